"""The rule protocol, the registry and the helpers rules share.

A *rule* gives, for one layer family, each example's gradient of the layer's
trainable variables from two things the forward pass keeps:

* its *taps*: tensors the rule's forward saves (the layer input, conv patches,
  a normalised input, ...), and
* the loss gradient at the tensors the rule's forward *watches* (usually the
  pre-activation output z; several for a layer made of several products).

With g_i = d loss_i / d z_i (the loss of example i depends on z only through
z_i), example i's gradient of a variable w is  sum_s (d z_is / d w)^T g_is,  a
sum over the positions s of the output (sequence steps, pixels) and over the
calls of the layer.  A rule returns, per variable, the vector of squared norms
||grad_i w||^2 and a function mapping per-example factors c to
sum_i c_i grad_i w, with examples whose factor is 0 (dropped as non-finite)
contributing exactly 0 (`kept` / `scaled`: 0 * NaN would be NaN).
"""

from __future__ import annotations

import dataclasses
import sys
import threading
from typing import Any, Callable, NamedTuple, Sequence

import keras
import tensorflow as tf

__all__ = [
    "LayerRule",
    "Taps",
    "LayerCall",
    "VariableGradients",
    "register_rule",
    "unregister_rule",
    "find_rule",
    "kept",
    "scaled",
    "weighted_sum",
    "stopped",
    "outer_gradients",
    "ghost_norm_is_smaller",
    "materialised",
    "original_call",
    "watched",
]


@dataclasses.dataclass
class Taps:
    """What a rule's forward keeps of one call of its layer.

    `watched` maps names to tensors whose loss gradient the rule needs (they are
    watched by the tape); `saved` is anything else the rule needs later.
    """

    watched: dict
    saved: Any = None


@dataclasses.dataclass
class LayerCall:
    """One call of a layer during the tapped forward, with the loss gradient
    (summed over examples, so row i is example i's) at each watched tensor; a
    watched tensor that does not reach the loss has a zero gradient."""

    saved: Any
    outputs: dict
    grads: dict


class VariableGradients(NamedTuple):
    """Per-example squared norms [B] of one variable's gradient, and the
    clipped sum  c -> sum_i c_i grad_i  (examples with c_i = 0 exactly 0)."""

    sq_norms: tf.Tensor
    clipped_sum: Callable[[tf.Tensor], tf.Tensor]


class LayerRule:
    """Per-example gradients of one layer family (subclass and register).

    `forward(layer, *args, **kwargs)` replaces the layer's `call` during the
    tapped forward pass and returns ``(outputs, Taps)``; it must read the
    layer's variables through `stopped` (their gradient comes from the taps, and
    a variable with another differentiable use is detected that way).
    `gradients(layer, calls)` returns ``[(variable, VariableGradients), ...]``
    covering every trainable variable of the layer, from all its calls.
    `applies(layer)` may refuse a configuration (the layer then uses the
    generic per-layer fallback).

    `reimplements` names the methods and properties of the registered class
    whose computation `forward` rewrites.  A subclass that overrides one of
    them computes another function (``class ScaledDense(Dense)`` whose `call`
    is ``Dense.call(x) * 3 + 1``), so the rule does not apply to it by
    inheritance (`find_rule`); registering the rule for that exact subclass
    declares it valid there.
    """

    reimplements: tuple[str, ...] = ("call",)

    def applies(self, layer) -> bool:
        return True

    def rule_for(self, layer) -> "LayerRule":
        """The rule for this layer's configuration: itself, or another rule a
        configuration is handed to (Keras's LoRA layers, `lora.py`)."""
        return self

    def forward(self, layer, *args, **kwargs):
        raise NotImplementedError

    def gradients(self, layer, calls: Sequence[LayerCall]) -> list:
        raise NotImplementedError


_REGISTRY: dict[type, LayerRule] = {}
_LOCK = threading.RLock()  # re-entered: a deferred registration calls register_rule
#: package -> the function that registers its rules, run once that package is
#: imported (a layer of it can exist only then): importing dpfl_tf does not import it
_DEFERRED: dict[str, Callable[[], object]] = {}
_REGISTERING: set[str] = set()


def register_when_imported(package: str, register: Callable[[], object]) -> None:
    """Runs `register` (which calls `register_rule`) before the next lookup or
    registration that finds `package` imported.  The rules are then exactly as if
    `register` had run now, and a rule registered later for one of its classes
    replaces them; but `package` is not imported for a model without its layers."""
    with _LOCK:
        _DEFERRED[package] = register
    _register_deferred()


def _register_deferred() -> None:
    if not _DEFERRED:
        return
    with _LOCK:  # held while registering: another thread's lookup waits for all the rules
        for package in [p for p in _DEFERRED if p in sys.modules and p not in _REGISTERING]:
            _REGISTERING.add(package)  # its register_rule calls come back here
            try:
                _DEFERRED[package]()
                del _DEFERRED[package]  # on an error: tried again at the next lookup
            finally:
                _REGISTERING.discard(package)


def register_rule(layer_class: type, rule: LayerRule) -> None:
    """Registers `rule` for `layer_class`, and for its subclasses that override
    none of `rule.reimplements` (a subclass's own registration, or the nearest
    registered class in its MRO, wins; see `find_rule`)."""
    if not (isinstance(layer_class, type) and issubclass(layer_class, keras.layers.Layer)):
        raise TypeError(f"layer_class must be a keras.layers.Layer subclass, got {layer_class!r}")
    if not isinstance(rule, LayerRule):
        raise TypeError(f"rule must be a LayerRule instance, got {type(rule).__name__}")
    _register_deferred()
    with _LOCK:
        _REGISTRY[layer_class] = rule


def unregister_rule(layer_class: type) -> None:
    """Removes the rule registered for exactly `layer_class` (if any)."""
    _register_deferred()
    with _LOCK:
        _REGISTRY.pop(layer_class, None)


def find_rule(layer) -> LayerRule | None:
    """The rule registered for the layer's exact type; else the rule of the
    nearest registered class of its MRO, unless a class in between overrides
    a method or property the rule reimplements (then None: the layer's own
    computation is not the rule's, so it is descended into or takes the exact
    per-layer fallback).  No rule by inheritance alone.  The rule found may
    hand the layer's configuration to another rule (`LayerRule.rule_for`)."""
    _register_deferred()
    mro = type(layer).__mro__
    for depth, cls in enumerate(mro):
        rule = _REGISTRY.get(cls)
        if rule is None:
            continue
        overridden = [name for k in mro[:depth] for name in rule.reimplements if name in vars(k)]
        return None if overridden else rule.rule_for(layer)
    return None


# ---------------------------------------------------------------------------
# Helpers for rules


def stopped(variable, dtype=None) -> tf.Tensor:
    """The variable's value read through tf.stop_gradient (cast to dtype)."""
    value = tf.convert_to_tensor(variable.value)
    if dtype is not None and value.dtype != tf.as_dtype(dtype):
        value = tf.cast(value, dtype)
    return tf.stop_gradient(value)


def kept(t: tf.Tensor, c: tf.Tensor) -> tf.Tensor:
    """t with the rows of examples whose factor is 0 (dropped as non-finite)
    set to exactly 0: 0 * NaN would be NaN.  t itself when no factor is 0 (the
    usual case: the copy of a big tap is skipped)."""

    def zeroed():
        keep = tf.reshape(c > 0, [-1] + [1] * (t.shape.rank - 1))
        return tf.where(keep, t, tf.zeros_like(t))

    return tf.cond(tf.reduce_all(c > 0), lambda: tf.identity(t), zeroed)


def scaled(t: tf.Tensor, c: tf.Tensor) -> tf.Tensor:
    """c_i * t_i per example, dropped examples exactly 0 (see `kept`): one
    `multiply_no_nan`, which gives 0 where c_i = 0 even if t_i is not finite
    (no `tf.cond`: tracing one costs ~20 ms)."""
    return tf.math.multiply_no_nan(
        t, tf.reshape(tf.cast(c, t.dtype), [-1] + [1] * (t.shape.rank - 1))
    )


def scaled_smaller(a: tf.Tensor, g: tf.Tensor, c: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
    """(a, g) with c_i applied to whichever of the two has the smaller last
    axis (they share the batch and position axes), for a product
    sum_i c_i a_i^T g_i: the scaled copy is then the smaller one (an LSTM's
    input [B, T, d] rather than its gate gradients [B, T, 4H]); dropped
    examples exactly 0 in both (see `kept`)."""
    if a.shape[-1] is not None and g.shape[-1] is not None and a.shape[-1] < g.shape[-1]:
        return scaled(a, c), kept(g, c)
    return kept(a, c), scaled(g, c)


def weighted_sum(t: tf.Tensor, c: tf.Tensor) -> tf.Tensor:
    """sum_i c_i t_i over the examples of t [B, ...] as one [1, B] x [B, n]
    product (no scaled [B, ...] copy), dropped examples exactly 0 (see `kept`)."""
    flat = tf.reshape(kept(t, c), [tf.shape(t)[0], -1])
    s = tf.matmul(tf.cast(c, t.dtype)[None], flat)
    shape = t.shape[1:]  # a Jacobian taken inside a loop may lose its static shape
    return tf.reshape(s, shape if shape.is_fully_defined() else tf.shape(t)[1:])


def f32(t: tf.Tensor) -> tf.Tensor:
    return t if t.dtype == tf.float32 else tf.cast(t, tf.float32)


def materialised(per_example: tf.Tensor, variable) -> VariableGradients:
    """VariableGradients from per-example gradients [B, *variable.shape]."""
    per_example = f32(per_example)
    b = tf.shape(per_example)[0]
    sq = tf.reduce_sum(tf.reshape(tf.square(per_example), [b, -1]), axis=1)

    def clipped_sum(c, j=per_example):
        return tf.cast(tf.reshape(weighted_sum(j, c), variable.shape), variable.dtype)

    return VariableGradients(sq, clipped_sum)


def static_positions(*tensors) -> int | None:
    """Total number of positions (product of axes between batch and the last)
    over the tensors, or None if not known statically."""
    total = 0
    for t in tensors:
        count = 1
        for dim in t.shape[1:-1]:
            if dim is None:
                return None
            count *= dim
        total += count
    return total


def ghost_norm_is_smaller(positions: int | None, d: int, o: int) -> bool:
    """Whether the ghost norm of a d x o kernel used at `positions` positions
    needs less memory per example than the materialised gradient: its two
    S x S Gram matrices against d o entries, 2 S^2 < d o (the per-layer choice
    of "mixed ghost clipping", Bu et al. 2022).

    Memory decides, not multiply-adds: materialised gradients are held until
    every layer's norm is known (the clipping factors need them all), so they
    add up over the layers, while the Gram matrices are freed once reduced.
    The ghost norm's B S^2 (d + o) multiply-adds are then at most
    (d + o) / sqrt(2 d o) times the B S d o of materialising (1.4x for a
    square kernel); the clipped sum costs B S d o either way.
    """
    return positions is not None and 2 * positions * positions < d * o


def outer_gradients(
    a: tf.Tensor,
    g: tf.Tensor,
    positions: int | None,
    to_variable: Callable[[tf.Tensor], tf.Tensor],
    variable,
) -> VariableGradients:
    """Gradients of a variable whose example gradient is, per group k,

        W_k = sum_s a_isk^T g_isk          a: [B, S, G, d],  g: [B, S, G, o]

    (G = 1 for a dense or convolution kernel, G = groups for a grouped or
    depthwise convolution).  ||grad_i||^2 is a ghost norm
    sum_{k,s,t} (a_isk . a_itk)(g_isk . g_itk) when that needs less memory than
    the materialised [B, G, d, o] (`ghost_norm_is_smaller`), else it is taken
    from the materialised gradients.  `to_variable` maps the summed [G, d, o]
    to the variable's shape.
    """
    a, g = f32(a), f32(g)
    d, o = a.shape[-1], g.shape[-1]
    single = a.shape[2] == 1  # one group: plain (batched) matmuls, faster than einsum
    if ghost_norm_is_smaller(positions, d, o):
        if single:
            a3, g3 = a[:, :, 0], g[:, :, 0]
            sq = tf.reduce_sum(
                tf.matmul(a3, a3, transpose_b=True) * tf.matmul(g3, g3, transpose_b=True),
                axis=[1, 2],
            )
        else:
            aa = tf.einsum("bsgd,btgd->bgst", a, a)
            gg = tf.einsum("bsgo,btgo->bgst", g, g)
            sq = tf.reduce_sum(aa * gg, axis=[1, 2, 3])

        def clipped_sum(c, a=a, g=g):
            ac, gc = scaled_smaller(a, g, c)
            if single:  # sum over examples and positions: one [d, B S] x [B S, o] product
                s = tf.matmul(tf.reshape(ac, [-1, d]), tf.reshape(gc, [-1, o]), transpose_a=True)[
                    None
                ]
            else:
                s = tf.einsum("bsgd,bsgo->gdo", ac, gc)
            return tf.cast(tf.reshape(to_variable(s), variable.shape), variable.dtype)
    else:
        per_example = (
            tf.matmul(a[:, :, 0], g[:, :, 0], transpose_a=True)[:, None]
            if single
            else tf.einsum("bsgd,bsgo->bgdo", a, g)
        )
        sq = tf.reduce_sum(tf.square(per_example), axis=[1, 2, 3])

        def clipped_sum(c, j=per_example):
            # the per-example gradients exist already: sum_i c_i W_i costs B d o,
            # not another B S d o product over the positions
            s = weighted_sum(j, c)
            return tf.cast(tf.reshape(to_variable(s), variable.shape), variable.dtype)

    return VariableGradients(sq, clipped_sum)


def rank_one_gradients(
    a: tf.Tensor, g: tf.Tensor, variable, g_sq: tf.Tensor | None = None
) -> VariableGradients:
    """W_i = a_i^T g_i for a: [B, d], g: [B, o] (a Dense layer on vectors):
    ||W_i||^2 = ||a_i||^2 ||g_i||^2 (Goodfellow 2015).  `g_sq`: ||g_i||^2 if
    already computed (it is also the bias's squared norm)."""
    a, g = f32(a), f32(g)
    if g_sq is None:
        g_sq = tf.reduce_sum(tf.square(g), 1)
    sq = tf.reduce_sum(tf.square(a), 1) * g_sq

    def clipped_sum(c, a=a, g=g):
        s = tf.matmul(*scaled_smaller(a, g, c), transpose_a=True)
        return tf.cast(tf.reshape(s, variable.shape), variable.dtype)

    return VariableGradients(sq, clipped_sum)


def flatten_positions(t: tf.Tensor) -> tf.Tensor:
    """[B, ..., d] -> [B, S, d]."""
    return tf.reshape(t, [tf.shape(t)[0], -1, t.shape[-1]])


def concat_positions(tensors: Sequence[tf.Tensor]) -> tf.Tensor:
    """The calls' positions side by side: [B, S_1 + ... + S_C, d]."""
    flat = [flatten_positions(t) for t in tensors]
    return flat[0] if len(flat) == 1 else tf.concat(flat, axis=1)


def grad_or_zeros(call: LayerCall, name: str) -> tf.Tensor:
    g = call.grads.get(name)
    return tf.zeros_like(call.outputs[name]) if g is None else g


# ---------------------------------------------------------------------------
# The tapped forward in progress (per thread) and the layers' own `call`

_ACTIVE = threading.local()  # .recorder: the recorder of this thread's tapped forward


def watched(t: tf.Tensor) -> tf.Tensor:
    """Watches t on the tape of the tapped forward in progress and returns it.
    A rule's forward must watch a tensor *before* computing anything from it
    (a tape records an op only if an input was already watched)."""
    recorder = getattr(_ACTIVE, "recorder", None)
    if recorder is not None:
        recorder.tape.watch(t)
    return t


_ORIGINAL_CALLS: dict[int, Callable] = {}


def original_call(layer) -> Callable:
    """The layer's own `call` (bound), also while a rule's forward replaces it."""
    return _ORIGINAL_CALLS.get(id(layer)) or layer.call
