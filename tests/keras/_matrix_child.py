"""Runs the verification matrix of DPModel training modes in one process with
two logical CPUs (MirroredStrategy needs them configured before TensorFlow
starts) and prints one JSON line of measurements per cell.

Cell = sampling x execution (eager / graph / XLA, steps_per_execution 1 or 3)
x distribution (none / MirroredStrategy on 2 logical CPUs) x clipping (flat /
per-layer) x scenario (plain fit / a target that stops training / a rollback
callback under a target / kill and resume from a checkpoint); `cells` runs every
combination of any three of these factors (a covering array of strength 3).

The model's input has NOISE_FEATURES always-zero features, so the rows of
``fc1``'s kernel that read them get a zero gradient: their change over a
Keras step is the DP noise alone, -lr * N(0, s^2) / L per lot, with
s = sigma * C_tot.  The test reads, per step, the change of those rows and the
number of lots counted, and checks sum(change^2) / (coords * (lr s / L)^2)
against the lots counted.
"""

from __future__ import annotations

import itertools
import json
import os
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402

_cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(_cpu, [tf.config.LogicalDeviceConfiguration()] * 2)

import keras  # noqa: E402
import numpy as np  # noqa: E402

from dpfl_tf.keras import DPSGD, DPCheckpoint, DPModel  # noqa: E402
from tests.keras.helpers import mnist_slice  # noqa: E402

SAMPLINGS = ("poisson", "fixed_size", "shuffle")
EXECUTIONS = (("eager", 1), ("graph", 1), ("graph", 3), ("xla", 1), ("xla", 3))
DISTRIBUTIONS = ("none", "mirrored")
CLIPS = ("flat", "per_layer")
SCENARIOS = ("plain", "target", "rollback", "resume")

N, LOT, FEATURES, NOISE_FEATURES, HIDDEN = 60, 10, 8, 24, 64
LOTS_PER_EPOCH = N // LOT
SIGMA, LR = 1.0, 1.0
CLIP_SPEC = {"flat": 1.0, "per_layer": {"fc1": 1.0, "out": 2.0}}
CLIP_TOTAL = {"flat": 1.0, "per_layer": float(np.sqrt(1.0 + 4.0))}


FACTORS = {
    "sampling": SAMPLINGS,
    "execution": EXECUTIONS,
    "distribution": DISTRIBUTIONS,
    "clip": CLIPS,
    "scenario": SCENARIOS,
}
#: every combination of values of any STRENGTH factors is run in some cell
STRENGTH = 3


def _cell(combo) -> dict:
    sampling, (execution, spe), dist, clip, scenario = combo
    return dict(
        sampling=sampling,
        execution=execution,
        spe=spe,
        distribution=dist,
        clip=clip,
        scenario=scenario,
    )


def all_cells() -> list[dict]:
    """The full product of the factors (240 cells)."""
    return [_cell(c) for c in itertools.product(*FACTORS.values())]


def interactions(cell: dict, strength: int = STRENGTH) -> set:
    """The (factors, values) combinations of `strength` factors that `cell` runs."""
    values = (
        cell["sampling"],
        (cell["execution"], cell["spe"]),
        cell["distribution"],
        cell["clip"],
        cell["scenario"],
    )
    return {
        (idx, tuple(values[i] for i in idx))
        for idx in itertools.combinations(range(len(values)), strength)
    }


def cells() -> list[dict]:
    """Every refused combination (refused before any lot: cheap), and of the
    combinations the library runs a covering array of strength STRENGTH: every
    combination of values of any three factors that the library runs (e.g.
    MirroredStrategy x per-layer clipping x resume, or XLA with 3 steps per
    execution x shuffle x a target) is run in at least one cell -- 63 of the 168
    the full product runs.  Chosen greedily (the cell covering most combinations
    not yet covered, the first in product order on a tie): deterministic."""
    full = all_cells()
    running = [c for c in full if refused(c) is None]
    uncovered = set().union(*(interactions(c) for c in running))
    chosen = set()
    while uncovered:
        best = max(range(len(running)), key=lambda i: len(interactions(running[i]) & uncovered))
        chosen.add(best)
        uncovered -= interactions(running[best])
    keep = [running[i] for i in sorted(chosen)]
    return [c for c in full if refused(c) is not None or c in keep]


def refused(cell) -> str | None:
    """Why a cell is refused by the library (the test checks the error), or None."""
    if cell["distribution"] == "mirrored" and cell["spe"] > 1:
        return "steps_per_execution must be 1 under a distribution strategy"
    if cell["distribution"] == "mirrored" and cell["execution"] == "xla":
        return "jit_compile must be False under a distribution strategy"
    return None


def data():
    x, y = mnist_slice(N, features=FEATURES)
    x = np.concatenate([x, np.zeros((N, NOISE_FEATURES), np.float32)], axis=1)
    return x, y % 3


class Probe(keras.callbacks.Callback):
    """Per Keras step: lots counted and the change of the zero-input kernel rows."""

    def __init__(self):
        super().__init__()
        self.steps = []

    def _rows(self):
        kernel = self.model.model.get_layer("fc1").kernel.numpy()
        return kernel[FEATURES:].copy()

    def on_train_batch_begin(self, batch, logs=None):
        self._before = (self.model.lots_computed, self.model.lots_applied, self._rows())

    def on_train_batch_end(self, batch, logs=None):
        c0, a0, w0 = self._before
        w1 = self._rows()
        self.steps.append(
            (
                self.model.lots_computed - c0,
                self.model.lots_applied - a0,
                float(np.sum((w1 - w0) ** 2)),
            )
        )


class Rollback(keras.callbacks.Callback):
    """Restores the initial weights after the first epoch (what
    EarlyStopping(restore_best_weights=True), BackupAndRestore or a plain
    set_weights do): the lot counter in the weights goes back to 0."""

    def on_train_begin(self, logs=None):
        self.saved = self.model.get_weights()

    def on_epoch_end(self, epoch, logs=None):
        if epoch == 0:
            self.model.set_weights(self.saved)


class Kill(keras.callbacks.Callback):
    def __init__(self, after_lots: int):
        super().__init__()
        self.after_lots = after_lots

    def on_train_batch_end(self, batch, logs=None):
        if self.model.lots_computed >= self.after_lots:
            raise KeyboardInterrupt("killed by the test")


def build(cell, strategy):
    with strategy.scope():
        inner = keras.Sequential(
            [
                keras.Input((FEATURES + NOISE_FEATURES,)),
                keras.layers.Dense(HIDDEN, activation="tanh", name="fc1"),
                keras.layers.Dense(3, name="out"),
            ]
        )
        model = DPModel(inner, accountant="rdp")
        compile_model(
            model, cell, DPSGD(LR, l2_norm_clip=CLIP_SPEC[cell["clip"]], noise_multiplier=SIGMA)
        )
    return model


def compile_model(model, cell, optimizer):
    model.compile(
        optimizer=optimizer,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        run_eagerly=cell["execution"] == "eager",
        jit_compile=cell["execution"] == "xla",
        steps_per_execution=cell["spe"],
    )


_MIRRORED = []


def mirrored():
    """One MirroredStrategy for the process (several in one process collide in
    their collective-op keys)."""
    if not _MIRRORED:
        _MIRRORED.append(tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"]))
    return _MIRRORED[0]


def run_cell(cell, x, y):
    strategy = mirrored() if cell["distribution"] == "mirrored" else tf.distribute.get_strategy()
    model = build(cell, strategy)
    fit_args = dict(lot_size=LOT, batch_size=4, sampling=cell["sampling"], verbose=0)
    probe = Probe()
    out = dict(cell)
    reason = refused(cell)
    if reason is not None:
        try:
            model.fit(x, y, epochs=1, callbacks=[probe], **fit_args)
            out["refusal"] = None
        except ValueError as err:
            out["refusal"] = str(err)
        out["lots_computed"] = model.lots_computed
        return out

    target = None
    scenario = cell["scenario"]
    if scenario == "plain":
        model.fit(x, y, epochs=2, callbacks=[probe], **fit_args)
        out["expected_lots"] = 2 * LOTS_PER_EPOCH
    elif scenario in ("target", "rollback"):
        target = _target(cell)
        callbacks = [probe] + ([Rollback()] if scenario == "rollback" else [])
        model.fit(x, y, epochs=4, callbacks=callbacks, target_epsilon=target, **fit_args)
        out["stop_reason"] = model.stop_reason
    else:  # resume: killed mid-epoch 2, restored from the epoch-1 checkpoint
        directory = tempfile.mkdtemp(prefix="dp-matrix-")
        try:
            model.fit(
                x,
                y,
                epochs=3,
                callbacks=[probe, DPCheckpoint(directory), Kill(LOTS_PER_EPOCH + 2)],
                **fit_args,
            )
        except KeyboardInterrupt:
            pass
        out["killed_at"] = model.lots_computed
        with strategy.scope():
            model, initial_epoch = DPCheckpoint.restore(directory)
        out["restored_lots"] = model.lots_computed
        out["restored_epoch"] = initial_epoch
        compile_model(model, cell, model.optimizer)
        model.fit(x, y, epochs=3, initial_epoch=initial_epoch, callbacks=[probe], **fit_args)
        out["expected_lots"] = 3 * LOTS_PER_EPOCH
    ledger = model.privacy_ledger
    out.update(
        target=target,
        lots_computed=model.lots_computed,
        lots_applied=model.lots_applied,
        ledger_lots=_ledger_lots(cell, ledger),
        epsilon=ledger.epsilon(1e-5, "rdp"),
        finite=bool(all(np.all(np.isfinite(w)) for w in model.get_weights())),
        steps=probe.steps,
        noise_var_per_lot=(LR * SIGMA * CLIP_TOTAL[cell["clip"]] / LOT) ** 2,
        noise_coords=NOISE_FEATURES * HIDDEN,
    )
    return out


def _ledger_lots(cell, ledger) -> int:
    """Lots the ledger accounts for (shuffle records epochs: one per epoch touched)."""
    if cell["sampling"] == "shuffle":
        return ledger.count() * LOTS_PER_EPOCH
    return ledger.count()


def _target(cell) -> float:
    """A target epsilon that allows 8 lots (poisson, fixed_size) or one epoch
    (shuffle: accounted per epoch), computed here from dp-accounting's RDP."""
    from dpfl_tf.privacy import compute_epsilon
    from dpfl_tf.privacy.events import dp_sgd_event

    if cell["sampling"] == "shuffle":
        event = dp_sgd_event(SIGMA, 1, "shuffle", epochs=1)
    elif cell["sampling"] == "poisson":
        event = dp_sgd_event(SIGMA, 8, "poisson", sampling_rate=LOT / N)
    else:
        event = dp_sgd_event(SIGMA, 8, "fixed_size", dataset_size=N, lot_size=LOT)
    return compute_epsilon(event, 1e-5, "rdp") + 1e-6


def shard_of(index: int, cell_list: list[dict], shards: int) -> int:
    """The shard of cell `index`: the running cells dealt round-robin in scenario
    order (which balances the costly resume cells); refused cells likewise."""
    order = sorted(
        range(len(cell_list)),
        key=lambda i: (refused(cell_list[i]) is not None, cell_list[i]["scenario"], i),
    )
    return order.index(index) % shards


def main():
    """Arguments: cell indices to run, or ``--shard K/S`` (`shard_of`)."""
    x, y = data()
    args = sys.argv[1:]
    shard = None
    if args[:1] == ["--shard"]:
        k, total = (int(v) for v in args[1].split("/"))
        shard, args = (k, total), args[2:]
    only = set(args) or None
    cell_list = cells()
    for i, cell in enumerate(cell_list):
        if only and str(i) not in only:
            continue
        if shard and shard_of(i, cell_list, shard[1]) != shard[0]:
            continue
        t0 = time.time()
        out = run_cell(cell, x, y)
        out["seconds"] = round(time.time() - t0, 2)
        out["index"] = i
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
