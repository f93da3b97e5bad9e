"""Where a federated round's time goes, and whether training the round's
clients together would make it faster (issue: the K = 10,000 run took 78 min).

For each of Geyer et al.'s settings (`federated_dp.SETTINGS`: K, the network,
E local epochs, batch 10) it measures, on the same sampled clients:

* ``one_by_one``: `LocalTrainer.train`, one client per call (what every
  round runs today: a ``tf.while_loop`` over the client's batches);
* ``together``: a prototype that trains G clients in one XLA call -- the G
  clients' weights stacked on a leading axis, ``tf.vectorized_map`` of
  ``model.stateless_call`` over them, one gradient of the summed client
  losses (each client's own gradient), padded batches and steps masked out;
  it lives here, not in the library (see the verdict below);
* the whole round (`FederatedServer.run_round`, Global DP: training, clipping,
  the noised sum, the accountant), so the training's share of the round shows.

Per client it also reports the arithmetic (6 x examples x parameters FLOPs per
local pass) and the weight traffic (each local step reads and writes every
weight several times), to tell op dispatch from arithmetic from memory.  The
two trainers' updates for the same client are compared (largest |difference|).
Times are medians over interleaved repeats (one_by_one, together, one_by_one,
...) so that a drift in machine load hits both.

    python experiments/federated_client_loop.py                 # K = 100, 1,000, 10,000
    python experiments/federated_client_loop.py --clients 100 --group 50

Writes results/federated_client_loop.json.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np
from _common import RESULTS, commit_of
from federated_dp import SETTINGS

from dpfl_tf._io import atomic_write_json


def batched_trainer(trainer, group: int):
    """The prototype: `fn(global_weights, indices_list, rngs) -> deltas` training
    `group` clients per XLA call with `trainer`'s model, data and plain SGD."""
    import keras
    import tensorflow as tf

    if trainer.momentum:
        raise ValueError("the prototype runs plain SGD (momentum 0)")
    model = trainer.model
    example_loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)

    def client_loss(args):
        weights, xb, yb, mb = args
        logits, _ = model.stateless_call(list(weights), [], xb, training=True)
        return tf.reduce_sum(example_loss(yb, logits) * mb) / tf.maximum(tf.reduce_sum(mb), 1.0)

    @tf.function(jit_compile=True)
    def train_group(w0, grid, mask, lr):
        ws = [tf.tile(w[None], [group] + [1] * len(w.shape)) for w in w0]

        def step(s, ws):
            idx = grid[:, s]
            xb, yb, mb = tf.gather(trainer.x, idx), tf.gather(trainer.y, idx), mask[:, s]
            with tf.GradientTape() as tape:
                tape.watch(ws)
                total = tf.reduce_sum(tf.vectorized_map(client_loss, (ws, xb, yb, mb)))
            grads = tape.gradient(total, ws)  # a padded step's gradient is 0: w stays
            return s + 1, [w - lr * tf.ensure_shape(g, w.shape) for w, g in zip(ws, grads)]

        _, ws = tf.while_loop(lambda s, ws: s < tf.shape(grid)[1], step, (0, ws))
        return [w - w_0[None] for w, w_0 in zip(ws, w0)]

    def train(global_weights, clients, rngs):
        out = []
        for first in range(0, len(clients), group):
            chunk = list(zip(clients[first : first + group], rngs[first : first + group]))
            orders = [
                np.concatenate([rng.permutation(idx) for _ in range(trainer.local_epochs)])
                for idx, rng in chunk
            ]
            bounds = [trainer.batch_bounds(len(idx)) for idx, _ in chunk]
            steps = max(len(s) for s, _ in bounds)
            grid = np.zeros((group, steps, trainer.batch_size), np.int32)
            mask = np.zeros(grid.shape, np.float32)
            for i, (order, (starts, ends)) in enumerate(zip(orders, bounds)):
                for s, (lo, hi) in enumerate(zip(starts, ends)):
                    grid[i, s, : hi - lo], mask[i, s, : hi - lo] = order[lo:hi], 1.0
            deltas = train_group(
                list(global_weights), tf.constant(grid), tf.constant(mask), trainer._lr
            )
            out += [[d[i] for d in deltas] for i in range(len(chunk))]
        return out

    return train


def measure(k: int, args, dataset) -> dict:
    from dpfl_tf.federated.runner import FederatedConfig, build_server

    s = SETTINGS[k]
    config = FederatedConfig(
        dataset="mnist",
        clients=k,
        clients_per_round=s["m"],
        sampling="poisson",
        partition="shards",
        local_epochs=s["epochs"],
        learning_rate=s["lr"],
        hidden=s["hidden"],
        dp="global",
        noise_multiplier=s["sigma"],
        seed=0,
        eval_every=10**6,
    )
    server = build_server(config, dataset, progress=False)[0]
    trainer = server.trainer
    w0 = trainer.get_weights()
    ids = [int(c) for c in np.random.default_rng(0).choice(k, size=args.sample, replace=False)]
    clients = [server.partition.client(c) for c in ids]
    params = sum(int(np.prod(v.shape)) for v in trainer.variables)
    group = args.group or min(64, args.sample)
    together = batched_trainer(trainer, group)

    def one_by_one():
        return [trainer.train(w0, idx, np.random.default_rng(c)) for c, idx in zip(ids, clients)]

    def in_groups():
        return together(w0, clients, [np.random.default_rng(c) for c in ids])

    timed = {"one_by_one": one_by_one, "together": in_groups}
    first = {name: fn() for name, fn in timed.items()}  # traces and compiles
    diff = max(
        float(np.max(np.abs(a.numpy() - b.numpy())))
        for da, db in zip(first["one_by_one"], first["together"])
        for a, b in zip(da, db)
    )
    seconds = {name: [] for name in timed}
    for r in range(args.repeats):
        for name in list(timed) if r % 2 == 0 else list(timed)[::-1]:
            start = time.perf_counter()
            out = timed[name]()
            out[-1][0].numpy()
            seconds[name].append((time.perf_counter() - start) / len(ids))
    rounds = []
    for _ in range(args.rounds):
        rounds.append(server.run_round())
    per_client = {name: float(np.median(v)) for name, v in seconds.items()}
    examples = float(np.mean([len(c) for c in clients])) * s["epochs"]
    steps = float(np.mean([len(trainer.batch_bounds(len(c))[0]) for c in clients]))
    flops = 6.0 * examples * params
    # a step reads the weights for the forward pass and the backward pass, writes the
    # gradient, reads both and writes the new weights: about 5 passes of 4 bytes
    weight_bytes = steps * 5 * 4 * params
    round_seconds = float(np.median([r.seconds for r in rounds[1:]]))
    round_clients = float(np.median([r.clients for r in rounds[1:]]))
    out = {
        "clients": k,
        "clients_per_round": s["m"],
        "hidden": list(s["hidden"]),
        "local_epochs": s["epochs"],
        "parameters": params,
        "sampled_clients_timed": len(ids),
        "group": group,
        "local_steps_per_client": steps,
        "seconds_per_client": per_client,
        "together_speedup": per_client["one_by_one"] / per_client["together"],
        "max_abs_update_difference": diff,
        "gflops_one_by_one": flops / per_client["one_by_one"] / 1e9,
        "weight_gb_per_second_one_by_one": weight_bytes / per_client["one_by_one"] / 1e9,
        "median_round_seconds": round_seconds,
        "median_round_clients": round_clients,
        "training_share_of_round": per_client["one_by_one"] * round_clients / round_seconds,
        "repeats": args.repeats,
    }
    print(
        f"K={k}: {per_client['one_by_one'] * 1e3:.2f} ms a client one by one, "
        f"{per_client['together'] * 1e3:.2f} ms together (G = {group}, x"
        f"{out['together_speedup']:.2f}); {out['gflops_one_by_one']:.1f} GFLOP/s, "
        f"{out['weight_gb_per_second_one_by_one']:.1f} GB/s of weights; round "
        f"{round_seconds:.2f} s for {round_clients:.0f} clients, training "
        f"{100 * out['training_share_of_round']:.0f}% of it; updates differ by <= {diff:.1e}",
        flush=True,
    )
    return out


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clients", type=int, nargs="+", default=sorted(SETTINGS))
    p.add_argument("--sample", type=int, default=64, help="clients timed per repeat")
    p.add_argument("--group", type=int, help="G, clients per XLA call (default min(64, sample))")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument(
        "--rounds", type=int, default=4, help="whole rounds timed (the first is dropped)"
    )
    p.add_argument("--output-dir", default=RESULTS)
    args = p.parse_args(argv)
    from dpfl_tf.data import load_dataset

    dataset = load_dataset("mnist")
    rows = [measure(k, args, dataset) for k in args.clients]
    path = os.path.join(args.output_dir, "federated_client_loop.json")
    atomic_write_json(path, {"commit": commit_of(), "runs": rows})
    print(f"wrote {path}")
    return rows


if __name__ == "__main__":
    main()
