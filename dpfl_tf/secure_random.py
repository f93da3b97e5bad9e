"""Secure mode: randomness for DP noise and sampling that resists known attacks.

Two implementation attacks break textbook DP noise even when the analysis is right:

1. *Predictable randomness.*  Noise from a generator whose seed (or state) an
   attacker can guess or read can be subtracted.  Secure mode keys every
   generator from the operating system's cryptographically secure source
   (`secrets`, i.e. ``os.urandom``), keeps the key in process memory only (it is
   never saved with a model or a checkpoint), and refuses a user seed.  The
   in-graph generator is Philox-4x32-10 (Salmon et al. 2011), a counter-based
   generator built from a cipher-like round function.  DP-SGD's per-lot noise
   is drawn statelessly from a seed of two 63-bit words from `secrets` (126
   secret bits) folded with the public lot index; the stateful generator of
   the federated aggregators is keyed with 63 secure bits and started at a
   126-bit secure counter.  Philox is not a proven
   CSPRNG: an attacker who sees many raw outputs might in principle learn the
   key.  A DP release exposes no raw outputs (only noise added to data), which
   is the threat model Opacus's secure mode also assumes.
   Sampling decisions (Poisson lots, client sampling) are drawn on the host
   directly from ``os.urandom`` (`secure_uniform`), 53 bits per decision.

2. *Floating-point attacks* (Mironov 2012 for the Laplace mechanism; Jin,
   McMurtry, Rubinstein, Ohrimenko 2022 for the Gaussian): a textbook sampler
   turns a few uniform floats into a normal by Box-Muller; in floating point
   the set of values ``x + noise`` can take is a sparse lattice that depends on
   ``x``, so an observed release can rule out inputs.  Following the remedy
   Holohan & Braghin 2021 analyse (and Opacus's ``secure_mode``), a secure
   sample is the normalised sum of four independent draws,

       Z = (Z_1 + Z_2 + Z_3 + Z_4) / 2 ~ N(0, 1),

   drawn and summed in float64 and added to the value in float64 before the
   one rounding to the release's float32.  The sum of four independent draws
   has no lattice structure at float64 resolution (each draw shifts the others
   by an independent amount), and float64 carries 29 more mantissa bits than
   the float32 released: every float32 near ``x + s Z`` is reachable from every
   nearby ``x``, which is what the attacks exploit the absence of.  This is an
   engineering defence with a published rationale, not a proof.

Cost: four float64 normals instead of one float32 normal per noised
coordinate (measured in ``experiments/benchmark_dpsgd.py --secure``), and one
``os.urandom`` call per lot for sampling.
"""

from __future__ import annotations

import os
import secrets

import numpy as np

# TensorFlow is imported inside the functions that draw with it: the seed check
# and the host-side uniforms are used by modules the CLI loads before TensorFlow

__all__ = [
    "secure_generator",
    "secure_key",
    "secure_add_noise",
    "secure_normal64",
    "secure_uniform",
    "refuse_seed",
    "SECURE_DRAWS",
]

SECURE_DRAWS = 4  # Z = sum of four N(0, 1) draws / 2


def refuse_seed(secure_mode: bool, seed, name: str = "seed") -> None:
    """In secure mode a seed (of noise or sampling) is an error: the randomness
    must come from the OS's secure source."""
    if secure_mode and seed is not None:
        raise ValueError(
            f"secure_mode=True refuses a seed (got {name}={seed!r}): secure "
            "noise and sampling must come from the OS's secure source"
        )


def secure_key() -> int:
    """63 bits from the OS's secure source (fits TensorFlow's int64 seeds)."""
    return secrets.randbits(63)


def secure_generator():
    """A Philox `tf.random.Generator` keyed and positioned from the OS's secure source."""
    import tensorflow as tf

    return tf.random.Generator.from_key_counter(
        key=secure_key(), counter=[secure_key(), secure_key()], alg="philox"
    )


def secure_add_noise(value, generator, stddev, *, seed=None):
    """value + s Z computed in float64 and rounded once to value's dtype (module
    doc); Z from `generator` (a `tf.random.Generator`), or statelessly from `seed`
    (a shape-[2] int64 tensor) when `generator` is None."""
    import tensorflow as tf

    noise = _secure_noise64(generator, tf.shape(value), stddev, seed)
    return tf.cast(tf.cast(value, tf.float64) + noise, value.dtype)


def secure_normal64(shape, stddev, *, seed):
    """s Z in float64, Z the normalised sum of four standard normals drawn
    statelessly from `seed` (a shape-[2] int64 tensor): the secure sample of
    this module's docstring, before any rounding (correlated noise adds it to
    float64 buffers and rounds once, `dpfl_tf.correlated_noise`)."""
    return _secure_noise64(None, shape, stddev, seed)


def _secure_noise64(generator, shape, stddev, seed):
    import tensorflow as tf

    shape = tf.concat([[SECURE_DRAWS], tf.cast(shape, tf.int32)], 0)
    if generator is not None:
        draws = generator.normal(shape, dtype=tf.float64)
    else:
        draws = tf.random.stateless_normal(shape, seed=seed, dtype=tf.float64, alg="philox")
    return tf.cast(stddev, tf.float64) * tf.reduce_sum(draws, axis=0) / 2.0


def secure_uniform(n: int) -> np.ndarray:
    """n independent uniforms on [0, 1) with 53 random bits each, from ``os.urandom``."""
    n = int(n)
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    words = np.frombuffer(os.urandom(8 * n), dtype=np.uint64) >> np.uint64(11)
    return words.astype(np.float64) * (2.0**-53)


def secure_words(n: int) -> np.ndarray:
    """n independent uniform integers in [0, 2^53) (uint64) from ``os.urandom``: the
    random words of the exact discrete Gaussian sampler (`dpfl_tf.discrete_noise`)."""
    n = int(n)
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    return np.frombuffer(os.urandom(8 * n), dtype=np.uint64) >> np.uint64(11)


def secure_numpy_generator() -> np.random.Generator:
    """A numpy Philox generator keyed with 128 bits from the OS's secure source (never
    saved): for samplers numpy provides and TensorFlow does not (Skellam's Poisson)."""
    return np.random.Generator(np.random.Philox(key=secrets.randbits(128)))
