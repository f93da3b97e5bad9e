"""Peak memory (RSS) of a short `dpfl-tf train cifar10` run, before and after
the private images are read through `ImageFolderSource`.

    git worktree add --detach /tmp/before e596614     # the in-memory version
    python experiments/cifar10_peak_rss.py --tree before=/tmp/before --tree after=.

Each tree runs ``python -m dpfl_tf train cifar10 --epochs 1 --seed 0`` (the
``dpfl-tf`` command; 20 lots of 2,000 on the 40,000 private images, the
pretrained weights of that tree's ``models/``) in its own process, with
``PYTHONPATH`` set to the tree and the data found through ``DPFL_DATA_DIR``
(the offline JPEG copy).  ``--repeats`` runs per tree: the first with an
empty cache directory (``DPFL_CACHE_DIR``, "cold": the old code decodes the
archive stream and writes its decoded ``.npz``, the new code extracts the
archive), the others with that cache ("warm").  Peak RSS is the process's
``ru_maxrss`` from ``wait4``.  Writes results/cifar10_peak_rss.json with the
commands, the environment, and accuracy / epsilon / seconds of each run (the
seconds are wall clock on whatever else the machine was doing: the load
average is recorded beside them).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import tempfile

from _common import DATA_DIR, RESULTS, commit_of, run_measured

from dpfl_tf._io import atomic_write_json

TRAIN_ARGS = ["train", "cifar10", "--epochs", "1", "--seed", "0"]


def run_once(tree: str, cache_dir: str, data_dir: str, output: str) -> dict:
    command = [sys.executable, "-m", "dpfl_tf", *TRAIN_ARGS, "--output", output]
    env = {
        **os.environ,
        "PYTHONPATH": tree,
        "DPFL_CACHE_DIR": cache_dir,
        "DPFL_DATA_DIR": data_dir,
        "TF_CPP_MIN_LOG_LEVEL": "3",
    }
    run = run_measured(command, cwd=tree, env=env, log=output + ".log")
    if run["exit_code"] != 0:
        raise RuntimeError(f"{run['command']} failed ({run['exit_code']}); see {output}.log")
    with open(output) as f:
        result = json.load(f)
    result = result.get("result", result)
    return {
        "command": (
            f"cd {tree} && PYTHONPATH={tree} DPFL_CACHE_DIR={cache_dir} "
            f"DPFL_DATA_DIR={data_dir} {shlex.join(['python', *command[1:]])}"
        ),
        "peak_rss_mb": run["peak_rss_mb"],
        "wall_seconds": run["wall_seconds"],
        "recipe_seconds": round(result["seconds"], 1),
        "epoch_seconds": round(result["history"][-1]["seconds"], 1),
        "test_accuracy": result["test_accuracy"],
        "start_test_accuracy": result["pretrained_on_cifar10_test"],
        "epsilon": result["epsilon"],
        "lots": result["lots"],
        "load_average_before": run["load_average_before"],
    }


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--tree",
        action="append",
        required=True,
        metavar="NAME=PATH",
        help="a checkout to measure (repeatable), e.g. before=/tmp/before",
    )
    p.add_argument("--repeats", type=int, default=2, help="runs per tree (first: cold cache)")
    p.add_argument("--data-dir", default=DATA_DIR)
    p.add_argument("--output", default=os.path.join(RESULTS, "cifar10_peak_rss.json"))
    args = p.parse_args(argv)

    out = {
        "what": "peak RSS of `dpfl-tf train cifar10 --epochs 1 --seed 0` (20 DP-SGD lots "
        "of 2,000 on the 40,000 private images of the offline JPEG copy, "
        "pretrained frozen convolutions from models/)",
        "cpu_count": os.cpu_count(),
        "data_dir": os.path.abspath(args.data_dir),
        "runs": {},
    }
    scratch = tempfile.mkdtemp(prefix="dpfl-peak-rss-")
    for spec in args.tree:
        name, _, tree = spec.partition("=")
        tree = os.path.abspath(tree)
        cache = os.path.join(scratch, f"cache-{name}")
        runs = []
        for i in range(args.repeats):
            row = run_once(
                tree,
                cache,
                os.path.abspath(args.data_dir),
                os.path.join(scratch, f"{name}-{i}.json"),
            )
            row["cache"] = "cold (empty cache directory)" if i == 0 else "warm"
            print(
                f"{name} run {i} ({row['cache']}): peak RSS {row['peak_rss_mb']} MB, "
                f"test accuracy {row['test_accuracy']:.4f}, {row['wall_seconds']} s",
                flush=True,
            )
            runs.append(row)
        out["runs"][name] = {
            "tree": tree,
            "commit": commit_of(tree),
            "runs": runs,
            "max_peak_rss_mb": max(r["peak_rss_mb"] for r in runs),
        }
    atomic_write_json(args.output, out)
    print(f"wrote {args.output}")
    return out


if __name__ == "__main__":
    main()
