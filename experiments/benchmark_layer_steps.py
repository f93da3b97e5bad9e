"""The gradient step alone, DP against non-private, for the models of
`benchmark_layers.py` (issue 16): where the epoch benchmark compares whole
`fit` epochs (Keras's input pipeline, optimizer and callbacks included), this
times one compiled function per side on the same fixed batch, interleaved
(plain, DP, plain, DP, ...) in one process, median of the repeats:

  plain  d mean-loss / d weights (one tape, `tf.function`)
  dp     `PerExampleGradients.compute`: per-example norms of every variable and
         the clipped sum (clip 1), i.e. everything DP-SGD adds except noise

    python experiments/benchmark_layer_steps.py                 # all four, batch 256
    python experiments/benchmark_layer_steps.py --models lstm --batch 512

writes results/benchmark_layer_steps.json.  Data are the same synthetic
arrays as the epoch benchmark (content does not change the cost).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from _common import RESULTS


def time_model(name: str, batch: int, repeats: int) -> dict:
    import benchmark_layers as bl
    import keras
    import tensorflow as tf

    from dpfl_tf.keras.per_example import PerExampleGradients

    keras.utils.set_random_seed(0)
    x, y = (tf.constant(a) for a in bl.make_data(name, batch))
    model = bl.build_model(name)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    per_example = PerExampleGradients(model, loss)

    @tf.function
    def plain(x, y):
        with tf.GradientTape() as tape:
            value = tf.reduce_mean(loss(y, model(x, training=True)))
        return [tf.convert_to_tensor(g) for g in tape.gradient(value, model.trainable_variables)]

    def clip_one(sq):
        factor = 1.0 / tf.maximum(tf.sqrt(tf.add_n(sq)), 1.0)
        return [factor] * len(sq)

    @tf.function
    def dp(x, y):
        return per_example.compute(x, y, tf.ones(tf.shape(y)[0]), clip_one)[0]

    def run(fn):
        start = time.perf_counter()
        [g.numpy() for g in fn(x, y)]
        return time.perf_counter() - start

    run(plain), run(dp)  # trace and warm up
    times = {"plain": [], "dp": []}
    for _ in range(repeats):
        times["plain"].append(run(plain))
        times["dp"].append(run(dp))
    med = {k: statistics.median(v) for k, v in times.items()}
    return {
        "model": name,
        "batch": batch,
        "plain_seconds": med["plain"],
        "dp_seconds": med["dp"],
        "ratio": med["dp"] / med["plain"],
        "times": times,
    }


def main(argv=None):
    import benchmark_layers as bl

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=list(bl.MODELS), choices=bl.MODELS)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--output", default=os.path.join(RESULTS, "benchmark_layer_steps.json"))
    args = p.parse_args(argv)
    from dpfl_tf._io import atomic_write_json

    rows = []
    for name in args.models:
        row = time_model(name, args.batch, args.repeats)
        rows.append(row)
        print(
            f"{name:12s} batch {args.batch}: plain {row['plain_seconds']:.3f} s, "
            f"dp {row['dp_seconds']:.3f} s, x{row['ratio']:.2f}",
            flush=True,
        )
    atomic_write_json(args.output, {"description": __doc__.split("\n\n")[0], "rows": rows})
    print(f"wrote {args.output}")
    return rows


if __name__ == "__main__":
    main()
