"""The clients' step decayed over the rounds (FederatedConfig.lr_decay_rounds):
eta_t = eta x rate^(t / R) reaches LocalTrainer at round t (in-process here, resumed
too; on Flower, tests/federated/test_flower.py's parity test), without retracing;
the constant step stays the default."""

import argparse

import numpy as np
import pytest
import tensorflow as tf

from dpfl_tf.federated import flower as fl
from dpfl_tf.federated.client import LocalTrainer
from dpfl_tf.federated.runner import build_server, run_federated
from tests.federated.conftest import small_global_dp_config, tiny_model


def _steps_seen(server) -> list[float]:
    """Wraps the trainer's compiled local SGD to record the step of every client call."""
    seen, original = [], server.trainer._train_fn

    def spy(*args):
        seen.append(float(args[4]))
        return original(*args)

    server.trainer._train_fn = spy
    return seen


def test_each_round_trains_its_clients_with_that_rounds_step(mnist_small):
    cfg = small_global_dp_config(learning_rate=0.2, lr_decay_rounds=2, lr_decay_rate=0.25)
    server, _ = build_server(cfg, mnist_small, progress=False)
    compiled = server.trainer._train_fn
    seen = _steps_seen(server)
    server.run(3)
    want = [0.2 * 0.25 ** (t / 2) for t in range(3) for _ in range(3)]  # 3 clients a round
    np.testing.assert_allclose(seen, want, rtol=1e-6)
    assert compiled.experimental_get_tracing_count() == 1  # the step is a tensor argument

    constant, _ = build_server(
        small_global_dp_config(learning_rate=0.2), mnist_small, progress=False
    )
    seen = _steps_seen(constant)
    constant.run(2)
    assert seen == [pytest.approx(0.2)] * 6


def test_a_scheduled_trainer_at_round_t_is_the_constant_trainer_at_eta_t(mnist_small):
    import keras

    schedule = keras.optimizers.schedules.ExponentialDecay(0.1, 10, 0.1)
    x, y = mnist_small.x_train[:200], mnist_small.y_train[:200]
    scheduled = LocalTrainer(tiny_model(), x, y, learning_rate=schedule)
    weights = scheduled.get_weights()
    got = scheduled.train(weights, np.arange(40), np.random.default_rng(0), round_index=7)
    eta_7 = 0.1 * 0.1**0.7
    assert scheduled.learning_rate_at(7) == pytest.approx(eta_7, rel=1e-6)
    constant = LocalTrainer(tiny_model(), x, y, learning_rate=float(schedule(7)))
    want = constant.train(weights, np.arange(40), np.random.default_rng(0))
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    moved = [tf.norm(d).numpy() for d in got]
    first = scheduled.train(weights, np.arange(40), np.random.default_rng(0), round_index=0)
    assert sum(moved) < sum(tf.norm(d).numpy() for d in first)  # the smaller step moves less


def test_bad_schedules_are_refused_with_the_field_named(mnist_small):
    for bad in (dict(lr_decay_rounds=0), dict(lr_decay_rounds=-3)):
        with pytest.raises(ValueError, match="lr_decay_rounds"):
            small_global_dp_config(**bad)
    for rate in (0.0, 1.5, -0.1):
        with pytest.raises(ValueError, match="lr_decay_rate"):
            small_global_dp_config(lr_decay_rounds=10, lr_decay_rate=rate)
    with pytest.raises(ValueError, match="without lr_decay_rounds"):
        small_global_dp_config(lr_decay_rate=0.5)
    with pytest.raises(ValueError, match="underflow to 0 by round 200"):
        small_global_dp_config(lr_decay_rounds=2, rounds=200)
    x, y = mnist_small.x_train[:20], mnist_small.y_train[:20]
    with pytest.raises(ValueError, match="learning_rate schedule at round 0"):
        LocalTrainer(tiny_model(), x, y, learning_rate=lambda t: 0.0)


def test_the_decay_is_reported_and_reaches_the_config_from_the_cli_and_flower(mnist_small):
    from dpfl_tf.federated.cli import add_federated_parser, config_from_args

    parser = argparse.ArgumentParser()
    add_federated_parser(parser.add_subparsers())
    config = config_from_args(
        parser.parse_args(["federated", "--lr-decay-rounds", "675", "--lr-decay-rate", "0.5"])
    )
    assert (config.lr_decay_rounds, config.lr_decay_rate) == (675, 0.5)
    assert config_from_args(parser.parse_args(["federated"])).lr_decay_rounds is None
    cfg = small_global_dp_config(lr_decay_rounds=2, rounds=2)
    assert fl.config_from_run_config(fl.config_to_run_config(cfg)) == cfg
    result = run_federated(cfg, mnist_small, progress=False)
    assert (result["lr_decay_rounds"], result["lr_decay_rate"]) == (2, 0.1)
    assert "lr_decay_rounds" not in run_federated(
        small_global_dp_config(rounds=1), mnist_small, progress=False
    )


def test_a_resumed_run_continues_the_schedule_from_its_round(mnist_small, tmp_path):
    cfg = small_global_dp_config(learning_rate=0.2, lr_decay_rounds=1, lr_decay_rate=0.5)
    first, _ = build_server(cfg, mnist_small, progress=False)
    first.run(2)
    first.save_checkpoint(tmp_path)
    resumed, _ = build_server(cfg, mnist_small, progress=False)
    assert resumed.load_checkpoint(tmp_path)
    seen = _steps_seen(resumed)
    resumed.run(3)  # rounds in all
    assert seen == [pytest.approx(0.2 * 0.5**2)] * 3  # round t = 2
