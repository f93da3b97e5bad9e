"""LayerNormalization, GroupNormalization, RMSNormalization: y = xhat * gamma + beta.

xhat (the normalised input) does not depend on gamma or beta, so example i's
gradients are  grad gamma = sum_s g_is * xhat_is  and  grad beta = sum_s g_is,
summed over every axis but the batch and the parameter axes (and over calls);
they have the parameter's size, so they are materialised.  xhat is computed by
the layer's own `call` with gamma = 1 and beta = 0, so the rule follows the
layer's exact normalisation (mean/variance, RMS, groups, epsilon).  Cf. Opacus
``grad_sample/layer_norm.py``, ``group_norm.py``; tensorflow-privacy
``registry_functions/layer_normalization.py``.
"""

from __future__ import annotations

import keras
import tensorflow as tf

from dpfl_tf.keras.layer_rules._base import (
    LayerRule,
    Taps,
    f32,
    grad_or_zeros,
    materialised,
    original_call,
    register_rule,
    stopped,
    watched,
)
from dpfl_tf.keras.layer_rules.dense import plain


def _axes(layer, rank: int) -> list[int]:
    axis = layer.axis if isinstance(layer.axis, (list, tuple)) else [layer.axis]
    return sorted(a % rank for a in axis)


class AffineNormalizationRule(LayerRule):
    """y = normalise(x) * scale + offset, parameters over the layer's `axis`."""

    # the layer's own call gives normalise(x); where scale and offset enter is the rule's
    reimplements = ("call", "_apply_normalization")

    def __init__(self, scale: str | None, offset: str | None):
        self.scale, self.offset = scale, offset

    def _params(self, layer):
        return [
            (name, v)
            for name, v in (
                ("scale", getattr(layer, self.scale or "", None)),
                ("offset", getattr(layer, self.offset or "", None)),
            )
            if isinstance(v, keras.Variable)
        ]

    def applies(self, layer) -> bool:
        axis = layer.axis if isinstance(layer.axis, (list, tuple)) else [layer.axis]
        return plain(layer) and 0 not in axis  # axis 0 would mix the batch

    def forward(self, layer, inputs, *args, **kwargs):
        params = self._params(layer)
        neutral = [
            (v, tf.ones(v.shape, v.dtype) if name == "scale" else tf.zeros(v.shape, v.dtype))
            for name, v in params
        ]
        with keras.StatelessScope(state_mapping=neutral):
            xhat = original_call(layer)(inputs, *args, **kwargs)
        rank = xhat.shape.rank
        axes = _axes(layer, rank)
        shape = [1] * rank
        for a in axes:
            shape[a] = xhat.shape[a]
        z = xhat
        for name, v in params:
            p = tf.reshape(stopped(v, xhat.dtype), shape)
            z = z * p if name == "scale" else z + p
        return watched(z), Taps({"z": z}, xhat)

    def gradients(self, layer, calls):
        result = []
        for name, v in self._params(layer):
            per_call = []
            for c in calls:
                g = f32(grad_or_zeros(c, "z"))
                axes = _axes(layer, g.shape.rank)
                summed = [a for a in range(1, g.shape.rank) if a not in axes]
                t = g * f32(c.saved) if name == "scale" else g
                per_call.append(tf.reshape(tf.reduce_sum(t, axis=summed), [-1, *v.shape]))
            result.append((v, materialised(tf.add_n(per_call), v)))
        return result


register_rule(keras.layers.LayerNormalization, AffineNormalizationRule("gamma", "beta"))
register_rule(keras.layers.GroupNormalization, AffineNormalizationRule("gamma", "beta"))
if hasattr(keras.layers, "RMSNormalization"):
    register_rule(keras.layers.RMSNormalization, AffineNormalizationRule("scale", None))
