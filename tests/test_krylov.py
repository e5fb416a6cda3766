"""Batched (preconditioned) conjugate gradients and the randomized Nystrom
preconditioner (``sklearn_lla._core.krylov``) against dense solves."""

from __future__ import annotations

import torch

from sklearn_lla._core.krylov import block_cg, nystrom_preconditioner


def _problem(n=300, k=40, seed=0):
    """``A = F F^T`` with a fast-decaying spectrum (as a GGN: a few stiff directions)."""
    g = torch.Generator().manual_seed(seed)
    Q = torch.linalg.qr(torch.randn(n, k, dtype=torch.float64, generator=g)).Q
    lam = 1e4 * torch.logspace(0, -5, k, dtype=torch.float64)
    A = (Q * lam) @ Q.T
    B = torch.randn(5, n, dtype=torch.float64, generator=g)
    return A, B


def test_nystrom_sketch_recovers_low_rank_operator():
    A, _ = _problem()
    pre = nystrom_preconditioner(lambda V: V @ A, A.shape[0], 60, torch.Generator().manual_seed(1))
    # rank 60 >= rank(A) = 40: the sketch is A itself (to rounding)
    rec = (pre.U * pre.lam) @ pre.U.T
    assert torch.linalg.norm(rec - A) / torch.linalg.norm(A) < 1e-8
    assert torch.all(pre.lam[:-1] >= pre.lam[1:]) and torch.all(pre.lam >= 0)
    # a rescaled copy is the preconditioner of I + c A: P^-1 (I + c A) = I on span(U)
    c = 0.3
    M = torch.eye(A.shape[0], dtype=torch.float64) + c * A
    PM = pre.rescaled(c).apply(M.T.contiguous()).T  # P^-1 M (M is symmetric)
    ev = torch.linalg.eigvals(PM).real
    assert float(ev.max() / ev.min()) < 1.0 + 1e-6


def test_preconditioned_cg_solves_with_fewer_iterations():
    A, B = _problem()
    n = A.shape[0]
    M = torch.eye(n, dtype=torch.float64) + A
    exact = torch.linalg.solve(M, B.T).T

    def op(V):
        return V @ M

    X0 = torch.zeros_like(B)
    plain, it_plain, rel_plain, R = block_cg(op, B, X0.clone(), 1e-10, 1000)
    # rank 20 < rank(A): an approximate sketch, the solution is still the system's
    pre = nystrom_preconditioner(lambda V: V @ A, n, 20, torch.Generator().manual_seed(2))
    pcg, it_pcg, rel_pcg, _ = block_cg(op, B, X0.clone(), 1e-10, 1000, pre.apply)
    print(f"\n[krylov] iterations plain {it_plain}, Nystrom rank 20 {it_pcg}")
    for X, rel in ((plain, rel_plain), (pcg, rel_pcg)):
        assert rel <= 1e-10
        assert torch.linalg.norm(X - exact) / torch.linalg.norm(exact) < 1e-8
    assert it_pcg < it_plain / 2
    # the recurrence's residual is the true one (what the E-step's gamma relies on)
    assert torch.linalg.norm(R - (B - op(plain))) <= 1e-12 * torch.linalg.norm(B)
