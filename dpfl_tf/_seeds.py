"""One derivation of per-purpose seeds from a run's seed.

A seeded run draws from several independent streams (which clients a round
samples, how a client shuffles its examples, the server's noise, a client's
noise, ...).  Each stream's seed is a hash of the run's seed, the stream's
purpose and its indices (round, client, ...):

    derive_seed(seed, purpose, *indices) = first 63 bits of
        BLAKE2b("dpfl_tf" | seed | purpose | index_1 | ... | index_n)

so two purposes never share a stream, a stream does not depend on how many
draws another stream made, and a run resumed at round t draws exactly what
the uninterrupted run drew there.  Seeds are for tests and reproducible
experiments: a deployment draws DP noise from OS entropy (see
`dpfl_tf.sanitizer.deployment_note`).

Nothing here imports TensorFlow.
"""

from __future__ import annotations

import hashlib
import operator

import numpy as np

__all__ = ["derive_seed", "derive_rng"]

_PERSON = b"dpfl_tf.seeds"  # BLAKE2b personalisation: these hashes are ours alone


def _int(name: str, value) -> int:
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an integer, got {value!r}") from None


def derive_seed(seed: int, purpose: str, *indices: int) -> int:
    """A seed in [0, 2^63) for the stream `purpose` at `indices` of a run seeded
    with `seed` (module docstring).  `seed` and the indices are integers (any
    sign); `purpose` is a non-empty string such as ``"client-sampling"``."""
    if not isinstance(purpose, str) or not purpose:
        raise ValueError(f"purpose must be a non-empty string, got {purpose!r}")
    parts = [str(_int("seed", seed)), purpose]
    parts += [str(_int(f"indices[{i}]", v)) for i, v in enumerate(indices)]
    digest = hashlib.blake2b("\x1f".join(parts).encode(), digest_size=8, person=_PERSON).digest()
    return int.from_bytes(digest, "big") >> 1


def derive_rng(seed: int, purpose: str, *indices: int) -> np.random.Generator:
    """A numpy generator seeded with `derive_seed(seed, purpose, *indices)`."""
    return np.random.default_rng(derive_seed(seed, purpose, *indices))
