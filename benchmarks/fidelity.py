"""Fidelity to exact LLA: KL(exact || method) of the latent predictive, every estimator.

Two small problems where exact LLA is cheap:

* ``gap`` (regression): the 1-D toy with a gap of the papers' figures, 80 points in
  [-2, -0.7] U [0.7, 2], ``y = sin 2x + 0.1 eps``, a 1-16-16-1 tanh MLP (float64)
  trained by skorch; queries: 61 points on [-3, 3] (inside the data, the gap and
  beyond);
* ``blobs`` (classification): 3 Gaussian blobs in 2-D (150 points), a 2-16-16-3 tanh
  MLP trained by skorch; queries: a 15 x 15 grid over the data's box plus margins;
* ``wiggle`` (regression): 80 points in [-2, -0.7] U [0.7, 2], ``y = x sin 3x +
  0.15 eps``, a 1-24-24-1 tanh MLP (float32) trained by full-batch Adam without
  weight decay, ``s0^2 = 0.5``, ``s2 = 0.0225``; queries: 161 points on [-4, 4].

On the regression problems VaLLA is also run with ``n_inducing=20`` (fewer inducing
pairs than rows, where its three ``covariance`` models differ) in each covariance.

Every registered configuration (``sklearn_lla._registry.ESTIMATORS``) is fitted on the
same net with the hyperparameters fixed to those of exact LLA (``prior_variance``
and, for regression, ``noise_variance``, where the estimator has them; FMGP learns
its own kernel and so is *not* an approximation of LLA: its row measures how far
its posterior is from LLA's, not an error) and all other parameters at their
defaults. laplace-torch's KFAC and diagonal LLA with the same prior precision and
noise are the peers. The score is the mean over query points of
``KL(N(0, S_exact(x)) || N(0, S_method(x)))`` of the C x C latent covariances (the
means are the network's output in every method), and fit time.

Usage::

    python benchmarks/fidelity.py [--problems gap,blobs] [--out docs/fidelity_table.md]
"""

from __future__ import annotations

import argparse
import copy
import inspect
import math
import os
import sys
import time
import traceback
import warnings

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import markdown_table, set_threads  # noqa: E402

#: (prior variance, noise variance) of each problem
HYPER = {"gap": (1.0, 0.01), "blobs": (1.0, None), "wiggle": (0.5, 0.0225)}
S0, S2 = HYPER["gap"]


def gap_problem():
    """The 1-D regression toy with a gap and its skorch net."""
    import skorch

    from sklearn_lla.nets import MLP

    rng = np.random.RandomState(0)
    X = np.concatenate([rng.uniform(-2, -0.7, 40), rng.uniform(0.7, 2, 40)])[:, None]
    y = np.sin(2 * X[:, 0]) + 0.1 * rng.randn(80)
    net = skorch.NeuralNetRegressor(
        MLP, module__n_features=1, module__n_outputs=1, module__hidden_layer_sizes=(16, 16),
        module__dtype=torch.float64, optimizer=torch.optim.Adam, lr=1e-2,
        optimizer__weight_decay=1e-4, max_epochs=300, train_split=None, verbose=0)
    torch.manual_seed(0)
    net.fit(X, y[:, None])
    return X, y, net, np.linspace(-3, 3, 61)[:, None]


def blobs_problem():
    """Three 2-D Gaussian blobs and a skorch classifier."""
    import skorch
    from sklearn.datasets import make_blobs

    from sklearn_lla.nets import MLP

    X, y = make_blobs(150, centers=3, cluster_std=1.2, random_state=0)
    X = (X - X.mean(0)) / X.std(0)
    net = skorch.NeuralNetClassifier(
        MLP, module__n_features=2, module__n_outputs=3, module__hidden_layer_sizes=(16, 16),
        module__dtype=torch.float64, criterion=torch.nn.CrossEntropyLoss,
        optimizer=torch.optim.Adam, lr=1e-2, optimizer__weight_decay=1e-4, max_epochs=200,
        train_split=None, verbose=0)
    torch.manual_seed(0)
    net.fit(X, y)
    g = np.linspace(-2.5, 2.5, 15)
    Xq = np.stack(np.meshgrid(g, g), -1).reshape(-1, 2)
    return X, y, net, Xq


def latent_cov(est, Xq):
    """Latent C x C covariances (float64 numpy) of a fitted estimator at ``Xq``."""
    lin = est.linearized_net_
    x = torch.as_tensor(np.asarray(Xq), dtype=lin.dtype, device=lin.device)
    return est.posterior_.predict(x).cov.double().cpu().numpy()


def mean_kl(Sp, Sq, rel_jitter=1e-10):
    """Mean over points of KL(N(0, Sp) || N(0, Sq)) for (B, C, C) stacks."""
    C = Sp.shape[-1]
    eye = np.eye(C)
    out = []
    for p, q in zip(Sp, Sq):
        j = rel_jitter * max(np.trace(p), np.trace(q), 1e-300) / C
        p, q = p + j * eye, q + j * eye
        sol = np.linalg.solve(q, p)
        out.append(0.5 * (np.trace(sol) - C - np.linalg.slogdet(sol)[1]))
    return float(np.mean(out))


def wiggle_problem():
    """The 1-D gap problem of issue 32: ``x sin 3x``, a net trained without decay."""
    from sklearn_lla.nets import MLP

    rng = np.random.RandomState(0)
    X = np.concatenate([rng.uniform(-2, -0.7, 40), rng.uniform(0.7, 2, 40)])[:, None]
    y = X[:, 0] * np.sin(3 * X[:, 0]) + 0.15 * rng.randn(80)
    torch.manual_seed(0)
    module = MLP(1, 1, hidden_layer_sizes=(24, 24))
    opt = torch.optim.Adam(module.parameters(), lr=1e-2)
    xt = torch.as_tensor(X, dtype=torch.float32)
    yt = torch.as_tensor(y[:, None], dtype=torch.float32)
    for _ in range(2000):
        opt.zero_grad()
        ((module(xt) - yt) ** 2).mean().backward()
        opt.step()
    return (X.astype(np.float32), y, module, np.linspace(-4, 4, 161)[:, None]
            .astype(np.float32))


def laplace_torch_cov(net, X, y, Xq, task, structure):
    """laplace-torch's LLA latent covariances (function space, GLM predictive)."""
    from laplace import Laplace
    from torch.utils.data import DataLoader, TensorDataset

    model = copy.deepcopy(getattr(net, "module_", net)).double()
    for p in model.parameters():
        p.requires_grad_(True)
    lik = "regression" if task == "regression" else "classification"
    kw = dict(sigma_noise=math.sqrt(S2)) if task == "regression" else {}
    la = Laplace(model, lik, subset_of_weights="all", hessian_structure=structure,
                 prior_precision=1.0 / S0, **kw)
    yt = torch.as_tensor(y[:, None] if task == "regression" else y)
    X64, Xq64 = (torch.as_tensor(np.asarray(a, dtype=np.float64)) for a in (X, Xq))
    la.fit(DataLoader(TensorDataset(X64, yt), batch_size=32))
    f_mu, f_var = la._glm_predictive_distribution(Xq64)
    f_var = f_var.detach().numpy()
    return f_var.reshape(len(Xq), 1, 1) if task == "regression" else f_var


def fixed_params(cls, task):
    sig = inspect.signature(cls.__init__).parameters
    kw = {}
    if "prior_variance" in sig:
        kw["prior_variance"] = S0
    if task == "regression" and "noise_variance" in sig:
        kw["noise_variance"] = S2
    if "device" in sig:
        kw["device"] = "cpu"
    if "random_state" in sig:
        kw["random_state"] = 0
    return kw


def _configurations(task):
    """``(label, class, parameters)``: every registered configuration; in regression,
    VaLLA with 20 inducing pairs in each covariance model too."""
    from sklearn_lla import VaLLARegressor
    from sklearn_lla._registry import ESTIMATORS

    out = [(e.id, e.cls, e.params) for e in ESTIMATORS
           if e.is_classifier == (task == "classification")]
    if task == "regression":
        for cov in ("subspace+diagonal", "subspace", "full"):
            out.append((f"VaLLARegressor[n_inducing=20, {cov}]", VaLLARegressor,
                        {"n_inducing": 20, "covariance": cov}))
    return out


def run_problem(name):
    global S0, S2
    from sklearn_lla import LLAClassifier, LLARegressor

    S0, S2 = HYPER[name]
    task = "classification" if name == "blobs" else "regression"
    X, y, net, Xq = {"gap": gap_problem, "blobs": blobs_problem,
                     "wiggle": wiggle_problem}[name]()
    exact_cls = LLARegressor if task == "regression" else LLAClassifier
    exact_net = copy.deepcopy(getattr(net, "module_", net)).double()  # the reference
    exact = exact_cls(exact_net, **fixed_params(exact_cls, task)).fit(
        np.asarray(X, dtype=np.float64), y)
    S_exact = latent_cov(exact, np.asarray(Xq, dtype=np.float64))
    rows = []
    for label, cls, params in _configurations(task):
        try:
            est = cls(net, **params, **fixed_params(cls, task))
            t0 = time.perf_counter()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                est.fit(X, y)
            dt = time.perf_counter() - t0
            kl = mean_kl(S_exact, latent_cov(est, Xq))
            rows.append([label, f"{kl:.4g}", f"{dt:.2f}"])
        except Exception as exc:  # report, keep going
            traceback.print_exc()
            rows.append([label, f"error: {type(exc).__name__}", "-"])
        print(rows[-1], flush=True)
    for structure in ("kron", "diag"):
        label = f"laplace-torch {structure} (peer)"
        try:
            t0 = time.perf_counter()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                S = laplace_torch_cov(net, X, y, Xq, task, structure)
            dt = time.perf_counter() - t0
            rows.append([label, f"{mean_kl(S_exact, S):.4g}", f"{dt:.2f}"])
        except Exception as exc:
            traceback.print_exc()
            rows.append([label, f"error: {type(exc).__name__}", "-"])
        print(rows[-1], flush=True)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--problems", default="gap,blobs,wiggle")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    set_threads(args.threads)
    text = []
    for name in args.problems.split(","):
        rows = run_problem(name)
        head = f"### {name} (s0^2 = {S0}" + (f", s2 = {S2})" if S2 is not None else ")")
        table = markdown_table(["estimator", "mean KL(exact || method)", "fit (s)"], rows)
        text.append(head + "\n\n" + table)
        print("\n" + text[-1], flush=True)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write("\n\n".join(text) + "\n")


if __name__ == "__main__":
    main()
