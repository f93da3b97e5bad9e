"""DPModel with correlated noise (DPOptimizer(correlated_noise=...)): the lots'
noise is the mechanism's, the ledger records the run once before its first
lot, refusals, budget, resume, and the in-order / cyclic Poisson samplers --
on small slices of real MNIST."""

import math

import keras
import numpy as np
import pytest

from dpfl_tf.correlated_noise import CorrelatedNoise
from dpfl_tf.keras import DPSGD, DPModel
from dpfl_tf.keras.sampling import LotSampler
from dpfl_tf.privacy import BudgetExceededError, ReplaceOneGaussianDpEvent, compute_epsilon
from dpfl_tf.privacy import matrix_factorization as mf
from tests.keras.helpers import loss, mlp, mnist_slice

N, LOT = 200, 50  # 4 lots an epoch


def dp_model(
    mechanism="banded", noise=1.0, lr=1.0, seed=0, model=None, ledger=None, recorded_lots=0, **opt
):
    dp = DPModel(
        model if model is not None else mlp(hidden=8), ledger=ledger, recorded_lots=recorded_lots
    )
    dp.compile(
        optimizer=DPSGD(
            lr,
            **{"l2_norm_clip": 1.0, **opt},
            noise_multiplier=noise,
            seed=seed,
            correlated_noise=mechanism,
        ),
        loss=loss(),
        steps_per_execution=1,
    )
    return dp


class KernelTrace(keras.callbacks.Callback):
    """The first kernel after every lot."""

    def on_train_begin(self, logs=None):
        self.kernels = [self.model.model.layers[0].kernel.numpy().copy()]

    def on_train_batch_end(self, batch, logs=None):
        self.kernels.append(self.model.model.layers[0].kernel.numpy().copy())


@pytest.mark.filterwarnings("ignore:seed=")
@pytest.mark.parametrize(
    "mechanism, sampling", [("banded", "in_order"), ("tree", "shuffle"), ("blt", "in_order")]
)
def test_lot_noise_is_the_mechanisms_and_the_run_is_recorded_once(mechanism, sampling):
    """Zero inputs: no gradient reaches the first kernel, so its change in lot t
    is -lr s sens w_t / L, with w_t the mechanism's noise at (seed, lot t)."""
    x, y = mnist_slice(N, features=60)
    x = np.zeros_like(x)
    dp = dp_model(mechanism, noise=2.0, seed=3)
    trace = KernelTrace()
    dp.fit(x, y, lot_size=LOT, epochs=3, verbose=0, sampling=sampling, callbacks=[trace])
    run = dp.optimizer.correlated_run
    mech = run.mechanism
    assert mech.steps == 12 and run.position == 12
    # the order of the data fixes the lots: replace-one
    assert mech.participation == (
        mf.Participation.epochs(12, 4, relation="replace_one")
        if sampling == "shuffle"
        else mf.Participation.min_separation(12, 4, relation="replace_one")
    )
    deltas = np.diff(np.stack(trace.kernels), axis=0)
    reference = CorrelatedNoise(mech, [deltas.shape[1:]], seed=3)
    want = np.stack([reference.next(t)[0].numpy() for t in range(12)])
    std = 2.0 * 1.0 * mech.sensitivity
    np.testing.assert_allclose(deltas, -std * want / LOT, rtol=2e-4, atol=1e-6)
    entries = dp.privacy_ledger.entries
    assert [e["label"] for e in entries] == ["mf", "dpsgd"] and entries[0]["count"] == 1
    assert dp.epsilon(1e-5, "rdp") == pytest.approx(
        compute_epsilon(ReplaceOneGaussianDpEvent(1.0), 1e-5, "rdp")
    )
    if mechanism == "banded":  # a new fit is a new run, recorded again
        dp.fit(x, y, lot_size=LOT, epochs=1, verbose=0, sampling=sampling)
        assert [e["label"] for e in dp.privacy_ledger.entries].count("mf") == 2


@pytest.mark.filterwarnings("ignore:seed=")
def test_poisson_lots_and_an_exceeding_run_are_refused_before_anything_is_recorded():
    x, y = mnist_slice(N, features=60)
    dp = dp_model("banded")
    with pytest.raises(
        ValueError,
        match="correlated noise needs sampling 'shuffle', "
        "'in_order', 'cyclic_poisson' or 'full_batch', "
        "got 'poisson'",
    ):
        dp.fit(x, y, lot_size=LOT, epochs=1, verbose=0)
    with pytest.raises(BudgetExceededError, match="would bring epsilon to .* > target_epsilon=0.5"):
        dp.fit(x, y, lot_size=LOT, epochs=1, verbose=0, sampling="in_order", target_epsilon=0.5)
    assert dp.privacy_ledger.entries == [] and dp.lots_computed == 0
    with pytest.raises(
        ValueError,
        match="cyclic_poisson' needs a DP optimizer with correlated_noise=CorrelatedNoiseConfig",
    ):
        dp.fit(x, y, lot_size=LOT, epochs=1, verbose=0, sampling="cyclic_poisson")
    # within the budget: trains, and the budget does not stop the run early
    dp.fit(x, y, lot_size=LOT, epochs=2, verbose=0, sampling="in_order", target_epsilon=20)
    assert dp.lots_computed == 8 and dp.stop_reason == "completed"


@pytest.mark.filterwarnings("ignore:seed=")
def test_an_interrupted_run_resumes_with_the_same_noise_and_one_event():
    """In order, seeded: stopped after epoch 1 and resumed -- in the same process
    and from a saved state in a new model -- the weights equal the uninterrupted
    run's, and the ledger holds the run's event once."""
    x, y = mnist_slice(N, features=60)

    class StopAfterFirstEpoch(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            self.model.stop_training = True

    whole = dp_model("blt", noise=1.0, seed=5, lr=0.5)
    whole.fit(x, y, lot_size=LOT, epochs=3, verbose=0, sampling="in_order")

    same = dp_model("blt", noise=1.0, seed=5, lr=0.5)
    same.fit(
        x,
        y,
        lot_size=LOT,
        epochs=3,
        verbose=0,
        sampling="in_order",
        callbacks=[StopAfterFirstEpoch()],
    )
    state = same.optimizer.correlated_run.get_state()
    weights = same.get_weights()
    ledger = same.privacy_ledger.to_dict()
    same.fit(x, y, lot_size=LOT, epochs=3, initial_epoch=1, verbose=0, sampling="in_order")

    other = dp_model(
        "blt",
        noise=1.0,
        seed=5,
        lr=0.5,
        model=mlp(hidden=8, seed=9),
        ledger=ledger,
        recorded_lots=4,
    )
    other.set_weights(weights)
    other.optimizer.restore_correlated_run(state)
    other.fit(x, y, lot_size=LOT, epochs=3, initial_epoch=1, verbose=0, sampling="in_order")
    for resumed in (same, other):
        for a, b in zip(whole.get_weights(), resumed.get_weights()):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
        assert [e["label"] for e in resumed.privacy_ledger.entries].count("mf") == 1
        assert resumed.lots_computed == 12
    assert other.epsilon(1e-5) == pytest.approx(whole.epsilon(1e-5))
    # weights that carry lots the model did not compute: refused, not recorded as no-ops
    bare = dp_model("blt", noise=1.0, seed=5, lr=0.5, model=mlp(hidden=8, seed=9))
    bare.set_weights(weights)
    with pytest.raises(ValueError, match="the weights carry 4 lots this model did not compute"):
        bare.fit(x, y, lot_size=LOT, epochs=3, initial_epoch=1, verbose=0, sampling="in_order")
    assert bare.privacy_ledger.entries == []


def test_in_order_lots_repeat_the_same_order_every_epoch():
    sampler = LotSampler(N, LOT, "in_order", first_lot=2)
    lots = list(sampler.lots(6))
    assert [lot[0] for lot in lots] == [100, 150, 0, 50, 100, 150]
    assert all(np.array_equal(lot, np.arange(lot[0], lot[0] + LOT)) for lot in lots)
    assert sampler.participation(40) == mf.Participation.min_separation(
        40, 4, relation="replace_one"
    )


@pytest.mark.parametrize("secure", [False, True])
def test_cyclic_poisson_lots_take_one_group_per_lot(secure):
    sampler = LotSampler(
        1000, 10, "cyclic_poisson", cycle_length=5, seed=None if secure else 1, secure_mode=secure
    )
    assert sampler.sampling_rate == pytest.approx(0.05)
    turns = {}
    lots = list(sampler.lots(30))
    for t, lot in enumerate(lots):
        for i in lot:
            turns.setdefault(int(i), set()).add(t % 5)
    assert all(len(v) == 1 for v in turns.values())  # one group per example
    assert np.mean([len(lot) for lot in lots]) == pytest.approx(10, rel=0.35)
    p = sampler.participation(30)
    assert p == mf.Participation.cyclic_poisson(30, 5, 0.05)
    with pytest.raises(
        ValueError, match=r"cycle_length must be <= N // L = 100 \(so that .*\), got 101"
    ):
        LotSampler(1000, 10, "cyclic_poisson", cycle_length=101)
    with pytest.raises(ValueError, match="cycle_length is for sampling='cyclic_poisson'"):
        LotSampler(1000, 10, "shuffle", cycle_length=5)


def test_amplified_banded_fit_in_secure_mode_records_k_sampled_cycles():
    x, y = mnist_slice(N, features=60)
    config = mf.CorrelatedNoiseConfig("banded", bands=2)
    dp = dp_model(config, noise=1.0, seed=None, secure_mode=True)
    dp.fit(x, y, lot_size=LOT, epochs=2, verbose=0, sampling="cyclic_poisson")
    run = dp.optimizer.correlated_run
    assert dp.lots_computed == 8 == run.position
    assert all(b.dtype == "float64" for b in run.sanitizer(1.0).noise.buffers)
    assert all(np.isfinite(w).all() for w in dp.get_weights())
    sens = run.mechanism.sensitivity
    assert sens == pytest.approx(1.0)  # one participation: ||c|| = 1
    assert dp.privacy_ledger.entries[0]["event"] == (
        "4 x Poisson(q=0.5) Gaussian(sigma=1) (add/remove-one)"
    )


def test_optimizer_config_round_trip_keeps_the_mechanism():
    opt = DPSGD(
        0.1,
        l2_norm_clip=1.0,
        noise_multiplier=1.0,
        correlated_noise=mf.CorrelatedNoiseConfig("blt", buffers=3),
    )
    again = DPSGD.from_config(opt.get_config())
    assert again.correlated_noise == opt.correlated_noise
    with pytest.raises(ValueError, match="mechanism must be one of tree, banded, blt, got 'dense'"):
        DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0, correlated_noise="dense")
    assert mf.CorrelatedNoiseConfig("ftrl").mechanism is mf.MechanismKind.TREE
    assert math.isfinite(
        mf.CorrelatedNoiseConfig("banded_mf")
        .build(mf.Participation.min_separation(8, 4), 1.0)
        .sensitivity
    )


@pytest.mark.filterwarnings("ignore:seed=")
@pytest.mark.parametrize(
    "mechanism, sampling, target, per_layer",
    [
        ("banded", "shuffle", 4.0, False),
        (mf.CorrelatedNoiseConfig("banded", bands=2), "cyclic_poisson", 2.0, False),
        ("blt", "in_order", 4.0, True),
    ],
)
def test_fit_calibrates_the_correlated_noise_for_the_target_after_what_is_spent(
    mechanism, sampling, target, per_layer
):
    """noise_multiplier=None: fit finds the sigma whose run event, after the
    ledger's earlier release (about half the target), spends the target; the
    ledger then reads it, and a sigma 2% smaller would exceed it (the smallest,
    not any, sigma).  Per-layer bounds with proportional noise: the event's
    multiplier is sigma / sqrt(2) (two groups).  A continued run keeps its noise."""
    import dataclasses

    import dp_accounting

    from dpfl_tf.privacy import PrivacyLedger

    x, y = mnist_slice(N, features=60)
    ledger = PrivacyLedger("rdp")
    replace_one = sampling != "cyclic_poisson"
    # about half the target (multiplier 2.2: epsilon 1.95; 4: 1.01; delta 1e-5, RDP)
    before = ReplaceOneGaussianDpEvent(2.2) if replace_one else dp_accounting.GaussianDpEvent(4.0)
    assert 0.4 * target < compute_epsilon(before, 1e-5, "rdp") < 0.6 * target
    ledger.record(before, label="earlier release")
    model = mlp(hidden=8)
    opt = {}
    if per_layer:
        names = [layer.name for layer in model.layers]
        opt = dict(l2_norm_clip={names[0]: 1.0, names[1]: 3.0}, noise_allocation="proportional")
    dp = dp_model(mechanism, noise=None, seed=None, ledger=ledger, model=model, **opt)

    class StopAfterFirstEpoch(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            self.model.stop_training = True

    with pytest.raises(ValueError, match="noise_multiplier is unset .* no target_epsilon"):
        dp.fit(x, y, lot_size=LOT, epochs=3, verbose=0, sampling=sampling)
    assert dp.privacy_ledger.entries[-1]["label"] == "earlier release"
    stop = [StopAfterFirstEpoch()]
    dp.fit(
        x,
        y,
        lot_size=LOT,
        epochs=3,
        verbose=0,
        sampling=sampling,
        target_epsilon=target,
        callbacks=stop,
    )
    sigma = dp.optimizer.noise_multiplier
    run = dp.optimizer.correlated_run
    assert run.mechanism.noise_multiplier == sigma and run.position == 4
    assert dp.calibration["lots"] == 12 and dp.calibration["noise_multiplier"] == sigma
    assert [e["label"] for e in dp.privacy_ledger.entries] == ["earlier release", "mf", "dpsgd"]
    spent = dp.epsilon(1e-5)
    assert target * 0.99 <= spent <= target
    per_unit = 1 / math.sqrt(2) if per_layer else 1.0

    def epsilon_at(s):
        event = dataclasses.replace(run.mechanism, noise_multiplier=per_unit * s).event()
        return compute_epsilon(dp_accounting.ComposedDpEvent([before, event]), 1e-5, "rdp")

    assert epsilon_at(sigma) == pytest.approx(spent, rel=1e-9)
    assert epsilon_at(0.98 * sigma) > target
    # the rest of the run, noise_multiplier unset again: the run keeps its sigma and
    # its one event (not a new calibration on top of what it already spent).  The cyclic
    # case's new run gets a 10% larger target: the first fit spent all but the
    # calibration's tolerance of it, which may leave no room for a second event
    dp.optimizer.noise_multiplier = None
    more = 1.1 if sampling == "cyclic_poisson" else 1.0
    dp.fit(
        x,
        y,
        lot_size=LOT,
        epochs=3,
        initial_epoch=1,
        verbose=0,
        sampling=sampling,
        target_epsilon=more * target,
    )
    mf_events = [e["label"] for e in dp.privacy_ledger.entries].count("mf")
    if sampling == "cyclic_poisson":  # unseeded groups cannot be continued: a new run,
        # calibrated for what is left of the target, with its own event
        assert dp.optimizer.correlated_run is not run and mf_events == 2
        assert dp.optimizer.noise_multiplier > sigma and dp.lots_computed == 12
        assert spent < dp.epsilon(1e-5) <= more * target
        return
    assert dp.optimizer.noise_multiplier == sigma and dp.optimizer.correlated_run is run
    assert run.position == 12 == dp.lots_computed and mf_events == 1
    assert dp.epsilon(1e-5) == pytest.approx(spent, rel=1e-9)
