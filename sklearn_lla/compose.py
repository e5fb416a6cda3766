"""A target transformer that carries the predictive uncertainty back to ``y``'s scale.

A network is often trained on transformed targets (standardised, min-max scaled).
Its Laplace estimator must then be fitted on the same transformed targets, and its
predictions mapped back. scikit-learn's
:class:`sklearn.compose.TransformedTargetRegressor` maps the mean only: its
``predict(X, return_std=True)`` fails, since it inverse-transforms whatever the
regressor returns as one array. :class:`TransformedTargetRegressor` here is a
drop-in subclass (the same parameters) that also maps

* ``predict(X, return_std=True)`` / ``return_cov=True`` for an **affine**
  transformer, per target (``StandardScaler``, ``MinMaxScaler``, ``MaxAbsScaler``,
  ``RobustScaler``): the mean through ``inverse_transform``, the std times the
  transformer's scale ``|b|`` (the covariance times ``b^2``);
* ``sample_y`` for any transformer acting on each target on its own: every draw
  goes through ``inverse_transform``;
* ``conformalize`` (``y_cal`` transformed) and ``predict_interval`` (bounds through
  ``inverse_transform``): exact for a monotone transformation of each target (every
  affine one, a log, Box-Cox / Yeo-Johnson, quantile transforms), since a monotone
  map keeps which points an interval holds, and with them its coverage;
* ``validation_data=(X_val, y_val)`` passed to ``fit``: ``y_val`` goes through the
  fitted transformer before the regressor sees it.

A non-affine transformer (a log) has no std on ``y``'s scale to report:
``return_std`` raises a ValueError saying so (use ``sample_y`` or
``predict_interval``).
"""

from __future__ import annotations

import numpy as np
from sklearn.compose import TransformedTargetRegressor as _SkTTR
from sklearn.utils.metaestimators import available_if
from sklearn.utils.validation import check_is_fitted

from ._deferred import DeferredPair, split_pair

__all__ = ["TransformedTargetRegressor"]

#: Points (in transformed units) at which the inverse transformation is probed.
_PROBES = (-3.0, -1.0, 0.5, 1.0, 2.0, 5.0)

#: Relative tolerance of the affinity and separability probes.
_RTOL = 1e-6


def _regressor_has(attr):
    def check(self):
        reg = self.regressor_ if hasattr(self, "regressor_") else self.regressor
        return reg is not None and hasattr(reg, attr)

    return check


class TransformedTargetRegressor(_SkTTR):
    """Regress on a transformed target, with the uncertainty mapped back to ``y``.

    A drop-in replacement of :class:`sklearn.compose.TransformedTargetRegressor`
    (the same parameters and fitted attributes) for the regressors of
    ``sklearn_lla``: ``predict(X, return_std=True)``, ``return_cov``, ``sample_y``,
    ``conformalize``, ``predict_interval`` and ``fit``'s ``validation_data`` work
    on ``y``'s own scale. Use it when the network was trained on transformed targets:
    ``TransformedTargetRegressor(LLARegressor(net), transformer=StandardScaler())``
    fits a fresh ``StandardScaler`` on the ``y`` given to ``fit`` (the same one the
    network was trained with, when ``fit`` gets the network's training rows), fits
    the Laplace posterior on the standardised targets, and reports on ``y``'s scale.

    Parameters
    ----------
    regressor : object, default=None
        The regressor (an ``sklearn_lla`` regressor for the uncertainty methods).
    transformer : object, default=None
        Transformer of ``y`` (cloned and fitted on ``y``). ``return_std`` and
        ``return_cov`` need it affine per target.
    func : callable, default=None
        Forward function, used with ``inverse_func`` instead of ``transformer``.
    inverse_func : callable, default=None
        Inverse of ``func``.
    check_inverse : bool, default=True
        Check that ``transform`` then ``inverse_transform`` gives ``y`` back.

    Attributes
    ----------
    regressor_ : object
        The fitted regressor (on transformed targets).
    transformer_ : object
        The fitted transformer.
    n_features_in_ : int
        Number of features of ``X``.

    See Also
    --------
    sklearn.compose.TransformedTargetRegressor : The scikit-learn original (mean only).

    Examples
    --------
    >>> import numpy as np
    >>> from sklearn.preprocessing import StandardScaler
    >>> from sklearn_lla import LLARegressor
    >>> from sklearn_lla.compose import TransformedTargetRegressor
    >>> rng = np.random.RandomState(0)
    >>> X = rng.uniform(-2, 2, (80, 1))
    >>> y = 100 + 30 * np.sin(2 * X[:, 0]) + 3 * rng.randn(80)
    >>> reg = TransformedTargetRegressor(LLARegressor(random_state=0),
    ...                                  transformer=StandardScaler()).fit(X, y)
    >>> mean, std = reg.predict(X[:3], return_std=True)  # on y's scale
    >>> mean.shape, bool((std > 1).all())
    ((3,), True)
    """

    # -- fit ----------------------------------------------------------------------
    def fit(self, X, y, **fit_params):
        """Fit the transformer on ``y``, then the regressor on the transformed ``y``.

        Parameters
        ----------
        X : array-like of shape (n_samples, n_features)
            Training inputs.
        y : array-like of shape (n_samples,) or (n_samples, n_targets)
            Targets on their own scale.
        **fit_params : dict
            Passed to the regressor's ``fit`` (routed, with metadata routing on). A
            ``validation_data=(X_val, y_val)`` has ``y_val`` on ``y``'s scale: it is
            transformed by the fitted transformer before the regressor reads it.

        Returns
        -------
        self : object
            The fitted estimator.
        """
        if fit_params.get("validation_data") is not None:
            Xv, yv = split_pair(fit_params["validation_data"])
            fit_params = {**fit_params,
                          "validation_data": DeferredPair(Xv, yv, transform_y=self._to_inner)}
        return super().fit(X, y, **fit_params)

    def _to_inner(self, y):
        """``y`` (original scale) through the fitted transformer, shaped like ``fit``'s."""
        y = np.asarray(y, dtype=np.float64)
        one = y.ndim == 1
        yt = np.asarray(self.transformer_.transform(y.reshape(len(y), -1)))
        return yt.reshape(len(y)) if one and yt.ndim == 2 and yt.shape[1] == 1 else yt

    def _to_outer(self, yt):
        """Transformed values ``(n,)`` or ``(n, C)`` back on ``y``'s scale, same shape."""
        yt = np.asarray(yt, dtype=np.float64)
        y = np.asarray(self.transformer_.inverse_transform(yt.reshape(len(yt), -1)))
        return y.reshape(yt.shape)

    # -- the transformer's shape --------------------------------------------------
    def _n_targets(self):
        return int(self.regressor_.n_outputs_) if hasattr(self.regressor_, "n_outputs_") \
            else 1

    def _linear_part(self, need_affine, what):
        """``(offset, scale)`` per target of the inverse transformation, checked.

        Raises a ValueError when the inverse mixes targets (always) or, with
        ``need_affine``, is not affine.
        """
        C = self._n_targets()
        inv = self.transformer_.inverse_transform
        base = np.asarray(inv(np.zeros((1, C)))).reshape(C)
        unit = np.asarray(inv(np.eye(C))).reshape(C, C) - base
        scale = np.diag(unit).copy()
        tol = _RTOL * (np.abs(base) + np.abs(scale) + 1.0)
        off = unit - np.diag(scale)
        if (np.abs(off) > tol[None, :]).any():
            raise ValueError(
                f"{what} maps each target on its own through the transformer's "
                f"inverse_transform; {type(self.transformer_).__name__} mixes the targets")
        if need_affine:
            z = np.repeat(np.asarray(_PROBES)[:, None], C, axis=1)
            got = np.asarray(inv(z)).reshape(z.shape)
            want = base + z * scale
            if not np.allclose(got, want, rtol=_RTOL, atol=0.0) or not (scale != 0).all():
                name = (type(self.transformer_).__name__ if self.transformer is not None
                        else "the func / inverse_func pair")
                raise ValueError(
                    f"{what} needs an affine target transformation (StandardScaler, "
                    f"MinMaxScaler, MaxAbsScaler, RobustScaler): only then is the std on "
                    f"y's scale the transformed std times a constant. {name} is not affine "
                    "(a log is not); use sample_y (draws mapped through inverse_transform) "
                    "or predict_interval (bounds mapped through it, exact for a monotone "
                    "transformation) instead")
        return base, scale

    # -- prediction -----------------------------------------------------------------
    def predict(self, X, return_std=False, return_cov=False, **predict_params):
        """Predict on ``y``'s scale, optionally with the std or covariance of ``y``.

        Parameters
        ----------
        X : array-like of shape (n_samples, n_features)
            Query points.
        return_std : bool, default=False
            Also return the predictive std on ``y``'s scale (affine transformer).
        return_cov : bool, default=False
            Also return the joint predictive covariance on ``y``'s scale (affine
            transformer).
        **predict_params : dict
            Further parameters of the regressor's ``predict``.

        Returns
        -------
        y_mean : ndarray of shape (n_samples,) or (n_samples, n_targets)
            The regressor's prediction through ``inverse_transform``.
        y_std : ndarray of the shape of ``y_mean``
            Returned when ``return_std`` is true: the regressor's std times the
            transformer's ``|scale|`` per target.
        y_cov : ndarray
            Returned when ``return_cov`` is true: the regressor's covariance times
            ``scale ** 2`` per target.
        """
        if not (return_std or return_cov):
            return super().predict(X, **predict_params)
        check_is_fitted(self)
        if return_std and return_cov:
            raise ValueError("at most one of return_std or return_cov can be requested")
        _, scale = self._linear_part(True, "return_std" if return_std else "return_cov")
        mean, spread = self.regressor_.predict(X, return_std=return_std,
                                               return_cov=return_cov, **predict_params)
        mean_y = self._to_outer(mean)
        if return_std:
            spread = np.asarray(spread) * (np.abs(scale) if np.ndim(spread) == 2
                                           else abs(scale[0]))
        else:
            spread = np.asarray(spread) * (scale ** 2 if np.ndim(spread) == 3
                                           else scale[0] ** 2)
        return mean_y, spread

    @available_if(_regressor_has("sample_y"))
    def sample_y(self, X, n_samples=1, random_state=0):
        """Joint draws of ``y`` on its own scale: the regressor's draws, inverse-transformed.

        Parameters
        ----------
        X : array-like of shape (n_samples_X, n_features)
            Query points.
        n_samples : int, default=1
            Number of joint draws.
        random_state : int, RandomState instance or None, default=0
            Seed of the draws.

        Returns
        -------
        y_samples : ndarray
            Shape (n_samples_X, n_samples), or (n_samples_X, n_targets, n_samples).
        """
        check_is_fitted(self)
        self._linear_part(False, "sample_y")
        draws = np.asarray(self.regressor_.sample_y(X, n_samples=n_samples,
                                                    random_state=random_state))
        if draws.ndim == 2:  # (n, S): one target
            return self._to_outer(draws.T.reshape(-1)).reshape(draws.T.shape).T
        n, C, S = draws.shape
        flat = draws.transpose(0, 2, 1).reshape(n * S, C)
        return self._to_outer(flat).reshape(n, S, C).transpose(0, 2, 1)

    @available_if(_regressor_has("conformalize"))
    def conformalize(self, X_cal, y_cal):
        """Calibrate the regressor's conformal intervals on rows the network did not fit.

        Parameters
        ----------
        X_cal : array-like of shape (n_cal, n_features)
            Calibration inputs.
        y_cal : array-like of shape (n_cal,) or (n_cal, n_targets)
            Calibration targets on ``y``'s scale (transformed here).

        Returns
        -------
        self : object
            The estimator, its ``regressor_`` calibrated.
        """
        check_is_fitted(self)
        self.regressor_.conformalize(X_cal, self._to_inner(y_cal))
        return self

    @available_if(_regressor_has("predict_interval"))
    def predict_interval(self, X, confidence=0.9):
        """Conformal intervals on ``y``'s scale: the regressor's bounds, inverse-transformed.

        A monotone transformation of each target keeps the coverage of the
        transformed intervals exactly (a decreasing one swaps the bounds, handled).

        Parameters
        ----------
        X : array-like of shape (n_samples, n_features)
            Query points.
        confidence : float, default=0.9
            Target coverage in (0, 1).

        Returns
        -------
        lower, upper : ndarray of shape (n_samples,) or (n_samples, n_targets)
            Bounds on ``y``'s scale.
        """
        check_is_fitted(self)
        self._linear_part(False, "predict_interval")
        lo, hi = self.regressor_.predict_interval(X, confidence=confidence)
        a, b = self._to_outer(lo), self._to_outer(hi)
        return np.minimum(a, b), np.maximum(a, b)
