"""What a process pays for its first lot dataset, this checkout against another one
(`--baseline`, e.g. a worktree of the commit before a change), run by run in turn
(A B A B ...), each in a fresh Python:

  build  seconds to build a process's first Poisson lot dataset
         (`LotSampler(60, 10, "poisson").dataset(x, y, epochs=1)`), measured in the child
  train  wall seconds of ``python -m dpfl_tf train mnist --epochs 1 --lot-size 600``

    git worktree add --detach /tmp/before <commit>
    python experiments/benchmark_first_dataset.py --baseline /tmp/before

writes results/benchmark_first_dataset.json: each run's seconds, the medians and the
median of the paired ratios (this checkout / the baseline).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from _common import ROOT, commit_of, paired_row, write_result

BUILD = (
    "import time, numpy as np; from dpfl_tf.keras import LotSampler; "
    "x = np.random.rand(60, 32).astype('float32'); y = np.zeros(60, np.int64); "
    "t = time.perf_counter(); LotSampler(60, 10, 'poisson', seed=0).dataset(x, y, epochs=1); "
    "print(time.perf_counter() - t)"
)
TRAIN = ["train", "mnist", "--epochs", "1", "--lot-size", "600", "--overwrite"]


def once(tree: str, what: str, out_dir: str) -> float:
    env = dict(os.environ, PYTHONPATH=tree, TF_CPP_MIN_LOG_LEVEL="3")
    if what == "build":
        cmd = [sys.executable, "-c", BUILD]
    else:
        cmd = [sys.executable, "-m", "dpfl_tf", *TRAIN, "--output", f"{out_dir}/r.json"]
    start = time.perf_counter()
    done = subprocess.run(cmd, env=env, cwd=out_dir, capture_output=True, text=True, timeout=900)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed in {tree}:\n{done.stderr[-2000:]}")
    return float(done.stdout.strip().splitlines()[-1]) if what == "build" else wall


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", required=True, help="a checkout to compare with")
    parser.add_argument("--runs", type=int, default=5, help="pairs of runs per measurement")
    parser.add_argument("--no-save", action="store_true", help="print only")
    args = parser.parse_args(argv)
    baseline = os.path.abspath(args.baseline)
    rows = {}
    with tempfile.TemporaryDirectory() as out_dir:
        for what in ("build", "train"):
            a, b = [], []
            for _ in range(args.runs):
                a.append(once(ROOT, what, out_dir))
                b.append(once(baseline, what, out_dir))
            rows[what] = paired_row(a, b)
            print(what, json.dumps(rows[what]), flush=True)
    if args.no_save:
        return
    write_result(
        "benchmark_first_dataset.json",
        rows,
        baseline_commit=commit_of(baseline),
        train_command="python -m dpfl_tf " + " ".join(TRAIN),
    )


if __name__ == "__main__":
    main()
