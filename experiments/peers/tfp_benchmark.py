#!/usr/bin/env python3
"""Speed benchmark of TensorFlow Privacy (peer library) DP-SGD on CPU.

Run with the interpreter of the separate TensorFlow Privacy environment
(TensorFlow 2.15 / Keras 2, tensorflow-privacy 0.9.0), e.g.

    /work/peer_envs/tfp/bin/python experiments/peers/tfp_benchmark.py \
        --model mnist_mlp --implementation dp_keras_sgd_vectorized \
        --examples 6000 --lot-size 600 --epochs 3 --repeats 3 \
        --output results/tfp_mnist_mlp_vectorized.json

One configuration is measured per process, so the reported peak resident
memory belongs to that configuration alone.  Every repeat builds and compiles
a fresh model and trains it for ``--epochs`` epochs; the first epoch of each
repeat (tracing / XLA compilation) is a warm-up and is not timed.

The data are _peer_common.benchmark_data's, as in opacus_benchmark.py.
This file is standalone but for _peer_common.py beside it: it must not import
the project's own package, since it runs under a different TensorFlow version.
"""

import argparse
import os
import platform
import sys
import time

import numpy as np
from _peer_common import (
    CIFAR_SHAPE,
    L2_NORM_CLIP,
    LEARNING_RATE,
    MNIST_FEATURES,
    NOISE_MULTIPLIER,
    NUM_CLASSES,
    benchmark_data,
    check_run_args,
    finish,
    limit_address_space,
    median_seconds,
    peak_memory_mb,
    record_repeat,
    run_guarded,
)

MODELS = ("mnist_mlp", "cifar_frozen_conv", "cifar_full_conv")

IMPLEMENTATIONS = {
    "nonprivate": "plain Keras 2 fit with legacy SGD (no clipping, no noise)",
    "dp_keras_sgd_microbatch": (
        "tensorflow_privacy.DPKerasSGDOptimizer, num_microbatches = batch size "
        "(per-example clipping via tape.jacobian + while_loop accumulation)"
    ),
    "dp_keras_sgd_vectorized": (
        "tensorflow_privacy.VectorizedDPKerasSGDOptimizer, num_microbatches = "
        "batch size (tape.jacobian + vectorized_map clipping)"
    ),
    "dp_sequential_fast_clipping": (
        "tensorflow_privacy.DPSequential with the default layer registry "
        "(fast / ghost gradient-norm clipping when every trainable layer is "
        "registered, otherwise its vectorized_map per-example fallback) and a "
        "plain legacy SGD optimizer"
    ),
}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=MODELS)
    parser.add_argument("--implementation", choices=sorted(IMPLEMENTATIONS))
    parser.add_argument(
        "--examples", type=int, default=6000, help="number of training examples (default 6000)"
    )
    parser.add_argument(
        "--lot-size", type=int, default=600, help="lot (= batch) size (default 600)"
    )
    parser.add_argument(
        "--epochs", type=int, default=3, help="epochs per repeat, the first is warm-up (>= 2)"
    )
    parser.add_argument(
        "--repeats", type=int, default=1, help="fresh model builds, each trained --epochs epochs"
    )
    parser.add_argument("--output", help="path of the JSON result file")
    parser.add_argument(
        "--physical-batch-size",
        type=int,
        default=None,
        help="dp_keras_sgd_microbatch only: split each lot "
        "into physical batches of this size using the "
        "optimizer's gradient_accumulation_steps "
        "(num_microbatches = physical batch). NOTE: "
        "tf-privacy then adds noise on every physical "
        "batch (sqrt(steps) x more noise per lot). "
        "Default: the lot size",
    )
    parser.add_argument(
        "--threads", type=int, default=2, help="TF intra- and inter-op threads (default 2)"
    )
    parser.add_argument(
        "--mnist-path",
        default=None,
        help="mnist.npz; default: $DPFL_DATA_DIR, "
        "../shared/data next to the repo, ~/.keras/datasets",
    )
    parser.add_argument(
        "--no-xla",
        action="store_true",
        help="dp_sequential_fast_clipping only: pass use_xla=False (library default is True)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--max-memory-gb",
        type=float,
        default=16.0,
        help="address-space limit (RLIMIT_AS) so that an "
        "over-large configuration fails with an OOM "
        "error instead of exhausting the machine; "
        "0 = no limit (default 16)",
    )
    parser.add_argument(
        "--list-implementations", action="store_true", help="print implementation names and exit"
    )
    args = parser.parse_args(argv)
    if args.list_implementations:
        return args
    check_run_args(parser, args, required=("model", "implementation", "output"))
    if args.physical_batch_size is None:
        args.physical_batch_size = args.lot_size
    if args.physical_batch_size != args.lot_size:
        if args.implementation != "dp_keras_sgd_microbatch":
            parser.error(
                "--physical-batch-size is only supported by "
                "dp_keras_sgd_microbatch (gradient accumulation)"
            )
        if args.physical_batch_size < 1 or args.lot_size % args.physical_batch_size:
            parser.error("--physical-batch-size must divide --lot-size")
    return args


# --------------------------------------------------------------------------
# TensorFlow side
# --------------------------------------------------------------------------


def model_layers(tf, model_name):
    layers = tf.keras.layers
    if model_name == "mnist_mlp":
        return [
            layers.InputLayer(input_shape=(MNIST_FEATURES,)),
            layers.Dense(1000, activation="relu"),
            layers.Dense(NUM_CLASSES),
        ]
    conv_trainable = model_name == "cifar_full_conv"
    return [
        layers.InputLayer(input_shape=CIFAR_SHAPE),
        layers.Conv2D(
            64, 5, strides=1, padding="same", activation="relu", trainable=conv_trainable
        ),
        layers.MaxPooling2D(2),
        layers.Conv2D(
            64, 5, strides=1, padding="same", activation="relu", trainable=conv_trainable
        ),
        layers.MaxPooling2D(2),
        layers.Flatten(),
        layers.Dense(384, activation="relu"),
        layers.Dense(384, activation="relu"),
        layers.Dense(NUM_CLASSES),
    ]


def build_and_compile(tf, tfp, args):
    """Returns (compiled model, extra settings)."""
    implementation = args.implementation
    lot = args.lot_size
    physical = args.physical_batch_size
    accumulation = lot // physical
    extra = {}
    if implementation == "dp_sequential_fast_clipping":
        from tensorflow_privacy.privacy.fast_gradient_clipping import (
            layer_registry as registry_module,
        )

        use_xla = not args.no_xla
        model = tfp.DPSequential(
            l2_norm_clip=L2_NORM_CLIP,
            noise_multiplier=NOISE_MULTIPLIER,
            num_microbatches=None,
            use_xla=use_xla,
            layer_registry=registry_module.make_default_layer_registry(),
            layers=model_layers(tf, args.model),
        )
        optimizer = tf.keras.optimizers.legacy.SGD(learning_rate=LEARNING_RATE)
        loss = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        fast = bool(model._enable_fast_peg_computation)  # pylint: disable=protected-access
        extra.update(
            {
                "dp_model_class": "tensorflow_privacy.DPSequential",
                "layer_registry": "make_default_layer_registry() (Dense, Embedding)",
                "num_microbatches": None,
                "use_xla": use_xla,
                "fast_gradient_clipping_enabled": fast,
                "clipping_path": (
                    "ghost-norm: norm pass + reweighted-loss pass"
                    if fast
                    else "fallback: vectorized_map over per-example gradients "
                    "(some trainable layer, e.g. Conv2D, is not in the registry)"
                ),
                "noise": (
                    "N(0, (clip*noise/batch)^2) added to the mean clipped gradient, once per batch"
                    if fast
                    else "N(0, (clip*noise)^2) added to the summed clipped "
                    "gradient, then divided by batch, once per batch"
                ),
            }
        )
    else:
        model = tf.keras.Sequential(model_layers(tf, args.model))
        if implementation == "nonprivate":
            optimizer = tf.keras.optimizers.legacy.SGD(learning_rate=LEARNING_RATE)
            loss = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        else:
            cls = {
                "dp_keras_sgd_microbatch": tfp.DPKerasSGDOptimizer,
                "dp_keras_sgd_vectorized": tfp.VectorizedDPKerasSGDOptimizer,
            }[implementation]
            kwargs = {}
            if accumulation > 1:
                kwargs["gradient_accumulation_steps"] = accumulation
            optimizer = cls(
                l2_norm_clip=L2_NORM_CLIP,
                noise_multiplier=NOISE_MULTIPLIER,
                num_microbatches=physical,
                learning_rate=LEARNING_RATE,
                **kwargs,
            )
            loss = tf.keras.losses.SparseCategoricalCrossentropy(
                from_logits=True, reduction=tf.keras.losses.Reduction.NONE
            )
            extra.update(
                {
                    "optimizer_class": "tensorflow_privacy." + cls.__name__,
                    "num_microbatches": physical,
                    "gradient_accumulation_steps": accumulation,
                    "loss_reduction": "NONE",
                    "noise": "N(0, (clip*noise)^2) added once per physical batch "
                    "to the sum of the clipped microbatch gradients, "
                    "then divided by num_microbatches"
                    + (
                        ""
                        if accumulation == 1
                        else "; with gradient accumulation every physical "
                        "batch is noised, so a lot gets sqrt(steps) x "
                        "the noise of a single noised lot"
                    ),
                }
            )
    model.compile(optimizer=optimizer, loss=loss)
    extra.setdefault("optimizer", type(optimizer).__module__ + "." + type(optimizer).__name__)
    return model, extra


def summarize_error(exc):
    text = str(exc)
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    head = lines[0] if lines else ""
    oom = [line for line in lines if "OOM when allocating" in line]
    summary = f"{type(exc).__name__}: {head}"
    if oom:
        summary += " | " + oom[0][:300]
    return summary[:1500]


def run_repeats(tf, tfp, args, features, labels, timer_cls, warmup, timed, extra):
    """Trains args.repeats fresh models; appends epoch times in place."""
    for repeat in range(args.repeats):
        tf.keras.backend.clear_session()
        tf.keras.utils.set_random_seed(args.seed + repeat)
        dataset = (
            tf.data.Dataset.from_tensor_slices((features, labels))
            .shuffle(args.examples, seed=args.seed + repeat, reshuffle_each_iteration=True)
            .batch(args.physical_batch_size, drop_remainder=True)
            .prefetch(1)
        )
        model, built_extra = build_and_compile(tf, tfp, args)
        extra.update(built_extra)
        timer = timer_cls()
        model.fit(dataset, epochs=args.epochs, verbose=0, callbacks=[timer])
        extra["_trainable_parameters"] = int(
            sum(int(np.prod(v.shape)) for v in model.trainable_variables)
        )
        record_repeat(repeat, timer.times, warmup, timed)
        del model, dataset


def main(argv=None):
    args = parse_args(argv)
    if args.list_implementations:
        for name, desc in IMPLEMENTATIONS.items():
            print(f"{name}\t{desc}")
        return 0

    limit_address_space(args.max_memory_gb)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    from importlib import metadata  # pylint: disable=import-outside-toplevel

    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    import tensorflow_privacy as tfp  # pylint: disable=import-outside-toplevel

    tf.config.threading.set_intra_op_parallelism_threads(args.threads)
    tf.config.threading.set_inter_op_parallelism_threads(args.threads)

    features, labels, data_desc = benchmark_data(args.model, args.examples, args.mnist_path)
    steps = args.examples // args.lot_size  # logical (noised) steps
    used = steps * args.lot_size  # batches of exactly lot_size examples
    if used != args.examples:
        # Keep whole lots only, so every physical epoch is whole lots too.
        features, labels = features[:used], labels[:used]

    class EpochTimer(tf.keras.callbacks.Callback):
        """Wall time of each epoch (fit syncs its logs before on_epoch_end)."""

        def __init__(self):
            super().__init__()
            self.times = []
            self._start = None

        def on_epoch_begin(self, epoch, logs=None):
            self._start = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            self.times.append(time.perf_counter() - self._start)

    warmup, timed, extra = [], [], {}
    # typically ResourceExhaustedError (OOM) for per-example Jacobians
    error = run_guarded(
        run_repeats,
        tf,
        tfp,
        args,
        features,
        labels,
        EpochTimer,
        warmup,
        timed,
        extra,
        describe=summarize_error,
    )
    n_params = extra.pop("_trainable_parameters", None)

    peak_mb = peak_memory_mb()
    settings = {
        "l2_norm_clip": None if args.implementation == "nonprivate" else L2_NORM_CLIP,
        "noise_multiplier": None if args.implementation == "nonprivate" else NOISE_MULTIPLIER,
        "learning_rate": LEARNING_RATE,
        "batch_size": args.lot_size,
        "physical_batch_size": args.physical_batch_size,
        "sampling": "shuffle each epoch, fixed batches of lot_size (drop_remainder)",
        "steps_per_epoch": steps,
        "physical_steps_per_epoch": used // args.physical_batch_size,
        "examples_used_per_epoch": used,
        "epochs_per_repeat": args.epochs,
        "repeats": args.repeats,
        "timed_epochs": len(timed),
        "warmup_epoch_seconds": warmup,
        "loss": "SparseCategoricalCrossentropy(from_logits=True)",
        "data": data_desc,
        "threads": args.threads,
        "seed": args.seed,
        "tensorflow_version": tf.__version__,
        "keras_version": metadata.version("keras"),
        "max_memory_gb": args.max_memory_gb or None,
        "python_version": platform.python_version(),
        "trainable_parameters": n_params,
    }
    settings.update(extra)

    result = {
        "model": args.model,
        "implementation": args.implementation,
        "library": "tensorflow-privacy",
        "library_version": metadata.version("tensorflow-privacy"),
        "seconds_per_epoch": median_seconds(timed, error),
        "epoch_seconds": timed,
        "peak_memory_mb": peak_mb,
        "examples": args.examples,
        "lot_size": args.lot_size,
        "settings": settings,
    }
    return finish(args.output, result, error)


if __name__ == "__main__":
    sys.exit(main())
