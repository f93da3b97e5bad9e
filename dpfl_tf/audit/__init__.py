"""Empirical privacy audits: membership inference on trained models.

    from dpfl_tf.audit import run_membership_attacks
    results = run_membership_attacks(model, (x_members, y_members),
                                     (x_nonmembers, y_nonmembers), delta=1e-5)
    results["loss_threshold"].auc, results["mlp"].epsilon_lower_bound_ci

Canary auditing in one training run (Steinke, Nasr, Jagielski 2023;
`dpfl_tf.audit.canary`, `dpfl_tf.audit.one_run`):

    canaries = DiracCanaries(1000, input_dim=784, num_classes=10)
    x_train, y_train = canaries.training_data(x, y)
    observer = canaries.observer(dp_model)
    dp_model.fit(x_train, y_train, lot_size=..., callbacks=[observer])
    canaries.audit(observer, delta=1e-5).epsilon_lower_bound

The f-DP (Gaussian) refinement of the one-run bound (Mahloujifar et al.
2024) for Gaussian mechanisms: ``canaries.audit(observer, delta=1e-5,
method="gdp")``, refused on sampled lots or clients (`refuse_gdp_on_sampling`).
The multi-run audit (R independent runs, one canary each;
`dpfl_tf.audit.multi_run`): ``multi_run_epsilon_lower_bound(in_scores,
out_scores, delta=1e-5)`` (with ``method="gdp"`` also ``mechanism=`` what ran).

An attack gives a *lower* bound on epsilon; a lower bound above the
accountant's epsilon is a bug (see `dpfl_tf.audit.membership`).
"""

from dpfl_tf.audit.canary import DiracCanaries, MislabelledCanaries, WhiteBoxObserver
from dpfl_tf.audit.membership import (
    AttackFeatures,
    AttackKind,
    AttackResult,
    attack_features,
    clopper_pearson,
    epsilon_lower_bound,
    epsilon_lower_bound_from_counts,
    evaluate_scores,
    features_from_outputs,
    run_attacks_on_features,
    run_membership_attacks,
    split_attack_data,
)
from dpfl_tf.audit.multi_run import MultiRunResult, multi_run_epsilon_lower_bound
from dpfl_tf.audit.one_run import (
    OneRunResult,
    epsilon_lower_bound_from_scores,
    gdp_epsilon,
    gdp_mu,
    ideal_gaussian_lower_bound,
    one_run_epsilon_lower_bound,
    one_run_gdp_mu_lower_bound,
    one_run_p_value,
    refuse_gdp_on_sampling,
)

__all__ = [
    "DiracCanaries",
    "MislabelledCanaries",
    "OneRunResult",
    "WhiteBoxObserver",
    "epsilon_lower_bound_from_scores",
    "ideal_gaussian_lower_bound",
    "one_run_epsilon_lower_bound",
    "one_run_p_value",
    "gdp_epsilon",
    "gdp_mu",
    "one_run_gdp_mu_lower_bound",
    "MultiRunResult",
    "multi_run_epsilon_lower_bound",
    "refuse_gdp_on_sampling",
    "AttackFeatures",
    "AttackKind",
    "AttackResult",
    "attack_features",
    "clopper_pearson",
    "epsilon_lower_bound",
    "epsilon_lower_bound_from_counts",
    "evaluate_scores",
    "features_from_outputs",
    "run_attacks_on_features",
    "run_membership_attacks",
    "split_attack_data",
]
