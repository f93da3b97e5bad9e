"""Speed and memory of DP-SGD on KerasHub models built from configs (issue 31).

Five models at small but realistic sizes (random initialisation, no weights
downloaded), each with every weight training and with LoRA (rank 4 on the
attention's query and value projections, ``backbone.enable_lora``; the rest
frozen):

  bert    BertBackbone + classifier head (2 classes)
  gpt2    GPT2CausalLM (the LM head is the token table, tied)
  gemma   GemmaCausalLM (tied head, grouped-query attention 4 q / 1 kv heads, RoPE)
  llama   LlamaCausalLM (untied head, grouped-query attention 4 q / 2 kv heads, RoPE)
  vit     ViTBackbone + ViTImageClassifier on 32x32x3 images, patches 4x4

Text models: 2 layers, hidden 128, sequence 128, vocabulary 8,000, 2,048
sequences of Zipf-distributed tokens; ViT: 2 layers, hidden 128, 2,048 uniform
images; lot 128 (16 lots per epoch); the content of a token or pixel does not
change a step's cost.  Each configuration runs in its own process: the first
epoch is warm-up, the table shows the median of the other epochs and the
process's peak RSS (ru_maxrss); ratios are to the non-private Keras epoch of
the same model and LoRA setting (plain ``fit``, SGD, batch = lot).  Targets:
DP epoch <= 1.5x, peak memory <= 2x.  For the slowest model (largest time
ratio) the DP step is broken down per layer: each layer's rule timed alone
(norms and clipped sum from its taps) against the plain and the DP step.

    python experiments/benchmark_hub.py            # results/benchmark_hub.json (idle machine)
    python experiments/benchmark_hub.py --quick    # smoke test; timings mean nothing
    python experiments/benchmark_hub.py --models gpt2 --lora off

With ``--opacus-python <venv>/bin/python`` (an Opacus environment, made as
experiments/peers/opacus_hub.py says) each model and LoRA setting also runs
the peer: PyTorch non-private, Opacus ghost clipping, and Opacus's per-sample
hooks where ghost clipping refuses the model (HuggingFace transformers built
to the same shapes and parameter counts); their ratios are to the PyTorch
non-private epoch.  Without it the JSON says the peer was not run.

    python experiments/benchmark_hub.py --opacus-python /work/peer_envs/opacus/bin/python
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

from _common import RESULTS, ROOT, command_line, commit_of, peak_rss_mb, run_child

MODELS = ("bert", "gpt2", "gemma", "llama", "vit")
IMPLEMENTATIONS = ("keras_nonprivate", "dpfl_tf")
PEER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "peers", "opacus_hub.py")
CLIP, NOISE, LR, RANK = 1.0, 1.0, 0.05, 4
FULL = dict(
    examples=2048, lot_size=128, seq=128, hidden=128, layers=2, vocab=8000, image=32, epochs=3
)
QUICK = dict(examples=256, lot_size=64, seq=32, hidden=32, layers=2, vocab=500, image=16, epochs=2)
TIME_TARGET, MEMORY_TARGET = 1.5, 2.0


def build(name: str, size: dict, lora: bool):
    """(model, x, y) of one benchmark configuration."""
    import keras_hub
    import numpy as np

    m, h = keras_hub.models, size["hidden"]
    text = dict(
        vocabulary_size=size["vocab"],
        num_layers=size["layers"],
        hidden_dim=h,
        intermediate_dim=4 * h if name in ("bert", "gpt2") else 2 * h,
    )
    if name == "bert":
        backbone = m.BertBackbone(num_heads=4, max_sequence_length=size["seq"], dropout=0.0, **text)
        model = m.BertTextClassifier(backbone, num_classes=2, preprocessor=None, dropout=0.0)
    elif name == "gpt2":
        backbone = m.GPT2Backbone(num_heads=4, max_sequence_length=size["seq"], dropout=0.0, **text)
        model = m.GPT2CausalLM(backbone, preprocessor=None)
    elif name == "gemma":
        backbone = m.GemmaBackbone(
            num_query_heads=4, num_key_value_heads=1, head_dim=h // 4, **text
        )
        model = m.GemmaCausalLM(backbone, preprocessor=None)
    elif name == "llama":
        backbone = m.LlamaBackbone(num_query_heads=4, num_key_value_heads=2, **text)
        model = m.LlamaCausalLM(backbone, preprocessor=None)
    else:
        s = size["image"]
        backbone = m.ViTBackbone(
            image_shape=(s, s, 3),
            patch_size=4,
            num_layers=size["layers"],
            num_heads=4,
            hidden_dim=h,
            mlp_dim=2 * h,
        )
        model = m.ViTImageClassifier(backbone, num_classes=10, preprocessor=None)
    if lora:
        backbone.enable_lora(RANK)
    rng = np.random.default_rng(0)
    n = size["examples"]
    if name == "vit":
        s = size["image"]
        return model, rng.random((n, s, s, 3), dtype=np.float32), rng.integers(0, 10, n)
    ranks = np.arange(1, size["vocab"])
    p = 1.0 / ranks
    ids = rng.choice(ranks, size=(n, size["seq"] + 1), p=p / p.sum()).astype("int32")
    x = {"token_ids": ids[:, :-1], "padding_mask": np.ones_like(ids[:, :-1])}
    if name == "bert":
        x["segment_ids"] = np.zeros_like(ids[:, :-1])
        return model, x, rng.integers(0, 2, n)
    return model, x, ids[:, 1:]


def _rules(model) -> dict:
    from collections import Counter

    from dpfl_tf.keras.exactness import plan

    return dict(sorted(Counter(f"{cls}: {rule}" for _, cls, rule in plan(model)).items()))


def worker(args) -> dict:
    import keras
    import tensorflow as tf

    from dpfl_tf.keras import DPSGD, DPModel

    size = QUICK if args.quick else FULL
    keras.utils.set_random_seed(0)
    model, x, y = build(args.model, size, args.lora)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    ends = []  # perf_counter at fit's start and at each epoch's end
    stamps = keras.callbacks.LambdaCallback(
        on_train_begin=lambda logs: ends.append(time.perf_counter()),
        on_epoch_end=lambda epoch, logs: ends.append(time.perf_counter()),
    )
    extra = {}
    if args.implementation == "keras_nonprivate":
        model.compile(optimizer=keras.optimizers.SGD(LR), loss=loss)
        model.fit(
            x, y, batch_size=size["lot_size"], epochs=size["epochs"], verbose=0, callbacks=[stamps]
        )
    else:
        dp = DPModel(model)
        dp.compile(optimizer=DPSGD(LR, l2_norm_clip=CLIP, noise_multiplier=NOISE), loss=loss)
        dp.fit(
            x, y, lot_size=size["lot_size"], epochs=size["epochs"], verbose=0, callbacks=[stamps]
        )
        extra = {"physical_batch": dp._batch_size, "rules": _rules(model)}
    epochs = [b - a for a, b in zip(ends, ends[1:])]  # the first is warm-up
    return {
        "model": args.model,
        "lora": args.lora,
        "implementation": args.implementation,
        "seconds_per_epoch": statistics.median(epochs[1:]),
        "epoch_seconds": epochs[1:],
        "warmup_seconds": epochs[:1],
        "peak_memory_mb": peak_rss_mb(),
        "trainable_parameters": int(sum(int(tf.size(v)) for v in model.trainable_variables)),
        "parameters": int(sum(int(tf.size(v)) for v in model.weights)),
        "tensorflow_version": tf.__version__,
        "keras_version": keras.__version__,
        **extra,
    }


def breakdown(name: str, size: dict, lora: bool, repeats: int = 5) -> dict:
    """The DP step of one batch (a lot) by layer: the plain step (loss gradient),
    the whole `PerExampleGradients.compute`, and each layer's rule alone (its
    norms and clipped sum from the taps of one tapped pass), median seconds."""
    import keras
    import tensorflow as tf

    from dpfl_tf.keras.layer_rules import LayerCall
    from dpfl_tf.keras.per_example import (
        PerExampleGradients,
        _Recorder,
        _tapping,
        per_example_loss,
        plan_layers,
    )

    keras.utils.set_random_seed(0)
    model, x, y = build(name, size, lora)
    b = size["lot_size"]
    x = tf.nest.map_structure(lambda t: tf.constant(t[:b]), x)
    y = tf.constant(y[:b])
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    variables = model.trainable_variables

    def median_time(fn, *args):
        fn(*args)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            tf.nest.map_structure(lambda t: t.numpy() if hasattr(t, "numpy") else t, fn(*args))
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    @tf.function
    def plain(x, y):
        with tf.GradientTape() as tape:
            value = tf.reduce_mean(per_example_loss(loss, y, model(x, training=True)))
        return tape.gradient(value, variables)

    per_example = PerExampleGradients(model, loss)
    ones = tf.ones(b)

    @tf.function
    def dp(x, y):
        return per_example.compute(x, y, ones, lambda sq: [tf.ones_like(s) for s in sq])[0]

    plan = plan_layers(model)
    with tf.GradientTape() as tape:  # one tapped pass, eagerly: the rules' inputs
        recorder = _Recorder(tape, plan)
        with _tapping(recorder):
            total = tf.reduce_sum(per_example_loss(loss, y, model(x, training=True)))
    watched = [
        (i, k, z) for i, (_, _, taps) in enumerate(recorder.calls) for k, z in taps.watched.items()
    ]
    grads = tape.gradient(total, [z for _, _, z in watched])
    per_call = [{} for _ in recorder.calls]
    for (i, k, _), g in zip(watched, grads):
        per_call[i][k] = g
    by_layer: dict = {}
    for (layer, rule, taps), g in zip(recorder.calls, per_call):
        by_layer.setdefault(id(layer), (layer, rule, []))[2].append((taps.saved, taps.watched, g))
    rows = []
    for layer, rule, calls in by_layer.values():

        def run(flat, layer=layer, rule=rule, calls=calls):
            packed = tf.nest.pack_sequence_as(calls, flat)
            results = rule.gradients(layer, [LayerCall(*c) for c in packed])
            return [(r.sq_norms, r.clipped_sum(ones)) for _, r in results]

        flat = tf.nest.flatten(calls)
        tensors = [t for t in flat if isinstance(t, tf.Tensor)]

        def fn(*ts, flat=flat, run=run):
            it = iter(ts)
            return run([next(it) if isinstance(t, tf.Tensor) else t for t in flat])

        rows.append(
            {
                "layer": layer.path,
                "class": type(layer).__name__,
                "rule": type(rule).__name__,
                "seconds": median_time(tf.function(fn), *tensors),
            }
        )
    rows.sort(key=lambda r: -r["seconds"])
    return {
        "model": name,
        "lora": lora,
        "batch": b,
        "plain_step_seconds": median_time(plain, x, y),
        "dp_step_seconds": median_time(dp, x, y),
        "rules_alone_total_seconds": sum(r["seconds"] for r in rows),
        "layers": rows,
    }


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    p.add_argument("--lora", nargs="+", default=["off", "on"], choices=["off", "on"])
    p.add_argument("--quick", action="store_true", help="tiny sizes; timings mean nothing")
    p.add_argument("--no-breakdown", action="store_true")
    p.add_argument(
        "--shared-machine",
        action="store_true",
        help="record that other jobs shared the machine (timings are noisy)",
    )
    p.add_argument("--timeout", type=float, default=3600, help="seconds per configuration")
    p.add_argument(
        "--opacus-python",
        help="the interpreter of an Opacus environment: also run the Opacus peer rows",
    )
    p.add_argument(
        "--output",
        help="default results/benchmark_hub.json (results/benchmark_hub_quick.json with --quick)",
    )
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--breakdown-of", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--implementation", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    from dpfl_tf._io import atomic_write_json

    if args.worker:
        args.lora = args.lora == ["on"]
        result = (
            breakdown(args.model, QUICK if args.quick else FULL, args.lora)
            if args.breakdown_of
            else worker(args)
        )
        atomic_write_json(args.output, result)
        return result
    output = args.output or os.path.join(
        RESULTS, "benchmark_hub_quick.json" if args.quick else "benchmark_hub.json"
    )
    size = QUICK if args.quick else FULL
    common = [sys.executable, os.path.abspath(__file__), "--worker"] + (
        ["--quick"] if args.quick else []
    )
    rows, started = [], time.perf_counter()
    report = {  # rewritten after every row: an interrupted run keeps its rows
        "command": command_line(),
        "commit": commit_of(),
        "quick": args.quick,
        "shared_machine": args.shared_machine,
        "sizes": size,
        "settings": {
            "l2_norm_clip": CLIP,
            "noise_multiplier": NOISE,
            "learning_rate": LR,
            "lora_rank": RANK,
            "optimizer": "DPSGD (dpfl_tf) / SGD (Keras)",
            "sampling": "poisson (dpfl_tf), physical batch chosen by the library",
        },
        "targets": {"time_ratio": TIME_TARGET, "memory_ratio": MEMORY_TARGET},
        "opacus": (
            "rows torch_nonprivate / opacus_ghost / opacus (hooks, where ghost clipping "
            "refuses the model): experiments/peers/opacus_hub.py, torch threads = cores (as "
            "TensorFlow's default); fixed lots (poisson_sampling=False), ours Poisson; ratios "
            "to torch_nonprivate, so compare the seconds side by side too"
            if args.opacus_python
            else "not run (no --opacus-python)"
        ),
        "python": platform.python_version(),
        "rows": rows,
    }
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)

    def relative(part: str) -> str:  # no machine's paths in the results
        return os.path.relpath(part, ROOT) if part.startswith(ROOT) else part

    def run(cmd, implementation, base, name, lora):
        t0, load = time.perf_counter(), os.getloadavg()
        row = dict(
            run_child(cmd, args.timeout),
            model=name,
            lora=lora == "on",
            implementation=implementation,
            command=" ".join(relative(c) for c in cmd[1:]),
            wall_seconds=round(time.perf_counter() - t0, 1),
            load_average_before=[round(v, 2) for v in load],
        )
        if base and base.get("seconds_per_epoch") and row.get("seconds_per_epoch"):
            row["time_ratio"] = row["seconds_per_epoch"] / base["seconds_per_epoch"]
            row["memory_ratio"] = row["peak_memory_mb"] / base["peak_memory_mb"]
            if implementation == "dpfl_tf":  # the targets are ours
                row["meets_time_target"] = row["time_ratio"] <= TIME_TARGET
                row["meets_memory_target"] = row["memory_ratio"] <= MEMORY_TARGET
        rows.append(row)
        report["complete"] = False
        atomic_write_json(output, report)
        print(
            f"{name:6s} lora={lora:3s} {implementation:16s} "
            f"{row.get('seconds_per_epoch') or float('nan'):8.2f} s/epoch "
            f"{row.get('peak_memory_mb') or float('nan'):8.0f} MB "
            f"ratio {row.get('time_ratio', float('nan')):.2f}x time, "
            f"{row.get('memory_ratio', float('nan')):.2f}x memory"
            + (f"  ERROR {row['error'][-200:]}" if row.get("error") else ""),
            flush=True,
        )
        return row

    # the peer's threads: as many as TensorFlow uses (all cores), its norms checked
    threads = ["--threads", str(os.cpu_count() or 1), "--check-norms"]
    peer = [args.opacus_python, PEER, *threads] + (["--quick"] if args.quick else [])
    for name in args.models:
        for lora in args.lora:
            base = None
            for impl in IMPLEMENTATIONS:
                cmd = common + ["--model", name, "--implementation", impl, "--lora", lora]
                row = run(cmd, impl, base, name, lora)
                base = base or row
            if not args.opacus_python:
                continue
            # the peer: its own non-private baseline, ghost clipping, and the
            # per-sample hooks where ghost clipping refuses the model
            base = None
            for impl in ("torch_nonprivate", "opacus_ghost", "opacus"):
                cmd = peer + ["--model", name, "--implementation", impl, "--lora", lora]
                row = run(cmd, impl, base, name, lora)
                base = base or row
                refused = "NotImplementedError" in (row.get("error") or "")
                if impl == "opacus_ghost" and not refused:
                    break
    ratios = [r for r in rows if r.get("time_ratio") and r["implementation"] == "dpfl_tf"]
    if ratios and not args.no_breakdown:
        slowest = max(ratios, key=lambda r: r["time_ratio"])
        cmd = common + [
            "--breakdown-of",
            "1",
            "--model",
            slowest["model"],
            "--lora",
            "on" if slowest["lora"] else "off",
        ]
        report["breakdown"] = dict(
            run_child(cmd, args.timeout, key="dp_step_seconds"), command=" ".join(cmd[1:])
        )
        print("breakdown of", slowest["model"], "lora" if slowest["lora"] else "", flush=True)
    report["wall_seconds"] = round(time.perf_counter() - started, 1)
    report["complete"] = True
    atomic_write_json(output, report)
    return report


if __name__ == "__main__":
    main()
