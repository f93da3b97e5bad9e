"""Privacy accounting: events, the moments accountant, strong composition,
the front end over moments / rdp / pld / strong, calibration and the ledger.

The names below are imported on first use: `dpfl_tf.privacy.choices` (the
accountants' and sampling methods' names, which the command line's parsers list)
is read without importing dp-accounting (one to two seconds, with SciPy)."""

from typing import TYPE_CHECKING

from dpfl_tf._lazy import lazy_exports as _lazy_exports

#: public names and the module each lives in
_EXPORTS = {
    "AccountantKind": "dpfl_tf.privacy.choices",
    "compute_delta": "dpfl_tf.privacy.accountants",
    "compute_epsilon": "dpfl_tf.privacy.accountants",
    "make_accountant": "dpfl_tf.privacy.accountants",
    "calibrate_noise_multiplier": "dpfl_tf.privacy.calibration",
    "max_steps": "dpfl_tf.privacy.calibration",
    "NeighboringRelation": "dpfl_tf.privacy.events",
    "ReplaceOneGaussianDpEvent": "dpfl_tf.privacy.events",
    "SamplingMethod": "dpfl_tf.privacy.choices",
    "describe_event": "dpfl_tf.privacy.events",
    "dp_sgd_event": "dpfl_tf.privacy.events",
    "event_from_dict": "dpfl_tf.privacy.events",
    "event_from_json": "dpfl_tf.privacy.events",
    "event_to_dict": "dpfl_tf.privacy.events",
    "event_to_json": "dpfl_tf.privacy.events",
    "gaussian_step_event": "dpfl_tf.privacy.events",
    "neighboring_relation_of": "dpfl_tf.privacy.events",
    "shuffle_epoch_event": "dpfl_tf.privacy.events",
    "to_replace_one": "dpfl_tf.privacy.events",
    "BudgetExceededError": "dpfl_tf.privacy.ledger",
    "PrivacyBudget": "dpfl_tf.privacy.ledger",
    "PrivacyLedger": "dpfl_tf.privacy.ledger",
    "MomentsAccountant": "dpfl_tf.privacy.moments",
    "log_moments": "dpfl_tf.privacy.moments",
    "StrongCompositionAccountant": "dpfl_tf.privacy.strong",
}

if TYPE_CHECKING:  # what static readers (type checkers, the API reference) see
    from dpfl_tf.privacy.accountants import (
        compute_delta,
        compute_epsilon,
        make_accountant,
    )
    from dpfl_tf.privacy.calibration import calibrate_noise_multiplier, max_steps
    from dpfl_tf.privacy.choices import AccountantKind, SamplingMethod
    from dpfl_tf.privacy.events import (
        NeighboringRelation,
        ReplaceOneGaussianDpEvent,
        describe_event,
        dp_sgd_event,
        event_from_dict,
        event_from_json,
        event_to_dict,
        event_to_json,
        gaussian_step_event,
        neighboring_relation_of,
        shuffle_epoch_event,
        to_replace_one,
    )
    from dpfl_tf.privacy.ledger import BudgetExceededError, PrivacyBudget, PrivacyLedger
    from dpfl_tf.privacy.moments import MomentsAccountant, log_moments
    from dpfl_tf.privacy.strong import StrongCompositionAccountant


__all__ = [
    "AccountantKind",
    "BudgetExceededError",
    "MomentsAccountant",
    "NeighboringRelation",
    "PrivacyBudget",
    "PrivacyLedger",
    "ReplaceOneGaussianDpEvent",
    "SamplingMethod",
    "StrongCompositionAccountant",
    "calibrate_noise_multiplier",
    "compute_delta",
    "compute_epsilon",
    "describe_event",
    "dp_sgd_event",
    "event_from_dict",
    "event_from_json",
    "event_to_dict",
    "event_to_json",
    "gaussian_step_event",
    "log_moments",
    "make_accountant",
    "max_steps",
    "neighboring_relation_of",
    "shuffle_epoch_event",
    "to_replace_one",
]

__getattr__, __dir__ = _lazy_exports(__name__, _EXPORTS, globals())
