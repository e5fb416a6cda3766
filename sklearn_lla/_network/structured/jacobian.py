"""Factored Jacobian rows of a chain of linear layers, and their exact algebra.

For a linear layer ``h = W a + b`` the gradient of any scalar output with respect to
``W`` is the outer product ``delta a^T`` with ``delta = d output / d h``, and the
gradient with respect to ``b`` is ``delta``. Two Jacobian rows ``r = (x, o)`` and
``r' = (x', o')`` therefore have the inner product

.. math::

    \\langle J_r, J_{r'} \\rangle = \\sum_l (\\delta_l(r) \\cdot \\delta_l(r'))
        ([W_l] \\, a_l(x) \\cdot a_l(x') + [b_l]),

where ``[W_l]`` / ``[b_l]`` is 1 when that parameter is among the linearised ones.
Gram matrices, row norms, ``J^T U`` and ``J V`` are computed from the per-layer
activations ``a_l`` (one per point) and back-propagated ``delta_l`` (one per row)
without ever forming a per-example Jacobian (VaLLA thesis, appendix "Efficient
Kernel Computation for MLP"). Gram matrices and row norms are accumulated in float64
whatever the network's dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["LayerFactor", "StructuredJacobian"]

#: Largest number of elements of a temporary created by :meth:`StructuredJacobian.vjp`
#: and :meth:`StructuredJacobian.matmul` before they split the ``K`` directions.
_CHUNK_ELEMENTS = 1 << 24

_F64 = torch.float64


@dataclass
class LayerFactor:
    """One linear layer's Jacobian block: rows ``delta[r] (x) a[point(r)]``.

    ``weight_name`` / ``bias_name`` is ``None`` when that parameter is not linearised
    (frozen, or outside the selected subset) or absent.
    """

    delta: Tensor  # (n_rows, out_features)
    act: Tensor  # (n_points, in_features)
    weight_name: str | None
    bias_name: str | None

    @property
    def has_weight(self) -> bool:
        return self.weight_name is not None

    @property
    def has_bias(self) -> bool:
        return self.bias_name is not None

    @property
    def n_params(self) -> int:
        o, i = self.delta.shape[1], self.act.shape[1]
        return o * i * self.has_weight + o * self.has_bias

    def signature(self) -> tuple:
        return (self.weight_name, self.bias_name, self.delta.shape[1], self.act.shape[1])


class _FlushingCast(torch.autograd.Function):
    """``t.to(float64)`` whose backward flushes subnormal gradient entries to zero."""

    @staticmethod
    def forward(ctx, t):
        ctx.dtype = t.dtype
        return t.to(_F64)

    @staticmethod
    def backward(ctx, grad):
        tiny = torch.finfo(ctx.dtype).tiny
        return grad.masked_fill(grad.abs() < tiny, 0.0).to(ctx.dtype)


def _to_f64(t: Tensor) -> Tensor:
    """``t`` in float64; gradients back to a lower precision skip subnormals."""
    if t.dtype == _F64:
        return t
    if t.requires_grad:
        return _FlushingCast.apply(t)
    return t.to(_F64)


def _act_sq_norm(act: Tensor, has_weight: bool, has_bias: bool) -> Tensor | float:
    """``[W] |a(x)|^2 + [b]`` per point: the input side of a row's squared norm."""
    if not has_weight:
        return 1.0
    an = act.pow(2).sum(-1)
    return an + 1.0 if has_bias else an


class StructuredJacobian:
    """Compact, exact representation of Jacobian rows of a :class:`StructuredChain`.

    Row ``r`` belongs to point ``r // rows_per_point``; the block of the row for the
    weight of linear layer ``l`` is ``delta_l[r] (outer) a_l[point]`` and the block for
    its bias is ``delta_l[r]``. Only the layers holding linearised parameters appear.

    Parameters
    ----------
    layers : list of LayerFactor
        Per linear layer: ``delta`` of shape ``(n_rows, out_l)``, ``act`` of shape
        ``(n_points, in_l)``, and the names of its linearised weight and bias.
    rows_per_point : int
        Number of consecutive rows per point (``C`` for all outputs, 1 for one
        selected output per point).
    param_names : list of str
        The linearised parameter names, in ``module.named_parameters()`` order: the
        columns of the Jacobian.
    output : Tensor of shape (n_points, C)
        Network output at the points.

    Attributes
    ----------
    n_rows, n_points : int
        Number of rows and of points.
    """

    def __init__(
        self,
        layers: list[LayerFactor],
        rows_per_point: int,
        param_names: list[str],
        output: Tensor,
    ) -> None:
        if not layers:
            raise ValueError("a StructuredJacobian needs at least one layer")
        self.layers = layers
        self.rows_per_point = int(rows_per_point)
        self.param_names = list(param_names)
        self.output = output
        self.n_points = int(layers[0].act.shape[0])
        self.n_rows = int(layers[0].delta.shape[0])
        if self.n_rows != self.n_points * self.rows_per_point:
            raise ValueError("inconsistent numbers of rows and points")
        self._where: dict[str, tuple[int, str]] = {}
        for i, layer in enumerate(layers):
            if layer.weight_name is not None:
                self._where[layer.weight_name] = (i, "weight")
            if layer.bias_name is not None:
                self._where[layer.bias_name] = (i, "bias")
        if set(self._where) != set(self.param_names):
            raise ValueError("param_names do not match the layers' parameters")

    def __len__(self) -> int:
        return self.n_rows

    @property
    def n_params(self) -> int:
        """Number of linearised parameters (columns of the Jacobian)."""
        return sum(layer.n_params for layer in self.layers)

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the factors (the network's)."""
        return self.layers[0].delta.dtype

    @property
    def device(self) -> torch.device:
        """The device of the factors."""
        return self.layers[0].delta.device

    def _check_compatible(self, other: StructuredJacobian) -> None:
        if len(self.layers) != len(other.layers) or any(
            a.signature() != b.signature() for a, b in zip(self.layers, other.layers)
        ):
            raise ValueError("the two StructuredJacobians come from different networks")

    def _factors64(self) -> list[tuple[Tensor, Tensor]]:
        """``(delta, act)`` of every layer in float64 (no copy for a float64 network)."""
        return [(layer.delta.to(_F64), layer.act.to(_F64)) for layer in self.layers]

    # -- kernel algebra -------------------------------------------------------------

    def gram(self, other: StructuredJacobian | None = None) -> Tensor:
        """Exact cross-Gram matrix ``J_self @ J_other^T``, in float64.

        Parameters
        ----------
        other : StructuredJacobian, optional
            Rows of the same network; defaults to ``self``.

        Returns
        -------
        Tensor of shape (n_rows_self, n_rows_other), dtype float64
            The inner products of the rows.
        """
        if other is None:
            other = self
        self._check_compatible(other)
        B1, k1 = self.n_points, self.rows_per_point
        B2, k2 = other.n_points, other.rows_per_point
        fa = self._factors64()
        fb = fa if other is self else other._factors64()
        G = None
        for layer, (da, aa), (db, ab) in zip(self.layers, fa, fb):
            DD = da @ db.T  # (n1, n2)
            if layer.has_weight:
                K = aa @ ab.T  # (B1, B2)
                if layer.has_bias:
                    K += 1.0
                if k1 == 1 and k2 == 1:
                    DD.mul_(K)
                else:
                    DD = DD.view(B1, k1, B2, k2).mul_(K[:, None, :, None]).view(B1 * k1, B2 * k2)
            G = DD if G is None else G.add_(DD)
        return G

    def cross_gram(self, other: StructuredJacobian | None = None) -> Tensor:
        """Differentiable cross-Gram matrix ``J_self @ J_other^T``, in float64.

        The autograd twin of :meth:`gram` (which works in place and builds no graph):
        out-of-place operations only, so gradients flow to whichever factors require
        them (e.g. factors built with ``differentiable=True`` at inducing inputs that
        are being learned). The factors are cast to float64 before each layer's two
        products (the sums over the layer's width accumulate in float64); on the way
        back, gradient entries below the smallest
        normal number of a float32 (or float16) factor are flushed to zero before
        the cast (subnormal operands slow a CPU matrix product down by two orders of
        magnitude, and such entries are below that dtype's resolution anyway).

        Parameters
        ----------
        other : StructuredJacobian, optional
            Rows of the same network; defaults to ``self``.

        Returns
        -------
        Tensor of shape (n_rows_self, n_rows_other), dtype float64
            The inner products of the rows.
        """
        if other is None:
            other = self
        self._check_compatible(other)
        B1, k1 = self.n_points, self.rows_per_point
        B2, k2 = other.n_points, other.rows_per_point
        G = None
        for la, lb in zip(self.layers, other.layers):
            # accumulate the inner products over the layer's width in float64: a float32
            # sum leaves relative errors of ~1e-7 sqrt(width) in every kernel entry,
            # which an inverse of a near-singular inducing Gram matrix amplifies
            DD = _to_f64(la.delta) @ _to_f64(lb.delta).T  # (B1 k1, B2 k2)
            if la.has_weight:
                K = _to_f64(la.act) @ _to_f64(lb.act).T  # (B1, B2)
                if la.has_bias:
                    K = K + 1.0
                if k1 == 1 and k2 == 1:
                    DD = DD * K
                else:
                    DD = (DD.view(B1, k1, B2, k2) * K[:, None, :, None]).reshape(B1 * k1,
                                                                               B2 * k2)
            G = DD if G is None else G + DD
        return G

    def diag(self) -> Tensor:
        """Squared norms of the rows (diagonal of :meth:`gram`), in float64.

        Returns
        -------
        Tensor of shape (n_rows,), dtype float64
            The squared row norms.
        """
        B, k = self.n_points, self.rows_per_point
        out = None
        for layer, (d, a) in zip(self.layers, self._factors64()):
            an = _act_sq_norm(a, layer.has_weight, layer.has_bias)
            dn = d.pow(2).sum(-1).view(B, k)
            dn = dn * (an[:, None] if isinstance(an, Tensor) else an)
            out = dn if out is None else out.add_(dn)
        return out.reshape(-1)

    def diag_blocks(self) -> Tensor:
        """Per-point blocks of :meth:`gram` (the rows of one point against each other).

        Returns
        -------
        Tensor of shape (n_points, rows_per_point, rows_per_point), dtype float64
            One block per point.
        """
        B, k = self.n_points, self.rows_per_point
        out = None
        for layer, (d, a) in zip(self.layers, self._factors64()):
            d = d.view(B, k, -1)
            blk = d @ d.transpose(1, 2)
            an = _act_sq_norm(a, layer.has_weight, layer.has_bias)
            blk = blk.mul_(an[:, None, None]) if isinstance(an, Tensor) else blk
            out = blk if out is None else out.add_(blk)
        return out

    def vjp(self, U: Tensor) -> dict[str, Tensor]:
        """Compute ``J^T U`` per parameter, never forming Jacobian rows.

        Parameters
        ----------
        U : Tensor of shape (n_rows, K)
            ``K`` weight vectors over the rows.

        Returns
        -------
        dict
            ``{name: Tensor of shape (K, *param.shape)}`` in :attr:`param_names` order.
        """
        if U.ndim != 2 or U.shape[0] != self.n_rows:
            raise ValueError(f"U must have shape ({self.n_rows}, K), got {tuple(U.shape)}")
        B, k = self.n_points, self.rows_per_point
        Kdim = U.shape[1]
        dtype, device = self.dtype, self.device
        Ub = U.to(dtype).view(B, k, Kdim)
        res: dict[str, Tensor] = {}
        for layer in self.layers:
            o, i = layer.delta.shape[1], layer.act.shape[1]
            D = layer.delta.view(B, k, o)
            gw = torch.empty(Kdim, o, i, dtype=dtype, device=device) if layer.has_weight else None
            gb = torch.empty(Kdim, o, dtype=dtype, device=device) if layer.has_bias else None
            step = max(1, _CHUNK_ELEMENTS // max(1, B * o))
            for s in range(0, Kdim, step):
                T = Ub[:, :, s : s + step].transpose(1, 2) @ D  # (B, Kc, o)
                Kc = T.shape[1]
                if gw is not None:  # sum_b T[b, kc, o] a[b, i]
                    gw[s : s + Kc] = (T.reshape(B, Kc * o).T @ layer.act).view(Kc, o, i)
                if gb is not None:
                    gb[s : s + Kc] = T.sum(0)
            if gw is not None:
                res[layer.weight_name] = gw
            if gb is not None:
                res[layer.bias_name] = gb
        return {name: res[name] for name in self.param_names}

    def weighted_sq_norms(self, w: dict[str, Tensor]) -> Tensor:
        """``sum_p R_rp^2 w_kp`` per row and weight vector, float64, from the factors.

        For a linear layer ``sum_oi delta_o^2 W_oi a_i^2 = (delta^2)^T W (a^2)``: no row
        is formed.

        Parameters
        ----------
        w : dict
            ``{name: Tensor of shape (K, *param.shape)}``; missing names count as 0.

        Returns
        -------
        Tensor of shape (n_rows, K), dtype float64
        """
        K = next(iter(w.values())).shape[0]
        B, k = self.n_points, self.rows_per_point
        out = torch.zeros(self.n_rows, K, dtype=_F64, device=self.device)
        for layer in self.layers:
            d2 = layer.delta.to(_F64) ** 2  # (B k, out)
            if layer.has_weight and layer.weight_name in w:
                a2 = layer.act.to(_F64) ** 2  # (B, in)
                t = torch.einsum("ro,koi->rki", d2, w[layer.weight_name].to(_F64))
                out += (t.view(B, k, K, -1) * a2[:, None, None, :]).sum(-1).reshape(-1, K)
            if layer.has_bias and layer.bias_name in w:
                out += d2 @ w[layer.bias_name].to(_F64).reshape(K, -1).T
        return out

    def mixed_sq_colsum(self, M: Tensor) -> dict[str, Tensor]:
        """``sum_b sum_j (sum_c M_bjc R_(b,c))^2`` per parameter entry, from the factors.

        Mixing a point's rows mixes only their ``delta``.

        Parameters
        ----------
        M : Tensor of shape (n_points, J, rows_per_point)

        Returns
        -------
        dict
            ``{name: Tensor of shape param.shape}``, float64, :attr:`param_names` order.
        """
        B, k = self.n_points, self.rows_per_point
        M = M.to(_F64)
        parts = {}
        for layer in self.layers:
            d = torch.einsum("bjc,bco->bjo", M, layer.delta.to(_F64).view(B, k, -1))
            d2 = (d * d).sum(1)  # (B, out)
            if layer.has_weight:
                parts[layer.weight_name] = d2.T @ (layer.act.to(_F64) ** 2)
            if layer.has_bias:
                parts[layer.bias_name] = d2.sum(0)
        return {n: parts[n] for n in self.param_names}

    def matmul(self, V: dict[str, Tensor]) -> Tensor:
        """Compute ``J @ V`` for directions ``V`` in parameter space, layer by layer.

        Parameters
        ----------
        V : dict
            ``{name: Tensor of shape (K, *param.shape)}``; missing names count as 0.

        Returns
        -------
        Tensor of shape (n_rows, K)
            The products, in the network's dtype.
        """
        Kdim = next((v.shape[0] for v in V.values()), None)
        if Kdim is None:
            raise ValueError("V is empty")
        B, k = self.n_points, self.rows_per_point
        dtype = self.dtype
        out = torch.zeros(B, k, Kdim, dtype=dtype, device=self.device)
        for layer in self.layers:
            o, i = layer.delta.shape[1], layer.act.shape[1]
            VW = V.get(layer.weight_name) if layer.has_weight else None
            Vb = V.get(layer.bias_name) if layer.has_bias else None
            if VW is None and Vb is None:
                continue
            D = layer.delta.view(B, k, o)
            step = max(1, _CHUNK_ELEMENTS // max(1, B * o))
            for s in range(0, Kdim, step):
                Kc = min(step, Kdim - s)
                Z = None  # (B, o, Kc): V_W[k] @ a[b] + V_b[k]
                if VW is not None:
                    VWc = VW[s : s + Kc].to(dtype).reshape(Kc * o, i)
                    Z = (layer.act @ VWc.T).view(B, Kc, o).transpose(1, 2)
                if Vb is not None:
                    Vbc = Vb[s : s + Kc].to(dtype).reshape(Kc, o).T  # (o, Kc)
                    Z = Vbc.expand(B, o, Kc) if Z is None else Z + Vbc
                out[:, :, s : s + Kc] += D @ Z
        return out.view(B * k, Kdim)

    def dense(self) -> Tensor:
        """Form the explicit Jacobian rows (small problems and tests only).

        Returns
        -------
        Tensor of shape (n_rows, n_params)
            Columns in :attr:`param_names` order, each parameter flattened.
        """
        B, k = self.n_points, self.rows_per_point
        blocks = []
        for name in self.param_names:
            li, kind = self._where[name]
            layer = self.layers[li]
            o, i = layer.delta.shape[1], layer.act.shape[1]
            if kind == "bias":
                blocks.append(layer.delta)
            else:
                D = layer.delta.view(B, k, o, 1)
                A = layer.act.view(B, 1, 1, i)
                blocks.append((D * A).reshape(B * k, o * i))
        return torch.cat(blocks, dim=1)
