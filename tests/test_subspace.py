"""Subspace Laplace (sklearn_lla.subspace) against the truth.

* Theorem 1: with ``projector="optimal"`` built on the query points ``X`` the
  subspace predictive is ``U_s Lam_s U_s^T`` (the best rank-``s`` approximation of
  exact LLA's joint covariance, from an independent dense oracle), and exact LLA
  itself at ``s`` = rank;
* ``Tr S_P(X) <= Tr S(X)`` for every projector (the paper's predictive,
  ``residual_correction=False``), the optimal projector maximises it;
* lowrank-kfac is closer to exact LLA (predictive KL) than subset-diagonal;
* the default (residual correction): the dense formula
  ``J P (P^T H P)^-1 P^T J^T + s0^2 J (I - P P^T) J^T`` with ``P`` in the span of the
  training Jacobians, exact LLA when ``s`` is their rank; the KFAC ridge of the
  ``"auto"`` prior; the check that turns the residual off when ``span(P)`` misses
  directions the data determine;
* KFAC through curvlinops is exact where KFAC is exact (one linear layer);
* the SWAG run leaves the pretrained weights untouched; float32 vs float64 nets;
  pickling; clear errors; ``SubspaceLaplace`` follows ``likelihood``.
"""

from __future__ import annotations

import copy
import pickle
import warnings

import numpy as np
import pytest
import torch
from sklearn.base import is_classifier, is_regressor
from torch import nn

from sklearn_lla import LLAClassifier, LLARegressor
from sklearn_lla._core.hyper import Evidence, HyperContext
from sklearn_lla._core.likelihoods import Categorical, Gaussian
from sklearn_lla._core.protocol import FitData
from sklearn_lla._network.curvature import KFAC, full_ggn, ggn_diagonal
from sklearn_lla._network.linearized import LinearizedNet
from sklearn_lla._posteriors import subspace as subspace_posterior
from sklearn_lla._posteriors.subspace import PROJECTORS
from sklearn_lla.diagnostics import latent_predictive, predictive_kl, trace_criterion
from sklearn_lla.subspace import (
    SubspaceLaplace,
    SubspaceLaplaceClassifier,
    SubspaceLaplaceRegressor,
)

S0, S2 = 0.7, 0.02


def _case(task, request):
    if task == "regression":
        return request.getfixturevalue("reg_data"), request.getfixturevalue("reg_net")
    return request.getfixturevalue("clf_data"), request.getfixturevalue("clf_net")


def _make(task, net, **kw):
    if task == "regression":
        return SubspaceLaplaceRegressor(net, prior_variance=S0, noise_variance=S2, device="cpu",
                                        random_state=0, **kw)
    return SubspaceLaplaceClassifier(net, prior_variance=S0, device="cpu", random_state=0, **kw)


def _exact(task, net, data):
    if task == "regression":
        est = LLARegressor(net, prior_variance=S0, noise_variance=S2, space="parameter",
                           device="cpu")
    else:
        est = LLAClassifier(net, prior_variance=S0, space="parameter", device="cpu")
    return est.fit(data.X, data.y)


# ---------------------------------------------------------------------------------
# Theorem 1
# ---------------------------------------------------------------------------------


@pytest.mark.parametrize("task", ["regression", "classification"])
def test_optimal_full_rank_equals_exact_lla(task, request, dense_ref):
    data, net = _case(task, request)
    Xq = data.X_test[:10]
    C = 1 if task == "regression" else 3
    ref = dense_ref.reference(net.module_, data.X, data.y, Xq, task, S0,
                              S2 if task == "regression" else None)
    rank = np.linalg.matrix_rank(ref.J_test.reshape(-1, ref.P))
    assert rank == 10 * C  # J_X has full row rank: s = rank = n C
    est = _make(task, net, projector="optimal", subspace_dim=rank, subspace_X=Xq).fit(
        data.X, data.y)
    assert est.subspace_dim_ == rank
    _, joint = latent_predictive(est, Xq, joint=True)
    np.testing.assert_allclose(joint, ref.joint, rtol=1e-7, atol=1e-10 * np.abs(ref.joint).max())
    # and the estimator agrees with exact LLA's
    exact = _exact(task, net, data)
    _, blocks = latent_predictive(est, Xq)
    _, want = latent_predictive(exact, Xq)
    np.testing.assert_allclose(blocks, want, rtol=1e-7, atol=1e-12)
    if task == "regression":
        np.testing.assert_allclose(est.predict(Xq, return_std=True)[1],
                                   exact.predict(Xq, return_std=True)[1], rtol=1e-8)
    else:
        np.testing.assert_allclose(est.predict_proba(Xq), exact.predict_proba(Xq), rtol=1e-8)


@pytest.mark.parametrize("task", ["regression", "classification"])
@pytest.mark.parametrize("s", [1, 4, 7])
def test_theorem1_best_rank_s_approximation(task, s, request, dense_ref):
    data, net = _case(task, request)
    Xq = data.X_test[:8]
    ref = dense_ref.reference(net.module_, data.X, data.y, Xq, task, S0,
                              S2 if task == "regression" else None)
    lam, U = np.linalg.eigh(ref.joint)
    lam, U = lam[::-1], U[:, ::-1]
    want = (U[:, :s] * lam[:s]) @ U[:, :s].T  # U_s Lam_s U_s^T
    est = _make(task, net, projector="optimal", subspace_dim=s, subspace_X=Xq).fit(
        data.X, data.y)
    _, joint = latent_predictive(est, Xq, joint=True)
    scale = lam[0]
    np.testing.assert_allclose(joint, want, atol=1e-8 * scale)
    np.testing.assert_allclose(est.projector_eigvals_, lam[:s], rtol=1e-8)
    # the rank-s truncation is optimal in Frobenius norm and under the trace criterion
    assert trace_criterion(est, Xq) == pytest.approx(lam[:s].sum(), rel=1e-8)


# ---------------------------------------------------------------------------------
# Trace criterion and KL to exact LLA
# ---------------------------------------------------------------------------------


@pytest.mark.parametrize("task", ["regression", "classification"])
def test_trace_criterion_bounded_by_exact_and_optimal_is_best(task, request):
    data, net = _case(task, request)
    Xq = data.X_test
    full = trace_criterion(_exact(task, net, data), Xq)
    s = 6
    traces = {}
    for name in PROJECTORS:
        kw = {"subspace_X": Xq} if name == "optimal" else {}
        est = _make(task, net, projector=name, subspace_dim=s, residual_correction=False,
                    **kw).fit(data.X, data.y)
        assert not est.residual_correction_
        traces[name] = trace_criterion(est, Xq)
        assert trace_criterion(est.posterior_, Xq) == pytest.approx(traces[name], rel=1e-12)
        assert 0.0 <= traces[name] <= full * (1 + 1e-9), name
    # Theorem 1's projector on the query points maximises the trace (appendix B.1)
    assert all(traces["optimal"] >= t * (1 - 1e-9) for t in traces.values())


@pytest.mark.parametrize("task", ["regression", "classification"])
def test_lowrank_kfac_closer_to_exact_than_subset_diagonal(task, request):
    """The paper's Figure 1 ordering on a small MLP, at equal s (fixed seeds)."""
    data, net = _case(task, request)
    Xq = data.X_test
    exact = _exact(task, net, data)
    mp, cp = latent_predictive(exact, Xq, joint=task == "regression")
    kl = {}
    for name in ("lowrank-kfac", "subset-diagonal"):
        est = _make(task, net, projector=name, subspace_dim=8,
                    residual_correction=False).fit(data.X, data.y)
        mq, cq = latent_predictive(est, Xq, joint=task == "regression")
        kl[name] = predictive_kl(mp, cp, mq, cq, likelihood=task, noise_variance=S2)
    assert kl["lowrank-kfac"] < kl["subset-diagonal"]


def test_subspace_is_exact_with_every_parameter(reg_data, reg_net):
    """A subset projector with s = p is the full Laplace approximation."""
    exact = _exact("regression", reg_net, reg_data)
    est = _make("regression", reg_net, projector="subset-magnitude", subspace_dim=10_000).fit(
        reg_data.X, reg_data.y)
    assert est.subspace_dim_ == est.linearized_net_.n_params
    np.testing.assert_allclose(est.predict(reg_data.X_test, return_std=True)[1],
                               exact.predict(reg_data.X_test, return_std=True)[1], rtol=1e-9)


# ---------------------------------------------------------------------------------
# Curvature pieces: KFAC (curvlinops) and the GGN diagonal
# ---------------------------------------------------------------------------------


def test_kfac_is_exact_for_one_linear_layer(reg_data):
    net = nn.Sequential(nn.Linear(3, 1)).double()
    lin = LinearizedNet(net, example_input=torch.as_tensor(reg_data.X))
    y = torch.as_tensor(reg_data.y.reshape(-1, 1))
    fd = FitData(lin, Gaussian(S2, 1), reg_data.X, y, batch_size=16)
    G = full_ggn(lin, fd)  # unit noise
    kfac = KFAC(lin, fd)
    np.testing.assert_allclose(np.sort(kfac.eigvals()), np.linalg.eigvalsh(G.numpy()),
                               rtol=1e-10)
    H = G / S2 + torch.eye(4, dtype=torch.float64) / S0
    eye = torch.eye(4, dtype=torch.float64)
    np.testing.assert_allclose(kfac.inverse(S0, S2)(eye).numpy(), torch.linalg.inv(H).numpy(),
                               rtol=1e-8)
    np.testing.assert_allclose(ggn_diagonal(lin, fd).numpy(), torch.diagonal(G).numpy(),
                               rtol=1e-12)


def test_kfac_with_batchnorm_is_kfac_plus_the_exact_diagonal(reg_data):
    """Parameters outside curvlinops' layers (here BatchNorm's) get the exact GGN
    diagonal; the Linear layers the same KFAC blocks as without them; no coupling."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Tanh(), nn.Linear(4, 1)).double()
    net[1].running_mean.uniform_(-0.5, 0.5)
    net[1].running_var.uniform_(0.5, 2.0)
    net.eval()
    X = torch.as_tensor(reg_data.X)
    y = torch.as_tensor(reg_data.y.reshape(-1, 1))
    lin = LinearizedNet(net, example_input=X)
    fd = FitData(lin, Gaussian(S2, 1), reg_data.X, y, batch_size=16)
    kfac = KFAC(lin, fd)
    bn = ["1.weight", "1.bias"]
    assert kfac.diag_names == bn and "BatchNorm1d: 8 parameters" in kfac.description
    linear = [n for n in lin.names if n not in bn]
    lin_l = LinearizedNet(net, example_input=X, param_names=linear)
    kfac_l = KFAC(lin_l, FitData(lin_l, Gaussian(S2, 1), reg_data.X, y, batch_size=16))
    assert kfac_l.diag is None
    lin_b = LinearizedNet(net, example_input=X, param_names=bn)
    d = ggn_diagonal(lin_b, FitData(lin_b, Gaussian(S2, 1), reg_data.X, y, batch_size=16))
    np.testing.assert_allclose(kfac.diag.numpy(), d.numpy(), rtol=1e-12)
    np.testing.assert_allclose(np.sort(kfac.eigvals()),
                               np.sort(np.concatenate([kfac_l.eigvals(), d.numpy()])),
                               rtol=1e-10)
    T = torch.randn(lin.n_params, 3, dtype=torch.float64)
    out = kfac.inverse(S0, S2)(T)
    is_bn = torch.cat([torch.full((p.numel(),), n in bn) for n, p in net.named_parameters()])
    np.testing.assert_allclose(out[is_bn].numpy(),
                               (T[is_bn] / (d / S2 + 1.0 / S0)[:, None]).numpy(), rtol=1e-12)
    np.testing.assert_allclose(out[~is_bn].numpy(),
                               kfac_l.inverse(S0, S2)(T[~is_bn]).numpy(), rtol=1e-10)


def test_kfac_trace_and_ggn_diagonal_on_an_mlp(clf_data, clf_net, dense_ref):
    lin = LinearizedNet(clf_net.module_, example_input=torch.as_tensor(clf_data.X))
    fd = FitData(lin, Categorical(3), clf_data.X, torch.as_tensor(clf_data.y), batch_size=32)
    kfac = KFAC(lin, fd)
    assert len(kfac.eigvals()) == lin.n_params
    assert kfac.eigvals().sum() == pytest.approx(float(kfac.op.trace), rel=1e-10)
    ref = dense_ref.reference(clf_net.module_, clf_data.X, clf_data.y, None, "classification",
                              S0)
    np.testing.assert_allclose(ggn_diagonal(lin, fd).numpy(), np.diag(ref.GGN), rtol=1e-9,
                               atol=1e-12)


def test_prior_auto_is_on_the_kfac_ridge(reg_data, reg_net, dense_ref):
    """Regression default: ``s0^2 = s0_KFAC(s2)``, the KFAC evidence's maximiser at the
    noise in use, and ``s2`` maximises the residual model's own Laplace evidence (the
    full-space evidence with the GGN compressed onto ``span(P)``) along that ridge."""
    X, y = reg_data.X, reg_data.y
    est = SubspaceLaplaceRegressor(reg_net, device="cpu", random_state=0).fit(X, y)
    assert est.hyper_trace_["prior_variance_source"] == "kfac_evidence"
    assert est.hyper_strategy_ == "evidence" and est.residual_correction_
    ref = dense_ref.reference(reg_net.module_, X, y, None, "regression", 1.0, 1.0)
    lin = LinearizedNet(copy.deepcopy(reg_net.module_).double(), example_input=torch.as_tensor(X))
    fd = FitData(lin, Gaussian(1.0, 1), X, torch.as_tensor(y.reshape(-1, 1)), batch_size=16)
    kfac_eig = KFAC(lin, fd).eigvals()

    def kfac_prior(s2):
        return Evidence().select(HyperContext("auto", s2, eigvals=kfac_eig,
                                              theta_sq_norm=ref.theta_sq, data_fit=ref.rss,
                                              n_obs=ref.N, n_params=ref.P)).prior_variance

    s2 = est.noise_variance_
    assert est.prior_variance_ == pytest.approx(kfac_prior(s2), rel=1e-6)
    V = est.projector_.numpy()
    G = np.einsum("nci,ncj->ij", ref.J, ref.J)  # unit-noise GGN
    inside = np.linalg.eigvalsh(V @ G @ V.T)

    def log_z(v):  # dense: log det over all P directions of (V^T V G V^T V / v + I / s0)
        s0 = kfac_prior(v)
        H = V.T @ V @ G @ V.T @ V / v + np.eye(ref.P) / s0
        return (-0.5 * ref.N * np.log(2 * np.pi * v) - 0.5 * ref.rss / v
                - 0.5 * ref.theta_sq / s0 - 0.5 * (np.linalg.slogdet(H)[1] + ref.P * np.log(s0)))

    assert est.log_marginal_likelihood_ == pytest.approx(log_z(s2), rel=1e-9)
    assert log_z(s2) >= max(log_z(s2 * 1.02), log_z(s2 / 1.02))
    assert np.all(inside >= -1e-9)
    # another strategy: the subspace model's own evidence for both
    other = SubspaceLaplaceRegressor(reg_net, hyper_strategy="evidence", device="cpu",
                                     random_state=0).fit(X, y)
    assert "prior_variance_source" not in other.hyper_trace_
    assert other.hyper_strategy_ == "evidence"


# ---------------------------------------------------------------------------------
# The default predictive: the prior variance outside span(P)
# ---------------------------------------------------------------------------------


@pytest.mark.parametrize("task", ["regression", "classification"])
def test_residual_predictive_is_the_dense_formula(task, request, dense_ref):
    """``J P (P^T H P)^-1 P^T J^T + s0^2 J (I - P P^T) J^T``, blocks and joint, and the
    residual's excess ``s0^2 tr(G_perp) / (s2 N C)`` on the training rows."""
    data, net = _case(task, request)
    Xq = data.X_test[:12]
    s2 = S2 if task == "regression" else None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # s = 6 misses data directions
        est = _make(task, net, subspace_dim=6, residual_correction=True).fit(data.X, data.y)
    assert est.residual_correction_ and est.subspace_dim_ == 6
    ref = dense_ref.reference(net.module_, data.X, data.y, Xq, task, S0, s2)
    V = est.projector_.numpy()
    np.testing.assert_allclose(V @ V.T, np.eye(6), atol=1e-12)
    Sig = V.T @ np.linalg.solve(V @ ref.H @ V.T, V) + S0 * (np.eye(ref.P) - V.T @ V)
    Jq = ref.J_test.reshape(-1, ref.P)
    want = Jq @ Sig @ Jq.T
    _, joint = latent_predictive(est, Xq, joint=True)
    np.testing.assert_allclose(joint, want, rtol=1e-8, atol=1e-10 * np.abs(want).max())
    _, blocks = latent_predictive(est, Xq)
    C = ref.C
    idx = np.arange(len(Xq))
    np.testing.assert_allclose(blocks, want.reshape(len(Xq), C, len(Xq), C)[idx, :, idx, :],
                               rtol=1e-8, atol=1e-10 * np.abs(want).max())
    G = ref.GGN * (S2 if task == "regression" else 1.0)  # unit noise
    outside = np.trace(G) - np.trace(V @ G @ V.T)
    want_excess = S0 * outside / (S2 if task == "regression" else 1.0) / (ref.N * C)
    assert est.residual_excess_ == pytest.approx(want_excess, rel=1e-8)


@pytest.mark.parametrize("task", ["regression", "classification"])
def test_residual_subspace_at_the_jacobian_rank_is_exact_lla(task, request, dense_ref):
    """With ``P`` spanning every training Jacobian row, the data determine nothing
    outside ``span(P)``: the residual-corrected subspace is exact LLA (the null space
    of the GGN keeps the prior, which is what grows away from the data)."""
    data, net = _case(task, request)
    n = len(data.X) if task == "regression" else 25  # N C < P: a null space exists
    X, y = data.X[:n], data.y[:n]
    s2 = S2 if task == "regression" else None
    ref = dense_ref.reference(net.module_, X, y, data.X_test, task, S0, s2)
    rank = np.linalg.matrix_rank(ref.J.reshape(-1, ref.P))
    assert rank < ref.P
    est = _make(task, net, subspace_dim=int(rank)).fit(X, y)
    assert est.residual_correction_ and est.subspace_dim_ == rank
    assert est.residual_excess_ == pytest.approx(0.0, abs=1e-9)
    _, blocks = latent_predictive(est, data.X_test)
    np.testing.assert_allclose(blocks, ref.S, rtol=1e-7, atol=1e-10 * np.abs(ref.S).max())


@pytest.mark.parametrize("name", ["lowrank-kfac", "lowrank-diag"])
def test_lowrank_directions_lie_in_the_span_of_the_subset_jacobians(name, reg_data, reg_net,
                                                                    dense_ref):
    """With the residual correction ``P = J_X'^T U_s``; the paper's ``Psi_approx J^T U_s``
    leaves that span (which is why the residual needs the former)."""
    kw = dict(projector=name, subspace_dim=5, n_subset=20)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        row = _make("regression", reg_net, residual_correction=True, **kw).fit(
            reg_data.X, reg_data.y)
    paper = _make("regression", reg_net, residual_correction=False, **kw).fit(
        reg_data.X, reg_data.y)
    idx = row.posterior_.subset_indices
    np.testing.assert_array_equal(idx, paper.posterior_.subset_indices)
    _, J = dense_ref.jacobian(reg_net.module_, reg_data.X[idx])
    Q, _ = np.linalg.qr(J.reshape(len(idx), -1).T)  # orthonormal basis of the row span

    def outside(V):
        return np.linalg.norm(V - (V @ Q) @ Q.T) / np.linalg.norm(V)

    assert outside(row.projector_.numpy()) < 1e-10
    assert outside(paper.projector_.numpy()) > 1e-3
    # the same eigenvectors U_s of M: the same eigenvalues
    np.testing.assert_allclose(row.projector_eigvals_, paper.projector_eigvals_, rtol=1e-10)


@pytest.mark.parametrize("row_space", [False, True])
def test_lowrank_directions_do_not_depend_on_the_chunking(row_space, clf_data, clf_net):
    """``M = J Psi J^T`` is assembled from blocks of Jacobian chunks (only those on and
    below the diagonal, the others mirrored): one chunk and chunks of 7 points (uneven
    last chunk, C = 3 outputs) give the same eigenvalues and the same span."""
    from sklearn_lla._posteriors.subspace import lowrank_directions

    lin, X, psi = _lowrank_problem(clf_data, clf_net, n=30)
    kw = dict(row_space=row_space, method="dense")
    V1, lam1 = lowrank_directions(lin, X, 3, psi, 12, batch_size=1000, **kw)
    V7, lam7 = lowrank_directions(lin, X, 3, psi, 12, batch_size=7, **kw)
    np.testing.assert_allclose(lam7.numpy(), lam1.numpy(), rtol=1e-10)
    # the same span: every principal angle between the two row spaces is zero
    np.testing.assert_allclose(torch.linalg.svdvals(V7 @ V1.T).numpy(), 1.0, atol=1e-8)


def test_residual_is_dropped_when_the_subspace_misses_the_data(reg_data, reg_net, monkeypatch):
    X, y = reg_data.X, reg_data.y
    # "auto" on a structured net: the KFAC complement, shrunk by the data (no warning)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        est = _make("regression", reg_net, subspace_dim=2).fit(X, y)
    assert est.residual_correction_ == "kfac" and est.residual_excess_ > 0.25
    # the prior residual, asked for explicitly, stays on with a warning
    with pytest.warns(RuntimeWarning, match="std on the data is inflated"):
        kept = _make("regression", reg_net, subspace_dim=2, residual_correction=True).fit(X, y)
    assert kept.residual_correction_ is True
    assert kept.residual_excess_ == pytest.approx(est.residual_excess_, rel=1e-12)
    # without the structured backend "auto" is the prior residual, dropped when it
    # would inflate the std on the data
    monkeypatch.setattr(subspace_posterior, "supports_kfac_complement", lambda lin: False)
    with pytest.warns(RuntimeWarning, match="misses directions the training data determine"):
        off = _make("regression", reg_net, subspace_dim=2).fit(X, y)
    assert off.residual_correction_ is False and off.residual_excess_ > 0.25
    # the predictive is then the paper's S_P
    paper = _make("regression", reg_net, subspace_dim=2, residual_correction=False).fit(X, y)
    np.testing.assert_array_equal(off.projector_eigvals_, paper.projector_eigvals_)
    # a subspace that holds the data: no warning, nothing added on the training rows
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        full = _make("regression", reg_net).fit(X, y)
    assert full.residual_correction_ and full.residual_excess_ < 1e-6


# ---------------------------------------------------------------------------------
# Non-mutation, float32, pickling, errors
# ---------------------------------------------------------------------------------


@pytest.mark.parametrize("task", ["regression", "classification"])
def test_swag_leaves_pretrained_weights_untouched(task, request, module_guard):
    data, net = _case(task, request)
    net = copy.deepcopy(net)
    net.module_.train()
    for p in net.module_.parameters():
        p.requires_grad_(True)
    snap = module_guard.snapshot(net.module_)
    est = _make(task, net, projector="subset-swag", subspace_dim=5, swag_n_steps=30).fit(
        data.X, data.y)
    module_guard.check(net.module_, snap)
    theta = torch.cat([p.detach().reshape(-1) for p in net.module_.parameters()])
    assert torch.equal(est.linearized_net_.flat_params(), theta)
    # the SWAG run did move a copy: the chosen coordinates have positive variance
    assert est.subspace_dim_ == 5


@pytest.mark.parametrize("name", PROJECTORS)
def test_float32_net_matches_float64(name, reg_data, reg_net):
    m64 = copy.deepcopy(reg_net.module_).double()
    m32 = copy.deepcopy(reg_net.module_).float()
    kw = dict(projector=name, subspace_dim=6, swag_n_steps=20, residual_correction=False)
    if name == "optimal":
        kw["subspace_X"] = reg_data.X_test
    a = _make("regression", m64, **kw).fit(reg_data.X, reg_data.y)
    b = _make("regression", m32, **kw).fit(reg_data.X.astype(np.float32), reg_data.y)
    sa = a.predict(reg_data.X_test, return_std=True)[1]
    sb = b.predict(reg_data.X_test.astype(np.float32), return_std=True)[1]
    np.testing.assert_allclose(sb, sa, rtol=1e-3, atol=1e-6)


@pytest.mark.parametrize("task", ["regression", "classification"])
@pytest.mark.parametrize("name", ["lowrank-kfac", "lowrank-diag"])
def test_float32_net_matches_float64_defaults(name, task, request):
    """The defaults (residual correction, "auto" s and hyperparameters) from a float32
    net: the residual ``k(x, x) - phi phi^T`` is formed in float64."""
    data, net = _case(task, request)
    m64 = copy.deepcopy(net.module_).double()
    m32 = copy.deepcopy(net.module_).float()
    cls = SubspaceLaplaceRegressor if task == "regression" else SubspaceLaplaceClassifier
    a = cls(m64, projector=name, device="cpu", random_state=0).fit(data.X, data.y)
    b = cls(m32, projector=name, device="cpu", random_state=0).fit(
        data.X.astype(np.float32), data.y)
    assert a.residual_correction_ and b.residual_correction_
    assert b.subspace_dim_ == a.subspace_dim_
    np.testing.assert_allclose(b.prior_variance_, a.prior_variance_, rtol=1e-3)
    Xq = np.concatenate([data.X_test, 3 * data.X_test])  # on and off the data
    if task == "regression":
        sa = a.predict(Xq, return_std=True)[1]
        sb = b.predict(Xq.astype(np.float32), return_std=True)[1]
        np.testing.assert_allclose(sb, sa, rtol=1e-3)
    else:
        np.testing.assert_allclose(b.predict_proba(Xq.astype(np.float32)),
                                   a.predict_proba(Xq), rtol=1e-3, atol=1e-6)


def _net_case(kind, task, request):
    """``(X, y, skorch net)`` of a float32-trained MLP or the tiny BatchNorm CNN."""
    if kind == "cnn":
        X, y, _, net = request.getfixturevalue("cnn_cases")[task]
        return X, y, net
    data, net = _case(task, request)
    return data.X, data.y, net


@pytest.mark.parametrize("task", ["regression", "classification"])
@pytest.mark.parametrize("kind", ["mlp", "cnn"])
def test_kfac_of_a_float32_net_matches_float64(kind, task, request):
    """KFAC runs curvlinops on the net in its own dtype with float64 factors, and the
    BatchNorm diagonal from the net's own products: a float32 net's curvature equals
    the float64 net's to 1e-3 (eigenvalues, ``Psi_approx T``, the diagonal)."""
    X, y, net = _net_case(kind, task, request)
    lik = Gaussian(S2, 1) if task == "regression" else Categorical(3)
    yt = torch.as_tensor(y).reshape(-1, 1) if task == "regression" else torch.as_tensor(y)
    out = {}
    for dt in (torch.float64, torch.float32):
        m = copy.deepcopy(net.module_).to(dt).eval()
        lin = LinearizedNet(m, example_input=torch.as_tensor(X[:4], dtype=dt))
        kfac = KFAC(lin, FitData(lin, lik, X, yt, batch_size=16))
        state = kfac.op.state_dict()
        for kind_ in ("input_covariances", "gradient_covariances"):
            assert all(v.dtype == torch.float64 for v in state[kind_].values())
        T = torch.randn(lin.n_params, 3, dtype=torch.float64,
                        generator=torch.Generator().manual_seed(0))
        out[dt] = (np.sort(kfac.eigvals()), kfac.inverse(S0, S2)(T).numpy(),
                   None if kfac.diag is None else kfac.diag.numpy(), kfac.description,
                   ggn_diagonal(lin, FitData(lin, lik, X, yt, batch_size=16)).numpy())
    a, b = out[torch.float64], out[torch.float32]
    assert b[3] == a[3]
    if kind == "cnn":
        assert "BatchNorm2d" in a[3] and b[2] is not None
        np.testing.assert_allclose(b[2], a[2], rtol=1e-3, atol=1e-6 * a[2].max())
    top = a[0].max()
    np.testing.assert_allclose(b[0], a[0], rtol=1e-3, atol=1e-6 * top)
    # ``Psi_approx T`` is a solve: the float32 factors' round-off (eps 6e-8) is
    # amplified by the conditioning of ``H + tau I``, and entries that are sums of
    # cancelling terms carry it at a few 1e-5 of the largest entry. So the solve is
    # compared column by column in norm (observed <= 9e-5 with 1 or 2 threads, whose
    # nets and reductions differ) and entry by entry against its largest entry.
    err = np.linalg.norm(b[1] - a[1], axis=0) / np.linalg.norm(a[1], axis=0)
    assert err.max() <= 1e-3, err
    np.testing.assert_allclose(b[1], a[1], rtol=1e-3, atol=1e-4 * np.abs(a[1]).max())
    np.testing.assert_allclose(b[4], a[4], rtol=1e-3, atol=1e-6 * a[4].max())


@pytest.mark.parametrize("kind", ["mlp", "cnn"])
@pytest.mark.parametrize("name", ["lowrank-kfac", "lowrank-diag"])
def test_projector_of_a_float32_net_matches_float64(name, kind, request):
    """The projector built on a float32 net (passes in float32, sums in float64) spans
    the float64 net's subspace to 1e-3, with the same eigenvalues of ``J Psi J^T``."""
    X, y, net = _net_case(kind, "classification", request)
    fits = []
    for dt in (torch.float64, torch.float32):
        m = copy.deepcopy(net.module_).to(dt)
        Xd = X.astype(np.float64 if dt == torch.float64 else np.float32)
        fits.append(SubspaceLaplaceClassifier(m, projector=name, subspace_dim=4, device="cpu",
                                              residual_correction=False,
                                              random_state=0).fit(Xd, y))
    a, b = fits
    assert b.projector_.dtype == torch.float64
    np.testing.assert_allclose(b.prior_variance_, a.prior_variance_, rtol=1e-3)
    np.testing.assert_allclose(b.projector_eigvals_, a.projector_eigvals_, rtol=1e-3)
    Va, Vb = a.projector_.numpy(), b.projector_.numpy()
    # the sines of the principal angles between the two spans
    sines = np.linalg.norm(Vb - (Vb @ Va.T) @ Va, axis=1)
    assert sines.max() < 1e-3, sines


@pytest.mark.parametrize("name", ["lowrank-kfac", "subset-swag"])
def test_pickle_round_trip(name, clf_data, clf_net):
    kw = {"subspace_dim": 5} if name == "subset-swag" else {}  # lowrank-kfac: the defaults
    est = _make("classification", clf_net, projector=name, **kw).fit(clf_data.X, clf_data.y)
    back = pickle.loads(pickle.dumps(est))
    np.testing.assert_array_equal(est.predict_proba(clf_data.X_test),
                                  back.predict_proba(clf_data.X_test))
    assert back.prior_variance_ == est.prior_variance_


def test_clear_errors(reg_data, reg_net):
    X, y = reg_data.X, reg_data.y
    with pytest.raises(ValueError, match="projector"):
        SubspaceLaplaceRegressor(reg_net, projector="lowrank-eigen", device="cpu").fit(X, y)
    with pytest.raises(ValueError, match="subspace_dim"):
        SubspaceLaplaceRegressor(reg_net, subspace_dim=0, device="cpu").fit(X, y)
    big = nn.Sequential(nn.Linear(3, 100), nn.Tanh(), nn.Linear(100, 50), nn.Tanh(),
                        nn.Linear(50, 1)).double()
    with pytest.raises(ValueError, match="optimal.*p <= 5000"):
        SubspaceLaplaceRegressor(big, projector="optimal", prior_variance=1.0, noise_variance=0.1,
                                 device="cpu").fit(X, y)

    class Normed(nn.Module):  # a LayerNorm: KFAC (curvlinops) does not support it
        def __init__(self):
            super().__init__()
            self.a, self.n, self.b = nn.Linear(3, 8), nn.LayerNorm(8), nn.Linear(8, 1)

        def forward(self, x):
            return self.b(torch.tanh(self.n(self.a(x))))

    # the default does not raise (issue 31): KFAC for the Linear layers, the exact GGN
    # diagonal for the LayerNorm's parameters, said in projector_curvature_
    est = SubspaceLaplaceRegressor(Normed().double(), device="cpu").fit(X, y)
    assert est.projector_curvature_ == ("KFAC (Linear: 41 parameters) + exact diagonal GGN "
                                        "(LayerNorm: 16 parameters)")
    assert est.hyper_trace_["prior_variance_source"] == "kfac_evidence"
    est = SubspaceLaplaceRegressor(Normed().double(), projector="lowrank-diag", subspace_dim=4,
                                   residual_correction=False, device="cpu").fit(X, y)
    assert est.projector_curvature_ == "exact diagonal GGN"


def test_lowrank_stops_at_the_numerical_rank(reg_data, reg_net):
    with pytest.warns(RuntimeWarning, match="numerically positive"):
        est = _make("regression", reg_net, projector="lowrank-diag", subspace_dim=50,
                    n_subset=5, residual_correction=False).fit(reg_data.X, reg_data.y)
    assert est.subspace_dim_ == 5  # n_subset * C rows


def test_random_state_draws_the_subset(reg_data, reg_net):
    a = _make("regression", reg_net, projector="lowrank-kfac", n_subset=10,
              residual_correction=False)
    sa = a.fit(reg_data.X, reg_data.y).posterior_.subset_indices
    sb = a.set_params(random_state=1).fit(reg_data.X, reg_data.y).posterior_.subset_indices
    assert len(sa) == 10 and not np.array_equal(sa, sb)


# ---------------------------------------------------------------------------------
# SubspaceLaplace(likelihood=...)
# ---------------------------------------------------------------------------------


def test_subspace_laplace_follows_likelihood(reg_data, reg_net, clf_data, clf_net):
    reg = SubspaceLaplace(reg_net, "regression", prior_variance=S0, noise_variance=S2,
                          device="cpu", random_state=0)
    clf = SubspaceLaplace(clf_net, "classification", prior_variance=S0, device="cpu",
                          random_state=0)
    assert is_regressor(reg) and not is_classifier(reg)
    assert is_classifier(clf) and not is_regressor(clf)
    assert not hasattr(reg, "predict_proba") and hasattr(reg, "sample_y")
    assert hasattr(clf, "predict_proba") and not hasattr(clf, "sample_y")
    reg.fit(reg_data.X, reg_data.y)
    clf.fit(clf_data.X, clf_data.y)
    want_reg = _make("regression", reg_net).fit(reg_data.X, reg_data.y)
    want_clf = _make("classification", clf_net).fit(clf_data.X, clf_data.y)
    np.testing.assert_array_equal(reg.predict(reg_data.X_test, return_std=True)[1],
                                  want_reg.predict(reg_data.X_test, return_std=True)[1])
    np.testing.assert_array_equal(clf.predict_proba(clf_data.X_test),
                                  want_clf.predict_proba(clf_data.X_test))
    np.testing.assert_array_equal(clf.predict(clf_data.X_test), want_clf.predict(clf_data.X_test))
    assert clf.score(clf_data.X_test, clf_data.y_test) == want_clf.score(clf_data.X_test,
                                                                         clf_data.y_test)
    assert reg.sample_y(reg_data.X_test[:3], 2).shape == (3, 2)
    with pytest.raises(ValueError, match="regression"):
        clf.predict(clf_data.X_test, return_std=True)


# ---------------------------------------------------------------------------------
# Diagnostics
# ---------------------------------------------------------------------------------


def test_predictive_kl_regression_forms_agree():
    rng = np.random.RandomState(0)
    m0, m1 = rng.randn(5), rng.randn(5)
    A, B = rng.randn(5, 5), rng.randn(5, 5)
    S0_, S1_ = A @ A.T + np.eye(5), B @ B.T + np.eye(5)
    # joint: the closed form
    want = 0.5 * (np.trace(np.linalg.solve(S1_, S0_)) + (m1 - m0) @ np.linalg.solve(S1_, m1 - m0)
                  - 5 + np.linalg.slogdet(S1_)[1] - np.linalg.slogdet(S0_)[1])
    assert predictive_kl(m0, S0_, m1, S1_) == pytest.approx(want, rel=1e-12)
    # variances == diagonal joint == (n, 1, 1) blocks, and the noise is added to both
    v0, v1 = np.diag(S0_), np.diag(S1_)
    a = predictive_kl(m0, v0, m1, v1, noise_variance=0.3)
    b = predictive_kl(m0, np.diag(v0), m1, np.diag(v1), noise_variance=0.3)
    c = predictive_kl(m0[:, None], v0[:, None, None], m1[:, None], v1[:, None, None],
                      noise_variance=0.3)
    assert a == pytest.approx(b, rel=1e-12) and a == pytest.approx(c, rel=1e-12)
    assert predictive_kl(m0, S0_, m0, S0_) == pytest.approx(0.0, abs=1e-12)
    with pytest.raises(ValueError, match="noise_variance"):
        predictive_kl(m0, S0_, m0, np.zeros((5, 5)))


def test_predictive_kl_classification_is_blockwise_probit():
    rng = np.random.RandomState(1)
    m = rng.randn(4, 3)
    A = rng.randn(4, 3, 3)
    Sp = A @ A.transpose(0, 2, 1)
    Sq = 0.5 * Sp

    def probit(m, S):
        z = m / np.sqrt(1 + np.pi / 8 * np.einsum("ncc->nc", S))
        e = np.exp(z - z.max(1, keepdims=True))
        return e / e.sum(1, keepdims=True)

    pp, pq = probit(m, Sp), probit(m, Sq)
    want = (pp * np.log(pp / pq)).sum()
    got = predictive_kl(m, Sp, m, Sq, likelihood="classification")
    assert got == pytest.approx(want, rel=1e-10)
    # a joint covariance: only its diagonal blocks count
    joint = np.zeros((12, 12))
    for i in range(4):
        joint[3 * i:3 * i + 3, 3 * i:3 * i + 3] = Sp[i]
    joint[0, 5] = joint[5, 0] = 0.3
    assert predictive_kl(m, joint, m, Sq, likelihood="classification") == pytest.approx(got)
    assert predictive_kl(m, Sp, m, Sq, likelihood="classification",
                         reduction="mean") == pytest.approx(got / 4)


def _lowrank_problem(clf_data, clf_net, n=60):
    lin = LinearizedNet(copy.deepcopy(clf_net.module_).double(),
                        example_input=torch.as_tensor(clf_data.X[:4], dtype=torch.float64))
    X = torch.as_tensor(clf_data.X[:n], dtype=torch.float64)
    d = torch.linspace(0.5, 2.0, lin.n_params, dtype=torch.float64)[:, None]
    return lin, X, (lambda T: d * T)  # a diagonal Psi (not a multiple of I)


@pytest.mark.parametrize("row_space", [False, True])
def test_randomized_lowrank_directions_match_the_dense_eigendecomposition(row_space, clf_data,
                                                                           clf_net):
    """Randomized block Krylov (never forming ``M``) against the full
    eigendecomposition of ``M`` on 60 points x 3 outputs (180 rows, s = 6, then a
    fourfold eigenvalue gap): Ritz values never exceed the eigenvalues (Cauchy
    interlacing) and agree with them to the stopping tolerance ``RANGE_RTOL``, and the
    span is the same (the Krylov steps converge at the rate of that gap). The run is
    deterministic given the generator and does not depend on the chunking."""
    from sklearn_lla._posteriors.subspace import RANGE_RTOL, lowrank_directions

    lin, X, psi = _lowrank_problem(clf_data, clf_net)
    _, ld = lowrank_directions(lin, X, 3, psi, 7, row_space=row_space, method="dense")
    assert ld[6] < 0.5 * ld[5]  # the gap that makes the top-6 span well defined
    Vd, ld = lowrank_directions(lin, X, 3, psi, 6, row_space=row_space, method="dense")
    runs = [lowrank_directions(lin, X, 3, psi, 6, batch_size=b, row_space=row_space,
                               method="randomized", generator=torch.Generator().manual_seed(0))
            for b in (1000, 7)]
    (Vr, lr), (V7, l7) = runs
    assert (lr <= ld * (1 + 1e-12)).all()
    np.testing.assert_allclose(lr.numpy(), ld.numpy(), rtol=RANGE_RTOL)
    np.testing.assert_allclose(torch.linalg.svdvals(Vd @ Vr.T).numpy(), 1.0, atol=1e-6)
    np.testing.assert_allclose(l7.numpy(), lr.numpy(), rtol=1e-10)
    np.testing.assert_allclose(torch.linalg.svdvals(V7 @ Vr.T).numpy(), 1.0, atol=1e-8)


def test_randomized_lowrank_directions_warn_when_the_range_does_not_settle(clf_data, clf_net,
                                                                          monkeypatch):
    import sklearn_lla._posteriors.subspace as sub

    lin, X, psi = _lowrank_problem(clf_data, clf_net)
    monkeypatch.setattr(sub, "RANGE_MAX_ITERATIONS", 0)
    monkeypatch.setattr(sub, "RANGE_RTOL", 0.0)
    with pytest.warns(RuntimeWarning, match="did not converge in 0 block Krylov steps"):
        V, lam = sub.lowrank_directions(lin, X, 3, psi, 6, method="randomized",
                                        generator=torch.Generator().manual_seed(0))
    assert V.shape == (6, lin.n_params) and torch.isfinite(lam).all()
    with pytest.raises(ValueError, match="method must be"):
        sub.lowrank_directions(lin, X, 3, psi, 6, method="lanczos")


def test_estimator_with_the_randomized_projector_predicts_as_the_dense_one(clf_data, clf_net,
                                                                            monkeypatch):
    """``method="auto"`` takes randomized block Krylov when ``s + 10`` is at most a
    quarter of the subset's rows (here s = 2 on 60 points x 3 classes; the KFAC
    ``M``'s eigenvalues drop fourfold after the second); forcing the dense path gives
    the same latent predictive, off the data included: to 2e-3 at the default stopping
    tolerance (the Krylov steps stop once the top Ritz values grow by less than
    ``RANGE_RTOL`` = 5e-3), to 1e-6 when they run to convergence."""
    import sklearn_lla._posteriors.subspace as sub

    calls = []
    orig = sub._randomized_directions
    monkeypatch.setattr(sub, "_randomized_directions",
                        lambda *a: calls.append(1) or orig(*a))
    X, y = clf_data.X, clf_data.y
    Xq = np.concatenate([clf_data.X_test, 3.0 * clf_data.X_test])
    kw = dict(subspace_dim=2, n_subset=60, residual_correction=False)

    def fit_predict():
        est = _make("classification", clf_net, **kw).fit(X, y)
        return latent_predictive(est, Xq)

    (m_r, S_r), ran = fit_predict(), bool(calls)
    assert ran, "the randomized path was not taken"
    monkeypatch.setattr(sub, "RANGE_RTOL", 1e-12)
    m_c, S_c = fit_predict()
    dense = sub.lowrank_directions
    monkeypatch.setattr(sub, "lowrank_directions",
                        lambda *a, **k: dense(*a, **{**k, "method": "dense"}))
    calls.clear()
    m_d, S_d = fit_predict()
    assert not calls
    atol = 1e-9 * np.abs(S_d).max()
    np.testing.assert_allclose(m_r, m_d, rtol=1e-10)
    np.testing.assert_allclose(S_c, S_d, rtol=1e-6, atol=atol)
    np.testing.assert_allclose(S_r, S_d, rtol=2e-3, atol=atol)
