"""Scorers of conformal prediction intervals and sets (public through :mod:`sklearn_lla.metrics`).

They call ``estimator.predict_interval(X, confidence=...)`` or
``estimator.predict_set(X, confidence=..., method=...)`` (the split-conformal methods
of every ``sklearn_lla`` regressor / classifier) and score the result with the
metrics of :mod:`._intervals`. Their docstrings come from the template of
:mod:`._scorers`.
"""

from __future__ import annotations

from numbers import Real

from ._intervals import (
    interval_coverage,
    interval_score,
    mean_interval_width,
    mean_set_size,
    set_coverage,
)
from ._scorers import _accepts_keyword, _BaseUncertaintyScorer, _Doc, _estimator_name


def _check_scorer_confidence(confidence):
    if isinstance(confidence, bool) or not isinstance(confidence, Real) or not (
            0.0 < float(confidence) < 1.0):
        raise ValueError(f"confidence must be a float in (0, 1); got {confidence!r}")
    return float(confidence)


_NOT_CONFORMALIZED = ("sklearn.exceptions.NotFittedError",
                      "If the estimator is not fitted or not conformalized.")

_CONFORMAL_NOTE = """
    The estimator must be conformalized: fitted with held-out rows (then it
    calibrates on them automatically) or calibrated with ``conformalize``. In
    ``GridSearchCV`` / ``cross_validate`` that means ``net=None`` or an unfitted
    skorch net (``fit`` holds rows out), a skorch net with its own validation
    split, or ``validation_data`` passed as a fit parameter. For another
    confidence (or set method) use ``get_scorer(name, confidence=...)``."""


class _IntervalScorer(_BaseUncertaintyScorer):
    """Scorer of conformal prediction intervals.

    Computes ``sign * metric(...)`` on ``lower, upper =
    estimator.predict_interval(X, confidence=confidence)``: ``metric(y, lower,
    upper)``, ``metric(lower, upper)`` (``uses_y=False``) or ``metric(y, lower,
    upper, confidence=confidence)`` (``uses_confidence=True``).

    Parameters
    ----------
    metric : callable
        The interval metric.
    sign : {-1, 1}
        -1 for losses (so that greater is better), 1 for reported quantities.
    name : str
        Name shown in the repr and used by :func:`get_scorer`.
    doc : _Doc
        This scorer's own docstring parts.
    confidence : float, default=0.9
        Confidence requested from ``predict_interval``.
    uses_y, uses_confidence : bool
        How ``metric`` is called.
    """

    _needs = "a regressor with predict_interval(X, confidence=...) returning (lower, upper)"
    _doc_estimator = "Fitted, conformalized ``sklearn_lla`` regressor."
    _doc_y = ("(n_samples,) or (n_samples, n_targets)", "True targets.")
    _doc_raises = (
        ("AttributeError", "If ``estimator`` has no ``predict_interval`` method."),
        ("TypeError", "If ``estimator.predict_interval`` does not accept ``confidence``."),
        ("ValueError", "If ``predict_interval`` does not return ``(lower, upper)`` of one "
                       "shape."),
        _NOT_CONFORMALIZED)
    _doc_notes = _CONFORMAL_NOTE

    def __init__(self, metric, sign, name, doc, confidence=0.9, *, uses_y=True,
                 uses_confidence=False):
        self.confidence = _check_scorer_confidence(confidence)
        self._uses_y = uses_y
        self._uses_confidence = uses_confidence
        super().__init__(metric, sign=sign, name=name, doc=doc)

    @property
    def _call_repr(self):
        call = f"*estimator.predict_interval(X, confidence={self.confidence:g})"
        args = f"y, {call}" if self._uses_y else call
        return args + (f", confidence={self.confidence:g}" if self._uses_confidence else "")

    def _doc_call(self):
        args = ("y, " if self._uses_y else "") + "lower, upper" + (
            f", confidence={self.confidence:g}" if self._uses_confidence else "")
        return args, f"lower, upper = estimator.predict_interval(X, confidence={self.confidence:g})"

    def _uses_y_doc(self):
        return self._uses_y

    def __call__(self, estimator, X, y):
        predict_interval = self._get_method(estimator, "predict_interval", self._needs)
        if not _accepts_keyword(predict_interval, "confidence"):
            raise TypeError(f"scorer {self._name!r} needs {self._needs}; "
                            f"{_estimator_name(estimator)}.predict_interval does not accept "
                            "confidence")
        out = predict_interval(X, confidence=self.confidence)
        if not isinstance(out, tuple) or len(out) != 2 or (
                getattr(out[0], "shape", None) != getattr(out[1], "shape", None)):
            raise ValueError(f"scorer {self._name!r} needs {self._needs}; "
                             f"{_estimator_name(estimator)}.predict_interval returned "
                             "something else")
        lower, upper = out
        if not self._uses_y:
            return self._sign * float(self._metric(lower, upper))
        if self._uses_confidence:
            return self._sign * float(self._metric(y, lower, upper,
                                                   confidence=self.confidence))
        return self._sign * float(self._metric(y, lower, upper))


class _SetScorer(_BaseUncertaintyScorer):
    """Scorer of conformal prediction sets.

    Computes ``sign * metric(...)`` on ``sets = estimator.predict_set(X,
    confidence=confidence, method=method)``: ``metric(y, sets,
    labels=estimator.classes_)``, or ``metric(sets)`` (``uses_y=False``).

    Parameters
    ----------
    metric : callable
        The set metric.
    sign : {-1, 1}
        -1 for losses (so that greater is better), 1 for reported quantities.
    name : str
        Name shown in the repr and used by :func:`get_scorer`.
    doc : _Doc
        This scorer's own docstring parts.
    confidence : float, default=0.9
        Confidence requested from ``predict_set``.
    method : {"lac", "aps"}, default="lac"
        Set method requested from ``predict_set``.
    uses_y : bool
        How ``metric`` is called.
    """

    _needs = "a classifier with predict_set(X, confidence=..., method=...)"
    _doc_estimator = "Fitted, conformalized ``sklearn_lla`` classifier."
    _doc_raises = (("AttributeError", "If ``estimator`` has no ``predict_set`` method."),
                   _NOT_CONFORMALIZED)
    _doc_notes = _CONFORMAL_NOTE

    def __init__(self, metric, sign, name, doc, confidence=0.9, method="lac", *, uses_y=True):
        self.confidence = _check_scorer_confidence(confidence)
        if method not in ("lac", "aps"):
            raise ValueError(f"method must be 'lac' or 'aps'; got {method!r}")
        self.method = method
        self._uses_y = uses_y
        super().__init__(metric, sign=sign, name=name, doc=doc)

    @property
    def _call_repr(self):
        call = (f"estimator.predict_set(X, confidence={self.confidence:g}, "
                f"method={self.method!r})")
        return f"y, {call}, labels=estimator.classes_" if self._uses_y else call

    def _doc_call(self):
        args = "y, sets, labels=estimator.classes_" if self._uses_y else "sets"
        return args, (f'sets = estimator.predict_set(X, confidence={self.confidence:g}, '
                      f'method="{self.method}")')

    def _uses_y_doc(self):
        return self._uses_y

    def __call__(self, estimator, X, y):
        predict_set = self._get_method(estimator, "predict_set", self._needs)
        sets = predict_set(X, confidence=self.confidence, method=self.method)
        if not self._uses_y:
            return self._sign * float(self._metric(sets))
        labels = getattr(estimator, "classes_", None)
        return self._sign * float(self._metric(y, sets, labels=labels))


#: Scorer ``interval_coverage`` of ``predict_interval(X, confidence=0.9)``.
interval_coverage_scorer = _IntervalScorer(
    interval_coverage, sign=1, name="interval_coverage", doc=_Doc(
        summary="Score a regressor by the coverage of its 90 % conformal intervals.",
        details="A quantity to *report* (it should be close to 0.9), not to maximise: the "
                "widest intervals cover best, so do not select models (``refit``) by it; "
                "use :data:`neg_interval_score_scorer` for that.",
        returns="The fraction of targets inside their intervals, in ``[0, 1]``.",
        examples="""
        >>> import numpy as np
        >>> from sklearn.model_selection import cross_validate
        >>> from sklearn_lla import LLARegressor
        >>> from sklearn_lla.metrics import interval_coverage_scorer, neg_mean_interval_width_scorer
        >>> rng = np.random.RandomState(0)
        >>> X = rng.uniform(-2, 2, (150, 1))
        >>> y = np.sin(2 * X[:, 0]) + 0.1 * rng.randn(150)
        >>> # net=None: each fold's fit trains a net on 80 % of its 75 rows and
        >>> # calibrates on the other 15 (a 0.9 interval needs at least 9)
        >>> reg = LLARegressor(validation_fraction=0.2, random_state=0)
        >>> res = cross_validate(reg, X, y, cv=2, error_score="raise",
        ...                      scoring={"coverage": interval_coverage_scorer,
        ...                               "width": neg_mean_interval_width_scorer})
        >>> res["test_coverage"].shape
        (2,)
        """))
#: Scorer ``-mean_interval_width`` of ``predict_interval(X, confidence=0.9)``.
neg_mean_interval_width_scorer = _IntervalScorer(
    mean_interval_width, sign=-1, name="neg_mean_interval_width", uses_y=False, doc=_Doc(
        summary="Score a regressor by the negated mean width of its 90 % conformal intervals.",
        details="Greater (narrower) is better at equal coverage; conformal intervals all "
                "have the nominal coverage, so among them the narrowest are the most "
                "informative.",
        returns="Minus the mean interval width, in the units of ``y``.",
        examples="""
        >>> import numpy as np
        >>> from sklearn_lla import LLARegressor
        >>> from sklearn_lla.metrics import neg_mean_interval_width_scorer
        >>> rng = np.random.RandomState(0)
        >>> X = rng.uniform(-2, 2, (150, 1))
        >>> y = np.sin(2 * X[:, 0]) + 0.1 * rng.randn(150)
        >>> reg = LLARegressor(random_state=0).fit(X[:100], y[:100])  # calibrated on held-out rows
        >>> bool(neg_mean_interval_width_scorer(reg, X[100:], y[100:]) < 0)
        True
        """))
#: Scorer ``-interval_score`` (Winkler) of ``predict_interval(X, confidence=0.9)``.
neg_interval_score_scorer = _IntervalScorer(
    interval_score, sign=-1, name="neg_interval_score", uses_confidence=True, doc=_Doc(
        summary="Score a regressor by the negated interval (Winkler) score of its 90 % "
                "intervals.",
        details="The interval score is the width plus ``2 / 0.1`` times the distance of each "
                "miss. Greater is better; a proper scoring rule for the interval, so it can "
                "select models (``refit``).",
        returns="Minus the mean interval score, in the units of ``y``.",
        examples="""
        >>> import numpy as np
        >>> from sklearn_lla import LLARegressor
        >>> from sklearn_lla.metrics import get_scorer, neg_interval_score_scorer
        >>> rng = np.random.RandomState(0)
        >>> X = rng.uniform(-2, 2, (150, 1))
        >>> y = np.sin(2 * X[:, 0]) + 0.1 * rng.randn(150)
        >>> reg = LLARegressor(random_state=0).fit(X[:100], y[:100])  # calibrated on held-out rows
        >>> bool(neg_interval_score_scorer(reg, X[100:], y[100:]) < 0)
        True
        >>> get_scorer("neg_interval_score", confidence=0.8).confidence
        0.8
        """))
#: Scorer ``set_coverage`` of ``predict_set(X, confidence=0.9, method="lac")``.
set_coverage_scorer = _SetScorer(set_coverage, sign=1, name="set_coverage", doc=_Doc(
    summary="Score a classifier by the coverage of its 90 % conformal prediction sets.",
    details="A quantity to *report* (close to 0.9), not to maximise: sets of every class "
            "cover best; select by :data:`neg_mean_set_size_scorer` or the log loss instead.",
    returns="The fraction of labels inside their sets, in ``[0, 1]``.",
    examples="""
    >>> from sklearn.datasets import make_blobs
    >>> from sklearn_lla import LLAClassifier
    >>> from sklearn_lla.metrics import set_coverage_scorer
    >>> X, y = make_blobs(n_samples=300, centers=3, cluster_std=2.0, random_state=0)
    >>> clf = LLAClassifier(random_state=0).fit(X[:200], y[:200])
    >>> clf.conformalize(X[200:250], y[200:250])
    LLAClassifier(random_state=0)
    >>> 0.0 <= set_coverage_scorer(clf, X[250:], y[250:]) <= 1.0
    True
    """))
#: Scorer ``-mean_set_size`` of ``predict_set(X, confidence=0.9, method="lac")``.
neg_mean_set_size_scorer = _SetScorer(
    mean_set_size, sign=-1, name="neg_mean_set_size", uses_y=False, doc=_Doc(
        summary="Score a classifier by the negated mean size of its 90 % conformal sets.",
        details="Greater (smaller sets) is better at equal coverage.",
        returns="Minus the mean set size, in ``[-n_classes, 0]``.",
        examples="""
        >>> from sklearn.datasets import make_blobs
        >>> from sklearn_lla import LLAClassifier
        >>> from sklearn_lla.metrics import get_scorer
        >>> X, y = make_blobs(n_samples=300, centers=3, cluster_std=2.0, random_state=0)
        >>> clf = LLAClassifier(random_state=0).fit(X[:200], y[:200])
        >>> clf.conformalize(X[200:250], y[200:250])
        LLAClassifier(random_state=0)
        >>> size = get_scorer("neg_mean_set_size", method="aps")
        >>> -3.0 <= size(clf, X[250:], y[250:]) <= -1.0
        True
        """))


#: This module's scorers by name (:mod:`._names` resolves names).
SCORERS = {
    "interval_coverage": interval_coverage_scorer,
    "neg_mean_interval_width": neg_mean_interval_width_scorer,
    "neg_interval_score": neg_interval_score_scorer,
    "set_coverage": set_coverage_scorer,
    "neg_mean_set_size": neg_mean_set_size_scorer,
}

# The scorers are objects: list their examples for ``--doctest-modules``.
__test__ = {f"{key}_scorer": scorer.__doc__ for key, scorer in SCORERS.items()}
