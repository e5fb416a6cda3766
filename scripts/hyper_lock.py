"""Behaviour lock for the hyperparameter layer: fit a fixed set of estimators, save outputs.

Every estimator of the registry (its contract-test sizes) is fitted on small fixed data
(diabetes / wine subsets, standardised) three ways: ``net=None`` (the estimator trains
its net and calibrates on the rows it held out), a pretrained skorch net with
``validation_data``, and a pretrained skorch net without held-out rows; plus every
``hyper_strategy`` an estimator accepts (``net=None``). Its predictions on test rows
(mean and std, or class probabilities) and fitted hyperparameters are saved.

Usage::

    OMP_NUM_THREADS=1 python scripts/hyper_lock.py /tmp/hyper_ref.npz
    OMP_NUM_THREADS=1 python scripts/hyper_lock.py /tmp/new.npz --compare /tmp/hyper_ref.npz

``--compare`` prints the largest relative difference per estimator and exits non-zero
when any exceeds ``--rtol`` (default 1e-8).
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings

import numpy as np
import skorch
import torch
from sklearn.datasets import load_diabetes, load_wine
from sklearn.preprocessing import StandardScaler
from torch import nn

from sklearn_lla._registry import ESTIMATORS
from sklearn_lla.nets import MLP

torch.set_num_threads(1)


def _data():
    Xr, yr = load_diabetes(return_X_y=True)
    rng = np.random.RandomState(0)
    i = rng.permutation(len(Xr))[:160]
    Xr = StandardScaler().fit_transform(Xr[i])
    yr = (yr[i] - yr[i].mean()) / yr[i].std()
    Xc, yc = load_wine(return_X_y=True)
    j = rng.permutation(len(Xc))
    Xc, yc = StandardScaler().fit_transform(Xc[j]), yc[j]
    return {"regression": (Xr[:100], yr[:100], Xr[100:130], yr[100:130], Xr[130:]),
            "classification": (Xc[:100], yc[:100], Xc[100:130], yc[100:130], Xc[130:])}


def _net(task, n_features, n_out):
    cls, crit = ((skorch.NeuralNetRegressor, nn.MSELoss) if task == "regression"
                 else (skorch.NeuralNetClassifier, nn.CrossEntropyLoss))
    return cls(module=MLP, module__n_features=n_features, module__n_outputs=n_out,
               module__hidden_layer_sizes=(16,), module__dtype=torch.float64, criterion=crit,
               optimizer=torch.optim.Adam, lr=1e-2, optimizer__weight_decay=1e-4,
               max_epochs=80, train_split=None, verbose=0)


def _nets(data):
    out = {}
    for task, (X, y, *_) in data.items():
        n_out = 1 if task == "regression" else len(np.unique(y))
        net = _net(task, X.shape[1], n_out)
        with torch.random.fork_rng():
            torch.manual_seed(0)
            net.fit(X, y.reshape(-1, 1) if task == "regression" else y)
        out[task] = net
    return out


#: Early-stopping loops (ELLA's streamed checks, sampled LLA's Adam) and every subspace
#: projector, with held-out rows.
_EXTRA = {
    "ELLARegressor": [("early_stopping", {"early_stopping": True, "search_freq": 20}),
                      ("early_stopping_fixed_prior", {"early_stopping": True, "search_freq": 20,
                                                      "prior_variance": 0.05})],
    "ELLAClassifier": [("early_stopping", {"early_stopping": True, "search_freq": 20})],
    "SubspaceLaplaceRegressor": [(f"projector_{p}", {"projector": p}) for p in (
        "lowrank-diag", "subset-magnitude", "subset-diagonal", "subset-swag", "optimal")],
    "SampledLLARegressor": [("adam_early_stopping", {"early_stopping": True, "solver": "adam",
                                                     "max_iter": 200})],
}


def _strategies(entry):
    from sklearn.utils._param_validation import StrOptions

    est = entry.make(None)
    cons = type(est)._parameter_constraints.get("hyper_strategy")
    if cons is None or "hyper_strategy" not in est.get_params():
        return []
    opts = [c for c in cons if isinstance(c, StrOptions)]
    return sorted(o for o in opts[0].options if o != "auto") if opts else []


def _record(est, X_test, classifier):
    rec = {}
    if classifier:
        rec["proba"] = est.predict_proba(X_test)
    else:
        mean, std = est.predict(X_test, return_std=True)
        rec["mean"], rec["std"] = mean, std
    for name in ("prior_variance_", "noise_variance_", "temperature_"):
        v = getattr(est, name, None)
        if v is not None:
            rec[name] = np.asarray(v, dtype=float)
    return rec


def run():
    data = _data()
    nets = _nets(data)
    results, names = {}, []
    for k, entry in enumerate(ESTIMATORS):
        task = "classification" if entry.is_classifier else "regression"
        X, y, Xv, yv, Xt = data[task]
        net = nets[task]
        cases = [("default", None, {}, None),
                 ("pretrained_val", net, {}, (Xv, yv)),
                 ("pretrained", net, {}, None)]
        cases += [(f"hyper_{s}", None, {"hyper_strategy": s}, None) for s in _strategies(entry)]
        cases.append(("fixed_prior", None, {"prior_variance": 0.05}, None))
        cases += [(label, net, kw, (Xv, yv)) for label, kw in _EXTRA.get(entry.cls.__name__, [])]
        if task == "regression":
            cases.append(("fixed_noise", None, {"noise_variance": 0.3}, None))
            cases.append(("fixed_both", None, {"noise_variance": 0.3, "prior_variance": 0.05},
                          None))
        for label, n, kw, val in cases:
            key = f"{k:02d}_{entry.id}_{label}"
            t = time.perf_counter()
            est = entry.make(n, random_state=0, **kw)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                try:
                    est.fit(X, y, validation_data=val)
                    rec = _record(est, Xt, task == "classification")
                except Exception as exc:  # a failing configuration is locked too
                    rec = {"error": np.array(f"{type(exc).__name__}: {exc}"[:200])}
            for name, v in rec.items():
                results[f"{key}::{name}"] = v
            names.append(key)
            print(f"{key:70s} {time.perf_counter() - t:6.1f} s", flush=True)
    return results


def compare(new, ref_path, rtol):
    ref = dict(np.load(ref_path, allow_pickle=False))
    worst, bad = {}, False
    for key in sorted(set(ref) | set(new)):
        est = key.split("::")[0]
        if key not in ref or key not in new:
            print(f"MISSING {key} (in {'new' if key in new else 'ref'} only)")
            bad = True
            continue
        a, b = np.asarray(new[key]), np.asarray(ref[key])
        if a.dtype.kind in "US":
            d = 0.0 if str(a) == str(b) else np.inf
        else:
            d = float(np.max(np.abs(a - b) / np.maximum(np.abs(b), 1e-300))) if a.size else 0.0
            if a.shape != b.shape:
                d = np.inf
        if d > worst.get(est, (-1.0, ""))[0]:
            worst[est] = (d, key.split("::")[1])
    for est, (d, what) in worst.items():
        flag = "" if d <= rtol else "   <-- DIFFERS"
        bad |= d > rtol
        print(f"{est:70s} max rel {d:.2e} ({what}){flag}")
    print(f"IDENTICAL to rtol={rtol:g}" if not bad else f"DIFFERENCES above rtol={rtol:g}")
    return 1 if bad else 0


def main():
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--compare")
    p.add_argument("--rtol", type=float, default=1e-8)
    a = p.parse_args()
    t = time.perf_counter()
    res = run()
    np.savez(a.out, **res)
    print(f"saved {len(res)} arrays to {a.out} in {time.perf_counter() - t:.0f} s")
    if a.compare:
        sys.exit(compare(res, a.compare, a.rtol))


if __name__ == "__main__":
    main()
