"""FMGP benchmarks: step costs, the defaults in situations (b) / (c), a Year-shaped run.

Four parts (``--part``, default ``steps,situations``; ``situations`` runs ``gap`` too
unless ``--no-gap``):

* ``steps``: time per Adam step of ``FMGPRegressor`` and ``FMGPClassifier`` on a
  ``load_digits``-sized table (1,078 x 64; the classifier's 10 logits against a
  one-output regression on the same inputs and the same 2 x 50 tanh MLP shape), and of
  the regressor on a Year-shaped table at N = 20,000 and 200,000 (it must not depend
  on N). The optimisation loop's wall and CPU time over its steps, initialisation
  excluded; also each default fit's wall and CPU time, steps, whether early stopping
  fired, and the classification / regression step-cost ratio.
* ``situations``: issue 19's protocol on scikit-learn's data sets (diabetes,
  friedman1, digits, breast cancer, wine): 60 / 20 / 20 split, standardised X (and y),
  a skorch 2 x 50 tanh MLP trained 200 epochs with ``train_split=None`` (the net fits
  every training row). FMGP with defaults in situation (b), ``fit(X_train, y_train)``,
  and (c), ``fit(..., validation_data=(X_val, y_val))``, against the raw net (its
  training-residual std in (b), validation-residual std in (c); the softmax for
  classifiers). Regression: NLL, CQM and 90 % coverage on the original y scale;
  classification: NLL and ECE (15 bins). Classifiers are fitted with both bias terms
  of the kernel (``delta="class"``, the default, and ``"input"``, the thesis text).
  Then ``gap``.
* ``gap``: the gap toy of ``tests/test_calibration.py``: std at x = 0 over the mean
  std on the data, for the defaults, the thesis' shared noise (``--authors``: also the
  authors' toy budget) and an exact RBF GP chosen by its evidence.
* ``year``: the Year-shaped problem of ``bench_ella.py`` (90 features, 3 x 200 tanh
  MLP; ``--quick``: 20,000 rows): fit time, predict time relative to the bare forward
  pass, and held-out NLL / CRPS / CQM with ``validation_data``.

Usage::

    python benchmarks/bench_fmgp.py                          # steps + situations, seed 0
    python benchmarks/bench_fmgp.py --part situations --seeds 0,1,2
    python benchmarks/bench_fmgp.py --part gap --authors
    python benchmarks/bench_fmgp.py --part year --quick
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time
import warnings

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import markdown_table, set_threads, train_skorch_mlp  # noqa: E402

REGRESSION = ("diabetes", "friedman1")
CLASSIFICATION = ("digits", "breast_cancer", "wine")


# ------------------------------------------------------------------------- data
def load(name):
    from sklearn import datasets

    if name == "diabetes":
        return datasets.load_diabetes(return_X_y=True)
    if name == "friedman1":
        return datasets.make_friedman1(n_samples=1000, noise=1.0, random_state=0)
    return getattr(datasets, f"load_{name}")(return_X_y=True)


def prepare(name, seed, epochs=200):
    """Split, standardise and train the net (``train_split=None``)."""
    from sklearn.model_selection import train_test_split
    from sklearn.preprocessing import StandardScaler

    clf = name in CLASSIFICATION
    X, y = load(name)
    Xa, Xte, ya, yte = train_test_split(X, y, test_size=0.2, random_state=seed,
                                        stratify=y if clf else None)
    Xtr, Xva, ytr, yva = train_test_split(Xa, ya, test_size=0.25, random_state=seed,
                                          stratify=ya if clf else None)
    sc = StandardScaler().fit(Xtr)
    Xtr, Xva, Xte = (sc.transform(a).astype(np.float32) for a in (Xtr, Xva, Xte))
    mu, sd = (0.0, 1.0) if clf else (float(ytr.mean()), float(ytr.std()))
    if not clf:
        ytr, yva, yte = ((a - mu) / sd for a in (ytr, yva, yte))
    n_out = int(np.max(y)) + 1 if clf else 1
    net = train_skorch_mlp(Xtr, ytr, clf, n_out, max_epochs=epochs, seed=seed, holdout=False)
    return dict(net=net, Xtr=Xtr, ytr=ytr, Xva=Xva, yva=yva, Xte=Xte, yte=yte, mu=mu, sd=sd)


def outputs(net, X):
    with torch.no_grad():
        return net.forward(X.astype(np.float32)).double().numpy()


# ---------------------------------------------------------------------- metrics
def reg_metrics(y, mean, std):
    from scipy.stats import norm

    from sklearn_lla.metrics import centered_quantile_metric, gaussian_nll

    y, mean, std = (np.asarray(a, dtype=np.float64).ravel() for a in (y, mean, std))
    return {"NLL": gaussian_nll(y, mean, std), "CQM": centered_quantile_metric(y, mean, std),
            "cov90": float(np.mean(np.abs(y - mean) <= norm.ppf(0.95) * std))}


def clf_metrics(y, proba):
    from sklearn.metrics import log_loss

    from sklearn_lla.metrics import expected_calibration_error

    proba = proba / proba.sum(1, keepdims=True)
    return {"NLL": float(log_loss(y, proba, labels=np.arange(proba.shape[1]))),
            "ECE": expected_calibration_error(y, proba, n_bins=15)}


# ------------------------------------------------------------------- step costs
def timed_fit(est, X, y, **fit_kw):
    """Fit; return (fit wall s, fit CPU s, wall s per Adam step, CPU s per step, warnings).

    CPU seconds (``time.process_time``) are reported next to wall seconds: on a shared,
    loaded machine the wall time of a single-threaded fit counts other processes too.
    """
    from sklearn_lla._posteriors import gp as _gp

    loop, spent = _gp.minimize, []

    def timed(*a, **kw):
        t, c = time.perf_counter(), time.process_time()
        res = loop(*a, **kw)
        n = max(res.n_iter, 1)
        spent.append(((time.perf_counter() - t) / n, (time.process_time() - c) / n))
        return res

    _gp.minimize = timed
    try:
        t, c = time.perf_counter(), time.process_time()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            est.fit(X, y, **fit_kw)
        fit_s, fit_cpu = time.perf_counter() - t, time.process_time() - c
    finally:
        _gp.minimize = loop
    warned = sorted({w.category.__name__ for w in caught
                     if not issubclass(w.category, (DeprecationWarning, FutureWarning))})
    return fit_s, fit_cpu, spent[0][0], spent[0][1], warned


def part_steps(args):
    from sklearn.datasets import load_digits
    from sklearn.preprocessing import StandardScaler

    from sklearn_lla import FMGPClassifier, FMGPRegressor

    X, y = load_digits(return_X_y=True)
    X = StandardScaler().fit_transform(X).astype(np.float32)[:1078]
    y = y[:1078]
    yr = (y - y.mean()) / y.std()  # a regression target on the same inputs
    clf_net = train_skorch_mlp(X, y, True, 10, max_epochs=args.epochs, holdout=False)
    reg_net = train_skorch_mlp(X, yr, False, 1, max_epochs=args.epochs, holdout=False)
    rows = []
    per_step = {}
    for name, cls, net, target in (("regression (C = 1)", FMGPRegressor, reg_net, yr),
                                   ("classification (C = 10)", FMGPClassifier, clf_net, y)):
        est = cls(net, random_state=0)
        t0, c0 = time.perf_counter(), time.process_time()
        fit_s, fit_cpu, step_s, step_cpu, warned = timed_fit(est, X, target)
        est.predict(X) if cls is FMGPRegressor else est.predict_proba(X)
        total, total_cpu = time.perf_counter() - t0, time.process_time() - c0
        per_step[cls] = step_cpu
        rows.append([f"digits-sized {name}", f"{1e3 * step_s:.1f} / {1e3 * step_cpu:.1f}",
                     str(est.n_iter_), str(bool(est.hyper_trace_["stopped_early"])),
                     f"{fit_s:.1f} / {fit_cpu:.1f}", f"{total:.1f} / {total_cpu:.1f}",
                     ", ".join(warned) or "none"])
    ratio = per_step[FMGPClassifier] / per_step[FMGPRegressor]
    rows.append(["classification / regression step (CPU)", f"{ratio:.1f} x (C = 10)",
                 "", "", "", "", ""])
    if not args.quick:
        from bench_ella import make_net, make_problem

        Xy, yy, _, _ = make_problem(200_000, 10, 90)
        ynet = make_net(Xy[:20_000], yy[:20_000], (200, 200, 200), 1)
        for n in (20_000, 200_000):
            est = FMGPRegressor(ynet, max_iter=200, early_stopping=False, random_state=0)
            _, _, step_s, step_cpu, _ = timed_fit(est, Xy[:n], yy[:n])
            rows.append([f"Year-shaped regression, N = {n:,}",
                         f"{1e3 * step_s:.1f} / {1e3 * step_cpu:.1f}", "200",
                         "(fixed)", "", "", ""])
    print(markdown_table(["problem", "ms / step (wall / CPU)", "steps", "stopped early",
                          "fit s (wall / CPU)", "fit + predict s (wall / CPU)", "warnings"],
                         rows))


# -------------------------------------------------------------------- situations
def fit_both(est, d, classification):
    """Fit once in (b); (c) is the same posterior calibrated on the validation rows.

    FMGP stops on its objective, so ``fit(..., validation_data=...)`` trains the same
    posterior as ``fit(...)`` and then runs ``posterior_.calibrate``; doing that on a
    copy gives both situations from one fit (checked: identical ``n_iter_`` and
    hyperparameters).
    """
    from sklearn_lla._core.protocol import FitData

    t = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        est.fit(d["Xtr"], d["ytr"])
        fit_s = time.perf_counter() - t
        c = copy.deepcopy(est)
        yv = (torch.tensor(d["yva"].astype(np.int64)) if classification
              else torch.tensor(d["yva"], dtype=torch.float64).reshape(-1, 1))
        val = FitData(c.linearized_net_, c.likelihood_, d["Xva"], yv, batch_size=c.batch_size)
        c.posterior_.calibrate(val, generator=torch.Generator().manual_seed(0),
                               noise=not classification, temperature=classification)
        c.likelihood_ = c.posterior_.likelihood
    warned = sorted({f"{w.category.__name__}: {str(w.message)[:80]}" for w in caught
                     if not issubclass(w.category, (DeprecationWarning, FutureWarning))})
    return est, c, fit_s, warned


def part_situations(args):
    from sklearn_lla import FMGPClassifier, FMGPRegressor
    from sklearn_lla.kernels import ClassificationKernel

    rows = []
    for name in args.datasets:
        clf = name in CLASSIFICATION
        for seed in args.seeds:
            d = prepare(name, seed, args.epochs)
            net = d["net"]
            if clf:
                raw = clf_metrics(d["yte"], torch.softmax(
                    torch.as_tensor(outputs(net, d["Xte"])), 1).numpy())
                rows.append([name, seed, "raw net", "b/c", *_fmt(raw, clf), "", ""])
                variants = [("FMGP", {}), ("FMGP, delta='input'",
                                           {"kernel": ClassificationKernel(delta="input")})]
            else:
                yte = d["yte"] * d["sd"] + d["mu"]
                m = outputs(net, d["Xte"])[:, 0] * d["sd"] + d["mu"]
                for sit, Xs, ys in (("b", d["Xtr"], d["ytr"]), ("c", d["Xva"], d["yva"])):
                    r = outputs(net, Xs)[:, 0] - ys
                    s0 = float(np.sqrt(np.mean(r ** 2))) * d["sd"]
                    rows.append([name, seed, "raw net", sit,
                                 *_fmt(reg_metrics(yte, m, np.full_like(m, s0)), clf), "", ""])
                variants = [("FMGP", {})]
            for label, kw in variants:
                cls = FMGPClassifier if clf else FMGPRegressor
                b, c, fit_s, warned = fit_both(cls(net, random_state=seed, **kw), d, clf)
                for sit, est in (("b", b), ("c", c)):
                    if clf:
                        met = clf_metrics(d["yte"], est.predict_proba(d["Xte"]))
                        hyp = f"T = {est.likelihood_.temperature:.3g}"
                    else:
                        mean, std = est.predict(d["Xte"], return_std=True)
                        met = reg_metrics(d["yte"] * d["sd"] + d["mu"],
                                          mean * d["sd"] + d["mu"], std * d["sd"])
                        hyp = f"s2 = {est.likelihood_.noise_variance:.3g}"
                    note = (f"{est.n_iter_} steps, {fit_s:.0f} s; a = "
                            f"{est.prior_variance_:.3g}, {hyp}")
                    rows.append([name, seed, label, sit, *_fmt(met, clf), note,
                                 "; ".join(warned)])
            print(f"done {name} seed {seed}", flush=True)
    print(markdown_table(["data", "seed", "model", "situation", "NLL", "CQM / ECE",
                          "cov90", "fit", "warnings"], rows))
    if not args.no_gap:
        part_gap(args)


def _fmt(met, clf):
    if clf:
        return [f"{met['NLL']:.4f}", f"{met['ECE']:.4f}", ""]
    return [f"{met['NLL']:.4f}", f"{met['CQM']:.4f}", f"{met['cov90']:.3f}"]


class _SharedNoise:
    """The thesis' / authors' noise design, for comparison only (not an option).

    One noise variance learned from both terms of the loss with alpha = 1 (the
    authors' ``FMGP_Base.loss``), instead of the default's ``Q*``-ELBO noise; with
    ``start`` the authors' toy initialisation ``s2 = exp(-5)``.
    """

    def __init__(self, start=None):
        self.start = start

    def __enter__(self):
        from sklearn_lla._posteriors.fmgp import FMGPPosterior

        self.saved = FMGPPosterior._noise_from_qstar, FMGPPosterior._initial_noise
        FMGPPosterior._noise_from_qstar = lambda self_, likelihood: False
        if self.start is not None:
            FMGPPosterior._initial_noise = lambda self_, data, gen: self.start
        return self

    def __exit__(self, *exc):
        from sklearn_lla._posteriors.fmgp import FMGPPosterior

        FMGPPosterior._noise_from_qstar, FMGPPosterior._initial_noise = self.saved


def part_gap(args):
    """The gap toy of tests/test_calibration.py: std at 0 / mean std on the data.

    Rows: the defaults; the thesis' shared noise with the default budget; with
    ``--authors``, the authors' toy settings (shared noise from ``exp(-5)``, Adam at
    1e-3 for 70,000 steps, no early stopping: about 10 minutes per situation).
    """
    import math

    from sklearn.gaussian_process import GaussianProcessRegressor
    from sklearn.gaussian_process.kernels import RBF, ConstantKernel, WhiteKernel

    from sklearn_lla import FMGPRegressor

    def rows_(seed, n):
        rng = np.random.RandomState(seed)
        x = np.concatenate([rng.uniform(-3, -1, n), rng.uniform(1, 3, n)])
        return x[:, None].astype(np.float32), (np.sin(x) + 0.1 * rng.randn(2 * n)).astype(
            np.float32)

    X, y = rows_(0, 40)
    Xv, yv = rows_(1, 20)
    net = train_skorch_mlp(X, y, False, 1, hidden=(32, 32), lr=1e-2, max_epochs=300,
                           holdout=False)
    variants = [("defaults", {}, None),
                ("thesis' shared noise", {}, _SharedNoise())]
    if getattr(args, "authors", False):
        variants.append(("authors' settings", {"learning_rate": 1e-3, "max_iter": 70_000,
                                               "early_stopping": False},
                         _SharedNoise(math.exp(-5))))
    out = []
    for label, kw, patch in variants:
        for sit, fit_kw in (("b", {}), ("c", {"validation_data": (Xv, yv)})):
            est = FMGPRegressor(net, n_inducing=20, random_state=0, **kw)
            if patch is None:
                est.fit(X, y, **fit_kw)
            else:
                with patch:
                    est.fit(X, y, **fit_kw)
            _, s_gap = est.predict(np.zeros((1, 1), np.float32), return_std=True)
            _, s_dat = est.predict(X, return_std=True)
            out.append([label, sit, f"{s_gap[0]:.3f}", f"{s_dat.mean():.3f}",
                        f"{s_gap[0] / s_dat.mean():.2f}",
                        f"{est.kernel_.length_scale_[0]:.3g}", f"{est.prior_variance_:.3g}",
                        f"{est.noise_variance_:.3g}", str(est.n_iter_)])
    gp = GaussianProcessRegressor(ConstantKernel() * RBF() + WhiteKernel(0.01),
                                  n_restarts_optimizer=5, random_state=0).fit(X, y)
    _, s_dat = gp.predict(X, return_std=True)
    _, s_gap = gp.predict(np.zeros((1, 1)), return_std=True)
    k = gp.kernel_
    out.append(["exact GP, RBF, evidence", "b", f"{s_gap[0]:.3f}", f"{s_dat.mean():.3f}",
                f"{s_gap[0] / s_dat.mean():.2f}", f"{k.k1.k2.length_scale:.3g}",
                f"{k.k1.k1.constant_value:.3g}", f"{k.k2.noise_level:.3g}", ""])
    print(markdown_table(["model", "situation", "std at 0", "mean std on data", "ratio",
                          "length scale", "amplitude", "noise variance", "steps"], out))


# -------------------------------------------------------------------------- year
def part_year(args):
    from bench_ella import make_net, make_problem

    from sklearn_lla import FMGPRegressor

    n_train, n_val, n_test, epochs = ((20_000, 2_000, 2_000, 1) if args.quick
                                      else (200_000, 20_000, 10_000, 3))
    X, y, Xr, yr = make_problem(n_train, n_val + n_test, 90)
    Xv, yv, Xt, yt = Xr[:n_val], yr[:n_val], Xr[n_val:], yr[n_val:]
    net = make_net(X, y, (200, 200, 200), epochs)
    s0 = float(np.sqrt(np.mean((outputs(net, Xv) - yv) ** 2)))
    rows = [["MAP + validation-residual noise",
             *_fmt(reg_metrics(yt, outputs(net, Xt), np.full(yt.shape, s0)), False), "", ""]]
    est = FMGPRegressor(net, random_state=0)
    fit_s, _, step_s, _, warned = timed_fit(est, X, y, validation_data=(Xv, yv))
    pred = fwd = np.inf
    for _ in range(3):  # best of 3: the machine is shared
        t = time.perf_counter()
        mean, std = est.predict(Xt, return_std=True)
        pred = min(pred, time.perf_counter() - t)
        t = time.perf_counter()
        est.predict(Xt)
        fwd = min(fwd, time.perf_counter() - t)
    rows.append(["FMGP (defaults, validation_data)", *_fmt(reg_metrics(yt, mean, std), False),
                 f"{fit_s:.1f} ({est.n_iter_} steps, {1e3 * step_s:.1f} ms / step)",
                 f"{pred / fwd:.2f} x forward"])
    print(markdown_table(["model", "NLL", "CQM", "cov90", "fit (s)", "predict"], rows))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--part", default="steps,situations")
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--datasets", default=",".join(REGRESSION + CLASSIFICATION))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=200)
    ap.add_argument("--no-gap", action="store_true")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--authors", action="store_true",
                    help="gap: also the authors' toy settings (about 20 minutes)")
    args = ap.parse_args()
    args.seeds = [int(s) for s in args.seeds.split(",")]
    args.datasets = args.datasets.split(",")
    set_threads(args.threads)
    print(f"load average before: {os.getloadavg()}")
    for part in args.part.split(","):
        {"steps": part_steps, "situations": part_situations, "gap": part_gap,
         "year": part_year}[part](args)
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
