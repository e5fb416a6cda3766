"""Dense float64 linear algebra with escalating jitter: Cholesky, eigh, inverse."""

from __future__ import annotations

import warnings

import numpy as np
import torch

__all__ = ["LinAlgWarning", "cholesky", "safe_eigh", "dense_inverse"]


class LinAlgWarning(UserWarning):
    """Warning raised when jitter had to be added to make a matrix positive definite."""


def cholesky(A: torch.Tensor, what: str = "matrix", *, warn: bool = True,
             inplace: bool = False, max_tries: int = 8) -> torch.Tensor:
    """Lower Cholesky factor of a symmetric PSD matrix, with escalating diagonal jitter.

    The one jittered Cholesky of the package. Tries the plain factorisation of the
    symmetrised matrix first, then adds ``jitter * mean |diag(A)|`` with jitter 1e-10,
    1e-9, ... (the scale is a detached constant, so gradients flow through ``A``
    alone), and raises a :class:`numpy.linalg.LinAlgError` naming ``what`` when even
    the largest jitter fails (a non-finite or indefinite matrix).

    Parameters
    ----------
    A : Tensor of shape (..., n, n)
        Symmetric positive semi-definite (batched is fine out of place).
    what : str, default="matrix"
        The matrix's name in warnings and errors.
    warn : bool, default=True
        Warn with :class:`LinAlgWarning` when jitter was needed; ``False`` in
        optimisation loops, where a step's jitter is routine.
    inplace : bool, default=False
        Factorise a contiguous float64 CPU matrix in its own memory (LAPACK ``potrf``,
        no second ``n x n`` buffer; a failed attempt is undone from the untouched
        strict upper triangle and the saved diagonal). Elsewhere out of place.
    max_tries : int, default=8
        Jitter escalations before giving up.

    Returns
    -------
    Tensor
        ``L`` with ``L L^T = A + jitter``.
    """
    if inplace and A.device.type == "cpu" and A.dtype == torch.float64 and A.is_contiguous() \
            and A.ndim == 2:
        return _cholesky_lapack_inplace(A, what, warn, max_tries)
    A = 0.5 * (A + A.transpose(-1, -2))
    L, info = torch.linalg.cholesky_ex(A)
    if not bool((info != 0).any()):
        return L
    scale = float(torch.diagonal(A.detach(), dim1=-2, dim2=-1).abs().mean().clamp_min(
        torch.finfo(A.dtype).tiny))
    eye = torch.eye(A.shape[-1], dtype=A.dtype, device=A.device)
    jitter = 1e-10
    for _ in range(max_tries):
        L, info = torch.linalg.cholesky_ex(A + (jitter * scale) * eye)
        if not bool((info != 0).any()):
            if warn:
                warnings.warn(f"{what} was not numerically positive definite; added jitter "
                              f"{jitter:.0e} x mean diagonal to factorise it.", LinAlgWarning,
                              stacklevel=2)
            return L
        jitter *= 10.0
    raise np.linalg.LinAlgError(
        f"{what} is not positive definite even with jitter {jitter / 10:.0e} x its mean "
        "diagonal; its entries may be non-finite")


def safe_eigh(A: torch.Tensor, name: str = "matrix", max_tries: int = 12):
    """Eigendecomposition of a symmetric matrix in float64, with escalating jitter.

    ``torch.linalg.eigh`` can fail to converge on ill-conditioned input; the matrix
    is then shifted by ``jitter * mean |diag|`` (1e-10, x10 per try) and the shift is
    removed from the eigenvalues. Eigenvalues are returned in ascending order.
    """
    A = 0.5 * (A + A.transpose(-1, -2)).double()
    if not bool(torch.isfinite(A).all()):
        raise ValueError(f"{name} contains non-finite values (NaN or inf)")
    scale = float(torch.diagonal(A, dim1=-2, dim2=-1).abs().mean().clamp_min(1e-300))
    eye = torch.eye(A.shape[-1], dtype=A.dtype, device=A.device)
    jitter = 0.0
    for _ in range(max_tries):
        try:
            e, U = torch.linalg.eigh(A + (jitter * scale) * eye if jitter else A)
            if bool(torch.isfinite(e).all()):
                if jitter:
                    warnings.warn(f"eigendecomposition of {name} needed jitter {jitter:.0e} x "
                                  "mean diagonal", LinAlgWarning, stacklevel=2)
                return e - jitter * scale, U
        except RuntimeError:  # eigh did not converge
            pass
        jitter = 1e-10 if jitter == 0.0 else jitter * 10.0
    raise np.linalg.LinAlgError(f"eigendecomposition of {name} failed even with jitter")


def _cholesky_lapack_inplace(B, name, warn, max_tries):
    """:func:`cholesky` of a contiguous float64 CPU matrix, overwriting ``B``."""
    from scipy.linalg import lapack

    arr = B.numpy()
    if not np.isfinite(arr).all():  # LAPACK's potrf does not reject NaN
        raise np.linalg.LinAlgError(f"{name} is not positive definite: it has non-finite "
                                    "entries")
    diag = arr.diagonal().copy()
    scale = max(float(np.abs(diag).mean()), np.finfo(np.float64).tiny)
    jitter = 0.0
    for _ in range(max_tries + 1):
        # arr.T is Fortran-ordered: its upper triangle is arr's lower one
        _, info = lapack.dpotrf(arr.T, lower=0, clean=0, overwrite_a=1)
        if info == 0:
            if jitter and warn:
                warnings.warn(f"{name} was not numerically positive definite; added jitter "
                              f"{jitter:.0e} x mean diagonal to factorise it.", LinAlgWarning,
                              stacklevel=3)
            return B.tril_()
        if info < 0:  # pragma: no cover - invalid argument
            raise np.linalg.LinAlgError(f"LAPACK potrf failed on {name} (info={info})")
        low = np.tril_indices_from(arr, -1)
        arr[low] = arr.T[low]  # restore the lower triangle from the upper one
        jitter = 1e-10 if jitter == 0.0 else jitter * 10.0
        np.fill_diagonal(arr, diag + jitter * scale)
    raise np.linalg.LinAlgError(
        f"{name} is not positive definite even with jitter {jitter:.0e} x mean diagonal"
    )


def dense_inverse(H):
    """Inverse of an SPD matrix by Cholesky (float64)."""
    L = cholesky(H, "posterior precision")
    return torch.cholesky_inverse(L)
