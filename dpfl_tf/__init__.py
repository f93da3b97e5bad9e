"""dpfl_tf: differentially private deep learning and federated learning for
TensorFlow 2 / Keras 3.

The privacy core lives in `dpfl_tf.privacy` (events, accountants, ledger) and
`dpfl_tf.sanitizer` (clip + noise, shared by every mechanism).  TensorFlow is
only imported by the modules that need it, so `dpfl_tf.privacy` and the
`dpfl-tf privacy` command start fast.
"""

__version__ = "0.2.0"

from typing import TYPE_CHECKING

from dpfl_tf._lazy import lazy_exports as _lazy_exports

#: public names and the module each lives in; imported on first use (the privacy
#: core imports dp-accounting, about a second; the sanitizer TensorFlow, seconds),
#: so a process that needs only a small part (a Flower ClientApp started for every
#: message, ``dpfl-tf privacy``) does not pay for the rest
_EXPORTS = {
    "AccountantKind": "dpfl_tf.privacy",
    "PrivacyBudget": "dpfl_tf.privacy",
    "PrivacyLedger": "dpfl_tf.privacy",
    "SamplingMethod": "dpfl_tf.privacy",
    "calibrate_noise_multiplier": "dpfl_tf.privacy",
    "compute_delta": "dpfl_tf.privacy",
    "compute_epsilon": "dpfl_tf.privacy",
    "dp_sgd_event": "dpfl_tf.privacy",
    "GaussianSanitizer": "dpfl_tf.sanitizer",
}

__all__ = [
    "AccountantKind",
    "PrivacyBudget",
    "PrivacyLedger",
    "SamplingMethod",
    "calibrate_noise_multiplier",
    "compute_delta",
    "compute_epsilon",
    "dp_sgd_event",
    "GaussianSanitizer",
]

if TYPE_CHECKING:  # what static readers (type checkers, the API reference) see
    from dpfl_tf.privacy import (
        AccountantKind,
        PrivacyBudget,
        PrivacyLedger,
        SamplingMethod,
        calibrate_noise_multiplier,
        compute_delta,
        compute_epsilon,
        dp_sgd_event,
    )
    from dpfl_tf.sanitizer import GaussianSanitizer

__getattr__, __dir__ = _lazy_exports(__name__, _EXPORTS, globals())
