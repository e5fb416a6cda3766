"""Hyperparameter strategies: how ``"auto"`` prior and noise variances are chosen.

The rule: the prior variance comes from the method's own objective, never from
held-out rows; rows the network did not fit calibrate one scalar afterwards
(:mod:`sklearn_lla._core.calibration`). Held-out NLL in distribution cannot see
epistemic uncertainty and is won by deleting the posterior, so the joint held-out
search (``validation``) runs only when asked for by name, and warns when it does.

Every strategy is an object with a ``name`` and ``select(context) -> HyperResult``;
the :class:`HyperContext` carries what any of them reads. :data:`OBJECTIVE` maps
(method family, task) to the objective behind ``hyper_strategy="auto"`` and
:data:`STRATEGIES` maps a name to its class: :func:`resolve` and :func:`select` are the
one place a strategy is chosen by name.

=====================  =============================================================
strategy               criterion
=====================  =============================================================
``fixed``              both given as floats: nothing is searched
``evidence``           the Laplace log marginal likelihood of the linearised model,
                       closed form over the GGN eigenvalues, maximised by L-BFGS-B
                       in log space (warns at a bound or without convergence)
``validation``         validation NLL on a log grid (the raw-network limit at its
                       floor), on data the network did not fit
``weight_norm``        ``s0^2 = ||theta_hat||^2 / P``: the evidence of the weights
                       alone (and the subspace evidence as K / P -> 0)
``em``                 the EM updates of the prior precision (sampled LLA)
``variational``        learned with the variational energy by the optimisation loop
=====================  =============================================================
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
from scipy.optimize import minimize

__all__ = [
    "HyperContext",
    "HyperResult",
    "HyperparameterWarning",
    "Fixed",
    "Evidence",
    "ValidationGrid",
    "WeightNorm",
    "EM",
    "VariationalEnergy",
    "OBJECTIVE",
    "STRATEGIES",
    "glm_log_evidence",
    "resolve",
    "select",
]


class HyperparameterWarning(UserWarning):
    """An ``"auto"`` hyperparameter ended at the edge of its search range."""


@dataclass(frozen=True)
class HyperResult:
    """Outcome of a hyperparameter strategy (never edited after it is returned).

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


@dataclass(frozen=True)
class HyperContext:
    """What a strategy may read: the settings and the method's statistics.

    Attributes
    ----------
    prior_variance, noise_variance : float, "auto" or None
        The settings (``noise_variance=None``: classification). For ``fixed`` and
        ``variational`` the values in use.
    eigvals : ndarray or None
        Eigenvalues of the (unit-noise) GGN in the posterior's feature space.
    theta_sq_norm : float
        ``||theta_hat||^2``.
    data_fit : float
        Residual sum of squares (regression) or log likelihood (classification).
    n_obs : int
        Scalar observations (regression).
    n_params : int
        Parameters (the weight norm ``||theta||^2 / P``).
    n_outside : int
        Parameter directions outside the feature space (:func:`glm_log_evidence`).
    outside_log_det : callable or None
        ``(s0^2, s2) -> (value, d / d log s0^2, d / d log s2)``: the Occam term of a
        posterior's curvature outside its feature space (:func:`glm_log_evidence`).
    prior_scale : float
        The prior precision's weight ``n_seen / N`` during early stopping: the
        evidence is that of the ``n_seen`` rows seen, at prior ``s0^2 / prior_scale``.
    score : callable or None
        ``score(s0_array, s2_array) -> ndarray (len(s0), len(s2))``: held-out NLL.
    base_prior, base_noise : float or None
        Scales of the held-out grids.
    scan : callable or None
        A method's own held-out search, ``scan(grid) -> HyperResult``, run by
        ``validation`` instead of scoring the grid.
    em_step : callable or None
        One EM update ``(s0, s2) -> (s0, s2, info)`` (updating the ``"auto"`` ones).
    start : tuple or None
        ``(s0^2, s2)`` an iterative strategy starts from.
    noise_update : callable or None
        ``s0 -> HyperResult``: the method's fit of an ``"auto"`` noise under a given
        prior (``weight_norm``; sampled LLA's EM noise update).
    history : dict or None
        The trace of an optimisation loop that produced the values (kept).
    warn : bool
        Warn at the edge of a search range.
    """

    prior_variance: float | str = "auto"
    noise_variance: float | str | None = None
    eigvals: np.ndarray | None = None
    theta_sq_norm: float = 0.0
    data_fit: float = 0.0
    n_obs: int = 0
    n_params: int = 1
    n_outside: int = 0
    outside_log_det: Callable | None = None
    prior_scale: float = 1.0
    score: Callable | None = None
    base_prior: float | None = None
    base_noise: float | None = None
    scan: Callable | None = None
    em_step: Callable | None = None
    start: tuple | None = None
    noise_update: Callable | None = None
    history: dict | None = None
    warn: bool = True

    @property
    def evidence_kwargs(self):
        """The keyword arguments of :func:`glm_log_evidence`."""
        return dict(eigvals=np.clip(np.asarray(self.eigvals, dtype=np.float64), 0.0, None),
                    theta_sq_norm=self.theta_sq_norm, data_fit=self.data_fit,
                    n_obs=self.n_obs, n_outside=self.n_outside,
                    outside_log_det=self.outside_log_det)


def _value(v):
    """A given variance as a float (``None`` stays ``None``)."""
    return None if v is None else float(v)


class _Strategy:
    """Base of the strategies: what a method must provide for one to run."""

    name = ""
    #: Whether the strategy reads the GGN spectrum (else one factor of the posterior).
    needs_spectrum = False
    #: Whether the strategy scores rows the network did not fit (then nothing is
    #: calibrated on them afterwards).
    uses_held_out = False
    #: Whether the strategy iterates the linear model's mode (EM's M-step).
    needs_mode = False


class Fixed(_Strategy):
    """No search: both hyperparameters are given."""

    name = "fixed"

    def select(self, ctx):
        """Return the given values as a :class:`HyperResult`."""
        return HyperResult(float(ctx.prior_variance), _value(ctx.noise_variance), self.name,
                           dict(ctx.history or {}))


def glm_log_evidence(prior_variance, noise_variance, *, eigvals, theta_sq_norm, data_fit,
                     n_obs=0, n_outside=0, outside_log_det=None):
    """Laplace log marginal likelihood of a linearised (GLM) model, up to a constant.

    ``log Z = log p(y | theta_hat) - ||theta_hat||^2 / (2 s0^2)
    - 1/2 sum_i log(1 + s0^2 e_i) - n_outside / 2 log s0^2 - 1/2 L_perp(s0^2, s2)``

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
    outside_log_det : callable or None
        ``(s0^2, s2) -> (L_perp, ...)``: ``log det(I + s0^2 H_perp / s2)`` of the
        curvature a posterior puts outside its feature space (ELLA's and subspace
        Laplace's KFAC complement,
        :meth:`~sklearn_lla._posteriors.complement.KFACComplement.outside_log_det`);
        ``None``: none (0).

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
    outside = 0.0 if outside_log_det is None else outside_log_det(prior_variance,
                                                                 noise_variance)[0]
    return (fit - 0.5 * theta_sq_norm / prior_variance - 0.5 * np.log1p(r).sum()
            - 0.5 * n_outside * math.log(prior_variance) - 0.5 * outside)


class Evidence(_Strategy):
    """Maximise the closed-form Laplace evidence (:func:`glm_log_evidence`).

    Parameters
    ----------
    bounds : tuple of float, default=(1e-12, 1e12)
        Range of both variances.
    """

    name = "evidence"
    needs_spectrum = True

    def __init__(self, bounds=(1e-12, 1e12)):
        self.bounds = bounds

    def select(self, ctx):
        """Return the evidence-optimal ``"auto"`` hyperparameters of ``ctx``.

        The evidence is that of the rows seen, at prior ``s0^2 / ctx.prior_scale``; the
        returned prior variance is its optimum times ``ctx.prior_scale``.

        Parameters
        ----------
        ctx : HyperContext
            ``eigvals``, ``theta_sq_norm``, ``data_fit``, ``n_obs``, ``n_outside``,
            ``outside_log_det``, ``n_params`` (the start ``||theta||^2 / P``) and
            ``prior_scale``.

        Returns
        -------
        HyperResult
        """
        kw = ctx.evidence_kwargs
        e, theta_sq_norm, data_fit = kw["eigvals"], ctx.theta_sq_norm, ctx.data_fit
        n_obs, n_outside, outside = ctx.n_obs, ctx.n_outside, ctx.outside_log_det
        regression = ctx.noise_variance is not None
        fit_prior = ctx.prior_variance == "auto"
        fit_noise = regression and ctx.noise_variance == "auto"
        s0 = (max(theta_sq_norm / max(ctx.n_params, 1), 1e-8) if fit_prior
              else float(ctx.prior_variance) / ctx.prior_scale)
        if regression:
            s2 = max(data_fit / max(n_obs, 1), 1e-10) if fit_noise else float(ctx.noise_variance)
        else:
            s2 = None

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
            val = glm_log_evidence(a, b, **{**kw, "outside_log_det": None})
            d_prior = d_noise = 0.0
            if outside is not None:  # the complement's Occam term, evaluated once
                v_out, d_prior, d_noise = outside(a, b)
                val -= 0.5 * v_out
            tried.append((a, b))
            scores.append(val)
            grad = []
            if fit_prior:
                grad.append(0.5 * theta_sq_norm / a - 0.5 * frac.sum() - 0.5 * n_outside
                            - 0.5 * d_prior)
            if fit_noise:
                grad.append(-0.5 * n_obs + 0.5 * data_fit / b + 0.5 * frac.sum()
                            - 0.5 * d_noise)
            return -val, -np.asarray(grad)

        u0 = ([math.log(s0)] if fit_prior else []) + ([math.log(s2)] if fit_noise else [])
        if not u0:
            return HyperResult(s0 * ctx.prior_scale, s2, Fixed.name, {})
        lo, hi = math.log(self.bounds[0]), math.log(self.bounds[1])
        res = minimize(negobj, np.asarray(u0), jac=True, method="L-BFGS-B",
                       bounds=[(lo, hi)] * len(u0))
        if not res.success:
            warnings.warn(f"the evidence optimisation did not converge ({res.message})",
                          HyperparameterWarning, stacklevel=4)
        if np.any(np.isclose(res.x, lo, atol=1e-6)) or np.any(np.isclose(res.x, hi, atol=1e-6)):
            warnings.warn("an evidence-optimal hyperparameter sits at the bound "
                          f"{self.bounds} of its search range", HyperparameterWarning,
                          stacklevel=4)
        a, b = unpack(res.x)
        trace = {"prior_variance": np.asarray([t[0] for t in tried], dtype=float),
                 "noise_variance": (np.asarray([t[1] for t in tried], dtype=float)
                                    if regression else None),
                 "score": np.asarray(scores), "log_evidence": float(glm_log_evidence(a, b, **kw)),
                 "n_evaluations": len(tried)}
        return HyperResult(a * ctx.prior_scale, b, self.name, trace)


class WeightNorm(_Strategy):
    """``prior_variance = ||theta_hat||^2 / P``, the prior's own maximum likelihood.

    The noise variance is not set here: a given one is kept, and an ``"auto"`` one is
    fitted by the method's ``ctx.noise_update`` under this prior.
    """

    name = "weight_norm"

    def select(self, ctx):
        """Return ``||theta||^2 / P`` for an ``"auto"`` prior variance."""
        s0 = (max(ctx.theta_sq_norm / max(ctx.n_params, 1), 1e-12)
              if ctx.prior_variance == "auto" else float(ctx.prior_variance))
        if ctx.noise_variance == "auto" and ctx.noise_update is not None:
            noise = ctx.noise_update(s0)
            return HyperResult(s0, noise.noise_variance, self.name, dict(noise.trace))
        return HyperResult(s0, _value(ctx.noise_variance), self.name,
                           {**(ctx.history or {}), "prior_variance": np.array([s0])})


class ValidationGrid(_Strategy):
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
    needs_spectrum = True
    uses_held_out = True

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

    def select(self, ctx):
        """Pick the candidate with the lowest validation NLL.

        Parameters
        ----------
        ctx : HyperContext
            ``score`` (``s2`` is NaN for classification), ``base_prior`` and
            ``base_noise`` (the grids' scales), ``warn`` (at an edge of a searched
            grid); or ``scan``, a method's own search over this grid.

        Returns
        -------
        HyperResult
        """
        if ctx.scan is not None:
            return ctx.scan(self)
        prior_variance, noise_variance = ctx.prior_variance, ctx.noise_variance
        s0, s2 = self.candidates(prior_variance, noise_variance, ctx.base_prior, ctx.base_noise)
        scores = _finite_scores(ctx.score(s0, s2)).reshape(len(s0), len(s2))
        if not np.isfinite(scores).any():
            raise FloatingPointError(
                "the validation NLL is not finite for any candidate hyperparameter"
            )
        i, j = np.unravel_index(np.argmin(scores), scores.shape)
        if ctx.warn:
            self.warn_edges(i, j, s0, s2, prior_variance, noise_variance)
        trace = {"prior_variance": s0, "noise_variance": None if noise_variance is None else s2,
                 "score": scores, "best_score": float(scores[i, j])}
        return HyperResult(float(s0[i]), None if noise_variance is None else float(s2[j]),
                           self.name, trace)

    @staticmethod
    def warn_edges(i, j, s0, s2, prior_variance, noise_variance):
        """Warn when candidate ``(i, j)`` sits on an edge of a searched grid."""
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
            warnings.warn(m, HyperparameterWarning, stacklevel=5)


class EM(_Strategy):
    """Expectation-maximisation of the prior precision (sampled LLA).

    The method supplies one EM update ``ctx.em_step(s0, s2) -> (s0, s2, info)``
    (updating the ``"auto"`` ones); this object runs ``n_steps`` of them from
    ``ctx.start`` and records the trace.

    Parameters
    ----------
    n_steps : int, default=3
    """

    name = "em"
    needs_mode = True

    def __init__(self, n_steps=3):
        self.n_steps = int(n_steps)

    def select(self, ctx):
        """Iterate ``ctx.em_step`` from ``ctx.start`` and return a :class:`HyperResult`."""
        s0, s2 = ctx.start
        values, infos = [float(s0)], []
        for _ in range(self.n_steps):
            s0, s2, info = ctx.em_step(s0, s2)
            values.append(float(s0))
            infos.append(info)
        return HyperResult(float(s0), s2, self.name,
                           {"prior_variance": np.asarray(values), "steps": infos})


class VariationalEnergy(_Strategy):
    """Hyperparameters learned jointly with the variational parameters.

    The optimisation loop (:mod:`sklearn_lla._core.optim`) moves them; this object only
    turns the learned values and the loop's ``ctx.history`` into a :class:`HyperResult`.
    """

    name = "variational"

    def select(self, ctx):
        """Wrap the learned values and the optimisation history."""
        return HyperResult(float(ctx.prior_variance), _value(ctx.noise_variance), self.name,
                           dict(ctx.history or {}))


def _finite_scores(scores):
    """A flat float64 array of held-out NLLs, non-finite ones replaced by ``inf``."""
    scores = np.asarray(scores, dtype=np.float64).reshape(-1)
    return np.where(np.isfinite(scores), scores, np.inf)


#: Every strategy by name.
STRATEGIES = {cls.name: cls for cls in (Fixed, Evidence, ValidationGrid, WeightNorm, EM,
                                        VariationalEnergy)}

#: The objective behind ``hyper_strategy="auto"``, per (method family, task). The prior
#: variance of a classifier is the weight norm: for a network that fits its training
#: labels the softmax curvature there vanishes and the evidence (or EM) then chooses a
#: prior far too broad (``docs/hyperparameters.md``).
OBJECTIVE = {
    ("glm", "regression"): "evidence",
    ("glm", "classification"): "weight_norm",
    ("sampled", "regression"): "em",
    ("sampled", "classification"): "weight_norm",
    ("variational", "regression"): "variational",
    ("variational", "classification"): "weight_norm",
}

#: The strategies a GLM-type posterior accepts for ``hyper``.
GLM_STRATEGIES = ("auto", "evidence", "validation", "weight_norm")


def resolve(hyper, *, family, task, auto, has_validation, allowed=GLM_STRATEGIES):
    """The name of the strategy that chooses the ``"auto"`` values.

    Parameters
    ----------
    hyper : str
        The requested strategy; ``"auto"`` means ``OBJECTIVE[(family, task)]``.
    family : {"glm", "sampled", "variational"}
        The method family.
    task : {"regression", "classification"}
    auto : bool
        Whether any hyperparameter is ``"auto"`` (else ``"fixed"``).
    has_validation : bool
        Whether rows the network did not fit are available.
    allowed : tuple of str
        Accepted values of ``hyper``.

    Returns
    -------
    str
    """
    if hyper not in allowed:
        raise ValueError(f"hyper_strategy must be one of {allowed}, got {hyper!r}")
    if not auto:
        return Fixed.name
    if hyper == "auto":
        return OBJECTIVE[(family, task)]
    if STRATEGIES[hyper].uses_held_out and not has_validation:
        raise ValueError(f"hyper_strategy={hyper!r} needs rows the network did not fit: "
                         "pass validation_data=(X_val, y_val) to fit")
    return hyper


def strategy(name, **configured):
    """The strategy called ``name``: ``configured[name]`` if given, else a default one."""
    return configured.get(name) or STRATEGIES[name]()


def select(name, ctx, **configured):
    """Run the strategy called ``name`` on ``ctx`` (see :func:`strategy`)."""
    return strategy(name, **configured).select(ctx)
