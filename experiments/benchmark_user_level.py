"""Seconds per epoch of user-level DP-SGD (`DPModel.fit(..., user_ids=...)`) at a few
physical batch sizes, one after another in this process, so that a change of the per-user
computation (`dpfl_tf.keras.users.PerUserGradients`) can be measured before and after:

  tanh   tanh_cnn on 2,000 MNIST images, 200 users x 10 examples, 10 users a lot
         (20 lots an epoch): the slow test of `dpfl-tf train --users`
  mlp    60-1000-10 MLP on 60,000 MNIST images projected to 60 features,
         600 users x 100 examples, 60 users a lot (10 lots an epoch)

Each setting: one fit to trace and warm up, then `--repeats` fits of one epoch, timed.

    python experiments/benchmark_user_level.py                     # both, their batches
    python experiments/benchmark_user_level.py --settings tanh --batches 10 256

writes results/benchmark_user_level.json (one row per setting and batch, with the
commit measured).  The package measured is the checkout's own: for another commit, copy
this file into a worktree of it (``git worktree add /tmp/before <commit>``) and run it
there with ``--no-save``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from _common import write_result

SETTINGS = {"tanh": (10, 256), "mlp": (60, 1024)}  # the CLI's default batch, the recipe's


def measure(setting: str, batch: int, repeats: int) -> dict:
    import keras
    import numpy as np

    import dpfl_tf
    from dpfl_tf.keras import DPSGD, DPModel
    from dpfl_tf.models import tanh_cnn
    from tests.keras.helpers import mnist_slice

    if setting == "tanh":
        x, y = mnist_slice(2000, flat=False)
        users, per_user, lot = 200, 10, 10
        build = tanh_cnn
    else:
        x, y = mnist_slice(60000, features=60)
        users, per_user, lot = 600, 100, 60
        layers = keras.layers

        def build():
            return keras.Sequential(
                [keras.Input((60,)), layers.Dense(1000, activation="relu"), layers.Dense(10)]
            )

    ids = np.random.default_rng(0).permutation(np.repeat(np.arange(users), per_user))
    keras.utils.set_random_seed(0)
    model = DPModel(build())
    model.compile(
        optimizer=DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0, seed=0),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )

    def epoch() -> float:
        start = time.perf_counter()
        model.fit(x, y, lot_size=lot, batch_size=batch, user_ids=ids, epochs=1, verbose=0)
        return time.perf_counter() - start

    first = epoch()  # traces
    seconds = [epoch() for _ in range(repeats)]
    return {
        "setting": setting,
        "users": users,
        "examples_per_user": per_user,
        "users_per_lot": lot,
        "lots_per_epoch": users // lot,
        "batch_size": batch,
        "first_epoch_seconds": round(first, 3),
        "seconds_per_epoch": [round(s, 3) for s in seconds],
        "median_seconds_per_epoch": round(statistics.median(seconds), 3),
        "package": os.path.dirname(dpfl_tf.__file__),
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--settings", nargs="+", choices=sorted(SETTINGS), default=sorted(SETTINGS))
    parser.add_argument("--batches", nargs="+", type=int, help="default: each setting's two")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--no-save", action="store_true", help="print only")
    args = parser.parse_args(argv)
    rows = []
    for setting in args.settings:
        for batch in args.batches or SETTINGS[setting]:
            row = measure(setting, batch, args.repeats)
            print(json.dumps(row), flush=True)
            rows.append(row)
    if args.no_save:
        return
    write_result("benchmark_user_level.json", rows)


if __name__ == "__main__":
    main()
