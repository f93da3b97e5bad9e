"""Integer noise for distributed DP: an exact discrete Gaussian sampler and Skellam shares.

The discrete Gaussian N_Z(0, s^2) puts mass proportional to exp(-y^2 / (2 s^2))
on every integer y (Canonne, Kamath, Steinke 2020, "The discrete Gaussian for
differential privacy", Definition 1).  `discrete_gaussian` samples it *exactly*:
every output has exactly that probability, with no floating-point
approximation anywhere in the decision, following the paper's Algorithm 3
(rejection from a discrete Laplace proposal) with its Algorithm 2 for the
discrete Laplace.  s^2 must be rational; here it is a dyadic p / 2^k (the
caller rounds a requested variance *up* to one, `dyadic_variance`).

Every randomised decision of the two algorithms is a Bernoulli(exp(-g)) with a
rational g >= 0 (or a uniform integer, or a fair bit).  The paper draws those
Bernoullis with exact rational arithmetic one at a time (its Algorithm 1);
here, to sample millions of coordinates with numpy, they are drawn by *lazy
comparison with a uniform*: B = [V < exp(-g)] for V uniform on [0, 1), where
V's first 53 bits come from one random word and exp(-g) is known in float64
to within 2^-50 (g itself from exact integers, a few roundings).  When V's
first 53 bits already decide the comparison with a margin of 2^-44 (all but
about 2^-43 of draws) that decision is exact; otherwise V's further bits are
drawn and compared with exp(-g) computed in exact rational and high-precision
decimal arithmetic, as many digits as it takes (`_exact_bernoulli_exp`).
The result has exactly the law of Bernoulli(exp(-g)), as the paper's
Algorithm 1 has, and so the samples have exactly the law N_Z(0, s^2).

Skellam shares (Agarwal, Kairouz, Liu 2021, "The Skellam mechanism for
differentially private federated learning"): Sk(mu) = P_1 - P_2 with P_1, P_2
independent Poisson(mu / 2) has variance mu, and a sum of independent Skellam
variables is Skellam (its variances add).  They are drawn with numpy's Poisson
sampler (transformed rejection in floating point: not an exact sampler).

Randomness.  Both draw from a `RandomSource`: `GeneratorSource` wraps a seeded
numpy generator (tests and reproducible simulations), `SecureSource` reads
the OS's secure source (``os.urandom`` via `dpfl_tf.secure_random`) for every
bit of the discrete Gaussian; its Skellam shares come from a numpy Philox
generator keyed with 128 bits from the same source.
"""

from __future__ import annotations

import decimal
import math
import os
from fractions import Fraction

import numpy as np

from dpfl_tf._validation import check_count, check_number

__all__ = [
    "RandomSource",
    "GeneratorSource",
    "SecureSource",
    "discrete_gaussian",
    "discrete_laplace",
    "bernoulli_exp",
    "skellam",
    "dyadic_variance",
    "discrete_gaussian_pmf",
]

_WORD = 2.0**-53  # one 53-bit word w stands for V in [w 2^-53, (w + 1) 2^-53)
_MARGIN = 2.0**-44  # float64 decisions need exp(-g) known to within this (it is 2^-50)
_DENOMINATOR_BITS = 30  # dyadic variances p / 2^k keep t 2^k <= 2^31 (int64 arithmetic)


class RandomSource:
    """Where the samplers' random bits come from."""

    #: True if every bit comes from the OS's secure source.
    secure = False

    def words(self, n: int) -> np.ndarray:
        """n independent uniform integers in [0, 2^53) (uint64)."""
        raise NotImplementedError

    def randbits(self, k: int) -> int:
        """A uniform integer in [0, 2^k)."""
        raise NotImplementedError

    def numpy_generator(self) -> np.random.Generator:
        """A numpy generator for the samplers that use numpy's (Skellam's Poisson)."""
        raise NotImplementedError


class GeneratorSource(RandomSource):
    """Bits from a numpy `Generator` (seeded: reproducible; tests and simulations)."""

    def __init__(self, generator: np.random.Generator | int | None = None):
        if not isinstance(generator, np.random.Generator):
            generator = np.random.default_rng(generator)
        self.generator = generator

    def words(self, n):
        return self.generator.integers(0, 2**53, size=int(n), dtype=np.uint64)

    def randbits(self, k):
        k = int(k)
        return int.from_bytes(self.generator.bytes((k + 7) // 8), "little") >> (-k % 8)

    def numpy_generator(self):
        return self.generator


class SecureSource(RandomSource):
    """Bits from the OS's secure source (``os.urandom``); refuses nothing, seeds nothing."""

    secure = True

    def words(self, n):
        from dpfl_tf.secure_random import secure_words

        return secure_words(n)

    def randbits(self, k):
        k = int(k)
        return int.from_bytes(os.urandom((k + 7) // 8), "little") >> (-k % 8)

    def numpy_generator(self):
        from dpfl_tf.secure_random import secure_numpy_generator

        return secure_numpy_generator()


def dyadic_variance(variance: float, denominator_bits: int | None = None) -> Fraction:
    """The smallest dyadic p / 2^k >= `variance` (so the noise is never below the
    one asked for), with k chosen so that the samplers' integers stay in int64:
    t 2^k <= 2^31 for t = floor(s) + 1 (the discrete Laplace scale)."""
    v = check_number("variance", variance, low=0.0, low_open=True)
    t = math.floor(math.sqrt(v)) + 1
    if denominator_bits is None:
        denominator_bits = max(0, _DENOMINATOR_BITS - t.bit_length())
    q = 2 ** int(denominator_bits)
    return Fraction(math.ceil(Fraction(v) * q), q)


# -- Bernoulli(exp(-g)), uniform integers, fair bits ---------------------------------------
def bernoulli_exp(gamma: np.ndarray, exact_gamma, source: RandomSource) -> np.ndarray:
    """Independent B_i ~ Bernoulli(exp(-g_i)), exactly: B_i = [V_i < exp(-g_i)] for
    V_i uniform on [0, 1) (module docstring).

    Args:
      gamma: float64 approximations of g_i >= 0 with relative error <= 2^-50.
      exact_gamma: ``exact_gamma(i) -> Fraction``, the exact g_i, called only for the
        rare draws the float64 comparison cannot decide.
      source: the `RandomSource`.
    """
    gamma = np.asarray(gamma, dtype=np.float64)
    p = np.exp(-gamma)  # within 2^-50 of exp(-g): g e^-g <= 1/e
    w = source.words(gamma.size)
    low = w.astype(np.float64) * _WORD
    out = (low + _WORD) <= (p - _MARGIN)
    for i in np.flatnonzero(~out & (low < p + _MARGIN)):
        out[i] = _LazyUniform(int(w[i]), source).below_exp(exact_gamma(int(i)))
    return out


class _LazyUniform:
    """V uniform on [0, 1), known so far to lie in [low, low + width): its first 53
    bits are given; `below_exp` draws further bits only as far as it must."""

    def __init__(self, word: int, source: RandomSource):
        self.low = Fraction(int(word), 2**53)
        self.width = Fraction(1, 2**53)
        self.source = source

    def below_exp(self, gamma: Fraction) -> bool:
        """[V < exp(-gamma)], exp(-gamma) computed to ever more decimal digits."""
        digits = 40
        while True:
            with decimal.localcontext() as ctx:
                ctx.prec = digits + 10
                ctx.Emin = -(10**9)
                g = decimal.Decimal(gamma.numerator) / decimal.Decimal(gamma.denominator)
                p = Fraction((-g).exp())
            # two roundings at prec digits + 10: |p - exp(-g)| <= (1 + g) 10^-(digits + 9)
            err = (1 + gamma) * Fraction(1, 10 ** (digits + 8))
            if self.low + self.width <= p - err:
                return True
            if self.low >= p + err:
                return False
            self.width /= 2**64
            self.low += self.source.randbits(64) * self.width
            digits += 20


def _fair_bits(n: int, source: RandomSource) -> np.ndarray:
    return (source.words(n) & np.uint64(1)).astype(bool)


# -- discrete Laplace and discrete Gaussian -------------------------------------------------
def _geometric(t: int, n: int, source: RandomSource) -> np.ndarray:
    """n independent X with P(X = x) = exp(-x/t) (1 - exp(-1/t)), x = 0, 1, ...:
    X = max{x : V < exp(-x/t)} for V uniform on [0, 1), read from V's first 53 bits
    when they decide it with a margin (the two comparisons below), else exactly."""
    w = source.words(n)
    low = w.astype(np.float64) * _WORD
    x = np.floor(-t * np.log(low + _WORD / 2)).astype(np.int64)
    upper = np.exp(-x / t)  # within 2^-52 of exp(-x/t)
    below = (low + _WORD) <= upper - _MARGIN  # V < exp(-x/t)
    above = low >= upper * math.exp(-1.0 / t) + _MARGIN  # V >= exp(-(x+1)/t)
    for i in np.flatnonzero(~(below & above)):
        v, k = _LazyUniform(int(w[i]), source), max(int(x[i]), 0)
        while k > 0 and not v.below_exp(Fraction(k, t)):
            k -= 1
        while v.below_exp(Fraction(k + 1, t)):
            k += 1
        x[i] = k
    return x


def discrete_laplace(t: int, size: int, source: RandomSource) -> np.ndarray:
    """Y with P(Y = y) proportional to exp(-|y| / t), t a positive integer, exactly.

    As Canonne, Kamath, Steinke 2020, Algorithm 2 (s = 1): X geometric with ratio
    exp(-1/t) (their U + tV; drawn here by `_geometric`), a fair sign bit B, the
    candidate (B = 1, X = 0) rejected (zero would be counted twice), Y = (1 - 2B) X."""
    t = check_count("t", t, minimum=1)
    size = check_count("size", size)
    out = np.empty(size, dtype=np.int64)
    todo = np.arange(size)
    while todo.size:
        x = _geometric(t, todo.size, source)
        b = _fair_bits(todo.size, source)
        ok = ~(b & (x == 0))
        out[todo[ok]] = np.where(b[ok], -x[ok], x[ok])
        todo = todo[~ok]
    return out


def discrete_gaussian(variance: Fraction | float, size: int, source: RandomSource) -> np.ndarray:
    """`size` independent exact samples of N_Z(0, s^2), s^2 = `variance` (int64).

    Canonne, Kamath, Steinke 2020, Algorithm 3: t = floor(s) + 1; Y ~ discrete
    Laplace(t); accept with probability exp(-(|Y| - s^2/t)^2 / (2 s^2)).  With
    s^2 = p/q the exponent is (|Y| t q - p)^2 / (2 p q t^2), computed from exact
    integers.  `variance` must be a dyadic `Fraction` (`dyadic_variance`); a float
    is rounded up to one first.
    """
    if not isinstance(variance, Fraction):
        variance = dyadic_variance(variance)
    if variance <= 0:
        raise ValueError(f"variance must be > 0, got {variance}")
    size = check_count("size", size)
    p, q = variance.numerator, variance.denominator
    t = math.isqrt(p // q) + 1  # floor(s) + 1 (s^2 = p/q, floor(s) = isqrt(floor(s^2)))
    if t * q > 2**40:
        raise ValueError(
            f"variance {variance} needs t q = {t * q} <= 2^40 for int64 "
            "arithmetic; round it with dyadic_variance()"
        )
    denominator = 2.0 * p * q * t * t  # float64, relative error <= 3 x 2^-53
    safe = 2**62 // (t * q)  # |y| t q < 2^62: exact in int64
    out = np.empty(size, dtype=np.int64)
    todo = np.arange(size)
    while todo.size:
        y = discrete_laplace(t, todo.size, source)
        sign, y = y < 0, np.abs(y)
        if y.max(initial=0) < safe:
            a = (y * (t * q) - p).astype(np.float64)
        else:  # never in practice; float64, no cancellation there
            a = y.astype(np.float64) * float(t * q) - float(p)
        gamma = a * a / denominator  # relative error <= 2^-50

        def exact(i, y=y):
            return Fraction((int(y[i]) * t * q - p) ** 2, 2 * p * q * t * t)

        ok = bernoulli_exp(gamma, exact, source)
        out[todo[ok]] = np.where(sign[ok], -y[ok], y[ok])
        todo = todo[~ok]
    return out


def discrete_gaussian_pmf(variance: float, support: np.ndarray) -> np.ndarray:
    """P(Y = y) of N_Z(0, variance) on the integers `support` (normalised by a sum over
    |y| <= 40 s + 10, which leaves out less than exp(-800) of the mass)."""
    v = float(variance)
    half = int(40 * math.sqrt(v)) + 10
    ys = np.arange(-half, half + 1, dtype=np.float64)
    log_norm = np.log(np.sum(np.exp(-(ys**2) / (2 * v))))
    return np.exp(-(np.asarray(support, dtype=np.float64) ** 2) / (2 * v) - log_norm)


def skellam(variance: float, size: int, source: RandomSource) -> np.ndarray:
    """`size` independent Sk(mu) = Poisson(mu/2) - Poisson(mu/2), mu = `variance` (int64).

    Agarwal, Kairouz, Liu 2021, Section 3: E = 0, Var = mu, and independent
    Skellam variables sum to a Skellam variable with the summed variance."""
    mu = check_number("variance", variance, low=0.0, low_open=True)
    size = check_count("size", size)
    gen = source.numpy_generator()
    draws = gen.poisson(mu / 2.0, size=(2, size)).astype(np.int64)
    return draws[0] - draws[1]
