"""The scikit-learn skin shared by every estimator.

A method module provides a *posterior*: a plain torch object built by
``_fit_posterior`` whose ``predict(lin, x, full_cov=False)`` returns the network
outputs ``g(x)`` of shape (B, C) and the latent covariance ``S(x)`` (B, C, C), or the
joint (B*C, B*C) covariance with ``full_cov=True``. Everything else lives here once:
parameter and input validation, resolving and checking the network, devices and
seeding, label encoding, batching, and the public ``predict`` / ``predict_proba`` /
``sample_y`` built on (mean, cov).
"""

from __future__ import annotations

import numpy as np
import torch
from sklearn.base import BaseEstimator, ClassifierMixin, RegressorMixin, clone
from sklearn.utils import check_random_state
from sklearn.utils.multiclass import check_classification_targets
from sklearn.utils.validation import check_is_fitted, validate_data

from ._likelihoods import LINK_APPROXIMATIONS, predictive_proba
from ._linearize import LinearizedNet
from ._net import is_pretrained, resolve_net
from ._utils import (
    as_tensor,
    check_positive_int,
    check_positive_or_auto,
    iter_batches,
    resolve_device,
    safe_cholesky,
    torch_seed,
)

__all__ = ["LaplaceRegressorMixin", "LaplaceClassifierMixin", "FitData", "NET_PARAM_DOC"]

#: numpydoc entry of the ``net`` parameter, shared by every estimator's docstring.
NET_PARAM_DOC = """
    net : None, skorch net, FrozenEstimator or torch.nn.Module, default=None
        The network. ``None`` trains a small tanh MLP (MAP, weight decay) in ``fit``;
        a fitted skorch net, ``FrozenEstimator(net)`` or an ``nn.Module`` is used as it
        is and never modified; an unfitted skorch net is trained in ``fit``."""


class FitData:
    """What ``_fit_posterior`` receives.

    Attributes
    ----------
    lin : LinearizedNet
    X : Tensor (n, n_features) in the network's dtype, on ``device``
    y : Tensor, float64 (n, C) targets for regression, int64 (n,) class indices
    X_val, y_val : Tensor or None
        Validation data given to ``fit`` (same formats), if any.
    n_outputs : int
    device : torch.device
    seed : int
    generator : torch.Generator seeded from ``random_state`` (on ``device``)
    """

    def __init__(self, lin, X, y, n_outputs, device, seed, X_val=None, y_val=None):
        self.lin = lin
        self.X = X
        self.y = y
        self.X_val = X_val
        self.y_val = y_val
        self.n_outputs = n_outputs
        self.device = device
        self.seed = seed
        self.generator = torch.Generator(device=device).manual_seed(seed)


class _LaplaceBase(BaseEstimator):
    """Validation, net resolution and batching common to regressors and classifiers."""

    _task = None  # "regression" | "classification"

    # -- cloning ------------------------------------------------------------
    def __sklearn_clone__(self):
        # sklearn.clone would turn a fitted skorch net into an unfitted one (it
        # re-instantiates its module): keep a pretrained net as it is instead, so a
        # GridSearchCV over prior_variance never retrains it. Sharing is safe: the
        # estimators never modify a pretrained net.
        params = self.get_params(deep=False)
        new = {
            k: (v if k == "net" and is_pretrained(v) else clone(v, safe=False))
            for k, v in params.items()
        }
        return type(self)(**new)

    # -- parameter checks ----------------------------------------------------
    def _check_common_params(self):
        check_positive_or_auto(self.prior_variance, "prior_variance")
        check_positive_int(self.batch_size, "batch_size")
        if not isinstance(self.verbose, (int, np.integer)) or isinstance(self.verbose, bool):
            raise TypeError(f"verbose must be an integer, got {self.verbose!r}")
        return resolve_device(self.device)

    # -- fitting ---------------------------------------------------------------
    def _resolve(self, X, y_net, n_outputs, device):
        seed = torch_seed(self.random_state)
        resolved = resolve_net(self.net, self._task, X, y_net, n_outputs, seed, device)
        lin = LinearizedNet(resolved.module, device, resolved.output_transform)
        Xt = as_tensor(X, lin.dtype, device)
        try:
            C = lin.n_outputs(Xt)
        except Exception as exc:
            raise ValueError(
                f"the network could not be evaluated on X with {X.shape[1]} feature(s): {exc}"
            ) from exc
        return resolved, lin, Xt, C, seed

    def _predict_latent(self, X, full_cov: bool = False):
        """Validated ``X`` -> (mean (n, C), cov) as float64 tensors on the CPU."""
        check_is_fitted(self, "posterior_")
        X = validate_data(self, X, reset=False, dtype=np.float64)
        lin = self.linearized_net_
        Xt = as_tensor(X, lin.dtype, lin.device)
        if full_cov:
            mean, cov = self.posterior_.predict(lin, Xt, full_cov=True)
            return mean.double().cpu(), cov.double().cpu()
        means, covs = [], []
        for sl in iter_batches(Xt.shape[0], self.batch_size):
            m, c = self.posterior_.predict(lin, Xt[sl])
            means.append(m.double().cpu())
            covs.append(c.double().cpu())
        return torch.cat(means), torch.cat(covs)

    def __sklearn_tags__(self):
        tags = super().__sklearn_tags__()
        tags.input_tags.allow_nan = False
        tags.non_deterministic = False
        return tags


class LaplaceRegressorMixin(RegressorMixin, _LaplaceBase):
    """Regression skin: ``fit``, ``predict(return_std, return_cov)``, ``sample_y``."""

    _task = "regression"

    def _check_params(self):
        device = self._check_common_params()
        check_positive_or_auto(self.noise_variance, "noise_variance")
        return device

    def fit(self, X, y):
        """Fit the Laplace posterior of the (pretrained or trained) network.

        Parameters
        ----------
        X : array-like of shape (n_samples, n_features)
            Training inputs.
        y : array-like of shape (n_samples,) or (n_samples, n_targets)
            Targets.

        Returns
        -------
        self : object
            The fitted estimator.
        """
        return self._fit(X, y)

    def _encode_val(self, validation_data, lin):
        if validation_data is None:
            return None, None
        Xv, yv = _split_validation(validation_data)
        Xv = validate_data(self, Xv, reset=False, dtype=np.float64)
        yv = np.asarray(yv, dtype=np.float64)
        if len(yv) != len(Xv):
            raise ValueError(
                f"validation_data has {len(Xv)} inputs but {len(yv)} targets"
            )
        yv = yv.reshape(len(Xv), -1)
        if yv.shape[1] != self.n_outputs_ or not np.isfinite(yv).all():
            raise ValueError("validation_data targets must be finite with the shape of y")
        return (as_tensor(Xv, lin.dtype, lin.device),
                torch.as_tensor(yv, dtype=torch.float64, device=lin.device))

    def _fit(self, X, y, validation_data=None):
        device = self._check_params()
        X, y = validate_data(
            self, X, y, multi_output=True, y_numeric=True, ensure_min_samples=2,
            dtype=np.float64,
        )
        y = np.asarray(y, dtype=np.float64)
        self._y_1d = y.ndim == 1
        y2 = y.reshape(len(y), -1)
        n_targets = y2.shape[1]
        resolved, lin, Xt, C, seed = self._resolve(X, y2, n_targets, device)
        if C != n_targets:
            raise ValueError(
                f"the network has {C} outputs but y has {n_targets} target(s); the net's "
                "output size must match the number of targets"
            )
        self.net_ = resolved.net
        self.linearized_net_ = lin
        self.n_outputs_ = C
        yt = torch.tensor(y2, dtype=torch.float64, device=device)  # copies (read-only input)
        data = FitData(lin, Xt, yt, C, device, seed, *self._encode_val(validation_data, lin))
        self.posterior_ = self._fit_posterior(data)
        self.prior_variance_ = float(self.posterior_.prior_variance)
        self.noise_variance_ = float(self.posterior_.noise_variance)
        return self

    def _shape(self, a: np.ndarray) -> np.ndarray:
        return a[:, 0] if self._y_1d else a

    def predict(self, X, return_std: bool = False, return_cov: bool = False):
        """Predictive mean (the network's output), optionally with std or covariance.

        Parameters
        ----------
        X : array-like of shape (n_samples, n_features)
        return_std : bool, default=False
            Also return the standard deviation of the predictive distribution of
            ``y`` (epistemic variance plus the noise variance).
        return_cov : bool, default=False
            Also return the joint covariance of ``y`` over the query points: shape
            (n_samples, n_samples), or (n_samples, n_samples, n_targets) for
            multi-output ``y`` (covariances across targets are not returned).

        Returns
        -------
        y_mean : ndarray of shape (n_samples,) or (n_samples, n_targets)
        y_std : ndarray, same shape as ``y_mean``, if ``return_std``
        y_cov : ndarray, if ``return_cov``
        """
        if return_std and return_cov:
            raise ValueError("at most one of return_std or return_cov can be requested")
        if not return_cov:
            mean, cov = self._predict_latent(X)
            mean = self._shape(mean.numpy())
            if not return_std:
                return mean
            var = torch.diagonal(cov, dim1=1, dim2=2).clamp_min(0) + self.noise_variance_
            return mean, self._shape(var.sqrt().numpy())
        mean, cov = self._predict_latent(X, full_cov=True)
        n, C = mean.shape
        cov = cov.reshape(n, C, n, C)
        per_target = torch.stack([cov[:, c, :, c] for c in range(C)], dim=-1)
        per_target = per_target + self.noise_variance_ * torch.eye(n, dtype=cov.dtype)[..., None]
        per_target = per_target.numpy()
        return self._shape(mean.numpy()), (per_target[..., 0] if self._y_1d else per_target)

    def sample_y(self, X, n_samples: int = 1, random_state=0):
        """Draw joint samples of ``y`` from the predictive distribution at ``X``.

        The latent function is sampled jointly over all query points and targets, and
        observation noise of variance ``noise_variance_`` is added.

        Parameters
        ----------
        X : array-like of shape (n_samples_X, n_features)
        n_samples : int, default=1
        random_state : int, RandomState instance or None, default=0

        Returns
        -------
        y_samples : ndarray of shape (n_samples_X, n_samples), or
            (n_samples_X, n_targets, n_samples) for multi-output ``y``
        """
        check_positive_int(n_samples, "n_samples")
        rng = check_random_state(random_state)
        mean, cov = self._predict_latent(X, full_cov=True)
        n, C = mean.shape
        cov = cov + self.noise_variance_ * torch.eye(n * C, dtype=cov.dtype)
        L = safe_cholesky(cov, "predictive covariance").numpy()
        z = rng.standard_normal((n * C, n_samples))
        draws = (mean.numpy().reshape(-1, 1) + L @ z).reshape(n, C, n_samples)
        return draws[:, 0, :] if self._y_1d else draws

    def __sklearn_tags__(self):
        tags = super().__sklearn_tags__()
        tags.target_tags.multi_output = True
        tags.target_tags.single_output = True
        return tags


class LaplaceClassifierMixin(ClassifierMixin, _LaplaceBase):
    """Classification skin: ``fit``, ``predict_proba``, ``predict``, ``predict_log_proba``."""

    _task = "classification"

    def _check_params(self):
        device = self._check_common_params()
        if self.link_approx not in LINK_APPROXIMATIONS:
            raise ValueError(
                f"link_approx must be one of {LINK_APPROXIMATIONS}, got {self.link_approx!r}"
            )
        check_positive_int(self.n_samples_predict, "n_samples_predict")
        return device

    def fit(self, X, y):
        """Fit the Laplace posterior of the (pretrained or trained) classifier.

        Parameters
        ----------
        X : array-like of shape (n_samples, n_features)
        y : array-like of shape (n_samples,)
            Class labels of any type.

        Returns
        -------
        self : object
        """
        return self._fit(X, y)

    def _encode_labels(self, y):
        classes = self.classes_
        sorter = np.argsort(classes)
        pos = np.clip(np.searchsorted(classes, y, sorter=sorter), 0, len(classes) - 1)
        y_enc = sorter[pos]
        if not np.array_equal(classes[y_enc], y):
            raise ValueError("y contains labels unknown to the network's classes")
        return y_enc

    def _encode_val(self, validation_data, lin):
        if validation_data is None:
            return None, None
        Xv, yv = _split_validation(validation_data)
        Xv = validate_data(self, Xv, reset=False, dtype=np.float64)
        yv = np.asarray(yv)
        if yv.shape != (len(Xv),):
            raise ValueError(
                f"validation_data labels must have shape ({len(Xv)},), got {yv.shape}"
            )
        return (as_tensor(Xv, lin.dtype, lin.device),
                torch.as_tensor(self._encode_labels(yv), dtype=torch.long, device=lin.device))

    def _fit(self, X, y, validation_data=None):
        device = self._check_params()
        X, y = validate_data(self, X, y, ensure_min_samples=2, dtype=np.float64)
        check_classification_targets(y)
        labels = np.unique(y)
        if len(labels) < 2:
            raise ValueError(
                f"the classifier needs samples of at least 2 classes in y; got only one class "
                f"({labels[0]!r})"
            )
        # Encode with the pretrained net's classes when it knows them, so that a
        # cross-validation fold missing a class still maps labels to the right logit.
        pretrained = is_pretrained(self.net)
        classes = labels
        if pretrained:
            resolved, lin, Xt, C, seed = self._resolve(X, None, None, device)
            net_classes = resolved.classes
            if net_classes is not None and len(net_classes) == C:
                known = np.isin(labels, net_classes)
                if known.all():
                    classes = np.asarray(net_classes)
                elif known.any():
                    raise ValueError(
                        f"y contains labels {labels[~known].tolist()} unknown to the "
                        "pretrained network, which was trained on classes "
                        f"{np.asarray(net_classes).tolist()}"
                    )
                # No overlap at all (e.g. string labels for a net trained on 0..C-1):
                # the sorted labels map to the logits by position.
            if C != len(classes):
                raise ValueError(
                    f"the network outputs {C} logits but y has {len(classes)} classes; the "
                    "net's output size must match the number of classes"
                )
        self.classes_ = classes
        y_enc = self._encode_labels(y)
        if not pretrained:
            resolved, lin, Xt, C, seed = self._resolve(X, y_enc, len(classes), device)
            if C != len(classes):
                raise ValueError(
                    f"the network outputs {C} logits but y has {len(classes)} classes"
                )
        self.net_ = resolved.net
        self.linearized_net_ = lin
        self.n_outputs_ = C
        yt = torch.as_tensor(y_enc, dtype=torch.long, device=device)
        data = FitData(lin, Xt, yt, C, device, seed, *self._encode_val(validation_data, lin))
        self.posterior_ = self._fit_posterior(data)
        self.prior_variance_ = float(self.posterior_.prior_variance)
        self._predict_seed = seed
        return self

    def predict_proba(self, X):
        """Predictive class probabilities ``E_{f ~ N(g(x), S(x))} softmax(f)``.

        Uses ``link_approx`` (``probit`` by default; ``mc`` with
        ``n_samples_predict`` samples, reproducible from ``random_state``; ``bridge``).

        Parameters
        ----------
        X : array-like of shape (n_samples, n_features)

        Returns
        -------
        proba : ndarray of shape (n_samples, n_classes), rows summing to one, columns
            in the order of ``classes_``.
        """
        mean, cov = self._predict_latent(X)
        gen = torch.Generator().manual_seed(self._predict_seed)
        p = predictive_proba(mean, cov, self.link_approx, self.n_samples_predict, gen)
        return p.numpy()

    def predict_log_proba(self, X):
        """Logarithm of :meth:`predict_proba`."""
        with np.errstate(divide="ignore"):
            return np.log(self.predict_proba(X))

    def predict(self, X):
        """Most probable class under the predictive distribution.

        Returns
        -------
        y_pred : ndarray of shape (n_samples,) with labels from ``classes_``.
        """
        proba = self.predict_proba(X)
        return self.classes_[np.argmax(proba, axis=1)]


def _split_validation(validation_data):
    try:
        Xv, yv = validation_data
    except (TypeError, ValueError) as exc:
        raise TypeError("validation_data must be a pair (X_val, y_val)") from exc
    return Xv, yv
