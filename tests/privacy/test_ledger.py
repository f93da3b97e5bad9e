"""Ledger: records, answers, round-trips through JSON, filters by budget."""

import json

import dp_accounting
import pytest

from dpfl_tf.privacy import (BudgetExceededError, PrivacyBudget, PrivacyLedger, compute_epsilon,
                             dp_sgd_event, event_from_json, event_to_json, gaussian_step_event)


def test_ledger_matches_accountant_for_steps_recorded():
    ledger = PrivacyLedger("moments")
    step = gaussian_step_event(4.0, sampling_rate=0.01)
    for _ in range(500):
        ledger.record(step, label="dpsgd")
    assert len(ledger.entries) == 1 and ledger.count("dpsgd") == 500  # merged
    assert ledger.epsilon(1e-5) == compute_epsilon(dp_sgd_event(4.0, 500, sampling_rate=0.01),
                                                   1e-5, "moments")
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
    event = dp_accounting.ComposedDpEvent([
        dp_accounting.GaussianDpEvent(3.0),
        dp_accounting.SelfComposedDpEvent(
            dp_accounting.PoissonSampledDpEvent(0.1, dp_accounting.GaussianDpEvent(1.0)), 5)])
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
    ledger.record(gaussian_step_event(4.0, "fixed_size", dataset_size=100, lot_size=10), 7)
    with pytest.raises(ValueError, match="different neighbouring relations"):
        ledger.epsilon(1e-5)
