"""FMGP: fixed-mean Gaussian processes (Ortega et al.; the thesis chapter).

A decoupled sparse variational GP whose predictive **mean is fixed to the network**
``g`` and whose covariance is learned with a free parametric kernel (see
:mod:`sklearn_lla.kernels`). Unlike VaLLA no Jacobian is ever formed: fitting and
prediction need only ``g(x)`` (and, for the classification kernel, the penultimate
features ``psi(x)``), one forward pass per batch.

With ``M`` inducing pairs ``(z_m, c_m)``, the factor ``L`` and the kernel ``K`` (all in
float64; the algebra is shared with VaLLA in :mod:`sklearn_lla._posteriors.gp`):

* ``Q``: mean ``g(x)``, covariance ``S(x) = Kxx - Kxz A Kzx``, ``A = L (I + L^T Kzz L)^-1 L^T``;
* ``Q*`` (the thesis' regulariser): the same covariance with mean
  ``m*(x) = Kxz a``, ``a = (Kzz + eps I)^-1 q_mu``, ``eps = 1e-3 mean(diag Kzz)`` (the
  thesis' ``1e-3 I`` on its standardised targets, made scale-equivariant), and
  ``KL(Q* | P) = KL(Q | P) + 1/2 a^T Kzz a`` (the decoupled KL, eq. ``KL_dual_basis``);
* loss per minibatch (alpha-energy, alpha = 1 by default):
  ``-(1/B) sum_b [E_alpha(y_b; g, S) + E_alpha(y_b; m*, S)] + (KL(Q) + KL(Q*)) / N``.

``Q*`` must explain the data with a mean that the kernel itself generates, so the
kernel hyperparameters cannot shrink the predictive variance to zero to fit the fixed
mean's residuals alone. Learned: ``Z`` (k-means initialisation, per class for
classification), ``L`` (initialised to ``I``), the kernel's hyperparameters, the
noise variance (regression) and ``q_mu`` (initialised to ``g`` at the inducing pairs,
so that ``m*`` starts near the network); Adam on minibatches through the shared loop
(:mod:`sklearn_lla._core.optim`) with early stopping on the validation NLL.
"""


from __future__ import annotations

import copy
import math
import warnings

import numpy as np
import torch

from .gp import (
    FixedMeanGPPosterior,
    alpha_energy,
    joint_cov,
    latent_cov,
    robust_cholesky,
    variational_terms,
)
from .kernels import RBF, ClassificationKernel

__all__ = [
    "FMGPPosterior",
    "KERNEL_INIT_ROWS",
    "QSTAR_JITTER",
    "RECALIBRATION_ELEMENTS",
    "RECALIBRATION_LOG_RANGE",
    "RECALIBRATION_ROWS",
    "mean_regularizer_loss",
]

#: Relative jitter of ``Q*``'s mean, ``a = (Kzz + 1e-3 mean(diag Kzz) I)^-1 q_mu``.
QSTAR_JITTER = 1e-3

#: Rows of training data sampled to initialise the kernel (median heuristic, scales).
KERNEL_INIT_ROWS = 1000

#: Validation rows (at most) used by the final rescaling, and its memory cap in
#: covariance elements (rows x C x C).
RECALIBRATION_ROWS = 20_000
RECALIBRATION_ELEMENTS = 2**24

#: The rescaling searches ``log c`` within this distance of 0.
RECALIBRATION_LOG_RANGE = math.log(1e4)



def mean_regularizer_loss(likelihood, q_mu, Kzz, terms, Kxx, Kxz, y, *, n_total, alpha=1.0,
                          noise=None, eps=None):
    """The auxiliary ``Q*`` term of the FMGP loss on one minibatch (per-point scale).

    ``-(1/B) sum_b E_alpha(y_b; m*(x_b), S(x_b)) + KL(Q* | P) / N`` with
    ``m* = Kxz a``, ``a = (Kzz + eps I)^-1 q_mu``, ``eps = 1e-3 mean(diag Kzz)`` and
    ``KL(Q* | P) = KL(Q | P) + 1/2 a^T Kzz a``.

    Parameters
    ----------
    likelihood : Likelihood
        The likelihood of the energy.
    q_mu : Tensor of shape (M,)
        ``Q*``'s mean parameters.
    Kzz : Tensor of shape (M, M)
        The inducing Gram matrix.
    terms : VariationalTerms
        ``W`` and ``KL(Q | P)`` of :func:`sklearn_lla._posteriors.gp.variational_terms`.
    Kxx : Tensor of shape (B, C, C)
        Prior covariance blocks of the batch.
    Kxz : Tensor of shape (B, C, M)
        Cross covariances of the batch.
    y : Tensor
        Targets of the batch.
    n_total : int
        ``N``, the number of training rows.
    alpha : float, default=1.0
        The energy's alpha.
    noise : Tensor or float, optional
        Regression noise variance.
    eps : Tensor, optional
        Standard normal draws for Monte Carlo energies.

    Returns
    -------
    Tensor
        A scalar, added to the loss.
    """
    M = Kzz.shape[0]
    eye = torch.eye(M, dtype=Kzz.dtype, device=Kzz.device)
    jitter = QSTAR_JITTER * torch.diagonal(Kzz).mean()
    chol = robust_cholesky(Kzz + jitter * eye, what="regularised inducing Gram matrix")
    a = torch.cholesky_solve(q_mu.reshape(M, 1), chol).reshape(M)
    m_star = Kxz @ a
    cov = latent_cov(Kxx, Kxz @ terms.W.T)
    e = alpha_energy(likelihood, m_star, cov, y, alpha=alpha, noise=noise, eps=eps)
    kl = terms.kl + 0.5 * (a @ (Kzz @ a))
    return -e.mean() + kl / n_total


class FMGPPosterior(FixedMeanGPPosterior):
    """The FMGP posterior: a fixed-mean sparse GP with a parametric kernel and ``Q*``.

    Parameters
    ----------
    kernel : Kernel or None, default=None
        The kernel template (deep-copied, then ``initialize``-d on a sample of the
        training data when it has that method). ``None``: :class:`~sklearn_lla.kernels.RBF`
        for regression, :class:`~sklearn_lla.kernels.ClassificationKernel` otherwise.
    mean_regularizer : bool, default=True
        Add the ``Q*`` term (the thesis' regulariser).
    recalibrate : bool, default=True
        After the fit, scale the predictive variance (latent and noise) by the factor
        that minimises the validation NLL (needs validation rows).
    **kwargs
        :class:`~sklearn_lla._posteriors.gp.FixedMeanGPPosterior`'s settings.
    """

    fitted_attributes = FixedMeanGPPosterior.fitted_attributes + ("q_mu", "calibration")

    def __init__(self, kernel=None, *, mean_regularizer=True, recalibrate=True, **kwargs):
        super().__init__(**kwargs)
        self.kernel_template = kernel
        self.mean_regularizer = bool(mean_regularizer)
        self.recalibrate = bool(recalibrate)
        self.cov_scale = 1.0
        self._features = None

    # -- hooks -----------------------------------------------------------------------
    def make_kernel(self, data, Z, cz):
        """Copy and initialise the kernel; initialise ``q_mu`` at ``g(Z)``."""
        task = data.likelihood.task
        if self.kernel_template is None:
            kernel = RBF() if task == "regression" else ClassificationKernel()
        else:
            kernel = copy.deepcopy(self.kernel_template)
        rng = np.random.default_rng(self.random_state)
        n = data.n_samples
        idx = np.sort(rng.choice(n, size=min(n, KERNEL_INIT_ROWS), replace=False))
        x, y = data.rows(idx)
        init = getattr(kernel, "initialize", None)
        if callable(init):
            out = init(x.detach().to(torch.float64).reshape(len(x), -1), y,
                       n_outputs=data.n_outputs, task=task, net=data.lin)
            kernel = kernel if out is None else out
        self._features = getattr(kernel, "features_", None)
        with torch.no_grad():
            g = self._mean(data.lin, Z.detach())
            q0 = g[torch.arange(len(cz), device=g.device), cz]
        self.q_mu = q0.detach().clone().requires_grad_(self.mean_regularizer)
        return kernel

    def extra_parameters(self):
        """``q_mu`` (when the ``Q*`` term is on)."""
        return [self.q_mu] if self.mean_regularizer else []

    def extra_loss(self, *, x, y, n_total, kernel, Kzz, terms, Kxx, Kxz, noise):
        """The ``Q*`` term (see :func:`mean_regularizer_loss`)."""
        if not self.mean_regularizer:
            return None
        lik = self._fit_lik
        eps = None
        if self._needs_eps(lik):
            eps = torch.randn((self.n_energy_samples, len(x), Kxz.shape[1]),
                              generator=self._gen, dtype=torch.float64).to(Kxz.device)
        return mean_regularizer_loss(lik, self.q_mu, Kzz, terms, Kxx, Kxz, y,
                                     n_total=n_total, alpha=self.alpha, noise=noise, eps=eps)

    def _mean(self, lin, x):
        feats = self._features
        if feats is not None and feats.net is lin:
            with torch.no_grad():
                return feats(x)[0].double()
        return super()._mean(lin, x)

    # -- fit -------------------------------------------------------------------------
    def fit(self, data):
        """Learn ``Z``, ``L``, ``q_mu`` and the hyperparameters on minibatches of ``data``."""
        self._fit_lik = self._energy_likelihood(data.likelihood)
        self._gen = data.generator
        try:
            super().fit(data)
        finally:
            del self._fit_lik, self._gen
        self.q_mu = self.q_mu.detach()
        self.calibration = None
        if self.recalibrate and data.validation is not None and data.validation.n_samples > 0:
            self._recalibrate(data.validation)
        return self

    def _recalibrate(self, val):
        """Scale the predictive variance by the ``c`` that minimises the validation NLL.

        The latent covariance becomes ``c S`` and the noise ``c s2``; each is kept when
        fixed by the user (``S`` when the amplitude is fixed, ``s2`` when the noise is).
        ``S -> c S`` is exact within the model: amplitude ``c a`` with ``L / sqrt(c)``
        gives ``A / c`` and so ``c S``.
        """
        from scipy.optimize import minimize_scalar

        lik = self.likelihood
        regression = lik.task == "regression"
        kernel = self.kernel
        scale_S = bool(getattr(kernel, "learn_amplitude", True))
        scale_s2 = regression and isinstance(self.noise_variance, str)
        if not (scale_S or scale_s2):
            return
        C = lik.n_outputs
        n_max = int(max(1, min(val.n_samples, RECALIBRATION_ROWS,
                               RECALIBRATION_ELEMENTS // max(1, C * C))))
        rows = np.arange(val.n_samples)
        if n_max < len(rows):
            rows = np.sort(np.random.default_rng(self.random_state).choice(
                rows, size=n_max, replace=False))
        means, covs, ys = [], [], []
        bs = max(val.batch_size, 256)
        for start in range(0, n_max, bs):
            x, y = val.rows(rows[start:start + bs])
            lp = self.predict(x)
            means.append(lp.mean)
            covs.append(lp.cov)
            ys.append(y)
        mean, cov, y = torch.cat(means), torch.cat(covs), torch.cat(ys)
        s2_0 = float(lik.noise_variance) if regression else None

        def nll(log_c):
            c = math.exp(log_c)
            S = c * cov if scale_S else cov
            with torch.no_grad():
                lp = (alpha_energy(lik, mean, S, y, alpha=1.0,
                                   noise=c * s2_0 if scale_s2 else s2_0)
                      if regression else lik.log_predictive(mean, S, y))
            v = -float(lp.mean())
            return v if math.isfinite(v) else 1e300

        before = nll(0.0)
        r = RECALIBRATION_LOG_RANGE
        res = minimize_scalar(nll, bounds=(-r, r), method="bounded",
                              options={"xatol": 1e-5})
        if not res.fun < before:
            return
        c = math.exp(res.x)
        if abs(res.x) > r - 1e-3:
            warnings.warn(f"FMGP: the validation rescaling of the predictive variance ended "
                          f"at its bound (c = {c:.3g})", RuntimeWarning, stacklevel=4)
        self.calibration = {"variance_scale": c, "validation_nll_before": before,
                            "validation_nll_after": float(res.fun), "n_rows": n_max}
        with torch.no_grad():
            if scale_S:
                if hasattr(kernel, "log_amplitude"):
                    kernel.log_amplitude += math.log(c)
                    self._L = self._L / math.sqrt(c)
                    self._build_predictor()
                else:
                    self.cov_scale = self.cov_scale * c
        if scale_s2:
            self.likelihood = lik.with_noise(c * s2_0)
        self.prior_variance = float(kernel.prior_variance) * self.cov_scale
        self.hyper_trace = {**self.hyper_trace, "calibration": self.calibration}

    def predict(self, x):
        """Latent mean ``g(x)`` and covariance ``Kxx - Kxz A Kzx`` per point."""
        lp = super().predict(x)
        if self.cov_scale != 1.0:
            lp.cov = lp.cov * self.cov_scale
        return lp

    def predict_joint(self, x):
        """Network output (B, C) and joint latent covariance (B*C, B*C), ``Kxx' - Kxz A Kzx'``.

        Rows and columns are ordered (point, output), as ``cov.reshape(B, C, B, C)``.
        """
        with torch.no_grad():
            mean = self._mean(self._lin, x)
            B, C = mean.shape
            kernel = self.kernel
            W = variational_terms(kernel.gram(self._Z, self._cz), self._L).W
            V = (kernel.cross(x, self._Z, self._cz) @ W.T).reshape(B * C, -1)
            dev = self._cz.device
            xx = x.repeat_interleave(C, dim=0)
            cc = torch.arange(C, device=dev).repeat(B)
            K = kernel.gram(xx, cc).to(torch.float64)
            return mean, joint_cov(K, V) * self.cov_scale
