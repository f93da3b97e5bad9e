"""The federated round loop (FedAvg, McMahan et al. 2017, Algorithm 1) with
client-level DP accounting (Geyer, Klein, Nabi 2017, Algorithm 1).

Each round t:

1. the privacy check: with a target epsilon, if recording this round's event
   would make delta(target eps) exceed delta_max, stop *before* the round
   (Geyer et al. stop once delta would pass their bound);
2. sample clients: Poisson (each of K clients independently with rate q =
   m/K or a fraction C) or m without replacement (fixed size);
3. broadcast w_t, train each sampled client locally (`LocalTrainer`), collect
   uploads (the aggregator's client-side step applied), aggregate, and move
   the model by the released aggregate Delta with the server optimiser
   (`ServerOptimizer`; by default FedAvg's w_{t+1} = w_t + Delta), and with a
   `ModelAverage` average the released models (the model the server releases);
4. record the round's `DpEvent` in the `PrivacyLedger` (one event per round,
   matching how clients were really sampled), evaluate on the server's test
   set, write the checkpoint.

Every stream is derived with `dpfl_tf._seeds.derive_seed` from (seed, purpose,
round, client): client sampling (keyed also by a secret drawn from OS entropy
unless `noise_seed` is given), each client's batch order, and -- with
`noise_seed` (tests) -- the server's and each client's noise.  A run resumed
from a checkpoint therefore draws what the uninterrupted run drew; without
`noise_seed` the DP noise comes from OS entropy.

`open_round`, `client_upload`, `close_round` and `finish` are the round in
named parts; the Flower strategy calls the same methods.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import math
import os
import secrets
import sys
import time
from typing import Any, Sequence

import dp_accounting
import numpy as np
import tensorflow as tf

from dpfl_tf._io import atomic_write, atomic_write_json, read_checkpoint_json
from dpfl_tf._seeds import derive_rng, derive_seed
from dpfl_tf._validation import check_count, check_number
from dpfl_tf.federated.aggregators import (
    AggregateResult,
    Aggregator,
    ClientNoiseDPAggregator,
    GlobalDPAggregator,
)
from dpfl_tf.federated.client import LocalTrainer, preprocess_images, refuse_unprotected_state
from dpfl_tf.federated.local_dp import LocalDPUpload, gaussian_upload_report
from dpfl_tf.federated.partition import ClientPartition
from dpfl_tf.federated.server_optimizers import ModelAverage, ServerOptimizer
from dpfl_tf.federated.settings import check_clients_per_round, check_delta_max
from dpfl_tf.privacy.accountants import AccountantKind, compute_delta, compute_epsilon
from dpfl_tf.privacy.events import SamplingMethod, describe_event
from dpfl_tf.privacy.ledger import PrivacyBudget, PrivacyLedger
from dpfl_tf.secure_random import refuse_seed, secure_uniform

__all__ = ["ClientSampling", "FederatedServer", "RoundRecord"]

CHECKPOINT_FORMAT = 1


def _differences(saved: dict, mine: dict, prefix: str = "") -> list[str]:
    """The keys where two fingerprints differ, one level down as ``outer.inner``
    (``local_training.momentum``)."""
    out = []
    for k in sorted(set(saved) | set(mine)):
        a, b = saved.get(k), mine.get(k)
        if a == b:
            continue
        if not prefix and isinstance(a, dict) and isinstance(b, dict) and a and b:
            out += _differences(a, b, f"{k}.")
        else:
            out.append(f"{prefix}{k}")
    return out


#: what checkpoints written before server optimisers existed ran: FedAvg's w + Delta
LEGACY_SERVER_OPTIMIZER = {"kind": "sgd", "learning_rate": 1.0, "momentum": 0.0}

#: The neighbouring relation of the released model, by client sampling scheme
#: (`dpfl_tf.privacy.events`): Poisson -> add/remove one client, m of K without
#: replacement -> replace one client.
RELATIONS = {
    SamplingMethod.POISSON: "add/remove-one client (Poisson client sampling)",
    SamplingMethod.FIXED_SIZE: "replace-one client (fixed-size client sampling)",
    SamplingMethod.CYCLIC_POISSON: "add/remove-one client (cyclic cohorts by client "
    "id; correlated noise)",
}


@dataclasses.dataclass(frozen=True)
class ClientSampling:
    """How the clients of a round are chosen.

    Exactly one of `clients_per_round` (m) and `fraction` (C) is given.
    ``POISSON``: every client joins independently with q = m/K (or C);
    ``FIXED_SIZE``: m = clients_per_round (or round(C K), at least 1) drawn
    uniformly without replacement.
    ``CYCLIC_POISSON`` (correlated noise only): client k belongs to cohort
    k mod b (b = `cohorts`); round t takes each client of cohort t mod b with
    probability q = `fraction` (1: the whole cohort).  A client's rounds are
    then at least b apart (`participation`), whoever else there is: the
    add/remove-one relation holds.
    """

    method: SamplingMethod = SamplingMethod.POISSON
    clients_per_round: int | None = None
    fraction: float | None = None
    cohorts: int | None = None

    def __post_init__(self):
        method = SamplingMethod.parse(self.method)
        allowed = (SamplingMethod.POISSON, SamplingMethod.FIXED_SIZE, SamplingMethod.CYCLIC_POISSON)
        if method not in allowed:
            raise ValueError(
                f"client sampling must be 'poisson', 'fixed_size' or "
                f"'cyclic_poisson', got {method.value!r}"
            )
        object.__setattr__(self, "method", method)
        if method is SamplingMethod.CYCLIC_POISSON:
            if self.cohorts is None or self.clients_per_round is not None:
                raise ValueError(
                    "client sampling 'cyclic_poisson' takes cohorts (b) and "
                    "fraction (q within the cohort), got "
                    f"cohorts={self.cohorts!r}, "
                    f"clients_per_round={self.clients_per_round!r}"
                )
            object.__setattr__(self, "cohorts", check_count("cohorts", self.cohorts, minimum=1))
        elif self.cohorts is not None:
            raise ValueError(
                f"cohorts is for client sampling 'cyclic_poisson' only, got "
                f"cohorts={self.cohorts!r} with {method.value!r}"
            )
        if (self.clients_per_round is None) == (self.fraction is None):
            raise ValueError(
                "give exactly one of clients_per_round and fraction, got "
                f"clients_per_round={self.clients_per_round!r}, "
                f"fraction={self.fraction!r}"
            )
        if self.clients_per_round is not None:
            object.__setattr__(
                self,
                "clients_per_round",
                check_count("clients_per_round", self.clients_per_round, minimum=1),
            )
        else:
            object.__setattr__(
                self,
                "fraction",
                check_number("fraction", self.fraction, low=0.0, high=1.0, low_open=True),
            )

    def cohort_of(self, client_id) -> int:
        """The cohort of a client (cyclic sampling): its id mod b."""
        return int(client_id) % self.cohorts

    def participation(self, rounds: int):
        """Cyclic cohorts: the `Participation` of a client over `rounds` rounds
        (min separation b with the whole cohort, cyclic Poisson with q < 1)."""
        from dpfl_tf.privacy.matrix_factorization import Participation

        if self.method is not SamplingMethod.CYCLIC_POISSON:
            raise ValueError(
                f"correlated noise needs client sampling 'cyclic_poisson' "
                f"(cohorts), got {self.method.value!r}: independent client "
                "sampling can pick a client in consecutive rounds"
            )
        if self.fraction == 1.0:
            return Participation.min_separation(rounds, self.cohorts)
        return Participation.cyclic_poisson(rounds, self.cohorts, self.fraction)

    def clients_for(self, num_clients: int) -> int:
        """m for K clients (expected m for Poisson sampling, as an int for fixed size)."""
        k = check_count("num_clients", num_clients, minimum=1)
        if self.method is SamplingMethod.CYCLIC_POISSON:
            if self.cohorts > k:
                raise ValueError(f"cohorts must be <= the {k} clients, got {self.cohorts}")
            return max(1, int(round(self.fraction * k / self.cohorts)))
        m = (
            self.clients_per_round
            if self.clients_per_round is not None
            else max(1, int(round(self.fraction * k)))
        )
        return check_clients_per_round(m, k)

    def rate(self, num_clients: int) -> float:
        """q = m / K (or C)."""
        if self.fraction is not None and self.method is SamplingMethod.POISSON:
            return self.fraction
        return self.clients_for(num_clients) / num_clients

    def expected_clients(self, num_clients: int) -> float:
        if self.method is SamplingMethod.CYCLIC_POISSON:  # q K / b: fixed, data-independent
            self.clients_for(num_clients)
            return self.fraction * num_clients / self.cohorts
        if self.method is SamplingMethod.POISSON:
            self.clients_for(num_clients)  # validates m <= K
            return self.rate(num_clients) * num_clients
        return float(self.clients_for(num_clients))

    def event_args(self, num_clients: int) -> dict:
        """Keyword arguments for `gaussian_step_event` / `GaussianSanitizer.event`."""
        if self.method is SamplingMethod.CYCLIC_POISSON:
            return {}  # the run's event is the mechanism's (`MatrixMechanism.event`)
        if self.method is SamplingMethod.POISSON:
            self.clients_for(num_clients)
            return {"sampling_rate": self.rate(num_clients)}
        return {"dataset_size": num_clients, "lot_size": self.clients_for(num_clients)}

    def sample(
        self, rng: np.random.Generator | None, num_clients: int, round_index: int | None = None
    ) -> np.ndarray:
        """The sorted ids of this round's clients, from `rng`, or -- `rng` None, secure
        mode -- from ``os.urandom`` (`dpfl_tf.secure_random.secure_uniform`, 53 bits per
        client): Poisson keeps client k when u_k < q; fixed size keeps the m clients
        with the smallest u_k (a uniformly random m-subset); cyclic keeps the
        clients of cohort `round_index` mod b with u_k < q."""
        if self.method is SamplingMethod.CYCLIC_POISSON:
            if round_index is None:
                raise ValueError("cyclic client sampling needs round_index, got None")
            ids = np.arange(num_clients)
            turn = ids % self.cohorts == int(round_index) % self.cohorts
            if self.fraction < 1.0:
                u = secure_uniform(num_clients) if rng is None else rng.random(num_clients)
                turn &= u < self.fraction
            return np.flatnonzero(turn)
        if self.method is SamplingMethod.POISSON:
            q = self.rate(num_clients)
            self.clients_for(num_clients)
            u = secure_uniform(num_clients) if rng is None else rng.random(num_clients)
            return np.flatnonzero(u < q)
        m = self.clients_for(num_clients)
        if rng is None:
            return np.sort(np.argsort(secure_uniform(num_clients), kind="stable")[:m])
        return np.sort(rng.choice(num_clients, size=m, replace=False))

    def to_dict(self) -> dict:
        out = {
            "method": self.method.value,
            "clients_per_round": self.clients_per_round,
            "fraction": self.fraction,
        }
        if self.cohorts is not None:  # (older checkpoints' fingerprints have no cohorts)
            out["cohorts"] = self.cohorts
        return out


class RoundProgress:
    """One progress line per run, rewritten after every round on a terminal (and
    printed every tenth of the run otherwise): counts as integers, accuracy and
    epsilon with four decimals, seconds per round."""

    def __init__(self, rounds: int, done: int = 0, stream=None):
        self.rounds, self.stream = int(rounds), stream or sys.stdout
        self.every = max(1, self.rounds // 10)
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.start, self.first = time.perf_counter(), int(done)
        self.shown = False

    def line(self, record: RoundRecord) -> str:
        width = len(str(self.rounds))
        parts = [f"round {record.round:>{width}}/{self.rounds}", f"clients {record.clients}"]
        if record.accuracy is not None:
            parts.append(f"acc {record.accuracy:.4f}")
        if record.epsilon is not None:
            parts.append(f"eps {record.epsilon:.4f}")
        done = record.round - self.first
        if done > 0:
            parts.append(f"{(time.perf_counter() - self.start) / done:.2f} s/round")
        return " - ".join(parts)

    def update(self, record: RoundRecord) -> None:
        if self.tty:
            print(f"\r{self.line(record)}\x1b[K", end="", file=self.stream, flush=True)
            self.shown = True
        elif record.round % self.every == 0 or record.round == self.rounds:
            print(self.line(record), file=self.stream, flush=True)

    def close(self) -> None:
        if self.shown:
            print(file=self.stream, flush=True)


class RoundAbandoned(Exception):
    """A round stopped before its update was released (see `FederatedServer.run_round`)."""


@dataclasses.dataclass
class RoundRecord:
    """One row of the history."""

    round: int
    clients: int
    seconds: float  # wall time of sampling + local training + aggregation
    accuracy: float | None
    loss: float | None
    epsilon: float | None  # at delta_max (None if not private)
    delta: float | None  # at the target epsilon (None without a target)
    info: dict[str, Any] = dataclasses.field(default_factory=dict)
    cpu_seconds: float | None = None  # process CPU time of the same (less load-sensitive)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def rounds_text(n: int) -> str:
    """'1 round', '2 rounds'."""
    return f"{n} round" + ("" if n == 1 else "s")


def _json_float(x):
    if x is None:
        return None
    x = float(x)
    return None if math.isinf(x) or math.isnan(x) else x


class FederatedServer:
    """Runs federated rounds on one reused model.

    Args:
      trainer: the `LocalTrainer` (model + training arrays + local SGD settings).
      partition: the clients' index lists into the trainer's training arrays.
      aggregator: `MeanAggregator`, `MedianAggregator`, `GlobalDPAggregator`,
        `ClientNoiseDPAggregator` or `DistributedDPAggregator`.
      sampling: `ClientSampling`.
      test_data: (x_test, y_test) for the server's evaluation.
      target_epsilon: stop before the round that would make delta at this
        epsilon exceed `delta_max` (private aggregators only; None = no stop).
      delta_max: the delta at which epsilon is reported and the stop rule's
        bound; must be < 1/K (delta << 1/K is the usual rule).  Required for
        private aggregators.
      accountant: "moments" | "rdp" | "pld" | "strong".  Fixed-size sampling
        is interpreted by "rdp" only.
      seed: client sampling and local shuffling (per round: (seed, round, key));
        the key is secret OS entropy unless `noise_seed` is given.
      noise_seed: seeds the DP noise per round (tests only; default OS entropy).
      eval_every: evaluate every n rounds (and after the last).
      progress: show a progress bar over rounds (accuracy and epsilon).
      local_dp: a `LocalDPUpload` every client applies to its upload after the
        aggregator's client step (local DP: Duchi, PM, PNPM, LDP-FL, ...); its
        per-client budget is in `privacy_report()["local_dp"]`.
      secure_mode: client sampling from ``os.urandom`` (`ClientSampling.sample`
        with no generator), the aggregator must be in secure mode, `noise_seed`
        is refused, and so is local DP (its randomisers have no secure
        sampler).  `seed` then seeds only what no privacy claim rests on (local
        batch order).
      server_optimizer: what moves the global model by the released aggregate
        (`ServerOptimizer`: FedAvgM, FedAdagrad, FedAdam, FedYogi); None is
        FedAvg's w + Delta.  It reads only the released aggregate
        (post-processing): the ledger is the same with or without it.
      model_average: a `ModelAverage` of the global models after each round
        (a round that released nothing counts with the unchanged model); the
        server's result is then the average (`released_weights`, `evaluate`,
        each round's accuracy), while the model broadcast to the clients (and
        Flower's returned arrays) stays the global model they train.
        Post-processing: the ledger is the same.

    With a private aggregator or local DP, a model whose local training updates
    unprotected state from client data (BatchNormalization in training mode) is
    refused (`dpfl_tf.federated.client.refuse_unprotected_state`); on Flower the
    same check runs where `DPStrategy` and every ClientApp build this object.
    """

    def __init__(
        self,
        trainer: LocalTrainer,
        partition: ClientPartition,
        aggregator: Aggregator,
        *,
        sampling: ClientSampling,
        test_data: tuple[np.ndarray, np.ndarray] | None,
        target_epsilon: float | None = None,
        delta_max: float | None = None,
        accountant: AccountantKind | str = AccountantKind.MOMENTS,
        seed: int = 0,
        noise_seed: int | None = None,
        eval_every: int = 1,
        eval_batch_size: int = 2000,
        progress: bool = True,
        local_dp: LocalDPUpload | None = None,
        secure_mode: bool = False,
        server_optimizer: ServerOptimizer | None = None,
        model_average: ModelAverage | None = None,
    ):
        if not isinstance(partition, ClientPartition):
            raise TypeError(f"partition must be a ClientPartition, got {type(partition).__name__}")
        if not isinstance(aggregator, Aggregator):
            raise TypeError(f"aggregator must be an Aggregator, got {type(aggregator).__name__}")
        if not isinstance(sampling, ClientSampling):
            raise TypeError(f"sampling must be a ClientSampling, got {type(sampling).__name__}")
        if int(partition.indices.max()) >= trainer.num_examples:
            raise ValueError(
                f"the partition refers to example {int(partition.indices.max())} "
                f"but the training set has {trainer.num_examples} examples"
            )
        if local_dp is not None and not isinstance(local_dp, LocalDPUpload):
            raise TypeError(f"local_dp must be a LocalDPUpload, got {type(local_dp).__name__}")
        self.secure_mode = bool(secure_mode)
        if self.secure_mode:
            refuse_seed(True, noise_seed, "noise_seed")
            if local_dp is not None:
                raise ValueError(
                    "secure_mode=True covers the Gaussian mechanisms (Global DP, "
                    "DP-FedAvg); the local-DP randomisers have no secure sampler, "
                    "so local_dp must be None"
                )
            if aggregator.private and not getattr(aggregator, "secure_mode", False):
                raise ValueError(
                    "secure_mode=True needs the aggregator in secure mode "
                    f"(secure_mode=True and a secure sanitizer), got {aggregator!r}"
                )
        if aggregator.private or local_dp is not None:
            refuse_unprotected_state(
                trainer.model, "client-level DP" if aggregator.private else "local DP"
            )
        if server_optimizer is None:
            server_optimizer = ServerOptimizer()
        if not isinstance(server_optimizer, ServerOptimizer):
            raise TypeError(
                f"server_optimizer must be a ServerOptimizer, got {type(server_optimizer).__name__}"
            )
        if server_optimizer.steps:
            raise ValueError(
                f"this ServerOptimizer has taken {server_optimizer.steps} steps for another "
                "run; give each server a new one (a checkpoint restores a run's state)"
            )
        self.server_optimizer = server_optimizer
        if model_average is not None and not isinstance(model_average, ModelAverage):
            raise TypeError(
                f"model_average must be a ModelAverage, got {type(model_average).__name__}"
            )
        if model_average is not None and model_average.rounds:
            raise ValueError(
                f"this ModelAverage has averaged {model_average.rounds} rounds of another "
                "run; give each server a new one (a checkpoint restores a run's state)"
            )
        self.model_average = model_average
        self.local_dp = local_dp
        self.trainer = trainer
        self.partition = partition
        self.aggregator = aggregator
        self.sampling = sampling
        self.num_clients = partition.num_clients
        self.expected_clients = sampling.expected_clients(self.num_clients)  # validates m <= K
        self.seed = int(seed)
        self.noise_seed = noise_seed
        # Which clients a round samples must stay secret for the amplification by
        # sampling to hold: the sampling stream is keyed by OS entropy (kept in
        # checkpoints only), unless the run was made reproducible on purpose with
        # `noise_seed` (tests; such runs are flagged "NOT for deployment").
        self._sampling_key = int(noise_seed) if noise_seed is not None else secrets.randbits(63)
        self.eval_every = check_count("eval_every", eval_every, minimum=1)
        self.eval_batch_size = check_count("eval_batch_size", eval_batch_size, minimum=1)
        self.progress = progress
        self.accountant = AccountantKind.parse(accountant)
        self.target_epsilon = (
            None
            if target_epsilon is None
            else check_number("target_epsilon", target_epsilon, low=0.0, low_open=True)
        )
        self.delta_max = None
        if delta_max is not None:
            self.delta_max = check_delta_max(
                check_number(
                    "delta_max", delta_max, low=0.0, high=1.0, low_open=True, high_open=True
                ),
                self.num_clients,
            )
        self.num_components = (
            aggregator.num_components(trainer.variables)
            if hasattr(aggregator, "num_components")
            else len(trainer.variables)
        )
        self.round_event: dp_accounting.DpEvent | None = None
        self.correlated = _correlated_run(aggregator, sampling)
        budget = None
        if aggregator.private:
            if self.delta_max is None:
                raise ValueError(
                    "a private aggregator needs delta_max (the delta at which "
                    "epsilon is reported and the stop rule's bound)"
                )
            if self.correlated is not None:  # one event for the run, recorded before round 1
                self.round_event = dp_accounting.NoOpDpEvent()
                self.correlated.check_budget(
                    self.num_components, self.target_epsilon, self.delta_max, self.accountant
                )
            else:
                self.round_event = aggregator.round_event(
                    self.num_components, sampling.method, **sampling.event_args(self.num_clients)
                )
            # fail now, not after the first round, if the accountant cannot read the event
            compute_epsilon(
                self.correlated.event(self.num_components)
                if self.correlated is not None
                else self.round_event,
                self.delta_max,
                self.accountant,
            )
            if self.target_epsilon is not None:
                budget = PrivacyBudget(self.target_epsilon, self.delta_max, self.accountant)
        elif self.target_epsilon is not None:
            raise ValueError("target_epsilon needs a private aggregator (global or client DP)")
        self.ledger = PrivacyLedger(self.accountant, budget)
        self.participations = np.zeros(self.num_clients, dtype=np.int32)
        self.history: list[RoundRecord] = []
        self.rounds_done = 0
        self.stop_reason: str | None = None
        self.notices: list[str] = []
        self._test = None
        if test_data is not None:
            x, y = test_data
            self._test = (tf.constant(preprocess_images(x)), tf.constant(np.asarray(y)))
        self._eval_fn = tf.function(self._eval_batch, reduce_retracing=True)
        self._global_accuracy: tuple[int, float] | None = None  # (round, accuracy)

    # -- helpers ---------------------------------------------------------------
    def _notice(self, text: str) -> None:
        self.notices.append(text)
        print(f"NOTE: {text}", file=sys.stderr)

    def _eval_batch(self, x, y):
        logits = self.trainer.model(x, training=False)
        loss = self.trainer.loss(y, logits) * tf.cast(tf.shape(y)[0], tf.float32)
        pred = tf.argmax(logits, axis=-1, output_type=tf.int32)
        correct = tf.reduce_sum(tf.cast(pred == tf.cast(y, tf.int32), tf.int32))
        return loss, correct

    def released_weights(self) -> list[np.ndarray]:
        """The model this server releases: the average of the released global models
        with `model_average` (after its first round), else the global model."""
        current = [v.numpy() for v in self.trainer.variables]
        if self.model_average is None:
            return current
        average = self.model_average.average(current)
        return current if average is None else average

    def evaluate(self, weights: Sequence | None = None) -> tuple[float, float]:
        """(loss, accuracy) on the server's test set of `weights`, by default the
        released model (`released_weights`)."""
        if self._test is None:
            raise ValueError("no test_data was given")
        if weights is None and self.model_average is not None:
            weights = self.released_weights()
        if weights is not None:  # evaluated in place of the global model, then put back
            shapes = [tuple(v.shape) for v in self.trainer.variables]
            given = [tuple(np.shape(w)) for w in weights]
            if given != shapes:
                raise ValueError(f"weights of shapes {given} for a model of shapes {shapes}")
            current = self.trainer.get_weights()
            try:
                self.trainer.set_weights(weights)
                return self._evaluate()
            finally:
                self.trainer.set_weights(current)
        return self._evaluate()

    def global_model_accuracy(self) -> float:
        """The test accuracy of the global model the clients train (with a model
        average, `evaluate` gives the average's), evaluated once per round however
        often it is asked for (the CLI builds a result every round)."""
        if self._global_accuracy is None or self._global_accuracy[0] != self.rounds_done:
            accuracy = self.evaluate(self.trainer.get_weights())[1]
            self._global_accuracy = (self.rounds_done, accuracy)
        return self._global_accuracy[1]

    def _evaluate(self) -> tuple[float, float]:
        x, y = self._test
        n = int(x.shape[0])
        loss, correct = 0.0, 0
        for s in range(0, n, self.eval_batch_size):
            l, c = self._eval_fn(x[s : s + self.eval_batch_size], y[s : s + self.eval_batch_size])
            loss += float(l)
            correct += int(c)
        return loss / n, correct / n

    def epsilon(self) -> float | None:
        """Epsilon spent so far at delta_max (None if not private)."""
        if not self.aggregator.private:
            return None
        return self.ledger.epsilon(self.delta_max)

    def delta_after(self, extra_rounds: int = 0) -> float:
        """delta at the target epsilon after `extra_rounds` more rounds (compute_delta)."""
        events = [self.ledger.event] if len(self.ledger) else []
        if extra_rounds:
            events.append(dp_accounting.SelfComposedDpEvent(self.round_event, extra_rounds))
        if not events:
            return 0.0
        return compute_delta(
            dp_accounting.ComposedDpEvent(events), self.target_epsilon, self.accountant
        )

    def would_exceed_budget(self) -> bool:
        """The stop rule: True if running one more round makes delta(target eps) > delta_max."""
        if not self.aggregator.private or self.target_epsilon is None:
            return False
        if self.correlated is not None:  # paid for the whole run, checked at the start
            return False
        return self.delta_after(1) > self.delta_max

    # -- one round in named parts: the in-process loop and the Flower strategy ------
    # (`dpfl_tf.federated.flower.DPStrategy`) call the same methods, so a round is
    # opened, trained, closed and recorded by one implementation.
    def round_rng(self, t: int) -> np.random.Generator:
        """Client sampling of round t: the stream (seed, "client-sampling", t, secret key)."""
        return derive_rng(self.seed, "client-sampling", int(t), self._sampling_key)

    def shuffle_rng(self, t: int, client_id: int) -> np.random.Generator:
        """Client k's local batch order in round t: (seed, "local-shuffle", t, k).  One
        stream per client, so a client computes it alone (on Flower, on its node)."""
        return derive_rng(self.seed, "local-shuffle", int(t), int(client_id))

    def sample_clients(self, rng: np.random.Generator, t: int | None = None) -> np.ndarray:
        """This round's clients: from the round's `rng`, or in secure mode from
        ``os.urandom`` (`ClientSampling.sample`); cyclic cohorts by round `t`."""
        return self.sampling.sample(None if self.secure_mode else rng, self.num_clients, t)

    def budget_stop_reason(self) -> str | None:
        """Why the next round must not run (the stop rule, `would_exceed_budget`, or
        the correlated-noise mechanism's horizon), or None."""
        if self.correlated is not None and self.rounds_done >= self.correlated.steps:
            return (
                f"the correlated-noise mechanism's horizon of "
                f"{rounds_text(self.correlated.steps)} is reached"
            )
        if not self.would_exceed_budget():
            return None
        return (
            f"privacy budget: round {self.rounds_done + 1} would make delta at "
            f"epsilon={self.target_epsilon:g} exceed delta_max={self.delta_max:g} "
            f"({self.accountant.value} accountant); stopped after "
            f"{rounds_text(self.rounds_done)}"
        )

    def open_round(self) -> tuple[int, np.ndarray]:
        """(t, the sampled client ids) of the next round; with `noise_seed`, the
        server's noise is reseeded from (noise_seed, "server-noise", t)."""
        t = self.rounds_done
        if self.noise_seed is not None:
            self.aggregator.reseed(derive_seed(self.noise_seed, "server-noise", t))
        self.aggregator.begin_round(t)
        selected = self.sample_clients(self.round_rng(t), t)
        if self.correlated is not None:  # refused before any client trains
            self.correlated.open(t, selected, self.ledger, self.num_components)
        return t, selected

    def client_upload(
        self,
        client_id: int,
        global_weights: Sequence[tf.Tensor],
        t: int,
        *,
        local_dp: LocalDPUpload | None = None,
        client_step: bool = True,
    ) -> tuple[list[tf.Tensor], int]:
        """What client k uploads in round t, and its n_k: Delta_k from `LocalTrainer.train`
        on its partition with `shuffle_rng(t, k)` and round t's step, then the
        aggregator's client step (`client_transform`: identity, clip + noise for
        DP-FedAvg, or distributed DP's encoding, drawn with (noise_seed,
        "client-noise", t, k) when seeded; skipped with ``client_step=False``, where
        a Flower client mod takes it), then the local-DP mechanism (`local_dp`,
        default this server's) with its (t, k) generator."""
        k = int(client_id)
        if not 0 <= k < self.num_clients:
            raise ValueError(
                f"client id (partition-id) must lie in [0, {self.num_clients}), got {client_id!r}"
            )
        indices = self.partition.client(k)
        delta = self.trainer.train(
            list(global_weights), indices, self.shuffle_rng(t, k), round_index=t
        )
        upload = delta
        if client_step:
            if self.noise_seed is not None and self.aggregator.client_noise:
                self.aggregator.reseed(derive_seed(self.noise_seed, "client-noise", t, k))
            upload = self.aggregator.client_transform(delta)
        local_dp = self.local_dp if local_dp is None else local_dp
        if local_dp is not None:
            upload = local_dp.apply(global_weights, upload, local_dp.generator(t, k))
        return upload, len(indices)

    def close_round(
        self,
        t: int,
        selected: np.ndarray,
        global_weights: Sequence[tf.Tensor],
        result: AggregateResult,
        *,
        start: float,
        cpu_start: float,
    ) -> RoundRecord:
        """Releases round t: w_{t+1} (the server optimiser's move by the aggregate),
        the participations, the round's event in the ledger, the evaluation
        (every `eval_every` rounds), epsilon and delta, and the history row,
        which it returns."""
        self.participations[selected] += 1
        if self.correlated is not None:
            self.correlated.guard.record(t, [int(k) for k in selected])
        if self.round_event is not None:  # charged before anything reads the release
            self.ledger.record(self.round_event, 1, label="federated round")
        if result.released:
            self.trainer.set_weights(self.server_optimizer.apply(global_weights, result.update))
        else:  # nothing released: the model stays, and no optimiser state moves it
            self.trainer.set_weights(global_weights)
        if self.model_average is not None:  # every round, also one that released nothing
            self.model_average.update(self.trainer.get_weights())
        seconds = time.perf_counter() - start
        cpu_seconds = time.process_time() - cpu_start
        self.rounds_done += 1
        acc = loss = None
        if self._test is not None and (self.rounds_done % self.eval_every == 0):
            loss, acc = self.evaluate()
        eps = self.epsilon()
        delta = self.delta_after(0) if self.aggregator.private and self.target_epsilon else None
        record = RoundRecord(
            t + 1, len(selected), seconds, acc, loss, eps, delta, dict(result.info), cpu_seconds
        )
        self.history.append(record)
        return record

    def finish(self, rounds: int) -> None:
        """The end of a run of up to `rounds` rounds: the stop reason if none was
        set, and the last round evaluated if `eval_every` skipped it."""
        if self.stop_reason is None and self.rounds_done >= rounds:
            self.stop_reason = f"completed {rounds_text(self.rounds_done)}"
        if self.history and self.history[-1].accuracy is None and self._test is not None:
            self.history[-1].loss, self.history[-1].accuracy = self.evaluate()

    # -- the in-process loop ---------------------------------------------------------
    def run_round(self, should_stop=None) -> RoundRecord:
        """Runs one round (no budget check; `run` checks first).  `should_stop()`
        is polled before each client; True abandons the round (`RoundAbandoned`):
        no update is released or recorded and the global weights are restored."""
        start, cpu_start = time.perf_counter(), time.process_time()
        t, selected = self.open_round()
        global_weights = self.trainer.get_weights()

        def uploads():
            for k in selected:
                if should_stop is not None and should_stop():
                    raise RoundAbandoned(t + 1)
                if self.aggregator.dropped_out(t, int(k)):  # uploads nothing
                    continue
                upload, n_k = self.client_upload(int(k), global_weights, t)
                yield upload, float(n_k)

        try:
            result = self.aggregator.aggregate(
                uploads(), global_weights, expected_clients=self.expected_clients
            )
        except RoundAbandoned:  # nothing released: the global model stays as it was
            self.trainer.set_weights(global_weights)
            raise
        return self.close_round(
            t, selected, global_weights, result, start=start, cpu_start=cpu_start
        )

    def run(
        self,
        rounds: int,
        *,
        checkpoint_dir: str | os.PathLike | None = None,
        resume: bool = True,
        should_stop=None,
        on_round=None,
    ) -> list[RoundRecord]:
        """Runs up to `rounds` rounds in total (counting rounds already done).

        With `checkpoint_dir`, the state is written atomically after every
        round and, if `resume`, read back first, so an interrupted run
        continues where it stopped.  `should_stop()` is polled before every
        client: True ends the run with ``stop_reason`` "interrupted" (the round
        under way is abandoned, see `run_round`).  `on_round(server)` is called
        after every round (after its checkpoint)."""
        rounds = check_count("rounds", rounds)
        self.stop_reason = None
        if checkpoint_dir is not None and resume:
            self.load_checkpoint(checkpoint_dir, missing_ok=True)
        bar = RoundProgress(rounds, self.rounds_done) if self.progress else None
        while self.rounds_done < rounds:
            self.stop_reason = self.budget_stop_reason()
            if self.stop_reason is not None:
                break
            try:
                rec = self.run_round(should_stop)
            except RoundAbandoned:
                self.stop_reason = "interrupted"
                break
            if checkpoint_dir is not None:
                self.save_checkpoint(checkpoint_dir)
            if on_round is not None:
                on_round(self)
            if bar is not None:
                bar.update(rec)
        self.finish(rounds)
        if bar is not None:
            bar.close()
            if self.stop_reason.startswith("privacy"):
                print(self.stop_reason, file=sys.stderr)
        return self.history

    # -- reports -----------------------------------------------------------------
    def privacy_report(self) -> dict:
        """What the run cost, for the released model and (client-side noise) per upload;
        with local DP also each client's local budget (``"local_dp"``)."""
        local = None
        if self.local_dp is not None:
            n_max = max(1, int(self.participations.max()) if len(self.participations) else 0)
            d = int(sum(int(np.prod(v.shape)) for v in self.trainer.variables))
            local = {
                **self.local_dp.report(d, n_max).to_dict(),
                "max_participations": int(self.participations.max()),
                "mean_participations": float(self.participations.mean()),
            }
        if not self.aggregator.private:
            if local is not None:
                return {
                    "mechanism": "local_dp",
                    "epsilon": None,
                    "epsilon_is_infinite": True,
                    "note": "no central DP accounting: the released model inherits only "
                    "the local guarantee of every upload (see local_dp)",
                    "local_dp": local,
                }
            return {
                "mechanism": "none",
                "epsilon": None,
                "epsilon_is_infinite": True,
                "note": "no noise: no differential privacy guarantee",
            }
        eps = self.epsilon()
        report = {
            "epsilon": _json_float(eps),
            "delta": self.delta_max,
            "epsilon_is_infinite": eps is not None and math.isinf(eps),
            "accountant": self.accountant.value,
            # the rounds charged (released or aborted); a correlated run's ledger also
            # holds its run event
            "rounds": self.ledger.count("federated round"),
            "secure_mode": self.secure_mode,
            "round_event": describe_event(self.round_event),
            "run_event": (
                describe_event(self.correlated.event(self.num_components))
                if self.correlated is not None
                else None
            ),
            "mechanism": (
                self.correlated.mechanism.describe() if self.correlated is not None else None
            ),
            "relation": RELATIONS[self.sampling.method],
            "target_epsilon": self.target_epsilon,
            "delta_at_target_epsilon": (
                _json_float(self.delta_after(0)) if self.target_epsilon else None
            ),
        }
        if hasattr(self.aggregator, "clipping_report"):
            report["clipping"] = self.aggregator.clipping_report()
        if hasattr(self.aggregator, "server_report"):  # distributed DP
            report["distributed"] = self.aggregator.mechanism.report()
            report["against_server"] = self.aggregator.server_report(
                self.participations, self.delta_max
            )
        if isinstance(self.aggregator, ClientNoiseDPAggregator):
            n_max = int(self.participations.max()) if len(self.participations) else 0
            z = self.aggregator.upload_noise_multiplier(self.num_components)
            upload = gaussian_upload_report(
                z, max(n_max, 1), delta=self.delta_max, accountant=self.accountant
            )
            server_eps = upload.accountant_epsilon_total if n_max else 0.0
            report["against_server"] = {
                "upload_event": describe_event(self.aggregator.upload_event(self.num_components)),
                "relation": upload.relation,
                "max_participations": n_max,
                "mean_participations": float(self.participations.mean()),
                "epsilon_per_upload": _json_float(upload.accountant_epsilon_per_upload),
                "epsilon": _json_float(server_eps),
                "delta": self.delta_max,
                "epsilon_is_infinite": math.isinf(server_eps),
                "note": "per client, over the rounds it uploaded in; no amplification by "
                "sampling (the server knows who uploaded); local_dp."
                "gaussian_upload_report",
            }
            report["released_model_noise_multiplier"] = self.aggregator.aggregate_noise_multiplier(
                self.num_components, self.sampling.clients_for(self.num_clients)
            )
        if local is not None:
            report["local_dp"] = local
        return report

    # -- checkpoints ---------------------------------------------------------------
    def _fingerprint(self) -> dict:
        return {
            "num_clients": self.num_clients,
            "sampling": self.sampling.to_dict(),
            "secure_mode": self.secure_mode,
            "aggregator": self.aggregator.get_config(),
            "seed": self.seed,
            "local_dp": None if self.local_dp is None else self.local_dp.get_config(),
            "accountant": self.accountant.value,
            "variables": [list(v.shape) for v in self.trainer.variables],
            "server_optimizer": self.server_optimizer.get_config(),
            "model_average": (
                None if self.model_average is None else self.model_average.get_config()
            ),
            "local_training": self.trainer.get_config(),
        }

    def save_checkpoint(self, directory: str | os.PathLike) -> None:
        """Global weights + ledger + history + round index, written atomically:
        the weights file of this round first, then the state file naming it."""
        directory = os.fspath(directory)
        os.makedirs(directory, exist_ok=True)
        name = f"weights-{self.rounds_done:06d}.npz"
        arrays = {f"w{i}": v.numpy() for i, v in enumerate(self.trainer.variables)}
        arrays["participations"] = self.participations
        correlated = None
        if self.correlated is not None:  # secret noise buffers: private, like the weights
            correlated, buffers = self.correlated.get_state()
            arrays.update({f"mf_buffer{i}": b for i, b in enumerate(buffers)})
        optimizer_state, optimizer_arrays = self.server_optimizer.get_state()
        arrays.update(optimizer_arrays)
        average_state = None
        if self.model_average is not None:
            average_state, average_arrays = self.model_average.get_state()
            arrays.update(average_arrays)
        atomic_write(os.path.join(directory, name), lambda f: np.savez(f, **arrays), binary=True)
        state = {
            "format": CHECKPOINT_FORMAT,
            "round": self.rounds_done,
            "weights": name,
            "fingerprint": self._fingerprint(),
            "ledger": self.ledger.to_dict(),
            "history": [r.to_dict() for r in self.history],
            "notices": self.notices,
            "aggregator_state": self.aggregator.get_state(),
            "sampling_key": self._sampling_key,  # private state, like the weights
            "correlated": correlated,
            "server_optimizer": optimizer_state,
            "model_average": average_state,
        }
        atomic_write_json(os.path.join(directory, "state.json"), state)
        for old in glob.glob(os.path.join(directory, "weights-*.npz")):
            if os.path.basename(old) != name:
                os.unlink(old)

    def load_checkpoint(self, directory: str | os.PathLike, *, missing_ok: bool = False) -> bool:
        path = os.path.join(os.fspath(directory), "state.json")
        state = read_checkpoint_json(path)
        if state is None:
            if missing_ok:
                return False
            raise FileNotFoundError(f"no checkpoint at {path}")
        if not isinstance(state, dict) or state.get("format") != CHECKPOINT_FORMAT:
            raise ValueError(
                f"{path}: not a dpfl_tf federated checkpoint (format {CHECKPOINT_FORMAT})"
            )
        mine = json.loads(json.dumps(self._fingerprint()))
        saved = dict(state["fingerprint"])  # checkpoints from before server optimisers: FedAvg
        saved.setdefault("server_optimizer", LEGACY_SERVER_OPTIMIZER)
        saved.setdefault("model_average", None)  # and before model averages
        # checkpoints from before the local-training settings were fingerprinted: not known
        saved.setdefault("local_training", mine["local_training"])
        if saved != mine:
            diff = sorted(_differences(saved, mine))
            raise ValueError(
                f"{path} belongs to a different run (differs in: "
                f"{', '.join(diff)}); use another checkpoint directory"
            )
        with np.load(os.path.join(os.fspath(directory), state["weights"])) as data:
            self.trainer.set_weights([data[f"w{i}"] for i in range(len(self.trainer.variables))])
            self.participations = data["participations"].astype(np.int32)
            if self.correlated is not None:
                count = sum(1 for key in data.files if key.startswith("mf_buffer"))
                buffers = [data[f"mf_buffer{i}"] for i in range(count)]
                self.correlated.set_state(state["correlated"], buffers, self.trainer.variables)
            shapes = [tuple(v.shape) for v in self.trainer.variables]
            self.server_optimizer.set_state(state.get("server_optimizer"), data, shapes)
            if self.model_average is not None:
                self.model_average.set_state(state.get("model_average"), data, shapes)
        self.ledger = PrivacyLedger.from_dict(state["ledger"])
        self.history = [RoundRecord(**r) for r in state["history"]]
        self.rounds_done = int(state["round"])
        self._sampling_key = int(state["sampling_key"])
        self.aggregator.set_state(state.get("aggregator_state", {}))
        return True


def _correlated_run(aggregator: Aggregator, sampling: ClientSampling):
    """The `_FederatedCorrelatedRun` of an aggregator whose sanitizer is a
    `CorrelatedSanitizer` (None otherwise); refuses cyclic cohorts without
    correlated noise and correlated noise with other sampling."""
    from dpfl_tf.correlated_noise import CorrelatedSanitizer

    sanitizer = getattr(aggregator, "sanitizer", None)
    cyclic = sampling.method is SamplingMethod.CYCLIC_POISSON
    if not isinstance(sanitizer, CorrelatedSanitizer):
        if cyclic:
            raise ValueError(
                "client sampling 'cyclic_poisson' (cohorts) is for correlated "
                "noise: give the aggregator a CorrelatedSanitizer"
            )
        return None
    if not isinstance(aggregator, GlobalDPAggregator) or aggregator.clip != "fixed":
        raise ValueError(
            f"correlated noise is supported by GlobalDPAggregator with "
            f"clip='fixed', got {aggregator!r}"
        )
    mechanism = sanitizer.mechanism
    declared = sampling.participation(mechanism.steps)
    if declared != mechanism.participation:
        raise ValueError(
            f"the mechanism was built for {mechanism.participation.describe()}, "
            f"but the client sampling gives {declared.describe()}"
        )
    return _FederatedCorrelatedRun(sanitizer, sampling)


class _FederatedCorrelatedRun:
    """A federated run's correlated noise: the guard of the declared pattern,
    the run's event (recorded in the ledger when round 1 opens), the state."""

    def __init__(self, sanitizer, sampling: ClientSampling):
        from dpfl_tf.privacy.matrix_factorization import ParticipationGuard

        self.sanitizer = sanitizer
        self.mechanism = sanitizer.mechanism
        self.steps = self.mechanism.steps
        self.guard = ParticipationGuard(self.mechanism.participation, group_of=sampling.cohort_of)
        self.recorded = False

    def event(self, num_components: int) -> dp_accounting.DpEvent:
        return self.sanitizer.event(num_components)

    def check_budget(self, num_components, target_epsilon, delta, accountant) -> None:
        if target_epsilon is None:
            return
        eps = compute_epsilon(self.event(num_components), delta, accountant)
        if eps > target_epsilon:
            raise ValueError(
                f"the correlated-noise run ({self.mechanism.describe()}) costs "
                f"epsilon {eps:.4g} > target_epsilon={target_epsilon:g} at delta="
                f"{delta:g}: raise the noise multiplier or declare fewer rounds"
            )

    def open(self, t: int, selected, ledger: PrivacyLedger, num_components: int) -> None:
        """Refuses round t's clients if they break the pattern; records the run's
        event before the first round is released."""
        self.guard.check(t, [int(k) for k in selected])
        if not self.recorded:
            ledger.record(self.event(num_components), label="mf")
            self.recorded = True

    def get_state(self) -> tuple[dict, list]:
        noise = self.sanitizer.noise
        state = {"recorded": self.recorded, "guard": _json_guard(self.guard.get_state())}
        if noise is None:
            return state, []
        full = noise.get_state()
        state.update(position=full["position"], last_index=full["last_index"])
        return state, full["buffers"]

    def set_state(self, state: dict, buffers: list, variables) -> None:
        self.recorded = bool(state["recorded"])
        guard = state["guard"]
        self.guard.set_state(
            {
                "last": {int(k): v for k, v in guard["last"].items()},
                "count": {int(k): v for k, v in guard["count"].items()},
                "steps_released": guard["steps_released"],
            }
        )
        if "position" in state:
            self.sanitizer.build(variables).set_state(
                {
                    "position": state["position"],
                    "last_index": state["last_index"],
                    "buffers": buffers,
                }
            )


def _json_guard(state: dict) -> dict:
    return {
        "last": {str(k): int(v) for k, v in state["last"].items()},
        "count": {str(k): int(v) for k, v in state["count"].items()},
        "steps_released": int(state["steps_released"]),
    }
