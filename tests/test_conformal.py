"""Split-conformal intervals and sets (``sklearn_lla/_conformal.py``).

The statistical tests rest on the exact law of split-conformal coverage: with ``n``
calibration rows, rank ``k = ceil((n + 1) c)`` and continuous scores, the coverage
given the calibration set is ``Beta(k, n + 1 - k)``, so the number of ``m`` fresh
test points covered is ``BetaBinomial(m, k, n + 1 - k)``, with mean
``m k / (n + 1)`` (Vovk et al. 2005; Angelopoulos & Bates 2023, sec. 3.2). Over
``S`` independent calibration / test draws the mean coverage is within
``Z = 4`` standard errors of ``k / (n + 1)`` except with probability 6e-5 (normal
approximation of a mean of ``S >= 100`` bounded draws). The draws are seeded, so a
run is reproducible; the power of the test is checked on the same draws: the
quantile one rank too low or too high (coverage ``(k -+ 1) / (n + 1)``, 0.02 off,
7 to 9 standard errors with ``S = 600``) is rejected.
"""

from __future__ import annotations

import math
import pickle
import re
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import _train, make_skorch_classifier, make_skorch_regressor
from scipy import stats
from sklearn.exceptions import NotFittedError

from sklearn_lla import (
    ELLARegressor,
    LLAClassifier,
    LLARegressor,
    SubspaceLaplace,
    SubspaceLaplaceClassifier,
    SubspaceLaplaceRegressor,
)
from sklearn_lla._conformal import (
    _uniforms,
    conformal_quantile,
    conformal_rank,
    prediction_sets,
)
from sklearn_lla.metrics import interval_coverage, set_coverage

ROOT = Path(__file__).resolve().parent.parent
Z = 4.0
_W = np.array([1.0, 0.5, -0.3])


# ---------------------------------------------------------------------------------
# Data: fresh draws from the distribution the fixture nets were trained on
# ---------------------------------------------------------------------------------


def _reg_draw(n, rng):
    """conftest's regression inputs, with heteroscedastic noise (sd 0.05 to 0.25)."""
    X = rng.uniform(-2.0, 2.0, (n, 3))
    y = np.sin(X @ _W) + (0.05 + 0.1 * np.abs(X[:, 0])) * rng.randn(n)
    return X, y


_CENTERS = np.array([[0.0, 0.0], [2.5, 0.5], [1.0, 2.5]])


def _clf_draw(n, rng):
    """Three overlapping Gaussian blobs: continuous, non-degenerate probabilities."""
    y = rng.randint(0, 3, n)
    return _CENTERS[y] + 1.2 * rng.randn(n, 2), y


@pytest.fixture(scope="module")
def lla_reg(reg_data, reg_net):
    return LLARegressor(reg_net, device="cpu").fit(reg_data.X, reg_data.y)


@pytest.fixture(scope="module")
def blob_net():
    X, y = _clf_draw(300, np.random.RandomState(0))
    return _train(make_skorch_classifier(2, 3, (16,), max_epochs=60), X, y, seed=0), X, y


@pytest.fixture(scope="module")
def lla_clf(blob_net):
    net, X, y = blob_net
    return LLAClassifier(net, device="cpu").fit(X, y)


def _betabinom_mean_check(coverages, n, k, m, what):
    """Assert the mean of ``S`` coverages is within Z standard errors of ``k / (n + 1)``."""
    dist = stats.betabinom(m, k, n + 1 - k)
    mean, sd = dist.mean() / m, dist.std() / m
    se = sd / math.sqrt(len(coverages))
    z = (np.mean(coverages) - mean) / se
    assert abs(z) < Z, (f"{what}: mean coverage {np.mean(coverages):.4f} vs "
                        f"{mean:.4f} (z = {z:.1f}, {len(coverages)} draws)")
    return z, sd


# ---------------------------------------------------------------------------------
# The quantile maths
# ---------------------------------------------------------------------------------


@pytest.mark.parametrize("confidence", ["0.5", "0.8", "0.9", "0.95", "0.99", "0.999"])
def test_conformal_rank_is_exact(confidence):
    c = Fraction(confidence)  # the exact decimal the user means
    for n in range(1, 3000):
        exact = math.ceil((n + 1) * c)
        if exact > n:
            with pytest.raises(ValueError, match="calibration row"):
                conformal_rank(n, float(confidence))
        else:
            assert conformal_rank(n, float(confidence)) == exact, n


def test_conformal_rank_too_few_rows_message():
    with pytest.raises(ValueError, match=r"8 calibration row\(s\).*8/9.*needs at least 9 rows"):
        conformal_rank(8, 0.9)
    assert conformal_rank(9, 0.9) == 9
    with pytest.raises(ValueError, match="at least 19 rows"):
        conformal_rank(18, 0.95)
    for bad in (0.0, 1.0, -0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match="confidence"):
            conformal_rank(100, bad)
    for bad in (True, "0.9", None):
        with pytest.raises(TypeError, match="confidence"):
            conformal_rank(100, bad)


def test_conformal_quantile_per_column():
    scores = np.sort(np.random.RandomState(0).rand(19, 3), axis=0)
    q = conformal_quantile(scores, 0.9)  # k = 18
    np.testing.assert_array_equal(q, scores[17])
    assert conformal_quantile(scores[:, 0], 0.5) == scores[9, 0]


# ---------------------------------------------------------------------------------
# Regression: values, coverage, shapes
# ---------------------------------------------------------------------------------


def test_interval_is_mean_plus_minus_q_std(lla_reg):
    rng = np.random.RandomState(1)
    Xc, yc = _reg_draw(40, rng)
    Xt, _ = _reg_draw(15, rng)
    lla_reg.conformalize(Xc, yc)
    mc, sc = lla_reg.predict(Xc, return_std=True)
    scores = np.sort(np.abs(yc - mc) / sc)
    np.testing.assert_allclose(lla_reg.conformal_scores_, scores, rtol=1e-12)
    assert lla_reg.conformal_n_ == 40 and lla_reg.conformal_source_ == "conformalize"
    mt, st = lla_reg.predict(Xt, return_std=True)
    for c in (0.5, 0.8, 0.9, 0.95):
        q = scores[math.ceil(41 * c) - 1]
        lo, hi = lla_reg.predict_interval(Xt, confidence=c)
        np.testing.assert_allclose(lo, mt - q * st, rtol=1e-12)
        np.testing.assert_allclose(hi, mt + q * st, rtol=1e-12)
    # wider with the confidence, and every interval contains the mean
    lo8, hi8 = lla_reg.predict_interval(Xt, confidence=0.8)
    assert np.all(hi - lo >= hi8 - lo8) and np.all((lo8 <= mt) & (mt <= hi8))


@pytest.mark.parametrize("confidence", [0.8, 0.9])
def test_regression_coverage_follows_the_exact_law(lla_reg, confidence):
    n, m, S = 49, 100, 600
    k = conformal_rank(n, confidence)  # 40 / 50 = 0.8, 45 / 50 = 0.9
    cover, lower_rank, upper_rank = [], [], []
    for s in range(S):
        rng = np.random.RandomState(10_000 + s)
        Xc, yc = _reg_draw(n, rng)
        Xt, yt = _reg_draw(m, rng)
        lla_reg.conformalize(Xc, yc)
        lo, hi = lla_reg.predict_interval(Xt, confidence)
        cover.append(interval_coverage(yt, lo, hi))
        # the same draws with the quantile one rank off (power of the test)
        mt, st = lla_reg.predict(Xt, return_std=True)
        z = np.abs(yt - mt) / st
        lower_rank.append(np.mean(z <= lla_reg.conformal_scores_[k - 2]))
        upper_rank.append(np.mean(z <= lla_reg.conformal_scores_[k]))
    _, sd = _betabinom_mean_check(cover, n, k, m, "conformal intervals")
    # the spread over draws is the Beta-binomial's (variance ratio within 0.7-1.3:
    # the sample variance of 600 draws has a relative sd of about 0.06)
    assert 0.7 < np.var(cover, ddof=1) / sd**2 < 1.3
    # one rank off is 0.02 of coverage: about 7 (0.8) and 9 (0.9) standard errors
    with pytest.raises(AssertionError):
        _betabinom_mean_check(lower_rank, n, k, m, "rank k - 1")
    with pytest.raises(AssertionError):
        _betabinom_mean_check(upper_rank, n, k, m, "rank k + 1")


def test_automatic_calibration_reusing_the_noise_rows_keeps_coverage(reg_data, reg_net):
    """fit(validation_data=...) calibrates the noise AND the conformal scores on the
    same rows; the coverage must still follow the split-conformal law."""
    n, m, S, c = 49, 100, 100, 0.9
    k = conformal_rank(n, c)
    cover = []
    for s in range(S):
        rng = np.random.RandomState(20_000 + s)
        Xc, yc = _reg_draw(n, rng)
        Xt, yt = _reg_draw(m, rng)
        est = LLARegressor(reg_net, device="cpu").fit(reg_data.X, reg_data.y,
                                                       validation_data=(Xc, yc))
        assert est.conformal_source_ == "validation_data" and est.conformal_n_ == n
        cover.append(interval_coverage(yt, *est.predict_interval(Xt, c)))
    _betabinom_mean_check(cover, n, k, m, "automatic calibration")


@pytest.mark.parametrize("space", ["parameter", "function"])
def test_automatic_calibration_equals_conformalize_for_a_rescaled_posterior(space, reg_data,
                                                                           reg_net):
    """Held-out rows fit one scale c of the evidence's pair: sigma(x) becomes sqrt(c)
    sigma(x) everywhere and the conformal quantile q / sqrt(c), so the intervals of
    fit(validation_data=cal) are those of fit() + conformalize(cal), to rounding."""
    rng = np.random.RandomState(7)
    Xc, yc = _reg_draw(60, rng)
    Xq = np.vstack([_reg_draw(30, rng)[0], 3.0 * _reg_draw(10, rng)[0]])
    auto = LLARegressor(reg_net, space=space, device="cpu").fit(
        reg_data.X, reg_data.y, validation_data=(Xc, yc))
    plain = LLARegressor(reg_net, space=space, device="cpu").fit(
        reg_data.X, reg_data.y).conformalize(Xc, yc)
    c = auto.hyper_trace_["calibration"]["scale"]
    assert abs(c - 1.0) > 1e-3  # the calibration did rescale
    for conf in (0.8, 0.9):
        np.testing.assert_allclose(auto.predict_interval(Xq, conf),
                                   plain.predict_interval(Xq, conf), rtol=1e-8, atol=1e-10)


def test_multi_output_is_per_target(reg2_data, reg2_net):
    est = LLARegressor(reg2_net, device="cpu").fit(reg2_data.X, reg2_data.y)
    rng = np.random.RandomState(3)
    Xc = rng.uniform(-2, 2, (30, 3))
    yc = np.column_stack([np.sin(Xc @ _W), np.cos(Xc[:, 1])]) + 0.1 * rng.randn(30, 2)
    est.conformalize(Xc, yc)
    assert est.conformal_scores_.shape == (30, 2)
    mc, sc = est.predict(Xc, return_std=True)
    scores = np.sort(np.abs(yc - mc) / sc, axis=0)
    np.testing.assert_allclose(est.conformal_scores_, scores, rtol=1e-12)
    lo, hi = est.predict_interval(reg2_data.X_test, 0.9)
    assert lo.shape == hi.shape == (len(reg2_data.X_test), 2)
    mt, st = est.predict(reg2_data.X_test, return_std=True)
    q = scores[math.ceil(31 * 0.9) - 1]  # one quantile per target
    np.testing.assert_allclose(hi, mt + q[None, :] * st, rtol=1e-12)
    with pytest.raises(ValueError, match="2 target"):
        est.conformalize(Xc, yc[:, 0])


def test_interval_grows_off_the_data(lla_reg):
    lla_reg.conformalize(*_reg_draw(50, np.random.RandomState(4)))
    lo, hi = lla_reg.predict_interval(np.array([[0.0, 0.0, 0.0], [6.0, 6.0, 6.0]]))
    assert (hi - lo)[1] > 2 * (hi - lo)[0]


# ---------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------


def test_errors(reg_data, reg_net):
    X, y = reg_data.X, reg_data.y
    with pytest.raises(NotFittedError):
        LLARegressor(reg_net).conformalize(X, y)
    with pytest.raises(NotFittedError):
        LLARegressor(reg_net).predict_interval(X)
    # a pretrained net without held-out rows: fitted, not calibrated
    plain = LLARegressor(reg_net, device="cpu").fit(X, y)
    assert not hasattr(plain, "conformal_scores_")
    with pytest.raises(NotFittedError, match=r"not conformalized.*conformalize\(X_cal, y_cal\)"):
        plain.predict_interval(X)
    with pytest.raises(ValueError, match="X_cal has 60 rows but y_cal has shape"):
        plain.conformalize(X, y[:-1])
    with pytest.raises(ValueError, match="NaN or infinite"):
        plain.conformalize(X, np.where(np.arange(60) == 3, np.nan, y))
    with pytest.raises(ValueError, match="features"):
        plain.conformalize(X[:, :2], y)
    plain.conformalize(X[:5], y[:5])
    with pytest.raises(ValueError, match=r"5 calibration row\(s\).*needs at least 9 rows"):
        plain.predict_interval(X, confidence=0.9)
    plain.predict_interval(X, confidence=0.8)  # 5 rows support up to 5/6
    for bad in (0.0, 1.0, 90):
        with pytest.raises(ValueError, match="confidence"):
            plain.predict_interval(X, confidence=bad)


def test_classification_errors(blob_net):
    net, X, y = blob_net
    with pytest.raises(NotFittedError):
        LLAClassifier(net).conformalize(X, y)
    clf = LLAClassifier(net, device="cpu").fit(X, y)
    with pytest.raises(NotFittedError, match="not conformalized"):
        clf.predict_set(X)
    with pytest.raises(ValueError, match=r"labels \[7\] that are not in classes_"):
        clf.conformalize(X, np.where(y == 0, 7, y))
    with pytest.raises(ValueError, match="one label per input row"):
        clf.conformalize(X, y[:-2])
    clf.conformalize(X, y)
    with pytest.raises(ValueError, match="method must be one of"):
        clf.predict_set(X, method="raps")
    with pytest.raises(ValueError, match="randomized=True is for method='aps'"):
        clf.predict_set(X, randomized=True)
    clf.conformalize(X[:10], y[:10])
    with pytest.raises(ValueError, match="at least 19 rows"):
        clf.predict_set(X, confidence=0.95)


# ---------------------------------------------------------------------------------
# Refit, pickling, automatic calibration
# ---------------------------------------------------------------------------------


def test_pickle_keeps_the_calibration(lla_reg, lla_clf, blob_net):
    Xc, yc = _reg_draw(30, np.random.RandomState(5))
    lla_reg.conformalize(Xc, yc)
    back = pickle.loads(pickle.dumps(lla_reg))
    for a, b in zip(lla_reg.predict_interval(Xc, 0.9), back.predict_interval(Xc, 0.9)):
        np.testing.assert_array_equal(a, b)
    assert back.conformal_n_ == 30
    _, X, y = blob_net
    lla_clf.conformalize(X[:80], y[:80])
    back = pickle.loads(pickle.dumps(lla_clf))
    for method, rand in (("lac", False), ("aps", False), ("aps", True)):
        np.testing.assert_array_equal(
            lla_clf.predict_set(X, method=method, randomized=rand),
            back.predict_set(X, method=method, randomized=rand))


def test_automatic_calibration_sources(reg_data, reg_net):
    from skorch.dataset import ValidSplit

    X, y = reg_data.X, reg_data.y
    Xv, yv = _reg_draw(25, np.random.RandomState(6))
    est = LLARegressor(reg_net, device="cpu").fit(X, y, validation_data=(Xv, yv))
    assert est.conformal_source_ == "validation_data" and est.conformal_n_ == 25
    auto = est.conformal_scores_.copy()
    est.conformalize(Xv, yv)  # the same rows by hand: the same scores
    np.testing.assert_allclose(est.conformal_scores_, auto, rtol=1e-12)
    # net trained in fit: its held-out rows
    own = LLARegressor(device="cpu", random_state=0).fit(X, y)
    assert own.conformal_source_ == "rows held out from training the network"
    assert own.conformal_n_ == round(0.1 * len(X))
    # a skorch net with its own validation split
    net = make_skorch_regressor(3, 1, (16,), max_epochs=30, train_split=ValidSplit(5))
    _train(net, X, y.reshape(-1, 1), seed=0)
    est = LLARegressor(net, device="cpu").fit(X, y)
    assert est.validation_source_ == "the skorch net's own validation split"
    assert est.conformal_source_ == est.validation_source_
    assert est.conformal_n_ == len(X) // 5


def test_refit_resets_and_failed_refit_keeps_the_calibration(reg_data, reg_net):
    X, y = reg_data.X, reg_data.y
    Xv, yv = _reg_draw(25, np.random.RandomState(7))
    est = LLARegressor(reg_net, device="cpu").fit(X, y, validation_data=(Xv, yv))
    scores = est.conformal_scores_
    X_bad = X.copy()
    X_bad[0, 0] = np.nan
    with pytest.raises(ValueError):
        est.fit(X_bad, y)
    assert est.conformal_scores_ is scores  # atomic: the old state, calibration included
    est.fit(X, y)  # no held-out rows: the old calibration is gone
    assert not hasattr(est, "conformal_scores_") and not hasattr(est, "conformal_source_")
    with pytest.raises(NotFittedError, match="not conformalized"):
        est.predict_interval(X)


def test_classifier_automatic_calibration(blob_net):
    net, X, y = blob_net
    Xv, yv = _clf_draw(40, np.random.RandomState(8))
    clf = LLAClassifier(net, device="cpu").fit(X, y, validation_data=(Xv, yv))
    assert clf.conformal_source_ == "validation_data" and clf.conformal_n_ == 40
    auto = {k: v.copy() for k, v in clf.conformal_scores_.items()}
    clf.conformalize(Xv, yv)
    for key in auto:
        np.testing.assert_allclose(clf.conformal_scores_[key], auto[key], rtol=1e-12)


def test_float32_net_gives_the_float64_intervals(reg_data, reg_net):
    import copy

    Xc, yc = _reg_draw(40, np.random.RandomState(10))
    out = []
    for dtype, np_dtype in ((torch.float64, np.float64), (torch.float32, np.float32)):
        module = copy.deepcopy(reg_net.module_).to(dtype)
        est = LLARegressor(module, device="cpu", prior_variance=0.5, noise_variance=0.05)
        est.fit(reg_data.X.astype(np_dtype), reg_data.y).conformalize(Xc.astype(np_dtype), yc)
        out.append(est.predict_interval(reg_data.X_test.astype(np_dtype), 0.9))
    for a, b in zip(*out):
        np.testing.assert_allclose(b, a, rtol=1e-3, atol=1e-6)


def test_ella_regressor_has_intervals(reg_data, reg_net):
    Xv, yv = _reg_draw(30, np.random.RandomState(9))
    est = ELLARegressor(reg_net, device="cpu", n_nystrom=60, random_state=0).fit(
        reg_data.X, reg_data.y, validation_data=(Xv, yv))
    lo, hi = est.predict_interval(reg_data.X_test)
    mean = est.predict(reg_data.X_test)
    assert np.all(lo < mean) and np.all(mean < hi)


def test_subspace_laplace_follows_its_likelihood(reg_data, reg_net, blob_net):
    """The paper-interface ``SubspaceLaplace`` has the task-specific conformal methods
    of the estimator its ``likelihood`` names, with the same results."""
    Xv, yv = _reg_draw(40, np.random.RandomState(9))
    kw = dict(device="cpu", random_state=0)
    one = SubspaceLaplace(reg_net, likelihood="regression", **kw).fit(
        reg_data.X, reg_data.y, validation_data=(Xv, yv))
    ref = SubspaceLaplaceRegressor(reg_net, **kw).fit(reg_data.X, reg_data.y,
                                                     validation_data=(Xv, yv))
    assert one.conformal_source_ == "validation_data" and not hasattr(one, "predict_set")
    for a, b in zip(one.predict_interval(reg_data.X_test, 0.8),
                    ref.predict_interval(reg_data.X_test, 0.8)):
        np.testing.assert_allclose(a, b, rtol=1e-10)
    net = blob_net[0]
    Xc, yc = _clf_draw(200, np.random.RandomState(3))
    one = SubspaceLaplace(net, **kw).fit(Xc[:100], yc[:100]).conformalize(
        Xc[100:160], yc[100:160])
    ref = SubspaceLaplaceClassifier(net, **kw).fit(Xc[:100], yc[:100]).conformalize(
        Xc[100:160], yc[100:160])
    assert one.conformal_n_ == 60 and not hasattr(one, "predict_interval")
    np.testing.assert_array_equal(one.predict_set(Xc[160:], method="aps"),
                                  ref.predict_set(Xc[160:], method="aps"))


# ---------------------------------------------------------------------------------
# Classification: sets, coverage
# ---------------------------------------------------------------------------------


def _brute_force_sets(proba, q, method, u=None):
    """The set definitions, written out one row and one class at a time."""
    n, K = proba.shape
    sets = np.zeros((n, K), dtype=bool)
    for i in range(n):
        order = sorted(range(K), key=lambda j: (-proba[i, j], j))
        above = 0.0
        for j in order:
            if method == "lac":
                score = 1.0 - proba[i, j]
            elif u is None:
                score = above + proba[i, j]
            else:
                score = above + u[i] * proba[i, j]
            sets[i, j] = score <= q
            above += proba[i, j]
    return sets


def test_prediction_sets_match_their_definitions():
    rng = np.random.RandomState(0)
    proba = rng.dirichlet(np.ones(5) * 0.7, size=300)
    u = rng.rand(300)
    for q in (0.05, 0.3, 0.6, 0.9, 0.99):
        for method, rand in (("lac", False), ("aps", False), ("aps", True)):
            expected = _brute_force_sets(proba, q, method, u if rand else None)
            got = prediction_sets(proba, q, method, rand, u, allow_empty=True)
            np.testing.assert_array_equal(got, expected)
            filled = prediction_sets(proba, q, method, rand, u, allow_empty=False)
            empty = ~expected.any(axis=1)
            np.testing.assert_array_equal(filled[~empty], expected[~empty])
            assert np.all(filled[empty].sum(axis=1) == 1)
            assert np.all(filled[empty, proba[empty].argmax(axis=1)])


@pytest.mark.parametrize("method, randomized", [("lac", False), ("aps", False), ("aps", True)])
def test_set_coverage_follows_the_exact_law(lla_clf, method, randomized):
    n, m, S, c = 49, 100, 300, 0.9
    k = conformal_rank(n, c)
    key = "aps_randomized" if randomized else method
    cover, sizes, lower_rank = [], [], []
    for s in range(S):
        rng = np.random.RandomState(30_000 + s)
        Xc, yc = _clf_draw(n, rng)
        Xt, yt = _clf_draw(m, rng)
        lla_clf.conformalize(Xc, yc)
        sets = lla_clf.predict_set(Xt, c, method=method, randomized=randomized,
                                   allow_empty=True, random_state=s)
        cover.append(set_coverage(yt, sets, labels=lla_clf.classes_))
        sizes.append(sets.sum(axis=1).mean())
        # power: the same sets built from the score one rank lower (0.02 less coverage,
        # about 7 standard errors with S = 300)
        u = _uniforms(Xt, s) if randomized else None
        low = prediction_sets(lla_clf.predict_proba(Xt), lla_clf.conformal_scores_[key][k - 2],
                              method, randomized, u, allow_empty=True)
        np.testing.assert_array_equal(
            sets, prediction_sets(lla_clf.predict_proba(Xt), lla_clf.conformal_scores_[key][k - 1],
                                  method, randomized, u, allow_empty=True))
        lower_rank.append(set_coverage(yt, low))
    _betabinom_mean_check(cover, n, k, m, f"{method} sets")
    with pytest.raises(AssertionError):
        _betabinom_mean_check(lower_rank, n, k, m, "rank k - 1")
    assert 1.0 < np.mean(sizes) < 3.0  # informative: the classes overlap, not fully


def test_automatic_set_calibration_reusing_the_temperature_rows_keeps_coverage(blob_net):
    """fit(validation_data=...) calibrates a temperature AND the conformal scores on
    the same rows; the coverage must still follow the split-conformal law."""
    net, X, y = blob_net
    n, m, S, c = 49, 100, 100, 0.9
    k = conformal_rank(n, c)
    cover = []
    for s in range(S):
        rng = np.random.RandomState(40_000 + s)
        Xc, yc = _clf_draw(n, rng)
        Xt, yt = _clf_draw(m, rng)
        clf = LLAClassifier(net, device="cpu").fit(X, y, validation_data=(Xc, yc))
        assert clf.conformal_source_ == "validation_data"
        cover.append(set_coverage(yt, clf.predict_set(Xt, c, method="aps", randomized=True,
                                                      allow_empty=True, random_state=s)))
    _betabinom_mean_check(cover, n, k, m, "automatic set calibration")


def test_sets_follow_classes_order_with_string_labels(blob_net):
    net, X, y = blob_net
    names = np.array(["cat", "dog", "emu"])
    clf = LLAClassifier(net, device="cpu", classes=names).fit(X, names[y])
    Xc, yc = _clf_draw(60, np.random.RandomState(11))
    clf.conformalize(Xc, names[yc])
    proba = clf.predict_proba(X[:20])
    q = conformal_quantile(clf.conformal_scores_["lac"], 0.8)
    sets = clf.predict_set(X[:20], 0.8, allow_empty=True)
    np.testing.assert_array_equal(sets, proba >= 1.0 - q)
    assert set_coverage(names[y[:20]], sets, labels=clf.classes_) == pytest.approx(
        np.mean(sets[np.arange(20), y[:20]]))


def test_randomized_draws_are_per_point(lla_clf, blob_net):
    _, X, y = blob_net
    lla_clf.conformalize(X[:100], y[:100])
    full = lla_clf.predict_set(X, method="aps", randomized=True, allow_empty=True)
    part = lla_clf.predict_set(X[[7, 3, 50]], method="aps", randomized=True, allow_empty=True)
    np.testing.assert_array_equal(full[[7, 3, 50]], part)
    other = lla_clf.predict_set(X, method="aps", randomized=True, allow_empty=True,
                                random_state=1)
    assert not np.array_equal(full, other)


# ---------------------------------------------------------------------------------
# Dask inputs
# ---------------------------------------------------------------------------------


def test_dask_inputs(lla_reg, lla_clf, blob_net):
    da = pytest.importorskip("dask.array")
    Xc, yc = _reg_draw(30, np.random.RandomState(12))
    lla_reg.conformalize(da.from_array(Xc, chunks=10), yc)
    ref = lla_reg.predict_interval(Xc, 0.9)
    Xd = da.from_array(Xc, chunks=7)
    lazy = lla_reg.predict_interval(Xd, 0.9)
    for a, b in zip(ref, lazy):
        assert hasattr(b, "compute")
        np.testing.assert_allclose(b.compute(), a, rtol=1e-12)
    _, X, y = blob_net
    lla_clf.conformalize(X[:60], y[:60])
    sets = lla_clf.predict_set(da.from_array(X, chunks=50), method="aps")
    np.testing.assert_array_equal(sets.compute(), lla_clf.predict_set(X, method="aps"))


# ---------------------------------------------------------------------------------
# MAPIE interop
# ---------------------------------------------------------------------------------


def test_mapie_split_conformal_takes_our_regressor(lla_reg):
    mapie = pytest.importorskip("mapie.regression")
    rng = np.random.RandomState(13)
    Xc, yc = _reg_draw(60, rng)
    Xt, _ = _reg_draw(20, rng)
    # float32 targets, as a skorch user has them
    scr = mapie.SplitConformalRegressor(lla_reg, confidence_level=0.9, prefit=True)
    scr.conformalize(Xc, yc.astype(np.float32))
    points, intervals = scr.predict_interval(Xt)
    np.testing.assert_allclose(points, lla_reg.predict(Xt), rtol=1e-12)
    assert intervals.shape == (20, 2, 1)
    # MAPIE's absolute-residual interval: a constant width, the k-th absolute residual
    k = math.ceil(61 * 0.9)
    q = np.sort(np.abs(yc.astype(np.float32) - lla_reg.predict(Xc)))[k - 1]
    np.testing.assert_allclose(intervals[:, 1, 0] - intervals[:, 0, 0], 2 * q, rtol=1e-5)


def _docs_recipe():
    """The MAPIE normalised-score recipe, as printed in docs/conformal.md."""
    text = (ROOT / "docs" / "conformal.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    recipe = [b for b in blocks if "ResidualNormalisedScore" in b]
    assert len(recipe) == 1, "docs/conformal.md should show one MAPIE recipe block"
    return recipe[0]


def test_mapie_normalised_score_recipe_equals_ours(lla_reg):
    pytest.importorskip("mapie")
    rng = np.random.RandomState(14)
    X_cal, y_cal = _reg_draw(60, rng)
    X_test, _ = _reg_draw(20, rng)
    scope = {"reg": lla_reg, "X_cal": X_cal, "y_cal": y_cal, "X_test": X_test}
    exec(compile(_docs_recipe(), "docs/conformal.md", "exec"), scope)  # noqa: S102
    intervals = scope["intervals"]
    lla_reg.conformalize(X_cal, y_cal)
    lo, hi = lla_reg.predict_interval(X_test, 0.9)
    np.testing.assert_allclose(intervals[:, 0, 0], lo, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(intervals[:, 1, 0], hi, rtol=1e-10, atol=1e-12)


def test_torch_global_rng_untouched(lla_clf, blob_net):
    _, X, y = blob_net
    state = torch.random.get_rng_state()
    lla_clf.conformalize(X[:50], y[:50])
    lla_clf.predict_set(X, method="aps", randomized=True)
    assert torch.equal(state, torch.random.get_rng_state())


# ---------------------------------------------------------------------------------
# One pass over the held-out rows (issue 36 part 7)
# ---------------------------------------------------------------------------------


def _count_predictions(monkeypatch, cls):
    """Record the number of rows of every ``predict`` / ``predict_proba`` call of ``cls``."""
    calls = []
    for name in ("predict", "predict_proba"):
        orig = getattr(cls, name, None)
        if orig is None:
            continue

        def wrapped(self, X, *a, _orig=orig, **k):
            calls.append(len(X))
            return _orig(self, X, *a, **k)

        monkeypatch.setattr(cls, name, wrapped)
    return calls


@pytest.mark.parametrize("make", [
    lambda net: LLARegressor(net, device="cpu"),
    lambda net: LLARegressor(net, subset_of_weights="last_layer", device="cpu"),
    lambda net: ELLARegressor(net, n_nystrom=40, device="cpu", random_state=0),
    lambda net: SubspaceLaplace(net, likelihood="regression", subspace_dim=10, n_subset=50,
                                device="cpu"),
], ids=["exact", "last_layer", "ella", "subspace_one_class"])
def test_held_out_scores_reuse_the_calibration_pass_regression(make, reg_data, reg_net,
                                                               monkeypatch):
    """fit(validation_data=...) reads the held-out rows once: the conformal scores come
    from the latent predictive the (scale) calibration formed on them, rescaled, and
    equal those of a fresh predict pass of the calibrated estimator (conformalize)."""
    Xc, yc = _reg_draw(70, np.random.RandomState(12))
    est = make(reg_net)
    calls = _count_predictions(monkeypatch, type(est))
    est.fit(reg_data.X, reg_data.y, validation_data=(Xc, yc))
    assert calls == [] and est.conformal_n_ == 70  # no second pass over the rows
    assert abs(est.hyper_trace_["calibration"]["scale"] - 1.0) > 1e-3  # it did rescale
    auto = est.conformal_scores_.copy()
    est.conformalize(Xc, yc)
    np.testing.assert_allclose(auto, est.conformal_scores_, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("link", ["probit", "mc"])
@pytest.mark.parametrize("subset", [False, True])
def test_held_out_scores_reuse_the_calibration_pass_classification(link, subset, blob_net,
                                                                   monkeypatch):
    """The temperature's latent predictive gives the conformal scores (the Monte Carlo
    link with each row's own draws); rows beyond the calibration's subset
    (``CALIBRATION_ROWS``) are predicted once, after it. Either way the scores equal
    those of a fresh predict_proba pass."""
    import sklearn_lla._core.calibration as cal

    net, X, y = blob_net
    Xc, yc = _clf_draw(80, np.random.RandomState(13))
    if subset:
        monkeypatch.setattr(cal, "CALIBRATION_ROWS", 30)
    clf = LLAClassifier(net, device="cpu", link_approx=link, n_samples_predict=50)
    calls = _count_predictions(monkeypatch, LLAClassifier)
    clf.fit(X, y, validation_data=(Xc, yc))
    assert clf.hyper_trace_["calibration"]["n_rows"] == (30 if subset else 80)
    assert calls == ([50] if subset else [])  # only the rows the calibration did not read
    auto = {k: v.copy() for k, v in clf.conformal_scores_.items()}
    clf.conformalize(Xc, yc)
    for k, v in clf.conformal_scores_.items():
        np.testing.assert_allclose(auto[k], v, rtol=1e-10, atol=1e-12)
