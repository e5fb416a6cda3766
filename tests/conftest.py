"""Shared fixtures: small pretrained skorch nets (built once per session) and an
independent dense float64 reference implementation of the exact GGN linearized Laplace.

The reference deliberately shares no code with ``sklearn_lla``: the Jacobian is taken
with ``torch.func.jacrev`` of a function of the *flat* parameter vector of a float64
deep copy of the module, the GGN is summed with ``numpy.einsum`` and the posterior
covariance is a plain ``scipy.linalg.inv``.
"""

from __future__ import annotations

import copy
import math
import os
from types import SimpleNamespace

import numpy as np
import pytest
import scipy.linalg
import scipy.special
import skorch
import torch
from sklearn.datasets import make_blobs
from torch import nn
from torch.func import functional_call, jacrev

from sklearn_lla.nets import MLP

# Under pytest-xdist each worker gets its own process: one torch thread each avoids
# oversubscribing the cores (the tiny matrices here gain nothing from threads).
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)

# ---------------------------------------------------------------------------------
# Modules used by the tests (defined here, importable as ``conftest.X`` for pickling)
# ---------------------------------------------------------------------------------


class SoftmaxMLP(nn.Module):
    """MLP whose forward ends in a softmax: skorch's default (NLLLoss) classifier setup."""

    def __init__(self, n_features=2, n_outputs=3, hidden_layer_sizes=(16,), dtype=torch.float64):
        super().__init__()
        self.mlp = MLP(n_features, n_outputs, hidden_layer_sizes, dtype=dtype)

    def forward(self, x):
        return torch.softmax(self.mlp(x), dim=-1)


class SingleLogitMLP(nn.Module):
    """MLP with one output squeezed to shape (B,): skorch's NeuralNetBinaryClassifier."""

    def __init__(self, n_features=2, hidden_layer_sizes=(16,), dtype=torch.float64):
        super().__init__()
        self.mlp = MLP(n_features, 1, hidden_layer_sizes, dtype=dtype)

    def forward(self, x):
        return self.mlp(x).squeeze(-1)


class TinyCNN(nn.Module):
    """4 x 4 images (16 features): Conv2d + BatchNorm + ReLU, a residual block
    (Conv2d + BatchNorm added to its input), average pooling, a linear head."""

    def __init__(self, n_outputs=3, channels=3):
        super().__init__()
        self.stem = nn.Sequential(nn.Unflatten(1, (1, 4, 4)), nn.Conv2d(1, channels, 3, padding=1),
                                  nn.BatchNorm2d(channels), nn.ReLU())
        self.conv = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(channels)
        self.head = nn.Sequential(nn.AvgPool2d(2), nn.Flatten(), nn.Linear(4 * channels, n_outputs))

    def forward(self, x):
        h = self.stem(x)
        h = torch.relu(h + self.bn(self.conv(h)))
        return self.head(h)


# ---------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------

N_REG = 60  # P = 3*16 + 16 + 16 + 1 = 81 > N*C = 60: "auto" picks function space
N_REG2 = 50  # P = 172 (3 -> 10 -> 10 -> 2), N*C = 100
N_CLF = 90  # P = 2*16 + 16 + 16*3 + 3 = 99 < N*C = 270: "auto" picks parameter space


def _sin_data(n, n_test, n_targets, seed):
    rng = np.random.RandomState(seed)
    X = rng.uniform(-2.0, 2.0, (n + n_test, 3))
    w = np.array([1.0, 0.5, -0.3])
    z = X @ w
    if n_targets == 1:
        y = np.sin(z) + 0.1 * rng.randn(n + n_test)
    else:
        y = np.column_stack([np.sin(z), np.cos(X[:, 1])]) + 0.1 * rng.randn(n + n_test, 2)
    return SimpleNamespace(X=X[:n], y=y[:n], X_test=X[n:], y_test=y[n:])


@pytest.fixture(scope="session")
def reg_data():
    """3-D inputs, 1 target (y of shape (n,))."""
    return _sin_data(N_REG, 20, 1, seed=0)


@pytest.fixture(scope="session")
def reg2_data():
    """3-D inputs, 2 targets (y of shape (n, 2))."""
    return _sin_data(N_REG2, 15, 2, seed=1)


@pytest.fixture(scope="session")
def clf_data():
    X, y = make_blobs(n_samples=N_CLF + 30, centers=3, n_features=2, cluster_std=0.9,
                      random_state=0)
    return SimpleNamespace(X=X[:N_CLF], y=y[:N_CLF], X_test=X[N_CLF:], y_test=y[N_CLF:])


# ---------------------------------------------------------------------------------
# Pretrained skorch nets (trained once per session, seeded without touching the
# global RNG state)
# ---------------------------------------------------------------------------------


def _train(net, X, y, seed):
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        net.fit(X, y)
    return net


def _make_skorch(cls, criterion, n_features, n_outputs, hidden, max_epochs, kw):
    params = dict(
        module=MLP,
        module__n_features=n_features,
        module__n_outputs=n_outputs,
        module__hidden_layer_sizes=hidden,
        module__dtype=torch.float64,
        criterion=criterion,
        optimizer=torch.optim.Adam,
        lr=1e-2,
        optimizer__weight_decay=1e-4,
        max_epochs=max_epochs,
        train_split=None,
        verbose=0,
    )
    params.update(kw)
    return cls(**params)


def make_skorch_regressor(n_features, n_outputs, hidden=(16,), max_epochs=100, **kw):
    return _make_skorch(skorch.NeuralNetRegressor, nn.MSELoss, n_features, n_outputs, hidden,
                        max_epochs, kw)


def make_skorch_classifier(n_features, n_classes, hidden=(16,), max_epochs=100, **kw):
    return _make_skorch(skorch.NeuralNetClassifier, nn.CrossEntropyLoss, n_features, n_classes,
                        hidden, max_epochs, kw)


@pytest.fixture(scope="session")
def reg_net(reg_data):
    """Fitted float64 NeuralNetRegressor MLP(3, 1, (16,)). Treat as read-only."""
    net = make_skorch_regressor(3, 1, (16,))
    return _train(net, reg_data.X, reg_data.y.reshape(-1, 1), seed=0)


@pytest.fixture(scope="session")
def reg2_net(reg2_data):
    """Fitted float64 NeuralNetRegressor MLP(3, 2, (10, 10)). Treat as read-only."""
    net = make_skorch_regressor(3, 2, (10, 10))
    return _train(net, reg2_data.X, reg2_data.y, seed=1)


@pytest.fixture(scope="session")
def clf_net(clf_data):
    """Fitted float64 NeuralNetClassifier (CrossEntropyLoss, logits). Treat as read-only."""
    net = make_skorch_classifier(2, 3, (16,))
    return _train(net, clf_data.X, clf_data.y, seed=2)


@pytest.fixture(scope="session")
def cnn_cases():
    """``{task: (X, y, X_test, fitted skorch TinyCNN)}`` for "classification" (3
    classes) and "regression" (one target); float32 nets. Treat as read-only."""
    rng = np.random.RandomState(3)
    X = rng.randn(60, 16).astype(np.float32)
    Xt = rng.randn(10, 16).astype(np.float32)
    w = rng.randn(16)
    y_clf = (np.digitize(X @ w, np.quantile(X @ w, [1 / 3, 2 / 3]))).astype(np.int64)
    y_reg = np.sin(X @ w / 4).astype(np.float32).reshape(-1, 1)
    out = {}
    for task, y, cls, crit, C in (
            ("classification", y_clf, skorch.NeuralNetClassifier, nn.CrossEntropyLoss, 3),
            ("regression", y_reg, skorch.NeuralNetRegressor, nn.MSELoss, 1)):
        net = cls(module=TinyCNN, module__n_outputs=C, criterion=crit,
                  optimizer=torch.optim.Adam, lr=1e-2, max_epochs=30, batch_size=20,
                  train_split=None, verbose=0)
        _train(net, X, y, seed=4)
        out[task] = (X, y.reshape(-1) if task == "regression" else y, Xt, net)
    return out


# ---------------------------------------------------------------------------------
# Independent dense reference
# ---------------------------------------------------------------------------------


@pytest.fixture
def case(request, reg_data, reg_net, clf_data, clf_net):
    """``(X, y, X_test, pretrained skorch net)`` matching the task of the test's
    ``entry`` parameter (a :class:`sklearn_lla._registry.Entry`)."""
    entry = request.getfixturevalue("entry")
    if entry.is_classifier:
        return clf_data.X, clf_data.y, clf_data.X_test, clf_net
    return reg_data.X, reg_data.y, reg_data.X_test, reg_net


def estimator_outputs(est, X):
    """What a fitted estimator predicts: ``(mean, std)`` or ``(probabilities,)``."""
    from sklearn.base import is_classifier

    if is_classifier(est):
        return (est.predict_proba(X),)
    return est.predict(X, return_std=True)


def dense_module(module):
    """A float64, eval-mode deep copy of ``module`` (the original is untouched)."""
    mod = copy.deepcopy(module).double().eval()
    for p in mod.parameters():
        p.requires_grad_(False)
    return mod


def flat_params(module):
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()]).double()


def dense_jacobian(module, X, transform="identity"):
    """``(g(X), J(X))`` as float64 numpy arrays of shapes (N, C) and (N, C, P).

    ``transform``: ``"identity"`` (logits / regression outputs) or ``"log"`` (module
    outputs probabilities; the latent is their logarithm).
    """
    mod = dense_module(module)
    names = [n for n, _ in mod.named_parameters()]
    shapes = [p.shape for _, p in mod.named_parameters()]
    sizes = [p.numel() for _, p in mod.named_parameters()]
    buffers = dict(mod.named_buffers())
    theta = flat_params(mod)
    Xt = torch.as_tensor(np.asarray(X, dtype=np.float64))

    def g(th):
        params, i = {}, 0
        for n, s, k in zip(names, shapes, sizes):
            params[n] = th[i:i + k].reshape(s)
            i += k
        out = functional_call(mod, (params, buffers), (Xt,))
        out = out.reshape(Xt.shape[0], -1)
        if transform == "log":
            out = torch.log(out)
        return out

    with torch.no_grad():
        f = g(theta)
    J = jacrev(g)(theta)
    return f.numpy(), J.detach().numpy()


def softmax(f):
    z = f - f.max(axis=-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=-1, keepdims=True)


def dense_reference(module, X, y, X_test, task, prior_variance, noise_variance=None,
                    transform="identity"):
    """Exact GGN Laplace, dense float64, independent of ``sklearn_lla``.

    Returns a namespace with the GGN (without prior), its eigenvalues, the posterior
    covariance, test means and latent covariance blocks ``S`` (B, C, C), the joint
    test covariance (B*C, B*C), the Laplace log evidence (by ``slogdet``) and the
    ingredients of the closed form (``theta_sq``, ``rss`` / ``log_lik``).
    """
    s0 = float(prior_variance)
    f, J = dense_jacobian(module, X, transform)
    N, C, P = J.shape
    if task == "regression":
        s2 = float(noise_variance)
        y2 = np.asarray(y, dtype=np.float64).reshape(N, -1)
        Lam = np.broadcast_to(np.eye(C) / s2, (N, C, C))
        rss = float(((y2 - f) ** 2).sum())
        log_lik = -0.5 * N * C * math.log(2 * math.pi * s2) - 0.5 * rss / s2
        # eigenvalues of the unit-noise GGN J^T J (what the closed form takes)
        eig_unit = scipy.linalg.eigvalsh(np.einsum("nci,ncj->ij", J, J))
    else:
        p = softmax(f)
        Lam = np.einsum("nc,cd->ncd", p, np.eye(C)) - np.einsum("nc,nd->ncd", p, p)
        logp = f - scipy.special.logsumexp(f, axis=1, keepdims=True)
        log_lik = float(logp[np.arange(N), np.asarray(y)].sum())
        rss = None
        eig_unit = None
    GGN = np.einsum("nci,ncd,ndj->ij", J, Lam, J)
    GGN = 0.5 * (GGN + GGN.T)
    H = GGN + np.eye(P) / s0
    Sigma = scipy.linalg.inv(H)
    Sigma = 0.5 * (Sigma + Sigma.T)
    theta = flat_params(dense_module(module)).numpy()
    theta_sq = float(theta @ theta)
    sign, logdet_H = np.linalg.slogdet(H)
    assert sign > 0
    # log Z = log p(y|theta) - |theta|^2 / (2 s0) - 1/2 [log det H - log det (I / s0)]
    evidence = log_lik - 0.5 * theta_sq / s0 - 0.5 * (logdet_H + P * math.log(s0))
    out = SimpleNamespace(
        f=f, J=J, GGN=GGN, eig=scipy.linalg.eigvalsh(GGN), eig_unit=eig_unit, H=H,
        Sigma=Sigma, theta_sq=theta_sq, rss=rss, log_lik=log_lik, evidence=evidence,
        N=N, C=C, P=P,
    )
    if X_test is not None:
        fs, Js = dense_jacobian(module, X_test, transform)
        B = Js.shape[0]
        Jflat = Js.reshape(B * C, P)
        joint = Jflat @ Sigma @ Jflat.T
        joint = 0.5 * (joint + joint.T)
        idx = np.arange(B)
        out.f_test = fs
        out.J_test = Js
        out.joint = joint
        out.S = joint.reshape(B, C, B, C)[idx, :, idx, :]
    return out


@pytest.fixture(scope="session")
def dense_ref():
    """The dense reference helpers, as a namespace (``dense_ref.reference(...)``)."""
    return SimpleNamespace(
        reference=dense_reference,
        jacobian=dense_jacobian,
        module=dense_module,
        flat_params=flat_params,
        softmax=softmax,
    )


def state_snapshot(module):
    """Deep copies of every parameter and buffer, plus training flags and requires_grad."""
    return SimpleNamespace(
        state={k: v.detach().clone() for k, v in module.state_dict().items()},
        training=[m.training for m in module.modules()],
        requires_grad=[p.requires_grad for p in module.parameters()],
    )


def assert_module_unchanged(module, snap):
    state = module.state_dict()
    assert set(state) == set(snap.state)
    for k, v in snap.state.items():
        assert state[k].dtype == v.dtype, k
        assert torch.equal(state[k], v), f"{k} was modified"
    assert [m.training for m in module.modules()] == snap.training
    assert [p.requires_grad for p in module.parameters()] == snap.requires_grad


@pytest.fixture(scope="session")
def module_guard():
    """``module_guard.snapshot(module)`` / ``module_guard.check(module, snap)``."""
    return SimpleNamespace(snapshot=state_snapshot, check=assert_module_unchanged)
