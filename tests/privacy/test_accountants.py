"""Front end: rdp and pld are dp-accounting itself; sampling events are honest."""

import math

import dp_accounting
import pytest
from dp_accounting import pld, rdp

from dpfl_tf.privacy import (
    NeighboringRelation,
    compute_delta,
    compute_epsilon,
    dp_sgd_event,
    gaussian_step_event,
    make_accountant,
)
from dpfl_tf.privacy.events import (
    ReplaceOneGaussianDpEvent,
    complementary_noise_multiplier,
    describe_event,
    joint_gaussian_step_event,
    joint_noise_multiplier,
    neighboring_relation_of,
)


@pytest.mark.parametrize("sigma, steps", [(4.0, 10000), (1.1, 3000), (0.8, 500)])
def test_rdp_and_pld_agree_with_dp_accounting_directly(sigma, steps):
    step = dp_accounting.PoissonSampledDpEvent(0.01, dp_accounting.GaussianDpEvent(sigma))
    ref_rdp = rdp.RdpAccountant().compose(step, steps).get_epsilon(1e-5)
    ref_pld = pld.PLDAccountant().compose(step, steps).get_epsilon(1e-5)
    event = dp_sgd_event(sigma, steps, sampling_rate=0.01)
    assert compute_epsilon(event, 1e-5, "rdp") == pytest.approx(ref_rdp, rel=1e-12)
    assert compute_epsilon(event, 1e-5, "pld") == pytest.approx(ref_pld, rel=1e-9)


@pytest.mark.parametrize(
    "event",
    [
        # a resumed recipe: DP feature statistics, then two fits' lots
        dp_accounting.ComposedDpEvent(
            [
                dp_accounting.GaussianDpEvent(5.6),
                dp_accounting.SelfComposedDpEvent(
                    dp_accounting.PoissonSampledDpEvent(0.125, dp_accounting.GaussianDpEvent(1.0)),
                    8,
                ),
                dp_accounting.SelfComposedDpEvent(
                    dp_accounting.PoissonSampledDpEvent(0.125, dp_accounting.GaussianDpEvent(1.0)),
                    5,
                ),
            ]
        ),
        # nested counts (rounds of several steps), a full-batch Gaussian, a no-op, a Laplace
        dp_accounting.SelfComposedDpEvent(
            dp_accounting.ComposedDpEvent(
                [
                    dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(3.0), 4),
                    dp_accounting.PoissonSampledDpEvent(0.5, dp_accounting.GaussianDpEvent(0.9)),
                    dp_accounting.NoOpDpEvent(),
                    dp_accounting.LaplaceDpEvent(20.0),
                ]
            ),
            3,
        ),
    ],
)
def test_the_cached_pld_accountant_gives_dp_accountings_numbers_exactly(event):
    """The PLD accountant builds each Gaussian's distribution once per process; a
    first and a second (cached) composition both equal dp-accounting's own."""
    ref = pld.PLDAccountant().compose(event)
    for _ in range(2):
        ours = make_accountant("pld").compose(event)
        assert ours.get_epsilon(1e-5) == ref.get_epsilon(1e-5)
        assert ours.get_delta(1.0) == ref.get_delta(1.0)


def test_a_pld_with_no_private_release_is_infinite_as_in_dp_accounting():
    event = dp_accounting.ComposedDpEvent(
        [
            dp_accounting.PoissonSampledDpEvent(0.1, dp_accounting.GaussianDpEvent(0.0)),
            dp_accounting.GaussianDpEvent(2.0),
        ]
    )
    assert pld.PLDAccountant().compose(event).get_epsilon(1e-5) == math.inf
    assert compute_epsilon(event, 1e-5, "pld") == math.inf


@pytest.mark.parametrize("kind", ["rdp", "pld", "moments"])
def test_numpy_numbers_in_an_unhashable_event_are_accounted(kind):
    """A composition (a list: attrs cannot hash it) of events holding numpy numbers
    cannot key the caches; it is accounted without them, as dp-accounting does."""
    import numpy as np

    event = dp_accounting.ComposedDpEvent(
        [
            dp_accounting.SelfComposedDpEvent(
                dp_accounting.PoissonSampledDpEvent(
                    np.float64(0.01), dp_accounting.GaussianDpEvent(np.float32(1.1))
                ),
                np.int64(500),
            )
        ]
    )
    plain = dp_sgd_event(float(np.float32(1.1)), 500, sampling_rate=0.01)
    assert compute_epsilon(event, 1e-5, kind) == compute_epsilon(plain, 1e-5, kind)


def test_a_zero_dimensional_array_as_sigma_is_accounted_as_dp_accounting_does():
    import numpy as np

    event = dp_accounting.PoissonSampledDpEvent(0.1, dp_accounting.GaussianDpEvent(np.array(1.1)))
    assert compute_epsilon(event, 1e-5, "pld") == pld.PLDAccountant().compose(event).get_epsilon(
        1e-5
    )


def test_the_epsilon_memo_answers_a_changed_event_anew():
    first = dp_sgd_event(1.1, 100, sampling_rate=0.01)
    later = dp_sgd_event(1.1, 200, sampling_rate=0.01)
    assert compute_epsilon(later, 1e-5, "pld") > compute_epsilon(first, 1e-5, "pld")
    assert compute_epsilon(first, 1e-5, "pld") == (
        pld.PLDAccountant().compose(first).get_epsilon(1e-5)
    )


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
    ref = (
        rdp.RdpAccountant(neighboring_relation=NeighboringRelation.REPLACE_ONE)
        .compose(event, 1000)
        .get_epsilon(1e-5)
    )
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
        dp_sgd_event(4.0, 1000, sampling_rate=0.01), 1e-5, "rdp"
    )


def test_poisson_rate_from_sizes_and_bad_inputs():
    assert gaussian_step_event(1.0, dataset_size=1000, lot_size=10) == gaussian_step_event(
        1.0, sampling_rate=0.01
    )
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


@pytest.mark.parametrize(
    "event",
    [
        dp_accounting.ComposedDpEvent(
            [
                dp_accounting.SelfComposedDpEvent(dp_sgd_event(1.1, 1, sampling_rate=0.01), 700),
                dp_accounting.GaussianDpEvent(7.0),
                dp_accounting.SelfComposedDpEvent(
                    dp_accounting.ComposedDpEvent(
                        [dp_sgd_event(2.0, 3, sampling_rate=0.05), dp_accounting.NoOpDpEvent()]
                    ),
                    4,
                ),
            ]
        ),
        dp_accounting.SelfComposedDpEvent(
            dp_accounting.SampledWithoutReplacementDpEvent(
                60000, 256, dp_accounting.GaussianDpEvent(0.55)
            ),
            900,
        ),
        dp_accounting.ComposedDpEvent(
            [dp_accounting.GaussianDpEvent(1.0), dp_accounting.NonPrivateDpEvent()]
        ),
    ],
)
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


def test_several_releases_of_one_sample_are_one_sampled_event():
    """Adaptive clipping releases an update sum and a count from one sample:
    Sampled([G(a) + G(b)]).  dp-accounting's RDP reads it directly; the front end
    reads it as Sampled(G((a^-2 + b^-2)^-1/2)) for every accountant; and two
    separately sampled events would under-count (the releases share the sample)."""
    q, z_count = 0.1, 4.0
    z_delta = complementary_noise_multiplier(1.0, z_count)
    assert joint_noise_multiplier([z_delta, z_count]) == pytest.approx(1.0, rel=1e-12)
    joint = dp_accounting.SelfComposedDpEvent(
        joint_gaussian_step_event([z_delta, z_count], "poisson", sampling_rate=q), 20
    )
    single = dp_sgd_event(1.0, 20, sampling_rate=q)
    assert compute_epsilon(joint, 1e-5, "rdp") == pytest.approx(
        rdp.RdpAccountant().compose(joint).get_epsilon(1e-5), rel=1e-12
    )
    for kind in ("rdp", "moments", "pld", "strong"):
        assert compute_epsilon(joint, 1e-5, kind) == pytest.approx(
            compute_epsilon(single, 1e-5, kind), rel=1e-9
        ), kind
    separate = dp_accounting.SelfComposedDpEvent(
        dp_accounting.ComposedDpEvent(
            [
                dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(s))
                for s in (z_delta, z_count)
            ]
        ),
        20,
    )
    assert compute_epsilon(separate, 1e-5, "rdp") < 0.97 * compute_epsilon(joint, 1e-5, "rdp")
    # fixed-size sampling: both multipliers halved (replace-one), read by rdp
    fixed = joint_gaussian_step_event([2.0, 6.0], "fixed_size", dataset_size=100, lot_size=10)
    assert fixed == dp_accounting.SampledWithoutReplacementDpEvent(
        100,
        10,
        dp_accounting.ComposedDpEvent(
            [dp_accounting.GaussianDpEvent(1.0), dp_accounting.GaussianDpEvent(3.0)]
        ),
    )
    assert describe_event(fixed).endswith("[Gaussian(sigma=1) + Gaussian(sigma=3)] (replace-one)")
    with pytest.raises(ValueError, match=r"must exceed the joint one"):
        complementary_noise_multiplier(1.0, 0.9)
