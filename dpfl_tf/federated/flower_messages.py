"""The ClientApp's side of a dpfl_tf round, as Flower messages, without TensorFlow.

A train message from `DPStrategy` carries the global weights (one ArrayRecord) and
the round (one ConfigRecord with ``dpfl-round``); the reply carries the client's
upload (an ArrayRecord) and its metrics (a MetricRecord).  The client counts its
own uploads in ``context.state`` (its composed local guarantee is reported over
them).  These helpers unpack and pack those messages; the cold ClientApp
(`dpfl_tf.federated.flower`) and the warm one (`dpfl_tf.federated.flower_warm`)
both use them, so the two answer the same message with the same reply.  This module
imports only Flower and NumPy: the warm ClientApp's process never imports
TensorFlow.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict

#: node_config keys Flower's simulation engine sets for every (virtual) SuperNode.
PARTITION_ID_KEY = "partition-id"
NUM_PARTITIONS_KEY = "num-partitions"
#: the round index t (0-based, as in FederatedServer) the server puts in every train config.
ROUND_KEY = "dpfl-round"
#: where the client keeps its upload count in ``context.state``
STATE_KEY = "dpfl"


def only(records: dict, what: str):
    """The one record of a kind in a message (an error naming what is there otherwise)."""
    if len(records) != 1:
        raise ValueError(
            f"expected exactly one {what} in the message, got {len(records)} "
            f"({', '.join(records) or 'none'})"
        )
    return next(iter(records.values()))


@dataclass(frozen=True)
class TrainRequest:
    """What a client needs from a train message and its context (picklable)."""

    run_config: dict
    node_config: dict
    arrays: list[np.ndarray]
    round_index: int
    #: the client's uploads before this one (from ``context.state``)
    uploads: int


def train_request(msg: Message, context: Context) -> TrainRequest:
    arrays = only(msg.content.array_records, "ArrayRecord").to_numpy_ndarrays()
    train_config = only(msg.content.config_records, "ConfigRecord")
    if ROUND_KEY not in train_config:
        raise ValueError(
            f"the train config has no {ROUND_KEY!r}: this ClientApp answers "
            "messages configured by dpfl_tf's DPStrategy"
        )
    state = context.state.config_records.get(STATE_KEY, ConfigRecord({"uploads": 0}))
    return TrainRequest(
        run_config=dict(context.run_config),
        node_config=dict(context.node_config),
        arrays=list(arrays),
        round_index=int(train_config[ROUND_KEY]),
        uploads=int(state["uploads"]),
    )


def train_reply(msg: Message, context: Context, upload: list[np.ndarray], metrics: dict) -> Message:
    """The reply to a train message; records the upload in ``context.state``."""
    context.state[STATE_KEY] = ConfigRecord({"uploads": int(metrics["uploads"])})
    content = RecordDict(
        {"arrays": ArrayRecord([np.asarray(u) for u in upload]), "metrics": MetricRecord(metrics)}
    )
    return Message(content, reply_to=msg)


def query_reply(msg: Message, partition_id: int) -> Message:
    """Enrolment: the node says which client (partition) it holds."""
    return Message(
        RecordDict({"metrics": MetricRecord({PARTITION_ID_KEY: int(partition_id)})}),
        reply_to=msg,
    )
