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
