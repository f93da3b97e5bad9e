"""Child process of test_resume.py: a small DP training run (Keras or federated)
that checkpoints as it goes and can be SIGKILLed and started again.

    python -m tests.audit._resume_child keras DIR [--slow]
    python -m tests.audit._resume_child federated DIR

Keras: DP-SGD on 1,200 real MNIST examples, 3 epochs of 20 lots, a
`DPCheckpoint` every epoch, each applied lot appended to DIR/lots.log (the
model's counter after the lot) by this process.  If DIR holds a checkpoint
the run resumes from it.  At the end DIR/report.json says what the model
holds.  --slow sleeps after each lot so the parent can kill mid-epoch.

Federated: Global DP FedAvg on 10 clients, 5 rounds, checkpoints every round
(`FederatedServer`), resuming from DIR if it holds one; DIR/report.json at
the end.
"""

import json
import os
import sys
import time

NOISE, CLIP, LOT, N, EPOCHS = 1.1, 1.0, 60, 1200, 3


def keras_run(directory: str, slow: bool) -> None:
    import keras

    from dpfl_tf.keras import DPSGD, DPModel
    from dpfl_tf.keras.checkpoint import DPCheckpoint
    from tests.keras.helpers import loss, mlp, mnist_slice

    x, y = mnist_slice(N, features=60)
    state = DPCheckpoint.latest(directory)
    if state is None:
        model, initial_epoch = DPModel(mlp(hidden=16)), 0
        # one lot per call: lots.log has a line per lot, and --slow sleeps after each
        model.compile(
            optimizer=DPSGD(0.2, momentum=0.5, l2_norm_clip=CLIP, noise_multiplier=NOISE),
            loss=loss(),
            steps_per_execution=1,
        )
    else:
        model, initial_epoch = DPCheckpoint.restore(directory)
    restored_lots = model.lots_applied
    log = open(os.path.join(directory, "lots.log"), "a")

    class LotLog(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            log.write(f"{os.getpid()} {self.model.lots_applied}\n")
            log.flush()
            if slow:
                time.sleep(0.1)

    model.fit(
        x,
        y,
        lot_size=LOT,
        batch_size=LOT,
        epochs=EPOCHS,
        initial_epoch=initial_epoch,
        callbacks=[DPCheckpoint(directory), LotLog()],
        verbose=0,
    )
    ledger = model.privacy_ledger
    report = {
        "pid": os.getpid(),
        "initial_epoch": initial_epoch,
        "restored_lots": restored_lots,
        "lots_applied": model.lots_applied,
        "optimizer_iterations": int(model.optimizer.iterations.numpy()),
        "ledger_count": ledger.count(),
        "ledger": ledger.entries,
        "epsilon": model.epsilon(1e-5),
    }
    with open(os.path.join(directory, "report.json"), "w") as f:
        json.dump(report, f)


def federated_config():
    from dpfl_tf.federated.runner import FederatedConfig

    return FederatedConfig(
        dataset="mnist",
        clients=10,
        train_subset=600,
        clients_per_round=5,
        rounds=5,
        local_epochs=10,
        local_batch_size=10,
        hidden=(16,),
        dp="global",
        clip=1.0,
        noise_multiplier=1.0,
        delta_max=1e-3,
        seed=0,
    )


def federated_run(directory: str) -> None:
    from dpfl_tf.federated.runner import run_federated

    start_round = 0
    state_path = os.path.join(directory, "state.json")
    if os.path.exists(state_path):
        with open(state_path) as f:
            start_round = json.load(f)["round"]
    result = run_federated(federated_config(), progress=False, checkpoint_dir=directory)
    report = {
        "pid": os.getpid(),
        "start_round": start_round,
        "rounds": result["rounds"],
        "ledger_rounds": result["privacy"]["rounds"],
        "epsilon": result["epsilon"],
        "history_rounds": [r["round"] for r in result["history"]],
    }
    with open(os.path.join(directory, "report.json"), "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    kind, directory = sys.argv[1], sys.argv[2]
    if kind == "keras":
        keras_run(directory, "--slow" in sys.argv)
    else:
        federated_run(directory)
