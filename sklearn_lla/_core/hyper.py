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

Which ``"auto"`` maps to which strategy is decided by each estimator (documented in
``docs/hyperparameters.md``): GLM methods use ``validation`` when held-out data is
available and ``evidence`` otherwise.
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
    "glm_log_evidence",
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
        scores = np.asarray(score(s0, s2), dtype=np.float64).reshape(len(s0), len(s2))
        scores = np.where(np.isfinite(scores), scores, np.inf)
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
                msgs.append("prior_variance is at the lower edge of its grid: the network's "
                            "own predictive (no posterior variance) scored best on the "
                            "validation data")
            elif i == len(s0) - 1:
                msgs.append("prior_variance is at the upper edge of its grid")
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
