"""LoRA (Hu et al. 2021) of Keras 3's Dense, EinsumDense and Embedding
(``layer.enable_lora(rank)``): the kernel W is frozen and the layer computes
with W + s A B, s = lora_alpha / rank, A = lora_*_a, B = lora_*_b (A's last
axis and B's first are the rank r; B's last is the kernel's last axis).

For z = einsum(eq, x, W + s A B) + b the LoRA term is two products through a
rank-r tensor m, each an einsum layer of its own:

    m = einsum(eq1, x, F1)   (watched)     z = einsum(eq, x, W) + s einsum(eq2, m, F2) + b

with (F1, F2) = (A, B) when the kernel's last axis is kept in the output (a
projection such as ``abc,cde->abde``), else (B, A) (that axis is contracted).
With g_m = d loss / d m and g_z = d loss / d z, example i's gradients are the
einsum-kernel gradients (`einsum_dense.kernel_gradients`) of F1 from (x_i, g_m,i)
and of F2 from (s m_i, g_z,i): ghost norms or r-sized materialised ones, never a
gradient of W's size.  An Embedding: z = E[x] + s A[x] B, with m = A[x] (a
lookup: `embedding.lookup_gradients` from (x, g_m)) and B a Dense on (s m, g_z).
Only the LoRA factors (and a bias, if it trains) get gradients; the frozen
kernel is read, never differentiated.  Quantized layers use the fallback.
"""

from __future__ import annotations

import string

import keras
import tensorflow as tf

from dpfl_tf.keras.layer_rules._base import (
    LayerRule,
    Taps,
    f32,
    grad_or_zeros,
    register_rule,
    stopped,
    watched,
)
from dpfl_tf.keras.layer_rules.dense import DenseRule
from dpfl_tf.keras.layer_rules.einsum_dense import (
    EinsumDenseRule,
    _expand,
    batch_first,
    bias_gradients,
    kernel_gradients,
)
from dpfl_tf.keras.layer_rules.embedding import EmbeddingRule, lookup_gradients

__all__ = ["LoraEinsumRule", "LoraEmbeddingRule", "lora_equations"]


def enabled(layer) -> bool:
    return bool(getattr(layer, "lora_enabled", False))


def _applies(layer) -> bool:
    return (
        enabled(layer)
        and not getattr(layer, "quantization_mode", None)
        and bool(layer.trainable_variables)
    )


def lora_equations(inp: str, ker: str, out: str) -> tuple[str, str, bool]:
    """(eq1, eq2, a_first) for einsum(inp,ker->out) with kernel A B (no ellipsis):
    m = einsum(eq1, x, F1), z = einsum(eq2, m, F2), (F1, F2) = (A, B) if a_first."""
    r = next(c for c in string.ascii_letters if c not in inp + ker + out)
    last, a_letters, b_letters = ker[-1], ker[:-1] + r, r + ker[-1]
    if last in out or last not in inp:  # A first: m keeps every output letter but B's
        mid = "".join(c for c in out if c != last or last in inp) + r
        return f"{inp},{a_letters}->{mid}", f"{mid},{b_letters}->{out}", True
    mid = "".join(c for c in inp if c != last) + r  # B first: it contracts x's `last`
    return f"{inp},{b_letters}->{mid}", f"{mid},{a_letters}->{out}", False


class LoraEinsumRule(LayerRule):
    """LoRA of a Dense (the einsum ``...a,ab->...b``) or an EinsumDense."""

    def applies(self, layer) -> bool:
        return _applies(layer) and batch_first(self._einsum(layer)[0])

    @staticmethod
    def _einsum(layer) -> tuple[str, str | None]:
        if isinstance(layer, keras.layers.EinsumDense):
            return layer.equation, layer.bias_axes
        return "...a,ab->...b", "b"

    def forward(self, layer, inputs, **kwargs):
        x = tf.convert_to_tensor(inputs)
        equation, _ = self._einsum(layer)
        inp, ker, out = _expand(equation, x.shape.rank)
        eq1, eq2, a_first = lora_equations(inp, ker, out)
        a, b = stopped(layer.lora_kernel_a, x.dtype), stopped(layer.lora_kernel_b, x.dtype)
        first, second = (a, b) if a_first else (b, a)
        scale = layer.lora_alpha / layer.lora_rank
        m = watched(tf.einsum(eq1, x, first))
        sm = m * tf.cast(scale, m.dtype)
        z = tf.einsum(f"{inp},{ker}->{out}", x, stopped(layer._kernel, x.dtype))
        z = z + tf.einsum(eq2, sm, second)
        if layer.bias is not None:
            z = z + stopped(layer.bias, z.dtype)
        z = watched(z)
        out_t = layer.activation(z) if layer.activation is not None else z
        return out_t, Taps({"m": m, "z": z}, (x, sm))

    def gradients(self, layer, calls):
        equation, bias_axes = self._einsum(layer)
        xs = [f32(c.saved[0]) for c in calls]
        sms = [f32(c.saved[1]) for c in calls]
        gms = [f32(grad_or_zeros(c, "m")) for c in calls]
        gzs = [f32(grad_or_zeros(c, "z")) for c in calls]
        inp, ker, out = _expand(equation, xs[0].shape.rank)
        eq1, eq2, a_first = lora_equations(inp, ker, out)
        first, second = (
            (layer.lora_kernel_a, layer.lora_kernel_b)
            if a_first
            else (layer.lora_kernel_b, layer.lora_kernel_a)
        )
        result = [
            (first, kernel_gradients(eq1, xs, gms, first)),
            (second, kernel_gradients(eq2, sms, gzs, second)),
        ]
        if layer._kernel.trainable:  # the frozen kernel made trainable again
            result.append(
                (layer._kernel, kernel_gradients(f"{inp},{ker}->{out}", xs, gzs, layer._kernel))
            )
        if layer.bias is not None:
            result.append((layer.bias, bias_gradients(out, bias_axes, gzs, layer.bias)))
        return _training(layer, result)


class LoraEmbeddingRule(LayerRule):
    """LoRA of an Embedding: z = E[x] + s A[x] B."""

    def applies(self, layer) -> bool:
        return _applies(layer)

    def forward(self, layer, inputs, **kwargs):
        ids = tf.cast(inputs, "int32")
        dtype = layer.compute_dtype
        m = watched(tf.gather(stopped(layer.lora_embeddings_a, dtype), ids))
        sm = m * tf.cast(layer.lora_alpha / layer.lora_rank, m.dtype)
        z = tf.gather(stopped(layer._embeddings, dtype), ids) + tf.matmul(
            sm, stopped(layer.lora_embeddings_b, dtype)
        )
        return watched(z), Taps({"m": m, "z": z}, (ids, sm))

    def gradients(self, layer, calls):
        b = tf.shape(calls[0].saved[0])[0]
        ids = tf.concat([tf.reshape(c.saved[0], [b, -1]) for c in calls], axis=1)

        def positions(name):
            ts = [f32(c.saved[1]) if name == "sm" else f32(grad_or_zeros(c, name)) for c in calls]
            return tf.concat([tf.reshape(t, [b, -1, t.shape[-1]]) for t in ts], axis=1)

        gm, sm, gz = positions("m"), positions("sm"), positions("z")
        result = [
            (layer.lora_embeddings_a, lookup_gradients(ids, gm, layer.lora_embeddings_a)),
            (
                layer.lora_embeddings_b,
                kernel_gradients("bsr,rd->bsd", [sm], [gz], layer.lora_embeddings_b),
            ),
        ]
        if layer._embeddings.trainable:
            result.append((layer._embeddings, lookup_gradients(ids, gz, layer._embeddings)))
        return _training(layer, result)


def _training(layer, result: list) -> list:
    """The (variable, gradients) pairs of the layer's variables that train."""
    trained = {id(v) for v in layer.trainable_variables}
    return [(v, g) for v, g in result if id(v) in trained]


class _PlainOrLora(LayerRule):
    """Registered for Dense, EinsumDense and Embedding: the family's rule, or its
    LoRA rule once ``enable_lora`` was called (`LayerRule.rule_for`).  It
    reimplements what either of them does, so a subclass overriding any of it
    gets neither by inheritance."""

    def __init__(self, plain: LayerRule, lora: LayerRule):
        self.plain, self.lora = plain, lora
        self.reimplements = tuple(dict.fromkeys(plain.reimplements + lora.reimplements))

    def rule_for(self, layer) -> LayerRule:
        return self.lora if enabled(layer) else self.plain


LORA_EINSUM = LoraEinsumRule()
LORA_EMBEDDING = LoraEmbeddingRule()
register_rule(keras.layers.Dense, _PlainOrLora(DenseRule(), LORA_EINSUM))
register_rule(keras.layers.EinsumDense, _PlainOrLora(EinsumDenseRule(), LORA_EINSUM))
register_rule(keras.layers.Embedding, _PlainOrLora(EmbeddingRule(), LORA_EMBEDDING))
