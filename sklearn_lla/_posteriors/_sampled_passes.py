"""Sampled LLA's row-sum passes (:meth:`FitData.reduce` functions, module level so that
dask workers can run them) and the sample covariance; see
:mod:`sklearn_lla._posteriors.sampled`."""

from __future__ import annotations

import torch

from .._core.likelihoods import uses_mc_link
from .._network.linearized import stack_flat

_F64 = torch.float64


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

    ``payload = (lin, lik, T)``, ``T`` of shape (M, P); returns a float64 (M, P)
    tensor. The matrix-vector product of the E-step's conjugate gradients: one JVP
    with ``M`` tangents and one VJP with ``M`` cotangents per batch.
    """
    lin, lik, T = payload
    out = torch.zeros(T.shape, dtype=_F64, device=T.device)
    for x, _ in batches:
        g, jt = lin.jvp(x, T)
        A = lik.lam_factor(g.to(_F64))
        ajt = torch.einsum("bcd,bck->bdk", A, jt.to(_F64))
        cot = torch.einsum("bcd,bdk->kbc", A, ajt)
        out += stack_flat(lin.vjp(x, cot), lin.names).to(_F64)
    return (out,)


def _statistics_sums(payload, batches):
    """``(q, rss)`` over ``batches``: ``q_k = sum_n |A_n^T J_n z_k|^2`` for every sample
    (their mean is the effective dimension ``gamma``) and the residual sum of squares of
    the linear model's mode (regression)."""
    lin, lik, delta, Z, regression = payload
    T = torch.cat([delta[None], Z])
    q = torch.zeros(Z.shape[0], dtype=_F64, device=Z.device)
    rss = 0.0
    for x, y in batches:
        g, jt = lin.jvp(x, T)
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
