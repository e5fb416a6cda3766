"""The Jacobian-backend interface, and its generic ``torch.func`` implementation.

A backend computes the products every posterior needs from
:class:`~sklearn_lla._network.linearized.LinearizedNet` (which chooses one, once, at
construction):

* ``jvp``: ``g(x)`` and ``J(x) t_k`` for many tangents in one batched pass;
* ``vjp``: ``J(x)^T u_k`` for many cotangents;
* ``jacobian``: per-example Jacobians ``(B, C, P)``;
* ``rows``: Jacobian rows (all outputs, or one output per point) as a :class:`Rows`
  object -- dense rows here, per-layer factors in a faster backend -- with their
  Gram, cross-Gram (differentiable), diagonal blocks, ``R^T U`` and ``R V``;
* ``ntk`` / ``kernel`` / ``ntk_diag_blocks`` / ``cross_and_diag``: blocks of the
  neural tangent kernel, in float64.

:class:`JacobianBackend` implements all of them generically with ``torch.func``
(reverse mode only: forward-mode dual levels are process-global, not per thread);
a backend for a kind of network subclasses it and overrides what it does faster
(the shape of laplace-torch's ``CurvatureInterface``). ``thread_safe`` says whether
the products may run from several threads at once; ``factored`` whether
:meth:`JacobianBackend.rows` returns compact factors (cheap to keep for many points,
so that a GP predictor can store the inducing points' rows instead of a ``P x M``
parameter-space basis).
"""

from __future__ import annotations

import abc

import numpy as np
import torch
from torch import Tensor
from torch.func import jacrev, vjp, vmap

__all__ = ["DenseRows", "FactoredBackend", "JacobianBackend", "Rows", "device_budget",
           "flat_directions", "gram64"]

_F64 = torch.float64

#: Elements (network dtype) of the Jacobian rows :meth:`JacobianBackend.kernel` keeps
#: at once: rows are computed once per panel of this size, not once per Gram block.
PANEL_ELEMENTS = 2**26

#: How many times a CPU element budget a CUDA device's products may hold (kernel
#: launches, not memory, bound a GPU's small chunks), capped by :data:`CUDA_SHARE`.
CUDA_SCALE = 16

#: The largest share of a CUDA device's memory one budgeted tensor may take.
CUDA_SHARE = 1 / 16

#: Elements of a float64 column block :func:`gram64` converts at once: the product of
#: wide rows is accumulated over column blocks, never through a float64 copy of all.
GRAM_BLOCK_ELEMENTS = 2**24

#: Row width from which :func:`_factored_self_gram` pairs a factor by ``syrk``.
SYRK_WIDTH = 256


def flat_directions(V: dict, names, numels, dtype, device) -> Tensor:
    """Directions ``{name: (K, *shape)}`` as ``(K, sum(numels))`` columns in ``names``
    order, in ``dtype`` (names missing from ``V`` count as 0).

    Parameters
    ----------
    V : dict of str to Tensor of shape (K, *param_shape)
    names : list of str
    numels : list of int
        The sizes of ``names``' parameters.
    dtype : torch.dtype
    device : torch.device

    Returns
    -------
    Tensor of shape (K, sum(numels))
    """
    K = next(iter(V.values())).shape[0]
    return torch.cat([
        (V[n].to(dtype).reshape(K, -1) if n in V else
         torch.zeros(K, k, dtype=dtype, device=device))
        for n, k in zip(names, numels)], dim=1)


def device_budget(elements: int, device) -> int:
    """An element budget set for the CPU, scaled for ``device``.

    On a CUDA device, :data:`CUDA_SCALE` times ``elements`` (larger chunks: a GPU's
    time on small ones goes to kernel launches), at most :data:`CUDA_SHARE` of its
    memory in float32 elements; on any other device, ``elements``.

    Parameters
    ----------
    elements : int
        The CPU budget, in tensor elements.
    device : torch.device or str
        Where the tensors live.

    Returns
    -------
    int
    """
    device = torch.device(device)
    if device.type != "cuda":
        return int(elements)
    total = torch.cuda.get_device_properties(device).total_memory
    return int(min(elements * CUDA_SCALE, max(elements, total * CUDA_SHARE // 4)))


def gram64(a: Tensor, b: Tensor | None = None) -> Tensor:
    """``a b^T`` in float64 (``b=None``: ``a a^T``, by BLAS ``syrk`` on the CPU: half
    the multiplications of a general product).

    Rows wider than :data:`GRAM_BLOCK_ELEMENTS` allows are paired block of columns by
    block of columns, so no float64 copy of the whole of ``a`` is made.

    Parameters
    ----------
    a : Tensor of shape (n, p)
    b : Tensor of shape (m, p), optional

    Returns
    -------
    Tensor of shape (n, m), dtype float64
    """
    n, p = a.shape
    rows = max(n, 1 if b is None else b.shape[0])
    width = max(1, GRAM_BLOCK_ELEMENTS // max(1, rows))
    if b is None and not a.requires_grad and a.device.type == "cpu" and n >= 64:
        return _syrk64(a, width)
    if a.requires_grad or (b is not None and b.requires_grad) or width >= p:
        return _gram64_block(a, b)
    out = None
    for s in range(0, p, width):
        out = _gram64_block(a[:, s:s + width], None if b is None else b[:, s:s + width],
                            out)
    return out


def _gram64_block(a: Tensor, b: Tensor | None, acc: Tensor | None = None) -> Tensor:
    """``a b^T`` in float64 (one general product), added to ``acc`` in place when
    given."""
    a64 = a.to(_F64)
    prod = a64 @ (a64 if b is None else b.to(_F64)).T
    return prod if acc is None else acc.add_(prod)


def _syrk64(a: Tensor, width: int) -> Tensor:
    """``a a^T`` in float64 on the CPU by BLAS ``dsyrk``, ``width`` columns of ``a``
    converted at a time and accumulated into one triangle (``beta = 1``), which is
    mirrored once at the end."""
    from scipy.linalg.blas import dsyrk

    n, p = a.shape
    a = a.detach()
    # Fortran-ordered upper triangle; the strict lower triangle stays zero
    c = np.zeros((n, n), dtype=np.float64, order="F")
    for s in range(0, p, width):
        arr = a[:, s:s + width].to(_F64).contiguous().numpy()
        # arr.T is Fortran-ordered: arr arr^T added to c
        c = dsyrk(1.0, arr.T, beta=1.0, c=c, trans=1, overwrite_c=1)
    low = torch.from_numpy(c).T  # C-ordered lower triangle (the transpose's memory)
    out = low + low.T
    out.diagonal().mul_(0.5)  # (the diagonal counted twice: exact in float64)
    return out


def _sym64(a: Tensor) -> Tensor:
    """``a a^T`` in float64: by :func:`gram64` (``syrk``) for rows of at least
    :data:`SYRK_WIDTH` entries, else one general product (for narrow rows the product
    costs less than ``syrk``'s mirroring of the triangle)."""
    if a.shape[1] >= SYRK_WIDTH:
        return gram64(a)
    a64 = a.to(_F64)
    return a64 @ a64.T


def _factored_self_gram(sj) -> Tensor:
    """``J J^T`` of factored rows (the graph backend's self-Gram), float64: each
    layer's two Grams by :func:`_sym64` (BLAS ``syrk`` for wide factors on the CPU:
    half the multiplications of the general products of ``StructuredJacobian.gram``,
    the same sums).

    Parameters
    ----------
    sj : StructuredJacobian
        Factored rows (:mod:`sklearn_lla._network.structured.jacobian`).

    Returns
    -------
    Tensor of shape (n_rows, n_rows), dtype float64
    """
    B, k = sj.n_points, sj.rows_per_point
    G = None
    for layer in sj.layers:
        DD = _sym64(layer.delta)
        if layer.has_weight:
            A = _sym64(layer.act)
            if layer.has_bias:
                A += 1.0
            if k == 1:
                DD.mul_(A)
            else:
                DD = DD.view(B, k, B, k).mul_(A[:, None, :, None]).view(B * k, B * k)
        G = DD if G is None else G.add_(DD)
    return G


class Rows(abc.ABC):
    """Jacobian rows of a set of points (row ``r`` belongs to point ``r // rows_per_point``).

    The interface the posteriors use to pair rows: :meth:`gram` (float64, no graph),
    :meth:`cross_gram` (float64, differentiable), :meth:`diag_blocks`, :meth:`vjp`
    (``R^T U``), :meth:`matmul` (``R V``) and :meth:`dense`. Subclasses:
    :class:`DenseRows` and
    :class:`~sklearn_lla._network.structured.jacobian.StructuredJacobian`.
    """

    rows_per_point: int
    n_rows: int

    @abc.abstractmethod
    def gram(self, other=None) -> Tensor:  # pragma: no cover - interface
        """``R_self R_other^T``, float64 (``other=None``: ``self``)."""

    @abc.abstractmethod
    def cross_gram(self, other=None) -> Tensor:  # pragma: no cover - interface
        """:meth:`gram` written so that autograd differentiates through it."""

    @abc.abstractmethod
    def diag_blocks(self) -> Tensor:  # pragma: no cover - interface
        """The per-point blocks of :meth:`gram`, ``(n_points, k, k)``, float64."""

    @abc.abstractmethod
    def vjp(self, U: Tensor) -> dict:  # pragma: no cover - interface
        """``R^T U`` per parameter, ``{name: (K, *shape)}``."""

    @abc.abstractmethod
    def matmul(self, V: dict) -> Tensor:  # pragma: no cover - interface
        """``R V`` of shape ``(n_rows, K)`` for directions ``{name: (K, *shape)}``."""

    @abc.abstractmethod
    def dense(self) -> Tensor:  # pragma: no cover - interface
        """The explicit rows ``(n_rows, P)``."""

    def weighted_sq_norms(self, w: dict) -> Tensor:
        """``sum_p R_rp^2 w_kp`` per row and weight vector, ``(n_rows, K)`` float64.

        Parameters
        ----------
        w : dict of str to Tensor of shape (K, *param_shape)
            ``K`` weight vectors over the parameters; missing names count as 0.

        Returns
        -------
        Tensor of shape (n_rows, K), dtype float64
        """
        R = self.dense().to(_F64)
        lin = self._lin
        return (R * R) @ flat_directions(w, lin.names, lin.numels, _F64, R.device).T

    def mixed_sq_colsum(self, M: Tensor) -> dict:
        """``sum_b sum_j (sum_c M_bjc R_(b,c))^2`` per parameter entry, float64 (the
        diagonal of ``sum_b R_b^T M_b^T M_b R_b``: a diagonal GGN for curvature
        factors ``M_b``).

        Parameters
        ----------
        M : Tensor of shape (n_points, J, rows_per_point)

        Returns
        -------
        dict of str to Tensor of shape param_shape
        """
        R = self.dense().to(_F64)
        G = M.to(_F64) @ R.view(-1, self.rows_per_point, R.shape[1])
        return {n: v[0] for n, v in self._lin.unflatten((G * G).sum((0, 1))[None]).items()}


class DenseRows(Rows):
    """Explicit Jacobian rows ``R`` of shape ``(n_rows, P)``, in the network's dtype.

    Parameters
    ----------
    R : Tensor of shape (n_rows, P)
        The rows (columns in the network's parameter order); may carry an autograd
        graph (e.g. to the inputs).
    rows_per_point : int
        Consecutive rows per point.
    lin : LinearizedNet
        The network (for the parameter layout).
    """

    def __init__(self, R: Tensor, rows_per_point: int, lin) -> None:
        self.R = R
        self.rows_per_point = int(rows_per_point)
        self.n_rows = int(R.shape[0])
        self.n_points = self.n_rows // self.rows_per_point
        self._lin = lin

    def __len__(self) -> int:
        return self.n_rows

    def gram(self, other: DenseRows | None = None) -> Tensor:
        """``R_self R_other^T`` in float64.

        Parameters
        ----------
        other : DenseRows, optional
            Defaults to ``self``.

        Returns
        -------
        Tensor of shape (n_rows_self, n_rows_other), dtype float64
        """
        if other is None or other is self:
            return gram64(self.R)
        return gram64(self.R, other.R)

    def cross_gram(self, other: DenseRows | None = None) -> Tensor:
        """:meth:`gram`, differentiable.

        Parameters
        ----------
        other : DenseRows, optional
            Defaults to ``self``.

        Returns
        -------
        Tensor of shape (n_rows_self, n_rows_other), dtype float64
        """
        a = self.R.to(_F64)
        b = a if other is None or other is self else other.R.to(_F64)
        return a @ b.T

    def diag_blocks(self) -> Tensor:
        """Per-point blocks of :meth:`gram`.

        Returns
        -------
        Tensor of shape (n_points, rows_per_point, rows_per_point), dtype float64
        """
        J = self.R.to(_F64).view(self.n_points, self.rows_per_point, -1)
        return J @ J.transpose(1, 2)

    def vjp(self, U: Tensor) -> dict:
        """``R^T U`` per parameter.

        Parameters
        ----------
        U : Tensor of shape (n_rows, K)

        Returns
        -------
        dict of str to Tensor of shape (K, *param_shape)
        """
        return self._lin.unflatten(U.to(self.R.dtype).T @ self.R)

    def matmul(self, V: dict) -> Tensor:
        """``R V``.

        Parameters
        ----------
        V : dict of str to Tensor of shape (K, *param_shape)
            Missing names count as 0.

        Returns
        -------
        Tensor of shape (n_rows, K)
        """
        lin = self._lin
        flat = flat_directions(V, lin.names, lin.numels, self.R.dtype, self.R.device)
        if flat.shape[0] == 1:
            return (self.R @ flat[0]).unsqueeze(1)
        return self.R @ flat.T

    def dense(self) -> Tensor:
        """The rows.

        Returns
        -------
        Tensor of shape (n_rows, P)
        """
        return self.R


class JacobianBackend:
    """Jacobian products of a :class:`~sklearn_lla._network.linearized.LinearizedNet`
    by ``torch.func`` (reverse mode), for any network.

    Subclasses override the products they compute faster. Every method receives
    inputs already cast by the network (``lin._input``) and returns the shapes and
    dtypes documented on the matching :class:`LinearizedNet` method.

    Parameters
    ----------
    lin : LinearizedNet
        The network whose products are computed.
    reason : str
        Why this backend was chosen, in words.

    Attributes
    ----------
    name : str
        Reported as ``jacobian_backend_``.
    thread_safe : bool
        Whether the products may run from several threads at once.
    factored : bool
        Whether :meth:`rows` returns compact per-layer factors rather than dense rows.
    """

    name = "functorch"
    thread_safe = True
    factored = False

    def __init__(self, lin, reason: str) -> None:
        self.lin = lin
        self.reason = reason

    # -- products ---------------------------------------------------------------
    def jvp(self, x: Tensor, T: dict) -> tuple[Tensor, Tensor]:
        """``(g(x), J(x) T)``; ``T`` maps names to ``(K, *shape)`` (missing: 0)."""
        lin = self.lin
        K = next((t.shape[0] for t in T.values()), None)
        if K is None:
            raise ValueError("tangents is empty")
        T = dict(T)
        for n in lin.names:
            if n not in T:
                T[n] = torch.zeros((), dtype=lin.dtype, device=lin.device).expand(
                    K, *lin.params[n].shape)
        # J t = d/du <J^T u, t>: the VJP of the (linear) VJP map, batched over tangents.
        # Reverse mode only: forward-mode dual levels are process-global, not per thread.
        g, vjp_fn = vjp(lambda p: lin._g(p, x), lin.params)
        _, vjp_t = vjp(lambda u: vjp_fn(u)[0], torch.zeros_like(g))
        with torch.no_grad():
            (jv,) = vmap(vjp_t)(T)
        return g.detach(), jv.permute(1, 2, 0)

    def jvp_and_ntk_diag(self, x: Tensor, T: dict) -> tuple[Tensor, Tensor, Tensor]:
        """``(*jvp(x, T), ntk_diag_blocks(x))``; backends with rows share them."""
        g, jv = self.jvp(x, T)
        return g, jv, self.ntk_diag_blocks(x)

    def vjp(self, x: Tensor, cotangents: Tensor) -> dict:
        """``sum_b J(x_b)^T u_k[b]`` for cotangents ``(K, B, C)``."""
        lin = self.lin
        _, fn = vjp(lambda p: lin._g(p, x), lin.params)
        with torch.no_grad():
            (grads,) = vmap(fn)(cotangents)
        return grads

    def jacobian(self, x: Tensor) -> Tensor:
        """Per-example Jacobians ``(B, C, P)`` in the network's dtype."""
        lin = self.lin

        def single(p, xi):
            return lin._g(p, xi.unsqueeze(0)).squeeze(0)

        with torch.no_grad():
            jac = vmap(jacrev(single), in_dims=(None, 0))(lin.params, x)
        B = x.shape[0]
        C = next(iter(jac.values())).shape[1]
        return torch.cat([jac[n].reshape(B, C, -1) for n in lin.names], dim=2)

    def jacobian_rows(self, x: Tensor, out_idx: Tensor, differentiable: bool = False) -> Tensor:
        """One row per point, ``grad g_{out_idx[b]}(x_b)``, ``(B, P)``."""
        lin = self.lin
        onehot = torch.nn.functional.one_hot(out_idx, lin.n_outputs(x)).to(lin.dtype)

        def out(p, xi, oi):
            return (lin._g(p, xi.unsqueeze(0))[0] * oi).sum()

        with torch.set_grad_enabled(differentiable and torch.is_grad_enabled()):
            jac = vmap(jacrev(out), in_dims=(None, 0, 0))(lin.params, x, onehot)
        return torch.cat([jac[n].reshape(x.shape[0], -1) for n in lin.names], dim=1)

    def rows(self, x: Tensor, out_idx: Tensor | None = None,
             differentiable: bool = False) -> Rows:
        """Jacobian rows at ``x``: all outputs (rows ``b * C + c``) or ``out_idx``."""
        if out_idx is None:
            J = self.jacobian(x)
            return DenseRows(J.reshape(-1, self.lin.n_params), J.shape[1], self.lin)
        return DenseRows(self.jacobian_rows(x, out_idx, differentiable), 1, self.lin)

    def gradient_rows_vjp(self, x: Tensor, out_idx: Tensor, U: Tensor) -> dict:
        """``R^T U`` for the rows ``grad g_{out_idx[m]}(x_m)``, by one batched VJP."""
        C = self.lin.n_outputs(x)
        onehot = torch.nn.functional.one_hot(out_idx, C).to(self.lin.dtype)  # (M, C)
        cot = U.T[:, :, None] * onehot[None]  # (K, M, C)
        return self.vjp(x, cot)

    # -- kernels ----------------------------------------------------------------
    def _rows64(self, x, out_idx):
        if out_idx is None:
            return self.jacobian(x).to(_F64).reshape(-1, self.lin.n_params)
        return self.jacobian_rows(x, out_idx).to(_F64)

    def ntk(self, x1: Tensor, x2: Tensor | None, out1=None, out2=None) -> Tensor:
        """``J_1 J_2^T`` in float64 (``x2=None``: ``x1`` and ``out1``)."""
        R1 = self._rows64(x1, out1)
        R2 = R1 if x2 is None else self._rows64(x2, out2)
        return R1 @ R2.T

    def ntk_diag_blocks(self, x: Tensor) -> Tensor:
        """Per-point ``J(x_b) J(x_b)^T``, ``(B, C, C)`` float64."""
        out = []
        for _, J in self.lin.jacobian_chunks(x, self.lin.n_outputs(x)):
            J = J.to(_F64)
            out.append(J @ J.transpose(1, 2))
        return torch.cat(out)

    def cross_and_diag(self, x: Tensor, rows: Rows, n_outputs: int) -> tuple[Tensor, Tensor]:
        """``(J(x) R^T, ntk_diag_blocks(x))``: ``(B, C, n_rows)`` and ``(B, C, C)``.

        The cross block is differentiable w.r.t. whatever ``rows`` depends on.
        """
        R = rows.dense().to(_F64)
        parts, blocks = [], []
        for _, J in self.lin.jacobian_chunks(x, n_outputs):
            J = J.to(_F64)
            parts.append(J @ R.T)
            blocks.append(J @ J.transpose(1, 2))
        return torch.cat(parts), torch.cat(blocks)

    def kernel_step(self, rows_per_point: int) -> int:
        """Points per block of :meth:`kernel` (their rows fit the chunk budget)."""
        return self.lin.chunk_size(rows_per_point)

    def row_elements(self) -> int:
        """Elements one Jacobian row holds in :meth:`rows`' representation."""
        return self.lin.n_params

    def kernel(self, X1: Tensor, X2: Tensor | None, C: int, dtype, out1=None,
               out2=None) -> Tensor:
        """The full Gram ``J(X1) J(X2)^T`` block by block (see ``LinearizedNet.kernel``).

        The rows of a panel of blocks (up to :data:`PANEL_ELEMENTS` elements) are
        computed once and paired with each other and with every later block, so each
        row is computed once when the panel holds them all, and once per panel
        otherwise -- never once per Gram block.
        """
        same = X2 is None
        if same:
            X2, out2 = X1, out1
        r1 = 1 if out1 is not None else C
        r2 = 1 if out2 is not None else C
        step = self.kernel_step(max(r1, r2))
        n1, n2 = X1.shape[0], X2.shape[0]
        out = torch.empty((n1 * r1, n2 * r2), dtype=dtype, device=self.lin.device)
        chunks1 = [slice(i, min(i + step, n1)) for i in range(0, n1, step)]
        chunks2 = chunks1 if same else [slice(j, min(j + step, n2)) for j in range(0, n2, step)]
        per_chunk = max(1, step * r1 * self.row_elements())
        panel = max(1, device_budget(PANEL_ELEMENTS, self.lin.device) // per_chunk)

        def rows(X, o, sl):
            with torch.no_grad():
                return self.rows(X[sl], None if o is None else o[sl])

        def put(si, sj, blk):
            out[si.start * r1:si.stop * r1, sj.start * r2:sj.stop * r2] = blk
            if same and si != sj:
                out[sj.start * r2:sj.stop * r2, si.start * r1:si.stop * r1] = blk.T

        for p0 in range(0, len(chunks1), panel):
            held = [(si, rows(X1, out1, si)) for si in chunks1[p0:p0 + panel]]
            if same:
                for a, (si, Ri) in enumerate(held):
                    for sj, Rj in held[a:]:
                        with torch.no_grad():
                            put(si, sj, Ri.gram(None if sj == si else Rj))
                later = chunks1[p0 + panel:]
            else:
                later = chunks2
            for sj in later:
                Rj = rows(X2, out2, sj)
                for si, Ri in held:
                    with torch.no_grad():
                        put(si, sj, Ri.gram(Rj))
        return out


class FactoredBackend(JacobianBackend):
    """A backend whose :meth:`rows` are compact factors: every kernel from them.

    Subclasses implement :meth:`rows` (and usually ``jvp`` / ``vjp``); the Jacobians,
    Gram blocks, diagonal blocks and ``R^T U`` products here pair the factors and
    never go through ``torch.func``.
    """

    thread_safe = True
    factored = True

    def jacobian(self, x: Tensor) -> Tensor:
        with torch.no_grad():
            return self.rows(x).dense().reshape(x.shape[0], -1, self.lin.n_params)

    def jacobian_rows(self, x: Tensor, out_idx: Tensor, differentiable: bool = False) -> Tensor:
        return self.rows(x, out_idx, differentiable).dense()

    def gradient_rows_vjp(self, x: Tensor, out_idx: Tensor, U: Tensor) -> dict:
        step = self.kernel_step(1)
        res = None
        with torch.no_grad():
            for s in range(0, x.shape[0], step):
                part = self.rows(x[s:s + step], out_idx[s:s + step]).vjp(U[s:s + step])
                res = part if res is None else {n: res[n] + part[n] for n in res}
        return res

    def ntk(self, x1: Tensor, x2: Tensor | None, out1=None, out2=None) -> Tensor:
        with torch.no_grad():
            F1 = self.rows(x1, out1)
            F2 = F1 if x2 is None else self.rows(x2, out2)
            return F1.gram(F2)

    def ntk_diag_blocks(self, x: Tensor) -> Tensor:
        with torch.no_grad():
            return self.rows(x).diag_blocks()

    def cross_and_diag(self, x: Tensor, rows, n_outputs: int) -> tuple[Tensor, Tensor]:
        Fx = self.rows(x)
        return Fx.cross_gram(rows).view(x.shape[0], n_outputs, -1), Fx.diag_blocks()
