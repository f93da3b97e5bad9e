"""The generic per-layer rule: exact per-example gradients of one layer's
variables for any differentiable layer without a rule of its own.

The forward runs the layer's own `call` with its trainable variables read
through stop_gradient (a `keras.StatelessScope`), keeping its inputs and its
non-trainable state before the call (seed-generator states, so dropout masks
are reproduced).  Given g = d loss / d output, example i's gradient is

    grad_i w = d/dw < f(x_i; w), g_i >,

the layer re-run once on its own tapped inputs, and the Jacobian of the B inner
products s_i = <f(x; w)_i, g_i> with respect to w (pfor-vectorised over the
batch).  Unlike the whole-model Jacobian it differentiates through this layer
only; per-example gradients [B, *w.shape] are materialised.  A generic
`keras.layers.RNN` (any cell), the recurrent layers' configurations their rule
refuses (`recurrent.py`) and wrappers such as TimeDistributed use it as a
whole: their cell or layer is called inside a loop, where no tap can be taken.
(Bidirectional calls its two layers directly, so it is descended into.)
"""

from __future__ import annotations

import contextlib

import keras
import tensorflow as tf

from dpfl_tf.keras.layer_rules._base import (
    LayerRule,
    Taps,
    f32,
    materialised,
    original_call,
    register_rule,
    stopped,
)


def _autocast(layer):
    """The autocast scope `Layer.__call__` would open (variables read in the
    compute dtype under mixed precision); the re-run bypasses `__call__`."""
    if layer.autocast and layer.compute_dtype != layer.variable_dtype:
        from keras.src.backend import AutocastScope  # no public alias in Keras 3

        return AutocastScope(layer.compute_dtype)
    return contextlib.nullcontext()


def _is_float(t) -> bool:
    return isinstance(t, tf.Tensor) and t.dtype.is_floating


class PerLayerJacobianRule(LayerRule):
    """Args:
    vectorize: pfor-vectorise the Jacobian over the batch (default).  XLA
      cannot compile the pfor form of a layer's internal loop (an RNN's
      TensorList ops): under ``jit_compile=True`` register recurrent layers with
      ``PerLayerJacobianRule(vectorize=False)`` (one backward pass of the layer
      per example, in a loop).
    """

    reimplements = ()  # runs the layer's own `call`: exact for any subclass

    def __init__(self, vectorize: bool = True):
        self.vectorize = bool(vectorize)

    def forward(self, layer, *args, **kwargs):
        trainable = layer.trainable_variables
        ids = {id(v) for v in trainable}
        state = [v for v in layer.variables if id(v) not in ids]
        before = [(v, tf.convert_to_tensor(v.value)) for v in state]
        with keras.StatelessScope(state_mapping=[(v, stopped(v)) for v in trainable]) as scope:
            outputs = original_call(layer)(*args, **kwargs)
        for v in state:  # state updates (a seed generator advancing) happen as usual
            new = scope.get_current_value(v)
            if new is not None:
                v.assign(new)
        flat = tf.nest.flatten(outputs)
        watched = {str(i): t for i, t in enumerate(flat) if _is_float(t)}
        return outputs, Taps(watched, (args, kwargs, before))

    def gradients(self, layer, calls):
        trainable = layer.trainable_variables
        total = None
        for call in calls:
            args, kwargs, before = call.saved
            ws = [tf.convert_to_tensor(v.value) for v in trainable]
            with tf.GradientTape() as tape:
                tape.watch(ws)
                with (
                    keras.StatelessScope(state_mapping=list(zip(trainable, ws)) + before),
                    _autocast(layer),
                ):
                    outputs = original_call(layer)(*args, **kwargs)
                flat = tf.nest.flatten(outputs)
                inner = []
                for name, g in call.grads.items():
                    if g is None:
                        continue
                    prod = f32(flat[int(name)]) * f32(g)
                    inner.append(tf.reduce_sum(tf.reshape(prod, [tf.shape(prod)[0], -1]), 1))
                if not inner:
                    continue
                s = tf.add_n(inner)
            jac = tape.jacobian(s, ws, experimental_use_pfor=self.vectorize)
            jac = [
                tf.zeros(tf.concat([tf.shape(s)[:1], w.shape], 0), tf.float32)
                if j is None
                else f32(j)
                for j, w in zip(jac, ws)
            ]
            total = jac if total is None else [t + j for t, j in zip(total, jac)]
        if total is None:  # no call reaches the loss
            b = tf.shape(next(iter(calls[0].outputs.values())))[0]
            total = [tf.zeros(tf.concat([[b], v.shape], 0), tf.float32) for v in trainable]
        return [(v, materialised(j, v)) for v, j in zip(trainable, total)]


FALLBACK = PerLayerJacobianRule()

# run as a whole: an RNN calls its cell in a loop; a Wrapper (TimeDistributed,
# ...) may call its layer in a loop or with altered weights
for _cls in (keras.layers.RNN, keras.layers.Wrapper):
    register_rule(_cls, FALLBACK)
