"""``LLARegressor`` and ``LLAClassifier``: exact linearized Laplace, the reference.

The scikit-learn estimators; the posteriors (parameter space, function space, last
layer) are in :mod:`sklearn_lla._posteriors.exact` and
:mod:`sklearn_lla._posteriors.glm`.
"""
from __future__ import annotations

from sklearn.utils._param_validation import StrOptions

from ._base import (
    CLASSIFIER_CONSTRAINTS,
    GLM_STRATEGY_CONSTRAINTS,
    LINEARIZED_CONSTRAINTS,
    REGRESSOR_CONSTRAINTS,
    LaplaceClassifierMixin,
    LaplaceRegressorMixin,
)
from ._posteriors.exact import FunctionSpacePosterior, _choose_space
from ._posteriors.glm import GLMPosterior, JacobianFeatures

__all__ = ["LLARegressor", "LLAClassifier"]



class _LLAMixin:
    """The exact-LLA part shared by :class:`LLARegressor` and :class:`LLAClassifier`."""

    _lla_constraints = {
        **LINEARIZED_CONSTRAINTS,
        **GLM_STRATEGY_CONSTRAINTS,
        "space": [StrOptions({"auto", "parameter", "function"})],
        "subset_of_weights": [StrOptions({"all", "last_layer"})],
    }

    def _linearize_kwargs(self, module, X, device):
        if self.subset_of_weights != "last_layer":
            return {}
        from ._core.protocol import to_batch
        from ._core.utils import module_dtype
        from ._network.resolve import last_layer_param_names

        example = to_batch(X, slice(0, min(len(X), 8)), module_dtype(module), device)
        return {"param_names": last_layer_param_names(module, example)}

    def _make_posterior(self, data):
        regression = data.likelihood.task == "regression"
        noise = self.noise_variance if regression else None
        space = _choose_space(self.space, data.lin.n_params, data.n_samples * data.n_outputs)
        if space == "function":
            post = FunctionSpacePosterior(self.prior_variance, noise, self.hyper_strategy)
        else:
            post = GLMPosterior(JacobianFeatures(), self.prior_variance, noise,
                                hyper=self.hyper_strategy)
        post.space = space
        return post

    def _store_fitted(self, posterior):
        self.space_ = posterior.space
        self.log_marginal_likelihood_ = posterior.log_evidence
        super()._store_fitted(posterior)


class LLARegressor(_LLAMixin, LaplaceRegressorMixin):
    """Exact linearized Laplace regression (GGN, float64 dense algebra).

    The reference implementation for small problems (``min(P, N * n_targets)`` up to
    10,000): every approximate method is tested against it. With
    ``subset_of_weights="last_layer"`` only the last layer is linearised (the other
    weights held fixed), which scales to any ``N`` and is a cheap baseline.

    Parameters
    ----------
    net : None, skorch net, FrozenEstimator or torch.nn.Module, default=None
        The network. ``None`` trains a small tanh MLP (MAP, weight decay) in ``fit``;
        a fitted skorch net, ``FrozenEstimator(net)`` or an ``nn.Module`` is used as it
        is and never modified; an unfitted skorch net is trained in ``fit``.
    prior_variance : float or "auto", default="auto"
        ``s0^2`` of the isotropic Gaussian prior on the linearised weights.
        ``"auto"``: the Laplace log marginal likelihood (evidence) of the linearised
        model; never chosen on held-out rows unless ``hyper_strategy="validation"``.
    noise_variance : float or "auto", default="auto"
        ``s2`` of the Gaussian likelihood, one variance shared by all targets.
        ``"auto"``: with held-out rows the network did not fit (``validation_data``,
        rows held out when ``fit`` trains the net, or a skorch net's own validation
        split) the evidence's pair ``(s0^2, s2)`` rescaled to ``(c s0^2, c s2)``,
        ``c`` the held-out NLL's minimiser (the posterior at the rescaled pair is ``c``
        times the evidence's, so its shape is kept); without them, the evidence
        jointly with the prior.
    hyper_strategy : {"auto", "evidence", "validation", "weight_norm"}, default="auto"
        The objective of ``"auto"`` prior variances: ``"auto"`` and ``"evidence"``
        the Laplace evidence, ``"weight_norm"`` ``||theta||^2 / P``;
        ``"validation"`` chooses both variances jointly on a held-out grid (it can
        end at the raw network, with a warning; see docs/hyperparameters.md).
    space : {"auto", "parameter", "function"}, default="auto"
        Where to form the dense posterior: ``P x P`` (parameter) or ``NC x NC``
        (function). ``"auto"`` takes the smaller.
    subset_of_weights : {"all", "last_layer"}, default="all"
        Linearise every trainable parameter, or only those of the last layer (the
        last module with parameters that runs in the forward pass).
    validation_fraction : float, default=0.1
        Fraction of the rows held out from training when ``fit`` trains the network
        (``net=None`` or an unfitted skorch net) and no ``validation_data`` is given;
        those rows calibrate an ``"auto"`` noise variance.
    trainable_only : bool, default=True
        Linearise only parameters with ``requires_grad=True`` (frozen ones are held
        fixed, as in laplace-torch); ``False`` linearises every parameter.
    device : str or torch.device, default="auto"
        ``"auto"`` (CUDA when available), ``"cpu"``, ``"cuda"`` or a torch device.
    batch_size : int, default=256
        Rows per batch when streaming data through the network.
    random_state : int, RandomState instance or None, default=None
        Seeds the training of a default or unfitted net and the hold-out split.
    verbose : int or bool, default=0
        ``>= 1`` shows progress bars on long passes.

    Attributes
    ----------
    prior_variance_ : float
        Prior variance in use.
    noise_variance_ : float
        Noise variance in use.
    hyper_strategy_ : str
        The objective of the ``"auto"`` values (``"evidence"``, ``"weight_norm"``,
        ``"validation"`` or ``"fixed"``).
    hyper_trace_ : dict
        Candidates tried and their scores; ``"calibration"`` holds the search of the
        noise variance on held-out rows, when there was one.
    log_marginal_likelihood_ : float or None
        Laplace evidence at the chosen hyperparameters (when computed).
    space_ : str
        The space actually used.
    net_ : object
        The pretrained or trained network.
    linearized_net_ : LinearizedNet
        The frozen functional view of the network.
    jacobian_backend_ : str
        ``"structured"``, ``"graph"`` or ``"functorch"``.
    jacobian_backend_reason_ : str
        Why that backend was chosen.
    validation_source_ : str or None
        Where the held-out rows came from (``"validation_data"``, rows held out from
        training the network, the skorch net's own validation split), or ``None``.
    conformal_scores_ : ndarray of shape (n_cal,) or (n_cal, n_targets)
        Sorted split-conformal scores ``|y - mean| / std`` of the held-out rows (set by
        ``fit`` when it had held-out rows, or by :meth:`conformalize`); used by
        :meth:`predict_interval`. Absent when the estimator is not calibrated.
    conformal_n_ : int
        Number of calibration rows.
    conformal_source_ : str
        Where they came from: ``validation_source_`` of ``fit``, or ``"conformalize"``.
    likelihood_ : Gaussian
        The fitted likelihood.
    posterior_ : Posterior
        The fitted posterior.
    n_outputs_ : int
        Number of network outputs.
    n_features_in_ : int
        Number of input features.
    feature_names_in_ : ndarray of shape (n_features_in_,)
        Feature names, when ``X`` has string column names.

    See Also
    --------
    ELLARegressor : Nystrom-accelerated LLA for large problems.

    Examples
    --------
    >>> import numpy as np
    >>> from sklearn_lla import LLARegressor
    >>> rng = np.random.RandomState(0)
    >>> X = rng.uniform(-2, 2, (60, 1))
    >>> y = np.sin(2 * X[:, 0]) + 0.1 * rng.randn(60)
    >>> reg = LLARegressor(random_state=0).fit(X, y)
    >>> mean, std = reg.predict(X[:3], return_std=True)
    >>> mean.shape, std.shape
    ((3,), (3,))
    """

    _parameter_constraints = {**REGRESSOR_CONSTRAINTS, **_LLAMixin._lla_constraints}

    def __init__(self, net=None, *, prior_variance="auto", noise_variance="auto",
                 hyper_strategy="auto", space="auto", subset_of_weights="all",
                 validation_fraction=0.1, trainable_only=True, device="auto", batch_size=256,
                 random_state=None, verbose=0):
        self.net = net
        self.prior_variance = prior_variance
        self.noise_variance = noise_variance
        self.hyper_strategy = hyper_strategy
        self.space = space
        self.subset_of_weights = subset_of_weights
        self.validation_fraction = validation_fraction
        self.trainable_only = trainable_only
        self.device = device
        self.batch_size = batch_size
        self.random_state = random_state
        self.verbose = verbose


class LLAClassifier(_LLAMixin, LaplaceClassifierMixin):
    """Exact linearized Laplace classification (GGN, float64 dense algebra).

    Works for C-logit nets (categorical likelihood) and one-logit binary nets
    (Bernoulli likelihood, e.g. skorch's ``NeuralNetBinaryClassifier``).

    Parameters
    ----------
    net : None, skorch net, FrozenEstimator or torch.nn.Module, default=None
        The network. ``None`` trains a small tanh MLP (MAP, weight decay) in ``fit``;
        a fitted skorch net, ``FrozenEstimator(net)`` or an ``nn.Module`` is used as it
        is and never modified; an unfitted skorch net is trained in ``fit``.
    prior_variance : float or "auto", default="auto"
        ``s0^2`` of the isotropic Gaussian prior. ``"auto"``: chosen by
        ``hyper_strategy``'s objective, never on held-out rows unless
        ``hyper_strategy="validation"``. With ``"auto"`` and held-out rows the
        network did not fit (``validation_data``, rows held out when ``fit`` trains
        the net, or a skorch net's own validation split), a temperature of the
        latent predictive is also calibrated on them (``temperature_``), kept only
        if it lowers their NLL out of fold and never sharper than the network.
    hyper_strategy : {"auto", "evidence", "validation", "weight_norm"}, default="auto"
        The objective of an ``"auto"`` prior variance: ``"auto"`` and
        ``"weight_norm"`` ``||theta||^2 / P`` over the linearised parameters (the
        Laplace evidence of a net that fits its training labels was measured to wreck
        calibration, full network and last layer alike), ``"evidence"`` the Laplace
        marginal likelihood; ``"validation"`` chooses the prior on a held-out grid (it
        can end at the raw network, with a warning).
    space : {"auto", "parameter", "function"}, default="auto"
        Where to form the dense posterior (``"auto"`` takes the smaller).
    subset_of_weights : {"all", "last_layer"}, default="all"
        Linearise every trainable parameter, or only the last layer's.
    link_approx : {"probit", "mc", "bridge"}, default="probit"
        Approximation of ``E softmax(f)`` under the Gaussian latent.
    n_samples_predict : int, default=512
        Samples per point for ``link_approx="mc"``.
    classes : array-like or None, default=None
        The label of each network output, in output order (for a one-logit net:
        ``[negative, positive]``). ``None``: a pretrained skorch classifier's
        ``classes_``, else the output indices ``0..C-1``; a net trained in ``fit``
        uses the sorted labels of ``y``.
    validation_fraction : float, default=0.1
        Fraction of the rows held out from training when ``fit`` trains the network
        and no ``validation_data`` is given; those rows calibrate the temperature.
    trainable_only : bool, default=True
        Linearise only parameters with ``requires_grad=True``.
    device : str or torch.device, default="auto"
        ``"auto"`` (CUDA when available), ``"cpu"``, ``"cuda"`` or a torch device.
    batch_size : int, default=256
        Rows per batch when streaming data through the network.
    random_state : int, RandomState instance or None, default=None
        Seeds training of a default or unfitted net, the hold-out and ``mc`` draws.
    verbose : int or bool, default=0
        ``>= 1`` shows progress bars on long passes.

    Attributes
    ----------
    classes_ : ndarray
        Class labels, in the order of ``predict_proba``'s columns.
    prior_variance_ : float
        Prior variance in use.
    hyper_strategy_ : str
        The objective of the ``"auto"`` prior variance (``"evidence"``,
        ``"weight_norm"``, ``"validation"`` or ``"fixed"``).
    hyper_trace_ : dict
        Candidates tried and their scores; ``"calibration"`` holds the temperature
        search on held-out rows, when there was one.
    temperature_ : float
        Temperature of the latent predictive calibrated on held-out rows (1.0 when
        there were none, or when it did not help out of fold).
    covariance_scale_ : float
        Scale of the latent covariance calibrated on held-out rows (1.0 unless the
        temperature alone left their NLL above the network's own; see
        :func:`~sklearn_lla._core.calibration.calibrate_classification`).
    log_marginal_likelihood_ : float or None
        Laplace evidence at the chosen prior variance (when computed).
    space_ : str
        The space actually used.
    net_ : object
        The pretrained or trained network.
    linearized_net_ : LinearizedNet
        The frozen functional view of the network.
    jacobian_backend_ : str
        ``"structured"``, ``"graph"`` or ``"functorch"``.
    jacobian_backend_reason_ : str
        Why that backend was chosen.
    validation_source_ : str or None
        Where the held-out rows came from (``"validation_data"``, rows held out from
        training the network, the skorch net's own validation split), or ``None``.
    conformal_scores_ : dict of str to ndarray of shape (n_cal,)
        Sorted split-conformal scores of the true labels (a dict by set
        method) of the held-out rows (set by
        ``fit`` when it had held-out rows, or by :meth:`conformalize`); used by
        :meth:`predict_set`. Absent when the estimator is not calibrated.
    conformal_n_ : int
        Number of calibration rows.
    conformal_source_ : str
        Where they came from: ``validation_source_`` of ``fit``, or ``"conformalize"``.
    likelihood_ : Categorical or Bernoulli
        The likelihood.
    posterior_ : Posterior
        The fitted posterior.
    n_outputs_ : int
        Number of network outputs (1 for a one-logit binary net).
    n_features_in_ : int
        Number of input features.
    feature_names_in_ : ndarray of shape (n_features_in_,)
        Feature names, when ``X`` has string column names.

    See Also
    --------
    ELLAClassifier : Nystrom-accelerated LLA for large problems.

    Examples
    --------
    >>> from sklearn.datasets import make_blobs
    >>> from sklearn_lla import LLAClassifier
    >>> X, y = make_blobs(n_samples=90, centers=3, random_state=0)
    >>> clf = LLAClassifier(random_state=0).fit(X, y)
    >>> clf.predict_proba(X[:2]).shape
    (2, 3)
    """

    _parameter_constraints = {**CLASSIFIER_CONSTRAINTS, **_LLAMixin._lla_constraints}

    def __init__(self, net=None, *, prior_variance="auto", hyper_strategy="auto", space="auto",
                 subset_of_weights="all", link_approx="probit", n_samples_predict=512,
                 classes=None, validation_fraction=0.1, trainable_only=True, device="auto",
                 batch_size=256, random_state=None, verbose=0):
        self.net = net
        self.prior_variance = prior_variance
        self.hyper_strategy = hyper_strategy
        self.space = space
        self.subset_of_weights = subset_of_weights
        self.link_approx = link_approx
        self.n_samples_predict = n_samples_predict
        self.classes = classes
        self.validation_fraction = validation_fraction
        self.trainable_only = trainable_only
        self.device = device
        self.batch_size = batch_size
        self.random_state = random_state
        self.verbose = verbose
