"""KerasHub's layers, ReversibleEmbedding (the tied LM head) and LoRA: every
rule == a brute-force per-example loop (one GradientTape per example; relative
error <= 1e-5 in float32, `dpfl_tf.keras.exactness`), and KerasHub models
built from configs (random initialisation) train with `DPModel.fit` exactly,
every layer on a fast rule."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from dpfl_tf.keras import layer_rules
from dpfl_tf.keras.exactness import compare, fit_error
from dpfl_tf.keras.per_example import PerExampleGradients, plan_layers
from tests.keras.helpers import loss, mnist_slice

# what XLA and TensorFlow compile here stays until the process ends (+0.9 GB in a
# whole-suite worker): the file runs in a process of its own (tests/isolation.py)
pytestmark = pytest.mark.isolated

keras_hub = pytest.importorskip("keras_hub")

TOL = 1e-5
SLOW = {"PerLayerJacobianRule", "whole-model Jacobian"}
N = 5


def tokens(n=N, steps=12, vocab=16, offset=320):
    """Token ids 0..vocab-1 from MNIST pixel intensities (0 = background)."""
    x, _ = mnist_slice(n + 1, flat=True)
    ids = np.floor(x[:, offset : offset + steps + 1] * (vocab - 0.01)).astype("int32")
    return ids[:n, :-1], ids[:n, 1:]  # inputs and next-token targets


def exact(model, x, y, rules=None, loss_fn=None):
    """Exact to TOL; no layer on the fallback or the whole-model Jacobian;
    `rules`: the {(layer class, rule class)} of the plan."""
    report = compare(model, x, y, loss_fn or loss())
    assert report.error <= TOL, report
    used = {(cls, rule) for _, cls, rule in report.plan}
    assert not {rule for _, rule in used} & SLOW, report.plan
    if rules is not None:
        assert used == rules
    return report


def randomise_lora(model, seed=0):
    """LoRA's B starts at zero (so A's gradient would be 0): random B."""
    rng = np.random.default_rng(seed)
    for v in model.trainable_variables:
        if "lora" in v.path and v.path.endswith("_b"):
            v.assign(rng.normal(size=v.shape).astype("float32") * 0.3)


# ---------------------------------------------------------------------------
# ReversibleEmbedding: lookup and tied head, summed before the norm


def lm(vocab=16, width=8, steps=12, **kwargs):
    """tokens -> ReversibleEmbedding -> Dense -> the same table as the head."""
    keras.utils.set_random_seed(40)
    inp = keras.Input((steps,), dtype="int32")
    emb = keras.layers.ReversibleEmbedding(vocab, width, **kwargs)
    h = keras.layers.Dense(width, activation="tanh")(emb(inp))
    return keras.Model(inp, emb(h, reverse=True)), emb


TIED = {
    # 2 S^2 = 288 > V d = 128: the [V, d] gradient is materialised
    "materialised": dict(vocab=16, width=8, steps=12),
    # 2 S^2 = 72 < V d = 320: ghost norm of the head plus the cross term
    "ghost": dict(vocab=40, width=8, steps=6),
    "soft_cap": dict(vocab=40, width=8, steps=6, logit_soft_cap=2.0),
    "untied": dict(vocab=40, width=8, steps=6, tie_weights=False),
    "mask_zero": dict(vocab=16, width=8, steps=12, mask_zero=True),
}


@pytest.mark.parametrize("name", list(TIED))
def test_reversible_embedding_as_lookup_and_tied_head(name):
    kwargs = TIED[name]
    x, y = tokens(steps=kwargs["steps"], vocab=kwargs["vocab"])
    model, emb = lm(**kwargs)
    exact(model, x, y, {("ReversibleEmbedding", "ReversibleEmbeddingRule"), ("Dense", "DenseRule")})
    if name in ("materialised", "ghost"):  # the two branches of the norm are taken
        from dpfl_tf.keras.layer_rules._base import ghost_norm_is_smaller

        assert ghost_norm_is_smaller(kwargs["steps"], kwargs["width"], kwargs["vocab"]) == (
            name == "ghost"
        )


def test_reversible_embedding_lookup_keeps_its_mask_and_head_alone():
    # lookup only, its padding mask read by the pooling; a second table used
    # only as a head on pooled features
    keras.utils.set_random_seed(41)
    x, y = tokens(vocab=16)
    inp = keras.Input((12,), dtype="int32")
    e = keras.layers.ReversibleEmbedding(16, 6, mask_zero=True)(inp)
    h = keras.layers.GlobalAveragePooling1D()(keras.layers.Dense(5, activation="tanh")(e))
    head = keras.layers.ReversibleEmbedding(10, 5)
    head.build((None,))
    model = keras.Model(inp, head(h, reverse=True))
    masked = keras.Model(inp, h)(x[:2]).numpy()
    dense = model.layers[2]
    values = dense(model.layers[1](x[:2])).numpy()
    keep = (x[:2] != 0)[..., None]
    np.testing.assert_allclose(masked, (values * keep).sum(1) / keep.sum(1), rtol=1e-5)
    exact(model, x, y[:, 0] % 10)


def test_a_table_called_twice_as_lookup_and_twice_as_head():
    keras.utils.set_random_seed(42)
    x, y = tokens(vocab=40, steps=6)
    a, b = keras.Input((6,), dtype="int32"), keras.Input((6,), dtype="int32")
    emb = keras.layers.ReversibleEmbedding(40, 8)
    h = keras.layers.Dense(8, activation="tanh")(emb(a) + emb(b))
    out = emb(h, reverse=True) + emb(keras.layers.Dense(8)(h), reverse=True)
    exact(keras.Model([a, b], out), [x, x[:, ::-1].copy()], y)


def test_tied_lm_trains_with_fit_exactly():
    # on main ReversibleEmbedding got Embedding's rule, which ignores reverse=True:
    # fit failed with a shape error
    x, y = tokens(n=8, vocab=40, steps=6)
    model, _ = lm(vocab=40, width=8, steps=6)
    error, _ = fit_error(model, x, y, loss())
    assert error <= TOL


# ---------------------------------------------------------------------------
# LoRA: only the factors (and a bias) train

EINSUM_LORA = {
    "projection_into_heads": ("abc,cde->abde", (12, 2, 3), "de"),
    "heads_out": ("abcd,cde->abe", (12, 5), "e"),
    "last_kernel_axis_contracted": ("abc,dc->abd", (12, 5), "d"),
    "diagonal_kernel": ("abc,bc->abc", (12, 8), None),
    "ellipsis": ("...b,bc->...c", 5, "c"),
}


@pytest.mark.parametrize("name", list(EINSUM_LORA))
def test_lora_einsum_dense(name):
    equation, shape, bias = EINSUM_LORA[name]
    keras.utils.set_random_seed(43)
    x, y = mnist_slice(N, flat=True)
    x = x[:, 196 : 196 + 96].reshape(N, 12, 8)
    if name == "heads_out":
        x = x.reshape(N, 12, 2, 4)
    inp = keras.Input(x.shape[1:])
    layer = keras.layers.EinsumDense(equation, shape, bias_axes=bias, activation="tanh")
    h = keras.layers.Flatten()(layer(inp))
    model = keras.Model(inp, keras.layers.Dense(10)(h))
    layer.enable_lora(2)
    randomise_lora(model)
    exact(model, x, y, {("EinsumDense", "LoraEinsumRule"), ("Dense", "DenseRule")})
    assert {v.path.split("/")[-1] for v in layer.trainable_variables} == (
        {"lora_kernel_a", "lora_kernel_b"} | ({"bias"} if bias else set())
    )


@pytest.mark.parametrize("rank", [2, 3])
def test_lora_dense_on_vectors_and_sequences_with_frozen_bias(rank):
    keras.utils.set_random_seed(44)
    x, y = mnist_slice(N, flat=True, features=24)
    if rank == 3:
        x = x.reshape(N, 4, 6)
    inp = keras.Input(x.shape[1:])
    first = keras.layers.Dense(7, activation="tanh")
    h = keras.layers.Flatten()(first(inp))
    model = keras.Model(inp, keras.layers.Dense(10)(h))
    first.enable_lora(3, lora_alpha=6)
    first.bias.trainable = False
    randomise_lora(model)
    exact(model, x, y, {("Dense", "LoraEinsumRule"), ("Dense", "DenseRule")})


def test_lora_kernel_made_trainable_again_gets_its_gradient_too():
    keras.utils.set_random_seed(45)
    x, y = mnist_slice(N, flat=True, features=24)
    inp = keras.Input(x.shape[1:])
    first = keras.layers.Dense(7, activation="tanh")
    model = keras.Model(inp, keras.layers.Dense(10)(first(inp)))
    first.enable_lora(2)
    first._kernel.trainable = True
    randomise_lora(model)
    exact(model, x, y)


def test_lora_embedding_and_lora_reversible_embedding():
    keras.utils.set_random_seed(46)
    x, y = tokens(vocab=16)
    inp = keras.Input((12,), dtype="int32")
    emb = keras.layers.Embedding(16, 6, mask_zero=True)
    h = keras.layers.GlobalAveragePooling1D()(emb(inp))
    model = keras.Model(inp, keras.layers.Dense(10)(h))
    emb.enable_lora(2)
    randomise_lora(model)
    exact(model, x, y[:, 0] % 10, {("Embedding", "LoraEmbeddingRule"), ("Dense", "DenseRule")})
    for kwargs in (
        dict(vocab=40, width=8, steps=6),
        dict(vocab=16, width=8, steps=12),
        dict(vocab=40, width=8, steps=6, tie_weights=False),
    ):
        x, y = tokens(steps=kwargs["steps"], vocab=kwargs["vocab"])
        model, table = lm(**kwargs)
        table.enable_lora(2)
        randomise_lora(model)
        exact(model, x, y)


# ---------------------------------------------------------------------------
# KerasHub layers

POSITIONS = {
    "plain": lambda layer, e: layer(e),
    "start_index": lambda layer, e: layer(e, start_index=3),
    "repeated_positions": lambda layer, e: layer(e, positions=tf.constant([0, 1, 1, 2] * 3)),
    "per_example_positions": lambda layer, e: layer(
        e, positions=tf.cast(tf.cumsum(tf.ones_like(e[..., 0]), axis=1) % 5, "int32")
    ),
    "called_twice": lambda layer, e: layer(e) + layer(e[:, :7])[:, :1],
    "rank_4_input": lambda layer, e: layer(tf.stack([e, 2 * e], axis=1))[:, 1],
}


class PositionModel(keras.Model):
    """tokens -> Embedding, + PositionEmbedding used as `POSITIONS[use]` says."""

    def __init__(self, use):
        super().__init__()
        self.use = use
        self.embedding = keras.layers.Embedding(16, 6)
        self.positions = keras_hub.layers.PositionEmbedding(sequence_length=16)
        self.dense = keras.layers.Dense(4, activation="tanh")
        self.head = keras.layers.Dense(10)

    def call(self, x):
        e = self.embedding(x)
        h = self.dense(e + POSITIONS[self.use](self.positions, e))
        return self.head(tf.reshape(h, [-1, 12 * 4]))


@pytest.mark.parametrize("name", list(POSITIONS))
def test_position_embedding(name):
    keras.utils.set_random_seed(47)
    x, y = tokens()
    exact(
        PositionModel(name),
        x,
        y[:, 0] % 10,
        {
            ("PositionEmbedding", "PositionEmbeddingRule"),
            ("Embedding", "EmbeddingRule"),
            ("Dense", "DenseRule"),
        },
    )


def test_token_and_position_embedding_is_descended_into():
    keras.utils.set_random_seed(48)
    x, y = tokens()
    inp = keras.Input((12,), dtype="int32")
    layer = keras_hub.layers.TokenAndPositionEmbedding(16, 12, 6, mask_zero=True)
    h = keras.layers.GlobalAveragePooling1D()(layer(inp))
    model = keras.Model(inp, keras.layers.Dense(10)(h))
    exact(
        model,
        x,
        y[:, 0] % 10,
        {
            ("ReversibleEmbedding", "ReversibleEmbeddingRule"),
            ("PositionEmbedding", "PositionEmbeddingRule"),
            ("Dense", "DenseRule"),
        },
    )


def _norm_classes():
    from dpfl_tf.keras.layer_rules import keras_hub as hub_rules

    found = []
    for (module, name), offset in hub_rules._NORMS.items():
        cls = hub_rules._class(module, name)
        if cls is not None:
            found.append(pytest.param(cls, offset, id=f"{module.split('.')[-2]}.{name}"))
    return found


@pytest.mark.parametrize("cls, offset", _norm_classes())
def test_keras_hub_rms_normalizations(cls, offset):
    keras.utils.set_random_seed(49)
    x, y = mnist_slice(N, flat=True)
    x = x[:, 196 : 196 + 96].reshape(N, 12, 8)
    inp = keras.Input(x.shape[1:])
    h = keras.layers.Dense(6, activation="tanh")(inp)
    norm = cls(6) if cls.__name__ == "RMSNormalization" and "layers" in cls.__module__ else cls()
    h = norm(h)
    model = keras.Model(inp, keras.layers.Dense(10)(keras.layers.Flatten()(h)))
    norm.scale.assign(np.linspace(-0.5, 0.5, 6))  # a scale that is not the initial one
    exact(model, x, y, {(cls.__name__, "OffsetScaleNormRule"), ("Dense", "DenseRule")})
    rule = layer_rules.find_rule(norm)
    assert rule.offset == offset


def test_gemma_rms_normalization_computes_one_plus_scale():
    from dpfl_tf.keras.layer_rules import keras_hub as hub_rules

    cls = hub_rules._class(hub_rules._MODELS + "gemma.rms_normalization", "RMSNormalization")
    norm = cls()
    x = np.random.default_rng(0).normal(size=(2, 3, 4)).astype("float32")
    norm.build(x.shape)
    norm.scale.assign([0.0, 1.0, -1.0, 2.0])
    xhat = x / np.sqrt(np.mean(x**2, -1, keepdims=True) + 1e-6)
    np.testing.assert_allclose(norm(x), xhat * np.array([1.0, 2.0, 0.0, 3.0]), rtol=1e-5)


def test_vit_patching_and_embedding_without_class_token():
    from keras_hub.src.models.vit.vit_layers import ViTPatchingAndEmbedding

    keras.utils.set_random_seed(50)
    x, y = mnist_slice(N, flat=False)
    inp = keras.Input(x.shape[1:])
    layer = ViTPatchingAndEmbedding((28, 28), (7, 7), 6, num_channels=1, use_class_token=False)
    h = keras.layers.Flatten()(layer(inp))
    model = keras.Model(inp, keras.layers.Dense(10)(h))
    exact(
        model,
        x,
        y,
        {("ViTPatchingAndEmbedding", "ViTPatchingAndEmbeddingRule"), ("Dense", "DenseRule")},
    )


# ---------------------------------------------------------------------------
# KerasHub models from configs


def hub_model(name, lora=False, seq=16, vocab=64):
    """A small KerasHub model (random initialisation) and one batch for it."""
    keras.utils.set_random_seed(51)
    m = keras_hub.models
    text = dict(vocabulary_size=vocab, num_layers=2, hidden_dim=16, intermediate_dim=32)
    if name == "bert":
        backbone = m.BertBackbone(num_heads=2, max_sequence_length=seq, dropout=0.0, **text)
        model = m.BertTextClassifier(backbone, num_classes=3, preprocessor=None, dropout=0.0)
    elif name == "gpt2":
        backbone = m.GPT2Backbone(num_heads=2, max_sequence_length=seq, dropout=0.0, **text)
        model = m.GPT2CausalLM(backbone, preprocessor=None)
    elif name == "gemma":
        backbone = m.GemmaBackbone(
            num_query_heads=4, num_key_value_heads=2, head_dim=4, final_logit_soft_cap=30.0, **text
        )
        model = m.GemmaCausalLM(backbone, preprocessor=None)
    elif name == "llama":
        backbone = m.LlamaBackbone(num_query_heads=4, num_key_value_heads=2, **text)
        model = m.LlamaCausalLM(backbone, preprocessor=None)
    elif name == "mistral":
        backbone = m.MistralBackbone(
            num_query_heads=4, num_key_value_heads=2, sliding_window=8, **text
        )
        model = m.MistralCausalLM(backbone, preprocessor=None)
    else:
        backbone = m.ViTBackbone(
            image_shape=(28, 28, 1),
            patch_size=7,
            num_layers=2,
            num_heads=2,
            hidden_dim=16,
            mlp_dim=32,
        )
        model = m.ViTImageClassifier(backbone, num_classes=10, preprocessor=None)
    if lora:
        backbone.enable_lora(2)
        randomise_lora(model)
    if name == "vit":
        return model, *mnist_slice(4, flat=False)
    ids, targets = tokens(n=4, steps=seq, vocab=vocab)
    x = {"token_ids": ids, "padding_mask": np.ones_like(ids)}
    if name == "bert":
        x["segment_ids"] = np.zeros_like(ids)
        return model, x, targets[:, 0] % 3
    return model, x, targets


MODELS = ["bert", "gpt2", "gemma", "llama", "mistral", "vit"]


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("name", MODELS)
def test_keras_hub_model_is_exact_and_fast(name, lora):
    model, x, y = hub_model(name, lora)
    report = exact(model, x, y)
    rules = {rule for _, _, rule in report.plan}
    if lora:  # only the LoRA factors (and biases) train, all through the LoRA rule
        assert "LoraEinsumRule" in rules
        assert all(
            "lora" in v.path or v.path.endswith("bias") for v in model.backbone.trainable_variables
        )
    elif name != "vit":  # the token table is one tied (or untied) ReversibleEmbedding
        assert "ReversibleEmbeddingRule" in rules


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("name", MODELS)
def test_keras_hub_model_trains_with_fit_exactly(name, lora):
    model, x, y = hub_model(name, lora)
    error, _ = fit_error(model, x, y, loss())
    assert error <= TOL


def test_hub_rules_compile_under_xla():
    model, x, y = hub_model("gemma", lora=False)
    model_l, xl, yl = hub_model("gpt2", lora=True)
    for m, xs, ys in ((model, x, y), (model_l, xl, yl)):
        per_example = PerExampleGradients(m, loss())
        ones = tf.ones(len(ys))

        def run(xs, ys):
            return per_example.compute(xs, ys, ones, lambda sq: [tf.sqrt(s) for s in sq])[0]

        eager = run(xs, tf.constant(ys))
        xla = tf.function(run, jit_compile=True)(
            tf.nest.map_structure(tf.constant, xs), tf.constant(ys)
        )
        for a, b in zip(eager, xla):
            # float32 sums whose terms reach ~30: XLA's other order of summation moves
            # small entries by ~1e-6 (seen on an AVX-512 machine), so the absolute
            # tolerance follows the tensor's scale; a wrong rule is off by O(1)
            scale = max(1.0, float(np.max(np.abs(b))))
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6 * scale)
        assert not {type(r).__name__ for _, r in plan_layers(m).values()} & SLOW
