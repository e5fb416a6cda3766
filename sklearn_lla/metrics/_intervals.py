"""Metrics of prediction intervals and prediction sets: coverage, width, interval score, size."""

from __future__ import annotations

import numpy as np

from ._validation import _as_float_array, _check_finite, _is_column, _labels_to_indices


def _check_confidence(confidence):
    if isinstance(confidence, (bool, np.bool_)):
        raise TypeError(f"confidence must be a float in (0, 1); got {confidence!r}")
    try:
        confidence = float(confidence)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"confidence must be a float in (0, 1); got {confidence!r}") from exc
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must lie in (0, 1) (e.g. 0.9); got {confidence!r}")
    return confidence


def _check_bounds(lower, upper):
    """Validate interval bounds: same shape, no NaN, ``lower <= upper`` (inf allowed)."""
    lower = _as_float_array(lower, "lower")
    upper = _as_float_array(upper, "upper")
    for arr, name in ((lower, "lower"), (upper, "upper")):
        if arr.ndim not in (1, 2):
            raise ValueError(f"{name} must have shape (n,) or (n, t); got shape {arr.shape}")
        if np.isnan(arr).any():
            raise ValueError(f"{name} contains NaN")
    if lower.shape != upper.shape:
        if _is_column(lower, upper):
            lower, upper = lower.reshape(-1), upper.reshape(-1)
        else:
            raise ValueError(f"lower and upper must have the same shape; got {lower.shape} "
                             f"and {upper.shape}")
    if lower.size == 0:
        raise ValueError("empty input: at least one interval is needed")
    if np.any(lower > upper):
        raise ValueError(f"lower must not exceed upper; {int((lower > upper).sum())} "
                         "interval(s) have lower > upper")
    return lower, upper


def _check_intervals(y, lower, upper):
    lower, upper = _check_bounds(lower, upper)
    y = _as_float_array(y, "y")
    if y.shape != lower.shape:
        if _is_column(y, lower):
            y, lower, upper = y.reshape(-1), lower.reshape(-1), upper.reshape(-1)
        else:
            raise ValueError(f"y and the bounds must have the same shape; got y {y.shape} "
                             f"and bounds {lower.shape}")
    _check_finite(y, "y")
    return y, lower, upper


def interval_coverage(y, lower, upper):
    """Compute the fraction of targets inside their prediction intervals.

    Parameters
    ----------
    y : array-like of shape (n,) or (n, t)
        Observed targets.
    lower : array-like of the same shape as ``y``
        Lower bounds (``-inf`` allowed).
    upper : array-like of the same shape as ``y``
        Upper bounds (``inf`` allowed).

    Returns
    -------
    coverage : float
        Fraction of entries with ``lower <= y <= upper``, over all samples and
        targets. For a conformal interval of confidence ``c`` it should be close to
        (and, on average, not below) ``c``.

    Raises
    ------
    ValueError
        On mismatched shapes, NaN, non-finite ``y``, or ``lower > upper``.

    See Also
    --------
    mean_interval_width : The other half of the coverage / width trade-off.

    Examples
    --------
    >>> from sklearn_lla.metrics import interval_coverage
    >>> interval_coverage([0.0, 1.0, 5.0, 2.0], [-1, 0, 0, 2], [1, 2, 3, 4])
    0.75
    """
    y, lower, upper = _check_intervals(y, lower, upper)
    return float(np.mean((y >= lower) & (y <= upper)))


def mean_interval_width(lower, upper):
    """Compute the mean width ``upper - lower`` of prediction intervals.

    Parameters
    ----------
    lower : array-like of shape (n,) or (n, t)
        Lower bounds.
    upper : array-like of the same shape as ``lower``
        Upper bounds.

    Returns
    -------
    width : float
        Mean of ``upper - lower`` over all entries, in the units of ``y``
        (``inf`` if any bound is infinite). Lower is better at equal coverage.

    Raises
    ------
    ValueError
        On mismatched shapes, NaN or ``lower > upper``.

    See Also
    --------
    interval_coverage : The other half of the coverage / width trade-off.

    Examples
    --------
    >>> from sklearn_lla.metrics import mean_interval_width
    >>> mean_interval_width([0.0, 1.0], [1.0, 4.0])
    2.0
    """
    lower, upper = _check_bounds(lower, upper)
    return float(np.mean(upper - lower))


def interval_score(y, lower, upper, confidence=0.9):
    """Compute the mean interval (Winkler) score of central prediction intervals.

    For miscoverage :math:`\\alpha = 1 - c`, the score of one interval
    :math:`[l, u]` is (Winkler 1972; Gneiting & Raftery 2007, eq. 43)

    .. math::

        S_\\alpha(l, u; y) = (u - l) + \\frac{2}{\\alpha}(l - y)\\,[y < l]
        + \\frac{2}{\\alpha}(y - u)\\,[y > u].

    It is a proper scoring rule for the central :math:`(1 - \\alpha)` interval:
    it rewards narrow intervals and penalises misses in proportion to their
    distance, so it ranks interval methods on both width and coverage at once.

    Parameters
    ----------
    y : array-like of shape (n,) or (n, t)
        Observed targets.
    lower : array-like of the same shape as ``y``
        Lower bounds.
    upper : array-like of the same shape as ``y``
        Upper bounds.
    confidence : float, default=0.9
        The nominal coverage ``c = 1 - alpha`` of the intervals, in (0, 1).

    Returns
    -------
    score : float
        The mean interval score over all entries, in the units of ``y``. Lower is
        better.

    Raises
    ------
    ValueError
        On mismatched shapes, NaN, non-finite ``y``, ``lower > upper`` or
        ``confidence`` outside (0, 1).

    See Also
    --------
    interval_coverage : Fraction of targets inside the intervals.
    mean_interval_width : Mean width of the intervals.

    Examples
    --------
    >>> from sklearn_lla.metrics import interval_score
    >>> # width 2, plus 2 / 0.1 * 0.5 for the second target 0.5 above its interval
    >>> round(interval_score([0.0, 1.5], [-1.0, -1.0], [1.0, 1.0], confidence=0.9), 6)
    7.0
    """
    confidence = _check_confidence(confidence)
    y, lower, upper = _check_intervals(y, lower, upper)
    alpha = 1.0 - confidence
    below = np.clip(lower - y, 0.0, None)
    above = np.clip(y - upper, 0.0, None)
    return float(np.mean((upper - lower) + 2.0 / alpha * (below + above)))


#: Alias of :func:`interval_score`.
winkler_score = interval_score


def _check_sets(sets):
    arr = np.asarray(sets)
    if arr.ndim != 2 or arr.shape[1] < 1:
        raise ValueError(f"sets must be a 2-D (n_samples, n_classes) membership array; got "
                         f"shape {arr.shape}")
    if arr.shape[0] == 0:
        raise ValueError("empty input: sets has no rows")
    if arr.dtype != bool:
        if arr.dtype.kind not in "iuf" or not np.isin(arr, (0, 1)).all():
            raise ValueError("sets must be boolean (or 0 / 1): sets[i, j] tells whether class "
                             "j is in the set of row i")
        arr = arr.astype(bool)
    return arr


def set_coverage(y, sets, *, labels=None):
    """Compute the fraction of labels inside their prediction sets.

    Parameters
    ----------
    y : array-like of shape (n,)
        True labels.
    sets : array-like of bool, shape (n, K)
        ``sets[i, j]`` tells whether class ``j`` is in the set of row ``i``, as
        returned by ``predict_set``.
    labels : array-like of shape (K,), default=None
        The class of each column of ``sets`` (e.g. ``estimator.classes_``). If
        ``None``, integer ``y`` in ``[0, K)`` are column indices, and otherwise the
        sorted ``np.unique(y)`` must have ``K`` entries.

    Returns
    -------
    coverage : float
        Fraction of rows whose set contains the true label.

    Raises
    ------
    ValueError
        On mismatched lengths, non-boolean sets or labels that match no column.

    See Also
    --------
    mean_set_size : The average size of the sets.

    Examples
    --------
    >>> import numpy as np
    >>> from sklearn_lla.metrics import set_coverage
    >>> sets = np.array([[True, True, False], [False, False, True], [True, False, False]])
    >>> set_coverage([1, 0, 0], sets)
    0.6666666666666666
    """
    sets = _check_sets(sets)
    y_arr = np.asarray(y)
    n_y = y_arr.shape[0] if y_arr.ndim else None
    if n_y != sets.shape[0]:
        raise ValueError(f"y and sets have inconsistent numbers of samples: {n_y} and "
                         f"{sets.shape[0]}")
    idx = _labels_to_indices(y_arr, sets.shape[1], labels)
    return float(np.mean(sets[np.arange(len(idx)), idx]))


def mean_set_size(sets):
    """Compute the mean number of classes in prediction sets.

    Parameters
    ----------
    sets : array-like of bool, shape (n, K)
        ``sets[i, j]`` tells whether class ``j`` is in the set of row ``i``.

    Returns
    -------
    size : float
        The average set size, in ``[0, K]``. Lower is better at equal coverage;
        1 is a point prediction.

    Raises
    ------
    ValueError
        If ``sets`` is not a non-empty 2-D boolean (or 0 / 1) array.

    See Also
    --------
    set_coverage : Fraction of labels inside their sets.

    Examples
    --------
    >>> import numpy as np
    >>> from sklearn_lla.metrics import mean_set_size
    >>> mean_set_size(np.array([[True, True, False], [False, False, True]]))
    1.5
    """
    return float(_check_sets(sets).sum(axis=1).mean())
