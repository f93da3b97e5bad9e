"""dpfl_tf: differentially private deep learning and federated learning for
TensorFlow 2 / Keras 3.

The privacy core lives in `dpfl_tf.privacy` (events, accountants, ledger) and
`dpfl_tf.sanitizer` (clip + noise, shared by every mechanism).  TensorFlow is
only imported by the modules that need it, so `dpfl_tf.privacy` and the
`dpfl-tf privacy` command start fast.
"""

__version__ = "0.2.0"

import importlib
from typing import TYPE_CHECKING

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


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    if name.startswith("_"):  # never runs dpfl_tf.__main__ (the CLI) on a hasattr
        raise AttributeError(f"module 'dpfl_tf' has no attribute {name!r}")
    try:  # a public submodule: ``import dpfl_tf; dpfl_tf.privacy``
        return importlib.import_module(f"dpfl_tf.{name}")
    except ModuleNotFoundError as exc:
        if exc.name != f"dpfl_tf.{name}":
            raise
    raise AttributeError(f"module 'dpfl_tf' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))
