"""Sampled LLA (sample-then-optimise + EM) against exact LLA, closed-form evidence
optima and laplace-torch's KFAC."""

from __future__ import annotations

import copy
import math
import warnings

import numpy as np
import pytest
import scipy.optimize
import torch
from sklearn.exceptions import ConvergenceWarning
from torch import nn

from sklearn_lla import LLARegressor
from sklearn_lla.sampled import SampledLLAClassifier, SampledLLARegressor

S0, S2 = 0.3, 0.02  # fixed hyperparameters of the comparisons with exact LLA
FAST = dict(device="cpu", learning_rate=0.05, max_iter=600)


def _cov(est, X):
    lp = est.posterior_.predict(torch.as_tensor(np.asarray(X, dtype=np.float64)))
    return lp.mean.numpy(), lp.cov.numpy()


def _queries(data):
    return np.vstack([data.X_test, 3.0 * data.X_test[:3]])


@pytest.fixture(scope="module")
def exact_reg(reg_data, reg_net):
    est = LLARegressor(reg_net, prior_variance=S0, noise_variance=S2, space="parameter",
                       device="cpu").fit(reg_data.X, reg_data.y)
    return _cov(est, _queries(reg_data))


@pytest.fixture(scope="module")
def sampled_256(reg_data, reg_net):
    return SampledLLARegressor(reg_net, prior_variance=S0, noise_variance=S2,
                               n_posterior_samples=256, random_state=0,
                               **FAST).fit(reg_data.X, reg_data.y)


# ---------------------------------------------------------------------------------
# Fixed hyperparameters: converges to exact LLA
# ---------------------------------------------------------------------------------


def test_sample_covariance_converges_to_exact(reg_data, reg_net, exact_reg, sampled_256):
    Xq = _queries(reg_data)
    mean_e, cov_e = exact_reg
    var_e = cov_e[:, 0, 0]
    errors = {}
    for K in (16, 256):
        est = sampled_256 if K == 256 else SampledLLARegressor(
            reg_net, prior_variance=S0, noise_variance=S2, n_posterior_samples=K,
            random_state=0, **FAST).fit(reg_data.X, reg_data.y)
        mean, cov = _cov(est, Xq)
        np.testing.assert_allclose(mean, mean_e, rtol=1e-12, atol=1e-12)  # network output
        errors[K] = float(np.mean(np.abs(cov[:, 0, 0] - var_e) / var_e))
    print(f"\n[sampled vs exact] mean relative variance error: {errors}")
    # Monte Carlo error of a variance from K samples: sqrt(2 / K) (8.8 % at 256)
    assert errors[256] < 0.15
    assert errors[256] < errors[16]
    assert sampled_256.prior_variance_ == S0 and sampled_256.noise_variance_ == S2
    assert sampled_256.hyper_strategy_ == "fixed"


def test_mode_is_the_linear_model_solution(reg_data, reg_net, dense_ref, sampled_256):
    f, J = dense_ref.jacobian(reg_net.module_, reg_data.X)
    J = J[:, 0, :]
    theta = dense_ref.flat_params(dense_ref.module(reg_net.module_)).numpy()
    H = J.T @ J / S2 + np.eye(len(theta)) / S0
    delta = np.linalg.solve(H, J.T @ (reg_data.y - f[:, 0]) / S2 - theta / S0)
    got = sampled_256.posterior_.mode.numpy() - theta
    rel = np.linalg.norm(got - delta) / np.linalg.norm(delta)
    print(f"\n[sampled mode] relative error of theta_bar - theta_hat: {rel:.2e}")
    assert rel < 1e-3  # conjugate gradients to a relative residual of 1e-4
    # in function space (what the M-step's RSS sees)
    fn = np.abs(J @ (got - delta)).max() / np.abs(J @ delta).max()
    print(f"[sampled mode] max function-space error / max |J delta|: {fn:.2e}")
    assert fn < 1e-3


def test_joint_covariance_matches_blocks(reg_data, sampled_256):
    X = reg_data.X_test[:6]
    lp = sampled_256.posterior_.predict(torch.as_tensor(X))
    mean, joint = sampled_256.posterior_.predict_joint(torch.as_tensor(X))
    np.testing.assert_allclose(np.diag(joint.numpy()), lp.cov[:, 0, 0].numpy(), rtol=1e-12)
    draws = sampled_256.sample_y(X, 3, random_state=0)
    assert draws.shape == (6, 3)


# ---------------------------------------------------------------------------------
# EM on a linear-Gaussian model: the evidence-optimal prior precision
# ---------------------------------------------------------------------------------


def test_em_finds_evidence_optimal_prior_precision():
    rng = np.random.RandomState(0)
    N, D, s2 = 60, 8, 0.25
    X = rng.randn(N, D)
    w = rng.randn(D) / math.sqrt(2.0)
    y = X @ w + 0.3 + math.sqrt(s2) * rng.randn(N)
    Phi = np.hstack([X, np.ones((N, 1))])  # nn.Linear's parameters: weight, then bias

    def neg_log_evidence(log_alpha):  # log N(y | 0, s2 I + Phi Phi^T / alpha)
        cov = s2 * np.eye(N) + Phi @ Phi.T / math.exp(log_alpha)
        sign, logdet = np.linalg.slogdet(cov)
        return 0.5 * (logdet + y @ np.linalg.solve(cov, y))

    best = scipy.optimize.minimize_scalar(neg_log_evidence, bounds=(-10, 10), method="bounded")
    alpha_opt = math.exp(best.x)

    net = nn.Linear(D, 1, dtype=torch.float64)
    with torch.no_grad():  # pretrained at least squares: the linearisation is exact
        sol = np.linalg.lstsq(Phi, y, rcond=None)[0]
        net.weight.copy_(torch.as_tensor(sol[:D])[None])
        net.bias.fill_(float(sol[D]))
    est = SampledLLARegressor(net, noise_variance=s2, n_posterior_samples=256, n_em_steps=8,
                              random_state=0, device="cpu", learning_rate=0.05,
                              max_iter=400).fit(X, y)
    alpha = 1.0 / est.prior_variance_
    trace = 1.0 / est.hyper_trace_["prior_variance"]
    print(f"\n[EM] alpha per step {np.round(trace, 3)}; evidence optimum {alpha_opt:.4f}")
    assert est.hyper_strategy_ == "em"
    assert abs(alpha - alpha_opt) / alpha_opt < 0.10


def test_em_sample_subset():
    """EM steps solve only as many samples as the M-step's gamma needs; the final
    E-step solves all K, and the fixed point matches EM on all K samples."""
    rng = np.random.RandomState(1)
    N, D, s2 = 80, 6, 0.25
    X = rng.randn(N, D)
    y = X @ rng.randn(D) + math.sqrt(s2) * rng.randn(N)
    net = nn.Linear(D, 1, dtype=torch.float64)
    with torch.no_grad():
        sol = np.linalg.lstsq(np.hstack([X, np.ones((N, 1))]), y, rcond=None)[0]
        net.weight.copy_(torch.as_tensor(sol[:D])[None])
        net.bias.fill_(float(sol[D]))
    kw = dict(noise_variance=s2, n_posterior_samples=128, n_em_steps=4, random_state=0,
              device="cpu")
    auto = SampledLLARegressor(net, **kw).fit(X, y)
    full = SampledLLARegressor(net, n_em_samples=128, **kw).fit(X, y)
    ks = [st["n_samples"] for st in auto.hyper_trace_["steps"]]
    gammas = np.array([st["effective_dim"] for st in auto.hyper_trace_["steps"]])
    # gamma <= D + 1 = 7: one sample's q_k has relative std ~ sqrt(2 / gamma) ~ 0.55,
    # so 16 samples give a relative standard error ~ 0.14 > 0.05 and "auto" grows k
    assert ks[0] == 16 and ks[1] > 16 and all(k <= 128 for k in ks)
    assert [st["n_samples"] for st in full.hyper_trace_["steps"]] == [128] * 4
    assert auto.posterior_.samples.shape[0] == 128  # the final E-step solves all K
    # each step's gamma against the closed form tr((G + I / s0^2)^-1 G) at the prior
    # variance its E-step used: within 3 standard errors of the samples it used
    Phi = np.hstack([X, np.ones((N, 1))])
    G = Phi.T @ Phi / s2
    used = auto.hyper_trace_["prior_variance"][:-1]
    exact = np.array([np.trace(np.linalg.solve(G + np.eye(D + 1) / v, G)) for v in used])
    rse = np.sqrt(2.0 / exact / np.array(ks))  # q_k ~ chi-square-like: var ~ 2 gamma
    assert np.all(np.abs(gammas / exact - 1) < 3 * rse), (gammas, exact)
    # the same fixed point within the standard error of the M-step (5 %, x 2)
    assert abs(auto.prior_variance_ / full.prior_variance_ - 1) < 0.1
    # an integer fixes the count (capped at K)
    few = SampledLLARegressor(net, n_em_samples=4, **kw).fit(X, y)
    assert [st["n_samples"] for st in few.hyper_trace_["steps"]] == [4] * 4
    capped = SampledLLARegressor(net, **{**kw, "n_posterior_samples": 8}).fit(X, y)
    assert [st["n_samples"] for st in capped.hyper_trace_["steps"]] == [8] * 4


def test_em_noise_variance_and_g_prior(reg_data, reg_net):
    est = SampledLLARegressor(reg_net, n_posterior_samples=16, n_em_steps=2, g_prior=True,
                              random_state=0, **FAST).fit(reg_data.X, reg_data.y)
    steps = est.hyper_trace_["steps"]
    assert len(steps) == 2 and all("noise_variance" in s for s in steps)
    assert est.hyper_trace_["noise_source"] == "em"
    assert 0 < est.effective_dim_ < est.linearized_net_.n_params
    resid = np.mean((reg_net.predict(reg_data.X)[:, 0] - reg_data.y) ** 2)
    # s2 = RSS(theta_bar) / (N - gamma): the linear model's mode may fit better than the
    # network, so only the order of magnitude is checked
    assert 0.1 * resid < est.noise_variance_ < 10 * resid
    assert est.noise_variance_ == steps[-1]["noise_variance"]
    scale = est.posterior_.prior_scale
    assert scale.shape == (est.linearized_net_.n_params,) and float(scale.max()) <= 100.0
    # EM with validation rows: the prior and the noise still come from EM on the
    # training rows; the held-out rows then fit the overall scale c of the exact
    # rescaling (c s0^2, c s2): the samples are sqrt(c) times EM's, so the predictive
    # variance is c times the one without held-out rows everywhere (the shape EM chose
    # is kept), and c is the held-out maximum likelihood scale: mean z^2 = 1 there.
    Xv, yv = reg_data.X_test, reg_data.y_test
    kw = dict(n_posterior_samples=8, n_em_steps=1, random_state=0, **FAST)
    plain = SampledLLARegressor(reg_net, **kw).fit(reg_data.X, reg_data.y)
    est_v = SampledLLARegressor(reg_net, **kw).fit(reg_data.X, reg_data.y,
                                                   validation_data=(Xv, yv))
    cal = est_v.hyper_trace_["calibration"]
    assert est_v.hyper_strategy_ == "em" and est_v.hyper_trace_["noise_source"] == "em"
    assert cal["method"] == "exact_rescaling" and cal["n_rows"] == len(yv)
    c = cal["scale"]
    np.testing.assert_allclose(cal["anchor"][1], plain.noise_variance_, rtol=1e-12)
    np.testing.assert_allclose(est_v.noise_variance_, c * plain.noise_variance_, rtol=1e-12)
    np.testing.assert_allclose(est_v.prior_variance_, c * plain.prior_variance_, rtol=1e-12)
    Xq = _queries(reg_data)
    np.testing.assert_allclose(est_v.predict(Xq, return_std=True)[1] ** 2,
                               c * plain.predict(Xq, return_std=True)[1] ** 2, rtol=1e-10)
    mean, std = est_v.predict(Xv, return_std=True)
    np.testing.assert_allclose(np.mean((yv - mean) ** 2 / std ** 2), 1.0, rtol=1e-10)
    # the net fitted its training rows: its held-out residuals are larger, c > 1
    print(f"\n[EM + held-out rows] exact rescaling factor c = {c:.3f}")
    assert c > 1.0


# ---------------------------------------------------------------------------------
# KL to exact LLA on a 1-D toy with a gap, against laplace-torch's KFAC
# ---------------------------------------------------------------------------------


def _gap_problem():
    import skorch

    from sklearn_lla.nets import MLP

    rng = np.random.RandomState(0)
    X = np.concatenate([rng.uniform(-2, -0.7, 40), rng.uniform(0.7, 2, 40)])[:, None]
    y = np.sin(2 * X[:, 0]) + 0.1 * rng.randn(80)
    net = skorch.NeuralNetRegressor(
        MLP, module__n_features=1, module__n_outputs=1, module__hidden_layer_sizes=(16, 16),
        module__dtype=torch.float64, optimizer=torch.optim.Adam, lr=1e-2,
        optimizer__weight_decay=1e-4, max_epochs=300, train_split=None, verbose=0)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        net.fit(X, y[:, None])
    return X, y, net, np.linspace(-3, 3, 61)[:, None]


def _kl(var_p, var_q):
    """Mean KL(N(m, var_p) || N(m, var_q)) over points (equal means)."""
    r = var_p / var_q
    return float(np.mean(0.5 * (r - 1.0 - np.log(r))))


@pytest.mark.filterwarnings("ignore:Extension saving to:UserWarning")
@pytest.mark.filterwarnings("ignore:Full backward hook:UserWarning")
def test_kl_to_exact_below_kfac():
    laplace = pytest.importorskip("laplace")
    from torch.utils.data import DataLoader, TensorDataset

    X, y, net, Xq = _gap_problem()
    s0, s2 = 1.0, 0.01
    exact = LLARegressor(net, prior_variance=s0, noise_variance=s2, space="parameter",
                         device="cpu").fit(X, y)
    var_e = _cov(exact, Xq)[1][:, 0, 0]
    est = SampledLLARegressor(net, prior_variance=s0, noise_variance=s2,
                              n_posterior_samples=64, random_state=0, **FAST).fit(X, y)
    var_s = _cov(est, Xq)[1][:, 0, 0]

    model = copy.deepcopy(net.module_).double()
    for p in model.parameters():
        p.requires_grad_(True)
    la = laplace.Laplace(model, "regression", subset_of_weights="all", hessian_structure="kron",
                         sigma_noise=math.sqrt(s2), prior_precision=1.0 / s0)
    la.fit(DataLoader(TensorDataset(torch.as_tensor(X), torch.as_tensor(y[:, None])),
                      batch_size=32))
    _, f_var = la(torch.as_tensor(Xq), pred_type="glm")
    var_k = f_var.reshape(-1).detach().numpy()
    kl_s, kl_k = _kl(var_e, var_s), _kl(var_e, var_k)
    print(f"\n[gap toy] KL(exact || sampled, K=64) = {kl_s:.4f}; KL(exact || KFAC) = {kl_k:.4f}")
    assert kl_s < kl_k


# ---------------------------------------------------------------------------------
# Determinism, dtypes, classification, options
# ---------------------------------------------------------------------------------


def test_determinism_and_seeds(reg_data, reg_net):
    kw = dict(prior_variance=S0, noise_variance=S2, n_posterior_samples=8, max_iter=100,
              device="cpu")
    a = SampledLLARegressor(reg_net, random_state=3, **kw).fit(reg_data.X, reg_data.y)
    b = SampledLLARegressor(reg_net, random_state=3, **kw).fit(reg_data.X, reg_data.y)
    c = SampledLLARegressor(reg_net, random_state=4, **kw).fit(reg_data.X, reg_data.y)
    sa, sb, sc = (e.predict(reg_data.X_test, return_std=True)[1] for e in (a, b, c))
    np.testing.assert_array_equal(sa, sb)
    assert not np.allclose(sa, sc)


@pytest.mark.parametrize("solver", ["cg", "adam"])
def test_float32_net_matches_float64(reg_data, reg_net, solver):
    # Same seed, same draws (always drawn in float64), same minibatches: the runs differ
    # only by float32 rounding of the Jacobian products. Conjugate gradients run to
    # their tolerance land within it of the same solution; Adam's cosine decay ends
    # its (contractive) iterations on the convex quadratic at the same point.
    kw = dict(prior_variance=S0, noise_variance=S2, n_posterior_samples=8, random_state=0,
              device="cpu", learning_rate=0.05, max_iter=300, solver=solver)
    m32 = copy.deepcopy(reg_net.module_).float()
    a = SampledLLARegressor(reg_net, **kw).fit(reg_data.X, reg_data.y)
    b = SampledLLARegressor(m32, **kw).fit(reg_data.X.astype(np.float32), reg_data.y)
    assert a.hyper_trace_["solver"] == b.hyper_trace_["solver"] == solver
    Xq = _queries(reg_data)
    sa = a.predict(Xq, return_std=True)[1]
    sb = b.predict(Xq.astype(np.float32), return_std=True)[1]
    print(f"\n[float32, {solver}] max relative std difference {np.max(np.abs(sb / sa - 1)):.2e}")
    np.testing.assert_allclose(sb, sa, rtol=1e-3)


def test_float32_net_matches_float64_with_em(reg_data, reg_net):
    # The default policy (EM for the prior and the noise, conjugate gradients): the
    # hyperparameters are statistics of the samples, so an inaccurate E-step would
    # move them apart; here they agree to the solver's tolerance.
    kw = dict(n_posterior_samples=16, random_state=0, device="cpu")
    m32 = copy.deepcopy(reg_net.module_).float()
    a = SampledLLARegressor(reg_net, **kw).fit(reg_data.X, reg_data.y)
    b = SampledLLARegressor(m32, **kw).fit(reg_data.X.astype(np.float32), reg_data.y)
    assert a.hyper_strategy_ == b.hyper_strategy_ == "em"
    np.testing.assert_allclose(b.prior_variance_, a.prior_variance_, rtol=1e-3)
    np.testing.assert_allclose(b.noise_variance_, a.noise_variance_, rtol=1e-3)
    Xq = _queries(reg_data)
    np.testing.assert_allclose(b.predict(Xq.astype(np.float32), return_std=True)[1],
                               a.predict(Xq, return_std=True)[1], rtol=1e-3)


def test_classifier_against_exact(clf_data, clf_net):
    from sklearn_lla import LLAClassifier

    exact = LLAClassifier(clf_net, prior_variance=2.0, space="parameter",
                          device="cpu").fit(clf_data.X, clf_data.y)
    est = SampledLLAClassifier(clf_net, prior_variance=2.0, n_posterior_samples=128,
                               random_state=0, **FAST).fit(clf_data.X, clf_data.y)
    Xq = clf_data.X_test
    ve = np.trace(_cov(exact, Xq)[1], axis1=1, axis2=2)
    vs = np.trace(_cov(est, Xq)[1], axis1=1, axis2=2)
    err = float(np.mean(np.abs(vs - ve) / ve))
    print(f"\n[sampled clf] mean relative error of the latent trace: {err:.3f}")
    assert err < 0.2
    np.testing.assert_allclose(est.predict_proba(Xq), exact.predict_proba(Xq), atol=0.05)
    # the default: the prior variance ||theta_hat||^2 / P, one E-step, no mode
    auto = SampledLLAClassifier(clf_net, n_posterior_samples=8, n_em_steps=2,
                                random_state=0, **FAST).fit(clf_data.X, clf_data.y)
    theta = auto.linearized_net_.flat_params().double()
    assert auto.hyper_strategy_ == "weight_norm" and len(auto.n_iter_) == 1
    np.testing.assert_allclose(auto.prior_variance_, float((theta ** 2).sum()) / len(theta),
                               rtol=1e-12)
    assert auto.posterior_.mode is None
    assert auto.predict_proba(Xq).shape == (len(Xq), 3)
    # the paper's EM on request: n_em_steps M-steps alpha = gamma / ||theta_bar||^2
    em = SampledLLAClassifier(clf_net, hyper_strategy="em", n_posterior_samples=8,
                              n_em_steps=2, random_state=0, **FAST).fit(clf_data.X, clf_data.y)
    tr = em.hyper_trace_
    assert em.hyper_strategy_ == "em" and len(tr["prior_variance"]) == 3
    assert len(em.n_iter_) == 3  # two EM steps and the final E-step
    for step, nxt in zip(tr["steps"], tr["prior_variance"][1:]):
        np.testing.assert_allclose(nxt, step["mode_sq_norm"] / step["effective_dim"],
                                   rtol=1e-12)
    assert tr["prior_variance"][0] == auto.prior_variance_  # EM starts at the weight norm
    assert em.posterior_.mode is not None


def test_early_stopping_and_convergence_warning(reg_data, reg_net):
    kw = dict(prior_variance=S0, noise_variance=S2, n_posterior_samples=8, device="cpu",
              random_state=0)
    # Adam's options (conjugate gradients stop at their residual tolerance)
    est = SampledLLARegressor(reg_net, early_stopping=True, tol=1e-3, max_iter=5000,
                              learning_rate=0.05, solver="adam", **kw).fit(reg_data.X, reg_data.y)
    assert est.n_iter_[-1] < 5000
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cut = SampledLLARegressor(reg_net, max_iter=30, learning_rate=1e-3, solver="adam",
                                  lr_schedule="constant", n_posterior_samples=8, n_em_steps=2,
                                  device="cpu", random_state=0).fit(reg_data.X, reg_data.y)
    # EM's E-steps are warm-started partial solves by design: only the final E-step
    # (the samples kept) warns; the trace says which EM steps were cut
    conv = [w for w in caught if issubclass(w.category, ConvergenceWarning)]
    assert len(conv) == 1 and "posterior samples: max_iter=30" in str(conv[0].message)
    steps = cut.hyper_trace_["steps"]
    assert len(steps) == cut.n_em_steps and all(st["cut_at_max_iter"] for st in steps)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConvergenceWarning)
        est.predict(reg_data.X_test)


# ---------------------------------------------------------------------------------
# Solvers, the exact rescaling, and the held-out-row policy
# ---------------------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore::sklearn.exceptions.ConvergenceWarning")
def test_rescaling_identity_is_exact(reg_data, reg_net):
    # The samples for (c s0^2, c s2) are sqrt(c) times those for (s0^2, s2), same draws:
    # in prior-whitened coordinates the two E-step objectives coincide. Adam's runs
    # then coincide step by step (to rounding), even unconverged; conjugate gradients
    # reach it to their tolerance. The calibration on held-out rows and the validation
    # scan's noise factors multiply the samples by sqrt(c) on the strength of it.
    c = 3.7
    for solver, extra, rtol in (("adam", dict(max_iter=50), 1e-8),
                                ("cg", dict(max_iter=2000, tol=1e-10), 1e-7)):
        kw = dict(n_posterior_samples=8, random_state=0, device="cpu", solver=solver, **extra)
        a = SampledLLARegressor(reg_net, prior_variance=S0, noise_variance=S2, **kw).fit(
            reg_data.X, reg_data.y)
        b = SampledLLARegressor(reg_net, prior_variance=c * S0, noise_variance=c * S2,
                                **kw).fit(reg_data.X, reg_data.y)
        assert a.hyper_trace_["optimisation"]["solver"] == solver
        za, zb = a.posterior_.samples.numpy(), b.posterior_.samples.numpy()
        err = np.abs(zb - math.sqrt(c) * za).max() / np.abs(za).max()
        print(f"\n[rescaling, {solver}] max |z(c) - sqrt(c) z| / max |z| = {err:.2e}")
        assert err < rtol
    # unconverged conjugate gradients are not the identity: the check has teeth
    kw = dict(n_posterior_samples=8, random_state=0, device="cpu", solver="cg", max_iter=3)
    a = SampledLLARegressor(reg_net, prior_variance=S0, noise_variance=S2, **kw).fit(
        reg_data.X, reg_data.y)
    b = SampledLLARegressor(reg_net, prior_variance=S0, noise_variance=c * S2, **kw).fit(
        reg_data.X, reg_data.y)
    za, zb = a.posterior_.samples.numpy(), b.posterior_.samples.numpy()
    assert np.abs(zb - math.sqrt(c) * za).max() / np.abs(za).max() > 1e-3


def test_solver_choice_and_conjugate_gradients(reg_data, reg_net):
    kw = dict(prior_variance=S0, noise_variance=S2, n_posterior_samples=8, random_state=0,
              device="cpu")
    # "auto": conjugate gradients when a data pass is at most CG_MAX_BATCHES batches
    from sklearn_lla._posteriors.sampled import AUTO_ITERATIONS, CG_MAX_BATCHES

    small = SampledLLARegressor(reg_net, **kw).fit(reg_data.X, reg_data.y)
    bs = max(1, len(reg_data.X) // (CG_MAX_BATCHES + 1))  # > CG_MAX_BATCHES batches
    big = SampledLLARegressor(reg_net, batch_size=bs, max_iter=50, **kw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        big.fit(reg_data.X, reg_data.y)
    assert small.hyper_trace_["solver"] == "cg" and big.hyper_trace_["solver"] == "adam"
    opt = small.hyper_trace_["optimisation"]
    assert opt["converged"] and opt["relative_residual"] <= 1e-4
    assert small.n_iter_[-1] == opt["n_iter"] < AUTO_ITERATIONS["cg"]  # max_iter="auto"
    # the tolerance bounds the function-space error: tol=1e-4 against a 1e-8 run
    tight = SampledLLARegressor(reg_net, tol=1e-8, **kw).fit(reg_data.X, reg_data.y)
    fa = small.posterior_.predict(torch.as_tensor(reg_data.X_test)).cov.numpy()
    ft = tight.posterior_.predict(torch.as_tensor(reg_data.X_test)).cov.numpy()
    print(f"\n[cg] latent variance, tol 1e-4 vs 1e-8: {np.max(np.abs(fa / ft - 1)):.2e}")
    assert np.max(np.abs(fa / ft - 1)) < 1e-3
    # max_iter ends an unconverged run with a ConvergenceWarning
    with pytest.warns(ConvergenceWarning, match="conjugate gradients reached max_iter=3"):
        SampledLLARegressor(reg_net, max_iter=3, **kw).fit(reg_data.X, reg_data.y)


@pytest.mark.filterwarnings("ignore::sklearn.exceptions.ConvergenceWarning")
def test_validation_policy_with_held_out_rows(reg_data, reg_net):
    Xv, yv = reg_data.X_test, reg_data.y_test
    kw = dict(n_posterior_samples=8, max_iter=60, random_state=0, device="cpu")
    # the default never scores candidates on held-out rows: EM, then the exact
    # rescaling fitted on them (test_em_noise_variance_and_g_prior checks its values)
    est = SampledLLARegressor(reg_net, **kw).fit(reg_data.X, reg_data.y,
                                                 validation_data=(Xv, yv))
    assert est.hyper_strategy_ == "em" and est.validation_source_ == "validation_data"
    assert est.hyper_trace_["calibration"]["method"] == "exact_rescaling"
    assert "score" not in est.hyper_trace_
    # no held-out rows: the paper's EM, nothing calibrated
    plain = SampledLLARegressor(reg_net, **kw).fit(reg_data.X, reg_data.y)
    assert plain.hyper_strategy_ == "em" and "calibration" not in plain.hyper_trace_
    assert plain.validation_source_ is None
    # the validation scan on request: increasing prior variances from
    # 1e-2 ||theta||^2 / P, warm-started, at most max_iter // 4 iterations each, then a
    # full E-step
    est = SampledLLARegressor(reg_net, hyper_strategy="validation", **kw).fit(
        reg_data.X, reg_data.y, validation_data=(Xv, yv))
    tr = est.hyper_trace_
    assert est.hyper_strategy_ == "validation" and tr["noise_source"] == "validation"
    assert "calibration" not in tr  # the scan already used the held-out rows
    theta = est.linearized_net_.flat_params().double()
    base = float((theta ** 2).sum()) / len(theta)
    n = len(tr["prior_variance"])
    np.testing.assert_allclose(tr["prior_variance"], base * np.logspace(-2, 2, 9)[:n],
                               rtol=1e-12)
    assert tr["score"].shape == (n, 21) and len(est.n_iter_) == n + 1
    assert np.all(est.n_iter_[:n] <= 15) and est.n_iter_[-1] <= 60
    # the kept predictive is the one scored: its validation NLL is the recorded final
    # score, and it is the best of the exact rescalings c (s0^2, s2) of the final samples
    mean, std = est.predict(Xv, return_std=True)
    nll = float(np.mean(0.5 * np.log(2 * np.pi * std ** 2) + 0.5 * (yv - mean) ** 2 / std ** 2))
    np.testing.assert_allclose(nll, tr["final_score"], rtol=1e-10)
    var = std ** 2
    for c in (0.5, 2.0):
        other = np.mean(0.5 * np.log(2 * np.pi * c * var) + 0.5 * (yv - mean) ** 2 / (c * var))
        assert nll <= other
    # and it beats the raw network with its validation residual variance
    s2v = np.mean((reg_net.predict(Xv)[:, 0] - yv) ** 2)
    raw = np.mean(0.5 * np.log(2 * np.pi * s2v) + 0.5 * (yv - mean) ** 2 / s2v)
    print(f"\n[validation scan] s0^2 {est.prior_variance_:.4g}, s2 {est.noise_variance_:.4g}"
          f"; validation NLL {nll:.4f} vs raw {raw:.4f}")
    assert nll <= raw + 1e-9
    with pytest.raises(ValueError, match="needs rows the network did not fit"):
        SampledLLARegressor(reg_net, hyper_strategy="validation", **kw).fit(
            reg_data.X, reg_data.y)


@pytest.mark.filterwarnings("ignore::sklearn.exceptions.ConvergenceWarning")
def test_validation_policy_classifier(clf_data, clf_net):
    Xv, yv = clf_data.X_test, clf_data.y_test
    kw = dict(n_posterior_samples=8, max_iter=60, random_state=0, device="cpu")
    # the default: the weight-norm prior, then a temperature fitted on the held-out rows
    est = SampledLLAClassifier(clf_net, **kw).fit(clf_data.X, clf_data.y,
                                                  validation_data=(Xv, yv))
    plain = SampledLLAClassifier(clf_net, **kw).fit(clf_data.X, clf_data.y)
    assert est.hyper_strategy_ == "weight_norm" and "calibration" in est.hyper_trace_
    assert est.prior_variance_ == plain.prior_variance_  # the prior ignores held-out rows
    assert plain.temperature_ == 1.0 and "calibration" not in plain.hyper_trace_
    assert est.temperature_ == est.likelihood_.temperature > 0
    np.testing.assert_array_equal(est.posterior_.samples.numpy(),
                                  plain.posterior_.samples.numpy())
    # the tempered predictive is N(g / T, S / T^2)
    lp = plain.posterior_.predict(torch.as_tensor(Xq := clf_data.X_test))
    T = est.temperature_
    want = plain.likelihood_.predict(lp.mean / T, lp.cov / T ** 2).numpy()
    np.testing.assert_allclose(est.predict_proba(Xq), want, rtol=1e-10, atol=1e-12)
    # the validation scan on request
    est = SampledLLAClassifier(clf_net, hyper_strategy="validation", **kw).fit(
        clf_data.X, clf_data.y, validation_data=(Xv, yv))
    tr = est.hyper_trace_
    assert est.hyper_strategy_ == "validation" and tr["score"].shape[1] == 1
    i = int(np.argmin(tr["score"][:, 0]))
    assert est.prior_variance_ == tr["prior_variance"][i]
    # every candidate but the best scored worse; the scan stops after two in a row that
    # are clearly worse (or at the top of the grid)
    assert len(tr["prior_variance"]) == 9 or np.all(
        tr["score"][-2:, 0] > tr["best_score"] * (1 + 1e-3))
    p = est.predict_proba(Xv)
    nll = -np.mean(np.log(p[np.arange(len(yv)), yv]))
    print(f"\n[validation scan, clf] s0^2 {est.prior_variance_:.4g}; final validation NLL "
          f"{nll:.4f} (scan: {tr['best_score']:.4f})")
    assert np.isfinite(nll)


@pytest.mark.filterwarnings("ignore::sklearn.exceptions.ConvergenceWarning")
def test_lr_schedule_auto(reg_data, reg_net):
    # Adam's schedule ("auto" is the cosine decay, full batch or not); conjugate
    # gradients have none
    kw = dict(prior_variance=S0, noise_variance=S2, n_posterior_samples=4, max_iter=20,
              random_state=0, device="cpu")
    full = SampledLLARegressor(reg_net, solver="adam", **kw).fit(reg_data.X, reg_data.y)
    assert full.hyper_trace_["lr_schedule"] == "cosine"
    # 60 batches of one row: more than CG_MAX_BATCHES, so "auto" is Adam
    mini = SampledLLARegressor(reg_net, batch_size=1, **kw).fit(reg_data.X, reg_data.y)
    assert mini.hyper_trace_["solver"] == "adam" and mini.hyper_trace_["lr_schedule"] == "cosine"
    step = SampledLLARegressor(reg_net, solver="adam", lr_schedule="step", **kw).fit(
        reg_data.X, reg_data.y)
    assert step.hyper_trace_["lr_schedule"] == "step"
    const = SampledLLARegressor(reg_net, solver="adam", lr_schedule="constant", **kw).fit(
        reg_data.X, reg_data.y)
    assert not np.allclose(const.posterior_.samples.numpy(), full.posterior_.samples.numpy())
    cg = SampledLLARegressor(reg_net, **kw).fit(reg_data.X, reg_data.y)
    assert cg.hyper_trace_["solver"] == "cg" and "lr_schedule" not in cg.hyper_trace_


def test_nystrom_preconditioned_cg(reg_data, reg_net, exact_reg):
    # The same draws give the same linear systems: the preconditioned and the plain
    # solver must land on the same samples and mode (to their tolerance), the
    # preconditioned one in fewer data passes, and both at exact LLA's variance up to
    # the Monte Carlo error of K = 64 samples (sqrt(2 / 64) = 0.18 per point).
    kw = dict(prior_variance=S0, noise_variance=S2, n_posterior_samples=64, random_state=0,
              device="cpu", solver="cg", tol=1e-8)
    plain = SampledLLARegressor(reg_net, preconditioner=None, **kw).fit(reg_data.X, reg_data.y)
    # rank 12 < N C = 60: an approximate sketch (the default, 2 (K + 1) = 130, would be
    # capped at N C and exact here)
    pcg = SampledLLARegressor(reg_net, preconditioner_rank=12, **kw).fit(reg_data.X, reg_data.y)
    assert pcg.hyper_trace_["optimisation"]["preconditioner_rank"] == 12
    assert "preconditioner_rank" not in plain.hyper_trace_["optimisation"]
    a, b = plain.posterior_, pcg.posterior_
    rel = float(torch.linalg.norm(b.samples - a.samples) / torch.linalg.norm(a.samples))
    rel_mode = float(torch.linalg.norm(b.mode - a.mode) / torch.linalg.norm(a.mode))
    print(f"\n[pcg] iterations plain {plain.n_iter_[-1]}, Nystrom rank 12 {pcg.n_iter_[-1]}; "
          f"samples differ by {rel:.1e}, mode by {rel_mode:.1e}")
    assert rel < 1e-6 and rel_mode < 1e-6
    assert pcg.n_iter_[-1] < plain.n_iter_[-1] / 2
    _, cov_e = exact_reg
    _, cov = _cov(pcg, _queries(reg_data))
    err = float(np.mean(np.abs(cov[:, 0, 0] / cov_e[:, 0, 0] - 1)))
    print(f"[pcg] mean relative variance error to exact LLA: {err:.3f}")
    assert err < 0.25
    # gamma from the solve's residual (no data pass) is the quadratic form of a pass
    _, jz = b.lin.jvp(torch.as_tensor(reg_data.X), b.samples)
    gamma = float((jz.to(torch.float64) ** 2).sum((0, 1)).mean()) / S2
    print(f"[pcg] gamma from the residual {pcg.effective_dim_:.6f}, from a pass {gamma:.6f}")
    np.testing.assert_allclose(pcg.effective_dim_, gamma, rtol=1e-6)
    # the sketch is made once per fit and rescaled: EM with it keeps the plain EM's
    # hyperparameters (same draws, solves to the tolerance)
    em = dict(n_posterior_samples=16, random_state=0, device="cpu", solver="cg", tol=1e-8)
    e0 = SampledLLARegressor(reg_net, preconditioner=None, **em).fit(reg_data.X, reg_data.y)
    e1 = SampledLLARegressor(reg_net, preconditioner_rank=12, **em).fit(reg_data.X, reg_data.y)
    np.testing.assert_allclose(e1.prior_variance_, e0.prior_variance_, rtol=1e-6)
    np.testing.assert_allclose(e1.noise_variance_, e0.noise_variance_, rtol=1e-6)
    assert e1.n_iter_.sum() < e0.n_iter_.sum() / 2


# ---------------------------------------------------------------------------------
# Graph backend (conv / BatchNorm nets): the training batches' rows are kept
# ---------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_kept_rows_products_match_dense_jacobian(cnn_cases, dtype, monkeypatch):
    from sklearn_lla._core.likelihoods import Categorical
    from sklearn_lla._network.linearized import LinearizedNet, stack_flat
    from sklearn_lla._posteriors._sampled_passes import BatchRows

    X, _, _, net = cnn_cases["classification"]
    x = torch.as_tensor(X[:25]).to(dtype)
    lin = LinearizedNet(copy.deepcopy(net.module_).to(dtype), example_input=x)
    assert lin.backend == "graph"
    lik = Categorical(3)
    g = torch.Generator().manual_seed(0)
    T = torch.randn(7, lin.n_params, dtype=torch.float64, generator=g)
    cot = torch.randn(7, 25, 3, dtype=torch.float64, generator=g)
    J = lin.jacobian(x).to(torch.float64)  # (B, C, P), torch.func
    ref_jt = torch.einsum("bcp,kp->bck", J, T)
    ref_vj = torch.einsum("bcp,kbc->kp", J, cot)
    A = lik.lam_factor(lin.forward(x).to(torch.float64))
    ref_ggn = torch.einsum("bcp,bcd,bed,bek->kp", J, A, A, ref_jt)
    tol = 1e-4 if dtype == torch.float32 else 1e-10

    def close(a, b):
        return torch.linalg.norm(a.double() - b) <= tol * torch.linalg.norm(b)

    for step in (None, 7):  # one chunk; chunks of 7 points (4 for 25 points)
        if step is not None:
            monkeypatch.setattr(lin.jacobian_backend, "kernel_step", lambda k, s=step: s)
        store = BatchRows(lin, 3, budget=10**9)
        for _ in range(2):  # rows made at the first use, kept for the second
            out, jt = store.jvp(0, x, T)
            vj = store.vjp(0, x, cot)
            assert close(jt, ref_jt) and close(vj, ref_vj)
            assert close(store.ggn_product(0, x, T, lik), ref_ggn)
            np.testing.assert_allclose(out.double().numpy(), lin.forward(x).double().numpy(),
                                       rtol=tol, atol=tol)
        assert list(store._rows) == [0] and store.held > 0
        assert len(store._rows[0]) == (1 if step is None else 4)
    # the same products as the backend's own (which make the same rows per call)
    ref = stack_flat(lin.vjp(x, cot), lin.names)
    assert torch.linalg.norm(vj - ref) <= 1e-6 * torch.linalg.norm(ref)
    # over budget: nothing kept, the same products
    small = BatchRows(lin, 3, budget=1)
    assert torch.equal(small.vjp(0, x, cot), vj) and small.held == 0 and not small._rows


@pytest.mark.parametrize("task", ["classification", "regression"])
def test_kept_rows_fit_equals_backend_products(task, cnn_cases, monkeypatch):
    # The kept rows change where the products come from, not what they are: a fit
    # with them, one that keeps only some batches (budget) and one with the backend's
    # per-pass products (no store) give the same samples to float32 rounding. Plain
    # conjugate gradients (no sketch, so no initial residual from it) solve the same
    # systems: the same samples to the tolerance.
    from sklearn_lla._posteriors import _sampled_passes as sp

    X, y, Xt, net = cnn_cases[task]
    cls = SampledLLAClassifier if task == "classification" else SampledLLARegressor
    kw = dict(n_posterior_samples=16, batch_size=20, random_state=0, device="cpu", tol=1e-7)
    plain = cls(net, preconditioner=None, **kw).fit(X, y)
    fits = [cls(net, **kw).fit(X, y)]
    assert fits[0].hyper_trace_["optimisation"]["preconditioner_rank"] >= 16
    rel = float(torch.linalg.norm(fits[0].posterior_.samples - plain.posterior_.samples)
                / torch.linalg.norm(plain.posterior_.samples))
    print(f"\n[kept rows {task}] Nystrom PCG vs plain CG: samples differ by {rel:.1e}")
    assert rel < 1e-5
    monkeypatch.setattr(sp, "ROW_STORE_ELEMENTS", 10_000)  # one batch of three (7,860 each)
    fits.append(cls(net, **kw).fit(X, y))
    monkeypatch.setattr(sp.BatchRows, "for_fit", classmethod(lambda c, data: None))
    fits.append(cls(net, **kw).fit(X, y))
    assert fits[0].jacobian_backend_ == "graph"
    ref = fits[-1].posterior_.samples
    for f in fits[:-1]:
        rel = float(torch.linalg.norm(f.posterior_.samples - ref) / torch.linalg.norm(ref))
        assert rel < 1e-5
        np.testing.assert_allclose(f.prior_variance_, fits[-1].prior_variance_, rtol=1e-5)


def test_cnn_classifier_against_exact(cnn_cases):
    # On the tiny conv / BatchNorm / residual net (graph backend, kept rows, the
    # sketch including the start) the samples' latent covariance is exact LLA's up to
    # the Monte Carlo error of K = 256 samples (sqrt(2 / 256) = 0.09 per point).
    from sklearn_lla import LLAClassifier

    X, y, Xt, net = cnn_cases["classification"]
    exact = LLAClassifier(net, prior_variance=0.5, space="parameter",
                          device="cpu").fit(X, y)
    est = SampledLLAClassifier(net, prior_variance=0.5, n_posterior_samples=256,
                               random_state=0, device="cpu").fit(X, y)
    assert est.jacobian_backend_ == "graph" and est.hyper_trace_["solver"] == "cg"
    ve = np.trace(_cov(exact, Xt)[1], axis1=1, axis2=2)
    vs = np.trace(_cov(est, Xt)[1], axis1=1, axis2=2)
    err = float(np.mean(np.abs(vs - ve) / ve))
    print(f"\n[sampled cnn] mean relative error of the latent trace: {err:.3f}")
    assert err < 0.15


def test_cnn_classifier_galerkin_start_and_default_tol(cnn_cases, monkeypatch):
    # The Galerkin start (the sketch's test matrix holds the starts and right-hand
    # sides) never costs iterations (here it saves none; on the digits CNN it brings
    # the first iteration's residual from 2.5e-3 to 2.7e-4); the classifier's default
    # tol = 1e-3 lands within its residual of a 1e-10 solve: a sample off by 1e-3
    # relative changes the latent variance by about 2e-3, far below the Monte Carlo
    # error sqrt(2 / K) = 0.35 of the K = 16 samples.
    from sklearn_lla._core.krylov import NystromPreconditioner

    X, y, Xt, net = cnn_cases["classification"]
    kw = dict(n_posterior_samples=16, random_state=0, device="cpu")
    default = SampledLLAClassifier(net, **kw).fit(X, y)
    assert default.get_params()["tol"] == 1e-3 and default.hyper_trace_["solver"] == "cg"
    opt = default.hyper_trace_["optimisation"]
    assert opt["converged"] and opt["relative_residual"] <= 1e-3
    tight = SampledLLAClassifier(net, tol=1e-10, **kw).fit(X, y)
    vd = np.trace(_cov(default, Xt)[1], axis1=1, axis2=2)
    vt = np.trace(_cov(tight, Xt)[1], axis1=1, axis2=2)
    print(f"\n[sampled cnn] latent trace, tol 1e-3 vs 1e-10: {np.max(np.abs(vd / vt - 1)):.2e}")
    assert np.max(np.abs(vd / vt - 1)) < 1e-2
    monkeypatch.setattr(NystromPreconditioner, "galerkin", lambda self, X, R: (X, R))
    plain = SampledLLAClassifier(net, tol=1e-10, **kw).fit(X, y)
    plain_default = SampledLLAClassifier(net, **kw).fit(X, y)
    print(f"[sampled cnn] iterations to 1e-3 / 1e-10: Galerkin start {default.n_iter_[-1]} / "
          f"{tight.n_iter_[-1]}, without {plain_default.n_iter_[-1]} / {plain.n_iter_[-1]}")
    assert default.n_iter_[-1] <= plain_default.n_iter_[-1]
    assert tight.n_iter_[-1] <= plain.n_iter_[-1]
    # the same solution from either start (to the float32 products' rounding)
    vp = np.trace(_cov(plain, Xt)[1], axis1=1, axis2=2)
    np.testing.assert_allclose(vt, vp, rtol=1e-5)


def test_scaled_tangents_equal_the_one_shot_cast():
    # (V * sigma).to(dtype) made a few rows at a time, from a strided view too: the
    # same values as the one-shot expression, contiguous.
    from sklearn_lla._posteriors._sampled_passes import scaled_tangents

    g = torch.Generator().manual_seed(0)
    Q = torch.randn(301, 19, dtype=torch.float64, generator=g)
    sigma = torch.rand(301, dtype=torch.float64, generator=g) + 0.1
    for dtype in (torch.float32, torch.float64):
        out = scaled_tangents(Q.T, sigma, dtype, rows=4)
        assert out.is_contiguous() and out.dtype == dtype
        assert torch.equal(out, (Q.T.contiguous() * sigma).to(dtype))


def test_final_e_step_lets_go_of_the_sketch_with_the_same_samples(cnn_cases, monkeypatch):
    # The fit's last E-step makes its right-hand sides in S's storage and drops the
    # perturbations and the sketch's test matrix once used (peak memory on large
    # nets): the samples are bit for bit those of an E-step that keeps them all.
    from sklearn_lla._posteriors._sampled_estep import ESteps

    X, y, _, net = cnn_cases["classification"]
    kw = dict(n_posterior_samples=8, random_state=0, device="cpu")
    states = []
    e_step = ESteps._e_step

    def record(self, st, *args, **kwargs):
        out = e_step(self, st, *args, **kwargs)
        states.append((kwargs.get("final", False), st.precond, st.S, st.eps0))
        return out

    monkeypatch.setattr(ESteps, "_e_step", record)
    dropped = SampledLLAClassifier(net, **kw).fit(X, y)
    assert states[-1] == (True, None, None, None)
    monkeypatch.setattr(ESteps, "_e_step", lambda self, *a, final=False, **k:
                        e_step(self, *a, **k))
    kept = SampledLLAClassifier(net, **kw).fit(X, y)
    assert torch.equal(dropped.posterior_.samples, kept.posterior_.samples)


def test_dense_view_of_the_flat_tangents_is_the_gathered_copy(cnn_cases, monkeypatch):
    # Kept-row passes multiply a chunk's dense block by a view of the flat tangents
    # (no per-chunk gather) when its parameters are one run of the flat layout: the
    # view is used on this CNN, and the samples are bit for bit those of the gather.
    from sklearn_lla._posteriors._sampled_passes import BatchRows

    X, y, _, net = cnn_cases["classification"]
    kw = dict(n_posterior_samples=8, random_state=0, device="cpu")
    view = BatchRows._dense_view
    used = []

    def record(self, R, T):
        out = view(self, R, T)
        if out is not None:
            assert torch.equal(out, R.dense_directions(self.lin.unflatten(T)))
        used.append(out is not None)
        return out

    monkeypatch.setattr(BatchRows, "_dense_view", record)
    a = SampledLLAClassifier(net, **kw).fit(X, y)
    assert any(used)
    monkeypatch.setattr(BatchRows, "_dense_view", lambda self, R, T: None)
    b = SampledLLAClassifier(net, **kw).fit(X, y)
    assert torch.equal(a.posterior_.samples, b.posterior_.samples)
