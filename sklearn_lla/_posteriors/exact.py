"""Exact linearized Laplace approximation: the reference every approximation is tested against.

The GGN posterior is formed explicitly in float64, either

* in **parameter space** (``P x P``): the feature-space GLM posterior
  (:class:`~sklearn_lla._posteriors.glm.GLMPosterior`) with the Jacobian itself as features
  (``V = I``), ``S(x) = J(x) H^-1 J(x)^T``;
* in **function space** (``NC x NC``), the dual form with ``Lam = A A^T`` and
  Woodbury, ``S(x) = s0^2 k(x,x) - s0^4 k(x,X) A (I + s0^2 A^T K A)^-1 A^T k(X,x)``,
  which needs no inverse of ``Lam`` (singular for softmax); formed in place, so it
  needs about ``2 (NC)^2`` doubles;
* on the **last layer** only (``subset_of_weights="last_layer"``,
  laplace-torch's default structure): the GLM posterior of the network linearised
  in its last layer's parameters, the other weights held fixed.

Hyperparameters (``"auto"``): the GLM family's objective
(:data:`~sklearn_lla._core.hyper.OBJECTIVE`); rows the network did not fit then
calibrate one scalar (:mod:`sklearn_lla._core.calibration`, ``docs/hyperparameters.md``).
"""


from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import torch

from .._core.hyper import HyperContext, resolve, strategy
from .._core.linalg import cholesky, safe_eigh
from .._core.protocol import LatentPredictive, Posterior, check_finite_outputs

__all__ = ["FunctionSpacePosterior", "MAX_EXACT_DIM"]

#: Largest ``min(P, N*C)`` the exact estimators accept: the fit holds dense float64
#: ``dim x dim`` matrices (``8 dim^2`` bytes each; two in function space) and
#: eigendecomposes one (``O(dim^3)``). The measured costs are in ``docs/exact.md``.
MAX_EXACT_DIM = 10_000


def _choose_space(space, n_params, n_rows):
    if space == "auto":
        space = "parameter" if n_params <= n_rows else "function"
    dim = n_params if space == "parameter" else n_rows
    if dim > MAX_EXACT_DIM:
        raise ValueError(
            f"exact LLA in {space} space needs a dense {dim} x {dim} matrix (P={n_params}, "
            f"N*C={n_rows}); the limit is {MAX_EXACT_DIM}. Use subset_of_weights='last_layer', "
            "ELLARegressor/ELLAClassifier or another scalable method for problems this large."
        )
    return space


class FunctionSpacePosterior(Posterior):
    """Exact LLA in its dual (function-space) form.

    Parameters
    ----------
    prior_variance : float or "auto"
    noise_variance : float, "auto" or None
        ``None`` for classification.
    hyper : {"auto", "evidence", "validation"}, default="auto"
        As in :class:`~sklearn_lla._posteriors.glm.GLMPosterior`.
    """

    fitted_attributes = ("prior_variance", "likelihood", "hyper_strategy", "hyper_trace",
                         "log_evidence")

    #: The posterior at ``(c s0^2, c s2)`` is ``c`` times this one, and is refitted for
    #: a candidate noise from the one eigendecomposition.
    rescalable = True
    refits_noise = True

    def __init__(self, prior_variance="auto", noise_variance=None, hyper="auto"):
        self.prior_variance = prior_variance
        self.noise_variance = noise_variance
        self.hyper = hyper

    def _sandwich_(self, K, A):
        """``K <- blockdiag(A)^T K blockdiag(A)`` in place (batched over points)."""
        N, C, _ = A.shape
        K4 = K.view(N, C, N, C)
        for i in range(N):  # left: rows of point i
            K4[i] = torch.einsum("ck,cmd->kmd", A[i], K4[i]) if C > 1 else K4[i] * A[i, 0, 0]
        for j in range(N):  # right: columns of point j
            K4[:, :, j, :] = K4[:, :, j, :] @ A[j] if C > 1 else K4[:, :, j, :] * A[j, 0, 0]
        return K

    def fit(self, data):
        """Form ``W = A^T K A``, choose hyperparameters and factorise in place."""
        lin, lik = data.lin, data.likelihood
        N, C = data.n_samples, data.n_outputs
        self.X_, y = data.rows(slice(0, N))
        f = torch.cat([lin.forward(x).double() for x, _ in data.batches()])
        check_finite_outputs(f, "training rows")
        self.lin, self._lik0 = lin, lik
        regression = lik.task == "regression"
        if regression:
            self._A = None
            fit_stat = float(((y - f) ** 2).sum())
        else:
            self._A = lik.lam_factor(f)
            fit_stat = float(lik.log_prob(f, y).sum())
        W = lin.kernel(self.X_, n_outputs=C)  # float64 (NC, NC), the only N^2 buffer kept
        if self._A is not None:
            self._sandwich_(W, self._A)
        theta = lin.flat_params().double()
        self.auto_prior = self.prior_variance == "auto"
        auto = self.auto_prior or (regression and self.noise_variance == "auto")
        strat = strategy(resolve(self.hyper, family="glm", task=lik.task, auto=auto,
                                 has_validation=data.validation is not None))
        # the spectrum, when a strategy or the noise calibration on held-out rows needs it
        profile = data.validation is not None and regression and self.noise_variance == "auto"
        self._Q, e = None, None
        if strat.uses_held_out or profile:
            e, self._Q = safe_eigh(W, "function-space GGN")
            e = e.clamp_min(0)
            del W
        elif strat.needs_spectrum:
            e = torch.linalg.eigvalsh(W).clamp_min(0)  # a transient copy of W
        self._fit_stat, self._n_obs, self._e = fit_stat, N * C, e
        self._theta_sq = float(theta @ theta)
        ctx = HyperContext(self.prior_variance, self.noise_variance if regression else None,
                           eigvals=None if e is None else e.cpu().numpy(),
                           theta_sq_norm=self._theta_sq, data_fit=fit_stat, n_obs=N * C,
                           n_params=lin.n_params)
        if strat.uses_held_out:
            ctx = self._held_out_context(ctx, data.validation)
        res = strat.select(ctx)
        self.hyper_strategy, self.hyper_trace = res.strategy, res.trace
        if self._Q is not None:
            self._set_hyperparameters(res.prior_variance, res.noise_variance)
        else:  # B = I + (s0 / s2) W, factorised in place
            self._set_hyperparameters(res.prior_variance, res.noise_variance, W=W)
        return self

    def _set_hyperparameters(self, s0, s2, W=None):
        """Fix ``(s0^2, s2)``: the factor of ``I + (s0 / s2) A^T K A`` and the evidence."""
        regression = self._lik0.task == "regression"
        self.prior_variance = float(s0)
        self.noise_variance = s2
        self.likelihood = self._lik0.with_noise(s2) if regression else self._lik0
        s2v = s2 if regression else 1.0
        self._s2 = s2v
        if W is None:
            self._dq = 1.0 / (1.0 + (s0 / s2v) * self._e)
            logdet = float(torch.log1p((s0 / s2v) * self._e).sum())
        else:
            W.mul_(s0 / s2v)
            W.diagonal().add_(1.0)
            self._L = cholesky(W, "function-space system matrix", inplace=True)
            logdet = 2.0 * float(torch.log(torch.diagonal(self._L)).sum())
        if regression:
            fit_term = (-0.5 * self._n_obs * math.log(2 * math.pi * s2v)
                        - 0.5 * self._fit_stat / s2v)
        else:
            fit_term = self._fit_stat
        # log Z = log p(y | theta) - |theta|^2 / (2 s0^2) - 1/2 log det(I + s0^2 A^T K A)
        self.log_evidence = fit_term - 0.5 * self._theta_sq / s0 - 0.5 * logdet

    def rescale(self, c):
        """Move to ``(c s0^2, c s2)``."""
        self._set_hyperparameters(c * self.prior_variance, c * self.noise_variance)

    def held_out_pairs(self, validation):
        """Held-out NLL per ``(s0^2, s2)`` pair, and the network's mean squared residual."""
        stats = self._held_out_stats(validation)
        return (lambda s0s, s2s: self._score_pairs(stats, s0s, s2s),
                _mean_squared_residual(stats))

    def refit_noise(self, noise_variance):
        """Refit at ``noise_variance`` (the prior variance kept)."""
        self._set_hyperparameters(self.prior_variance, noise_variance)

    def _AtK(self, kXx):
        """``blockdiag(A)^T k(X, x)`` (unit-noise A = I for regression)."""
        if self._A is None:
            return kXx
        N, C, _ = self._A.shape
        return torch.einsum("nck,ncm->nkm", self._A, kXx.reshape(N, C, -1)).reshape(N * C, -1)

    def _reduce(self, AtK):
        """``Z`` with ``Z^T Z = AtK^T B^-1 AtK``."""
        if self._Q is not None:
            return (self._Q.T @ AtK) * self._dq.sqrt()[:, None]
        return torch.linalg.solve_triangular(self._L, AtK, upper=False)

    def _held_out_stats(self, validation):
        """Per batch: the outputs, NTK blocks and reduced cross kernel on held-out rows."""
        stats = []
        C = validation.n_outputs
        for x, y in validation.batches():
            g = self.lin.forward(x).double()
            kxx = self.lin.ntk_diag_blocks(x).double()
            Z = self._Q.T @ self._AtK(self.lin.kernel(self.X_, x, n_outputs=C))
            stats.append((g, kxx, Z.reshape(len(Z), len(x), C), y))
        return stats

    def _score_pairs(self, stats, s0s, s2s):
        """Mean held-out NLL of each ``(s0s[k], s2s[k])`` pair (``s2`` NaN: classification)."""
        lik = self._lik0
        out = np.zeros(len(s0s))
        n = 0
        for g, kxx, Z, y in stats:
            n += len(g)
            for k, (s0, s2) in enumerate(zip(s0s, s2s)):
                s2v = 1.0 if np.isnan(s2) else s2
                w = 1.0 / (1.0 + (s0 / s2v) * self._e)
                red = torch.einsum("kbc,k,kbd->bcd", Z, w, Z)
                cov = s0 * kxx - (s0 * s0 / s2v) * red
                lk = lik if np.isnan(s2) else lik.with_noise(s2)
                out[k] -= float(lk.log_predictive(g, cov, y).sum())
        return out / max(n, 1)

    def _held_out_context(self, ctx, validation):
        """``ctx`` with the held-out score of a strategy that reads held-out rows."""
        stats = self._held_out_stats(validation)
        base_prior = max(float(self.lin.flat_params().double().pow(2).mean()), 1e-12)

        def score(s0s, s2s):
            a, b = np.meshgrid(np.asarray(s0s, float), np.asarray(s2s, float), indexing="ij")
            return self._score_pairs(stats, a.ravel(), b.ravel()).reshape(a.shape)

        return replace(ctx, score=score, base_prior=base_prior,
                       base_noise=(_mean_squared_residual(stats)
                                   if ctx.noise_variance is not None else None))

    def predict(self, x):
        """Latent predictive at a batch ``x``."""
        g = self.lin.forward(x).double()
        B, C = g.shape
        Z = self._reduce(self._AtK(self.lin.kernel(self.X_, x, n_outputs=C)))
        Zb = Z.reshape(len(Z), B, C)
        red = torch.einsum("kbc,kbd->bcd", Zb, Zb)
        s0 = self.prior_variance
        cov = s0 * self.lin.ntk_diag_blocks(x).double() - (s0 * s0 / self._s2) * red
        return LatentPredictive(g, 0.5 * (cov + cov.transpose(1, 2)))

    def predict_joint(self, x):
        """Mean (B, C) and joint latent covariance (B*C, B*C)."""
        g = self.lin.forward(x).double()
        C = g.shape[1]
        Z = self._reduce(self._AtK(self.lin.kernel(self.X_, x, n_outputs=C)))
        s0 = self.prior_variance
        cov = s0 * self.lin.kernel(x, n_outputs=C) - (s0 * s0 / self._s2) * (Z.T @ Z)
        return g, 0.5 * (cov + cov.T)


def _mean_squared_residual(stats):
    """The network's mean squared residual over held-out ``stats`` batches."""
    return max(sum(float(((y - g) ** 2).sum()) for g, _, _, y in stats)
               / sum(y.numel() for *_, y in stats), 1e-12)
