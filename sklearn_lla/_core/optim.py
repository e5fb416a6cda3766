"""The one minibatch optimisation loop (VaLLA, FMGP, sampled LLA).

:func:`minimize` runs Adam on a list of tensors with a loss evaluated on minibatches
drawn by :func:`minibatches`, with

* early stopping on a score (lower is better) checked every ``validation_freq``
  steps, restoring the best state at the end. The score is either a callable (a
  held-out NLL) or ``"loss"``: the training objective itself, as the mean minibatch
  loss over the ``validation_freq`` steps since the previous check (a window average
  that costs nothing extra and, over many minibatches, estimates the full objective).
  One tolerance decides what counts as progress for both: a check improves on the
  best score ``b`` when it is lower by more than ``tol * max(1, |b|)`` (scipy's
  L-BFGS-B ``ftol`` rule: relative for large scores, absolute below 1, so a score
  near zero, such as a per-point NLL, is not held to a vanishing relative
  threshold);
* an optional learning-rate schedule (``lr_schedule``: constant by default, or a
  cosine / step decay over ``max_iter``, or any ``step -> factor`` callable);
* a progress bar (tqdm) when ``verbose``;
* a clear error on a non-finite loss or gradient (naming the step), never a silent
  NaN state;
* a :class:`~sklearn.exceptions.ConvergenceWarning` when ``max_iter`` ends the run
  while the monitored score (or, without checks, the loss) was still improving.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np
import torch
from sklearn.exceptions import ConvergenceWarning

__all__ = ["FlatAdam", "OptimResult", "Patience", "epoch_batches", "epoch_permutations", "improves",
           "lr_factor", "minibatches", "minimize"]

#: Named learning-rate schedules of :func:`minimize` (see :func:`lr_factor`).
LR_SCHEDULES = ("constant", "cosine", "step")


@dataclass
class OptimResult:
    """What :func:`minimize` did.

    Attributes
    ----------
    n_iter : int
        Steps taken.
    loss_history : list of float
        Minibatch loss per step.
    validation_history : list of (int, float)
        ``(step, score)`` at each check (the held-out score, or the window mean of
        the loss with ``validation="loss"``).
    best_iter : int
        Step of the restored state (the last step without early stopping).
    stopped_early : bool
        Whether early stopping ended the run.
    monitor : str
        What the checks scored: ``"validation"`` (a callable), ``"loss"`` (the
        training objective) or ``"none"``.
    """

    n_iter: int = 0
    loss_history: list = field(default_factory=list)
    validation_history: list = field(default_factory=list)
    best_iter: int = 0
    stopped_early: bool = False
    monitor: str = "none"

    def as_dict(self):
        """The history as a plain dict (for ``hyper_trace_``)."""
        return {"n_iter": self.n_iter, "loss": np.asarray(self.loss_history),
                "validation": list(self.validation_history), "best_iter": self.best_iter,
                "stopped_early": self.stopped_early, "monitor": self.monitor}


def minibatches(data, batch_size: int, generator: torch.Generator) -> Iterator:
    """Endless shuffled minibatches ``(x, y)`` of a :class:`~sklearn_lla._core.protocol.FitData`.

    Each epoch is a fresh permutation drawn from ``generator``; rows are read per
    batch, so the cost of a step does not depend on the number of rows. A FitData
    draws them itself (:meth:`~sklearn_lla._core.protocol.FitData.minibatches`: the same
    draws up to ``MINIBATCH_CACHE_ROWS`` rows, then grouped blocks; numpy, memmap
    and dask inputs alike).
    """
    if hasattr(data, "minibatches"):
        yield from data.minibatches(batch_size, generator)
        return
    for sel in epoch_batches(data.n_samples, batch_size, generator):
        yield data.rows(sel)


def epoch_batches(n: int, batch_size: int, generator: torch.Generator) -> Iterator:
    """Endless minibatch row indices: each epoch a permutation of ``range(n)`` drawn from
    ``generator``, cut into consecutive batches (a last partial batch dropped).

    The draws of :func:`minibatches` (and of
    :meth:`~sklearn_lla._core.protocol.FitData.minibatches` up to
    ``MINIBATCH_CACHE_ROWS`` rows), for callers that index cached tensors themselves
    (FMGP's training rows).

    Yields
    ------
    ndarray of shape (min(batch_size, n),)
        The rows of a batch (int64).
    """
    bs = min(int(batch_size), n)
    for perm in epoch_permutations(n, generator):
        for start in range(0, n - bs + 1, bs):
            yield perm[start:start + bs]


def epoch_permutations(n: int, generator: torch.Generator) -> Iterator:
    """Endless permutations of ``range(n)`` (int64 ndarrays), one per epoch, drawn from
    ``generator``: :func:`epoch_batches` cuts each into its batches."""
    while True:
        yield torch.randperm(n, generator=generator).numpy()


def lr_factor(schedule, step: int, max_iter: int, final_factor: float = 0.01) -> float:
    """Multiplier of the base learning rate at ``step`` (1-based) of ``max_iter``.

    Parameters
    ----------
    schedule : {"constant", "cosine", "step"} or callable
        ``"constant"``: 1. ``"cosine"``: half a cosine from 1 at step 1 down to
        ``final_factor`` at ``max_iter``, ``f + (1 - f) (1 + cos(pi t)) / 2`` with
        ``t = (step - 1) / (max_iter - 1)``. ``"step"``: 1, then divided by 10 after
        50 % and again after 75 % of ``max_iter`` (floored at ``final_factor``). A
        callable ``schedule(step, max_iter) -> float`` is used as it is.
    step : int
        The step about to be taken (1-based).
    max_iter : int
        The number of steps of the run.
    final_factor : float, default=0.01
        The factor reached at the end of a ``"cosine"`` run (and the floor of
        ``"step"``).

    Returns
    -------
    float

    Examples
    --------
    >>> from sklearn_lla._core.optim import lr_factor
    >>> [round(lr_factor("cosine", s, 5, final_factor=0.0), 3) for s in range(1, 6)]
    [1.0, 0.854, 0.5, 0.146, 0.0]
    >>> [lr_factor("step", s, 8) for s in (1, 4, 5, 7)]
    [1.0, 1.0, 0.1, 0.01]
    """
    if callable(schedule):
        return float(schedule(step, max_iter))
    if schedule == "constant":
        return 1.0
    t = (step - 1) / max(max_iter - 1, 1)
    if schedule == "cosine":
        return final_factor + (1.0 - final_factor) * 0.5 * (1.0 + math.cos(math.pi * t))
    if schedule == "step":
        frac = step / max_iter
        return max(0.01 if frac > 0.75 else 0.1 if frac > 0.5 else 1.0, final_factor)
    raise ValueError(f"lr_schedule must be one of {LR_SCHEDULES} or a callable, "
                     f"got {schedule!r}")


def improves(score: float, best: float, tol: float) -> bool:
    """Whether ``score`` beats ``best`` by more than ``tol * max(1, |best|)``.

    The one tolerance rule of :func:`minimize` (scipy's L-BFGS-B ``ftol`` form). A
    non-finite ``score`` never improves; anything finite improves on ``inf``.

    Examples
    --------
    >>> from sklearn_lla._core.optim import improves
    >>> improves(0.9, 1.0, 1e-3), improves(0.9995, 1.0, 1e-3), improves(0.5, float("inf"), 0)
    (True, False, True)
    """
    if not math.isfinite(score):
        return False
    if not math.isfinite(best):
        return True
    return score < best - tol * max(1.0, abs(best))


class Patience:
    """Early stopping's count: checks without an improvement, by :func:`improves`.

    The one rule of every early-stopping loop (:func:`minimize`, ELLA's streamed
    checks, sampled LLA's validation scan): a score improves on the best when
    :func:`improves` says so (it then becomes the best and the count restarts);
    otherwise the check counts against, unless it is within ``slack * |best|`` of
    the best (not clearly worse: the count restarts). :attr:`stop` after
    ``n_iter_no_change`` such checks in a row.

    Parameters
    ----------
    n_iter_no_change : int
        Checks without improvement that stop the loop.
    tol : float, default=0.0
        The tolerance of :func:`improves`.
    slack : float or None, default=None
        Scores within ``slack * |best|`` above the best restart the count; ``None``:
        every check that does not improve counts.
    progress_tol : float, default=0.0
        Diminishing returns: a score improves only when it is also lower than the best
        by more than ``progress_tol`` times the progress so far (the first score
        minus the best). ``0``: no such condition.
    n_iter_no_progress : int or None, default=None
        With ``progress_tol``: also stop after this many checks since the last
        improvement that beat the best by the tolerance but not by the progress
        margin (the score still creeps down, by too little to count). ``None``: such
        checks count only towards ``n_iter_no_change``.

    Examples
    --------
    >>> from sklearn_lla._core.optim import Patience
    >>> p = Patience(2)
    >>> [p.update(s) for s in (3.0, 2.0, 2.5, 2.5)], p.best, p.stop
    ([True, True, False, False], 2.0, True)
    >>> p = Patience(5, progress_tol=0.5, n_iter_no_progress=2)
    >>> [p.update(s) for s in (3.0, 2.0, 1.9, 1.8)], p.best, p.stop
    ([True, True, False, False], 2.0, True)
    """

    def __init__(self, n_iter_no_change: int, tol: float = 0.0, slack: float | None = None,
                 progress_tol: float = 0.0, n_iter_no_progress: int | None = None):
        self.n_iter_no_change = int(n_iter_no_change)
        self.tol = float(tol)
        self.slack = slack
        self.progress_tol = float(progress_tol)
        self.n_iter_no_progress = None if n_iter_no_progress is None else int(
            n_iter_no_progress)
        self.best = math.inf
        self.first = None
        self.bad = 0
        self.creep = 0

    def update(self, score: float) -> bool:
        """Record a check's ``score``; whether it improved on the best."""
        if self.first is None and math.isfinite(score):
            self.first = score
        progress = 0.0 if self.first is None or not math.isfinite(self.best) else (
            self.first - self.best)
        gain = improves(score, self.best, self.tol)
        if gain and self.best - score > self.progress_tol * progress:
            self.best, self.bad, self.creep = score, 0, 0
            return True
        if gain:  # below the best, by less than the progress margin
            self.creep += 1
        if self.slack is not None and score <= self.best + self.slack * abs(self.best):
            self.bad = 0
        else:
            self.bad += 1
        return False

    @property
    def stop(self) -> bool:
        """Whether ``n_iter_no_change`` checks in a row did not improve (or, with
        ``n_iter_no_progress``, that many crept since the last improvement)."""
        return self.bad >= self.n_iter_no_change or (
            self.n_iter_no_progress is not None and self.creep >= self.n_iter_no_progress)


class FlatAdam:
    """Adam (torch's defaults: betas 0.9 / 0.999, eps 1e-8, no weight decay) on the
    concatenation of a list of tensors of one dtype and device.

    One step is a handful of operations on one vector (gather the tensors and their
    gradients, update the moments, scatter back), where ``torch.optim.Adam`` (also
    fused) spends a fraction of a millisecond per step on its bookkeeping: for loops of
    thousands of steps of a few milliseconds (FMGP's). The update is
    ``torch.optim.Adam``'s single-tensor one, to float round-off; a tensor without a
    gradient at a step gets a zero one (torch skips it: the two differ only when a
    gradient is missing at some steps and not at others).

    Parameters
    ----------
    params : list of Tensor
        The leaves, updated in place.
    lr : float
        The learning rate.
    lr_scales : list of float or None, default=None
        A multiplier of ``lr`` per tensor.
    """

    betas = (0.9, 0.999)
    eps = 1e-8

    def __init__(self, params, lr, lr_scales=None):
        self.params = list(params)
        self.sizes = [p.numel() for p in self.params]
        ref = self.params[0]
        n = sum(self.sizes)
        self.exp_avg = torch.zeros(n, dtype=ref.dtype, device=ref.device)
        self.exp_avg_sq = torch.zeros_like(self.exp_avg)
        self.lr = float(lr)
        self.lr_vec = None
        if lr_scales is not None and any(float(f) != 1.0 for f in lr_scales):
            self.lr_vec = torch.cat([torch.full((k,), self.lr * float(f), dtype=ref.dtype,
                                                device=ref.device)
                                     for k, f in zip(self.sizes, lr_scales)])
        self.n_steps = 0

    def zero_grad(self, set_to_none=True):
        """Clear the tensors' ``.grad`` (as ``torch.optim.Optimizer.zero_grad``)."""
        for p in self.params:
            p.grad = None

    def flat_grad(self, grads):
        """The gradients as one vector (zeros for ``None``)."""
        return torch.cat([torch.zeros(k, dtype=self.exp_avg.dtype, device=self.exp_avg.device)
                          if g is None else g.reshape(-1)
                          for g, k in zip(grads, self.sizes)])

    def step(self, grad):
        """One Adam update of the tensors with the flat gradient ``grad``."""
        b1, b2 = self.betas
        self.n_steps += 1
        t = self.n_steps
        with torch.no_grad():
            theta = torch.cat([p.reshape(-1) for p in self.params])
            self.exp_avg.lerp_(grad, 1.0 - b1)
            self.exp_avg_sq.mul_(b2).addcmul_(grad, grad, value=1.0 - b2)
            denom = (self.exp_avg_sq.sqrt() / math.sqrt(1.0 - b2 ** t)).add_(self.eps)
            bc1 = 1.0 - b1 ** t
            if self.lr_vec is None:
                theta.addcdiv_(self.exp_avg, denom, value=-self.lr / bc1)
            else:
                theta.addcmul_(self.exp_avg / denom, self.lr_vec, value=-1.0 / bc1)
            torch._foreach_copy_(self.params, [v.view_as(p) for v, p in
                                               zip(theta.split(self.sizes), self.params)])


def minimize(loss_fn: Callable, params: list, batches: Iterator, *, max_iter: int,
             lr: float = 1e-3, validation: Callable | str | None = None,
             validation_freq: int = 100, early_stopping: bool = True,
             n_iter_no_change: int = 5, tol: float = 0.0, progress_tol: float = 0.0,
             n_iter_no_progress: int | None = None, check_start: bool = False,
             verbose: int = 0, desc: str = "optimising", lr_schedule="constant",
             final_lr_factor: float = 0.01, fused: bool | str = False,
             lr_scales: list | None = None,
             loss_and_grads: Callable | None = None) -> OptimResult:
    """Minimise ``loss_fn(batch)`` over ``params`` with Adam.

    Parameters
    ----------
    loss_fn : callable
        ``loss_fn(batch) -> scalar tensor`` (differentiable w.r.t. ``params``).
    params : list of Tensor
        Leaf tensors with ``requires_grad=True``; updated in place.
    batches : iterator
        Yields the minibatches (see :func:`minibatches`).
    max_iter : int
        Largest number of steps.
    lr : float, default=1e-3
        Adam's learning rate.
    validation : callable, "loss" or None, default=None
        What is checked every ``validation_freq`` steps and after the last one
        (lower is better). A callable: ``validation() -> float``, evaluated without
        gradients (a held-out score). ``"loss"``: the training objective, as the mean
        minibatch loss over the steps since the previous check. ``None``: no checks,
        the last state is kept.
    validation_freq : int, default=100
        Steps between checks.
    early_stopping : bool, default=True
        Stop after ``n_iter_no_change`` checks without improvement (requires
        ``validation``). With checks, the state of the best check is restored at the
        end in either case.
    n_iter_no_change : int, default=5
        Checks without improvement before stopping.
    tol : float, default=0.0
        A check improves on the best score ``b`` only when it is lower by more than
        ``tol * max(1, |b|)`` (see :func:`improves`); smaller gains count as none and
        the earlier, equally good state is kept.
    progress_tol : float, default=0.0
        A check must also beat the best score by more than ``progress_tol`` times
        the progress so far (the first check's score minus the best): stop on
        diminishing returns (see :class:`Patience`).
    n_iter_no_progress : int or None, default=None
        With ``progress_tol``: also stop after this many checks since the best that
        beat it by ``tol`` but not by the progress margin (see :class:`Patience`).
    check_start : bool, default=False
        Also score the initial state (as step 0) when ``validation`` is a callable, so
        that a run that only makes things worse restores where it started (useful
        when the start is already an optimum of a cheaper problem).
    verbose : int, default=0
        ``>= 1`` shows a progress bar.
    desc : str, default="optimising"
        Label of the progress bar and of error and warning messages (a user-facing
        name such as ``"VaLLARegressor: fitting"``).
    lr_schedule : {"constant", "cosine", "step"} or callable, default="constant"
        Learning rate of step ``t``: ``lr * lr_factor(lr_schedule, t, max_iter,
        final_lr_factor)`` (see :func:`lr_factor`). A decaying schedule lets the
        iterates of a stochastic (minibatch) objective settle instead of hovering at
        a noise floor set by ``lr``.
    final_lr_factor : float, default=0.01
        The last step's factor for ``"cosine"`` (and the floor of ``"step"``).
    fused : bool or "flat", default=False
        Run torch's fused Adam kernel (one pass over every tensor instead of a dozen
        operations per tensor: the same update up to float round-off). For loops of
        many cheap steps over several small tensors (FMGP). ``"flat"``: Adam on the
        concatenation of ``params`` (:class:`FlatAdam`: a few operations on one vector
        per step, without ``torch.optim``'s per-step bookkeeping; the same update up
        to float round-off), where they share a dtype and device and the schedule is
        constant (else the fused kernel).
    lr_scales : list of float or None, default=None
        A multiplier of ``lr`` per tensor of ``params`` (Adam's parameter groups, one
        per distinct value); ``None``: ``lr`` for every tensor.
    loss_and_grads : callable or None, default=None
        ``loss_and_grads(batch) -> (loss, grads)``, the loss (a scalar tensor) with the
        gradient of every tensor of ``params`` (a list in their order; ``None`` for
        none), used instead of ``loss_fn`` and a backward pass (a step whose gradient
        is computed in closed form).

    Returns
    -------
    OptimResult
    """
    lr_factor(lr_schedule, 1, max_iter, final_lr_factor)  # validates the schedule
    on_loss = isinstance(validation, str)
    if on_loss and validation != "loss":
        raise ValueError(f"validation must be a callable, 'loss' or None, got {validation!r}")
    if tol < 0 or not math.isfinite(tol):
        raise ValueError(f"tol must be a finite number >= 0, got {tol!r}")
    groups = params
    if lr_scales is not None:
        if len(lr_scales) != len(params):
            raise ValueError(f"lr_scales has {len(lr_scales)} entries for {len(params)} tensors")
        by_scale = {}
        for p, f in zip(params, lr_scales):
            by_scale.setdefault(float(f), []).append(p)
        groups = [{"params": ps, "lr": lr * f, "lr_scale": f} for f, ps in by_scale.items()]
    flat = (fused == "flat" and lr_schedule == "constant" and len(params) > 0
             and len({(p.dtype, p.device) for p in params}) == 1)
    if flat:
        opt = FlatAdam(params, lr, lr_scales)
    else:
        opt = torch.optim.Adam(groups, lr=lr, **({"fused": True} if fused else {}))
    res = OptimResult(monitor="none" if validation is None else
                      "loss" if on_loss else "validation")
    patience = Patience(n_iter_no_change, tol, progress_tol=progress_tol,
                        n_iter_no_progress=n_iter_no_progress)
    best_state, last_check = None, 0
    bar = None
    if verbose:
        from tqdm.auto import tqdm

        bar = tqdm(total=max_iter, desc=desc, leave=False)

    def check(step):
        nonlocal best_state, last_check
        if on_loss:
            score = float(np.mean(res.loss_history[last_check:step]))
        else:
            with torch.no_grad():
                score = float(validation())
        last_check = step
        res.validation_history.append((step, score))
        if patience.update(score):
            best_state = [p.detach().clone() for p in params]
            res.best_iter = step
        return early_stopping and patience.stop

    if check_start and callable(validation):
        check(0)
    try:
        for step in range(1, max_iter + 1):
            batch = next(batches)
            if lr_schedule != "constant":
                for group in opt.param_groups:
                    group["lr"] = lr * group.get("lr_scale", 1.0) * lr_factor(
                        lr_schedule, step, max_iter, final_lr_factor)
            opt.zero_grad(set_to_none=True)
            if loss_and_grads is not None:
                loss, grads = loss_and_grads(batch)
            else:
                loss, grads = loss_fn(batch), None
            if not bool(torch.isfinite(loss)):
                raise FloatingPointError(
                    f"{desc}: the loss is not finite at step {step} ({float(loss.detach())});"
                    " lower the learning rate or check the data and the network's outputs"
                )
            if grads is None:
                loss.backward()
                grads = [p.grad for p in params]
            if flat:
                g = opt.flat_grad(grads)
                if not bool(torch.isfinite(g).all()):
                    raise FloatingPointError(f"{desc}: non-finite gradient at step {step}")
                opt.step(g)
            else:
                if any(g is not None and not bool(torch.isfinite(g).all()) for g in grads):
                    raise FloatingPointError(f"{desc}: non-finite gradient at step {step}")
                if loss_and_grads is not None:
                    for p, g in zip(params, grads):
                        p.grad = g
                opt.step()
            res.loss_history.append(float(loss.detach()))
            res.n_iter = step
            if bar is not None:
                bar.update(1)
                if step % 50 == 0:
                    bar.set_postfix(loss=f"{res.loss_history[-1]:.4g}")
            due = validation is not None and (step % validation_freq == 0 or step == max_iter)
            if due and check(step):
                res.stopped_early = True
                break
    finally:
        if bar is not None:
            bar.close()
    if validation is not None:
        if best_state is None:
            raise FloatingPointError(f"{desc}: the {'loss' if on_loss else 'validation score'}"
                                     " was never finite at a check")
        with torch.no_grad():
            for p, b in zip(params, best_state):
                p.copy_(b)
        if not res.stopped_early and res.best_iter == res.n_iter and early_stopping:
            what = "training objective" if on_loss else "monitored score"
            warnings.warn(f"{desc}: max_iter={max_iter} reached while the {what} was still "
                          "improving; increase max_iter", ConvergenceWarning, stacklevel=2)
    else:
        res.best_iter = res.n_iter
        h = res.loss_history
        k = max(1, len(h) // 10)
        if len(h) >= 20 and np.mean(h[-k:]) < np.mean(h[-2 * k:-k]) - 1e-3 * abs(np.mean(h[-k:])):
            warnings.warn(f"{desc}: max_iter={max_iter} reached while the loss was still "
                          "decreasing; increase max_iter", ConvergenceWarning, stacklevel=2)
    return res
