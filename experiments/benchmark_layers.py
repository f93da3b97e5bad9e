"""Speed and memory of DP-SGD on the model families of the layers issue (16).

Four models, each built the same way in Keras 3 and (for the peers) in PyTorch
and, for the transformer, in Keras 2:

  transformer   sequence classifier: Embedding(20,000, 128) + fixed sinusoidal
                positions, 2 post-LN blocks (MultiHeadAttention 4 heads x 32,
                LayerNormalization, Dense FFN 256), mean pooling, Dense(2);
                sequence 128
  conv1d_text   Embedding(20,000, 128), Conv1D(128, 7, strides 3) x 2 (ReLU),
                global max pooling, Dense(128), Dense(2); sequence 128
  resnet20_gn   ResNet-20 (3 stages x 3 basic blocks, 16/32/64 channels,
                1x1 projection shortcuts) with GroupNormalization (8 groups)
                on CIFAR-shaped 32x32x3 inputs, 10 classes
  lstm          Embedding(20,000, 128), LSTM(128), Dense(2); sequence 128

Data are synthetic (the content of a token or a pixel does not change the cost
of a step): tokens drawn from a Zipf-like law over a 20,000-word vocabulary,
25,000 sequences (the size of IMDB's training set); 50,000 uniform images
(CIFAR-10's training set size); random labels.  The recipe is numpy only, in
`experiments/peers/_peer_common.py` with the architecture's constants: the
Opacus and tensorflow-privacy peers take them from there too.

Implementations, each in its own process (so peak RSS is its own), first
epoch of every repeat as warm-up, median of the timed epochs:

  keras_nonprivate   plain Keras 3 `fit` (SGD, batch = lot)      -- the baseline
  dpfl_tf            DPModel + DPSGD, default settings: Poisson lots, physical
                     batch chosen by the library (no batch_size passed)
  opacus_nonprivate  plain PyTorch loop on CPU, batch = lot    -- PyTorch's baseline
  opacus             Opacus make_private, per-sample gradients (hooks)
  opacus_ghost       Opacus make_private, ghost clipping
  tfp_nonprivate     plain tf.keras 2 `fit` (TF 2.15), batch = lot  -- its baseline
  tfp_fast_clipping  tensorflow-privacy 0.9.0 DPModel, fast (ghost) clipping with
                     a layer registry covering every layer; transformer only: the
                     other models' layers (Conv1D, Conv2D, GroupNormalization,
                     LSTM) are not in its registry, so their rows say "not run"

`ratio_to_nonprivate` is DP epoch / non-private epoch of the *same framework*
and precision policy (the issue's targets); `ratio_to_keras` is to Keras's
float32 non-private epoch.  `--policies float32 mixed_bfloat16` adds the Keras
rows under a mixed-precision policy (`keras_nonprivate@mixed_bfloat16`,
`dpfl_tf@mixed_bfloat16`): the speed effect of mixed precision, DP and not.
Targets (issue 16): transformer and Conv1D <= 1.5x, GroupNorm ResNet <= 2x,
LSTM <= 4x time; peak memory <= 2x; and a lower time ratio than Opacus ghost
clipping.

    python experiments/benchmark_layers.py                  # the real run (idle machine)
    python experiments/benchmark_layers.py --quick          # smoke test, tiny sizes
    python experiments/benchmark_layers.py --models lstm --skip-peers
    python experiments/benchmark_layers.py --skip-peers --policies float32 mixed_bfloat16
    python experiments/benchmark_layers.py --skip-ours --peer-steps 20   # peer rows only
    python experiments/benchmark_layers.py --skip-ours --peers tfp    # tensorflow-privacy only

`--peer-steps N` times the first N lots of each Opacus epoch (its non-private
baseline the same way) and scales that to the epoch's lots: Opacus's
full-size DP epochs take up to an hour.  Such rows say so in their settings
(`timed_lots_per_epoch`).

The Opacus peer runs in its own virtual environment (`--opacus-python`,
default /work/peer_envs/opacus/bin/python when it exists; see README), and so
does tensorflow-privacy, which needs TensorFlow 2.15 / Keras 2 (`--tfp-python`,
default /work/peer_envs/tfp/bin/python).  Its rows are whole epochs (`--epochs`);
`--peer-steps` and `--peer-epochs` are Opacus's.  Rows of a framework that a
run does not measure (ours under `--skip-ours`, a peer under `--reuse-peers` or
left out of `--peers`) are kept from the existing --output file when that file
is read (`--skip-ours`, `--reuse-peers`), marked `reused_from`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

from _common import RESULTS, ROOT, command_line, peak_rss_mb, run_child

# the architecture and data of every framework's models (numpy only)
from peers._peer_common import (
    BLOCKS,
    CONV_DENSE,
    CONV_FILTERS,
    CONV_KERNEL,
    CONV_STRIDE,
    FFN,
    GN_GROUPS,
    HEADS,
    IMAGE,
    IMAGE_CLASSES,
    LSTM_UNITS,
    RESNET_BLOCKS,
    RESNET_STAGES,
    SEQ_LEN,
    TEXT_CLASSES,
    VOCAB,
    WIDTH,
    layers_data,
)
from peers._peer_common import positions as _positions

MODELS = ("transformer", "conv1d_text", "resnet20_gn", "lstm")
OURS = ("keras_nonprivate", "dpfl_tf")
OPACUS = ("nonprivate", "opacus", "opacus_ghost")
TFP = ("nonprivate", "fast_clipping")
PEERS = ("opacus", "tfp")
FRAMEWORKS = {"ours": "keras", "opacus": "pytorch", "tfp": "keras 2"}
POLICIES = ("float32", "mixed_bfloat16", "mixed_float16")
CLIP, NOISE, LR = 4.0, 1.0, 0.05

# full-size data and realistic lots (issue 16: lots of 256-1024)
FULL = {
    "transformer": dict(examples=25_000, lot_size=256),
    "conv1d_text": dict(examples=25_000, lot_size=256),
    "resnet20_gn": dict(examples=50_000, lot_size=256),
    "lstm": dict(examples=25_000, lot_size=256),
}
QUICK = {m: dict(examples=512, lot_size=128) for m in MODELS}

# issue 16: DP epoch / non-private epoch of the same framework
TIME_TARGETS = {"transformer": 1.5, "conv1d_text": 1.5, "resnet20_gn": 2.0, "lstm": 4.0}
MEMORY_TARGET = 2.0

# tensorflow-privacy 0.9.0's fast-clipping registry functions (Dense, EinsumDense,
# Embedding, LayerNormalization, MultiHeadAttention) against each model's layers;
# peers/tfp_layers.py builds the one model they cover all of
TFP_MODELS = ("transformer",)
TFP_COVERAGE = {
    "transformer": "all layers registered (Dense, EinsumDense via MultiHeadAttention, "
    "Embedding, LayerNormalization)",
    "conv1d_text": "Conv1D not registered (vectorized per-example fallback)",
    "resnet20_gn": "Conv2D and GroupNormalization not registered (vectorized fallback)",
    "lstm": "LSTM not registered (vectorized fallback)",
}
TFP_UNREGISTERED = {
    "conv1d_text": "Conv1D",
    "resnet20_gn": "Conv2D and GroupNormalization",
    "lstm": "LSTM",
}


def tfp_reason(model: str) -> str:
    """Why tensorflow-privacy's fast clipping has no measured row for this model."""
    return (
        f"not run: {TFP_UNREGISTERED[model]} not in tensorflow-privacy 0.9.0's "
        "fast-clipping layer registry (its registry functions cover Dense, EinsumDense, "
        "Embedding, LayerNormalization and MultiHeadAttention), so its DPModel would "
        "silently fall back to per-example gradients by vectorized_map: not fast "
        "clipping"
    )


# ---------------------------------------------------------------------------
# data and models (Keras)


def make_data(model_name: str, n: int):
    """Synthetic features and labels (token ids int32, images NHWC): the recipe
    of peers/_peer_common.py, the same numbers as the peers train on."""
    x, y, _ = layers_data(model_name, n)
    return x, y


def build_model(model_name: str):
    import keras

    layers = keras.layers
    if model_name == "resnet20_gn":

        def conv_gn(x, filters, strides, relu=True):
            x = layers.Conv2D(filters, 3, strides=strides, padding="same", use_bias=False)(x)
            x = layers.GroupNormalization(GN_GROUPS, epsilon=1e-5)(x)
            return layers.ReLU()(x) if relu else x

        inputs = keras.Input(IMAGE)
        x = conv_gn(inputs, RESNET_STAGES[0], 1)
        for stage, filters in enumerate(RESNET_STAGES):
            for block in range(RESNET_BLOCKS):
                strides = 2 if stage > 0 and block == 0 else 1
                shortcut = x
                if strides != 1 or x.shape[-1] != filters:
                    shortcut = layers.Conv2D(filters, 1, strides=strides, use_bias=False)(x)
                    shortcut = layers.GroupNormalization(GN_GROUPS, epsilon=1e-5)(shortcut)
                y = conv_gn(x, filters, strides)
                y = conv_gn(y, filters, 1, relu=False)
                x = layers.ReLU()(layers.Add()([y, shortcut]))
        x = layers.GlobalAveragePooling1D()(layers.Reshape((-1, RESNET_STAGES[-1]))(x))
        return keras.Model(inputs, layers.Dense(IMAGE_CLASSES)(x), name=model_name)

    inputs = keras.Input((SEQ_LEN,), dtype="int32")
    if model_name == "transformer":
        x = layers.Embedding(VOCAB, WIDTH)(inputs)
        x = x + keras.ops.convert_to_tensor(_positions())
        for _ in range(BLOCKS):
            a = layers.MultiHeadAttention(HEADS, WIDTH // HEADS)(x, x)
            x = layers.LayerNormalization(epsilon=1e-5)(layers.Add()([x, a]))
            f = layers.Dense(WIDTH)(layers.Dense(FFN, activation="relu")(x))
            x = layers.LayerNormalization(epsilon=1e-5)(layers.Add()([x, f]))
        x = layers.GlobalAveragePooling1D()(x)
    elif model_name == "conv1d_text":
        x = layers.Embedding(VOCAB, WIDTH)(inputs)
        for _ in range(2):
            x = layers.Conv1D(CONV_FILTERS, CONV_KERNEL, strides=CONV_STRIDE, activation="relu")(x)
        x = layers.GlobalMaxPooling1D()(x)
        x = layers.Dense(CONV_DENSE, activation="relu")(x)
    elif model_name == "lstm":
        x = layers.Embedding(VOCAB, WIDTH)(inputs)
        x = layers.LSTM(LSTM_UNITS)(x)
    else:
        raise ValueError(f"model must be one of {MODELS}, got {model_name!r}")
    return keras.Model(inputs, layers.Dense(TEXT_CLASSES)(x), name=model_name)


# ---------------------------------------------------------------------------
# worker: one configuration of ours, in this process


def _rules_used(dp) -> dict:
    """How DPModel computes each trainable layer's per-example norms."""
    from collections import Counter

    from dpfl_tf.keras.per_example import plan_layers

    per_example = getattr(dp, "_per_example", None)
    if per_example is None:
        return {}
    excluded = frozenset(getattr(per_example, "_excluded", {}) or {})
    counts = Counter(type(rule).__name__ for _, rule in plan_layers(dp.model, excluded).values())
    if excluded:
        counts["whole-model Jacobian"] = len(excluded)
    return dict(sorted(counts.items()))


def worker(args) -> dict:
    import keras
    import tensorflow as tf

    from dpfl_tf.keras import DPSGD, DPModel

    x, y = make_data(args.model, args.examples)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    timed, warmup, extra = [], [], {}

    class EpochTimer(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.t0 = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            (warmup if epoch == 0 else timed).append(time.perf_counter() - self.t0)

    keras.mixed_precision.set_global_policy(args.policy)
    for repeat in range(args.repeats):
        keras.utils.set_random_seed(repeat)
        model = build_model(args.model)
        extra["trainable_parameters"] = int(sum(int(tf.size(v)) for v in model.trainable_variables))
        if args.implementation == "keras_nonprivate":
            model.compile(optimizer=keras.optimizers.SGD(LR), loss=loss)
            model.fit(
                x,
                y,
                batch_size=args.lot_size,
                epochs=args.epochs,
                verbose=0,
                callbacks=[EpochTimer()],
            )
        elif args.implementation == "dpfl_tf":
            dp = DPModel(model)
            dp.compile(optimizer=DPSGD(LR, l2_norm_clip=CLIP, noise_multiplier=NOISE), loss=loss)
            dp.fit(
                x,
                y,
                lot_size=args.lot_size,
                epochs=args.epochs,
                verbose=0,
                batch_size=args.batch_size,
                callbacks=[EpochTimer()],
            )
            extra["physical_batch"] = getattr(dp, "_batch_size", None)
            extra["rules"] = _rules_used(dp)
        else:
            raise ValueError(f"implementation must be one of {OURS}, got {args.implementation!r}")
        del model
    return {
        "model": args.model,
        "implementation": args.implementation,
        "library": "dpfl_tf" if args.implementation == "dpfl_tf" else "keras",
        "library_version": keras.__version__,
        "tensorflow_version": tf.__version__,
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
            "optimizer": "DPSGD" if args.implementation == "dpfl_tf" else "SGD",
            "sampling": "poisson"
            if args.implementation == "dpfl_tf"
            else "keras batches of lot size",
            "epochs_per_repeat": args.epochs,
            "repeats": args.repeats,
            "python_version": platform.python_version(),
            "policy": args.policy,
            **extra,
        },
    }


# ---------------------------------------------------------------------------
# orchestrator


def _error_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    errors = [line for line in lines if "Error" in line or "error" in line]
    return (errors or lines or [""])[-1].strip()[:300]


def _checks(rows: list[dict]) -> dict:
    """Issue-16 targets for each model's dpfl_tf row, and the peers' ratios beside it."""
    checks = {}
    for model in dict.fromkeys(r["model"] for r in rows):
        by = {r["implementation"]: r for r in rows if r["model"] == model}
        ours, ghost = by.get("dpfl_tf", {}), by.get("opacus_ghost", {})
        time_ratio, mem_ratio = (
            ours.get("ratio_to_nonprivate"),
            ours.get("memory_ratio_to_nonprivate"),
        )
        ghost_ratio = ghost.get("ratio_to_nonprivate")
        tfp_ratio = by.get("tfp_fast_clipping", {}).get("ratio_to_nonprivate")
        checks[model] = {
            "time_ratio": time_ratio,
            "time_target": TIME_TARGETS[model],
            "time_ok": None if time_ratio is None else time_ratio <= TIME_TARGETS[model],
            "memory_ratio": mem_ratio,
            "memory_target": MEMORY_TARGET,
            "memory_ok": None if mem_ratio is None else mem_ratio <= MEMORY_TARGET,
            "opacus_ghost_ratio": ghost_ratio,
            "below_opacus_ghost": None
            if time_ratio is None or ghost_ratio is None
            else time_ratio < ghost_ratio,
            "tfp_fast_clipping_ratio": tfp_ratio,
            "below_tfp_fast_clipping": None
            if time_ratio is None or tfp_ratio is None
            else time_ratio < tfp_ratio,
            # same architecture in both frameworks (PyTorch's LSTM has a second bias)
            "trainable_parameters": {
                impl: (r.get("settings") or {}).get("trainable_parameters")
                for impl, r in by.items()
                if (r.get("settings") or {}).get("trainable_parameters")
            },
        }
    return checks


def _verdict(ok) -> str:
    return "n/a" if ok is None else ("ok" if ok else "MISSED")


def _print_checks(checks: dict, quick: bool) -> None:
    print(
        "\nissue-16 targets (dpfl_tf, DP epoch / non-private Keras epoch):"
        + ("  [--quick smoke test: tiny sizes, verdicts mean nothing]" if quick else "")
    )
    for model, c in checks.items():
        t = "-" if c["time_ratio"] is None else f"x{c['time_ratio']:.2f}"
        m = "-" if c["memory_ratio"] is None else f"x{c['memory_ratio']:.2f}"
        g = "-" if c["opacus_ghost_ratio"] is None else f"x{c['opacus_ghost_ratio']:.2f}"
        fc = c.get("tfp_fast_clipping_ratio")
        tfp = (
            ""
            if fc is None
            else (
                f"   tfp fast clipping x{fc:.2f} (ours lower: "
                f"{_verdict(c['below_tfp_fast_clipping'])})"
            )
        )
        print(
            f"  {model:12s} time {t:>7s} (<= {c['time_target']}x: {_verdict(c['time_ok'])})"
            f"   memory {m:>7s} (<= {c['memory_target']}x: {_verdict(c['memory_ok'])})"
            f"   opacus ghost {g:>7s} (ours lower: {_verdict(c['below_opacus_ghost'])})" + tfp
        )


def plot(rows: list[dict], path: str, quick: bool = False) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import FormatStrFormatter, NullFormatter
    except ImportError:
        print("matplotlib not found: no figure")
        return False
    models = list(dict.fromkeys(r["model"] for r in rows))
    impls = [
        i
        for i in (
            "dpfl_tf",
            *(f"dpfl_tf@{p}" for p in POLICIES[1:]),
            "opacus",
            "opacus_ghost",
            "tfp_fast_clipping",
        )
        if any(r["implementation"] == i for r in rows)
    ]
    impls[1:1] = list(
        dict.fromkeys(
            r["implementation"]
            for r in rows  # --physical-batches
            if r["implementation"].startswith("dpfl_tf@batch")
        )
    )
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / max(1, len(impls))
    for ax, key, title in [
        (axes[0], "ratio_to_nonprivate", "time per epoch"),
        (axes[1], "memory_ratio_to_nonprivate", "peak RSS"),
    ]:
        for k, impl in enumerate(impls):
            found = [
                next((r for r in rows if r["model"] == m and r["implementation"] == impl), {})
                for m in models
            ]
            vals = [r.get(key) for r in found]
            xs = [i + (k - (len(impls) - 1) / 2) * width for i in range(len(models))]
            bars = ax.bar(xs, [v or 0 for v in vals], width, label=impl)
            for bar, v, r in zip(bars, vals, found):
                # a peer that cannot run the model (layers outside its registry) is not a failure
                missing = "not run" if r.get("not_run") else "failed"
                ax.annotate(
                    missing if v is None else f"{v:.1f}",
                    (bar.get_x() + bar.get_width() / 2, max(bar.get_height(), 1)),
                    ha="center",
                    va="bottom",
                    fontsize=7,
                )
        for i, m in enumerate(models):
            target = TIME_TARGETS[m] if key == "ratio_to_nonprivate" else MEMORY_TARGET
            ax.hlines(target, i - 0.45, i + 0.45, colors="k", linestyles="--", linewidth=1)
        if key == "ratio_to_nonprivate":  # spans 1x to 100x
            ax.set_yscale("log")
            ax.yaxis.set_minor_formatter(NullFormatter())
        ax.yaxis.set_major_formatter(FormatStrFormatter("%gx"))
        ax.set_xticks(range(len(models)), models)
        ax.set_title(f"{title}: DP / non-private, same framework")
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize=8, title="dashed: issue-16 target", title_fontsize=8)
    fig.suptitle(
        "DP-SGD cost by model family (experiments/benchmark_layers.py)"
        + (
            "\n--quick smoke test: tiny sizes on a busy machine, timings mean nothing"
            if quick
            else ""
        )
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    p.add_argument(
        "--quick",
        action="store_true",
        help="smoke test: 512 examples, lot 128, 2 epochs, 1 repeat (timings "
        "meaningless); writes results/benchmark_layers_quick.{json,png}",
    )
    p.add_argument("--examples", type=int, help="override every model's data size")
    p.add_argument("--lot-size", type=int, help="override every model's lot size")
    p.add_argument("--epochs", type=int, default=3, help="per repeat; the first is warm-up")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--opacus-python", default="/work/peer_envs/opacus/bin/python")
    p.add_argument(
        "--tfp-python",
        default="/work/peer_envs/tfp/bin/python",
        help="interpreter of the tensorflow-privacy environment (TF 2.15 / "
        "Keras 2, tensorflow-privacy 0.9.0; see README)",
    )
    p.add_argument(
        "--peers",
        nargs="+",
        default=list(PEERS),
        choices=PEERS,
        help="peer libraries to run (default: both); with --skip-ours the rows "
        "of a peer left out are kept from the existing --output file",
    )
    p.add_argument("--skip-peers", action="store_true")
    p.add_argument(
        "--skip-ours",
        action="store_true",
        help="run only the peers; our rows (and Keras's baselines) are taken "
        "from the existing --output file, marked as reused",
    )
    p.add_argument(
        "--reuse-peers",
        action="store_true",
        help="with --skip-peers: keep the peers' rows (Opacus, "
        "tensorflow-privacy) of the existing --output file (marked as "
        "reused), so ours can be rerun alone",
    )
    p.add_argument(
        "--policies",
        nargs="+",
        default=["float32"],
        choices=POLICIES,
        help="Keras precision policies to time ours under (float32 first: the "
        "other policies' rows are also compared with it)",
    )
    p.add_argument(
        "--peer-epochs",
        type=int,
        default=2,
        help="epochs per repeat (the first is warm-up) for Opacus's DP modes, "
        "whose epochs take up to an hour at full size (tensorflow-privacy's "
        "rows take --epochs)",
    )
    p.add_argument(
        "--physical-batches",
        type=int,
        nargs="+",
        default=[],
        help="also time ours (float32) with these physical batch sizes "
        "(fit's batch_size; rows dpfl_tf@batchB): memory against time",
    )
    p.add_argument(
        "--peer-steps",
        type=int,
        default=0,
        help="time only the first N lots of each Opacus epoch (its non-private "
        "baseline too) and scale to the whole epoch; 0 = whole epochs",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=6 * 3600,
        help="seconds per configuration (the slowest, our LSTM, takes about "
        "1.5 h on an idle machine)",
    )
    p.add_argument(
        "--output",
        help="default results/benchmark_layers.json "
        "(results/benchmark_layers_quick.json with --quick)",
    )
    p.add_argument("--figure", help="default: the output's name with .png")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--implementation", help=argparse.SUPPRESS)
    p.add_argument("--policy", default="float32", help=argparse.SUPPRESS)
    p.add_argument("--batch-size", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    if args.worker:
        from dpfl_tf._io import atomic_write_json

        atomic_write_json(args.output, worker(args))
        return []

    if args.quick:
        args.epochs, args.repeats, args.peer_epochs = 2, 1, 2
    output = args.output or os.path.join(
        RESULTS, "benchmark_layers_quick.json" if args.quick else "benchmark_layers.json"
    )
    figure = args.figure or os.path.splitext(output)[0] + ".png"
    if args.skip_ours and args.skip_peers:
        p.error("--skip-ours with --skip-peers runs nothing")
    if args.reuse_peers and not args.skip_peers:
        p.error("--reuse-peers keeps the peers' rows of an earlier run: pass --skip-peers too")
    have = {}
    for peer, name, python in (
        ("opacus", "Opacus", args.opacus_python),
        ("tfp", "tensorflow-privacy", args.tfp_python),
    ):
        have[peer] = not args.skip_peers and peer in args.peers and os.path.exists(python)
        if not args.skip_peers and peer in args.peers and not have[peer]:
            print(f"skipping {name}: no interpreter at {python}")
    have_opacus, have_tfp = have["opacus"], have["tfp"]

    # frameworks this run measures; the others' rows come from the earlier file
    measured = {FRAMEWORKS[k] for k, run in (("ours", not args.skip_ours), *have.items()) if run}
    earlier = []
    if args.skip_ours or args.reuse_peers:
        option = "--skip-ours" if args.skip_ours else "--reuse-peers"
        if not os.path.exists(output):
            p.error(
                f"{option} reuses rows from {output}, which does not exist: "
                f"run without {option} first (or pass --output)"
            )
        with open(output, encoding="utf-8") as f:
            earlier_report = json.load(f)
        # not-run rows are written anew below, not reused
        earlier = [
            dict(r, reused_from=r.get("reused_from") or earlier_report.get("command"))
            for r in earlier_report["rows"]
            if r.get("framework") not in measured and not r.get("not_run")
        ]
    rows, started = [], time.perf_counter()
    for model in args.models:
        sizes = dict((QUICK if args.quick else FULL)[model])
        sizes["examples"] = args.examples or sizes["examples"]
        sizes["lot_size"] = args.lot_size or sizes["lot_size"]
        common = ["--examples", str(sizes["examples"]), "--lot-size", str(sizes["lot_size"])]
        plan = (
            []
            if args.skip_ours
            else [
                (
                    sys.executable,
                    os.path.abspath(__file__),
                    impl,
                    ["--worker", "--policy", policy],
                    args.epochs,
                    args.repeats,
                    policy,
                    "",
                )
                for policy in args.policies
                for impl in OURS
            ]
        )
        if not args.skip_ours:
            plan += [
                (
                    sys.executable,
                    os.path.abspath(__file__),
                    "dpfl_tf",
                    ["--worker", "--batch-size", str(b)],
                    args.epochs,
                    args.repeats,
                    "float32",
                    f"@batch{b}",
                )
                for b in args.physical_batches
            ]
        if have_opacus:
            script = os.path.join(ROOT, "experiments", "peers", "opacus_layers.py")
            for impl in OPACUS:
                epochs = args.epochs if impl == "nonprivate" else args.peer_epochs
                extra = ["--max-steps", str(args.peer_steps)] if args.peer_steps else []
                plan.append(
                    (args.opacus_python, script, impl, extra, epochs, args.repeats, "float32", "")
                )
        if have_tfp and model in TFP_MODELS:  # whole epochs: a few minutes each
            script = os.path.join(ROOT, "experiments", "peers", "tfp_layers.py")
            plan += [
                (args.tfp_python, script, impl, [], args.epochs, args.repeats, "float32", "")
                for impl in TFP
            ]
        baselines = {}
        for row in (r for r in earlier if r["model"] == model):  # --skip-ours
            rows.append(row)
            if row["implementation"] == "keras_nonprivate" and row["seconds_per_epoch"]:
                baselines["keras", "float32"] = row
        for python, script, impl, extra, epochs, repeats, policy, suffix in plan:
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
                str(repeats),
                *common,
            ]
            start = time.perf_counter()
            result = run_child(cmd, args.timeout)
            kind = (
                "ours"
                if script.endswith("benchmark_layers.py")
                else "tfp"
                if script.endswith("tfp_layers.py")
                else "opacus"
            )
            label = {
                "ours": impl,
                "tfp": f"tfp_{impl}",
                "opacus": "opacus_nonprivate" if impl == "nonprivate" else impl,
            }[kind]
            if policy != "float32":
                label += "@" + policy
            label += suffix
            framework = FRAMEWORKS[kind]
            row = {
                "model": model,
                "implementation": label,
                "framework": framework,
                "seconds_per_epoch": result.get("seconds_per_epoch"),
                "ratio_to_nonprivate": None,
                "memory_ratio_to_nonprivate": None,
                "ratio_to_keras": None,
                "peak_memory_mb": result.get("peak_memory_mb"),
                "library": result.get("library"),
                "library_version": result.get("library_version"),
                "epoch_seconds": result.get("epoch_seconds"),
                "warmup_seconds": result.get("warmup_seconds")
                or (result.get("settings") or {}).get("warmup_epoch_seconds"),
                "examples": sizes["examples"],
                "lot_size": sizes["lot_size"],
                "epochs_per_repeat": epochs,
                "repeats": repeats,
                "settings": result.get("settings"),
                "policy": policy,
                "command": " ".join(cmd),
                "wall_seconds": time.perf_counter() - start,
            }
            if kind == "tfp":
                row["tfp_layer_coverage"] = TFP_COVERAGE[model]
            if result.get("error"):
                row["error"] = _error_line(result["error"])
                row["error_detail"] = result["error"][-2000:]
            if impl in ("keras_nonprivate", "nonprivate") and row["seconds_per_epoch"]:
                baselines[framework, policy] = row
            base, keras_base = (
                baselines.get((framework, policy)),
                baselines.get(("keras", "float32")),
            )
            if row["seconds_per_epoch"] and base and base is not row:
                row["ratio_to_nonprivate"] = row["seconds_per_epoch"] / base["seconds_per_epoch"]
                row["memory_ratio_to_nonprivate"] = row["peak_memory_mb"] / base["peak_memory_mb"]
            if row["seconds_per_epoch"] and keras_base:
                row["ratio_to_keras"] = row["seconds_per_epoch"] / keras_base["seconds_per_epoch"]
            rows.append(row)
            if row["seconds_per_epoch"]:
                ratio = (
                    ""
                    if row["ratio_to_nonprivate"] is None
                    else f"x{row['ratio_to_nonprivate']:.2f} time  x"
                    f"{row['memory_ratio_to_nonprivate']:.2f} memory"
                )
                print(
                    f"{model:12s} {label:18s} {row['seconds_per_epoch']:9.3f} s/epoch "
                    f"{row['peak_memory_mb']:7.0f} MB  {ratio}"
                    f"   [{row['wall_seconds']:.0f} s wall]",
                    flush=True,
                )
            else:
                print(f"{model:12s} {label:18s} failed: {row.get('error', '')[:200]}", flush=True)
        if model not in TFP_MODELS:
            rows.append(
                {
                    "model": model,
                    "implementation": "tfp_fast_clipping",
                    "framework": FRAMEWORKS["tfp"],
                    "seconds_per_epoch": None,
                    "ratio_to_nonprivate": None,
                    "memory_ratio_to_nonprivate": None,
                    "ratio_to_keras": None,
                    "peak_memory_mb": None,
                    "library": "tensorflow-privacy",
                    "library_version": "0.9.0",
                    "examples": sizes["examples"],
                    "lot_size": sizes["lot_size"],
                    "not_run": tfp_reason(model),
                    "tfp_layer_coverage": TFP_COVERAGE[model],
                }
            )
            print(
                f"{model:12s} {'tfp_fast_clipping':18s} not run: {TFP_UNREGISTERED[model]} "
                "not in tensorflow-privacy's fast-clipping registry",
                flush=True,
            )
    checks = _checks(rows)
    _print_checks(checks, args.quick)
    from dpfl_tf._io import atomic_write_json

    report = {
        "description": __doc__.split("\n\n")[0],
        "quick": bool(args.quick),
        "valid_timings": not args.quick,
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "load_average_at_end": os.getloadavg(),
        },
        "command": command_line(),
        "wall_seconds": time.perf_counter() - started,
        "targets": {"time": TIME_TARGETS, "memory": MEMORY_TARGET},
        "checks": checks,
        "rows": rows,
    }
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    atomic_write_json(output, report)
    print(f"wrote {output}")
    if plot([r for r in rows if r.get("seconds_per_epoch")], figure, args.quick):
        print(f"wrote {figure}")
    return rows


if __name__ == "__main__":
    main()
