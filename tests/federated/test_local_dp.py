"""Local-DP mechanisms for client uploads (issue 7): moments against the closed
forms (statistically, and shown to fail for a wrong formula), output ranges,
the e^eps density-ratio bound on a grid, domain handling, TF vs numpy
reference, seeding, and the privacy report."""

import json
import math

import dp_accounting
import numpy as np
import pytest
import tensorflow as tf
from scipy import stats

from dpfl_tf.federated.local_dp import (
    DomainMode,
    DomainPolicy,
    DuchiMechanism,
    GaussianMechanism,
    LaplaceMechanism,
    LDPFLMechanism,
    LocalDPMechanism,
    LocalDPUpload,
    LocalPrivacyReport,
    MechanismKind,
    PiecewiseMechanism,
    PNPMMechanism,
    gaussian_upload_report,
    make_mechanism,
    out_of_domain_counts,
    pnpm_magnitude_distinguishability,
    privacy_report,
)
from dpfl_tf.privacy import compute_epsilon

EPS = 1.0
N = 200_000  # samples per input for the moment tests
Z = 5.0  # |z| above this rejects (false alarm ~6e-7 per check)


def _mechanisms(seed=None):
    return {
        "duchi": DuchiMechanism(EPS, seed=seed),
        "piecewise": PiecewiseMechanism(EPS, seed=seed),
        "pnpm": PNPMMechanism(EPS, seed=seed),
        "ldp_fl": LDPFLMechanism(EPS, center=0.2, radius=0.5, seed=seed),
        "laplace": LaplaceMechanism(EPS, seed=seed),
        "gaussian": GaussianMechanism(1.5, seed=seed),
    }


NAMES = list(_mechanisms())
PURE = ["duchi", "piecewise", "ldp_fl", "laplace"]


def _inputs(mech):
    if mech.input_domain() is None:  # PNPM: any weight; 0 is uploaded as exactly 0
        return np.array([-0.7, -0.28, 0.35, 2.5])
    lo, hi = mech.input_domain()
    return np.array([lo, lo + 0.3 * (hi - lo), 0.5 * (lo + hi), hi])


def _draw(mech, inputs, n=N):
    """n draws for each input, one vectorised call: shape [len(inputs), n]."""
    x = tf.constant(np.repeat(np.asarray(inputs, np.float64)[:, None], n, axis=1))
    return mech.perturb(x).numpy()


def _assert_support(y, values, rtol=1e-6):
    """The distinct outputs of y are exactly `values` (up to float rounding)."""
    got = np.unique(np.asarray(y, np.float64))
    got = got[np.concatenate([[True], np.diff(got) > rtol * np.abs(got[1:]) + 1e-12])]
    np.testing.assert_allclose(got, np.sort(np.asarray(values, np.float64)), rtol=rtol)


def _moment_z(samples, mean, var):
    """z-scores of the sample mean and of the mean squared deviation from the
    claimed mean, against the claimed mean and variance.

    E[(y - mean)^2] = var exactly when the mean is right; its standard error is
    estimated from the samples.  Two-point outputs at the midpoint have
    (y - mean)^2 constant: the check is then exact equality."""
    n = samples.size
    z_mean = (samples.mean() - mean) / math.sqrt(var / n)
    sq = (samples - mean) ** 2
    diff = sq.mean() - var
    se = sq.std() / math.sqrt(n)
    if se <= 1e-9 * max(var, 1.0):
        z_var = 0.0 if abs(diff) <= 1e-9 * max(var, 1.0) else math.inf
    else:
        z_var = diff / se
    return z_mean, z_var


# --------------------------------------------------------------------------
# moments: unbiasedness and variance, and a test that can fail


@pytest.mark.parametrize("name", NAMES)
def test_unbiased_and_variance_match_closed_form(name):
    mech = _mechanisms(seed=11)[name]
    ts = _inputs(mech)
    draws = _draw(mech, ts)
    for t, y in zip(ts, draws):
        z_mean, z_var = _moment_z(y, float(mech.mean(t)), float(mech.variance(t)))
        assert abs(z_mean) < Z, (name, t, z_mean)
        assert abs(z_var) < Z, (name, t, z_var)
        assert float(mech.mean(t)) == pytest.approx(t)
    # the same check rejects a variance formula that is 10% off
    rejected = [
        abs(_moment_z(y, float(mech.mean(t)), 1.1 * float(mech.variance(t)))[1]) > Z
        for t, y in zip(ts, draws)
    ]
    assert all(rejected), name


class _BiasedDuchi(DuchiMechanism):
    """B computed with e^(eps/2): the output is no longer unbiased."""

    def _perturb(self, t, gen):
        b_wrong = (math.exp(self.epsilon / 2) + 1) / (math.exp(self.epsilon / 2) - 1)
        y = super()._perturb(t, gen)
        return y / self.B * b_wrong


class _BiasedPiecewise(PiecewiseMechanism):
    """Probability of the central piece e^eps/(e^eps+1) instead of e^(eps/2)/(e^(eps/2)+1)."""

    @property
    def b(self):
        return math.exp(self.epsilon)


class _BiasedPNPM(PNPMMechanism):
    """C = (a+1)/(a-1) (Duchi's B) instead of (a+3)/(a-1): E[t*] = a/(a+1) s."""

    @property
    def C(self):
        return (self.a + 1) / (self.a - 1)


class _BiasedLDPFL(LDPFLMechanism):
    """Forgets the centre in P[+]: biased when c != 0."""

    def _ldpfl(self, w, c, r, gen):
        return super()._ldpfl(w + tf.cast(c, w.dtype), c, r, gen)


class _WrongScaleLaplace(LaplaceMechanism):
    """Scale 1/eps (forgets that [-1, 1] has sensitivity 2)."""

    @property
    def scale(self):
        return 1.0 / self.epsilon


class _WrongScaleGaussian(GaussianMechanism):
    """Std sigma instead of 2 sigma."""

    @property
    def stddev(self):
        return self.noise_multiplier


WRONG = {
    "duchi": lambda: _BiasedDuchi(EPS, seed=3),
    "piecewise": lambda: _BiasedPiecewise(EPS, seed=3),
    "pnpm": lambda: _BiasedPNPM(EPS, seed=3),
    "ldp_fl": lambda: _BiasedLDPFL(EPS, center=0.2, radius=0.5, seed=3),
    "laplace": lambda: _WrongScaleLaplace(EPS, seed=3),
    "gaussian": lambda: _WrongScaleGaussian(1.5, seed=3),
}


@pytest.mark.parametrize("name", NAMES)
def test_moment_check_rejects_a_wrong_sampler(name):
    right = _mechanisms()[name]
    wrong = WRONG[name]()
    ts = _inputs(right)
    draws = _draw(wrong, ts, n=N // 2)
    worst = max(
        max(abs(z) for z in _moment_z(y, float(right.mean(t)), float(right.variance(t))))
        for t, y in zip(ts, draws)
    )
    assert worst > Z, (name, worst)


def test_closed_forms_match_the_papers_worst_cases():
    a = math.exp(EPS)
    b = math.exp(EPS / 2)
    # Duchi: worst case at t = 0, ((a+1)/(a-1))^2
    assert DuchiMechanism(EPS).variance(0.0) == pytest.approx(((a + 1) / (a - 1)) ** 2)
    # PM (Wang et al. 2019): worst case at |t| = 1, 4 e^(eps/2) / (3 (e^(eps/2) - 1)^2)
    assert PiecewiseMechanism(EPS).variance(1.0) == pytest.approx(4 * b / (3 * (b - 1) ** 2))
    # PNPM: Var[t*] = 4(a + 1/3)/(a-1)^2 = (C+2)(C-1)/3
    pn = PNPMMechanism(EPS)
    assert pn.variance(1.0) == pytest.approx(4 * (a + 1 / 3) / (a - 1) ** 2)
    assert pn.variance(1.0) == pytest.approx((pn.C + 2) * (pn.C - 1) / 3)
    assert pn.variance(-0.3) == pytest.approx(0.09 * pn.variance(1.0))
    # LDP-FL: r^2 B^2 - (w - c)^2
    lf = LDPFLMechanism(EPS, center=0.2, radius=0.5)
    assert lf.variance(0.5) == pytest.approx(0.25 * ((a + 1) / (a - 1)) ** 2 - 0.09)
    assert LaplaceMechanism(EPS).variance(0.3) == pytest.approx(8 / EPS**2)
    assert GaussianMechanism(1.5).variance(0.3) == pytest.approx(9.0)


@pytest.mark.parametrize("name", NAMES)
def test_density_integrates_to_the_closed_form_moments(name):
    mech = _mechanisms()[name]
    for t in _inputs(mech):
        if mech.discrete:
            lo, hi = mech.output_range(t)
            ys = np.array([float(lo), float(hi)])
            p = mech.density(ys, t)
            assert p.sum() == pytest.approx(1.0)
            mean = (ys * p).sum()
            var = ((ys - mean) ** 2 * p).sum()
        else:
            lo, hi = mech.output_range(t)
            sd = math.sqrt(float(mech.variance(t)))
            lo = max(float(lo), t - 40 * sd)
            hi = min(float(hi), t + 40 * sd)
            edges = np.linspace(lo, hi, 800_001)
            mid = 0.5 * (edges[1:] + edges[:-1])
            w = mech.density(mid, t) * np.diff(edges)
            assert w.sum() == pytest.approx(1.0, abs=1e-4)
            mean = (mid * w).sum()
            var = ((mid - mean) ** 2 * w).sum()
        assert mean == pytest.approx(float(mech.mean(t)), abs=1e-4 * max(1.0, abs(t)))
        assert var == pytest.approx(float(mech.variance(t)), rel=1e-3)


# --------------------------------------------------------------------------
# output ranges


@pytest.mark.parametrize("name", NAMES)
def test_outputs_stay_in_the_output_range(name):
    mech = _mechanisms(seed=5)[name]
    ts = _inputs(mech)
    draws = _draw(mech, ts, n=50_000)
    for t, y in zip(ts, draws):
        lo, hi = mech.output_range(t)
        tol = 1e-9 * max(1.0, abs(float(hi)) if np.isfinite(hi) else 1.0)
        assert np.all(y >= float(lo) - tol) and np.all(y <= float(hi) + tol)
        if mech.discrete:
            _assert_support(y, [float(lo), float(hi)])


def test_piecewise_places_mass_b_over_b_plus_1_on_l_r():
    pm = PiecewiseMechanism(EPS, seed=2)
    b = math.exp(EPS / 2)
    for t in (-1.0, 0.0, 0.6):
        y = _draw(pm, [t], n=100_000)[0]
        left = (pm.C + 1) / 2 * t - (pm.C - 1) / 2
        frac = np.mean((y >= left) & (y <= left + pm.C - 1))
        p = b / (b + 1)
        assert abs(frac - p) < Z * math.sqrt(p * (1 - p) / y.size)


def test_pnpm_upload_keeps_magnitude_within_factor_c_and_flips_sign_with_right_probability():
    pn = PNPMMechanism(EPS, seed=4)
    w = np.array([-0.7, -0.01, 0.3, 2.5])
    y = _draw(pn, w, n=50_000)
    for wi, yi in zip(w, y):
        lo, hi = pn.magnitude_range(wi)
        assert np.all(np.abs(yi) >= lo * (1 - 1e-12)) and np.all(np.abs(yi) <= hi * (1 + 1e-12))
        kept = np.mean(np.sign(yi) == np.sign(wi))
        p = pn.a / (pn.a + 1)
        assert abs(kept - p) < Z * math.sqrt(p * (1 - p) / yi.size)
        # the magnitude factor |y|/|w| is Uniform[1, C], whatever the sign
        assert stats.kstest((np.abs(yi) / abs(wi) - 1) / (pn.C - 1), "uniform").pvalue > 1e-4
    # w = 0 is uploaded as exactly 0
    assert np.all(pn.perturb(tf.zeros([1000])).numpy() == 0.0)


# --------------------------------------------------------------------------
# the e^eps density-ratio bound


def _max_ratio(mech_density, ts, ys):
    dens = np.stack([mech_density(ys, t) for t in ts])  # [T, Y]
    hi = dens.max(axis=0)
    lo = dens.min(axis=0)
    if np.any((hi > 0) & (lo == 0)):
        return math.inf
    keep = hi > 0
    return float(np.max(hi[keep] / lo[keep]))


def _grid(mech):
    if mech.discrete:
        lo, hi = mech.output_range(
            0.0 if mech.input_domain() is None else sum(mech.input_domain()) / 2
        )
        return np.array([float(lo), float(hi), 0.123])
    if isinstance(mech, PiecewiseMechanism):
        return np.linspace(-mech.C - 0.5, mech.C + 0.5, 20_001)
    return np.linspace(-30, 30, 20_001)


@pytest.mark.parametrize("name", PURE)
def test_density_ratio_is_at_most_e_eps_between_any_two_inputs(name):
    mech = _mechanisms()[name]
    lo, hi = mech.input_domain()
    ts = np.linspace(lo, hi, 41)
    ratio = _max_ratio(mech.density, ts, _grid(mech))
    assert ratio <= math.exp(EPS) * (1 + 1e-9), (name, ratio)
    assert ratio >= math.exp(EPS) * (1 - 1e-3)  # and the bound is attained (tight)


@pytest.mark.parametrize("cls", [DuchiMechanism, PiecewiseMechanism, LaplaceMechanism])
def test_ratio_check_fails_for_a_mechanism_calibrated_to_the_wrong_eps(cls):
    # e.g. PM with b = e^eps instead of e^(eps/2) is exactly PM(2 eps)
    wrong = cls(1.5 * EPS)
    ratio = _max_ratio(wrong.density, np.linspace(-1, 1, 41), _grid(wrong))
    assert ratio > math.exp(EPS) * 1.3


def test_pnpm_sign_is_eps_ldp_and_magnitude_is_not():
    pn = PNPMMechanism(EPS)
    ys = np.linspace(-pn.C - 0.5, pn.C + 0.5, 20_001)
    ratio = _max_ratio(pn.sign_density, [-1.0, 1.0], ys)
    assert ratio <= math.exp(EPS) * (1 + 1e-9)
    assert ratio >= math.exp(EPS) * (1 - 1e-9)
    # wrong C (Duchi's B): still e^eps on the sign, but biased (see the moment test)
    # the upload's density for w and -w: ratio e^eps
    grid = np.linspace(-3, 3, 30_001)
    assert _max_ratio(pn.density, [0.4, -0.4], grid) <= math.exp(EPS) * (1 + 1e-9)
    # ... but for two magnitudes the supports differ: no finite eps
    assert _max_ratio(pn.density, [0.4, 0.5], grid) == math.inf
    assert _max_ratio(pn.density, [0.4, -0.5], grid) == math.inf
    with pytest.raises(ValueError, match="point mass"):
        pn.density(grid, 0.0)


def test_pnpm_magnitude_distinguishability_formula_matches_the_densities():
    pn = PNPMMechanism(EPS)
    m = 0.3
    edges = np.linspace(0, 6 * pn.C * m, 1_200_001)  # covers k C m for every k below
    mid = 0.5 * (edges[1:] + edges[:-1])
    dx = np.diff(edges)
    f1 = pn.density(mid, m) + pn.density(-mid, m)  # pdf of |y| for |w| = m
    for k in (1.0, 1.5, 2.0, 3.0, pn.C, 5.0):
        f2 = pn.density(mid, k * m) + pn.density(-mid, k * m)
        tv = 0.5 * np.sum(np.abs(f1 - f2) * dx)
        assert pnpm_magnitude_distinguishability(EPS, k) == pytest.approx(tv, abs=2e-4), k
    assert pnpm_magnitude_distinguishability(EPS, pn.C) == 1.0
    assert pnpm_magnitude_distinguishability(EPS, 1.0) == 0.0
    # a factor 2 in magnitude is told apart with advantage ~ 0.71 at eps = 1
    assert pnpm_magnitude_distinguishability(EPS, 2.0) == pytest.approx(
        1 - (pn.C - 2) / (2 * (pn.C - 1))
    )


def test_gaussian_is_eps_delta_not_pure_and_the_check_can_fail():
    g = GaussianMechanism(1.5)
    grid = np.linspace(-40, 40, 400_001)
    dx = grid[1] - grid[0]
    # privacy-loss ratio is unbounded: not pure eps-DP
    assert _max_ratio(g.density, [-1.0, 1.0], grid) > math.exp(g.epsilon) * 10

    def hockey_stick(mech, eps):
        p, q = mech.density(grid, 1.0), mech.density(grid, -1.0)
        return float(np.sum(np.maximum(p - math.exp(eps) * q, 0.0)) * dx)

    assert hockey_stick(g, g.epsilon) <= g.delta
    assert hockey_stick(_WrongScaleGaussian(1.5), g.epsilon) > 100 * g.delta


# --------------------------------------------------------------------------
# vectorised (TensorFlow) and scalar (numpy) versions agree


def _scalar_draws(mech, t, n, seed):
    rng = np.random.default_rng(seed)
    return np.array([mech.perturb_scalar(float(t), rng) for _ in range(n)])


@pytest.mark.parametrize("name", NAMES)
def test_tensorflow_and_numpy_reference_agree_in_distribution(name):
    mech = _mechanisms(seed=21)[name]
    ts = _inputs(mech)[[0, 2]]
    tf_draws = _draw(mech, ts, n=100_000)
    for i, (t, y_tf) in enumerate(zip(ts, tf_draws)):
        y_np = _scalar_draws(mech, t, 20_000, seed=i)
        if mech.discrete:
            hi = float(mech.output_range(t)[1])
            _assert_support(y_tf, mech.output_range(t))
            _assert_support(y_np, mech.output_range(t))
            p1, p2 = np.mean(np.isclose(y_tf, hi)), np.mean(np.isclose(y_np, hi))
            pooled = (p1 * y_tf.size + p2 * y_np.size) / (y_tf.size + y_np.size)
            se = math.sqrt(pooled * (1 - pooled) * (1 / y_tf.size + 1 / y_np.size))
            assert abs(p1 - p2) < Z * se, (name, t)
        else:
            assert stats.ks_2samp(y_tf, y_np).pvalue > 1e-4, (name, t)


def test_the_agreement_check_can_fail():
    pm, other = PiecewiseMechanism(EPS, seed=1), PiecewiseMechanism(1.5 * EPS)
    assert (
        stats.ks_2samp(_draw(pm, [0.3], 50_000)[0], _scalar_draws(other, 0.3, 20_000, 0)).pvalue
        < 1e-6
    )
    du, other = DuchiMechanism(EPS, seed=1), DuchiMechanism(1.5 * EPS)
    y_tf = _draw(du, [0.5], 50_000)[0] > 0
    y_np = _scalar_draws(other, 0.5, 20_000, 0) > 0
    assert abs(y_tf.mean() - y_np.mean()) > Z * math.sqrt(0.25 * (1 / 50_000 + 1 / 20_000))


# --------------------------------------------------------------------------
# domain handling


@pytest.mark.parametrize("name", ["duchi", "piecewise", "laplace", "gaussian", "ldp_fl"])
def test_error_policy_names_mechanism_range_and_count(name):
    mech = _mechanisms()[name]
    lo, hi = mech.input_domain()
    ok = tf.constant([[lo, hi], [0.5 * (lo + hi), lo]])
    bad = tf.constant([lo - 0.1, hi, hi + 1.0, 0.5 * (lo + hi), hi + 1e-3])
    pattern = (
        rf"{type(mech).__name__}\(epsilon=.*\): 3 of 5 entries of weight tensor 1 "
        rf"\(shape \[5\]\) lie outside the input range \[{lo:g}, {hi:g}\]"
    )
    if name == "gaussian":
        pattern = pattern.replace(r"\(epsilon=", r"\(noise_multiplier=")
    with pytest.raises(ValueError, match=pattern):
        mech.perturb_weights([ok, bad])
    with pytest.raises(ValueError, match="DomainPolicy.clip"):
        mech.perturb(bad)
    assert out_of_domain_counts([ok, bad], DomainPolicy.error(), mech) == [0, 3]
    assert mech.perturb_weights([ok])[0].shape == (2, 2)


def test_pnpm_takes_any_finite_weight():
    pn = PNPMMechanism(EPS, seed=0)
    out = pn.perturb_weights([tf.constant([-40.0, 0.0, 3.0])])[0].numpy()
    assert abs(out[0]) >= 40 and out[1] == 0 and abs(out[2]) >= 3


def test_clip_policy_is_unbiased_for_the_clipped_weights():
    du = DuchiMechanism(EPS, seed=8)
    w = np.array([-3.0, -0.5, 0.2, 0.9, 3.0], np.float64)
    n = 100_000
    weights = [tf.constant(np.tile(w, (n, 1)))]
    y = du.perturb_weights(weights, DomainPolicy.clip(0.8, center=0.1))[0].numpy()
    c, r = 0.1, 0.8
    _assert_support(y, [c - r * du.B, c + r * du.B])
    clipped = np.clip(w, c - r, c + r)
    var = r**2 * du.variance((clipped - c) / r)
    z = (y.mean(axis=0) - clipped) / np.sqrt(var / n)
    assert np.all(np.abs(z) < Z), z
    # ... and biased for the raw weights outside the range (the clip is real, and explicit)
    assert abs(y.mean(axis=0)[0] - w[0]) > 1.0
    assert out_of_domain_counts(weights, DomainPolicy.clip(0.8, center=0.1)) == [2 * n]


def test_scale_policy_unscales_after_perturbation_and_refuses_out_of_range():
    pm = PiecewiseMechanism(EPS, seed=9)
    bound = 0.25
    w = np.array([-0.25, -0.1, 0.0, 0.25])
    n = 100_000
    y = pm.perturb_weights([tf.constant(np.tile(w, (n, 1)))], DomainPolicy.scale(bound))[0]
    y = y.numpy()
    assert np.all(np.abs(y) <= bound * pm.C * (1 + 1e-9))
    var = bound**2 * pm.variance(w / bound)
    z = (y.mean(axis=0) - w) / np.sqrt(var / n)
    assert np.all(np.abs(z) < Z), z
    with pytest.raises(
        ValueError,
        match=r"PiecewiseMechanism\(epsilon=1.0\): 2 of 4 entries .*"
        r"\[-0.25, 0.25\].*DomainPolicy.scale\(bound=0.25",
    ):
        pm.perturb_weights([tf.constant([0.3, -0.26, 0.1, 0.0])], DomainPolicy.scale(bound))


def test_per_layer_bounds_and_centres():
    lf = LDPFLMechanism(EPS, seed=1)
    policy = DomainPolicy.clip([0.5, 2.0], center=[0.0, 1.0])
    a, b = lf.perturb_weights([tf.zeros([1000]), tf.fill([1000], 5.0)], policy)
    big_b = (math.exp(EPS) + 1) / (math.exp(EPS) - 1)
    _assert_support(a, [-0.5 * big_b, 0.5 * big_b])
    _assert_support(b, [1 - 2 * big_b, 1 + 2 * big_b])
    # w = 5 is clipped to c + r = 3: P[+] = ((3-1)(a-1) + 2(a+1)) / (2*2(a+1)) = a/(a+1)
    frac = np.mean(b.numpy() > 1)
    assert abs(frac - math.exp(EPS) / (math.exp(EPS) + 1)) < 0.06
    with pytest.raises(ValueError, match="2 per-layer bound values but the upload has 3"):
        lf.perturb_weights([tf.zeros([2])] * 3, DomainPolicy.clip([0.5, 2.0]))


def test_ldpfl_with_a_layer_range_is_duchi_on_the_rescaled_weight():
    c, r, w = -0.3, 0.4, 0.0
    lf = LDPFLMechanism(EPS, center=c, radius=r)
    du = DuchiMechanism(EPS)
    t = (w - c) / r
    hi = c + r * du.B
    assert lf.output_range(w)[1] == pytest.approx(hi)
    assert lf.density(hi, w) == pytest.approx(du.density(du.B, t))
    assert lf.variance(w) == pytest.approx(r**2 * du.variance(t))
    y = (
        LDPFLMechanism(EPS, seed=2)
        .perturb_weights([tf.fill([100_000], w)], DomainPolicy.clip(r, center=c))[0]
        .numpy()
    )
    p = float(du.density(du.B, t))
    assert abs(np.mean(np.isclose(y, hi)) - p) < Z * math.sqrt(p * (1 - p) / y.size)


@pytest.mark.parametrize(
    "policy", [DomainPolicy.error(), DomainPolicy.clip(1.0), DomainPolicy.scale(5.0)]
)
def test_non_finite_weights_are_refused_under_every_policy(policy):
    for mech in (DuchiMechanism(EPS), PNPMMechanism(EPS)):
        with pytest.raises(ValueError, match=r"1 of 3 entries of weight tensor 0 .* NaN or inf"):
            mech.perturb_weights([tf.constant([0.1, float("nan"), 0.2])], policy)
    with pytest.raises(ValueError, match="2 of 3 entries .* NaN or inf"):
        DuchiMechanism(EPS).perturb(tf.constant([float("inf"), -float("inf"), 0.0]))


def test_graph_mode_runs_and_guards_the_domain():
    du = DuchiMechanism(EPS, seed=0)
    fn = tf.function(lambda x: du.perturb(x))
    assert fn(tf.constant([0.5, -0.5])).shape == (2,)
    with pytest.raises(tf.errors.InvalidArgumentError, match="DuchiMechanism"):
        fn(tf.constant([1.5, 0.0]))
    clip_fn = tf.function(lambda x: du.perturb_weights([x], DomainPolicy.clip(1.0))[0])
    assert np.all(np.abs(clip_fn(tf.constant([7.0, -9.0])).numpy()) == pytest.approx(du.B))


def test_shapes_dtypes_and_inputs():
    du = DuchiMechanism(EPS, seed=0)
    var = tf.Variable(tf.zeros([3, 4, 5]))
    out = du.perturb_weights(
        [var, np.zeros((2,), np.float64), tf.zeros([2, 2], tf.float16), tf.constant(0.25)]
    )
    assert [o.shape for o in out] == [(3, 4, 5), (2,), (2, 2), ()]
    assert [o.dtype for o in out] == [tf.float32, tf.float64, tf.float16, tf.float32]
    with pytest.raises(ValueError, match="floating-point weights, got dtype int32"):
        du.perturb(tf.constant([1, 0]))


# --------------------------------------------------------------------------
# seeding


@pytest.mark.parametrize("name", NAMES)
def test_seeded_draws_are_reproducible_and_default_is_not(name):
    x = tf.fill([500], 0.0) if name != "ldp_fl" else tf.fill([500], 0.2)
    x = x + (0.1 if name == "pnpm" else 0.0)
    a = _mechanisms(seed=7)[name].perturb(x).numpy()
    b = _mechanisms(seed=7)[name].perturb(x).numpy()
    c = _mechanisms(seed=8)[name].perturb(x).numpy()
    d = _mechanisms()[name].perturb(x).numpy()
    e = _mechanisms()[name].perturb(x).numpy()
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    assert not np.array_equal(d, e)
    gen = tf.random.Generator.from_seed(3)
    f = _mechanisms()[name].perturb(x, tf.random.Generator.from_seed(3)).numpy()
    g = _mechanisms()[name].perturb(x, gen).numpy()
    np.testing.assert_array_equal(f, g)


# --------------------------------------------------------------------------
# honest privacy reporting


def test_privacy_report_basic_composition_numbers():
    d, rounds = 21_750, 10
    rep = privacy_report(DuchiMechanism(0.5), d, rounds)
    assert rep.epsilon_per_coordinate == 0.5
    assert rep.epsilon_per_upload == pytest.approx(10_875.0)
    assert rep.epsilon_total == pytest.approx(108_750.0)
    assert rep.delta_per_upload == 0.0 and rep.composition == "basic"
    assert "NOT a guarantee for the model" in rep.note
    assert DuchiMechanism(0.5).privacy_report(d, rounds) == rep
    json.dumps(rep.to_dict())
    assert "10875" in str(rep) and "108750" in str(rep)
    lf = privacy_report(LDPFLMechanism(1.0), 41_936, 10)
    assert lf.epsilon_per_upload == pytest.approx(41_936.0)
    assert "shuffling" in lf.note


def test_pnpm_report_says_only_the_sign_is_protected():
    """PNPM uploads |w| U: the whole upload has no finite eps (inf, with the reason);
    d x eps is a figure for the signs only and is labelled so."""
    pn = PNPMMechanism(1.0)
    rep = privacy_report(pn, 56_560, 20)
    assert math.isinf(rep.epsilon_per_upload) and math.isinf(rep.epsilon_total)
    assert "magnitude" in rep.epsilon_infinite_reason
    assert rep.epsilon_per_upload_sign_only == pytest.approx(56_560.0)
    assert rep.epsilon_total_sign_only == pytest.approx(20 * 56_560.0)
    text = str(rep)
    assert "per upload (d = 56560): eps = inf" in text
    assert "signs only: eps = 56560 per upload" in text
    # JSON-ready: inf becomes None, named in infinite_fields, and comes back
    data = rep.to_dict()
    assert data["epsilon_per_upload"] is None and data["epsilon_total"] is None
    assert set(data["infinite_fields"]) == {"epsilon_per_upload", "epsilon_total"}
    json.dumps(data, allow_nan=False)
    assert LocalPrivacyReport.from_dict(data) == rep
    # a mechanism that protects every value keeps finite figures and no sign-only ones
    duchi = privacy_report(DuchiMechanism(1.0), 10, 2)
    assert duchi.epsilon_per_upload == 10.0 and duchi.epsilon_per_upload_sign_only is None
    assert "SIGN" in rep.protected_input
    assert f"{pn.C:.4g}" in rep.note and "w = 0 exactly" in rep.note
    assert "No eps guarantee covers |w|" in rep.note
    assert pn.C == pytest.approx((math.e + 3) / (math.e - 1))


def test_gaussian_report_uses_the_accountant():
    g = GaussianMechanism(2.0, delta=1e-5)
    d, rounds = 100, 5
    rep = privacy_report(g, d, rounds)
    per_coord = compute_epsilon(dp_accounting.GaussianDpEvent(2.0), 1e-5, "rdp")
    assert rep.epsilon_per_coordinate == pytest.approx(per_coord)
    assert rep.epsilon_per_upload == pytest.approx(d * per_coord)
    assert rep.delta_per_upload == pytest.approx(d * 1e-5)
    assert rep.accountant_epsilon_per_upload == pytest.approx(
        compute_epsilon(dp_accounting.GaussianDpEvent(2.0 / math.sqrt(d)), 1e-5, "rdp")
    )
    assert rep.accountant_epsilon_total == pytest.approx(
        compute_epsilon(
            dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(0.2), rounds),
            1e-5,
            "rdp",
        )
    )
    assert rep.accountant_epsilon_per_upload < rep.epsilon_per_upload
    # the upload event is exact Gaussian composition of the d coordinates
    assert compute_epsilon(g.dp_event(4), 1e-5, "pld") == pytest.approx(
        compute_epsilon(
            dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(2.0), 4), 1e-5, "pld"
        ),
        rel=1e-3,
    )


def test_clipped_gaussian_upload_report_uses_sensitivity_two_s():
    rep = gaussian_upload_report(2.0, rounds=10, delta=1e-5)
    assert rep.epsilon_per_upload == pytest.approx(
        compute_epsilon(dp_accounting.GaussianDpEvent(1.0), 1e-5, "rdp")
    )
    assert rep.epsilon_total == pytest.approx(
        compute_epsilon(
            dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(1.0), 10), 1e-5, "rdp"
        )
    )
    assert rep.epsilon_per_coordinate is None
    assert "GaussianDpEvent(1)" in rep.note


def test_gaussian_from_epsilon_calibrates_per_coordinate():
    g = GaussianMechanism.from_epsilon(1.0, delta=1e-5)
    assert 0.98 <= g.epsilon <= 1.0
    assert make_mechanism("gaussian", 1.0, delta=1e-5).noise_multiplier == pytest.approx(
        g.noise_multiplier
    )


# --------------------------------------------------------------------------
# construction and bad inputs


def test_registry_and_config_round_trip():
    assert isinstance(make_mechanism("pm", 1.0), PiecewiseMechanism)
    assert isinstance(make_mechanism("LDP-FL", 1.0, center=0.1), LDPFLMechanism)
    assert MechanismKind.parse("pnpm") is MechanismKind.PNPM
    for mech in _mechanisms(seed=3).values():
        clone = type(mech).from_config(mech.get_config())
        assert clone.get_config() == mech.get_config()
        assert isinstance(clone, LocalDPMechanism)
    with pytest.raises(ValueError, match="mechanism must be one of duchi, piecewise"):
        make_mechanism("rappor", 1.0)


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), float("inf"), "one", True, None, 51.0])
@pytest.mark.parametrize(
    "cls", [DuchiMechanism, PiecewiseMechanism, PNPMMechanism, LDPFLMechanism, LaplaceMechanism]
)
def test_bad_epsilon_is_refused_with_a_clear_error(cls, bad):
    with pytest.raises(ValueError, match=r"epsilon must be (in \(0, 50\]|a number), got"):
        cls(bad)


def test_other_bad_arguments():
    with pytest.raises(ValueError, match=r"radius must be > 0, got 0"):
        LDPFLMechanism(1.0, radius=0)
    with pytest.raises(ValueError, match=r"noise_multiplier must be > 0, got 0"):
        GaussianMechanism(0.0)
    with pytest.raises(ValueError, match=r"gives epsilon .* use more noise"):
        GaussianMechanism(0.01)
    with pytest.raises(ValueError, match=r"delta must be in \(0, 1\), got 0"):
        GaussianMechanism(1.0, delta=0)
    with pytest.raises(ValueError, match=r"bound must be > 0, got -1"):
        DomainPolicy.clip(-1)
    with pytest.raises(ValueError, match=r"bound\[1\] must be > 0, got nan"):
        DomainPolicy.scale([1.0, float("nan")])
    with pytest.raises(ValueError, match="needs a public bound"):
        DomainPolicy("clip")
    with pytest.raises(ValueError, match="takes no bound"):
        DomainPolicy("error", bound=1.0)
    with pytest.raises(ValueError, match="domain mode must be one of clip, scale, error"):
        DomainPolicy("wrap", bound=1.0)
    assert DomainPolicy("CLIP", bound=2).mode is DomainMode.CLIP
    with pytest.raises(ValueError, match="policy must be a DomainPolicy"):
        DuchiMechanism(1.0).perturb_weights([tf.zeros(2)], "clip")
    with pytest.raises(ValueError, match=r"num_coordinates must be a whole number >= 1, got 0"):
        privacy_report(DuchiMechanism(1.0), 0)
    with pytest.raises(ValueError, match=r"rounds must be a whole number >= 1, got 2.5"):
        privacy_report(DuchiMechanism(1.0), 10, 2.5)
    with pytest.raises(ValueError, match="mechanism must be a LocalDPMechanism"):
        privacy_report("duchi", 10)
    with pytest.raises(ValueError, match=r"ratio must be >= 1, got 0.5"):
        pnpm_magnitude_distinguishability(1.0, 0.5)
    with pytest.raises(ValueError, match="sign must be -1 or \\+1"):
        PNPMMechanism(1.0).sign_density(1.0, 0.0)
    with pytest.raises(ValueError, match=r"1 of 1 inputs lie outside the input range \[-1, 1\]"):
        DuchiMechanism(1.0).perturb_scalar(1.5, np.random.default_rng(0))
    with pytest.raises(ValueError, match="input must be finite"):
        PiecewiseMechanism(1.0).variance(float("nan"))


def test_pnpm_client_metrics_report_inf_per_upload_and_a_labelled_sign_only_figure():
    """What a Flower client sends after its uploads (`LocalDPUpload.metrics`)."""
    metrics = LocalDPUpload(PNPMMechanism(1.0)).metrics(100, 3)
    assert math.isinf(metrics["ldp-epsilon-upload"]) and math.isinf(metrics["ldp-epsilon-total"])
    assert metrics["ldp-epsilon-upload-sign-only"] == pytest.approx(100.0)
    assert metrics["ldp-epsilon-total-sign-only"] == pytest.approx(300.0)
    duchi = LocalDPUpload(DuchiMechanism(1.0), DomainPolicy.clip(1.0)).metrics(100, 3)
    assert duchi["ldp-epsilon-upload"] == 100.0 and "ldp-epsilon-upload-sign-only" not in duchi
