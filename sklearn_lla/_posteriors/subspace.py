"""Subspace Laplace (Faller & Martin): the projectors ``P`` and the posterior on their span.

Every projector returns the directions as the rows of a float64 ``(s, p)`` tensor
(``V = P^T``); the posterior itself is the GLM posterior with features ``J(x) V``
(:class:`sklearn_lla._posteriors.glm.ProjectionFeatures`), whose prior Gram ``V V^T`` makes the
result independent of the basis chosen inside ``span(P)``.

* ``lowrank-kfac`` / ``lowrank-diag`` (Algorithm 1): ``Psi_approx`` the KFAC or
  diagonal-GGN posterior covariance, ``M = J_X' Psi_approx J_X'^T`` over a subset
  ``X'`` of the training inputs, its top-``s`` eigenvectors ``U_s`` and
  ``P = Psi_approx J_X'^T U_s`` (orthonormalised: Theorem 1 holds for any
  reparametrisation ``P Q``), or ``P = J_X'^T U_s`` with the residual correction (the
  same span for the exact ``Psi``, and inside the span of the training Jacobians);
* ``optimal`` (Theorem 1): the same with the full GGN posterior covariance
  ``Psi = (GGN + I / s0^2)^-1``, only for ``p <= MAX_OPTIMAL_PARAMS``;
* ``subset-magnitude`` / ``subset-diagonal`` / ``subset-swag``: the ``s``
  coordinates with the largest ``|theta|``, diagonal-GGN posterior variance or SWAG
  variance (Daxberger et al., 2021).

Memory: ``M`` is ``(n' C) x (n' C)``; ``Psi_approx`` (from
:mod:`sklearn_lla._network.curvature`) is applied to chunks of Jacobian rows, so no
``p x p`` matrix is formed except by ``optimal``.

One KFAC: on a network with layer factors (the structured or graph Jacobian backend)
``lowrank-kfac``'s KFAC is read from the KFAC complement's factor sums
(:class:`~sklearn_lla._posteriors.subspace_kfac.LayerKFAC`, curvlinops' convention;
curvlinops' own :class:`~sklearn_lla._network.curvature.KFAC` for the other nets): one
pass over the training rows gives the projector's ``Psi_approx``, the complement's
``Sigma`` and, when they fit a budget, the training rows for the GGN of the features;
the range finder then works on the subset's rows rotated into the Kronecker
eigenbases, where ``Psi_approx`` is diagonal.

:class:`SubspacePosterior` builds the projector (``Psi_approx`` with the KFAC
evidence's hyperparameters, the paper's), runs
:class:`~sklearn_lla._posteriors.glm.GLMPosterior` on ``ProjectionFeatures`` and, for
the low-rank projectors, keeps the prior variance outside ``span(P)`` in the
predictive (checked on the training rows, :meth:`SubspacePosterior._check_residual`).
Regression's ``"auto"`` prior variance lies on the KFAC ridge ``s0^2 = s0_KFAC(s2)``
(the KFAC evidence's maximiser at the noise variance in use). The estimators are in
:mod:`sklearn_lla.subspace`.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import torch
from scipy.optimize import minimize_scalar

from .._core.hyper import (
    Evidence,
    HyperContext,
    HyperparameterWarning,
    HyperResult,
    glm_log_evidence,
)
from .._core.linalg import dense_inverse, safe_eigh
from .._core.protocol import check_finite_outputs, to_batch
from .._network.curvature import (
    KFAC,
    UnsupportedKFAC,
    _chunk,
    float64_view,
    full_ggn,
    ggn_diagonal,
    swag_variances,
)
from .._network.linearized import stack_flat
from .complement import supports_kfac_complement
from .glm import GLMPosterior, ProjectionFeatures
from .subspace_kfac import LayerKFAC

__all__ = ["SubspacePosterior", "PROJECTORS", "MAX_OPTIMAL_PARAMS", "lowrank_directions",
           "subset_directions"]

#: The projector names.
PROJECTORS = ("lowrank-kfac", "lowrank-diag", "subset-magnitude", "subset-diagonal",
              "subset-swag", "optimal")


#: Largest mean latent variance (per training row and output, in units of the noise
#: variance or of the curvature) that the prior residual may add on the training rows
#: before ``residual_correction="auto"`` turns it off (:meth:`SubspacePosterior._check_residual`).
RESIDUAL_TOL = 0.25

#: Search range of the ``"auto"`` noise variance along the KFAC ridge, relative to the
#: mean squared training residual.
NOISE_RANGE = (1e-6, 1e2)

#: Largest number of parameters for which ``projector="optimal"`` forms the dense
#: ``p x p`` posterior covariance.
MAX_OPTIMAL_PARAMS = 5000


#: Per-row cost budget of ``subspace_dim="auto"``, in multiply-adds: the features of a
#: row cost ``s * p`` (one JVP with ``s`` tangents) at fit and at predict, so "auto"
#: keeps at most ``max(AUTO_MIN_DIM, AUTO_COST_BUDGET // p)`` directions.
AUTO_COST_BUDGET = 2**21

#: The smallest ``s`` that ``subspace_dim="auto"`` keeps when the spectrum allows it.
AUTO_MIN_DIM = 20

#: Relative eigenvalue floor of ``subspace_dim="auto"``: directions of ``M`` below
#: ``AUTO_RTOL * lam_max`` are left out (the data leave their posterior at the prior).
AUTO_RTOL = 1e-6


#: Extra columns of the randomized block Krylov method of :func:`lowrank_directions`.
RANGE_OVERSAMPLING = 10

#: Its block Krylov steps (each one JVP and one VJP pass over the subset) stop when the
#: sum of the top Ritz values grows by at most this fraction ...
RANGE_RTOL = 5e-3

#: ... or after this many of them (with a warning).
RANGE_MAX_ITERATIONS = 12


def auto_dim_cap(n_params):
    """The most directions ``subspace_dim="auto"`` keeps for ``n_params`` parameters."""
    return max(AUTO_MIN_DIM, AUTO_COST_BUDGET // max(1, int(n_params)))


def _top_eigvecs(M, s, cap=None):
    lam, U = safe_eigh(0.5 * (M + M.T), "projected covariance J Psi J^T")
    return _select_top(lam.flip(0), U.flip(1), s, cap, M.shape[0])


def _select_top(lam, U, s, cap, n_rows):
    """The leading ``s`` of the descending eigenpairs ``(lam, U)`` of an ``n_rows``
    square ``M`` (``"auto"``: the rule of :func:`lowrank_directions`)."""
    top = max(float(lam[0]), 0.0)
    tol = top * n_rows * torch.finfo(torch.float64).eps * 10
    positive = int((lam > tol).sum())
    if positive == 0:
        raise ValueError("J Psi J^T is zero on the subset: the network's Jacobian vanishes")
    if s == "auto":
        s = min(int((lam > max(tol, AUTO_RTOL * top)).sum()), cap or positive)
    elif positive < s:
        warnings.warn(f"J Psi J^T has only {positive} numerically positive eigenvalues on the "
                      f"{n_rows} rows of the subset; using subspace_dim={positive} instead "
                      f"of {s}", RuntimeWarning, stacklevel=5)
        s = positive
    return lam[:s], U[:, :s]


def lowrank_directions(lin, X, n_outputs, psi, s, batch_size=256, row_space=False,
                       method="auto", generator=None):
    """Algorithm 1: orthonormal rows spanning ``Psi J_X^T U_s`` (or ``J_X^T U_s``).

    Parameters
    ----------
    lin : LinearizedNet
        The network, in its own dtype: its Jacobian products run in that dtype and
        are cast to float64 before anything is accumulated (``M``, the Krylov basis,
        ``QR`` and ``eigh`` are float64).
    X : Tensor of shape (n, ...)
        The inputs ``X'`` (floating ones are cast to the network's dtype).
    n_outputs : int
        ``C``.
    psi : callable
        ``T (p, k) -> Psi T (p, k)``, float64. One with a ``passes`` method (a
        :class:`~sklearn_lla._posteriors.subspace_kfac.LayerKFAC`'s inverse) supplies
        the products itself: on the subset's rows rotated once into the Kronecker
        eigenbases, where ``Psi`` is diagonal.
    s : int or "auto"
        Subspace dimension (an integer is reduced to the numerical rank of ``M`` with a
        warning); ``"auto"``: every eigenvalue of ``M`` above ``AUTO_RTOL`` times the
        largest, at most :func:`auto_dim_cap` of them.
    batch_size : int, default=256
        Points per Jacobian chunk (also capped by the Jacobian memory budget).
    row_space : bool, default=False
        Span ``J_X^T U_s`` instead of ``Psi J_X^T U_s``: the same span when ``Psi`` is
        the exact posterior covariance of the training rows ``X`` (push-through:
        ``Psi J^T = s0^2 J^T (I + s0^2 Lam J J^T)^-1``, whose eigenvectors are those of
        ``M`` for a Gaussian likelihood), and always inside the span of the
        Jacobian rows, which the prior residual of the predictive needs.
    method : {"auto", "dense", "randomized"}, default="auto"
        ``"dense"``: assemble the ``n C x n C`` matrix ``M`` from Jacobian chunks and
        take its full eigendecomposition (``Psi`` applied to all ``n C`` Jacobian
        rows). ``"randomized"``: only its top eigenpairs, by a randomized block Krylov
        method (Halko, Martinsson & Tropp, 2011; Musco & Musco, 2015) started from
        ``k + o`` Gaussian columns (``k`` = ``s`` or, for ``"auto"``,
        :func:`auto_dim_cap`; ``o`` = :data:`RANGE_OVERSAMPLING`): each step
        multiplies the newest block by ``M = J Psi J^T`` (one batched VJP and one
        batched JVP pass over ``X``, ``Psi`` on ``k + o`` columns; ``M`` is never
        formed), orthogonalises it against the whole basis, and a Rayleigh-Ritz step
        on the basis gives the eigenpairs, until the sum of the top ``k`` Ritz values
        grows by less than :data:`RANGE_RTOL` (Krylov rather than subspace iteration:
        it converges faster on flat spectra; ``docs/subspace.md``). ``"auto"``:
        randomized when ``k + o`` is at most a quarter of ``n C``.
    generator : torch.Generator or None, default=None
        Draws the randomized method's test matrix (the global generator if None).

    Returns
    -------
    V : Tensor of shape (s, p)
        Orthonormal rows, float64.
    lam : Tensor of shape (s,)
        The top eigenvalues of ``M = J_X Psi J_X^T``.
    """
    C, n = n_outputs, X.shape[0]
    if method not in ("auto", "dense", "randomized"):
        raise ValueError(f"method must be 'auto', 'dense' or 'randomized', got {method!r}")
    if X.is_floating_point() and X.dtype != lin.dtype:
        X = X.to(lin.dtype)
    step = _chunk(lin, C, batch_size)
    chunks = [slice(i, min(i + step, n)) for i in range(0, n, step)]
    # the products on the subset's rows: Psi's own (any network), or in the KFAC
    # eigenbases on rows rotated once (a LayerKFAC's Psi, :mod:`.subspace_kfac`)
    passes = (psi.passes(lin, X, C, chunks) if hasattr(psi, "passes")
              else _NetPasses(lin, X, C, chunks, psi))
    k = auto_dim_cap(lin.n_params) if s == "auto" else int(s)
    if method == "randomized" or (method == "auto" and 4 * (k + RANGE_OVERSAMPLING) <= n * C):
        return _randomized_directions(lin, passes, C, s, k, row_space, generator)
    M = torch.empty((n * C, n * C), dtype=torch.float64, device=lin.device)
    for i, si in enumerate(chunks):
        Jt_i = passes.rows_t(i)  # (p, b C)
        Z = passes.psi(Jt_i)
        rows_i = slice(si.start * C, si.stop * C)
        for j in range(i, len(chunks)):  # M is symmetric: the blocks on and below the diagonal
            sj = chunks[j]
            Jj = Jt_i.T if j == i else passes.rows_t(j).T
            rows_j = slice(sj.start * C, sj.stop * C)
            M[rows_j, rows_i] = Jj @ Z
            if j != i:
                M[rows_i, rows_j] = M[rows_j, rows_i].T
    lam, U = _top_eigvecs(M, s, auto_dim_cap(lin.n_params))
    del M
    Q, _ = torch.linalg.qr(passes.directions(U, row_space))
    return Q.T.contiguous(), lam


class _NetPasses:
    """``J^T Q``, ``J T`` and ``Psi T`` over the rows of ``X`` by the network's own
    products, in the parameters' layout: each product one batched VJP or JVP pass in
    the network's dtype, the results cast to float64 (the range finder's sums)."""

    def __init__(self, lin, X, n_outputs, chunks, psi):
        self.lin, self.X, self.C, self.chunks, self.psi = lin, X, n_outputs, chunks, psi
        self.p = lin.n_params

    def jt(self, Q):
        """``J^T Q`` ``(p, w)`` for ``Q`` ``(n C, w)``: one batched VJP pass."""
        lin, C, dt = self.lin, self.C, self.lin.dtype
        out = torch.zeros((self.p, Q.shape[1]), dtype=torch.float64, device=lin.device)
        for sl in self.chunks:
            cot = Q[sl.start * C:sl.stop * C].T.reshape(Q.shape[1], -1, C).to(dt)
            out += stack_flat(lin.vjp(self.X[sl], cot), lin.names).T.double()
        return out

    def j(self, T):
        """``J T`` ``(n C, w)`` for ``T`` ``(p, w)``: one batched JVP pass."""
        Tt = T.T.to(self.lin.dtype)
        return torch.cat([self.lin.jvp(self.X[sl], Tt)[1].reshape(-1, T.shape[1]).double()
                          for sl in self.chunks])

    def rows_t(self, i):
        """``J^T`` of chunk ``i``'s rows, ``(p, b C)`` float64."""
        return self.lin.jacobian(self.X[self.chunks[i]]).double().reshape(-1, self.p).T

    def directions(self, U, row_space):
        """``J^T U`` (``row_space``) or ``Psi J^T U``, ``(p, w)`` float64."""
        Pm = self.jt(U)
        return Pm if row_space else self.psi(Pm)

    @staticmethod
    def to_params(P):
        """The layout is the parameters' already."""
        return P


def _randomized_directions(lin, passes, C, s, k, row_space, generator):
    """:func:`lowrank_directions` by randomized block Krylov (see its ``method``): the top
    eigenpairs of ``M`` from blocks of ``k + o`` columns (at most ``n C``), the products
    by ``passes`` (:class:`_NetPasses` or the KFAC eigenbases' rotated rows)."""
    n = passes.X.shape[0]
    width = min(k + RANGE_OVERSAMPLING, n * C)
    k = max(width - min(RANGE_OVERSAMPLING, width), 1)
    omega = torch.randn((n * C, width), dtype=torch.float64, generator=generator)
    Q, _ = torch.linalg.qr(omega.to(lin.device))
    K, As, PAs = [], [], []  # the orthonormal Krylov blocks, J^T and Psi J^T of each
    # (kept only where J^T U_s is dearer than a product with them: rotated rows are not)
    keep = not getattr(passes, "rotated_layout", False)
    MK = []  # M times each block (M is symmetric: K_j^T M Q = (M K_j)^T Q, n C rows)
    B = torch.zeros((0, 0), dtype=torch.float64, device=lin.device)
    previous = None
    for it in range(RANGE_MAX_ITERATIONS + 1):
        # the newest block of K^T M K: (J^T Q)^T Psi (J^T Q) (p rows) where J^T Q is kept,
        # else Q^T (M Q) from the product M Q the next step needs (rotated rows: each
        # Kronecker block's J_b Psi_b J_b^T Q at once, n C rows)
        if keep:
            A = passes.jt(Q)
            PA = passes.psi(A)
            As.append(A)
            PAs.append(PA)
            new = A.T @ PA
        else:
            MQ = passes.m(Q)
            new = Q.T @ MQ
        cross = torch.cat(MK, 1).T @ Q if MK else B.new_zeros((0, Q.shape[1]))
        B = torch.cat([torch.cat([B, cross], 1), torch.cat([cross.T, new], 1)])
        K.append(Q)
        lam, W = safe_eigh(0.5 * (B + B.T), "projected covariance K^T J Psi J^T K")
        lam, W = lam.flip(0), W.flip(1)
        captured = float(lam[:k].clamp_min(0).sum())
        if previous is not None and captured <= previous * (1 + RANGE_RTOL):
            break
        if B.shape[0] + width > n * C:  # the Krylov space would fill the row space
            break
        if it == RANGE_MAX_ITERATIONS:
            warnings.warn(f"the randomized block Krylov method of the low-rank projector did not "
                          f"converge in {RANGE_MAX_ITERATIONS} block Krylov steps (the top "
                          f"eigenvalues of J Psi J^T still grew by more than {RANGE_RTOL:g}); "
                          "its subspace is the best found", RuntimeWarning, stacklevel=4)
            break
        previous = captured
        MK.append(passes.j(PA) if keep else MQ)  # M Q, orthogonalised against K (twice)
        Y = MK[-1].clone()
        Kb = torch.cat(K, 1)
        norm = float(torch.linalg.norm(Y))
        for _ in range(2):
            Y -= Kb @ (Kb.T @ Y)
        if float(torch.linalg.norm(Y)) <= 1e-10 * max(norm, 1e-300):
            break  # an invariant subspace: the Ritz pairs are exact
        Q, _ = torch.linalg.qr(Y)
    lam, W = _select_top(lam, W, s, auto_dim_cap(lin.n_params), n * C)
    if keep:  # J^T U_s or Psi J^T U_s, U_s = K W
        Pm = passes.to_params(torch.cat(As if row_space else PAs, 1) @ W)
    else:
        Pm = passes.directions(torch.cat(K, 1) @ W, row_space)
    V, _ = torch.linalg.qr(Pm)
    return V.T.contiguous(), lam


def subset_directions(scores, s):
    """Selection rows of the ``s`` largest ``scores`` (ties: the lower index first;
    ``s="auto"``: :func:`auto_dim_cap` of them)."""
    p = scores.shape[0]
    s = min(auto_dim_cap(p) if s == "auto" else int(s), p)
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
    subspace_dim : int or "auto"
        ``s``; ``"auto"``: see :func:`lowrank_directions` and :func:`subset_directions`.
    prior_variance : float or "auto"
    noise_variance : float, "auto" or None
    hyper : {"auto", "evidence", "validation", "weight_norm"}, default="auto"
        Strategy for ``"auto"`` values on the subspace model
        (:func:`~sklearn_lla._core.hyper.resolve`); ``"auto"`` is the GLM family's
        objective for the task. The projector's ``Psi_approx`` is built with the KFAC evidence's
        hyperparameters (the paper's choice) when KFAC supports the network.
    n_subset : int or "auto", default="auto"
        Size of the training subset ``X'`` of the low-rank and optimal projectors
        (``"auto"``: ``ceil(1000 / C)`` points, ``n C = 1000`` rows as in the paper).
    subspace_X : array-like or None, default=None
        Inputs to use as ``X'`` instead of a random training subset.
    swag_learning_rate : float, default=1e-2
    swag_n_steps : int, default=100
    residual_correction : bool, "kfac" or "auto", default="auto"
        The posterior of the directions outside ``span(P)`` in the predictive
        (:class:`~sklearn_lla._posteriors.glm.GLMPosterior`: ``True`` the prior,
        ``"kfac"`` a projected KFAC posterior); with either the low-rank projectors
        are built in the span of the training Jacobians (``row_space`` of
        :func:`lowrank_directions`). ``"auto"``: ``"kfac"`` for the low-rank
        projectors built on training rows of a network with the structured or graph
        Jacobian backend (``True`` on the generic one), off for the subset and optimal projectors.
    """

    fitted_attributes = GLMPosterior.fitted_attributes + (
        "projector_rows", "projector_eigvals", "projector_curvature", "projector_prior_variance",
        "projector_noise_variance", "subset_indices")

    def __init__(self, projector, subspace_dim="auto", prior_variance="auto",
                 noise_variance=None, hyper="auto", n_subset="auto", subspace_X=None,
                 swag_learning_rate=1e-2, swag_n_steps=100, residual_correction="auto"):
        super().__init__(None, prior_variance, noise_variance, hyper=hyper,
                         residual_correction=residual_correction, label="subspace Laplace")
        self.projector = projector
        self.subspace_dim = subspace_dim
        self.n_subset = n_subset
        self.subspace_X = subspace_X
        self.swag_learning_rate = swag_learning_rate
        self.swag_n_steps = swag_n_steps

    # ---------------------------------------------------------------- helpers
    def _fit_statistic(self, lin, data):
        """Residual sum of squares (regression) or log likelihood: from the outputs of
        the training rows the KFAC pass kept, else one forward pass."""
        kept = getattr(self, "_kfac_rows", None)
        if kept is not None:
            return _fit_statistic((lin, data.likelihood),
                                  ((rows.output, y) for rows, y in kept.items), forward=False)[0]
        return data.reduce(_fit_statistic, (lin, data.likelihood))[0]

    def _subset_inputs(self, data):
        lin = data.lin
        if self.subspace_X is not None:
            X = np.asarray(self.subspace_X)
            self.subset_indices = None
            return to_batch(X, slice(0, len(X)), lin.dtype, lin.device)
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
        return x.to(lin.dtype) if x.is_floating_point() else x

    def _hyper_for_projector(self, lin, data, kfac):
        """``(s0^2, s2)`` of the projector's ``Psi_approx``, from the KFAC evidence when
        any is ``"auto"`` (the paper's choice), else given / weight norm / residuals."""
        lik = data.likelihood
        regression = lik.task == "regression"
        P, N, C = lin.n_params, data.n_samples, data.n_outputs
        theta = lin.flat_params().double()
        theta_sq = float(theta @ theta)
        s0, s2 = self.prior_variance, (self.noise_variance if regression else None)
        self._kfac_fit = None
        if kfac is not None and (s0 == "auto" or s2 == "auto"):
            stat = self._fit_statistic(lin, data)
            self._kfac_fit = dict(eigvals=kfac.eigvals(), theta_sq_norm=theta_sq,
                                  data_fit=stat, n_obs=N * C, n_params=P)
            res = Evidence().select(HyperContext(s0, s2, **self._kfac_fit))
            self._kfac_result = res
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
        """The projector's rows ``V`` (:data:`_LOWRANK` / :data:`_SUBSET`)."""
        lin = data.lin  # every pass in the net's dtype, every sum in float64
        name = self.projector
        s = self.subspace_dim if self.subspace_dim == "auto" else int(self.subspace_dim)
        if name == "optimal" and lin.n_params > MAX_OPTIMAL_PARAMS:
            raise ValueError(
                f"projector='optimal' forms the dense p x p posterior covariance and needs "
                f"p <= {MAX_OPTIMAL_PARAMS}; this network has p = {lin.n_params} linearised "
                "parameters. Use projector='lowrank-kfac' or 'lowrank-diag'.")
        kfac = None
        wants_kfac = self.prior_variance == "auto" or self.noise_variance == "auto"
        if name == "lowrank-kfac" or wants_kfac:
            if supports_kfac_complement(lin):
                # the layer factors' KFAC: the same curvature as curvlinops', and the
                # complement reads its factor sums instead of a pass of its own
                kfac = LayerKFAC(lin, data, keep_rows=(self.residual_correction == "kfac"
                                                       and not self.early_stopping))
                self._kfac_sums, self._kfac_rows = kfac.sums, kfac.rows
            else:
                try:
                    kfac = KFAC(lin, data)
                except UnsupportedKFAC:
                    if name == "lowrank-kfac":
                        raise
        self.projector_curvature = _CURVATURE.get(name)
        if name == "lowrank-kfac":
            self.projector_curvature = kfac.description
        s0, s2 = self._hyper_for_projector(lin, data, kfac)
        self.projector_prior_variance, self.projector_noise_variance = s0, s2
        inputs = _ProjectorInputs(self, data, lin, kfac, s0, s2,
                                  1.0 / s2 if s2 is not None else 1.0)
        self.projector_eigvals = None
        self.subset_indices = getattr(self, "subset_indices", None)
        if name in _LOWRANK:
            psi = _LOWRANK[name](inputs)
            V, lam = lowrank_directions(lin, self._subset_inputs(data), data.n_outputs,
                                        psi, s, data.batch_size,
                                        row_space=bool(self.residual_correction),
                                        generator=data.generator)
            self.projector_eigvals = lam
            return V
        return subset_directions(_SUBSET[name](inputs), s)

    # ---------------------------------------------------------------- fitting
    def fit(self, data):
        """Build the projector, then fit the GLM posterior on ``J(x) P``."""
        if self.projector not in PROJECTORS:
            raise ValueError(f"unknown projector {self.projector!r}; expected one of "
                             f"{PROJECTORS}")
        residual_auto = self.residual_correction == "auto"
        if residual_auto:
            lowrank = (self.projector in ("lowrank-kfac", "lowrank-diag")
                       and self.subspace_X is None)
            self.residual_correction = (
                ("kfac" if supports_kfac_complement(data.lin) else True) if lowrank else False)
        self._kfac_result = None
        # the projector's KFAC factor sums and the training rows of their pass, for the
        # complement and the GGN of the features
        self._kfac_sums = self._kfac_rows = None
        V = self._directions(data)
        self.projector_rows = V
        self.features = ProjectionFeatures(V)
        # regression, "auto" prior, the default strategy: the prior variance is the KFAC
        # evidence's maximiser at the noise variance in use (the "KFAC ridge")
        self._kfac_ridge = (data.likelihood.task == "regression" and self._kfac_fit is not None
                            and self.prior_variance == "auto" and self.hyper == "auto")
        super().fit(data)
        self.residual_excess = None
        if self.residual_correction:
            self._check_residual(data, switch=residual_auto)
        proj = {"prior_variance": self.projector_prior_variance,
                "noise_variance": self.projector_noise_variance}
        if self._kfac_result is not None:
            proj["kfac_evidence"] = self._kfac_result.trace
        self.hyper_trace = {**self.hyper_trace, "projector": proj,
                            "residual_excess": self.residual_excess}
        if self._kfac_ridge:
            self.hyper_trace["prior_variance_source"] = "kfac_evidence"
        return self

    def _kfac_prior_at(self, s2, warn=False):
        """The KFAC evidence's prior variance at the noise variance ``s2``."""
        with warnings.catch_warnings():
            if not warn:
                warnings.simplefilter("ignore", HyperparameterWarning)
            return Evidence().select(HyperContext("auto", float(s2), **self._kfac_fit)
                                     ).prior_variance

    def _objective(self, data, e, T, prior_scale, fit_stat, n_seen, warn=True):
        """The GLM strategy, or on the KFAC ridge: ``s0^2 = s0_KFAC(s2)`` and an ``"auto"``
        noise maximising the subspace model's own evidence along that ridge."""
        if not self._kfac_ridge:
            return super()._objective(data, e, T, prior_scale, fit_stat, n_seen, warn=warn)
        kw = self._context(e, prior_scale, fit_stat, n_seen).evidence_kwargs
        if self.noise_variance != "auto":
            s2 = float(self.noise_variance)
            return HyperResult(self._kfac_prior_at(s2, warn) * prior_scale, s2, Evidence.name,
                               {"noise_variance": np.array([s2])})

        ridge = {}  # u -> the KFAC prior at s2 = exp(u), each solved once

        def log_z(u):
            s2 = math.exp(u)
            if u not in ridge:
                ridge[u] = self._kfac_prior_at(s2)
            return glm_log_evidence(ridge[u], s2, **kw)

        mse = max(fit_stat / max(kw["n_obs"], 1), 1e-300)
        u, trace = _profile_search(log_z, math.log(mse * NOISE_RANGE[0]),
                                   math.log(mse * NOISE_RANGE[1]))
        s2 = math.exp(u)
        if warn and trace.pop("at_edge"):
            warnings.warn(f"the noise variance that maximises the subspace evidence along the "
                          f"KFAC-evidence prior is at the edge of its range ({s2:.3g}); pass "
                          "noise_variance or validation_data", HyperparameterWarning,
                          stacklevel=4)
        trace.pop("at_edge", None)
        s0 = self._kfac_prior_at(s2, warn)
        trace["prior_variance"] = np.array([ridge[u] for u in trace.pop("log_grid")])
        return HyperResult(s0 * prior_scale, s2, Evidence.name, trace)

    def _inside_trace(self):
        """``tr((V^T V)^-1 V^T G V)``: the GGN's trace inside ``span(P)``."""
        if self.eigvals is not None:
            return float(self.eigvals.sum())
        R = self.features.prior_gram.double()
        return float(torch.trace(torch.linalg.solve(R, self._factor)))

    def _check_residual(self, data, switch):
        """The prior residual's latent variance on the training rows; too much: off.

        ``excess = s0^2 tr(G_perp) / (s2 N C)``, ``G_perp`` the GGN outside
        ``span(P)`` (``tr G`` minus the trace inside): the mean latent variance the
        residual adds on a training row, in units of the noise variance (regression)
        or of the curvature ``Lam`` (classification). Exact LLA's latent variance at a
        training row is below the noise variance, so ``excess > RESIDUAL_TOL`` means
        that ``span(P)`` misses directions the data determine and the residual would
        inflate the std on the data.
        """
        lin, lik = data.lin, data.likelihood
        if self.complement is not None:  # its pass over the training rows had it
            tr_g = self.complement.ggn_trace
        else:
            bs = min(data.batch_size, lin.chunk_size(data.n_outputs))
            tr_g = data.reduce(_ggn_trace, (lin, lik), bs)[0]
        outside = max(tr_g - self._inside_trace(), 0.0)
        s2 = self.noise_variance if self._regression else 1.0
        excess = self.prior_variance * outside / s2 / (self.n_seen * data.n_outputs)
        self.residual_excess = float(excess)
        if excess <= RESIDUAL_TOL or self.residual_correction == "kfac":
            return  # the KFAC complement is shrunk by the data: nothing is inflated
        what = ("the noise variance" if self._regression else "the curvature")
        msg = (f"the subspace (subspace_dim_={self.features.dim}) misses directions the "
               f"training data determine: the prior variance outside it would add "
               f"{excess:.3g} x {what} to the latent variance of a training row on average "
               f"(more than {RESIDUAL_TOL:g})")
        if not switch:
            warnings.warn(msg + "; the std on the data is inflated. Raise subspace_dim / "
                          "n_subset or pass residual_correction=False", RuntimeWarning,
                          stacklevel=6)
            return
        warnings.warn(msg + "; the predictive keeps to span(P) (residual_correction=False, "
                      "the paper's), whose std does not grow away from the data. Raise "
                      "subspace_dim / n_subset so that span(P) holds them, or use "
                      "LLARegressor / ELLARegressor", RuntimeWarning, stacklevel=6)
        self.residual_correction = False
        res = self._objective(data, self.eigvals, self._factor, self.prior_scale,
                              self._fit_stat, self.n_seen)
        self._set_hyperparameters(data.likelihood, res.prior_variance, res.noise_variance)
        self.hyper_strategy, self.hyper_trace = res.strategy, res.trace


class _ProjectorInputs:
    """What a projector reads: the posterior, the data, the network (in its own
    dtype), KFAC, and the ``(s0^2, s2)`` of ``Psi_approx`` (``scale = 1 / s2``, 1 for
    classification)."""

    def __init__(self, post, data, lin, kfac, s0, s2, scale):
        self.post, self.data, self.lin, self.kfac = post, data, lin, kfac
        self.s0, self.s2, self.scale = s0, s2, scale


def _psi_kfac(p):
    """``Psi_approx``: the KFAC posterior covariance."""
    return p.kfac.inverse(p.s0, p.s2)


def _psi_diag(p):
    """``Psi_approx``: the diagonal-GGN posterior covariance."""
    var = 1.0 / (ggn_diagonal(p.lin, p.data) * p.scale + 1.0 / p.s0)

    def psi(T):
        return T * var[:, None]

    return psi


def _psi_optimal(p):
    """``Psi_approx``: the dense posterior covariance (the optimal projector)."""
    # a dense p x p float64 operator is inherent here (p <= MAX_OPTIMAL_PARAMS), and
    # its Jacobian rows are taken from a float64 copy of the (small) network
    H = full_ggn(float64_view(p.lin), p.data) * p.scale
    H.diagonal().add_(1.0 / p.s0)
    Sigma = dense_inverse(H)
    del H

    def psi(T):
        return Sigma @ T

    return psi


def _scores_magnitude(p):
    """Subset scores: ``|theta_hat|``."""
    return p.lin.flat_params().double().abs()


def _scores_diagonal(p):
    """Subset scores: the diagonal-GGN posterior variances."""
    return 1.0 / (ggn_diagonal(p.lin, p.data) * p.scale + 1.0 / p.s0)


def _scores_swag(p):
    """Subset scores: SWAG's marginal variances."""
    lik = p.data.likelihood
    lk = lik.with_noise(p.s2) if p.s2 is not None else lik
    return swag_variances(p.data.lin, p.data, lk, p.s0, p.post.swag_learning_rate,
                          p.post.swag_n_steps, p.data.generator)


#: Low-rank projectors: ``Psi_approx`` (a function ``T -> Psi T``) whose top
#: directions on the training Jacobians span the subspace.
_LOWRANK = {"lowrank-kfac": _psi_kfac, "lowrank-diag": _psi_diag, "optimal": _psi_optimal}

#: Subset projectors: per-parameter scores, the top ``s`` parameters kept.
_SUBSET = {"subset-magnitude": _scores_magnitude, "subset-diagonal": _scores_diagonal,
           "subset-swag": _scores_swag}

#: The curvature each projector reads (``lowrank-kfac``: KFAC's own description).
_CURVATURE = {"lowrank-diag": "exact diagonal GGN", "subset-diagonal": "exact diagonal GGN",
              "optimal": "full GGN"}


def _profile_search(f, a, b, n_grid=41):
    """Maximise the smooth 1-D ``f(u)`` on ``[a, b]``: a grid, then Brent between the
    best point's neighbours. Returns ``(u, trace)``; ``trace["log_grid"]`` holds the
    grid's ``u`` values (the ``noise_variance`` of the trace is their exponential)."""
    grid = np.linspace(a, b, n_grid)
    vals = np.array([f(u) for u in grid])
    vals = np.where(np.isfinite(vals), vals, -np.inf)
    if not np.isfinite(vals).any():
        raise FloatingPointError("the evidence is not finite for any noise variance")
    i = int(np.argmax(vals))
    lo, hi = grid[max(i - 1, 0)], grid[min(i + 1, n_grid - 1)]
    res = minimize_scalar(lambda u: -f(u), bounds=(lo, hi), method="bounded",
                          options={"xatol": 1e-6})
    u, val = (float(res.x), -float(res.fun)) if -res.fun >= vals[i] else (grid[i], vals[i])
    at_edge = (i == 0 and u - a < 1e-3) or (i == n_grid - 1 and b - u < 1e-3)
    return u, {"noise_variance": np.exp(grid), "score": vals, "log_evidence": val,
               "at_edge": at_edge, "log_grid": [float(v) for v in grid]}


def _ggn_trace(payload, batches):
    """``(sum_n tr(Lam_n J_n J_n^T),)``: the trace of the (unit-noise) GGN, adds over rows."""
    lin, lik = payload
    total = 0.0
    for x, _ in batches:
        K = lin.ntk_diag_blocks(x).double()
        if lik.unit_curvature:
            total += float(torch.einsum("bcc->", K))
        else:
            A = lik.lam_factor(lin.forward(x).double())
            total += float(torch.einsum("bck,bcd,bdk->", A, K, A))
    return (total,)


def _fit_statistic(payload, batches, forward=True):
    """``(residual sum of squares or log likelihood,)`` over ``batches`` (adds over rows);
    ``forward=False``: the batches hold the network's outputs instead of its inputs."""
    lin, lik = payload
    stat = 0.0
    for x, y in batches:
        g = (lin.forward(x) if forward else x).double()
        check_finite_outputs(g, "training rows")
        stat += (float(((y - g) ** 2).sum()) if lik.task == "regression"
                 else float(lik.log_prob(g, y).sum()))
    return (stat,)
