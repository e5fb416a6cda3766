"""Defaults must calibrate: with default parameters, every registered estimator's
held-out NLL and calibration error are no worse than the raw network's.

The protocol is the one of ``benchmarks/calibration.py`` (see ``docs/calibration.md``)
on two of its data sets, diabetes (regression) and breast cancer (classification):
a skorch net trained the usual way (skorch's default 20 % validation split, Adam),
then each estimator fitted with its defaults on the same training data. The raw
baselines are the net's softmax, and the net with a homoscedastic std from the
validation residuals (the stronger of the two raw regression baselines).

Tolerances: NLL may exceed the raw net's by 0.02 nats, ECE / CQM by 0.01 (absolute):
sampling noise of 89 / 114 test points, far below the failures these tests guard
against (ECE 0.03 -> 0.35, NLL 0.17 -> 0.59 on digits before the fix).
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


def _split(X, y, stratify):
    Xa, Xte, ya, yte = train_test_split(X, y, test_size=0.2, random_state=0,
                                        stratify=y if stratify else None)
    Xtr, Xva, ytr, yva = train_test_split(Xa, ya, test_size=0.25, random_state=0,
                                          stratify=ya if stratify else None)
    sc = StandardScaler().fit(Xtr)
    f = lambda a: sc.transform(a).astype(np.float32)
    return f(Xtr), f(Xva), f(Xte), ytr, yva, yte


def _net(cls, criterion, n_in, n_out):
    return cls(MLP, module__n_features=n_in, module__n_outputs=n_out,
               module__hidden_layer_sizes=(50, 50), criterion=criterion,
               optimizer=torch.optim.Adam, lr=3e-3, optimizer__weight_decay=1e-4,
               max_epochs=100, batch_size=128, verbose=0)


@pytest.fixture(scope="module")
def diabetes():
    X, y = load_diabetes(return_X_y=True)
    Xtr, Xva, Xte, ytr, yva, yte = _split(X, y, False)
    mu, sd = ytr.mean(), ytr.std()
    z = lambda a: ((a - mu) / sd).astype(np.float32)
    net = _net(skorch.NeuralNetRegressor, torch.nn.MSELoss, X.shape[1], 1)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        net.fit(Xtr, z(ytr).reshape(-1, 1))
    return dict(net=net, Xtr=Xtr, ytr=z(ytr), Xva=Xva, yva=z(yva), Xte=Xte, yte=z(yte))


@pytest.fixture(scope="module")
def breast_cancer():
    X, y = load_breast_cancer(return_X_y=True)
    Xtr, Xva, Xte, ytr, yva, yte = _split(X, y, True)
    net = _net(skorch.NeuralNetClassifier, torch.nn.CrossEntropyLoss, X.shape[1], 2)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        net.fit(Xtr, ytr)
    return dict(net=net, Xtr=Xtr, ytr=ytr, Xva=Xva, yva=yva, Xte=Xte, yte=yte)


# Sampled LLA is fitted with its registry ``test_params`` (K = 8 samples, 100 Adam steps
# per E-step instead of 64 and 300): the same "auto" policy (validation scan when held-out
# rows exist), in seconds instead of a minute; the full defaults are measured in
# docs/sampled.md. Entries that would need an xfail go into ``_KNOWN`` (none now).
_KNOWN: set = set()
_FAST = {"SampledLLARegressor", "SampledLLAClassifier"}


def _params(entries):
    return [pytest.param(e, id=e.id, marks=pytest.mark.xfail(
        run=False, reason="known calibration defect")) if e.cls.__name__ in _KNOWN
        else pytest.param(e, id=e.id) for e in entries]


def _make(entry, net):
    fast = entry.test_params if entry.cls.__name__ in _FAST else {}
    return entry.cls(net, **{**entry.params, **fast}, random_state=0)


REG = _params([e for e in ESTIMATORS if not e.is_classifier])
CLF = _params([e for e in ESTIMATORS if e.is_classifier])


@pytest.mark.parametrize("entry", REG)
def test_regression_defaults_not_worse_than_raw_net(entry, diabetes):
    d = diabetes
    net = d["net"]
    raw_mean = net.predict(d["Xte"])[:, 0]
    raw_std = np.sqrt(np.mean((net.predict(d["Xva"])[:, 0] - d["yva"]) ** 2))
    raw_nll = gaussian_nll(d["yte"], raw_mean, raw_std)
    raw_cqm = centered_quantile_metric(d["yte"], raw_mean, np.full_like(raw_mean, raw_std))
    est = _make(entry, net).fit(d["Xtr"], d["ytr"])
    mean, std = est.predict(d["Xte"], return_std=True)
    np.testing.assert_allclose(mean, raw_mean, rtol=1e-5, atol=1e-6)  # the net's own mean
    nll, cqm = gaussian_nll(d["yte"], mean, std), centered_quantile_metric(d["yte"], mean, std)
    print(f"{entry.id}: NLL {nll:.4f} (raw {raw_nll:.4f}), CQM {cqm:.4f} (raw {raw_cqm:.4f}), "
          f"{est.hyper_strategy_}, {est.validation_source_}")
    assert nll <= raw_nll + NLL_TOL
    assert cqm <= raw_cqm + CAL_TOL


@pytest.mark.parametrize("entry", CLF)
def test_classification_defaults_not_worse_than_raw_net(entry, breast_cancer):
    d = breast_cancer
    net = d["net"]
    raw = net.predict_proba(d["Xte"])
    raw_nll = -np.mean(np.log(raw[np.arange(len(raw)), d["yte"]]))
    raw_ece = expected_calibration_error(d["yte"], raw)
    est = _make(entry, net).fit(d["Xtr"], d["ytr"])
    p = est.predict_proba(d["Xte"])
    nll = -np.mean(np.log(p[np.arange(len(p)), d["yte"]]))
    ece = expected_calibration_error(d["yte"], p)
    print(f"{entry.id}: NLL {nll:.4f} (raw {raw_nll:.4f}), ECE {ece:.4f} (raw {raw_ece:.4f}), "
          f"{est.hyper_strategy_}, {est.validation_source_}")
    assert nll <= raw_nll + NLL_TOL
    assert ece <= raw_ece + CAL_TOL
    # and the decisions stay the network's
    assert np.mean(est.predict(d["Xte"]) == d["yte"]) >= np.mean(raw.argmax(1) == d["yte"]) - 0.02
