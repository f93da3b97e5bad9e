"""Where a DP-SGD step's time goes, piece by piece, against a non-private step.

On one fixed lot (the first L examples, all real), each piece is one compiled
function, timed in interleaved rounds (100 calls each, median of the rounds):

  nonprivate_step     Keras forward + backward + SGD update (the baseline)
  nonprivate_grads    forward + backward only
  dp_clipped_sum      per-example norms (layer rules) and the clipped sum
  dp_lot              + noise once per lot, the non-finite check, loss sums
  dp_train_step       DPModel.train_step: + the budget guard, counters, update
  lot_sampling        one Poisson lot's indices drawn in the graph (N draws)

The differences say what DP adds: norms (dp_clipped_sum - nonprivate_grads),
noise and bookkeeping (dp_lot - dp_clipped_sum), and the lot sampling that
the input pipeline runs beside the step (on the same cores).  A diagnosis,
not the speed claim: `experiments/benchmark_dpsgd.py` times whole epochs.

    python experiments/profile_dpsgd_step.py                    # paper MNIST MLP, lot 600
    python experiments/profile_dpsgd_step.py --model cifar_full_conv
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

from _common import RESULTS, command_line
from benchmark_dpsgd import CLIP, FULL_SIZE, LR, MODELS, NOISE, _data, _model


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="mnist_mlp", choices=MODELS)
    p.add_argument("--lot-size", type=int, default=600)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--calls", type=int, default=100, help="calls per round")
    p.add_argument("--output", default=None, help="default results/profile_dpsgd_step_<model>.json")
    args = p.parse_args(argv)

    import keras
    import numpy as np
    import tensorflow as tf

    from dpfl_tf._io import atomic_write_json
    from dpfl_tf.keras import DPSGD, DPModel
    from dpfl_tf.keras.sampling import LotSampler

    n = FULL_SIZE[args.model]
    x, y = _data(args.model, n)
    lot = args.lot_size
    xb, yb, mask = tf.constant(x[:lot]), tf.constant(y[:lot]), tf.ones([lot])
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    plain = _model(args.model)
    sgd = keras.optimizers.SGD(LR)
    plain.compile(optimizer=sgd, loss=loss)
    dp = DPModel(_model(args.model))
    dp.compile(optimizer=DPSGD(LR, l2_norm_clip=CLIP, noise_multiplier=NOISE), loss=loss)
    dp.fit(x[: 2 * lot], y[: 2 * lot], lot_size=lot, epochs=1, verbose=0)  # builds, prepares
    variables = plain.trainable_variables

    @tf.function
    def nonprivate_grads():
        with tf.GradientTape() as tape:
            value = loss(yb, plain(xb, training=True))
        return tape.gradient(value, variables)

    @tf.function
    def nonprivate_step():
        with tf.GradientTape() as tape:
            value = loss(yb, plain(xb, training=True))
        sgd.apply(tape.gradient(value, variables), variables)
        return value

    @tf.function
    def dp_clipped_sum():
        return dp._per_example.compute(xb, yb, mask, dp._sanitizer.clip_factors)[0]

    @tf.function
    def dp_lot():
        return dp._dp_lot(xb, yb, mask)[0]

    @tf.function
    def dp_train_step():
        return list(dp.train_step((xb, yb, mask)).values())

    sampler = LotSampler(n, lot, seed=0)

    @tf.function
    def lot_sampling():
        return sampler._lot_in_graph(tf.constant(7, tf.int64))

    pieces = {
        "nonprivate_step": nonprivate_step,
        "nonprivate_grads": nonprivate_grads,
        "dp_clipped_sum": dp_clipped_sum,
        "dp_lot": dp_lot,
        "dp_train_step": dp_train_step,
        "lot_sampling": lot_sampling,
    }

    def run(fn):
        out = None
        for _ in range(args.calls):
            out = fn()
        while isinstance(out, (list, tuple)):
            out = out[0]
        np.asarray(out)  # wait for the last call

    for fn in pieces.values():
        run(fn)  # trace and warm up
    times = {name: [] for name in pieces}
    for _ in range(args.rounds):
        for name, fn in pieces.items():
            start = time.perf_counter()
            run(fn)
            times[name].append((time.perf_counter() - start) / args.calls * 1e3)
    ms = {name: statistics.median(t) for name, t in times.items()}
    base = ms["nonprivate_step"]
    for name, value in ms.items():
        print(f"{name:18s} {value:8.3f} ms   x{value / base:.2f} of the non-private step")
    print(
        f"norms ~{ms['dp_clipped_sum'] - ms['nonprivate_grads']:.3f} ms, noise and "
        f"bookkeeping ~{ms['dp_lot'] - ms['dp_clipped_sum']:.3f} ms, lot sampling "
        f"{ms['lot_sampling']:.3f} ms (input pipeline)"
    )
    report = {
        "description": __doc__.split("\n\n")[0],
        "model": args.model,
        "examples": n,
        "lot_size": lot,
        "rounds": args.rounds,
        "calls": args.calls,
        "median_ms": ms,
        "ratio_to_nonprivate_step": {k: v / base for k, v in ms.items()},
        "round_ms": times,
        "command": command_line(),
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "load_average_at_end": os.getloadavg(),
        },
        "tensorflow_version": tf.__version__,
        "keras_version": keras.__version__,
    }
    output = args.output or os.path.join(RESULTS, f"profile_dpsgd_step_{args.model}.json")
    atomic_write_json(output, report)
    print(f"wrote {output}")
    return report


if __name__ == "__main__":
    main()
