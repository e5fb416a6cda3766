"""Metrics of a Gaussian predictive: NLL, CRPS, the centred quantile metric and its curve."""

from __future__ import annotations

import numpy as np
from scipy import stats

from ._validation import _as_float_array, _check_finite, _check_regression_inputs

#: The 11-point grid ``0, 0.1, ..., 1`` of central-interval levels used by the CQM.
_CQM_ALPHAS = np.linspace(0.0, 1.0, 11)


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
