"""Subspace Laplace (Faller & Martin): the projectors ``P`` and the posterior on their span.

Every projector returns the directions as the rows of a float64 ``(s, p)`` tensor
(``V = P^T``); the posterior itself is the GLM posterior with features ``J(x) V``
(:class:`sklearn_lla._posteriors.glm.ProjectionFeatures`), whose prior Gram ``V V^T`` makes the
result independent of the basis chosen inside ``span(P)``.

* ``lowrank-kfac`` / ``lowrank-diag`` (Algorithm 1): ``Psi_approx`` the KFAC or
  diagonal-GGN posterior covariance, ``M = J_X' Psi_approx J_X'^T`` over a subset
  ``X'`` of the training inputs, its top-``s`` eigenvectors ``U_s`` and
  ``P = Psi_approx J_X'^T U_s`` (orthonormalised: Theorem 1 holds for any
  reparametrisation ``P Q``);
* ``optimal`` (Theorem 1): the same with the full GGN posterior covariance
  ``Psi = (GGN + I / s0^2)^-1``, only for ``p <= MAX_OPTIMAL_PARAMS``;
* ``subset-magnitude`` / ``subset-diagonal`` / ``subset-swag``: the ``s``
  coordinates with the largest ``|theta|``, diagonal-GGN posterior variance or SWAG
  variance (Daxberger et al., 2021).

Memory: ``M`` is ``(n' C) x (n' C)``; ``Psi_approx`` (from
:mod:`sklearn_lla._network.curvature`) is applied to chunks of Jacobian rows, so no
``p x p`` matrix is formed except by ``optimal``.

:class:`SubspacePosterior` builds the projector (with the KFAC-evidence prior variance
of the paper when ``"auto"``) and runs :class:`~sklearn_lla._posteriors.glm.GLMPosterior`
on ``ProjectionFeatures``; the estimators are in :mod:`sklearn_lla.subspace`.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch

from .._core.hyper import Evidence
from .._core.linalg import dense_inverse, safe_eigh
from .._core.protocol import to_batch
from .._network.curvature import (
    KFAC,
    UnsupportedKFAC,
    _chunk,
    float64_view,
    full_ggn,
    ggn_diagonal,
    swag_variances,
)
from .glm import GLMPosterior, ProjectionFeatures, _check_finite_outputs

__all__ = ["SubspacePosterior", "PROJECTORS", "MAX_OPTIMAL_PARAMS", "lowrank_directions",
           "subset_directions"]

#: The projector names.
PROJECTORS = ("lowrank-kfac", "lowrank-diag", "subset-magnitude", "subset-diagonal",
              "subset-swag", "optimal")


#: Largest number of parameters for which ``projector="optimal"`` forms the dense
#: ``p x p`` posterior covariance.
MAX_OPTIMAL_PARAMS = 5000


def _top_eigvecs(M, s):
    lam, U = safe_eigh(0.5 * (M + M.T), "projected covariance J Psi J^T")
    lam, U = lam.flip(0), U.flip(1)
    tol = max(float(lam[0]), 0.0) * len(lam) * torch.finfo(torch.float64).eps * 10
    positive = int((lam > tol).sum())
    if positive == 0:
        raise ValueError("J Psi J^T is zero on the subset: the network's Jacobian vanishes")
    if positive < s:
        warnings.warn(f"J Psi J^T has only {positive} numerically positive eigenvalues on the "
                      f"{M.shape[0]} rows of the subset; using subspace_dim={positive} instead "
                      f"of {s}", RuntimeWarning, stacklevel=4)
        s = positive
    return lam[:s], U[:, :s]


def lowrank_directions(lin, X, n_outputs, psi, s, batch_size=256):
    """Algorithm 1: orthonormal rows spanning ``Psi J_X^T U_s``.

    Parameters
    ----------
    lin : LinearizedNet
        The (float64) network.
    X : Tensor of shape (n, ...)
        The inputs ``X'``.
    n_outputs : int
        ``C``.
    psi : callable
        ``T (p, k) -> Psi T (p, k)``, float64.
    s : int
        Subspace dimension (reduced to the numerical rank of ``M`` with a warning).
    batch_size : int, default=256
        Points per Jacobian chunk (also capped by the Jacobian memory budget).

    Returns
    -------
    V : Tensor of shape (s, p)
        Orthonormal rows, float64.
    lam : Tensor of shape (s,)
        The top eigenvalues of ``M = J_X Psi J_X^T``.
    """
    C, p, n = n_outputs, lin.n_params, X.shape[0]
    step = _chunk(lin, C, batch_size)
    chunks = [slice(i, min(i + step, n)) for i in range(0, n, step)]
    M = torch.empty((n * C, n * C), dtype=torch.float64, device=lin.device)

    def jac(sl):
        return lin.jacobian(X[sl]).double().reshape(-1, p)

    for si in chunks:
        Ji = jac(si)
        Z = psi(Ji.T)  # (p, b C)
        for sj in chunks:
            Jj = Ji if sj == si else jac(sj)
            M[sj.start * C:sj.stop * C, si.start * C:si.stop * C] = Jj @ Z
    lam, U = _top_eigvecs(M, s)
    del M
    Pm = torch.zeros((p, U.shape[1]), dtype=torch.float64, device=lin.device)
    for si in chunks:
        Pm += psi(jac(si).T) @ U[si.start * C:si.stop * C]
    Q, _ = torch.linalg.qr(Pm)
    return Q.T.contiguous(), lam


def subset_directions(scores, s):
    """Selection rows of the ``s`` largest ``scores`` (ties: the lower index first)."""
    p = scores.shape[0]
    s = min(int(s), p)
    order = np.argsort(-scores.cpu().numpy(), kind="stable")[:s]
    V = torch.zeros((s, p), dtype=torch.float64, device=scores.device)
    V[torch.arange(s), torch.as_tensor(np.sort(order), device=scores.device)] = 1.0
    return V


class SubspacePosterior(GLMPosterior):
    """The GLM posterior on the span of a projector built from the training data.

    Parameters
    ----------
    projector : str
        One of :data:`sklearn_lla._posteriors.subspace.PROJECTORS`.
    subspace_dim : int
        ``s``.
    prior_variance : float or "auto"
    noise_variance : float, "auto" or None
    hyper : {"auto", "evidence", "validation", "weight_norm"}, default="auto"
        ``"auto"``: an ``"auto"`` prior variance from the KFAC evidence (falls back to
        the subspace evidence when KFAC does not support the network), an ``"auto"``
        noise variance by the GLM posterior's ``"auto"``. Otherwise both by that GLM
        strategy on the subspace model.
    n_subset : int or "auto", default="auto"
        Size of the training subset ``X'`` of the low-rank and optimal projectors
        (``"auto"``: ``ceil(1000 / C)`` points, ``n C = 1000`` rows as in the paper).
    subspace_X : array-like or None, default=None
        Inputs to use as ``X'`` instead of a random training subset.
    swag_learning_rate : float, default=1e-2
    swag_n_steps : int, default=100
    """

    fitted_attributes = GLMPosterior.fitted_attributes + (
        "projector_rows", "projector_eigvals", "projector_prior_variance",
        "projector_noise_variance", "subset_indices")

    def __init__(self, projector, subspace_dim, prior_variance="auto", noise_variance=None,
                 hyper="auto", n_subset="auto", subspace_X=None, swag_learning_rate=1e-2,
                 swag_n_steps=100):
        super().__init__(None, prior_variance, noise_variance, hyper=hyper,
                         label="subspace Laplace")
        self.projector = projector
        self.subspace_dim = subspace_dim
        self.n_subset = n_subset
        self.subspace_X = subspace_X
        self.swag_learning_rate = swag_learning_rate
        self.swag_n_steps = swag_n_steps

    # ---------------------------------------------------------------- helpers
    def _fit_statistic(self, lin, data):
        """Residual sum of squares (regression) or log likelihood, one forward pass."""
        return data.reduce(_fit_statistic, (lin, data.likelihood))[0]

    def _subset_inputs(self, data):
        lin = data.lin
        if self.subspace_X is not None:
            X = np.asarray(self.subspace_X)
            self.subset_indices = None
            return to_batch(X, slice(0, len(X)), torch.float64, lin.device)
        N = data.n_samples
        n_subset = self.n_subset
        if n_subset == "auto":  # the paper: n C = 1000 rows (1000 points for one output)
            n_subset = max(1, -(-1000 // data.n_outputs))
        if n_subset >= N:
            idx = np.arange(N)
        else:
            idx = np.sort(torch.randperm(N, generator=data.generator)[:n_subset].numpy())
        self.subset_indices = idx
        x, _ = data.rows(idx)
        return x.double() if x.is_floating_point() else x

    def _hyper_for_projector(self, lin, data, kfac):
        """Prior (and noise) variances for the projector; fixes an evidence-chosen prior."""
        lik = data.likelihood
        regression = lik.task == "regression"
        P, N, C = lin.n_params, data.n_samples, data.n_outputs
        theta = lin.flat_params().double()
        theta_sq = float(theta @ theta)
        s0, s2 = self.prior_variance, (self.noise_variance if regression else None)
        self._kfac_result = None
        if s0 == "auto" and self.hyper == "auto" and kfac is not None:
            stat = self._fit_statistic(lin, data)
            res = Evidence().select(s0, s2, eigvals=kfac.eigvals(), theta_sq_norm=theta_sq,
                                    data_fit=stat, n_obs=N * C, n_params=P)
            self._kfac_result = res
            if data.validation is None:
                # no held-out rows: the KFAC evidence (the paper's choice) also fixes
                # the subspace posterior's prior; with held-out rows the posterior's
                # own validation strategy chooses it (docs/hyperparameters.md)
                self.prior_variance = res.prior_variance
            return res.prior_variance, res.noise_variance
        s0p = float(s0) if s0 != "auto" else max(theta_sq / max(P, 1), 1e-12)
        s2p = None
        if regression:
            if s2 == "auto":  # the paper: the variance of the training residuals
                s2p = max(self._fit_statistic(lin, data) / (N * C), 1e-12)
            else:
                s2p = float(s2)
        return s0p, s2p

    def _directions(self, data):
        lin, lik = data.lin, data.likelihood
        lin64 = float64_view(lin)
        name, s = self.projector, int(self.subspace_dim)
        if name == "optimal" and lin.n_params > MAX_OPTIMAL_PARAMS:
            raise ValueError(
                f"projector='optimal' forms the dense p x p posterior covariance and needs "
                f"p <= {MAX_OPTIMAL_PARAMS}; this network has p = {lin.n_params} linearised "
                "parameters. Use projector='lowrank-kfac' or 'lowrank-diag'.")
        kfac = None
        wants_kfac = self.prior_variance == "auto" and self.hyper == "auto"
        if name == "lowrank-kfac" or wants_kfac:
            try:
                kfac = KFAC(lin64, data)
            except UnsupportedKFAC:
                if name == "lowrank-kfac":
                    raise
        s0, s2 = self._hyper_for_projector(lin, data, kfac)
        self.projector_prior_variance, self.projector_noise_variance = s0, s2
        scale = 1.0 / s2 if s2 is not None else 1.0
        self.projector_eigvals = None
        self.subset_indices = getattr(self, "subset_indices", None)
        if name in ("lowrank-kfac", "lowrank-diag", "optimal"):
            if name == "lowrank-kfac":
                psi = kfac.inverse(s0, s2)
            elif name == "lowrank-diag":
                var = 1.0 / (ggn_diagonal(lin64, data) * scale + 1.0 / s0)

                def psi(T):
                    return T * var[:, None]
            else:
                H = full_ggn(lin64, data) * scale
                H.diagonal().add_(1.0 / s0)
                Sigma = dense_inverse(H)
                del H

                def psi(T):
                    return Sigma @ T
            Xs = self._subset_inputs(data)
            V, lam = lowrank_directions(lin64, Xs, data.n_outputs, psi, s, data.batch_size)
            self.projector_eigvals = lam
            return V
        if name == "subset-magnitude":
            scores = lin64.flat_params().abs()
        elif name == "subset-diagonal":
            scores = 1.0 / (ggn_diagonal(lin64, data) * scale + 1.0 / s0)
        else:  # subset-swag
            lk = lik.with_noise(s2) if s2 is not None else lik
            scores = swag_variances(lin, data, lk, s0, self.swag_learning_rate,
                                    self.swag_n_steps, data.generator)
        return subset_directions(scores, s)

    # ---------------------------------------------------------------- fitting
    def fit(self, data):
        """Build the projector, then fit the GLM posterior on ``J(x) P``."""
        if self.projector not in PROJECTORS:
            raise ValueError(f"unknown projector {self.projector!r}; expected one of "
                             f"{PROJECTORS}")
        V = self._directions(data)  # may fix an evidence-chosen prior variance
        self.projector_rows = V
        self.features = ProjectionFeatures(V)
        super().fit(data)
        if self._kfac_result is not None and data.validation is None:
            glm = self.hyper_strategy
            self.hyper_strategy = "evidence" if glm in ("fixed", "evidence") else glm
            self.hyper_trace = {**self.hyper_trace, "kfac_evidence": self._kfac_result.trace,
                                "prior_variance_source": "kfac_evidence"}
        return self


def _fit_statistic(payload, batches):
    """``(residual sum of squares or log likelihood,)`` over ``batches`` (adds over rows)."""
    lin, lik = payload
    stat = 0.0
    for x, y in batches:
        g = lin.forward(x).double()
        _check_finite_outputs(g, "training rows")
        stat += (float(((y - g) ** 2).sum()) if lik.task == "regression"
                 else float(lik.log_prob(g, y).sum()))
    return (stat,)
