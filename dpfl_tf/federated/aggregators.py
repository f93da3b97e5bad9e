"""Aggregators: how the server turns the round's client updates into one update.

An aggregator sees the round's uploads as a stream of ``(update, weight)``
pairs (update = Delta_k, a list of tensors; weight = n_k) and returns the
update to add to the global model.  Streaming aggregators (mean, both DP
ones, fixed or adaptive clip) hold one running sum, so a round costs O(model)
memory however many clients take part; the median needs every update of the
round at once (O(m x model)).

* `MeanAggregator` -- FedAvg (McMahan et al. 2017): sum_k n_k Delta_k / sum_k n_k.
* `MedianAggregator` -- FedMedian: coordinate-wise median (Yin et al. 2018).
* `GlobalDPAggregator` -- Global DP (Geyer, Klein, Nabi 2017, Algorithm 1):
  clip each Delta_k to norm S, sum, add N(0, sigma^2 S^2) once, divide by m;
  S fixed, or adapted privately each round (Andrew et al. 2021).
* `ClientNoiseDPAggregator` -- DP-FedAvg with client-side noise: each client
  clips to S and adds N(0, z^2 S^2) before upload; the server averages.
* `DistributedDPAggregator` -- distributed DP (Kairouz et al. 2021; Agarwal et al.
  2021): each client quantizes its clipped update and adds a discrete noise share
  (`dpfl_tf.federated.distributed_dp`); a simulated secure sum modulo 2^b; the
  server decodes the sum only.

The DP aggregators never clip or draw noise themselves: every clip and
every noise draw goes through a `dpfl_tf.sanitizer.GaussianSanitizer`, the
object DP-SGD uses, with one client's update as the record.

Unit of privacy: one client (all its examples).  Neighbouring relation
follows the sampling scheme as in `dpfl_tf.privacy.events`: Poisson client
sampling -> add/remove one client; m clients drawn without replacement ->
replace one client.

DP-FedAvg with client-side noise: the event
-------------------------------------------
Each of the m clients of a round uploads u_k = clip_S(Delta_k) + Z_k with
Z_k ~ N(0, z^2 S^2 I) independent.  The server releases

    (1/m) sum_k u_k = (1/m) [ sum_k clip_S(Delta_k) + Z ],   Z ~ N(0, m z^2 S^2 I),

since a sum of m independent N(0, z^2 S^2) is N(0, m z^2 S^2).  The sum of
clipped updates has L2 sensitivity S per client (its clipped update vs. a
zero one), so the released model is a Gaussian mechanism with noise
multiplier

    z_agg = z * sqrt(m)          (noise std / sensitivity = z sqrt(m) S / S),

composed with the client sampling: with m of K clients drawn without
replacement (replace-one, sensitivity 2S) the round's event is
``SampledWithoutReplacementDpEvent(K, m, GaussianDpEvent(z sqrt(m) / 2))``,
i.e. ``gaussian_step_event(z * sqrt(m), "fixed_size", dataset_size=K,
lot_size=m)``.  The number of uploads must be known and the same in
neighbouring worlds: with Poisson sampling the count (and with it the total
noise variance) changes with the client's presence, which no Gaussian event
describes, so client-side noise is accounted only for fixed-size sampling.

Against the server (who sees each upload and knows who sent it), sampling
gives no amplification and summing gives no extra noise; nor can the client's
presence be hidden, so the only neighbouring relation is replace-one (the
client's clipped update replaced by another: sensitivity 2S).  Every
participation of a client is ``GaussianDpEvent(z / 2)``
(`dpfl_tf.privacy.events.clipped_upload_event`), composed over the rounds
that client took part in; `dpfl_tf.federated.local_dp.gaussian_upload_report`
turns that into epsilon for the server's report, the Flower client and the
CLI alike.  With per-layer clipping z is the sanitizer's effective multiplier.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Iterable, Sequence

import dp_accounting
import numpy as np
import tensorflow as tf

from dpfl_tf._seeds import derive_rng, derive_seed
from dpfl_tf._validation import check_number
from dpfl_tf.privacy.events import (
    SamplingMethod,
    clipped_upload_event,
    complementary_noise_multiplier,
    gaussian_step_event,
    joint_gaussian_step_event,
)
from dpfl_tf.sanitizer import GaussianSanitizer, flat_clip_factor
from dpfl_tf.secure_random import refuse_seed

__all__ = [
    "AggregateResult",
    "Aggregator",
    "ClientNoiseDPAggregator",
    "DistributedDPAggregator",
    "GlobalDPAggregator",
    "MeanAggregator",
    "MedianAggregator",
    "update_norms",
]

Update = Sequence[tf.Tensor]


@dataclasses.dataclass
class AggregateResult:
    """The round's aggregate update and what happened on the way.  ``released`` is
    False when the round released nothing (no uploads to a non-private mean, a
    secure aggregation that aborted): the server then leaves the model as it was."""

    update: list[tf.Tensor]
    num_clients: int
    info: dict[str, Any] = dataclasses.field(default_factory=dict)
    released: bool = True


def update_norms(update: Update, groups: Sequence[int] | None = None) -> np.ndarray:
    """Per-component L2 norms of one update (one component per tensor, or per group)."""
    groups = list(range(len(update))) if groups is None else list(groups)
    sq = np.zeros(max(groups) + 1)
    for t, g in zip(update, groups):
        sq[g] += float(tf.reduce_sum(tf.square(t)))
    return np.sqrt(sq)


class Aggregator:
    """Base class.  Subclasses implement `aggregate`; DP ones also `round_event`."""

    #: True if the aggregate is released with a DP guarantee.
    private: bool = False
    #: True if `aggregate` needs only O(model) memory.
    streaming: bool = True
    #: True if `client_transform` draws noise (each client's own stream when seeded).
    client_noise: bool = False

    def client_transform(self, update: Update) -> list[tf.Tensor]:
        """What a client does to its update before upload (identity here)."""
        return list(update)

    def begin_round(self, t: int) -> None:
        """Round t starts (`FederatedServer.open_round`); e.g. its public per-round seeds."""

    def dropped_out(self, t: int, client_id: int) -> bool:
        """True if sampled client `client_id` drops out of round t before it uploads (a
        simulation of unreliable clients; False here)."""
        return False

    def aggregate(
        self, uploads: Iterable[tuple[Update, float]], template: Update, *, expected_clients: float
    ) -> AggregateResult:
        raise NotImplementedError

    def round_event(
        self, num_components: int, sampling: SamplingMethod | str, **sampling_args
    ) -> dp_accounting.DpEvent | None:
        """The DpEvent of one round's release (None: not private)."""
        return None

    def reseed(self, seed: int) -> None:
        """Re-seeds the noise generator (tests and exact resume only)."""

    def get_state(self) -> dict:
        """State that changes from round to round (checkpointed; e.g. an adaptive clip)."""
        return {}

    def set_state(self, state: dict) -> None:
        """Restores `get_state` (from a checkpoint)."""

    def get_config(self) -> dict:
        return {"name": type(self).__name__}


class MeanAggregator(Aggregator):
    """FedAvg: the n_k-weighted mean of the updates (or the plain mean)."""

    def __init__(self, weighted: bool = True):
        self.weighted = bool(weighted)

    def aggregate(self, uploads, template, *, expected_clients=None) -> AggregateResult:
        total = [tf.zeros_like(t) for t in template]
        weight_sum, count = 0.0, 0
        for update, weight in uploads:
            w = float(weight) if self.weighted else 1.0
            if w < 0:
                raise ValueError(f"client weights must be >= 0, got {w}")
            total = [s + w * tf.cast(u, s.dtype) for s, u in zip(total, update)]
            weight_sum += w
            count += 1
        if weight_sum > 0:
            total = [s / weight_sum for s in total]
        return AggregateResult(total, count, released=count > 0)

    def get_config(self) -> dict:
        return {"name": "mean", "weighted": self.weighted}


class MedianAggregator(Aggregator):
    """FedMedian: the coordinate-wise median of the updates (unweighted).

    Needs all m updates of the round at once: O(m x model) memory."""

    streaming = False

    def aggregate(self, uploads, template, *, expected_clients=None) -> AggregateResult:
        stacks: list[list[np.ndarray]] = [[] for _ in template]
        count = 0
        for update, _ in uploads:
            for s, u in zip(stacks, update):
                s.append(np.asarray(u))
            count += 1
        if count == 0:
            return AggregateResult([tf.zeros_like(t) for t in template], 0, released=False)
        out = [
            tf.constant(np.median(np.stack(s), axis=0), dtype=t.dtype)
            for s, t in zip(stacks, template)
        ]
        return AggregateResult(out, count)

    def get_config(self) -> dict:
        return {"name": "median"}


def _clip_update_tensors(
    sanitizer: GaussianSanitizer, update: Update, groups: Sequence[int] | None
) -> tuple[list[tf.Tensor], tf.Tensor]:
    """One update clipped by the sanitizer (flat, or per component given by `groups`):
    the clipped tensors and the per-component squared norms before clipping.
    An update with a NaN or inf entry is zeroed (the sanitizer's factor 0 applied
    with `tf.where`: 0 x NaN would be NaN), so the client contributes nothing and
    the sensitivity stays S.  Pure TensorFlow, so it runs inside a `tf.function`."""
    if groups is None:
        groups = list(range(len(update)))
    k = max(groups) + 1
    sq = [tf.zeros([1], update[0].dtype) for _ in range(k)]
    for t, g in zip(update, groups):
        sq[g] = sq[g] + tf.reshape(tf.reduce_sum(tf.square(t)), [1])
    factors = sanitizer.clip_factors(sq)
    clipped = [sanitizer.apply_factors(t[None], factors[g])[0] for t, g in zip(update, groups)]
    return clipped, tf.concat(sq, axis=0)


def _adaptive_clip_count(state, bits, update, bound):
    """Adaptive clipping's client step: the update clipped to the round's bound C_t
    (flat) added to the sum `state`, and b_k - 1/2 added to the count `bits`
    (b_k = 1 if ||update|| <= C_t; 0 for a non-finite update, which is also zeroed).
    Pure TensorFlow, with C_t an input, so one traced graph serves every round."""
    total = tf.add_n([tf.reduce_sum(tf.square(t)) for t in update])
    factor = flat_clip_factor(total, bound)
    clipped = [GaussianSanitizer.apply_factors(t[None], factor[None])[0] for t in update]
    norm = tf.sqrt(total)  # NaN (non-finite update): b_k = 0
    below = tf.cast(norm <= tf.cast(bound, norm.dtype), tf.float32)
    return (
        [s + c for s, c in zip(state, clipped)],
        [bits[0] + tf.reshape(below - 0.5, [1])],
    )


def _clip_update(
    sanitizer: GaussianSanitizer, update: Update, groups: Sequence[int] | None
) -> tuple[list[tf.Tensor], np.ndarray]:
    """Eager version: the clipped tensors and the per-component norms (numpy)."""
    clipped, sq = _clip_update_tensors(sanitizer, update, groups)
    return clipped, np.sqrt(sq.numpy())


class _SanitizedAggregator(Aggregator):
    private = True

    def __init__(
        self,
        sanitizer: GaussianSanitizer,
        groups: Sequence[int] | None = None,
        secure_mode: bool = False,
    ):
        if not isinstance(sanitizer, GaussianSanitizer):
            raise TypeError(
                f"sanitizer must be a GaussianSanitizer, got {type(sanitizer).__name__}"
            )
        if secure_mode and not sanitizer.secure_mode:
            raise ValueError(
                "secure_mode=True needs the sanitizer built with secure_mode=True "
                f"(noise resistant to floating-point attacks), got {sanitizer!r}"
            )
        #: secure mode (`dpfl_tf.secure_random`): every noise draw of this aggregator is
        #: secure and no seed is accepted (`reseed` refuses).
        self.secure_mode = bool(secure_mode) or sanitizer.secure_mode
        self.sanitizer = sanitizer
        self.groups = None if groups is None else [int(g) for g in groups]
        # one graph call per client for clip (+ noise / + accumulate): no per-op overhead
        self._clip_accumulate = tf.function(self._clip_accumulate_step, reduce_retracing=True)
        self._clip_noise = tf.function(self._clip_noise_step, reduce_retracing=True)
        if self.groups is not None and sorted(set(self.groups)) != list(
            range(max(self.groups) + 1)
        ):
            raise ValueError(f"groups must number components 0..k-1 without gaps, got {groups}")

    def _clip_accumulate_step(self, state, update):
        clipped, sq = _clip_update_tensors(self.sanitizer, update, self.groups)
        return self.sanitizer.accumulate(state, clipped), sq

    def _clip_noise_step(self, update):
        clipped, _ = _clip_update_tensors(self.sanitizer, update, self.groups)
        return self.sanitizer.add_noise(clipped, self.groups)

    def num_components(self, template: Update) -> int:
        """Clipping components for the event: 1 for flat clipping (one bound on the
        whole update), else one per group (or per tensor without groups)."""
        if not self.sanitizer.per_layer:
            return 1
        return len(template) if self.groups is None else max(self.groups) + 1

    def reseed(self, seed: int) -> None:
        refuse_seed(self.secure_mode, seed)
        self.sanitizer.generator.reset_from_seed(int(seed))

    def _check_template(self, template: Update) -> None:
        if self.groups is not None and len(self.groups) != len(template):
            raise ValueError(
                f"groups has {len(self.groups)} entries but the model has "
                f"{len(template)} trainable variables"
            )
        self.sanitizer.clip_bounds(self.num_components(template))  # validates per-layer count


class GlobalDPAggregator(_SanitizedAggregator):
    """Global DP (Geyer et al. 2017): clip each update to S, noise the sum once.

        Delta = (1/m) [ sum_k clip_S(Delta_k) + N(0, sigma^2 S^2 I) ]

    Unweighted: every client counts equally, so one client moves the sum by
    at most S.  m is the *expected* number of clients (fixed for fixed-size
    sampling, qK for Poisson sampling): dividing by the realised count under
    Poisson sampling would leak that count.

    Adaptive clipping (``clip="adaptive"``; Andrew, Thakkar, McMahan,
    Ramaswamy 2021, "Differentially private learning with adaptive clipping",
    Algorithm 1 with geometric updates).  Round t clips at C_t (C_0 = the
    sanitizer's l2_norm_clip) and, from the same sampled clients, releases a
    second noised sum, of the centred bits b_k - 1/2 with
    b_k = [ ||Delta_k|| <= C_t ]:

        R_t = sum_k (b_k - 1/2) + N(0, sigma_b^2),
        b_t = clip_[0,1]( R_t / m + 1/2 ),
        C_{t+1} = C_t exp( -eta_C (b_t - gamma) ),

    so C_t moves towards the gamma-quantile of the update norms.  One client
    moves the centred sum by at most 1/2 (add/remove; 1 under replace-one), so
    this count release is a Gaussian mechanism with multiplier 2 sigma_b, drawn
    by its own `GaussianSanitizer` (bound 1/2, multiplier 2 sigma_b).  Both
    releases read the same sample, so the round's event is ONE sampled event
    over both, ``Sampled(ComposedDpEvent([Gaussian(z_Delta), Gaussian(2
    sigma_b)]))`` (`dpfl_tf.privacy.events.joint_gaussian_step_event`),
    whose joint multiplier is (z_Delta^-2 + (2 sigma_b)^-2)^(-1/2) (the
    paper's Theorem 1).  As in TensorFlow Federated's ``gaussian_adaptive``,
    ``noise_multiplier`` (the sanitizer's sigma) is that JOINT multiplier z:
    the update sum gets z_Delta = (z^-2 - (2 sigma_b)^-2)^(-1/2) > z
    (`complementary_noise_multiplier`), so a round costs exactly what a
    fixed-clip round at sigma = z costs.  sigma_b = 0 releases the count
    exactly: the round's event is then ``NonPrivateDpEvent`` (eps = inf).
    The bits and the noise are the server's (it is trusted with raw updates
    under Global DP); nothing else about the norms is released.

    Args:
      sanitizer: the shared `GaussianSanitizer` (S = its l2_norm_clip, flat or
        one bound per component; sigma = its noise_multiplier).  With
        ``clip="adaptive"``: flat only; S = C_0 and sigma = the joint z.
      clip: "fixed" or "adaptive".  ("median", the per-round median of the raw
        update norms, read the clients' data without noise and was removed.)
      groups: component index of each tensor for per-layer clipping (see
        `dpfl_tf.federated.client.layer_groups`); None = one per tensor.
      target_quantile: gamma in [0, 1] (adaptive; default 0.5).
      clip_learning_rate: eta_C > 0 (adaptive; default 0.2).
      count_stddev: sigma_b >= 0, the std of the noise on the count (adaptive;
        required: the paper and TFF use 0.05 x the expected clients per round).
      secure_mode: the sanitizer must be secure (`GaussianSanitizer(...,
        secure_mode=True)`); the count's sanitizer and every round's update
        sanitizer are built secure too, and `reseed` refuses.
    """

    def __init__(
        self,
        sanitizer: GaussianSanitizer,
        *,
        clip: str = "fixed",
        groups: Sequence[int] | None = None,
        target_quantile: float = 0.5,
        clip_learning_rate: float = 0.2,
        count_stddev: float | None = None,
        secure_mode: bool = False,
    ):
        super().__init__(sanitizer, groups, secure_mode)
        if clip == "median":
            raise ValueError(
                "clip='median' (the median of the round's raw update norms, read "
                "without noise: not differentially private) is no longer offered; "
                "use clip='adaptive' (DP adaptive clipping, Andrew et al. 2021)"
            )
        if clip not in ("fixed", "adaptive"):
            raise ValueError(f"clip must be 'fixed' or 'adaptive', got {clip!r}")
        self.clip = clip
        self.target_quantile = check_number("target_quantile", target_quantile, low=0.0, high=1.0)
        self.clip_learning_rate = check_number(
            "clip_learning_rate", clip_learning_rate, low=0.0, low_open=True
        )
        self.count_stddev = None
        if clip == "adaptive":
            if sanitizer.per_layer:
                raise ValueError(
                    "clip='adaptive' adapts one flat bound; got a per-layer "
                    f"sanitizer (l2_norm_clip={sanitizer.l2_norm_clip!r})"
                )
            if count_stddev is None:
                raise ValueError(
                    "clip='adaptive' needs count_stddev (sigma_b, the noise std "
                    "of the count of unclipped clients; Andrew et al. use 0.05 x "
                    "the expected clients per round)"
                )
            self.count_stddev = check_number("count_stddev", count_stddev, low=0.0)
            z = sanitizer.noise_multiplier
            if z > 0 and self.count_stddev > 0 and 2 * self.count_stddev <= z:
                raise ValueError(
                    f"count_stddev must be > noise_multiplier / 2 = {z / 2:g} (the count "
                    f"release alone, multiplier 2 x count_stddev = {2 * self.count_stddev:g}, "
                    f"would cost more than the round's noise_multiplier {z:g} allows), got "
                    f"{self.count_stddev:g}"
                )
            self._count = GaussianSanitizer(
                0.5,
                2.0 * self.count_stddev,
                seed=None if sanitizer.seed is None else derive_seed(sanitizer.seed, "count-noise"),
                secure_mode=self.secure_mode,
            )
        self.clip_bound = float(sanitizer.l2_norm_clip) if not sanitizer.per_layer else None
        # adaptive: one graph call per client too, with the round's bound C_t an input
        self._adaptive_step = tf.function(_adaptive_clip_count, reduce_retracing=True)

    # -- the noise multipliers of the two releases --------------------------------
    def update_noise_multiplier(self) -> float:
        """z_Delta: the update sum's noise std / C_t (= sigma for a fixed clip)."""
        z = self.sanitizer.noise_multiplier
        if self.clip == "fixed" or z == 0 or self.count_stddev == 0:
            return z
        return complementary_noise_multiplier(z, 2.0 * self.count_stddev)

    def count_noise_multiplier(self) -> float | None:
        """2 sigma_b: the count's noise std / its add-remove sensitivity 1/2 (None: fixed)."""
        return None if self.clip == "fixed" else 2.0 * self.count_stddev

    def _round_sanitizer(self) -> GaussianSanitizer:
        """This round's update sanitizer: bound C_t, multiplier z_Delta, the same generator."""
        if self.clip == "fixed":
            return self.sanitizer
        return GaussianSanitizer(
            self.clip_bound,
            self.update_noise_multiplier(),
            generator=self.sanitizer.generator,
            secure_mode=self.secure_mode,
        )

    def aggregate(self, uploads, template, *, expected_clients: float) -> AggregateResult:
        if not expected_clients or expected_clients <= 0:
            raise ValueError(f"expected_clients must be > 0, got {expected_clients}")
        self._check_template(template)
        sanitizer = self._round_sanitizer()
        adaptive = self.clip == "adaptive"
        state = sanitizer.initial_state(template)
        bits = self._count.initial_state([tf.zeros([1])]) if adaptive else None
        count = 0
        for update, _ in uploads:
            if not adaptive:  # fixed S: one compiled call per client
                state, _ = self._clip_accumulate(state, list(update))
            else:  # this round's C_t; b_k - 1/2 into the count
                state, bits = self._adaptive_step(
                    state, bits, list(update), tf.constant(self.clip_bound, tf.float64)
                )
            count += 1
        noised = sanitizer.add_noise(state, self.groups)
        # Only what the mechanism released goes into `info` (it is written to the
        # history, the results file and Flower's metrics): the bound used and, with
        # adaptive clipping, the noised fraction and the next bound.  No statistic of
        # the raw norms (such as the fraction clipped) leaves the aggregator.
        info: dict[str, Any] = {
            "clip": sanitizer.l2_norm_clip
            if not sanitizer.per_layer
            else list(sanitizer.l2_norm_clip)
        }
        if adaptive:
            released = float(self._count.add_noise(bits)[0][0])  # R_t, the noised count
            below = min(1.0, max(0.0, released / expected_clients + 0.5))
            self.clip_bound = self.clip_bound * math.exp(
                -self.clip_learning_rate * (below - self.target_quantile)
            )
            info.update(unclipped_fraction_noised=below, clip_next=self.clip_bound)
        return AggregateResult([t / expected_clients for t in noised], count, info)

    def round_event(self, num_components, sampling, **sampling_args):
        if self.clip == "fixed":
            return self.sanitizer.event(num_components, sampling, **sampling_args)
        z_delta, z_count = self.update_noise_multiplier(), self.count_noise_multiplier()
        if z_delta == 0 or z_count == 0:  # an exact update sum or an exact count
            return dp_accounting.NonPrivateDpEvent()
        return joint_gaussian_step_event([z_delta, z_count], sampling, **sampling_args)

    def reseed(self, seed: int) -> None:
        super().reseed(seed)  # refuses in secure mode
        if self.clip == "adaptive":
            self._count.generator.reset_from_seed(derive_seed(seed, "count-noise"))

    def get_state(self) -> dict:
        return {"clip_bound": self.clip_bound} if self.clip == "adaptive" else {}

    def set_state(self, state: dict) -> None:
        if self.clip == "adaptive":
            self.clip_bound = check_number(
                "clip_bound", state["clip_bound"], low=0.0, low_open=True
            )

    def clipping_report(self) -> dict:
        """How updates were clipped, for the privacy report."""
        if self.clip == "fixed":
            return {"mode": "fixed", "clip": self.sanitizer.l2_norm_clip}
        return {
            "mode": "adaptive (Andrew et al. 2021)",
            "initial_clip": self.sanitizer.l2_norm_clip,
            "current_clip": self.clip_bound,
            "target_quantile": self.target_quantile,
            "clip_learning_rate": self.clip_learning_rate,
            "count_stddev": self.count_stddev,
            "update_noise_multiplier": self.update_noise_multiplier(),
            "count_noise_multiplier": self.count_noise_multiplier(),
            "joint_noise_multiplier": self.sanitizer.noise_multiplier,
        }

    def get_config(self) -> dict:
        config = {
            "name": "global_dp",
            "clip": self.clip,
            "groups": self.groups,
            "sanitizer": self.sanitizer.get_config(),
            "secure_mode": self.secure_mode,
        }
        if self.clip == "adaptive":
            config.update(
                target_quantile=self.target_quantile,
                clip_learning_rate=self.clip_learning_rate,
                count_stddev=self.count_stddev,
            )
        return config


class ClientNoiseDPAggregator(_SanitizedAggregator):
    """DP-FedAvg with client-side noise (module docstring has the event).

    `client_transform` is the client's step: u_k = clip_S(Delta_k) + N(0, z^2 S^2 I),
    drawn with the sanitizer (in a deployment each client builds its own
    `GaussianSanitizer(**sanitizer.get_config())`; in simulation the clients
    share one generator).  The server averages: (1/m) sum_k u_k.

    Args:
      sanitizer: the clients' `GaussianSanitizer` (S, z).
      groups: as for `GlobalDPAggregator`.
      secure_mode: the sanitizer must be secure; `reseed` refuses.
    """

    client_noise = True

    def __init__(
        self,
        sanitizer: GaussianSanitizer,
        *,
        groups: Sequence[int] | None = None,
        secure_mode: bool = False,
    ):
        super().__init__(sanitizer, groups, secure_mode)

    def client_transform(self, update: Update) -> list[tf.Tensor]:
        _ = self.sanitizer.generator  # created outside the tf.function
        return self._clip_noise(list(update))

    def aggregate(self, uploads, template, *, expected_clients: float) -> AggregateResult:
        if not expected_clients or expected_clients <= 0:
            raise ValueError(f"expected_clients must be > 0, got {expected_clients}")
        self._check_template(template)
        total = [tf.zeros_like(t) for t in template]
        count = 0
        for update, _ in uploads:
            total = [s + u for s, u in zip(total, update)]
            count += 1
        return AggregateResult(
            [t / expected_clients for t in total], count, {"clip": self.sanitizer.l2_norm_clip}
        )

    def upload_noise_multiplier(self, num_components: int) -> float:
        """z: noise std / sensitivity of one upload (the sanitizer's effective multiplier)."""
        return self.sanitizer.effective_noise_multiplier(num_components)

    def aggregate_noise_multiplier(self, num_components: int, num_uploads: int) -> float:
        """z * sqrt(m): the noise multiplier of the sum of m noisy uploads."""
        return self.upload_noise_multiplier(num_components) * math.sqrt(num_uploads)

    def upload_event(self, num_components: int) -> dp_accounting.DpEvent:
        """One upload as seen by the server, replace-one: ``GaussianDpEvent(z / 2)``
        (`clipped_upload_event`; module docstring)."""
        return clipped_upload_event(self.upload_noise_multiplier(num_components))

    def round_event(self, num_components, sampling, **sampling_args):
        method = SamplingMethod.parse(sampling)
        if method is not SamplingMethod.FIXED_SIZE:
            raise ValueError(
                "DP-FedAvg with client-side noise is accounted for fixed-size client sampling "
                "only (sampling='fixed_size'): the released sum's noise is N(0, m z^2 S^2) and "
                f"m must not depend on whether a client took part; got sampling={method.value!r}"
            )
        m = sampling_args.get("lot_size")
        if m is None:
            raise ValueError("fixed-size sampling needs lot_size (clients per round)")
        z_agg = self.aggregate_noise_multiplier(num_components, int(m))
        if z_agg == 0:
            return dp_accounting.NonPrivateDpEvent()
        return gaussian_step_event(z_agg, method, **sampling_args)

    def get_config(self) -> dict:
        return {
            "name": "client_dp",
            "groups": self.groups,
            "sanitizer": self.sanitizer.get_config(),
            "secure_mode": self.secure_mode,
        }


class DistributedDPAggregator(Aggregator):
    """Distributed DP with a simulated secure sum (`dpfl_tf.federated.distributed_dp`).

    The client step (`client_transform`) is `DistributedDP.encode`: clip to c,
    rotate with the round's public seed, scale, round, add the client's discrete
    noise share, wrap at b bits.  `aggregate` is what secure aggregation and the
    server do: the sum of the uploads modulo 2^b (`DistributedDP.secure_sum`; in a
    deployment only this sum is revealed, here the simulation sees every upload),
    decoded (`DistributedDP.decode`) and divided by the number of uploads.  The
    server never uses anything else of the uploads, and what it releases is the
    decoded mean.

    Dropouts.  A sampled client drops out before uploading with probability
    `dropout_rate` (`dropped_out`, from the stream (dropout_seed, "dropout", t, k),
    as the Flower dropout mod draws it).  If fewer than ``mechanism.min_clients``
    uploads arrive, the secure aggregation aborts: nothing is released (the
    update is zero, ``info["aborted"]``), and the round's event is still recorded,
    which over-counts (the server's bookkeeping is the same as for any round).

    Unit of privacy: one client.  The round's event for the released model is
    `DistributedDP.round_event` (m of K without replacement, replace-one); against
    the server, which knows who took part, each participation is
    `DistributedDP.event` (`server_report`).

    Args:
      mechanism: the `DistributedDP` (its ``dimension`` the model's parameter count).
      dropout_rate: simulated dropout probability per sampled client and round.
      dropout_seed: seeds the simulated dropouts (not a privacy matter).
      rotation_key: the public key of the per-round rotation seeds (default: drawn
        from OS entropy; checkpointed).
      secure_mode: noise and rounding from the OS's secure source
        (`dpfl_tf.discrete_noise.SecureSource`); `reseed` refuses.
    """

    private = True
    client_noise = True

    def __init__(
        self,
        mechanism,
        *,
        dropout_rate: float = 0.0,
        dropout_seed: int = 0,
        rotation_key: int | None = None,
        secure_mode: bool = False,
    ):
        from dpfl_tf.discrete_noise import GeneratorSource, SecureSource
        from dpfl_tf.federated.distributed_dp import DistributedDP

        if not isinstance(mechanism, DistributedDP):
            raise TypeError(f"mechanism must be a DistributedDP, got {type(mechanism).__name__}")
        self.mechanism = mechanism
        self.dropout_rate = check_number(
            "dropout_rate", dropout_rate, low=0.0, high=1.0, high_open=True
        )
        self.dropout_seed = int(dropout_seed)
        self.secure_mode = bool(secure_mode)
        refuse_seed(self.secure_mode, rotation_key, "rotation_key")
        import secrets

        self.rotation_key = secrets.randbits(63) if rotation_key is None else int(rotation_key)
        self._source = SecureSource() if self.secure_mode else GeneratorSource(None)
        self._round = 0

    # -- rounds, seeds, dropouts --------------------------------------------------------
    def begin_round(self, t: int) -> None:
        self._round = int(t)

    def rotation_seed(self, t: int | None = None) -> int:
        """Round t's public rotation seed: (rotation_key, "rotation", t)."""
        return derive_seed(self.rotation_key, "rotation", self._round if t is None else int(t))

    def dropped_out(self, t: int, client_id: int) -> bool:
        if self.dropout_rate == 0:
            return False
        return dropped_out(self.dropout_rate, self.dropout_seed, t, client_id)

    def reseed(self, seed: int) -> None:
        from dpfl_tf.discrete_noise import GeneratorSource

        refuse_seed(self.secure_mode, seed)
        self._source = GeneratorSource(int(seed))

    # -- client and server ------------------------------------------------------------
    def client_transform(self, update: Update) -> list[np.ndarray]:
        from dpfl_tf.federated.distributed_dp import flatten

        flat = flatten([np.asarray(u) for u in update])
        return [self.mechanism.encode(flat, self.rotation_seed(), self._source)]

    def aggregate(self, uploads, template, *, expected_clients: float) -> AggregateResult:
        total, count = self.mechanism.secure_sum(np.asarray(u[0]) for u, _ in uploads)
        return self.release(total, count, template)

    def release(self, total: np.ndarray, count: int, template: Update) -> AggregateResult:
        """The round's update from the secure sum of `count` uploads (in-process and
        on Flower's SecAgg+): decoded and divided by `count`, or zero if the secure
        aggregation would have aborted (count < min_clients)."""
        from dpfl_tf.federated.distributed_dp import unflatten

        mech = self.mechanism
        info: dict[str, Any] = {"clip": mech.l2_norm_clip, "bits": mech.bits, "uploads": int(count)}
        if count < mech.min_clients:
            info["aborted"] = (
                f"{count} uploads < min_clients={mech.min_clients}: the secure "
                "aggregation releases nothing"
            )
            return AggregateResult(
                [tf.zeros_like(t) for t in template], int(count), info, released=False
            )
        flat = mech.decode(total, self.rotation_seed()) / count
        shapes = [tuple(t.shape) for t in template]
        update = [tf.constant(a, dtype=t.dtype) for a, t in zip(unflatten(flat, shapes), template)]
        return AggregateResult(update, int(count), info)

    def round_event(self, num_components, sampling, **sampling_args):
        return self.mechanism.round_event(sampling, **sampling_args)

    def server_report(self, participations: np.ndarray, delta: float) -> dict:
        """Epsilon against the server, per client: `DistributedDP.event` (replace-one, no
        amplification: the server knows who took part) composed over the most rounds
        one client took part in ('rdp' accountant)."""
        from dpfl_tf.privacy.accountants import compute_epsilon
        from dpfl_tf.privacy.events import describe_event

        n_max = int(participations.max()) if len(participations) else 0
        event = self.mechanism.event()
        eps = (
            compute_epsilon(dp_accounting.SelfComposedDpEvent(event, n_max), delta, "rdp")
            if n_max
            else 0.0
        )
        return {
            "participation_event": describe_event(event),
            "max_participations": n_max,
            "mean_participations": float(np.mean(participations)) if len(participations) else 0.0,
            "epsilon": None if math.isinf(eps) else eps,
            "delta": delta,
            "epsilon_is_infinite": math.isinf(eps),
            "accountant": "rdp",
            "relation": "replace-one (the server knows who took part)",
            "note": "per client, over the rounds it took part in; the server sees only "
            "the secure sum of >= min_clients noised vectors",
        }

    def get_state(self) -> dict:
        return {"rotation_key": self.rotation_key}

    def set_state(self, state: dict) -> None:
        if "rotation_key" in state:
            self.rotation_key = int(state["rotation_key"])

    def get_config(self) -> dict:
        mech = self.mechanism
        return {
            "name": "distributed_dp",
            "mechanism": mech.mechanism.value,
            "bits": mech.bits,
            "clip": mech.l2_norm_clip,
            "noise_multiplier": mech.noise_multiplier,
            "clients_per_round": mech.clients_per_round,
            "min_clients": mech.min_clients,
            "dimension": mech.dimension,
            "beta": mech.beta,
            "overflow_probability": mech.overflow_probability,
            "block_size": mech.block_size,
            "dropout_rate": self.dropout_rate,
            "secure_mode": self.secure_mode,
        }


def dropped_out(rate: float, seed: int, t: int, client_id: int) -> bool:
    """The simulated dropout of client k in round t: (seed, "dropout", t, k) < rate (the
    in-process aggregator and Flower's dropout mod draw the same)."""
    return bool(derive_rng(int(seed), "dropout", int(t), int(client_id)).random() < rate)
