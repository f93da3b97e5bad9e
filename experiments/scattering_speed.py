"""Throughput of `Scattering2D.transform` (J=2, L=8), the features the ScatterNet
recipes compute: CPU and wall seconds for N random images of CIFAR-10's shape
(32x32x3) and of MNIST's (28x28), after a warm-up call, the median of a few
repeats.  The transform works image by image, so seconds per image hold for the
full datasets (60,000 / 70,000 images); the images are random, not the datasets.

    python experiments/scattering_speed.py --label "after"

To compare with another commit, run this script from a worktree of that commit
(copied there if it lacks it) with ``--output`` pointing here: the row records
the commit of the checkout that ran.  Appends to results/scattering_speed.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from _common import RESULTS, ROOT, command_line, commit_of

SHAPES = {"cifar10": (32, 32, 3), "mnist": (28, 28)}


def measure(shape, images: int, batch_size: int, repeats: int) -> dict:
    import numpy as np

    from dpfl_tf.scattering import Scattering2D

    x = np.random.default_rng(0).random((images, *shape)).astype(np.float32)
    scattering = Scattering2D(J=2, L=8, shape=shape[:2])
    scattering.transform(x[: 2 * batch_size], batch_size=batch_size)  # traced here
    cpu, wall = [], []
    for _ in range(repeats):
        c0, w0 = time.process_time(), time.perf_counter()
        scattering.transform(x, batch_size=batch_size)
        cpu.append(time.process_time() - c0)
        wall.append(time.perf_counter() - w0)
    return {
        "images": images,
        "shape": list(shape),
        "cpu_seconds": [round(v, 2) for v in cpu],
        "wall_seconds": [round(v, 2) for v in wall],
        "median_cpu_seconds": round(statistics.median(cpu), 2),
        "median_wall_seconds": round(statistics.median(wall), 2),
    }


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--label", required=True)
    p.add_argument("--cifar10-images", type=int, default=2048)
    p.add_argument("--mnist-images", type=int, default=4096)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--output", default=os.path.join(RESULTS, "scattering_speed.json"))
    args = p.parse_args()
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    row = {
        "label": args.label,
        "commit": commit_of(ROOT),
        "command": command_line(),
        "batch_size": args.batch_size,
        "cpus": os.cpu_count(),
        "when": time.strftime("%Y-%m-%d %H:%M"),
    }
    for name, images in (("cifar10", args.cifar10_images), ("mnist", args.mnist_images)):
        row[name] = measure(SHAPES[name], images, args.batch_size, args.repeats)
        print(name, row[name], flush=True)
    rows = json.load(open(args.output)) if os.path.exists(args.output) else []
    rows.append(row)
    with open(args.output, "w") as f:
        json.dump(rows, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
