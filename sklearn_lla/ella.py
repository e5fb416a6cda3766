"""``ELLARegressor`` and ``ELLAClassifier``: Nystrom-accelerated linearized Laplace.

The scikit-learn estimators; the Nystrom features and their posterior are in
:mod:`sklearn_lla._posteriors.ella`.
"""
from __future__ import annotations

from numbers import Integral

from sklearn.utils._param_validation import Interval, StrOptions

from ._base import (
    CLASSIFIER_CONSTRAINTS,
    GLM_STRATEGY_CONSTRAINTS,
    LINEARIZED_CONSTRAINTS,
    REGRESSOR_CONSTRAINTS,
    LaplaceClassifierMixin,
    LaplaceRegressorMixin,
)
from ._posteriors.ella import NystromFeatures
from ._posteriors.glm import GLMPosterior

__all__ = ["ELLARegressor", "ELLAClassifier"]



class _ELLAMixin:
    """ELLA's parameters and posterior, shared by the regressor and the classifier."""

    _ella_constraints = {
        **LINEARIZED_CONSTRAINTS,
        **GLM_STRATEGY_CONSTRAINTS,
        "n_nystrom": [Interval(Integral, 1, None, closed="left")],
        "n_components": [Interval(Integral, 1, None, closed="left"), StrOptions({"auto"})],
        "early_stopping": ["boolean"],
        "search_freq": [Interval(Integral, 1, None, closed="left")],
        "n_iter_no_change": [Interval(Integral, 1, None, closed="left")],
        "residual_correction": ["boolean", StrOptions({"kfac"})],
    }

    def _make_posterior(self, data):
        regression = data.likelihood.task == "regression"
        noise = self.noise_variance if regression else None
        return GLMPosterior(NystromFeatures(self.n_nystrom, self.n_components),
                            self.prior_variance, noise, hyper=self.hyper_strategy,
                            early_stopping=self.early_stopping,
                            search_freq=self.search_freq, n_iter_no_change=self.n_iter_no_change,
                            residual_correction=self.residual_correction, label="ELLA")

    def _store_fitted(self, posterior):
        self.n_components_ = posterior.features.dim
        self.residual_correction_ = posterior.residual_correction
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
        number of linearised parameters; ``docs/ella.md`` gives typical values).
    prior_variance : float or "auto", default="auto"
        ``s0^2``. ``"auto"``: the Laplace evidence of the network's linearised model
        over the Nystrom spectrum (with all pairs and components it is exact LLA's
        choice); never chosen on held-out rows unless ``hyper_strategy="validation"``.
    noise_variance : float or "auto", default="auto"
        ``s2``. ``"auto"``: with held-out rows the network did not fit
        (``validation_data``, rows held out when ``fit`` trains the net, or a skorch
        net's own validation split) the evidence's pair ``(s0^2, s2)`` rescaled to
        ``(c s0^2, c s2)``, ``c`` the held-out NLL's minimiser (the posterior is ``c``
        times the evidence's: its shape is kept); without them the evidence, jointly
        with the prior.
    hyper_strategy : {"auto", "evidence", "validation", "weight_norm"}, default="auto"
        The objective of ``"auto"`` prior variances: ``"auto"`` and ``"evidence"``
        the Laplace evidence, ``"weight_norm"`` ``||theta||^2 / P``;
        ``"validation"`` chooses both variances jointly on a held-out grid (it can
        end at the raw network, with a warning).
    early_stopping : bool, default=False
        Stream the training data in random order, evaluate the held-out NLL every
        ``search_freq`` points (prior term ``(n_seen / N) I / s0^2``, hyperparameters
        as above) and keep the best state (the paper's remedy for LLA's
        over-concentration at large N). Needs rows the network did not fit.
    validation_fraction : float, default=0.1
        Fraction of the rows held out from training when ``fit`` trains the network
        and no ``validation_data`` is given.
    search_freq : int, default=1000
        Training points between validation evaluations.
    n_iter_no_change : int, default=5
        Evaluations without improvement before the stream stops.
    residual_correction : bool or "kfac", default="kfac"
        The posterior of the parameter directions outside ``span(V)``. ``"kfac"``: a
        KFAC (Kronecker-factored GGN) posterior projected on them,
        ``j_perp^T Sigma_KFAC j_perp``: at large ``N`` the top-``K`` Nystrom
        directions are those the data pin down and most of exact LLA's epistemic
        variance lies outside them (measured in ``docs/ella.md``); on the structured
        (``nn.Linear`` chains) and graph (convolutional / residual nets; BatchNorm's
        parameters get a diagonal block) Jacobian backends, networks on the generic
        one fall back to ``False``. ``True``: the prior variance,
        ``s0^2 (k(x,x) - phi(x) phi(x)^T)`` (full-rank ELLA then equals exact LLA at
        every input; at large ``N`` it overshoots). ``False``: none (the paper's,
        formerly the default).
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
    residual_correction_ : bool or "kfac"
        The posterior outside ``span(V)`` in use (``"kfac"`` falls back to ``False``
        on the generic ``torch.func`` Jacobian backend).
    n_seen_ : int
        Training points accumulated (fewer than N after early stopping).
    validation_scores_ : list of tuple
        ``(n_seen, validation NLL)`` at each early-stopping check.
    hyper_strategy_ : str
        The objective of the ``"auto"`` values (``"evidence"``, ``"validation"`` or
        ``"fixed"``).
    hyper_trace_ : dict
        Candidates tried and their scores; ``"calibration"`` holds the search of the
        noise variance on held-out rows, when there was one.
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
                 search_freq=1000, n_iter_no_change=5, residual_correction="kfac",
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
        ``s0^2``. ``"auto"``: chosen by ``hyper_strategy``'s objective, never on
        held-out rows unless ``hyper_strategy="validation"``. With ``"auto"`` and
        held-out rows the network did not fit, a temperature of the latent predictive
        is also calibrated on them (``temperature_``), kept only if it lowers their
        NLL out of fold and never sharper than the network.
    hyper_strategy : {"auto", "evidence", "validation", "weight_norm"}, default="auto"
        The objective of an ``"auto"`` prior variance: ``"auto"`` and
        ``"weight_norm"`` ``||theta||^2 / P`` (as exact LLA's classifier: the
        evidence of a net that fits its training labels picks priors that wreck
        calibration), ``"evidence"`` the Laplace evidence; ``"validation"`` a
        held-out grid (it can end at the raw network, with a warning).
    early_stopping : bool, default=False
        Early stopping of the training stream on the held-out NLL (needs rows the
        network did not fit).
    validation_fraction : float, default=0.1
        Fraction of the rows held out from training when ``fit`` trains the network
        and no ``validation_data`` is given.
    search_freq : int, default=1000
        Training points between validation evaluations.
    n_iter_no_change : int, default=5
        Evaluations without improvement before the stream stops.
    residual_correction : bool or "kfac", default="kfac"
        The posterior outside ``span(V)``: ``"kfac"`` a projected KFAC posterior,
        ``True`` the prior variance, ``False`` none (see :class:`ELLARegressor`).
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
    residual_correction_ : bool or "kfac"
        The posterior outside ``span(V)`` in use.
    n_seen_ : int
        Training points accumulated.
    validation_scores_ : list of tuple
        ``(n_seen, validation NLL)`` at each early-stopping check.
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
                 n_iter_no_change=5, residual_correction="kfac", link_approx="probit",
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
