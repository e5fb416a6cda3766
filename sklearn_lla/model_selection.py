"""Hyperparameter searches over the Laplace estimators that keep the uncertainty.

:func:`prior_search_scoring` gives a ``GridSearchCV`` over ``prior_variance`` the
scorers and the refit rule (:class:`OneStandardErrorRule`) of the library's search
recipe: score each candidate on rows the network did not see, keep the candidates
whose held-out NLL is within one standard error of the best, and among them take the
one with the largest marginal likelihood of the training rows
(``docs/model-selection.md``). The held-out rows guard the fit in distribution; the
evidence decides what they cannot see, the uncertainty off the data.

A search's best candidate at the edge of its grid says that the criterion wanted to
go further: the grid did not bracket the optimum. For ``prior_variance`` at the
lower edge this usually means more: scored on rows the network was trained on, the
negative log-likelihood is won by *deleting* the posterior (the raw network with a
constant std fits those rows best), and every grid's floor wins
(``docs/model-selection.md``). :func:`check_grid_edges` tells the user, with what
to do next.
"""

from __future__ import annotations

import re
import warnings
from numbers import Real

import numpy as np
from sklearn.base import is_classifier

from ._core.hyper import HyperparameterWarning
from .metrics import neg_log_loss_scorer, neg_nll_scorer

__all__ = ["check_grid_edges", "log_evidence_scorer", "nll_standard_error_scorer",
           "OneStandardErrorRule", "prior_search_scoring"]


def _final_estimator(estimator):
    """The Laplace estimator inside pipelines and target transformers."""
    while True:
        if hasattr(estimator, "steps"):
            estimator = estimator.steps[-1][1]
        elif hasattr(estimator, "regressor_"):
            estimator = estimator.regressor_
        else:
            return estimator


def log_evidence_scorer(estimator, X, y):
    """Return the fitted estimator's log marginal likelihood of its training rows.

    A scorer for ``GridSearchCV`` (``scoring={"log_evidence": log_evidence_scorer,
    ...}``): the Laplace evidence of the rows the candidate was fitted on, at its
    hyperparameters. ``X`` and ``y`` (the test fold) are not used. It is the tie-break
    of :class:`OneStandardErrorRule`, not a criterion to maximise alone on a
    classifier (the evidence of a network that fits its training labels prefers
    priors that wreck calibration; ``docs/hyperparameters.md``).

    Parameters
    ----------
    estimator : object
        A fitted estimator with ``log_marginal_likelihood_`` (exact LLA, subspace
        Laplace) or a posterior with a ``log_evidence`` (ELLA), possibly the last step
        of a ``Pipeline`` or inside a ``TransformedTargetRegressor``.
    X : array-like
        Ignored (the test fold).
    y : array-like
        Ignored.

    Returns
    -------
    log_evidence : float
        The log marginal likelihood.

    Raises
    ------
    AttributeError
        If the estimator computes no evidence (VaLLA, FMGP, sampled LLA).

    Examples
    --------
    >>> import numpy as np
    >>> from sklearn_lla import LLARegressor
    >>> from sklearn_lla.model_selection import log_evidence_scorer
    >>> rng = np.random.RandomState(0)
    >>> X = rng.uniform(-2, 2, (60, 1))
    >>> y = np.sin(2 * X[:, 0]) + 0.1 * rng.randn(60)
    >>> est = LLARegressor(random_state=0).fit(X, y)
    >>> bool(np.isfinite(log_evidence_scorer(est, X, y)))
    True
    """
    est = _final_estimator(estimator)
    value = getattr(est, "log_marginal_likelihood_", None)
    if value is None:
        value = getattr(getattr(est, "posterior_", None), "log_evidence", None)
    if value is None:
        raise AttributeError(
            f"log_evidence_scorer needs an estimator that computes the Laplace evidence "
            f"(LLARegressor / LLAClassifier, ELLA*, SubspaceLaplace*); "
            f"{type(est).__name__} has none. Use prior_search_scoring(prefer='largest')")
    return float(value)


def _row_nll(estimator, X, y):
    """Per-row negative log-likelihood of ``y`` under the estimator's predictive."""
    if is_classifier(estimator):
        proba = np.asarray(estimator.predict_proba(X), dtype=float)
        classes = np.asarray(estimator.classes_)
        idx = np.searchsorted(classes, np.asarray(y))
        return -np.log(np.clip(proba[np.arange(len(proba)), idx], 1e-300, None))
    mean, std = estimator.predict(X, return_std=True)
    n = len(np.asarray(mean))
    mean = np.asarray(mean, dtype=float).reshape(n, -1)
    std = np.asarray(std, dtype=float).reshape(n, -1)
    y = np.asarray(y, dtype=float).reshape(n, -1)
    z = (y - mean) / std
    return np.mean(0.5 * np.log(2 * np.pi * std ** 2) + 0.5 * z ** 2, axis=1)


def nll_standard_error_scorer(estimator, X, y):
    """Return the standard error of the mean negative log-likelihood on ``X``.

    A scorer to report, not to maximise: the spread of the per-row NLL (Gaussian NLL of
    ``predict(X, return_std=True)`` for regressors, averaged over targets; log loss of
    ``predict_proba`` for classifiers) over the square root of the number of rows.
    :class:`OneStandardErrorRule` uses it as the tolerance of the one-SE rule.

    Parameters
    ----------
    estimator : object
        A fitted regressor with ``predict(X, return_std=True)`` or a classifier with
        ``predict_proba`` and ``classes_``.
    X : array-like of shape (n_samples, n_features)
        Input rows (the test fold).
    y : array-like of shape (n_samples,) or (n_samples, n_targets)
        Their targets.

    Returns
    -------
    standard_error : float
        ``std(per-row NLL, ddof=1) / sqrt(n_samples)``.

    Examples
    --------
    >>> import numpy as np
    >>> from sklearn.linear_model import BayesianRidge
    >>> from sklearn_lla.model_selection import nll_standard_error_scorer
    >>> rng = np.random.RandomState(0)
    >>> X = rng.normal(size=(200, 2))
    >>> y = X @ [1.0, -2.0] + 0.5 * rng.normal(size=200)
    >>> reg = BayesianRidge().fit(X[:150], y[:150])
    >>> round(nll_standard_error_scorer(reg, X[150:], y[150:]), 3)
    0.104
    """
    rows = _row_nll(estimator, X, y)
    return float(np.std(rows, ddof=1) / np.sqrt(len(rows)))


class OneStandardErrorRule:
    """Choose a search's candidate by the one-standard-error rule, ties broken for uncertainty.

    A ``refit`` callable for :class:`~sklearn.model_selection.GridSearchCV` with
    several scorers. The candidates whose mean held-out score is within ``tolerance``
    standard errors of the best one are tied (the held-out rows cannot tell them
    apart); among them the rule takes the one with the largest marginal likelihood
    (``prefer="log_evidence"``) or the largest ``param`` (``prefer="largest"``: the
    widest posterior the held-out rows accept). Held-out rows from the training
    distribution cannot see the uncertainty off the data, so a plain best score picks
    the smallest prior whenever the network's held-out errors are only noise; the
    tie-break keeps it.

    Parameters
    ----------
    score : str, default="nll"
        Key of the held-out score in ``scoring`` (greater is better: a negated NLL).
    standard_error : str, default="nll_se"
        Key of its standard error (:func:`nll_standard_error_scorer`). With several
        folds, the mean over folds divided by the square root of their number.
    prefer : {"log_evidence", "largest"}, default="log_evidence"
        The tie-break: the key ``"log_evidence"`` of ``scoring``
        (:func:`log_evidence_scorer`), or the largest value of ``param``.
    param : str, default="prior_variance"
        The parameter ``prefer="largest"`` compares (also as ``"<step>__" + param``).
    tolerance : float, default=1.0
        How many standard errors of the best candidate's score count as a tie.

    Examples
    --------
    >>> import numpy as np
    >>> from sklearn_lla.model_selection import OneStandardErrorRule
    >>> cv_results = {"params": [{"prior_variance": v} for v in (0.01, 0.1, 1.0)],
    ...               "param_prior_variance": np.array([0.01, 0.1, 1.0]),
    ...               "split0_test_nll": np.array([-0.50, -0.52, -0.90]),
    ...               "mean_test_nll": np.array([-0.50, -0.52, -0.90]),
    ...               "mean_test_nll_se": np.array([0.05, 0.05, 0.05]),
    ...               "mean_test_log_evidence": np.array([-80.0, -60.0, -70.0])}
    >>> OneStandardErrorRule()(cv_results)   # 0.01 and 0.1 tie; 0.1 has more evidence
    1
    >>> OneStandardErrorRule(prefer="largest")(cv_results)
    1
    """

    def __init__(self, score="nll", standard_error="nll_se", prefer="log_evidence",
                 param="prior_variance", tolerance=1.0):
        if prefer not in ("log_evidence", "largest"):
            raise ValueError(f"prefer must be 'log_evidence' or 'largest'; got {prefer!r}")
        self.score = score
        self.standard_error = standard_error
        self.prefer = prefer
        self.param = param
        self.tolerance = tolerance

    def __repr__(self):
        return (f"OneStandardErrorRule(score={self.score!r}, standard_error="
                f"{self.standard_error!r}, prefer={self.prefer!r}, param={self.param!r}, "
                f"tolerance={self.tolerance!r})")

    def _column(self, cv_results, key):
        name = f"mean_test_{key}"
        if name not in cv_results:
            raise KeyError(f"OneStandardErrorRule needs the scorer {key!r} in the search's "
                           f"scoring dict (cv_results_ has no {name!r}); use "
                           "sklearn_lla.model_selection.prior_search_scoring()")
        return np.asarray(cv_results[name], dtype=float)

    def __call__(self, cv_results):
        """Return the index of the chosen candidate in ``cv_results``.

        Parameters
        ----------
        cv_results : dict
            A search's ``cv_results_``.

        Returns
        -------
        index : int
            The ``best_index_`` of the search.
        """
        score = self._column(cv_results, self.score)
        pattern = re.compile(rf"split\d+_test_{re.escape(self.score)}$")
        n_splits = max(1, sum(1 for k in cv_results if pattern.match(k)))
        se = self._column(cv_results, self.standard_error) / np.sqrt(n_splits)
        if not np.any(np.isfinite(score)):
            raise ValueError("every candidate's held-out score is NaN: the fits or the "
                             "scorer failed (set error_score='raise' to see why)")
        best = int(np.nanargmax(score))
        tied = np.flatnonzero(np.isfinite(score)
                              & (score >= score[best] - self.tolerance * np.nan_to_num(se[best])))
        if self.prefer == "log_evidence":
            key = self._column(cv_results, "log_evidence")[tied]
        else:
            cols = [k for k in cv_results if k.startswith("param_")
                    and (k == f"param_{self.param}" or k.endswith(f"__{self.param}"))]
            if not cols:
                raise KeyError(f"the search has no parameter {self.param!r} for "
                               "prefer='largest'")
            key = np.asarray(cv_results[cols[0]], dtype=float)[tied]
        if not np.any(np.isfinite(key)):
            raise ValueError(f"no tied candidate has a finite {self.prefer}: the estimator "
                             "computes no evidence; use prefer='largest'")
        return int(tied[int(np.nanargmax(key))])


def prior_search_scoring(classifier=False, *, prefer="log_evidence", tolerance=1.0):
    """Return the ``scoring`` and ``refit`` of the prior-variance search that keeps the uncertainty.

    ``GridSearchCV(est, {"prior_variance": grid}, cv=..., **prior_search_scoring())``
    scores every candidate by its NLL on the test folds (with their standard error and
    the candidate's evidence) and refits the candidate chosen by
    :class:`OneStandardErrorRule`. The test folds must be rows the network did not
    see (a ``PredefinedSplit`` with held-out rows as the only test fold, or folds of
    an estimator that trains its own network): rows it was trained on reward deleting
    the posterior (``docs/model-selection.md``).

    Parameters
    ----------
    classifier : bool, default=False
        Score by log loss (``predict_proba``) instead of the Gaussian NLL
        (``predict(X, return_std=True)``).
    prefer : {"log_evidence", "largest"}, default="log_evidence"
        The tie-break among candidates within one standard error of the best:
        the evidence (estimators that compute it: exact LLA, ELLA, subspace Laplace)
        or the largest prior variance (any estimator).
    tolerance : float, default=1.0
        How many standard errors count as a tie.

    Returns
    -------
    params : dict
        ``{"scoring": {"nll": ..., "nll_se": ..., ["log_evidence": ...]}, "refit":
        OneStandardErrorRule(...)}``, to pass as keyword arguments of the search.
        ``cv_results_["mean_test_nll"]`` is minus the held-out NLL.

    See Also
    --------
    OneStandardErrorRule : The refit rule.
    check_grid_edges : Warn when the chosen value is an edge of its grid.

    Examples
    --------
    >>> from sklearn_lla.model_selection import prior_search_scoring
    >>> params = prior_search_scoring()
    >>> sorted(params["scoring"])
    ['log_evidence', 'nll', 'nll_se']
    >>> params["refit"]
    OneStandardErrorRule(score='nll', standard_error='nll_se', prefer='log_evidence', \
param='prior_variance', tolerance=1.0)
    """
    rule = OneStandardErrorRule(prefer=prefer, tolerance=tolerance)
    scoring = {"nll": neg_log_loss_scorer if classifier else neg_nll_scorer,
               "nll_se": nll_standard_error_scorer}
    if prefer == "log_evidence":
        scoring["log_evidence"] = log_evidence_scorer
    return {"scoring": scoring, "refit": rule}


def _grids(search):
    """``{param: sorted distinct real values}`` searched, for grid-like searches."""
    grids = {}
    params = getattr(search, "cv_results_", {}).get("params", [])
    for cand in params:
        for name, value in cand.items():
            if isinstance(value, Real) and not isinstance(value, bool):
                grids.setdefault(name, set()).add(float(value))
            else:
                grids.setdefault(name, set()).add(None)  # not numeric: not a range
    return {k: np.array(sorted(v)) for k, v in grids.items() if None not in v and len(v) >= 3}


def check_grid_edges(search, *, warn=True):
    """Return (and warn about) the numeric parameters whose best value is a grid edge.

    Works on a fitted :class:`~sklearn.model_selection.GridSearchCV` or
    :class:`~sklearn.model_selection.RandomizedSearchCV` (anything with
    ``cv_results_["params"]`` and ``best_params_``): for every parameter searched
    over at least three distinct real values, the best candidate's value is compared
    with the smallest and largest tried.

    Parameters
    ----------
    search : fitted search estimator
        A fitted ``GridSearchCV`` / ``RandomizedSearchCV`` (with ``refit`` set to a
        metric or ``True``, so that ``best_params_`` exists).
    warn : bool, default=True
        Emit one :class:`~sklearn_lla._core.hyper.HyperparameterWarning` per
        parameter at an edge, saying what to do.

    Returns
    -------
    edges : dict
        ``{param: "lower" | "upper"}`` for the parameters at an edge (empty when
        every optimum is inside its grid).

    Raises
    ------
    AttributeError
        If ``search`` is not fitted or has no ``best_params_`` (``refit=False``
        with several metrics).

    Examples
    --------
    >>> import warnings
    >>> import numpy as np
    >>> from sklearn.linear_model import Ridge
    >>> from sklearn.model_selection import GridSearchCV
    >>> from sklearn_lla.model_selection import check_grid_edges
    >>> rng = np.random.RandomState(0)
    >>> X, y = rng.randn(60, 3), rng.randn(60)  # pure noise: the most shrinkage wins
    >>> search = GridSearchCV(Ridge(), {"alpha": [0.01, 0.1, 1.0]}, cv=3).fit(X, y)
    >>> with warnings.catch_warnings():
    ...     warnings.simplefilter("ignore")
    ...     check_grid_edges(search)
    {'alpha': 'upper'}
    """
    if not hasattr(search, "cv_results_"):
        raise AttributeError(f"{type(search).__name__} is not fitted: call fit first")
    if not hasattr(search, "best_params_"):
        raise AttributeError(f"{type(search).__name__} has no best_params_ (refit=False with "
                             "several metrics); pass a search with refit set")
    edges = {}
    for name, grid in _grids(search).items():
        best = float(search.best_params_[name])
        if best <= grid[0]:
            edges[name] = "lower"
        elif best >= grid[-1]:
            edges[name] = "upper"
        else:
            continue
        if not warn:
            continue
        msg = (f"the best {name} of {type(search).__name__}, {best:g}, is the {edges[name]} "
               f"edge of its grid [{grid[0]:g}, ..., {grid[-1]:g}]: the criterion wants to go "
               "further, so the grid does not bracket its optimum. Extend the grid past "
               f"{best:g} and search again")
        if name.split("__")[-1] == "prior_variance" and edges[name] == "lower":
            msg += (". For prior_variance at the lower edge, check first what the folds are: "
                    "scored on rows the network was trained on, a likelihood is won by deleting "
                    "the posterior (every grid's floor wins, and the uncertainty off the data is "
                    "gone). Score on rows the network did not see (a PredefinedSplit with "
                    "held-out rows as the test fold) with prior_search_scoring(), which also "
                    "keeps the posterior where those rows cannot tell candidates apart, or "
                    "keep prior_variance='auto' (docs/model-selection.md)")
        warnings.warn(msg, HyperparameterWarning, stacklevel=2)
    return edges
