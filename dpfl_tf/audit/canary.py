"""Canary auditing of DP-SGD in one training run (white box and black box).

The audit of Steinke, Nasr and Jagielski (2023), "Privacy auditing with one
(1) training run", with the white-box gradient canaries of Nasr et al. (2023),
"Tight auditing of differentially private machine learning":

1. m canaries are made; a secret coin per canary (probability 1/2) decides
   whether it joins the training data.  The training data then goes through
   `DPModel.fit` *unchanged*: the canaries are ordinary examples, sampled,
   clipped and noised like every other example.
2. After (and, white box, during) training each canary gets a score computed
   from what the training released -- never from the coins.
3. `dpfl_tf.audit.one_run` turns scores and coins into an epsilon lower bound
   at a stated confidence.  Unit of privacy: one example (add/remove one),
   exactly DP-SGD's.

White-box *Dirac* canaries (`DiracCanaries`).  The model's input gets m extra
features that real data never uses (always 0).  Canary i is the example that
is ``value`` in extra feature i and 0 elsewhere, with a random label.  With a
first Dense layer on the (flat) input, canary i's gradient with respect to the
kernel is non-zero only in kernel row d + i, and no other example's gradient
touches that row (real data and the other canaries have 0 there).  So the row
of canary i moves, in lot t, by

    -lr / L * (1[i in lot t] * c_{i,t} + z_{i,t}),

where c_{i,t} is canary i's *clipped* per-example gradient restricted to the
row and z_{i,t} that row of the lot's Gaussian noise, N(0, sigma^2 C^2 I).  With
``value`` large the row carries nearly all of the canary's gradient norm, so
||c_{i,t}|| = C (for a gradient norm >= C, which ``value`` ensures) and the
canary is a Dirac canary in its own coordinates.

White-box score.  The auditor sees every intermediate model (a Keras callback
around each lot; `DPModel.lots_computed` says whether a lot was released).
Before lot t it computes the descent direction u_{i,t} = -g_{i,t} / ||g_{i,t}||
of canary i's row gradient at the current weights (known before lot t's noise
is drawn, so z_{i,t} projected on u_{i,t} is exactly N(0, sigma^2 C^2) lr / L);
after the lot it records the projection

    p_{i,t} = < row_i(w_{t+1}) - row_i(w_t), u_{i,t} >.

Scores (`WhiteBoxObserver.scores`):

* ``"sum"``: s_i = sum_t p_{i,t}.  For full-batch lots this is exactly a
  Gaussian mechanism per canary with mu = sqrt(T) / sigma (the likelihood-ratio
  test, so the strongest score for that setting);
* ``"spread"``: s_i = sum_{t>1} (p_{i,t} - p_{i,t-1})^2, the variation of the
  projections from lot to lot.  An included canary under Poisson lots moves
  its row only in the lots that sample it; if the noise does not change from
  lot to lot (a broken implementation that draws it once), this separates
  "in" from "out" perfectly, while a correct implementation hides it.

Every score is a function of the released models only, so the one-run bound
applies to each (a score is chosen before the run; do not try several and
keep the best without a Bonferroni correction).

Client-level canaries (`DiracCanaries.federated_data`, `observe_rounds`).
The same construction at the federated wrapper's unit of privacy, one client
(Global DP, Geyer et al. 2017): each included canary is a *canary client*
holding only its canary example; with one local SGD step its update is
-eta g, a Dirac update in its own kernel row (norm about eta * value, chosen
>= the clip S).  The rounds run through `FederatedServer.run_round` unchanged
(same client sampling, clipping at S, noise N(0, sigma^2 S^2) on the sum,
division by the expected clients); the observer reads the global model before
and after each round.

Black-box canaries (`MislabelledCanaries`): real examples given a wrong
label; score = -loss of the *final* model on the canary (Steinke et al. 2023,
section 6).  Much weaker: the final model averages away most of the signal.

Power.  With m canaries one run certifies less than the accountant's epsilon
even for an exactly Gaussian canary (see `dpfl_tf.audit.one_run`).  The
eps-DP test (``method="eps_dp"``, valid for every mechanism) certifies about
0.4-0.45 x eps at eps = 1..8 for m = 5000; the f-DP (Gaussian) test
(``method="gdp"``) about 0.5-0.57 x eps with 10,000-20,000 canaries, but only
for settings whose claim is a Gaussian mechanism (full-batch lots; Global DP
with every client in every round), not for Poisson-sampled lots.  Runs are
independent, so the scores and coins of R runs (fresh canaries, coins and
noise each) may be pooled into one audit of R m canaries: every canary's coin
still moves only its own run (README, "Canary auditing").  A bound above the
claimed epsilon is a bug; a bound well below it is expected.
"""

from __future__ import annotations

from typing import Sequence

import keras
import numpy as np
import tensorflow as tf

from dpfl_tf._validation import check_count, check_number
from dpfl_tf.audit.one_run import (
    OneRunResult,
    epsilon_lower_bound_from_scores,
    refuse_gdp_on_sampling,
)

__all__ = [
    "DiracCanaries",
    "MislabelledCanaries",
    "WhiteBoxObserver",
    "STATISTICS",
    "observe_rounds",
]

STATISTICS = ("sum", "spread")


def _rng(seed):
    # the coins are the audit's secret: OS entropy unless a seed is asked for
    return np.random.default_rng(seed)


def _holding_a_ledger(model):
    """The model if it keeps a privacy ledger (a `DPModel`), else None."""
    return model if hasattr(model, "privacy_ledger") else None


class DiracCanaries:
    """m white-box canaries living in m extra input features (module docstring).

    Args:
      num_canaries: m.
      input_dim: d, the number of (flat) features of the real data.
      num_classes: labels of the canaries are drawn uniformly from range(num_classes).
      value: the canary's feature value a.  A softmax-regression canary's
        gradient norm is sqrt(a^2 + 1) ||p - e_y||, about 0.95 a at the start of
        training; choose a >= 2 C / 0.95 so that clipping always binds (and
        a ~ 10 C to let an implementation that skips clipping show it).
      seed: seeds the coins and labels (reproducible audits); default OS entropy.

    Usage::

        canaries = DiracCanaries(1000, input_dim=784, num_classes=10, value=10.0)
        x_train, y_train = canaries.training_data(x, y)   # d + m features
        model = keras.Sequential([keras.Input((canaries.total_dim,)), keras.layers.Dense(10)])
        dp = DPModel(model); dp.compile(optimizer=DPSGD(...), loss=...)
        observer = canaries.observer(dp)
        dp.fit(x_train, y_train, lot_size=..., callbacks=[observer])
        result = canaries.audit(observer, delta=1e-5)     # OneRunResult
    """

    def __init__(
        self,
        num_canaries: int,
        *,
        input_dim: int,
        num_classes: int,
        value: float = 10.0,
        seed: int | None = None,
    ):
        self.num_canaries = check_count("num_canaries", num_canaries, minimum=1)
        self.input_dim = check_count("input_dim", input_dim, minimum=1)
        self.num_classes = check_count("num_classes", num_classes, minimum=2)
        self.value = check_number("value", value, low=0.0, low_open=True)
        rng = _rng(seed)
        self._coins = rng.random(self.num_canaries) < 0.5
        self.labels = rng.integers(0, self.num_classes, self.num_canaries)

    @property
    def total_dim(self) -> int:
        """d + m: the number of input features the audited model takes."""
        return self.input_dim + self.num_canaries

    @property
    def rows(self) -> np.ndarray:
        """Index of each canary's feature (= its row of the first kernel)."""
        return self.input_dim + np.arange(self.num_canaries)

    def coins(self) -> np.ndarray:
        """The secret coins (True = included).  Only the final bound reads them."""
        return self._coins.copy()

    def pad(self, x) -> np.ndarray:
        """Real data (n, d) -> (n, d + m) with the m canary features 0."""
        x = np.asarray(x, dtype=np.float32)
        x = x.reshape(len(x), -1)
        if x.shape[1] != self.input_dim:
            raise ValueError(
                f"x must have input_dim = {self.input_dim} features per example "
                f"(after flattening), got {x.shape[1]}"
            )
        return np.concatenate([x, np.zeros((len(x), self.num_canaries), np.float32)], axis=1)

    def examples(self, index: Sequence[int] | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(x, y) of the canaries (all m, or those at `index`)."""
        index = np.arange(self.num_canaries) if index is None else np.asarray(index)
        x = np.zeros((len(index), self.total_dim), np.float32)
        x[np.arange(len(index)), self.rows[index]] = self.value
        return x, self.labels[index].astype(np.int64)

    def training_data(self, x, y) -> tuple[np.ndarray, np.ndarray]:
        """The real data padded, followed by the included canaries."""
        xc, yc = self.examples(np.flatnonzero(self._coins))
        y = np.asarray(y).astype(np.int64).reshape(-1)
        if len(y) != len(x):
            raise ValueError(f"x and y disagree on the number of examples: {len(x)} and {len(y)}")
        return np.concatenate([self.pad(x), xc]), np.concatenate([y, yc])

    def federated_data(self, x, y, partition):
        """Client-level canaries (unit: one client): the real clients' data
        padded, plus one *canary client* per included canary holding only its
        canary example.  With one local step (E = 1 and a batch size >= 1) a
        canary client's update is -eta g, g its canary's gradient: a Dirac
        update in its own kernel row.  Returns (x, y, partition) for
        `LocalTrainer` and `FederatedServer`; real clients keep their ids."""
        from dpfl_tf.federated.partition import ClientPartition

        x_all, y_all = self.training_data(x, y)
        n = len(np.asarray(y).reshape(-1))
        clients = [partition.client(k) for k in range(partition.num_clients)]
        clients += [[n + j] for j in range(len(y_all) - n)]
        return (
            x_all,
            y_all,
            ClientPartition.from_lists(clients, scheme=f"{partition.scheme}+canary_clients"),
        )

    def observer(
        self, dp_model, *, loss=None, kernel=None, chunk: int = 1024
    ) -> "WhiteBoxObserver":
        """A `WhiteBoxObserver` of these canaries for `dp_model` (it sees the
        canary examples, never the coins)."""
        x, y = self.examples()
        return WhiteBoxObserver(dp_model, x, y, self.rows, loss=loss, kernel=kernel, chunk=chunk)

    def audit(
        self,
        observer: "WhiteBoxObserver",
        *,
        delta: float,
        confidence: float = 0.95,
        statistic: str = "sum",
        guess_fractions: Sequence[float] | None = None,
        method: str = "eps_dp",
        mechanism=None,
    ) -> OneRunResult:
        """The one-run lower bound from the observer's scores and the coins.
        ``method="gdp"`` only for full-batch lots (or Global DP with every
        client every round): see `dpfl_tf.audit.one_run`; it is refused on a
        sampled mechanism (the GDP test's null is then not the mechanism that
        ran), read from `mechanism`, else from what the observer watched (the
        `DPModel`, or the server of `observe_rounds`), and refused when neither
        says what ran."""
        refuse_gdp_on_sampling(method, mechanism if mechanism is not None else observer.mechanism)
        return epsilon_lower_bound_from_scores(
            observer.scores(statistic),
            self._coins,
            delta=delta,
            confidence=confidence,
            guess_fractions=guess_fractions,
            method=method,
        )


class WhiteBoxObserver(keras.callbacks.Callback):
    """Records, for every released lot, the projection of each canary row's
    change on the canary's descent direction (module docstring).

    As a Keras callback of `DPModel.fit` it observes every lot (a lot counts
    when `DPModel.lots_computed` moved).  For other training loops -- the
    federated rounds of `dpfl_tf.federated.FederatedServer` -- call `begin()`
    before and `end()` after each release, with the loop's model as `dp_model`
    and its loss as `loss` (`observe_rounds` does this).

    Args:
      dp_model: the `DPModel` being trained, or the plain Keras model whose
        weights each release changes (e.g. ``LocalTrainer.model``).
      canary_x, canary_y: the m canary examples (all of them, in or out).
      rows: the kernel row of each canary.
      loss: per-example loss for the directions (default: the DPModel's loss).
      kernel: the kernel variable holding the canary rows (default: the first
        trainable variable with as many rows as the model has input features).
      chunk: canaries per gradient computation (memory).
    """

    def __init__(
        self, dp_model, canary_x, canary_y, rows, *, loss=None, kernel=None, chunk: int = 1024
    ):
        super().__init__()
        self.dp_model = dp_model
        self.canary_x = np.asarray(canary_x, np.float32)
        self.canary_y = np.asarray(canary_y)
        self.canary_rows = np.asarray(rows, np.int64)
        if not (len(self.canary_x) == len(self.canary_y) == len(self.canary_rows)):
            raise ValueError(
                f"canary_x, canary_y and rows must have one entry per canary, "
                f"got {len(self.canary_x)}, {len(self.canary_y)} and "
                f"{len(self.canary_rows)}"
            )
        self._loss = loss
        self._kernel = kernel
        self.chunk = check_count("chunk", chunk, minimum=1)
        self.projections: list[np.ndarray] = []
        self._before = None
        self.released_by = None  # a FederatedServer, set by `observe_rounds`

    @property
    def mechanism(self):
        """What released the observed changes and keeps their ledger: the
        server of `observe_rounds`, else the `DPModel` (None for a plain model)."""
        if self.released_by is not None:
            return self.released_by
        return _holding_a_ledger(self.dp_model)

    @property
    def _inner(self):
        from dpfl_tf.keras import DPModel

        return self.dp_model.model if isinstance(self.dp_model, DPModel) else self.dp_model

    def _released_count(self) -> int | None:
        return getattr(self.dp_model, "lots_computed", None)

    # -- helpers ----------------------------------------------------------------
    def _find_kernel(self):
        if self._kernel is not None:
            return self._kernel
        width = self.canary_x.shape[1]
        for v in self._inner.trainable_variables:
            if len(v.shape) == 2 and int(v.shape[0]) == width:
                self._kernel = v
                return v
        raise ValueError(
            f"no trainable kernel with {width} rows (the model's input width) "
            "was found: pass kernel= the variable of the first Dense layer"
        )

    def _loss_fn(self):
        loss = self._loss if self._loss is not None else getattr(self.dp_model, "_dp_loss", None)
        if loss is None:
            raise ValueError("no loss: compile the DPModel or pass loss=")
        return keras.losses.get(loss) if isinstance(loss, str) else loss

    def directions(self) -> np.ndarray:
        """(m, units): -g_i / ||g_i|| for each canary's kernel row at the current
        weights (a zero gradient gives a zero direction)."""
        kernel = self._find_kernel()
        loss_fn = self._loss_fn()
        model = self._inner
        out = np.zeros((len(self.canary_rows), int(kernel.shape[1])), np.float32)
        for start in range(0, len(self.canary_rows), self.chunk):
            sl = slice(start, start + self.chunk)
            x = tf.constant(self.canary_x[sl])
            y = tf.constant(self.canary_y[sl])
            with tf.GradientTape() as tape:
                pred = model(x, training=True)
                # row rows[i] gets only canary i's gradient; the loss's reduction
                # only scales it, and the direction is normalised
                total = tf.reduce_sum(loss_fn(y, pred))
            grad = tape.gradient(total, kernel)
            out[sl] = tf.gather(grad, self.canary_rows[sl]).numpy()
        norm = np.linalg.norm(out, axis=1, keepdims=True)
        return np.where(norm > 0, -out / np.maximum(norm, 1e-30), 0.0).astype(np.float32)

    # -- observation ----------------------------------------------------------------
    def begin(self) -> None:
        """Before a release: the canary rows and their directions now."""
        kernel = self._find_kernel()
        rows = np.asarray(kernel.numpy())[self.canary_rows]
        self._before = (self._released_count(), rows, self.directions())

    def end(self) -> None:
        """After a release: records the projections of the rows' change."""
        if self._before is None:
            return
        lots, rows, dirs = self._before
        self._before = None
        now = self._released_count()
        if lots is not None and now <= lots:  # nothing released (budget spent)
            return
        after = np.asarray(self._find_kernel().numpy())[self.canary_rows]
        delta = after.astype(np.float64) - rows.astype(np.float64)
        self.projections.append(np.sum(delta * dirs, axis=1))

    def on_train_batch_begin(self, batch, logs=None):
        self.begin()

    def on_train_batch_end(self, batch, logs=None):
        self.end()

    # -- scores -------------------------------------------------------------------
    @property
    def lots_observed(self) -> int:
        return len(self.projections)

    def scores(self, statistic: str = "sum") -> np.ndarray:
        """One score per canary; higher means "more likely included"."""
        if statistic not in STATISTICS:
            raise ValueError(f"statistic must be one of {STATISTICS}, got {statistic!r}")
        if not self.projections:
            raise RuntimeError(
                "no lot was observed: pass the observer to DPModel.fit's "
                "callbacks and train at least one lot"
            )
        p = np.stack(self.projections, axis=1)  # (m, T)
        if statistic == "sum":
            return p.sum(axis=1)
        if p.shape[1] < 2:
            raise ValueError(f"statistic 'spread' needs at least 2 observed lots, got {p.shape[1]}")
        return np.sum(np.diff(p, axis=1) ** 2, axis=1)


class MislabelledCanaries:
    """Black-box canaries: real examples with a wrong label (uniform over the
    other classes).  Score = -loss of the final model (lower loss, more likely in).

    Args:
      x, y: m examples *not* otherwise in the training data, with their true labels.
      num_classes: number of classes.
      seed: seeds the coins and wrong labels; default OS entropy.
    """

    def __init__(self, x, y, *, num_classes: int, seed: int | None = None):
        self.x = np.asarray(x)
        y = np.asarray(y).astype(np.int64).reshape(-1)
        if len(y) != len(self.x) or len(y) == 0:
            raise ValueError(
                f"x and y must hold the same number (>= 1) of canaries, got "
                f"{len(self.x)} and {len(y)}"
            )
        self.num_classes = check_count("num_classes", num_classes, minimum=2)
        if y.min() < 0 or y.max() >= self.num_classes:
            raise ValueError(f"y must lie in [0, {self.num_classes}), got [{y.min()}, {y.max()}]")
        rng = _rng(seed)
        self.num_canaries = len(y)
        self.labels = (y + rng.integers(1, self.num_classes, len(y))) % self.num_classes
        self._coins = rng.random(len(y)) < 0.5

    def coins(self) -> np.ndarray:
        return self._coins.copy()

    def included(self) -> tuple[np.ndarray, np.ndarray]:
        """(x, wrong y) of the included canaries, to append to the training data."""
        idx = np.flatnonzero(self._coins)
        return self.x[idx], self.labels[idx]

    def scores(self, model, *, batch_size: int = 1024, from_logits: bool = True) -> np.ndarray:
        """-loss of `model` on every canary (with its wrong label)."""
        from dpfl_tf.audit.membership import attack_features

        return -attack_features(
            model, self.x, self.labels, from_logits=from_logits, batch_size=batch_size
        ).loss

    def audit(
        self,
        model,
        *,
        delta: float,
        confidence: float = 0.95,
        guess_fractions: Sequence[float] | None = None,
        from_logits: bool = True,
        method: str = "eps_dp",
        mechanism=None,
    ) -> OneRunResult:
        """The one-run lower bound from the final model's losses on the canaries.
        ``method="gdp"`` is refused on a sampled mechanism, read from
        `mechanism` (a DpEvent, PrivacyLedger or FederatedServer) or from
        `model` when it is the `DPModel`, and refused when neither says what
        ran (`dpfl_tf.audit.one_run.refuse_gdp_on_sampling`)."""
        refuse_gdp_on_sampling(
            method, mechanism if mechanism is not None else _holding_a_ledger(model)
        )
        return epsilon_lower_bound_from_scores(
            self.scores(model, from_logits=from_logits),
            self._coins,
            delta=delta,
            confidence=confidence,
            guess_fractions=guess_fractions,
            method=method,
        )


def observe_rounds(server, rounds: int, observer: WhiteBoxObserver) -> None:
    """Runs `rounds` rounds of a `dpfl_tf.federated.FederatedServer` (its
    ordinary `run_round`: same client sampling, clipping and noise), with the
    observer around each round.  Stops early, like `FederatedServer.run`, when
    the next round would exceed the server's privacy budget."""
    check_count("rounds", rounds, minimum=1)
    observer.released_by = server  # its ledger says what ran (`DiracCanaries.audit`)
    for _ in range(rounds):
        if server.would_exceed_budget():
            break
        observer.begin()
        server.run_round()
        observer.end()
