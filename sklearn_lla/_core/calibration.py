"""Calibration on held-out rows that keeps the posterior: one scalar, by held-out NLL.

A criterion scored on held-out rows may choose between candidates only if it cannot
be won by deleting the posterior. Each calibration here keeps the shape of the latent
covariance ``S(x)`` the posterior produced and moves one scalar:

* regression, a posterior that is exactly rescalable (:attr:`Posterior.rescalable
  <sklearn_lla._core.protocol.Posterior.rescalable>`: the posterior at ``(c s0^2, c
  s2)`` is ``c`` times the one at ``(s0^2, s2)``), the **scale** ``c``: the predictive
  is ``N(g(x), c (S(x) + s2 I))`` and its held-out maximum likelihood is closed form,
  ``c = (1 / (n C)) sum_i r_i^T (S_i + s2 I)^-1 r_i`` (:func:`calibrate_scale`);
* regression otherwise, the **noise variance** ``s2`` of ``N(g(x), S(x) + s2 I)``
  (:func:`calibrate_noise`), or under a fixed prior variance, for a posterior that
  refits for each candidate noise, ``s2`` with the posterior refitted
  (:func:`calibrate_noise_refit`);
* classification, a **temperature** ``T`` of the latent, ``f / T`` with
  ``f ~ N(g(x), S(x))`` (temperature scaling, Guo et al. 2017, applied to the whole
  Laplace predictive). A temperature below 1 takes back spread without scaling any
  logit up: per point it is raised to the floor ``sqrt(1 - pi min_c v_c / 8)``
  (:func:`~sklearn_lla._core.likelihoods.sharpening_floor`). Where that cap stops
  the temperature with the held-out NLL still clearly above the network's own (the
  posterior's spread wider than the held-out rows support), the latent covariance is
  also **scaled down**, by the largest factor that brings the NLL within tolerance
  (:func:`calibrate_classification`).

The searched ones minimise the held-out NLL over a bounded interval and report a
:class:`~sklearn_lla._core.hyper.HyperparameterWarning` when they end at a bound.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import numpy as np
import torch
from scipy.optimize import minimize_scalar

from .hyper import HyperparameterWarning, _finite_scores
from .likelihoods import sharpening_floor

__all__ = ["CALIBRATION_ROWS", "HeldOutLatent", "held_out_predictive", "calibrate_scale",
           "calibrate_noise", "calibrate_noise_refit", "calibrate_temperature",
           "calibrate_classification",
           "gaussian_nll_curve", "rescaled_nll"]

#: Held-out rows (at most) read by a calibration; beyond, a random subset this large
#: (a 1-D scalar is estimated: 20,000 rows pin it to well under 1 % relative error).
CALIBRATION_ROWS = 20_000

#: Search interval of the noise variance, relative to the network's mean squared
#: residual on the held-out rows.
NOISE_RANGE = (1e-6, 1e2)

#: Smallest scale ``c`` of a rescalable posterior, in units of ``c0 = (mean squared
#: held-out residual) / s2``, the largest the held-out rows can call for.
MIN_SCALE = 1e-4

#: Noise candidates of :func:`calibrate_noise_refit`, relative to the network's mean
#: squared held-out residual.
NOISE_REFIT_GRID = np.logspace(-3, 1, 41)

#: Search interval of the temperature.
TEMPERATURE_RANGE = (1e-2, 1e2)

#: Smallest scale of the latent covariance :func:`calibrate_classification` may reach.
COVARIANCE_SCALE_MIN = 1e-3

#: Bisection steps of that scale in ``log c`` (the bracket ends ``1e3 ** (2 ** -10)``,
#: 0.7 %, wide).
COVARIANCE_SCALE_STEPS = 10

#: Folds of the out-of-fold check that keeps a fitted temperature only where it helps.
CALIBRATION_FOLDS = 5

#: A temperature at its sharpening limit warns when the held-out NLL there still
#: exceeds the network's own (softmax / sigmoid of its logits) by more than
#: ``max(SHARPENING_GAP_ABS, SHARPENING_GAP_REL * network's NLL)`` per row: the cap
#: then stops a calibration that the held-out rows ask to go further.
SHARPENING_GAP_ABS = 0.005
SHARPENING_GAP_REL = 0.1


@dataclass
class HeldOutLatent:
    """The latent predictive of the *calibrated* posterior on held-out rows.

    :meth:`Posterior.calibrate <sklearn_lla._core.protocol.Posterior.calibrate>`
    returns it so that the split-conformal scores (:func:`sklearn_lla._conformal.
    calibrate_held_out`) reuse the pass the calibration made over these rows instead of
    predicting them again: ``mean`` and ``cov`` are what ``posterior.predict`` gives on
    them after the calibration (the covariance of a rescaled posterior times its scale).

    Attributes
    ----------
    rows : ndarray of int, shape (n,)
        Positions of the rows in the held-out stream (sorted).
    mean : Tensor of shape (n, C)
    cov : Tensor of shape (n, C, C)
    """

    rows: np.ndarray
    mean: torch.Tensor
    cov: torch.Tensor


def held_out_predictive(posterior, validation, *, max_rows=CALIBRATION_ROWS,
                        generator=None, return_rows=False):
    """The latent predictive of ``posterior`` on (a subset of) the held-out rows.

    Parameters
    ----------
    posterior : Posterior
        A fitted posterior (its :meth:`predict` is called per batch).
    validation : FitData
        The held-out rows.
    max_rows : int or None, default=CALIBRATION_ROWS
        Rows read at most: a random subset (from ``generator``) beyond; ``None``:
        every row.
    generator : torch.Generator, optional
        Random source of the subset.
    return_rows : bool, default=False
        Also return the positions of the rows read.

    Returns
    -------
    mean : Tensor of shape (n, C)
    cov : Tensor of shape (n, C, C)
    y : Tensor
        The targets of those rows.
    rows : ndarray of int, shape (n,)
        Their positions in ``validation`` (sorted), if ``return_rows``.
    """
    n = validation.n_samples
    if max_rows is not None and n > max_rows:
        gen = generator if generator is not None else torch.Generator().manual_seed(0)
        rows = np.sort(torch.randperm(n, generator=gen)[:max_rows].numpy())
    else:
        rows = np.arange(n)
    means, covs, ys = [], [], []
    bs = validation.batch_size
    for start in range(0, len(rows), bs):
        x, y = validation.rows(rows[start:start + bs])
        with torch.no_grad():
            lp = posterior.predict(x)
        means.append(lp.mean.double().cpu())
        covs.append(lp.cov.double().cpu())
        ys.append(y.cpu())
    mean, cov, y = torch.cat(means), torch.cat(covs), torch.cat(ys)
    if not (bool(torch.isfinite(mean).all()) and bool(torch.isfinite(cov).all())):
        raise FloatingPointError("the predictive is not finite on the held-out rows; check "
                                 "the network's outputs on them")
    return (mean, cov, y, rows) if return_rows else (mean, cov, y)


def calibrate_scale(mean, cov, y, prior_variance, noise_variance, *, warn=True):
    """The held-out maximum-likelihood scale ``c`` of a rescalable posterior.

    The predictive at ``(c s0^2, c s2)`` is ``N(g, c Sigma_i)``, ``Sigma_i = S_i + s2 I``,
    whose mean held-out NLL ``A + (C / 2) log c + q / (2 c)``,
    ``q = mean_i r_i^T Sigma_i^-1 r_i``, is minimal at ``c = q / C``. Since
    ``S_i >= 0``, ``c <= c0``, the mean squared residual (at least 1e-12) over ``s2``;
    it is floored at :data:`MIN_SCALE` ``c0`` (and warns there: the latent variance alone
    over-explains the held-out residuals).

    Parameters
    ----------
    mean : Tensor of shape (n, C)
    cov : Tensor of shape (n, C, C)
        The latent covariance at ``(s0^2, s2)``.
    y : Tensor
        The targets (reshaped to ``mean``'s shape).
    prior_variance, noise_variance : float
        The pair ``(s0^2, s2)`` that is rescaled.
    warn : bool, default=True
        Warn at the floor.

    Returns
    -------
    c : float
    trace : dict
    """
    s2 = float(noise_variance)
    n, C = mean.shape
    r = y.reshape(mean.shape).double() - mean
    mse = max(float((r * r).mean()), 1e-12)
    sig = cov + s2 * torch.eye(C, dtype=cov.dtype)
    L = torch.linalg.cholesky(sig)
    z = torch.linalg.solve_triangular(L, r.unsqueeze(-1), upper=False).squeeze(-1)
    q = (z * z).sum(1)
    logdet = 2.0 * torch.log(torch.diagonal(L, dim1=1, dim2=2)).sum(1)
    c = float(q.mean()) / C
    floor = MIN_SCALE * mse / max(s2, 1e-300)
    if c < floor:
        if warn:
            warnings.warn(
                f"noise_variance_ and prior_variance_ are the objective's pair scaled by the "
                f"lowest allowed factor: the held-out rows call for a scale below {MIN_SCALE:g} "
                "times the largest their residuals allow, as the posterior's latent variance "
                "alone over-explains them. Check that the held-out rows come from the training "
                "data's distribution and that their targets are on the scale of y; otherwise "
                "pass a prior_variance below prior_variance_",
                HyperparameterWarning, stacklevel=4)
        c = floor
    nll = float(0.5 * (logdet + C * math.log(2 * math.pi * c) + q / c).mean())
    trace = {"method": "exact_rescaling", "scale": c, "best_score": nll,
             "mse_held_out": mse, "n_rows": int(n), "anchor": (float(prior_variance), s2),
             "prior_variance": float(prior_variance) * c, "noise_variance": s2 * c}
    return c, trace


def rescaled_nll(nll_at, n_outputs):
    """The held-out NLL of a rescalable posterior at its best scale, from two of its values.

    As in :func:`calibrate_scale`, the mean NLL at scale ``c`` is
    ``A + (C / 2) log c + q / (2 c)``: its values at ``c = 1`` and ``c = 2`` give
    ``q = 4 (nll(1) - nll(2) + (C / 2) log 2)`` and the minimum
    ``nll(1) - q / 2 + (C / 2) (log(q / C) + 1)`` (for a method that scores candidate
    pairs without forming the latent covariance, e.g. at ELLA's early-stopping checks).

    Parameters
    ----------
    nll_at : callable
        ``c -> mean held-out NLL`` of the posterior at ``(c s0^2, c s2)``.
    n_outputs : int
        ``C``.

    Returns
    -------
    float
    """
    C = n_outputs
    one, two = nll_at(1.0), nll_at(2.0)
    q = 4.0 * (one - two + 0.5 * C * math.log(2.0))
    if not (math.isfinite(q) and q > 0):
        return math.inf if not math.isfinite(one) else one
    return one - 0.5 * q + 0.5 * C * (math.log(q / C) + 1.0)


def _refine(values, scores, i, score):
    """Re-score 11 points between the neighbours of ``values[i]`` (log spacing of the
    grid) and return the arrays with the better one appended (or unchanged), and its index."""
    step = np.log(values[1] / values[0])
    fine = values[i] * np.exp(np.linspace(-step, step, 11))
    fs = _finite_scores(score(fine))
    j = int(np.argmin(fs))
    if fs[j] < scores[i]:
        return np.concatenate([values, fine]), np.concatenate([scores, fs]), len(scores) + j
    return values, scores, i


def calibrate_noise_refit(score, prior_variance, base_noise, *, warn=True):
    """The noise variance under a fixed prior variance, the posterior refitted per candidate.

    A log grid of :data:`NOISE_REFIT_GRID` times ``base_noise``, refined 10-fold
    around its best point.

    Parameters
    ----------
    score : callable
        ``score(s0_array, s2_array) -> ndarray`` of held-out NLL per *pair*.
    prior_variance : float
        The fixed ``s0^2``.
    base_noise : float
        The network's mean squared held-out residual.
    warn : bool, default=True
        Warn when the optimum sits on an edge of the grid.

    Returns
    -------
    s2 : float
    trace : dict
    """
    s0 = float(prior_variance)
    s2 = base_noise * NOISE_REFIT_GRID

    def by_noise(v):
        return score(np.full(len(v), s0), v)

    sc = _finite_scores(by_noise(s2))
    if not np.isfinite(sc).any():
        raise FloatingPointError("the held-out NLL is not finite for any noise variance")
    i = int(np.argmin(sc))
    at_edge = i in (0, len(s2) - 1)
    if not at_edge:
        s2, sc, i = _refine(s2, sc, i, by_noise)
    if at_edge and warn:
        where = "lower" if i == 0 else "upper"
        msg = (f"noise_variance_, calibrated on the held-out rows, is at the {where} edge "
               f"of its grid ({s2[i]:.3g}, {NOISE_REFIT_GRID[0 if i == 0 else -1]:g} x the "
               "network's mean squared residual there)")
        msg += ("; the posterior's latent variance alone over-explains the held-out "
                "residuals: pass a prior_variance below prior_variance_ if the intervals "
                "are too wide" if i == 0 else
                "; check that the held-out targets are on the scale of y")
        warnings.warn(msg, HyperparameterWarning, stacklevel=4)
    trace = {"prior_variance": np.full(len(s2), s0), "noise_variance": s2, "score": sc,
             "best_score": float(sc[i]), "mse_held_out": float(base_noise), "scale": None}
    return float(s2[i]), trace


def _bounded_log_search(f, lo, hi, what, f_many=None):
    """Minimise ``f(log v)`` over ``[log lo, log hi]``; also says whether it ends at a bound.

    ``f_many``, when given, evaluates ``f`` on an array of points at once (the grid).
    """
    a, b = math.log(lo), math.log(hi)
    # a coarse grid first (the NLL can have a flat region), then Brent around the best
    grid = np.linspace(a, b, 41)
    vals = np.asarray(f_many(grid) if f_many is not None else [f(u) for u in grid],
                      dtype=float)
    vals = np.where(np.isfinite(vals), vals, np.inf)
    if not np.isfinite(vals).any():
        raise FloatingPointError(f"the held-out NLL is not finite for any {what}")
    i = int(np.argmin(vals))
    lo_i, hi_i = grid[max(i - 1, 0)], grid[min(i + 1, len(grid) - 1)]
    res = minimize_scalar(f, bounds=(lo_i, hi_i), method="bounded",
                          options={"xatol": 1e-4})
    u, val = (float(res.x), float(res.fun)) if res.fun <= vals[i] else (grid[i], vals[i])
    at_edge = (i == 0 and u - a < 1e-3) or (i == len(grid) - 1 and b - u < 1e-3)
    return u, val, at_edge, grid, vals


def gaussian_nll_curve(mean, cov, y):
    """``s2 -> mean held-out NLL`` of ``N(mean, cov + s2 I)`` (one eigendecomposition).

    Parameters
    ----------
    mean : Tensor of shape (n, C)
    cov : Tensor of shape (n, C, C)
    y : Tensor of shape (n, C)

    Returns
    -------
    callable
        ``nll(s2) -> float``.
    """
    r = (y.reshape(mean.shape).double() - mean)
    if mean.shape[1] == 1:
        lam = cov.reshape(-1).clamp_min(0.0)
        z2 = (r * r).reshape(-1, 1)
        lam = lam.reshape(-1, 1)
    else:
        lam, U = torch.linalg.eigh(0.5 * (cov + cov.transpose(1, 2)))
        lam = lam.clamp_min(0.0)
        z2 = torch.einsum("bcj,bc->bj", U, r) ** 2
    lam_np, z2_np = lam.numpy(), z2.numpy()
    C = mean.shape[1]

    def nll(s2):
        v = lam_np + s2
        return float(0.5 * (np.log(v) + z2_np / v).sum(1).mean() + 0.5 * C * math.log(2 * math.pi))

    return nll


def calibrate_noise(mean, cov, y, *, warn=True):
    """The noise variance minimising the held-out Gaussian NLL, the latent ``cov`` fixed.

    Parameters
    ----------
    mean : Tensor of shape (n, C)
        The network's outputs on the held-out rows.
    cov : Tensor of shape (n, C, C)
        The posterior's latent covariance there.
    y : Tensor of shape (n, C)
        The targets.
    warn : bool, default=True
        Warn when the optimum sits on a bound of the search interval.

    Returns
    -------
    s2 : float
    trace : dict
        The candidates tried, their scores, the network's own mean squared residual.
    """
    r = y.reshape(mean.shape).double() - mean
    mse = max(float((r * r).mean()), 1e-300)
    nll = gaussian_nll_curve(mean, cov, y)
    lo, hi = mse * NOISE_RANGE[0], mse * NOISE_RANGE[1]
    u, val, at_edge, grid, vals = _bounded_log_search(lambda u: nll(math.exp(u)), lo, hi,
                                                      "noise variance")
    s2 = math.exp(u)
    if warn and at_edge:
        if u < 0.5 * (math.log(lo) + math.log(hi)):
            msg = ("noise_variance_, calibrated on the held-out rows, is at the lower bound "
                   f"{lo:.3g} of its range: the posterior's latent variance alone already "
                   "exceeds the network's squared residuals there, so the prior variance is "
                   "too broad for these rows; pass a prior_variance below prior_variance_ if "
                   "the intervals are too wide")
        else:
            msg = (f"noise_variance_, calibrated on the held-out rows, is at the upper bound "
                   f"{hi:.3g} of its range (100 x the network's mean squared residual there); "
                   "check that the held-out targets are on the training targets' scale")
        warnings.warn(msg, HyperparameterWarning, stacklevel=3)
    trace = {"noise_variance": np.exp(grid), "score": vals, "best_score": val,
             "mse_held_out": mse, "n_rows": int(mean.shape[0])}
    return s2, trace


def _sharpest_temperature(likelihood, mean, cov, eps, lo, hi):
    """The smallest ``T`` whose mean confidence does not exceed the raw network's.

    Tempering below 1 sharpens the predictive; it may undo the posterior's spread in
    distribution but never make the predictive more confident than the network
    itself (with few or no held-out errors the held-out NLL keeps falling as
    ``T -> 0``: its minimiser is then not identified by the data). The mean
    confidence ``mean_x max_c p_T(c | x)`` decreases in ``T`` (the probit scale
    ``1 / sqrt(T^2 + pi v / 8)`` does), so the bound is found by bisection in
    ``log T``.
    """
    with torch.no_grad():
        raw = float(likelihood.with_temperature(1.0).predict(mean, torch.zeros_like(cov),
                                                            eps=eps).max(-1).values.mean())

        def conf(us):
            p = likelihood.predict_at_temperatures(mean, cov, np.exp(us), eps=eps)
            return p.max(-1).values.mean(-1).tolist()

        a, b = math.log(lo), 0.0
        at_b, at_a = conf([b, a])
        if at_b >= raw:  # already at least as confident as the net: no sharpening
            return 1.0, raw
        if at_a <= raw:
            return lo, raw
        _, b = _crossing(lambda us: np.asarray(conf(us)) > raw, a, b)
        return math.exp(b), raw


def _crossing(above, a, b, points=63, rounds=7):
    """Bracket where a decreasing function crosses a level, in batched evaluations.

    ``above(us)`` says, for an array of points, whether the function is above the level
    there; it must be at ``a`` and not at ``b``. Each call evaluates ``points`` interior
    points of the bracket and keeps the one interval where the answer flips: the
    bracket shrinks ``points + 1``-fold per call (by default to ``2^-42`` of its width,
    below 40 bisection steps). Returns ``(a, b)`` with ``above`` at ``a``, not at ``b``.
    """
    for _ in range(rounds):
        us = np.linspace(a, b, points + 2)[1:-1]
        up = np.asarray(above(us), dtype=bool)
        j = int(np.argmin(up)) if not up.all() else len(us)
        a = us[j - 1] if j > 0 else a
        b = us[j] if j < len(us) else b
    return a, b


def _warn_temperature_at_upper_bound():
    """The warning of a kept temperature at the top of :data:`TEMPERATURE_RANGE` (raised
    for the caller of the public calibration that found it)."""
    warnings.warn(f"the temperature calibrated on the held-out rows is at the upper bound "
                  f"{TEMPERATURE_RANGE[1]:g} of its range: the predictive is near uniform; "
                  "check that the held-out labels are the network's classes",
                  HyperparameterWarning, stacklevel=4)


def _fit_temperature(likelihood, mean, cov, y, eps, rows):
    """The held-out NLL's minimiser over ``[T_min, 100]`` on ``rows``:
    ``(_bounded_log_search's result, T_min, the network's mean confidence)``."""
    lo, hi = TEMPERATURE_RANGE
    m, c, t = mean[rows], cov[rows], y[rows]
    e = None if eps is None else eps[:, rows]

    def nll(u):
        lik = likelihood.with_temperature(math.exp(u))
        with torch.no_grad():
            return float(-lik.log_predictive(m, c, t, eps=e).mean())

    def nll_many(us):
        with torch.no_grad():
            return (-likelihood.log_predictive_at_temperatures(
                m, c, t, np.exp(us), eps=e).mean(-1)).tolist()

    # below every row's sharpening floor (each <= 1) nothing changes: the NLL is flat
    lowest = max(lo, float(sharpening_floor(c).min()))
    t_min, raw_conf = _sharpest_temperature(likelihood, m, c, e, lowest, hi)
    return _bounded_log_search(nll, t_min, hi, "temperature", nll_many), t_min, raw_conf


def calibrate_temperature(likelihood, mean, cov, y, *, eps=None, warn=True):
    """The temperature minimising the held-out NLL of the tempered predictive, if it helps.

    The fitted temperature is kept only when, fitted on 4/5 of the rows, it beats
    ``T = 1`` on the other fifth, summed over the five folds; otherwise ``T = 1``.
    The search runs over ``[T_min, 100]``, ``T_min`` the smallest temperature whose
    mean confidence on the held-out rows does not exceed the raw network's (see
    :func:`_sharpest_temperature`), and not below the smallest per-row sharpening
    floor (under it nothing changes): a temperature can take back the spread the
    posterior adds in distribution, not make the predictive sharper than the network,
    on average or at any row's logits (the likelihood's per-row floor).

    Parameters
    ----------
    likelihood : Categorical or Bernoulli
        The classification likelihood (its link approximation is used).
    mean : Tensor of shape (n, C)
    cov : Tensor of shape (n, C, C)
    y : Tensor of shape (n,)
        Class indices.
    eps : Tensor, optional
        Fixed standard normal draws for ``link_approx="mc"`` (common random numbers
        make the NLL a smooth function of ``T``).
    warn : bool, default=True
        Warn when the optimum sits on the upper bound of the search interval, or on
        the sharpening limit with a held-out NLL still above the network's own.

    Returns
    -------
    temperature : float
    trace : dict
    """
    def fit(rows):
        return _fit_temperature(likelihood, mean, cov, y, eps, rows)

    def nll_at(T, rows):
        e = None if eps is None else eps[:, rows]
        with torch.no_grad():
            return float(-likelihood.with_temperature(T).log_predictive(
                mean[rows], cov[rows], y[rows], eps=e).sum())

    n = int(mean.shape[0])
    everything = torch.arange(n)
    (u, val, at_edge, grid, vals), t_min, raw_conf = fit(everything)
    # Kept only where it helps out of sample: a temperature fitted on the other folds
    # must beat T = 1 on each held-out fold, summed over CALIBRATION_FOLDS folds (with
    # few held-out errors the NLL's minimiser is driven by the correctly classified
    # rows alone and does not generalise; docs/hyperparameters.md).
    folds = min(CALIBRATION_FOLDS, n)
    oof_fit = oof_one = 0.0
    for k in range(folds):
        test = everything[k::folds]
        train = everything[torch.arange(n) % folds != k]
        (uk, *_), *_ = fit(train)
        oof_fit += nll_at(math.exp(uk), test)
        oof_one += nll_at(1.0, test)
    helps = oof_fit < oof_one
    T = math.exp(u) if helps else 1.0
    if warn and helps and at_edge and u > 0:
        _warn_temperature_at_upper_bound()
    # The lower end is a cap by design (the network's own sharpness, on average and
    # per row), reached whenever the held-out rows have (almost) no errors; the trace
    # records it (``"at_sharpening_limit"``). It warns only when the predictive there is
    # still clearly worse on the held-out rows than the network alone: the posterior's
    # spread is then wider than those rows support, which no temperature may undo.
    at_limit = bool(u - math.log(t_min) < 1e-3)
    with torch.no_grad():
        raw_nll = float(-likelihood.with_temperature(1.0).log_predictive(
            mean, torch.zeros_like(cov), y, eps=eps).mean())
    best = nll_at(T, everything) / n
    if warn and helps and at_limit and \
            best - raw_nll > max(SHARPENING_GAP_ABS, SHARPENING_GAP_REL * raw_nll):
        warnings.warn(
            f"temperature_ ended at its sharpening limit {T:.3g} (the predictive as sharp as "
            f"the network allows) with the held-out NLL there, {best:.4f}, still above the "
            f"network's own, {raw_nll:.4f}, on these {n} rows: the posterior's spread is wider "
            "than the held-out rows support. Pass a prior_variance below the fitted "
            "prior_variance_ (try a tenth; compare held-out NLL and off-data behaviour), or "
            "check that the held-out rows come from the training distribution",
            HyperparameterWarning, stacklevel=3)
    trace = {"temperature": np.exp(grid), "score": vals, "best_score": best,
             "fitted_temperature": math.exp(u), "kept": bool(helps),
             "out_of_fold_nll": oof_fit / n, "out_of_fold_nll_at_1": oof_one / n,
             "score_at_1": nll_at(1.0, everything) / n, "min_temperature": t_min,
             "raw_confidence": raw_conf, "n_rows": n, "network_nll": raw_nll,
             "at_sharpening_limit": at_limit, "at_upper_bound": bool(at_edge and u > 0)}
    return T, trace


def _spread_gap(trace):
    """``(held-out NLL - the network's own, the tolerance)`` of a temperature's trace."""
    raw = trace["network_nll"]
    return trace["best_score"] - raw, max(SHARPENING_GAP_ABS, SHARPENING_GAP_REL * raw)


def calibrate_classification(likelihood, mean, cov, y, *, eps=None, warn=True):
    """A temperature, and a scale of the latent covariance where a temperature is not enough.

    First the temperature alone (:func:`calibrate_temperature`). When the held-out
    NLL there is still above the network's own by more than ``max(0.005, 10 %)`` of
    it, the posterior's spread is wider than the held-out rows support and no
    temperature may take it back (the cap: the predictive no sharper than the
    network). Then the latent covariance ``S(x)`` is multiplied by the **largest**
    ``c`` in ``[COVARIANCE_SCALE_MIN, 1]`` at which the tempered predictive's held-out
    NLL (temperature refitted) comes within that tolerance, found by bisection in
    ``log c``. The scale only shrinks, and only as far as the rows ask: where the
    temperature suffices (every case where the posterior's spread fits the held-out
    rows) ``c = 1`` and the result is :func:`calibrate_temperature`'s; the criterion
    cannot be won by deleting the posterior, since any smaller ``c`` that also meets
    the tolerance is not taken.

    Parameters
    ----------
    likelihood : Categorical or Bernoulli
        The classification likelihood (its link approximation is used).
    mean : Tensor of shape (n, C)
    cov : Tensor of shape (n, C, C)
    y : Tensor of shape (n,)
        Class indices.
    eps : Tensor, optional
        Fixed standard normal draws for ``link_approx="mc"``.
    warn : bool, default=True
        Warn when the temperature ends at the upper bound of its range, or when the
        scale ends at ``COVARIANCE_SCALE_MIN`` with the held-out NLL still above the
        tolerance.

    Returns
    -------
    temperature : float
    covariance_scale : float
    trace : dict
        :func:`calibrate_temperature`'s trace at the chosen scale, with
        ``"covariance_scale"`` and, when the scale was searched,
        ``"scale_search"``: the scales tried and their held-out NLL gaps.
    """
    T, trace = calibrate_temperature(likelihood, mean, cov, y, eps=eps, warn=False)
    gap, tol = _spread_gap(trace)
    c = 1.0
    if gap > tol:
        everything = torch.arange(int(mean.shape[0]))
        tried = []

        def gap_at(u):
            (_, val, *_), *_ = _fit_temperature(likelihood, mean, cov * math.exp(u), y, eps,
                                                everything)
            tried.append((math.exp(u), val - trace["network_nll"]))
            return val - trace["network_nll"]

        a, b = math.log(COVARIANCE_SCALE_MIN), 0.0
        if gap_at(a) > tol:
            b = a
        else:  # gap(a) <= tol < gap(b): the largest scale within the tolerance
            for _ in range(COVARIANCE_SCALE_STEPS):
                mid = 0.5 * (a + b)
                if gap_at(mid) <= tol:
                    a = mid
                else:
                    b = mid
            b = a
        c = math.exp(b)
        T, trace = calibrate_temperature(likelihood, mean, cov * c, y, eps=eps, warn=False)
        trace["scale_search"] = {"covariance_scale": np.array([t[0] for t in tried]),
                                 "nll_gap": np.array([t[1] for t in tried]), "tolerance": tol}
        gap, tol = _spread_gap(trace)
    trace["covariance_scale"] = c
    if warn and trace["kept"] and trace["at_upper_bound"]:
        _warn_temperature_at_upper_bound()
    if warn and gap > tol:
        warnings.warn(
            f"on these {trace['n_rows']} held-out rows the calibrated predictive's NLL, "
            f"{trace['best_score']:.4f}, stays above the network's own, "
            f"{trace['network_nll']:.4f}, with the latent covariance scaled down to "
            f"covariance_scale_ = {c:.3g} and temperature_ = {T:.3g}: check that the "
            "held-out rows come from the training distribution and that the network's "
            "outputs are its logits", HyperparameterWarning, stacklevel=3)
    return T, c, trace
