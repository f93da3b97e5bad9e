"""Distributed DP: each client noises its own quantized update; secure aggregation
reveals only the sum.

The unit of privacy is one client (all its examples).  Who learns what, per round:

* a client learns the global model it is sent, nothing about the others;
* the server chooses the round's clients (so it knows who took part) and learns
  only the output of the secure aggregation: the sum, modulo 2^b, of the
  clients' integer vectors, each carrying its own noise share.  The sum holds
  the noise of every share that reached it (>= ``min_clients`` of them), so it
  is differentially private *against the server*, with no amplification by
  sampling (it knows who took part): replace-one, one event per round a
  client took part in (`DistributedDP.event`);
* whoever sees only the released models (the server's users, the public)
  also gets the amplification of the random choice of m of K clients
  (`DistributedDP.round_event`), as under central DP.

Under central DP (Global DP, `GlobalDPAggregator`) the server sees every
clipped update: against it epsilon is infinite.  Under local DP every upload is
private on its own, and the noise of a sum of m uploads grows with sqrt(m).
See docs/concepts/central-distributed-local.md.

The mechanisms (Kairouz, Liu, Steinke 2021, "The distributed discrete Gaussian
mechanism for federated learning with secure aggregation", Algorithms 1-2;
Agarwal, Kairouz, Liu 2021, "The Skellam mechanism for differentially private
federated learning", Algorithm 1).  Client i, update u_i (d parameters):

1. clip:    x_i = u_i min(1, c / ||u_i||)                       (||x_i|| <= c)
2. rotate:  x_i <- H D x_i, D random signs, H the normalised Hadamard matrix
   (block diagonal, blocks of ``block_size`` = 2^k; d padded to d' = a multiple
   of it).  H D is orthogonal: norms, and so the privacy analysis, unchanged;
   it spreads every vector over its block, so no coordinate is large.  D
   comes from a public per-round seed the server broadcasts.
3. scale:   x_i <- s x_i                                       (||x_i|| <= c s)
4. round:   conditional randomized rounding: each coordinate to floor or ceil
   with the probabilities that keep its mean, redrawn until the rounded
   vector's norm is <= D = `rounded_l2_norm_bound(c s, beta, d')`.
5. noise:   + Y_i, Y_i ~ N_Z(0, s_share^2)^d' (exact sampler,
   `dpfl_tf.discrete_noise.discrete_gaussian`) or Sk(mu_share)^d' (Skellam).
6. wrap:    v_i = (x_i + Y_i) mod 2^b: what the client hands to secure
   aggregation, b bits per coordinate.

Server: the secure aggregation outputs T = sum_i v_i mod 2^b; decoding maps
T to the integer in [-2^(b-1), 2^(b-1)) congruent to it, divides by s and
undoes the rotation, which gives sum_i x_i + (rounding and noise)/s, the sum
of the clipped updates plus noise, exactly when no coordinate of the
integer sum left [-2^(b-1), 2^(b-1)) (`wrap_probability`).

Noise.  ``noise_multiplier`` z is the central noise std over c, as for Global
DP: the shares are sized so that ``min_clients`` of them sum to variance
(z c s)^2 (discrete Gaussian: s_share^2 = (z c s)^2 / n_min, rounded up to a
dyadic rational; Skellam: mu_share = (z c s)^2 / n_min).  If more clients
survive, the sum is noisier than needed (the cost of dropouts).

Scale.  s is the largest scale for which the sum of m vectors stays inside
the b-bit range with probability >= 1 - ``overflow_probability`` per
coordinate, from the sub-Gaussian bound P(|S_j| >= 2^(b-1)) <= 2 exp(-2^(2b-2)
/ (2 V)), V = (m c s)^2 / B + m/4 + m s_share^2 (Kairouz et al. 2021, Section
4.4; B the block size: one block holding the whole sum is the worst case;
m/4 the rounding, each coordinate's error being bounded in an interval of
length 1; the discrete Gaussian is s^2-sub-Gaussian, Canonne et al. 2020).
The rounding terms treat conditional rounding as unconditional rounding
(as the paper's heuristic does).

Privacy (`dpfl_tf.privacy.distributed`): replacing one client moves sum_i x_i
by at most 2D in L2 and `integer_l1_bound(2D, d')` in L1; the rounding's
inflation of the norm, c s -> D, is thereby accounted, and the wrap-around is
a post-processing of the integer sum.  Client sampling must be fixed-size (m
of K without replacement): with Poisson sampling the number of noise shares
would depend on whether a client took part, which no event here describes.
"""

from __future__ import annotations

import dataclasses
import math
from fractions import Fraction
from typing import Iterable, Sequence

import dp_accounting
import numpy as np

from dpfl_tf._validation import check_count, check_number
from dpfl_tf.discrete_noise import (
    GeneratorSource,
    RandomSource,
    discrete_gaussian,
    dyadic_variance,
    skellam,
)
from dpfl_tf.federated.settings import DistributedMechanism
from dpfl_tf.privacy.distributed import integer_l1_bound, rounded_l2_norm_bound
from dpfl_tf.privacy.events import (
    DistributedDiscreteGaussianDpEvent,
    DistributedSkellamDpEvent,
    SamplingMethod,
)

__all__ = [
    "DistributedMechanism",
    "DistributedDP",
    "block_size_for",
    "hadamard_blocks",
    "rotate",
    "unrotate",
    "DEFAULT_BETA",
]

#: Conditional rounding's beta (Kairouz et al. 2021 use exp(-1/2)).
DEFAULT_BETA = math.exp(-0.5)
_MAX_ROUNDING_TRIES = 1000


def block_size_for(dimension: int, max_padding: float = 1 / 16) -> int:
    """The Hadamard block size for d parameters: the largest power of two B <=
    2^ceil(log2 d) whose padding, ceil(d / B) B - d, is at most `max_padding` x d,
    and never below min(2^ceil(log2 d), 1024) (a small vector is one block)."""
    d = check_count("dimension", dimension, minimum=1)
    full = 1 << (d - 1).bit_length()
    floor_size = min(full, 1024)
    b = full
    while b > floor_size and math.ceil(d / b) * b > (1 + max_padding) * d:
        b //= 2
    return b


def hadamard_blocks(x: np.ndarray) -> np.ndarray:
    """The normalised Walsh-Hadamard transform H / sqrt(B) of every row of `x`
    (shape (L, B), B a power of two): orthogonal and its own inverse."""
    rows, size = x.shape
    y = np.array(x, dtype=np.float64)
    h = 1
    while h < size:
        y = y.reshape(rows, size // (2 * h), 2, h)
        a, b = y[:, :, 0, :], y[:, :, 1, :]
        y = np.stack([a + b, a - b], axis=2)
        h *= 2
    return y.reshape(rows, size) / math.sqrt(size)


def _signs(seed: int, size: int) -> np.ndarray:
    """D: `size` random signs from the round's public rotation seed."""
    bits = np.random.default_rng([int(seed), 0x5EED]).integers(0, 2, size=size)
    return 1.0 - 2.0 * bits


def rotate(x: np.ndarray, seed: int, padded: int, block: int) -> np.ndarray:
    """H D x with x zero-padded to `padded` coordinates (blocks of `block`)."""
    z = np.zeros(padded)
    z[: x.size] = x
    return hadamard_blocks((z * _signs(seed, padded)).reshape(-1, block)).reshape(-1)


def unrotate(y: np.ndarray, seed: int, dimension: int, block: int) -> np.ndarray:
    """The inverse of `rotate`: D H y, the padding dropped."""
    x = hadamard_blocks(np.asarray(y, dtype=np.float64).reshape(-1, block)).reshape(-1)
    return (x * _signs(seed, y.size))[:dimension]


@dataclasses.dataclass(frozen=True)
class DistributedDP:
    """One distributed DP mechanism (module docstring): its parameters, what follows
    from them (scale, share noise, norm bound, events) and its client and server
    steps.  Frozen; checked in ``__post_init__``; `calibrated` returns a copy with
    the noise for a target epsilon.

    Attributes:
      mechanism: "discrete_gaussian" or "skellam".
      bits: b, the bits of every coordinate the secure aggregation sums (its
        modulus is 2^b); 2 <= b <= 30.
      l2_norm_clip: c > 0, the clip bound of one client's update.
      noise_multiplier: z > 0, the central noise std over c of the sum of
        `min_clients` shares.
      clients_per_round: m, the most vectors one sum holds.
      min_clients: n_min <= m, the fewest vectors (and noise shares) with which
        the secure aggregation finishes a round; the privacy events assume only
        these (default m: no dropouts tolerated).
      dimension: d, the number of model parameters.
      beta: conditional rounding's beta in [0, 1) (0: unconditional rounding).
      overflow_probability: target bound of the per-coordinate wrap-around
        probability the scale is chosen for, in (0, 1).
      block_size: the Hadamard block (a power of two; default `block_size_for`).
    """

    mechanism: DistributedMechanism
    bits: int
    l2_norm_clip: float
    noise_multiplier: float
    clients_per_round: int
    dimension: int
    min_clients: int | None = None
    beta: float = DEFAULT_BETA
    overflow_probability: float = 1e-4
    block_size: int | None = None

    def __post_init__(self):
        s = object.__setattr__
        s(self, "mechanism", DistributedMechanism.parse(self.mechanism))
        bits = check_count("bits", self.bits, minimum=2)
        if bits > 30:
            raise ValueError(
                f"bits must be in [2, 30] (integer sums in int64 and Flower's "
                f"int32 quantizer), got {self.bits!r}"
            )
        s(self, "bits", bits)
        s(
            self,
            "l2_norm_clip",
            check_number("l2_norm_clip", self.l2_norm_clip, low=0.0, low_open=True),
        )
        s(
            self,
            "noise_multiplier",
            check_number("noise_multiplier", self.noise_multiplier, low=0.0, low_open=True),
        )
        m = check_count("clients_per_round", self.clients_per_round, minimum=1)
        s(self, "clients_per_round", m)
        n_min = (
            m
            if self.min_clients is None
            else check_count("min_clients", self.min_clients, minimum=1)
        )
        if n_min > m:
            raise ValueError(f"min_clients must be <= clients_per_round ({m}), got {n_min}")
        s(self, "min_clients", n_min)
        s(self, "dimension", check_count("dimension", self.dimension, minimum=1))
        s(self, "beta", check_number("beta", self.beta, low=0.0, high=1.0, high_open=True))
        s(
            self,
            "overflow_probability",
            check_number(
                "overflow_probability",
                self.overflow_probability,
                low=0.0,
                high=1.0,
                low_open=True,
                high_open=True,
            ),
        )
        block = (
            block_size_for(self.dimension)
            if self.block_size is None
            else check_count("block_size", self.block_size, minimum=1)
        )
        if block & (block - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size!r}")
        s(self, "block_size", block)
        k_sq = 2.0 * math.log(2.0 / self.overflow_probability)  # 2 exp(-k^2/2) = p
        if self.modulus**2 / 4.0 <= k_sq * m / 4.0:
            raise ValueError(
                f"bits={bits} is too few for {m} clients per round at overflow_probability="
                f"{self.overflow_probability:g}: the rounding alone would wrap; need 2^(2b) > "
                f"{k_sq * m:.0f} (bits >= {math.ceil(math.log2(k_sq * m) / 2 + 1e-9)})"
            )
        # the largest s with k^2 V(s) = (2^(b-1))^2 (module docstring)
        a = m * m / block + m * self.noise_multiplier**2 / n_min
        scale = math.sqrt(self.modulus**2 / 4.0 / k_sq - m / 4.0) / (
            self.l2_norm_clip * math.sqrt(a)
        )
        s(self, "_scale", scale)
        central = (self.noise_multiplier * self.l2_norm_clip * scale) ** 2
        if self.mechanism is DistributedMechanism.DISCRETE_GAUSSIAN:
            share = dyadic_variance(central / n_min)
            if share < Fraction(1, 4):
                raise ValueError(
                    f"the discrete Gaussian shares would have stddev {math.sqrt(share):.3g} < "
                    "1/2, below what the distributed discrete Gaussian bound covers; raise "
                    f"noise_multiplier ({self.noise_multiplier:g}) or bits ({bits})"
                )
        else:
            share = central / n_min
        s(self, "_share_variance", share)

    # -- derived quantities --------------------------------------------------------------
    @property
    def modulus(self) -> int:
        """2^b: secure aggregation sums modulo this."""
        return 1 << self.bits

    @property
    def padded_dimension(self) -> int:
        """d': d rounded up to a whole number of Hadamard blocks."""
        return math.ceil(self.dimension / self.block_size) * self.block_size

    @property
    def scale(self) -> float:
        """s: clipped updates are multiplied by s before rounding."""
        return self._scale

    @property
    def share_variance(self) -> float:
        """Each client's noise variance in the integer domain (exact dyadic for the
        discrete Gaussian)."""
        return float(self._share_variance)

    @property
    def l2_bound(self) -> float:
        """D: the L2 norm bound of a client's rounded vector (conditional rounding)."""
        return rounded_l2_norm_bound(
            self.l2_norm_clip * self.scale, self.beta, self.padded_dimension
        )

    @property
    def bits_per_parameter(self) -> float:
        """Bits uploaded per model parameter per round: b d' / d."""
        return self.bits * self.padded_dimension / self.dimension

    def event(self) -> dp_accounting.DpEvent:
        """One round's release as the server sees it, replace-one, no sampling: the
        sum of >= min_clients vectors, one of which is the client's (module docstring)."""
        l2 = 2.0 * self.l2_bound
        l1 = integer_l1_bound(l2, self.padded_dimension)
        if self.mechanism is DistributedMechanism.DISCRETE_GAUSSIAN:
            return DistributedDiscreteGaussianDpEvent(
                self.share_variance, self.min_clients, l2, l1, self.padded_dimension
            )
        return DistributedSkellamDpEvent(self.share_variance, self.min_clients, l2, l1)

    def round_event(
        self,
        sampling: SamplingMethod | str = SamplingMethod.FIXED_SIZE,
        *,
        dataset_size: int | None = None,
        lot_size: int | None = None,
        **unused,
    ) -> dp_accounting.DpEvent:
        """One round's release of the model: m of K clients drawn without replacement
        (``dataset_size`` = K, ``lot_size`` = m), ``SampledWithoutReplacementDpEvent``.
        Poisson sampling is refused (module docstring)."""
        method = SamplingMethod.parse(sampling)
        if method is not SamplingMethod.FIXED_SIZE:
            raise ValueError(
                "distributed DP is accounted for fixed-size client sampling only "
                f"(sampling='fixed_size'), got sampling={method.value!r}: with Poisson "
                "sampling the number of noise shares in the sum would depend on whether a "
                "client took part"
            )
        k = check_count("dataset_size", dataset_size, minimum=1)
        m = check_count("lot_size", lot_size, minimum=1)
        if m != self.clients_per_round:
            raise ValueError(
                f"lot_size ({m}) must equal clients_per_round ({self.clients_per_round})"
            )
        if m > k:
            raise ValueError(f"lot_size must be <= dataset_size ({k}), got {m}")
        return dp_accounting.SampledWithoutReplacementDpEvent(k, m, self.event())

    def calibrated(
        self,
        target_epsilon: float,
        delta: float,
        rounds: int,
        num_clients: int,
        *,
        tolerance: float = 1e-3,
    ) -> "DistributedDP":
        """A copy with the smallest noise_multiplier for which `rounds` rounds of
        `round_event` (m of ``num_clients``) cost at most `target_epsilon` at `delta`
        ('rdp' accountant)."""
        from dpfl_tf.privacy.calibration import calibrate_noise_multiplier

        rounds = check_count("rounds", rounds, minimum=1)

        def event(z):
            try:
                config = dataclasses.replace(self, noise_multiplier=max(z, 1e-6))
            except ValueError:  # shares below what the bound covers: no guarantee
                return dp_accounting.NonPrivateDpEvent()
            return dp_accounting.SelfComposedDpEvent(
                config.round_event(
                    "fixed_size", dataset_size=num_clients, lot_size=self.clients_per_round
                ),
                rounds,
            )

        z, _ = calibrate_noise_multiplier(target_epsilon, delta, event, "rdp", tolerance=tolerance)
        return dataclasses.replace(self, noise_multiplier=z)

    def wrap_probability(self, num_vectors: int | None = None) -> float:
        """A bound on the probability that one coordinate of the integer sum of
        `num_vectors` (default m) client vectors leaves [-2^(b-1), 2^(b-1)), i.e. is
        decoded wrongly (module docstring: sub-Gaussian signal and rounding; the
        discrete Gaussian's sub-Gaussian tail, Skellam's moment generating function
        exp(mu (cosh t - 1)) in a Chernoff bound)."""
        n = (
            self.clients_per_round
            if num_vectors is None
            else check_count("num_vectors", num_vectors, minimum=1)
        )
        cs = self.l2_norm_clip * self.scale
        v_signal = (n * cs) ** 2 / self.block_size + n / 4.0
        half = self.modulus / 2.0
        mu = n * self.share_variance
        if self.mechanism is DistributedMechanism.DISCRETE_GAUSSIAN:
            return min(1.0, 2.0 * math.exp(-(half**2) / (2.0 * (v_signal + mu))))
        from scipy import optimize

        def log_bound(t):
            return t * t * v_signal / 2.0 + mu * (math.cosh(t) - 1.0) - t * half

        t_max = math.asinh(half / max(mu, 1e-300)) + 1.0
        best = optimize.minimize_scalar(log_bound, bounds=(0.0, t_max), method="bounded")
        return min(1.0, 2.0 * math.exp(min(0.0, best.fun)))

    def report(self) -> dict:
        """The mechanism's numbers (for results files and the privacy report)."""
        return {
            "mechanism": self.mechanism.value,
            "bits": self.bits,
            "l2_norm_clip": self.l2_norm_clip,
            "noise_multiplier": self.noise_multiplier,
            "clients_per_round": self.clients_per_round,
            "min_clients": self.min_clients,
            "dimension": self.dimension,
            "padded_dimension": self.padded_dimension,
            "block_size": self.block_size,
            "scale": self.scale,
            "beta": self.beta,
            "share_variance": self.share_variance,
            "l2_bound": self.l2_bound,
            "norm_inflation": self.l2_bound / (self.l2_norm_clip * self.scale),
            "wrap_probability": self.wrap_probability(),
            "bits_per_parameter": self.bits_per_parameter,
        }

    # -- client: clip, rotate, scale, round, noise, wrap ----------------------------------
    def clip(self, flat: np.ndarray) -> np.ndarray:
        """x min(1, c / ||x||); a vector with a non-finite entry becomes 0 (the client
        then contributes only its noise share)."""
        x = np.asarray(flat, dtype=np.float64).reshape(-1)
        if x.size != self.dimension:
            raise ValueError(
                f"the update has {x.size} parameters, the mechanism was built "
                f"for dimension={self.dimension}"
            )
        if not np.all(np.isfinite(x)):
            return np.zeros_like(x)
        norm = _norm(x)
        return x * min(1.0, self.l2_norm_clip / norm) if norm > 0 else x

    def round_conditionally(self, x: np.ndarray, source: RandomSource) -> np.ndarray:
        """Randomized rounding of x (E[result] = x), redrawn until its norm is <= D
        (Kairouz et al. 2021, Section 4.1; at most 1 / (1 - beta) draws on average)."""
        floor = np.floor(x)
        frac = x - floor
        bound = self.l2_bound
        for _ in range(_MAX_ROUNDING_TRIES):
            u = source.words(x.size).astype(np.float64) * 2.0**-53
            rounded = floor + (u < frac)
            if _norm(rounded) <= bound:
                return rounded.astype(np.int64)
        raise RuntimeError(
            f"conditional rounding found no vector of norm <= {bound:g} in "
            f"{_MAX_ROUNDING_TRIES} tries (expected about "
            f"{1 / (1 - self.beta):.1f})"
        )

    def noise_share(self, source: RandomSource) -> np.ndarray:
        """Y_i: d' independent discrete Gaussian (exact) or Skellam integers."""
        if self.mechanism is DistributedMechanism.DISCRETE_GAUSSIAN:
            return discrete_gaussian(self._share_variance, self.padded_dimension, source)
        return skellam(self._share_variance, self.padded_dimension, source)

    def wrap(self, v: np.ndarray) -> np.ndarray:
        """v mod 2^b, in [0, 2^b)."""
        return np.mod(v, self.modulus)

    def encode(self, flat: np.ndarray, rotation_seed: int, source: RandomSource) -> np.ndarray:
        """A client's upload: clip, rotate, scale, round, add its noise share, wrap
        (module docstring); int64 in [0, 2^b), d' coordinates."""
        x = rotate(self.clip(flat), rotation_seed, self.padded_dimension, self.block_size)
        rounded = self.round_conditionally(x * self.scale, source)
        return self.wrap(rounded + self.noise_share(source))

    # -- server: secure sum (simulated), decode --------------------------------------------
    def secure_sum(self, uploads: Iterable[np.ndarray]) -> tuple[np.ndarray, int]:
        """What secure aggregation reveals: sum_i v_i mod 2^b (and the count).  A
        simulation: it sees each v_i, which a real protocol never reveals."""
        total = np.zeros(self.padded_dimension, dtype=np.int64)
        count = 0
        for v in uploads:
            v = np.asarray(v, dtype=np.int64)
            if v.shape != total.shape or v.min(initial=0) < 0 or v.max(initial=0) >= self.modulus:
                raise ValueError(
                    f"an upload must be {self.padded_dimension} integers in "
                    f"[0, 2^{self.bits}), got shape {v.shape}"
                )
            total = np.mod(total + v, self.modulus)
            count += 1
        return total, count

    def decode(self, total: np.ndarray, rotation_seed: int) -> np.ndarray:
        """The sum of the clients' clipped updates plus noise / s, from the secure sum
        modulo 2^b: centre into [-2^(b-1), 2^(b-1)), divide by s, undo the rotation
        (d float64 values)."""
        t = np.mod(np.asarray(total, dtype=np.int64), self.modulus)
        centred = np.where(t >= self.modulus // 2, t - self.modulus, t).astype(np.float64)
        return unrotate(centred / self.scale, rotation_seed, self.dimension, self.block_size)


def _norm(x: np.ndarray) -> float:
    """The L2 norm without BLAS (whose threads contend on a busy machine)."""
    return math.sqrt(float(np.sum(np.square(x))))


def flatten(update: Sequence) -> np.ndarray:
    """The tensors of an update as one float64 vector."""
    return np.concatenate([np.asarray(t, dtype=np.float64).reshape(-1) for t in update])


def unflatten(flat: np.ndarray, shapes: Sequence[Sequence[int]]) -> list[np.ndarray]:
    """`flatten`'s inverse for tensors of the given shapes."""
    out, start = [], 0
    for shape in shapes:
        size = int(np.prod(shape))
        out.append(flat[start : start + size].reshape(shape))
        start += size
    return out


def seeded_source(*keys: int) -> RandomSource:
    """A reproducible `GeneratorSource` keyed by integers (noise seed, round, client)."""
    return GeneratorSource(np.random.default_rng([int(k) for k in keys]))
