"""Convolutions: Conv1D/2D/3D (strides, dilation, groups, causal padding),
DepthwiseConv1D/2D, SeparableConv1D/2D, Conv1D/2D/3DTranspose.

A convolution is a Dense layer applied to the input's patches: z_is =
p_is W with p_is the flattened receptive field of output position s, so the
kernel's example gradient is sum_s p_is^T g_is (Opacus ``grad_sample/conv.py``
unfolds the same way) and the ghost/materialised norm of `outer_gradients`
applies.  Groups (and the depthwise case, groups = channels) make the kernel
block diagonal: one such product per group.  A transposed convolution
y = conv^T(x; W) is the adjoint of conv(.; W), so <g, conv^T(x; W)> =
<conv(g; W), x> and its kernel gradient is sum_s q_is^T x_is with q the patches
of the output gradient g.  A separable convolution is a depthwise convolution
followed by a 1x1 one: two taps.  channels_first layers use the fallback.
"""

from __future__ import annotations

import math

import keras
import numpy as np
import tensorflow as tf

from dpfl_tf.keras.layer_rules._base import (
    LayerRule,
    Taps,
    concat_positions,
    f32,
    grad_or_zeros,
    materialised,
    outer_gradients,
    register_rule,
    static_positions,
    stopped,
    watched,
)
from dpfl_tf.keras.layer_rules.dense import plain


def patches(x: tf.Tensor, kernel_size, strides, padding: str, dilation) -> tf.Tensor:
    """[B, *out_spatial, prod(kernel_size) * C]: each output position's receptive
    field, flattened in the order (kernel offsets..., channel) of a Keras kernel.

    Built as one gather from the padded input with its positions flattened: the
    index of output position s and kernel offset j is computed once, in numpy
    (5-6x faster on CPU than a strided slice per offset, 2-7x faster than
    `tf.image.extract_patches`, and any rank, stride and dilation)."""
    x = f32(x)
    spatial = x.shape[1:-1]
    if any(d is None for d in spatial):
        raise ValueError(f"convolution rule: spatial input shape {tuple(spatial)} must be static")
    pads, out = [], []
    for size, k, s, d in zip(spatial, kernel_size, strides, dilation):
        span = (k - 1) * d + 1
        if padding.upper() == "SAME":
            n_out = -(-size // s)
            total = max((n_out - 1) * s + span - size, 0)
            pads.append((total // 2, total - total // 2))
        else:  # VALID
            n_out = (size - span) // s + 1
            pads.append((0, 0))
        out.append(n_out)
    xp = tf.pad(x, [[0, 0], *[list(p) for p in pads], [0, 0]]) if any(sum(p) for p in pads) else x
    padded = [size + sum(p) for size, p in zip(spatial, pads)]
    # flat index (in the padded input) of output position o and kernel offset j:
    # sum over axes of (o_a stride_a + j_a dilation_a) * row-major stride of axis a
    index = np.zeros((1, 1), np.int64)
    for n_out, k, s, d, size in zip(out, kernel_size, strides, dilation, padded):
        index = (
            index[:, None, :, None] * size
            + (np.arange(n_out)[:, None] * s + np.arange(k)[None, :] * d)[None, :, None, :]
        )
        index = index.reshape(index.shape[0] * n_out, -1)
    flat = tf.reshape(xp, [-1, math.prod(padded), x.shape[-1]])
    p = tf.gather(flat, tf.constant(index.astype(np.int32)), axis=1)  # [B, S, k, C]
    return tf.reshape(p, [-1, *out, math.prod(kernel_size) * x.shape[-1]])


def _bias_gradients(layer, gs):
    g = concat_positions([f32(t) for t in gs])
    return (layer.bias, materialised(tf.reduce_sum(g, axis=1), layer.bias))


def _bias_watch_activate(layer, z):
    """(z + b watched, activation(z + b))."""
    if layer.use_bias:
        z = z + stopped(layer.bias, z.dtype)
    z = watched(z)
    return z, (layer.activation(z) if layer.activation is not None else z)


def _grouped(p: tf.Tensor, g: tf.Tensor, k: int, groups: int):
    """Patches [B, S, k*C] and gradient [B, S, O] -> [B, S, G, k*C/G], [B, S, G, O/G]."""
    b = tf.shape(p)[0]
    c = p.shape[-1] // k
    p = tf.reshape(p, [b, -1, k, groups, c // groups])
    p = tf.reshape(tf.transpose(p, [0, 1, 3, 2, 4]), [b, -1, groups, k * (c // groups)])
    return p, tf.reshape(g, [b, -1, groups, g.shape[-1] // groups])


class ConvRule(LayerRule):
    """Conv1D/2D/3D (BaseConv): any strides, dilation, groups, padding."""

    reimplements = ("call", "kernel", "convolution_op")

    def applies(self, layer) -> bool:
        return plain(layer) and layer.data_format == "channels_last"

    def forward(self, layer, inputs, **kwargs):
        a = tf.convert_to_tensor(inputs)
        padding = layer.padding
        if padding == "causal":
            left = layer.dilation_rate[0] * (layer.kernel_size[0] - 1)
            a = tf.pad(a, [[0, 0], [left, 0], [0, 0]])
            padding = "valid"
        z = keras.ops.conv(
            a,
            stopped(layer.kernel, a.dtype),
            strides=list(layer.strides),
            padding=padding,
            dilation_rate=layer.dilation_rate,
            data_format="channels_last",
        )
        z, out = _bias_watch_activate(layer, z)
        return out, Taps({"z": z}, (a, padding))

    def gradients(self, layer, calls):
        ps = [
            patches(a, layer.kernel_size, layer.strides, padding, layer.dilation_rate)
            for a, padding in (c.saved for c in calls)
        ]
        gs = [grad_or_zeros(c, "z") for c in calls]
        k = math.prod(layer.kernel_size)
        groups = getattr(layer, "groups", 1)
        a4, g4 = _grouped(concat_positions(ps), concat_positions([f32(g) for g in gs]), k, groups)
        kernel = layer.kernel
        cg, og = kernel.shape[-2], kernel.shape[-1] // groups

        def to_kernel(s):  # [G, k*cg, og] -> (k..., cg, G*og)
            s = tf.reshape(s, [groups, k, cg, og])
            return tf.transpose(s, [1, 2, 0, 3])

        result = [(kernel, outer_gradients(a4, g4, static_positions(*ps), to_kernel, kernel))]
        if layer.use_bias:
            result.append(_bias_gradients(layer, gs))
        return result


def _depthwise_kernel_gradients(kernel, ps, gs, kernel_size):
    """Depthwise kernel (k..., C, M): groups = C, one input channel each."""
    k = math.prod(kernel_size)
    channels, multiplier = kernel.shape[-2], kernel.shape[-1]
    a4, g4 = _grouped(concat_positions(ps), concat_positions([f32(g) for g in gs]), k, channels)

    def to_kernel(s):  # [C, k, M] -> (k..., C, M)
        return tf.transpose(tf.reshape(s, [channels, k, multiplier]), [1, 0, 2])

    return kernel, outer_gradients(a4, g4, static_positions(*ps), to_kernel, kernel)


class DepthwiseConvRule(LayerRule):
    def applies(self, layer) -> bool:
        return plain(layer) and layer.data_format == "channels_last"

    def forward(self, layer, inputs, **kwargs):
        a = tf.convert_to_tensor(inputs)
        z = keras.ops.depthwise_conv(
            a,
            stopped(layer.kernel, a.dtype),
            strides=layer.strides,
            padding=layer.padding,
            dilation_rate=layer.dilation_rate,
            data_format="channels_last",
        )
        z, out = _bias_watch_activate(layer, z)
        return out, Taps({"z": z}, a)

    def gradients(self, layer, calls):
        ps = [
            patches(c.saved, layer.kernel_size, layer.strides, layer.padding, layer.dilation_rate)
            for c in calls
        ]
        gs = [grad_or_zeros(c, "z") for c in calls]
        result = [_depthwise_kernel_gradients(layer.kernel, ps, gs, layer.kernel_size)]
        if layer.use_bias:
            result.append(_bias_gradients(layer, gs))
        return result


class SeparableConvRule(LayerRule):
    def applies(self, layer) -> bool:
        return plain(layer) and layer.data_format == "channels_last"

    def forward(self, layer, inputs, **kwargs):
        a = tf.convert_to_tensor(inputs)
        h = keras.ops.depthwise_conv(
            a,
            stopped(layer.depthwise_kernel, a.dtype),
            strides=layer.strides,
            padding=layer.padding,
            dilation_rate=layer.dilation_rate,
            data_format="channels_last",
        )
        h = watched(h)
        z = keras.ops.conv(
            h,
            stopped(layer.pointwise_kernel, a.dtype),
            strides=1,
            padding="valid",
            data_format="channels_last",
        )
        z, out = _bias_watch_activate(layer, z)
        return out, Taps({"h": h, "z": z}, a)

    def gradients(self, layer, calls):
        ps = [
            patches(c.saved, layer.kernel_size, layer.strides, layer.padding, layer.dilation_rate)
            for c in calls
        ]
        gh = [grad_or_zeros(c, "h") for c in calls]
        gz = [grad_or_zeros(c, "z") for c in calls]
        result = [_depthwise_kernel_gradients(layer.depthwise_kernel, ps, gh, layer.kernel_size)]
        hs = [f32(c.outputs["h"]) for c in calls]
        pointwise = layer.pointwise_kernel
        result.append(
            (
                pointwise,
                outer_gradients(
                    concat_positions(hs)[:, :, None],
                    concat_positions([f32(g) for g in gz])[:, :, None],
                    static_positions(*hs),
                    lambda s: s,
                    pointwise,
                ),
            )
        )
        if layer.use_bias:
            result.append(_bias_gradients(layer, gz))
        return result


class ConvTransposeRule(LayerRule):
    """Conv1D/2D/3DTranspose without output_padding: the kernel gradient is
    sum_s q_is^T x_is, q = patches of the output gradient."""

    def applies(self, layer) -> bool:
        return (
            plain(layer) and layer.data_format == "channels_last" and layer.output_padding is None
        )

    def forward(self, layer, inputs, **kwargs):
        x = tf.convert_to_tensor(inputs)
        z = keras.ops.conv_transpose(
            x,
            stopped(layer.kernel, x.dtype),
            strides=list(layer.strides),
            padding=layer.padding,
            dilation_rate=layer.dilation_rate,
            data_format="channels_last",
        )
        z, out = _bias_watch_activate(layer, z)
        return out, Taps({"z": z}, x)

    def gradients(self, layer, calls):
        gs = [grad_or_zeros(c, "z") for c in calls]
        qs = [
            patches(g, layer.kernel_size, layer.strides, layer.padding, layer.dilation_rate)
            for g in gs
        ]
        xs = [f32(c.saved) for c in calls]
        kernel = layer.kernel
        result = [
            (
                kernel,
                outer_gradients(
                    concat_positions(qs)[:, :, None],
                    concat_positions(xs)[:, :, None],
                    static_positions(*xs),
                    lambda s: s,
                    kernel,
                ),
            )
        ]
        if layer.use_bias:
            result.append(_bias_gradients(layer, gs))
        return result


for _cls in (keras.layers.Conv1D, keras.layers.Conv2D, keras.layers.Conv3D):
    register_rule(_cls, ConvRule())
for _cls in (keras.layers.DepthwiseConv1D, keras.layers.DepthwiseConv2D):
    register_rule(_cls, DepthwiseConvRule())
for _cls in (keras.layers.SeparableConv1D, keras.layers.SeparableConv2D):
    register_rule(_cls, SeparableConvRule())
for _cls in (
    keras.layers.Conv1DTranspose,
    keras.layers.Conv2DTranspose,
    keras.layers.Conv3DTranspose,
):
    register_rule(_cls, ConvTransposeRule())
