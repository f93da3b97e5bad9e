"""A model-zoo fuzzer: seeded random Keras models, each trained one DP-SGD lot
with `DPModel.fit` (no noise) and compared with a brute-force per-example loop.

The property (issue 31): every model `fit` accepts trains exactly (relative
error of the weight update <= 1e-5 in float32; mixed-precision models are held
to their precision) or is refused with a clear error.  Each model is one seed:
an input kind (vectors, sequences, images, tokens, two inputs), 1-4 blocks of
layer families (Dense, EinsumDense, convolutions, recurrent layers,
attention, normalisations, embeddings incl. a tied ReversibleEmbedding head,
KerasHub layers when installed, LoRA, custom layers without a rule,
subclasses of Dense with and without an overridden `call`, frozen layers),
layer reuse, branches, sub-models, masks, a subclassed wrapper, dtype
policies, a loss and a batch size.  Outcomes:

  exact     fit trained and the update matches the per-example loop
  refused   fit (or compile) raised an error from dpfl_tf before any lot was
            applied (weights unchanged, ledger empty); the message is kept
  WRONG     fit trained but the update differs from the per-example loop
  CRASH     fit raised an error from TensorFlow/Keras internals (not a clear
            refusal), or changed the weights and then raised
  precision a mixed-precision model missed its tolerance, and the same model
            in float32 is exact: the 16-bit rounding of batched against
            one-example computation, not a rule
  invalid   the generator made a model Keras itself cannot train with that
            loss (the per-example loop fails too): not a library result

Each WRONG or CRASH model says which of its features are expected to be fixed
by the refusals being added to the library (a subclass that overrides `call`
inheriting its parent's rule; losses and layers that mix the examples of a
batch).

    python experiments/fuzz_models.py --models 500 --seed 0   # results/fuzz_models.json
    python experiments/fuzz_models.py --models 500 --seed 0 --resume   # only the seeds
        # of the range not yet in the results file (a run stopped part-way)
    python experiments/fuzz_models.py --models 20 --seed 3 --output /tmp/f.json
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import sys
import time
import traceback

import numpy as np
from _common import RESULTS, command_line, commit_of, run_writer

TOLERANCE = {"float32": 1e-5, "mixed_float16": 2e-2, "mixed_bfloat16": 1e-1}
# features whose wrong results the library's coming refusals address
EXPECTED_FIX = {
    "overrides_call": "subclass overriding call inherits its parent's rule (-> fallback)",
    "batch_mixing_layer": "layer mixing the examples of a batch (-> refused)",
    "batch_mixing_loss": "loss mixing the examples of a batch (-> refused)",
}


@dataclasses.dataclass
class Case:
    """One generated model and its data."""

    seed: int
    model: object
    x: object
    y: np.ndarray
    loss: object
    policy: str
    description: list
    features: set
    batch_size: int | None = None
    fast_gradients: bool = True


# ---------------------------------------------------------------------------
# custom layers


@functools.lru_cache(maxsize=None)
def _custom_layers():
    """(Gate, NamedDense, ScaledDense, BatchCentred): one class object each per
    process, so a rule can be registered for them."""
    import keras
    import tensorflow as tf

    class Gate(keras.layers.Layer):
        """No rule: y = tanh(x w) + v^2 elementwise (per-layer fallback)."""

        def build(self, shape):
            self.w, self.v = (
                self.add_weight(shape=(shape[-1],), initializer="random_normal") for _ in range(2)
            )

        def call(self, x):
            return tf.tanh(x * self.w) + tf.square(self.v)

    class NamedDense(keras.layers.Dense):
        """A subclass that does not override call (Dense's rule is right)."""

        def get_config(self):
            return super().get_config()

    class ScaledDense(keras.layers.Dense):
        """A subclass whose call is another function: 3 Dense(x) + 1."""

        def call(self, inputs, training=None):
            return super().call(inputs) * 3.0 + 1.0

    class BatchCentred(keras.layers.Layer):
        """Mixes the batch: x - mean over the batch."""

        def call(self, x):
            return x - tf.reduce_mean(x, axis=0, keepdims=True)

    return Gate, NamedDense, ScaledDense, BatchCentred


# ---------------------------------------------------------------------------
# the generator


class _Builder:
    """Builds one random functional model block by block from a seed."""

    def __init__(self, seed: int):
        import keras

        self.k = keras
        self.rng = np.random.default_rng(seed)
        self.desc: list[str] = []
        self.features: set[str] = set()
        (self.Gate, self.NamedDense, self.ScaledDense, self.BatchCentred) = _custom_layers()
        try:
            import keras_hub

            self.hub = keras_hub
        except ImportError:
            self.hub = None

    def pick(self, options):
        return options[int(self.rng.integers(len(options)))]

    def chance(self, p: float) -> bool:
        return bool(self.rng.random() < p)

    def small(self, low=2, high=6) -> int:
        return int(self.rng.integers(low, high + 1))

    def note(self, text: str, *features: str) -> None:
        self.desc.append(text)
        self.features.update(features)

    # -- blocks on vectors [B, F] ------------------------------------------
    def vector_block(self, h):
        L = self.k.layers
        units = self.small(3, 8)
        choice = self.pick(
            [
                "dense",
                "dense",
                "einsum",
                "layernorm",
                "rms",
                "custom",
                "named",
                "scaled",
                "shared",
                "branch",
                "submodel",
                "lambda",
                "batch_mix",
                "frozen",
                "batchnorm",
                "lora",
                "float64",
            ]
        )
        act = self.pick([None, "tanh", "relu", "gelu"])
        if choice == "dense":
            self.note(f"Dense({units}, {act})")
            return L.Dense(units, activation=act)(h)
        if choice == "einsum":
            self.note(f"EinsumDense(ab,bc->ac, {units})")
            return L.EinsumDense("ab,bc->ac", units, bias_axes="c", activation=act)(h)
        if choice == "layernorm":
            self.note("LayerNormalization")
            return L.LayerNormalization()(h)
        if choice == "rms":
            self.note("RMSNormalization")
            return L.RMSNormalization()(h)
        if choice == "custom":
            self.note("Gate (custom layer, no rule)", "custom_layer")
            return self.Gate()(h)
        if choice == "named":
            self.note(f"NamedDense({units}) (Dense subclass, call not overridden)")
            return self.NamedDense(units, activation=act)(h)
        if choice == "scaled":
            self.note(f"ScaledDense({units}) (Dense subclass overriding call)", "overrides_call")
            return self.ScaledDense(units, activation="tanh")(h)
        if choice == "shared":
            layer = L.Dense(h.shape[-1], activation="tanh")
            self.note(f"the same Dense({h.shape[-1]}) called twice", "reuse")
            return layer(layer(h))
        if choice == "branch":
            a = L.Dense(units, activation="tanh")(h)
            b = L.Dense(units)(h)
            merge = self.pick(["add", "concat", "multiply"])
            self.note(f"two Dense({units}) branches merged by {merge}", "branch")
            return {"add": L.Add, "concat": L.Concatenate, "multiply": L.Multiply}[merge]()([a, b])
        if choice == "submodel":
            inner = self.k.Sequential(
                [self.k.Input((h.shape[-1],)), L.Dense(units, activation="tanh"), L.Dense(units)]
            )
            self.note(f"a Sequential sub-model (Dense({units}) x 2)", "submodel")
            return inner(h)
        if choice == "lambda":
            self.note("Lambda(2 tanh(x)) (per example)")
            return L.Lambda(lambda t: 2.0 * self.k.ops.tanh(t))(h)
        if choice == "batch_mix":
            if self.chance(0.5):
                self.note("Lambda(x - mean over the batch)", "batch_mixing_layer")
                return L.Lambda(lambda t: t - self.k.ops.mean(t, axis=0, keepdims=True))(h)
            self.note("BatchCentred (custom layer: x - mean over the batch)", "batch_mixing_layer")
            return self.BatchCentred()(h)
        if choice == "frozen":
            layer = L.Dense(units, activation=act)
            layer.trainable = False
            self.note(f"frozen Dense({units})", "frozen")
            return layer(h)
        if choice == "batchnorm":
            self.note("BatchNormalization (trainable)", "batchnorm")
            return L.BatchNormalization()(h)
        if choice == "lora":
            layer = L.Dense(units, activation=act)
            out = layer(h)
            layer.enable_lora(2)
            layer.lora_kernel_b.assign(self.rng.normal(size=layer.lora_kernel_b.shape) * 0.3)
            self.note(f"Dense({units}) with LoRA rank 2", "lora")
            return out
        self.note(f"Dense({units}) in float64", "float64_layer")
        return L.Dense(units, activation="tanh", dtype="float64")(h)

    def conv_variant(self, h, choice: str, units: int, dims: str):
        """A depthwise, separable or transposed convolution of `dims` ("1D", "2D")."""
        L = self.k.layers
        layer, text = {
            "depthwise": (
                lambda: getattr(L, "DepthwiseConv" + dims)(3, padding="same"),
                f"DepthwiseConv{dims}(3, same)",
            ),
            "separable": (
                lambda: getattr(L, "SeparableConv" + dims)(units, 3, padding="same"),
                f"SeparableConv{dims}({units}, 3, same)",
            ),
            "transpose": (
                lambda: getattr(L, f"Conv{dims}Transpose")(units, 2, strides=2),
                f"Conv{dims}Transpose({units}, 2, strides 2)",
            ),
        }[choice]
        self.note(text)
        return layer()(h)

    # -- blocks on sequences [B, T, F] --------------------------------------
    def sequence_block(self, h):
        L = self.k.layers
        f = h.shape[-1]
        units = self.small(2, 6)
        choices = [
            "dense",
            "einsum",
            "conv",
            "depthwise",
            "separable",
            "transpose",
            "rnn",
            "bidirectional",
            "attention",
            "layernorm",
            "groupnorm",
            "timedistributed",
            "shared",
            "lambda",
        ]
        if self.hub is not None:
            choices += ["position", "hub_norm"]
        choice = self.pick(choices)
        if choice == "dense":
            self.note(f"Dense({units}) on positions")
            return L.Dense(units, activation="tanh")(h)
        if choice == "einsum":
            eq = self.pick(["abc,cd->abd", "abc,cde->abde"])
            shape = (h.shape[1], units) if eq == "abc,cd->abd" else (h.shape[1], 2, units)
            out = L.EinsumDense(eq, shape, bias_axes=eq[-1])(h)
            self.note(f"EinsumDense({eq})")
            return out if eq == "abc,cd->abd" else L.Reshape((h.shape[1], 2 * units))(out)
        if choice == "conv":
            kw = self.pick(
                [
                    dict(padding="causal", dilation_rate=2),
                    dict(padding="same"),
                    dict(padding="same", strides=2),
                    dict(padding="same", groups=1),
                ]
            )
            self.note(f"Conv1D({units}, 3, {kw})")
            return L.Conv1D(units, 3, activation="relu", **kw)(h)
        if choice in ("depthwise", "separable", "transpose"):
            return self.conv_variant(h, choice, units, "1D")
        if choice == "rnn":
            cls = self.pick([L.LSTM, L.GRU, L.SimpleRNN])
            self.note(f"{cls.__name__}({units}, return_sequences)")
            return cls(units, return_sequences=True)(h)
        if choice == "bidirectional":
            self.note(f"Bidirectional(GRU({units}), return_sequences)")
            return L.Bidirectional(L.GRU(units, return_sequences=True))(h)
        if choice == "attention":
            heads = self.small(1, 2)
            self.note(f"MultiHeadAttention({heads} heads x 3) self-attention + residual")
            return h + L.MultiHeadAttention(heads, 3)(h, h)
        if choice == "layernorm":
            self.note("LayerNormalization")
            return L.LayerNormalization()(h)
        if choice == "groupnorm":
            groups = self.pick([g for g in (1, 2, 3) if f % g == 0])
            self.note(f"GroupNormalization({groups})")
            return L.GroupNormalization(groups)(h)
        if choice == "timedistributed":
            self.note(f"TimeDistributed(Dense({units})) (fallback)", "fallback_layer")
            return L.TimeDistributed(L.Dense(units))(h)
        if choice == "shared":
            layer = L.Dense(f, activation="tanh")
            self.note(f"the same Dense({f}) called twice on positions", "reuse")
            return layer(layer(h))
        if choice == "lambda":
            self.note("Lambda(x * x) (per example)")
            return L.Lambda(lambda t: t * t)(h)
        if choice == "position":
            self.note("+ keras_hub PositionEmbedding", "keras_hub")
            return h + self.hub.layers.PositionEmbedding(h.shape[1])(h)
        norm = self.pick(["gemma", "llama"])
        self.note(f"KerasHub {norm} RMS normalisation", "keras_hub")
        from dpfl_tf.keras.layer_rules import keras_hub as hub_rules

        module, name = {
            "gemma": (hub_rules._MODELS + "gemma.rms_normalization", "RMSNormalization"),
            "llama": (hub_rules._MODELS + "llama.llama_layernorm", "LlamaLayerNorm"),
        }[norm]
        return hub_rules._class(module, name)()(h)

    def image_block(self, h):
        L = self.k.layers
        units = self.small(2, 5)
        choice = self.pick(
            [
                "conv",
                "conv_stride",
                "depthwise",
                "separable",
                "transpose",
                "groupnorm",
                "layernorm",
                "pool",
            ]
        )
        if choice == "conv":
            groups = self.pick([g for g in (1, 2) if h.shape[-1] % g == 0 and units % g == 0])
            self.note(f"Conv2D({units}, 3, same, groups {groups})")
            return L.Conv2D(units, 3, padding="same", groups=groups, activation="relu")(h)
        if choice == "conv_stride":
            self.note(f"Conv2D({units}, 3, strides 2, dilation 1)")
            return L.Conv2D(units, 3, strides=2, activation="tanh")(h)
        if choice in ("depthwise", "separable", "transpose"):
            return self.conv_variant(h, choice, units, "2D")
        if choice == "groupnorm":
            self.note("GroupNormalization(1)")
            return L.GroupNormalization(1)(h)
        if choice == "layernorm":
            self.note("LayerNormalization")
            return L.LayerNormalization()(h)
        self.note("MaxPooling2D(2)")
        return L.MaxPooling2D(2, padding="same")(h)

    # -- the model -----------------------------------------------------------
    def inputs(self, n: int):
        """(inputs, first hidden tensor, kind, x, extras)."""
        L, rng = self.k.layers, self.rng
        kind = self.pick(["vector", "vector", "sequence", "image", "tokens", "tokens", "two"])
        if kind == "vector":
            f = self.small(3, 10)
            x = rng.normal(size=(n, f)).astype("float32")
            inp = self.k.Input((f,))
            self.note(f"input vectors [{f}]")
            return inp, inp, "vector", x, {}
        if kind == "sequence":
            t, f = self.small(3, 7), self.small(2, 6)
            x = rng.normal(size=(n, t, f)).astype("float32")
            inp = self.k.Input((t, f))
            self.note(f"input sequences [{t}, {f}]")
            return inp, inp, "sequence", x, {}
        if kind == "image":
            s, c = self.small(5, 9), self.small(1, 3)
            x = rng.normal(size=(n, s, s, c)).astype("float32")
            inp = self.k.Input((s, s, c))
            self.note(f"input images [{s}, {s}, {c}]")
            return inp, inp, "image", x, {}
        if kind == "two":
            f1, f2 = self.small(2, 6), self.small(2, 6)
            x = [
                rng.normal(size=(n, f1)).astype("float32"),
                rng.normal(size=(n, f2)).astype("float32"),
            ]
            a, b = self.k.Input((f1,)), self.k.Input((f2,))
            shared = self.chance(0.5) and f1 == f2
            if shared:
                layer = L.Dense(4, activation="tanh")
                h = L.Add()([layer(a), layer(b)])
                self.note(
                    f"two inputs [{f1}] [{f2}] through one shared Dense(4), added",
                    "reuse",
                    "multi_input",
                )
            else:
                h = L.Concatenate()([L.Dense(4)(a), L.Dense(3)(b)])
                self.note(f"two inputs [{f1}] [{f2}], a Dense each, concatenated", "multi_input")
            return [a, b], h, "vector", x, {}
        t, vocab, width = self.small(3, 8), self.small(6, 24), self.small(3, 6)
        x = rng.integers(0, vocab, size=(n, t)).astype("int32")
        inp = self.k.Input((t,), dtype="int32")
        style = self.pick(
            ["embedding", "masked", "reversible", "lora"]
            + (["token_and_position"] if self.hub is not None else [])
        )
        extras = {"vocab": vocab}
        if style == "embedding":
            h = L.Embedding(vocab, width)(inp)
            self.note(f"tokens [{t}] (vocab {vocab}) -> Embedding({width})")
        elif style == "masked":
            h = L.Embedding(vocab, width, mask_zero=True)(inp)
            self.note(f"tokens [{t}] (vocab {vocab}) -> Embedding({width}, mask_zero)", "mask")
        elif style == "reversible":
            table = L.ReversibleEmbedding(vocab, width, tie_weights=self.chance(0.8))
            h = table(inp)
            extras["table"] = table
            self.note(
                f"tokens [{t}] (vocab {vocab}) -> ReversibleEmbedding({width}, "
                f"tie_weights={table.tie_weights})",
                "reversible",
            )
        elif style == "lora":
            layer = L.Embedding(vocab, width)
            h = layer(inp)
            layer.enable_lora(2)
            layer.lora_embeddings_b.assign(rng.normal(size=layer.lora_embeddings_b.shape))
            self.note(
                f"tokens [{t}] (vocab {vocab}) -> Embedding({width}) with LoRA rank 2", "lora"
            )
        else:
            h = self.hub.layers.TokenAndPositionEmbedding(vocab, t, width)(inp)
            self.note(
                f"tokens [{t}] (vocab {vocab}) -> keras_hub TokenAndPositionEmbedding({width})",
                "keras_hub",
            )
        return inp, h, "sequence", x, extras

    def build(self, n: int):
        """(model, x, y, loss, policy)."""
        L, rng = self.k.layers, self.rng
        inp, h, kind, x, extras = self.inputs(n)
        for _ in range(self.small(1, 3)):
            h = {
                "vector": self.vector_block,
                "sequence": self.sequence_block,
                "image": self.image_block,
            }[kind](h)
        classes = self.small(2, 5)
        per_token = kind == "sequence" and self.chance(0.35)
        if per_token:
            table = extras.get("table")
            if table is not None and table.tie_weights and self.chance(0.8):
                h = L.Dense(table.output_dim, activation="tanh")(h)
                out = table(h, reverse=True)
                classes = extras["vocab"]
                self.note("per-token logits from the tied ReversibleEmbedding head", "tied_head")
            else:
                out = L.Dense(classes)(h)
                self.note(f"per-token Dense({classes}) head")
            y = rng.integers(0, classes, size=(n, out.shape[1]))  # strides change T
            loss = self.k.losses.SparseCategoricalCrossentropy(from_logits=True)
            self.note("loss: per-token SparseCategoricalCrossentropy")
        else:
            if kind == "sequence":
                pool = self.pick(["avg", "max", "flatten", "lstm"])
                h = {
                    "avg": L.GlobalAveragePooling1D(),
                    "max": L.GlobalMaxPooling1D(),
                    "flatten": L.Flatten(),
                    "lstm": L.LSTM(4),
                }[pool](h)
                self.note(
                    {
                        "avg": "GlobalAveragePooling1D",
                        "max": "GlobalMaxPooling1D",
                        "flatten": "Flatten",
                        "lstm": "LSTM(4)",
                    }[pool]
                )
            elif kind == "image":
                h = self.pick([L.GlobalAveragePooling2D, L.Flatten])()(h)
                self.note("pooled")
            out = L.Dense(classes, dtype="float32")(h)
            loss, y = self.loss(n, classes)
        model = self.k.Model(inp, out)
        if self.chance(0.15):
            model = _wrap(self.k, model)
            self.note("wrapped in a subclassed keras.Model", "subclassed_model")
        return model, x, y, loss

    def loss(self, n: int, classes: int):
        k, rng = self.k, self.rng
        name = self.pick(
            ["scce", "scce", "cce", "mse", "huber", "bce", "cosine", "function", "circle", "scalar"]
        )
        labels = rng.integers(0, classes, size=n)
        self.note(
            f"loss: {name}",
            *({"circle": ["batch_mixing_loss"], "scalar": ["scalar_loss"]}.get(name, [])),
        )
        if name == "scce":
            return k.losses.SparseCategoricalCrossentropy(from_logits=True), labels
        if name == "cce":
            return (
                k.losses.CategoricalCrossentropy(from_logits=True),
                np.eye(classes, dtype="float32")[labels],
            )
        if name in ("mse", "huber", "cosine"):
            cls = {
                "mse": k.losses.MeanSquaredError,
                "huber": k.losses.Huber,
                "cosine": k.losses.CosineSimilarity,
            }[name]
            return cls(), rng.normal(size=(n, classes)).astype("float32")
        if name == "bce":
            return (
                k.losses.BinaryCrossentropy(from_logits=True),
                rng.integers(0, 2, size=(n, classes)).astype("float32"),
            )
        if name == "function":

            def squared_error(y_true, y_pred):
                return k.ops.mean(k.ops.square(y_true - y_pred), axis=-1)

            return squared_error, rng.normal(size=(n, classes)).astype("float32")
        if name == "circle":  # two classes, so examples have positive pairs
            return k.losses.Circle(), rng.integers(0, 2, size=n)

        def mean_loss(y_true, y_pred):  # reduced to a scalar: no per-example values
            return k.ops.mean(k.ops.square(y_true - y_pred))

        return mean_loss, rng.normal(size=(n, classes)).astype("float32")


def _wrap(keras, inner):
    class Wrapper(keras.Model):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def call(self, x, training=None):
            return self.inner(x, training=training)

    return Wrapper(inner)


def generate(seed: int, policy: str | None = None) -> Case:
    """The model of `seed`: same seed, same model (architecture, weights, data);
    `policy` overrides the seed's precision policy (the same model in float32)."""
    import keras

    rng = np.random.default_rng([seed, 1])
    drawn = str(rng.choice(["float32"] * 8 + ["mixed_float16", "mixed_bfloat16"]))
    policy = policy or drawn
    keras.mixed_precision.set_global_policy(policy)
    keras.utils.set_random_seed(seed)
    builder = _Builder(seed)
    n = int(rng.integers(2, 7))
    model, x, y, loss = builder.build(n)
    batch_size = int(rng.integers(1, n)) if n > 2 and rng.random() < 0.2 else None
    fast = bool(rng.random() >= 0.08)
    if policy != "float32":
        builder.note(f"policy {policy}", "mixed_precision")
    if batch_size:
        builder.note(f"physical batch {batch_size} < lot {n}", "batches")
    if not fast:
        builder.note("DPModel(fast_gradients=False)", "generic_path")
    builder.note(f"{n} examples")
    return Case(seed, model, x, y, loss, policy, builder.desc, builder.features, batch_size, fast)


# ---------------------------------------------------------------------------
# running one model


def _raised_by_dpfl(error: BaseException) -> bool:
    """A refusal: raised (innermost frame, with Keras's and TensorFlow's
    traceback filtering off) inside the dpfl_tf package as a ValueError /
    TypeError / NotImplementedError."""
    frames = traceback.extract_tb(error.__traceback__)
    package = os.sep + "dpfl_tf" + os.sep
    return (
        bool(frames)
        and package in frames[-1].filename
        and isinstance(error, (ValueError, TypeError, NotImplementedError))
    )


def _message(error: BaseException) -> str:
    lines = [line for line in str(error).strip().splitlines() if line.strip()]
    return f"{type(error).__name__}: {(lines or [''])[0][:400]}"


def run_case(seed: int, policy: str | None = None) -> dict:
    """One model's row (see the module docstring); `policy` as in `generate`.  A
    mixed-precision model whose update misses its tolerance is run again in
    float32: if that is exact, the miss is the precision's ("precision"), not a
    rule's."""
    import keras
    import tensorflow as tf

    from dpfl_tf.keras import exactness
    from dpfl_tf.keras.model import DPModel

    keras.config.disable_traceback_filtering()  # the frame that raised is the real one
    tf.debugging.disable_traceback_filtering()
    started = time.perf_counter()
    row = {"seed": seed}
    try:
        case = generate(seed, policy)
    except Exception as error:  # a generator bug, not a library result
        keras.mixed_precision.set_global_policy("float32")
        return dict(row, outcome="invalid", message=_message(error))
    row.update(
        description="; ".join(case.description),
        features=sorted(case.features),
        policy=case.policy,
        examples=len(case.y),
    )
    tolerance = TOLERANCE[case.policy]
    try:
        try:
            expected, clip, lr = exactness.noiseless_step(case.model, case.x, case.y, case.loss)
            reference_error = None
        except Exception as error:
            expected, clip, lr, reference_error = None, 1.0, 1.0, error
        before = [np.asarray(v, np.float64) for v in case.model.trainable_variables]
        dp = DPModel(case.model, fast_gradients=case.fast_gradients)
        try:
            exactness.fit_once(dp, case.x, case.y, case.loss, clip, lr, batch_size=case.batch_size)
            row["plan"] = [list(p) for p in exactness.plan(case.model, dp._per_example)]
        except Exception as error:
            unchanged = all(
                np.array_equal(np.asarray(v, np.float64), b)
                for v, b in zip(case.model.trainable_variables, before)
            )
            untouched = unchanged and dp.lots_applied == 0 and dp.lots_computed == 0
            row.update(
                message=_message(error),
                weights_unchanged=unchanged,
                ledger_empty=dp.lots_computed == 0,
            )
            row["outcome"] = "refused" if _raised_by_dpfl(error) and untouched else "CRASH"
            if (
                row["outcome"] == "CRASH"
                and reference_error is not None
                and not _raised_by_dpfl(reference_error)
            ):  # Keras rejects it too
                row.update(outcome="invalid", reference_message=_message(reference_error))
            if row["outcome"] == "CRASH":
                row["traceback"] = traceback.format_exception(error)[-6:]
        else:
            if reference_error is not None:
                row.update(
                    outcome="CRASH",
                    message="fit trained a model whose per-example "
                    f"loop fails: {_message(reference_error)}",
                )
            else:
                error = exactness.relative_change(case.model, before, expected)
                # a zero reference step cannot tell a wrong update from a right one
                row["zero_step"] = not any(np.any(e) for e in expected)
                row.update(
                    error=error,
                    tolerance=tolerance,
                    outcome="exact" if error <= tolerance else "WRONG",
                    lots_applied=int(dp.lots_applied),
                )
    finally:
        keras.mixed_precision.set_global_policy("float32")
        keras.backend.clear_session()
    if row["outcome"] == "WRONG" and case.policy != "float32":
        twin = run_case(seed, policy="float32")
        row["float32_twin"] = {k: twin.get(k) for k in ("outcome", "error")}
        if twin["outcome"] == "exact":
            row["outcome"] = "precision"
    if row["outcome"] in ("WRONG", "CRASH"):
        row["expected_fix"] = [EXPECTED_FIX[f] for f in row["features"] if f in EXPECTED_FIX]
    row["seconds"] = round(time.perf_counter() - started, 2)
    return row


def summarise(rows: list) -> dict:
    counts = {}
    for r in rows:
        counts[r["outcome"]] = counts.get(r["outcome"], 0) + 1
    bad = [r for r in rows if r["outcome"] in ("WRONG", "CRASH")]
    return {
        "counts": counts,
        "exact_with_zero_step": sum(
            1 for r in rows if r.get("zero_step") and r["outcome"] == "exact"
        ),
        "wrong_or_crash_expected_to_be_fixed": sum(1 for r in bad if r["expected_fix"]),
        "wrong_or_crash_not_explained": [
            {
                "seed": r["seed"],
                "outcome": r["outcome"],
                "description": r["description"],
                "message": r.get("message"),
                "error": r.get("error"),
            }
            for r in bad
            if not r["expected_fix"]
        ],
    }


def _worker(seeds: list, timeout: float) -> tuple[list, str]:
    """Runs seeds in a child process (bounded memory); its rows (written after
    each model) and, if it died or timed out, why."""
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--seeds", *map(str, seeds)]
    rows, why = run_writer(cmd, timeout)
    return rows or [], why[-600:]


def run_seeds(seeds: list, timeout: float) -> list:
    """Every seed's row; a model that kills or hangs its worker is a CRASH and
    the rest run in a new worker."""
    rows = []
    while seeds:
        done, why = _worker(seeds, timeout)
        rows += done
        if len(done) < len(seeds):
            dead = seeds[len(done)]
            rows.append(
                {
                    "seed": dead,
                    "outcome": "CRASH",
                    "description": "?",
                    "message": f"worker died: {why}",
                    "features": [],
                    "expected_fix": [],
                }
            )
            seeds = seeds[len(done) + 1 :]
        else:
            seeds = []
    return rows


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", type=int, default=500)
    p.add_argument("--seed", type=int, default=0, help="first seed; models are seed, seed+1, ...")
    p.add_argument("--chunk", type=int, default=25, help="models per child process")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per chunk")
    p.add_argument("--output", default=os.path.join(RESULTS, "fuzz_models.json"))
    p.add_argument(
        "--rerun",
        nargs="+",
        metavar="OUTCOME",
        help="run again the models of --output with these outcomes (after a fix) "
        "and replace their rows; the file records which and at what commit",
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="keep the models already in --output and run only the seeds of the range "
        "that are not there",
    )
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--seeds", type=int, nargs="*", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    from dpfl_tf._io import atomic_write_json

    if args.worker:
        rows = []
        for s in args.seeds:
            rows.append(run_case(s))
            atomic_write_json(args.output, rows)
        return {}

    import keras
    import tensorflow as tf

    seeds = list(range(args.seed, args.seed + args.models))
    rows, started, total, earlier = [], time.perf_counter(), len(seeds), {}
    if args.resume and os.path.exists(args.output):
        with open(args.output) as f:
            earlier = json.load(f)
        rows = [r for r in earlier["models"] if r["seed"] in set(seeds)]
        done = {r["seed"] for r in rows}
        seeds = [s for s in seeds if s not in done]
        print(f"resuming: {len(done)} models in {args.output}, {len(seeds)} to run", flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    command, commit = command_line(), commit_of()
    if args.rerun:
        with open(args.output) as f:
            report = json.load(f)
        seeds = [r["seed"] for r in report["models"] if r["outcome"] in args.rerun]
        again = {r["seed"]: r for r in run_seeds(seeds, args.timeout)}
        report["models"] = [again.get(r["seed"], r) for r in report["models"]]
        report["summary"] = summarise(report["models"])
        report.setdefault("reruns", []).append(
            {"command": command, "commit": commit, "outcomes": args.rerun, "seeds": seeds}
        )
        atomic_write_json(args.output, report)
        print(json.dumps(report["summary"], indent=1))
        return report
    for i in range(0, len(seeds), args.chunk):
        rows += run_seeds(seeds[i : i + args.chunk], args.timeout)
        report = {
            "command": command,
            "commit": commit,
            "complete": len(rows) == total,
            **(
                {"resumed_from": {"commit": earlier.get("commit"), "models": total - len(seeds)}}
                if earlier
                else {}
            ),
            "property": "every model fit accepts trains exactly (relative error of the "
            "weight update <= tolerance) or is refused with a clear error",
            "tolerance": TOLERANCE,
            "expected_fix": EXPECTED_FIX,
            "tensorflow": tf.__version__,
            "keras": keras.__version__,
            "wall_seconds": round(
                earlier.get("wall_seconds", 0.0) + time.perf_counter() - started, 1
            ),
            **({"reruns": earlier["reruns"]} if earlier.get("reruns") else {}),
            "summary": summarise(rows),
            "models": rows,
        }
        atomic_write_json(args.output, report)  # after every chunk: a stopped run keeps its rows
        print(
            f"{len(rows)}/{total} models, {report['wall_seconds']:.0f} s: "
            f"{report['summary']['counts']}",
            flush=True,
        )
    print(json.dumps(report["summary"], indent=1))
    return report


if __name__ == "__main__":
    main()
