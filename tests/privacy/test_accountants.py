"""Front end: rdp and pld are dp-accounting itself; sampling events are honest."""

import math

import dp_accounting
import pytest
from dp_accounting import pld, rdp

from dpfl_tf.privacy import (NeighboringRelation, compute_delta, compute_epsilon,
                             dp_sgd_event, gaussian_step_event, make_accountant)
from dpfl_tf.privacy.events import ReplaceOneGaussianDpEvent, neighboring_relation_of


@pytest.mark.parametrize("sigma, steps", [(4.0, 10000), (1.1, 3000), (0.8, 500)])
def test_rdp_and_pld_agree_with_dp_accounting_directly(sigma, steps):
    step = dp_accounting.PoissonSampledDpEvent(0.01, dp_accounting.GaussianDpEvent(sigma))
    ref_rdp = rdp.RdpAccountant().compose(step, steps).get_epsilon(1e-5)
    ref_pld = pld.PLDAccountant().compose(step, steps).get_epsilon(1e-5)
    event = dp_sgd_event(sigma, steps, sampling_rate=0.01)
    assert compute_epsilon(event, 1e-5, "rdp") == pytest.approx(ref_rdp, rel=1e-12)
    assert compute_epsilon(event, 1e-5, "pld") == pytest.approx(ref_pld, rel=1e-9)


def test_forward_and_inverse_are_consistent_for_every_accountant():
    event = dp_sgd_event(1.5, 2000, sampling_rate=0.02)
    for kind in ["moments", "rdp", "pld", "strong"]:
        eps = compute_epsilon(event, 1e-5, kind)
        assert compute_delta(event, eps * 1.001, kind) <= 1e-5 * 1.01, kind
        assert compute_delta(event, eps * 0.95, kind) > 1e-5, kind


def test_fixed_size_sampling_uses_replace_one_and_twice_the_sensitivity():
    event = gaussian_step_event(4.0, "fixed_size", dataset_size=60000, lot_size=600)
    assert isinstance(event, dp_accounting.SampledWithoutReplacementDpEvent)
    assert event.event.noise_multiplier == 2.0  # sensitivity 2C under replace-one
    assert neighboring_relation_of(event) is NeighboringRelation.REPLACE_ONE
    eps = compute_epsilon(dp_accounting.SelfComposedDpEvent(event, 1000), 1e-5, "rdp")
    ref = rdp.RdpAccountant(neighboring_relation=NeighboringRelation.REPLACE_ONE).compose(
        event, 1000).get_epsilon(1e-5)
    assert eps == pytest.approx(ref)
    for kind in ["moments", "pld", "strong"]:
        with pytest.raises(ValueError, match="rdp"):
            compute_epsilon(event, 1e-5, kind)


def test_shuffle_is_one_gaussian_per_epoch_without_amplification():
    event = dp_sgd_event(4.0, 1000, "shuffle", epochs=10)
    assert event == dp_accounting.SelfComposedDpEvent(ReplaceOneGaussianDpEvent(2.0), 10)
    assert isinstance(event.event, dp_accounting.GaussianDpEvent)  # sensitivity 2C
    assert neighboring_relation_of(event) is NeighboringRelation.REPLACE_ONE
    # shuffled lots never get the Poisson amplification
    assert compute_epsilon(event, 1e-5, "rdp") > 5 * compute_epsilon(
        dp_sgd_event(4.0, 1000, sampling_rate=0.01), 1e-5, "rdp")


def test_poisson_rate_from_sizes_and_bad_inputs():
    assert gaussian_step_event(1.0, dataset_size=1000, lot_size=10) == \
        gaussian_step_event(1.0, sampling_rate=0.01)
    with pytest.raises(ValueError, match="sampling_rate must be in \\(0, 1\\]"):
        gaussian_step_event(1.0, sampling_rate=0.0)
    with pytest.raises(ValueError, match="noise_multiplier must be >= 0"):
        gaussian_step_event(-1.0, sampling_rate=0.1)
    with pytest.raises(ValueError, match="noise_multiplier"):
        gaussian_step_event(float("nan"), sampling_rate=0.1)
    with pytest.raises(ValueError, match="lot_size must be <= dataset_size"):
        gaussian_step_event(1.0, "fixed_size", dataset_size=10, lot_size=11)
    with pytest.raises(ValueError, match="sampling must be one of"):
        gaussian_step_event(1.0, "bootstrap", sampling_rate=0.1)
    with pytest.raises(ValueError, match="accountant must be one of"):
        make_accountant("gdp")
    with pytest.raises(ValueError, match="delta must be in \\(0, 1\\)"):
        compute_epsilon(dp_sgd_event(1.0, 10, sampling_rate=0.1), 1.0)
    with pytest.raises(ValueError, match="steps must be a whole number"):
        dp_sgd_event(1.0, -3, sampling_rate=0.1)


def test_zero_noise_gives_infinite_epsilon_everywhere():
    event = dp_sgd_event(0.0, 10, sampling_rate=0.1)
    for kind in ["moments", "rdp", "pld", "strong"]:
        assert compute_epsilon(event, 1e-5, kind) == math.inf, kind


@pytest.mark.parametrize("event", [
    dp_accounting.ComposedDpEvent([
        dp_accounting.SelfComposedDpEvent(dp_sgd_event(1.1, 1, sampling_rate=0.01), 700),
        dp_accounting.GaussianDpEvent(7.0),
        dp_accounting.SelfComposedDpEvent(dp_accounting.ComposedDpEvent([
            dp_sgd_event(2.0, 3, sampling_rate=0.05), dp_accounting.NoOpDpEvent()]), 4)]),
    dp_accounting.SelfComposedDpEvent(dp_accounting.SampledWithoutReplacementDpEvent(
        60000, 256, dp_accounting.GaussianDpEvent(0.55)), 900),
    dp_accounting.ComposedDpEvent([dp_accounting.GaussianDpEvent(1.0),
                                   dp_accounting.NonPrivateDpEvent()]),
])
def test_cached_rdp_accountant_gives_dp_accountings_numbers(event):
    relation = neighboring_relation_of(event)
    plain = rdp.RdpAccountant(neighboring_relation=relation).compose(event)
    ours = make_accountant("rdp", neighboring_relation=relation).compose(event)
    ours_again = make_accountant("rdp", neighboring_relation=relation).compose(event)  # cached
    for delta in (1e-5, 1e-3):
        want = plain.get_epsilon(delta)
        assert ours.get_epsilon(delta) == pytest.approx(want, rel=1e-12)
        assert ours_again.get_epsilon(delta) == pytest.approx(want, rel=1e-12)
    assert ours.get_delta(2.0) == pytest.approx(plain.get_delta(2.0), rel=1e-12)
