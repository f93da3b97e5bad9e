"""One worker of a two-worker MultiWorkerMirroredStrategy cluster on 127.0.0.1
(TF_CONFIG set by tests/keras/test_multiworker.py).  Both workers run the same
scenarios in the same order (every fit is collective) and each writes what it
saw to ``<out_dir>/worker-<index>.json``.

The model's input has one extra column, the example's index: the `preprocess`
function records the indices of every share this worker reads, then zeroes
the column (so the model trains on the same values as on one machine).
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402

STRATEGY = tf.distribute.MultiWorkerMirroredStrategy()  # before any other TensorFlow op

import keras  # noqa: E402
import numpy as np  # noqa: E402

from dpfl_tf.keras import DPSGD, DPCheckpoint, DPModel, LotSampler  # noqa: E402
from dpfl_tf.keras.multiworker import barrier, is_chief  # noqa: E402
from tests.keras.helpers import loss, mnist_slice, mnist_test_slice  # noqa: E402

N, FEATURES = 600, 60
features, labels = mnist_slice(N, features=FEATURES)
X = np.concatenate([features, np.arange(N, dtype="float32")[:, None]], axis=1)
Y = labels
X_TEST, Y_TEST = mnist_test_slice(101, features=FEATURES)  # an odd last batch
X_TEST = np.concatenate([X_TEST, np.zeros((101, 1), "float32")], axis=1)
INDEX = tf.distribute.get_strategy()  # the default strategy: one plain process
SEEN: list[list[int]] = []


def _record(ids):
    SEEN.append(sorted(int(i) for i in ids))
    return np.int64(len(ids))


def preprocess(xb):
    """Records the indices of the examples read, then zeroes the index column."""
    done = tf.numpy_function(_record, [xb[:, -1]], tf.int64, stateful=True)
    with tf.control_dependencies([done]):
        return tf.concat([xb[:, :-1], tf.zeros_like(xb[:, -1:])], axis=1)


def make(strategy, noise, seed=None, hidden=200, **compile_kwargs):
    with strategy.scope():
        keras.utils.set_random_seed(1)
        model = keras.Sequential(
            [
                keras.Input((FEATURES + 1,)),
                keras.layers.Dense(hidden, activation="relu"),
                keras.layers.Dense(10),
            ]
        )
        dp = DPModel(model)
        optimizer_kwargs = (
            {"secure_mode": compile_kwargs.pop("secure_mode")}
            if "secure_mode" in compile_kwargs
            else {"seed": seed}
        )
        dp.compile(
            optimizer=DPSGD(1.0, l2_norm_clip=1.0, noise_multiplier=noise, **optimizer_kwargs),
            loss=loss(),
            **compile_kwargs,
        )
    return dp


def weights(dp):
    return np.concatenate([v.numpy().ravel() for v in dp.model.trainable_variables])


def train(strategy, noise, *, seed=None, **fit_kwargs):
    """(weight update, model, shares read) of one fit."""
    dp = make(strategy, noise, seed=seed)
    w0 = weights(dp)
    SEEN.clear()
    dp.fit(X, Y, verbose=0, preprocess=preprocess, **fit_kwargs)
    return weights(dp) - w0, dp, [list(s) for s in SEEN]


def counts(dp):
    return {
        "lots_computed": dp.lots_computed,
        "lots_applied": dp.lots_applied,
        "ledger": dp.privacy_ledger.count(),
    }


def lots_of(key, lot_size, num_lots):
    return [[int(i) for i in lot] for lot in LotSampler(N, lot_size, seed=key).lots(num_lots)]


def refusal(fn):
    try:
        fn()
    except ValueError as err:
        return str(err)
    return None


def main(out_dir: str) -> None:
    index = STRATEGY.cluster_resolver.task_id
    report = {
        "index": index,
        "chief": is_chief(STRATEGY),
        "replicas": STRATEGY.num_replicas_in_sync,
    }

    # 1. no noise, the whole data as one lot: the same update as one process
    plain, _, _ = train(INDEX, 0.0, lot_size=N, epochs=2, sampling="full_batch")
    multi, dp, _ = train(STRATEGY, 0.0, lot_size=N, epochs=2, sampling="full_batch")
    report["full_batch"] = {"max_diff": float(np.max(np.abs(plain - multi))), **counts(dp)}

    # 2. Poisson lots with one seed: the same lots, the same update
    plain, _, _ = train(INDEX, 0.0, lot_size=60, epochs=1, sampling_seed=4)
    multi, dp, seen = train(STRATEGY, 0.0, lot_size=60, epochs=1, sampling_seed=4)
    report["seeded"] = {
        "max_diff": float(np.max(np.abs(plain - multi))),
        "key": dp.sampler.key,
        "seen": seen,
        "lots": lots_of(dp.sampler.key, 60, 10),
        "ahead": lots_of(dp.sampler.key, 60, 20)[10:],
        **counts(dp),
    }

    # 3. Poisson lots, unseeded (OS entropy on each worker): the chief's key
    # everywhere (and no training statistics: only the lots are logged)
    _, dp, seen = train(STRATEGY, 1.0, lot_size=60, epochs=1, log_train_metrics=False)
    report["unseeded"] = {
        "key": dp.sampler.key,
        "seen": seen,
        "logged_lots": dp.history.history.get("lots"),
        "lots": lots_of(dp.sampler.key, 60, 10),
        "ahead": lots_of(dp.sampler.key, 60, 20)[10:],
        **counts(dp),
    }

    # 4. noise: one lot of the whole data, sigma = 2; the difference to the
    # noiseless update is the noise alone, lr * N(0, (sigma C)^2) / L per coordinate
    clean, _, _ = train(INDEX, 0.0, lot_size=N, epochs=1, sampling="full_batch")
    noisy, dp, _ = train(STRATEGY, 2.0, seed=5, lot_size=N, epochs=1, sampling="full_batch")
    scale = 1.0 * 2.0 * 1.0 / N
    report["noise"] = {"normalised": ((noisy - clean) / scale).tolist(), **counts(dp)}

    # 5. validation during fit and evaluate: the same numbers as one process
    dp = make(STRATEGY, 1.0, hidden=32, metrics=["accuracy"])
    history = dp.fit(
        X,
        Y,
        lot_size=60,
        epochs=1,
        verbose=0,
        preprocess=preprocess,
        validation_data=(X_TEST, Y_TEST),
    )
    plain = keras.models.clone_model(dp.model)
    plain.set_weights(dp.model.get_weights())
    plain.compile(loss=loss(), metrics=["accuracy"])
    report["evaluate"] = {
        "val": [history.history["val_loss"][-1], history.history["val_accuracy"][-1]],
        "multi": dp.evaluate(X_TEST, Y_TEST, verbose=0),
        "plain": plain.evaluate(X_TEST, Y_TEST, verbose=0),
    }

    # 6. a target epsilon that stops training in the middle of an epoch
    dp = make(STRATEGY, 3.0)  # sigma 3, q 0.1: epsilon 1 after 20-30 lots
    dp.fit(
        X,
        Y,
        lot_size=60,
        epochs=10,
        verbose=0,
        target_epsilon=1.0,
        target_delta=1e-5,
        preprocess=preprocess,
    )
    report["budget"] = {"stop_reason": dp.stop_reason, "epsilon": dp.epsilon(1e-5), **counts(dp)}

    # 7. a checkpoint after 2 epochs, a resume to 4.  Worker 1 is given a
    # directory of its own, as on a machine of its own: only the chief writes,
    # so it stays absent; every worker resumes from the chief's files
    ckpt = os.path.join(out_dir, "ckpt")
    own = ckpt if index == 0 else f"{ckpt}-worker{index}"
    dp = make(STRATEGY, 1.0)
    dp.fit(
        X, Y, lot_size=60, epochs=2, verbose=0, preprocess=preprocess, callbacks=[DPCheckpoint(own)]
    )
    first = counts(dp)
    with STRATEGY.scope():
        restored, initial_epoch = DPCheckpoint.restore(ckpt)
    at_restore = counts(restored)
    restored.fit(
        X,
        Y,
        lot_size=60,
        epochs=4,
        initial_epoch=initial_epoch,
        verbose=0,
        preprocess=preprocess,
        callbacks=[DPCheckpoint(own)],
    )
    report["resume"] = {
        "first": first,
        "initial_epoch": initial_epoch,
        "at_restore": at_restore,
        "state": DPCheckpoint.latest(ckpt),
        "files": sorted(os.listdir(ckpt)),
        "own_written": os.path.exists(own),
        **counts(restored),
    }

    # 8. what is refused under the strategy, before any lot
    refusals = {}
    for name, kwargs in [
        ("jit_compile", {"jit_compile": True}),
        ("steps_per_execution", {"steps_per_execution": 2}),
        ("secure_mode", {"secure_mode": True}),
    ]:
        dp = make(STRATEGY, 1.0, **kwargs)
        refusals[name] = {
            "error": refusal(lambda: dp.fit(X, Y, lot_size=60, verbose=0)),
            "lots": dp.lots_computed,
        }
    dp = make(STRATEGY, 1.0)
    refusals["different_seeds"] = {
        "error": refusal(lambda: dp.fit(X, Y, lot_size=60, verbose=0, sampling_seed=100 + index)),
        "lots": dp.lots_computed,
    }
    report["refusals"] = refusals

    barrier(STRATEGY)
    with open(os.path.join(out_dir, f"worker-{index}.json"), "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main(sys.argv[1])
