#!/usr/bin/env python3
"""tensorflow-privacy (peer library) fast clipping on the layers issue's transformer.

Run with the interpreter of the separate tensorflow-privacy environment
(TensorFlow 2.15 / Keras 2 = tf.keras, tensorflow-privacy 0.9.0; see the
README); experiments/benchmark_layers.py calls it once per configuration, e.g.

    /work/peer_envs/tfp/bin/python experiments/peers/tfp_layers.py \
        --model transformer --implementation fast_clipping \
        --examples 25000 --lot-size 256 --epochs 3 --repeats 1 \
        --output /tmp/tfp_transformer_fast_clipping.json

One configuration is measured per process, so the reported peak resident
memory belongs to that configuration alone.  Every repeat builds a fresh
model and trains it for ``--epochs`` epochs; the first epoch of each repeat
(tracing, XLA compilation) is a warm-up and is not timed.

Only the transformer is built here: it is the one model of
experiments/benchmark_layers.py whose trainable layers all have a rule in
tensorflow-privacy 0.9.0's fast-gradient-clipping registry functions (Dense,
EinsumDense, Embedding, LayerNormalization, MultiHeadAttention).  Conv1D,
Conv2D, GroupNormalization and LSTM have none; for such a model its DPModel
silently takes its vectorized_map per-example-gradient path instead.

  transformer   Embedding(20,000, 128) + fixed sinusoidal positions, 2 post-LN
                blocks (MultiHeadAttention 4 heads x 32, LayerNormalization,
                Dense FFN 256 with ReLU), mean pooling, Dense(2); sequence 128;
                the layer order of benchmark_layers.build_model, 2,825,218
                trainable parameters

Implementations:

  nonprivate      plain tf.keras Model.fit at its defaults (no XLA, as the
                  Keras 3 rows: Keras 3's jit_compile='auto' is off on a
                  CPU-only machine), legacy SGD, batches of lot size
  fast_clipping   tensorflow_privacy DPModel (make_dp_model_class(tf.keras.Model))
                  with a layer registry holding the package's registry
                  functions for every layer type of the model: per-example
                  gradient norms from a first forward/backward pass (ghost
                  norms: Goodfellow 2015, arXiv:1510.01799; Lee & Kifer 2020,
                  arXiv:2009.03106), then a second one for the gradient of the
                  loss reweighted by min(1, C / norm_i); N(0, (C sigma / B)^2)
                  added to that mean gradient;
                  train_step compiled with XLA (DPModel's default use_xla=True)

Note that tensorflow-privacy's ``make_default_layer_registry()`` in 0.9.0
holds only Dense and Embedding, so with it alone this model would fall back
(silently) to per-example gradients; the rules for EinsumDense,
LayerNormalization and MultiHeadAttention ship in the package but must be
inserted by the caller.  The row records which path was taken, and a run
that did not take the fast path fails instead of being timed under this name.

Sampling is tensorflow-privacy's (whatever batches fit is given): the data
are shuffled every epoch and cut into fixed batches of exactly lot size
(remainder dropped), not Poisson-sampled lots.

This file is standalone but for _peer_common.py beside it (the architecture
constants and the data recipe of experiments/benchmark_layers.py, which
imports them from there too): it must not import the project's own package,
since it runs under a different TensorFlow and Keras version.
"""

import argparse
import os
import platform
import sys
import time

import numpy as np
from _peer_common import (
    BLOCKS,
    FFN,
    HEADS,
    L2_NORM_CLIP,
    LEARNING_RATE,
    NOISE_MULTIPLIER,
    SEQ_LEN,
    TEXT_CLASSES,
    VOCAB,
    WIDTH,
    check_run_args,
    finish,
    layers_data,
    limit_address_space,
    median_seconds,
    peak_memory_mb,
    positions,
    record_repeat,
    run_guarded,
)

MODELS = ("transformer",)

IMPLEMENTATIONS = {
    "nonprivate": "plain tf.keras Model.fit, legacy SGD, shuffled batches of lot size",
    "fast_clipping": (
        "tensorflow_privacy DPModel (make_dp_model_class(tf.keras.Model)), "
        "fast gradient clipping with a layer registry covering every "
        "trainable layer, legacy SGD, shuffled batches of lot size"
    ),
}

# How each registry function of tensorflow-privacy 0.9.0 gets a layer's
# per-example squared gradient norms (read from its registry_functions/).
REGISTRY_RULES = {
    "Embedding": (
        "embedding_layer_computation: per-example sums of the rows' "
        "gradients over (example, token id) pairs (UniqueV2 + "
        "unsorted_segment_sum), squared"
    ),
    "MultiHeadAttention": (
        "multi_head_attention_layer_computation: "
        "einsum_layer_computation on its query/key/value/output "
        "EinsumDense kernels and biases, summed"
    ),
    "EinsumDense": (
        "einsum_layer_computation: ghost norm, <X X^T, G G^T> per "
        "example from [S x S] Gram matrices of the inputs X and the "
        "output gradients G, plus the bias term"
    ),
    "LayerNormalization": (
        "layer_normalization_computation: gamma and beta tiled "
        "to [batch, width] and watched, so per-example gradients "
        "are materialised (not a ghost norm)"
    ),
    "Dense": (
        "dense_layer_computation: ghost norm via the einsum rule "
        "('...b,bc->...c'): [S x S] Gram matrices on sequence inputs, "
        "|x|^2 |g|^2 on the [batch, width] input of the head"
    ),
}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=MODELS, required=True)
    parser.add_argument("--implementation", choices=sorted(IMPLEMENTATIONS), required=True)
    parser.add_argument("--examples", type=int, default=25_000)
    parser.add_argument(
        "--lot-size", type=int, default=256, help="lot size = the fixed batch size (default 256)"
    )
    parser.add_argument(
        "--epochs", type=int, default=3, help="epochs per repeat, the first is warm-up (>= 2)"
    )
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument(
        "--max-steps",
        type=int,
        default=0,
        help="time only the first N lots of each epoch and scale the time "
        "to the whole epoch (0 = whole epochs)",
    )
    parser.add_argument("--output", required=True, help="path of the JSON result file")
    parser.add_argument(
        "--threads",
        type=int,
        default=os.cpu_count() or 2,
        help="TF intra- and inter-op threads (default: all cores)",
    )
    parser.add_argument(
        "--xla",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="XLA for the run (default: each library's own default -- "
        "fast_clipping: DPModel's use_xla=True; nonprivate: Keras 2's "
        "fit without jit_compile, as the Keras 3 rows, whose "
        "jit_compile='auto' is off on a CPU-only machine)",
    )
    parser.add_argument(
        "--norm-check",
        type=int,
        default=4,
        help="fast_clipping: before training, compare the registry's "
        "per-example gradient norms of this many examples with "
        "norms of explicit per-example gradients (0 = skip)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--max-memory-gb",
        type=float,
        default=20.0,
        help="address-space limit (RLIMIT_AS) so that an over-large "
        "configuration fails with an out-of-memory error instead of "
        "exhausting the machine; 0 = no limit (default 20)",
    )
    args = parser.parse_args(argv)
    check_run_args(parser, args)
    if args.norm_check < 0:
        parser.error("--norm-check must be >= 0 (0 = skip)")
    return args


def make_data(model_name, n):
    """_peer_common.layers_data for the transformer: int32 token ids, as the
    Keras model of experiments/benchmark_layers.py takes them."""
    if model_name not in MODELS:
        raise ValueError(f"model must be one of {MODELS}, got {model_name!r}")
    return layers_data(model_name, n, token_dtype=np.int32)


# --------------------------------------------------------------------------
# Model (tf.keras 2, functional: DPModel's fast path walks the layer graph)
# --------------------------------------------------------------------------


def build_model(tf, model_name, dp_options=None):
    """benchmark_layers.build_model's transformer; a DPModel if dp_options is given."""
    if model_name != "transformer":
        raise ValueError(f"model must be one of {MODELS}, got {model_name!r}")
    layers = tf.keras.layers
    inputs = tf.keras.Input((SEQ_LEN,), dtype="int32")
    x = layers.Embedding(VOCAB, WIDTH)(inputs)
    x = x + tf.constant(positions())  # a TFOpLambda layer, no variables
    for _ in range(BLOCKS):
        a = layers.MultiHeadAttention(HEADS, WIDTH // HEADS)(x, x)
        x = layers.LayerNormalization(epsilon=1e-5)(layers.Add()([x, a]))
        f = layers.Dense(WIDTH)(layers.Dense(FFN, activation="relu")(x))
        x = layers.LayerNormalization(epsilon=1e-5)(layers.Add()([x, f]))
    x = layers.GlobalAveragePooling1D()(x)
    outputs = layers.Dense(TEXT_CLASSES)(x)
    if dp_options is None:
        return tf.keras.Model(inputs, outputs, name=model_name)
    # pylint: disable=import-outside-toplevel
    from tensorflow_privacy.privacy.keras_models.dp_keras_model import DPModel

    return DPModel(inputs=inputs, outputs=outputs, name=model_name, **dp_options)


def make_registry(tf):
    """The package's default registry plus its rules for the attention layers."""
    # pylint: disable=import-outside-toplevel
    from tensorflow_privacy.privacy.fast_gradient_clipping import layer_registry
    from tensorflow_privacy.privacy.fast_gradient_clipping.registry_functions import (
        einsum_dense,
        layer_normalization,
        multi_head_attention,
    )

    registry = layer_registry.make_default_layer_registry()  # Dense, Embedding
    registry.insert(tf.keras.layers.EinsumDense, einsum_dense.einsum_layer_computation)
    registry.insert(
        tf.keras.layers.LayerNormalization, layer_normalization.layer_normalization_computation
    )
    registry.insert(
        tf.keras.layers.MultiHeadAttention,
        multi_head_attention.multi_head_attention_layer_computation,
    )
    return registry


def layer_paths(model, registry):
    """For each trainable layer type: count, parameters and the rule that takes it."""
    # pylint: disable=import-outside-toplevel
    from tensorflow_privacy.privacy.fast_gradient_clipping import (
        gradient_clipping_utils,
        layer_registry,
    )

    paths = {}
    for layer in model.layers:
        if not layer.trainable_variables:
            continue
        name = type(layer).__name__
        entry = paths.setdefault(name, {"layers": 0, "parameters": 0})
        entry["layers"] += 1
        entry["parameters"] += int(sum(int(np.prod(v.shape)) for v in layer.trainable_variables))
        if registry.is_elem(layer):
            entry["path"] = "registry: " + registry.lookup(layer).__name__
            entry["rule"] = REGISTRY_RULES.get(name, "")
        else:
            entry["path"] = "NOT REGISTERED: falls back to vectorized_map per-example gradients"
    default = layer_registry.make_default_layer_registry()
    missing = sorted(
        {
            type(layer).__name__
            for layer in model.layers
            if layer.trainable_variables and not default.is_elem(layer)
        }
    )
    return paths, {
        "unregistered_layers": missing,
        "fast_path": gradient_clipping_utils.all_trainable_layers_are_registered(model, default),
        "note": (
            "make_default_layer_registry() of 0.9.0 holds only Dense and Embedding: "
            "with it alone DPModel would silently take the vectorized_map "
            "per-example-gradient path for this model"
            if missing
            else ""
        ),
    }


def check_norms(tf, model, registry, features, labels, loss_fn, count):
    """Largest relative gap between the registry's norms and explicit per-example ones."""
    # pylint: disable=import-outside-toplevel
    from tensorflow_privacy.privacy.fast_gradient_clipping import clip_grads

    x, y = tf.constant(features[:count]), tf.constant(labels[:count])
    fast = clip_grads.compute_gradient_norms(
        model, registry, x, y, trainable_vars=model.trainable_variables
    ).numpy()
    exact = []
    for i in range(count):
        with tf.GradientTape() as tape:
            loss = loss_fn(y[i : i + 1], model(x[i : i + 1], training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        exact.append(
            float(
                tf.sqrt(
                    tf.add_n([tf.reduce_sum(tf.square(tf.convert_to_tensor(g))) for g in grads])
                )
            )
        )
    exact = np.asarray(exact)
    return {
        "examples": count,
        "registry_norms": [float(v) for v in fast],
        "per_example_gradient_norms": [float(v) for v in exact],
        "max_relative_error": float(np.max(np.abs(fast - exact) / np.maximum(exact, 1e-12))),
    }


# --------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------


def run_repeats(tf, args, features, labels, warmup, timed, extra):
    """Trains args.repeats fresh models; appends epoch times in place."""
    private = args.implementation == "fast_clipping"
    lots_per_epoch = args.examples // args.lot_size
    steps = min(args.max_steps, lots_per_epoch) if args.max_steps else lots_per_epoch

    class EpochTimer(tf.keras.callbacks.Callback):
        """Wall time of each epoch (fit syncs its logs before on_epoch_end)."""

        def __init__(self):
            super().__init__()
            self.times, self._start = [], None

        def on_epoch_begin(self, epoch, logs=None):
            self._start = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            # a partial epoch (--max-steps) is scaled to the epoch's lots
            self.times.append((time.perf_counter() - self._start) * lots_per_epoch / steps)

    for repeat in range(args.repeats):
        tf.keras.backend.clear_session()
        tf.keras.utils.set_random_seed(args.seed + repeat)
        dataset = (
            tf.data.Dataset.from_tensor_slices((features, labels))
            .shuffle(args.examples, seed=args.seed + repeat, reshuffle_each_iteration=True)
            .batch(args.lot_size, drop_remainder=True)
        )
        if args.max_steps:
            dataset = dataset.take(steps)
        dataset = dataset.prefetch(1)
        loss = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        optimizer = tf.keras.optimizers.legacy.SGD(learning_rate=LEARNING_RATE)
        if private:
            registry = make_registry(tf)
            model = build_model(
                tf,
                args.model,
                dict(
                    l2_norm_clip=L2_NORM_CLIP,
                    noise_multiplier=NOISE_MULTIPLIER,
                    num_microbatches=None,
                    use_xla=True if args.xla is None else args.xla,
                    layer_registry=registry,
                ),
            )
            model.compile(optimizer=optimizer, loss=loss)
            paths, default_only = layer_paths(model, registry)
            fast = bool(model._enable_fast_peg_computation)  # pylint: disable=protected-access
            extra.update(
                {
                    "dp_model_class": "tensorflow_privacy.privacy.keras_models.dp_keras_model."
                    "DPModel (make_dp_model_class(tf.keras.Model))",
                    "layer_registry": (
                        "make_default_layer_registry() (Dense, Embedding) + "
                        "insert(EinsumDense, LayerNormalization, MultiHeadAttention) "
                        "with the package's registry_functions"
                    ),
                    "num_microbatches": None,
                    "use_xla": True if args.xla is None else args.xla,
                    "fast_gradient_clipping_enabled": fast,
                    "clipping_path": (
                        "fast: registry norm pass (forward + backward), then a "
                        "second forward + backward of the loss reweighted by "
                        "min(1, clip / norm)"
                        if fast
                        else "FALLBACK: vectorized_map over per-example gradients"
                    ),
                    "layer_paths": paths,
                    "default_registry_alone": default_only,
                    "clipping": "flat (one norm over all trainable variables)",
                    "noise": (
                        "N(0, (clip*noise/batch)^2) added to the mean of the clipped "
                        "gradients, once per batch"
                    ),
                }
            )
            if not fast:
                raise RuntimeError(
                    "DPModel did not enable fast gradient clipping (a trainable layer is not "
                    f"in the registry: {paths}); refusing to time its fallback as "
                    "fast_clipping"
                )
            if args.norm_check and repeat == 0:
                extra["registry_norm_check"] = check_norms(
                    tf, model, registry, features, labels, loss, args.norm_check
                )
        else:
            model = build_model(tf, args.model)
            jit = bool(args.xla)  # Keras 2's default: no XLA
            model.compile(optimizer=optimizer, loss=loss, jit_compile=jit)
            extra["jit_compile"] = jit
        extra["trainable_parameters"] = int(
            sum(int(np.prod(v.shape)) for v in model.trainable_variables)
        )
        extra["optimizer"] = type(optimizer).__module__ + "." + type(optimizer).__name__
        timer = EpochTimer()
        model.fit(dataset, epochs=args.epochs, verbose=0, callbacks=[timer])
        extra["lots_per_epoch"] = lots_per_epoch
        record_repeat(repeat, timer.times, warmup, timed)
        del model, dataset


def main(argv=None):
    args = parse_args(argv)
    limit_address_space(args.max_memory_gb)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    from importlib import metadata  # pylint: disable=import-outside-toplevel

    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    tf.config.threading.set_intra_op_parallelism_threads(args.threads)
    tf.config.threading.set_inter_op_parallelism_threads(args.threads)
    features, labels, data_desc = make_data(args.model, args.examples)
    warmup, timed, extra = [], [], {}
    error = run_guarded(run_repeats, tf, args, features, labels, warmup, timed, extra)

    private = args.implementation == "fast_clipping"
    lots = args.examples // args.lot_size
    settings = {
        "l2_norm_clip": L2_NORM_CLIP if private else None,
        "noise_multiplier": NOISE_MULTIPLIER if private else None,
        "learning_rate": LEARNING_RATE,
        "sampling": (
            "shuffled fixed-size batches (tf.data shuffle over all examples, "
            "reshuffled every epoch, batch(lot, drop_remainder=True)); not "
            "Poisson: tensorflow-privacy's DPModel clips and noises whatever "
            "batches fit gives it"
        ),
        "examples_used_per_epoch": lots * args.lot_size,
        "epochs_per_repeat": args.epochs,
        "repeats": args.repeats,
        "timed_lots_per_epoch": (
            min(args.max_steps, lots) if args.max_steps else "all (whole epochs)"
        ),
        "epoch_seconds_are": (
            "the time of the first --max-steps lots x lots per epoch / --max-steps"
            if args.max_steps
            else "measured whole epochs"
        ),
        "warmup_epoch_seconds": warmup,
        "loss": "SparseCategoricalCrossentropy(from_logits=True), mean over the batch",
        "data": data_desc,
        "threads": args.threads,
        "seed": args.seed,
        "tensorflow_version": tf.__version__,
        "keras_version": metadata.version("keras"),
        "python_version": platform.python_version(),
        "max_memory_gb": args.max_memory_gb or None,
    }
    settings.update(extra)
    result = {
        "model": args.model,
        "implementation": args.implementation,
        "framework": "keras 2",
        "library": "tensorflow-privacy" if private else "tf.keras",
        "library_version": (
            metadata.version("tensorflow-privacy") if private else metadata.version("keras")
        ),
        "seconds_per_epoch": median_seconds(timed, error),
        "epoch_seconds": timed,
        "warmup_seconds": warmup,
        "peak_memory_mb": peak_memory_mb(),
        "examples": args.examples,
        "lot_size": args.lot_size,
        "settings": settings,
        "command": " ".join([sys.executable] + sys.argv),
    }
    return finish(args.output, result, error)


if __name__ == "__main__":
    sys.exit(main())
