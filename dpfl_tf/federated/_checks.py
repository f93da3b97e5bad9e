"""The federated rules that tie two settings together, written once.

`FederatedConfig.__post_init__` applies them when a configuration is made
(so the CLI, experiments and Flower refuse it before any data is loaded);
`ClientSampling` and `FederatedServer` apply the same functions for callers
that build them directly.  Nothing here imports TensorFlow.
"""

from __future__ import annotations

__all__ = ["check_clients_per_round", "check_delta_max"]


def check_clients_per_round(m: int, num_clients: int) -> int:
    """m clients per round out of K: m <= K."""
    if m > num_clients:
        raise ValueError(f"clients_per_round (m={m}) must be <= the number of clients "
                         f"(K={num_clients})")
    return m


def check_delta_max(delta_max: float, num_clients: int) -> float:
    """The delta of a client-level guarantee over K clients: delta_max < 1/K (a
    mechanism that releases one client's data outright is (0, 1/K)-DP, so delta
    must stay well below 1/K; delta << 1/K is the usual rule)."""
    if delta_max >= 1.0 / num_clients:
        raise ValueError(f"delta_max must be < 1/K = {1.0 / num_clients:g} (delta << 1/K), "
                         f"got {delta_max:g}")
    return delta_max
