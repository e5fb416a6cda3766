"""Sampled LLA estimators (Antoran et al., ICLR 2023): sample-then-optimise posterior
samples of the linearised network, prior variance by EM (regression) or the weight
norm (classification), calibrated on held-out rows when there are any.

The posterior (E-step, M-step, validation scan, predictive) is
:class:`~sklearn_lla._posteriors.sampled.SampledLLAPosterior`; this module holds the
thin scikit-learn estimators on it.
"""

from __future__ import annotations

from numbers import Integral, Real

import numpy as np
from sklearn.utils._param_validation import Interval, StrOptions

from ._base import (
    CLASSIFIER_CONSTRAINTS,
    LINEARIZED_CONSTRAINTS,
    REGRESSOR_CONSTRAINTS,
    LaplaceClassifierMixin,
    LaplaceRegressorMixin,
)
from ._posteriors.sampled import SampledLLAPosterior

__all__ = ["SampledLLARegressor", "SampledLLAClassifier"]


class _SampledMixin:
    """Parameters and posterior shared by the regressor and the classifier."""

    _sampled_constraints = {
        **LINEARIZED_CONSTRAINTS,
        "n_posterior_samples": [Interval(Integral, 1, None, closed="left")],
        "n_em_steps": [Interval(Integral, 0, None, closed="left")],
        "n_em_samples": [Interval(Integral, 1, None, closed="left"), StrOptions({"auto"})],
        "max_iter": [Interval(Integral, 1, None, closed="left"), StrOptions({"auto"})],
        "learning_rate": [Interval(Real, 0, None, closed="neither")],
        "lr_schedule": [StrOptions({"auto", "cosine", "constant", "step"})],
        "hyper_strategy": [StrOptions({"auto", "em", "weight_norm", "validation"})],
        "early_stopping": ["boolean"],
        "tol": [Interval(Real, 0, None, closed="left")],
        "n_iter_no_change": [Interval(Integral, 1, None, closed="left")],
        "g_prior": ["boolean"],
        "solver": [StrOptions({"auto", "cg", "adam"})],
        "preconditioner": [StrOptions({"nystrom"}), None],
        "preconditioner_rank": [Interval(Integral, 1, None, closed="left"),
                                StrOptions({"auto"})],
    }

    def _make_posterior(self, data):
        noise = self.noise_variance if data.likelihood.task == "regression" else None
        return SampledLLAPosterior(
            self.prior_variance, noise, hyper=self.hyper_strategy,
            n_posterior_samples=self.n_posterior_samples, n_em_steps=self.n_em_steps,
            n_em_samples=self.n_em_samples,
            max_iter=self.max_iter, learning_rate=self.learning_rate,
            lr_schedule=self.lr_schedule, early_stopping=self.early_stopping, tol=self.tol,
            n_iter_no_change=self.n_iter_no_change, g_prior=self.g_prior,
            solver=self.solver, preconditioner=self.preconditioner,
            preconditioner_rank=self.preconditioner_rank, name=type(self).__name__)

    def _store_fitted(self, posterior):
        self.effective_dim_ = float(posterior.effective_dim)
        self.n_iter_ = np.asarray(posterior.n_iter, dtype=np.int64)
        super()._store_fitted(posterior)


class SampledLLARegressor(_SampledMixin, LaplaceRegressorMixin):
    """Sampled LLA regression: sample-then-optimise posterior samples, hyperparameters by EM.

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
        ``s0^2 = 1 / alpha``; ``"auto"`` is chosen by ``hyper_strategy``.
    noise_variance : float or "auto", default="auto"
        ``s2``. ``"auto"``: the EM update ``s2 = RSS(theta_bar) / (N n_targets -
        gamma)`` from ``RSS(theta_hat) / (N n_targets)``; with held-out rows, the
        exact rescaling ``(c s0^2, c s2)`` is then fitted on them after ``fit`` (the
        held-out maximum likelihood ``c``: the predictive variance is scaled by ``c``
        everywhere, keeping the shape EM chose). Under ``hyper_strategy="validation"``
        it is chosen with the prior by validation NLL.
    hyper_strategy : {"auto", "em", "weight_norm", "validation"}, default="auto"
        How ``"auto"`` values are chosen. ``"auto"`` is ``"em"``, the paper's EM
        (``n_em_steps`` updates ``alpha = gamma / ||theta_bar||^2`` and the noise update,
        from ``||theta_hat||^2 / P``), with or without held-out rows.
        ``"weight_norm"``: ``s0^2 = ||theta_hat||^2 / P`` (the noise still by EM).
        ``"validation"`` (only when asked for; needs held-out rows): validation NLL
        over a scan of prior variances (``||theta_hat||^2 / P x logspace(-2, 2, 9)``,
        warm-started E-steps of ``max_iter // 4`` iterations, stopped once two
        candidates in a row score worse) and, for each, the exact rescalings
        ``(c s0^2, c s2)``, ``c`` in ``logspace(-1, 1, 21)``.
    n_em_steps : int, default=3
        EM iterations of ``hyper_strategy="em"`` (one E-step each, plus a final
        E-step at the learned values).
    n_em_samples : int or "auto", default="auto"
        Samples solved in each EM step: the M-step needs only the effective dimension
        ``gamma`` (the samples' mean quadratic form), so only the final E-step solves
        all ``n_posterior_samples``. ``"auto"``: 16 in the first step, then as many as
        bring the relative standard error of ``gamma`` (known from the samples) to 5 %.
    max_iter : int or "auto", default="auto"
        Iterations per E-step: conjugate-gradient iterations (full data passes) or
        Adam steps (minibatches of ``batch_size`` rows). ``"auto"``: up to 1,000
        conjugate-gradient iterations (they stop at ``tol``, usually after 150-300 on
        the bundled data sets) or 300 Adam steps.
    learning_rate : float, default=0.1
        Adam's (initial) learning rate, in prior-whitened coordinates.
    lr_schedule : {"auto", "cosine", "constant", "step"}, default="auto"
        Adam's learning-rate schedule in each E-step. ``"auto"`` is a cosine decay to
        1 %: it averages the minibatch noise out and ends a full-batch run at the
        optimum instead of oscillating about it.
    early_stopping : bool, default=False
        Adam only: end an E-step early when its objective, averaged over windows of
        50 steps, improves by less than ``tol`` (relative) ``n_iter_no_change`` times
        in a row.
    tol : float, default=1e-4
        Conjugate gradients stop once every column's residual is below ``tol`` times
        its right-hand side; Adam (with ``early_stopping``) counts a relative
        improvement below ``tol`` as none.
    n_iter_no_change : int, default=3
        Windows without progress before an E-step ends (with ``early_stopping``).
    g_prior : bool, default=False
        Per-parameter prior scales ``1 / sqrt(diag GGN)`` (normalised to mean one and
        clipped at 100) instead of an isotropic prior.
    solver : {"auto", "cg", "adam"}, default="auto"
        How each E-step is solved. ``"cg"``: conjugate gradients, one full data pass
        per iteration, to the relative residual ``tol``. ``"adam"``: ``max_iter``
        minibatch Adam steps. ``"auto"``: ``"cg"`` when a data pass is at most 32
        batches of ``batch_size`` rows, ``"adam"`` beyond (the same for numpy and dask
        inputs).
    preconditioner : {"nystrom"} or None, default="nystrom"
        Conjugate gradients' preconditioner: a randomized Nystrom approximation of
        rank ``preconditioner_rank`` of the prior-whitened GGN (the few directions the
        data pin down, which make plain conjugate gradients slow), sketched once per
        fit by one data pass; ``None``: plain conjugate gradients. Adam ignores it.
    preconditioner_rank : int or "auto", default="auto"
        The sketch's rank (memory ``rank x P`` doubles); ``"auto"``:
        ``2 (n_posterior_samples + 1)``, at most the number of rows times outputs.
    validation_fraction : float, default=0.1
        Fraction of rows held out when a network is trained in ``fit`` (then used as
        held-out rows).
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
        Iterations (conjugate-gradient iterations or Adam steps) of each E-step.
    hyper_strategy_ : str
        ``"em"``, ``"weight_norm"``, ``"validation"`` or ``"fixed"``.
    hyper_trace_ : dict
        ``"em"``: the prior variance of each EM step and per-step information
        (``"steps"``); ``"validation"``: the scanned ``prior_variance`` values, the
        ``noise_variance`` grid, ``score`` (validation NLL per prior and rescaling),
        ``final_factor``. Always ``"solver"`` and ``"optimisation"`` (the final
        E-step); ``"calibration"`` when held-out rows rescaled the predictive.
    validation_source_ : str or None
        Where the held-out rows came from, or ``None`` without any.
    net_ : object
        The pretrained or trained network.
    linearized_net_ : LinearizedNet
        The frozen functional view of the network.
    jacobian_backend_ : str
        ``"structured"``, ``"graph"`` or ``"functorch"``.
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
                 noise_variance="auto", hyper_strategy="auto", n_em_steps=3,
                 n_em_samples="auto", max_iter="auto", learning_rate=0.1, lr_schedule="auto",
                 early_stopping=False, tol=1e-4, n_iter_no_change=3, g_prior=False,
                 solver="auto", preconditioner="nystrom", preconditioner_rank="auto",
                 validation_fraction=0.1, trainable_only=True, device="auto",
                 batch_size=256, random_state=None, verbose=0):
        self.net = net
        self.n_posterior_samples = n_posterior_samples
        self.prior_variance = prior_variance
        self.noise_variance = noise_variance
        self.hyper_strategy = hyper_strategy
        self.n_em_steps = n_em_steps
        self.n_em_samples = n_em_samples
        self.max_iter = max_iter
        self.learning_rate = learning_rate
        self.lr_schedule = lr_schedule
        self.early_stopping = early_stopping
        self.tol = tol
        self.n_iter_no_change = n_iter_no_change
        self.g_prior = g_prior
        self.solver = solver
        self.preconditioner = preconditioner
        self.preconditioner_rank = preconditioner_rank
        self.validation_fraction = validation_fraction
        self.trainable_only = trainable_only
        self.device = device
        self.batch_size = batch_size
        self.random_state = random_state
        self.verbose = verbose


class SampledLLAClassifier(_SampledMixin, LaplaceClassifierMixin):
    """Sampled LLA classification: sample-then-optimise posterior samples.

    Parameters
    ----------
    net : None, skorch net, FrozenEstimator or torch.nn.Module, default=None
        The network. ``None`` trains a small tanh MLP (MAP, weight decay) in ``fit``;
        a fitted skorch net, ``FrozenEstimator(net)`` or an ``nn.Module`` is used as it
        is and never modified; an unfitted skorch net is trained in ``fit``.
    n_posterior_samples : int, default=64
        ``K``, posterior samples of the linearised parameters.
    prior_variance : float or "auto", default="auto"
        ``s0^2 = 1 / alpha``; ``"auto"`` is chosen by ``hyper_strategy``.
    hyper_strategy : {"auto", "em", "weight_norm", "validation"}, default="auto"
        How an ``"auto"`` prior variance is chosen. ``"auto"`` is ``"weight_norm"``,
        ``s0^2 = ||theta_hat||^2 / P`` (as exact LLA's classifier): on a network that
        fits its training rows the softmax curvature there vanishes and the paper's
        EM (``"em"``) ends far under-confident (``docs/sampled.md``). With held-out
        rows a temperature of the latent predictive is then fitted on them
        (``temperature_``). ``"validation"`` (only when asked for; needs held-out
        rows): validation NLL over a scan of prior variances (``||theta_hat||^2 / P x
        logspace(-2, 2, 9)``, warm-started E-steps of ``max_iter // 4`` iterations,
        stopped once two candidates in a row score worse).
    n_em_steps : int, default=3
        EM iterations of ``hyper_strategy="em"``.
    n_em_samples : int or "auto", default="auto"
        Samples solved in each EM step: the M-step needs only the effective dimension
        ``gamma`` (the samples' mean quadratic form), so only the final E-step solves
        all ``n_posterior_samples``. ``"auto"``: 16 in the first step, then as many as
        bring the relative standard error of ``gamma`` (known from the samples) to 5 %.
    max_iter : int or "auto", default="auto"
        Iterations per E-step (conjugate-gradient iterations or Adam steps);
        ``"auto"``: up to 1,000 conjugate-gradient iterations or 300 Adam steps.
    learning_rate : float, default=0.1
        Adam's (initial) learning rate, in prior-whitened coordinates.
    lr_schedule : {"auto", "cosine", "constant", "step"}, default="auto"
        Adam's learning-rate schedule in each E-step (``"auto"``: a cosine decay to
        1 %).
    early_stopping : bool, default=False
        Adam only: end an E-step early when its windowed objective stops decreasing.
    tol : float, default=1e-3
        Relative residual at which conjugate gradients stop; Adam's relative
        improvement threshold (with ``early_stopping``). Looser than the regressor's
        ``1e-4`` (whose EM reads the effective dimension off the solve): a sample off
        by ``1e-3`` relative is 100 times below the Monte Carlo error of ``K = 64``
        samples; on the digits CNN it saves one of two conjugate-gradient
        iterations with the same NLL, ECE and OOD AUC to 4 digits.
    n_iter_no_change : int, default=3
        Windows without progress before an E-step ends (with ``early_stopping``).
    g_prior : bool, default=False
        Per-parameter prior scales ``1 / sqrt(diag GGN)`` (normalised, clipped).
    solver : {"auto", "cg", "adam"}, default="auto"
        How each E-step is solved: conjugate gradients (full data passes), minibatch
        Adam, or ``"auto"``: ``"cg"`` when a data pass is at most 32 batches.
    preconditioner : {"nystrom"} or None, default="nystrom"
        Conjugate gradients' preconditioner: a randomized Nystrom approximation of
        rank ``preconditioner_rank`` of the prior-whitened GGN (the few directions the
        data pin down, which make plain conjugate gradients slow), sketched once per
        fit by one data pass; ``None``: plain conjugate gradients. Adam ignores it.
    preconditioner_rank : int or "auto", default="auto"
        The sketch's rank (memory ``rank x P`` doubles); ``"auto"``:
        ``2 (n_posterior_samples + 1)``, at most the number of rows times outputs.
    link_approx : {"probit", "mc", "bridge"}, default="probit"
        Approximation of ``E softmax(f)`` under the latent Gaussian with the sample
        covariance.
    n_samples_predict : int, default=512
        Samples per point for ``link_approx="mc"``.
    classes : array-like or None, default=None
        The label of each network output, in output order (see
        :class:`~sklearn_lla.LLAClassifier`).
    validation_fraction : float, default=0.1
        Fraction of rows held out when a network is trained in ``fit`` (then used as
        held-out rows).
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
    temperature_ : float
        Temperature of the latent predictive (1 unless fitted on held-out rows).
    covariance_scale_ : float
        Scale of the latent covariance calibrated on held-out rows (1.0 unless the
        temperature alone left their NLL above the network's own; see
        :func:`~sklearn_lla._core.calibration.calibrate_classification`).
    n_iter_ : ndarray of int
        Iterations (conjugate-gradient iterations or Adam steps) of each E-step.
    hyper_strategy_ : str
        ``"weight_norm"``, ``"em"``, ``"validation"`` or ``"fixed"``.
    hyper_trace_ : dict
        ``"em"``: the prior variance of each EM step and per-step information;
        ``"validation"``: the scanned ``prior_variance`` values and ``score``
        (validation NLL per prior). Always ``"solver"`` and ``"optimisation"``;
        ``"calibration"`` when a temperature was fitted on held-out rows.
    validation_source_ : str or None
        Where the held-out rows came from, or ``None`` without any.
    net_ : object
        The pretrained or trained network.
    linearized_net_ : LinearizedNet
        The frozen functional view of the network.
    jacobian_backend_ : str
        ``"structured"``, ``"graph"`` or ``"functorch"``.
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

    def __init__(self, net=None, *, n_posterior_samples=64, prior_variance="auto",
                 hyper_strategy="auto", n_em_steps=3, n_em_samples="auto", max_iter="auto",
                 learning_rate=0.1, lr_schedule="auto", early_stopping=False, tol=1e-3,
                 n_iter_no_change=3, g_prior=False, solver="auto", preconditioner="nystrom",
                 preconditioner_rank="auto", link_approx="probit",
                 n_samples_predict=512, classes=None, validation_fraction=0.1,
                 trainable_only=True, device="auto", batch_size=256, random_state=None,
                 verbose=0):
        self.net = net
        self.n_posterior_samples = n_posterior_samples
        self.prior_variance = prior_variance
        self.hyper_strategy = hyper_strategy
        self.n_em_steps = n_em_steps
        self.n_em_samples = n_em_samples
        self.max_iter = max_iter
        self.learning_rate = learning_rate
        self.lr_schedule = lr_schedule
        self.early_stopping = early_stopping
        self.tol = tol
        self.n_iter_no_change = n_iter_no_change
        self.g_prior = g_prior
        self.solver = solver
        self.preconditioner = preconditioner
        self.preconditioner_rank = preconditioner_rank
        self.validation_fraction = validation_fraction
        self.link_approx = link_approx
        self.n_samples_predict = n_samples_predict
        self.classes = classes
        self.trainable_only = trainable_only
        self.device = device
        self.batch_size = batch_size
        self.random_state = random_state
        self.verbose = verbose
