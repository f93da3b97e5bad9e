"""Embedding (with or without ``mask_zero``): z_it = E[x_it].

Example i's gradient has row r equal to sum_{t: x_it = r} g_it (over the
positions of all calls), so

    ||grad_i E||^2 = sum_r ||sum_{t: x_it = r} g_it||^2,

computed by sorting each example's ids, summing g over each run of equal ids
(one segment sum) and squaring: O(B T d), where the pairwise form
sum_{s,t} [x_is = x_it] (g_is . g_it) costs O(B T^2 d).  The clipped sum
scatters c_i g_it into row x_it.  ``mask_zero``
only changes the mask handed to later layers, not this layer's gradient.  Cf.
Opacus ``grad_sample/embedding.py``, tensorflow-privacy
``registry_functions/embedding.py``.
"""

from __future__ import annotations

import keras
import tensorflow as tf

from dpfl_tf.keras.layer_rules._base import (
    LayerRule,
    Taps,
    VariableGradients,
    f32,
    grad_or_zeros,
    register_rule,
    scaled,
    stopped,
    watched,
)
from dpfl_tf.keras.layer_rules.dense import plain


class EmbeddingRule(LayerRule):
    reimplements = ("call", "embeddings")

    def applies(self, layer) -> bool:
        return plain(layer)

    def forward(self, layer, inputs, **kwargs):
        ids = tf.cast(inputs, "int32")
        z = tf.gather(stopped(layer.embeddings, layer.compute_dtype), ids)
        return watched(z), Taps({"z": z}, ids)

    def gradients(self, layer, calls):
        gs = [f32(grad_or_zeros(c, "z")) for c in calls]
        b = tf.shape(gs[0])[0]
        ids = tf.concat([tf.reshape(c.saved, [b, -1]) for c in calls], axis=1)
        gf = tf.concat([tf.reshape(g, [b, -1, g.shape[-1]]) for g in gs], axis=1)
        return [(layer.embeddings, lookup_gradients(ids, gf, layer.embeddings))]


def lookup_gradients(ids: tf.Tensor, g: tf.Tensor, table) -> VariableGradients:
    """VariableGradients of a table [R, d] read as z_it = table[ids_it], for ids
    [B, T] and g [B, T, d] (see the module docstring)."""

    def clipped_sum(c, g=g, ids=ids):
        return tf.cast(lookup_sum(ids, scaled(g, c), table.shape[0]), table.dtype)

    return VariableGradients(lookup_sq_norms(ids, g), clipped_sum)


def lookup_sum(ids: tf.Tensor, g: tf.Tensor, rows: int) -> tf.Tensor:
    """sum_i sum_t g_it scattered into row ids_it: [rows, d]."""
    return tf.math.unsorted_segment_sum(
        tf.reshape(g, [-1, g.shape[-1]]), tf.reshape(ids, [-1]), rows
    )


def lookup_sq_norms(ids: tf.Tensor, g: tf.Tensor) -> tf.Tensor:
    """sum_r ||sum_{t: ids_it = r} g_it||^2 per example, for ids [B, T] and
    g [B, T, d]: runs of equal ids after a per-example sort, one segment each
    (static segment count B T, so it compiles under XLA)."""
    b, t = tf.shape(ids)[0], tf.shape(ids)[1]
    order = tf.argsort(ids, axis=1, stable=True)
    ids_sorted = tf.gather(ids, order, batch_dims=1)
    g_sorted = tf.gather(g, order, batch_dims=1)
    first = tf.concat(
        [tf.ones([b, 1], tf.int32), tf.cast(ids_sorted[:, 1:] != ids_sorted[:, :-1], tf.int32)],
        axis=1,
    )
    segment = tf.cumsum(first, axis=1) - 1 + tf.range(b)[:, None] * t
    run_sums = tf.math.unsorted_segment_sum(
        tf.reshape(g_sorted, [-1, g.shape[-1]]), tf.reshape(segment, [-1]), b * t
    )
    return tf.reduce_sum(tf.reshape(tf.square(run_sums), [b, -1]), axis=1)


register_rule(keras.layers.Embedding, EmbeddingRule())
