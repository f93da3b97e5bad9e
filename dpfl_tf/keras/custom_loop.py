"""DP-SGD in your own training loop: one call per lot gives the clipped and
noised gradient and records the lot in a privacy ledger.

    sampler = LotSampler(len(x), lot_size=50)
    for x_lot, y_lot, mask in sampler.dataset(x, y, epochs=3):
        grads = dp_gradients(model, loss, x_lot, y_lot, mask=mask, optimizer=dp_sgd,
                             sampler=sampler, ledger=ledger)
        dp_sgd.apply_noised_gradients(grads, model.trainable_variables)

The gradient is `DPModel.fit`'s, computed by the same code (`LotStep`, the
per-layer rules of `PerExampleGradients`, the optimizer's sanitizer):

    (sum_i clip(grad_i) + N(0, sigma^2 C^2 I)) / L,

and the ledger records the same event per lot (Abadi et al. 2016; unit of
privacy: one example, add/remove for Poisson lots).  With the same seeds and
the same lots, a loop of `dp_gradients` and `fit` give the same updates and the
same ledger.  The lots must be drawn as `sampler` says (its `dataset` or
`lots`): the accounting assumes them.  See docs/howto/custom-training-loop.md.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Callable

import dp_accounting
import keras
import tensorflow as tf

from dpfl_tf.keras.lot import LotStep
from dpfl_tf.keras.mixing import (
    PROBE_HALF,
    probe_batch_mixing,
    refuse_batch_mixing_layers,
    refuse_batch_mixing_loss,
)
from dpfl_tf.keras.model import _refuse_regularizers, _release_event, default_batch_size
from dpfl_tf.keras.optimizers import DPOptimizer
from dpfl_tf.keras.per_example import PerExampleGradients, _leaf_layers, default_loss_scale
from dpfl_tf.keras.sampling import LotSampler
from dpfl_tf.privacy.events import SamplingMethod
from dpfl_tf.privacy.ledger import BudgetExceededError, PrivacyLedger

__all__ = ["dp_gradients"]

LABEL = "dpsgd"  # the ledger label of DP-SGD lots (as `DPModel` records them)


@dataclasses.dataclass
class _Prepared:
    """What one (model, loss, optimizer settings, sampler) needs per lot."""

    model: object
    compiled: Callable
    event: dp_accounting.DpEvent
    probed: bool = False


# the lot steps of the last few settings used (each holds its model: bounded, not weak)
_PREPARED: "collections.OrderedDict[tuple, _Prepared]" = collections.OrderedDict()
_KEEP = 8


def _prepared(
    model, loss, optimizer: DPOptimizer, sampler: LotSampler, batch_size, fast_gradients: bool
) -> _Prepared:
    """The lot step of these settings, made (and checked) once and reused."""
    variables = model.trainable_variables
    key = (
        id(model),
        id(loss),
        id(optimizer),
        repr(optimizer._dp_config()),
        id(sampler),
        batch_size,
        bool(fast_gradients),
        tuple(id(v) for v in variables),
    )
    if key in _PREPARED and _PREPARED[key].model is model:
        _PREPARED.move_to_end(key)
        return _PREPARED[key]
    refuse_batch_mixing_layers(model)
    refuse_batch_mixing_loss(loss)
    _refuse_regularizers(model)
    if not variables:
        raise ValueError("the model has no trainable variables")
    layer_of = {
        id(v): layer.name for layer in _leaf_layers(model) for v in layer.trainable_variables
    }
    groups, bounds = optimizer.clip_groups(variables, layer_of)
    sanitizer = optimizer.make_sanitizer(bounds)
    per_example = PerExampleGradients(
        model, loss, fast=fast_gradients, loss_scale=default_loss_scale(model)
    )
    if batch_size is None:
        batch_size = default_batch_size(sampler, per_example.materialised_parameters())
    lot = LotStep(
        variables,
        per_example,
        sanitizer,
        groups,
        batch_size=batch_size,
        expected_lot=sampler.lot_size,
    )
    compiled = tf.function(lambda x, y, mask, step: lot(x, y, mask, step)[0], reduce_retracing=True)
    event = _release_event(sampler, sanitizer.effective_noise_multiplier(max(groups) + 1))
    _PREPARED[key] = _Prepared(model, compiled, event)
    while len(_PREPARED) > _KEEP:
        _PREPARED.popitem(last=False)
    return _PREPARED[key]


def dp_gradients(
    model: keras.Model,
    loss,
    x,
    y,
    *,
    optimizer: DPOptimizer,
    sampler: LotSampler,
    ledger: PrivacyLedger,
    mask=None,
    batch_size: int | None = None,
    fast_gradients: bool = True,
) -> list:
    """The DP-SGD gradient of one lot, (sum_i clip(grad_i) + noise) / L, aligned
    with ``model.trainable_variables``; the lot is recorded in `ledger`.

    Args:
      model, loss: the Keras model and a per-example loss (a `keras.losses.Loss`
        or a function returning one value per example).
      x, y: the lot, drawn as `sampler` says (e.g. ``sampler.dataset(x, y)``).
      optimizer: a `DPOptimizer` (e.g. `DPSGD`) giving the clip bound(s), the
        noise multiplier and the noise seed; apply the result with its
        ``apply_noised_gradients`` (or any optimizer).
      sampler: the `LotSampler` that drew the lot: its sampling and rate make
        the event recorded (poisson, fixed_size or full_batch).
      ledger: the `PrivacyLedger` of the training; each call records one lot
        (label "dpsgd") before the gradient is returned, and refuses, computing
        nothing, a lot its budget does not allow.  Lot t (t lots recorded so
        far) draws its noise at position t of the optimizer's noise stream.
      mask: 1 for real examples, 0 for padding (default: all real).
      batch_size: physical batch size (memory only; default as in `fit`).
      fast_gradients: the per-layer rules (False: the generic Jacobian).

    Call it eagerly (a Python loop, or a `train_step` with run_eagerly=True):
    the ledger is Python.  The first call for a model and loss also runs the
    cross-example dependence probe (`dpfl_tf.keras.mixing`).
    """
    if not tf.executing_eagerly():
        raise RuntimeError(
            "dp_gradients must be called eagerly (not inside tf.function): it records each "
            "lot in the Python ledger; call it from a Python loop, or compile the model "
            "with run_eagerly=True (it compiles its own computation)"
        )
    if not isinstance(optimizer, DPOptimizer):
        raise TypeError(
            f"optimizer must be a DPOptimizer (e.g. DPSGD), got {type(optimizer).__name__}"
        )
    if not isinstance(sampler, LotSampler):
        raise TypeError(
            f"sampler must be the LotSampler that drew the lot, got {type(sampler).__name__}"
        )
    if not isinstance(ledger, PrivacyLedger):
        raise TypeError(f"ledger must be a PrivacyLedger, got {type(ledger).__name__}")
    if sampler.sampling is SamplingMethod.SHUFFLE:
        raise ValueError(
            "sampler.sampling='shuffle' is accounted per epoch, not per lot: use "
            "'poisson', 'fixed_size' or 'full_batch' with dp_gradients, or DPModel.fit"
        )
    prepared = _prepared(model, loss, optimizer, sampler, batch_size, fast_gradients)
    event = ledger.admit(prepared.event)
    if ledger.budget is not None and ledger.would_exceed(event):
        b = ledger.budget
        raise BudgetExceededError(
            f"the ledger's budget (epsilon={b.epsilon:g}, delta={b.delta:g}, "
            f"{b.accountant.value}) allows no further lot; spent so far "
            f"epsilon={ledger.epsilon(b.delta, b.accountant):.4g} (nothing was computed)"
        )
    x = tf.nest.map_structure(tf.convert_to_tensor, x)
    y = tf.convert_to_tensor(y)
    mask = tf.ones(tf.shape(y)[:1]) if mask is None else tf.cast(mask, tf.float32)
    if not prepared.probed:
        real = tf.where(mask > 0)[:, 0][: 2 * PROBE_HALF]
        probe_batch_mixing(
            model, loss, tf.nest.map_structure(lambda t: tf.gather(t, real), x), tf.gather(y, real)
        )
        prepared.probed = int(tf.size(real)) >= 2  # else at the next lot
    step = tf.constant(ledger.count(LABEL), tf.int64)
    grads = prepared.compiled(x, y, mask, step)
    ledger.record(event, 1, label=LABEL)
    return list(grads)
