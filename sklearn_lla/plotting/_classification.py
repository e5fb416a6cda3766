"""Classification display: the reliability diagram."""

from __future__ import annotations

import numpy as np

from ..metrics import expected_calibration_error, reliability_curve
from ._common import _estimator_name, _get_ax, _legend_has

__all__ = ["ReliabilityDisplay"]


def _histogram_axes(ax):
    """The twin axes of ``ax`` holding a reliability histogram already, or ``None``."""
    for other in ax.figure.axes:
        if other is not ax and other.bbox.bounds == ax.bbox.bounds and \
                other.get_ylabel() == ReliabilityDisplay._HIST_LABEL and \
                other.get_shared_x_axes().joined(ax, other):
            return other
    return None


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
    line_ : matplotlib.lines.Line2D or matplotlib.patches.StepPatch or None
        The accuracy points (``kind="line"``) or step line (``kind="step"``).
    ref_line_ : matplotlib.lines.Line2D or None
        The diagonal, if this call drew it.
    hist_ : matplotlib.container.BarContainer or None
        The histogram of confidences (fraction of predictions per bin; the tallest
        bar of the axes reaches a quarter of the height).
    hist_ax_ : matplotlib.axes.Axes or None
        The twin axes (right-hand scale) holding ``hist_``, shared by every
        display drawn on the same axes.
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
    _HIST_LABEL = "fraction of predictions"

    def __init__(self, *, bin_confidence, bin_accuracy, bin_counts, ece, estimator_name=None):
        self.bin_confidence = bin_confidence
        self.bin_accuracy = bin_accuracy
        self.bin_counts = bin_counts
        self.ece = ece
        self.estimator_name = estimator_name

    def plot(self, ax=None, *, name=None, kind="bar", bar_position=(0, 1),
             show_histogram=True, ref_line=True, **kwargs):
        """Plot accuracy against confidence, the diagonal and the confidence histogram.

        Several displays can share one axes (pass ``ax=first.ax_``): as step lines
        (``kind="step"``) or points (``kind="line"``), or as bars side by side, each
        display in its own slot of every bin (``bar_position=(i, k)``). Their
        histograms share one twin axes, each in its display's slot and colour.

        Parameters
        ----------
        ax : matplotlib.axes.Axes, default=None
            Axes to plot on; a new figure and axes are created if ``None``.
        name : str, default=None
            Name in the legend; defaults to ``estimator_name``.
        kind : {"bar", "step", "line"}, default="bar"
            Accuracy as bars over each non-empty bin, as a step line over the bins
            (flat across each bin, broken at empty ones), or as points at each
            bin's mean confidence joined by a line.
        bar_position : tuple of int (i, k), default=(0, 1)
            Draw this display's bars (and histogram bars) in slot ``i`` of ``k``
            equal slots of each bin, so that ``k`` displays overlaid on one axes
            sit side by side; ``(0, 1)`` fills the bins.
        show_histogram : bool, default=True
            Draw the fraction of predictions per bin as narrow bars along the
            bottom, on a twin axes (right-hand scale) shared by the displays of
            the axes.
        ref_line : bool, default=True
            Draw the diagonal ``accuracy == confidence`` (once per axes).
        **kwargs : dict
            Keyword arguments for :meth:`matplotlib.axes.Axes.bar`,
            :meth:`matplotlib.axes.Axes.stairs` or :meth:`matplotlib.axes.Axes.plot`
            of the accuracy.

        Returns
        -------
        display : ReliabilityDisplay
            The display, with the artists stored as attributes.
        """
        if kind not in ("bar", "step", "line"):
            raise ValueError(f"kind must be 'bar', 'step' or 'line'; got {kind!r}")
        try:
            slot, n_slots = (int(v) for v in bar_position)
            if not 0 <= slot < n_slots or (slot, n_slots) != tuple(bar_position):
                raise ValueError
        except (TypeError, ValueError):
            raise ValueError(f"bar_position must be a pair (i, k) of integers with "
                             f"0 <= i < k; got {bar_position!r}") from None
        ax = _get_ax(ax, "ReliabilityDisplay.plot")
        name = self.estimator_name if name is None else name
        label = f"ECE = {self.ece:.3f}" if name is None else f"{name} (ECE = {self.ece:.3f})"
        conf = np.asarray(self.bin_confidence, dtype=np.float64)
        acc = np.asarray(self.bin_accuracy, dtype=np.float64)
        counts = np.asarray(self.bin_counts)
        n_bins = len(counts)
        edges = np.arange(n_bins + 1) / n_bins
        nonempty = counts > 0
        width = 1.0 / (n_bins * n_slots)
        left = edges[:-1] + slot * width  # this display's slot in each bin

        self.ref_line_ = None
        if ref_line and not _legend_has(ax, self._REF_LABEL):
            self.ref_line_ = ax.plot([0, 1], [0, 1], "k:", label=self._REF_LABEL)[0]
        self.bars_ = self.line_ = None
        if kind == "bar":
            bar_kw = {"width": width, "align": "edge", "edgecolor": "k", "alpha": 0.7,
                      "label": label}
            bar_kw.update(kwargs)
            self.bars_ = ax.bar(left[nonempty], acc[nonempty], **bar_kw)
            color = self.bars_.patches[0].get_facecolor() if self.bars_.patches else None
        elif kind == "step":
            step_kw = {"baseline": None, "linewidth": 2.0, "label": label}
            step_kw.update(kwargs)
            self.line_ = ax.stairs(np.where(nonempty, acc, np.nan), edges, **step_kw)
            color = self.line_.get_edgecolor()
        else:
            line_kw = {"marker": "o", "label": label}
            line_kw.update(kwargs)
            self.line_ = ax.plot(conf[nonempty], acc[nonempty], **line_kw)[0]
            color = self.line_.get_color()

        self.hist_ = self.hist_ax_ = None
        if show_histogram:
            hist_ax = _histogram_axes(ax)
            first = hist_ax is None
            if first:
                hist_ax = ax.twinx()
                hist_ax.set_ylabel(self._HIST_LABEL, loc="bottom")
            frac = counts / max(int(counts.sum()), 1)
            # narrow bars centred in this display's slot; the tallest bar of all the
            # displays on the axes fills the lowest quarter of the plot
            self.hist_ = hist_ax.bar(left + 0.25 * width, frac, width=0.5 * width,
                                     align="edge", alpha=0.6, label=self._HIST_LABEL,
                                     color="0.25" if first and n_slots == 1 or color is None
                                     else color)
            top = max([float(frac.max())] + [float(p.get_height()) for p in hist_ax.patches])
            top = top if top > 0 else 1.0
            hist_ax.set_ylim(0, 4 * top)
            hist_ax.set_yticks([0, top], labels=["0", f"{top:.2f}"])
            self.hist_ax_ = hist_ax
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
