"""VaLLA benchmark: time per Adam step vs N, and laplace-torch 0.3's VaLLA as the peer.

Setting (issue #9): a Year-shaped problem (synthetic: the UCI Year data cannot be
downloaded here), N = 20,000 and 200,000 training rows x 90 features, a 3 x 200 tanh
MLP (float32, P = 98,801) trained briefly on the first 20,000 rows, M = 100 inducing
points, batch 100, 2 torch threads.

1. **Time per step**: ``VaLLARegressor`` with learned ``s0^2``, ``s2``, ``Z`` and ``L``,
   early stopping off; the time between consecutive minibatch draws of the shared
   Adam loop (one step: kernel, objective, backward, Adam update, reading the next
   batch), median over ``--steps`` steps after ``--warmup``. It must not grow with N.
2. **Peer step time**: laplace-torch's ``Laplace(..., hessian_structure="gp",
   functional_approximation="variational")`` (its ``VaLLA`` class) on the same net
   and data; per-step time = (fit with ``--peer-steps + 2`` iterations - fit with 2
   iterations) / ``--peer-steps`` (removes its k-means set-up).
3. **Validation NLL**: both run ``--nll-steps`` Adam steps at ``--nll-lr`` from the
   same initial hyperparameters (``s0^2 = ||theta||^2 / P``, ``s2`` = the net's
   training MSE), then the Gaussian NLL on 2,000 held-out rows, with ratios.

4. **Regression vs classification steps and default fits** (``--parts tables``):
   digits-sized tables as ``benchmarks/budgets.py`` builds them (``load_digits``, 1,797 x
   64, 10 classes; ``make_friedman1(n_samples=1797, n_features=64, noise=1.0)``, y
   standardised), a skorch MLP (2 x 50 tanh, Adam, 200 epochs, ``train_split=None``).
   Per-step time of ``VaLLARegressor`` / ``VaLLAClassifier`` (median time between
   minibatch draws, ``early_stopping=False``), with the default fixed inducing inputs
   and with ``learn_inducing=True`` (gradients through ``J(Z)``), the ratio
   classification / regression and that ratio / C. Then the default fit + predict
   (all rows) in situation (b) (``fit(X, y)``) and (c) (80 % of the rows, the other
   20 % as ``validation_data``), with the steps taken and any ConvergenceWarning.

Other processes may share the CPU: the load average is printed next to the numbers.

Usage::

    python benchmarks/bench_valla.py                 # full setting (several minutes)
    python benchmarks/bench_valla.py --quick         # small smoke run
    python benchmarks/bench_valla.py --parts tables  # regression vs classification
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import sys
import time
import warnings

import numpy as np
import torch
from sklearn.exceptions import ConvergenceWarning

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import set_threads  # noqa: E402


def make_problem(n_train, n_val, n_features=90, seed=0):
    rng = np.random.RandomState(seed)
    W = rng.randn(n_features, 1) / np.sqrt(n_features)
    X = rng.randn(n_train + n_val, n_features).astype(np.float32)
    y = np.tanh(X @ W) * 2 + 0.5 * np.sin(3 * X[:, :1]) + 0.3 * rng.randn(len(X), 1)
    y = y.astype(np.float32)
    return X[:n_train], y[:n_train], X[n_train:], y[n_train:]


def make_net(X, y, epochs=2, seed=0):
    from sklearn_lla.nets import MLP

    torch.manual_seed(seed)
    net = MLP(X.shape[1], 1, (200, 200, 200))
    opt = torch.optim.Adam(net.parameters(), lr=1e-3, weight_decay=1e-4)
    Xt, yt = torch.as_tensor(X), torch.as_tensor(y)
    for _ in range(epochs):
        perm = torch.randperm(len(Xt))
        for i in range(0, len(Xt), 256):
            idx = perm[i:i + 256]
            opt.zero_grad()
            torch.nn.functional.mse_loss(net(Xt[idx]), yt[idx]).backward()
            opt.step()
    return net.eval()


def _gaussian_nll(y, mean, var):
    return float(np.mean(0.5 * (np.log(2 * np.pi * var) + (y - mean) ** 2 / var)))


def timed_fit(est, X, y, **fit_kw):
    """Fit ``est``; returns (per-step times after the first, total seconds, warnings)."""
    import sklearn_lla._posteriors.gp as gp

    stamps = []
    draw = gp.minibatches

    def timed(data, batch_size, generator):  # a stamp at every minibatch draw
        for batch in draw(data, batch_size, generator):
            stamps.append(time.perf_counter())
            yield batch

    gp.minibatches = timed
    try:
        t = time.perf_counter()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            est.fit(X, y, **fit_kw)
        total = time.perf_counter() - t
    finally:
        gp.minibatches = draw
    return np.diff(stamps), total, caught


def ours(net, X, y, steps, lr, warmup=0):
    """Fit VaLLA for ``steps`` steps; returns the estimator and per-step times."""
    from sklearn_lla import VaLLARegressor

    est = VaLLARegressor(net, n_inducing=100, batch_size=100, max_iter=warmup + steps,
                         learning_rate=lr, early_stopping=False, device="cpu",
                         random_state=0)
    d, total, _ = timed_fit(est, X, y[:, 0])
    return est, d[warmup:], total, float("nan")


def peer(net, X, y, iterations, lr, s0, s2, Xv=None, yv=None):
    """laplace-torch's VaLLA; returns (fit seconds, validation NLL or None)."""
    from laplace import Laplace
    from torch.utils.data import DataLoader, TensorDataset

    model = copy.deepcopy(net)
    la = Laplace(model, "regression", subset_of_weights="all", hessian_structure="gp",
                 functional_approximation="variational", inducing_locations="kmeans",
                 num_inducing=100, prior_precision=1.0 / s0, sigma_noise=math.sqrt(s2),
                 seed=0)
    loader = DataLoader(TensorDataset(torch.as_tensor(X), torch.as_tensor(y)), batch_size=100,
                        shuffle=True, generator=torch.Generator().manual_seed(0))
    t = time.perf_counter()
    la.fit(loader, iterations=iterations, lr=lr)
    dt = time.perf_counter() - t
    nll = None
    if Xv is not None:
        mus, vs = [], []
        for i in range(0, len(Xv), 100):  # in one call it needs over 24 GiB (OOM)
            with torch.no_grad():
                f_mu, f_var = la._glm_predictive_distribution(torch.as_tensor(Xv[i:i + 100]))
            mus.append(f_mu.numpy()[:, 0])
            vs.append(f_var.numpy().reshape(-1))
        noise = float(torch.as_tensor(la.sigma_noise).detach()) ** 2
        nll = _gaussian_nll(yv[:, 0], np.concatenate(mus), np.concatenate(vs) + noise)
    return dt, nll


def digits_tables():
    """The digits-sized classification and regression tables (see ``budgets.py``)."""
    from sklearn.datasets import load_digits, make_friedman1
    from sklearn.preprocessing import StandardScaler

    Xc, yc = load_digits(return_X_y=True)
    Xr, yr = make_friedman1(n_samples=1797, n_features=64, noise=1.0, random_state=0)
    yr = (yr - yr.mean()) / yr.std()
    return {"classification": (StandardScaler().fit_transform(Xc).astype(np.float32), yc),
            "regression": (StandardScaler().fit_transform(Xr).astype(np.float32), yr)}


def tables(args):
    """Part 4: step costs regression vs classification, default fit + predict times."""
    from _common import train_skorch_mlp

    from sklearn_lla import VaLLAClassifier, VaLLARegressor

    rows = {}
    for task, (X, y) in digits_tables().items():
        clf = task == "classification"
        C = 10 if clf else 1
        Est = VaLLAClassifier if clf else VaLLARegressor
        net_b = train_skorch_mlp(X, y, clf, C, holdout=False)
        n80 = int(0.8 * len(X))
        perm = np.random.RandomState(0).permutation(len(X))
        tr, va = perm[:n80], perm[n80:]
        net_c = train_skorch_mlp(X[tr], y[tr], clf, C, holdout=False)
        for learn in (False, True):
            est = Est(net_b, max_iter=args.table_steps + 5, early_stopping=False,
                      learn_inducing=learn, device="cpu", random_state=0)
            d, _, _ = timed_fit(est, X, y)
            rows[(task, learn)] = float(np.median(d[5:]))
            print(f"{task:>14}, learn_inducing={learn!s:>5}: median step "
                  f"{1e3 * rows[(task, learn)]:.1f} ms ({len(d) - 5} steps); load "
                  f"{os.getloadavg()[0]:.2f}", flush=True)
        for sit, net, fit_rows, kw in [("b", net_b, np.arange(len(X)), {}),
                                       ("c", net_c, tr, {"validation_data": (X[va], y[va])})]:
            est = Est(net, device="cpu", random_state=0)
            t = time.perf_counter()
            _, fit_s, caught = timed_fit(est, X[fit_rows], y[fit_rows], **kw)
            if clf:
                est.predict_proba(X)
            else:
                est.predict(X, return_std=True)
            total = time.perf_counter() - t
            conv = sum(issubclass(w.category, ConvergenceWarning) for w in caught)
            print(f"{task:>14} ({sit}) default fit {fit_s:.1f} s, fit + predict {total:.1f} s, "
                  f"{est.n_iter_} steps (best check at step {est.hyper_trace_['best_iter']}), "
                  f"ConvergenceWarnings {conv}; load {os.getloadavg()[0]:.2f}", flush=True)
    for learn in (False, True):
        r = rows[("classification", learn)] / rows[("regression", learn)]
        print(f"learn_inducing={learn}: classification / regression step {r:.2f} "
              f"(/ C = {r / 10:.2f})")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="20000,200000")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--peer-steps", type=int, default=5)
    ap.add_argument("--nll-steps", type=int, default=100)
    ap.add_argument("--nll-lr", type=float, default=1e-2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-peer", action="store_true")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--parts", default="year", help="comma-separated: year, tables")
    ap.add_argument("--table-steps", type=int, default=60)
    args = ap.parse_args(argv)
    if args.quick:
        args.sizes, args.steps, args.warmup = "2000,20000", 20, 5
        args.peer_steps, args.nll_steps = 2, 20
    set_threads(args.threads)
    parts = args.parts.split(",")
    if "tables" in parts:
        print(f"load average before: {os.getloadavg()}")
        tables(args)
    if "year" not in parts:
        return
    sizes = [int(s) for s in args.sizes.split(",")]
    n_val = 2000
    X, y, Xv, yv = make_problem(max(sizes), n_val)
    net = make_net(X[:20000], y[:20000])
    theta = torch.cat([p.detach().reshape(-1) for p in net.parameters()]).double()
    s0 = float(theta @ theta) / theta.numel()
    with torch.no_grad():  # ours starts at the training MSE (no held-out rows given)
        s2 = float(((net(torch.as_tensor(X[:2000])) - torch.as_tensor(y[:2000])) ** 2).mean())
    print(f"problem: up to {max(sizes)} x 90, 3 x 200 tanh MLP (P = {theta.numel()}), "
          f"M = 100, batch 100, {args.threads} threads; s0^2 init {s0:.3g}, s2 init {s2:.3g}")
    print(f"load average before: {os.getloadavg()}")

    # 1. time per step against N
    for n in sizes:
        est, d, total, setup = ours(net, X[:n], y[:n], args.steps, 1e-3, warmup=args.warmup)
        print(f"ours  N={n:>7}: median step {1e3 * np.median(d):6.1f} ms "
              f"(p10 {1e3 * np.percentile(d, 10):.1f}, p90 {1e3 * np.percentile(d, 90):.1f}; "
              f"{len(d)} steps), fit {total:.1f} s, backend {est.jacobian_backend_}; "
              f"load {os.getloadavg()[0]:.2f}", flush=True)
    ours_step = float(np.median(d))

    if args.no_peer:
        return
    try:
        import laplace  # noqa: F401
    except ImportError:
        print("laplace-torch is not installed: no peer")
        return

    # 2. the peer's step time on the smallest N
    n = sizes[0]
    base, _ = peer(net, X[:n], y[:n], 2, 1e-3, s0, s2)
    more, _ = peer(net, X[:n], y[:n], 2 + args.peer_steps, 1e-3, s0, s2)
    peer_step = (more - base) / args.peer_steps
    print(f"laplace-torch VaLLA N={n}: {1e3 * peer_step:.1f} ms per step "
          f"({args.peer_steps} steps); ratio peer / ours = {peer_step / ours_step:.1f}; "
          f"load {os.getloadavg()[0]:.2f}", flush=True)

    # 3. validation NLL after the same number of steps, same initial hyperparameters
    est, d, total, _ = ours(net, X[:n], y[:n], args.nll_steps, args.nll_lr)
    mean, std = est.predict(Xv, return_std=True)
    nll_ours = _gaussian_nll(yv[:, 0], mean, std ** 2)
    t_peer, nll_peer = peer(net, X[:n], y[:n], args.nll_steps, args.nll_lr, s0, s2, Xv, yv)
    with torch.no_grad():
        g = net(torch.as_tensor(Xv)).numpy()[:, 0]
    nll_raw = _gaussian_nll(yv[:, 0], g, np.full_like(g, s2))
    print(f"after {args.nll_steps} steps at lr {args.nll_lr}: validation NLL ours {nll_ours:.4f} "
          f"(fit {total:.1f} s), laplace-torch {nll_peer:.4f} (fit {t_peer:.1f} s), raw net "
          f"with training-MSE noise {nll_raw:.4f}; NLL ratio ours / peer "
          f"{nll_ours / nll_peer:.3f}, fit time ratio peer / ours {t_peer / total:.1f}")
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
