"""Uncertainty metrics and scorers for probabilistic predictions.

All metrics are plain NumPy functions working in the original target scale
(no standardisation is undone or applied here).

Regression metrics take ``y``, the predictive ``mean`` and the predictive
``std`` of a Gaussian predictive distribution :math:`\\mathcal N(\\mu, \\sigma^2)`:

- :func:`gaussian_nll` -- mean negative log predictive density (lower is better);
- :func:`crps_gaussian` -- mean continuous ranked probability score (lower is better);
- :func:`centered_quantile_metric` (alias :func:`cqm`) -- calibration error of the
  central prediction intervals, in ``[0, 0.5]`` (lower is better);
- :func:`calibration_curve_regression` -- the curve behind the CQM, for plots.

Classification metrics take labels ``y`` and predicted probabilities ``proba``:

- :func:`expected_calibration_error` (alias :func:`ece`) and
  :func:`reliability_curve`;
- :func:`brier_score` -- the multi-class Brier score;
- :func:`predictive_entropy` and :func:`ood_auc` for out-of-distribution detection.

The scorers (``neg_*_scorer``) follow scikit-learn's "greater is better"
convention and can be passed as ``scoring=`` to
:class:`~sklearn.model_selection.GridSearchCV` or
:func:`~sklearn.model_selection.cross_validate`, alone or in a dict.
Regression scorers call ``estimator.predict(X, return_std=True)``, which
:func:`sklearn.metrics.make_scorer` cannot do. :func:`get_scorer` resolves the
names of these scorers and falls back to :func:`sklearn.metrics.get_scorer`.
"""

from __future__ import annotations

import numbers

import numpy as np
from scipy import stats
from scipy.special import entr
from sklearn.metrics import roc_auc_score

__all__ = [
    # regression metrics
    "gaussian_nll",
    "crps_gaussian",
    "centered_quantile_metric",
    "cqm",
    "calibration_curve_regression",
    # classification metrics
    "expected_calibration_error",
    "ece",
    "reliability_curve",
    "brier_score",
    "predictive_entropy",
    "ood_auc",
    # scorers
    "neg_cqm_scorer",
    "neg_nll_scorer",
    "neg_crps_scorer",
    "neg_ece_scorer",
    "neg_brier_scorer",
    "neg_log_loss_scorer",
    "get_scorer",
]

#: Absolute tolerance for probabilities slightly outside ``[0, 1]`` and for row sums.
_PROBA_TOL = 1e-6

#: The 11-point grid ``0, 0.1, ..., 1`` of central-interval levels used by the CQM.
_CQM_ALPHAS = np.linspace(0.0, 1.0, 11)


# ---------------------------------------------------------------------------
# input validation
# ---------------------------------------------------------------------------


def _as_float_array(x, name):
    try:
        arr = np.asarray(x, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{name} must be array-like of numbers; got {type(x).__name__}") from exc
    return arr


def _check_finite(arr, name):
    if not np.all(np.isfinite(arr)):
        n_nan = int(np.isnan(arr).sum())
        n_inf = int(np.isinf(arr).sum())
        raise ValueError(
            f"{name} contains non-finite values ({n_nan} NaN, {n_inf} inf); "
            "all values must be finite"
        )


def _check_regression_inputs(y, mean, std):
    """Validate and convert ``(y, mean, std)`` to float arrays of one common shape.

    Accepted shapes are ``(n,)`` and ``(n, t)``. Arrays of shape ``(n,)`` and
    ``(n, 1)`` are allowed to be mixed (they are all flattened), and ``std``
    may be a scalar shared by all entries.
    """
    y = _as_float_array(y, "y")
    mean = _as_float_array(mean, "mean")
    std = _as_float_array(std, "std")
    for arr, name in ((y, "y"), (mean, "mean")):
        if arr.ndim not in (1, 2):
            raise ValueError(f"{name} must have shape (n,) or (n, t); got shape {arr.shape}")
    if std.ndim not in (0, 1, 2):
        raise ValueError(
            f"std must be a scalar or have shape (n,) or (n, t); got shape {std.shape}"
        )

    if y.shape != mean.shape:
        if _is_column(y, mean):
            y, mean = y.reshape(-1), mean.reshape(-1)
        else:
            raise ValueError(
                f"y and mean must have the same shape; got y {y.shape} and mean {mean.shape}"
            )
    if std.ndim == 0:
        std = np.full(y.shape, float(std))
    elif std.shape != y.shape:
        if _is_column(y, std):
            y, mean, std = y.reshape(-1), mean.reshape(-1), std.reshape(-1)
        else:
            raise ValueError(
                f"std must have the same shape as y and mean; got std {std.shape} "
                f"and y {y.shape}"
            )
    if y.shape[0] == 0 or y.size == 0:
        raise ValueError(f"empty input: y has shape {y.shape}; at least one target is needed")
    _check_finite(y, "y")
    _check_finite(mean, "mean")
    _check_finite(std, "std")
    if np.any(std <= 0):
        raise ValueError(
            f"std must be strictly positive; got {int((std <= 0).sum())} non-positive "
            f"value(s) (min {std.min():.3g})"
        )
    return y, mean, std


def _is_column(a, b):
    """True when one of ``a`` / ``b`` is ``(n,)`` and the other ``(n, 1)`` (or both)."""
    shapes = {a.shape, b.shape}
    n = a.shape[0] if a.ndim else None
    return all(s in ((n,), (n, 1)) for s in shapes)


def _check_proba(proba, name="proba"):
    """Validate probabilities; a 1-D ``proba`` is turned into ``[1 - p, p]`` columns."""
    proba = _as_float_array(proba, name)
    if proba.ndim == 1:
        proba = np.column_stack([1.0 - proba, proba])
        binary_1d = True
    elif proba.ndim == 2:
        binary_1d = False
        if proba.shape[1] < 2:
            raise ValueError(
                f"{name} must have shape (n,) (binary, probability of the positive class) "
                f"or (n, K) with K >= 2 classes; got shape {proba.shape}"
            )
    else:
        raise ValueError(f"{name} must have shape (n,) or (n, K); got shape {proba.shape}")
    if proba.shape[0] == 0:
        raise ValueError(f"empty input: {name} has no rows")
    _check_finite(proba, name)
    if np.any(proba < -_PROBA_TOL) or np.any(proba > 1.0 + _PROBA_TOL):
        raise ValueError(
            f"{name} must contain probabilities in [0, 1]; got values in "
            f"[{proba.min():.6g}, {proba.max():.6g}]"
        )
    if not binary_1d:
        dev = np.abs(proba.sum(axis=1) - 1.0)
        if np.any(dev > _PROBA_TOL):
            raise ValueError(
                f"rows of {name} must sum to 1 (tolerance {_PROBA_TOL:g}); "
                f"{int((dev > _PROBA_TOL).sum())} row(s) do not (max deviation {dev.max():.3g})"
            )
    return np.clip(proba, 0.0, 1.0)


def _labels_to_indices(y, n_classes, labels=None):
    """Map labels ``y`` to column indices ``0..n_classes-1`` of the probability matrix."""
    y = np.asarray(y)
    if y.ndim == 2 and y.shape[1] == 1:
        y = y.reshape(-1)
    if y.ndim != 1:
        raise ValueError(f"y must be a 1-D array of labels; got shape {y.shape}")

    if labels is not None:
        labels = np.asarray(labels)
        if labels.ndim != 1:
            raise ValueError(f"labels must be 1-D; got shape {labels.shape}")
        if len(labels) != n_classes:
            raise ValueError(
                f"labels has {len(labels)} entries but proba has {n_classes} columns"
            )
        if len(np.unique(labels)) != len(labels):
            raise ValueError(f"labels must be unique; got {labels!r}")
        # stable lookup that works for any hashable label type
        lookup = {_key(lab): i for i, lab in enumerate(labels.tolist())}
        try:
            return np.fromiter((lookup[_key(v)] for v in y.tolist()), dtype=np.intp, count=len(y))
        except KeyError as exc:
            raise ValueError(
                f"y contains label {exc.args[0]!r} which is not in labels={labels.tolist()!r}"
            ) from None

    if y.dtype.kind == "b":
        y = y.astype(np.intp)
    if y.dtype.kind in "iuf":
        yf = y.astype(np.float64)
        if y.dtype.kind == "f":
            _check_finite(yf, "y")
        if np.all(yf == np.round(yf)) and np.all((yf >= 0) & (yf < n_classes)):
            return yf.astype(np.intp)
    classes = np.unique(y)
    if len(classes) != n_classes:
        raise ValueError(
            f"cannot match the labels in y to the {n_classes} columns of proba: y is not "
            f"integer-valued in [0, {n_classes}) and has {len(classes)} distinct label(s) "
            f"{classes.tolist()[:10]!r}; pass labels= to give the class of each column"
        )
    return np.searchsorted(classes, y).astype(np.intp)


def _key(v):
    # Make 1 and 1.0 (and numpy scalars) map to the same dictionary key.
    if isinstance(v, numbers.Number) and not isinstance(v, bool):
        fv = float(v)
        if fv.is_integer():
            return int(fv)
        return fv
    return v


def _check_classification_inputs(y, proba, labels=None):
    proba = _check_proba(proba)
    y_arr = np.asarray(y)
    n_y = y_arr.shape[0] if y_arr.ndim else None
    if n_y != proba.shape[0]:
        raise ValueError(
            f"y and proba have inconsistent numbers of samples: {n_y} and {proba.shape[0]}"
        )
    idx = _labels_to_indices(y_arr, proba.shape[1], labels)
    return idx, proba


def _check_n_bins(n_bins):
    if (
        not isinstance(n_bins, numbers.Integral)
        or isinstance(n_bins, bool)
        or n_bins < 1
    ):
        raise ValueError(f"n_bins must be a positive integer; got {n_bins!r}")
    return int(n_bins)


# ---------------------------------------------------------------------------
# regression metrics
# ---------------------------------------------------------------------------


def gaussian_nll(y, mean, std):
    """Mean negative log predictive density of a Gaussian predictive.

    Computes :math:`\\frac1N \\sum_i -\\log \\mathcal N(y_i \\mid \\mu_i, \\sigma_i^2)`.

    Parameters
    ----------
    y : array-like of shape (n,) or (n, t)
        Observed targets, in the original scale.
    mean : array-like of the same shape as ``y``
        Predictive means.
    std : array-like of the same shape as ``y``, or float
        Predictive standard deviations (strictly positive).

    Returns
    -------
    nll : float
        The negative log density averaged over all entries (all samples and
        all outputs). Lower is better.

    Raises
    ------
    ValueError
        On empty input, mismatched shapes, non-finite values or ``std <= 0``.

    Examples
    --------
    >>> round(gaussian_nll([0.0], [0.0], [1.0]), 6)  # 0.5 * log(2 pi)
    0.918939
    """
    y, mean, std = _check_regression_inputs(y, mean, std)
    z = (y - mean) / std
    nll = 0.5 * np.log(2.0 * np.pi) + np.log(std) + 0.5 * z**2
    return float(np.mean(nll))


def crps_gaussian(y, mean, std):
    """Mean continuous ranked probability score of a Gaussian predictive.

    Uses the closed form
    :math:`\\mathrm{CRPS} = \\sigma\\,[z(2\\Phi(z) - 1) + 2\\varphi(z) - 1/\\sqrt{\\pi}]`
    with :math:`z = (y - \\mu)/\\sigma`.

    Parameters
    ----------
    y : array-like of shape (n,) or (n, t)
        Observed targets, in the original scale.
    mean : array-like of the same shape as ``y``
        Predictive means.
    std : array-like of the same shape as ``y``, or float
        Predictive standard deviations (strictly positive).

    Returns
    -------
    crps : float
        The CRPS averaged over all entries, in the units of ``y``. Lower is better.

    Raises
    ------
    ValueError
        On empty input, mismatched shapes, non-finite values or ``std <= 0``.

    Examples
    --------
    >>> round(crps_gaussian([0.0], [0.0], [1.0]), 6)  # (sqrt(2) - 1) / sqrt(pi)
    0.233695
    """
    y, mean, std = _check_regression_inputs(y, mean, std)
    z = (y - mean) / std
    crps = std * (
        z * (2.0 * stats.norm.cdf(z) - 1.0) + 2.0 * stats.norm.pdf(z) - 1.0 / np.sqrt(np.pi)
    )
    return float(np.mean(crps))


def calibration_curve_regression(y, mean, std, alphas=None):
    """Observed coverage of central Gaussian prediction intervals.

    For each level ``alpha`` the central ``alpha``-interval of
    :math:`\\mathcal N(\\mu, \\sigma^2)` is
    :math:`|y - \\mu| / \\sigma \\le \\Phi^{-1}((1 + \\alpha)/2)`, and
    ``gamma(alpha)`` is the fraction of targets inside it. A calibrated
    predictive has ``gamma(alpha) == alpha``.

    Parameters
    ----------
    y : array-like of shape (n,) or (n, t)
        Observed targets, in the original scale. For multi-output targets
        every entry counts as one target.
    mean : array-like of the same shape as ``y``
        Predictive means.
    std : array-like of the same shape as ``y``, or float
        Predictive standard deviations (strictly positive).
    alphas : array-like of shape (m,), default=None
        Interval levels in ``[0, 1]``. ``None`` means the 11-point grid
        ``0, 0.1, ..., 1``. ``gamma`` is 0 at ``alpha = 0`` and 1 at ``alpha = 1``
        by definition.

    Returns
    -------
    alphas : ndarray of shape (m,)
        The interval levels (expected coverage).
    gamma : ndarray of shape (m,)
        The observed coverage of each level.

    Examples
    --------
    >>> a, g = calibration_curve_regression([0.0, 3.0], [0.0, 0.0], [1.0, 1.0])
    >>> g.tolist()
    [0.0, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 1.0]
    """
    y, mean, std = _check_regression_inputs(y, mean, std)
    if alphas is None:
        alphas = _CQM_ALPHAS.copy()
    else:
        alphas = _as_float_array(alphas, "alphas")
        if alphas.ndim != 1 or alphas.size == 0:
            raise ValueError(f"alphas must be a non-empty 1-D array; got shape {alphas.shape}")
        _check_finite(alphas, "alphas")
        if np.any(alphas < 0) or np.any(alphas > 1):
            raise ValueError(
                f"alphas must lie in [0, 1]; got values in [{alphas.min()}, {alphas.max()}]"
            )
    abs_z = np.abs(y - mean).reshape(-1) / std.reshape(-1)
    gamma = np.empty_like(alphas)
    for i, a in enumerate(alphas):
        if a <= 0.0:
            gamma[i] = 0.0
        elif a >= 1.0:
            gamma[i] = 1.0
        else:
            gamma[i] = np.mean(abs_z <= stats.norm.ppf(0.5 * (1.0 + a)))
    return alphas, gamma


def centered_quantile_metric(y, mean, std):
    """Centered quantile metric (CQM): calibration error of central intervals.

    With ``gamma(alpha)`` from :func:`calibration_curve_regression` on the grid
    ``alpha = 0, 0.1, ..., 1``, the CQM is
    :math:`\\int_0^1 |\\gamma(\\alpha) - \\alpha|\\,d\\alpha` evaluated with the
    trapezoid rule on that grid. The deviation is zero at both ends, so this
    equals ``0.1 * sum(|gamma(alpha) - alpha|)`` over ``alpha = 0.1, ..., 0.9``.

    Parameters
    ----------
    y : array-like of shape (n,) or (n, t)
        Observed targets, in the original scale. For multi-output targets
        every entry counts as one target.
    mean : array-like of the same shape as ``y``
        Predictive means.
    std : array-like of the same shape as ``y``, or float
        Predictive standard deviations (strictly positive).

    Returns
    -------
    cqm : float
        Value in ``[0, 0.5]`` (on the 11-point grid at most 0.45); 0 means
        perfectly calibrated central intervals. Lower is better.

    See Also
    --------
    calibration_curve_regression : The curve whose deviation is integrated.

    Examples
    --------
    >>> # one target at the mean (inside every interval), one far away (inside none)
    >>> round(centered_quantile_metric([0.0, 3.0], [0.0, 0.0], [1.0, 1.0]), 6)
    0.2
    """
    alphas, gamma = calibration_curve_regression(y, mean, std)
    dev = np.abs(gamma - alphas)
    return float(np.sum(0.5 * (dev[1:] + dev[:-1]) * np.diff(alphas)))


#: Short alias of :func:`centered_quantile_metric`.
cqm = centered_quantile_metric


# ---------------------------------------------------------------------------
# classification metrics
# ---------------------------------------------------------------------------


def reliability_curve(y, proba, n_bins=15, *, labels=None):
    """Per-bin confidence and accuracy of a classifier (reliability diagram).

    The confidence of a prediction is its largest class probability and the
    predicted class its argmax. Confidences are put in ``n_bins`` equal-width
    bins ``(lo, hi]`` over ``[0, 1]``; a confidence of exactly 0 goes in the
    first bin.

    Parameters
    ----------
    y : array-like of shape (n,)
        True labels. See ``labels`` for how they are matched to columns.
    proba : array-like of shape (n, K) or (n,)
        Predicted class probabilities; rows must sum to 1. A 1-D array is the
        probability of the positive (second) class of a binary problem.
    n_bins : int, default=15
        Number of equal-width confidence bins.
    labels : array-like of shape (K,), default=None
        The class of each column of ``proba`` (e.g. ``estimator.classes_``).
        If ``None``, integer ``y`` in ``[0, K)`` are used as column indices,
        and otherwise the sorted ``np.unique(y)`` must have ``K`` entries.

    Returns
    -------
    bin_confidence : ndarray of shape (n_bins,)
        Mean confidence in each bin (NaN for empty bins).
    bin_accuracy : ndarray of shape (n_bins,)
        Accuracy in each bin (NaN for empty bins).
    bin_counts : ndarray of shape (n_bins,)
        Number of samples in each bin.

    Examples
    --------
    >>> conf, acc, cnt = reliability_curve([0, 1], [[0.9, 0.1], [0.8, 0.2]], n_bins=2)
    >>> cnt.tolist(), acc.tolist()
    ([0, 2], [nan, 0.5])
    """
    n_bins = _check_n_bins(n_bins)
    idx, proba = _check_classification_inputs(y, proba, labels)
    conf = proba.max(axis=1)
    correct = (proba.argmax(axis=1) == idx).astype(np.float64)
    # edges[b] is the correctly rounded float of b / n_bins, so a confidence
    # written as such a fraction (e.g. 0.2 = 3/15) lands in (edges[b-1], edges[b]].
    edges = np.arange(n_bins + 1) / n_bins
    bins = np.clip(np.searchsorted(edges, conf, side="left") - 1, 0, n_bins - 1)
    counts = np.bincount(bins, minlength=n_bins)
    sum_conf = np.bincount(bins, weights=conf, minlength=n_bins)
    sum_acc = np.bincount(bins, weights=correct, minlength=n_bins)
    with np.errstate(invalid="ignore", divide="ignore"):
        bin_conf = np.where(counts > 0, sum_conf / np.maximum(counts, 1), np.nan)
        bin_acc = np.where(counts > 0, sum_acc / np.maximum(counts, 1), np.nan)
    return bin_conf, bin_acc, counts


def expected_calibration_error(y, proba, n_bins=15, *, labels=None):
    """Expected calibration error (ECE) of a classifier.

    :math:`\\mathrm{ECE} = \\sum_b \\frac{n_b}{n}\\,|\\mathrm{acc}_b - \\mathrm{conf}_b|`
    over ``n_bins`` equal-width confidence bins ``(lo, hi]`` (see
    :func:`reliability_curve`).

    Parameters
    ----------
    y : array-like of shape (n,)
        True labels. See ``labels`` for how they are matched to columns.
    proba : array-like of shape (n, K) or (n,)
        Predicted class probabilities; rows must sum to 1. A 1-D array is the
        probability of the positive (second) class of a binary problem.
    n_bins : int, default=15
        Number of equal-width confidence bins.
    labels : array-like of shape (K,), default=None
        The class of each column of ``proba`` (e.g. ``estimator.classes_``).
        If ``None``, integer ``y`` in ``[0, K)`` are used as column indices,
        and otherwise the sorted ``np.unique(y)`` must have ``K`` entries.

    Returns
    -------
    ece : float
        Value in ``[0, 1]``. Lower is better.

    Examples
    --------
    >>> # two bins: conf 0.9 correct, conf 0.8 wrong -> 0.5 * 0.1 + 0.5 * 0.8
    >>> round(expected_calibration_error([0, 1], [[0.9, 0.1], [0.8, 0.2]]), 6)
    0.45
    """
    bin_conf, bin_acc, counts = reliability_curve(y, proba, n_bins, labels=labels)
    nonempty = counts > 0
    weights = counts[nonempty] / counts.sum()
    return float(np.sum(weights * np.abs(bin_acc[nonempty] - bin_conf[nonempty])))


#: Short alias of :func:`expected_calibration_error`.
ece = expected_calibration_error


def brier_score(y, proba, *, labels=None):
    """Multi-class Brier score.

    :math:`\\frac1n \\sum_i \\sum_c (p_{ic} - [y_i = c])^2`. For binary problems
    this is twice :func:`sklearn.metrics.brier_score_loss`.

    Parameters
    ----------
    y : array-like of shape (n,)
        True labels. See ``labels`` for how they are matched to columns.
    proba : array-like of shape (n, K) or (n,)
        Predicted class probabilities; rows must sum to 1. A 1-D array is the
        probability of the positive (second) class of a binary problem.
    labels : array-like of shape (K,), default=None
        The class of each column of ``proba`` (e.g. ``estimator.classes_``).
        If ``None``, integer ``y`` in ``[0, K)`` are used as column indices,
        and otherwise the sorted ``np.unique(y)`` must have ``K`` entries.

    Returns
    -------
    brier : float
        Value in ``[0, 2]``. Lower is better.

    Examples
    --------
    >>> round(brier_score([0], [[0.75, 0.25]]), 6)  # 0.25**2 + 0.25**2
    0.125
    """
    idx, proba = _check_classification_inputs(y, proba, labels)
    onehot = np.zeros_like(proba)
    onehot[np.arange(len(idx)), idx] = 1.0
    return float(np.mean(np.sum((proba - onehot) ** 2, axis=1)))


def predictive_entropy(proba):
    """Entropy of each predictive distribution, ``-sum_c p_c log p_c``.

    Parameters
    ----------
    proba : array-like of shape (n, K) or (n,)
        Predicted class probabilities (a 1-D array is the positive-class
        probability of a binary problem). ``0 log 0`` is taken as 0.

    Returns
    -------
    entropy : ndarray of shape (n,)
        Entropies in nats, between 0 and ``log K``.

    Examples
    --------
    >>> predictive_entropy([[1.0, 0.0], [0.5, 0.5]]).round(6).tolist()
    [0.0, 0.693147]
    """
    proba = _check_proba(proba)
    return entr(proba).sum(axis=1)


def ood_auc(proba_in, proba_out):
    """ROC AUC of predictive entropy for out-of-distribution detection.

    In-distribution samples are labelled 0 and out-of-distribution samples 1,
    and the predictive entropy is the score. 1 means every OOD input has a
    higher entropy than every in-distribution input; 0.5 is chance.

    Parameters
    ----------
    proba_in : array-like of shape (n_in, K) or (n_in,)
        Predicted probabilities on in-distribution inputs.
    proba_out : array-like of shape (n_out, K) or (n_out,)
        Predicted probabilities on out-of-distribution inputs.

    Returns
    -------
    auc : float
        Area under the ROC curve, in ``[0, 1]``. Higher is better.

    Examples
    --------
    >>> ood_auc([[0.99, 0.01]], [[0.5, 0.5]])
    1.0
    """
    p_in = _check_proba(proba_in, "proba_in")
    p_out = _check_proba(proba_out, "proba_out")
    if p_in.shape[1] != p_out.shape[1]:
        raise ValueError(
            f"proba_in and proba_out must have the same number of classes; got "
            f"{p_in.shape[1]} and {p_out.shape[1]}"
        )
    scores = np.concatenate([entr(p_in).sum(axis=1), entr(p_out).sum(axis=1)])
    is_ood = np.concatenate([np.zeros(len(p_in)), np.ones(len(p_out))])
    return float(roc_auc_score(is_ood, scores))


# The scorers use the metric functions above: imported last (see _scorers.py).
from ._scorers import (  # noqa: E402
    get_scorer,
    neg_brier_scorer,
    neg_cqm_scorer,
    neg_crps_scorer,
    neg_ece_scorer,
    neg_log_loss_scorer,
    neg_nll_scorer,
)
