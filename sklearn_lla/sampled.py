"""Sampled LLA: linearised Laplace by sample-then-optimise, with EM prior learning.

LLA is the posterior of the linear model ``f(x, theta) = g(x) + J(x) (theta - theta_hat)``
with prior ``theta ~ N(0, A^-1)``, ``A = alpha diag(1 / s^2)`` (``s = 1`` unless the
g-prior is used) and the likelihood's output curvature ``Lam_n = A_n A_n^T``. Following
Antoran et al. (ICLR 2023), nothing ``P x P`` or ``NC x NC`` is ever formed:

* **E-step.** The linear model's mode ``theta_bar`` and ``K`` posterior samples
  ``zeta_k ~ N(0, H^-1)``, ``H = sum_n J_n^T Lam_n J_n + A``, are found together by
  minibatch Adam (:func:`sklearn_lla._optim.minimize`). The samples minimise the
  low-variance sample-then-optimise objective
  ``1/2 z^T (sum_n J_n^T Lam_n J_n) z + 1/2 (z - theta_n)^T A (z - theta_n)`` with
  ``theta_n = theta_0 + A^-1 sum_n J_n^T Lam_n^(1/2) eps_n``, ``theta_0 ~ N(0, A^-1)``
  and ``eps_n ~ N(0, I)`` drawn once. One JVP with ``K + 1`` tangents gives every
  ``J(x) z_k`` of a minibatch at once and one VJP with ``K + 1`` cotangents their
  gradients; the data term of a minibatch of ``B`` rows is scaled by ``N / B``.
  The optimisation runs in prior-whitened coordinates ``u = z / sigma``
  (``sigma = s0 s``), where Adam's learning rate is relative to the prior's scale.
* **M-step** (``prior_variance="auto"``). The effective dimension
  ``gamma = (1/K) sum_k sum_n (J_n zeta_k)^T Lam_n (J_n zeta_k)`` (function-space
  estimator, one pass) and ``alpha = gamma / ||theta_bar / s||^2``. Between EM steps
  the perturbations are rescaled, never redrawn (in whitened coordinates
  ``u_n = eps_0 + sigma * sum_n J_n^T A_n eps_n``: only ``sigma`` changes), and the
  optimisation is warm-started from the previous solution.
* **Predictive.** ``g(x) + J(x) zeta_k``: the latent mean is the network's output and
  the latent covariance the sample covariance ``(1/K) sum_k (J zeta_k)(J zeta_k)^T``
  (``zeta`` has known mean zero), ``C x C`` per point.

Memory is ``O(P K)`` (the samples, their perturbations and Adam's moments) plus one
minibatch; time is ``O(max_iter)`` JVP/VJP pairs with ``K + 1`` tangents per E-step.
"""

from __future__ import annotations

import math
from numbers import Integral, Real

import numpy as np
import torch
from sklearn.utils._param_validation import Interval

from ._base import (
    CLASSIFIER_CONSTRAINTS,
    REGRESSOR_CONSTRAINTS,
    LaplaceClassifierMixin,
    LaplaceRegressorMixin,
)
from ._hyper import EM, Fixed
from ._optim import minibatches, minimize
from ._protocol import LatentPredictive, Posterior

__all__ = ["SampledLLAPosterior", "SampledLLARegressor", "SampledLLAClassifier"]

_F64 = torch.float64

#: Smallest normalised GGN diagonal entry of the g-prior (so ``s <= 100``).
G_PRIOR_FLOOR = 1e-4

#: Steps between the checks of the windowed objective when ``early_stopping``.
_CHECK_FREQ = 50


def _flat(grads: dict, names, K) -> torch.Tensor:
    return torch.cat([grads[n].reshape(K, -1) for n in names], dim=1)


class _JacobianProducts(torch.autograd.Function):
    """``J(x) t_k`` for tangents ``T`` (K, P); backward is the VJP with K cotangents."""

    @staticmethod
    def forward(ctx, T, x, lin):
        g, jt = lin.jvp(x, T)
        ctx.lin, ctx.x = lin, x
        g = g.to(_F64)
        ctx.mark_non_differentiable(g)
        return g, jt.to(_F64)

    @staticmethod
    def backward(ctx, grad_g, grad_jt):
        lin = ctx.lin
        K = grad_jt.shape[-1]
        grads = lin.vjp(ctx.x, grad_jt.permute(2, 0, 1).contiguous())
        return _flat(grads, lin.names, K).to(_F64), None, None


def _sample_cov(jz: torch.Tensor) -> torch.Tensor:
    """``(1/K) sum_k (J z_k)(J z_k)^T`` per point from ``jz`` of shape (B, C, K)."""
    return torch.einsum("bck,bdk->bcd", jz, jz) / jz.shape[-1]


class SampledLLAPosterior(Posterior):
    """Sample-then-optimise linearised Laplace posterior with EM hyperparameters.

    Parameters
    ----------
    prior_variance : float or "auto"
        ``s0^2 = 1 / alpha``; ``"auto"`` learns it by EM.
    noise_variance : float, "auto" or None
        ``s2`` (regression) or ``None`` (classification).
    n_posterior_samples : int, default=64
        ``K``.
    n_em_steps : int, default=3
        EM iterations when a hyperparameter is ``"auto"``.
    max_iter : int, default=1000
        Adam steps per E-step.
    learning_rate : float, default=0.05
        Adam's learning rate (in prior-whitened coordinates).
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
    """

    fitted_attributes = ("prior_variance", "likelihood", "hyper_strategy", "hyper_trace",
                         "samples", "mode", "effective_dim", "prior_scale", "n_iter")

    def __init__(self, prior_variance="auto", noise_variance=None, *, n_posterior_samples=64,
                 n_em_steps=3, max_iter=1000, learning_rate=0.05, early_stopping=False,
                 tol=1e-4, n_iter_no_change=3, g_prior=False):
        self.prior_variance = prior_variance
        self.noise_variance = noise_variance
        self.n_posterior_samples = int(n_posterior_samples)
        self.n_em_steps = int(n_em_steps)
        self.max_iter = int(max_iter)
        self.learning_rate = float(learning_rate)
        self.early_stopping = bool(early_stopping)
        self.tol = float(tol)
        self.n_iter_no_change = int(n_iter_no_change)
        self.g_prior = bool(g_prior)

    # ------------------------------------------------------------------ helpers
    def _ggn_diag(self, data):
        """``diag(sum_n J_n^T Lam_n J_n)`` streamed over Jacobian rows (float64)."""
        lin, lik = data.lin, data.likelihood
        d = torch.zeros(lin.n_params, dtype=_F64, device=data.device)
        for x, _ in data.batches():
            for sl, J in lin.jacobian_chunks(x, data.n_outputs):
                A = lik.lam_factor(lin.forward(x[sl]).to(_F64))
                AJ = torch.einsum("bcd,bcp->bdp", A, J.to(_F64))
                d += AJ.pow(2).sum((0, 1))
        return d

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
        """One pass: ``gamma`` (function-space estimator) and the linear model's RSS."""
        lin = data.lin
        K = Z.shape[0]
        T = torch.cat([delta[None], Z])
        gamma, rss = 0.0, 0.0
        for x, y in data.batches():
            g, jt = lin.jvp(x, T)
            g, jt = g.to(_F64), jt.to(_F64)
            A = lik.lam_factor(g)
            gamma += float(torch.einsum("bcd,bck->bdk", A, jt[..., 1:]).pow(2).sum()) / K
            if self._regression:
                rss += float((y - g - jt[..., 0]).pow(2).sum())
        return gamma, rss

    def _validation_noise(self, data):
        """Mean squared residual of the network on the validation rows."""
        v = data.validation
        r2, n = 0.0, 0
        for x, y in v.batches():
            r2 += float((y - data.lin.forward(x).to(_F64)).pow(2).sum())
            n += y.numel()
        return max(r2 / n, 1e-12)

    # ------------------------------------------------------------------ E-step
    def _e_step(self, data, lik, sigma, desc):
        """Optimise the mode (column 0) and the K samples together; updates state."""
        lin, N = data.lin, data.n_samples
        K = self.n_posterior_samples
        w_hat = self._theta_hat / sigma
        U_n = self._eps0 + sigma * self._S
        V = torch.cat([(self._delta / sigma)[None], self._Z / sigma]).requires_grad_(True)

        def loss_fn(batch):
            x, y = batch
            scale = N / x.shape[0]
            g, jt = _JacobianProducts.apply(V * sigma, x, lin)
            A = lik.lam_factor(g)
            data_mode = -lik.log_prob(g + jt[..., 0], y).sum()
            data_samples = 0.5 * torch.einsum("bcd,bck->bdk", A, jt[..., 1:]).pow(2).sum()
            prior = 0.5 * ((w_hat + V[0]).pow(2).sum() + (V[1:] - U_n).pow(2).sum())
            loss = (scale * (data_mode + data_samples) + prior) / (K + 1)
            window.append(float(loss.detach()))
            return loss

        window, state = [], {"ref": math.inf}

        def windowed():
            cur = float(np.mean(window[-_CHECK_FREQ:]))
            if cur < state["ref"] - self.tol * abs(state["ref"]) or not np.isfinite(state["ref"]):
                state["ref"] = cur
                return cur
            return state["ref"]

        es = self.early_stopping
        res = minimize(loss_fn, [V], minibatches(data, data.batch_size, data.generator),
                       max_iter=self.max_iter, lr=self.learning_rate,
                       validation=windowed if es else None, validation_freq=_CHECK_FREQ,
                       early_stopping=es, n_iter_no_change=self.n_iter_no_change,
                       verbose=data.verbose, desc=desc)
        with torch.no_grad():
            W = V.detach() * sigma
        self._delta, self._Z = W[0].clone(), W[1:].clone()
        return res

    # --------------------------------------------------------------------- fit
    def fit(self, data):
        """Learn the hyperparameters by EM (when ``"auto"``) and draw the samples."""
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
        s0 = (float((self._theta_hat / scale).pow(2).sum()) / P if fit_prior
              else float(self.prior_variance))
        s0 = max(s0, 1e-12)
        noise_source = None
        if fit_noise:
            if data.validation is not None:
                s2, fit_noise, noise_source = self._validation_noise(data), False, "validation"
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
        state = {"s2": s2, "lik": lik}

        def step(prior_variance):
            it = len(self.n_iter) + 1
            res = self._e_step(data, state["lik"], math.sqrt(prior_variance) * scale,
                               f"SampledLLA E-step {it}/{self.n_em_steps}")
            self.n_iter.append(res.n_iter)
            gamma, rss = self._statistics(data, state["lik"], self._delta, self._Z)
            w_sq = float(((self._theta_hat + self._delta) / scale).pow(2).sum())
            info = {"effective_dim": gamma, "mode_sq_norm": w_sq, "n_iter": res.n_iter,
                    "loss": res.loss_history[-1] if res.loss_history else float("nan")}
            new = max(w_sq / max(gamma, 1e-12), 1e-12) if fit_prior else prior_variance
            if fit_noise:
                s2_new = max(rss / max(N * C - gamma, 1.0), 1e-12)
                self._S *= math.sqrt(state["s2"] / s2_new)  # Lam^(1/2) = I / sqrt(s2)
                state["s2"], state["lik"] = s2_new, state["lik"].with_noise(s2_new)
                info["noise_variance"] = s2_new
            info["prior_variance"] = new
            return new, info

        if fit_prior or fit_noise:
            result = EM(self.n_em_steps).run(step, s0, s2)
            s0 = result.prior_variance
            result.noise_variance = state["s2"]
        else:
            result = Fixed().select(s0, s2)
        if self._regression:
            result.trace["noise_source"] = noise_source
        # final E-step at the learned hyperparameters (perturbations rescaled, warm start)
        res = self._e_step(data, state["lik"], math.sqrt(s0) * scale, "SampledLLA samples")
        self.n_iter.append(res.n_iter)
        gamma, _ = self._statistics(data, state["lik"], self._delta, self._Z)
        result.trace["optimisation"] = res.as_dict()
        self.prior_variance = float(s0)
        self.likelihood = state["lik"] if self._regression else lik
        self.hyper_strategy, self.hyper_trace = result.strategy, result.trace
        self.samples = self._Z
        self.mode = self._theta_hat + self._delta
        self.effective_dim = gamma
        self.lin = lin
        for name in ("_eps0", "_S", "_Z", "_delta", "_theta_hat"):
            delattr(self, name)
        return self

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


class _SampledMixin:
    """Parameters and posterior shared by the regressor and the classifier."""

    _sampled_constraints = {
        "n_posterior_samples": [Interval(Integral, 1, None, closed="left")],
        "n_em_steps": [Interval(Integral, 0, None, closed="left")],
        "max_iter": [Interval(Integral, 1, None, closed="left")],
        "learning_rate": [Interval(Real, 0, None, closed="neither")],
        "early_stopping": ["boolean"],
        "tol": [Interval(Real, 0, None, closed="left")],
        "n_iter_no_change": [Interval(Integral, 1, None, closed="left")],
        "g_prior": ["boolean"],
        "validation_fraction": [Interval(Real, 0, 1, closed="neither")],
    }

    def _make_posterior(self, data):
        noise = self.noise_variance if data.likelihood.task == "regression" else None
        return SampledLLAPosterior(
            self.prior_variance, noise, n_posterior_samples=self.n_posterior_samples,
            n_em_steps=self.n_em_steps, max_iter=self.max_iter,
            learning_rate=self.learning_rate, early_stopping=self.early_stopping, tol=self.tol,
            n_iter_no_change=self.n_iter_no_change, g_prior=self.g_prior)

    def _store_fitted(self, posterior):
        self.effective_dim_ = float(posterior.effective_dim)
        self.n_iter_ = np.asarray(posterior.n_iter, dtype=np.int64)
        super()._store_fitted(posterior)


class SampledLLARegressor(_SampledMixin, LaplaceRegressorMixin):
    """Sampled LLA regression: sample-then-optimise posterior samples with EM.

    Parameters
    ----------
    net : None, skorch net, FrozenEstimator or torch.nn.Module, default=None
        The network. ``None`` trains a small tanh MLP (MAP, weight decay) in ``fit``;
        a fitted skorch net, ``FrozenEstimator(net)`` or an ``nn.Module`` is used as it
        is and never modified; an unfitted skorch net is trained in ``fit``.
    n_posterior_samples : int, default=64
        ``K``, posterior samples of the linearised parameters (optimised together,
        kept for prediction). Memory is about ``5 K P`` doubles during ``fit`` and
        ``K P`` after.
    prior_variance : float or "auto", default="auto"
        ``s0^2 = 1 / alpha``. ``"auto"``: ``n_em_steps`` EM updates
        ``alpha = gamma / ||theta_bar||^2`` from ``||theta_hat||^2 / P``.
    noise_variance : float or "auto", default="auto"
        ``s2``. ``"auto"``: the mean squared residual of the network on validation
        rows when there are any, otherwise the EM update
        ``s2 = RSS(theta_bar) / (N n_targets - gamma)`` from ``RSS(theta_hat) / (N
        n_targets)``.
    n_em_steps : int, default=3
        EM iterations for ``"auto"`` hyperparameters (one E-step each, plus a final
        E-step at the learned values).
    max_iter : int, default=1000
        Adam steps per E-step (minibatches of ``batch_size`` rows).
    learning_rate : float, default=0.05
        Adam's learning rate, in prior-whitened coordinates.
    early_stopping : bool, default=False
        End an E-step early when its objective, averaged over windows of 50 steps,
        decreases by less than ``tol`` (relative) ``n_iter_no_change`` times in a row.
    tol : float, default=1e-4
        Relative decrease of the windowed objective that counts as progress.
    n_iter_no_change : int, default=3
        Windows without progress before an E-step ends (with ``early_stopping``).
    g_prior : bool, default=False
        Per-parameter prior scales ``1 / sqrt(diag GGN)`` (normalised to mean one and
        clipped at 100) instead of an isotropic prior.
    validation_fraction : float, default=0.1
        Fraction of rows held out when a network is trained in ``fit`` (used for the
        ``"auto"`` noise variance of the regressor).
    trainable_only : bool, default=True
        Linearise only parameters with ``requires_grad=True``.
    device : str or torch.device, default="auto"
        ``"auto"`` (CUDA when available), ``"cpu"``, ``"cuda"`` or a torch device.
    batch_size : int, default=256
        Rows per minibatch and per forward pass at prediction.
    random_state : int, RandomState instance or None, default=None
        Seeds the perturbations, the minibatch order and net training.
    verbose : int or bool, default=0
        ``>= 1`` shows progress bars.

    Attributes
    ----------
    prior_variance_ : float
        Prior variance in use.
    noise_variance_ : float
        Noise variance in use.
    effective_dim_ : float
        ``gamma`` estimated from the final samples.
    n_iter_ : ndarray of int
        Adam steps of each E-step.
    hyper_strategy_ : str
        ``"em"`` or ``"fixed"``.
    hyper_trace_ : dict
        Prior variances of each EM step and per-step information.
    net_ : object
        The pretrained or trained network.
    linearized_net_ : LinearizedNet
        The frozen functional view of the network.
    jacobian_backend_ : str
        ``"structured"`` or ``"functorch"``.
    likelihood_ : Gaussian
        The fitted likelihood.
    posterior_ : SampledLLAPosterior
        The fitted posterior (``samples`` of shape (K, P), ``mode``).
    n_outputs_ : int
        Number of network outputs.
    n_features_in_ : int
        Number of input features.
    feature_names_in_ : ndarray of shape (n_features_in_,)
        Feature names, when ``X`` has string column names.

    See Also
    --------
    LLARegressor : Exact LLA, the reference.

    Examples
    --------
    >>> import numpy as np
    >>> from sklearn_lla import SampledLLARegressor
    >>> rng = np.random.RandomState(0)
    >>> X = rng.uniform(-2, 2, (200, 1))
    >>> y = np.sin(2 * X[:, 0]) + 0.1 * rng.randn(200)
    >>> reg = SampledLLARegressor(n_posterior_samples=16, max_iter=200,
    ...                           random_state=0).fit(X, y)
    >>> mean, std = reg.predict(X[:2], return_std=True)
    >>> std.shape
    (2,)
    """

    _parameter_constraints = {**REGRESSOR_CONSTRAINTS, **_SampledMixin._sampled_constraints}

    def __init__(self, net=None, *, n_posterior_samples=64, prior_variance="auto",
                 noise_variance="auto", n_em_steps=3, max_iter=1000, learning_rate=0.05,
                 early_stopping=False, tol=1e-4, n_iter_no_change=3, g_prior=False,
                 validation_fraction=0.1, trainable_only=True, device="auto", batch_size=256,
                 random_state=None, verbose=0):
        self.net = net
        self.n_posterior_samples = n_posterior_samples
        self.prior_variance = prior_variance
        self.noise_variance = noise_variance
        self.n_em_steps = n_em_steps
        self.max_iter = max_iter
        self.learning_rate = learning_rate
        self.early_stopping = early_stopping
        self.tol = tol
        self.n_iter_no_change = n_iter_no_change
        self.g_prior = g_prior
        self.validation_fraction = validation_fraction
        self.trainable_only = trainable_only
        self.device = device
        self.batch_size = batch_size
        self.random_state = random_state
        self.verbose = verbose


class SampledLLAClassifier(_SampledMixin, LaplaceClassifierMixin):
    """Sampled LLA classification: sample-then-optimise posterior samples with EM.

    Parameters
    ----------
    net : None, skorch net, FrozenEstimator or torch.nn.Module, default=None
        The network. ``None`` trains a small tanh MLP (MAP, weight decay) in ``fit``;
        a fitted skorch net, ``FrozenEstimator(net)`` or an ``nn.Module`` is used as it
        is and never modified; an unfitted skorch net is trained in ``fit``.
    n_posterior_samples : int, default=64
        ``K``, posterior samples of the linearised parameters.
    prior_variance : float or "auto", default="auto"
        ``s0^2 = 1 / alpha``. ``"auto"``: ``n_em_steps`` EM updates
        ``alpha = gamma / ||theta_bar||^2`` from ``||theta_hat||^2 / P``.
    n_em_steps : int, default=3
        EM iterations for an ``"auto"`` prior variance.
    max_iter : int, default=1000
        Adam steps per E-step.
    learning_rate : float, default=0.05
        Adam's learning rate, in prior-whitened coordinates.
    early_stopping : bool, default=False
        End an E-step early when its windowed objective stops decreasing.
    tol : float, default=1e-4
        Relative decrease of the windowed objective that counts as progress.
    n_iter_no_change : int, default=3
        Windows without progress before an E-step ends (with ``early_stopping``).
    g_prior : bool, default=False
        Per-parameter prior scales ``1 / sqrt(diag GGN)`` (normalised, clipped).
    link_approx : {"probit", "mc", "bridge"}, default="probit"
        Approximation of ``E softmax(f)`` under the latent Gaussian with the sample
        covariance.
    n_samples_predict : int, default=512
        Samples per point for ``link_approx="mc"``.
    classes : array-like or None, default=None
        The label of each network output, in output order (see
        :class:`~sklearn_lla.LLAClassifier`).
    validation_fraction : float, default=0.1
        Fraction of rows held out when a network is trained in ``fit`` (used for the
        ``"auto"`` noise variance of the regressor).
    trainable_only : bool, default=True
        Linearise only parameters with ``requires_grad=True``.
    device : str or torch.device, default="auto"
        ``"auto"`` (CUDA when available), ``"cpu"``, ``"cuda"`` or a torch device.
    batch_size : int, default=256
        Rows per minibatch and per forward pass at prediction.
    random_state : int, RandomState instance or None, default=None
        Seeds the perturbations, the minibatch order, net training and ``mc`` draws.
    verbose : int or bool, default=0
        ``>= 1`` shows progress bars.

    Attributes
    ----------
    classes_ : ndarray
        Class labels, in the order of ``predict_proba``'s columns.
    prior_variance_ : float
        Prior variance in use.
    effective_dim_ : float
        ``gamma`` estimated from the final samples.
    n_iter_ : ndarray of int
        Adam steps of each E-step.
    hyper_strategy_ : str
        ``"em"`` or ``"fixed"``.
    hyper_trace_ : dict
        Prior variances of each EM step and per-step information.
    net_ : object
        The pretrained or trained network.
    linearized_net_ : LinearizedNet
        The frozen functional view of the network.
    jacobian_backend_ : str
        ``"structured"`` or ``"functorch"``.
    likelihood_ : Categorical or Bernoulli
        The likelihood.
    posterior_ : SampledLLAPosterior
        The fitted posterior.
    n_outputs_ : int
        Number of network outputs.
    n_features_in_ : int
        Number of input features.
    feature_names_in_ : ndarray of shape (n_features_in_,)
        Feature names, when ``X`` has string column names.

    See Also
    --------
    LLAClassifier : Exact LLA, the reference.

    Examples
    --------
    >>> from sklearn.datasets import make_blobs
    >>> from sklearn_lla import SampledLLAClassifier
    >>> X, y = make_blobs(n_samples=120, centers=3, random_state=0)
    >>> clf = SampledLLAClassifier(n_posterior_samples=16, max_iter=200,
    ...                            random_state=0).fit(X, y)
    >>> clf.predict_proba(X[:2]).shape
    (2, 3)
    """

    _parameter_constraints = {**CLASSIFIER_CONSTRAINTS, **_SampledMixin._sampled_constraints}

    def __init__(self, net=None, *, n_posterior_samples=64, prior_variance="auto", n_em_steps=3,
                 max_iter=1000, learning_rate=0.05, early_stopping=False, tol=1e-4,
                 n_iter_no_change=3, g_prior=False, link_approx="probit",
                 n_samples_predict=512, classes=None, validation_fraction=0.1,
                 trainable_only=True, device="auto",
                 batch_size=256, random_state=None, verbose=0):
        self.net = net
        self.n_posterior_samples = n_posterior_samples
        self.prior_variance = prior_variance
        self.n_em_steps = n_em_steps
        self.max_iter = max_iter
        self.learning_rate = learning_rate
        self.early_stopping = early_stopping
        self.tol = tol
        self.n_iter_no_change = n_iter_no_change
        self.g_prior = g_prior
        self.validation_fraction = validation_fraction
        self.link_approx = link_approx
        self.n_samples_predict = n_samples_predict
        self.classes = classes
        self.trainable_only = trainable_only
        self.device = device
        self.batch_size = batch_size
        self.random_state = random_state
        self.verbose = verbose
