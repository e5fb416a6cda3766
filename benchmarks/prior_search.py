"""Which GridSearchCV recipe over ``prior_variance`` keeps the uncertainty (issue 33).

For each data set and seed: the splits and the ``train_split=None`` net of
``benchmarks/calibration.py`` (``gap``: the clustered 1-D toy, its gaps as the
"shift" rows), then the raw net, the default ``"auto"`` estimator, and
``GridSearchCV(Est(net), {"prior_variance": grid})`` scored by

* ``cv-nll`` / ``cv-logloss``: the NLL on 3 folds of the training rows;
* ``evidence``: the fitted estimator's ``log_marginal_likelihood_``;
* ``perturbed0.5`` / ``perturbed1``: the mean of the NLL on the fold and on a copy of
  it with the (standardised) inputs perturbed by N(0, s^2);
* ``heldout-fold``: the NLL on the validation rows (a ``PredefinedSplit``), then the
  best prior refitted on the training rows.

Reported per recipe: in-distribution test NLL, shifted NLL (regression) or noise-image
OOD AUC (digits), the chosen prior and whether it is an edge of the grid. One JSON line
per (data set, seed)::

    python benchmarks/prior_search.py friedman1 0,1
    python benchmarks/prior_search.py digits 0
"""
import json
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import train_skorch_mlp  # noqa: E402
from calibration import problem  # noqa: E402
from sklearn.metrics import log_loss  # noqa: E402
from sklearn.model_selection import GridSearchCV, PredefinedSplit  # noqa: E402

from sklearn_lla import LLAClassifier, LLARegressor  # noqa: E402
from sklearn_lla.metrics import (  # noqa: E402
    gaussian_nll,
    neg_log_loss_scorer,
    neg_nll_scorer,
    ood_auc,
)


def evidence_per_row(est, X, y):
    """The fitted estimator's log marginal likelihood (the fold's rows are not used)."""
    return float(est.log_marginal_likelihood_)


def perturbed(scale, base):
    """``base``'s mean over the fold and a copy with inputs perturbed by N(0, scale^2)."""
    def scorer(est, X, y):
        rng = np.random.RandomState(0)
        Xp = (X + scale * rng.randn(*X.shape)).astype(X.dtype)
        return 0.5 * (base(est, X, y) + base(est, Xp, y))
    return scorer


def gap_problem(seed):
    """The clustered 1-D toy: its gaps are the shifted rows."""
    from sklearn_lla.datasets import make_toy_regression

    Xtr, ytr = make_toy_regression("clusters", n_samples=150, random_state=seed)
    Xva, yva = make_toy_regression("clusters", n_samples=60, random_state=1000 + seed)
    Xte, yte = make_toy_regression("clusters", n_samples=300, random_state=2000 + seed)
    rng = np.random.RandomState(3000 + seed)
    xg = np.r_[rng.uniform(-2.5, -0.5, 150), rng.uniform(0.5, 2.5, 150)][:, None]
    yg = np.sin(2 * xg[:, 0]) + 0.2 * rng.randn(300)

    def f(a):
        return a.astype(np.float32)

    return dict(classification=False, n_out=1, mu=0.0, sd=1.0, Xtr=f(Xtr), ytr=f(ytr),
                Xva=f(Xva), yva=f(yva), Xte=f(Xte), yte=yte, Xsh=f(xg), ysh=yg)


def run(name, seed, grid, hidden, cv=3):
    """Every recipe on one (data set, seed): ``{recipe: metrics}``."""
    p = gap_problem(seed) if name == "gap" else problem(name, seed)
    clf = p["classification"]
    net = train_skorch_mlp(p["Xtr"], p["ytr"], clf, p["n_out"], hidden=hidden, seed=seed,
                           holdout=False)
    Est = LLAClassifier if clf else LLARegressor
    base = neg_log_loss_scorer if clf else neg_nll_scorer

    def metrics(pred):
        if clf:
            return dict(NLL=log_loss(p["yte"], pred(p["Xte"]), labels=np.arange(p["n_out"])),
                        AUC=ood_auc(pred(p["Xte"]), pred(p["ood"]["noise"])))
        mt, st = pred(p["Xte"])
        ms, ss = pred(p["Xsh"])
        return dict(NLL=gaussian_nll(p["yte"], mt * p["sd"] + p["mu"], st * p["sd"]),
                    shift=gaussian_nll(p["ysh"], ms * p["sd"] + p["mu"], ss * p["sd"]))

    def predictor(est):
        return est.predict_proba if clf else (lambda X: est.predict(X, return_std=True))

    out = {}
    if clf:
        def raw(X):
            return torch.softmax(torch.as_tensor(net.forward(X)).double(), -1).numpy()
    else:
        r = net.predict(p["Xtr"]).ravel() - p["ytr"]
        s_raw = float(np.sqrt(np.mean(r ** 2)))

        def raw(X):
            return net.predict(X).ravel(), np.full(len(X), s_raw)
    out["raw"] = metrics(raw)
    t = time.time()
    d = Est(net, random_state=seed).fit(p["Xtr"], p["ytr"])
    out["default"] = dict(metrics(predictor(d)), pv=d.prior_variance_, t=time.time() - t)
    recipes = {"cv-" + ("logloss" if clf else "nll"): base, "evidence": evidence_per_row,
               "perturbed0.5": perturbed(0.5, base), "perturbed1": perturbed(1.0, base)}
    for rn, sc in recipes.items():
        t = time.time()
        gs = GridSearchCV(Est(net, random_state=seed), {"prior_variance": grid}, scoring=sc,
                          cv=cv).fit(p["Xtr"], p["ytr"])
        pv = gs.best_params_["prior_variance"]
        out[rn] = dict(metrics(predictor(gs.best_estimator_)), pv=pv,
                       edge=bool(pv in (grid[0], grid[-1])), t=time.time() - t)
    # folds the network did not see: the held-out rows as the only test fold
    t = time.time()
    Xa = np.concatenate([p["Xtr"], p["Xva"]])
    ya = np.concatenate([p["ytr"], p["yva"]])
    fold = np.r_[np.full(len(p["Xtr"]), -1), np.zeros(len(p["Xva"]))]
    gs = GridSearchCV(Est(net, random_state=seed), {"prior_variance": grid}, scoring=base,
                      cv=PredefinedSplit(fold), refit=False).fit(Xa, ya)
    pv = gs.best_params_["prior_variance"]
    b = Est(net, prior_variance=pv, random_state=seed).fit(p["Xtr"], p["ytr"])
    out["heldout-fold"] = dict(metrics(predictor(b)), pv=pv,
                               edge=bool(pv in (grid[0], grid[-1])), t=time.time() - t)
    return out


def _rounded(res):
    return {k: {kk: (round(vv, 4) if isinstance(vv, float) else vv) for kk, vv in v.items()}
            for k, v in res.items()}


if __name__ == "__main__":
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    which = sys.argv[1]
    for seed in (int(s) for s in sys.argv[2].split(",")):
        if which == "digits":
            res = run("digits", seed, list(np.logspace(-3, 1, 5)), (32,))
        else:
            res = run(which, seed, list(np.logspace(-3, 1, 9)), (50, 50))
        print(json.dumps({"data": which, "seed": seed, **_rounded(res)}), flush=True)
