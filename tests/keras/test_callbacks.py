"""PrivacyCallback: a fit whose lots the ledger cannot account is refused before
the first lot (on small slices of real MNIST)."""

import dp_accounting
import pytest
from dp_accounting import rdp

from dpfl_tf.keras import DPSGD, DPModel
from dpfl_tf.privacy import PrivacyLedger
from tests.keras.helpers import loss, mlp, mnist_slice

DP_PCA = dp_accounting.PoissonSampledDpEvent(1.0, dp_accounting.GaussianDpEvent(7.0))


def _model(ledger):
    dp = DPModel(mlp(), ledger=ledger)
    dp.compile(optimizer=DPSGD(0.5, l2_norm_clip=1.0, noise_multiplier=1.0, seed=0), loss=loss())
    return dp


def test_shuffled_fit_after_add_remove_dp_pca_is_refused_before_any_lot():
    x, y = mnist_slice(1000, features=60)
    ledger = PrivacyLedger("rdp")
    ledger.record(DP_PCA, label="dp_pca")  # add/remove-one
    dp = _model(ledger)
    with pytest.raises(ValueError, match="add/remove-one.*relation='replace_one'"):
        dp.fit(x, y, lot_size=100, epochs=2, verbose=0, sampling="shuffle", sampling_seed=0)
    assert dp.lots_applied == 0 and ledger.count() == 1
    # accounted under replace-one throughout: DP-PCA is Gaussian(7 / 2), each epoch
    # Gaussian(1 / 2) (sensitivity 2C)
    dp = _model(PrivacyLedger("rdp", relation="replace_one"))
    dp.ledger.record(DP_PCA, label="dp_pca")
    dp.fit(x, y, lot_size=100, epochs=2, verbose=0, sampling="shuffle", sampling_seed=0)
    assert dp.lots_applied == 20
    ref = rdp.RdpAccountant().compose(
        dp_accounting.ComposedDpEvent(
            [
                dp_accounting.GaussianDpEvent(3.5),
                dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(0.5), 2),
            ]
        )
    )
    assert dp.epsilon(1e-5) == pytest.approx(ref.get_epsilon(1e-5), rel=1e-12)


@pytest.mark.parametrize("sampling", ["poisson", "shuffle"])
def test_a_large_budget_is_asked_only_for_the_lots_the_fit_can_run(sampling, monkeypatch):
    """A fit of 2 epochs of 5 lots under eps 100 (PLD allows millions of lots) asks the
    budget for at most the fit's lots + 1: one epsilon evaluation, not a search to the
    end of the budget (~20 s of PLD accounting a fit), and the fit ends as planned, not
    as "budget_spent".  A budget that binds still stops the fit where it binds."""
    from dpfl_tf.privacy import calibration, compute_epsilon, dp_sgd_event

    x, y = mnist_slice(500, features=60)
    calls = []
    real = calibration.compute_epsilon
    monkeypatch.setattr(
        calibration, "compute_epsilon", lambda *a, **k: calls.append(1) or real(*a, **k)
    )
    dp = _model(PrivacyLedger("pld", relation="replace_one" if sampling == "shuffle" else None))
    dp.fit(x, y, lot_size=100, epochs=2, verbose=0, sampling=sampling, target_epsilon=100.0)
    assert dp.lots_computed == 10 and dp.stop_reason != "budget_spent"
    assert len(calls) == 1
    if sampling == "shuffle":
        # a budget of exactly one epoch stops the fit after its 5 lots
        relation = "replace_one"
        one = dp_sgd_event(1.0, 0, "shuffle", epochs=1)
        eps = compute_epsilon(one, 1e-5, "pld") + 1e-9
        dp = _model(PrivacyLedger("pld", relation=relation))
        dp.fit(x, y, lot_size=100, epochs=2, verbose=0, sampling=sampling, target_epsilon=eps)
        assert dp.lots_computed == 5 and dp.stop_reason == "budget_spent"
        return
    # a budget of exactly 7 lots stops the fit after 7 (searched below the limit); one of
    # exactly the fit's 10 reads as spent at the end, one of 11 does not
    for allowed, lots, spent in [(7, 7, True), (10, 10, True), (11, 10, False)]:
        eps = compute_epsilon(dp_sgd_event(1.0, allowed, sampling_rate=0.2), 1e-5, "pld")
        dp = _model(PrivacyLedger("pld"))
        dp.fit(x, y, lot_size=100, epochs=2, verbose=0, target_epsilon=eps + 1e-9)
        assert dp.lots_computed == lots
        assert (dp.stop_reason == "budget_spent") == spent, (allowed, dp.stop_reason)
