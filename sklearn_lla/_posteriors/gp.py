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
(:func:`sklearn_lla._core.optim.minimize`). ``covariance="subspace"`` replaces the
kernel's prior by its Nystrom approximation through the inducing pairs. These
functions are the engine's algebra, in :mod:`sklearn_lla._posteriors.gp_algebra`; this
module holds the kernel interface and the posterior that fits and predicts with them.

What a method writes is a :class:`Kernel` (VaLLA: the scaled NTK ``s0^2 J(x) J(z)^T``;
FMGP: parametric kernels) and, optionally, an extra loss term (FMGP's auxiliary
``Q*``) through :class:`FixedMeanGPPosterior`'s hooks. The M x M algebra is float64
whatever the network's dtype; the Cholesky of ``Hm`` escalates its jitter.
"""

from __future__ import annotations

import abc
import math

import torch

from .._core.hyper import Fixed, HyperContext, VariationalEnergy, select
from .._core.linalg import cholesky
from .._core.optim import minibatches, minimize
from .._core.protocol import LatentPredictive, Posterior
from .gp_algebra import (
    FIT_THREADS,
    alpha_energy,
    init_inducing,
    latent_cov,
    latent_var_blocks,
    nystrom_blocks,
    subspace_gram,
    torch_threads,
    variational_terms,
)

#: ``validation_freq="auto"``: steps between early-stopping checks. ``"exact"``: the
#: checks score a callable without minibatch noise (VaLLA's objective on its fixed
#: monitor rows, or held-out NLL), so a short window suffices: with the default
#: ``n_iter_no_change=3`` a start that is already the optimum stops after 60 steps
#: (150 with 50; on a Year-shaped VaLLA fit that was 7 of its 10 s). ``"loss"``: the
#: checks average the minibatch loss over the window, which needs the longer one.
AUTO_CHECK_FREQ = {"exact": 20, "loss": 50}

__all__ = ["AUTO_CHECK_FREQ", "FixedMeanGPPosterior", "Kernel"]

# ---------------------------------------------------------------------------------
# The kernel interface
# ---------------------------------------------------------------------------------


class Kernel(abc.ABC):
    """A kernel over (input, output index) pairs, ``K((x, c), (x', c'))``, in float64.

    The one kernel interface of the fixed-mean sparse GP engine (VaLLA's scaled NTK,
    FMGP's parametric kernels; public as :class:`sklearn_lla.kernels.Kernel`).
    ``c`` is the regression target or the class logit. Subclasses implement
    :meth:`gram`, :meth:`cross` and :meth:`diag_blocks`, list their trainable tensors
    in :meth:`parameters` and report their amplitude as :attr:`prior_variance`.
    Optional hooks: :meth:`initialize` (FMGP calls it once at the start of ``fit`` on a
    deep copy of the user's kernel, with a sample of the training data, to build the
    hyperparameter tensors), :meth:`cross_and_diag` and :meth:`batch` (share work within
    a step), :meth:`predictor` (precompute what prediction needs). Every method must
    be free of side effects on shared state once fitting is done (predictions run from
    several threads).

    Examples
    --------
    A fixed (untrained) linear kernel on one output:

    >>> import torch
    >>> from sklearn_lla.kernels import Kernel
    >>> class Linear(Kernel):
    ...     @property
    ...     def prior_variance(self):
    ...         return 1.0
    ...     def gram(self, z, cz):
    ...         return z.double() @ z.double().T
    ...     def cross(self, x, z, cz):
    ...         return (x.double() @ z.double().T)[:, None, :]
    ...     def diag_blocks(self, x):
    ...         return (x.double() ** 2).sum(-1).reshape(-1, 1, 1)
    >>> k = Linear()
    >>> k.cross(torch.ones(2, 3), torch.ones(4, 3), torch.zeros(4, dtype=torch.long)).shape
    torch.Size([2, 1, 4])
    """

    def initialize(self, X, y, *, n_outputs, task, net):
        """Build the hyperparameters from a sample of the training data (optional hook).

        Parameters
        ----------
        X : Tensor of shape (n, n_features)
            A sample of the training inputs (float64, on the fitting device).
        y : Tensor
            Their targets: (n, n_outputs) float64 for regression, (n,) int64 labels
            for classification.
        n_outputs : int
            ``C``, the number of network outputs.
        task : {"regression", "classification"}
            The task.
        net : LinearizedNet
            The frozen network (for kernels that use its features).

        Returns
        -------
        self : Kernel
            The initialised kernel.
        """
        return self

    def parameters(self) -> list:
        """Return the trainable leaf tensors (``requires_grad=True``).

        Returns
        -------
        list of Tensor
            Optimised together with the variational parameters ``L`` and ``Z``.
        """
        return []

    @property
    @abc.abstractmethod
    def prior_variance(self) -> float:  # pragma: no cover - interface
        """The kernel's amplitude (reported as the estimator's ``prior_variance_``)."""

    @abc.abstractmethod
    def gram(self, z: torch.Tensor, cz: torch.Tensor) -> torch.Tensor:  # pragma: no cover
        """Compute the kernel matrix of the inducing pairs.

        Parameters
        ----------
        z : Tensor of shape (M, n_features)
            Inducing inputs.
        cz : Tensor of shape (M,)
            Output index of each inducing input.

        Returns
        -------
        Tensor of shape (M, M)
            ``K((z_i, cz_i), (z_j, cz_j))`` in float64.
        """

    @abc.abstractmethod
    def cross(self, x: torch.Tensor, z: torch.Tensor,
              cz: torch.Tensor) -> torch.Tensor:  # pragma: no cover - interface
        """Compute the covariances of every output of every point with the inducing pairs.

        Parameters
        ----------
        x : Tensor of shape (B, n_features)
            Query points.
        z : Tensor of shape (M, n_features)
            Inducing inputs.
        cz : Tensor of shape (M,)
            Their output indices.

        Returns
        -------
        Tensor of shape (B, C, M)
            ``K((x_b, c), (z_m, cz_m))`` in float64.
        """

    @abc.abstractmethod
    def diag_blocks(self, x: torch.Tensor) -> torch.Tensor:  # pragma: no cover - interface
        """Compute the prior covariance between the outputs of each point.

        Parameters
        ----------
        x : Tensor of shape (B, n_features)
            Query points.

        Returns
        -------
        Tensor of shape (B, C, C)
            ``K((x_b, c), (x_b, c'))`` in float64.
        """

    def cross_and_diag(self, x: torch.Tensor, z: torch.Tensor, cz: torch.Tensor):
        """Return :meth:`cross` and :meth:`diag_blocks` of one batch together.

        Kernels may override it to share the work on ``x``.

        Parameters
        ----------
        x : Tensor of shape (B, n_features)
            Query points.
        z : Tensor of shape (M, n_features)
            Inducing inputs.
        cz : Tensor of shape (M,)
            Their output indices.

        Returns
        -------
        Kxz : Tensor of shape (B, C, M)
            ``cross(x, z, cz)``.
        Kxx : Tensor of shape (B, C, C)
            ``diag_blocks(x)``.
        """
        return self.cross(x, z, cz), self.diag_blocks(x)

    def batch(self, x: torch.Tensor, z: torch.Tensor, cz: torch.Tensor):
        """Return :meth:`gram`, :meth:`cross` and :meth:`diag_blocks` for one training step.

        Kernels may override it to share the work on ``Z`` (VaLLA evaluates the
        network's Jacobian factors at ``Z`` once per step).

        Parameters
        ----------
        x : Tensor of shape (B, n_features)
            The minibatch's inputs.
        z : Tensor of shape (M, n_features)
            Inducing inputs.
        cz : Tensor of shape (M,)
            Their output indices.

        Returns
        -------
        Kzz : Tensor of shape (M, M)
            ``gram(z, cz)``.
        Kxz : Tensor of shape (B, C, M)
            ``cross(x, z, cz)``.
        Kxx : Tensor of shape (B, C, C)
            ``diag_blocks(x)``.
        """
        return (self.gram(z, cz), *self.cross_and_diag(x, z, cz))

    def lift_inducing(self, z: torch.Tensor) -> torch.Tensor:
        """The inducing parameters the fit learns for inducing inputs ``z`` (optional hook).

        The engine calls it once on the initial inducing inputs (k-means centres,
        ``(M, n_features)``); what it returns is optimised in their place and is the
        ``z`` that :meth:`gram`, :meth:`cross`, :meth:`batch` and :meth:`predictor`
        receive. The default returns ``z``; a kernel may append per-point parameters
        (``ClassificationKernel`` appends free inducing features).

        Parameters
        ----------
        z : Tensor of shape (M, n_features)
            Inducing inputs.

        Returns
        -------
        Tensor of shape (M, n_params)
            The inducing parameters (``z`` itself by default).
        """
        return z

    def predictor(self, z: torch.Tensor, cz: torch.Tensor, W: torch.Tensor):
        """Build the function used at prediction, ``x -> (Kxx blocks, Kxz W^T)``.

        The default evaluates :meth:`diag_blocks` and :meth:`cross`; kernels may
        precompute (VaLLA folds ``J(Z)^T W^T`` into a parameter-space basis).

        Parameters
        ----------
        z : Tensor of shape (M, n_features)
            Fitted inducing inputs.
        cz : Tensor of shape (M,)
            Their output indices.
        W : Tensor of shape (M, M)
            The fitted factor with ``A = W^T W``.

        Returns
        -------
        callable
            ``predict(x) -> (Tensor (B, C, C), Tensor (B, C, M))``; it must not mutate
            shared state (it is called from several threads).
        """
        z, cz, W = z.detach(), cz, W.detach()

        def predict(x):
            return self.diag_blocks(x), self.cross(x, z, cz) @ W.T

        return predict


# ---------------------------------------------------------------------------------
# The posterior
# ---------------------------------------------------------------------------------


class FixedMeanGPPosterior(Posterior):
    """Sparse variational GP with the mean fixed to the network (VaLLA, FMGP).

    Subclasses implement :meth:`make_kernel`; FMGP adds :meth:`extra_loss` and
    :meth:`extra_parameters`. The parameters are validated once, by the estimators'
    ``_parameter_constraints`` (``VaLLARegressor``, ``FMGPRegressor``, ...); this
    engine converts them and trusts their values.

    Parameters
    ----------
    n_inducing : int, default=100
        ``M``.
    covariance : {"full", "subspace"}, default="full"
        The GP's prior. ``"full"``: the kernel ``K`` itself, latent covariance
        ``Kxx - Kxz A Kzx`` (the papers'). ``"subspace"``: its Nystrom approximation
        through the inducing pairs, ``Q = Kxz Kzz^-1 Kzx`` (``Kzz`` jittered, see
        :func:`subspace_gram`), latent covariance ``Qxx - Kxz A Kzx``: the prior
        restricted to the span of the inducing pairs' features, so the part of the
        prior variance the ``M`` inducing pairs cannot reach is left out instead of
        kept at its prior value everywhere, data included.
    noise_variance : float, "auto" or None, default="auto"
        Regression ``s2``: learned (``"auto"``; initialised at the network's mean squared
        residual) or fixed. ``None`` for classification.
    alpha : float, default=1.0
        The alpha of the energy (0 gives the ELBO).
    learning_rate, max_iter, batch_size : float, int, int
        The shared Adam loop's settings (paper: 1e-3, up to 40,000, 100).
    early_stopping : bool, default=True
        Stop when the monitored score (see ``stopping``) stops improving and restore
        the state of its best check (see :func:`~sklearn_lla._core.optim.minimize`).
    stopping : {"auto", "objective"}, default="auto"
        What early stopping monitors. ``"objective"``: the training objective itself,
        the loss averaged over the ``validation_freq`` steps between checks.
        ``"auto"``: the NLL of the held-out rows when ``data.validation`` holds some,
        else the objective.
    validation_freq : int or "auto"
        Steps between checks. ``"auto"``: :data:`AUTO_CHECK_FREQ` (``"exact"`` when
        the checks score a callable, a monitor without minibatch noise, ``"loss"``
        when they average the minibatch loss).
    n_iter_no_change : int
        Checks without improvement before stopping.
    learn_inducing : bool, default=True
        Optimise ``Z`` (else keep the k-means centres).
    energy_link : {"probit", "mc"}, default="probit"
        Classification: how ``E_Q p(y | f)`` is computed in the energy.
    n_energy_samples : int, default=32
        Monte Carlo draws per point for ``energy_link="mc"`` and ``0 < alpha < 1``.
    random_state : int, default=0
        Seed of the k-means initialisation.
    tol : float, default=1e-3
        Improvement a check must make to count as one for early stopping: the score
        must fall by more than ``tol * max(1, |best|)`` (both scores are per-point
        NLLs, so this is 1e-3 nats per point below 1).
    progress_tol : float, default=0.0
        And by more than ``progress_tol`` times the progress since the first check
        (diminishing returns; see :class:`~sklearn_lla._core.optim.Patience`).
    name : str or None, default=None
        The name shown in progress bars, warnings and errors (the estimator passes
        its own, e.g. ``"VaLLARegressor"``); ``None`` uses the class name.
    n_iter_no_progress : int or None, default=None
        With ``progress_tol``: also stop after this many checks since the best that
        only crept below it (see :class:`~sklearn_lla._core.optim.Patience`).
    """

    fitted_attributes = ("prior_variance", "likelihood", "hyper_strategy", "hyper_trace",
                         "inducing_inputs", "inducing_outputs", "n_iter", "kernel")

    #: The strategy named when nothing is learned (the kernel's values kept);
    #: :meth:`make_kernel` may set another that keeps them (``"weight_norm"``).
    fixed_strategy = Fixed.name

    #: Whether the Adam loop runs torch's fused Adam kernel (see
    #: :func:`~sklearn_lla._core.optim.minimize`); FMGP's steps are cheap enough for
    #: Adam's per-tensor operations to show.
    fused_adam = False

    #: The calibration's hundreds of held-out NLL evaluations are small tensor
    #: operations, as a step is (:data:`FIT_THREADS`).
    calibration_threads = FIT_THREADS

    def __init__(self, *, n_inducing=100, covariance="full", noise_variance="auto", alpha=1.0,
                 learning_rate=1e-3, max_iter=5000, batch_size=100, early_stopping=True,
                 validation_freq=100, n_iter_no_change=5, learn_inducing=True,
                 energy_link="probit", n_energy_samples=32, random_state=0,
                 tol=1e-3, progress_tol=0.0, stopping="auto", name=None,
                 n_iter_no_progress=None):
        self.n_inducing = int(n_inducing)
        self.covariance = covariance
        self.noise_variance = noise_variance
        self.alpha = float(alpha)
        self.learning_rate = float(learning_rate)
        self.max_iter = int(max_iter)
        self.batch_size = int(batch_size)
        self.early_stopping = bool(early_stopping)
        self.validation_freq = (validation_freq if validation_freq == "auto"
                                else int(validation_freq))
        self.n_iter_no_change = int(n_iter_no_change)
        self.learn_inducing = bool(learn_inducing)
        self.energy_link = energy_link
        self.n_energy_samples = int(n_energy_samples)
        self.random_state = int(random_state)
        self.tol = float(tol)
        self.progress_tol = float(progress_tol)
        self.n_iter_no_progress = n_iter_no_progress
        self.name = name
        self.stopping = stopping

    # -- hooks ---------------------------------------------------------------------
    @abc.abstractmethod
    def make_kernel(self, data, Z: torch.Tensor, cz: torch.Tensor) -> Kernel:  # pragma: no cover
        """Build the kernel for ``data`` (initial hyperparameters from the data)."""

    def start(self, data, kernel, Z, cz, L_raw, log_noise):
        """Set the starting point of the optimisation in place (default: keep it).

        Called once before the Adam loop with the k-means ``Z``, ``L_raw = I``, the
        kernel's initial hyperparameters and ``log_noise`` (the learned ``log s2``, or
        ``None``). Subclasses may move any of them (under ``torch.no_grad``).
        """

    def monitor(self, kernel, Z, cz, L_raw, noise):
        """What early stopping on the objective checks (default ``"loss"``).

        ``"loss"``: the minibatch loss averaged between checks (see
        :func:`~sklearn_lla._core.optim.minimize`). Subclasses may return a callable
        ``() -> float`` scoring the current state on the objective exactly (e.g. on a
        fixed subset of the training rows); ``noise()`` gives the current ``s2``.
        """
        return "loss"

    def subspace_cholesky(self, kernel, Z, Kzz):
        """``chol(Kzz)`` of the ``"subspace"`` model's jittered ``Kzz`` at a training step.

        A hook: a kernel whose ``Kzz`` is its prior variance times a fixed matrix while
        ``Z`` is fixed can return the scaled factor of that matrix instead of a new
        factorisation (see :meth:`VaLLAPosterior.subspace_cholesky`).
        """
        return cholesky(Kzz, "inducing kernel matrix", warn=False)

    def make_objective(self, data, kernel, Z, cz, L_raw, log_noise, fixed_noise):
        """The minibatch objective of one ``fit`` on its live tensors (a hook).

        Default: the engine's ``_VariationalObjective`` (``loss(batch)`` and
        ``held_out_nll()``); a subclass may return one that evaluates the same loss
        with fewer operations (FMGP's factored step).
        """
        return _VariationalObjective(self, data, kernel, Z, cz, L_raw, log_noise, fixed_noise)

    def learning_rate_scales(self, params, kernel):
        """Multipliers of ``learning_rate`` per trained tensor (a hook; default ``None``:
        one learning rate). FMGP's classification scales the kernel's."""
        return None

    def extra_parameters(self) -> list:
        """Further trainable tensors of :meth:`extra_loss` (created in :meth:`make_kernel`)."""
        return []

    def extra_loss(self, *, x, y, n_total, kernel, Kzz, terms, Kxx, Kxz, cov, noise):
        """A loss term added to the minibatch loss (per-point scale), default none.

        ``cov`` is the batch's latent covariance blocks ``S(x)`` (B, C, C) that the
        fixed-mean term used; ``noise`` the regression noise variance (``None`` for
        classification), as a tensor that carries its gradient.
        """
        return None

    def training_batches(self, data, generator):
        """The endless minibatches ``(x, y)`` of the Adam loop (a hook).

        Default: :func:`~sklearn_lla._core.optim.minibatches`. FMGP attaches its
        cached network outputs to each batch.
        """
        return minibatches(data, self.batch_size, generator)

    def batch_kernel(self, kernel, x, Z, cz):
        """``(Kzz, Kxz, Kxx)`` of one training step (a hook; default :meth:`Kernel.batch`).

        A subclass may return for ``Kxz`` an object that is not a tensor but multiplies
        like one, ``Kxz @ T`` for ``T`` of shape (M, K) or (M,), giving (B, C, K) or
        (B, C) (FMGP's class-structured cross covariance): the step only multiplies it.
        Used with ``covariance="full"`` only (the subspace model reads ``Kxz`` itself).
        """
        return kernel.batch(x, Z, cz)

    def diagonal_energy(self, likelihood) -> bool:
        """Whether the step's energy reads only the diagonal of ``S(x)`` (a hook).

        Default ``False``: the full ``C x C`` blocks are formed. A subclass whose
        energy (and :meth:`extra_loss`) reads only the latent variances (the probit
        link at alpha = 1) may return ``True``: the step then forms only those
        (:func:`~sklearn_lla._posteriors.gp_algebra.latent_var_blocks`), the same
        numbers on the diagonal.
        """
        return False

    def mean_term_noise(self, noise):
        """The noise variance the fixed-mean term is evaluated with (a hook).

        Default: ``noise`` itself. FMGP returns it with its gradient stopped when the
        noise is learned from ``Q*``'s ELBO alone.
        """
        return noise

    # -- helpers ---------------------------------------------------------------------
    def _display_name(self):
        return self.name or type(self).__name__

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
        """Learn ``Z``, ``L`` and the hyperparameters on minibatches of ``data``.

        torch runs on :data:`FIT_THREADS` intra-op thread(s) meanwhile.
        """
        with torch_threads(FIT_THREADS):
            return self._fit(data)

    def _fit(self, data):
        lik = data.likelihood
        regression = lik.task == "regression"
        gen = data.generator
        dev = data.device
        # -- the model: inducing inputs, kernel, factor, noise ----------------------------
        Z0, cz0 = init_inducing(data, self.n_inducing, self.random_state)
        Z = torch.tensor(Z0, dtype=torch.float64, device=dev,
                         requires_grad=self.learn_inducing)
        cz = torch.as_tensor(cz0, device=dev)
        kernel = self.make_kernel(data, Z, cz)
        lifted = kernel.lift_inducing(Z.detach())
        if lifted.shape != Z.shape:  # the kernel appends per-point parameters
            Z = lifted.detach().clone().requires_grad_(self.learn_inducing)
        L_raw = torch.eye(Z.shape[0], dtype=torch.float64, device=dev, requires_grad=True)
        log_noise = fixed_noise = None
        if regression:
            if isinstance(self.noise_variance, str):
                log_noise = torch.tensor(math.log(self._initial_noise(data, gen)),
                                         dtype=torch.float64, device=dev, requires_grad=True)
            else:
                fixed_noise = torch.tensor(float(self.noise_variance), dtype=torch.float64,
                                           device=dev)
        params = [L_raw, *kernel.parameters(), *self.extra_parameters()]
        if self.learn_inducing:
            params.append(Z)
        if log_noise is not None:
            params.append(log_noise)
        # -- the objective (on the live tensors), the start, the checks, the loop ----------
        objective = self.make_objective(data, kernel, Z, cz, L_raw, log_noise, fixed_noise)
        self.start(data, kernel, Z, cz, L_raw, log_noise)
        validation = self.monitor(kernel, Z, cz, L_raw, objective.noise)  # the objective
        val = data.validation
        if self.stopping == "auto" and val is not None and val.n_samples > 0:
            validation = objective.held_out_nll
        freq = self.validation_freq
        if freq == "auto":
            freq = AUTO_CHECK_FREQ["exact" if callable(validation) else "loss"]
        closed = getattr(objective, "closed_form_step", None)
        res = minimize(objective.loss, params, self.training_batches(data, gen),
                       max_iter=self.max_iter, lr=self.learning_rate,
                       validation=validation if self.early_stopping else None,
                       validation_freq=freq,
                       early_stopping=self.early_stopping,
                       n_iter_no_change=self.n_iter_no_change, tol=self.tol,
                       progress_tol=self.progress_tol,
                       n_iter_no_progress=self.n_iter_no_progress,
                       check_start=callable(validation), verbose=data.verbose,
                       desc=f"{self._display_name()}: fitting", fused=self.fused_adam,
                       lr_scales=self.learning_rate_scales(params, kernel),
                       loss_and_grads=closed(params) if closed is not None else None)
        # -- publish -----------------------------------------------------------------------
        self.freeze(data.lin, kernel, Z, cz, L_raw)
        self.n_iter = int(res.n_iter)
        self.prior_variance = float(kernel.prior_variance)
        s2 = float(objective.noise().detach()) if regression else None
        self.likelihood = lik.with_noise(s2) if regression else lik
        trace = {**res.as_dict(), "kl": float(self._kl)}
        learned = (regression and log_noise is not None) or kernel.parameters()
        r = select(VariationalEnergy.name if learned else self.fixed_strategy,
                   HyperContext(self.prior_variance, s2, history=trace))
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

    def predictor_factor(self):
        """The matrix the kernel's predictor folds in, and the ``A`` factor's row count.

        ``"full"``: ``W`` (M, M) with ``A = W^T W``. ``"subspace"``: ``W`` stacked on
        ``chol(Kzz)^-1`` (2M, M), so that one predictor pass gives ``V = Kxz W^T`` and
        ``U = Kxz chol(Kzz)^-T`` (``Qxx = U U^T``) together.

        Returns
        -------
        factor : Tensor of shape (M, M) or (2M, M)
        n_w : int
            ``M``: the rows of ``factor`` that are ``W``.
        kl : float
            The covariance part of the KL at the fitted state.
        """
        Kzz = self.kernel.gram(self._Z, self._cz)
        chol_inv = None
        if getattr(self, "covariance", "full") == "subspace":
            Kzz = subspace_gram(Kzz)
            chol = cholesky(Kzz, "inducing kernel matrix", warn=False)
            chol_inv = torch.linalg.solve_triangular(
                chol, torch.eye(Kzz.shape[0], dtype=Kzz.dtype, device=Kzz.device),
                upper=False)
        terms = variational_terms(Kzz, self._L)
        factor = terms.W if chol_inv is None else torch.cat([terms.W, chol_inv])
        return factor, terms.W.shape[0], float(terms.kl)

    def _build_predictor(self):
        factor, self._n_w, self._kl = self.predictor_factor()
        self._predict_fn = self.kernel.predictor(self._Z, self._cz, factor)

    def _prior_and_v(self, x):
        """``(prior blocks (B, C, C), V = Kxz W^T (B, C, M))`` at ``x``, float64."""
        Kxx, V = self._predict_fn(x)
        V = V.double()
        m = getattr(self, "_n_w", V.shape[-1])
        if V.shape[-1] == m:
            return Kxx.double(), V
        U = V[..., m:]
        return U @ U.transpose(-1, -2), V[..., :m]

    # -- predict -------------------------------------------------------------------
    def predict(self, x):
        """Latent mean ``g(x)`` and covariance ``Kxx - Kxz A Kzx`` (or ``Qxx - ...``).

        torch runs on :data:`FIT_THREADS` intra-op thread(s) meanwhile.
        """
        with torch_threads(FIT_THREADS), torch.no_grad():
            mean = self._mean(self._lin, x)
            prior, V = self._prior_and_v(x)
            return LatentPredictive(mean, latent_cov(prior, V))

    def __getstate__(self):
        state = dict(self.__dict__)
        state.pop("_predict_fn", None)
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        if "_L" in state:
            with torch.no_grad():
                self._build_predictor()


class _VariationalObjective:
    """The fixed-mean GP's minibatch objective and its held-out score, at the live
    (trainable) ``Z``, ``L_raw``, kernel and noise of one ``fit``.

    ``loss(batch)``: ``-mean alpha-energy + KL / N`` (plus the posterior's
    :meth:`~FixedMeanGPPosterior.extra_loss`); ``held_out_nll()``: the mean NLL of the
    current predictive on the held-out rows (early stopping's score).
    """

    def __init__(self, post, data, kernel, Z, cz, L_raw, log_noise, fixed_noise):
        self.post, self.data, self.kernel = post, data, kernel
        self.Z, self.cz, self.L_raw = Z, cz, L_raw
        self.log_noise, self.fixed_noise = log_noise, fixed_noise
        self.regression = data.likelihood.task == "regression"
        self.elik = post._energy_likelihood(data.likelihood)
        self.subspace = post.covariance == "subspace"
        self.diagonal = (not self.subspace) and bool(post.diagonal_energy(self.elik))

    def noise(self):
        """The noise variance in use (a tensor; ``None`` for classification)."""
        if not self.regression:
            return None
        return torch.exp(self.log_noise) if self.log_noise is not None else self.fixed_noise

    def prior_terms(self, Kzz):
        """``(Kzz used by A and the KL, its Cholesky factor or None, terms)``."""
        if not self.subspace:
            return Kzz, None, variational_terms(Kzz, self.L_raw)
        Kzz = subspace_gram(Kzz)
        return (Kzz, self.post.subspace_cholesky(self.kernel, self.Z, Kzz),
                variational_terms(Kzz, self.L_raw))

    @staticmethod
    def cov_of(Kxx, Kxz, chol, terms):
        """The latent covariance blocks of a batch."""
        prior = Kxx if chol is None else nystrom_blocks(Kxz, chol)
        return latent_cov(prior, Kxz @ terms.W.T)

    def loss(self, batch):
        """The minibatch objective (a differentiable scalar)."""
        post, data = self.post, self.data
        x, y = batch
        if self.subspace:
            Kzz, Kxz, Kxx = self.kernel.batch(x, self.Z, self.cz)
        else:
            Kzz, Kxz, Kxx = post.batch_kernel(self.kernel, x, self.Z, self.cz)
        Kzz, chol, terms = self.prior_terms(Kzz)
        if self.diagonal:
            cov = latent_var_blocks(Kxx, Kxz @ terms.W.T)
        else:
            cov = self.cov_of(Kxx, Kxz, chol, terms)
        mean = post._mean(data.lin, x)
        eps = None
        if post._needs_eps(self.elik):
            eps = torch.randn((post.n_energy_samples, *mean.shape), generator=data.generator,
                              dtype=torch.float64).to(data.device)
        s2 = self.noise()
        e = alpha_energy(self.elik, mean, cov, y, alpha=post.alpha,
                         noise=post.mean_term_noise(s2), eps=eps)
        n_total = data.n_samples
        loss = -e.mean() + terms.kl / n_total
        extra = post.extra_loss(x=x, y=y, n_total=n_total, kernel=self.kernel, Kzz=Kzz,
                                terms=terms, Kxx=Kxx, Kxz=Kxz, cov=cov, noise=s2)
        return loss if extra is None else loss + extra

    def held_out_nll(self):
        """Mean NLL of the current predictive on the held-out rows."""
        post, data, lik = self.post, self.data, self.data.likelihood
        val = data.validation
        _, chol, terms = self.prior_terms(self.kernel.gram(self.Z, self.cz))
        total = 0.0
        for x, y in val.batches(max(val.batch_size, 256)):
            Kxz, Kxx = self.kernel.cross_and_diag(x, self.Z, self.cz)
            cov = self.cov_of(Kxx, Kxz, chol, terms)
            mean = post._mean(data.lin, x)
            lp = (alpha_energy(lik, mean, cov, y, alpha=1.0, noise=self.noise())
                  if self.regression else lik.log_predictive(mean, cov, y))
            total -= float(lp.sum())
        return total / val.n_samples
