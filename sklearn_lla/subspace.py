"""Subspace Laplace (Faller & Martin): linearised Laplace on ``theta = theta_hat + P mu``.

With a ``p x s`` projector ``P`` and the prior ``mu ~ N(0, s0^2 (P^T P)^-1)`` the
Laplace posterior of ``mu`` is ``N(0, (P^T H P)^-1)`` with ``H`` the *full* GGN
precision; the paper's predictive covariance is

``S_P(X) = J_X P (P^T H P)^-1 P^T J_X^T``.

That is the feature-space GLM posterior of :mod:`sklearn_lla._posteriors.glm` with ``V = P``
(:class:`~sklearn_lla._posteriors.glm.ProjectionFeatures`): ``P^T H P`` is accumulated batch
by batch from the JVPs ``J_n P``, never as a ``p x p`` matrix. The projectors are in
:mod:`sklearn_lla._posteriors.subspace`.

Defaults (the class docstrings and ``docs/subspace.md``): the low-rank projectors keep
the prior variance outside ``span(P)`` in the predictive (``residual_correction``), so
the std grows off the data as exact LLA's does. :class:`SubspaceLaplace` (the task
chosen by ``likelihood``) and the parameters all three share are in
``sklearn_lla/_subspace_laplace.py``.
"""

from __future__ import annotations

from ._base import (
    CLASSIFIER_CONSTRAINTS,
    REGRESSOR_CONSTRAINTS,
    LaplaceClassifierMixin,
    LaplaceRegressorMixin,
)
from ._subspace_laplace import SubspaceLaplace, _SubspaceMixin

__all__ = ["SubspaceLaplaceRegressor", "SubspaceLaplaceClassifier", "SubspaceLaplace"]


# ------------------------------------------------------------------------- estimators
class SubspaceLaplaceRegressor(_SubspaceMixin, LaplaceRegressorMixin):
    """Subspace Laplace regression: linearised Laplace on ``theta_hat + P mu``.

    Inside ``span(P)`` the posterior has the full GGN precision ``H``, accumulated
    batch-wise in the ``s``-dimensional subspace (Faller & Martin):
    ``J(x) P (P^T H P)^-1 P^T J(x)^T``. With the default low-rank projector the prior
    variance of the directions outside ``span(P)`` is added
    (``residual_correction``), so the std grows away from the data as exact LLA's
    does; with ``s`` at the rank of the training Jacobians this is exact LLA.

    Parameters
    ----------
    net : None, skorch net, FrozenEstimator or torch.nn.Module, default=None
        The network. ``None`` trains a small tanh MLP (MAP, weight decay) in ``fit``;
        a fitted skorch net, ``FrozenEstimator(net)`` or an ``nn.Module`` is used as it
        is and never modified; an unfitted skorch net is trained in ``fit``.
    projector : {"lowrank-kfac", "lowrank-diag", "subset-magnitude", \
"subset-diagonal", "subset-swag", "optimal"}, default="lowrank-kfac"
        How ``P`` is built: Algorithm 1 with a KFAC or diagonal-GGN posterior
        covariance ``Psi_approx`` (the top-``s`` eigenvectors ``U_s`` of
        ``J_X' Psi_approx J_X'^T`` on training inputs ``X'``, ``P = J_X'^T U_s`` with
        the residual correction, else ``Psi_approx J_X'^T U_s``), a subset of the
        parameters with the largest magnitude, diagonal-GGN posterior variance or
        SWAG variance, or Theorem 1's optimum with the full posterior covariance
        (``p <= 5000``).
    subspace_dim : int or "auto", default="auto"
        ``s``. ``"auto"``: every eigenvalue of ``J_X' Psi_approx J_X'^T`` above
        ``1e-6`` times the largest (the subspace then holds the directions the
        subset's data determine), at most ``max(20, 2**21 // p)`` (the cost of a
        row's features); subset projectors: that cap. An integer is reduced to the
        numerical rank with a ``RuntimeWarning``.
    prior_variance : float or "auto", default="auto"
        ``s0^2``. ``"auto"``: the maximiser of the Laplace evidence of the KFAC
        approximation of the full network (the paper's choice) at the noise
        variance in use; the subspace model's own evidence when KFAC does not
        support the network.
    noise_variance : float or "auto", default="auto"
        ``s2``. ``"auto"``: with held-out rows (``validation_data``, or rows held out
        from the network), the pair chosen without them rescaled to ``(c s0^2, c
        s2)``, ``c`` the held-out NLL's minimiser (the posterior's shape is kept);
        otherwise the subspace model's Laplace evidence along the prior's ridge.
    hyper_strategy : {"auto", "evidence", "validation", "weight_norm"}, default="auto"
        ``"auto"``: as above. Otherwise the ``"auto"`` variances by this strategy on
        the subspace model (``"validation"``, the joint held-out grid, only when
        asked for); the projector is still built with the KFAC evidence.
    n_subset : int or "auto", default="auto"
        Size of the training subset ``X'`` of the low-rank and optimal projectors;
        ``"auto"``: ``ceil(1000 / n_outputs)`` points, i.e. ``n C = 1000`` rows of
        ``M = J_X' Psi J_X'^T`` (the paper's 1000 points for regression and 100 for
        ten classes). ``M`` costs ``(n C)^2`` memory and an ``(n C)^3`` eigensolve.
    subspace_X : array-like of shape (n, n_features) or None, default=None
        Inputs used as ``X'`` instead of a random training subset (for
        ``projector="optimal"``, the ``X`` of Theorem 1).
    swag_learning_rate : float, default=1e-2
        SGD learning rate of the SWAG run (``projector="subset-swag"``).
    swag_n_steps : int, default=100
        SGD steps of the SWAG run.
    residual_correction : bool, "kfac" or "auto", default="auto"
        The posterior outside ``span(P)``. ``"kfac"``: a KFAC posterior projected
        on the complement, ``j_perp^T Sigma_KFAC j_perp`` (at large ``N`` most of
        exact LLA's epistemic variance lies outside ``span(P)``; ``docs/fidelity.md``).
        ``True``: add ``s0^2 J(x) (I - P P^T) J(x)^T``, the prior variance outside ``span(P)``,
        to the predictive (the posterior is then the full-network Laplace
        approximation with the GGN compressed onto ``span(P)``, and the evidence is
        that model's). ``"auto"``: ``"kfac"`` for the low-rank projectors built on
        training inputs of networks with the structured or graph Jacobian backend
        (chains of ``nn.Linear``; convolutional / residual nets); on others
        ``True``, unless ``span(P)`` misses directions the training data determine
        (the residual would add more than 0.25 x the noise variance to a training
        row's latent variance; ``residual_excess_``): then off, with a
        ``RuntimeWarning``. Off for the subset and optimal projectors (the paper's
        ``S_P``, whose trace is below exact LLA's).
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
        Seeds the subset ``X'``, the SWAG run, hold-outs and net training.
    verbose : int or bool, default=0
        ``>= 1`` shows progress bars on long passes.

    Attributes
    ----------
    prior_variance_ : float
        Prior variance in use.
    noise_variance_ : float
        Noise variance in use.
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
        Candidates tried and their scores; ``"projector"``: the hyperparameters of
        ``Psi_approx`` (and the KFAC evidence search); ``"prior_variance_source"``:
        ``"kfac_evidence"`` when the prior is on the KFAC ridge.
    net_ : object
        The pretrained or trained network.
    linearized_net_ : LinearizedNet
        The frozen functional view of the network.
    jacobian_backend_ : str
        ``"structured"``, ``"graph"`` or ``"functorch"``.
    likelihood_ : Gaussian
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
    SubspaceLaplace : The same with the task chosen by ``likelihood``.
    LLARegressor : Exact LLA, the reference.

    Examples
    --------
    >>> import numpy as np
    >>> from sklearn_lla.subspace import SubspaceLaplaceRegressor
    >>> rng = np.random.RandomState(0)
    >>> X = rng.uniform(-2, 2, (80, 1))
    >>> y = np.sin(2 * X[:, 0]) + 0.1 * rng.randn(80)
    >>> reg = SubspaceLaplaceRegressor(subspace_dim=10, random_state=0).fit(X, y)
    >>> mean, std = reg.predict(X[:2], return_std=True)
    >>> std.shape
    (2,)
    """

    _parameter_constraints = {**REGRESSOR_CONSTRAINTS, **_SubspaceMixin._subspace_constraints}

    def __init__(self, net=None, *, projector="lowrank-kfac", subspace_dim="auto",
                 prior_variance="auto", noise_variance="auto", hyper_strategy="auto",
                 n_subset="auto", subspace_X=None, swag_learning_rate=1e-2, swag_n_steps=100,
                 residual_correction="auto",
                 validation_fraction=0.1, trainable_only=True, device="auto", batch_size=256,
                 random_state=None, verbose=0):
        self.net = net
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
        self.validation_fraction = validation_fraction
        self.trainable_only = trainable_only
        self.device = device
        self.batch_size = batch_size
        self.random_state = random_state
        self.verbose = verbose


class SubspaceLaplaceClassifier(_SubspaceMixin, LaplaceClassifierMixin):
    """Subspace Laplace classification: linearised Laplace on ``theta_hat + P mu``.

    The latent covariance is ``J(x) P (P^T H P)^-1 P^T J(x)^T`` with the full GGN
    precision ``H`` accumulated batch-wise in the ``s``-dimensional subspace
    (Faller & Martin), plus, with the default low-rank projector, the prior variance
    outside ``span(P)`` (``residual_correction``); class probabilities by
    ``link_approx``.

    Parameters
    ----------
    net : None, skorch net, FrozenEstimator or torch.nn.Module, default=None
        The network. ``None`` trains a small tanh MLP (MAP, weight decay) in ``fit``;
        a fitted skorch net, ``FrozenEstimator(net)`` or an ``nn.Module`` is used as it
        is and never modified; an unfitted skorch net is trained in ``fit``.
    projector : {"lowrank-kfac", "lowrank-diag", "subset-magnitude", \
"subset-diagonal", "subset-swag", "optimal"}, default="lowrank-kfac"
        How ``P`` is built (see :class:`SubspaceLaplaceRegressor`).
    subspace_dim : int or "auto", default="auto"
        ``s`` (see :class:`SubspaceLaplaceRegressor`).
    prior_variance : float or "auto", default="auto"
        ``s0^2``. ``"auto"``: chosen by ``hyper_strategy``'s objective, never on
        held-out rows unless ``hyper_strategy="validation"``. With ``"auto"`` and
        held-out rows the network did not fit, a temperature of the latent predictive
        is also calibrated on them (``temperature_``), kept only if it lowers their
        NLL out of fold and never sharper than the network.
    hyper_strategy : {"auto", "evidence", "validation", "weight_norm"}, default="auto"
        The objective of an ``"auto"`` prior variance: ``"auto"`` and
        ``"weight_norm"`` ``||theta||^2 / p`` (as exact LLA's and ELLA's classifiers:
        the KFAC evidence of a net that fits its training labels picks a prior 25-100
        x larger and an under-confident predictive), ``"evidence"`` the subspace
        model's Laplace evidence; ``"validation"`` a held-out grid (it can end at the
        raw network, with a warning). The projector is built with the KFAC evidence.
    n_subset : int or "auto", default="auto"
        Size of the training subset ``X'``; ``"auto"``: ``ceil(1000 / n_outputs)``
        points (``n C = 1000`` rows, the paper's 100 points for ten classes).
    subspace_X : array-like of shape (n, n_features) or None, default=None
        Inputs used as ``X'`` instead of a random training subset.
    swag_learning_rate : float, default=1e-2
        SGD learning rate of the SWAG run (``projector="subset-swag"``).
    swag_n_steps : int, default=100
        SGD steps of the SWAG run.
    residual_correction : bool, "kfac" or "auto", default="auto"
        The posterior outside ``span(P)`` in the latent covariance (see
        :class:`SubspaceLaplaceRegressor`).
    link_approx : {"probit", "mc", "bridge"}, default="probit"
        Approximation of ``E softmax(f)`` under the Gaussian latent.
    n_samples_predict : int, default=512
        Samples per point for ``link_approx="mc"``.
    classes : array-like or None, default=None
        The label of each network output, in output order (see
        :class:`~sklearn_lla.LLAClassifier`).
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
        Class labels, in the order of ``predict_proba``'s columns.
    prior_variance_ : float
        Prior variance in use.
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
    likelihood_ : Categorical or Bernoulli
        The likelihood.
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
    SubspaceLaplace : The same with the task chosen by ``likelihood``.
    LLAClassifier : Exact LLA, the reference.

    Examples
    --------
    >>> from sklearn.datasets import make_blobs
    >>> from sklearn_lla.subspace import SubspaceLaplaceClassifier
    >>> X, y = make_blobs(n_samples=90, centers=3, random_state=0)
    >>> clf = SubspaceLaplaceClassifier(subspace_dim=10, random_state=0).fit(X, y)
    >>> clf.predict_proba(X[:2]).shape
    (2, 3)
    """

    _parameter_constraints = {**CLASSIFIER_CONSTRAINTS, **_SubspaceMixin._subspace_constraints}

    def __init__(self, net=None, *, projector="lowrank-kfac", subspace_dim="auto",
                 prior_variance="auto", hyper_strategy="auto", n_subset="auto",
                 subspace_X=None, swag_learning_rate=1e-2, swag_n_steps=100,
                 residual_correction="auto",
                 link_approx="probit", n_samples_predict=512, classes=None,
                 validation_fraction=0.1, trainable_only=True, device="auto", batch_size=256,
                 random_state=None, verbose=0):
        self.net = net
        self.projector = projector
        self.subspace_dim = subspace_dim
        self.prior_variance = prior_variance
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
