"""Uncertainty metrics and scorers for probabilistic predictions.

All metrics are plain NumPy functions working in the original target scale
(no standardisation is undone or applied here).

Regression metrics take ``y``, the predictive ``mean`` and the predictive
``std`` of a Gaussian predictive distribution :math:`\\mathcal N(\\mu, \\sigma^2)`:

- :func:`gaussian_nll` -- mean negative log predictive density (lower is better);
- :func:`crps_gaussian` -- mean continuous ranked probability score (lower is better);
- :func:`centered_quantile_metric` (alias :func:`cqm`) -- calibration error of the
  central prediction intervals, in ``[0, 0.5]`` (lower is better);
- :func:`calibration_curve_regression` -- the curve behind the CQM, for plots.

Classification metrics take labels ``y`` and predicted probabilities ``proba``:

- :func:`expected_calibration_error` (alias :func:`ece`) and
  :func:`reliability_curve`;
- :func:`brier_score` -- the multi-class Brier score;
- :func:`predictive_entropy` and :func:`ood_auc` for out-of-distribution detection.

Prediction intervals and sets (from ``predict_interval`` / ``predict_set``, see
the conformal page of the docs):

- :func:`interval_coverage`, :func:`mean_interval_width` and
  :func:`interval_score` (alias :func:`winkler_score`) for intervals;
- :func:`set_coverage` and :func:`mean_set_size` for classification sets.

The scorers (``neg_*_scorer``) follow scikit-learn's "greater is better"
convention and can be passed as ``scoring=`` to
:class:`~sklearn.model_selection.GridSearchCV` or
:func:`~sklearn.model_selection.cross_validate`, alone or in a dict.
Regression scorers call ``estimator.predict(X, return_std=True)``, which
:func:`sklearn.metrics.make_scorer` cannot do; the interval and set scorers call
``predict_interval`` / ``predict_set``. :func:`get_scorer` resolves the names of
these scorers and falls back to :func:`sklearn.metrics.get_scorer`;
a list of names gives a dict ``{name: scorer}`` for ``scoring=`` (scikit-learn
accepts only its own scorer *names* as strings).
"""

from __future__ import annotations

from ._classification import (
    brier_score,
    ece,
    expected_calibration_error,
    ood_auc,
    predictive_entropy,
    reliability_curve,
)
from ._interval_scorers import (
    interval_coverage_scorer,
    neg_interval_score_scorer,
    neg_mean_interval_width_scorer,
    neg_mean_set_size_scorer,
    set_coverage_scorer,
)
from ._intervals import (
    interval_coverage,
    interval_score,
    mean_interval_width,
    mean_set_size,
    set_coverage,
    winkler_score,
)
from ._names import get_scorer, get_scorer_names
from ._regression import (
    calibration_curve_regression,
    centered_quantile_metric,
    cqm,
    crps_gaussian,
    gaussian_nll,
)
from ._scorers import (
    neg_brier_scorer,
    neg_cqm_scorer,
    neg_crps_scorer,
    neg_ece_scorer,
    neg_log_loss_scorer,
    neg_nll_scorer,
)

__all__ = [
    # regression metrics
    "gaussian_nll",
    "crps_gaussian",
    "centered_quantile_metric",
    "cqm",
    "calibration_curve_regression",
    # classification metrics
    "expected_calibration_error",
    "ece",
    "reliability_curve",
    "brier_score",
    "predictive_entropy",
    "ood_auc",
    # interval and set metrics
    "interval_coverage",
    "mean_interval_width",
    "interval_score",
    "winkler_score",
    "set_coverage",
    "mean_set_size",
    # scorers
    "neg_cqm_scorer",
    "neg_nll_scorer",
    "neg_crps_scorer",
    "neg_ece_scorer",
    "neg_brier_scorer",
    "neg_log_loss_scorer",
    "interval_coverage_scorer",
    "neg_mean_interval_width_scorer",
    "neg_interval_score_scorer",
    "set_coverage_scorer",
    "neg_mean_set_size_scorer",
    "get_scorer",
    "get_scorer_names",
]

