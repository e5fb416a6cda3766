"""A KFAC posterior for the parameter directions a low-rank method leaves out.

ELLA and subspace Laplace keep ``K`` directions ``Q`` (orthonormal rows, K x P) and
compute the posterior exactly inside ``span(Q)``. Outside it the exact posterior
covariance ``S = (GGN / s2 + I / s0^2)^-1`` is not the prior: at large ``N`` the
kept directions are the ones the data pin down hardest, and most of exact LLA's
epistemic variance lives in the directions left out, shrunk by the data but far
from to zero (issue 34: the top-``K`` part alone kept 0.3 - 3 % of it, the prior on
the rest 3.6 - 15 x). With ``P_perp = I - Q^T Q`` the complement's share is taken from
a Kronecker-factored (KFAC, type-2) approximation ``Sigma`` of the *full* posterior
covariance,

``S(x) ~ phi(x) S_K phi(x)^T + j_perp(x)^T Sigma j_perp(x)``,  ``j_perp = P_perp j``,

exact when ``span(Q)`` is an invariant subspace of the GGN and ``Sigma`` exact, equal
to the KFAC Laplace predictive for ``K = 0``. Expanded,

``j_perp^T Sigma j_perp = j^T Sigma j - 2 phi (Q Sigma j) + phi (Q Sigma Q^T) phi^T``:

``j^T Sigma j`` costs ``O(in^2 + out^2 + in out)`` per layer and row from the factored
Jacobian ``delta (x) a`` of a linear layer (:class:`~sklearn_lla._network.structured.
jacobian.StructuredJacobian`), ``Q Sigma j`` is one JVP with the ``K`` fixed tangents
``Sigma Q^T``. The KFAC factors are accumulated here from the same factored
Jacobians (one pass): ``A_l = mean_n abar abar^T`` (``abar = [a, 1]`` with a bias),
``G_l = sum_n sum_c (Lam_n^{1/2} delta_nc)(...)^T`` (unit noise for a Gaussian
likelihood), the GGN block ``~ G_l (x) A_l``; both are eigendecomposed once, so
``Sigma = mult * (H_unit + tau I)^-1`` for any hyperparameters (``mult = s2``,
``tau = s2 / s0^2`` in regression; ``mult = 1``, ``tau = 1 / s0^2`` in
classification) costs only new eigenvalue weights. All curvature algebra is float64.

Networks outside the structured backend (chains of ``nn.Linear`` and elementwise
maps) have no factored Jacobian; there the estimators fall back to the prior
residual (see :func:`supports_kfac_complement`).
"""

from __future__ import annotations

import torch

__all__ = ["KFACComplement", "supports_kfac_complement", "OUTSIDE_RTOL"]

_F64 = torch.float64

#: Below this fraction of the GGN's trace outside the kept span the data determine
#: nothing there (round-off of float32 features, of the dropped Nystrom eigenvalues):
#: the complement is the prior (:meth:`KFACComplement.match_trace`).
OUTSIDE_RTOL = 1e-6


def supports_kfac_complement(lin) -> bool:
    """Whether ``lin`` has factored Jacobians (the structured backend)."""
    return getattr(lin, "chain", None) is not None


def _abar(layer, act):
    """``[a, 1]`` (weight and bias), ``a`` (weight only) or ``1`` (bias only), float64."""
    parts = []
    if layer.has_weight:
        parts.append(act)
    if layer.has_bias:
        parts.append(torch.ones((act.shape[0], 1), dtype=_F64, device=act.device))
    return torch.cat(parts, dim=1)


def _kfac_pass(payload, batches):
    """Row sums of the KFAC factors: ``(sum abar abar^T per layer..., sum G per layer...,
    n_points, tr GGN)`` over ``batches`` (unit noise for a Gaussian likelihood)."""
    lin, lik = payload
    A, G, n, tr = None, None, 0, 0.0
    for x, _ in batches:
        F = lin.factored_jacobian(x)
        B, C = F.n_points, F.rows_per_point
        lam = None
        if not lik.unit_curvature:
            lam = lik.lam_factor(F.output.to(_F64))  # (B, C, C), Lam = lam lam^T
        a_sums, g_sums = [], []
        for layer in F.layers:
            a = _abar(layer, layer.act.to(_F64))
            d = layer.delta.to(_F64).reshape(B, C, -1)
            if lam is not None:
                d = torch.einsum("bck,bco->bko", lam, d)
            d = d.reshape(-1, d.shape[-1])
            a_sums.append(a.T @ a)
            g_sums.append(d.T @ d)
            tr += float((d.pow(2).sum(1).reshape(B, C).sum(1) * a.pow(2).sum(1)).sum())
        A = a_sums if A is None else [s + t for s, t in zip(A, a_sums)]
        G = g_sums if G is None else [s + t for s, t in zip(G, g_sums)]
        n += B
    return (*A, *G, n, tr)


class KFACComplement:
    """``P_perp Sigma_KFAC P_perp``: the posterior outside a kept span ``Q``.

    Parameters
    ----------
    lin : LinearizedNet
        The network (structured backend).
    data : FitData
        The training stream (one pass of factored Jacobians).
    Q : Tensor of shape (K, P) or None
        Orthonormal rows spanning the kept directions (float64); ``None``: nothing
        kept (the KFAC Laplace predictive).
    """

    def __init__(self, lin, data, Q):
        if not supports_kfac_complement(lin):
            raise ValueError("the KFAC complement needs the structured Jacobian backend")
        self.lin = lin
        self.regression = data.likelihood.task == "regression"
        bs = min(data.batch_size, 1024)
        out = data.reduce(_kfac_pass, (lin, data.likelihood), bs)
        n, self.ggn_trace = out[-2], float(out[-1])
        L = (len(out) - 2) // 2
        probe = lin.factored_jacobian(data.rows(slice(0, 1))[0])
        self.layers = [(layer.weight_name, layer.bias_name) for layer in probe.layers]
        if len(self.layers) != L:
            raise RuntimeError("internal error: KFAC factors do not match the layers")
        self.eig = []
        for A, G in zip(out[:L], out[L:2 * L]):
            la, Ua = torch.linalg.eigh(0.5 * (A + A.T) / max(n, 1))
            lg, Ug = torch.linalg.eigh(0.5 * (G + G.T))
            self.eig.append((lg.clamp_min(0.0), Ug, la.clamp_min(0.0), Ua))
        self.Q = None if Q is None or len(Q) == 0 else Q.to(_F64)
        self._cache = {}
        self.scale, self.fraction, self.outside_fraction = 1.0, 1.0, None

    # ---------------------------------------------------------------- algebra
    def _key(self, s0, s2):
        """``(mult, tau)``: ``Sigma = mult * (H_unit + tau I)^-1``."""
        mult = float(s2) if self.regression and s2 is not None else 1.0
        # after early stopping: the KFAC of the rows seen is ``fraction`` times the
        # full data's (a random subset) and the prior precision ``fraction / s0^2``
        return mult / self.fraction, mult / float(s0)

    def _weights(self, tau):
        """Per layer ``1 / (rho lam_G lam_A^T + tau)`` (out, in'): ``(rho H_KFAC + tau
        I)^-1``'s eigenvalues in the Kronecker eigenbasis (``rho`` in {0, 1},
        :meth:`match_trace`)."""
        return [1.0 / (self.scale * torch.outer(lg, la) + tau) for lg, _, la, _ in self.eig]

    def _to_blocks(self, T):
        """A dict of parameter tensors (K, *shape) -> per layer (K, out, in')."""
        out = []
        for w, b in self.layers:
            parts = []
            if w is not None:
                parts.append(T[w].to(_F64))
            if b is not None:
                parts.append(T[b].to(_F64)[..., None])
            out.append(torch.cat(parts, dim=-1))
        return out

    def _from_blocks(self, blocks):
        T = {}
        for (w, b), X in zip(self.layers, blocks):
            if w is not None:
                T[w] = X[..., :X.shape[-1] - (b is not None)]
            if b is not None:
                T[b] = X[..., -1]
        return T

    def match_trace(self, inside_trace, fraction=1.0, total_trace=None):
        """Switch the complement's curvature off when the data leave none outside ``Q``.

        ``tr(P_perp GGN P_perp) = tr GGN - inside_trace`` (``inside_trace = tr(Q GGN
        Q^T)``, the trace of the feature-space GGN) is the curvature the data put
        outside ``span(Q)``. When it vanishes (to :data:`OUTSIDE_RTOL` of ``tr GGN``:
        full-rank ELLA, a subspace at the Jacobian's rank) the exact posterior there
        is the prior, and KFAC, whose factors do not know ``span(Q)``, would shrink
        it: ``rho = 0`` and the complement is the prior, so full rank is exact LLA.
        Otherwise ``rho = 1``: KFAC's own curvature. (Matching KFAC's trace outside
        ``span(Q)`` to the GGN's instead was measured and rejected: KFAC's top
        directions do not align with the GGN's, its trace outside ``span(Q)`` is
        dominated by them, and the matched scale over-shrank the curvature of the
        directions that hold the variance: 3,000 rows, ``n_nystrom=200``, ratio to
        exact LLA's epistemic variance 4.1 against 1.1 with ``rho = 1``.)

        After early stopping (the posterior of a random ``fraction`` of the rows,
        prior precision ``fraction / s0^2``) the complement is that of those rows:
        ``fraction`` times the full data's KFAC and the same prior precision, i.e.
        ``Sigma / fraction``.

        Parameters
        ----------
        inside_trace : float
            ``tr(Q GGN Q^T)`` (unit noise) of the rows the posterior holds.
        fraction : float, default=1.0
            The share of the training rows the posterior holds.
        total_trace : float, optional
            ``tr GGN`` of those rows (default: all of them, or ``fraction`` of it).

        Returns
        -------
        float
            ``rho``.
        """
        self.fraction = float(fraction)
        total = self.fraction * self.ggn_trace if total_trace is None else float(total_trace)
        outside = total - float(inside_trace)
        self.outside_fraction = max(outside, 0.0) / total if total > 0 else 0.0
        self.scale = 1.0 if self.outside_fraction > OUTSIDE_RTOL else 0.0
        self._cache = {}
        return self.scale

    def _apply_unit(self, tau, T):
        """``(H_unit + tau I)^-1 T`` for a dict of K parameter tensors."""
        W = self._weights(tau)
        out = []
        for (_, Ug, _, Ua), w, X in zip(self.eig, W, self._to_blocks(T)):
            Y = Ug.T @ X @ Ua
            out.append(Ug @ (Y * w) @ Ua.T)
        return self._from_blocks(out)

    def _pieces(self, tau):
        """``(weights, Sigma_unit Q^T as tangents, Q Sigma_unit Q^T)`` at ``tau``."""
        if tau in self._cache:
            return self._cache[tau]
        W = self._weights(tau)
        U = QSQ = None
        if self.Q is not None:
            Qd = self.lin.unflatten(self.Q)
            Ud = self._apply_unit(tau, {k: v.to(_F64) for k, v in Qd.items()})
            from .._network.linearized import stack_flat

            Uf = stack_flat(Ud, self.lin.names).to(_F64)
            QSQ = self.Q @ Uf.T
            QSQ = 0.5 * (QSQ + QSQ.T)
            U = self.lin.unflatten(Uf.to(self.lin.dtype))
        if len(self._cache) > 64:
            self._cache.clear()
        self._cache[tau] = (W, U, QSQ)
        return self._cache[tau]

    # ---------------------------------------------------------------- prediction
    def _quad(self, F, W):
        """``j_c^T Sigma_unit j_d`` per point (B, C, C) from the factored Jacobian."""
        B, C = F.n_points, F.rows_per_point
        out = torch.zeros((B, C, C), dtype=_F64, device=F.device)
        for layer, (_, Ug, _, Ua), w in zip(F.layers, self.eig, W):
            at = _abar(layer, layer.act.to(_F64)) @ Ua  # (B, in')
            dt = (layer.delta.to(_F64) @ Ug).reshape(B, C, -1)  # (B, C, out)
            t = (at * at) @ w.T  # (B, out)
            out += torch.einsum("bci,bdi,bi->bcd", dt, dt, t)
        return out

    def covariance(self, x, phi_o, s0, s2):
        """``j_perp^T Sigma j_perp`` per point (B, C, C), float64, PSD.

        Parameters
        ----------
        x : Tensor
            Input batch.
        phi_o : Tensor of shape (B, C, K) or None
            ``J(x) Q^T`` (the coordinates in the kept orthonormal basis).
        s0, s2 : float
            Prior variance and noise variance (``None`` for classification).

        Returns
        -------
        Tensor of shape (B, C, C)
        """
        mult, tau = self._key(s0, s2)
        return mult * self.unit_covariance(x, phi_o, tau)

    def unit_covariance(self, x, phi_o, tau):
        """:meth:`covariance` of ``Sigma_unit = (H_unit + tau I)^-1`` (``mult = 1``)."""
        W, U, QSQ = self._pieces(tau)
        F = self.lin.factored_jacobian(x)
        cov = self._quad(F, W)
        if U is not None:
            B, C = F.n_points, F.rows_per_point
            JU = F.matmul(U).to(_F64).reshape(B, C, -1)  # j^T Sigma Q^T
            P = phi_o.to(_F64)
            cross = P @ JU.transpose(1, 2)
            cov = cov - cross - cross.transpose(1, 2) + P @ QSQ @ P.transpose(1, 2)
        cov = 0.5 * (cov + cov.transpose(1, 2))
        if cov.shape[-1] == 1:
            return cov.clamp_min(0.0)
        e, V = torch.linalg.eigh(cov)
        return (V * e.clamp_min(0.0)[:, None, :]) @ V.transpose(1, 2)

    def joint_covariance(self, x, phi_o, s0, s2):
        """The joint ``(B C, B C)`` covariance of ``j_perp^T Sigma j_perp`` across points."""
        mult, tau = self._key(s0, s2)
        W, U, QSQ = self._pieces(tau)
        F = self.lin.factored_jacobian(x)
        B, C = F.n_points, F.rows_per_point
        cov = torch.zeros((B * C, B * C), dtype=_F64, device=F.device)
        for layer, (_, Ug, _, Ua), w in zip(F.layers, self.eig, W):
            at = _abar(layer, layer.act.to(_F64)) @ Ua  # (B, in')
            dt = (layer.delta.to(_F64) @ Ug).reshape(B, C, -1)
            T = torch.einsum("pj,qj,ij->pqi", at, at, w)  # (B, B, out)
            cov += torch.einsum("pci,pqi,qdi->pcqd", dt, T, dt).reshape(B * C, B * C)
        if U is not None:
            JU = F.matmul(U).to(_F64).reshape(B * C, -1)
            P = phi_o.to(_F64).reshape(B * C, -1)
            cross = P @ JU.T
            cov = cov - cross - cross.T + P @ QSQ @ P.T
        return 0.5 * (cov + cov.T) * mult
