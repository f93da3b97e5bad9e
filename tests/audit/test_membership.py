"""Membership inference: the attacks find members of a deliberately overfit
model, find nothing where there is nothing to find, and the epsilon lower
bound matches hand-computed numbers."""

import math

import keras
import numpy as np
import pytest

from dpfl_tf.audit import (
    AttackFeatures,
    clopper_pearson,
    epsilon_lower_bound,
    epsilon_lower_bound_from_counts,
    evaluate_scores,
    features_from_outputs,
    run_membership_attacks,
    split_attack_data,
)
from tests.keras.helpers import mnist_slice, mnist_test_slice

ATTACKS = ("loss_threshold", "logistic_regression", "mlp")


@pytest.fixture(scope="module")
def overfit():
    """A 784-256-10 MLP trained to memorise 600 real MNIST images (30 epochs of
    Adam); 600 other training images of MNIST are the non-members."""
    x, y = mnist_slice(1200)
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((784,)), keras.layers.Dense(256, activation="relu"), keras.layers.Dense(10)]
    )
    model.compile(
        keras.optimizers.Adam(1e-3), keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    )
    model.fit(x[:600], y[:600], batch_size=60, epochs=30, verbose=0)
    return model, (x[:600], y[:600]), (x[600:], y[600:])


def test_attacks_find_the_members_of_an_overfit_model(overfit):
    model, members, nonmembers = overfit
    results = run_membership_attacks(model, members, nonmembers, delta=1e-5)
    assert set(results) == set(ATTACKS)
    for name, r in results.items():
        assert r.auc > 0.65, (name, r.auc)
        assert r.advantage > 0.25
        assert r.num_members == r.num_nonmembers == 300  # the held-out half of each
        # the statistically valid bound: this model is far from DP
        assert r.epsilon_lower_bound_ci > 1.0
        assert r.epsilon_lower_bound >= r.epsilon_lower_bound_ci  # plug-in is optimistic
        c = r.counts
        assert c["tp"] + c["fn"] == 300 and c["fp"] + c["tn"] == 300
        assert r.epsilon_lower_bound_ci == pytest.approx(
            epsilon_lower_bound_from_counts(c["tp"], c["fn"], c["fp"], c["tn"], 1e-5, 0.95)
        )
        assert set(r.tpr_at_fpr) == {1e-3, 1e-2}
        d = r.to_dict(roc_points=50)
        assert d["auc"] == r.auc and len(d["roc"]["fpr"]) <= 52
        assert d["roc"]["fpr"][0] == 0.0 and d["roc"]["tpr"][-1] == 1.0


def test_attacks_find_nothing_on_random_labels_of_unseen_data(overfit):
    """Both groups are unseen test images with random labels, split at random
    into "members" and "non-members": no membership exists to be found."""
    model, _, _ = overfit
    x, _ = mnist_test_slice(1200)
    y = np.random.default_rng(1).integers(0, 10, 1200)
    results = run_membership_attacks(model, (x[:600], y[:600]), (x[600:], y[600:]))
    for name, r in results.items():
        # 300 vs 300 held out: AUC has standard deviation ~0.024 under the null
        assert abs(r.auc - 0.5) < 0.08, (name, r.auc)
        assert r.advantage < 0.15
        assert r.epsilon_lower_bound_ci < 0.2  # valid bound: ~0 where there is no leak


def test_lower_bound_worked_examples():
    # TPR = 0.5, FPR = 0.1: log(0.5 / 0.1) = log 5 beats log(0.9 / 0.5) = log 1.8
    assert epsilon_lower_bound(0.5, 0.1, 0.0) == pytest.approx(math.log(5.0))
    # delta is subtracted first: log((0.5 - 0.1) / 0.1) = log 4 (vs log(0.8 / 0.5))
    assert epsilon_lower_bound(0.5, 0.1, 0.1) == pytest.approx(math.log(4.0))
    # the second inequality can be the binding one: (1 - 0.5) / (1 - 0.99) = 50
    assert epsilon_lower_bound(0.99, 0.5, 0.0) == pytest.approx(math.log(50.0))
    # randomized response with e^eps = 3 (TPR 3/4, FPR 1/4) is tight: both give log 3
    assert epsilon_lower_bound(0.75, 0.25, 0.0) == pytest.approx(math.log(3.0))
    # no evidence: TPR = FPR, or TPR below FPR, gives 0 (eps >= 0 always)
    assert epsilon_lower_bound(0.3, 0.3, 1e-5) == 0.0
    assert epsilon_lower_bound(0.1, 0.4, 0.0) == 0.0
    # guards: FPR = 0 skips the first ratio, TPR = 1 the second
    assert epsilon_lower_bound(0.5, 0.0, 0.0) == pytest.approx(math.log(1.0 / 0.5))
    assert epsilon_lower_bound(1.0, 0.2, 0.0) == pytest.approx(math.log(1.0 / 0.2))
    # TPR <= delta gives nothing through the first ratio
    assert epsilon_lower_bound(1e-6, 0.0, 1e-5) == 0.0
    # arrays: the maximum over the thresholds
    assert epsilon_lower_bound([0.3, 0.5, 0.9], [0.3, 0.1, 0.5], 0.0) == pytest.approx(
        math.log(5.0)
    )


def test_clopper_pearson_worked_examples():
    # 0 successes in 10: upper bound solves (1 - p)^10 = alpha; 10 of 10: p^10 = alpha
    lo, hi = clopper_pearson(0, 10, 0.05)
    assert lo == 0.0 and hi == pytest.approx(1 - 0.05**0.1)
    lo, hi = clopper_pearson(10, 10, 0.05)
    assert lo == pytest.approx(0.05**0.1) and hi == 1.0
    # 10 of 10 members caught, 0 of 10 non-members flagged, 90 % joint confidence
    # (5 % per rate): TPR_lo = 0.05^0.1, FPR_hi = 1 - 0.05^0.1, both ratios equal
    a = 0.05**0.1
    assert epsilon_lower_bound_from_counts(10, 0, 0, 10, 0.0, confidence=0.9) == pytest.approx(
        math.log(a / (1 - a))
    )  # = 1.0519
    assert math.log(a / (1 - a)) == pytest.approx(1.0519, abs=1e-4)
    # a perfect attack on few examples proves little; on many it proves a lot
    assert epsilon_lower_bound_from_counts(1000, 0, 0, 1000, 1e-5) > 5.0


def test_threshold_is_chosen_on_the_training_part_only():
    rng = np.random.default_rng(0)
    train = (rng.normal(1.0, 1.0, 500), rng.normal(0.0, 1.0, 500))
    held_out = (rng.normal(1.0, 1.0, 500), rng.normal(0.0, 1.0, 500))
    r = evaluate_scores("gauss", train, held_out, delta=0.0)
    moved = evaluate_scores("gauss", train, (held_out[0] + 0.01, held_out[1]), delta=0.0)
    assert moved.threshold == r.threshold  # eval scores do not move the threshold
    # two unit Gaussians one apart: AUC = Phi(1 / sqrt 2) = 0.760
    assert r.auc == pytest.approx(0.760, abs=0.04)
    # Gaussian DP with mu = 1 has eps(delta=0) = inf but small rates cap any test;
    # the valid bound is positive and below the plug-in estimate
    assert 0 < r.epsilon_lower_bound_ci < r.epsilon_lower_bound


def test_features_and_split():
    logits = np.array([[10.0, 0.0], [0.0, 0.0]])
    f = features_from_outputs(logits, [0, 1])
    assert f.loss[0] == pytest.approx(math.log1p(math.exp(-10.0)))
    assert f.loss[1] == pytest.approx(math.log(2.0)) and f.entropy[1] == pytest.approx(math.log(2))
    assert f.confidence[1] == pytest.approx(0.5)
    probs = features_from_outputs(np.array([[0.25, 0.75]]), [1], from_logits=False)
    assert probs.loss[0] == pytest.approx(-math.log(0.75))
    assert AttackFeatures(f.loss, f.confidence, f.entropy).matrix().shape == (2, 5)
    m, n = split_attack_data(11, 7, seed=3)
    assert m.sum() == 6 and n.sum() == 4  # round(0.5 * 11), round(0.5 * 7)
