"""Exact LLA (LLARegressor / LLAClassifier) against independent dense computations,
against laplace-torch 0.3, and its marginal-likelihood hyperparameter selection
against brute-force grids."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
from torch import nn

from sklearn_lla import LLAClassifier, LLARegressor
from sklearn_lla._core.hyper import glm_log_evidence


def log_marginal_likelihood(s0, s2, *, eigvals, theta_sq_norm, rss=None, n_obs=0, log_lik=None):
    """The closed-form evidence in the old keyword form (regression: rss, else log_lik)."""
    fit = rss if s2 is not None else log_lik
    return glm_log_evidence(s0, s2, eigvals=eigvals, theta_sq_norm=theta_sq_norm,
                            data_fit=fit, n_obs=n_obs)

S0, S2 = 0.3, 0.02  # fixed hyperparameters for the comparisons
S0_CLF = 2.0

# float64 throughout. The parameter-space path solves with a Cholesky factor of H
# (condition number ~1e3-1e5 here), the function-space path subtracts two Woodbury
# terms that nearly cancel at training inputs. Measured against the dense reference:
# <= 1.3e-14 relative to the largest variance, <= 6e-13 pointwise (function space at
# training inputs). 1e-10 / 1e-9 keep a wide margin for other BLAS builds while any
# algebraic error (a wrong factor, a missing term) shows up at 1e-3 or worse.
RTOL = 1e-10
RTOL_POINTWISE = 1e-9


def _queries(data):
    """Test inputs, a few training inputs (where the function-space Woodbury terms
    cancel most) and far-away inputs (extrapolation, large variance)."""
    return np.vstack([data.X_test, data.X[:5], 4.0 * data.X_test[:3]])


def _latent(est, X):
    """Package predictive latent (mean (B, C), cov (B, C, C)) as numpy arrays."""
    lp = est.posterior_.predict(torch.as_tensor(np.asarray(X, dtype=np.float64)))
    return lp.mean.double().numpy(), lp.cov.double().numpy()


def _assert_cov_close(got, want, rtol=RTOL):
    scale = np.abs(want).max()
    np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol * scale)


def _max_rel(got, want):
    return float(np.max(np.abs(got - want)) / np.abs(want).max())


# ---------------------------------------------------------------------------------
# Against the independent dense reference
# ---------------------------------------------------------------------------------


@pytest.mark.parametrize("space", ["parameter", "function"])
@pytest.mark.parametrize("which", ["reg", "reg2"])
def test_regression_matches_dense(which, space, request, dense_ref):
    data = request.getfixturevalue(f"{which}_data")
    net = request.getfixturevalue(f"{which}_net")
    est = LLARegressor(net, prior_variance=S0, noise_variance=S2, space=space,
                       device="cpu").fit(data.X, data.y)
    assert est.space_ == space
    assert est.prior_variance_ == S0 and est.noise_variance_ == S2
    Xq = _queries(data)
    ref = dense_ref.reference(net.module_, data.X, data.y, Xq, "regression", S0, S2)

    mean, cov = _latent(est, Xq)
    np.testing.assert_allclose(mean, ref.f_test, rtol=1e-12, atol=1e-12)
    print(f"\n[dense {which} {space}] max rel. diff. {_max_rel(cov, ref.S):.2e}")
    _assert_cov_close(cov, ref.S)
    # also relative to each point's own variance (not only the largest one)
    d, dref = np.einsum("bcc->bc", cov), np.einsum("bcc->bc", ref.S)
    print(f"[dense {which} {space}] max pointwise rel. diff. {np.max(np.abs(d / dref - 1)):.2e}")
    np.testing.assert_allclose(d, dref, rtol=RTOL_POINTWISE)

    # the public std is sqrt(latent variance + s2), same shape as y
    pred, std = est.predict(Xq, return_std=True)
    var_ref = np.einsum("bcc->bc", ref.S) + S2
    if data.y.ndim == 1:
        var_ref = var_ref[:, 0]
    assert pred.shape == std.shape == var_ref.shape
    np.testing.assert_allclose(std**2, var_ref, rtol=RTOL)

    # joint covariance (return_cov): per-target blocks across query points, + s2 I
    _, jcov = est.predict(Xq, return_cov=True)
    B, C = ref.f_test.shape
    joint = ref.joint.reshape(B, C, B, C)
    for c in range(C):
        want = joint[:, c, :, c] + S2 * np.eye(B)
        got = jcov if data.y.ndim == 1 else jcov[..., c]
        _assert_cov_close(got, want)

    # evidence at the fixed hyperparameters, against slogdet of the dense H
    np.testing.assert_allclose(est.log_marginal_likelihood_, ref.evidence, rtol=1e-9)


@pytest.mark.parametrize("space", ["parameter", "function"])
def test_classification_matches_dense(space, clf_data, clf_net, dense_ref):
    est = LLAClassifier(clf_net, prior_variance=S0_CLF, space=space, device="cpu")
    est.fit(clf_data.X, clf_data.y)
    assert est.space_ == space
    Xq = _queries(clf_data)
    ref = dense_ref.reference(clf_net.module_, clf_data.X, clf_data.y, Xq,
                              "classification", S0_CLF)
    mean, cov = _latent(est, Xq)
    np.testing.assert_allclose(mean, ref.f_test, rtol=1e-12, atol=1e-12)
    print(f"\n[dense clf {space}] max rel. diff. {_max_rel(cov, ref.S):.2e}")
    _assert_cov_close(cov, ref.S)
    d, dref = np.einsum("bcc->bc", cov), np.einsum("bcc->bc", ref.S)
    print(f"[dense clf {space}] max pointwise rel. diff. {np.max(np.abs(d / dref - 1)):.2e}")
    np.testing.assert_allclose(d, dref, rtol=RTOL_POINTWISE)

    # probit: softmax(g / sqrt(1 + pi/8 diag S))
    var = np.einsum("bcc->bc", ref.S)
    want = dense_ref.softmax(ref.f_test / np.sqrt(1.0 + math.pi / 8.0 * var))
    proba = est.predict_proba(Xq)
    np.testing.assert_allclose(proba, want, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(proba.sum(1), 1.0, rtol=1e-12)
    np.testing.assert_array_equal(est.predict(Xq), est.classes_[want.argmax(1)])
    np.testing.assert_allclose(est.predict_log_proba(Xq), np.log(want),
                               rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(est.log_marginal_likelihood_, ref.evidence, rtol=1e-9)


def test_parameter_and_function_space_agree(reg_data, reg_net):
    kw = dict(device="cpu")
    a = LLARegressor(reg_net, space="parameter", **kw).fit(reg_data.X, reg_data.y)
    b = LLARegressor(reg_net, space="function", **kw).fit(reg_data.X, reg_data.y)
    # "auto" hyperparameters come from the same non-zero eigenvalues in both spaces;
    # the two eigensolves differ in the last digits, the optimiser tolerates that.
    np.testing.assert_allclose(a.prior_variance_, b.prior_variance_, rtol=1e-6)
    np.testing.assert_allclose(a.noise_variance_, b.noise_variance_, rtol=1e-6)
    np.testing.assert_allclose(a.log_marginal_likelihood_, b.log_marginal_likelihood_,
                               rtol=1e-9)
    ma, sa = a.predict(reg_data.X_test, return_std=True)
    mb, sb = b.predict(reg_data.X_test, return_std=True)
    np.testing.assert_array_equal(ma, mb)
    np.testing.assert_allclose(sa, sb, rtol=1e-5)


@pytest.mark.parametrize("space", ["parameter", "function"])
def test_prediction_batch_size_invariance(space, reg_data, reg_net):
    # predict streams over batch_size points; the result must not depend on it
    # (float64 sums in another order: ~1e-15)
    kw = dict(prior_variance=S0, noise_variance=S2, space=space, device="cpu")
    a = LLARegressor(reg_net, batch_size=3, **kw).fit(reg_data.X, reg_data.y)
    b = LLARegressor(reg_net, batch_size=1000, **kw).fit(reg_data.X, reg_data.y)
    ma, sa = a.predict(reg_data.X_test, return_std=True)
    mb, sb = b.predict(reg_data.X_test, return_std=True)
    np.testing.assert_allclose(ma, mb, rtol=1e-13, atol=1e-13)
    np.testing.assert_allclose(sa, sb, rtol=1e-12)


def test_auto_space_picks_smaller(reg_data, reg_net, clf_data, clf_net):
    # regression: P = 81 > N*C = 60
    est = LLARegressor(reg_net, prior_variance=S0, noise_variance=S2, device="cpu")
    assert est.fit(reg_data.X, reg_data.y).space_ == "function"
    # fewer points than parameters again, or more: N*C = 90 > P = 81
    X2 = np.vstack([reg_data.X, reg_data.X_test + 0.01, reg_data.X_test - 0.01])[:90]
    y2 = np.sin(X2 @ np.array([1.0, 0.5, -0.3]))
    assert est.fit(X2, y2).space_ == "parameter"
    # classification: P = 99 < N*C = 270
    clf = LLAClassifier(clf_net, prior_variance=S0_CLF, device="cpu")
    assert clf.fit(clf_data.X, clf_data.y).space_ == "parameter"
    assert clf.fit(clf_data.X[:30], clf_data.y[:30]).space_ == "function"  # N*C = 90


def test_too_large_raises_naming_ella():
    # P = 2 * 20001 and N*C = 2 * 20001: both above the dense limit (10,000), and the
    # check happens before any Jacobian is formed, so this is cheap.
    torch.manual_seed(0)
    module = nn.Linear(1, 20001, dtype=torch.float64)
    X = np.array([[0.0], [1.0]])
    y = np.zeros((2, 20001))
    for space in ["auto", "parameter", "function"]:
        with pytest.raises(ValueError, match="ELLA"):
            LLARegressor(module, prior_variance=1.0, noise_variance=1.0, space=space,
                         device="cpu").fit(X, y)


def test_bad_space_raises(reg_data, reg_net):
    with pytest.raises(ValueError, match="space"):
        LLARegressor(reg_net, space="dual", device="cpu").fit(reg_data.X, reg_data.y)


# ---------------------------------------------------------------------------------
# Against laplace-torch 0.3 (full GGN, all weights)
# ---------------------------------------------------------------------------------


def _loader(X, y):
    from torch.utils.data import DataLoader, TensorDataset

    return DataLoader(TensorDataset(torch.as_tensor(X), torch.as_tensor(y)), batch_size=32)


def _laplace_model(net):
    # laplace-torch computes in the model's dtype: a float64 copy keeps it in float64
    # (and leaves the fixture's net untouched: Laplace.fit sets eval mode and attrs).
    model = copy.deepcopy(net.module_).double()
    for p in model.parameters():
        p.requires_grad_(True)
    return model


# laplace-torch 0.3's default backend (CurvlinopsGGN) materialises the GGN as
# ``linop @ torch.eye(P)`` with a *float32* identity, so curvlinops returns the dense
# GGN rounded to float32 (relative error ~6e-8 in H, measured 1.1e-8) even for a float64
# model; the covariance error is that times up to cond(H) (~3e3 here). Measured: 1e-7 to
# 7e-7 relative. The BackPACK backend stays in float64 and agrees with us to ~1e-14.
BACKENDS = {
    "backpack": (1e-10, 1e-12),  # (covariance rtol, evidence rtol): float64 throughout
    "curvlinops": (1e-5, 1e-6),  # float32-rounded GGN, see above
}


def _backend(name):
    if name == "backpack":
        pytest.importorskip("backpack")
        from laplace.curvature import BackPackGGN

        return BackPackGGN
    from laplace.curvature import CurvlinopsGGN

    return CurvlinopsGGN


@pytest.mark.filterwarnings("ignore:Extension saving to:UserWarning")
@pytest.mark.filterwarnings("ignore:Full backward hook:UserWarning")
@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("which", ["reg", "reg2"])
def test_regression_matches_laplace_torch(which, backend, request):
    laplace = pytest.importorskip("laplace")
    tol_cov, tol_lml = BACKENDS[backend]
    data = request.getfixturevalue(f"{which}_data")
    net = request.getfixturevalue(f"{which}_net")
    y2 = data.y.reshape(len(data.y), -1)
    la = laplace.Laplace(_laplace_model(net), "regression", subset_of_weights="all",
                         hessian_structure="full", sigma_noise=math.sqrt(S2),
                         prior_precision=1.0 / S0, backend=_backend(backend))
    la.fit(_loader(data.X, y2))
    f_mu, f_var = la(torch.as_tensor(data.X_test), pred_type="glm")
    assert f_var.dtype == torch.float64

    est = LLARegressor(net, prior_variance=S0, noise_variance=S2, device="cpu")
    est.fit(data.X, data.y)
    mean, cov = _latent(est, data.X_test)
    rel = _max_rel(cov, f_var.numpy())
    print(f"\n[laplace-torch {backend} {which}] max rel. diff. of latent covariance: {rel:.3e}")
    np.testing.assert_allclose(mean, f_mu.numpy(), rtol=1e-12, atol=1e-12)
    assert rel < tol_cov

    lml = float(la.log_marginal_likelihood())
    print(f"[laplace-torch {backend} {which}] log marginal likelihood: ours "
          f"{est.log_marginal_likelihood_:.15g}, laplace-torch {lml:.15g}")
    np.testing.assert_allclose(est.log_marginal_likelihood_, lml, rtol=tol_lml)


@pytest.mark.filterwarnings("ignore:Extension saving to:UserWarning")
@pytest.mark.filterwarnings("ignore:Full backward hook:UserWarning")
@pytest.mark.parametrize("backend", list(BACKENDS))
def test_classification_matches_laplace_torch(backend, clf_data, clf_net):
    laplace = pytest.importorskip("laplace")
    tol_cov, tol_lml = BACKENDS[backend]
    la = laplace.Laplace(_laplace_model(clf_net), "classification", subset_of_weights="all",
                         hessian_structure="full", prior_precision=1.0 / S0_CLF,
                         backend=_backend(backend))
    la.fit(_loader(clf_data.X, clf_data.y.astype(np.int64)))
    # the latent GLM predictive N(f_mu, f_var), f_var of shape (B, C, C)
    f_mu, f_var = la._glm_predictive_distribution(torch.as_tensor(clf_data.X_test))
    assert f_var.shape == (len(clf_data.X_test), 3, 3)

    est = LLAClassifier(clf_net, prior_variance=S0_CLF, device="cpu")
    est.fit(clf_data.X, clf_data.y)
    mean, cov = _latent(est, clf_data.X_test)
    rel = _max_rel(cov, f_var.numpy())
    print(f"\n[laplace-torch {backend} clf] max rel. diff. of latent covariance: {rel:.3e}")
    np.testing.assert_allclose(mean, f_mu.numpy(), rtol=1e-12, atol=1e-12)
    assert rel < tol_cov
    # probit probabilities against laplace-torch's own probit link
    la_proba = la(torch.as_tensor(clf_data.X_test), pred_type="glm", link_approx="probit")
    np.testing.assert_allclose(est.predict_proba(clf_data.X_test), la_proba.numpy(),
                               rtol=tol_cov, atol=1e-12)
    lml = float(la.log_marginal_likelihood())
    print(f"[laplace-torch {backend} clf] log marginal likelihood: ours "
          f"{est.log_marginal_likelihood_:.15g}, laplace-torch {lml:.15g}")
    np.testing.assert_allclose(est.log_marginal_likelihood_, lml, rtol=tol_lml)


# ---------------------------------------------------------------------------------
# Marginal likelihood: hyperparameters against brute-force grids
# ---------------------------------------------------------------------------------


def _grid_1d(fun, lo, hi, n):
    grid = np.logspace(lo, hi, n)
    vals = np.array([fun(v) for v in grid])
    k = int(np.argmax(vals))
    assert 0 < k < n - 1, "grid maximum on the boundary: widen the grid"
    step = (hi - lo) / (n - 1) * math.log(10)  # grid step in natural log units
    return grid, vals, k, step


def test_prior_variance_auto_matches_grid_regression(reg_data, reg_net, dense_ref):
    est = LLARegressor(reg_net, prior_variance="auto", noise_variance=S2, device="cpu")
    est.fit(reg_data.X, reg_data.y)
    ref = dense_ref.reference(reg_net.module_, reg_data.X, reg_data.y, None, "regression",
                              1.0, S2)

    def lml(s0):
        return log_marginal_likelihood(s0, S2, eigvals=ref.eig_unit, theta_sq_norm=ref.theta_sq,
                                       rss=ref.rss, n_obs=ref.N * ref.C)

    grid, vals, k, step = _grid_1d(lml, -4, 4, 2000)
    assert abs(math.log(est.prior_variance_) - math.log(grid[k])) <= step
    assert est.log_marginal_likelihood_ >= vals[k] - 1e-6
    assert lml(est.prior_variance_) >= vals[k] - 1e-6
    # the closed form equals the slogdet evidence of the dense H at the optimum
    ref_opt = dense_ref.reference(reg_net.module_, reg_data.X, reg_data.y, None, "regression",
                                  est.prior_variance_, S2)
    np.testing.assert_allclose(est.log_marginal_likelihood_, ref_opt.evidence, rtol=1e-9)


def test_noise_variance_auto_matches_grid_regression(reg_data, reg_net, dense_ref):
    est = LLARegressor(reg_net, prior_variance=S0, noise_variance="auto", device="cpu")
    est.fit(reg_data.X, reg_data.y)
    assert est.prior_variance_ == S0
    ref = dense_ref.reference(reg_net.module_, reg_data.X, reg_data.y, None, "regression",
                              S0, 1.0)

    def lml(s2):
        return log_marginal_likelihood(S0, s2, eigvals=ref.eig_unit, theta_sq_norm=ref.theta_sq,
                                       rss=ref.rss, n_obs=ref.N * ref.C)

    grid, vals, k, step = _grid_1d(lml, -5, 1, 2000)
    assert abs(math.log(est.noise_variance_) - math.log(grid[k])) <= step
    assert est.log_marginal_likelihood_ >= vals[k] - 1e-6


def test_joint_auto_matches_grid_regression(reg_data, reg_net, dense_ref):
    est = LLARegressor(reg_net, device="cpu").fit(reg_data.X, reg_data.y)
    ref = dense_ref.reference(reg_net.module_, reg_data.X, reg_data.y, None, "regression",
                              1.0, S2)
    n0, n2 = 160, 160
    g0 = np.logspace(-4, 4, n0)
    g2 = np.logspace(-5, 1, n2)
    vals = np.array([[log_marginal_likelihood(a, b, eigvals=ref.eig_unit,
                                              theta_sq_norm=ref.theta_sq, rss=ref.rss,
                                              n_obs=ref.N * ref.C) for b in g2] for a in g0])
    i, j = np.unravel_index(np.argmax(vals), vals.shape)
    assert 0 < i < n0 - 1 and 0 < j < n2 - 1
    step0 = 8 / (n0 - 1) * math.log(10)
    step2 = 6 / (n2 - 1) * math.log(10)
    assert abs(math.log(est.prior_variance_) - math.log(g0[i])) <= step0
    assert abs(math.log(est.noise_variance_) - math.log(g2[j])) <= step2
    assert est.log_marginal_likelihood_ >= vals[i, j] - 1e-6
    ref_opt = dense_ref.reference(reg_net.module_, reg_data.X, reg_data.y, None, "regression",
                                  est.prior_variance_, est.noise_variance_)
    np.testing.assert_allclose(est.log_marginal_likelihood_, ref_opt.evidence, rtol=1e-9)


def test_prior_variance_auto_matches_grid_classification(clf_data, clf_net, dense_ref):
    est = LLAClassifier(clf_net, hyper_strategy="evidence", device="cpu").fit(clf_data.X,
                                                                              clf_data.y)
    assert est.hyper_strategy_ == "evidence"
    ref = dense_ref.reference(clf_net.module_, clf_data.X, clf_data.y, None,
                              "classification", 1.0)

    def lml(s0):
        return log_marginal_likelihood(s0, None, eigvals=ref.eig, theta_sq_norm=ref.theta_sq,
                                       log_lik=ref.log_lik)

    grid, vals, k, step = _grid_1d(lml, -4, 4, 2000)
    assert abs(math.log(est.prior_variance_) - math.log(grid[k])) <= step
    assert est.log_marginal_likelihood_ >= vals[k] - 1e-6
    ref_opt = dense_ref.reference(clf_net.module_, clf_data.X, clf_data.y, None,
                                  "classification", est.prior_variance_)
    np.testing.assert_allclose(est.log_marginal_likelihood_, ref_opt.evidence, rtol=1e-9)


def test_log_marginal_likelihood_function_matches_slogdet(reg_data, reg_net, dense_ref):
    # The public closed form, fed independent eigenvalues, equals the slogdet evidence.
    for s0, s2 in [(0.01, 0.5), (S0, S2), (10.0, 1e-3)]:
        ref = dense_ref.reference(reg_net.module_, reg_data.X, reg_data.y, None,
                                  "regression", s0, s2)
        got = log_marginal_likelihood(s0, s2, eigvals=ref.eig_unit, theta_sq_norm=ref.theta_sq,
                                      rss=ref.rss, n_obs=ref.N)
        np.testing.assert_allclose(got, ref.evidence, rtol=1e-9)


# ---------------------------------------------------------------------------------
# sample_y and return_cov
# ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fitted_reg(reg_data, reg_net):
    return LLARegressor(reg_net, prior_variance=S0, noise_variance=S2, device="cpu").fit(
        reg_data.X, reg_data.y)


@pytest.fixture(scope="module")
def fitted_reg2(reg2_data, reg2_net):
    return LLARegressor(reg2_net, prior_variance=S0, noise_variance=S2, device="cpu").fit(
        reg2_data.X, reg2_data.y)


def test_sample_y_shapes_and_determinism(fitted_reg, fitted_reg2, reg_data, reg2_data):
    Xq = reg_data.X_test[:5]
    s = fitted_reg.sample_y(Xq, n_samples=7, random_state=3)
    assert s.shape == (5, 7)
    s1 = fitted_reg.sample_y(Xq)
    assert s1.shape == (5, 1)
    np.testing.assert_array_equal(s, fitted_reg.sample_y(Xq, n_samples=7, random_state=3))
    assert not np.array_equal(s, fitted_reg.sample_y(Xq, n_samples=7, random_state=4))
    s2 = fitted_reg2.sample_y(reg2_data.X_test[:4], n_samples=6, random_state=0)
    assert s2.shape == (4, 2, 6)


@pytest.mark.parametrize("which", ["reg", "reg2"])
def test_sample_y_moments(which, fitted_reg, fitted_reg2, reg_data, reg2_data):
    est, data = (fitted_reg, reg_data) if which == "reg" else (fitted_reg2, reg2_data)
    Xq = data.X_test[:4]
    n = 20000
    draws = est.sample_y(Xq, n_samples=n, random_state=0)
    mean, std = est.predict(Xq, return_std=True)
    _, cov = est.predict(Xq, return_cov=True)
    # statistical: sample mean error ~ std / sqrt(n); 5 standard errors
    np.testing.assert_array_less(np.abs(draws.mean(-1) - mean), 5 * std / math.sqrt(n))
    # sample covariance per target vs return_cov; the standard error of a covariance
    # estimate is <= sqrt(2/n) * var_max ~ 0.01 var_max, so 0.05 var_max is ~5 s.e.
    d = draws if draws.ndim == 3 else draws[:, None, :]
    c = cov if cov.ndim == 3 else cov[..., None]
    for t in range(d.shape[1]):
        emp = np.cov(d[:, t, :])
        np.testing.assert_allclose(emp, c[..., t], atol=0.05 * c[..., t].max())


def test_return_cov(fitted_reg, fitted_reg2, reg_data, reg2_data):
    Xq = reg_data.X_test[:6]
    mean, cov = fitted_reg.predict(Xq, return_cov=True)
    _, std = fitted_reg.predict(Xq, return_std=True)
    assert mean.shape == (6,) and cov.shape == (6, 6)
    np.testing.assert_allclose(np.diag(cov), std**2, rtol=1e-10)
    np.testing.assert_allclose(cov, cov.T, rtol=0, atol=1e-14)
    assert np.all(np.linalg.eigvalsh(cov) > 0)

    Xq2 = reg2_data.X_test[:5]
    mean2, cov2 = fitted_reg2.predict(Xq2, return_cov=True)
    _, std2 = fitted_reg2.predict(Xq2, return_std=True)
    assert mean2.shape == (5, 2) and cov2.shape == (5, 5, 2)
    for t in range(2):
        np.testing.assert_allclose(np.diag(cov2[..., t]), std2[:, t] ** 2, rtol=1e-10)

    with pytest.raises(ValueError):
        fitted_reg.predict(Xq, return_std=True, return_cov=True)


# ---------------------------------------------------------------------------------
# Link approximations
# ---------------------------------------------------------------------------------


def _clf(clf_net, **kw):
    # a small prior variance keeps many test points confident (max probability > 0.9)
    return LLAClassifier(clf_net, prior_variance=0.1, device="cpu", **kw)


def test_link_approximations(clf_data, clf_net):
    Xq = clf_data.X_test
    probit = _clf(clf_net).fit(clf_data.X, clf_data.y).predict_proba(Xq)
    mc_est = _clf(clf_net, link_approx="mc", n_samples_predict=4000, random_state=0)
    mc = mc_est.fit(clf_data.X, clf_data.y).predict_proba(Xq)
    bridge = _clf(clf_net, link_approx="bridge").fit(clf_data.X, clf_data.y).predict_proba(Xq)
    for p in (probit, mc, bridge):
        assert p.shape == (len(Xq), 3)
        assert np.all(np.isfinite(p)) and np.all(p >= 0)
        np.testing.assert_allclose(p.sum(1), 1.0, rtol=1e-12)
    # on confident points the probit approximation is accurate: MC agrees within 0.05
    confident = probit.max(1) > 0.9
    assert confident.sum() >= 5
    np.testing.assert_allclose(mc[confident], probit[confident], atol=0.05)
    # mc: deterministic for a fixed random_state, across calls and across fits
    np.testing.assert_array_equal(mc, mc_est.predict_proba(Xq))
    mc2 = _clf(clf_net, link_approx="mc", n_samples_predict=4000, random_state=0).fit(
        clf_data.X, clf_data.y).predict_proba(Xq)
    np.testing.assert_array_equal(mc, mc2)
    mc3 = _clf(clf_net, link_approx="mc", n_samples_predict=4000, random_state=1).fit(
        clf_data.X, clf_data.y).predict_proba(Xq)
    assert not np.array_equal(mc, mc3)


def test_bad_link_approx(clf_data, clf_net):
    with pytest.raises(ValueError, match="link_approx"):
        _clf(clf_net, link_approx="laplace").fit(clf_data.X, clf_data.y)


def test_classifier_auto_without_held_out_rows_uses_the_weight_norm(clf_data, clf_net):
    # full-network evidence wrecks the calibration of nets that fit their training
    # data (docs/calibration.md): without held-out rows the prior is ||theta||^2 / P
    est = LLAClassifier(clf_net, device="cpu").fit(clf_data.X, clf_data.y)
    assert est.hyper_strategy_ == "weight_norm" and est.validation_source_ is None
    theta = np.concatenate([p.detach().numpy().ravel() for p in clf_net.module_.parameters()])
    assert est.prior_variance_ == pytest.approx(theta @ theta / theta.size, rel=1e-12)
    # with held-out rows: the prior stays the weight norm, a temperature is calibrated
    # on them (tests/test_glm.py checks the temperature against brute force)
    est = LLAClassifier(clf_net, device="cpu").fit(
        clf_data.X, clf_data.y, validation_data=(clf_data.X_test, clf_data.y_test))
    assert est.hyper_strategy_ == "weight_norm" and est.validation_source_ == "validation_data"
    assert est.prior_variance_ == pytest.approx(theta @ theta / theta.size, rel=1e-12)
    assert "calibration" in est.hyper_trace_
    with pytest.raises(ValueError, match="validation_data"):
        LLAClassifier(clf_net, hyper_strategy="validation", device="cpu").fit(clf_data.X,
                                                                             clf_data.y)



@pytest.mark.parametrize("space", ["parameter", "function"])
@pytest.mark.parametrize("task", ["regression", "classification"])
def test_tiny_cnn_matches_dense(task, space, cnn_cases, dense_ref):
    """Exact LLA on a conv net with BatchNorm and a residual block (the graph Jacobian
    backend: conv weight blocks from unfolded patches, BatchNorm's affine parameters,
    autograd through the residual sum and the pooling) equals the dense oracle."""
    X, y, Xt, net = cnn_cases[task]
    module = copy.deepcopy(net.module_).double().eval()
    X64, Xt64 = X.astype(np.float64), Xt.astype(np.float64)
    if task == "regression":
        est = LLARegressor(module, prior_variance=S0, noise_variance=S2, space=space,
                           device="cpu")
        ref_args = ("regression", S0, S2)
    else:
        est = LLAClassifier(module, prior_variance=S0_CLF, space=space, device="cpu")
        ref_args = ("classification", S0_CLF)
    est.fit(X64, y)
    assert est.space_ == space and est.jacobian_backend_ == "graph"
    Xq = np.vstack([Xt64, X64[:5], 4.0 * Xt64[:3]])
    ref = dense_ref.reference(module, X64, y, Xq, *ref_args)
    mean, cov = _latent(est, Xq)
    np.testing.assert_allclose(mean, ref.f_test, rtol=1e-12, atol=1e-12)
    print(f"\n[dense cnn {task} {space}] max rel. diff. {_max_rel(cov, ref.S):.2e}")
    _assert_cov_close(cov, ref.S)
    d, dref = np.einsum("bcc->bc", cov), np.einsum("bcc->bc", ref.S)
    np.testing.assert_allclose(d, dref, rtol=RTOL_POINTWISE)
    np.testing.assert_allclose(est.log_marginal_likelihood_, ref.evidence, rtol=1e-9)
