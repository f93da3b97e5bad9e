"""dpfl_tf: differentially private deep learning and federated learning for
TensorFlow 2 / Keras 3.

The privacy core lives in `dpfl_tf.privacy` (events, accountants, ledger) and
`dpfl_tf.sanitizer` (clip + noise, shared by every mechanism).  TensorFlow is
only imported by the modules that need it, so `dpfl_tf.privacy` and the
`dpfl-tf privacy` command start fast.
"""

__version__ = "0.2.0"

from dpfl_tf.privacy import (  # noqa: E402
    AccountantKind,
    PrivacyBudget,
    PrivacyLedger,
    SamplingMethod,
    calibrate_noise_multiplier,
    compute_delta,
    compute_epsilon,
    dp_sgd_event,
)

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


def __getattr__(name):  # lazy: importing TensorFlow takes seconds
    if name == "GaussianSanitizer":
        from dpfl_tf.sanitizer import GaussianSanitizer

        return GaussianSanitizer
    raise AttributeError(f"module 'dpfl_tf' has no attribute {name!r}")
