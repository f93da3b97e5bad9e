"""DP-SGD on several machines: `tf.distribute.MultiWorkerMirroredStrategy`.

Every worker runs the same script with its own ``TF_CONFIG``.  What makes the
run one DP-SGD run, with the privacy analysis of one machine:

* **One sampler key.**  Each worker adopts the chief's key (`agree_on_sampler_key`:
  an all-gather over the replicas before the first lot), so every worker draws
  the *same* Poisson lots.  An unseeded worker never samples with its own
  entropy; workers given different ``sampling_seed`` values are refused.
* **An explicit split.**  The data is not auto-sharded.  `lot_shares` builds
  each worker's input with ``distribute_datasets_from_function``: replica r
  (of R in the cluster) trains on the r-th of R equal, disjoint shares of
  every lot (`LotSampler.replica_shares`), so together the replicas train on
  exactly the lot, and each worker reads only its own shares' records.
  (Measured on TF 2.21 with the whole-lot dataset of one machine and
  ``experimental_distribute_dataset``: ``AutoShardPolicy.AUTO``/``DATA`` does
  halve each lot between two workers -- but only if both drew the same lot,
  and every worker reads the whole lot; ``OFF`` gives every worker every half
  of the lot in turn, so each half-lot is a step of its own trained by all
  workers at once: twice the sensitivity and twice the steps the ledger
  assumes.)
* **Noise once per lot.**  `DPModel` adds the noise only on the replica with
  ``replica_id_in_sync_group == 0`` -- in a cluster, the chief's first
  replica -- and the all-reduce sums the shares, so the update is
  (sum over the whole lot + one noise draw) / L.
* **One ledger.**  The lot counters are mirrored variables, equal on every
  worker; the chief's ledger is the run's ledger and only the chief writes
  files.  Saving reads variables collectively (a chief saving alone broke
  the run's next collective), so `DPCheckpoint` and `save_model` save on
  every worker, the others into a temporary directory they then delete.
"""

from __future__ import annotations

import os
import tempfile

import tensorflow as tf

from dpfl_tf.keras.sampling import LotSampler

__all__ = [
    "agree_on_sampler_key",
    "barrier",
    "is_chief",
    "is_multi_worker",
    "lot_shares",
    "save_model",
]


def is_multi_worker(strategy) -> bool:
    """True for a `tf.distribute.MultiWorkerMirroredStrategy` (also with one worker)."""
    return isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy)


def is_chief(strategy=None) -> bool:
    """True on the worker that writes the run's files: the ``chief`` task, or
    worker 0 of a cluster without one, or the only process (no cluster).  It is
    also the worker whose first replica adds the noise."""
    strategy = strategy or tf.distribute.get_strategy()
    if not is_multi_worker(strategy):
        return True
    resolver = strategy.cluster_resolver
    task_type, task_id = resolver.task_type, resolver.task_id
    if task_type in (None, "chief"):
        return True
    return (
        task_type == "worker" and task_id == 0 and "chief" not in resolver.cluster_spec().as_dict()
    )


def barrier(strategy) -> None:
    """Returns on every worker once all have reached it (a collective: every
    worker must call it); a no-op without a multi-worker strategy."""
    if not is_multi_worker(strategy):
        return

    @tf.function
    def meet():
        return tf.distribute.get_replica_context().all_reduce("sum", tf.constant(1.0))

    strategy.experimental_local_results(strategy.run(meet))[0].numpy()


def save_model(model, filepath, **kwargs) -> None:
    """``model.save(filepath)`` on the chief; every worker must call it.

    Saving reads variables collectively under a MultiWorkerMirroredStrategy:
    a chief saving alone breaks the next collective of the run (measured: an
    error on both workers).  So the other workers save too, into a temporary
    directory they delete, and all return once the chief's file is written."""
    strategy = model.distribute_strategy
    if is_chief(strategy):
        model.save(filepath, **kwargs)
    else:
        with tempfile.TemporaryDirectory(prefix="dpfl-worker-") as scratch:
            model.save(os.path.join(scratch, os.path.basename(os.fspath(filepath))), **kwargs)
    barrier(strategy)


def agree_on_sampler_key(strategy, sampler: LotSampler) -> None:
    """Sets `sampler.key` to the chief's key on every worker (a collective: every
    worker must call it).  Refuses, on every worker alike, seeds that differ
    between workers (a seeded and an unseeded worker included), and workers
    whose data size, lot size, sampling or first lot differ."""
    from dpfl_tf.privacy.events import SamplingMethod

    methods = list(SamplingMethod)
    own = [
        1 if sampler.seed is not None else 0,
        int(sampler.seed) if sampler.seed is not None else 0,
        int(sampler.key),
        sampler.dataset_size,
        sampler.lot_size,
        methods.index(sampler.sampling),
        sampler.first_lot,
    ]

    @tf.function
    def gather():
        mine = tf.constant([own], tf.int64)
        return tf.distribute.get_replica_context().all_gather(mine, axis=0)

    rows = strategy.experimental_local_results(strategy.run(gather))[0].numpy()
    seeds = sorted({(int(seeded), int(seed)) for seeded, seed, *_ in rows})
    if len(seeds) > 1:
        said = ", ".join(str(seed) if seeded else "None" for seeded, seed in seeds)
        raise ValueError(
            f"sampling_seed must be the same on every worker of a MultiWorkerMirroredStrategy, "
            f"got {said}: all workers must draw the same lots (pass the same seed to each, "
            "or none to use the chief's random key); nothing was trained"
        )
    settings = {tuple(int(v) for v in row[3:]) for row in rows}
    if len(settings) > 1:
        said = "; ".join(
            f"{n} records, lot {lot}, {methods[m].value}, first lot {f}"
            for n, lot, m, f in sorted(settings)
        )
        raise ValueError(
            "the workers of a MultiWorkerMirroredStrategy disagree on the data or the "
            f"sampling ({said}): every worker must hold the same records in the same order "
            "(an index must be the same example on each) and sample alike; nothing was "
            "trained"
        )
    # row 0 is replica 0: the chief's first replica
    sampler.key = int(rows[0][2])


def lot_shares(
    strategy, sampler: LotSampler, reader, *, epochs: int | None = None, preprocess=None
) -> tf.distribute.DistributedDataset:
    """The lots of `sampler` as this worker's distributed input: each replica its
    own disjoint share of every lot (`LotSampler.replica_shares`), the worker's
    local replicas in order.  Agrees on the chief's sampler key first."""
    agree_on_sampler_key(strategy, sampler)

    def dataset_fn(context: tf.distribute.InputContext) -> tf.data.Dataset:
        replicas = context.num_replicas_in_sync
        local = replicas // context.num_input_pipelines
        # MultiWorkerMirroredStrategy numbers the replicas worker by worker:
        # replica_id_in_sync_group = worker (input pipeline) id * local + local id
        return sampler.replica_shares(
            reader,
            epochs=epochs,
            replicas=replicas,
            first_replica=context.input_pipeline_id * local,
            local_replicas=local,
            preprocess=preprocess,
        )

    return strategy.distribute_datasets_from_function(dataset_fn)
