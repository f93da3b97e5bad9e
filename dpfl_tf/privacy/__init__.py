"""Privacy accounting: events, the moments accountant, strong composition,
the front end over moments / rdp / pld / strong, calibration and the ledger."""

from dpfl_tf.privacy.accountants import (
    AccountantKind,
    compute_delta,
    compute_epsilon,
    make_accountant,
)
from dpfl_tf.privacy.calibration import calibrate_noise_multiplier, max_steps
from dpfl_tf.privacy.events import (
    NeighboringRelation,
    ReplaceOneGaussianDpEvent,
    SamplingMethod,
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
