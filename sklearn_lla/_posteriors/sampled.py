"""Sampled LLA: linearised Laplace by sample-then-optimise, prior variance by EM.

LLA is the posterior of the linear model ``f(x, theta) = g(x) + J(x) (theta - theta_hat)``
with prior ``theta ~ N(0, A^-1)``, ``A = alpha diag(1 / s^2)`` (``s = 1`` unless the
g-prior is used) and the likelihood's output curvature ``Lam_n = A_n A_n^T``. Following
Antoran et al. (ICLR 2023), nothing ``P x P`` or ``NC x NC`` is ever formed:

* **E-step.** The linear model's mode ``theta_bar`` and ``K`` posterior samples
  ``zeta_k ~ N(0, H^-1)``, ``H = sum_n J_n^T Lam_n J_n + A``, are found together, by
  conjugate gradients on the whitened linear systems (``solver="cg"``, the default
  when a data pass is at most :data:`CG_MAX_BATCHES` batches: deterministic, to a
  relative residual ``tol``, preconditioned by a randomized Nystrom sketch of the
  whitened GGN made once per fit, :mod:`sklearn_lla._core.krylov`, whose test matrix
  holds the starts and right-hand sides: CG starts from the best point within its
  range, with no data pass) or by minibatch Adam
  (:func:`sklearn_lla._core.optim.minimize`). The samples minimise the
  low-variance sample-then-optimise objective
  ``1/2 z^T (sum_n J_n^T Lam_n J_n) z + 1/2 (z - theta_n)^T A (z - theta_n)`` with
  ``theta_n = theta_0 + A^-1 sum_n J_n^T Lam_n^(1/2) eps_n``, ``theta_0 ~ N(0, A^-1)``
  and ``eps_n ~ N(0, I)`` drawn once. One JVP with ``K + 1`` tangents gives every
  ``J(x) z_k`` of a minibatch at once and one VJP with ``K + 1`` cotangents their
  gradients; the data term of a minibatch of ``B`` rows is scaled by ``N / B``.
  The optimisation runs in prior-whitened coordinates ``u = z / sigma``
  (``sigma = s0 s``), where Adam's learning rate is relative to the prior's scale.
* **Prior variance** (``hyper="auto"``). Regression: Antoran et al.'s EM. The
  effective dimension ``gamma = (1/K) sum_k sum_n (J_n zeta_k)^T Lam_n (J_n zeta_k)``
  (function-space estimator, one pass), ``alpha = gamma / ||theta_bar / s||^2`` and the
  MacKay noise update ``s2 = RSS(theta_bar) / (N C - gamma)``. Between EM steps the
  perturbations are rescaled, never redrawn (in whitened coordinates
  ``u_n = eps_0 + sigma * sum_n J_n^T A_n eps_n``: only ``sigma`` changes), and the
  optimisation is warm-started from the previous solution. The M-step needs only
  ``gamma``, whose relative standard error ``std(q_k) / (sqrt(k) gamma)`` is known from
  the ``k`` samples solved, so the EM steps solve the first ``k`` of the ``K`` samples
  (``n_em_samples="auto"``: 16, grown to the count that brings the error to 5 %) and
  only the final E-step solves all ``K``: on a 20,000-row problem with
  ``P = 98,801`` a step with ``K + 1 = 65`` tangents costs 8 times one with 9. Classification:
  ``s0^2 = ||theta_hat / s||^2 / P`` (``"weight_norm"``, the objective table's
  :data:`~sklearn_lla._core.hyper.OBJECTIVE`): for a network that fits its training
  rows (the usual case) the softmax curvature there vanishes and the EM fixed point
  is a far broader prior, under-confident (``docs/sampled.md``); ``hyper="em"`` still
  runs the paper's EM.
* **Held-out rows** (rows the network did not fit) are used after ``fit`` only, by
  :meth:`SampledLLAPosterior.calibrate`: regression rescales the whole predictive by
  the exact rescaling ``(c s0^2, c s2)`` (the samples at ``(c s0^2, c s2)`` are
  ``sqrt(c)`` times those at ``(s0^2, s2)`` with the same draws, so the posterior stays
  the exact one of a rescaled model and the ratio chosen by EM is kept);
  classification calibrates a temperature (the generic
  :meth:`~sklearn_lla._core.protocol.Posterior.calibrate`).
* **Validation scan** (``hyper="validation"``, only when asked for). Validation NLL
  over increasing prior variances ``s0^2 = ||theta_hat / s||^2 / P x PRIOR_GRID``,
  each a warm-started E-step of ``max_iter // 4`` steps, and (regression) every exact
  rescaling ``(c s0^2, c s2)``, ``c`` in ``NOISE_GRID``, around the network's mean
  squared validation residual. In-distribution NLL cannot see epistemic uncertainty:
  it often ends at the floor of the grid (no posterior), and then warns.
* **Predictive.** ``g(x) + J(x) zeta_k``: the latent mean is the network's output and
  the latent covariance the sample covariance ``(1/K) sum_k (J zeta_k)(J zeta_k)^T``
  (``zeta`` has known mean zero), ``C x C`` per point.

Memory is ``O(P K)`` (the samples, their perturbations and Adam's moments) plus one
minibatch; time is ``O(max_iter)`` JVP/VJP pairs with ``K + 1`` tangents per E-step
(the gradient is assembled by hand from one VJP: no autograd graph through them).
On the graph backend a fit keeps its batches' Jacobian rows (within a budget,
:class:`~sklearn_lla._posteriors._sampled_passes.BatchRows`) for all its full passes.
The E-step's solvers live in :mod:`sklearn_lla._posteriors._sampled_estep`.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from .._core.hyper import EM, HyperContext, HyperResult, ValidationGrid, resolve, strategy
from .._core.likelihoods import mc_seed
from .._core.optim import Patience
from .._core.protocol import LatentPredictive, Posterior, validation_residuals
from ._sampled_estep import (
    AUTO_ITERATIONS,
    AUTO_PRECONDITIONER_RANK,
    CG_MAX_BATCHES,
    ESteps,
    _EStepState,
)
from ._sampled_passes import (
    BatchRows,
    _ggn_diag_sums,
    _sample_cov,
    _statistics_sums,
    _validation_nll_sums,
)

__all__ = ["SampledLLAPosterior", "PRIOR_GRID", "NOISE_GRID", "G_PRIOR_FLOOR", "CG_MAX_BATCHES",
           "AUTO_ITERATIONS", "EM_START_SAMPLES", "EM_GAMMA_RSE", "AUTO_PRECONDITIONER_RANK"]

_F64 = torch.float64

#: Smallest normalised GGN diagonal entry of the g-prior (so ``s <= 100``).
G_PRIOR_FLOOR = 1e-4

#: ``n_em_samples="auto"``: samples solved in the first EM step; later steps use as
#: many as bring the relative standard error of ``gamma`` to :data:`EM_GAMMA_RSE`.
EM_START_SAMPLES = 16
EM_GAMMA_RSE = 0.05

#: ``hyper`` values of :class:`SampledLLAPosterior`.
STRATEGIES = ("auto", "em", "weight_norm", "validation")

#: Prior variances of the validation scan, in units of ``||theta_hat / s||^2 / P``
#: (scanned upwards; the lowest is close to the raw network's own predictive).
PRIOR_GRID = np.logspace(-2, 2, 9)

#: Rescalings ``c`` of ``(s0^2, s2)`` scored for each scanned prior (regression).
NOISE_GRID = np.logspace(-1, 1, 21)

#: Fraction of ``max_iter`` given to each (warm-started) E-step of the validation scan.
_SCAN_FRACTION = 0.25

#: The scan stops after this many candidates in a row scoring worse than the best by
#: more than ``_SCAN_SLACK`` (relative; :class:`~sklearn_lla._core.optim.Patience`).
_SCAN_PATIENCE = 2
_SCAN_SLACK = 1e-3


class SampledLLAPosterior(ESteps, Posterior):
    """Sample-then-optimise linearised Laplace posterior.

    Parameters
    ----------
    prior_variance : float or "auto"
        ``s0^2 = 1 / alpha``; ``"auto"`` is chosen by ``hyper``.
    noise_variance : float, "auto" or None
        ``s2`` (regression) or ``None`` (classification).
    hyper : {"auto", "em", "weight_norm", "validation"}, default="auto"
        Strategy for ``"auto"`` values. ``"auto"``: ``"em"`` for regression,
        ``"weight_norm"`` for classification (see the module docstring).
        ``"validation"`` (a scan scored on held-out rows) only when asked for.
    n_posterior_samples : int, default=64
        ``K``.
    n_em_steps : int, default=3
        EM iterations (``hyper="em"``).
    n_em_samples : int or "auto", default="auto"
        Samples solved in each EM step (the M-step needs only ``gamma``, their mean
        quadratic form; the final E-step solves all ``K``). ``"auto"``:
        :data:`EM_START_SAMPLES` in the first step, then as many as bring the relative
        standard error of ``gamma`` to :data:`EM_GAMMA_RSE` (at most ``K``).
    max_iter : int or "auto", default="auto"
        Iterations per E-step, conjugate-gradient iterations or Adam steps
        (``max_iter // 4`` per candidate of the validation scan); ``"auto"``:
        :data:`AUTO_ITERATIONS` of the solver in use.
    learning_rate : float, default=0.1
        Adam's (initial) learning rate, in prior-whitened coordinates.
    lr_schedule : {"auto", "cosine", "constant", "step"}, default="auto"
        Learning-rate schedule of each E-step (:func:`sklearn_lla._core.optim.lr_factor`);
        ``"auto"`` is ``"cosine"``: the decay averages minibatch noise out and, on a
        full-batch objective, ends the run converged instead of hovering (Adam at a
        constant rate oscillates about the optimum; the oscillation amplified float32
        rounding to a 1.6e-2 relative std difference in 1,200 steps).
    early_stopping : bool, default=False
        Adam only: end an E-step when the mean objective over windows of 50 steps improves by
        less than ``tol * max(1, |best|)`` ``n_iter_no_change`` times in a row
        (:func:`sklearn_lla._core.optim.minimize` with ``validation="loss"``).
    tol : float, default=1e-4
        Stopping tolerance of an E-step: conjugate gradients stop once every column's
        residual is below ``tol`` times its right-hand side; Adam (with
        ``early_stopping``) once its windows improve by less than ``tol * max(1,
        |best|)``.
    n_iter_no_change : int, default=3
        Windows without improvement before an E-step ends.
    g_prior : bool, default=False
        Per-parameter prior scales ``s = 1 / sqrt(diag GGN)`` (normalised to mean one,
        the diagonal floored at ``1e-4``: ``s <= 100``).
    solver : {"auto", "cg", "adam"}, default="auto"
        How an E-step is solved: ``"cg"``, conjugate gradients with full data passes
        (deterministic, stops at a relative residual ``tol``); ``"adam"``, minibatch
        Adam for ``max_iter`` steps; ``"auto"``: ``"cg"`` when a data pass is at most
        :data:`CG_MAX_BATCHES` batches, else ``"adam"``.
    preconditioner : {"nystrom", None}, default="nystrom"
        Conjugate gradients' preconditioner: a randomized Nystrom approximation of
        the whitened GGN ``sigma G sigma`` (:mod:`sklearn_lla._core.krylov`), one sketch
        per fit; ``None``: plain conjugate gradients.
    preconditioner_rank : int or "auto", default="auto"
        The sketch's rank; ``"auto"``: :data:`AUTO_PRECONDITIONER_RANK` ``x (K + 1)``
        (at most ``N C`` and ``P``).
    validation_grid : ValidationGrid or None, default=None
        The prior factors (scanned in increasing order) and noise factors of
        ``hyper="validation"``; ``None``: :data:`PRIOR_GRID` and :data:`NOISE_GRID`.
    name : str, default="SampledLLA"
        The estimator's name, shown in progress bars and warnings.
    """

    fitted_attributes = ("prior_variance", "likelihood", "hyper_strategy", "hyper_trace",
                         "samples", "mode", "effective_dim", "prior_scale", "n_iter")

    def __init__(self, prior_variance="auto", noise_variance=None, *, hyper="auto",
                 n_posterior_samples=64, n_em_steps=3, n_em_samples="auto", max_iter="auto",
                 learning_rate=0.1, lr_schedule="auto", early_stopping=False, tol=1e-4,
                 n_iter_no_change=3, g_prior=False, solver="auto", preconditioner="nystrom",
                 preconditioner_rank="auto", validation_grid=None, name="SampledLLA"):
        self.prior_variance = prior_variance
        self.noise_variance = noise_variance
        self.hyper = hyper
        self.n_posterior_samples = int(n_posterior_samples)
        self.n_em_steps = int(n_em_steps)
        self.n_em_samples = n_em_samples if n_em_samples == "auto" else int(n_em_samples)
        self.max_iter = max_iter if max_iter == "auto" else int(max_iter)
        self.learning_rate = float(learning_rate)
        self.lr_schedule = lr_schedule
        self.early_stopping = bool(early_stopping)
        self.tol = float(tol)
        self.n_iter_no_change = int(n_iter_no_change)
        self.g_prior = bool(g_prior)
        self.solver = solver
        self.preconditioner = None if preconditioner in (None, "none") else preconditioner
        self.preconditioner_rank = (preconditioner_rank if preconditioner_rank == "auto"
                                    else int(preconditioner_rank))
        self.validation_grid = validation_grid or ValidationGrid(PRIOR_GRID, NOISE_GRID)
        self.name = str(name)

    # ------------------------------------------------------------------ helpers
    def _ggn_diag(self, data):
        """``diag(sum_n J_n^T Lam_n J_n)`` (float64), a row-sum pass."""
        return data.reduce(_ggn_diag_sums, (data.lin, data.likelihood, data.n_outputs))[0]

    def _statistics(self, data, lik, delta, Z, store=None):
        """One row-sum pass: the per-sample ``q_k`` (``gamma = mean(q)``, the
        function-space estimator) and the linear model's RSS."""
        q, rss = data.reduce(_statistics_sums,
                             (data.lin, lik, delta, Z, self._regression, store))
        return q, float(rss)

    def _sample_statistics(self, st, data, lik, k, rss=True):
        """``(q, rss)`` of the first ``k`` samples and the mode after an E-step.

        After conjugate gradients ``q`` comes from the solve itself
        (:attr:`_EStepState.q_solved`) and only the RSS needs a pass (one tangent, and
        none without ``rss`` or for classification); after Adam, one pass with
        ``k + 1`` tangents (:meth:`_statistics`).
        """
        if st.q_solved is not None and st.q_solved.shape[0] == k:
            if rss and self._regression:
                return st.q_solved, self._statistics(data, lik, st.delta, st.Z[:0],
                                                     st.rows)[1]
            return st.q_solved, 0.0
        return self._statistics(data, lik, st.delta, st.Z[:k], st.rows)

    def _validation_noise(self, data):
        """Mean squared residual of the network on the validation rows."""
        sq, n = data.validation.reduce(validation_residuals, data.lin)
        return max(sq / max(n, 1), 1e-12)

    def _validation_nll(self, st, data, lik, factors, s2_ref, seed):
        """Mean validation NLL of the current samples, rescaled by each factor ``c``.

        A row-sum pass (per partition on dask validation data); see
        :func:`_validation_nll_sums`.
        """
        payload = (data.lin, st.Z, lik, self._regression,
                   np.asarray(factors, dtype=np.float64), s2_ref, seed)
        total, n = data.validation.reduce(_validation_nll_sums, payload)
        out = total.cpu().numpy() / max(n, 1)
        return np.where(np.isfinite(out), out, np.inf)

    def _strategy(self, data, fit_prior, fit_noise):
        """The strategy object choosing the ``"auto"`` values."""
        name = resolve(self.hyper, family="sampled", task=data.likelihood.task,
                       auto=fit_prior or fit_noise, has_validation=data.validation is not None,
                       allowed=STRATEGIES)
        return strategy(name, validation=self.validation_grid, em=EM(self.n_em_steps))

    # ------------------------------------------------------------ hyperparameters
    def _validation_scan(self, st, data, lik, scale, base, s2_ref, fit_prior, fit_noise,
                         grid):
        """Choose ``"auto"`` values by validation NLL over ``grid`` (``hyper="validation"``
        only): each prior a warm-started E-step, each rescaling of it scored."""
        if not fit_prior:  # a given prior: s2 is the mean squared validation residual
            return HyperResult(float(self.prior_variance), s2_ref, grid.name,
                               {"noise_variance": np.array([s2_ref])})
        s0s = base * np.sort(np.asarray(grid.prior_grid, dtype=np.float64))
        factors = np.asarray(grid.noise_grid, dtype=np.float64) if fit_noise else np.ones(1)
        scan_iter = max(1, math.ceil(self._iterations(data) * _SCAN_FRACTION))
        scores, best = [], None
        patience = Patience(_SCAN_PATIENCE, slack=_SCAN_SLACK)
        seed = mc_seed(lik, data.generator)  # common random numbers across the scan
        st.sigma = math.sqrt(s0s[0]) * scale
        st.Z = st.eps0 * st.sigma
        for i, s0 in enumerate(s0s):
            self._partial_e_step(st, data, lik, math.sqrt(s0) * scale,
                                 f"validation scan {i + 1}/{len(s0s)}", scan_iter)
            row = self._validation_nll(st, data, lik, factors, s2_ref, seed)
            scores.append(row)
            j = int(np.argmin(row))
            if patience.update(float(row[j])):
                best = (i, j, st.delta.clone(), st.Z.clone())
            elif patience.stop:
                break
        if best is None:
            raise FloatingPointError(
                "the validation NLL is not finite for any candidate hyperparameter")
        score = patience.best
        i, j, st.delta, st.Z = best
        c = float(factors[j])
        st.Z *= math.sqrt(c)  # exact samples at (c s0^2, c s2): same draws
        st.sigma = st.sigma * math.sqrt(c)
        st.S /= math.sqrt(c)  # Lam^(1/2) = I / sqrt(c s2)
        if st.q is not None:
            st.q /= c
        tried = s0s[:len(scores)]
        s2s = None if s2_ref is None else s2_ref * factors
        ValidationGrid.warn_edges(i, j, s0s, factors, "auto", "auto" if fit_noise else 1.0)
        trace = {"prior_variance": tried, "noise_variance": s2s,
                 "rescaled_prior_variance": np.outer(tried, factors),
                 "score": np.asarray(scores), "best_score": float(score),
                 "scan_iter": scan_iter}
        return HyperResult(float(s0s[i] * c), None if s2_ref is None else float(s2_ref * c),
                           grid.name, trace)

    # --------------------------------------------------------------------- fit
    def fit(self, data):
        """Choose the ``"auto"`` hyperparameters and draw the posterior samples."""
        lin, lik = data.lin, data.likelihood
        N, C, P, K = data.n_samples, data.n_outputs, lin.n_params, self.n_posterior_samples
        self._regression = self.noise_variance is not None
        theta_hat = lin.flat_params().to(_F64)
        scale = torch.ones(P, dtype=_F64, device=data.device)
        if self.g_prior:
            d = self._ggn_diag(data)
            d = d / d.mean().clamp_min(torch.finfo(_F64).tiny)
            scale = 1.0 / d.clamp_min(G_PRIOR_FLOOR).sqrt()
        self.prior_scale = scale
        fit_prior = self.prior_variance == "auto"
        fit_noise = self._regression and self.noise_variance == "auto"
        strat = self._strategy(data, fit_prior, fit_noise)
        theta_sq = float((theta_hat / scale).pow(2).sum())
        base = max(theta_sq / P, 1e-12)
        s0 = base if fit_prior else max(float(self.prior_variance), 1e-12)
        noise_source = None
        if fit_noise:
            if strat.uses_held_out:
                s2, noise_source = self._validation_noise(data), "validation"
            else:  # the MacKay update starts from the network's training residuals
                r2 = sum(float((y - lin.forward(x).to(_F64)).pow(2).sum())
                         for x, y in data.batches())
                s2, noise_source = max(r2 / (N * C), 1e-12), "em"
            lik = lik.with_noise(s2)
        elif self._regression:
            s2 = float(self.noise_variance)
            lik = lik.with_noise(s2)
        else:
            s2 = None
        st = _EStepState(theta_hat, self._regression or strat.needs_mode,
                         rows=BatchRows.for_fit(data))
        st.eps0 = torch.randn((K, P), dtype=_F64, generator=data.generator).to(data.device)
        st.S, st.q = self._perturbation_pass(st, data, lik)
        st.delta = torch.zeros(P, dtype=_F64, device=data.device)
        st.sigma = math.sqrt(s0) * scale
        st.Z = st.eps0 * st.sigma
        self.n_iter = []
        ctx = HyperContext(
            prior_variance="auto" if fit_prior else s0,
            noise_variance="auto" if fit_noise else s2, theta_sq_norm=theta_sq, n_params=P,
            start=(s0, s2), em_step=self._em_step(st, data, lik, scale, fit_prior, fit_noise),
            # weight_norm's "auto" noise: the EM noise update under its prior
            noise_update=lambda prior: EM(self.n_em_steps).select(HyperContext(
                prior, "auto", start=(prior, s2),
                em_step=self._em_step(st, data, lik, scale, False, True))),
            scan=lambda grid: self._validation_scan(st, data, lik, scale, base, s2, fit_prior,
                                                    fit_noise, grid))
        result = strat.select(ctx)
        s0, s2 = result.prior_variance, result.noise_variance
        if self._regression:
            lik = lik.with_noise(s2)
        trace = dict(result.trace)
        if self._regression:
            trace["noise_source"] = noise_source
        # final E-step at the chosen hyperparameters (perturbations rescaled, warm start)
        res = self._e_step(st, data, lik, math.sqrt(s0) * scale, "posterior samples",
                           final=True)
        if strat.uses_held_out and fit_prior and fit_noise:
            s0, s2, lik = self._refit_scale(st, data, lik, s0, s2, trace)
        gamma = float(self._sample_statistics(st, data, lik, K, rss=False)[0].mean())
        trace["optimisation"] = res
        trace["solver"] = self._solver(data)
        if trace["solver"] == "adam":
            trace["lr_schedule"] = self._schedule()
        self.prior_variance = float(s0)
        self.likelihood = lik
        self.hyper_strategy, self.hyper_trace = result.strategy, trace
        self.samples = st.Z
        self.mode = st.theta_hat + st.delta if st.with_mode else None
        self.effective_dim = gamma
        self.lin = lin
        return self

    def _refit_scale(self, st, data, lik, s0, s2, trace):
        """Re-choose the exact rescaling ``(c s0^2, c s2)`` with the final samples.

        The scan scored samples after ``max_iter * 0.25`` steps; the final E-step
        moves them further, and the free scale ``c`` is re-chosen on the validation
        rows with the samples that are kept, so that the predictive is the one scored.
        """
        factors = np.asarray(self.validation_grid.noise_grid, dtype=np.float64)
        row = self._validation_nll(st, data, lik, factors, s2, mc_seed(lik, data.generator))
        j = int(np.argmin(row))
        if not np.isfinite(row[j]):
            raise FloatingPointError("the validation NLL of the final samples is not finite")
        c = float(factors[j])
        st.Z *= math.sqrt(c)
        trace.update(final_factor=c, final_score=float(row[j]))
        return s0 * c, s2 * c, lik.with_noise(s2 * c)

    def _em_samples(self):
        """Samples of the first EM step: ``n_em_samples``, or for ``"auto"``
        :data:`EM_START_SAMPLES` (at most ``K``)."""
        K = self.n_posterior_samples
        return min(K, EM_START_SAMPLES if self.n_em_samples == "auto" else self.n_em_samples)

    def _next_em_samples(self, k, q):
        """Samples of the next EM step from this step's per-sample ``q_k`` (``"auto"``).

        ``gamma = mean(q)`` sets ``alpha = gamma / ||theta_bar||^2``: its relative
        standard error ``std(q) / (sqrt(k) gamma)`` is the M-step's. ``"auto"`` grows
        ``k`` to the count that brings it to :data:`EM_GAMMA_RSE` (at most ``K``).
        """
        K = self.n_posterior_samples
        if self.n_em_samples != "auto" or k >= K or k < 2:
            return k
        gamma = float(q.mean())
        rse = float(q.std()) / (math.sqrt(k) * max(gamma, 1e-300))
        if rse <= EM_GAMMA_RSE:
            return k
        return min(K, math.ceil(k * (rse / EM_GAMMA_RSE) ** 2))

    def _em_step(self, st, data, lik, scale, fit_prior, fit_noise):
        """The paper's EM step (E-step, M-step) for :class:`~sklearn_lla._core.hyper.EM`,
        on the first ``k`` samples (:meth:`_em_samples`, :meth:`_next_em_samples`)."""
        N, C = data.n_samples, data.n_outputs
        state = {"lik": lik, "k": self._em_samples()}

        def step(prior_variance, s2):
            it, k = len(self.n_iter) + 1, state["k"]
            cut = self._partial_e_step(st, data, state["lik"],
                                       math.sqrt(prior_variance) * scale,
                                       f"EM step {it}/{self.n_em_steps}", k=k)
            q, rss = self._sample_statistics(st, data, state["lik"], k)
            gamma = float(q.mean())
            state["k"] = self._next_em_samples(k, q)
            w_sq = float(((st.theta_hat + st.delta) / scale).pow(2).sum())
            info = {"effective_dim": gamma, "mode_sq_norm": w_sq, "n_iter": self.n_iter[-1],
                    "n_samples": k, "cut_at_max_iter": cut}
            new = max(w_sq / max(gamma, 1e-12), 1e-12) if fit_prior else prior_variance
            if fit_noise:
                s2_new = max(rss / max(N * C - gamma, 1.0), 1e-12)
                st.S *= math.sqrt(s2 / s2_new)  # Lam^(1/2) = I / sqrt(s2)
                st.q *= s2 / s2_new  # q = J^T (J theta_hat + y - g) / s2
                s2, state["lik"] = s2_new, state["lik"].with_noise(s2_new)
                info["noise_variance"] = s2_new
            info["prior_variance"] = new
            return new, s2, info

        return step

    # ------------------------------------------------------------ calibration
    #: The samples at ``(c s0^2, c s2)`` are ``sqrt(c)`` times those at ``(s0^2, s2)``
    #: with the same draws: held-out rows fit that scale (a fixed prior included).
    rescalable = True

    def rescale(self, c):
        """Move to ``(c s0^2, c s2)``: the samples times ``sqrt(c)``, the ratio
        ``s2 / s0^2`` chosen by EM (and the predictive's shape) kept."""
        self.samples = self.samples * math.sqrt(c)
        self.prior_variance = float(self.prior_variance) * c
        self.likelihood = self.likelihood.with_noise(float(self.likelihood.noise_variance) * c)

    # ---------------------------------------------------------------- predict
    def predict(self, x):
        """Network output and sample covariance of ``J(x) zeta_k`` per point."""
        g, jz = self.lin.jvp(x, self.samples)
        return LatentPredictive(g.to(_F64), _sample_cov(jz.to(_F64)))

    def predict_joint(self, x):
        """Network output (B, C) and the joint sample covariance (B*C, B*C)."""
        g, jz = self.lin.jvp(x, self.samples)
        M = jz.to(_F64).reshape(-1, jz.shape[-1])
        return g.to(_F64), M @ M.T / M.shape[1]
