"""The scikit-learn workflow around the estimators: Pipelines with a ColumnTransformer,
targets on another scale (TransformedTargetRegressor), and the messages of ``fit``
for inputs that do not fit the network."""

from __future__ import annotations

import pickle
import warnings

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import _train, make_skorch_regressor
from sklearn.base import clone
from sklearn.compose import ColumnTransformer
from sklearn.compose import TransformedTargetRegressor as SkTTR
from sklearn.model_selection import GridSearchCV
from sklearn.pipeline import Pipeline
from sklearn.preprocessing import OneHotEncoder, StandardScaler

from sklearn_lla import LLAClassifier, LLARegressor
from sklearn_lla.compose import TransformedTargetRegressor
from sklearn_lla.metrics import neg_nll_scorer
from sklearn_lla.pipeline import LaplacePipeline, make_pipeline

# ---------------------------------------------------------------------------------
# Data: a numeric and a string column
# ---------------------------------------------------------------------------------


def _frame(n, seed):
    rng = np.random.RandomState(seed)
    X = pd.DataFrame({"x": rng.uniform(-2, 2, n), "z": rng.randn(n),
                      "age": rng.choice(["<35", "35-50", ">50"], n)})
    return X, rng


def _prep():
    return ColumnTransformer([("num", StandardScaler(), ["x", "z"]),
                              ("cat", OneHotEncoder(), ["age"])])


@pytest.fixture(scope="module")
def frame_reg():
    X, rng = _frame(150, 0)
    y = np.sin(2 * X["x"].to_numpy()) + (X["age"] == "35-50") + 0.1 * rng.randn(150)
    return X, y.to_numpy() if hasattr(y, "to_numpy") else y


@pytest.fixture(scope="module")
def frame_clf():
    X, rng = _frame(180, 1)
    score = 2 * X["x"].to_numpy() + (X["age"] == ">50").to_numpy() * 2 - 1
    y = np.where(score + 0.5 * rng.randn(180) > 0.5, "yes",
                 np.where(score < -1.0, "no", "maybe"))
    return X, y


def _manual(est, X_tr, y_tr, X_val, y_val):
    """The same fit without a Pipeline: the preprocessing fitted on X_tr by hand."""
    prep = _prep().fit(X_tr)
    fitted = clone(est).fit(prep.transform(X_tr), y_tr,
                            validation_data=(prep.transform(X_val), y_val))
    return prep, fitted


# ---------------------------------------------------------------------------------
# LaplacePipeline
# ---------------------------------------------------------------------------------


def test_pipeline_regressor_every_method_on_raw_frames(frame_reg):
    X, y = frame_reg
    Xtr, ytr, Xv, yv, Xte = X[:90], y[:90], X[90:130], y[90:130], X[130:]
    est = LLARegressor(random_state=0)
    pipe = LaplacePipeline([("prep", _prep()), ("lla", est)])
    pipe.fit(Xtr, ytr, lla__validation_data=(Xv, yv))
    prep, ref = _manual(est, Xtr, ytr, Xv, yv)
    Xt = prep.transform(Xte)
    last = pipe[-1]
    assert last.validation_source_ == "validation_data" and last.conformal_n_ == 40
    assert last.noise_variance_ == pytest.approx(ref.noise_variance_, rel=1e-10)
    np.testing.assert_allclose(pipe.predict(Xte), ref.predict(Xt))
    for got, want in zip(pipe.predict(Xte, return_std=True), ref.predict(Xt, return_std=True)):
        np.testing.assert_allclose(got, want)
    for got, want in zip(pipe.predict(Xte, return_cov=True), ref.predict(Xt, return_cov=True)):
        np.testing.assert_allclose(got, want)
    for got, want in zip(pipe.predict_interval(Xte, confidence=0.8),
                         ref.predict_interval(Xt, confidence=0.8)):
        np.testing.assert_allclose(got, want)
    np.testing.assert_allclose(pipe.sample_y(Xte, n_samples=3, random_state=1),
                               ref.sample_y(Xt, n_samples=3, random_state=1))
    assert pipe.score(Xte, y[130:]) == pytest.approx(ref.score(Xt, y[130:]))
    # conformalize on raw rows: the same scores as on the transformed rows
    assert pipe.conformalize(X[110:130], y[110:130]) is pipe
    ref.conformalize(prep.transform(X[110:130]), y[110:130])
    assert last.conformal_source_ == "conformalize"
    np.testing.assert_allclose(last.conformal_scores_, ref.conformal_scores_)
    # the scorers and a search over the last step's parameters take the pipeline
    assert np.isfinite(neg_nll_scorer(pipe, Xte, y[130:]))
    again = pickle.loads(pickle.dumps(pipe))
    np.testing.assert_allclose(again.predict_interval(Xte)[0], pipe.predict_interval(Xte)[0])


def test_pipeline_classifier_every_method_on_raw_frames(frame_clf):
    X, y = frame_clf
    Xtr, ytr, Xv, yv, Xte = X[:100], y[:100], X[100:150], y[100:150], X[150:]
    est = LLAClassifier(random_state=0)
    pipe = make_pipeline(_prep(), est)
    assert isinstance(pipe, LaplacePipeline)
    pipe.fit(Xtr, ytr, llaclassifier__validation_data=(Xv, yv))
    prep, ref = _manual(est, Xtr, ytr, Xv, yv)
    Xt = prep.transform(Xte)
    assert pipe[-1].validation_source_ == "validation_data"
    assert list(pipe.classes_) == list(ref.classes_)
    np.testing.assert_allclose(pipe.predict_proba(Xte), ref.predict_proba(Xt))
    np.testing.assert_allclose(pipe.predict_log_proba(Xte), ref.predict_log_proba(Xt))
    np.testing.assert_array_equal(pipe.predict(Xte), ref.predict(Xt))
    for kw in ({}, {"method": "aps"}, {"method": "aps", "randomized": True}):
        np.testing.assert_array_equal(pipe.predict_set(Xte, confidence=0.8, **kw),
                                      ref.predict_set(Xt, confidence=0.8, **kw))
    pipe.conformalize(X[120:150], y[120:150])
    ref.conformalize(prep.transform(X[120:150]), y[120:150])
    np.testing.assert_allclose(pipe[-1].conformal_scores_["lac"], ref.conformal_scores_["lac"])
    assert pipe.score(Xte, y[150:]) == pytest.approx(ref.score(Xt, y[150:]))
    # a regressor's methods are not offered by a classifier's pipeline, and vice versa
    assert not hasattr(pipe, "predict_interval") and not hasattr(pipe, "sample_y")


def test_pipeline_grid_search_routes_validation_data(frame_reg):
    """A search over the last step's prior, each candidate calibrated on the same
    held-out rows through the fitted steps."""
    X, y = frame_reg
    pipe = LaplacePipeline([("prep", _prep()), ("lla", LLARegressor(random_state=0))])
    search = GridSearchCV(pipe, {"lla__prior_variance": [0.1, 1.0]}, scoring=neg_nll_scorer,
                          cv=2)
    search.fit(X[:100], y[:100], lla__validation_data=(X[100:], y[100:]))
    best = search.best_estimator_
    assert best[-1].validation_source_ == "validation_data"
    assert len(best.predict_interval(X[100:110])[0]) == 10


def test_plain_pipeline_names_validation_data(frame_reg):
    """sklearn's Pipeline passes the raw frame: the error names validation_data and
    the pipeline that transforms it."""
    X, y = frame_reg
    pipe = Pipeline([("prep", _prep()), ("lla", LLARegressor(random_state=0))])
    with pytest.raises(ValueError, match=r"validation_data.*LaplacePipeline"):
        pipe.fit(X[:90], y[:90], lla__validation_data=(X[90:], y[90:]))


def test_pipeline_validation_data_with_metadata_routing(frame_reg):
    import sklearn

    X, y = frame_reg
    with sklearn.config_context(enable_metadata_routing=True):
        est = LLARegressor(random_state=0).set_fit_request(validation_data=True)
        pipe = LaplacePipeline([("prep", _prep()), ("lla", est)])
        pipe.fit(X[:90], y[:90], validation_data=(X[90:130], y[90:130]))
        assert pipe[-1].validation_source_ == "validation_data"
        assert pipe[-1].conformal_n_ == 40


# ---------------------------------------------------------------------------------
# Targets on another scale
# ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def scaled_problem(reg_data):
    """A net trained on standardised targets, and the raw targets (mean 150, std 40)."""
    y_raw = 150.0 + 40.0 * reg_data.y
    scaler = StandardScaler().fit(y_raw.reshape(-1, 1))
    y_std = scaler.transform(y_raw.reshape(-1, 1))
    net = _train(make_skorch_regressor(3, 1, (16,)), reg_data.X, y_std, seed=0)
    return net, y_raw


def test_target_scale_warning(reg_data, scaled_problem):
    net, y_raw = scaled_problem
    X = reg_data.X
    with pytest.warns(UserWarning, match=r"cannot be predictions of y.*TransformedTargetRegressor"):
        LLARegressor(net).fit(X, y_raw)
    # centred but not scaled: R^2 near 0, outputs 40 x narrower than y
    with pytest.warns(UserWarning, match="cannot be predictions of y"):
        LLARegressor(net).fit(X, y_raw - y_raw.mean())
    y_std = (y_raw - y_raw.mean()) / y_raw.std()
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        LLARegressor(net).fit(X, y_std)


def test_transformed_target_regressor_maps_the_uncertainty(reg_data, scaled_problem):
    net, y_raw = scaled_problem
    X, Xq = reg_data.X, reg_data.X_test
    ttr = TransformedTargetRegressor(LLARegressor(net), transformer=StandardScaler())
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no target-scale warning
        ttr.fit(X[:45], y_raw[:45], validation_data=(X[45:], y_raw[45:]))
    mu, sd = y_raw[:45].mean(), y_raw[:45].std()
    ref = LLARegressor(net).fit(X[:45], (y_raw[:45] - mu) / sd,
                                validation_data=(X[45:], (y_raw[45:] - mu) / sd))
    assert ttr.regressor_.validation_source_ == "validation_data"
    assert ttr.regressor_.noise_variance_ == pytest.approx(ref.noise_variance_, rel=1e-9)
    m_ref, s_ref = ref.predict(Xq, return_std=True)
    mean, std = ttr.predict(Xq, return_std=True)
    np.testing.assert_allclose(mean, mu + sd * m_ref, rtol=1e-9)
    np.testing.assert_allclose(std, sd * s_ref, rtol=1e-9)
    np.testing.assert_allclose(ttr.predict(Xq), mean)
    m2, cov = ttr.predict(Xq, return_cov=True)
    np.testing.assert_allclose(cov, sd ** 2 * ref.predict(Xq, return_cov=True)[1], rtol=1e-9)
    lo, hi = ttr.predict_interval(Xq, confidence=0.8)
    lo_r, hi_r = ref.predict_interval(Xq, confidence=0.8)
    np.testing.assert_allclose(lo, mu + sd * lo_r, rtol=1e-9)
    np.testing.assert_allclose(hi, mu + sd * hi_r, rtol=1e-9)
    draws = ttr.sample_y(Xq, n_samples=4, random_state=3)
    np.testing.assert_allclose(draws, mu + sd * ref.sample_y(Xq, n_samples=4, random_state=3),
                               rtol=1e-9)
    assert ttr.conformalize(X[45:], y_raw[45:]) is ttr
    assert ttr.regressor_.conformal_source_ == "conformalize"
    assert np.isfinite(neg_nll_scorer(ttr, Xq, 150 + 40 * reg_data.y_test))


def test_sklearn_ttr_return_std_says_what_to_use(reg_data, scaled_problem):
    net, y_raw = scaled_problem
    ttr = SkTTR(regressor=LLARegressor(net), transformer=StandardScaler()).fit(reg_data.X, y_raw)
    for kw in ({"return_std": True}, {"return_cov": True}):
        with pytest.raises(AttributeError,
                           match=r"sklearn_lla\.compose\.TransformedTargetRegressor"):
            ttr.predict(reg_data.X_test, **kw)
    # the (mean, std) pair stays a tuple for everything else
    mean, std = LLARegressor(net).fit(reg_data.X, (y_raw - 150) / 40).predict(
        reg_data.X_test, return_std=True)
    assert mean.shape == std.shape


def test_non_affine_target_transformer(reg_data):
    """A log: no std on y's scale (clear error); draws and intervals map through."""
    X, Xq = reg_data.X, reg_data.X_test
    y = np.exp(reg_data.y)
    ttr = TransformedTargetRegressor(LLARegressor(random_state=0), func=np.log,
                                     inverse_func=np.exp).fit(X, y)
    with pytest.raises(ValueError, match="affine.*not affine"):
        ttr.predict(Xq, return_std=True)
    lo, hi = ttr.predict_interval(Xq, confidence=0.8)
    lo_t, hi_t = ttr.regressor_.predict_interval(Xq, confidence=0.8)
    np.testing.assert_allclose(lo, np.exp(lo_t))
    np.testing.assert_allclose(hi, np.exp(hi_t))
    assert (ttr.sample_y(Xq, n_samples=5) > 0).all()


def test_mixing_target_transformer_is_refused(reg2_data):
    from sklearn.decomposition import PCA

    ttr = TransformedTargetRegressor(LLARegressor(random_state=0), transformer=PCA(2),
                                     check_inverse=False).fit(reg2_data.X, reg2_data.y)
    with pytest.raises(ValueError, match="mixes the targets"):
        ttr.predict(reg2_data.X_test, return_std=True)


def test_transformed_target_regressor_multi_output(reg2_data):
    X, Y = reg2_data.X, 10.0 + np.array([3.0, 0.5]) * reg2_data.y
    ttr = TransformedTargetRegressor(LLARegressor(random_state=0),
                                     transformer=StandardScaler()).fit(X, Y)
    scale = ttr.transformer_.scale_
    m, s = ttr.predict(reg2_data.X_test, return_std=True)
    m_t, s_t = ttr.regressor_.predict(reg2_data.X_test, return_std=True)
    np.testing.assert_allclose(s, s_t * scale)
    _, cov = ttr.predict(reg2_data.X_test, return_cov=True)
    np.testing.assert_allclose(
        cov, ttr.regressor_.predict(reg2_data.X_test, return_cov=True)[1] * scale ** 2)
    assert ttr.sample_y(reg2_data.X_test, n_samples=3).shape == (len(m), 2, 3)


# ---------------------------------------------------------------------------------
# Messages
# ---------------------------------------------------------------------------------


def test_wrong_column_count_names_x_and_the_width(reg_data, reg_net):
    X = reg_data.X
    for bad in (X[:, :2], np.c_[X, X[:, :1]]):
        with pytest.raises(ValueError, match=r"X has \d feature\(s\).*takes 3.*\(n_samples, 3\)"):
            LLARegressor(reg_net).fit(bad, reg_data.y)
    # a torch module passed as is: the same check
    with pytest.raises(ValueError, match=r"\(n_samples, 3\)"):
        LLARegressor(reg_net.module_).fit(X[:, :2], reg_data.y)


def test_wrong_column_count_of_a_custom_forward_is_still_named(reg_data):
    """A custom forward can reshape its input: no width is assumed; the failing forward
    is reported with X's shape."""

    class Custom(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(6, 1, dtype=torch.float64)

        def forward(self, x):
            return self.lin(torch.cat([x, x ** 2], dim=1))

    X = reg_data.X
    LLARegressor(Custom(), prior_variance=1.0, noise_variance=1.0).fit(X, reg_data.y)
    with pytest.raises(ValueError, match=r"X of shape \(60, 2\).*columns the network"):
        LLARegressor(Custom(), prior_variance=1.0, noise_variance=1.0).fit(X[:, :2], reg_data.y)


def test_validation_data_shape_messages(reg_data, reg_net, clf_data, clf_net):
    X, y = reg_data.X, reg_data.y
    with pytest.raises(ValueError, match=r"validation_data.*\(n_val, 3\)"):
        LLARegressor(reg_net).fit(X, y, validation_data=(X[:10, :2], y[:10]))
    with pytest.raises(ValueError, match="validation_data has 10 inputs but 8 targets"):
        LLARegressor(reg_net).fit(X, y, validation_data=(X[:10], y[:8]))
    with pytest.raises(TypeError, match=r"validation_data must be a pair"):
        LLARegressor(reg_net).fit(X, y, validation_data=X[:10])
    with pytest.raises(ValueError, match=r"validation_data.*\(n_val, 2\)"):
        LLAClassifier(clf_net).fit(clf_data.X, clf_data.y,
                                   validation_data=(clf_data.X[:10, :1], clf_data.y[:10]))


# ---------------------------------------------------------------------------------
# Searches: the grid's edge
# ---------------------------------------------------------------------------------


def test_check_grid_edges_on_a_search_that_deletes_the_posterior(reg_data, reg_net):
    """Scored on the rows the network fitted, the NLL is won by the grid's floor: the
    check says so and points to rows the network did not see."""
    from sklearn_lla._core.hyper import HyperparameterWarning
    from sklearn_lla.model_selection import check_grid_edges

    search = GridSearchCV(LLARegressor(reg_net), {"prior_variance": [1e-2, 0.1, 1.0, 10.0]},
                          scoring=neg_nll_scorer, cv=3).fit(reg_data.X, reg_data.y)
    assert search.best_params_["prior_variance"] == 1e-2
    with pytest.warns(HyperparameterWarning,
                      match=r"prior_variance.*lower edge.*did not see"):
        assert check_grid_edges(search) == {"prior_variance": "lower"}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert check_grid_edges(search, warn=False) == {"prior_variance": "lower"}


def test_check_grid_edges_inside_upper_and_non_numeric():
    from types import SimpleNamespace

    from sklearn.linear_model import Ridge

    from sklearn_lla._core.hyper import HyperparameterWarning
    from sklearn_lla.model_selection import check_grid_edges

    def fake(best, grid, kernel=("a", "b")):
        params = [{"alpha": a, "kernel": k} for a in grid for k in kernel]
        return SimpleNamespace(cv_results_={"params": params},
                               best_params_={"alpha": best, "kernel": kernel[0]})

    grid = [0.1, 1.0, 10.0]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert check_grid_edges(fake(1.0, grid)) == {}  # inside; "kernel" is no range
        assert check_grid_edges(fake(10.0, [1.0, 10.0])) == {}  # two values: no range
    with pytest.warns(HyperparameterWarning, match=r"alpha.*upper edge.*Extend the grid"):
        assert check_grid_edges(fake(10.0, grid)) == {"alpha": "upper"}
    with pytest.warns(HyperparameterWarning) as record:
        assert check_grid_edges(fake(0.1, grid)) == {"alpha": "lower"}
    assert "did not see" not in str(record[0].message)  # the prior's advice is for priors
    with pytest.raises(AttributeError, match="not fitted"):
        check_grid_edges(GridSearchCV(Ridge(), {"alpha": [1.0]}))
    with pytest.raises(AttributeError, match="best_params_"):
        check_grid_edges(SimpleNamespace(cv_results_={"params": []}))


# ---------------------------------------------------------------------------------
# Searches that keep the uncertainty: prior_search_scoring / OneStandardErrorRule
# ---------------------------------------------------------------------------------


def _held_out_split(n_train, n_val):
    from sklearn.model_selection import PredefinedSplit

    return PredefinedSplit(np.r_[np.full(n_train, -1), np.zeros(n_val)])


def _results(nll, se, evidence, grid=(0.01, 0.1, 1.0, 10.0), n_splits=1):
    res = {"params": [{"prior_variance": v} for v in grid],
           "param_prior_variance": np.ma.masked_array(np.array(grid, dtype=object)),
           "mean_test_nll": -np.asarray(nll, dtype=float),
           "mean_test_nll_se": np.asarray(se, dtype=float),
           "mean_test_log_evidence": np.asarray(evidence, dtype=float)}
    for k in range(n_splits):
        res[f"split{k}_test_nll"] = res["mean_test_nll"]
    return res


def test_one_standard_error_rule_ties_and_tie_breaks():
    from sklearn_lla.model_selection import OneStandardErrorRule

    # the floor has the best held-out NLL, but 0.1 and 1.0 are within one SE of it
    res = _results([0.50, 0.52, 0.58, 0.90], [0.1] * 4, [-90, -70, -60, -80])
    assert OneStandardErrorRule()(res) == 2             # the evidence among the tied
    assert OneStandardErrorRule(prefer="largest")(res) == 2   # 10.0 is not tied
    assert OneStandardErrorRule(tolerance=0.0)(res) == 0      # the plain best score
    # four folds: the standard error of their mean is halved, so 1.0 drops out
    res4 = _results([0.50, 0.52, 0.58, 0.90], [0.1] * 4, [-90, -70, -60, -80], n_splits=4)
    assert OneStandardErrorRule()(res4) == 1
    # a failed candidate (NaN score) is never chosen
    res_nan = _results([0.50, np.nan, 0.52, 0.90], [0.1] * 4, [-90, 0, -60, -80])
    assert OneStandardErrorRule()(res_nan) == 2
    with pytest.raises(KeyError, match="prior_search_scoring"):
        OneStandardErrorRule(standard_error="missing")(res)
    with pytest.raises(ValueError, match="prefer='largest'"):
        OneStandardErrorRule()(_results([0.5] * 4, [0.1] * 4, [np.nan] * 4))
    with pytest.raises(ValueError, match="prefer"):
        OneStandardErrorRule(prefer="smallest")


def test_nll_standard_error_scorer_matches_the_per_row_losses(reg_data, reg_net, clf_data,
                                                              clf_net):
    from sklearn.metrics import log_loss

    from sklearn_lla.metrics import gaussian_nll
    from sklearn_lla.model_selection import nll_standard_error_scorer

    reg = LLARegressor(reg_net).fit(reg_data.X, reg_data.y)
    m, s = reg.predict(reg_data.X_test, return_std=True)
    rows = 0.5 * np.log(2 * np.pi * s ** 2) + 0.5 * ((reg_data.y_test - m) / s) ** 2
    assert np.mean(rows) == pytest.approx(gaussian_nll(reg_data.y_test, m, s))
    assert nll_standard_error_scorer(reg, reg_data.X_test, reg_data.y_test) == pytest.approx(
        np.std(rows, ddof=1) / np.sqrt(len(rows)))
    clf = LLAClassifier(clf_net).fit(clf_data.X, clf_data.y)
    p = clf.predict_proba(clf_data.X_test)
    rows = -np.log(p[np.arange(len(p)), clf_data.y_test])
    assert np.mean(rows) == pytest.approx(log_loss(clf_data.y_test, p, labels=clf.classes_))
    assert nll_standard_error_scorer(clf, clf_data.X_test, clf_data.y_test) == pytest.approx(
        np.std(rows, ddof=1) / np.sqrt(len(rows)))


def test_log_evidence_scorer_unwraps_and_says_what_to_use(reg_data, reg_net):
    from sklearn.linear_model import BayesianRidge

    from sklearn_lla import ELLARegressor
    from sklearn_lla.model_selection import log_evidence_scorer

    est = LLARegressor(reg_net, prior_variance=0.5).fit(reg_data.X, reg_data.y)
    assert log_evidence_scorer(est, None, None) == est.log_marginal_likelihood_
    pipe = Pipeline([("scale", StandardScaler(with_mean=False, with_std=False)),
                     ("lla", clone(est))]).fit(reg_data.X, reg_data.y)
    assert log_evidence_scorer(pipe, None, None) == pytest.approx(est.log_marginal_likelihood_)
    ttr = TransformedTargetRegressor(clone(est)).fit(reg_data.X, reg_data.y)
    assert np.isfinite(log_evidence_scorer(ttr, None, None))
    ella = ELLARegressor(reg_net, prior_variance=0.5, random_state=0).fit(reg_data.X,
                                                                           reg_data.y)
    assert np.isfinite(log_evidence_scorer(ella, None, None))  # from its posterior
    with pytest.raises(AttributeError, match="prefer='largest'"):
        log_evidence_scorer(BayesianRidge().fit(reg_data.X, reg_data.y), None, None)


@pytest.mark.parametrize("task", ["regression", "classification"])
def test_prior_search_scoring_in_grid_search(task, reg_data, reg_net, clf_data, clf_net):
    """The README's recipe end to end: held-out rows as the only test fold, the one-SE
    rule with the evidence, the chosen candidate refitted on all rows."""
    from sklearn_lla.model_selection import (
        OneStandardErrorRule,
        check_grid_edges,
        prior_search_scoring,
    )

    if task == "regression":
        data, est = reg_data, LLARegressor(reg_net)
    else:
        data, est = clf_data, LLAClassifier(clf_net)
    X = np.concatenate([data.X, data.X_test])
    y = np.concatenate([data.y, data.y_test])
    grid = [1e-3, 1e-2, 0.1, 1.0, 10.0]
    search = GridSearchCV(est, {"prior_variance": grid},
                          cv=_held_out_split(len(data.X), len(data.X_test)),
                          **prior_search_scoring(task == "classification")).fit(X, y)
    res = search.cv_results_
    i = search.best_index_
    assert i == OneStandardErrorRule()(res)
    nll, se = -res["mean_test_nll"], res["mean_test_nll_se"]
    best = int(np.argmin(nll))
    tied = nll <= nll[best] + se[best]
    assert tied[i] and res["mean_test_log_evidence"][i] == res["mean_test_log_evidence"][tied].max()
    assert search.best_estimator_.prior_variance == grid[i]
    assert search.best_estimator_.n_features_in_ == X.shape[1]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        check_grid_edges(search)  # works with a callable refit
    # the largest tied prior: any estimator, no evidence needed
    largest = GridSearchCV(est, {"prior_variance": grid},
                           cv=_held_out_split(len(data.X), len(data.X_test)),
                           **prior_search_scoring(task == "classification", prefer="largest"))
    largest.fit(X, y)
    assert "mean_test_log_evidence" not in largest.cv_results_
    assert largest.best_params_["prior_variance"] == max(np.array(grid)[tied])
