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


def _tapped_call(layer, kind: str, taps: list) -> Callable:
    """The layer's computation written out so its input and pre-activation are kept."""

    def call(inputs, **kwargs):
        a = tf.convert_to_tensor(inputs)
        if kind == "dense":
            z = tf.matmul(a, layer.kernel) if a.shape.rank == 2 else tf.tensordot(
                a, layer.kernel, axes=[[a.shape.rank - 1], [0]])
        elif kind == "conv2d":
            z = tf.nn.conv2d(a, layer.kernel, strides=[1, *layer.strides, 1],
                             padding=str(layer.padding).upper())
        else:  # embedding
            a = tf.cast(a, "int32")
            z = tf.gather(layer.embeddings, a)
            taps.append(_Tap(layer, kind, a, z))
            return z
        if layer.use_bias:
            z = z + layer.bias
        taps.append(_Tap(layer, kind, a, z))
        return layer.activation(z) if layer.activation is not None else z

    return call


def _has_graph(model) -> bool:
    inner = getattr(model, "_functional", None) if isinstance(model, keras.Sequential) else model
    return inner is not None and hasattr(inner, "_run_through_graph")


def _forward(op, inputs, taps: list, training: bool):
    """Runs `op` on inputs, tapping fast-path layers inside functional graphs."""
    if isinstance(op, keras.Model) and _has_graph(op):
        graph = op._functional if isinstance(op, keras.Sequential) else op
        inputs = graph._standardize_inputs(inputs) if hasattr(graph, "_standardize_inputs") \
            else inputs
        outputs = graph._run_through_graph(
            inputs, operation_fn=lambda sub: _operation(sub, taps, training))
        return graph._pack_outputs(outputs) if hasattr(graph, "_pack_outputs") else outputs
    return _call_with_training(op, training)(inputs)


def _operation(op, taps: list, training: bool):
    kind = _fast_kind(op) if isinstance(op, keras.layers.Layer) else None
    if kind is not None:
        return _tapped_call(op, kind, taps)
    if isinstance(op, keras.Model) and _has_graph(op):
        return lambda inputs, **kw: _forward(op, inputs, taps, training)
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
    """Per-example squared norms and clipped sums for one model and loss."""

    def __init__(self, model: keras.Model, loss_fn, *, fast: bool = True):
        self.model = model
        self.loss_fn = loss_fn
        self.fast = fast

    def compute(self, x, y, weights: tf.Tensor, clip_factors_fn, training: bool = True):
        """Returns (clipped sums aligned with model.trainable_variables,
        per-example losses, y_pred).

        `weights` is 1 for real examples and 0 for padding; `clip_factors_fn`
        maps a list of per-variable squared norms ([B] each) to per-variable
        clip factors ([B] each) -- the sanitizer's clipping rule.
        """
        variables = self.model.trainable_variables
        taps: list[_Tap] = []
        with tf.GradientTape(persistent=True) as tape:
            if self.fast:
                y_pred = _forward(self.model, x, taps, training)
            else:
                y_pred = _call_with_training(self.model, training)(x)
            losses = per_example_loss(self.loss_fn, y, y_pred)
            losses = losses * tf.cast(weights, losses.dtype)
            total = tf.reduce_sum(losses)

        tapped_ids = {}
        for t_index, tap in enumerate(taps):
            for var in tap.layer.trainable_variables:
                tapped_ids[id(var)] = t_index
        generic = [v for v in variables if id(v) not in tapped_ids]

        g_list = tape.gradient(total, [t.z for t in taps]) if taps else []
        jac = (tape.jacobian(losses, generic, experimental_use_pfor=True)
               if generic else [])
        del tape

        sq_norms: dict[int, tf.Tensor] = {}
        sum_fns: dict[int, Callable[[tf.Tensor], tf.Tensor]] = {}
        for tap, g in zip(taps, g_list):
            self._tap_norms_and_sums(tap, g, sq_norms, sum_fns)
        for var, j in zip(generic, jac):
            j = tf.zeros((tf.shape(losses)[0],) + tuple(var.shape), var.dtype) if j is None else j
            sq_norms[id(var)] = tf.reduce_sum(tf.reshape(tf.square(j), [tf.shape(j)[0], -1]), 1)
            sum_fns[id(var)] = (lambda c, j=j: tf.reduce_sum(_scaled(j, c), axis=0))

        factors = clip_factors_fn([sq_norms[id(v)] for v in variables])
        sums = [sum_fns[id(v)](tf.cast(f, v.dtype)) for v, f in zip(variables, factors)]
        return sums, losses, y_pred

    @staticmethod
    def _tap_norms_and_sums(tap: _Tap, g: tf.Tensor, sq_norms: dict, sum_fns: dict) -> None:
        layer = tap.layer
        if g is None:  # the layer does not influence the loss
            g = tf.zeros_like(tap.z)
        if tap.kind == "embedding":
            b = tf.shape(g)[0]
            ids = tf.reshape(tap.inputs, [b, -1])
            gf = tf.reshape(g, [b, -1, g.shape[-1]])
            same = tf.cast(tf.equal(ids[:, :, None], ids[:, None, :]), gf.dtype)
            gg = tf.matmul(gf, gf, transpose_b=True)
            sq_norms[id(layer.embeddings)] = tf.reduce_sum(same * gg, axis=[1, 2])

            def emb_sum(c, gf=gf, ids=ids, layer=layer):
                weighted = tf.reshape(_scaled(gf, c), [-1, gf.shape[-1]])
                return tf.math.unsorted_segment_sum(weighted, tf.reshape(ids, [-1]),
                                                    layer.input_dim)

            sum_fns[id(layer.embeddings)] = emb_sum
            return

        a = _conv_patches(tap) if tap.kind == "conv2d" else tap.inputs
        if a.shape.rank == 2:  # Dense on [B, d]: rank-one per-example gradient
            sq_norms[id(layer.kernel)] = (tf.reduce_sum(tf.square(a), 1)
                                          * tf.reduce_sum(tf.square(g), 1))
            sum_fns[id(layer.kernel)] = (
                lambda c, a=a, g=g: tf.matmul(_kept(a, c), _scaled(g, c), transpose_a=True))
            g_example = g
        else:
            a3, g3 = _flatten_positions(a, g)
            positions = 1
            for dim in a.shape[1:-1]:
                positions = None if dim is None or positions is None else positions * dim
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
