"""The per-training-row kernel matrices of one VaLLA fit (:class:`RowCache`).

With the inducing inputs ``Z`` fixed (VaLLA's default), the NTK of a training row
against the inducing pairs is a constant of the fit up to the prior variance, so
:class:`~sklearn_lla._posteriors.valla.VaLLAPosterior` computes it once per row and
fit instead of once per epoch.
"""

from __future__ import annotations

import weakref

import numpy as np
import torch

__all__ = ["ROW_CACHE_ELEMENTS", "RowCache"]

_F64 = torch.float64

#: Largest number of float64 elements (``N C (M + C + 1)``) of the per-row kernel
#: matrices a fit keeps (:class:`RowCache`, 128 MiB): with ``Z`` fixed, a training row's
#: ``Kxz``, ``Kxx`` and ``g(x)`` are computed once per fit, not once per epoch.
ROW_CACHE_ELEMENTS = 1 << 24


class RowCache:
    """A fit's per-training-row kernel matrices at a fixed ``Z``, filled as rows come.

    With ``Z`` fixed, the NTK of a training row against the inducing pairs is the
    prior variance times a constant of the fit: ``Kxz = s0^2 J(x) J_Z^T``, ``Kxx =
    s0^2 J(x) J(x)^T``. The cache keeps ``J(x) J_Z^T`` (``C x M``), ``J(x) J(x)^T``
    (``C x C``) and the network's output ``g(x)`` of every row already evaluated --
    by :meth:`~sklearn_lla._posteriors.valla.VaLLAPosterior.start` on its rows, or
    by a training step the first time the row is in a minibatch -- and a step
    computes only its rows not yet there. The values are those the step would
    compute (the same products, in the same dtypes), so the optimisation is
    unchanged; the cost of an epoch after the first is the ``M x M`` algebra alone.
    It lives for one fit (dropped at its end, after the complement, if any, has read
    it).

    Parameters
    ----------
    n, n_outputs, n_inducing : int
        ``N``, ``C``, ``M``.
    device : torch.device
    """

    def __init__(self, n, n_outputs, n_inducing, device):
        C, M = int(n_outputs), int(n_inducing)
        self.Kxz = torch.zeros((n, C, M), dtype=_F64, device=device)
        self.Kxx = torch.zeros((n, C, C), dtype=_F64, device=device)
        self.mean = torch.zeros((n, C), dtype=_F64, device=device)
        self.done = torch.zeros(n, dtype=torch.bool, device=device)
        self._pinned = None

    @staticmethod
    def fits(n, n_outputs, n_inducing):
        """Whether ``n`` rows fit :data:`ROW_CACHE_ELEMENTS`."""
        return n * n_outputs * (n_inducing + n_outputs + 1) <= ROW_CACHE_ELEMENTS

    def put(self, idx, Kxz, Kxx, mean):
        """Store rows ``idx`` (units of ``s0^2``)."""
        t = torch.as_tensor(np.asarray(idx), device=self.done.device)
        self.Kxz[t], self.Kxx[t], self.mean[t] = Kxz, Kxx, mean
        self.done[t] = True

    def pin(self, x, idx):
        """Mark the minibatch tensor ``x`` as training rows ``idx``."""
        self._pinned = (weakref.ref(x), x._version,
                        torch.as_tensor(np.asarray(idx), device=self.done.device))

    def rows_of(self, x):
        """The training rows of the pinned ``x`` (unmodified), else ``None``."""
        pinned = self._pinned
        if pinned is not None and pinned[0]() is x and pinned[1] == x._version:
            return pinned[2]
        return None

    def fill(self, x, t, compute):
        """``(Kxz, Kxx, g)`` of rows ``t`` (the points of ``x``); ``compute(x_sub)``
        gives ``(Kxz, Kxx, g)`` of rows not stored yet."""
        todo = ~self.done[t]
        if bool(todo.any()):
            sel = torch.nonzero(todo).flatten()
            kxz, kxx, g = compute(x[sel.to(x.device)])
            rows = t[sel]
            self.Kxz[rows], self.Kxx[rows], self.mean[rows] = kxz, kxx, g
            self.done[rows] = True
        return self.Kxz[t], self.Kxx[t], self.mean[t]
