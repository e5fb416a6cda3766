"""The one jittered Cholesky (``sklearn_lla._core.linalg.cholesky``) and ``safe_eigh``."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from sklearn_lla._core.linalg import LinAlgWarning, cholesky, dense_inverse, safe_eigh


def _spd(n, seed, rank=None):
    g = torch.Generator().manual_seed(seed)
    B = torch.randn(n, rank or n, dtype=torch.float64, generator=g)
    return B @ B.T + (0.0 if rank else 1e-3) * torch.eye(n, dtype=torch.float64)


@pytest.mark.parametrize("inplace", [False, True])
def test_positive_definite_needs_no_jitter(inplace):
    A = _spd(30, 0)
    want = torch.linalg.cholesky(A)
    B = A.clone()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        L = cholesky(B, "A", inplace=inplace)
    torch.testing.assert_close(L, want, rtol=1e-12, atol=1e-12)
    if inplace:  # LAPACK worked in B's own memory
        assert L.data_ptr() == B.data_ptr()
    else:
        torch.testing.assert_close(B, A, rtol=0, atol=0)


@pytest.mark.parametrize("inplace", [False, True])
def test_singular_gets_the_smallest_jitter_that_works_and_warns(inplace):
    A = _spd(20, 1, rank=5)  # PSD of rank 5: the plain factorisation fails
    with pytest.warns(LinAlgWarning, match="the test matrix was not numerically positive"):
        L = cholesky(A.clone(), "the test matrix", inplace=inplace)
    # the factor reproduces A up to the jitter (<= 1e-10 * 10^7 x the mean diagonal)
    resid = (L @ L.T - A).abs().max() / A.diagonal().mean()
    assert 0 < float(resid) < 1e-2
    # both routes take the same jitter
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", LinAlgWarning)
        other = cholesky(A.clone(), inplace=not inplace)
    # (the factor of a matrix this ill-conditioned carries rounding ~1e-10 x its scale)
    torch.testing.assert_close(L, other, rtol=0, atol=1e-8 * float(L.abs().max()))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warn=False: silent
        cholesky(A.clone(), warn=False, inplace=inplace)


@pytest.mark.parametrize("inplace", [False, True])
def test_non_finite_raises_naming_the_matrix(inplace):
    A = torch.full((3, 3), float("nan"), dtype=torch.float64)
    with pytest.raises(np.linalg.LinAlgError, match="the NaN matrix is not positive definite.*"
                       "non-finite"):
        cholesky(A, "the NaN matrix", inplace=inplace, warn=False)


def test_gradients_flow_through_the_jittered_factor():
    # the jitter scale is a detached constant: d(logdet)/dA = A_j^-1 of the jittered A_j
    A = _spd(6, 2, rank=3).requires_grad_(True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", LinAlgWarning)
        L = cholesky(A, warn=False)
    (2 * torch.log(torch.diagonal(L)).sum()).backward()
    Aj = L.detach() @ L.detach().T
    want = torch.linalg.inv(Aj)
    # A_j's condition number is ~1e10 (jitter 1e-10): its inverse is accurate to ~1e-6
    torch.testing.assert_close(0.5 * (A.grad + A.grad.T), want, rtol=1e-4, atol=0)


def test_batched_out_of_place():
    A = torch.stack([_spd(4, s) for s in range(3)])
    torch.testing.assert_close(cholesky(A), torch.linalg.cholesky(A), rtol=1e-12, atol=1e-12)


def test_dense_inverse_and_safe_eigh():
    A = _spd(12, 3)
    torch.testing.assert_close(dense_inverse(A), torch.linalg.inv(A), rtol=1e-9, atol=1e-9)
    e, U = safe_eigh(A)
    torch.testing.assert_close(U @ torch.diag(e) @ U.T, A, rtol=1e-10, atol=1e-10)
    with pytest.raises(ValueError, match="non-finite"):
        safe_eigh(torch.full((2, 2), float("inf"), dtype=torch.float64))
