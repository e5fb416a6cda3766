"""Split-conformal calibration of the Laplace predictive: intervals and prediction sets.

The mixins here give every regressor ``conformalize`` and ``predict_interval``, and
every classifier ``conformalize`` and ``predict_set``. Both calibrate a *normalised*
nonconformity score of the estimator's own predictive on rows the network did not
fit, so the result keeps the shape of the Laplace uncertainty (wide in gaps and under
shift) and gains the finite-sample marginal coverage guarantee of split conformal
prediction (Vovk et al. 2005; Lei et al. 2018; Angelopoulos & Bates 2023).

Regression
    Score :math:`s_i = |y_i - \\mu(x_i)| / \\sigma(x_i)` with
    ``mu, sigma = predict(X, return_std=True)`` (per target). With the scores of
    ``n`` calibration rows sorted, :math:`\\hat q` is the
    :math:`k = \\lceil (n + 1)\\,c \\rceil`-th smallest for confidence ``c``, and the
    interval is :math:`\\mu(x) \\pm \\hat q\\,\\sigma(x)`.

Classification
    From ``p = predict_proba(X)``: LAC (Sadinle et al. 2019), :math:`s = 1 - p_y`,
    set :math:`\\{k : p_k \\ge 1 - \\hat q\\}`; APS (Romano et al. 2020),
    :math:`s = \\sum_{j \\preceq y} p_j` (the mass of the classes ranked at or above
    ``y``), set: the classes whose cumulated mass stays :math:`\\le \\hat q`; and the
    randomised APS, :math:`s = \\sum_{j \\prec y} p_j + U p_y`.

For exchangeable calibration and test rows, :math:`P(y \\in C(x)) \\ge c`, and, with
continuous scores, :math:`\\le c + 1/(n + 1)`; given the calibration set, the
coverage is :math:`\\mathrm{Beta}(k, n + 1 - k)`-distributed.

The sorted scores are stored (``conformal_scores_``), not one quantile, so any
confidence can be asked for after calibration. ``_base`` calls
:func:`calibrate_held_out` at the end of every ``fit``: with held-out rows (the
``validation`` stream) the estimator is calibrated on them, and a refit always
replaces the previous calibration.
"""

from __future__ import annotations

import math
import warnings
from numbers import Integral, Real

import numpy as np
from scipy.special import ndtr
from sklearn.exceptions import NotFittedError
from sklearn.utils.validation import check_is_fitted

from ._core import dask as _dask
from ._core.likelihoods import point_normals, row_keys
from ._core.utils import int_seed

__all__ = [
    "ConformalRegressorMixin",
    "ConformalClassifierMixin",
    "calibrate_held_out",
    "conformal_rank",
    "conformal_quantile",
]

#: The fitted attributes written by a calibration (removed by a refit).
CONFORMAL_ATTRIBUTES = ("conformal_scores_", "conformal_n_", "conformal_source_")

#: ``conformal_source_`` after an explicit ``conformalize`` call.
SOURCE_CONFORMALIZE = "conformalize"

#: Prediction-set methods of :meth:`ConformalClassifierMixin.predict_set`.
SET_METHODS = ("lac", "aps")

#: Salt of the calibration rows' uniform draws (randomised APS): calibration and
#: test rows never share draws, even for identical inputs.
_CALIBRATION_SALT = 0x5F3759DF


# ---------------------------------------------------------------------------------
# The quantile maths
# ---------------------------------------------------------------------------------


def _check_confidence(confidence):
    if isinstance(confidence, (bool, np.bool_)) or not isinstance(confidence, Real):
        raise TypeError(f"confidence must be a float in (0, 1); got {confidence!r}")
    confidence = float(confidence)
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must lie in (0, 1) (e.g. 0.9); got {confidence!r}")
    return confidence


def conformal_rank(n, confidence):
    """Return the rank ``k = ceil((n + 1) * confidence)`` of the conformal quantile.

    The ``k``-th smallest of ``n`` calibration scores bounds the score of a new
    exchangeable point with probability at least ``k / (n + 1) >= confidence``.

    Parameters
    ----------
    n : int
        Number of calibration scores (>= 1).
    confidence : float
        Target coverage in (0, 1).

    Returns
    -------
    k : int
        The rank, ``1 <= k <= n``.

    Raises
    ------
    ValueError
        If ``k > n``: ``n`` rows support confidences up to ``n / (n + 1)`` only.

    Examples
    --------
    >>> from sklearn_lla._conformal import conformal_rank
    >>> conformal_rank(9, 0.9), conformal_rank(99, 0.9), conformal_rank(100, 0.9)
    (9, 90, 91)
    """
    confidence = _check_confidence(confidence)
    if not isinstance(n, Integral) or n < 1:
        raise ValueError(f"the number of calibration scores must be >= 1; got {n!r}")
    x = (n + 1) * confidence
    # (n + 1) * confidence is an integer in exact arithmetic for e.g. n = 9, 0.9; its
    # float may land a few ulps above it, which ceil must not round up.
    k = math.ceil(x * (1.0 - 1e-12))
    if k > n:
        need = math.ceil(confidence / (1.0 - confidence) * (1.0 - 1e-12))
        raise ValueError(
            f"{n} calibration row(s) give a finite conformal interval / set up to "
            f"confidence {n}/{n + 1} = {n / (n + 1):.4g} only; confidence={confidence:g} "
            f"needs at least {need} rows the network did not fit. Pass more rows to "
            "conformalize (or to fit's validation_data), or ask for a lower confidence")
    return int(k)


def conformal_quantile(sorted_scores, confidence):
    """Return the finite-sample conformal quantile of sorted calibration scores.

    Parameters
    ----------
    sorted_scores : ndarray of shape (n,) or (n, n_targets)
        Calibration scores sorted in ascending order along the first axis.
    confidence : float
        Target coverage in (0, 1).

    Returns
    -------
    q : float or ndarray of shape (n_targets,)
        The ``k``-th smallest score, ``k = ceil((n + 1) * confidence)`` (per column).

    Raises
    ------
    ValueError
        If there are too few scores for ``confidence`` (see :func:`conformal_rank`).

    Examples
    --------
    >>> import numpy as np
    >>> from sklearn_lla._conformal import conformal_quantile
    >>> conformal_quantile(np.arange(1.0, 20.0), 0.9)  # k = ceil(20 * 0.9) = 18
    18.0
    """
    sorted_scores = np.asarray(sorted_scores)
    k = conformal_rank(len(sorted_scores), confidence)
    q = sorted_scores[k - 1]
    return float(q) if np.ndim(q) == 0 else np.asarray(q, dtype=np.float64)


# ---------------------------------------------------------------------------------
# Scores
# ---------------------------------------------------------------------------------


def _uniforms(X, seed):
    """One uniform draw in (0, 1) per row of ``X``, derived from the row and ``seed``."""
    keys = row_keys(np.asarray(X), int(seed) % 2**63)
    return ndtr(point_normals(keys, 1, 1).numpy()[0, :, 0])


def _ranked(proba):
    """``order`` (classes by decreasing probability, ties by index) and cumulated mass."""
    order = np.argsort(-proba, axis=1, kind="stable")
    sorted_p = np.take_along_axis(proba, order, axis=1)
    return order, np.cumsum(sorted_p, axis=1)


def classification_scores(proba, y_idx, u):
    """Nonconformity scores of the true classes: LAC, APS and randomised APS.

    Parameters
    ----------
    proba : ndarray of shape (n, K)
        Predictive probabilities.
    y_idx : ndarray of shape (n,)
        Column of the true class of each row.
    u : ndarray of shape (n,)
        Uniform draws for the randomised APS.

    Returns
    -------
    scores : dict
        ``{"lac": 1 - p_y, "aps": mass ranked at or above y,
        "aps_randomized": mass ranked above y + u * p_y}``, each of shape (n,).
    """
    n = len(proba)
    rows = np.arange(n)
    p_y = proba[rows, y_idx]
    order, cum = _ranked(proba)
    rank = np.argsort(order, axis=1, kind="stable")[rows, y_idx]  # position of y
    incl = cum[rows, rank]
    return {"lac": 1.0 - p_y, "aps": incl, "aps_randomized": incl - p_y + u * p_y}


def prediction_sets(proba, q, method, randomized, u, allow_empty):
    """Boolean membership ``(n, K)`` of the conformal sets (columns as in ``proba``).

    Parameters
    ----------
    proba : ndarray of shape (n, K)
        Predictive probabilities.
    q : float
        Conformal quantile of the calibration scores of ``method``.
    method : {"lac", "aps"}
        The score.
    randomized : bool
        Randomised APS (``u`` used).
    u : ndarray of shape (n,) or None
        Uniform draws per row (randomised APS).
    allow_empty : bool
        Keep empty sets; otherwise an empty set gets the most probable class.

    Returns
    -------
    sets : ndarray of bool, shape (n, K)
        Membership of each class in each row's set.
    """
    proba = np.asarray(proba, dtype=np.float64)
    if method == "lac":
        sets = 1.0 - proba <= q
    else:
        order, cum = _ranked(proba)
        sorted_p = np.take_along_axis(proba, order, axis=1)
        score = cum - sorted_p + u[:, None] * sorted_p if randomized else cum
        in_sorted = score <= q
        sets = np.zeros_like(in_sorted)
        np.put_along_axis(sets, order, in_sorted, axis=1)
    if not allow_empty:
        empty = ~sets.any(axis=1)
        if empty.any():
            sets[np.flatnonzero(empty), np.argmax(proba[empty], axis=1)] = True
    return sets


# ---------------------------------------------------------------------------------
# Calibration
# ---------------------------------------------------------------------------------


def _reset(est):
    for name in CONFORMAL_ATTRIBUTES:
        est.__dict__.pop(name, None)


def _computed(a):
    return np.asarray(a.compute()) if _dask.is_dask(a) else np.asarray(a)


def _calibrate_regression(est, mean, std, y2, source):
    """Store the sorted normalised scores of ``(mean, std)`` against ``y2`` (n, C)."""
    n, C = y2.shape
    mean = _computed(mean).reshape(n, C)
    std = _computed(std).reshape(n, C)
    if not (np.isfinite(std).all() and (std > 0).all() and np.isfinite(mean).all()):
        raise FloatingPointError("the predictive std on the calibration rows is not finite "
                                 "and positive")
    scores = np.sort(np.abs(y2 - mean) / std, axis=0)
    est.conformal_scores_ = scores[:, 0] if est._y_1d else scores
    est.conformal_n_ = int(n)
    est.conformal_source_ = source


def _calibrate_classification(est, proba, y_idx, X, source):
    """Store the sorted LAC / APS / randomised-APS scores of ``proba`` for labels ``y_idx``."""
    proba = _computed(proba)
    u = _uniforms(np.asarray(_computed(X), dtype=np.float64),
                  est._predict_seed ^ _CALIBRATION_SALT)
    scores = classification_scores(proba, np.asarray(y_idx, dtype=np.intp), u)
    est.conformal_scores_ = {name: np.sort(s) for name, s in scores.items()}
    est.conformal_n_ = int(len(proba))
    est.conformal_source_ = source


def _predict_held_out(est, X, latent):
    """``(mean, std)`` (regression) or ``proba`` of ``est`` on the held-out rows ``X``.

    The rows in ``latent`` (a :class:`~sklearn_lla._core.calibration.HeldOutLatent`,
    the calibrated posterior's latent predictive there) are not predicted again: their
    outputs come from it through the estimator's likelihood, as in ``predict`` /
    ``predict_proba``; the other rows (beyond a calibration subset) are predicted.
    """
    regression = est._task == "regression"
    n = _n_rows(X)
    if latent is None or len(latent.rows) == 0:
        return est.predict(X, return_std=True) if regression else est.predict_proba(X)
    rows = np.asarray(latent.rows)
    C = latent.mean.shape[1]
    if regression:
        out = (np.empty((n, C)), np.empty((n, C)))
    else:
        out = np.empty((n, len(est.classes_)))
        Xr = np.asarray(_computed(X[rows]))  # the rows' keys of a Monte Carlo link
    bs = est.batch_size
    for start in range(0, len(rows), bs):  # per batch: the link's draws stay small
        sl = slice(start, start + bs)
        r = rows[sl]
        if regression:
            out[0][r], out[1][r] = est._mean_std(latent.mean[sl], latent.cov[sl])
        else:
            out[r] = est._proba(Xr[sl], latent.mean[sl], latent.cov[sl])
    rest = np.setdiff1d(np.arange(n), rows, assume_unique=True)
    if len(rest):  # rows beyond the calibration's subset: predicted once, here
        if regression:
            m, s = est.predict(X[rest], return_std=True)
            out[0][rest] = _computed(m).reshape(len(rest), C)
            out[1][rest] = _computed(s).reshape(len(rest), C)
        else:
            out[rest] = _computed(est.predict_proba(X[rest]))
    return out


def calibrate_held_out(est, validation, source, latent=None):
    """Calibrate ``est`` on the held-out rows of its fit (called by ``_base`` after fit).

    Any previous calibration is removed first; with no held-out rows the estimator is
    left uncalibrated.

    Parameters
    ----------
    est : estimator
        A just-fitted ``sklearn_lla`` estimator (its fitted state is published).
    validation : FitData or None
        The rows the network did not fit (``validation_data``, rows held out when
        ``fit`` trained the net, or a skorch net's own validation split).
    source : str or None
        Where those rows came from (``validation_source_``).
    latent : HeldOutLatent or None, optional
        The latent predictive the posterior's calibration formed on (some of) these
        rows, at the calibrated posterior: reused instead of predicting those rows
        again (``sklearn_lla._core.calibration.HeldOutLatent``).
    """
    _reset(est)
    if validation is None or validation.n_samples == 0:
        return
    X, y = validation.X, validation.y.detach().cpu().numpy()
    if validation.index is not None:
        X, y = X[validation.index], y[validation.index]
    # X is already validated; predict would warn that a numpy X has no feature names
    # when fit saw a DataFrame (it does not: these are fit's own rows).
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="X does not have valid feature names",
                                category=UserWarning)
        if est._task == "regression":
            mean, std = _predict_held_out(est, X, latent)
            _calibrate_regression(est, mean, std, y.reshape(len(y), -1), source)
        else:
            _calibrate_classification(est, _predict_held_out(est, X, latent), y, X, source)


def _n_rows(X):
    shape = getattr(X, "shape", None)
    if shape is not None and len(shape) >= 1 and not (isinstance(shape[0], float)
                                                       and math.isnan(shape[0])):
        return int(shape[0])
    return len(X)


def _check_calibrated(est):
    check_is_fitted(est, "posterior_")
    if getattr(est, "conformal_scores_", None) is None:
        raise NotFittedError(
            f"This {type(est).__name__} is not conformalized: call "
            "conformalize(X_cal, y_cal) with rows the network did not fit, or fit it with "
            "held-out rows (fit(X, y, validation_data=(X_val, y_val)), a skorch net with "
            "its own validation split, or net=None) to calibrate on them automatically")


# ---------------------------------------------------------------------------------
# The mixins
# ---------------------------------------------------------------------------------


class ConformalRegressorMixin:
    """Split-conformal prediction intervals from the regressor's predictive std."""

    def conformalize(self, X_cal, y_cal):
        """Calibrate conformal intervals on rows the network did not fit.

        Computes the normalised scores ``|y - mean| / std`` with
        ``mean, std = predict(X_cal, return_std=True)`` and stores them sorted (per
        target) in ``conformal_scores_``, so that :meth:`predict_interval` can give
        intervals of any confidence with a finite-sample coverage guarantee. Replaces
        any previous calibration (including the automatic one made by ``fit`` on
        held-out rows).

        Parameters
        ----------
        X_cal : array-like of shape (n_cal, n_features)
            Calibration inputs. They must be exchangeable with the test points and
            must not have been used to train the network (nor to fit this estimator):
            the guarantee needs fresh rows.
        y_cal : array-like of shape (n_cal,) or (n_cal, n_targets)
            Calibration targets, shaped like the ``y`` given to ``fit``.

        Returns
        -------
        self : object
            The estimator, with ``conformal_scores_`` (sorted scores,
            ``(n_cal,)`` or ``(n_cal, n_targets)``), ``conformal_n_`` and
            ``conformal_source_ = "conformalize"``.

        Raises
        ------
        sklearn.exceptions.NotFittedError
            If the estimator is not fitted.
        ValueError
            If ``X_cal`` and ``y_cal`` have different numbers of rows, ``y_cal`` has
            the wrong number of targets or non-finite values.

        Examples
        --------
        >>> import numpy as np
        >>> from sklearn_lla import LLARegressor
        >>> rng = np.random.RandomState(0)
        >>> X = rng.uniform(-2, 2, (300, 1))
        >>> y = np.sin(2 * X[:, 0]) + 0.1 * rng.randn(300)
        >>> reg = LLARegressor(random_state=0).fit(X[:150], y[:150])
        >>> reg = reg.conformalize(X[150:250], y[150:250])  # rows the net never saw
        >>> reg.conformal_source_, reg.conformal_n_
        ('conformalize', 100)
        >>> lower, upper = reg.predict_interval(X[250:], confidence=0.9)
        >>> 0.7 < float(np.mean((lower <= y[250:]) & (y[250:] <= upper))) <= 1.0
        True
        """
        check_is_fitted(self, "posterior_")
        y = np.asarray(_dask.materialize(y_cal), dtype=np.float64)
        n = _n_rows(X_cal)
        if y.ndim not in (1, 2) or len(y) != n:
            raise ValueError(f"X_cal has {n} rows but y_cal has shape {y.shape}; pass one "
                             "target row per input row")
        if n < 1:
            raise ValueError("conformalize needs at least one calibration row")
        C = self.n_outputs_
        if (y.ndim == 1 and C != 1) or (y.ndim == 2 and y.shape[1] != C):
            raise ValueError(f"y_cal has shape {y.shape} but the estimator was fitted on "
                             f"{C} target(s); pass y_cal shaped like fit's y")
        if not np.isfinite(y).all():
            raise ValueError("y_cal contains NaN or infinite values")
        mean, std = self.predict(X_cal, return_std=True)
        _calibrate_regression(self, mean, std, y.reshape(n, C), SOURCE_CONFORMALIZE)
        return self

    def predict_interval(self, X, confidence=0.9):
        """Predict split-conformal intervals ``mean ± q * std`` with guaranteed coverage.

        ``q`` is the ``ceil((n_cal + 1) * confidence)``-th smallest calibration score
        ``|y - mean| / std`` (per target). On exchangeable data the interval holds
        the target with probability at least ``confidence`` (and, with continuous
        scores, at most ``confidence + 1 / (n_cal + 1)``), marginally over test and
        calibration points and per target; its width follows the predictive std,
        so it widens where the Laplace posterior is unsure (gaps, shift).

        Parameters
        ----------
        X : array-like of shape (n_samples, n_features)
            Query points (a dask array gives lazy dask bounds).
        confidence : float, default=0.9
            Target coverage in (0, 1). Any value can be asked for after one
            calibration, as long as ``conformal_n_ >= confidence / (1 - confidence)``
            (9 rows for 0.9, 19 for 0.95, 99 for 0.99).

        Returns
        -------
        lower : ndarray of shape (n_samples,) or (n_samples, n_targets)
            Lower bounds, shaped like ``predict(X)``.
        upper : ndarray of the shape of ``lower``
            Upper bounds.

        Raises
        ------
        sklearn.exceptions.NotFittedError
            If the estimator is not fitted, or not calibrated (no held-out rows at
            ``fit`` and no :meth:`conformalize`).
        ValueError
            If ``confidence`` is outside (0, 1) or needs more calibration rows than
            there are.

        Examples
        --------
        >>> import numpy as np
        >>> from sklearn_lla import LLARegressor
        >>> rng = np.random.RandomState(0)
        >>> X = rng.uniform(-2, 2, (200, 1))
        >>> y = np.sin(2 * X[:, 0]) + 0.1 * rng.randn(200)
        >>> # net=None: fit trains the net on 90 % of the rows and calibrates on the rest
        >>> reg = LLARegressor(random_state=0).fit(X, y)
        >>> reg.conformal_source_, reg.conformal_n_
        ('rows held out from training the network', 20)
        >>> lower, upper = reg.predict_interval(np.array([[0.0], [3.0]]), confidence=0.8)
        >>> bool((upper - lower)[1] > (upper - lower)[0])  # wider off the data
        True
        """
        _check_calibrated(self)
        q = conformal_quantile(self.conformal_scores_, confidence)
        mean, std = self.predict(X, return_std=True)
        return mean - q * std, mean + q * std


class ConformalClassifierMixin:
    """Split-conformal prediction sets from the classifier's predictive probabilities."""

    def conformalize(self, X_cal, y_cal):
        """Calibrate conformal prediction sets on rows the network did not fit.

        Computes, from ``p = predict_proba(X_cal)``, the scores of the true labels for
        every set method of :meth:`predict_set` (LAC ``1 - p_y``; APS, the mass of
        the classes ranked at or above ``y``; randomised APS) and stores them sorted
        in ``conformal_scores_``. Replaces any previous calibration (including the
        automatic one made by ``fit`` on held-out rows).

        Parameters
        ----------
        X_cal : array-like of shape (n_cal, n_features)
            Calibration inputs. They must be exchangeable with the test points and
            must not have been used to train the network (nor to fit this estimator).
        y_cal : array-like of shape (n_cal,)
            Calibration labels, from ``classes_``.

        Returns
        -------
        self : object
            The estimator, with ``conformal_scores_`` (a dict ``{"lac", "aps",
            "aps_randomized"}`` of sorted scores of shape ``(n_cal,)``),
            ``conformal_n_`` and ``conformal_source_ = "conformalize"``.

        Raises
        ------
        sklearn.exceptions.NotFittedError
            If the estimator is not fitted.
        ValueError
            If ``X_cal`` and ``y_cal`` have different numbers of rows or ``y_cal``
            holds labels that are not in ``classes_``.

        Examples
        --------
        >>> from sklearn.datasets import make_blobs
        >>> from sklearn_lla import LLAClassifier
        >>> X, y = make_blobs(n_samples=300, centers=3, cluster_std=2.0, random_state=0)
        >>> clf = LLAClassifier(random_state=0).fit(X[:150], y[:150])
        >>> clf = clf.conformalize(X[150:250], y[150:250])  # rows the net never saw
        >>> sorted(clf.conformal_scores_), clf.conformal_n_
        (['aps', 'aps_randomized', 'lac'], 100)
        """
        check_is_fitted(self, "posterior_")
        y = np.asarray(_dask.materialize(y_cal))
        n = _n_rows(X_cal)
        if y.ndim == 2 and y.shape[1] == 1:
            y = y[:, 0]
        if y.ndim != 1 or len(y) != n:
            raise ValueError(f"X_cal has {n} rows but y_cal has shape {y.shape}; pass one "
                             "label per input row")
        if n < 1:
            raise ValueError("conformalize needs at least one calibration row")
        classes = np.asarray(self.classes_)
        lookup = {c: i for i, c in enumerate(classes.tolist())}
        try:
            y_idx = np.fromiter((lookup[v] for v in y.tolist()), dtype=np.intp, count=n)
        except (KeyError, TypeError):
            bad = [v for v in np.unique(y).tolist() if v not in lookup][:10]
            raise ValueError(f"y_cal contains labels {bad} that are not in classes_ "
                             f"{classes.tolist()}") from None
        proba = self.predict_proba(X_cal)
        X_num = self._check_X(_dask.materialize(X_cal))  # the randomised APS draws
        _calibrate_classification(self, proba, y_idx, X_num, SOURCE_CONFORMALIZE)
        return self

    def predict_set(self, X, confidence=0.9, *, method="lac", randomized=False,
                    allow_empty=False, random_state=0):
        """Predict split-conformal prediction sets with guaranteed coverage.

        A set holds the classes whose score is at most ``q``, the
        ``ceil((n_cal + 1) * confidence)``-th smallest calibration score of
        ``method``. On exchangeable data it contains the true label with probability
        at least ``confidence``, marginally over test and calibration points.

        * ``method="lac"`` (least ambiguous set-valued classifier, Sadinle et al.
          2019): score ``1 - p_y``, set ``{k : p_k >= 1 - q}``. The smallest sets
          on average; their size does not adapt much to the difficulty of ``x``.
        * ``method="aps"`` (adaptive prediction sets, Romano et al. 2020): score
          the predictive mass of the classes ranked at or above ``y``; the set is
          the top-ranked classes whose cumulated mass stays ``<= q``. More adaptive
          sets (bigger where the predictive is spread out).
          ``randomized=True`` uses Romano et al.'s randomised score ``mass above y +
          U * p_y`` with ``U`` uniform: the same guarantee, and much smaller sets
          when the predictive is confident (the score of a correct top class is
          ``U * p_y`` rather than ``p_y``, so ``q`` no longer sits just below 1).

        Parameters
        ----------
        X : array-like of shape (n_samples, n_features)
            Query points (a dask array gives a lazy dask result, except with
            ``randomized=True``).
        confidence : float, default=0.9
            Target coverage in (0, 1); needs
            ``conformal_n_ >= confidence / (1 - confidence)``.
        method : {"lac", "aps"}, default="lac"
            The nonconformity score.
        randomized : bool, default=False
            Randomised APS (``method="aps"`` only).
        allow_empty : bool, default=False
            LAC and randomised APS can return an empty set when no class is
            plausible enough (deterministic APS too, when the top class alone
            exceeds ``q``). With ``False`` an empty set gets the most probable class
            (this only raises the coverage); with ``True`` empty sets are kept, as
            the theory has them (an empty set flags an input unlike the calibration
            data).
        random_state : int, RandomState instance or None, default=0
            Seed of the uniform draws of the randomised APS; each point's draw
            comes from the point itself and this seed, so it does not depend on the
            other rows of ``X``.

        Returns
        -------
        sets : ndarray of bool, shape (n_samples, n_classes)
            ``sets[i, j]`` tells whether ``classes_[j]`` is in the set of row ``i``;
            ``sets.sum(axis=1)`` are the set sizes.

        Raises
        ------
        sklearn.exceptions.NotFittedError
            If the estimator is not fitted, or not calibrated.
        ValueError
            If ``confidence`` is outside (0, 1) or needs more calibration rows, or
            ``method`` / ``randomized`` are invalid.

        Examples
        --------
        >>> from sklearn.datasets import make_blobs
        >>> from sklearn_lla import LLAClassifier
        >>> X, y = make_blobs(n_samples=300, centers=3, cluster_std=2.0, random_state=0)
        >>> clf = LLAClassifier(random_state=0).fit(X[:150], y[:150])
        >>> clf = clf.conformalize(X[150:250], y[150:250])
        >>> sets = clf.predict_set(X[250:], confidence=0.9, method="aps")
        >>> sets.shape, sets.dtype
        ((50, 3), dtype('bool'))
        >>> bool(sets.any(axis=1).all())  # allow_empty=False: never an empty set
        True
        """
        _check_calibrated(self)
        if method not in SET_METHODS:
            raise ValueError(f"method must be one of {SET_METHODS}; got {method!r}")
        if not isinstance(randomized, (bool, np.bool_)):
            raise TypeError(f"randomized must be a bool; got {randomized!r}")
        if randomized and method != "aps":
            raise ValueError("randomized=True is for method='aps' (LAC is not randomised)")
        key = "aps_randomized" if randomized else method
        q = conformal_quantile(self.conformal_scores_[key], confidence)
        proba = self.predict_proba(X)
        if _dask.is_dask(proba):
            if randomized:
                raise ValueError("randomized=True needs X in memory; pass X.compute()")
            return proba.map_blocks(prediction_sets, q, method, False, None, allow_empty,
                                    dtype=bool)
        u = None
        if randomized:
            Xv = self._check_X(X)
            u = _uniforms(np.asarray(Xv, dtype=np.float64), int_seed(random_state))
        return prediction_sets(proba, q, method, randomized, u, allow_empty)
