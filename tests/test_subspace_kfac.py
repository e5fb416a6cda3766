"""Subspace Laplace's one KFAC (sklearn_lla._posteriors.subspace_kfac) against curvlinops'.

* the projector's KFAC read from the KFAC complement's layer factors is curvlinops'
  KFAC (type-2, expand) plus the exact BatchNorm diagonal to round-off, on the tiny
  BatchNorm / residual CNN (graph backend) and on an MLP (structured backend), for
  both likelihoods: the same eigenvalues, the same ``Psi_approx T``;
* the range finder in the Kronecker eigenbases (rows rotated once) finds the same
  eigenvalues and span as the one in the parameters' layout with the same ``Psi``
  (dense and randomized, several chunkings);
* the training rows kept from the KFAC pass give the same fit as a GGN pass of its own.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from sklearn_lla._core.likelihoods import Categorical, Gaussian
from sklearn_lla._core.protocol import FitData
from sklearn_lla._network.curvature import KFAC
from sklearn_lla._network.linearized import LinearizedNet
from sklearn_lla._posteriors import subspace_kfac
from sklearn_lla._posteriors.subspace import lowrank_directions
from sklearn_lla._posteriors.subspace_kfac import LayerKFAC
from sklearn_lla.subspace import SubspaceLaplaceClassifier, SubspaceLaplaceRegressor

S0, S2 = 0.7, 0.02


def _problem(kind, task, request, dtype=torch.float64):
    """``(lin, FitData, X)`` of a float64 (or ``dtype``) copy of the tiny CNN or of an MLP."""
    if kind == "cnn":
        X, y, _, net = request.getfixturevalue("cnn_cases")[task]
        C = 3 if task == "classification" else 1
    else:
        data = request.getfixturevalue("clf_data" if task == "classification" else "reg_data")
        net = request.getfixturevalue("clf_net" if task == "classification" else "reg_net")
        X, y, C = data.X, data.y, (3 if task == "classification" else 1)
    m = copy.deepcopy(net.module_).to(dtype).eval()
    X = np.asarray(X, dtype=torch.empty(0, dtype=dtype).numpy().dtype)
    lin = LinearizedNet(m, example_input=torch.as_tensor(X[:4]))
    lik = Categorical(C) if task == "classification" else Gaussian(S2, 1)
    yt = torch.as_tensor(y) if task == "classification" else torch.as_tensor(
        np.asarray(y, dtype=np.float64).reshape(-1, 1))
    return lin, FitData(lin, lik, X, yt, batch_size=16), X


@pytest.mark.parametrize("task", ["classification", "regression"])
@pytest.mark.parametrize("kind", ["cnn", "mlp"])
def test_layer_kfac_is_curvlinops_kfac(kind, task, request):
    lin, fd, _ = _problem(kind, task, request)
    assert lin.backend == ("graph" if kind == "cnn" else "structured")
    ours, ref = LayerKFAC(lin, fd), KFAC(lin, fd)
    assert ours.description == ref.description
    if kind == "cnn":
        assert "BatchNorm2d" in ours.description
        assert ours.diag_names == ref.diag_names
        np.testing.assert_allclose(ours.diag.numpy(), ref.diag.numpy(), rtol=1e-10,
                                   atol=1e-14 * float(ref.diag.max()))
    a, b = np.sort(ours.eigvals()), np.sort(ref.eigvals())
    np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-12 * b.max())
    s2 = S2 if task == "regression" else None
    T = torch.randn(lin.n_params, 5, dtype=torch.float64,
                    generator=torch.Generator().manual_seed(0))
    got, want = ours.inverse(S0, s2)(T), ref.inverse(S0, s2)(T)
    np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-8,
                               atol=1e-10 * float(want.abs().max()))
    # the rotated layout is an orthogonal change of basis
    np.testing.assert_allclose(ours.unrotate(ours.rotate(T)).numpy(), T.numpy(), atol=1e-12)
    np.testing.assert_allclose(torch.linalg.norm(ours.rotate(T), dim=0).numpy(),
                               torch.linalg.norm(T, dim=0).numpy(), rtol=1e-12)


@pytest.mark.parametrize("row_space", [True, False])
@pytest.mark.parametrize("kind", ["cnn", "mlp"])
def test_rotated_range_finder_matches_the_parameters_layout(kind, row_space, request,
                                                            monkeypatch):
    """The same ``Psi`` as a plain map (the network's own JVP / VJP passes, parameters'
    layout) and as a LayerKFAC's (rows rotated into the Kronecker eigenbases once, kept
    or recomputed per product): the same eigenvalues and span, dense and randomized."""
    lin, fd, X = _problem(kind, "classification", request)
    kfac = LayerKFAC(lin, fd)
    psi = kfac.inverse(S0)
    plain = lambda T: psi(T)  # noqa: E731 - no .passes: the parameters' layout
    Xs = torch.as_tensor(X[:40])
    kw = dict(row_space=row_space)
    for method, s in (("dense", 12), ("randomized", 6)):
        gen = dict(generator=torch.Generator().manual_seed(0)) if method == "randomized" else {}
        V0, l0 = lowrank_directions(lin, Xs, 3, plain, s, method=method, **kw,
                                    **({} if not gen else
                                       dict(generator=torch.Generator().manual_seed(0))))
        for bs in (1000, 7):
            for budget in (2**25, 0):  # rotated rows kept / recomputed per product
                monkeypatch.setattr(subspace_kfac, "ROTATED_ROWS_ELEMENTS", budget)
                V1, l1 = lowrank_directions(
                    lin, Xs, 3, psi, s, batch_size=bs, method=method, **kw,
                    **({} if not gen else dict(generator=torch.Generator().manual_seed(0))))
                np.testing.assert_allclose(l1.numpy(), l0.numpy(), rtol=1e-9)
                np.testing.assert_allclose(torch.linalg.svdvals(V1 @ V0.T).numpy(), 1.0,
                                           atol=1e-8)


@pytest.mark.parametrize("task", ["classification", "regression"])
def test_rows_kept_from_the_kfac_pass_give_the_same_fit(task, request, monkeypatch):
    """The default on the graph backend keeps the training rows of the KFAC pass for
    the GGN of the features (no second pass); without room for them (budget 0) the
    GGN is a pass of its own: the same posterior."""
    from sklearn_lla._posteriors import glm

    X, y, Xt, net = request.getfixturevalue("cnn_cases")[task]
    m = copy.deepcopy(net.module_).double()
    X, Xt = X.astype(np.float64), Xt.astype(np.float64)
    cls = SubspaceLaplaceClassifier if task == "classification" else SubspaceLaplaceRegressor
    calls = []
    orig = glm.ggn_statistics
    monkeypatch.setattr(glm, "ggn_statistics", lambda *a: calls.append(1) or orig(*a))
    outs = []
    for budget in (2**26, 0):
        monkeypatch.setattr(subspace_kfac, "ROW_CACHE_ELEMENTS", budget)
        est = cls(copy.deepcopy(m), device="cpu", random_state=0).fit(X, y)
        assert est.jacobian_backend_ == "graph"
        assert est.residual_correction_ == "kfac"
        assert bool(calls) == (budget == 0)  # the GGN's own pass only without the rows
        outs.append((est, est.predict_proba(Xt) if task == "classification"
                     else np.stack(est.predict(Xt, return_std=True))))
    (a, pa), (b, pb) = outs
    assert a.prior_variance_ == pytest.approx(b.prior_variance_, rel=1e-10)
    np.testing.assert_allclose(pa, pb, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("row_space", [True, False])
@pytest.mark.parametrize("kind", ["cnn", "mlp"])
def test_rotated_range_finder_of_a_float32_net(kind, row_space, request):
    """The rotated rows and their products run in the network's dtype (float32 here)
    and are summed in float64: the eigenvalues and span of a float32 net's range finder
    are the float64 net's to float32 round-off (measured: eigenvalues within 1.2e-7
    relative, span cosines within 3e-13 of 1; the tolerances leave a factor 10-1000)."""
    lin64, fd64, X = _problem(kind, "classification", request)
    lin32, fd32, _ = _problem(kind, "classification", request, torch.float32)
    assert lin32.dtype == torch.float32 and lin32.backend == lin64.backend
    Xs = torch.as_tensor(X[:40])
    out = []
    for lin, fd in ((lin64, fd64), (lin32, fd32)):
        psi = LayerKFAC(lin, fd).inverse(S0)
        out.append([lowrank_directions(lin, Xs, 3, psi, s, method=method, row_space=row_space,
                                       generator=torch.Generator().manual_seed(0))
                    for method, s in (("dense", 12), ("randomized", 6))])
    for (V0, l0), (V1, l1) in zip(*out):
        assert V1.dtype == l1.dtype == torch.float64
        np.testing.assert_allclose(l1.numpy(), l0.numpy(), rtol=2e-6)
        np.testing.assert_allclose(torch.linalg.svdvals(V1 @ V0.T).numpy(), 1.0, atol=1e-10)


@pytest.mark.parametrize("task", ["classification", "regression"])
def test_fit_statistic_from_the_kept_rows(task, request, monkeypatch):
    """The projector's data fit (log likelihood / residual sum of squares) read from the
    outputs of the training rows the KFAC pass kept equals a forward pass's, to
    round-off (a different chunking of the same sum)."""
    from sklearn_lla._posteriors.subspace import SubspacePosterior

    X, y, _, net = request.getfixturevalue("cnn_cases")[task]
    m = copy.deepcopy(net.module_).double()
    cls = SubspaceLaplaceClassifier if task == "classification" else SubspaceLaplaceRegressor
    orig, seen = SubspacePosterior._fit_statistic, []

    def both(self, lin, data):
        kept = orig(self, lin, data)
        rows, self._kfac_rows = self._kfac_rows, None
        seen.append((rows is not None, kept, orig(self, lin, data)))
        self._kfac_rows = rows
        return kept

    monkeypatch.setattr(SubspacePosterior, "_fit_statistic", both)
    kw = {} if task == "classification" else dict(noise_variance="auto")
    cls(m, device="cpu", random_state=0, **kw).fit(X.astype(np.float64), y)
    assert seen and all(k for k, _, _ in seen)
    for _, kept, fwd in seen:
        assert kept == pytest.approx(fwd, rel=1e-12)
