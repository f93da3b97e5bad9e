"""The Flower adapter: the client's upload equals the in-process client's, the
strategy's epsilon equals the ledger's, the same config runs in-process and on
Flower (LocalGrid without Ray; Flower's Simulation Engine on Ray), bad
configurations are refused."""

import importlib.util
import json
import os
import subprocess
import sys

import dp_accounting
import numpy as np
import pytest

# no telemetry calls from the test run (read when flwr is first imported; Ray workers inherit it)
os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
flwr = pytest.importorskip("flwr", reason="Flower is not installed: pip install 'dpfl-tf[flower]'")

import tensorflow as tf  # noqa: E402
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict  # noqa: E402
from flwr.serverapp.strategy import FedAvg  # noqa: E402

from dpfl_tf._seeds import derive_seed  # noqa: E402
from dpfl_tf.federated import flower as fl  # noqa: E402
from dpfl_tf.federated.aggregators import ClientNoiseDPAggregator  # noqa: E402
from dpfl_tf.federated.local_dp import DomainPolicy, PiecewiseMechanism, gaussian_upload_report  # noqa: E402
from dpfl_tf.federated.runner import FederatedConfig, build_server, run_federated  # noqa: E402
from dpfl_tf.privacy import compute_epsilon, gaussian_step_event  # noqa: E402
from dpfl_tf.sanitizer import GaussianSanitizer, make_generator  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _cfg(**kw):
    base = dict(
        clients=4,
        clients_per_round=2,
        sampling="fixed_size",
        rounds=2,
        partition="iid",
        hidden=(16,),
        accountant="rdp",
        dp="global",
        noise_multiplier=1.0,
        clip=1.0,
        noise_seed=1,
        seed=0,
    )
    base.update(kw)
    return FederatedConfig(**base)


def _round_event(cfg):
    """The event of one round, written from the papers' formulas (not from the code)."""
    m, k = cfg.clients_per_round, cfg.clients
    sigma = cfg.noise_multiplier * (np.sqrt(m) if cfg.dp.value == "client" else 1.0)
    if cfg.clip == "adaptive":  # Andrew et al.: the update and the count, one sample
        z_count = 2 * cfg.clip_count_stddev
        z_delta = (sigma**-2 - z_count**-2) ** -0.5
        return dp_accounting.PoissonSampledDpEvent(
            m / k,
            dp_accounting.ComposedDpEvent(
                [dp_accounting.GaussianDpEvent(z_delta), dp_accounting.GaussianDpEvent(z_count)]
            ),
        )
    if cfg.sampling.value == "fixed_size":
        return gaussian_step_event(sigma, "fixed_size", dataset_size=k, lot_size=m)
    return gaussian_step_event(sigma, "poisson", sampling_rate=m / k)


def _train_message(weights, round_index, node_id=3):
    fl._ensure_task_identity(1)
    content = RecordDict(
        {
            "arrays": ArrayRecord([np.asarray(w) for w in weights]),
            "config": ConfigRecord({fl.ROUND_KEY: round_index}),
        }
    )
    return Message(content, dst_node_id=node_id, message_type="train")


def _context(partition_id, num_partitions=4):
    return Context(
        run_id=1,
        node_id=partition_id + 1,
        node_config={fl.PARTITION_ID_KEY: partition_id, fl.NUM_PARTITIONS_KEY: num_partitions},
        state=RecordDict(),
        run_config={},
    )


def _arrays(reply):
    return next(iter(reply.content.array_records.values())).to_numpy_ndarrays()


def _metrics(reply):
    return dict(next(iter(reply.content.metric_records.values())))


# ---------------------------------------------------------------------------
# the client


@pytest.mark.parametrize("dp", ["none", "client"])
def test_client_upload_equals_in_process_client_update(mnist_small, dp):
    cfg = _cfg(dp=dp, noise_multiplier=0.7, clip=0.5)
    ref, _ = build_server(cfg, mnist_small, progress=False)
    w0 = ref.trainer.get_weights()
    t, k = 3, 2
    # in-process: LocalTrainer.train on the client's indices with the client's generator
    # (the streams are derive_seed's since the seeding helper; the formula was numpy's
    # SeedSequence of (seed, t, k) before) ...
    expected = ref.trainer.train(
        w0, ref.partition.client(k), np.random.default_rng(derive_seed(0, "local-shuffle", t, k))
    )
    if dp == "client":  # ... then the DP-FedAvg client step: clip + noise by the sanitizer
        agg = ClientNoiseDPAggregator(GaussianSanitizer(0.5, 0.7))
        agg.reseed(derive_seed(1, "client-noise", t, k))
        expected = agg.client_transform(expected)
        assert float(tf.linalg.global_norm(expected)) > 0.5  # noise was added
    app = fl.make_client_app(cfg, mnist_small)
    reply = app(_train_message(w0, t), _context(k))
    got = _arrays(reply)
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        np.testing.assert_array_equal(g, np.asarray(e))
    m = _metrics(reply)
    assert m["partition-id"] == k
    # n_k is client data: sent to a trusted (or non-private) server only
    assert m["num-examples"] == (len(ref.partition.client(k)) if dp == "none" else 1)
    assert m["uploads"] == 1
    if dp == "client":  # the client's own per-upload guarantee: replace-one, Gaussian(z/2)
        assert m["client-dp-epsilon-upload"] == pytest.approx(
            compute_epsilon(dp_accounting.GaussianDpEvent(0.35), cfg.delta_max, "rdp")
        )
        want = gaussian_upload_report(0.7, 1, delta=cfg.delta_max, accountant="rdp")
        assert m["client-dp-epsilon-upload"] == want.accountant_epsilon_per_upload
        assert m["client-dp-epsilon-total"] == want.accountant_epsilon_total


def test_client_local_dp_upload_and_its_composition_across_rounds(mnist_small):
    cfg = _cfg(dp="none")
    mech = PiecewiseMechanism(2.0, seed=5)
    policy = DomainPolicy.clip(1.0)
    ref, _ = build_server(cfg, mnist_small, progress=False)
    w0 = ref.trainer.get_weights()
    app = fl.make_client_app(cfg, mnist_small, local_dp=fl.LocalDPUpload(mech, policy))
    ctx = _context(1)
    reply = app(_train_message(w0, 0), ctx)
    delta = ref.trainer.train(w0, ref.partition.client(1), ref.shuffle_rng(0, 1))
    gen = make_generator(derive_seed(5, "local-dp", 0, 1))  # (mechanism seed, t, k)
    want = [
        p - w
        for p, w in zip(
            mech.perturb_weights([w + d for w, d in zip(w0, delta)], policy, generator=gen), w0
        )
    ]
    for g, e in zip(_arrays(reply), want):
        np.testing.assert_allclose(g, np.asarray(e), rtol=0, atol=1e-6)
    d = sum(int(np.prod(w.shape)) for w in w0)
    first = _metrics(reply)
    assert first["ldp-epsilon-upload"] == pytest.approx(d * 2.0)
    assert first["ldp-epsilon-total"] == pytest.approx(d * 2.0)
    # the same node again: its state counts the uploads and the total composes
    second = _metrics(app(_train_message(w0, 1), ctx))
    assert second["uploads"] == 2
    assert second["ldp-epsilon-total"] == pytest.approx(2 * d * 2.0)


def test_client_refuses_bad_messages_and_nodes(mnist_small):
    cfg = _cfg(dp="none")
    app = fl.make_client_app(cfg, mnist_small)
    w0 = build_server(cfg, mnist_small, progress=False)[0].trainer.get_weights()
    fl._ensure_task_identity(1)
    no_round = Message(
        RecordDict(
            {"arrays": ArrayRecord([np.asarray(w) for w in w0]), "config": ConfigRecord({})}
        ),
        dst_node_id=1,
        message_type="train",
    )
    with pytest.raises(ValueError, match="dpfl-round"):
        app(no_round, _context(0))
    with pytest.raises(ValueError, match="num-partitions=5 but the config has clients=4"):
        app(_train_message(w0, 0), _context(0, num_partitions=5))
    with pytest.raises(ValueError, match=r"partition-id\) must lie in \[0, 4\)"):
        app(_train_message(w0, 0), _context(7))
    with pytest.raises(ValueError, match="shapes"):
        app(_train_message(w0[:1], 0), _context(0))


# ---------------------------------------------------------------------------
# the strategy and whole runs (LocalGrid: Flower's apps and strategy, no Ray)


@pytest.mark.parametrize(
    "dp,sampling,accountant,clip",
    [
        ("global", "fixed_size", "rdp", 1.0),  # Flower's own scheme: m of K without replacement
        ("global", "poisson", "moments", 1.0),  # Poisson sampling implemented on the server
        ("client", "fixed_size", "rdp", 1.0),  # DP-FedAvg with client-side noise
        ("global", "poisson", "rdp", "adaptive"),  # DP adaptive clipping: update + count release
    ],
)
def test_same_config_same_epsilon_in_process_and_on_flower(
    mnist_small, dp, sampling, accountant, clip
):
    cfg = _cfg(dp=dp, sampling=sampling, accountant=accountant, clip=clip, clip_count_stddev=2.0)
    inproc = run_federated(cfg, mnist_small, progress=False)
    flower = fl.run_on_flower(cfg, mnist_small, backend="local")
    assert set(inproc) <= set(flower)  # the same result format
    assert flower["rounds"] == inproc["rounds"] == 2
    assert flower["epsilon"] == inproc["epsilon"]  # exactly: the same events
    assert [r["epsilon"] for r in flower["history"]] == [r["epsilon"] for r in inproc["history"]]
    assert flower["privacy"]["round_event"] == inproc["privacy"]["round_event"]
    want = compute_epsilon(
        dp_accounting.SelfComposedDpEvent(_round_event(cfg), 2), cfg.delta_max, accountant
    )
    assert flower["epsilon"] == pytest.approx(want, rel=1e-9)
    if clip == "adaptive":  # the server adapted the bound from the noised count
        assert flower["history"][0]["info"]["clip"] == cfg.clip_initial == 0.1
        assert flower["history"][1]["info"]["clip"] == flower["history"][0]["info"]["clip_next"]
    if dp == "client":
        # LocalGrid's node k+1 holds partition k: the same clients take part
        against = flower["privacy"]["against_server"]
        assert against == inproc["privacy"]["against_server"]
        # what the clients themselves report equals the server's per-client report
        assert flower["client_reported"]["max_client_dp_epsilon_total"] == pytest.approx(
            against["epsilon"]
        )


#: result keys two runs of one config may differ in: wall and CPU time, the process's memory
TIMING_KEYS = {"seconds", "median_round_seconds", "rounds_per_minute", "peak_rss_mb"}
HISTORY_TIMING_KEYS = {"seconds", "cpu_seconds"}
#: what only a Flower result has: the runtime's labels and the clients' own reports
RUNTIME_KEYS = {"runtime", "flower_backend", "flwr_version", "client_reported"}


def _assert_same(got, want, where="result"):
    """Equal, floats to 1e-6 (Flower's FedAvg averages in numpy, in-process in TF)."""
    if isinstance(want, dict):
        assert isinstance(got, dict) and set(got) == set(want), (where, got, want)
        for key in want:
            _assert_same(got[key], want[key], f"{where}[{key!r}]")
    elif isinstance(want, (list, tuple)):
        assert isinstance(got, (list, tuple)) and len(got) == len(want), (where, got, want)
        for i, (g, w) in enumerate(zip(got, want)):
            _assert_same(g, w, f"{where}[{i}]")
    elif isinstance(want, float) and not isinstance(got, bool):
        assert got == pytest.approx(want, rel=1e-6, abs=1e-9), (where, got, want)
    else:
        assert got == want, (where, got, want)


@pytest.mark.parametrize("dp, server", [("local", "sgd"), ("client", "sgd"), ("global", "yogi")])
def test_one_config_gives_one_result_on_both_runtimes(mnist_small, dp, server):
    """The in-process server and the Flower strategy open, train, close and report a
    round with the same functions (the server optimiser's move included): every
    result key agrees (seeded runs), apart from timings and Flower's runtime labels."""
    extra = (
        dict(ldp_mechanism="piecewise", ldp_epsilon=2.0, ldp_bound=0.5, accountant="moments")
        if dp == "local"
        else {}
    )
    if server != "sgd":  # and the released model is the average of the global models,
        # the clients' step decaying over the rounds
        extra.update(server_optimizer=server, server_lr=0.05, model_average=0.5, lr_decay_rounds=2)
    cfg = _cfg(dp=dp, rounds=3, eval_every=2, **extra)
    inproc = run_federated(cfg, mnist_small, progress=False)
    flower = fl.run_on_flower(cfg, mnist_small, backend="local")
    assert set(flower) - set(inproc) == RUNTIME_KEYS
    assert (
        flower["mechanism"]
        == inproc["mechanism"]
        == {"local": "ldp_piecewise", "client": "client_dp", "global": "global_dp"}[dp]
    )
    assert flower["dataset"] == inproc["dataset"] == mnist_small.source.label
    for key in sorted(set(inproc) - TIMING_KEYS - {"history"}):
        _assert_same(flower[key], inproc[key], key)
    assert len(flower["history"]) == len(inproc["history"]) == 3
    for got, want in zip(flower["history"], inproc["history"]):
        _assert_same(
            {k: v for k, v in got.items() if k not in HISTORY_TIMING_KEYS},
            {k: v for k, v in want.items() if k not in HISTORY_TIMING_KEYS},
        )
    assert inproc["history"][0]["accuracy"] is None  # eval_every=2: rounds 2 and 3
    assert inproc["test_accuracy"] == inproc["history"][-1]["accuracy"] is not None
    if server != "sgd":
        assert "global_model_accuracy" in flower and "global_model_accuracy" in inproc


def test_correlated_noise_gives_one_result_on_both_runtimes(mnist_small):
    """Banded MF with cyclic cohorts: the Flower strategy closes rounds with the
    server's functions, so its noise, ledger and history are the in-process run's."""
    cfg = _cfg(dp="banded_mf", clients_per_round=None, sampling=None, cohorts=2, rounds=4)
    inproc = run_federated(cfg, mnist_small, progress=False)
    flower = fl.run_on_flower(cfg, mnist_small, backend="local")
    assert flower["mechanism"] == inproc["mechanism"] == "banded_mf"
    for key in sorted(set(inproc) - TIMING_KEYS - {"history"}):
        _assert_same(flower[key], inproc[key], key)
    for got, want in zip(flower["history"], inproc["history"]):
        _assert_same(
            {k: v for k, v in got.items() if k not in HISTORY_TIMING_KEYS},
            {k: v for k, v in want.items() if k not in HISTORY_TIMING_KEYS},
        )


def test_strategy_reports_the_ledger_epsilon_per_round_and_stops_at_the_budget(mnist_small):
    base = _cfg(rounds=5)
    event = _round_event(base)
    eps2 = compute_epsilon(dp_accounting.SelfComposedDpEvent(event, 2), base.delta_max, "rdp")
    cfg = _cfg(rounds=5, target_epsilon=eps2 * 1.001)
    inproc = run_federated(cfg, mnist_small, progress=False)
    strategy = fl.DPStrategy.from_config(cfg, mnist_small)
    grid = fl.LocalGrid(fl.make_client_app(cfg, mnist_small), cfg.clients)
    result = strategy.run(grid, cfg.rounds)
    srv = strategy.server
    assert srv.rounds_done == inproc["rounds"] == 2  # the same stop rule
    assert srv.stop_reason == inproc["stop_reason"]
    assert srv.stop_reason.startswith("privacy budget: round 3")
    assert sorted(result.train_metrics_clientapp) == [1, 2]
    for r in (1, 2):
        metrics = result.train_metrics_clientapp[r]
        want = compute_epsilon(dp_accounting.SelfComposedDpEvent(event, r), cfg.delta_max, "rdp")
        assert metrics["epsilon"] == pytest.approx(want, rel=1e-9)
        assert metrics["epsilon"] == srv.history[r - 1].epsilon
        assert metrics["delta"] <= cfg.delta_max
        assert metrics["clients"] == 2 and "fraction-clipped" not in metrics  # raw: not sent
        assert result.evaluate_metrics_serverapp[r]["accuracy"] == metrics["accuracy"]
    assert metrics["epsilon"] == srv.ledger.epsilon(cfg.delta_max)
    assert len(srv.ledger) == 2 and srv.ledger.event == dp_accounting.ComposedDpEvent(
        [dp_accounting.SelfComposedDpEvent(srv.round_event, 2)]
    )


def test_same_config_statistically_equivalent_accuracy(mnist_small):
    """Without noise, the runs differ only in the clients' shuffling streams."""
    cfg = _cfg(dp="none", clients_per_round=4, rounds=2)
    inproc = run_federated(cfg, mnist_small, progress=False)
    flower = fl.run_on_flower(cfg, mnist_small, backend="local")
    assert inproc["test_accuracy"] > 0.6 and flower["test_accuracy"] > 0.6
    assert abs(flower["test_accuracy"] - inproc["test_accuracy"]) < 0.05
    assert flower["epsilon"] is None and flower["mechanism"] == "fedavg"


# ---------------------------------------------------------------------------
# Flower's Simulation Engine (Ray)


@pytest.mark.skipif(
    importlib.util.find_spec("ray") is None,
    reason="Ray is not installed: pip install 'dpfl-tf[flower]' (flwr[simulation])",
)
def test_simulation_engine_run(mnist_small):
    cfg = _cfg(clients=3, clients_per_round=2, rounds=2)
    out = fl.run_on_flower(cfg, mnist_small, backend="ray")
    assert out["flower_backend"] == "ray" and out["rounds"] == 2
    assert [r["clients"] for r in out["history"]] == [2, 2]
    want = compute_epsilon(
        dp_accounting.SelfComposedDpEvent(_round_event(cfg), 2), cfg.delta_max, "rdp"
    )
    assert out["epsilon"] == pytest.approx(want, rel=1e-9)
    assert 0.0 <= out["test_accuracy"] <= 1.0


# ---------------------------------------------------------------------------
# bad configurations


def test_bad_configurations_are_refused(mnist_small):
    cfg = _cfg()
    with pytest.raises(ValueError, match="backend must be one of"):
        fl.run_on_flower(cfg, mnist_small, backend="spark")
    with pytest.raises(TypeError, match="FederatedConfig"):
        fl.run_on_flower({"clients": 4}, mnist_small, backend="local")
    with pytest.raises(ValueError, match="backend_config is for backend='ray'"):
        fl.run_on_flower(cfg, mnist_small, backend="local", backend_config={})
    with pytest.raises(ValueError, match="unknown run-config key 'clinets'"):
        fl.config_from_run_config({"clinets": 4})
    with pytest.raises(ValueError, match="sampling='fixed_size'"):
        fl.config_from_run_config({"dp": "client", "sampling": "poisson"})
    assert fl.config_from_run_config(fl.config_to_run_config(cfg)) == cfg
    assert fl.config_from_run_config({"hidden": "32,8", "clients-per-round": 3}).hidden == (32, 8)
    with pytest.raises(ValueError, match="perturb must be"):
        fl.LocalDPUpload(PiecewiseMechanism(1.0), perturb="gradient")
    with pytest.raises(TypeError, match="LocalDPMechanism"):
        fl.LocalDPUpload("piecewise")
    with pytest.raises(TypeError, match="FederatedServer"):
        fl.DPStrategy(FedAvg(), "server")
    with pytest.raises(TypeError, match="flwr Strategy"):
        fl.DPStrategy("fedavg", build_server(cfg, mnist_small, progress=False)[0])
    # an inner strategy that samples on its own would break the accounted event
    half = FedAvg(
        fraction_train=0.5, fraction_evaluate=0.0, min_train_nodes=0, min_available_nodes=0
    )
    with pytest.raises(ValueError, match="must address every node it is offered"):
        fl.run_on_flower(cfg, mnist_small, backend="local", strategy=half)
    # K enters the event: the federation must have exactly config.clients nodes
    strategy = fl.DPStrategy.from_config(cfg, mnist_small, node_timeout=0.2)
    with pytest.raises(ValueError, match="the federation has 3 nodes but the config has clients=4"):
        strategy.run(fl.LocalGrid(fl.make_client_app(cfg, mnist_small), 3), 1)
    assert len(strategy.server.ledger) == 0


def test_without_flower_the_package_works_and_the_module_says_how_to_install():
    code = (
        "import sys; sys.modules['flwr'] = None\n"
        "import dpfl_tf, dpfl_tf.federated\n"
        "from dpfl_tf.federated import FederatedConfig, run_federated\n"
        "print('package ok')\n"
        "import dpfl_tf.federated.flower\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert "package ok" in proc.stdout
    assert proc.returncode != 0
    assert "ImportError" in proc.stderr and "pip install 'dpfl-tf[flower]'" in proc.stderr


def test_client_applies_the_configs_local_dp_like_the_in_process_server(mnist_small):
    cfg = _cfg(
        dp="local",
        ldp_mechanism="duchi",
        ldp_epsilon=1.5,
        ldp_bound=0.5,
        hidden=(8,),
        accountant="moments",
        noise_multiplier=1.0,
    )
    ref, _ = build_server(cfg, mnist_small, progress=False)
    w0 = ref.trainer.get_weights()
    t, k = 1, 2
    want, _ = fl.client_update(ref, k, w0, t, local_dp=ref.local_dp)
    reply = fl.make_client_app(cfg, mnist_small)(_train_message(w0, t), _context(k))
    got = _arrays(reply)
    for g, e in zip(got, want):
        np.testing.assert_allclose(g, np.asarray(e), rtol=0, atol=1e-6)
    # Duchi on [-0.5, 0.5]: every uploaded weight w0 + Delta' is +-B r (the mechanism ran)
    b = ref.local_dp.mechanism.B * 0.5
    for g, w in zip(got, w0):
        np.testing.assert_allclose(np.abs(g + np.asarray(w)), b, rtol=1e-5)
    assert _metrics(reply)["ldp-epsilon-coordinate"] == 1.5
    assert _metrics(reply)["num-examples"] == 1  # n_k is not sent under local DP
    assert ref.aggregator.weighted is False  # in-process: the unweighted mean
    with pytest.raises(ValueError, match="give the local-DP mechanism in one place"):
        fl.make_client_app(cfg, mnist_small, local_dp=ref.local_dp)(
            _train_message(w0, t), _context(k)
        )


def test_pnpm_on_flower_reports_an_infinite_upload_epsilon_and_a_sign_only_figure(mnist_small):
    cfg = _cfg(
        dp="local",
        ldp_mechanism="pnpm",
        ldp_epsilon=1.0,
        rounds=1,
        hidden=(8,),
        accountant="moments",
        clients_per_round=4,
    )
    inproc = run_federated(cfg, mnist_small, progress=False)
    flower = fl.run_on_flower(cfg, mnist_small, backend="local")
    d = inproc["num_coordinates"]
    for out in (inproc, flower):
        assert out["epsilon_per_upload"] is None and out["epsilon_per_upload_is_infinite"]
        assert out["epsilon_per_upload_sign_only"] == pytest.approx(d * 1.0)
    reported = flower["client_reported"]
    assert reported["max_ldp_epsilon_total"] is None
    assert reported["max_ldp_epsilon_total_is_infinite"]
    assert reported["max_ldp_epsilon_total_sign_only"] == pytest.approx(d * 1.0)


def test_secure_mode_on_flower(mnist_small):
    """The strategy samples with os.urandom and every client draws secure noise; the
    event, and so epsilon, is the in-process one."""
    cfg = _cfg(dp="client", secure_mode=True, noise_seed=None, rounds=1)
    strategy = fl.DPStrategy.from_config(cfg, mnist_small)
    assert strategy.server.secure_mode and strategy.server.aggregator.secure_mode
    out = fl.run_on_flower(cfg, mnist_small, backend="local")
    want = compute_epsilon(
        dp_accounting.SelfComposedDpEvent(_round_event(cfg), 1), cfg.delta_max, "rdp"
    )
    assert out["epsilon"] == pytest.approx(want, rel=1e-9)
    assert out["privacy"]["secure_mode"] is True
    assert fl.config_from_run_config(fl.config_to_run_config(cfg)) == cfg


# ---------------------------------------------------------------------------
# nodes that come and go; books kept (issue 39, on LocalGrid)


class _LosingGrid(fl.LocalGrid):
    """A LocalGrid whose node `lose` goes down once `after` rounds have trained."""

    def __init__(self, *args, lose, after, **kwargs):
        super().__init__(*args, **kwargs)
        self.lose, self.after, self.rounds = lose, after, 0

    def send_and_receive(self, messages, *, timeout=None):
        messages = list(messages)
        replies = super().send_and_receive(messages, timeout=timeout)
        if messages and messages[0].metadata.message_type == "train":
            self.rounds += 1
            if self.rounds == self.after:
                self.stop_node(self.lose)
        return replies


def _server_context(**run_config):
    return Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=run_config)


def test_a_node_lost_mid_run_is_a_dropout_with_min_nodes(mnist_small):
    cfg = _cfg(clients=4, clients_per_round=3, rounds=5)
    strategy = fl.DPStrategy.from_config(cfg, mnist_small, min_nodes=2)
    grid = _LosingGrid(fl.make_client_app(cfg, mnist_small), 4, lose=2, after=1)
    result = strategy.run(grid, cfg.rounds)
    srv = strategy.server
    assert srv.rounds_done == 5 and srv.stop_reason == "completed 5 rounds"
    assert strategy.partition_nodes == {0: 1, 2: 3, 3: 4}  # node 2 (client 1) is gone
    # every round records the full round's event (conservative for a dropout)
    want = compute_epsilon(
        dp_accounting.SelfComposedDpEvent(_round_event(cfg), 5), cfg.delta_max, "rdp"
    )
    assert srv.epsilon() == pytest.approx(want, rel=1e-9)
    dropped = [r for r in srv.history[1:] if r.info.get("missing_clients")]
    assert dropped, "client 1 was never sampled after its node went down"
    for r in dropped:
        metrics = result.train_metrics_clientapp[r.round]
        assert (metrics["clients"], metrics["uploads"], metrics["missing-clients"]) == (3, 2, 1)


def test_duplicate_or_out_of_range_partition_ids_are_refused_naming_the_nodes(mnist_small):
    cfg = _cfg()
    grid = fl.LocalGrid(fl.make_client_app(cfg, mnist_small), 4)
    grid.contexts[3].node_config[fl.PARTITION_ID_KEY] = 0  # node 3 claims client 0 too
    with pytest.raises(ValueError, match=r"nodes 1 and 3 both hold partition-id=0"):
        fl.DPStrategy.from_config(cfg, mnist_small).run(grid, 1)
    grid = fl.LocalGrid(fl.make_client_app(cfg, mnist_small), 4, raise_client_errors=False)
    grid.contexts[4].node_config[fl.PARTITION_ID_KEY] = 9  # as on Flower: an error reply
    with pytest.raises(
        ValueError,
        match=r"node 4 could not enrol: .*must lie in \[0, 4\), "
        r"got 9",
    ):
        fl.DPStrategy.from_config(cfg, mnist_small).run(grid, 1)


def test_a_failed_flower_run_keeps_its_results_and_resumes_from_its_checkpoint(
    mnist_small, tmp_path
):
    """The ServerApp writes the results after every round and on failure; `flwr run`
    again with the same run config continues from the checkpoint and ends where the
    uninterrupted run ends (weights, accuracy, ledger)."""
    cfg = _cfg(clients=4, clients_per_round=2, rounds=4)
    client = fl.make_client_app(cfg, mnist_small)
    straight = {}
    fl.make_server_app(cfg, mnist_small, on_finish=lambda d, r, s: straight.update(d=d))(
        fl.LocalGrid(client, 4), _server_context()
    )

    out, ckpt = tmp_path / "flower.json", tmp_path / "ckpt"
    run_config = {"results-path": str(out), "checkpoint-dir": str(ckpt), "node-timeout": 0.2}
    app = fl.make_server_app(cfg, mnist_small)
    with pytest.raises(ValueError, match="fewer than min_nodes=4"):
        app(_LosingGrid(client, 4, lose=3, after=2), _server_context(**run_config))
    kept = json.loads(out.read_text())
    assert kept["status"] == "failed" and "fewer than min_nodes=4" in kept["error"]
    assert kept["rounds"] == 2 and kept["epsilon"] == straight["d"].server.history[1].epsilon

    resumed = {}
    fl.make_server_app(cfg, mnist_small, on_finish=lambda d, r, s: resumed.update(d=d))(
        fl.LocalGrid(client, 4), _server_context(**run_config)
    )
    done = json.loads(out.read_text())
    assert done["status"] == "completed" and done["rounds"] == 4
    a, b = resumed["d"].server, straight["d"].server
    assert a.ledger == b.ledger and done["epsilon"] == b.epsilon()
    assert a.history[-1].accuracy == b.history[-1].accuracy
    for x, y in zip(a.trainer.get_weights(), b.trainer.get_weights()):
        np.testing.assert_allclose(x.numpy(), y.numpy(), rtol=1e-6, atol=1e-7)


def test_a_server_optimizer_round_trips_through_the_run_config():
    cfg = _cfg(server_optimizer="yogi", server_lr=0.05, server_tau=0.01, model_average=0.9)
    again = fl.config_from_run_config(fl.config_to_run_config(cfg))
    assert again == cfg and again.model_average == 0.9
    assert again.build_server_optimizer().get_config() == {
        "kind": "yogi",
        "learning_rate": 0.05,
        "momentum": 0.9,
        "beta2": 0.99,
        "tau": 0.01,
    }
