"""Federated settings that must be known before TensorFlow loads: the local-DP
and distributed-DP mechanism names and the rules that tie two settings together, written once.

`FederatedConfig.__post_init__` applies the rules when a configuration is made
(so the CLI, experiments and Flower refuse it before any data or TensorFlow is
loaded); `ClientSampling` and `FederatedServer` apply the same functions for
callers that build them directly.  Nothing here imports TensorFlow.
"""

from __future__ import annotations

from dpfl_tf._validation import ChoiceEnum

__all__ = [
    "MAX_EPSILON",
    "DistributedMechanism",
    "MechanismKind",
    "check_clients_per_round",
    "check_delta_max",
]

#: eps above this makes e^eps overflow the constants' useful precision; such a
#: budget protects nothing anyway.
MAX_EPSILON = 50.0


class DistributedMechanism(ChoiceEnum):
    """The noise each client adds to its integer vector
    (`dpfl_tf.federated.distributed_dp`)."""

    __argument__ = "mechanism"
    __aliases__ = {
        "ddg": "discrete_gaussian",
        "dgauss": "discrete_gaussian",
        "distributed_discrete_gaussian": "discrete_gaussian",
        "distributed_skellam": "skellam",
    }
    DISCRETE_GAUSSIAN = "discrete_gaussian"
    SKELLAM = "skellam"


class MechanismKind(ChoiceEnum):
    """The local-DP randomisers of `dpfl_tf.federated.local_dp`."""

    __argument__ = "mechanism"
    __aliases__ = {"pm": "piecewise", "ldpfl": "ldp_fl"}
    DUCHI = "duchi"
    PIECEWISE = "piecewise"
    PNPM = "pnpm"
    LDP_FL = "ldp_fl"
    LAPLACE = "laplace"
    GAUSSIAN = "gaussian"


def check_clients_per_round(m: int, num_clients: int) -> int:
    """m clients per round out of K: m <= K."""
    if m > num_clients:
        raise ValueError(
            f"clients_per_round (m={m}) must be <= the number of clients (K={num_clients})"
        )
    return m


def check_delta_max(delta_max: float, num_clients: int) -> float:
    """The delta of a client-level guarantee over K clients: delta_max < 1/K (a
    mechanism that releases one client's data outright is (0, 1/K)-DP, so delta
    must stay well below 1/K; delta << 1/K is the usual rule)."""
    if delta_max >= 1.0 / num_clients:
        raise ValueError(
            f"delta_max must be < 1/K = {1.0 / num_clients:g} (delta << 1/K), got {delta_max:g}"
        )
    return delta_max
