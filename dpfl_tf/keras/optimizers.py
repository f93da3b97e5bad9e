"""DP optimizers for Keras 3: a wrapper for any Keras optimizer, and DP-SGD.

A Keras 3 optimizer only ever sees the summed gradient, so the per-example
work (clipping) happens in `DPModel.train_step`.  The optimizer carries the
privacy parameters (clip bound(s), noise multiplier), adds the Gaussian noise
once per lot through the shared `GaussianSanitizer`, divides by the expected lot
size and hands the result to the inner optimizer:

    w <- inner_update(w, (sum_i clip(g_i) + N(0, sigma^2 C^2 I)) / L)

(Abadi et al. 2016, Algorithm 1).  Its ordinary `apply` / `apply_gradients`
refuse to run, so a DP optimizer can never train a plain model without privacy.
"""

from __future__ import annotations

import dataclasses
import warnings
import weakref
from typing import Mapping, Sequence

import keras
import tensorflow as tf

from dpfl_tf._validation import check_number
from dpfl_tf.sanitizer import GaussianSanitizer, deployment_note
from dpfl_tf.secure_random import refuse_seed

__all__ = ["DPOptimizer", "DPSGD", "DPAdam"]

ClipSpec = float | Sequence[float] | Mapping[str, float]


def _check_clip(l2_norm_clip) -> ClipSpec:
    if isinstance(l2_norm_clip, Mapping):
        if not l2_norm_clip:
            raise ValueError("l2_norm_clip must not be an empty dict")
        return {
            str(k): check_number(f"l2_norm_clip[{k!r}]", v, low=0.0, low_open=True)
            for k, v in l2_norm_clip.items()
        }
    if isinstance(l2_norm_clip, (list, tuple)):
        if not l2_norm_clip:
            raise ValueError("l2_norm_clip must not be an empty list")
        return [
            check_number(f"l2_norm_clip[{i}]", v, low=0.0, low_open=True)
            for i, v in enumerate(l2_norm_clip)
        ]
    return check_number("l2_norm_clip", l2_norm_clip, low=0.0, low_open=True)


@keras.saving.register_keras_serializable(package="dpfl_tf")
class DPOptimizer(keras.optimizers.Optimizer):
    """Makes any Keras optimizer differentially private (use with `DPModel`).

    Args:
      inner_optimizer: the Keras optimizer that applies the noised gradient.
      l2_norm_clip: flat bound C (float); or per-layer bounds, as a dict
        {layer name: C_layer} (a layer's kernel and bias share the bound) or a
        list with one bound per trainable variable.
      noise_multiplier: sigma; noise std is sigma * C (sigma * sqrt(sum C_j^2)
        for per-layer bounds, see `GaussianSanitizer`).  None (unset): the next
        ``DPModel.fit(..., target_epsilon=, epochs=)`` calibrates it for the
        planned lots and stores it here (so `get_config` keeps it).
      noise_allocation: per-layer only, "global" or "proportional".
      seed: seeds the noise (tests only; results then say "not for deployment").
        The noise of lot t is position t of the seed's stream, so the stream
        continues across `fit` calls and resumes.
      secure_mode: noise and lot sampling from the OS's secure source, Gaussian
        samples drawn against floating-point attacks (`dpfl_tf.secure_random`);
        refuses a seed.
      correlated_noise: a `CorrelatedNoiseConfig` (or its mechanism name:
        "tree", "banded", "blt") for noise correlated across lots
        (matrix factorization; `dpfl_tf.correlated_noise`).  `fit` then needs
        sampling "shuffle", "in_order", "cyclic_poisson" or "full_batch"; the
        strategy is optimised for the fit's lots and that participation, the
        noise of each lot is s * sens(C) * w_t, and the ledger records the run's
        event (one Gaussian with multiplier `noise_multiplier`, or k cycles of
        a Poisson-sampled one) before the first lot.
    """

    def __init__(
        self,
        inner_optimizer: keras.optimizers.Optimizer,
        *,
        l2_norm_clip: ClipSpec,
        noise_multiplier: float | None = None,
        noise_allocation: str = "global",
        seed: int | None = None,
        secure_mode: bool = False,
        correlated_noise=None,
        name: str | None = None,
        **kwargs,
    ):
        if kwargs:
            raise ValueError(
                f"DPOptimizer does not support arguments {sorted(kwargs)}; set "
                "them on the inner optimizer"
            )
        if isinstance(inner_optimizer, DPOptimizer):
            raise ValueError("inner_optimizer is already a DPOptimizer")
        if not isinstance(inner_optimizer, keras.optimizers.Optimizer):
            raise TypeError(
                "inner_optimizer must be a keras.optimizers.Optimizer, got "
                f"{type(inner_optimizer).__name__}"
            )
        super().__init__(learning_rate=0.0, name=name or f"dp_{inner_optimizer.name}")
        self.inner_optimizer = inner_optimizer
        self.l2_norm_clip = _check_clip(l2_norm_clip)
        self.noise_multiplier = (
            None
            if noise_multiplier is None
            else check_number("noise_multiplier", noise_multiplier, low=0.0)
        )
        if noise_allocation not in ("global", "proportional"):
            raise ValueError(
                f"noise_allocation must be 'global' or 'proportional', got {noise_allocation!r}"
            )
        self.noise_allocation = noise_allocation
        self.secure_mode = bool(secure_mode)
        refuse_seed(self.secure_mode, seed)
        self.seed = seed
        if seed is not None:
            warnings.warn(deployment_note(seed), UserWarning, stacklevel=2)
        self.correlated_noise = _correlated_config(correlated_noise)
        self._run = None  # the correlated-noise run in progress (`plan_correlated_run`)
        _sum_one_replica_without_all_reduce(inner_optimizer)

    # -- the sanitizer for a model's variables -------------------------------
    def clip_groups(self, variables, layer_of: Mapping[int, str]) -> tuple[list[int], ClipSpec]:
        """(group index of each variable, bounds per group) for the clip spec."""
        if isinstance(self.l2_norm_clip, float):
            return [0] * len(variables), self.l2_norm_clip
        if isinstance(self.l2_norm_clip, list):
            if len(self.l2_norm_clip) != len(variables):
                raise ValueError(
                    f"l2_norm_clip has {len(self.l2_norm_clip)} bounds but the model has "
                    f"{len(variables)} trainable variables: "
                    f"{[v.path for v in variables]}"
                )
            return list(range(len(variables))), list(self.l2_norm_clip)
        names = [layer_of[id(v)] for v in variables]
        missing = sorted(set(names) - set(self.l2_norm_clip))
        unknown = sorted(set(self.l2_norm_clip) - set(names))
        if missing or unknown:
            raise ValueError(
                f"per-layer l2_norm_clip must name every trainable layer: missing "
                f"{missing}, unknown {unknown}"
            )
        order = list(dict.fromkeys(names))
        return [order.index(n) for n in names], [self.l2_norm_clip[n] for n in order]

    def make_sanitizer(self, bounds: ClipSpec) -> GaussianSanitizer:
        if self._run is not None:
            return self._run.sanitizer(bounds)
        if self.noise_multiplier is None:
            raise ValueError(
                "noise_multiplier is unset (None): pass it to the optimizer, or pass "
                "target_epsilon= (and epochs=) to DPModel.fit to calibrate it"
            )
        return GaussianSanitizer(
            bounds,
            self.noise_multiplier,
            noise_allocation=self.noise_allocation,
            seed=self.seed,
            secure_mode=self.secure_mode,
        )

    # -- correlated noise ---------------------------------------------------------
    def plan_correlated_run(self, sampler, *, lots: int, first_lot: int, built=None):
        """The correlated-noise run for a fit of `lots` lots from lot `first_lot`
        (None without `correlated_noise`): the run in progress when this fit
        finishes it (same participation, its next position is this fit's first
        lot, its remaining steps are this fit's lots), else a new one of `lots`
        steps.  `built`: a mechanism already built for this participation (its
        strategy is reused, its noise multiplier replaced by this optimizer's)."""
        if self.correlated_noise is None:
            self._run = None
            return None
        if self.noise_multiplier is None:
            raise ValueError(
                f"correlated_noise={self.correlated_noise!r} needs noise_multiplier set, "
                "or fit(target_epsilon=...) to calibrate it (nothing was trained)"
            )
        from dpfl_tf.correlated_noise import CorrelatedRun

        run = self._run
        if run is None or not run.continues(sampler, first_lot, lots):
            participation = sampler.participation(lots)
            if built is not None and built.participation == participation:
                mechanism = dataclasses.replace(built, noise_multiplier=self.noise_multiplier)
            else:
                mechanism = self.correlated_noise.build(participation, self.noise_multiplier)
            run = CorrelatedRun(
                mechanism,
                first_lot=first_lot,
                noise_allocation=self.noise_allocation,
                seed=self.seed,
                secure_mode=self.secure_mode,
                sampling=sampler.sampling,
            )
        self._run = run
        return run

    @property
    def correlated_run(self):
        """The correlated-noise run of the last fit (None without one)."""
        return self._run

    def restore_correlated_run(self, state: dict) -> None:
        """Continues a run saved with ``correlated_run.get_state()`` (in another
        process): the next `fit` that starts at its next lot continues its
        noise instead of starting (and recording) a new run."""
        from dpfl_tf.correlated_noise import CorrelatedRun

        if self.correlated_noise is None:
            raise ValueError("restore_correlated_run needs an optimizer with correlated_noise")
        self._run = CorrelatedRun.from_state(
            state,
            noise_allocation=self.noise_allocation,
            seed=self.seed,
            secure_mode=self.secure_mode,
        )

    # -- optimizer protocol ---------------------------------------------------
    def build(self, var_list):
        if not self.inner_optimizer.built:  # a second build would make its slots twice
            self.inner_optimizer.build(var_list)
        super().build(var_list)

    @property
    def variables(self):
        return self._variables + self.inner_optimizer.variables

    def apply_noised_gradients(self, grads, trainable_variables):
        """Applies gradients that `DPModel` has clipped, noised and normalised."""
        return self.inner_optimizer.apply(grads, trainable_variables)

    def apply(self, grads, trainable_variables=None):
        raise RuntimeError(
            "DPOptimizer received ordinary (unclipped, un-noised) gradients. Train with "
            "dpfl_tf.keras.DPModel(model), whose train_step clips per example and adds the "
            "noise, or, in a custom training loop, compute the gradient with "
            "dpfl_tf.keras.dp_gradients (clipped per example, noised, recorded in a "
            "ledger) and apply it with this optimizer's apply_noised_gradients; a "
            "DPOptimizer never applies gradients without privacy."
        )

    def apply_gradients(self, grads_and_vars):
        self.apply(None)

    def stateless_apply(self, optimizer_variables, grads, trainable_variables):
        self.apply(None)

    @property
    def learning_rate(self):
        return self.inner_optimizer.learning_rate

    @learning_rate.setter
    def learning_rate(self, learning_rate):
        self.inner_optimizer.learning_rate = learning_rate

    @property
    def iterations(self):
        return self.inner_optimizer.iterations

    def finalize_variable_values(self, var_list):
        self.inner_optimizer.finalize_variable_values(var_list)

    def _dp_config(self) -> dict:
        clip = self.l2_norm_clip
        return {
            "l2_norm_clip": dict(clip) if isinstance(clip, Mapping) else clip,
            "noise_multiplier": self.noise_multiplier,
            "noise_allocation": self.noise_allocation,
            "seed": self.seed,
            "secure_mode": self.secure_mode,
            "correlated_noise": (
                None if self.correlated_noise is None else self.correlated_noise.to_config()
            ),
        }

    def get_config(self):
        return {
            "name": self.name,
            "inner_optimizer": keras.saving.serialize_keras_object(self.inner_optimizer),
            **self._dp_config(),
        }

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        inner = keras.saving.deserialize_keras_object(
            config.pop("inner_optimizer"), custom_objects=custom_objects
        )
        return cls(inner, **config)

    def __repr__(self):
        return (
            f"{type(self).__name__}(inner={type(self.inner_optimizer).__name__}, "
            f"l2_norm_clip={self.l2_norm_clip!r}, noise_multiplier={self.noise_multiplier})"
        )


def _sum_one_replica_without_all_reduce(optimizer) -> None:
    """Keras' TensorFlow optimizers sum the gradients over the replicas with
    `ReplicaContext.all_reduce` in every traced update (Keras 3.15:
    `_all_reduce_sum_gradients`).  In a graph, that call registers a new gradient
    function (`tf.custom_gradient`) in TensorFlow's global gradient registry,
    which is never emptied and holds the traced graph: each trace of a training
    step stayed in memory for good (~8,000 Python objects, which every later
    garbage collection walked again).  With one replica in sync the sum over the
    replicas is the gradient itself, and the all-reduce is skipped; with more it
    runs as before (and still leaks: TensorFlow's).  Optimizers that hand the
    update to others (`LossScaleOptimizer`, `MultiOptimizer`) get it too."""
    nested = [getattr(optimizer, "inner_optimizer", None)]
    nested += list(getattr(optimizer, "_inner_optimizers", None) or ())
    for inner in nested:
        if isinstance(inner, keras.optimizers.Optimizer):
            _sum_one_replica_without_all_reduce(inner)
    all_reduce_sum = type(optimizer)._all_reduce_sum_gradients
    owner = weakref.ref(optimizer)  # not the optimizer: it holds this function

    def sum_over_replicas(grads_and_vars):
        context = tf.distribute.get_replica_context()
        if context is not None and context.num_replicas_in_sync == 1:
            return list(grads_and_vars)
        return all_reduce_sum(owner(), grads_and_vars)

    optimizer._all_reduce_sum_gradients = sum_over_replicas


def _correlated_config(value):
    """None, a `CorrelatedNoiseConfig`, its dict, or a mechanism name."""
    if value is None:
        return None
    from dpfl_tf.privacy.matrix_factorization import CorrelatedNoiseConfig

    if isinstance(value, CorrelatedNoiseConfig):
        return value
    if isinstance(value, dict):
        return CorrelatedNoiseConfig.from_config(value)
    if isinstance(value, str):
        return CorrelatedNoiseConfig(value)
    raise TypeError(
        f"correlated_noise must be None, a CorrelatedNoiseConfig, its dict or a "
        f"mechanism name, got {type(value).__name__}"
    )


def _serialize_lr(lr):
    if isinstance(lr, keras.optimizers.schedules.LearningRateSchedule):
        return keras.optimizers.schedules.serialize(lr)
    return float(keras.ops.convert_to_numpy(lr))


def _deserialize_lr(lr):
    return keras.optimizers.schedules.deserialize(lr) if isinstance(lr, dict) else lr


@keras.saving.register_keras_serializable(package="dpfl_tf")
class DPSGD(DPOptimizer):
    """DP-SGD of Abadi et al. 2016: SGD (optionally with momentum) on the
    clipped, noised, lot-averaged gradient.  `learning_rate` may be a Keras
    schedule, e.g. the paper's linear decay then constant:
    ``keras.optimizers.schedules.PolynomialDecay(0.1, 10 * steps_per_epoch, 0.052)``."""

    def __init__(
        self,
        learning_rate=0.01,
        momentum: float = 0.0,
        nesterov: bool = False,
        *,
        l2_norm_clip: ClipSpec,
        noise_multiplier: float | None = None,
        noise_allocation: str = "global",
        seed: int | None = None,
        secure_mode: bool = False,
        correlated_noise=None,
        name: str = "dp_sgd",
    ):
        super().__init__(
            keras.optimizers.SGD(learning_rate=learning_rate, momentum=momentum, nesterov=nesterov),
            l2_norm_clip=l2_norm_clip,
            noise_multiplier=noise_multiplier,
            noise_allocation=noise_allocation,
            seed=seed,
            secure_mode=secure_mode,
            correlated_noise=correlated_noise,
            name=name,
        )

    def get_config(self):
        inner = self.inner_optimizer
        return {
            "name": self.name,
            "learning_rate": _serialize_lr(inner._learning_rate),
            "momentum": inner.momentum,
            "nesterov": inner.nesterov,
            **self._dp_config(),
        }

    @classmethod
    def from_config(cls, config, custom_objects=None):
        return _from_flat_config(cls, config)


@keras.saving.register_keras_serializable(package="dpfl_tf")
class DPAdam(DPOptimizer):
    """Adam on the clipped, noised, lot-averaged gradient."""

    def __init__(
        self,
        learning_rate=0.001,
        beta_1: float = 0.9,
        beta_2: float = 0.999,
        epsilon: float = 1e-7,
        *,
        l2_norm_clip: ClipSpec,
        noise_multiplier: float | None = None,
        noise_allocation: str = "global",
        seed: int | None = None,
        secure_mode: bool = False,
        correlated_noise=None,
        name: str = "dp_adam",
    ):
        super().__init__(
            keras.optimizers.Adam(
                learning_rate=learning_rate, beta_1=beta_1, beta_2=beta_2, epsilon=epsilon
            ),
            l2_norm_clip=l2_norm_clip,
            noise_multiplier=noise_multiplier,
            noise_allocation=noise_allocation,
            seed=seed,
            secure_mode=secure_mode,
            correlated_noise=correlated_noise,
            name=name,
        )

    def get_config(self):
        inner = self.inner_optimizer
        return {
            "name": self.name,
            "learning_rate": _serialize_lr(inner._learning_rate),
            "beta_1": inner.beta_1,
            "beta_2": inner.beta_2,
            "epsilon": inner.epsilon,
            **self._dp_config(),
        }

    @classmethod
    def from_config(cls, config, custom_objects=None):
        return _from_flat_config(cls, config)


def _from_flat_config(cls, config):
    config = dict(config)
    config["learning_rate"] = _deserialize_lr(config["learning_rate"])
    return cls(**config)
