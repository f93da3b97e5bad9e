"""Handcrafted ScatterNet features: the 2-D scattering transform, order 2.

Tramer & Boneh, "Differentially Private Learning Needs Better Features (or
Much More Data)" (ICLR 2021), train a linear model with DP-SGD on scattering
features.  The transform is fixed and data-independent, so computing it costs
no privacy.  After Mallat 2012 ("Group invariant scattering") and Bruna &
Mallat 2013 ("Invariant scattering convolution networks"):

    S0 x          = x * phi_J                                    (1 channel)
    S1 x(j1, t1)  = |x * psi_{j1,t1}| * phi_J                    (J L channels)
    S2 x(j1,t1,j2,t2) = ||x * psi_{j1,t1}| * psi_{j2,t2}| * phi_J,  j1 < j2
                                                     (L^2 J (J-1) / 2 channels)

each subsampled by 2^J: K = 1 + J L + L^2 J (J-1) / 2 channels (81 for J=2,
L=8), channels last, in this order (j1, t1, j2, t2 major to minor).  Filters
are built in the Fourier domain, with kymatio's parameters (Andreux et al.
2020, the implementation Tramer & Boneh used): with R_t the rotation by
t = (L/2 - 1 - l) pi / L (l = 0..L-1, kymatio's order of orientations),
sigma_j = 0.8 2^j, xi_j = (3 pi / 4) / 2^j and slant s = 4 / L,
the unit-mass Gaussian envelope of covariance sigma^2 R_t diag(1, 1/s^2) R_t^T
has Fourier transform

    g_hat(w) = exp(-w^T Sigma w / 2),   Sigma = sigma_j^2 R_t diag(1, 1/s^2) R_t^T,

the Gabor filter is g_hat(w - xi_j e_t) and the Morlet wavelet is the Gabor
minus the multiple of its envelope that makes psi_hat(0) = 0.  The low-pass
phi_J is the isotropic Gaussian of sigma = 0.8 2^(J-1) (phi_hat(0) = 1), as in
kymatio (an earlier version used 0.8 2^J, a low-pass twice as wide; see the
README's CIFAR-10 diagnosis for what that changed).  Each
filter is sampled on the DFT grid and periodised in frequency (aliases
2 pi k), which is the DFT of the periodised, sampled continuous filter, so
convolution is circular (FFT).  Images are reflect-padded by 2^J on each side
(``padding="reflect"``, the default) or treated as periodic
(``padding="periodic"``); the pad is cropped after subsampling.  Subsampling
by k is done in the Fourier domain by folding the spectrum (the mean of its
k^2 aliases), which gives the exact samples; |x * psi_j| is kept at every
2^j-th sample and filtered further on that grid (Bruna & Mallat 2013, sec.
3.3), which agrees with the full-resolution transform to ~0.2% (tested).

Energy (Littlewood-Paley): for real x, with
LP(w) = |phi_hat(w)|^2 + 1/2 sum_{j,t} (|psi_hat_{j,t}(w)|^2 + |psi_hat_{j,t}(-w)|^2),
A ||x||^2 <= ||x * phi||^2 + sum ||x * psi_{j,t}||^2 <= B ||x||^2 with
A = min LP, B = max LP (for J=2, L=8 on 36x36: A = 0.12, at the corners
(+-pi, +-pi) only, A = 0.35 for |w| <= pi, and B = 1).
"""

from __future__ import annotations

import math
import time

import numpy as np
import tensorflow as tf

from dpfl_tf._validation import check_count

__all__ = ["Scattering2D", "scattering_channels", "scattering_orders", "morlet_filter_bank"]


def scattering_channels(J: int, L: int) -> int:
    """K = 1 + J L + L^2 J (J - 1) / 2, the channels per input channel (order 2)."""
    return 1 + J * L + L * L * J * (J - 1) // 2


def scattering_orders(J: int, L: int, colours: int = 1) -> np.ndarray:
    """The order (0, 1 or 2) of every output channel, in `Scattering2D`'s layout
    (colour c's K channels are c K .. c K + K - 1): int array of length colours K."""
    one = np.array([0] + [1] * (J * L) + [2] * (L * L * J * (J - 1) // 2))
    return np.tile(one, check_count("colours", colours, minimum=1))


def _periodised_gaussian_hat(
    shape, sigma: float, theta: float, slant: float, xi: float, aliases: int = 2
) -> np.ndarray:
    """sum_k exp(-(w + 2 pi k - xi e_t)^T Sigma (w + 2 pi k - xi e_t) / 2) on the DFT
    grid w = 2 pi (fftfreq(M), fftfreq(N)); float64, shape (M, N)."""
    m, n = shape
    w1 = 2 * np.pi * np.fft.fftfreq(m)[:, None]
    w2 = 2 * np.pi * np.fft.fftfreq(n)[None, :]
    c, s = math.cos(theta), math.sin(theta)
    # Sigma = sigma^2 R diag(1, 1/slant^2) R^T, written in rotated coordinates
    out = np.zeros((m, n))
    for k1 in range(-aliases, aliases + 1):
        for k2 in range(-aliases, aliases + 1):
            u = w1 + 2 * np.pi * k1
            v = w2 + 2 * np.pi * k2
            along = c * u + s * v - xi  # component along e_t, shifted by xi
            across = -s * u + c * v
            out += np.exp(-0.5 * sigma**2 * (along**2 + across**2 / slant**2))
    return out


def morlet_filter_bank(shape, J: int = 2, L: int = 8):
    """(psi_hat [J, L, M, N], phi_hat [M, N]) in float64, Fourier domain.

    psi_hat[j, l] is the Morlet wavelet of scale 2^j and angle (L/2 - 1 - l) pi / L
    (kymatio's order); phi_hat is the Gaussian of sigma = 0.8 2^(J-1);
    psi_hat(0) = 0 and phi_hat(0) = 1 exactly (on the grid)."""
    slant = 4.0 / L
    psi = np.zeros((J, L) + tuple(shape))
    for j in range(J):
        sigma, xi = 0.8 * 2**j, 0.75 * np.pi / 2**j
        for l_ in range(L):
            theta = (L // 2 - 1 - l_) * np.pi / L
            gabor = _periodised_gaussian_hat(shape, sigma, theta, slant, xi)
            envelope = _periodised_gaussian_hat(shape, sigma, theta, slant, 0.0)
            psi[j, l_] = gabor - gabor[0, 0] / envelope[0, 0] * envelope
    phi = _periodised_gaussian_hat(shape, 0.8 * 2 ** (J - 1), 0.0, 1.0, 0.0)
    return psi, phi / phi[0, 0]


class Scattering2D:
    """Order-2 scattering of images: (N, H, W) or (N, H, W, C) -> (N, H/2^J, W/2^J, C K).

    A fixed, non-trainable feature map (float32).  `__call__` works on a tensor
    in one go; `transform` walks a large array in batches and returns numpy.

    Args:
      J: number of scales (>= 1); the output is subsampled by 2^J.
      L: number of orientations (>= 1).
      shape: (H, W) of the images, each divisible by 2^J.
      padding: "reflect" (pad 2^J on each side, needs H, W >= 2^(J+1)) or
        "periodic" (no padding: the image is treated as a torus).
    """

    def __init__(self, J: int = 2, L: int = 8, shape=(28, 28), *, padding: str = "reflect"):
        self.J = check_count("J", J, minimum=1)
        self.L = check_count("L", L, minimum=1)
        if padding not in ("reflect", "periodic"):
            raise ValueError(f"padding must be 'reflect' or 'periodic', got {padding!r}")
        self.padding = padding
        try:
            h, w = (int(s) for s in shape)
        except (TypeError, ValueError):
            raise ValueError(f"shape must be (H, W), got {shape!r}") from None
        step = 2**self.J
        for name, size in (("H", h), ("W", w)):
            if size < step or size % step:
                raise ValueError(
                    f"shape {name} must be a positive multiple of 2^J = {step}, "
                    f"got {size} (shape={tuple(shape)!r})"
                )
            if padding == "reflect" and size < 2 * step:
                raise ValueError(
                    f"padding='reflect' needs shape {name} >= 2^(J+1) = "
                    f"{2 * step}, got {size}; use padding='periodic'"
                )
        self.shape = (h, w)
        self.pad = step if padding == "reflect" else 0
        self.padded_shape = (h + 2 * self.pad, w + 2 * self.pad)
        self.output_shape = (h // step, w // step)
        self.channels = scattering_channels(self.J, self.L)
        psi, phi = morlet_filter_bank(self.padded_shape, self.J, self.L)
        self.psi_hat = psi.astype(np.float32)  # [J, L, M, N] on the full grid
        self.phi_hat = phi.astype(np.float32)
        # _psi[r][j - r], _phi[r]: the filters of scale 2^j (2^J) on the grid of
        # every 2^r-th sample, i.e. of scale 2^(j-r) (2^(J-r)) there, each as
        # `_FilterBank` with the subsampling it is applied with
        self._psi, self._phi = [], []
        for r in range(self.J):
            grid = (self.padded_shape[0] // 2**r, self.padded_shape[1] // 2**r)
            psi_r, phi_r = (psi, phi) if r == 0 else morlet_filter_bank(grid, self.J - r, self.L)
            self._psi.append([_FilterBank(psi_r[j - r], 2 ** (j - r)) for j in range(r, self.J)])
            self._phi.append(_FilterBank(phi_r[None], 2 ** (self.J - r)))
        # one graph for every batch size: a graph traced for a static batch is
        # optimised differently, and its features differed in the last bit (on
        # CPU, tested; a GPU's batched FFT need not keep this)
        self._fn = tf.function(
            self._scatter, input_signature=[tf.TensorSpec([None, *self.shape], tf.float32)]
        )

    def __repr__(self):
        return f"Scattering2D(J={self.J}, L={self.L}, shape={self.shape}, padding={self.padding!r})"

    # -- checks -------------------------------------------------------------

    def _check(self, images):
        shape = tuple(images.shape)
        if len(shape) not in (3, 4):
            raise ValueError(
                f"images must have rank 3 (N, H, W) or 4 (N, H, W, C), got shape {shape}"
            )
        if shape[1:3] != self.shape:
            raise ValueError(
                f"images must be {self.shape[0]}x{self.shape[1]} (the shape this "
                f"Scattering2D was built for), got shape {shape}"
            )

    # -- the transform ------------------------------------------------------

    def _lowpass(self, spectrum, r: int):
        """Spectrum on the grid of resolution 2^r -> real (u * phi_J)[::2^J] with the
        pad cropped; [..., H/2^J, W/2^J]."""
        out = tf.math.real(tf.signal.ifft2d(self._phi[r](spectrum)[..., 0, :, :]))
        if self.pad:
            c = self.pad // 2**self.J  # = 1
            out = out[..., c:-c, c:-c]
        return out

    def _scatter(self, x):
        """x: float32 [B, H, W] -> [B, K, H', W'].

        |x * psi_j1| is kept at every 2^j1-th sample (exact samples: subsampling a
        signal is folding its spectrum) and filtered further on that coarser grid
        with the filters rebuilt for it (Bruna & Mallat 2013, section 3.3); only
        the small part of the modulus' spectrum above pi / 2^j1 aliases."""
        if self.pad:
            p = self.pad
            x = tf.pad(x, [[0, 0], [p, p], [p, p]], mode="REFLECT")
        b = tf.shape(x)[0]
        x_hat = tf.signal.fft2d(tf.cast(x, tf.complex64))  # [B, M, N]
        out = [self._lowpass(x_hat, 0)[:, None]]
        second = []
        for j1 in range(self.J):
            u1 = tf.abs(tf.signal.ifft2d(self._psi[0][j1](x_hat)))  # [B, L, M1, N1]
            u1_hat = tf.signal.fft2d(tf.cast(u1, tf.complex64))
            out.append(self._lowpass(u1_hat, j1))
            for j2 in range(j1 + 1, self.J):
                u2 = tf.abs(tf.signal.ifft2d(self._psi[j1][j2 - j1](u1_hat)))  # [B, L, L, M2, N2]
                s2 = self._lowpass(tf.signal.fft2d(tf.cast(u2, tf.complex64)), j2)
                second.append((j1, j2, s2))
        # order 2 in (j1, t1, j2, t2) order
        for j1 in range(self.J):
            blocks = [s for (a, _, s) in second if a == j1]
            if blocks:
                s = tf.concat(blocks, axis=2)  # [B, L, (J-j1-1)L, ..]
                out.append(tf.reshape(s, [b, -1, *self.output_shape]))
        return tf.concat(out, axis=1)

    def __call__(self, images) -> tf.Tensor:
        """Scattering coefficients, float32 [N, H/2^J, W/2^J, C K] (channel c's K
        coefficients are channels c K .. c K + K - 1)."""
        images = tf.convert_to_tensor(images)
        self._check(images)
        x = tf.cast(images, tf.float32)
        if x.shape.rank == 3:
            x = x[..., None]
        n, c = tf.shape(x)[0], x.shape[-1]
        x = tf.reshape(tf.transpose(x, [0, 3, 1, 2]), [-1, *self.shape])  # [N C, H, W]
        s = self._fn(x)  # [N C, K, h, w]
        s = tf.reshape(s, [n, c * self.channels, *self.output_shape])
        return tf.transpose(s, [0, 2, 3, 1])

    def features_shape(self, images_shape, mirror: bool = False) -> tuple:
        """The shape `transform` returns for images of `images_shape`
        ([N, H, W] or [N, H, W, C])."""
        c = 1 if len(images_shape) == 3 else images_shape[-1]
        return (images_shape[0], *((2,) if mirror else ()), *self.output_shape, c * self.channels)

    def transform(
        self,
        images,
        batch_size: int = 64,
        verbose: bool = False,
        *,
        mirror: bool = False,
        out=None,
    ) -> np.ndarray:
        """`__call__` over a large array in batches of `batch_size`; numpy float32
        [N, H/2^J, W/2^J, C K].  A batch's intermediate tensors are what the
        transform adds to the process's memory (one measurement on 2,048 random
        32x32x3 images, two cores: 64 at a time ~0.6 GB, 256 ~1.9 GB, 6 s either
        way; the block-wise sum of `_FilterBank` later took a quarter of the CPU
        time off: `experiments/scattering_speed.py`).  The
        features do not depend on the batch size (bit for bit on CPU).

        mirror: also the features of each image's mirror image (flipped left to
          right, ``images[:, :, ::-1]``): [N, 2, H/2^J, W/2^J, C K], view 0 the
          image's, view 1 its mirror image's (for `dpfl_tf.models.view_averaged`).
          View 1 is computed, not a permutation of view 0: mirroring moves the
          2^J subsampling grid by one pixel.
        out: an array of that shape to fill (e.g. a ``np.memmap``) and return."""
        images = np.asarray(images)
        self._check(images)
        batch_size = check_count("batch_size", batch_size, minimum=1)
        shape = self.features_shape(images.shape, mirror)
        if out is None:
            out = np.empty(shape, np.float32)
        elif tuple(out.shape) != shape:
            raise ValueError(f"out must have shape {shape}, got {tuple(out.shape)}")
        start = time.perf_counter()
        for i in range(0, len(images), batch_size):
            batch = images[i : i + batch_size]
            if mirror:
                out[i : i + len(batch), 0] = self(batch).numpy()
                out[i : i + len(batch), 1] = self(batch[:, :, ::-1]).numpy()
            else:
                out[i : i + len(batch)] = self(batch).numpy()
        if verbose:
            print(
                f"scattering {len(images)} images{' and their mirror images' if mirror else ''}"
                f": {time.perf_counter() - start:.1f} s"
            )
        return out


class _FilterBank:
    """T filters on an M x N DFT grid, applied with subsampling by k: a spectrum
    [..., M, N] -> the spectra [..., T, M/k, N/k] of (u * filter_t)[::k, ::k].

    Subsampling by k folds the filtered spectrum (the mean of its k^2 aliases,
    exact for any u): out[..., t, m, n] = sum_(a,c) X[a M/k + m, c N/k + n]
    F_t[a M/k + m, c N/k + n] / k^2.  For k <= MAX_BLOCKWISE it is summed block
    by block (the k^2 blocks of X against those of F / k^2) rather than as the
    product's [..., T, M, N] tensor reduced afterwards: half the time of the
    second-order step, the transform's largest; a larger k (J >= 3) would make
    k^2 small ops of the graph, and reduces the product instead.  Either way an
    image's features do not depend on what else is in its batch."""

    MAX_BLOCKWISE = 4

    def __init__(self, filters: np.ndarray, k: int):
        t, m, n = filters.shape
        if m % k or n % k:
            raise ValueError(f"a {m}x{n} grid cannot be subsampled by {k}")
        self.k, self.block = k, (m // k, n // k)
        mk, nk = self.block
        scaled = filters / (k * k)  # exact for a power of 2 (every k here)
        if k > self.MAX_BLOCKWISE:
            self._blocks = [tf.constant(scaled, tf.complex64)]
            return
        self._blocks = [
            tf.constant(scaled[:, a * mk : (a + 1) * mk, c * nk : (c + 1) * nk], tf.complex64)
            for a in range(k)
            for c in range(k)
        ]

    def __call__(self, spectrum):
        k, (mk, nk) = self.k, self.block
        if k > self.MAX_BLOCKWISE:
            product = spectrum[..., None, :, :] * self._blocks[0]
            lead = tf.shape(product)[:-2]
            folded = tf.reshape(product, tf.concat([lead, [k, mk, k, nk]], 0))
            return tf.reduce_sum(folded, axis=[-4, -2])
        out = None
        for i, bank in enumerate(self._blocks):
            a, c = divmod(i, k)
            term = spectrum[..., None, a * mk : (a + 1) * mk, c * nk : (c + 1) * nk] * bank
            out = term if out is None else out + term
        return out


def __getattr__(name):  # the model builders moved to dpfl_tf.models
    if name in ("scatter_linear", "scatter_cnn"):
        import warnings

        from dpfl_tf import models

        warnings.warn(
            f"dpfl_tf.scattering.{name} moved to dpfl_tf.models.{name}",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(models, name)
    raise AttributeError(f"module 'dpfl_tf.scattering' has no attribute {name!r}")
