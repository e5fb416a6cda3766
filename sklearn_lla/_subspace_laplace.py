"""Subspace Laplace's shared estimator parameters and :class:`SubspaceLaplace`.

:class:`SubspaceLaplace` is the paper's one-class interface, whose task follows its
``likelihood`` parameter at run time; it and the task estimators of
:mod:`sklearn_lla.subspace` share :class:`_SubspaceMixin` (the parameters, their
constraints and the posterior). Imported from :mod:`sklearn_lla.subspace`.
"""

from __future__ import annotations

from numbers import Integral, Real

from sklearn.utils._available_if import available_if
from sklearn.utils._param_validation import Interval, StrOptions
from sklearn.utils._tags import ClassifierTags, RegressorTags

from ._base import (
    CLASSIFIER_CONSTRAINTS,
    GLM_STRATEGY_CONSTRAINTS,
    LINEARIZED_CONSTRAINTS,
    REGRESSOR_CONSTRAINTS,
    LaplaceClassifierMixin,
    LaplaceRegressorMixin,
    _LaplaceBase,
)
from ._posteriors.subspace import PROJECTORS, SubspacePosterior

__all__ = ["SubspaceLaplace"]


class _SubspaceMixin:
    """Subspace Laplace's parameters and posterior, shared by the estimators."""

    _subspace_constraints = {
        **LINEARIZED_CONSTRAINTS,
        **GLM_STRATEGY_CONSTRAINTS,
        "projector": [StrOptions(set(PROJECTORS))],
        "subspace_dim": [Interval(Integral, 1, None, closed="left"), StrOptions({"auto"})],
        "residual_correction": ["boolean", StrOptions({"auto", "kfac"})],
        "n_subset": [Interval(Integral, 1, None, closed="left"), StrOptions({"auto"})],
        "subspace_X": ["array-like", None],
        "swag_learning_rate": [Interval(Real, 0, None, closed="neither")],
        "swag_n_steps": [Interval(Integral, 1, None, closed="left")],
    }

    def _make_posterior(self, data):
        regression = data.likelihood.task == "regression"
        noise = self.noise_variance if regression else None
        return SubspacePosterior(self.projector, self.subspace_dim, self.prior_variance, noise,
                                 hyper=self.hyper_strategy, n_subset=self.n_subset,
                                 subspace_X=self.subspace_X,
                                 swag_learning_rate=self.swag_learning_rate,
                                 swag_n_steps=self.swag_n_steps,
                                 residual_correction=self.residual_correction)

    def _store_fitted(self, posterior):
        self.subspace_dim_ = int(posterior.features.dim)
        rc = posterior.residual_correction
        self.residual_correction_ = rc if rc == "kfac" else bool(rc)
        self.residual_excess_ = posterior.residual_excess
        self.projector_ = posterior.projector_rows
        self.projector_eigvals_ = (None if posterior.projector_eigvals is None
                                   else posterior.projector_eigvals.cpu().numpy())
        self.projector_curvature_ = posterior.projector_curvature
        self.log_marginal_likelihood_ = posterior.log_evidence
        super()._store_fitted(posterior)



def _clf(self):
    return self.likelihood == "classification"


def _reg(self):
    return self.likelihood == "regression"


def _impl(name):
    """The regression or classification skin's method ``name`` for ``self``."""

    def pick(self):
        skin = LaplaceClassifierMixin if _clf(self) else LaplaceRegressorMixin
        return getattr(skin, name).__get__(self)

    return pick


class SubspaceLaplace(_SubspaceMixin, _LaplaceBase):
    """Subspace Laplace for regression or classification, chosen by ``likelihood``.

    The estimator of the paper's interface (``SubspaceLaplace(net, likelihood)``):
    with ``likelihood="regression"`` it is :class:`SubspaceLaplaceRegressor`, with
    ``likelihood="classification"`` :class:`SubspaceLaplaceClassifier`; its
    scikit-learn tags (``is_classifier``, ``is_regressor``), its methods
    (``predict_proba`` only for classification, ``sample_y`` only for regression)
    and its ``score`` follow ``likelihood``.

    Parameters
    ----------
    net : None, skorch net, FrozenEstimator or torch.nn.Module, default=None
        The network. ``None`` trains a small tanh MLP (MAP, weight decay) in ``fit``;
        a fitted skorch net, ``FrozenEstimator(net)`` or an ``nn.Module`` is used as it
        is and never modified; an unfitted skorch net is trained in ``fit``.
    likelihood : {"classification", "regression"}, default="classification"
        The task: a categorical (or Bernoulli, for a one-logit net) or a Gaussian
        likelihood.
    projector : {"lowrank-kfac", "lowrank-diag", "subset-magnitude", \
"subset-diagonal", "subset-swag", "optimal"}, default="lowrank-kfac"
        How ``P`` is built (see :class:`SubspaceLaplaceRegressor`).
    subspace_dim : int or "auto", default="auto"
        ``s`` (see :class:`SubspaceLaplaceRegressor`).
    prior_variance : float or "auto", default="auto"
        ``s0^2``. ``"auto"``: regression, the KFAC evidence at the noise variance in
        use (see :class:`SubspaceLaplaceRegressor`); classification,
        ``||theta||^2 / p`` (see :class:`SubspaceLaplaceClassifier`).
    noise_variance : float or "auto", default="auto"
        ``s2`` (regression only).
    hyper_strategy : {"auto", "evidence", "validation", "weight_norm"}, default="auto"
        As in :class:`SubspaceLaplaceRegressor` / :class:`SubspaceLaplaceClassifier`.
    n_subset : int or "auto", default="auto"
        Size of the training subset ``X'`` (see :class:`SubspaceLaplaceRegressor`).
    subspace_X : array-like of shape (n, n_features) or None, default=None
        Inputs used as ``X'`` instead of a random training subset.
    swag_learning_rate : float, default=1e-2
        SGD learning rate of the SWAG run.
    swag_n_steps : int, default=100
        SGD steps of the SWAG run.
    residual_correction : bool, "kfac" or "auto", default="auto"
        The posterior outside ``span(P)`` in the predictive (see
        :class:`SubspaceLaplaceRegressor`).
    link_approx : {"probit", "mc", "bridge"}, default="probit"
        Approximation of ``E softmax(f)`` (classification only).
    n_samples_predict : int, default=512
        Samples per point for ``link_approx="mc"`` (classification only).
    classes : array-like or None, default=None
        The label of each network output (classification only).
    validation_fraction : float, default=0.1
        Fraction of the rows held out from training when ``fit`` trains the network
        and no ``validation_data`` is given.
    trainable_only : bool, default=True
        Linearise only parameters with ``requires_grad=True``.
    device : str or torch.device, default="auto"
        ``"auto"`` (CUDA when available), ``"cpu"``, ``"cuda"`` or a torch device.
    batch_size : int, default=256
        Rows per batch when streaming data through the network.
    random_state : int, RandomState instance or None, default=None
        Seeds the subset ``X'``, the SWAG run, hold-outs, net training and ``mc``.
    verbose : int or bool, default=0
        ``>= 1`` shows progress bars on long passes.

    Attributes
    ----------
    classes_ : ndarray
        Class labels (classification only).
    prior_variance_ : float
        Prior variance in use.
    noise_variance_ : float
        Noise variance in use (regression only).
    subspace_dim_ : int
        ``s`` in use.
    residual_correction_ : bool or "kfac"
        The posterior outside ``span(P)`` in the predictive (``"kfac"``, the prior
        (``True``) or none).
    residual_excess_ : float or None
        Mean latent variance the residual adds on a training row, in units of the
        noise variance (regression) or of the curvature (classification); ``None``
        without the residual correction.
    projector_ : Tensor of shape (subspace_dim_, n_params)
        Orthonormal rows spanning ``P`` (float64).
    projector_eigvals_ : ndarray or None
        Top eigenvalues of ``J_X' Psi J_X'^T`` (low-rank and optimal projectors).
    projector_curvature_ : str or None
        The curvature ``Psi_approx`` is built from, e.g. ``"KFAC (Conv2d, Linear: 37,984
        parameters) + exact diagonal GGN (BatchNorm2d: 96 parameters)"`` (the default
        projector on a net with BatchNorm: KFAC where curvlinops supports the layer, the
        exact GGN diagonal for the other parameters); ``None`` for the subset projectors
        built without curvature.
    log_marginal_likelihood_ : float
        Laplace evidence of the subspace model.
    hyper_strategy_ : str
        How ``"auto"`` values were chosen.
    hyper_trace_ : dict
        Candidates tried and their scores.
    temperature_ : float
        Temperature calibrated on held-out rows (classification only).
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
    likelihood_ : Likelihood
        The fitted likelihood.
    posterior_ : SubspacePosterior
        The fitted posterior.
    n_outputs_ : int
        Number of network outputs.
    n_features_in_ : int
        Number of input features.
    feature_names_in_ : ndarray of shape (n_features_in_,)
        Feature names, when ``X`` has string column names.

    See Also
    --------
    SubspaceLaplaceRegressor : The regression estimator.
    SubspaceLaplaceClassifier : The classification estimator.

    Examples
    --------
    >>> from sklearn.base import is_classifier
    >>> from sklearn.datasets import make_blobs
    >>> from sklearn_lla.subspace import SubspaceLaplace
    >>> X, y = make_blobs(n_samples=90, centers=3, random_state=0)
    >>> la = SubspaceLaplace(likelihood="classification", subspace_dim=10,
    ...                      random_state=0).fit(X, y)
    >>> is_classifier(la), la.predict_proba(X[:2]).shape
    (True, (2, 3))
    """

    _parameter_constraints = {
        **REGRESSOR_CONSTRAINTS, **CLASSIFIER_CONSTRAINTS,
        **_SubspaceMixin._subspace_constraints,
        "likelihood": [StrOptions({"regression", "classification"})],
    }

    def __init__(self, net=None, likelihood="classification", *, projector="lowrank-kfac",
                 subspace_dim="auto", prior_variance="auto", noise_variance="auto",
                 hyper_strategy="auto", n_subset="auto", subspace_X=None,
                 swag_learning_rate=1e-2, swag_n_steps=100,
                 residual_correction="auto", link_approx="probit",
                 n_samples_predict=512, classes=None, validation_fraction=0.1,
                 trainable_only=True, device="auto", batch_size=256, random_state=None,
                 verbose=0):
        self.net = net
        self.likelihood = likelihood
        self.projector = projector
        self.subspace_dim = subspace_dim
        self.prior_variance = prior_variance
        self.noise_variance = noise_variance
        self.hyper_strategy = hyper_strategy
        self.n_subset = n_subset
        self.subspace_X = subspace_X
        self.swag_learning_rate = swag_learning_rate
        self.swag_n_steps = swag_n_steps
        self.residual_correction = residual_correction
        self.link_approx = link_approx
        self.n_samples_predict = n_samples_predict
        self.classes = classes
        self.validation_fraction = validation_fraction
        self.trainable_only = trainable_only
        self.device = device
        self.batch_size = batch_size
        self.random_state = random_state
        self.verbose = verbose

    # -- the task follows ``likelihood`` --------------------------------------------
    @property
    def _task(self):
        return self.likelihood

    def __sklearn_tags__(self):
        tags = super().__sklearn_tags__()
        tags.target_tags.required = True
        if self.likelihood == "classification":
            tags.estimator_type = "classifier"
            tags.classifier_tags = ClassifierTags()
        else:
            tags.estimator_type = "regressor"
            tags.regressor_tags = RegressorTags()
            tags.target_tags.multi_output = True
            tags.target_tags.single_output = True
        return tags

    _validate_xy = property(_impl("_validate_xy"))
    _encode_targets = property(_impl("_encode_targets"))
    _n_net_outputs = property(_impl("_n_net_outputs"))
    _likelihood = property(_impl("_likelihood"))
    _encode_validation_targets = property(_impl("_encode_validation_targets"))
    _mean_std = LaplaceRegressorMixin._mean_std  # the outputs of a latent predictive
    _proba = LaplaceClassifierMixin._proba

    def _target_tensor(self, y, device):
        skin = LaplaceClassifierMixin if _clf(self) else LaplaceRegressorMixin
        return skin._target_tensor(y, device)

    def _net_classes(self, resolved, C):
        return LaplaceClassifierMixin._net_classes(self, resolved, C)

    def _shape(self, a):
        return LaplaceRegressorMixin._shape(self, a)

    def _store_fitted(self, posterior):
        if _reg(self):
            self.noise_variance_ = float(posterior.likelihood.noise_variance)
        else:
            self.temperature_ = float(getattr(posterior.likelihood, "temperature", 1.0))
            self.covariance_scale_ = float(getattr(posterior.likelihood, "covariance_scale",
                                                   1.0))
        super()._store_fitted(posterior)

    def fit(self, X, y, validation_data=None):
        """Fit the subspace Laplace posterior of the (pretrained or trained) network.

        Parameters
        ----------
        X : array-like of shape (n_samples, n_features)
            Training inputs.
        y : array-like of shape (n_samples,) or (n_samples, n_targets)
            Targets (regression) or class labels (classification).
        validation_data : tuple (X_val, y_val), optional
            Held-out data the network did not fit: an ``"auto"`` noise variance
            (regression) or a temperature (classification) is calibrated on it.

        Returns
        -------
        self : object
            The fitted estimator.
        """
        return self._fit(X, y, validation_data)

    def predict(self, X, return_std=False, return_cov=False):
        """Predict the mean (regression) or the most probable class (classification).

        Parameters
        ----------
        X : array-like of shape (n_samples, n_features)
            Query points.
        return_std : bool, default=False
            Regression only: also return the predictive standard deviation of ``y``.
        return_cov : bool, default=False
            Regression only: also return the joint predictive covariance of ``y``.

        Returns
        -------
        y_pred : ndarray of shape (n_samples,) or (n_samples, n_targets)
            Predictive mean or class labels.
        y_std : ndarray of the shape of ``y_pred``
            Returned when ``return_std`` is true.
        y_cov : ndarray
            Returned when ``return_cov`` is true.
        """
        if _clf(self):
            if return_std or return_cov:
                raise ValueError("return_std and return_cov are for "
                                 "likelihood='regression'")
            return LaplaceClassifierMixin.predict(self, X)
        return LaplaceRegressorMixin.predict(self, X, return_std=return_std,
                                             return_cov=return_cov)

    @available_if(_clf)
    def predict_proba(self, X):
        """Predict class probabilities ``E softmax(f)`` (classification only).

        Parameters
        ----------
        X : array-like of shape (n_samples, n_features)
            Query points.

        Returns
        -------
        proba : ndarray of shape (n_samples, n_classes)
            Rows sum to one; columns in the order of ``classes_``.
        """
        return LaplaceClassifierMixin.predict_proba(self, X)

    @available_if(_clf)
    def predict_log_proba(self, X):
        """Predict the logarithm of :meth:`predict_proba` (classification only).

        Parameters
        ----------
        X : array-like of shape (n_samples, n_features)
            Query points.

        Returns
        -------
        log_proba : ndarray of shape (n_samples, n_classes)
            Log probabilities, columns in the order of ``classes_``.
        """
        return LaplaceClassifierMixin.predict_log_proba(self, X)

    def conformalize(self, X_cal, y_cal):
        """Calibrate split-conformal intervals (regression) or sets (classification).

        Parameters
        ----------
        X_cal : array-like of shape (n_cal, n_features)
            Calibration inputs the network did not fit, exchangeable with test points.
        y_cal : array-like of shape (n_cal,) or (n_cal, n_targets)
            Their targets or labels.

        Returns
        -------
        self : object
            The estimator, with ``conformal_scores_``, ``conformal_n_`` and
            ``conformal_source_``.
        """
        skin = LaplaceClassifierMixin if _clf(self) else LaplaceRegressorMixin
        return skin.conformalize(self, X_cal, y_cal)

    @available_if(_reg)
    def predict_interval(self, X, confidence=0.9):
        """Predict split-conformal intervals (regression only; see ``conformalize``).

        Parameters
        ----------
        X : array-like of shape (n_samples, n_features)
            Query points.
        confidence : float or array-like of float, default=0.9
            Coverage level(s) in (0, 1).

        Returns
        -------
        lower, upper : ndarray
            ``mean -/+ q * std``; as :meth:`SubspaceLaplaceRegressor.predict_interval`.
        """
        return LaplaceRegressorMixin.predict_interval(self, X, confidence)

    @available_if(_clf)
    def predict_set(self, X, confidence=0.9, *, method="lac", randomized=False,
                    allow_empty=False, random_state=0):
        """Predict split-conformal prediction sets (classification only).

        Parameters
        ----------
        X : array-like of shape (n_samples, n_features)
            Query points.
        confidence : float, default=0.9
            Coverage level in (0, 1).
        method : {"lac", "aps"}, default="lac"
            Conformity score.
        randomized : bool, default=False
            Randomised APS.
        allow_empty : bool, default=False
            Whether a set may be empty.
        random_state : int, RandomState instance or None, default=0
            Seed of the randomised APS draws.

        Returns
        -------
        sets : ndarray of shape (n_samples, n_classes), dtype bool
            As :meth:`SubspaceLaplaceClassifier.predict_set`.
        """
        return LaplaceClassifierMixin.predict_set(
            self, X, confidence, method=method, randomized=randomized,
            allow_empty=allow_empty, random_state=random_state)

    @available_if(_reg)
    def sample_y(self, X, n_samples=1, random_state=0):
        """Draw joint samples of ``y`` from the predictive (regression only).

        Parameters
        ----------
        X : array-like of shape (n_samples_X, n_features)
            Query points.
        n_samples : int, default=1
            Number of joint samples.
        random_state : int, RandomState instance or None, default=0
            Seed of the draws.

        Returns
        -------
        y_samples : ndarray
            Shape (n_samples_X, n_samples), or (n_samples_X, n_targets, n_samples).
        """
        return LaplaceRegressorMixin.sample_y(self, X, n_samples, random_state)

    def score(self, X, y, sample_weight=None):
        """Return the accuracy (classification) or the R^2 (regression) on ``(X, y)``.

        Parameters
        ----------
        X : array-like of shape (n_samples, n_features)
            Test inputs.
        y : array-like of shape (n_samples,) or (n_samples, n_targets)
            True labels or targets.
        sample_weight : array-like of shape (n_samples,), default=None
            Sample weights.

        Returns
        -------
        score : float
            Mean accuracy or coefficient of determination.
        """
        from sklearn.metrics import accuracy_score, r2_score

        if _clf(self):
            return accuracy_score(y, self.predict(X), sample_weight=sample_weight)
        return r2_score(y, self.predict(X), sample_weight=sample_weight)
