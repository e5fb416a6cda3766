"""The diagonal complement VaLLA uses (``covariance="subspace+diagonal"``).

Moved out of :mod:`~sklearn_lla._posteriors.complement` (which re-exports its names):
a diagonal posterior computed from Jacobian rows and the Nystrom residual the sparse
GP has anyway, for any network (the comments below).
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["DiagonalComplement", "row_subset", "weighted_sq_norms", "mixed_sq_colsum",
           "MAX_ROWS"]

_F64 = torch.float64

#
# A diagonal posterior for the parameter directions a low-rank method does not keep.
#
# Methods that keep a subspace of the parameters (VaLLA's span of the inducing pairs'
# Jacobian rows) treat the rest in one of two extreme ways: as the prior (VaLLA's
# ``"full"`` covariance: variance ``s0^2`` in every direction the span misses, also
# those the data determine, so the predictive is far too wide in distribution when the
# data determine more directions than the span holds), or as nothing (``"subspace"``:
# no variance outside the span, so off the data, where the network's Jacobian leaves
# it, the predictive keeps a small fraction of LLA's). LLA's own posterior is in
# between: the complement's directions have the precision ``1 / s0^2`` plus whatever
# curvature the data put on them.
#
# :class:`DiagonalComplement` gives the complement that posterior, diagonal in the
# parameters. With ``Pi`` the projector onto the complement, ``r = Pi J^T`` the part of
# a Jacobian row outside the span and ``Lam_n`` the likelihood's curvature,
#
#     ``D = diag(sum_n Pi J_n^T Lam_n J_n Pi) + 1 / s0^2``,   ``S_perp(x) = r(x)^T D^-1 r(x)``.
#
# Both are evaluated with a row's outside fraction instead of its projected entries,
# which would cost ``O(P K)`` per row against a span of ``K`` directions:
#
# * the squared entries of ``r_n`` are taken as those of ``J_n`` times
#   ``rho_n = |r_n|^2 / |J_n|^2``, so ``D`` is the diagonal GGN with ``Lam_n`` scaled
#   by ``rho_n^(1/2) Lam_n rho_n^(1/2)`` (``O(P)`` per row);
# * ``S_perp(x) = w(x)^(1/2) R(x) w(x)^(1/2)``, ``R(x) = (Pi J^T)^T (Pi J^T)`` the prior
#   residual of the span (for a Nystrom span, ``(K - Q) / s0^2`` from the kernel
#   matrices the method has anyway) and ``w_c(x) = J_c D^-1 J_c^T / J_c J_c^T``, the
#   mean inverse precision along output ``c``'s row (``O(P)`` per point and output).
#
# Two limits make it the right interpolation. When the span contains every training
# row's Jacobian (inducing pairs at every training row and output), ``rho_n = 0``,
# ``D = I / s0^2`` and ``S_perp = R`` times ``s0^2`` is exactly what LLA's posterior
# has outside that span (no data constrain those directions): the method is exact
# LLA. A direction no residual row touches keeps the prior variance, and one the data
# pin down gets at most the inverse of their curvature. The complement is independent
# of the span (no cross covariance), as in a mean-field posterior over the two blocks.
#
# On the 1-D gap problem at ``M = 20`` inducing pairs and on friedman1 at ``M = 100,
# 300``, against exact LLA at its own hyperparameters: mean epistemic variance 0.80-1.10
# x exact's in and under shift, rank correlation 0.87-0.98 (``"subspace"``: 0.04-0.23 x,
# ``"full"``: 1.3-6.3 x); ``docs/valla.md``.
#
# All the algebra is float64 whatever the network's dtype; nothing here holds more than
# one batch of Jacobian rows.

#: Most training rows read to estimate the complement's curvature (scaled to ``N``).
MAX_ROWS = 2000


def weighted_sq_norms(lin, x, weights: torch.Tensor) -> torch.Tensor:
    """``sum_p J_c(x)_p^2 w_kp`` per point, output and weight vector, (B, C, K), float64.

    By the rows' own :meth:`~sklearn_lla._network.backends.base.Rows.weighted_sq_norms`
    (per-layer factors never form a row: for a linear layer, ``sum_oi delta_o^2 W_oi
    a_i^2 = (delta^2)^T W (a^2)``); the rows at ``x`` are computed once for all ``K``
    vectors.

    Parameters
    ----------
    lin : LinearizedNet
        The network.
    x : Tensor of shape (B, ...)
        Inputs.
    weights : Tensor of shape (K, P)
        ``K`` vectors ``w`` over the linearised parameters.

    Returns
    -------
    Tensor of shape (B, C, K)
    """
    with torch.no_grad():
        rows = lin.rows(x)
        out = rows.weighted_sq_norms(lin.unflatten(weights.to(_F64)))
        return out.view(rows.n_points, rows.rows_per_point, -1)


def mixed_sq_colsum(lin, x, M: torch.Tensor) -> torch.Tensor:
    """``sum_b sum_j (sum_c M_bjc J_c(x_b))_p^2`` per parameter, shape (P,), float64.

    The diagonal of ``sum_b J_b^T M_b^T M_b J_b``: with ``M_b M_b^T``-type factors of a
    curvature, a diagonal GGN. By the rows' own
    :meth:`~sklearn_lla._network.backends.base.Rows.mixed_sq_colsum` (mixing a point's
    factored rows mixes only their ``delta``).

    Parameters
    ----------
    lin : LinearizedNet
        The network.
    x : Tensor of shape (B, ...)
        Inputs.
    M : Tensor of shape (B, K, C)
        The per-point mixing of the outputs' rows.

    Returns
    -------
    Tensor of shape (P,)
    """
    from .._network.linearized import stack_flat

    with torch.no_grad():
        parts = lin.rows(x).mixed_sq_colsum(M)
        return stack_flat({n: v[None] for n, v in parts.items()}, lin.names)[0]


class DiagonalComplement:
    """The diagonal posterior of the directions outside a kept span (module docstring).

    Parameters
    ----------
    prior_variance : float
        ``s0^2``.
    n_parameters : int
        ``P``.
    device : torch.device or str, default="cpu"
        Where the precision lives.

    Attributes
    ----------
    curvature : Tensor of shape (P,)
        ``diag(sum_n Pi J_n^T Lam_n J_n Pi)`` (float64), scaled to all training rows.
    precision : Tensor of shape (P,)
        ``D``: the curvature plus ``1 / s0^2``.
    n_rows : int
        Training rows the curvature was estimated on.

    Examples
    --------
    No data: the complement keeps the prior, ``S_perp = s0^2 R``.

    >>> import torch
    >>> from sklearn_lla._posteriors.diagonal_complement import DiagonalComplement
    >>> comp = DiagonalComplement(0.5, 3).finish(n_rows=0, n_total=0)
    >>> w = comp.precision.new_full((1, 1), 1.0 / float(comp.precision[0]))  # (B, C)
    >>> R = torch.tensor([[[4.0]]], dtype=torch.float64)  # the span's residual
    >>> round(float(comp.blocks(w, R)[0, 0, 0]), 12)
    2.0
    """

    def __init__(self, prior_variance: float, n_parameters: int, device="cpu"):
        self.prior_variance = float(prior_variance)
        self.curvature = torch.zeros(int(n_parameters), dtype=_F64, device=device)
        self.n_rows = 0

    def add_rows(self, lin, x, outside: torch.Tensor, lam_factor: torch.Tensor):
        """Accumulate a batch of training rows' curvature (factored where it can be).

        Parameters
        ----------
        lin : LinearizedNet
            The network.
        x : Tensor of shape (B, ...)
            A batch of training inputs.
        outside : Tensor of shape (B, C)
            ``rho``: the fraction of each row's squared norm outside the span, in [0, 1].
        lam_factor : Tensor of shape (B, C, C)
            ``A`` with ``A A^T = Lam`` (the likelihood's curvature at the network's
            outputs).

        Returns
        -------
        self
        """
        s = torch.sqrt(torch.clamp(outside.to(_F64), 0.0, 1.0))
        M = lam_factor.to(_F64).transpose(1, 2) * s[:, None, :]  # (B, C, C): A^T diag(s)
        self.curvature += mixed_sq_colsum(lin, x, M).to(self.curvature.device)
        self.n_rows += int(x.shape[0])
        return self

    def finish(self, n_rows: int, n_total: int):
        """Scale the curvature of ``n_rows`` rows to ``n_total`` and form ``D``.

        Parameters
        ----------
        n_rows : int
            Rows accumulated by :meth:`add`.
        n_total : int
            ``N``, the training rows they stand for.

        Returns
        -------
        self
        """
        if n_rows > 0:
            self.curvature = self.curvature * (float(n_total) / n_rows)
        self.n_rows = int(n_rows)
        self.precision = self.curvature + 1.0 / self.prior_variance
        return self

    def inverse_precision(self, lin, x) -> torch.Tensor:
        """``w_c = J_c D^-1 J_c^T / J_c J_c^T`` per point and output, shape (B, C).

        From the network's rows at ``x`` (factored where it can, see
        :func:`weighted_sq_norms`).

        Parameters
        ----------
        lin : LinearizedNet
            The network.
        x : Tensor of shape (B, ...)
            Inputs.

        Returns
        -------
        Tensor of shape (B, C)
            In ``(0, s0^2]``; ``s0^2`` for a zero row.
        """
        both = torch.stack([1.0 / self.precision, torch.ones_like(self.precision)])
        nd = weighted_sq_norms(lin, x, both)
        num, den = nd[..., 0], nd[..., 1]
        return torch.where(den > 0, num / torch.where(den > 0, den, 1.0),
                           torch.full_like(den, self.prior_variance))

    def blocks(self, w: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """``S_perp(x) = w^(1/2) R w^(1/2)`` per point, shape (B, C, C), float64.

        Parameters
        ----------
        w : Tensor of shape (B, C)
            :meth:`inverse_precision` at the points.
        residual : Tensor of shape (B, C, C)
            ``R``: the prior residual ``(Pi J^T)^T (Pi J^T)`` per point (unscaled by
            ``s0^2``).

        Returns
        -------
        Tensor of shape (B, C, C)
        """
        s = torch.sqrt(w.to(_F64))
        return s[:, :, None] * residual.to(_F64) * s[:, None, :]

    def joint(self, w: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """``S_perp`` between every output of every point, shape (B C, B C).

        Parameters
        ----------
        w : Tensor of shape (B, C)
            :meth:`inverse_precision` at the points.
        residual : Tensor of shape (B C, B C)
            The prior residual between every pair (unscaled by ``s0^2``).

        Returns
        -------
        Tensor of shape (B C, B C)
        """
        s = torch.sqrt(w.to(_F64)).reshape(-1)
        return s[:, None] * residual.to(_F64) * s[None, :]

    def trace(self) -> dict:
        """A summary for ``hyper_trace``: rows read and the precision's spread."""
        ratio = self.precision * self.prior_variance
        return {"rows": self.n_rows, "precision_ratio_median": float(ratio.median()),
                "precision_ratio_max": float(ratio.max())}


def row_subset(n_total: int, seed: int, max_rows: int = MAX_ROWS) -> np.ndarray:
    """A seeded, sorted subset of at most ``max_rows`` of ``n_total`` row indices.

    Parameters
    ----------
    n_total : int
        ``N``.
    seed : int
        The subset's seed.
    max_rows : int, default=MAX_ROWS
        Its largest size.

    Returns
    -------
    ndarray of int
    """
    n = int(min(n_total, max_rows))
    return np.sort(np.random.default_rng(seed).permutation(n_total)[:n])
