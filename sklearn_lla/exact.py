"""Exact linearized Laplace approximation: the reference every approximation is tested against.

The GGN posterior is formed explicitly in float64, either

* in **parameter space** (``P x P``): the feature-space GLM posterior
  (:class:`~sklearn_lla._glm.GLMPosterior`) with the Jacobian itself as features
  (``V = I``), ``S(x) = J(x) H^-1 J(x)^T``;
* in **function space** (``NC x NC``), the dual form with ``Lam = A A^T`` and
  Woodbury, ``S(x) = s0^2 k(x,x) - s0^4 k(x,X) A (I + s0^2 A^T K A)^-1 A^T k(X,x)``,
  which needs no inverse of ``Lam`` (singular for softmax); formed in place, so it
  needs about ``2 (NC)^2`` doubles;
* on the **last layer** only (``subset_of_weights="last_layer"``,
  laplace-torch's default structure): the GLM posterior of the network linearised
  in its last layer's parameters, the other weights held fixed.

Hyperparameters (``"auto"``): the validation NLL when validation data is available
(``fit(..., validation_data=...)``, or rows held out from training a default net),
otherwise the closed-form Laplace evidence (:mod:`sklearn_lla._hyper`).
"""

from __future__ import annotations

import math

import numpy as np
import torch
from sklearn.utils._param_validation import StrOptions

from ._base import (
    CLASSIFIER_CONSTRAINTS,
    REGRESSOR_CONSTRAINTS,
    LaplaceClassifierMixin,
    LaplaceRegressorMixin,
)
from ._glm import GLMPosterior, JacobianFeatures, _check_finite_outputs
from ._hyper import Evidence, Fixed, ValidationGrid, WeightNorm
from ._protocol import LatentPredictive, Posterior
from ._utils import cholesky_inplace, safe_eigh

__all__ = ["FunctionSpacePosterior", "LLARegressor", "LLAClassifier", "MAX_EXACT_DIM"]

#: Largest ``min(P, N*C)`` the exact estimators accept (a dense float64 matrix that
#: size takes 3.2 GB; its decomposition dominates the run time).
MAX_EXACT_DIM = 20_000


def _choose_space(space, n_params, n_rows):
    if space == "auto":
        space = "parameter" if n_params <= n_rows else "function"
    dim = n_params if space == "parameter" else n_rows
    if dim > MAX_EXACT_DIM:
        raise ValueError(
            f"exact LLA in {space} space needs a dense {dim} x {dim} matrix (P={n_params}, "
            f"N*C={n_rows}); the limit is {MAX_EXACT_DIM}. Use subset_of_weights='last_layer', "
            "ELLARegressor/ELLAClassifier or another scalable method for problems this large."
        )
    return space


class FunctionSpacePosterior(Posterior):
    """Exact LLA in its dual (function-space) form.

    Parameters
    ----------
    prior_variance : float or "auto"
    noise_variance : float, "auto" or None
        ``None`` for classification.
    hyper : {"auto", "evidence", "validation"}, default="auto"
        As in :class:`~sklearn_lla._glm.GLMPosterior`.
    """

    fitted_attributes = ("prior_variance", "likelihood", "hyper_strategy", "hyper_trace",
                         "log_evidence")

    def __init__(self, prior_variance="auto", noise_variance=None, hyper="auto",
                 fallback="evidence"):
        self.prior_variance = prior_variance
        self.noise_variance = noise_variance
        self.hyper = hyper
        self.fallback = fallback

    def _sandwich_(self, K, A):
        """``K <- blockdiag(A)^T K blockdiag(A)`` in place (batched over points)."""
        N, C, _ = A.shape
        K4 = K.view(N, C, N, C)
        for i in range(N):  # left: rows of point i
            K4[i] = torch.einsum("ck,cmd->kmd", A[i], K4[i]) if C > 1 else K4[i] * A[i, 0, 0]
        for j in range(N):  # right: columns of point j
            K4[:, :, j, :] = K4[:, :, j, :] @ A[j] if C > 1 else K4[:, :, j, :] * A[j, 0, 0]
        return K

    def fit(self, data):
        """Form ``W = A^T K A``, choose hyperparameters and factorise in place."""
        lin, lik = data.lin, data.likelihood
        N, C = data.n_samples, data.n_outputs
        self.X_, y = data.rows(slice(0, N))
        f = torch.cat([lin.forward(x).double() for x, _ in data.batches()])
        _check_finite_outputs(f, "training rows")
        self.lin = lin
        regression = lik.task == "regression"
        if regression:
            self._A = None
            fit_stat = float(((y - f) ** 2).sum())
        else:
            self._A = lik.lam_factor(f)
            fit_stat = float(lik.log_prob(f, y).sum())
        W = lin.kernel(self.X_, n_outputs=C)  # float64 (NC, NC), the only N^2 buffer kept
        if self._A is not None:
            self._sandwich_(W, self._A)
        theta = lin.flat_params().double()
        theta_sq = float(theta @ theta)
        strategy = self.hyper
        auto = self.prior_variance == "auto" or self.noise_variance == "auto"
        if not auto:
            strategy = "fixed"
        elif strategy == "auto":
            strategy = "validation" if data.validation is not None else self.fallback
        if strategy == "validation" and data.validation is None:
            raise ValueError("hyper_strategy='validation' needs held-out data: pass "
                             "validation_data to fit")
        s2 = self.noise_variance if regression else None
        self._Q = None
        if strategy == "fixed":
            res = Fixed().select(self.prior_variance, s2)
            e = None
        elif strategy == "weight_norm":
            res = WeightNorm().select(self.prior_variance, s2, theta_sq_norm=theta_sq,
                                      n_params=lin.n_params)
            e = None
        elif strategy == "evidence":
            e = torch.linalg.eigvalsh(W).clamp_min(0)  # a transient copy of W
            res = Evidence().select(self.prior_variance, s2, eigvals=e.cpu().numpy(),
                                    theta_sq_norm=theta_sq, data_fit=fit_stat, n_obs=N * C,
                                    n_params=lin.n_params)
        else:
            e, self._Q = safe_eigh(W, "function-space GGN")
            e = e.clamp_min(0)
            del W
            res = self._validate(data, e, fit_stat)
        self.prior_variance = res.prior_variance
        self.noise_variance = res.noise_variance
        self.likelihood = lik.with_noise(res.noise_variance) if regression else lik
        self.hyper_strategy, self.hyper_trace = res.strategy, res.trace
        s0, s2v = self.prior_variance, (res.noise_variance if regression else 1.0)
        self._s2 = s2v
        if self._Q is not None:
            self._dq = 1.0 / (1.0 + (s0 / s2v) * e)
            logdet = float(torch.log1p((s0 / s2v) * e).sum())
        else:  # B = I + (s0 / s2) W, factorised in place
            W.mul_(s0 / s2v)
            W.diagonal().add_(1.0)
            self._L = cholesky_inplace(W, "function-space system matrix")
            logdet = 2.0 * float(torch.log(torch.diagonal(self._L)).sum())
        if regression:
            fit_term = -0.5 * N * C * math.log(2 * math.pi * s2v) - 0.5 * fit_stat / s2v
        else:
            fit_term = fit_stat
        # log Z = log p(y | theta) - |theta|^2 / (2 s0^2) - 1/2 log det(I + s0^2 A^T K A)
        self.log_evidence = fit_term - 0.5 * theta_sq / s0 - 0.5 * logdet
        return self

    def _AtK(self, kXx):
        """``blockdiag(A)^T k(X, x)`` (unit-noise A = I for regression)."""
        if self._A is None:
            return kXx
        N, C, _ = self._A.shape
        return torch.einsum("nck,ncm->nkm", self._A, kXx.reshape(N, C, -1)).reshape(N * C, -1)

    def _reduce(self, AtK):
        """``Z`` with ``Z^T Z = AtK^T B^-1 AtK``."""
        if self._Q is not None:
            return (self._Q.T @ AtK) * self._dq.sqrt()[:, None]
        return torch.linalg.solve_triangular(self._L, AtK, upper=False)

    def _validate(self, data, e, fit_stat):
        stats = []
        C = data.n_outputs
        for x, y in data.validation.batches():
            g = self.lin.forward(x).double()
            kxx = self.lin.ntk_diag_blocks(x).double()
            Z = self._Q.T @ self._AtK(self.lin.kernel(self.X_, x, n_outputs=C))
            stats.append((g, kxx, Z.reshape(len(Z), len(x), C), y))
        lik = data.likelihood
        regression = lik.task == "regression"
        base_noise = None
        if regression:
            base_noise = max(sum(float(((y - g) ** 2).sum()) for g, _, _, y in stats)
                             / sum(y.numel() for *_, y in stats), 1e-12)
        base_prior = max(float(self.lin.flat_params().double().pow(2).mean()), 1e-12)

        def score(s0s, s2s):
            out = np.zeros((len(s0s), len(s2s)))
            n = 0
            for g, kxx, Z, y in stats:
                n += len(g)
                for i, s0 in enumerate(s0s):
                    for j, s2 in enumerate(s2s):
                        s2v = 1.0 if np.isnan(s2) else s2
                        w = 1.0 / (1.0 + (s0 / s2v) * e)
                        red = torch.einsum("kbc,k,kbd->bcd", Z, w, Z)
                        cov = s0 * kxx - (s0 * s0 / s2v) * red
                        lk = lik if np.isnan(s2) else lik.with_noise(s2)
                        out[i, j] -= float(lk.log_predictive(g, cov, y).sum())
            return out / max(n, 1)

        return ValidationGrid().select(self.prior_variance,
                                       self.noise_variance if regression else None,
                                       score=score, base_prior=base_prior,
                                       base_noise=base_noise)

    def predict(self, x):
        """Latent predictive at a batch ``x``."""
        g = self.lin.forward(x).double()
        B, C = g.shape
        Z = self._reduce(self._AtK(self.lin.kernel(self.X_, x, n_outputs=C)))
        Zb = Z.reshape(len(Z), B, C)
        red = torch.einsum("kbc,kbd->bcd", Zb, Zb)
        s0 = self.prior_variance
        cov = s0 * self.lin.ntk_diag_blocks(x).double() - (s0 * s0 / self._s2) * red
        return LatentPredictive(g, 0.5 * (cov + cov.transpose(1, 2)))

    def predict_joint(self, x):
        """Mean (B, C) and joint latent covariance (B*C, B*C)."""
        g = self.lin.forward(x).double()
        C = g.shape[1]
        Z = self._reduce(self._AtK(self.lin.kernel(self.X_, x, n_outputs=C)))
        s0 = self.prior_variance
        cov = s0 * self.lin.kernel(x, n_outputs=C) - (s0 * s0 / self._s2) * (Z.T @ Z)
        return g, 0.5 * (cov + cov.T)


class _LLAMixin:
    """The exact-LLA part shared by :class:`LLARegressor` and :class:`LLAClassifier`."""

    _lla_constraints = {
        "space": [StrOptions({"auto", "parameter", "function"})],
        "subset_of_weights": [StrOptions({"all", "last_layer"})],
    }

    def _linearize_kwargs(self, module, X, device):
        if self.subset_of_weights != "last_layer":
            return {}
        from ._linearize import last_layer_param_names
        from ._protocol import to_batch

        example = to_batch(X, slice(0, min(len(X), 8)), next(module.parameters()).dtype, device)
        return {"param_names": last_layer_param_names(module, example)}

    def _make_posterior(self, data):
        regression = data.likelihood.task == "regression"
        noise = self.noise_variance if regression else None
        space = _choose_space(self.space, data.lin.n_params, data.n_samples * data.n_outputs)
        # without held-out data: the evidence, except for full-network classification
        # where it was measured to wreck calibration (docs/calibration.md)
        full_clf = not regression and self.subset_of_weights == "all"
        fallback = "weight_norm" if full_clf else "evidence"
        if space == "function":
            post = FunctionSpacePosterior(self.prior_variance, noise, self.hyper_strategy,
                                          fallback=fallback)
        else:
            post = GLMPosterior(JacobianFeatures(), self.prior_variance, noise,
                                hyper=self.hyper_strategy, fallback=fallback)
        post.space = space
        return post

    def _store_fitted(self, posterior):
        self.space_ = posterior.space
        self.log_marginal_likelihood_ = posterior.log_evidence
        super()._store_fitted(posterior)


class LLARegressor(_LLAMixin, LaplaceRegressorMixin):
    """Exact linearized Laplace regression (GGN, float64 dense algebra).

    The reference implementation for small problems (``min(P, N * n_targets)`` up to
    20,000): every approximate method is tested against it. With
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
        ``"auto"``: validation NLL when validation data is available, otherwise the
        Laplace log marginal likelihood (see ``hyper_strategy_``).
    noise_variance : float or "auto", default="auto"
        ``s2`` of the Gaussian likelihood, chosen jointly with ``prior_variance``; one
        variance shared by all targets.
    hyper_strategy : {"auto", "evidence", "validation", "weight_norm"}, default="auto"
        How ``"auto"`` variances are chosen: ``"validation"`` (validation NLL on
        held-out rows the network did not fit), ``"evidence"`` (Laplace marginal
        likelihood) or ``"weight_norm"`` (``||theta||^2 / P``). ``"auto"`` uses
        ``"validation"`` when held-out rows exist (``validation_data``, rows held out
        from training a network in ``fit``, or a skorch net's own validation split)
        and the evidence otherwise.
    space : {"auto", "parameter", "function"}, default="auto"
        Where to form the dense posterior: ``P x P`` (parameter) or ``NC x NC``
        (function). ``"auto"`` takes the smaller.
    subset_of_weights : {"all", "last_layer"}, default="all"
        Linearise every trainable parameter, or only those of the last layer (the
        last module with parameters that runs in the forward pass).
    validation_fraction : float, default=0.1
        Fraction of the rows held out from training when ``fit`` trains the network
        (``net=None`` or an unfitted skorch net) and no ``validation_data`` is given;
        those rows choose the ``"auto"`` hyperparameters.
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
        How ``"auto"`` values were chosen (``"evidence"``, ``"validation"`` or
        ``"fixed"``).
    hyper_trace_ : dict
        Candidates tried and their scores.
    log_marginal_likelihood_ : float or None
        Laplace evidence at the chosen hyperparameters (when computed).
    space_ : str
        The space actually used.
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
        ``s0^2`` of the isotropic Gaussian prior. ``"auto"``: validation NLL when
        validation data is available, otherwise the Laplace log marginal likelihood.
    hyper_strategy : {"auto", "evidence", "validation", "weight_norm"}, default="auto"
        How an ``"auto"`` prior variance is chosen: ``"validation"`` (validation NLL
        on held-out rows the network did not fit), ``"evidence"`` (Laplace marginal
        likelihood) or ``"weight_norm"`` (``||theta||^2 / P``). ``"auto"`` uses
        ``"validation"`` when held-out rows exist (``validation_data``, rows held out
        from training a network in ``fit``, or a skorch net's own validation split),
        otherwise the evidence, except with ``subset_of_weights="all"``, where the
        full-network evidence was measured to wreck calibration and
        ``"weight_norm"`` is used.
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
        and no ``validation_data`` is given; those rows choose ``"auto"`` values.
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
        How ``"auto"`` values were chosen.
    hyper_trace_ : dict
        Candidates tried and their scores.
    log_marginal_likelihood_ : float or None
        Laplace evidence at the chosen prior variance (when computed).
    space_ : str
        The space actually used.
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
