"""What the server does with a round's aggregate: server optimisers.

A round releases Delta_t, the aggregate of the client updates (with DP: the
clipped mean plus the mechanism's noise).  The server treats -Delta_t as a
pseudo-gradient and moves the global model x with one of

* ``sgd`` -- server learning rate eta and heavy-ball momentum beta
  (FedAvgM, Hsu et al. 2019; DP-FedAvgM, McMahan et al. 2018)::

      v_t = beta v_{t-1} + Delta_t;   x_{t+1} = x_t + eta v_t

  FedAvg is eta = 1, beta = 0 (the default: x_{t+1} = x_t + Delta_t exactly);
* ``adagrad``, ``adam``, ``yogi`` -- FedOpt (Reddi et al. 2021, Algorithm 2),
  with m_{-1} = 0 and v_{-1} = tau^2::

      m_t = beta1 m_{t-1} + (1 - beta1) Delta_t
      adagrad: v_t = v_{t-1} + Delta_t^2
      adam:    v_t = beta2 v_{t-1} + (1 - beta2) Delta_t^2
      yogi:    v_t = v_{t-1} - (1 - beta2) Delta_t^2 sign(v_{t-1} - Delta_t^2)
      x_{t+1} = x_t + eta m_t / (sqrt(v_t) + tau)

  (no bias correction, as in the paper; tau is the degree of adaptivity).

A server optimiser reads only what the round released, so it is
post-processing: the privacy ledger records the same events with or without
one, and its state (v, m) is as public as the model.

`ModelAverage` keeps an exponential moving average of the global models after
each round, a_1 = x_1 and a_t = beta a_{t-1} + (1 - beta) x_t, and makes it the
server's result, the model it evaluates and hands out as trained (the clients
keep training the global model x_t).  Post-processing too: it averages out part
of the noise each round added, at no privacy cost (iterate averaging, here
exponentially weighted rather than Polyak & Juditsky's uniform average).

(NumPy only: the CLI and `FederatedConfig` build these before TensorFlow loads.)
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from dpfl_tf._validation import check_number

__all__ = ["SERVER_OPTIMIZERS", "ModelAverage", "ServerOptimizer"]

#: the rules, and the momentum (beta or beta1) each takes by default
SERVER_OPTIMIZERS = {"sgd": 0.0, "adagrad": 0.9, "adam": 0.9, "yogi": 0.9}


def _read_arrays(arrays, prefix: str, shapes, what: str) -> list[np.ndarray]:
    """The arrays ``<prefix>0``, ``<prefix>1``, ... of a checkpoint mapping (e.g. an npz
    file), in order, as float64; with `shapes` (the model's), other shapes are refused."""
    keys = sorted(
        (k for k in arrays if k.startswith(prefix)),
        key=lambda k: int(k[len(prefix) :]),
    )
    state = [np.asarray(arrays[k], dtype=np.float64) for k in keys]
    if state and shapes is not None and [a.shape for a in state] != list(shapes):
        raise ValueError(f"{what} has shapes {[a.shape for a in state]}, the model {list(shapes)}")
    return state


class ServerOptimizer:
    """Moves the global model by a round's released aggregate (see the module docstring).

    Args:
      kind: "sgd" | "adagrad" | "adam" | "yogi".
      learning_rate: the server learning rate eta (> 0).
      momentum: beta (sgd) or beta1 (the adaptive rules), in [0, 1); None takes
        the rule's default (0 for sgd, 0.9 otherwise, as in Reddi et al.).
      beta2: the second-moment decay of adam and yogi, in [0, 1).
      tau: the adaptivity tau (> 0) of the adaptive rules.
    """

    def __init__(
        self,
        kind: str = "sgd",
        learning_rate: float = 1.0,
        momentum: float | None = None,
        beta2: float = 0.99,
        tau: float = 1e-3,
    ):
        kind = str(getattr(kind, "value", kind)).lower()
        if kind not in SERVER_OPTIMIZERS:
            raise ValueError(
                f"server optimizer must be one of {', '.join(SERVER_OPTIMIZERS)}, got {kind!r}"
            )
        self.kind = kind
        self.learning_rate = check_number("server_lr", learning_rate, low=0.0, low_open=True)
        if momentum is None:
            momentum = SERVER_OPTIMIZERS[kind]
        self.momentum = check_number("server_momentum", momentum, low=0.0, high=1.0, high_open=True)
        self.beta2 = check_number("server_beta2", beta2, low=0.0, high=1.0, high_open=True)
        self.tau = check_number("server_tau", tau, low=0.0, low_open=True)
        self.steps = 0
        self._m: list[np.ndarray] | None = None  # sgd: the velocity v; else the first moment
        self._v: list[np.ndarray] | None = None  # the adaptive rules' second moment

    @property
    def is_plain_fedavg(self) -> bool:
        """x_{t+1} = x_t + Delta_t: the default, which keeps no state."""
        return self.kind == "sgd" and self.learning_rate == 1.0 and self.momentum == 0.0

    def get_config(self) -> dict:
        """The settings the rule uses (sgd has no beta2 or tau)."""
        config = {"kind": self.kind, "learning_rate": self.learning_rate, "momentum": self.momentum}
        if self.kind != "sgd":
            config.update(beta2=self.beta2, tau=self.tau)
        return config

    @classmethod
    def from_config(cls, config: dict) -> ServerOptimizer:
        return cls(**config)

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.get_config().items())
        return f"ServerOptimizer({args})"

    def _step(self, delta: list[np.ndarray]) -> list[np.ndarray]:
        """The move eta * (v_t, or m_t / (sqrt(v_t) + tau)) for the released Delta_t."""
        beta = self.momentum
        if self._m is None:
            self._m = [np.zeros_like(d) for d in delta]
        if self.kind == "sgd":
            self._m = [beta * m + d for m, d in zip(self._m, delta)]
            return [self.learning_rate * m for m in self._m]
        self._m = [beta * m + (1.0 - beta) * d for m, d in zip(self._m, delta)]
        if self._v is None:
            self._v = [np.full_like(d, self.tau**2) for d in delta]
        squares = [d * d for d in delta]
        b2 = self.beta2
        if self.kind == "adagrad":
            self._v = [v + s for v, s in zip(self._v, squares)]
        elif self.kind == "adam":
            self._v = [b2 * v + (1.0 - b2) * s for v, s in zip(self._v, squares)]
        else:  # yogi
            self._v = [v - (1.0 - b2) * s * np.sign(v - s) for v, s in zip(self._v, squares)]
        return [self.learning_rate * m / (np.sqrt(v) + self.tau) for m, v in zip(self._m, self._v)]

    def apply(self, weights: Sequence, update: Sequence) -> list[np.ndarray]:
        """x_{t+1} from x_t (`weights`) and the released Delta_t (`update`), as arrays
        of the weights' dtypes."""
        if len(weights) != len(update):
            raise ValueError(f"{len(update)} update tensors for {len(weights)} weights")
        self.steps += 1
        weights = [np.asarray(w) for w in weights]
        if self.is_plain_fedavg:
            step = update
        else:
            step = self._step([np.asarray(d, dtype=np.float64) for d in update])
        return [w + np.asarray(s, dtype=w.dtype) for w, s in zip(weights, step)]

    # -- checkpoints: the state is public (a function of released aggregates) ----------
    def get_state(self) -> tuple[dict, dict[str, np.ndarray]]:
        """(json-able info, named arrays) for a checkpoint."""
        arrays = {}
        for name, tensors in (("m", self._m), ("v", self._v)):
            for i, a in enumerate(tensors or []):
                arrays[f"server_opt_{name}{i}"] = a
        return {"steps": self.steps, "config": self.get_config()}, arrays

    def set_state(self, info: dict | None, arrays, shapes=None) -> None:
        """Restores what `get_state` returned (`arrays`: a mapping, e.g. an npz file);
        with `shapes` (the model's), a state of other shapes is refused."""
        info = info or {"steps": 0}
        if info.get("config", self.get_config()) != self.get_config():
            raise ValueError(
                f"the saved server optimiser state is of {info['config']}, not {self.get_config()}"
            )

        what = "the saved server optimiser state"
        self._m = _read_arrays(arrays, "server_opt_m", shapes, what) or None
        self._v = _read_arrays(arrays, "server_opt_v", shapes, what) or None
        self.steps = int(info["steps"])


class ModelAverage:
    """The exponential moving average of the released global models (see the module
    docstring): ``update(x_t)`` after every round, ``average`` is a_t.

    Args:
      beta: the decay, in (0, 1); the average spans about 1 / (1 - beta) rounds.
    """

    def __init__(self, beta: float):
        self.beta = check_number(
            "model_average", beta, low=0.0, high=1.0, low_open=True, high_open=True
        )
        self.rounds = 0
        self._average: list[np.ndarray] | None = None

    def get_config(self) -> dict:
        return {"beta": self.beta}

    def __repr__(self) -> str:
        return f"ModelAverage(beta={self.beta!r})"

    def update(self, weights: Sequence) -> None:
        """a_t from a_{t-1} and the global model x_t the round released."""
        x = [np.asarray(w, dtype=np.float64) for w in weights]
        b = self.beta
        if self._average is not None and [a.shape for a in self._average] != [w.shape for w in x]:
            raise ValueError(
                f"weights of shapes {[w.shape for w in x]} for an average of shapes "
                f"{[a.shape for a in self._average]}"
            )
        if self._average is None:
            self._average = x
        else:
            self._average = [b * a + (1.0 - b) * w for a, w in zip(self._average, x)]
        self.rounds += 1

    def average(self, like: Sequence) -> list[np.ndarray] | None:
        """a_t in the dtypes of `like` (the model's weights); None before round 1."""
        if self._average is None:
            return None
        return [a.astype(np.asarray(w).dtype) for a, w in zip(self._average, like)]

    # -- checkpoints: as public as the released models it averages ---------------------
    def get_state(self) -> tuple[dict, dict[str, np.ndarray]]:
        arrays = {f"model_average{i}": a for i, a in enumerate(self._average or [])}
        return {"rounds": self.rounds, "config": self.get_config()}, arrays

    def set_state(self, info: dict | None, arrays, shapes=None) -> None:
        """Restores what `get_state` returned; a state of other settings or shapes is
        refused."""
        info = info or {"rounds": 0}
        if info.get("config", self.get_config()) != self.get_config():
            raise ValueError(
                f"the saved model average is of {info['config']}, not {self.get_config()}"
            )
        state = _read_arrays(arrays, "model_average", shapes, "the saved model average")
        if bool(state) != bool(info["rounds"]):
            raise ValueError(
                f"the saved model average has {len(state)} arrays after {info['rounds']} rounds"
            )
        self._average = state or None
        self.rounds = int(info["rounds"])
