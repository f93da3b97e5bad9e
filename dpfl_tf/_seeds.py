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

The seeded streams, and where each seed comes from:

- ``derive_seed(seed, purpose, *indices)``: the federated streams (client
  sampling, local shuffles, server and client noise, count noise, rotations,
  dropouts), the augmentation key and the CIFAR-10 recipes' data subsets;
- ``derive_seed(seed, purpose, *indices) >> 32``: the private search of
  ``dpfl-tf train --tune`` (`dpfl_tf.recipes.tune`: the number of trials,
  the score's noise, and each trial's recipe seed);
- ``noise_key(seed)``: DP-SGD's noise (`dpfl_tf.sanitizer`), two 63-bit words,
  the Philox key of the stateless per-lot noise;
- the seed itself, as a Philox key: lot sampling (`LotSampler`, folded with
  the stream and the lot) and `sanitizer.make_generator`;
- ``numpy.random.default_rng`` of the seed (and indices): DP-PCA's noise
  (`dpfl_tf.pca`), CIFAR-10's public/private split (``split_seed``), user-level
  lots (`UserLotSampler`: ``[seed, t]``), the distributed-DP sources
  (`federated.distributed_dp`: ``[noise seed, round, client]``, the rotation
  signs), private tuning (`dpfl_tf.tuning`) and the audits (`dpfl_tf.audit`);
- ``keras.utils.set_random_seed(seed)``: the recipes' weight initialisation,
  dropout and Keras's shuffles;
- ``random.Random(seed)``: the initializer seeds of the federated models, with
  seed ``derive_seed(config seed, "model-init") >> 31``
  (`dpfl_tf.models.glorot_uniform_kernels`; the draws ``set_random_seed`` made from the
  global `random`, kept private: Flower's threads draw from that one).

These keep their derivation: every seeded result the project records
(results/, docs/results/) and the shipped pretrained weights were drawn with
them, and each is a generator of its own (a distinct key or a distinct
SeedSequence entropy), not a stream shared with another purpose.

Nothing here imports TensorFlow.
"""

from __future__ import annotations

import hashlib
import operator

import numpy as np

__all__ = ["derive_seed", "derive_rng", "noise_key"]

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


def noise_key(seed: int) -> tuple[int, int]:
    """The 2 x 63-bit key of a seeded run's DP-SGD noise: both words hashed from
    the seed (BLAKE2b).  The key (seed, 0) made the streams of nearby seeds
    overlap: lot t of seed s drew seed [s XOR t, j], so seed 1's lot 0 was seed
    2's lot 3, and runs told apart only by their seeds shared noise."""
    digest = hashlib.blake2b(
        f"dpfl_tf noise key {_int('seed', seed)}".encode(), digest_size=16
    ).digest()
    return (
        int.from_bytes(digest[:8], "little") % 2**63,
        int.from_bytes(digest[8:], "little") % 2**63,
    )
