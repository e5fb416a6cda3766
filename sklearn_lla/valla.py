"""``VaLLARegressor`` and ``VaLLAClassifier``: variational linearized Laplace.

The scikit-learn estimators; the NTK kernel and the posterior are in
:mod:`sklearn_lla._posteriors.valla`, on the fixed-mean sparse GP of
:mod:`sklearn_lla._posteriors.gp`.
"""
from __future__ import annotations

from numbers import Integral, Real

import numpy as np
import torch
from sklearn.utils._param_validation import Interval, StrOptions

from ._base import (
    _MIN_ROWS_FOR_HOLDOUT,
    CLASSIFIER_CONSTRAINTS,
    REGRESSOR_CONSTRAINTS,
    LaplaceClassifierMixin,
    LaplaceRegressorMixin,
)
from ._core.protocol import carve_validation
from ._posteriors.valla import VaLLAPosterior

__all__ = ["VaLLARegressor", "VaLLAClassifier"]



# ---------------------------------------------------------------------------------
# Estimators
# ---------------------------------------------------------------------------------


class _VaLLAMixin:
    """VaLLA's parameters and posterior, shared by the regressor and the classifier."""

    _valla_constraints = {
        "n_inducing": [Interval(Integral, 1, None, closed="left")],
        "alpha": [Interval(Real, 0, 1, closed="both")],
        "learning_rate": [Interval(Real, 0, None, closed="neither")],
        "max_iter": [Interval(Integral, 1, None, closed="left")],
        "early_stopping": ["boolean"],
        "validation_freq": [Interval(Integral, 1, None, closed="left")],
        "n_iter_no_change": [Interval(Integral, 1, None, closed="left")],
        "tol": [Interval(Real, 0, None, closed="left")],
        "learn_inducing": ["boolean"],
        "energy_link": [StrOptions({"probit", "mc"})],
        "validation_fraction": [Interval(Real, 0, 1, closed="neither")],
    }

    def _make_posterior(self, data):
        self._carved = False
        if (self.early_stopping and data.validation is None
                and data.n_samples >= _MIN_ROWS_FOR_HOLDOUT):
            data.validation = carve_validation(data, self.validation_fraction)
            self._carved = True
        regression = data.likelihood.task == "regression"
        seed = int(torch.randint(0, 2**31 - 1, (1,), generator=data.generator))
        return VaLLAPosterior(
            prior_variance=self.prior_variance,
            noise_variance=self.noise_variance if regression else None,
            n_inducing=self.n_inducing, alpha=self.alpha, learning_rate=self.learning_rate,
            max_iter=self.max_iter, batch_size=self.batch_size,
            early_stopping=self.early_stopping, validation_freq=self.validation_freq,
            n_iter_no_change=self.n_iter_no_change, learn_inducing=self.learn_inducing,
            energy_link=self.energy_link, random_state=seed, validation_tol=self.tol)

    def _store_fitted(self, posterior):
        self.inducing_inputs_ = posterior.inducing_inputs
        self.inducing_outputs_ = posterior.inducing_outputs
        self.n_iter_ = posterior.n_iter
        self.validation_scores_ = list(posterior.hyper_trace.get("validation", []))
        self.kl_ = float(posterior.hyper_trace.get("kl", np.nan))
        if self._carved:
            self.validation_source_ = "rows held out from the training data (validation_fraction)"
        del self._carved
        super()._store_fitted(posterior)




class VaLLARegressor(_VaLLAMixin, LaplaceRegressorMixin):
    """VaLLA regression: variational LLA with learned prior, noise and inducing points.

    Approximates linearized Laplace (the GP with the network as mean and the scaled
    NTK ``s0^2 J(x) J(x')^T`` as kernel) by a sparse variational GP whose mean stays
    the network: ``n_inducing`` inducing inputs (k-means initialised) and a triangular
    factor, learned with ``log s0^2`` and ``log s2`` by minibatch Adam on the
    alpha-energy, with early stopping on the validation NLL. A step costs the same for
    any number of rows.

    Parameters
    ----------
    net : None, skorch net, FrozenEstimator or torch.nn.Module, default=None
        The network. ``None`` trains a small tanh MLP (MAP, weight decay) in ``fit``;
        a fitted skorch net, ``FrozenEstimator(net)`` or an ``nn.Module`` is used as it
        is and never modified; an unfitted skorch net is trained in ``fit``.
    n_inducing : int, default=100
        ``M``, the number of inducing points (cost ``O(M^3)`` per step).
    prior_variance : float or "auto", default="auto"
        ``s0^2``. ``"auto"``: learned by the objective, initialised at
        ``||theta_hat||^2 / P``; a float is kept fixed.
    noise_variance : float or "auto", default="auto"
        ``s2``. ``"auto"``: learned, initialised at the network's mean squared
        residual on the held-out rows (or the training rows, whichever is larger);
        a float is kept fixed.
    alpha : float, default=1.0
        The alpha of the energy (1: the paper's; 0: the ELBO, which cannot learn
        ``s0^2`` with the mean fixed).
    learning_rate : float, default=1e-3
        Adam's learning rate (the paper's). Larger rates move ``s0^2`` and ``s2``
        past the validation optimum between two checks (measured in
        ``docs/valla.md``).
    max_iter : int, default=10000
        Largest number of Adam steps (the paper: up to 40,000); early stopping
        usually ends the run after a few hundred to a few thousand.
    batch_size : int, default=100
        Rows per Adam step (and per forward pass at prediction).
    early_stopping : bool, default=True
        Check the validation NLL every ``validation_freq`` steps, stop after
        ``n_iter_no_change`` checks without improvement and keep the best state. Needs
        held-out rows: ``validation_data``, the net's own hold-out, or
        ``validation_fraction`` of the training rows.
    validation_freq : int, default=100
        Steps between validation checks.
    n_iter_no_change : int, default=5
        Checks without improvement before stopping.
    tol : float, default=1e-3
        Relative decrease of the validation NLL that counts as an improvement.
    validation_fraction : float, default=0.1
        Fraction of training rows held out for early stopping when no held-out rows
        exist (at least 20 rows needed).
    learn_inducing : bool, default=True
        Learn ``Z`` (gradients through ``J(Z)``: second derivatives of the network).
    energy_link : {"probit", "mc"}, default="probit"
        Unused in regression (closed form); kept for a common signature.
    trainable_only : bool, default=True
        Linearise only parameters with ``requires_grad=True``.
    device : str or torch.device, default="auto"
        ``"auto"`` (CUDA when available), ``"cpu"``, ``"cuda"`` or a torch device.
    random_state : int, RandomState instance or None, default=None
        Seeds k-means, hold-outs, the minibatch order and net training.
    verbose : int or bool, default=0
        ``>= 1`` shows a progress bar.

    Attributes
    ----------
    prior_variance_ : float
        The learned (or fixed) ``s0^2``.
    noise_variance_ : float
        The learned (or fixed) ``s2``.
    inducing_inputs_ : ndarray of shape (n_inducing, n_features_flat)
        The learned inducing inputs ``Z`` (flattened inputs).
    inducing_outputs_ : ndarray of shape (n_inducing,)
        The output index (regression target or class logit) each one carries.
    n_iter_ : int
        Adam steps taken.
    validation_scores_ : list of tuple
        ``(step, validation NLL)`` at each check (empty without held-out rows).
    kl_ : float
        The fitted ``KL`` term of the objective.
    hyper_strategy_ : str
        ``"variational"`` (learned) or ``"fixed"``.
    hyper_trace_ : dict
        The optimisation history (loss per step, validation checks, best step).
    net_ : object
        The pretrained or trained network.
    linearized_net_ : LinearizedNet
        The frozen functional view of the network.
    jacobian_backend_ : str
        ``"structured"`` (layer-wise NTK) or ``"functorch"``.
    jacobian_backend_reason_ : str
        Why that backend was chosen.
    validation_source_ : str or None
        Where the held-out rows came from, or ``None``.
    likelihood_ : Gaussian
        The fitted likelihood.
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

    def __init__(self, net=None, *, n_inducing=100, prior_variance="auto",
                 noise_variance="auto", alpha=1.0, learning_rate=1e-3, max_iter=10000,
                 batch_size=100, early_stopping=True, validation_freq=100, n_iter_no_change=5,
                 tol=1e-3, validation_fraction=0.1, learn_inducing=True, energy_link="probit",
                 trainable_only=True, device="auto", random_state=None, verbose=0):
        self.net = net
        self.n_inducing = n_inducing
        self.prior_variance = prior_variance
        self.noise_variance = noise_variance
        self.alpha = alpha
        self.learning_rate = learning_rate
        self.max_iter = max_iter
        self.batch_size = batch_size
        self.early_stopping = early_stopping
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
    """VaLLA classification: variational LLA with a learned prior and inducing points.

    Approximates linearized Laplace (the GP with the network's logits as mean and the
    scaled NTK as kernel) by a sparse variational GP whose mean stays the network:
    ``n_inducing`` inducing points (k-means per class, each carrying its class logit)
    and a triangular factor, learned with ``log s0^2`` by minibatch Adam on the
    alpha-energy (the probit-scaled softmax's log predictive at alpha = 1), with early
    stopping on the validation NLL.

    Parameters
    ----------
    net : None, skorch net, FrozenEstimator or torch.nn.Module, default=None
        The network. ``None`` trains a small tanh MLP (MAP, weight decay) in ``fit``;
        a fitted skorch net, ``FrozenEstimator(net)`` or an ``nn.Module`` is used as it
        is and never modified; an unfitted skorch net is trained in ``fit``.
    n_inducing : int, default=100
        ``M``; ``M / n_classes`` per class.
    prior_variance : float or "auto", default="auto"
        ``s0^2``. ``"auto"``: learned, initialised at ``||theta_hat||^2 / P``.
    alpha : float, default=1.0
        The alpha of the energy; ``0 < alpha < 1`` uses Monte Carlo.
    learning_rate : float, default=1e-3
        Adam's learning rate (the paper's).
    max_iter : int, default=10000
        Largest number of Adam steps; early stopping usually ends the run sooner.
    batch_size : int, default=100
        Rows per Adam step (and per forward pass at prediction).
    early_stopping : bool, default=True
        Stop on the validation NLL (checked every ``validation_freq`` steps).
    validation_freq : int, default=100
        Steps between validation checks.
    n_iter_no_change : int, default=5
        Checks without improvement before stopping.
    tol : float, default=1e-3
        Relative decrease of the validation NLL that counts as an improvement.
    validation_fraction : float, default=0.1
        Fraction of training rows held out for early stopping when no held-out rows
        exist.
    learn_inducing : bool, default=True
        Learn ``Z``.
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
        Seeds k-means, hold-outs, the minibatch order, net training and ``mc`` draws.
    verbose : int or bool, default=0
        ``>= 1`` shows a progress bar.

    Attributes
    ----------
    classes_ : ndarray
        Class labels, in the order of ``predict_proba``'s columns.
    prior_variance_ : float
        The learned (or fixed) ``s0^2``.
    inducing_inputs_ : ndarray of shape (n_inducing, n_features_flat)
        The learned inducing inputs ``Z`` (flattened inputs).
    inducing_outputs_ : ndarray of shape (n_inducing,)
        The output index (regression target or class logit) each one carries.
    n_iter_ : int
        Adam steps taken.
    validation_scores_ : list of tuple
        ``(step, validation NLL)`` at each check (empty without held-out rows).
    kl_ : float
        The fitted ``KL`` term of the objective.
    hyper_strategy_ : str
        ``"variational"`` (learned) or ``"fixed"``.
    hyper_trace_ : dict
        The optimisation history.
    net_ : object
        The pretrained or trained network.
    linearized_net_ : LinearizedNet
        The frozen functional view of the network.
    jacobian_backend_ : str
        ``"structured"`` or ``"functorch"``.
    jacobian_backend_reason_ : str
        Why that backend was chosen.
    validation_source_ : str or None
        Where the held-out rows came from, or ``None``.
    likelihood_ : Categorical or Bernoulli
        The likelihood.
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

    def __init__(self, net=None, *, n_inducing=100, prior_variance="auto", alpha=1.0,
                 learning_rate=1e-3, max_iter=10000, batch_size=100, early_stopping=True,
                 validation_freq=100, n_iter_no_change=5, tol=1e-3, validation_fraction=0.1,
                 learn_inducing=True, energy_link="probit", link_approx="probit",
                 n_samples_predict=512, classes=None, trainable_only=True, device="auto",
                 random_state=None, verbose=0):
        self.net = net
        self.n_inducing = n_inducing
        self.prior_variance = prior_variance
        self.alpha = alpha
        self.learning_rate = learning_rate
        self.max_iter = max_iter
        self.batch_size = batch_size
        self.early_stopping = early_stopping
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
