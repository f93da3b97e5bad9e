"""Accounting of distributed DP: the papers' Renyi bounds hold against brute-force
Renyi divergences of small cases (where the naive Gaussian formula does not), the
without-replacement amplification agrees with dp-accounting's Gaussian bound where
both apply and holds against a brute-force subsampled case, and the accountant,
the ledger and the events compose and serialise them."""

import math

import dp_accounting
import numpy as np
import pytest
from dp_accounting.rdp import rdp_privacy_accountant as rdp_impl
from scipy import special, stats

from dpfl_tf.privacy import PrivacyLedger, compute_epsilon, describe_event
from dpfl_tf.privacy import distributed as dist
from dpfl_tf.privacy.events import DistributedDiscreteGaussianDpEvent as DDG
from dpfl_tf.privacy.events import DistributedSkellamDpEvent as Skellam
from dpfl_tf.privacy.events import event_from_json, event_to_json

ORDERS = [1.5, 2.0, 3.0, 5.0, 8.0, 16.0]


def renyi(lp, lq, alpha):
    """D_alpha(p || q) of two pmfs given as logs on the same support (exact sum; the
    tails that matter at high orders lie far below float64's smallest number)."""
    ok = np.isfinite(lp) & np.isfinite(lq)  # the truncated edges: negligible mass
    return float(special.logsumexp(alpha * lp[ok] + (1 - alpha) * lq[ok]) / (alpha - 1))


def log_convolve(la, lb):
    """log of the convolution of two pmfs given as logs on [-h, h], kept on [-h, h]."""
    h = (len(la) - 1) // 2
    grid = np.add.outer(la, lb)[:, ::-1]
    full = np.array(
        [
            special.logsumexp(np.diagonal(grid, offset))
            for offset in range(len(lb) - 1, -len(la), -1)
        ]
    )
    return full[h : 3 * h + 1]


def ddg_sum_logpmf(variance, shares, half):
    """log pmf of the sum of `shares` N_Z(0, variance) on [-half, half]."""
    k = np.arange(-half, half + 1, dtype=np.float64)
    one = -(k**2) / (2 * variance)
    one -= special.logsumexp(one)
    out = one
    for _ in range(shares - 1):
        out = log_convolve(out, one)
    return out


def skellam_logpmf(k, mu):
    """log P(Sk(mu) = k) = -mu + log I_|k|(mu), I by its power series in log space
    (scipy's logpmf is -inf in the far tails that high orders read)."""
    m = np.arange(0, 3000)[:, None]
    k = np.abs(np.asarray(k))[None, :]
    terms = (2 * m + k) * np.log(mu / 2) - special.gammaln(m + 1) - special.gammaln(m + k + 1)
    return -mu + special.logsumexp(terms, axis=0)


def shifted(lpmf, delta):
    out = np.full_like(lpmf, -np.inf)
    out[delta:] = lpmf[: len(lpmf) - delta]
    return out


def log_mix(weights, lpmfs):
    return special.logsumexp(np.stack(lpmfs), axis=0, b=np.asarray(weights)[:, None])


@pytest.mark.parametrize(
    "variance, shares, delta", [(0.25, 3, 1), (0.25, 3, 2), (0.5, 5, 1), (4.0, 4, 3)]
)
def test_ddg_bound_holds_against_the_exact_renyi_divergence(variance, shares, delta):
    half = 300
    z = ddg_sum_logpmf(variance, shares, half)
    event = DDG(variance, shares, float(delta), float(delta), 1)
    bound = dist.ddg_rdp(ORDERS, event)
    for alpha, b in zip(ORDERS, bound):
        exact = max(renyi(shifted(z, delta), z, alpha), renyi(z, shifted(z, delta), alpha))
        assert exact <= b * (1 + 1e-9), (alpha, exact, b)
        if variance >= 4:  # tau ~ 0: the bound is the Gaussian one, and tight
            assert b <= exact * 1.02, (alpha, exact, b)


def test_the_sum_of_discrete_gaussians_is_not_a_discrete_gaussian():
    # the naive bound alpha D^2 / (2 n s^2) of one N_Z(0, n s^2) fails for small s: the
    # brute-force check above can fail, and the tau term of Theorem 1 is needed
    z = ddg_sum_logpmf(0.25, 3, 100)
    for alpha in [4.0, 16.0]:
        naive = alpha * 1**2 / (2 * 3 * 0.25)
        assert renyi(shifted(z, 1), z, alpha) > naive * 1.02
    assert dist.ddg_tau(0.25, 3) > 0.1
    assert dist.ddg_tau(4.0, 100) < 1e-15


@pytest.mark.parametrize("mu, delta", [(2.0, 1), (10.0, 1), (10.0, 3), (50.0, 4)])
def test_skellam_bound_holds_against_the_exact_renyi_divergence(mu, delta):
    half = int(mu + 60 * math.sqrt(mu) + 200)
    k = np.arange(-half, half + 1)
    z = skellam_logpmf(k, mu)
    event = Skellam(mu / 4, 4, float(delta), float(delta))  # four shares of mu/4
    alphas = [2, 3, 4, 8, 16]
    bound = dist.skellam_rdp(alphas, event)
    for alpha, b in zip(alphas, bound):
        exact = renyi(shifted(z, delta), z, alpha)
        assert exact <= b * (1 + 1e-9), (alpha, exact, b)
        assert b <= 3.5 * exact, (alpha, exact, b)  # and not vacuous


def test_without_replacement_bound_against_dp_accounting_for_the_gaussian():
    # Theorem 9 (any mechanism) is never tighter than dp-accounting's Gaussian-only
    # Theorem 27, and equals it at order 2, where the two coincide
    for sigma in [0.7, 1.5, 3.0]:
        for q in [0.01, 0.1, 0.5]:
            for alpha in [2, 3, 6, 20]:
                ours = dist.sampled_without_replacement_rdp(alpha, q, lambda j: j / (2 * sigma**2))
                ref = rdp_impl._compute_rdp_sample_wor_gaussian_scalar(q, sigma, alpha)
                assert ours >= ref * (1 - 1e-9)
                if alpha == 2:
                    assert ours == pytest.approx(ref, rel=1e-9)


def test_sampled_ddg_bound_holds_against_a_brute_force_subsampled_release():
    # K = 5 clients, m = 2 drawn without replacement, each adds a N_Z(0, 1) share:
    # client 1 holds a = +1 or (replaced) b = -1, the others 0; the release is
    # (client 1 sampled ? a : 0) + Z_2, a mixture
    z = ddg_sum_logpmf(1.0, 2, 150)
    gamma = 2 / 5
    p = log_mix([gamma, 1 - gamma], [shifted(z, 2), shifted(z, 1)])  # a = +1 (one further)
    q = log_mix([gamma, 1 - gamma], [z, shifted(z, 1)])  # b = -1
    event = dp_accounting.SampledWithoutReplacementDpEvent(5, 2, DDG(1.0, 2, 2.0, 2.0, 1))
    orders = (2.0, 3.0, 4.0, 8.0, 2.5)
    bound = dist.rdp_curve(event, orders)
    for alpha, b in zip(orders, bound):
        exact = max(renyi(p, q, alpha), renyi(q, p, alpha))
        assert exact <= b * (1 + 1e-9), (alpha, exact, b)
        assert b <= dist.rdp_curve(event.event, (alpha,))[0] + 1e-12  # never above unsampled


def test_rounds_compose_in_the_rdp_accountant_as_by_hand():
    inner = DDG(5000.0, 40, 300.0, 9000.0, 4096)
    event = dp_accounting.SampledWithoutReplacementDpEvent(1000, 50, inner)
    rounds = dp_accounting.SelfComposedDpEvent(event, 120)
    orders = rdp_impl.DEFAULT_RDP_ORDERS
    by_hand = rdp_impl.compute_epsilon(orders, 120 * dist.rdp_curve(event, tuple(orders)), 1e-5)[0]
    assert compute_epsilon(rounds, 1e-5, "rdp") == pytest.approx(by_hand, rel=1e-12)
    for kind in ["moments", "pld", "strong"]:
        with pytest.raises(ValueError, match="distributed DP events are interpreted by 'rdp'"):
            compute_epsilon(rounds, 1e-5, kind)


def test_fewer_shares_cost_more():
    many = DDG(100.0, 50, 40.0, 400.0, 1024)
    few = DDG(100.0, 40, 40.0, 400.0, 1024)
    assert compute_epsilon(few, 1e-5, "rdp") > compute_epsilon(many, 1e-5, "rdp")
    assert compute_epsilon(Skellam(100.0, 40, 40.0, 400.0), 1e-5, "rdp") > compute_epsilon(
        Skellam(100.0, 50, 40.0, 400.0), 1e-5, "rdp"
    )


def test_events_serialise_describe_and_enter_a_replace_one_ledger():
    ddg = DDG(2.5, 7, 3.0, 9.0, 16)
    sk = Skellam(2.5, 7, 3.0, 9.0)
    for e in (ddg, sk):
        assert event_from_json(event_to_json(e)) == e
        assert "replace-one" in describe_event(e)
    ledger = PrivacyLedger("rdp")
    ledger.record(dp_accounting.SampledWithoutReplacementDpEvent(100, 10, ddg), 5, "round")
    again = PrivacyLedger.from_json(ledger.to_json())
    assert again.epsilon(1e-5) == pytest.approx(ledger.epsilon(1e-5))
    with pytest.raises(ValueError, match="add/remove-one"):
        ledger.record(dp_accounting.PoissonSampledDpEvent(0.1, dp_accounting.GaussianDpEvent(1)))
    with pytest.raises(ValueError, match="num_shares must be a whole number >= 1, got 0"):
        DDG(1.0, 0, 1.0, 1.0, 4)
    with pytest.raises(ValueError, match="share stddev >= 1/2"):
        dist.ddg_rdp([2.0], DDG(0.2, 3, 1.0, 1.0, 1))


def test_rounded_norm_bound_holds_for_randomized_rounding():
    rng = np.random.default_rng(0)
    d, c, beta = 2000, 25.0, 0.3
    bound = dist.rounded_l2_norm_bound(c, beta, d)
    assert bound < c + math.sqrt(d)  # the conditional bound is the tighter one
    assert dist.rounded_l2_norm_bound(c, 0.0, d) == c + math.sqrt(d)
    over = 0
    for _ in range(400):
        x = rng.normal(size=d)
        x *= c / np.linalg.norm(x)
        rounded = np.floor(x) + (rng.random(d) < x - np.floor(x))
        over += np.linalg.norm(rounded) > bound
        assert np.linalg.norm(rounded) <= c + math.sqrt(d)
    assert stats.binomtest(over, 400, beta, alternative="greater").pvalue > 1e-3
    assert over / 400 <= beta
    assert dist.integer_l1_bound(3.0, 100) == 9.0 and dist.integer_l1_bound(30.0, 100) == 300.0
