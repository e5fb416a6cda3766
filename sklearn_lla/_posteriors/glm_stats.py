"""The streamed row sums of the GLM posterior's fit (:mod:`sklearn_lla._posteriors.glm`):
``G = sum_n phi_n^T Lam_n phi_n``, the fit statistic and the GGN trace, per batch of
inputs or from Jacobian rows a shared pass made."""

from __future__ import annotations

import torch

from .._core.protocol import check_finite_outputs

__all__ = ["ggn_statistics"]


def phi_lam(lik, g, phi):
    """``A^T phi`` with ``Lam = A A^T`` (unit noise for a Gaussian likelihood)."""
    if lik.unit_curvature:
        return phi
    return torch.einsum("bck,bcl->bkl", lik.lam_factor(g), phi)


def _accumulate_batch(feats, lik, G, x, y, gphi=None):
    """Add one batch's ``phi^T Lam phi`` to ``G``; returns (fit statistic, rows).
    ``gphi``: the batch's ``(g, phi)`` when already computed."""
    g, phi = feats(x) if gphi is None else gphi
    check_finite_outputs(g, "training rows")
    P = phi_lam(lik, g, phi)
    if P.ndim == 3:
        P = P.reshape(-1, G.shape[0])
    G.addmm_(P.T, P)
    if lik.task == "regression":
        return float(((y - g) ** 2).sum()), g.shape[0]
    return float(lik.log_prob(g, y).sum()), g.shape[0]


def ggn_statistics(payload, batches):
    """The row sums of the GLM fit over ``batches``: ``(G, fit statistic, n_rows)``.

    ``G = sum_n phi_n^T Lam_n phi_n`` (float64, K x K) and the residual sum of
    squares (regression) or log likelihood (classification). Results over
    disjoint row sets add, so the pass runs per partition
    (:meth:`~sklearn_lla._core.protocol.FitData.reduce`).

    Parameters
    ----------
    payload : tuple
        ``(features, likelihood, device)``.
    batches : iterable of (x, y)

    Returns
    -------
    tuple of (Tensor, float, int)
    """
    feats, lik, device = payload
    G = torch.zeros((feats.dim, feats.dim), dtype=torch.float64, device=device)
    fit_stat, n = 0.0, 0
    for x, y in batches:
        df, b = _accumulate_batch(feats, lik, G, x, y)
        fit_stat += df
        n += b
    return G, fit_stat, n


def _ggn_of_rows(feats, lik, rows, x, y, state):
    """:func:`ggn_statistics`'s sums ``state = [G, fit statistic, n_rows]`` of a chunk
    from its Jacobian rows (the pass the KFAC complement's factors share,
    :func:`~sklearn_lla._posteriors.complement.kfac_and_rows_pass`)."""
    df, b = _accumulate_batch(feats, lik, state[0], x, y, feats.of_rows(rows))
    state[1] += df
    state[2] += b


def _batch_ggn_trace(feats, lik, x):
    """``sum_b tr(Lam_b J_b J_b^T)`` over a batch (unit noise for a Gaussian)."""
    K = feats.ntk_diag(x)
    if lik.unit_curvature:
        return float(torch.einsum("bcc->", K))
    A = lik.lam_factor(feats.lin.forward(x).double())
    return float(torch.einsum("bck,bcd,bdk->", A, K, A))
