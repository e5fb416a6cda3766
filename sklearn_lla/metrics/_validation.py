"""Input checks shared by the metric functions: shapes, finiteness, probabilities, labels."""

from __future__ import annotations

import numbers

import numpy as np

_PROBA_TOL = 1e-6



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
