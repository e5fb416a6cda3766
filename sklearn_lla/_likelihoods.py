"""Likelihoods (Gaussian, categorical) and the classification link approximations.

Each likelihood provides what the Laplace methods need about ``p(y | f)``:

* ``lam_factor(f)``: a factor ``A`` with ``Lam(f) = A A^T``, ``Lam`` the Hessian of
  ``-log p(y | f)`` w.r.t. the outputs ``f``. Regression: ``I / sqrt(s2)``.
  Classification: ``A = diag(sqrt p) - p sqrt(p)^T`` (``p = softmax f``), which gives
  ``A A^T = diag(p) - p p^T`` exactly without any eigendecomposition;
* ``log_likelihood(f, y)``: summed log density;
* the predictive: Gaussian ``N(g, S + s2 I)``; categorical ``E softmax(f)`` by a link
  approximation (:func:`predictive_proba`).
"""

from __future__ import annotations

import math

import torch

__all__ = [
    "GaussianLikelihood",
    "CategoricalLikelihood",
    "predictive_proba",
    "LINK_APPROXIMATIONS",
]

LINK_APPROXIMATIONS = ("probit", "mc", "bridge")


class GaussianLikelihood:
    """Isotropic Gaussian likelihood ``y ~ N(f, s2 I)``.

    Parameters
    ----------
    noise_variance : float
        ``s2`` (> 0).
    """

    task = "regression"

    def __init__(self, noise_variance: float):
        if not noise_variance > 0:
            raise ValueError(f"noise_variance must be > 0, got {noise_variance!r}")
        self.noise_variance = float(noise_variance)

    def lam_factor(self, f: torch.Tensor) -> torch.Tensor:
        """``A`` of shape (B, C, C) with ``A A^T = I / s2``."""
        B, C = f.shape
        eye = torch.eye(C, dtype=f.dtype, device=f.device)
        return (eye / math.sqrt(self.noise_variance)).expand(B, C, C)

    def lam(self, f: torch.Tensor) -> torch.Tensor:
        """Output Hessian ``Lam`` of shape (B, C, C)."""
        A = self.lam_factor(f)
        return A @ A.transpose(1, 2)

    def log_likelihood(self, f: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``sum_n log N(y_n | f_n, s2 I)``."""
        r = (y - f).reshape(-1)
        return -0.5 * (r @ r) / self.noise_variance - 0.5 * r.numel() * math.log(
            2 * math.pi * self.noise_variance
        )

    def predictive_variance(self, latent_var: torch.Tensor) -> torch.Tensor:
        """Variance of ``y``: latent variance plus ``s2``."""
        return latent_var + self.noise_variance


class CategoricalLikelihood:
    """Categorical likelihood with softmax link on logits ``f``."""

    task = "classification"

    def lam_factor(self, f: torch.Tensor) -> torch.Tensor:
        """``A = diag(sqrt p) - p sqrt(p)^T`` of shape (B, C, C); ``A A^T = diag(p) - p p^T``."""
        p = torch.softmax(f, dim=-1)
        sp = p.sqrt()
        return torch.diag_embed(sp) - p.unsqueeze(-1) * sp.unsqueeze(-2)

    def lam(self, f: torch.Tensor) -> torch.Tensor:
        """Output Hessian ``diag(p) - p p^T`` of shape (B, C, C)."""
        p = torch.softmax(f, dim=-1)
        return torch.diag_embed(p) - p.unsqueeze(-1) * p.unsqueeze(-2)

    def log_likelihood(self, f: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``sum_n log softmax(f_n)[y_n]`` for integer labels ``y``."""
        logp = torch.log_softmax(f, dim=-1)
        return logp.gather(1, y.long().reshape(-1, 1)).sum()


def _probit(mean, var):
    return torch.softmax(mean / torch.sqrt(1.0 + math.pi / 8.0 * var), dim=-1)


def _bridge(mean, var):
    # Laplace bridge (Hobbhahn et al., 2022): map N(mean, diag var) to a Dirichlet
    # and return its mean. Logits are centred first (softmax is shift invariant, the
    # bridge is not; the paper's derivation assumes sum-to-zero logits).
    C = mean.shape[-1]
    mu = mean - mean.mean(dim=-1, keepdim=True)
    var = var.clamp_min(torch.finfo(var.dtype).eps)
    # exp(mu_k) * sum_l exp(-mu_l), computed in log space for stability
    log_term = mu + torch.logsumexp(-mu, dim=-1, keepdim=True)
    alpha = (1.0 - 2.0 / C + torch.exp(log_term) / C**2) / var
    return alpha / alpha.sum(dim=-1, keepdim=True)


def _mc(mean, cov, n_samples, generator):
    B, C = mean.shape
    # Cholesky of each C x C covariance; tiny jitter for numerically singular ones.
    eye = torch.eye(C, dtype=cov.dtype, device=cov.device)
    scale = torch.diagonal(cov, dim1=1, dim2=2).mean(-1).clamp_min(1e-30)[:, None, None]
    L, info = torch.linalg.cholesky_ex(cov + 1e-10 * scale * eye)
    if bool((info != 0).any()):
        evals, evecs = torch.linalg.eigh(cov)
        L = evecs * evals.clamp_min(0).sqrt().unsqueeze(-2)
    eps = torch.randn((n_samples, B, C), dtype=mean.dtype, device=mean.device, generator=generator)
    f = mean.unsqueeze(0) + torch.einsum("bij,sbj->sbi", L, eps)
    return torch.softmax(f, dim=-1).mean(0)


def predictive_proba(mean: torch.Tensor, cov: torch.Tensor, link_approx: str = "probit",
                     n_samples: int = 512, generator: torch.Generator | None = None) -> torch.Tensor:
    """Class probabilities ``E_{f ~ N(mean, cov)} softmax(f)``.

    Parameters
    ----------
    mean : Tensor of shape (B, C)
        Logits of the pretrained network.
    cov : Tensor of shape (B, C, C)
        Latent covariance ``S(x)`` per point.
    link_approx : {"probit", "mc", "bridge"}
        ``probit``: ``softmax(g / sqrt(1 + pi/8 diag S))`` (deterministic);
        ``mc``: average softmax over ``n_samples`` draws of the full ``C x C`` Gaussian;
        ``bridge``: the Laplace bridge.
    n_samples : int
        Monte Carlo samples for ``mc``.
    generator : torch.Generator, optional
        Random source for ``mc``.

    Returns
    -------
    Tensor of shape (B, C), rows summing to one.
    """
    var = torch.diagonal(cov, dim1=1, dim2=2).clamp_min(0)
    if link_approx == "probit":
        return _probit(mean, var)
    if link_approx == "bridge":
        return _bridge(mean, var)
    if link_approx == "mc":
        return _mc(mean, cov, n_samples, generator)
    raise ValueError(f"link_approx must be one of {LINK_APPROXIMATIONS}, got {link_approx!r}")
