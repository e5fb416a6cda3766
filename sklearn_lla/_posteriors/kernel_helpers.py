"""Helpers of the FMGP kernels (:mod:`sklearn_lla.kernels`): the median heuristic,
positivity checks of user-given hyperparameters and scaled squared distances."""

from __future__ import annotations

import math

import numpy as np
import torch

__all__ = ["HEURISTIC_ROWS", "median_heuristic"]

_F64 = torch.float64

#: Rows read (at most) for the median heuristic and the feature scale.
HEURISTIC_ROWS = 1000


def median_heuristic(X):
    """Length scales by the median heuristic on standardised inputs.

    With ``s_d`` the standard deviation of feature ``d`` (1 for a constant feature)
    and ``u = x / s`` the standardised inputs, ``l0 = sqrt(median ||u_i - u_j||^2 / 2)``
    over the pairs of *distinct* rows (1 when all rows coincide), and the ARD length
    scales are ``l_d = l0 s_d``: the heuristic in standardised units, mapped back to
    the raw inputs. Never zero, never NaN.

    Parameters
    ----------
    X : array-like of shape (n, n_features)
        A sample of the inputs (at most :data:`HEURISTIC_ROWS` rows are used).

    Returns
    -------
    ndarray of shape (n_features,)
        Positive length scales.

    Examples
    --------
    >>> import numpy as np
    >>> from sklearn_lla.kernels import median_heuristic
    >>> X = np.array([[0.0, 5.0], [1.0, 5.0], [3.0, 5.0]])
    >>> median_heuristic(X).round(4)
    array([1.4142, 1.1339])
    """
    X = np.asarray(X, dtype=np.float64)
    if X.ndim != 2:
        X = X.reshape(len(X), -1)
    X = X[:HEURISTIC_ROWS]
    if len(X) < 2:
        return np.ones(X.shape[1])
    sd = X.std(axis=0)
    sd = np.where(sd > 0, sd, 1.0)
    U = (X - X.mean(axis=0)) / sd
    sq = (U * U).sum(1)
    d2 = sq[:, None] + sq[None, :] - 2.0 * U @ U.T
    iu = np.triu_indices(len(U), k=1)
    d2 = d2[iu]
    # distinct pairs only; the Gram formula leaves ~1e-15 on duplicates
    d2 = d2[d2 > 1e-12 * max(1.0, float(sq.max(initial=0.0)))]
    l0 = math.sqrt(float(np.median(d2)) / 2.0) if len(d2) else 1.0
    return l0 * sd


def _positive(value, name, shape=None):
    arr = np.asarray(value, dtype=np.float64)
    if not np.all(np.isfinite(arr)) or np.any(arr <= 0):
        raise ValueError(f"{name} must be positive and finite, got {value!r}")
    if shape is not None and arr.ndim == 1 and arr.shape != shape:
        raise ValueError(f"{name} has {arr.shape[0]} entries but the inputs have "
                         f"{shape[0]} features")
    return arr


class _ScaledDistance:
    """Squared ARD distances ``sum_d (x_d - z_d)^2 / l_d^2`` (float64).

    Inputs are centred at the training mean first (distances are unchanged; the
    Gram-matrix formula loses less to cancellation), then divided by the length
    scales.
    """

    def __init__(self, log_ls, center):
        self.log_ls = log_ls
        self.center = center

    def scale(self, x):
        return (x.to(_F64).reshape(len(x), -1) - self.center) * torch.exp(-self.log_ls)

    @staticmethod
    def sq(a, b):
        d2 = (a * a).sum(-1)[:, None] + (b * b).sum(-1)[None, :] - 2.0 * a @ b.T
        return d2.clamp_min(0.0)
