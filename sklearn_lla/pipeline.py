"""A Pipeline that carries the Laplace estimators' uncertainty methods and held-out rows.

scikit-learn's :class:`~sklearn.pipeline.Pipeline` delegates a fixed list of methods
to its last step (``predict``, ``predict_proba``, ``score``, ...), and passes fit
parameters to a step untransformed. With one of this library's estimators last, two
things a user expects do not happen there:

* ``predict_interval``, ``predict_set``, ``conformalize`` and ``sample_y`` are not
  methods of the pipeline (``AttributeError``);
* ``validation_data=(X_val, y_val)`` passed to ``fit`` (``lla__validation_data=...``)
  reaches the estimator as the raw rows, not through the fitted preprocessing steps
  (scikit-learn's ``transform_input`` transforms every element of a tuple, ``y_val``
  included, and needs metadata routing on).

:class:`LaplacePipeline` is a :class:`~sklearn.pipeline.Pipeline` (same parameters,
same behaviour otherwise) that adds both: each uncertainty method transforms ``X``
through the fitted steps and calls the last step's method (exposed with
``available_if`` only when the last step has it); ``fit`` applies the fitted steps to
``X_val`` of the last step's ``validation_data`` (``y_val`` unchanged) when the last
step reads it, after those steps are fitted on the training rows. ``predict(X,
return_std=True)`` and ``predict_proba`` already work in a plain Pipeline.
:func:`make_pipeline` is :func:`sklearn.pipeline.make_pipeline` returning one.
"""

from __future__ import annotations

from sklearn.pipeline import Pipeline
from sklearn.pipeline import make_pipeline as _sk_make_pipeline
from sklearn.utils import metadata_routing
from sklearn.utils.metaestimators import available_if
from sklearn.utils.validation import check_is_fitted

from ._deferred import DeferredPair, split_pair

__all__ = ["LaplacePipeline", "make_pipeline"]

#: The fit parameter of the last step whose ``X_val`` goes through the fitted steps.
VALIDATION_PARAM = "validation_data"


def _final_estimator_has(attr):
    def check(self):
        getattr(self._final_estimator, attr)  # the original AttributeError if absent
        return True

    return check


class LaplacePipeline(Pipeline):
    """A Pipeline whose last step's uncertainty methods and held-out rows work end to end.

    The same as :class:`sklearn.pipeline.Pipeline` (parameters, fitting, caching,
    metadata routing), plus:

    * :meth:`predict_interval`, :meth:`predict_set`, :meth:`conformalize` and
      :meth:`sample_y`, available when the last step has them: ``X`` (``X_cal``)
      goes through the fitted steps, then to the last step;
    * ``fit(X, y, <last step>__validation_data=(X_val, y_val))`` (or
      ``validation_data=...`` with metadata routing on and the last step requesting
      it): ``X_val`` goes through the steps fitted on ``X`` before the last step
      reads it; ``y_val`` is passed as is (the last step's own ``y`` handling
      applies, e.g. :class:`sklearn_lla.compose.TransformedTargetRegressor`'s
      transformer).

    Parameters
    ----------
    steps : list of tuples
        ``(name, transformer)`` pairs, the last one an estimator.
    transform_input : list of str, default=None
        See :class:`sklearn.pipeline.Pipeline` (``validation_data`` needs no entry
        here: it is handled as above).
    memory : str or object with the joblib.Memory interface, default=None
        Caching of the fitted transformers.
    verbose : bool, default=False
        Print the time elapsed fitting each step.

    Attributes
    ----------
    named_steps : Bunch
        The steps by name.
    n_features_in_ : int
        Number of features seen by the first step.
    feature_names_in_ : ndarray of str
        Names of the features seen by the first step (when it records them).

    See Also
    --------
    make_pipeline : Build one from estimators, names generated.
    sklearn.pipeline.Pipeline : The scikit-learn original.

    Examples
    --------
    >>> import numpy as np
    >>> import pandas as pd
    >>> from sklearn.compose import ColumnTransformer
    >>> from sklearn.preprocessing import OneHotEncoder, StandardScaler
    >>> from sklearn_lla import LLARegressor
    >>> from sklearn_lla.pipeline import LaplacePipeline
    >>> rng = np.random.RandomState(0)
    >>> X = pd.DataFrame({"x": rng.uniform(-2, 2, 120),
    ...                   "group": rng.choice(["a", "b"], 120)})
    >>> y = np.sin(2 * X["x"]) + (X["group"] == "b") + 0.1 * rng.randn(120)
    >>> prep = ColumnTransformer([("num", StandardScaler(), ["x"]),
    ...                           ("cat", OneHotEncoder(), ["group"])])
    >>> pipe = LaplacePipeline([("prep", prep), ("lla", LLARegressor(random_state=0))])
    >>> pipe = pipe.fit(X[:100], y[:100])  # net=None: calibrated on held-out rows
    >>> lower, upper = pipe.predict_interval(X[100:], confidence=0.9)
    >>> bool((lower < upper).all())
    True
    """

    def _transform_head(self, X, check=True):
        """``X`` through every fitted step but the last (as ``predict`` does)."""
        if check:
            check_is_fitted(self)
        Xt = X
        for _, _, transform in self._iter(with_final=False):
            Xt = transform.transform(Xt)
        return Xt

    def _validation_key(self, params):
        if metadata_routing._routing_enabled():
            return VALIDATION_PARAM if VALIDATION_PARAM in params else None
        key = f"{self.steps[-1][0]}__{VALIDATION_PARAM}"
        return key if key in params else None

    def fit(self, X, y=None, **params):
        """Fit the steps on ``X``, then the last step, with ``X_val`` through the steps.

        Parameters
        ----------
        X : iterable
            Training data, as the first step takes it.
        y : iterable, default=None
            Training targets.
        **params : dict of str -> object
            Fit parameters, as :meth:`sklearn.pipeline.Pipeline.fit` takes them
            (``<step>__<param>``, or routed with metadata routing on). The last
            step's ``validation_data=(X_val, y_val)`` has ``X_val`` in the form of
            ``X``: it goes through the steps fitted on ``X`` first.

        Returns
        -------
        self : object
            The pipeline with fitted steps.
        """
        key = self._validation_key(params)
        if key is not None and params[key] is not None and len(self.steps) > 1:
            Xv, yv = split_pair(params[key])
            params = {**params,
                      key: DeferredPair(
                Xv, yv, transform_X=lambda X: self._transform_head(X, check=False))}
        return super().fit(X, y, **params)

    @available_if(_final_estimator_has("predict_interval"))
    def predict_interval(self, X, confidence=0.9):
        """Transform ``X`` and return the last step's conformal intervals.

        Parameters
        ----------
        X : iterable
            Query points, as the first step takes them.
        confidence : float, default=0.9
            Target coverage in (0, 1).

        Returns
        -------
        lower, upper : ndarray
            The last step's ``predict_interval`` bounds.
        """
        return self._final_estimator.predict_interval(self._transform_head(X),
                                                      confidence=confidence)

    @available_if(_final_estimator_has("predict_set"))
    def predict_set(self, X, confidence=0.9, **params):
        """Transform ``X`` and return the last step's conformal prediction sets.

        Parameters
        ----------
        X : iterable
            Query points, as the first step takes them.
        confidence : float, default=0.9
            Target coverage in (0, 1).
        **params : dict
            Further parameters of the last step's ``predict_set`` (``method``,
            ``randomized``, ``allow_empty``, ``random_state``).

        Returns
        -------
        sets : ndarray of bool of shape (n_samples, n_classes)
            The last step's prediction sets.
        """
        return self._final_estimator.predict_set(self._transform_head(X),
                                                 confidence=confidence, **params)

    @available_if(_final_estimator_has("conformalize"))
    def conformalize(self, X_cal, y_cal):
        """Transform ``X_cal`` and calibrate the last step's conformal predictions.

        Parameters
        ----------
        X_cal : iterable
            Calibration inputs (rows the network did not fit), as the first step
            takes them.
        y_cal : array-like
            Calibration targets or labels.

        Returns
        -------
        self : object
            The pipeline, its last step calibrated.
        """
        self._final_estimator.conformalize(self._transform_head(X_cal), y_cal)
        return self

    @available_if(_final_estimator_has("sample_y"))
    def sample_y(self, X, n_samples=1, random_state=0):
        """Transform ``X`` and draw joint samples of ``y`` from the last step.

        Parameters
        ----------
        X : iterable
            Query points, as the first step takes them.
        n_samples : int, default=1
            Number of joint draws.
        random_state : int, RandomState instance or None, default=0
            Seed of the draws.

        Returns
        -------
        y_samples : ndarray
            The last step's ``sample_y`` draws.
        """
        return self._final_estimator.sample_y(self._transform_head(X), n_samples=n_samples,
                                              random_state=random_state)


def make_pipeline(*steps, memory=None, transform_input=None, verbose=False):
    """Build a :class:`LaplacePipeline` from estimators, naming the steps.

    :func:`sklearn.pipeline.make_pipeline` returning a :class:`LaplacePipeline`: the
    step names are the lowercased class names (``llaregressor`` for
    ``LLARegressor``), so ``validation_data`` is passed as
    ``fit(X, y, llaregressor__validation_data=(X_val, y_val))``.

    Parameters
    ----------
    *steps : list of estimators
        The transformers, then the final estimator.
    memory : str or object with the joblib.Memory interface, default=None
        Caching of the fitted transformers.
    transform_input : list of str, default=None
        See :class:`sklearn.pipeline.Pipeline`.
    verbose : bool, default=False
        Print the time elapsed fitting each step.

    Returns
    -------
    p : LaplacePipeline
        The pipeline.

    Examples
    --------
    >>> from sklearn.preprocessing import StandardScaler
    >>> from sklearn_lla import LLARegressor
    >>> from sklearn_lla.pipeline import make_pipeline
    >>> pipe = make_pipeline(StandardScaler(), LLARegressor())
    >>> [name for name, _ in pipe.steps]
    ['standardscaler', 'llaregressor']
    """
    p = _sk_make_pipeline(*steps, memory=memory, transform_input=transform_input,
                          verbose=verbose)
    return LaplacePipeline(p.steps, memory=memory, transform_input=transform_input,
                           verbose=verbose)
