"""Private hyperparameter search (Papernot & Steinke 2022): the best of a
random number of DP trials, in one ledger.

* `TrialCount` -- the distribution of the number of trials;
* `ValidationScore` -- a trial's score, released with Gaussian noise;
* `private_search` -- random search without Keras Tuner;
* `dpfl_tf.tuning.keras_tuner.DPTuner` -- the same on Keras Tuner
  (``pip install dpfl-tf[tune]``);
* `calibrate_search` -- the training noise for a target epsilon of the search.
"""

from dpfl_tf.tuning.scores import ValidationScore, top1_correct
from dpfl_tf.tuning.search import (
    PrivateSelection,
    SearchPrivacyError,
    SearchResult,
    Trial,
    calibrate_search,
    private_search,
)
from dpfl_tf.tuning.trials import TrialCount, search_event

__all__ = [
    "PrivateSelection",
    "SearchPrivacyError",
    "SearchResult",
    "Trial",
    "TrialCount",
    "ValidationScore",
    "calibrate_search",
    "private_search",
    "search_event",
    "top1_correct",
]
