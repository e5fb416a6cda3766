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


def test_sketch_including_the_start_gives_its_products():
    # A sketch whose test matrix contains the solver's start X0 returns A X0 (no
    # product of its own); the Nystrom approximation is exact on its test matrix's
    # range, so it reproduces A on X0; conjugate gradients started from X0 with
    # op(X0) = X0 + A X0 from the sketch run the same iterations.
    A, B = _problem()
    n = A.shape[0]
    X0 = torch.randn(5, n, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    pre, AX = nystrom_preconditioner(lambda V: V @ A, n, 20, torch.Generator().manual_seed(2),
                                     include=X0)
    assert pre.rank == 20 and AX.shape == X0.shape
    assert torch.linalg.norm(AX - X0 @ A) <= 1e-12 * torch.linalg.norm(X0 @ A)
    rec = ((X0 @ pre.U) * pre.lam) @ pre.U.T
    assert torch.linalg.norm(rec - X0 @ A) <= 1e-8 * torch.linalg.norm(X0 @ A)
    M = torch.eye(n, dtype=torch.float64) + A

    def op(V):
        return V @ M

    X1, it1, rel1, R1 = block_cg(op, B, X0.clone(), 1e-10, 1000, pre.apply)
    X2, it2, rel2, R2 = block_cg(op, B, X0.clone(), 1e-10, 1000, pre.apply,
                                 start_product=X0 + AX)
    assert it1 == it2 and rel2 <= 1e-10
    assert torch.linalg.norm(X2 - X1) <= 1e-10 * torch.linalg.norm(X1)
    # more vectors than the rank: refused
    try:
        nystrom_preconditioner(lambda V: V @ A, n, 4, torch.Generator(), include=X0)
    except ValueError as exc:
        assert "more than the rank" in str(exc)
    else:  # pragma: no cover
        raise AssertionError("include with more vectors than the rank was accepted")
