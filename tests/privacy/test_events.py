"""Events: each event carries its neighbouring relation; mixtures are refused;
conversion to replace-one is explicit; descriptions name the relation."""

import dp_accounting
import pytest
from dp_accounting import pld, rdp

from dpfl_tf.privacy import (
    NeighboringRelation,
    compute_epsilon,
    describe_event,
    dp_sgd_event,
    event_from_json,
    event_to_json,
    events,
    gaussian_step_event,
    shuffle_epoch_event,
)
from dpfl_tf.privacy.events import neighboring_relation_of

ADD_REMOVE = NeighboringRelation.ADD_OR_REMOVE_ONE
REPLACE = NeighboringRelation.REPLACE_ONE


def test_a_shuffle_epoch_is_told_apart_from_an_add_remove_gaussian():
    epoch = shuffle_epoch_event(4.0)
    assert isinstance(epoch, dp_accounting.GaussianDpEvent)  # every accountant reads it
    assert epoch.noise_multiplier == 2.0  # sensitivity 2C
    assert neighboring_relation_of(epoch) is REPLACE
    assert neighboring_relation_of(dp_accounting.GaussianDpEvent(2.0)) is ADD_REMOVE
    assert epoch != dp_accounting.GaussianDpEvent(2.0)
    assert event_from_json(event_to_json(epoch)) == epoch
    assert neighboring_relation_of(dp_sgd_event(4.0, 100, "shuffle", epochs=3)) is REPLACE


@pytest.mark.parametrize("kind", ["moments", "rdp", "pld", "strong"])
def test_shuffle_epochs_and_poisson_lots_are_not_composed_silently(kind):
    pca = dp_accounting.PoissonSampledDpEvent(1.0, dp_accounting.GaussianDpEvent(7.0))
    mixed = dp_accounting.ComposedDpEvent([pca, dp_sgd_event(4.0, 2340, "shuffle", epochs=10)])
    with pytest.raises(ValueError, match="add/remove-one.*replace-one"):
        compute_epsilon(mixed, 1e-5, kind)


def test_fixed_size_and_an_add_remove_gaussian_are_not_composed_silently():
    # rdp under replace-one would read the add/remove Gaussian(7) as Gaussian(7) at
    # sensitivity 2C: half the cost it really has
    mixed = dp_accounting.ComposedDpEvent(
        [
            dp_accounting.GaussianDpEvent(7.0),
            dp_sgd_event(4.0, 100, "fixed_size", dataset_size=60000, lot_size=600),
        ]
    )
    with pytest.raises(ValueError, match="add/remove-one.*replace-one"):
        compute_epsilon(mixed, 1e-5, "rdp")


def test_replace_one_gaussians_cost_what_dp_accounting_says_for_the_plain_gaussian():
    # the multiplier is already std / (2C): pld must not double the sensitivity again
    event = dp_sgd_event(4.0, 2340, "shuffle", epochs=10)
    plain = dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(2.0), 10)
    assert compute_epsilon(event, 1e-5, "pld") == pytest.approx(
        pld.PLDAccountant().compose(plain).get_epsilon(1e-5), rel=1e-9
    )
    assert compute_epsilon(event, 1e-5, "rdp") == pytest.approx(
        rdp.RdpAccountant().compose(plain).get_epsilon(1e-5), rel=1e-12
    )
    # shuffle epochs and fixed-size lots are both replace-one: rdp composes them
    both = dp_accounting.ComposedDpEvent(
        [event, dp_sgd_event(4.0, 100, "fixed_size", dataset_size=60000, lot_size=600)]
    )
    ref = rdp.RdpAccountant(neighboring_relation=REPLACE).compose(both).get_epsilon(1e-5)
    assert compute_epsilon(both, 1e-5, "rdp") == pytest.approx(ref, rel=1e-12)


def test_to_replace_one_is_sensitivity_2c():
    to_replace_one = events.to_replace_one
    assert to_replace_one(dp_accounting.GaussianDpEvent(7.0)) == shuffle_epoch_event(7.0)
    pca = dp_accounting.PoissonSampledDpEvent(1.0, dp_accounting.GaussianDpEvent(7.0))
    assert to_replace_one(pca) == shuffle_epoch_event(7.0)  # q = 1: every record, one Gaussian
    epoch = shuffle_epoch_event(4.0)
    assert to_replace_one(epoch) == epoch
    composed = dp_accounting.ComposedDpEvent(
        [
            dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(3.0), 4),
            dp_accounting.NoOpDpEvent(),
        ]
    )
    assert neighboring_relation_of(to_replace_one(composed)) is REPLACE
    with pytest.raises(ValueError, match="sampling_probability=0.01.*separate ledger"):
        to_replace_one(gaussian_step_event(4.0, sampling_rate=0.01))


def test_describe_event_names_the_relation():
    assert (
        describe_event(dp_sgd_event(4.0, 10000, sampling_rate=0.01))
        == "10000 x Poisson(q=0.01) Gaussian(sigma=4) (add/remove-one)"
    )
    assert (
        describe_event(dp_sgd_event(4.0, 2340, "shuffle", epochs=10))
        == "10 x Gaussian(sigma=2) (replace-one)"
    )
    assert (
        describe_event(gaussian_step_event(4.0, "fixed_size", dataset_size=60000, lot_size=600))
        == "fixed-size(L=600 of N=60000) Gaussian(sigma=2) (replace-one)"
    )
    assert describe_event(dp_accounting.NoOpDpEvent()) == "no-op"
    mixed = dp_accounting.ComposedDpEvent(
        [dp_accounting.GaussianDpEvent(1.0), shuffle_epoch_event(1.0)]
    )
    assert "MIXED" in describe_event(mixed)


def test_a_shuffled_lot_has_no_per_lot_event_that_costs_nothing():
    """A noised shuffled lot is a release; its cost is the epoch's Gaussian, recorded
    per epoch touched.  A per-lot no-op event would let a caller record it for free."""
    from dpfl_tf.sanitizer import GaussianSanitizer

    with pytest.raises(ValueError, match="sampling='shuffle'.*shuffle_epoch_event"):
        gaussian_step_event(4.0, "shuffle")
    with pytest.raises(ValueError, match="sampling='shuffle'.*shuffle_epoch_event"):
        GaussianSanitizer(1.0, 4.0).event(1, "shuffle")
