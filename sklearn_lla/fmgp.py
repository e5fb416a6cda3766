"""``FMGPRegressor`` and ``FMGPClassifier``: fixed-mean Gaussian processes.

The scikit-learn estimators; the posterior is in :mod:`sklearn_lla._posteriors.fmgp`,
on the fixed-mean sparse GP of :mod:`sklearn_lla._posteriors.gp`, with the kernels of
:mod:`sklearn_lla.kernels`.
"""
from __future__ import annotations

from numbers import Integral, Real

import torch
from sklearn.utils._param_validation import HasMethods, Interval, StrOptions

from ._base import (
    _MIN_ROWS_FOR_HOLDOUT,
    CLASSIFIER_CONSTRAINTS,
    REGRESSOR_CONSTRAINTS,
    LaplaceClassifierMixin,
    LaplaceRegressorMixin,
)
from ._core.protocol import carve_validation
from ._posteriors.fmgp import (
    FMGPPosterior,
)
from ._posteriors.kernels import RBF, ClassificationKernel

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

