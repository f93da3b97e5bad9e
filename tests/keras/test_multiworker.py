"""DP-SGD under MultiWorkerMirroredStrategy: two worker processes on 127.0.0.1
(tests/keras/_multiworker_child.py) train as one DP-SGD run -- the same lots
on every worker, each worker a disjoint share of each lot, noise once per lot
for the whole cluster, one ledger equal to the lots applied, checkpoints that
resume -- and the modes that are not supported are refused."""

import json
import os
import pathlib
import socket
import subprocess
import sys

import numpy as np
import pytest
from scipy import stats

from dpfl_tf.keras.sampling import LotSampler

ROOT = pathlib.Path(__file__).resolve().parents[2]
WORKERS = 2


def _free_ports(count):
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


@pytest.fixture(scope="module")
def workers(tmp_path_factory):
    out = tmp_path_factory.mktemp("multiworker")
    cluster = {"worker": [f"127.0.0.1:{p}" for p in _free_ports(WORKERS)]}
    procs = []
    for index in range(WORKERS):
        env = dict(
            os.environ,
            PYTHONPATH=str(ROOT),
            TF_CPP_MIN_LOG_LEVEL="2",
            TF_CONFIG=json.dumps({"cluster": cluster, "task": {"type": "worker", "index": index}}),
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "tests.keras._multiworker_child", str(out)],
                cwd=ROOT,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    errors = []
    try:
        for index, proc in enumerate(procs):
            _, stderr = proc.communicate(timeout=600)
            if proc.returncode != 0:
                errors.append(f"worker {index} exited {proc.returncode}:\n{stderr[-3000:]}")
    finally:
        for proc in procs:  # a worker left waiting on a dead peer's collective
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    assert not errors, "\n".join(errors)
    return [json.loads((out / f"worker-{i}.json").read_text()) for i in range(WORKERS)]


@pytest.fixture(scope="module")
def chief(workers):
    assert [w["chief"] for w in workers] == [True, False]
    return workers[0]


def test_one_replica_per_worker(workers):
    assert [w["replicas"] for w in workers] == [2, 2]


def test_no_noise_updates_equal_one_process(chief):
    assert chief["full_batch"]["max_diff"] < 1e-5
    assert chief["full_batch"]["lots_applied"] == 2
    assert chief["seeded"]["max_diff"] < 1e-5
    assert chief["seeded"]["lots_applied"] == 10


@pytest.mark.parametrize("scenario", ["seeded", "unseeded"])
def test_every_worker_draws_the_chiefs_lots_and_trains_its_own_share(scenario, workers):
    """Worker r reads exactly share r of every lot (the sorted lot cut into two
    halves of ceil(n/2) positions) and nothing else: the shares are disjoint and
    together exactly the lot drawn with the chief's key."""
    chief_run, other_run = workers[0][scenario], workers[1][scenario]
    assert chief_run["key"] == other_run["key"]  # unseeded: the chief's OS entropy
    lots = chief_run["lots"]
    assert lots == other_run["lots"]
    assert len({len(lot) for lot in lots}) > 1  # Poisson: sizes vary

    def halves(lots):
        return [[lot[: -(-len(lot) // 2)], lot[-(-len(lot) // 2) :]] for lot in lots]

    shares = halves(lots)
    # the input pipeline reads a few lots ahead (prefetch; never trained or released)
    ahead = halves(chief_run["ahead"])
    for r, run in enumerate((chief_run, other_run)):
        seen = {tuple(s) for s in run["seen"]}
        for t, pair in enumerate(shares):  # every lot's share was read (and trained) ...
            assert tuple(pair[r]) in seen, f"worker {r} did not read its share of lot {t}"
        # ... and nothing that is not this worker's share of a lot of the sampler
        assert seen <= {tuple(pair[r]) for pair in shares + ahead}, (
            f"worker {r} read examples outside its shares"
        )
    for first, second in shares:
        assert not set(first) & set(second)
    assert chief_run["lots_applied"] == 10
    if scenario == "unseeded":  # fit(log_train_metrics=False) logs the lots only
        assert chief_run["logged_lots"] == [10]


def test_unseeded_key_is_fresh():
    """The keys of the run above came from OS entropy, not a constant."""
    assert LotSampler(10, 2).key != LotSampler(10, 2).key


def test_noise_drawn_once_per_lot_for_the_whole_cluster(chief):
    noise = np.asarray(chief["noise"]["normalised"])
    assert noise.size > 10_000
    # std of the update difference = lr sigma C / L: within 3 % (its standard
    # error here is 0.6 %); noise added on both workers would give sqrt(2) or 2
    assert abs(noise.std() - 1.0) < 0.03
    assert stats.kstest(noise, "norm").pvalue > 1e-3
    assert stats.kstest(noise / np.sqrt(2), "norm").pvalue < 1e-6
    assert chief["noise"]["lots_applied"] == chief["noise"]["ledger"] == 1


@pytest.mark.parametrize("scenario", ["full_batch", "seeded", "unseeded", "noise", "budget"])
def test_one_ledger_equal_to_the_lots_applied(scenario, workers):
    runs = [w[scenario] for w in workers]
    c = runs[0]
    assert c["lots_computed"] == c["ledger"] == c["lots_applied"] > 0
    for other in runs[1:]:  # every worker's counters agree with the chief's
        assert (other["lots_computed"], other["lots_applied"]) == (
            c["lots_computed"],
            c["lots_applied"],
        )


def test_validation_and_evaluate_equal_one_process(workers):
    for w in workers:
        e = w["evaluate"]
        np.testing.assert_allclose(e["multi"], e["plain"], rtol=1e-5)
        np.testing.assert_allclose(e["val"], e["plain"], rtol=1e-5)


def test_budget_stops_every_worker_at_the_same_lot(workers):
    for w in workers:
        budget = w["budget"]
        assert budget["stop_reason"] == "budget_spent"
        assert budget["epsilon"] <= 1.0
        assert 0 < budget["lots_applied"] < 100 and budget["lots_applied"] % 10
    assert workers[0]["budget"]["lots_applied"] == workers[1]["budget"]["lots_applied"]


def test_checkpoint_written_by_the_chief_resumes_the_ledger(workers):
    resume = workers[0]["resume"]
    assert resume["first"] == {"lots_computed": 20, "lots_applied": 20, "ledger": 20}
    assert resume["initial_epoch"] == 2
    assert resume["at_restore"] == {"lots_computed": 20, "lots_applied": 20, "ledger": 20}
    assert resume["lots_computed"] == resume["ledger"] == resume["lots_applied"] == 40
    assert resume["state"]["lots_applied"] == resume["state"]["ledger_count"] == 40
    assert resume["state"]["epoch"] == 4
    assert resume["files"] == ["model-000004.keras", "state.json"]
    # worker 1 saved into a directory of its own: it was never created
    assert resume["own_written"] and not workers[1]["resume"]["own_written"]
    assert workers[1]["resume"]["lots_applied"] == workers[1]["resume"]["ledger"] == 40


@pytest.mark.parametrize(
    "mode, message",
    [
        ("jit_compile", "jit_compile must be False under a distribution strategy"),
        ("steps_per_execution", "steps_per_execution must be 1 under a distribution strategy"),
        ("secure_mode", "secure_mode=True is not supported under a distribution strategy"),
        ("different_seeds", "sampling_seed must be the same on every worker"),
    ],
)
def test_unsupported_modes_are_refused_on_every_worker(mode, message, workers):
    for w in workers:
        refused = w["refusals"][mode]
        assert refused["error"] is not None and message in refused["error"]
        assert refused["lots"] == 0


# -- the split itself, in this process --------------------------------------------
@pytest.mark.parametrize("replicas", [1, 2, 3])
def test_replica_shares_partition_every_lot_as_a_mirrored_split(replicas):
    """`LotSampler.replica_shares` cuts each lot into the shares that
    `dataset(pad_to=R)` leaves to a one-machine strategy (equal, contiguous):
    disjoint, together exactly the lot, equal sizes, also for lots of size 0."""
    x = np.arange(40, dtype="float32")[:, None]
    y = np.arange(40)
    sampler = LotSampler(40, 3, seed=2)  # a seed whose lots include an empty one
    lots = list(sampler.lots(13))
    assert 0 in {len(lot) for lot in lots}
    whole = list(sampler.dataset(x, y, epochs=1, pad_to=replicas).as_numpy_iterator())
    each = [
        list(
            sampler.replica_shares(
                x, y, epochs=1, replicas=replicas, first_replica=r
            ).as_numpy_iterator()
        )
        for r in range(replicas)
    ]
    local = list(
        sampler.replica_shares(
            x, y, epochs=1, replicas=replicas, local_replicas=replicas
        ).as_numpy_iterator()
    )
    assert len(local) == replicas * len(lots)
    for t, lot in enumerate(lots):
        got = []
        for r in range(replicas):
            xb, yb, mask = each[r][t]
            size = len(mask)
            assert size == max(1, -(-len(lot) // replicas))
            np.testing.assert_array_equal(mask, whole[t][2][r * size : (r + 1) * size])
            np.testing.assert_array_equal(yb, whole[t][1][r * size : (r + 1) * size])
            np.testing.assert_array_equal(xb[:, 0][mask > 0], yb[mask > 0])
            for a, b in zip(local[t * replicas + r], each[r][t]):
                np.testing.assert_array_equal(a, b)
            got += list(yb[mask > 0])
        assert sorted(got) == list(lot) and len(got) == len(set(got))


def test_replica_shares_validates_replicas():
    sampler = LotSampler(40, 3, seed=1)
    with pytest.raises(ValueError, match="do not exist"):
        sampler.replica_shares(
            np.zeros((40, 1)), np.zeros(40), epochs=1, replicas=2, first_replica=1, local_replicas=2
        )
