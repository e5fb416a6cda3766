"""The CUDA path: every registered estimator fitted on a GPU gives the CPU's answer.

Skipped where ``torch.cuda.is_available()`` is false (CI has no GPU); run on a GPU
machine with ``pytest tests/test_cuda.py``. Random draws are made on the CPU
generator and moved to the device (``_base.py``, the posteriors), so a CUDA fit makes
the same draws as a CPU fit and the two may differ only by floating-point reduction
order: float64 on both sides, so the tolerances below are far from what a wrong
device path (a dropped term, a tensor left on the CPU, TF32) would produce.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from conftest import estimator_outputs

from sklearn_lla._registry import ESTIMATORS

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

REGISTRY = pytest.mark.parametrize("entry", ESTIMATORS, ids=[e.id for e in ESTIMATORS])

# Float64 everywhere: closed-form posteriors agree to rounding; the iterative fits
# (Adam on the variational / sample objectives, 40-100 steps in the test settings)
# carry the reduction-order differences through their steps. Measured on an H100
# (2026-11-26): at most 1.4e-7 relative (sampled LLA's regression std), closed forms
# within 3e-11, so 1e-6 has a 7 x margin.
RTOL, ATOL = 1e-6, 1e-9


def _max_rel(u, v):
    return float(np.max(np.abs(u - v) / (np.abs(u) + 1e-12)))


@REGISTRY
def test_cuda_matches_cpu(entry, case, record_property):
    X, y, Xt, net = case
    cpu = entry.make(net, device="cpu", random_state=0).fit(X, y)
    gpu = entry.make(net, device="cuda", random_state=0).fit(X, y)
    # the user's net stays where it was; the estimator's copy is on the GPU
    assert all(p.device.type == "cpu" for p in net.module_.parameters())
    assert gpu.linearized_net_.device.type == "cuda"
    assert cpu.linearized_net_.device.type == "cpu"
    assert gpu.prior_variance_ == pytest.approx(cpu.prior_variance_, rel=RTOL)
    for u, v in zip(estimator_outputs(cpu, Xt), estimator_outputs(gpu, Xt)):
        assert isinstance(v, np.ndarray) and v.dtype == u.dtype and v.shape == u.shape
        record_property("max_rel_diff", _max_rel(u, v))
        np.testing.assert_allclose(v, u, rtol=RTOL, atol=ATOL)


@REGISTRY
def test_cuda_float32_net(entry, case, record_property):
    """A float32 net on the GPU matches the float64 net on the CPU to the contract's
    1e-3 (the curvature algebra runs in float64 on the GPU too, and no TF32)."""
    X, y, Xt, net = case
    fixed = {"prior_variance": 0.5}
    if not entry.is_classifier:
        fixed["noise_variance"] = 0.05
    m64 = copy.deepcopy(net.module_).double()
    m32 = copy.deepcopy(net.module_).float()
    a = entry.make(m64, device="cpu", random_state=0, **fixed).fit(X, y)
    b = entry.make(m32, device="cuda", random_state=0, **fixed).fit(X.astype(np.float32), y)
    for u, v in zip(estimator_outputs(a, Xt), estimator_outputs(b, Xt.astype(np.float32))):
        record_property("max_rel_diff", _max_rel(u, v))
        np.testing.assert_allclose(v, u, rtol=1e-3, atol=1e-6)


@REGISTRY
def test_cuda_cnn_graph_backend_matches_cpu(entry, cnn_cases, record_property):
    """The graph backend (conv / BatchNorm / residual) on the GPU against the CPU, every
    registered estimator on the contract's tiny CNN: the same backend chosen and the
    same predictions (float32 convolutions: cuDNN and the CPU sum in other orders, so
    the tolerance is the float32 contract's 1e-3, not the float64 MLP's 1e-6)."""
    X, y, Xt, net = cnn_cases["classification" if entry.is_classifier else "regression"]
    cpu = entry.make(net, device="cpu", random_state=0, batch_size=25).fit(X, y)
    gpu = entry.make(net, device="cuda", random_state=0, batch_size=25).fit(X, y)
    assert (getattr(gpu, "jacobian_backend_", "graph") ==
            getattr(cpu, "jacobian_backend_", "graph") == "graph")
    for u, v in zip(estimator_outputs(cpu, Xt), estimator_outputs(gpu, Xt)):
        record_property("max_rel_diff", _max_rel(u, v))
        np.testing.assert_allclose(v, u, rtol=1e-3, atol=1e-5)


@pytest.mark.parametrize("panel_rows", [1, 2])
def test_cuda_graph_gram_in_panels(monkeypatch, panel_rows):
    """The graph backend's Gram built in panels on the GPU (the CPU's element budgets
    forced, a panel holding 7 or 14 of 20 rows: a GPU's own budget would hold them
    all) equals the dense float64 Gram made on the CPU, by itself and against a second
    set of points, to 1e-10."""
    from test_backends import _make, dense_jacobian

    from sklearn_lla._network.backends import graph
    from sklearn_lla._network.linearized import LinearizedNet

    net, x = _make("conv2d", torch.float64)
    x = torch.cat([x, 0.5 * x, -x, x + 0.1])  # 20 points
    x2 = x[:7] - 0.2
    J, J2 = dense_jacobian(net, x), dense_jacobian(net, x2)
    B, C, _ = J.shape
    idx = torch.arange(B) % C
    Ji, J2i = J[torch.arange(B), idx], J2[torch.arange(7), idx[:7]]
    lin = LinearizedNet(copy.deepcopy(net).cuda(), example_input=x.cuda())
    held = lin.jacobian_backend._held
    monkeypatch.setattr(graph, "device_budget", lambda elements, device: int(elements))
    monkeypatch.setattr(graph, "KERNEL_PANEL_ELEMENTS", 8 * panel_rows * held)
    xc, x2c, ic = x.cuda(), x2.cuda(), idx.cuda()
    for got, want in ((lin.kernel(xc, out1=ic), Ji @ Ji.T),
                      (lin.kernel(xc, x2c, out1=ic, out2=ic[:7]), Ji @ J2i.T)):
        assert got.device.type == "cuda" and got.dtype == torch.float64
        err = float((got.cpu() - want).abs().max() / want.abs().max())
        assert err <= 1e-10, err


@pytest.mark.filterwarnings("ignore::sklearn.exceptions.ConvergenceWarning")
def test_cuda_fused_fmgp_step_is_autograds():
    """FMGP's closed-form classification step on the GPU: 60 steps with it and with
    autograd give the same fitted state to 1e-8 (float64 net), and the CPU's."""
    import sklearn_lla._posteriors.fmgp_fused as fused_mod
    from sklearn_lla import FMGPClassifier

    rng = np.random.default_rng(0)
    X = rng.normal(size=(240, 5))
    y = (X[:, 0] > 0).astype(int) + 2 * (X[:, 1] + 0.3 * X[:, 2] > 0).astype(int)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(5, 16), torch.nn.Tanh(),
                              torch.nn.Linear(16, 4)).double()
    fits = []
    for device, fused in (("cuda", True), ("cuda", False), ("cpu", True)):
        fused_mod.FUSED_STEPS = fused
        try:
            fits.append(FMGPClassifier(net, n_inducing=12, learn_inducing=True,
                                       batch_size=60, max_iter=60, early_stopping=False,
                                       device=device, random_state=0).fit(X, y))
        finally:
            fused_mod.FUSED_STEPS = True
    a, b, c = (e.posterior_ for e in fits)
    for name in ("_L", "_Z", "q_mu"):
        torch.testing.assert_close(getattr(a, name), getattr(b, name), rtol=1e-8, atol=1e-10)
        torch.testing.assert_close(getattr(a, name).cpu(), getattr(c, name), rtol=1e-6,
                                   atol=1e-9)
    np.testing.assert_allclose(fits[0].predict_proba(X[:50]), fits[2].predict_proba(X[:50]),
                               rtol=1e-6, atol=1e-9)
