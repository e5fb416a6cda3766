"""Small shared helpers: devices, dtypes, seeding, batching and parameter checks."""

from __future__ import annotations

import contextlib
import numbers
import warnings
from collections.abc import Iterator

import numpy as np
import torch
from sklearn.utils import check_random_state

__all__ = [
    "resolve_device",
    "torch_seed",
    "seeded",
    "iter_batches",
    "check_positive_or_auto",
    "check_positive_int",
    "as_tensor",
    "safe_cholesky",
    "safe_eigh",
    "LinAlgWarning",
]


class LinAlgWarning(UserWarning):
    """Warning raised when jitter had to be added to make a matrix positive definite."""


def resolve_device(device) -> torch.device:
    """Turn the ``device`` constructor parameter into a :class:`torch.device`.

    ``"auto"`` selects CUDA when it is available and the CPU otherwise.
    """
    if device is None or (isinstance(device, str) and device == "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if isinstance(device, torch.device):
        dev = device
    elif isinstance(device, str):
        try:
            dev = torch.device(device)
        except RuntimeError as exc:
            raise ValueError(f"device={device!r} is not a valid torch device") from exc
    else:
        raise TypeError(
            f"device must be 'auto', 'cpu', 'cuda' or a torch.device, got {device!r}"
        )
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} was requested but CUDA is not available")
    return dev


def torch_seed(random_state) -> int:
    """Draw a torch seed from ``random_state`` (int, RandomState or None)."""
    rng = check_random_state(random_state)
    return int(rng.randint(0, 2**31 - 1))


@contextlib.contextmanager
def seeded(seed: int, device: torch.device | None = None):
    """Run a block with torch's global RNG seeded, restoring the previous state afterwards.

    Code that cannot take a :class:`torch.Generator` (skorch training, module
    initialisation) is made reproducible this way without leaving any global seed set.
    """
    devices = []
    if device is not None and device.type == "cuda":
        devices = [device.index if device.index is not None else torch.cuda.current_device()]
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield


def iter_batches(n: int, batch_size: int) -> Iterator[slice]:
    """Yield consecutive slices of ``range(n)`` of length at most ``batch_size``."""
    batch_size = max(int(batch_size), 1)
    for start in range(0, n, batch_size):
        yield slice(start, min(start + batch_size, n))


def check_positive_or_auto(value, name: str, allow_auto: bool = True):
    """Validate a variance-like parameter: a finite float > 0, or ``"auto"``."""
    if allow_auto and isinstance(value, str) and value == "auto":
        return value
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        expected = "a float > 0 or 'auto'" if allow_auto else "a float > 0"
        raise TypeError(f"{name} must be {expected}, got {value!r}")
    if not np.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite positive number, got {value!r}")
    return float(value)


def check_positive_int(value, name: str, minimum: int = 1) -> int:
    """Validate an integer parameter ``>= minimum``."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value!r}")
    return int(value)


def as_tensor(X, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Convert validated array data to a tensor.

    Always copies from numpy (read-only memmaps cannot back a writable tensor).
    """
    arr = np.array(X, copy=True)
    return torch.as_tensor(arr, dtype=dtype, device=device)


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
