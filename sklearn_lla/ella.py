"""``ELLARegressor`` and ``ELLAClassifier``: Nystrom-accelerated linearized Laplace.

The scikit-learn estimators; the Nystrom features and their posterior are in
:mod:`sklearn_lla._posteriors.ella`.
"""
from __future__ import annotations

from numbers import Integral, Real

from sklearn.utils._param_validation import Interval, StrOptions

from ._base import (
    CLASSIFIER_CONSTRAINTS,
    REGRESSOR_CONSTRAINTS,
    LaplaceClassifierMixin,
    LaplaceRegressorMixin,
)
from ._core.protocol import carve_validation
from ._posteriors.ella import NystromFeatures
from ._posteriors.glm import GLMPosterior

__all__ = ["ELLARegressor", "ELLAClassifier"]



class _ELLAMixin:
    """ELLA's parameters and posterior, shared by the regressor and the classifier."""

    _ella_constraints = {
        "n_nystrom": [Interval(Integral, 1, None, closed="left")],
        "n_components": [Interval(Integral, 1, None, closed="left"), StrOptions({"auto"})],
        "early_stopping": ["boolean"],
        "search_freq": [Interval(Integral, 1, None, closed="left")],
        "n_iter_no_change": [Interval(Integral, 1, None, closed="left")],
        "residual_correction": ["boolean"],
        "validation_fraction": [Interval(Real, 0, 1, closed="neither")],
    }

    def _make_posterior(self, data):
        noise = self.noise_variance if data.likelihood.task == "regression" else None
        if self.early_stopping and data.validation is None:
            data.validation = carve_validation(data, self.validation_fraction)
        return GLMPosterior(NystromFeatures(self.n_nystrom, self.n_components),
                            self.prior_variance, noise, hyper=self.hyper_strategy,
                            early_stopping=self.early_stopping,
                            search_freq=self.search_freq, n_iter_no_change=self.n_iter_no_change,
                            residual_correction=self.residual_correction, label="ELLA")

    def _store_fitted(self, posterior):
        self.n_components_ = posterior.features.dim
        self.n_seen_ = posterior.n_seen
        self.validation_scores_ = list(posterior.history)
        super()._store_fitted(posterior)


class ELLARegressor(_ELLAMixin, LaplaceRegressorMixin):
    """ELLA regression: Nystrom-accelerated linearized Laplace.

    Parameters
    ----------
    net : None, skorch net, FrozenEstimator or torch.nn.Module, default=None
        The network. ``None`` trains a small tanh MLP (MAP, weight decay) in ``fit``;
        a fitted skorch net, ``FrozenEstimator(net)`` or an ``nn.Module`` is used as it
        is and never modified; an unfitted skorch net is trained in ``fit``.
    n_nystrom : int, default=2000
        ``M``, the number of (point, output) pairs of the Nystrom approximation (all
        ``N * n_targets`` pairs when larger).
    n_components : int or "auto", default="auto"
        ``K``, the number of eigenpairs kept. ``"auto"``: every numerically positive
        eigenvalue of the Nystrom Gram, at most ``max(20, 2**21 // P)`` (each
        component costs ``P`` multiply-adds per row at fit and predict; ``P`` is the
        number of linearised parameters): 25 for a 3 x 200 MLP on 8 inputs.
    prior_variance : float or "auto", default="auto"
        ``s0^2``. ``"auto"``: validation NLL over a log grid when validation data is
        available, otherwise the Laplace evidence of the subspace model.
    noise_variance : float or "auto", default="auto"
        ``s2``, chosen jointly with ``prior_variance``.
    hyper_strategy : {"auto", "evidence", "validation", "weight_norm"}, default="auto"
        How ``"auto"`` variances are chosen: ``"validation"`` (validation NLL on
        held-out rows the network did not fit), ``"evidence"`` (Laplace marginal
        likelihood) or ``"weight_norm"`` (``||theta||^2 / P``). ``"auto"`` uses
        ``"validation"`` when held-out rows exist (``validation_data``, rows held out
        from training a network in ``fit``, or a skorch net's own validation split)
        and the evidence otherwise.
    early_stopping : bool, default=False
        Stream the training data in random order, evaluate the validation NLL every
        ``search_freq`` points with prior term ``(n_seen / N) I / s0^2`` and keep the
        best state (the paper's remedy for LLA's over-concentration at large N).
    validation_fraction : float, default=0.1
        Fraction of rows held out when validation is needed (early stopping, or a
        network trained in ``fit``) and no ``validation_data`` is given.
    search_freq : int, default=1000
        Training points between validation evaluations.
    n_iter_no_change : int, default=5
        Evaluations without improvement before the stream stops.
    residual_correction : bool, default=False
        Add back the prior variance ELLA drops outside ``span(V)``,
        ``s0^2 (k(x,x) - phi(x) phi(x)^T)``: full-rank ELLA then equals exact LLA at
        every input. Off by default (see ``docs/ella.md``).
    trainable_only : bool, default=True
        Linearise only parameters with ``requires_grad=True``.
    device : str or torch.device, default="auto"
        ``"auto"`` (CUDA when available), ``"cpu"``, ``"cuda"`` or a torch device.
    batch_size : int, default=256
        Rows per forward pass (training stream and prediction).
    random_state : int, RandomState instance or None, default=None
        Seeds the Nystrom pairs, hold-outs, the stream order and net training.
    verbose : int or bool, default=0
        ``>= 1`` shows progress bars on long passes.

    Attributes
    ----------
    prior_variance_ : float
        Prior variance in use.
    noise_variance_ : float
        Noise variance in use.
    n_components_ : int
        Eigenpairs kept.
    n_seen_ : int
        Training points accumulated (fewer than N after early stopping).
    validation_scores_ : list of tuple
        ``(n_seen, validation NLL)`` at each early-stopping check.
    hyper_strategy_ : str
        How ``"auto"`` values were chosen.
    hyper_trace_ : dict
        Candidates tried and their scores.
    net_ : object
        The pretrained or trained network.
    linearized_net_ : LinearizedNet
        The frozen functional view of the network.
    jacobian_backend_ : str
        ``"structured"`` or ``"functorch"``.
    jacobian_backend_reason_ : str
        Why that backend was chosen.
    validation_source_ : str or None
        Where the held-out rows came from (``"validation_data"``, rows held out from
        training the network, the skorch net's own validation split), or ``None``.
    likelihood_ : Gaussian
        The fitted likelihood.
    posterior_ : GLMPosterior
        The fitted posterior.
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
    >>> from sklearn_lla import ELLARegressor
    >>> rng = np.random.RandomState(0)
    >>> X = rng.uniform(-2, 2, (200, 1))
    >>> y = np.sin(2 * X[:, 0]) + 0.1 * rng.randn(200)
    >>> reg = ELLARegressor(n_nystrom=100, random_state=0).fit(X, y)
    >>> mean, std = reg.predict(X[:2], return_std=True)
    >>> std.shape
    (2,)
    """

    _parameter_constraints = {**REGRESSOR_CONSTRAINTS, **_ELLAMixin._ella_constraints}

    def __init__(self, net=None, *, n_nystrom=2000, n_components="auto", prior_variance="auto",
                 noise_variance="auto", hyper_strategy="auto", early_stopping=False,
                 validation_fraction=0.1,
                 search_freq=1000, n_iter_no_change=5, residual_correction=False,
                 trainable_only=True, device="auto", batch_size=256, random_state=None,
                 verbose=0):
        self.net = net
        self.n_nystrom = n_nystrom
        self.n_components = n_components
        self.prior_variance = prior_variance
        self.noise_variance = noise_variance
        self.hyper_strategy = hyper_strategy
        self.early_stopping = early_stopping
        self.validation_fraction = validation_fraction
        self.search_freq = search_freq
        self.n_iter_no_change = n_iter_no_change
        self.residual_correction = residual_correction
        self.trainable_only = trainable_only
        self.device = device
        self.batch_size = batch_size
        self.random_state = random_state
        self.verbose = verbose


class ELLAClassifier(_ELLAMixin, LaplaceClassifierMixin):
    """ELLA classification: Nystrom-accelerated linearized Laplace.

    Parameters
    ----------
    net : None, skorch net, FrozenEstimator or torch.nn.Module, default=None
        The network. ``None`` trains a small tanh MLP (MAP, weight decay) in ``fit``;
        a fitted skorch net, ``FrozenEstimator(net)`` or an ``nn.Module`` is used as it
        is and never modified; an unfitted skorch net is trained in ``fit``.
    n_nystrom : int, default=2000
        ``M``, the number of (point, class) pairs.
    n_components : int or "auto", default="auto"
        ``K``; ``"auto"`` as in :class:`ELLARegressor`.
    prior_variance : float or "auto", default="auto"
        ``s0^2``. ``"auto"``: validation NLL when validation data is available,
        otherwise the Laplace evidence of the subspace model.
    hyper_strategy : {"auto", "evidence", "validation", "weight_norm"}, default="auto"
        How an ``"auto"`` prior variance is chosen: ``"validation"`` (validation NLL on
        held-out rows the network did not fit), ``"evidence"`` (Laplace marginal
        likelihood) or ``"weight_norm"`` (``||theta||^2 / P``). ``"auto"`` uses
        ``"validation"`` when held-out rows exist (``validation_data``, rows held out
        from training a network in ``fit``, or a skorch net's own validation split)
        and the evidence otherwise.
    early_stopping : bool, default=False
        Early stopping of the training stream on validation NLL.
    validation_fraction : float, default=0.1
        Fraction of rows held out when validation is needed and not given.
    search_freq : int, default=1000
        Training points between validation evaluations.
    n_iter_no_change : int, default=5
        Evaluations without improvement before the stream stops.
    residual_correction : bool, default=False
        Add back the prior variance outside ``span(V)``.
    link_approx : {"probit", "mc", "bridge"}, default="probit"
        Approximation of ``E softmax(f)``; the paper uses ``"mc"`` with 512 samples.
    n_samples_predict : int, default=512
        Samples per point for ``link_approx="mc"``.
    classes : array-like or None, default=None
        The label of each network output, in output order (see
        :class:`~sklearn_lla.LLAClassifier`).
    trainable_only : bool, default=True
        Linearise only parameters with ``requires_grad=True``.
    device : str or torch.device, default="auto"
        ``"auto"`` (CUDA when available), ``"cpu"``, ``"cuda"`` or a torch device.
    batch_size : int, default=256
        Rows per forward pass.
    random_state : int, RandomState instance or None, default=None
        Seeds the pairs, hold-outs, stream order, net training and ``mc`` draws.
    verbose : int or bool, default=0
        ``>= 1`` shows progress bars on long passes.

    Attributes
    ----------
    classes_ : ndarray
        Class labels, in the order of ``predict_proba``'s columns.
    prior_variance_ : float
        Prior variance in use.
    n_components_ : int
        Eigenpairs kept.
    n_seen_ : int
        Training points accumulated.
    validation_scores_ : list of tuple
        ``(n_seen, validation NLL)`` at each early-stopping check.
    hyper_strategy_ : str
        How ``"auto"`` values were chosen.
    hyper_trace_ : dict
        Candidates tried and their scores.
    net_ : object
        The pretrained or trained network.
    linearized_net_ : LinearizedNet
        The frozen functional view of the network.
    jacobian_backend_ : str
        ``"structured"`` or ``"functorch"``.
    jacobian_backend_reason_ : str
        Why that backend was chosen.
    validation_source_ : str or None
        Where the held-out rows came from (``"validation_data"``, rows held out from
        training the network, the skorch net's own validation split), or ``None``.
    likelihood_ : Categorical or Bernoulli
        The likelihood.
    posterior_ : GLMPosterior
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
    >>> from sklearn_lla import ELLAClassifier
    >>> X, y = make_blobs(n_samples=120, centers=3, random_state=0)
    >>> clf = ELLAClassifier(n_nystrom=100, random_state=0).fit(X, y)
    >>> clf.predict_proba(X[:2]).shape
    (2, 3)
    """

    _parameter_constraints = {**CLASSIFIER_CONSTRAINTS, **_ELLAMixin._ella_constraints}

    def __init__(self, net=None, *, n_nystrom=2000, n_components="auto", prior_variance="auto",
                 hyper_strategy="auto", early_stopping=False, validation_fraction=0.1,
                 search_freq=1000,
                 n_iter_no_change=5, residual_correction=False, link_approx="probit",
                 n_samples_predict=512, classes=None, trainable_only=True, device="auto",
                 batch_size=256, random_state=None, verbose=0):
        self.net = net
        self.n_nystrom = n_nystrom
        self.n_components = n_components
        self.prior_variance = prior_variance
        self.hyper_strategy = hyper_strategy
        self.early_stopping = early_stopping
        self.validation_fraction = validation_fraction
        self.search_freq = search_freq
        self.n_iter_no_change = n_iter_no_change
        self.residual_correction = residual_correction
        self.link_approx = link_approx
        self.n_samples_predict = n_samples_predict
        self.classes = classes
        self.trainable_only = trainable_only
        self.device = device
        self.batch_size = batch_size
        self.random_state = random_state
        self.verbose = verbose
