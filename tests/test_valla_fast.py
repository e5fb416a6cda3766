"""VaLLA's fit-time shortcuts change its cost, never its result.

* :class:`~sklearn_lla._posteriors.valla_cache.RowCache`: with ``Z`` fixed a training
  row's kernel matrices are computed once per fit; the fit with the cache equals the
  fit without it (same steps, checks and predictive, to round-off) on a BatchNorm CNN
  (graph backend, classification) and an MLP (structured backend, regression, with
  and without a complement), and evaluates each training row's Jacobian once instead
  of once per epoch;
* the ``"auto"`` predictor on a CNN (the basis ``J_Z^T W^T`` pushed through ``J(x)``)
  against the structured one, in float32 and float64.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from sklearn_lla import VaLLAClassifier, VaLLARegressor
from sklearn_lla._network.linearized import LinearizedNet
from sklearn_lla._posteriors import valla as valla_mod
from sklearn_lla._posteriors import valla_cache


def _cnn(seed=0):
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Unflatten(1, (1, 4, 4)), nn.Conv2d(1, 4, 3, padding=1),
                        nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(64, 3))
    with torch.no_grad():  # non-trivial running statistics
        net[2].running_mean.uniform_(-0.2, 0.2)
        net[2].running_var.uniform_(0.5, 1.5)
    return net.eval()


def _mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(2, 16), nn.Tanh(), nn.Linear(16, 1)).double()


def _count_rows(monkeypatch):
    """Count the points whose Jacobian rows ``LinearizedNet.cross_and_diag`` evaluates."""
    seen = {"rows": 0}
    orig = LinearizedNet.cross_and_diag

    def counted(self, x, rows, n_outputs):
        seen["rows"] += int(x.shape[0])
        return orig(self, x, rows, n_outputs)

    monkeypatch.setattr(LinearizedNet, "cross_and_diag", counted)
    return seen


def _problem(kind):
    rng = np.random.default_rng(0)
    if kind == "cnn":
        X = rng.uniform(0, 1, (150, 16)).astype(np.float32)
        y = (X[:, :8].sum(1) > X[:, 8:].sum(1)).astype(int) + (X[:, 0] > 0.8)
        est = VaLLAClassifier(_cnn(), n_inducing=9, max_iter=120, batch_size=20,
                              validation_freq=20, random_state=0)
        return est, X, y
    X = rng.uniform(-2, 2, (150, 2))
    y = np.sin(X[:, 0]) + 0.1 * rng.standard_normal(150)
    # "mlp": the subspace model alone; "mlp-kfac" / "mlp-diagonal": with a complement
    # (fitted after the Adam loop from the cached rows)
    cov = {"mlp": "subspace", "mlp-kfac": "subspace+kfac",
           "mlp-diagonal": "subspace+diagonal"}[kind]
    est = VaLLARegressor(_mlp(), n_inducing=15, covariance=cov, max_iter=120,
                         batch_size=20, validation_freq=20, random_state=0)
    return est, X, y


def _fit(est, X, y, monkeypatch, *, cache, start_rows):
    with monkeypatch.context() as m:
        m.setattr(valla_mod, "START_ROWS", start_rows)
        if not cache:
            m.setattr(valla_cache, "ROW_CACHE_ELEMENTS", 0)
        seen = _count_rows(m)
        est.fit(X, y)
    return est, seen["rows"]


@pytest.mark.parametrize("kind", ["cnn", "mlp", "mlp-kfac", "mlp-diagonal"])
@pytest.mark.parametrize("start_rows", [40, 2000])
def test_row_cache_leaves_the_fit_unchanged(kind, start_rows, monkeypatch):
    """Cached and recomputed rows give the same fit; the cache evaluates each training
    row at most once (steps fill the rows the start did not read)."""
    est, X, y = _problem(kind)
    a, rows_a = _fit(est, X, y, monkeypatch, cache=True, start_rows=start_rows)
    b, rows_b = _fit(type(est)(**est.get_params()), X, y, monkeypatch, cache=False,
                     start_rows=start_rows)
    assert a.n_iter_ == b.n_iter_ and a.n_iter_ > len(X) // 20  # more than an epoch
    sa, sb = np.array(a.stopping_scores_), np.array(b.stopping_scores_)
    np.testing.assert_allclose(sa, sb, rtol=1e-9, atol=1e-12)
    assert a.prior_variance_ == pytest.approx(b.prior_variance_, rel=1e-9)
    if kind == "cnn":
        np.testing.assert_allclose(a.predict_proba(X[:40]), b.predict_proba(X[:40]),
                                   rtol=1e-7, atol=1e-10)
    else:
        ma, sda = a.predict(X[:40], return_std=True)
        mb, sdb = b.predict(X[:40], return_std=True)
        np.testing.assert_allclose(ma, mb, rtol=1e-9, atol=1e-12)
        np.testing.assert_allclose(sda, sdb, rtol=1e-7, atol=1e-12)
    # the start reads min(N, start_rows) rows and the monitor as many others (its
    # check rows), the steps' rows come from the cache after their first visit
    start = min(len(X), start_rows)
    monitor = min(len(X) - start, start) if len(X) > start else 0
    assert rows_a <= len(X) + monitor  # each row once (start / steps), monitor rows
    assert rows_b >= start + monitor + 20 * a.n_iter_  # every step's batch
    assert "row_cache" not in a.posterior_.kernel.__dict__
    assert "_row_cache" not in a.posterior_.__dict__


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_auto_predictor_on_a_cnn_matches_the_structured_one(dtype):
    """On a network whose rows have dense blocks (a CNN in the graph backend), the
    ``"full"`` model predicts by the basis ``U = J_Z^T W^T`` (products in the network's
    dtype): the latent covariance matches the float64 pairing of the stored inducing
    rows (float32: to 1e-5 relative, float64: to round-off); the subspace model and
    chains of ``nn.Linear`` keep the structured predictor."""
    from sklearn_lla._posteriors.gp_algebra import latent_cov

    rng = np.random.default_rng(1)
    X = rng.uniform(0, 1, (120, 16))
    y = rng.integers(0, 3, 120)
    net = _cnn().to(dtype)
    est = VaLLAClassifier(net, n_inducing=9, max_iter=20, random_state=0).fit(
        X.astype(np.float32 if dtype == torch.float32 else np.float64), y)
    post = est.posterior_
    kernel = post.kernel
    assert est.jacobian_backend_ == "graph"
    M = post._Z.shape[0]
    assert kernel.predictor_method(M, M) == "basis"
    assert kernel.predictor_method(M, 2 * M) == "structured"
    factor, _, _ = post.predictor_factor()
    x = torch.as_tensor(X[:50], dtype=dtype)
    covs = []
    for method in ("auto", "structured"):
        Kxx, V = kernel.predictor(post._Z, post._cz, factor, method=method)(x)
        covs.append(latent_cov(Kxx.double(), V.double()))
    var_a, var_s = (torch.diagonal(c, dim1=1, dim2=2) for c in covs)
    assert float(var_s.min()) > 0
    rtol = 1e-5 if dtype == torch.float32 else 1e-10
    np.testing.assert_allclose(covs[0].numpy(), covs[1].numpy(), rtol=rtol,
                               atol=rtol * float(var_s.max()))
    mlp = VaLLARegressor(_mlp(), n_inducing=10, max_iter=20, random_state=0).fit(
        X[:, :2], X[:, 0])
    kern = mlp.posterior_.kernel
    assert kern.predictor_method(10, 10) == "structured"
