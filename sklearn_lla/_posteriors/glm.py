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
import functools
import warnings
from dataclasses import replace

import numpy as np
import torch

from .._core import calibration as cal
from .._core.hyper import HyperContext, HyperparameterWarning, ValidationGrid, resolve, strategy
from .._core.likelihoods import mc_seed, uses_mc_link
from .._core.linalg import cholesky, safe_eigh
from .._core.optim import Patience
from .._core.protocol import (
    FitData,
    LatentPredictive,
    Posterior,
    check_finite_outputs,
    validation_residuals,
)
from .._network.linearized import stack_flat
from .complement import (
    KFACComplement,
    kfac_and_rows_pass,
    supports_kfac_complement,
    training_rows_cache,
)
from .glm_stats import _accumulate_batch, _batch_ggn_trace, _ggn_of_rows, ggn_statistics
from .kfac_layers import layer_factors

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

    #: Whether :meth:`fit` takes ``held=``: training rows to read instead of computing.
    takes_held_rows = False

    @abc.abstractmethod
    def fit(self, lin, data: FitData) -> Features:  # pragma: no cover - interface
        """Build the basis (if any) from the training data; returns ``self``."""

    @abc.abstractmethod
    def __call__(self, x: torch.Tensor):  # pragma: no cover - interface
        """``g(x)`` (B, C) and ``phi(x)`` (B, C, K), float64."""

    def max_batch(self, n_outputs: int) -> int:
        """Largest batch whose features fit the memory budget."""
        return 1 << 30

    def ntk_diag(self, x: torch.Tensor) -> torch.Tensor:
        """Per-point NTK blocks ``J(x) J(x)^T`` (B, C, C), float64."""
        return self.lin.ntk_diag_blocks(x).double()

    def with_ntk_diag(self, x: torch.Tensor):
        """``(g, phi, ntk_diag(x))``; subclasses share the work on ``x`` where they can."""
        g, phi = self(x)
        return g, phi, self.ntk_diag(x)

    #: The directions ``V`` as tangents (``{name: (K, *shape)}`` or ``(K, P)``) for
    #: :meth:`of_rows`; ``None``: the features are not ``J(x) V`` for a stored ``V``.
    tangents = None

    def of_rows(self, rows, extra=None):
        """``(g, phi)`` from Jacobian rows already computed at the batch (all outputs).

        Parameters
        ----------
        rows : Rows
            The rows of a batch (with their ``output``), e.g. those the KFAC
            complement's terms are computed from
            (:meth:`~sklearn_lla._posteriors.complement.KFACComplement.
            features_and_covariance`).
        extra : dict of str to Tensor of shape (L, *param_shape), optional
            More directions ``U``, multiplied in the same product.

        Returns
        -------
        g : Tensor of shape (B, C)
        phi : Tensor of shape (B, C, K)
            Both float64, equal to ``self(x)``.
        ju : Tensor of shape (B, C, L)
            ``J(x) U^T`` in the network's dtype (only with ``extra``).
        """
        if self.tangents is None:
            raise NotImplementedError(f"{type(self).__name__} has no stored directions")
        T = self.lin._tangents(self.tangents)
        K = next(iter(T.values())).shape[0]
        if extra is not None:
            T = {n: torch.cat([T[n], extra[n].to(T[n].dtype)]) for n in T}
        B, C = rows.output.shape
        with torch.no_grad():
            prod = rows.matmul(T).view(B, C, -1)
        g, phi = rows.output.double(), prod[..., :K].double()
        return (g, phi) if extra is None else (g, phi, prod[..., K:])


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
        flat = (stack_flat(V, lin.names) if isinstance(V, dict) else V).double()
        self.dim = int(flat.shape[0])
        self.prior_gram = flat @ flat.T
        self._tangents = lin.unflatten(flat.to(lin.dtype))
        theta = lin.flat_params().double()
        self.theta_sq_norm = float(theta @ theta)
        self.n_outside = lin.n_params - self.dim
        return self

    @property
    def tangents(self):
        """The directions ``V`` (:meth:`Features.of_rows`)."""
        return self._tangents

    def __call__(self, x):
        g, phi = self.lin.jvp(x, self._tangents)
        return g.double(), phi.double()

    def with_ntk_diag(self, x):
        """``(g, phi, J(x) J(x)^T)`` from one evaluation of the Jacobian at ``x``."""
        g, phi, k = self.lin.jvp_and_ntk_diag(x, self._tangents)
        return g.double(), phi.double(), k


def _residual_kernel(feats, W, x, phi, kdiag=None):
    """``k(x, x) - phi R^-1 phi^T`` per point: the NTK outside span(V) (C x C, symmetric).

    ``kdiag``: ``k(x, x)`` when already computed."""
    if W is None:
        inside = phi @ phi.transpose(1, 2)
    else:
        pw = phi @ W
        inside = pw @ pw.transpose(1, 2)
    res = (feats.ntk_diag(x) if kdiag is None else kdiag.double()) - inside
    return 0.5 * (res + res.transpose(1, 2))


def _orthonormal(phi, W):
    """``J(x) Q^T`` with ``Q = W^T V^T`` the orthonormal rows spanning ``span(V)``."""
    return phi if W is None else phi @ W


def _prior_shrinkage(e, s0, s2, prior_scale):
    """Posterior variances ``1 / (e / s2 + prior_scale / s0)`` along the eigenvectors."""
    scale = 1.0 / s2 if s2 is not None and not np.isnan(s2) else 1.0
    return 1.0 / (e * scale + prior_scale / s0)


def validation_nll(payload, batches):
    """Row sums of the negative log predictive for candidate hyperparameters.

    A row-sum pass (:meth:`~sklearn_lla._core.protocol.FitData.reduce`): on dask
    validation data it runs per partition on the workers and only the per-candidate
    sums travel back. Candidate ``k``'s latent covariance is
    ``phi T diag(D[k]) T^T phi^T`` (plus ``s0s[k]`` times the residual kernel).

    Parameters
    ----------
    payload : tuple
        ``(features, W, residual, likelihood, T, D, s0s, s2s, seed)``: the
        fitted feature map, the whitening map ``W`` of ``span(V)``, the residual
        correction (``True``: the prior outside ``span(V)``; a
        :class:`~sklearn_lla._posteriors.complement.KFACComplement`; else none), the
        factor ``T`` (K x K), the per-candidate shrinkage rows ``D`` (n x K), the
        candidates' prior and noise variances (``s2`` NaN for classification) and
        the seed of a Monte Carlo link.
    batches : iterable of (x, y)

    Returns
    -------
    tuple of (Tensor of shape (n,), int)
        The summed NLL per candidate (float64) and the number of rows.
    """
    feats, W, residual, lik, T, D, s0s, s2s, seed = payload
    comp = residual if isinstance(residual, KFACComplement) else None
    scores = torch.zeros(len(s0s), dtype=torch.float64)
    mc = uses_mc_link(lik)
    gen = torch.Generator().manual_seed(seed) if mc else None
    liks = [lik if np.isnan(s2) else lik.with_noise(s2) for s2 in s2s]
    n = 0
    for x, y in batches:
        g, phi = feats(x)
        check_finite_outputs(g, "validation rows")
        res = _residual_kernel(feats, W, x, phi) if residual is True else None
        outside = {}  # the KFAC complement per (mult, tau): Sigma = mult * unit(tau)
        facs = None  # its layer factors at x, computed once for every tau
        psi = torch.einsum("bck,kl->bcl", phi, T)
        eps = None
        if mc:
            eps = torch.randn((lik.n_samples, *g.shape), dtype=g.dtype,
                              generator=gen).to(g.device)
        n += g.shape[0]
        for k in range(len(s0s)):
            cov = torch.einsum("bck,k,bdk->bcd", psi, D[k], psi)
            if res is not None:
                cov = cov + float(s0s[k]) * res
            if comp is not None:
                s2k = None if np.isnan(s2s[k]) else float(s2s[k])
                mult, tau = comp._key(float(s0s[k]), s2k)
                if tau not in outside:
                    if facs is None:
                        facs = comp.chunk_factors(x, g.shape[1])
                    outside[tau] = comp.unit_covariance(x, _orthonormal(phi, W), tau, facs)
                cov = cov + mult * outside[tau]
            scores[k] -= float(liks[k].log_predictive(g, cov, y, eps=eps).sum())
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
        Strategy for ``"auto"`` values (:func:`~sklearn_lla._core.hyper.resolve`):
        ``"auto"`` is the GLM family's objective for the task; ``"validation"`` the
        joint held-out grid, only when asked for.
    validation_grid : ValidationGrid, optional
        The grid of the ``validation`` strategy.
    early_stopping : bool, default=False
        Stream the training data in random order, evaluate the held-out NLL every
        ``search_freq`` points (the posterior of the rows seen so far, prior weighted by
        ``n_seen / N``, hyperparameters by the objective and the noise calibrated as in
        :meth:`~sklearn_lla._core.protocol.Posterior.calibrate`) and keep the best
        state (ELLA's remedy for over-concentration at large N). Needs rows the network did not fit.
    search_freq : int, default=1000
    n_iter_no_change : int, default=5
    residual_correction : bool or "kfac", default=False
        The posterior outside ``span(V)``: ``True`` the prior,
        ``s0^2 (k(x,x) - phi R^-1 phi^T)``; ``"kfac"`` a KFAC posterior projected on
        the complement (:mod:`sklearn_lla._posteriors.complement`; networks on the
        generic ``torch.func`` Jacobian backend fall back to ``False``); ``False`` none.
    label : str, default="LLA"
        The method's name in progress bars.
    """

    #: During :meth:`fit` only: KFAC factor sums and the training rows of their pass
    #: (a :class:`~sklearn_lla._posteriors.subspace_kfac.RowCache`) made before the GGN
    #: (subspace Laplace's projector, ELLA's first pass), read instead of a pass.
    _kfac_sums = _kfac_rows = None

    fitted_attributes = ("features", "prior_variance", "likelihood", "eigvals", "T", "d",
                         "complement",
                         "n_seen", "prior_scale", "hyper_strategy", "hyper_trace",
                         "log_evidence")

    def __init__(self, features, prior_variance="auto", noise_variance=None, hyper="auto",
                 validation_grid=None, early_stopping=False, search_freq=1000,
                 n_iter_no_change=5, residual_correction=False, label="LLA"):
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

    # ---------------------------------------------------------------- pieces
    def _whiten_map(self):
        """``W = L^-T`` with ``L L^T = V^T V`` (``None`` for an identity prior Gram)."""
        R = self.features.prior_gram
        if R is None:
            return None
        L = cholesky(R.double(), "prior Gram V^T V")
        eye = torch.eye(len(L), dtype=L.dtype, device=L.device)
        return torch.linalg.solve_triangular(L, eye, upper=False).T

    def _match_complement(self, G, prior_scale):
        """Match the KFAC complement's curvature to the GGN's trace outside ``span(V)``."""
        if self.complement is not None:
            Gs = G if self._W is None else self._W.T @ G @ self._W
            seen = self._seen_trace if self.early_stopping else None
            self.complement.match_trace(float(torch.trace(Gs)), prior_scale, seen)

    def _kept_rows(self):
        """Orthonormal rows ``Q = W^T V^T`` (K x P, float64) spanning ``span(V)``."""
        V = getattr(self.features, "V", None)
        if V is None:
            return None
        lin = self.features.lin
        flat = (stack_flat(V, lin.names) if isinstance(V, dict) else V).double()
        return flat if self._W is None else self._W.T @ flat

    def _decompose(self, G):
        """Eigenvalues of the prior-whitened Gram and the whitened eigenvectors ``T``."""
        G = 0.5 * (G + G.T)
        W = self._W
        e, U = safe_eigh(G if W is None else W.T @ G @ W, "GGN in feature space")
        return e.clamp_min(0.0), (U if W is None else W @ U)

    def _needs_spectrum(self):
        """Whether the strategy needs the eigendecomposition (else one Cholesky).

        The evidence, the validation grid and every noise search score many candidate
        hyperparameters from one eigendecomposition; the weight norm and fixed
        values need one posterior only, which a Cholesky factor gives at a fraction
        of the cost (``docs/exact.md``).
        """
        noise_auto = self._regression and self.noise_variance == "auto"
        return self._strategy_obj().needs_spectrum or noise_auto

    def _spectrum_factor(self, G):
        """``(e, T)`` when the strategy needs the spectrum, else ``(None, G)``."""
        if self._needs_spectrum():
            return self._decompose(G)
        return None, 0.5 * (G + G.T)

    def _cholesky_factor(self, G, s0, s2, prior_scale):
        """``A = L^-T`` with ``L L^T = G / s2 + (prior_scale / s0) V^T V`` and
        ``sum log(1 + s0' e / s2)`` (``s0' = s0 / prior_scale``, ``e`` the whitened
        eigenvalues) from the factor's diagonal."""
        s2v = s2 if s2 is not None else 1.0
        c = prior_scale / s0
        R = self.features.prior_gram
        H = G / s2v
        if R is None:
            H.diagonal().add_(c)
            logdet_r = 0.0
        else:
            H = H + c * R.double()
            logdet_r = 2.0 * float(torch.log(torch.diagonal(
                cholesky(R.double(), "prior Gram V^T V"))).sum())
        L = cholesky(H, "posterior precision in feature space")
        K = len(L)
        eye = torch.eye(K, dtype=L.dtype, device=L.device)
        A = torch.linalg.solve_triangular(L, eye, upper=False).T
        logdet1p = (2.0 * float(torch.log(torch.diagonal(L)).sum()) - logdet_r
                    - K * np.log(c))
        return A, logdet1p

    # ---------------------------------------------------------------- fitting
    def fit(self, data: FitData) -> GLMPosterior:
        """Build the features, stream the data, choose hyperparameters, factorise."""
        lik = data.likelihood
        self._training_pass_first(data)
        feats = (self.features.fit(data.lin, data, held=self._kfac_rows.items)
                 if self.features.takes_held_rows and self._kfac_rows is not None
                 else self.features.fit(data.lin, data))
        K, N = feats.dim, data.n_samples
        self._regression = lik.task == "regression"
        self._n_outputs = data.n_outputs
        self.auto_prior = self.prior_variance == "auto"
        auto = self.auto_prior or (self._regression and self.noise_variance == "auto")
        self._strategy = resolve(self.hyper, family="glm", task=lik.task, auto=auto,
                                 has_validation=data.validation is not None)
        if self.early_stopping and data.validation is None:
            raise ValueError(
                "early_stopping=True needs rows the network did not fit: pass "
                "validation_data=(X_val, y_val) to fit (rows of the training set are never "
                "used as validation)")
        bs = min(data.batch_size, feats.max_batch(data.n_outputs))
        self.history = []
        self._W = self._whiten_map()
        self.complement = None
        shared = None
        sums = self._kfac_sums  # (subspace Laplace's projector's; ELLA's first pass)
        if self.residual_correction == "kfac":
            if not supports_kfac_complement(data.lin):
                self.residual_correction = False
            elif sums is not None:  # the factors already summed: the GGN's pass alone
                self.complement = KFACComplement(data.lin, data, self._kept_rows(), sums=sums)
            elif (not self.early_stopping and feats.tangents is not None
                  and getattr(layer_factors(data.lin), "shares_rows", False)):
                # one pass over the training rows: the GGN of the features and the
                # complement's KFAC factors from the same rows (graph backend)
                state = [torch.zeros((K, K), dtype=torch.float64, device=data.device), 0.0, 0]
                shared = data.reduce(kfac_and_rows_pass, (
                    data.lin, lik, functools.partial(_ggn_of_rows, feats, lik), state),
                    bs, desc=f"{self.label}: accumulating the GGN and the KFAC factors")
                self.complement = KFACComplement(data.lin, data, self._kept_rows(),
                                                 sums=shared[:-3])
            else:
                self.complement = KFACComplement(data.lin, data, self._kept_rows())
        self._mc_seed = mc_seed(lik, data.generator)
        desc = f"{self.label}: accumulating the GGN"
        if shared is not None:
            G, fit_stat, n_seen = shared[-3:]
        elif not self.early_stopping:
            G, fit_stat, n_seen = self._ggn_pass(data, feats, lik, bs, desc)
        else:
            bs = min(bs, self.search_freq)
            order = torch.randperm(N, generator=data.generator).numpy()
            G, fit_stat, n_seen = self._early_stopping_pass(data, feats, lik, K, N, bs,
                                                            order, desc)
        self._fit_stat = fit_stat
        self.n_seen, self.prior_scale = n_seen, n_seen / N
        self._match_complement(G, self.prior_scale)
        self.eigvals, self._factor = self._spectrum_factor(G)
        del G
        result = self._objective(data, self.eigvals, self._factor, self.prior_scale,
                                 fit_stat, n_seen)
        self._set_hyperparameters(lik, result.prior_variance, result.noise_variance)
        self.hyper_strategy = result.strategy
        self.hyper_trace = result.trace
        self._kfac_sums = self._kfac_rows = None
        return self

    def _training_pass_first(self, data):
        """Sets :attr:`_kfac_sums` and :attr:`_kfac_rows` from one
        :func:`kfac_and_rows_pass` made before the features, which take rows from it
        (:attr:`Features.takes_held_rows`: ELLA's Nystrom rows), when the rows can be
        held (:func:`training_rows_cache`; rows ``None``: they outgrew it); else leaves
        them. No random draws."""
        if not (self.residual_correction == "kfac" and not self.early_stopping
                and self.features.takes_held_rows and supports_kfac_complement(data.lin)):
            return
        cache = training_rows_cache(data)
        if cache is None:
            return
        bs = min(data.batch_size, self.features.max_batch(data.n_outputs))
        self._kfac_sums = data.reduce(
            kfac_and_rows_pass, (data.lin, data.likelihood, cache.add, []), bs,
            desc=f"{self.label}: the training rows and the KFAC factors")
        self._kfac_rows = cache if cache.items is not None else None

    def _ggn_pass(self, data, feats, lik, bs, desc):
        """``(G, fit statistic, n_rows)`` of the features over the training rows: from
        the rows a KFAC pass kept (:attr:`_kfac_rows`), else one row-sum pass (per
        partition on dask input)."""
        if self._kfac_rows is None:
            return data.reduce(ggn_statistics, (feats, lik, data.device), bs, desc=desc)
        state = [torch.zeros((feats.dim, feats.dim), dtype=torch.float64, device=data.device),
                 0.0, 0]
        for rows, y in self._kfac_rows.items:
            _ggn_of_rows(feats, lik, rows, None, y, state)
        return tuple(state)

    def _set_hyperparameters(self, lik, s0, s2):
        """Fix ``(s0^2, s2)``: the likelihood, the factor ``T diag(d) T^T`` and the evidence."""
        self.prior_variance = float(s0)
        self.noise_variance = s2
        self.likelihood = lik.with_noise(s2) if self._regression else lik
        s2e = s2 if self._regression else None
        if self.eigvals is not None:
            self.T = self._factor
            self.d = _prior_shrinkage(self.eigvals, self.prior_variance, s2e, self.prior_scale)
            s0e = self.prior_variance / self.prior_scale
            r = s0e * self.eigvals / (s2e if s2e is not None else 1.0)
            logdet1p = float(torch.log1p(r).sum())
        else:
            self.T, logdet1p = self._cholesky_factor(self._factor, self.prior_variance, s2e,
                                                     self.prior_scale)
            self.d = torch.ones(len(self.T), dtype=torch.float64, device=self.T.device)
        self.log_evidence = self._log_evidence(self.prior_variance, s2e, logdet1p)

    def _early_stopping_pass(self, data, feats, lik, K, N, bs, order, desc):
        """Stream in random order, checking the held-out NLL; the best state."""
        self._seen_trace = 0.0  # tr GGN of the rows seen (the KFAC complement's check)
        G = torch.zeros((K, K), dtype=torch.float64, device=data.device)
        fit_stat = 0.0  # residual sum of squares (regression) or log likelihood
        bar = data.progress(N, desc)
        n_seen, next_check = 0, self.search_freq
        best, patience = None, Patience(self.n_iter_no_change)
        for x, y in data.batches(bs, order=order):
            df, b = _accumulate_batch(feats, lik, G, x, y)
            fit_stat += df
            n_seen += b
            if self.complement is not None:
                self._seen_trace += _batch_ggn_trace(feats, lik, x)
            if bar is not None:
                bar.update(b)
            if n_seen >= next_check or n_seen == N:
                next_check += self.search_freq
                try:
                    score = self._held_out_score(data, G, n_seen / N, fit_stat, n_seen)
                except FloatingPointError:  # no finite candidate at this check
                    score = np.inf
                self.history.append((n_seen, score))
                if patience.update(score):
                    best = (G.clone(), n_seen, fit_stat, self._seen_trace)
                elif patience.stop:
                    break
        if bar is not None:
            bar.close()
        if best is None:
            raise FloatingPointError(
                "early stopping: the held-out NLL was not finite at any check; check "
                "the validation data and the network's outputs on it")
        G, n_seen, fit_stat, self._seen_trace = best
        return G, fit_stat, n_seen

    def _held_out_score(self, data, G, prior_scale, fit_stat, n_seen):
        """Held-out NLL of the posterior of the rows seen so far (early stopping): at the
        objective's hyperparameters, calibrated on the held-out rows as :meth:`fit`'s
        result will be (:meth:`~sklearn_lla._core.protocol.Posterior.calibrate`)."""
        self._match_complement(G, prior_scale)
        e, F = self._spectrum_factor(G)
        val = data.validation
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", HyperparameterWarning)
            res = self._objective(data, e, F, prior_scale, fit_stat, n_seen, warn=False)
            if self._strategy_obj().uses_held_out:
                return res.trace["best_score"]
            if self._regression and self.noise_variance == "auto":
                def score(s0s, s2s):
                    return self._score_eig(val, e, F, prior_scale, s0s, s2s)

                s0, s2 = res.prior_variance, res.noise_variance
                if not self.auto_prior:
                    trace = cal.calibrate_noise_refit(score, s0, self._base_noise(val),
                                                      warn=False)[1]
                    return trace["best_score"]
                return cal.rescaled_nll(lambda c: float(score([c * s0], [c * s2])[0]),
                                        self._n_outputs)
        s2 = res.noise_variance if self._regression else None
        if e is None:
            A, _ = self._cholesky_factor(F, res.prior_variance, s2, prior_scale)
            D = torch.ones((1, len(A)), dtype=torch.float64, device=A.device)
            return float(self._score(data.validation, A, D, [res.prior_variance],
                                     [np.nan if s2 is None else s2])[0])
        return float(self._score_eig(data.validation, e, F, prior_scale, [res.prior_variance],
                                     [np.nan if s2 is None else s2])[0])

    def _log_evidence(self, s0, s2, logdet1p):
        """Laplace log evidence of the rows seen, at prior ``s0 / prior_scale``."""
        s0e = s0 / self.prior_scale
        if s2 is None:
            fit = self._fit_stat
        else:
            n_obs = self.n_seen * self._n_outputs
            fit = -0.5 * n_obs * np.log(2 * np.pi * s2) - 0.5 * self._fit_stat / s2
        return float(fit - 0.5 * self.features.theta_sq_norm / s0e - 0.5 * logdet1p
                     - 0.5 * self._n_outside * np.log(s0e))

    def _score(self, val, T, D, s0s, s2s):
        """Mean held-out NLL of each candidate (one pass over ``val``)."""
        feats = self.features
        bs = min(val.batch_size, feats.max_batch(val.n_outputs))
        W = self._W if self.residual_correction else None
        residual = self.complement if self.complement is not None else (
            self.residual_correction is True)
        payload = (feats, W, residual, val.likelihood, T, D,
                   np.asarray(s0s, dtype=float), np.asarray(s2s, dtype=float), self._mc_seed)
        total, n = val.reduce(validation_nll, payload, bs)
        return total.cpu().numpy() / max(n, 1)

    def _score_eig(self, val, e, T, prior_scale, s0s, s2s):
        """:meth:`_score` of ``(s0s[k], s2s[k])`` pairs on the spectrum ``(e, T)``."""
        D = torch.stack([_prior_shrinkage(e, float(a), None if np.isnan(b) else float(b),
                                          prior_scale) for a, b in zip(s0s, s2s)])
        return self._score(val, T, D, s0s, s2s)

    @property
    def _n_outside(self):
        """Directions whose prior normaliser stays in the evidence: none when the residual
        correction keeps their prior variance in the predictive (the full-space Laplace
        evidence with curvature only in ``span(V)``, where the ``P - K`` terms cancel)."""
        return 0 if self.residual_correction else self.features.n_outside

    def _context(self, e, prior_scale, fit_stat, n_seen, warn=True):
        """The :class:`~sklearn_lla._core.hyper.HyperContext` of this spectrum."""
        feats = self.features
        return HyperContext(
            prior_variance=self.prior_variance,
            noise_variance=self.noise_variance if self._regression else None,
            eigvals=None if e is None else e.cpu().numpy(),
            theta_sq_norm=feats.theta_sq_norm, data_fit=fit_stat,
            n_obs=n_seen * self._n_outputs, n_params=feats.lin.n_params,
            n_outside=self._n_outside, prior_scale=prior_scale, warn=warn,
            outside_log_det=(None if self.complement is None
                             else self.complement.outside_log_det))

    def _strategy_obj(self):
        """The strategy object of :attr:`_strategy`."""
        return strategy(self._strategy, validation=self.validation_grid)

    def _base_noise(self, val):
        """The network's mean squared residual on the held-out rows ``val``."""
        bs = min(val.batch_size, self.features.max_batch(val.n_outputs))
        sq, cnt = val.reduce(validation_residuals, self.features.lin, bs)
        return max(float(sq) / max(cnt, 1), 1e-12)

    def _objective(self, data, e, T, prior_scale, fit_stat, n_seen, warn=True):
        """The strategy's hyperparameters on the spectrum ``e`` (no held-out rows used,
        except by a strategy that scores them, when asked for by name)."""
        feats = self.features
        ctx = self._context(e, prior_scale, fit_stat, n_seen, warn)
        strat = self._strategy_obj()
        if strat.uses_held_out:
            val = data.validation

            def score(s0s, s2s):  # the grid: every (s0, s2) combination
                a, b = np.meshgrid(np.asarray(s0s, float), np.asarray(s2s, float),
                                   indexing="ij")
                return self._score_eig(val, e, T, prior_scale, a.ravel(),
                                       b.ravel()).reshape(a.shape)

            ctx = replace(ctx, score=score,
                          base_prior=max(feats.theta_sq_norm / max(feats.lin.n_params, 1),
                                         1e-12),
                          base_noise=self._base_noise(val) if self._regression else None)
        return strat.select(ctx)

    # ---------------------------------------------------------------- calibration
    #: The posterior at ``(c s0^2, c s2)`` is ``c`` times this one, and is refitted for
    #: a candidate noise from the one eigendecomposition.
    rescalable = True
    refits_noise = True

    def rescale(self, c):
        """Move to ``(c s0^2, c s2)``."""
        self._set_hyperparameters(self.likelihood, c * self.prior_variance,
                                  c * float(self.likelihood.noise_variance))

    def held_out_pairs(self, validation):
        """Held-out NLL per ``(s0^2, s2)`` pair on this spectrum, and the base noise."""
        return (lambda s0s, s2s: self._score_eig(validation, self.eigvals, self._factor,
                                                 self.prior_scale, s0s, s2s),
                self._base_noise(validation))

    def refit_noise(self, noise_variance):
        """Refit at ``noise_variance`` (the prior variance kept)."""
        self._set_hyperparameters(self.likelihood, self.prior_variance, noise_variance)

    # ---------------------------------------------------------------- prediction
    def _noise(self):
        """The noise variance in use (``None`` for classification)."""
        return float(self.likelihood.noise_variance) if self._regression else None

    def predict(self, x):
        """Latent predictive ``N(g(x), phi T diag(d) T^T phi^T)`` at a batch ``x``."""
        outside = None
        if self.complement is None and self.residual_correction:
            g, phi, kdiag = self.features.with_ntk_diag(x)
        elif (self.complement is not None and self.complement.shares_rows
              and self.features.tangents is not None):
            # one forward + backward pass for the features and the complement's terms
            g, phi, outside = self.complement.features_and_covariance(
                x, self.features, self._W, self.prior_variance, self._noise())
        else:
            (g, phi), kdiag = self.features(x), None
        psi = phi @ self.T
        cov = torch.einsum("bck,k,bdk->bcd", psi, self.d, psi)
        if outside is not None:
            cov = cov + outside
        elif self.complement is not None:
            cov = cov + self.complement.covariance(x, _orthonormal(phi, self._W),
                                                   self.prior_variance, self._noise())
        elif self.residual_correction:
            cov = cov + self.prior_variance * _residual_kernel(self.features, self._W, x, phi,
                                                               kdiag)
        return LatentPredictive(g, 0.5 * (cov + cov.transpose(1, 2)))

    def predict_joint(self, x):
        """Mean (B, C) and the joint latent covariance (B*C, B*C) at ``x``."""
        g, phi = self.features(x)
        B, C, K = phi.shape
        Z = (phi @ self.T).reshape(B * C, K) * self.d.sqrt()
        cov = Z @ Z.T
        if self.complement is not None:
            cov = cov + self.complement.joint_covariance(x, _orthonormal(phi, self._W),
                                                         self.prior_variance, self._noise())
        elif self.residual_correction:
            k = self.features.lin.kernel(x, n_outputs=C)
            pr = phi.reshape(B * C, K)
            inside = (pr @ pr.T) if self._W is None else (pr @ self._W) @ (pr @ self._W).T
            cov = cov + self.prior_variance * (k - inside)
        return g, 0.5 * (cov + cov.T)
