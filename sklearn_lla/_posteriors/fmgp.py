"""FMGP: fixed-mean Gaussian processes (Ortega et al.; the thesis chapter).

A decoupled sparse variational GP whose predictive **mean is fixed to the network**
``g`` and whose covariance is learned with a free parametric kernel (see
:mod:`sklearn_lla.kernels`). Unlike VaLLA no Jacobian is ever formed: fitting and
prediction need only ``g(x)`` (and, for the classification kernel, the penultimate
features ``psi(x)``): ``fit`` computes them once per training row (at most
:data:`FEATURE_CACHE_BYTES`; beyond, one forward pass per minibatch), prediction one
forward pass per batch. The classification kernel's inducing points carry their own
learned features (``ClassificationKernel(inducing_features="free")``), so a training
step runs no network pass.

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
mean's residuals alone.

Regression's noise variance. The residuals of ``g`` on its own training rows are
optimistic by construction (``docs/fmgp.md`` measures them), so a noise variance
learned from the fixed-mean term collapses towards them (and below: the alpha = 1
energies let ``S`` stand in for the noise). The noise is a property of the data: every
parameter but ``s2`` minimises the thesis' loss above with ``s2`` held constant in it,
and ``s2`` takes its gradient from ``Q*``'s ELBO data term only,
``-(1/B) sum_b E_0(y_b; m*(x_b), S(x_b))`` with ``m*`` and ``S`` held: the type-II
maximum likelihood of the noise given ``Q*``, whose mean is the kernel's own
regularised fit of the data, not the network (``E_0 = E log p``: with alpha = 1 the
latent variance would stand in for the noise again, the FITC-like behaviour of power
EP that underestimates it). ``s2`` starts at ``Q*``'s ELBO maximiser
(:func:`qstar_initial_noise`) and ``L`` at the optimal factor
(:meth:`FMGPPosterior.start`). Learned: ``Z`` (k-means initialisation, per class for
classification), ``L``, the kernel's hyperparameters, the noise variance (regression)
and ``q_mu`` (initialised to ``g`` at the inducing pairs, so that ``m*`` starts near
the network); Adam on minibatches through the shared loop
(:mod:`sklearn_lla._core.optim`), stopped when the objective stops improving.
"""


from __future__ import annotations

import copy
import math
import weakref

import numpy as np
import torch

from .._core.linalg import cholesky
from .._core.optim import epoch_permutations, minibatches
from .._core.protocol import MINIBATCH_CACHE_ROWS
from .fmgp_cross import FactoredObjective, class_groups, factored_batch
from .gp import FixedMeanGPPosterior
from .gp_algebra import alpha_energy, joint_cov, latent_cov, spd_solve, variational_terms
from .kernels import RBF, ClassificationKernel

__all__ = [
    "FACTORED_STEPS",
    "FEATURE_CACHE_BYTES",
    "FMGPPosterior",
    "KERNEL_LR_SCALE",
    "PROGRESS_PATIENCE",
    "PROGRESS_TOL",
    "KERNEL_INIT_ROWS",
    "QSTAR_JITTER",
    "default_kernel",
    "mean_regularizer_loss",
    "optimal_factor",
    "qstar_initial_noise",
]

#: Relative jitter of ``Q*``'s mean, ``a = (Kzz + 1e-3 mean(diag Kzz) I)^-1 q_mu``.
QSTAR_JITTER = 1e-3

#: Rows of training data sampled to initialise the kernel (median heuristic, scales),
#: ``Q*``'s noise and the variational factor ``L`` (:meth:`FMGPPosterior.start`).
KERNEL_INIT_ROWS = 1000

#: Relative jitter of ``Kzz`` in the starting factor of :meth:`FMGPPosterior.start`.
START_JITTER = 1e-6

#: Classification's early-stopping rule of diminishing returns (``progress_tol`` of
#: :func:`~sklearn_lla._core.optim.minimize`): a check improves only when the objective
#: fell by more than this fraction of its progress since the first check. The
#: classification kernel's input length scales grow without bound on image inputs
#: (the RBF flattening towards the linear kernel on ``psi``), so its objective creeps
#: down by a near-constant amount per step for thousands of steps (``docs/fmgp.md``).
#: Regression keeps the absolute rule alone (``0``).
PROGRESS_TOL = 0.1

#: Classification's early stopping also stops after this many checks since the best
#: that only crept below it (lower by ``tol`` but not by :data:`PROGRESS_TOL` of the
#: progress; ``n_iter_no_progress`` of :func:`~sklearn_lla._core.optim.minimize`). In
#: the creep every check is such a one, and ``n_iter_no_change`` (5) of them only
#: ran steps whose states were thrown away: on the digits CNN (``benchmarks/cnn.py``,
#: situations b and c) the state restored is the same, after 800 steps instead of
#: 1,100. Two, not one: a single check that falls short by minibatch noise does not
#: end the run.
PROGRESS_PATIENCE = 2

#: Classification's Adam learning rate of the kernel's hyperparameters (length scales,
#: amplitude, output covariance), as a multiple of ``learning_rate`` (the factor and
#: ``q_mu`` keep ``learning_rate``). Their drift towards long length scales sets the
#: pace of the fit (on the digits CNN the median log length scale rises by 0.3-0.4 per
#: 100 steps at 0.01): at 3 x the early stopping restores a lower objective after 500
#: steps instead of 800 (``docs/fmgp.md``). Regression keeps one learning rate (1).
KERNEL_LR_SCALE = 3.0

#: Largest size (bytes) of the training rows' cached network outputs ``g(x)`` (and
#: penultimate features ``psi(x)``): up to it ``fit`` computes them in one pass over
#: the data and reads them per minibatch; beyond, every step runs the network on
#: its minibatch (the same numbers, one forward pass per step).
FEATURE_CACHE_BYTES = 512 * 2**20

#: Rows of an epoch's permutation gathered at a time from the cached training rows
#: (:meth:`FMGPPosterior.training_batches`): one gather per tensor for that many rows
#: instead of one per minibatch.
GATHER_ROWS = 8192

#: A training step with :class:`~sklearn_lla.kernels.ClassificationKernel` multiplies
#: its cross covariances in factored form (:mod:`sklearn_lla._posteriors.fmgp_cross`)
#: and, with the probit energy at alpha = 1, forms only the latent variances: the same
#: losses and gradients to float64 round-off (``False``: the dense tensors, as
#: :meth:`~sklearn_lla.kernels.Kernel.batch` gives them; for tests).
FACTORED_STEPS = True


def default_kernel(task, *, amplitude=None, penultimate_layer=None):
    """The default FMGP kernel of ``task`` (``kernel="auto"``).

    Parameters
    ----------
    task : {"regression", "classification"}
        The task.
    amplitude : float or None, default=None
        A fixed amplitude (``prior_variance``); ``None`` learns it.
    penultimate_layer : str or None, default=None
        Classification: the module whose output is ``psi(x)``.

    Returns
    -------
    Kernel
        :class:`~sklearn_lla.kernels.RBF` for regression,
        :class:`~sklearn_lla.kernels.ClassificationKernel` otherwise.
    """
    learn = amplitude is None
    if task == "regression":
        return RBF(amplitude=amplitude, learn_amplitude=learn)
    return ClassificationKernel(amplitude=amplitude, learn_amplitude=learn,
                                penultimate_layer=penultimate_layer)


def mean_regularizer_loss(likelihood, q_mu, Kzz, terms, Kxx, Kxz, y, *, n_total, alpha=1.0,
                          noise=None, eps=None, cov=None):
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
        ``W`` and ``KL(Q | P)`` of :func:`sklearn_lla._posteriors.gp_algebra.variational_terms`.
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
    cov : Tensor of shape (B, C, C), optional
        ``S(x)`` of the batch if already computed (it is ``latent_cov(Kxx, Kxz W^T)``).

    Returns
    -------
    Tensor
        A scalar, added to the loss.
    """
    a = _qstar_weights(q_mu, Kzz)
    if cov is None:
        cov = latent_cov(Kxx, Kxz @ terms.W.T)
    e = alpha_energy(likelihood, Kxz @ a, cov, y, alpha=alpha, noise=noise, eps=eps)
    kl = terms.kl + 0.5 * (a @ (Kzz @ a))
    return -e.mean() + kl / n_total


def _qstar_weights(q_mu, Kzz):
    """``a = (Kzz + 1e-3 mean(diag Kzz) I)^-1 q_mu``, so that ``m*(x) = Kxz a``."""
    M = Kzz.shape[0]
    eye = torch.eye(M, dtype=Kzz.dtype, device=Kzz.device)
    jitter = QSTAR_JITTER * torch.diagonal(Kzz).mean()
    return spd_solve(Kzz + jitter * eye, q_mu.reshape(M), "regularised inducing Gram matrix")


def qstar_initial_noise(kernel, Z, cz, q_mu, x, y):
    """``Q*``'s noise variance at the start: the maximiser of its ELBO there.

    ``mean((y - m*(x))^2 + S(x))`` over the rows ``x`` with ``L = I`` (the closed-form
    maximiser in ``s2`` of the Gaussian ELBO of ``Q*``).

    Parameters
    ----------
    kernel : Kernel
        The initialised kernel.
    Z : Tensor of shape (M, n_features)
        Initial inducing inputs.
    cz : Tensor of shape (M,)
        Their output indices.
    q_mu : Tensor of shape (M,)
        Initial ``Q*`` mean parameters.
    x : Tensor of shape (n, n_features)
        A sample of training inputs.
    y : Tensor of shape (n, C)
        Their targets.

    Returns
    -------
    float
        Positive and finite (the targets' variance if the expression is not).
    """
    with torch.no_grad():
        Kzz = kernel.gram(Z, cz)
        Kxz, Kxx = kernel.cross_and_diag(x, Z, cz)
        W = variational_terms(Kzz, torch.eye(len(cz), dtype=Kzz.dtype, device=Kzz.device)).W
        var = torch.diagonal(latent_cov(Kxx, Kxz @ W.T), dim1=-2, dim2=-1)
        yy = y.reshape(len(x), -1).double()
        r = yy - Kxz @ _qstar_weights(q_mu, Kzz)
        s2 = float((r * r + var).mean())
        if not (math.isfinite(s2) and s2 > 0):
            s2 = float(yy.var()) if len(yy) > 1 else 1.0
    return s2 if math.isfinite(s2) and s2 > 0 else 1.0


def optimal_factor(Kzz, G):
    """``L`` with ``L L^T = Kzz^-1 G^T G Kzz^-1``: the optimal factor for sites ``G^T G``.

    With ``G^T G = Phi = sum_n Kzn Lam_n Knz`` (``Lam_n``: the likelihood's curvature
    at the mean, ``I / s2`` in regression) this is the thesis' optimal ``A`` of the
    Gaussian ELBO (Proposition 4.3's cost ``O(N M^2 + M^3)``), exact for alpha = 0
    and the Laplace sites otherwise. Formed as ``R^T R`` from a QR factorisation of
    ``(Kzz^-1 G^T)^T`` (no squared condition number); ``Kzz`` is jittered by
    :data:`START_JITTER` times its mean diagonal.

    Parameters
    ----------
    Kzz : Tensor of shape (M, M)
        The inducing Gram matrix.
    G : Tensor of shape (n, M)
        The site factor rows.

    Returns
    -------
    Tensor of shape (M, M)
        Lower triangular, with a non-negative diagonal.
    """
    M = Kzz.shape[0]
    eye = torch.eye(M, dtype=Kzz.dtype, device=Kzz.device)
    Lk = cholesky(Kzz + START_JITTER * float(Kzz.diagonal().mean()) * eye,
                  "inducing kernel matrix", warn=False)
    F = torch.cholesky_solve(G.T.contiguous(), Lk)  # Kzz^-1 G^T, (M, n)
    R = torch.linalg.qr(F.T, mode="r").R
    if R.shape[0] < M:  # fewer site rows than inducing pairs: a low-rank factor
        R = torch.cat([R, R.new_zeros(M - R.shape[0], M)])
    return R.T * torch.where(torch.diagonal(R) < 0, -1.0, 1.0)[None, :]


class FMGPPosterior(FixedMeanGPPosterior):
    """The FMGP posterior: a fixed-mean sparse GP with a parametric kernel and ``Q*``.

    Parameters
    ----------
    kernel : Kernel or None, default=None
        The kernel template (deep-copied, then ``initialize``-d on a sample of the
        training data). ``None``: :func:`default_kernel` of the task.
    mean_regularizer : bool, default=True
        Add the ``Q*`` term (the thesis' regulariser). In regression with a learned
        noise, the noise then takes its gradient from ``Q*``'s ELBO only (see the
        module docstring); without it, from the fixed-mean term (the thesis).
    progress_tol : float or "auto", default="auto"
        Early stopping's diminishing-returns fraction (see
        :func:`~sklearn_lla._core.optim.minimize`); ``"auto"``: :data:`PROGRESS_TOL`
        for classification, 0 for regression.
    n_iter_no_progress : int, None or "auto", default="auto"
        Checks that only creep below the best (see
        :class:`~sklearn_lla._core.optim.Patience`) that stop the run; ``"auto"``:
        :data:`PROGRESS_PATIENCE` for classification, ``None`` for regression.
    kernel_lr_scale : float or "auto", default="auto"
        The kernel hyperparameters' learning rate as a multiple of ``learning_rate``;
        ``"auto"``: :data:`KERNEL_LR_SCALE` for classification, 1 for regression.
    **kwargs
        :class:`~sklearn_lla._posteriors.gp.FixedMeanGPPosterior`'s settings
        (``stopping`` defaults to ``"objective"``).
    """

    fitted_attributes = FixedMeanGPPosterior.fitted_attributes + (
        "q_mu", "inducing_features", "cached_rows")

    #: Adam on the concatenated tensors (:class:`~sklearn_lla._core.optim.FlatAdam`:
    #: torch's update to round-off; a step is a few ms, of which ``torch.optim``'s fused
    #: Adam took 0.3-0.7 ms on the digits CNN).
    fused_adam = "flat"


    def __init__(self, kernel=None, *, mean_regularizer=True, **kwargs):
        kwargs.setdefault("stopping", "objective")
        self.progress_tol_param = kwargs.pop("progress_tol", "auto")
        self.n_iter_no_progress_param = kwargs.pop("n_iter_no_progress", "auto")
        self.kernel_lr_scale_param = kwargs.pop("kernel_lr_scale", "auto")
        super().__init__(**kwargs)
        self.kernel_template = kernel
        self.mean_regularizer = bool(mean_regularizer)
        self._features = None
        self._pinned = None
        self.cached_rows = 0

    # -- hooks -----------------------------------------------------------------------
    def make_kernel(self, data, Z, cz):
        """Copy and initialise the kernel; initialise ``q_mu`` at ``g(Z)`` (and the noise)."""
        task = data.likelihood.task
        if self.kernel_template is None:
            kernel = default_kernel(task)
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
        self._noise0 = None
        if self._noise_from_qstar(data.likelihood):
            self._noise0 = qstar_initial_noise(kernel, kernel.lift_inducing(Z.detach()), cz,
                                               self.q_mu.detach(), x, y)
        return kernel

    def _noise_from_qstar(self, likelihood):
        return (self.mean_regularizer and likelihood.task == "regression"
                and isinstance(self.noise_variance, str))

    def _initial_noise(self, data, gen):
        """``Q*``'s ELBO maximiser at the start (see :func:`qstar_initial_noise`)."""
        if self._noise0 is not None:
            return self._noise0
        return super()._initial_noise(data, gen)

    def learning_rate_scales(self, params, kernel):
        """``kernel_lr_scale`` for the kernel's tensors, 1 for the others (``None`` at 1)."""
        scale = self.kernel_lr_scale
        if scale == 1.0:
            return None
        own = {id(p) for p in kernel.parameters()}
        return [scale if id(p) in own else 1.0 for p in params]

    def extra_parameters(self):
        """``q_mu`` (when the ``Q*`` term is on)."""
        return [self.q_mu] if self.mean_regularizer else []

    def start(self, data, kernel, Z, cz, L_raw, log_noise):
        """Start ``L`` at the optimal factor for the initial kernel (:func:`optimal_factor`).

        The sites are those of a sample of at most :data:`KERNEL_INIT_ROWS` training
        rows scaled to ``N``: ``I / s2`` in regression (the initial or fixed noise),
        the softmax Hessian at the network's logits in classification. ``L = I`` (the
        thesis' start) is thousands of Adam steps from entries of order
        ``sqrt(N / (M s2))``.

        The training rows' ``g`` (and ``psi``) are computed here once
        (:meth:`_cache_rows`), for the loop's minibatches.
        """
        self._row_cache = self._cache_rows(data)
        self._groups = class_groups(cz, data.n_outputs) if FACTORED_STEPS else None
        self.cached_rows = 0 if self._row_cache is None else int(self._row_cache[0].shape[0])
        lik = data.likelihood
        N = data.n_samples
        rng = np.random.default_rng(self.random_state + 1)
        idx = np.sort(rng.choice(N, size=min(N, KERNEL_INIT_ROWS), replace=False))
        with torch.no_grad():
            Kzz = kernel.gram(Z, cz)
            G = []
            for i in range(0, len(idx), 256):
                x, _ = data.rows(idx[i:i + 256])
                if self._row_cache is not None:
                    g_all, psi_all = self._row_cache
                    t = torch.from_numpy(idx[i:i + 256]).to(g_all.device)
                    self._pin(x, g_all[t], None if psi_all is None else psi_all[t])
                Kxz = kernel.cross(x, Z, cz)  # (b, C, M)
                if lik.task != "regression":
                    Kxz = lik.lam_factor(self._mean(data.lin, x)).transpose(1, 2) @ Kxz
                G.append(Kxz.reshape(-1, Kxz.shape[-1]))
            G = torch.cat(G) * math.sqrt(N / len(idx))
            if lik.task == "regression":
                s2 = (float(torch.exp(log_noise)) if log_noise is not None
                      else float(self.noise_variance))
                G = G / math.sqrt(s2)
            L_raw.copy_(optimal_factor(Kzz, G))

    def batch_kernel(self, kernel, x, Z, cz):
        """The step's ``(Kzz, Kxz, Kxx)``; ``Kxz`` factored for the classification kernel.

        With :class:`~sklearn_lla.kernels.ClassificationKernel` (and
        :data:`FACTORED_STEPS`), ``Kxz`` is a
        :class:`~sklearn_lla._posteriors.fmgp_cross.ClassCross`: the step's products
        with ``W^T`` and ``Q*``'s weights cost ``O(B M^2)`` instead of ``O(B C M^2)``.
        """
        if FACTORED_STEPS and getattr(self, "_groups", False) is not False:
            out = factored_batch(kernel, x, Z, cz, self._groups)
            if out is not None:
                return out
        return kernel.batch(x, Z, cz)

    def make_objective(self, *args):
        """:class:`~sklearn_lla._posteriors.fmgp_cross.FactoredObjective` (with
        :data:`FACTORED_STEPS`): the engine's loss, with the classification kernel's
        step factored; else the engine's objective."""
        if FACTORED_STEPS:
            return FactoredObjective(self, *args)
        return super().make_objective(*args)

    def diagonal_energy(self, likelihood):
        """Whether the energy reads only the latent variances: the probit link at alpha = 1.

        FMGP's energies (the fixed-mean and ``Q*`` terms) then form only the diagonal
        of ``S(x)`` (:data:`FACTORED_STEPS`).
        """
        return (FACTORED_STEPS and likelihood.task != "regression" and self.alpha == 1.0
                and getattr(likelihood, "link_approx", None) == "probit")

    def mean_term_noise(self, noise):
        """``sg(s2)`` when the noise is learned from ``Q*`` (see :meth:`extra_loss`)."""
        if noise is not None and self._noise_from_qstar(self._fit_lik):
            return noise.detach()
        return noise

    def extra_loss(self, *, x, y, n_total, kernel, Kzz, terms, Kxx, Kxz, cov, noise):
        """The ``Q*`` term (see :func:`mean_regularizer_loss`), and the noise's objective.

        In regression with a learned noise ``s2`` (see the module docstring):

        * the thesis' terms are evaluated with ``sg(s2)`` (``sg``: stop the gradient):
          ``Q*``'s here, the engine's fixed-mean term through :meth:`mean_term_noise`;
        * ``s2`` takes its gradient from ``Q*``'s ELBO data term,
          ``-mean E_0(y; sg(m*), sg(S), s2)``.
        """
        if not self.mean_regularizer:
            return None
        lik = self._fit_lik
        if not self._noise_from_qstar(lik):
            eps = None
            if self._needs_eps(lik):
                eps = torch.randn((self.n_energy_samples, len(x), Kxz.shape[1]),
                                  generator=self._gen, dtype=torch.float64).to(Kxz.device)
            return mean_regularizer_loss(lik, self.q_mu, Kzz, terms, Kxx, Kxz, y,
                                         n_total=n_total, alpha=self.alpha, noise=noise,
                                         eps=eps, cov=cov)
        a = _qstar_weights(self.q_mu, Kzz)
        m_star = Kxz @ a
        e_star = alpha_energy(lik, m_star, cov, y, alpha=self.alpha, noise=noise.detach())
        e_noise = alpha_energy(lik, m_star.detach(), cov.detach(), y, alpha=0.0, noise=noise)
        kl = terms.kl + 0.5 * (a @ (Kzz @ a))
        return -(e_star.mean() + e_noise.mean()) + kl / n_total

    # -- the training rows' outputs, computed once ------------------------------------
    def _cache_rows(self, data):
        """``(g, psi)`` of every training row in one pass (``None`` beyond the budget).

        ``psi`` is ``None`` unless the kernel uses the penultimate features. Stored
        in the network's dtype on its device, at most :data:`FEATURE_CACHE_BYTES`.
        """
        if not hasattr(data, "minibatches"):
            return None
        feats = self._features if (self._features is not None
                                   and self._features.net is data.lin) else None
        n = data.n_samples
        rows, xs, ys = [], [], []
        keep_xy = n <= MINIBATCH_CACHE_ROWS and not data.is_dask
        bs = self.batch_size
        for start in range(0, n, bs):  # stream order, whatever the storage
            x, y = data.rows(slice(start, min(start + bs, n)))
            with torch.no_grad():
                out = feats(x) if feats is not None else (data.lin.forward(x), None)
            if not rows:
                width = sum(t[0].numel() for t in out if t is not None)
                nbytes = n * width * out[0].element_size()
                if nbytes > FEATURE_CACHE_BYTES:
                    return None
                nbytes += n * (x[0].numel() * x.element_size() + y[0].numel() * y.element_size())
                keep_xy = keep_xy and nbytes <= FEATURE_CACHE_BYTES
            rows.append(out)
            if keep_xy:
                xs.append(x)
                ys.append(y)
        g = torch.cat([r[0] for r in rows])
        psi = torch.cat([r[1] for r in rows]) if feats is not None else None
        self._xy_cache = (torch.cat(xs), torch.cat(ys)) if keep_xy else None
        return g, psi

    def training_batches(self, data, generator):
        """Minibatches with the cached ``g`` (and ``psi``) of their rows attached.

        The same draws as :func:`~sklearn_lla._core.optim.minibatches`; each batch's
        input tensor is given its rows' outputs (:meth:`_pin`), so the step runs no
        forward pass on it. Without a cache (too many rows): the plain minibatches.

        When :meth:`_cache_rows` kept the inputs and targets too, the batches are read
        from the cached tensors: up to ``MINIBATCH_CACHE_ROWS`` rows in memory the
        stream's draws are an epoch permutation of the rows from ``generator`` cut into
        consecutive batches (the last partial one dropped,
        :func:`~sklearn_lla._core.optim.epoch_batches`), so the same permutations index
        the cached tensors, which hold the very rows ``data.rows`` reads, without its
        per-batch copy and sort; they are gathered :data:`GATHER_ROWS` rows of the
        permutation at a time and each batch is a slice (``tests/test_fmgp_cost.py``
        checks the batches are the stream's).
        """
        cache = getattr(self, "_row_cache", None)
        if cache is None:
            yield from minibatches(data, self.batch_size, generator)
            return
        g_all, psi_all = cache
        xy = getattr(self, "_xy_cache", None)
        if xy is None:
            for x, y, idx in data.minibatches(self.batch_size, generator, with_index=True):
                t = torch.from_numpy(idx).to(g_all.device)
                self._pin(x, g_all[t], None if psi_all is None else psi_all[t])
                yield x, y
            return
        x_all, y_all = xy
        n = data.n_samples
        bs = min(int(self.batch_size), n)
        chunk = max(1, GATHER_ROWS // bs) * bs
        full = n - n % bs  # the rows of the epoch's whole batches
        for perm in epoch_permutations(n, generator):
            for lo in range(0, full, chunk):
                t = torch.from_numpy(perm[lo:min(lo + chunk, full)])
                parts = [a[t.to(a.device)] for a in (x_all, y_all, g_all)]
                if psi_all is not None:
                    parts.append(psi_all[t.to(psi_all.device)])
                for start in range(0, len(t), bs):
                    x, y, g, *psi = (a[start:start + bs] for a in parts)
                    self._pin(x, g, psi[0] if psi else None)
                    yield x, y

    def _pin(self, x, g, psi):
        self._pinned = (weakref.ref(x), x._version, g)
        if psi is not None:
            self._features.pin(x, g, psi)

    def _unpin(self):
        self._pinned = None
        if self._features is not None:
            self._features.unpin()

    def _mean(self, lin, x):
        pinned = self._pinned
        if pinned is not None and pinned[0]() is x and pinned[1] == x._version:
            return pinned[2].double()
        feats = self._features
        if feats is not None and feats.net is lin:  # g(x) and psi(x) from one forward pass
            with torch.no_grad():
                return feats(x)[0].double()
        return super()._mean(lin, x)

    # -- fit -------------------------------------------------------------------------
    def fit(self, data):
        """Learn ``Z``, ``L``, ``q_mu`` and the hyperparameters on minibatches of ``data``.

        Early stopping monitors the objective (``stopping="objective"``), also when
        ``data`` holds held-out rows: those are for :meth:`calibrate`.
        """
        self._fit_lik = self._energy_likelihood(data.likelihood)
        progress = self.progress_tol_param
        regression = data.likelihood.task == "regression"
        if progress == "auto":
            progress = 0.0 if regression else PROGRESS_TOL
        self.progress_tol = float(progress)
        if self.n_iter_no_progress_param == "auto":
            self.n_iter_no_progress = None if regression else PROGRESS_PATIENCE
        else:
            self.n_iter_no_progress = self.n_iter_no_progress_param
        scale = self.kernel_lr_scale_param
        self.kernel_lr_scale = float((1.0 if regression else KERNEL_LR_SCALE)
                                     if scale == "auto" else scale)
        self._noise0 = None
        self._gen = data.generator
        self._row_cache = self._xy_cache = None
        self._groups = False
        try:
            super().fit(data)
        finally:
            self._unpin()
            del (self._fit_lik, self._gen, self._noise0, self._row_cache, self._groups,
                 self._xy_cache)
        self.q_mu = self.q_mu.detach()
        return self

    def freeze(self, lin, kernel, Z, cz, L_raw):
        """Fix the fitted state (see :meth:`FixedMeanGPPosterior.freeze`).

        With free inducing features (``ClassificationKernel(inducing_features="free")``)
        the inducing parameters are rows ``[z_m, psi_m]``: :attr:`inducing_inputs` are
        the ``z_m``, :attr:`inducing_features` the ``psi_m`` (else ``None``).
        """
        super().freeze(lin, kernel, Z, cz, L_raw)
        D = getattr(kernel, "n_inputs", None)
        self.inducing_features = None
        if getattr(kernel, "_free", False) and D is not None and self._Z.shape[1] > D:
            self.inducing_features = self.inducing_inputs[:, D:]
            self.inducing_inputs = self.inducing_inputs[:, :D]
        return self

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
            return mean, joint_cov(K, V)
