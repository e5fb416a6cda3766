"""Plotting displays for predictive uncertainty, in scikit-learn's display style.

Each display (like :class:`sklearn.metrics.RocCurveDisplay`) stores the computed
arrays as attributes, draws them with ``plot(ax=None, ...)`` (which returns the
display with the matplotlib artists as ``ax_``, ``figure_``, ``line_``, ...), and is
built with the classmethods ``from_estimator`` and ``from_predictions``:

- :class:`PredictiveBandDisplay`: predictive mean and +-k std bands of a regressor
  with 1-D inputs, with the training points;
- :class:`CalibrationCurveDisplay`: observed coverage ``gamma(alpha)`` of the
  central prediction intervals against ``alpha`` (the curve behind the CQM);
- :class:`PredictionIntervalDisplay`: true against predicted values of a regressor
  with any number of features, each with its prediction interval (conformal or
  Gaussian), the coverage in the legend;
- :class:`ReliabilityDisplay`: accuracy against confidence of a classifier in
  equal-width confidence bins (the reliability diagram behind the ECE), as bars,
  step lines or points, several of them overlaid on one axes.

The numbers come from :mod:`sklearn_lla.metrics`. matplotlib is an optional
dependency (``pip install sklearn-lla[plot]``): this module imports without it, and
``plot`` raises an :class:`ImportError` saying how to install it.
"""

from ._classification import ReliabilityDisplay
from ._regression import CalibrationCurveDisplay, PredictionIntervalDisplay, PredictiveBandDisplay

__all__ = ["PredictiveBandDisplay", "CalibrationCurveDisplay", "PredictionIntervalDisplay",
           "ReliabilityDisplay"]
