"""FederatedServer with correlated client-level noise: cyclic cohorts, the
round's noise is the mechanism's, one event for the run, refusals, resume."""

import json

import numpy as np
import pytest
import tensorflow as tf

from dpfl_tf.correlated_noise import CorrelatedNoise, CorrelatedSanitizer
from dpfl_tf.federated.aggregators import GlobalDPAggregator
from dpfl_tf.federated.client import LocalTrainer
from dpfl_tf.federated.partition import iid_partition
from dpfl_tf.federated.server import ClientSampling, FederatedServer
from dpfl_tf.privacy import matrix_factorization as mf
from dpfl_tf.sanitizer import GaussianSanitizer
from tests.federated.conftest import tiny_model

CLIENTS, COHORTS, ROUNDS = 12, 3, 6


@pytest.fixture(scope="module")
def trainer(mnist_small):
    return LocalTrainer(
        tiny_model(hidden=4),
        mnist_small.x_train[:240],
        mnist_small.y_train[:240],
        local_epochs=1,
        batch_size=20,
        learning_rate=0.05,
    )


def server(trainer, mechanism="banded", rounds=ROUNDS, noise=1.0, seed=3, clip=0.5, **kw):
    sampling = ClientSampling("cyclic_poisson", fraction=1.0, cohorts=COHORTS)
    config = mf.CorrelatedNoiseConfig(mechanism)
    mech = config.build(sampling.participation(rounds), noise)
    agg = GlobalDPAggregator(CorrelatedSanitizer(clip, mech, seed=seed))
    return FederatedServer(
        trainer,
        iid_partition(240, CLIENTS, seed=0),
        agg,
        sampling=sampling,
        test_data=None,
        delta_max=1e-3,
        seed=1,
        progress=False,
        **kw,
    )


def test_cohorts_take_turns_and_the_noise_is_the_mechanisms(trainer):
    init = trainer.get_weights()
    srv = server(trainer, "blt")
    deltas = []
    for _ in range(ROUNDS):
        before = [w.numpy().copy() for w in trainer.get_weights()]
        rec = srv.run_round()
        deltas.append([w.numpy() - b for w, b in zip(trainer.get_weights(), before)])
        assert rec.clients == CLIENTS // COHORTS
    assert srv.participations.tolist() == [2] * CLIENTS  # every client 3 rounds apart
    entries = srv.ledger.entries
    assert entries[0]["label"] == "mf" and entries[0]["count"] == 1
    assert srv.privacy_report()["run_event"].startswith("Gaussian(sigma=1)")
    # a round's update is the clipped mean plus s sens w_t / m: with a clip of
    # 1e-4 and sigma 100 the mean is negligible beside the noise
    trainer.set_weights(init)
    tiny = server(trainer, "blt", noise=100.0, clip=1e-4)
    got = []
    for _ in range(ROUNDS):
        before = [w.numpy().copy() for w in trainer.get_weights()]
        tiny.run_round()
        got.append(trainer.get_weights()[0].numpy() - before[0])
    mech = tiny.aggregator.sanitizer.mechanism
    reference = CorrelatedNoise(mech, [w.shape for w in init], seed=3)
    want = [reference.next(t)[0].numpy() for t in range(ROUNDS)]
    std = 100.0 * 1e-4 * mech.sensitivity
    m = CLIENTS / COHORTS
    np.testing.assert_allclose(np.stack(got), std * np.stack(want) / m, rtol=0, atol=3e-5)
    assert np.abs(np.stack(got)).max() > 100 * 3e-5
    trainer.set_weights(init)


def test_refusals_before_any_release(trainer):
    init = trainer.get_weights()
    srv = server(trainer)
    srv.run_round()
    srv.sampling = ClientSampling("cyclic_poisson", fraction=1.0, cohorts=1)  # all clients
    with pytest.raises(
        mf.PatternViolation,
        match="client|unit 0 took part at step 0; step 1 "
        "is 1 later, the declared min separation "
        "is 3",
    ):
        srv.run_round()
    assert srv.rounds_done == 1 and srv.ledger.count("federated round") == 1
    trainer.set_weights(init)
    with pytest.raises(ValueError, match="cyclic_poisson' \\(cohorts\\) is for correlated"):
        FederatedServer(
            trainer,
            iid_partition(240, CLIENTS, seed=0),
            GlobalDPAggregator(GaussianSanitizer(0.5, 1.0)),
            sampling=ClientSampling("cyclic_poisson", fraction=1.0, cohorts=3),
            test_data=None,
            delta_max=1e-3,
            progress=False,
        )
    with pytest.raises(ValueError, match="costs epsilon .* > target_epsilon=0.5"):
        server(trainer, target_epsilon=0.5)
    with pytest.raises(ValueError, match="cohorts is for client sampling 'cyclic_poisson'"):
        ClientSampling("poisson", fraction=0.5, cohorts=3)
    srv = server(trainer, rounds=3)
    history = srv.run(10)
    assert len(history) == 3 and "horizon of 3 rounds is reached" in srv.stop_reason


def test_resume_continues_the_same_noise(trainer, tmp_path):
    init = trainer.get_weights()
    straight = server(trainer, "tree")
    straight.run(ROUNDS)
    want = [w.numpy() for w in trainer.get_weights()]
    trainer.set_weights(init)
    first = server(trainer, "tree")
    first.run(4, checkpoint_dir=tmp_path)
    state = json.loads((tmp_path / "state.json").read_text())
    assert state["correlated"]["position"] == 4
    trainer.set_weights([tf.zeros_like(w) for w in init])
    resumed = server(trainer, "tree")
    resumed.run(ROUNDS, checkpoint_dir=tmp_path)
    for got, expect in zip(trainer.get_weights(), want):
        np.testing.assert_allclose(got.numpy(), expect, rtol=1e-5, atol=1e-6)
    assert resumed.ledger == straight.ledger
    assert [e["label"] for e in resumed.ledger.entries].count("mf") == 1
    trainer.set_weights(init)


def test_config_and_cli_modes_build_the_mechanism(mnist_small):
    from dpfl_tf.federated.runner import FederatedConfig, build_server

    config = FederatedConfig(
        dp="ftrl", cohorts=4, clients=20, rounds=8, train_subset=400, noise_multiplier=2.0
    )
    assert config.sampling.value == "cyclic_poisson" and config.fraction == 1.0
    srv, _ = build_server(config, mnist_small, progress=False)
    mech = srv.aggregator.sanitizer.mechanism
    assert mech.participation == mf.Participation.min_separation(8, 4)
    assert mech.strategy == mf.TreeAggregation(restart_every=4)
    with pytest.raises(ValueError, match="takes cohorts"):
        FederatedConfig(dp="blt")
    with pytest.raises(ValueError, match="cohorts is for dp='ftrl', 'banded_mf' or 'blt'"):
        FederatedConfig(dp="global", cohorts=3)
    with pytest.raises(ValueError, match="goes with sampling cyclic_poisson"):
        FederatedConfig(dp="banded_mf", cohorts=3, sampling="poisson")


def test_the_report_counts_rounds_not_ledger_entries(mnist_small):
    """A correlated run's ledger holds its run event beside the rounds; the report's
    round count is the rounds, not the entries."""
    from dpfl_tf.federated.runner import FederatedConfig, run_federated

    config = FederatedConfig(
        dp="banded_mf", cohorts=2, clients=8, rounds=3, train_subset=200, noise_multiplier=2.0
    )
    result = run_federated(config, mnist_small, progress=False)
    assert result["rounds"] == result["privacy"]["rounds"] == 3
    assert result["privacy"]["run_event"].startswith("Gaussian")
