"""FMGP: fixed-mean Gaussian processes (Ortega et al.; the thesis chapter).

A decoupled sparse variational GP whose predictive **mean is fixed to the network**
``g`` and whose covariance is learned with a free parametric kernel (see
:mod:`sklearn_lla.kernels`). Unlike VaLLA no Jacobian is ever formed: fitting and
prediction need only ``g(x)`` (and, for the classification kernel, the penultimate
features ``psi(x)``), one forward pass per batch.

With ``M`` inducing pairs ``(z_m, c_m)``, the factor ``L`` and the kernel ``K`` (all in
float64; the algebra is shared with VaLLA in :mod:`sklearn_lla._gp`):

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
(:mod:`sklearn_lla._optim`) with early stopping on the validation NLL.
"""

from __future__ import annotations

import copy
import math
import warnings
from numbers import Integral, Real

import numpy as np
import torch
from sklearn.utils._param_validation import HasMethods, Interval, StrOptions

from ._base import (
    _MIN_ROWS_FOR_HOLDOUT,
    CLASSIFIER_CONSTRAINTS,
    REGRESSOR_CONSTRAINTS,
    LaplaceClassifierMixin,
    LaplaceRegressorMixin,
)
from ._gp import (
    FixedMeanGPPosterior,
    alpha_energy,
    joint_cov,
    latent_cov,
    robust_cholesky,
    variational_terms,
)
from ._protocol import carve_validation
from .kernels import RBF, ClassificationKernel

__all__ = ["FMGPClassifier", "FMGPPosterior", "FMGPRegressor", "mean_regularizer_loss"]

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
        ``W`` and ``KL(Q | P)`` of :func:`sklearn_lla._gp.variational_terms`.
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
        :class:`~sklearn_lla._gp.FixedMeanGPPosterior`'s settings.
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


class _FMGPMixin:
    """FMGP's parameters and posterior, shared by the regressor and the classifier."""

    # FMGP never linearises the network: frozen parameters are fine.
    trainable_only = False

    _fmgp_constraints = {
        "kernel": [StrOptions({"auto"}), HasMethods(["gram", "cross", "diag_blocks"])],
        "n_inducing": [Interval(Integral, 1, None, closed="left")],
        "alpha": [Interval(Real, 0, 1, closed="both")],
        "learning_rate": [Interval(Real, 0, None, closed="neither")],
        "max_iter": [Interval(Integral, 1, None, closed="left")],
        "early_stopping": ["boolean"],
        "validation_freq": [Interval(Integral, 1, None, closed="left")],
        "n_iter_no_change": [Interval(Integral, 1, None, closed="left")],
        "learn_inducing": ["boolean"],
        "mean_regularizer": ["boolean"],
        "recalibrate": ["boolean"],
    }

    def _kernel_template(self, task):
        pv = None if self.prior_variance == "auto" else float(self.prior_variance)
        layer = getattr(self, "penultimate_layer", None)
        if not (isinstance(self.kernel, str) and self.kernel == "auto"):
            if pv is not None:
                raise ValueError("prior_variance applies to kernel='auto'; set the amplitude "
                                 "of your kernel object instead")
            if layer is not None:
                raise ValueError("penultimate_layer applies to kernel='auto'; set it on your "
                                 "kernel object instead")
            return self.kernel
        fixed = pv is not None
        if task == "regression":
            return RBF(amplitude=pv, learn_amplitude=not fixed)
        return ClassificationKernel(amplitude=pv, learn_amplitude=not fixed,
                                    penultimate_layer=layer)

    def _make_posterior(self, data):
        task = data.likelihood.task
        kernel = self._kernel_template(task)
        if (self.early_stopping and data.validation is None
                and data.n_samples >= _MIN_ROWS_FOR_HOLDOUT):
            data.validation = carve_validation(data, self.validation_fraction)
        seed = int(torch.randint(0, 2**31 - 1, (1,), generator=data.generator))
        return FMGPPosterior(
            kernel, mean_regularizer=self.mean_regularizer, recalibrate=self.recalibrate,
            n_inducing=self.n_inducing,
            noise_variance=self.noise_variance if task == "regression" else None,
            alpha=self.alpha, learning_rate=self.learning_rate, max_iter=self.max_iter,
            batch_size=self.batch_size, early_stopping=self.early_stopping,
            validation_freq=self.validation_freq, n_iter_no_change=self.n_iter_no_change,
            learn_inducing=self.learn_inducing, random_state=seed)

    def _store_fitted(self, posterior):
        self.kernel_ = posterior.kernel
        self.inducing_inputs_ = posterior.inducing_inputs
        self.inducing_outputs_ = posterior.inducing_outputs
        self.n_iter_ = int(posterior.n_iter)
        self.validation_scores_ = list(posterior.hyper_trace.get("validation", []))
        super()._store_fitted(posterior)


class FMGPRegressor(_FMGPMixin, LaplaceRegressorMixin):
    """FMGP regression: a Gaussian process whose mean is the network's output.

    The predictive mean is the network ``g(x)``; the variance ``S(x) + s2`` comes from a
    sparse variational GP with an ARD RBF kernel (or ``kernel``) learned on minibatches
    together with ``M`` inducing points and the thesis' auxiliary ``Q*`` regulariser.
    No Jacobians: fitting and prediction cost one forward pass per batch plus
    ``O(B M (D + M))`` kernel algebra. See ``docs/fmgp.md``.

    Parameters
    ----------
    net : None, skorch net, FrozenEstimator or torch.nn.Module, default=None
        The network. ``None`` trains a small tanh MLP (MAP, weight decay) in ``fit``;
        a fitted skorch net, ``FrozenEstimator(net)`` or an ``nn.Module`` is used as it
        is and never modified; an unfitted skorch net is trained in ``fit``.
    kernel : "auto" or Kernel, default="auto"
        ``"auto"``: :class:`~sklearn_lla.kernels.RBF` with length scales from the median
        heuristic (per feature, in the inputs' units: raw and standardised inputs give
        the same kernel) and amplitude initialised at the targets' variance. Or a
        kernel object with the :class:`~sklearn_lla.kernels.Kernel` interface
        (deep-copied; its ``initialize`` is called on a sample of the training data).
    n_inducing : int, default=100
        ``M``, inducing points (k-means on at most 20,000 rows).
    prior_variance : float or "auto", default="auto"
        The kernel amplitude: ``"auto"`` learns it; a float fixes it (``kernel="auto"``
        only).
    noise_variance : float or "auto", default="auto"
        ``s2``: ``"auto"`` learns it (from the network's mean squared residual).
    alpha : float, default=1.0
        The alpha of the energy (1: the thesis' objective; 0: the ELBO).
    learning_rate : float, default=0.01
        Adam's learning rate. The paper uses 1e-3 for tens of thousands of steps;
        1e-2 reaches the same validation NLL in a few hundred to a few thousand.
    max_iter : int, default=3000
        Largest number of Adam steps.
    batch_size : int, default=100
        Rows per minibatch and per forward pass at prediction.
    early_stopping : bool, default=True
        Stop when the validation NLL has not improved for ``n_iter_no_change`` checks
        and restore the best state. Validation rows: ``validation_data``, rows held
        out from training the network, the skorch net's own validation split, or
        else ``validation_fraction`` of the training rows.
    validation_fraction : float, default=0.1
        Fraction of rows held out when validation rows are needed and not given.
    validation_freq : int, default=100
        Steps between validation checks.
    n_iter_no_change : int, default=5
        Checks without improvement before stopping.
    learn_inducing : bool, default=True
        Optimise the inducing inputs (else keep the k-means centres).
    mean_regularizer : bool, default=True
        Add the auxiliary ``Q*`` term (recommended: without it the learned kernel
        can shrink the variance to fit the fixed mean's residuals).
    recalibrate : bool, default=True
        After fitting, multiply the predictive variance (latent and noise) by the one
        factor ``c`` that minimises the validation NLL (when there are validation
        rows). The variational fit sees the rows the network was trained on, whose
        residuals are optimistic when the network overfits; ``c`` corrects that. A
        fixed ``prior_variance`` or ``noise_variance`` is not rescaled.
    device : str or torch.device, default="auto"
        ``"auto"`` (CUDA when available), ``"cpu"``, ``"cuda"`` or a torch device.
    random_state : int, RandomState instance or None, default=None
        Seeds the k-means initialisation, minibatches, hold-outs and net training.
    verbose : int or bool, default=0
        ``>= 1`` shows a progress bar.

    Attributes
    ----------
    prior_variance_ : float
        The learned (or fixed) kernel amplitude.
    noise_variance_ : float
        The learned (or fixed) noise variance.
    kernel_ : Kernel
        The fitted kernel (e.g. ``kernel_.length_scale_``).
    inducing_inputs_ : ndarray of shape (M, n_features)
        The learned inducing inputs.
    inducing_outputs_ : ndarray of shape (M,)
        The target index of each inducing input.
    n_iter_ : int
        Adam steps taken.
    validation_scores_ : list of tuple
        ``(step, validation NLL)`` at each check.
    hyper_strategy_ : str
        ``"variational"`` (learned with the variational parameters) or ``"fixed"``.
    hyper_trace_ : dict
        The optimisation history.
    net_ : object
        The pretrained or trained network.
    linearized_net_ : LinearizedNet
        The frozen functional view of the network (only its forward pass is used).
    jacobian_backend_ : str
        The backend of ``linearized_net_`` (unused by FMGP).
    jacobian_backend_reason_ : str
        Why that backend was chosen.
    validation_source_ : str or None
        Where held-out rows came from, or ``None`` (then ``validation_fraction`` of
        the training rows are carved out for early stopping).
    likelihood_ : Gaussian
        The fitted likelihood.
    posterior_ : FMGPPosterior
        The fitted posterior.
    n_outputs_ : int
        Number of network outputs.
    n_features_in_ : int
        Number of input features.
    feature_names_in_ : ndarray of shape (n_features_in_,)
        Feature names, when ``X`` has string column names.

    See Also
    --------
    FMGPClassifier : The classification counterpart.
    ELLARegressor : A Nystrom LLA (needs Jacobians).

    Examples
    --------
    >>> import numpy as np
    >>> from sklearn_lla import FMGPRegressor
    >>> rng = np.random.RandomState(0)
    >>> X = rng.uniform(-2, 2, (200, 1))
    >>> y = np.sin(2 * X[:, 0]) + 0.1 * rng.randn(200)
    >>> reg = FMGPRegressor(n_inducing=10, max_iter=300, random_state=0).fit(X, y)
    >>> mean, std = reg.predict(X[:2], return_std=True)
    >>> std.shape
    (2,)
    """

    _parameter_constraints = {**REGRESSOR_CONSTRAINTS, **_FMGPMixin._fmgp_constraints}

    def __init__(self, net=None, *, kernel="auto", n_inducing=100, prior_variance="auto",
                 noise_variance="auto", alpha=1.0, learning_rate=0.01, max_iter=3000,
                 batch_size=100, early_stopping=True, validation_fraction=0.1,
                 validation_freq=100, n_iter_no_change=5, learn_inducing=True,
                 mean_regularizer=True, recalibrate=True, device="auto", random_state=None,
                 verbose=0):
        self.net = net
        self.kernel = kernel
        self.n_inducing = n_inducing
        self.prior_variance = prior_variance
        self.noise_variance = noise_variance
        self.alpha = alpha
        self.learning_rate = learning_rate
        self.max_iter = max_iter
        self.batch_size = batch_size
        self.early_stopping = early_stopping
        self.validation_fraction = validation_fraction
        self.validation_freq = validation_freq
        self.n_iter_no_change = n_iter_no_change
        self.learn_inducing = learn_inducing
        self.mean_regularizer = mean_regularizer
        self.recalibrate = recalibrate
        self.device = device
        self.random_state = random_state
        self.verbose = verbose


class FMGPClassifier(_FMGPMixin, LaplaceClassifierMixin):
    """FMGP classification: a Gaussian process on the logits whose mean is the network.

    The latent mean is the network's logits ``g(x)``; their covariance comes from a
    sparse variational GP with the thesis' kernel
    ``a B_cc' RBF(x, x') (psi(x)^T psi(x') / s + delta)`` (``psi``: the network's
    penultimate features; see :class:`~sklearn_lla.kernels.ClassificationKernel`),
    learned on minibatches with the probit-approximated alpha = 1 energy and the
    auxiliary ``Q*`` regulariser. No Jacobians. See ``docs/fmgp.md``.

    Parameters
    ----------
    net : None, skorch net, FrozenEstimator or torch.nn.Module, default=None
        The network. ``None`` trains a small tanh MLP (MAP, weight decay) in ``fit``;
        a fitted skorch net, ``FrozenEstimator(net)`` or an ``nn.Module`` is used as it
        is and never modified; an unfitted skorch net is trained in ``fit``.
    kernel : "auto" or Kernel, default="auto"
        ``"auto"``: :class:`~sklearn_lla.kernels.ClassificationKernel`. Or a kernel
        object with the :class:`~sklearn_lla.kernels.Kernel` interface.
    n_inducing : int, default=100
        ``M``, inducing points, ``M / n_classes`` per class (k-means within each
        class; each carries its class's logit index).
    prior_variance : float or "auto", default="auto"
        The kernel amplitude ``a``: ``"auto"`` learns it (from 1); a float fixes it.
    alpha : float, default=1.0
        The alpha of the energy.
    learning_rate : float, default=0.01
        Adam's learning rate.
    max_iter : int, default=3000
        Largest number of Adam steps.
    batch_size : int, default=100
        Rows per minibatch and per forward pass at prediction.
    early_stopping : bool, default=True
        Early stopping on the validation NLL (rows as in :class:`FMGPRegressor`).
    validation_fraction : float, default=0.1
        Fraction of rows held out when validation rows are needed and not given.
    validation_freq : int, default=100
        Steps between validation checks.
    n_iter_no_change : int, default=5
        Checks without improvement before stopping.
    learn_inducing : bool, default=True
        Optimise the inducing inputs.
    mean_regularizer : bool, default=True
        Add the auxiliary ``Q*`` term.
    recalibrate : bool, default=True
        After fitting, multiply the latent covariance by the factor that minimises
        the validation NLL (when there are validation rows; not with a fixed
        ``prior_variance``).
    penultimate_layer : str or None, default=None
        Name (as in ``net.named_modules()``) of the module whose output are the
        features ``psi(x)``. ``None``: the input of the network's last module with
        trainable parameters, which must be an ``nn.Linear``; any other head is an
        error asking for this parameter.
    link_approx : {"probit", "mc", "bridge"}, default="probit"
        Approximation of ``E softmax(f)`` at prediction.
    n_samples_predict : int, default=512
        Samples per point for ``link_approx="mc"``.
    classes : array-like or None, default=None
        The label of each network output, in output order (see
        :class:`~sklearn_lla.LLAClassifier`).
    device : str or torch.device, default="auto"
        ``"auto"`` (CUDA when available), ``"cpu"``, ``"cuda"`` or a torch device.
    random_state : int, RandomState instance or None, default=None
        Seeds the k-means initialisation, minibatches, hold-outs, net training and
        ``mc`` draws.
    verbose : int or bool, default=0
        ``>= 1`` shows a progress bar.

    Attributes
    ----------
    classes_ : ndarray
        Class labels, in the order of ``predict_proba``'s columns.
    prior_variance_ : float
        The learned (or fixed) kernel amplitude.
    kernel_ : Kernel
        The fitted kernel (``kernel_.B_``, ``kernel_.length_scale_``).
    inducing_inputs_ : ndarray of shape (M, n_features)
        The learned inducing inputs.
    inducing_outputs_ : ndarray of shape (M,)
        The logit index of each inducing input.
    n_iter_ : int
        Adam steps taken.
    validation_scores_ : list of tuple
        ``(step, validation NLL)`` at each check.
    hyper_strategy_ : str
        ``"variational"`` or ``"fixed"``.
    hyper_trace_ : dict
        The optimisation history.
    net_ : object
        The pretrained or trained network.
    linearized_net_ : LinearizedNet
        The frozen functional view of the network (only its forward pass is used).
    jacobian_backend_ : str
        The backend of ``linearized_net_`` (unused by FMGP).
    jacobian_backend_reason_ : str
        Why that backend was chosen.
    validation_source_ : str or None
        Where held-out rows came from, or ``None``.
    likelihood_ : Categorical or Bernoulli
        The likelihood.
    posterior_ : FMGPPosterior
        The fitted posterior.
    n_outputs_ : int
        Number of network outputs.
    n_features_in_ : int
        Number of input features.
    feature_names_in_ : ndarray of shape (n_features_in_,)
        Feature names, when ``X`` has string column names.

    See Also
    --------
    FMGPRegressor : The regression counterpart.

    Examples
    --------
    >>> from sklearn.datasets import make_blobs
    >>> from sklearn_lla import FMGPClassifier
    >>> X, y = make_blobs(n_samples=120, centers=3, random_state=0)
    >>> clf = FMGPClassifier(n_inducing=9, max_iter=200, random_state=0).fit(X, y)
    >>> clf.predict_proba(X[:2]).shape
    (2, 3)
    """

    _parameter_constraints = {**CLASSIFIER_CONSTRAINTS, **_FMGPMixin._fmgp_constraints,
                              "penultimate_layer": [str, None]}

    def __init__(self, net=None, *, kernel="auto", n_inducing=100, prior_variance="auto",
                 alpha=1.0, learning_rate=0.01, max_iter=3000, batch_size=100,
                 early_stopping=True, validation_fraction=0.1, validation_freq=100,
                 n_iter_no_change=5, learn_inducing=True, mean_regularizer=True,
                 recalibrate=True, penultimate_layer=None, link_approx="probit",
                 n_samples_predict=512, classes=None, device="auto", random_state=None,
                 verbose=0):
        self.net = net
        self.kernel = kernel
        self.n_inducing = n_inducing
        self.prior_variance = prior_variance
        self.alpha = alpha
        self.learning_rate = learning_rate
        self.max_iter = max_iter
        self.batch_size = batch_size
        self.early_stopping = early_stopping
        self.validation_fraction = validation_fraction
        self.validation_freq = validation_freq
        self.n_iter_no_change = n_iter_no_change
        self.learn_inducing = learn_inducing
        self.mean_regularizer = mean_regularizer
        self.recalibrate = recalibrate
        self.penultimate_layer = penultimate_layer
        self.link_approx = link_approx
        self.n_samples_predict = n_samples_predict
        self.classes = classes
        self.device = device
        self.random_state = random_state
        self.verbose = verbose

