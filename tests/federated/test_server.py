"""The round loop: FedAvg by hand on a tiny model, local SGD, learning on real
MNIST, checkpoint/resume."""

import json
import shutil

import keras
import numpy as np
import pytest
import tensorflow as tf

from dpfl_tf.federated.aggregators import GlobalDPAggregator, MeanAggregator, MedianAggregator
from dpfl_tf.federated.client import LocalTrainer, layer_groups
from dpfl_tf.federated.partition import ClientPartition, iid_partition, unequal_partition
from dpfl_tf.federated.server import ClientSampling, FederatedServer
from dpfl_tf.sanitizer import GaussianSanitizer
from tests.federated.conftest import tiny_model


@pytest.fixture(scope="module")
def trainer(mnist_small):
    return LocalTrainer(
        tiny_model(hidden=8),
        mnist_small.x_train[:600],
        mnist_small.y_train[:600],
        local_epochs=2,
        batch_size=16,
        learning_rate=0.05,
        momentum=0.5,
    )


def test_local_sgd_step_is_minus_lr_times_the_gradient(mnist_small):
    import keras

    model = tiny_model(hidden=4, seed=1)
    x, y = mnist_small.x_train[:32], mnist_small.y_train[:32]
    t = LocalTrainer(model, x, y, local_epochs=1, batch_size=32, learning_rate=0.3)
    w0 = t.get_weights()
    delta = t.train(w0, np.arange(32), np.random.default_rng(0))
    t.set_weights(w0)
    with tf.GradientTape() as tape:
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)(
            y, model(x.astype(np.float32) / 255.0)
        )
    grads = tape.gradient(loss, model.trainable_variables)
    for d, g in zip(delta, grads):
        np.testing.assert_allclose(d.numpy(), -0.3 * g.numpy(), rtol=1e-4, atol=1e-6)
    # the model's weights are left at w_k = w_t + Delta (the server resets them)
    assert layer_groups(model) == [0, 0, 1, 1]


def test_batches_cover_each_epoch_once(trainer):
    starts, ends = trainer.batch_bounds(40)  # B = 16, E = 2
    np.testing.assert_array_equal(starts, [0, 16, 32, 40, 56, 72])
    np.testing.assert_array_equal(ends, [16, 32, 40, 56, 72, 80])


def test_one_round_equals_the_hand_computed_weighted_average(trainer):
    partition = unequal_partition(600, 6, seed=3)
    sampling = ClientSampling("fixed_size", clients_per_round=4)
    server = FederatedServer(
        trainer,
        partition,
        MeanAggregator(),
        sampling=sampling,
        test_data=None,
        seed=5,
        progress=False,
    )
    w0 = trainer.get_weights()
    # the same randomness the server derives for round 0: the sampling stream, then
    # one batch-order stream per client (since the seeding helper; was one shared stream)
    chosen = sampling.sample(server.round_rng(0), 6)
    deltas, sizes = [], []
    for k in chosen:
        deltas.append(
            [
                d.numpy()
                for d in trainer.train(w0, partition.client(int(k)), server.shuffle_rng(0, int(k)))
            ]
        )
        sizes.append(len(partition.client(int(k))))
    trainer.set_weights(w0)
    server.run_round()
    want = [
        w.numpy() + sum(n * d[j] for n, d in zip(sizes, deltas)) / sum(sizes)
        for j, w in enumerate(w0)
    ]
    for got, expect in zip(trainer.get_weights(), want):
        np.testing.assert_allclose(got.numpy(), expect, rtol=1e-5, atol=1e-6)
    assert server.history[0].clients == 4 and len(set(sizes)) > 1  # really weighted
    assert len(server.ledger) == 0 and server.epsilon() is None


def test_fedavg_and_fedmedian_learn_real_mnist(mnist_small):
    accs = {}
    for name, agg in [("mean", MeanAggregator()), ("median", MedianAggregator())]:
        t = LocalTrainer(
            tiny_model(hidden=32, seed=0),
            mnist_small.x_train,
            mnist_small.y_train,
            local_epochs=2,
            batch_size=10,
            learning_rate=0.1,
        )
        server = FederatedServer(
            t,
            iid_partition(3000, 30, seed=0),
            agg,
            sampling=ClientSampling("poisson", fraction=0.3),
            test_data=(mnist_small.x_test, mnist_small.y_test),
            seed=0,
            progress=False,
        )
        _, before = server.evaluate()
        server.run(3)
        accs[name] = server.history[-1].accuracy
        assert before < 0.3
    assert accs["mean"] > 0.8 and accs["median"] > 0.7, accs


def test_checkpoint_resume_reproduces_an_uninterrupted_run(trainer, tmp_path, mnist_small):
    partition = iid_partition(600, 12, seed=0)

    def server():
        agg = GlobalDPAggregator(GaussianSanitizer(0.5, 1.0))
        return FederatedServer(
            trainer,
            partition,
            agg,
            sampling=ClientSampling("poisson", clients_per_round=4),
            test_data=(mnist_small.x_test[:100], mnist_small.y_test[:100]),
            delta_max=1e-3,
            seed=1,
            noise_seed=2,
            progress=False,
        )

    init = trainer.get_weights()
    straight = server()
    straight.run(3)
    want = [w.numpy() for w in trainer.get_weights()]

    trainer.set_weights(init)
    first = server()
    first.run(2, checkpoint_dir=tmp_path)
    state = json.loads((tmp_path / "state.json").read_text())
    assert state["round"] == 2 and sorted(p.name for p in tmp_path.iterdir()) == [
        "state.json",
        "weights-000002.npz",
    ]
    trainer.set_weights([tf.zeros_like(w) for w in init])  # a fresh process would start anew
    resumed = server()
    resumed.run(3, checkpoint_dir=tmp_path)
    assert resumed.rounds_done == 3 and len(resumed.history) == 3
    assert resumed.ledger == straight.ledger
    for got, expect in zip(trainer.get_weights(), want):
        np.testing.assert_allclose(got.numpy(), expect, rtol=1e-5, atol=1e-6)
    assert [r.clients for r in resumed.history] == [r.clients for r in straight.history]
    # a checkpoint of another run is refused
    other = FederatedServer(
        trainer,
        partition,
        MeanAggregator(),
        sampling=ClientSampling("poisson", clients_per_round=4),
        test_data=None,
        seed=1,
        progress=False,
    )
    with pytest.raises(ValueError, match="belongs to a different run"):
        other.load_checkpoint(tmp_path)
    # and so is one whose clients trained otherwise (E, B, step, momentum or loss); the
    # same settings in a new trainer are the same run
    for change, same in [
        ({}, True),
        ({"local_epochs": 1}, False),
        ({"batch_size": 8}, False),
        ({"learning_rate": 0.1}, False),
        ({"momentum": 0.0}, False),
        ({"loss": keras.losses.CategoricalFocalCrossentropy()}, False),
    ]:
        settings = dict(local_epochs=2, batch_size=16, learning_rate=0.05, momentum=0.5)
        other_trainer = LocalTrainer(
            trainer.model,
            mnist_small.x_train[:600],
            mnist_small.y_train[:600],
            **{**settings, **change},
        )
        again = FederatedServer(
            other_trainer,
            partition,
            GlobalDPAggregator(GaussianSanitizer(0.5, 1.0)),
            sampling=ClientSampling("poisson", clients_per_round=4),
            test_data=None,
            delta_max=1e-3,
            seed=1,
            noise_seed=2,
            progress=False,
        )
        if same:
            assert again.load_checkpoint(tmp_path) and again.rounds_done == 3
        else:
            key = next(iter(change))
            with pytest.raises(ValueError, match=f"differs in: local_training.{key}\\)"):
                again.load_checkpoint(tmp_path)
            # a checkpoint written before the settings were fingerprinted still loads
            state = json.loads((tmp_path / "state.json").read_text())
            legacy = tmp_path.parent / f"legacy-{key}"
            shutil.copytree(tmp_path, legacy)
            del state["fingerprint"]["local_training"]
            (legacy / "state.json").write_text(json.dumps(state))
            assert again.load_checkpoint(legacy) and again.rounds_done == 3


def test_server_input_errors(trainer):
    with pytest.raises(ValueError, match="refers to example"):
        FederatedServer(
            trainer,
            ClientPartition.from_lists([[0, 1], [5000]]),
            MeanAggregator(),
            sampling=ClientSampling("poisson", fraction=0.5),
            test_data=None,
        )
    with pytest.raises(ValueError, match="target_epsilon needs a private aggregator"):
        FederatedServer(
            trainer,
            iid_partition(600, 6),
            MeanAggregator(),
            sampling=ClientSampling("poisson", fraction=0.5),
            test_data=None,
            target_epsilon=1.0,
        )
    with pytest.raises(ValueError, match="a client with no examples"):
        trainer.train(trainer.get_weights(), np.array([], dtype=np.int64), np.random.default_rng(0))


def test_client_sampling_is_secret_unless_reproducibility_is_asked_for(trainer):
    """Amplification by sampling assumes nobody can predict who is sampled: two
    servers with the same `seed` sample differently unless `noise_seed` is set."""
    partition = unequal_partition(600, 50, seed=3)
    sampling = ClientSampling("fixed_size", clients_per_round=5)

    def chosen(**kw):
        server = FederatedServer(
            trainer,
            partition,
            MeanAggregator(),
            sampling=sampling,
            test_data=None,
            seed=5,
            progress=False,
            **kw,
        )
        return [tuple(sampling.sample(server.round_rng(t), 50)) for t in range(4)]

    assert chosen() != chosen()
    assert chosen(noise_seed=3) == chosen(noise_seed=3)
