"""The seeding helper: one derivation of per-purpose seeds (hash of seed, purpose,
indices), stable across processes and versions, independent per purpose."""

import subprocess
import sys

import numpy as np
import pytest

from dpfl_tf._seeds import derive_rng, derive_seed


def test_streams_differ_by_seed_purpose_and_indices_and_fit_in_63_bits():
    seeds = {
        derive_seed(0, "client-sampling", 0),
        derive_seed(1, "client-sampling", 0),
        derive_seed(0, "local-shuffle", 0),
        derive_seed(0, "client-sampling", 1),
        derive_seed(0, "client-sampling", 0, 0),
        derive_seed(0, "client-sampling", 10),
        derive_seed(-1, "client-sampling", 0),
    }
    assert len(seeds) == 7
    assert all(0 <= s < 2**63 for s in seeds)
    # ("1", "0") and ("10",) must not collide through concatenation
    assert derive_seed(0, "x", 1, 0) != derive_seed(0, "x", 10)
    assert derive_seed(np.int64(3), "x", np.int32(2)) == derive_seed(3, "x", 2)


def test_the_same_seed_in_another_process_and_a_pinned_value():
    code = "from dpfl_tf._seeds import derive_seed; print(derive_seed(7, 'server-noise', 3))"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert int(out) == derive_seed(7, "server-noise", 3)
    # pinned: a change of the derivation changes every seeded run, so it must be deliberate
    assert derive_seed(0, "client-sampling", 0) == 8163809310054442189
    np.testing.assert_array_equal(
        derive_rng(5, "p", 1).random(3), np.random.default_rng(derive_seed(5, "p", 1)).random(3)
    )


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="purpose must be a non-empty string, got ''"):
        derive_seed(0, "")
    with pytest.raises(TypeError, match="seed must be an integer, got 1.5"):
        derive_seed(1.5, "x")
    with pytest.raises(TypeError, match=r"indices\[1\] must be an integer, got 'a'"):
        derive_seed(0, "x", 1, "a")


def test_the_dp_sgd_noise_key_is_derived_here_and_pinned():
    from dpfl_tf import sanitizer
    from dpfl_tf._seeds import noise_key

    assert sanitizer.seeded_noise_key is noise_key  # one derivation, used by the sanitizer
    # pinned: the seeded results the project records were drawn with this key
    assert noise_key(0) == (3932270914786768106, 2908678251386947380)
    assert len({noise_key(s) for s in range(-3, 100)}) == 103
    assert all(0 <= w < 2**63 for s in (0, 1, 2**62) for w in noise_key(s))
    with pytest.raises(TypeError, match="seed must be an integer"):
        noise_key(0.5)
