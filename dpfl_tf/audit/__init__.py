"""Empirical privacy audits: membership inference on trained models.

    from dpfl_tf.audit import run_membership_attacks
    results = run_membership_attacks(model, (x_members, y_members),
                                     (x_nonmembers, y_nonmembers), delta=1e-5)
    results["loss_threshold"].auc, results["mlp"].epsilon_lower_bound_ci

An attack gives a *lower* bound on epsilon; a lower bound above the
accountant's epsilon is a bug (see `dpfl_tf.audit.membership`).
"""

from dpfl_tf.audit.membership import (AttackFeatures, AttackKind, AttackResult,
                                      attack_features, clopper_pearson, epsilon_lower_bound,
                                      epsilon_lower_bound_from_counts, evaluate_scores,
                                      features_from_outputs, run_attacks_on_features,
                                      run_membership_attacks, split_attack_data)

__all__ = ["AttackFeatures", "AttackKind", "AttackResult", "attack_features",
           "clopper_pearson", "epsilon_lower_bound", "epsilon_lower_bound_from_counts",
           "evaluate_scores", "features_from_outputs", "run_attacks_on_features",
           "run_membership_attacks", "split_attack_data"]
