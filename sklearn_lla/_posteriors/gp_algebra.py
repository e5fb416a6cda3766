"""The algebra of the fixed-mean sparse GP engine (:mod:`sklearn_lla._posteriors.gp`).

Pure functions, float64: the jittered Cholesky, the variational terms ``W`` (``A = W^T
W``) and ``KL``, latent covariances (the kernel's, or its Nystrom approximation through
the inducing pairs), the alpha-energy of a minibatch, the k-means inducing inputs, and
the torch thread limit the engine fits and predicts under.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from .._core.linalg import cholesky
from .._core.utils import torch_threads

__all__ = [
    "COVARIANCES",
    "FIT_THREADS",
    "KMEANS_MAX_ROWS",
    "SUBSPACE_JITTER",
    "VariationalTerms",
    "alpha_energy",
    "init_inducing",
    "joint_cov",
    "latent_cov",
    "latent_var_blocks",
    "nystrom_blocks",
    "spd_solve",
    "subspace_gram",
    "torch_threads",
    "variational_terms",
]

_LOG_2PI = math.log(2.0 * math.pi)

#: Rows read (at most) to initialise the inducing inputs by k-means.
KMEANS_MAX_ROWS = 20_000

#: torch intra-op threads while a fixed-mean GP fits or predicts (restored after). A
#: step, and a prediction batch, is hundreds of small operations (``M x M``,
#: ``B C x M``): a thread pool only adds synchronisation, and on a machine whose cores
#: are busy its spinning workers wait for cores (``benchmarks/bench_valla.py``: one
#: thread is faster even on an idle machine, and 10-70 x faster on a loaded one).
#: VaLLA's passes of Jacobian rows (large products) run with the setting this lowered
#: (:func:`~sklearn_lla._core.utils.torch_threads_released`).
FIT_THREADS = 1

# ---------------------------------------------------------------------------------
# The M x M algebra
# ---------------------------------------------------------------------------------


@dataclass
class VariationalTerms:
    """``W`` with ``A = L Hm^-1 L^T = W^T W``, and the KL term."""

    W: torch.Tensor
    kl: torch.Tensor


def variational_terms(Kzz: torch.Tensor, L_raw: torch.Tensor) -> VariationalTerms:
    """``W = chol(Hm)^-1 L^T`` (so ``A = W^T W``) and ``KL = 1/2 logdet Hm - 1/2 tr(Kzz A)``.

    Parameters
    ----------
    Kzz : Tensor of shape (M, M)
        Kernel matrix of the inducing pairs (float64).
    L_raw : Tensor of shape (M, M)
        Unconstrained parameter; its lower triangle is ``L``.

    Returns
    -------
    VariationalTerms
    """
    L = torch.tril(L_raw)
    M = L.shape[0]
    eye = torch.eye(M, dtype=Kzz.dtype, device=Kzz.device)
    Hm = eye + L.T @ Kzz @ L
    chol = cholesky(Hm, "variational matrix I + L^T Kzz L", warn=False)
    W = torch.linalg.solve_triangular(chol, L.T, upper=False)
    kl = torch.log(torch.diagonal(chol)).sum() - 0.5 * (Kzz * (W.T @ W)).sum()
    return VariationalTerms(W, kl)


class _SPDSolve(torch.autograd.Function):
    """``A^-1 b`` by Cholesky, with the closed-form backward (see :func:`spd_solve`)."""

    @staticmethod
    def forward(ctx, A, b, what):
        chol = cholesky(A, what, warn=False)
        x = torch.cholesky_solve(b.reshape(-1, 1), chol).reshape(b.shape)
        ctx.save_for_backward(chol, x)
        return x

    @staticmethod
    def backward(ctx, grad):
        chol, x = ctx.saved_tensors
        gb = torch.cholesky_solve(grad.reshape(-1, 1), chol).reshape(x.shape)
        gA = None
        if ctx.needs_input_grad[0]:
            gA = torch.outer(gb, x)
            gA = -0.5 * (gA + gA.T)
        return gA, gb, None


def spd_solve(A: torch.Tensor, b: torch.Tensor, what: str = "matrix") -> torch.Tensor:
    """``x = A^-1 b`` for a symmetric positive definite ``A``, differentiable in both.

    The forward pass is the jittered :func:`~sklearn_lla._core.linalg.cholesky` of ``A``
    (symmetrised) and a Cholesky solve, as autograd would run it; the backward pass is
    the closed form ``b_bar = A^-1 x_bar`` and ``A_bar = -sym(b_bar x^T)`` from the saved
    factor: one more ``O(M^2)`` solve instead of differentiating the factorisation
    (several ``O(M^3)`` triangular solves). The same gradients to round-off.

    Parameters
    ----------
    A : Tensor of shape (M, M)
        Symmetric positive definite (float64).
    b : Tensor of shape (M,)
        The right-hand side.
    what : str, default="matrix"
        ``A``'s name in the factorisation's errors.

    Returns
    -------
    Tensor of shape (M,)
    """
    return _SPDSolve.apply(A, b, what)


def latent_cov(Kxx: torch.Tensor, V: torch.Tensor) -> torch.Tensor:
    """``Kxx - V V^T`` per point (``V = Kxz W^T``), diagonal clamped at zero.

    ``Kxx`` has shape (B, C, C) and ``V`` (B, C, M). Round-off can make a variance a
    hair negative where the data pin it down; it is clamped to zero, never returned
    negative.
    """
    cov = Kxx - V @ V.transpose(-1, -2)
    d = torch.diagonal(cov, dim1=-2, dim2=-1)
    neg = torch.clamp(d, max=0.0)
    if bool((neg < 0).any()):
        cov = cov - torch.diag_embed(neg)
    return cov


def latent_var_blocks(Kxx: torch.Tensor, V: torch.Tensor) -> torch.Tensor:
    """The diagonal of :func:`latent_cov`'s blocks, as (B, C, C) diagonal blocks.

    ``diag(Kxx) - sum_k V_ck^2`` per point, clamped at zero, on the diagonal of
    otherwise zero blocks: for energies that read only the latent variances (the
    probit link), at ``O(B C M)`` instead of the ``O(B C^2 M)`` of the full blocks.
    """
    var = torch.diagonal(Kxx, dim1=-2, dim2=-1) - (V * V).sum(-1)
    return torch.diag_embed(var.clamp_min(0.0))


def joint_cov(K: torch.Tensor, V: torch.Tensor) -> torch.Tensor:
    """Joint latent covariance ``K - V V^T`` (symmetrised), diagonal clamped at zero.

    ``K`` is the (BC, BC) prior block of a batch and ``V`` the matching (BC, M)
    ``Kxz W^T``; the joint counterpart of :func:`latent_cov`.
    """
    cov = K - V @ V.T
    cov = 0.5 * (cov + cov.T)
    return cov - torch.diag(torch.clamp(torch.diagonal(cov), max=0.0))


#: Relative jitter added to ``Kzz`` by the subspace covariance (``covariance="subspace"``).
SUBSPACE_JITTER = 1e-6

#: The two covariance models of :class:`FixedMeanGPPosterior`.
COVARIANCES = ("full", "subspace")


def subspace_gram(Kzz: torch.Tensor) -> torch.Tensor:
    """``Kzz + eps I`` with ``eps`` = :data:`SUBSPACE_JITTER` times its mean diagonal.

    The subspace model's prior is the Nystrom kernel ``Q = Kxz (Kzz + eps I)^-1 Kzx``;
    the same jittered ``Kzz`` enters ``A`` and the KL, so that ``Q - Kxz A Kzx`` stays
    positive semi-definite (``A <= (Kzz + eps I)^-1``) however close to singular the
    inducing points make ``Kzz``.
    """
    eye = torch.eye(Kzz.shape[-1], dtype=Kzz.dtype, device=Kzz.device)
    return Kzz + (SUBSPACE_JITTER * torch.diagonal(Kzz).mean()) * eye


def nystrom_blocks(Kxz: torch.Tensor, chol: torch.Tensor) -> torch.Tensor:
    """``Q`` blocks ``Kxz Kzz^-1 Kzx`` of shape (B, C, C) from ``chol = chol(Kzz)``.

    ``Kxz`` has shape (B, C, M).
    """
    B, C, M = Kxz.shape
    U = torch.linalg.solve_triangular(chol, Kxz.reshape(B * C, M).T, upper=False)
    U = U.T.reshape(B, C, M)
    return U @ U.transpose(-1, -2)


def alpha_energy(likelihood, mean, cov, y, *, alpha: float = 1.0, noise=None, eps=None):
    """Per-point alpha-energy ``(1/alpha) log E_Q[p(y | f)^alpha]`` (alpha = 0: ``E_Q log p``).

    Parameters
    ----------
    likelihood : Likelihood
        The task's likelihood. For regression its noise is replaced by ``noise``.
    mean : Tensor of shape (B, C)
        Latent mean (the network's output).
    cov : Tensor of shape (B, C, C)
        Latent covariance blocks.
    y : Tensor
        Targets (B, C) for regression, labels (B,) for classification.
    alpha : float, default=1.0
        In [0, 1]. Regression is closed form for every alpha; classification uses the
        likelihood's link approximation at alpha = 1 (the probit-scaled softmax by
        default), its expected log-likelihood at alpha = 0, and Monte Carlo over ``eps``
        in between.
    noise : Tensor or float, optional
        The Gaussian noise variance ``s2`` (a tensor when it is learned).
    eps : Tensor of shape (S, B, C), optional
        Standard normal draws for the Monte Carlo cases.

    Returns
    -------
    Tensor of shape (B,)
    """
    if likelihood.task == "regression":
        s2 = torch.as_tensor(likelihood.noise_variance if noise is None else noise,
                             dtype=mean.dtype, device=mean.device)
        C = mean.shape[-1]
        r = y.reshape(mean.shape) - mean
        if alpha == 0:
            var = torch.diagonal(cov, dim1=-2, dim2=-1)
            return -0.5 * (((r * r + var) / s2).sum(-1) + C * (_LOG_2PI + torch.log(s2)))
        # N(y | f, s2)^a = (2 pi s2)^((1-a)/2) a^(-1/2) N(y | f, s2 / a), per output
        const = C * (0.5 * (1.0 - alpha) * (_LOG_2PI + torch.log(s2)) - 0.5 * math.log(alpha))
        eye = torch.eye(C, dtype=mean.dtype, device=mean.device)
        S = 0.5 * (cov + cov.transpose(-1, -2)) + (s2 / alpha) * eye
        if C == 1:
            v = S.reshape(-1)
            logn = -0.5 * (_LOG_2PI + torch.log(v) + r.reshape(-1) ** 2 / v)
        else:
            Lc = torch.linalg.cholesky(S)
            z = torch.linalg.solve_triangular(Lc, r.unsqueeze(-1), upper=False).squeeze(-1)
            logdet = 2.0 * torch.log(torch.diagonal(Lc, dim1=-2, dim2=-1)).sum(-1)
            logn = -0.5 * (C * _LOG_2PI + logdet + z.pow(2).sum(-1))
        return (const + logn) / alpha
    if alpha == 1:
        return likelihood.log_predictive(mean, cov, y, eps=eps)
    if alpha == 0:
        return likelihood.expected_log_prob(mean, cov, y, eps=eps)
    if eps is None:
        raise ValueError("classification with 0 < alpha < 1 needs Monte Carlo draws eps")
    from .._core.likelihoods import latent_draws

    f = latent_draws(mean, cov, eps)  # (S, B, C)
    S_ = f.shape[0]
    lp = likelihood.log_prob(f.reshape(-1, f.shape[-1]), y.repeat(S_)).reshape(S_, -1)
    return (torch.logsumexp(alpha * lp, dim=0) - math.log(S_)) / alpha


# ---------------------------------------------------------------------------------
# Inducing points
# ---------------------------------------------------------------------------------


def init_inducing(data, n_inducing: int, seed: int):
    """Inducing inputs by k-means on (a sample of) the training inputs.

    Regression: ``n_inducing`` centres on the inputs; with C > 1 targets the output
    indices go round-robin. Classification: ``n_inducing / n_labels`` centres per
    label, each carrying that label as its logit index (one-logit nets: index 0).
    When ``n_inducing`` covers every (training row, output) pair (``N C``, all rows
    read), the pairs are those: every distinct training input with every output
    index, where the sparse GP can be exact.
    At most :data:`KMEANS_MAX_ROWS` rows are read (a seeded sample), so the cost does
    not grow with N.

    Returns
    -------
    Z : ndarray of shape (M, D), float64
    cz : ndarray of shape (M,), int64
    """
    from sklearn.cluster import KMeans, MiniBatchKMeans

    rng = np.random.default_rng(seed)
    n = data.n_samples
    idx = np.sort(rng.choice(n, size=min(n, KMEANS_MAX_ROWS), replace=False))
    xs, ys = [], []
    for start in range(0, len(idx), 4096):
        x, y = data.rows(idx[start:start + 4096])
        xs.append(x.detach().double().cpu().reshape(len(x), -1).numpy())
        ys.append(y.detach().cpu().numpy())
    X = np.concatenate(xs)
    Y = np.concatenate(ys)
    C = data.n_outputs

    def centres(rows, k, s):
        k = int(min(k, len(rows)))
        if k <= 0:
            return np.empty((0, X.shape[1]))
        uniq = np.unique(rows, axis=0)
        if len(uniq) <= k:
            return uniq
        km = (KMeans(k, n_init=1, random_state=s) if len(rows) <= 5000
              else MiniBatchKMeans(k, n_init=3, random_state=s, batch_size=1024))
        return km.fit(rows).cluster_centers_

    if n <= KMEANS_MAX_ROWS and n_inducing >= n * C and C > 1:
        uniq = np.unique(X, axis=0)
        Z, cz = np.repeat(uniq, C, axis=0), np.tile(np.arange(C), len(uniq))
    elif data.likelihood.task == "regression":
        Z = centres(X, n_inducing, seed)
        cz = np.arange(len(Z)) % C
    else:
        labels = np.unique(Y)
        share = np.full(len(labels), n_inducing // len(labels))
        share[: n_inducing - share.sum()] += 1
        Zs, cs = [], []
        for lab, k in zip(labels, share):
            Zc = centres(X[Y == lab], k, seed + int(lab))
            Zs.append(Zc)
            cs.append(np.full(len(Zc), int(lab) if C > 1 else 0))
        Z, cz = np.concatenate(Zs), np.concatenate(cs)
    return np.ascontiguousarray(Z, dtype=np.float64), cz.astype(np.int64)
