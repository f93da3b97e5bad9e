"""The Gaussian sanitizer: clip records, sum them, add noise once, say what it cost.

One mechanism serves every private computation in dpfl_tf.  A *record* is a
list of tensors -- a per-example gradient (DP-SGD, Abadi et al. 2016,
Algorithm 1) or a client's model update (Global DP, Geyer et al. 2017; DP-FedAvg).
The only difference between sample-level and client-level DP is which records
are fed in.

Life cycle (after the DPQuery idea of tensorflow-privacy):
  ``state = initial_state(template)`` -> ``accumulate(state, clip_batch(...))`` for
  each batch of records -> ``noised_sum(state, ...)`` returning the noised sum and
  the `DpEvent` describing it.

Clipping
  *flat*: one bound C on the L2 norm of the whole record:
      g <- g * min(1, C / ||g||_2).
  *per-layer*: a bound C_j per component (variable) j:
      g_j <- g_j * min(1, C_j / ||g_j||_2),
  so the clipped record's total norm is at most C_tot = sqrt(sum_j C_j^2).
  Norms are guarded: the factor is computed as C / max(||g||, C), never C / 0.

Non-finite records
  A record whose norm is NaN or inf (a NaN pixel, an overflowing loss) cannot
  be clipped.  Its factor is 0 and its every component is zeroed with
  ``tf.where`` (not multiplied: 0 * NaN is NaN), so the sum stays finite and the
  sensitivity stays C: the lot is applied and counted as usual, and the record
  is reported as *dropped* (`dropped_records`).  The rule is part of the
  computation (no assert, which XLA would drop), so it holds in eager, graph,
  XLA and distributed execution alike.  Note that dropping is itself
  data-dependent only through the dropped record, exactly like clipping it to
  norm 0, which is within the add/remove-one analysis.

Noise and sensitivity
  Component j of the sum gets N(0, s_j^2) noise.  Adding or removing one
  record moves component j by at most C_j, so after scaling component j by
  1/s_j the sum has L2 sensitivity sqrt(sum_j (C_j/s_j)^2) and unit noise: the
  release is a Gaussian mechanism with noise multiplier

      sigma_eff = 1 / sqrt(sum_j (C_j / s_j)^2).

  Flat clipping (one bound on the whole record, however many components):
  s = sigma C, sigma_eff = sigma.  Per-layer clipping with
  ``noise_allocation="global"`` (default): s_j = sigma C_tot, sigma_eff = sigma.
  With ``"proportional"``: s_j = sigma C_j, sigma_eff = sigma / sqrt(k) for k
  components -- the same noise per unit of bound, but k times the sensitivity.
"""

from __future__ import annotations

import math
from typing import Sequence

import dp_accounting
import tensorflow as tf

from dpfl_tf import secure_random
from dpfl_tf._seeds import noise_key
from dpfl_tf._validation import check_number
from dpfl_tf.privacy.events import SamplingMethod, gaussian_step_event

__all__ = ["GaussianSanitizer", "NoiseAllocation", "deployment_note", "make_generator"]

NoiseAllocation = ("global", "proportional")


def deployment_note(seed) -> str | None:
    """What a run with a fixed seed must say (None without a seed)."""
    if seed is None:
        return None
    return (
        f"seed={seed}: sampling and noise are reproducible, so this run is NOT for "
        "deployment (DP noise must come from OS entropy)"
    )


def make_generator(seed: int | None = None, *, secure_mode: bool = False) -> tf.random.Generator:
    """OS-entropy generator by default; a seeded one only when asked (tests,
    debugging); with `secure_mode`, keyed from the OS's secure source
    (`dpfl_tf.secure_random`)."""
    if secure_mode:
        secure_random.refuse_seed(secure_mode, seed)
        return secure_random.secure_generator()
    if seed is None:
        return tf.random.Generator.from_non_deterministic_state()
    # The seed is the Philox *key*: distinct seeds give independent streams.
    # (`from_seed` puts the seed in the counter, so seeds k and k+1 would give
    # shifted copies of one stream.)
    return tf.random.Generator.from_key_counter(key=int(seed) % 2**63, counter=[0, 0], alg="philox")


#: the noise key of a seeded run (derived with the library's other seeds)
seeded_noise_key = noise_key


def stream_key(seed: int | None, secure_mode: bool) -> tuple[int, int]:
    """The key of a stateless noise stream: hashed from the seed when seeded
    (so a resumed run continues the same stream at lot t), otherwise two fresh
    63-bit words from `secrets` (126 bits), held in memory only, never saved.
    Secure mode refuses a seed."""
    secure_random.refuse_seed(secure_mode, seed)
    if seed is not None:
        return seeded_noise_key(seed)
    return (secure_random.secure_key(), secure_random.secure_key())


def noise_seed(noise_key, step, j: int) -> tf.Tensor:
    """The stateless seed of draw j in lot `step`: [k0 XOR step, k1 XOR j] (draw j:
    chunk j of `stateless_normals`; in secure mode, tensor j).

    Both words of the 2 x 63-bit key enter every seed (TensorFlow hashes the
    whole 128-bit seed into Philox's key and counter), and distinct (step, j)
    give distinct seeds.  (`stateless_fold_in` would not do: it returns a seed
    of the dtype of its data, so folding in a Python int leaves a seed with 32
    random bits -- a noise stream an observer could search exhaustively.)"""
    key = tf.constant(list(noise_key), tf.int64)
    mix = tf.stack([tf.cast(step, tf.int64), tf.constant(j, tf.int64)])
    return tf.bitwise.bitwise_xor(key, mix)


NOISE_CHUNK = 1 << 22  # values per stateless draw (16 MB of float32)


def stateless_normals(like: Sequence[tf.Tensor], noise_key, step) -> list[tf.Tensor]:
    """Standard normal tensors of the shapes and dtypes of `like`, for stream
    position `step`.  The tensors are packed, in order, into chunks of one dtype
    and at most `NOISE_CHUNK` values (a larger tensor, or one of unknown size, is
    a chunk of its own); chunk k is one Philox draw from `noise_seed(noise_key,
    step, k)`, cut into its tensors.  Every value is an independent N(0, 1) draw
    either way; one draw per chunk rather than per tensor because tracing a
    draw's seed scrambling takes ~30 ms: seconds for a model with a hundred
    variables.  A chunk bounds what the cutting copies."""
    chunks: list[list[int]] = []  # indices into `like`
    dtype, filled = None, 0  # the last chunk's, None once it takes no more tensors
    for i, t in enumerate(like):
        size = t.shape.num_elements()
        if size is not None and t.dtype == dtype and filled + size <= NOISE_CHUNK:
            chunks[-1].append(i)
            filled += size
        else:
            chunks.append([i])
            dtype, filled = (t.dtype, size) if size is not None else (None, 0)
    out: list = [None] * len(like)
    for k, chunk in enumerate(chunks):
        seed = noise_seed(noise_key, step, k)
        first = like[chunk[0]]
        if len(chunk) == 1:
            shape = first.shape if first.shape.is_fully_defined() else tf.shape(first)
            out[chunk[0]] = tf.random.stateless_normal(
                shape, seed=seed, dtype=first.dtype, alg="philox"
            )
            continue
        sizes = [like[i].shape.num_elements() for i in chunk]
        flat = tf.random.stateless_normal([sum(sizes)], seed=seed, dtype=first.dtype, alg="philox")
        for i, piece in zip(chunk, tf.split(flat, sizes)):
            out[i] = tf.reshape(piece, like[i].shape)
    return out


def flat_clip_factor(squared_norm: tf.Tensor, bound) -> tf.Tensor:
    """min(1, C / ||g||) from ||g||^2 (any shape), and 0 where ||g||^2 is not
    finite; `bound` C may be a float or a tensor (a bound that moves, as adaptive
    clipping's)."""
    squared_norm = tf.convert_to_tensor(squared_norm)
    finite = tf.math.is_finite(squared_norm)
    norm = tf.sqrt(tf.where(finite, squared_norm, 0.0))
    # a Python bound straight into the norm's dtype (tf.cast of a float would round it
    # through float32 first: a float64 record clipped to C = 0.1 kept norm 0.10000000149)
    c = tf.cast(bound, norm.dtype) if tf.is_tensor(bound) else tf.constant(bound, norm.dtype)
    return tf.where(finite, c / tf.maximum(norm, c), 0.0)


class GaussianSanitizer:
    """Clip (flat or per-layer) + sum + Gaussian noise, with its `DpEvent`.

    Args:
      l2_norm_clip: a float (flat clipping) or a sequence of floats, one per
        record component (per-layer clipping).
      noise_multiplier: sigma >= 0 (0 means no noise: the event is then
        non-private, and accountants report eps = inf).
      noise_allocation: per-layer only; "global" or "proportional" (see module).
      seed: seeds the noise generator (tests only; default is OS entropy).
      generator: an explicit `tf.random.Generator` (overrides seed).
      secure_mode: noise keyed from the OS's secure source and drawn so that
        floating-point attacks do not apply (`dpfl_tf.secure_random`); refuses
        a seed.
    """

    def __init__(
        self,
        l2_norm_clip: float | Sequence[float],
        noise_multiplier: float,
        *,
        noise_allocation: str = "global",
        seed: int | None = None,
        generator: tf.random.Generator | None = None,
        secure_mode: bool = False,
    ):
        if isinstance(l2_norm_clip, (list, tuple)):
            if len(l2_norm_clip) == 0:
                raise ValueError("l2_norm_clip must be a float or a non-empty list, got []")
            self._clips = tuple(
                check_number(f"l2_norm_clip[{i}]", c, low=0.0, low_open=True)
                for i, c in enumerate(l2_norm_clip)
            )
            self.per_layer = True
        else:
            self._clips = (check_number("l2_norm_clip", l2_norm_clip, low=0.0, low_open=True),)
            self.per_layer = False
        self.noise_multiplier = check_number("noise_multiplier", noise_multiplier, low=0.0)
        if noise_allocation not in NoiseAllocation:
            raise ValueError(
                f"noise_allocation must be one of {NoiseAllocation}, got {noise_allocation!r}"
            )
        self.noise_allocation = noise_allocation
        self.secure_mode = bool(secure_mode)
        self.seed = seed
        self._generator = generator
        # key of the stateless per-lot noise stream (`add_noise(..., step=t)`)
        self.noise_key = stream_key(seed, self.secure_mode)

    # -- configuration ------------------------------------------------------
    @property
    def l2_norm_clip(self) -> float | tuple[float, ...]:
        return self._clips if self.per_layer else self._clips[0]

    @property
    def generator(self) -> tf.random.Generator:
        if self._generator is None:  # created lazily, inside whatever scope first needs it
            self._generator = make_generator(self.seed, secure_mode=self.secure_mode)
        return self._generator

    def clip_bounds(self, num_components: int) -> tuple[float, ...]:
        """The bound C_j of each component."""
        if not self.per_layer:
            return self._clips * num_components
        if len(self._clips) != num_components:
            raise ValueError(
                f"per-layer l2_norm_clip has {len(self._clips)} bounds but the "
                f"record has {num_components} components (trainable variables)"
            )
        return self._clips

    def total_clip(self, num_components: int) -> float:
        """C_tot: the largest L2 norm of one clipped record."""
        if not self.per_layer:
            return self._clips[0]
        return math.sqrt(sum(c * c for c in self.clip_bounds(num_components)))

    def noise_stddevs(self, num_components: int) -> tuple[float, ...]:
        """s_j, the noise standard deviation added to component j of the sum."""
        bounds = self.clip_bounds(num_components)
        if self.per_layer and self.noise_allocation == "proportional":
            return tuple(self.noise_multiplier * c for c in bounds)
        return (self.noise_multiplier * self.total_clip(num_components),) * num_components

    def effective_noise_multiplier(self, num_components: int) -> float:
        """sigma_eff = 1 / sqrt(sum_j (C_j / s_j)^2) (module docstring)."""
        if self.noise_multiplier == 0:
            return 0.0
        if not self.per_layer:  # one bound on the whole record: sensitivity C, noise sigma C
            return self.noise_multiplier
        bounds = self.clip_bounds(num_components)
        # this class's s_j (a subclass may scale its noise by a strategy's sensitivity)
        stds = GaussianSanitizer.noise_stddevs(self, num_components)
        return 1.0 / math.sqrt(sum((c / s) ** 2 for c, s in zip(bounds, stds)))

    def event(
        self,
        num_components: int,
        sampling: SamplingMethod | str = SamplingMethod.POISSON,
        **sampling_args,
    ) -> dp_accounting.DpEvent:
        """The event of one noised sum released by this sanitizer."""
        sigma = self.effective_noise_multiplier(num_components)
        if sigma == 0:
            return dp_accounting.NonPrivateDpEvent()
        return gaussian_step_event(sigma, sampling, **sampling_args)

    def get_config(self) -> dict:
        return {
            "l2_norm_clip": list(self._clips) if self.per_layer else self._clips[0],
            "noise_multiplier": self.noise_multiplier,
            "noise_allocation": self.noise_allocation,
            "seed": self.seed,
            "secure_mode": self.secure_mode,
        }

    @classmethod
    def from_config(cls, config: dict) -> "GaussianSanitizer":
        return cls(**config)

    # -- clipping -------------------------------------------------------------
    def clip_factors(self, squared_norms: Sequence[tf.Tensor]) -> list[tf.Tensor]:
        """Per-record scale factors min(1, C/||g||) from per-component squared norms.

        A record with any non-finite squared norm gets factor 0 in every
        component (module docstring); apply factors with `apply_factors`.

        Args:
          squared_norms: one tensor of shape [B] per component: ||g_j^(i)||^2.
        Returns:
          one tensor of shape [B] per component.
        """
        bounds = self.clip_bounds(len(squared_norms))
        squared_norms = [tf.convert_to_tensor(s) for s in squared_norms]
        total = tf.add_n(squared_norms) if len(squared_norms) > 1 else squared_norms[0]
        finite = tf.math.is_finite(total)
        if not self.per_layer:
            return [flat_clip_factor(total, bounds[0])] * len(squared_norms)
        # a record with any non-finite component gets factor 0 in all of them
        return [
            tf.where(finite, flat_clip_factor(sq, b), 0.0) for sq, b in zip(squared_norms, bounds)
        ]

    @staticmethod
    def dropped_records(factors: Sequence[tf.Tensor]) -> tf.Tensor:
        """Number of records zeroed as non-finite (factor 0: a finite norm never
        gives 0, since C / max(||g||, C) > 0)."""
        return tf.reduce_sum(tf.cast(tf.equal(factors[0], 0.0), tf.int64))

    @staticmethod
    def apply_factors(records: tf.Tensor, factor: tf.Tensor) -> tf.Tensor:
        """records[i] * factor[i], with records of factor 0 set to exactly 0
        (even if they hold NaN or inf)."""
        f = tf.reshape(tf.cast(factor, records.dtype), [-1] + [1] * (records.shape.rank - 1))
        return tf.where(f > 0, records * f, tf.zeros_like(records))

    def clip_batch(self, records: Sequence[tf.Tensor]) -> list[tf.Tensor]:
        """Clips a batch of records given as per-component tensors of shape [B, ...]."""
        records = [tf.convert_to_tensor(r) for r in records]
        sq = [
            tf.reduce_sum(tf.reshape(tf.square(r), [tf.shape(r)[0], -1]), axis=1) for r in records
        ]
        factors = self.clip_factors(sq)
        return [self.apply_factors(r, f) for r, f in zip(records, factors)]

    def clip_and_sum(self, records: Sequence[tf.Tensor]) -> list[tf.Tensor]:
        """sum_i clip(record_i), for records stacked as [B, ...] per component."""
        return [tf.reduce_sum(r, axis=0) for r in self.clip_batch(records)]

    def clip(self, record: Sequence[tf.Tensor]) -> list[tf.Tensor]:
        """Clips one record (a list of tensors)."""
        return [r[0] for r in self.clip_batch([tf.expand_dims(t, 0) for t in record])]

    # -- life cycle -------------------------------------------------------------
    def initial_state(self, template: Sequence[tf.Tensor | tf.Variable]) -> list[tf.Tensor]:
        """Zeros shaped like one record."""
        return [tf.zeros(t.shape, dtype=t.dtype) for t in template]

    @staticmethod
    def accumulate(state: Sequence[tf.Tensor], clipped_sum: Sequence[tf.Tensor]) -> list[tf.Tensor]:
        return [s + c for s, c in zip(state, clipped_sum)]

    def add_noise(
        self, summed: Sequence[tf.Tensor], groups: Sequence[int] | None = None, *, step=None
    ) -> list[tf.Tensor]:
        """sum + N(0, s_j^2) on each component.

        `groups` maps each tensor to its clipping component when one component
        (e.g. a layer) spans several tensors (its kernel and bias).

        Without `step`, the noise comes from the stateful `generator`.  With
        `step` (an integer tensor, e.g. DP-SGD's monotonic lot counter) it is
        drawn statelessly from (noise_key, step), one draw per chunk of tensors
        (`stateless_normals`): lot t always gets the stream position t, so a
        seeded run continues its stream across `fit` calls and resumes, and never
        reuses a position.  Secure mode draws each tensor's values as in
        `dpfl_tf.secure_random` (seed `noise_seed(noise_key, step, j)`) and
        rounds once."""
        groups = list(range(len(summed))) if groups is None else list(groups)
        stds = self.noise_stddevs(max(groups) + 1 if groups else 0)
        if self.noise_multiplier == 0:
            return list(summed)
        gen = self.generator if step is None else None
        if step is not None and not self.secure_mode:
            normals = stateless_normals(summed, self.noise_key, step)
            return [s + tf.cast(stds[g], s.dtype) * z for s, g, z in zip(summed, groups, normals)]
        out = []
        for j, (s, g) in enumerate(zip(summed, groups)):
            seed = None if step is None else noise_seed(self.noise_key, step, j)
            if self.secure_mode:
                out.append(secure_random.secure_add_noise(s, gen, stds[g], seed=seed))
            else:
                out.append(s + tf.cast(stds[g], s.dtype) * gen.normal(tf.shape(s), dtype=s.dtype))
        return out

    def noised_sum(
        self,
        state: Sequence[tf.Tensor],
        sampling: SamplingMethod | str = SamplingMethod.POISSON,
        groups: Sequence[int] | None = None,
        **sampling_args,
    ) -> tuple[list[tf.Tensor], dp_accounting.DpEvent]:
        """(noised sum, the event of this release)."""
        num = len(state) if groups is None else max(groups) + 1
        return self.add_noise(state, groups), self.event(num, sampling, **sampling_args)

    def __repr__(self) -> str:
        return (
            f"GaussianSanitizer(l2_norm_clip={self.l2_norm_clip!r}, "
            f"noise_multiplier={self.noise_multiplier!r}"
            + (f", noise_allocation={self.noise_allocation!r}" if self.per_layer else "")
            + (", secure_mode=True" if self.secure_mode else "")
            + ")"
        )
