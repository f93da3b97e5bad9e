"""Dense: z = a W + b on inputs [B, ..., d].

Example i's kernel gradient is sum_s a_is^T g_is over the positions s of all
calls (Goodfellow 2015 for one position: ||a_i||^2 ||g_i||^2); the bias
gradient is sum_s g_is.  Cf. Opacus ``grad_sample/linear.py``,
tensorflow-privacy ``registry_functions/dense.py``.
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
    grad_or_zeros,
    materialised,
    outer_gradients,
    rank_one_gradients,
    register_rule,
    static_positions,
    stopped,
    watched,
    weighted_sum,
)


def plain(layer) -> bool:
    """Trainable, float, not quantized, no LoRA (those use the fallback)."""
    return (
        bool(layer.trainable_variables)
        and not getattr(layer, "quantization_mode", None)
        and not getattr(layer, "lora_enabled", False)
    )


class DenseRule(LayerRule):
    reimplements = ("call", "kernel")

    def applies(self, layer) -> bool:
        return plain(layer)

    def forward(self, layer, inputs, **kwargs):
        a = tf.convert_to_tensor(inputs)
        kernel = stopped(layer.kernel, a.dtype)
        z = (
            tf.matmul(a, kernel)
            if a.shape.rank == 2
            else tf.tensordot(a, kernel, axes=[[a.shape.rank - 1], [0]])
        )
        if layer.use_bias:
            z = z + stopped(layer.bias, z.dtype)
        z = watched(z)
        out = layer.activation(z) if layer.activation is not None else z
        return out, Taps({"z": z}, a)

    def gradients(self, layer, calls):
        inputs = [c.saved for c in calls]
        gs = [grad_or_zeros(c, "z") for c in calls]
        kernel = layer.kernel
        if len(calls) == 1 and inputs[0].shape.rank == 2:
            g = f32(gs[0])
            g_sq = tf.reduce_sum(tf.square(g), 1)  # ||g_i||^2: the bias's squared norm too
            result = [(kernel, rank_one_gradients(inputs[0], g, kernel, g_sq))]
            if layer.use_bias:
                result.append(
                    (
                        layer.bias,
                        VariableGradients(
                            g_sq, lambda c, g=g: tf.cast(weighted_sum(g, c), layer.bias.dtype)
                        ),
                    )
                )
            return result
        a3, g3 = concat_positions(inputs), concat_positions(gs)
        result = [
            (
                kernel,
                outer_gradients(
                    a3[:, :, None], g3[:, :, None], static_positions(*inputs), lambda s: s, kernel
                ),
            )
        ]
        g_example = tf.reduce_sum(g3, axis=1)
        if layer.use_bias:
            result.append((layer.bias, materialised(g_example, layer.bias)))
        return result


register_rule(keras.layers.Dense, DenseRule())
