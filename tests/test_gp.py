"""The shared fixed-mean sparse-GP algebra (sklearn_lla._posteriors.gp) that VaLLA and FMGP use.

Checked with a small dense RBF kernel written here (no package kernel involved):

* ``Z = X``, ``L L^T = I / s2``: the predictive covariance is the exact GP posterior
  covariance ``K** - K*X (K + s2 I)^-1 KX*`` (the thesis' optimal-A proposition);
* the KL term against the closed form of the thesis (``A_dual = L L^T``);
* the alpha energy against numerical integration (regression, several alpha), the
  alpha = 0 limit, and the classification cases;
* gradients of the objective w.r.t. ``L`` and ``Z`` against finite differences;
* a fit on minibatches learns the noise and keeps the mean equal to the network.
"""

from __future__ import annotations

import math
import pickle
import warnings

import numpy as np
import pytest
import torch
from scipy import integrate
from sklearn.exceptions import ConvergenceWarning

from sklearn_lla._core.likelihoods import Bernoulli, Categorical, Gaussian
from sklearn_lla._core.protocol import FitData
from sklearn_lla._network.linearized import LinearizedNet
from sklearn_lla._posteriors import gp_algebra
from sklearn_lla._posteriors.gp import FixedMeanGPPosterior, Kernel
from sklearn_lla._posteriors.gp_algebra import (
    alpha_energy,
    init_inducing,
    latent_cov,
    variational_terms,
)


class _RBF(Kernel):
    """Dense test kernel: ``amp * exp(-|x - x'|^2 / (2 ls^2)) * [c == c']``."""

    def __init__(self, amp=1.3, ls=0.7, trainable=False):
        self.log_amp = torch.tensor(math.log(amp), dtype=torch.float64,
                                    requires_grad=trainable)
        self.log_ls = torch.tensor(math.log(ls), dtype=torch.float64, requires_grad=trainable)
        self.C = 1

    def parameters(self):
        return [self.log_amp, self.log_ls] if self.log_amp.requires_grad else []

    @property
    def prior_variance(self):
        return float(torch.exp(self.log_amp))

    def _k(self, a, b):
        d2 = torch.cdist(a.double(), b.double()).pow(2)
        return torch.exp(self.log_amp) * torch.exp(-0.5 * d2 / torch.exp(2 * self.log_ls))

    def gram(self, z, cz):
        return self._k(z, z) * (cz[:, None] == cz[None, :])

    def cross(self, x, z, cz):
        k = self._k(x, z)  # (B, M)
        eye = (torch.arange(self.C)[:, None] == cz[None, :]).double()  # (C, M)
        return k[:, None, :] * eye[None]

    def diag_blocks(self, x):
        return torch.exp(self.log_amp) * torch.eye(self.C, dtype=torch.float64).expand(
            len(x), self.C, self.C).clone()


class _Post(FixedMeanGPPosterior):
    def __init__(self, kernel, **kw):
        super().__init__(**kw)
        self._kernel = kernel

    def make_kernel(self, data, Z, cz):
        return self._kernel


def _net(seed=0, d=1, c=1):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(d, 8), torch.nn.Tanh(),
                               torch.nn.Linear(8, c)).double()


def _data(n=40, seed=0, noise=0.1):
    rng = np.random.default_rng(seed)
    X = rng.uniform(-2, 2, (n, 1))
    y = np.sin(2 * X) + noise * rng.standard_normal((n, 1))
    return X, y


def _lin(module, X):
    return LinearizedNet(module, torch.device("cpu"), "identity",
                         example_input=torch.as_tensor(X[:4]))


def test_optimal_A_recovers_exact_gp_posterior():
    X, y = _data(30)
    Xs = np.linspace(-3, 3, 17)[:, None]
    s2 = 0.05
    k = _RBF()
    lin = _lin(_net(), X)
    Z = torch.as_tensor(X)
    cz = torch.zeros(len(X), dtype=torch.int64)
    post = _Post(k).freeze(lin, k, Z, cz, torch.eye(len(X), dtype=torch.float64) / math.sqrt(s2))
    lp = post.predict(torch.as_tensor(Xs))
    K = k._k(Z, Z).numpy()
    Ks = k._k(torch.as_tensor(Xs), Z).numpy()
    exact = k.prior_variance - np.einsum("ij,ji->i", Ks, np.linalg.solve(K + s2 * np.eye(len(X)),
                                                                        Ks.T))
    np.testing.assert_allclose(lp.cov[:, 0, 0].numpy(), exact, rtol=1e-9, atol=1e-12)
    with torch.no_grad():
        np.testing.assert_array_equal(lp.mean.numpy(), lin.forward(torch.as_tensor(Xs)).numpy())


def test_kl_matches_thesis_closed_form():
    rng = np.random.default_rng(1)
    Z = torch.as_tensor(rng.normal(size=(6, 2)))
    K = _RBF().gram(Z, torch.zeros(6, dtype=torch.int64))
    L = torch.as_tensor(np.tril(rng.normal(size=(6, 6))) + 2 * np.eye(6))
    t = variational_terms(K, L)
    Ad = (L @ L.T).numpy()
    Kn = K.numpy()
    # KL = 1/2 logdet(I + K A) - 1/2 tr[K (A^-1 + K)^-1]
    ref = 0.5 * np.linalg.slogdet(np.eye(6) + Kn @ Ad)[1] - 0.5 * np.trace(
        Kn @ np.linalg.inv(np.linalg.inv(Ad) + Kn))
    assert float(t.kl) == pytest.approx(ref, rel=1e-10)
    # A = W^T W = L Hm^-1 L^T = (A_dual^-1 + K)^-1
    np.testing.assert_allclose((t.W.T @ t.W).numpy(), np.linalg.inv(np.linalg.inv(Ad) + Kn),
                               rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("alpha", [1.0, 0.5, 0.1])
def test_regression_alpha_energy_against_quadrature(alpha):
    m, v, s2, y = 0.3, 0.4, 0.2, 1.1
    lik = Gaussian(s2)

    def integrand(f):
        return (math.exp(-0.5 * (y - f) ** 2 / s2) / math.sqrt(2 * math.pi * s2)) ** alpha * (
            math.exp(-0.5 * (f - m) ** 2 / v) / math.sqrt(2 * math.pi * v))

    ref = math.log(integrate.quad(integrand, -20, 20, epsabs=1e-14)[0]) / alpha
    got = alpha_energy(lik, torch.tensor([[m]], dtype=torch.float64),
                       torch.tensor([[[v]]], dtype=torch.float64),
                       torch.tensor([[y]], dtype=torch.float64), alpha=alpha)
    assert float(got) == pytest.approx(ref, rel=1e-9)


def test_regression_alpha_zero_is_expected_log_likelihood_and_the_limit():
    lik = Gaussian(0.3)
    m = torch.tensor([[0.1], [2.0]], dtype=torch.float64)
    c = torch.tensor([[[0.5]], [[0.05]]], dtype=torch.float64)
    y = torch.tensor([[0.4], [1.0]], dtype=torch.float64)
    e0 = alpha_energy(lik, m, c, y, alpha=0.0)
    np.testing.assert_allclose(e0.numpy(), lik.expected_log_prob(m, c, y).numpy(), rtol=1e-12)
    np.testing.assert_allclose(alpha_energy(lik, m, c, y, alpha=1e-7).numpy(), e0.numpy(),
                               rtol=1e-5)
    # alpha = 1 is the log predictive density
    np.testing.assert_allclose(alpha_energy(lik, m, c, y, alpha=1.0).numpy(),
                               lik.log_predictive(m, c, y).numpy(), rtol=1e-12)


def test_multioutput_regression_energy_is_sum_for_diagonal_blocks():
    lik = Gaussian(0.2, n_outputs=2)
    m = torch.tensor([[0.1, -0.3]], dtype=torch.float64)
    c = torch.diag_embed(torch.tensor([[0.5, 0.2]], dtype=torch.float64))
    y = torch.tensor([[0.4, 0.0]], dtype=torch.float64)
    both = alpha_energy(lik, m, c, y, alpha=0.5)
    one = sum(alpha_energy(Gaussian(0.2), m[:, i:i + 1], c[:, i:i + 1, i:i + 1], y[:, i:i + 1],
                           alpha=0.5) for i in range(2))
    assert float(both) == pytest.approx(float(one), rel=1e-12)


def test_classification_energies():
    torch.manual_seed(0)
    m = torch.randn(5, 3, dtype=torch.float64)
    c = torch.diag_embed(torch.rand(5, 3, dtype=torch.float64))
    y = torch.tensor([0, 1, 2, 1, 0])
    lik = Categorical(3)
    np.testing.assert_allclose(alpha_energy(lik, m, c, y, alpha=1.0).numpy(),
                               lik.log_predictive(m, c, y).numpy())
    eps = torch.randn(20000, 5, 3, dtype=torch.float64)
    # alpha -> 1 on MC draws approaches the MC log predictive; alpha = 0 the expected log lik
    mc = Categorical(3, link_approx="mc")
    e1 = alpha_energy(lik, m, c, y, alpha=0.999999, eps=eps)
    np.testing.assert_allclose(e1.numpy(), mc.log_predictive(m, c, y, eps=eps).numpy(),
                               rtol=1e-4)
    e0 = alpha_energy(lik, m, c, y, alpha=0.0, eps=eps)
    assert bool((e0 <= e1).all())  # Jensen
    b = Bernoulli()
    yb = torch.tensor([0, 1, 1, 0, 1])
    eb = alpha_energy(b, m[:, :1], c[:, :1, :1], yb, alpha=1.0)
    np.testing.assert_allclose(eb.numpy(), b.log_predictive(m[:, :1], c[:, :1, :1], yb).numpy())
    with pytest.raises(ValueError, match="Monte Carlo"):
        alpha_energy(lik, m, c, y, alpha=0.5)


def test_objective_gradients_match_finite_differences():
    X, y = _data(12, seed=3)
    k = _RBF()
    Z0 = torch.as_tensor(np.linspace(-2, 2, 4)[:, None])
    cz = torch.zeros(4, dtype=torch.int64)
    x = torch.as_tensor(X)
    yt = torch.as_tensor(y)
    mean = torch.as_tensor(np.sin(2 * X) * 0.9)
    lik = Gaussian(0.1)

    def obj(Z, L):
        t = variational_terms(k.gram(Z, cz), L)
        cov = latent_cov(k.diag_blocks(x), k.cross(x, Z, cz) @ t.W.T)
        return -alpha_energy(lik, mean, cov, yt, alpha=1.0).mean() + t.kl / 100

    rng = np.random.default_rng(0)
    L0 = torch.as_tensor(np.tril(0.3 * rng.normal(size=(4, 4))) + np.eye(4))
    Z = Z0.clone().requires_grad_(True)
    L = L0.clone().requires_grad_(True)
    assert torch.autograd.gradcheck(obj, (Z, L), eps=1e-6, atol=1e-8, rtol=1e-6)


def test_latent_cov_never_negative():
    Kxx = torch.tensor([[[1.0]]], dtype=torch.float64)
    V = torch.tensor([[[1.0, 1e-8]]], dtype=torch.float64)
    assert float(latent_cov(Kxx, V)) == 0.0


def _fitdata(X, y, module, val=None, seed=0):
    lin = _lin(module, X)
    lik = Gaussian(1.0)
    v = None if val is None else FitData(lin, lik, val[0], torch.as_tensor(val[1]),
                                         batch_size=64)
    return FitData(lin, lik, X, torch.as_tensor(y), batch_size=20,
                   generator=torch.Generator().manual_seed(seed), validation=v)


def test_fit_learns_noise_keeps_mean_and_pickles():
    X, y = _data(400, seed=5, noise=0.3)
    Xv, yv = _data(200, seed=6, noise=0.3)
    module = _net()
    # a "network" that is the true function: the learned noise must be the true 0.09
    module = torch.nn.Sequential(_Sin())
    data = _fitdata(X, y, module, val=(Xv, yv))
    post = _Post(_RBF(trainable=True), n_inducing=10, learning_rate=1e-2, max_iter=600,
                 batch_size=50, validation_freq=50).fit(data)
    s2 = post.likelihood.noise_variance
    assert post.hyper_strategy == "variational"
    # at alpha = 1 with the mean fixed, only latent + noise variance is seen by the data
    # term: their sum matches the true 0.09 where the data are
    total = post.predict(torch.as_tensor(X)).var.mean().item() + s2
    assert total == pytest.approx(0.09, rel=0.15)
    xs = torch.linspace(-3, 3, 11, dtype=torch.float64)[:, None]
    lp = post.predict(xs)
    np.testing.assert_allclose(lp.mean.numpy(), np.sin(2 * xs.numpy()), rtol=1e-12)
    assert bool((lp.var >= 0).all())
    lp2 = pickle.loads(pickle.dumps(post)).predict(xs)
    np.testing.assert_array_equal(lp2.cov.numpy(), lp.cov.numpy())
    # determinism
    post2 = _Post(_RBF(trainable=True), n_inducing=10, learning_rate=1e-2, max_iter=600,
                  batch_size=50, validation_freq=50).fit(_fitdata(X, y, module, (Xv, yv)))
    np.testing.assert_array_equal(post2.predict(xs).cov.numpy(), lp.cov.numpy())
    # with a small fixed kernel the noise itself is identified
    post3 = _Post(_RBF(amp=1e-3), n_inducing=10, learning_rate=1e-2, max_iter=600,
                  batch_size=50, validation_freq=50).fit(_fitdata(X, y, module, (Xv, yv)))
    assert post3.likelihood.noise_variance == pytest.approx(0.09, rel=0.15)
    assert post3.hyper_strategy == "variational"


class _Sin(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor(2.0, dtype=torch.float64))

    def forward(self, x):
        return torch.sin(self.w * x)


def test_init_inducing_per_class():
    rng = np.random.default_rng(0)
    X = np.concatenate([rng.normal(-3, 0.3, (50, 2)), rng.normal(3, 0.3, (30, 2)),
                        rng.normal(0, 0.3, (20, 2))])
    y = np.repeat([0, 1, 2], [50, 30, 20])
    module = torch.nn.Linear(2, 3).double()
    lin = _lin(module, X)
    data = FitData(lin, Categorical(3), X, torch.as_tensor(y), batch_size=16)
    Z, cz = init_inducing(data, 10, seed=0)
    assert Z.shape == (10, 2)
    np.testing.assert_array_equal(np.bincount(cz), [4, 3, 3])
    for c, centre in enumerate([-3, 3, 0]):
        assert np.abs(Z[cz == c] - centre).max() < 1.5
    data1 = FitData(lin, Gaussian(1.0), X, torch.as_tensor(y[:, None] * 1.0), batch_size=16)
    Z1, cz1 = init_inducing(data1, 7, seed=0)
    assert Z1.shape == (7, 2) and (cz1 == 0).all()
    Z2, _ = init_inducing(data1, 7, seed=0)
    np.testing.assert_array_equal(Z1, Z2)


# ---------------------------------------------------------------------------------
# The subspace (Nystrom) covariance, early stopping on the objective, threads
# ---------------------------------------------------------------------------------


def test_subspace_covariance_against_the_dense_nystrom_formula(monkeypatch):
    """``Qxx - Kxz A Kzx``: with ``Z = X`` and ``L L^T = I / s2`` the exact GP posterior
    at the training inputs (where ``Q = K``), and the dense formula everywhere."""
    X = np.linspace(-2, 2, 8)[:, None]
    Xs = np.linspace(-3, 3, 13)[:, None]
    s2 = 0.05
    k = _RBF()
    lin = _lin(_net(), X)
    Z = torch.as_tensor(X)
    cz = torch.zeros(len(X), dtype=torch.int64)
    L = torch.eye(len(X), dtype=torch.float64) / math.sqrt(s2)
    K = k._k(Z, Z).numpy()
    Ks = k._k(torch.as_tensor(Xs), Z).numpy()
    for jitter in (0.0, gp_algebra.SUBSPACE_JITTER):
        monkeypatch.setattr(gp_algebra, "SUBSPACE_JITTER", jitter)
        post = _Post(k, covariance="subspace").freeze(lin, k, Z, cz, L)
        Kj = K + jitter * np.mean(np.diag(K)) * np.eye(len(X))
        A = np.linalg.inv(np.eye(len(X)) * s2 + Kj)  # L (I + L^T Kj L)^-1 L^T
        want = np.einsum("bm,mk,bk->b", Ks, np.linalg.inv(Kj) - A, Ks)
        got = post.predict(torch.as_tensor(Xs)).cov[:, 0, 0].numpy()
        np.testing.assert_allclose(got, want, rtol=1e-8, atol=1e-12)
        if jitter == 0.0:  # at the training inputs: the exact GP posterior
            at_x = post.predict(Z).cov[:, 0, 0].numpy()
            exact = np.diag(K - K @ np.linalg.solve(K + s2 * np.eye(len(X)), K))
            np.testing.assert_allclose(at_x, exact, rtol=1e-8, atol=1e-12)


@pytest.mark.parametrize("estimator, params", [
    ("VaLLARegressor", {"covariance": "nystrom"}),
    ("VaLLARegressor", {"stopping": "held_out"}),
    ("VaLLARegressor", {"alpha": 1.5}),
    ("FMGPRegressor", {"alpha": -0.1}),
])
def test_the_estimators_validate_the_engine_settings(estimator, params):
    """``covariance``, ``stopping`` and ``alpha`` are validated once, by the estimator
    (its ``_parameter_constraints``), before any work; the engine trusts them."""
    import sklearn_lla

    X, y = _data(20)
    with pytest.raises(ValueError, match=next(iter(params))):
        getattr(sklearn_lla, estimator)(**params).fit(X, y)


def test_without_held_out_rows_early_stopping_watches_the_objective():
    X, y = _data(300, seed=7, noise=0.3)
    module = torch.nn.Sequential(_Sin())
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConvergenceWarning)
        post = _Post(_RBF(amp=0.2), n_inducing=8, learning_rate=3e-2, max_iter=20000, alpha=0.0,
                     batch_size=50, validation_freq=50, n_iter_no_change=3,
                     tol=1e-3).fit(_fitdata(X, y, module))
    tr = post.hyper_trace
    assert tr["monitor"] == "loss" and tr["stopped_early"] and post.n_iter < 20000
    h = np.asarray(tr["loss"])
    step, score = tr["validation"][-1]
    assert score == pytest.approx(h[step - 50:step].mean(), rel=1e-12)
    # the noise is learned from the objective (the ELBO tells it from the latent
    # variance at the data): close to the true 0.09
    assert post.likelihood.noise_variance == pytest.approx(0.09, rel=0.2)
    # with held-out rows and stopping="auto" the checks score their NLL instead
    Xv, yv = _data(100, seed=8, noise=0.3)
    post = _Post(_RBF(amp=0.2), n_inducing=8, learning_rate=3e-2, max_iter=200,
                 batch_size=50, validation_freq=50).fit(_fitdata(X, y, module, (Xv, yv)))
    assert post.hyper_trace["monitor"] == "validation"
    assert post.hyper_trace["validation"][0][0] == 0  # the start is scored too


def test_released_block_runs_on_the_setting_the_limit_lowered():
    """``torch_threads_released`` inside a ``torch_threads(1)`` block runs with the
    setting before the limit, then lowers it again; outside a limit it does nothing;
    nested limits restore the original setting at the end."""
    from sklearn_lla._core.utils import torch_threads, torch_threads_released

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        with torch_threads_released():
            assert torch.get_num_threads() == 2
        with torch_threads(1):
            assert torch.get_num_threads() == 1
            with torch_threads_released():
                assert torch.get_num_threads() == 2
                with torch_threads(1):  # nested: the outer limit's record is kept
                    assert torch.get_num_threads() == 2
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_fit_runs_torch_on_one_thread_and_restores_the_setting():
    before = torch.get_num_threads()
    seen = []

    class _Spy(_RBF):
        def gram(self, z, cz):
            seen.append(torch.get_num_threads())
            return super().gram(z, cz)

    X, y = _data(60, seed=9)
    try:
        torch.set_num_threads(2)
        _Post(_Spy(), n_inducing=4, max_iter=3, early_stopping=False).fit(
            _fitdata(X, y, torch.nn.Sequential(_Sin())))
        assert set(seen) == {gp_algebra.FIT_THREADS}
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
