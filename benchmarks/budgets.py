"""Default budgets (issue 19, item 4): does every estimator's default fit finish?

Three measurements, every registered configuration (``sklearn_lla._registry.ESTIMATORS``)
with its default parameters (``Est(net, **entry.params, random_state=0)``):

1. **A load_digits-sized table** (1,797 x 64). Classifiers: ``load_digits`` (10
   classes). Regressors: ``make_friedman1(n_samples=1797, n_features=64, noise=1.0,
   random_state=0)`` (same shape; only 5 features matter), y standardised. X
   standardised. The net: a skorch MLP (2 x 50 tanh, Adam lr 3e-3, weight decay 1e-4,
   batch 128, 200 epochs, ``train_split=None``), as in ``benchmarks/calibration.py``.
   Situation (b): the net trained on all 1,797 rows, ``fit(X, y)``; situation (c): a
   net trained on a random 80 % (1,437 rows), ``fit(X_80, y_80,
   validation_data=(X_20, y_20))``. Both predict on all 1,797 rows (``predict_proba`` /
   ``predict(return_std=True)``). Budget: fit + predict <= 60 s on 2 cores.
2. **A Year-shaped regression** (20,000 x 90), the problem and the 3 x 200 tanh MLP of
   ``benchmarks/bench_ella.py`` (``make_problem`` / ``make_net``, 2 epochs), predicting
   5,000 test rows; situation (b) by default (``--year-situations b,c`` adds (c) with
   2,000 fresh validation rows). Budget: fit + predict <= 3 x ELLARegressor's in the
   same run.
3. **Step costs** of VaLLA and FMGP, regression vs classification, on the tables of 1
   in situation (b): ``max_iter=n`` with ``early_stopping=False`` for the two budgets
   of ``--steps`` (default 20 and 120); per-step time = (t(n2) - t(n1)) / (k2 - k1),
   k the steps the fits report (``n_iter_``, else n), which removes the set-up cost;
   each budget's time is the fastest of ``--repeats`` fits (default 3).
   Reported: the classification / regression ratio and that ratio divided by C = 10
   classes (issue 19: "no more than about C times").

Every fit runs in its own subprocess (``run_child``), fed the data and the trained net
through a pickle, so that a time-out (``--timeout``, the child is killed) or a memory
limit (``--mem-limit-mb``, the child exits when its RSS exceeds it) ends only that
measurement; its peak RSS is its own. Before the timed fit each child fits the same
configuration once on the table's first 256 rows, untimed (``warm_up``; ``--no-warmup``
switches it off), so that one-time costs of a process (``torch._dynamo``'s import by the
first ``torch.optim.Adam``: 1.1-1.4 s, which only the Adam-based estimators paid) are
not counted as fit time. ConvergenceWarnings are counted per fit (the
issue's criterion: none on scikit-learn's bundled data sets); every other warning is
listed. Ratios are to ELLA of the same task, table and situation in the same run.

Usage::

    python benchmarks/budgets.py                          # everything (tens of minutes)
    python benchmarks/budgets.py --parts digits --estimators ELLA,VaLLA
    python benchmarks/budgets.py --parts steps --steps 10,60
    python benchmarks/budgets.py --out budgets.md --json budgets.json
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import sys
import tempfile
import time
import warnings

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from _common import (  # noqa: E402
    RSSSampler,
    fitted_hypers,
    markdown_table,
    peak_rss_mb,
    run_child,
    set_threads,
    train_skorch_mlp,
    warning_summary,
)

DIGITS_BUDGET_S = 60.0
YEAR_BUDGET_X_ELLA = 3.0
NET_CFG = dict(hidden=(50, 50), lr=3e-3, weight_decay=1e-4, max_epochs=200, batch_size=128)
YEAR_CFG = dict(n_train=20_000, n_test=5_000, n_val=2_000, n_features=90,
                hidden=(200, 200, 200), epochs=2)
STEP_METHODS = ("VaLLA", "FMGP")


# ------------------------------------------------------------------- problems
def digits_tables(seed=0):
    """``{task: dict(X, y, net_b, net_c, X_fit, y_fit, X_val, y_val)}`` of part 1."""
    from sklearn.datasets import load_digits, make_friedman1
    from sklearn.model_selection import train_test_split
    from sklearn.preprocessing import StandardScaler

    out = {}
    Xc, yc = load_digits(return_X_y=True)
    Xr, yr = make_friedman1(n_samples=len(Xc), n_features=Xc.shape[1], noise=1.0,
                            random_state=seed)
    for task, X, y in (("classification", Xc, yc), ("regression", Xr, yr)):
        clf = task == "classification"
        X = StandardScaler().fit_transform(X).astype(np.float32)
        y = y.astype(np.int64) if clf else ((y - y.mean()) / y.std()).astype(np.float32)
        X_fit, X_val, y_fit, y_val = train_test_split(X, y, test_size=0.2, random_state=seed,
                                                      stratify=y if clf else None)
        n_out = int(y.max()) + 1 if clf else 1
        kw = dict(hidden=NET_CFG["hidden"], lr=NET_CFG["lr"],
                  weight_decay=NET_CFG["weight_decay"], max_epochs=NET_CFG["max_epochs"],
                  batch_size=NET_CFG["batch_size"], seed=seed, holdout=False)
        out[task] = dict(task=task, X=X, y=y, X_fit=X_fit, y_fit=y_fit, X_val=X_val,
                         y_val=y_val, X_pred=X, net_b=train_skorch_mlp(X, y, clf, n_out, **kw),
                         net_c=train_skorch_mlp(X_fit, y_fit, clf, n_out, **kw))
    return out


def year_table(seed=0):
    """The Year-shaped problem and net of ``bench_ella.py`` (plus validation rows)."""
    from bench_ella import make_net, make_problem

    c = YEAR_CFG
    X, y, Xrest, yrest = make_problem(c["n_train"], c["n_test"] + c["n_val"], c["n_features"],
                                      seed)
    net = make_net(X, y, c["hidden"], c["epochs"], seed)
    return dict(task="regression", X=X, y=y[:, 0], X_fit=X, y_fit=y[:, 0],
                X_val=Xrest[c["n_test"]:], y_val=yrest[c["n_test"]:, 0],
                X_pred=Xrest[:c["n_test"]], net_b=net, net_c=net)


# ----------------------------------------------------------------------- child
WARMUP_ROWS = 256


def warm_up(entry, over, prob, sit):
    """Fit and predict the same configuration once on a slice of the table, untimed.

    What a process pays once (imports such as ``torch._dynamo``, which the first
    ``torch.optim.Adam`` pulls in: 1.1-1.4 s on this machine, charged before this to
    the estimators that run Adam and to no other; first-call set-up of the BLAS and
    of ``torch.func``) is not part of a fit's cost, and a user who trained the net in
    the same session has paid it already. Every estimator gets the same warm-up: the
    first rows of the table (classification: one row of each class first), and in
    situation (c) a slice of the validation rows. Returns ``(seconds, error or None)``.
    """
    X, y = prob["X_fit" if sit == "c" else "X"], prob["y_fit" if sit == "c" else "y"]
    n = min(WARMUP_ROWS, len(X))
    if prob["task"] == "classification":
        first = np.unique(y, return_index=True)[1]
        rest = np.setdiff1d(np.arange(len(X)), first)[:max(0, n - len(first))]
        idx = np.sort(np.concatenate([first, rest]))
    else:
        idx = np.arange(n)
    t = time.perf_counter()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            est = entry.cls(prob["net_" + sit], **{**entry.params, **over}, random_state=0)
            kw = ({"validation_data": (prob["X_val"][:64], prob["y_val"][:64])}
                  if sit == "c" else {})
            est.fit(X[idx], y[idx], **kw)
            if prob["task"] == "classification":
                est.predict_proba(X[:16])
            else:
                est.predict(X[:16], return_std=True)
        err = None
    except Exception as exc:  # noqa: BLE001 - the timed fit reports its own errors
        err = f"{type(exc).__name__}: {exc}"[:120]
    return time.perf_counter() - t, err


def child(args):
    """Fit one configuration on one pickled table; print ``RESULT {json}``."""
    from sklearn.exceptions import ConvergenceWarning

    set_threads(args.threads)
    from sklearn_lla._registry import ESTIMATORS

    with open(args.problem, "rb") as fh:
        prob = pickle.load(fh)
    entry = ESTIMATORS[args.entry]
    over = json.loads(args.overrides)
    sit = args.situation
    res = dict(entry=entry.id, situation=sit, overrides=over, error=None)
    if args.warmup:
        res["warmup_s"], res["warmup_error"] = warm_up(entry, over, prob, sit)
    with RSSSampler(limit_mb=args.mem_limit_mb or None) as rss:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                est = entry.cls(prob["net_" + sit], **{**entry.params, **over}, random_state=0)
                t = time.perf_counter()
                if sit == "c":
                    est.fit(prob["X_fit"], prob["y_fit"],
                            validation_data=(prob["X_val"], prob["y_val"]))
                else:
                    est.fit(prob["X"], prob["y"])
                res["fit_s"] = time.perf_counter() - t
                t = time.perf_counter()
                if prob["task"] == "classification":
                    est.predict_proba(prob["X_pred"])
                else:
                    est.predict(prob["X_pred"], return_std=True)
                res["predict_s"] = time.perf_counter() - t
                res["hypers"] = fitted_hypers(est)
            except Exception as exc:  # noqa: BLE001 - reported, never raised
                msg = f"{type(exc).__name__}: {exc}".replace("\n", " ")
                res["error"] = msg[:200]
        res["convergence_warnings"] = sum(issubclass(w.category, ConvergenceWarning)
                                          for w in caught)
        res["warnings"] = warning_summary(caught)
    res["peak_mb"] = rss.peak
    print("RESULT " + json.dumps(res, default=str), flush=True)


def measure(path, entry_index, situation, overrides, args):
    """Run one child; a result dict (``error`` set on failure / time-out / memory)."""
    cli = ["--child", "--problem", path, "--entry", str(entry_index), "--situation",
           situation, "--overrides", json.dumps(overrides), "--threads", str(args.threads),
           "--mem-limit-mb", str(args.mem_limit_mb)] + ([] if args.warmup else ["--no-warmup"])
    t = time.perf_counter()
    res, code, err = run_child(__file__, cli, env={"OMP_NUM_THREADS": str(args.threads)},
                               timeout=args.timeout or None)
    wall = time.perf_counter() - t
    if res is None:
        why = (f"TIMEOUT after {args.timeout:g} s" if code == "timeout" else
               f"memory limit {args.mem_limit_mb} MB exceeded" if code == 3 else
               f"child failed (exit {code}): {err.strip().splitlines()[-1:] if err else ''}")
        res = dict(error=why, convergence_warnings=None, warnings=[], peak_mb=None)
    res["child_wall_s"] = wall
    return res


# ---------------------------------------------------------------------- parts
def _total(r):
    return r["fit_s"] + r["predict_s"] if r.get("fit_s") is not None and not r["error"] else None


def _ella_ratio(rows, table, task, sit, tot):
    ella = [r for r in rows if r["table"] == table and r["situation"] == sit
            and r["entry"].startswith("ELLA") and r["task"] == task]
    base = _total(ella[0]) if ella else None
    return tot / base if tot is not None and base else None


def run_budgets(problems, entries, situations, args, table):
    """Part 1 / 2: every entry x situation on ``problems`` ({task: path})."""
    rows = []
    for idx, entry in entries:
        task = "classification" if entry.is_classifier else "regression"
        if task not in problems:
            continue
        for sit in situations:
            r = measure(problems[task], idx, sit, {}, args)
            r.update(entry=entry.id, task=task, situation=sit, table=table)
            rows.append(r)
            print(f"  {table} ({sit}) {entry.id}: "
                  + (f"{_total(r):.1f} s" if _total(r) is not None else r["error"]), flush=True)
    for r in rows:
        r["total_s"] = _total(r)
        r["x_ella"] = _ella_ratio(rows, table, r["task"], r["situation"], r["total_s"])
    return rows


def budget_table(rows, year):
    body = []
    for r in rows:
        tot = r["total_s"]
        if year:
            ok = r["x_ella"] is not None and r["x_ella"] <= YEAR_BUDGET_X_ELLA
        else:
            ok = tot is not None and tot <= DIGITS_BUDGET_S
        notes = r["error"] or " ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}"
                                       for k, v in r.get("hypers", {}).items())
        if r.get("warnings"):
            notes += " [warn: " + "; ".join(r["warnings"]) + "]"
        body.append([r["entry"], r["situation"], r.get("fit_s"), r.get("predict_s"), tot,
                     r["x_ella"], "yes" if ok else "NO", r["convergence_warnings"],
                     r["peak_mb"], notes])
    budget = (f"<= {YEAR_BUDGET_X_ELLA:g} x ELLA" if year else f"<= {DIGITS_BUDGET_S:g} s")
    return markdown_table(["estimator", "situation", "fit s", "predict s", "total s", "x ELLA",
                           budget, "ConvergenceWarnings", "peak MB", "notes"], body)


def run_steps(problems, entries, args):
    """Part 3: per-step time of VaLLA / FMGP, regression and classification."""
    n1, n2 = args.steps
    rows = []
    for idx, entry in entries:
        if not any(entry.cls.__name__.startswith(m) for m in STEP_METHODS):
            continue
        task = "classification" if entry.is_classifier else "regression"
        ts = []
        for n in (n1, n2):
            # the fastest of --repeats fits: the least disturbed by other load (a
            # difference of two single fits can even come out negative under load)
            runs = [measure(problems[task], idx, "b", {"max_iter": n, "early_stopping": False},
                            args) for _ in range(args.repeats)]
            good = [r for r in runs if _total(r) is not None]
            ts.append(min(good, key=lambda r: r["fit_s"]) if good else runs[0])
        ok = all(_total(r) is not None for r in ts)
        ks = [r.get("hypers", {}).get("n_iter", n) for r, n in zip(ts, (n1, n2))]
        ks = [k if isinstance(k, int) else n for k, n in zip(ks, (n1, n2))]
        ok = ok and ks[1] > ks[0]
        per = (ts[1]["fit_s"] - ts[0]["fit_s"]) / (ks[1] - ks[0]) if ok else None
        rows.append(dict(entry=entry.id, method=entry.cls.__name__.replace(
            "Classifier", "").replace("Regressor", ""), task=task, per_step_s=per,
            fits=ts, steps=ks, error=None if ok else next(
                (r["error"] for r in ts if r["error"]), f"steps done {ks}")))
        print(f"  steps {entry.id}: " + (f"{per * 1e3:.1f} ms/step" if ok else rows[-1]["error"]),
              flush=True)
    return rows


def steps_table(rows, n_classes):
    body = []
    for r in rows:
        reg = next((q for q in rows if q["method"] == r["method"]
                    and q["task"] == "regression"), None)
        ratio = (r["per_step_s"] / reg["per_step_s"]
                 if r["task"] == "classification" and reg and r["per_step_s"]
                 and reg["per_step_s"] else None)
        body.append([r["entry"], r["task"], None if r["per_step_s"] is None
                     else r["per_step_s"] * 1e3, ratio,
                     None if ratio is None else ratio / n_classes,
                     r["error"] or f"fits of {r['steps'][0]} / {r['steps'][1]} steps: "
                                   f"{r['fits'][0]['fit_s']:.2f} / {r['fits'][1]['fit_s']:.2f} s"])
    return markdown_table(["estimator", "task", "ms / step", "clf / reg step",
                           f"(clf / reg) / C (C = {n_classes})", "notes"], body)


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default="digits,year,steps",
                    help="comma-separated subset of digits, year, steps")
    ap.add_argument("--estimators", default="",
                    help="comma-separated case-insensitive substrings of registry ids "
                         "('=ID' matches exactly); ELLA is always measured for the ratios")
    ap.add_argument("--situations", default="b,c", help="situations of the digits-sized part")
    ap.add_argument("--year-situations", default="b", help="situations of the Year part")
    ap.add_argument("--steps", default="20,120", help="the two max_iter budgets of the step part")
    ap.add_argument("--repeats", type=int, default=3,
                    help="fits per budget in the step part; the fastest is used")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=600.0,
                    help="seconds per fit (the child is killed; 0: none)")
    ap.add_argument("--mem-limit-mb", type=float, default=6000.0,
                    help="a child whose RSS exceeds this exits (0: none)")
    ap.add_argument("--no-warmup", dest="warmup", action="store_false",
                    help="time each fit cold: without an untimed fit of the same "
                         "configuration on a slice first (see warm_up)")
    ap.add_argument("--out", help="write the markdown tables to this file")
    ap.add_argument("--json", help="write every raw number to this file")
    # child mode
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--problem", help=argparse.SUPPRESS)
    ap.add_argument("--entry", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--situation", help=argparse.SUPPRESS)
    ap.add_argument("--overrides", default="{}", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args)
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    args.steps = [int(v) for v in args.steps.split(",")]
    if len(args.steps) != 2 or args.steps[0] >= args.steps[1]:
        ap.error("--steps takes two increasing budgets, e.g. 10,50")
    set_threads(args.threads)
    import sklearn
    import torch

    import sklearn_lla
    from sklearn_lla._registry import ESTIMATORS

    pats = [e.strip().lower() for e in args.estimators.split(",") if e.strip()]
    entries = [(i, e) for i, e in enumerate(ESTIMATORS)
               if not pats or e.cls.__name__.startswith("ELLA") or any(
                   e.id.lower() == s[1:] if s.startswith("=") else s in e.id.lower()
                   for s in pats)]
    t0 = time.perf_counter()
    out = dict(budgets={}, steps=[])
    doc = []
    with tempfile.TemporaryDirectory() as tmp:
        paths = {}
        if "digits" in parts or "steps" in parts:
            for task, prob in digits_tables().items():
                paths[task] = os.path.join(tmp, f"digits_{task}.pkl")
                with open(paths[task], "wb") as fh:
                    pickle.dump(prob, fh)
        if "digits" in parts:
            sits = [s.strip() for s in args.situations.split(",") if s.strip()]
            rows = run_budgets(paths, entries, sits, args, "digits-sized")
            out["budgets"]["digits"] = rows
            doc.append("### Load_digits-sized tables (1,797 x 64)\n\n" + budget_table(rows, False))
        if "year" in parts:
            ypath = os.path.join(tmp, "year.pkl")
            with open(ypath, "wb") as fh:
                pickle.dump(year_table(), fh)
            sits = [s.strip() for s in args.year_situations.split(",") if s.strip()]
            rows = run_budgets({"regression": ypath}, entries, sits, args, "year")
            out["budgets"]["year"] = rows
            doc.append("### Year-shaped regression (20,000 x 90, 3 x 200 tanh MLP, 5,000 "
                       "test rows)\n\n" + budget_table(rows, True))
        if "steps" in parts:
            out["steps"] = run_steps(paths, entries, args)
            doc.append(f"### Step costs (max_iter {args.steps[0]} vs {args.steps[1]}, "
                       "early_stopping=False, situation (b), digits-sized tables)\n\n"
                       + steps_table(out["steps"], 10))
    total = time.perf_counter() - t0
    env = (f"sklearn_lla {sklearn_lla.__version__}, torch {torch.__version__}, sklearn "
           f"{sklearn.__version__}, {args.threads} threads per fit, timeout {args.timeout:g} s, "
           f"memory limit {args.mem_limit_mb:g} MB; total {total:.0f} s, parent peak RSS "
           f"{peak_rss_mb():.0f} MB")
    text = "\n\n".join(doc + [env])
    print("\n" + text)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write("# Default budgets (benchmarks/budgets.py)\n\n" + text + "\n")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(dict(env=env, total_s=total, args=vars(args), **out), fh, indent=1,
                      default=str)


if __name__ == "__main__":
    main()
