"""Defaults must calibrate, and keep the uncertainty, in the situations users are in.

Two of the data sets of ``benchmarks/calibration.py`` (see ``docs/calibration.md``),
diabetes (regression) and breast cancer (classification), in two of its situations:

* (a) a skorch net trained the usual way (skorch's default 20 % validation split,
  Adam), each registered estimator then fitted with its defaults on the same
  training data: it recovers skorch's validation rows itself. Raw baselines: the
  net's softmax, and the net with a homoscedastic std from the residuals on the
  benchmark's validation split (the stronger of the two raw regression baselines);
* (b) the same net trained with ``train_split=None`` (it fits every training row),
  each estimator fitted without validation data: no held-out rows exist. Raw
  baselines: the softmax, and the net with the RMS of its training residuals as std
  (all a user without held-out rows has). The fit must report no validation source:
  rows the net has fitted are never validation data.

Tolerances: NLL may exceed the raw net's by 0.02 nats, ECE / CQM by 0.01 (absolute):
the sampling noise of 89 / 114 test points, far below the failures these tests guard
against (ECE 0.03 -> 0.35, NLL 0.17 -> 0.59 on digits before the calibration fix;
issue 19's VaLLA / FMGP without held-out rows: up to 0.2-0.5 nats worse than the
raw net on diabetes). They are the tolerances of the benchmark's verdicts.

The gap test: a 1-D regression with two clusters, x in [-3, -1] U [1, 3], y =
sin(x) + N(0, 0.1^2), 40 rows each, and a small skorch MLP (2 x 32 tanh, 300 full-batch
Adam steps, ``train_split=None``). Every registered regression configuration with its
default hyperparameter policy must give a predictive std at x = 0 (the middle of the
gap, one unit from the nearest row) at least 3 x its mean std on the training rows,
in situation (b) (no validation data) and (c) (``validation_data``: 20 fresh rows per
cluster). 3 x: the exact LLA with its evidence-chosen prior gives 4.7 / 5.1 here; a
constant band, which issue 19 found for sampled LLA, VaLLA and subspace defaults, gives
1; on the data the std is the noise std 0.1, so 3 x means the epistemic std in the gap
is at least 2.8 x the noise std. The only size changes are ones that leave the
hyperparameter policy and the optimisation budget alone (``_GAP_SIZES``).

Sampled LLA is fitted with its registry ``test_params`` in the diabetes / breast
cancer tests (K = 8 samples, 100 Adam steps, 1 EM step instead of 64, 300, 3): the same
policy in seconds instead of a minute; the full defaults are measured by
``benchmarks/calibration.py``.
"""

from __future__ import annotations

import numpy as np
import pytest
import skorch
import torch
from sklearn.datasets import load_breast_cancer, load_diabetes
from sklearn.model_selection import train_test_split
from sklearn.preprocessing import StandardScaler

from sklearn_lla._registry import ESTIMATORS
from sklearn_lla.metrics import centered_quantile_metric, expected_calibration_error, gaussian_nll
from sklearn_lla.nets import MLP

NLL_TOL, CAL_TOL = 0.02, 0.01
GAP_RATIO = 3.0
#: Last-layer LLA's evidence-chosen posterior on the gap toy: the last layer's tanh
#: features at x = 0 lie between those of the two clusters, so a linear model of them
#: grows little in between (the in-between limitation of last-layer Laplace). Measured
#: on this toy: ours 1.29, laplace-torch's last-layer full / KFAC + marglik 1.04 / 1.04
#: (all-weights KFAC 1.21, our full LLA 4.7). The bar for it: clearly above 1 and above
#: that peer.
GAP_RATIO_LAST_LAYER = 1.2


def _exact_rbf_gp_gap_ratio(g):
    """The gap ratio of an exact GP with FMGP's prior family (RBF plus noise), its
    hyperparameters by the evidence (scikit-learn's ``GaussianProcessRegressor``) on
    the same rows. FMGP's prior is an RBF GP, not LLA's NTK: sin(x) is
    smooth across the gap, so any evidence-fitted RBF GP learns a length scale that
    bridges it (measured 1.49, ratio 1.39; FMGP 1.62 / 1.95). The authors' settings
    reach ~4 only by driving the noise to 1e-11, which loses on diabetes and friedman1
    without held-out rows (docs/fmgp.md). FMGP's bar: at least the exact RBF GP's."""
    from sklearn.gaussian_process import GaussianProcessRegressor
    from sklearn.gaussian_process.kernels import RBF, ConstantKernel, WhiteKernel

    gp = GaussianProcessRegressor(ConstantKernel() * RBF() + WhiteKernel(), random_state=0,
                                  n_restarts_optimizer=3).fit(g["X"], g["y"])
    _, sd_data = gp.predict(g["X"], return_std=True)
    _, sd_gap = gp.predict(np.zeros((1, 1)), return_std=True)
    return float(sd_gap[0] / sd_data.mean())


def _split(X, y, stratify):
    Xa, Xte, ya, yte = train_test_split(X, y, test_size=0.2, random_state=0,
                                        stratify=y if stratify else None)
    Xtr, Xva, ytr, yva = train_test_split(Xa, ya, test_size=0.25, random_state=0,
                                          stratify=ya if stratify else None)
    sc = StandardScaler().fit(Xtr)
    f = lambda a: sc.transform(a).astype(np.float32)  # noqa: E731
    return f(Xtr), f(Xva), f(Xte), ytr, yva, yte


def _net(cls, criterion, n_in, n_out, holdout=True, hidden=(50, 50), max_epochs=100, lr=3e-3):
    kw = {} if holdout else {"train_split": None}
    return cls(MLP, module__n_features=n_in, module__n_outputs=n_out,
               module__hidden_layer_sizes=hidden, criterion=criterion,
               optimizer=torch.optim.Adam, lr=lr, optimizer__weight_decay=1e-4,
               max_epochs=max_epochs, batch_size=128, verbose=0, **kw)


def _fit(net, X, y):
    with torch.random.fork_rng():
        torch.manual_seed(0)
        net.fit(X, y)
    return net


def _diabetes(holdout):
    X, y = load_diabetes(return_X_y=True)
    Xtr, Xva, Xte, ytr, yva, yte = _split(X, y, False)
    mu, sd = ytr.mean(), ytr.std()
    z = lambda a: ((a - mu) / sd).astype(np.float32)  # noqa: E731
    net = _fit(_net(skorch.NeuralNetRegressor, torch.nn.MSELoss, X.shape[1], 1, holdout),
               Xtr, z(ytr).reshape(-1, 1))
    return dict(net=net, Xtr=Xtr, ytr=z(ytr), Xva=Xva, yva=z(yva), Xte=Xte, yte=z(yte))


def _breast_cancer(holdout):
    X, y = load_breast_cancer(return_X_y=True)
    Xtr, Xva, Xte, ytr, yva, yte = _split(X, y, True)
    net = _fit(_net(skorch.NeuralNetClassifier, torch.nn.CrossEntropyLoss, X.shape[1], 2,
                    holdout), Xtr, ytr)
    return dict(net=net, Xtr=Xtr, ytr=ytr, Xva=Xva, yva=yva, Xte=Xte, yte=yte)


@pytest.fixture(scope="module")
def diabetes():
    return _diabetes(holdout=True)


@pytest.fixture(scope="module")
def breast_cancer():
    return _breast_cancer(holdout=True)


@pytest.fixture(scope="module")
def diabetes_b():
    return _diabetes(holdout=False)


@pytest.fixture(scope="module")
def breast_cancer_b():
    return _breast_cancer(holdout=False)


def _gap_rows(seed, n):
    rng = np.random.RandomState(seed)
    x = np.concatenate([rng.uniform(-3, -1, n), rng.uniform(1, 3, n)])
    y = np.sin(x) + 0.1 * rng.randn(2 * n)
    return x[:, None].astype(np.float32), y.astype(np.float32)


@pytest.fixture(scope="module")
def gap():
    X, y = _gap_rows(0, 40)
    Xv, yv = _gap_rows(1, 20)
    net = _fit(_net(skorch.NeuralNetRegressor, torch.nn.MSELoss, 1, 1, holdout=False,
                    hidden=(32, 32), max_epochs=300, lr=1e-2), X, y[:, None])
    return dict(net=net, X=X, y=y, Xv=Xv, yv=yv)


# Entries that would need an xfail go into ``_KNOWN`` (none: a failing default is a
# finding of issue 19, not something to hide).
_KNOWN: set = set()
_FAST = {"SampledLLARegressor", "SampledLLAClassifier"}
# Gap test: sizes only (n_inducing for 80 rows of a 1-D input; MC samples of sampled
# LLA), never the hyperparameter policy, iteration budgets or early stopping.
_GAP_SIZES = {"FMGPRegressor": {"n_inducing": 20}, "VaLLARegressor": {"n_inducing": 20},
              "SampledLLARegressor": {"n_posterior_samples": 16}}


def _params(entries):
    return [pytest.param(e, id=e.id, marks=pytest.mark.xfail(
        run=False, reason="known calibration defect")) if e.cls.__name__ in _KNOWN
        else pytest.param(e, id=e.id) for e in entries]


def _make(entry, net):
    fast = entry.test_params if entry.cls.__name__ in _FAST else {}
    return entry.cls(net, **{**entry.params, **fast}, random_state=0)


REG = _params([e for e in ESTIMATORS if not e.is_classifier])
CLF = _params([e for e in ESTIMATORS if e.is_classifier])


def _check_regression(entry, d, raw_std, label):
    net = d["net"]
    raw_mean = net.predict(d["Xte"])[:, 0]
    raw_nll = gaussian_nll(d["yte"], raw_mean, raw_std)
    raw_cqm = centered_quantile_metric(d["yte"], raw_mean, np.full_like(raw_mean, raw_std))
    est = _make(entry, net).fit(d["Xtr"], d["ytr"])
    mean, std = est.predict(d["Xte"], return_std=True)
    np.testing.assert_allclose(mean, raw_mean, rtol=1e-5, atol=1e-6)  # the net's own mean
    nll, cqm = gaussian_nll(d["yte"], mean, std), centered_quantile_metric(d["yte"], mean, std)
    print(f"{label} {entry.id}: NLL {nll:.4f} (raw {raw_nll:.4f}), CQM {cqm:.4f} "
          f"(raw {raw_cqm:.4f}), {est.hyper_strategy_}, {est.validation_source_}")
    assert nll <= raw_nll + NLL_TOL
    assert cqm <= raw_cqm + CAL_TOL
    return est


def _check_classification(entry, d, label):
    net = d["net"]
    raw = net.predict_proba(d["Xte"])
    raw_nll = -np.mean(np.log(raw[np.arange(len(raw)), d["yte"]]))
    raw_ece = expected_calibration_error(d["yte"], raw)
    est = _make(entry, net).fit(d["Xtr"], d["ytr"])
    p = est.predict_proba(d["Xte"])
    nll = -np.mean(np.log(p[np.arange(len(p)), d["yte"]]))
    ece = expected_calibration_error(d["yte"], p)
    print(f"{label} {entry.id}: NLL {nll:.4f} (raw {raw_nll:.4f}), ECE {ece:.4f} "
          f"(raw {raw_ece:.4f}), {est.hyper_strategy_}, {est.validation_source_}")
    assert nll <= raw_nll + NLL_TOL
    assert ece <= raw_ece + CAL_TOL
    # and the decisions stay the network's
    assert np.mean(est.predict(d["Xte"]) == d["yte"]) >= np.mean(raw.argmax(1) == d["yte"]) - 0.02
    return est


# -- situation (a): skorch's default split ------------------------------------------
@pytest.mark.parametrize("entry", REG)
def test_regression_defaults_not_worse_than_raw_net(entry, diabetes):
    d = diabetes
    raw_std = np.sqrt(np.mean((d["net"].predict(d["Xva"])[:, 0] - d["yva"]) ** 2))
    _check_regression(entry, d, raw_std, "(a)")


@pytest.mark.parametrize("entry", CLF)
def test_classification_defaults_not_worse_than_raw_net(entry, breast_cancer):
    _check_classification(entry, breast_cancer, "(a)")


# -- situation (b): train_split=None, no validation data ----------------------------
@pytest.mark.parametrize("entry", REG)
def test_regression_defaults_without_held_out_rows(entry, diabetes_b):
    d = diabetes_b
    raw_std = np.sqrt(np.mean((d["net"].predict(d["Xtr"])[:, 0] - d["ytr"]) ** 2))
    est = _check_regression(entry, d, raw_std, "(b)")
    assert est.validation_source_ is None  # no held-out rows: none may be claimed


@pytest.mark.parametrize("entry", CLF)
def test_classification_defaults_without_held_out_rows(entry, breast_cancer_b):
    est = _check_classification(entry, breast_cancer_b, "(b)")
    assert est.validation_source_ is None


# -- the gap: std grows between two clusters of data ----------------------------------
@pytest.mark.parametrize("situation", ["b", "c"])
@pytest.mark.parametrize("entry", REG)
def test_regression_std_grows_in_the_gap(entry, situation, gap):
    g = gap
    kw = {**entry.params, **_GAP_SIZES.get(entry.cls.__name__, {})}
    est = entry.cls(g["net"], **kw, random_state=0)
    if situation == "c":
        est.fit(g["X"], g["y"], validation_data=(g["Xv"], g["yv"]))
    else:
        est.fit(g["X"], g["y"])
    _, std_data = est.predict(g["X"], return_std=True)
    _, std_gap = est.predict(np.zeros((1, 1), dtype=np.float32), return_std=True)
    ratio = float(std_gap[0]) / float(np.mean(std_data))
    print(f"gap ({situation}) {entry.id}: std at 0 {float(std_gap[0]):.4f}, mean std on the "
          f"data {float(np.mean(std_data)):.4f}, ratio {ratio:.2f}, "
          f"prior_variance_ {est.prior_variance_:.3g}")
    assert np.all(np.isfinite(std_data)) and np.all(std_data > 0)
    if entry.params.get("subset_of_weights") == "last_layer":
        assert ratio >= GAP_RATIO_LAST_LAYER
    elif entry.cls.__name__ == "FMGPRegressor":
        bar = _exact_rbf_gp_gap_ratio(g)
        assert 1.2 < bar <= ratio, f"exact RBF GP's ratio {bar:.2f}"
    else:
        assert ratio >= GAP_RATIO
