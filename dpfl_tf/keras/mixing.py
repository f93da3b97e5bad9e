"""The guard against cross-example dependence.

Per-example clipping bounds one record's influence on a lot's sum only when
example i's loss depends on example i alone: removing record j then changes
one term, of norm <= C.  A loss or a layer that mixes the batch (a metric
loss comparing each embedding with the others', a normalisation over the batch
axis, MixUp) makes every term depend on record j, and the sum moves by up to
B x C while epsilon assumes C.

Two checks, both before anything trains:

* *by construction* (`refuse_batch_mixing_layers`, `refuse_batch_mixing_loss`,
  at `compile`): the Keras 3 losses and layers known to mix the batch;
* *a probe* (`probe_batch_mixing`, at the first `fit` after `compile`,
  eagerly, before the first lot is trained, on 2h examples of that lot): with
  A = x_1..x_h and B = x_h+1..x_2h, it runs the batches [A, B] against [A, A]
  and [A, B[:h/2], A[:h/2]], and [B, A] against [B, B]: one half's losses
  must not change when the other half does (three trials, so that a batch
  statistic -- a mean that happens to be equal for both halves, a maximum
  that one half decides -- is changed by at least one).  The randomness of
  the training forward (dropout masks) is the same in every run (Keras
  seed-generator states and Python's `random` are restored before each), so
  a difference means dependence; the layer named is the first whose inputs
  agree on the compared rows and whose outputs do not.
  Cost: five forward passes of 2h = 16 examples in training mode (fewer when
  a trial finds a difference, plus one to rerun it), no gradient.

What the probe cannot see (docs/concepts/what-epsilon-covers.md):
dependence on particular inputs only (a branch on the batch's content that
these 2h examples do not take), dependence weaker than its tolerance (relative
1e-4), dependence in the gradient but not in the loss (a custom gradient),
randomness outside Keras seed generators (then it warns that it could not
check), and mixing inside `fit(preprocess=...)`, whose output it takes as given.
"""

from __future__ import annotations

import contextlib
import random
import warnings

import keras
import numpy as np
import tensorflow as tf

__all__ = [
    "BatchMixingLayerError",
    "BatchMixingLossError",
    "refuse_batch_mixing_layers",
    "refuse_batch_mixing_loss",
    "probe_batch_mixing",
    "PROBE_HALF",
]

PROBE_HALF = 8  # h: the probe runs 2h examples
PROBE_RTOL = 1e-4  # relative change of a loss (or a layer's output) that counts


class BatchMixingLayerError(ValueError):
    """A layer's output for one example depends on other examples of the batch."""


class BatchMixingLossError(ValueError):
    """A loss's value for one example depends on other examples of the batch."""


_WHY = "so one record moves every example's clipped gradient and the sensitivity is not C"


def _leaf_layers(layer):
    children = list(layer._flatten_layers(include_self=False, recursive=False))
    if not children:
        yield layer
    for child in children:
        yield from _leaf_layers(child)


def _axes(axis) -> tuple:
    return tuple(axis) if isinstance(axis, (list, tuple)) else (axis,)


_AXIS_LAYERS = (
    keras.layers.Softmax,
    keras.layers.LayerNormalization,
    keras.layers.UnitNormalization,
    keras.layers.GroupNormalization,
    *([keras.layers.RMSNormalization] if hasattr(keras.layers, "RMSNormalization") else []),
)
_MIXING_AUGMENTATIONS = tuple(
    getattr(keras.layers, n) for n in ("MixUp", "CutMix") if hasattr(keras.layers, n)
)


def refuse_batch_mixing_layers(model: keras.Model) -> None:
    """Raises `BatchMixingLayerError` for the Keras layers that mix examples in
    training mode: BatchNormalization (unless frozen), MixUp and CutMix (each
    output blends two records), and softmax / normalisation layers whose
    `axis` is the batch axis 0."""
    for layer in _leaf_layers(model):
        name = f"layer {layer.name!r} ({type(layer).__name__})"
        if isinstance(layer, keras.layers.BatchNormalization) and layer.trainable:
            raise BatchMixingLayerError(
                f"layer {layer.name!r} is BatchNormalization in training mode: it normalises "
                "with statistics of the whole batch, so one example's output depends on the "
                "others and per-example clipping does not bound its influence. Use "
                "LayerNormalization or GroupNormalization, or freeze it (trainable=False)."
            )
        if isinstance(layer, _MIXING_AUGMENTATIONS):
            raise BatchMixingLayerError(
                f"{name} blends each example with another of the batch, {_WHY}; remove it "
                "(augment each example on its own, e.g. fit(preprocess=...) with random "
                "flips and crops)"
            )
        if isinstance(layer, _AXIS_LAYERS) and 0 in _axes(layer.axis):
            raise BatchMixingLayerError(
                f"{name} has axis={layer.axis!r}, which includes the batch axis 0, {_WHY}; "
                "use the example's own axes (e.g. axis=-1)"
            )


def refuse_batch_mixing_loss(loss_fn) -> None:
    """Raises `BatchMixingLossError` for the Keras losses that compare an
    example with the others of its batch (Circle: each embedding against the
    batch's) or reduce over the batch axis (Dice and Tversky with their
    default axis=None; any loss given an `axis` containing 0)."""
    fn = getattr(loss_fn, "fn", loss_fn)
    kwargs = dict(getattr(loss_fn, "_fn_kwargs", {}) or {})
    name = getattr(loss_fn, "name", None) or getattr(fn, "__name__", type(loss_fn).__name__)
    if fn is keras.losses.circle:
        raise BatchMixingLossError(
            f"loss {name!r} (Circle) compares each example's embedding with every other "
            f"example of the batch, {_WHY}; use a per-example loss (e.g. a classification "
            "loss on the embeddings)"
        )
    reduces_all = fn in (keras.losses.dice, keras.losses.tversky)
    if "axis" in kwargs or reduces_all:
        axis = kwargs.get("axis")
        if (axis is None and reduces_all) or (axis is not None and 0 in _axes(axis)):
            raise BatchMixingLossError(
                f"loss {name!r} has axis={axis!r}, which reduces over the batch axis 0, "
                f"{_WHY}; pass axis= the example's own axes (e.g. axis=(1, 2, 3) for "
                "images)"
            )


# ---------------------------------------------------------------------------
# The probe


@contextlib.contextmanager
def _same_randomness(model):
    """Restores the model's non-trainable state (Keras seed generators, moving
    statistics), Keras's global seed generator and Python's `random` to their
    values at entry, before each `rerun()` and at exit: every run of the
    training forward draws the same dropout masks, and the probe leaves no
    trace in the training's randomness."""
    from keras.src.backend.common import global_state
    from keras.src.random.seed_generator import GLOBAL_SEED_GENERATOR

    state = [(v, tf.identity(v.value)) for v in model.variables if not v.trainable]
    generator = global_state.get_global_attribute(GLOBAL_SEED_GENERATOR)
    if generator is not None:
        state.append((generator.state, tf.identity(generator.state.value)))
    python_random = random.getstate()

    def rerun():
        for v, value in state:
            v.assign(value)
        if generator is None:  # created by a run: created again from the same seed
            global_state.set_global_attribute(GLOBAL_SEED_GENERATOR, None)
        random.setstate(python_random)

    try:
        yield rerun
    finally:
        rerun()


@contextlib.contextmanager
def _recording(model, calls: list):
    """Records (layer, inputs, outputs) of every layer call (in order of
    completion: a layer after the layers it calls) through an instance `call`."""
    layers = [layer for layer in model._flatten_layers(include_self=False)]
    saved = []
    for layer in layers:
        own = layer.__dict__.get("call")
        original = layer.call

        def call(*args, _layer=layer, _original=original, **kwargs):
            out = _original(*args, **kwargs)
            calls.append((_layer, tf.nest.flatten((args, kwargs)), tf.nest.flatten(out)))
            return out

        saved.append((layer, own))
        object.__setattr__(layer, "call", call)
    try:
        yield
    finally:
        for layer, own in saved:
            if own is None:
                del layer.__dict__["call"]
            else:
                object.__setattr__(layer, "call", own)


def _first_rows_close(a, b, h: int) -> bool:
    """Whether rows [:h] of two tensors (batch 2h) agree to `PROBE_RTOL`; other
    values (not a tensor of this batch) count as agreeing."""
    if (
        not (isinstance(a, tf.Tensor) and isinstance(b, tf.Tensor))
        or a.shape != b.shape
        or a.shape.rank == 0
        or a.shape[0] != 2 * h
        or not (a.dtype.is_floating or a.dtype.is_integer)
    ):
        return True
    a, b = a[:h].numpy().astype(np.float64), b[:h].numpy().astype(np.float64)
    scale = max(1.0, float(np.nanmax(np.abs(a), initial=0.0)))
    return bool(np.allclose(a, b, rtol=PROBE_RTOL, atol=1e-6 * scale, equal_nan=True))


def _culprit(calls_a, calls_b, h: int):
    """The first layer call whose inputs agree on rows [:h] and whose outputs do not."""
    for (layer, ins_a, outs_a), (_, ins_b, outs_b) in zip(calls_a, calls_b):
        if all(_first_rows_close(p, q, h) for p, q in zip(ins_a, ins_b)) and not all(
            _first_rows_close(p, q, h) for p, q in zip(outs_a, outs_b)
        ):
            return layer
    return None


def probe_batch_mixing(model, loss_fn, x, y, loss_name: str = "the loss") -> None:
    """Raises `BatchMixingLayerError` / `BatchMixingLossError` when one half's
    per-example losses change with the other half of the batch (x, y: 2h
    examples, h >= 1; the trials are in the comments below).  Runs
    eagerly, in training mode, with the same randomness in each run
    (`_same_randomness`); when two identical runs already disagree (randomness
    outside Keras seed generators) it warns that it could not check, and
    returns."""
    from dpfl_tf.keras.per_example import _call_with_training, per_example_loss

    n = int(tf.shape(y)[0])
    h = n // 2
    if h < 1:
        return
    take = lambda t: tf.convert_to_tensor(t)[: 2 * h]
    x, y = tf.nest.map_structure(take, x), take(y)
    # Each trial runs a batch [P, Q] and the same P with Q replaced, and compares P's
    # losses: [A, B] against [A, A] and against [A, B[:h//2], A[:h-h//2]] (a statistic
    # of the batch, a mean say, that happens to be equal for both halves escapes one of
    # them, not both), then [B, A] against [B, B] (a statistic A decides, the batch's
    # largest loss say, escapes every replacement that keeps A).
    both = lambda first, second: lambda t: tf.concat([first(t), second(t)], axis=0)
    a, b = (lambda t: t[:h]), (lambda t: t[h : 2 * h])
    mixed = lambda t: tf.concat([t[h : h + h // 2], t[: h - h // 2]], axis=0)
    trials = [(both(a, b), both(a, a)), (both(a, b), both(a, mixed)), (both(b, a), both(b, b))]
    if h == 1:  # the mixed second half is A itself: the first trial again
        del trials[1]

    def run(batch):
        xs, ys = tf.nest.map_structure(batch, x), batch(y)
        calls: list = []
        with _recording(model, calls):
            y_pred = _call_with_training(model, True)(xs)
        losses = per_example_loss(loss_fn, ys, y_pred)
        return calls, y_pred, losses

    with _same_randomness(model) as rerun:
        bases: dict = {}
        for base, other in trials:
            if base not in bases:
                rerun()
                bases[base] = run(base)
            calls_a, pred_a, losses_a = bases[base]
            rerun()
            calls_b, pred_b, losses_b = run(other)
            if not _first_rows_close(losses_a, losses_b, h):
                break
        else:
            return
        rerun()
        _, _, losses_again = run(base)
    if not _first_rows_close(losses_a, losses_again, h) or not np.array_equal(
        np.isfinite(losses_a.numpy()), np.isfinite(losses_again.numpy())
    ):
        warnings.warn(
            "the cross-example dependence probe could not check this model: two identical "
            "training forwards gave different losses (randomness outside Keras seed "
            "generators?); make sure each example's loss depends on that example alone",
            RuntimeWarning,
            stacklevel=3,
        )
        return
    layer = _culprit(calls_a, calls_b, h)
    if layer is not None:
        raise BatchMixingLayerError(
            f"layer {layer.name!r} ({type(layer).__name__}) makes one example's output depend "
            f"on the other examples of the batch, {_WHY}: nothing was trained; compute each "
            "example's output from that example alone (no reduction over axis 0)"
        )
    if all(
        _first_rows_close(p, q, h) for p, q in zip(tf.nest.flatten(pred_a), tf.nest.flatten(pred_b))
    ):
        raise BatchMixingLossError(
            f"{loss_name} makes one example's loss depend on the other examples of the batch, "
            f"{_WHY}: nothing was trained; use a loss computed from each example alone"
        )
    raise BatchMixingLayerError(
        f"model {model.name!r} makes one example's output depend on the other examples of "
        f"the batch (in its own call, between layers), {_WHY}: nothing was trained; compute "
        "each example's output from that example alone (no reduction over axis 0)"
    )
