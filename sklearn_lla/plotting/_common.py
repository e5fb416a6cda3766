"""Helpers shared by the displays: matplotlib import, axes, names, argument checks."""

from __future__ import annotations

import numbers

import numpy as np

#: How to install the optional plotting dependency.
_INSTALL_HINT = "pip install sklearn-lla[plot]"


def _pyplot(caller):
    """Import ``matplotlib.pyplot`` or raise an ImportError naming the ``plot`` extra."""
    try:
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ImportError(
            f"{caller} requires matplotlib, an optional dependency of sklearn-lla; "
            f"install it with `{_INSTALL_HINT}` (or `pip install matplotlib`)"
        ) from exc
    return plt


def _get_ax(ax, caller):
    plt = _pyplot(caller)
    if ax is None:
        _, ax = plt.subplots()
    return ax


def _estimator_name(estimator):
    return type(estimator).__name__


def _legend_has(ax, label):
    legend = ax.get_legend()
    return legend is not None and any(t.get_text() == label for t in legend.get_texts())


def _check_n_std(n_std):
    values = np.atleast_1d(np.asarray(n_std, dtype=np.float64))
    if values.ndim != 1 or values.size == 0 or not np.all(np.isfinite(values)) or np.any(
        values <= 0
    ):
        raise ValueError(f"n_std must be a positive number or a list of them; got {n_std!r}")
    return tuple(sorted(float(v) for v in values))


def _select_target(arr, target, name):
    """A 1-D view of ``arr`` of shape (n,) or the column ``target`` of shape (n, t)."""
    arr = np.asarray(arr, dtype=np.float64)
    if arr.ndim == 2:
        if not isinstance(target, numbers.Integral) or not -arr.shape[1] <= target < arr.shape[1]:
            raise ValueError(
                f"target={target!r} is not a column of {name}, which has {arr.shape[1]} outputs"
            )
        return arr[:, target]
    if arr.ndim != 1:
        raise ValueError(f"{name} must have shape (n,) or (n, n_outputs); got shape {arr.shape}")
    return arr


def _one_feature(X, name="X"):
    """The single input column of ``X`` (shape (n,) or (n, 1)) as a float array."""
    arr = np.asarray(X, dtype=np.float64)
    if arr.ndim == 2 and arr.shape[1] == 1:
        arr = arr[:, 0]
    if arr.ndim != 1:
        raise ValueError(
            f"{name} must have one input feature, shape (n,) or (n, 1); got shape {arr.shape}. "
            "PredictiveBandDisplay plots 1-D inputs only"
        )
    if arr.size == 0 or not np.all(np.isfinite(arr)):
        raise ValueError(f"{name} must be non-empty and finite")
    return arr


