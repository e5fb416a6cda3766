"""The shared minibatch optimisation loop (sklearn_lla._optim)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from sklearn.exceptions import ConvergenceWarning

from sklearn_lla._likelihoods import Gaussian
from sklearn_lla._optim import minibatches, minimize
from sklearn_lla._protocol import FitData


class _Lin:  # FitData only needs the device and dtype of the network here
    device = torch.device("cpu")
    dtype = torch.float64


def _data(n=200, seed=0):
    rng = np.random.RandomState(seed)
    X = rng.randn(n, 3)
    y = torch.as_tensor(X @ np.array([1.0, -2.0, 0.5]) + 0.1 * rng.randn(n)).reshape(-1, 1)
    return FitData(_Lin(), Gaussian(1.0), X, y)


def _loss(w):
    def f(batch):
        x, y = batch
        return ((x @ w - y[:, 0]) ** 2).mean()
    return f


def test_minibatches_cover_every_row_each_epoch():
    d = _data(50)
    it = minibatches(d, 10, torch.Generator().manual_seed(0))
    seen = np.concatenate([next(it)[0][:, 0].numpy() for _ in range(5)])
    np.testing.assert_array_equal(np.sort(seen), np.sort(d.X[:, 0]))
    a = [next(minibatches(d, 10, torch.Generator().manual_seed(3)))[0] for _ in range(2)]
    torch.testing.assert_close(a[0], a[1], rtol=0, atol=0)


def test_converges_to_least_squares():
    d = _data()
    w = torch.zeros(3, dtype=torch.float64, requires_grad=True)
    res = minimize(_loss(w), [w], minibatches(d, 32, torch.Generator().manual_seed(0)),
                   max_iter=3000, lr=5e-2)
    want = np.linalg.lstsq(d.X, d.y.numpy()[:, 0], rcond=None)[0]
    np.testing.assert_allclose(w.detach().numpy(), want, atol=0.03)
    assert res.n_iter == 3000 and res.best_iter == 3000 and len(res.loss_history) == 3000


def test_early_stopping_restores_the_best_state():
    d = _data()
    w = torch.zeros(3, dtype=torch.float64, requires_grad=True)
    target = torch.tensor([0.5, -1.0, 0.2], dtype=torch.float64)
    # the validation score is best half-way to the least-squares solution
    seen = []

    def validation():
        seen.append(w.detach().clone())
        return float(((w - target) ** 2).sum())

    res = minimize(_loss(w), [w], minibatches(d, 32, torch.Generator().manual_seed(0)),
                   max_iter=5000, lr=2e-2, validation=validation, validation_freq=10,
                   n_iter_no_change=3)
    assert res.stopped_early and res.n_iter < 5000
    scores = [s for _, s in res.validation_history]
    best = int(np.argmin(scores))
    assert res.best_iter == res.validation_history[best][0]
    torch.testing.assert_close(w.detach(), seen[best], rtol=0, atol=0)
    assert len(scores) == best + 1 + 3


def test_non_finite_loss_is_a_clear_error():
    d = _data()
    w = torch.zeros(3, dtype=torch.float64, requires_grad=True)
    with pytest.raises(FloatingPointError, match="not finite at step 1"):
        minimize(lambda b: (w * float("nan")).sum(), [w],
                 minibatches(d, 8, torch.Generator()), max_iter=5, desc="test")


def test_convergence_warnings():
    d = _data()
    w = torch.zeros(3, dtype=torch.float64, requires_grad=True)
    with pytest.warns(ConvergenceWarning, match="max_iter"):
        minimize(_loss(w), [w], minibatches(d, 32, torch.Generator()), max_iter=40, lr=1e-3)
    w2 = torch.zeros(3, dtype=torch.float64, requires_grad=True)
    with pytest.warns(ConvergenceWarning, match="still improving"):
        minimize(_loss(w2), [w2], minibatches(d, 32, torch.Generator()), max_iter=40, lr=1e-3,
                 validation=lambda: float(((w2 - 1) ** 2).sum()), validation_freq=10)
    w3 = torch.zeros(3, dtype=torch.float64, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        minimize(_loss(w3), [w3], minibatches(d, 32, torch.Generator()), max_iter=3000,
                 lr=5e-2)
