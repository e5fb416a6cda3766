"""Plotting displays for predictive uncertainty, in scikit-learn's display style.

Each display (like :class:`sklearn.metrics.RocCurveDisplay`) stores the computed
arrays as attributes, draws them with ``plot(ax=None, ...)`` (which returns the
display with the matplotlib artists as ``ax_``, ``figure_``, ``line_``, ...), and is
built with the classmethods ``from_estimator`` and ``from_predictions``:

- :class:`PredictiveBandDisplay`: predictive mean and +-k std bands of a regressor
  with 1-D inputs, with the training points;
- :class:`CalibrationCurveDisplay`: observed coverage ``gamma(alpha)`` of the
  central prediction intervals against ``alpha`` (the curve behind the CQM);
- :class:`ReliabilityDisplay`: accuracy against confidence of a classifier in
  equal-width confidence bins (the reliability diagram behind the ECE).

The numbers come from :mod:`sklearn_lla.metrics`. matplotlib is an optional
dependency (``pip install sklearn-lla[plot]``): this module imports without it, and
``plot`` raises an :class:`ImportError` saying how to install it.
"""

from __future__ import annotations

import numbers

import numpy as np

from .metrics import (
    calibration_curve_regression,
    centered_quantile_metric,
    expected_calibration_error,
    reliability_curve,
)

__all__ = ["PredictiveBandDisplay", "CalibrationCurveDisplay", "ReliabilityDisplay"]

#: How to install the optional plotting dependency.
_INSTALL_HINT = "pip install sklearn-lla[plot]"


def _pyplot(caller):
    """Import ``matplotlib.pyplot`` or raise an ImportError naming the ``plot`` extra."""
    try:
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ImportError(
            f"{caller} requires matplotlib, an optional dependency of sklearn-lla; "
            f"install it with `{_INSTALL_HINT}` (or `pip install matplotlib`)"
        ) from exc
    return plt


def _get_ax(ax, caller):
    plt = _pyplot(caller)
    if ax is None:
        _, ax = plt.subplots()
    return ax


def _estimator_name(estimator):
    return type(estimator).__name__


def _legend_has(ax, label):
    legend = ax.get_legend()
    return legend is not None and any(t.get_text() == label for t in legend.get_texts())


def _check_n_std(n_std):
    values = np.atleast_1d(np.asarray(n_std, dtype=np.float64))
    if values.ndim != 1 or values.size == 0 or not np.all(np.isfinite(values)) or np.any(
        values <= 0
    ):
        raise ValueError(f"n_std must be a positive number or a list of them; got {n_std!r}")
    return tuple(sorted(float(v) for v in values))


def _select_target(arr, target, name):
    """A 1-D view of ``arr`` of shape (n,) or the column ``target`` of shape (n, t)."""
    arr = np.asarray(arr, dtype=np.float64)
    if arr.ndim == 2:
        if not isinstance(target, numbers.Integral) or not -arr.shape[1] <= target < arr.shape[1]:
            raise ValueError(
                f"target={target!r} is not a column of {name}, which has {arr.shape[1]} outputs"
            )
        return arr[:, target]
    if arr.ndim != 1:
        raise ValueError(f"{name} must have shape (n,) or (n, n_outputs); got shape {arr.shape}")
    return arr


def _one_feature(X, name="X"):
    """The single input column of ``X`` (shape (n,) or (n, 1)) as a float array."""
    arr = np.asarray(X, dtype=np.float64)
    if arr.ndim == 2 and arr.shape[1] == 1:
        arr = arr[:, 0]
    if arr.ndim != 1:
        raise ValueError(
            f"{name} must have one input feature, shape (n,) or (n, 1); got shape {arr.shape}. "
            "PredictiveBandDisplay plots 1-D inputs only"
        )
    if arr.size == 0 or not np.all(np.isfinite(arr)):
        raise ValueError(f"{name} must be non-empty and finite")
    return arr


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


class ReliabilityDisplay:
    """Reliability diagram of a classifier: accuracy against confidence, with the ECE.

    The confidence of a prediction is its largest class probability. Predictions are
    put in ``n_bins`` equal-width confidence bins over ``[0, 1]``
    (:func:`sklearn_lla.metrics.reliability_curve`); a calibrated classifier has the
    accuracy of each bin equal to its mean confidence (the diagonal). The legend
    shows the ECE (:func:`sklearn_lla.metrics.expected_calibration_error` with the
    same bins).

    Parameters
    ----------
    bin_confidence : ndarray of shape (n_bins,)
        Mean confidence in each bin (NaN for empty bins).
    bin_accuracy : ndarray of shape (n_bins,)
        Accuracy in each bin (NaN for empty bins).
    bin_counts : ndarray of shape (n_bins,)
        Number of predictions in each bin.
    ece : float
        Expected calibration error over these bins.
    estimator_name : str, default=None
        Name used in the legend.

    Attributes
    ----------
    bars_ : matplotlib.container.BarContainer or None
        The accuracy bars (``kind="bar"``).
    line_ : matplotlib.lines.Line2D or None
        The accuracy points (``kind="line"``).
    ref_line_ : matplotlib.lines.Line2D or None
        The diagonal, if this call drew it.
    hist_ : matplotlib.container.BarContainer or None
        The histogram of confidences (fraction of predictions per bin; the tallest
        bar reaches a quarter of the height).
    hist_ax_ : matplotlib.axes.Axes or None
        The twin axes (right-hand scale) holding ``hist_``.
    ax_ : matplotlib.axes.Axes
        Axes with the plot.
    figure_ : matplotlib.figure.Figure
        Figure containing the plot.

    See Also
    --------
    sklearn_lla.metrics.reliability_curve : The binned accuracies and confidences.
    sklearn_lla.metrics.expected_calibration_error : The ECE.

    Examples
    --------
    >>> from sklearn_lla.plotting import ReliabilityDisplay
    >>> disp = ReliabilityDisplay.from_predictions(
    ...     [0, 1], [[0.9, 0.1], [0.8, 0.2]], n_bins=2, plot=False)
    >>> disp.bin_counts.tolist(), round(disp.ece, 6)
    ([0, 2], 0.35)
    """

    _REF_LABEL = "perfectly calibrated"

    def __init__(self, *, bin_confidence, bin_accuracy, bin_counts, ece, estimator_name=None):
        self.bin_confidence = bin_confidence
        self.bin_accuracy = bin_accuracy
        self.bin_counts = bin_counts
        self.ece = ece
        self.estimator_name = estimator_name

    def plot(self, ax=None, *, name=None, kind="bar", show_histogram=True, ref_line=True,
             **kwargs):
        """Plot accuracy against confidence, the diagonal and the confidence histogram.

        Parameters
        ----------
        ax : matplotlib.axes.Axes, default=None
            Axes to plot on; a new figure and axes are created if ``None``.
        name : str, default=None
            Name in the legend; defaults to ``estimator_name``.
        kind : {"bar", "line"}, default="bar"
            Accuracy as bars over each non-empty bin, or as points at each bin's
            mean confidence joined by a line (to overlay several classifiers).
        show_histogram : bool, default=True
            Draw the fraction of predictions per bin as narrow dark bars along
            the bottom, on a twin axes (right-hand scale).
        ref_line : bool, default=True
            Draw the diagonal ``accuracy == confidence``.
        **kwargs : dict
            Keyword arguments for :meth:`matplotlib.axes.Axes.bar` or
            :meth:`matplotlib.axes.Axes.plot` of the accuracy.

        Returns
        -------
        display : ReliabilityDisplay
            The display, with the artists stored as attributes.
        """
        if kind not in ("bar", "line"):
            raise ValueError(f"kind must be 'bar' or 'line'; got {kind!r}")
        ax = _get_ax(ax, "ReliabilityDisplay.plot")
        name = self.estimator_name if name is None else name
        label = f"ECE = {self.ece:.3f}" if name is None else f"{name} (ECE = {self.ece:.3f})"
        conf = np.asarray(self.bin_confidence, dtype=np.float64)
        acc = np.asarray(self.bin_accuracy, dtype=np.float64)
        counts = np.asarray(self.bin_counts)
        n_bins = len(counts)
        edges = np.arange(n_bins + 1) / n_bins
        nonempty = counts > 0

        self.hist_ = self.hist_ax_ = None
        if show_histogram:
            # narrow dark bars on a twin axes scaled so that the tallest fills the
            # lowest quarter of the plot, drawn in front of the accuracy bars
            hist_ax = ax.twinx()
            frac = counts / max(int(counts.sum()), 1)
            self.hist_ = hist_ax.bar(edges[:-1] + 0.25 / n_bins, frac, width=0.5 / n_bins,
                                     align="edge", color="0.25", alpha=0.6,
                                     label="fraction of predictions")
            top = float(frac.max()) if frac.max() > 0 else 1.0
            hist_ax.set_ylim(0, 4 * top)
            hist_ax.set_yticks([0, top], labels=["0", f"{top:.2f}"])
            hist_ax.set_ylabel("fraction of predictions", loc="bottom")
            self.hist_ax_ = hist_ax

        self.ref_line_ = None
        if ref_line and not _legend_has(ax, self._REF_LABEL):
            self.ref_line_ = ax.plot([0, 1], [0, 1], "k:", label=self._REF_LABEL)[0]
        self.bars_ = self.line_ = None
        if kind == "bar":
            bar_kw = {"width": 1.0 / n_bins, "align": "edge", "edgecolor": "k", "alpha": 0.7,
                      "label": label}
            bar_kw.update(kwargs)
            self.bars_ = ax.bar(edges[:-1][nonempty], acc[nonempty], **bar_kw)
        else:
            line_kw = {"marker": "o", "label": label}
            line_kw.update(kwargs)
            self.line_ = ax.plot(conf[nonempty], acc[nonempty], **line_kw)[0]
        ax.set(xlim=(0, 1), ylim=(0, 1), xlabel="confidence (largest class probability)",
               ylabel="accuracy")
        ax.legend(loc="upper left")
        self.ax_ = ax
        self.figure_ = ax.figure
        return self

    @classmethod
    def from_estimator(cls, estimator, X, y, *, n_bins=15, name=None, ax=None, plot=True,
                       **kwargs):
        """Compute and plot the reliability diagram of a fitted classifier on ``(X, y)``.

        Parameters
        ----------
        estimator : fitted classifier
            Any classifier with ``predict_proba``; its ``classes_`` (when present)
            give the label of each probability column.
        X : array-like of shape (n_samples, n_features)
            Test inputs.
        y : array-like of shape (n_samples,)
            Test labels.
        n_bins : int, default=15
            Number of equal-width confidence bins.
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
        display : ReliabilityDisplay
            The display.
        """
        predict_proba = getattr(estimator, "predict_proba", None)
        if not callable(predict_proba):
            raise AttributeError(
                f"ReliabilityDisplay needs a classifier with predict_proba; "
                f"{_estimator_name(estimator)} has none"
            )
        proba = predict_proba(X)
        name = _estimator_name(estimator) if name is None else name
        return cls.from_predictions(y, proba, n_bins=n_bins,
                                    labels=getattr(estimator, "classes_", None), name=name,
                                    ax=ax, plot=plot, **kwargs)

    @classmethod
    def from_predictions(cls, y_true, proba, *, n_bins=15, labels=None, name=None, ax=None,
                         plot=True, **kwargs):
        """Compute and plot the reliability diagram of predicted probabilities.

        Parameters
        ----------
        y_true : array-like of shape (n_samples,)
            True labels.
        proba : array-like of shape (n_samples, n_classes) or (n_samples,)
            Predicted probabilities (a 1-D array is the probability of the
            positive class of a binary problem).
        n_bins : int, default=15
            Number of equal-width confidence bins.
        labels : array-like of shape (n_classes,), default=None
            The class of each column of ``proba``; see
            :func:`sklearn_lla.metrics.reliability_curve`.
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
        display : ReliabilityDisplay
            The display.
        """
        conf, acc, counts = reliability_curve(y_true, proba, n_bins, labels=labels)
        ece = expected_calibration_error(y_true, proba, n_bins, labels=labels)
        disp = cls(bin_confidence=conf, bin_accuracy=acc, bin_counts=counts, ece=ece,
                   estimator_name=name)
        return disp.plot(ax=ax, **kwargs) if plot else disp
