"""Speed and memory of DP-SGD, side by side in one run.

For each model (the paper's MNIST MLP on 60 PCA-like features; the paper's
CIFAR-10 net with frozen conv layers; the same net fully trainable) this times
median seconds per epoch and peak memory of:

  keras_nonprivate  plain Keras 3 `fit` (SGD, batch = lot)         -- the baseline
  keras_nonprivate_spe  the same with the steps_per_execution our "auto" picks
                    (what Keras would gain from it too: the cost DP itself adds)
  keras_nonprivate_xla  the same with jit_compile=True (Keras's own XLA cost)
  dpfl_tf           our DPModel + DPSGD, default settings (Poisson lots sampled in
                    the graph, the whole lot as one physical batch, noise once per lot,
                    steps_per_execution "auto")
  dpfl_tf_spe1      the same with steps_per_execution=1 (one lot per call)
  dpfl_tf_memmap    the same reading the data from an on-disk array (np.memmap,
                    a random-access source: lots read from disk, prefetched)
  dpfl_tf_xla       the same with jit_compile=True
  dpfl_tf_secure    the same with secure_mode=True (os.urandom sampling, secure keys,
                    four-draw float64 Gaussian noise)
  tfp_*             tensorflow-privacy 0.9.0 in its own virtual environment
  opacus*           Opacus on CPU PyTorch in its own virtual environment

Every configuration runs in its own process (so peak RSS is its own), with the
first epoch as warm-up.  `--repeats R` runs R rounds, each of them one fresh
process per configuration in turn (A B C, A B C, ...), so that a drift of the
machine's speed reaches every configuration alike; a row's time is the median
of all its timed epochs, its memory the largest peak.  Ratios are to
`keras_nonprivate` of the same run.
Full dataset sizes by default (MNIST 60,000, CIFAR-10 50,000); a smaller
`--examples` is recorded in every row (a slice, not the full-size figure).

    python experiments/benchmark_dpsgd.py                       # everything found
    python experiments/benchmark_dpsgd.py --models mnist_mlp --skip-peers

Peer environments (see README): --tfp-python / --opacus-python, defaulting to
/work/peer_envs/{tfp,opacus}/bin/python when they exist.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

from _common import ROOT, peak_rss_mb, run_child

MODELS = ("mnist_mlp", "cifar_frozen_conv", "cifar_full_conv")
OURS = (
    "keras_nonprivate",
    "keras_nonprivate_spe",
    "keras_nonprivate_xla",
    "dpfl_tf",
    "dpfl_tf_spe1",
    "dpfl_tf_memmap",
    "dpfl_tf_xla",
    "dpfl_tf_secure",
)
FULL_SIZE = {"mnist_mlp": 60_000, "cifar_frozen_conv": 50_000, "cifar_full_conv": 50_000}
TFP = (
    "nonprivate",
    "dp_keras_sgd_microbatch",
    "dp_keras_sgd_vectorized",
    "dp_sequential_fast_clipping",
)
OPACUS = ("nonprivate", "opacus", "opacus_ghost")
CLIP, NOISE, LR = 4.0, 1.0, 0.05


# ---------------------------------------------------------------------------
# worker: one configuration of ours, in this process


def _data(model_name: str, n: int):
    import numpy as np

    rng = np.random.default_rng(0)
    if model_name == "mnist_mlp":
        from dpfl_tf.data import load_dataset

        ds = load_dataset("mnist")
        x = ds.x_train[:n].reshape(n, -1).astype("float32") / 255.0
        proj = rng.normal(size=(784, 60)).astype("float32")
        return x @ proj, ds.y_train[:n].astype("int64")
    # CIFAR-shaped inputs: the content does not change the cost of a step
    return rng.uniform(size=(n, 24, 24, 3)).astype("float32"), rng.integers(0, 10, n)


def _model(model_name: str):
    import keras

    if model_name == "mnist_mlp":
        return keras.Sequential(
            [
                keras.Input((60,)),
                keras.layers.Dense(1000, activation="relu"),
                keras.layers.Dense(10),
            ]
        )
    layers = keras.layers
    model = keras.Sequential(
        [
            keras.Input((24, 24, 3)),
            layers.Conv2D(64, 5, padding="same", activation="relu"),
            layers.MaxPooling2D(2),
            layers.Conv2D(64, 5, padding="same", activation="relu"),
            layers.MaxPooling2D(2),
            layers.Flatten(),
            layers.Dense(384, activation="relu"),
            layers.Dense(384, activation="relu"),
            layers.Dense(10),
        ]
    )
    if model_name == "cifar_frozen_conv":
        for layer in model.layers[:4]:
            layer.trainable = False
    return model


def worker(args) -> dict:
    import keras

    from dpfl_tf.keras import DPSGD, DPModel
    from dpfl_tf.keras.model import auto_steps_per_execution

    x, y = _data(args.model, args.examples)
    if args.implementation == "dpfl_tf_memmap":  # the same array, read from disk
        import numpy as np

        tmp = tempfile.mkdtemp(prefix="dpfl_bench_")
        np.save(os.path.join(tmp, "x.npy"), x)
        del x
        x = np.load(os.path.join(tmp, "x.npy"), mmap_mode="r")
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    timed, warmup = [], []

    class EpochTimer(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.t0 = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            (warmup if epoch == 0 else timed).append(time.perf_counter() - self.t0)

    impl = args.implementation
    steps = 1
    for _ in range(args.repeats):
        model = _model(args.model)
        if impl.startswith("keras_nonprivate"):
            if impl == "keras_nonprivate_spe":
                steps = auto_steps_per_execution(max(1, len(y) // args.lot_size))
            model.compile(
                optimizer=keras.optimizers.SGD(LR),
                loss=loss,
                steps_per_execution=steps,
                jit_compile=impl.endswith("_xla"),
            )
            model.fit(
                x,
                y,
                batch_size=args.lot_size,
                epochs=args.epochs,
                verbose=0,
                callbacks=[EpochTimer()],
            )
        else:
            dp = DPModel(model)
            dp.compile(
                optimizer=DPSGD(
                    LR,
                    l2_norm_clip=CLIP,
                    noise_multiplier=NOISE,
                    secure_mode=impl == "dpfl_tf_secure",
                ),
                loss=loss,
                jit_compile=impl == "dpfl_tf_xla",
                steps_per_execution=1 if impl == "dpfl_tf_spe1" else "auto",
            )
            dp.fit(
                x,
                y,
                lot_size=args.lot_size,
                epochs=args.epochs,
                verbose=0,
                callbacks=[EpochTimer()],
            )
            steps = dp.steps_per_execution
    if args.implementation == "dpfl_tf_memmap":
        import shutil

        del x
        shutil.rmtree(tmp, ignore_errors=True)
    return {
        "model": args.model,
        "implementation": args.implementation,
        "library": "dpfl_tf" if args.implementation.startswith("dpfl_tf") else "keras",
        "library_version": keras.__version__,
        "seconds_per_epoch": statistics.median(timed),
        "epoch_seconds": timed,
        "warmup_seconds": warmup,
        "peak_memory_mb": peak_rss_mb(),
        "examples": args.examples,
        "lot_size": args.lot_size,
        "settings": {
            "l2_norm_clip": CLIP,
            "noise_multiplier": NOISE,
            "learning_rate": LR,
            "sampling": "poisson" if args.implementation.startswith("dpfl_tf") else "keras batches",
            "physical_batch": "default (the whole lot)",
            "steps_per_execution": steps,
        },
    }


# ---------------------------------------------------------------------------
# orchestrator


def _merge(merged: dict | None, result: dict) -> dict:
    """One configuration's results over its processes: every timed epoch (the
    row's time is their median), the largest peak memory, the first error."""
    if merged is None:
        merged = dict(result, processes=0, epoch_seconds=[], warmup_seconds=[])
    merged["processes"] += 1
    merged["epoch_seconds"] += result.get("epoch_seconds") or []
    merged["warmup_seconds"] += result.get("warmup_seconds") or []
    peaks = [m for m in (merged.get("peak_memory_mb"), result.get("peak_memory_mb")) if m]
    merged["peak_memory_mb"] = max(peaks) if peaks else None
    merged["seconds_per_epoch"] = (
        statistics.median(merged["epoch_seconds"]) if merged["epoch_seconds"] else None
    )
    if result.get("error") and not merged.get("error"):
        merged["error"] = result["error"]
    return merged


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    p.add_argument(
        "--examples",
        type=int,
        default=None,
        help="examples per model (default: the full training set)",
    )
    p.add_argument("--implementations", nargs="+", default=list(OURS), choices=OURS)
    p.add_argument("--lot-size", type=int, default=600)
    p.add_argument("--epochs", type=int, default=3, help="per repeat; the first is warm-up")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--tfp-python", default="/work/peer_envs/tfp/bin/python")
    p.add_argument("--opacus-python", default="/work/peer_envs/opacus/bin/python")
    p.add_argument("--skip-peers", action="store_true")
    p.add_argument(
        "--peer-epochs",
        type=int,
        default=2,
        help="epochs per repeat for the slow per-example peers",
    )
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--output", default="results/benchmark_dpsgd.json")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--implementation", help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    if args.worker:
        from dpfl_tf._io import atomic_write_json

        atomic_write_json(args.output, worker(args))
        return []

    rows = []
    for model in args.models:
        examples = args.examples or FULL_SIZE[model]
        common = ["--examples", str(examples), "--lot-size", str(args.lot_size)]
        plan = [
            (
                sys.executable,
                os.path.abspath(__file__),
                impl,
                ["--worker"],
                args.epochs,
                args.repeats,
            )
            for impl in args.implementations
        ]
        if not args.skip_peers:
            for python, script, impls in [
                (args.tfp_python, "experiments/peers/tfp_benchmark.py", TFP),
                (args.opacus_python, "experiments/peers/opacus_benchmark.py", OPACUS),
            ]:
                if not os.path.exists(python):
                    print(f"skipping {script}: no interpreter at {python}")
                    continue
                for impl in impls:
                    slow = impl.startswith("dp_keras") or (
                        impl == "opacus" and model != "mnist_mlp"
                    )
                    plan.append(
                        (
                            python,
                            os.path.join(ROOT, script),
                            impl,
                            [],
                            args.peer_epochs if slow else args.epochs,
                            1 if slow else args.repeats,
                        )
                    )
        # rounds: every configuration once per round, each in a fresh process
        results = {}  # label -> merged result
        walls = {}
        for round_ in range(max(1, max(r for *_, r in plan))):
            for python, script, impl, extra, epochs, repeats in plan:
                if round_ >= repeats:
                    continue
                cmd = [
                    python,
                    script,
                    *extra,
                    "--model",
                    model,
                    "--implementation",
                    impl,
                    "--epochs",
                    str(epochs),
                    "--repeats",
                    "1",
                    *common,
                ]
                start = time.perf_counter()
                result = run_child(cmd, args.timeout)
                label = (
                    impl
                    if script.endswith("benchmark_dpsgd.py")
                    else ("tfp_" if "tfp" in script else "opacus_") + impl
                )
                walls[label] = walls.get(label, 0.0) + time.perf_counter() - start
                results[label] = _merge(results.get(label), result)
        baseline = None
        for label, result in results.items():
            row = {
                "model": model,
                "implementation": label,
                "seconds_per_epoch": result.get("seconds_per_epoch"),
                "ratio_to_nonprivate": None,
                "peak_memory_mb": result.get("peak_memory_mb"),
                "library": result.get("library"),
                "library_version": result.get("library_version"),
                "epochs_timed": len(result.get("epoch_seconds") or []),
                "epoch_seconds": result.get("epoch_seconds"),
                "processes": result.get("processes"),
                "steps_per_execution": (result.get("settings") or {}).get("steps_per_execution"),
                "examples": examples,
                "lot_size": args.lot_size,
                "command": " ".join(
                    [
                        "python",
                        "experiments/benchmark_dpsgd.py",
                        *(argv if argv is not None else sys.argv[1:]),
                    ]
                ),
                "wall_seconds": walls[label],
            }
            if result.get("error"):
                row["error"] = result["error"].strip().splitlines()[-1][:300]
            if label == "keras_nonprivate":
                baseline = row
            if baseline and row["seconds_per_epoch"] and baseline["seconds_per_epoch"]:
                row["ratio_to_nonprivate"] = (
                    row["seconds_per_epoch"] / baseline["seconds_per_epoch"]
                )
                row["memory_ratio_to_nonprivate"] = (
                    row["peak_memory_mb"] / baseline["peak_memory_mb"]
                )
            rows.append(row)
            print(
                f"{model:18s} {label:34s} "
                + (
                    f"{row['seconds_per_epoch']:8.3f} s/epoch  x{row['ratio_to_nonprivate']:.2f}"
                    f"  {row['peak_memory_mb']:7.0f} MB"
                    if row["seconds_per_epoch"]
                    else f"failed: {row.get('error', '')[:80]}"
                ),
                flush=True,
            )
    from dpfl_tf._io import atomic_write_json

    atomic_write_json(args.output, rows)
    print(f"wrote {args.output}")
    return rows


if __name__ == "__main__":
    main()
