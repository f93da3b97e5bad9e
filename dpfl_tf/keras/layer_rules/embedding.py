"""Embedding (with or without ``mask_zero``): z_it = E[x_it].

Example i's gradient has row r equal to sum_{t: x_it = r} g_it, so
||grad_i E||^2 = sum_{s,t} [x_is = x_it] (g_is . g_it)  (over the positions of
all calls), and the clipped sum scatters c_i g_it into row x_it.  ``mask_zero``
only changes the mask handed to later layers, not this layer's gradient.  Cf.
Opacus ``grad_sample/embedding.py``, tensorflow-privacy
``registry_functions/embedding.py``.
"""

from __future__ import annotations

import keras
import tensorflow as tf

from dpfl_tf.keras.layer_rules._base import (LayerRule, Taps, VariableGradients, f32,
                                             grad_or_zeros, register_rule, scaled, stopped,
                                             watched)
from dpfl_tf.keras.layer_rules.dense import plain


class EmbeddingRule(LayerRule):
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
        same = tf.cast(tf.equal(ids[:, :, None], ids[:, None, :]), gf.dtype)
        sq = tf.reduce_sum(same * tf.matmul(gf, gf, transpose_b=True), axis=[1, 2])
        table = layer.embeddings

        def clipped_sum(c, gf=gf, ids=ids):
            rows = tf.reshape(scaled(gf, c), [-1, gf.shape[-1]])
            s = tf.math.unsorted_segment_sum(rows, tf.reshape(ids, [-1]), layer.input_dim)
            return tf.cast(s, table.dtype)

        return [(table, VariableGradients(sq, clipped_sum))]


register_rule(keras.layers.Embedding, EmbeddingRule())
