"""Scale: ELLA and last-layer LLA (defaults) on a Taxi-shaped parquet table, with Dask.

Setting (issue 14): the papers' Taxi regression (the features of ../shared/METHODS.md:
time of day in seconds, day of week, day of month, month, PULocationID, DOLocationID,
trip distance, trip duration -> total amount) as a synthetic parquet table of N rows
(0.3M, 1M, 3M), read with ``dask.dataframe.read_parquet`` and never loaded whole;
a pretrained 3 x 200 tanh MLP (float32, P = 82,401);
``ELLARegressor(net, random_state=0)`` and
``LLARegressor(net, subset_of_weights="last_layer")`` with every other parameter at
its default ("auto" prior and noise by the evidence: no held-out rows).

Two ways of running, each in a FRESH subprocess (clean peak RSS):

* ``single``: dask's default (threaded, 2 threads) scheduler in one process, torch
  with one thread per dask thread;
* ``cluster``: a ``distributed.LocalCluster(n_workers=2, threads_per_worker=1)`` on
  the same machine; the row-sum passes run on the workers.

Measured: fit time, predict time (``predict(X, return_std=True)`` over all N rows,
reduced to two numbers on the workers so the outputs are not collected), and the
peak RSS (``ru_maxrss``) of the client process and of each worker. Targets: 3M rows
fitted in <= 5 min on 2 cores, <= 3 GB per process, time linear in N, memory flat.

The table is written in ``--workdir`` (default: a ``bench_scale`` folder in the
system temp dir) as one parquet file per 100,000 rows, generated chunk by chunk, and
reused when asked again.

Usage::

    python benchmarks/bench_scale.py --sizes 300000 1000000 3000000
    python benchmarks/bench_scale.py --sizes 300000 --methods last_layer --modes cluster
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import markdown_table, peak_rss_mb, run_child  # noqa: E402

FEATURES = ["time_of_day", "day_of_week", "day_of_month", "month", "PULocationID",
            "DOLocationID", "trip_distance", "duration"]
TARGET = "total_amount"
ROWS_PER_FILE = 100_000
HIDDEN = (200, 200, 200)


def _chunk(n, rng):
    """``n`` Taxi-shaped rows: raw features, a fare-like target; standardised later."""
    t = rng.uniform(0, 86400, n)
    dow = rng.integers(0, 7, n).astype(float)
    dom = rng.integers(1, 32, n).astype(float)
    month = np.ones(n)
    pu = rng.integers(1, 266, n).astype(float)
    do = rng.integers(1, 266, n).astype(float)
    dist = rng.gamma(1.5, 2.0, n)
    dur = np.clip(dist * rng.uniform(120, 400, n) + rng.normal(0, 60, n), 10, 18000)
    amount = (3.0 + 2.5 * dist + 0.01 * dur + 2.0 * np.sin(2 * np.pi * t / 86400)
              + 0.5 * (dow >= 5) + rng.gamma(2.0, 1.0, n))
    return np.stack([t, dow, dom, month, pu, do, dist, dur], 1), amount


# fixed standardisation (the statistics of the generator, so every N shares them)
_MEAN = np.array([43200, 3, 16, 1, 133, 133, 3.0, 780.0])
_STD = np.array([24942, 2, 8.9, 1, 76.5, 76.5, 2.45, 700.0])


def _standardise(X, a):
    return ((X - _MEAN) / _STD).astype(np.float32), ((a - 16.0) / 8.0).astype(np.float32)


def make_table(workdir, n, seed=0):
    """Write (once) the parquet folder of ``n`` rows; returns its path."""
    import pandas as pd

    path = os.path.join(workdir, f"taxi_{n}")
    if os.path.exists(os.path.join(path, "_done")):
        return path
    os.makedirs(path, exist_ok=True)
    rng = np.random.default_rng(seed)
    for k, start in enumerate(range(0, n, ROWS_PER_FILE)):
        X, a = _standardise(*_chunk(min(ROWS_PER_FILE, n - start), rng))
        df = pd.DataFrame(X, columns=FEATURES).assign(**{TARGET: a})
        df.to_parquet(os.path.join(path, f"part.{k:04d}.parquet"), index=False)
    open(os.path.join(path, "_done"), "w").close()
    return path


def make_net(workdir):
    """The "pretrained" MLP: 300 Adam steps on 20,000 rows drawn like the table."""
    import torch

    from sklearn_lla.nets import MLP

    path = os.path.join(workdir, "net.pt")
    net = MLP(len(FEATURES), 1, HIDDEN, dtype=torch.float32)
    if os.path.exists(path):
        net.load_state_dict(torch.load(path))
        return net.eval()
    X, a = _standardise(*_chunk(20_000, np.random.default_rng(123)))
    X, a = torch.from_numpy(X), torch.from_numpy(a)[:, None]
    gen = torch.Generator().manual_seed(0)
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    for _ in range(300):
        idx = torch.randint(0, len(X), (256,), generator=gen)
        loss = ((net(X[idx]) - a[idx]) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    torch.save(net.state_dict(), path)
    return net.eval()


def _estimator(method, net, n_components="auto"):
    from sklearn_lla import ELLARegressor, LLARegressor

    if method == "ella":
        return ELLARegressor(net, n_components=n_components, random_state=0)
    return LLARegressor(net, subset_of_weights="last_layer", random_state=0)


def child(args):
    """One measurement (runs in its own process); prints ``RESULT {json}``."""
    import resource

    import torch

    torch.set_num_threads(1)
    import dask
    import dask.dataframe as dd

    client = None
    if args.mode == "cluster":
        from distributed import Client, LocalCluster

        client = Client(LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                                     dashboard_address=None))
    else:
        dask.config.set(scheduler="threads", num_workers=2)
    net = make_net(args.workdir)
    ddf = dd.read_parquet(args.table)
    k = args.ella_components
    est = _estimator(args.method, net, k if k == "auto" else int(k))
    t0 = time.perf_counter()
    est.fit(ddf[FEATURES], ddf[TARGET])
    t_fit = time.perf_counter() - t0
    mean, std = est.predict(ddf[FEATURES], return_std=True)
    t0 = time.perf_counter()
    msum, smean = dask.compute(mean.sum(), std.mean())
    t_pred = time.perf_counter() - t0
    res = {"fit_s": t_fit, "predict_s": t_pred, "client_rss_mb": peak_rss_mb(),
           "K": int(getattr(est, "n_components_", est.posterior_.features.dim)),
           "mean_std": float(smean), "noise_variance": float(est.noise_variance_)}
    if client is not None:
        def worker_peak():
            return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0

        res["worker_rss_mb"] = sorted(client.run(worker_peak).values())
        client.close()
    print("RESULT " + json.dumps(res), flush=True)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[300_000, 1_000_000])
    p.add_argument("--methods", nargs="+", default=["last_layer", "ella"],
                   choices=["last_layer", "ella"])
    p.add_argument("--modes", nargs="+", default=["single", "cluster"],
                   choices=["single", "cluster"])
    p.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "bench_scale"))
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--ella-components", default="auto",
                   help="ELLA's n_components (default: the estimator's default, 'auto')")
    p.add_argument("--json", default=None, help="also write the results here")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--table", help=argparse.SUPPRESS)
    p.add_argument("--method", help=argparse.SUPPRESS)
    p.add_argument("--mode", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    os.makedirs(args.workdir, exist_ok=True)
    if args.child:
        return child(args)
    make_net(args.workdir)
    rows, results = [], []
    for n in args.sizes:
        table = make_table(args.workdir, n)
        for method in args.methods:
            for mode in args.modes:
                res, rc, err = run_child(__file__, [
                    "--child", "--table", table, "--method", method, "--mode", mode,
                    "--workdir", args.workdir, "--ella-components", args.ella_components],
                    timeout=args.timeout)
                load = os.getloadavg()[0]
                if res is None:
                    print(f"N={n} {method} {mode}: failed ({rc})\n{err}", file=sys.stderr)
                    rows.append([f"{n / 1e6:g}M", method, mode, "failed", "", "", "",
                                 f"{load:.1f}"])
                    continue
                res.update(n=n, method=method, mode=mode, load1=load)
                results.append(res)
                workers = res.get("worker_rss_mb")
                rows.append([f"{n / 1e6:g}M", method, mode, f"{res['fit_s']:.1f}",
                             f"{res['predict_s']:.1f}",
                             f"{res['client_rss_mb']:.0f}",
                             "/".join(f"{w:.0f}" for w in workers) if workers else "-",
                             f"{load:.1f}"])
                print(rows[-1], flush=True)
    print(markdown_table(["N", "method", "mode", "fit s", "predict s", "client peak MB",
                          "worker peak MB", "load (1 min)"], rows))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=1)


if __name__ == "__main__":
    main()
