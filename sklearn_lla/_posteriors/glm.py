"""The feature-space GLM posterior shared by every linearised-Laplace method.

With features ``phi(x) = J(x) V`` (C x K per point) the linearised model is a
generalised linear model in ``w`` (``theta = theta_hat + V w``) with prior
``w ~ N(0, s0^2 (V^T V)^-1)``-equivalent precision ``V^T V / s0^2``:

* ``V = I``: exact LLA in parameter space (:class:`JacobianFeatures`);
* ``V`` = the selection of the last layer: last-layer LLA (:class:`JacobianFeatures`
  on a network linearised in its last layer only);
* ``V`` = the Nystrom basis: ELLA (:class:`sklearn_lla._posteriors.ella.NystromFeatures`);
* ``V`` = a projector: subspace Laplace.

:class:`GLMPosterior` streams the training data once, accumulating
``G = sum_n phi_n^T Lam_n phi_n`` in float64 (with unit noise for a Gaussian
likelihood, whose ``Lam = I / s2`` is rescaled later), whitens by the prior Gram,
eigendecomposes once and then, for any prior and noise variance,

``S(x) = phi(x) T diag(1 / (e / s2 + r / s0^2)) T^T phi(x)^T``

(``T`` the whitened eigenvectors, ``r`` the fraction of the data seen, 1 unless
early stopping ended the stream early). Hyperparameter strategies
(:mod:`sklearn_lla._core.hyper`) evaluate candidates from the eigenvalues alone.
"""

from __future__ import annotations

import abc

import numpy as np
import torch

from .._core.hyper import Evidence, Fixed, ValidationGrid, WeightNorm, glm_log_evidence
from .._core.linalg import safe_cholesky, safe_eigh
from .._core.protocol import FitData, LatentPredictive, Posterior

__all__ = ["Features", "JacobianFeatures", "ProjectionFeatures", "GLMPosterior"]


class Features(abc.ABC):
    """Base class of a feature map ``phi(x) = J(x) V``.

    Attributes (after :meth:`fit`)
    ------------------------------
    dim : int
        ``K``.
    prior_gram : Tensor (K, K) or None
        ``V^T V`` (``None`` means the identity).
    theta_sq_norm : float
        ``||theta_hat||^2`` over the linearised parameters (for the evidence).
    n_outside : int
        Parameter directions outside ``span(V)`` (``P - K``; 0 for the full space or
        when the other parameters are held fixed, as in last-layer LLA).
    """

    prior_gram = None
    n_outside = 0
    #: Whether :meth:`ntk_diag` is available (for the optional residual correction).
    has_ntk = True

    @abc.abstractmethod
    def fit(self, lin, data: FitData) -> Features:  # pragma: no cover - interface
        """Build the basis (if any) from the training data; returns ``self``."""
        raise NotImplementedError

    @abc.abstractmethod
    def __call__(self, x: torch.Tensor):  # pragma: no cover - interface
        """``g(x)`` (B, C) and ``phi(x)`` (B, C, K), float64."""
        raise NotImplementedError

    def max_batch(self, n_outputs: int) -> int:
        """Largest batch whose features fit the memory budget."""
        return 1 << 30

    def ntk_diag(self, x: torch.Tensor) -> torch.Tensor:
        """Per-point NTK blocks ``J(x) J(x)^T`` (B, C, C), float64."""
        return self.lin.ntk_diag_blocks(x).double()


class JacobianFeatures(Features):
    """``V = I``: the features are the Jacobian rows themselves (``K = P``).

    Used by exact LLA in parameter space and, on a network linearised in its last
    layer only, by last-layer LLA.
    """

    def fit(self, lin, data=None):
        """Record the network; there is no basis to build."""
        self.lin = lin
        self.dim = lin.n_params
        theta = lin.flat_params().double()
        self.theta_sq_norm = float(theta @ theta)
        return self

    def max_batch(self, n_outputs):
        return self.lin.chunk_size(n_outputs)

    def __call__(self, x):
        g = self.lin.forward(x).double()
        J = self.lin.jacobian(x).double()
        return g, J


class ProjectionFeatures(Features):
    """Features ``phi(x) = J(x) V`` for a given basis ``V`` (K directions of P).

    ``V`` need not be orthonormal: the prior Gram ``V^T V`` enters the posterior
    (subspace Laplace, ``theta = theta_hat + V w``).

    Parameters
    ----------
    V : Tensor of shape (K, P) or dict of str to Tensor of shape (K, *param_shape)
        The directions, as rows.
    """

    def __init__(self, V):
        self.V = V

    def fit(self, lin, data=None):
        """Record the network and the prior Gram ``V^T V`` (float64)."""
        self.lin = lin
        V = self.V
        flat = (torch.cat([V[n].reshape(V[n].shape[0], -1) for n in lin.names], 1)
                if isinstance(V, dict) else V)
        flat = flat.double()
        self.dim = int(flat.shape[0])
        self.prior_gram = flat @ flat.T
        self._tangents = lin.unflatten(flat.to(lin.dtype))
        theta = lin.flat_params().double()
        self.theta_sq_norm = float(theta @ theta)
        self.n_outside = lin.n_params - self.dim
        return self

    def __call__(self, x):
        g, phi = self.lin.jvp(x, self._tangents)
        return g.double(), phi.double()


def _check_finite_outputs(g, where):
    if not bool(torch.isfinite(g).all()):
        raise ValueError(
            f"the network produced non-finite outputs (NaN or inf) on {where}; check the "
            "inputs' scale and the network's weights"
        )


def phi_lam(lik, g, phi):
    """``A^T phi`` with ``Lam = A A^T`` (unit noise for a Gaussian likelihood)."""
    if lik.unit_curvature:
        return phi
    return torch.einsum("bck,bcl->bkl", lik.lam_factor(g), phi)


def _accumulate_batch(feats, lik, G, x, y):
    """Add one batch's ``phi^T Lam phi`` to ``G``; returns (fit statistic, rows)."""
    g, phi = feats(x)
    _check_finite_outputs(g, "training rows")
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


def _residual_kernel(feats, W, x, phi):
    """``k(x, x) - phi R^-1 phi^T`` per point: the NTK outside span(V) (C x C, symmetric)."""
    if W is None:
        inside = phi @ phi.transpose(1, 2)
    else:
        pw = phi @ W
        inside = pw @ pw.transpose(1, 2)
    res = feats.ntk_diag(x) - inside
    return 0.5 * (res + res.transpose(1, 2))


def _prior_shrinkage(e, s0, s2, prior_scale):
    """Posterior variances ``1 / (e / s2 + prior_scale / s0)`` along the eigenvectors."""
    scale = 1.0 / s2 if s2 is not None and not np.isnan(s2) else 1.0
    return 1.0 / (e * scale + prior_scale / s0)


def uses_mc_link(lik):
    """Whether the likelihood's predictive draws Monte Carlo samples (``link_approx="mc"``)."""
    return getattr(lik, "link_approx", None) == "mc"


def mc_seed(lik, generator):
    """A seed for a validation pass's Monte Carlo draws, from ``generator``.

    One seed per selection gives every candidate the same draws (common random
    numbers), on every partition alike; for other links it is 0 and ``generator``
    is left untouched.
    """
    if not uses_mc_link(lik):
        return 0
    return int(torch.randint(2**62, (1,), generator=generator))


def validation_residuals(lin, batches):
    """Row sums ``(sum (y - g)^2, number of scalars)`` of the network on ``batches``."""
    sq, n = 0.0, 0
    for x, y in batches:
        g = lin.forward(x).to(torch.float64)
        _check_finite_outputs(g, "validation rows")
        sq += float(((y - g) ** 2).sum())
        n += y.numel()
    return sq, n


def validation_nll(payload, batches):
    """Row sums of the negative log predictive over a grid of ``(s0^2, s2)``.

    A row-sum pass (:meth:`~sklearn_lla._core.protocol.FitData.reduce`): on dask
    validation data it runs per partition on the workers and only the
    ``len(s0) x len(s2)`` sums travel back.

    Parameters
    ----------
    payload : tuple
        ``(features, W, residual_correction, likelihood, T, eigvals, prior_scale,
        s0s, s2s, seed)``: the fitted feature map, the whitening map of the residual
        correction, the GGN eigenvectors ``T`` and eigenvalues, the candidates
        (``s2`` NaN for classification) and the seed of a Monte Carlo link.
    batches : iterable of (x, y)

    Returns
    -------
    tuple of (Tensor of shape (len(s0s), len(s2s)), int)
        The summed NLL per candidate (float64) and the number of rows.
    """
    feats, W, residual, lik, T, e, prior_scale, s0s, s2s, seed = payload
    scores = torch.zeros((len(s0s), len(s2s)), dtype=torch.float64)
    mc = uses_mc_link(lik)
    gen = torch.Generator().manual_seed(seed) if mc else None
    liks = [lik if np.isnan(s2) else lik.with_noise(s2) for s2 in s2s]
    n = 0
    for x, y in batches:
        g, phi = feats(x)
        _check_finite_outputs(g, "validation rows")
        res = _residual_kernel(feats, W, x, phi) if residual else None
        psi = torch.einsum("bck,kl->bcl", phi, T)
        eps = None
        if mc:
            eps = torch.randn((lik.n_samples, *g.shape), dtype=g.dtype,
                              generator=gen).to(g.device)
        n += g.shape[0]
        for i, s0 in enumerate(s0s):
            for j, s2 in enumerate(s2s):
                d = _prior_shrinkage(e, s0, None if np.isnan(s2) else s2, prior_scale)
                cov = torch.einsum("bck,k,bdk->bcd", psi, d, psi)
                if res is not None:
                    cov = cov + s0 * res
                scores[i, j] -= float(liks[j].log_predictive(g, cov, y, eps=eps).sum())
    return scores, n


class GLMPosterior(Posterior):
    """Linearised-Laplace posterior of a generalised linear model in features ``phi``.

    Parameters
    ----------
    features : Features
        The feature map (fitted in :meth:`fit`).
    prior_variance : float or "auto", default="auto"
    noise_variance : float, "auto" or None, default=None
        Regression noise (``None`` for classification).
    hyper : {"auto", "evidence", "validation", "weight_norm"}, default="auto"
        Strategy for ``"auto"`` values: ``"auto"`` uses ``validation`` when the data
        carries a validation set and ``fallback`` otherwise.
    fallback : {"evidence", "weight_norm"}, default="evidence"
        The strategy without validation data.
    validation_grid : ValidationGrid, optional
        The grid of the ``validation`` strategy.
    early_stopping : bool, default=False
        Stream the training data in random order, evaluate the validation NLL every
        ``search_freq`` points with prior term ``(n_seen / N) V^T V / s0^2`` and keep
        the best state (ELLA's remedy for over-concentration at large N).
    search_freq : int, default=1000
    n_iter_no_change : int, default=5
    residual_correction : bool, default=False
        Add the prior variance outside ``span(V)``, ``s0^2 (k(x,x) - phi R^-1 phi^T)``.
    label : str, default="LLA"
        The method's name in progress bars.
    """

    fitted_attributes = ("features", "prior_variance", "likelihood", "eigvals", "T", "d",
                         "n_seen", "prior_scale", "hyper_strategy", "hyper_trace",
                         "log_evidence")

    def __init__(self, features, prior_variance="auto", noise_variance=None, hyper="auto",
                 validation_grid=None, early_stopping=False, search_freq=1000,
                 n_iter_no_change=5, residual_correction=False, label="LLA",
                 fallback="evidence"):
        self.features = features
        self.prior_variance = prior_variance
        self.noise_variance = noise_variance
        self.hyper = hyper
        self.validation_grid = validation_grid or ValidationGrid()
        self.early_stopping = early_stopping
        self.search_freq = search_freq
        self.n_iter_no_change = n_iter_no_change
        self.residual_correction = residual_correction
        self.label = label
        self.fallback = fallback

    # ---------------------------------------------------------------- pieces
    def _phi_lam(self, lik, g, phi):
        """``A^T phi`` with ``Lam = A A^T`` (unit noise for a Gaussian likelihood)."""
        return phi_lam(lik, g, phi)

    def _whiten_map(self):
        """``W = L^-T`` with ``L L^T = V^T V`` (``None`` for an identity prior Gram)."""
        R = self.features.prior_gram
        if R is None:
            return None
        L = safe_cholesky(R.double(), "prior Gram V^T V")
        eye = torch.eye(len(L), dtype=L.dtype, device=L.device)
        return torch.linalg.solve_triangular(L, eye, upper=False).T

    def _decompose(self, G):
        """Eigenvalues of the prior-whitened Gram and the whitened eigenvectors ``T``."""
        G = 0.5 * (G + G.T)
        W = self._W
        e, U = safe_eigh(G if W is None else W.T @ G @ W, "GGN in feature space")
        return e.clamp_min(0.0), (U if W is None else W @ U)

    # ---------------------------------------------------------------- fitting
    def _strategy(self, data):
        auto = self.prior_variance == "auto" or self.noise_variance == "auto"
        if not auto:
            return "fixed"
        hyper = self.hyper
        if hyper == "auto":
            hyper = "validation" if data.validation is not None else self.fallback
        if hyper == "validation" and data.validation is None:
            raise ValueError("hyper_strategy='validation' needs held-out data: pass "
                             "validation_data to fit")
        return hyper

    def fit(self, data: FitData) -> GLMPosterior:
        """Build the features, stream the data, choose hyperparameters, factorise."""
        lik = data.likelihood
        feats = self.features.fit(data.lin, data)
        K, N, C = feats.dim, data.n_samples, data.n_outputs
        strategy = self._strategy(data)
        if self.early_stopping and data.validation is None:
            raise ValueError("early stopping needs validation data")
        bs = min(data.batch_size, feats.max_batch(C))
        if self.early_stopping:
            bs = min(bs, self.search_freq)
            order = torch.randperm(N, generator=data.generator).numpy()
        else:
            order = None
        self.history = []
        self._W = self._whiten_map()
        desc = f"{self.label}: accumulating the GGN"
        if not self.early_stopping:  # one row-sum pass (per partition on dask input)
            G, fit_stat, n_seen = data.reduce(ggn_statistics, (feats, lik, data.device), bs,
                                              desc=desc)
        else:
            G, fit_stat, n_seen = self._early_stopping_pass(data, feats, lik, K, N, bs,
                                                            order, desc)
        prior_scale = n_seen / N
        result, e, T = self._select(data, G, "validation" if self.early_stopping else strategy,
                                    prior_scale, fit_stat, n_seen)
        self.prior_variance = result.prior_variance
        s2 = result.noise_variance
        self.likelihood = lik.with_noise(s2) if lik.task == "regression" else lik
        self.noise_variance = s2
        self.eigvals, self.T = e, T
        self.d = _prior_shrinkage(e, self.prior_variance, s2, prior_scale)
        self.n_seen, self.prior_scale = n_seen, prior_scale
        self.hyper_strategy = result.strategy
        self.hyper_trace = result.trace
        self.log_evidence = self._log_evidence(e, self.prior_variance, s2, fit_stat, n_seen * C)
        return self

    def _early_stopping_pass(self, data, feats, lik, K, N, bs, order, desc):
        """Stream in random order, checking the validation NLL; the best state."""
        G = torch.zeros((K, K), dtype=torch.float64, device=data.device)
        fit_stat = 0.0  # residual sum of squares (regression) or log likelihood
        bar = data.progress(N, desc)
        n_seen, next_check, bad = 0, self.search_freq, 0
        best = None
        for x, y in data.batches(bs, order=order):
            df, b = _accumulate_batch(feats, lik, G, x, y)
            fit_stat += df
            n_seen += b
            if bar is not None:
                bar.update(b)
            if n_seen >= next_check or n_seen == N:
                next_check += self.search_freq
                try:
                    res = self._select(data, G, "validation", n_seen / N, fit_stat, n_seen,
                                       warn=False)
                    score = res[0].trace["best_score"]
                except FloatingPointError:  # no finite candidate at this check
                    score = np.inf
                self.history.append((n_seen, score))
                if np.isfinite(score) and (best is None or score < best[0]):
                    best = (score, G.clone(), n_seen, fit_stat)
                    bad = 0
                else:
                    bad += 1
                    if bad >= self.n_iter_no_change:
                        break
        if bar is not None:
            bar.close()
        if best is None:
            raise FloatingPointError(
                "early stopping: the validation NLL was not finite at any check; check "
                "the validation data and the network's outputs on it")
        _, G, n_seen, fit_stat = best
        return G, fit_stat, n_seen

    def _log_evidence(self, e, s0, s2, fit_stat, n_obs):
        return float(glm_log_evidence(s0, s2, eigvals=e.cpu().numpy(),
                                      theta_sq_norm=self.features.theta_sq_norm,
                                      data_fit=fit_stat, n_obs=n_obs,
                                      n_outside=self.features.n_outside))

    def _select(self, data, G, strategy, prior_scale, fit_stat, n_seen, warn=True):
        e, T = self._decompose(G)
        lik = data.likelihood
        regression = lik.task == "regression"
        s2 = self.noise_variance if regression else None
        if strategy == "fixed":
            return Fixed().select(self.prior_variance, s2), e, T
        feats = self.features
        if strategy == "weight_norm":
            return WeightNorm().select(self.prior_variance, s2, theta_sq_norm=feats.theta_sq_norm,
                                       n_params=feats.dim + feats.n_outside), e, T
        if strategy == "evidence":
            res = Evidence().select(
                self.prior_variance, s2, eigvals=e.cpu().numpy(),
                theta_sq_norm=feats.theta_sq_norm, data_fit=fit_stat,
                n_obs=n_seen * data.n_outputs, n_params=feats.dim + feats.n_outside,
                n_outside=feats.n_outside)
            return res, e, T
        if strategy != "validation":
            raise ValueError(f"unknown hyperparameter strategy {strategy!r}")
        val = data.validation
        bs = min(val.batch_size, feats.max_batch(data.n_outputs))
        base_prior = max(feats.theta_sq_norm / max(feats.dim + feats.n_outside, 1), 1e-12)
        base_noise = None
        if regression:
            sq, cnt = val.reduce(validation_residuals, feats.lin, bs)
            base_noise = max(float(sq) / max(cnt, 1), 1e-12)
        seed = mc_seed(lik, data.generator)
        W = self._W if self.residual_correction else None

        def score(s0s, s2s):
            payload = (feats, W, self.residual_correction, lik, T, e, prior_scale,
                       np.asarray(s0s, dtype=float), np.asarray(s2s, dtype=float), seed)
            total, n = val.reduce(validation_nll, payload, bs)
            return total.cpu().numpy() / max(n, 1)

        res = self.validation_grid.select(self.prior_variance, s2, score=score,
                                          base_prior=base_prior, base_noise=base_noise,
                                          warn=warn)
        return res, e, T

    # ---------------------------------------------------------------- prediction
    def predict(self, x):
        """Latent predictive ``N(g(x), phi T diag(d) T^T phi^T)`` at a batch ``x``."""
        g, phi = self.features(x)
        psi = phi @ self.T
        cov = torch.einsum("bck,k,bdk->bcd", psi, self.d, psi)
        if self.residual_correction:
            cov = cov + self.prior_variance * _residual_kernel(self.features, self._W, x, phi)
        return LatentPredictive(g, 0.5 * (cov + cov.transpose(1, 2)))

    def predict_joint(self, x):
        """Mean (B, C) and the joint latent covariance (B*C, B*C) at ``x``."""
        g, phi = self.features(x)
        B, C, K = phi.shape
        Z = (phi @ self.T).reshape(B * C, K) * self.d.sqrt()
        cov = Z @ Z.T
        if self.residual_correction:
            k = self.features.lin.kernel(x, n_outputs=C)
            pr = phi.reshape(B * C, K)
            inside = (pr @ pr.T) if self._W is None else (pr @ self._W) @ (pr @ self._W).T
            cov = cov + self.prior_variance * (k - inside)
        return g, 0.5 * (cov + cov.T)
