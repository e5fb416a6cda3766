"""Tests of sklearn_lla.plotting: arrays against sklearn_lla.metrics, artists, errors."""

import importlib
import pickle
import sys
import warnings

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from matplotlib.collections import PathCollection, PolyCollection  # noqa: E402
from matplotlib.container import BarContainer  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402

from sklearn_lla import LLAClassifier, LLARegressor  # noqa: E402
from sklearn_lla.metrics import (  # noqa: E402
    calibration_curve_regression,
    centered_quantile_metric,
    expected_calibration_error,
    reliability_curve,
)
from sklearn_lla.plotting import (  # noqa: E402
    CalibrationCurveDisplay,
    PredictionIntervalDisplay,
    PredictiveBandDisplay,
    ReliabilityDisplay,
)


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


def _tiny_net(n_in, n_out, seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(n_in, 8), torch.nn.Tanh(), torch.nn.Linear(8, n_out)
    ).double()


@pytest.fixture(scope="module")
def regression():
    rng = np.random.RandomState(0)
    X = rng.uniform(-2, 2, (30, 1))
    y = np.sin(2 * X[:, 0]) + 0.1 * rng.randn(30)
    reg = LLARegressor(_tiny_net(1, 1), prior_variance=1.0, noise_variance=0.05,
                       random_state=0).fit(X, y)
    return reg, X, y


@pytest.fixture(scope="module")
def classification():
    rng = np.random.RandomState(1)
    X = rng.randn(60, 2)
    y = np.array(["a", "b", "c"])[(X[:, 0] > 0).astype(int) + (X[:, 1] > 1).astype(int)]
    clf = LLAClassifier(_tiny_net(2, 3), prior_variance=1.0, classes=["a", "b", "c"],
                        random_state=0).fit(X, y)
    return clf, X, y


def _band_limits(band):
    """(x, lower, upper) of a fill_between PolyCollection."""
    verts = band.get_paths()[0].vertices
    return verts[:, 0], verts[:, 1]


# ---------------------------------------------------------------------------
# PredictiveBandDisplay
# ---------------------------------------------------------------------------


def test_band_from_predictions_sorts_and_draws_each_band():
    x = np.array([0.5, -1.0, 2.0, 0.0])
    mean = np.array([1.0, 2.0, 3.0, 4.0])
    std = np.array([0.1, 0.2, 0.3, 0.4])
    disp = PredictiveBandDisplay.from_predictions(x, mean, std, n_std=(2, 1),
                                                  X_train=[0.0, 1.0], y_train=[5.0, 6.0])
    order = np.argsort(x)
    np.testing.assert_array_equal(disp.x, x[order])
    np.testing.assert_array_equal(disp.mean, mean[order])
    np.testing.assert_array_equal(disp.std, std[order])
    assert disp.n_std == (1.0, 2.0)

    assert isinstance(disp.line_, Line2D)
    np.testing.assert_array_equal(disp.line_.get_ydata(), mean[order])
    assert len(disp.bands_) == 2 and all(isinstance(b, PolyCollection) for b in disp.bands_)
    for band, k in zip(disp.bands_, (2.0, 1.0)):  # widest first
        bx, by = _band_limits(band)
        for xi, mi, si in zip(x[order], mean[order], std[order]):
            at_xi = by[bx == xi]  # the polygon's vertices above xi: both band edges
            assert np.any(np.isclose(at_xi, mi - k * si)), (k, xi)
            assert np.any(np.isclose(at_xi, mi + k * si)), (k, xi)
        assert by.max() == pytest.approx(np.max(mean[order] + k * std[order]))
        assert by.min() == pytest.approx(np.min(mean[order] - k * std[order]))
    assert isinstance(disp.data_, PathCollection)
    np.testing.assert_array_equal(disp.data_.get_offsets(), [[0.0, 5.0], [1.0, 6.0]])
    assert disp.ax_.figure is disp.figure_
    labels = [t.get_text() for t in disp.ax_.get_legend().get_texts()]
    assert "+-2 std" in labels and "+-1 std" in labels and "training data" in labels


def test_band_from_estimator_matches_predict(regression):
    reg, X, y = regression
    disp = PredictiveBandDisplay.from_estimator(reg, X, y, n_points=50)
    lo, hi = X.min(), X.max()
    pad = 0.25 * (hi - lo)
    np.testing.assert_allclose(disp.x, np.linspace(lo - pad, hi + pad, 50))
    mean, std = reg.predict(disp.x[:, None], return_std=True)
    np.testing.assert_array_equal(disp.mean, np.ravel(mean))
    np.testing.assert_array_equal(disp.std, np.ravel(std))
    np.testing.assert_array_equal(disp.X_train, X[:, 0])
    np.testing.assert_array_equal(disp.y_train, y)
    assert disp.estimator_name == "LLARegressor"
    assert "LLARegressor mean" in [t.get_text() for t in disp.ax_.get_legend().get_texts()]

    # an explicit grid, no data, onto a given axes
    _, ax = plt.subplots()
    grid = np.linspace(3, -3, 7)
    disp = PredictiveBandDisplay.from_estimator(reg, X, grid=grid, ax=ax, n_std=1.5)
    assert disp.ax_ is ax and disp.data_ is None and len(disp.bands_) == 1
    np.testing.assert_array_equal(disp.x, np.sort(grid))


def test_band_from_estimator_dataframe_keeps_feature_names(regression):
    pd = pytest.importorskip("pandas")
    _, X, y = regression
    Xf = pd.DataFrame(X, columns=["t"])
    reg = LLARegressor(_tiny_net(1, 1), prior_variance=1.0, noise_variance=0.05).fit(Xf, y)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        disp = PredictiveBandDisplay.from_estimator(reg, Xf, y, n_points=5, plot=False)
    assert not [w for w in caught if "feature names" in str(w.message)]
    assert not hasattr(disp, "ax_")
    # the check above can fail: a plain array does warn
    with pytest.warns(UserWarning, match="feature names"):
        reg.predict(np.zeros((2, 1)))


def test_band_multi_output_target():
    x = np.linspace(0, 1, 4)
    mean = np.column_stack([x, 10 * x])
    std = np.ones_like(mean)
    disp = PredictiveBandDisplay.from_predictions(x, mean, std, target=1, plot=False)
    np.testing.assert_array_equal(disp.mean, 10 * x)
    with pytest.raises(ValueError, match="target=2"):
        PredictiveBandDisplay.from_predictions(x, mean, std, target=2, plot=False)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(x=np.zeros((3, 2)), mean=np.zeros(3), std=np.ones(3)), "one input feature"),
        (dict(x=np.zeros(3), mean=np.zeros(4), std=np.ones(4)), "same length"),
        (dict(x=np.zeros(3), mean=np.zeros(3), std=-np.ones(3)), "non-negative"),
        (dict(x=np.zeros(3), mean=np.zeros(3), std=np.ones(3), n_std=-1), "n_std"),
        (dict(x=np.zeros(3), mean=np.zeros(3), std=np.ones(3), X_train=[1.0]), "both"),
    ],
)
def test_band_bad_input(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PredictiveBandDisplay.from_predictions(**kwargs, plot=False)


def test_band_from_estimator_bad_input(regression):
    reg, X, _ = regression
    with pytest.raises(ValueError, match="extent"):
        PredictiveBandDisplay.from_estimator(reg, X, extent=(1, 1))
    with pytest.raises(ValueError, match="n_points"):
        PredictiveBandDisplay.from_estimator(reg, X, n_points=1)
    with pytest.raises(ValueError, match="one input feature"):
        PredictiveBandDisplay.from_estimator(reg, np.hstack([X, X]))
    with pytest.raises(ValueError, match="n_std"):
        PredictiveBandDisplay.from_estimator(reg, X, n_std=[1, 0], plot=False)


# ---------------------------------------------------------------------------
# CalibrationCurveDisplay
# ---------------------------------------------------------------------------


def _gaussian_predictions(n=400, scale=0.6, seed=0):
    rng = np.random.RandomState(seed)
    mean = rng.randn(n)
    y = mean + rng.randn(n)  # true std 1: std=scale < 1 is over-confident
    return y, mean, np.full(n, scale)


def test_calibration_curve_matches_metrics():
    y, mean, std = _gaussian_predictions()
    disp = CalibrationCurveDisplay.from_predictions(y, mean, std, name="model")
    alphas, gamma = calibration_curve_regression(y, mean, std)
    np.testing.assert_array_equal(disp.alphas, alphas)
    np.testing.assert_array_equal(disp.coverage, gamma)
    assert disp.cqm == centered_quantile_metric(y, mean, std)
    assert disp.cqm > 0.1  # over-confident by construction
    assert np.all(disp.coverage[1:-1] < disp.alphas[1:-1])  # below the diagonal

    np.testing.assert_array_equal(disp.line_.get_xdata(), alphas)
    np.testing.assert_array_equal(disp.line_.get_ydata(), gamma)
    assert isinstance(disp.ref_line_, Line2D)
    labels = [t.get_text() for t in disp.ax_.get_legend().get_texts()]
    assert f"model (CQM = {disp.cqm:.3f})" in labels

    # a finer grid: the curve follows it, the CQM stays the 11-point metric
    fine = np.linspace(0.05, 0.95, 19)
    disp2 = CalibrationCurveDisplay.from_predictions(y, mean, std, alphas=fine, ax=disp.ax_)
    np.testing.assert_array_equal(disp2.coverage, calibration_curve_regression(
        y, mean, std, alphas=fine)[1])
    assert disp2.cqm == disp.cqm
    assert disp2.ref_line_ is None  # the diagonal is drawn once per axes
    assert len(disp.ax_.get_lines()) == 3


def test_calibration_from_estimator(regression):
    reg, X, y = regression
    disp = CalibrationCurveDisplay.from_estimator(reg, X, y)
    mean, std = reg.predict(X, return_std=True)
    np.testing.assert_array_equal(disp.coverage, calibration_curve_regression(y, mean, std)[1])
    assert disp.cqm == centered_quantile_metric(y, mean, std)
    assert disp.estimator_name == "LLARegressor"


def test_calibration_bad_input():
    with pytest.raises(ValueError, match="strictly positive"):
        CalibrationCurveDisplay.from_predictions([0.0, 1.0], [0.0, 0.0], [1.0, 0.0])
    with pytest.raises(ValueError, match="alphas"):
        CalibrationCurveDisplay.from_predictions([0.0, 1.0], [0.0, 0.0], 1.0, alphas=[1.5])


# ---------------------------------------------------------------------------
# ReliabilityDisplay
# ---------------------------------------------------------------------------


def _proba_predictions(n=500, k=3, seed=0):
    rng = np.random.RandomState(seed)
    logits = 3 * rng.randn(n, k)
    proba = np.exp(logits) / np.exp(logits).sum(1, keepdims=True)
    y = np.array([rng.choice(k, p=p ** 0.5 / (p ** 0.5).sum()) for p in proba])
    return y, proba


def test_reliability_matches_metrics():
    y, proba = _proba_predictions()
    disp = ReliabilityDisplay.from_predictions(y, proba, name="net")
    conf, acc, counts = reliability_curve(y, proba, 15)
    np.testing.assert_array_equal(disp.bin_confidence, conf)
    np.testing.assert_array_equal(disp.bin_accuracy, acc)
    np.testing.assert_array_equal(disp.bin_counts, counts)
    assert disp.ece == expected_calibration_error(y, proba, 15)
    assert disp.ece > 0.05  # labels drawn from a flattened proba: over-confident

    nonempty = counts > 0
    assert isinstance(disp.bars_, BarContainer) and disp.line_ is None
    assert len(disp.bars_) == nonempty.sum()
    np.testing.assert_allclose([r.get_height() for r in disp.bars_], acc[nonempty])
    np.testing.assert_allclose([r.get_x() for r in disp.bars_],
                               (np.arange(15) / 15)[nonempty])
    assert isinstance(disp.hist_, BarContainer) and len(disp.hist_) == 15
    np.testing.assert_allclose([r.get_height() for r in disp.hist_], counts / counts.sum())
    np.testing.assert_allclose([r.get_x() for r in disp.hist_], (np.arange(15) + 0.25) / 15)
    assert disp.hist_ax_ is not disp.ax_
    labels = [t.get_text() for t in disp.ax_.get_legend().get_texts()]
    assert f"net (ECE = {disp.ece:.3f})" in labels and "perfectly calibrated" in labels


def test_reliability_line_kind_and_bins():
    y, proba = _proba_predictions(seed=1)
    disp = ReliabilityDisplay.from_predictions(y, proba, n_bins=5, kind="line",
                                               show_histogram=False)
    conf, acc, counts = reliability_curve(y, proba, 5)
    assert disp.bars_ is None and disp.hist_ is None and disp.hist_ax_ is None
    np.testing.assert_allclose(disp.line_.get_xdata(), conf[counts > 0])
    np.testing.assert_allclose(disp.line_.get_ydata(), acc[counts > 0])
    assert disp.ece == expected_calibration_error(y, proba, 5)
    with pytest.raises(ValueError, match="kind"):
        disp.plot(kind="scatter")


def test_reliability_binary_1d_proba():
    y = np.array([0, 1, 1, 0, 1])
    p1 = np.array([0.2, 0.9, 0.6, 0.4, 0.3])
    disp = ReliabilityDisplay.from_predictions(y, p1, plot=False)
    assert disp.ece == expected_calibration_error(y, np.column_stack([1 - p1, p1]))


def test_reliability_from_estimator_uses_classes(classification):
    clf, X, y = classification
    disp = ReliabilityDisplay.from_estimator(clf, X, y)
    proba = clf.predict_proba(X)
    assert disp.ece == expected_calibration_error(y, proba, labels=clf.classes_)
    np.testing.assert_array_equal(
        disp.bin_accuracy, reliability_curve(y, proba, labels=clf.classes_)[1])
    assert disp.estimator_name == "LLAClassifier"


def test_reliability_from_estimator_needs_predict_proba(regression):
    reg, X, y = regression
    with pytest.raises(AttributeError, match="predict_proba"):
        ReliabilityDisplay.from_estimator(reg, X, y)


def test_two_reliability_diagrams_on_one_axes():
    """Overlaid: step lines (flat over each bin, broken at empty bins), or bars side by
    side in slots; the histograms share one twin axes, each in its display's slot."""
    y1, p1 = _proba_predictions(seed=0)
    y2, p2 = _proba_predictions(seed=1)
    first = ReliabilityDisplay.from_predictions(y1, p1, n_bins=10, kind="step", name="A",
                                                bar_position=(0, 2))
    second = ReliabilityDisplay.from_predictions(y2, p2, n_bins=10, kind="step", name="B",
                                                 bar_position=(1, 2), ax=first.ax_)
    ax = first.ax_
    assert second.ax_ is ax and second.hist_ax_ is first.hist_ax_
    assert len([a for a in ax.figure.axes if a is not ax]) == 1  # one twin, not two
    for disp, (y, p) in ((first, (y1, p1)), (second, (y2, p2))):
        _, acc, counts = reliability_curve(y, p, 10)
        data = disp.line_.get_data()
        values, edges = data.values, data.edges
        np.testing.assert_allclose(edges, np.arange(11) / 10)
        np.testing.assert_array_equal(np.isnan(values), counts == 0)
        np.testing.assert_allclose(values[counts > 0], acc[counts > 0])
    assert first.line_.get_edgecolor() != second.line_.get_edgecolor()
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels.count("perfectly calibrated") == 1
    assert f"A (ECE = {first.ece:.3f})" in labels and f"B (ECE = {second.ece:.3f})" in labels

    # bars in two slots of each bin: side by side, never on top of each other
    a = ReliabilityDisplay.from_predictions(y1, p1, n_bins=10, bar_position=(0, 2))
    b = ReliabilityDisplay.from_predictions(y2, p2, n_bins=10, bar_position=(1, 2), ax=a.ax_)
    spans = [(r.get_x(), r.get_x() + r.get_width()) for r in [*a.bars_, *b.bars_]]
    spans.sort()
    for (_, end), (start, _) in zip(spans, spans[1:]):
        assert start >= end - 1e-12
    assert all(r.get_width() == pytest.approx(0.05) for r in a.bars_)
    np.testing.assert_allclose(sorted({round(r.get_x() % 0.1, 9) for r in b.bars_}), [0.05])
    hist_x = sorted(r.get_x() for r in [*a.hist_, *b.hist_])
    assert len(set(np.round(hist_x, 9))) == 20  # 10 bins x 2 slots, no two at one place
    top = max(r.get_height() for r in [*a.hist_, *b.hist_])
    assert a.hist_ax_.get_ylim()[1] == pytest.approx(4 * top)
    with pytest.raises(ValueError, match="bar_position"):
        a.plot(bar_position=(2, 2))


# ---------------------------------------------------------------------------
# PredictionIntervalDisplay
# ---------------------------------------------------------------------------


def test_prediction_interval_from_predictions():
    y, mean, std = _gaussian_predictions(n=200)
    from scipy.stats import norm

    disp = PredictionIntervalDisplay.from_predictions(y, mean, std=std, confidence=0.8,
                                                      name="net", subsample=50,
                                                      random_state=0)
    z = norm.ppf(0.9)
    lo, hi = mean - z * std, mean + z * std
    assert disp.coverage_ == pytest.approx(np.mean((lo <= y) & (y <= hi)))
    assert disp.mean_width_ == pytest.approx(np.mean(hi - lo))
    np.testing.assert_allclose(disp.lower, lo)
    assert len(disp.scatter_.get_offsets()) == 50 and len(disp.intervals_.get_segments()) == 50
    for seg in disp.intervals_.get_segments():  # vertical at the prediction
        assert seg[0, 0] == seg[1, 0]
    labels = [t.get_text() for t in disp.ax_.get_legend().get_texts()]
    assert f"net, 80% gaussian interval: coverage {disp.coverage_:.3f}" in labels
    assert "true = predicted" in labels
    # the colours: green where covered, red where missed
    seg_x = np.array([s[0, 0] for s in disp.intervals_.get_segments()])
    colors = disp.intervals_.get_colors()
    rows = [int(np.flatnonzero(mean == x)[0]) for x in seg_x]
    covered = (lo[rows] <= y[rows]) & (y[rows] <= hi[rows])
    assert covered.any() and (~covered).any()
    green = matplotlib.colors.to_rgba("tab:green", 0.5)
    np.testing.assert_allclose(colors[covered], np.tile(green, (covered.sum(), 1)))
    with pytest.raises(ValueError, match="either the bounds"):
        PredictionIntervalDisplay.from_predictions(y, mean, lower=lo, upper=hi, std=std)
    with pytest.raises(ValueError, match="lower must not exceed upper"):
        PredictionIntervalDisplay.from_predictions(y, mean, lower=hi, upper=lo)
    with pytest.raises(ValueError, match="subsample"):
        disp.plot(subsample=-1)


def test_prediction_interval_from_estimator(regression):
    reg, X, y = regression
    gauss = PredictionIntervalDisplay.from_estimator(reg, X, y, confidence=0.9)
    assert gauss.kind == "gaussian"  # not conformalized
    with pytest.raises(Exception, match="not conformalized"):
        PredictionIntervalDisplay.from_estimator(reg, X, y, interval="conformal", plot=False)
    cal = pickle.loads(pickle.dumps(reg)).conformalize(X[:20], y[:20])
    disp = PredictionIntervalDisplay.from_estimator(cal, X[20:], y[20:], confidence=0.8)
    lo, hi = cal.predict_interval(X[20:], confidence=0.8)
    assert disp.kind == "conformal"
    np.testing.assert_allclose(disp.lower, lo)
    np.testing.assert_allclose(disp.upper, hi)
    assert disp.estimator_name == "LLARegressor"
    np.testing.assert_allclose(disp.y_pred, cal.predict(X[20:]))


# ---------------------------------------------------------------------------
# matplotlib is optional
# ---------------------------------------------------------------------------


def _hide_matplotlib(monkeypatch):
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.setitem(sys.modules, name, None)  # "import name" raises ImportError
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", None)


def test_import_and_compute_without_matplotlib(monkeypatch):
    _hide_matplotlib(monkeypatch)
    monkeypatch.delitem(sys.modules, "sklearn_lla.plotting")
    plotting = importlib.import_module("sklearn_lla.plotting")
    y, mean, std = _gaussian_predictions(n=20)
    disp = plotting.CalibrationCurveDisplay.from_predictions(y, mean, std, plot=False)
    assert disp.cqm == centered_quantile_metric(y, mean, std)


@pytest.mark.parametrize("display", ["band", "calibration", "reliability"])
def test_plot_without_matplotlib_names_the_extra(monkeypatch, display):
    y, mean, std = _gaussian_predictions(n=20)
    if display == "band":
        disp = PredictiveBandDisplay.from_predictions(mean, mean, std, plot=False)
    elif display == "calibration":
        disp = CalibrationCurveDisplay.from_predictions(y, mean, std, plot=False)
    else:
        disp = ReliabilityDisplay.from_predictions(*_proba_predictions(n=20), plot=False)
    _hide_matplotlib(monkeypatch)
    with pytest.raises(ImportError, match=r"pip install sklearn-lla\[plot\]") as info:
        disp.plot()
    assert "requires matplotlib" in str(info.value)
