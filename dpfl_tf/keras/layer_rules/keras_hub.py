"""KerasHub's own layers with weights (``pip install "dpfl-tf[hub]"``).

* ``PositionEmbedding``: out_i = P[p] broadcast over the batch, p = start_index
  + (0..S-1) or the given ``positions``.  The broadcast output is watched, so
  g_i is example i's own gradient and P is a lookup table with ids p:
  ||grad_i P||^2 = sum_r ||sum_{s: p_s = r} g_is||^2 (`embedding.lookup_gradients`;
  sum_s ||g_is||^2 when one call reads distinct rows).  O(B S d).
* ``ViTPatchingAndEmbedding``: patches = Conv2D(x) (the convolution rule),
  a class token t prepended (its gradient: g_i at position 0) and a
  position table Q added to every position (its gradient: g_i itself), the last
  two materialised (parameter-sized, [B, 1, 1, d] and [B, N, d]).
* The RMS normalisations of KerasHub's decoders, y = xhat * (o + scale) with
  xhat = x / sqrt(mean(x^2) + eps) over the last axis: o = 1 for Gemma
  (``1 + scale``), o = 0 for Llama, Mistral, Mixtral, Phi-3, Qwen, Qwen3 and
  ``keras_hub.layers.RMSNormalization``.  grad_i scale = sum_s g_is * xhat_is,
  materialised; xhat comes from the layer's own ``call`` with scale = 1 - o.

Attention (multi-head, grouped-query, rotary embeddings; caches are off in
training) and the feed-forward blocks hold their weights in EinsumDense and
Dense sublayers, which the planner descends into; ``TokenAndPositionEmbedding``
is a ReversibleEmbedding and a PositionEmbedding (`reversible_embedding.py`).
"""

from __future__ import annotations

import importlib

import keras
import tensorflow as tf

from dpfl_tf.keras.layer_rules._base import (
    LayerCall,
    LayerRule,
    Taps,
    VariableGradients,
    f32,
    find_rule,
    grad_or_zeros,
    materialised,
    original_call,
    register_rule,
    scaled,
    stopped,
    watched,
)
from dpfl_tf.keras.layer_rules.dense import plain
from dpfl_tf.keras.layer_rules.embedding import lookup_gradients, lookup_sum

__all__ = ["PositionEmbeddingRule", "ViTPatchingAndEmbeddingRule", "OffsetScaleNormRule"]


def _row_gradients(calls, table) -> VariableGradients:
    """A table read at rows ids (saved per call: [S] or [B, S], and whether
    they are distinct) with gradients g [B, ..., S, d]: the axes between the
    batch and S are summed first."""
    gs = [f32(grad_or_zeros(c, "z")) for c in calls]
    b = tf.shape(gs[0])[0]
    gs = [
        tf.reduce_sum(g, axis=list(range(1, g.shape.rank - 2))) if g.shape.rank > 3 else g
        for g in gs
    ]
    ids = [tf.broadcast_to(c.saved[0], [b, tf.shape(g)[1]]) for c, g in zip(calls, gs)]
    if len(calls) == 1 and calls[0].saved[1]:  # distinct rows: no sort
        g, i = gs[0], ids[0]
        return VariableGradients(
            tf.reduce_sum(tf.square(g), axis=[1, 2]),
            lambda c: tf.cast(lookup_sum(i, scaled(g, c), table.shape[0]), table.dtype),
        )
    return lookup_gradients(tf.concat(ids, axis=1), tf.concat(gs, axis=1), table)


class PositionEmbeddingRule(LayerRule):
    def applies(self, layer) -> bool:
        return plain(layer)

    def forward(self, layer, inputs, start_index=0, positions=None):
        shape = tf.shape(inputs)
        table = stopped(layer.position_embeddings, layer.compute_dtype)
        if positions is None:
            ids = tf.range(shape[-2]) + tf.cast(start_index, tf.int32)
        else:
            ids = tf.cast(positions, tf.int32)
        z = watched(tf.broadcast_to(tf.gather(table, ids), shape))
        return z, Taps({"z": z}, (ids, positions is None))

    def gradients(self, layer, calls):
        table = layer.position_embeddings
        return [(table, _row_gradients(calls, table))]


class ViTPatchingAndEmbeddingRule(LayerRule):
    """Delegates the patch convolution to its rule; class token and position
    table from the gradient at the output."""

    def applies(self, layer) -> bool:
        conv = layer.patch_embedding
        rule = find_rule(conv)
        return (
            layer.data_format == "channels_last"
            and plain(layer.position_embedding)
            and rule is not None
            and rule.applies(conv)
        )

    def forward(self, layer, inputs):
        conv = layer.patch_embedding
        patches, conv_taps = find_rule(conv).forward(conv, inputs)
        b, d = tf.shape(patches)[0], patches.shape[-1]
        x = tf.reshape(patches, [b, -1, d])
        watch = {"conv/" + k: v for k, v in conv_taps.watched.items()}
        if layer.use_class_token:
            token = watched(tf.tile(stopped(layer.class_token, x.dtype), [b, 1, 1]))
            watch["token"] = token
            x = tf.concat([token, x], axis=1)
        table = stopped(layer.position_embedding.embeddings, x.dtype)
        pos = watched(tf.broadcast_to(table[None, : layer.num_positions], tf.shape(x)))
        watch["pos"] = pos
        return x + pos, Taps(watch, conv_taps.saved)

    def gradients(self, layer, calls):
        conv = layer.patch_embedding

        def part(c, prefix):
            return {k[len(prefix) :]: v for k, v in c.items() if k.startswith(prefix)}

        conv_calls = [
            LayerCall(c.saved, part(c.outputs, "conv/"), part(c.grads, "conv/")) for c in calls
        ]
        result = list(find_rule(conv).gradients(conv, conv_calls))
        table = layer.position_embedding.embeddings
        pos = tf.add_n([f32(grad_or_zeros(c, "pos")) for c in calls])
        result.append((table, materialised(pos, table)))
        if layer.use_class_token:
            token = tf.add_n([f32(grad_or_zeros(c, "token")) for c in calls])
            result.append((layer.class_token, materialised(token[:, None], layer.class_token)))
        trained = {id(v) for v in layer.trainable_variables}
        return [(v, g) for v, g in result if id(v) in trained]


class OffsetScaleNormRule(LayerRule):
    """y = xhat * (offset + scale), scale over the last axis."""

    def __init__(self, offset: float):
        self.offset = float(offset)

    def applies(self, layer) -> bool:
        return plain(layer) and isinstance(getattr(layer, "scale", None), keras.Variable)

    def forward(self, layer, inputs, *args, **kwargs):
        scale = layer.scale
        neutral = tf.fill(scale.shape, tf.cast(1.0 - self.offset, scale.dtype))
        with keras.StatelessScope(state_mapping=[(scale, neutral)]):
            xhat = original_call(layer)(inputs, *args, **kwargs)
        z = watched(xhat * (self.offset + stopped(scale, xhat.dtype)))
        return z, Taps({"z": z}, xhat)

    def gradients(self, layer, calls):
        per_call = []
        for c in calls:
            t = f32(grad_or_zeros(c, "z")) * f32(c.saved)
            per_call.append(tf.reduce_sum(t, axis=list(range(1, t.shape.rank - 1))))
        return [(layer.scale, materialised(tf.add_n(per_call), layer.scale))]


_MODELS = "keras_hub.src.models."
_NORMS = {  # (module, class): offset
    ("keras_hub.src.layers.modeling.rms_normalization", "RMSNormalization"): 0.0,
    (_MODELS + "gemma.rms_normalization", "RMSNormalization"): 1.0,
    (_MODELS + "llama.llama_layernorm", "LlamaLayerNorm"): 0.0,
    (_MODELS + "mistral.mistral_layer_norm", "MistralLayerNormalization"): 0.0,
    (_MODELS + "mixtral.mixtral_layer_norm", "MixtralLayerNormalization"): 0.0,
    (_MODELS + "phi3.phi3_layernorm", "Phi3LayerNorm"): 0.0,
    (_MODELS + "qwen.qwen_layernorm", "QwenLayerNorm"): 0.0,
    (_MODELS + "qwen3.qwen3_layernorm", "Qwen3LayerNorm"): 0.0,
}


def _class(module: str, name: str):
    """A KerasHub class by module path, or None where this version lacks it."""
    try:
        return getattr(importlib.import_module(module), name, None)
    except ImportError:
        return None


def register() -> list:
    """Registers the rules above for the KerasHub classes this version has;
    returns the classes registered."""
    done = []
    for (module, name), offset in _NORMS.items():
        cls = _class(module, name)
        if cls is not None:
            register_rule(cls, OffsetScaleNormRule(offset))
            done.append(cls)
    for module, name, rule in [
        (
            "keras_hub.src.layers.modeling.position_embedding",
            "PositionEmbedding",
            PositionEmbeddingRule(),
        ),
        (_MODELS + "vit.vit_layers", "ViTPatchingAndEmbedding", ViTPatchingAndEmbeddingRule()),
    ]:
        cls = _class(module, name)
        if cls is not None:
            register_rule(cls, rule)
            done.append(cls)
    return done
