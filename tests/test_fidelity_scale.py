"""Fidelity to exact LLA with N >> the Nystrom / subspace budget (issue 34).

On 3,000 rows with 200 Nystrom pairs (and a 200-point subspace subset) the kept
directions are those the data pin down hardest, and most of exact LLA's epistemic
variance lies outside them. At fixed hyperparameters each scalable estimator's mean
epistemic (latent) variance on held-out rows must be within ``[0.7, 1.4]`` of exact
LLA's (parameter space, the ground truth) and rank the rows alike; before the KFAC
complement ELLA kept about half of it here and the prior residual about six times it
(``benchmarks/fidelity_scale.py`` has the same at 10,000 rows of a 98,801-parameter
net, where the top-``K`` part alone keeps 0.3 %).
"""

from __future__ import annotations

import copy
import warnings

import numpy as np
import pytest
import torch
from scipy.stats import spearmanr
from torch import nn

from sklearn_lla import ELLARegressor, LLARegressor, SubspaceLaplaceRegressor

N, N_TEST, S0, S2 = 3000, 300, 1.0, 0.1
BOUNDS = (0.7, 1.4)


@pytest.fixture(scope="module")
def problem():
    rng = np.random.RandomState(0)
    X = rng.randn(N + N_TEST, 6)
    y = np.sin(X[:, 0]) + 0.5 * X[:, 1] * X[:, 2] + 0.3 * rng.randn(N + N_TEST)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(6, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(),
                            nn.Linear(32, 1)).double()
    Xt, yt = torch.as_tensor(X[:N]), torch.as_tensor(y[:N])[:, None]
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    for _ in range(150):
        opt.zero_grad()
        loss = ((net(Xt) - yt) ** 2).mean()
        loss.backward()
        opt.step()
    exact = LLARegressor(net, prior_variance=S0, noise_variance=S2, space="parameter",
                         device="cpu").fit(X[:N], y[:N])
    return X[:N], y[:N], X[N:], net, _epistemic(exact, X[N:])


def _epistemic(est, X):
    return est.predict(X, return_std=True)[1] ** 2 - est.noise_variance_


def _fit(est, problem):
    X, y, _, _, _ = problem
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the prior residual's warning
        return est.fit(X, y)


ESTIMATORS = {
    "ella": lambda net, **kw: ELLARegressor(net, n_nystrom=200, prior_variance=S0,
                                            noise_variance=S2, device="cpu", random_state=0,
                                            **kw),
    "subspace": lambda net, **kw: SubspaceLaplaceRegressor(
        net, n_subset=200, prior_variance=S0, noise_variance=S2, device="cpu",
        random_state=0, **kw),
}


@pytest.mark.parametrize("name", sorted(ESTIMATORS))
def test_default_keeps_exact_llas_epistemic_variance(name, problem):
    _, _, Xq, net, v_exact = problem
    est = _fit(ESTIMATORS[name](net), problem)
    assert est.residual_correction_ == "kfac"
    v = _epistemic(est, Xq)
    assert np.all(np.isfinite(v)) and np.all(v >= 0)
    ratio = v.mean() / v_exact.mean()
    assert BOUNDS[0] <= ratio <= BOUNDS[1], ratio
    assert spearmanr(v, v_exact)[0] >= 0.8


def test_the_old_complements_miss_it(problem):
    """The measured failure the default fixes: no complement drops variance, the prior
    on the complement overshoots (both still reachable by ``residual_correction``)."""
    _, _, Xq, net, v_exact = problem
    ratio = {}
    for rc in (False, True):
        est = _fit(ESTIMATORS["ella"](net, residual_correction=rc), problem)
        ratio[rc] = _epistemic(est, Xq).mean() / v_exact.mean()
    assert ratio[False] < BOUNDS[0] and ratio[True] > BOUNDS[1]


# -------------------------------------------------------------------------------------
# The evidence of the corrected posterior (issue 34, item 4)
# -------------------------------------------------------------------------------------
def _dense_outside_log_det(comp, c):
    """``log det((I + c H)_perp)`` from the dense KFAC curvature ``H`` (read back from
    the complement's own ``Q Sigma Q^T`` with ``Q = I``) and a dense orthonormal basis
    of the complement of ``span(Q)``."""
    P = comp.Q.shape[1]
    eye = torch.eye(P, dtype=torch.float64)
    probe = copy.copy(comp)
    probe.Q, probe._cache, probe._rot, probe.scale = eye, {}, None, 1.0
    tau = 1.0
    H = torch.linalg.inv(probe._pieces(tau)[-1]) - tau * eye  # (H + tau I)^-1 -> H
    H = comp.scale * 0.5 * (H + H.T)
    g = torch.Generator().manual_seed(0)
    basis, _ = torch.linalg.qr(torch.cat([comp.Q.T, torch.randn(P, P, generator=g,
                                                                 dtype=torch.float64)], 1))
    perp = basis[:, comp.Q.shape[0]:]
    return torch.linalg.slogdet(perp.T @ (eye + c * H) @ perp)[1].item()


def test_complement_occam_term_is_its_block_log_det(problem):
    """``KFACComplement.outside_log_det`` = ``log det`` of the complement block of
    ``I + c H_KFAC`` (dense, P = 1,313), and its derivatives are those of the value."""
    _, _, _, net, _ = problem
    est = _fit(ELLARegressor(net, n_nystrom=60, n_components=6, prior_variance=S0,
                             noise_variance=S2, device="cpu", random_state=0), problem)
    comp = est.posterior_.complement
    for s0, s2 in ((1.0, 0.1), (0.2, 0.5)):
        value, d_prior, d_noise = comp.outside_log_det(s0, s2)
        ref = _dense_outside_log_det(comp, comp.fraction * s0 / s2)
        assert value == pytest.approx(ref, rel=1e-10)
        h = 1e-6
        fd = (comp.outside_log_det(s0 * np.exp(h), s2)[0]
              - comp.outside_log_det(s0 * np.exp(-h), s2)[0]) / (2 * h)
        assert d_prior == pytest.approx(fd, rel=1e-6)
        assert d_noise == pytest.approx(-d_prior, rel=1e-12)
    assert comp.outside_log_det(1.0, None)[2] == 0.0


def test_evidence_counts_the_complements_curvature(problem):
    """ELLA's evidence with the KFAC complement's Occam term picks hyperparameters near
    exact LLA's evidence optimum. Without it (the evidence of the K kept directions
    alone, the complement counted as uninformed) the prior variance came out 24 - 40 x
    exact LLA's here (21 x on 10,000 airline rows) and the epistemic variance 3 x."""
    X, y, Xq, net, _ = problem
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        exact = LLARegressor(net, space="parameter", device="cpu").fit(X, y)
    v_exact = _epistemic(exact, Xq).mean()
    for k, m in ((6, 60), (10, 100)):
        est = _fit(ELLARegressor(net, n_nystrom=m, n_components=k, device="cpu",
                                 random_state=0), problem)
        assert est.hyper_strategy_ == "evidence"
        assert 1 / 3 <= est.prior_variance_ / exact.prior_variance_ <= 3
        assert abs(est.noise_variance_ / exact.noise_variance_ - 1) <= 0.15
        assert 0.5 <= _epistemic(est, Xq).mean() / v_exact <= 2.0


def _valla(net, **kw):
    from sklearn_lla import VaLLARegressor

    return VaLLARegressor(net, n_inducing=100, prior_variance=S0, noise_variance=S2,
                          device="cpu", random_state=0, **kw)


def test_valla_default_keeps_exact_llas_epistemic_variance(problem):
    """VaLLA with 100 inducing pairs on 3,000 rows: the default complement (KFAC on a
    chain net) keeps 1.19 x of exact LLA's mean epistemic variance (Spearman 0.98);
    the diagonal complement, the default before, keeps 1.75 x (measured): a diagonal
    precision spreads the curvature of the directions the data pin down outside the
    span over all parameters and leaves those directions far too loose."""
    _, _, Xq, net, v_exact = problem
    est = _fit(_valla(net), problem)
    assert est.complement_ == "kfac"
    v = _epistemic(est, Xq)
    assert np.all(np.isfinite(v)) and np.all(v >= 0)
    ratio = v.mean() / v_exact.mean()
    assert BOUNDS[0] <= ratio <= BOUNDS[1], ratio
    assert spearmanr(v, v_exact)[0] >= 0.8
    diagonal = _fit(_valla(net, covariance="subspace+diagonal"), problem)
    assert diagonal.complement_ == "diagonal"
    assert _epistemic(diagonal, Xq).mean() / v_exact.mean() > BOUNDS[1]
