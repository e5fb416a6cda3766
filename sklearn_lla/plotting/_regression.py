"""Regression displays: predictive bands, the CQM calibration curve, prediction intervals."""

from __future__ import annotations

import numbers

import numpy as np

from ..metrics import calibration_curve_regression, centered_quantile_metric
from ._common import (
    _check_n_std,
    _estimator_name,
    _get_ax,
    _legend_has,
    _one_feature,
    _select_target,
)

__all__ = ["PredictiveBandDisplay", "CalibrationCurveDisplay", "PredictionIntervalDisplay"]


class PredictiveBandDisplay:
    """Predictive mean and +-k std bands of a regressor with one input feature.

    Build it with :meth:`from_estimator` or :meth:`from_predictions`; the
    constructor only stores the arrays. The bands are ``mean +- k * std`` for each
    ``k`` in ``n_std``, where ``std`` is the standard deviation of the predictive
    distribution of ``y`` (``predict(X, return_std=True)``: the epistemic part and
    the noise).

    Parameters
    ----------
    x : ndarray of shape (n_points,)
        Input values at which the predictive was evaluated, sorted.
    mean : ndarray of shape (n_points,)
        Predictive mean at ``x``.
    std : ndarray of shape (n_points,)
        Predictive standard deviation at ``x``.
    n_std : float or sequence of float, default=(1, 2)
        The multiples ``k`` of ``std`` to draw as bands.
    X_train : ndarray of shape (n_train,), default=None
        Training inputs to scatter (with ``y_train``).
    y_train : ndarray of shape (n_train,), default=None
        Training targets to scatter.
    estimator_name : str, default=None
        Name used in the legend.

    Attributes
    ----------
    line_ : matplotlib.lines.Line2D
        The predictive mean.
    bands_ : list of matplotlib.collections.PolyCollection
        One filled band per entry of ``n_std``, widest first.
    data_ : matplotlib.collections.PathCollection or None
        The training points, if drawn.
    ax_ : matplotlib.axes.Axes
        Axes with the plot.
    figure_ : matplotlib.figure.Figure
        Figure containing the plot.

    See Also
    --------
    CalibrationCurveDisplay : Calibration of the central intervals of the predictive.

    Examples
    --------
    >>> import numpy as np
    >>> from sklearn_lla.plotting import PredictiveBandDisplay
    >>> x = np.linspace(-1, 1, 5)
    >>> disp = PredictiveBandDisplay.from_predictions(x, np.sin(x), 0.1 + x**2, plot=False)
    >>> disp.n_std
    (1.0, 2.0)
    >>> disp.std.round(2).tolist()
    [1.1, 0.35, 0.1, 0.35, 1.1]
    """

    def __init__(self, *, x, mean, std, n_std=(1, 2), X_train=None, y_train=None,
                 estimator_name=None):
        self.x = x
        self.mean = mean
        self.std = std
        self.n_std = n_std
        self.X_train = X_train
        self.y_train = y_train
        self.estimator_name = estimator_name

    def plot(self, ax=None, *, name=None, show_data=True, line_kwargs=None, band_kwargs=None,
             data_kwargs=None):
        """Plot the predictive mean, the bands and the training points.

        Parameters
        ----------
        ax : matplotlib.axes.Axes, default=None
            Axes to plot on; a new figure and axes are created if ``None``.
        name : str, default=None
            Label of the mean in the legend; defaults to ``estimator_name``.
        show_data : bool, default=True
            Scatter ``X_train`` and ``y_train`` when they are set.
        line_kwargs : dict, default=None
            Keyword arguments for :meth:`matplotlib.axes.Axes.plot` of the mean.
        band_kwargs : dict, default=None
            Keyword arguments for :meth:`matplotlib.axes.Axes.fill_between`, applied
            to every band.
        data_kwargs : dict, default=None
            Keyword arguments for :meth:`matplotlib.axes.Axes.scatter` of the data.

        Returns
        -------
        display : PredictiveBandDisplay
            The display, with the artists stored as attributes.
        """
        ax = _get_ax(ax, "PredictiveBandDisplay.plot")
        name = self.estimator_name if name is None else name
        n_std = _check_n_std(self.n_std)
        x, mean, std = (np.asarray(a, dtype=np.float64) for a in (self.x, self.mean, self.std))

        line_kw = {"lw": 2, "label": "predictive mean" if name is None else f"{name} mean"}
        line_kw.update(line_kwargs or {})
        self.line_ = ax.plot(x, mean, **line_kw)[0]
        color = self.line_.get_color()
        self.bands_ = []
        for i, k in enumerate(reversed(n_std)):  # widest first, lighter
            band_kw = {"color": color, "alpha": min(0.15 + 0.15 * i, 0.6), "lw": 0,
                       "label": f"+-{k:g} std"}
            band_kw.update(band_kwargs or {})
            self.bands_.append(ax.fill_between(x, mean - k * std, mean + k * std, **band_kw))

        self.data_ = None
        if show_data and self.X_train is not None and self.y_train is not None:
            data_kw = {"s": 8, "c": "k", "alpha": 0.6, "label": "training data", "zorder": 3}
            data_kw.update(data_kwargs or {})
            self.data_ = ax.scatter(self.X_train, self.y_train, **data_kw)
        ax.set_xlabel("x")
        ax.set_ylabel("y")
        ax.legend(loc="best")
        self.ax_ = ax
        self.figure_ = ax.figure
        return self

    @classmethod
    def from_estimator(cls, estimator, X, y=None, *, grid=None, n_points=200, extent=None,
                       n_std=(1, 2), target=0, name=None, ax=None, plot=True, **kwargs):
        """Evaluate a fitted regressor on a 1-D grid and plot its predictive bands.

        Parameters
        ----------
        estimator : fitted regressor
            Any regressor whose ``predict(X, return_std=True)`` returns
            ``(mean, std)``, such as the sklearn_lla regressors.
        X : array-like of shape (n_samples, 1)
            Inputs, usually the training inputs; they set the grid's default
            extent and are scattered when ``y`` is given.
        y : array-like of shape (n_samples,) or (n_samples, n_outputs), default=None
            Targets of ``X`` to scatter.
        grid : array-like of shape (n_points,) or (n_points, 1), default=None
            Input values to evaluate; overrides ``n_points`` and ``extent``.
        n_points : int, default=200
            Number of evenly spaced grid points.
        extent : tuple of (float, float), default=None
            Interval of the grid; by default the range of ``X`` widened by a
            quarter of its length on each side (to show the uncertainty grow away
            from the data).
        n_std : float or sequence of float, default=(1, 2)
            The multiples of the std drawn as bands.
        target : int, default=0
            The output to plot for a multi-output regressor.
        name : str, default=None
            Name in the legend; defaults to the estimator's class name.
        ax : matplotlib.axes.Axes, default=None
            Axes to plot on; a new figure and axes are created if ``None``.
        plot : bool, default=True
            Call :meth:`plot`; ``False`` only computes the arrays.
        **kwargs : dict
            Passed to :meth:`plot`.

        Returns
        -------
        display : PredictiveBandDisplay
            The display.
        """
        x_data = _one_feature(X)
        n_std = _check_n_std(n_std)
        if grid is not None:
            x = np.sort(_one_feature(grid, "grid"))
        else:
            if not isinstance(n_points, numbers.Integral) or n_points < 2:
                raise ValueError(f"n_points must be an integer >= 2; got {n_points!r}")
            if extent is None:
                lo, hi = float(x_data.min()), float(x_data.max())
                pad = 0.25 * (hi - lo) if hi > lo else 1.0
                extent = (lo - pad, hi + pad)
            lo, hi = (float(v) for v in extent)
            if not (np.isfinite(lo) and np.isfinite(hi) and lo < hi):
                raise ValueError(f"extent must be (low, high) with low < high; got {extent!r}")
            x = np.linspace(lo, hi, int(n_points))
        X_query = x[:, None]
        columns = getattr(X, "columns", None)
        if columns is not None:  # keep the feature name the estimator was fitted with
            import pandas as pd

            X_query = pd.DataFrame(X_query, columns=columns)
        out = estimator.predict(X_query, return_std=True)
        if not isinstance(out, tuple) or len(out) != 2:
            raise TypeError(
                f"{_estimator_name(estimator)}.predict(X, return_std=True) must return "
                "(mean, std)"
            )
        mean, std = out
        y_train = None if y is None else _select_target(y, target, "y")
        if y_train is not None and len(y_train) != len(x_data):
            raise ValueError(f"X and y have {len(x_data)} and {len(y_train)} rows")
        disp = cls(
            x=x, mean=_select_target(mean, target, "mean"), std=_select_target(std, target, "std"),
            n_std=n_std, X_train=x_data if y_train is not None else None, y_train=y_train,
            estimator_name=_estimator_name(estimator) if name is None else name,
        )
        return disp.plot(ax=ax, **kwargs) if plot else disp

    @classmethod
    def from_predictions(cls, x, mean, std, *, X_train=None, y_train=None, n_std=(1, 2),
                         target=0, name=None, ax=None, plot=True, **kwargs):
        """Plot predictive bands from precomputed means and standard deviations.

        Parameters
        ----------
        x : array-like of shape (n_points,) or (n_points, 1)
            Input values; they are sorted (with ``mean`` and ``std``) before plotting.
        mean : array-like of shape (n_points,) or (n_points, n_outputs)
            Predictive means.
        std : array-like of the same shape as ``mean``
            Predictive standard deviations (non-negative).
        X_train : array-like of shape (n_train,) or (n_train, 1), default=None
            Training inputs to scatter.
        y_train : array-like of shape (n_train,) or (n_train, n_outputs), default=None
            Training targets to scatter.
        n_std : float or sequence of float, default=(1, 2)
            The multiples of the std drawn as bands.
        target : int, default=0
            The output to plot when ``mean`` has several columns.
        name : str, default=None
            Name in the legend.
        ax : matplotlib.axes.Axes, default=None
            Axes to plot on; a new figure and axes are created if ``None``.
        plot : bool, default=True
            Call :meth:`plot`; ``False`` only computes the arrays.
        **kwargs : dict
            Passed to :meth:`plot`.

        Returns
        -------
        display : PredictiveBandDisplay
            The display.
        """
        x = _one_feature(x, "x")
        mean = _select_target(mean, target, "mean")
        std = _select_target(std, target, "std")
        if not (len(x) == len(mean) == len(std)):
            raise ValueError(
                f"x, mean and std must have the same length; got {len(x)}, {len(mean)}, "
                f"{len(std)}"
            )
        if not (np.all(np.isfinite(mean)) and np.all(np.isfinite(std))) or np.any(std < 0):
            raise ValueError("mean and std must be finite and std non-negative")
        n_std = _check_n_std(n_std)
        order = np.argsort(x, kind="stable")
        if (X_train is None) != (y_train is None):
            raise ValueError("pass both X_train and y_train, or neither")
        if X_train is not None:
            X_train = _one_feature(X_train, "X_train")
            y_train = _select_target(y_train, target, "y_train")
            if len(X_train) != len(y_train):
                raise ValueError(f"X_train and y_train have {len(X_train)} and {len(y_train)} rows")
        disp = cls(x=x[order], mean=mean[order], std=std[order], n_std=n_std, X_train=X_train,
                   y_train=y_train, estimator_name=name)
        return disp.plot(ax=ax, **kwargs) if plot else disp


class CalibrationCurveDisplay:
    """Coverage of the central prediction intervals of a regressor (CQM curve).

    For each level ``alpha``, ``coverage[i]`` is the fraction of targets inside the
    central ``alpha`` interval of the Gaussian predictive ``N(mean, std^2)``, from
    :func:`sklearn_lla.metrics.calibration_curve_regression`. A calibrated
    predictive lies on the diagonal; a curve below it is over-confident (intervals
    too narrow), above it under-confident. The legend shows the CQM
    (:func:`sklearn_lla.metrics.centered_quantile_metric`, always on the grid
    ``0, 0.1, ..., 1`` whatever ``alphas`` is plotted).

    Parameters
    ----------
    alphas : ndarray of shape (n_alphas,)
        Interval levels (expected coverage).
    coverage : ndarray of shape (n_alphas,)
        Observed coverage ``gamma(alpha)``.
    cqm : float
        The centred quantile metric of the same predictions.
    estimator_name : str, default=None
        Name used in the legend.

    Attributes
    ----------
    line_ : matplotlib.lines.Line2D
        The calibration curve.
    ref_line_ : matplotlib.lines.Line2D or None
        The diagonal, if this call drew it.
    ax_ : matplotlib.axes.Axes
        Axes with the plot.
    figure_ : matplotlib.figure.Figure
        Figure containing the plot.

    See Also
    --------
    sklearn_lla.metrics.calibration_curve_regression : The curve.
    sklearn_lla.metrics.centered_quantile_metric : The CQM.

    Examples
    --------
    >>> from sklearn_lla.plotting import CalibrationCurveDisplay
    >>> disp = CalibrationCurveDisplay.from_predictions(
    ...     [0.0, 3.0], [0.0, 0.0], [1.0, 1.0], plot=False)
    >>> disp.coverage.tolist()
    [0.0, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 1.0]
    >>> round(disp.cqm, 6)
    0.2
    """

    _REF_LABEL = "perfectly calibrated"

    def __init__(self, *, alphas, coverage, cqm, estimator_name=None):
        self.alphas = alphas
        self.coverage = coverage
        self.cqm = cqm
        self.estimator_name = estimator_name

    def plot(self, ax=None, *, name=None, ref_line=True, **kwargs):
        """Plot the coverage curve and the diagonal.

        Several displays can share one ``ax`` to compare estimators; the diagonal
        is drawn once.

        Parameters
        ----------
        ax : matplotlib.axes.Axes, default=None
            Axes to plot on; a new figure and axes are created if ``None``.
        name : str, default=None
            Name in the legend; defaults to ``estimator_name``.
        ref_line : bool, default=True
            Draw the diagonal ``coverage == alpha``.
        **kwargs : dict
            Keyword arguments for :meth:`matplotlib.axes.Axes.plot` of the curve.

        Returns
        -------
        display : CalibrationCurveDisplay
            The display, with the artists stored as attributes.
        """
        ax = _get_ax(ax, "CalibrationCurveDisplay.plot")
        name = self.estimator_name if name is None else name
        label = f"CQM = {self.cqm:.3f}" if name is None else f"{name} (CQM = {self.cqm:.3f})"
        self.ref_line_ = None
        if ref_line and not _legend_has(ax, self._REF_LABEL):
            self.ref_line_ = ax.plot([0, 1], [0, 1], "k:", label=self._REF_LABEL)[0]
        line_kw = {"marker": "o", "label": label}
        line_kw.update(kwargs)
        self.line_ = ax.plot(self.alphas, self.coverage, **line_kw)[0]
        ax.set(xlim=(-0.02, 1.02), ylim=(-0.02, 1.02), aspect="equal",
               xlabel="central interval level alpha",
               ylabel="observed coverage gamma(alpha)")
        ax.legend(loc="upper left")
        self.ax_ = ax
        self.figure_ = ax.figure
        return self

    @classmethod
    def from_estimator(cls, estimator, X, y, *, alphas=None, name=None, ax=None, plot=True,
                       **kwargs):
        """Compute and plot the coverage curve of a fitted regressor on ``(X, y)``.

        Parameters
        ----------
        estimator : fitted regressor
            Any regressor whose ``predict(X, return_std=True)`` returns
            ``(mean, std)``.
        X : array-like of shape (n_samples, n_features)
            Test inputs.
        y : array-like of shape (n_samples,) or (n_samples, n_outputs)
            Test targets.
        alphas : array-like of shape (n_alphas,), default=None
            Interval levels in ``[0, 1]``; ``None`` is ``0, 0.1, ..., 1``.
        name : str, default=None
            Name in the legend; defaults to the estimator's class name.
        ax : matplotlib.axes.Axes, default=None
            Axes to plot on; a new figure and axes are created if ``None``.
        plot : bool, default=True
            Call :meth:`plot`; ``False`` only computes the arrays.
        **kwargs : dict
            Passed to :meth:`plot`.

        Returns
        -------
        display : CalibrationCurveDisplay
            The display.
        """
        mean, std = estimator.predict(X, return_std=True)
        name = _estimator_name(estimator) if name is None else name
        return cls.from_predictions(y, mean, std, alphas=alphas, name=name, ax=ax, plot=plot,
                                    **kwargs)

    @classmethod
    def from_predictions(cls, y_true, mean, std, *, alphas=None, name=None, ax=None,
                         plot=True, **kwargs):
        """Compute and plot the coverage curve of Gaussian predictions.

        Parameters
        ----------
        y_true : array-like of shape (n_samples,) or (n_samples, n_outputs)
            Observed targets.
        mean : array-like of the same shape as ``y_true``
            Predictive means.
        std : array-like of the same shape as ``y_true``, or float
            Predictive standard deviations (strictly positive).
        alphas : array-like of shape (n_alphas,), default=None
            Interval levels in ``[0, 1]``; ``None`` is ``0, 0.1, ..., 1``.
        name : str, default=None
            Name in the legend.
        ax : matplotlib.axes.Axes, default=None
            Axes to plot on; a new figure and axes are created if ``None``.
        plot : bool, default=True
            Call :meth:`plot`; ``False`` only computes the arrays.
        **kwargs : dict
            Passed to :meth:`plot`.

        Returns
        -------
        display : CalibrationCurveDisplay
            The display.
        """
        alphas, coverage = calibration_curve_regression(y_true, mean, std, alphas=alphas)
        cqm = centered_quantile_metric(y_true, mean, std)
        disp = cls(alphas=alphas, coverage=coverage, cqm=cqm, estimator_name=name)
        return disp.plot(ax=ax, **kwargs) if plot else disp


def _interval_arrays(y_true, y_pred, lower, upper, target):
    arrays = [_select_target(a, target, n) for a, n in
              ((y_true, "y_true"), (y_pred, "y_pred"), (lower, "lower"), (upper, "upper"))]
    n = len(arrays[0])
    for a, name in zip(arrays, ("y_true", "y_pred", "lower", "upper")):
        if len(a) != n:
            raise ValueError(f"{name} has {len(a)} rows but y_true has {n}")
        if not np.all(np.isfinite(a)):
            raise ValueError(f"{name} must be finite")
    if n == 0:
        raise ValueError("y_true is empty")
    if np.any(arrays[2] > arrays[3]):
        raise ValueError("lower must not exceed upper")
    return arrays


class PredictionIntervalDisplay:
    """True against predicted values of a regressor, each with its prediction interval.

    The regression counterpart of :class:`sklearn.metrics.PredictionErrorDisplay`
    (``kind="actual_vs_predicted"``) for any number of input features: every point
    is drawn at (predicted, true), with its interval as a vertical segment around the
    prediction (green where it holds the true value, red where it misses), and the
    diagonal ``true == predicted``. The legend gives the confidence and the
    coverage, the fraction of all the rows whose interval holds the true value (the
    plot may show a subsample).

    Parameters
    ----------
    y_true : ndarray of shape (n_samples,)
        True values.
    y_pred : ndarray of shape (n_samples,)
        Predictions (the predictive mean).
    lower : ndarray of shape (n_samples,)
        Lower bounds of the intervals.
    upper : ndarray of shape (n_samples,)
        Upper bounds of the intervals.
    confidence : float, default=None
        The intervals' nominal confidence, for the legend.
    kind : str, default=None
        How the intervals were made (``"conformal"``, ``"gaussian"``), for the
        legend.
    estimator_name : str, default=None
        Name used in the legend.

    Attributes
    ----------
    coverage_ : float
        Fraction of the rows whose interval holds ``y_true``.
    mean_width_ : float
        Mean width ``upper - lower``.
    scatter_ : matplotlib.collections.PathCollection
        The (predicted, true) points drawn.
    intervals_ : matplotlib.collections.LineCollection
        The intervals drawn.
    line_ : matplotlib.lines.Line2D or None
        The diagonal, if this call drew it.
    ax_ : matplotlib.axes.Axes
        Axes with the plot.
    figure_ : matplotlib.figure.Figure
        Figure containing the plot.

    See Also
    --------
    sklearn.metrics.PredictionErrorDisplay : The same plot without intervals.
    CalibrationCurveDisplay : Coverage of the central intervals at every level.

    Examples
    --------
    >>> from sklearn_lla.plotting import PredictionIntervalDisplay
    >>> disp = PredictionIntervalDisplay.from_predictions(
    ...     [1.0, 2.0, 3.0, 4.0], [1.1, 2.5, 2.9, 3.0], lower=[0.5, 2.2, 2.0, 2.5],
    ...     upper=[1.5, 2.8, 3.5, 3.5], confidence=0.9, plot=False)
    >>> disp.coverage_, round(disp.mean_width_, 3)
    (0.5, 1.025)
    """

    _REF_LABEL = "true = predicted"

    def __init__(self, *, y_true, y_pred, lower, upper, confidence=None, kind=None,
                 estimator_name=None):
        self.y_true = y_true
        self.y_pred = y_pred
        self.lower = lower
        self.upper = upper
        self.confidence = confidence
        self.kind = kind
        self.estimator_name = estimator_name
        y, lo, hi = (np.asarray(a, dtype=np.float64) for a in (y_true, lower, upper))
        self.coverage_ = float(np.mean((lo <= y) & (y <= hi)))
        self.mean_width_ = float(np.mean(hi - lo))

    def plot(self, ax=None, *, name=None, subsample=1_000, random_state=None, ref_line=True,
             scatter_kwargs=None, interval_kwargs=None):
        """Plot true against predicted values with the intervals and the diagonal.

        Parameters
        ----------
        ax : matplotlib.axes.Axes, default=None
            Axes to plot on; a new figure and axes are created if ``None``.
        name : str, default=None
            Name in the legend; defaults to ``estimator_name``.
        subsample : int, float or None, default=1000
            Rows drawn: an int is a count, a float in (0, 1] a fraction, ``None``
            all of them (as :class:`sklearn.metrics.PredictionErrorDisplay`). The
            coverage in the legend is always over every row.
        random_state : int, RandomState instance or None, default=None
            Seed of the subsample.
        ref_line : bool, default=True
            Draw the diagonal ``true == predicted``.
        scatter_kwargs : dict, default=None
            Keyword arguments for :meth:`matplotlib.axes.Axes.scatter` of the points.
        interval_kwargs : dict, default=None
            Keyword arguments for :meth:`matplotlib.axes.Axes.vlines` of the
            intervals (a ``colors`` entry replaces the covered / missed colours).

        Returns
        -------
        display : PredictionIntervalDisplay
            The display, with the artists stored as attributes.
        """
        from sklearn.utils import check_random_state

        ax = _get_ax(ax, "PredictionIntervalDisplay.plot")
        y, pred, lo, hi = (np.asarray(a, dtype=np.float64) for a in
                           (self.y_true, self.y_pred, self.lower, self.upper))
        n = len(y)
        if subsample is None:
            k = n
        elif isinstance(subsample, numbers.Integral) and not isinstance(subsample, bool) \
                and subsample > 0:
            k = min(int(subsample), n)
        elif isinstance(subsample, numbers.Real) and 0 < subsample <= 1:
            k = max(1, int(round(subsample * n)))
        else:
            raise ValueError(f"subsample must be a positive int, a float in (0, 1] or None; "
                             f"got {subsample!r}")
        rows = np.sort(check_random_state(random_state).choice(n, k, replace=False)) \
            if k < n else np.arange(n)
        y, pred, lo, hi = y[rows], pred[rows], lo[rows], hi[rows]
        covered = (lo <= y) & (y <= hi)
        name = self.estimator_name if name is None else name
        what = "" if self.confidence is None else f"{self.confidence:.0%} "
        how = "" if self.kind is None else f"{self.kind} "
        label = f"{what}{how}interval: coverage {self.coverage_:.3f}"
        if name is not None:
            label = f"{name}, {label}"
        iv_kw = {"colors": np.where(covered, "tab:green", "tab:red"), "alpha": 0.5,
                 "linewidth": 1.0, "label": label}
        iv_kw.update(interval_kwargs or {})
        self.intervals_ = ax.vlines(pred, lo, hi, **iv_kw)
        sc_kw = {"s": 10, "color": "k", "zorder": 3}
        sc_kw.update(scatter_kwargs or {})
        self.scatter_ = ax.scatter(pred, y, **sc_kw)
        self.line_ = None
        if ref_line and not _legend_has(ax, self._REF_LABEL):
            ends = [min(pred.min(), y.min()), max(pred.max(), y.max())]
            self.line_ = ax.plot(ends, ends, "k:", label=self._REF_LABEL)[0]
        ax.set(xlabel="predicted value", ylabel="true value")
        ax.legend(loc="upper left")
        self.ax_ = ax
        self.figure_ = ax.figure
        return self

    @classmethod
    def from_estimator(cls, estimator, X, y, *, confidence=0.9, interval="auto", target=None,
                       name=None, ax=None, plot=True, **kwargs):
        """Compute and plot the prediction intervals of a fitted regressor on ``(X, y)``.

        Parameters
        ----------
        estimator : fitted regressor
            A regressor with ``predict(X, return_std=True)``, and for conformal
            intervals ``predict_interval`` (the estimators of this library, a
            :class:`~sklearn_lla.pipeline.LaplacePipeline` ending in one, a
            :class:`~sklearn_lla.compose.TransformedTargetRegressor` around one).
        X : array-like of shape (n_samples, n_features)
            Test inputs.
        y : array-like of shape (n_samples,) or (n_samples, n_targets)
            Test targets.
        confidence : float, default=0.9
            Nominal coverage of the intervals, in (0, 1).
        interval : {"auto", "conformal", "gaussian"}, default="auto"
            ``"conformal"``: ``estimator.predict_interval(X, confidence)`` (needs
            a conformalized estimator); ``"gaussian"``: the central interval
            ``mean +- z std`` of the predictive distribution; ``"auto"``:
            conformal when the estimator is conformalized, otherwise Gaussian.
        target : int, default=None
            The target to plot when ``y`` has several (required then).
        name : str, default=None
            Name in the legend; defaults to the estimator's class name.
        ax : matplotlib.axes.Axes, default=None
            Axes to plot on; a new figure and axes are created if ``None``.
        plot : bool, default=True
            Call :meth:`plot`; ``False`` only computes the arrays.
        **kwargs : dict
            Passed to :meth:`plot`.

        Returns
        -------
        display : PredictionIntervalDisplay
            The display.
        """
        from sklearn.exceptions import NotFittedError

        if interval not in ("auto", "conformal", "gaussian"):
            raise ValueError(f"interval must be 'auto', 'conformal' or 'gaussian'; "
                             f"got {interval!r}")
        name = _estimator_name(estimator) if name is None else name
        mean, std = estimator.predict(X, return_std=True)
        lower = upper = None
        if interval in ("auto", "conformal"):
            if not hasattr(estimator, "predict_interval"):
                if interval == "conformal":
                    raise AttributeError(f"{name} has no predict_interval; use "
                                         "interval='gaussian'")
            else:
                try:
                    lower, upper = estimator.predict_interval(X, confidence=confidence)
                    kind = "conformal"
                except NotFittedError:
                    if interval == "conformal":
                        raise
        if lower is None:
            return cls.from_predictions(y, mean, std=std, confidence=confidence,
                                        target=target, name=name, ax=ax, plot=plot, **kwargs)
        return cls.from_predictions(y, mean, lower=lower, upper=upper, confidence=confidence,
                                    kind=kind, target=target, name=name, ax=ax, plot=plot,
                                    **kwargs)

    @classmethod
    def from_predictions(cls, y_true, y_pred, *, lower=None, upper=None, std=None,
                         confidence=0.9, kind=None, target=None, name=None, ax=None,
                         plot=True, **kwargs):
        """Compute and plot prediction intervals from bounds or a Gaussian std.

        Parameters
        ----------
        y_true : array-like of shape (n_samples,) or (n_samples, n_targets)
            True values.
        y_pred : array-like of the shape of ``y_true``
            Predictions.
        lower, upper : array-like of the shape of ``y_true``, default=None
            Interval bounds (both, or ``std`` instead).
        std : array-like of the shape of ``y_true``, default=None
            Predictive std: the intervals are the Gaussian central intervals
            ``y_pred +- z std``, ``z`` the ``(1 + confidence) / 2`` normal quantile.
        confidence : float, default=0.9
            The intervals' nominal coverage (for the legend; with ``std`` it also
            sets ``z``).
        kind : str, default=None
            How the intervals were made, for the legend (``"gaussian"`` with
            ``std``).
        target : int, default=None
            The target to plot when the arrays have several columns.
        name : str, default=None
            Name in the legend.
        ax : matplotlib.axes.Axes, default=None
            Axes to plot on; a new figure and axes are created if ``None``.
        plot : bool, default=True
            Call :meth:`plot`; ``False`` only computes the arrays.
        **kwargs : dict
            Passed to :meth:`plot`.

        Returns
        -------
        display : PredictionIntervalDisplay
            The display.
        """
        from scipy.stats import norm

        if isinstance(confidence, bool) or not isinstance(confidence, numbers.Real) or \
                not 0 < confidence < 1:
            raise ValueError(f"confidence must be a float in (0, 1); got {confidence!r}")
        if (lower is None) != (upper is None):
            raise ValueError("pass both lower and upper, or std")
        if (lower is None) == (std is None):
            raise ValueError("pass either the bounds (lower and upper) or std, not both "
                             "or neither")
        if std is not None:
            s = np.asarray(std, dtype=np.float64)
            if np.any(s < 0):
                raise ValueError("std must be non-negative")
            z = float(norm.ppf(0.5 + confidence / 2))
            m = np.asarray(y_pred, dtype=np.float64)
            lower, upper = m - z * s, m + z * s
            kind = "gaussian" if kind is None else kind
        y, pred, lo, hi = _interval_arrays(y_true, y_pred, lower, upper, target)
        disp = cls(y_true=y, y_pred=pred, lower=lo, upper=hi, confidence=float(confidence),
                   kind=kind, estimator_name=name)
        return disp.plot(ax=ax, **kwargs) if plot else disp
