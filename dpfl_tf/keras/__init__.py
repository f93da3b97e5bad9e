"""DP-SGD for Keras 3 (TensorFlow backend): `DPModel` + a DP optimizer."""

from dpfl_tf.keras.callbacks import PrivacyCallback
from dpfl_tf.keras.checkpoint import DPCheckpoint
from dpfl_tf.keras.model import DPModel
from dpfl_tf.keras.optimizers import DPAdam, DPOptimizer, DPSGD
from dpfl_tf.keras.per_example import BatchMixingLayerError, PerExampleGradients
from dpfl_tf.keras.sampling import LotSampler
from dpfl_tf.keras.tensorboard import tensorboard_callback

__all__ = ["BatchMixingLayerError", "DPAdam", "DPCheckpoint", "DPModel", "DPOptimizer", "DPSGD",
           "LotSampler", "PerExampleGradients", "PrivacyCallback",
           "tensorboard_callback"]
