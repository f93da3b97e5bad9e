"""Per-example gradient norms and clipped gradient sums for Keras 3 models.

DP-SGD (Abadi et al. 2016, Algorithm 1) needs, for a batch of B examples,

    sum_i  clip(grad_i),   clip(g) = g * min(1, C / ||g||),

which needs each example's gradient norm.  Two paths compute it.

*Generic path* (any differentiable layer): the Jacobian of the vector of
per-example losses with respect to a variable, d loss_i / d w, is exactly the
stack of per-example gradients (pfor-vectorised).

*Fast paths* (Dense, Conv2D, Embedding; Goodfellow 2015, Lee & Kifer 2021,
"ghost clipping" of Li et al. 2022): for a layer z = a W + b, the example's
gradient is a_i^T g_i with g_i = d loss_i / d z_i (for inputs with extra axes
s -- sequence positions, conv patches -- a sum over s).  We record the layer's
input a and take one backward pass to every pre-activation z, then

    ||grad_i W||^2 = ||a_i||^2 ||g_i||^2                         (2-D input)
                   = sum_{s,t} (a_is . a_it)(g_is . g_it)          (ghost norm)
                   or ||sum_s a_is^T g_is||^2                      (materialised,
                                                          whichever is cheaper)
    sum_i c_i grad_i W = sum_i a_i^T (c_i g_i)               (one matmul)

A Conv2D is the same with a = its input patches.  For an Embedding with ids
x_it the gradient rows are g_it at rows x_it:
||grad_i||^2 = sum_{s,t} [x_is = x_it] (g_is . g_it).  Both paths give the same
numbers to float tolerance (tested).  Layers with ``trainable=False`` are only
run forward.

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
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import keras
import tensorflow as tf

__all__ = ["PerExampleGradients", "refuse_batch_mixing_layers", "per_example_loss"]


class BatchMixingLayerError(ValueError):
    """A layer's output for one example depends on other examples of the batch."""


def refuse_batch_mixing_layers(model: keras.Model) -> None:
    """Raises for layers that mix examples in training mode (per-example
    gradients, and so the privacy analysis, would be wrong)."""
    for layer in _leaf_layers(model):
        if isinstance(layer, keras.layers.BatchNormalization) and layer.trainable:
            raise BatchMixingLayerError(
                f"layer {layer.name!r} is BatchNormalization in training mode: it normalises "
                "with statistics of the whole batch, so one example's output depends on the "
                "others and per-example clipping does not bound its influence. Use "
                "LayerNormalization or GroupNormalization, or freeze it (trainable=False).")


def _leaf_layers(layer):
    children = [c for c in layer._flatten_layers(include_self=False, recursive=False)]
    if not children:
        yield layer
    for child in children:
        yield from _leaf_layers(child)


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
            "keras.losses.Loss instance or a function returning shape [batch].")
    if values.shape.rank > 1:  # e.g. per-token losses: average over the example's axes
        values = tf.reduce_mean(tf.reshape(values, [tf.shape(values)[0], -1]), axis=1)
    return values


# ---------------------------------------------------------------------------
# Fast-path layers

def _fast_kind(layer) -> str | None:
    """'dense', 'conv2d' or 'embedding' if the layer has an exact fast path here."""
    if not layer.trainable or not layer.trainable_variables:
        return None
    if getattr(layer, "quantization_mode", None) or getattr(layer, "lora_enabled", False):
        return None
    if getattr(layer, "compute_dtype", "float32") != "float32":
        return None
    if type(layer) is keras.layers.Dense:
        return "dense"
    if type(layer) is keras.layers.Conv2D:
        if (layer.groups == 1 and tuple(layer.dilation_rate) == (1, 1)
                and layer.data_format == "channels_last"
                and str(layer.padding).lower() in ("valid", "same")):
            return "conv2d"
        return None
    if type(layer) is keras.layers.Embedding and not layer.mask_zero:
        return "embedding"
    return None


@dataclasses.dataclass
class _Tap:
    layer: keras.layers.Layer
    kind: str
    inputs: tf.Tensor
    z: tf.Tensor  # pre-activation output; d loss / d z gives per-example g


@dataclasses.dataclass
class _Recorder:
    """One forward pass: its tape, the taps it keeps, the layers kept off the fast path."""
    tape: tf.GradientTape
    excluded: frozenset  # ids of layers run as ordinary Keras calls (generic path)
    taps: list = dataclasses.field(default_factory=list)

    def record(self, layer, kind: str, inputs: tf.Tensor, z: tf.Tensor) -> None:
        # z is computed from stop_gradient(variables), so the tape must be told to
        # follow it (the layer's input may not be watched either, e.g. model inputs)
        self.tape.watch(z)
        self.taps.append(_Tap(layer, kind, inputs, z))


def _tapped_call(layer, kind: str, recorder: _Recorder) -> Callable:
    """The layer's computation written out so its input and pre-activation are kept.

    The variables are read through ``tf.stop_gradient``: their per-example
    gradients come from the tap, and d loss / d variable stays None unless the
    variable has a use the taps do not see (see `PerExampleGradients.compute`).
    """

    def call(inputs, **kwargs):
        a = tf.convert_to_tensor(inputs)
        if kind == "dense":
            kernel = tf.stop_gradient(layer.kernel)
            z = tf.matmul(a, kernel) if a.shape.rank == 2 else tf.tensordot(
                a, kernel, axes=[[a.shape.rank - 1], [0]])
        elif kind == "conv2d":
            z = tf.nn.conv2d(a, tf.stop_gradient(layer.kernel),
                             strides=[1, *layer.strides, 1],
                             padding=str(layer.padding).upper())
        else:  # embedding
            a = tf.cast(a, "int32")
            z = tf.gather(tf.stop_gradient(layer.embeddings), a)
            recorder.record(layer, kind, a, z)
            return z
        if layer.use_bias:
            z = z + tf.stop_gradient(layer.bias)
        recorder.record(layer, kind, a, z)
        return layer.activation(z) if layer.activation is not None else z

    return call


def _has_graph(model) -> bool:
    inner = getattr(model, "_functional", None) if isinstance(model, keras.Sequential) else model
    return inner is not None and hasattr(inner, "_run_through_graph")


def _forward(op, inputs, recorder: _Recorder, training: bool):
    """Runs `op` on inputs, tapping fast-path layers inside functional graphs."""
    if isinstance(op, keras.Model) and _has_graph(op):
        graph = op._functional if isinstance(op, keras.Sequential) else op
        inputs = graph._standardize_inputs(inputs) if hasattr(graph, "_standardize_inputs") \
            else inputs
        outputs = graph._run_through_graph(
            inputs, operation_fn=lambda sub: _operation(sub, recorder, training))
        return graph._pack_outputs(outputs) if hasattr(graph, "_pack_outputs") else outputs
    return _call_with_training(op, training)(inputs)


def _operation(op, recorder: _Recorder, training: bool):
    kind = (_fast_kind(op) if isinstance(op, keras.layers.Layer)
            and id(op) not in recorder.excluded else None)
    if kind is not None:
        return _tapped_call(op, kind, recorder)
    if isinstance(op, keras.Model) and _has_graph(op):
        return lambda inputs, **kw: _forward(op, inputs, recorder, training)
    return _call_with_training(op, training)


def _call_with_training(op, training: bool):
    def call(*args, **kwargs):
        context = getattr(op, "_call_context_args", None)
        if (context is not None and "training" in context) or getattr(
                op, "_call_has_training_arg", False):
            kwargs.setdefault("training", training)
        return op(*args, **kwargs)

    return call


# ---------------------------------------------------------------------------
# Norms and sums from taps

def _flatten_positions(a: tf.Tensor, g: tf.Tensor):
    """[B, ..., d], [B, ..., o] -> [B, S, d], [B, S, o]."""
    b = tf.shape(a)[0]
    return tf.reshape(a, [b, -1, a.shape[-1]]), tf.reshape(g, [b, -1, g.shape[-1]])


def _outer_sq_norm(a: tf.Tensor, g: tf.Tensor, positions: int | None) -> tf.Tensor:
    """||sum_s a_s^T g_s||_F^2 per example, ghost or materialised (cheaper one)."""
    d, o = a.shape[-1], g.shape[-1]
    if positions is not None and positions * positions < d * o:
        aa = tf.matmul(a, a, transpose_b=True)  # [B, S, S]
        gg = tf.matmul(g, g, transpose_b=True)
        return tf.reduce_sum(aa * gg, axis=[1, 2])
    per_example = tf.matmul(a, g, transpose_a=True)  # [B, d, o]
    return tf.reduce_sum(tf.square(per_example), axis=[1, 2])


def _conv_patches(tap: _Tap) -> tf.Tensor:
    kh, kw = tap.layer.kernel_size
    sh, sw = tap.layer.strides
    patches = tf.image.extract_patches(tap.inputs, sizes=[1, kh, kw, 1],
                                       strides=[1, sh, sw, 1], rates=[1, 1, 1, 1],
                                       padding=str(tap.layer.padding).upper())
    depth = kh * kw * tap.layer.kernel.shape[2]
    return tf.ensure_shape(patches, [None, None, None, depth])


def _kept(t: tf.Tensor, c: tf.Tensor) -> tf.Tensor:
    """t with the rows of examples whose clip factor is 0 (dropped as non-finite)
    set to exactly 0: 0 * NaN would be NaN."""
    keep = tf.reshape(c > 0, [-1] + [1] * (t.shape.rank - 1))
    return tf.where(keep, t, tf.zeros_like(t))


def _scaled(t: tf.Tensor, c: tf.Tensor) -> tf.Tensor:
    """c_i * t_i per example, dropped examples exactly 0 (see `_kept`)."""
    return _kept(t * tf.reshape(tf.cast(c, t.dtype), [-1] + [1] * (t.shape.rank - 1)), c)


class PerExampleGradients:
    """Per-example squared norms and clipped sums for one model and loss.

    Layers moved to the generic path because their variables have uses the
    fast path cannot see (weight tying; see the module docstring) are listed in
    `excluded_layers`; the decision is made while tracing, once per object.
    """

    def __init__(self, model: keras.Model, loss_fn, *, fast: bool = True):
        self.model = model
        self.loss_fn = loss_fn
        self.fast = fast
        self._excluded: dict[int, keras.layers.Layer] = {}

    @property
    def excluded_layers(self) -> tuple:
        """Fast-path layers run on the generic path (their variables are used elsewhere)."""
        return tuple(self._excluded.values())

    def compute(self, x, y, weights: tf.Tensor, clip_factors_fn, training: bool = True):
        """Returns (clipped sums aligned with model.trainable_variables,
        per-example losses, y_pred).

        `weights` is 1 for real examples and 0 for padding; `clip_factors_fn`
        maps a list of per-variable squared norms ([B] each) to per-variable
        clip factors ([B] each) -- the sanitizer's clipping rule.
        """
        while True:  # at most once more per layer found to have an outside use
            result = self._compute(x, y, weights, clip_factors_fn, training)
            if result is not None:
                return result

    def _compute(self, x, y, weights, clip_factors_fn, training):
        """One pass; None (and more `_excluded` layers) if a tapped variable has a
        use outside its layer's taps."""
        variables = self.model.trainable_variables
        with tf.GradientTape(persistent=True) as tape:
            recorder = _Recorder(tape, frozenset(self._excluded))
            if self.fast:
                y_pred = _forward(self.model, x, recorder, training)
            else:
                y_pred = _call_with_training(self.model, training)(x)
            losses = per_example_loss(self.loss_fn, y, y_pred)
            losses = losses * tf.cast(weights, losses.dtype)
            total = tf.reduce_sum(losses)

        taps = recorder.taps
        layers = {id(t.layer): t.layer for t in taps}  # each tapped layer once
        owner: dict[int, int] = {}  # variable id -> id of the tapped layer holding it
        tapped_vars = []  # (layer id, variable)
        leave_fast_path = set()  # ids of layers whose variables have other uses
        for layer_id, layer in layers.items():
            for var in layer.trainable_variables:
                other = owner.setdefault(id(var), layer_id)
                if other != layer_id:  # one variable held by two tapped layers
                    leave_fast_path |= {other, layer_id}
                else:
                    tapped_vars.append((layer_id, var))

        # Tapped calls read variables through stop_gradient: d total / d var is None
        # (no ops, so no run-time cost) unless the variable has another use.
        grads = tape.gradient(total, [t.z for t in taps] + [v for _, v in tapped_vars]) \
            if taps else []
        g_list, outside = grads[:len(taps)], grads[len(taps):]
        leave_fast_path |= {layer_id for (layer_id, _), g in zip(tapped_vars, outside)
                            if g is not None}
        if leave_fast_path:
            del tape
            self._excluded.update((i, layers[i]) for i in leave_fast_path)
            return None

        generic = [v for v in variables if id(v) not in owner]
        jac = (tape.jacobian(losses, generic, experimental_use_pfor=True)
               if generic else [])
        del tape

        sq_norms: dict[int, tf.Tensor] = {}
        sum_fns: dict[int, Callable[[tf.Tensor], tf.Tensor]] = {}
        calls = {layer_id: ([], []) for layer_id in layers}  # taps and g of each layer
        for tap, g in zip(taps, g_list):
            calls[id(tap.layer)][0].append(tap)
            calls[id(tap.layer)][1].append(g)
        for layer_taps, layer_gs in calls.values():
            self._layer_norms_and_sums(layer_taps, layer_gs, sq_norms, sum_fns)
        for var, j in zip(generic, jac):
            j = tf.zeros((tf.shape(losses)[0],) + tuple(var.shape), var.dtype) if j is None else j
            sq_norms[id(var)] = tf.reduce_sum(tf.reshape(tf.square(j), [tf.shape(j)[0], -1]), 1)
            sum_fns[id(var)] = (lambda c, j=j: tf.reduce_sum(_scaled(j, c), axis=0))

        factors = clip_factors_fn([sq_norms[id(v)] for v in variables])
        sums = [sum_fns[id(v)](tf.cast(f, v.dtype)) for v, f in zip(variables, factors)]
        return sums, losses, y_pred

    @staticmethod
    def _layer_norms_and_sums(taps: list, g_list: list, sq_norms: dict, sum_fns: dict) -> None:
        """Norms and clipped sums of one layer's variables from the taps of all its
        calls: an example's gradient is the sum over calls, so the calls' positions
        are concatenated before the norm is taken."""
        layer, kind = taps[0].layer, taps[0].kind
        # g is None if a call does not influence the loss
        g_list = [tf.zeros_like(t.z) if g is None else g for t, g in zip(taps, g_list)]
        if kind == "embedding":
            b = tf.shape(g_list[0])[0]
            ids = tf.concat([tf.reshape(t.inputs, [b, -1]) for t in taps], axis=1)
            gf = tf.concat([tf.reshape(g, [b, -1, g.shape[-1]]) for g in g_list], axis=1)
            same = tf.cast(tf.equal(ids[:, :, None], ids[:, None, :]), gf.dtype)
            gg = tf.matmul(gf, gf, transpose_b=True)
            sq_norms[id(layer.embeddings)] = tf.reduce_sum(same * gg, axis=[1, 2])

            def emb_sum(c, gf=gf, ids=ids, layer=layer):
                weighted = tf.reshape(_scaled(gf, c), [-1, gf.shape[-1]])
                return tf.math.unsorted_segment_sum(weighted, tf.reshape(ids, [-1]),
                                                    layer.input_dim)

            sum_fns[id(layer.embeddings)] = emb_sum
            return

        inputs = [_conv_patches(t) if kind == "conv2d" else t.inputs for t in taps]
        if len(taps) == 1 and inputs[0].shape.rank == 2:
            # one Dense call on [B, d]: rank-one per-example gradient
            a, g = inputs[0], g_list[0]
            sq_norms[id(layer.kernel)] = (tf.reduce_sum(tf.square(a), 1)
                                          * tf.reduce_sum(tf.square(g), 1))
            sum_fns[id(layer.kernel)] = (
                lambda c, a=a, g=g: tf.matmul(_kept(a, c), _scaled(g, c), transpose_a=True))
            g_example = g
        else:
            flat = [_flatten_positions(a, g) for a, g in zip(inputs, g_list)]
            a3 = tf.concat([f[0] for f in flat], axis=1) if len(flat) > 1 else flat[0][0]
            g3 = tf.concat([f[1] for f in flat], axis=1) if len(flat) > 1 else flat[0][1]
            positions = 0  # static number of positions over all calls, if known
            for a in inputs:
                count = 1
                for dim in a.shape[1:-1]:
                    count = None if dim is None or count is None else count * dim
                positions = None if count is None or positions is None else positions + count
            sq_norms[id(layer.kernel)] = _outer_sq_norm(a3, g3, positions)
            shape = layer.kernel.shape

            def kernel_sum(c, a3=a3, g3=g3, shape=shape):
                s = tf.tensordot(_kept(a3, c), _scaled(g3, c), axes=[[0, 1], [0, 1]])
                return tf.reshape(s, shape)

            sum_fns[id(layer.kernel)] = kernel_sum
            g_example = tf.reduce_sum(g3, axis=1)
        if layer.use_bias:
            sq_norms[id(layer.bias)] = tf.reduce_sum(tf.square(g_example), 1)
            sum_fns[id(layer.bias)] = (
                lambda c, ge=g_example: tf.reduce_sum(_scaled(ge, c), axis=0))
