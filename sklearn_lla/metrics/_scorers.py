"""Scorers for ``GridSearchCV`` / ``cross_validate`` (public through :mod:`sklearn_lla.metrics`).

Regression scorers call ``estimator.predict(X, return_std=True)``, which
:func:`sklearn.metrics.make_scorer` cannot do; classification scorers call
``predict_proba``. Each follows scikit-learn's "greater is better" convention.
"""

from __future__ import annotations

import inspect

from sklearn.metrics import log_loss as _sk_log_loss

from ._classification import brier_score, expected_calibration_error
from ._regression import centered_quantile_metric, crps_gaussian, gaussian_nll

# ---------------------------------------------------------------------------
# scorers
# ---------------------------------------------------------------------------


def _estimator_name(estimator):
    return type(estimator).__name__


def _accepts_keyword(method, keyword):
    """Whether ``method`` can be called with ``keyword=...`` (True when unknown)."""
    try:
        params = inspect.signature(method).parameters
    except (TypeError, ValueError):  # builtins and the like: let the call decide
        return True
    return keyword in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


class _BaseUncertaintyScorer:
    """Common part of the scorers: ``sign * metric(...)``, picklable, with a repr.

    Each public scorer object carries its own docstring (``doc``), so that
    ``help(neg_nll_scorer)`` and ``neg_nll_scorer?`` describe that scorer.
    """

    _call_repr = ""

    def __init__(self, metric, sign=-1, name=None, doc=None):
        if sign not in (1, -1):
            raise ValueError(f"sign must be 1 or -1; got {sign!r}")
        self._metric = metric
        self._sign = sign
        self._name = name if name is not None else getattr(metric, "__name__", repr(metric))
        if doc is not None:
            self.__doc__ = doc

    def _accept_sample_weight(self):
        # Consulted by scikit-learn's multi-metric scoring when sample_weight is
        # passed to score(); these metrics are unweighted.
        return False

    def _get_method(self, estimator, method, needs):
        # ``getattr(..., None)`` also covers methods hidden by ``available_if``
        # (e.g. ``SVC(probability=False).predict_proba``).
        bound = getattr(estimator, method, None)
        if not callable(bound):
            raise AttributeError(
                f"scorer {self._name!r} needs {needs}; {_estimator_name(estimator)} has no "
                f"{method} method"
            )
        return bound

    def __repr__(self):
        metric_name = getattr(self._metric, "__name__", repr(self._metric))
        sign = "-" if self._sign < 0 else ""
        return (
            f"<{type(self).__name__} {self._name!r}: "
            f"{sign}{metric_name}({self._call_repr})>"
        )


class _StdScorer(_BaseUncertaintyScorer):
    """Scorer for regressors with a Gaussian predictive.

    Computes ``sign * metric(y, mean, std)`` with
    ``mean, std = estimator.predict(X, return_std=True)``.

    Parameters
    ----------
    metric : callable
        ``metric(y, mean, std) -> float``.
    sign : {-1, 1}, default=-1
        -1 for losses (so that greater is better), 1 for scores.
    name : str, default=None
        Name shown in the repr; defaults to the metric's ``__name__``.
    doc : str, default=None
        Docstring of this scorer object.
    """

    _call_repr = "y, *estimator.predict(X, return_std=True)"
    _needs = "a regressor whose predict(X, return_std=True) returns (mean, std)"

    def __call__(self, estimator, X, y):
        predict = self._get_method(estimator, "predict", self._needs)
        if not _accepts_keyword(predict, "return_std"):
            raise TypeError(
                f"scorer {self._name!r} needs {self._needs}, like the sklearn_lla "
                f"regressors, GaussianProcessRegressor or BayesianRidge; "
                f"{_estimator_name(estimator)}.predict does not accept return_std"
            )
        out = predict(X, return_std=True)
        if not isinstance(out, tuple) or len(out) != 2:
            raise ValueError(
                f"scorer {self._name!r} needs {self._needs}; "
                f"{_estimator_name(estimator)}.predict(X, return_std=True) returned "
                f"{type(out).__name__}"
            )
        mean, std = out
        return self._sign * float(self._metric(y, mean, std))


class _ProbaScorer(_BaseUncertaintyScorer):
    """Scorer for probabilistic classifiers.

    Computes ``sign * metric(y, estimator.predict_proba(X), labels=estimator.classes_)``.
    ``classes_`` gives the class of each column of ``predict_proba`` (it is
    sorted for scikit-learn classifiers, which :func:`sklearn.metrics.log_loss`
    relies on).

    Parameters
    ----------
    metric : callable
        ``metric(y, proba, labels=...) -> float``.
    sign : {-1, 1}, default=-1
        -1 for losses (so that greater is better), 1 for scores.
    name : str, default=None
        Name shown in the repr; defaults to the metric's ``__name__``.
    doc : str, default=None
        Docstring of this scorer object.
    """

    _call_repr = "y, estimator.predict_proba(X), labels=estimator.classes_"
    _needs = "a probabilistic classifier with predict_proba(X)"

    def __call__(self, estimator, X, y):
        predict_proba = self._get_method(estimator, "predict_proba", self._needs)
        proba = predict_proba(X)
        labels = getattr(estimator, "classes_", None)
        return self._sign * float(self._metric(y, proba, labels=labels))


#: Scorer ``-centered_quantile_metric`` for regressors with ``predict(X, return_std=True)``.
neg_cqm_scorer = _StdScorer(
    centered_quantile_metric,
    sign=-1,
    name="neg_cqm",
    doc="""Score a regressor by the negated CQM of its predictive intervals.

    Computes ``-centered_quantile_metric(y, mean, std)`` with
    ``mean, std = estimator.predict(X, return_std=True)``. Greater is better;
    0 means perfectly calibrated central intervals. Use it as ``scoring=``
    in :class:`~sklearn.model_selection.GridSearchCV` or
    :func:`~sklearn.model_selection.cross_validate`, alone or in a dict.

    Parameters
    ----------
    estimator : object
        Fitted regressor whose ``predict(X, return_std=True)`` returns
        ``(mean, std)``: every ``sklearn_lla`` regressor, and also scikit-learn's
        ``GaussianProcessRegressor`` and ``BayesianRidge``.
    X : array-like of shape (n_samples, n_features)
        Input samples.
    y : array-like of shape (n_samples,) or (n_samples, n_targets)
        True targets, in the original scale.

    Returns
    -------
    score : float
        Minus the centered quantile metric, in ``[-0.5, 0]``.

    Raises
    ------
    AttributeError
        If ``estimator`` has no ``predict`` method.
    TypeError
        If ``estimator.predict`` does not accept ``return_std``.
    ValueError
        If ``predict(X, return_std=True)`` does not return ``(mean, std)``.

    See Also
    --------
    centered_quantile_metric : The metric behind this scorer.

    Examples
    --------
    >>> import numpy as np
    >>> from sklearn.linear_model import BayesianRidge
    >>> from sklearn_lla.metrics import neg_cqm_scorer
    >>> rng = np.random.RandomState(0)
    >>> X = rng.normal(size=(200, 2))
    >>> y = X @ [1.0, -2.0] + 0.5 * rng.normal(size=200)
    >>> reg = BayesianRidge().fit(X[:150], y[:150])
    >>> round(neg_cqm_scorer(reg, X[150:], y[150:]), 3)
    -0.076
    """,
)
#: Scorer ``-gaussian_nll`` for regressors with ``predict(X, return_std=True)``.
neg_nll_scorer = _StdScorer(
    gaussian_nll,
    sign=-1,
    name="neg_nll",
    doc="""Score a regressor by the negated Gaussian NLL of its predictive.

    Computes ``-gaussian_nll(y, mean, std)`` with
    ``mean, std = estimator.predict(X, return_std=True)``, which
    :func:`sklearn.metrics.make_scorer` cannot request. Greater is better.
    Use it as ``scoring=`` in :class:`~sklearn.model_selection.GridSearchCV`
    or :func:`~sklearn.model_selection.cross_validate`, alone or in a dict.

    Parameters
    ----------
    estimator : object
        Fitted regressor whose ``predict(X, return_std=True)`` returns
        ``(mean, std)``: every ``sklearn_lla`` regressor, and also scikit-learn's
        ``GaussianProcessRegressor`` and ``BayesianRidge``.
    X : array-like of shape (n_samples, n_features)
        Input samples.
    y : array-like of shape (n_samples,) or (n_samples, n_targets)
        True targets, in the original scale.

    Returns
    -------
    score : float
        Minus the mean negative log predictive density.

    Raises
    ------
    AttributeError
        If ``estimator`` has no ``predict`` method.
    TypeError
        If ``estimator.predict`` does not accept ``return_std``.
    ValueError
        If ``predict(X, return_std=True)`` does not return ``(mean, std)``.

    See Also
    --------
    gaussian_nll : The metric behind this scorer.

    Examples
    --------
    >>> import numpy as np
    >>> from sklearn.linear_model import BayesianRidge
    >>> from sklearn.model_selection import GridSearchCV
    >>> from sklearn_lla.metrics import neg_nll_scorer
    >>> rng = np.random.RandomState(0)
    >>> X = rng.normal(size=(200, 2))
    >>> y = X @ [1.0, -2.0] + 0.5 * rng.normal(size=200)
    >>> reg = BayesianRidge().fit(X[:150], y[:150])
    >>> round(neg_nll_scorer(reg, X[150:], y[150:]), 3)
    -0.696
    >>> search = GridSearchCV(BayesianRidge(), {"alpha_1": [1e-6, 1e-3]},
    ...                       scoring=neg_nll_scorer, cv=3).fit(X, y)
    >>> bool(search.best_score_ < 0)
    True
    """,
)
#: Scorer ``-crps_gaussian`` for regressors with ``predict(X, return_std=True)``.
neg_crps_scorer = _StdScorer(
    crps_gaussian,
    sign=-1,
    name="neg_crps",
    doc="""Score a regressor by the negated CRPS of its Gaussian predictive.

    Computes ``-crps_gaussian(y, mean, std)`` with
    ``mean, std = estimator.predict(X, return_std=True)``. Greater is better.
    Use it as ``scoring=`` in :class:`~sklearn.model_selection.GridSearchCV`
    or :func:`~sklearn.model_selection.cross_validate`, alone or in a dict.

    Parameters
    ----------
    estimator : object
        Fitted regressor whose ``predict(X, return_std=True)`` returns
        ``(mean, std)``: every ``sklearn_lla`` regressor, and also scikit-learn's
        ``GaussianProcessRegressor`` and ``BayesianRidge``.
    X : array-like of shape (n_samples, n_features)
        Input samples.
    y : array-like of shape (n_samples,) or (n_samples, n_targets)
        True targets, in the original scale.

    Returns
    -------
    score : float
        Minus the mean CRPS, in the units of ``y``.

    Raises
    ------
    AttributeError
        If ``estimator`` has no ``predict`` method.
    TypeError
        If ``estimator.predict`` does not accept ``return_std``.
    ValueError
        If ``predict(X, return_std=True)`` does not return ``(mean, std)``.

    See Also
    --------
    crps_gaussian : The metric behind this scorer.

    Examples
    --------
    >>> import numpy as np
    >>> from sklearn.linear_model import BayesianRidge
    >>> from sklearn.model_selection import cross_validate
    >>> from sklearn_lla.metrics import neg_crps_scorer, neg_nll_scorer
    >>> rng = np.random.RandomState(0)
    >>> X = rng.normal(size=(200, 2))
    >>> y = X @ [1.0, -2.0] + 0.5 * rng.normal(size=200)
    >>> reg = BayesianRidge().fit(X[:150], y[:150])
    >>> round(neg_crps_scorer(reg, X[150:], y[150:]), 3)
    -0.265
    >>> res = cross_validate(BayesianRidge(), X, y, cv=3,
    ...                      scoring={"crps": neg_crps_scorer, "nll": neg_nll_scorer})
    >>> res["test_crps"].shape
    (3,)
    """,
)
#: Scorer ``-expected_calibration_error`` for classifiers with ``predict_proba``.
neg_ece_scorer = _ProbaScorer(
    expected_calibration_error,
    sign=-1,
    name="neg_ece",
    doc="""Score a classifier by its negated expected calibration error.

    Computes ``-expected_calibration_error(y, proba, labels=estimator.classes_)``
    with ``proba = estimator.predict_proba(X)`` and the default 15 bins.
    Greater is better; 0 is perfectly calibrated. Use it as ``scoring=`` in
    :class:`~sklearn.model_selection.GridSearchCV` or
    :func:`~sklearn.model_selection.cross_validate`, alone or in a dict.

    Parameters
    ----------
    estimator : object
        Fitted classifier with ``predict_proba``. Its ``classes_`` (when
        present) give the class of each probability column.
    X : array-like of shape (n_samples, n_features)
        Input samples.
    y : array-like of shape (n_samples,)
        True labels.

    Returns
    -------
    score : float
        Minus the expected calibration error, in ``[-1, 0]``.

    Raises
    ------
    AttributeError
        If ``estimator`` has no ``predict_proba`` method.

    See Also
    --------
    expected_calibration_error : The metric behind this scorer.

    Examples
    --------
    >>> from sklearn.datasets import load_iris
    >>> from sklearn.linear_model import LogisticRegression
    >>> from sklearn.model_selection import train_test_split
    >>> from sklearn_lla.metrics import neg_ece_scorer
    >>> X, y = load_iris(return_X_y=True)
    >>> X_train, X_test, y_train, y_test = train_test_split(X, y, random_state=0)
    >>> clf = LogisticRegression(max_iter=1000).fit(X_train, y_train)
    >>> round(neg_ece_scorer(clf, X_test, y_test), 3)
    -0.105
    """,
)
#: Scorer ``-brier_score`` for classifiers with ``predict_proba``.
neg_brier_scorer = _ProbaScorer(
    brier_score,
    sign=-1,
    name="neg_brier",
    doc="""Score a classifier by its negated multi-class Brier score.

    Computes ``-brier_score(y, proba, labels=estimator.classes_)`` with
    ``proba = estimator.predict_proba(X)``. Greater is better. Unlike
    scikit-learn's ``"neg_brier_score"``, this works for any number of classes
    (and is twice that score for binary problems).

    Parameters
    ----------
    estimator : object
        Fitted classifier with ``predict_proba``. Its ``classes_`` (when
        present) give the class of each probability column.
    X : array-like of shape (n_samples, n_features)
        Input samples.
    y : array-like of shape (n_samples,)
        True labels.

    Returns
    -------
    score : float
        Minus the Brier score, in ``[-2, 0]``.

    Raises
    ------
    AttributeError
        If ``estimator`` has no ``predict_proba`` method.

    See Also
    --------
    brier_score : The metric behind this scorer.

    Examples
    --------
    >>> from sklearn.datasets import load_iris
    >>> from sklearn.linear_model import LogisticRegression
    >>> from sklearn.model_selection import train_test_split
    >>> from sklearn_lla.metrics import neg_brier_scorer
    >>> X, y = load_iris(return_X_y=True)
    >>> X_train, X_test, y_train, y_test = train_test_split(X, y, random_state=0)
    >>> clf = LogisticRegression(max_iter=1000).fit(X_train, y_train)
    >>> round(neg_brier_scorer(clf, X_test, y_test), 3)
    -0.08
    """,
)
#: Scorer ``-sklearn.metrics.log_loss`` (with ``labels=estimator.classes_``).
neg_log_loss_scorer = _ProbaScorer(
    _sk_log_loss,
    sign=-1,
    name="neg_log_loss",
    doc="""Score a classifier by its negated log loss (mean NLL of the labels).

    Computes ``-sklearn.metrics.log_loss(y, proba, labels=estimator.classes_)``
    with ``proba = estimator.predict_proba(X)``; passing ``labels`` keeps the
    score defined on test folds that miss a class. Greater is better.

    Parameters
    ----------
    estimator : object
        Fitted classifier with ``predict_proba`` and sorted ``classes_``, as
        every scikit-learn classifier has.
    X : array-like of shape (n_samples, n_features)
        Input samples.
    y : array-like of shape (n_samples,)
        True labels.

    Returns
    -------
    score : float
        Minus the log loss, in ``(-inf, 0]``.

    Raises
    ------
    AttributeError
        If ``estimator`` has no ``predict_proba`` method.

    See Also
    --------
    sklearn.metrics.log_loss : The metric behind this scorer.

    Examples
    --------
    >>> from sklearn.datasets import load_iris
    >>> from sklearn.linear_model import LogisticRegression
    >>> from sklearn.model_selection import cross_val_score
    >>> from sklearn_lla.metrics import neg_log_loss_scorer
    >>> X, y = load_iris(return_X_y=True)
    >>> scores = cross_val_score(LogisticRegression(max_iter=1000), X, y,
    ...                          scoring=neg_log_loss_scorer, cv=3)
    >>> scores.shape, bool((scores < 0).all())
    ((3,), True)
    """,
)

#: This module's scorers by name (:mod:`._names` resolves names).
SCORERS = {
    "neg_cqm": neg_cqm_scorer,
    "neg_nll": neg_nll_scorer,
    "neg_crps": neg_crps_scorer,
    "neg_ece": neg_ece_scorer,
    "neg_brier": neg_brier_scorer,
    "neg_log_loss": neg_log_loss_scorer,
}

# The scorers are objects, not functions or classes, so ``--doctest-modules``
# would not find their examples on its own.
__test__ = {f"{key}_scorer": scorer.__doc__ for key, scorer in SCORERS.items()}
