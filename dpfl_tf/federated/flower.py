"""Run the federated wrapper on Flower (``pip install 'dpfl-tf[flower]'``).

Our in-process loop (`FederatedServer`) serves one machine.  This module
makes the same round run on Flower's Message API (``flwr >= 1.41``:
``ClientApp`` / ``ServerApp`` / message-based ``Strategy``), so it can use
Flower's Simulation Engine (Ray, one machine or a multi-node Ray cluster)
or a real deployment, with OUR mechanisms and OUR accounting:

* `make_client_app` -- a ``ClientApp`` whose ``train`` handler runs our
  `LocalTrainer` (local SGD on one reused Keras model) on the client's
  partition (``context.node_config["partition-id"]``) and applies the
  client-side mechanisms *before* the update leaves the client:
  DP-FedAvg clip + noise through the same code path as in-process
  (`ClientNoiseDPAggregator.client_transform`, i.e. the shared
  `GaussianSanitizer`), and/or any local-DP mechanism of `local_dp`
  (`LocalDPUpload`).  The client keeps its own upload count in
  ``context.state`` and reports its *composed* local guarantee after every
  upload (Flower's ``LocalDpMod`` reports nothing across rounds).
* `DPStrategy` -- a Flower ``Strategy`` that wraps an inner Flower strategy
  (``FedAvg`` by default).  Its state is an ordinary `FederatedServer`
  (built by `build_server` from the same `FederatedConfig`), so the client
  sampling, the aggregator (Global DP: clip each update, noise the sum once
  with the sanitizer, divide by m), the round's `DpEvent`, the
  `PrivacyLedger`, the stop rule (`FederatedServer.would_exceed_budget`:
  stop before a round that would make delta at the target epsilon exceed
  delta_max), the evaluation and the privacy report are the in-process
  objects themselves; Flower only carries the messages.
* `run_on_flower(config)` -- the same `FederatedConfig` that `run_federated`
  runs in-process, run on Flower's simulation engine (``backend="ray"``) or
  on `LocalGrid` (``backend="local"``: Flower's ClientApp, ServerApp,
  strategies and records, delivered by plain function calls in this process;
  no Ray).  Returns the same result dict as `run_federated`.
* ``client_app`` / ``server_app`` -- module-level apps for ``flwr run``; they
  read the configuration from the run config (`config_from_run_config`).

How a round maps (in-process -> Flower)
---------------------------------------
The round is `FederatedServer`'s own named parts on both runtimes:

=================================  ============================================
``FederatedServer.run``            ``DPStrategy``
=================================  ============================================
``budget_stop_reason``             ``configure_train`` (same method)
``open_round``: sample clients     ``configure_train`` (same method), then the
                                   nodes of the sampled clients (enrolment:
                                   each node says its ``partition-id``); the
                                   inner strategy addresses exactly them
``client_upload``: train, client   ClientApp ``train`` (same method, on the
step, local DP                     client's node; streams (seed, t, k))
aggregator.aggregate               ``aggregate_train`` (same object); without
                                   DP the inner strategy aggregates the updates
``close_round``: weights, ledger,  ``aggregate_train`` (same method), then the
participations, test, history      checkpoint and the results file
``finish``                         ``run`` (same method)
=================================  ============================================

Clients upload the *update* Delta_k (after their mechanism), not the new
weights: that is the record the DP guarantees talk about, and the server
adds the aggregate to w_t exactly as in-process.  (An inner strategy used
without DP must therefore be translation-equivariant -- FedAvg, FedMedian,
FedTrimmedAvg -- not a server-optimizer strategy such as FedAdam.)

Sampling and the event.  Flower's own FedAvg samples a fixed number of
nodes uniformly without replacement (``random.sample``).  `DPStrategy`
samples itself, with the config's `ClientSampling` and the seeded
generator of the in-process loop: ``fixed_size`` is exactly Flower's
scheme (m of K without replacement, replace-one relation, event
``gaussian_step_event(sigma, "fixed_size", dataset_size=K, lot_size=m)``,
read by the ``rdp`` accountant), and ``poisson`` is implemented on the
server (every node joins with q = m/K; add/remove-one; Poisson event; any
accountant).  Both are the event FederatedServer records for the same
config, so the two runtimes report exactly the same epsilon.  Flower's
DP wrappers (``DifferentialPrivacy*FixedClipping``) only account with
``sampling_method="no-amplification"``; ours credit the amplification the
sampling really gives.

Unit of privacy: one client (all its examples); the server is trusted
with the raw updates under Global DP, not under DP-FedAvg with client-side
noise or local DP.
"""

from __future__ import annotations

try:
    import flwr
    from flwr.app import (
        ArrayRecord,
        ConfigRecord,
        Context,
        Error,
        Message,
        MetricRecord,
        RecordDict,
    )
    from flwr.clientapp import ClientApp
    from flwr.serverapp import Grid, ServerApp
    from flwr.serverapp.strategy import FedAvg, FedMedian, Strategy
    from flwr.supercore.run import Run
except ImportError as _exc:  # pragma: no cover - exercised in a subprocess test
    raise ImportError(
        "dpfl_tf.federated.flower needs Flower (flwr >= 1.41, the Message API with "
        "flwr.app / flwr.clientapp / flwr.serverapp); install the extra with: "
        "pip install 'dpfl-tf[flower]'"
    ) from _exc

import copy
import dataclasses
import hashlib
import json
import logging
import math
import time
import uuid
from typing import Any, Callable, Iterable, Sequence

import numpy as np
import tensorflow as tf

from dpfl_tf._validation import check_count
from dpfl_tf.federated.aggregators import AggregateResult, ClientNoiseDPAggregator
from dpfl_tf.federated.flower_messages import (
    NUM_PARTITIONS_KEY,
    PARTITION_ID_KEY,
    ROUND_KEY,
    TrainRequest,
    query_reply,
    train_reply,
    train_request,
)
from dpfl_tf.federated.flower_messages import only as _only
from dpfl_tf.federated.local_dp import LocalDPUpload, gaussian_upload_report
from dpfl_tf.federated.runner import DPMode, FederatedConfig, build_server, federated_result
from dpfl_tf.federated.server import FederatedServer, RoundRecord

__all__ = [
    "DPStrategy",
    "LocalDPUpload",
    "LocalGrid",
    "client_app",
    "client_update",
    "config_from_run_config",
    "config_to_run_config",
    "default_inner_strategy",
    "make_client_app",
    "make_server_app",
    "run_apps",
    "run_on_flower",
    "server_app",
    "FLOWER_VERSION",
    "PARTITION_ID_KEY",
    "NUM_PARTITIONS_KEY",
    "ROUND_KEY",
]

FLOWER_VERSION = getattr(flwr, "__version__", "unknown")
_BACKENDS = ("ray", "local")
#: the composed epsilons clients report in their metrics (the largest is kept)
_CLIENT_EPSILONS = (
    "client-dp-epsilon-total",
    "ldp-epsilon-total",
    "ldp-accountant-epsilon-total",
    "ldp-epsilon-total-sign-only",
)
_log = logging.getLogger("dpfl_tf.federated.flower")


# ---------------------------------------------------------------------------
# Run configuration <-> FederatedConfig (for `flwr run`)

_FIELDS = {f.name: f for f in dataclasses.fields(FederatedConfig)}
#: run-config keys the apps read besides FederatedConfig's fields.
_EXTRA_RUN_KEYS = ("results-path", "checkpoint-dir", "min-nodes", "node-timeout")


def config_from_run_config(run_config: dict) -> FederatedConfig:
    """A `FederatedConfig` from a Flower run config (``[tool.flwr.app.config]``).

    Keys are FederatedConfig's field names with ``-`` for ``_``
    (``clients-per-round = 5``); ``hidden`` is a comma-separated string
    (``"600,100"``); a field left out keeps its default (None fields are
    simply omitted).  ``results-path`` is read by the ServerApp.  Any other
    key is an error (a typo must not silently run the default)."""
    if not isinstance(run_config, dict):
        raise ValueError(f"run_config must be a mapping, got {type(run_config).__name__}")
    kwargs: dict[str, Any] = {}
    for key, value in run_config.items():
        if key in _EXTRA_RUN_KEYS:
            continue
        name = str(key).replace("-", "_")
        if name not in _FIELDS:
            allowed = ", ".join(sorted(n.replace("_", "-") for n in _FIELDS))
            raise ValueError(
                f"unknown run-config key {key!r}; allowed: {allowed}, " + ", ".join(_EXTRA_RUN_KEYS)
            )
        if name == "hidden":
            if isinstance(value, str):
                value = tuple(int(v) for v in value.replace(" ", "").split(",") if v)
            elif isinstance(value, int):
                value = (value,)
        kwargs[name] = value
    return FederatedConfig(**kwargs)


def config_to_run_config(config: FederatedConfig) -> dict:
    """The inverse of `config_from_run_config` (None fields left out)."""
    out = {}
    for key, value in config.to_dict().items():
        if value is None:
            continue
        if key == "hidden":
            value = ",".join(str(h) for h in value)
        out[key.replace("_", "-")] = value
    return out


# ---------------------------------------------------------------------------
# Client side


def client_update(
    server: FederatedServer,
    client_id: int,
    global_weights: Sequence[tf.Tensor],
    round_index: int,
    *,
    local_dp: LocalDPUpload | None = None,
) -> tuple[list[tf.Tensor], int]:
    """What client k uploads in round t, and its n_k: `FederatedServer.client_upload`,
    the in-process client step itself (`server` is built from the run's config;
    the client uses its trainer, partition and aggregator, never its ledger)."""
    upload, n_k = server.client_upload(client_id, global_weights, round_index, local_dp=local_dp)
    return [tf.convert_to_tensor(u) for u in upload], n_k


@dataclasses.dataclass(frozen=True)
class _ClientSpec:
    """What a ClientApp needs; picklable (Ray ships it to its workers)."""

    config: FederatedConfig | None
    dataset: Any
    local_dp: LocalDPUpload | None
    key: str


#: one built client runtime per process (Ray worker), keyed by the spec's key.
_RUNTIMES: dict[str, FederatedServer] = {}


def _dataset_fingerprint(dataset) -> str:
    if dataset is None:
        return "default"
    h = hashlib.sha1()
    for name in ("x_train", "y_train", "x_test", "y_test"):
        arr = np.ascontiguousarray(getattr(dataset, name))
        h.update(f"{name}{arr.shape}{arr.dtype}".encode())
        h.update(arr.tobytes())
    return h.hexdigest()


def _runtime(spec: _ClientSpec, config: FederatedConfig) -> FederatedServer:
    key = spec.key + json.dumps(config.to_dict(), sort_keys=True)
    if key not in _RUNTIMES:
        _RUNTIMES.clear()  # one run per process at a time: free the previous model
        server, _ = build_server(config, spec.dataset, progress=False)
        _RUNTIMES[key] = server
    return _RUNTIMES[key]


def _partition_id(
    spec: _ClientSpec, run_config: dict, node_config: dict
) -> tuple[FederatedConfig, int]:
    """(the run's config, this node's partition id k), checked: 0 <= k < K and the node's
    num-partitions equal to K."""
    config = spec.config if spec.config is not None else config_from_run_config(dict(run_config))
    if PARTITION_ID_KEY not in node_config:
        raise ValueError(
            f"the node config has no {PARTITION_ID_KEY!r}: start the SuperNode "
            f'with --node-config "{PARTITION_ID_KEY}=<k> '
            f'{NUM_PARTITIONS_KEY}={config.clients}" (the simulation engine '
            "sets both)"
        )
    k = int(node_config[PARTITION_ID_KEY])
    if NUM_PARTITIONS_KEY in node_config and int(node_config[NUM_PARTITIONS_KEY]) != config.clients:
        raise ValueError(
            f"{NUM_PARTITIONS_KEY}={node_config[NUM_PARTITIONS_KEY]} but the "
            f"config has clients={config.clients}: every client must build the "
            "same partition"
        )
    if not 0 <= k < config.clients:
        raise ValueError(f"client id (partition-id) must lie in [0, {config.clients}), got {k}")
    return config, k


def client_train(spec: _ClientSpec, request: TrainRequest) -> tuple[list[np.ndarray], dict]:
    """Client k's answer to a train message: (its upload, its metrics).  The cold
    ClientApp calls it in the ClientApp's process, the warm one
    (`dpfl_tf.federated.flower_warm`) in the node's worker process."""
    config, k = _partition_id(spec, request.run_config, request.node_config)
    server = _runtime(spec, config)
    arrays, t = request.arrays, request.round_index
    shapes = [tuple(v.shape) for v in server.trainer.variables]
    if [tuple(a.shape) for a in arrays] != shapes:
        raise ValueError(
            f"the server sent arrays of shapes {[a.shape for a in arrays]}, the "
            f"client's model has {shapes}"
        )
    global_weights = [tf.constant(a) for a in arrays]
    local_dp = spec.local_dp
    if server.local_dp is not None:  # the config says dp="local"
        if local_dp is not None:
            raise ValueError(
                "the config has dp='local' and make_client_app got a local_dp "
                "too: give the local-DP mechanism in one place"
            )
        local_dp = server.local_dp
    upload, n_k = client_update(server, k, global_weights, t, local_dp=local_dp)

    # the client's own accounting, composed over the rounds it took part in
    uploads = request.uploads + 1
    # n_k is the client's data, which no mechanism protects: a server that is not
    # trusted (client-side noise, local DP) gets 1, so FedAvg's weighting is the
    # unweighted mean, as in-process (`build_server`); a trusted Global DP server
    # ignores the weights anyway.
    untrusted = config.dp in (DPMode.CLIENT, DPMode.LOCAL) or local_dp is not None
    metrics: dict[str, float | int] = {
        "num-examples": 1 if untrusted else int(n_k),
        "partition-id": k,
        "uploads": uploads,
    }
    d = int(sum(int(np.prod(s)) for s in shapes))
    if config.dp is DPMode.CLIENT:  # replace-one against the server: the one report
        rep = gaussian_upload_report(
            server.aggregator.upload_noise_multiplier(server.num_components),
            uploads,
            delta=config.delta_max,
            accountant=config.accountant,
        )
        metrics["client-dp-epsilon-upload"] = _finite(rep.accountant_epsilon_per_upload)
        metrics["client-dp-epsilon-total"] = _finite(rep.accountant_epsilon_total)
    if local_dp is not None:
        metrics.update(local_dp.metrics(d, uploads))
    return [np.asarray(u) for u in upload], metrics


def client_partition(
    spec: _ClientSpec, run_config: dict, node_config: dict, *, build: bool = False
) -> int:
    """The node's partition id, checked against the run's config (enrolment); with
    `build`, the client's runtime (data, model) is built now, before the first round
    (the warm ClientApp's worker)."""
    config, k = _partition_id(spec, run_config, node_config)
    if build:
        _runtime(spec, config)
    return k


def _client_query(spec: _ClientSpec, msg: Message, context: Context) -> Message:
    k = client_partition(spec, dict(context.run_config), dict(context.node_config))
    return query_reply(msg, k)


def _client_train(spec: _ClientSpec, msg: Message, context: Context) -> Message:
    upload, metrics = client_train(spec, train_request(msg, context))
    return train_reply(msg, context, upload, metrics)


def _finite(x: float) -> float:
    return float(x) if math.isfinite(x) else float("inf")


def make_client_app(
    config: FederatedConfig | None = None, dataset=None, *, local_dp: LocalDPUpload | None = None
) -> ClientApp:
    """A Flower ``ClientApp`` that trains with our `LocalTrainer`.

    Args:
      config: the run's `FederatedConfig`; None reads it from the Flower run
        config (``flwr run``, see `config_from_run_config`).
      dataset: the training/test arrays (default ``load_dataset(config.dataset)``
        in each client process; pass small slices only: Ray ships the app,
        dataset included, with every message).
      local_dp: a `LocalDPUpload` applied after the config's own client step
        (for a config without ``dp="local"``; with it, the config's mechanism
        is used, as in-process).

    The client is identified by ``context.node_config["partition-id"]`` and
    trains on that partition of `make_partition` (which every client
    computes identically from the config's seed).  It replies with the
    upload (an ArrayRecord) and a MetricRecord holding ``num-examples``,
    its ``partition-id``, its upload count and, for DP-FedAvg with
    client-side noise or local DP, its own epsilon per upload and composed
    over all its uploads so far.
    """
    if config is not None and not isinstance(config, FederatedConfig):
        raise TypeError(f"config must be a FederatedConfig or None, got {type(config).__name__}")
    if local_dp is not None and not isinstance(local_dp, LocalDPUpload):
        raise TypeError(f"local_dp must be a LocalDPUpload, got {type(local_dp).__name__}")
    spec = _ClientSpec(
        config, dataset, local_dp, key=f"{_dataset_fingerprint(dataset)}:{uuid.uuid4().hex}"
    )
    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        return _client_train(spec, msg, context)

    @app.query()
    def query(msg: Message, context: Context) -> Message:
        return _client_query(spec, msg, context)

    return app


# ---------------------------------------------------------------------------
# Server side


class _NodeSubset(Grid):
    """The round's sampled nodes as a Grid view: the inner strategy sees only them."""

    def __init__(self, grid: Grid, node_ids: Sequence[int]):
        self._grid = grid
        self._ids = [int(n) for n in node_ids]

    def set_run(self, run):
        self._grid.set_run(run)

    @property
    def run(self):
        return self._grid.run

    def create_message(self, content, message_type, dst_node_id, group_id, ttl=None):
        return self._grid.create_message(content, message_type, dst_node_id, group_id, ttl)

    def get_node_ids(self) -> Iterable[int]:
        return list(self._ids)

    def get_nodes(self):
        ids = set(self._ids)
        return [n for n in self._grid.get_nodes() if n.node_id in ids]

    def push_messages(self, messages):
        return self._grid.push_messages(messages)

    def pull_messages(self, message_ids):
        return self._grid.pull_messages(message_ids)

    def send_and_receive(self, messages, *, timeout=None):
        return self._grid.send_and_receive(messages, timeout=timeout)


def default_inner_strategy(config: FederatedConfig) -> Strategy:
    """FedAvg (or FedMedian for ``aggregator="median"``) that addresses every node it
    is offered and asks no client-side evaluation (the server evaluates centrally)."""
    cls = FedMedian if config.aggregator == "median" else FedAvg
    return cls(
        fraction_train=1.0,
        fraction_evaluate=0.0,
        min_train_nodes=0,
        min_evaluate_nodes=0,
        min_available_nodes=0,
    )


@dataclasses.dataclass
class _Pending:
    round_index: int
    selected: np.ndarray
    nodes: list[int]
    weights: list[tf.Tensor]
    start: float
    cpu_start: float


class DPStrategy(Strategy):
    """A Flower strategy wrapping an inner one with dpfl_tf's private round.

    Args:
      strategy: the inner Flower ``Strategy`` (`default_inner_strategy`:
        FedAvg).  It builds the train messages for the nodes `DPStrategy`
        sampled (it must address all of them: FedAvg(fraction_train=1.0,
        min_train_nodes=0, min_available_nodes=0)) and, without DP,
        aggregates the uploaded updates; client evaluation is delegated to it.
      server: the run's `FederatedServer` (`build_server(config)`): its
        sampling, aggregator, ledger, stop rule, evaluation, history and
        privacy report are used as they are.  Its trainer's model holds the
        global weights; its local-training arrays are not used on Flower.
      node_timeout: seconds the first round waits for the K enrolled clients'
        nodes to connect (later rounds do not wait: a sampled client whose node is
        down is a dropout).
      min_nodes: the fewest live enrolled nodes a round runs with (default K: every
        client's node; fewer, and a node lost mid-run does not end the run).
      checkpoint_dir: the server's checkpoint is written there after every round and
        read back by `run` (a Flower run started again continues where it stopped).
      on_round: ``on_round(strategy)`` after every round (after its checkpoint).

    Enrolment.  K = ``config.clients`` is the enrolled population the privacy event
    is about, not the number of live nodes: every node is asked (a ``query``
    message) which client (``partition-id``) it holds; two nodes claiming one
    client, or a client id outside [0, K), are refused, naming the nodes.  The
    round samples clients from the K enrolled ones; a sampled client whose node is
    not alive uploads nothing (a dropout: the round proceeds with the uploads that
    arrive and records the full round's event, which is conservative; the metrics
    say ``uploads`` and ``missing-clients``).  With client-side noise a dropout
    is refused instead (the released sum would carry less noise than accounted).

    Per round ``aggregate_train`` returns (new global weights, a
    MetricRecord with ``epsilon`` (at delta_max, the ledger's), ``delta``
    (at the target epsilon, when one is set), ``clients``, ``accuracy`` /
    ``loss`` when evaluated, the adaptive clip's ``clip`` and
    ``unclipped-fraction-noised`` (its noised release), and the largest composed
    client-side epsilon reported so far).  Before a round that would exceed
    the budget, ``configure_train`` sends nothing and the strategy stops:
    later rounds are empty and ``server.stop_reason`` says why.
    """

    def __init__(
        self,
        strategy: Strategy,
        server: FederatedServer,
        *,
        node_timeout: float = 120.0,
        min_nodes: int | None = None,
        checkpoint_dir: str | None = None,
        on_round: Callable[["DPStrategy"], None] | None = None,
    ):
        super().__init__()
        if not isinstance(strategy, Strategy):
            raise TypeError(f"strategy must be a flwr Strategy, got {type(strategy).__name__}")
        if isinstance(strategy, DPStrategy):
            raise TypeError("strategy must be a plain Flower strategy, not another DPStrategy")
        if not isinstance(server, FederatedServer):
            raise TypeError(f"server must be a FederatedServer, got {type(server).__name__}")
        self.strategy = strategy
        self.server = server
        self.node_timeout = float(node_timeout)
        k = server.num_clients
        self.min_nodes = k if min_nodes is None else check_count("min_nodes", min_nodes, minimum=1)
        if self.min_nodes > k:
            raise ValueError(
                f"min_nodes must be <= the number of clients (K={k}), got {self.min_nodes}"
            )
        self.checkpoint_dir = checkpoint_dir
        self.on_round = on_round
        #: seconds to wait for replies (`run`'s timeout, as for the rounds' replies)
        self.reply_timeout = 3600.0
        #: enrolled clients: partition id -> the node holding it (`_enrol`)
        self.partition_nodes: dict[int, int] = {}
        self.stopped = False
        self.client_metrics: dict[int, dict] = {}
        self._pending: dict[int, _Pending] = {}
        self._reported_round: int | None = None
        self._started = False
        #: the server's dataset (its label goes into the result; `from_config` sets it)
        self.dataset = None

    @classmethod
    def from_config(
        cls, config: FederatedConfig, dataset=None, *, strategy: Strategy | None = None, **kwargs
    ) -> "DPStrategy":
        server, ds = build_server(config, dataset, progress=False)
        out = cls(
            strategy if strategy is not None else default_inner_strategy(config), server, **kwargs
        )
        out.dataset = ds
        return out

    # -- helpers -----------------------------------------------------------------
    def initial_arrays(self) -> ArrayRecord:
        """The global model w_0 (the in-process initial model for the same seed)."""
        return ArrayRecord([np.asarray(w) for w in self.server.trainer.get_weights()])

    def _ask_partitions(self, grid: Grid, node_ids: list[int]) -> None:
        """Asks `node_ids` which client they hold; refuses duplicates and bad ids."""
        messages = [
            grid.create_message(RecordDict({"config": ConfigRecord({})}), "query", n, "dpfl-enrol")
            for n in node_ids
        ]
        # answered by a ClientApp each (on a SuperNode: a process that starts up first)
        for reply in grid.send_and_receive(messages, timeout=self.reply_timeout):
            node = int(reply.metadata.src_node_id)
            if reply.has_error():
                raise ValueError(f"node {node} could not enrol: {reply.error.reason}")
            k = int(_only(reply.content.metric_records, "MetricRecord")[PARTITION_ID_KEY])
            other = self.partition_nodes.get(k)
            if other is not None and other != node:
                raise ValueError(
                    f"nodes {other} and {node} both hold {PARTITION_ID_KEY}={k}: "
                    "every client must run on one node (give each SuperNode "
                    "its own partition-id)"
                )
            self.partition_nodes[k] = node

    def _enrol(self, grid: Grid, wait: bool) -> dict[int, int]:
        """The live enrolled clients, partition id -> node id (waiting up to
        `node_timeout` for K live nodes when `wait`)."""
        k = self.server.num_clients
        deadline = time.monotonic() + (self.node_timeout if wait else 0.0)
        while True:
            live = sorted(int(n) for n in grid.get_node_ids())
            if len(live) >= k or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        self.partition_nodes = {p: n for p, n in self.partition_nodes.items() if n in live}
        known = set(self.partition_nodes.values())
        new = [n for n in live if n not in known]
        if new and len(live) >= self.min_nodes:
            self._ask_partitions(grid, new)
        if len(self.partition_nodes) < self.min_nodes:
            raise ValueError(
                f"the federation has {len(live)} nodes but the config has clients={k}: "
                f"{len(self.partition_nodes)} enrolled clients are alive, fewer than "
                f"min_nodes={self.min_nodes} (K enters the privacy event as the enrolled "
                "population: start the missing SuperNodes, or set min-nodes to run with "
                "dropouts)"
            )
        return dict(self.partition_nodes)

    def _stop(self, reason: str) -> None:
        self.stopped = True
        self.server.stop_reason = reason
        _log.warning(reason)

    def summary(self) -> None:
        srv = self.server
        _log.info(
            "DPStrategy: %s, K=%d, %s sampling, expected m=%g, event %s",
            type(srv.aggregator).__name__,
            srv.num_clients,
            srv.sampling.method.value,
            srv.expected_clients,
            srv.round_event,
        )
        self.strategy.summary()

    # -- train ---------------------------------------------------------------------
    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        srv = self.server
        if self.stopped:
            return []
        reason = srv.budget_stop_reason()  # FederatedServer's stop rule, same method
        if reason is not None:
            self._stop(reason)
            return []
        nodes = self._enrol(grid, wait=not self._started)
        self._started = True
        start, cpu_start = time.perf_counter(), time.process_time()
        t, selected = srv.open_round()  # as FederatedServer.run_round
        chosen = [nodes[int(k)] for k in selected if int(k) in nodes]
        if len(chosen) < len(selected):
            _log.warning(
                "round %d: %d of the %d sampled clients have no live node (dropouts)",
                t + 1,
                len(selected) - len(chosen),
                len(selected),
            )
        weights = [tf.constant(a) for a in arrays.to_numpy_ndarrays()]
        config[ROUND_KEY] = int(t)
        messages: list[Message] = []
        if chosen:
            messages = list(
                self.strategy.configure_train(
                    server_round, arrays, config, _NodeSubset(grid, chosen)
                )
            )
            addressed = sorted(int(m.metadata.dst_node_id) for m in messages)
            if addressed != sorted(chosen):
                raise ValueError(
                    f"the inner strategy addressed {len(addressed)} of the {len(chosen)} nodes "
                    "DPStrategy sampled; it must address every node it is offered (e.g. "
                    "FedAvg(fraction_train=1.0, min_train_nodes=0, min_available_nodes=0)), "
                    "otherwise the sampling differs from the accounted event"
                )
        self._pending[server_round] = _Pending(t, selected, chosen, weights, start, cpu_start)
        return messages

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        srv = self.server
        pending = self._pending.pop(server_round, None)
        if pending is None:  # stopped: nothing was sent
            return None, None
        replies = list(replies)
        failed = [r for r in replies if r.has_error()]
        by_node: dict[int, Message] = {}
        for r in replies:
            if r.has_error():
                continue
            node = int(r.metadata.src_node_id)
            if node not in pending.nodes or node in by_node:
                raise ValueError(
                    f"reply from node {node}, which was not sampled this round or replied twice"
                )
            by_node[node] = r
        missing = len(pending.selected) - len(by_node)  # dropouts and failed replies
        if missing:
            reasons = "; ".join(str(r.error.reason) for r in failed) or "no live node"
            if isinstance(srv.aggregator, ClientNoiseDPAggregator):
                raise RuntimeError(
                    f"{missing} of {len(pending.selected)} clients did not upload ({reasons}); "
                    "with client-side noise the released sum would carry less noise than the "
                    "accounted event, so the round is refused"
                )
            _log.warning(
                "round %d: %d of %d clients did not upload (%s)",
                pending.round_index + 1,
                missing,
                len(pending.selected),
                reasons,
            )
        ordered = [by_node[n] for n in pending.nodes if n in by_node]  # selection order
        for r in ordered:
            metrics = dict(_only(r.content.metric_records, "MetricRecord"))
            self.client_metrics[int(metrics.get("partition-id", -1))] = metrics

        if srv.aggregator.private:
            uploads = (
                (
                    [
                        tf.constant(a)
                        for a in _only(r.content.array_records, "ArrayRecord").to_numpy_ndarrays()
                    ],
                    float(_only(r.content.metric_records, "MetricRecord")["num-examples"]),
                )
                for r in ordered
            )
            result = srv.aggregator.aggregate(
                uploads, pending.weights, expected_clients=srv.expected_clients
            )
            update, info = result.update, dict(result.info)
        elif ordered:
            agg, _ = self.strategy.aggregate_train(server_round, ordered)
            if agg is None:
                raise RuntimeError(
                    f"the inner strategy returned no aggregate for {len(ordered)} uploads"
                )
            update = [tf.constant(a) for a in agg.to_numpy_ndarrays()]
            info = {}
        else:
            update, info = [tf.zeros_like(w) for w in pending.weights], {}
        if srv.aggregator.private:
            released = result.released
        else:
            released = bool(ordered)
        if missing:
            info["missing_clients"] = missing

        # the in-process round's closing: weights, participations, ledger, test, history
        record = srv.close_round(
            pending.round_index,
            pending.selected,
            pending.weights,
            AggregateResult(update, len(ordered), info, released=released),
            start=pending.start,
            cpu_start=pending.cpu_start,
        )
        if self.checkpoint_dir is not None:
            srv.save_checkpoint(self.checkpoint_dir)
        if self.on_round is not None:
            self.on_round(self)
        return ArrayRecord([np.asarray(w) for w in srv.trainer.get_weights()]), self._metrics(
            record
        )

    def _metrics(self, record: RoundRecord) -> MetricRecord:
        missing = int(record.info.get("missing_clients", 0))
        out: dict[str, float | int] = {
            "round": record.round,
            "clients": record.clients,
            "uploads": record.clients - missing,
            "missing-clients": missing,
            "seconds": float(record.seconds),
        }
        if record.epsilon is not None:
            out["epsilon"] = _finite(record.epsilon)
            out["delta-max"] = float(self.server.delta_max)
        if record.delta is not None:
            out["delta"] = float(record.delta)
        if record.accuracy is not None:
            out["accuracy"] = float(record.accuracy)
            out["loss"] = float(record.loss)
        if "unclipped_fraction_noised" in record.info:  # adaptive clipping's release
            out["unclipped-fraction-noised"] = float(record.info["unclipped_fraction_noised"])
            out["clip"] = float(record.info["clip"])
        for key in _CLIENT_EPSILONS:
            values = [m[key] for m in self.client_metrics.values() if key in m]
            if values:
                out[f"max-{key}"] = float(max(values))
        return MetricRecord(out)

    # -- evaluate --------------------------------------------------------------------
    def configure_evaluate(self, server_round, arrays, config, grid):
        if self.stopped:
            return []
        return self.strategy.configure_evaluate(server_round, arrays, config, grid)

    def aggregate_evaluate(self, server_round, replies):
        return self.strategy.aggregate_evaluate(server_round, replies)

    def evaluate_fn(self, server_round: int, arrays: ArrayRecord) -> MetricRecord | None:
        """For ``Strategy.start(evaluate_fn=...)``: the round's central accuracy/loss
        (computed in ``aggregate_train`` on the server's test set)."""
        hist = self.server.history
        if (
            server_round == 0
            or not hist
            or hist[-1].accuracy is None
            or self._reported_round == hist[-1].round
        ):
            return None
        last = hist[-1]
        self._reported_round = last.round
        return MetricRecord({"accuracy": float(last.accuracy), "loss": float(last.loss)})

    # -- the whole run -------------------------------------------------------------------
    def run(self, grid: Grid, num_rounds: int, *, timeout: float = 3600.0):
        """Runs up to `num_rounds` rounds in total (as `FederatedServer.run`) with
        Flower's ``Strategy.start`` and returns its ``Result``."""
        srv = self.server
        srv.stop_reason = None
        self.reply_timeout = float(timeout)
        if self.checkpoint_dir is not None and srv.load_checkpoint(
            self.checkpoint_dir, missing_ok=True
        ):
            _log.warning(
                "resumed from %s: %d rounds, epsilon so far %s",
                self.checkpoint_dir,
                srv.rounds_done,
                srv.epsilon(),
            )
        todo = max(0, int(num_rounds) - srv.rounds_done)
        result = self.start(
            grid,
            self.initial_arrays(),
            num_rounds=todo,
            timeout=timeout,
            train_config=ConfigRecord(),
            evaluate_fn=self.evaluate_fn,
        )
        srv.finish(num_rounds)
        return result


def make_server_app(
    config: FederatedConfig | None = None,
    dataset=None,
    *,
    strategy: Strategy | None = None,
    on_finish: Callable[[DPStrategy, Any, float], None] | None = None,
) -> ServerApp:
    """A Flower ``ServerApp`` running `DPStrategy` for `config.rounds` rounds.

    `config` None reads it from the run config (``flwr run``).  Run-config keys
    besides the config's: ``results-path`` -- the result JSON, rewritten
    atomically after every round with a ``status`` (running, completed,
    budget_spent, failed: the epsilon spent so far is kept when a run fails);
    ``checkpoint-dir`` -- the server's checkpoint after every round, from which
    the same ``flwr run`` started again continues (ledger, weights, history);
    ``min-nodes`` and ``node-timeout`` (`DPStrategy`).
    `on_finish(strategy, flower_result, seconds)` receives the finished
    strategy (`run_on_flower` uses it to build its result)."""
    if config is not None and not isinstance(config, FederatedConfig):
        raise TypeError(f"config must be a FederatedConfig or None, got {type(config).__name__}")
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        from dpfl_tf._runs import ResultsFile
        from dpfl_tf.federated.runner import result_status

        start = time.perf_counter()
        run_config = dict(context.run_config)
        cfg = config if config is not None else config_from_run_config(run_config)
        path = run_config.get("results-path")
        results = ResultsFile(str(path)) if path else None

        def write(status: str, dp: DPStrategy, **extra) -> None:
            if results is not None:
                results.write(
                    status,
                    _result(cfg, dp, time.perf_counter() - start, backend="flwr run"),
                    **extra,
                )

        dp = DPStrategy.from_config(
            cfg,
            dataset,
            strategy=strategy,
            node_timeout=float(run_config.get("node-timeout", 120.0)),
            min_nodes=run_config.get("min-nodes"),
            checkpoint_dir=run_config.get("checkpoint-dir") or None,
            on_round=lambda d: write("running", d),
        )
        try:
            result = dp.run(grid, cfg.rounds)
        except Exception as e:
            write("failed", dp, error=f"{type(e).__name__}: {e}")
            raise
        seconds = time.perf_counter() - start
        if on_finish is not None:
            on_finish(dp, result, seconds)
        report = dp.server.privacy_report()
        last = dp.server.history[-1] if dp.server.history else None
        _log.warning(
            "dpfl_tf on Flower: %s; accuracy %s; epsilon %s at delta %s",
            dp.server.stop_reason,
            None if last is None else last.accuracy,
            report.get("epsilon"),
            report.get("delta"),
        )
        write(result_status(dp.server.stop_reason), dp)

    return app


# ---------------------------------------------------------------------------
# A Grid without Ray: Flower's apps, strategies and records, delivered in-process


def _ensure_task_identity(run_id: int) -> None:
    """Messages take their run id and source node from the process's task identity,
    which Flower's runtimes set (`run_simulation` does the same for its process)."""
    from flwr.common.constant import SUPERLINK_NODE_ID
    from flwr.supercore.task_identity import TaskIdentity

    if TaskIdentity._run_id is None:
        TaskIdentity.run_id = int(run_id)
        TaskIdentity.task_id = 1
        TaskIdentity.node_id = SUPERLINK_NODE_ID


class LocalGrid(Grid):
    """Delivers messages by calling the ClientApp in this process, one node after
    another (no Ray, no SuperLink).  Node k+1 holds partition k, so the sorted node
    ids are in partition order.  For tests and small runs; the Simulation Engine
    (`run_on_flower(..., backend="ray")`) is the scalable path."""

    def __init__(
        self,
        client_app: ClientApp,
        num_nodes: int,
        *,
        run_config: dict | None = None,
        num_partitions: int | None = None,
        raise_client_errors: bool = True,
    ):
        if not isinstance(client_app, ClientApp):
            raise TypeError(f"client_app must be a flwr ClientApp, got {type(client_app).__name__}")
        if int(num_nodes) < 1:
            raise ValueError(f"num_nodes must be >= 1, got {num_nodes}")
        self._app = client_app
        parts = int(num_partitions if num_partitions is not None else num_nodes)
        self._run = Run.create_empty(run_id=1)
        self.contexts = {
            k + 1: Context(
                run_id=1,
                node_id=k + 1,
                node_config={PARTITION_ID_KEY: k, NUM_PARTITIONS_KEY: parts},
                state=RecordDict(),
                run_config=dict(run_config or {}),
            )
            for k in range(int(num_nodes))
        }
        self._replies: dict[str, Message] = {}
        self.raise_client_errors = bool(raise_client_errors)
        #: nodes taken down by `stop_node`
        self.down: set[int] = set()
        _ensure_task_identity(1)

    def set_run(self, run) -> None:
        self._run = run

    @property
    def run(self):
        return self._run

    def create_message(self, content, message_type, dst_node_id, group_id, ttl=None):
        return Message(content, dst_node_id, message_type, ttl=ttl, group_id=group_id)

    def get_node_ids(self) -> Iterable[int]:
        return [n for n in self.contexts if n not in self.down]

    def stop_node(self, node_id: int) -> None:
        """Takes a node down (tests: a SuperNode lost mid-run): it leaves
        `get_node_ids` and a message sent to it gets an error reply."""
        self.down.add(int(node_id))

    def push_messages(self, messages) -> Iterable[str]:
        ids = []
        for msg in messages:
            node = int(msg.metadata.dst_node_id)
            if node not in self.contexts:
                raise ValueError(f"no node {node} in this LocalGrid")
            msg_id = uuid.uuid4().hex
            try:
                if node in self.down:  # as Flower's SuperLink: an error reply, not a raise
                    reply = Message(Error(code=0, reason=f"node {node} is offline"), reply_to=msg)
                else:  # a copy, as a transport delivers: a ClientApp may change its message
                    reply = self._app(copy.deepcopy(msg), self.contexts[node])
            except Exception as exc:
                if self.raise_client_errors:
                    raise
                # as on Flower: a failing ClientApp becomes an error reply
                reply = Message(Error(code=0, reason=f"{type(exc).__name__}: {exc}"), reply_to=msg)
            self._replies[msg_id] = reply
            ids.append(msg_id)
        return ids

    def pull_messages(self, message_ids) -> Iterable[Message]:
        return [self._replies.pop(i) for i in list(message_ids) if i in self._replies]

    def send_and_receive(self, messages, *, timeout=None) -> Iterable[Message]:
        return self.pull_messages(self.push_messages(messages))


# ---------------------------------------------------------------------------
# One config, on Flower


def _result(config: FederatedConfig, dp: DPStrategy, seconds: float, *, backend: str) -> dict:
    """`runner.federated_result` (the in-process result, one function) plus what only a
    Flower run has: the runtime's labels and what the clients reported of themselves."""
    client_side = {}
    for key in _CLIENT_EPSILONS:
        values = [m[key] for m in dp.client_metrics.values() if key in m]
        if values:  # JSON-ready: an infinite epsilon is None with a flag
            top = float(max(values))
            name = f"max_{key.replace('-', '_')}"
            client_side[name] = top if math.isfinite(top) else None
            if not math.isfinite(top):
                client_side[f"{name}_is_infinite"] = True
    return {
        **federated_result(config, dp.server, dp.dataset, seconds=seconds),
        "runtime": "flower",
        "flower_backend": backend,
        "flwr_version": FLOWER_VERSION,
        "client_reported": client_side,
    }


def run_on_flower(
    config: FederatedConfig,
    dataset=None,
    *,
    backend: str = "ray",
    backend_config: dict | None = None,
    local_dp: LocalDPUpload | None = None,
    strategy: Strategy | None = None,
    verbose: bool = False,
) -> dict[str, Any]:
    """Runs `config` on Flower and returns the `run_federated` result dict
    (plus ``runtime``, ``flower_backend``, ``flwr_version``, ``client_reported``).

    Args:
      config: the same `FederatedConfig` `run_federated` takes; K =
        ``config.clients`` simulated SuperNodes, one partition each.
      dataset: as for `run_federated` (default: loaded by every process).
      backend: ``"ray"`` -- Flower's Simulation Engine
        (`flwr.simulation.run_simulation`; Ray starts locally, or joins the
        cluster of ``ray start`` / ``RAY_ADDRESS``); ``"local"`` -- `LocalGrid`,
        no Ray.
      backend_config: Flower's backend config for ``"ray"`` (default: one CPU
        per ClientApp, no GPU).
      local_dp: a client-side `LocalDPUpload`.
      strategy: the inner Flower strategy (default `default_inner_strategy`).

    ``dp="distributed"`` runs in Flower's SecAgg+ workflow instead
    (`dpfl_tf.federated.flower_secagg.run_on_secagg`).
      verbose: keep Flower's INFO logging (default: warnings only).
    """
    if not isinstance(config, FederatedConfig):
        raise TypeError(f"config must be a FederatedConfig, got {type(config).__name__}")
    if config.dp is DPMode.DISTRIBUTED:  # Flower's secure aggregation (SecAgg+)
        if local_dp is not None or strategy is not None:
            raise ValueError(
                "dp='distributed' runs in Flower's SecAggPlusWorkflow with "
                "DistributedDPStrategy: local_dp and strategy must be None"
            )
        from dpfl_tf.federated.flower_secagg import run_on_secagg

        return run_on_secagg(
            config, dataset, backend=backend, backend_config=backend_config, verbose=verbose
        )
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")
    if backend_config is not None and backend != "ray":
        raise ValueError("backend_config is for backend='ray' only")
    finished: dict[str, Any] = {}

    def on_finish(dp, result, seconds):
        finished.update(strategy=dp, result=result, seconds=seconds)

    client = make_client_app(config, dataset, local_dp=local_dp)
    server = make_server_app(config, dataset, strategy=strategy, on_finish=on_finish)
    run_apps(
        server,
        client,
        config.clients,
        backend=backend,
        backend_config=backend_config,
        verbose=verbose,
    )
    if "strategy" not in finished:
        raise RuntimeError(
            f"the Flower run ({backend}) ended without finishing the ServerApp; "
            "see Flower's log above"
        )
    return _result(config, finished["strategy"], finished["seconds"], backend=backend)


def run_apps(
    server: ServerApp,
    client: ClientApp,
    num_nodes: int,
    *,
    backend: str = "ray",
    backend_config: dict | None = None,
    verbose: bool = False,
    raise_client_errors: bool = True,
) -> None:
    """Runs a ServerApp with `num_nodes` nodes of a ClientApp: on Flower's Simulation
    Engine (``"ray"``; one CPU per ClientApp unless `backend_config` says otherwise) or
    on `LocalGrid` (``"local"``; a failing ClientApp raises unless
    ``raise_client_errors=False``, which makes it an error reply as on Flower).
    Flower logs warnings only unless `verbose`."""
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")
    flwr_logger = logging.getLogger("flwr")
    level = flwr_logger.level
    if not verbose:
        flwr_logger.setLevel(logging.WARNING)
    try:
        if backend == "ray":
            from flwr.simulation import run_simulation

            run_simulation(
                server_app=server,
                client_app=client,
                num_supernodes=int(num_nodes),
                backend_config=backend_config
                or {"client_resources": {"num_cpus": 1, "num_gpus": 0.0}},
                verbose_logging=verbose,
            )
        else:
            grid = LocalGrid(client, int(num_nodes), raise_client_errors=raise_client_errors)
            server(
                grid,
                Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config={}),
            )
    finally:
        flwr_logger.setLevel(level)


#: For ``flwr run``: in ``[tool.flwr.app.components]``,
#: ``serverapp = "dpfl_tf.federated.flower:server_app"`` and
#: ``clientapp = "dpfl_tf.federated.flower:client_app"``; the FederatedConfig comes
#: from ``[tool.flwr.app.config]`` (see `config_from_run_config`).
client_app = make_client_app()
server_app = make_server_app()
