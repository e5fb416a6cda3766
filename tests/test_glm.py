"""The feature-space GLM posterior (sklearn_lla._posteriors.glm) and the hyperparameter layer.

* last-layer LLA (``subset_of_weights="last_layer"``) against a dense last-layer
  oracle built with ``torch.func.jacrev`` and scipy, sharing no code with the package;
* a non-orthonormal projection ``V`` (subspace Laplace's case) against the dense
  subspace formula ``S = J V (V^T H V)^-1 V^T J^T``;
* the strategies of ``_hyper``: evidence and validation grids against brute force,
  edge warnings;
* the "auto" policy with held-out rows (issue 19): the prior stays on its objective
  (the evidence), the noise variance is calibrated on the held-out rows along the
  evidence's pair rescaled, classifiers get a temperature; both checked against brute-force
  refits with fixed hyperparameters, in parameter and function space.
"""

from __future__ import annotations

import copy
import math
import warnings

import numpy as np
import pytest
import scipy.linalg
import torch
from torch.func import functional_call, jacrev

from sklearn_lla import LLAClassifier, LLARegressor
from sklearn_lla._core.hyper import (
    Evidence,
    HyperContext,
    HyperparameterWarning,
    ValidationGrid,
    glm_log_evidence,
)
from sklearn_lla._core.likelihoods import Categorical, Gaussian
from sklearn_lla._core.protocol import FitData
from sklearn_lla._network.linearized import LinearizedNet
from sklearn_lla._posteriors.glm import GLMPosterior, ProjectionFeatures

S0, S2 = 0.7, 0.02


def _last_layer_jacobian(module, X, names):
    """Dense Jacobian of the outputs w.r.t. the named parameters only: (N, C, P_ll)."""
    mod = copy.deepcopy(module).double().eval()
    params = {n: p.detach() for n, p in mod.named_parameters()}
    sub = {n: params[n] for n in names}
    Xt = torch.as_tensor(np.asarray(X, dtype=np.float64))

    def g(s):
        return functional_call(mod, ({**params, **s},), (Xt,)).reshape(len(Xt), -1)

    jac = jacrev(g)(sub)
    N, C = g(sub).shape
    J = torch.cat([jac[n].reshape(N, C, -1) for n in names], -1)
    theta = torch.cat([sub[n].reshape(-1) for n in names])
    with torch.no_grad():
        f = g(sub)
    return f.numpy(), J.detach().numpy(), theta.numpy()


def _dense_ll(module, X, Xt, names, lam_fn, s0):
    f, J, theta = _last_layer_jacobian(module, X, names)
    _, Jt, _ = _last_layer_jacobian(module, Xt, names)
    Lam = lam_fn(f)
    H = np.einsum("nci,ncd,ndj->ij", J, Lam, J) + np.eye(J.shape[-1]) / s0
    Sigma = scipy.linalg.inv(H)
    S = np.einsum("bci,ij,bdj->bcd", Jt, Sigma, Jt)
    return S, f, J, theta, H


@pytest.mark.parametrize("which", ["reg", "reg2"])
def test_last_layer_regression_matches_dense_oracle(which, request):
    data = request.getfixturevalue(f"{which}_data")
    net = request.getfixturevalue(f"{which}_net")
    est = LLARegressor(net, subset_of_weights="last_layer", prior_variance=S0, noise_variance=S2,
                       device="cpu").fit(data.X, data.y)
    names = est.linearized_net_.names
    last = [n for n, _ in net.module_.named_parameters()][-2:]
    assert names == last
    C = est.n_outputs_
    S, *_ = _dense_ll(net.module_, data.X, data.X_test, names,
                      lambda f: np.broadcast_to(np.eye(C) / S2, (len(f), C, C)), S0)
    _, std = est.predict(data.X_test, return_std=True)
    want = np.sqrt(np.einsum("bcc->bc", S) + S2)
    np.testing.assert_allclose(std.reshape(want.shape), want, rtol=1e-10)
    # the joint covariance too
    cov = est.predict(data.X_test[:5], return_cov=True)[1]
    if C == 1:
        _, Jt, _ = _last_layer_jacobian(net.module_, data.X_test[:5], names)
        f, J, _ = _last_layer_jacobian(net.module_, data.X, names)
        H = np.einsum("nci,ncj->ij", J, J) / S2 + np.eye(J.shape[-1]) / S0
        want = Jt[:, 0] @ scipy.linalg.inv(H) @ Jt[:, 0].T + S2 * np.eye(5)
        np.testing.assert_allclose(cov, want, rtol=1e-9)


def test_last_layer_classification_matches_dense_oracle(clf_data, clf_net, dense_ref):
    est = LLAClassifier(clf_net, subset_of_weights="last_layer", prior_variance=S0,
                        device="cpu").fit(clf_data.X, clf_data.y)
    names = est.linearized_net_.names

    def lam(f):
        p = dense_ref.softmax(f)
        return np.einsum("nc,cd->ncd", p, np.eye(p.shape[1])) - np.einsum("nc,nd->ncd", p, p)

    S, *_ = _dense_ll(clf_net.module_, clf_data.X, clf_data.X_test, names, lam, S0)
    got = torch.stack([est.posterior_.predict(torch.as_tensor(clf_data.X_test[i:i + 1])).cov[0]
                       for i in range(len(clf_data.X_test))]).numpy()
    np.testing.assert_allclose(got, S, rtol=1e-9, atol=1e-12)
    f = clf_net.module_(torch.as_tensor(clf_data.X_test)).detach().numpy()
    var = np.einsum("bcc->bc", S)
    want = dense_ref.softmax(f / np.sqrt(1 + math.pi / 8 * var))
    np.testing.assert_allclose(est.predict_proba(clf_data.X_test), want, rtol=1e-9)


def test_last_layer_evidence_matches_dense(reg_data, reg_net):
    est = LLARegressor(reg_net, subset_of_weights="last_layer", device="cpu").fit(
        reg_data.X, reg_data.y)
    assert est.hyper_strategy_ == "evidence"
    names = est.linearized_net_.names
    s0, s2 = est.prior_variance_, est.noise_variance_
    f, J, theta = _last_layer_jacobian(reg_net.module_, reg_data.X, names)
    y = reg_data.y.reshape(-1, 1)
    N, C, P = J.shape

    def evidence(a, b):
        H = np.einsum("nci,ncj->ij", J, J) / b + np.eye(P) / a
        ll = -0.5 * N * C * math.log(2 * math.pi * b) - 0.5 * ((y - f) ** 2).sum() / b
        return ll - 0.5 * theta @ theta / a - 0.5 * (np.linalg.slogdet(H)[1] + P * math.log(a))

    np.testing.assert_allclose(est.log_marginal_likelihood_, evidence(s0, s2), rtol=1e-9)
    for da in (0.9, 1.1):
        for db in (0.9, 1.1):
            assert evidence(s0, s2) >= evidence(s0 * da, s2 * db) - 1e-9


# ---------------------------------------------------------------------------------
# A non-orthonormal projection: the prior Gram V^T V whitens correctly
# ---------------------------------------------------------------------------------


@pytest.mark.parametrize("task", ["regression", "classification"])
def test_projection_features_match_dense_subspace(task, reg_data, reg_net, clf_data, clf_net,
                                                  dense_ref):
    data, net = (reg_data, reg_net) if task == "regression" else (clf_data, clf_net)
    ref = dense_ref.reference(net.module_, data.X, data.y, data.X_test, task, S0,
                              S2 if task == "regression" else None)
    P, C = ref.P, ref.C
    rng = np.random.RandomState(0)
    Vmat = rng.randn(7, P) * rng.uniform(0.1, 3.0, (7, 1))  # K = 7, far from orthonormal
    lin = LinearizedNet(net.module_, torch.device("cpu"))
    lik = Gaussian(S2, C) if task == "regression" else Categorical(C)
    y = (torch.as_tensor(data.y.reshape(len(data.y), -1)) if task == "regression"
         else torch.as_tensor(data.y))
    fd = FitData(lin, lik, data.X, y, batch_size=11)
    post = GLMPosterior(ProjectionFeatures(torch.as_tensor(Vmat)), S0,
                        S2 if task == "regression" else None).fit(fd)
    got = post.predict(torch.as_tensor(data.X_test)).cov.numpy()
    # dense: S = J V (V^T H V)^-1 V^T J^T with the full GGN precision H
    Vt = Vmat.T
    Hs = Vt.T @ ref.H @ Vt
    Jv = np.einsum("bcp,pk->bck", ref.J_test, Vt)
    want = np.einsum("bck,kl,bdl->bcd", Jv, scipy.linalg.inv(Hs), Jv)
    np.testing.assert_allclose(got, want, rtol=1e-8, atol=1e-12)


# ---------------------------------------------------------------------------------
# Hyperparameter strategies
# ---------------------------------------------------------------------------------


def test_evidence_strategy_matches_fine_grid():
    rng = np.random.RandomState(0)
    e = rng.gamma(0.5, 20.0, 40)
    kw = dict(eigvals=e, theta_sq_norm=35.0, data_fit=12.0, n_obs=200, n_outside=13)
    res = Evidence().select(HyperContext("auto", "auto", n_params=53, **kw))
    a = res.prior_variance * np.exp(np.linspace(-0.05, 0.05, 41))
    b = res.noise_variance * np.exp(np.linspace(-0.05, 0.05, 41))
    vals = np.array([[glm_log_evidence(u, v, **kw) for v in b] for u in a])
    assert glm_log_evidence(res.prior_variance, res.noise_variance, **kw) >= vals.max() - 1e-9
    assert res.strategy == "evidence" and res.trace["n_evaluations"] > 0


def test_validation_grid_picks_the_minimum_and_warns_at_edges():
    grid = ValidationGrid(prior_grid=np.logspace(-2, 2, 9), noise_grid=np.logspace(-1, 1, 5))

    def score(s0, s2):  # a bowl with its minimum at s0 = 1, s2 = 2 * base
        return (np.log(s0)[:, None]) ** 2 + (np.log(s2 / 2.0)[None, :]) ** 2

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        res = grid.select(HyperContext("auto", "auto", score=score, base_prior=1.0,
                                       base_noise=1.0))
    assert res.prior_variance == pytest.approx(1.0)
    assert res.noise_variance == pytest.approx(10 ** 0.5)  # nearest grid point to 2
    # the optimum at the raw-network floor and at the upper edge both warn
    with pytest.warns(HyperparameterWarning, match="smallest prior_variance"):
        grid.select(HyperContext("auto", None, score=lambda s0, s2: s0[:, None], base_prior=1.0))
    with pytest.warns(HyperparameterWarning, match="largest prior_variance"):
        grid.select(HyperContext("auto", None, score=lambda s0, s2: -s0[:, None],
                                 base_prior=1.0))
    with pytest.raises(FloatingPointError, match="not finite"):
        grid.select(HyperContext("auto", None, base_prior=1.0,
                                 score=lambda s0, s2: np.full((len(s0), 1), np.nan)))


def test_validation_strategy_equals_brute_force(reg_data, reg_net):
    X, y = reg_data.X, reg_data.y
    Xv, yv = reg_data.X_test, reg_data.y_test
    est = LLARegressor(reg_net, hyper_strategy="validation", device="cpu").fit(
        X, y, validation_data=(Xv, yv))
    assert est.hyper_strategy_ == "validation"
    trace = est.hyper_trace_
    s0s, s2s = trace["prior_variance"], trace["noise_variance"]
    i, j = np.unravel_index(np.argmin(trace["score"]), trace["score"].shape)
    assert est.prior_variance_ == s0s[i] and est.noise_variance_ == s2s[j]
    # spot-check a few candidates against fixed-hyperparameter fits
    from sklearn_lla.metrics import gaussian_nll

    for a, b in [(i, j), (0, 0), (len(s0s) - 1, len(s2s) // 2)]:
        fixed = LLARegressor(reg_net, prior_variance=s0s[a], noise_variance=s2s[b],
                             device="cpu").fit(X, y)
        m, s = fixed.predict(Xv, return_std=True)
        np.testing.assert_allclose(trace["score"][a, b], gaussian_nll(yv, m, s), rtol=1e-8)


def test_latent_predictive_var_and_sample():
    from sklearn_lla._core.protocol import LatentPredictive

    g = torch.Generator().manual_seed(0)
    L = torch.randn(4, 3, 3, dtype=torch.float64, generator=g)
    cov = L @ L.transpose(1, 2)
    cov[0] = 0.0  # a degenerate (zero) covariance samples the mean exactly
    mean = torch.randn(4, 3, dtype=torch.float64, generator=g)
    lp = LatentPredictive(mean, cov)
    torch.testing.assert_close(lp.var, torch.diagonal(cov, dim1=1, dim2=2))
    s = lp.sample(40000, torch.Generator().manual_seed(1))
    assert s.shape == (40000, 4, 3)
    torch.testing.assert_close(s[:, 0], mean[0].expand(40000, 3), rtol=0, atol=1e-12)
    for b in range(1, 4):
        emp = torch.cov(s[:, b].T)
        # Monte Carlo error of a covariance entry with 40000 draws: ~sqrt(2/40000) ~ 0.7 %
        torch.testing.assert_close(emp, cov[b], rtol=0, atol=0.05 * float(cov[b].abs().max()))
        torch.testing.assert_close(s[:, b].mean(0), mean[b], rtol=0,
                                   atol=0.05 * float(cov[b].diagonal().sqrt().max()))


# ---------------------------------------------------------------------------------
# The "auto" policy with held-out rows: objective for the prior, held-out rows for one
# scalar (noise / temperature), checked against brute-force refits
# ---------------------------------------------------------------------------------


def _held_out_nll(est, Xv, yv):
    from sklearn_lla.metrics import gaussian_nll

    m, s = est.predict(Xv, return_std=True)
    return gaussian_nll(yv, m, s)


@pytest.mark.parametrize("space", ["parameter", "function"])
def test_auto_with_held_out_rows_rescales_the_evidence_pair(space, reg_data, reg_net):
    """Held-out rows fit one scale c of the evidence's pair: (c s0^2, c s2) is the
    consistent posterior of that pair, its std sqrt(c) times the uncalibrated one
    everywhere (on and off the data), and c is the held-out NLL's minimiser, checked
    against refits at neighbouring scales and against the closed-form Gaussian
    maximum-likelihood scale."""
    X, y, Xv, yv = reg_data.X, reg_data.y, reg_data.X_test, reg_data.y_test
    plain = LLARegressor(reg_net, space=space, device="cpu").fit(X, y)
    assert "calibration" not in plain.hyper_trace_ and plain.validation_source_ is None
    est = LLARegressor(reg_net, space=space, device="cpu").fit(X, y, validation_data=(Xv, yv))
    assert est.hyper_strategy_ == "evidence" and est.validation_source_ == "validation_data"
    cal = est.hyper_trace_["calibration"]
    c = cal["scale"]
    assert est.prior_variance_ == pytest.approx(c * plain.prior_variance_, rel=1e-10)
    assert est.noise_variance_ == pytest.approx(c * plain.noise_variance_, rel=1e-10)
    Xq = np.concatenate([Xv, 3 * Xv])
    s_plain = plain.predict(Xq, return_std=True)[1]
    np.testing.assert_allclose(est.predict(Xq, return_std=True)[1], np.sqrt(c) * s_plain,
                               rtol=1e-8)
    # the consistent posterior of the rescaled pair (a fixed-hyperparameter refit)
    fixed = LLARegressor(reg_net, space=space, prior_variance=est.prior_variance_,
                         noise_variance=est.noise_variance_, device="cpu").fit(X, y)
    np.testing.assert_allclose(fixed.predict(Xv, return_std=True)[1],
                               est.predict(Xv, return_std=True)[1], rtol=1e-8)
    nll = _held_out_nll(est, Xv, yv)
    assert cal["best_score"] == pytest.approx(nll, rel=1e-9)
    # closed form: c* = mean r^2 / (S + s2) at the evidence's pair
    m, s = plain.predict(Xv, return_std=True)
    c_star = float(np.mean((yv - m) ** 2 / s ** 2))
    assert c == pytest.approx(c_star, rel=1e-8)
    for f in (1.05, 1 / 1.05):
        other = LLARegressor(reg_net, space=space, device="cpu",
                             prior_variance=f * c * plain.prior_variance_,
                             noise_variance=f * c * plain.noise_variance_).fit(X, y)
        assert _held_out_nll(other, Xv, yv) >= nll - 1e-9


@pytest.mark.parametrize("space", ["parameter", "function"])
def test_over_explained_held_out_rows_shrink_the_pair(space, reg_data, reg_net):
    """Held-out residuals far below the posterior's latent variance (inputs 3x those of
    the training distribution, targets = the net's output plus a little noise): the
    scale c is far below 1, still the closed-form maximum-likelihood one, and nothing
    warns while it stays inside the grid."""
    import warnings

    from sklearn_lla._core.hyper import HyperparameterWarning

    X, y, Xv = reg_data.X, reg_data.y, 3 * reg_data.X_test
    rng = np.random.RandomState(0)
    yv = np.asarray(reg_net.predict(Xv)).reshape(-1) + 3e-3 * rng.randn(len(Xv))
    plain = LLARegressor(reg_net, space=space, device="cpu").fit(X, y)
    with warnings.catch_warnings():
        warnings.simplefilter("error", HyperparameterWarning)
        est = LLARegressor(reg_net, space=space, device="cpu").fit(
            X, y, validation_data=(Xv, yv))
    c = est.hyper_trace_["calibration"]["scale"]
    m, s = plain.predict(Xv, return_std=True)
    assert c < 0.1 and c == pytest.approx(float(np.mean((yv - m) ** 2 / s ** 2)), rel=1e-8)
    assert est.noise_variance_ == pytest.approx(c * plain.noise_variance_, rel=1e-10)


def test_held_out_rows_far_off_warn_at_the_grid_floor(reg_data, reg_net):
    """Held-out targets equal to the network's outputs to 1e-9: no scale of the
    posterior fits them; the scale ends at the grid's floor with a warning."""
    from sklearn_lla._core.hyper import HyperparameterWarning

    X, y, Xv = reg_data.X, reg_data.y, 3 * reg_data.X_test
    yv = np.asarray(reg_net.predict(Xv), dtype=np.float64).reshape(-1) + 1e-9
    with pytest.warns(HyperparameterWarning, match="over-explains"):
        LLARegressor(reg_net, device="cpu").fit(X, y, validation_data=(Xv, yv))


def test_fixed_prior_with_held_out_rows_calibrates_only_the_noise(reg_data, reg_net):
    X, y, Xv, yv = reg_data.X, reg_data.y, reg_data.X_test, reg_data.y_test
    est = LLARegressor(reg_net, prior_variance=S0, device="cpu").fit(
        X, y, validation_data=(Xv, yv))
    assert est.prior_variance_ == S0
    grid = est.hyper_trace_["calibration"]["noise_variance"]
    brute = [_held_out_nll(LLARegressor(reg_net, prior_variance=S0, noise_variance=float(v),
                                        device="cpu").fit(X, y), Xv, yv) for v in grid[:41]]
    assert _held_out_nll(est, Xv, yv) <= min(brute) + 1e-12
    # both fixed: nothing to calibrate, the given values are kept
    est = LLARegressor(reg_net, prior_variance=S0, noise_variance=S2, device="cpu").fit(
        X, y, validation_data=(Xv, yv))
    assert (est.prior_variance_, est.noise_variance_) == (S0, S2)
    assert "calibration" not in est.hyper_trace_


def test_classifier_covariance_scale_on_held_out_rows(clf_data, clf_net):
    """Held-out rows twice as far out as the data, labelled by the network (so it is
    right on all of them): the posterior's spread there is wider than the rows
    support and the temperature's cap leaves their NLL above the network's own, so
    the latent covariance is scaled down (``covariance_scale_ < 1``) by the largest
    factor within tolerance, and ``predict_proba`` is the likelihood's at that scale
    and temperature; on rows like the training data the scale stays 1."""
    X, y = clf_data.X, clf_data.y
    Xv = 2.0 * clf_data.X_test
    yv = clf_net.predict(Xv)
    with warnings.catch_warnings():
        warnings.simplefilter("error", HyperparameterWarning)
        est = LLAClassifier(clf_net, device="cpu").fit(X, y, validation_data=(Xv, yv))
    cal = est.hyper_trace_["calibration"]
    c, T = est.covariance_scale_, est.temperature_
    assert 1e-3 < c < 1 and cal["covariance_scale"] == c
    tol = max(0.005, 0.1 * cal["network_nll"])
    assert cal["best_score"] - cal["network_nll"] <= tol + 1e-9
    lp = est.posterior_.predict(torch.as_tensor(Xv, dtype=torch.float64))
    want = Categorical(3).with_temperature(T).predict(lp.mean, c * lp.cov)
    np.testing.assert_allclose(est.predict_proba(Xv), want.numpy(), rtol=1e-10, atol=1e-12)
    near = LLAClassifier(clf_net, device="cpu").fit(X, y, validation_data=(clf_data.X_test,
                                                                          clf_data.y_test))
    assert near.covariance_scale_ == 1.0


@pytest.mark.parametrize("space", ["parameter", "function"])
def test_classifier_temperature_on_held_out_rows(space, clf_data, clf_net):
    X, y, Xv, yv = clf_data.X, clf_data.y, clf_data.X_test, clf_data.y_test
    plain = LLAClassifier(clf_net, space=space, device="cpu").fit(X, y)
    assert plain.temperature_ == 1.0
    est = LLAClassifier(clf_net, space=space, device="cpu").fit(X, y, validation_data=(Xv, yv))
    # the prior stays the objective's (full network: the weight norm), only T moves
    assert est.hyper_strategy_ == "weight_norm"
    assert est.prior_variance_ == pytest.approx(plain.prior_variance_, rel=1e-12)
    T = est.temperature_
    cal = est.hyper_trace_["calibration"]
    lik = est.likelihood_

    def nll(t):
        with torch.no_grad():
            lp = est.posterior_.predict(torch.as_tensor(Xv, dtype=torch.float64))
            return float(-lik.with_temperature(t).log_predictive(
                lp.mean, lp.cov, torch.as_tensor(yv)).mean())

    assert nll(T) == pytest.approx(cal["best_score"], rel=1e-9)
    Tf = cal["fitted_temperature"]
    assert Tf >= cal["min_temperature"] * (1 - 1e-9)
    assert cal["at_sharpening_limit"] == (math.log(Tf / cal["min_temperature"]) < 1e-3)
    for t in (Tf * 1.05, Tf / 1.05):  # a local minimum unless on the sharpening bound
        if t >= cal["min_temperature"]:
            assert nll(t) >= nll(Tf) - 1e-10
    # kept only when it beats T = 1 out of fold (tests/test_core_calibration.py checks
    # both branches on data with a known answer)
    if cal["kept"]:
        assert T == Tf and cal["out_of_fold_nll"] < cal["out_of_fold_nll_at_1"]
    else:
        assert T == 1.0 and cal["out_of_fold_nll"] >= cal["out_of_fold_nll_at_1"]
    # never sharper than the network itself on the held-out rows
    raw = clf_net.predict_proba(Xv).max(1).mean()
    assert est.predict_proba(Xv).max(1).mean() <= raw + 1e-6
    # predict_proba is the tempered predictive
    p = est.predict_proba(Xv)
    with torch.no_grad():
        lp = est.posterior_.predict(torch.as_tensor(Xv, dtype=torch.float64))
        # f / T_x per point, T_x = max(T, sqrt(1 - pi min_c v_c / 8)): no logit's probit
        # scale above 1 (a temperature below 1 never sharpens past the network)
        v = torch.diagonal(lp.cov, dim1=-2, dim2=-1).clamp_min(0).min(-1).values
        Tx = torch.clamp(torch.sqrt((1 - math.pi / 8 * v).clamp_min(0)), min=T) if T < 1 \
            else torch.full_like(v, T)
        want = lik.with_temperature(1.0).predict(lp.mean / Tx[:, None],
                                                 lp.cov / Tx[:, None, None] ** 2)
    np.testing.assert_allclose(p, want.numpy(), rtol=1e-12)
    # a fixed prior variance: the user chose the predictive, no temperature
    fixed = LLAClassifier(clf_net, space=space, prior_variance=0.5, device="cpu").fit(
        X, y, validation_data=(Xv, yv))
    assert fixed.temperature_ == 1.0
