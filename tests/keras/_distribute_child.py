"""Run in a fresh process (logical devices must be set before TensorFlow starts):
prints JSON with MirroredStrategy / XLA comparisons against one plain device."""

import json
import sys

import tensorflow as tf

cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)

import keras  # noqa: E402
import numpy as np  # noqa: E402

from dpfl_tf.keras import DPSGD, DPModel  # noqa: E402
from tests.keras.helpers import loss, mnist_slice  # noqa: E402

x, y = mnist_slice(600, features=60)


def update(strategy, noise, jit=False, seed=3, epochs=1):
    with strategy.scope():
        keras.utils.set_random_seed(1)
        model = keras.Sequential(
            [keras.Input((60,)), keras.layers.Dense(200, activation="relu"), keras.layers.Dense(10)]
        )
        dp = DPModel(model)
        dp.compile(
            optimizer=DPSGD(1.0, l2_norm_clip=1.0, noise_multiplier=noise, seed=seed),
            loss=loss(),
            jit_compile=jit,
        )
    w0 = [v.numpy().copy() for v in model.trainable_variables]
    dp.fit(x, y, lot_size=600, batch_size=150, epochs=epochs, verbose=0, sampling="full_batch")
    delta = np.concatenate([(v.numpy() - a).ravel() for v, a in zip(model.trainable_variables, w0)])
    return delta, dp.lots_applied


plain = tf.distribute.get_strategy()
mirrored = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
clean, _ = update(plain, 0.0, epochs=3)
clean_m, lots_m = update(mirrored, 0.0, epochs=3)
clean_x, _ = update(plain, 0.0, jit=True, epochs=3)
one_clean, _ = update(plain, 0.0)
noisy_m, _ = update(mirrored, 2.0, seed=5)
noisy_x, _ = update(plain, 2.0, jit=True, seed=5)
scale = 2.0 * 1.0 / 600  # lr * sigma * C / L


TINY_EPOCHS = 5


def tiny_lots():
    """Poisson lots of expected size 1 from 7 examples (sizes 0, 1, 2, 3 ...),
    one with a NaN pixel, on 2 replicas: every lot trains, the NaN example is
    dropped and counted, the ledger equals the lots.  The lots are seeded: the
    sizes reported are those of the fit's own lots."""
    xs, ys = x[:7].copy(), y[:7]
    xs[2, 0] = np.nan
    with mirrored.scope():
        model = keras.Sequential([keras.Input((60,)), keras.layers.Dense(10)])
        dp = DPModel(model)
        dp.compile(optimizer=DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0), loss=loss())
    sizes = [len(i) for i in dp_sampler_sizes(dp, TINY_EPOCHS)]
    with np.errstate(all="ignore"):
        dp.fit(xs, ys, lot_size=1, batch_size=1, epochs=TINY_EPOCHS, sampling_seed=0, verbose=0)
    return {
        "tiny_lot_sizes_seen": sorted(set(sizes)),
        "tiny_lots": dp.lots_computed,
        "tiny_ledger": dp.privacy_ledger.count(),
        "tiny_dropped": dp.dropped_examples,
        "tiny_finite": bool(all(np.all(np.isfinite(w)) for w in model.get_weights())),
    }


def dp_sampler_sizes(dp, epochs):
    """The lots `dp.fit(..., sampling_seed=0)` trains on 7 examples with lot size 1."""
    from dpfl_tf.keras import LotSampler

    return list(LotSampler(7, 1, seed=0).lots(7 * epochs))


def correlated_refusal():
    """Correlated noise under 2 replicas: refused before its run event is recorded."""
    with mirrored.scope():
        dp = DPModel(keras.Sequential([keras.Input((60,)), keras.layers.Dense(10)]))
        dp.compile(
            optimizer=DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0, correlated_noise="banded"),
            loss=loss(),
        )
    try:
        dp.fit(x[:20], y[:20], lot_size=5, epochs=1, verbose=0, sampling="in_order")
    except ValueError as err:
        return {"correlated_refusal": str(err), "correlated_ledger": len(dp.privacy_ledger)}
    return {"correlated_refusal": None, "correlated_ledger": len(dp.privacy_ledger)}


def secure_refusal():
    with mirrored.scope():
        dp = DPModel(keras.Sequential([keras.Input((60,)), keras.layers.Dense(10)]))
        dp.compile(
            optimizer=DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0, secure_mode=True),
            loss=loss(),
        )
    try:
        dp.fit(x[:20], y[:20], lot_size=5, epochs=1, verbose=0)
    except ValueError as err:
        return {"secure_refusal": str(err), "secure_lots": dp.lots_computed}
    return {"secure_refusal": None, "secure_lots": dp.lots_computed}


def one_replica():
    """A strategy of one replica (a Mirrored script on a one-GPU machine): the
    optimizer's merge cannot sit inside the budget's branch, so the lot is
    gated as on several replicas; the budget stops after the same lot as
    without a strategy."""
    out = {}
    for name, strategy in [("plain", plain), ("one", tf.distribute.MirroredStrategy(["/cpu:0"]))]:
        with strategy.scope():
            dp = DPModel(keras.Sequential([keras.Input((60,)), keras.layers.Dense(10)]))
            dp.compile(optimizer=DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=3.0), loss=loss())
        dp.fit(x[:300], y[:300], lot_size=30, epochs=5, target_epsilon=1.0, verbose=0)
        out[f"{name}_replica_lots"] = [
            dp.lots_computed,
            dp.lots_applied,
            dp.privacy_ledger.count(),
            dp.stop_reason,
        ]
    return out


def mixing_refusal():
    """A layer centring the batch, on 2 replicas: refused before any lot."""
    from dpfl_tf.keras import BatchMixingLayerError

    with mirrored.scope():
        dp = DPModel(
            keras.Sequential(
                [
                    keras.Input((60,)),
                    keras.layers.Dense(8),
                    keras.layers.Lambda(lambda t: t - keras.ops.mean(t, axis=0), name="centre"),
                    keras.layers.Dense(10),
                ]
            )
        )
        dp.compile(optimizer=DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0), loss=loss())
    try:
        dp.fit(x[:40], y[:40], lot_size=20, epochs=1, verbose=0)
    except BatchMixingLayerError as err:
        return {
            "mixing_refusal": str(err),
            "mixing_lots": dp.lots_computed,
            "mixing_ledger": len(dp.privacy_ledger),
        }
    return {
        "mixing_refusal": None,
        "mixing_lots": dp.lots_computed,
        "mixing_ledger": len(dp.privacy_ledger),
    }


json.dump(
    {
        **tiny_lots(),
        **secure_refusal(),
        **correlated_refusal(),
        **one_replica(),
        **mixing_refusal(),
        "replicas": mirrored.num_replicas_in_sync,
        # the KerasHub rules wait for KerasHub (layer_rules.register_when_imported)
        "keras_hub_imported": "keras_hub" in sys.modules,
        "mirrored_max_diff": float(np.max(np.abs(clean - clean_m))),
        "xla_max_diff": float(np.max(np.abs(clean - clean_x))),
        "mirrored_lots": lots_m,
        "mirrored_noise": ((noisy_m - one_clean) / scale).tolist()[:60000],
        "xla_noise": ((noisy_x - one_clean) / scale).tolist()[:60000],
    },
    sys.stdout,
)
