"""Local DP inside the federated round: each client's upload is the mechanism
applied to its local model, the server averages; configs build the documented
domains; the PNPM experiments' CNNs have the paper's weight counts."""

import numpy as np
import pytest
import tensorflow as tf

from dpfl_tf.federated.aggregators import MeanAggregator
from dpfl_tf.federated.client import LocalTrainer
from dpfl_tf.federated.local_dp import (
    DomainMode,
    DomainPolicy,
    DuchiMechanism,
    LocalDPUpload,
    PNPMMechanism,
)
from dpfl_tf.federated.partition import iid_partition
from dpfl_tf.federated.runner import FederatedConfig, build_server, local_dp_upload
from dpfl_tf.federated.server import ClientSampling, FederatedServer
from tests.federated.conftest import tiny_model


@pytest.mark.parametrize(
    "mechanism, policy",
    [
        (PNPMMechanism(0.5, seed=11), None),
        (DuchiMechanism(1.0, seed=12), DomainPolicy.clip(0.5)),
    ],
)
def test_a_round_averages_the_perturbed_local_models(mnist_small, mechanism, policy):
    trainer = LocalTrainer(
        tiny_model(hidden=8),
        mnist_small.x_train[:400],
        mnist_small.y_train[:400],
        local_epochs=1,
        batch_size=20,
        learning_rate=0.1,
    )
    partition = iid_partition(400, 4, seed=0)
    upload = LocalDPUpload(mechanism, policy)
    server = FederatedServer(
        trainer,
        partition,
        MeanAggregator(weighted=False),
        sampling=ClientSampling("fixed_size", clients_per_round=4),
        test_data=None,
        seed=3,
        progress=False,
        local_dp=upload,
    )
    w0 = trainer.get_weights()
    # the round's streams: sampling from round_rng, each client's batch order from its
    # own shuffle_rng (one stream per client since the seeding helper, so a Flower
    # client draws what the in-process client draws)
    chosen = server.sampling.sample(server.round_rng(0), 4)
    expected = [np.zeros(w.shape) for w in w0]
    for k in chosen:
        delta = trainer.train(w0, partition.client(int(k)), server.shuffle_rng(0, int(k)))
        local = [w + d for w, d in zip(w0, delta)]
        noisy = mechanism.perturb_weights(local, policy, generator=upload.generator(0, int(k)))
        for e, n in zip(expected, noisy):
            e += n.numpy() / 4
    trainer.set_weights(w0)
    server.run_round()
    for got, want in zip(trainer.get_weights(), expected):
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-6)
    # the new global model is the mean of perturbed models, not the clean FedAvg model
    if isinstance(mechanism, DuchiMechanism):
        b = mechanism.B * 0.5  # every perturbed weight is +-B r ...
        vals = np.concatenate([g.numpy().ravel() for g in trainer.get_weights()])
        # ... so the mean of 4 of them lies on the grid {-B r, -B r / 2, 0, B r / 2, B r}
        np.testing.assert_allclose(np.round(vals / (b / 2)), vals / (b / 2), atol=1e-4)


def test_configs_build_the_documented_domains(mnist_small):
    base = dict(
        clients=4,
        clients_per_round=4,
        sampling="fixed_size",
        partition="iid",
        model="cnn2",
        rounds=1,
        dp="local",
        ldp_epsilon=1.0,
    )
    server, _ = build_server(
        FederatedConfig(ldp_mechanism="pnpm", **base), mnist_small, progress=False
    )
    assert server.local_dp.policy is None  # PNPM: any finite weight, sign randomised
    server, _ = build_server(
        FederatedConfig(ldp_mechanism="duchi", ldp_bound=1.0, **base), mnist_small, progress=False
    )
    assert server.local_dp.policy == DomainPolicy.clip(1.0)
    c = FederatedConfig(ldp_mechanism="ldp_fl", ldp_bound="init", ldp_bound_margin=3.0, **base)
    w0 = [tf.constant([[0.1, -0.4]]), tf.zeros([2]), tf.constant([0.2]), tf.zeros([1])]
    policy = local_dp_upload(c, w0).policy
    assert policy.mode is DomainMode.CLIP
    # 3 x max|w| per tensor; a zero tensor (bias) takes the bound of the tensor before it
    np.testing.assert_allclose(policy.bound, [1.2, 1.2, 0.6, 0.6])


def test_pnpm_cnns_have_the_papers_weight_counts():
    from dpfl_tf.models import pnpm_cnn

    def kernels(model):
        return sum(int(np.prod(v.shape)) for v in model.trainable_variables if len(v.shape) > 1)

    assert kernels(pnpm_cnn((28, 28), depth=2)) == 21_750
    assert kernels(pnpm_cnn((28, 28), depth=3)) == 41_936
    assert kernels(pnpm_cnn((32, 32, 3), depth=3)) == 56_560
    with pytest.raises(ValueError, match="depth must be 2 or 3"):
        pnpm_cnn(depth=4)
