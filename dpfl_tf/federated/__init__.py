"""Federated learning with client-level differential privacy.

A thin layer over Keras models that reuses the DP-SGD sanitizer
(`dpfl_tf.sanitizer.GaussianSanitizer`) with one client's model update as
the record:

* `partition` -- client partitions (IID, label shards, Dirichlet, unequal sizes);
* `client` -- `LocalTrainer`: local SGD on one reused model, Delta_k = w_k - w_t;
* `aggregators` -- FedAvg mean, FedMedian, Global DP (Geyer et al. 2017) and
  DP-FedAvg with client-side noise;
* `server` -- `FederatedServer`: the round loop, client sampling, the privacy
  ledger and stop rule, checkpoints;
* `server_optimizers` -- `ServerOptimizer`: FedAvg, FedAvgM, FedAdagrad,
  FedAdam, FedYogi on the released aggregate, and `ModelAverage` of the released
  models (post-processing);
* `runner` -- `FederatedConfig` + `run_federated` (CLI, experiments, notebook);
* `local_dp` -- local-DP perturbation of uploads (Duchi, Piecewise, PNPM,
  LDP-FL, Laplace, Gaussian) and honest per-coordinate / per-upload reports;
* `cli` -- ``dpfl-tf federated``.

TensorFlow is imported only when a submodule that needs it is used.
"""

from __future__ import annotations

from dpfl_tf._lazy import lazy_exports as _lazy_exports

_EXPORTS = {
    "ClientPartition": ".partition",
    "PartitionScheme": ".partition",
    "make_partition": ".partition",
    "iid_partition": ".partition",
    "shard_partition": ".partition",
    "dirichlet_partition": ".partition",
    "unequal_partition": ".partition",
    "LocalTrainer": ".client",
    "layer_groups": ".client",
    "AggregateResult": ".aggregators",
    "Aggregator": ".aggregators",
    "MeanAggregator": ".aggregators",
    "MedianAggregator": ".aggregators",
    "GlobalDPAggregator": ".aggregators",
    "ClientNoiseDPAggregator": ".aggregators",
    "ClientSampling": ".server",
    "FederatedServer": ".server",
    "RoundRecord": ".server",
    "ModelAverage": ".server_optimizers",
    "ServerOptimizer": ".server_optimizers",
    "DPMode": ".runner",
    "FederatedConfig": ".runner",
    "build_server": ".runner",
    "run_federated": ".runner",
    "fully_connected_model": ".runner",
    "add_federated_parser": ".cli",
    "LocalDPMechanism": ".local_dp",
    "DuchiMechanism": ".local_dp",
    "PiecewiseMechanism": ".local_dp",
    "PNPMMechanism": ".local_dp",
    "LDPFLMechanism": ".local_dp",
    "LaplaceMechanism": ".local_dp",
    "GaussianMechanism": ".local_dp",
    "MechanismKind": ".local_dp",
    "make_mechanism": ".local_dp",
    "DomainPolicy": ".local_dp",
    "privacy_report": ".local_dp",
    "LocalDPUpload": ".local_dp",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = _lazy_exports(__name__, _EXPORTS, globals())
