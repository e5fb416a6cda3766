"""ELLA: Nystrom-accelerated linearized Laplace (Deng, Zhou & Zhu, NeurIPS 2022).

The NTK is approximated by ``k(x, x') ~ phi(x) phi(x')^T`` with ``K`` Nystrom
features ``phi(x) = J(x) V`` (C x K), and LLA becomes the feature-space GLM
posterior of :mod:`sklearn_lla._posteriors.glm`:

1. draw ``M`` pairs ``(x_m, i_m)`` (training point, output index) uniformly without
   replacement from the ``N * C`` pairs (all of them when ``M >= N * C``);
2. ``Kt = Jt Jt^T`` (M x M) in float64, ``Jt`` the rows ``grad g_{i_m}(x_m)``; its
   top-``K`` eigenpairs ``(lam_k, u_k)`` by block Lanczos when ``20 K <= M`` (to
   round-off, :func:`_krylov_top_eigh`), else LAPACK (``syevr`` for the top ``K``, or
   ``eigh`` with escalating jitter) (``n_components="auto"``: every numerically
   positive eigenvalue, capped by the memory of ``V``);
3. ``v_k = Jt^T u_k / sqrt(lam_k)`` by vector-Jacobian products (memory O(P K));
4. ``phi(x) = J(x) V`` and ``g(x)`` from one forward pass with ``K`` tangents;
5. ``G = sum_n phi_n^T Lam_n phi_n`` streamed over the training data;
   ``S(x) = phi(x) (G + I / s0^2)^-1 phi(x)^T``.

For networks that are chains of ``nn.Linear`` layers and elementwise maps, steps 2
and 3 use the structured NTK: no Jacobian row is formed.
"""


from __future__ import annotations

import warnings

import numpy as np
import torch

from .._core.linalg import safe_eigh
from .._network.backends.base import device_budget
from .glm import Features

__all__ = ["AUTO_COST_BUDGET", "AUTO_MIN_COMPONENTS", "NystromFeatures", "nystrom_basis"]

#: Per-row cost budget of ``n_components="auto"``, in multiply-adds: the features of a
#: row cost ``K * P`` (one GEMM per layer, see ``StructuredChain.jvp``) at fit and at
#: predict, so "auto" keeps at most ``max(AUTO_MIN_COMPONENTS, AUTO_COST_BUDGET // P)``
#: components: about the paper's K = 20 for its 3 x 200 MLPs, hundreds (in practice
#: all the numerically positive ones) for nets with a few thousand parameters.
#:
#: Why not a captured fraction of the trace: directions with tiny eigenvalues on the
#: Nystrom points are those the data barely constrain, where the posterior keeps its
#: prior variance, and they carry most of the variance away from the data. The values
#: of K and the measurements behind both choices are in ``docs/ella.md``.
AUTO_COST_BUDGET = 2**21

#: The smallest ``K`` that ``n_components="auto"`` keeps when the spectrum allows it
#: (the ELLA paper's default).
AUTO_MIN_COMPONENTS = 20


#: Elements (network dtype) of the ``M`` Nystrom rows held at once to reuse them for
#: ``V`` (factored rows hold far fewer than ``M x P``).
ROWS_HELD = 2**27

_F64 = torch.float64


#: Block size of :func:`_krylov_top_eigh`. 16 rather than 24: the Krylov space needed is
#: smaller (the digits CNN's ``M = 2000`` Gram, ``k = 54``: 336 vectors instead of 408;
#: a Year-shaped 3 x 200 tanh MLP's, ``k = 21``: 224 instead of 288) and the solve
#: 11-12 % faster on one thread (0.208 s against 0.237 s; 0.130 s against 0.146 s), the
#: same eigenpairs to round-off (within 7e-16 ``lam_1``, the span within 2e-15).
KRYLOV_BLOCK = 16

#: Relative residual ``||Kt x - lam x|| / lam_1`` at which :func:`_krylov_top_eigh`
#: stops (a few hundred units of round-off: its Ritz pairs are then those of a full
#: ``eigh`` to round-off, ``test_ella.py``).
KRYLOV_TOL = 1e-13


def _krylov_top_eigh(A, k, block=KRYLOV_BLOCK, tol=KRYLOV_TOL):
    """The top ``k`` eigenpairs of the symmetric float64 ``A`` by block Lanczos with
    full reorthogonalisation, or ``None`` when it does not converge within half of
    ``A``'s size (or the Krylov space becomes invariant before it does).

    Each step is one product of ``A`` with ``block`` vectors (BLAS 3, where LAPACK's
    tridiagonal reduction of all of ``A`` streams it once per column); from ``4 k``
    Krylov vectors on, the Ritz pairs of the block-tridiagonal projection ``H`` are
    checked by their exact residuals ``||A x - theta x|| = ||R s_last||`` (``R`` the
    new block's QR factor, ``s_last`` the Ritz vector's last block), and returned
    when every one of the top ``k`` is below ``tol * theta_1``. The start block is a
    fixed Gaussian draw (the estimator's random stream is not touched), so the result
    is deterministic. Measured on the digits CNN's ``M = 2000`` Gram (``k = 54``,
    blocks of 16): 336 Krylov vectors (checks at 224, 288 and 336), eigenvalues within
    7e-16 ``lam_1`` and the span within 2e-15 of ``syevr``'s, 0.21 s against 0.6-0.7 s
    (one thread; blocks of 24: 408 vectors, 0.24 s); on a flat spectrum it gives up
    after 0.06-0.17 s.
    """
    M = A.shape[0]
    max_dim = M // 2
    b = max(1, min(block, max_dim // 4))
    g = torch.Generator(device=A.device).manual_seed(0)
    Qt = torch.zeros((max_dim + b, M), dtype=_F64, device=A.device)  # basis as rows
    H = torch.zeros((max_dim + b, max_dim + b), dtype=_F64, device=A.device)
    Qt[:b] = torch.linalg.qr(torch.randn(M, b, generator=g, dtype=_F64,
                                         device=A.device))[0].T
    j, scale, last = 0, None, None  # last: (n, largest residual) at the last check
    due = min(4 * k, max_dim - b)  # the size at which the next check is due
    while j + b <= max_dim:
        n = j + b
        Wt = Qt[j:n] @ A  # (A symmetric)
        C = Wt @ Qt[:n].T  # classical Gram-Schmidt, twice
        Wt -= C @ Qt[:n]
        C2 = Wt @ Qt[:n].T
        Wt -= C2 @ Qt[:n]
        H[j:n, :n] = C + C2
        Qn, R = torch.linalg.qr(Wt.T)
        # checks from 4 k vectors on (their eigh costs O(n^3)), each after the space
        # grew by a quarter, or sooner: at the size where the residual's decay
        # between the last two checks reaches the tolerance (the decay accelerates,
        # so that size is an upper bound); given up when that decay would not reach
        # the tolerance within twice max_dim (a flat spectrum: LAPACK is cheaper)
        if n >= due or n + b > max_dim:
            Hs = H[:n, :n]
            th, S = torch.linalg.eigh(0.5 * (Hs + Hs.T))
            th, S = th.flip(0)[:k], S.flip(1)[:, :k]
            worst = float((R @ S[j:n]).norm(dim=0).max())
            goal = tol * float(th[0])
            if float(th[0]) > 0 and worst <= goal:
                return th, (S.T @ Qt[:n]).T
            due = 1.25 * n
            if last is not None and goal > 0:
                rate = (worst / last[1]) ** (1.0 / (n - last[0])) if last[1] > 0 else 1.0
                # (the decay accelerates: only a projection far beyond max_dim aborts)
                if not rate < 1.0:
                    return None
                reach = n + np.log(goal / worst) / np.log(rate)
                if reach > 2 * max_dim:
                    return None
                due = min(max(reach, n + 1), 1.25 * n)
            last = (n, worst)
        scale = float(torch.diagonal(H[:n, :n]).abs().max()) if scale is None else scale
        if not float(torch.diagonal(R).abs().min()) > 1e-10 * scale:
            return None  # (nearly) invariant: the next block would be round-off
        H[n:n + b, j:n] = R
        H[j:n, n:n + b] = R.T
        Qt[n:n + b] = Qn.T
        j = n
    return None


def _top_eigh(Kt, k):
    """The top ``k`` eigenpairs of the symmetric ``Kt``, in descending order.

    When ``20 k <= M``, block Lanczos (:func:`_krylov_top_eigh`: 220-340 Krylov
    vectors for ``k = 21-54`` of ``M = 2000`` on the digits CNN and a Year-shaped MLP,
    0.13-0.21 s against 0.6-0.8 s for ``syevr``, one thread); else, or if it does not
    converge, on the CPU LAPACK's ``syevr`` for those ``k`` only (faster than a full
    ``eigh``; ``docs/cnn.md``); otherwise, or if it fails, the full :func:`safe_eigh`.
    """
    M = Kt.shape[0]
    if 20 * k <= M and M >= 256:
        A = Kt.double()
        A = (A + A.T).mul_(0.5)
        # (a finite sum: every entry finite, unless the sum overflows; then LAPACK)
        if bool(torch.isfinite(A.sum())):
            out = _krylov_top_eigh(A, k)
            if out is not None:
                return out
    if Kt.device.type == "cpu" and 4 * k <= M:
        import scipy.linalg

        A = (0.5 * (Kt + Kt.T)).double().numpy()
        if np.isfinite(A).all():
            try:
                lam, U = scipy.linalg.eigh(A, subset_by_index=[M - k, M - 1], driver="evr",
                                           check_finite=False)
                if np.isfinite(lam).all():
                    lam = torch.from_numpy(lam[::-1].copy())
                    return lam, torch.from_numpy(np.ascontiguousarray(U[:, ::-1]))
            except (np.linalg.LinAlgError, ValueError):
                pass
    lam, U = safe_eigh(Kt, "Nystrom Gram matrix")
    return lam.flip(0), U.flip(1)


def _top_eigenpairs(Kt, n_components, n_params):
    """Top eigenpairs of the PSD Gram ``Kt`` (float64); ``K`` fixed or ``"auto"``."""
    M = Kt.shape[0]
    if n_components == "auto":
        cap = max(AUTO_MIN_COMPONENTS, AUTO_COST_BUDGET // max(1, n_params))
    else:
        cap = int(n_components)
    lam, U = _top_eigh(Kt, min(M, cap))
    tol = max(float(lam[0]), 0.0) * M * torch.finfo(torch.float64).eps * 10
    positive = int((lam > tol).sum())
    if positive == 0:
        raise ValueError("the Nystrom Gram matrix is zero: the network's Jacobian vanishes")
    if n_components == "auto":
        k = min(positive, max(AUTO_MIN_COMPONENTS, AUTO_COST_BUDGET // max(1, n_params)))
    else:
        k = int(n_components)
        if positive < k:
            warnings.warn(
                f"the Nystrom Gram matrix has only {positive} numerically positive eigenvalues; "
                f"using {positive} components instead of {k}", RuntimeWarning, stacklevel=4)
            k = positive
    return lam[:k], U[:, :k]


def rows_of_pairs(held, idx, out, lin):
    """The Nystrom pairs' rows, taken from the training rows of every output held
    chunk by chunk (graph backend: no row is computed a second time).

    Parameters
    ----------
    held : list of (GraphRows, Tensor)
        The training rows of every point and output, chunk by chunk in the order of
        the training rows (:class:`~sklearn_lla._posteriors.subspace_kfac.RowCache`).
    idx, out : ndarray of shape (M,)
        The pairs' points (indices of the training rows) and outputs.
    lin : LinearizedNet
        The network.

    Returns
    -------
    GraphRows
        One row per pair (``rows_per_point = 1``), in the pairs' order.
    """
    from .._network.backends.graph import GraphRows
    from .._network.structured.jacobian import LayerFactor, StructuredJacobian

    first = held[0][0]
    C, dev, M = first.rows_per_point, first.output.device, len(idx)
    idx_t = torch.as_tensor(np.asarray(idx), dtype=torch.int64, device=dev)
    out_t = torch.as_tensor(np.asarray(out), dtype=torch.int64, device=dev)
    D = None if first.D is None else first.D.new_empty((M, first.D.shape[1]))
    sj = first.factors
    layers = [] if sj is None else sj.layers
    deltas = [f.delta.new_empty((M, f.delta.shape[1])) for f in layers]
    acts = [f.act.new_empty((M, f.act.shape[1])) for f in layers]
    output = first.output.new_empty((M, first.output.shape[1]))
    start, found = 0, 0
    for rows, _ in held:
        n = rows.n_points
        m = ((idx_t >= start) & (idx_t < start + n)).nonzero().flatten()
        if len(m):
            p = idx_t[m] - start
            r = p * C + out_t[m]
            if D is not None:
                D[m] = rows.D[r]
            for j, f in enumerate(rows.factors.layers if layers else []):
                deltas[j][m] = f.delta[r]
                acts[j][m] = f.act[p]
            output[m] = rows.output[p]
            found += len(m)
        start += n
    if found != M:
        raise RuntimeError("internal error: the held rows do not cover the Nystrom pairs")
    factors = None
    if layers:
        factors = StructuredJacobian(
            [LayerFactor(d, a, f.weight_name, f.bias_name)
             for d, a, f in zip(deltas, acts, layers)], 1, sj.param_names, output)
    return GraphRows(factors, D, first.dense_names, 1, lin, output)


def nystrom_basis(lin, data, n_nystrom, n_components, generator, chunk=4096, pairs=None,
                  held=None):
    """Draw the Nystrom pairs and build the parameter-space basis ``V``.

    Parameters
    ----------
    lin : LinearizedNet
        The network.
    data : FitData
        The training stream (only the ``M`` drawn rows are read).
    n_nystrom : int
        ``M``.
    n_components : int or "auto"
        ``K``.
    generator : torch.Generator
        Random source of the pairs.
    chunk : int, default=4096
        Rows per vector-Jacobian product.
    pairs : tuple of arrays, optional
        ``(point_idx, output_idx)`` to use instead of drawing them.
    held : list of (GraphRows, Tensor), optional
        The training rows of every output, already computed (:func:`rows_of_pairs`):
        the pairs' rows are taken from them.

    Returns
    -------
    V : dict of str to Tensor of shape (K, *param_shape)
        ``v_k = Jt^T u_k / sqrt(lam_k)``, orthonormal in parameter space.
    lam : Tensor of shape (K,)
        The top eigenvalues of ``Kt``.
    pairs : tuple of ndarray
        Point and output indices of the ``M`` pairs.
    """
    N, C = data.n_samples, data.n_outputs
    if pairs is not None:
        idx, out = (np.asarray(p, dtype=np.int64) for p in pairs)
    else:
        n_pairs = N * C
        if n_nystrom >= n_pairs:
            flat = np.arange(n_pairs)
        else:
            flat = torch.randperm(n_pairs, generator=generator)[:n_nystrom].numpy()
        idx, out = flat // C, flat % C
    if held is not None:
        rows = rows_of_pairs(held, idx, out, lin)
        lam, U = _top_eigenpairs(rows.gram(), n_components, lin.n_params)
        return rows.vjp((U / lam.sqrt()).to(lin.dtype)), lam, (idx, out)
    Xm, _ = data.rows(idx)
    out_t = torch.as_tensor(out, device=Xm.device)
    rows = None
    if len(idx) * lin.row_elements() <= device_budget(ROWS_HELD, lin.device):
        # the M rows fit: computed once, for the Gram and for V = Jt^T U
        with torch.no_grad():
            rows = lin.rows(Xm, out_t)
        Kt = rows.gram()
    else:
        Kt = lin.kernel(Xm, n_outputs=C, out1=out_t)
    lam, U = _top_eigenpairs(Kt, n_components, lin.n_params)
    Us = (U / lam.sqrt()).to(lin.dtype)
    if rows is not None:
        return rows.vjp(Us), lam, (idx, out)
    V = None
    for s in range(0, len(idx), chunk):
        part = lin.gradient_rows_vjp(Xm[s:s + chunk], out_t[s:s + chunk], Us[s:s + chunk])
        V = part if V is None else {k: V[k] + part[k] for k in V}
    return V, lam, (idx, out)


class NystromFeatures(Features):
    """ELLA's features ``phi(x) = J(x) V`` with ``V`` the Nystrom basis.

    Parameters
    ----------
    n_nystrom : int
        ``M``.
    n_components : int or "auto"
        ``K``.
    pairs : tuple of arrays, optional
        Fixed Nystrom pairs (see :func:`nystrom_basis`).
    """

    def __init__(self, n_nystrom=2000, n_components="auto", pairs=None):
        self.n_nystrom = n_nystrom
        self.n_components = n_components
        self.pairs = pairs

    #: :meth:`fit` can take the Nystrom rows from the training rows of a pass already
    #: made (:meth:`~sklearn_lla._posteriors.glm.GLMPosterior.fit`).
    takes_held_rows = True

    def fit(self, lin, data, held=None):
        """Draw the pairs and build the orthonormal basis ``V``; ``held``: the training
        rows of every output, chunk by chunk, to take the pairs' rows from
        (:func:`rows_of_pairs`)."""
        self.lin = lin
        self.V, self.eigvals, self.pairs_ = nystrom_basis(
            lin, data, self.n_nystrom, self.n_components, data.generator, pairs=self.pairs,
            held=held)
        self.dim = len(self.eigvals)
        theta = lin.flat_params().double()
        self.theta_sq_norm = float(theta @ theta)
        # ELLA approximates the full network's LLA, and its hyperparameters are that
        # model's: the evidence of the P-dimensional Laplace approximation whose
        # curvature lives in span(V) (where the training NTK's spectrum is), in which
        # the prior normalisers of the P - K other directions cancel against their
        # posterior volume. Keeping them (n_outside = P - K) pinned s0^2 to about
        # ||theta||^2 / P whatever the data said: the std then barely grew away from
        # the data (1-D gap toy: gap / data std 1.9 instead of exact LLA's 13).
        self.n_outside = 0
        return self

    @property
    def tangents(self):
        """The Nystrom basis ``V`` (:meth:`Features.of_rows`)."""
        return self.V

    def __call__(self, x):
        g, phi = self.lin.jvp(x, self.V)
        return g.double(), phi.double()

    def with_ntk_diag(self, x):
        """``(g, phi, J(x) J(x)^T)`` from one evaluation of the Jacobian at ``x``."""
        g, phi, k = self.lin.jvp_and_ntk_diag(x, self.V)
        return g.double(), phi.double(), k
