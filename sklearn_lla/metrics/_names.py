"""Scorer names: :func:`get_scorer` and :func:`get_scorer_names` (see :mod:`sklearn_lla.metrics`).

scikit-learn resolves ``scoring="..."`` strings from its own table only, and its
searches check them against the names that table held at import; these functions
resolve this package's names (and scikit-learn's) into the callables and dicts of
callables that scikit-learn accepts as ``scoring=``.
"""

from __future__ import annotations

import copy
import difflib

from sklearn.metrics import get_scorer as _sk_get_scorer
from sklearn.metrics import get_scorer_names as _sk_get_scorer_names

from ._interval_scorers import SCORERS as _INTERVAL_SCORERS
from ._interval_scorers import _check_scorer_confidence, _IntervalScorer, _SetScorer
from ._scorers import SCORERS as _POINT_SCORERS

#: Every scorer of this package by name, in the order listed by error messages.
_SCORERS = {**_POINT_SCORERS, **_INTERVAL_SCORERS}


def get_scorer_names():
    """Return the names :func:`get_scorer` resolves: sklearn_lla's and scikit-learn's.

    Returns
    -------
    names : list of str
        The scorer names of sklearn_lla (each also accepted with a ``"_scorer"``
        suffix), followed by those of :func:`sklearn.metrics.get_scorer_names`
        that are not among them.

    See Also
    --------
    get_scorer : Resolve one of these names.

    Examples
    --------
    >>> from sklearn_lla.metrics import get_scorer_names
    >>> names = get_scorer_names()
    >>> names[:3]
    ['neg_cqm', 'neg_nll', 'neg_crps']
    >>> "r2" in names
    True
    """
    ours = list(_SCORERS)
    return ours + [n for n in _sk_get_scorer_names() if n not in _SCORERS]


def get_scorer(scoring, **params):
    """Resolve scorer names, including sklearn_lla's uncertainty scorers.

    scikit-learn checks ``scoring="..."`` strings against its own names only
    (:func:`sklearn.metrics.get_scorer_names`, fixed when scikit-learn is
    imported), so ``GridSearchCV(..., scoring="neg_nll")`` cannot work; it takes
    callables and dicts of callables. This function turns names into those: a
    name into its scorer, a list of names into a dict ``{name: scorer}`` whose
    keys name the results (``cv_results_["mean_test_neg_nll"]``) and ``refit``.

    Parameters
    ----------
    scoring : str, list or tuple of str, or callable
        One of sklearn_lla's names (optionally with a ``"_scorer"`` suffix):
        ``"neg_cqm"``, ``"neg_nll"``, ``"neg_crps"``, ``"neg_ece"``,
        ``"neg_brier"``, ``"neg_log_loss"``, ``"interval_coverage"``,
        ``"neg_mean_interval_width"``, ``"neg_interval_score"``,
        ``"set_coverage"``, ``"neg_mean_set_size"``; any name known to
        :func:`sklearn.metrics.get_scorer`; a list or tuple of such names; or a
        callable, which is returned unchanged. ``"neg_log_loss"`` resolves to
        :data:`neg_log_loss_scorer`, which gives the same values as
        scikit-learn's scorer of that name.
    **params : dict
        Settings of the conformal scorers only: ``confidence`` (default 0.9) for
        the interval and set scorers, ``method`` (``"lac"`` or ``"aps"``) for the
        set scorers.

    Returns
    -------
    scorer : callable or dict
        ``scorer(estimator, X, y) -> float``, greater is better (a fresh copy for
        names, as :func:`sklearn.metrics.get_scorer` returns); for a list of
        names, a dict ``{name: scorer}`` in the order given, to pass as
        ``scoring=``.

    Raises
    ------
    ValueError
        If a string names no known scorer (the message lists sklearn_lla's
        names and points to scikit-learn's), a list is empty or repeats a
        scorer, or ``params`` do not apply.

    See Also
    --------
    get_scorer_names : Every name this function resolves.
    sklearn.metrics.get_scorer : The fallback for scikit-learn's names.

    Examples
    --------
    >>> from sklearn_lla.metrics import get_scorer
    >>> get_scorer("neg_cqm")
    <_StdScorer 'neg_cqm': -centered_quantile_metric(y, *estimator.predict(X, return_std=True))>
    >>> "expected_calibration_error" in repr(get_scorer("neg_ece_scorer"))
    True
    >>> get_scorer("r2")
    make_scorer(r2_score, response_method='predict')
    >>> get_scorer("interval_coverage", confidence=0.8).confidence
    0.8
    >>> sorted(get_scorer(["neg_nll", "neg_crps", "r2"]))  # scoring= for GridSearchCV
    ['neg_crps', 'neg_nll', 'r2']
    """
    if isinstance(scoring, (list, tuple)):
        if not scoring:
            raise ValueError("an empty list of scorer names was given")
        keys = [s[: -len("_scorer")] if isinstance(s, str) and s.endswith("_scorer")
                and s[: -len("_scorer")] in _SCORERS else s for s in scoring]
        if not all(isinstance(k, str) for k in keys) or len(set(keys)) != len(keys):
            raise ValueError(f"scorer names must be unique strings; got {scoring!r}")
        return {name: get_scorer(name, **params) for name in scoring}
    if callable(scoring) and not isinstance(scoring, str):
        if params:
            raise ValueError("scorer settings apply to scorer names, not to a callable")
        return scoring
    if isinstance(scoring, str):
        key = scoring[: -len("_scorer")] if scoring.endswith("_scorer") else scoring
        if key in _SCORERS:
            scorer = copy.deepcopy(_SCORERS[key])
            if params:
                _apply_params(scorer, key, params)
            return scorer
        if params:
            raise ValueError(f"scorer settings {sorted(params)} apply to sklearn_lla's "
                             f"interval and set scorers only, not to {scoring!r}")
        try:
            return _sk_get_scorer(scoring)
        except ValueError:
            raise ValueError(_unknown_name_message(scoring)) from None
    return _sk_get_scorer(scoring)


def _apply_params(scorer, key, params):
    allowed = (("confidence", "method") if isinstance(scorer, _SetScorer)
               else ("confidence",) if isinstance(scorer, _IntervalScorer) else ())
    unknown = sorted(set(params) - set(allowed))
    if unknown:
        raise ValueError(f"scorer {key!r} takes no setting(s) {unknown}"
                         + (f"; it accepts {list(allowed)}" if allowed else ""))
    if "confidence" in params:
        scorer.confidence = _check_scorer_confidence(params["confidence"])
    if "method" in params:
        if params["method"] not in ("lac", "aps"):
            raise ValueError(f"method must be 'lac' or 'aps'; got {params['method']!r}")
        scorer.method = params["method"]


def _unknown_name_message(scoring):
    ours = list(_SCORERS)
    close = difflib.get_close_matches(scoring, ours + _sk_get_scorer_names(), n=3)
    hint = f" Did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
    return (f"{scoring!r} is not a valid scoring value.{hint} sklearn_lla's scorers: "
            f"{', '.join(ours)} (each also with a '_scorer' suffix); scikit-learn's: "
            "sklearn.metrics.get_scorer_names(). sklearn_lla.metrics.get_scorer_names() "
            "lists both.")
