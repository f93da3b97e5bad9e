"""The privacy package's named choices -- the accountants, the ways a lot is sampled --
in a module that imports neither dp-accounting nor TensorFlow: the command line
lists them in its parsers, and ``dpfl-tf --help`` starts in well under a second.
`dpfl_tf.privacy.accountants` re-exports `AccountantKind`, `dpfl_tf.privacy.events`
`SamplingMethod`."""

from __future__ import annotations

from dpfl_tf._validation import ChoiceEnum

__all__ = ["AccountantKind", "SamplingMethod"]


class AccountantKind(ChoiceEnum):
    """The accountant that turns the ledger's events into epsilon
    (`dpfl_tf.privacy.accountants`): the paper's moments accountant, Renyi DP, privacy
    loss distributions (dp-accounting's), or the strong-composition baseline."""

    __argument__ = "accountant"
    MOMENTS = "moments"
    RDP = "rdp"
    PLD = "pld"
    STRONG = "strong"


class SamplingMethod(ChoiceEnum):
    """How the records that enter one noised sum were chosen."""

    __argument__ = "sampling"
    POISSON = "poisson"
    FIXED_SIZE = "fixed_size"
    SHUFFLE = "shuffle"
    FULL_BATCH = "full_batch"
    #: the same fixed order every epoch (a source read in order); correlated noise only
    IN_ORDER = "in_order"
    #: units in b groups, group t mod b Poisson-sampled at step t; correlated noise only
    CYCLIC_POISSON = "cyclic_poisson"
