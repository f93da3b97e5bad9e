"""Peak memory and wall time of every `dpfl-tf train` recipe, as a user runs it.

    python experiments/recipe_memory.py                       # every recipe, this checkout
    python experiments/recipe_memory.py --only cifar10_scatter_linear --tree before=/tmp/old
    python experiments/recipe_memory.py --epochs 2            # shortened runs (labelled)

Each recipe is the command a user types (``python -m dpfl_tf train ...``, the
defaults of its model), run in its own process with ``PYTHONPATH`` set to the
checkout measured (``--tree name=path``, default this one), the data found
through ``DPFL_DATA_DIR`` and the scattering features in a cache directory of
the run's own (``DPFL_CACHE_DIR``; ``--cache-dir`` to share one between trees,
so that only the first run computes them).  Peak RSS is the child's
``ru_maxrss`` (what ``/usr/bin/time -v`` calls "Maximum resident set size":
anonymous memory and mapped file pages).  The wall time is on whatever else
the machine was doing: the load average before each run is recorded beside
it.  ``--epochs`` shortens every run (such rows say so in ``epochs_cap``).

Writes (merges into) results/recipe_memory.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

from _common import DATA_DIR, RESULTS, ROOT, commit_of, run_measured

RECIPES = {
    "mnist_mlp": ["train", "mnist", "--epsilon", "2"],
    "fashion_mnist_scatter_linear": [
        "train",
        "fashion_mnist",
        "--model",
        "scatter_linear",
        "--epsilon",
        "3",
    ],
    "cifar10_scatter_linear": ["train", "cifar10", "--model", "scatter_linear", "--epsilon", "3"],
    "cifar10_scatter_cnn": ["train", "cifar10", "--model", "scatter_cnn", "--epsilon", "3"],
    "cifar10_convnet": ["train", "cifar10", "--epsilon", "2"],
    # the defaults alone (epsilon 2): what `train --help` says they reach
    "mnist_scatter_cnn": ["train", "mnist", "--model", "scatter_cnn"],
    "cifar10_scatter_cnn_eps2": ["train", "cifar10", "--model", "scatter_cnn"],
}


def measure(name: str, tree: str, args, scratch: str) -> dict:
    output = os.path.join(scratch, f"{name}.json")
    command = [sys.executable, "-m", "dpfl_tf", *RECIPES[name], "--seed", "0", "--output", output]
    if args.epochs is not None:
        command += ["--epochs", str(args.epochs)]
    cache = args.cache_dir or os.path.join(scratch, "cache")
    env = {
        **os.environ,
        "PYTHONPATH": tree,
        "DPFL_CACHE_DIR": cache,
        "DPFL_DATA_DIR": os.path.abspath(args.data_dir),
    }
    row = run_measured(command, cwd=tree, env=env, log=output + ".log")
    row["command"] = row["command"].replace(sys.executable, "python")
    if row["exit_code"] != 0:
        with open(output + ".log") as f:
            row["error"] = f.read()[-2000:]
        return row
    with open(output) as f:
        result = json.load(f)
    row.update(
        {
            k: result.get(k)
            for k in ("test_accuracy", "epsilon", "epochs", "lots", "seconds", "noise_multiplier")
        }
    )
    row["epochs_cap"] = args.epochs
    return row


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", nargs="+", choices=sorted(RECIPES), default=sorted(RECIPES))
    p.add_argument(
        "--tree",
        action="append",
        metavar="NAME=PATH",
        help="a checkout to measure (repeatable); default this one as 'current'",
    )
    p.add_argument(
        "--epochs",
        type=int,
        default=None,
        help="cap every run at this many epochs (shortened rows, labelled)",
    )
    p.add_argument(
        "--cache-dir",
        default=None,
        help="a scattering-feature cache shared by the runs (default: a fresh "
        "one per tree and recipe: every run computes its features)",
    )
    p.add_argument("--data-dir", default=DATA_DIR)
    p.add_argument("--output", default=os.path.join(RESULTS, "recipe_memory.json"))
    args = p.parse_args(argv)
    trees = args.tree or [f"current={ROOT}"]
    try:
        with open(args.output) as f:
            out = json.load(f)
    except FileNotFoundError:
        out = {
            "what": "peak RSS (ru_maxrss, as /usr/bin/time -v) and wall time of each "
            "`dpfl-tf train` recipe with its defaults, one process each",
            "cpu_count": os.cpu_count(),
            "rows": {},
        }
    for spec in trees:
        tree_name, _, tree = spec.partition("=")
        tree = os.path.abspath(tree)
        for name in args.only:
            scratch = tempfile.mkdtemp(prefix=f"dpfl-memory-{name}-")
            row = measure(name, tree, args, scratch)
            row.update(tree=tree_name, commit=commit_of(tree))
            key = f"{tree_name}/{name}" + (f"/epochs{args.epochs}" if args.epochs else "")
            out["rows"][key] = row
            print(
                f"{key}: peak RSS {row['peak_rss_mb']} MB, {row['wall_seconds']} s, "
                f"test accuracy {row.get('test_accuracy')}, exit {row['exit_code']}",
                flush=True,
            )
            from dpfl_tf._io import atomic_write_json

            atomic_write_json(args.output, out)
    return out


if __name__ == "__main__":
    main()
