"""Dense float64 linear algebra with escalating jitter: Cholesky, eigh, inverse."""

from __future__ import annotations

import warnings

import numpy as np
import torch

__all__ = ["LinAlgWarning", "safe_cholesky", "safe_eigh", "cholesky_inplace", "dense_inverse"]


class LinAlgWarning(UserWarning):
    """Warning raised when jitter had to be added to make a matrix positive definite."""


def safe_cholesky(A: torch.Tensor, name: str = "matrix", max_tries: int = 8) -> torch.Tensor:
    """Cholesky factor of a symmetric PSD matrix, with escalating diagonal jitter.

    Tries the plain factorisation first, then adds ``jitter * mean(diag(A))`` with
    jitter 1e-10, 1e-9, ... and warns with :class:`LinAlgWarning` when it had to.
    """
    A = 0.5 * (A + A.transpose(-1, -2))
    L, info = torch.linalg.cholesky_ex(A)
    if not bool((info != 0).any()):
        return L
    scale = torch.diagonal(A, dim1=-2, dim2=-1).abs().mean().clamp_min(
        torch.finfo(A.dtype).tiny
    )
    eye = torch.eye(A.shape[-1], dtype=A.dtype, device=A.device)
    jitter = 1e-10
    for _ in range(max_tries):
        L, info = torch.linalg.cholesky_ex(A + (jitter * scale) * eye)
        if not bool((info != 0).any()):
            warnings.warn(
                f"{name} was not numerically positive definite; added jitter "
                f"{jitter:.0e} x mean diagonal to factorise it.",
                LinAlgWarning,
                stacklevel=2,
            )
            return L
        jitter *= 10.0
    raise np.linalg.LinAlgError(
        f"{name} is not positive definite even with jitter {jitter / 10:.0e} x mean diagonal"
    )


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


def cholesky_inplace(B: torch.Tensor, name: str = "matrix", max_tries: int = 8) -> torch.Tensor:
    """Lower Cholesky factor of a symmetric PD float64 matrix, overwriting ``B``.

    On the CPU, LAPACK's ``potrf`` works in ``B``'s own memory (no second ``n x n``
    buffer). A failed attempt is undone from the untouched strict upper triangle and
    the saved diagonal, and retried with escalating jitter (1e-10, x10, times the
    mean diagonal), with a :class:`LinAlgWarning`. Elsewhere falls back to
    :func:`safe_cholesky`.
    """
    if B.device.type != "cpu" or B.dtype != torch.float64 or not B.is_contiguous():
        return safe_cholesky(B, name, max_tries)
    from scipy.linalg import lapack

    arr = B.numpy()
    diag = arr.diagonal().copy()
    scale = max(float(np.abs(diag).mean()), np.finfo(np.float64).tiny)
    jitter = 0.0
    for _ in range(max_tries + 1):
        # arr.T is Fortran-ordered: its upper triangle is arr's lower one
        _, info = lapack.dpotrf(arr.T, lower=0, clean=0, overwrite_a=1)
        if info == 0:
            if jitter:
                warnings.warn(f"{name} was not numerically positive definite; added jitter "
                              f"{jitter:.0e} x mean diagonal to factorise it.", LinAlgWarning,
                              stacklevel=2)
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
    L = safe_cholesky(H, "posterior precision")
    return torch.cholesky_inverse(L)
