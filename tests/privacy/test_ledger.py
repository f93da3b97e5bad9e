"""Ledger: records, answers, round-trips through JSON, filters by budget."""

import json

import dp_accounting
import pytest
from dp_accounting import rdp

from dpfl_tf.privacy import (
    BudgetExceededError,
    NeighboringRelation,
    PrivacyBudget,
    PrivacyLedger,
    compute_epsilon,
    dp_sgd_event,
    event_from_json,
    event_to_dict,
    event_to_json,
    gaussian_step_event,
    shuffle_epoch_event,
)


def test_ledger_matches_accountant_for_steps_recorded():
    ledger = PrivacyLedger("moments")
    step = gaussian_step_event(4.0, sampling_rate=0.01)
    for _ in range(500):
        ledger.record(step, label="dpsgd")
    assert len(ledger.entries) == 1 and ledger.count("dpsgd") == 500  # merged
    assert ledger.epsilon(1e-5) == compute_epsilon(
        dp_sgd_event(4.0, 500, sampling_rate=0.01), 1e-5, "moments"
    )
    assert ledger.epsilon(1e-5, "pld") < ledger.epsilon(1e-5)


def test_json_round_trip_is_exact(tmp_path):
    ledger = PrivacyLedger("rdp", budget=PrivacyBudget(3.0, 1e-5, "rdp"))
    ledger.record(dp_accounting.GaussianDpEvent(16.0), label="dp_pca")
    ledger.record(gaussian_step_event(2.0, sampling_rate=0.01), 123, label="dpsgd")
    ledger.record(gaussian_step_event(4.0, sampling_rate=0.02), 7)
    restored = PrivacyLedger.from_json(ledger.to_json())
    assert restored == ledger
    assert restored.to_json() == ledger.to_json()
    assert restored.epsilon(1e-5) == ledger.epsilon(1e-5)
    path = tmp_path / "sub" / "ledger.json"
    ledger.save(path)
    assert PrivacyLedger.load(path) == ledger
    assert json.loads(path.read_text())["format"] == 1
    assert not list(path.parent.glob("*.tmp"))


def test_event_json_round_trip_nested():
    event = dp_accounting.ComposedDpEvent(
        [
            dp_accounting.GaussianDpEvent(3.0),
            dp_accounting.SelfComposedDpEvent(
                dp_accounting.PoissonSampledDpEvent(0.1, dp_accounting.GaussianDpEvent(1.0)), 5
            ),
        ]
    )
    assert event_from_json(event_to_json(event)) == event
    with pytest.raises(ValueError, match="unknown DpEvent type"):
        event_from_json('{"type": "os"}')


def test_budget_filter_refuses_the_step_that_would_exceed():
    budget = PrivacyBudget(1.0, 1e-5, "moments")
    ledger = PrivacyLedger("moments", budget=budget)
    step = gaussian_step_event(4.0, sampling_rate=0.01)
    allowed = ledger.steps_within_budget(step)
    assert allowed > 0
    ledger.spend(step, allowed)
    assert ledger.epsilon(1e-5) <= 1.0
    with pytest.raises(BudgetExceededError, match="would exceed the budget"):
        ledger.spend(step)
    assert ledger.count() == allowed  # the refused step was not recorded
    assert ledger.would_exceed(step)


def test_bad_inputs():
    with pytest.raises(ValueError, match="epsilon must be > 0"):
        PrivacyBudget(-1.0, 1e-5)
    with pytest.raises(ValueError, match="delta must be in"):
        PrivacyBudget(1.0, 2.0)
    with pytest.raises(TypeError, match="DpEvent"):
        PrivacyLedger().record("a step")
    with pytest.raises(ValueError, match="count must be a whole number"):
        PrivacyLedger().record(dp_accounting.GaussianDpEvent(1.0), -1)
    with pytest.raises(ValueError, match="not a dpfl_tf privacy ledger"):
        PrivacyLedger.from_json('{"entries": []}')
    with pytest.raises(ValueError, match="has no budget"):
        PrivacyLedger().steps_within_budget(dp_accounting.GaussianDpEvent(1.0))


def test_fixed_size_and_poisson_cannot_be_mixed_silently():
    ledger = PrivacyLedger("rdp")
    ledger.record(gaussian_step_event(2.0, sampling_rate=0.01), 10)
    with pytest.raises(ValueError, match="different neighbouring relations"):
        ledger.record(gaussian_step_event(4.0, "fixed_size", dataset_size=100, lot_size=10), 7)
    assert ledger.count() == 10  # refused: nothing recorded


DP_PCA = dp_accounting.PoissonSampledDpEvent(1.0, dp_accounting.GaussianDpEvent(7.0))


@pytest.mark.parametrize(
    "first, then",
    [
        ((DP_PCA, "dp_pca"), (shuffle_epoch_event(4.0), "dpsgd")),
        (
            (shuffle_epoch_event(4.0), "dpsgd"),
            (gaussian_step_event(4.0, sampling_rate=0.01), "dpsgd"),
        ),
    ],
)
def test_shuffle_epochs_and_add_remove_events_are_refused_naming_both_relations(first, then):
    ledger = PrivacyLedger("rdp")
    ledger.record(*first[:1], label=first[1])
    with pytest.raises(ValueError, match="add/remove-one.*replace-one|replace-one.*add/remove"):
        ledger.record(then[0], 10, label=then[1])
    with pytest.raises(ValueError, match="relation='replace_one'"):
        ledger.record(then[0], 10, label=then[1])
    assert ledger.count() == 1
    budgeted = PrivacyLedger.from_dict(
        {**ledger.to_dict(), "budget": PrivacyBudget(20.0, 1e-5, "rdp").to_dict()}
    )
    with pytest.raises(ValueError, match="different neighbouring relations"):
        budgeted.spend(then[0], label=then[1])
    with pytest.raises(ValueError, match="different neighbouring relations"):
        budgeted.steps_within_budget(then[0])


def test_a_replace_one_ledger_converts_add_remove_gaussians_explicitly():
    ledger = PrivacyLedger("rdp", relation="replace_one")
    ledger.record(DP_PCA, label="dp_pca")  # every example: one Gaussian
    ledger.record(shuffle_epoch_event(4.0), 10, label="dpsgd")
    assert ledger.entries[0]["event"] == "Gaussian(sigma=3.5) (replace-one)"
    ref = rdp.RdpAccountant().compose(
        dp_accounting.ComposedDpEvent(
            [
                dp_accounting.GaussianDpEvent(3.5),
                dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(2.0), 10),
            ]
        )
    )
    assert ledger.epsilon(1e-5) == pytest.approx(ref.get_epsilon(1e-5), rel=1e-12)
    # a Poisson-sampled lot has no replace-one form here: refused, nothing recorded
    with pytest.raises(ValueError, match="sampling_probability=0.01"):
        ledger.record(gaussian_step_event(4.0, sampling_rate=0.01), label="dpsgd")
    assert ledger.count() == 11
    restored = PrivacyLedger.from_json(ledger.to_json())
    assert restored == ledger and restored.relation is NeighboringRelation.REPLACE_ONE
    # an add/remove ledger (e.g. DP-PCA recorded already) converted after the fact
    old = PrivacyLedger("rdp")
    old.record(DP_PCA, label="dp_pca")
    converted = old.as_replace_one()
    converted.record(shuffle_epoch_event(4.0), 10, label="dpsgd")
    assert converted.epsilon(1e-5) == ledger.epsilon(1e-5)
    with pytest.raises(ValueError, match="relation must be one of"):
        PrivacyLedger(relation="replace_all")


def test_old_ledgers_load_with_todays_inference():
    old = {
        "format": 1,
        "accountant": "rdp",
        "budget": None,
        "entries": [
            {
                "event": {
                    "type": "PoissonSampledDpEvent",
                    "sampling_probability": 1.0,
                    "event": {"type": "GaussianDpEvent", "noise_multiplier": 7.0},
                },
                "count": 1,
                "label": "dp_pca",
            },
            {
                "event": {"type": "GaussianDpEvent", "noise_multiplier": 2.0},
                "count": 10,
                "label": "dpsgd",
            },
        ],
    }
    ledger = PrivacyLedger.from_dict(old)
    assert ledger.relation is NeighboringRelation.ADD_OR_REMOVE_ONE
    assert ledger.entries[1]["event"] == "Gaussian(sigma=2) (add/remove-one)"
    assert ledger.epsilon(1e-5) == compute_epsilon(ledger.event, 1e-5, "rdp")
    # an old file that already mixes relations loads (nothing is lost) but cannot be
    # turned into an epsilon
    old["entries"].append(
        {
            "event": event_to_dict(
                gaussian_step_event(4.0, "fixed_size", dataset_size=100, lot_size=10)
            ),
            "count": 3,
            "label": "fixed",
        }
    )
    mixed = PrivacyLedger.from_dict(old)
    assert mixed.count() == 14
    with pytest.raises(ValueError, match="different neighbouring relations"):
        mixed.epsilon(1e-5)
