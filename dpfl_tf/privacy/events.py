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
  mechanism with sensitivity 2C, ``GaussianDpEvent(sigma/2)`` per epoch.
* ``SamplingMethod.FULL_BATCH``: every record in every step,
  ``GaussianDpEvent(sigma)`` per step (add/remove relation).

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
"""

from __future__ import annotations

import json
from typing import Any

import dp_accounting
from dp_accounting import dp_event as _dp_event

from dpfl_tf._validation import ChoiceEnum
from dpfl_tf._validation import check_count as _check_count
from dpfl_tf._validation import check_number as _check_number

__all__ = [
    "SamplingMethod",
    "NeighboringRelation",
    "gaussian_step_event",
    "joint_gaussian_step_event",
    "joint_noise_multiplier",
    "complementary_noise_multiplier",
    "dp_sgd_event",
    "shuffle_epoch_event",
    "clipped_upload_event",
    "REPLACE_ONE_UPDATE",
    "neighboring_relation_of",
    "event_to_dict",
    "event_from_dict",
    "event_to_json",
    "event_from_json",
    "describe_event",
]

NeighboringRelation = dp_accounting.NeighboringRelation


class SamplingMethod(ChoiceEnum):
    """How the records that enter one noised sum were chosen."""

    __argument__ = "sampling"
    POISSON = "poisson"
    FIXED_SIZE = "fixed_size"
    SHUFFLE = "shuffle"
    FULL_BATCH = "full_batch"


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

    For ``SHUFFLE`` the per-step event is a no-op: the whole epoch is one
    Gaussian release, see `dp_sgd_event` and `shuffle_epoch_event`.
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
    sigmas = [_check_number(f"noise_multipliers[{i}]", s, low=0.0)
              for i, s in enumerate(noise_multipliers)]
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
                raise ValueError("Poisson sampling needs sampling_rate, or dataset_size and lot_size")
            sampling_rate = _check_count("lot_size", lot_size, minimum=1) / _check_count(
                "dataset_size", dataset_size, minimum=1)
        q = _check_number("sampling_rate", sampling_rate, low=0.0, high=1.0, low_open=True)
        return dp_accounting.PoissonSampledDpEvent(q, inner(1.0))
    if method is SamplingMethod.FIXED_SIZE:
        n = _check_count("dataset_size", dataset_size, minimum=1)
        lot = _check_count("lot_size", lot_size, minimum=1)
        if lot > n:
            raise ValueError(f"lot_size must be <= dataset_size ({n}), got {lot}")
        return dp_accounting.SampledWithoutReplacementDpEvent(n, lot, inner(0.5))
    # SHUFFLE: per-step nothing new is released beyond the epoch's Gaussian.
    return dp_accounting.NoOpDpEvent()


def joint_noise_multiplier(noise_multipliers) -> float:
    """(sum_i s_i^-2)^(-1/2): independent Gaussian releases of the same records,
    multipliers s_i, as one Gaussian mechanism (module docstring).  Any s_i = 0
    gives 0 (that release is exact)."""
    sigmas = [_check_number(f"noise_multipliers[{i}]", s, low=0.0)
              for i, s in enumerate(noise_multipliers)]
    if not sigmas:
        raise ValueError("noise_multipliers must name at least one release, got []")
    if any(s == 0 for s in sigmas):
        return 0.0
    return sum(s ** -2 for s in sigmas) ** -0.5


def complementary_noise_multiplier(joint: float, other: float) -> float:
    """The s with ``joint_noise_multiplier([s, other]) == joint``:
    s = (joint^-2 - other^-2)^(-1/2) (Andrew et al. 2021, section 3: the update
    noise that keeps the round's multiplier at `joint` beside a count release
    of multiplier `other`).  Needs other > joint > 0."""
    joint = _check_number("joint", joint, low=0.0, low_open=True)
    other = _check_number("other", other, low=0.0, low_open=True)
    if other <= joint:
        raise ValueError(f"the other release's noise multiplier ({other:g}) must exceed the "
                         f"joint one ({joint:g}): alone it would already cost more")
    return (joint ** -2 - other ** -2) ** -0.5


def shuffle_epoch_event(noise_multiplier: float) -> dp_accounting.DpEvent:
    """One epoch of shuffle-and-split lots: one Gaussian, replace-one, sensitivity 2C."""
    sigma = _check_number("noise_multiplier", noise_multiplier, low=0.0)
    return dp_accounting.GaussianDpEvent(sigma / 2.0)


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
    return dp_accounting.GaussianDpEvent(z / 2.0)


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
            shuffle_epoch_event(noise_multiplier), _check_count("epochs", epochs))
    step = gaussian_step_event(noise_multiplier, method, sampling_rate=sampling_rate,
                               dataset_size=dataset_size, lot_size=lot_size)
    return dp_accounting.SelfComposedDpEvent(step, _check_count("steps", steps))


def _walk(event: dp_accounting.DpEvent):
    yield event
    if isinstance(event, (_dp_event.SelfComposedDpEvent, _dp_event.PoissonSampledDpEvent,
                          _dp_event.SampledWithoutReplacementDpEvent,
                          _dp_event.SampledWithReplacementDpEvent)):
        yield from _walk(event.event)
    elif isinstance(event, _dp_event.ComposedDpEvent):
        for e in event.events:
            yield from _walk(e)


def neighboring_relation_of(event: dp_accounting.DpEvent) -> NeighboringRelation:
    """The relation an event's noise multipliers refer to (see module docstring)."""
    if any(isinstance(e, _dp_event.SampledWithoutReplacementDpEvent) for e in _walk(event)):
        return NeighboringRelation.REPLACE_ONE
    return NeighboringRelation.ADD_OR_REMOVE_ONE


# --------------------------------------------------------------------------
# Serialisation: events are attrs classes of dp_accounting; store class + fields.

def event_to_dict(event: dp_accounting.DpEvent) -> dict:
    """A JSON-ready dict; `event_from_dict` restores an equal event."""
    if not isinstance(event, dp_accounting.DpEvent):
        raise TypeError(f"event must be a dp_accounting.DpEvent, got {type(event).__name__}")
    import attr

    out: dict[str, Any] = {"type": type(event).__name__}
    for field in attr.fields(type(event)):
        value = getattr(event, field.name)
        if isinstance(value, dp_accounting.DpEvent):
            value = event_to_dict(value)
        elif isinstance(value, (list, tuple)):
            value = [event_to_dict(v) if isinstance(v, dp_accounting.DpEvent) else v
                     for v in value]
        out[field.name] = value
    return out


def event_from_dict(data: dict) -> dp_accounting.DpEvent:
    if not isinstance(data, dict) or "type" not in data:
        raise ValueError(f"not a serialised DpEvent: {data!r}")
    cls = getattr(_dp_event, data["type"], None)
    if not (isinstance(cls, type) and issubclass(cls, dp_accounting.DpEvent)):
        raise ValueError(f"unknown DpEvent type {data['type']!r}")
    kwargs = {}
    for key, value in data.items():
        if key == "type":
            continue
        if isinstance(value, dict) and "type" in value:
            value = event_from_dict(value)
        elif isinstance(value, list):
            value = [event_from_dict(v) if isinstance(v, dict) and "type" in v else v
                     for v in value]
        kwargs[key] = value
    return cls(**kwargs)


def event_to_json(event: dp_accounting.DpEvent) -> str:
    return json.dumps(event_to_dict(event), sort_keys=True)


def event_from_json(text: str) -> dp_accounting.DpEvent:
    return event_from_dict(json.loads(text))


def describe_event(event: dp_accounting.DpEvent) -> str:
    """A short human-readable description, e.g. '10000 x Poisson(q=0.01) Gaussian(sigma=4)'."""
    if isinstance(event, _dp_event.SelfComposedDpEvent):
        return f"{event.count} x {describe_event(event.event)}"
    if isinstance(event, _dp_event.ComposedDpEvent):
        return " + ".join(describe_event(e) for e in event.events) or "nothing"
    if isinstance(event, _dp_event.PoissonSampledDpEvent):
        return f"Poisson(q={event.sampling_probability:g}) {_describe_inner(event.event)}"
    if isinstance(event, _dp_event.SampledWithoutReplacementDpEvent):
        return (f"fixed-size(L={event.sample_size} of N={event.source_dataset_size}, "
                f"replace-one) {_describe_inner(event.event)}")
    if isinstance(event, _dp_event.GaussianDpEvent):
        return f"Gaussian(sigma={event.noise_multiplier:g})"
    if isinstance(event, _dp_event.NoOpDpEvent):
        return "no-op"
    if isinstance(event, _dp_event.NonPrivateDpEvent):
        return "NON-PRIVATE"
    return type(event).__name__


def _describe_inner(event: dp_accounting.DpEvent) -> str:
    """A sampled event's inner event; brackets several releases of one sample."""
    text = describe_event(event)
    return f"[{text}]" if isinstance(event, _dp_event.ComposedDpEvent) else text
