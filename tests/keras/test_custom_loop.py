"""dp_gradients: a custom training loop gets fit's update and fit's ledger."""

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

from dpfl_tf.keras import DPSGD, BatchMixingLayerError, DPModel, LotSampler, dp_gradients
from dpfl_tf.privacy import BudgetExceededError, PrivacyBudget, PrivacyLedger
from tests.keras.helpers import loss, mlp, mnist_slice


def _optimizer(**kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # seeded noise: not for deployment
        return DPSGD(0.5, l2_norm_clip=1.0, noise_multiplier=1.1, seed=7, **kwargs)


def _weights(model):
    return [v.numpy().copy() for v in model.trainable_variables]


@pytest.mark.parametrize(
    "sampling, clip, accountant",
    [("poisson", 1.0, "moments"), ("fixed_size", [0.5, 0.5, 1.0, 2.0], "rdp")],
)
def test_a_custom_loop_makes_fits_updates_and_fits_ledger(sampling, clip, accountant):
    """Same seeds, same lots: the weights after 2 epochs of `dp_gradients` +
    `apply_noised_gradients` equal fit's, and so do the ledgers."""
    x, y = mnist_slice(200, features=60)
    fitted = DPModel(mlp(), accountant=accountant)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        opt = DPSGD(0.5, l2_norm_clip=clip, noise_multiplier=1.1, seed=7)
    fitted.compile(optimizer=opt, loss=loss())
    fitted.fit(x, y, lot_size=50, epochs=2, sampling=sampling, sampling_seed=3, verbose=0)

    model = mlp()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dp_sgd = DPSGD(0.5, l2_norm_clip=clip, noise_multiplier=1.1, seed=7)
    sampler = LotSampler(len(y), 50, sampling, seed=3)
    ledger = PrivacyLedger(accountant)
    for x_lot, y_lot, mask in sampler.dataset(x, y, epochs=2):
        grads = dp_gradients(
            model, loss(), x_lot, y_lot, mask=mask, optimizer=dp_sgd, sampler=sampler, ledger=ledger
        )
        dp_sgd.apply_noised_gradients(grads, model.trainable_variables)
    assert ledger.to_dict() == fitted.privacy_ledger.to_dict()
    assert ledger.count("dpsgd") == fitted.lots_computed == 8
    for a, b in zip(_weights(model), _weights(fitted.model)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_the_noise_is_the_optimizers_and_moves_with_the_lot():
    """Without clipping effects (a zero model input), the update is the noise:
    std sigma C / L per coordinate, and lot t's noise differs from lot t+1's."""
    x, y = mnist_slice(64, features=60)
    model = mlp()
    sampler = LotSampler(len(y), 64, "full_batch")
    ledger, opt = PrivacyLedger(), _optimizer()
    zeros = np.zeros_like(x)
    first = dp_gradients(model, loss(), zeros, y, optimizer=opt, sampler=sampler, ledger=ledger)
    second = dp_gradients(model, loss(), zeros, y, optimizer=opt, sampler=sampler, ledger=ledger)
    kernel = first[0].numpy()  # zero inputs: the first kernel's gradient is noise alone
    assert np.std(kernel) == pytest.approx(1.1 * 1.0 / 64, rel=0.05)
    assert not np.allclose(kernel, second[0].numpy())
    assert ledger.count() == 2


def test_refusals_compute_and_record_nothing():
    x, y = mnist_slice(40, features=60)
    model = mlp()
    sampler = LotSampler(len(y), 20, "poisson", seed=1)
    ledger = PrivacyLedger(budget=PrivacyBudget(0.01, 1e-5))
    with pytest.raises(BudgetExceededError, match="allows no further lot"):
        dp_gradients(model, loss(), x, y, optimizer=_optimizer(), sampler=sampler, ledger=ledger)
    assert len(ledger) == 0
    with pytest.raises(ValueError, match="accounted per epoch"):
        dp_gradients(
            model,
            loss(),
            x,
            y,
            optimizer=_optimizer(),
            sampler=LotSampler(len(y), 20, "shuffle"),
            ledger=PrivacyLedger(),
        )
    with pytest.raises(RuntimeError, match="eagerly"):
        tf.function(
            lambda: dp_gradients(
                model, loss(), x, y, optimizer=_optimizer(), sampler=sampler, ledger=PrivacyLedger()
            )
        )()
    centred = keras.Sequential(
        [
            keras.Input((60,)),
            keras.layers.Dense(8),
            keras.layers.Lambda(lambda t: t - keras.ops.mean(t, axis=0), name="centre"),
            keras.layers.Dense(10),
        ]
    )
    ledger = PrivacyLedger()
    with pytest.raises(BatchMixingLayerError, match="'centre'"):
        dp_gradients(centred, loss(), x, y, optimizer=_optimizer(), sampler=sampler, ledger=ledger)
    assert len(ledger) == 0
