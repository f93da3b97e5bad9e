"""Per-example gradient norms and clipped gradient sums for Keras 3 models.

DP-SGD (Abadi et al. 2016, Algorithm 1) needs, for a batch of B examples,

    sum_i  clip(grad_i),   clip(g) = g * min(1, C / ||g||),

which needs each example's gradient norm.  Two paths compute it.

*Generic path* (any differentiable layer): the Jacobian of the vector of
per-example losses with respect to a variable, d loss_i / d w, is exactly the
stack of per-example gradients (pfor-vectorised).

*Per-layer rules* (`dpfl_tf.keras.layer_rules`, one module per layer family;
Goodfellow 2015, Lee & Kifer 2021, "ghost clipping" of Li et al. 2022): during
the forward pass each trainable layer's `call` is replaced by its rule's
forward, which keeps the layer's input (taps) and the tensors whose loss
gradient it needs (e.g. the pre-activation z).  One backward pass to those
tensors gives g_i = d loss_i / d z_i, and the rule turns taps and g into each
example's squared norm per variable and the clipped sum.  For z = a W + b on
positions s (sequence steps, conv patches):

    ||grad_i W||^2 = ||a_i||^2 ||g_i||^2                         (one position)
                   = sum_{s,t} (a_is . a_it)(g_is . g_it)          (ghost norm)
                   or ||sum_s a_is^T g_is||^2                      (materialised,
                                  whichever needs less memory: 2 S^2 < d o)
    sum_i c_i grad_i W = sum_i a_i^T (c_i g_i)               (one matmul)

Rules are looked up by exact type, then along the MRO unless the subclass
overrides what the rule reimplements (`find_rule`; `register_rule` adds one).
A layer whose variables all belong to sublayers (MultiHeadAttention,
transformer blocks, nested models) is descended into, so its EinsumDense,
Dense, LayerNormalization sublayers use their rules.  Any other trainable
layer uses the per-layer fallback (`PerLayerJacobianRule`: the layer re-run on
its own taps, a Jacobian of that layer only).  Rules and the generic path give
the same numbers to float tolerance (tested against a per-example loop).
Layers with ``trainable=False`` are only run forward.

*Shared layers and shared variables.*  An example's gradient of a variable is
the sum over all its uses.  A layer called C times (the same Dense on two
inputs, twice in sequence, ...) has grad_i W = sum_c sum_s a_cis^T g_cis: the
positions of all calls are concatenated, [B, S_1 + ... + S_C, d], before the
norm above is taken (the bias gradient is sum_c sum_s g_cis).  A use that no
tap sees (weight tying: an Embedding table also used as the output projection
by another layer; a layer also called inside a custom layer) is found while
tracing: a tapped call reads its variables through ``tf.stop_gradient`` (its
gradient comes from d loss / d z), so d loss / d w is None -- no ops -- unless w
has another differentiable use.  Such a layer is moved, once per
`PerExampleGradients`, to the generic path and the pass is redone; its
variables' per-example gradients are then exact Jacobians over all uses.
(Variables held by the model itself, not by a layer, take that path too.)
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import threading
from typing import Callable, NamedTuple

import keras
import tensorflow as tf

from dpfl_tf.keras.layer_rules import FALLBACK, LayerCall, find_rule, weighted_sum
from dpfl_tf.keras.layer_rules._base import _ACTIVE, _ORIGINAL_CALLS, Taps
from dpfl_tf.keras.mixing import BatchMixingLayerError, _leaf_layers, refuse_batch_mixing_layers  # noqa: F401

__all__ = [
    "PerExampleGradients",
    "ClippedBatch",
    "refuse_batch_mixing_layers",
    "per_example_loss",
    "plan_layers",
    "default_loss_scale",
]


FLOAT16_LOSS_SCALE = 2.0**10


def default_loss_scale(model: keras.Model) -> float:
    """The static loss scale for `PerExampleGradients`: 2^10 if a trainable
    layer computes in float16 (mixed_float16: float16's 5 exponent bits
    underflow below 6e-8), else 1 (float32, bfloat16: float32's exponent)."""
    for layer in _leaf_layers(model):
        if layer.trainable and getattr(layer, "compute_dtype", None) == "float16":
            return FLOAT16_LOSS_SCALE
    return 1.0


def per_example_loss(loss_fn, y_true, y_pred) -> tf.Tensor:
    """The unreduced loss, one value per example; refuses reduced losses."""
    if isinstance(loss_fn, keras.losses.Loss):
        values = loss_fn.call(y_true, y_pred)  # `call` skips the reduction
    else:
        values = loss_fn(y_true, y_pred)
    values = tf.convert_to_tensor(values)
    if values.shape.rank == 0:
        raise ValueError(
            "the loss returned a scalar: DP-SGD needs one loss value per example. Pass a "
            "keras.losses.Loss instance or a function returning shape [batch]."
        )
    if values.shape.rank > 1:  # e.g. per-token losses: average over the example's axes
        values = tf.reduce_mean(tf.reshape(values, [tf.shape(values)[0], -1]), axis=1)
    return values


# ---------------------------------------------------------------------------
# The tapped forward: each planned layer's `call` is replaced by its rule's forward


def _direct_children(layer) -> list:
    return list(layer._flatten_layers(include_self=False, recursive=False))


def _trained(layer) -> list:
    """The variables under `layer` that train (`trainable_variables` is empty for
    a frozen layer even when a sublayer trains, as after KerasHub's
    ``backbone.enable_lora``)."""
    return [v for v in layer.variables if v.trainable]


def plan_layers(model, excluded=frozenset()) -> dict:
    """{id(layer): (layer, rule)} for the trainable layers the tapped forward
    replaces: a layer with a registered rule that applies; else, a layer whose
    variables all belong to sublayers is descended into (MultiHeadAttention,
    transformer blocks, nested models); else the per-layer fallback.  Frozen
    layers only run forward; `excluded` layers (variables used outside their
    taps) and the model's own variables take the whole-model Jacobian."""
    plan: dict = {}

    def visit(layer):
        for child in _direct_children(layer):
            if id(child) in plan or id(child) in excluded or not _trained(child):
                continue
            if not child.trainable:  # frozen, with a sublayer that trains (enable_lora)
                visit(child)
                continue
            rule = find_rule(child)
            if rule is not None:
                plan[id(child)] = (child, rule if rule.applies(child) else FALLBACK)
                continue
            grandchildren = _direct_children(child)
            held = {id(v) for g in grandchildren for v in _trained(g)}
            if grandchildren and all(id(v) in held for v in _trained(child)):
                visit(child)
            else:
                plan[id(child)] = (child, FALLBACK)

    visit(model)
    return plan


@dataclasses.dataclass
class _Recorder:
    """One forward pass: its tape, the rules in force and the calls they tapped."""

    tape: tf.GradientTape
    plan: dict
    graph: object = dataclasses.field(default_factory=tf.compat.v1.get_default_graph)
    calls: list = dataclasses.field(default_factory=list)  # (layer, rule, Taps)

    def rule_for(self, layer):
        entry = self.plan.get(id(layer))
        # a call inside a loop or branch of the layer above (an RNN cell, ...) is in
        # another graph: its tensors cannot leave it, so it is not tapped (its
        # variables then take the whole-model Jacobian)
        if entry is None or tf.compat.v1.get_default_graph() is not self.graph:
            return None
        return entry[1]

    def record(self, layer, rule, taps: Taps) -> None:
        # watched tensors are computed from stop_gradient(variables) (and the layer's
        # input may not be watched either, e.g. model inputs)
        for z in taps.watched.values():
            self.tape.watch(z)
        self.calls.append((layer, rule, taps))


_HOOK_LOCK = threading.Lock()
_HOOKS: dict[int, list] = {}  # id(layer) -> [users, instance attribute before (or _NONE)]
_NONE = object()


def _dispatch(layer, original):
    def call(*args, **kwargs):
        recorder = getattr(_ACTIVE, "recorder", None)
        rule = recorder.rule_for(layer) if recorder is not None else None
        if rule is None:
            return original(*args, **kwargs)
        outputs, taps = rule.forward(layer, *args, **kwargs)
        recorder.record(layer, rule, taps)
        return outputs

    return call


@contextlib.contextmanager
def _tapping(recorder: _Recorder):
    """Replaces the planned layers' `call` for this thread's forward pass.

    The replacement is an instance attribute that dispatches to the rule only
    for the thread whose recorder is active (replicas of a distribution strategy
    run in threads), and calls the layer's own `call` otherwise."""
    layers = [layer for layer, _ in recorder.plan.values()]
    with _HOOK_LOCK:
        for layer in layers:
            entry = _HOOKS.get(id(layer))
            if entry is not None:
                entry[0] += 1
                continue
            _HOOKS[id(layer)] = [1, layer.__dict__.get("call", _NONE)]
            _ORIGINAL_CALLS[id(layer)] = layer.call
            object.__setattr__(layer, "call", _dispatch(layer, layer.call))
    previous = getattr(_ACTIVE, "recorder", None)
    _ACTIVE.recorder = recorder
    try:
        yield
    finally:
        _ACTIVE.recorder = previous
        with _HOOK_LOCK:
            for layer in layers:
                entry = _HOOKS[id(layer)]
                entry[0] -= 1
                if entry[0]:
                    continue
                del _HOOKS[id(layer)], _ORIGINAL_CALLS[id(layer)]
                if entry[1] is _NONE:
                    del layer.__dict__["call"]
                else:
                    object.__setattr__(layer, "call", entry[1])


def _after(tensors):
    """Ops created inside the context run after `tensors` (in a graph; eager
    code runs in order anyway)."""
    tensors = [t for t in tensors if t is not None]
    if not tensors or tf.executing_eagerly():
        return contextlib.nullcontext()
    return tf.control_dependencies(tensors)


def _call_with_training(op, training: bool):
    def call(*args, **kwargs):
        context = getattr(op, "_call_context_args", None)
        if (context is not None and "training" in context) or getattr(
            op, "_call_has_training_arg", False
        ):
            kwargs.setdefault("training", training)
        return op(*args, **kwargs)

    return call


class ClippedBatch(NamedTuple):
    """One batch's clipped sums (aligned with the model's trainable variables),
    per-example losses, predictions, and the clip factors applied (one [B]
    tensor per variable; 0 for an example dropped as non-finite)."""

    sums: list
    losses: tf.Tensor
    y_pred: object
    factors: list


class PerExampleGradients:
    """Per-example squared norms and clipped sums for one model and loss.

    Layers moved to the generic path because their variables have uses the
    fast path cannot see (weight tying; see the module docstring) are listed in
    `excluded_layers`; the decision is made while tracing, once per object.

    `loss_scale` (mixed_float16): the backward pass differentiates
    loss_scale * loss, so small float16 gradients at the layers' outputs do not
    underflow; the rules work in float32 and the norms and sums are unscaled
    (sq / S^2, sum / S) before clipping, so clipping and noise see the true
    gradients.  A static scale: an example whose scaled gradient overflows has
    a non-finite norm and is dropped like any non-finite example.
    """

    def __init__(self, model: keras.Model, loss_fn, *, fast: bool = True, loss_scale: float = 1.0):
        self.model = model
        self.loss_fn = loss_fn
        self.fast = fast
        if not (
            isinstance(loss_scale, (int, float)) and loss_scale > 0 and loss_scale < float("inf")
        ):
            raise ValueError(f"loss_scale must be a finite number > 0, got {loss_scale!r}")
        self.loss_scale = float(loss_scale)
        self._excluded: dict[int, keras.layers.Layer] = {}
        # The tape is persistent only when variables take the whole-model
        # Jacobian (a second use of the tape).  A persistent tape makes every
        # while loop (an RNN's backpropagation through time) keep all its
        # intermediates: +0.5 GB for an LSTM(128) over 128 steps at batch 256.
        self._persistent = None  # decided at the first pass (`_needs_jacobian`)

    @property
    def excluded_layers(self) -> tuple:
        """Fast-path layers run on the generic path (their variables are used elsewhere)."""
        return tuple(self._excluded.values())

    def materialised_parameters(self) -> int:
        """Trainable parameters whose per-example gradients are materialised, one
        copy per example (generic path and per-layer Jacobian fallback): what
        bounds the physical batch's memory beyond the activations."""
        plan = plan_layers(self.model, frozenset(self._excluded)) if self.fast else {}
        fast = {
            id(v)
            for layer, rule in plan.values()
            if rule is not FALLBACK
            for v in layer.trainable_variables
        }
        return sum(math.prod(v.shape) for v in self.model.trainable_variables if id(v) not in fast)

    def compute(self, x, y, weights: tf.Tensor, clip_factors_fn, training: bool = True):
        """Returns (clipped sums aligned with model.trainable_variables,
        per-example losses, y_pred): `clipped` without the factors."""
        return tuple(self.clipped(x, y, weights, clip_factors_fn, training)[:3])

    def clipped(
        self, x, y, weights: tf.Tensor, clip_factors_fn, training: bool = True
    ) -> ClippedBatch:
        """The batch's `ClippedBatch`: sum_i c_i grad_i per variable, with the
        clip factors c that `clip_factors_fn` gave.

        `weights` is 1 for real examples and 0 for padding; `clip_factors_fn`
        maps a list of per-variable squared norms ([B] each) to per-variable
        clip factors ([B] each) -- the sanitizer's clipping rule.
        """
        while True:  # at most once more per layer found to have an outside use, and
            # once more when the whole-model Jacobian first needs a persistent tape
            result = self._compute(x, y, weights, clip_factors_fn, training)
            if result is not None:
                return result

    def _clipped_norms(self, variables, sq_norms: dict, sum_fns: dict) -> list:
        """The squared norms clipping reads, one [B] vector per variable: each
        example's own (`dpfl_tf.keras.users.PerUserGradients` gives each example
        its user's instead)."""
        return [sq_norms[id(v)] for v in variables]

    def _compute(self, x, y, weights, clip_factors_fn, training):
        """One pass; None (and more `_excluded` layers) if a tapped variable has a
        use outside its layer's taps."""
        variables = self.model.trainable_variables
        plan = plan_layers(self.model, frozenset(self._excluded)) if self.fast else {}
        if self._persistent is None:
            planned = {id(v) for layer, _ in plan.values() for v in layer.trainable_variables}
            self._persistent = any(id(v) not in planned for v in variables)
        persistent = self._persistent
        with tf.GradientTape(persistent=persistent) as tape:
            recorder = _Recorder(tape, plan)
            with _tapping(recorder):
                y_pred = _call_with_training(self.model, training)(x)
            losses = per_example_loss(self.loss_fn, y, y_pred)
            losses = losses * tf.cast(weights, losses.dtype)
            scale = self.loss_scale
            scaled_losses = losses * scale if scale != 1.0 else losses
            total = tf.reduce_sum(scaled_losses)

        calls = recorder.calls
        layers = {id(layer): (layer, rule) for layer, rule, _ in calls}  # tapped, once each
        owner: dict[int, int] = {}  # variable id -> id of the tapped layer holding it
        tapped_vars = []  # (layer id, variable)
        leave_fast_path = set()  # ids of layers whose variables have other uses
        for layer_id, (layer, _) in layers.items():
            for var in layer.trainable_variables:
                other = owner.setdefault(id(var), layer_id)
                if other != layer_id:  # one variable held by two tapped layers
                    leave_fast_path |= {other, layer_id}
                else:
                    tapped_vars.append((layer_id, var))

        # Tapped calls read variables through stop_gradient: d total / d var is None
        # (no ops, so no run-time cost) unless the variable has another use.
        watched = [
            (i, name, z) for i, (_, _, taps) in enumerate(calls) for name, z in taps.watched.items()
        ]
        grads = (
            tape.gradient(total, [z for _, _, z in watched] + [v for _, v in tapped_vars])
            if calls
            else []
        )
        g_watched, outside = grads[: len(watched)], grads[len(watched) :]
        leave_fast_path |= {
            layer_id for (layer_id, _), g in zip(tapped_vars, outside) if g is not None
        }
        if leave_fast_path:
            del tape
            self._excluded.update((i, layers[i][0]) for i in leave_fast_path)
            self._persistent = True  # their variables take the whole-model Jacobian
            return None

        generic = [v for v in variables if id(v) not in owner]
        if generic and not persistent:  # the Jacobian needs a persistent tape: redo
            del tape
            self._persistent = True
            return None
        jac = tape.jacobian(scaled_losses, generic, experimental_use_pfor=True) if generic else []
        del tape

        call_grads = [{} for _ in calls]
        for (i, name, _), g in zip(watched, g_watched):
            call_grads[i][name] = g
        per_layer: dict[int, list] = {layer_id: [] for layer_id in layers}
        for (layer, _, taps), g in zip(calls, call_grads):
            per_layer[id(layer)].append(LayerCall(taps.saved, taps.watched, g))

        sq_norms: dict[int, tf.Tensor] = {}
        sum_fns: dict[int, Callable[[tf.Tensor], tf.Tensor]] = {}
        # One layer at a time, from the output back (the order backprop produces
        # their gradients): each layer's temporaries (patches, per-example
        # products) are freed before the next layer's exist, instead of all
        # layers' at once when the graph runs them side by side.
        previous: list = []
        for layer_id, layer_calls in reversed(per_layer.items()):
            layer, rule = layers[layer_id]
            with _after(previous):
                results = rule.gradients(layer, layer_calls)
            for var, result in results:
                sq_norms[id(var)], sum_fns[id(var)] = result
            previous = [sq for _, (sq, _) in results]
            missing = [v.path for v in layer.trainable_variables if id(v) not in sq_norms]
            if missing:
                raise ValueError(
                    f"the rule {type(rule).__name__} for layer {layer.name!r} "
                    f"returned no gradients for variables {missing}"
                )
        for var, j in zip(generic, jac):
            j = tf.zeros((tf.shape(losses)[0],) + tuple(var.shape), var.dtype) if j is None else j
            j.set_shape([None, *var.shape])  # pfor inside a while loop loses it
            sq_norms[id(var)] = tf.reduce_sum(tf.reshape(tf.square(j), [tf.shape(j)[0], -1]), 1)
            sum_fns[id(var)] = lambda c, j=j: weighted_sum(j, c)

        if scale != 1.0:  # back to the gradients of the loss itself, in float32
            sq_norms = {k: tf.cast(q, tf.float32) / (scale * scale) for k, q in sq_norms.items()}
            sum_fns = {k: (lambda c, fn=fn: fn(c) / scale) for k, fn in sum_fns.items()}
        factors = clip_factors_fn(self._clipped_norms(variables, sq_norms, sum_fns))
        sums = []  # one variable at a time too (each sum scales a [B, ...] copy)
        for v, f in zip(variables, factors):
            with _after(sums[-1:]):
                sums.append(sum_fns[id(v)](tf.cast(f, v.dtype)))
        return ClippedBatch(sums, losses, y_pred, list(factors))
