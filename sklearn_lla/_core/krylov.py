"""Batched (preconditioned) conjugate gradients and a randomized Nystrom preconditioner.

Sampled LLA's E-step solves ``M`` shifted systems ``(I + A) x_m = b_m`` with the same
positive semi-definite ``A`` (the prior-whitened GGN ``sigma G sigma``), available only
as a product with a block of vectors (one data pass). Its conditioning is
``1 + lambda_max(A)``: the directions the data pin down, a few large eigenvalues, are
what makes plain conjugate gradients slow. A rank-``r`` randomized Nystrom
approximation ``A ~ U diag(lam) U^T`` (Frangella, Tropp and Udell, SIAM J. Matrix
Anal. Appl. 2023) costs one product with ``r`` vectors and gives the preconditioner

``P = (U diag(lam + 1) U^T) / (lam_r + 1) + (I - U U^T)``,

whose inverse is applied in ``O(P r)`` per vector; the preconditioned system's
condition number is about ``(lam_r + 1)`` times smaller in the directions it captures.
Vectors are rows here (a block ``V`` of shape ``(M, P)``), as everywhere in the E-step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["NystromPreconditioner", "nystrom_preconditioner", "block_cg"]

_F64 = torch.float64


@dataclass
class NystromPreconditioner:
    """The inverse of a randomized Nystrom preconditioner of ``I + c A``.

    Attributes
    ----------
    U : Tensor of shape (P, r)
        Orthonormal columns, the sketch's top eigenvectors of ``A``.
    lam : Tensor of shape (r,)
        Their eigenvalues (non-negative, decreasing), for ``c = 1``.
    scale : float, default=1.0
        ``c``: the preconditioner is for ``I + c A`` (``A`` rescaled without a new sketch;
        a prior or noise variance change in the E-step multiplies ``A`` by a scalar).
    """

    U: torch.Tensor
    lam: torch.Tensor
    scale: float = 1.0

    @property
    def rank(self) -> int:
        """The sketch's rank ``r``."""
        return int(self.lam.shape[0])

    def rescaled(self, c: float) -> NystromPreconditioner:
        """The preconditioner of ``I + c A`` (same sketch)."""
        return NystromPreconditioner(self.U, self.lam, float(c))

    def apply(self, R: torch.Tensor) -> torch.Tensor:
        """``P^{-1} r`` for every row ``r`` of ``R`` (M, P)."""
        lam = self.scale * self.lam
        w = (lam[-1] + 1.0) / (lam + 1.0) - 1.0  # U-coefficients of P^-1 - I
        return R + ((R @ self.U) * w) @ self.U.T


def nystrom_preconditioner(matvec, n: int, rank: int, generator: torch.Generator,
                           device=None, include: torch.Tensor | None = None):
    """Rank-``rank`` randomized Nystrom approximation of a PSD operator, as a preconditioner.

    Parameters
    ----------
    matvec : callable
        ``matvec(V) -> A V`` for a block of row vectors ``V`` of shape ``(rank, n)``
        (float64 in and out): one product with ``rank`` vectors.
    n : int
        Dimension of ``A``.
    rank : int
        Sketch size ``r`` (at most ``n``).
    generator : torch.Generator
        Draws the Gaussian test matrix (on the CPU).
    device : torch.device, optional
        Where the sketch lives.
    include : Tensor of shape (k, n), optional
        Vectors the test matrix contains (``k <= rank``; its other ``rank - k``
        columns are Gaussian), whose products ``A v`` are returned too: a solver
        starting from them (conjugate gradients' initial residual) then needs no
        product of its own. A Nystrom approximation only improves when the test
        matrix's range grows, so fixed vectors next to Gaussian ones do not weaken it
        (and a solver's random start, e.g. prior draws, is itself Gaussian).

    Returns
    -------
    NystromPreconditioner
        With ``scale = 1``; a tuple ``(preconditioner, A include^T)`` (the products
        as rows, (k, n), float64) when ``include`` is given.

    Notes
    -----
    The stable single-pass construction (Tropp et al. 2017): an orthonormal test
    matrix ``Q``, ``Y = A Q``, a shift ``nu`` of the order of float64 rounding times
    ``||Y||``, the Cholesky factor of ``Q^T (Y + nu Q)`` and the SVD of
    ``(Y + nu Q) C^-T``; eigenvalues below the shift are clipped at zero. A direction
    the sketch gets wrong only slows the solver; the solution is that of the original
    system whatever the preconditioner, as long as it is positive definite (it is:
    every weight is positive).
    """
    rank = max(1, min(int(rank), int(n)))
    k = 0 if include is None else int(include.shape[0])
    if k > rank:
        raise ValueError(f"include has {k} vectors, more than the rank {rank}")
    omega = torch.randn((n, rank - k), dtype=_F64, generator=generator).to(device)
    if k:
        omega = torch.cat([include.T.to(device=device, dtype=_F64), omega], dim=1)
    Q, Rq = torch.linalg.qr(omega)
    Y = matvec(Q.T.contiguous()).T.to(_F64)  # (n, r)
    # include = Q[:, :k] Rq[:k, :k] (Rq upper triangular): A include = Y[:, :k] Rq[:k, :k]
    products = (Y[:, :k] @ Rq[:k, :k]).T if k else None
    nu = math.sqrt(n) * torch.finfo(_F64).eps * float(torch.linalg.norm(Y))
    nu = max(nu, torch.finfo(_F64).tiny)
    Y = Y + nu * Q
    core = Q.T @ Y
    L, info = torch.linalg.cholesky_ex(0.5 * (core + core.T))
    if int(info) != 0:  # numerically indefinite (rounding in the products): shift further
        extra = float(-torch.linalg.eigvalsh(0.5 * (core + core.T)).min()) + 10 * nu
        Y, nu = Y + extra * Q, nu + extra
        core = Q.T @ Y
        L = torch.linalg.cholesky(0.5 * (core + core.T))
    B = torch.linalg.solve_triangular(L, Y.T, upper=False).T  # Y C^-T, C = L
    U, s, _ = torch.linalg.svd(B, full_matrices=False)
    lam = (s.pow(2) - nu).clamp_min(0.0)
    if include is None:
        return NystromPreconditioner(U, lam)
    return NystromPreconditioner(U, lam), products


def block_cg(op, B: torch.Tensor, X: torch.Tensor, tol: float, max_iter: int,
             precond=None, callback=None, start_product: torch.Tensor | None = None):
    """Conjugate gradients on ``op(X) = B`` for every row, batched (one ``op`` per iteration).

    Parameters
    ----------
    op : callable
        ``op(V) -> M V`` for a block of rows ``V`` (k, n), ``M`` symmetric positive
        definite (the same for every row).
    B : Tensor of shape (k, n)
        Right-hand sides.
    X : Tensor of shape (k, n)
        Start; updated in place and returned.
    tol : float
        A row is converged when ``||b - M x|| <= tol ||b||``; the run ends when every
        row is (or after ``max_iter`` iterations).
    max_iter : int
        Most iterations.
    precond : callable, optional
        ``precond(R) -> P^{-1} R`` row by row, ``P`` symmetric positive definite and
        fixed for the run; ``None``: plain conjugate gradients.
    callback : callable, optional
        ``callback(it, rel)`` after every iteration (``rel``: the largest relative
        residual).
    start_product : Tensor of shape (k, n), optional
        ``op(X)`` at the start when it is already known (e.g. from a preconditioner's
        sketch, :func:`nystrom_preconditioner`'s ``include``): the initial residual
        then costs no product.

    Returns
    -------
    X : Tensor of shape (k, n)
    it : int
        Iterations run.
    rel : float
        The largest relative residual at the end.
    R : Tensor of shape (k, n)
        The residuals ``b - M x`` (as updated by the recurrence).

    Raises
    ------
    FloatingPointError
        When the residual is not finite.
    """
    tiny = torch.finfo(_F64).tiny
    bnorm = B.norm(dim=1).clamp_min(tiny)
    R = B - (op(X) if start_product is None else start_product)
    Zr = precond(R) if precond is not None else R
    D = Zr.clone()
    rz = (R * Zr).sum(1)
    it, rel = 0, float((R.norm(dim=1) / bnorm).max())
    while rel > tol and it < max_iter:
        MD = op(D)
        alpha = rz / (D * MD).sum(1).clamp_min(tiny)
        X += alpha[:, None] * D
        R -= alpha[:, None] * MD
        Zr = precond(R) if precond is not None else R
        rz_new = (R * Zr).sum(1)
        D = Zr + (rz_new / rz.clamp_min(tiny))[:, None] * D
        rz, it = rz_new, it + 1
        rel = float((R.norm(dim=1) / bnorm).max())
        if not math.isfinite(rel):
            raise FloatingPointError(f"conjugate gradients diverged at iteration {it}")
        if callback is not None:
            callback(it, rel)
    return X, it, rel, R
