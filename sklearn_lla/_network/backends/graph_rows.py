"""The Jacobian rows of the graph backend (:class:`GraphRows`): factored ``nn.Linear``
blocks and dense blocks of the other layers, with their Grams and products.

See :mod:`sklearn_lla._network.backends.graph` for how the rows are made.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..structured.jacobian import LayerFactor, StructuredJacobian, _to_f64
from .base import DenseRows, Rows, _factored_self_gram, flat_directions, gram64

__all__ = ["GraphRows", "DIAG_BLOCK_ELEMENTS"]

_F64 = torch.float64


#: Elements of the dense rows converted to float64 at once by
#: :meth:`GraphRows.diag_blocks`.
DIAG_BLOCK_ELEMENTS = 2**18


class GraphRows(Rows):
    """Jacobian rows of a :class:`GraphBackend` network: factored ``nn.Linear`` blocks
    (a :class:`StructuredJacobian`) and dense blocks for the other layers.

    Parameters
    ----------
    factors : StructuredJacobian or None
        The factored blocks.
    dense : Tensor of shape (n_rows, p_dense) or None
        The other blocks, columns ``dense_names`` in order, each flattened.
    dense_names : list of str
        The parameters of ``dense``.
    rows_per_point : int
        Consecutive rows per point.
    lin : LinearizedNet
        The network (parameter layout).
    output : Tensor of shape (n_points, C)
        The network's outputs at the points.
    """

    def __init__(self, factors, dense, dense_names, rows_per_point, lin, output):
        self.factors = factors
        self.D = dense
        self.dense_names = list(dense_names)
        self.rows_per_point = int(rows_per_point)
        self.output = output
        self.n_points = int(output.shape[0])
        self.n_rows = self.n_points * self.rows_per_point
        self._lin = lin

    def __len__(self) -> int:
        return self.n_rows

    def _dense_numels(self) -> list[int]:
        return [self._lin.params[n].numel() for n in self.dense_names]

    def _columns(self, flat: Tensor, names) -> dict:
        """The last dimension of ``flat`` cut into ``names``' parameters, in order."""
        out, start = {}, 0
        for n in names:
            size = self._lin.params[n].numel()
            out[n] = flat[..., start:start + size]
            start += size
        return out

    def _pair(self, other, differentiable):
        if isinstance(other, DenseRows):  # rows of the generic fallback
            a = _to_f64(self.dense()) if differentiable else self.dense().to(_F64)
            return a @ (_to_f64(other.R) if differentiable else other.R.to(_F64)).T
        G = None
        if self.factors is not None:
            if differentiable:
                G = self.factors.cross_gram(other.factors)
            elif other is self:
                G = _factored_self_gram(self.factors)
            else:
                G = self.factors.gram(other.factors)
        if self.D is not None:
            if differentiable:
                a = _to_f64(self.D)
                DD = a @ (a if other is self else _to_f64(other.D)).T
                G = DD if G is None else G + DD
            else:
                DD = gram64(self.D, None if other is self else other.D)
                G = DD if G is None else G.add_(DD)  # (a fresh float64 product)
        return G

    def gram(self, other=None) -> Tensor:
        """``R_self R_other^T``, float64.

        Parameters
        ----------
        other : GraphRows, optional
            Defaults to ``self``.

        Returns
        -------
        Tensor of shape (n_rows_self, n_rows_other), dtype float64
        """
        return self._pair(self if other is None else other, False)

    def cross_gram(self, other=None) -> Tensor:
        """:meth:`gram` built from out-of-place operations (autograd flows through).

        Parameters
        ----------
        other : GraphRows, optional
            Defaults to ``self``.

        Returns
        -------
        Tensor of shape (n_rows_self, n_rows_other), dtype float64
        """
        return self._pair(self if other is None else other, True)

    def diag_blocks(self) -> Tensor:
        """Per-point blocks of :meth:`gram`.

        Returns
        -------
        Tensor of shape (n_points, rows_per_point, rows_per_point), dtype float64
        """
        out = None if self.factors is None else self.factors.diag_blocks()
        if self.D is not None:
            B, k = self.n_points, self.rows_per_point
            J = self.D.view(B, k, -1)
            # float64 copies of a few points' rows at a time (cache-sized)
            step = max(1, DIAG_BLOCK_ELEMENTS // max(1, k * J.shape[-1]))
            blk = torch.empty((B, k, k), dtype=_F64, device=J.device)
            for s in range(0, B, step):
                Js = J[s:s + step].to(_F64)
                torch.bmm(Js, Js.transpose(1, 2), out=blk[s:s + step])
            out = blk if out is None else out + blk
        return out

    def vjp(self, U: Tensor) -> dict:
        """``R^T U`` per parameter.

        Parameters
        ----------
        U : Tensor of shape (n_rows, K)

        Returns
        -------
        dict of str to Tensor of shape (K, *param_shape)
        """
        lin = self._lin
        res = {} if self.factors is None else dict(self.factors.vjp(U))
        if self.D is not None:
            flat = U.to(self.D.dtype).T @ self.D  # (K, p_dense)
            for n, c in self._columns(flat, self.dense_names).items():
                res[n] = c.reshape(-1, *lin.params[n].shape)
        return {n: res[n] for n in lin.names}

    def dense_directions(self, V: dict) -> Tensor:
        """``V``'s entries of the dense blocks, ``(K, p_dense)`` in their dtype: what
        :meth:`matmul` multiplies them with (made once for many chunks of rows of the
        same network, :meth:`GraphBackend.jvp`).

        Parameters
        ----------
        V : dict of str to Tensor of shape (K, *param_shape)
            Missing names count as 0.

        Returns
        -------
        Tensor of shape (K, p_dense)
        """
        return flat_directions(V, self.dense_names, self._dense_numels(), self.D.dtype,
                               self.D.device)

    def matmul(self, V: dict, flat: Tensor | None = None) -> Tensor:
        """``R V``.

        Parameters
        ----------
        V : dict of str to Tensor of shape (K, *param_shape)
            Missing names count as 0.
        flat : Tensor of shape (K, p_dense), optional
            :meth:`dense_directions` of ``V`` when already made (rows of the same
            dense parameters).

        Returns
        -------
        Tensor of shape (n_rows, K)
        """
        K = next(iter(V.values())).shape[0]
        out = None
        if self.factors is not None and any(n in V for n in self.factors.param_names):
            out = self.factors.matmul(V)
        if self.D is not None:
            if flat is None:
                flat = self.dense_directions(V)
            # (flat D^T)^T: the product with the K directions on the left is the faster
            # layout of the same GEMM (measured on CPU: 15-25 % at K = 65 to 130)
            z = (flat @ self.D.T).T
            out = z.contiguous() if out is None else out + z
        if out is None:
            out = torch.zeros(self.n_rows, K, dtype=self._lin.dtype, device=self._lin.device)
        return out

    def weighted_sq_norms(self, w: dict) -> Tensor:
        """``sum_p R_rp^2 w_kp`` per row and weight vector: the factored layers from
        their factors, the dense blocks from their squares.

        Parameters
        ----------
        w : dict of str to Tensor of shape (K, *param_shape)
            Missing names count as 0.

        Returns
        -------
        Tensor of shape (n_rows, K), dtype float64
        """
        K = next(iter(w.values())).shape[0]
        dev = next(iter(w.values())).device
        out = torch.zeros(self.n_rows, K, dtype=_F64, device=dev)
        if self.factors is not None and any(n in w for n in self.factors.param_names):
            out += self.factors.weighted_sq_norms(w)
        if self.D is not None:
            flat = flat_directions(w, self.dense_names, self._dense_numels(), _F64, dev)
            D = self.D.to(_F64)
            out += (D * D) @ flat.T
        return out

    def mixed_sq_colsum(self, M: Tensor) -> dict:
        """Per parameter entry ``sum_b sum_j (sum_c M_bjc R_(b,c))^2``, float64.

        Parameters
        ----------
        M : Tensor of shape (n_points, J, rows_per_point)

        Returns
        -------
        dict of str to Tensor of shape param_shape
        """
        res = {} if self.factors is None else dict(self.factors.mixed_sq_colsum(M))
        if self.D is not None:
            D = self.D.to(_F64).view(self.n_points, self.rows_per_point, -1)
            G = M.to(_F64) @ D
            for n, c in self._columns((G * G).sum((0, 1)), self.dense_names).items():
                res[n] = c.view(self._lin.params[n].shape)
        return {n: res[n] for n in self._lin.names}

    def dense(self) -> Tensor:
        """The explicit rows, columns in the network's parameter order.

        Returns
        -------
        Tensor of shape (n_rows, P)
        """
        blocks = {}
        if self.factors is not None:
            blocks.update(self._columns(self.factors.dense(), self.factors.param_names))
        if self.D is not None:
            blocks.update(self._columns(self.D, self.dense_names))
        return torch.cat([blocks[n] for n in self._lin.names], dim=1)


def _cat_rows(parts: list[GraphRows], D: Tensor | None, lin) -> GraphRows:
    """The rows of consecutive chunks of points as one :class:`GraphRows` (their dense
    blocks already gathered in ``D``)."""
    first = parts[0]
    output = torch.cat([p.output for p in parts])
    sj = None
    if first.factors is not None:
        layers = [LayerFactor(torch.cat([p.factors.layers[j].delta for p in parts]),
                              torch.cat([p.factors.layers[j].act for p in parts]),
                              f.weight_name, f.bias_name)
                  for j, f in enumerate(first.factors.layers)]
        sj = StructuredJacobian(layers, first.rows_per_point, first.factors.param_names,
                                output)
    return GraphRows(sj, D, first.dense_names, first.rows_per_point, lin, output)
