"""Resolution of the ``net`` parameter (API.md "The network"), the promise that a
pretrained network is never modified, cloning semantics, and input validation."""

from __future__ import annotations

import copy
import warnings

import numpy as np
import pytest
import skorch
import torch
from conftest import SingleLogitMLP, SoftmaxMLP, make_skorch_classifier, make_skorch_regressor
from sklearn.base import clone
from sklearn.exceptions import NotFittedError
from sklearn.frozen import FrozenEstimator
from sklearn.model_selection import GridSearchCV
from torch import nn

from sklearn_lla import LLAClassifier, LLARegressor
from sklearn_lla._network.resolve import looks_freshly_initialised
from sklearn_lla.nets import MLP


def _module_output(module, X):
    """The module's own forward pass (no_grad, whatever mode it is in: no dropout here)."""
    with torch.no_grad():
        return module(torch.as_tensor(np.asarray(X, dtype=np.float64))).numpy()


def _trainable_copy(net):
    """A deep copy of a fitted skorch net with its module in train mode and
    requires_grad=True everywhere, the state a user's freshly trained net is in."""
    net = copy.deepcopy(net)
    net.module_.train()
    for p in net.module_.parameters():
        p.requires_grad_(True)
    return net


# ---------------------------------------------------------------------------------
# net=None and unfitted skorch nets: trained inside fit
# ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def default_reg(reg_data):
    """LLARegressor(net=None) fitted once (training the default MLP takes seconds)."""
    return LLARegressor(device="cpu", random_state=3).fit(reg_data.X, reg_data.y)


def test_net_none_trains_float64_default_mlp(default_reg, reg_data, clf_data):
    reg = default_reg
    assert isinstance(reg.net_, skorch.NeuralNetRegressor)
    assert hasattr(reg.net_, "module_")
    assert all(p.dtype == torch.float64 for p in reg.net_.module_.parameters())
    assert reg.net is None  # the parameter is untouched
    mean = reg.predict(reg_data.X_test)
    np.testing.assert_array_equal(mean, _module_output(reg.net_.module_, reg_data.X_test)[:, 0])
    # the MAP fit is not trivial: it explains most of the variance of sin data
    assert reg.score(reg_data.X, reg_data.y) > 0.5

    clf = LLAClassifier(device="cpu", random_state=0).fit(clf_data.X, clf_data.y)
    assert isinstance(clf.net_, skorch.NeuralNetClassifier)
    assert all(p.dtype == torch.float64 for p in clf.net_.module_.parameters())
    np.testing.assert_array_equal(clf.classes_, [0, 1, 2])
    assert clf.score(clf_data.X, clf_data.y) > 0.8


def test_net_none_clone_refits_deterministically(default_reg, reg_data):
    c = clone(default_reg)
    assert c.net is None and not hasattr(c, "net_")
    state = torch.random.get_rng_state()
    c.fit(reg_data.X, reg_data.y)
    # no global seed is left behind: torch's global RNG state is unchanged by fit
    assert torch.equal(state, torch.random.get_rng_state())
    assert c.net_ is not default_reg.net_
    # same random_state: the refit is identical
    ma, sa = default_reg.predict(reg_data.X_test, return_std=True)
    mb, sb = c.predict(reg_data.X_test, return_std=True)
    np.testing.assert_array_equal(ma, mb)
    np.testing.assert_array_equal(sa, sb)


def test_unfitted_skorch_net_is_cloned_and_trained(reg_data):
    user_net = make_skorch_regressor(3, 1, (8,), max_epochs=20)
    est = LLARegressor(user_net, device="cpu", random_state=0).fit(reg_data.X, reg_data.y)
    assert est.net is user_net
    assert not hasattr(user_net, "module_"), "the user's unfitted net must stay unfitted"
    assert est.net_ is not user_net
    assert hasattr(est.net_, "module_")
    assert len(est.net_.history) == 20
    np.testing.assert_array_equal(
        est.predict(reg_data.X_test), _module_output(est.net_.module_, reg_data.X_test)[:, 0])


def test_unfitted_skorch_classifier_is_trained(clf_data):
    user_net = make_skorch_classifier(2, 3, (8,), max_epochs=30)
    est = LLAClassifier(user_net, device="cpu", random_state=0).fit(clf_data.X, clf_data.y)
    assert not hasattr(user_net, "module_")
    assert hasattr(est.net_, "module_")
    assert est.predict_proba(clf_data.X_test).shape == (len(clf_data.X_test), 3)


def test_frozen_unfitted_net_raises(reg_data):
    est = LLARegressor(FrozenEstimator(make_skorch_regressor(3, 1)), device="cpu")
    with pytest.raises(ValueError, match="fit"):
        est.fit(reg_data.X, reg_data.y)


# ---------------------------------------------------------------------------------
# Pretrained nets: used as they are, never modified
# ---------------------------------------------------------------------------------


def _pretrained_variants(net):
    """(net parameter, the torch module it holds) for the three pretrained forms."""
    return {
        "skorch": (net, net.module_),
        "frozen": (FrozenEstimator(net), net.module_),
        "module": (net.module_, net.module_),
    }


@pytest.mark.parametrize("kind", ["skorch", "frozen", "module"])
def test_pretrained_regressor_never_modified(kind, reg_data, reg_net, module_guard):
    net = _trainable_copy(reg_net)
    n_hist = len(net.history)
    param, module = _pretrained_variants(net)[kind]
    snap = module_guard.snapshot(module)
    assert module.training and all(p.requires_grad for p in module.parameters())

    est = LLARegressor(param, device="cpu").fit(reg_data.X, reg_data.y)
    mean, std = est.predict(reg_data.X_test, return_std=True)
    est.predict(reg_data.X_test, return_cov=True)
    est.sample_y(reg_data.X_test[:3], n_samples=2)
    est.score(reg_data.X, reg_data.y)

    module_guard.check(module, snap)  # bit-identical weights, same flags
    assert len(net.history) == n_hist
    if kind == "module":
        assert est.net_ is module
    else:
        assert est.net_ is net
    # the predictive mean is the network's own output, bit for bit (float64)
    np.testing.assert_array_equal(mean, _module_output(module, reg_data.X_test)[:, 0])
    assert np.all(std > 0)


@pytest.mark.parametrize("kind", ["skorch", "frozen", "module"])
def test_pretrained_classifier_never_modified(kind, clf_data, clf_net, module_guard):
    net = _trainable_copy(clf_net)
    param, module = _pretrained_variants(net)[kind]
    snap = module_guard.snapshot(module)
    est = LLAClassifier(param, device="cpu").fit(clf_data.X, clf_data.y)
    proba = est.predict_proba(clf_data.X_test)
    est.predict(clf_data.X_test)
    est.predict_log_proba(clf_data.X_test)
    module_guard.check(module, snap)
    lin_mean = est.posterior_.predict(torch.as_tensor(clf_data.X_test)).mean
    np.testing.assert_array_equal(lin_mean.numpy(), _module_output(module, clf_data.X_test))
    np.testing.assert_allclose(proba.sum(1), 1.0, rtol=1e-12)


def test_pretrained_module_eval_mode_dropout(reg_data, module_guard):
    # a module in train mode with dropout: the estimator must evaluate it in eval mode
    # (deterministic), without switching the user's module out of train mode.
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(3, 16), nn.Tanh(), nn.Dropout(0.5), nn.Linear(16, 1)).double()
    module.train()
    snap = module_guard.snapshot(module)
    est = LLARegressor(module, prior_variance=0.1, noise_variance=0.1, device="cpu")
    est.fit(reg_data.X, reg_data.y)
    m1, s1 = est.predict(reg_data.X_test, return_std=True)
    m2, s2 = est.predict(reg_data.X_test, return_std=True)
    np.testing.assert_array_equal(m1, m2)
    np.testing.assert_array_equal(s1, s2)
    module_guard.check(module, snap)
    eval_copy = copy.deepcopy(module).eval()
    np.testing.assert_allclose(m1, _module_output(eval_copy, reg_data.X_test)[:, 0],
                               rtol=1e-12, atol=1e-12)


def test_pretrained_float32_module(reg_data):
    torch.manual_seed(0)
    module = MLP(3, 1, (8,))  # float32
    est = LLARegressor(module, device="cpu").fit(reg_data.X, reg_data.y)
    mean, std = est.predict(reg_data.X_test, return_std=True)
    with torch.no_grad():
        want = module(torch.as_tensor(reg_data.X_test, dtype=torch.float32)).double().numpy()
    # computed in float32 by the same module: equal up to float32 rounding
    np.testing.assert_allclose(mean, want[:, 0], rtol=1e-6, atol=1e-6)
    assert mean.dtype == np.float64 and np.all(np.isfinite(std))


def test_skorch_nllloss_softmax_classifier(clf_data):
    # skorch's default classifier: NLLLoss on a module that outputs probabilities
    net = skorch.NeuralNetClassifier(
        SoftmaxMLP, module__n_features=2, module__n_outputs=3, module__hidden_layer_sizes=(8,),
        optimizer=torch.optim.Adam, lr=1e-2, max_epochs=40, train_split=None, verbose=0)
    assert net.criterion is torch.nn.NLLLoss
    with torch.random.fork_rng():
        torch.manual_seed(0)
        net.fit(clf_data.X, clf_data.y)
    est = LLAClassifier(net, prior_variance=1e-8, device="cpu").fit(clf_data.X, clf_data.y)
    # the latent g is the log of the module's probabilities (logits up to a constant)
    g = est.posterior_.predict(torch.as_tensor(clf_data.X_test)).mean
    p_net = net.predict_proba(clf_data.X_test)
    np.testing.assert_allclose(g.numpy(), np.log(p_net), rtol=1e-12, atol=1e-12)
    # a vanishing prior variance leaves the MAP probabilities (S ~ 1e-8 * NTK)
    np.testing.assert_allclose(est.predict_proba(clf_data.X_test), p_net, atol=1e-5)
    np.testing.assert_array_equal(est.predict(clf_data.X_test), net.predict(clf_data.X_test))


def test_skorch_binary_classifier(clf_data):
    mask = clf_data.y < 2
    X, y = clf_data.X[mask], clf_data.y[mask]
    net = skorch.NeuralNetBinaryClassifier(
        SingleLogitMLP, module__n_features=2, module__hidden_layer_sizes=(8,),
        optimizer=torch.optim.Adam, lr=1e-2, max_epochs=40, train_split=None, verbose=0)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        net.fit(X, y.astype(np.float64))
    est = LLAClassifier(net, prior_variance=1e-8, device="cpu").fit(X, y)
    np.testing.assert_array_equal(est.classes_, [0, 1])
    assert est.n_outputs_ == 1  # one logit: the Bernoulli likelihood
    assert type(est.likelihood_).__name__ == "Bernoulli"
    Xq = clf_data.X_test[clf_data.y_test < 2]
    proba = est.predict_proba(Xq)
    assert proba.shape == (len(Xq), 2)
    np.testing.assert_allclose(proba, net.predict_proba(Xq), atol=1e-5)
    # larger prior variance: probabilities pulled towards 1/2, rows still sum to one
    wide = LLAClassifier(net, prior_variance=10.0, device="cpu").fit(X, y).predict_proba(Xq)
    np.testing.assert_allclose(wide.sum(1), 1.0, rtol=1e-12)
    assert np.all(np.abs(wide[:, 1] - 0.5) <= np.abs(proba[:, 1] - 0.5) + 1e-12)
    # every link keeps the net's decisions (bridge used to predict one class only)
    yq = clf_data.y_test[clf_data.y_test < 2]
    acc_net = np.mean(net.predict(Xq) == yq)
    for link in ("probit", "mc", "bridge"):
        for s0 in (1e-3, 1.0):
            e = LLAClassifier(net, prior_variance=s0, link_approx=link, n_samples_predict=256,
                              device="cpu", random_state=0).fit(X, y)
            assert np.mean(e.predict(Xq) == yq) >= acc_net - 0.05, (link, s0)


# ---------------------------------------------------------------------------------
# clone and GridSearchCV
# ---------------------------------------------------------------------------------


def _same_weights(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    return set(sa) == set(sb) and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.parametrize("kind", ["skorch", "frozen", "module"])
def test_clone_keeps_pretrained_net(kind, reg_data, reg_net):
    param, module = _pretrained_variants(reg_net)[kind]
    est = LLARegressor(param, prior_variance=0.5, device="cpu")
    c = clone(est)
    assert c.prior_variance == 0.5
    inner = c.net.estimator if kind == "frozen" else c.net
    if inner is not (reg_net if kind != "module" else module):
        held = inner if kind == "module" else inner.module_
        assert _same_weights(held, module)
    # a fitted clone predicts exactly as the original
    m1 = est.fit(reg_data.X, reg_data.y).predict(reg_data.X_test)
    m2 = c.fit(reg_data.X, reg_data.y).predict(reg_data.X_test)
    np.testing.assert_array_equal(m1, m2)
    # cloning a fitted estimator too
    c2 = clone(est)
    assert not hasattr(c2, "posterior_")
    np.testing.assert_array_equal(c2.fit(reg_data.X, reg_data.y).predict(reg_data.X_test), m1)


def test_clone_refits_unfitted_skorch(reg_data):
    net = make_skorch_regressor(3, 1, (8,), max_epochs=10)
    est = LLARegressor(net, device="cpu", random_state=0).fit(reg_data.X, reg_data.y)
    c = clone(est)
    assert not hasattr(c, "net_")
    assert not hasattr(c.net, "module_"), "clone must hold an unfitted net"
    c.fit(reg_data.X, reg_data.y)
    assert c.net_ is not est.net_
    np.testing.assert_array_equal(c.predict(reg_data.X_test), est.predict(reg_data.X_test))


class _NoTrainRegressor(skorch.NeuralNetRegressor):
    """A skorch regressor whose training entry points raise once armed."""

    armed = False

    def fit(self, *a, **k):
        if self.armed:
            raise AssertionError("the pretrained net was refitted")
        return super().fit(*a, **k)

    def partial_fit(self, *a, **k):
        if self.armed:
            raise AssertionError("the pretrained net was refitted")
        return super().partial_fit(*a, **k)

    def initialize(self, *a, **k):
        if self.armed:
            raise AssertionError("the pretrained net was re-initialised")
        return super().initialize(*a, **k)


def test_gridsearch_never_retrains_pretrained_net(reg_data, reg_net, module_guard):
    net = _NoTrainRegressor(**reg_net.get_params())
    with torch.random.fork_rng():
        torch.manual_seed(0)
        net.fit(reg_data.X, reg_data.y.reshape(-1, 1))
    net.armed = True
    n_hist = len(net.history)
    snap = module_guard.snapshot(net.module_)
    gs = GridSearchCV(LLARegressor(net, noise_variance="auto", device="cpu"),
                      {"prior_variance": [0.1, 1.0]}, cv=3)
    gs.fit(reg_data.X, reg_data.y)
    module_guard.check(net.module_, snap)
    assert len(net.history) == n_hist
    assert gs.best_params_["prior_variance"] in (0.1, 1.0)
    assert np.all(np.isfinite(gs.cv_results_["mean_test_score"]))
    best = gs.best_estimator_
    inner = best.net_
    assert inner is net or _same_weights(inner.module_, net.module_)
    np.testing.assert_array_equal(
        gs.predict(reg_data.X_test), _module_output(net.module_, reg_data.X_test)[:, 0])


def test_gridsearch_frozen_classifier(clf_data, clf_net, module_guard):
    snap = module_guard.snapshot(clf_net.module_)
    n_hist = len(clf_net.history)
    gs = GridSearchCV(LLAClassifier(FrozenEstimator(clf_net), device="cpu"),
                      {"prior_variance": [0.1, 1.0]}, cv=3, scoring="neg_log_loss")
    gs.fit(clf_data.X, clf_data.y)
    module_guard.check(clf_net.module_, snap)
    assert len(clf_net.history) == n_hist
    assert np.all(np.isfinite(gs.cv_results_["mean_test_score"]))


# ---------------------------------------------------------------------------------
# Bad input
# ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fitted(reg_data, reg_net):
    return LLARegressor(reg_net, device="cpu").fit(reg_data.X, reg_data.y)


@pytest.mark.parametrize("bad, pattern", [(np.nan, "NaN"), (np.inf, "infinity"),
                                          (-np.inf, "infinity")])
def test_non_finite_X(bad, pattern, reg_data, reg_net, clf_data, clf_net, fitted):
    X = reg_data.X.copy()
    X[3, 1] = bad
    with pytest.raises(ValueError, match=pattern):
        LLARegressor(reg_net, device="cpu").fit(X, reg_data.y)
    Xc = clf_data.X.copy()
    Xc[0, 0] = bad
    with pytest.raises(ValueError, match=pattern):
        LLAClassifier(clf_net, device="cpu").fit(Xc, clf_data.y)
    with pytest.raises(ValueError, match=pattern):
        fitted.predict(X, return_std=True)


def test_non_finite_y(reg_data, reg_net):
    y = reg_data.y.copy()
    y[0] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        LLARegressor(reg_net, device="cpu").fit(reg_data.X, y)


def test_wrong_feature_count_at_predict(fitted, reg_data):
    with pytest.raises(ValueError, match=r"feature\(s\)|features"):
        fitted.predict(reg_data.X_test[:, :2])
    with pytest.raises(ValueError, match=r"feature\(s\)|features"):
        fitted.predict(np.hstack([reg_data.X_test, reg_data.X_test]), return_std=True)
    with pytest.raises(ValueError, match=r"feature\(s\)|features"):
        fitted.sample_y(reg_data.X_test[:, :2])


def test_wrong_feature_count_at_fit(reg_data, reg_net):
    # the pretrained net takes 3 features
    with pytest.raises(ValueError, match=r"feature\(s\)|features"):
        LLARegressor(reg_net, device="cpu").fit(reg_data.X[:, :2], reg_data.y)


def test_output_size_mismatch_regression(reg_data, reg_net, reg2_data, reg2_net):
    with pytest.raises(ValueError, match="output|target"):
        LLARegressor(reg_net, device="cpu").fit(reg2_data.X, reg2_data.y)  # 1 output, 2 targets
    with pytest.raises(ValueError, match="output|target"):
        LLARegressor(reg2_net, device="cpu").fit(reg_data.X, reg_data.y)  # 2 outputs, 1 target


def test_output_size_mismatch_classification(clf_data, clf_net):
    # a plain module's classes are its output indices: a subset of them is fine, a
    # label outside 0..C-1 is a clear error
    mask = clf_data.y < 2
    est = LLAClassifier(clf_net.module_, device="cpu").fit(clf_data.X[mask], clf_data.y[mask])
    np.testing.assert_array_equal(est.classes_, [0, 1, 2])
    with pytest.raises(ValueError, match="not the network's classes"):
        LLAClassifier(clf_net.module_, device="cpu").fit(clf_data.X, clf_data.y + 1)
    # 3 logits, 4 classes with a pretrained skorch net
    y4 = clf_data.y.copy()
    y4[:5] = 3
    with pytest.raises(ValueError, match="logit|class"):
        LLAClassifier(clf_net, device="cpu").fit(clf_data.X, y4)


def test_subset_of_known_classes_maps_to_the_right_logits(clf_data, clf_net):
    # a CV fold missing class 0: labels 1, 2 must still map to logits 1, 2
    mask = clf_data.y > 0
    est = LLAClassifier(clf_net, prior_variance=1e-8, device="cpu")
    est.fit(clf_data.X[mask], clf_data.y[mask])
    np.testing.assert_array_equal(est.classes_, [0, 1, 2])
    np.testing.assert_allclose(est.predict_proba(clf_data.X_test),
                               clf_net.predict_proba(clf_data.X_test), atol=1e-5)


def test_labels_unknown_to_pretrained_skorch_classifier(clf_data, clf_net):
    # The net was trained on classes [0, 1, 2]. y with labels {0, 1, 5}: label 5 is
    # unknown to the pretrained net; silently mapping it to logit 2 (by sorted
    # position) would mislabel, so fit must refuse.
    y = np.where(clf_data.y == 2, 5, clf_data.y)
    with pytest.raises(ValueError, match="label|class"):
        LLAClassifier(clf_net, device="cpu").fit(clf_data.X, y)


@pytest.mark.parametrize("kind", ["module", "skorch"])
def test_labels_that_are_not_the_nets_classes(kind, clf_data, clf_net):
    # the breast-cancer report: a net trained on 0/1/2, fitted with label names. Sorted
    # position would silently map "c" < "a" orders wrongly; it is a clear error, and
    # classes=[...] (the label of each output, in output order) maps them explicitly
    net = clf_net.module_ if kind == "module" else clf_net
    order = np.array(["c", "a", "b"])  # output 0 is "c": not sorted
    names = order[clf_data.y]
    with pytest.raises(ValueError, match="classes="):
        LLAClassifier(net, device="cpu").fit(clf_data.X, names)
    est = LLAClassifier(net, classes=order, prior_variance=1e-8, device="cpu")
    est.fit(clf_data.X, names)
    np.testing.assert_array_equal(est.classes_, order)
    want = order[clf_net.predict(clf_data.X_test)]
    np.testing.assert_array_equal(est.predict(clf_data.X_test), want)
    assert np.mean(est.predict(clf_data.X_test) == order[clf_data.y_test]) > 0.8
    with pytest.raises(ValueError, match="distinct labels"):
        LLAClassifier(net, classes=["a", "b"], device="cpu").fit(clf_data.X, names)


@pytest.mark.parametrize("value", [0.0, -1.0, np.nan, np.inf])
@pytest.mark.parametrize("param", ["prior_variance", "noise_variance"])
def test_bad_variance_values(param, value, reg_data, reg_net):
    with pytest.raises(ValueError, match=param):
        LLARegressor(reg_net, device="cpu", **{param: value}).fit(reg_data.X, reg_data.y)


@pytest.mark.parametrize("param", ["prior_variance", "noise_variance"])
def test_bad_variance_types(param, reg_data, reg_net):
    for value in ["abc", None, [1.0], True]:
        with pytest.raises((TypeError, ValueError)):
            LLARegressor(reg_net, device="cpu", **{param: value}).fit(reg_data.X, reg_data.y)


def test_bad_classifier_prior(clf_data, clf_net):
    for value in [0.0, -2.0, np.nan]:
        with pytest.raises(ValueError, match="prior_variance"):
            LLAClassifier(clf_net, prior_variance=value, device="cpu").fit(clf_data.X, clf_data.y)
    with pytest.raises((TypeError, ValueError)):
        LLAClassifier(clf_net, prior_variance="abc", device="cpu").fit(clf_data.X, clf_data.y)
    with pytest.raises((TypeError, ValueError)):
        LLAClassifier(clf_net, n_samples_predict=0, device="cpu").fit(clf_data.X, clf_data.y)


def test_bad_net_type(reg_data):
    with pytest.raises(TypeError, match="net"):
        LLARegressor("abc", device="cpu").fit(reg_data.X, reg_data.y)


def test_bad_device(reg_data, reg_net):
    with pytest.raises((TypeError, ValueError)):
        LLARegressor(reg_net, device="tpu-9").fit(reg_data.X, reg_data.y)


def test_not_fitted(reg_data, clf_data, reg_net, clf_net):
    reg = LLARegressor(reg_net, device="cpu")
    for call in (lambda: reg.predict(reg_data.X), lambda: reg.sample_y(reg_data.X),
                 lambda: reg.predict(reg_data.X, return_std=True)):
        with pytest.raises(NotFittedError):
            call()
    clf = LLAClassifier(clf_net, device="cpu")
    for call in (lambda: clf.predict(clf_data.X), lambda: clf.predict_proba(clf_data.X)):
        with pytest.raises(NotFittedError):
            call()


def test_one_class(clf_data, clf_net):
    with pytest.raises(ValueError, match="class"):
        LLAClassifier(clf_net, device="cpu").fit(clf_data.X, np.zeros(len(clf_data.X), int))
    with pytest.raises(ValueError, match="class"):
        LLAClassifier(device="cpu").fit(clf_data.X, np.ones(len(clf_data.X), int))


def test_continuous_y_for_classifier(clf_data, clf_net):
    with pytest.raises(ValueError):
        LLAClassifier(clf_net, device="cpu").fit(clf_data.X, clf_data.X[:, 0])


def test_too_few_samples(reg_data, reg_net):
    with pytest.raises(ValueError, match="sample"):
        LLARegressor(reg_net, device="cpu").fit(reg_data.X[:1], reg_data.y[:1])


# ---------------------------------------------------------------------------------
# Held-out rows: a skorch net's own validation split, verified
# ---------------------------------------------------------------------------------


@pytest.mark.parametrize("task", ["regression", "classification"])
def test_skorch_validation_split_is_recovered_and_verified(task, reg_data, clf_data):
    from skorch.dataset import ValidSplit

    if task == "regression":
        X, y = reg_data.X, reg_data.y
        net = make_skorch_regressor(3, 1, (16,), max_epochs=30, train_split=ValidSplit(5))
        fit_y = y.reshape(-1, 1)
        Est = LLARegressor
    else:
        X, y = clf_data.X, clf_data.y
        net = make_skorch_classifier(2, 3, (16,), max_epochs=30,
                                     train_split=ValidSplit(5, stratified=True))
        fit_y = y
        Est = LLAClassifier
    with torch.random.fork_rng():
        torch.manual_seed(0)
        net.fit(X, fit_y)
    est = Est(net, device="cpu").fit(X, y)
    assert est.validation_source_ == "the skorch net's own validation split"
    # the prior from the objective, the held-out rows calibrate the noise / temperature
    assert est.hyper_strategy_ == ("evidence" if task == "regression" else "weight_norm")
    assert "calibration" in est.hyper_trace_
    # the held-out rows are exactly skorch's: the first fold (no shuffling)
    n_val = len(X) // 5
    post = est.posterior_
    n_used = len(post.X_) if hasattr(post, "X_") else post.n_seen
    assert n_used == len(X) - n_val
    # other data than the net was trained on: the check fails, nothing is recovered
    est2 = Est(net, device="cpu").fit(X[::-1].copy(), y[::-1].copy())
    assert est2.validation_source_ is None
    # a net trained without a split: nothing to recover
    plain = (make_skorch_regressor(3, 1, (16,), max_epochs=5) if task == "regression"
             else make_skorch_classifier(2, 3, (16,), max_epochs=5))
    with torch.random.fork_rng():
        torch.manual_seed(0)
        plain.fit(X, fit_y)
    assert Est(plain, device="cpu").fit(X, y).validation_source_ is None


def test_net_trained_in_fit_keeps_its_holdout(reg_data):
    est = LLARegressor(device="cpu", random_state=0).fit(reg_data.X, reg_data.y)
    assert est.validation_source_ == "rows held out from training the network"
    assert est.hyper_strategy_ == "evidence" and "calibration" in est.hyper_trace_


class _DropsBatch(nn.Module):
    """Returns one row of outputs whatever the batch: (C,) instead of (B, C)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 1, dtype=torch.float64)

    def forward(self, x):
        return self.lin(x).mean(0)


def test_net_dropping_the_batch_dimension_is_a_clear_error(reg_data):
    with pytest.raises(ValueError, match="batch"):
        LLARegressor(_DropsBatch(), device="cpu").fit(reg_data.X, reg_data.y)


def test_frozen_parameters_are_not_linearised_by_default(reg_data, reg_net):
    module = copy.deepcopy(reg_net.module_)
    first = module.layers[0]
    for p in first.parameters():
        p.requires_grad_(False)
    n_all = sum(p.numel() for p in module.parameters())
    n_frozen = sum(p.numel() for p in first.parameters())
    est = LLARegressor(module, prior_variance=1.0, noise_variance=0.01,
                       device="cpu").fit(reg_data.X, reg_data.y)
    assert est.linearized_net_.n_params == n_all - n_frozen
    everything = LLARegressor(module, prior_variance=1.0, noise_variance=0.01,
                              trainable_only=False, device="cpu").fit(reg_data.X, reg_data.y)
    assert everything.linearized_net_.n_params == n_all
    # fewer linearised directions: never more latent variance at the same prior
    s_tr = est.predict(reg_data.X_test, return_std=True)[1]
    s_all = everything.predict(reg_data.X_test, return_std=True)[1]
    assert np.all(s_tr <= s_all + 1e-12)
    # the user's flags are untouched
    assert not any(p.requires_grad for p in first.parameters())


# ---------------------------------------------------------------------------------
# Untrained networks (issue 21): an error where skorch's history tells, a warning
# where only the weights can be read, and classes passed instead of instances
# ---------------------------------------------------------------------------------

_UNTRAINED = "looks untrained"


def _untrained_warnings(record):
    return [w for w in record if _UNTRAINED in str(w.message)]


@pytest.mark.parametrize("task", ["regression", "classification"])
def test_initialised_but_untrained_skorch_net_is_an_error(task, reg_data, clf_data):
    if task == "regression":
        net, est, d = make_skorch_regressor(3, 1).initialize(), LLARegressor, reg_data
        name = "NeuralNetRegressor"
    else:
        net, est, d = make_skorch_classifier(2, 3).initialize(), LLAClassifier, clf_data
        name = "NeuralNetClassifier"
    with pytest.raises(ValueError, match=rf"{name} that was initialised but never trained"):
        est(net, device="cpu").fit(d.X, d.y)
    # the message names the ways out
    with pytest.raises(ValueError, match=r"net\.fit\(X, y\).*initialize\(\).*FrozenEstimator"):
        est(net, device="cpu").fit(d.X, d.y)
    assert len(net.history) == 0  # refused, not trained behind the user's back


def test_frozen_untrained_skorch_net_warns_naming_the_class(reg_data):
    with torch.random.fork_rng():
        torch.manual_seed(0)
        net = make_skorch_regressor(3, 1, (32,)).initialize()  # 96 first-layer weights
    with pytest.warns(UserWarning, match=r"FrozenEstimator\(NeuralNetRegressor\).*looks untrained"):
        LLARegressor(FrozenEstimator(net), device="cpu").fit(reg_data.X, reg_data.y)


def test_fresh_module_warns_naming_the_class(reg_data):
    with torch.random.fork_rng():
        torch.manual_seed(0)
        module = MLP(3, 1, (32,), dtype=torch.float64)
    with pytest.warns(UserWarning, match=r"net \(MLP\) looks untrained") as record:
        est = LLARegressor(module, device="cpu").fit(reg_data.X, reg_data.y)
    assert len(_untrained_warnings(record)) == 1
    assert record[0].filename == __file__  # points at the user's call, not the library
    assert np.all(np.isfinite(est.predict(reg_data.X_test, return_std=True)[1]))


def _train_module(module, X, y, steps, lr=1e-2, weight_decay=0.0):
    opt = torch.optim.Adam(module.parameters(), lr=lr, weight_decay=weight_decay)
    Xt = torch.as_tensor(X)
    yt = torch.as_tensor(y, dtype=Xt.dtype).reshape(-1, 1)
    for _ in range(steps):
        opt.zero_grad()
        torch.nn.functional.mse_loss(module(Xt), yt).backward()
        opt.step()
    return module


@pytest.mark.parametrize("kind", ["skorch", "frozen", "module", "briefly_trained", "default"])
def test_trained_nets_do_not_warn(kind, reg_data, reg_net):
    if kind == "briefly_trained":  # 20 Adam steps suffice to leave the initial range
        with torch.random.fork_rng():
            torch.manual_seed(0)
            net = _train_module(MLP(3, 1, (32,), dtype=torch.float64), reg_data.X, reg_data.y, 20)
    else:
        net = {"skorch": reg_net, "frozen": FrozenEstimator(reg_net), "module": reg_net.module_,
               "default": None}[kind]
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        LLARegressor(net, device="cpu", random_state=0).fit(reg_data.X, reg_data.y)
    assert not _untrained_warnings(record)


def test_looks_freshly_initialised_evidence():
    with torch.random.fork_rng():
        torch.manual_seed(0)
        fresh = MLP(3, 1, (32,), dtype=torch.float64)
        conv = nn.Sequential(nn.Conv2d(1, 8, 3), nn.Flatten(), nn.Linear(8 * 4 * 4, 2))
        normed = nn.Sequential(nn.Linear(4, 32), nn.LayerNorm(32), nn.Tanh(), nn.Linear(32, 1))
    assert looks_freshly_initialised(fresh)
    assert looks_freshly_initialised(conv)
    assert looks_freshly_initialised(normed)
    # too few weights to tell: a 3 -> 8 -> 1 MLP (24 and 8 weights) is never flagged
    assert not looks_freshly_initialised(MLP(3, 1, (8,)))
    # a weight past the bound, or everything shrunk (weight decay), means trained
    grown, shrunk, renormed = copy.deepcopy(fresh), copy.deepcopy(fresh), copy.deepcopy(normed)
    with torch.no_grad():
        grown.layers[2].weight[0, 0] = 1.01 / np.sqrt(32)
        for p in shrunk.parameters():
            p.mul_(0.8)
        renormed[1].weight[0] = 1.5
    assert not looks_freshly_initialised(grown)
    assert not looks_freshly_initialised(shrunk)
    assert not looks_freshly_initialised(renormed)
    # another initialisation scheme is not recognised (the warning can miss; it says so)
    xavier = copy.deepcopy(fresh)
    for m in xavier.modules():
        if isinstance(m, nn.Linear):
            nn.init.xavier_normal_(m.weight)
    assert not looks_freshly_initialised(xavier)


@pytest.mark.parametrize("cls, pattern", [
    (MLP, r"got the class sklearn_lla\.nets\.MLP itself: pass a trained instance"),
    (skorch.NeuralNetRegressor,
     r"got the class skorch\.regressor\.NeuralNetRegressor itself: pass an instance"),
    (FrozenEstimator, r"got the class sklearn\.frozen\._frozen\.FrozenEstimator itself"),
])
def test_class_instead_of_instance_names_the_class(cls, pattern, reg_data):
    with pytest.raises(TypeError, match=pattern):
        LLARegressor(cls, device="cpu").fit(reg_data.X, reg_data.y)


def test_bad_net_type_names_value_and_type(reg_data):
    with pytest.raises(TypeError, match=r"got 'abc' of type str$"):
        LLARegressor("abc", device="cpu").fit(reg_data.X, reg_data.y)
