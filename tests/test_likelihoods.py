"""Likelihoods and link approximations (sklearn_lla._core.likelihoods)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import scipy.special
import scipy.stats
import torch

from sklearn_lla._core.likelihoods import (
    LINK_APPROXIMATIONS,
    Bernoulli,
    Categorical,
    Gaussian,
    point_normals,
    row_keys,
    sharpening_floor,
)

DT = torch.float64


def predictive_proba(mean, cov, link="probit", n_samples=512, generator=None):
    return Categorical(mean.shape[-1], link, n_samples).predict(mean, cov, generator=generator)


def CategoricalLikelihood(C=4):
    return Categorical(C)


def GaussianLikelihood(s2, C=1):
    return Gaussian(s2, C)


def _logits(B=7, C=4, scale=3.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    return scale * torch.randn(B, C, dtype=DT, generator=g)


def _covs(B=7, C=4, scale=1.0, seed=1):
    g = torch.Generator().manual_seed(seed)
    L = torch.randn(B, C, C, dtype=DT, generator=g)
    return scale * (L @ L.transpose(1, 2)) / C + 1e-3 * torch.eye(C, dtype=DT)


@pytest.mark.parametrize("C", [2, 3, 5])
def test_categorical_lam_factor(C):
    f = _logits(B=9, C=C)
    f[0] = torch.tensor([40.0] + [-40.0] * (C - 1), dtype=DT)  # saturated softmax
    lik = CategoricalLikelihood(C)
    A = lik.lam_factor(f)
    assert A.shape == (9, C, C)
    p = torch.softmax(f, -1)
    want = torch.diag_embed(p) - p[:, :, None] * p[:, None, :]
    # exact algebraic identity; products of O(1) numbers: float64 rounding only
    torch.testing.assert_close(A @ A.transpose(1, 2), want, rtol=0, atol=1e-14)
    torch.testing.assert_close(lik.lam(f), want, rtol=0, atol=1e-15)
    # Lam is PSD with the constant vector in its null space (softmax shift invariance)
    torch.testing.assert_close(lik.lam(f) @ torch.ones(C, dtype=DT),
                               torch.zeros(9, C, dtype=DT), rtol=0, atol=1e-15)
    assert torch.all(torch.linalg.eigvalsh(want) > -1e-15)


def test_gaussian_lam_factor():
    s2 = 0.37
    lik = GaussianLikelihood(s2, 3)
    f = _logits(B=5, C=3)
    A = lik.lam_factor(f)
    assert A.shape == (5, 3, 3)
    torch.testing.assert_close(A @ A.transpose(1, 2),
                               torch.eye(3, dtype=DT).expand(5, 3, 3) / s2, rtol=1e-15, atol=0)
    torch.testing.assert_close(lik.lam(f), torch.eye(3, dtype=DT).expand(5, 3, 3) / s2,
                               rtol=1e-15, atol=0)
    v = torch.rand(5, 3, dtype=DT)
    m, var = lik.predict(f, torch.diag_embed(v))
    torch.testing.assert_close(var, v + s2, rtol=0, atol=0)
    assert m is f


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan")])
def test_gaussian_rejects_bad_noise(bad):
    with pytest.raises(ValueError):
        GaussianLikelihood(bad)


@pytest.mark.parametrize("C", [1, 2])
def test_gaussian_log_likelihood_vs_scipy(C):
    rng = np.random.RandomState(0)
    f = rng.randn(11, C)
    y = f + 0.3 * rng.randn(11, C)
    s2 = 0.09
    got = GaussianLikelihood(s2, C).log_prob(torch.as_tensor(f), torch.as_tensor(y))
    want = scipy.stats.norm(loc=f, scale=math.sqrt(s2)).logpdf(y).sum(1)
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-13)


def test_categorical_log_likelihood_vs_scipy():
    f = _logits(B=13, C=4).numpy()
    f[0] = [60.0, -60.0, 0.0, 1.0]  # large logits: must stay finite (log-sum-exp)
    y = np.array([0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 1])
    got = CategoricalLikelihood().log_prob(torch.as_tensor(f), torch.as_tensor(y))
    want = (f - scipy.special.logsumexp(f, axis=1, keepdims=True))[np.arange(13), y]
    assert torch.isfinite(got).all()
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-13)


def test_probit_formula():
    mean, cov = _logits(), _covs()
    got = predictive_proba(mean, cov, "probit")
    var = np.einsum("bcc->bc", cov.numpy())
    want = scipy.special.softmax(mean.numpy() / np.sqrt(1 + math.pi / 8 * var), axis=1)
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-13, atol=1e-16)
    # zero covariance: the softmax of the mean
    np.testing.assert_allclose(predictive_proba(mean, 0 * cov, "probit").numpy(),
                               scipy.special.softmax(mean.numpy(), axis=1), rtol=1e-13)


@pytest.mark.parametrize("link", LINK_APPROXIMATIONS)
def test_rows_sum_to_one_and_finite_for_extreme_logits(link):
    C = 3
    mean = torch.tensor([[50.0, -50.0, 0.0], [-50.0, -50.0, 50.0], [50.0, 50.0, 50.0],
                         [0.0, 0.0, 0.0], [1e-3, 0.0, -1e-3]], dtype=DT)
    eye = torch.eye(C, dtype=DT)
    for cov in (1e-6 * eye.expand(5, C, C), 10.0 * eye.expand(5, C, C), _covs(5, C)):
        gen = torch.Generator().manual_seed(0)
        p = predictive_proba(mean, cov.clone(), link, n_samples=256, generator=gen)
        assert p.shape == (5, C)
        assert torch.all(torch.isfinite(p)), (link, p)
        assert torch.all(p >= 0)
        torch.testing.assert_close(p.sum(1), torch.ones(5, dtype=DT), rtol=1e-12, atol=1e-12)
        # the dominant logit stays dominant
        assert p[0].argmax() == 0 and p[1].argmax() == 2
        # symmetric inputs stay symmetric for isotropic covariances
        if torch.equal(cov, cov[0, 0, 0] * eye.expand(5, C, C)) and link != "mc":
            torch.testing.assert_close(p[2], torch.full((C,), 1 / C, dtype=DT))


def test_bridge_formula():
    # Laplace bridge (Hobbhahn et al. 2022) for zero-sum logits and diagonal covariance:
    # alpha_k = (1 - 2/C + e^{mu_k} / C^2 sum_l e^{-mu_l}) / var_k; p = alpha / sum alpha.
    C = 4
    rng = np.random.RandomState(0)
    mu = rng.randn(6, C)
    mu -= mu.mean(1, keepdims=True)
    var = rng.uniform(0.1, 2.0, (6, C))
    alpha = (1 - 2 / C + np.exp(mu) / C**2 * np.exp(-mu).sum(1, keepdims=True)) / var
    want = alpha / alpha.sum(1, keepdims=True)
    cov = torch.diag_embed(torch.as_tensor(var))
    got = predictive_proba(torch.as_tensor(mu), cov, "bridge")
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-12)
    # softmax is shift invariant, and so is the bridge after centring the logits
    shifted = predictive_proba(torch.as_tensor(mu + 3.0), cov, "bridge")
    np.testing.assert_allclose(shifted.numpy(), want, rtol=1e-10)


def test_bridge_zero_mean_is_uniform_and_variance_lowers_confidence():
    C = 4
    mean = torch.zeros(2, C, dtype=DT)
    cov = torch.eye(C, dtype=DT).expand(2, C, C).clone()
    torch.testing.assert_close(predictive_proba(mean, cov, "bridge"),
                               torch.full((2, C), 1 / C, dtype=DT))
    # more variance on the dominant class lowers its probability (an isotropic
    # rescaling leaves the Dirichlet mean unchanged, so vary one class only)
    m = torch.tensor([[2.0, 0.0, 0.0, 0.0]], dtype=DT)
    small = torch.diag(torch.tensor([0.01, 1.0, 1.0, 1.0], dtype=DT))[None]
    big = torch.diag(torch.tensor([10.0, 1.0, 1.0, 1.0], dtype=DT))[None]
    p_small = predictive_proba(m, small, "bridge")
    p_big = predictive_proba(m, big, "bridge")
    assert p_small[0, 0] > p_big[0, 0]


def test_mc_reproducible_and_consistent():
    mean, cov = _logits(B=4, C=3, scale=1.0), _covs(B=4, C=3, scale=0.5)
    a = predictive_proba(mean, cov, "mc", 5000, torch.Generator().manual_seed(7))
    b = predictive_proba(mean, cov, "mc", 5000, torch.Generator().manual_seed(7))
    c = predictive_proba(mean, cov, "mc", 5000, torch.Generator().manual_seed(8))
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert not torch.equal(a, c)
    # against an independent numpy Monte Carlo with 2e5 samples: the MC standard error
    # of a probability with 5000 samples is <= 0.5 / sqrt(5000) ~ 0.007; 0.03 is > 4 s.e.
    rng = np.random.RandomState(0)
    ref = np.stack([
        scipy.special.softmax(rng.multivariate_normal(mean[i].numpy(), cov[i].numpy(),
                                                      200000), axis=1).mean(0)
        for i in range(4)
    ])
    np.testing.assert_allclose(a.numpy(), ref, atol=0.03)
    # zero covariance: every sample is the mean
    z = predictive_proba(mean, torch.zeros_like(cov), "mc", 10, torch.Generator().manual_seed(0))
    torch.testing.assert_close(z, torch.softmax(mean, -1), rtol=1e-8, atol=1e-10)


def test_mc_singular_covariance():
    # a rank-one covariance (as for softmax-invariant directions) must still sample
    C = 3
    v = torch.tensor([1.0, -1.0, 0.0], dtype=DT)
    cov = (v[:, None] * v[None, :]).expand(2, C, C).clone()
    p = predictive_proba(_logits(2, C), cov, "mc", 100, torch.Generator().manual_seed(0))
    assert torch.all(torch.isfinite(p))
    torch.testing.assert_close(p.sum(1), torch.ones(2, dtype=DT))


def test_unknown_link():
    with pytest.raises(ValueError, match="link_approx"):
        predictive_proba(_logits(), _covs(), "laplace")
    with pytest.raises(ValueError, match="link_approx"):
        Bernoulli("laplace")


# ---------------------------------------------------------------------------------
# Gaussian: predictive and expected log likelihood against scipy
# ---------------------------------------------------------------------------------


@pytest.mark.parametrize("C", [1, 3])
def test_gaussian_log_predictive_and_expectation(C):
    rng = np.random.RandomState(3)
    m, y = rng.randn(6, C), rng.randn(6, C)
    cov = _covs(6, C, seed=4) if C > 1 else torch.rand(6, 1, 1, dtype=DT)
    s2 = 0.2
    lik = Gaussian(s2, C)
    got = lik.log_predictive(torch.as_tensor(m), cov, torch.as_tensor(y))
    want = [scipy.stats.multivariate_normal(m[i], cov[i].numpy() + s2 * np.eye(C)).logpdf(y[i])
            for i in range(6)]
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-12)
    # E_{N(m, S)} log N(y | f, s2) = log N(y | m, s2) - tr(S) / (2 s2)
    ell = lik.expected_log_prob(torch.as_tensor(m), cov, torch.as_tensor(y))
    want = scipy.stats.norm(m, math.sqrt(s2)).logpdf(y).sum(1) - np.einsum(
        "bcc->b", cov.numpy()) / (2 * s2)
    np.testing.assert_allclose(ell.numpy(), want, rtol=1e-12)
    assert lik.with_noise(0.5).noise_variance == 0.5 and lik.with_noise(0.5).n_outputs == C


# ---------------------------------------------------------------------------------
# Bernoulli (one-logit binary nets): every link, against references
# ---------------------------------------------------------------------------------


def _binary_case(seed=0, B=200):
    rng = np.random.RandomState(seed)
    m = torch.as_tensor(3 * rng.randn(B, 1))
    v = torch.as_tensor(rng.uniform(0.01, 4.0, (B, 1, 1)))
    return m, v


def test_bernoulli_probit_and_mc():
    m, v = _binary_case()
    p = Bernoulli("probit").predict(m, v)
    want = scipy.special.expit(m[:, 0].numpy() / np.sqrt(1 + math.pi / 8 * v[:, 0, 0].numpy()))
    np.testing.assert_allclose(p[:, 1].numpy(), want, rtol=1e-13)
    np.testing.assert_allclose(p.sum(1).numpy(), 1.0, rtol=1e-14)
    # MC against Gauss-Hermite quadrature of E sigmoid(z) (4 s.e. with 20000 samples)
    pm = Bernoulli("mc", 20000).predict(m, v, generator=torch.Generator().manual_seed(0))
    x, w = np.polynomial.hermite_e.hermegauss(60)
    ref = (scipy.special.expit(m.numpy() + np.sqrt(v[:, :, 0].numpy()) * x) * w).sum(1) / w.sum()
    np.testing.assert_allclose(pm[:, 1].numpy(), ref, atol=4 * 0.5 / math.sqrt(20000))


@pytest.mark.parametrize("link", LINK_APPROXIMATIONS)
def test_bernoulli_links_keep_the_map_decision(link):
    # the bug this guards against: bridge on a [0, z] two-logit encoding predicted
    # one class for every input; every link must keep sign(z) as the decision here
    m, v = _binary_case(1)
    p = Bernoulli(link, 2000).predict(m, v, generator=torch.Generator().manual_seed(0))
    assert p.shape == (len(m), 2)
    strong = m[:, 0].abs() > 1.0
    np.testing.assert_array_equal((p[strong, 1] > 0.5).numpy(), (m[strong, 0] > 0).numpy())


def test_bernoulli_matches_two_logit_categorical():
    # a one-logit net z is the two-logit net [0, z]: probit and MC agree exactly
    m, v = _binary_case(2, B=50)
    mean2 = torch.cat([torch.zeros_like(m), m], 1)
    cov2 = torch.zeros(50, 2, 2, dtype=DT)
    cov2[:, 1, 1] = v[:, 0, 0]
    np.testing.assert_allclose(Bernoulli("probit").predict(m, v).numpy(),
                               Categorical(2, "probit").predict(mean2, cov2).numpy(), rtol=1e-13)
    eps = torch.randn(300, 50, 1, dtype=DT, generator=torch.Generator().manual_seed(1))
    eps2 = torch.cat([torch.zeros_like(eps), eps], -1)
    np.testing.assert_allclose(Bernoulli("mc", 300).predict(m, v, eps=eps).numpy(),
                               Categorical(2, "mc", 300).predict(mean2, cov2, eps=eps2).numpy(),
                               rtol=1e-12)
    # curvature and log likelihood agree too
    y = torch.as_tensor(np.random.RandomState(0).randint(0, 2, 50))
    np.testing.assert_allclose(Bernoulli().lam(m)[:, 0, 0].numpy(),
                               Categorical(2).lam(mean2)[:, 1, 1].numpy(), rtol=1e-12)
    np.testing.assert_allclose(Bernoulli().log_prob(m, y).numpy(),
                               Categorical(2).log_prob(mean2, y).numpy(), rtol=1e-12)


def test_bernoulli_expected_log_prob_quadrature():
    m, v = _binary_case(3, B=20)
    y = torch.as_tensor(np.random.RandomState(0).randint(0, 2, 20))
    got = Bernoulli().expected_log_prob(m, v, y)
    rng = np.random.RandomState(0)
    z = m.numpy() + np.sqrt(v[:, :, 0].numpy()) * rng.randn(20, 200000)
    sign = 2 * y.numpy()[:, None] - 1
    ref = -np.logaddexp(0, -sign * z).mean(1)
    np.testing.assert_allclose(got.numpy(), ref, atol=0.01)


def test_categorical_expected_log_prob_mc():
    mean, cov = _logits(B=5, C=3, scale=1.0), _covs(B=5, C=3, scale=0.5)
    y = torch.tensor([0, 1, 2, 0, 1])
    got = Categorical(3, n_samples=20000).expected_log_prob(
        mean, cov, y, generator=torch.Generator().manual_seed(0))
    rng = np.random.RandomState(1)
    ref = [scipy.special.log_softmax(rng.multivariate_normal(mean[i].numpy(), cov[i].numpy(),
                                                             200000), axis=1)[:, y[i]].mean()
           for i in range(5)]
    np.testing.assert_allclose(got.numpy(), ref, atol=0.02)


# ---------------------------------------------------------------------------------
# Per-point MC draws: independent of the batch they come in
# ---------------------------------------------------------------------------------


def test_point_normals_depend_only_on_the_point():
    rng = np.random.RandomState(0)
    X = rng.randn(40, 5)
    keys = row_keys(X, seed=11)
    eps = point_normals(keys, 64, 3)
    assert eps.shape == (64, 40, 3) and eps.dtype == DT
    sub = point_normals(row_keys(X[[7, 3, 30]], seed=11), 64, 3)
    torch.testing.assert_close(sub, eps[:, [7, 3, 30]], rtol=0, atol=0)
    # float32 and float64 copies of the same values hash alike; another seed differs
    np.testing.assert_array_equal(row_keys(X.astype(np.float32).astype(np.float64), 11),
                                  row_keys(X.astype(np.float32), 11))
    assert not np.array_equal(row_keys(X, 12), keys)
    # standard normal: moments and a KS test over many draws
    big = point_normals(row_keys(rng.randn(500, 2), 0), 200, 2).numpy().ravel()
    assert abs(big.mean()) < 0.01 and abs(big.std() - 1) < 0.01
    assert scipy.stats.kstest(big, "norm").pvalue > 1e-3


@pytest.mark.parametrize("link", ["probit", "mc", "bridge"])
def test_temperature_below_one_never_scales_a_logit_up(link):
    """``f / T_x``, ``T_x = max(T, sqrt(1 - pi min_c v_c / 8))``: a sharpening temperature
    takes back the posterior's spread but no logit's probit scale exceeds 1, so rows
    without latent variance keep the network's own probabilities, rows with a large
    variance are tempered in full, and ``T >= 1`` is plain tempering."""
    g = torch.Generator().manual_seed(0)
    B, C = 6, 4
    mean = 3 * torch.randn(B, C, dtype=torch.float64, generator=g)
    A = torch.randn(B, C, C, dtype=torch.float64, generator=g)
    v = torch.tensor([0.0, 0.1, 0.5, 1.5, 3.0, 30.0], dtype=torch.float64)
    cov = A @ A.transpose(-1, -2) / C
    d = torch.diagonal(cov, dim1=-2, dim2=-1)
    cov = cov / d.min(-1).values[:, None, None] * v[:, None, None]  # min_c v_c = v
    cov[0] = 0.0
    eps = torch.randn(256, B, C, dtype=torch.float64, generator=g)
    lik = Categorical(C, link_approx=link)

    def by_hand(Tx):
        return lik.predict(mean / Tx[:, None], cov / Tx[:, None, None] ** 2, eps=eps)

    floor = torch.sqrt((1 - math.pi / 8 * v).clamp_min(0))
    np.testing.assert_allclose(floor.numpy(), sharpening_floor(cov).numpy(), rtol=1e-12)
    for T in (0.05, 0.5, 0.9):
        got = lik.with_temperature(T).predict(mean, cov, eps=eps)
        np.testing.assert_allclose(got, by_hand(torch.clamp(floor, min=T)), rtol=1e-12)
        # no latent variance: exactly the network (the bridge has no zero-variance
        # limit); v >= 8 / pi: the full temperature
        if link != "bridge":
            np.testing.assert_allclose(got[0], torch.softmax(mean[0], -1), rtol=1e-12)
        np.testing.assert_allclose(got[5], by_hand(torch.full((B,), T, dtype=torch.float64))[5],
                                   rtol=1e-12)
        if link == "probit":  # every logit's scale 1 / sqrt(T_x^2 + pi v_c / 8) <= 1
            Tx = torch.clamp(floor, min=T)[:, None]
            scale = 1 / torch.sqrt(Tx**2 + math.pi / 8 * torch.diagonal(cov, dim1=-2, dim2=-1))
            assert float(scale.max()) <= 1 + 1e-12
    for T in (1.0, 2.0):  # at or above 1: the plain f / T
        got = lik.with_temperature(T).predict(mean, cov, eps=eps)
        np.testing.assert_allclose(got, by_hand(torch.full((B,), T, dtype=torch.float64)),
                                   rtol=1e-12)
    # one logit: the same floor (its only variance)
    b = Bernoulli(link_approx=link)
    z, vz = mean[:, :1], v.reshape(B, 1, 1)
    got = b.with_temperature(0.2).predict(z, vz, eps=eps[..., :1])
    Tb = torch.clamp(floor, min=0.2)
    want = b.predict(z / Tb[:, None], vz / Tb[:, None, None] ** 2, eps=eps[..., :1])
    np.testing.assert_allclose(got, want, rtol=1e-12)
    if link != "bridge":
        assert float(got[0, 1]) == pytest.approx(float(torch.sigmoid(z[0, 0])), rel=1e-12)


@pytest.mark.parametrize("kind", ["categorical", "bernoulli"])
@pytest.mark.parametrize("link", LINK_APPROXIMATIONS)
def test_predict_at_temperatures_equals_one_temperature_at_a_time(kind, link):
    # the batched evaluation the held-out calibration uses is the same computation as
    # with_temperature(T).predict, for temperatures below 1 (per-point floor), at 1 and
    # above, with a covariance scale, for every link (Monte Carlo with shared draws)
    g = torch.Generator().manual_seed(3)
    C = 4 if kind == "categorical" else 1
    lik = (Categorical(C, link, n_samples=64) if kind == "categorical"
           else Bernoulli(link, n_samples=64)).with_covariance_scale(0.3)
    mean = _logits(B=9, C=C)
    A = torch.randn(9, C, C, dtype=DT, generator=g)
    cov = A @ A.transpose(-1, -2)
    eps = torch.randn(64, 9, C, dtype=DT, generator=g)
    y = torch.randint(0, max(C, 2), (9,), generator=g)
    temps = [0.01, 0.4, 0.97, 1.0, 2.5, 100.0]
    got = lik.predict_at_temperatures(mean, cov, temps, eps=eps)
    lp = lik.log_predictive_at_temperatures(mean, cov, y, temps, eps=eps)
    for i, T in enumerate(temps):
        one = lik.with_temperature(T)
        torch.testing.assert_close(got[i], one.predict(mean, cov, eps=eps), rtol=1e-13,
                                   atol=1e-15)
        torch.testing.assert_close(lp[i], one.log_predictive(mean, cov, y, eps=eps),
                                   rtol=1e-13, atol=1e-15)
    with pytest.raises(ValueError, match="temperatures"):
        lik.predict_at_temperatures(mean, cov, [1.0, 0.0])
