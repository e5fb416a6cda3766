"""The authors' VaLLA / FMGP code against ours on the NYC flights table (issue 36 part 4).

Why does VaLLA gain 0.16 nats over the MAP net on the papers' Airline set (4.923 against
5.087) and nothing on ``load_airline_nyc``? This script runs the authors' own code on our
net and our split, next to ``VaLLARegressor`` / ``FMGPRegressor``, and the controlled
variants that isolate the difference. It is a benchmark, not part of the library: nothing
imports it, and the authors' code is imported from a checkout given on the command line,
never copied here.

The authors' code (public GitHub repositories of L. A. Ortega, user ``Ludvins``):

* ``BayesiPy`` (``bayesipy.laplace.valla.src.VaLLA``, ``bayesipy.fmgp.FMGP``): the
  packaged VaLLA (BackPACK Jacobians) and FMGP; needs ``backpack-for-pytorch``,
  ``laplace-torch`` (for ``CurvatureInterface``) and ``properscoring``;
* ``Variational-LLA`` (``src/valla.py``: ``VaLLARegression`` with an ``alpha``, and
  ``utils/models.py``: ``create_ad_hoc_mlp``, the closed-form MLP Jacobians): the code
  that wrote the paper's result CSVs (``results/VaLLA_dataset=Airline_M=100_*``).

Their data files (``airline.csv``) are Git LFS objects that are not in the public
snapshots, so their loaders cannot run; the driver feeds their classes our rows instead.

Setup and run (CPU, one thread; about an hour for everything on a loaded 2-core
machine; ``--methods`` runs a subset, results accumulate in ``--out-dir`` and
``--report`` prints the table from what is there)::

    # the authors' code, outside any git work tree
    git clone https://github.com/Ludvins/BayesiPy /work/authors-code/BayesiPy
    git clone https://github.com/Ludvins/Variational-LLA /work/authors-code/Variational-LLA
    # a separate venv that sees the project's packages, plus properscoring
    python -m venv /work/authors-venv
    echo "$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" \\
        > /work/authors-venv/lib/python3.11/site-packages/main_venv.pth
    /work/authors-venv/bin/pip install properscoring
    OMP_NUM_THREADS=1 /work/authors-venv/bin/python benchmarks/authors_airline.py \\
        --code /work/authors-code/BayesiPy --code /work/authors-code/Variational-LLA

What runs on the same rows (``_airline_nyc.py``'s split for ``--seed``, its cached net: the
skorch 3 x 200 tanh MLP trained on 221,821 rows; fit rows: its ``--subsample`` draw,
50,000 by default, ``--subsample 0`` = all 221,821; validation: ``--val-rows`` of its
24,647 held-out rows (2,000 by default); test: its 27,385 test rows (``--test-rows`` a
random subset: BayesiPy's VaLLA predicts through BackPACK Jacobians, slow here; every
method is scored on the same rows; heavy tails make the NLL of a 10,000-row subset move
by 0.02 nats, so compare methods on the same rows only)):

* ``raw``: the net with one std: the residual RMS of the fit rows (b) and of the held-out
  rows (c); the papers' MAP rule (noise variance ``y_std^2 exp(v)``, ``v`` in -5..1 chosen
  by validation NLL: ``Variational-LLA/scripts/regression/map.py``); the best constant
  std for the test rows themselves (their RMSE: a floor no constant std can beat);
* ``bayesipy-valla``: their packaged VaLLA with the paper's settings: 100 k-means
  inducing points, batch 100, Adam lr 1e-3, learned prior / noise / inducing points /
  factor, alpha = 1 (hard-coded there), early stopping on the validation NLL every 100
  steps (stop at the first check that does not improve; their ``fit``'s rule);
* ``vlla-valla-a1`` / ``vlla-valla-a0``: the paper's own ``VaLLARegression``
  (Variational-LLA) at alpha = 1 (the paper's runs) and alpha = 0 (the ELBO), the same
  early stopping; everything else equal: the controlled run for the objective;
  ``vlla-valla-a1-noes``: alpha = 1 without early stopping (the script's own loop, up to
  ``--max-steps`` or ``--time-limit``; the validation NLL is only recorded);
* ``bayesipy-fmgp-es`` / ``bayesipy-fmgp-b``: their FMGP (RBF kernel, 100 k-means
  inducing points, noise started at exp(-5), the surrogate regulariser, lr 1e-3, batch
  100) with the same early stopping, and without it for ``--fmgp-steps`` steps (the
  paper: 70,000; situation (b) has no validation rows);
* ``ours-valla-b`` / ``ours-valla-c``, ``ours-fmgp-b`` / ``ours-fmgp-c``: the defaults,
  ``fit(X, y)`` and ``fit(X, y, validation_data=held)``; ``ours-fmgp-b-resid``: (b) with
  the noise variance fixed at the fit rows' mean squared residual (the noise rule
  controlled);
* ``ours-valla-paper`` / ``ours-valla-paper-a0``: ``VaLLARegressor`` set as the paper:
  ``n_inducing=100, covariance="full", init="identity", learn_inducing=True,
  stopping="auto"`` with the validation rows, alpha 1 and 0 (ours then calibrates the
  noise on those rows, which the paper does not); ``ours-valla-paper-b``: the same at
  alpha 1 without validation rows (early stopping on the objective, the noise the
  objective learned, no calibration); ``ours-valla-their-hypers``: ``covariance="full"``,
  100 inducing pairs, alpha 1, with the prior and noise variances fixed at the values
  the authors' fit learned (``--their-prior``, ``--their-noise``);
* ``ntk-diag-std``: no posterior at all: the net with ``std(x)^2 = a k(x) (+ b)``,
  ``k(x) = ||d g(x) / d theta||^2`` the NTK diagonal, ``a`` (and ``b``) chosen by
  validation NLL: the variance VaLLA's predictive tends to when its noise collapses;
* ``hetero-gbm``: a yardstick, no posterior either: the net with a variance regressed by
  gradient boosting (``log r^2`` on half of the held-out rows, a scale on the other
  half): what an input-dependent Gaussian std can gain on this table.

Printed per method: test NLL / CRPS / CQM / 90 % coverage and width (minutes), the
spread of the predictive std (p10 / p50 / p90), the learned noise variance in min^2, the
steps run and the fit time.
"""

from __future__ import annotations

import argparse
import copy
import glob
import json
import os
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(1, os.path.dirname(HERE))  # this checkout's sklearn_lla

import _airline_nyc as A  # noqa: E402  (benchmarks/ on the path first)

METHODS = ("raw", "ntk-diag-std", "bayesipy-valla", "vlla-valla-a1", "vlla-valla-a0",
           "vlla-valla-a1-noes", "bayesipy-fmgp-es", "bayesipy-fmgp-b", "ours-valla-b",
           "ours-valla-c", "ours-valla-paper", "ours-valla-paper-a0", "ours-valla-paper-b",
           "ours-valla-their-hypers", "ours-fmgp-b", "ours-fmgp-c", "ours-fmgp-b-resid",
           "hetero-gbm")
M_INDUCING, BATCH, LR, VAL_EVERY = 100, 100, 1e-3, 100


# ------------------------------------------------------------------------- data
def load_problem(args):
    """Our split, net and fit rows (as ``_airline_nyc.main``), plus float64 tensors."""
    import torch

    sp = A.load_splits("none", args.seed, None)
    X_tr, y_tr = sp["train"]
    path, _, _ = A.train_or_load(X_tr, y_tr, "none", args.seed, args.iterations)
    net = A.load_net(path)
    rng = np.random.default_rng(args.seed + 1)
    n_fit = min(args.subsample or len(y_tr), len(y_tr))
    idx = np.sort(rng.choice(len(y_tr), n_fit, replace=False))
    X_held, y_held = sp["held"]
    vrng = np.random.default_rng(args.seed + 2)
    vidx = (np.sort(vrng.choice(len(y_held), args.val_rows, replace=False))
            if args.val_rows and args.val_rows < len(y_held) else np.arange(len(y_held)))
    X_te, y_te = sp["test"]
    if args.test_rows and args.test_rows < len(y_te):
        tidx = np.sort(np.random.default_rng(args.seed + 3).choice(len(y_te), args.test_rows,
                                                                  replace=False))
        X_te, y_te = X_te[tidx], y_te[tidx]
    mod = net.module_
    stats = {k: getattr(mod, k).detach().double().numpy() for k in
             ("x_mean", "x_scale", "y_mean", "y_scale")}
    # The authors' code wants the net on standardised inputs and targets (their datasets
    # standardise both with training statistics): the same layers, in float64.
    std_net = copy.deepcopy(mod.layers).double().eval()
    for p in std_net.parameters():
        p.requires_grad_(True)
    return dict(net=net, std_net=std_net, stats=stats, fit=(X_tr[idx], y_tr[idx]),
                held=(X_held, y_held), val=(X_held[vidx], y_held[vidx]), test=(X_te, y_te),
                n_net=len(y_tr), torch=torch)


def standardise(P, X, y=None):
    torch = P["torch"]
    s = P["stats"]
    Xs = torch.as_tensor((X - s["x_mean"]) / s["x_scale"], dtype=torch.float64)
    if y is None:
        return Xs
    ys = torch.as_tensor(((y - s["y_mean"][0]) / s["y_scale"][0]).reshape(-1, 1),
                         dtype=torch.float64)
    return Xs, ys


def loaders(P, shuffle_seed):
    from torch.utils.data import DataLoader, TensorDataset

    torch = P["torch"]
    g = torch.Generator().manual_seed(shuffle_seed)
    Xs, ys = standardise(P, *P["fit"])
    train = DataLoader(TensorDataset(Xs, ys), batch_size=BATCH, shuffle=True, generator=g)
    # Validation targets stay in minutes: their _validate compares predict() (minutes)
    # with the raw targets, as their Test_Dataset leaves test targets unscaled.
    Xv = standardise(P, P["val"][0])
    yv = torch.as_tensor(P["val"][1].reshape(-1, 1), dtype=torch.float64)
    val = DataLoader(TensorDataset(Xv, yv), batch_size=250)
    return train, val, Xs


def metrics(y, mean, std):
    d = A.metrics(y, dict(mean=mean, std=std))
    d.update(std_p10=float(np.percentile(std, 10)), std_p50=float(np.median(std)),
             std_p90=float(np.percentile(std, 90)))
    return d


# -------------------------------------------------------------- their training
def gaussian_nll_t(mean, var, y):
    torch = __import__("torch")
    return 0.5 * (np.log(2 * np.pi) + torch.log(var) + (y - mean) ** 2 / var)


def predict_theirs(model, X, batch=250):
    """``model.predict`` (minutes, variance) over ``X`` in batches -> mean, std arrays."""
    torch = __import__("torch")
    means, variances = [], []
    for i in range(0, len(X), batch):
        m, v = model.predict(X[i:i + batch])
        means.append(m.detach().reshape(-1))
        variances.append(v.detach().reshape(-1))
    with torch.no_grad():
        m, v = torch.cat(means).numpy(), torch.cat(variances).numpy()
    return m.astype(float), np.sqrt(v.astype(float))


def val_nll(model, val_loader):
    """Mean Gaussian NLL (minutes) of ``model.predict`` on the validation loader."""
    tot, n = 0.0, 0
    for X, y in val_loader:
        m, v = model.predict(X)
        tot += float(gaussian_nll_t(m.detach().reshape(-1), v.detach().reshape(-1),
                                    y.reshape(-1)).sum())
        n += len(y)
    return tot / n


def train_loop(model, train_loader, val_loader, max_steps, time_limit, early_stop=True):
    """Adam on ``model``'s parameters with their ``train_step``; their early-stopping rule.

    Their ``VaLLA.fit``: a validation NLL after step ``i`` whenever ``i % 100 == 0``
    (the first after step 0), and training stops at the first check that is not better
    than the best one; the state at that point (not the best) is kept. With
    ``early_stop=False`` the checks are only recorded.
    """
    torch = __import__("torch")
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    it = iter(train_loader)
    best, trace, t0, reason = np.inf, [], time.perf_counter(), "max_steps"
    step = 0
    for step in range(max_steps):
        try:
            X, y = next(it)
        except StopIteration:
            it = iter(train_loader)
            X, y = next(it)
        model.train()
        model.train_step(opt, X, y)
        if val_loader is not None and step % VAL_EVERY == 0:
            model.eval()
            cur = val_nll(model, val_loader)
            trace.append((step, round(cur, 5)))
            print(f"    step {step}: validation NLL {cur:.4f} "
                  f"({time.perf_counter() - t0:.0f} s)", flush=True)
            if cur < best:
                best = cur
            elif early_stop:
                reason = "early stopping"
                break
        if time.perf_counter() - t0 > time_limit:
            reason = f"time limit {time_limit:.0f} s"
            break
    model.eval()
    return dict(steps=step + 1, stop=reason, val_trace=trace[-8:])


def run_bayesipy_valla(P, args):
    from bayesipy.laplace.valla.src import VaLLA

    torch = P["torch"]
    torch.manual_seed(args.seed)
    train, val, _ = loaders(P, args.seed)
    s = P["stats"]
    # FixedMeanGaussianProcesses/scripts/regression/valla.py: noise started at exp(-5),
    # the prior precision at BayesiPy's default 1.
    model = VaLLA(copy.deepcopy(P["std_net"]), "regression", noise_variance=float(np.exp(-5)),
                  prior_precision=1.0, inducing_locations="kmeans", num_inducing=M_INDUCING,
                  y_mean=float(s["y_mean"][0]), y_std=float(s["y_scale"][0]), seed=args.seed)
    t = time.perf_counter()
    model.fit(iterations=0, lr=LR, train_loader=train, verbose=False)  # k-means, backend
    info = train_loop(model, train, val, args.max_steps, args.time_limit)
    fit_s = time.perf_counter() - t
    info.update(noise_var_min2=float(model.log_noise_variance.exp() * s["y_scale"][0] ** 2),
                prior_var=float(1 / model.log_prior_precision.exp()))
    return model, fit_s, info


def run_vlla_valla(P, args, alpha, early_stop=True):
    from scipy.cluster.vq import kmeans2
    from src.valla import VaLLARegression
    from utils.models import create_ad_hoc_mlp

    torch = P["torch"]
    torch.manual_seed(args.seed)
    train, val, Xs = loaders(P, args.seed)
    s = P["stats"]
    net = copy.deepcopy(P["std_net"])
    for p in net.parameters():
        p.requires_grad_(False)
    t = time.perf_counter()
    Z = kmeans2(Xs.numpy(), M_INDUCING, minit="points", seed=args.seed)[0]
    # scripts/regression/valla.py: prior_std 1, ll_log_var -5 (its defaults), the
    # Airline result files' alpha 1.0; everything but alpha is the same in both runs.
    model = VaLLARegression(create_ad_hoc_mlp(net), Z, prior_std=1.0, num_data=len(Xs),
                            output_dim=1, log_variance=-5.0, y_mean=float(s["y_mean"][0]),
                            y_std=float(s["y_scale"][0]), alpha=alpha,
                            dtype=torch.float64)
    model.predict = model.forward  # their forward returns mean, variance in minutes
    params = list(model.parameters(recurse=False))
    model.parameters = lambda *a, **k: iter(params)  # their script: parameters(recurse=False)
    info = train_loop(model, train, val, args.max_steps, args.time_limit, early_stop=early_stop)
    fit_s = time.perf_counter() - t
    info.update(noise_var_min2=float(model.log_variance.exp() * s["y_scale"][0] ** 2),
                prior_var=float(model.log_prior_std.exp() ** 2))
    return model, fit_s, info


def run_bayesipy_fmgp(P, args, early_stop):
    from bayesipy.fmgp import FMGP

    torch = P["torch"]
    torch.manual_seed(args.seed)
    train, val, _ = loaders(P, args.seed)
    s = P["stats"]
    # FixedMeanGaussianProcesses/scripts/regression/fmgp.py's settings.
    model = FMGP(model=copy.deepcopy(P["std_net"]), likelihood="regression", kernel="RBF",
                 inducing_locations="kmeans", num_inducing=M_INDUCING,
                 noise_variance=float(np.exp(-5)), subrogate_regularizer=True,
                 y_mean=float(s["y_mean"][0]), y_std=float(s["y_scale"][0]), seed=args.seed)
    t = time.perf_counter()
    model.fit(iterations=0, lr=LR, train_loader=train, verbose=False)  # k-means, kernel
    steps = args.max_steps if early_stop else args.fmgp_steps
    info = train_loop(model, train, val if early_stop else None, steps, args.time_limit,
                      early_stop=early_stop)
    fit_s = time.perf_counter() - t
    info.update(noise_var_min2=float(model.log_noise_variance.exp() * s["y_scale"][0] ** 2),
                amplitude=float(model.kernel.log_input_amplitude.exp()))
    if not early_stop:
        model.eval()
        info["val_nll_end"] = val_nll(model, val)
    return model, fit_s, info


# ----------------------------------------------------------------- our estimators
def run_ours(P, args, method):
    from sklearn_lla import FMGPRegressor, VaLLARegressor

    resid_var = float(np.mean((A.net_mean(P["net"], P["fit"][0]) - P["fit"][1]) ** 2))
    paper = dict(n_inducing=M_INDUCING, covariance="full", init="identity",
                 learn_inducing=True, stopping="auto", max_iter=args.max_steps)
    cls, kw, sit = {
        "ours-valla-b": (VaLLARegressor, {}, "b"),
        "ours-valla-c": (VaLLARegressor, {}, "c"),
        "ours-valla-paper": (VaLLARegressor, dict(paper, alpha=1.0), "c"),
        "ours-valla-paper-a0": (VaLLARegressor, dict(paper, alpha=0.0), "c"),
        "ours-valla-paper-b": (VaLLARegressor, dict(paper, alpha=1.0, stopping="objective"),
                               "b"),
        "ours-fmgp-b": (FMGPRegressor, {}, "b"),
        "ours-fmgp-c": (FMGPRegressor, {}, "c"),
        "ours-fmgp-b-resid": (FMGPRegressor, dict(noise_variance=resid_var), "b"),
        "ours-valla-their-hypers": (VaLLARegressor, dict(
            n_inducing=M_INDUCING, covariance="full", alpha=1.0,
            prior_variance=args.their_prior, noise_variance=args.their_noise), "b"),
    }[method]
    est = cls(P["net"], random_state=args.seed, **kw)
    fit_kw = {"validation_data": P["val"] if "paper" in method else P["held"]} \
        if sit == "c" else {}
    t = time.perf_counter()
    est.fit(*P["fit"], **fit_kw)
    fit_s = time.perf_counter() - t
    info = dict(steps=int(getattr(est, "n_iter_", -1)),
                noise_var_min2=float(np.asarray(est.noise_variance_).reshape(-1)[0]))
    pv = getattr(est, "prior_variance_", None)
    if pv is not None:
        info["prior_var"] = float(np.asarray(pv).reshape(-1)[0])
    mean, std = est.predict(P["test"][0], return_std=True)
    return np.asarray(mean, float).reshape(-1), np.asarray(std, float).reshape(-1), fit_s, info


def ntk_diag(P, X, chunk=256):
    """``||d g(x) / d theta||^2`` of the net (minutes), row by row (torch.func)."""
    import torch
    from torch.func import functional_call, jacrev, vmap

    mod = P["net"].module_
    params = {k: v.detach() for k, v in mod.named_parameters()}
    buffers = {k: v.detach() for k, v in mod.named_buffers()}

    def f(p, x):
        return functional_call(mod, (p, buffers), (x[None],))[0, 0]

    out = []
    for i in range(0, len(X), chunk):
        x = torch.as_tensor(X[i:i + chunk], dtype=torch.float32)
        J = vmap(jacrev(f), in_dims=(None, 0))(params, x)
        out.append(sum(j.reshape(len(x), -1).double().pow(2).sum(1) for j in J.values()))
    return torch.cat(out).numpy()


def run_ntk_diag(P):
    """The net with ``std(x)^2 = a k(x) + b``, ``k`` the NTK diagonal; ``a, b`` by
    validation NLL (the variance shape VaLLA at alpha = 1 converges to when its noise
    collapses: ``a k(x)`` alone, ``b = 0``, is the 1-parameter version)."""
    from scipy.optimize import minimize

    kv, kt = ntk_diag(P, P["val"][0]), ntk_diag(P, P["test"][0])
    rv = P["val"][1] - A.net_mean(P["net"], P["val"][0])
    scale = float(np.mean(rv ** 2))

    def nll(u, with_b):
        var = np.exp(u[0]) * kv / kv.mean() * scale + (np.exp(u[1]) * scale if with_b else 0)
        return float(np.mean(0.5 * (np.log(2 * np.pi * var) + rv ** 2 / var)))

    m_test = A.net_mean(P["net"], P["test"][0])
    out = {}
    for with_b in (False, True):
        u = minimize(nll, np.zeros(2), args=(with_b,), method="Nelder-Mead").x
        a, b = np.exp(u[0]) * scale / kv.mean(), (np.exp(u[1]) * scale if with_b else 0.0)
        sd = np.sqrt(a * kt + b)
        name = "net, std^2 = a k(x) + b (NTK diagonal)" if with_b else "net, std^2 = a k(x)"
        out[name] = (m_test, sd, f"a {a:.3g}, b {b:.0f} min^2 by validation NLL; k(x) p10 / "
                                 f"p90 {np.percentile(kt, 10):.3g} / {np.percentile(kt, 90):.3g}")
    return out


def run_hetero_gbm(P, seed):
    """A yardstick: the net with a gradient-boosted variance (no posterior).

    ``log r^2`` of the net's residuals on half of the held-out rows, regressed on the
    features by ``HistGradientBoostingRegressor``; the variance ``c exp(h(x))`` with
    ``c`` chosen by NLL on the other half: what an input-dependent Gaussian variance
    can gain on this table."""
    from scipy.optimize import minimize_scalar
    from sklearn.ensemble import HistGradientBoostingRegressor

    X, y = P["held"]
    r2 = (y - A.net_mean(P["net"], X)) ** 2
    half = np.random.default_rng(seed + 4).permutation(len(y))
    a, b = half[: len(y) // 2], half[len(y) // 2:]
    h = HistGradientBoostingRegressor(max_iter=200, random_state=seed)
    h.fit(X[a], np.log(r2[a] + 1.0))
    vb = np.exp(h.predict(X[b]))

    def nll(u):
        var = np.exp(u) * vb
        return float(np.mean(0.5 * (np.log(2 * np.pi * var) + r2[b] / var)))

    c = float(np.exp(minimize_scalar(nll, bounds=(-5, 5), method="bounded").x))
    m_test = A.net_mean(P["net"], P["test"][0])
    sd = np.sqrt(c * np.exp(h.predict(P["test"][0])))
    return {"net + gradient-boosted variance (held-out rows)": (
        m_test, sd, f"log r^2 ~ HistGradientBoosting on {len(a):,} held-out rows, scale "
                    f"{c:.2f} by NLL on the other {len(b):,}")}


def run_raw(P):
    """The net with constant stds: residual RMS (b, c), the papers' MAP grid, the floor."""
    s = P["stats"]
    y_std = float(s["y_scale"][0])
    m_test = A.net_mean(P["net"], P["test"][0])
    out = {}
    for name, (X, y) in (("raw residual std (b)", P["fit"]), ("raw residual std (c)", P["held"])):
        sd = float(np.sqrt(np.mean((A.net_mean(P["net"], X) - y) ** 2)))
        out[name] = (sd, f"std {sd:.2f} min: RMS residual of the {len(y):,} "
                         f"{'fit' if '(b)' in name else 'held-out'} rows")
    m_val = A.net_mean(P["net"], P["val"][0])
    grid = [-5, -4, -3, -2, -1, 0, 1]
    nlls = [float(np.mean(0.5 * (np.log(2 * np.pi * y_std ** 2 * np.exp(v))
                                 + (P["val"][1] - m_val) ** 2 / (y_std ** 2 * np.exp(v)))))
            for v in grid]
    v = grid[int(np.argmin(nlls))]
    sd = y_std * np.exp(v / 2)
    out["raw, papers' MAP rule"] = (sd, f"log variance {v} of y_std^2 picked by validation "
                                        f"NLL: std {sd:.2f} min (y_std {y_std:.2f})")
    rmse = float(np.sqrt(np.mean((m_test - P["test"][1]) ** 2)))
    out["raw, best constant std (test RMSE)"] = (rmse, f"std {rmse:.2f} min, chosen on the "
                                                       "test rows: no constant std does better")
    return {k: (m_test, np.full_like(m_test, sd), note) for k, (sd, note) in out.items()}


# ------------------------------------------------------------------------- main
def add_code_paths(paths):
    found = set()
    for p in paths:
        p = os.path.abspath(p)
        if os.path.isdir(os.path.join(p, "bayesipy")):
            found.add("bayesipy")
        elif os.path.isfile(os.path.join(p, "src", "valla.py")):
            found.add("vlla")
        else:
            raise SystemExit(f"--code {p}: neither a BayesiPy nor a Variational-LLA checkout")
        sys.path.insert(0, p)
    return found


def run_method(P, args, method):
    y = P["test"][1]
    if method in ("raw", "ntk-diag-std", "hetero-gbm"):
        t = time.perf_counter()
        res = (run_raw(P) if method == "raw" else run_ntk_diag(P) if method == "ntk-diag-std"
               else run_hetero_gbm(P, args.seed))
        return [dict(method=k, metrics=metrics(y, m, sd), fit_s=time.perf_counter() - t,
                     info=dict(note=note)) for k, (m, sd, note) in res.items()]
    if method.startswith("ours-"):
        mean, std, fit_s, info = run_ours(P, args, method)
    else:
        if method == "bayesipy-valla":
            model, fit_s, info = run_bayesipy_valla(P, args)
        elif method.startswith("vlla-valla"):
            model, fit_s, info = run_vlla_valla(P, args, 0.0 if method.endswith("a0") else 1.0,
                                                early_stop=not method.endswith("noes"))
        else:
            model, fit_s, info = run_bayesipy_fmgp(P, args, method.endswith("-es"))
        mean, std = predict_theirs(model, standardise(P, P["test"][0]))
    return [dict(method=method, metrics=metrics(y, mean, std), fit_s=fit_s, info=info)]


def report(out_dir):
    from _common import markdown_table

    recs = []
    for f in sorted(glob.glob(os.path.join(out_dir, "*.json"))):
        with open(f) as fh:
            recs += json.load(fh)["records"]
    order = {m: i for i, m in enumerate(METHODS)}
    recs.sort(key=lambda r: (order.get(r["method"].split(",")[0].split(" ")[0], -1),
                             r["method"]))
    rows = []
    for r in recs:
        m, i = r["metrics"], r["info"]
        rows.append([r["method"], f"{m['NLL']:.4f}", f"{m['CRPS']:.2f}", f"{m['CQM']:.3f}",
                     f"{m['cov90']:.3f} / {m['width90']:.0f}",
                     f"{m['std_p10']:.1f} / {m['std_p50']:.1f} / {m['std_p90']:.1f}",
                     f"{i['noise_var_min2']:.0f}" if "noise_var_min2" in i else "",
                     str(i.get("steps", "")), i.get("stop", i.get("note", "")),
                     f"{r['fit_s']:.0f}"])
    return markdown_table(["method", "test NLL", "CRPS", "CQM", "90 % cov / width (min)",
                           "std p10 / p50 / p90 (min)", "noise var (min^2)", "steps",
                           "stop / note", "fit s"], rows)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--code", action="append", default=[],
                    help="a BayesiPy or Variational-LLA checkout (repeat for both)")
    ap.add_argument("--methods", default=",".join(METHODS),
                    help="comma-separated subset of: " + ", ".join(METHODS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--iterations", type=int, default=20_000, help="net's Adam steps (cache)")
    ap.add_argument("--subsample", type=int, default=50_000,
                    help="fit rows (the protocol's draw; 0 = all 221,821 net training rows)")
    ap.add_argument("--val-rows", type=int, default=2_000,
                    help="held-out rows used for early stopping (0 = all 24,647)")
    ap.add_argument("--test-rows", type=int, default=0,
                    help="test rows every method is scored on (0: all 27,385)")
    ap.add_argument("--max-steps", type=int, default=40_000,
                    help="Adam steps at most (the paper's VaLLA: 40,000)")
    ap.add_argument("--fmgp-steps", type=int, default=20_000,
                    help="steps of bayesipy-fmgp-b (no early stopping; the paper: 70,000)")
    ap.add_argument("--time-limit", type=float, default=600.0,
                    help="seconds of training per method of the authors' code")
    ap.add_argument("--their-prior", type=float, default=0.1875,
                    help="ours-valla-their-hypers: the prior variance (their fit learned)")
    ap.add_argument("--their-noise", type=float, default=7.66,
                    help="ours-valla-their-hypers: the noise variance, min^2")
    ap.add_argument("--out-dir", default=os.path.join(HERE, "results", "authors_airline"))
    ap.add_argument("--tag", default="", help="suffix of the result files")
    ap.add_argument("--report", action="store_true", help="only print the saved results")
    args = ap.parse_args(argv)
    if args.report:
        print(report(args.out_dir))
        return
    from _common import set_threads

    set_threads(1)
    found = add_code_paths(args.code)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    for m in methods:
        if m not in METHODS:
            raise SystemExit(f"unknown method {m!r}")
        need = "bayesipy" if m.startswith("bayesipy") else "vlla" if m.startswith("vlla") \
            else None
        if need and need not in found:
            raise SystemExit(f"{m} needs --code pointing at "
                             + ("BayesiPy" if need == "bayesipy" else "Variational-LLA"))
    os.makedirs(args.out_dir, exist_ok=True)
    P = load_problem(args)
    head = (f"fit rows {len(P['fit'][1]):,} of {P['n_net']:,}, validation rows "
            f"{len(P['val'][1]):,}, test rows {len(P['test'][1]):,}, seed {args.seed}")
    print(head, flush=True)
    for m in methods:
        t = time.perf_counter()
        recs = run_method(P, args, m)
        load = os.getloadavg()[0]
        for r in recs:
            if args.subsample != 50_000:
                r["method"] += f", {len(P['fit'][1]):,} rows"
            r["load"] = load
            print(f"{r['method']}: NLL {r['metrics']['NLL']:.4f} CRPS "
                  f"{r['metrics']['CRPS']:.2f} fit {r['fit_s']:.0f} s {r['info']} "
                  f"[{time.perf_counter() - t:.0f} s, load {load:.1f}]", flush=True)
        name = f"{m}_n{len(P['fit'][1])}_seed{args.seed}{args.tag}.json"
        with open(os.path.join(args.out_dir, name), "w") as fh:
            json.dump(dict(header=head, records=recs), fh, indent=1, default=float)
    print(report(args.out_dir))


if __name__ == "__main__":
    main()
