"""Server optimisers: each rule equals the paper's formulas written out coordinate by
coordinate; the default is FedAvg's w + Delta to the bit; the optimiser sees the
released (noised) aggregate and nothing else; the ledger is the same with or
without one; bad settings are refused naming the flag."""

import numpy as np
import pytest
import tensorflow as tf

from dpfl_tf.federated.runner import FederatedConfig, build_server, run_federated
from dpfl_tf.federated.server_optimizers import ServerOptimizer
from tests.federated.conftest import small_global_dp_config


def _reference(kind, deltas, eta, beta1, beta2, tau):
    """x_T - x_0 from the formulas of Hsu et al. 2019 (sgd with momentum) and Reddi et
    al. 2021, Algorithm 2 (adagrad, adam, yogi), one scalar coordinate at a time."""
    total = []
    for coords in zip(*deltas):  # the sequence Delta_0..Delta_T-1 of one coordinate
        x, m, v = 0.0, 0.0, tau * tau
        for d in coords:
            if kind == "sgd":
                m = beta1 * m + d
                x += eta * m
                continue
            m = beta1 * m + (1 - beta1) * d
            if kind == "adagrad":
                v = v + d * d
            elif kind == "adam":
                v = beta2 * v + (1 - beta2) * d * d
            else:
                v = v - (1 - beta2) * d * d * np.sign(v - d * d)
            x += eta * m / (np.sqrt(v) + tau)
        total.append(x)
    return np.array(total)


@pytest.mark.parametrize("kind", ["sgd", "adagrad", "adam", "yogi"])
def test_each_rule_is_the_papers_formula(kind):
    rng = np.random.default_rng(0)
    deltas = [rng.normal(scale=0.05, size=(6,)) for _ in range(7)]
    eta, beta1, beta2, tau = 0.3, 0.8, 0.95, 0.01
    opt = ServerOptimizer(kind, eta, beta1, beta2=beta2, tau=tau)
    w = [tf.zeros((2, 3), tf.float64), tf.zeros((), tf.float64)]  # two tensors, 6 + 1 coords
    for d in deltas:
        w = opt.apply(w, [d.reshape(2, 3), tf.constant(d[0], tf.float64)])
    want = _reference(kind, deltas, eta, beta1, beta2, tau)
    np.testing.assert_allclose(w[0].ravel(), want, rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(float(w[1]), want[0], rtol=1e-12, atol=1e-15)
    assert opt.steps == len(deltas)


def test_yogi_and_adam_differ_where_the_second_moment_falls():
    """A small Delta after large ones: Adam's v decays by beta2, Yogi's by at most
    (1 - beta2) Delta^2 -- the rules are not the same code path under two names."""
    deltas = [np.array([1.0]), np.array([1.0]), np.array([1e-3])]
    got = {}
    for kind in ("adam", "yogi"):
        opt = ServerOptimizer(kind, 1.0, 0.0, beta2=0.5, tau=1e-3)
        w = [tf.zeros((1,), tf.float64)]
        for d in deltas:
            w = opt.apply(w, [d])
        got[kind] = float(w[0][0])
    assert got["adam"] != pytest.approx(got["yogi"], rel=1e-3)


def test_the_default_is_fedavg_to_the_bit_and_keeps_no_state():
    rng = np.random.default_rng(1)
    w = [tf.constant(rng.normal(size=(3, 4)).astype(np.float32))]
    d = [tf.constant(rng.normal(size=(3, 4)).astype(np.float32))]
    opt = ServerOptimizer()
    assert opt.is_plain_fedavg
    np.testing.assert_array_equal(opt.apply(w, d)[0], (w[0] + d[0]).numpy())
    assert opt.get_state()[1] == {}


def test_state_round_trips_through_a_checkpoint_mapping():
    rng = np.random.default_rng(2)
    a, b = ServerOptimizer("yogi", 0.1), ServerOptimizer("yogi", 0.1)
    w = [tf.zeros((5,), tf.float64)]
    for _ in range(3):
        w = a.apply(w, [rng.normal(size=5)])
    info, arrays = a.get_state()
    b.set_state(info, dict(arrays))
    d = [rng.normal(size=5)]
    np.testing.assert_array_equal(a.apply(w, d)[0], b.apply(w, d)[0])
    assert b.steps == 4


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(server_optimizer="adamw"), "server optimizer must be one of sgd, adagrad"),
        (dict(server_lr=0.0), "server_lr"),
        (dict(server_momentum=1.0), "server_momentum"),
        (dict(server_tau=-1.0), "server_tau"),
    ],
)
def test_bad_settings_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        FederatedConfig(**kwargs)


def test_the_cli_flags_reach_the_config_and_errors_name_the_flag(capsys):
    import argparse

    from dpfl_tf.federated.cli import add_federated_parser, config_from_args

    parser = argparse.ArgumentParser()
    add_federated_parser(parser.add_subparsers())
    args = parser.parse_args(
        ["federated", "--server-optimizer", "adam", "--server-lr", "0.05", "--server-tau", "0.01"]
    )
    config = config_from_args(args)
    opt = config.build_server_optimizer()
    assert (opt.kind, opt.learning_rate, opt.momentum, opt.tau) == ("adam", 0.05, 0.9, 0.01)
    bad = parser.parse_args(["federated", "--server-lr", "-1"])
    with pytest.raises(ValueError):
        config_from_args(bad, error=lambda msg: print(msg))
    assert capsys.readouterr().out.startswith("--server-lr ")


_cfg = small_global_dp_config


def test_the_optimizer_sees_the_released_aggregate_and_the_ledger_does_not_change(mnist_small):
    """Post-processing: the update a round hands the optimiser is the aggregate the
    aggregator released, noise included (it is not the plain mean of the clipped
    uploads), and a run with FedAdam records the ledger and epsilon of the same run
    with FedAvg (server lr 1) while its weights differ."""
    runs = {}
    for kind, lr in (("sgd", 1.0), ("adam", 0.05)):
        server, _ = build_server(
            _cfg(server_optimizer=kind, server_lr=lr), mnist_small, progress=False
        )
        released, seen, clipped = [], [], []
        aggregate, apply = server.aggregator.aggregate, server.server_optimizer.apply

        def spy_aggregate(uploads, *args, _aggregate=aggregate, _released=released, **kwargs):
            uploads = list(uploads)
            clip = server.aggregator.sanitizer.l2_norm_clip
            plain = []
            for update, _ in uploads:
                norm = np.sqrt(sum(float(np.sum(np.square(u))) for u in update))
                plain.append([np.asarray(u) * min(1.0, clip / norm) for u in update])
            clipped.append([np.mean(parts, axis=0) for parts in zip(*plain)] if plain else None)
            result = _aggregate(iter(uploads), *args, **kwargs)
            _released.append([np.array(u) for u in result.update])
            return result

        def spy_apply(weights, update, _apply=apply, _seen=seen):
            _seen.append([np.array(u) for u in update])
            return _apply(weights, update)

        server.aggregator.aggregate = spy_aggregate
        server.server_optimizer.apply = spy_apply
        server.run(3)
        assert len(seen) == len(released) == 3
        for s, r, c in zip(seen, released, clipped):
            for a, b in zip(s, r):
                np.testing.assert_array_equal(a, b)
            if c is not None:  # sigma S / m = 1/3 per coordinate: far from the plain mean
                assert np.abs(s[0] - c[0]).mean() > 0.1
        runs[kind] = (server.ledger.to_dict(), server.epsilon(), server.trainer.get_weights())
    assert runs["adam"][0] == runs["sgd"][0] and runs["adam"][1] == runs["sgd"][1] > 0
    assert not np.allclose(np.asarray(runs["adam"][2][0]), np.asarray(runs["sgd"][2][0]))


def test_a_server_optimizer_resumes_with_its_state(mnist_small, tmp_path):
    """Four rounds straight == two rounds, a new process-like start from the
    checkpoint, two more (FedYogi's m and v are in the checkpoint)."""
    cfg = _cfg(server_optimizer="yogi", server_lr=0.05, rounds=4)
    straight = run_federated(cfg, mnist_small, progress=False)
    ckpt = str(tmp_path / "ckpt")
    run_federated(
        _cfg(server_optimizer="yogi", server_lr=0.05, rounds=2),
        mnist_small,
        progress=False,
        checkpoint_dir=ckpt,
    )
    server, _ = build_server(cfg, mnist_small, progress=False)
    assert server.load_checkpoint(ckpt) and server.server_optimizer.steps == 2
    resumed = run_federated(cfg, mnist_small, progress=False, checkpoint_dir=ckpt)
    assert resumed["rounds"] == 4
    assert resumed["test_accuracy"] == straight["test_accuracy"]
    assert [h["loss"] for h in resumed["history"]] == pytest.approx(
        [h["loss"] for h in straight["history"]], rel=1e-6
    )
    # the same checkpoint is refused by a run with another server optimiser
    with pytest.raises(ValueError, match="server_optimizer"):
        other, _ = build_server(_cfg(rounds=4), mnist_small, progress=False)
        other.load_checkpoint(ckpt)


def test_a_non_default_rule_keeps_float32_weights_float32():
    rng = np.random.default_rng(3)
    w32 = [rng.normal(size=(4, 3)).astype(np.float32)]
    d = [rng.normal(scale=0.1, size=(4, 3)).astype(np.float32)]
    a, b = ServerOptimizer("adam", 0.1), ServerOptimizer("adam", 0.1)
    got = a.apply(w32, d)[0]
    want = b.apply([w32[0].astype(np.float64)], d)[0]
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


def test_a_round_that_releases_nothing_leaves_the_model_and_the_momentum(mnist_small):
    """A secure aggregation that aborted (or no uploads to a plain mean) releases
    nothing: momentum must not keep moving the model on such a round."""
    from dpfl_tf.federated.aggregators import AggregateResult

    cfg = _cfg(server_optimizer="sgd", server_momentum=0.9, server_lr=0.5)
    server, _ = build_server(cfg, mnist_small, progress=False)
    server.run(1)
    before = [np.array(w) for w in server.trainer.get_weights()]
    t, selected = server.open_round()
    zeros = [tf.zeros_like(w) for w in server.trainer.get_weights()]
    server.close_round(
        t,
        selected,
        server.trainer.get_weights(),
        AggregateResult(zeros, 0, {"aborted": "test"}, released=False),
        start=0.0,
        cpu_start=0.0,
    )
    for a, b in zip(before, server.trainer.get_weights()):
        np.testing.assert_array_equal(a, np.asarray(b))
    assert server.server_optimizer.steps == 1 and server.ledger.count() == 2  # still charged


def test_an_optimizer_of_another_run_is_refused(mnist_small):
    opt = ServerOptimizer("yogi", 0.1)
    opt.apply([np.zeros(2)], [np.ones(2)])
    cfg = _cfg()
    from dpfl_tf.federated.server import FederatedServer

    server, _ = build_server(cfg, mnist_small, progress=False)
    with pytest.raises(ValueError, match="taken 1 steps for another run"):
        FederatedServer(
            server.trainer,
            server.partition,
            server.aggregator,
            sampling=server.sampling,
            test_data=None,
            delta_max=cfg.delta_max,
            server_optimizer=opt,
        )


def test_a_checkpoint_from_before_server_optimizers_resumes_as_fedavg(mnist_small, tmp_path):
    """Checkpoints written before this feature have no optimiser: FedAvg resumes them,
    another optimiser refuses them."""
    import json

    ckpt = tmp_path / "old"
    server, _ = build_server(_cfg(rounds=2), mnist_small, progress=False)
    server.run(2, checkpoint_dir=str(ckpt))
    state = json.loads((ckpt / "state.json").read_text())
    del state["fingerprint"]["server_optimizer"], state["server_optimizer"]
    (ckpt / "state.json").write_text(json.dumps(state))
    fedavg, _ = build_server(_cfg(rounds=2), mnist_small, progress=False)
    assert fedavg.load_checkpoint(str(ckpt)) and fedavg.rounds_done == 2
    yogi, _ = build_server(_cfg(rounds=2, server_optimizer="yogi"), mnist_small, progress=False)
    with pytest.raises(ValueError, match="server_optimizer"):
        yogi.load_checkpoint(str(ckpt))


def test_the_config_keeps_an_unset_momentum_for_the_rule_to_resolve():
    import dataclasses

    cfg = FederatedConfig(server_optimizer="sgd")
    assert cfg.server_momentum is None
    adam = dataclasses.replace(cfg, server_optimizer="adam").build_server_optimizer()
    assert adam.momentum == 0.9  # the adaptive rules' default, not sgd's resolved 0
    assert FederatedConfig(server_lr="0.5").server_lr == 0.5  # numbers, not strings
