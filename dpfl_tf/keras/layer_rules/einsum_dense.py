"""EinsumDense: z = einsum(equation, x, W) + b (the projections of
MultiHeadAttention and of most transformer blocks).

Write the equation's letters as: b the batch (the first input letter), K_in
the kernel letters contracted with the input, K_out the kernel letters kept in
the output, S the other letters shared by input and output (positions), R
input letters summed away.  Then  z_{b S K_out} = sum_{K_in} x'_{b S K_in} W,
with x' = x summed over R, i.e. a Dense layer on [B, S, |K_in|] ->
[B, S, |K_out|]: the ghost/materialised norm of `outer_gradients` applies
(tensorflow-privacy ``registry_functions/einsum_dense.py`` does the same with a
reshape).  An equation with a kernel letter in both input and output (a
"diagonal" kernel) is materialised directly: grad_i W = einsum(x_i, g_i).
The bias (over `bias_axes`) gets g summed over the other output axes.
"""

from __future__ import annotations

import math
import string

import keras
import tensorflow as tf

from dpfl_tf.keras.layer_rules._base import (
    LayerRule,
    Taps,
    f32,
    grad_or_zeros,
    materialised,
    outer_gradients,
    register_rule,
    stopped,
    watched,
)
from dpfl_tf.keras.layer_rules.dense import plain


def _expand(equation: str, input_rank: int) -> tuple[str, str, str]:
    """(input, kernel, output) letters with any ellipsis written out."""
    lhs, out = equation.split("->")
    inp, ker = lhs.split(",")
    if "..." in inp:
        unused = [c for c in string.ascii_letters if c not in equation]
        n = input_rank - (len(inp) - 3)
        fill = "".join(unused[:n])
        inp, out = inp.replace("...", fill), out.replace("...", fill)
    return inp, ker, out


def batch_first(equation: str) -> bool:
    """Whether the input's first axis (a letter, or the ellipsis's first) is a
    batch axis the output keeps and the kernel does not have."""
    lhs, out = equation.split("->")
    inp, ker = lhs.split(",")
    if "..." in ker:
        return False
    return out.startswith("...") if inp.startswith("...") else (inp[0] in out and inp[0] not in ker)


class EinsumDenseRule(LayerRule):
    reimplements = ("call", "kernel")

    def applies(self, layer) -> bool:
        return plain(layer) and batch_first(layer.equation)

    def forward(self, layer, inputs, **kwargs):
        x = tf.convert_to_tensor(inputs)
        z = tf.einsum(layer.equation, x, stopped(layer.kernel, x.dtype))
        if layer.bias is not None:
            z = z + stopped(layer.bias, z.dtype)
        z = watched(z)
        out = layer.activation(z) if layer.activation is not None else z
        return out, Taps({"z": z}, x)

    def gradients(self, layer, calls):
        xs = [f32(c.saved) for c in calls]
        gs = [f32(grad_or_zeros(c, "z")) for c in calls]
        result = [(layer.kernel, kernel_gradients(layer.equation, xs, gs, layer.kernel))]
        if layer.bias is not None:
            out = _expand(layer.equation, xs[0].shape.rank)[2]
            result.append((layer.bias, bias_gradients(out, layer.bias_axes, gs, layer.bias)))
        return result


def kernel_gradients(equation: str, xs, gs, kernel):
    """VariableGradients of the kernel of z = einsum(equation, x, kernel), from the
    inputs `xs` and the output gradients `gs` of its calls (see the module
    docstring: a Dense on [B, S, |K_in|] -> [B, S, |K_out|], or materialised
    for a diagonal kernel)."""
    inp, ker, out = _expand(equation, xs[0].shape.rank)
    b = inp[0]
    k_in = [c for c in ker if c in inp and c not in out]
    k_out = [c for c in ker if c in out and c not in inp]
    both = [c for c in ker if c in inp and c in out]
    s_letters = [c for c in inp if c in out and c not in ker and c != b]
    if both or b in ker:
        per_example = tf.add_n([tf.einsum(f"{inp},{out}->{b}{ker}", x, g) for x, g in zip(xs, gs)])
        return materialised(per_example, kernel)
    size = dict(zip(ker, kernel.shape))
    d_in = math.prod(size[c] for c in k_in)
    d_out = math.prod(size[c] for c in k_out)
    s_str, in_str, out_str = "".join(s_letters), "".join(k_in), "".join(k_out)
    a3 = tf.concat(
        [
            tf.reshape(tf.einsum(f"{inp}->{b}{s_str}{in_str}", x), [tf.shape(x)[0], -1, d_in])
            for x in xs
        ],
        axis=1,
    )
    g3 = tf.concat(
        [
            tf.reshape(tf.einsum(f"{out}->{b}{s_str}{out_str}", g), [tf.shape(g)[0], -1, d_out])
            for g in gs
        ],
        axis=1,
    )
    positions = 0  # static number of positions over all calls, if known
    for x in xs:
        count = 1
        for c in s_letters:
            dim = x.shape[inp.index(c)]
            count = None if dim is None or count is None else count * dim
        positions = None if count is None or positions is None else positions + count
    shape = [size[c] for c in k_in + k_out]
    to_kernel = lambda s: tf.einsum(f"{in_str}{out_str}->{ker}", tf.reshape(s, shape))
    return outer_gradients(a3[:, :, None], g3[:, :, None], positions, to_kernel, kernel)


def bias_gradients(out: str, bias_axes: str, gs, bias):
    """VariableGradients of a bias over `bias_axes` added to an output with
    letters `out` (no ellipsis): g summed over the other output axes (and over
    calls), materialised."""
    first = min(out.index(c) for c in bias_axes)
    summed = [i for i in range(1, len(out)) if i < first or out[i] not in bias_axes]
    per_example = tf.add_n([tf.reduce_sum(g, axis=summed, keepdims=True) for g in gs])
    return materialised(tf.reshape(per_example, [-1, *bias.shape]), bias)


register_rule(keras.layers.EinsumDense, EinsumDenseRule())
