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

#: Smallest ratio of the sketch's smallest to largest squared singular value for which
#: its eigenvectors come from the ``r x r`` Gram (:func:`_nystrom_eig_by_gram`, an
#: orthogonality error below ``1e-8``) rather than the SVD of the tall factor.
_GRAM_SPREAD = 1e-8

#: Smallest ratio of the smallest to largest eigenvalue of ``omega^T omega`` for which
#: the sketch's test matrix is orthonormalised by Cholesky QR (:func:`_orthonormalize`,
#: an orthogonality error below ``1e-9``) rather than Householder QR.
_CHOLQR_SPREAD = 1e-6


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
    Q : Tensor of shape (P, r) or None
        The sketch's orthonormal test matrix (for :meth:`galerkin`).
    AQ : Tensor of shape (P, r) or None
        ``A Q`` (for ``c = 1``), the sketch's products.
    core : Tensor of shape (r, r) or None
        ``Q^T A Q`` (symmetrised).
    """

    U: torch.Tensor
    lam: torch.Tensor
    scale: float = 1.0
    Q: torch.Tensor | None = None
    AQ: torch.Tensor | None = None
    core: torch.Tensor | None = None

    @property
    def rank(self) -> int:
        """The sketch's rank ``r``."""
        return int(self.lam.shape[0])

    def rescaled(self, c: float) -> NystromPreconditioner:
        """The preconditioner of ``I + c A`` (same sketch)."""
        return NystromPreconditioner(self.U, self.lam, float(c), self.Q, self.AQ, self.core)

    def apply(self, R: torch.Tensor) -> torch.Tensor:
        """``P^{-1} r`` for every row ``r`` of ``R`` (M, P)."""
        lam = self.scale * self.lam
        w = (lam[-1] + 1.0) / (lam + 1.0) - 1.0  # U-coefficients of P^-1 - I
        return R + ((R @ self.U) * w) @ self.U.T

    def galerkin(self, X: torch.Tensor, R: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The best correction of ``X`` within the sketch's range, with no product.

        For ``M = I + c A`` and residuals ``R = B - M X`` (rows), the correction
        ``Q g`` minimising the ``M``-norm error of ``X + Q g`` solves
        ``(Q^T M Q) g = Q^T r``, and ``Q^T M Q = I + c Q^T (A Q)`` and ``M Q`` are known
        from the sketch: the new residual is ``r - Q g - c (A Q) g``. A conjugate-gradient
        run started there has an ``M``-norm error no larger than from ``X`` (what
        :func:`block_cg`'s error bound is relative to). When ``B``'s rows are in the
        test matrix (:func:`nystrom_preconditioner`'s ``span``), the correction holds
        the whole right-hand side, not only the stiff directions.

        Parameters
        ----------
        X : Tensor of shape (k, n)
            Start (float64); updated in place and returned.
        R : Tensor of shape (k, n)
            Its residuals; updated in place and returned.

        Returns
        -------
        X, R : Tensor of shape (k, n)
        """
        if self.Q is None or self.AQ is None or self.core is None:
            return X, R
        c = self.scale
        M = torch.eye(self.rank, dtype=_F64, device=self.core.device) + c * self.core
        G = torch.linalg.solve(M, (R @ self.Q).T).T  # (k, r); M is SPD
        GQ = G @ self.Q.T
        X += GQ
        R -= GQ
        R.addmm_(G, self.AQ.T, alpha=-c)
        return X, R


def nystrom_preconditioner(matvec, n: int, rank: int, generator: torch.Generator,
                           device=None, include: torch.Tensor | None = None,
                           span: torch.Tensor | None = None):
    """Rank-``rank`` randomized Nystrom approximation of a PSD operator, as a preconditioner.

    Parameters
    ----------
    matvec : callable
        ``matvec(V) -> A V`` for a block of row vectors ``V`` of shape ``(rank, n)``
        (float64 in and out): one product with ``rank`` vectors. ``V`` is the
        transposed view of the ``(n, rank)`` test matrix (not contiguous: no copy of
        it is made).
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
    span : Tensor of shape (m, n), optional
        More vectors the test matrix contains (after ``include``; ``k + m <= rank``),
        whose products are not returned: a solver's right-hand sides, so that
        :meth:`NystromPreconditioner.galerkin` corrects its start within a range that
        holds them.

    Returns
    -------
    NystromPreconditioner
        With ``scale = 1`` (and the test matrix ``Q`` and ``A Q`` kept for
        :meth:`~NystromPreconditioner.galerkin`); a tuple ``(preconditioner,
        A include^T)`` (the products as rows, (k, n), float64) when ``include`` is
        given.

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
    m = 0 if span is None else int(span.shape[0])
    if k + m > rank:
        raise ValueError(f"include and span have {k + m} vectors, more than the rank {rank}")
    omega = torch.randn((n, rank - k - m), dtype=_F64, generator=generator).to(device)
    fixed = [v.T.to(device=device, dtype=_F64) for v in (include, span) if v is not None]
    if fixed:
        omega = torch.cat(fixed + [omega], dim=1)
    Q, Rq = _orthonormalize(omega)
    del omega, fixed  # (not held during the product)
    AQ = matvec(Q.T).T.to(_F64)  # (n, r)
    # include = Q[:, :k] Rq[:k, :k] (Rq upper triangular): A include = AQ[:, :k] Rq[:k, :k]
    products = (AQ[:, :k] @ Rq[:k, :k]).T if k else None
    nu = math.sqrt(n) * torch.finfo(_F64).eps * float(torch.linalg.norm(AQ))
    nu = max(nu, torch.finfo(_F64).tiny)
    core0 = Q.T @ AQ
    core0 = 0.5 * (core0 + core0.T)  # Q^T A Q
    eye = torch.eye(core0.shape[0], dtype=_F64, device=core0.device)
    L, info = torch.linalg.cholesky_ex(core0 + nu * eye)  # Q^T (A Q + nu Q)
    if int(info) != 0:  # numerically indefinite (rounding in the products): shift further
        nu += float(-torch.linalg.eigvalsh(core0 + nu * eye).min()) + 10 * nu
        L = torch.linalg.cholesky(core0 + nu * eye)
    Y = AQ + nu * Q
    U, lam = _nystrom_eig_by_gram(Y, AQ, core0, L, nu)
    if U is None:  # ill-conditioned: the SVD of the tall factor (accurate at any spread)
        B = torch.linalg.solve_triangular(L, Y.T, upper=False).T  # Y C^-T, C = L
        U, s, _ = torch.linalg.svd(B, full_matrices=False)
        lam = (s.pow(2) - nu).clamp_min(0.0)
    pre = NystromPreconditioner(U, lam, 1.0, Q, AQ, core0)
    return pre if include is None else (pre, products)


def _orthonormalize(omega: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(Q, R)``, ``omega = Q R`` with orthonormal ``Q`` and upper-triangular ``R``.

    Cholesky QR (``omega^T omega = L L^T``, ``Q = omega L^-T``: one ``n x r`` Gram and
    one ``n x r`` product, where Householder QR makes ``Q`` by a second sweep of
    reflections) when ``omega`` is well-conditioned: the orthogonality error of one
    pass is about ``eps cond(omega)^2``, so only for ``cond(omega)^2 <=
    1 / `` :data:`_CHOLQR_SPREAD`; Householder QR otherwise.
    """
    G = omega.T @ omega
    G = 0.5 * (G + G.T)
    ev = torch.linalg.eigvalsh(G)
    if bool(torch.isfinite(ev).all()) and float(ev[0]) > _CHOLQR_SPREAD * float(ev[-1]):
        L, info = torch.linalg.cholesky_ex(G)
        if int(info) == 0:
            eye = torch.eye(L.shape[0], dtype=L.dtype, device=L.device)
            Linv = torch.linalg.solve_triangular(L, eye, upper=False)
            return omega @ Linv.T, L.T
    return torch.linalg.qr(omega)


def _nystrom_eig_by_gram(Y, AQ, core0, L, nu):
    """``(U, lam)`` of the Nystrom approximation ``B B^T``, ``B = Y L^-T``, from the
    eigendecomposition of the small ``B^T B = L^-1 Y^T Y L^-T`` (``r x r``) and
    ``U = Y L^-T V diag(1 / s)``: one ``n x r`` Gram and one ``n x r`` product instead
    of a triangular solve and the SVD of the tall ``B``.

    Squaring ``B`` loses the small singular values' relative accuracy (``U``'s
    orthogonality error is about ``eps s_1^2 / s_r^2``): used only when the spread
    ``s_r^2 / s_1^2`` is above :data:`_GRAM_SPREAD` (checked on ``Q^T A Q`` first, then
    on ``B^T B``); returns ``(None, None)`` otherwise.
    """
    ev = torch.linalg.eigvalsh(core0)
    if float(ev[0] + nu) <= _GRAM_SPREAD * float(ev[-1] + nu):
        return None, None
    eye = torch.eye(L.shape[0], dtype=_F64, device=L.device)
    # Y^T Y for Y = AQ + nu Q (Q orthonormal): AQ^T AQ + 2 nu Q^T A Q + nu^2 I
    YtY = AQ.T @ AQ + (2.0 * nu) * core0 + (nu * nu) * eye
    T = torch.linalg.solve_triangular(L, YtY, upper=False)  # L^-1 Y^T Y
    BtB = torch.linalg.solve_triangular(L, T.T, upper=False)  # L^-1 Y^T Y L^-T
    s2, V = torch.linalg.eigh(0.5 * (BtB + BtB.T))
    s2, V = s2.flip(0), V.flip(1)  # decreasing
    if not bool(torch.isfinite(s2).all()) or float(s2[-1]) <= _GRAM_SPREAD * float(s2[0]):
        return None, None
    U = Y @ (torch.linalg.solve_triangular(L.T, V, upper=True) * s2.rsqrt())
    return U, (s2 - nu).clamp_min(0.0)


def block_cg(op, B: torch.Tensor, X: torch.Tensor, tol: float, max_iter: int,
             precond=None, callback=None, start_product: torch.Tensor | None = None,
             start_correction=None, start_residual: torch.Tensor | None = None):
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
    start_correction : callable, optional
        ``start_correction(X, R) -> (X, R)``: a better start and its residuals from the
        start's, with no product (:meth:`NystromPreconditioner.galerkin`), applied
        before the first iteration.
    start_residual : Tensor of shape (k, n), optional
        ``B - op(X)`` at the start when already known (instead of ``start_product``):
        used as the residual block itself and updated in place (so that a caller
        holding it holds no extra block).

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
    if start_residual is not None:
        R = start_residual
    else:
        R = B - (op(X) if start_product is None else start_product)
    if start_correction is not None:
        X, R = start_correction(X, R)
    Zr = precond(R) if precond is not None else R
    rz = (R * Zr).sum(1)
    D = Zr.clone() if Zr is R else Zr
    del Zr  # (blocks of (k, n) are freed as soon as they are used, none held by op)
    it, rel = 0, float((R.norm(dim=1) / bnorm).max())
    while rel > tol and it < max_iter:
        MD = op(D)
        alpha = rz / (D * MD).sum(1).clamp_min(tiny)
        X += alpha[:, None] * D
        R -= alpha[:, None] * MD
        del MD
        it += 1
        rel = float((R.norm(dim=1) / bnorm).max())
        if not math.isfinite(rel):
            raise FloatingPointError(f"conjugate gradients diverged at iteration {it}")
        if callback is not None:
            callback(it, rel)
        if rel <= tol or it >= max_iter:  # (no next direction to make)
            break
        Zr = precond(R) if precond is not None else R
        rz_new = (R * Zr).sum(1)
        # Zr + beta D, in place in D (the same rounding)
        D.mul_((rz_new / rz.clamp_min(tiny))[:, None]).add_(Zr)
        del Zr
        rz = rz_new
    return X, it, rel, R
