"""One front end over four accountants, all reading the same `DpEvent`s.

* ``moments`` -- the paper's moments accountant (`dpfl_tf.privacy.moments`).
* ``rdp``     -- `dp_accounting.rdp.RdpAccountant` (Renyi DP, Mironov 2017).
* ``pld``     -- `dp_accounting.pld.PLDAccountant` (privacy loss distributions,
  numerically tight), each Gaussian's distribution built once per process.
* ``strong``  -- the strong-composition baseline (`dpfl_tf.privacy.strong`).
"""

from __future__ import annotations

import functools
import math

import attr
import dp_accounting
import numpy as np
from dp_accounting import dp_event as _dp_event
from dp_accounting import pld as _pld
from dp_accounting import rdp as _rdp

from dpfl_tf._validation import check_number
from dpfl_tf.privacy import distributed as _distributed
from dpfl_tf.privacy._gaussian_accountant import walk_composition
from dpfl_tf.privacy.choices import AccountantKind
from dpfl_tf.privacy.events import (
    describe_event,
    event_to_json,
    iter_events,
    joint_noise_multiplier,
    neighboring_relation_of,
)
from dpfl_tf.privacy.moments import MomentsAccountant
from dpfl_tf.privacy.strong import StrongCompositionAccountant

__all__ = [
    "AccountantKind",
    "make_accountant",
    "compute_epsilon",
    "compute_delta",
    "epsilon_by_accountant",
    "rdp_curve",
    "refuse_repeat_and_select",
]


def make_accountant(
    kind: AccountantKind | str = AccountantKind.MOMENTS,
    *,
    neighboring_relation=dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE,
    pld_discretization: float = 1e-4,
) -> dp_accounting.PrivacyAccountant:
    """A fresh, empty accountant of the given kind."""
    kind = AccountantKind.parse(kind)
    if kind is AccountantKind.MOMENTS:
        return MomentsAccountant(neighboring_relation=neighboring_relation)
    if kind is AccountantKind.RDP:
        return CachedRdpAccountant(neighboring_relation=neighboring_relation)
    if kind is AccountantKind.PLD:
        return CachedPldAccountant(
            neighboring_relation=neighboring_relation,
            value_discretization_interval=pld_discretization,
        )
    return StrongCompositionAccountant(neighboring_relation=neighboring_relation)


class _EventKey:
    """A cache key for an event attrs cannot hash (a ComposedDpEvent holds a list):
    equal events have equal JSON."""

    def __init__(self, event: dp_accounting.DpEvent):
        self.event = event
        self.text = event_to_json(event)

    def __hash__(self):
        return hash(self.text)

    def __eq__(self, other):
        return isinstance(other, _EventKey) and self.text == other.text


def _cache_key(event: dp_accounting.DpEvent):
    """`event` itself, or its `_EventKey`; None if neither can key a cache (a list
    holding numpy numbers: the caller computes without the cache)."""
    try:
        hash(event)
    except TypeError:  # e.g. a sampled [Gaussian + Gaussian] (joint_gaussian_step_event)
        try:
            return _EventKey(event)
        except TypeError:  # JSON cannot write numpy numbers
            return None
    return event


@functools.lru_cache(maxsize=256)
def _rdp_of_leaf(leaf, relation) -> tuple[tuple, np.ndarray]:
    """(orders, RDP curve) of one non-composite event (or its `_EventKey`), from
    dp_accounting's RdpAccountant."""
    acc = _rdp.RdpAccountant(neighboring_relation=relation)
    acc.compose(leaf.event if isinstance(leaf, _EventKey) else leaf)
    return tuple(acc._orders), np.asarray(acc._rdp, dtype=float)


class CachedRdpAccountant(_rdp.RdpAccountant):
    """dp_accounting's RDP accountant, with each distinct leaf event's RDP curve
    computed once per process, that also reads the distributed DP events
    (`dpfl_tf.privacy.distributed`: their papers' bounds, sampled without
    replacement by Wang et al.'s Theorem 9).  RDP composes additively, so an event tree
    costs sum(count x curve(leaf)): logging epsilon after every lot of a long
    run no longer recomputes the sampled-Gaussian curve (tens of ms) each time.
    Same numbers as `dp_accounting.rdp.RdpAccountant` (tested)."""

    def _maybe_compose(self, event, count, do_compose):
        return walk_composition(event, count, lambda e, n: self._compose_leaf(e, n, do_compose))

    def _compose_leaf(self, event, count, do_compose):
        if _distributed.is_distributed_event(event):  # distributed DP: its own bounds
            if do_compose and count > 0:
                self._rdp = self._rdp + count * _distributed.rdp_curve(
                    event, tuple(float(a) for a in self._orders)
                )
            return None
        err = super()._maybe_compose(event, count, do_compose=False)  # support check only
        if err is None and do_compose and count > 0:
            key = _cache_key(event)
            if key is None:
                return super()._maybe_compose(event, count, do_compose)
            orders, curve = _rdp_of_leaf(key, self._neighboring_relation)
            if orders != tuple(self._orders):  # other orders: the uncached path
                return super()._maybe_compose(event, count, do_compose)
            self._rdp = self._rdp + count * curve
        return err


@functools.lru_cache(maxsize=32)
def _gaussian_pld(sigma, sampling_prob, relation, discretization) -> _pld.PrivacyLossDistribution:
    """The PLD of one Gaussian (``sampling_prob`` None) or Poisson-sampled Gaussian
    release, built by dp_accounting exactly as its PLDAccountant builds it."""
    kwargs = {} if sampling_prob is None else {"sampling_prob": sampling_prob}
    return _pld.privacy_loss_distribution.from_gaussian_mechanism(
        standard_deviation=sigma,
        value_discretization_interval=discretization,
        neighboring_relation=relation,
        **kwargs,
    )


@functools.lru_cache(maxsize=8)  # a long run's composition holds up to ~20 MB
def _sampled_gaussian_pld(sigma, q, count, relation, discretization):
    """`count` self-compositions of the Poisson-sampled Gaussian's PLD."""
    return _gaussian_pld(sigma, q, relation, discretization).self_compose(count)


class CachedPldAccountant(_pld.PLDAccountant):
    """dp_accounting's PLD accountant, with the privacy loss distribution of each
    (Poisson-sampled) Gaussian and its self-compositions built once per process.

    Building a sampled Gaussian's PLD (the pessimistic discretisation of its
    tails) takes 0.1-1 s; a search for the number of steps a budget allows
    (`dpfl_tf.privacy.max_steps`) composes the same step dozens of times, and
    planning a run searches twice.  The same calls in the same order as
    `dp_accounting.pld.PLDAccountant`, on the same arguments: the same numbers
    (tested); other events take its own path."""

    def _maybe_compose(self, event, count, do_compose):
        return walk_composition(event, count, lambda e, n: self._compose_leaf(e, n, do_compose))

    def _compose_leaf(self, event, count, do_compose):
        leaf = self._cached_leaf(event, count) if do_compose and count >= 1 else None
        if leaf is None:
            return super()._maybe_compose(event, count, do_compose)
        self._pld = self._pld.compose(leaf)
        return None

    def _cached_leaf(self, event, count):
        try:
            hash(event)  # a 0-d numpy array as sigma or q cannot key the cache
        except TypeError:
            return None
        args = (self.neighboring_relation, self._value_discretization_interval)
        if isinstance(event, _dp_event.GaussianDpEvent) and event.noise_multiplier > 0:
            return _gaussian_pld(event.noise_multiplier / math.sqrt(count), None, *args)
        if (
            isinstance(event, _dp_event.PoissonSampledDpEvent)
            and isinstance(event.event, _dp_event.GaussianDpEvent)
            and event.sampling_probability > 0
            and event.event.noise_multiplier > 0
        ):
            sigma, q = event.event.noise_multiplier, event.sampling_probability
            return _sampled_gaussian_pld(sigma, q, count, *args)
        return None


def _accountant_relation(event: dp_accounting.DpEvent) -> dp_accounting.NeighboringRelation:
    """The relation to build a dp_accounting accountant with for `event`.

    REPLACE_ONE only if the event holds fixed-size sampling (RDP's Wang-Balle-
    Kasiviswanathan bound needs it; its multiplier is std / sensitivity).  Every
    other event here has multipliers normalised by its own relation's
    sensitivity (``ReplaceOneGaussianDpEvent``: std / 2C), which is what
    dp_accounting reads under ADD_OR_REMOVE_ONE; its PLD accountant under
    REPLACE_ONE would double a Gaussian's sensitivity a second time.
    """
    if any(isinstance(e, _dp_event.SampledWithoutReplacementDpEvent) for e in iter_events(event)):
        return dp_accounting.NeighboringRelation.REPLACE_ONE
    return dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE


def _gaussian_tree_multiplier(event: dp_accounting.DpEvent) -> float | None:
    """The joint multiplier of a composition tree of Gaussian events (None if the
    tree holds anything else): SelfComposed(G(s), n) counts as n releases."""
    if isinstance(event, _dp_event.GaussianDpEvent):
        return float(event.noise_multiplier)
    if isinstance(event, _dp_event.SelfComposedDpEvent):
        inner = _gaussian_tree_multiplier(event.event)
        if inner is None or event.count < 1:
            return None
        return inner / math.sqrt(event.count)  # joint_noise_multiplier of `count` copies
    if isinstance(event, _dp_event.ComposedDpEvent) and event.events:
        parts = [_gaussian_tree_multiplier(e) for e in event.events]
        return None if any(p is None for p in parts) else joint_noise_multiplier(parts)
    return None


def _one_gaussian_per_sample(event: dp_accounting.DpEvent) -> dp_accounting.DpEvent:
    """Rewrites every sampled event whose inner event is a composition of Gaussians
    (several releases of one sample, `dpfl_tf.privacy.events.joint_gaussian_step_event`)
    as the same sampling of ONE Gaussian with the joint multiplier -- the
    interpretation dp-accounting's RDP accountant applies itself -- for the
    accountants that read only a sampled single Gaussian (moments, strong, PLD)."""
    if isinstance(event, _dp_event.SelfComposedDpEvent):
        return _dp_event.SelfComposedDpEvent(_one_gaussian_per_sample(event.event), event.count)
    if isinstance(event, _dp_event.ComposedDpEvent):
        return _dp_event.ComposedDpEvent([_one_gaussian_per_sample(e) for e in event.events])
    if isinstance(
        event, (_dp_event.PoissonSampledDpEvent, _dp_event.SampledWithoutReplacementDpEvent)
    ) and not isinstance(event.event, _dp_event.GaussianDpEvent):
        sigma = _gaussian_tree_multiplier(event.event)
        if sigma is not None:
            return attr.evolve(event, event=dp_accounting.GaussianDpEvent(sigma))
    return event


def _accountant_for(event: dp_accounting.DpEvent, kind) -> dp_accounting.PrivacyAccountant:
    neighboring_relation_of(event)  # refuses add/remove-one mixed with replace-one
    if AccountantKind.parse(kind) is not AccountantKind.RDP:
        refuse_repeat_and_select(event, kind)
        event = _one_gaussian_per_sample(event)
    accountant = make_accountant(kind, neighboring_relation=_accountant_relation(event))
    if not accountant.supports(event):
        raise ValueError(
            f"the {AccountantKind.parse(kind).value!r} accountant cannot interpret "
            f"{describe_event(event)}; fixed-size sampling without replacement and the "
            "distributed DP events are interpreted by 'rdp' only"
        )
    return accountant.compose(event)


def refuse_repeat_and_select(event: dp_accounting.DpEvent, kind) -> None:
    """ValueError if `event` holds a `RepeatAndSelectDpEvent` (the best of a random
    number of runs, Papernot & Steinke 2022) and `kind` is not 'rdp': their
    bound is a bound on Renyi DP, which only the RDP accountant composes (the
    moments accountant's log-moments are RDP at integer orders 2..33 only, and
    PLD and strong composition read no RDP curve)."""
    kind = AccountantKind.parse(kind)
    if kind is AccountantKind.RDP:
        return
    if any(isinstance(e, _dp_event.RepeatAndSelectDpEvent) for e in iter_events(event)):
        raise ValueError(
            f"accountant {kind.value!r} cannot account {describe_event(event)}: the best of "
            "a random number of runs (RepeatAndSelectDpEvent, Papernot & Steinke 2022) is "
            "bounded in Renyi DP only; use accountant='rdp'"
        )


def rdp_curve(event: dp_accounting.DpEvent) -> tuple[np.ndarray, np.ndarray]:
    """(orders, RDP epsilons) of `event` from dp_accounting's RDP accountant
    (its default orders), under the relation the event is stated in."""
    accountant = _accountant_for(event, AccountantKind.RDP)
    return np.asarray(accountant._orders, dtype=float), np.asarray(accountant._rdp, dtype=float)


def compute_epsilon(
    event: dp_accounting.DpEvent,
    delta: float,
    accountant: AccountantKind | str = AccountantKind.MOMENTS,
) -> float:
    """eps such that `event` is (eps, delta)-DP according to `accountant` (each
    distinct question answered once per process: a budget is searched, planned
    and checked with the same events)."""
    delta = check_number("delta", delta, low=0.0, high=1.0, low_open=True, high_open=True)
    kind, key = AccountantKind.parse(accountant), _cache_key(event)
    return _epsilon_of(event, delta, kind) if key is None else _epsilon(key, delta, kind)


@functools.lru_cache(maxsize=1024)
def _epsilon(key, delta: float, kind: AccountantKind) -> float:
    return _epsilon_of(key.event if isinstance(key, _EventKey) else key, delta, kind)


def _epsilon_of(event, delta: float, kind: AccountantKind) -> float:
    eps = _accountant_for(event, kind).get_epsilon(delta)
    return math.inf if eps is None or math.isnan(eps) else float(eps)


def epsilon_by_accountant(event: dp_accounting.DpEvent, delta: float) -> dict:
    """{accountant: eps} for every accountant that can analyse `event` (those
    that cannot are left out): what a refusal quotes as the cost of a release."""
    out = {}
    for kind in AccountantKind:
        try:
            out[kind] = compute_epsilon(event, delta, kind)
        except Exception:  # this accountant cannot analyse the event
            continue
    return out


def compute_delta(
    event: dp_accounting.DpEvent,
    epsilon: float,
    accountant: AccountantKind | str = AccountantKind.MOMENTS,
) -> float:
    """delta such that `event` is (epsilon, delta)-DP according to `accountant`."""
    epsilon = check_number("epsilon", epsilon, low=0.0)
    return float(_accountant_for(event, accountant).get_delta(epsilon))
