"""Sampled LLA: linearised Laplace by sample-then-optimise (EM or validation hyperparameters).

LLA is the posterior of the linear model ``f(x, theta) = g(x) + J(x) (theta - theta_hat)``
with prior ``theta ~ N(0, A^-1)``, ``A = alpha diag(1 / s^2)`` (``s = 1`` unless the
g-prior is used) and the likelihood's output curvature ``Lam_n = A_n A_n^T``. Following
Antoran et al. (ICLR 2023), nothing ``P x P`` or ``NC x NC`` is ever formed:

* **E-step.** The linear model's mode ``theta_bar`` and ``K`` posterior samples
  ``zeta_k ~ N(0, H^-1)``, ``H = sum_n J_n^T Lam_n J_n + A``, are found together by
  minibatch Adam (:func:`sklearn_lla._core.optim.minimize`). The samples minimise the
  low-variance sample-then-optimise objective
  ``1/2 z^T (sum_n J_n^T Lam_n J_n) z + 1/2 (z - theta_n)^T A (z - theta_n)`` with
  ``theta_n = theta_0 + A^-1 sum_n J_n^T Lam_n^(1/2) eps_n``, ``theta_0 ~ N(0, A^-1)``
  and ``eps_n ~ N(0, I)`` drawn once. One JVP with ``K + 1`` tangents gives every
  ``J(x) z_k`` of a minibatch at once and one VJP with ``K + 1`` cotangents their
  gradients; the data term of a minibatch of ``B`` rows is scaled by ``N / B``.
  The optimisation runs in prior-whitened coordinates ``u = z / sigma``
  (``sigma = s0 s``), where Adam's learning rate is relative to the prior's scale.
* **Hyperparameters with held-out rows** (the default ``hyper_strategy="auto"`` when
  the data carries validation rows; ``"validation"``). Validation NLL, as the GLM
  methods: a scan over increasing prior variances ``s0^2 = ||theta_hat / s||^2 / P x
  PRIOR_GRID`` (``1e-2 .. 1e2``, two per decade), each a warm-started E-step of
  ``max_iter // 4`` steps (the previous solution kept in whitened coordinates), scored
  on the validation rows; it stops after two candidates in a row that score clearly
  worse than the best. Regression: ``s2`` starts at the network's mean squared
  validation residual, and for each scanned prior every exact rescaling
  ``(c s0^2, c s2)``, ``c`` in ``NOISE_GRID`` (``0.1 .. 10``), is scored too: the
  samples at ``(c s0^2, c s2)`` are ``sqrt(c)`` times those at ``(s0^2, s2)`` with the
  same draws, so the predictive is ``N(g, c (cov + s2))`` exactly. After the final
  E-step, ``c`` is re-chosen with the kept samples.
* **M-step** (``hyper_strategy="em"``, and the default without held-out rows:
  Antoran et al.'s EM). The effective dimension
  ``gamma = (1/K) sum_k sum_n (J_n zeta_k)^T Lam_n (J_n zeta_k)`` (function-space
  estimator, one pass) and ``alpha = gamma / ||theta_bar / s||^2``. Between EM steps
  the perturbations are rescaled, never redrawn (in whitened coordinates
  ``u_n = eps_0 + sigma * sum_n J_n^T A_n eps_n``: only ``sigma`` changes), and the
  optimisation is warm-started from the previous solution.
* **Predictive.** ``g(x) + J(x) zeta_k``: the latent mean is the network's output and
  the latent covariance the sample covariance ``(1/K) sum_k (J zeta_k)(J zeta_k)^T``
  (``zeta`` has known mean zero), ``C x C`` per point.

Memory is ``O(P K)`` (the samples, their perturbations and Adam's moments) plus one
minibatch; time is ``O(max_iter)`` JVP/VJP pairs with ``K + 1`` tangents per E-step
(the gradient is assembled by hand from one VJP: no autograd graph through them).
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import torch
from sklearn.exceptions import ConvergenceWarning

from .._core.hyper import EM, Fixed, HyperResult, ValidationGrid
from .._core.optim import minibatches, minimize
from .._core.protocol import LatentPredictive, Posterior
from .glm import mc_seed, uses_mc_link, validation_residuals

__all__ = ["SampledLLAPosterior", "PRIOR_GRID", "NOISE_GRID", "G_PRIOR_FLOOR"]

_F64 = torch.float64

#: Smallest normalised GGN diagonal entry of the g-prior (so ``s <= 100``).
G_PRIOR_FLOOR = 1e-4

#: Steps between the checks of the windowed objective when ``early_stopping``.
_CHECK_FREQ = 50

#: Prior variances of the validation scan, in units of ``||theta_hat / s||^2 / P``
#: (scanned upwards; the lowest is close to the raw network's own predictive).
PRIOR_GRID = np.logspace(-2, 2, 9)

#: Rescalings ``c`` of ``(s0^2, s2)`` scored for each scanned prior (regression).
NOISE_GRID = np.logspace(-1, 1, 21)

#: Fraction of ``max_iter`` given to each (warm-started) E-step of the validation scan.
_SCAN_FRACTION = 0.25

#: The scan stops after this many candidates in a row scoring worse than the best by
#: more than ``_SCAN_TOL`` (relative).
_SCAN_PATIENCE = 2
_SCAN_TOL = 1e-3


def _flat(grads: dict, names, K) -> torch.Tensor:
    return torch.cat([grads[n].reshape(K, -1) for n in names], dim=1)


class _HandGradient(torch.autograd.Function):
    """``value``, with the gradient ``grad`` w.r.t. ``V`` (assembled by hand).

    The E-step objective is a quadratic (or, for the mode, a GLM) in ``V`` whose
    gradient is one VJP of hand-made output cotangents: building it by hand spares
    autograd's graph through the Jacobian products.
    """

    @staticmethod
    def forward(ctx, V, value, grad):
        ctx.save_for_backward(grad)
        return value.clone()

    @staticmethod
    def backward(ctx, grad_out):
        (grad,) = ctx.saved_tensors
        return grad_out * grad, None, None


def _sample_cov(jz: torch.Tensor) -> torch.Tensor:
    """``(1/K) sum_k (J z_k)(J z_k)^T`` per point from ``jz`` of shape (B, C, K)."""
    return torch.einsum("bck,bdk->bcd", jz, jz) / jz.shape[-1]


def _ggn_diag_sums(payload, batches):
    """``(diag(sum_n J_n^T Lam_n J_n),)`` over ``batches`` from Jacobian rows (float64)."""
    lin, lik, n_outputs = payload
    d = torch.zeros(lin.n_params, dtype=_F64, device=lin.device)
    for x, _ in batches:
        for sl, J in lin.jacobian_chunks(x, n_outputs):
            A = lik.lam_factor(lin.forward(x[sl]).to(_F64))
            d += torch.einsum("bcd,bcp->bdp", A, J.to(_F64)).pow(2).sum((0, 1))
    return (d,)


def _statistics_sums(payload, batches):
    """``(gamma, rss)`` over ``batches``: ``gamma = (1/K) sum_k sum_n |A_n^T J_n z_k|^2``
    and the residual sum of squares of the linear model's mode (regression)."""
    lin, lik, delta, Z, regression = payload
    K = Z.shape[0]
    T = torch.cat([delta[None], Z])
    gamma, rss = 0.0, 0.0
    for x, y in batches:
        g, jt = lin.jvp(x, T)
        g, jt = g.to(_F64), jt.to(_F64)
        A = lik.lam_factor(g)
        gamma += float(torch.einsum("bcd,bck->bdk", A, jt[..., 1:]).pow(2).sum()) / K
        if regression:
            rss += float((y - g - jt[..., 0]).pow(2).sum())
    return gamma, rss


def _validation_nll_sums(payload, batches):
    """Row sums of the validation NLL of the samples, for each rescaling factor ``c``.

    Regression: the samples for ``(c s0^2, c s2)`` are ``sqrt(c)`` times those for
    ``(s0^2, s2)`` (same draws), so the predictive is ``N(g, c (cov + s2))`` exactly;
    classification has ``factors = [1]``. Returns ``(sums (len(factors),), rows)``.
    """
    lin, Z, lik, regression, factors, s2_ref, seed = payload
    mc = uses_mc_link(lik)
    gen = torch.Generator().manual_seed(seed) if mc else None
    out = torch.zeros(len(factors), dtype=_F64)
    n = 0
    for x, y in batches:
        g, jz = lin.jvp(x, Z)
        g, cov = g.to(_F64), _sample_cov(jz.to(_F64))
        eps = None
        if mc:
            eps = torch.randn((lik.n_samples, *g.shape), dtype=_F64, generator=gen).to(g.device)
        for j, c in enumerate(factors):
            lk = lik.with_noise(c * s2_ref) if regression else lik
            out[j] -= float(lk.log_predictive(g, c * cov, y, eps=eps).sum())
        n += g.shape[0]
    return out, n


class SampledLLAPosterior(Posterior):
    """Sample-then-optimise linearised Laplace posterior.

    Parameters
    ----------
    prior_variance : float or "auto"
        ``s0^2 = 1 / alpha``; ``"auto"`` is chosen by ``hyper``.
    noise_variance : float, "auto" or None
        ``s2`` (regression) or ``None`` (classification).
    hyper : {"auto", "validation", "em"}, default="auto"
        Strategy for ``"auto"`` values: ``"auto"`` uses ``"validation"`` when the data
        carries held-out rows and ``"em"`` otherwise.
    n_posterior_samples : int, default=64
        ``K``.
    n_em_steps : int, default=3
        EM iterations (``hyper="em"``).
    max_iter : int, default=300
        Adam steps per E-step (``max_iter // 4`` per candidate of the validation scan).
    learning_rate : float, default=0.1
        Adam's (initial) learning rate, in prior-whitened coordinates.
    lr_schedule : {"auto", "cosine", "constant", "step"}, default="auto"
        Learning-rate schedule of each E-step (:func:`sklearn_lla._core.optim.lr_factor`);
        ``"auto"``: ``"constant"`` when one minibatch holds every training row (a
        deterministic objective), ``"cosine"`` otherwise (the decay averages the
        minibatch noise out).
    early_stopping : bool, default=False
        End an E-step when the objective, averaged over windows of 50 steps, decreases
        by less than ``tol`` (relative) ``n_iter_no_change`` times in a row.
    tol : float, default=1e-4
        Relative decrease below which a window counts as no improvement.
    n_iter_no_change : int, default=3
        Windows without improvement before an E-step ends.
    g_prior : bool, default=False
        Per-parameter prior scales ``s = 1 / sqrt(diag GGN)`` (normalised to mean one,
        the diagonal floored at ``1e-4``: ``s <= 100``).
    validation_grid : ValidationGrid or None, default=None
        The prior factors (scanned in increasing order) and noise factors of
        ``hyper="validation"``; ``None``: :data:`PRIOR_GRID` and :data:`NOISE_GRID`.
    """

    fitted_attributes = ("prior_variance", "likelihood", "hyper_strategy", "hyper_trace",
                         "samples", "mode", "effective_dim", "prior_scale", "n_iter")

    def __init__(self, prior_variance="auto", noise_variance=None, *, hyper="auto",
                 n_posterior_samples=64, n_em_steps=3, max_iter=300, learning_rate=0.1,
                 lr_schedule="auto", early_stopping=False, tol=1e-4, n_iter_no_change=3,
                 g_prior=False, validation_grid=None):
        self.prior_variance = prior_variance
        self.noise_variance = noise_variance
        self.hyper = hyper
        self.n_posterior_samples = int(n_posterior_samples)
        self.n_em_steps = int(n_em_steps)
        self.max_iter = int(max_iter)
        self.learning_rate = float(learning_rate)
        self.lr_schedule = lr_schedule
        self.early_stopping = bool(early_stopping)
        self.tol = float(tol)
        self.n_iter_no_change = int(n_iter_no_change)
        self.g_prior = bool(g_prior)
        self.validation_grid = validation_grid or ValidationGrid(PRIOR_GRID, NOISE_GRID)

    # ------------------------------------------------------------------ helpers
    def _ggn_diag(self, data):
        """``diag(sum_n J_n^T Lam_n J_n)`` (float64), a row-sum pass."""
        return data.reduce(_ggn_diag_sums, (data.lin, data.likelihood, data.n_outputs))[0]

    def _perturbation_pass(self, data, lik):
        """``S = sum_n J_n^T A_n eps_n`` for K fresh ``eps_n ~ N(0, I)`` (K, P)."""
        lin, K, C = data.lin, self.n_posterior_samples, data.n_outputs
        S = torch.zeros((K, lin.n_params), dtype=_F64, device=data.device)
        gen = data.generator
        for x, _ in data.batches():
            g = lin.forward(x).to(_F64)
            eps = torch.randn((x.shape[0], K, C), dtype=_F64, generator=gen).to(data.device)
            cot = torch.einsum("bcd,bkd->kbc", lik.lam_factor(g), eps)
            S += _flat(lin.vjp(x, cot), lin.names, K).to(_F64)
        return S

    def _statistics(self, data, lik, delta, Z):
        """One row-sum pass: ``gamma`` (function-space estimator) and the linear model's RSS."""
        gamma, rss = data.reduce(_statistics_sums, (data.lin, lik, delta, Z, self._regression))
        return float(gamma), float(rss)

    def _validation_noise(self, data):
        """Mean squared residual of the network on the validation rows."""
        sq, n = data.validation.reduce(validation_residuals, data.lin)
        return max(sq / max(n, 1), 1e-12)

    def _validation_nll(self, data, lik, factors, s2_ref, seed):
        """Mean validation NLL of the current samples, rescaled by each factor ``c``.

        A row-sum pass (per partition on dask validation data); see
        :func:`_validation_nll_sums`.
        """
        payload = (data.lin, self._Z, lik, self._regression,
                   np.asarray(factors, dtype=np.float64), s2_ref, seed)
        total, n = data.validation.reduce(_validation_nll_sums, payload)
        out = total.cpu().numpy() / max(n, 1)
        return np.where(np.isfinite(out), out, np.inf)

    def _strategy(self, data, fit_prior, fit_noise):
        if not (fit_prior or fit_noise):
            return "fixed"
        hyper = self.hyper
        if hyper == "auto":
            hyper = "validation" if data.validation is not None else "em"
        if hyper not in ("validation", "em"):
            raise ValueError(f"hyper_strategy must be 'auto', 'validation' or 'em', got "
                             f"{hyper!r}")
        if hyper == "validation" and data.validation is None:
            raise ValueError("hyper_strategy='validation' needs held-out data: pass "
                             "validation_data to fit")
        return hyper

    def _schedule(self, data):
        """``"auto"``: constant when one minibatch holds every row, else cosine."""
        if self.lr_schedule != "auto":
            return self.lr_schedule
        return "constant" if data.n_samples <= data.batch_size else "cosine"

    # ------------------------------------------------------------------ E-step
    def _e_step(self, data, lik, sigma, desc, max_iter=None):
        """Optimise the mode (column 0) and the K samples together; updates state."""
        lin, N = data.lin, data.n_samples
        K = self.n_posterior_samples
        w_hat = self._theta_hat / sigma
        U_n = self._eps0 + sigma * self._S
        V = torch.cat([(self._delta / sigma)[None], self._Z / sigma]).requires_grad_(True)

        def loss_fn(batch):
            x, y = batch
            scale = N / x.shape[0]
            with torch.no_grad():
                g, jt = lin.jvp(x, V * sigma)
                g, jt = g.to(_F64), jt.to(_F64)
                f = g + jt[..., 0]
                A = lik.lam_factor(g)
                ajz = torch.einsum("bcd,bck->bdk", A, jt[..., 1:])  # A^T J z_k
                r0, r = w_hat + V[0], V[1:] - U_n
                value = (scale * (0.5 * ajz.pow(2).sum() - lik.log_prob(f, y).sum())
                         + 0.5 * (r0.pow(2).sum() + r.pow(2).sum())) / (K + 1)
                # output cotangents: -d log p / df (mode), Lam J z_k (samples)
                cot = torch.cat([-lik.grad(f, y)[None],
                                 torch.einsum("bcd,bdk->kbc", A, ajz)])
                grad = _flat(lin.vjp(x, cot), lin.names, K + 1).to(_F64).mul_(scale * sigma)
                grad[0] += r0
                grad[1:] += r
                grad /= K + 1
            window.append(float(value))
            return _HandGradient.apply(V, value, grad)

        window, state = [], {"ref": math.inf}

        def windowed():
            cur = float(np.mean(window[-_CHECK_FREQ:]))
            if cur < state["ref"] - self.tol * abs(state["ref"]) or not np.isfinite(state["ref"]):
                state["ref"] = cur
                return cur
            return state["ref"]

        es = self.early_stopping
        res = minimize(loss_fn, [V], minibatches(data, data.batch_size, data.generator),
                       max_iter=max_iter or self.max_iter, lr=self.learning_rate,
                       validation=windowed if es else None, validation_freq=_CHECK_FREQ,
                       early_stopping=es, n_iter_no_change=self.n_iter_no_change,
                       verbose=data.verbose, desc=desc, lr_schedule=self._schedule(data))
        with torch.no_grad():
            W = V.detach() * sigma
        self._delta, self._Z = W[0].clone(), W[1:].clone()
        self.n_iter.append(res.n_iter)
        return res

    # ------------------------------------------------------------ hyperparameters
    def _validation_scan(self, data, lik, scale, base, s2_ref, fit_prior, fit_noise):
        """Choose ``"auto"`` values by validation NLL (see the module docstring)."""
        if not fit_prior:  # a given prior: s2 is the mean squared validation residual
            return HyperResult(float(self.prior_variance), s2_ref, "validation",
                               {"noise_variance": np.array([s2_ref])})
        grid = self.validation_grid
        s0s = base * np.sort(np.asarray(grid.prior_grid, dtype=np.float64))
        factors = np.asarray(grid.noise_grid, dtype=np.float64) if fit_noise else np.ones(1)
        scan_iter = max(1, math.ceil(self.max_iter * _SCAN_FRACTION))
        scores, best, bad = [], None, 0
        seed = mc_seed(lik, data.generator)  # common random numbers across the scan
        self._Z = self._eps0 * math.sqrt(s0s[0]) * scale
        for i, s0 in enumerate(s0s):
            if i:  # warm start: the previous solution in whitened coordinates
                self._Z *= math.sqrt(s0 / s0s[i - 1])
            with warnings.catch_warnings():  # short warm-started runs, by design
                warnings.simplefilter("ignore", ConvergenceWarning)
                self._e_step(data, lik, math.sqrt(s0) * scale,
                             f"SampledLLA validation scan {i + 1}/{len(s0s)}", scan_iter)
            row = self._validation_nll(data, lik, factors, s2_ref, seed)
            scores.append(row)
            j = int(np.argmin(row))
            if best is None or row[j] < best[0]:
                best, bad = (row[j], i, j, self._delta.clone(), self._Z.clone()), 0
            elif row[j] > best[0] + _SCAN_TOL * abs(best[0]):
                bad += 1
                if bad >= _SCAN_PATIENCE:
                    break
            else:  # within the tolerance of the best: not a clearly worse candidate
                bad = 0
        score, i, j, self._delta, self._Z = best
        if not np.isfinite(score):
            raise FloatingPointError(
                "the validation NLL is not finite for any candidate hyperparameter")
        c = float(factors[j])
        self._Z *= math.sqrt(c)  # exact samples at (c s0^2, c s2): same draws
        self._S /= math.sqrt(c)  # Lam^(1/2) = I / sqrt(c s2)
        tried = s0s[:len(scores)]
        s2s = None if s2_ref is None else s2_ref * factors
        ValidationGrid._warn_edges(i, j, s0s, factors, "auto", "auto" if fit_noise else 1.0)
        trace = {"prior_variance": tried, "noise_variance": s2s,
                 "rescaled_prior_variance": np.outer(tried, factors),
                 "score": np.asarray(scores), "best_score": float(score),
                 "scan_iter": scan_iter}
        return HyperResult(float(s0s[i] * c), None if s2_ref is None else float(s2_ref * c),
                           "validation", trace)

    # --------------------------------------------------------------------- fit
    def fit(self, data):
        """Choose the ``"auto"`` hyperparameters and draw the posterior samples."""
        lin, lik = data.lin, data.likelihood
        N, C, P, K = data.n_samples, data.n_outputs, lin.n_params, self.n_posterior_samples
        self._regression = self.noise_variance is not None
        self._theta_hat = lin.flat_params().to(_F64)
        scale = torch.ones(P, dtype=_F64, device=data.device)
        if self.g_prior:
            d = self._ggn_diag(data)
            d = d / d.mean().clamp_min(torch.finfo(_F64).tiny)
            scale = 1.0 / d.clamp_min(G_PRIOR_FLOOR).sqrt()
        self.prior_scale = scale
        fit_prior = self.prior_variance == "auto"
        fit_noise = self._regression and self.noise_variance == "auto"
        strategy = self._strategy(data, fit_prior, fit_noise)
        base = max(float((self._theta_hat / scale).pow(2).sum()) / P, 1e-12)
        s0 = base if fit_prior else max(float(self.prior_variance), 1e-12)
        noise_source = None
        if fit_noise:
            if data.validation is not None:
                s2, noise_source = self._validation_noise(data), "validation"
            else:
                r2 = sum(float((y - lin.forward(x).to(_F64)).pow(2).sum())
                         for x, y in data.batches())
                s2, noise_source = max(r2 / (N * C), 1e-12), "em"
            lik = lik.with_noise(s2)
        elif self._regression:
            s2 = float(self.noise_variance)
            lik = lik.with_noise(s2)
        else:
            s2 = None
        self._eps0 = torch.randn((K, P), dtype=_F64, generator=data.generator).to(data.device)
        self._S = self._perturbation_pass(data, lik)
        self._delta = torch.zeros(P, dtype=_F64, device=data.device)
        self._Z = self._eps0 * math.sqrt(s0) * scale
        self.n_iter = []
        if strategy == "validation":
            result = self._validation_scan(data, lik, scale, base, s2, fit_prior, fit_noise)
            s0, s2 = result.prior_variance, result.noise_variance
            if self._regression:
                lik = lik.with_noise(s2)
        elif strategy == "em":
            result, lik = self._em(data, lik, scale, s0, s2, fit_prior,
                                   fit_noise and noise_source == "em")
            s0, s2 = result.prior_variance, result.noise_variance
        else:
            result = Fixed().select(s0, s2)
        if self._regression:
            result.trace["noise_source"] = noise_source
        # final E-step at the chosen hyperparameters (perturbations rescaled, warm start)
        res = self._e_step(data, lik, math.sqrt(s0) * scale, "SampledLLA samples")
        if strategy == "validation" and fit_prior and fit_noise:
            s0, s2, lik = self._refit_scale(data, lik, s0, s2, result.trace)
        gamma, _ = self._statistics(data, lik, self._delta, self._Z)
        result.trace["optimisation"] = res.as_dict()
        result.trace["lr_schedule"] = self._schedule(data)
        self.prior_variance = float(s0)
        self.likelihood = lik
        self.hyper_strategy, self.hyper_trace = result.strategy, result.trace
        self.samples = self._Z
        self.mode = self._theta_hat + self._delta
        self.effective_dim = gamma
        self.lin = lin
        for name in ("_eps0", "_S", "_Z", "_delta", "_theta_hat"):
            delattr(self, name)
        return self

    def _refit_scale(self, data, lik, s0, s2, trace):
        """Re-choose the exact rescaling ``(c s0^2, c s2)`` with the final samples.

        The scan scored samples after ``max_iter * 0.25`` steps; the final E-step
        moves them further, and the free scale ``c`` is re-chosen on the validation
        rows with the samples that are kept, so that the predictive is the one scored.
        """
        factors = np.asarray(self.validation_grid.noise_grid, dtype=np.float64)
        row = self._validation_nll(data, lik, factors, s2, mc_seed(lik, data.generator))
        j = int(np.argmin(row))
        if not np.isfinite(row[j]):
            raise FloatingPointError("the validation NLL of the final samples is not finite")
        c = float(factors[j])
        self._Z *= math.sqrt(c)
        trace.update(final_factor=c, final_score=float(row[j]))
        return s0 * c, s2 * c, lik.with_noise(s2 * c)

    def _em(self, data, lik, scale, s0, s2, fit_prior, fit_noise):
        """The paper's EM: ``n_em_steps`` (E-step, M-step) pairs."""
        N, C = data.n_samples, data.n_outputs
        state = {"s2": s2, "lik": lik}

        def step(prior_variance):
            it = len(self.n_iter) + 1
            self._e_step(data, state["lik"], math.sqrt(prior_variance) * scale,
                         f"SampledLLA E-step {it}/{self.n_em_steps}")
            gamma, rss = self._statistics(data, state["lik"], self._delta, self._Z)
            w_sq = float(((self._theta_hat + self._delta) / scale).pow(2).sum())
            info = {"effective_dim": gamma, "mode_sq_norm": w_sq, "n_iter": self.n_iter[-1]}
            new = max(w_sq / max(gamma, 1e-12), 1e-12) if fit_prior else prior_variance
            if fit_noise:
                s2_new = max(rss / max(N * C - gamma, 1.0), 1e-12)
                self._S *= math.sqrt(state["s2"] / s2_new)  # Lam^(1/2) = I / sqrt(s2)
                state["s2"], state["lik"] = s2_new, state["lik"].with_noise(s2_new)
                info["noise_variance"] = s2_new
            info["prior_variance"] = new
            return new, info

        result = EM(self.n_em_steps).run(step, s0, s2)
        result.noise_variance = state["s2"]
        return result, state["lik"]

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
