"""Does an average of the DP-SGD iterates lift Abadi et al.'s medium-noise row (eps 2)?

Averaging the weights a run went through is post-processing of what DP-SGD released
(no privacy cost).  One tuning trial of the medium-noise setting (PLD, the step decayed
linearly from 0.1 to FINAL over the run, `mnist_dpsgd.py --group tune`) on 54,000
training examples, 6,000 held out (`--validation`), keeping after every call of the
training function (a few lots) an exponential moving average of the weights at several
momenta, and every tenth call's weights for uniform averages of the last 10 / 25 / 50%
of the run; at the end each average is evaluated on the held-out examples beside the
last iterate.  A diagnostic on validation data, one seed per call:

    python experiments/mnist_iterate_averaging.py --final 0.005 --seed 0
    python experiments/mnist_iterate_averaging.py --final 0.02 --seed 0

Writes one row per call to results/mnist_iterate_averaging.json (replacing a row of
the same run name: final step, validation size and seed).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from unittest import mock

import keras
import numpy as np
from _common import RESULTS, command_line, commit_of, load_runs
from mnist_dpsgd import tune_runs

from dpfl_tf._io import atomic_write_json
from dpfl_tf.recipes import common, run
from dpfl_tf.recipes.common import accuracy
from dpfl_tf.recipes.mnist import train_mnist

MOMENTA = (0.99, 0.995, 0.999, 0.9995, 0.9999)
TAILS = (0.1, 0.25, 0.5)


class IterateAverages(keras.callbacks.Callback):
    """After every call of the training function: an EMA of the trainable weights
    per momentum in MOMENTA, and every tenth call a copy of the weights."""

    def on_train_begin(self, logs=None):
        self.calls, self.ema, self.snaps = 0, None, []

    def on_train_batch_end(self, batch, logs=None):
        w = [v.numpy() for v in self.model.trainable_variables]
        self.calls += 1
        if self.ema is None:
            self.ema = {m: [x.copy() for x in w] for m in MOMENTA}
        else:
            for m in MOMENTA:
                for e, x in zip(self.ema[m], w):
                    e *= m
                    e += (1 - m) * x
        if self.calls % 10 == 0:
            self.snaps.append([x.copy() for x in w])


class _EvaluationSet(common.EpochHistory):
    """The recipe's own epoch evaluation, remembered: its evaluation arrays (the
    held-out examples through the run's released projection) score the averages."""

    last = None

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        type(self).last = self


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--final",
        type=float,
        default=0.005,
        choices=(0.02, 0.01, 0.005, 0.0025),
        help="the step's final value (one of the tuning trials')",
    )
    p.add_argument("--validation", type=int, default=6000, help="held-out examples (>= 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", default=os.path.join(RESULTS, "mnist_iterate_averaging.json"))
    args = p.parse_args(argv)
    if args.validation < 1:  # the averages are scored on held-out examples, never the test set
        p.error("--validation must be >= 1")
    name = f"medium_noise/pld/anneal{args.final:g}"
    config = tune_runs(args.validation, lambda n: n == name)[name]
    config = dataclasses.replace(config, validation=args.validation, seed=args.seed)
    averages = IterateAverages()
    start = time.perf_counter()
    with mock.patch.object(run, "EpochHistory", _EvaluationSet):  # the run's history
        result, model = train_mnist(config, callbacks=[averages], return_model=True, verbose=False)
    held_out = _EvaluationSet.last
    raw = [v.numpy() for v in model.trainable_variables]

    def score(weights) -> float:
        for v, x in zip(model.trainable_variables, weights):
            v.assign(x)
        return accuracy(model, held_out.x_test, held_out.y_test)

    row = {
        "run": f"{name}/val{args.validation}/seed{args.seed}",
        "final_learning_rate": args.final,
        "validation": args.validation,
        "seed": args.seed,
        "calls": averages.calls,
        "decay_epochs": config.decay_epochs,
        "lots": result["lots"],
        "epsilon": result["epsilon"],
        "last_iterate": score(raw),
        "recipe_result": result["test_accuracy"],
        "seconds": time.perf_counter() - start,
    }
    for m in MOMENTA:
        row[f"ema{m:g}"] = score(averages.ema[m])
    n = len(averages.snaps)
    for frac in TAILS:
        tail = averages.snaps[int(n * (1 - frac)) :]
        row[f"tail{frac:g}"] = score([np.mean(layer, axis=0) for layer in zip(*tail)])
    print(json.dumps(row), flush=True)
    out = [r for r in load_runs(args.output) if r["run"] != row["run"]] + [
        dict(row, command=command_line(), commit=commit_of())
    ]
    atomic_write_json(args.output, out)
    return row


if __name__ == "__main__":
    main()
