"""FMGP (sklearn_lla.fmgp, sklearn_lla.kernels) against hand computations and the truth.

* kernel fixed, ``Z = X``, ``L = I / sqrt(s2)``: the predictive variance is the exact GP
  posterior variance of that kernel (dense numpy), for the RBF and for the
  classification kernel;
* the kernels against dense hand computations (the classification kernel with the
  network's penultimate features computed by hand);
* the median heuristic (a hand value; no NaN with duplicates and constant columns);
* the ``Q*`` term against a hand computation (numpy, closed-form KL);
* fits: on a 1-D problem with clusters the variance grows between clusters and the
  mean is the network's output exactly; held-out NLL and CQM better than the network
  with a fitted constant noise; the classifier's probabilities valid and its NLL / ECE
  better than the raw (overconfident) network;
* the routing of the learned noise's gradient in the training loss (Q*'s ELBO alone);
* the penultimate-layer rule and its errors; a user kernel object.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch
from torch import nn

from sklearn_lla import FMGPClassifier, FMGPRegressor
from sklearn_lla._core.likelihoods import Gaussian
from sklearn_lla._network.linearized import LinearizedNet
from sklearn_lla._posteriors.fmgp import (
    FMGPPosterior,
    mean_regularizer_loss,
    optimal_factor,
    qstar_initial_noise,
)
from sklearn_lla._posteriors.gp_algebra import variational_terms
from sklearn_lla.kernels import RBF, ClassificationKernel, Kernel, median_heuristic
from sklearn_lla.metrics import centered_quantile_metric, expected_calibration_error, gaussian_nll

F64 = torch.float64


class _Sin(nn.Module):
    """A "network" equal to the true function ``sin(w x)``."""

    def __init__(self, w=2.0):
        super().__init__()
        self.w = nn.Parameter(torch.tensor(w, dtype=F64))

    def forward(self, x):
        return torch.sin(self.w * x[:, :1])


def _rbf_np(A, B, amp, ls):
    d2 = (((A[:, None, :] - B[None, :, :]) / ls) ** 2).sum(-1)
    return amp * np.exp(-0.5 * d2)


def _lin(module, X):
    return LinearizedNet(module, "cpu", example_input=torch.as_tensor(X[:4]))


# ---------------------------------------------------------------------------------
# Exact GP limit and kernels
# ---------------------------------------------------------------------------------


def test_fixed_kernel_with_Z_equal_X_is_the_exact_gp():
    rng = np.random.default_rng(0)
    X = rng.uniform(-2, 2, (25, 2))
    Xs = rng.uniform(-4, 4, (13, 2))
    s2, amp, ls = 0.03, 1.7, np.array([0.8, 1.5])
    k = RBF(length_scale=ls, amplitude=amp).initialize(
        torch.as_tensor(X), None, n_outputs=1, task="regression", net=None)
    module = nn.Sequential(nn.Linear(2, 5), nn.Tanh(), nn.Linear(5, 1)).double()
    lin = _lin(module, X)
    post = FMGPPosterior().freeze(lin, k, torch.as_tensor(X), torch.zeros(25, dtype=torch.long),
                                  torch.eye(25, dtype=F64) / math.sqrt(s2))
    lp = post.predict(torch.as_tensor(Xs))
    K = _rbf_np(X, X, amp, ls)
    Ks = _rbf_np(Xs, X, amp, ls)
    exact = amp - np.einsum("ij,ji->i", Ks, np.linalg.solve(K + s2 * np.eye(25), Ks.T))
    np.testing.assert_allclose(lp.cov[:, 0, 0].numpy(), exact, rtol=1e-9, atol=1e-12)
    with torch.no_grad():
        np.testing.assert_array_equal(lp.mean.numpy(), module(torch.as_tensor(Xs)).numpy())
    # the joint covariance too
    _, joint = post.predict_joint(torch.as_tensor(Xs))
    Kss = _rbf_np(Xs, Xs, amp, ls)
    exact_joint = Kss - Ks @ np.linalg.solve(K + s2 * np.eye(25), Ks.T)
    np.testing.assert_allclose(joint.numpy(), exact_joint, rtol=1e-8, atol=1e-11)


def _clf_setup(C=3, n=7, seed=0, delta="class"):
    torch.manual_seed(seed)
    module = nn.Sequential(nn.Linear(2, 6), nn.Tanh(), nn.Linear(6, C)).double()
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n, 2))
    k = ClassificationKernel(length_scale=[0.9, 1.4], amplitude=0.8, delta=delta).initialize(
        torch.as_tensor(X), None, n_outputs=C, task="classification", net=_lin(module, X))
    with torch.no_grad():
        k.L_B.copy_(torch.as_tensor(np.tril(rng.normal(size=(C, C))) + 2 * np.eye(C)))
    W1, b1 = module[0].weight.detach().numpy(), module[0].bias.detach().numpy()
    psi = lambda A: np.tanh(A @ W1.T + b1)  # noqa: E731 - the penultimate features by hand
    return module, X, k, psi


def _clf_dense(X1, c1, X2, c2, k, psi):
    """The classification kernel by hand, pair by pair.

    ``a B[c, c'] RBF(x, x') (s psi(x) psi(x') + delta)``, ``delta = [c = c']`` (the
    default, the head's bias) or ``[x = x']`` (``delta="input"``, the thesis text).
    """
    L = np.tril(k.L_B.detach().numpy())
    B = L @ L.T
    ls = np.array([0.9, 1.4])
    s = k.feature_scale
    out = np.empty((len(X1), len(X2)))
    for i in range(len(X1)):
        for j in range(len(X2)):
            r2 = (((X1[i] - X2[j]) / ls) ** 2).sum()
            same = float(np.array_equal(X1[i], X2[j]) if k.delta == "input"
                         else c1[i] == c2[j])
            out[i, j] = 0.8 * B[c1[i], c2[j]] * math.exp(-0.5 * r2) * (
                s * psi(X1[i:i + 1])[0] @ psi(X2[j:j + 1])[0] + same)
    return out


@pytest.mark.parametrize("delta", ["class", "input"])
def test_classification_kernel_against_dense_hand_computation(delta):
    module, X, k, psi = _clf_setup(delta=delta)
    # the feature scale is 1 / mean |psi|^2 over the initialisation sample
    assert k.feature_scale == pytest.approx(1.0 / np.mean((psi(X) ** 2).sum(-1)), rel=1e-12)
    rng = np.random.default_rng(3)
    Z = np.vstack([X[:2], rng.normal(size=(3, 2))])  # two inducing inputs equal training rows
    cz = np.array([0, 2, 1, 1, 0])
    Zt, czt = torch.as_tensor(Z), torch.as_tensor(cz)
    np.testing.assert_allclose(k.gram(Zt, czt).detach().numpy(), _clf_dense(Z, cz, Z, cz, k, psi),
                               rtol=1e-12, atol=1e-14)
    C = 3
    cross = k.cross(torch.as_tensor(X), Zt, czt).detach().numpy()  # (B, C, M)
    for c in range(C):
        np.testing.assert_allclose(cross[:, c, :], _clf_dense(X, np.full(len(X), c), Z, cz, k, psi),
                                   rtol=1e-12, atol=1e-14)
    diag = k.diag_blocks(torch.as_tensor(X)).detach().numpy()
    for b in range(len(X)):
        ref = _clf_dense(X[b:b + 1].repeat(C, 0), np.arange(C), X[b:b + 1].repeat(C, 0),
                         np.arange(C), k, psi)
        np.testing.assert_allclose(diag[b], ref, rtol=1e-12, atol=1e-14)
    # the one-pass training and validation paths agree with the separate methods
    Kzz, Kxz, Kxx = k.batch(torch.as_tensor(X), Zt, czt)
    np.testing.assert_allclose(Kzz.detach().numpy(), k.gram(Zt, czt).detach().numpy(),
                               rtol=1e-14)
    np.testing.assert_allclose(Kxz.detach().numpy(), cross, rtol=1e-14)
    np.testing.assert_allclose(Kxx.detach().numpy(), diag, rtol=1e-14)
    Kxz, Kxx = k.cross_and_diag(torch.as_tensor(X), Zt, czt)
    np.testing.assert_allclose(Kxz.detach().numpy(), cross, rtol=1e-14)
    np.testing.assert_allclose(Kxx.detach().numpy(), diag, rtol=1e-14)
    # the prediction function (psi(Z) precomputed) agrees with cross
    W = torch.eye(5, dtype=F64)
    Kxx, V = k.predictor(Zt, czt, W)(torch.as_tensor(X))
    np.testing.assert_allclose(V.numpy(), cross, rtol=1e-13, atol=1e-15)
    np.testing.assert_allclose(Kxx.numpy(), diag, rtol=1e-13)


@pytest.mark.parametrize("delta", ["class", "input"])
def test_classification_kernel_exact_gp_limit(delta):
    module, X, k, psi = _clf_setup(C=2, n=6, delta=delta)
    C, n, s2 = 2, len(X), 0.1
    Z = np.repeat(X, C, axis=0)
    cz = np.tile(np.arange(C), n)
    lin = k.features_.net
    post = FMGPPosterior().freeze(lin, k, torch.as_tensor(Z), torch.as_tensor(cz),
                                  torch.eye(n * C, dtype=F64) / math.sqrt(s2))
    Xs = np.vstack([X[:2], np.random.default_rng(5).normal(size=(3, 2))])
    lp = post.predict(torch.as_tensor(Xs))
    K = _clf_dense(Z, cz, Z, cz, k, psi)
    for c in range(C):
        for c2 in range(C):
            Ks = _clf_dense(Xs, np.full(len(Xs), c), Z, cz, k, psi)
            Ks2 = _clf_dense(Xs, np.full(len(Xs), c2), Z, cz, k, psi)
            prior = np.array([_clf_dense(Xs[i:i + 1], [c], Xs[i:i + 1], [c2], k, psi)[0, 0]
                              for i in range(len(Xs))])
            exact = prior - np.einsum("ij,ji->i", Ks, np.linalg.solve(K + s2 * np.eye(n * C),
                                                                      Ks2.T))
            np.testing.assert_allclose(lp.cov[:, c, c2].numpy(), exact, rtol=1e-8, atol=1e-11)


def test_median_heuristic_hand_value_duplicates_and_constant_columns():
    X = np.array([[0.0, 5.0], [1.0, 5.0], [3.0, 5.0]])
    # column 0: sd s, standardised squared distances {1, 9, 4} / s^2, median 4 / s^2,
    # l0 = sqrt(2) / s, back in raw units: sqrt(2). Column 1 is constant: sd 1, l = l0.
    s = X[:, 0].std()
    np.testing.assert_allclose(median_heuristic(X), [math.sqrt(2), math.sqrt(2) / s],
                               rtol=1e-12)
    # mostly duplicates: the median is over distinct pairs only
    Xd = np.array([[1.0, 2.0]] * 10 + [[2.0, 2.0]])
    ls = median_heuristic(Xd)
    assert np.all(np.isfinite(ls)) and np.all(ls > 0)
    # all rows equal, one row, constant columns: finite and positive
    for A in (np.ones((6, 3)), np.zeros((1, 4)), np.zeros((0, 2))):
        ls = median_heuristic(A)
        assert ls.shape == (A.shape[1],) and np.all(np.isfinite(ls)) and np.all(ls > 0)
    k = RBF().initialize(torch.ones(5, 3, dtype=F64), torch.zeros(5, 1, dtype=F64),
                         n_outputs=1, task="regression", net=None)
    assert torch.isfinite(k.log_length_scale).all() and math.isfinite(k.prior_variance)


def test_qstar_term_against_hand_computation():
    rng = np.random.default_rng(2)
    M, B, N = 3, 4, 50
    Z = rng.normal(size=(M, 1))
    x = rng.normal(size=(B, 1))
    y = rng.normal(size=(B, 1))
    amp, ls, s2 = 1.3, 0.9, 0.2
    Kzz = _rbf_np(Z, Z, amp, ls)
    Kxz = _rbf_np(x, Z, amp, ls)
    L = np.tril(rng.normal(size=(M, M))) + 1.5 * np.eye(M)
    q = rng.normal(size=M)
    terms = variational_terms(torch.as_tensor(Kzz), torch.as_tensor(L))
    got = mean_regularizer_loss(
        Gaussian(s2), torch.as_tensor(q), torch.as_tensor(Kzz), terms,
        torch.full((B, 1, 1), amp, dtype=F64), torch.as_tensor(Kxz)[:, None, :],
        torch.as_tensor(y), n_total=N, noise=s2)
    # by hand
    a = np.linalg.solve(Kzz + 1e-3 * np.mean(np.diag(Kzz)) * np.eye(M), q)
    m = Kxz @ a
    Ad = L @ L.T
    A = np.linalg.inv(np.linalg.inv(Ad) + Kzz)
    var = amp - np.einsum("ij,jk,ik->i", Kxz, A, Kxz) + s2
    e = -0.5 * (np.log(2 * np.pi * var) + (y[:, 0] - m) ** 2 / var)
    kl_cov = 0.5 * np.linalg.slogdet(np.eye(M) + Kzz @ Ad)[1] - 0.5 * np.trace(Kzz @ A)
    ref = -e.mean() + (kl_cov + 0.5 * a @ Kzz @ a) / N
    assert float(got) == pytest.approx(ref, rel=1e-10)


def test_optimal_factor_is_the_exact_gp_factor_and_matches_the_dense_formula():
    rng = np.random.default_rng(6)
    X = rng.uniform(-2, 2, (12, 2))
    s2, amp, ls = 0.05, 1.3, np.array([0.7, 1.1])
    K = _rbf_np(X, X, amp, ls)
    # Z = X with sites I / s2: Phi = K K / s2, so L L^T = K^-1 Phi K^-1 = I / s2, the
    # factor of the exact-GP limit test above (up to the 1e-6 relative jitter of K:
    # (Kj^-1 K)(K Kj^-1) / s2, compared exactly)
    L = optimal_factor(torch.as_tensor(K), torch.as_tensor(K) / math.sqrt(s2)).numpy()
    P = np.linalg.solve(K + 1e-6 * amp * np.eye(12), K)
    np.testing.assert_allclose(L @ L.T, P @ P.T / s2, rtol=1e-8, atol=1e-9)
    assert np.abs(P - np.eye(12)).max() < 1e-3  # the jitter's whole effect
    assert np.allclose(L, np.tril(L)) and np.all(np.diag(L) >= 0)
    # a general Z against K^-1 G^T G K^-1 in numpy
    Z = rng.uniform(-2, 2, (5, 2))
    Kzz, G = _rbf_np(Z, Z, amp, ls), rng.normal(size=(30, 5))
    L = optimal_factor(torch.as_tensor(Kzz), torch.as_tensor(G)).numpy()
    Kj = Kzz + 1e-6 * np.mean(np.diag(Kzz)) * np.eye(5)  # START_JITTER
    ref = np.linalg.solve(Kj, np.linalg.solve(Kj, G.T @ G).T)
    np.testing.assert_allclose(L @ L.T, ref, rtol=1e-8)


def test_qstar_initial_noise_against_hand_computation():
    rng = np.random.default_rng(7)
    X, Z = rng.normal(size=(40, 1)), rng.normal(size=(6, 1))
    y = np.sin(X) + 0.2 * rng.normal(size=(40, 1))
    amp, ls = 0.9, 0.8
    k = RBF(length_scale=ls, amplitude=amp).initialize(
        torch.as_tensor(X), None, n_outputs=1, task="regression", net=None)
    q = rng.normal(size=6)
    got = qstar_initial_noise(k, torch.as_tensor(Z), torch.zeros(6, dtype=torch.long),
                              torch.as_tensor(q), torch.as_tensor(X), torch.as_tensor(y))
    Kzz, Kxz = _rbf_np(Z, Z, amp, ls), _rbf_np(X, Z, amp, ls)
    m = Kxz @ np.linalg.solve(Kzz + 1e-3 * amp * np.eye(6), q)  # Q*'s mean
    A = np.linalg.inv(np.eye(6) + Kzz)  # L = I
    var = amp - np.einsum("ij,jk,ik->i", Kxz, A, Kxz)
    assert got == pytest.approx(np.mean((y[:, 0] - m) ** 2 + var), rel=1e-10)


# ---------------------------------------------------------------------------------
# Fits
# ---------------------------------------------------------------------------------


def _clusters(n, seed):
    rng = np.random.default_rng(seed)
    centres = np.array([-3.0, 0.0, 3.0])
    X = (centres[rng.integers(0, 3, n)] + rng.uniform(-0.5, 0.5, n))[:, None]
    y = np.sin(2 * X[:, 0]) + 0.1 * rng.standard_normal(n)
    return X, y


@pytest.mark.parametrize("situation", ["b", "c"])
def test_std_grows_in_the_gaps_early_stopping_fires_and_mean_is_the_network(situation):
    """Defaults (only M set): std at the gaps' centres >= 3 x on the clusters.

    Situation (b): no held-out rows; (c): ``validation_data``. The objective stops
    the run (no ConvergenceWarning) and the mean is the network's output exactly.
    """
    from sklearn.exceptions import ConvergenceWarning

    X, y = _clusters(300, 0)
    Xv, yv = _clusters(100, 1)
    net = _Sin()
    reg = FMGPRegressor(net, n_inducing=15, random_state=0, device="cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConvergenceWarning)
        reg.fit(X, y, **({"validation_data": (Xv, yv)} if situation == "c" else {}))
    assert reg.hyper_trace_["stopped_early"] and reg.n_iter_ < reg.max_iter
    grid = np.linspace(-4, 4, 81)[:, None]
    mean, std = reg.predict(grid, return_std=True)
    with torch.no_grad():
        np.testing.assert_array_equal(mean, net(torch.as_tensor(grid))[:, 0].numpy())
    at = lambda v: std[np.argmin(np.abs(grid[:, 0] - v))]  # noqa: E731
    inside = max(at(-3), at(0), at(3))
    print(f"({situation}) std inside {inside:.3f}, gaps {at(-1.5):.3f} {at(1.5):.3f}, "
          f"outside {at(-4):.3f} {at(4):.3f}; {reg.n_iter_} steps")
    for gap in (-1.5, 1.5):
        assert at(gap) >= 3 * inside, (at(gap), inside)
    assert at(-4.0) > 2 * inside and at(4.0) > 2 * inside
    assert reg.hyper_strategy_ == "variational"
    assert (reg.validation_source_ is None) == (situation == "b")


class _Memorizer(nn.Module):
    """``sin(2 x)`` plus a narrow bump at each training row: it interpolates its rows."""

    def __init__(self, X, y, width=1e-3):
        super().__init__()
        self.w = nn.Parameter(torch.tensor(2.0, dtype=F64))
        self.register_buffer("xs", torch.as_tensor(X[:, 0], dtype=F64))
        self.register_buffer("r", torch.as_tensor(y - np.sin(2 * X[:, 0]), dtype=F64))
        self.width = width

    def forward(self, x):
        d = (x[:, :1] - self.xs[None, :]) / self.width
        bumps = (torch.exp(-0.5 * d * d) * self.r).sum(-1, keepdim=True)
        return torch.sin(self.w * x[:, :1]) + bumps


def test_noise_is_learned_by_qstar_not_from_the_networks_training_residuals():
    """A network that interpolates its rows (training residuals ~0): s2 is the noise.

    The noise variance is 0.09; the network's mean squared training residual is 0.016
    (the bumps of neighbouring rows overlap a little). Learned from the fixed-mean term
    (the thesis' shared noise, issue 19) s2 collapses towards the residuals; from
    ``Q*``'s ELBO it is the noise of the data.
    """
    rng = np.random.default_rng(0)
    X = np.sort(rng.uniform(-2, 2, 300))[:, None]
    y = np.sin(2 * X[:, 0]) + 0.3 * rng.standard_normal(300)
    net = _Memorizer(X, y)
    with torch.no_grad():
        mse = float(((net(torch.as_tensor(X))[:, 0].numpy() - y) ** 2).mean())
    assert mse < 0.02
    reg = FMGPRegressor(net, n_inducing=20, random_state=0, device="cpu").fit(X, y)
    print(f"noise_variance_ {reg.noise_variance_:.4f} (true 0.09, network residual {mse:.4f})")
    assert 0.06 < reg.noise_variance_ < 0.135
    assert reg.hyper_trace_["stopped_early"]


class _Captured(Exception):
    pass


def test_noise_gradient_comes_from_qstars_elbo_alone_and_the_rest_sees_it_held(monkeypatch):
    """The routing of the learned noise's gradient in the real training loss.

    The engine's minibatch loss (taken from the first call of ``minimize``, where the
    fit is then stopped) is differentiated on one batch. ``d loss / d log s2`` must
    equal that of ``Q*``'s ELBO data term alone, ``-mean E_0(y; m*, S, s2)`` with
    ``m*`` and ``S`` held: ``1/2 - mean((y - m*)^2 + S) / (2 s2)`` in closed form (a
    noise gradient also routed through the fixed-mean term or ``Q*``'s alpha-energy
    fails this). ``q_mu`` enters only through ``Q*``'s thesis terms (its energy at
    alpha = 1 and the decoupled KL), so its gradient is theirs, recomputed here (a
    noise term that did not hold ``m*`` fails this). And every other parameter sees
    ``s2`` held: with ``log s2`` no longer a leaf that requires a gradient, the loss's
    value and its gradients w.r.t. ``q_mu`` and ``L`` are the same.
    """
    import sklearn_lla._posteriors.gp as gp_mod
    from sklearn_lla._posteriors.fmgp import _qstar_weights
    from sklearn_lla._posteriors.gp_algebra import alpha_energy, latent_cov

    seen = {}
    start = FMGPPosterior.start

    def record_start(self, data, kernel, Z, cz, L_raw, log_noise):
        start(self, data, kernel, Z, cz, L_raw, log_noise)
        seen.update(post=self, kernel=kernel, Z=Z, cz=cz, L=L_raw, log_noise=log_noise)

    def capture(loss_fn, params, batches, **kw):
        x, yb = next(batches)
        log_noise, q_mu, L = seen["log_noise"], seen["post"].q_mu, seen["L"]
        assert log_noise is not None and log_noise.requires_grad
        loss = loss_fn((x, yb))
        seen["grads"] = torch.autograd.grad(loss, [log_noise, q_mu, L])
        seen["loss"] = float(loss.detach())
        kernel, Z, cz = seen["kernel"], seen["Z"], seen["cz"]
        with torch.no_grad():
            Kzz, Kxz, Kxx = kernel.batch(x, Z, cz)
            W = variational_terms(Kzz, L).W
            S = torch.diagonal(latent_cov(Kxx, Kxz @ W.T), dim1=-2, dim2=-1).reshape(-1)
            r = yb.reshape(-1).double() - (Kxz @ _qstar_weights(q_mu, Kzz)).reshape(-1)
            seen["want"] = float(0.5 - (r * r + S).mean() / (2 * torch.exp(log_noise)))
        # q_mu enters the thesis' loss only through Q*: -mean E_1(y; Kxz a, S, s2) and
        # 1/2 a^T Kzz a / N, a = (Kzz + eps I)^-1 q_mu (s2 and S held)
        q = q_mu.detach().clone().requires_grad_(True)
        a = _qstar_weights(q, Kzz.detach())
        e1 = alpha_energy(Gaussian(1.0), Kxz.detach() @ a, latent_cov(Kxx, Kxz @ W.T).detach(),
                          yb.double().reshape(len(x), 1), alpha=1.0,
                          noise=torch.exp(log_noise).detach())
        qstar = -e1.mean() + 0.5 * (a @ (Kzz.detach() @ a)) / len(X)
        seen["want_q"] = torch.autograd.grad(qstar, [q])[0]
        log_noise.requires_grad_(False)
        held = loss_fn((x, yb))
        seen["held_grads"] = torch.autograd.grad(held, [q_mu, L])
        seen["held_loss"] = float(held.detach())
        raise _Captured

    monkeypatch.setattr(FMGPPosterior, "start", record_start)
    monkeypatch.setattr(gp_mod, "minimize", capture)
    rng = np.random.default_rng(0)
    X = rng.uniform(-3, 3, (200, 1))
    y = np.sin(2 * X[:, 0]) + 0.3 * rng.standard_normal(200)
    with pytest.raises(_Captured):
        FMGPRegressor(_Sin(), n_inducing=10, random_state=0, device="cpu").fit(X, y)
    g_noise, g_q, g_L = seen["grads"]
    print(f"d loss / d log s2 = {float(g_noise):.6f}, closed form {seen['want']:.6f}")
    assert abs(seen["want"]) > 1e-3  # a nonzero target: the check is not 0 == 0
    assert float(g_noise) == pytest.approx(seen["want"], rel=1e-10, abs=1e-12)
    assert seen["held_loss"] == pytest.approx(seen["loss"], rel=1e-12)
    torch.testing.assert_close(g_q, seen["want_q"], rtol=1e-9, atol=1e-13)
    torch.testing.assert_close(seen["held_grads"][0], g_q, rtol=1e-10, atol=1e-14)
    torch.testing.assert_close(seen["held_grads"][1], g_L, rtol=1e-10, atol=1e-14)


def _hetero(n, seed):
    rng = np.random.default_rng(seed)
    X = rng.uniform(-2, 2, (n, 1))
    sd = np.where(X[:, 0] > 0, 0.5, 0.05)
    return X, np.sin(2 * X[:, 0]) + sd * rng.standard_normal(n)


@pytest.mark.parametrize("situation", ["b", "c"])
def test_nll_and_cqm_against_the_network_with_constant_noise(situation):
    """Heteroscedastic noise (std 0.05 left of 0, 0.5 right), the network = the truth.

    (c) with ``validation_data``: better than the network with the validation
    residuals' constant noise. ``S`` learns the variance of the residuals beyond the
    training-time noise (0.16 here, the noise floor in ``S + s2``), and the
    calibrated ``s2`` (0.055) lets it show: measured NLL 0.306 against 0.412, CQM 0.133
    against 0.150. (The thesis' shared noise did better here, NLL below 0.1, by letting
    ``s2`` collapse onto the training residuals, which issue 19 found breaks every
    network that fits its rows.) (b) without held-out rows: NLL no worse than the
    network with its training residuals' constant noise (an honest network: those
    residuals are the noise): measured 0.395 against 0.405 (CQM 0.194 against 0.160:
    ``s2`` also counts the mean of ``S``, see docs/fmgp.md).
    """
    X, y = _hetero(600, 0)
    Xv, yv = _hetero(200, 1)
    Xt, yt = _hetero(1000, 2)
    net = _Sin()
    g = lambda A: net(torch.as_tensor(A))[:, 0].detach().numpy()  # noqa: E731
    Xs, ys = (Xv, yv) if situation == "c" else (X, y)
    sd0 = np.sqrt(np.mean((g(Xs) - ys) ** 2))  # the net with a fitted constant noise
    base_nll = gaussian_nll(yt, g(Xt), sd0)
    base_cqm = centered_quantile_metric(yt, g(Xt), np.full(len(yt), sd0))
    reg = FMGPRegressor(net, n_inducing=20, max_iter=800, random_state=0, device="cpu")
    reg.fit(X, y, **({"validation_data": (Xv, yv)} if situation == "c" else {}))
    mean, std = reg.predict(Xt, return_std=True)
    nll, cqm = gaussian_nll(yt, mean, std), centered_quantile_metric(yt, mean, std)
    print(f"({situation}) FMGP NLL {nll:.3f} CQM {cqm:.3f}; net + constant noise NLL "
          f"{base_nll:.3f} CQM {base_cqm:.3f}")
    if situation == "c":
        assert nll < base_nll - 0.05
        assert cqm < base_cqm - 0.01
    else:
        assert nll < base_nll + 0.02  # issue 19's in-distribution tolerance


def test_classifier_probabilities_valid_and_better_than_the_raw_net():
    from sklearn.datasets import make_blobs

    X, y = make_blobs(n_samples=700, centers=3, cluster_std=2.0, random_state=0)
    X = (X - X.mean(0)) / X.std(0)
    Xtr, ytr, Xv, yv, Xt, yt = X[:150], y[:150], X[150:300], y[150:300], X[300:], y[300:]
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(2, 32), nn.Tanh(), nn.Linear(32, 3)).double()
    opt = torch.optim.Adam(module.parameters(), lr=3e-2)
    xt, yt_ = torch.as_tensor(Xtr), torch.as_tensor(ytr)
    for _ in range(1000):  # overfit 150 overlapping points: an overconfident network
        opt.zero_grad()
        nn.functional.cross_entropy(module(xt), yt_).backward()
        opt.step()
    with torch.no_grad():
        raw = torch.softmax(module(torch.as_tensor(Xt)), -1).numpy()
    clf = FMGPClassifier(module, n_inducing=15, max_iter=300, random_state=0,
                         device="cpu").fit(Xtr, ytr, validation_data=(Xv, yv))
    p = clf.predict_proba(Xt)
    assert np.all(p >= 0) and np.all(p <= 1)
    np.testing.assert_allclose(p.sum(1), 1.0, rtol=1e-12)
    nll = lambda q: -np.mean(np.log(q[np.arange(len(yt)), yt]))  # noqa: E731
    print(f"FMGP NLL {nll(p):.3f} ECE {expected_calibration_error(yt, p):.3f}; raw NLL "
          f"{nll(raw):.3f} ECE {expected_calibration_error(yt, raw):.3f}")
    # raw: NLL 3.2, ECE 0.35 (accuracy 0.59); FMGP: NLL 0.83, ECE 0.05
    assert nll(p) < nll(raw) - 1.0
    assert expected_calibration_error(yt, p) < expected_calibration_error(yt, raw) - 0.15
    assert clf.kernel_.B_.shape == (3, 3) and clf.prior_variance_ > 0


# ---------------------------------------------------------------------------------
# The penultimate layer, user kernels
# ---------------------------------------------------------------------------------


class _NormHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(2, 8), nn.Tanh())
        self.head = nn.Linear(8, 3)
        self.norm = nn.LayerNorm(3)

    def forward(self, x):
        return self.norm(self.head(self.body(x)))


def test_penultimate_layer_rule_and_errors():
    from sklearn.datasets import make_blobs

    X, y = make_blobs(n_samples=60, centers=3, random_state=0)
    torch.manual_seed(0)
    net = _NormHead().double()
    hooks_before = [dict(m._forward_hooks) for m in net.modules()]
    with pytest.raises(ValueError, match="penultimate_layer"):
        FMGPClassifier(net, n_inducing=6, max_iter=5, device="cpu").fit(X, y)
    with pytest.raises(ValueError, match="not a module"):
        FMGPClassifier(net, n_inducing=6, max_iter=5, penultimate_layer="nope",
                       device="cpu").fit(X, y)
    clf = FMGPClassifier(net, n_inducing=6, max_iter=20, penultimate_layer="body",
                         device="cpu").fit(X, y)
    feats = clf.kernel_.features_
    assert (feats.layer, feats.mode) == ("body", "output")
    with torch.no_grad():
        g, psi = feats(torch.as_tensor(X[:5]))
        np.testing.assert_array_equal(psi.numpy(), net.body(torch.as_tensor(X[:5])).numpy())
        np.testing.assert_array_equal(g.numpy(), net(torch.as_tensor(X[:5])).numpy())
    assert [dict(m._forward_hooks) for m in net.modules()] == hooks_before
    # the default rule: the input of the last nn.Linear
    mlp = nn.Sequential(nn.Linear(2, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    clf = FMGPClassifier(mlp, n_inducing=6, max_iter=20, device="cpu").fit(X, y)
    assert (clf.kernel_.features_.layer, clf.kernel_.features_.mode) == ("2", "input")
    with pytest.raises(ValueError, match="kernel='auto'"):
        FMGPClassifier(mlp, kernel=RBF(), penultimate_layer="1", device="cpu").fit(X, y)


class _Fixed1D(Kernel):
    """A user kernel: fixed ``exp(-|x - x'|^2 / 2) [c = c']`` (no ``initialize``)."""

    @property
    def prior_variance(self):
        return 1.0

    def gram(self, z, cz):
        return torch.exp(-0.5 * torch.cdist(z.double(), z.double()) ** 2)

    def cross(self, x, z, cz):
        return torch.exp(-0.5 * torch.cdist(x.double(), z.double()) ** 2)[:, None, :]

    def diag_blocks(self, x):
        return torch.ones(len(x), 1, 1, dtype=F64)


def test_user_kernel_object():
    X, y = _clusters(200, 3)
    user = _Fixed1D()
    reg = FMGPRegressor(_Sin(), kernel=user, n_inducing=8, max_iter=200, device="cpu",
                        random_state=0).fit(X, y)
    assert isinstance(reg.kernel_, _Fixed1D) and reg.kernel_ is not user
    mean, std = reg.predict(np.array([[0.0], [10.0]]), return_std=True)
    # far from the data the latent variance returns to the user kernel's prior
    assert std[1] ** 2 == pytest.approx(1.0 + reg.noise_variance_, rel=1e-6)
    assert std[0] < std[1]
    with pytest.raises(ValueError, match="prior_variance"):
        FMGPRegressor(_Sin(), kernel=user, prior_variance=1.0, device="cpu").fit(X, y)
    with pytest.raises(ValueError, match="kernel"):
        FMGPRegressor(_Sin(), kernel=object(), device="cpu").fit(X, y)


def test_rbf_prediction_function_matches_cross_for_several_outputs():
    rng = np.random.default_rng(4)
    X = torch.as_tensor(rng.normal(size=(9, 3)))
    k = RBF().initialize(X, torch.as_tensor(rng.normal(size=(9, 2))), n_outputs=2,
                         task="regression", net=None)
    Z, cz = X[:5] + 0.1, torch.tensor([0, 1, 1, 0, 1])
    W = torch.as_tensor(np.tril(rng.normal(size=(5, 5))))
    Kxx, V = k.predictor(Z, cz, W)(X)
    np.testing.assert_allclose(V.numpy(), (k.cross(X, Z, cz) @ W.T).detach().numpy(),
                               rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(Kxx.numpy(), k.diag_blocks(X).detach().numpy())
    # cross against the dense formula: a exp(-r^2 / 2) [c = cz]
    ls, amp = k.length_scale_, k.amplitude_
    dense = _rbf_np(X.numpy(), Z.numpy(), amp, ls)
    got = k.cross(X, Z, cz).detach().numpy()
    for c in range(2):
        np.testing.assert_allclose(got[:, c, :], dense * (cz.numpy() == c), rtol=1e-12)
