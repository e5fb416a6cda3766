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


def test_galerkin_start_from_the_sketch():
    # The sketch's test matrix Q and products A Q give, with no product, the best
    # start within range(Q) in the M-norm (M = I + c A): its error is no larger than
    # the start's, and when the right-hand sides are in the test matrix (``span``) and
    # the sketch holds A's whole range, the corrected start is the exact solution.
    A, B = _problem()
    n = A.shape[0]
    c = 0.7
    M = torch.eye(n, dtype=torch.float64) + c * A
    exact = torch.linalg.solve(M, B.T).T
    X0 = torch.randn(5, n, dtype=torch.float64, generator=torch.Generator().manual_seed(3))

    def energy(X):
        E = X - exact
        return ((E @ M) * E).sum(1)

    rangeA = torch.linalg.eigh(A).eigenvectors[:, -40:].T  # A has rank 40
    for rank, span, exact_start in ((20, None, False), (30, B, False),
                                    (50, torch.cat([B, rangeA]), True)):
        pre, AX = nystrom_preconditioner(lambda V: V @ A, n, rank,
                                         torch.Generator().manual_seed(2), include=X0,
                                         span=span)
        pre = pre.rescaled(c)
        X, R = pre.galerkin(X0.clone(), B - X0 - c * AX)
        assert torch.linalg.norm(R - (B - X @ M)) <= 1e-10 * torch.linalg.norm(B)
        assert torch.all(energy(X) <= energy(X0) * (1 + 1e-12))
        if exact_start:
            assert torch.linalg.norm(X - exact) <= 1e-8 * torch.linalg.norm(exact)
        # conjugate gradients from the corrected start: the same solution, the
        # recurrence's residual the true one, in no more iterations than from X0
        Xa, ita, rela, Ra = block_cg(lambda V: V @ M, B, X0.clone(), 1e-10, 1000, pre.apply)
        Xb, itb, relb, Rb = block_cg(lambda V: V @ M, B, X0.clone(), 1e-10, 1000, pre.apply,
                                     start_product=X0 @ M, start_correction=pre.galerkin)
        assert relb <= 1e-10 and itb <= ita
        assert torch.linalg.norm(Xb - exact) <= 1e-8 * torch.linalg.norm(exact)
        assert torch.linalg.norm(Rb - (B - Xb @ M)) <= 1e-9 * torch.linalg.norm(B)


def test_sketch_eigendecomposition_routes_agree(monkeypatch):
    # The eigenvectors from the r x r Gram (well-conditioned sketch) and from the SVD
    # of the tall factor (forced) give the same Nystrom approximation and eigenvalues;
    # a sketch of a rank-deficient operator (singular values at the shift) takes the SVD.
    from sklearn_lla._core import krylov

    g = torch.Generator().manual_seed(5)
    n, k = 400, 30
    Qa = torch.linalg.qr(torch.randn(n, k, dtype=torch.float64, generator=g)).Q
    A = (Qa * torch.logspace(1, -1, k, dtype=torch.float64)) @ Qa.T
    A = A + 1e-2 * torch.eye(n, dtype=torch.float64)  # full rank, spread 1e-3
    runs, calls = {}, []
    orig = torch.linalg.svd
    monkeypatch.setattr(torch.linalg, "svd", lambda *a, **kw: calls.append(1) or orig(*a, **kw))
    for spread in (krylov._GRAM_SPREAD, 1.0):  # 1.0: never the Gram
        monkeypatch.setattr(krylov, "_GRAM_SPREAD", spread)
        pre = nystrom_preconditioner(lambda V: V @ A, n, 40, torch.Generator().manual_seed(1))
        runs[spread] = pre
        assert len(calls) == (spread == 1.0)
        eye = torch.eye(pre.rank, dtype=torch.float64)
        assert torch.linalg.norm(pre.U.T @ pre.U - eye) < 1e-10
    a, b = runs.values()
    torch.testing.assert_close(a.lam, b.lam, rtol=1e-10, atol=1e-12)
    rec = [(p.U * p.lam) @ p.U.T for p in (a, b)]
    assert torch.linalg.norm(rec[0] - rec[1]) <= 1e-10 * torch.linalg.norm(rec[1])
    monkeypatch.undo()
    low, _ = _problem()  # rank 40 < the sketch's 60: the SVD route, exact on A
    calls.clear()
    monkeypatch.setattr(torch.linalg, "svd", lambda *a, **kw: calls.append(1) or orig(*a, **kw))
    pre = nystrom_preconditioner(lambda V: V @ low, n - 100, 60,
                                 torch.Generator().manual_seed(1))
    assert calls and torch.linalg.norm((pre.U * pre.lam) @ pre.U.T - low) < 1e-8 * float(
        torch.linalg.norm(low))


def test_test_matrix_orthonormalisation(monkeypatch):
    # Cholesky QR for a well-conditioned test matrix, Householder QR for an
    # ill-conditioned one (nearly dependent columns: a start equal to its right-hand
    # side up to 1e-9); both omega = Q R with orthonormal Q, R upper triangular.
    from sklearn_lla._core import krylov

    g = torch.Generator().manual_seed(7)
    good = torch.randn(500, 30, dtype=torch.float64, generator=g)
    bad = good.clone()
    bad[:, 1] = bad[:, 0] + 1e-9 * bad[:, 2]
    calls = []
    orig = torch.linalg.qr
    monkeypatch.setattr(torch.linalg, "qr", lambda *a, **kw: calls.append(1) or orig(*a, **kw))
    for omega, householder in ((good, False), (bad, True)):
        calls.clear()
        Q, R = krylov._orthonormalize(omega)
        assert bool(calls) == householder
        eye = torch.eye(30, dtype=torch.float64)
        assert torch.linalg.norm(Q.T @ Q - eye) < 1e-12
        assert torch.linalg.norm(Q @ R - omega) < 1e-12 * torch.linalg.norm(omega)
        assert torch.equal(R, torch.triu(R))


def test_start_residual_is_the_start_products_run_in_place():
    # block_cg's start_residual (B - op(X0) made by the caller) runs the same
    # iterations as start_product, bit for bit, and is itself the residual block the
    # solve updates (a caller holding it holds no extra block).
    A, B = _problem()
    n = A.shape[0]
    M = torch.eye(n, dtype=torch.float64) + A
    X0 = torch.randn(5, n, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    pre = nystrom_preconditioner(lambda V: V @ A, n, 20, torch.Generator().manual_seed(2))
    Xa, ita, rela, Ra = block_cg(lambda V: V @ M, B, X0.clone(), 1e-10, 1000, pre.apply,
                                 start_product=X0 @ M)
    R0 = B - X0 @ M
    Xb, itb, relb, Rb = block_cg(lambda V: V @ M, B, X0.clone(), 1e-10, 1000, pre.apply,
                                 start_residual=R0)
    assert ita == itb and rela == relb
    assert torch.equal(Xa, Xb) and torch.equal(Ra, Rb) and Rb is R0


def test_sketch_product_gets_a_view_of_the_test_matrix():
    # The sketch passes its test matrix to matvec as Q.T (no contiguous copy); a
    # matvec that reads it as a strided view gives the same preconditioner bit for bit.
    A, _ = _problem()
    n = A.shape[0]
    seen = []

    def matvec(V):
        seen.append(V.is_contiguous())
        return V @ A

    def matvec_copy(V):
        return V.contiguous() @ A

    p1 = nystrom_preconditioner(matvec, n, 20, torch.Generator().manual_seed(2))
    p2 = nystrom_preconditioner(matvec_copy, n, 20, torch.Generator().manual_seed(2))
    assert seen == [False]
    assert torch.equal(p1.U, p2.U) and torch.equal(p1.lam, p2.lam)
