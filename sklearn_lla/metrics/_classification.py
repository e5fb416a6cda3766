"""Metrics of predicted class probabilities: ECE and its curve, Brier score, entropy, OOD-AUC."""

from __future__ import annotations

import numpy as np
from scipy.special import entr
from sklearn.metrics import roc_auc_score

from ._validation import (
    _check_classification_inputs,
    _check_n_bins,
    _check_proba,
)


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
