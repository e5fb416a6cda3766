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
  best prior refitted on the training rows;
* ``1se-evidence``: the recipe the README ships, ``GridSearchCV(..., cv=PredefinedSplit,
  **prior_search_scoring())``: the candidates whose held-out NLL is within one standard
  error of the best are tied, the largest evidence among them wins, refitted on all rows;
* ``1se-largest``: the same rule with the largest tied prior as the tie-break;
* ``cv-cqm`` (regression): the CQM (interval calibration) on 3 folds of the training rows;
* ``quantile-folds`` (regression): the NLL on 3 extrapolation folds (terciles of the
  feature with the most distinct values, ``GroupKFold``) of the training rows.

The recipes of the first table of docs/model-selection.md (``cv-nll``, ``evidence``,
``perturbed*``) run only with ``--old``. ``readme`` is the README's 1-D data and net
(shifted rows 3.5 <= x <= 6). Grids: regression 10^-3 ... 10^2 in half decades, digits
10^-3 ... 10 in decades.

Reported per recipe: in-distribution test NLL, shifted NLL (regression) or noise-image
OOD AUC (digits), the chosen prior and whether it is an edge of the grid. One JSON line
per (data set, seed)::

    python benchmarks/prior_search.py friedman1 0,1,2
    python benchmarks/prior_search.py digits 0,1
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
from sklearn.model_selection import GridSearchCV, GroupKFold, PredefinedSplit  # noqa: E402

from sklearn_lla import LLAClassifier, LLARegressor  # noqa: E402
from sklearn_lla.metrics import (  # noqa: E402
    gaussian_nll,
    neg_cqm_scorer,
    neg_log_loss_scorer,
    neg_nll_scorer,
    ood_auc,
)
from sklearn_lla.model_selection import OneStandardErrorRule, prior_search_scoring  # noqa: E402


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


def readme_problem(seed):
    """The README's 1-D data and net; shifted rows: 3.5 <= x <= 6, beyond the data."""
    from skorch import NeuralNetRegressor

    from sklearn_lla.nets import MLP

    def draw(n, lo, hi, s):
        rng = np.random.RandomState(s)
        X = rng.uniform(lo, hi, (n, 1)).astype(np.float32)
        return X, (np.sin(2 * X) + 0.2 * rng.randn(n, 1)).astype(np.float32)

    Xtr, ytr = draw(300, -3, 3, seed)
    Xva, yva = draw(100, -3, 3, 1000 + seed)
    Xte, yte = draw(300, -3, 3, 2000 + seed)
    Xsh, ysh = draw(300, 3.5, 6, 3000 + seed)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        net = NeuralNetRegressor(MLP, module__n_features=1, module__hidden_layer_sizes=(50, 50),
                                 optimizer=torch.optim.Adam, lr=1e-2, max_epochs=200,
                                 train_split=None, verbose=0).fit(Xtr, ytr)
    return dict(classification=False, n_out=1, mu=0.0, sd=1.0, Xtr=Xtr, ytr=ytr.ravel(), Xva=Xva,
                yva=yva.ravel(), Xte=Xte, yte=yte.ravel(), Xsh=Xsh, ysh=ysh.ravel(), net=net)


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
    p = {"gap": gap_problem, "readme": readme_problem}.get(name, lambda s: problem(name, s))(seed)
    clf = p["classification"]
    net = p.get("net") or train_skorch_mlp(p["Xtr"], p["ytr"], clf, p["n_out"], hidden=hidden,
                                           seed=seed, holdout=False)
    Est = LLAClassifier if clf else LLARegressor
    base = neg_log_loss_scorer if clf else neg_nll_scorer

    def metrics(pred):
        if clf:
            return dict(NLL=log_loss(p["yte"], pred(p["Xte"]), labels=np.arange(p["n_out"])),
                        AUC=ood_auc(pred(p["Xte"]), pred(p["ood"]["noise"])))
        mt, st = (np.ravel(a) for a in pred(p["Xte"]))
        ms, ss = (np.ravel(a) for a in pred(p["Xsh"]))
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
    if not OLD:
        recipes = {}
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
    # the shipped recipe (README): the same held-out fold, prior_search_scoring's one-SE
    # rule with the evidence as tie-break, refitted on all rows; then the rule's other
    # tie-break (the largest tied prior) on the same cv_results_
    t = time.time()
    gs = GridSearchCV(Est(net, random_state=seed), {"prior_variance": grid},
                      cv=PredefinedSplit(fold), **prior_search_scoring(clf)).fit(Xa, ya)
    pv = gs.best_params_["prior_variance"]
    out["1se-evidence"] = dict(metrics(predictor(gs.best_estimator_)), pv=pv,
                               edge=bool(pv in (grid[0], grid[-1])), t=time.time() - t)
    t = time.time()
    pv = grid[OneStandardErrorRule(prefer="largest")(gs.cv_results_)]
    b = Est(net, prior_variance=pv, random_state=seed).fit(Xa, ya)
    out["1se-largest"] = dict(metrics(predictor(b)), pv=pv, edge=bool(pv in (grid[0], grid[-1])),
                              t=time.time() - t)
    out["heldout-curve"] = [round(-v, 4) for v in gs.cv_results_["mean_test_nll"]]
    out["se-curve"] = [round(v, 4) for v in gs.cv_results_["mean_test_nll_se"]]
    if not clf:
        # coverage / calibration on folds of the training rows, and extrapolation folds
        j = int(np.argmax([len(np.unique(c)) for c in p["Xtr"].T]))  # not a binary one
        groups = np.digitize(p["Xtr"][:, j], np.quantile(p["Xtr"][:, j], [1 / 3, 2 / 3]))
        for rn, sc, folds in (("cv-cqm", neg_cqm_scorer, cv),
                              ("quantile-folds", base, GroupKFold(3))):
            t = time.time()
            g = GridSearchCV(Est(net, random_state=seed), {"prior_variance": grid}, scoring=sc,
                             cv=folds).fit(p["Xtr"], p["ytr"], groups=groups)
            pv = g.best_params_["prior_variance"]
            out[rn] = dict(metrics(predictor(g.best_estimator_)), pv=pv,
                           edge=bool(pv in (grid[0], grid[-1])), t=time.time() - t)
    return out


def _rounded(res):
    return {k: ({kk: (round(vv, 4) if isinstance(vv, float) else vv) for kk, vv in v.items()}
                if isinstance(v, dict) else v) for k, v in res.items()}


OLD = "--old" in sys.argv


if __name__ == "__main__":
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    which = sys.argv[1]
    for seed in (int(s) for s in sys.argv[2].split(",")):
        if which == "digits":
            res = run("digits", seed, list(np.logspace(-3, 1, 5)), (32,))
        else:
            res = run(which, seed, list(np.logspace(-3, 2, 11)), (50, 50))
        print(json.dumps({"data": which, "seed": seed, **_rounded(res)}), flush=True)
