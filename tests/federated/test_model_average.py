"""ModelAverage: the server releases the exponential moving average of the released
global models -- the formula written out, the same ledger and global trajectory as
without it (post-processing), evaluated and resumed as the released model."""

import numpy as np
import pytest

from dpfl_tf.federated.runner import build_server, run_federated
from dpfl_tf.federated.server_optimizers import ModelAverage
from tests.federated.conftest import small_global_dp_config


def _cfg(**kw):
    return small_global_dp_config(**{"rounds": 4, **kw})


def test_the_average_is_the_formula():
    rng = np.random.default_rng(0)
    models = [[rng.normal(size=(3, 2)).astype(np.float32), rng.normal(size=2)] for _ in range(5)]
    average = ModelAverage(0.8)
    assert average.average(models[0]) is None
    for x in models:
        average.update(x)
    for i in range(2):  # a_1 = x_1, a_t = 0.8 a_(t-1) + 0.2 x_t, coordinate by coordinate
        a = np.asarray(models[0][i], np.float64)
        for x in models[1:]:
            a = 0.8 * a + 0.2 * np.asarray(x[i], np.float64)
        got = average.average(models[0])[i]
        assert got.dtype == np.asarray(models[0][i]).dtype  # the model's dtype
        np.testing.assert_allclose(got, a, rtol=1e-6)
    info, arrays = average.get_state()
    again = ModelAverage(0.8)
    again.set_state(info, arrays, [(3, 2), (2,)])
    assert again.rounds == 5
    np.testing.assert_array_equal(again.average(models[0])[0], average.average(models[0])[0])
    with pytest.raises(ValueError, match="not"):
        ModelAverage(0.5).set_state(info, arrays)
    with pytest.raises(ValueError, match="0 arrays after 5 rounds"):
        ModelAverage(0.8).set_state(info, {})
    with pytest.raises(ValueError, match="shapes"):
        average.update([np.zeros((2, 3)), np.zeros(2)])
    with pytest.raises(ValueError, match="shapes"):
        ModelAverage(0.8).set_state(info, arrays, [(2, 3), (2,)])


@pytest.mark.parametrize("beta", [0.0, 1.0, -0.1, float("nan")])
def test_bad_decays_are_refused(beta):
    with pytest.raises(ValueError, match="model_average"):
        ModelAverage(beta)
    with pytest.raises(ValueError, match="model_average"):
        _cfg(model_average=beta)


def test_the_server_releases_the_average_and_the_run_is_the_same_without_it(mnist_small):
    """The global models, the ledger and epsilon are those of the run without the
    average (post-processing); each round's accuracy is the average's, which is the
    formula over the global models of rounds 1..t."""
    plain, _ = build_server(_cfg(), mnist_small, progress=False)
    averaged, _ = build_server(_cfg(model_average=0.7), mnist_small, progress=False)
    globals_ = []
    plain.run(4)
    averaged.run(4, on_round=lambda s: globals_.append([v.numpy() for v in s.trainer.variables]))
    assert averaged.ledger.to_dict() == plain.ledger.to_dict()
    assert averaged.epsilon() == plain.epsilon() > 0
    for a, b in zip(averaged.trainer.get_weights(), plain.trainer.get_weights()):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    expected = [np.asarray(w, np.float64) for w in globals_[0]]
    for x in globals_[1:]:
        expected = [0.7 * e + 0.3 * np.asarray(w, np.float64) for e, w in zip(expected, x)]
    released = averaged.released_weights()
    for r, e in zip(released, expected):
        np.testing.assert_allclose(r, e, rtol=1e-6, atol=1e-7)
    assert not np.allclose(released[0], globals_[-1][0])
    loss, acc = averaged.evaluate()
    assert (loss, acc) == averaged.evaluate(released)
    assert averaged.history[-1].accuracy == acc
    assert averaged.evaluate(averaged.trainer.get_weights()) == plain.evaluate()
    with pytest.raises(ValueError, match="shapes"):  # checked before anything is assigned
        averaged.evaluate(released[:1])
    # evaluating the average (and refusing a wrong one) put the global model back
    np.testing.assert_array_equal(
        np.asarray(averaged.trainer.get_weights()[0]), np.asarray(plain.trainer.get_weights()[0])
    )


def test_the_result_gives_both_accuracies_and_a_resumed_run_continues_the_average(
    mnist_small, tmp_path
):
    cfg = _cfg(model_average=0.7)
    straight = run_federated(cfg, mnist_small, progress=False)
    assert straight["config"]["model_average"] == 0.7
    assert straight["test_accuracy"] == straight["history"][-1]["accuracy"]
    assert "global_model_accuracy" in straight
    ckpt = str(tmp_path / "ckpt")
    run_federated(
        _cfg(model_average=0.7, rounds=2), mnist_small, progress=False, checkpoint_dir=ckpt
    )
    resumed = run_federated(cfg, mnist_small, progress=False, checkpoint_dir=ckpt)
    assert resumed["rounds"] == 4
    assert resumed["test_accuracy"] == straight["test_accuracy"]
    assert resumed["global_model_accuracy"] == straight["global_model_accuracy"]
    with pytest.raises(ValueError, match="model_average"):  # another run's checkpoint
        other, _ = build_server(_cfg(model_average=0.5), mnist_small, progress=False)
        other.load_checkpoint(ckpt)


def test_the_cli_flag_reaches_the_config():
    import argparse

    from dpfl_tf.federated.cli import add_federated_parser, config_from_args

    parser = argparse.ArgumentParser()
    add_federated_parser(parser.add_subparsers())
    config = config_from_args(parser.parse_args(["federated", "--model-average", "0.9"]))
    assert config.model_average == 0.9 and config.build_model_average().beta == 0.9
    assert config_from_args(parser.parse_args(["federated"])).build_model_average() is None
