"""Local training of simulated clients with ONE reused Keras model.

A `LocalTrainer` holds the training arrays once (as tensors) and one Keras
model.  Training client k means: set the model's trainable variables to the
global weights w_t, run E epochs of mini-batch SGD (batch B, learning rate
eta, heavy-ball momentum mu) over client k's index list, and return

    Delta_k = w_k - w_t,

a list of tensors, one per trainable variable (McMahan et al. 2017,
Algorithm 1, ClientUpdate).  The whole local run is one `tf.function` call
(a `tf.while_loop` over the client's batches), traced once for every client
size, so 10,000 clients cost no Python loop over steps and no new Keras model:
memory is O(model + data).

SGD with momentum is written out (v <- mu v + g; w <- w - eta v, the Keras
`SGD(momentum=mu)` rule); the velocity is reset for every client, so a client
starts from the global model with no state from other clients.
Non-trainable variables are not federated.  BatchNormalization in training
mode updates its moving statistics from the client's raw data on the shared
model, unclipped and un-noised, and the released model is evaluated with
them: `refuse_unprotected_state` refuses such models whenever client-level
DP is on (`FederatedServer` calls it).
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import tensorflow as tf

from dpfl_tf._validation import check_count, check_number

__all__ = ["LocalTrainer", "layer_groups", "preprocess_images", "refuse_unprotected_state"]


def preprocess_images(x: np.ndarray) -> np.ndarray:
    """uint8 images -> float32 in [0, 1] (shape kept)."""
    x = np.asarray(x)
    if x.dtype == np.uint8:
        return x.astype(np.float32) / 255.0
    return x.astype(np.float32)


def refuse_unprotected_state(model, why: str) -> None:
    """Raises ValueError for a layer whose non-trainable state local training
    updates from the client's data: BatchNormalization with ``trainable=True``
    (Keras runs it in training mode: its moving mean and variance move towards
    each client's batch statistics).  Under client-level DP only the clipped,
    noised update of the trainable variables is protected; that state would be
    a release outside the mechanism (and the ledger).  A frozen
    BatchNormalization (``trainable=False``: inference mode, statistics fixed)
    is accepted.  `why` names the DP mode in the message."""
    import keras

    for layer in model._flatten_layers(include_self=False, recursive=True):
        if isinstance(layer, keras.layers.BatchNormalization) and layer.trainable:
            raise ValueError(
                f"layer {layer.name!r} is BatchNormalization in training mode: local training "
                "updates its moving mean and variance from each client's raw data, which are "
                f"never clipped or noised and are used by the released model, so {why} does "
                "not cover them. Use LayerNormalization or GroupNormalization, or freeze it "
                "(trainable=False)."
            )


def layer_groups(model) -> list[int]:
    """For per-layer clipping: the layer (component) index of each trainable
    variable, so that a layer's kernel and bias share one clip bound.

    Layers are told apart by the variable path (``"dense_1/kernel"`` and
    ``"dense_1/bias"`` belong to layer ``"dense_1"``)."""
    ids: dict[str, int] = {}
    groups = []
    for i, v in enumerate(model.trainable_variables):
        path = getattr(v, "path", None) or getattr(v, "name", f"var{i}")
        layer = path.rsplit("/", 1)[0] if "/" in path else f"{path}#{i}"
        groups.append(ids.setdefault(layer, len(ids)))
    return groups


def _describe(setting):
    """A number as it is; a Keras object (schedule, loss) by its serialized config;
    another callable by its module and qualified name."""
    if not callable(setting):
        return float(setting)
    import keras

    if hasattr(setting, "get_config"):
        try:
            return keras.saving.serialize_keras_object(setting)
        except (TypeError, ValueError, NotImplementedError):
            pass
    name = getattr(setting, "__qualname__", type(setting).__qualname__)
    return f"{getattr(setting, '__module__', '?')}.{name}"


class LocalTrainer:
    """Runs ClientUpdate for one client at a time on a shared model.

    Args:
      model: a built Keras model (its trainable variables are overwritten).
      x, y: the whole training set (clients hold indices into it).
      local_epochs: E >= 1.
      batch_size: B >= 1 (a client's last batch may be smaller).
      learning_rate: eta > 0, or a schedule of the round index t (a callable
        returning eta_t > 0, e.g. a Keras
        `keras.optimizers.schedules.ExponentialDecay(0.1, 675, 0.1)`, whose
        "step" is then the round), read at each `train(round_index=t)`.
      momentum: mu in [0, 1).
      loss: a Keras loss or callable(y_true, y_pred) returning per-batch mean;
        default sparse categorical cross-entropy on logits.
    """

    def __init__(
        self,
        model,
        x: np.ndarray,
        y: np.ndarray,
        *,
        local_epochs: int = 1,
        batch_size: int = 10,
        learning_rate: float | Callable[[int], float] = 0.1,
        momentum: float = 0.0,
        loss: Callable | None = None,
    ):
        import keras

        self.model = model
        if not model.built:
            raise ValueError("model must be built (call it on a batch or pass input_shape)")
        if len(x) != len(y):
            raise ValueError(f"x has {len(x)} examples but y has {len(y)}")
        self.local_epochs = check_count("local_epochs", local_epochs, minimum=1)
        self.batch_size = check_count("batch_size", batch_size, minimum=1)
        self.learning_rate = (
            learning_rate
            if callable(learning_rate)
            else check_number("learning_rate", learning_rate, low=0.0, low_open=True)
        )
        self._rate_of_round: tuple[int, float] | None = None  # (t, eta_t) last evaluated
        self.learning_rate_at(0)  # a schedule is checked on its first round too
        self.momentum = check_number("momentum", momentum, low=0.0, high=1.0, high_open=True)
        self.loss = loss or keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        self.num_examples = len(x)
        self.x = tf.constant(preprocess_images(x))
        self.y = tf.constant(np.asarray(y))
        self._vars = list(model.trainable_variables)
        self._velocity = [tf.Variable(tf.zeros_like(v), trainable=False) for v in self._vars]
        self._mu = tf.constant(self.momentum, tf.float32)
        self._train_fn = tf.function(self._local_sgd, reduce_retracing=True)

    def get_config(self) -> dict:
        """The local-training settings, JSON-ready (a checkpoint's fingerprint holds
        them, so a run resumed with another E, B, step, momentum or loss is refused):
        a Keras schedule or loss by its serialized config, another callable by its
        name only (two lambdas, or a function whose body changed, look the same)."""
        return {
            "local_epochs": self.local_epochs,
            "batch_size": self.batch_size,
            "learning_rate": _describe(self.learning_rate),
            "momentum": self.momentum,
            "loss": _describe(self.loss),
        }

    @property
    def variables(self) -> list[tf.Variable]:
        return self._vars

    def get_weights(self) -> list[tf.Tensor]:
        """The current trainable weights, as tensors (copies)."""
        return [tf.identity(v) for v in self._vars]

    def set_weights(self, weights: Sequence[tf.Tensor]) -> None:
        for v, w in zip(self._vars, weights):
            v.assign(w)

    def batch_bounds(self, num_examples: int) -> tuple[np.ndarray, np.ndarray]:
        """Start and end offsets of every local step in the concatenated epoch order.

        Each epoch (a fresh permutation of the client's n_k indices) is cut
        into ceil(n_k / B) consecutive batches, the last one short when B does
        not divide n_k; no batch straddles two epochs."""
        n, b = int(num_examples), self.batch_size
        starts = np.concatenate(
            [np.arange(e * n, (e + 1) * n, b) for e in range(self.local_epochs)]
        )
        ends = np.minimum(starts + b, (starts // n + 1) * n)
        return starts.astype(np.int32), ends.astype(np.int32)

    def learning_rate_at(self, round_index: int) -> float:
        """eta_t: the learning rate, or its schedule at round t (0, 1, ...), evaluated
        once per round (an eager Keras schedule call costs ~0.4 ms, and a round trains
        hundreds of clients)."""
        if not callable(self.learning_rate):
            return self.learning_rate
        t = int(round_index)
        if self._rate_of_round is None or self._rate_of_round[0] != t:
            rate = check_number(
                f"learning_rate schedule at round {t}",
                float(self.learning_rate(t)),
                low=0.0,
                low_open=True,
            )
            self._rate_of_round = (t, rate)
        return self._rate_of_round[1]

    def train(
        self,
        global_weights: Sequence[tf.Tensor],
        indices: np.ndarray,
        rng: np.random.Generator,
        *,
        round_index: int = 0,
    ) -> list[tf.Tensor]:
        """Delta_k = w_k - w_t after E local epochs on the client's `indices`, with
        the step `learning_rate_at(round_index)`.

        `rng` shuffles the client's examples (one permutation per epoch)."""
        indices = np.asarray(indices, dtype=np.int64)
        if len(indices) == 0:
            raise ValueError("a client with no examples cannot train")
        if indices.min() < 0 or indices.max() >= self.num_examples:
            raise ValueError(
                f"client indices must lie in [0, {self.num_examples}), got "
                f"[{int(indices.min())}, {int(indices.max())}]"
            )
        order = np.concatenate([rng.permutation(indices) for _ in range(self.local_epochs)])
        starts, ends = self.batch_bounds(len(indices))
        return self._train_fn(
            list(global_weights),
            tf.constant(order),
            tf.constant(starts),
            tf.constant(ends),
            tf.constant(self.learning_rate_at(round_index), tf.float32),
            self._mu,
        )

    def _local_sgd(self, global_weights, order, starts, ends, lr, mu):
        for v, w in zip(self._vars, global_weights):
            v.assign(w)
        for vel in self._velocity:
            vel.assign(tf.zeros_like(vel))
        for i in tf.range(tf.shape(starts)[0]):
            idx = order[starts[i] : ends[i]]
            xb = tf.gather(self.x, idx)
            yb = tf.gather(self.y, idx)
            with tf.GradientTape() as tape:
                loss = self.loss(yb, self.model(xb, training=True))
            grads = tape.gradient(loss, self._vars)
            for v, vel, g in zip(self._vars, self._velocity, grads):
                vel.assign(mu * vel + g)
                v.assign_sub(lr * vel)
        return [v - w for v, w in zip(self._vars, global_weights)]
