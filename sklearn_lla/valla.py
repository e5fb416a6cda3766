"""``VaLLARegressor`` and ``VaLLAClassifier``: variational linearized Laplace.

The scikit-learn estimators; the NTK kernel and the posterior are in
:mod:`sklearn_lla._posteriors.valla`, on the fixed-mean sparse GP of
:mod:`sklearn_lla._posteriors.gp`.
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
from ._core.utils import generator_seed
from ._posteriors.valla import VaLLAPosterior

__all__ = ["VaLLARegressor", "VaLLAClassifier"]

#: ``n_inducing="auto"``: inducing pairs by task (at most the number of training rows).
#: Regression: 300, not the paper's 100, with which the ``"subspace"`` predictive
#: keeps almost no variance off the data and, without held-out rows, learns a noise
#: close to the fitted training residuals (``docs/valla.md``, item 9, for the
#: measurements). Classification: 100 pairs (``M / C`` per class).
AUTO_INDUCING = {"regression": 300, "classification": 100}

#: ``covariance`` -> the posterior's ``complement`` ("auto": KFAC where the network has
#: factored Jacobians, else diagonal).
COMPLEMENTS = {"subspace+complement": "auto", "subspace+kfac": "kfac",
               "subspace+diagonal": "diagonal"}


class _VaLLAMixin:
    """VaLLA's parameters and posterior, shared by the regressor and the classifier."""

    _valla_constraints = {
        **LINEARIZED_CONSTRAINTS,
        "n_inducing": [Interval(Integral, 1, None, closed="left"), StrOptions({"auto"})],
        "covariance": [StrOptions({"subspace+complement", "subspace+kfac", "subspace+diagonal",
                                   "subspace", "full"})],
        "init": [StrOptions({"optimal", "identity"})],
        "alpha": [Interval(Real, 0, 1, closed="both")],
        "learning_rate": [Interval(Real, 0, None, closed="neither")],
        "max_iter": [Interval(Integral, 1, None, closed="left")],
        "early_stopping": ["boolean"],
        "stopping": [StrOptions({"objective", "auto"})],
        "validation_freq": [Interval(Integral, 1, None, closed="left"), StrOptions({"auto"})],
        "n_iter_no_change": [Interval(Integral, 1, None, closed="left")],
        "tol": [Interval(Real, 0, None, closed="left")],
        "learn_inducing": ["boolean"],
        "energy_link": [StrOptions({"probit", "mc"})],
    }

    def _make_posterior(self, data):
        regression = data.likelihood.task == "regression"
        seed = generator_seed(data.generator)
        n_inducing = self.n_inducing
        if n_inducing == "auto":  # k-means caps it at the number of training rows
            n_inducing = AUTO_INDUCING["regression" if regression else "classification"]
        covariance, complement = self.covariance, None
        if covariance.startswith("subspace+"):
            covariance, complement = "subspace", COMPLEMENTS[covariance]
        return VaLLAPosterior(
            prior_variance=self.prior_variance, init=self.init, covariance=covariance,
            complement=complement,
            noise_variance=self.noise_variance if regression else None,
            n_inducing=n_inducing, alpha=self.alpha, learning_rate=self.learning_rate,
            max_iter=self.max_iter, batch_size=self.batch_size,
            early_stopping=self.early_stopping, stopping=self.stopping,
            validation_freq=self.validation_freq, n_iter_no_change=self.n_iter_no_change,
            tol=self.tol, learn_inducing=self.learn_inducing, energy_link=self.energy_link,
            random_state=seed, name=type(self).__name__)

    def _store_fitted(self, posterior):
        self.inducing_inputs_ = posterior.inducing_inputs
        self.inducing_outputs_ = posterior.inducing_outputs
        self.n_iter_ = posterior.n_iter
        self.stopping_scores_ = list(posterior.hyper_trace.get("validation", []))
        self.kl_ = float(posterior.hyper_trace.get("kl", np.nan))
        self.complement_ = getattr(posterior, "complement_kind", None)
        super()._store_fitted(posterior)



class VaLLARegressor(_VaLLAMixin, LaplaceRegressorMixin):
    """VaLLA regression: variational LLA with a learned prior and noise.

    Approximates linearized Laplace (the GP with the network as mean and the scaled
    NTK ``s0^2 J(x) J(x')^T`` as kernel) by a sparse variational GP whose mean stays
    the network: ``n_inducing`` inducing inputs (k-means) and a triangular factor,
    started at their optimum (``init``) and refined by minibatch Adam on the ELBO
    (``alpha = 0``) with the complete KL, which also learns ``s0^2`` and ``s2``.
    Early stopping checks the objective; held-out rows, when there are any,
    calibrate the noise variance afterwards. A step costs the same for any number
    of rows. See ``docs/valla.md``.

    Parameters
    ----------
    net : None, skorch net, FrozenEstimator or torch.nn.Module, default=None
        The network. ``None`` trains a small tanh MLP (MAP, weight decay) in ``fit``;
        a fitted skorch net, ``FrozenEstimator(net)`` or an ``nn.Module`` is used as it
        is and never modified; an unfitted skorch net is trained in ``fit``.
    n_inducing : int or "auto", default="auto"
        ``M``, the number of inducing pairs (input, output index), at most the number
        of training rows. ``"auto"``: 300 (the paper's 100 leaves the predictive
        almost constant off the data; measured in ``docs/valla.md``). A step costs
        ``O(M^3)`` plus ``O(B M)`` per layer.
    covariance : {"subspace+complement", "subspace+kfac", "subspace+diagonal", \
"subspace", "full"}, default="subspace+complement"
        The posterior's covariance. ``"subspace"``: the GP on the NTK restricted to
        the span of the inducing pairs' Jacobian rows (its Nystrom approximation ``Q
        = Kxz Kzz^-1 Kzx``), LLA on the ``M``-dimensional parameter subspace those rows
        span: no variance in any other direction, so off the data, where the network's
        Jacobian leaves that span, the predictive keeps a small fraction of LLA's.
        ``"full"``: the NTK itself, as in the papers: the prior variance in every
        direction the pairs do not span, the data included, which makes the
        predictive far too wide in distribution whenever the data determine more
        than ``M`` directions. ``"subspace+kfac"``: ``"subspace"`` plus the KFAC
        posterior of the directions outside the span (the complement ELLA uses),
        each output's variance there floored at a lower bound of exact LLA's
        (Cauchy-Schwarz on the span's residual kernel against up to 2,000 training
        rows: the prior's off the data); networks with factored Jacobians only.
        ``"subspace+diagonal"``: ``"subspace"`` plus a diagonal posterior for those
        directions (the prior's precision plus the diagonal of the data's curvature
        there, on up to 2,000 training rows), for any network; it ignores the
        correlations of the curvature and is too wide once the data pin down
        directions the span misses. ``"subspace+complement"``: ``"subspace+kfac"``
        where the network has factored Jacobians and ``P M C <= 10^7`` (its
        prediction pushes ``M`` tangents through the network per point: 2,000 rows of
        a 98,801-parameter MLP at ``M = 300`` took 133 s against the diagonal's 1 s),
        else ``"subspace+diagonal"`` (the choice is in ``complement_``). All three
        complements are exact LLA when the pairs are the training rows. At fixed
        hyperparameters against exact LLA (``docs/fidelity.md``; mean epistemic
        variance ratio, a 4,481-parameter net, 300 pairs): the KFAC complement keeps
        1.19 x at 10,000 rows and 1.20 x at 100,000, the diagonal one 1.43 x and
        1.72 x. The diagonal complement costs one Jacobian row per predicted point
        and output, the KFAC one ``3 M`` tangents through the network per point and
        a kernel row against the stored training rows (its floor).
    init : {"optimal", "identity"}, default="optimal"
        Where Adam starts. ``"optimal"``: the optimal variational factor for the
        k-means inducing points (the papers' Proposition 3, formed on up to 2,000
        training rows), and the learned variances that minimise the objective
        there. ``"identity"``: the papers' ``L = I``,
        ``prior_variance = ||theta_hat||^2 / P`` and the network's mean squared
        training residual as noise.
    prior_variance : float or "auto", default="auto"
        ``s0^2``. ``"auto"``: learned by the objective (whose KL includes the mean
        term that gives it a finite optimum); a float is kept fixed.
    noise_variance : float or "auto", default="auto"
        ``s2``. ``"auto"``: learned by the objective, then, when there are held-out
        rows, calibrated on them (held-out NLL, latent covariance kept); a float is
        kept fixed.
    alpha : float, default=0.0
        The alpha of the energy. 0: the ELBO, which tells the latent variance from
        the noise at the data. 1 (the paper's) lets the latent variance stand in for
        the noise there, and ``s2`` drifts to zero (measured in ``docs/valla.md``).
    learning_rate : float, default=1e-3
        Adam's learning rate (the paper's).
    max_iter : int, default=10000
        Largest number of Adam steps.
    batch_size : int, default=100
        Rows per Adam step (and per forward pass at prediction).
    early_stopping : bool, default=True
        Stop after ``n_iter_no_change`` checks, every ``validation_freq`` steps,
        without an improvement of more than ``tol``, and keep the state of the best
        check (the start included). ``False`` runs ``max_iter`` steps.
    stopping : {"objective", "auto"}, default="objective"
        What the checks score. ``"objective"``: the training objective, exactly, on
        a fixed set of up to 2,000 training rows (the minibatch loss averaged
        between checks when ``learn_inducing=True`` or ``init="identity"``); held-out
        rows are then used only to calibrate the predictive after the fit.
        ``"auto"``: the held-out NLL when there are held-out rows (the papers'
        early stopping), else the objective.
    validation_freq : int or "auto", default="auto"
        Steps between checks. ``"auto"``: 20 when the checks score the objective on
        the fixed monitor rows or held-out NLL (exact scores, no minibatch noise),
        50 when they average the minibatch loss.
    n_iter_no_change : int, default=3
        Checks without improvement before stopping.
    tol : float, default=1e-3
        A check improves on the best score ``b`` (a per-point negative objective or
        NLL) when it is lower by more than ``tol * max(1, |b|)``.
    validation_fraction : float, default=0.1
        Fraction of the rows held out from training when ``fit`` trains the network
        (``net=None`` or an unfitted skorch net) and no ``validation_data`` is
        given; those rows calibrate the predictive.
    learn_inducing : bool, default=False
        Learn ``Z`` too (gradients through ``J(Z)``: second derivatives of the
        network, at several times the cost of a step). Off by default: with
        ``covariance="subspace"`` the mean term of the KL depends on ``Z`` and
        moving ``Z`` to shrink it drives the prior variance towards zero (measured
        in ``docs/valla.md``), and the optimal start is exact only for a fixed ``Z``.
    energy_link : {"probit", "mc"}, default="probit"
        Unused in regression (closed form); kept for a common signature.
    trainable_only : bool, default=True
        Linearise only parameters with ``requires_grad=True``.
    device : str or torch.device, default="auto"
        ``"auto"`` (CUDA when available), ``"cpu"``, ``"cuda"`` or a torch device.
    random_state : int, RandomState instance or None, default=None
        Seeds k-means, the start's row subsets, the minibatch order, net training and
        Monte Carlo draws.
    verbose : int or bool, default=0
        ``>= 1`` shows a progress bar.

    Attributes
    ----------
    prior_variance_ : float
        The learned (or fixed) ``s0^2``.
    noise_variance_ : float
        The noise variance of the predictive (learned, calibrated or fixed).
    inducing_inputs_ : ndarray of shape (n_inducing, n_features_flat)
        The inducing inputs ``Z`` (flattened inputs).
    inducing_outputs_ : ndarray of shape (n_inducing,)
        The output index (regression target or class logit) each one carries.
    n_iter_ : int
        Adam steps taken.
    stopping_scores_ : list of tuple
        ``(step, score)`` at each early-stopping check (step 0: the start): the
        negative objective per row, or the held-out NLL with ``stopping="auto"``.
    kl_ : float
        The fitted ``KL(q || p)``, covariance and mean parts.
    complement_ : {"kfac", "diagonal"} or None
        The posterior of the directions outside the inducing pairs' span
        (``covariance="subspace+..."``), ``None`` without one.
    hyper_strategy_ : str
        ``"variational"`` (learned) or ``"fixed"``.
    hyper_trace_ : dict
        The optimisation history: loss per step, checks, best step, ``"start"`` (what
        the optimal start found), ``"calibration"`` (with held-out rows).
    likelihood_ : Gaussian
        The fitted likelihood.
    net_ : object
        The pretrained or trained network.
    linearized_net_ : LinearizedNet
        The frozen functional view of the network.
    jacobian_backend_ : str
        ``"structured"`` (layer-wise NTK), ``"graph"`` or ``"functorch"``.
    jacobian_backend_reason_ : str
        Why that backend was chosen.
    validation_source_ : str or None
        Where the held-out rows came from, or ``None``.
    conformal_scores_ : ndarray of shape (n_cal,) or (n_cal, n_targets)
        Sorted split-conformal scores ``|y - mean| / std`` of the held-out rows (set by
        ``fit`` when it had held-out rows, or by :meth:`conformalize`); used by
        :meth:`predict_interval`. Absent when the estimator is not calibrated.
    conformal_n_ : int
        Number of calibration rows.
    conformal_source_ : str
        Where they came from: ``validation_source_`` of ``fit``, or ``"conformalize"``.
    posterior_ : VaLLAPosterior
        The fitted posterior.
    n_outputs_ : int
        Number of network outputs.
    n_features_in_ : int
        Number of input features.
    feature_names_in_ : ndarray of shape (n_features_in_,)
        Feature names, when ``X`` has string column names.

    See Also
    --------
    LLARegressor : Exact LLA, which VaLLA approximates.
    ELLARegressor : Nystrom LLA.

    Examples
    --------
    >>> import numpy as np
    >>> from sklearn_lla import VaLLARegressor
    >>> rng = np.random.RandomState(0)
    >>> X = rng.uniform(-2, 2, (200, 1))
    >>> y = np.sin(2 * X[:, 0]) + 0.1 * rng.randn(200)
    >>> reg = VaLLARegressor(n_inducing=20, max_iter=200, random_state=0).fit(X, y)
    >>> mean, std = reg.predict(X[:2], return_std=True)
    >>> std.shape, reg.inducing_inputs_.shape
    ((2,), (20, 1))
    """

    _parameter_constraints = {**REGRESSOR_CONSTRAINTS, **_VaLLAMixin._valla_constraints}

    def __init__(self, net=None, *, n_inducing="auto", covariance="subspace+complement",
                 init="optimal",
                 prior_variance="auto", noise_variance="auto", alpha=0.0, learning_rate=1e-3,
                 max_iter=10000, batch_size=100, early_stopping=True, stopping="objective",
                 validation_freq="auto", n_iter_no_change=3, tol=1e-3, validation_fraction=0.1,
                 learn_inducing=False, energy_link="probit", trainable_only=True,
                 device="auto", random_state=None, verbose=0):
        self.net = net
        self.n_inducing = n_inducing
        self.covariance = covariance
        self.init = init
        self.prior_variance = prior_variance
        self.noise_variance = noise_variance
        self.alpha = alpha
        self.learning_rate = learning_rate
        self.max_iter = max_iter
        self.batch_size = batch_size
        self.early_stopping = early_stopping
        self.stopping = stopping
        self.validation_freq = validation_freq
        self.n_iter_no_change = n_iter_no_change
        self.tol = tol
        self.validation_fraction = validation_fraction
        self.learn_inducing = learn_inducing
        self.energy_link = energy_link
        self.trainable_only = trainable_only
        self.device = device
        self.random_state = random_state
        self.verbose = verbose


class VaLLAClassifier(_VaLLAMixin, LaplaceClassifierMixin):
    """VaLLA classification: variational LLA with inducing points per class.

    Approximates linearized Laplace (the GP with the network's logits as mean and the
    scaled NTK as kernel) by a sparse variational GP whose mean stays the network:
    ``n_inducing`` inducing points (k-means per class, each carrying its class logit)
    and a triangular factor, started at the Laplace (GGN) optimum for them and refined
    by minibatch Adam on the alpha-energy (the probit-scaled softmax's log predictive
    at alpha = 1). Early stopping checks the objective; held-out rows, when there are
    any, calibrate a temperature afterwards. See ``docs/valla.md``.

    Parameters
    ----------
    net : None, skorch net, FrozenEstimator or torch.nn.Module, default=None
        The network. ``None`` trains a small tanh MLP (MAP, weight decay) in ``fit``;
        a fitted skorch net, ``FrozenEstimator(net)`` or an ``nn.Module`` is used as it
        is and never modified; an unfitted skorch net is trained in ``fit``.
    n_inducing : int or "auto", default=100
        ``M``, the number of inducing pairs (input, output index); ``M / C`` per class
        (k-means on each class). ``"auto"`` is 100. A step costs ``O(M^3)`` plus
        ``O(B C M)`` per layer.
    covariance : {"full", "subspace+complement", "subspace+kfac", "subspace+diagonal", \
"subspace"}, default="full"
        The posterior's covariance. ``"full"``: the NTK itself, as in the papers; the
        prior variance that the ``M`` pairs cannot explain stays at its prior value,
        which is what raises the predictive entropy off the data (digits against
        shuffled digits: OOD AUC 0.940 against 0.925 for the raw softmax and 0.898
        with ``"subspace"``; ``docs/valla.md``). ``"subspace"``: the NTK restricted
        to the span of the inducing pairs' Jacobian rows (its Nystrom approximation
        ``Q = Kxz Kzz^-1 Kzx``), LLA on the ``M``-dimensional parameter subspace
        those rows span. ``"subspace+kfac"``, ``"subspace+diagonal"``,
        ``"subspace+complement"``: ``"subspace"`` plus a KFAC or diagonal posterior
        for the other directions (see :class:`VaLLARegressor`, whose default is
        ``"subspace+complement"``).
    init : {"optimal", "identity"}, default="optimal"
        Where Adam starts. ``"optimal"``: the optimal variational factor for the
        k-means inducing points (the papers' Proposition 3, formed on up to 2,000
        training rows), and the learned variances that minimise the objective
        there. ``"identity"``: the papers' ``L = I``,
        ``prior_variance = ||theta_hat||^2 / P`` and the network's mean squared
        training residual as noise.
    prior_variance : float or "auto", default="auto"
        ``s0^2``. ``"auto"``: ``||theta_hat||^2 / P`` (the ``weight_norm`` rule of the
        library's LLA classifiers): with a confident network the objective barely
        constrains ``s0^2`` and learns values 40-80 times larger that leave the
        predictive under-confident in distribution (measured in ``docs/valla.md``).
        A float is kept fixed (and no temperature is calibrated).
    alpha : float, default=1.0
        The alpha of the energy (1: the paper's, closed form with the probit
        approximation; ``0 <= alpha < 1`` uses Monte Carlo).
    learning_rate : float, default=1e-3
        Adam's learning rate (the paper's).
    max_iter : int, default=10000
        Largest number of Adam steps.
    batch_size : int, default=100
        Rows per Adam step (and per forward pass at prediction).
    early_stopping : bool, default=True
        Stop after ``n_iter_no_change`` checks, every ``validation_freq`` steps,
        without an improvement of more than ``tol``, and keep the state of the best
        check (the start included). ``False`` runs ``max_iter`` steps.
    stopping : {"objective", "auto"}, default="objective"
        What the checks score. ``"objective"``: the training objective, exactly, on
        a fixed set of up to 2,000 training rows (the minibatch loss averaged
        between checks when ``learn_inducing=True`` or ``init="identity"``); held-out
        rows are then used only to calibrate the predictive after the fit.
        ``"auto"``: the held-out NLL when there are held-out rows (the papers'
        early stopping), else the objective.
    validation_freq : int or "auto", default="auto"
        Steps between checks. ``"auto"``: 20 when the checks score the objective on
        the fixed monitor rows or held-out NLL (exact scores, no minibatch noise),
        50 when they average the minibatch loss.
    n_iter_no_change : int, default=3
        Checks without improvement before stopping.
    tol : float, default=1e-3
        A check improves on the best score ``b`` (a per-point negative objective or
        NLL) when it is lower by more than ``tol * max(1, |b|)``.
    validation_fraction : float, default=0.1
        Fraction of the rows held out from training when ``fit`` trains the network
        (``net=None`` or an unfitted skorch net) and no ``validation_data`` is
        given; those rows calibrate the predictive.
    learn_inducing : bool, default=False
        Learn ``Z`` too (gradients through ``J(Z)``: second derivatives of the
        network, at several times the cost of a step). Off by default: with
        ``covariance="subspace"`` the mean term of the KL depends on ``Z`` and
        moving ``Z`` to shrink it drives the prior variance towards zero (measured
        in ``docs/valla.md``), and the optimal start is exact only for a fixed ``Z``.
    energy_link : {"probit", "mc"}, default="probit"
        How ``E_Q p(y | f)`` is computed in the objective.
    link_approx : {"probit", "mc", "bridge"}, default="probit"
        Approximation of ``E softmax(f)`` at prediction.
    n_samples_predict : int, default=512
        Samples per point for ``link_approx="mc"``.
    classes : array-like or None, default=None
        The label of each network output, in output order (see
        :class:`~sklearn_lla.LLAClassifier`).
    trainable_only : bool, default=True
        Linearise only parameters with ``requires_grad=True``.
    device : str or torch.device, default="auto"
        ``"auto"`` (CUDA when available), ``"cpu"``, ``"cuda"`` or a torch device.
    random_state : int, RandomState instance or None, default=None
        Seeds k-means, the start's row subsets, the minibatch order, net training and
        Monte Carlo draws.
    verbose : int or bool, default=0
        ``>= 1`` shows a progress bar.

    Attributes
    ----------
    classes_ : ndarray
        Class labels, in the order of ``predict_proba``'s columns.
    prior_variance_ : float
        ``s0^2``.
    temperature_ : float
        The temperature of the predictive (1 unless calibrated on held-out rows).
    covariance_scale_ : float
        Scale of the latent covariance calibrated on held-out rows (1.0 unless the
        temperature alone left their NLL above the network's own; see
        :func:`~sklearn_lla._core.calibration.calibrate_classification`).
    inducing_inputs_ : ndarray of shape (n_inducing, n_features_flat)
        The inducing inputs ``Z`` (flattened inputs).
    inducing_outputs_ : ndarray of shape (n_inducing,)
        The output index (regression target or class logit) each one carries.
    n_iter_ : int
        Adam steps taken.
    stopping_scores_ : list of tuple
        ``(step, score)`` at each early-stopping check (step 0: the start): the
        negative objective per row, or the held-out NLL with ``stopping="auto"``.
    kl_ : float
        The fitted ``KL(q || p)``, covariance and mean parts.
    complement_ : {"kfac", "diagonal"} or None
        The posterior of the directions outside the inducing pairs' span
        (``covariance="subspace+..."``), ``None`` without one.
    hyper_strategy_ : str
        ``"weight_norm"`` (``"auto"``) or ``"fixed"``.
    hyper_trace_ : dict
        The optimisation history (see :class:`VaLLARegressor`).
    likelihood_ : Categorical or Bernoulli
        The likelihood.
    net_ : object
        The pretrained or trained network.
    linearized_net_ : LinearizedNet
        The frozen functional view of the network.
    jacobian_backend_ : str
        ``"structured"`` (layer-wise NTK), ``"graph"`` or ``"functorch"``.
    jacobian_backend_reason_ : str
        Why that backend was chosen.
    validation_source_ : str or None
        Where the held-out rows came from, or ``None``.
    conformal_scores_ : dict of str to ndarray of shape (n_cal,)
        Sorted split-conformal scores of the true labels (a dict by set
        method) of the held-out rows (set by
        ``fit`` when it had held-out rows, or by :meth:`conformalize`); used by
        :meth:`predict_set`. Absent when the estimator is not calibrated.
    conformal_n_ : int
        Number of calibration rows.
    conformal_source_ : str
        Where they came from: ``validation_source_`` of ``fit``, or ``"conformalize"``.
    posterior_ : VaLLAPosterior
        The fitted posterior.
    n_outputs_ : int
        Number of network outputs.
    n_features_in_ : int
        Number of input features.
    feature_names_in_ : ndarray of shape (n_features_in_,)
        Feature names, when ``X`` has string column names.

    See Also
    --------
    LLAClassifier : Exact LLA, which VaLLA approximates.

    Examples
    --------
    >>> from sklearn.datasets import make_blobs
    >>> from sklearn_lla import VaLLAClassifier
    >>> X, y = make_blobs(n_samples=120, centers=3, random_state=0)
    >>> clf = VaLLAClassifier(n_inducing=12, max_iter=100, random_state=0).fit(X, y)
    >>> clf.predict_proba(X[:2]).shape
    (2, 3)
    """

    _parameter_constraints = {**CLASSIFIER_CONSTRAINTS, **_VaLLAMixin._valla_constraints}

    def __init__(self, net=None, *, n_inducing=100, covariance="full", init="optimal",
                 prior_variance="auto", alpha=1.0, learning_rate=1e-3, max_iter=10000,
                 batch_size=100, early_stopping=True, stopping="objective",
                 validation_freq="auto", n_iter_no_change=3, tol=1e-3, validation_fraction=0.1,
                 learn_inducing=False, energy_link="probit", link_approx="probit",
                 n_samples_predict=512, classes=None, trainable_only=True, device="auto",
                 random_state=None, verbose=0):
        self.net = net
        self.n_inducing = n_inducing
        self.covariance = covariance
        self.init = init
        self.prior_variance = prior_variance
        self.alpha = alpha
        self.learning_rate = learning_rate
        self.max_iter = max_iter
        self.batch_size = batch_size
        self.early_stopping = early_stopping
        self.stopping = stopping
        self.validation_freq = validation_freq
        self.n_iter_no_change = n_iter_no_change
        self.tol = tol
        self.validation_fraction = validation_fraction
        self.learn_inducing = learn_inducing
        self.energy_link = energy_link
        self.link_approx = link_approx
        self.n_samples_predict = n_samples_predict
        self.classes = classes
        self.trainable_only = trainable_only
        self.device = device
        self.random_state = random_state
        self.verbose = verbose
