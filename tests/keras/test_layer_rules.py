"""Per-layer rules: every rule == a brute-force per-example loop (one
GradientTape per example), for norms, sums and clipped sums; the planner sends
each layer to the rule the test names."""

import sys
import types

import keras
import numpy as np
import pytest
import tensorflow as tf

from dpfl_tf.keras import layer_rules
from dpfl_tf.keras.layer_rules import FALLBACK, LayerRule, find_rule, register_rule
from dpfl_tf.keras.layer_rules._base import ghost_norm_is_smaller, outer_gradients
from dpfl_tf.keras.layer_rules.recurrent import RECURRENT as RECURRENT_RULE
from dpfl_tf.keras.per_example import PerExampleGradients, plan_layers
from tests.keras.helpers import WITH_ONEDNN, loss, mnist_slice, skip_unless_the_cpu_runs

# what XLA and TensorFlow compile here stays until the process ends (+0.9 GB in a
# whole-suite worker): the file runs in a process of its own (tests/isolation.py), with
# oneDNN on: a channels_first Conv2D and a dilated transposed convolution have a CPU
# kernel only there (`WITH_ONEDNN`)
pytestmark = pytest.mark.isolated(env=WITH_ONEDNN)

N = 5


def _images(n=N):
    return mnist_slice(n, flat=False)


def _sequence(n=N, steps=14, width=8):
    """MNIST rows as sequences: [n, steps, width] from the middle of the image."""
    x, y = mnist_slice(n, flat=True)
    return x[:, 196 : 196 + steps * width].reshape(n, steps, width), y


def _tokens(n=N, steps=12, vocab=16, offset=320):
    """Token ids 0..vocab-1 from pixel intensities (0 = background, used as padding)."""
    x, y = mnist_slice(n, flat=True)
    return np.floor(x[:, offset : offset + steps] * (vocab - 0.01)).astype("int32"), y


def _volumes(n=N):
    x, y = mnist_slice(n, flat=True)
    return x[:, 196 : 196 + 4 * 7 * 7].reshape(n, 4, 7, 7, 1), y


def _reference(model, x, y):
    grads = []
    for i in range(len(y)):
        with tf.GradientTape() as tape:
            li = tf.reduce_sum(loss().call(y[i : i + 1], model(x[i : i + 1], training=True)))
        g = tape.gradient(li, model.trainable_variables)
        grads.append(
            [
                np.zeros(v.shape) if gi is None else tf.convert_to_tensor(gi).numpy()
                for gi, v in zip(g, model.trainable_variables)
            ]
        )
    return grads


def _run(model, x, y, clip=None, jit=None):
    captured = {}

    def factors(sq):
        captured["sq"] = sq
        if clip is None:
            return [tf.ones_like(s) for s in sq]
        total = tf.sqrt(tf.add_n(sq))
        return [clip / tf.maximum(total, clip)] * len(sq)

    per_example = PerExampleGradients(model, loss())

    def compute(x, y):
        sums = per_example.compute(x, y, tf.ones(tf.shape(y)[0]), factors)[0]
        return sums, captured["sq"]

    if jit is not None:
        compute = tf.function(compute, jit_compile=jit)
    sums, sq = compute(tf.constant(x), tf.constant(y))
    return [s.numpy() for s in sums], [s.numpy() for s in sq], per_example


def check_exact(model, x, y, rules=None, clip=0.01, jit=None):
    """Norms, sums and clipped sums equal the per-example loop; `rules` maps
    layer class names to the rule class each must use."""
    model(x[:1])
    if rules is not None:
        used = {
            type(layer).__name__: type(rule).__name__ for layer, rule in plan_layers(model).values()
        }
        assert used == rules
    ref = _reference(model, x, y)
    ref_sq = [np.array([np.sum(r[j] ** 2) for r in ref]) for j in range(len(ref[0]))]
    ref_sum = [sum(r[j] for r in ref) for j in range(len(ref[0]))]
    sums, sq, per_example = _run(model, x, y, jit=jit)
    assert per_example.excluded_layers == ()
    names = [v.path for v in model.trainable_variables]
    for name, a, b in zip(names, sq, ref_sq):
        np.testing.assert_allclose(a, b, rtol=3e-4, atol=1e-9, err_msg=name)
    for name, a, b in zip(names, sums, ref_sum):
        np.testing.assert_allclose(a, b, rtol=3e-4, atol=2e-6, err_msg=name)
    expected = [np.zeros_like(g) for g in ref[0]]
    for r in ref:
        norm = np.sqrt(sum(np.sum(g**2) for g in r))
        for j, g in enumerate(r):
            expected[j] += g * min(1.0, clip / norm)
    sums, _, _ = _run(model, x, y, clip=clip, jit=jit)
    for name, a, b in zip(names, sums, expected):
        np.testing.assert_allclose(a, b, rtol=3e-4, atol=1e-8, err_msg=name)


def _head(h, pool=True):
    if pool:
        h = keras.layers.Flatten()(h)
    return keras.layers.Dense(10)(h)


# ---------------------------------------------------------------------------
# EinsumDense and what is built from it

EINSUM = {
    "3d_dense": ("abc,cd->abd", (14, 6), "d"),
    "heads": ("abc,cde->abde", (14, 2, 3), "de"),
    "heads_bias_on_one_axis": ("abc,cde->abde", (14, 2, 3), "e"),
    "ellipsis": ("...b,bc->...c", 5, "c"),
    "summed_positions": ("abc,cd->ad", (6,), "d"),
    "diagonal_kernel": ("abc,bc->abc", (14, 8), None),
}


@pytest.mark.parametrize("name", list(EINSUM))
def test_einsum_dense(name):
    equation, shape, bias = EINSUM[name]
    keras.utils.set_random_seed(11)
    x, y = _sequence()
    inp = keras.Input(x.shape[1:])
    h = keras.layers.EinsumDense(equation, shape, bias_axes=bias, activation="tanh")(inp)
    check_exact(
        keras.Model(inp, _head(h)), x, y, {"EinsumDense": "EinsumDenseRule", "Dense": "DenseRule"}
    )


def test_einsum_dense_four_dimensional_input_into_heads():
    keras.utils.set_random_seed(12)
    x, y = _sequence(steps=14, width=8)
    x = x.reshape(N, 14, 2, 4)
    inp = keras.Input(x.shape[1:])
    h = keras.layers.EinsumDense("abcd,cde->abe", (14, 5), bias_axes="e")(inp)
    check_exact(keras.Model(inp, _head(h)), x, y)


def transformer_block(mask_zero=True):
    keras.utils.set_random_seed(13)
    tokens = keras.Input((12,), dtype="int32")
    e = keras.layers.Embedding(16, 8, mask_zero=mask_zero)(tokens)
    a = keras.layers.MultiHeadAttention(num_heads=2, key_dim=4)(e, e)
    h = keras.layers.LayerNormalization()(e + a)
    f = keras.layers.Dense(16, activation="relu")(h)
    f = keras.layers.Dense(8)(f)
    h = keras.layers.LayerNormalization()(h + f)
    h = keras.layers.GlobalAveragePooling1D()(h)
    return keras.Model(tokens, keras.layers.Dense(10)(h))


def test_multi_head_attention_is_reached_through_its_einsum_dense_sublayers():
    model = transformer_block()
    rules = {
        (type(layer).__name__, type(rule).__name__) for layer, rule in plan_layers(model).values()
    }
    assert rules == {
        ("Embedding", "EmbeddingRule"),
        ("EinsumDense", "EinsumDenseRule"),
        ("LayerNormalization", "AffineNormalizationRule"),
        ("Dense", "DenseRule"),
    }
    assert len(plan_layers(model)) == 1 + 4 + 2 + 3  # embedding, q/k/v/out, 2 LN, 3 Dense


@pytest.mark.parametrize("jit", [None, False, True], ids=["eager", "tf_function", "xla"])
def test_transformer_block_with_masked_embedding(jit):
    x, y = _tokens()
    assert (x == 0).any() and (x != 0).any()  # padding and tokens both present
    check_exact(transformer_block(), x, y, jit=jit)


# ---------------------------------------------------------------------------
# Normalization

NORMS = {
    "layer_norm_3d": lambda: keras.layers.LayerNormalization(),
    "layer_norm_two_axes": lambda: keras.layers.LayerNormalization(axis=[1, 2]),
    "layer_norm_rms_scaling": lambda: keras.layers.LayerNormalization(rms_scaling=True),
    "layer_norm_no_center": lambda: keras.layers.LayerNormalization(center=False),
    "rms_normalization": lambda: keras.layers.RMSNormalization(),
}


@pytest.mark.parametrize("name", list(NORMS))
def test_normalization_on_sequences(name):
    keras.utils.set_random_seed(14)
    x, y = _sequence()
    inp = keras.Input(x.shape[1:])
    h = keras.layers.Dense(6, activation="tanh")(inp)
    h = NORMS[name]()(h)
    check_exact(keras.Model(inp, _head(h)), x, y)


@pytest.mark.parametrize("groups", [1, 2, 4])
def test_group_normalization_on_images(groups):
    keras.utils.set_random_seed(15)
    x, y = _images()
    inp = keras.Input(x.shape[1:])
    h = keras.layers.Conv2D(4, 3, strides=2, activation="relu")(inp)
    h = keras.layers.GroupNormalization(groups=groups)(h)
    h = keras.layers.MaxPooling2D(2)(h)
    check_exact(
        keras.Model(inp, _head(h)),
        x,
        y,
        {
            "Conv2D": "ConvRule",
            "GroupNormalization": "AffineNormalizationRule",
            "Dense": "DenseRule",
        },
    )


# ---------------------------------------------------------------------------
# Convolutions

CONV1D = {
    "valid": dict(kernel_size=3),
    "same_stride2": dict(kernel_size=3, strides=2, padding="same"),
    "causal_dilated": dict(kernel_size=3, padding="causal", dilation_rate=2),
    "valid_dilated": dict(kernel_size=2, dilation_rate=3),
    "groups": dict(kernel_size=3, groups=2, padding="same"),
}


@pytest.mark.parametrize("name", list(CONV1D))
def test_conv1d(name):
    keras.utils.set_random_seed(16)
    x, y = _sequence()
    inp = keras.Input(x.shape[1:])
    h = keras.layers.Conv1D(4, activation="tanh", **CONV1D[name])(inp)
    check_exact(keras.Model(inp, _head(h)), x, y, {"Conv1D": "ConvRule", "Dense": "DenseRule"})


CONV2D = {
    "dilated": dict(kernel_size=3, dilation_rate=2),
    "dilated_same": dict(kernel_size=(3, 2), dilation_rate=(2, 3), padding="same"),
    "groups": dict(kernel_size=3, groups=2, strides=2),
    "groups_same": dict(kernel_size=3, groups=4, padding="same", strides=(2, 3)),
}


@pytest.mark.parametrize("name", list(CONV2D))
def test_conv2d_dilation_and_groups(name):
    keras.utils.set_random_seed(17)
    x, y = _images()
    inp = keras.Input(x.shape[1:])
    h = keras.layers.Conv2D(4, 3, strides=2, activation="relu")(inp)  # 4 channels for groups
    h = keras.layers.Conv2D(4, activation="tanh", **CONV2D[name])(h)
    check_exact(keras.Model(inp, _head(h)), x, y, {"Conv2D": "ConvRule", "Dense": "DenseRule"})


@pytest.mark.parametrize(
    "kwargs",
    [dict(), dict(strides=2, padding="same"), dict(dilation_rate=2)],
    ids=["valid", "same_s2", "dilated"],
)
def test_conv3d(kwargs):
    keras.utils.set_random_seed(18)
    x, y = _volumes()
    inp = keras.Input(x.shape[1:])
    h = keras.layers.Conv3D(3, 2, activation="relu", **kwargs)(inp)
    check_exact(keras.Model(inp, _head(h)), x, y, {"Conv3D": "ConvRule", "Dense": "DenseRule"})


def test_depthwise_conv2d_and_1d():
    keras.utils.set_random_seed(19)
    x, y = _images()
    inp = keras.Input(x.shape[1:])
    h = keras.layers.Conv2D(3, 3, strides=2, activation="relu")(inp)
    h = keras.layers.DepthwiseConv2D(
        3, depth_multiplier=2, strides=2, padding="same", activation="tanh"
    )(h)
    h = keras.layers.DepthwiseConv2D(2, dilation_rate=2)(h)
    check_exact(
        keras.Model(inp, _head(h)),
        x,
        y,
        {"Conv2D": "ConvRule", "DepthwiseConv2D": "DepthwiseConvRule", "Dense": "DenseRule"},
    )
    x, y = _sequence()
    inp = keras.Input(x.shape[1:])
    h = keras.layers.DepthwiseConv1D(3, depth_multiplier=2, activation="tanh")(inp)
    h = keras.layers.DepthwiseConv1D(2, strides=2, padding="same")(h)
    check_exact(
        keras.Model(inp, _head(h)),
        x,
        y,
        {"DepthwiseConv1D": "DepthwiseConvRule", "Dense": "DenseRule"},
    )


def test_separable_conv2d_and_1d():
    keras.utils.set_random_seed(20)
    x, y = _images()
    inp = keras.Input(x.shape[1:])
    h = keras.layers.Conv2D(3, 3, strides=2, activation="relu")(inp)
    h = keras.layers.SeparableConv2D(
        4, 3, depth_multiplier=2, strides=2, padding="same", activation="tanh"
    )(h)
    check_exact(
        keras.Model(inp, _head(h)),
        x,
        y,
        {"Conv2D": "ConvRule", "SeparableConv2D": "SeparableConvRule", "Dense": "DenseRule"},
    )
    x, y = _sequence()
    inp = keras.Input(x.shape[1:])
    h = keras.layers.SeparableConv1D(5, 3, dilation_rate=2, activation="tanh")(inp)
    check_exact(
        keras.Model(inp, _head(h)),
        x,
        y,
        {"SeparableConv1D": "SeparableConvRule", "Dense": "DenseRule"},
    )


TRANSPOSE = {
    "1d_valid": (1, dict(kernel_size=3)),
    "1d_same_s2": (1, dict(kernel_size=3, strides=2, padding="same")),
    "1d_valid_s2": (1, dict(kernel_size=3, strides=2)),
    "2d_same_s2": (2, dict(kernel_size=3, strides=2, padding="same")),
    "2d_valid_s2": (2, dict(kernel_size=(3, 2), strides=(2, 1))),
    "2d_dilated": (2, dict(kernel_size=2, dilation_rate=2)),
    "3d_same_s2": (3, dict(kernel_size=2, strides=2, padding="same")),
}


@pytest.mark.parametrize("name", list(TRANSPOSE))
def test_conv_transpose(name):
    rank, kwargs = TRANSPOSE[name]
    keras.utils.set_random_seed(21)
    x, y = {1: _sequence, 2: _images, 3: _volumes}[rank]()
    if rank == 2:
        x = x[:, ::4, ::4]  # 7 x 7 keeps the upsampled map small
    inp = keras.Input(x.shape[1:])
    cls = {
        1: keras.layers.Conv1DTranspose,
        2: keras.layers.Conv2DTranspose,
        3: keras.layers.Conv3DTranspose,
    }[rank]
    h = cls(3, activation="tanh", **kwargs)(inp)
    model = keras.Model(inp, _head(h))
    skip_unless_the_cpu_runs(lambda: model(x[:1]), f"a {cls.__name__} with {kwargs}")
    check_exact(model, x, y, {cls.__name__: "ConvTransposeRule", "Dense": "DenseRule"})


# ---------------------------------------------------------------------------
# Embedding, shared use and the ghost/materialised choice


def test_embedding_with_mask_zero_and_masked_pooling():
    keras.utils.set_random_seed(22)
    x, y = _tokens()
    tokens = keras.Input((12,), dtype="int32")
    e = keras.layers.Embedding(16, 6, mask_zero=True)(tokens)
    h = keras.layers.GlobalAveragePooling1D()(keras.layers.Dense(5, activation="tanh")(e))
    check_exact(
        keras.Model(tokens, keras.layers.Dense(10)(h)),
        x,
        y,
        {"Embedding": "EmbeddingRule", "Dense": "DenseRule"},
    )


def test_einsum_dense_and_layer_norm_called_twice_sum_over_calls():
    keras.utils.set_random_seed(23)
    x, y = _sequence()
    inp = keras.Input(x.shape[1:])
    proj = keras.layers.EinsumDense("abc,cd->abd", (14, 8), bias_axes="d", activation="tanh")
    norm = keras.layers.LayerNormalization()
    h = norm(proj(norm(proj(inp))))
    check_exact(keras.Model(inp, _head(h)), x, y)


@pytest.mark.parametrize("positions", [None, 2], ids=["materialised", "ghost"])
def test_ghost_and_materialised_norms_agree(positions):
    rng = np.random.default_rng(0)
    a = tf.constant(rng.normal(size=(4, 2, 3, 5)), tf.float32)
    g = tf.constant(rng.normal(size=(4, 2, 3, 7)), tf.float32)
    var = keras.Variable(np.zeros((3, 5, 7)), dtype="float32")
    result = outer_gradients(a, g, positions, lambda s: s, var)
    per_example = np.einsum("bsgd,bsgo->bgdo", a.numpy(), g.numpy())
    np.testing.assert_allclose(
        result.sq_norms.numpy(), np.sum(per_example**2, axis=(1, 2, 3)), rtol=1e-5
    )
    c = tf.constant([0.5, 0.0, 1.0, np.nan])  # NaN factors never occur; 0 drops exactly
    c = tf.where(tf.math.is_nan(c), 0.0, c)
    a_nan = tf.tensor_scatter_nd_update(a, [[1, 0, 0, 0]], [np.nan])
    s = outer_gradients(a_nan, g, positions, lambda s: s, var).clipped_sum(c).numpy()
    expected = np.einsum("b,bgdo->gdo", c.numpy(), per_example)
    np.testing.assert_allclose(s, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "positions, d, o, ghost",
    [
        (128, 128, 4 * 128, True),  # LSTM(128) kernel over 128 steps: 2 S^2 = 32768 < d o = 65536
        (128, 128, 128, False),  # Dense 128 -> 128 over 128 positions: 32768 > 16384
        (64, 9 * 64, 64, True),  # 3x3 conv, 64 -> 64 channels on an 8x8 map
        (1024, 9 * 16, 16, False),  # 3x3 conv, 16 -> 16 channels on a 32x32 map
        (None, 5, 7, False),  # positions unknown statically: materialised
    ],
)
def test_ghost_norm_chosen_when_its_gram_matrices_are_smaller(positions, d, o, ghost):
    assert ghost_norm_is_smaller(positions, d, o) is ghost


# ---------------------------------------------------------------------------
# The per-layer fallback


class ScaleShift(keras.layers.Layer):
    """A layer with no rule: y = x * exp(s) + t over the last axis."""

    def build(self, shape):
        self.s = self.add_weight(shape=(shape[-1],), initializer="random_normal")
        self.t = self.add_weight(shape=(shape[-1],), initializer="random_normal")

    def call(self, x):
        return x * tf.exp(self.s) + self.t


RECURRENT = {
    "simple_rnn": (lambda: keras.layers.SimpleRNN(5, activation="tanh"), {}),
    "simple_rnn_no_bias_sequences": (
        lambda: keras.layers.SimpleRNN(4, use_bias=False, return_sequences=True),
        {},
    ),
    "lstm": (lambda: keras.layers.LSTM(5), {}),
    "lstm_implementation_1_backwards": (
        lambda: keras.layers.LSTM(4, implementation=1, go_backwards=True, return_sequences=True),
        {},
    ),
    "lstm_unrolled_state": (lambda: keras.layers.LSTM(3, unroll=True, return_state=True), {}),
    "gru": (lambda: keras.layers.GRU(4), {}),
    "gru_sequences_backwards": (
        lambda: keras.layers.GRU(4, return_sequences=True, go_backwards=True),
        {},
    ),
    "gru_no_bias": (lambda: keras.layers.GRU(3, use_bias=False), {}),
    "bidirectional_lstm": (
        lambda: keras.layers.Bidirectional(keras.layers.LSTM(3)),
        {"LSTM": "RecurrentRule", "Dense": "DenseRule"},
    ),
    "bidirectional_gru_sequences": (
        lambda: keras.layers.Bidirectional(
            keras.layers.GRU(3, return_sequences=True), merge_mode="sum"
        ),
        {"GRU": "RecurrentRule", "Dense": "DenseRule"},
    ),
}


def _recurrent_head(out):
    if isinstance(out, (list, tuple)):  # return_state: every output reaches the loss
        out = keras.layers.Concatenate()([keras.layers.Flatten()(t) for t in out])
    return _head(out)


@pytest.mark.parametrize("name", list(RECURRENT))
def test_recurrent_layers_use_their_per_step_rule(name):
    keras.utils.set_random_seed(24)
    x, y = _sequence(steps=6)
    inp = keras.Input(x.shape[1:])
    make, rules = RECURRENT[name]
    layer = make()
    h = layer(keras.layers.Dense(4, activation="tanh")(inp))
    model = keras.Model(inp, _recurrent_head(h))
    check_exact(model, x, y, rules or {type(layer).__name__: "RecurrentRule", "Dense": "DenseRule"})
    if name.startswith("bidirectional"):
        assert plan_layers(model).keys().isdisjoint({id(layer)})


@pytest.mark.parametrize("cell", ["lstm", "gru", "simple_rnn"])
def test_recurrent_rule_with_masked_tokens_and_an_initial_state(cell):
    # padding (token 0) masked by the Embedding; the initial state is computed
    # from the example's own tokens, so its gradient flows back through it
    keras.utils.set_random_seed(27)
    x, y = _tokens(steps=10)
    x[:, -3:] = 0  # trailing padding on every example, leading zeros already frequent
    units = 4
    cls = {
        "lstm": keras.layers.LSTM,
        "gru": keras.layers.GRU,
        "simple_rnn": keras.layers.SimpleRNN,
    }[cell]
    inp = keras.Input(x.shape[1:], dtype="int32")
    e = keras.layers.Embedding(16, 5, mask_zero=True)(inp)
    h0 = keras.layers.Dense(units, activation="tanh")(keras.layers.GlobalAveragePooling1D()(e))
    states = [h0, h0] if cell == "lstm" else [h0]
    h = cls(units, return_sequences=True, zero_output_for_mask=True)(e, initial_state=states)
    model = keras.Model(inp, _head(h))
    check_exact(
        model,
        x,
        y,
        {cls.__name__: "RecurrentRule", "Embedding": "EmbeddingRule", "Dense": "DenseRule"},
    )


@pytest.mark.parametrize("unroll", [False, True])
def test_bidirectional_recurrent_layers_on_masked_tokens(unroll):
    # the backward layer runs go_backwards with zero_output_for_mask (set by
    # Bidirectional); unrolled, Keras zeroes its outputs with the mask in input
    # order, so that layer is refused and takes the exact fallback
    keras.utils.set_random_seed(30)
    x, y = _tokens(steps=10)
    x[:, -3:] = 0
    inp = keras.Input(x.shape[1:], dtype="int32")
    e = keras.layers.Embedding(16, 5, mask_zero=True)(inp)
    bi = keras.layers.Bidirectional(keras.layers.LSTM(3, return_sequences=True, unroll=unroll))
    h = keras.layers.Bidirectional(keras.layers.GRU(3, unroll=unroll))(bi(e))
    model = keras.Model(inp, _head(h, pool=False))
    model(x[:1])
    rules = sorted(
        type(r).__name__
        for layer, r in plan_layers(model).values()
        if isinstance(layer, keras.layers.RNN)
    )
    # only the LSTM's backward layer zeroes masked outputs (return_sequences=True)
    assert rules == (
        ["PerLayerJacobianRule"] + ["RecurrentRule"] * 3 if unroll else ["RecurrentRule"] * 4
    )
    check_exact(model, x, y)


def test_a_recurrent_layer_called_twice_sums_over_its_calls_and_runs_in_xla():
    keras.utils.set_random_seed(28)
    x, y = _sequence(steps=6)
    inp = keras.Input(x.shape[1:])
    lstm = keras.layers.LSTM(4, return_sequences=True)
    h = lstm(keras.layers.Dense(4, activation="tanh")(inp))
    h = lstm(h)
    model = keras.Model(inp, _head(h))
    check_exact(model, x, y, {"LSTM": "RecurrentRule", "Dense": "DenseRule"})
    check_exact(model, x, y, jit=True)


REFUSED = {
    "dropout": lambda: keras.layers.LSTM(4, dropout=0.2),
    "recurrent_dropout": lambda: keras.layers.GRU(4, recurrent_dropout=0.2),
    "reset_before": lambda: keras.layers.GRU(4, reset_after=False),
    "generic_rnn": lambda: keras.layers.RNN(keras.layers.LSTMCell(4)),
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_recurrent_configurations_the_rule_refuses_use_the_fallback(name):
    keras.utils.set_random_seed(29)
    x, y = _sequence(steps=5)
    inp = keras.Input(x.shape[1:])
    layer = REFUSED[name]()
    h = layer(keras.layers.Dense(4, activation="tanh")(inp))
    model = keras.Model(inp, _head(h))
    if "dropout" in name:  # the loop compares with a reference: no random masks
        layer.cell.dropout = layer.cell.recurrent_dropout = 0.0
        assert RECURRENT_RULE.applies(layer)
        layer.cell.dropout = 0.2 if name == "dropout" else 0.0
        layer.cell.recurrent_dropout = 0.2 if name == "recurrent_dropout" else 0.0
        assert not RECURRENT_RULE.applies(layer)
        used = {type(lr).__name__: type(r).__name__ for lr, r in plan_layers(model).values()}
        assert used[type(layer).__name__] == "PerLayerJacobianRule"
        return
    check_exact(model, x, y, {type(layer).__name__: "PerLayerJacobianRule", "Dense": "DenseRule"})


def test_the_fallback_runs_a_generic_rnn_inside_xla_without_pfor():
    # XLA cannot compile pfor's form of the RNN loop (nor could the whole-model
    # Jacobian before); the unvectorised per-layer Jacobian compiles
    keras.utils.set_random_seed(25)
    x, y = _sequence(steps=6)
    inp = keras.Input(x.shape[1:])
    model = keras.Model(inp, _head(keras.layers.RNN(keras.layers.LSTMCell(4))(inp)))
    register_rule(keras.layers.RNN, layer_rules.PerLayerJacobianRule(vectorize=False))
    try:
        check_exact(model, x, y, jit=True)
    finally:
        register_rule(keras.layers.RNN, FALLBACK)


def test_a_custom_layer_without_a_rule_uses_the_fallback_and_a_registered_rule_wins():
    keras.utils.set_random_seed(26)
    x, y = _sequence()
    inp = keras.Input(x.shape[1:])
    h = ScaleShift()(keras.layers.Dense(6, activation="tanh")(inp))
    model = keras.Model(inp, _head(h))
    check_exact(model, x, y, {"ScaleShift": "PerLayerJacobianRule", "Dense": "DenseRule"})

    class ScaleShiftRule(LayerRule):
        """dy/ds = x exp(s), dy/dt = 1: both materialised."""

        def forward(self, layer, x):
            s, t = layer_rules.stopped(layer.s), layer_rules.stopped(layer.t)
            z = layer_rules.watched(x * tf.exp(s) + t)
            return z, layer_rules.Taps({"z": z}, x * tf.exp(s))

        def gradients(self, layer, calls):
            (call,) = calls
            g = call.grads["z"]
            return [
                (layer.s, layer_rules.materialised(tf.reduce_sum(g * call.saved, axis=1), layer.s)),
                (layer.t, layer_rules.materialised(tf.reduce_sum(g, axis=1), layer.t)),
            ]

    register_rule(ScaleShift, ScaleShiftRule())
    try:
        assert isinstance(find_rule(model.layers[2]), ScaleShiftRule)
        check_exact(model, x, y, {"ScaleShift": "ScaleShiftRule", "Dense": "DenseRule"})
    finally:
        layer_rules.unregister_rule(ScaleShift)
    assert find_rule(model.layers[2]) is None


def test_rules_registered_when_their_package_is_imported(monkeypatch):
    """`register_when_imported`: nothing runs while the package is not imported; the
    first lookup after its import registers its rules; a rule registered for one of
    its classes after that import replaces the deferred one, as if it had run at once."""
    package = "dpfl_fake_layer_package"
    layer = ScaleShift()
    calls = []

    def register():
        calls.append(1)
        register_rule(ScaleShift, FALLBACK)

    layer_rules.register_when_imported(package, register)
    try:
        assert find_rule(layer) is None and calls == []
        monkeypatch.setitem(sys.modules, package, types.ModuleType(package))
        assert find_rule(layer) is FALLBACK and calls == [1]
        assert find_rule(layer) is FALLBACK and calls == [1]  # once
        layer_rules.unregister_rule(ScaleShift)
        assert find_rule(layer) is None and calls == [1]
        # registered by the user after the import: theirs wins over the deferred rule
        layer_rules.register_when_imported(package + "_b", register)
        monkeypatch.setitem(sys.modules, package + "_b", types.ModuleType(package))
        mine = layer_rules.PerLayerJacobianRule(vectorize=False)
        register_rule(ScaleShift, mine)
        assert calls == [1, 1] and find_rule(layer) is mine
        # a registration that fails says so, and is tried again at the next lookup
        monkeypatch.setitem(sys.modules, package + "_c", types.ModuleType(package))

        def broken():
            raise RuntimeError("broken registration")

        with pytest.raises(RuntimeError, match="broken registration"):
            layer_rules.register_when_imported(package + "_c", broken)
        assert layer_rules._base._DEFERRED[package + "_c"] is broken  # kept
        with pytest.raises(RuntimeError, match="broken registration"):
            find_rule(layer)
        layer_rules._base._DEFERRED[package + "_c"] = register  # mended
        assert find_rule(layer) is FALLBACK and calls == [1, 1, 1]
        assert package + "_c" not in layer_rules._base._DEFERRED
    finally:
        layer_rules.unregister_rule(ScaleShift)
        layer_rules._base._DEFERRED.pop(package, None)
        layer_rules._base._DEFERRED.pop(package + "_b", None)
        layer_rules._base._DEFERRED.pop(package + "_c", None)


def test_register_rule_checks_its_arguments():
    with pytest.raises(TypeError, match="layer_class"):
        register_rule(int, FALLBACK)
    with pytest.raises(TypeError, match="rule"):
        register_rule(ScaleShift, lambda *a: None)


# ---------------------------------------------------------------------------
# No rule by inheritance alone: a subclass that overrides what a rule
# reimplements computes another function


class ScaledDense(keras.layers.Dense):
    def call(self, x):
        return keras.layers.Dense.call(self, x) * 3 + 1


class DoubledKernelDense(keras.layers.Dense):
    @property
    def kernel(self):
        return super().kernel * 2


class ScaledEmbedding(keras.layers.Embedding):
    """A transformer's embedding scaled by sqrt(d)."""

    def call(self, ids):
        return super().call(ids) * float(np.sqrt(self.output_dim))


class ShiftedLayerNormalization(keras.layers.LayerNormalization):
    def call(self, x):
        return super().call(x) * 2 + 0.5


class NamedDense(keras.layers.Dense):
    """A subclass that only changes the constructor: still a Dense."""

    def __init__(self, units, **kwargs):
        super().__init__(units, activation="tanh", **kwargs)


OVERRIDING = {
    "dense_call": (ScaledDense, lambda: ScaledDense(6, activation="tanh")),
    "dense_kernel_property": (DoubledKernelDense, lambda: DoubledKernelDense(6)),
    "layer_normalization_call": (ShiftedLayerNormalization, ShiftedLayerNormalization),
}


@pytest.mark.parametrize("name", list(OVERRIDING))
def test_a_subclass_overriding_what_the_rule_reimplements_is_exact(name):
    cls, make = OVERRIDING[name]
    keras.utils.set_random_seed(41)
    x, y = _sequence()
    inp = keras.Input(x.shape[1:])
    model = keras.Model(inp, _head(make()(inp)))
    check_exact(model, x, y, {cls.__name__: "PerLayerJacobianRule", "Dense": "DenseRule"})


def test_a_subclassed_embedding_overriding_call_is_exact():
    keras.utils.set_random_seed(42)
    x, y = _tokens()
    inp = keras.Input(x.shape[1:], dtype="int32")
    h = keras.layers.GlobalAveragePooling1D()(ScaledEmbedding(16, 4)(inp))
    model = keras.Model(inp, _head(h, pool=False))
    check_exact(model, x, y, {"ScaledEmbedding": "PerLayerJacobianRule", "Dense": "DenseRule"})


def test_a_tied_reversible_embedding_has_its_own_rule_not_embeddings():
    """keras.layers.ReversibleEmbedding(Embedding) overrides call (reverse=True is
    the tied output projection): with Embedding's rule fit failed with a shape
    error ("output.shape=(None, 16, 8, 8)"); it now has its own rule (lookup and
    tied head summed before the norm), exact against a per-example loop."""
    keras.utils.set_random_seed(44)
    x, _ = _tokens(steps=13)
    inp, target = x[:, :-1], x[:, 1:]
    tokens = keras.Input(inp.shape[1:], dtype="int32")
    emb = keras.layers.ReversibleEmbedding(16, 8)
    model = keras.Model(
        tokens, emb(keras.layers.Dense(8, activation="tanh")(emb(tokens)), reverse=True)
    )
    used = {type(la).__name__: type(r).__name__ for la, r in plan_layers(model).values()}
    assert used == {"ReversibleEmbedding": "ReversibleEmbeddingRule", "Dense": "DenseRule"}
    ref = []
    for i in range(len(inp)):  # the per-example loss: the mean over the tokens
        with tf.GradientTape() as tape:
            li = tf.reduce_mean(loss().call(target[i : i + 1], model(inp[i : i + 1])))
        ref.append([g.numpy() for g in tape.gradient(li, model.trainable_variables)])
    sums, sq, _ = _run(model, inp, target)
    for j, v in enumerate(model.trainable_variables):
        np.testing.assert_allclose(
            sq[j], [np.sum(r[j] ** 2) for r in ref], rtol=3e-4, atol=1e-9, err_msg=v.path
        )
        np.testing.assert_allclose(
            sums[j], sum(r[j] for r in ref), rtol=3e-4, atol=2e-6, err_msg=v.path
        )


def test_a_subclass_keeping_call_keeps_the_fast_rule_and_a_registration_declares_one():
    keras.utils.set_random_seed(43)
    x, y = _sequence()
    inp = keras.Input(x.shape[1:])
    model = keras.Model(inp, _head(NamedDense(6)(inp)))
    check_exact(model, x, y, {"NamedDense": "DenseRule", "Dense": "DenseRule"})
    layer = ScaledDense(3)
    assert find_rule(layer) is None
    rule = find_rule(keras.layers.Dense(3))
    register_rule(ScaledDense, rule)  # the user declares the rule valid for it
    try:
        assert find_rule(layer) is rule
    finally:
        layer_rules.unregister_rule(ScaledDense)


def test_a_rule_refusing_a_configuration_sends_the_layer_to_the_fallback():
    keras.utils.set_random_seed(27)
    x, y = _images()
    x = np.transpose(x, (0, 3, 1, 2))  # channels_first
    inp = keras.Input(x.shape[1:])
    h = keras.layers.Conv2D(3, 3, strides=2, data_format="channels_first")(inp)
    model = keras.Model(inp, _head(h))
    skip_unless_the_cpu_runs(lambda: model(x[:1]), "a channels_first Conv2D")
    check_exact(model, x, y, {"Conv2D": "PerLayerJacobianRule", "Dense": "DenseRule"})


# ---------------------------------------------------------------------------
# Mixed precision: layers compute in float16/bfloat16, rules in float32


@pytest.fixture
def policy(request):
    keras.mixed_precision.set_global_policy(request.param)
    yield request.param
    keras.mixed_precision.set_global_policy("float32")


def _mixed_models():
    x, y = _images()
    keras.utils.set_random_seed(28)
    inp = keras.Input(x.shape[1:])
    h = keras.layers.Conv2D(4, 3, strides=2, activation="relu")(inp)
    h = keras.layers.GroupNormalization(2)(h)
    h = keras.layers.DepthwiseConv2D(3, strides=2)(h)
    h = keras.layers.Flatten()(h)
    cnn = keras.Model(inp, keras.layers.Dense(10, dtype="float32")(h))
    xt, yt = _tokens()
    inp = keras.Input(xt.shape[1:], dtype="int32")
    h = keras.layers.Embedding(16, 6, mask_zero=True)(inp)
    h = keras.layers.Bidirectional(keras.layers.GRU(4, return_sequences=True))(h)
    h = keras.layers.LSTM(5)(h)
    recurrent = keras.Model(inp, keras.layers.Dense(10, dtype="float32")(h))
    return [(cnn, x, y), (transformer_block(), xt, yt), (recurrent, xt, yt)]


@pytest.mark.parametrize(
    "policy, loss_scale, rtol",
    [("mixed_float16", 1.0, 2e-2), ("mixed_float16", 1024.0, 2e-2), ("mixed_bfloat16", 1.0, 1e-1)],
    indirect=["policy"],
)
def test_mixed_precision_norms_and_sums_are_float32_and_close_to_float32(policy, loss_scale, rtol):
    mixed = _mixed_models()
    keras.mixed_precision.set_global_policy("float32")
    for model, x, y in mixed:
        assert model.layers[1].compute_dtype != "float32"
        weights = [v.numpy() for v in model.trainable_variables]
        ref = _reference(model, x, y)  # the mixed model itself, example by example
        ref_sq = [np.array([np.sum(r[j] ** 2) for r in ref]) for j in range(len(ref[0]))]
        captured = {}

        def factors(sq):
            captured["sq"] = sq
            return [tf.ones_like(s) for s in sq]

        per_example = PerExampleGradients(model, loss(), loss_scale=loss_scale)
        sums = per_example.compute(tf.constant(x), tf.constant(y), tf.ones(N), factors)[0]
        assert all(s.dtype == tf.float32 for s in captured["sq"] + list(sums))
        total_ref = sum(ref_sq)
        total = sum(s.numpy() for s in captured["sq"])
        np.testing.assert_allclose(total, total_ref, rtol=rtol)
        for s, r in zip(sums, [sum(g[j] for g in ref) for j in range(len(ref[0]))]):
            assert np.linalg.norm(s.numpy() - r) <= rtol * (np.linalg.norm(r) + 1e-3)
        assert all(np.array_equal(v.numpy(), w) for v, w in zip(model.trainable_variables, weights))


@pytest.mark.parametrize(
    "policy, scale",
    [("mixed_float16", 1024.0), ("mixed_bfloat16", 1.0), ("float32", 1.0)],
    indirect=["policy"],
)
def test_default_loss_scale(policy, scale):
    from dpfl_tf.keras.per_example import default_loss_scale

    assert default_loss_scale(_mixed_models()[0][0]) == scale


def test_loss_scale_is_checked():
    with pytest.raises(ValueError, match="loss_scale must be a finite number > 0, got 0"):
        PerExampleGradients(keras.Sequential([keras.layers.Dense(1)]), loss(), loss_scale=0)


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"], indirect=True)
def test_dp_training_under_mixed_precision(policy):
    # DPModel.compile keeps Keras from wrapping the DP optimizer in a
    # LossScaleOptimizer (it scales the per-example losses itself)
    from dpfl_tf.keras import DPSGD, DPModel

    model, x, y = _mixed_models()[0]
    x, y = mnist_slice(48, flat=False)
    dp = DPModel(model)
    dp.compile(optimizer=DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0, seed=0), loss=loss())
    before = [v.numpy().copy() for v in model.trainable_variables]
    dp.fit(x, y, lot_size=16, batch_size=8, epochs=1, verbose=0)
    assert dp.lots_applied >= 1 and dp.dropped_examples == 0
    after = [v.numpy() for v in model.trainable_variables]
    assert all(v.dtype == np.float32 and np.all(np.isfinite(v)) for v in after)
    assert any(not np.allclose(a, b) for a, b in zip(after, before))


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"], indirect=True)
def test_noise_under_mixed_precision_has_the_float32_scale(policy):
    """Same lot, noise 0 vs noise sigma: the weight difference is -lr z / L with
    z ~ N(0, sigma^2 C^2), in float32 (a KS test that rejects a wrong scale)."""
    from scipy import stats

    from dpfl_tf.keras import DPSGD, DPModel

    x, y = mnist_slice(16, flat=False)
    lr, clip, sigma, lot = 0.5, 1.0, 2.0, 16
    deltas = []
    for noise in (0.0, sigma):
        model = _mixed_models()[0][0]
        dp = DPModel(model)
        dp.compile(
            optimizer=DPSGD(lr, l2_norm_clip=clip, noise_multiplier=noise, seed=1), loss=loss()
        )
        before = np.concatenate([v.numpy().ravel() for v in model.trainable_variables])
        dp.fit(x, y, lot_size=lot, batch_size=8, epochs=1, verbose=0, sampling="full_batch")
        after = np.concatenate([v.numpy().ravel() for v in model.trainable_variables])
        deltas.append(after - before)
    z = (deltas[0] - deltas[1]) * lot / lr  # the noise draw
    assert z.size > 1000
    assert stats.kstest(z, "norm", args=(0, sigma * clip)).pvalue > 1e-3
    assert stats.kstest(z, "norm", args=(0, 1.5 * sigma * clip)).pvalue < 1e-3


class OwnTemperature(keras.Model):
    """A model holding a variable of its own next to its layers."""

    def __init__(self):
        super().__init__()
        self.dense = keras.layers.Dense(10)
        self.temperature = self.add_weight(shape=(), initializer="ones")

    def call(self, x, training=None):
        return self.dense(x) * self.temperature


def test_time_distributed_and_a_models_own_variable():
    keras.utils.set_random_seed(29)
    x, y = _sequence()
    inp = keras.Input(x.shape[1:])
    h = keras.layers.TimeDistributed(keras.layers.Dense(3, activation="tanh"))(inp)
    check_exact(
        keras.Model(inp, _head(h)),
        x,
        y,
        {"TimeDistributed": "PerLayerJacobianRule", "Dense": "DenseRule"},
    )
    model = OwnTemperature()
    flat = x.reshape(N, -1)
    # the Dense uses its rule; the model's own variable takes the whole-model Jacobian
    model(flat[:1])
    assert [type(r).__name__ for _, r in plan_layers(model).values()] == ["DenseRule"]
    check_exact(model, flat, y)


def test_convolution_and_normalization_rules_inside_xla():
    keras.utils.set_random_seed(30)
    x, y = _images()
    inp = keras.Input(x.shape[1:])
    h = keras.layers.Conv2D(4, 3, strides=2, groups=1, activation="relu")(inp)
    h = keras.layers.GroupNormalization(2)(h)
    h = keras.layers.Conv2D(4, 3, groups=2, dilation_rate=2)(h)
    h = keras.layers.DepthwiseConv2D(3, depth_multiplier=2, padding="same")(h)
    h = keras.layers.SeparableConv2D(4, 3, strides=2, padding="same")(h)
    h = keras.layers.Conv2DTranspose(3, 3, strides=2, padding="same")(h)
    h = keras.layers.LayerNormalization()(h)
    h = keras.layers.Reshape((-1, 3))(h)
    h = keras.layers.Conv1D(3, 3, padding="causal", dilation_rate=2)(h)
    h = keras.layers.RMSNormalization()(h)
    check_exact(keras.Model(inp, _head(h)), x, y, jit=True)
