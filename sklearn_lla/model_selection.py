"""Checks for hyperparameter searches over the Laplace estimators.

A search's best candidate at the edge of its grid says that the criterion wanted to
go further: the grid did not bracket the optimum. For ``prior_variance`` at the
lower edge this usually means more: scored on rows the network was trained on, the
negative log-likelihood is won by *deleting* the posterior (the raw network with a
constant std fits those rows best), and every grid's floor wins
(``docs/model-selection.md``). :func:`check_grid_edges` tells the user, with what
to do next.
"""

from __future__ import annotations

import warnings
from numbers import Real

import numpy as np

from ._core.hyper import HyperparameterWarning

__all__ = ["check_grid_edges"]


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
                    "held-out rows as the test fold), or keep prior_variance='auto' "
                    "(docs/model-selection.md)")
        warnings.warn(msg, HyperparameterWarning, stacklevel=2)
    return edges
