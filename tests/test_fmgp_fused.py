"""FMGP's classification step in closed form (``_posteriors/fmgp_fused.py``).

The fused step computes the loss of ``FactoredObjective`` and every parameter's
gradient without autograd's graph. Checked here against the autograd path
(``FUSED_STEPS = False``, itself checked against the dense step in
``test_fmgp_cost.py``) at a perturbed state, for the default settings and the
variants the fused step covers (learned inducing rows, unequal class groups, no
``Q*``, fixed length scales and amplitude); against central finite differences of
the loss itself; and over whole fits (the same steps give the same fitted state).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import sklearn_lla._posteriors.fmgp_fused as fused_mod
import sklearn_lla._posteriors.gp as gp_mod
from sklearn_lla import FMGPClassifier
from sklearn_lla.kernels import ClassificationKernel

F64 = torch.float64

pytestmark = [pytest.mark.filterwarnings("ignore:net .* looks untrained"),
              pytest.mark.filterwarnings("ignore::sklearn.exceptions.ConvergenceWarning")]


def _net(d_in=5, d_out=4, seed=0, dtype=F64):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(d_in, 16), nn.Tanh(), nn.Linear(16, d_out)).to(dtype)


def _data(n=240, seed=0):
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n, 5))
    y = (X[:, 0] > 0).astype(int) + 2 * (X[:, 1] + 0.3 * X[:, 2] > 0).astype(int)
    return X, y


def _capture(monkeypatch, body):
    """Run ``body(objective, params, batches)`` inside a fit, in place of its loop."""
    real = gp_mod.minimize
    seen = {}

    def fake(loss_fn, params, batches, **kw):
        seen["out"] = body(loss_fn.__self__, loss_fn, params, batches)
        kw.update(max_iter=1, early_stopping=False, validation=None)
        return real(loss_fn, params, batches, **kw)

    monkeypatch.setattr(gp_mod, "minimize", fake)
    return seen


def _perturb(params, seed=1, scale=0.05):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in params:
            p.add_(scale * torch.randn(p.shape, generator=g, dtype=p.dtype))


def _loss_and_grads(loss_fn, params, batch, fused):
    fused_mod.FUSED_STEPS = fused
    try:
        for p in params:
            p.grad = None
        loss = loss_fn(batch)
        loss.backward()
        return float(loss.detach()), [None if p.grad is None else p.grad.clone() for p in params]
    finally:
        fused_mod.FUSED_STEPS = True


@pytest.mark.parametrize("kw", [
    {},
    {"learn_inducing": True},
    {"n_inducing": 10, "learn_inducing": True},  # unequal (padded) class groups
    {"mean_regularizer": False},
    {"kernel": ClassificationKernel(learn_length_scale=False, learn_amplitude=False)},
])
def test_fused_step_has_autograds_loss_and_gradients(monkeypatch, kw):
    """At a perturbed state, the fused loss and every gradient equal autograd's through
    the factored loss to float64 round-off (relative 1e-10 of each gradient's size)."""

    def body(obj, loss_fn, params, batches):
        assert obj.fused
        _perturb(params)
        batch = next(batches)
        return _loss_and_grads(loss_fn, params, batch, True), _loss_and_grads(
            loss_fn, params, batch, False)

    seen = _capture(monkeypatch, body)
    X, y = _data()
    FMGPClassifier(_net(), **{"n_inducing": 12, **kw}, batch_size=60,
                   random_state=0).fit(X, y)
    (lf, gf), (la, ga) = seen["out"]
    assert lf == pytest.approx(la, rel=1e-13)
    for a, b in zip(gf, ga):
        assert (a is None) == (b is None)
        if b is not None:
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10 * float(b.abs().max()))


def test_fused_gradient_is_the_finite_difference_of_its_loss(monkeypatch):
    """``<grad, v>`` equals the central difference ``(f(p + h v) - f(p - h v)) / 2h`` of
    the fused loss along random directions (h = 1e-5, float64: agreement to ~1e-7)."""

    def body(obj, loss_fn, params, batches):
        _perturb(params)
        batch = next(batches)
        _, grads = _loss_and_grads(loss_fn, params, batch, True)
        g = torch.Generator().manual_seed(3)
        out = []
        for _ in range(3):
            v = [torch.randn(p.shape, generator=g, dtype=F64) for p in params]
            h = 1e-5
            with torch.no_grad():
                vals = []
                for sign in (1.0, -1.0):
                    for p, d in zip(params, v):
                        p.add_(sign * h * d)
                    vals.append(float(loss_fn(batch)))
                    for p, d in zip(params, v):
                        p.sub_(sign * h * d)
            fd = (vals[0] - vals[1]) / (2 * h)
            out.append((fd, float(sum((gr * d).sum() for gr, d in zip(grads, v)))))
        return out

    seen = _capture(monkeypatch, body)
    X, y = _data()
    FMGPClassifier(_net(), n_inducing=12, learn_inducing=True, batch_size=60,
                   random_state=0).fit(X, y)
    for fd, an in seen["out"]:
        assert an == pytest.approx(fd, rel=1e-6, abs=1e-9)


@pytest.mark.parametrize("dtype", [F64, torch.float32])
def test_fused_fits_are_the_autograd_fits(dtype):
    """The same 60 steps with the fused step and with autograd give the same fitted
    state (the factor, the kernel, ``q_mu``, the inducing rows) to 1e-8 and the same
    predictions, with a float64 and a float32 network."""
    X, y = _data()
    Xq, _ = _data(50, seed=1)
    fits = []
    for fused in (True, False):
        fused_mod.FUSED_STEPS = fused
        try:
            est = FMGPClassifier(_net(dtype=dtype), n_inducing=12, learn_inducing=True,
                                 batch_size=60, max_iter=60, early_stopping=False,
                                 random_state=0).fit(X, y)
        finally:
            fused_mod.FUSED_STEPS = True
        fits.append(est)
    a, b = (e.posterior_ for e in fits)
    for name in ("_L", "_Z", "q_mu"):
        torch.testing.assert_close(getattr(a, name), getattr(b, name), rtol=1e-8, atol=1e-10)
    for pa, pb in zip(a.kernel.parameters(), b.kernel.parameters()):
        torch.testing.assert_close(pa, pb, rtol=1e-8, atol=1e-10)
    np.testing.assert_allclose(fits[0].predict_proba(Xq), fits[1].predict_proba(Xq),
                               rtol=1e-8, atol=1e-12)


@pytest.mark.parametrize("kw,fused", [
    ({}, True),
    ({"kernel": ClassificationKernel(delta="input")}, False),
    ({"kernel": ClassificationKernel(inducing_features="network")}, False),
    ({"alpha": 0.5}, False),
])
def test_fused_step_runs_where_it_applies(monkeypatch, kw, fused):
    """The default classifier's step is the fused one; the kernel's other forms and
    the Monte Carlo energy keep the autograd step."""
    seen = _capture(monkeypatch, lambda obj, *a: obj.fused)
    X, y = _data()
    FMGPClassifier(_net(), n_inducing=12, batch_size=60, random_state=0, **kw).fit(X, y)
    assert seen["out"] is fused


@pytest.mark.parametrize("task,kw,want", [
    ("classification", {}, 3.0),  # KERNEL_LR_SCALE
    ("classification", {"kernel_lr_scale": 1.0}, None),
    ("regression", {}, None),
])
def test_kernel_learning_rate_scale(monkeypatch, task, kw, want):
    """Classification trains the kernel's hyperparameters at ``KERNEL_LR_SCALE`` times
    the learning rate and the factor / ``q_mu`` at the learning rate; regression keeps
    one learning rate."""
    from sklearn_lla._posteriors.fmgp import FMGPPosterior

    seen = {}
    real = gp_mod.minimize

    def fake(loss_fn, params, batches, **kw_):
        seen["scales"] = kw_.get("lr_scales")
        seen["kernel"] = {id(p) for p in loss_fn.__self__.kernel.parameters()}
        seen["ids"] = [id(p) for p in params]
        kw_.update(max_iter=1, early_stopping=False, validation=None)
        return real(loss_fn, params, batches, **kw_)

    monkeypatch.setattr(gp_mod, "minimize", fake)
    init = FMGPPosterior.__init__

    def patched(self, *a, **k):
        init(self, *a, **{**k, **kw})

    monkeypatch.setattr(FMGPPosterior, "__init__", patched)
    X, y = _data()
    if task == "regression":
        from sklearn_lla import FMGPRegressor

        FMGPRegressor(_net(d_out=1), n_inducing=12, batch_size=60,
                      random_state=0).fit(X, X[:, 0])
    else:
        FMGPClassifier(_net(), n_inducing=12, batch_size=60, random_state=0).fit(X, y)
    if want is None:
        assert seen["scales"] is None
        return
    assert seen["scales"] == [want if i in seen["kernel"] else 1.0 for i in seen["ids"]]
    assert seen["scales"].count(want) == len(seen["kernel"]) == 3  # log l, log a, L_B
