"""Per-example gradients: fast paths == generic path == a reference loop."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from dpfl_tf.keras.layer_rules import FALLBACK, find_rule
from dpfl_tf.keras.layer_rules.conv import ConvRule
from dpfl_tf.keras.layer_rules.dense import DenseRule
from dpfl_tf.keras.layer_rules.embedding import EmbeddingRule
from dpfl_tf.keras.layer_rules.normalization import AffineNormalizationRule
from dpfl_tf.keras.per_example import (
    BatchMixingLayerError,
    PerExampleGradients,
    plan_layers,
    refuse_batch_mixing_layers,
)
from tests.keras.helpers import WITH_ONEDNN, loss, mnist_slice, skip_without_onednn

# what XLA and TensorFlow compile here stays until the process ends (+0.8 GB in a
# whole-suite worker): the file runs in a process of its own (tests/isolation.py), with
# oneDNN on: its allocator keeps the CPU memory statistics a test reads (`WITH_ONEDNN`)
pytestmark = pytest.mark.isolated(env=WITH_ONEDNN)


def _example(x, i):
    """Example i of an input (an array or a list of arrays), batch axis kept."""
    return [t[i : i + 1] for t in x] if isinstance(x, (list, tuple)) else x[i : i + 1]


def _reference(model, x, y):
    """Per-example gradients by brute force: one GradientTape per example."""
    grads = []
    for i in range(len(y)):
        with tf.GradientTape() as tape:
            li = tf.reduce_sum(loss().call(y[i : i + 1], model(_example(x, i), training=True)))
        g = tape.gradient(li, model.trainable_variables)
        grads.append(
            [
                np.zeros(v.shape) if gi is None else tf.convert_to_tensor(gi).numpy()
                for gi, v in zip(g, model.trainable_variables)
            ]
        )
    return grads


def _compute(model, x, y, fast, clip=None):
    captured = {}

    def factors(sq):
        captured["sq"] = [s.numpy() for s in sq]
        if clip is None:
            return [tf.ones_like(s) for s in sq]
        total = tf.sqrt(tf.add_n(sq))
        return [clip / tf.maximum(total, clip)] * len(sq)

    sums, losses, _ = PerExampleGradients(model, loss(), fast=fast).compute(
        x, tf.constant(y), tf.ones(len(y)), factors
    )
    return [s.numpy() for s in sums], captured["sq"]


def conv_model():
    keras.utils.set_random_seed(1)
    inp = keras.Input((28, 28, 1))
    h = keras.layers.Conv2D(4, 5, strides=2, padding="same", activation="relu")(inp)
    h = keras.layers.MaxPooling2D(2)(h)
    h = keras.layers.Conv2D(6, 3, padding="valid", activation="tanh")(h)
    h = keras.layers.Flatten()(h)
    h = keras.layers.LayerNormalization()(h)  # generic path
    return keras.Model(inp, keras.layers.Dense(10)(h))


def embedding_model():
    keras.utils.set_random_seed(2)
    tokens = keras.Input((12,), dtype="int32")
    e = keras.layers.Embedding(16, 4)(tokens)
    e = keras.layers.Dense(5, activation="relu")(e)  # Dense on [B, T, d]: ghost norm
    e = keras.layers.GlobalAveragePooling1D()(e)
    return keras.Model(tokens, keras.layers.Dense(10)(e))


class Subclassed(keras.Model):
    def __init__(self):
        super().__init__()
        self.d1 = keras.layers.Dense(8, activation="tanh")
        self.d2 = keras.layers.Dense(10)

    def call(self, x, training=None):
        return self.d2(self.d1(x) * 2.0)


def _data(kind, n=6):
    if kind == "conv":
        return mnist_slice(n, flat=False)
    x, y = mnist_slice(n, flat=True)
    if kind == "embedding":
        return (np.floor(x[:, 200:212] * 15.99)).astype("int32"), y
    return x[:, :20], y


@pytest.mark.parametrize(
    "kind, make",
    [("conv", conv_model), ("embedding", embedding_model), ("dense", lambda: Subclassed())],
)
def test_fast_and_generic_paths_equal_reference_loop(kind, make):
    x, y = _data(kind)
    model = make()
    model(x[:1])
    _assert_both_paths_equal_reference(model, x, y)


def _assert_both_paths_equal_reference(model, x, y):
    """Unclipped sums and per-example squared norms of the fast and generic paths equal a
    per-example loop (one tape per example)."""
    ref = _reference(model, x, y)
    ref_sum = [sum(r[j] for r in ref) for j in range(len(ref[0]))]
    ref_sq = [np.array([np.sum(r[j] ** 2) for r in ref]) for j in range(len(ref[0]))]
    for fast in (True, False):
        sums, sq = _compute(model, x, y, fast)
        for a, b in zip(sq, ref_sq):
            np.testing.assert_allclose(a, b, rtol=2e-4, atol=1e-8)
        for a, b in zip(sums, ref_sum):
            np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-5)


def _rule_names(model):
    return {layer.name: type(rule).__name__ for layer, rule in plan_layers(model).values()}


def test_rules_are_found_for_dense_conv_embedding_and_frozen_layers_only_run_forward():
    model = conv_model()
    assert [type(find_rule(layer)) for layer in model.layers[1:]] == [
        ConvRule,
        type(None),
        ConvRule,
        type(None),
        AffineNormalizationRule,
        DenseRule,
    ]
    assert sorted(_rule_names(model).values()) == sorted(
        ["ConvRule", "ConvRule", "AffineNormalizationRule", "DenseRule"]
    )
    assert isinstance(find_rule(embedding_model().layers[1]), EmbeddingRule)
    frozen = keras.Sequential([keras.Input((2,)), keras.layers.Dense(3), keras.layers.Dense(2)])
    frozen.layers[0].trainable = False
    assert list(_rule_names(frozen)) == [frozen.layers[1].name]  # frozen: forward only
    # subclassed models are descended into as well
    sub = Subclassed()
    sub(np.zeros((1, 20), "float32"))
    assert sorted(_rule_names(sub).values()) == ["DenseRule", "DenseRule"]
    # a layer without a rule whose variables are its own uses the fallback
    rnn = keras.Sequential(
        [keras.Input((5, 3)), keras.layers.RNN(keras.layers.LSTMCell(4)), keras.layers.Dense(2)]
    )
    assert [rule for _, rule in plan_layers(rnn).values()][0] is FALLBACK


def test_clipped_sum_equals_sum_of_clipped_reference_gradients():
    x, y = _data("conv")
    model = conv_model()
    ref = _reference(model, x, y)
    clip = 0.05
    expected = [np.zeros_like(g) for g in ref[0]]
    for r in ref:
        norm = np.sqrt(sum(np.sum(g**2) for g in r))
        assert norm > clip  # the bound binds
        for j, g in enumerate(r):
            expected[j] += g * min(1.0, clip / norm)
    sums, _ = _compute(model, x, y, fast=True, clip=clip)
    for a, b in zip(sums, expected):
        np.testing.assert_allclose(a, b, rtol=2e-4, atol=1e-7)
    # the sum of B clipped gradients has norm at most B * C
    assert np.sqrt(sum(np.sum(s**2) for s in sums)) <= len(y) * clip * (1 + 1e-5)


def test_batch_normalization_in_training_mode_is_refused():
    model = keras.Sequential(
        [
            keras.Input((4,)),
            keras.layers.Dense(3),
            keras.layers.BatchNormalization(),
            keras.layers.Dense(2),
        ]
    )
    with pytest.raises(BatchMixingLayerError, match="BatchNormalization"):
        refuse_batch_mixing_layers(model)
    model.layers[1].trainable = False  # frozen BN runs in inference mode: fine
    refuse_batch_mixing_layers(model)


def test_reduced_loss_is_refused():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])

    def mean_loss(y_true, y_pred):
        return tf.reduce_mean(tf.square(y_pred))

    with pytest.raises(ValueError, match="one loss value per example"):
        PerExampleGradients(model, mean_loss).compute(
            tf.ones((4, 3)), tf.zeros(4), tf.ones(4), lambda sq: sq
        )


# ---------------------------------------------------------------------------
# Layers called more than once and variables used outside the layer's own call:
# an example's gradient of such a variable is the sum over all its uses.


class TiedProjection(keras.layers.Layer):
    """Output logits h @ E^T with the embedding table E of an Embedding (weight tying)."""

    def __init__(self, embedding, **kwargs):
        super().__init__(**kwargs)
        self.embedding = embedding

    def call(self, h):
        return tf.matmul(h, self.embedding.embeddings, transpose_b=True)


class CallsInside(keras.layers.Layer):
    """Calls a layer that is also a node of the functional graph (a use no tap sees)."""

    def __init__(self, layer, **kwargs):
        super().__init__(**kwargs)
        self.inner = layer

    def call(self, h):
        return self.inner(h) * 0.5


def shared_dense_two_inputs():
    keras.utils.set_random_seed(3)
    a, b = keras.Input((20,)), keras.Input((20,))
    shared = keras.layers.Dense(8, activation="tanh")
    h = keras.layers.Concatenate()([shared(a), shared(b)])
    return keras.Model([a, b], keras.layers.Dense(10)(h))


def dense_twice_in_sequence():
    keras.utils.set_random_seed(4)
    inp = keras.Input((20,))
    shared = keras.layers.Dense(20, activation="tanh")
    return keras.Model(inp, keras.layers.Dense(10)(shared(shared(inp))))


def conv_twice():
    keras.utils.set_random_seed(5)
    inp = keras.Input((28, 28, 1))
    h = keras.layers.Conv2D(4, 5, strides=2, padding="same", activation="relu")(inp)
    shared = keras.layers.Conv2D(4, 3, padding="same", activation="tanh")
    h = keras.layers.MaxPooling2D(2)(shared(shared(h)))
    h = keras.layers.Flatten()(h)
    return keras.Model(inp, keras.layers.Dense(10)(h))


def embedding_twice():
    keras.utils.set_random_seed(6)
    first, second = keras.Input((6,), dtype="int32"), keras.Input((6,), dtype="int32")
    emb = keras.layers.Embedding(16, 4)
    e = keras.layers.Concatenate(axis=1)([emb(first), emb(second)])
    e = keras.layers.GlobalAveragePooling1D()(keras.layers.Dense(5, activation="relu")(e))
    return keras.Model([first, second], keras.layers.Dense(10)(e))


def tied_embedding():
    keras.utils.set_random_seed(7)
    tokens = keras.Input((12,), dtype="int32")
    emb = keras.layers.Embedding(16, 8)
    h = keras.layers.Dense(8, activation="tanh")(emb(tokens))
    h = keras.layers.GlobalAveragePooling1D()(h)
    return keras.Model(tokens, TiedProjection(emb)(h))  # 16 logits, labels 0..9


def tied_embedding_by_keras_ops():
    keras.utils.set_random_seed(10)
    tokens = keras.Input((12,), dtype="int32")
    emb = keras.layers.Embedding(16, 10)
    h = keras.layers.Dense(16, activation="tanh")(emb(tokens))
    h = keras.layers.GlobalAveragePooling1D()(h)
    # the graph node keeps the Variable itself (a transpose would be a constant copy)
    return keras.Model(tokens, keras.ops.matmul(h, emb.embeddings))


def dense_also_called_inside_a_layer():
    keras.utils.set_random_seed(8)
    inp = keras.Input((20,))
    shared = keras.layers.Dense(20, activation="tanh")
    h = CallsInside(shared)(shared(inp))
    return keras.Model(inp, keras.layers.Dense(10)(h))


def mirror_views_cnn():
    """`view_averaged`: one nested CNN (a frozen normalisation, conv, dense) on an
    image and its mirror image, logits averaged -- the ScatterNet CNN's shape."""
    from dpfl_tf.models import view_averaged

    keras.utils.set_random_seed(9)
    head = keras.Sequential(
        [
            keras.Input((28, 28, 1)),
            keras.layers.Normalization(axis=-1, mean=[0.13], variance=[0.09]),
            keras.layers.Conv2D(4, 5, strides=2, padding="same", activation="tanh"),
            keras.layers.MaxPooling2D(2),
            keras.layers.Flatten(),
            keras.layers.Dense(10),
        ]
    )
    return view_averaged(head, 2)


def mirror_views_linear():
    from dpfl_tf.models import view_averaged

    keras.utils.set_random_seed(11)
    head = keras.Sequential(
        [keras.Input((28, 28, 1)), keras.layers.Flatten(), keras.layers.Dense(10)]
    )
    return view_averaged(head, 2)


def mirror_views_scatter_cnn():
    """The ScatterNet CNN itself on 7x7x81 features with two views: 98 positions
    per conv1 call pair, 2 S^2 < d o, so the convolutions take the ghost norm."""
    from dpfl_tf.models import scatter_cnn

    keras.utils.set_random_seed(12)
    return scatter_cnn((7, 7, 81), views=2)


SHARED = {
    "dense_two_inputs": ("dense2", shared_dense_two_inputs),
    "mirror_views_scatter_cnn": ("scatter_views", mirror_views_scatter_cnn),
    "mirror_views_cnn": ("views", mirror_views_cnn),
    "mirror_views_linear": ("views", mirror_views_linear),
    "dense_twice_in_sequence": ("dense", dense_twice_in_sequence),
    "conv2d_twice": ("conv", conv_twice),
    "embedding_twice": ("embedding2", embedding_twice),
    "tied_embedding": ("embedding", tied_embedding),
    "tied_embedding_by_keras_ops": ("embedding", tied_embedding_by_keras_ops),
    "dense_also_called_inside_a_layer": ("dense", dense_also_called_inside_a_layer),
}


def _shared_data(kind, n=6):
    if kind == "scatter_views":  # real scattering features of digits and their mirrors
        from dpfl_tf.scattering import Scattering2D

        x, y = mnist_slice(n, flat=False)
        return Scattering2D(J=2, L=8, shape=(28, 28)).transform(x[..., 0], mirror=True), y
    if kind == "views":  # [n, 2, 28, 28, 1]: each image and its mirror image
        x, y = mnist_slice(n, flat=False)
        return np.stack([x, x[:, :, ::-1]], axis=1), y
    if kind == "dense2":
        x, y = mnist_slice(n, flat=True)
        return [x[:, 150:170], x[:, 400:420]], y
    if kind == "embedding2":
        x, y = _data("embedding", n)
        return [x[:, :6], x[:, 6:]], y
    return _data(kind, n)


def _clipped_reference(ref, clip):
    expected = [np.zeros_like(g) for g in ref[0]]
    for r in ref:
        norm = np.sqrt(sum(np.sum(g**2) for g in r))
        assert norm > clip  # the bound binds: every clip factor is < 1
        for j, g in enumerate(r):
            expected[j] += g * min(1.0, clip / norm)
    return expected


@pytest.mark.parametrize("name", list(SHARED))
def test_shared_layers_and_tied_weights_equal_reference_loop(name):
    kind, make = SHARED[name]
    x, y = _shared_data(kind)
    _assert_both_paths_equal_reference(make(), x, y)


@pytest.mark.parametrize("name", list(SHARED))
def test_shared_layers_and_tied_weights_clipped_sums(name):
    kind, make = SHARED[name]
    x, y = _shared_data(kind)
    model = make()
    clip = 0.01
    expected = _clipped_reference(_reference(model, x, y), clip)
    sums, _ = _compute(model, x, y, fast=True, clip=clip)
    for a, b in zip(sums, expected):
        np.testing.assert_allclose(a, b, rtol=2e-4, atol=1e-7)


@pytest.mark.parametrize("jit", [False, True], ids=["tf_function", "xla"])
@pytest.mark.parametrize("name", list(SHARED))
def test_shared_layers_and_tied_weights_inside_tf_function_and_xla(name, jit):
    kind, make = SHARED[name]
    x, y = _shared_data(kind)
    model = make()
    clip = 0.01
    expected = _clipped_reference(_reference(model, x, y), clip)
    per_example = PerExampleGradients(model, loss())

    @tf.function(jit_compile=jit)
    def clipped_sums(x, y):
        def factors(sq):
            total = tf.sqrt(tf.add_n(sq))
            return [clip / tf.maximum(total, clip)] * len(sq)

        return per_example.compute(x, y, tf.ones(tf.shape(y)[0]), factors)[0]

    sums = clipped_sums(tf.nest.map_structure(tf.constant, x), tf.constant(y))
    for a, b in zip(sums, expected):
        np.testing.assert_allclose(a.numpy(), b, rtol=2e-4, atol=1e-7)


def test_outside_use_moves_the_layer_to_the_generic_path_once():
    x, y = _data("embedding")
    model = tied_embedding()
    per_example = PerExampleGradients(model, loss())
    passes = []
    one_pass = per_example._compute
    per_example._compute = lambda *a: passes.append(1) or one_pass(*a)
    for _ in range(2):
        per_example.compute(x, tf.constant(y), tf.ones(len(y)), lambda sq: sq)
    embedding = next(la for la in model.layers if isinstance(la, keras.layers.Embedding))
    assert per_example.excluded_layers == (embedding,)
    assert len(passes) == 3  # found in the first call; the second starts with it excluded
    # layers called more than once, but only through taps, stay on the fast path
    for make, kind in [
        (shared_dense_two_inputs, "dense2"),
        (conv_twice, "conv"),
        (embedding_twice, "embedding2"),
        (conv_model, "conv"),
    ]:
        xs, ys = _shared_data(kind)
        fast = PerExampleGradients(make(), loss())
        fast.compute(xs, tf.constant(ys), tf.ones(len(ys)), lambda sq: sq)
        assert fast.excluded_layers == ()


def test_a_variable_held_by_two_fast_path_layers_goes_to_the_generic_path():
    # Keras refuses new state after build; the private unlock makes the case the
    # structural check exists for (both taps read the kernel through stop_gradient)
    keras.utils.set_random_seed(9)
    inp = keras.Input((20,))
    first = keras.layers.Dense(20, activation="tanh")
    second = keras.layers.Dense(20, activation="tanh", use_bias=False)
    h = second(first(inp))
    second._tracker.unlock()
    second._kernel = first._kernel
    second._tracker.lock()
    model = keras.Model(inp, keras.layers.Dense(10)(h))
    x, y = _data("dense")
    ref = _reference(model, x, y)
    ref_sq = [np.array([np.sum(r[j] ** 2) for r in ref]) for j in range(len(ref[0]))]
    per_example = PerExampleGradients(model, loss())
    captured = []
    per_example.compute(
        x,
        tf.constant(y),
        tf.ones(len(y)),
        lambda sq: captured.extend(sq) or [tf.ones_like(s) for s in sq],
    )
    assert set(per_example.excluded_layers) == {first, second}
    for a, b in zip(captured, ref_sq):
        np.testing.assert_allclose(a.numpy(), b, rtol=2e-4, atol=1e-8)


@pytest.mark.parametrize("jit", [False, True], ids=["tf_function", "xla"])
def test_dp_training_of_a_weight_tied_model(jit):
    from dpfl_tf.keras import DPSGD, DPModel

    x, y = _data("embedding", n=60)

    def dp_model(noise, clip, lr):
        model = tied_embedding()
        dp = DPModel(model)
        dp.compile(
            optimizer=DPSGD(lr, l2_norm_clip=clip, noise_multiplier=noise, seed=0),
            loss=loss(),
            jit_compile=jit,
        )
        return dp, model, [v.numpy().copy() for v in model.trainable_variables]

    # without noise, one lot of 24 in physical batches of 8 moves the weights by
    # -lr sum(clipped) / 24 (lr large enough for float32 differences of weights)
    clip, lr = 0.01, 1000.0
    expected = _clipped_reference(_reference(tied_embedding(), x[:24], y[:24]), clip)
    dp, model, before = dp_model(0.0, clip, lr)
    dp.fit(x[:24], y[:24], lot_size=24, batch_size=8, epochs=1, verbose=0, sampling="full_batch")
    for v, w0, e in zip(model.trainable_variables, before, expected):
        np.testing.assert_allclose(v.numpy() - w0, -lr * e / 24, rtol=1e-3, atol=1e-6)
    assert [type(la).__name__ for la in dp._per_example.excluded_layers] == ["Embedding"]

    # a few noisy Poisson lots finish with finite, changed weights
    dp, model, before = dp_model(1.0, 1.0, 0.5)
    dp.fit(x, y, lot_size=20, batch_size=8, epochs=1, verbose=0)
    assert dp.lots_applied == 3
    after = [v.numpy() for v in model.trainable_variables]
    assert all(np.all(np.isfinite(w)) for w in after)
    assert all(not np.allclose(a, b) for a, b in zip(after, before))


def test_peak_memory_of_the_dp_pass_stays_near_the_plain_gradient():
    """The layers' norms run one after another: each layer's patches are freed
    before the next layer's exist.  Allowing the graph to run them side by
    side (as before) measured 7-10x the plain gradient's peak allocation on this
    6-conv net; one at a time, 3.5x."""
    try:
        tf.config.experimental.reset_memory_stats("CPU:0")
    except ValueError as e:
        skip_without_onednn(e, "keeps no CPU memory statistics", e)
    keras.utils.set_random_seed(0)
    inputs = keras.Input((32, 32, 3))
    h = inputs
    for _ in range(6):
        h = keras.layers.Conv2D(16, 3, padding="same", activation="relu")(h)
    model = keras.Model(inputs, keras.layers.Dense(10)(keras.layers.GlobalAveragePooling2D()(h)))
    per_example = PerExampleGradients(model, loss())

    @tf.function
    def plain(x, y):
        with tf.GradientTape() as tape:
            value = tf.reduce_sum(loss().call(y, model(x, training=True)))
        return tape.gradient(value, model.trainable_variables)

    @tf.function
    def dp(x, y):
        return per_example.compute(
            x,
            y,
            tf.ones(tf.shape(y)[0]),
            lambda sq: [1.0 / tf.maximum(tf.sqrt(tf.add_n(sq)), 1.0)] * len(sq),
        )[0]

    x = tf.random.uniform((64, 32, 32, 3))
    y = tf.zeros((64,), tf.int64)

    def peak_bytes(fn):
        fn(x, y)  # trace and warm up
        tf.config.experimental.reset_memory_stats("CPU:0")
        start = tf.config.experimental.get_memory_info("CPU:0")["current"]
        fn(x, y)
        return tf.config.experimental.get_memory_info("CPU:0")["peak"] - start

    plain_peak, dp_peak = peak_bytes(plain), peak_bytes(dp)
    assert plain_peak > 0
    assert dp_peak <= 5 * plain_peak, (dp_peak / 2**20, plain_peak / 2**20)


def test_the_tape_is_persistent_only_for_the_whole_model_jacobian():
    """A persistent tape makes TensorFlow's while loops keep every intermediate
    for any later gradient: the LSTM benchmark model's DP pass (LSTM(128) over
    128 steps, batch 256) peaked at 1715 MB RSS with it and 1325 MB without
    (the plain gradient: 978 MB).  So the tape is persistent only when a
    variable takes the whole-model Jacobian (its second use)."""
    keras.utils.set_random_seed(3)
    inp = keras.Input((12,), dtype="int32")
    h = keras.layers.LSTM(8)(keras.layers.Embedding(50, 6)(inp))
    model = keras.Model(inp, keras.layers.Dense(2)(h))
    x = np.random.default_rng(0).integers(1, 50, (5, 12)).astype("int32")
    y = np.zeros((5,), "int64")
    per_example = PerExampleGradients(model, loss())
    sums, _, _ = per_example.compute(
        x, tf.constant(y), tf.ones(5), lambda sq: [tf.ones_like(s) for s in sq]
    )
    assert per_example._persistent is False  # every variable has a rule
    ref = _reference(model, x, y)
    for j, s in enumerate(sums):  # still exact
        np.testing.assert_allclose(s.numpy(), sum(r[j] for r in ref), rtol=1e-4, atol=1e-6)
    generic = PerExampleGradients(model, loss(), fast=False)
    generic.compute(x, tf.constant(y), tf.ones(5), lambda sq: [tf.ones_like(s) for s in sq])
    assert generic._persistent is True
    # found while tracing (weight tying): the redo pass is persistent
    tied = PerExampleGradients(tied_embedding(), loss())
    xt, yt = _data("embedding")
    tied.compute(xt, tf.constant(yt), tf.ones(len(yt)), lambda sq: sq)
    assert tied._persistent is True


class _Branchy(keras.layers.Layer):
    """Calls its Dense inside tf.cond: in a graph the call is in the branch's
    graph, which the tapped forward cannot reach, so the Dense is not tapped."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(5, activation="tanh")

    def call(self, x):
        return tf.cond(
            tf.reduce_sum(x) > -1e9, lambda: self.dense(x), lambda: tf.zeros_like(self.dense(x))
        )


def test_a_planned_layer_not_tapped_takes_the_jacobian_with_a_persistent_redo():
    """Planned (its variables belong to a Dense with a rule), but its call is
    hidden in a branch: found after the first pass, which is redone with a
    persistent tape; the result stays exact."""
    keras.utils.set_random_seed(8)
    x, y = _data("dense")
    inp = keras.Input(x.shape[1:])
    model = keras.Model(inp, keras.layers.Dense(10)(_Branchy()(inp)))
    per_example = PerExampleGradients(model, loss())
    passes = []
    one_pass = per_example._compute
    per_example._compute = lambda *a: passes.append(1) or one_pass(*a)
    captured = []

    @tf.function
    def dp(x, y):
        return per_example.compute(
            x,
            y,
            tf.ones(tf.shape(y)[0]),
            lambda sq: captured.append(sq) or [tf.ones_like(s) for s in sq],
        )[0]

    sums = dp(tf.constant(x), tf.constant(y))
    assert per_example._persistent is True and len(passes) == 2
    ref = _reference(model, x, y)
    for j, s in enumerate(sums):
        np.testing.assert_allclose(s.numpy(), sum(r[j] for r in ref), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("fast", [True, False])
def test_a_float64_layer_in_a_float32_model_trains_exactly(fast):
    """Layers of two dtypes in one model (a float64 head on float32 layers): the
    per-variable squared norms come in both dtypes and are summed for clipping
    (the generic path crashed on float32 + float64; the fuzzer's seeds 159, 243)."""
    from dpfl_tf.keras import DPSGD, DPModel

    keras.utils.set_random_seed(4)
    a, b = keras.Input((6,)), keras.Input((4,))
    h = keras.layers.Concatenate()([keras.layers.Dense(3)(a), keras.layers.Dense(3)(b)])
    out = keras.layers.Dense(10, dtype="float64")(keras.layers.Dense(5)(h))
    model = keras.Model([a, b], out)
    rng = np.random.default_rng(0)
    x = [rng.normal(size=(6, 6)).astype("float32"), rng.normal(size=(6, 4)).astype("float32")]
    y = rng.integers(0, 10, size=6)
    before = [v.numpy() for v in model.trainable_variables]
    per_example = _reference(model, x, y)
    clip = 0.5
    clipped = []
    for g in per_example:
        norm = np.sqrt(sum(np.sum(np.square(t.astype(np.float64))) for t in g))
        clipped.append([t * min(1.0, clip / norm) for t in g])
    want = [w - np.mean(parts, axis=0) for w, parts in zip(before, zip(*clipped))]
    dp = DPModel(model, fast_gradients=fast)
    dp.compile(optimizer=DPSGD(1.0, l2_norm_clip=clip, noise_multiplier=0.0), loss=loss())
    dp.fit(x, y, lot_size=6, sampling="shuffle", epochs=1, verbose=0)
    assert dp.lots_computed == 1
    for got, w in zip(model.trainable_variables, want):
        np.testing.assert_allclose(got.numpy(), w, rtol=1e-4, atol=1e-6)
