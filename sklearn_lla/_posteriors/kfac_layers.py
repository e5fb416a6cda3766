"""Per-backend layer factors: what :class:`~sklearn_lla._posteriors.complement.
KFACComplement` accumulates its Kronecker factors from and evaluates ``j^T Sigma j`` with.

A *layer factors* object describes the linearised parameters of a network as

* Kronecker blocks (:class:`KronBlock`): a parameter matrix ``W`` of shape
  ``(out, in')`` (a weight reshaped to ``(out, -1)``, its bias, if linearised, as the
  last column), whose Jacobian block for a row is ``sum_t d_t abar_t^T`` over the
  layer's positions ``t`` (one position for ``nn.Linear`` on ``(B, in)`` inputs; the
  output positions of a convolution, against its unfolded input patches; the extra
  dimensions of a ``nn.Linear`` on ``(B, ..., in)``), ``abar_t = [a_t, 1]``;
* diagonal parameters: any other linearised parameter, whose rows are given densely
  (BatchNorm's weight and bias; they are few).

and, for a batch of inputs, returns those factors in float64 (:meth:`factors`):
``a`` of shape ``(B, T, in')``, ``d`` of shape ``(B, K, out, T)`` per block and the
dense rows ``(B, K, p_diag)`` of the diagonal parameters, for ``K`` rows per point: the
``C`` outputs, or, for the curvature, the rows mixed by the likelihood's curvature
factor (``sum_c M_kc J_c`` with ``M M^T``-type factors of ``Lam``).

Two implementations: :class:`ChainFactors` (the structured backend: chains of
``nn.Linear``, every block one position) and :class:`GraphFactors` (the graph
backend: ``nn.Linear``, ``nn.Conv1d`` / ``nn.Conv2d`` as Kronecker blocks in the KFC
sense of Grosse & Martens (2016), BatchNorm's affine parameters diagonal). The KFAC
algebra on them (factors, eigenbases, ``j^T Sigma j``) is one code, in
:mod:`~sklearn_lla._posteriors.complement`; the row sums of the factors and of the
exact GGN trace over a pass (``_FactorSums``, ``_rows_ggn_trace``) are here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

__all__ = ["KronBlock", "ChainFactors", "GraphFactors", "layer_factors", "rotate_signals",
           "supports_layer_factors"]

_F64 = torch.float64


@dataclass(frozen=True)
class KronBlock:
    """One Kronecker-factored parameter block ``W`` of shape ``(out, in')``.

    Attributes
    ----------
    weight_name, bias_name : str or None
        The linearised parameters (``None``: absent or not linearised).
    weight_shape : tuple
        The weight's shape (reshaped to ``(out, -1)`` in the block).
    out : int
        Output features / channels.
    """

    weight_name: str | None
    bias_name: str | None
    weight_shape: tuple
    out: int

    @property
    def n_in(self) -> int:
        """``in'``: the weight's input features (times the kernel) plus one for a bias."""
        n = 1
        for s in self.weight_shape[1:]:
            n *= int(s)
        return (n if self.weight_name is not None else 0) + (self.bias_name is not None)

    def to_matrix(self, T: dict) -> Tensor:
        """``{name: (K, *shape)}`` -> ``(K, out, in')`` float64 (the bias last)."""
        parts = []
        if self.weight_name is not None:
            X = T[self.weight_name]
            parts.append(X.to(_F64).reshape(X.shape[0], self.out, -1))
        if self.bias_name is not None:
            parts.append(T[self.bias_name].to(_F64)[..., None])
        return torch.cat(parts, dim=-1)


def _with_bias(a: Tensor, weight: bool, bias: bool) -> Tensor:
    """``[a, 1]`` / ``a`` / ``1`` along the last dimension (``a``'s dtype)."""
    parts = [a] if weight else []
    if bias:
        parts.append(torch.ones(a.shape[:-1] + (1,), dtype=a.dtype, device=a.device))
    return torch.cat(parts, dim=-1)


def rotate_signals(Ug: Tensor, d: Tensor) -> Tensor:
    """``Ug^T d`` for signals ``d`` of shape ``(B, K, out, T)``: a block's signals in the
    eigenbasis ``Ug`` of its ``G`` factor (for one position, ``T = 1``, one product
    ``d^T Ug``).

    One batched product over the ``B K`` rows with ``Ug^T`` expanded (no copy), which
    is what ``Ug.T @ d`` broadcasts to, without its dispatch: on the digits CNN (71
    points, ``C = 10``) 0.74 - 2.8 ms against 0.78 - 3.0 ms for the convolutions, and
    0.09 against 3.5 ms for its ``nn.Linear(512, 64)`` (one thread).

    Parameters
    ----------
    Ug : Tensor of shape (out, out)
    d : Tensor of shape (B, K, out, T)

    Returns
    -------
    Tensor of shape (B, K, out, T)
    """
    B, K, o, T = d.shape
    if T == 1:
        return (d[..., 0] @ Ug).unsqueeze(-1)
    n = B * K
    return torch.bmm(Ug.T.expand(n, o, o), d.reshape(n, o, T)).view(B, K, o, T)


def _mix(d: Tensor, M: Tensor | None) -> Tensor:
    """Rows ``(B, C, ...)`` mixed by ``M`` ``(B, K, C)`` into ``(B, K, ...)``."""
    if M is None:
        return d
    B, C = d.shape[:2]
    return (M @ d.reshape(B, C, -1)).reshape(B, M.shape[1], *d.shape[2:])


class ChainFactors:
    """Layer factors of the structured backend (chains of ``nn.Linear``).

    Parameters
    ----------
    lin : LinearizedNet
        A network with ``backend == "structured"``.
    """

    #: The chain's features come from its own forward-mode products, cheaper than
    #: its rows: the complement's factors are computed separately.
    shares_rows = False

    def __init__(self, lin):
        self.lin = lin
        self._blocks = None
        self.diag_names: list[str] = []

    def _describe(self, F) -> list[KronBlock]:
        lin = self.lin
        out = []
        for layer in F.layers:
            w, b = layer.weight_name, layer.bias_name
            shape = tuple(lin.params[w].shape) if w is not None else ()
            out.append(KronBlock(w, b, shape, int(layer.delta.shape[1])))
        return out

    def blocks(self, x: Tensor) -> list[KronBlock]:
        """The Kronecker blocks (read from the factored Jacobian at ``x``, one row).

        Parameters
        ----------
        x : Tensor of shape (B, ...)

        Returns
        -------
        list of KronBlock
        """
        if self._blocks is None:
            self._blocks = self._describe(self.lin.factored_jacobian(x[:1]))
        return self._blocks

    def step(self, n_rows: int) -> int:
        """Points per chunk of :meth:`factors` (the chain's factors are small)."""
        return 1 << 30

    def factors(self, x: Tensor, mix=None, dtype=_F64) -> tuple:
        """``(g, [(a, d) per block], None)`` at ``x`` (module docstring), float64.

        Parameters
        ----------
        x : Tensor of shape (B, ...)
        mix : callable, optional
            ``mix(g64) -> M`` ``(B, K, C)``: the rows mixed per point; default all
            ``C`` outputs' rows.
        dtype : torch.dtype, default=torch.float64
            The factors' dtype (the network's for the products of a prediction, as
            :meth:`GraphFactors.factors`).

        Returns
        -------
        tuple
        """
        F = self.lin.factored_jacobian(x)
        B, C = F.n_points, F.rows_per_point
        g = F.output
        M = None if mix is None else mix(g.to(_F64)).to(dtype)
        out = []
        for layer in F.layers:
            a = _with_bias(layer.act.to(dtype), layer.has_weight, layer.has_bias)
            d = _mix(layer.delta.to(dtype).reshape(B, C, -1), M)
            out.append((a[:, None, :], d[..., None]))
        return g, out, None


class GraphFactors:
    """Layer factors of the graph backend (convolutional / residual networks).

    ``nn.Linear``, ``nn.Conv1d`` and ``nn.Conv2d`` are Kronecker blocks: a
    convolution's weight block of a row is ``sum_t d_t abar_t^T``, ``d_t`` the
    back-propagated signal at output position ``t`` and ``abar_t`` the unfolded input
    patch there (with a 1 for the bias); a ``nn.Linear`` on inputs with extra
    dimensions likewise over them. BatchNorm's weight and bias are diagonal parameters
    (their dense rows come from the backend's closed-form blocks).

    Parameters
    ----------
    lin : LinearizedNet
        A network with ``backend == "graph"``.
    """

    KRON = (nn.Linear, nn.Conv1d, nn.Conv2d)

    #: :meth:`rows_and_factors` shares one pass between the rows and the factors.
    shares_rows = True

    def __init__(self, lin):
        self.lin = lin
        self.backend = lin.jacobian_backend
        modules = dict(lin.module.named_modules())
        self._kron, self._diag = [], []  # layer indices
        kron_blocks, self.diag_names = [], []
        for i, layer in enumerate(self.backend.layers):
            m = modules[layer.path]
            if isinstance(m, self.KRON):
                w = layer.weight_name
                shape = tuple(lin.params[w].shape) if w is not None else ()
                kron_blocks.append(KronBlock(w, layer.bias_name, shape, int(m.weight.shape[0])))
                self._kron.append(i)
            else:
                self._diag.append(i)
                self.diag_names += layer.names()
        self._blocks = kron_blocks

    def blocks(self, x: Tensor) -> list[KronBlock]:
        """The Kronecker blocks.

        Parameters
        ----------
        x : Tensor
            Unused (the blocks are known from the modules).

        Returns
        -------
        list of KronBlock
        """
        return self._blocks

    def step(self, n_rows: int) -> int:
        """Points per chunk of :meth:`factors` (the backend's budget of a recorded
        pass, :meth:`~sklearn_lla._network.backends.graph.GraphBackend.rows_step`)."""
        return self.backend.rows_step(n_rows)

    def factors(self, x: Tensor, mix=None, dtype=_F64) -> tuple:
        """``(g, [(a, d) per block], D)`` at ``x`` (module docstring), float64.

        Parameters
        ----------
        x : Tensor of shape (B, ...)
        mix : callable, optional
            ``mix(g64) -> M`` ``(B, K, C)``; default all ``C`` outputs' rows.
        dtype : torch.dtype, default=torch.float64
            The factors' dtype (the network's for the products of a prediction).

        Returns
        -------
        tuple
        """
        g, sig = self.backend.layer_signals(self.lin._input(x))
        return self._from_signals(g, sig, mix, dtype=dtype)

    def rows_and_factors(self, x: Tensor, mix=None, dtype=None) -> tuple:
        """The Jacobian rows at ``x`` (all outputs) and :meth:`factors` of the same
        forward and backward pass.

        Parameters
        ----------
        x : Tensor of shape (B, ...)
            Inputs (cast by the network), at most :meth:`step` points.
        mix : callable, optional
            As in :meth:`factors` (the signals are mixed after the backward pass).
        dtype : torch.dtype, optional
            The factors' dtype (default the network's: a prediction's rotations).

        Returns
        -------
        rows : GraphRows
        factors : tuple
            As :meth:`factors`.
        """
        rows = self.backend.rows_and_signals(self.lin._input(x))
        dense = None
        if self.diag_names and rows.D is not None:  # the diagonal parameters' rows
            dense = rows._columns(rows.D, rows.dense_names)
        facs = self._from_signals(rows.output, rows.signals, mix, rows.patches,
                                  dtype=dtype or self.lin.dtype, dense=dense)
        rows.signals = rows.patches = None  # (held by the factors now, as needed)
        return rows, facs

    def _from_signals(self, g: Tensor, sig: list, mix=None, patches=None, dtype=_F64,
                      dense=None) -> tuple:
        """:meth:`factors` from the backend's layer signals, in ``dtype`` (float64 for
        the curvature; the network's for the rotations of a prediction). ``patches``:
        the conv layers' unfolded inputs and ``dense``: the diagonal parameters' rows
        ``{name: (B * C, numel)}``, when the rows already hold them."""
        from .._network.backends.graph import conv_patches, layer_blocks

        B, C = g.shape
        M = None if mix is None else mix(g.to(_F64)).to(dtype)
        K = C if M is None else M.shape[1]
        out = []
        for i, blk in zip(self._kron, self._blocks):
            if sig[i] is None:  # not used by the forward pass: zero rows
                out.append(None)
                continue
            layer, mod, a, d = sig[i]
            d = _mix(d.to(dtype).reshape(B, C, *d.shape[1:]), M)
            if isinstance(mod, nn.Linear):
                a = a.to(dtype).reshape(B, -1, a.shape[-1])  # (B, T, in)
                d = d.reshape(B, K, -1, blk.out).transpose(2, 3)  # (B, K, out, T)
                out.append((_with_bias(a, layer.weight_name is not None,
                                       layer.bias_name is not None), d))
                continue
            d = d.reshape(B, K, blk.out, -1)
            bias = layer.bias_name is not None
            if layer.weight_name is not None:
                # abar = [patches, 1]: the rows' pass keeps it (graph_layers.layer_blocks),
                # else the patches are unfolded with the ones in one copy
                pa = None if patches is None else patches.get(i)
                abar = (pa.to(dtype) if pa is not None else
                        conv_patches(mod, a.to(dtype), ones=bias))
            else:
                abar = torch.ones((B, d.shape[-1], int(bias)), dtype=dtype, device=d.device)
            out.append((abar, d))
        D = None
        if self.diag_names:
            cols = {} if dense is None else {  # (B, K, numel) once mixed
                n: _mix(dense[n].to(dtype).reshape(B, C, -1), M)
                for n in self.diag_names if n in dense}
            for i in self._diag:
                if sig[i] is None or all(n in cols for n in self.backend.layers[i].names()):
                    continue
                layer, mod, a, d = sig[i]
                d = _mix(d.to(dtype).reshape(B, C, *d.shape[1:]), M)
                _, blocks = layer_blocks(layer, mod, a.to(dtype),
                                         d.reshape(B * K, *d.shape[2:]), K)
                cols.update(blocks)
            D = torch.cat([cols[n].reshape(B, K, -1) if n in cols else
                           torch.zeros((B, K, self.lin.params[n].numel()), dtype=dtype,
                                       device=g.device) for n in self.diag_names], dim=-1)
        return g, out, D


# ------------------------------------------------------------------------------------
# the KFAC factors' row sums over a pass (KFACComplement's, from either backend)
# ------------------------------------------------------------------------------------
def _block_trace(a, d):
    """``sum_b sum_k ||sum_t d_bkt abar_bt^T||_F^2`` of a Kronecker block's rows (the
    exact GGN trace's share), by whichever is cheaper: forming the row blocks
    (``out T in'`` per row) or the Gram identity ``sum_tt' (d_t . d_t')(abar_t .
    abar_t') = sum_k d_k^T (abar abar^T) d_k`` (``T^2 out`` per row and ``T^2 in'`` per
    point, one batched product per point)."""
    b, K, o, T = d.shape
    if T == 1:
        return float((d[..., 0].pow(2).sum(-1) * a[:, None, 0].pow(2).sum(-1)).sum())
    n_in = a.shape[-1]
    if K * T * T * o + T * T * n_in < K * o * T * n_in:
        Ga = a @ a.transpose(1, 2)  # (b, T, T)
        dd = d.reshape(b, K * o, T)
        return float((torch.bmm(dd, Ga) * dd).sum())
    return float(torch.bmm(d.reshape(b, K * o, T), a).pow(2).sum())


def _gram_t64(X):
    """``X^T X`` in float64 for ``X`` of shape ``(n, p)`` in any dtype (torch's BLAS:
    scipy's ``syrk`` halves the multiplications, but its BLAS threads, called for
    every chunk and block, spin against torch's with two threads: 2.5 s instead of
    3.3 s for the digits CNN's ELLA fit)."""
    X = X.to(_F64)
    return X.T @ X


class _FactorSums:
    """The row sums of the KFAC factors over chunks of points: ``A = sum mean_t abar
    abar^T`` and ``G = sum_(b, k, t) d d^T`` per block, the diagonal GGN of the
    diagonal parameters, the points and ``tr GGN`` (:mod:`~sklearn_lla._posteriors.
    complement`'s module docstring)."""

    def __init__(self, lin, src):
        self.lin, self.src = lin, src
        self.A = self.G = None
        self.diag = torch.zeros(sum(lin.params[n].numel() for n in src.diag_names),
                                dtype=_F64, device=lin.device)
        self.n, self.tr = 0, 0.0

    def add(self, facs, D, n_points, x, trace=None):
        """Add one chunk's factors ``[(a, d) per block]`` and diagonal rows (``x``: the
        chunk's inputs, for the blocks' shapes); ``trace``: the chunk's ``tr GGN`` when
        already known (:func:`_rows_ggn_trace`), else computed from the factors (then
        float64). The factors may be in the network's dtype (the signals mixed by the
        likelihood's curvature there, a product of Jacobian rows): the products and
        the sums are float64."""
        if self.A is None:
            blocks = self.src.blocks(x)
            dev = self.lin.device
            self.A = [torch.zeros((b.n_in, b.n_in), dtype=_F64, device=dev) for b in blocks]
            self.G = [torch.zeros((b.out, b.out), dtype=_F64, device=dev) for b in blocks]
        for j, f in enumerate(facs):
            if f is None:
                continue
            a, d = f  # (b, T, in'), (b, K, out, T)
            T = a.shape[1]
            if T > 1 and a.stride(1) == 1:
                # a conv's abar, a transposed view of (b, in', T) (graph_layers.
                # conv_patches): one float64 copy in the (in', b T) layout, whose product
                # with its transpose is A (digits CNN, 63 points: 4.7 against 6.7 ms
                # through a copy of the view in its own layout)
                af = torch.empty((a.shape[2], a.shape[0], T), dtype=_F64, device=a.device)
                af.copy_(a.permute(2, 0, 1))
                af = af.view(a.shape[2], -1)
                self.A[j] += (af @ af.T) / T
                del af
            else:
                self.A[j] += _gram_t64(a.reshape(-1, a.shape[-1])) / T
            b_, K_, o, _ = d.shape
            # G = sum over (b, k, t) of d d^T from one float64 copy: for one position
            # its plain cast (b K, out); for several the (out, b K T) layout, one
            # product of long rows (30 % faster than (b K T, out) on the digits CNN's
            # convolutions, whose (b, K, out, T) signals are transposed either way)
            if T == 1:
                self.G[j] += _gram_t64(d.reshape(-1, o))
            else:
                df = torch.empty((o, b_, K_, T), dtype=_F64, device=d.device)
                df.copy_(d.permute(2, 0, 1, 3))
                df = df.view(o, -1)
                self.G[j] += df @ df.T
                del df
            if trace is None:
                self.tr += _block_trace(a.to(_F64), d.to(_F64))
        if D is not None:
            sq = D.to(_F64).pow(2).sum((0, 1))
            self.diag += sq
            if trace is None:
                self.tr += float(sq.sum())
        if trace is not None:
            self.tr += float(trace)
        self.n += int(n_points)

    def result(self):
        """``(A per block..., G per block..., diagonal GGN, n_points, tr GGN)``."""
        return (*self.A, *self.G, self.diag, self.n, self.tr)


def _rows_ggn_trace(rows, mix):
    """``sum_b tr(Lam_b J_b J_b^T) = sum_b ||M_b J_b||_F^2`` of a chunk's rows (all
    outputs; ``Lam_b = M_b^T M_b``): the GGN trace's share of the chunk, float64.

    The dense blocks' rows are mixed by ``M_b`` in their own dtype (a product of
    Jacobian rows, as the KFAC factors' mixed signals), each mixed row's norm taken
    there and the squares summed in float64; a factored layer's rows ``delta (x)
    abar`` give ``||M delta||^2 ||abar||^2`` per point, in float64. (The per-point
    ``C x C`` blocks of the rows in float64, contracted with ``Lam``, took as many
    products but a float64 copy of every dense entry, a few points at a time.)"""
    B, C = rows.output.shape
    M = None if mix is None else mix(rows.output.to(_F64))  # (B, K, C)
    tr = torch.zeros((), dtype=_F64, device=rows.output.device)
    if rows.D is not None:
        D = rows.D.view(B, C, -1)
        MD = D if M is None else torch.bmm(M.to(D.dtype), D)
        # per mixed row its norm in the rows' dtype, the squares summed in float64
        # (a float64 reduction of every entry costs 15 times more)
        tr += torch.linalg.vector_norm(MD, dim=-1).to(_F64).square().sum()
    if rows.factors is not None:
        for f in rows.factors.layers:
            d = f.delta.view(B, C, -1).to(_F64)
            dn = (d if M is None else torch.bmm(M, d)).square().sum((1, 2))  # (B,)
            if f.has_weight:
                an = f.act.to(_F64).square().sum(-1) + float(f.has_bias)
                tr += dn @ an
            else:
                tr += dn.sum()
    return float(tr)


def supports_layer_factors(lin) -> bool:
    """Whether ``lin``'s backend has layer factors (structured or graph).

    Parameters
    ----------
    lin : LinearizedNet

    Returns
    -------
    bool
    """
    return getattr(lin, "backend", None) in ("structured", "graph")


def layer_factors(lin):
    """The layer factors of ``lin``'s Jacobian backend.

    Parameters
    ----------
    lin : LinearizedNet

    Returns
    -------
    ChainFactors or GraphFactors

    Raises
    ------
    ValueError
        When the backend has none (the generic ``torch.func`` one).
    """
    backend = getattr(lin, "backend", None)
    if backend == "structured":
        return ChainFactors(lin)
    if backend == "graph":
        return GraphFactors(lin)
    raise ValueError("the KFAC complement needs the structured or graph Jacobian backend; "
                     f"this network uses {backend!r}")
