"""scikit-learn compatibility beyond the estimator checks (which run for every
registered estimator in test_contract.py): model selection, pipelines and pickling."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch
from conftest import _train, make_skorch_regressor
from sklearn.base import clone
from sklearn.model_selection import GridSearchCV, KFold, cross_validate
from sklearn.pipeline import Pipeline, make_pipeline
from sklearn.preprocessing import StandardScaler

from sklearn_lla import LLAClassifier, LLARegressor

# ---------------------------------------------------------------------------------
# Model selection with a pretrained net
# ---------------------------------------------------------------------------------


def _weights(module):
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _assert_same(module, weights):
    for k, v in module.state_dict().items():
        assert torch.equal(v, weights[k]), k


def test_gridsearch_prior_variance(reg_data, reg_net):
    w, n_hist = _weights(reg_net.module_), len(reg_net.history)
    gs = GridSearchCV(LLARegressor(reg_net, device="cpu"),
                      {"prior_variance": [0.01, 0.1, 1.0]}, cv=KFold(3))
    gs.fit(reg_data.X, reg_data.y)
    _assert_same(reg_net.module_, w)
    assert len(reg_net.history) == n_hist
    assert gs.best_params_["prior_variance"] in (0.01, 0.1, 1.0)
    assert gs.best_estimator_.prior_variance_ == gs.best_params_["prior_variance"]
    # R^2 (default score) depends only on the mean: the same for every candidate
    s = gs.cv_results_["mean_test_score"]
    np.testing.assert_allclose(s, s[0], rtol=1e-12)


def test_gridsearch_with_uncertainty_scorer(reg_data, reg_net):
    metrics = pytest.importorskip("sklearn_lla.metrics")
    gs = GridSearchCV(LLARegressor(reg_net, noise_variance=0.01, device="cpu"),
                      {"prior_variance": [1e-4, 0.1, 10.0]}, cv=KFold(3),
                      scoring=metrics.neg_nll_scorer)
    gs.fit(reg_data.X, reg_data.y)
    scores = gs.cv_results_["mean_test_score"]
    assert np.all(np.isfinite(scores))
    assert len(set(np.round(scores, 10))) == 3  # the scorer sees the predictive std


def test_cross_validate_regression_multimetric(reg_data, reg_net):
    metrics = pytest.importorskip("sklearn_lla.metrics")
    w = _weights(reg_net.module_)
    scoring = {
        "nll": metrics.neg_nll_scorer,
        "crps": metrics.neg_crps_scorer,
        "cqm": metrics.neg_cqm_scorer,
        "r2": "r2",
    }
    res = cross_validate(LLARegressor(reg_net, device="cpu"), reg_data.X, reg_data.y,
                         cv=KFold(3), scoring=scoring, return_estimator=True)
    _assert_same(reg_net.module_, w)
    for name in scoring:
        assert np.all(np.isfinite(res[f"test_{name}"])), name
    assert np.all(res["test_cqm"] <= 0) and np.all(res["test_cqm"] >= -0.5)
    # each score is what the scorer computes on that fold's estimator
    est = res["estimator"][0]
    test_idx = next(iter(KFold(3).split(reg_data.X)))[1]
    mean, std = est.predict(reg_data.X[test_idx], return_std=True)
    want = -metrics.gaussian_nll(reg_data.y[test_idx], mean, std)
    np.testing.assert_allclose(res["test_nll"][0], want, rtol=1e-12)


def test_cross_validate_classification_multimetric(clf_data, clf_net):
    metrics = pytest.importorskip("sklearn_lla.metrics")
    w = _weights(clf_net.module_)
    scoring = {
        "ece": metrics.neg_ece_scorer,
        "brier": metrics.neg_brier_scorer,
        "log_loss": metrics.neg_log_loss_scorer,
        "accuracy": "accuracy",
    }
    res = cross_validate(LLAClassifier(clf_net, device="cpu"), clf_data.X, clf_data.y,
                         cv=3, scoring=scoring)
    _assert_same(clf_net.module_, w)
    for name in scoring:
        assert np.all(np.isfinite(res[f"test_{name}"])), name
    assert np.all(res["test_accuracy"] > 0.7)
    assert np.all(res["test_ece"] <= 0)


@pytest.fixture(scope="module")
def std_net(reg_data):
    """A skorch net trained on standardised inputs."""
    Xs = StandardScaler().fit_transform(reg_data.X)
    net = make_skorch_regressor(3, 1, (16,), max_epochs=60)
    return _train(net, Xs, reg_data.y.reshape(-1, 1), seed=5)


def test_pipeline_with_scaler(reg_data, std_net):
    w, n_hist = _weights(std_net.module_), len(std_net.history)
    pipe = make_pipeline(StandardScaler(), LLARegressor(std_net, device="cpu"))
    pipe.fit(reg_data.X, reg_data.y)
    mean, std = pipe.predict(reg_data.X_test, return_std=True)
    _assert_same(std_net.module_, w)
    assert len(std_net.history) == n_hist
    scaler = pipe.named_steps["standardscaler"]
    want = std_net.predict(scaler.transform(reg_data.X_test))[:, 0]
    # same float64 module; skorch evaluates in its own batches: equal to rounding
    np.testing.assert_allclose(mean, want, rtol=1e-12, atol=1e-12)
    assert std.shape == mean.shape and np.all(std > 0)

    # and a search over the pipeline's prior variance never retrains the net either
    gs = GridSearchCV(pipe, {"llaregressor__prior_variance": [0.1, 1.0]}, cv=KFold(3))
    gs.fit(reg_data.X, reg_data.y)
    _assert_same(std_net.module_, w)
    assert len(std_net.history) == n_hist
    np.testing.assert_allclose(gs.predict(reg_data.X_test), want, rtol=1e-12, atol=1e-12)


def test_pipeline_clone_keeps_net(std_net):
    pipe = Pipeline([("s", StandardScaler()), ("lla", LLARegressor(std_net, device="cpu"))])
    c = clone(pipe)
    net = c.named_steps["lla"].net
    assert net is std_net or all(
        torch.equal(a, b) for a, b in zip(net.module_.state_dict().values(),
                                          std_net.module_.state_dict().values()))


# ---------------------------------------------------------------------------------
# Pickling
# ---------------------------------------------------------------------------------


def _roundtrip(est):
    return pickle.loads(pickle.dumps(est))


def test_pickle_regressor(reg_data, reg_net, reg2_data, reg2_net):
    for est, data in [
        (LLARegressor(device="cpu", random_state=0), reg_data),
        (LLARegressor(reg_net, device="cpu"), reg_data),
        (LLARegressor(reg2_net, space="parameter", device="cpu"), reg2_data),
    ]:
        est.fit(data.X, data.y)
        back = _roundtrip(est)
        for a, b in zip(est.predict(data.X_test, return_std=True),
                        back.predict(data.X_test, return_std=True)):
            np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(est.predict(data.X_test, return_cov=True)[1],
                                      back.predict(data.X_test, return_cov=True)[1])
        np.testing.assert_array_equal(est.sample_y(data.X_test, 3, random_state=1),
                                      back.sample_y(data.X_test, 3, random_state=1))
        assert back.prior_variance_ == est.prior_variance_
        assert back.noise_variance_ == est.noise_variance_


@pytest.mark.parametrize("link_approx", ["probit", "mc"])
def test_pickle_classifier(link_approx, clf_data, clf_net):
    for net in (None, clf_net):
        est = LLAClassifier(net, link_approx=link_approx, n_samples_predict=64, device="cpu",
                            random_state=0).fit(clf_data.X, clf_data.y)
        back = _roundtrip(est)
        np.testing.assert_array_equal(est.predict_proba(clf_data.X_test),
                                      back.predict_proba(clf_data.X_test))
        np.testing.assert_array_equal(est.predict(clf_data.X_test),
                                      back.predict(clf_data.X_test))
        np.testing.assert_array_equal(est.classes_, back.classes_)
