"""SimpleRNN, LSTM, GRU: a rule from per-step taps.

A recurrent layer computes at every step t

    z_t = x_t W + b  +  h_{t-1} U (+ b_rec)            (GRU: its gates as below)

so example i's gradients are sums over the steps of outer products,

    grad_i W = sum_t x_it^T gx_it,     grad_i U = sum_t h_i,t-1^T gh_it,

with gx_t = d loss / d (x_t W + b) and gh_t = d loss / d (h_{t-1} U + b_rec):
a Dense rule over the T positions of the sequence (ghost or materialised norm,
`outer_gradients`).  The rule's forward computes the input projection
x W + b for all steps at once (watched: its gradient is gx) and runs the
recurrence with U read through stop_gradient.  For SimpleRNN and LSTM, x_t W
and h_{t-1} U enter the same sum, so gh = gx; for GRU the reset gate sits
between them, and a zero *probe* sequence added to h_{t-1} U (watched) gives
gh as its gradient.  The loop also returns each
step's h_{t-1} (concatenated to its output), the tap of U.  Backpropagation
through time is TensorFlow's own; no per-example Jacobian is taken.  Masks, `go_backwards`,
`return_sequences`, `return_state`, `unroll` and initial states behave as in
Keras (the loop is Keras's `backend.rnn`); dropout, recurrent dropout, a
stateful layer, GRU's `reset_after=False` and an unrolled backwards layer that
zeroes masked outputs (as Bidirectional's backward layer does) use the
per-layer fallback.
Cf. Opacus ``grad_sample/dp_rnn.py`` (per-step taps of its own RNN cells).
"""

from __future__ import annotations

import keras
import tensorflow as tf
from keras.src import backend as keras_backend

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


def _lstm_step(cell, zx, inner, states):
    h, c = states
    z = zx + inner
    z_i, z_f, z_c, z_o = tf.split(z, 4, axis=-1)
    i, f, o = (cell.recurrent_activation(v) for v in (z_i, z_f, z_o))
    c = f * c + i * cell.activation(z_c)
    h = o * cell.activation(c)
    return h, [h, c]


def _gru_step(cell, zx, inner, states):
    (h_prev,) = states
    x_z, x_r, x_h = tf.split(zx, 3, axis=-1)
    r_z, r_r, r_h = tf.split(inner, 3, axis=-1)
    z = cell.recurrent_activation(x_z + r_z)
    r = cell.recurrent_activation(x_r + r_r)
    hh = cell.activation(x_h + r * r_h)
    h = z * h_prev + (1 - z) * hh
    return h, [h]


def _simple_step(cell, zx, inner, states):
    h = zx + inner
    if cell.activation is not None:
        h = cell.activation(h)
    return h, [h]


_STEPS = {
    keras.layers.LSTMCell: _lstm_step,
    keras.layers.GRUCell: _gru_step,
    keras.layers.SimpleRNNCell: _simple_step,
}


def _biases(cell, dtype):
    """(input bias, recurrent bias), read through stop_gradient: GRU with
    reset_after keeps both in one (2, 3H) variable; the others have an input
    bias only."""
    if not cell.use_bias:
        return None, None
    bias = stopped(cell.bias, dtype)
    if isinstance(cell, keras.layers.GRUCell):
        return bias[0], bias[1]
    return bias, None


class RecurrentRule(LayerRule):
    """SimpleRNN, LSTM and GRU (reset_after=True) layers, from per-step taps."""

    reimplements = ("call", "inner_loop")

    def applies(self, layer) -> bool:
        cell = getattr(layer, "cell", None)
        return (
            plain(layer)
            and type(cell) in _STEPS
            and not layer.stateful
            and not cell.dropout
            and not cell.recurrent_dropout
            and getattr(cell, "reset_after", True)
            # Keras's unrolled loop zeroes the outputs of a backwards pass with the
            # mask in input order, so the h_{t-1} tap would be zeroed at valid steps
            and not (layer.unroll and layer.go_backwards and layer.zero_output_for_mask)
        )

    def forward(self, layer, sequences, initial_state=None, mask=None, training=False):
        cell = layer.cell
        dtype = cell.compute_dtype
        x = tf.cast(tf.convert_to_tensor(sequences), dtype)
        if isinstance(mask, (list, tuple)):
            mask = mask[0]
        if initial_state is None:
            initial_state = layer.get_initial_state(batch_size=tf.shape(x)[0])
        if not isinstance(initial_state, (list, tuple)):
            initial_state = [initial_state]
        initial_state = [tf.cast(tf.convert_to_tensor(s), dtype) for s in initial_state]

        kernel = stopped(cell.kernel, dtype)
        recurrent_kernel = stopped(cell.recurrent_kernel, dtype)
        input_bias, recurrent_bias = _biases(cell, dtype)
        zx = tf.tensordot(x, kernel, axes=[[2], [0]])
        if input_bias is not None:
            zx = zx + input_bias
        zx = watched(zx)
        # gh = gx except for GRU, whose reset gate sits between them: only GRU
        # needs the probe (a [B, T, 3H] zero sequence and its gradient)
        gru = isinstance(cell, keras.layers.GRUCell)
        probe = watched(tf.zeros_like(zx)) if gru else None
        step_fn = _STEPS[type(cell)]

        def step(inputs, states):
            zx_t, probe_t = inputs if gru else (inputs, None)
            h_prev = states[0]
            inner = tf.matmul(h_prev, recurrent_kernel)
            if gru:
                inner = inner + probe_t
            if recurrent_bias is not None:
                inner = inner + recurrent_bias
            h, new_states = step_fn(cell, zx_t, inner, states)
            # one output tensor (the unrolled loop stacks a single tensor only)
            return tf.concat([h, h_prev], axis=-1), new_states

        last, outputs, states = keras_backend.rnn(
            step,
            (zx, probe) if gru else zx,
            initial_state,
            go_backwards=layer.go_backwards,
            mask=mask,
            unroll=layer.unroll,
            input_length=x.shape[1],
            zero_output_for_mask=layer.zero_output_for_mask,
            return_all_outputs=True,
        )
        units = cell.units
        outputs, h_prev, last = outputs[..., :units], outputs[..., units:], last[..., :units]
        if layer.go_backwards:  # the loop's outputs are in processing order
            h_prev = tf.reverse(h_prev, [1])
        out_dtype = layer.compute_dtype
        output = tf.cast(outputs if layer.return_sequences else last, out_dtype)
        if layer.return_state:
            output = [output] + [tf.cast(s, out_dtype) for s in states]
        return output, Taps({"zx": zx, "probe": probe} if gru else {"zx": zx}, (x, h_prev))

    def gradients(self, layer, calls):
        cell = layer.cell
        xs = [c.saved[0] for c in calls]
        hs = [c.saved[1] for c in calls]
        gx = concat_positions([grad_or_zeros(c, "zx") for c in calls])
        gh = (
            concat_positions([grad_or_zeros(c, "probe") for c in calls])
            if isinstance(cell, keras.layers.GRUCell)
            else gx
        )
        positions = static_positions(*xs)
        result = [
            (
                cell.kernel,
                outer_gradients(
                    concat_positions(xs)[:, :, None],
                    gx[:, :, None],
                    positions,
                    lambda s: s,
                    cell.kernel,
                ),
            ),
            (
                cell.recurrent_kernel,
                outer_gradients(
                    concat_positions(hs)[:, :, None],
                    gh[:, :, None],
                    positions,
                    lambda s: s,
                    cell.recurrent_kernel,
                ),
            ),
        ]
        if cell.use_bias:
            per_example = tf.reduce_sum(f32(gx), axis=1)
            if isinstance(cell, keras.layers.GRUCell):  # (input, recurrent) biases
                per_example = tf.stack([per_example, tf.reduce_sum(f32(gh), axis=1)], axis=1)
            result.append((cell.bias, materialised(per_example, cell.bias)))
        return result


RECURRENT = RecurrentRule()
for _cls in (keras.layers.SimpleRNN, keras.layers.LSTM, keras.layers.GRU):
    register_rule(_cls, RECURRENT)
