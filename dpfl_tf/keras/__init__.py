"""DP-SGD for Keras 3 (TensorFlow backend): `DPModel` + a DP optimizer."""

from dpfl_tf.keras.callbacks import PrivacyCallback
from dpfl_tf.keras.checkpoint import DPCheckpoint
from dpfl_tf.keras.custom_loop import dp_gradients
from dpfl_tf.keras.lot import LotStep
from dpfl_tf.keras.mixing import BatchMixingLayerError, BatchMixingLossError
from dpfl_tf.keras.model import DPModel
from dpfl_tf.keras.optimizers import DPSGD, DPAdam, DPOptimizer
from dpfl_tf.keras.per_example import PerExampleGradients
from dpfl_tf.keras.sampling import LotSampler
from dpfl_tf.keras.tensorboard import tensorboard_callback

__all__ = [
    "BatchMixingLayerError",
    "BatchMixingLossError",
    "DPAdam",
    "DPCheckpoint",
    "DPModel",
    "DPOptimizer",
    "DPSGD",
    "LotSampler",
    "LotStep",
    "PerExampleGradients",
    "PrivacyCallback",
    "dp_gradients",
    "tensorboard_callback",
]
