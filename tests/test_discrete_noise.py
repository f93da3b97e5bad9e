"""Integer noise: the exact discrete Gaussian sampler has the law N_Z(0, s^2) (goodness
of fit tests that reject a 10% wrong variance), on its fast path and on its exact
path; Skellam shares have the Skellam law and add up to one; the secure source."""

import math
from fractions import Fraction

import numpy as np
import pytest
from scipy import stats

from dpfl_tf import discrete_noise as dn


def chi_square_p(samples, pmf):
    """p-value of a chi-square goodness-of-fit test of integer `samples` against
    `pmf(support)`, bins with expected count < 5 merged into the two tails."""
    n = len(samples)
    lo, hi = int(samples.min()), int(samples.max())
    support = np.arange(lo - 1, hi + 2)
    probs = pmf(support)
    expected = n * probs
    keep = np.flatnonzero(expected >= 5)
    a, b = support[keep[0]], support[keep[-1]]
    observed = (
        [np.sum(samples <= a)]
        + [np.sum(samples == k) for k in range(a + 1, b)]
        + [np.sum(samples >= b)]
    )
    left = pmf(np.arange(a - 10 * (hi - lo + 10), a + 1)).sum()
    inner = pmf(np.arange(a + 1, b))
    exp = np.concatenate([[left], inner, [1.0 - left - inner.sum()]]) * n
    return stats.chisquare(observed, exp).pvalue


@pytest.mark.parametrize("variance, n", [(0.3, 60000), (2.0, 60000), (30.25, 80000)])
def test_discrete_gaussian_has_the_discrete_gaussian_law(variance, n):
    v = dn.dyadic_variance(variance)
    x = dn.discrete_gaussian(v, n, dn.GeneratorSource(7))
    assert x.dtype == np.int64 and x.shape == (n,)
    assert chi_square_p(x, lambda k: dn.discrete_gaussian_pmf(float(v), k)) > 1e-3
    # the same test rejects a variance 10% off: it can fail
    assert chi_square_p(x, lambda k: dn.discrete_gaussian_pmf(1.1 * float(v), k)) < 1e-6


def test_the_exact_path_has_the_same_law(monkeypatch):
    # a huge margin sends about half of all Bernoulli decisions (and geometric draws)
    # through the exact rational / decimal comparison
    monkeypatch.setattr(dn, "_MARGIN", 0.2)
    calls = []
    below_exp = dn._LazyUniform.below_exp
    monkeypatch.setattr(
        dn._LazyUniform, "below_exp", lambda self, g: calls.append(1) or below_exp(self, g)
    )
    x = dn.discrete_gaussian(Fraction(9, 4), 6000, dn.GeneratorSource(3))
    assert len(calls) > 6000
    assert chi_square_p(x, lambda k: dn.discrete_gaussian_pmf(2.25, k)) > 1e-3
    assert chi_square_p(x, lambda k: dn.discrete_gaussian_pmf(2.25 * 1.3, k)) < 1e-3


def test_bernoulli_exp_is_exact_in_frequency():
    g = np.full(200000, 0.7)
    b = dn.bernoulli_exp(g, lambda i: Fraction(7, 10), dn.GeneratorSource(1))
    assert stats.binomtest(int(b.sum()), b.size, math.exp(-0.7)).pvalue > 1e-3


def test_discrete_laplace_has_the_geometric_two_sided_law():
    t = 4
    x = dn.discrete_laplace(t, 80000, dn.GeneratorSource(2))
    r = math.exp(-1 / t)

    def pmf(k):
        return (1 - r) / (1 + r) * r ** np.abs(k)

    assert chi_square_p(x, pmf) > 1e-3
    assert chi_square_p(x, lambda k: (1 - r**1.1) / (1 + r**1.1) * r ** (1.1 * np.abs(k))) < 1e-6


def test_dyadic_variance_rounds_up_with_a_bounded_denominator():
    for v in [0.3, 1.0, 2.5, 123.456, 1e7]:
        f = dn.dyadic_variance(v)
        assert f >= Fraction(v)
        assert f - Fraction(v) <= Fraction(1, f.denominator)
        assert f.denominator & (f.denominator - 1) == 0  # a power of two
    with pytest.raises(ValueError, match="variance must be > 0, got -1"):
        dn.dyadic_variance(-1)


def test_skellam_shares_have_the_skellam_law_and_sum_to_one():
    mu = 6.0
    x = dn.skellam(mu, 80000, dn.GeneratorSource(4))
    assert chi_square_p(x, lambda k: stats.skellam.pmf(k, mu / 2, mu / 2)) > 1e-3
    assert chi_square_p(x, lambda k: stats.skellam.pmf(k, 0.6 * mu, 0.6 * mu)) < 1e-6
    # five shares of mu sum to Sk(5 mu) (Agarwal et al. 2021: closed under summation)
    total = sum(dn.skellam(mu, 40000, dn.GeneratorSource(10 + i)) for i in range(5))
    assert chi_square_p(total, lambda k: stats.skellam.pmf(k, 2.5 * mu, 2.5 * mu)) > 1e-3


def test_secure_source_reads_the_os_and_samples_the_same_law():
    src = dn.SecureSource()
    assert src.secure and not dn.GeneratorSource(0).secure
    w = src.words(1000)
    assert w.dtype == np.uint64 and int(w.max()) < 2**53
    assert not np.array_equal(w, src.words(1000))
    x = dn.discrete_gaussian(Fraction(25), 40000, src)
    assert chi_square_p(x, lambda k: dn.discrete_gaussian_pmf(25.0, k)) > 1e-4
    y = dn.skellam(4.0, 1000, src)  # Philox keyed from the OS, never seeded
    assert not np.array_equal(y, dn.skellam(4.0, 1000, src))


def test_generator_source_is_reproducible():
    a = dn.discrete_gaussian(Fraction(10), 500, dn.GeneratorSource(5))
    b = dn.discrete_gaussian(Fraction(10), 500, dn.GeneratorSource(5))
    assert np.array_equal(a, b)
    assert dn.GeneratorSource(9).randbits(70) < 2**70
