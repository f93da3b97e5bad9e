"""What a first DP `fit` (and a first `dp_gradients` call) costs, this checkout
against another one (`--baseline`, e.g. a worktree of the commit before a change),
run by run in turn (A B A B ...), each in a fresh Python.  Most of a small model's
first fit is tracing the training step (`tf.function`), which a user pays once
per model and the test suite once per test.

Models (random data: 2,000 examples, lots of 200, one epoch = 10 lots):
  mlp          Dense 100 -> Dense 10 on 60 features (the paper's MNIST model)
  cnn          4 x (Conv2D 16 + GroupNormalization) on 16x16x3, pooling, Dense 10
  transformer  Embedding 100x32, 4 blocks (MultiHeadAttention 4x8, LayerNorm,
               Dense 64 -> 32), pooling, Dense 10 (62 variables)
  custom_loop  the mlp's first `dp_gradients` call on a lot of 200 (it traces its
               own `tf.function` for the lot's static shape)
  mlp_xla_fixed  the mlp under XLA (`jit_compile=True`) with fixed-size lots

For each: seconds of the first fit (call), measured in the child, and of a second
fit of the same model (no new trace: what a fit costs once traced).

    git worktree add --detach /tmp/before <commit>
    python experiments/benchmark_first_fit.py --baseline /tmp/before

writes results/benchmark_first_fit.json: each run's seconds, the medians and the
median of the paired ratios (this checkout / the baseline).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from _common import ROOT, commit_of, paired_row, write_result

MODELS = ("mlp", "cnn", "transformer", "custom_loop", "mlp_xla_fixed")

CHILD = r"""
import sys, time
import numpy as np, keras, tensorflow as tf
from dpfl_tf.keras import DPModel, DPSGD, LotSampler, dp_gradients
from dpfl_tf.privacy import PrivacyLedger

kind = sys.argv[1]
rng = np.random.default_rng(0)
y = rng.integers(0, 10, 2000)
if kind in ("mlp", "custom_loop", "mlp_xla_fixed"):
    x = rng.random((2000, 60), dtype=np.float32)
    def net():
        return keras.Sequential([keras.Input((60,)), keras.layers.Dense(100, activation="relu"),
                                 keras.layers.Dense(10)])
elif kind == "cnn":
    x = rng.random((2000, 16, 16, 3), dtype=np.float32)
    def net():
        body = [layer for _ in range(4) for layer in (
            keras.layers.Conv2D(16, 3, padding="same", activation="tanh"),
            keras.layers.GroupNormalization(4))]
        return keras.Sequential([keras.Input((16, 16, 3)), *body,
                                 keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(10)])
else:
    x = rng.integers(0, 100, (2000, 16))
    def net():
        inp = keras.Input((16,), dtype="int32")
        h = keras.layers.Embedding(100, 32)(inp)
        for _ in range(4):
            a = keras.layers.MultiHeadAttention(4, 8)(h, h)
            h = keras.layers.LayerNormalization()(h + a)
            f = keras.layers.Dense(32)(keras.layers.Dense(64, activation="relu")(h))
            h = keras.layers.LayerNormalization()(h + f)
        out = keras.layers.Dense(10)(keras.layers.GlobalAveragePooling1D()(h))
        return keras.Model(inp, out)
loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
optimizer = DPSGD(learning_rate=0.1, l2_norm_clip=1.0, noise_multiplier=1.0)
if kind == "custom_loop":
    model, sampler, ledger = net(), LotSampler(2000, 200, "poisson"), PrivacyLedger()
    loss = keras.losses.SparseCategoricalCrossentropy(
        from_logits=True, reduction=None)
    step = lambda xb, yb: dp_gradients(
        model, loss, xb, yb, optimizer=optimizer, sampler=sampler, ledger=ledger)
    xb, yb = tf.constant(x[:200]), tf.constant(y[:200])
    times = []
    for _ in range(2):
        t = time.perf_counter(); [g.numpy() for g in step(xb, yb)]
        times.append(time.perf_counter() - t)
else:
    model = DPModel(net())
    xla = kind == "mlp_xla_fixed"
    model.compile(optimizer, loss, jit_compile=xla)
    sampling = "fixed_size" if xla else "poisson"
    times = []
    for _ in range(2):
        t = time.perf_counter()
        model.fit(x, y, lot_size=200, epochs=1, verbose=0, sampling=sampling, accountant="rdp")
        times.append(time.perf_counter() - t)
print(*times)
"""


def once(tree: str, kind: str) -> tuple[float, float]:
    env = dict(os.environ, PYTHONPATH=tree, TF_CPP_MIN_LOG_LEVEL="3")
    cmd = [sys.executable, "-c", CHILD, kind]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise SystemExit(f"{kind} failed in {tree}:\n{done.stderr[-2000:]}")
    first, second = (float(s) for s in done.stdout.strip().splitlines()[-1].split())
    return first, second


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", required=True, help="a checkout to compare with")
    parser.add_argument("--runs", type=int, default=5, help="pairs of runs per model")
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument("--no-save", action="store_true", help="print only")
    args = parser.parse_args(argv)
    baseline = os.path.abspath(args.baseline)
    rows = {}
    for kind in args.models:
        a, b = [], []
        for _ in range(args.runs):
            a.append(once(ROOT, kind))
            b.append(once(baseline, kind))
        rows[kind] = {
            "first": paired_row([s[0] for s in a], [s[0] for s in b]),
            "second": paired_row([s[1] for s in a], [s[1] for s in b]),
        }
        print(kind, json.dumps(rows[kind]), flush=True)
    if args.no_save:
        return
    write_result("benchmark_first_fit.json", rows, baseline_commit=commit_of(baseline))


if __name__ == "__main__":
    main()
