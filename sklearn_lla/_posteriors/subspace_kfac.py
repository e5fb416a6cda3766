"""The ``lowrank-kfac`` projector from the layer factors of the KFAC complement.

On a network whose Jacobian backend has layer factors (structured or graph,
:mod:`~sklearn_lla._posteriors.kfac_layers`) subspace Laplace needs one KFAC, not two:
the projector's ``Psi_approx = (H_KFAC / s2 + I / s0^2)^-1`` and the complement's
``Sigma`` (:class:`~sklearn_lla._posteriors.complement.KFACComplement`) are read from
the same factor sums, accumulated in one pass over the training rows
(:func:`~sklearn_lla._posteriors.complement.kfac_factor_sums`). The convention is
curvlinops' (type-2 factors, KFAC-expand, ``num_data = N``): per Kronecker block
``A = sum_n mean_t abar abar^T / N``, ``G = sum_n sum_k sum_t d d^T`` with the rows
mixed by the likelihood's curvature factor (unit noise for a Gaussian), the GGN block
``~ G (x) A``; any parameter outside a Kronecker block (BatchNorm's) gets its exact
diagonal GGN entry. On nets of ``nn.Linear`` / ``nn.Conv2d`` / BatchNorm layers this is
the curvature :class:`sklearn_lla._network.curvature.KFAC` computes with curvlinops
(checked to round-off in the tests); ``nn.Conv1d`` is a Kronecker block here (a
diagonal one there).

``Psi_approx`` is diagonal in the factors' Kronecker eigenbases: the Jacobian rows of
the projector's subset are rotated into them once (:class:`_RotatedPasses`; a row
block ``sum_t d_t abar_t^T`` becomes ``sum_t (U_G^T d_t)(U_A^T abar_t)^T``, kept as its
two factors for one position, formed for several), so every step of the range finder
of :func:`~sklearn_lla._posteriors.subspace.lowrank_directions` is two contractions of
cached rows and a diagonal scaling, instead of two passes through the network and a
rotation of ``p x (k + o)`` columns into the eigenbases and back. The directions
found are formed in the parameters' layout once (:meth:`_RotatedPasses.jt_params`:
the layers of one position from their unrotated factors, the others' small blocks
rotated back). The rows, their rotations and their products with the range finder's
columns run in the network's dtype (Jacobian products) and are cast to float64 before
they are summed; the columns, the eigenbases, ``Psi_approx`` and everything the range
finder accumulates are float64.
"""

from __future__ import annotations

import inspect

import torch

from .._network.curvature import _owners
from .._network.linearized import stack_flat
from .complement import KFACComplement, kfac_and_rows_pass, kfac_factor_sums
from .kfac_layers import layer_factors, rotate_signals

__all__ = ["LayerKFAC", "ROTATED_ROWS_ELEMENTS", "ROW_CACHE_ELEMENTS"]

_F64 = torch.float64

#: Largest number of elements (in the network's dtype) of the training rows kept from
#: the KFAC pass for the GGN of the features (:class:`RowCache`); beyond it the GGN
#: is one more pass.
ROW_CACHE_ELEMENTS = 2**26

#: Largest number of elements (in the network's dtype) of the subset's rotated rows kept
#: between the range finder's steps (beyond it they are recomputed chunk by chunk at each step).
ROTATED_ROWS_ELEMENTS = 2**25


class LayerKFAC:
    """KFAC of the GGN from the layer factors (module docstring), with the interface of
    :class:`sklearn_lla._network.curvature.KFAC`.

    Parameters
    ----------
    lin : LinearizedNet
        A network with layer factors (structured or graph backend).
    data : FitData
        The training stream (one pass).
    keep_rows : bool, default=False
        Keep the training rows of the same pass (:attr:`rows`) where the layer factors
        share it (graph backend, in-memory data) and they fit
        :data:`ROW_CACHE_ELEMENTS`.

    Attributes
    ----------
    rows : RowCache or None
        The training rows, chunk by chunk (``None``: not kept).
    sums : tuple
        The factors' row sums (``KFACComplement(..., sums=sums)``).
    description : str
        Which curvature covers which parameters, in words.
    diag : Tensor of shape (p_diag,) or None
        The exact diagonal GGN of :attr:`diag_names` (unit noise), float64.
    diag_names : list of str
        The parameters outside the Kronecker blocks.
    """

    def __init__(self, lin, data, keep_rows=False):
        self.lin = lin
        self.rows = None
        src = layer_factors(lin)
        if (keep_rows and getattr(src, "shares_rows", False) and not data.is_dask
                and _fit_rows(lin, data)):
            # the pass that gives the factors gives the training rows too (graph
            # backend): kept, within ROW_CACHE_ELEMENTS, for the GGN of the features
            cache = RowCache(ROW_CACHE_ELEMENTS)
            self.sums = data.reduce(kfac_and_rows_pass, (lin, data.likelihood, cache.add, []),
                                    min(data.batch_size, 1024))
            self.rows = cache if cache.items is not None else None
        else:
            self.sums = kfac_factor_sums(lin, data)
        self.kfac = KFACComplement(lin, data, None, sums=self.sums)
        self.blocks, self.eig = self.kfac.blocks, self.kfac.eig
        self.diag_names = list(self.kfac.diag_names)
        self.diag = self.kfac.diag if self.diag_names else None
        owners = _owners(lin.module)
        kron = [n for b in self.blocks for n in (b.weight_name, b.bias_name) if n is not None]

        def describe(names):
            kinds = sorted({type(owners[n]).__name__ for n in names})
            return ", ".join(kinds), sum(lin.params[n].numel() for n in names)

        kinds, n_k = describe(kron)
        self.description = f"KFAC ({kinds}: {n_k} parameters)"
        if self.diag_names:
            kinds, n_d = describe(self.diag_names)
            self.description += f" + exact diagonal GGN ({kinds}: {n_d} parameters)"
        # the rotated layout: every block's out x in' eigen-coordinates, then the diagonal
        self._sizes = [b.out * b.n_in for b in self.blocks]
        self._n_diag = sum(lin.params[n].numel() for n in self.diag_names)

    def eigvals(self):
        """Eigenvalues of the unit-noise KFAC GGN (``p`` of them), float64 numpy."""
        return self.kfac._rotated()[0].cpu().numpy()

    def weights(self, prior_variance, noise_variance=None):
        """``Psi_approx``'s eigenvalues ``1 / (lam / s2 + 1 / s0^2)`` in the rotated
        layout, float64 ``(p,)``."""
        s2 = 1.0 if noise_variance is None else float(noise_variance)
        lam = self.kfac._rotated()[0]
        return 1.0 / (lam / s2 + 1.0 / float(prior_variance))

    # -------------------------------------------------------------- the bases
    def rotate(self, T):
        """Columns ``T`` ``(p, k)`` in the parameters' layout -> the rotated layout."""
        Td = self.lin.unflatten(T.T.to(_F64))
        k = T.shape[1]
        parts = [(Ug.T @ blk.to_matrix(Td) @ Ua).reshape(k, -1)
                 for blk, (_, Ug, _, Ua) in zip(self.blocks, self.eig)]
        if self.diag_names:
            parts.append(self.kfac._diag_matrix(Td))
        return torch.cat(parts, dim=1).T

    def unrotate(self, R):
        """Columns ``R`` ``(p, k)`` in the rotated layout -> the parameters' layout."""
        k, mats, start = R.shape[1], [], 0
        Rt = R.T
        for blk, (_, Ug, _, Ua), size in zip(self.blocks, self.eig, self._sizes):
            mats.append(Ug @ Rt[:, start:start + size].reshape(k, blk.out, blk.n_in) @ Ua.T)
            start += size
        return self._to_params(mats, Rt[:, start:], k).contiguous()

    def _to_params(self, mats, diag, k):
        """``(p, k)`` float64 columns in the parameters' layout from every Kronecker
        block's ``(k, out, in')`` matrices (parameters' coordinates; ``None``: zero) and
        the diagonal parameters' ``(k, p_diag)`` columns (the transpose of a contiguous
        ``(k, p)``: LAPACK's column-major layout)."""
        out, start = {}, 0
        for blk, M in zip(self.blocks, mats):
            if M is None:
                M = torch.zeros((k, blk.out, blk.n_in), dtype=_F64, device=self.lin.device)
            if blk.weight_name is not None:
                n_w = blk.n_in - (blk.bias_name is not None)
                out[blk.weight_name] = M[..., :n_w].reshape(k, *blk.weight_shape)
            if blk.bias_name is not None:
                out[blk.bias_name] = M[..., -1]
        for n in self.diag_names:
            size = self.lin.params[n].numel()
            out[n] = diag[:, start:start + size].reshape(k, *self.lin.params[n].shape)
            start += size
        return stack_flat(out, self.lin.names).T

    def inverse(self, prior_variance, noise_variance=None):
        """``Psi_approx = (H_KFAC / s2 + I / s0^2)^-1`` as a map on ``(p, k)`` float64
        matrices (parameters' layout), with :meth:`_KFACInverse.passes` for the range
        finder."""
        return _KFACInverse(self, self.weights(prior_variance, noise_variance))


class _KFACInverse:
    """``T -> Psi_approx T`` of a :class:`LayerKFAC`; its :meth:`passes` work in the
    rotated layout, where ``Psi_approx`` is the diagonal ``w``."""

    def __init__(self, kfac, w):
        self.kfac, self.w = kfac, w

    def __call__(self, T):
        k = self.kfac
        return k.unrotate(self.w[:, None] * k.rotate(T.to(_F64)))

    def passes(self, lin, X, n_outputs, chunks):
        """The range finder's products on the rows of ``X`` (:class:`_RotatedPasses`)."""
        return _RotatedPasses(self.kfac, self.w, lin, X, n_outputs, chunks)


class _RotatedPasses:
    """``J^T Q``, ``J T`` and ``Psi T`` over the rows of ``X`` in the rotated layout.

    Per chunk of points and Kronecker block: for one position the rotated factors
    ``dt = U_G^T d`` ``(b, C, out)`` and ``at = U_A^T abar`` ``(b, in')`` (with the
    unrotated ``d`` and ``abar``, for :meth:`jt_params`); for several the rotated row
    blocks ``(b C, out in')``; the diagonal parameters' rows as they are. The rows,
    their rotations and their products with the range finder's columns run in the
    network's dtype (Jacobian products); every product is cast to float64 before it is
    summed (over chunks, blocks), and the columns, ``Psi`` and the bases stay float64.
    Cached when they fit :data:`ROTATED_ROWS_ELEMENTS`, else recomputed per product.
    """

    def __init__(self, kfac, w, lin, X, n_outputs, chunks):
        self.kfac, self.w, self.lin, self.X, self.C = kfac, w, lin, X, n_outputs
        self.chunks = chunks
        self.p = int(w.shape[0])
        self.rotated_layout = True
        self.dtype = lin.dtype
        # the eigenbases in the network's dtype, for the rows' rotations
        self._bases = [(Ug.to(self.dtype), Ua.to(self.dtype)) for _, Ug, _, Ua in kfac.eig]
        self._src = layer_factors(lin)
        # the layer factors in the network's dtype where the source takes one (graph
        # backend), else its float64 factors cast (structured backend)
        self._takes_dtype = "dtype" in inspect.signature(self._src.factors).parameters
        self._cache, self._w_net = None, None
        first = self._rotated(chunks[0])
        per_point = _elements(first) / max(chunks[0].stop - chunks[0].start, 1)
        if per_point * X.shape[0] <= ROTATED_ROWS_ELEMENTS:
            # computed chunk by chunk, kept as one chunk (one product per block)
            rotated = [first] + [self._rotated(sl) for sl in chunks[1:]]
            self._cache = _cat_rotated(rotated) if len(rotated) > 1 else first

    def _rotated(self, sl):
        x = self.X[sl]
        kw = {"dtype": self.dtype} if self._takes_dtype else {}
        _, facs, D = self._src.factors(x, **kw)  # all C outputs' rows
        b, C = x.shape[0], self.C
        parts = []
        for f, blk, (Ug, Ua) in zip(facs, self.kfac.blocks, self._bases):
            if f is None:  # a layer the forward pass does not use: zero rows
                parts.append(None)
                continue
            a, d = (t.to(self.dtype) for t in f)  # (b, T, in'), (b, C, out, T)
            at = a @ Ua
            dt = rotate_signals(Ug, d)  # (b, C, out, T)
            if a.shape[1] == 1:
                parts.append((dt[..., 0], at[:, 0], d[..., 0], a[:, 0]))
            else:
                Z = torch.bmm(dt.reshape(b, C * blk.out, -1), at)
                parts.append(Z.reshape(b * C, -1))
        Dd = None if D is None else D.to(self.dtype).reshape(b * C, -1)
        return parts, Dd

    def _each(self):
        if self._cache is not None:
            return [(slice(0, self.X.shape[0]), self._cache)]
        return ((sl, self._rotated(sl)) for sl in self.chunks)

    def psi(self, T):
        """``Psi_approx T`` (rotated layout)."""
        return self.w[:, None] * T

    def _block_jt(self, part, Qd, unrotated=False):
        """One Kronecker block's ``(w, out in')`` part of ``(J_chunk^T Qd)^T``, in the
        network's dtype (rotated coordinates; ``unrotated``: the parameters', for the
        blocks of one position only)."""
        w = Qd.shape[1]
        if not isinstance(part, tuple):
            return Qd.T @ part
        dt, at = part[2:] if unrotated else part[:2]  # (b, C, out), (b, in')
        b, C, o = dt.shape
        E = torch.einsum("bco,bck->kob", dt, Qd.reshape(b, C, w))
        return (E.reshape(w * o, b) @ at).reshape(w, -1)

    def _add_jt(self, out, rotated, Qs):
        """``out (w, p) += (J_chunk^T Qs)^T`` for one chunk's rotated rows."""
        parts, Dd = rotated
        Qd, start = Qs.to(self.dtype), 0
        for part, size in zip(parts, self.kfac._sizes):
            if part is not None:
                out[:, start:start + size] += self._block_jt(part, Qd)
            start += size
        if Dd is not None:
            out[:, start:] += Qd.T @ Dd

    def jt(self, Q):
        """``J^T Q`` ``(p, w)`` for ``Q`` ``(n C, w)`` (rotated layout), float64."""
        if self._cache is not None:  # one chunk: its blocks' products cast once, no sums
            parts, Dd = self._cache
            Qd, w = Q.to(self.dtype), Q.shape[1]
            cols = [self._block_jt(part, Qd) if part is not None else
                    Qd.new_zeros((w, size)) for part, size in zip(parts, self.kfac._sizes)]
            if Dd is not None:
                cols.append(Qd.T @ Dd)
            elif self.kfac._n_diag:
                cols.append(Qd.new_zeros((w, self.kfac._n_diag)))
            return torch.cat(cols, 1).to(_F64).T
        out = torch.zeros((Q.shape[1], self.p), dtype=_F64, device=Q.device)
        for sl, rotated in self._each():
            self._add_jt(out, rotated, Q[sl.start * self.C:sl.stop * self.C])
        return out.T

    def jt_params(self, Q):
        """``J^T Q`` ``(p, w)`` in the parameters' layout, float64, without rotating
        ``p x w`` columns back: the blocks of one position from their unrotated
        factors, the others' ``(w, out, in')`` sums rotated back (``U_G . U_A^T``)."""
        k, C, blocks = Q.shape[1], self.C, self.kfac.blocks
        mats = [None] * len(blocks)
        rot = [None] * len(blocks)
        diag = torch.zeros((k, self.p - sum(self.kfac._sizes)), dtype=_F64, device=Q.device)
        for sl, (parts, Dd) in self._each():
            Qd = Q[sl.start * C:sl.stop * C].to(self.dtype)
            for i, (part, blk) in enumerate(zip(parts, blocks)):
                if part is None:
                    continue
                one = isinstance(part, tuple)
                M = self._block_jt(part, Qd, unrotated=True).to(_F64)
                M = M.reshape(k, blk.out, blk.n_in)
                acc = mats if one else rot
                acc[i] = M if acc[i] is None else acc[i] + M
            if Dd is not None:
                diag += Qd.T @ Dd
        for i, (_, Ug, _, Ua) in enumerate(self.kfac.eig):
            if rot[i] is not None:
                M = Ug @ rot[i] @ Ua.T
                mats[i] = M if mats[i] is None else mats[i] + M
        return self.kfac._to_params(mats, diag, k)

    def directions(self, U, row_space):
        """``J^T U`` (``row_space``) or ``Psi J^T U``, in the parameters' layout."""
        if row_space:
            return self.jt_params(U)
        return self.kfac.unrotate(self.psi(self.jt(U)))

    def _block_j(self, part, blk, Tb):
        """One Kronecker block's ``J_chunk T_b`` ``(b C, w)`` for its ``(w, out in')``
        columns ``Tb`` (rotated coordinates), in the network's dtype."""
        w = Tb.shape[0]
        if not isinstance(part, tuple):
            return part @ Tb.T
        dt, at = part[:2]
        b = dt.shape[0]
        H = (Tb.reshape(w * blk.out, -1) @ at.T).reshape(w, blk.out, b)
        return torch.einsum("bco,kob->bck", dt, H).reshape(b * self.C, w)

    def j(self, T):
        """``J T`` ``(n C, w)`` for ``T`` ``(p, w)`` (rotated layout), float64."""
        Tt = T.T.to(self.dtype)
        res = []
        for _, (parts, Dd) in self._each():
            acc, start = None, 0
            for part, blk, size in zip(parts, self.kfac.blocks, self.kfac._sizes):
                if part is not None:
                    z = self._block_j(part, blk, Tt[:, start:start + size]).to(_F64)
                    acc = z if acc is None else acc + z
                start += size
            if Dd is not None:
                z = (Dd @ Tt[:, start:].T).to(_F64)
                acc = z if acc is None else acc + z
            res.append(acc)
        return torch.cat(res)

    def m(self, Q):
        """``M Q = J Psi J^T Q`` ``(n C, w)``, float64, for ``Q`` ``(n C, w)``: on kept
        rows block by block (``Psi`` is diagonal in the rotated layout), each block's
        ``J_b^T Q``, its scaling and ``J_b (.)`` in the network's dtype, the blocks'
        products summed in float64; else :meth:`j` of :meth:`psi` of :meth:`jt`."""
        if self._cache is None:
            return self.j(self.psi(self.jt(Q)))
        if self._w_net is None:
            self._w_net = self.w.to(self.dtype)
        parts, Dd = self._cache
        Qd, wn, acc, start = Q.to(self.dtype), self._w_net, None, 0
        for part, blk, size in zip(parts, self.kfac.blocks, self.kfac._sizes):
            if part is not None:
                Y = self._block_jt(part, Qd) * wn[start:start + size]
                z = self._block_j(part, blk, Y).to(_F64)
                acc = z if acc is None else acc + z
            start += size
        if Dd is not None:
            z = (Dd @ ((Qd.T @ Dd) * wn[start:]).T).to(_F64)
            acc = z if acc is None else acc + z
        return acc if acc is not None else torch.zeros_like(Q)

    def rows_t(self, i):
        """``J^T`` of chunk ``i``'s rows ``(p, b C)``: its rotated rows, formed."""
        sl = self.chunks[i]
        rotated = (_slice_rotated(self._cache, sl, self.C) if self._cache is not None
                   else self._rotated(sl))
        n = (sl.stop - sl.start) * self.C
        out = torch.zeros((n, self.p), dtype=_F64, device=self.w.device)
        self._add_jt(out, rotated, torch.eye(n, dtype=_F64, device=self.w.device))
        return out.T

    def to_params(self, P):
        """Columns in the rotated layout -> the parameters' layout."""
        return self.kfac.unrotate(P)


def _cat_rotated(chunks):
    """The rotated rows of consecutive chunks (:meth:`_RotatedPasses._rotated`) as one."""
    parts = []
    for ps in zip(*(c[0] for c in chunks)):
        if ps[0] is None:
            parts.append(None)
        elif isinstance(ps[0], tuple):
            parts.append(tuple(torch.cat(ts) for ts in zip(*ps)))
        else:
            parts.append(torch.cat(ps))
    Dd = None if chunks[0][1] is None else torch.cat([c[1] for c in chunks])
    return parts, Dd


def _slice_rotated(rotated, sl, C):
    """The points ``sl`` of rotated rows (``C`` rows a point)."""
    parts, Dd = rotated
    rows = slice(sl.start * C, sl.stop * C)
    parts = [None if p is None else tuple(t[sl] for t in p) if isinstance(p, tuple)
             else p[rows] for p in parts]
    return parts, (None if Dd is None else Dd[rows])


def _elements(rotated):
    parts, Dd = rotated
    n = 0 if Dd is None else Dd.numel()
    for part in parts:
        if part is None:
            continue
        n += sum(t.numel() for t in part) if isinstance(part, tuple) else part.numel()
    return n


class RowCache:
    """The training rows of the KFAC pass, chunk by chunk, while they fit a budget.

    Parameters
    ----------
    budget : int
        Largest number of elements kept; past it everything is dropped
        (:attr:`items` becomes ``None``) and nothing more is kept.

    Attributes
    ----------
    items : list of (Rows, Tensor) or None
        Each chunk's rows (all outputs, with their ``output``) and targets.
    """

    def __init__(self, budget):
        self.budget, self.elements, self.items = int(budget), 0, []

    def add(self, rows, x, y, state):
        """Keep one chunk's rows (the ``fn`` of
        :func:`~sklearn_lla._posteriors.complement.kfac_and_rows_pass`)."""
        if self.items is None:
            return
        self.elements += _rows_elements(rows)
        if self.elements > self.budget:
            self.items = None
            return
        self.items.append((rows, y))


def _fit_rows(lin, data):
    """Whether all training rows fit :data:`ROW_CACHE_ELEMENTS` (one point's rows
    measured: the layer factors' pass costs more than the factors alone, so it is
    taken only when its rows are kept)."""
    with torch.no_grad():
        probe = lin.rows(data.rows(slice(0, 1))[0])
    return _rows_elements(probe) * data.n_samples <= ROW_CACHE_ELEMENTS


def _rows_elements(rows):
    """Elements held by a chunk of graph rows (dense blocks and layer factors)."""
    n = rows.output.numel() + (0 if rows.D is None else rows.D.numel())
    if rows.factors is not None:
        n += sum(f.delta.numel() + f.act.numel() for f in rows.factors.layers)
    return n
