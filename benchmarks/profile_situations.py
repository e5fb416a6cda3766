"""Where does situation (c) ``fit(X, y, validation_data=...)`` spend its extra time?

cProfile of one estimator's fit in situation (b) ``fit(X, y)`` and (c) on the
airline-nyc table of ``reproduce.py --data airline-nyc`` (the same split, cached net
and ``--subsample`` rows; run that first so the net is cached, or this trains it).
Prints the wall time of each fit and the top ``--top`` functions by cumulative and by
internal time.

Usage::

    python benchmarks/profile_situations.py --estimator ELLARegressor
    python benchmarks/profile_situations.py --estimator "LLARegressor[last_layer]"
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _airline_nyc as A  # noqa: E402
from _common import set_threads  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--estimator", default="ELLARegressor", help="registry id")
    ap.add_argument("--subsample", type=int, default=50_000)
    ap.add_argument("--iterations", type=int, default=20_000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--situations", default="b,c")
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    set_threads(args.threads)
    sp = A.load_splits("none", args.seed, None)
    X_tr, y_tr = sp["train"]
    path, _, _ = A.train_or_load(X_tr, y_tr, "none", args.seed, args.iterations)
    net = A.load_net(path)
    rng = np.random.default_rng(args.seed + 1)
    idx = np.sort(rng.choice(len(y_tr), min(args.subsample, len(y_tr)), replace=False))
    fit = (X_tr[idx], y_tr[idx])
    entry = next(e for e in A._regressors() if e.id == args.estimator)
    for sit in args.situations.split(","):
        est = entry.cls(net, **entry.params, random_state=args.seed)
        kw = {"validation_data": sp["held"]} if sit == "c" else {}
        prof = cProfile.Profile()
        t = time.perf_counter()
        prof.enable()
        est.fit(*fit, **kw)
        prof.disable()
        wall = time.perf_counter() - t
        hyp = {k: getattr(est, k) for k in ("prior_precision_", "noise_variance_")
               if hasattr(est, k)}
        print(f"\n=== {args.estimator} ({sit}): fit {wall:.1f} s on {len(fit[1]):,} rows"
              + (f" + {len(sp['held'][1]):,} held-out rows" if kw else "")
              + f"; {hyp}; load {os.getloadavg()[0]:.2f}")
        for key in ("cumulative", "tottime"):
            buf = io.StringIO()
            pstats.Stats(prof, stream=buf).sort_stats(key).print_stats(args.top)
            text = buf.getvalue()
            print(f"--- by {key}\n" + text[text.index("ncalls"):] if "ncalls" in text else text)


if __name__ == "__main__":
    main()
