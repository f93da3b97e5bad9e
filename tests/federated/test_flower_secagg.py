"""Distributed DP in Flower's SecAgg+: b-bit vectors pass Flower's quantizer and
masking unchanged; the workflow finishes a round only with min_clients uploads; the
same config gives the same model, uploads and epsilon in-process (simulated secure
sum) and in SecAggPlusWorkflow (LocalGrid), with dropouts; the mod refuses to send
a noised vector outside secure aggregation."""

import dataclasses
import importlib.util
import os

import numpy as np
import pytest

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
flwr = pytest.importorskip("flwr", reason="Flower is not installed: pip install 'dpfl-tf[flower]'")

from flwr.app import ConfigRecord, Context, Message, RecordDict  # noqa: E402
from flwr.common.secure_aggregation.quantization import dequantize, quantize  # noqa: E402

from dpfl_tf.federated import flower as fl  # noqa: E402
from dpfl_tf.federated import flower_secagg as fs  # noqa: E402
from dpfl_tf.federated.runner import FederatedConfig, run_federated  # noqa: E402


def _cfg(**kw):
    base = dict(
        dp="distributed",
        clients=12,
        clients_per_round=8,
        min_clients=5,
        dropout_rate=0.2,
        rounds=3,
        hidden=(16,),
        noise_multiplier=1.0,
        noise_seed=3,
        partition="iid",
        bits=16,
        seed=1,
    )
    base.update(kw)
    return FederatedConfig(**base)


@pytest.mark.parametrize("bits, n", [(8, 5), (16, 40), (20, 3)])
def test_b_bit_vectors_pass_flowers_quantizer_and_modulus_unchanged(bits, n):
    """Flower's own quantize / mask-free modular sum / dequantize, as SecAgg+ applies
    them (weight factor included), give back sum_i v_i mod 2^b."""
    r = fs.secagg_ranges(bits)
    rng = np.random.default_rng(bits)
    vs = [rng.integers(0, 2**bits, size=257) for _ in range(n)]
    quantized = []
    for v in vs:
        q = quantize([fs.centred(v, bits)], r["clipping_range"], r["quantization_range"])[0]
        assert np.array_equal(q, fs.centred(v, bits) + r["clipping_range"])  # exact
        quantized.append(q)
    factor = (n * round(1.0 / r["max_weight"] * r["quantization_range"])) % r["modulus_range"]
    summed = np.mod(sum(quantized), r["modulus_range"])
    flower_out = dequantize([summed], r["clipping_range"], r["quantization_range"])[0]
    flower_out += -(n - 1) * r["clipping_range"]
    flower_out *= r["quantization_range"] / factor
    assert np.array_equal(fs.recover_sum(flower_out, n, bits), np.mod(sum(vs), 2**bits))


def test_secagg_finishes_rounds_with_min_clients_uploads_only():
    assert fs.secagg_min_survivors(8, 8, 5) == 5  # everyone a neighbour: n_min
    assert fs.secagg_min_survivors(100, 21, 11) == 53  # a sparse SecAgg+ graph
    strategy = fs.DistributedDPStrategy.from_config(_cfg(), _small())
    flow = strategy.workflow()
    assert flow.modulus_range == 2**17 and flow.quantization_range == 2**16 + 2
    assert round(flow.reconstruction_threshold * 8) == 5
    assert strategy.server.aggregator.mechanism.event().num_shares == 5


def _small():
    from dpfl_tf.data import load_dataset

    ds = load_dataset("mnist")
    rng = np.random.default_rng(0)
    tr = np.sort(rng.permutation(len(ds.y_train))[:1500])
    te = np.sort(rng.permutation(len(ds.y_test))[:500])
    return dataclasses.replace(
        ds,
        x_train=ds.x_train[tr],
        y_train=ds.y_train[tr],
        x_test=ds.x_test[te],
        y_test=ds.y_test[te],
    )


@pytest.mark.parametrize("mechanism", ["discrete_gaussian", "skellam"])
def test_in_process_and_flower_secagg_give_the_same_rounds(mechanism):
    data = _small()
    cfg = _cfg(ddp_mechanism=mechanism)
    here = run_federated(cfg, data, progress=False)
    there = fl.run_on_flower(cfg, data, backend="local")
    assert there["flower_backend"] == "local, SecAgg+"
    assert [h["info"]["uploads"] for h in there["history"]] == [
        h["info"]["uploads"] for h in here["history"]
    ]
    assert min(h["info"]["uploads"] for h in here["history"]) < 8  # clients dropped out
    for a, b in zip(here["history"], there["history"]):
        assert a["accuracy"] == b["accuracy"] and a["loss"] == pytest.approx(b["loss"], rel=1e-6)
        assert a["epsilon"] == b["epsilon"]
    assert here["privacy"]["against_server"] == there["privacy"]["against_server"]
    assert here["bits_per_parameter"] == there["bits_per_parameter"]


@pytest.mark.skipif(
    importlib.util.find_spec("ray") is None,
    reason="Flower's Simulation Engine needs Ray: pip install 'flwr[simulation]'",
)
def test_secagg_on_the_simulation_engine_gives_the_in_process_rounds():
    """SecAgg+ with Ray workers (serialised messages, one process per ClientApp actor),
    dropouts included: the rounds of the in-process simulation.  (100 clients per
    round: experiments/federated_distributed.py --flower.)"""
    data = _small()
    cfg = _cfg(clients=6, clients_per_round=5, min_clients=3, rounds=2, hidden=(4,))
    here = run_federated(cfg, data, progress=False)
    there = fl.run_on_flower(cfg, data, backend="ray")
    assert there["flower_backend"] == "ray, SecAgg+"
    assert [h["info"]["uploads"] for h in there["history"]] == [
        h["info"]["uploads"] for h in here["history"]
    ]
    assert [h["accuracy"] for h in there["history"]] == [h["accuracy"] for h in here["history"]]


def test_a_round_below_min_clients_releases_nothing_on_both_runtimes():
    data = _small()
    cfg = _cfg(rounds=2, dropout_rate=0.5, min_clients=7, seed=2)
    here = run_federated(cfg, data, progress=False)
    there = fl.run_on_flower(cfg, data, backend="local")
    aborted = [("aborted" in h["info"]) for h in here["history"]]
    assert any(aborted)
    assert aborted == [("aborted" in h["info"]) for h in there["history"]]
    assert [h["accuracy"] for h in here["history"]] == [h["accuracy"] for h in there["history"]]
    assert here["epsilon"] == there["epsilon"]  # recorded anyway: conservative


def test_the_mod_refuses_to_send_a_noised_vector_outside_secure_aggregation():
    fl._ensure_task_identity(1)
    msg = Message(
        RecordDict({"config": ConfigRecord({fl.ROUND_KEY: 0})}), dst_node_id=2, message_type="train"
    )
    context = Context(
        run_id=1, node_id=2, node_config={fl.PARTITION_ID_KEY: 0}, state=RecordDict(), run_config={}
    )
    with pytest.raises(ValueError, match="inside Flower's secure aggregation"):
        fs.distributed_dp_mod(msg, context, lambda m, c: m)
    with pytest.raises(ValueError, match="dp='distributed'"):
        fs.run_on_secagg(FederatedConfig(dp="global"), backend="local")
    with pytest.raises(ValueError, match="local_dp and strategy must be None"):
        fl.run_on_flower(_cfg(), backend="local", strategy=object())
