"""Local differential privacy for client uploads: each client perturbs every
coordinate of its model before upload, so even the server learns little from
one upload (issue 7).

Unit of privacy and neighbouring relation
-----------------------------------------
A mechanism M is eps-LDP for one *coordinate* when, for ANY two inputs t, t'
of its domain and every output set S, P[M(t) in S] <= e^eps P[M(t') in S]
(local model: the "neighbour" of a client's value is every other value).
A model upload perturbs d coordinates independently; with basic composition
it is (d * eps)-LDP, and R uploads (rounds the client takes part in) are
(R * d * eps)-LDP.  `privacy_report` states these three numbers; a
per-coordinate eps is never a model-level guarantee.  PNPM randomises only
signs, so its upload and client figures are inf, with the sign-only
composition reported beside them under its own name.

Mechanisms (a = e^eps; all vectorised over whole tensors in TensorFlow)
----------------------------------------------------------------------
* `DuchiMechanism` -- Duchi, Jordan, Wainwright (FOCS 2013 / JASA 2018), one
  dimension, as restated by Wang et al. (ICDE 2019, Alg. 1): t in [-1, 1],
  output +B or -B with B = (a+1)/(a-1) and P[+B] = 1/2 + t (a-1) / (2(a+1)).
  E = t, Var = B^2 - t^2.
* `PiecewiseMechanism` -- Wang et al., "Collecting and analyzing
  multidimensional data with local differential privacy", ICDE 2019, Alg. 2:
  b = e^(eps/2), C = (b+1)/(b-1), l(t) = (C+1)/2 t - (C-1)/2,
  r(t) = l(t) + C - 1; with probability b/(b+1) uniform on [l, r], otherwise
  uniform on [-C, l) U (r, C].  Density p = (a - b)/(2b + 2) on [l, r] and p/a
  elsewhere on [-C, C].  E = t, Var = t^2/(b-1) + (b+3)/(3(b-1)^2) (Lemma 1).
* `PNPMMechanism` -- positive-negative piecewise mechanism (Ren et al. 2022),
  input the sign s in {-1, +1} of a weight w: C = (a+3)/(a-1),
  l(s) = (C+1)/2 s - (C-1)/2, r(s) = l(s) + C - 1 (so [l, r] = [1, C] for
  s = +1 and [-C, -1] for s = -1); with probability a/(a+1) t* is uniform on
  [l(s), r(s)], otherwise uniform on [-r(s), -l(s)]; the upload is |w| t*.
  E[t*] = s, so E = w; Var = w^2 4(a + 1/3)/(a-1)^2 = w^2 (C+2)(C-1)/3.
  **Only the sign is protected**: |t*| is uniform on [1, C] whatever s is, so
  |upload| = |w| U with U ~ Uniform[1, C]; one upload reveals |w| to within a
  factor C (|w| in [|y|/C, |y|]) and w = 0 exactly.  See
  `pnpm_magnitude_distinguishability`.
* `LDPFLMechanism` -- Sun, Qian, Chen, "LDP-FL: Practical private aggregation
  in federated learning with local differential privacy", IJCAI 2021: weights
  of a layer in [c - r, c + r]; output c + r (a+1)/(a-1) with probability
  ((w-c)(a-1) + r(a+1)) / (2r(a+1)), else c - r (a+1)/(a-1).  This is Duchi's
  mechanism applied to (w - c)/r and mapped back; E = w,
  Var = r^2 ((a+1)/(a-1))^2 - (w-c)^2.  (The paper's splitting and shuffling
  of uploads is not implemented and no amplification from it is claimed.)
* `LaplaceMechanism` -- t in [-1, 1] (sensitivity 2), y = t + Lap(2/eps);
  Var = 8/eps^2 (Dwork et al. 2006).
* `GaussianMechanism` -- t in [-1, 1], y = t + N(0, (2 sigma)^2): the Gaussian
  mechanism with noise multiplier sigma (noise std / sensitivity); it is
  (eps, delta)-DP per coordinate, eps from a `dpfl_tf.privacy` accountant on
  `GaussianDpEvent(sigma)`.  A d-coordinate upload is exactly one Gaussian
  mechanism with L2 sensitivity 2 sqrt(d): `GaussianDpEvent(sigma/sqrt(d))`.
  `gaussian_upload_report` covers the other textbook form (clip the whole
  upload to L2 norm S, add N(0, sigma^2 S^2)).

Domain handling (`DomainPolicy`): explicit, never silent
-------------------------------------------------------
Duchi, PM, LDP-FL, Laplace and Gaussian need their input in a bounded domain.
A layer's weights are mapped with a *public* centre c and bound r (chosen
without looking at private data), t = (w - c)/r, perturbed, and mapped back,
y = c + r M(t), so E[y] = the (clipped) weight:

* ``DomainPolicy.clip(bound, center=0)`` -- clip w to [c - r, c + r] first;
  the output is unbiased for the clipped weight.
* ``DomainPolicy.scale(bound, center=0)`` -- t = (w - c)/bound; an entry
  outside [c - r, c + r] raises ValueError (it is not clipped behind your back).
* ``DomainPolicy.error()`` (default) -- no mapping: inputs must already lie in
  the mechanism's own domain, otherwise ValueError naming the mechanism, the
  range and how many entries were out of range.

Non-finite inputs (NaN, inf) are refused under every policy.

Randomness is drawn from an injected `tf.random.Generator` (OS entropy by
default via `dpfl_tf.sanitizer.make_generator`; seed it for tests only).
The guarantees are those of the idealised real-valued mechanisms: like every
floating-point sampler of Laplace, Gaussian or uniform noise, this code does
not defend against low-order-bit attacks on floating-point outputs
(Mironov, CCS 2012).
Every mechanism also has a numpy scalar reference (`perturb_scalar`) written
directly from the paper's description, the closed-form `mean` / `variance`,
`output_range` and the `density` (pdf, or pmf for two-point outputs) of the
output given the input, so that tests can check the e^eps ratio bound.
"""

from __future__ import annotations

import abc
import dataclasses
import math
from typing import Any, ClassVar, Sequence

import dp_accounting
import numpy as np
import tensorflow as tf

from dpfl_tf._seeds import derive_seed
from dpfl_tf._validation import ChoiceEnum, check_count, check_number
from dpfl_tf.federated.settings import MAX_EPSILON, MechanismKind
from dpfl_tf.privacy.accountants import AccountantKind, compute_epsilon
from dpfl_tf.privacy.events import REPLACE_ONE_UPDATE, clipped_upload_event
from dpfl_tf.sanitizer import make_generator

__all__ = [
    "LocalDPMechanism",
    "DuchiMechanism",
    "PiecewiseMechanism",
    "PNPMMechanism",
    "LDPFLMechanism",
    "LaplaceMechanism",
    "GaussianMechanism",
    "MechanismKind",
    "make_mechanism",
    "DomainMode",
    "DomainPolicy",
    "out_of_domain_counts",
    "LocalPrivacyReport",
    "privacy_report",
    "gaussian_upload_report",
    "pnpm_magnitude_distinguishability",
    "LocalDPUpload",
]


def _check_epsilon(epsilon: Any) -> float:
    return check_number("epsilon", epsilon, low=0.0, high=MAX_EPSILON, low_open=True)


# ---------------------------------------------------------------------------
# Domain policy


class DomainMode(ChoiceEnum):
    """What to do with a weight outside the public range [c - r, c + r]."""

    __argument__ = "domain mode"

    CLIP = "clip"
    SCALE = "scale"
    ERROR = "error"


def _per_layer(name: str, value: Any, *, positive: bool) -> float | tuple[float, ...]:
    kwargs = dict(low=0.0, low_open=True) if positive else {}
    if isinstance(value, (list, tuple, np.ndarray)):
        values = list(value)
        if not values:
            raise ValueError(f"{name} must be a number or a non-empty sequence, got {value!r}")
        return tuple(check_number(f"{name}[{i}]", v, **kwargs) for i, v in enumerate(values))
    return check_number(name, value, **kwargs)


@dataclasses.dataclass(frozen=True)
class DomainPolicy:
    """How weights are brought into a mechanism's input domain (module docstring).

    Args:
      mode: `DomainMode` CLIP, SCALE or ERROR.
      bound: the public half-width r of each layer's range (a float, or one
        float per weight tensor); required for CLIP and SCALE.
      center: the public centre c (a float or one per weight tensor), default 0.

    The bound and centre must be public -- fixed before seeing any client's
    data (e.g. from the architecture's initialiser or a public pretrained
    model); a range computed from private weights leaks them.
    """

    mode: DomainMode | str = DomainMode.ERROR
    bound: float | tuple[float, ...] | None = None
    center: float | tuple[float, ...] = 0.0

    def __post_init__(self):
        mode = DomainMode.parse(self.mode)
        object.__setattr__(self, "mode", mode)
        if mode is DomainMode.ERROR:
            if self.bound is not None:
                raise ValueError(
                    "DomainPolicy 'error' uses the mechanism's own domain and takes "
                    f"no bound, got bound={self.bound!r}; use clip or scale"
                )
            if self.center != 0.0:
                raise ValueError(
                    "DomainPolicy 'error' takes no center, got "
                    f"center={self.center!r}; use clip or scale"
                )
            return
        if self.bound is None:
            raise ValueError(f"DomainPolicy {mode.value!r} needs a public bound > 0, got None")
        object.__setattr__(self, "bound", _per_layer("bound", self.bound, positive=True))
        object.__setattr__(self, "center", _per_layer("center", self.center, positive=False))

    @classmethod
    def clip(
        cls, bound: float | Sequence[float], center: float | Sequence[float] = 0.0
    ) -> "DomainPolicy":
        return cls(DomainMode.CLIP, bound, center)

    @classmethod
    def scale(
        cls, bound: float | Sequence[float], center: float | Sequence[float] = 0.0
    ) -> "DomainPolicy":
        return cls(DomainMode.SCALE, bound, center)

    @classmethod
    def error(cls) -> "DomainPolicy":
        return cls(DomainMode.ERROR)

    def layer_range(self, index: int, num_layers: int) -> tuple[float, float]:
        """(c, r) of weight tensor `index` out of `num_layers` (CLIP / SCALE only)."""
        if self.mode is DomainMode.ERROR:
            raise ValueError("DomainPolicy 'error' has no per-layer range")
        out = []
        for name, value in (("center", self.center), ("bound", self.bound)):
            if isinstance(value, tuple):
                if len(value) != num_layers:
                    raise ValueError(
                        f"DomainPolicy has {len(value)} per-layer {name} values but "
                        f"the upload has {num_layers} weight tensors"
                    )
                out.append(value[index])
            else:
                out.append(value)
        return out[0], out[1]

    def to_dict(self) -> dict:
        return {
            "mode": self.mode.value,
            "bound": list(self.bound) if isinstance(self.bound, tuple) else self.bound,
            "center": list(self.center) if isinstance(self.center, tuple) else self.center,
        }


# ---------------------------------------------------------------------------
# Tensor helpers


def _as_float(tensor: Any) -> tf.Tensor:
    x = tf.convert_to_tensor(tensor)
    if not x.dtype.is_floating:
        raise ValueError(f"local DP perturbs floating-point weights, got dtype {x.dtype.name}")
    return x


def _require_finite(x: tf.Tensor, mechanism: "LocalDPMechanism", where: str) -> None:
    if tf.executing_eagerly():
        bad = int(tf.size(x)) - int(tf.reduce_sum(tf.cast(tf.math.is_finite(x), tf.int64)))
        if bad:
            raise ValueError(
                f"{mechanism!r}: {bad} of {int(tf.size(x))} entries of {where} are "
                "NaN or inf; they cannot be perturbed (check the local training)"
            )
    else:
        tf.debugging.assert_all_finite(x, f"{mechanism!r}: {where} has NaN or inf entries")


def _require_in_range(
    x: tf.Tensor, low: float, high: float, mechanism: "LocalDPMechanism", where: str, hint: str
) -> None:
    lo = _const(low, x.dtype)
    hi = _const(high, x.dtype)
    if tf.executing_eagerly():
        outside = int(tf.reduce_sum(tf.cast((x < lo) | (x > hi), tf.int64)))
        if outside:
            raise ValueError(
                f"{mechanism!r}: {outside} of {int(tf.size(x))} entries of {where} lie outside "
                f"the input range [{low:g}, {high:g}]; {hint}"
            )
    else:
        tf.debugging.assert_greater_equal(x, lo, f"{mechanism!r}: {where} below {low:g}; {hint}")
        tf.debugging.assert_less_equal(x, hi, f"{mechanism!r}: {where} above {high:g}; {hint}")


_HINT = (
    "handle such entries explicitly: DomainPolicy.clip(bound) to clip to a public range, "
    "or a larger public bound with DomainPolicy.scale(bound)"
)


def _const(value: float, dtype: tf.DType) -> tf.Tensor:
    """A Python float as a tensor of `dtype` (tf.cast would round it through float32 first)."""
    return tf.constant(value, dtype=dtype)


def _compute_dtype(dtype: tf.DType) -> tf.DType:
    return dtype if dtype in (tf.float32, tf.float64) else tf.float32


# ---------------------------------------------------------------------------
# Mechanisms


class LocalDPMechanism(abc.ABC):
    """A per-coordinate local randomiser, vectorised over whole tensors.

    Subclasses set `name`, `discrete` (two-point output: `density` is a pmf),
    `pure` (eps-LDP, delta = 0) and implement `_perturb` (TensorFlow, input in
    the domain), `perturb_scalar` (numpy reference), `mean`, `variance`,
    `output_range` and `density`.

    Args:
      epsilon: the per-coordinate budget eps > 0.
      seed: seeds the generator (tests only; default is OS entropy).
      generator: an explicit `tf.random.Generator` (overrides seed).
    """

    name: ClassVar[str] = "local_dp"
    discrete: ClassVar[bool] = False
    pure: ClassVar[bool] = True
    #: what the per-coordinate eps protects, in words (for reports).
    protected_input: ClassVar[str] = (
        "each perturbed coordinate (any two values of the public domain are eps-indistinguishable)"
    )

    def __init__(
        self,
        epsilon: float,
        *,
        seed: int | None = None,
        generator: tf.random.Generator | None = None,
    ):
        self.epsilon = _check_epsilon(epsilon)
        if seed is not None:
            seed = check_count("seed", seed)
        self.seed = seed
        self._generator = generator

    # -- configuration --------------------------------------------------------
    @property
    def a(self) -> float:
        """e^eps."""
        return math.exp(self.epsilon)

    @property
    def generator(self) -> tf.random.Generator:
        if self._generator is None:  # created lazily, inside whatever scope first needs it
            self._generator = make_generator(self.seed)
        return self._generator

    def input_domain(self) -> tuple[float, float] | None:
        """[low, high] the randomised input must lie in; None when any finite value is allowed."""
        return (-1.0, 1.0)

    def get_config(self) -> dict:
        return {"epsilon": self.epsilon, "seed": self.seed}

    @classmethod
    def from_config(cls, config: dict) -> "LocalDPMechanism":
        return cls(**config)

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.get_config().items() if k != "seed")
        return f"{type(self).__name__}({args})"

    # -- TensorFlow ------------------------------------------------------------
    def perturb(
        self, tensor: Any, generator: tf.random.Generator | None = None, *, where: str = "the input"
    ) -> tf.Tensor:
        """M applied independently to every entry of `tensor` (any shape).

        Inputs must lie in `input_domain()` (ValueError otherwise: use
        `perturb_weights` with a `DomainPolicy` to clip or scale)."""
        x = _as_float(tensor)
        _require_finite(x, self, where)
        domain = self.input_domain()
        if domain is not None:
            _require_in_range(x, domain[0], domain[1], self, where, _HINT)
        return self._perturb_cast(x, generator if generator is not None else self.generator)

    def _perturb_cast(self, x: tf.Tensor, gen: tf.random.Generator) -> tf.Tensor:
        dtype = _compute_dtype(x.dtype)
        y = self._perturb(tf.cast(x, dtype), gen)
        return tf.cast(y, x.dtype)

    @abc.abstractmethod
    def _perturb(self, t: tf.Tensor, gen: tf.random.Generator) -> tf.Tensor:
        """The randomiser on a float32/float64 tensor already in the domain."""

    def _perturb_affine(
        self, w: tf.Tensor, center: float, bound: float, gen: tf.random.Generator
    ) -> tf.Tensor:
        """c + r M((w - c)/r) for w in [c - r, c + r]: unbiased for w."""
        c = _const(center, w.dtype)
        r = _const(bound, w.dtype)
        # w was checked or clipped to [c - r, c + r]; clipping t only removes rounding.
        t = tf.clip_by_value((w - c) / r, _const(-1.0, w.dtype), _const(1.0, w.dtype))
        return c + r * self._perturb(t, gen)

    def perturb_weights(
        self,
        weights: Sequence[Any],
        policy: DomainPolicy | None = None,
        *,
        generator: tf.random.Generator | None = None,
    ) -> list[tf.Tensor]:
        """Perturbs every weight tensor of an upload (a list of tensors / variables).

        `policy` (default `DomainPolicy.error()`) says how weights are mapped
        into the domain; see the module docstring.  Returns tensors of the
        same shapes and dtypes."""
        policy = DomainPolicy.error() if policy is None else policy
        if not isinstance(policy, DomainPolicy):
            raise ValueError(f"policy must be a DomainPolicy, got {policy!r}")
        weights = list(weights)
        gen = generator if generator is not None else self.generator
        out = []
        for i, w in enumerate(weights):
            x = _as_float(w)
            where = f"weight tensor {i} (shape {x.shape.as_list()})"
            if policy.mode is DomainMode.ERROR:
                out.append(self.perturb(x, gen, where=where))
                continue
            _require_finite(x, self, where)
            c, r = policy.layer_range(i, len(weights))
            dtype = _compute_dtype(x.dtype)
            xc = tf.cast(x, dtype)
            lo, hi = c - r, c + r
            if policy.mode is DomainMode.CLIP:
                xc = tf.clip_by_value(xc, _const(lo, dtype), _const(hi, dtype))
            else:
                _require_in_range(
                    xc,
                    lo,
                    hi,
                    self,
                    where,
                    f"DomainPolicy.scale(bound={r:g}, center={c:g}) maps "
                    f"[{lo:g}, {hi:g}] onto the domain and does not clip; use "
                    "DomainPolicy.clip or a larger public bound",
                )
            out.append(tf.cast(self._perturb_affine(xc, c, r, gen), x.dtype))
        return out

    # -- numpy reference and closed forms ------------------------------------
    @abc.abstractmethod
    def perturb_scalar(self, t: float, rng: np.random.Generator) -> float:
        """Reference: one draw of M(t) in plain numpy, from the paper's description."""

    @abc.abstractmethod
    def mean(self, t: Any) -> np.ndarray:
        """E[M(t)] (closed form)."""

    @abc.abstractmethod
    def variance(self, t: Any) -> np.ndarray:
        """Var[M(t)] (closed form)."""

    @abc.abstractmethod
    def output_range(self, t: Any) -> tuple[np.ndarray, np.ndarray]:
        """(low, high): every output for input t lies in [low, high]."""

    @abc.abstractmethod
    def density(self, y: Any, t: Any) -> np.ndarray:
        """p(y | t): the pdf, or for `discrete` mechanisms the pmf, broadcast over y and t."""

    def _check_scalar_domain(self, t: Any) -> np.ndarray:
        arr = np.asarray(t, dtype=np.float64)
        if not np.all(np.isfinite(arr)):
            raise ValueError(f"{self!r}: input must be finite, got {t!r}")
        domain = self.input_domain()
        if domain is not None and (np.any(arr < domain[0]) or np.any(arr > domain[1])):
            n = int(np.sum((arr < domain[0]) | (arr > domain[1])))
            raise ValueError(
                f"{self!r}: {n} of {arr.size} inputs lie outside the input range "
                f"[{domain[0]:g}, {domain[1]:g}]; {_HINT}"
            )
        return arr

    # -- privacy ----------------------------------------------------------------
    def privacy_report(self, num_coordinates: int, rounds: int = 1) -> "LocalPrivacyReport":
        return privacy_report(self, num_coordinates, rounds)


def _binary_constants(epsilon: float) -> tuple[float, float]:
    """(B, P[+B] slope): B = (a+1)/(a-1), slope (a-1)/(2(a+1)) = 1/(2B)."""
    em1 = math.expm1(epsilon)
    big_b = (em1 + 2.0) / em1
    return big_b, 0.5 / big_b


class DuchiMechanism(LocalDPMechanism):
    """Duchi et al.'s one-dimensional mechanism (Wang et al. ICDE 2019, Alg. 1).

    t in [-1, 1] -> +B w.p. 1/2 + t (a-1)/(2(a+1)), else -B, B = (a+1)/(a-1).
    Unbiased; Var = B^2 - t^2.  p(B|1)/p(B|-1) = a: exactly eps-LDP.
    """

    name = "duchi"
    discrete = True

    @property
    def B(self) -> float:
        return _binary_constants(self.epsilon)[0]

    def _p_plus(self, t):
        big_b, slope = _binary_constants(self.epsilon)
        return 0.5 + slope * t

    def _perturb(self, t, gen):
        big_b, _ = _binary_constants(self.epsilon)
        u = gen.uniform(tf.shape(t), dtype=t.dtype)
        b = _const(big_b, t.dtype)
        return tf.where(u < self._p_plus(t), b, -b)

    def perturb_scalar(self, t, rng):
        t = float(self._check_scalar_domain(t))
        a = self.a
        big_b = (a + 1.0) / (a - 1.0)
        p_plus = 0.5 + t * (a - 1.0) / (2.0 * (a + 1.0))
        return big_b if rng.random() < p_plus else -big_b

    def mean(self, t):
        return self._check_scalar_domain(t).copy()

    def variance(self, t):
        t = self._check_scalar_domain(t)
        return self.B**2 - t**2

    def output_range(self, t):
        t = self._check_scalar_domain(t)
        return np.full_like(t, -self.B), np.full_like(t, self.B)

    def density(self, y, t):
        t = self._check_scalar_domain(t)
        y = np.asarray(y, dtype=np.float64)
        p = self._p_plus(t)
        big_b = self.B
        return np.where(
            np.isclose(y, big_b, rtol=1e-12, atol=0.0),
            p,
            np.where(np.isclose(y, -big_b, rtol=1e-12, atol=0.0), 1.0 - p, 0.0),
        )


class PiecewiseMechanism(LocalDPMechanism):
    """Piecewise Mechanism, Wang et al. ICDE 2019 (Alg. 2, Lemma 1).

    b = e^(eps/2), C = (b+1)/(b-1), l(t) = (C+1)/2 t - (C-1)/2, r(t) = l(t) + C - 1.
    pdf: p = (a - b)/(2b + 2) on [l(t), r(t)] (mass b/(b+1)) and p/a on the rest
    of [-C, C]; so p(y|t)/p(y|t') <= a.  E = t,
    Var = t^2/(b-1) + (b+3)/(3(b-1)^2).
    """

    name = "piecewise"

    @property
    def b(self) -> float:
        return math.exp(self.epsilon / 2.0)

    @property
    def C(self) -> float:
        bm1 = math.expm1(self.epsilon / 2.0)
        return (bm1 + 2.0) / bm1

    def _lr(self, t):
        big_c = self.C
        left = (big_c + 1.0) / 2.0 * t - (big_c - 1.0) / 2.0
        return left, left + big_c - 1.0

    def _perturb(self, t, gen):
        big_c = self.C
        dt = t.dtype
        left, right = self._lr(t)
        shape = tf.shape(t)
        u_piece = gen.uniform(shape, dtype=dt)
        u_pos = gen.uniform(shape, dtype=dt)
        inside = left + _const(big_c - 1.0, dt) * u_pos  # uniform on [l, r]
        v = _const(big_c + 1.0, dt) * u_pos  # uniform on [0, C + 1)
        outside = tf.where(
            v < left + big_c,
            -big_c + v,  # [-C, l)
            right + (v - (left + big_c)),
        )  # (r, C]
        return tf.where(u_piece < _const(self.b / (self.b + 1.0), dt), inside, outside)

    def perturb_scalar(self, t, rng):
        t = float(self._check_scalar_domain(t))
        b = math.exp(self.epsilon / 2.0)
        big_c = (b + 1.0) / (b - 1.0)
        left = (big_c + 1.0) / 2.0 * t - (big_c - 1.0) / 2.0
        right = left + big_c - 1.0
        # three pieces with masses (t+1)/(2(b+1)), b/(b+1), (1-t)/(2(b+1))
        x = rng.random()
        p_left = (t + 1.0) / (2.0 * (b + 1.0))
        p_mid = b / (b + 1.0)
        if x < p_left:
            return float(rng.uniform(-big_c, left))
        if x < p_left + p_mid:
            return float(rng.uniform(left, right))
        return float(rng.uniform(right, big_c))

    def mean(self, t):
        return self._check_scalar_domain(t).copy()

    def variance(self, t):
        t = self._check_scalar_domain(t)
        bm1 = math.expm1(self.epsilon / 2.0)
        return t**2 / bm1 + (bm1 + 4.0) / (3.0 * bm1**2)

    def output_range(self, t):
        t = self._check_scalar_domain(t)
        return np.full_like(t, -self.C), np.full_like(t, self.C)

    def density(self, y, t):
        t = self._check_scalar_domain(t)
        y = np.asarray(y, dtype=np.float64)
        a, b = self.a, self.b
        p = (a - b) / (2.0 * b + 2.0)
        left, right = self._lr(t)
        big_c = self.C
        return np.where(
            (y >= left) & (y <= right), p, np.where((y >= -big_c) & (y <= big_c), p / a, 0.0)
        )


class PNPMMechanism(LocalDPMechanism):
    """Positive-negative piecewise mechanism (PNPM), Ren et al. 2022.

    Randomised input: s = sign(w) in {-1, +1} (w = 0 counts as +1; its upload
    is 0).  C = (a+3)/(a-1); l(s) = (C+1)/2 s - (C-1)/2, r(s) = l(s) + C - 1,
    i.e. [l, r] = [1, C] for s = +1 and [-C, -1] for s = -1.  With probability
    a/(a+1), t* ~ U[l(s), r(s)], else t* ~ U[-r(s), -l(s)]; upload y = |w| t*.
    E[t*] = (C+1)/2 (a-1)/(a+1) s = s, so E[y] = w;
    Var[y] = w^2 (4(a + 1/3)/(a-1)^2) = w^2 (C+2)(C-1)/3.

    What it protects: the density of t* is a/((a+1)(C-1)) on the side of s and
    1/((a+1)(C-1)) on the other, so the SIGN is eps-LDP.  The magnitude is not
    randomised: |y| = |w| U with U ~ U[1, C] independent of s.  One upload
    pins |w| to [|y|/C, |y|] (a factor C = 7.17 at eps = 0.5, 3.33 at eps = 1,
    1.63 at eps = 2), reveals w = 0 exactly, and n uploads of an unchanged |w|
    pin it to [max|y_i|/C, min|y_i|], which shrinks as n grows.  Two weights whose
    magnitudes differ at all are NOT eps-indistinguishable for any finite eps
    (the supports differ); see `pnpm_magnitude_distinguishability`.  Its eps
    is a guarantee for signs only -- not for |w|, and never for the model.
    """

    name = "pnpm"
    protected_input = (
        "the SIGN of each weight only (relative to the public centre); the "
        "magnitude |w| is uploaded times a factor U ~ Uniform[1, C]"
    )

    @property
    def C(self) -> float:
        em1 = math.expm1(self.epsilon)
        return (em1 + 4.0) / em1

    def input_domain(self):
        return None

    def _perturb(self, w, gen):
        dt = w.dtype
        shape = tf.shape(w)
        sign = tf.where(w >= 0, tf.ones_like(w), -tf.ones_like(w))
        keep = gen.uniform(shape, dtype=dt) < _const(self.a / (self.a + 1.0), dt)
        magnitude = 1.0 + _const(self.C - 1.0, dt) * gen.uniform(shape, dtype=dt)  # U[1, C]
        t_star = sign * tf.where(keep, tf.ones_like(w), -tf.ones_like(w)) * magnitude
        return tf.abs(w) * t_star

    def _lr(self, s):
        big_c = self.C
        left = (big_c + 1.0) / 2.0 * s - (big_c - 1.0) / 2.0
        return left, left + big_c - 1.0

    def perturb_scalar(self, t, rng):
        w = float(self._check_scalar_domain(t))
        s = 1.0 if w >= 0 else -1.0
        a = self.a
        big_c = (a + 3.0) / (a - 1.0)
        left = (big_c + 1.0) / 2.0 * s - (big_c - 1.0) / 2.0
        right = left + big_c - 1.0
        if rng.random() < a / (a + 1.0):
            t_star = rng.uniform(left, right)
        else:
            t_star = rng.uniform(-right, -left)
        return abs(w) * float(t_star)

    def mean(self, t):
        return self._check_scalar_domain(t).copy()

    def variance(self, t):
        w = self._check_scalar_domain(t)
        em1 = math.expm1(self.epsilon)
        return w**2 * 4.0 * (em1 + 1.0 + 1.0 / 3.0) / em1**2

    def output_range(self, t):
        """Hull [-C|w|, C|w|]; outputs also satisfy |y| >= |w| (`magnitude_range`)."""
        w = self._check_scalar_domain(t)
        return -self.C * np.abs(w), self.C * np.abs(w)

    def magnitude_range(self, t):
        """[|w|, C|w|]: the range of |upload|, whatever the sign."""
        w = np.abs(self._check_scalar_domain(t))
        return w, self.C * w

    def sign_density(self, t_star, sign):
        """pdf of t* given the sign s in {-1, +1} (the eps-LDP part)."""
        s = np.asarray(sign, dtype=np.float64)
        if not np.all(np.isin(s, (-1.0, 1.0))):
            raise ValueError(f"sign must be -1 or +1, got {sign!r}")
        t_star = np.asarray(t_star, dtype=np.float64)
        a, big_c = self.a, self.C
        left, right = self._lr(s)
        high = a / ((a + 1.0) * (big_c - 1.0))
        low = 1.0 / ((a + 1.0) * (big_c - 1.0))
        return np.where(
            (t_star >= left) & (t_star <= right),
            high,
            np.where((t_star >= -right) & (t_star <= -left), low, 0.0),
        )

    def density(self, y, t):
        """pdf of the upload y = |w| t* given w (w != 0; at w = 0 the upload is the point 0)."""
        w = self._check_scalar_domain(t)
        if np.any(w == 0):
            raise ValueError(
                f"{self!r}: the upload of w = 0 is exactly 0 (a point mass, no density)"
            )
        y = np.asarray(y, dtype=np.float64)
        return self.sign_density(y / np.abs(w), np.sign(w)) / np.abs(w)


class LDPFLMechanism(LocalDPMechanism):
    """LDP-FL's data perturbation, Sun, Qian, Chen (IJCAI 2021).

    Weight w in [c - r, c + r] -> c + r (a+1)/(a-1) with probability
    ((w-c)(a-1) + r(a+1)) / (2r(a+1)), else c - r (a+1)/(a-1).
    E = w, Var = r^2 ((a+1)/(a-1))^2 - (w-c)^2.  Equal in law to
    c + r Duchi((w - c)/r).

    `center` and `radius` are the mechanism's own range (used by `perturb`,
    the closed forms and the default `DomainPolicy.error()`); with a clip or
    scale policy, each layer uses the policy's public (c, r) instead.
    """

    name = "ldp_fl"
    discrete = True

    def __init__(
        self,
        epsilon: float,
        *,
        center: float = 0.0,
        radius: float = 1.0,
        seed: int | None = None,
        generator: tf.random.Generator | None = None,
    ):
        super().__init__(epsilon, seed=seed, generator=generator)
        self.center = check_number("center", center)
        self.radius = check_number("radius", radius, low=0.0, low_open=True)

    def get_config(self):
        return {
            "epsilon": self.epsilon,
            "center": self.center,
            "radius": self.radius,
            "seed": self.seed,
        }

    def input_domain(self):
        return (self.center - self.radius, self.center + self.radius)

    def _ldpfl(self, w, c, r, gen):
        dt = w.dtype
        em1 = math.expm1(self.epsilon)
        a = em1 + 1.0
        c = _const(c, dt)
        r = _const(r, dt)
        p_plus = ((w - c) * _const(em1, dt) + r * _const(a + 1.0, dt)) / (
            2.0 * r * _const(a + 1.0, dt)
        )
        half_width = r * _const((a + 1.0) / em1, dt)
        u = gen.uniform(tf.shape(w), dtype=dt)
        return tf.where(u < p_plus, c + half_width, c - half_width)

    def _perturb(self, w, gen):
        return self._ldpfl(w, self.center, self.radius, gen)

    def _perturb_affine(self, w, center, bound, gen):
        return self._ldpfl(w, center, bound, gen)  # the layer's range is LDP-FL's [c - r, c + r]

    def _half_width(self) -> float:
        return self.radius * _binary_constants(self.epsilon)[0]

    def perturb_scalar(self, t, rng):
        w = float(self._check_scalar_domain(t))
        a, c, r = self.a, self.center, self.radius
        p_plus = ((w - c) * (a - 1.0) + r * (a + 1.0)) / (2.0 * r * (a + 1.0))
        width = r * (a + 1.0) / (a - 1.0)
        return c + width if rng.random() < p_plus else c - width

    def mean(self, t):
        return self._check_scalar_domain(t).copy()

    def variance(self, t):
        w = self._check_scalar_domain(t)
        return self._half_width() ** 2 - (w - self.center) ** 2

    def output_range(self, t):
        w = self._check_scalar_domain(t)
        h = self._half_width()
        return np.full_like(w, self.center - h), np.full_like(w, self.center + h)

    def density(self, y, t):
        w = self._check_scalar_domain(t)
        y = np.asarray(y, dtype=np.float64)
        a, c, r = self.a, self.center, self.radius
        p_plus = ((w - c) * (a - 1.0) + r * (a + 1.0)) / (2.0 * r * (a + 1.0))
        h = self._half_width()
        tol = 1e-12 * max(abs(c) + h, 1.0)
        return np.where(
            np.abs(y - (c + h)) <= tol,
            p_plus,
            np.where(np.abs(y - (c - h)) <= tol, 1.0 - p_plus, 0.0),
        )


class _AdditiveNoiseMechanism(LocalDPMechanism):
    """y = t + zero-mean noise: unbiased, constant variance, unbounded output."""

    @property
    def noise_variance(self) -> float:
        raise NotImplementedError

    def mean(self, t):
        return self._check_scalar_domain(t).copy()

    def variance(self, t):
        t = self._check_scalar_domain(t)
        return np.full_like(t, self.noise_variance)

    def output_range(self, t):
        t = self._check_scalar_domain(t)
        return np.full_like(t, -np.inf), np.full_like(t, np.inf)


class LaplaceMechanism(_AdditiveNoiseMechanism):
    """Textbook Laplace baseline: t in [-1, 1] (sensitivity 2), y = t + Lap(2/eps).

    p(y|t) = exp(-|y - t|/s)/(2s), s = 2/eps; ratio <= exp(2/s) = e^eps.
    E = t, Var = 2 s^2 = 8/eps^2 (Dwork, McSherry, Nissim, Smith 2006).
    """

    name = "laplace"

    @property
    def scale(self) -> float:
        return 2.0 / self.epsilon

    def _perturb(self, t, gen):
        dt = t.dtype
        shape = tf.shape(t)
        # difference of two Exp(1) draws is Laplace(1); -log(1 - U) is finite for U in [0, 1)
        e1 = -tf.math.log1p(-gen.uniform(shape, dtype=dt))
        e2 = -tf.math.log1p(-gen.uniform(shape, dtype=dt))
        return t + _const(self.scale, dt) * (e1 - e2)

    def perturb_scalar(self, t, rng):
        t = float(self._check_scalar_domain(t))
        return t + float(rng.laplace(0.0, 2.0 / self.epsilon))

    @property
    def noise_variance(self) -> float:
        return 2.0 * self.scale**2

    def density(self, y, t):
        t = self._check_scalar_domain(t)
        y = np.asarray(y, dtype=np.float64)
        s = self.scale
        return np.exp(-np.abs(y - t) / s) / (2.0 * s)

    def dp_event(self, num_coordinates: int = 1) -> dp_accounting.DpEvent:
        """d Laplace releases of sensitivity 2 and scale 2/eps: LaplaceDpEvent(1/eps) each."""
        d = check_count("num_coordinates", num_coordinates, minimum=1)
        return dp_accounting.SelfComposedDpEvent(
            dp_accounting.LaplaceDpEvent(1.0 / self.epsilon), d
        )


class GaussianMechanism(_AdditiveNoiseMechanism):
    """Textbook Gaussian baseline: t in [-1, 1] (sensitivity 2), y = t + N(0, (2 sigma)^2).

    Not pure: (eps, delta)-DP per coordinate with eps from the accountant on
    `GaussianDpEvent(sigma)` (the event's multiplier is noise std / sensitivity
    = 2 sigma / 2).  A whole upload of d coordinates is one Gaussian mechanism
    with L2 sensitivity 2 sqrt(d) (two inputs in [-1, 1]^d), i.e.
    `GaussianDpEvent(sigma / sqrt(d))` -- exact, not basic composition.
    E = t, Var = 4 sigma^2.

    Args:
      noise_multiplier: sigma > 0.
      delta: the delta at which `epsilon` (per coordinate) is reported.
      accountant: which `dpfl_tf.privacy` accountant turns events into eps
        ("rdp" by default: fast and an upper bound; "pld" is tighter but can
        need a lot of memory when the effective multiplier is small).
    """

    name = "gaussian"
    pure = False
    protected_input = (
        "each perturbed coordinate ((eps, delta)-indistinguishable for any two "
        "values of the public domain)"
    )

    def __init__(
        self,
        noise_multiplier: float,
        *,
        delta: float = 1e-5,
        accountant: AccountantKind | str = AccountantKind.RDP,
        seed: int | None = None,
        generator: tf.random.Generator | None = None,
    ):
        self.noise_multiplier = check_number(
            "noise_multiplier", noise_multiplier, low=0.0, low_open=True
        )
        self.delta = check_number("delta", delta, low=0.0, high=1.0, low_open=True, high_open=True)
        self.accountant = AccountantKind.parse(accountant)
        eps = compute_epsilon(
            dp_accounting.GaussianDpEvent(self.noise_multiplier), self.delta, self.accountant
        )
        if not math.isfinite(eps) or eps > MAX_EPSILON:
            raise ValueError(
                f"noise_multiplier {self.noise_multiplier:g} gives epsilon {eps:g} "
                f"per coordinate at delta {self.delta:g} (> {MAX_EPSILON:g}); use "
                "more noise"
            )
        super().__init__(eps, seed=seed, generator=generator)

    @classmethod
    def from_epsilon(
        cls,
        epsilon: float,
        *,
        delta: float = 1e-5,
        accountant: AccountantKind | str = AccountantKind.RDP,
        **kwargs,
    ) -> "GaussianMechanism":
        """The least noise whose per-coordinate eps at `delta` is <= `epsilon`."""
        from dpfl_tf.privacy.calibration import calibrate_noise_multiplier

        sigma, _ = calibrate_noise_multiplier(
            _check_epsilon(epsilon),
            delta,
            dp_accounting.GaussianDpEvent,
            accountant,
            tolerance=1e-4,
        )
        return cls(sigma, delta=delta, accountant=accountant, **kwargs)

    def get_config(self):
        return {
            "noise_multiplier": self.noise_multiplier,
            "delta": self.delta,
            "accountant": self.accountant.value,
            "seed": self.seed,
        }

    @property
    def stddev(self) -> float:
        return 2.0 * self.noise_multiplier

    def _perturb(self, t, gen):
        return t + _const(self.stddev, t.dtype) * gen.normal(tf.shape(t), dtype=t.dtype)

    def perturb_scalar(self, t, rng):
        t = float(self._check_scalar_domain(t))
        return t + float(rng.normal(0.0, 2.0 * self.noise_multiplier))

    @property
    def noise_variance(self) -> float:
        return self.stddev**2

    def density(self, y, t):
        t = self._check_scalar_domain(t)
        y = np.asarray(y, dtype=np.float64)
        s = self.stddev
        return np.exp(-0.5 * ((y - t) / s) ** 2) / (s * math.sqrt(2.0 * math.pi))

    def dp_event(self, num_coordinates: int = 1) -> dp_accounting.DpEvent:
        """One upload of d coordinates: GaussianDpEvent(sigma / sqrt(d))."""
        d = check_count("num_coordinates", num_coordinates, minimum=1)
        return dp_accounting.GaussianDpEvent(self.noise_multiplier / math.sqrt(d))


# ---------------------------------------------------------------------------
# Registry

_CLASSES = {
    MechanismKind.DUCHI: DuchiMechanism,
    MechanismKind.PIECEWISE: PiecewiseMechanism,
    MechanismKind.PNPM: PNPMMechanism,
    MechanismKind.LDP_FL: LDPFLMechanism,
    MechanismKind.LAPLACE: LaplaceMechanism,
    MechanismKind.GAUSSIAN: GaussianMechanism,
}


def make_mechanism(kind: MechanismKind | str, epsilon: float, **kwargs) -> LocalDPMechanism:
    """A mechanism by name with per-coordinate budget `epsilon` (Gaussian: calibrated
    at `delta`, default 1e-5)."""
    kind = MechanismKind.parse(kind)
    if kind is MechanismKind.GAUSSIAN:
        return GaussianMechanism.from_epsilon(epsilon, **kwargs)
    return _CLASSES[kind](epsilon, **kwargs)


def out_of_domain_counts(
    weights: Sequence[Any], policy: DomainPolicy, mechanism: LocalDPMechanism | None = None
) -> list[int]:
    """How many entries of each tensor lie outside the policy's range (for the client's
    own diagnostics: these counts depend on private weights -- do not upload them)."""
    weights = [np.asarray(tf.convert_to_tensor(w)) for w in weights]
    out = []
    for i, w in enumerate(weights):
        if policy.mode is DomainMode.ERROR:
            domain = None if mechanism is None else mechanism.input_domain()
            if domain is None:
                out.append(int(np.sum(~np.isfinite(w))))
                continue
            lo, hi = domain
        else:
            c, r = policy.layer_range(i, len(weights))
            lo, hi = c - r, c + r
        out.append(int(np.sum(~np.isfinite(w) | (w < lo) | (w > hi))))
    return out


# ---------------------------------------------------------------------------
# The client's local-DP step (shared by FederatedServer and the Flower ClientApp)


@dataclasses.dataclass(frozen=True)
class LocalDPUpload:
    """A local-DP mechanism applied by the client to what it uploads.

    Args:
      mechanism: any `dpfl_tf.federated.local_dp.LocalDPMechanism`.
      policy: how values are brought into the mechanism's domain (default
        `DomainPolicy.error()`: out-of-domain values raise).
      perturb: ``"weights"`` (default; the local model w_k = w_t + Delta_k is
        perturbed, as in LDP-FL and the local_dp module, and Delta_k' =
        M(w_k) - w_t is uploaded) or ``"update"`` (M(Delta_k) is uploaded).

    Accounting (per client, across rounds): each upload of d coordinates is
    reported with `local_dp.privacy_report(mechanism, d, uploads)`, i.e.
    d*eps per upload and uploads*d*eps in total (basic composition; for the
    Gaussian mechanism also the accountant's exact composition; for PNPM inf,
    the d*eps figures labelled sign-only).
    """

    mechanism: LocalDPMechanism
    policy: DomainPolicy | None = None
    perturb: str = "weights"

    def __post_init__(self):
        if not isinstance(self.mechanism, LocalDPMechanism):
            raise TypeError(
                f"mechanism must be a LocalDPMechanism, got {type(self.mechanism).__name__}"
            )
        if self.policy is not None and not isinstance(self.policy, DomainPolicy):
            raise TypeError(f"policy must be a DomainPolicy, got {type(self.policy).__name__}")
        if self.perturb not in ("weights", "update"):
            raise ValueError(f"perturb must be 'weights' or 'update', got {self.perturb!r}")

    def generator(self, round_index: int, client_id: int) -> tf.random.Generator:
        """OS entropy, or the stream (mechanism.seed, "local-dp", t, k) when the
        mechanism is seeded (tests; `dpfl_tf._seeds.derive_seed`)."""
        seed = self.mechanism.seed
        return make_generator(
            None if seed is None else derive_seed(seed, "local-dp", round_index, client_id)
        )

    def apply(
        self,
        global_weights: Sequence[tf.Tensor],
        update: Sequence[tf.Tensor],
        generator: tf.random.Generator,
    ) -> list[tf.Tensor]:
        if self.perturb == "update":
            return self.mechanism.perturb_weights(update, self.policy, generator=generator)
        local = [w + u for w, u in zip(global_weights, update)]
        noisy = self.mechanism.perturb_weights(local, self.policy, generator=generator)
        return [n - w for n, w in zip(noisy, global_weights)]

    def report(self, num_coordinates: int, uploads: int) -> "LocalPrivacyReport":
        """`privacy_report` of `uploads` uploads of `num_coordinates` coordinates."""
        return privacy_report(self.mechanism, num_coordinates, uploads)

    def get_config(self) -> dict:
        return {
            "mechanism": type(self.mechanism).__name__,
            **self.mechanism.get_config(),
            "policy": None if self.policy is None else self.policy.to_dict(),
            "perturb": self.perturb,
        }

    def metrics(self, num_coordinates: int, uploads: int) -> dict[str, float]:
        """The client's own report after `uploads` uploads (what it has spent)."""
        rep = self.report(num_coordinates, uploads)
        out = {
            "ldp-epsilon-coordinate": float(rep.epsilon_per_coordinate),
            "ldp-epsilon-upload": float(rep.epsilon_per_upload),
            "ldp-epsilon-total": float(rep.epsilon_total),
        }
        if rep.epsilon_per_upload_sign_only is not None:  # PNPM: the upload's eps is inf
            out["ldp-epsilon-upload-sign-only"] = float(rep.epsilon_per_upload_sign_only)
            out["ldp-epsilon-total-sign-only"] = float(rep.epsilon_total_sign_only)
        if isinstance(self.mechanism, GaussianMechanism):
            out["ldp-delta-total"] = float(rep.delta_total)
            out["ldp-accountant-epsilon-total"] = float(rep.accountant_epsilon_total)
        return out


# ---------------------------------------------------------------------------
# Honest privacy reporting

#: The neighbouring relation of a local randomiser: any two inputs of its domain.
LDP_RELATION = "any two values of each coordinate (local DP)"


@dataclasses.dataclass(frozen=True)
class LocalPrivacyReport:
    """What an LDP upload scheme guarantees, in numbers and words.

    ``epsilon_per_upload`` and ``epsilon_total`` are basic composition
    (d * eps and rounds * d * eps; deltas add up the same way) for the whole
    upload, or inf when part of the upload has no finite guarantee
    (``epsilon_infinite_reason`` says why: PNPM's magnitudes).  Then
    ``epsilon_per_upload_sign_only`` / ``epsilon_total_sign_only`` carry the
    basic composition over the part that IS randomised (PNPM: the signs),
    labelled as such.  The ``accountant_*`` fields, when present, are the
    accountant's (eps, delta) for Gaussian noise (exact Gaussian composition),
    at ``accountant_delta``.

    `to_dict` is JSON-ready: non-finite floats become None and are listed in
    ``infinite_fields``; `from_dict` restores them.
    """

    mechanism: str
    num_coordinates: int | None
    rounds: int
    epsilon_per_coordinate: float | None
    epsilon_per_upload: float
    epsilon_total: float
    delta_per_coordinate: float = 0.0
    delta_per_upload: float = 0.0
    delta_total: float = 0.0
    composition: str = "basic"
    accountant: str | None = None
    accountant_delta: float | None = None
    accountant_epsilon_per_upload: float | None = None
    accountant_epsilon_total: float | None = None
    relation: str = LDP_RELATION
    epsilon_per_upload_sign_only: float | None = None
    epsilon_total_sign_only: float | None = None
    epsilon_infinite_reason: str = ""
    protected_input: str = ""
    note: str = ""

    def to_dict(self) -> dict:
        """A JSON-ready dict (inf -> None, named in ``infinite_fields``)."""
        out = dataclasses.asdict(self)
        infinite = [k for k, v in out.items() if isinstance(v, float) and not math.isfinite(v)]
        for k in infinite:
            out[k] = None
        out["infinite_fields"] = infinite
        return out

    @classmethod
    def from_dict(cls, data: dict) -> "LocalPrivacyReport":
        """The inverse of `to_dict` (extra keys, e.g. a server's participation counts,
        are ignored)."""
        names = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in data.items() if k in names}
        for k in data.get("infinite_fields", ()):
            kwargs[k] = math.inf
        return cls(**kwargs)

    def __str__(self) -> str:
        lines = [f"local DP report: {self.mechanism}"]
        if self.epsilon_per_coordinate is not None:
            lines.append(
                f"  per coordinate : eps = {self.epsilon_per_coordinate:.6g}"
                + (
                    f", delta = {self.delta_per_coordinate:.3g}"
                    if self.delta_per_coordinate
                    else ""
                )
            )
        dd = f" (d = {self.num_coordinates})" if self.num_coordinates else ""
        lines.append(
            f"  per upload{dd}: eps = {self.epsilon_per_upload:.6g}"
            + (f", delta = {self.delta_per_upload:.3g}" if self.delta_per_upload else "")
            + f"  [{self.composition}]"
        )
        lines.append(
            f"  over {self.rounds} round(s): eps = {self.epsilon_total:.6g}"
            + (f", delta = {self.delta_total:.3g}" if self.delta_total else "")
        )
        if self.epsilon_infinite_reason:
            lines.append(f"  not finite because: {self.epsilon_infinite_reason}")
        if self.epsilon_per_upload_sign_only is not None:
            lines.append(
                f"  signs only: eps = {self.epsilon_per_upload_sign_only:.6g} per "
                f"upload, {self.epsilon_total_sign_only:.6g} over {self.rounds} "
                "round(s) [basic; NOT a guarantee for the upload]"
            )
        if self.accountant_epsilon_per_upload is not None:
            lines.append(
                f"  {self.accountant} accountant at delta = {self.accountant_delta:.3g}: "
                f"eps per upload = {self.accountant_epsilon_per_upload:.6g}, "
                f"total = {self.accountant_epsilon_total:.6g}"
            )
        lines.append(f"  neighbouring relation: {self.relation}")
        lines.append(f"  protects: {self.protected_input}")
        lines.append(f"  note: {self.note}")
        return "\n".join(lines)


def _model_level_warning(eps_upload: float, eps_total: float) -> str:
    return (
        f"Basic composition over the upload gives eps = {eps_upload:.4g} per upload and "
        f"{eps_total:.4g} over all rounds; an eps this size "
        + ("still bounds little" if eps_total <= 10 else "bounds nothing in practice")
        + ". The per-coordinate eps is NOT a guarantee for the model or the client's data "
        "as a whole."
    )


def privacy_report(
    mechanism: LocalDPMechanism, num_coordinates: int, rounds: int = 1
) -> LocalPrivacyReport:
    """Per-coordinate, per-upload (d coordinates) and total (rounds uploads) budget.

    Args:
      mechanism: the local randomiser applied to every uploaded coordinate.
      num_coordinates: d, the number of perturbed coordinates per upload.
      rounds: the number of rounds the client takes part in (uploads).
    """
    if not isinstance(mechanism, LocalDPMechanism):
        raise ValueError(f"mechanism must be a LocalDPMechanism, got {mechanism!r}")
    d = check_count("num_coordinates", num_coordinates, minimum=1)
    rounds = check_count("rounds", rounds, minimum=1)
    eps = mechanism.epsilon
    eps_upload, eps_total = d * eps, rounds * d * eps
    common = dict(
        mechanism=repr(mechanism),
        num_coordinates=d,
        rounds=rounds,
        epsilon_per_coordinate=eps,
        epsilon_per_upload=eps_upload,
        epsilon_total=eps_total,
        protected_input=mechanism.protected_input,
    )
    domain_note = (
        " The guarantee is for inputs in the public domain (after clip/scale with a "
        "bound and centre fixed without looking at private data)."
    )
    if isinstance(mechanism, GaussianMechanism):
        delta = mechanism.delta
        upload_event = mechanism.dp_event(d)
        acc_upload = compute_epsilon(upload_event, delta, mechanism.accountant)
        acc_total = compute_epsilon(
            dp_accounting.SelfComposedDpEvent(upload_event, rounds), delta, mechanism.accountant
        )
        basic_delta_upload = min(1.0, d * delta)
        basic_delta_total = min(1.0, rounds * d * delta)
        note = (
            f"Each coordinate is ({eps:.4g}, {delta:.3g})-DP (Gaussian, noise multiplier "
            f"{mechanism.noise_multiplier:g} on sensitivity 2). Basic composition: "
            f"({eps_upload:.4g}, {basic_delta_upload:.3g}) per upload and ({eps_total:.4g}, "
            f"{basic_delta_total:.3g}) in total. Exact Gaussian composition (the upload is "
            f"one Gaussian mechanism, L2 sensitivity 2 sqrt(d)): eps = {acc_upload:.4g} per "
            f"upload and {acc_total:.4g} over {rounds} round(s) at delta = {delta:.3g} "
            f"({mechanism.accountant.value} accountant); report these. They bound what the "
            "uploads reveal about the client's (clipped or scaled) weights, nothing more."
            + domain_note
        )
        return LocalPrivacyReport(
            **common,
            delta_per_coordinate=delta,
            delta_per_upload=basic_delta_upload,
            delta_total=basic_delta_total,
            composition="basic",
            accountant=mechanism.accountant.value,
            accountant_delta=delta,
            accountant_epsilon_per_upload=acc_upload,
            accountant_epsilon_total=acc_total,
            note=note,
        )
    if isinstance(mechanism, PNPMMechanism):
        big_c = mechanism.C
        reason = (
            f"PNPM uploads each weight's magnitude as |w| U, U ~ Uniform[1, {big_c:.4g}], "
            "whatever its sign: two different magnitudes have different supports, so no "
            "finite eps covers the upload (or the client)"
        )
        note = (
            f"PNPM randomises only the sign of each weight: each sign is {eps:.4g}-LDP. "
            f"The magnitude enters the upload as |w| U with U ~ Uniform[1, C], C = "
            f"(e^eps+3)/(e^eps-1) = {big_c:.4g}, independent of the sign: one upload reveals "
            f"|w| to within a factor {big_c:.4g} (|w| in [|y|/C, |y|]), reveals w = 0 "
            "exactly, and repeated uploads of a slowly changing weight narrow |w| further. "
            "No eps guarantee covers |w| (two different magnitudes are not "
            "eps-indistinguishable for any finite eps), so the upload's eps is inf. "
            f"Basic composition over the signs alone gives {eps_upload:.4g} per upload and "
            f"{eps_total:.4g} over {rounds} round(s): a figure for the signs, not for the "
            "model or the client's data."
        )
        return LocalPrivacyReport(
            **{**common, "epsilon_per_upload": math.inf, "epsilon_total": math.inf},
            epsilon_per_upload_sign_only=eps_upload,
            epsilon_total_sign_only=eps_total,
            epsilon_infinite_reason=reason,
            note=note,
        )
    note = (
        f"Each coordinate is {eps:.4g}-LDP."
        + domain_note
        + " "
        + _model_level_warning(eps_upload, eps_total)
    )
    if isinstance(mechanism, LDPFLMechanism):
        note += (
            " LDP-FL's splitting and shuffling of uploads is not implemented; no "
            "amplification from it is claimed."
        )
    return LocalPrivacyReport(**common, note=note)


def gaussian_upload_report(
    noise_multiplier: float,
    rounds: int = 1,
    *,
    delta: float = 1e-5,
    accountant: AccountantKind | str = AccountantKind.RDP,
) -> LocalPrivacyReport:
    """Local Gaussian noise on an L2-clipped upload: clip the whole update to norm S,
    add N(0, z^2 S^2) to every coordinate (the client side of DP-FedAvg).

    The one place the guarantee of such uploads is computed: the in-process
    server's ``privacy_report()["against_server"]``, the Flower client's
    metrics and the CLI all call it.

    The receiver sees this one upload and knows who sent it, so the relation is
    replace-one (`dpfl_tf.privacy.events.REPLACE_ONE_UPDATE`): any two clipped
    updates differ by up to 2S in L2 norm, and one upload is the Gaussian
    mechanism with multiplier z/2, `clipped_upload_event(z)` =
    ``GaussianDpEvent(z/2)``, (eps, delta)-DP with eps from the accountant;
    `rounds` uploads compose (``SelfComposedDpEvent``).  (The central
    add/remove-one-client view, multiplier z, is NOT the guarantee against the
    receiver.)  z = 0 is reported as eps = inf.
    """
    sigma = check_number("noise_multiplier", noise_multiplier, low=0.0)
    rounds = check_count("rounds", rounds, minimum=1)
    delta = check_number("delta", delta, low=0.0, high=1.0, low_open=True, high_open=True)
    kind = AccountantKind.parse(accountant)
    event = clipped_upload_event(sigma)
    eps_upload = compute_epsilon(event, delta, kind)
    eps_total = compute_epsilon(dp_accounting.SelfComposedDpEvent(event, rounds), delta, kind)
    if sigma == 0:
        note = (
            "No noise: each upload is the client's clipped update itself; no finite eps "
            "holds against its receiver."
        )
    else:
        note = (
            f"One L2-clipped upload with noise multiplier {sigma:g} is ({eps_upload:.4g}, "
            f"{delta:.3g})-DP against its receiver for the whole upload (replace-one: any "
            f"two clipped uploads differ by up to 2S, GaussianDpEvent({sigma / 2:g})); "
            f"{rounds} upload(s) compose to ({eps_total:.4g}, {delta:.3g}) ({kind.value} "
            "accountant). This is a guarantee for the client's whole update, not per "
            "coordinate."
        )
    return LocalPrivacyReport(
        mechanism=f"gaussian on L2-clipped upload (noise_multiplier={sigma:g})",
        num_coordinates=None,
        rounds=rounds,
        epsilon_per_coordinate=None,
        epsilon_per_upload=eps_upload,
        epsilon_total=eps_total,
        delta_per_upload=delta,
        delta_total=delta,
        composition=f"{kind.value} accountant",
        accountant=kind.value,
        accountant_delta=delta,
        accountant_epsilon_per_upload=eps_upload,
        accountant_epsilon_total=eps_total,
        relation=REPLACE_ONE_UPDATE,
        protected_input="the whole clipped upload (any two uploads of norm <= S)",
        note=note,
    )


def pnpm_magnitude_distinguishability(epsilon: float, ratio: float) -> float:
    """Total-variation distance between PNPM's |upload| for magnitudes m and k m.

    |y| = m U with U ~ Uniform[1, C], C = (e^eps+3)/(e^eps-1), whatever the sign.
    For 1 <= k <= C the two uniform laws on [m, Cm] and [km, kCm] overlap on
    [km, Cm] and TV = 1 - (C - k)/(k (C - 1)); for k >= C they are disjoint and
    TV = 1 (the magnitudes are told apart with certainty from one upload).
    An adversary distinguishes the two magnitudes with advantage TV; no finite
    eps bounds the density ratio (the supports differ).
    """
    eps = _check_epsilon(epsilon)
    k = check_number("ratio", ratio, low=1.0)
    em1 = math.expm1(eps)
    big_c = (em1 + 4.0) / em1
    if k >= big_c:
        return 1.0
    return 1.0 - (big_c - k) / (k * (big_c - 1.0))
