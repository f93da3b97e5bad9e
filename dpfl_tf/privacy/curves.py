"""Epsilon versus training length for several accountants (Abadi et al. 2016,
Figure 2: moments accountant vs strong composition, plus RDP and PLD)."""

from __future__ import annotations

from typing import Sequence

from dpfl_tf.privacy.accountants import AccountantKind, compute_epsilon
from dpfl_tf.privacy.events import dp_sgd_event

__all__ = ["epsilon_curves"]

ALL_ACCOUNTANTS = tuple(k.value for k in AccountantKind)


def epsilon_curves(
    sampling_rate: float,
    noise_multiplier: float,
    delta: float,
    epochs: Sequence[float],
    accountants: Sequence[str] = ALL_ACCOUNTANTS,
) -> dict:
    """{"epochs": [...], "steps": [...], "<accountant>": [eps, ...], ...} for
    Poisson-sampled DP-SGD with T = round(epochs / q) steps."""
    steps = [int(round(e / sampling_rate)) for e in epochs]
    out: dict = {
        "sampling_rate": sampling_rate,
        "noise_multiplier": noise_multiplier,
        "delta": delta,
        "epochs": list(epochs),
        "steps": steps,
    }
    for name in accountants:
        kind = AccountantKind.parse(name)
        out[kind.value] = [
            compute_epsilon(
                dp_sgd_event(noise_multiplier, t, sampling_rate=sampling_rate), delta, kind
            )
            if t > 0
            else 0.0
            for t in steps
        ]
    return out
