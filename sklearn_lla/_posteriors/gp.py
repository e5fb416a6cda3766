"""Fixed-mean sparse variational GPs: the algebra VaLLA and FMGP share.

Both methods approximate the posterior of a GP whose predictive **mean is fixed to the
network** ``g`` by a decoupled sparse Gaussian measure (Cheng & Boots; the thesis
chapter ``papers/valla-and-fmgp-thesis-chapter.txt``). Only the covariance is learned:
``M`` inducing pairs ``(z_m, c_m)`` (an input and the output index it carries) and a
lower-triangular factor ``L`` (initialised to ``I``) with

* ``Hm = I + L^T Kzz L`` and ``A = L Hm^-1 L^T``;
* latent covariance ``S(x) = Kxx - Kxz A Kzx`` (C x C blocks per point);
* ``KL = 1/2 logdet Hm - 1/2 tr(Kzz A)``.

The objective is the alpha-divergence energy (alpha = 1 by default, alpha = 0 gives the
ELBO) on minibatches, ``(N / B) sum_b E_alpha(y_b) - KL``; :func:`alpha_energy` gives the
per-point term and the optimisation runs through the shared loop
(:func:`sklearn_lla._core.optim.minimize`).

What a method writes is a :class:`Kernel` (VaLLA: the scaled NTK ``s0^2 J(x) J(z)^T``;
FMGP: parametric kernels) and, optionally, an extra loss term (FMGP's auxiliary
``Q*``) through :class:`FixedMeanGPPosterior`'s hooks. The M x M algebra is float64
whatever the network's dtype; the Cholesky of ``Hm`` escalates its jitter.
"""

from __future__ import annotations

import abc
import math
from dataclasses import dataclass

import numpy as np
import torch

from .._core.hyper import Fixed, VariationalEnergy
from .._core.optim import minibatches, minimize
from .._core.protocol import LatentPredictive, Posterior

__all__ = [
    "FixedMeanGPPosterior",
    "Kernel",
    "VariationalTerms",
    "alpha_energy",
    "init_inducing",
    "joint_cov",
    "latent_cov",
    "robust_cholesky",
    "variational_terms",
]

_LOG_2PI = math.log(2.0 * math.pi)

#: Rows read (at most) to initialise the inducing inputs by k-means.
KMEANS_MAX_ROWS = 20_000


# ---------------------------------------------------------------------------------
# The kernel interface
# ---------------------------------------------------------------------------------


class Kernel(abc.ABC):
    """A kernel over (input, output index) pairs, evaluated in float64.

    ``K((x, c), (x', c'))`` for inputs ``x`` and output indices ``c`` (the regression
    target or the class logit). Subclasses implement :meth:`gram`, :meth:`cross` and
    :meth:`diag_blocks`, list their trainable tensors in :meth:`parameters`, and report
    their amplitude as :attr:`prior_variance`. :meth:`predictor` may be overridden to
    precompute what prediction needs once fitting is done.
    """

    def parameters(self) -> list:
        """Trainable leaf tensors (``requires_grad=True``), optimised with ``L`` and ``Z``."""
        return []

    @property
    @abc.abstractmethod
    def prior_variance(self) -> float:  # pragma: no cover - interface
        """The kernel's amplitude (reported as the estimator's ``prior_variance_``)."""
        raise NotImplementedError

    @abc.abstractmethod
    def gram(self, z: torch.Tensor, cz: torch.Tensor) -> torch.Tensor:  # pragma: no cover
        """``K(Z, Z)`` of shape (M, M) for inducing inputs ``z`` (M, D) and indices ``cz``."""
        raise NotImplementedError

    @abc.abstractmethod
    def cross(self, x: torch.Tensor, z: torch.Tensor,
              cz: torch.Tensor) -> torch.Tensor:  # pragma: no cover - interface
        """``K(x, Z)`` of shape (B, C, M): every output of every point against Z."""
        raise NotImplementedError

    @abc.abstractmethod
    def diag_blocks(self, x: torch.Tensor) -> torch.Tensor:  # pragma: no cover - interface
        """``K(x_b, x_b)`` output blocks of shape (B, C, C)."""
        raise NotImplementedError

    def cross_and_diag(self, x: torch.Tensor, z: torch.Tensor, cz: torch.Tensor):
        """``(cross(x, z, cz), diag_blocks(x))``; kernels may share the work on ``x``."""
        return self.cross(x, z, cz), self.diag_blocks(x)

    def batch(self, x: torch.Tensor, z: torch.Tensor, cz: torch.Tensor):
        """``(gram(z, cz), cross(x, z, cz), diag_blocks(x))`` for one training step.

        Kernels may override it to share the work on ``Z`` (VaLLA evaluates the
        network's Jacobian factors at ``Z`` once per step).
        """
        return (self.gram(z, cz), *self.cross_and_diag(x, z, cz))

    def predictor(self, z: torch.Tensor, cz: torch.Tensor, W: torch.Tensor):
        """A function ``x -> (Kxx blocks (B, C, C), Kxz W^T (B, C, M))`` for prediction.

        ``W`` is the fitted (M, M) factor with ``A = W^T W``. The default evaluates
        :meth:`cross`; kernels may precompute (VaLLA folds ``J(Z)^T W^T`` into a
        parameter-space basis). The returned function must not mutate shared state
        (it is called from several threads).
        """
        z, cz, W = z.detach(), cz, W.detach()

        def predict(x):
            return self.diag_blocks(x), self.cross(x, z, cz) @ W.T

        return predict


# ---------------------------------------------------------------------------------
# The M x M algebra
# ---------------------------------------------------------------------------------


def robust_cholesky(K: torch.Tensor, *, max_tries: int = 8, what: str = "matrix") -> torch.Tensor:
    """Lower Cholesky factor of a symmetric PSD ``K``, escalating a relative jitter.

    Tries no jitter, then ``1e-10``, ``1e-9``, ... times the mean diagonal. Raises a
    :class:`numpy.linalg.LinAlgError` naming ``what`` when even the largest jitter fails
    (a non-finite or indefinite matrix).
    """
    K = 0.5 * (K + K.transpose(-1, -2))
    scale = float(torch.diagonal(K.detach()).abs().mean().clamp_min(1e-300))
    eye = torch.eye(K.shape[-1], dtype=K.dtype, device=K.device)
    jitter = 0.0
    for i in range(max_tries + 1):
        chol, info = torch.linalg.cholesky_ex(K + jitter * scale * eye)
        if int(info) == 0:
            return chol
        jitter = 1e-10 * 10.0**i
    raise np.linalg.LinAlgError(
        f"the {what} is not positive definite even with a jitter of {jitter:.0e} times its "
        "mean diagonal; its entries may be non-finite"
    )


@dataclass
class VariationalTerms:
    """``W`` with ``A = L Hm^-1 L^T = W^T W``, and the KL term."""

    W: torch.Tensor
    kl: torch.Tensor


def variational_terms(Kzz: torch.Tensor, L_raw: torch.Tensor) -> VariationalTerms:
    """``W = chol(Hm)^-1 L^T`` (so ``A = W^T W``) and ``KL = 1/2 logdet Hm - 1/2 tr(Kzz A)``.

    Parameters
    ----------
    Kzz : Tensor of shape (M, M)
        Kernel matrix of the inducing pairs (float64).
    L_raw : Tensor of shape (M, M)
        Unconstrained parameter; its lower triangle is ``L``.

    Returns
    -------
    VariationalTerms
    """
    L = torch.tril(L_raw)
    M = L.shape[0]
    eye = torch.eye(M, dtype=Kzz.dtype, device=Kzz.device)
    Hm = eye + L.T @ Kzz @ L
    chol = robust_cholesky(Hm, what="variational matrix I + L^T Kzz L")
    W = torch.linalg.solve_triangular(chol, L.T, upper=False)
    kl = torch.log(torch.diagonal(chol)).sum() - 0.5 * (Kzz * (W.T @ W)).sum()
    return VariationalTerms(W, kl)


def latent_cov(Kxx: torch.Tensor, V: torch.Tensor) -> torch.Tensor:
    """``Kxx - V V^T`` per point (``V = Kxz W^T``), diagonal clamped at zero.

    ``Kxx`` has shape (B, C, C) and ``V`` (B, C, M). Round-off can make a variance a
    hair negative where the data pin it down; it is clamped to zero, never returned
    negative.
    """
    cov = Kxx - V @ V.transpose(-1, -2)
    d = torch.diagonal(cov, dim1=-2, dim2=-1)
    neg = torch.clamp(d, max=0.0)
    if bool((neg < 0).any()):
        cov = cov - torch.diag_embed(neg)
    return cov


def joint_cov(K: torch.Tensor, V: torch.Tensor) -> torch.Tensor:
    """Joint latent covariance ``K - V V^T`` (symmetrised), diagonal clamped at zero.

    ``K`` is the (BC, BC) prior block of a batch and ``V`` the matching (BC, M)
    ``Kxz W^T``; the joint counterpart of :func:`latent_cov`.
    """
    cov = K - V @ V.T
    cov = 0.5 * (cov + cov.T)
    return cov - torch.diag(torch.clamp(torch.diagonal(cov), max=0.0))


def alpha_energy(likelihood, mean, cov, y, *, alpha: float = 1.0, noise=None, eps=None):
    """Per-point alpha-energy ``(1/alpha) log E_Q[p(y | f)^alpha]`` (alpha = 0: ``E_Q log p``).

    Parameters
    ----------
    likelihood : Likelihood
        The task's likelihood. For regression its noise is replaced by ``noise``.
    mean : Tensor of shape (B, C)
        Latent mean (the network's output).
    cov : Tensor of shape (B, C, C)
        Latent covariance blocks.
    y : Tensor
        Targets (B, C) for regression, labels (B,) for classification.
    alpha : float, default=1.0
        In [0, 1]. Regression is closed form for every alpha; classification uses the
        likelihood's link approximation at alpha = 1 (the probit-scaled softmax by
        default), its expected log-likelihood at alpha = 0, and Monte Carlo over ``eps``
        in between.
    noise : Tensor or float, optional
        The Gaussian noise variance ``s2`` (a tensor when it is learned).
    eps : Tensor of shape (S, B, C), optional
        Standard normal draws for the Monte Carlo cases.

    Returns
    -------
    Tensor of shape (B,)
    """
    if likelihood.task == "regression":
        s2 = torch.as_tensor(likelihood.noise_variance if noise is None else noise,
                             dtype=mean.dtype, device=mean.device)
        C = mean.shape[-1]
        r = y.reshape(mean.shape) - mean
        if alpha == 0:
            var = torch.diagonal(cov, dim1=-2, dim2=-1)
            return -0.5 * (((r * r + var) / s2).sum(-1) + C * (_LOG_2PI + torch.log(s2)))
        # N(y | f, s2)^a = (2 pi s2)^((1-a)/2) a^(-1/2) N(y | f, s2 / a), per output
        const = C * (0.5 * (1.0 - alpha) * (_LOG_2PI + torch.log(s2)) - 0.5 * math.log(alpha))
        eye = torch.eye(C, dtype=mean.dtype, device=mean.device)
        S = 0.5 * (cov + cov.transpose(-1, -2)) + (s2 / alpha) * eye
        if C == 1:
            v = S.reshape(-1)
            logn = -0.5 * (_LOG_2PI + torch.log(v) + r.reshape(-1) ** 2 / v)
        else:
            Lc = torch.linalg.cholesky(S)
            z = torch.linalg.solve_triangular(Lc, r.unsqueeze(-1), upper=False).squeeze(-1)
            logdet = 2.0 * torch.log(torch.diagonal(Lc, dim1=-2, dim2=-1)).sum(-1)
            logn = -0.5 * (C * _LOG_2PI + logdet + z.pow(2).sum(-1))
        return (const + logn) / alpha
    if alpha == 1:
        return likelihood.log_predictive(mean, cov, y, eps=eps)
    if alpha == 0:
        return likelihood.expected_log_prob(mean, cov, y, eps=eps)
    if eps is None:
        raise ValueError("classification with 0 < alpha < 1 needs Monte Carlo draws eps")
    from .._core.likelihoods import _latent_draws

    f = _latent_draws(mean, cov, eps)  # (S, B, C)
    S_ = f.shape[0]
    lp = likelihood.log_prob(f.reshape(-1, f.shape[-1]), y.repeat(S_)).reshape(S_, -1)
    return (torch.logsumexp(alpha * lp, dim=0) - math.log(S_)) / alpha


# ---------------------------------------------------------------------------------
# Inducing points
# ---------------------------------------------------------------------------------


def init_inducing(data, n_inducing: int, seed: int):
    """Inducing inputs by k-means on (a sample of) the training inputs.

    Regression: ``n_inducing`` centres on the inputs; with C > 1 targets the output
    indices go round-robin. Classification: ``n_inducing / n_labels`` centres per
    label, each carrying that label as its logit index (one-logit nets: index 0).
    At most :data:`KMEANS_MAX_ROWS` rows are read (a seeded sample), so the cost does
    not grow with N.

    Returns
    -------
    Z : ndarray of shape (M, D), float64
    cz : ndarray of shape (M,), int64
    """
    from sklearn.cluster import KMeans, MiniBatchKMeans

    rng = np.random.default_rng(seed)
    n = data.n_samples
    idx = np.sort(rng.choice(n, size=min(n, KMEANS_MAX_ROWS), replace=False))
    xs, ys = [], []
    for start in range(0, len(idx), 4096):
        x, y = data.rows(idx[start:start + 4096])
        xs.append(x.detach().double().cpu().reshape(len(x), -1).numpy())
        ys.append(y.detach().cpu().numpy())
    X = np.concatenate(xs)
    Y = np.concatenate(ys)
    C = data.n_outputs

    def centres(rows, k, s):
        k = int(min(k, len(rows)))
        if k <= 0:
            return np.empty((0, X.shape[1]))
        uniq = np.unique(rows, axis=0)
        if len(uniq) <= k:
            return uniq
        km = (KMeans(k, n_init=1, random_state=s) if len(rows) <= 5000
              else MiniBatchKMeans(k, n_init=3, random_state=s, batch_size=1024))
        return km.fit(rows).cluster_centers_

    if data.likelihood.task == "regression":
        Z = centres(X, n_inducing, seed)
        cz = np.arange(len(Z)) % C
    else:
        labels = np.unique(Y)
        share = np.full(len(labels), n_inducing // len(labels))
        share[: n_inducing - share.sum()] += 1
        Zs, cs = [], []
        for lab, k in zip(labels, share):
            Zc = centres(X[Y == lab], k, seed + int(lab))
            Zs.append(Zc)
            cs.append(np.full(len(Zc), int(lab) if C > 1 else 0))
        Z, cz = np.concatenate(Zs), np.concatenate(cs)
    return np.ascontiguousarray(Z, dtype=np.float64), cz.astype(np.int64)


# ---------------------------------------------------------------------------------
# The posterior
# ---------------------------------------------------------------------------------


def _with_tolerance(validation, tol):
    """Wrap a validation score so that relative improvements below ``tol`` count as none.

    The early-stopping loop keeps the state of the best score it saw; a score that
    beats the best by less than ``tol * |best|`` is reported as the best (a check
    without improvement), so the earlier, equally good state is kept.
    """
    best = [math.inf]

    def score():
        s = validation()
        if not math.isfinite(s):
            return s
        if not math.isfinite(best[0]) or s < best[0] - tol * abs(best[0]):
            best[0] = s
            return s
        return max(s, best[0])

    return score


class FixedMeanGPPosterior(Posterior):
    """Sparse variational GP with the mean fixed to the network (VaLLA, FMGP).

    Subclasses implement :meth:`make_kernel`; FMGP adds :meth:`extra_loss` and
    :meth:`extra_parameters`.

    Parameters
    ----------
    n_inducing : int, default=100
        ``M``.
    noise_variance : float, "auto" or None, default="auto"
        Regression ``s2``: learned (``"auto"``; initialised at the network's mean squared
        residual) or fixed. ``None`` for classification.
    alpha : float, default=1.0
        The alpha of the energy (0 gives the ELBO).
    learning_rate, max_iter, batch_size : float, int, int
        The shared Adam loop's settings (paper: 1e-3, up to 40,000, 100).
    early_stopping : bool, default=True
        Stop on the validation NLL (needs held-out rows) and restore the best state.
    validation_freq, n_iter_no_change : int
        Steps between validation checks, checks without improvement before stopping.
    learn_inducing : bool, default=True
        Optimise ``Z`` (else keep the k-means centres).
    energy_link : {"probit", "mc"}, default="probit"
        Classification: how ``E_Q p(y | f)`` is computed in the energy.
    n_energy_samples : int, default=32
        Monte Carlo draws per point for ``energy_link="mc"`` and ``0 < alpha < 1``.
    random_state : int, default=0
        Seed of the k-means initialisation.
    validation_tol : float, default=0.0
        Relative improvement of the validation NLL a check must make to count as one
        for early stopping (smaller improvements count as none).
    """

    fitted_attributes = ("prior_variance", "likelihood", "hyper_strategy", "hyper_trace",
                         "inducing_inputs", "inducing_outputs", "n_iter", "kernel")

    def __init__(self, *, n_inducing=100, noise_variance="auto", alpha=1.0,
                 learning_rate=1e-3, max_iter=5000, batch_size=100, early_stopping=True,
                 validation_freq=100, n_iter_no_change=5, learn_inducing=True,
                 energy_link="probit", n_energy_samples=32, random_state=0,
                 validation_tol=0.0):
        self.n_inducing = int(n_inducing)
        self.noise_variance = noise_variance
        self.alpha = float(alpha)
        self.learning_rate = float(learning_rate)
        self.max_iter = int(max_iter)
        self.batch_size = int(batch_size)
        self.early_stopping = bool(early_stopping)
        self.validation_freq = int(validation_freq)
        self.n_iter_no_change = int(n_iter_no_change)
        self.learn_inducing = bool(learn_inducing)
        self.energy_link = energy_link
        self.n_energy_samples = int(n_energy_samples)
        self.random_state = int(random_state)
        self.validation_tol = float(validation_tol)
        if not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"alpha must be in [0, 1], got {alpha!r}")

    # -- hooks ---------------------------------------------------------------------
    def make_kernel(self, data, Z: torch.Tensor, cz: torch.Tensor) -> Kernel:  # pragma: no cover
        """Build the kernel for ``data`` (initial hyperparameters from the data)."""
        raise NotImplementedError

    def extra_parameters(self) -> list:
        """Further trainable tensors of :meth:`extra_loss` (created in :meth:`make_kernel`)."""
        return []

    def extra_loss(self, *, x, y, n_total, kernel, Kzz, terms, Kxx, Kxz, noise):
        """A loss term added to the minibatch loss (per-point scale), default none."""
        return None

    # -- helpers ---------------------------------------------------------------------
    def _mean(self, lin, x):
        with torch.no_grad():
            return lin.forward(x).double()

    def _energy_likelihood(self, likelihood):
        if likelihood.task == "regression" or self.energy_link == getattr(likelihood,
                                                                           "link_approx", None):
            return likelihood
        if self.energy_link not in ("probit", "mc"):
            raise ValueError(f"energy_link must be 'probit' or 'mc', got {self.energy_link!r}")
        import copy

        lik = copy.copy(likelihood)
        lik.link_approx = self.energy_link
        lik.n_samples = self.n_energy_samples
        return lik

    def _needs_eps(self, lik):
        return lik.task != "regression" and (
            (self.alpha == 1 and lik.link_approx == "mc") or 0 < self.alpha < 1
            or (self.alpha == 0 and lik.n_outputs > 1))

    def _initial_noise(self, data, gen):
        n = data.n_samples
        idx = torch.randperm(n, generator=gen)[: min(n, 20 * data.batch_size)].numpy()
        idx.sort()
        x, y = data.rows(idx)
        g = self._mean(data.lin, x)
        mse = float(((y.reshape(g.shape).double() - g) ** 2).mean())
        return max(mse, 1e-6)

    # -- fit -----------------------------------------------------------------------
    def fit(self, data):
        """Learn ``Z``, ``L`` and the hyperparameters on minibatches of ``data``."""
        lik = data.likelihood
        regression = lik.task == "regression"
        gen = data.generator
        dev = data.device
        Z0, cz0 = init_inducing(data, self.n_inducing, self.random_state)
        Z = torch.tensor(Z0, dtype=torch.float64, device=dev,
                         requires_grad=self.learn_inducing)
        cz = torch.as_tensor(cz0, device=dev)
        kernel = self.make_kernel(data, Z, cz)
        M = Z.shape[0]
        L_raw = torch.eye(M, dtype=torch.float64, device=dev, requires_grad=True)
        log_noise = None
        if regression:
            if isinstance(self.noise_variance, str):
                log_noise = torch.tensor(math.log(self._initial_noise(data, gen)),
                                         dtype=torch.float64, device=dev, requires_grad=True)
            else:
                fixed_noise = torch.tensor(float(self.noise_variance), dtype=torch.float64,
                                           device=dev)
        elik = self._energy_likelihood(lik)
        n_total = data.n_samples
        params = [L_raw, *kernel.parameters(), *self.extra_parameters()]
        if self.learn_inducing:
            params.append(Z)
        if log_noise is not None:
            params.append(log_noise)

        def noise():
            if not regression:
                return None
            return torch.exp(log_noise) if log_noise is not None else fixed_noise

        def batch_cov(x, Kzz, terms):
            Kxz, Kxx = kernel.cross_and_diag(x, Z, cz)
            return Kxx, Kxz, latent_cov(Kxx, Kxz @ terms.W.T)

        def loss_fn(batch):
            x, y = batch
            Kzz, Kxz, Kxx = kernel.batch(x, Z, cz)
            terms = variational_terms(Kzz, L_raw)
            cov = latent_cov(Kxx, Kxz @ terms.W.T)
            mean = self._mean(data.lin, x)
            eps = None
            if self._needs_eps(elik):
                eps = torch.randn((self.n_energy_samples, *mean.shape), generator=gen,
                                  dtype=torch.float64).to(dev)
            e = alpha_energy(elik, mean, cov, y, alpha=self.alpha, noise=noise(), eps=eps)
            loss = -e.mean() + terms.kl / n_total
            extra = self.extra_loss(x=x, y=y, n_total=n_total, kernel=kernel, Kzz=Kzz,
                                    terms=terms, Kxx=Kxx, Kxz=Kxz, noise=noise())
            return loss if extra is None else loss + extra

        validation = None
        val = data.validation
        if val is not None and val.n_samples > 0:
            def validation():
                Kzz = kernel.gram(Z, cz)
                terms = variational_terms(Kzz, L_raw)
                total = 0.0
                for x, y in val.batches(max(val.batch_size, 256)):
                    _, _, cov = batch_cov(x, Kzz, terms)
                    mean = self._mean(data.lin, x)
                    lp = (alpha_energy(lik, mean, cov, y, alpha=1.0, noise=noise())
                          if regression else lik.log_predictive(mean, cov, y))
                    total -= float(lp.sum())
                return total / val.n_samples

            if self.validation_tol > 0:
                validation = _with_tolerance(validation, self.validation_tol)

        res = minimize(loss_fn, params, minibatches(data, self.batch_size, gen),
                       max_iter=self.max_iter, lr=self.learning_rate, validation=validation,
                       validation_freq=self.validation_freq,
                       early_stopping=self.early_stopping and validation is not None,
                       n_iter_no_change=self.n_iter_no_change, verbose=data.verbose,
                       desc=f"{type(self).__name__}: fitting")
        # -- freeze ------------------------------------------------------------------
        self.freeze(data.lin, kernel, Z, cz, L_raw)
        self.n_iter = int(res.n_iter)
        self.prior_variance = float(kernel.prior_variance)
        s2 = float(noise().detach()) if regression else None
        self.likelihood = lik.with_noise(s2) if regression else lik
        trace = {**res.as_dict(), "kl": float(self._kl)}
        learned = regression and log_noise is not None
        if learned or kernel.parameters():
            r = VariationalEnergy().result(self.prior_variance, s2, trace)
        else:
            r = Fixed().select(self.prior_variance, s2)
            r.trace = trace
        self.hyper_strategy, self.hyper_trace = r.strategy, r.trace
        return self

    def freeze(self, lin, kernel, Z, cz, L_raw):
        """Fix the fitted state: the network, the kernel, ``Z``, ``cz`` and ``L``.

        ``fit`` ends here; tests call it directly to set a known ``L`` (e.g.
        ``L = I / sqrt(s2)`` with ``Z = X``, where the predictive is the exact GP's).
        """
        with torch.no_grad():
            for p in kernel.parameters():
                p.requires_grad_(False)
            self._lin = lin
            self.kernel = kernel
            self._Z = Z.detach().clone()
            self._cz = torch.as_tensor(cz, device=self._Z.device)
            self._L = torch.tril(L_raw.detach()).clone()
            self._build_predictor()
            self.inducing_inputs = self._Z.cpu().numpy()
            self.inducing_outputs = self._cz.cpu().numpy()
        return self

    def _build_predictor(self):
        terms = variational_terms(self.kernel.gram(self._Z, self._cz), self._L)
        self._kl = float(terms.kl)
        self._predict_fn = self.kernel.predictor(self._Z, self._cz, terms.W)

    # -- predict -------------------------------------------------------------------
    def predict(self, x):
        """Latent mean ``g(x)`` and covariance ``Kxx - Kxz A Kzx`` per point."""
        mean = self._mean(self._lin, x)
        with torch.no_grad():
            Kxx, V = self._predict_fn(x)
            return LatentPredictive(mean, latent_cov(Kxx.double(), V.double()))

    def __getstate__(self):
        state = dict(self.__dict__)
        state.pop("_predict_fn", None)
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        if "_L" in state:
            with torch.no_grad():
                self._build_predictor()
