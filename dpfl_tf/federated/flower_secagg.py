"""Distributed DP on Flower's secure aggregation: the SecAgg+ protocol itself.

Flower's ``SecAggPlusWorkflow`` (server) and ``secaggplus_mod`` (client) run
the SecAgg+ protocol (Bell et al. 2020): clients mask their integer vectors
with pairwise and private masks, the server learns only their sum modulo a
power of two, and clients that drop out after sharing their keys are
recovered from the others' secret shares.  Flower quantizes the updates and
adds no noise.  This module runs `dpfl_tf.federated.distributed_dp` inside it:

* `distributed_dp_mod` -- a client mod, placed inside ``secaggplus_mod``
  (``mods=[secaggplus_mod, distributed_dp_mod]``): it takes the update the
  ClientApp's ``fit`` returns (Delta_k, not the new weights) and applies the
  mechanism's client step (`DistributedDP.encode`: clip, rotate, scale, round,
  add this client's discrete noise share, wrap at b bits) before SecAgg+ masks
  it.  The mechanism's parameters, the round and its public rotation seed come
  in the fit config from the strategy.
* `DistributedDPStrategy` -- a Flower (legacy) strategy over an ordinary
  `FederatedServer` whose aggregator is a `DistributedDPAggregator`: it samples
  the round's clients, sends the mechanism's parameters, recovers the sum
  modulo 2^b from what SecAgg+ outputs, decodes it (the same
  `DistributedDPAggregator.release` as in-process) and closes the round with
  the in-process server's own bookkeeping (ledger, evaluation, history).
* `make_dropout_mod` -- simulated dropouts: a sampled client fails before it
  sends its masked vector with the in-process aggregator's probability and
  stream, so both runtimes drop the same clients.
* `run_on_secagg(config)` -- the same `FederatedConfig` (``dp="distributed"``)
  on Flower's simulation engine (Ray) or `dpfl_tf.federated.flower.LocalGrid`.

Carrying b-bit vectors through Flower's quantizer.  SecAgg+ maps each value x
to (clip(x, -C, C) + C) T / (2C) (stochastic rounding), sums modulo
``modulus_range`` and needs ``quantization_range`` T < ``modulus_range``.
With T = 2^b + 2, C = T / 2 (the map is x -> x + C, exact on integers) and
``modulus_range`` = 2^(b+1), a client's vector, centred into [-2^(b-1),
2^(b-1)), passes unchanged; SecAgg+ reveals sum_i (v_i + C) mod 2^(b+1), and
the strategy reduces it modulo 2^b (`secagg_ranges`, `recover_sum`).  So each
coordinate travels with b + 1 bits on Flower (one more than the mechanism
needs: Flower's quantization range must be below its modulus).  Each client
reports weight 1 (``max_weight`` 1.0): the strategy divides by the number of
uploads itself.

Dropouts and the accounting.  With ``num_shares`` = all the round's clients
and ``reconstruction_threshold`` = n_min / m, SecAgg+ halts a round unless
every client keeps >= n_min live neighbours, i.e. unless >= n_min masked
vectors arrive (`secagg_min_survivors`): the noise of at least n_min shares is
in every released sum, which is what the events assume.  A halted round
releases nothing; it is still recorded (conservative).

Trust.  The server sees only the SecAgg+ sum (and who took part); what it
learns is bounded by the privacy report's ``against_server`` epsilon.
SecAgg+ is secure against an honest-but-curious server and a bounded number
of colluding clients (Bell et al. 2020); a server that lies about who dropped
out, or clients that collude with it, are outside this guarantee.
"""

from __future__ import annotations

try:
    import flwr.compat.common.recorddict_compat as compat
    from flwr.app import ConfigRecord, Context, Message
    from flwr.client import ClientApp, NumPyClient
    from flwr.client.mod import secaggplus_mod
    from flwr.common import FitIns, GetPropertiesIns, ndarrays_to_parameters, parameters_to_ndarrays
    from flwr.common.constant import MessageTypeLegacy
    from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key, Stage
    from flwr.server import LegacyContext, ServerApp, ServerConfig
    from flwr.server.strategy import Strategy as LegacyStrategy
    from flwr.server.workflow import DefaultWorkflow, SecAggPlusWorkflow
except ImportError as _exc:  # pragma: no cover
    raise ImportError(
        "dpfl_tf.federated.flower_secagg needs Flower (flwr >= 1.41); install the "
        "extra with: pip install 'dpfl-tf[flower]'"
    ) from _exc

import dataclasses
import functools
import logging
import math
import time
import uuid
from typing import Any, Callable

import numpy as np
import tensorflow as tf

from dpfl_tf._seeds import derive_seed
from dpfl_tf.discrete_noise import GeneratorSource, SecureSource
from dpfl_tf.federated.aggregators import DistributedDPAggregator, dropped_out
from dpfl_tf.federated.distributed_dp import DistributedDP, flatten
from dpfl_tf.federated.flower import (
    PARTITION_ID_KEY,
    ROUND_KEY,
    _ClientSpec,
    _dataset_fingerprint,
    _partition_id,
    _result,
    _runtime,
    config_from_run_config,
    run_apps,
)
from dpfl_tf.federated.runner import DPMode, FederatedConfig, build_server
from dpfl_tf.federated.server import FederatedServer

__all__ = [
    "DistributedDPStrategy",
    "client_app",
    "distributed_dp_mod",
    "make_dropout_mod",
    "make_secagg_client_app",
    "make_secagg_server_app",
    "recover_sum",
    "run_on_secagg",
    "secagg_min_survivors",
    "secagg_ranges",
    "server_app",
]

_log = logging.getLogger("dpfl_tf.federated.flower_secagg")
#: the fit-config keys of the mechanism (`mechanism_config`, `mechanism_from_config`)
_PREFIX = "dpfl-ddp-"
_FIELDS = (
    "mechanism",
    "bits",
    "l2_norm_clip",
    "noise_multiplier",
    "clients_per_round",
    "dimension",
    "min_clients",
    "beta",
    "overflow_probability",
    "block_size",
)
ROTATION_KEY = "dpfl-rotation-seed"
NOISE_SEED_KEY = "dpfl-noise-seed"


# ---------------------------------------------------------------------------
# The b-bit transport through SecAgg+


def secagg_ranges(bits: int) -> dict:
    """SecAggPlusWorkflow's quantization settings that carry centred b-bit integers
    unchanged (module docstring): T = 2^b + 2, C = T/2, modulus 2^(b+1), weight 1."""
    m = 1 << int(bits)
    return {
        "clipping_range": float(m // 2 + 1),
        "quantization_range": m + 2,
        "modulus_range": 2 * m,
        "max_weight": 1.0,
    }


def recover_sum(aggregated: np.ndarray, uploads: int, bits: int) -> np.ndarray:
    """sum_i v_i mod 2^b from what SecAgg+ hands the strategy for `uploads` vectors:
    Flower returns (S - n C) T / q with S = sum_i (v_i + C) mod 2^(b+1) and
    q = n T mod 2^(b+1) (its weight factor); both T and q are known, so
    S - n C = a q / T exactly (after rounding off float64's error)."""
    r = secagg_ranges(bits)
    t, mod = r["quantization_range"], r["modulus_range"]
    q = (int(uploads) * t) % mod
    if q == 0:
        raise ValueError(
            f"{uploads} uploads at bits={bits}: SecAgg+'s weight factor wraps to "
            "0 (needs fewer uploads than 2^b)"
        )
    return np.mod(
        np.rint(np.asarray(aggregated, np.float64) * (q / t)).astype(np.int64), 1 << int(bits)
    )


def secagg_min_survivors(num_clients: int, num_shares: int, threshold: int) -> int:
    """The fewest masked vectors with which SecAggPlusWorkflow finishes a round of
    `num_clients` = m: every client needs >= `threshold` live neighbours among its
    window of w = min(m, 2 floor(num_shares / 2) + 1) (itself included), so summing
    over the m windows, w x survivors >= m x threshold."""
    m = int(num_clients)
    w = min(m, 2 * (int(num_shares) // 2) + 1)
    return math.ceil(m * int(threshold) / w)


def centred(v: np.ndarray, bits: int) -> np.ndarray:
    """v in [0, 2^b) as the congruent integer in [-2^(b-1), 2^(b-1)) (float64)."""
    m = 1 << int(bits)
    return np.where(v >= m // 2, v - m, v).astype(np.float64)


# ---------------------------------------------------------------------------
# The mechanism's parameters in a fit config


def mechanism_config(mechanism: DistributedDP) -> dict:
    """The `DistributedDP`'s parameters as fit-config entries."""
    out = {}
    for name in _FIELDS:
        value = getattr(mechanism, name)
        out[_PREFIX + name] = value.value if name == "mechanism" else value
    return out


@functools.lru_cache(maxsize=8)
def _mechanism(items: tuple) -> DistributedDP:
    return DistributedDP(**dict(items))


def mechanism_from_config(config) -> DistributedDP:
    """The `DistributedDP` a fit config describes (`mechanism_config`), built once."""
    missing = [_PREFIX + n for n in _FIELDS if _PREFIX + n not in config]
    if missing:
        raise ValueError(
            f"the fit config lacks {', '.join(missing)}: distributed_dp_mod "
            "answers rounds configured by DistributedDPStrategy"
        )
    return _mechanism(tuple((n, config[_PREFIX + n]) for n in _FIELDS))


def _fit_config(msg: Message) -> ConfigRecord:
    for name, record in msg.content.config_records.items():
        if name != RECORD_KEY_CONFIGS and ROUND_KEY in record:
            return record
    raise ValueError(
        f"the message has no fit config with {ROUND_KEY!r}: this client answers "
        "rounds configured by DistributedDPStrategy"
    )


# ---------------------------------------------------------------------------
# Client side


def distributed_dp_mod(msg: Message, context: Context, call_next) -> Message:
    """Client mod: the distributed DP client step on the ClientApp's fit result.

    Place it inside Flower's SecAgg+ mod, ``mods=[secaggplus_mod,
    distributed_dp_mod]``: it then runs when SecAgg+ asks for the masked vector.
    The ClientApp's ``fit`` must return the model update Delta_k.  The mod
    encodes it with the `DistributedDP` of the fit config (`mechanism_from_config`)
    and the round's public rotation seed, from this client's noise stream
    (``(noise seed, "client-noise", t, k)`` when the config carries a noise seed
    -- tests only -- else the OS's secure source), and replaces the fit result by
    the centred b-bit vector with weight 1 (`secagg_ranges`).  Outside SecAgg+
    it refuses: the noised vector alone is protected only by one share's noise.
    """
    if msg.metadata.message_type != "train":
        return call_next(msg, context)
    if RECORD_KEY_CONFIGS not in msg.content.config_records:
        raise ValueError(
            "distributed_dp_mod runs inside Flower's secure aggregation: use "
            "mods=[secaggplus_mod, distributed_dp_mod] with SecAggPlusWorkflow "
            "(one client's noised vector must never leave it in the clear)"
        )
    config = _fit_config(msg)
    mech = mechanism_from_config(config)
    out = call_next(msg, context)
    if out.has_error():
        return out
    fitres = compat.recorddict_to_fitres(out.content, keep_input=True)
    update = parameters_to_ndarrays(fitres.parameters)
    t = int(config[ROUND_KEY])
    k = int(context.node_config[PARTITION_ID_KEY])
    source = (
        GeneratorSource(derive_seed(int(config[NOISE_SEED_KEY]), "client-noise", t, k))
        if NOISE_SEED_KEY in config
        else SecureSource()
    )
    v = mech.encode(flatten(update), int(config[ROTATION_KEY]), source)
    fitres.parameters = ndarrays_to_parameters([centred(v, mech.bits)])
    fitres.num_examples = 1
    out.content = compat.fitres_to_recorddict(fitres, keep_input=True)
    return out


def make_dropout_mod(rate: float, seed: int):
    """A client mod (outermost: ``mods=[dropout_mod, secaggplus_mod, ...]``) that
    makes client k fail in round t when SecAgg+ asks for its masked vector, with
    probability `rate`, from the stream (seed, "dropout", t, k) -- the in-process
    `DistributedDPAggregator.dropped_out`: a client that drops out after sharing
    its keys and before uploading (SecAgg+ recovers its pairwise masks)."""

    def dropout_mod(msg: Message, context: Context, call_next) -> Message:
        secagg = msg.content.config_records.get(RECORD_KEY_CONFIGS)
        if (
            rate > 0
            and secagg is not None
            and secagg.get(Key.STAGE) == Stage.COLLECT_MASKED_VECTORS
        ):
            t = int(_fit_config(msg)[ROUND_KEY])
            k = int(context.node_config[PARTITION_ID_KEY])
            if dropped_out(rate, seed, t, k):
                raise RuntimeError(f"client {k} dropped out of round {t + 1} (simulated)")
        return call_next(msg, context)

    return dropout_mod


class _UpdateClient(NumPyClient):
    """Trains with the in-process client step and returns Delta_k (the mod encodes it)."""

    def __init__(self, spec: _ClientSpec, context: Context):
        self.config, self.k = _partition_id(
            spec, dict(context.run_config), dict(context.node_config)
        )
        self.spec = spec

    def get_properties(self, config):
        return {PARTITION_ID_KEY: self.k}

    def get_parameters(self, config):
        return []

    def fit(self, parameters, config):
        server = _runtime(self.spec, self.config)
        weights = [tf.constant(p) for p in parameters]
        upload, _ = server.client_upload(self.k, weights, int(config[ROUND_KEY]), client_step=False)
        return [np.asarray(u, dtype=np.float64) for u in upload], 1, {PARTITION_ID_KEY: self.k}


def make_secagg_client_app(config: FederatedConfig | None = None, dataset=None) -> ClientApp:
    """A Flower ClientApp for ``dp="distributed"``: local training as in-process,
    then `distributed_dp_mod` inside ``secaggplus_mod``, and the config's simulated
    dropouts (`make_dropout_mod`) outside both.  `config` None reads it from the run
    config (``flwr run``)."""
    spec = _ClientSpec(
        config, dataset, None, key=f"{_dataset_fingerprint(dataset)}:{uuid.uuid4().hex}"
    )

    def client_fn(context: Context):
        return _UpdateClient(spec, context).to_client()

    mods = [secaggplus_mod, distributed_dp_mod]
    if config is not None and config.dropout_rate > 0:
        mods.insert(0, make_dropout_mod(config.dropout_rate, derive_seed(config.seed, "dropout")))
    return ClientApp(client_fn=client_fn, mods=mods)


# ---------------------------------------------------------------------------
# Server side


@dataclasses.dataclass
class _Pending:
    round_index: int
    selected: np.ndarray
    weights: list
    start: float
    cpu_start: float


class DistributedDPStrategy(LegacyStrategy):
    """A Flower strategy for SecAggPlusWorkflow over a `FederatedServer` with a
    `DistributedDPAggregator` (module docstring): the in-process sampling, stop
    rule, decoding, ledger, evaluation and history, on SecAgg+'s sum.

    Enrolment (`enrol`): every node is asked which client (``partition-id``) it
    holds; K enters the event as the enrolled population.  A sampled client whose
    node is not alive is a dropout.  Rounds the workflow halts (fewer than
    ``min_clients`` masked vectors) are closed at the next round as aborted
    (nothing released; the event recorded, conservatively).
    """

    def __init__(self, server: FederatedServer, *, timeout: float | None = None):
        super().__init__()
        if not isinstance(server, FederatedServer):
            raise TypeError(f"server must be a FederatedServer, got {type(server).__name__}")
        if not isinstance(server.aggregator, DistributedDPAggregator):
            raise TypeError(
                "DistributedDPStrategy runs dp='distributed' (a "
                "DistributedDPAggregator), got "
                f"{type(server.aggregator).__name__}"
            )
        self.server = server
        self.aggregator = server.aggregator
        self.mechanism = server.aggregator.mechanism
        if self.mechanism.clients_per_round >= self.mechanism.modulus // 2:
            raise ValueError(
                f"bits={self.mechanism.bits} is too few for SecAgg+ with "
                f"{self.mechanism.clients_per_round} clients per round (its weight "
                "factor needs m < 2^(b-1))"
            )
        self.timeout = timeout
        self.partition_nodes: dict[int, int] = {}
        self.client_metrics: dict[int, dict] = {}
        self.dataset = None
        self._pending: _Pending | None = None

    @classmethod
    def from_config(cls, config: FederatedConfig, dataset=None, **kwargs):
        server, ds = build_server(config, dataset, progress=False)
        out = cls(server, **kwargs)
        out.dataset = ds
        return out

    def workflow(self) -> SecAggPlusWorkflow:
        """Flower's SecAgg+ with every client a neighbour of every other and the
        threshold n_min / m: a round finishes only with >= min_clients uploads."""
        m, n_min = self.mechanism.clients_per_round, self.mechanism.min_clients
        flow = SecAggPlusWorkflow(
            num_shares=1.0,
            reconstruction_threshold=n_min / m,
            timeout=self.timeout,
            **secagg_ranges(self.mechanism.bits),
        )
        threshold = max(round(n_min / m * m), 2)
        if secagg_min_survivors(m, m, threshold) < n_min:
            raise ValueError(f"SecAgg+ would finish rounds with fewer than min_clients={n_min}")
        return flow

    def enrol(self, grid) -> dict[int, int]:
        """Asks every node which client it holds (one batch of get_properties messages);
        two nodes claiming one client are refused, naming them."""
        content = compat.getpropertiesins_to_recorddict(GetPropertiesIns({}))
        messages = [
            grid.create_message(content, MessageTypeLegacy.GET_PROPERTIES, n, "dpfl-enrol")
            for n in grid.get_node_ids()
        ]
        for reply in grid.send_and_receive(messages, timeout=self.timeout):
            node = int(reply.metadata.src_node_id)
            if reply.has_error():
                raise ValueError(f"node {node} could not enrol: {reply.error.reason}")
            k = int(
                compat.recorddict_to_getpropertiesres(reply.content).properties[PARTITION_ID_KEY]
            )
            other = self.partition_nodes.get(k)
            if other is not None and other != node:
                raise ValueError(f"nodes {other} and {node} both hold {PARTITION_ID_KEY}={k}")
            self.partition_nodes[k] = node
        return dict(self.partition_nodes)

    # -- the legacy Strategy ------------------------------------------------------------
    def initialize_parameters(self, client_manager):
        return ndarrays_to_parameters([np.asarray(w) for w in self.server.trainer.get_weights()])

    def configure_fit(self, server_round, parameters, client_manager):
        srv = self.server
        self._close_aborted()
        reason = srv.budget_stop_reason()  # FederatedServer's stop rule
        if reason is not None:
            srv.stop_reason = reason
            return []
        start, cpu_start = time.perf_counter(), time.process_time()
        t, selected = srv.open_round()
        proxies = client_manager.all()
        chosen = [
            proxies[str(self.partition_nodes[int(k)])]
            for k in selected
            if int(k) in self.partition_nodes and str(self.partition_nodes[int(k)]) in proxies
        ]
        if len(chosen) < len(selected):
            _log.warning(
                "round %d: %d of the %d sampled clients have no live node",
                t + 1,
                len(selected) - len(chosen),
                len(selected),
            )
        config: dict[str, Any] = {
            ROUND_KEY: int(t),
            ROTATION_KEY: self.aggregator.rotation_seed(t),
            **mechanism_config(self.mechanism),
        }
        if srv.noise_seed is not None:
            config[NOISE_SEED_KEY] = int(srv.noise_seed)
        weights = [tf.constant(a) for a in parameters_to_ndarrays(parameters)]
        self._pending = _Pending(t, selected, weights, start, cpu_start)
        fit_ins = FitIns(parameters, config)
        return [(proxy, fit_ins) for proxy in chosen]

    def aggregate_fit(self, server_round, results, failures):
        pending, self._pending = self._pending, None
        if pending is None or not results:
            return None, {}
        count = len(results)
        for _, res in results:
            k = int(res.metrics.get(PARTITION_ID_KEY, -1))
            self.client_metrics[k] = dict(res.metrics)
        aggregated = parameters_to_ndarrays(results[0][1].parameters)[0]
        total = recover_sum(aggregated, count, self.mechanism.bits)
        result = self.aggregator.release(total, count, pending.weights)
        if count < len(pending.selected):
            result.info["missing_clients"] = len(pending.selected) - count
        record = self.server.close_round(
            pending.round_index,
            pending.selected,
            pending.weights,
            result,
            start=pending.start,
            cpu_start=pending.cpu_start,
        )
        metrics = {
            "round": record.round,
            "uploads": count,
            "epsilon": float(record.epsilon) if record.epsilon is not None else -1.0,
        }
        if record.accuracy is not None:
            metrics["accuracy"] = float(record.accuracy)
        new = [np.asarray(w) for w in self.server.trainer.get_weights()]
        return ndarrays_to_parameters(new), metrics

    def _close_aborted(self) -> None:
        """Closes a round SecAgg+ halted (aggregate_fit never came): nothing released."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        _log.warning(
            "round %d: SecAgg+ halted (fewer than %d uploads): nothing released",
            pending.round_index + 1,
            self.mechanism.min_clients,
        )
        result = self.aggregator.release(
            np.zeros(self.mechanism.padded_dimension, np.int64), 0, pending.weights
        )
        self.server.close_round(
            pending.round_index,
            pending.selected,
            pending.weights,
            result,
            start=pending.start,
            cpu_start=pending.cpu_start,
        )

    def configure_evaluate(self, server_round, parameters, client_manager):
        return []

    def aggregate_evaluate(self, server_round, results, failures):
        return None, {}

    def evaluate(self, server_round, parameters):
        return None  # the server evaluates when it closes a round

    def finish(self, rounds: int) -> None:
        self._close_aborted()
        self.server.finish(rounds)


def make_secagg_server_app(
    config: FederatedConfig | None = None,
    dataset=None,
    *,
    timeout: float | None = None,
    on_finish: Callable | None = None,
) -> ServerApp:
    """A Flower ServerApp running `DistributedDPStrategy` in SecAggPlusWorkflow for
    ``config.rounds`` rounds (`config` None: from the run config).
    ``on_finish(strategy, seconds)`` receives the finished strategy."""
    app = ServerApp()

    @app.main()
    def main(grid, context: Context) -> None:
        start = time.perf_counter()
        cfg = config if config is not None else config_from_run_config(dict(context.run_config))
        strategy = DistributedDPStrategy.from_config(cfg, dataset, timeout=timeout)
        strategy.enrol(grid)
        legacy = LegacyContext(
            context=context, config=ServerConfig(num_rounds=cfg.rounds), strategy=strategy
        )
        DefaultWorkflow(fit_workflow=strategy.workflow())(grid, legacy)
        strategy.finish(cfg.rounds)
        if on_finish is not None:
            on_finish(strategy, time.perf_counter() - start)

    return app


def run_on_secagg(
    config: FederatedConfig,
    dataset=None,
    *,
    backend: str = "ray",
    backend_config: dict | None = None,
    timeout: float | None = None,
    verbose: bool = False,
) -> dict[str, Any]:
    """Runs a ``dp="distributed"`` `FederatedConfig` on Flower's SecAgg+ and returns the
    `run_federated` result dict (plus the runtime labels of
    `dpfl_tf.federated.flower.run_on_flower`, which calls this for such configs).
    ``backend``: "ray" (the Simulation Engine) or "local" (`LocalGrid`, no Ray)."""
    if not isinstance(config, FederatedConfig) or config.dp is not DPMode.DISTRIBUTED:
        raise ValueError("run_on_secagg runs a FederatedConfig with dp='distributed'")
    finished: dict[str, Any] = {}
    client = make_secagg_client_app(config, dataset)
    server = make_secagg_server_app(
        config,
        dataset,
        timeout=timeout,
        on_finish=lambda s, sec: finished.update(strategy=s, seconds=sec),
    )
    # a client that drops out fails its ClientApp: an error reply, as on Flower
    run_apps(
        server,
        client,
        config.clients,
        backend=backend,
        backend_config=backend_config,
        verbose=verbose,
        raise_client_errors=False,
    )
    if "strategy" not in finished:
        raise RuntimeError(
            f"the Flower run ({backend}) ended without finishing the ServerApp; "
            "see Flower's log above"
        )
    return _result(config, finished["strategy"], finished["seconds"], backend=f"{backend}, SecAgg+")


#: For ``flwr run`` of a ``dp="distributed"`` app: in ``[tool.flwr.app.components]``,
#: ``serverapp = "dpfl_tf.federated.flower_secagg:server_app"`` and
#: ``clientapp = "dpfl_tf.federated.flower_secagg:client_app"``; the FederatedConfig comes
#: from ``[tool.flwr.app.config]`` (`dpfl_tf.federated.flower.config_from_run_config`).
client_app = make_secagg_client_app()
server_app = make_secagg_server_app()
