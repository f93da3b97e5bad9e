"""The scattering transform on real MNIST digits: shape, moduli, low-pass,
translation invariance, energy bounds, and a full-resolution numpy reference."""

import numpy as np
import pytest
import tensorflow as tf

from dpfl_tf.data import load_dataset
from dpfl_tf.scattering import Scattering2D, morlet_filter_bank, scattering_channels


@pytest.fixture(scope="module")
def digits():
    return load_dataset("mnist").x_test[:16].astype("float32") / 255.0


@pytest.fixture(scope="module")
def scat():
    return Scattering2D(J=2, L=8, shape=(28, 28))


def _lp_sum(psi, phi):
    """|phi_hat|^2 + 1/2 sum (|psi_hat(w)|^2 + |psi_hat(-w)|^2) on the DFT grid."""
    neg = np.roll(psi[..., ::-1, ::-1], 1, axis=(-2, -1))  # psi_hat(-w)
    return phi**2 + 0.5 * (np.abs(psi) ** 2 + np.abs(neg) ** 2).sum(axis=(0, 1))


def test_shape_channels_and_dtype(scat, digits):
    assert scattering_channels(2, 8) == 81
    assert scattering_channels(3, 4) == 1 + 12 + 16 * 3
    out = scat(digits[:4])
    assert out.shape == (4, 7, 7, 81) and out.dtype.name == "float32"
    rgb = np.stack([digits[:2], 0.5 * digits[:2], digits[2:4]], axis=-1)  # (2, 28, 28, 3)
    out3 = scat(rgb).numpy()
    assert out3.shape == (2, 7, 7, 243)
    # channel c's coefficients are channels c K .. c K + K - 1
    np.testing.assert_allclose(out3[..., 81:162], 0.5 * out[:2].numpy(), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(out3[..., 162:], out[2:4].numpy(), rtol=1e-4, atol=1e-6)
    j3 = Scattering2D(J=3, L=4, shape=(32, 16), padding="periodic")
    assert j3(np.zeros((1, 32, 16))).shape == (1, 4, 2, 61)
    np.testing.assert_allclose(
        scat.transform(digits, batch_size=5), scat(digits).numpy(), rtol=1e-5, atol=1e-6
    )


def test_an_images_features_do_not_depend_on_its_batch(digits):
    """Bit for bit, whatever the batch and whichever batch size came first (a graph
    traced for one static batch size was optimised differently: the last bit of 5%
    of the features moved)."""
    scat = Scattering2D(J=2, L=8, shape=(28, 28))
    whole = scat.transform(digits[:6], batch_size=6)  # the first call: 6 images
    for batch_size in (1, 4, 5):
        np.testing.assert_array_equal(scat.transform(digits[:6], batch_size=batch_size), whole)
    np.testing.assert_array_equal(scat(digits[3:9]).numpy()[:3], whole[3:])


@pytest.mark.parametrize("k", [1, 2, 4, 8])  # 8: the reduced product, not block by block
@pytest.mark.parametrize("lead", [(5,), (2, 3)])
@pytest.mark.parametrize("filters", [1, 3])
def test_a_filter_bank_is_the_folded_product(k, lead, filters):
    """_FilterBank(F, k)(X) = the spectrum of (u * f_t)[::k, ::k]: the product X F_t
    folded to (M/k, N/k) by the mean of its k^2 aliases, on a grid that is not square."""
    from dpfl_tf.scattering import _FilterBank

    rng = np.random.default_rng(k)
    m, n = 24, 16
    spectrum = rng.normal(size=(*lead, m, n)) + 1j * rng.normal(size=(*lead, m, n))
    bank = rng.normal(size=(filters, m, n))
    product = spectrum[..., None, :, :] * bank
    want = product.reshape(*lead, filters, k, m // k, k, n // k).mean(axis=(-4, -2))
    got = _FilterBank(bank, k)(tf.constant(spectrum, tf.complex64)).numpy()
    assert got.shape == (*lead, filters, m // k, n // k)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())
    with pytest.raises(ValueError, match="cannot be subsampled by 3"):
        _FilterBank(bank, 3)


def test_moduli_are_nonnegative_and_order_zero_is_the_lowpassed_image(scat, digits):
    out = scat(digits).numpy()
    # orders 1 and 2: a low-pass of a modulus with a positive Gaussian: >= 0
    assert out[..., 1:].min() > -1e-5
    assert out[..., 1:].max() > 0.01
    # order 0: the reflect-padded image circularly convolved with phi_J, every 4th sample
    pad = np.pad(digits, [(0, 0), (4, 4), (4, 4)], mode="reflect")
    low = np.real(np.fft.ifft2(np.fft.fft2(pad) * scat.phi_hat))[:, ::4, ::4][:, 1:-1, 1:-1]
    np.testing.assert_allclose(out[..., 0], low, atol=1e-5)
    # phi_hat(0) = 1: the mean is kept; psi_hat(0) = 0: constants vanish
    flat = scat(np.full((1, 28, 28), 0.7, np.float32)).numpy()
    np.testing.assert_allclose(flat[..., 0], 0.7, atol=1e-5)
    assert np.abs(flat[..., 1:]).max() < 1e-4


def test_matches_a_full_resolution_reference(digits):
    """The transform without the coarse-grid shortcut, written out in numpy."""
    J, L = 2, 8
    img = digits[0]
    xp = np.pad(img, 4, mode="reflect")
    psi, phi = morlet_filter_bank(xp.shape, J, L)

    def low(u_hat):
        return np.real(np.fft.ifft2(u_hat * phi))[::4, ::4][1:-1, 1:-1]

    x_hat = np.fft.fft2(xp)
    u1 = {(j, t): np.abs(np.fft.ifft2(x_hat * psi[j, t])) for j in range(J) for t in range(L)}
    ref = [low(x_hat)] + [low(np.fft.fft2(u1[k])) for k in sorted(u1)]
    for t1 in range(L):  # j1 = 0, j2 = 1
        u1_hat = np.fft.fft2(u1[0, t1])
        ref += [low(np.fft.fft2(np.abs(np.fft.ifft2(u1_hat * psi[1, t2])))) for t2 in range(L)]
    ref = np.stack(ref, axis=-1)
    out = Scattering2D(J, L, (28, 28))(img[None]).numpy()[0]
    assert np.linalg.norm(out - ref) / np.linalg.norm(ref) < 0.01


def test_small_translations_barely_change_the_features(scat, digits):
    # MNIST digits sit on a zero border, so np.roll is a true translation
    x = digits[:8]
    rel = lambda a, b: np.linalg.norm(a - b) / np.linalg.norm(b)  # noqa: E731
    s = scat(x).numpy()
    one = np.roll(x, 1, axis=2)
    raw_change = rel(one, x)
    feature_change = rel(scat(one).numpy(), s)
    assert raw_change > 0.5  # the pixels move a lot ...
    # ... the features much less (kymatio's low-pass, sigma 0.8 2^(J-1) = 1.6 pixels,
    # averages over about +-2 pixels: a one-pixel shift keeps ~60% of them)
    assert feature_change < 0.45 * raw_change
    # the invariance is local (scale 2^J = 4): a 6-pixel shift changes the features
    six = np.roll(x, 6, axis=2)
    assert rel(scat(six).numpy(), s) > 2 * feature_change
    assert rel(scat(six).numpy(), s) > 0.3


def test_littlewood_paley_energy_bounds(scat, digits):
    psi, phi = morlet_filter_bank((36, 36), 2, 8)
    assert np.abs(psi[:, :, 0, 0]).max() < 1e-12 and phi[0, 0] == pytest.approx(1.0)
    lp = _lp_sum(psi, phi)
    w = 2 * np.pi * np.fft.fftfreq(36)
    radius = np.hypot(w[:, None], w[None, :])
    a_all, a_disc, b = lp.min(), lp[radius <= np.pi].min(), lp.max()
    assert 0.1 < a_all and 0.3 < a_disc and b <= 1.0 + 1e-9
    # Parseval: the energy of all (unsubsampled) filter outputs of a real image
    x = np.pad(digits[3], 4, mode="reflect")
    x_hat = np.fft.fft2(x)
    energy = np.sum(np.real(np.fft.ifft2(x_hat * phi)) ** 2) + sum(
        np.sum(np.abs(np.fft.ifft2(x_hat * p)) ** 2) for p in psi.reshape(-1, 36, 36)
    )
    ratio = energy / np.sum(x**2)
    assert a_all <= ratio <= b
    # the bound is the symmetrised sum: one-sided |psi_hat|^2 leaves half the plane empty
    assert (np.abs(psi) ** 2).sum(axis=(0, 1)).min() < 0.01


def test_bad_inputs_raise_clear_errors(scat):
    with pytest.raises(ValueError, match="rank 3"):
        scat(np.zeros((28, 28)))
    with pytest.raises(ValueError, match="28x28"):
        scat(np.zeros((2, 32, 32)))
    with pytest.raises(ValueError, match="multiple of 2\\^J = 4"):
        Scattering2D(2, 8, shape=(30, 28))
    with pytest.raises(ValueError, match="J must be"):
        Scattering2D(0, 8, shape=(28, 28))
    with pytest.raises(ValueError, match="L must be"):
        Scattering2D(2, 0, shape=(28, 28))
    with pytest.raises(ValueError, match="padding='reflect' needs"):
        Scattering2D(2, 8, shape=(4, 8))
    with pytest.raises(ValueError, match="padding must be"):
        Scattering2D(2, 8, shape=(28, 28), padding="zeros")


@pytest.mark.parametrize("shape", [(28, 28), (32, 32)])
def test_matches_kymatio_channel_for_channel(digits, shape):
    """An independent implementation (kymatio, the one Tramer & Boneh used) on the
    same colour images: the same coefficients in the same layout (colour c's
    coefficients are channels c K .. c K + K - 1; within a colour, order 0, then
    (j1, t1), then (j1, t1, j2, t2) in kymatio's order of orientations)."""
    # the 2-D numpy frontend alone: kymatio.numpy also imports its 3-D filters
    from kymatio.scattering2d.frontend.numpy_frontend import ScatteringNumPy2D

    h, w = shape
    rng = np.random.default_rng(0)
    base = np.zeros((4, h, w), np.float32)
    base[:, :28, :28] = digits[:4]
    # three different colour planes: a digit, a shifted digit, smooth noise
    noise = rng.random((4, h // 4, w // 4)).repeat(4, axis=1).repeat(4, axis=2)
    rgb = np.stack([base, np.roll(base, 3, axis=2), noise.astype(np.float32)], axis=-1)
    ours = Scattering2D(J=2, L=8, shape=shape)(rgb).numpy()  # N, h, w, 3K
    theirs = ScatteringNumPy2D(J=2, shape=shape, L=8)(np.transpose(rgb, (0, 3, 1, 2)))
    theirs = np.transpose(theirs.reshape(4, 3 * 81, h // 4, w // 4), (0, 2, 3, 1))
    assert ours.shape == theirs.shape
    per_channel = np.linalg.norm((ours - theirs).reshape(-1, 243), axis=0) / np.linalg.norm(
        theirs.reshape(-1, 243), axis=0
    )
    assert np.linalg.norm(ours - theirs) / np.linalg.norm(theirs) < 1e-3
    assert per_channel.max() < 1e-2, np.argsort(per_channel)[-5:]


def test_mirror_views_are_the_features_of_the_image_and_of_its_mirror_image(scat, digits, tmp_path):
    views = scat.transform(digits[:6], batch_size=4, mirror=True)
    assert views.shape == (6, 2, 7, 7, 81)
    np.testing.assert_allclose(views[:, 0], scat(digits[:6]).numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(views[:, 1], scat(digits[:6, :, ::-1]).numpy(), rtol=1e-5, atol=1e-6)
    # computed, not mirrored: mirroring moves the 2^J subsampling grid by one pixel,
    # so even the isotropic order-0 channel is not the mirrored order-0 channel
    order0 = views[..., 0]
    gap = np.linalg.norm(order0[:, 1] - order0[:, 0, :, ::-1]) / np.linalg.norm(order0[:, 0])
    assert gap > 0.05
    # filled in place, e.g. into a memmap
    out = np.lib.format.open_memmap(
        tmp_path / "f.npy", mode="w+", dtype=np.float32, shape=(6, 2, 7, 7, 81)
    )
    assert scat.transform(digits[:6], mirror=True, out=out) is out
    np.testing.assert_array_equal(np.load(tmp_path / "f.npy"), views)
    with pytest.raises(ValueError, match=r"out must have shape \(6, 2, 7, 7, 81\)"):
        scat.transform(digits[:6], mirror=True, out=np.zeros((6, 7, 7, 81), np.float32))
