"""Correlated noise, step by step: the TensorFlow side of matrix factorization.

`CorrelatedNoise` produces, at step t of a `MatrixMechanism`, the noise
w_t = (M zeta)_t (`dpfl_tf.privacy.matrix_factorization`), for a list of
tensors (a model's variables, or a federated update), from a fixed number of
stored noise vectors -- never the n x n matrix:

* tree aggregation (Kairouz et al. 2021, Algorithm 1, online, restarted):
  one buffer per level l = 0..floor(log2 m).  At position p (1-based in its
  tree) with v trailing zero bits, the prefix noise changes by the new node
  of level v minus the nodes of levels < v that it replaces:
      w = zeta - sum_{l < v} buf_l,   buf_v <- zeta;
* banded Toeplitz (Choquette-Choo et al. 2023, Algorithm 9): the b - 1 last
  outputs, c_0 w = zeta - sum_{j >= 1} c_j w_{t - j};
* BLT (McMahan et al. 2024, arXiv:2408.08868, Algorithm 3): d buffers,
  w = zeta - sum_j omega_j buf_j,  buf_j <- theta_j buf_j + w.

zeta_t ~ N(0, 1) per coordinate is drawn statelessly from (key, index), one
draw per chunk of tensors (`dpfl_tf.sanitizer.stateless_normals`), where the
*index* is a monotonic release counter supplied by the caller (DP-SGD's lots
computed, a federated round):
a seeded run resumed from its state continues the same correlated noise, and
an index is never drawn twice in a process (`next` refuses an index at or
below the last one).  The key comes from OS entropy (two 63-bit words, never
saved) unless a seed is given (tests); secure mode draws zeta as in
`dpfl_tf.secure_random` (four float64 normals) and keeps the buffers in float64,
so the noised value is rounded once.

The state (position and buffers) is *secret*: the buffers are sums of past
noise, and whoever holds them with the released models can subtract part of
the noise.  `get_state` returns it for a checkpoint that must be kept as
private as the training data.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import tensorflow as tf

from dpfl_tf import secure_random
from dpfl_tf.privacy.matrix_factorization import (
    BandedToeplitz,
    BufferedToeplitz,
    MatrixMechanism,
    TreeAggregation,
)
from dpfl_tf.sanitizer import GaussianSanitizer, noise_seed, stateless_normals, stream_key

__all__ = ["CorrelatedNoise", "CorrelatedSanitizer", "CorrelatedRun"]


class CorrelatedNoise:
    """The step-by-step noise of one `MatrixMechanism` for tensors of given shapes.

    Args:
      mechanism: the `MatrixMechanism` (its strategy and horizon n).
      shapes: the shape of each tensor the noise is added to.
      seed: a seed for tests (default: an OS-entropy key, never saved).
      secure_mode: zeta as in `dpfl_tf.secure_random`, float64 buffers; refuses a seed.
      dtype: the dtype of the noise (float32); float64 in secure mode.

    ``next(index)`` returns the unit-scale noise of the next step (the caller
    multiplies by the std s = sigma * clip * sens).
    """

    def __init__(
        self,
        mechanism: MatrixMechanism,
        shapes: Sequence,
        *,
        seed: int | None = None,
        secure_mode: bool = False,
        dtype=tf.float32,
    ):
        if not isinstance(mechanism, MatrixMechanism):
            raise TypeError(f"mechanism must be a MatrixMechanism, got {type(mechanism).__name__}")
        self.mechanism = mechanism
        self.secure_mode = bool(secure_mode)
        self.seed = seed
        self.noise_key = stream_key(seed, self.secure_mode)
        self.dtype = tf.float64 if self.secure_mode else tf.as_dtype(dtype)
        self.shapes = [tf.TensorShape(s) for s in shapes]
        strategy, n = mechanism.strategy, mechanism.steps
        self.steps = n
        self.num_buffers = strategy.buffers(n)
        if isinstance(strategy, TreeAggregation):
            self._kind, self._period = "tree", strategy._period(n)
        elif isinstance(strategy, BandedToeplitz):
            c = strategy.coefficients(n)
            self._kind = "banded"
            self._c0 = float(c[0])
            self._c = tf.constant(c[1 : 1 + self.num_buffers], self.dtype)
        elif isinstance(strategy, BufferedToeplitz):
            self._kind = "blt"
            self._theta = tf.constant(strategy.buf_decay, self.dtype)
            self._omega = tf.constant(strategy.output_scale, self.dtype)
        else:
            raise TypeError(f"no step-by-step generator for {strategy.describe()}")
        with tf.init_scope():
            self.position = tf.Variable(0, dtype=tf.int64, trainable=False, name="mf_position")
            self.last_index = tf.Variable(-1, dtype=tf.int64, trainable=False, name="mf_last_index")
            self.buffers = [
                tf.Variable(
                    tf.zeros([max(self.num_buffers, 1)] + s.as_list(), self.dtype),
                    trainable=False,
                    name=f"mf_buffer_{j}",
                )
                for j, s in enumerate(self.shapes)
            ]
        self._high_water = 0  # positions released in this process (Python side)

    # -- one step ---------------------------------------------------------------
    def _zetas(self, index) -> list[tf.Tensor]:
        """zeta of every tensor from stream `index`: `stateless_normals` (secure
        mode: one `secure_normal64` draw per tensor)."""
        if self.secure_mode:
            return [
                secure_random.secure_normal64(shape, 1.0, seed=noise_seed(self.noise_key, index, j))
                for j, shape in enumerate(self.shapes)
            ]
        specs = [tf.TensorSpec(shape, self.dtype) for shape in self.shapes]
        return stateless_normals(specs, self.noise_key, index)

    def next(self, index) -> list[tf.Tensor]:
        """The noise of the next position, zeta drawn from stream `index`.

        In eager mode, refuses a position beyond the horizon and an index not
        above the last one (Python checks with a message); in a graph the
        caller's guard keeps the position below the horizon (`DPModel` stops at
        it with a lot limit) and the index is monotonic by construction.
        """
        if tf.executing_eagerly():
            self.check_next(int(index))
        index = tf.cast(index, tf.int64)
        pos = self.position
        outs = []
        for zeta, buf in zip(self._zetas(index), self.buffers):
            w, new_buf = self._step(zeta, buf, pos)
            buf.assign(new_buf)
            outs.append(w)
        with tf.control_dependencies(outs):
            pos.assign_add(1)
            self.last_index.assign(index)
        if tf.executing_eagerly():
            self._high_water = int(pos.numpy())
        return outs

    def check_next(self, index: int) -> None:
        last = int(self.last_index.numpy())
        if index <= last:
            raise ValueError(
                f"noise index {index} was already drawn (last index {last}): a "
                "replayed step never reuses noise"
            )
        position = int(self.position.numpy())
        if position >= self.steps:
            raise ValueError(
                f"the mechanism's horizon of {self.steps} steps is reached (position "
                f"{position}): a further step would release a row the strategy does not have; "
                "declare more steps in the participation"
            )

    def _step(self, zeta, buf, pos):
        if self._kind == "tree":
            t = tf.math.floormod(pos, self._period) + 1
            levels = tf.range(self.num_buffers, dtype=tf.int64)
            below = tf.equal(
                tf.math.floormod(t, tf.bitwise.left_shift(tf.constant(2, tf.int64), levels)), 0
            )  # l < v
            at = tf.logical_and(
                tf.equal(
                    tf.math.floormod(t, tf.bitwise.left_shift(tf.constant(1, tf.int64), levels)), 0
                ),
                tf.logical_not(below),
            )  # l == v
            w = zeta - tf.tensordot(tf.cast(below, self.dtype), buf, axes=1)
            shape = [-1] + [1] * zeta.shape.rank
            new = tf.where(tf.reshape(at, shape), zeta[None], buf)
            return w, new
        if self._kind == "banded":
            if self.num_buffers == 0:
                return zeta / self._c0, buf
            w = (zeta - tf.tensordot(self._c, buf, axes=1)) / self._c0
            return w, tf.concat([w[None], buf[:-1]], axis=0)
        w = zeta - tf.tensordot(self._omega, buf, axes=1)
        shape = [-1] + [1] * zeta.shape.rank
        return w, tf.reshape(self._theta, shape) * buf + w[None]

    # -- state ------------------------------------------------------------------
    def get_state(self) -> dict:
        """Position, last index and buffers (SECRET: module docstring)."""
        return {
            "position": int(self.position.numpy()),
            "last_index": int(self.last_index.numpy()),
            "buffers": [b.numpy() for b in self.buffers],
        }

    def set_state(self, state: dict) -> None:
        """Continues from a saved state.  Refuses one behind the positions this
        object already released (that would release those rows again)."""
        position = int(state["position"])
        released = max(self._high_water, int(self.position.numpy()))
        if position < released:
            raise ValueError(
                f"state position {position} is behind the {released} steps already "
                "released: restoring it would replay released steps"
            )
        buffers = state["buffers"]
        if len(buffers) != len(self.buffers):
            raise ValueError(f"state has {len(buffers)} buffers, expected {len(self.buffers)}")
        for var, value in zip(self.buffers, buffers):
            value = np.asarray(value)
            if tuple(value.shape) != tuple(var.shape):
                raise ValueError(f"state buffer of shape {value.shape}, expected {var.shape}")
            var.assign(tf.cast(value, self.dtype))
        self.position.assign(position)
        self.last_index.assign(int(state.get("last_index", -1)))
        self._high_water = position


class CorrelatedSanitizer(GaussianSanitizer):
    """The Gaussian sanitizer whose noise is a `MatrixMechanism`'s correlated noise.

    Clipping is the parent's; component j of step t gets
    s_j * sens(C) * w_t, with s_j the parent's std for component j
    (sigma * C_tot, or sigma * C_j for proportional per-layer allocation) and
    w_t the unit noise of `CorrelatedNoise`.  `event` is the mechanism's event
    for the whole run with the effective multiplier (`GaussianSanitizer`)."""

    def __init__(
        self,
        l2_norm_clip,
        mechanism: MatrixMechanism,
        *,
        noise_allocation: str = "global",
        seed: int | None = None,
        secure_mode: bool = False,
    ):
        super().__init__(
            l2_norm_clip,
            mechanism.noise_multiplier,
            noise_allocation=noise_allocation,
            seed=seed,
            secure_mode=secure_mode,
        )
        self.mechanism = mechanism
        self.noise: CorrelatedNoise | None = None

    def build(self, template: Sequence) -> CorrelatedNoise:
        """Creates the noise state for tensors shaped like `template` (once)."""
        if self.noise is None:
            self.noise = CorrelatedNoise(
                self.mechanism,
                [t.shape for t in template],
                seed=self.seed,
                secure_mode=self.secure_mode,
            )
        return self.noise

    def noise_stddevs(self, num_components: int) -> tuple[float, ...]:
        """s_j sens(C): the std of zeta on component j."""
        sens = self.mechanism.sensitivity
        return tuple(s * sens for s in super().noise_stddevs(num_components))

    def add_noise(self, summed, groups=None, *, step=None) -> list[tf.Tensor]:
        """sum + s_j sens w_t (class docstring); `step` is the monotonic stream
        index (DP-SGD's lots computed).  Without it (eager calls only: a
        federated round) the index is the mechanism's position, which only
        moves forward."""
        groups = list(range(len(summed))) if groups is None else list(groups)
        stds = self.noise_stddevs(max(groups) + 1)
        noise = self.build(summed)
        if step is None:
            if not tf.executing_eagerly():
                raise ValueError(
                    "CorrelatedSanitizer.add_noise needs step (a monotonic "
                    "release index) inside a tf.function, got None"
                )
            step = int(noise.position.numpy())
        noise = noise.next(step)
        out = []
        for s, w, g in zip(summed, noise, groups):
            if self.secure_mode:
                out.append(tf.cast(tf.cast(s, tf.float64) + stds[g] * w, s.dtype))
            else:
                out.append(s + tf.cast(stds[g], s.dtype) * tf.cast(w, s.dtype))
        return out

    def event(self, num_components: int, *args, **kwargs):
        """The mechanism's event for its whole run (sampling arguments are the
        participation's, so any passed here are ignored)."""
        import dataclasses

        sigma = self.effective_noise_multiplier(num_components)
        return dataclasses.replace(self.mechanism, noise_multiplier=sigma).event()

    def get_config(self) -> dict:
        config = super().get_config()
        config.pop("noise_multiplier")
        return {**config, "mechanism": self.mechanism.to_config()}

    @classmethod
    def from_config(cls, config: dict) -> "CorrelatedSanitizer":
        config = dict(config)
        mechanism = MatrixMechanism.from_config(config.pop("mechanism"))
        return cls(config.pop("l2_norm_clip"), mechanism, **config)

    def __repr__(self) -> str:
        return (
            f"CorrelatedSanitizer(l2_norm_clip={self.l2_norm_clip!r}, "
            f"mechanism={self.mechanism.describe()!r})"
        )


class CorrelatedRun:
    """One correlated-noise run of DP-SGD: the mechanism, where it started (the
    model's lot number of position 0), its sanitizer and noise state, and
    whether its event is in the ledger.  Made by
    `DPOptimizer.plan_correlated_run`; a later `fit` continues it when it
    starts at the run's next position with the same participation.

    Args:
      mechanism: the `MatrixMechanism` (horizon = the run's lots).
      first_lot: the model's lot number of position 0.
      sampling: the sampling method of the run's lots.
      noise_allocation, seed, secure_mode: as for `GaussianSanitizer`.
    """

    def __init__(
        self,
        mechanism: MatrixMechanism,
        *,
        first_lot: int,
        sampling,
        noise_allocation: str = "global",
        seed: int | None = None,
        secure_mode: bool = False,
        recorded: bool = False,
    ):
        from dpfl_tf.privacy.events import SamplingMethod

        self.mechanism = mechanism
        self.first_lot = int(first_lot)
        self.sampling = SamplingMethod.parse(sampling)
        self.noise_allocation = noise_allocation
        self.seed = seed
        self.secure_mode = bool(secure_mode)
        self.recorded = bool(recorded)
        self._sanitizer: CorrelatedSanitizer | None = None
        self._bounds = None
        self._pending_state = None

    def sanitizer(self, bounds) -> CorrelatedSanitizer:
        """The run's sanitizer (one per run: its noise state carries over)."""
        if self._sanitizer is None:
            self._sanitizer = CorrelatedSanitizer(
                bounds,
                self.mechanism,
                noise_allocation=self.noise_allocation,
                seed=self.seed,
                secure_mode=self.secure_mode,
            )
            self._bounds = bounds
        elif bounds != self._bounds:
            raise ValueError(
                f"the clip bounds changed within a correlated-noise run "
                f"({self._bounds!r} -> {bounds!r}); start a new run"
            )
        return self._sanitizer

    def build(self, variables) -> CorrelatedNoise:
        """The noise state for the model's variables (restored if pending)."""
        noise = self._sanitizer.build(variables)
        if self._pending_state is not None:
            noise.set_state(self._pending_state)
            self._pending_state = None
        return noise

    @property
    def position(self) -> int:
        """Steps of the mechanism released so far."""
        if self._sanitizer is not None and self._sanitizer.noise is not None:
            return int(self._sanitizer.noise.position.numpy())
        if self._pending_state is not None:
            return int(self._pending_state["position"])
        return 0

    @property
    def remaining(self) -> int:
        return self.mechanism.steps - self.position

    def continues(self, sampler, first_lot: int, lots: int) -> bool:
        """Whether a fit of `lots` of `sampler`'s lots from `first_lot` is the
        rest of this run: a run that has begun, same sampling and epoch length,
        its next position, its remaining steps, and (shuffled epochs) at an
        epoch boundary of the run."""
        from dpfl_tf.privacy.events import SamplingMethod

        position = self.position
        if (
            sampler.sampling is not self.sampling
            or position == 0
            or lots != self.mechanism.steps - position
            or first_lot != self.first_lot + position
        ):
            return False
        if sampler.participation(self.mechanism.steps) != self.mechanism.participation:
            return False
        if self.sampling is SamplingMethod.SHUFFLE:
            return position % sampler.lots_per_epoch == 0
        if self.sampling is SamplingMethod.CYCLIC_POISSON:  # the same groups
            return sampler.seed is not None and self.seed is not None
        return True

    def get_state(self) -> dict:
        """The run for a checkpoint (SECRET: holds the noise buffers)."""
        noise = self._sanitizer.noise if self._sanitizer is not None else None
        return {
            "mechanism": self.mechanism.to_config(),
            "first_lot": self.first_lot,
            "sampling": self.sampling.value,
            "recorded": self.recorded,
            "noise": noise.get_state() if noise is not None else self._pending_state,
        }

    @classmethod
    def from_state(
        cls,
        state: dict,
        *,
        noise_allocation: str = "global",
        seed: int | None = None,
        secure_mode: bool = False,
    ) -> "CorrelatedRun":
        run = cls(
            MatrixMechanism.from_config(state["mechanism"]),
            first_lot=state["first_lot"],
            sampling=state["sampling"],
            noise_allocation=noise_allocation,
            seed=seed,
            secure_mode=secure_mode,
            recorded=state["recorded"],
        )
        run._pending_state = state["noise"]
        return run
