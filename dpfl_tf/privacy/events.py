"""Privacy events: the one description of what a mechanism did.

Every mechanism in dpfl_tf (a DP-SGD lot, a DP-PCA covariance release, a
federated round) returns a `dp_accounting.DpEvent`. Accountants only interpret
events; no privacy formula is written next to a mechanism.

Conventions
-----------
* A Gaussian event's ``noise_multiplier`` is the noise standard deviation
  divided by the L2 sensitivity of the released sum under the neighbouring
  relation that goes with the sampling scheme (below).
* ``SamplingMethod.POISSON``: every record joins a lot independently with
  probability q (Abadi et al. 2016, section 3.1).  Neighbouring datasets differ
  by adding or removing one record, so the sensitivity of a sum of records
  clipped to C is C and the event is
  ``PoissonSampledDpEvent(q, GaussianDpEvent(sigma))``.
* ``SamplingMethod.FIXED_SIZE``: a lot is L records drawn uniformly without
  replacement from N.  Its analysis (Wang, Balle, Kasiviswanathan 2019) uses
  the replace-one relation, under which a clipped sum moves by up to 2C, so the
  event is ``SampledWithoutReplacementDpEvent(N, L, GaussianDpEvent(sigma/2))``.
* ``SamplingMethod.SHUFFLE``: each epoch a random permutation is cut into
  disjoint lots.  No amplification is claimed: under replace-one the changed
  record sits in exactly one lot per epoch, so an epoch is one Gaussian
  mechanism with sensitivity 2C, ``ReplaceOneGaussianDpEvent(sigma/2)`` per
  epoch (a `GaussianDpEvent` whose type says "replace-one").
* ``SamplingMethod.FULL_BATCH``: every record in every step,
  ``GaussianDpEvent(sigma)`` per step (add/remove relation).

Neighbouring relations are never mixed
--------------------------------------
An (eps, delta) guarantee is stated for one relation.  Composing an
add/remove-one event with a replace-one event gives a number that bounds
neither (e.g. DP-PCA, add/remove, then shuffled DP-SGD, replace-one), so
`neighboring_relation_of` -- which every accountant of `dpfl_tf.privacy`
consults -- refuses such a composition, and so does the `PrivacyLedger`.  An
event's relation is read from the event: ``SampledWithoutReplacementDpEvent``
and ``ReplaceOneGaussianDpEvent`` are replace-one; no-op and non-private
events have none; every other event is add/remove-one.

Conversion is possible in one direction only, and is explicit
(`to_replace_one`): replacing a record is removing it and adding another, so
a sum of records clipped to C moves by up to 2C, and an add/remove
``GaussianDpEvent(sigma)`` (sensitivity C) is the replace-one mechanism
``ReplaceOneGaussianDpEvent(sigma/2)``.  A Poisson-sampled event with q < 1 has
no such one-event form for the accountants here.

Noise multipliers are normalised by the sensitivity of the event's own
relation (std / 2C under replace-one).  `dp_accounting`'s PLD accountant,
built with ``REPLACE_ONE``, would double a Gaussian's sensitivity a second
time, so the accountants of `dpfl_tf.privacy.accountants` are built with
``REPLACE_ONE`` only where dp_accounting requires it (fixed-size sampling,
RDP's Wang-Balle-Kasiviswanathan bound, whose multiplier is std / sensitivity).

Several releases from one sample
--------------------------------
When one sampled lot feeds several independently noised sums (DP adaptive
clipping releases the clipped updates and a count of clients under the clip
bound, Andrew et al. 2021), the event is ONE sampled event over their
composition, ``PoissonSampledDpEvent(q, ComposedDpEvent([GaussianDpEvent(s_1),
GaussianDpEvent(s_2)]))`` (`joint_gaussian_step_event`): the releases share
the sample, so two separately sampled events would under-count.  Gaussian
releases of the same records with multipliers s_i are together one Gaussian
mechanism with multiplier ``(sum_i s_i^-2)^(-1/2)`` (`joint_noise_multiplier`;
Mironov, Talwar, Zhang 2019, "Renyi DP of the sampled Gaussian mechanism",
section 3; Andrew et al. 2021, Theorem 1), which is how dp-accounting's RDP
accountant reads such an event and how `dpfl_tf.privacy.accountants` rewrites
it for the accountants that read only a sampled single Gaussian.

Best of a random number of runs
-------------------------------
A hyperparameter search that trains K times, K drawn from a distribution
independent of the data, and releases only the best run is
``RepeatAndSelectDpEvent(run, mean, shape)`` (Papernot & Steinke 2022,
"Hyperparameter tuning with Renyi differential privacy", Theorems 2 and 6):
its relation is the run's, and its bound is one on Renyi DP, so only the
``rdp`` accountant interprets it (`dpfl_tf.privacy.accountants` refuses it
for the others, naming the event).
"""

from __future__ import annotations

import json
import math
from typing import Any

import attr
import dp_accounting
from dp_accounting import dp_event as _dp_event

from dpfl_tf._validation import check_count as _check_count
from dpfl_tf._validation import check_number as _check_number
from dpfl_tf.privacy.choices import SamplingMethod

__all__ = [
    "SamplingMethod",
    "NeighboringRelation",
    "gaussian_step_event",
    "joint_gaussian_step_event",
    "joint_noise_multiplier",
    "complementary_noise_multiplier",
    "dp_sgd_event",
    "shuffle_epoch_event",
    "ReplaceOneGaussianDpEvent",
    "DistributedDiscreteGaussianDpEvent",
    "DistributedSkellamDpEvent",
    "clipped_upload_event",
    "REPLACE_ONE_UPDATE",
    "neighboring_relation_of",
    "relations_of",
    "parse_relation",
    "relation_name",
    "to_replace_one",
    "event_to_dict",
    "event_from_dict",
    "event_to_json",
    "event_from_json",
    "describe_event",
]

NeighboringRelation = dp_accounting.NeighboringRelation

_RELATION_NAMES = {
    NeighboringRelation.ADD_OR_REMOVE_ONE: "add/remove-one",
    NeighboringRelation.REPLACE_ONE: "replace-one",
}


def relation_name(relation: NeighboringRelation) -> str:
    """'add/remove-one' or 'replace-one' (for messages and descriptions)."""
    return _RELATION_NAMES.get(relation, str(relation))


def parse_relation(
    relation: NeighboringRelation | str, argument: str = "relation"
) -> NeighboringRelation:
    """A `NeighboringRelation` from itself or its name ('add_or_remove_one', 'replace_one')."""
    allowed = tuple(_RELATION_NAMES)
    if isinstance(relation, NeighboringRelation) and relation in allowed:
        return relation
    if isinstance(relation, str):
        key = relation.strip().upper().replace("-", "_").replace("/", "_OR_")
        if key in NeighboringRelation.__members__ and NeighboringRelation[key] in allowed:
            return NeighboringRelation[key]
    raise ValueError(
        f"{argument} must be one of 'add_or_remove_one', 'replace_one', got {relation!r}"
    )


@attr.s(frozen=True, slots=True, auto_attribs=True)
class ReplaceOneGaussianDpEvent(dp_accounting.GaussianDpEvent):
    """A Gaussian mechanism stated under the replace-one relation.

    ``noise_multiplier`` = noise std / (2C): replacing one record of a sum of
    records clipped to C moves the sum by up to 2C.  Numerically it is the
    `GaussianDpEvent` it subclasses (every dp_accounting accountant reads it as
    one); the type only records which neighbouring relation the guarantee is
    about, so that it is never composed with add/remove-one events.
    """


def _positive(instance, attribute, value):
    """attrs validator: a number > 0 (the error names the field)."""
    _check_number(attribute.name, value, low=0.0, low_open=True)


def _whole(instance, attribute, value):
    """attrs validator: a whole number >= 1 (the error names the field)."""
    _check_count(attribute.name, value, minimum=1)


@attr.s(frozen=True, slots=True, auto_attribs=True)
class DistributedDiscreteGaussianDpEvent(dp_accounting.DpEvent):
    """One release of a sum of integer vectors, each carrying its own discrete
    Gaussian noise share (the distributed discrete Gaussian; Kairouz, Liu,
    Steinke 2021), stated under the replace-one relation.

    In the integer domain the clients' vectors live in: at least ``num_shares``
    independent N_Z(0, share_variance)^d shares reach the released sum (the
    fewest the secure aggregation lets a round finish with), and replacing one
    client moves the sum of the vectors by at most ``l2_sensitivity`` in L2 and
    ``l1_sensitivity`` in L1; ``dimension`` = d.  The sum of the shares is not a
    discrete Gaussian: `dpfl_tf.privacy.distributed` interprets this event with
    the paper's bound for it (Theorem 1).  Read by the 'rdp' accountant only.
    """

    share_variance: float = attr.ib(validator=_positive)
    num_shares: int = attr.ib(validator=_whole)
    l2_sensitivity: float = attr.ib(validator=_positive)
    l1_sensitivity: float = attr.ib(validator=_positive)
    dimension: int = attr.ib(validator=_whole)


@attr.s(frozen=True, slots=True, auto_attribs=True)
class DistributedSkellamDpEvent(dp_accounting.DpEvent):
    """One release of a sum of integer vectors, each carrying a Skellam noise share
    Sk(share_variance)^d (the distributed Skellam mechanism; Agarwal, Kairouz,
    Liu 2021), stated under the replace-one relation.

    At least ``num_shares`` shares reach the sum, whose noise is then Skellam with
    variance >= num_shares x share_variance (Skellam is closed under summation);
    ``l2_sensitivity`` / ``l1_sensitivity`` as for
    `DistributedDiscreteGaussianDpEvent`.  Read by the 'rdp' accountant only.
    """

    share_variance: float = attr.ib(validator=_positive)
    num_shares: int = attr.ib(validator=_whole)
    l2_sensitivity: float = attr.ib(validator=_positive)
    l1_sensitivity: float = attr.ib(validator=_positive)


#: The events of distributed DP (integer noise shares summed by secure aggregation).
DISTRIBUTED_EVENTS = (DistributedDiscreteGaussianDpEvent, DistributedSkellamDpEvent)


def gaussian_step_event(
    noise_multiplier: float,
    sampling: SamplingMethod | str = SamplingMethod.POISSON,
    *,
    sampling_rate: float | None = None,
    dataset_size: int | None = None,
    lot_size: int | None = None,
) -> dp_accounting.DpEvent:
    """The event of one noised sum of clipped records (one DP-SGD lot).

    Args:
      noise_multiplier: sigma, noise std / clip bound (>= 0).
      sampling: how the lot was drawn (see module docstring).
      sampling_rate: q for Poisson sampling (defaults to lot_size/dataset_size).
      dataset_size, lot_size: N and L, needed for fixed-size sampling.

    ``SHUFFLE`` has no per-lot event and raises: an epoch of shuffled lots is one
    Gaussian release, recorded once per epoch touched (`shuffle_epoch_event`,
    `dp_sgd_event(..., epochs=)`); a per-lot no-op would let a caller record a
    noised lot at no cost.
    """
    sigma = _check_number("noise_multiplier", noise_multiplier, low=0.0)
    return _sampled([sigma], sampling, sampling_rate, dataset_size, lot_size)


def joint_gaussian_step_event(
    noise_multipliers,
    sampling: SamplingMethod | str = SamplingMethod.POISSON,
    *,
    sampling_rate: float | None = None,
    dataset_size: int | None = None,
    lot_size: int | None = None,
) -> dp_accounting.DpEvent:
    """One sampled lot released as several independently noised sums (module
    docstring): the sampling event over ``ComposedDpEvent`` of one Gaussian per
    release, each multiplier being noise std / add-remove sensitivity of its
    sum (halved under fixed-size sampling's replace-one relation, as for
    `gaussian_step_event`)."""
    sigmas = [
        _check_number(f"noise_multipliers[{i}]", s, low=0.0)
        for i, s in enumerate(noise_multipliers)
    ]
    if not sigmas:
        raise ValueError("noise_multipliers must name at least one release, got []")
    return _sampled(sigmas, sampling, sampling_rate, dataset_size, lot_size)


def _sampled(sigmas, sampling, sampling_rate, dataset_size, lot_size) -> dp_accounting.DpEvent:
    method = SamplingMethod.parse(sampling)

    def inner(scale):
        gaussians = [dp_accounting.GaussianDpEvent(s * scale) for s in sigmas]
        return gaussians[0] if len(gaussians) == 1 else dp_accounting.ComposedDpEvent(gaussians)

    if method is SamplingMethod.FULL_BATCH:
        return inner(1.0)
    if method is SamplingMethod.POISSON:
        if sampling_rate is None:
            if dataset_size is None or lot_size is None:
                raise ValueError(
                    "Poisson sampling needs sampling_rate, or dataset_size and lot_size"
                )
            sampling_rate = _check_count("lot_size", lot_size, minimum=1) / _check_count(
                "dataset_size", dataset_size, minimum=1
            )
        q = _check_number("sampling_rate", sampling_rate, low=0.0, high=1.0, low_open=True)
        return dp_accounting.PoissonSampledDpEvent(q, inner(1.0))
    if method is SamplingMethod.FIXED_SIZE:
        n = _check_count("dataset_size", dataset_size, minimum=1)
        lot = _check_count("lot_size", lot_size, minimum=1)
        if lot > n:
            raise ValueError(f"lot_size must be <= dataset_size ({n}), got {lot}")
        return dp_accounting.SampledWithoutReplacementDpEvent(n, lot, inner(0.5))
    if method in (SamplingMethod.IN_ORDER, SamplingMethod.CYCLIC_POISSON):
        raise ValueError(
            f"sampling={method.value!r} has no per-lot event: it is accounted with a "
            "correlated-noise mechanism for the whole run (DPOptimizer(correlated_noise=...), "
            "dpfl_tf.privacy.matrix_factorization.MatrixMechanism.event)"
        )
    raise ValueError(
        "sampling='shuffle' has no per-lot event: an epoch of shuffled lots is one "
        "replace-one Gaussian, recorded once per epoch touched -- use "
        "shuffle_epoch_event(noise_multiplier) or dp_sgd_event(..., 'shuffle', epochs=E)"
    )


def joint_noise_multiplier(noise_multipliers) -> float:
    """(sum_i s_i^-2)^(-1/2): independent Gaussian releases of the same records,
    multipliers s_i, as one Gaussian mechanism (module docstring).  Any s_i = 0
    gives 0 (that release is exact)."""
    sigmas = [
        _check_number(f"noise_multipliers[{i}]", s, low=0.0)
        for i, s in enumerate(noise_multipliers)
    ]
    if not sigmas:
        raise ValueError("noise_multipliers must name at least one release, got []")
    if any(s == 0 for s in sigmas):
        return 0.0
    return sum(s**-2 for s in sigmas) ** -0.5


def complementary_noise_multiplier(joint: float, other: float) -> float:
    """The s with ``joint_noise_multiplier([s, other]) == joint``:
    s = (joint^-2 - other^-2)^(-1/2) (Andrew et al. 2021, section 3: the update
    noise that keeps the round's multiplier at `joint` beside a count release
    of multiplier `other`).  Needs other > joint > 0."""
    joint = _check_number("joint", joint, low=0.0, low_open=True)
    other = _check_number("other", other, low=0.0, low_open=True)
    if other <= joint:
        raise ValueError(
            f"the other release's noise multiplier ({other:g}) must exceed the "
            f"joint one ({joint:g}): alone it would already cost more"
        )
    return (joint**-2 - other**-2) ** -0.5


def shuffle_epoch_event(noise_multiplier: float) -> dp_accounting.DpEvent:
    """One epoch of shuffle-and-split lots: ``ReplaceOneGaussianDpEvent(sigma / 2)``.

    Under replace-one the changed record sits in exactly one lot of the epoch,
    whose clipped sum moves by up to 2C; the lot's noise has std sigma C, so the
    epoch is one Gaussian mechanism with multiplier sigma C / 2C = sigma / 2.
    """
    sigma = _check_number("noise_multiplier", noise_multiplier, low=0.0)
    return ReplaceOneGaussianDpEvent(sigma / 2.0)


#: The relation of one upload seen by its receiver (who knows who sent it).
REPLACE_ONE_UPDATE = "replace-one (one client's update replaced)"


def clipped_upload_event(noise_multiplier: float) -> dp_accounting.DpEvent:
    """One upload u = clip_S(Delta) + N(0, z^2 S^2 I), as seen by whoever receives it.

    The receiver (the server, under DP-FedAvg with client-side noise) sees the
    upload and knows who sent it, so adding or removing the client is not a
    neighbouring relation it can be blind to: the only one is replace-one,
    `REPLACE_ONE_UPDATE` -- the client's clipped update (norm <= S) replaced by
    any other, which moves u by up to 2S.  The upload is then the Gaussian
    mechanism with multiplier z S / 2S = z/2, ``GaussianDpEvent(z / 2)``
    (Dwork & Roth 2014, Theorem A.1 with L2 sensitivity 2S).  z = 0: the
    clipped update itself, ``NonPrivateDpEvent``.
    """
    z = _check_number("noise_multiplier", noise_multiplier, low=0.0)
    if z == 0:
        return dp_accounting.NonPrivateDpEvent()
    return ReplaceOneGaussianDpEvent(z / 2.0)


def dp_sgd_event(
    noise_multiplier: float,
    steps: int,
    sampling: SamplingMethod | str = SamplingMethod.POISSON,
    *,
    sampling_rate: float | None = None,
    dataset_size: int | None = None,
    lot_size: int | None = None,
    epochs: int | None = None,
) -> dp_accounting.DpEvent:
    """The event of `steps` DP-SGD lots (SHUFFLE counts `epochs` instead)."""
    method = SamplingMethod.parse(sampling)
    if method is SamplingMethod.SHUFFLE:
        if epochs is None:
            raise ValueError("shuffle sampling is accounted per epoch: pass epochs")
        return dp_accounting.SelfComposedDpEvent(
            shuffle_epoch_event(noise_multiplier), _check_count("epochs", epochs)
        )
    step = gaussian_step_event(
        noise_multiplier,
        method,
        sampling_rate=sampling_rate,
        dataset_size=dataset_size,
        lot_size=lot_size,
    )
    return dp_accounting.SelfComposedDpEvent(step, _check_count("steps", steps))


def iter_events(event: dp_accounting.DpEvent):
    """`event` and every event nested in it, depth first."""
    yield event
    if isinstance(
        event,
        (
            _dp_event.SelfComposedDpEvent,
            _dp_event.PoissonSampledDpEvent,
            _dp_event.SampledWithoutReplacementDpEvent,
            _dp_event.SampledWithReplacementDpEvent,
            _dp_event.RepeatAndSelectDpEvent,
        ),
    ):
        yield from iter_events(event.event)
    elif isinstance(event, _dp_event.ComposedDpEvent):
        for e in event.events:
            yield from iter_events(e)


def relations_of(event: dp_accounting.DpEvent) -> frozenset:
    """The neighbouring relations of the mechanisms in `event` (empty: none applies;
    two: a mixture, which no accountant here interprets)."""
    if isinstance(event, (_dp_event.NoOpDpEvent, _dp_event.NonPrivateDpEvent)):
        return frozenset()
    if isinstance(event, (_dp_event.SelfComposedDpEvent, _dp_event.RepeatAndSelectDpEvent)):
        return relations_of(event.event)  # best of K runs: the runs' relation
    if isinstance(event, _dp_event.ComposedDpEvent):
        return frozenset().union(*(relations_of(e) for e in event.events))
    if isinstance(
        event,
        (_dp_event.SampledWithoutReplacementDpEvent, ReplaceOneGaussianDpEvent)
        + DISTRIBUTED_EVENTS,
    ):
        return frozenset({NeighboringRelation.REPLACE_ONE})
    if isinstance(
        event, (_dp_event.PoissonSampledDpEvent, _dp_event.SampledWithReplacementDpEvent)
    ):
        return frozenset({NeighboringRelation.ADD_OR_REMOVE_ONE}) | relations_of(event.event)
    return frozenset({NeighboringRelation.ADD_OR_REMOVE_ONE})


def mixed_relations_message(what: str) -> str:
    """The error for a composition of add/remove-one and replace-one events."""
    return (
        f"{what} mixes add/remove-one and replace-one events (different neighbouring "
        "relations): an epsilon composed from both bounds neither relation.  Account "
        "everything under replace-one instead: an add/remove Gaussian(sigma) is the "
        "replace-one Gaussian(sigma/2) (sensitivity 2C), see "
        "dpfl_tf.privacy.events.to_replace_one and PrivacyLedger(relation='replace_one'); "
        "Poisson-sampled events with q < 1 cannot be converted: keep them in a separate "
        "ledger, or train with poisson sampling throughout"
    )


def neighboring_relation_of(event: dp_accounting.DpEvent) -> NeighboringRelation:
    """The relation the event's guarantee is stated under (see module docstring).

    ADD_OR_REMOVE_ONE for events without any (no-ops, non-private events).
    Raises ValueError if `event` composes events of both relations.
    """
    relations = relations_of(event)
    if len(relations) > 1:
        raise ValueError(mixed_relations_message(describe_event(event)))
    return next(iter(relations), NeighboringRelation.ADD_OR_REMOVE_ONE)


def to_replace_one(event: dp_accounting.DpEvent) -> dp_accounting.DpEvent:
    """`event` stated under replace-one: add/remove ``GaussianDpEvent(sigma)`` (and a
    Poisson-sampled one with q = 1, i.e. every record) becomes
    ``ReplaceOneGaussianDpEvent(sigma / 2)`` -- replacing a record moves a sum of
    records clipped to C by up to 2C.  Replace-one, no-op and non-private events
    are kept; compositions are converted part by part.

    Raises ValueError for events with no replace-one form here (Poisson sampling
    with q < 1, non-Gaussian mechanisms).
    """
    if isinstance(
        event,
        (
            _dp_event.NoOpDpEvent,
            _dp_event.NonPrivateDpEvent,
            _dp_event.SampledWithoutReplacementDpEvent,
            ReplaceOneGaussianDpEvent,
        )
        + DISTRIBUTED_EVENTS,
    ):
        return event
    if isinstance(event, _dp_event.SelfComposedDpEvent):
        return _dp_event.SelfComposedDpEvent(to_replace_one(event.event), event.count)
    if isinstance(event, _dp_event.ComposedDpEvent):
        return _dp_event.ComposedDpEvent([to_replace_one(e) for e in event.events])
    if isinstance(event, _dp_event.RepeatAndSelectDpEvent):
        # Papernot & Steinke's bound holds for any neighbouring relation: it reads
        # the RDP curve of one run, stated here under replace-one
        return attr.evolve(event, event=to_replace_one(event.event))
    if type(event) is _dp_event.GaussianDpEvent:
        return ReplaceOneGaussianDpEvent(event.noise_multiplier / 2.0)
    if isinstance(event, _dp_event.PoissonSampledDpEvent) and event.sampling_probability == 1:
        return to_replace_one(event.event)
    if isinstance(event, _dp_event.PoissonSampledDpEvent):
        raise ValueError(
            f"{describe_event(event)} has no replace-one form the accountants here interpret "
            f"(Poisson sampling_probability={event.sampling_probability:g} < 1): keep it in a "
            "separate ledger, under add/remove-one"
        )
    raise ValueError(
        f"{describe_event(event)} has no replace-one form here (only Gaussian "
        "events and their compositions are converted)"
    )


# --------------------------------------------------------------------------
# Serialisation: events are attrs classes of dp_accounting; store class + fields.

_OWN_EVENTS = {cls.__name__: cls for cls in (ReplaceOneGaussianDpEvent,) + DISTRIBUTED_EVENTS}


def event_to_dict(event: dp_accounting.DpEvent) -> dict:
    """A JSON-ready dict; `event_from_dict` restores an equal event."""
    if not isinstance(event, dp_accounting.DpEvent):
        raise TypeError(f"event must be a dp_accounting.DpEvent, got {type(event).__name__}")
    out: dict[str, Any] = {"type": type(event).__name__}
    for field in attr.fields(type(event)):
        value = getattr(event, field.name)
        if isinstance(value, dp_accounting.DpEvent):
            value = event_to_dict(value)
        elif isinstance(value, (list, tuple)):
            value = [event_to_dict(v) if isinstance(v, dp_accounting.DpEvent) else v for v in value]
        out[field.name] = value
    return out


def event_from_dict(data: dict) -> dp_accounting.DpEvent:
    if not isinstance(data, dict) or "type" not in data:
        raise ValueError(f"not a serialised DpEvent: {data!r}")
    cls = _OWN_EVENTS.get(data["type"]) or getattr(_dp_event, data["type"], None)
    if not (isinstance(cls, type) and issubclass(cls, dp_accounting.DpEvent)):
        raise ValueError(f"unknown DpEvent type {data['type']!r}")
    kwargs = {}
    for key, value in data.items():
        if key == "type":
            continue
        if isinstance(value, dict) and "type" in value:
            value = event_from_dict(value)
        elif isinstance(value, list):
            value = [
                event_from_dict(v) if isinstance(v, dict) and "type" in v else v for v in value
            ]
        kwargs[key] = value
    return cls(**kwargs)


def event_to_json(event: dp_accounting.DpEvent) -> str:
    return json.dumps(event_to_dict(event), sort_keys=True)


def event_from_json(text: str) -> dp_accounting.DpEvent:
    return event_from_dict(json.loads(text))


def describe_event(event: dp_accounting.DpEvent) -> str:
    """A short human-readable description naming the neighbouring relation, e.g.
    '10000 x Poisson(q=0.01) Gaussian(sigma=4) (add/remove-one)'."""
    relations = relations_of(event)
    text = _describe(event)
    if len(relations) > 1:
        return text + " (MIXED add/remove-one and replace-one: no epsilon)"
    if relations:
        return f"{text} ({relation_name(next(iter(relations)))})"
    return text


def _describe(event: dp_accounting.DpEvent) -> str:
    if isinstance(event, _dp_event.SelfComposedDpEvent):
        inner = _describe(event.event)
        if isinstance(event.event, _dp_event.ComposedDpEvent) and len(event.event.events) > 1:
            inner = f"[{inner}]"  # the count repeats the whole composition
        return f"{event.count} x {inner}"
    if isinstance(event, _dp_event.ComposedDpEvent):
        return " + ".join(_describe(e) for e in event.events) or "nothing"
    if isinstance(event, _dp_event.PoissonSampledDpEvent):
        return f"Poisson(q={event.sampling_probability:g}) {_describe_inner(event.event)}"
    if isinstance(event, _dp_event.SampledWithoutReplacementDpEvent):
        return (
            f"fixed-size(L={event.sample_size} of N={event.source_dataset_size}) "
            f"{_describe_inner(event.event)}"
        )
    if isinstance(event, _dp_event.GaussianDpEvent):
        return f"Gaussian(sigma={event.noise_multiplier:g})"
    if isinstance(event, DistributedDiscreteGaussianDpEvent):
        return (
            f"distributed discrete Gaussian(>= {event.num_shares} shares of "
            f"variance {event.share_variance:g}, L2 {event.l2_sensitivity:g}, "
            f"d={event.dimension})"
        )
    if isinstance(event, DistributedSkellamDpEvent):
        return (
            f"distributed Skellam(>= {event.num_shares} shares of variance "
            f"{event.share_variance:g}, L2 {event.l2_sensitivity:g})"
        )
    if isinstance(event, _dp_event.RepeatAndSelectDpEvent):
        return (
            f"best of {_trial_count_name(event.mean, event.shape)} runs of "
            f"[{_describe(event.event)}]"
        )
    if isinstance(event, _dp_event.NoOpDpEvent):
        return "no-op"
    if isinstance(event, _dp_event.NonPrivateDpEvent):
        return "NON-PRIVATE"
    return type(event).__name__


def _trial_count_name(mean: float, shape: float) -> str:
    """The distribution of a RepeatAndSelectDpEvent's number of runs, in words."""
    if math.isinf(shape):
        return f"Poisson(mean={mean:g})"
    name = {0.0: "logarithmic", 1.0: "geometric"}.get(float(shape))
    if name:
        return f"{name}(mean={mean:g})"
    return f"truncated-negative-binomial(mean={mean:g}, shape={shape:g})"


def _describe_inner(event: dp_accounting.DpEvent) -> str:
    """A sampled event's inner event; brackets several releases of one sample."""
    text = _describe(event)
    return f"[{text}]" if isinstance(event, _dp_event.ComposedDpEvent) else text
