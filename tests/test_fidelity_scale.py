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
