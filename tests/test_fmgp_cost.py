"""FMGP's cost structure: what each training step runs, and that it changes no number.

* the training rows' network outputs ``g(x)`` and features ``psi(x)``, computed once
  (``FMGPPosterior.cached_rows``), give the same minibatch losses and gradients as a
  forward pass per step (``FEATURE_CACHE_BYTES = 0``), to float64 round-off;
* with the cache and free inducing features (the default) the Adam loop runs no
  network pass at all; with ``inducing_features="network"`` it runs one per step at
  ``Z`` (and none at the minibatch);
* free inducing features start at ``psi(Z)``: the kernel of the rows ``[z, psi(z)]``
  equals the kernel of the inputs ``z`` (the ``"network"`` form), and the fitted
  ``inducing_inputs_`` / ``inducing_features_`` split them.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import sklearn_lla._posteriors.fmgp as fmgp_mod
import sklearn_lla._posteriors.gp as gp_mod
from sklearn_lla import FMGPClassifier, FMGPRegressor
from sklearn_lla.kernels import ClassificationKernel

F64 = torch.float64
CALLS = {"rows": 0}


class _Counted(nn.Module):
    """A float64 tanh MLP that counts the rows it is evaluated on."""

    def __init__(self, d_in, d_out, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.body = nn.Sequential(nn.Linear(d_in, 16), nn.Tanh())
        self.head = nn.Linear(16, d_out)
        self.double()

    def forward(self, x):
        CALLS["rows"] += x.shape[0]
        return self.head(self.body(x))


def _data(task, n=230, seed=0):
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n, 3))
    if task == "regression":
        return X, np.sin(X[:, 0]) + 0.1 * rng.normal(size=n)
    return X, (X[:, 0] + 0.5 * X[:, 1] > 0).astype(int) + (X[:, 2] > 1).astype(int)


def _record(monkeypatch, n_batches=4):
    """Replace the engine's Adam loop by: loss and gradients on ``n_batches`` batches at
    the starting state (no step taken), the rows the network saw meanwhile, then one
    real step so that ``fit`` completes."""
    real = gp_mod.minimize
    out = {}

    def fake(loss_fn, params, batches, **kw):
        losses, grads = [], []
        CALLS["rows"] = 0
        for _ in range(n_batches):
            for p in params:
                p.grad = None
            loss = loss_fn(next(batches))
            loss.backward()
            with torch.no_grad():  # no step, but a new version, as after a step
                for p in params:
                    p.add_(0.0)
            losses.append(float(loss.detach()))
            grads.append([p.grad.detach().clone() if p.grad is not None else None
                          for p in params])
        out.update(losses=losses, grads=grads, rows=CALLS["rows"])
        kw.update(max_iter=1, early_stopping=False, validation=None)
        return real(loss_fn, params, batches, **kw)

    monkeypatch.setattr(gp_mod, "minimize", fake)
    return out


def _fit(task, monkeypatch, *, budget=None, **kw):
    if budget is not None:
        monkeypatch.setattr(fmgp_mod, "FEATURE_CACHE_BYTES", budget)
    X, y = _data(task)
    cls = FMGPRegressor if task == "regression" else FMGPClassifier
    net = _Counted(3, 1 if task == "regression" else 3)
    rec = _record(monkeypatch)
    est = cls(net, n_inducing=9, batch_size=50, random_state=0, device="cpu", **kw).fit(X, y)
    monkeypatch.undo()
    return est, rec


@pytest.mark.parametrize("task,kernel", [("regression", None), ("classification", "free"),
                                         ("classification", "network")])
def test_cached_rows_give_the_per_step_losses_and_gradients(monkeypatch, task, kernel):
    # learned inducing pairs (not the classifier's default): the loop then differentiates
    # at Z, through the network when psi is tied to it
    kw = {} if kernel is None else {"kernel": ClassificationKernel(inducing_features=kernel),
                                    "learn_inducing": True}
    cached, rec_c = _fit(task, monkeypatch, **kw)
    per_step, rec_s = _fit(task, monkeypatch, budget=0, **kw)
    assert cached.posterior_.cached_rows == 230 and per_step.posterior_.cached_rows == 0
    # early stopping's rule of diminishing returns: classification only
    assert cached.posterior_.progress_tol == (0.0 if task == "regression"
                                              else fmgp_mod.PROGRESS_TOL)
    # float64 network: the cache holds the very numbers a forward pass of the batch
    # gives, up to the row blocking of the matrix products (round-off)
    np.testing.assert_allclose(rec_c["losses"], rec_s["losses"], rtol=1e-12)
    for gc, gs in zip(rec_c["grads"], rec_s["grads"]):
        assert len(gc) == len(gs)
        for a, b in zip(gc, gs):
            assert (a is None) == (b is None)
            if a is not None:
                np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-10,
                                           atol=1e-12 * float(b.abs().max()))
    # what the loop ran: per step a forward pass of the batch (50 rows) without the
    # cache; with it none, unless psi is tied to the network at Z (9 rows per step)
    at_z = 9 if kernel == "network" else 0
    assert rec_s["rows"] == 4 * (50 + at_z)
    assert rec_c["rows"] == 4 * at_z
    # the fits agree (the same batches, the same steps)
    X, _ = _data(task, 40, seed=1)
    out_c = cached.predict(X, return_std=True) if task == "regression" else \
        cached.predict_proba(X)
    out_s = per_step.predict(X, return_std=True) if task == "regression" else \
        per_step.predict_proba(X)
    np.testing.assert_allclose(np.asarray(out_c), np.asarray(out_s), rtol=1e-8)


def test_free_inducing_features_start_at_the_network_and_split_when_fitted():
    X, y = _data("classification")
    net = _Counted(3, 3)
    clf = FMGPClassifier(net, n_inducing=9, max_iter=30, early_stopping=False, device="cpu",
                         learn_inducing=True, random_state=0).fit(X, y)
    k = clf.kernel_
    assert k.inducing_features == "free"
    Z, cz = torch.as_tensor(clf.inducing_inputs_), torch.as_tensor(clf.inducing_outputs_)
    F = clf.inducing_features_.shape[1]
    assert clf.inducing_inputs_.shape == (9, 3) and F == 16
    # the lift starts each inducing point at psi(z): the two forms give one kernel
    lifted = k.lift_inducing(Z)
    assert lifted.shape == (9, 3 + F)
    with torch.no_grad():
        psi = net.body(Z)
    np.testing.assert_allclose(lifted[:, 3:].numpy(), psi.numpy(), rtol=1e-14)
    np.testing.assert_allclose(k.gram(lifted, cz).detach().numpy(),
                               k.gram(Z, cz).detach().numpy(), rtol=1e-13)
    Xq = torch.as_tensor(X[:7])
    np.testing.assert_allclose(k.cross(Xq, lifted, cz).detach().numpy(),
                               k.cross(Xq, Z, cz).detach().numpy(), rtol=1e-13)
    # the fitted psi_m moved away from psi(z_m) (they are learned)
    assert not np.allclose(clf.inducing_features_, psi.numpy(), rtol=1e-3)
    with pytest.raises(ValueError, match="inducing_features"):
        FMGPClassifier(net, kernel=ClassificationKernel(inducing_features="nope"),
                       device="cpu").fit(X, y)



def _class_kernel(delta, C=3, D=4, F=5, seed=0):
    """An initialised ClassificationKernel on a tiny float64 net, with a non-trivial
    output covariance ``B`` and length scales."""
    from sklearn_lla._network.linearized import LinearizedNet

    torch.manual_seed(seed)
    module = nn.Sequential(nn.Linear(D, F), nn.Tanh(), nn.Linear(F, C)).double()
    X = torch.randn(40, D, dtype=F64)
    k = ClassificationKernel(delta=delta).initialize(
        X, None, n_outputs=C, task="classification", net=LinearizedNet(module, example_input=X))
    with torch.no_grad():
        k.L_B.copy_(torch.eye(C, dtype=F64) + 0.3 * torch.randn(C, C, dtype=F64).tril())
        k.log_length_scale.add_(0.2 * torch.randn(D, dtype=F64))
        k.log_amplitude.fill_(0.4)
    return k, X


@pytest.mark.parametrize("delta", ["class", "input"])
@pytest.mark.parametrize("cz", [[0, 0, 0, 1, 1, 1, 2, 2, 2],  # k-means' order, equal shares
                                [2, 0, 1, 0, 2, 2, 1, 0, 2, 2]])  # shuffled, unequal shares
def test_factored_cross_is_the_dense_cross(delta, cz):
    """``ClassCross`` multiplies like the dense ``Kxz`` of ``kernel.batch``: the (B, C, M)
    tensor itself, its products with a matrix and a vector, and the step's ``Kzz`` and
    ``Kxx``, in float64 round-off; ``delta="input"`` with a batch row equal to an
    inducing input (the ``[x = z]`` term)."""
    from sklearn_lla._posteriors.fmgp_cross import class_groups, factored_batch

    k, X = _class_kernel(delta)
    cz = torch.tensor(cz)
    M = len(cz)
    Z = k.lift_inducing(X[5:5 + M])
    x = torch.cat([X[20:26], X[5:6]])  # the last row is inducing input 0
    groups = class_groups(cz, 3)
    assert (groups is None) == (M == 9)
    Kzz, cross, Kxx = factored_batch(k, x, Z, cz, groups)
    Kzz0, Kxz0, Kxx0 = k.batch(x, Z, cz)
    assert cross.shape == tuple(Kxz0.shape)
    tight = dict(rtol=1e-13, atol=1e-14)
    torch.testing.assert_close(Kzz, Kzz0, **tight)
    torch.testing.assert_close(Kxx, Kxx0, **tight)
    torch.testing.assert_close(cross.dense(), Kxz0, **tight)
    T = torch.randn(M, 4, dtype=F64)
    a = torch.randn(M, dtype=F64)
    torch.testing.assert_close(cross @ T, Kxz0 @ T, **tight)
    torch.testing.assert_close(cross @ a, Kxz0 @ a, **tight)
    # a subclass (which may change the formula) is not factored
    sub = type("Sub", (ClassificationKernel,), {})()
    sub.__dict__.update(k.__dict__)
    assert factored_batch(sub, x, Z, cz, groups) is None


@pytest.mark.parametrize("kw", [{}, {"n_inducing": 10},  # padded (unequal) class groups
                                {"learn_inducing": True},  # free inducing features
                                {"kernel": ClassificationKernel(delta="input")},
                                {"kernel": ClassificationKernel(inducing_features="network"),
                                 "learn_inducing": True},
                                {"energy_link": "mc"}])
def test_factored_steps_give_the_dense_steps_losses_and_gradients(monkeypatch, kw):
    """The factored cross covariances and the variance-only energy
    (``FACTORED_STEPS``) change no number of a training step: the losses and every
    gradient of the dense step (``kernel.batch``, full ``C x C`` blocks) to float64
    round-off, and the fits agree."""
    energy_link = kw.pop("energy_link", None)
    kw = {"n_inducing": 9, **kw}
    if energy_link is not None:  # the Monte Carlo energy reads the full blocks
        kw["alpha"] = 0.5
    fits = {}
    for factored in (True, False):
        monkeypatch.setattr(fmgp_mod, "FACTORED_STEPS", factored)
        X, y = _data("classification")
        rec = _record(monkeypatch)
        est = FMGPClassifier(_Counted(3, 3), batch_size=50, random_state=0, device="cpu",
                             **kw).fit(X, y)
        monkeypatch.undo()
        fits[factored] = (est, rec)
    (fe, fr), (de, dr) = fits[True], fits[False]
    np.testing.assert_allclose(fr["losses"], dr["losses"], rtol=1e-12)
    for gf, gd in zip(fr["grads"], dr["grads"]):
        for a, b in zip(gf, gd):
            assert (a is None) == (b is None)
            if a is not None:
                np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-9,
                                           atol=1e-12 * float(b.abs().max()))
    Xq, _ = _data("classification", 40, seed=1)
    np.testing.assert_allclose(fe.predict_proba(Xq), de.predict_proba(Xq), rtol=1e-8)


@pytest.mark.parametrize("budget,gather", [(None, None), (None, 120), (0, None)])
def test_training_batches_are_the_streams_minibatches(monkeypatch, budget, gather):
    """With the cache, the loop's batches come from the cached inputs and targets: the
    very batches (values and order) of ``data.minibatches`` from the same generator
    state, over several epochs, also gathered in several chunks an epoch
    (``GATHER_ROWS``); without (``FEATURE_CACHE_BYTES = 0``) the stream's."""
    if budget is not None:
        monkeypatch.setattr(fmgp_mod, "FEATURE_CACHE_BYTES", budget)
    if gather is not None:
        monkeypatch.setattr(fmgp_mod, "GATHER_ROWS", gather)
    real = gp_mod.minimize
    seen = {}

    def fake(loss_fn, params, batches, **kw):
        data = loss_fn.__self__.data
        g = torch.Generator()
        g.set_state(data.generator.get_state())
        ref = data.minibatches(50, g)
        seen["xy"] = getattr(loss_fn.__self__.post, "_xy_cache", None) is not None
        for _ in range(12):  # 4 batches an epoch (230 rows, the last 30 dropped)
            (x, y), (xr, yr) = next(batches), next(ref)
            torch.testing.assert_close(x, xr, rtol=0, atol=0)
            torch.testing.assert_close(y, yr, rtol=0, atol=0)
        kw.update(max_iter=1, early_stopping=False, validation=None)
        return real(loss_fn, params, batches, **kw)

    monkeypatch.setattr(gp_mod, "minimize", fake)
    X, y = _data("classification")
    FMGPClassifier(_Counted(3, 3), n_inducing=9, batch_size=50, random_state=0,
                   device="cpu").fit(X, y)
    assert seen["xy"] is (budget is None)


def test_spd_solve_has_autograds_gradients():
    """``spd_solve``'s closed-form backward gives autograd's gradients through the
    factorisation (the jittered Cholesky of the symmetrised matrix, then the solve),
    for the matrix and the right-hand side, to float64 round-off."""
    from sklearn_lla._core.linalg import cholesky
    from sklearn_lla._posteriors.gp_algebra import spd_solve

    torch.manual_seed(0)
    G = torch.randn(7, 9, dtype=F64)
    A0 = G @ G.T / 9 + 0.1 * torch.eye(7, dtype=F64)
    b0, w = torch.randn(7, dtype=F64), torch.randn(7, dtype=F64)
    grads = []
    for closed in (True, False):
        A, b = A0.clone().requires_grad_(), b0.clone().requires_grad_()
        if closed:
            x = spd_solve(A, b)
        else:
            x = torch.cholesky_solve(b.reshape(-1, 1), cholesky(A, warn=False)).reshape(-1)
        ((x * w).sum() + (x * x).sum()).backward()
        grads.append((x.detach(), A.grad, b.grad))
    for a, r in zip(*grads):
        torch.testing.assert_close(a, r, rtol=1e-12, atol=1e-12)
    # only the right-hand side requires a gradient
    b = b0.clone().requires_grad_()
    spd_solve(A0, b).sum().backward()
    torch.testing.assert_close(b.grad, torch.linalg.solve(A0, torch.ones(7, dtype=F64)),
                               rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("delta", ["class", "input"])
def test_prior_variances_are_the_prior_blocks_diagonal(delta):
    """``ClassificationKernel.prior_variances`` is the diagonal of ``prior_blocks`` (the
    kernel's ``diag_blocks``), the same numbers."""
    k, X = _class_kernel(delta)
    _, psi = k.features_(X[:6])
    blocks = k.prior_blocks(psi.double())
    torch.testing.assert_close(blocks, k.diag_blocks(X[:6]), rtol=0, atol=0)
    torch.testing.assert_close(k.prior_variances(psi.double()),
                               torch.diagonal(blocks, dim1=-2, dim2=-1), rtol=0, atol=0)


@pytest.mark.parametrize("kw,lean", [({}, True), ({"alpha": 0.5}, False),
                                     ({"kernel": ClassificationKernel(delta="input")}, True)])
def test_default_classifier_steps_run_the_factored_objective(monkeypatch, kw, lean):
    """The classifier's default step is ``FactoredObjective``'s lean loss (the probit
    energy at alpha = 1); the Monte Carlo energy (alpha = 0.5) runs the engine's loss."""
    from sklearn_lla._posteriors.fmgp_cross import FactoredObjective

    real = gp_mod.minimize
    seen = {}

    def fake(loss_fn, params, batches, **kw_):
        obj = loss_fn.__self__
        seen.update(kind=type(obj), lean=obj.lean, groups=obj.post._groups is not False)
        kw_.update(max_iter=2, early_stopping=False, validation=None)
        return real(loss_fn, params, batches, **kw_)

    monkeypatch.setattr(gp_mod, "minimize", fake)
    X, y = _data("classification")
    FMGPClassifier(_Counted(3, 3), n_inducing=9, batch_size=50, random_state=0,
                   device="cpu", **kw).fit(X, y)
    assert seen["kind"] is FactoredObjective and seen["groups"]
    assert seen["lean"] is lean
