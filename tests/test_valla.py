"""VaLLA (sklearn_lla.valla) against the truth.

* the NTK kernel (structured closed form and torch.func) against dense ``jacrev``
  Jacobians, with regression and per-class output indices, and its gradient w.r.t.
  the inducing inputs against finite differences (tanh: closed-form second
  derivative; GELU: double backward);
* Proposition 4.3: with ``Z = X`` (every training input, every output) and
  ``A = I / s2`` the predictive is exact LLA regression;
* the training objective at the first step against a hand computation;
* fidelity: KL to exact LLA falls as ``M`` grows and, on the 1-D gap toy at
  ``M = 20``, is below laplace-torch's KFAC LLA (same prior and noise);
* the learned noise on synthetic data, float32 vs float64 nets, both predictors,
  and a classifier sanity check.
"""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
from torch import nn

from sklearn_lla import LLARegressor, VaLLAClassifier, VaLLARegressor
from sklearn_lla._core.likelihoods import Gaussian
from sklearn_lla._core.protocol import FitData
from sklearn_lla._network.linearized import LinearizedNet
from sklearn_lla._posteriors.gp import variational_terms
from sklearn_lla._posteriors.valla import NTKKernel, VaLLAPosterior

F64 = torch.float64


def _mlp(d_in, widths, d_out, act=nn.Tanh, seed=0):
    torch.manual_seed(seed)
    layers, d = [], d_in
    for w in widths:
        layers += [nn.Linear(d, w), act()]
        d = w
    return nn.Sequential(*layers, nn.Linear(d, d_out)).double()


def _kernels(module, X, C, s0=0.7):
    x = torch.as_tensor(X)
    lin_s = LinearizedNet(module, example_input=x)
    lin_f = LinearizedNet(module, example_input=x, structured=False)
    assert lin_s.backend == "structured" and lin_f.backend == "functorch"
    return [NTKKernel(lin_s, C, X.shape[1:], s0), NTKKernel(lin_f, C, X.shape[1:], s0)]


# ---------------------------------------------------------------------------------
# The kernel
# ---------------------------------------------------------------------------------


@pytest.mark.parametrize("C", [1, 3])
def test_ntk_kernel_matches_dense_jacobian(C, dense_ref):
    rng = np.random.default_rng(0)
    module = _mlp(2, (8, 8), C)
    X = rng.normal(size=(5, 2))
    Z = rng.normal(size=(4, 2))
    cz = np.array([0, C - 1, C // 2, 0])
    s0 = 0.7
    _, Jx = dense_ref.jacobian(module, X)  # (5, C, P)
    _, Jz = dense_ref.jacobian(module, Z)
    Rz = Jz[np.arange(4), cz]  # the rows of the inducing pairs
    for k in _kernels(module, X, C, s0):
        z, c = torch.as_tensor(Z), torch.as_tensor(cz)
        x = torch.as_tensor(X)
        with torch.no_grad():
            np.testing.assert_allclose(k.gram(z, c).numpy(), s0 * Rz @ Rz.T, rtol=1e-12)
            np.testing.assert_allclose(k.cross(x, z, c).numpy(),
                                       s0 * np.einsum("bcp,mp->bcm", Jx, Rz), rtol=1e-12,
                                       atol=1e-14)
            np.testing.assert_allclose(k.diag_blocks(x).numpy(),
                                       s0 * np.einsum("bcp,bdp->bcd", Jx, Jx), rtol=1e-12)
            Jf = Jx.reshape(-1, Jx.shape[-1])
            np.testing.assert_allclose(k.joint(x).numpy(), s0 * Jf @ Jf.T, rtol=1e-12,
                                       atol=1e-14)
            Kzz, Kxz, Kxx = k.batch(x, z, c)
            np.testing.assert_allclose(Kzz.numpy(), s0 * Rz @ Rz.T, rtol=1e-12)
            np.testing.assert_allclose(Kxx.numpy(), k.diag_blocks(x).numpy(), rtol=1e-13)


@pytest.mark.parametrize("act", [nn.Tanh, nn.GELU])
def test_kernel_gradient_wrt_inducing_inputs(act):
    """Finite differences of Kzz and Kxz w.r.t. Z, and the two backends agree."""
    rng = np.random.default_rng(1)
    module = _mlp(3, (6, 5), 2, act=act, seed=1)
    X = rng.normal(size=(4, 3))
    cz = torch.tensor([0, 1, 1])
    x = torch.as_tensor(X)
    z0 = rng.normal(size=(3, 3))
    grads = []
    for k in _kernels(module, X, 2):
        z = torch.as_tensor(z0).requires_grad_(True)
        assert torch.autograd.gradcheck(lambda z_, k=k: k.batch(x, z_, cz)[:2], (z,), eps=1e-6,
                                        atol=1e-8, rtol=1e-6)
        Kzz, Kxz, _ = k.batch(x, z, cz)
        (g,) = torch.autograd.grad((Kzz ** 2).sum() + Kxz.sum(), z)
        grads.append(g)
    np.testing.assert_allclose(grads[0].numpy(), grads[1].numpy(), rtol=1e-10, atol=1e-12)


def test_objective_gradient_wrt_z_and_l_matches_finite_differences():
    rng = np.random.default_rng(2)
    module = _mlp(2, (6,), 1, seed=2)
    X = rng.normal(size=(6, 2))
    y = torch.as_tensor(rng.normal(size=(6, 1)))
    k = _kernels(module, X, 1, s0=0.5)[0]
    x = torch.as_tensor(X)
    with torch.no_grad():
        g = k.lin.forward(x)
    cz = torch.zeros(3, dtype=torch.int64)

    def objective(z, L, log_s0):
        k.log_prior_variance = log_s0
        Kzz, Kxz, Kxx = k.batch(x, z, cz)
        t = variational_terms(Kzz, L)
        v = (Kxx - (Kxz @ t.W.T) @ (Kxz @ t.W.T).transpose(1, 2))[:, 0, 0] + 0.1
        e = -0.5 * (math.log(2 * math.pi) + torch.log(v) + (y[:, 0] - g[:, 0]) ** 2 / v)
        return -e.mean() + t.kl / 50

    z = torch.as_tensor(rng.normal(size=(3, 2))).requires_grad_(True)
    L = torch.as_tensor(np.tril(0.3 * rng.normal(size=(3, 3))) + np.eye(3)).requires_grad_(True)
    ls = torch.tensor(math.log(0.5), dtype=F64, requires_grad=True)
    assert torch.autograd.gradcheck(objective, (z, L, ls), eps=1e-6, atol=1e-8, rtol=1e-6)


# ---------------------------------------------------------------------------------
# Proposition 4.3: Z = X, A = I / s2 is exact LLA regression
# ---------------------------------------------------------------------------------


@pytest.mark.parametrize("which", ["reg", "reg2"])
@pytest.mark.parametrize("method", ["structured", "basis"])
def test_optimal_A_with_Z_equal_X_is_exact_lla(which, method, request, dense_ref):
    data = request.getfixturevalue(f"{which}_data")
    net = request.getfixturevalue(f"{which}_net")
    s0, s2 = 0.3, 0.02
    X, y, Xq = data.X, data.y, np.vstack([data.X_test, 3.0 * data.X_test[:3]])
    ref = dense_ref.reference(net.module_, X, y, Xq, "regression", s0, s2)
    C = ref.C
    lin = LinearizedNet(net.module_, example_input=torch.as_tensor(X))
    # every training input with every output index: M = N C pairs
    Z = torch.as_tensor(np.repeat(X, C, axis=0))
    cz = torch.as_tensor(np.tile(np.arange(C), len(X)))
    kernel = NTKKernel(lin, C, X.shape[1:], s0)
    post = VaLLAPosterior(prior_variance=s0, noise_variance=s2)
    post.freeze(lin, kernel, Z, cz, torch.eye(len(Z), dtype=F64) / math.sqrt(s2))
    if method == "basis":
        post._predict_fn = kernel.predictor(post._Z, post._cz,
                                            variational_terms(kernel.gram(Z, cz), post._L).W,
                                            method="basis")
    lp = post.predict(torch.as_tensor(Xq))
    scale = np.abs(ref.S).max()
    np.testing.assert_allclose(lp.cov.numpy(), ref.S, rtol=1e-8, atol=1e-8 * scale)
    np.testing.assert_allclose(lp.mean.numpy(), ref.f_test, rtol=1e-12)
    # the joint covariance too
    _, joint = post.predict_joint(torch.as_tensor(Xq))
    np.testing.assert_allclose(joint.numpy(), ref.joint, rtol=1e-8, atol=1e-8 * scale)


# ---------------------------------------------------------------------------------
# The objective against a hand computation
# ---------------------------------------------------------------------------------


def test_first_step_objective_matches_hand_computation(dense_ref):
    rng = np.random.default_rng(3)
    module = _mlp(2, (5,), 1, seed=3)
    X = rng.normal(size=(8, 2))
    y = rng.normal(size=8)
    s0, s2 = 0.4, 0.3
    est = VaLLARegressor(module, n_inducing=3, prior_variance=s0, noise_variance=s2,
                         max_iter=1, batch_size=8, learn_inducing=False, early_stopping=False,
                         device="cpu", random_state=0).fit(X, y)
    loss = est.hyper_trace_["loss"][0]  # evaluated at the initial state (L = I)
    Z = est.inducing_inputs_
    f, J = dense_ref.jacobian(module, X)
    _, Jz = dense_ref.jacobian(module, Z)
    J, Jz = J[:, 0], Jz[:, 0]
    Kzz, Kxz = s0 * Jz @ Jz.T, s0 * J @ Jz.T
    A = np.linalg.inv(np.eye(3) + Kzz)  # L = I: A = (I + Kzz)^-1
    v = s0 * (J * J).sum(1) - np.einsum("nm,mk,nk->n", Kxz, A, Kxz)
    log_pred = -0.5 * (np.log(2 * np.pi * (v + s2)) + (y - f[:, 0]) ** 2 / (v + s2))
    kl = 0.5 * np.linalg.slogdet(np.eye(3) + Kzz)[1] - 0.5 * np.trace(Kzz @ A)
    assert loss == pytest.approx(-log_pred.mean() + kl / 8, rel=1e-10)


# ---------------------------------------------------------------------------------
# Fidelity to exact LLA
# ---------------------------------------------------------------------------------


def _mean_kl(p, q):
    """Mean KL(N(0, p) || N(0, q)) of 1-D variances."""
    r = p / q
    return float(np.mean(0.5 * (r - 1.0 - np.log(r))))


@pytest.fixture(scope="module")
def gap_toy():
    """The papers' 1-D toy with a gap, a 1-16-16-1 tanh MLP trained here."""
    rng = np.random.RandomState(0)
    X = np.concatenate([rng.uniform(-2, -0.7, 40), rng.uniform(0.7, 2, 40)])[:, None]
    y = np.sin(2 * X[:, 0]) + 0.1 * rng.randn(80)
    net = _mlp(1, (16, 16), 1, seed=0)
    opt = torch.optim.Adam(net.parameters(), lr=1e-2, weight_decay=1e-4)
    xt, yt = torch.as_tensor(X), torch.as_tensor(y[:, None])
    for _ in range(1500):
        opt.zero_grad()
        ((net(xt) - yt) ** 2).mean().backward()
        opt.step()
    Xq = np.linspace(-3, 3, 61)[:, None]
    return X, y, net, Xq


def test_kl_to_exact_lla_falls_with_m_and_beats_kfac(gap_toy):
    laplace = pytest.importorskip("laplace")
    from torch.utils.data import DataLoader, TensorDataset

    X, y, net, Xq = gap_toy
    s0, s2 = 1.0, 0.01
    exact = LLARegressor(net, prior_variance=s0, noise_variance=s2, device="cpu").fit(X, y)
    v_exact = exact.predict(Xq, return_std=True)[1] ** 2 - s2  # latent variance
    kls = {}
    for M in (5, 20):
        est = VaLLARegressor(net, n_inducing=M, prior_variance=s0, noise_variance=s2,
                             learning_rate=1e-2, max_iter=1500, batch_size=80,
                             early_stopping=False, device="cpu", random_state=0).fit(X, y)
        v = est.predict(Xq, return_std=True)[1] ** 2 - s2
        kls[M] = _mean_kl(v_exact, v)
    # laplace-torch's KFAC LLA with the same prior precision and noise
    model = copy.deepcopy(net)
    la = laplace.Laplace(model, "regression", subset_of_weights="all",
                         hessian_structure="kron", prior_precision=1.0 / s0,
                         sigma_noise=math.sqrt(s2))
    la.fit(DataLoader(TensorDataset(torch.as_tensor(X), torch.as_tensor(y[:, None])),
                      batch_size=32))
    _, f_var = la._glm_predictive_distribution(torch.as_tensor(Xq))
    kl_kfac = _mean_kl(v_exact, f_var.detach().numpy().reshape(-1))
    print(f"KL(exact || VaLLA M=5) = {kls[5]:.4g}, M=20: {kls[20]:.4g}, KFAC: {kl_kfac:.4g}")
    assert kls[20] < 0.5 * kls[5]
    assert kls[20] < kl_kfac


# ---------------------------------------------------------------------------------
# Learned hyperparameters, dtypes, predictors, classification
# ---------------------------------------------------------------------------------


class _StartAt(VaLLAPosterior):
    """VaLLA whose learned noise starts at a given (wrong) value."""

    def __init__(self, s2_init, **kw):
        super().__init__(**kw)
        self.s2_init = s2_init

    def _initial_noise(self, data, gen):
        return self.s2_init


def test_learned_noise_close_to_true_noise():
    rng = np.random.default_rng(4)
    module = _mlp(2, (16,), 1, seed=4)  # the true function: the net's mean is exact
    X = rng.uniform(-2, 2, (1000, 2))
    with torch.no_grad():
        f = module(torch.as_tensor(X)).numpy()
    y = torch.as_tensor(f + 0.1 * rng.standard_normal(f.shape))
    lin = LinearizedNet(module, example_input=torch.as_tensor(X[:8]))

    def fit(prior):
        data = FitData(lin, Gaussian(1.0), X, y, batch_size=100,
                       generator=torch.Generator().manual_seed(0))
        return _StartAt(1.0, prior_variance=prior, n_inducing=10, learning_rate=2e-2,
                        max_iter=500, early_stopping=False).fit(data)

    # a negligible fixed prior: the noise itself is identified, from 1.0 down to 0.01
    post = fit(1e-6)
    assert post.likelihood.noise_variance == pytest.approx(0.01, rel=0.15)
    # the prior learned too: at alpha = 1 with the mean fixed only latent + noise
    # variance is identified where the data are; their sum is the true 0.01
    post = fit("auto")
    latent = post.predict(torch.as_tensor(X)).var.mean().item()
    assert latent + post.likelihood.noise_variance == pytest.approx(0.01, rel=0.15)
    assert post.hyper_strategy == "variational"


def test_float32_net_matches_float64_and_predictors_agree(reg_data, reg_net):
    X, y, Xq = reg_data.X, reg_data.y, reg_data.X_test
    kw = dict(n_inducing=15, max_iter=150, learning_rate=1e-2, device="cpu", random_state=0)
    a = VaLLARegressor(copy.deepcopy(reg_net.module_).double(), **kw).fit(X, y)
    b = VaLLARegressor(copy.deepcopy(reg_net.module_).float(), **kw).fit(X.astype(np.float32), y)
    for u, v in zip(a.predict(Xq, return_std=True), b.predict(Xq.astype(np.float32),
                                                                return_std=True)):
        np.testing.assert_allclose(v, u, rtol=1e-3, atol=1e-6)
    assert a.prior_variance_ == pytest.approx(b.prior_variance_, rel=1e-3)
    # the parameter-space basis predictor equals the structured one
    post = a.posterior_
    W = variational_terms(post.kernel.gram(post._Z, post._cz), post._L).W
    basis = post.kernel.predictor(post._Z, post._cz, W, method="basis")
    x = torch.as_tensor(Xq)
    for u, v in zip(post._predict_fn(x), basis(x)):
        np.testing.assert_allclose(v.numpy(), u.numpy(), rtol=1e-10, atol=1e-13)


def test_classifier_sanity(clf_data, clf_net):
    X, y, Xt = clf_data.X, clf_data.y, clf_data.X_test
    est = VaLLAClassifier(clf_net, n_inducing=12, max_iter=300, learning_rate=1e-2,
                          device="cpu", random_state=0).fit(X, y)
    assert est.hyper_strategy_ == "variational"
    np.testing.assert_array_equal(np.bincount(est.inducing_outputs_), [4, 4, 4])
    assert est.inducing_inputs_.shape == (12, 2)
    p = est.predict_proba(Xt)
    np.testing.assert_allclose(p.sum(1), 1.0, rtol=1e-12)
    raw = torch.softmax(torch.as_tensor(clf_net.forward(Xt)), 1).numpy()
    assert np.mean(p.argmax(1) == raw.argmax(1)) >= 0.95
    # more latent variance far from the data than on it
    lin = est.linearized_net_
    near = est.posterior_.predict(torch.as_tensor(X, dtype=lin.dtype)).var.mean()
    far = est.posterior_.predict(torch.as_tensor(6.0 * X, dtype=lin.dtype)).var.mean()
    assert float(far) > 2 * float(near)
    assert 0 < est.n_iter_ <= 300 and est.kl_ >= 0
