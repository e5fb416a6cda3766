"""Hyperparameter strategies: how ``"auto"`` prior and noise variances are chosen.

Every strategy is a small object with a ``name`` and a ``select`` method returning a
:class:`HyperResult` (the chosen ``prior_variance`` / ``noise_variance``, and a
``trace`` of the values tried and their scores). The estimator stores the name in
``hyper_strategy_`` and the trace in ``hyper_trace_``.

=====================  =============================================================
strategy               criterion
=====================  =============================================================
``fixed``              both given as floats: nothing is searched
``evidence``           the Laplace log marginal likelihood of the linearised model,
                       closed form over the GGN eigenvalues, maximised by L-BFGS-B
                       in log space (warns at a bound or without convergence)
``validation``         validation NLL on a log grid (the raw-network limit at its
                       floor), on data the network did not fit; only the GLM
                       eigenvalues change between candidates (warns at an edge)
``weight_norm``        ``s0^2 = ||theta_hat||^2 / P``: the evidence of the weights
                       alone (and the subspace evidence as K / P -> 0); the fallback
                       for full-network classification without held-out data
``em``                 the sampled-LLA EM updates of the prior precision
``variational``        learned with the variational energy by the optimisation loop
=====================  =============================================================

What ``"auto"`` means (``docs/hyperparameters.md``): the prior variance always comes
from the method's own objective (``evidence``, ``weight_norm``, ``em``,
``variational``), never from held-out rows, because held-out NLL in distribution cannot
see epistemic uncertainty and is won by deleting the posterior (a prior variance at the
floor of a grid). Held-out rows, when there are any, calibrate one scalar afterwards
that keeps the posterior covariance: for the regression GLM methods one scale ``c`` of
the evidence's pair, ``(c s0^2, c s2)`` (:class:`HeldOutNoise`; the noise variance
alone under a fixed prior), the additive noise variance otherwise
(:mod:`sklearn_lla._core.calibration`), or a classification temperature.
``validation`` (the joint grid) runs only when asked for by name, and warns, with the
next step, when it deletes the posterior.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field

import numpy as np
from scipy.optimize import minimize

__all__ = [
    "HyperResult",
    "HyperparameterWarning",
    "Fixed",
    "Evidence",
    "ValidationGrid",
    "WeightNorm",
    "EM",
    "VariationalEnergy",
    "HeldOutNoise",
    "glm_log_evidence",
    "resolve_strategy",
    "select_from_spectrum",
]


class HyperparameterWarning(UserWarning):
    """An ``"auto"`` hyperparameter ended at the edge of its search range."""


@dataclass
class HyperResult:
    """Outcome of a hyperparameter strategy.

    Attributes
    ----------
    prior_variance : float
    noise_variance : float or None
        ``None`` for classification.
    strategy : str
    trace : dict
        ``"prior_variance"``, ``"noise_variance"`` (arrays of candidates) and
        ``"score"`` (what was optimised, per candidate), plus strategy-specific keys.
    """

    prior_variance: float
    noise_variance: float | None
    strategy: str
    trace: dict = field(default_factory=dict)


class Fixed:
    """No search: both hyperparameters are given."""

    name = "fixed"

    def select(self, prior_variance, noise_variance):
        """Return the given values as a :class:`HyperResult`."""
        return HyperResult(float(prior_variance),
                           None if noise_variance is None else float(noise_variance),
                           self.name, {})


def glm_log_evidence(prior_variance, noise_variance, *, eigvals, theta_sq_norm, data_fit,
                     n_obs=0, n_outside=0):
    """Laplace log marginal likelihood of a linearised (GLM) model, up to a constant.

    ``log Z = log p(y | theta_hat) - ||theta_hat||^2 / (2 s0^2)
    - 1/2 sum_i log(1 + s0^2 e_i) - n_outside / 2 log s0^2``

    Parameters
    ----------
    prior_variance : float
        ``s0^2``.
    noise_variance : float or None
        ``s2`` (regression): ``eigvals`` are then those of the unit-noise GGN
        ``sum J^T J`` and ``data_fit`` is the residual sum of squares; ``None``
        (classification): ``eigvals`` of the GGN, ``data_fit`` = ``log p(y|theta)``.
    eigvals : ndarray
        Eigenvalues of the (unit-noise) GGN in the posterior's feature space.
    theta_sq_norm : float
        ``||theta_hat||^2``.
    data_fit : float
        Residual sum of squares (regression) or log likelihood (classification).
    n_obs : int
        Number of scalar observations (regression).
    n_outside : int
        Parameter directions outside the feature space (``P - K`` for a K-dimensional
        subspace of P parameters; 0 for the full space). Their prior normaliser stays
        in the evidence of a subspace Laplace approximation.

    Returns
    -------
    float
    """
    e = np.clip(np.asarray(eigvals, dtype=np.float64), 0.0, None)
    if noise_variance is None:
        fit, r = data_fit, prior_variance * e
    else:
        fit = (-0.5 * n_obs * math.log(2 * math.pi * noise_variance)
               - 0.5 * data_fit / noise_variance)
        r = prior_variance * e / noise_variance
    return (fit - 0.5 * theta_sq_norm / prior_variance - 0.5 * np.log1p(r).sum()
            - 0.5 * n_outside * math.log(prior_variance))


class Evidence:
    """Maximise the closed-form Laplace evidence (:func:`glm_log_evidence`).

    Parameters
    ----------
    bounds : tuple of float, default=(1e-12, 1e12)
        Range of both variances.
    """

    name = "evidence"

    def __init__(self, bounds=(1e-12, 1e12)):
        self.bounds = bounds

    def select(self, prior_variance, noise_variance, *, eigvals, theta_sq_norm, data_fit,
               n_obs=0, n_params=1, n_outside=0):
        """Return the evidence-optimal ``"auto"`` hyperparameters.

        Parameters
        ----------
        prior_variance, noise_variance : float or "auto"
            ``noise_variance=None`` for classification.
        eigvals, theta_sq_norm, data_fit, n_obs, n_outside
            As in :func:`glm_log_evidence`.
        n_params : int
            Number of parameters (for the starting value ``||theta||^2 / P``).

        Returns
        -------
        HyperResult
        """
        e = np.clip(np.asarray(eigvals, dtype=np.float64), 0.0, None)
        regression = noise_variance is not None
        fit_prior = prior_variance == "auto"
        fit_noise = regression and noise_variance == "auto"
        s0 = max(theta_sq_norm / max(n_params, 1), 1e-8) if fit_prior else float(prior_variance)
        if regression:
            s2 = max(data_fit / max(n_obs, 1), 1e-10) if fit_noise else float(noise_variance)
        else:
            s2 = None
        kw = dict(eigvals=e, theta_sq_norm=theta_sq_norm, data_fit=data_fit, n_obs=n_obs,
                  n_outside=n_outside)

        def unpack(u):
            a, b, i = s0, s2, 0
            if fit_prior:
                a, i = math.exp(u[0]), 1
            if fit_noise:
                b = math.exp(u[i])
            return a, b

        tried, scores = [], []

        def negobj(u):
            a, b = unpack(u)
            r = a * e / b if regression else a * e
            frac = r / (1.0 + r)
            val = glm_log_evidence(a, b, **kw)
            tried.append((a, b))
            scores.append(val)
            grad = []
            if fit_prior:
                grad.append(0.5 * theta_sq_norm / a - 0.5 * frac.sum() - 0.5 * n_outside)
            if fit_noise:
                grad.append(-0.5 * n_obs + 0.5 * data_fit / b + 0.5 * frac.sum())
            return -val, -np.asarray(grad)

        u0 = ([math.log(s0)] if fit_prior else []) + ([math.log(s2)] if fit_noise else [])
        if not u0:
            return Fixed().select(s0, s2)
        lo, hi = math.log(self.bounds[0]), math.log(self.bounds[1])
        res = minimize(negobj, np.asarray(u0), jac=True, method="L-BFGS-B",
                       bounds=[(lo, hi)] * len(u0))
        if not res.success:
            warnings.warn(f"the evidence optimisation did not converge ({res.message})",
                          HyperparameterWarning, stacklevel=3)
        if np.any(np.isclose(res.x, lo, atol=1e-6)) or np.any(np.isclose(res.x, hi, atol=1e-6)):
            warnings.warn("an evidence-optimal hyperparameter sits at the bound "
                          f"{self.bounds} of its search range", HyperparameterWarning,
                          stacklevel=3)
        a, b = unpack(res.x)
        arr = np.asarray(tried, dtype=object)
        trace = {"prior_variance": np.asarray([t[0] for t in tried], dtype=float),
                 "noise_variance": (np.asarray([t[1] for t in tried], dtype=float)
                                    if regression else None),
                 "score": np.asarray(scores), "log_evidence": float(glm_log_evidence(a, b, **kw)),
                 "n_evaluations": len(arr)}
        return HyperResult(a, b, self.name, trace)


class WeightNorm:
    """``prior_variance = ||theta_hat||^2 / P``, the prior's own maximum likelihood.

    Measured on scikit-learn's bundled classification sets with skorch nets that
    (as usual) fit their training data almost perfectly, the full-network Laplace
    evidence chose prior variances 30-200 times this value and made the predictive
    far less calibrated than the network (``docs/calibration.md``); this value kept
    or improved calibration. The noise variance is not set here.
    """

    name = "weight_norm"

    def select(self, prior_variance, noise_variance, *, theta_sq_norm, n_params):
        """Return ``||theta||^2 / P`` for an ``"auto"`` prior variance."""
        s0 = (max(theta_sq_norm / max(n_params, 1), 1e-12) if prior_variance == "auto"
              else float(prior_variance))
        return HyperResult(s0, None if noise_variance is None else float(noise_variance),
                           self.name, {"prior_variance": np.array([s0])})


class ValidationGrid:
    """Minimise validation NLL over a log grid of prior (and noise) variances.

    The prior grid is ``base_prior * prior_grid`` and always reaches down to the
    raw-network limit (a prior variance so small that the posterior adds nothing);
    the noise grid is ``base_noise * noise_grid``.

    Parameters
    ----------
    prior_grid : array-like, default=logspace(-6, 4, 41)
    noise_grid : array-like, default=logspace(-1, 1, 21)
    """

    name = "validation"

    def __init__(self, prior_grid=None, noise_grid=None):
        self.prior_grid = np.logspace(-6, 4, 41) if prior_grid is None else np.asarray(prior_grid)
        self.noise_grid = np.logspace(-1, 1, 21) if noise_grid is None else np.asarray(noise_grid)

    def candidates(self, prior_variance, noise_variance, base_prior, base_noise):
        """The prior and noise candidate arrays for the given settings."""
        s0 = (base_prior * self.prior_grid if prior_variance == "auto"
              else np.array([float(prior_variance)]))
        if noise_variance is None:
            s2 = np.array([np.nan])
        elif noise_variance == "auto":
            s2 = base_noise * self.noise_grid
        else:
            s2 = np.array([float(noise_variance)])
        return s0, s2

    def select(self, prior_variance, noise_variance, *, score, base_prior, base_noise=None,
               warn=True):
        """Pick the candidate with the lowest validation NLL.

        Parameters
        ----------
        prior_variance, noise_variance : float or "auto"
            ``noise_variance=None`` for classification.
        score : callable
            ``score(s0_array, s2_array) -> ndarray (len(s0), len(s2))`` of validation
            NLL (``s2`` is NaN for classification).
        base_prior, base_noise : float
            Scales of the grids.
        warn : bool, default=True
            Warn when the optimum sits on an edge of a searched grid.

        Returns
        -------
        HyperResult
        """
        s0, s2 = self.candidates(prior_variance, noise_variance, base_prior, base_noise)
        scores = _finite_scores(score(s0, s2)).reshape(len(s0), len(s2))
        if not np.isfinite(scores).any():
            raise FloatingPointError(
                "the validation NLL is not finite for any candidate hyperparameter"
            )
        i, j = np.unravel_index(np.argmin(scores), scores.shape)
        if warn:
            self._warn_edges(i, j, s0, s2, prior_variance, noise_variance)
        trace = {"prior_variance": s0, "noise_variance": None if noise_variance is None else s2,
                 "score": scores, "best_score": float(scores[i, j])}
        return HyperResult(float(s0[i]), None if noise_variance is None else float(s2[j]),
                           self.name, trace)

    @staticmethod
    def _warn_edges(i, j, s0, s2, prior_variance, noise_variance):
        msgs = []
        if prior_variance == "auto" and len(s0) > 1:
            if i == 0:
                msgs.append(
                    "hyper_strategy='validation' chose the smallest prior_variance of its "
                    f"grid ({s0[0]:.3g}): the estimator now returns the raw network with a "
                    "constant noise std and no posterior variance (the validation rows, "
                    "drawn from the training distribution, cannot reward uncertainty away "
                    "from the data). Use hyper_strategy='auto' (prior variance from the "
                    "method's objective, noise / temperature calibrated on the held-out "
                    "rows), or pass a prior_variance")
            elif i == len(s0) - 1:
                msgs.append(f"hyper_strategy='validation' chose the largest prior_variance of "
                            f"its grid ({s0[-1]:.3g}); pass a larger prior_variance or use "
                            "hyper_strategy='auto'")
        if noise_variance == "auto" and len(s2) > 1 and j in (0, len(s2) - 1):
            msgs.append(f"noise_variance is at the {'lower' if j == 0 else 'upper'} edge of "
                        "its grid")
        for m in msgs:
            warnings.warn(m, HyperparameterWarning, stacklevel=4)


class EM:
    """Expectation-maximisation of the prior precision (sampled LLA).

    The method supplies one EM update ``step(prior_variance) -> (prior_variance,
    info)``; this object runs ``n_steps`` of them and records the trace.

    Parameters
    ----------
    n_steps : int, default=3
    """

    name = "em"

    def __init__(self, n_steps=3):
        self.n_steps = int(n_steps)

    def run(self, step, prior_variance, noise_variance=None):
        """Iterate ``step`` from ``prior_variance`` and return a :class:`HyperResult`."""
        values, infos = [float(prior_variance)], []
        for _ in range(self.n_steps):
            prior_variance, info = step(prior_variance)
            values.append(float(prior_variance))
            infos.append(info)
        return HyperResult(float(prior_variance), noise_variance, self.name,
                           {"prior_variance": np.asarray(values), "steps": infos})


class VariationalEnergy:
    """Hyperparameters learned jointly with the variational parameters.

    The optimisation loop (:mod:`sklearn_lla._core.optim`) moves them; this object only
    turns the loop's history into a :class:`HyperResult`.
    """

    name = "variational"

    def result(self, prior_variance, noise_variance, history):
        """Wrap the learned values and the optimisation ``history``."""
        return HyperResult(float(prior_variance),
                           None if noise_variance is None else float(noise_variance),
                           self.name, dict(history))


#: Scales ``c`` of the objective's ``(s0^2, s2)`` that :class:`HeldOutNoise` scores, in
#: units of ``c0 = (mean squared held-out residual) / s2``, the largest scale the
#: held-out rows can call for (``1e-4 .. 10^0.2``, 0.05 decades apart).
SCALE_GRID = np.logspace(-4, 0.2, 85)


def _finite_scores(scores):
    """A flat float64 array of held-out NLLs, non-finite ones replaced by ``inf``."""
    scores = np.asarray(scores, dtype=np.float64).reshape(-1)
    return np.where(np.isfinite(scores), scores, np.inf)


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


class HeldOutNoise:
    """Regression hyperparameters on held-out rows: one scalar, the posterior kept.

    **The prior chosen by the objective** (``anchor``: the method's own joint optimum
    ``(s0^2, s2)`` on the training rows). Held-out rows fit one scale ``c`` of the
    pair, ``(c s0^2, c s2)``: for a Gaussian linear model the posterior at ``(c s0^2, c
    s2)`` is exactly ``c`` times the one at ``(s0^2, s2)``, so the predictive keeps the
    objective's shape (its signal-to-noise ratio, and how much wider it grows off the
    data) and only its overall scale is fitted, by held-out NLL (the Gaussian maximum
    likelihood scale; it is at most ``c0``, the held-out mean squared residual over
    ``s2``, since the latent variance is non-negative). A scale cannot switch the
    posterior off. (Moving along the evidence ridge instead, each candidate noise
    paired with the evidence's prior for it, let 53-89 held-out rows trade most of the
    noise for prior variance in directions no training row determines: exact LLA on
    diabetes, P ~ 3,000 >> N = 264, came out 0.02-0.05 nats worse than the raw net;
    docs/calibration.md.)

    **A fixed prior variance** (``anchor=None``): the noise variance alone, by held-out
    NLL on a log grid around the network's mean squared held-out residual, paired
    with ``prior_of(s2)`` (the fixed value).

    Parameters
    ----------
    noise_grid : array-like, default=logspace(-3, 1, 41)
        Noise candidates relative to the mean squared held-out residual (fixed prior).
    """

    name = "held_out_noise"

    def __init__(self, noise_grid=None):
        self.noise_grid = (np.logspace(-3, 1, 41) if noise_grid is None
                           else np.asarray(noise_grid, dtype=float))

    def select(self, prior_of, *, score, base_noise, warn=True, anchor=None):
        """The held-out NLL's best rescaling of ``anchor`` (or noise, for a fixed prior).

        Parameters
        ----------
        prior_of : callable
            ``s2 -> s0^2``, the prior variance for a noise variance (used when
            ``anchor`` is ``None``).
        score : callable
            ``score(s0_array, s2_array) -> ndarray`` of held-out NLL per *pair*.
        base_noise : float
            The mean squared held-out residual of the network.
        warn : bool, default=True
            Warn when the optimum sits on an edge of the grid.
        anchor : tuple of float, optional
            ``(s0^2, s2)`` of the objective's joint optimum (a prior chosen by the
            objective); ``None`` for a fixed prior variance.

        Returns
        -------
        prior_variance, noise_variance : float
        trace : dict
            ``"scale"`` is the chosen ``c`` (``None`` for a fixed prior).
        """
        if anchor is not None:
            return self._rescale(anchor, score, base_noise, warn)
        s2 = base_noise * self.noise_grid

        def by_noise(v):
            return score(np.array([prior_of(u) for u in v]), v)

        sc = _finite_scores(by_noise(s2))
        if not np.isfinite(sc).any():
            raise FloatingPointError("the held-out NLL is not finite for any noise variance")
        i = int(np.argmin(sc))
        at_edge = len(s2) > 1 and i in (0, len(s2) - 1)
        if not at_edge and len(s2) > 1:
            s2, sc, i = _refine(s2, sc, i, by_noise)
        s0 = np.array([prior_of(v) for v in s2])
        if at_edge and warn:
            where = "lower" if i == 0 else "upper"
            msg = (f"noise_variance_, calibrated on the held-out rows, is at the {where} edge "
                   f"of its grid ({s2[i]:.3g}, {self.noise_grid[0 if i == 0 else -1]:g} x the "
                   "network's mean squared residual there)")
            msg += ("; the posterior's latent variance alone over-explains the held-out "
                    "residuals: pass a prior_variance below prior_variance_ if the intervals "
                    "are too wide" if i == 0 else
                    "; check that the held-out targets are on the scale of y")
            warnings.warn(msg, HyperparameterWarning, stacklevel=3)
        trace = {"prior_variance": s0, "noise_variance": s2, "score": sc,
                 "best_score": float(sc[i]), "mse_held_out": float(base_noise), "scale": None}
        return float(s0[i]), float(s2[i]), trace

    @staticmethod
    def _rescale(anchor, score, base_noise, warn):
        """The held-out NLL's best ``c`` in ``(c s0^2, c s2)`` (see the class docstring)."""
        a0, a2 = float(anchor[0]), float(anchor[1])
        c = SCALE_GRID * (float(base_noise) / max(a2, 1e-300))

        def by_scale(v):
            return score(a0 * v, a2 * v)

        sc = _finite_scores(by_scale(c))
        if not np.isfinite(sc).any():
            raise FloatingPointError("the held-out NLL is not finite for any scale")
        i = int(np.argmin(sc))
        if 0 < i < len(c) - 1:
            c, sc, i = _refine(c, sc, i, by_scale)
        elif i == 0 and warn:
            warnings.warn(
                f"noise_variance_ and prior_variance_ are the objective's pair scaled by the "
                f"lowest candidate: the held-out rows call for a scale below {SCALE_GRID[0]:g} "
                "times the largest their residuals allow, as the posterior's latent variance "
                "alone over-explains them. Check that the held-out rows come from the training "
                "data's distribution and that their targets are on the scale of y; otherwise "
                "pass a prior_variance below prior_variance_",
                HyperparameterWarning, stacklevel=3)
        trace = {"prior_variance": a0 * c, "noise_variance": a2 * c, "score": sc,
                 "best_score": float(sc[i]), "mse_held_out": float(base_noise),
                 "scale": float(c[i]), "anchor": (a0, a2)}
        return float(a0 * c[i]), float(a2 * c[i]), trace


#: The strategies a GLM-type posterior accepts for ``hyper``.
GLM_STRATEGIES = ("auto", "evidence", "validation", "weight_norm")


def resolve_strategy(hyper, *, auto, has_validation, fallback="evidence",
                     allowed=GLM_STRATEGIES):
    """The strategy that chooses the ``"auto"`` prior (and, without held-out rows, noise).

    Parameters
    ----------
    hyper : str
        The requested strategy; ``"auto"`` means ``fallback`` (the method's objective).
    auto : bool
        Whether any hyperparameter is ``"auto"`` (else ``"fixed"``).
    has_validation : bool
        Whether rows the network did not fit are available.
    fallback : str, default="evidence"
        The method's objective for ``"auto"``.
    allowed : tuple of str
        Accepted values of ``hyper``.

    Returns
    -------
    str
    """
    if hyper not in allowed:
        raise ValueError(f"hyper_strategy must be one of {allowed}, got {hyper!r}")
    if not auto:
        return "fixed"
    if hyper == "auto":
        return fallback
    if hyper == "validation" and not has_validation:
        raise ValueError("hyper_strategy='validation' needs rows the network did not fit: "
                         "pass validation_data=(X_val, y_val) to fit")
    return hyper


def select_from_spectrum(strategy, prior_variance, noise_variance, *, eigvals, theta_sq_norm,
                         data_fit, n_obs, n_params, n_outside=0, prior_scale=1.0,
                         score=None, base_prior=None, base_noise=None, grid=None, warn=True):
    """Run ``strategy`` on a GLM posterior's spectrum: the one dispatch of every GLM method.

    Parameters
    ----------
    strategy : {"fixed", "evidence", "weight_norm", "validation"}
        As returned by :func:`resolve_strategy`.
    prior_variance, noise_variance : float or "auto"
        ``noise_variance=None`` for classification.
    eigvals : ndarray
        Eigenvalues of the (unit-noise) GGN in the posterior's feature space, whitened
        by the prior Gram.
    theta_sq_norm, data_fit, n_obs, n_outside
        As in :func:`glm_log_evidence`.
    n_params : int
        Number of parameters (the weight-norm value ``||theta||^2 / P``).
    prior_scale : float, default=1.0
        The prior precision's weight ``n_seen / N`` during early stopping: the
        evidence is that of the ``n_seen`` rows seen, whose prior variance is
        ``s0^2 / prior_scale``.
    score, base_prior, base_noise, grid, warn
        The ``validation`` strategy's held-out score, grid scales and grid.

    Returns
    -------
    HyperResult
    """
    if strategy == "fixed":
        return Fixed().select(prior_variance, noise_variance)
    if strategy == "weight_norm":
        return WeightNorm().select(prior_variance, noise_variance, theta_sq_norm=theta_sq_norm,
                                   n_params=n_params)
    if strategy == "evidence":
        fixed_prior = prior_variance != "auto"
        res = Evidence().select(
            float(prior_variance) / prior_scale if fixed_prior else "auto", noise_variance,
            eigvals=eigvals, theta_sq_norm=theta_sq_norm, data_fit=data_fit, n_obs=n_obs,
            n_params=n_params, n_outside=n_outside)
        res.prior_variance *= prior_scale
        return res
    if strategy == "validation":
        return (grid or ValidationGrid()).select(prior_variance, noise_variance, score=score,
                                                 base_prior=base_prior, base_noise=base_noise,
                                                 warn=warn)
    raise ValueError(f"unknown hyperparameter strategy {strategy!r}")
