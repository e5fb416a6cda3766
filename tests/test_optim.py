"""The shared minibatch optimisation loop (sklearn_lla._core.optim)."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch
from sklearn.exceptions import ConvergenceWarning

from sklearn_lla._core.likelihoods import Gaussian
from sklearn_lla._core.optim import improves, lr_factor, minibatches, minimize
from sklearn_lla._core.protocol import FitData


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


# ---------------------------------------------------------------------------------
# Learning-rate schedules (additive: the default stays a constant learning rate)
# ---------------------------------------------------------------------------------


def test_lr_factor_schedules():
    n = 101
    const = [lr_factor("constant", s, n) for s in range(1, n + 1)]
    assert const == [1.0] * n
    cos = np.array([lr_factor("cosine", s, n, final_factor=0.01) for s in range(1, n + 1)])
    np.testing.assert_allclose([cos[0], cos[50], cos[-1]], [1.0, 0.505, 0.01], rtol=1e-12)
    assert np.all(np.diff(cos) < 0)
    step = [lr_factor("step", s, 100) for s in (1, 50, 51, 75, 76, 100)]
    assert step == [1.0, 1.0, 0.1, 0.1, 0.01, 0.01]
    assert lr_factor(lambda s, m: s / m, 3, 4) == 0.75
    with pytest.raises(ValueError, match="lr_schedule"):
        lr_factor("linear", 1, 10)


def _displacement(schedule, max_iter=50, lr=0.1):
    """Adam on the linear loss ``w`` moves ``w`` by exactly ``lr_t`` per step (up to
    Adam's eps): the final ``-w`` is the sum of the learning rates actually used."""
    d = _data(40)
    w = torch.zeros(1, dtype=torch.float64, requires_grad=True)
    minimize(lambda b: w.sum(), [w], minibatches(d, 8, torch.Generator().manual_seed(0)),
             max_iter=max_iter, lr=lr, lr_schedule=schedule)
    return -float(w.detach())


@pytest.mark.filterwarnings("ignore::sklearn.exceptions.ConvergenceWarning")  # a linear loss
def test_schedule_sets_the_learning_rate_of_each_step():
    n, lr = 50, 0.1
    np.testing.assert_allclose(_displacement("constant", n, lr), n * lr, rtol=1e-6)
    want = lr * sum(lr_factor("cosine", s, n) for s in range(1, n + 1))
    np.testing.assert_allclose(_displacement("cosine", n, lr), want, rtol=1e-6)
    want = lr * sum(lr_factor("step", s, n) for s in range(1, n + 1))
    np.testing.assert_allclose(_displacement("step", n, lr), want, rtol=1e-6)
    # the default is unchanged for existing callers: a constant learning rate
    d = _data(40)
    w = torch.zeros(1, dtype=torch.float64, requires_grad=True)
    minimize(lambda b: w.sum(), [w], minibatches(d, 8, torch.Generator()), max_iter=n, lr=lr)
    np.testing.assert_allclose(-float(w.detach()), n * lr, rtol=1e-6)
    with pytest.raises(ValueError, match="lr_schedule"):
        _displacement("exponential")


@pytest.mark.filterwarnings("ignore::sklearn.exceptions.ConvergenceWarning")  # a linear loss
@pytest.mark.parametrize("schedule", ["constant", "cosine"])
@pytest.mark.parametrize("fused", [False, True])
def test_lr_scales_set_each_tensors_learning_rate(schedule, fused):
    """``lr_scales`` multiply the learning rate per tensor (with the schedule on top):
    on the linear loss each tensor moves by its own ``scale * lr_t`` per step."""
    n, lr = 30, 0.1
    d = _data(40)
    w = [torch.zeros(k, dtype=torch.float64, requires_grad=True) for k in (1, 2, 3)]
    minimize(lambda b: sum(t.sum() for t in w), w,
             minibatches(d, 8, torch.Generator().manual_seed(0)), max_iter=n, lr=lr,
             lr_schedule=schedule, fused=fused, lr_scales=[1.0, 3.0, 1.0])
    base = lr * sum(lr_factor(schedule, s, n) for s in range(1, n + 1))
    for t, f in zip(w, (1.0, 3.0, 1.0)):
        np.testing.assert_allclose(-t.detach().numpy(), f * base, rtol=1e-6)
    with pytest.raises(ValueError, match="lr_scales"):
        minimize(lambda b: w[0].sum(), w[:1], minibatches(d, 8, torch.Generator()),
                 max_iter=1, lr_scales=[1.0, 2.0])


@pytest.mark.filterwarnings("ignore::sklearn.exceptions.ConvergenceWarning")
def test_cosine_decay_settles_below_the_minibatch_noise_floor():
    # Minibatch least squares with a large learning rate: a constant rate hovers around
    # the solution at a distance set by the gradient noise; decaying it averages the
    # noise out (same seed, same batches).
    d = _data(400, seed=1)
    want = np.linalg.lstsq(d.X, d.y.numpy()[:, 0], rcond=None)[0]
    err = {}
    for schedule in ("constant", "cosine"):
        w = torch.zeros(3, dtype=torch.float64, requires_grad=True)
        minimize(_loss(w), [w], minibatches(d, 8, torch.Generator().manual_seed(0)),
                 max_iter=1500, lr=0.1, lr_schedule=schedule)
        err[schedule] = float(np.linalg.norm(w.detach().numpy() - want))
    print(f"\n[schedule] distance to least squares: {err}")
    assert err["cosine"] < 0.2 * err["constant"]


# ---------------------------------------------------------------------------------
# One tolerance, the objective as the monitored score, the start as a candidate
# ---------------------------------------------------------------------------------


def test_improves_is_relative_above_one_and_absolute_below():
    assert improves(0.5, math.inf, 0.0) and not improves(math.nan, 1.0, 0.0)
    assert not improves(math.inf, math.inf, 0.0)
    # |best| >= 1: relative
    assert improves(999.0, 1000.0, 1e-4) and not improves(999.95, 1000.0, 1e-4)
    # |best| < 1: absolute (a per-point NLL near zero is not held to a vanishing bar)
    assert improves(-0.0011, 0.0, 1e-3) and not improves(-0.0009, 0.0, 1e-3)
    assert improves(0.3, 0.3009, 1e-3) is False and improves(0.3, 0.3009, 1e-4)
    with pytest.raises(ValueError, match="tol"):
        minimize(lambda b: torch.zeros(()), [torch.zeros(1, requires_grad=True)],
                 iter([]), max_iter=1, tol=-1.0)


def test_tolerance_counts_small_gains_as_none_and_keeps_the_earlier_state():
    """A check that beats the best by less than ``tol`` counts as no improvement, and
    the state of the earlier (equally good) check is the one restored."""
    d = _data()
    w = torch.zeros(3, dtype=torch.float64, requires_grad=True)
    scores = iter([10.0, 5.0, 4.999, 4.998, 4.997, 1.0])
    seen = []

    def validation():
        seen.append(w.detach().clone())
        return next(scores)

    res = minimize(_loss(w), [w], minibatches(d, 32, torch.Generator().manual_seed(0)),
                   max_iter=100, lr=1e-2, validation=validation, validation_freq=5,
                   n_iter_no_change=3, tol=1e-3)
    assert res.stopped_early and res.best_iter == 10 and res.n_iter == 25
    torch.testing.assert_close(w.detach(), seen[1], rtol=0, atol=0)


def test_the_loss_as_monitored_score_stops_on_a_plateau():
    """``validation="loss"``: the window mean of the minibatch loss between checks; the
    run stops once it no longer falls by ``tol`` and restores the best check's state."""
    d = _data()
    w = torch.zeros(3, dtype=torch.float64, requires_grad=True)
    res = minimize(_loss(w), [w], minibatches(d, 32, torch.Generator().manual_seed(0)),
                   max_iter=20000, lr=5e-2, validation="loss", validation_freq=50,
                   n_iter_no_change=3, tol=1e-3)
    assert res.monitor == "loss" and res.stopped_early and res.n_iter < 20000
    h = np.asarray(res.loss_history)
    for step, score in res.validation_history:  # each score is its window's mean loss
        assert score == pytest.approx(h[max(0, step - 50):step].mean(), rel=1e-12)
    steps = [s for s, _ in res.validation_history]
    assert res.best_iter == steps[-4]  # three checks without progress after the best
    want = np.linalg.lstsq(d.X, d.y.numpy()[:, 0], rcond=None)[0]
    np.testing.assert_allclose(w.detach().numpy(), want, atol=0.05)
    with pytest.raises(ValueError, match="'loss'"):
        minimize(_loss(w), [w], minibatches(d, 32, torch.Generator()), max_iter=1,
                 validation="validation")


def test_check_start_restores_the_start_when_steps_only_make_things_worse():
    d = _data()
    w = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64, requires_grad=True)  # optimum
    start = w.detach().clone()

    def validation():
        return float(((w - start) ** 2).sum())

    # an objective pulling away from the start: every check is worse than step 0
    res = minimize(lambda b: -(w ** 2).sum(), [w], minibatches(d, 8, torch.Generator()),
                   max_iter=1000, lr=1e-2, validation=validation, validation_freq=10,
                   n_iter_no_change=2, check_start=True)
    assert res.validation_history[0] == (0, 0.0)
    assert res.best_iter == 0 and res.stopped_early and res.n_iter == 20
    torch.testing.assert_close(w.detach(), start, rtol=0, atol=0)


def test_progress_tol_stops_on_diminishing_returns():
    """A score creeping down by a constant 0.01 per check (an optimum at infinity) never
    stops the absolute rule; with ``progress_tol`` a check must beat the best by that
    fraction of the progress since the first check, so the count runs out once the
    steps are small next to the progress made."""
    from sklearn_lla._core.optim import Patience

    scores = [1.0, 0.5, 0.3, 0.2] + [0.2 - 0.01 * i for i in range(1, 40)]
    plain, diminishing = Patience(3, tol=1e-3), Patience(3, tol=1e-3, progress_tol=0.05)
    for s in scores:
        plain.update(s)
        diminishing.update(s)
        if diminishing.stop:
            break
    assert not plain.stop
    # progress at the best check (0.2) is 0.8: steps of 0.01 < 0.05 * 0.8 never count
    assert diminishing.stop and diminishing.best == 0.2
    assert diminishing.first == 1.0
    # a gain of more than the fraction restarts the count
    p = Patience(2, progress_tol=0.5)
    assert [p.update(s) for s in (1.0, 0.5, 0.4, 0.1)] == [True, True, False, True]


def test_n_iter_no_progress_stops_the_creep_sooner_with_the_same_best():
    """``n_iter_no_progress`` checks that only creep below the best (lower by ``tol``,
    not by the progress margin) stop the run; on a creep of shrinking gains (the
    objective's tail) the best is the one ``n_iter_no_change`` alone keeps. Checks
    that are no gain at all (noise) do not count as creep, and a real improvement
    restarts the count."""
    from sklearn_lla._core.optim import Patience

    scores = [1.0, 0.5, 0.3, 0.2] + [0.2 - 0.02 * (1 - 0.7 ** i) for i in range(1, 40)]
    slow = Patience(5, tol=1e-3, progress_tol=0.05)
    fast = Patience(5, tol=1e-3, progress_tol=0.05, n_iter_no_progress=2)
    stops = {}
    for i, s in enumerate(scores):
        for name, p in (("slow", slow), ("fast", fast)):
            if name not in stops:
                p.update(s)
                if p.stop:
                    stops[name] = i
    assert stops == {"fast": 5, "slow": 8}  # two creeping checks against five
    assert fast.best == slow.best == 0.2 and fast.creep == 2
    # noise (no gain by tol) is not creep; an improvement restarts the creep count
    p = Patience(5, tol=1e-3, progress_tol=0.5, n_iter_no_progress=2)
    out = [p.update(s) for s in (1.0, 0.5, 0.45, 0.6, 0.1, 0.09)]
    assert out == [True, True, False, False, True, False]
    assert (p.creep, p.bad, p.stop) == (1, 1, False)
    assert p.update(0.08) is False and p.stop
    # without it, creeping checks count towards n_iter_no_change only (as before)
    p = Patience(3, tol=1e-3, progress_tol=0.5)
    assert [p.update(s) for s in (1.0, 0.5, 0.45, 0.44)] == [True, True, False, False]
    assert not p.stop


def test_minimize_passes_n_iter_no_progress():
    """The loop stops on the first creeping check with ``n_iter_no_progress=1``: sooner
    than without, at a check that was below the best by less than the margin."""
    data = _data()
    runs = {}
    for k in (None, 1):
        w = torch.zeros(3, dtype=torch.float64, requires_grad=True)
        runs[k] = minimize(_loss(w), [w],
                           minibatches(data, 50, torch.Generator().manual_seed(0)),
                           max_iter=3000, lr=0.01, validation="loss", validation_freq=20,
                           n_iter_no_change=5, tol=1e-4, progress_tol=0.05,
                           n_iter_no_progress=k)
    fast, slow = runs[1], runs[None]
    assert fast.stopped_early and fast.n_iter < slow.n_iter
    hist = dict(fast.validation_history)
    first, best, last = hist[20], hist[fast.best_iter], hist[fast.n_iter]
    assert best - 1e-4 > last > best - 0.05 * (first - best)
    # the same steps up to the stop: the histories agree
    assert fast.validation_history == slow.validation_history[:len(fast.validation_history)]


@pytest.mark.filterwarnings("ignore::sklearn.exceptions.ConvergenceWarning")
@pytest.mark.parametrize("scales", [None, [1.0, 3.0, 0.5]])
def test_flat_adam_and_closed_form_gradients_take_torchs_adam_steps(scales):
    """``fused="flat"`` (FlatAdam on the concatenated tensors) and ``loss_and_grads``
    (gradients handed to the loop, no backward pass) take ``torch.optim.Adam``'s steps
    on a non-quadratic minibatch loss over three tensors, with and without per-tensor
    learning rates: the same iterates to round-off after 60 steps."""
    d = _data(64)
    torch.manual_seed(0)
    init = [torch.randn(k, dtype=torch.float64) for k in ((3, 1), (2,), (1,))]

    def run(fused, closed):
        w = [t.clone().requires_grad_(True) for t in init]

        def loss(batch):
            x, y = batch
            pred = (x @ w[0])[:, 0] * torch.tanh(w[1]).sum() + w[2]
            return torch.log1p((pred - y[:, 0]) ** 2).mean() + 0.1 * (w[0] ** 4).sum()

        def loss_and_grads(batch):
            value = loss(batch)
            return value.detach(), list(torch.autograd.grad(value, w))

        minimize(loss, w, minibatches(d, 16, torch.Generator().manual_seed(1)), max_iter=60,
                 lr=0.05, fused=fused, lr_scales=scales,
                 loss_and_grads=loss_and_grads if closed else None)
        return [t.detach() for t in w]

    ref = run(False, False)
    for fused, closed in [("flat", False), ("flat", True), (False, True)]:
        for got, want in zip(run(fused, closed), ref):
            np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-11, atol=1e-13)
