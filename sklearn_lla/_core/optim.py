"""The one minibatch optimisation loop (VaLLA, FMGP, sampled LLA).

:func:`minimize` runs Adam on a list of tensors with a loss evaluated on minibatches
drawn by :func:`minibatches`, with

* early stopping on a validation score (lower is better) evaluated every
  ``validation_freq`` steps, restoring the best state at the end;
* an optional learning-rate schedule (``lr_schedule``: constant by default, or a
  cosine / step decay over ``max_iter``, or any ``step -> factor`` callable);
* a progress bar (tqdm) when ``verbose``;
* a clear error on a non-finite loss or gradient (naming the step), never a silent
  NaN state;
* a :class:`~sklearn.exceptions.ConvergenceWarning` when ``max_iter`` ends the run
  while the validation score (or, without validation, the loss) was still improving.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np
import torch
from sklearn.exceptions import ConvergenceWarning

__all__ = ["OptimResult", "lr_factor", "minibatches", "minimize"]

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
        ``(step, score)`` at each validation check.
    best_iter : int
        Step of the restored state (the last step without early stopping).
    stopped_early : bool
        Whether early stopping ended the run.
    """

    n_iter: int = 0
    loss_history: list = field(default_factory=list)
    validation_history: list = field(default_factory=list)
    best_iter: int = 0
    stopped_early: bool = False

    def as_dict(self):
        """The history as a plain dict (for ``hyper_trace_``)."""
        return {"n_iter": self.n_iter, "loss": np.asarray(self.loss_history),
                "validation": list(self.validation_history), "best_iter": self.best_iter,
                "stopped_early": self.stopped_early}


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
    n = data.n_samples
    bs = min(int(batch_size), n)
    while True:
        perm = torch.randperm(n, generator=generator).numpy()
        for start in range(0, n - bs + 1, bs):
            yield data.rows(perm[start:start + bs])


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


def minimize(loss_fn: Callable, params: list, batches: Iterator, *, max_iter: int,
             lr: float = 1e-3, validation: Callable | None = None, validation_freq: int = 100,
             early_stopping: bool = True, n_iter_no_change: int = 5, verbose: int = 0,
             desc: str = "optimising", lr_schedule="constant",
             final_lr_factor: float = 0.01) -> OptimResult:
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
    validation : callable or None, default=None
        ``validation() -> float`` (lower is better), evaluated without gradients
        every ``validation_freq`` steps and after the last one.
    validation_freq : int, default=100
        Steps between validation checks.
    early_stopping : bool, default=True
        Stop after ``n_iter_no_change`` checks without improvement and restore the
        best state (requires ``validation``).
    n_iter_no_change : int, default=5
        Checks without improvement before stopping.
    verbose : int, default=0
        ``>= 1`` shows a progress bar.
    desc : str, default="optimising"
        Label of the progress bar and of error messages.
    lr_schedule : {"constant", "cosine", "step"} or callable, default="constant"
        Learning rate of step ``t``: ``lr * lr_factor(lr_schedule, t, max_iter,
        final_lr_factor)`` (see :func:`lr_factor`). A decaying schedule lets the
        iterates of a stochastic (minibatch) objective settle instead of hovering at
        a noise floor set by ``lr``.
    final_lr_factor : float, default=0.01
        The last step's factor for ``"cosine"`` (and the floor of ``"step"``).

    Returns
    -------
    OptimResult
    """
    lr_factor(lr_schedule, 1, max_iter, final_lr_factor)  # validates the schedule
    opt = torch.optim.Adam(params, lr=lr)
    res = OptimResult()
    best_score, best_state, bad = np.inf, None, 0
    bar = None
    if verbose:
        from tqdm.auto import tqdm

        bar = tqdm(total=max_iter, desc=desc, leave=False)

    def check(step):
        nonlocal best_score, best_state, bad
        with torch.no_grad():
            score = float(validation())
        res.validation_history.append((step, score))
        if not np.isfinite(score):
            bad += 1
        elif score < best_score:
            best_score, bad = score, 0
            best_state = [p.detach().clone() for p in params]
            res.best_iter = step
        else:
            bad += 1
        return early_stopping and bad >= n_iter_no_change

    try:
        for step in range(1, max_iter + 1):
            batch = next(batches)
            if lr_schedule != "constant":
                for group in opt.param_groups:
                    group["lr"] = lr * lr_factor(lr_schedule, step, max_iter, final_lr_factor)
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(batch)
            if not bool(torch.isfinite(loss)):
                raise FloatingPointError(
                    f"{desc}: the loss is not finite at step {step} ({float(loss.detach())});"
                    " lower the learning rate or check the data and the network's outputs"
                )
            loss.backward()
            if any(p.grad is not None and not bool(torch.isfinite(p.grad).all())
                   for p in params):
                raise FloatingPointError(f"{desc}: non-finite gradient at step {step}")
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
            raise FloatingPointError(f"{desc}: the validation score was never finite")
        with torch.no_grad():
            for p, b in zip(params, best_state):
                p.copy_(b)
        if not res.stopped_early and res.best_iter == res.n_iter and early_stopping:
            warnings.warn(f"{desc}: max_iter={max_iter} reached while the validation score "
                          "was still improving; increase max_iter", ConvergenceWarning,
                          stacklevel=2)
    else:
        res.best_iter = res.n_iter
        h = res.loss_history
        k = max(1, len(h) // 10)
        if len(h) >= 20 and np.mean(h[-k:]) < np.mean(h[-2 * k:-k]) - 1e-3 * abs(np.mean(h[-k:])):
            warnings.warn(f"{desc}: max_iter={max_iter} reached while the loss was still "
                          "decreasing; increase max_iter", ConvergenceWarning, stacklevel=2)
    return res
