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
:mod:`~sklearn_lla._posteriors.complement`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

__all__ = ["KronBlock", "ChainFactors", "GraphFactors", "layer_factors",
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

    def factors(self, x: Tensor, mix=None) -> tuple:
        """``(g, [(a, d) per block], None)`` at ``x`` (module docstring), float64.

        Parameters
        ----------
        x : Tensor of shape (B, ...)
        mix : callable, optional
            ``mix(g64) -> M`` ``(B, K, C)``: the rows mixed per point; default all
            ``C`` outputs' rows.

        Returns
        -------
        tuple
        """
        F = self.lin.factored_jacobian(x)
        B, C = F.n_points, F.rows_per_point
        g = F.output
        M = None if mix is None else mix(g.to(_F64))
        out = []
        for layer in F.layers:
            a = _with_bias(layer.act.to(_F64), layer.has_weight, layer.has_bias)
            d = _mix(layer.delta.to(_F64).reshape(B, C, -1), M)
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
            else:
                pa = None if patches is None else patches.get(i)
                a = ((pa.to(dtype) if pa is not None else conv_patches(mod, a.to(dtype)))
                     if layer.weight_name is not None else
                     torch.zeros((B, d.reshape(B, K, blk.out, -1).shape[-1], 0),
                                 dtype=dtype, device=d.device))
                d = d.reshape(B, K, blk.out, -1)
            out.append((_with_bias(a, layer.weight_name is not None,
                                   layer.bias_name is not None), d))
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
