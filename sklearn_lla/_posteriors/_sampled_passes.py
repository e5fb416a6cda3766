"""Sampled LLA's row-sum passes (:meth:`FitData.reduce` functions, module level so that
dask workers can run them) and the sample covariance; see
:mod:`sklearn_lla._posteriors.sampled`."""

from __future__ import annotations

import torch

from .._core.likelihoods import uses_mc_link
from .._network.backends.base import device_budget
from .._network.linearized import stack_flat

_F64 = torch.float64

#: Tensor elements of Jacobian rows one fit keeps (:class:`BatchRows`; CPU figure,
#: scaled on a GPU by :func:`~sklearn_lla._network.backends.base.device_budget`):
#: 512 MB of float32 rows. Batches beyond it are recomputed in every pass.
ROW_STORE_ELEMENTS = 2**27


def _add_flat(out: torch.Tensor | None, parts: dict, lin) -> torch.Tensor:
    """``out += stack_flat(parts)`` in float64, parameter by parameter (no flat copy in
    the network's dtype, no separate cast); a new float64 (K, P) tensor when ``out`` is
    ``None``."""
    K = parts[lin.names[0]].shape[0]
    if out is None:
        out = torch.empty((K, lin.n_params), dtype=_F64, device=parts[lin.names[0]].device)
        fill = True
    else:
        fill = False
    start = 0
    for n in lin.names:
        blk = parts[n].reshape(K, -1)
        dst = out[:, start:start + blk.shape[1]]
        dst.copy_(blk) if fill else dst.add_(blk)
        start += blk.shape[1]
    return out


class BatchRows:
    """The Jacobian rows of one fit's training batches, made once and reused by its
    data passes (the perturbations, the Nystrom sketch, every conjugate-gradient
    iteration, the statistics).

    Only for a backend whose rows are cheaper to multiply than to recompute and
    compact enough to keep (the graph backend: per-layer factors, dense blocks only
    for the small convolutional / BatchNorm layers), and only for in-memory data (a
    dask pass runs on the workers). A kept batch's pass costs two matrix products
    (``J V`` and ``J^T U``, in the network's dtype, as the backend's own
    :meth:`jvp` / :meth:`vjp` compute them from the same rows) instead of a forward
    pass, a batched backward pass and the rows' assembly, twice. Rows are made in the
    backend's chunks of points (:meth:`GraphBackend.kernel_step`), so that a batch
    that is not kept (past :data:`ROW_STORE_ELEMENTS`) holds one chunk at a time and
    a GGN product (:meth:`ggn_product`) makes its rows once per pass, not once for
    the JVP and once for the VJP. The store lives as long as the fit that made it
    (never shared between estimators).

    Parameters
    ----------
    lin : LinearizedNet
        The network.
    n_outputs : int
        ``C``.
    budget : int
        Most tensor elements kept.
    """

    def __init__(self, lin, n_outputs: int, budget: int) -> None:
        self.lin = lin
        self.n_outputs = int(n_outputs)
        self.budget = int(budget)
        self.held = 0
        self._rows: dict[int, list] = {}

    @classmethod
    def for_fit(cls, data) -> BatchRows | None:
        """A store for ``data``'s batches, or ``None`` where the backend's own products
        are used (any backend but the graph one, or dask data)."""
        if data.is_dask or getattr(data.lin, "backend", None) != "graph":
            return None
        return cls(data.lin, data.n_outputs, device_budget(ROW_STORE_ELEMENTS, data.device))

    @staticmethod
    def _elements(R) -> int:
        n = 0 if R.D is None else R.D.numel()
        if R.factors is not None:
            n += sum(f.delta.numel() + f.act.numel() for f in R.factors.layers)
        return n + R.output.numel()

    def chunks(self, i: int, x: torch.Tensor):
        """Batch ``i``'s rows chunk by chunk, made at its first use.

        Parameters
        ----------
        i : int
            The batch's position in :meth:`FitData.batches` (same batch size).
        x : Tensor of shape (B, ...)
            Its inputs.

        Yields
        ------
        start : int
            The chunk's first point in the batch.
        rows : GraphRows
            Its rows (all outputs, rows ``b * C + c``).
        """
        kept = self._rows.get(i)
        if kept is not None and sum(R.n_points for _, R in kept) == x.shape[0]:
            yield from kept
            return
        step = self.lin.jacobian_backend.kernel_step(self.n_outputs)
        parts, n = ([] if kept is None else None), 0
        for s in range(0, x.shape[0], step):
            R = self.lin.rows(x[s:s + step])
            if parts is not None:
                n += self._elements(R)
                parts = parts + [(s, R)] if self.held + n <= self.budget else None
            yield s, R
        if parts is not None:
            self._rows[i] = parts
            self.held += n

    def _dense_view(self, R, T: torch.Tensor):
        """The directions ``R``'s dense block multiplies, as columns of the flat tangents
        ``T`` (K, P) with no copy: when ``T`` is in the block's dtype and its parameters
        are one run of the flat layout (in order); ``None`` otherwise (``R.matmul``
        then gathers them, once per chunk)."""
        if R.D is None or T.dtype != R.D.dtype or not R.dense_names:
            return None
        names, dense = self.lin.names, R.dense_names
        j = names.index(dense[0])
        if names[j:j + len(dense)] != dense:
            return None
        a = sum(self.lin.params[n].numel() for n in names[:j])
        return T[:, a:a + R.D.shape[1]]

    def output(self, i: int, x: torch.Tensor) -> torch.Tensor:
        """The network's outputs at batch ``i`` (B, C)."""
        return torch.cat([R.output for _, R in self.chunks(i, x)])

    def tangents(self, T: torch.Tensor) -> dict:
        """Flat tangents ``T`` (K, P) as the per-parameter dict in the network's dtype
        that :meth:`jvp` and :meth:`ggn_product` take (made once per pass)."""
        return self.lin.unflatten(T.to(self.lin.dtype))

    def jvp(self, i: int, x: torch.Tensor, T: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(g, J T)`` of batch ``i`` as :meth:`LinearizedNet.jvp` for tangents ``T`` (K, P)."""
        lin, K = self.lin, T.shape[0]
        T = T.to(lin.dtype)
        Td = lin.unflatten(T)
        gs, jts = [], []
        for _, R in self.chunks(i, x):
            gs.append(R.output)
            jts.append(R.matmul(Td, self._dense_view(R, T)).view(R.n_points, -1, K))
        return torch.cat(gs), torch.cat(jts)

    def vjp(self, i: int, x: torch.Tensor, cot: torch.Tensor) -> torch.Tensor:
        """``sum_b J_b^T u_k[b]`` of batch ``i`` for cotangents ``(K, B, C)``: flat
        (K, P), float64 (the chunks' products, in the network's dtype, added in float64)."""
        lin, K = self.lin, cot.shape[0]
        out = None
        for s, R in self.chunks(i, x):
            U = cot[:, s:s + R.n_points].to(lin.dtype).permute(1, 2, 0).reshape(-1, K)
            out = _add_flat(out, R.vjp(U), lin)
        return out

    def ggn_product(self, i: int, x: torch.Tensor, T: torch.Tensor, lik, out=None,
                    Td: dict | None = None) -> torch.Tensor:
        """``sum_b J_b^T Lam_b J_b t_k`` over batch ``i`` for tangents ``T`` (K, P):
        float64 (K, P), each chunk's rows used for both of its products; added to
        ``out`` when given. ``Td``: :meth:`tangents` of ``T``, when already made."""
        lin, K = self.lin, T.shape[0]
        Td = self.tangents(T) if Td is None else Td
        for _, R in self.chunks(i, x):
            b = R.n_points
            jt = R.matmul(Td, self._dense_view(R, T)).view(b, -1, K)
            A = lik.lam_factor(R.output.to(_F64))
            ajt = torch.einsum("bcd,bck->bdk", A, jt.to(_F64))
            U = torch.einsum("bcd,bdk->bck", A, ajt).to(lin.dtype).reshape(-1, K)
            out = _add_flat(out, R.vjp(U), lin)
        return out


class BackendProducts:
    """The backend's own products per call, with :class:`BatchRows`' methods (nothing
    kept; the batch index is ignored).

    Parameters
    ----------
    lin : LinearizedNet
        The network.
    """

    def __init__(self, lin) -> None:
        self.lin = lin

    def output(self, i: int, x: torch.Tensor) -> torch.Tensor:
        """:meth:`LinearizedNet.forward`."""
        return self.lin.forward(x)

    def jvp(self, i: int, x: torch.Tensor, T: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`LinearizedNet.jvp`."""
        return self.lin.jvp(x, T)

    def vjp(self, i: int, x: torch.Tensor, cot: torch.Tensor) -> torch.Tensor:
        """:meth:`LinearizedNet.vjp`, flat (K, P) float64."""
        return stack_flat(self.lin.vjp(x, cot), self.lin.names).to(_F64)

    def tangents(self, T: torch.Tensor) -> None:
        """Nothing to prepare (:meth:`LinearizedNet.jvp` takes flat tangents)."""
        return None

    def ggn_product(self, i: int, x: torch.Tensor, T: torch.Tensor, lik, out=None,
                    Td=None) -> torch.Tensor:
        """``sum_b J_b^T Lam_b J_b t_k`` over the batch: one JVP, one VJP (float64),
        added to ``out`` when given."""
        g, jt = self.lin.jvp(x, T)
        A = lik.lam_factor(g.to(_F64))
        ajt = torch.einsum("bcd,bck->bdk", A, jt.to(_F64))
        part = self.vjp(i, x, torch.einsum("bcd,bdk->kbc", A, ajt))
        return part if out is None else out.add_(part)


def scaled_tangents(V: torch.Tensor, sigma: torch.Tensor, dtype,
                    rows: int = 8) -> torch.Tensor:
    """``(V * sigma).to(dtype)`` for tangents ``V`` (M, P), made ``rows`` rows at a time.

    The product is taken in ``V``'s dtype (float64) and rounded to ``dtype`` row block
    by row block: the same values as the one-shot expression without its (M, P)
    temporary in ``V``'s dtype. ``V`` may be a strided view (a transposed sketch); the
    result is contiguous.
    """
    out = torch.empty(V.shape, dtype=dtype, device=V.device)
    for i in range(0, V.shape[0], rows):
        out[i:i + rows] = V[i:i + rows] * sigma
    return out


def products(lin, store: BatchRows | None):
    """``store``, or the backend's own products (:class:`BackendProducts`) without one."""
    return BackendProducts(lin) if store is None else store


def _sample_cov(jz: torch.Tensor) -> torch.Tensor:
    """``(1/K) sum_k (J z_k)(J z_k)^T`` per point from ``jz`` of shape (B, C, K)."""
    return torch.einsum("bck,bdk->bcd", jz, jz) / jz.shape[-1]


def _ggn_diag_sums(payload, batches):
    """``(diag(sum_n J_n^T Lam_n J_n),)`` over ``batches`` from Jacobian rows (float64)."""
    lin, lik, n_outputs = payload
    d = torch.zeros(lin.n_params, dtype=_F64, device=lin.device)
    for x, _ in batches:
        for sl, J in lin.jacobian_chunks(x, n_outputs):
            A = lik.lam_factor(lin.forward(x[sl]).to(_F64))
            d += torch.einsum("bcd,bcp->bdp", A, J.to(_F64)).pow(2).sum((0, 1))
    return (d,)


def _ggn_product_sums(payload, batches):
    """``(sum_n J_n^T Lam_n J_n t_m for every tangent t_m,)`` over ``batches``.

    ``payload = (lin, lik, T)`` or ``(lin, lik, T, store)``, ``T`` of shape (M, P),
    ``store`` a :class:`BatchRows` or ``None``; returns a float64 (M, P) tensor. The
    matrix-vector product of the E-step's conjugate gradients: one JVP with ``M``
    tangents and one VJP with ``M`` cotangents per batch (from the batch's kept rows
    with a ``store``).
    """
    lin, lik, T = payload[:3]
    ops = products(lin, payload[3] if len(payload) > 3 else None)
    Td = ops.tangents(T)  # (the network's dtype, once per pass)
    out = None
    for i, (x, _) in enumerate(batches):
        out = ops.ggn_product(i, x, T, lik, out, Td)
    return (torch.zeros(T.shape, dtype=_F64, device=T.device) if out is None else out,)


def _statistics_sums(payload, batches):
    """``(q, rss)`` over ``batches``: ``q_k = sum_n |A_n^T J_n z_k|^2`` for every sample
    (their mean is the effective dimension ``gamma``) and the residual sum of squares of
    the linear model's mode (regression). ``payload = (lin, lik, delta, Z, regression)``
    and optionally a :class:`BatchRows` store."""
    lin, lik, delta, Z, regression = payload[:5]
    ops = products(lin, payload[5] if len(payload) > 5 else None)
    T = torch.cat([delta[None], Z])
    q = torch.zeros(Z.shape[0], dtype=_F64, device=Z.device)
    rss = 0.0
    for i, (x, y) in enumerate(batches):
        g, jt = ops.jvp(i, x, T)
        g, jt = g.to(_F64), jt.to(_F64)
        A = lik.lam_factor(g)
        q += torch.einsum("bcd,bck->bdk", A, jt[..., 1:]).pow(2).sum((0, 1))
        if regression:
            rss += float((y - g - jt[..., 0]).pow(2).sum())
    return q, rss


def _validation_nll_sums(payload, batches):
    """Row sums of the validation NLL of the samples, for each rescaling factor ``c``.

    Regression: the samples for ``(c s0^2, c s2)`` are ``sqrt(c)`` times those for
    ``(s0^2, s2)`` (same draws), so the predictive is ``N(g, c (cov + s2))`` exactly;
    classification has ``factors = [1]``. Returns ``(sums (len(factors),), rows)``.
    """
    lin, Z, lik, regression, factors, s2_ref, seed = payload
    mc = uses_mc_link(lik)
    gen = torch.Generator().manual_seed(seed) if mc else None
    out = torch.zeros(len(factors), dtype=_F64)
    n = 0
    for x, y in batches:
        g, jz = lin.jvp(x, Z)
        g, cov = g.to(_F64), _sample_cov(jz.to(_F64))
        eps = None
        if mc:
            eps = torch.randn((lik.n_samples, *g.shape), dtype=_F64, generator=gen).to(g.device)
        for j, c in enumerate(factors):
            lk = lik.with_noise(c * s2_ref) if regression else lik
            out[j] -= float(lk.log_predictive(g, c * cov, y, eps=eps).sum())
        n += g.shape[0]
    return out, n
