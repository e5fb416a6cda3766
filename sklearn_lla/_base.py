"""The scikit-learn skin shared by every estimator.

A method provides a :class:`~sklearn_lla._core.protocol.Posterior` through
``_make_posterior(likelihood)``; everything else lives here once: parameter and
input validation, resolving and checking the network, devices and seeding, label
encoding, the validation data policy, atomic refits, per-batch streaming with
preallocated outputs, and the public ``predict`` / ``predict_proba`` / ``sample_y``
built on the posterior's :class:`~sklearn_lla._core.protocol.LatentPredictive`.

Held-out rows are only ever rows the network did not fit, in order of preference:
the ``validation_data`` passed to ``fit``; rows held out from the network's own
training when ``fit`` trains it (``net=None`` or an unfitted skorch net); a skorch
net's own validation split; otherwise none (``validation_source_`` says which). They
serve early stopping and, after the posterior is fitted on its own objective,
:meth:`~sklearn_lla._core.protocol.Posterior.calibrate` (the noise variance of a
regressor, a temperature of a classifier); rows of the training set are never carved
out as validation (``docs/hyperparameters.md``).
"""

from __future__ import annotations

import abc
from numbers import Integral, Real

import numpy as np
import torch
from sklearn.base import BaseEstimator, ClassifierMixin, RegressorMixin, clone
from sklearn.utils import check_random_state
from sklearn.utils._param_validation import Interval, StrOptions
from sklearn.utils.multiclass import check_classification_targets
from sklearn.utils.validation import (
    _check_y,
    check_consistent_length,
    check_is_fitted,
    validate_data,
)

from ._checks import check_input_width, check_target_scale
from ._conformal import ConformalClassifierMixin, ConformalRegressorMixin, calibrate_held_out
from ._core import dask as _dask
from ._core.hyper import GLM_STRATEGIES, STRATEGIES
from ._core.likelihoods import Bernoulli, Categorical, Gaussian, point_normals, row_keys
from ._core.linalg import cholesky
from ._core.protocol import FitData, check_finite_outputs, holdout_rows, to_batch
from ._core.utils import int_seed, module_dtype, resolve_device, torch_seed
from ._network.linearized import LinearizedNet
from ._network.resolve import is_pretrained, resolve_net, skorch_validation_rows

__all__ = ["LaplaceRegressorMixin", "LaplaceClassifierMixin"]

#: Inputs are validated into one of these dtypes (float32 stays float32).
_FLOAT_DTYPES = (np.float64, np.float32)

#: Fewest training rows from which ``validation_fraction`` rows are held out.
_MIN_ROWS_FOR_HOLDOUT = 20

_COMMON_CONSTRAINTS = {
    "net": "no_validation",
    "prior_variance": [Interval(Real, 0, None, closed="neither"), StrOptions({"auto"})],
    "validation_fraction": [Interval(Real, 0, 1, closed="neither")],
    "device": [str, torch.device],
    "batch_size": [Interval(Integral, 1, None, closed="left")],
    "random_state": ["random_state"],
    "verbose": ["verbose"],
}


def _split_validation(validation_data):
    try:
        Xv, yv = validation_data
    except (TypeError, ValueError) as exc:
        raise TypeError("validation_data must be a pair (X_val, y_val)") from exc
    return Xv, yv


class _MeanStd(tuple):
    """``(mean, std)`` / ``(mean, cov)`` from ``predict(X, return_std=True)`` /
    ``return_cov=True``: a plain tuple, with a clear error for code that expects one
    array (sklearn's ``TransformedTargetRegressor`` reads ``.ndim`` of what ``predict``
    returns)."""

    __slots__ = ()

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        raise AttributeError(
            f"predict(X, return_std=True) (or return_cov=True) returned a (mean, std) (or "
            f"(mean, cov)) tuple, which has no attribute {name!r}: the caller expected one "
            "array. sklearn.compose.TransformedTargetRegressor cannot carry a std through "
            "its transformer; use sklearn_lla.compose.TransformedTargetRegressor (the same "
            "parameters), which maps the std through an affine transformer such as "
            "StandardScaler")

    def __reduce__(self):
        return (tuple, (tuple(self),))


class _LaplaceBase(BaseEstimator, metaclass=abc.ABCMeta):
    """Validation, net resolution, fitting and batching common to every estimator."""

    _task = None  # "regression" | "classification"

    # -- cloning ------------------------------------------------------------
    def __sklearn_clone__(self):
        # sklearn.clone would turn a fitted skorch net into an unfitted one (it
        # re-instantiates its module): keep a pretrained net as it is, so that a
        # GridSearchCV over prior_variance never retrains it. Sharing is safe: the
        # estimators never modify a pretrained net.
        params = self.get_params(deep=False)
        new = {k: (v if k == "net" and is_pretrained(v) else clone(v, safe=False))
               for k, v in params.items()}
        return type(self)(**new)

    def __sklearn_tags__(self):
        tags = super().__sklearn_tags__()
        tags.input_tags.allow_nan = False
        tags.non_deterministic = False
        return tags

    # -- hooks for methods --------------------------------------------------
    @abc.abstractmethod
    def _make_posterior(self, data):  # pragma: no cover - interface
        """The method's unfitted :class:`~sklearn_lla._core.protocol.Posterior` for ``data``."""

    def _store_fitted(self, posterior):
        """Copy method-specific fitted attributes from the posterior (optional)."""

    # -- fitting --------------------------------------------------------------
    def _fit(self, X, y, validation_data):
        self._validate_params()
        for name in ("prior_variance", "noise_variance"):
            if isinstance(getattr(self, name, None), (bool, np.bool_)):
                raise TypeError(f"{name} must be a float > 0 or 'auto', got a bool")
        device = resolve_device(self.device)
        saved = dict(self.__dict__)
        try:
            self._fit_inner(X, y, validation_data, device)
        except BaseException:
            # a failed (re)fit leaves the previous fitted state intact
            self.__dict__.clear()
            self.__dict__.update(saved)
            raise
        return self

    def _holdout(self, n, seed):
        """Row indices (train, validation) for a hold-out, or ``(None, None)``."""
        if n < _MIN_ROWS_FOR_HOLDOUT:
            return None, None
        return holdout_rows(n, self.validation_fraction, torch.Generator().manual_seed(seed + 1))

    def _fit_inner(self, X, y, validation_data, device):
        X, y = self._validate_xy(X, y)
        seed = torch_seed(self.random_state)
        pretrained = is_pretrained(self.net)
        if _dask.is_dask(X) and not pretrained:
            raise ValueError(
                "fit on a dask input needs a pretrained network: training one in fit would "
                "load all of X into memory. Train the net first (e.g. a skorch net on a "
                "sample) and pass it fitted, or pass X.compute() if it fits in memory")
        y_enc, classes = self._encode_targets(y, pretrained)
        train_idx = val_idx = None
        if not pretrained and validation_data is None:
            train_idx, val_idx = self._holdout(len(X), seed)
        Xtr = X if train_idx is None else X[train_idx]
        ytr = y_enc if train_idx is None else y_enc[train_idx]
        resolved = resolve_net(self.net, self._task, Xtr, ytr, self._n_net_outputs(ytr, classes),
                               seed, device)
        lin = self._linearize(resolved, X, device)
        C = lin.n_outputs(to_batch(X, slice(0, 1), lin.dtype, device))
        likelihood, classes, ytr = self._likelihood(C, ytr, classes, resolved, pretrained)
        generator = torch.Generator().manual_seed(seed)
        kw = dict(batch_size=self.batch_size, verbose=self.verbose)
        y_full = ytr if train_idx is None else y_enc  # encoded targets of every row of X
        yt = self._target_tensor(y_full, device)
        if validation_data is not None:
            Xv, yv = self._validation_arrays(validation_data, classes, C)
            validation = FitData(lin, likelihood, Xv, self._target_tensor(yv, device), **kw)
            source = "validation_data"
        else:
            source = "rows held out from training the network" if val_idx is not None else None
            if val_idx is None and pretrained and not _dask.is_dask(X):  # dask: pass them
                rows = skorch_validation_rows(resolved.net, X, y_full, self._task,
                                              module_dtype(resolved.module))
                if rows is not None:
                    (train_idx, val_idx), source = rows, "the skorch net's own validation split"
            validation = (None if val_idx is None
                          else FitData(lin, likelihood, X, yt, index=val_idx, **kw))
        data = FitData(lin, likelihood, X, yt, generator=generator, validation=validation,
                       index=train_idx, **kw)
        posterior, latent = self._fit_posterior(data, generator)
        if self._task == "regression" and pretrained:
            # after the fit: bad rows have been reported there, with their own message
            check_target_scale(lin, X, y_enc, self)
        self._publish(resolved.net, lin, C, posterior, source, seed, classes)
        # split-conformal calibration on the held-out rows, if any (_conformal.py);
        # a refit always drops the previous calibration. The latent predictive the
        # posterior's calibration formed on those rows is reused (one pass over them)
        calibrate_held_out(self, validation, source, latent)

    def _linearize(self, resolved, X, device):
        """The :class:`LinearizedNet` of the resolved network, checked against ``X``."""
        module = resolved.module
        check_input_width(module, X)
        example = to_batch(X, slice(0, min(len(X), 8)), module_dtype(module), device)
        try:
            return LinearizedNet(module, device, resolved.output_transform,
                                 example_input=example, trainable_only=self.trainable_only,
                                 **self._linearize_kwargs(module, X, device))
        except (RuntimeError, TypeError, IndexError) as exc:
            # shape mismatches surface from torch as RuntimeErrors
            raise ValueError(
                f"the network could not be evaluated on X of shape {tuple(X.shape)} "
                f"({X.shape[1]} feature(s)): {exc}. Check that X has the columns the "
                "network was trained on (same features, order and preprocessing)"
            ) from exc

    def _fit_posterior(self, data, generator):
        """Fit the method's posterior on ``data``, then calibrate it on the held-out rows.

        The held-out rows' one use after ``fit``: one scalar (the noise, the scale of
        a rescalable posterior, or a temperature), the posterior covariance kept;
        unless the strategy itself chose the hyperparameters on them.

        Returns the posterior and the :class:`~sklearn_lla._core.calibration.HeldOutLatent`
        its calibration formed on the held-out rows (``None`` if none).
        """
        posterior = self._make_posterior(data).fit(data)
        latent = None
        if data.validation is not None and \
                not STRATEGIES[posterior.hyper_strategy].uses_held_out:
            latent = posterior.calibrate(
                data.validation, generator=generator,
                noise=self._task == "regression" and self.noise_variance == "auto",
                temperature=self._task == "classification" and self.prior_variance == "auto")
        return posterior, latent

    def _publish(self, net, lin, n_outputs, posterior, source, seed, classes):
        """Set the fitted attributes (only once everything succeeded: atomic refits)."""
        self.net_ = net
        self.linearized_net_ = lin
        self.jacobian_backend_ = lin.backend
        self.jacobian_backend_reason_ = lin.backend_reason
        self.n_outputs_ = n_outputs
        self.posterior_ = posterior
        self.likelihood_ = posterior.likelihood
        self.prior_variance_ = float(posterior.prior_variance)
        self.hyper_strategy_ = posterior.hyper_strategy
        self.hyper_trace_ = posterior.hyper_trace
        self.validation_source_ = source
        self._predict_seed = seed
        if classes is not None:
            self.classes_ = classes
        self._store_fitted(posterior)

    def _linearize_kwargs(self, module, X, device):
        return {}

    def _validation_arrays(self, validation_data, classes, n_outputs):
        Xv, yv = _split_validation(validation_data)
        yv = _dask.materialize(yv)
        try:
            if _dask.is_dask(Xv):
                Xv = _dask.validate_X(self, Xv, reset=False)
                Xv = Xv if not any(np.isnan(Xv.chunks[0])) else Xv.compute_chunk_sizes()
            else:
                Xv = validate_data(self, Xv, reset=False, dtype=_FLOAT_DTYPES)
        except ValueError as exc:
            raise ValueError(
                f"validation_data=(X_val, y_val): X_val must be shaped and preprocessed like "
                f"fit's X, (n_val, {self.n_features_in_}) numbers; {exc} (in a Pipeline, pass "
                "validation_data through sklearn_lla.pipeline.LaplacePipeline, which applies "
                "the fitted steps to X_val)") from exc
        yv = self._encode_validation_targets(np.asarray(yv), Xv.shape[0], classes, n_outputs)
        return Xv, yv

    # -- prediction -----------------------------------------------------------
    def _check_X(self, X):
        check_is_fitted(self, "posterior_")
        if _dask.is_dask(X):  # lazily: nothing is computed
            return _dask.validate_X(self, X, reset=False)
        return validate_data(self, X, reset=False, dtype=_FLOAT_DTYPES)

    def _validate_dask_xy(self, X, y):
        """Validate a dask ``X`` lazily and compute ``y`` (one column, in memory)."""
        y = _dask.materialize(y)
        if y is None:
            raise ValueError("requires y to be passed, but the target y is None")
        X = _dask.validate_X(self, X, reset=True)
        check_consistent_length(np.empty((X.shape[0], 0)), y)
        return X, y

    def _no_dask_joint(self, X, what):
        if _dask.is_dask(X):
            raise ValueError(
                f"{what} forms an n x n joint covariance and needs X in memory; pass "
                "X.compute() (a few thousand rows at most)")

    def _predictive_batches(self, X):
        """Yield ``(slice, x_numpy, LatentPredictive)`` per batch (float64, CPU)."""
        lin = self.linearized_net_
        bar = None
        if self.verbose and len(X) > 50 * self.batch_size:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(X), desc=f"{type(self).__name__}: predicting", leave=False)
        for start in range(0, len(X), self.batch_size):
            sl = slice(start, min(start + self.batch_size, len(X)))
            x = to_batch(X, sl, lin.dtype, lin.device)
            lp = self.posterior_.predict(x)
            check_finite_outputs(lp.mean, f"rows {sl.start}..{sl.stop - 1} of X")
            if not bool(torch.isfinite(lp.cov).all()):
                raise FloatingPointError(f"non-finite predictive covariance for rows "
                                         f"{sl.start}..{sl.stop - 1} of X")
            lp.mean, lp.cov = lp.mean.double().cpu(), lp.cov.double().cpu()
            if bar is not None:
                bar.update(sl.stop - sl.start)
            yield sl, lp
        if bar is not None:
            bar.close()

    def _output_batches(self, X):
        """Yield ``(slice, network outputs)`` per batch (float64 numpy)."""
        lin = self.linearized_net_
        for start in range(0, len(X), self.batch_size):
            sl = slice(start, min(start + self.batch_size, len(X)))
            g = lin.forward(to_batch(X, sl, lin.dtype, lin.device)).double().cpu()
            check_finite_outputs(g, f"rows {sl.start}..{sl.stop - 1} of X")
            yield sl, g.numpy()

    def _predict_joint(self, X):
        lin = self.linearized_net_
        x = to_batch(X, slice(0, len(X)), lin.dtype, lin.device)
        mean, cov = self.posterior_.predict_joint(x)
        return mean.double().cpu(), cov.double().cpu()


def _check_classes(classes, n):
    classes = np.asarray(classes)
    if classes.ndim != 1 or len(classes) != n or len(np.unique(classes)) != n:
        raise ValueError(
            f"classes must list {n} distinct labels, one per network output (for a one-logit "
            f"binary net: [negative, positive]); got {classes.tolist()}"
        )
    return classes


def _check_known(y, classes, source):
    known = np.isin(y, classes)
    if not known.all():
        bad = np.unique(y[~known])[:10].tolist()
        raise ValueError(
            f"y contains labels {bad} that are not the network's classes {classes.tolist()} "
            f"(from {source}); pass classes=[...] with the label of each network output, in "
            "output order"
        )


def _encode(y, classes):
    """Indices of labels ``y`` in ``classes`` (all known)."""
    sorter = np.argsort(classes)
    return sorter[np.searchsorted(classes, y, sorter=sorter)].astype(np.int64)


class LaplaceRegressorMixin(RegressorMixin, ConformalRegressorMixin, _LaplaceBase):
    """Regression skin: ``fit``, ``predict(return_std, return_cov)``, ``sample_y``."""

    _task = "regression"

    def fit(self, X, y, validation_data=None):
        """Fit the Laplace posterior of the (pretrained or trained) network.

        Parameters
        ----------
        X : array-like of shape (n_samples, n_features)
            Training inputs.
        y : array-like of shape (n_samples,) or (n_samples, n_targets)
            Targets.
        validation_data : tuple (X_val, y_val), optional
            Held-out data the network did not fit: an ``"auto"`` noise variance is
            calibrated on it (and iterative methods stop early on it); the prior
            variance still comes from the method's objective.

        Returns
        -------
        self : object
            The fitted estimator.
        """
        return self._fit(X, y, validation_data)

    def _validate_xy(self, X, y):
        if _dask.is_dask(X):
            X, y = self._validate_dask_xy(X, y)
            y = _check_y(y, multi_output=True, y_numeric=True, estimator=self)
        else:
            X, y = validate_data(self, X, _dask.materialize(y), multi_output=True,
                                 y_numeric=True, ensure_min_samples=2, dtype=_FLOAT_DTYPES)
        y = np.asarray(y, dtype=np.float64)
        self._y_1d = y.ndim == 1
        return X, y

    def _encode_targets(self, y, pretrained):
        return y.reshape(len(y), -1), None

    def _n_net_outputs(self, y, classes):
        return y.shape[1]

    def _encode_validation_targets(self, yv, n, classes, n_outputs):
        yv = np.asarray(yv, dtype=np.float64)
        if len(yv) != n:
            raise ValueError(f"validation_data has {n} inputs but {len(yv)} targets")
        yv = yv.reshape(n, -1)
        if yv.shape[1] != n_outputs or not np.isfinite(yv).all():
            raise ValueError("validation_data targets must be finite with the shape of y")
        return yv

    def _likelihood(self, C, y, classes, resolved, pretrained):
        if C != y.shape[1]:
            raise ValueError(
                f"the network has {C} outputs but y has {y.shape[1]} target(s); the net's "
                "output size must match the number of targets"
            )
        s2 = self.noise_variance if self.noise_variance != "auto" else 1.0
        return Gaussian(s2, C), None, y

    @staticmethod
    def _target_tensor(y, device):
        return torch.tensor(y, dtype=torch.float64, device=device)  # copies

    def _store_fitted(self, posterior):
        self.noise_variance_ = float(posterior.likelihood.noise_variance)
        super()._store_fitted(posterior)

    def _shape(self, a):
        return a[:, 0] if self._y_1d else a

    def predict(self, X, return_std=False, return_cov=False):
        """Predictive mean (the network's output), optionally with std or covariance.

        Parameters
        ----------
        X : array-like of shape (n_samples, n_features)
            Query points.
        return_std : bool, default=False
            Also return the standard deviation of the predictive distribution of
            ``y`` (epistemic plus noise).
        return_cov : bool, default=False
            Also return the joint covariance of ``y`` over the query points: shape
            (n_samples, n_samples), or (n_samples, n_samples, n_targets) for
            multi-output ``y`` (covariances across targets are not returned).

        Returns
        -------
        y_mean : ndarray of shape (n_samples,) or (n_samples, n_targets)
            Predictive mean.
        y_std : ndarray of the shape of ``y_mean``
            Returned when ``return_std`` is true.
        y_cov : ndarray
            Returned when ``return_cov`` is true.
        """
        if return_std and return_cov:
            raise ValueError("at most one of return_std or return_cov can be requested")
        X = self._check_X(X)
        if _dask.is_dask(X):
            if return_cov:
                self._no_dask_joint(X, "return_cov")
            tail = () if self._y_1d else (self.n_outputs_,)
            if not return_std:
                return _dask.lazy_apply(self, X, "predict", shape_tail=tail)
            both = _dask.lazy_apply(self, X, "predict_std", shape_tail=(2 * self.n_outputs_,))
            C = self.n_outputs_
            mean, std = both[:, :C], both[:, C:]
            return _MeanStd((mean[:, 0], std[:, 0]) if self._y_1d else (mean, std))
        if return_cov:
            mean, cov = self._predict_joint(X)
            n, C = mean.shape
            cov = cov.reshape(n, C, n, C)
            per = torch.stack([cov[:, c, :, c] for c in range(C)], dim=-1)
            per = per + self.noise_variance_ * torch.eye(n, dtype=cov.dtype)[..., None]
            per = per.numpy()
            return _MeanStd((self._shape(mean.numpy()), per[..., 0] if self._y_1d else per))
        n, C = len(X), self.n_outputs_
        mean = np.empty((n, C))
        if not return_std:  # the predictive mean is the network's output: one forward
            for sl, g in self._output_batches(X):
                mean[sl] = g
            return self._shape(mean)
        std = np.empty((n, C))
        for sl, lp in self._predictive_batches(X):
            mean[sl], std[sl] = self._mean_std(lp.mean, lp.cov)
        return _MeanStd((self._shape(mean), self._shape(std)))

    def _mean_std(self, mean, cov):
        """Predictive mean and std ``(n, C)`` (numpy) of the latent ``N(mean, cov)``."""
        m, v = self.likelihood_.predict(mean, cov)
        return m.numpy(), v.sqrt().numpy()

    def sample_y(self, X, n_samples=1, random_state=0):
        """Draw joint samples of ``y`` from the predictive distribution at ``X``.

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
            Shape (n_samples_X, n_samples), or (n_samples_X, n_targets, n_samples)
            for multi-output ``y``.
        """
        if not isinstance(n_samples, Integral) or isinstance(n_samples, bool) or n_samples < 1:
            raise ValueError(f"n_samples must be a positive integer, got {n_samples!r}")
        X = self._check_X(X)
        if _dask.is_dask(X):  # joint within each block; block i seeded by (seed, i)
            tail = ((n_samples,) if self._y_1d else (self.n_outputs_, n_samples))
            return _dask.lazy_apply(self, X, "sample_y", shape_tail=tail, n_samples=n_samples,
                                    seed=int_seed(random_state))
        rng = check_random_state(random_state)
        mean, cov = self._predict_joint(X)
        n, C = mean.shape
        cov = cov + self.noise_variance_ * torch.eye(n * C, dtype=cov.dtype)
        L = cholesky(cov, "predictive covariance").numpy()
        z = rng.standard_normal((n * C, n_samples))
        draws = (mean.numpy().reshape(-1, 1) + L @ z).reshape(n, C, n_samples)
        return draws[:, 0, :] if self._y_1d else draws

    def __sklearn_tags__(self):
        tags = super().__sklearn_tags__()
        tags.target_tags.multi_output = True
        tags.target_tags.single_output = True
        return tags


class LaplaceClassifierMixin(ClassifierMixin, ConformalClassifierMixin, _LaplaceBase):
    """Classification skin: ``fit``, ``predict_proba``, ``predict``, ``predict_log_proba``."""

    _task = "classification"

    def fit(self, X, y, validation_data=None):
        """Fit the Laplace posterior of the (pretrained or trained) classifier.

        Parameters
        ----------
        X : array-like of shape (n_samples, n_features)
            Training inputs.
        y : array-like of shape (n_samples,)
            Class labels: the network's classes (see ``classes``).
        validation_data : tuple (X_val, y_val), optional
            Held-out data the network did not fit: with ``prior_variance="auto"`` a
            temperature of the predictive is calibrated on it (and iterative methods
            stop early on it); the prior variance still comes from the method's
            objective.

        Returns
        -------
        self : object
            The fitted estimator.
        """
        return self._fit(X, y, validation_data)

    def _validate_xy(self, X, y):
        if _dask.is_dask(X):
            X, y = self._validate_dask_xy(X, y)
            y = _check_y(y, estimator=self)
        else:
            X, y = validate_data(self, X, _dask.materialize(y), ensure_min_samples=2,
                                 dtype=_FLOAT_DTYPES)
        check_classification_targets(y)
        return X, y

    def _encode_targets(self, y, pretrained):
        labels = np.unique(y)
        if len(labels) < 2:
            raise ValueError(
                f"the classifier needs samples of at least 2 classes in y; got only one class "
                f"({labels[0]!r})"
            )
        if pretrained:
            # encoded against the network's classes once the net is known (_likelihood)
            return y, None
        if self.classes is not None:
            labels = _check_classes(self.classes, len(self.classes))
            _check_known(y, labels, "the classes parameter")
        return _encode(y, labels), labels

    def _n_net_outputs(self, y, classes):
        return None if classes is None else len(classes)

    def _net_classes(self, resolved, C):
        """The labels of the net's outputs: explicit ``classes``, skorch's, or indices."""
        n = 2 if C == 1 else C
        if self.classes is not None:
            return _check_classes(self.classes, n), "the classes parameter"
        if resolved.classes is not None and len(resolved.classes) == n:
            return np.asarray(resolved.classes), "the skorch net's classes_"
        return np.arange(n), "output indices (the network's classes are unknown)"

    def _likelihood(self, C, y, classes, resolved, pretrained):
        if classes is None:  # pretrained: y holds raw labels
            classes, source = self._net_classes(resolved, C)
            _check_known(y, classes, source)
            y = _encode(y, classes)
        elif C != len(classes) and not (C == 1 and len(classes) == 2):
            raise ValueError(f"the network outputs {C} logits but y has {len(classes)} classes")
        if pretrained and C != 1 and C != len(classes):
            raise ValueError(
                f"the network outputs {C} logits but y has {len(classes)} classes; the net's "
                "output size must match the number of classes")
        if C == 1:
            lik = Bernoulli(self.link_approx, self.n_samples_predict)
        else:
            lik = Categorical(C, self.link_approx, self.n_samples_predict)
        return lik, classes, y

    def _encode_validation_targets(self, yv, n, classes, n_outputs):
        if yv.shape != (n,):
            raise ValueError(f"validation_data labels must have shape ({n},), got {yv.shape}")
        known = np.isin(yv, classes)
        if not known.all():
            raise ValueError(f"validation_data contains labels "
                             f"{np.unique(yv[~known])[:10].tolist()} unknown to the classifier")
        return _encode(yv, classes)

    @staticmethod
    def _target_tensor(y, device):
        return torch.tensor(np.asarray(y, dtype=np.int64), device=device)

    def _store_fitted(self, posterior):
        self.temperature_ = float(getattr(posterior.likelihood, "temperature", 1.0))
        self.covariance_scale_ = float(getattr(posterior.likelihood, "covariance_scale", 1.0))
        super()._store_fitted(posterior)

    def predict_proba(self, X):
        """Predictive class probabilities ``E_{f ~ N(g(x), S(x))} softmax(f)``.

        Uses ``link_approx``; ``"mc"`` draws ``n_samples_predict`` latent samples per
        point from a key derived from the point itself and ``random_state``, so a
        point's probabilities do not depend on the rest of ``X`` or on
        ``batch_size``.

        Parameters
        ----------
        X : array-like of shape (n_samples, n_features)
            Query points.

        Returns
        -------
        proba : ndarray of shape (n_samples, n_classes)
            Rows sum to one; columns in the order of ``classes_``.
        """
        X = self._check_X(X)
        if _dask.is_dask(X):
            return _dask.lazy_apply(self, X, "predict_proba", shape_tail=(len(self.classes_),))
        out = np.empty((len(X), len(self.classes_)))
        for sl, lp in self._predictive_batches(X):
            out[sl] = self._proba(np.asarray(X[sl]), lp.mean, lp.cov)
        return out

    def _proba(self, x, mean, cov):
        """Class probabilities (numpy) at the rows ``x`` of the latent ``N(mean, cov)``."""
        lik = self.likelihood_
        eps = None
        if lik.link_approx == "mc":
            eps = point_normals(row_keys(x, self._predict_seed), lik.n_samples,
                                mean.shape[1])
        return lik.predict(mean, cov, eps=eps).numpy()

    def predict_log_proba(self, X):
        """Logarithm of :meth:`predict_proba`.

        Parameters
        ----------
        X : array-like of shape (n_samples, n_features)
            Query points.

        Returns
        -------
        log_proba : ndarray of shape (n_samples, n_classes)
            Log probabilities, columns in the order of ``classes_``.
        """
        with np.errstate(divide="ignore"):
            return np.log(self.predict_proba(X))

    def predict(self, X):
        """Most probable class under the predictive distribution.

        This is the argmax of :meth:`predict_proba`, the Bayes decision under the
        Laplace predictive. It can differ from the network's own argmax on a few
        points: the link approximation scales each logit by its own latent variance
        (probit: ``g_c / sqrt(1 + pi/8 var_c)``), so a confident class with a large
        variance can drop below a runner-up (``docs/exact.md`` gives the measured
        accuracies). For the network's own decisions use the network
        (``estimator.net_.predict``).

        Parameters
        ----------
        X : array-like of shape (n_samples, n_features)
            Query points.

        Returns
        -------
        y_pred : ndarray of shape (n_samples,)
            Labels from ``classes_``.
        """
        if _dask.is_dask(X):
            X = self._check_X(X)
            return _dask.lazy_apply(self, X, "predict", shape_tail=(),
                                    dtype=np.asarray(self.classes_).dtype)
        proba = self.predict_proba(X)
        return self.classes_[np.argmax(proba, axis=1)]


#: Constraints of the estimators that linearise the network (not FMGP).
LINEARIZED_CONSTRAINTS = {"trainable_only": ["boolean"]}

#: The ``hyper_strategy`` of the GLM-family estimators (exact LLA, ELLA, subspace).
GLM_STRATEGY_CONSTRAINTS = {"hyper_strategy": [StrOptions(set(GLM_STRATEGIES))]}

#: Parameter constraints shared by every estimator (methods extend them).
REGRESSOR_CONSTRAINTS = {
    **_COMMON_CONSTRAINTS,
    "noise_variance": [Interval(Real, 0, None, closed="neither"), StrOptions({"auto"})],
}
CLASSIFIER_CONSTRAINTS = {
    **_COMMON_CONSTRAINTS,
    "link_approx": [StrOptions({"probit", "mc", "bridge"})],
    "n_samples_predict": [Interval(Integral, 1, None, closed="left")],
    "classes": ["array-like", None],
}
