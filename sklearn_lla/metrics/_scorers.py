"""Scorers for ``GridSearchCV`` / ``cross_validate`` (public through :mod:`sklearn_lla.metrics`).

Regression scorers call ``estimator.predict(X, return_std=True)``, which
:func:`sklearn.metrics.make_scorer` cannot do; classification scorers call
``predict_proba``. Each follows scikit-learn's "greater is better" convention.

Every public scorer object carries its own numpydoc docstring, built by
:meth:`_BaseUncertaintyScorer._render_doc` from one template: the call it makes,
its parameters, exceptions and metric come from the scorer (its class, metric and
sign); the summary, the returned range and the examples are the scorer's own
(:class:`_Doc`).
"""

from __future__ import annotations

import inspect
import re
import textwrap
from typing import NamedTuple

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


class _Doc(NamedTuple):
    """The parts of a scorer's docstring that are its own; the template adds the rest."""

    #: One-line summary.
    summary: str
    #: Description of the returned score (its meaning and range).
    returns: str
    #: The Examples section, as doctest lines (dedented by the template).
    examples: str
    #: Sentences after "Computes ...": what greater means, caveats.
    details: str = ""
    #: Description of ``estimator``, when the class's (``_doc_estimator``) does not fit.
    estimator: str = ""


def _fill(text):
    """Wrap ``text`` at 76 columns, never inside an inline literal (````...````)."""
    text = re.sub(r"``.+?``", lambda m: m.group().replace(" ", "\0"), " ".join(text.split()))
    return textwrap.fill(text, width=76, break_long_words=False,
                         break_on_hyphens=False).replace("\0", " ")


def _section(title, entries):
    """A numpydoc section from ``(head, description)`` pairs."""
    lines = ["", title, "-" * len(title)]
    for head, description in entries:
        lines.append(head)
        lines.extend(textwrap.indent(_fill(description), "    ").splitlines())
    return lines


class _BaseUncertaintyScorer:
    """Common part of the scorers: ``sign * metric(...)``, picklable, with a repr.

    Each public scorer object carries its own docstring (``doc``, rendered by
    :meth:`_render_doc`), so that ``help(neg_nll_scorer)`` and ``neg_nll_scorer?``
    describe that scorer.
    """

    _call_repr = ""
    #: Docstring template parts shared by a class's scorers (see :meth:`_render_doc`).
    _doc_estimator = ""
    _doc_y = ("(n_samples,)", "True labels.")
    _doc_raises = ()
    _doc_notes = ""

    def __init__(self, metric, sign=-1, name=None, doc=None):
        if sign not in (1, -1):
            raise ValueError(f"sign must be 1 or -1; got {sign!r}")
        self._metric = metric
        self._sign = sign
        self._name = name if name is not None else getattr(metric, "__name__", repr(metric))
        if doc is not None:
            self.__doc__ = self._render_doc(doc)

    def _doc_call(self):
        """``(arguments of the metric, the assignment that computes them)`` for the docs."""
        raise NotImplementedError

    def _uses_y_doc(self):
        return True

    def _render_doc(self, doc):
        """This scorer's numpydoc docstring: the template filled with ``doc`` (a :class:`_Doc`)."""
        metric = getattr(self._metric, "__name__", repr(self._metric))
        module = getattr(self._metric, "__module__", "") or ""
        public = module.split("._")[0]  # sklearn.metrics._classification -> sklearn.metrics
        if public and public != "sklearn_lla.metrics":
            metric = f"{public}.{metric}"
        args, assignment = self._doc_call()
        sign = "-" if self._sign < 0 else ""
        computes = (f"Computes ``{sign}{metric}({args})`` with ``{assignment}``. "
                    f"{doc.details} Pass it as ``scoring=`` to "
                    ":class:`~sklearn.model_selection.GridSearchCV` or "
                    ":func:`~sklearn.model_selection.cross_validate`, alone or in a dict.")
        y_shape, y_text = self._doc_y
        if not self._uses_y_doc():
            y_text = y_text.rstrip(".") + " (unused by this scorer)."
        lines = [doc.summary, "", _fill(computes)]
        lines += _section("Parameters", [
            ("estimator : object", doc.estimator or self._doc_estimator),
            ("X : array-like of shape (n_samples, n_features)", "Input samples."),
            (f"y : array-like of shape {y_shape}", y_text)])
        lines += _section("Returns", [("score : float", doc.returns)])
        lines += _section("Raises", self._doc_raises)
        lines += _section("See Also", [(f"{metric} : The metric behind this scorer.", "")])
        if self._doc_notes:
            lines += ["", "Notes", "-----", _fill(self._doc_notes)]
        lines += ["", "Examples", "--------", textwrap.dedent(doc.examples).strip(), ""]
        return "\n".join(lines)

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
    doc : _Doc, default=None
        This scorer's own docstring parts.
    """

    _call_repr = "y, *estimator.predict(X, return_std=True)"
    _needs = "a regressor whose predict(X, return_std=True) returns (mean, std)"
    _doc_estimator = ("Fitted regressor whose ``predict(X, return_std=True)`` returns "
                      "``(mean, std)``: every ``sklearn_lla`` regressor, and also "
                      "scikit-learn's ``GaussianProcessRegressor`` and ``BayesianRidge``.")
    _doc_y = ("(n_samples,) or (n_samples, n_targets)", "True targets, in the original scale.")
    _doc_raises = (
        ("AttributeError", "If ``estimator`` has no ``predict`` method."),
        ("TypeError", "If ``estimator.predict`` does not accept ``return_std``."),
        ("ValueError", "If ``predict(X, return_std=True)`` does not return ``(mean, std)``."))

    def _doc_call(self):
        return "y, mean, std", "mean, std = estimator.predict(X, return_std=True)"

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
    doc : _Doc, default=None
        This scorer's own docstring parts.
    """

    _call_repr = "y, estimator.predict_proba(X), labels=estimator.classes_"
    _needs = "a probabilistic classifier with predict_proba(X)"
    _doc_estimator = ("Fitted classifier with ``predict_proba``. Its ``classes_`` (when "
                      "present) give the class of each probability column.")
    _doc_raises = (("AttributeError", "If ``estimator`` has no ``predict_proba`` method."),)

    def _doc_call(self):
        return "y, proba, labels=estimator.classes_", "proba = estimator.predict_proba(X)"

    def __call__(self, estimator, X, y):
        predict_proba = self._get_method(estimator, "predict_proba", self._needs)
        proba = predict_proba(X)
        labels = getattr(estimator, "classes_", None)
        return self._sign * float(self._metric(y, proba, labels=labels))


#: Scorer ``-centered_quantile_metric`` for regressors with ``predict(X, return_std=True)``.
neg_cqm_scorer = _StdScorer(centered_quantile_metric, sign=-1, name="neg_cqm", doc=_Doc(
    summary="Score a regressor by the negated CQM of its predictive intervals.",
    details="Greater is better; 0 means perfectly calibrated central intervals.",
    returns="Minus the centered quantile metric, in ``[-0.5, 0]``.",
    examples="""
    >>> import numpy as np
    >>> from sklearn.linear_model import BayesianRidge
    >>> from sklearn_lla.metrics import neg_cqm_scorer
    >>> rng = np.random.RandomState(0)
    >>> X = rng.normal(size=(200, 2))
    >>> y = X @ [1.0, -2.0] + 0.5 * rng.normal(size=200)
    >>> reg = BayesianRidge().fit(X[:150], y[:150])
    >>> round(neg_cqm_scorer(reg, X[150:], y[150:]), 3)
    -0.076
    """))
#: Scorer ``-gaussian_nll`` for regressors with ``predict(X, return_std=True)``.
neg_nll_scorer = _StdScorer(gaussian_nll, sign=-1, name="neg_nll", doc=_Doc(
    summary="Score a regressor by the negated Gaussian NLL of its predictive.",
    details="Greater is better.",
    returns="Minus the mean negative log predictive density.",
    examples="""
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
    """))
#: Scorer ``-crps_gaussian`` for regressors with ``predict(X, return_std=True)``.
neg_crps_scorer = _StdScorer(crps_gaussian, sign=-1, name="neg_crps", doc=_Doc(
    summary="Score a regressor by the negated CRPS of its Gaussian predictive.",
    details="Greater is better.",
    returns="Minus the mean CRPS, in the units of ``y``.",
    examples="""
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
    """))
#: Scorer ``-expected_calibration_error`` for classifiers with ``predict_proba``.
neg_ece_scorer = _ProbaScorer(expected_calibration_error, sign=-1, name="neg_ece", doc=_Doc(
    summary="Score a classifier by its negated expected calibration error.",
    details="It uses the metric's default 15 bins. Greater is better; 0 is perfectly "
            "calibrated.",
    returns="Minus the expected calibration error, in ``[-1, 0]``.",
    examples="""
    >>> from sklearn.datasets import load_iris
    >>> from sklearn.linear_model import LogisticRegression
    >>> from sklearn.model_selection import train_test_split
    >>> from sklearn_lla.metrics import neg_ece_scorer
    >>> X, y = load_iris(return_X_y=True)
    >>> X_train, X_test, y_train, y_test = train_test_split(X, y, random_state=0)
    >>> clf = LogisticRegression(max_iter=1000).fit(X_train, y_train)
    >>> round(neg_ece_scorer(clf, X_test, y_test), 3)
    -0.105
    """))
#: Scorer ``-brier_score`` for classifiers with ``predict_proba``.
neg_brier_scorer = _ProbaScorer(brier_score, sign=-1, name="neg_brier", doc=_Doc(
    summary="Score a classifier by its negated multi-class Brier score.",
    details="Greater is better. Unlike scikit-learn's ``\"neg_brier_score\"``, this works "
            "for any number of classes (and is twice that score for binary problems).",
    returns="Minus the Brier score, in ``[-2, 0]``.",
    examples="""
    >>> from sklearn.datasets import load_iris
    >>> from sklearn.linear_model import LogisticRegression
    >>> from sklearn.model_selection import train_test_split
    >>> from sklearn_lla.metrics import neg_brier_scorer
    >>> X, y = load_iris(return_X_y=True)
    >>> X_train, X_test, y_train, y_test = train_test_split(X, y, random_state=0)
    >>> clf = LogisticRegression(max_iter=1000).fit(X_train, y_train)
    >>> round(neg_brier_scorer(clf, X_test, y_test), 3)
    -0.08
    """))
#: Scorer ``-sklearn.metrics.log_loss`` (with ``labels=estimator.classes_``).
neg_log_loss_scorer = _ProbaScorer(_sk_log_loss, sign=-1, name="neg_log_loss", doc=_Doc(
    summary="Score a classifier by its negated log loss (mean NLL of the labels).",
    details="Passing ``labels`` keeps the score defined on test folds that miss a class. "
            "Greater is better.",
    estimator="Fitted classifier with ``predict_proba`` and sorted ``classes_``, as every "
              "scikit-learn classifier has.",
    returns="Minus the log loss, in ``(-inf, 0]``.",
    examples="""
    >>> from sklearn.datasets import load_iris
    >>> from sklearn.linear_model import LogisticRegression
    >>> from sklearn.model_selection import cross_val_score
    >>> from sklearn_lla.metrics import neg_log_loss_scorer
    >>> X, y = load_iris(return_X_y=True)
    >>> scores = cross_val_score(LogisticRegression(max_iter=1000), X, y,
    ...                          scoring=neg_log_loss_scorer, cv=3)
    >>> scores.shape, bool((scores < 0).all())
    ((3,), True)
    """))

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
