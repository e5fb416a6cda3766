"""Likelihoods and link approximations (sklearn_lla._likelihoods)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import scipy.special
import scipy.stats
import torch

from sklearn_lla._likelihoods import (
    LINK_APPROXIMATIONS,
    CategoricalLikelihood,
    GaussianLikelihood,
    predictive_proba,
)

DT = torch.float64


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
    lik = CategoricalLikelihood()
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
    lik = GaussianLikelihood(s2)
    f = _logits(B=5, C=3)
    A = lik.lam_factor(f)
    assert A.shape == (5, 3, 3)
    torch.testing.assert_close(A @ A.transpose(1, 2),
                               torch.eye(3, dtype=DT).expand(5, 3, 3) / s2, rtol=1e-15, atol=0)
    torch.testing.assert_close(lik.lam(f), torch.eye(3, dtype=DT).expand(5, 3, 3) / s2,
                               rtol=1e-15, atol=0)
    v = torch.rand(5, 3, dtype=DT)
    torch.testing.assert_close(lik.predictive_variance(v), v + s2, rtol=0, atol=0)


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
    got = GaussianLikelihood(s2).log_likelihood(torch.as_tensor(f), torch.as_tensor(y))
    want = scipy.stats.norm(loc=f, scale=math.sqrt(s2)).logpdf(y).sum()
    np.testing.assert_allclose(float(got), want, rtol=1e-13)


def test_categorical_log_likelihood_vs_scipy():
    f = _logits(B=13, C=4).numpy()
    f[0] = [60.0, -60.0, 0.0, 1.0]  # large logits: must stay finite (log-sum-exp)
    y = np.array([0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 1])
    got = CategoricalLikelihood().log_likelihood(torch.as_tensor(f), torch.as_tensor(y))
    want = (f - scipy.special.logsumexp(f, axis=1, keepdims=True))[np.arange(13), y].sum()
    assert np.isfinite(float(got))
    np.testing.assert_allclose(float(got), want, rtol=1e-13)


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
