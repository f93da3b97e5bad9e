"""ReversibleEmbedding (Keras 3, used by KerasHub's language models): a table
E [V, d] read as a lookup, z_it = E[x_it], and, called with ``reverse=True``,
used as the output projection (the tied LM head): logits_is = h_is E^T, then
an optional soft cap c tanh(logits / c).  With ``tie_weights=False`` the head
has its own kernel R [d, V] (a Dense on h).

A tied table's example gradient is the sum of its two uses,

    grad_i E = L_i + H_i,   L_i[r] = sum_{t: x_it = r} gl_it (lookup),
                            H_i = sum_s G_is^T h_is          (head, [V, d]),

with gl = d loss / d z and G = d loss / d logits, summed *before* the norm:

    ||grad_i E||^2 = ||L_i||^2 + ||H_i||^2 + 2 sum_{t,s} G_is[x_it] (gl_it . h_is).

||L_i||^2 is the Embedding rule's run sum, ||H_i||^2 the ghost norm
sum_{s,s'} (h_is . h_is')(G_is . G_is') when its S x S Gram matrices need less
memory than the [V, d] gradient (`ghost_norm_is_smaller`; else L_i + H_i is
materialised), and the cross term gathers G at the example's own ids: O(B S T).
The clipped sum is a scatter of c_i gl plus one [V, B S] x [B S, d] product.

LoRA (``enable_lora``): E + s A B with E frozen.  The lookup reads
m = A[x] (watched; z = E[x] + s m B) and the head w = h B^T (watched;
logits = h E^T + s w A^T), so A is a tied table too (lookup gradient g_m, head
input s w) and B is a Dense over both uses' positions: sum_t (s m_it)^T gl_it +
sum_s g_w,is^T h_is.  Cf. Opacus ``grad_sample/embedding.py`` and
``linear.py``; weight tying: Press & Wolf 2017.
"""

from __future__ import annotations

import keras
import tensorflow as tf

from dpfl_tf.keras.layer_rules._base import (
    LayerRule,
    Taps,
    VariableGradients,
    concat_positions,
    f32,
    ghost_norm_is_smaller,
    grad_or_zeros,
    materialised,
    outer_gradients,
    register_rule,
    scaled,
    scaled_smaller,
    static_positions,
    stopped,
    watched,
)
from dpfl_tf.keras.layer_rules.embedding import lookup_gradients, lookup_sq_norms, lookup_sum

__all__ = ["ReversibleEmbeddingRule", "tied_gradients"]


def tied_gradients(ids, gl, h, g_head, positions, table) -> VariableGradients:
    """Gradients of a table [V, k] used as a lookup (ids [B, T], gradient gl
    [B, T, k]) and as an output projection logits = h table^T (h [B, S, k],
    gradient g_head [B, S, V]; S = `positions` if static): grad_i = L_i + H_i
    (see the module docstring)."""
    gl, h, g_head = f32(gl), f32(h), f32(g_head)
    rows, k = table.shape
    if not ghost_norm_is_smaller(positions, k, rows):
        per_example = tf.einsum("bsv,bsk->bvk", g_head, h)
        b, t = tf.shape(ids)[0], tf.shape(ids)[1]
        index = tf.stack([tf.broadcast_to(tf.range(b)[:, None], [b, t]), ids], axis=-1)
        per_example = tf.tensor_scatter_nd_add(per_example, index, gl)
        return materialised(per_example, table)
    head_sq = tf.reduce_sum(
        tf.matmul(h, h, transpose_b=True) * tf.matmul(g_head, g_head, transpose_b=True), axis=[1, 2]
    )
    at_ids = tf.gather(g_head, ids, axis=2, batch_dims=1)  # [B, S, T]: G_is[x_it]
    cross = tf.reduce_sum(at_ids * tf.matmul(h, gl, transpose_b=True), axis=[1, 2])
    sq = lookup_sq_norms(ids, gl) + head_sq + 2.0 * cross

    def clipped_sum(c, ids=ids, gl=gl, h=h, g_head=g_head):
        hc, gc = scaled_smaller(h, g_head, c)
        head = tf.matmul(tf.reshape(gc, [-1, rows]), tf.reshape(hc, [-1, k]), transpose_a=True)
        return tf.cast(lookup_sum(ids, scaled(gl, c), rows) + head, table.dtype)

    return VariableGradients(sq, clipped_sum)


def _head_gradients(h, g_head, positions, variable, transposed: bool) -> VariableGradients:
    """A Dense on the head's input: kernel [k, V] (or its transpose [V, k])."""
    to_variable = (lambda s: tf.transpose(s[0])) if transposed else (lambda s: s)
    return outer_gradients(h[:, :, None], g_head[:, :, None], positions, to_variable, variable)


def _zero(variable, b) -> VariableGradients:
    """A trainable variable no call used: zero gradients."""
    return VariableGradients(tf.zeros([b]), lambda c, v=variable: tf.zeros(v.shape, v.dtype))


class ReversibleEmbeddingRule(LayerRule):
    def applies(self, layer) -> bool:
        return not getattr(layer, "quantization_mode", None) and bool(layer.trainable_variables)

    def forward(self, layer, inputs, reverse=False):
        lora = bool(getattr(layer, "lora_enabled", False))
        s = layer.lora_alpha / layer.lora_rank if lora else 1.0
        table = layer._embeddings if lora else layer.embeddings
        if not reverse:
            ids = tf.cast(inputs, "int32")
            dtype = layer.compute_dtype
            z, sm, watch = tf.gather(stopped(table, dtype), ids), None, {}
            if lora:
                m = watched(tf.gather(stopped(layer.lora_embeddings_a, dtype), ids))
                sm, watch = m * tf.cast(s, m.dtype), {"m": m}
                z = z + tf.matmul(sm, stopped(layer.lora_embeddings_b, dtype))
            z = watched(z)
            out = tf.identity(z)
            if layer.mask_zero:
                from keras.src.backend import set_keras_mask  # no public alias in Keras 3

                set_keras_mask(out, tf.not_equal(ids, 0))
            return out, Taps({"z": z, **watch}, ("lookup", ids, sm))
        h = tf.convert_to_tensor(inputs)
        if layer.reverse_dtype is not None:
            h = tf.cast(h, layer.reverse_dtype)
        sw, watch = None, {}
        if layer.tie_weights:
            logits = tf.matmul(h, stopped(table, h.dtype), transpose_b=True)
            if lora:
                w = watched(
                    tf.matmul(h, stopped(layer.lora_embeddings_b, h.dtype), transpose_b=True)
                )
                sw, watch = w * tf.cast(s, w.dtype), {"w": w}
                logits = logits + tf.matmul(
                    sw, stopped(layer.lora_embeddings_a, h.dtype), transpose_b=True
                )
        else:
            logits = tf.matmul(h, stopped(layer.reverse_embeddings, h.dtype))
        logits = watched(logits)
        out = logits
        if layer.logit_soft_cap is not None:
            cap = tf.cast(layer.logit_soft_cap, logits.dtype)
            out = tf.tanh(logits / cap) * cap
        return out, Taps({"z": logits, **watch}, ("head", h, sw))

    def gradients(self, layer, calls):
        b = tf.shape(next(iter(calls[0].outputs.values())))[0]

        def gather(kind, i):  # item i of the calls of one kind, [B, positions, ...]
            ts = [
                c.saved[i] if isinstance(i, int) else grad_or_zeros(c, i)
                for c in calls
                if c.saved[0] == kind
            ]
            if not ts:
                return None
            if ts[0].dtype.is_integer:
                return tf.concat([tf.reshape(t, [b, -1]) for t in ts], axis=1)
            return concat_positions([f32(t) for t in ts])

        ids, gl = gather("lookup", 1), gather("lookup", "z")
        h, g_head = gather("head", 1), gather("head", "z")
        looked, headed = ids is not None, h is not None
        tied_head = headed and layer.tie_weights
        # static positions of each kind (the reshaped tensors lose them)
        at = {
            kind: static_positions(
                *[
                    c.saved[1][..., None] if kind == "lookup" else c.saved[1]
                    for c in calls
                    if c.saved[0] == kind
                ]
            )
            for kind in ("lookup", "head")
        }
        result = []
        if getattr(layer, "lora_enabled", False):
            a, bv = layer.lora_embeddings_a, layer.lora_embeddings_b
            sm, gm = gather("lookup", 2), gather("lookup", "m")
            sw, gw = (gather("head", 2), gather("head", "w")) if tied_head else (None, None)
            if looked and tied_head:
                result.append((a, tied_gradients(ids, gm, sw, g_head, at["head"], a)))
            elif looked:
                result.append((a, lookup_gradients(ids, gm, a)))
            elif tied_head:
                result.append((a, _head_gradients(sw, g_head, at["head"], a, True)))
            # B: (s m)^T gl over the lookups' positions, g_w^T h over the head's
            pairs = ([(sm, gl, "lookup")] if looked else []) + (
                [(gw, h, "head")] if tied_head else []
            )
            if pairs:
                left = tf.concat([p[0] for p in pairs], axis=1)
                right = tf.concat([p[1] for p in pairs], axis=1)
                counts = [at[p[2]] for p in pairs]
                positions = None if None in counts else sum(counts)
                result.append(
                    (
                        bv,
                        outer_gradients(
                            left[:, :, None], right[:, :, None], positions, lambda s: s[0], bv
                        ),
                    )
                )
        trained = {id(v): v for v in layer.trainable_variables}
        table = layer._embeddings if getattr(layer, "lora_enabled", False) else layer.embeddings
        if id(table) in trained and looked and tied_head:  # (frozen under LoRA)
            result.append((table, tied_gradients(ids, gl, h, g_head, at["head"], table)))
        elif id(table) in trained and looked:
            result.append((table, lookup_gradients(ids, gl, table)))
        elif id(table) in trained and tied_head:
            result.append((table, _head_gradients(h, g_head, at["head"], table, True)))
        if not layer.tie_weights and headed and id(layer.reverse_embeddings) in trained:
            result.append(
                (
                    layer.reverse_embeddings,
                    _head_gradients(h, g_head, at["head"], layer.reverse_embeddings, False),
                )
            )
        done = {id(v) for v, _ in result}
        return [(v, g) for v, g in result if id(v) in trained] + [
            (v, _zero(v, b)) for i, v in trained.items() if i not in done
        ]


if hasattr(keras.layers, "ReversibleEmbedding"):
    register_rule(keras.layers.ReversibleEmbedding, ReversibleEmbeddingRule())
