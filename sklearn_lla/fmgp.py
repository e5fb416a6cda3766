"""``FMGPRegressor`` and ``FMGPClassifier``: fixed-mean Gaussian processes.

The scikit-learn estimators; the posterior is in :mod:`sklearn_lla._posteriors.fmgp`,
on the fixed-mean sparse GP of :mod:`sklearn_lla._posteriors.gp`, with the kernels of
:mod:`sklearn_lla.kernels`.
"""
from __future__ import annotations

from numbers import Integral, Real

from sklearn.utils._param_validation import HasMethods, Interval, StrOptions

from ._base import (
    CLASSIFIER_CONSTRAINTS,
    REGRESSOR_CONSTRAINTS,
    LaplaceClassifierMixin,
    LaplaceRegressorMixin,
)
from ._core.utils import generator_seed, torch_threads
from ._posteriors.fmgp import FMGPPosterior, default_kernel
from ._posteriors.gp_algebra import FIT_THREADS

__all__ = ["FMGPClassifier", "FMGPRegressor"]



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
        "tol": [Interval(Real, 0, None, closed="left")],
        "learn_inducing": ["boolean"],
        "mean_regularizer": ["boolean"],
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
        return default_kernel(task, amplitude=pv, penultimate_layer=layer)

    def _linearize(self, resolved, X, device):
        # Building the frozen view (and choosing its Jacobian backend, which FMGP never
        # uses) is a few passes over 8 rows: on FIT_THREADS torch thread(s), as the fit.
        with torch_threads(FIT_THREADS):
            return super()._linearize(resolved, X, device)

    def _make_posterior(self, data):
        task = data.likelihood.task
        kernel = self._kernel_template(task)
        seed = generator_seed(data.generator)
        return FMGPPosterior(
            kernel, mean_regularizer=self.mean_regularizer, n_inducing=self.n_inducing,
            noise_variance=self.noise_variance if task == "regression" else None,
            alpha=self.alpha, learning_rate=self.learning_rate, max_iter=self.max_iter,
            batch_size=self.batch_size, early_stopping=self.early_stopping,
            validation_freq=self.validation_freq, n_iter_no_change=self.n_iter_no_change,
            learn_inducing=self.learn_inducing, tol=self.tol, random_state=seed,
            name=type(self).__name__)

    def _store_fitted(self, posterior):
        self.kernel_ = posterior.kernel
        self.inducing_inputs_ = posterior.inducing_inputs
        self.inducing_outputs_ = posterior.inducing_outputs
        self.inducing_features_ = posterior.inducing_features
        self.n_iter_ = int(posterior.n_iter)
        self.validation_scores_ = list(posterior.hyper_trace.get("validation", []))
        super()._store_fitted(posterior)


class FMGPRegressor(_FMGPMixin, LaplaceRegressorMixin):
    """FMGP regression: a Gaussian process whose mean is the network's output.

    The predictive mean is the network ``g(x)``; the variance ``S(x) + s2`` comes from a
    sparse variational GP with an ARD RBF kernel (or ``kernel``) learned on minibatches
    together with ``M`` inducing points and the thesis' auxiliary ``Q*`` regulariser,
    stopped when the objective stops improving. The noise ``s2`` is learned by ``Q*``
    (the network's residuals on its own training rows are optimistic) and, when there
    are rows the network did not fit (``validation_data``, rows held out from training
    it), recalibrated on them with ``S`` kept. No Jacobians: fitting and prediction
    cost one forward pass per batch plus ``O(B M (D + M))`` kernel algebra. See
    ``docs/fmgp.md``.

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
        ``s2``: ``"auto"`` learns it with ``Q*``'s ELBO, then, with held-out rows,
        calibrates it on them by NLL with the latent covariance kept; a float fixes
        it.
    alpha : float, default=1.0
        The alpha of the energy (1: the thesis' objective; 0: the ELBO).
    learning_rate : float, default=0.01
        Adam's learning rate. The paper uses 1e-3 for tens of thousands of steps;
        1e-2 reaches the same objective in a few hundred to a few thousand.
    max_iter : int, default=5000
        Largest number of Adam steps.
    batch_size : int, default=100
        Rows per minibatch and per forward pass at prediction.
    early_stopping : bool, default=True
        Stop when the training objective (its mean over the ``validation_freq`` steps
        since the last check) has not improved for ``n_iter_no_change`` checks, and
        restore the state of the best check. Held-out rows are never used for this
        (``Q*`` is the regulariser; held-out rows calibrate the noise).
    validation_fraction : float, default=0.1
        Fraction of rows held out from training the network when ``fit`` trains it
        (``net=None`` or an unfitted skorch net); those rows calibrate the noise.
    validation_freq : int, default=100
        Steps between checks of the objective.
    n_iter_no_change : int, default=5
        Checks without improvement before stopping.
    tol : float, default=1e-3
        A check improves on the best one ``b`` when the objective (a per-row loss)
        is lower by more than ``tol * max(1, |b|)``.
    learn_inducing : bool, default=True
        Optimise the inducing inputs (else keep the k-means centres).
    mean_regularizer : bool, default=True
        Add the auxiliary ``Q*`` term (recommended: without it the learned kernel
        can shrink the variance to fit the fixed mean's residuals).
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
    inducing_features_ : None
        ``None`` (the kernels of regression take no network features).
    n_iter_ : int
        Adam steps taken.
    validation_scores_ : list of tuple
        ``(step, objective)`` at each check (the mean minibatch loss since the
        previous check).
    hyper_strategy_ : str
        ``"variational"`` (learned with the variational parameters) or ``"fixed"``.
    hyper_trace_ : dict
        The optimisation history (and ``"calibration"``, the held-out noise search,
        when there was one).
    net_ : object
        The pretrained or trained network.
    linearized_net_ : LinearizedNet
        The frozen functional view of the network (only its forward pass is used).
    jacobian_backend_ : str
        The backend of ``linearized_net_`` (unused by FMGP).
    jacobian_backend_reason_ : str
        Why that backend was chosen.
    validation_source_ : str or None
        Where held-out rows came from, or ``None`` when there were none.
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
    >>> reg = FMGPRegressor(n_inducing=10, random_state=0).fit(X, y)
    >>> mean, std = reg.predict(X[:2], return_std=True)
    >>> std.shape
    (2,)
    """

    _parameter_constraints = {**REGRESSOR_CONSTRAINTS, **_FMGPMixin._fmgp_constraints}

    def __init__(self, net=None, *, kernel="auto", n_inducing=100, prior_variance="auto",
                 noise_variance="auto", alpha=1.0, learning_rate=0.01, max_iter=5000,
                 batch_size=100, early_stopping=True, validation_fraction=0.1,
                 validation_freq=100, n_iter_no_change=5, tol=1e-3, learn_inducing=True,
                 mean_regularizer=True, device="auto", random_state=None,
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
        self.tol = tol
        self.learn_inducing = learn_inducing
        self.mean_regularizer = mean_regularizer
        self.device = device
        self.random_state = random_state
        self.verbose = verbose


class FMGPClassifier(_FMGPMixin, LaplaceClassifierMixin):
    """FMGP classification: a Gaussian process on the logits whose mean is the network.

    The latent mean is the network's logits ``g(x)``; their covariance comes from a
    sparse variational GP with the kernel of the authors' code,
    ``a B_cc' RBF(x, x') (psi(x)^T psi(x') / s + [c = c'])`` (``psi``: the network's
    penultimate features; see :class:`~sklearn_lla.kernels.ClassificationKernel`),
    learned on minibatches with the probit-approximated alpha = 1 energy and the
    auxiliary ``Q*`` regulariser, stopped when the objective stops improving. With
    rows the network did not fit, a temperature of the latent predictive is
    calibrated on them. No Jacobians. See ``docs/fmgp.md``.

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
        The kernel amplitude ``a``: ``"auto"`` learns it (from 1), and a temperature
        is calibrated on held-out rows when there are any; a float fixes it (and no
        temperature is calibrated).
    alpha : float, default=1.0
        The alpha of the energy.
    learning_rate : float, default=0.01
        Adam's learning rate (of the variational factor and ``Q*``'s mean; the
        kernel's hyperparameters train at
        :data:`~sklearn_lla._posteriors.fmgp.KERNEL_LR_SCALE` times it).
    max_iter : int, default=5000
        Largest number of Adam steps.
    batch_size : int, default=100
        Rows per minibatch and per forward pass at prediction.
    early_stopping : bool, default=True
        Stop when the training objective has not improved for ``n_iter_no_change``
        checks (as in :class:`FMGPRegressor`), where a check improves only when it
        also beats the best by more than 10 % of the objective's progress since the
        first check (diminishing returns: on image inputs the kernel's length scales
        grow without bound and the objective creeps down for thousands of steps; see
        ``docs/fmgp.md``); two checks since the best that are lower by ``tol`` but
        not by that margin (the creep) also stop it.
    validation_fraction : float, default=0.1
        Fraction of rows held out from training the network when ``fit`` trains it;
        those rows calibrate the temperature.
    validation_freq : int, default=100
        Steps between checks of the objective.
    n_iter_no_change : int, default=5
        Checks without improvement before stopping.
    tol : float, default=1e-3
        A check improves on the best one ``b`` when the objective (a per-row loss)
        is lower by more than ``tol * max(1, |b|)``.
    learn_inducing : bool, default=False
        Optimise the inducing pairs (inputs and their features ``psi_m``; the
        thesis'). Off by default: the per-class k-means inputs and their features
        are kept, which on the digits CNN and on MLPs (digits, breast cancer)
        measured a lower test NLL and ECE at fewer steps than learning them, which
        lowers the training objective but fits the rows the network already fits
        (``docs/fmgp.md``).
    mean_regularizer : bool, default=True
        Add the auxiliary ``Q*`` term.
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
    inducing_features_ : ndarray of shape (M, F) or None
        The learned penultimate features ``psi_m`` of the inducing points
        (``ClassificationKernel(inducing_features="free")``, the default); ``None``
        when they are ``psi(inducing_inputs_)``.
    n_iter_ : int
        Adam steps taken.
    validation_scores_ : list of tuple
        ``(step, objective)`` at each check.
    temperature_ : float
        The temperature calibrated on held-out rows (1 without them).
    covariance_scale_ : float
        Scale of the latent covariance calibrated on held-out rows (1.0 unless the
        temperature alone left their NLL above the network's own; see
        :func:`~sklearn_lla._core.calibration.calibrate_classification`).
    hyper_strategy_ : str
        ``"variational"`` or ``"fixed"``.
    hyper_trace_ : dict
        The optimisation history (and ``"calibration"``, the temperature search).
    net_ : object
        The pretrained or trained network.
    linearized_net_ : LinearizedNet
        The frozen functional view of the network (only its forward pass is used).
    jacobian_backend_ : str
        The backend of ``linearized_net_`` (unused by FMGP).
    jacobian_backend_reason_ : str
        Why that backend was chosen.
    validation_source_ : str or None
        Where held-out rows came from, or ``None`` when there were none.
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
    >>> clf = FMGPClassifier(n_inducing=9, random_state=0).fit(X, y)
    >>> clf.predict_proba(X[:2]).shape
    (2, 3)
    """

    _parameter_constraints = {**CLASSIFIER_CONSTRAINTS, **_FMGPMixin._fmgp_constraints,
                              "penultimate_layer": [str, None]}

    def _proba(self, x, mean, cov):
        # The link (probit, tempered) is a few operations on (batch, classes) arrays: on
        # FIT_THREADS torch thread(s), as the posterior's predictive itself.
        with torch_threads(FIT_THREADS):
            return super()._proba(x, mean, cov)

    def __init__(self, net=None, *, kernel="auto", n_inducing=100, prior_variance="auto",
                 alpha=1.0, learning_rate=0.01, max_iter=5000, batch_size=100,
                 early_stopping=True, validation_fraction=0.1, validation_freq=100,
                 n_iter_no_change=5, tol=1e-3, learn_inducing=False, mean_regularizer=True,
                 penultimate_layer=None, link_approx="probit",
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
        self.tol = tol
        self.learn_inducing = learn_inducing
        self.mean_regularizer = mean_regularizer
        self.penultimate_layer = penultimate_layer
        self.link_approx = link_approx
        self.n_samples_predict = n_samples_predict
        self.classes = classes
        self.device = device
        self.random_state = random_state
        self.verbose = verbose

