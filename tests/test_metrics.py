"""Tests for sklearn_lla.metrics: metric values, input checks and scorers."""

import math
import pickle

import numpy as np
import pytest
from scipy import integrate, stats
from sklearn.base import BaseEstimator, ClassifierMixin, RegressorMixin
from sklearn.linear_model import BayesianRidge, LinearRegression
from sklearn.metrics import brier_score_loss, log_loss, make_scorer
from sklearn.metrics import get_scorer as sk_get_scorer
from sklearn.model_selection import GridSearchCV, cross_validate
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler
from sklearn.svm import SVC

from sklearn_lla import metrics
from sklearn_lla.metrics import (
    brier_score,
    calibration_curve_regression,
    centered_quantile_metric,
    cqm,
    crps_gaussian,
    ece,
    expected_calibration_error,
    gaussian_nll,
    get_scorer,
    get_scorer_names,
    interval_coverage,
    interval_coverage_scorer,
    interval_score,
    mean_interval_width,
    mean_set_size,
    neg_brier_scorer,
    neg_cqm_scorer,
    neg_crps_scorer,
    neg_ece_scorer,
    neg_interval_score_scorer,
    neg_log_loss_scorer,
    neg_mean_interval_width_scorer,
    neg_mean_set_size_scorer,
    neg_nll_scorer,
    ood_auc,
    predictive_entropy,
    reliability_curve,
    set_coverage,
    set_coverage_scorer,
    winkler_score,
)

# Two-sided standard-normal quantiles Phi^{-1}((1 + a) / 2) for a = 0.1, ..., 0.9:
# 0.1257 0.2533 0.3853 0.5244 0.6745 0.8416 1.0364 1.2816 1.6449


# ---------------------------------------------------------------------------
# Gaussian NLL
# ---------------------------------------------------------------------------


def test_gaussian_nll_hand_value():
    # y=1, mean=0, std=2: 0.5 log(2 pi) + log 2 + 0.5 * (1/2)^2
    expected = 0.5 * math.log(2 * math.pi) + math.log(2.0) + 0.125
    assert gaussian_nll([1.0], [0.0], [2.0]) == pytest.approx(expected, rel=1e-12)
    # Mean over points: second point at its mean with std 1 -> 0.5 log(2 pi)
    both = gaussian_nll([1.0, 3.0], [0.0, 3.0], [2.0, 1.0])
    assert both == pytest.approx(0.5 * (expected + 0.5 * math.log(2 * math.pi)), rel=1e-12)


@pytest.mark.parametrize("shape", [(7,), (7, 3)])
def test_gaussian_nll_matches_scipy(shape):
    rng = np.random.default_rng(0)
    y = rng.normal(size=shape) * 5 + 100  # original (unstandardised) scale
    mean = y + rng.normal(size=shape)
    std = rng.uniform(0.1, 3.0, size=shape)
    expected = -np.mean(stats.norm.logpdf(y, loc=mean, scale=std))
    assert gaussian_nll(y, mean, std) == pytest.approx(expected, rel=1e-12)


def test_regression_accepts_column_vectors_and_scalar_std():
    y = np.array([0.0, 1.0, 2.0])
    mean = np.array([0.5, 1.0, 1.0])
    ref = gaussian_nll(y, mean, np.full(3, 0.7))
    assert gaussian_nll(y[:, None], mean, 0.7) == pytest.approx(ref)
    assert gaussian_nll(y, mean[:, None], np.full((3, 1), 0.7)) == pytest.approx(ref)


# ---------------------------------------------------------------------------
# CRPS
# ---------------------------------------------------------------------------


def test_crps_hand_value():
    # z = 0: std * (2 phi(0) - 1/sqrt(pi)) = std * (sqrt(2) - 1) / sqrt(pi)
    unit = (math.sqrt(2) - 1) / math.sqrt(math.pi)
    assert crps_gaussian([0.0], [0.0], [1.0]) == pytest.approx(unit, rel=1e-12)
    assert crps_gaussian([5.0], [5.0], [3.0]) == pytest.approx(3 * unit, rel=1e-12)


def _crps_by_quadrature(y, mu, sigma):
    # CRPS = int (F(x) - 1{x >= y})^2 dx, split at y
    F = stats.norm(mu, sigma).cdf
    left, _ = integrate.quad(lambda x: F(x) ** 2, -np.inf, y)
    right, _ = integrate.quad(lambda x: (1 - F(x)) ** 2, y, np.inf)
    return left + right


def test_crps_matches_numerical_integration():
    y = np.array([0.3, -2.0, 10.0, 1.0])
    mean = np.array([0.0, 0.5, 9.0, 1.0])
    std = np.array([1.0, 0.7, 2.5, 0.2])
    per_point = [_crps_by_quadrature(*args) for args in zip(y, mean, std)]
    for i in range(len(y)):
        assert crps_gaussian(y[i : i + 1], mean[i : i + 1], std[i : i + 1]) == pytest.approx(
            per_point[i], rel=1e-6
        )
    assert crps_gaussian(y, mean, std) == pytest.approx(np.mean(per_point), rel=1e-6)


# ---------------------------------------------------------------------------
# CQM and calibration curve
# ---------------------------------------------------------------------------


def test_cqm_hand_example():
    # |z| = 0.2, 0.6, 1.0, 2.0 (n = 4). Against the quantiles listed at the top:
    #   a     : 0.1  0.2  0.3  0.4  0.5  0.6  0.7  0.8  0.9
    #   gamma : 0    .25  .25  .25  .5   .5   .75  .75  .75
    #   |dev| : .1   .05  .05  .15  0    .1   .05  .05  .15   -> sum 0.7
    # Trapezoid on 0, 0.1, ..., 1 with dev(0) = dev(1) = 0: 0.1 * 0.7 = 0.07
    z = np.array([0.2, -0.6, 1.0, -2.0])
    mean = np.array([10.0, -3.0, 0.0, 7.0])
    std = np.array([2.0, 0.5, 1.0, 4.0])
    y = mean + z * std
    alphas, gamma = calibration_curve_regression(y, mean, std)
    np.testing.assert_allclose(alphas, np.linspace(0, 1, 11))
    np.testing.assert_allclose(
        gamma, [0, 0, 0.25, 0.25, 0.25, 0.5, 0.5, 0.75, 0.75, 0.75, 1.0]
    )
    assert centered_quantile_metric(y, mean, std) == pytest.approx(0.07, abs=1e-12)
    assert cqm is centered_quantile_metric


def test_cqm_trapezoid_weights():
    # Trapezoid weights on the 11-point grid are 0.05 at both ends and 0.1 inside.
    rng = np.random.default_rng(1)
    y, mean, std = rng.normal(size=9), rng.normal(size=9), rng.uniform(0.5, 2, size=9)
    alphas, gamma = calibration_curve_regression(y, mean, std)
    weights = np.r_[0.05, np.full(9, 0.1), 0.05]
    assert cqm(y, mean, std) == pytest.approx(np.sum(weights * np.abs(gamma - alphas)))
    # Extreme cases: nothing inside any interval (gamma = 0) or everything
    # inside (gamma = 1) both give 0.1 * (0.1 + ... + 0.9) = 0.45
    assert cqm([100.0, -100.0], [0.0, 0.0], [1.0, 1.0]) == pytest.approx(0.45)
    assert cqm([0.0, 0.0], [0.0, 0.0], [1.0, 1.0]) == pytest.approx(0.45)
    # Half at the mean, half far away: gamma = 0.5 inside -> 0.1 * 2.0 = 0.2
    assert cqm([0.0, 3.0], [0.0, 0.0], [1.0, 1.0]) == pytest.approx(0.2)


def test_cqm_calibrated_and_overconfident():
    rng = np.random.default_rng(0)
    n = 20000
    mean = rng.normal(size=n) * 10
    std = rng.uniform(0.5, 5.0, size=n)
    y = mean + std * rng.normal(size=n)
    assert cqm(y, mean, std) < 0.02
    assert cqm(y, mean, std / 10) > 0.35
    assert cqm(y, mean, std * 10) > 0.35  # grossly underconfident as well
    # multi-output: every entry counts as one target
    assert cqm(y.reshape(-1, 4), mean.reshape(-1, 4), std.reshape(-1, 4)) == pytest.approx(
        cqm(y, mean, std)
    )


def test_calibration_curve_custom_alphas():
    y, mean, std = [0.0, 3.0], [0.0, 0.0], [1.0, 1.0]
    alphas, gamma = calibration_curve_regression(y, mean, std, alphas=[0.0, 0.5, 1.0])
    np.testing.assert_allclose(alphas, [0.0, 0.5, 1.0])
    np.testing.assert_allclose(gamma, [0.0, 0.5, 1.0])
    with pytest.raises(ValueError, match=r"alphas must lie in \[0, 1\]"):
        calibration_curve_regression(y, mean, std, alphas=[0.5, 1.5])


# ---------------------------------------------------------------------------
# ECE / reliability curve
# ---------------------------------------------------------------------------


def test_ece_hand_example_separate_bins():
    # 15 bins of width 1/15; confidences land in
    #   0.95 -> (14/15, 1]      correct
    #   0.90 -> (13/15, 14/15]  wrong
    #   0.70 -> (10/15, 11/15]  correct
    #   0.60 -> (8/15, 9/15]    correct (0.6 = 9/15 is an upper edge)
    # ECE = (0.05 + 0.9 + 0.3 + 0.4) / 4 = 0.4125
    y = [0, 1, 1, 0]
    proba = [[0.95, 0.05], [0.9, 0.1], [0.3, 0.7], [0.6, 0.4]]
    assert expected_calibration_error(y, proba) == pytest.approx(0.4125)
    conf, acc, counts = reliability_curve(y, proba)
    assert counts.tolist() == [0] * 8 + [1, 0, 1, 0, 0, 1, 1]
    np.testing.assert_allclose(conf[counts > 0], [0.6, 0.7, 0.9, 0.95])
    np.testing.assert_allclose(acc[counts > 0], [1.0, 1.0, 0.0, 1.0])
    assert np.all(np.isnan(conf[counts == 0])) and np.all(np.isnan(acc[counts == 0]))
    assert ece is expected_calibration_error


def test_ece_hand_example_shared_bins():
    # Two points per bin: conf 0.95 (one right, one wrong) and conf 0.7 (one
    # right, one wrong): 0.5 * |0.5 - 0.95| + 0.5 * |0.5 - 0.7| = 0.325
    # (averaging per bin, not per sample: per sample it would be 0.5)
    y = [0, 0, 0, 0]
    proba = [[0.95, 0.05], [0.05, 0.95], [0.7, 0.3], [0.3, 0.7]]
    assert ece(y, proba) == pytest.approx(0.325)
    # A single bin covering [0, 1]: |acc - mean conf| = |0.5 - 0.825|
    assert ece(y, proba, n_bins=1) == pytest.approx(0.325)
    # Perfectly calibrated in both bins -> 0
    assert ece([0, 1], [[0.5, 0.5], [0.5, 0.5]]) == pytest.approx(0.0)


def test_ece_bin_edges_are_right_closed():
    # Confidence exactly 0.2 = 3/15 belongs to (2/15, 3/15], i.e. bin index 2.
    _, _, counts = reliability_curve([0], [[0.2] * 5])
    assert counts.tolist() == [0, 0, 1] + [0] * 12
    # 1/15 (uniform over 15 classes) belongs to the first bin (0, 1/15]
    _, _, counts = reliability_curve([0], [np.full(15, 1 / 15)])
    assert counts[0] == 1
    # Confidence 1 goes in the last bin; 0.5 with 2 bins goes in (0, 0.5]
    _, _, counts = reliability_curve([0], [[1.0, 0.0]])
    assert counts[-1] == 1
    _, _, counts = reliability_curve([0, 1], [[0.5, 0.5], [0.25, 0.75]], n_bins=2)
    assert counts.tolist() == [1, 1]


def test_binary_1d_proba_equals_two_columns():
    y = np.array([0, 1, 0, 1, 1])
    p = np.array([0.1, 0.8, 0.6, 0.3, 0.95])
    p2 = np.column_stack([1 - p, p])
    assert ece(y, p) == pytest.approx(ece(y, p2))
    assert brier_score(y, p) == pytest.approx(brier_score(y, p2))
    # String labels: the sorted second label is the positive class
    ys = np.where(y == 1, "spam", "ham")
    assert ece(ys, p) == pytest.approx(ece(y, p2))
    assert brier_score(ys, p) == pytest.approx(brier_score(y, p2))
    # The multi-class Brier is twice sklearn's binary brier_score_loss
    assert brier_score(y, p) == pytest.approx(2 * brier_score_loss(y, p))


def test_labels_argument():
    proba = np.array([[0.7, 0.2, 0.1], [0.1, 0.1, 0.8], [0.3, 0.4, 0.3]])
    y_idx = np.array([0, 2, 0])
    # labels give the class of each column; order need not be sorted
    labels = np.array(["z", "a", "m"])
    y_lab = labels[y_idx]
    for f in (ece, brier_score):
        assert f(y_lab, proba, labels=labels) == pytest.approx(f(y_idx, proba))
    # Without labels, non-index labels are mapped through np.unique(y)
    assert brier_score(np.array([10, 30, 10, 20]), np.tile([0.5, 0.25, 0.25], (4, 1))) == (
        pytest.approx(brier_score([0, 2, 0, 1], np.tile([0.5, 0.25, 0.25], (4, 1))))
    )
    # Integer-valued floats are fine as indices
    assert brier_score(y_idx.astype(float), proba) == pytest.approx(brier_score(y_idx, proba))
    with pytest.raises(ValueError, match="not in labels"):
        ece(["q", "a", "z"], proba, labels=labels)
    with pytest.raises(ValueError, match="labels has 2 entries"):
        ece(y_idx, proba, labels=[0, 1])
    with pytest.raises(ValueError, match="pass labels="):
        ece(["a", "b", "a"], proba)  # 2 distinct labels, 3 columns


# ---------------------------------------------------------------------------
# Brier
# ---------------------------------------------------------------------------


def test_brier_hand_value():
    # row 1 (y=0): (0.5-1)^2 + 0.3^2 + 0.2^2 = 0.25 + 0.09 + 0.04 = 0.38
    # row 2 (y=2): 0.1^2 + 0.1^2 + (0.8-1)^2 = 0.01 + 0.01 + 0.04 = 0.06
    proba = [[0.5, 0.3, 0.2], [0.1, 0.1, 0.8]]
    assert brier_score([0, 2], proba) == pytest.approx(0.22)
    assert brier_score([0], [[1.0, 0.0]]) == 0.0
    assert brier_score([1], [[1.0, 0.0]]) == pytest.approx(2.0)


# ---------------------------------------------------------------------------
# Entropy / OOD AUC
# ---------------------------------------------------------------------------


def test_predictive_entropy():
    h = predictive_entropy([[1.0, 0.0, 0.0], [0.5, 0.5, 0.0], [1 / 3, 1 / 3, 1 / 3]])
    np.testing.assert_allclose(h, [0.0, math.log(2), math.log(3)])
    np.testing.assert_allclose(predictive_entropy([0.5, 1.0]), [math.log(2), 0.0])


def test_ood_auc():
    rng = np.random.default_rng(0)
    confident = rng.dirichlet([50.0, 1.0, 1.0], size=40)
    uncertain = rng.dirichlet([20.0, 20.0, 20.0], size=30)
    assert ood_auc(confident, uncertain) == 1.0
    assert ood_auc(uncertain, confident) == 0.0
    a = rng.dirichlet([1.0, 1.0, 1.0], size=2000)
    b = rng.dirichlet([1.0, 1.0, 1.0], size=2000)
    assert abs(ood_auc(a, b) - 0.5) < 0.05
    with pytest.raises(ValueError, match="same number of classes"):
        ood_auc(a, rng.dirichlet([1.0, 1.0], size=5))


# ---------------------------------------------------------------------------
# Input validation
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("metric", [gaussian_nll, crps_gaussian, cqm])
def test_regression_bad_input(metric):
    ok = np.array([0.0, 1.0, 2.0])
    with pytest.raises(ValueError, match="y contains non-finite"):
        metric([0.0, np.nan, 1.0], ok, ok + 1)
    with pytest.raises(ValueError, match="mean contains non-finite"):
        metric(ok, [0.0, np.inf, 1.0], ok + 1)
    with pytest.raises(ValueError, match="std contains non-finite"):
        metric(ok, ok, [1.0, np.nan, 1.0])
    with pytest.raises(ValueError, match="same shape"):
        metric(ok, ok[:2], ok + 1)
    with pytest.raises(ValueError, match="std must have the same shape"):
        metric(ok, ok, np.ones(4))
    with pytest.raises(ValueError, match="strictly positive"):
        metric(ok, ok, [1.0, 0.0, 1.0])
    with pytest.raises(ValueError, match="strictly positive"):
        metric(ok, ok, [1.0, -1.0, 1.0])
    with pytest.raises(ValueError, match="empty"):
        metric([], [], [])
    with pytest.raises(ValueError, match=r"shape \(n,\) or \(n, t\)"):
        metric(np.zeros((2, 2, 2)), np.zeros((2, 2, 2)), np.ones((2, 2, 2)))


@pytest.mark.parametrize("metric", [ece, brier_score])
def test_classification_bad_input(metric):
    with pytest.raises(ValueError, match=r"probabilities in \[0, 1\]"):
        metric([0, 1], [[1.2, -0.2], [0.5, 0.5]])
    with pytest.raises(ValueError, match=r"probabilities in \[0, 1\]"):
        metric([0, 1], [1.5, 0.5])
    with pytest.raises(ValueError, match="sum to 1"):
        metric([0, 1], [[0.5, 0.6], [0.5, 0.5]])
    with pytest.raises(ValueError, match="proba contains non-finite"):
        metric([0, 1], [[np.nan, 0.5], [0.5, 0.5]])
    with pytest.raises(ValueError, match="inconsistent numbers of samples"):
        metric([0, 1, 1], [[0.5, 0.5], [0.5, 0.5]])
    with pytest.raises(ValueError, match="empty"):
        metric([], np.zeros((0, 3)))
    with pytest.raises(ValueError, match="K >= 2"):
        metric([0, 0], [[1.0], [1.0]])
    # Rows summing to 1 within 1e-6 are accepted
    metric([0, 1], [[0.5 + 5e-7, 0.5], [0.5, 0.5]])


def test_n_bins_and_ood_validation():
    with pytest.raises(ValueError, match="n_bins must be a positive integer"):
        ece([0], [[1.0, 0.0]], n_bins=0)
    with pytest.raises(ValueError, match="n_bins must be a positive integer"):
        reliability_curve([0], [[1.0, 0.0]], n_bins=2.5)
    with pytest.raises(ValueError, match="proba_out contains non-finite"):
        ood_auc([[0.5, 0.5]], [[np.nan, 0.5]])
    with pytest.raises(ValueError, match="sum to 1"):
        predictive_entropy([[0.2, 0.2]])


# ---------------------------------------------------------------------------
# Scorers
# ---------------------------------------------------------------------------


class FakeRegressor:
    """Returns fixed (mean, std) whatever X is."""

    def __init__(self, mean, std):
        self.mean, self.std = np.asarray(mean), np.asarray(std)

    def predict(self, X, return_std=False):
        return (self.mean, self.std) if return_std else self.mean


class FakeClassifier:
    """Returns fixed probabilities whatever X is."""

    def __init__(self, proba, classes):
        self.proba, self.classes_ = np.asarray(proba), np.asarray(classes)

    def predict_proba(self, X):
        return self.proba


class MeanStdRegressor(RegressorMixin, BaseEstimator):
    """Predicts the training mean with the training std (times std_scale)."""

    def __init__(self, std_scale=1.0):
        self.std_scale = std_scale

    def fit(self, X, y):
        self.mean_, self.std_ = float(np.mean(y)), float(np.std(y))
        return self

    def predict(self, X, return_std=False):
        n = len(X)
        mean = np.full(n, self.mean_)
        return (mean, np.full(n, self.std_ * self.std_scale)) if return_std else mean


class FrequencyClassifier(ClassifierMixin, BaseEstimator):
    """Predicts the training class frequencies."""

    def fit(self, X, y):
        self.classes_, counts = np.unique(y, return_counts=True)
        self.prior_ = counts / counts.sum()
        return self

    def predict_proba(self, X):
        return np.tile(self.prior_, (len(X), 1))

    def predict(self, X):
        return self.classes_[np.argmax(self.predict_proba(X), axis=1)]


def _reg_data(n=60, seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, 2)), rng.normal(loc=3.0, scale=2.0, size=n)


def _clf_data():
    rng = np.random.default_rng(0)
    y = np.repeat(np.array(["cat", "dog", "emu"]), [12, 9, 9])
    return rng.normal(size=(len(y), 2)), y


def test_regression_scorers_sign():
    y = np.array([0.0, 1.0, 2.5, -1.0])
    est = FakeRegressor([0.2, 0.8, 2.0, 0.0], [1.0, 0.5, 2.0, 0.3])
    X = np.zeros((4, 1))
    for scorer, metric in [
        (neg_nll_scorer, gaussian_nll),
        (neg_crps_scorer, crps_gaussian),
        (neg_cqm_scorer, cqm),
    ]:
        assert scorer(est, X, y) == pytest.approx(-metric(y, est.mean, est.std))


def test_classification_scorers_sign_and_labels():
    classes = np.array(["b", "c", "a"])  # column order given by classes_
    proba = np.array([[0.7, 0.2, 0.1], [0.1, 0.1, 0.8], [0.3, 0.4, 0.3], [0.2, 0.6, 0.2]])
    y = np.array(["b", "a", "b", "c"])
    est = FakeClassifier(proba, classes)
    X = np.zeros((4, 1))
    assert neg_ece_scorer(est, X, y) == pytest.approx(-ece(y, proba, labels=classes))
    assert neg_brier_scorer(est, X, y) == pytest.approx(-brier_score(y, proba, labels=classes))
    # Same with indices 0..2 into the columns
    y_idx = np.array([0, 2, 0, 1])
    assert neg_brier_scorer(est, X, y) == pytest.approx(-brier_score(y_idx, proba))
    # sklearn's log_loss assumes sorted labels (as sklearn classifiers' classes_ are)
    est_sorted = FakeClassifier(proba, ["a", "b", "c"])
    assert neg_log_loss_scorer(est_sorted, X, y) == pytest.approx(
        -log_loss(y, proba, labels=["a", "b", "c"])
    )
    assert neg_brier_scorer(est_sorted, X, y) == pytest.approx(
        -brier_score(np.array([1, 0, 1, 2]), proba)
    )


class TemperedFrequencyClassifier(FrequencyClassifier):
    """Training class frequencies sharpened (temperature < 1) or flattened (> 1)."""

    def __init__(self, temperature=1.0):
        self.temperature = temperature

    def predict_proba(self, X):
        p = self.prior_ ** (1.0 / self.temperature)
        return np.tile(p / p.sum(), (len(X), 1))


REGRESSION_SCORERS = ("neg_cqm", "neg_nll", "neg_crps")
CLASSIFICATION_SCORERS = ("neg_ece", "neg_brier", "neg_log_loss")


def test_std_scorer_requires_tuple():
    class NoStd:
        def predict(self, X, return_std=False):
            return np.zeros(len(X))

    with pytest.raises(ValueError, match=r"'neg_nll' needs .*NoStd\.predict.*returned ndarray"):
        neg_nll_scorer(NoStd(), np.zeros((2, 1)), np.zeros(2))


@pytest.mark.parametrize("name", REGRESSION_SCORERS)
def test_regression_scorers_clear_errors(name):
    scorer = getattr(metrics, f"{name}_scorer")
    X, y = _reg_data()
    # predict without return_std: a TypeError naming the scorer and the estimator
    reg = LinearRegression().fit(X, y)
    with pytest.raises(TypeError, match=rf"'{name}' needs .*return_std=True.*LinearRegression"):
        scorer(reg, X, y)
    # no predict at all
    with pytest.raises(AttributeError, match=rf"'{name}' needs .*object has no predict"):
        scorer(object(), X, y)
    # the same error surfaces through cross_validate(error_score="raise")
    with pytest.raises(TypeError, match="does not accept return_std"):
        cross_validate(LinearRegression(), X, y, cv=2, scoring=scorer, error_score="raise")


@pytest.mark.parametrize("name", CLASSIFICATION_SCORERS)
def test_classification_scorers_clear_errors(name):
    scorer = getattr(metrics, f"{name}_scorer")
    X, y = _clf_data()
    # SVC(probability=False) hides predict_proba (available_if)
    svc = SVC().fit(X, y)
    with pytest.raises(AttributeError, match=rf"'{name}' needs .*predict_proba.*SVC has no"):
        scorer(svc, X, y)
    with pytest.raises(AttributeError, match="MeanStdRegressor has no predict_proba"):
        scorer(MeanStdRegressor().fit(X, np.zeros(len(X))), X, y)


def test_std_scorers_accept_pipelines_and_sklearn_regressors():
    # Pipeline.predict(X, **params) forwards return_std to its last step
    X, y = _reg_data(n=120)
    y = X @ np.array([1.0, -2.0]) + 0.3 * y
    for est in (BayesianRidge(), make_pipeline(StandardScaler(), BayesianRidge())):
        est.fit(X, y)
        mean, std = est.predict(X, return_std=True)
        assert neg_nll_scorer(est, X, y) == pytest.approx(-gaussian_nll(y, mean, std))


def test_scorers_in_cross_validate_regression():
    X, y = _reg_data()
    scoring = {
        "cqm": neg_cqm_scorer,
        "nll": neg_nll_scorer,
        "crps": get_scorer("neg_crps"),
        "r2": "r2",
    }
    res = cross_validate(MeanStdRegressor(), X, y, cv=3, scoring=scoring)
    for key in ("cqm", "nll", "crps"):
        scores = res[f"test_{key}"]
        assert scores.shape == (3,) and np.all(np.isfinite(scores)) and np.all(scores <= 0)
    assert np.all(np.isfinite(res["test_r2"]))


def test_scorers_in_grid_search():
    X, y = _reg_data(n=300)
    for scorer in (neg_nll_scorer, neg_cqm_scorer, neg_crps_scorer):
        gs = GridSearchCV(
            MeanStdRegressor(), {"std_scale": [0.1, 1.0, 10.0]}, scoring=scorer, cv=3
        ).fit(X, y)
        assert gs.best_params_ == {"std_scale": 1.0}, repr(scorer)


@pytest.mark.parametrize("name", REGRESSION_SCORERS)
def test_regression_scorer_by_name_in_grid_search(name):
    X, y = _reg_data(n=300)
    for scoring in (getattr(metrics, f"{name}_scorer"), get_scorer(name)):
        gs = GridSearchCV(
            MeanStdRegressor(), {"std_scale": [0.1, 1.0, 10.0]}, scoring=scoring, cv=3
        ).fit(X, y)
        assert gs.best_params_ == {"std_scale": 1.0}
        assert gs.best_score_ <= 0 and gs.score(X, y) <= 0


@pytest.mark.parametrize("name", CLASSIFICATION_SCORERS)
def test_classification_scorer_by_name_in_grid_search(name):
    # Stratified 3-fold CV of 12/9/9 labels: every training prior equals its test
    # fold's class frequencies, so temperature 1 is best for all three scores.
    X, y = _clf_data()
    for scoring in (getattr(metrics, f"{name}_scorer"), get_scorer(f"{name}_scorer")):
        gs = GridSearchCV(
            TemperedFrequencyClassifier(), {"temperature": [0.3, 1.0, 3.0]},
            scoring=scoring, cv=3,
        ).fit(X, y)
        assert gs.best_params_ == {"temperature": 1.0}
        assert np.all(np.isfinite(gs.cv_results_["mean_test_score"]))


def test_scorer_dicts_with_refit():
    X, y = _reg_data(n=300)
    scoring = {name: get_scorer(name) for name in REGRESSION_SCORERS}
    gs = GridSearchCV(
        MeanStdRegressor(), {"std_scale": [0.1, 1.0, 10.0]}, scoring=scoring,
        refit="neg_nll", cv=3,
    ).fit(X, y)
    assert gs.best_params_ == {"std_scale": 1.0}
    for name in REGRESSION_SCORERS:
        assert np.all(gs.cv_results_[f"mean_test_{name}"] <= 0)

    X, y = _clf_data()
    scoring = {name: getattr(metrics, f"{name}_scorer") for name in CLASSIFICATION_SCORERS}
    gs = GridSearchCV(
        TemperedFrequencyClassifier(), {"temperature": [0.3, 1.0, 3.0]}, scoring=scoring,
        refit="neg_brier", cv=3,
    ).fit(X, y)
    assert gs.best_params_ == {"temperature": 1.0}


@pytest.mark.parametrize("labels", [[0, 1], ["ham", "spam"]])
def test_ece_binary_1d_through_make_scorer(labels):
    # make_scorer(response_method="predict_proba") hands binary metrics the
    # positive-class column, shape (n,); the ECE must take it and agree with ours.
    rng = np.random.default_rng(0)
    y = np.asarray(labels)[(rng.uniform(size=40) < 0.3).astype(int)]
    X = rng.normal(size=(40, 2))
    est = TemperedFrequencyClassifier(temperature=2.0).fit(X, y)
    ece_1d = make_scorer(
        expected_calibration_error, response_method="predict_proba", greater_is_better=False
    )
    assert ece_1d(est, X, y) == pytest.approx(neg_ece_scorer(est, X, y))
    res = cross_validate(est, X, y, cv=2, scoring={"sk": ece_1d, "ours": neg_ece_scorer})
    np.testing.assert_allclose(res["test_sk"], res["test_ours"])


def test_scorers_in_cross_validate_classification():
    X, y = _clf_data()
    scoring = {
        "ece": neg_ece_scorer,
        "brier": neg_brier_scorer,
        "log_loss": get_scorer("neg_log_loss_scorer"),
        "acc": "accuracy",
    }
    res = cross_validate(FrequencyClassifier(), X, y, cv=3, scoring=scoring)
    for key in ("ece", "brier", "log_loss"):
        scores = res[f"test_{key}"]
        assert scores.shape == (3,) and np.all(np.isfinite(scores)) and np.all(scores <= 0)
    # Direct check against sklearn's log_loss on the full data
    est = FrequencyClassifier().fit(X, y)
    assert neg_log_loss_scorer(est, X, y) == pytest.approx(
        -log_loss(y, est.predict_proba(X), labels=est.classes_)
    )


@pytest.mark.parametrize(
    "scorer",
    [
        neg_cqm_scorer,
        neg_nll_scorer,
        neg_crps_scorer,
        neg_ece_scorer,
        neg_brier_scorer,
        neg_log_loss_scorer,
    ],
)
def test_scorers_pickle_and_repr(scorer):
    clone = pickle.loads(pickle.dumps(scorer))
    assert repr(clone) == repr(scorer)
    assert scorer._name in repr(scorer)
    if scorer in (neg_cqm_scorer, neg_nll_scorer, neg_crps_scorer):
        X, y = _reg_data()
        est = MeanStdRegressor().fit(X, y)
        assert "return_std=True" in repr(scorer)
    else:
        X, y = _clf_data()
        est = FrequencyClassifier().fit(X, y)
        assert "predict_proba" in repr(scorer)
    assert clone(est, X, y) == scorer(est, X, y)


def test_get_scorer():
    for name in ("neg_cqm", "neg_nll", "neg_crps", "neg_ece", "neg_brier", "neg_log_loss"):
        ours = getattr(metrics, f"{name}_scorer")
        for key in (name, f"{name}_scorer"):
            s = get_scorer(key)
            assert type(s) is type(ours) and repr(s) == repr(ours)
    for name in ("r2", "accuracy"):
        assert repr(get_scorer(name)) == repr(sk_get_scorer(name))
    X, y = _reg_data()
    est = MeanStdRegressor().fit(X, y)
    assert get_scorer("r2")(est, X, y) == pytest.approx(est.score(X, y))

    def my_scorer(estimator, X, y):
        return 0.0

    assert get_scorer(my_scorer) is my_scorer
    with pytest.raises(ValueError):
        get_scorer("not_a_scorer_name")


def test_all_exports_exist():
    for name in metrics.__all__:
        assert hasattr(metrics, name), name
    for name in REGRESSION_SCORERS + CLASSIFICATION_SCORERS + CONFORMAL_SCORERS:
        assert f"{name}_scorer" in metrics.__all__


# ---------------------------------------------------------------------------
# Interval and set metrics
# ---------------------------------------------------------------------------

CONFORMAL_SCORERS = ("interval_coverage", "neg_mean_interval_width", "neg_interval_score",
                     "set_coverage", "neg_mean_set_size")


def test_interval_metrics_hand_values():
    y = np.array([0.0, 1.0, 5.0, 2.0])
    lo = np.array([-1.0, 0.0, 0.0, 2.0])
    hi = np.array([1.0, 2.0, 3.0, 4.0])
    assert interval_coverage(y, lo, hi) == 0.75  # 5 is out; 2 on a bound is in
    assert mean_interval_width(lo, hi) == pytest.approx(2.25)
    # width 2.25 on average; the miss of 5 by 2 costs 2 / alpha * 2, averaged over 4
    for c in (0.5, 0.8, 0.9):
        expected = 2.25 + (2.0 / (1.0 - c)) * 2.0 / 4.0
        assert interval_score(y, lo, hi, confidence=c) == pytest.approx(expected, rel=1e-12)
    assert winkler_score is interval_score
    # a miss below the interval counts the same
    assert interval_score([-3.0], [-1.0], [1.0], 0.5) == pytest.approx(2.0 + 4.0 * 2.0)
    # multi-output and column shapes
    Y, L, H = np.stack([y, y], 1), np.stack([lo, lo - 10], 1), np.stack([hi, hi + 10], 1)
    assert interval_coverage(Y, L, H) == pytest.approx((3 + 4) / 8)
    assert interval_coverage(y[:, None], lo, hi[:, None]) == 0.75
    # infinite bounds: covered, infinitely wide
    assert interval_coverage([1e9], [-np.inf], [np.inf]) == 1.0
    assert mean_interval_width([-np.inf], [0.0]) == np.inf


def test_interval_score_is_proper_for_gaussian_quantiles():
    # E S(l, u; y) for y ~ N(0, 1) and [l, u] = [-a, a] has the closed form
    # 2a + (4 / alpha) (phi(a) - a (1 - Phi(a))), minimised at a = z_{1 - alpha / 2}.
    alpha = 0.1
    z = stats.norm.ppf(1 - alpha / 2)
    a = np.linspace(0.5, 3.5, 3001)
    expected = 2 * a + 4 / alpha * (stats.norm.pdf(a) - a * stats.norm.sf(a))
    assert a[np.argmin(expected)] == pytest.approx(z, abs=1e-3)
    y = np.random.default_rng(0).normal(size=400_000)
    for scale in (0.8, 1.0, 1.25):
        ai = scale * z
        e = 2 * ai + 4 / alpha * (stats.norm.pdf(ai) - ai * stats.norm.sf(ai))
        got = interval_score(y, np.full_like(y, -ai), np.full_like(y, ai), 1 - alpha)
        assert got == pytest.approx(e, rel=5e-3)


def test_interval_metric_errors():
    with pytest.raises(ValueError, match="lower must not exceed upper"):
        interval_coverage([0.0], [1.0], [0.0])
    with pytest.raises(ValueError, match="same shape"):
        mean_interval_width([0.0, 1.0], [1.0])
    with pytest.raises(ValueError, match="y and the bounds"):
        interval_coverage([0.0, 1.0, 2.0], [0.0, 0.0], [1.0, 1.0])
    with pytest.raises(ValueError, match="NaN"):
        mean_interval_width([np.nan], [1.0])
    with pytest.raises(ValueError, match="non-finite"):
        interval_coverage([np.inf], [0.0], [1.0])
    with pytest.raises(ValueError, match="empty"):
        interval_coverage([], [], [])
    for bad in (0.0, 1.0, 1.5):
        with pytest.raises(ValueError, match="confidence"):
            interval_score([0.0], [0.0], [1.0], confidence=bad)
    with pytest.raises(TypeError, match="confidence"):
        interval_score([0.0], [0.0], [1.0], confidence=True)


def test_set_metrics():
    sets = np.array([[True, True, False], [False, False, True], [True, False, False],
                     [False, False, False]])
    assert set_coverage([1, 0, 0, 2], sets) == 0.5
    assert mean_set_size(sets) == 1.0
    # labels give the class of each column
    names = np.array(["b", "c", "a"])
    assert set_coverage(["c", "b", "b", "a"], sets, labels=names) == 0.5
    assert set_coverage([1, 0, 0, 2], sets.astype(int)) == 0.5
    with pytest.raises(ValueError, match="boolean"):
        mean_set_size(np.array([[0.5, 1.0]]))
    with pytest.raises(ValueError, match="2-D"):
        mean_set_size(np.array([True, False]))
    with pytest.raises(ValueError, match="inconsistent numbers of samples"):
        set_coverage([0, 1], sets)
    with pytest.raises(ValueError, match="not in labels"):
        set_coverage(["x", "b", "b", "a"], sets, labels=names)


# ---------------------------------------------------------------------------
# Interval and set scorers
# ---------------------------------------------------------------------------


class FakeIntervalRegressor:
    """Returns mean -+ confidence (so the requested confidence shows in the width)."""

    def __init__(self, mean):
        self.mean = np.asarray(mean, dtype=float)

    def predict_interval(self, X, confidence=0.9):
        return self.mean - confidence, self.mean + confidence


class FakeSetClassifier:
    """Returns fixed sets for method 'lac' and all classes for 'aps'."""

    def __init__(self, sets, classes):
        self.sets, self.classes_ = np.asarray(sets), np.asarray(classes)
        self.calls = []

    def predict_set(self, X, confidence=0.9, method="lac"):
        self.calls.append((confidence, method))
        return self.sets if method == "lac" else np.ones_like(self.sets)


def test_interval_scorers_values():
    y = np.array([0.0, 1.0, 2.0, 0.5])
    est = FakeIntervalRegressor([0.0, 0.0, 0.0, 0.0])
    X = np.zeros((4, 1))
    lo, hi = est.predict_interval(X, 0.9)
    assert interval_coverage_scorer(est, X, y) == interval_coverage(y, lo, hi) == 0.5
    assert neg_mean_interval_width_scorer(est, X, y) == pytest.approx(-1.8)
    assert neg_interval_score_scorer(est, X, y) == pytest.approx(-interval_score(y, lo, hi, 0.9))
    # the confidence setting reaches predict_interval and the interval score
    s = get_scorer("neg_interval_score", confidence=0.5)
    lo5, hi5 = est.predict_interval(X, 0.5)
    assert s(est, X, y) == pytest.approx(-interval_score(y, lo5, hi5, 0.5))
    assert get_scorer("neg_mean_interval_width_scorer", confidence=0.5)(est, X, y) == -1.0
    assert neg_interval_score_scorer.confidence == 0.9  # the module's object is untouched


def test_set_scorers_values():
    sets = np.array([[True, False, False], [True, True, False], [False, False, True]])
    est = FakeSetClassifier(sets, ["b", "c", "a"])
    X, y = np.zeros((3, 1)), np.array(["b", "a", "a"])
    assert set_coverage_scorer(est, X, y) == pytest.approx(2 / 3)
    assert neg_mean_set_size_scorer(est, X, y) == pytest.approx(-4 / 3)
    assert est.calls == [(0.9, "lac"), (0.9, "lac")]
    assert get_scorer("neg_mean_set_size", method="aps", confidence=0.8)(est, X, y) == -3.0
    assert est.calls[-1] == (0.8, "aps")


def test_conformal_scorer_errors():
    X, y = np.zeros((2, 1)), np.zeros(2)
    with pytest.raises(AttributeError, match="'interval_coverage' needs .*predict_interval"):
        interval_coverage_scorer(BayesianRidge().fit(X + [[0], [1]], y), X, y)
    with pytest.raises(AttributeError, match="'set_coverage' needs .*predict_set"):
        set_coverage_scorer(FrequencyClassifier().fit(X, [0, 1]), X, [0, 1])

    class MapieLike:  # MAPIE's predict_interval(X) -> (points, (n, 2, k) intervals)
        def predict_interval(self, X):
            return np.zeros(len(X)), np.zeros((len(X), 2, 1))

    with pytest.raises(TypeError, match="does not accept confidence"):
        interval_coverage_scorer(MapieLike(), X, y)

    class WrongShape:
        def predict_interval(self, X, confidence=0.9):
            return np.zeros(len(X)), np.zeros((len(X), 2, 1))

    with pytest.raises(ValueError, match="returned something else"):
        neg_interval_score_scorer(WrongShape(), X, y)
    with pytest.raises(ValueError, match=r"takes no setting\(s\) \['method'\]"):
        get_scorer("interval_coverage", method="aps")
    with pytest.raises(ValueError, match="takes no setting"):
        get_scorer("neg_nll", confidence=0.9)
    with pytest.raises(ValueError, match="apply to sklearn_lla's interval and set scorers"):
        get_scorer("r2", confidence=0.9)
    with pytest.raises(ValueError, match="confidence"):
        get_scorer("set_coverage", confidence=1.5)
    with pytest.raises(ValueError, match="method"):
        get_scorer("set_coverage", method="raps")


@pytest.mark.parametrize("name", CONFORMAL_SCORERS)
def test_conformal_scorers_pickle_and_repr(name):
    scorer = getattr(metrics, f"{name}_scorer")
    back = pickle.loads(pickle.dumps(get_scorer(name, confidence=0.8)))
    assert repr(back) == repr(get_scorer(name, confidence=0.8)) != repr(scorer)
    assert "confidence=0.8" in repr(back) and name in repr(back)


def test_conformal_scorers_on_lla_estimators_in_cross_validate():
    from sklearn.datasets import make_blobs

    from sklearn_lla import LLAClassifier, LLARegressor

    rng = np.random.RandomState(0)
    X = rng.uniform(-2, 2, (200, 1))
    y = np.sin(2 * X[:, 0]) + 0.1 * rng.randn(200)
    res = cross_validate(LLARegressor(random_state=0, device="cpu"), X, y, cv=2,
                         error_score="raise",
                         scoring={n: get_scorer(n) for n in CONFORMAL_SCORERS[:3]})
    assert np.all((res["test_interval_coverage"] > 0.5) & (res["test_interval_coverage"] <= 1))
    assert np.all(res["test_neg_mean_interval_width"] < 0)
    Xc, yc = make_blobs(n_samples=300, centers=3, cluster_std=2.0, random_state=0)
    res = cross_validate(LLAClassifier(random_state=0, device="cpu", validation_fraction=0.2),
                         Xc, yc, cv=2, error_score="raise",
                         scoring={n: get_scorer(n) for n in CONFORMAL_SCORERS[3:]})
    assert np.all(res["test_set_coverage"] > 0.5)
    assert np.all((res["test_neg_mean_set_size"] <= -1) & (res["test_neg_mean_set_size"] > -3))


# ---------------------------------------------------------------------------
# Scorer names: the error lists ours, and the opt-in registration in scikit-learn
# ---------------------------------------------------------------------------


def test_unknown_name_lists_our_scorers():
    with pytest.raises(ValueError) as info:
        get_scorer("neg_nl")
    msg = str(info.value)
    for name in REGRESSION_SCORERS + CLASSIFICATION_SCORERS + CONFORMAL_SCORERS:
        assert name in msg
    assert "Did you mean 'neg_nll'" in msg
    assert "sklearn.metrics.get_scorer_names()" in msg
    names = get_scorer_names()
    assert names[:len(REGRESSION_SCORERS)] == list(REGRESSION_SCORERS)
    assert "r2" in names and len(names) == len(set(names))


def test_sklearn_rejects_third_party_names_and_dicts_name_them():
    """scikit-learn 1.9 validates ``scoring`` strings against a set of its own names
    frozen at import (GridSearchCV's and cross_validate's parameter constraints), so
    no third-party name can work there; a dict of scorer objects names them."""
    X, y = _reg_data(n=300)
    grid = {"std_scale": [0.1, 1.0, 10.0]}
    with pytest.raises(ValueError, match="'scoring' parameter of GridSearchCV must be"):
        GridSearchCV(MeanStdRegressor(), grid, scoring="neg_nll", cv=3).fit(X, y)
    scoring = get_scorer(["neg_nll", "neg_cqm", "r2"])
    assert list(scoring) == ["neg_nll", "neg_cqm", "r2"]
    assert repr(scoring["r2"]) == repr(sk_get_scorer("r2"))
    gs = GridSearchCV(MeanStdRegressor(), grid, scoring=scoring, refit="neg_nll", cv=3).fit(X, y)
    ref = GridSearchCV(MeanStdRegressor(), grid, scoring=neg_nll_scorer, cv=3).fit(X, y)
    assert gs.best_params_ == {"std_scale": 1.0}
    np.testing.assert_allclose(gs.cv_results_["mean_test_neg_nll"],
                               ref.cv_results_["mean_test_score"])
    res = cross_validate(MeanStdRegressor(), X, y, cv=2,
                         scoring=get_scorer(("neg_crps",)))
    assert np.all(res["test_neg_crps"] < 0)
    with pytest.raises(ValueError, match="unique"):
        get_scorer(["neg_nll", "neg_nll_scorer"])
    with pytest.raises(ValueError, match="empty"):
        get_scorer([])
    with pytest.raises(ValueError, match="'nope' is not a valid scoring value"):
        get_scorer(["neg_nll", "nope"])
