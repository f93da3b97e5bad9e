"""Resume is exact on the model, not only on the books: a seeded federated run
interrupted in the middle of a round and resumed from its checkpoint ends with the
weights, the test accuracy, the history and the ledger of the same run
uninterrupted (the CLI's two ways: a checkpoint every round, or one written when
Ctrl-C stops the run)."""

import json

import numpy as np
import pytest

from dpfl_tf.federated.runner import FederatedConfig, run_federated


def _cfg(dp):
    extra = {
        "local": dict(ldp_mechanism="piecewise", ldp_epsilon=2.0, ldp_bound=0.5),
        "client": dict(sampling="fixed_size", accountant="rdp", noise_multiplier=0.5),
        "global": dict(clip="adaptive", clip_count_stddev=2.0),
        # secure-sum noise shares, dropouts drawn per round
        "distributed": dict(
            sampling="fixed_size",
            min_clients=2,
            dropout_rate=0.2,
            noise_multiplier=1.0,
            bits=16,
        ),
        "none": {},
    }[dp]
    return FederatedConfig(
        clients=6,
        clients_per_round=3,
        rounds=4,
        partition="iid",
        hidden=(8,),
        dp=dp,
        noise_seed=3,
        seed=2,
        **extra,
    )


def _weights(directory):
    state = json.loads((directory / "state.json").read_text())
    with np.load(directory / state["weights"]) as data:
        return [data[k] for k in sorted(data.files) if k.startswith("w")], state


def _stop_after(calls):
    """should_stop: False for the first `calls` polls (one poll per client), then True."""
    seen = []

    def should_stop():
        seen.append(1)
        return len(seen) > calls

    return should_stop


@pytest.mark.parametrize(
    "dp, every_round",
    [
        ("global", True),
        ("client", False),
        ("local", True),
        ("distributed", True),
        ("none", False),
    ],
)
def test_interrupted_and_resumed_run_ends_as_the_uninterrupted_one(
    mnist_small, tmp_path, dp, every_round
):
    cfg = _cfg(dp)
    straight = run_federated(
        cfg, mnist_small, progress=False, checkpoint_dir=str(tmp_path / "straight")
    )
    want, want_state = _weights(tmp_path / "straight")

    ckpt = tmp_path / "resumed"
    # stopped before the 2nd client of round 2 (or 3): that round is abandoned, not released
    first = run_federated(
        cfg,
        mnist_small,
        progress=False,
        checkpoint_dir=str(ckpt),
        checkpoint_every_round=every_round,
        should_stop=_stop_after(4),
    )
    assert first["stop_reason"] == "interrupted" and 0 < first["rounds"] < cfg.rounds
    resumed_from = []
    second = run_federated(
        cfg, mnist_small, progress=False, checkpoint_dir=str(ckpt), on_resume=resumed_from.append
    )
    assert resumed_from and resumed_from[0]["rounds"] == first["rounds"]
    got, got_state = _weights(ckpt)
    assert second["rounds"] == straight["rounds"] == cfg.rounds
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-7)
    assert second["test_accuracy"] == straight["test_accuracy"]
    assert second["epsilon"] == straight["epsilon"]
    assert got_state["ledger"] == want_state["ledger"]
    for a, b in zip(second["history"], straight["history"]):
        assert (a["round"], a["clients"], a["accuracy"], a["epsilon"], a["info"]) == (
            b["round"],
            b["clients"],
            b["accuracy"],
            b["epsilon"],
            b["info"],
        )
    assert second["privacy"] == straight["privacy"]
