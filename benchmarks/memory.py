"""Memory and prediction cost of ELLARegressor (defaults) on a memmap, and of exact LLA.

Setting (the memory issue): a Year-shaped regression problem, N x 90 float32 read from a
``.npy`` memmap (``np.load(path, mmap_mode="r")``), a pretrained 3 x 200 tanh
``sklearn_lla.nets.MLP`` (float32, P = 98,801), ``ELLARegressor(net, random_state=0)``
with every other parameter at its default (M = 2000, K = 20, batch 256, "auto"
prior and noise from a 10 % hold-out).

Targets of the issue: peak RSS of fit + predict <= 3 GB at N = 1,000,000 (model +
O(batch) + outputs), and predict time <= 1.5 (K + 1) bare forward passes over the same
X in the same batch size; exact LLA (``LLARegressor``, function space at N < P) within
2 N^2 doubles.

How it measures
---------------
* The data (X: N x 90 float32; y: a random 3 x 200 tanh MLP teacher + Gaussian noise,
  float32) is written in chunks of 50,000 rows with ``np.lib.format.open_memmap``, so
  creating it never holds N x 90 in memory; it is kept in ``--workdir`` (a temporary
  directory by default) and reused when the same N and seed are asked again.
* The "pretrained" net: the teacher's architecture, fresh initialisation (seed 1),
  300 Adam steps (lr 1e-3, batch 256) on 20,000 rows of its own drawn like the data
  (seed 123), so it is the same net for every N. Saved once as a state dict.
* Every measurement runs in a FRESH subprocess (so its high-water mark is its own).
  Reported: the process's peak RSS (``ru_maxrss``, which includes the interpreter,
  torch and the memmap pages the process touched) after fit and after predict; the
  baseline RSS after imports + net load; a psutil-style sampler (every 20 ms, from
  ``/proc/self/status``) gives the peak of each phase and its anonymous part (RssAnon:
  not counting file pages of the memmap) and how much predict alone grew the RSS.
* Bare forward: the same MLP, ``torch.no_grad``, float32, batches of the estimator's
  default ``batch_size`` read from the same memmap; the best of 2 passes.
* Exact LLA (``--exact``): ``LLARegressor(net, random_state=0)`` fitted on the first
  ``--exact-n`` rows (default 5,000; the issue's setting is 20,000, which the current
  code needed 15.3 GB for) and predicting 1,000 rows with std; compared with the
  2 N^2 doubles bound.
* A guard: a child whose RSS exceeds ``--mem-limit-mb`` (default 6000; 0 disables) is
  stopped and reported as such, so a regression cannot take the machine's memory.

Usage::

    python benchmarks/memory.py --n 1000000                # the issue's setting
    python benchmarks/memory.py --n 100000,200000          # growth with N
    python benchmarks/memory.py --n 100000 --exact --exact-n 5000
    python benchmarks/memory.py --quick                    # smoke run (N = 20,000)
    python benchmarks/memory.py --n 1000000 --workdir /tmp/lla_mem --out docs/mem.md
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import RSSSampler, markdown_table, peak_rss_mb, run_child, set_threads  # noqa: E402

N_FEATURES = 90
HIDDEN = (200, 200, 200)
CHUNK = 50_000
NOISE_STD = 0.3
PRETRAIN_ROWS = 20_000
PRETRAIN_STEPS = 300


# ------------------------------------------------------------------ procfs
def _status_mb():
    """(VmRSS, RssAnon) of this process in MB, from /proc/self/status."""
    out = {}
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(("VmRSS:", "RssAnon:")):
                k, v = line.split(":")
                out[k] = int(v.split()[0]) / 1024.0
    return out.get("VmRSS", 0.0), out.get("RssAnon", 0.0)


class PhaseSampler(RSSSampler):
    """RSSSampler that also tracks the peak of RssAnon."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.peak_anon = 0.0

    def _run(self):
        while not self._stop.is_set():
            rss, anon = _status_mb()
            self.peak = max(self.peak, rss)
            self.peak_anon = max(self.peak_anon, anon)
            if self.limit_mb and rss > self.limit_mb:
                sys.stderr.write(f"RSS {rss:.0f} MB exceeded --mem-limit-mb "
                                 f"{self.limit_mb:.0f}; stopping this measurement\n")
                sys.stderr.flush()
                os._exit(3)
            time.sleep(self.interval)

    def reset(self):
        self.peak, self.peak_anon = _status_mb()


# -------------------------------------------------------------------- data
def teacher_and_student(seed_teacher=0, seed_student=1):
    import torch

    from sklearn_lla.nets import MLP

    torch.manual_seed(seed_teacher)
    teacher = MLP(N_FEATURES, 1, HIDDEN)
    with torch.no_grad():
        # a teacher with a visible signal: larger first-layer weights, and the head
        # scaled so that the noiseless output has unit std (noise std NOISE_STD)
        teacher.layers[0].weight.mul_(2.0)
        x = torch.from_numpy(_features(np.random.default_rng(7), 10_000, _mixing()))
        out = teacher(x)
        head = teacher.layers[-1]
        scale = 1.0 / float(out.std())
        head.weight.mul_(scale)
        head.bias.sub_(float(out.mean())).mul_(scale)
    torch.manual_seed(seed_student)
    student = MLP(N_FEATURES, 1, HIDDEN)
    return teacher, student


def _mixing():
    """Fixed 90 x 90 mixing: correlated features (Year's timbre features are correlated)."""
    rng = np.random.default_rng(12345)
    mix = rng.standard_normal((N_FEATURES, N_FEATURES)).astype(np.float32)
    mix = 0.7 * np.eye(N_FEATURES, dtype=np.float32) + 0.3 * mix / np.sqrt(N_FEATURES)
    return (mix / np.linalg.norm(mix, axis=0, keepdims=True)).astype(np.float32)


def _features(rng, b, mix):
    """``b`` rows of roughly standardised, correlated features (float32)."""
    return (rng.standard_normal((b, N_FEATURES), dtype=np.float32) @ mix).astype(np.float32)


def make_data(workdir, n, seed=0):
    """Write X (n x 90) and y (n,) float32 .npy files in chunks; reuse if present."""
    import torch

    xp = os.path.join(workdir, f"X_{n}_{seed}.npy")
    yp = os.path.join(workdir, f"y_{n}_{seed}.npy")
    if os.path.exists(xp) and os.path.exists(yp):
        return xp, yp
    teacher, _ = teacher_and_student()
    rng_x, rng_e = np.random.default_rng(seed), np.random.default_rng(seed + 1)
    mix = _mixing()
    X = np.lib.format.open_memmap(xp + ".tmp", mode="w+", dtype=np.float32,
                                  shape=(n, N_FEATURES))
    Y = np.lib.format.open_memmap(yp + ".tmp", mode="w+", dtype=np.float32, shape=(n,))
    for i in range(0, n, CHUNK):
        b = min(CHUNK, n - i)
        xb = _features(rng_x, b, mix)
        with torch.no_grad():
            fb = teacher(torch.from_numpy(xb))[:, 0].numpy()
        X[i:i + b] = xb
        Y[i:i + b] = fb + NOISE_STD * rng_e.standard_normal(b, dtype=np.float32)
    X.flush()
    Y.flush()
    del X, Y
    os.replace(xp + ".tmp", xp)
    os.replace(yp + ".tmp", yp)
    return xp, yp


def make_net(workdir):
    """The pretrained student (a state dict file), the same for every N and workdir.

    Trained on its own 20,000 rows (drawn like the data, seed 123), so that the net
    does not depend on which data file was created first.
    """
    import torch

    path = os.path.join(workdir, "net.pt")
    if os.path.exists(path):
        return path
    teacher, net = teacher_and_student()
    rng = np.random.default_rng(123)
    Xt = torch.from_numpy(_features(rng, PRETRAIN_ROWS, _mixing()))
    with torch.no_grad():
        yt = teacher(Xt) + NOISE_STD * torch.from_numpy(
            rng.standard_normal((PRETRAIN_ROWS, 1), dtype=np.float32))
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    for _ in range(PRETRAIN_STEPS):
        idx = torch.randint(0, PRETRAIN_ROWS, (256,), generator=g)
        opt.zero_grad()
        torch.nn.functional.mse_loss(net(Xt[idx]), yt[idx]).backward()
        opt.step()
    torch.save(net.state_dict(), path)
    return path


# ----------------------------------------------------------------- children
def _bare_forward(net, X, batch_size, repeats=2):
    """Best (wall s, CPU s) of ``repeats`` no-grad float32 passes over memmap X."""
    import torch

    best = (float("inf"), float("inf"))
    with torch.no_grad():
        for _ in range(repeats):
            t, c = time.perf_counter(), time.process_time()
            for i in range(0, len(X), batch_size):
                net(torch.from_numpy(np.array(X[i:i + batch_size])))
            best = (min(best[0], time.perf_counter() - t), min(best[1], time.process_time() - c))
    return best


def child(kind, cfg):
    set_threads(cfg["threads"])
    import torch

    from sklearn_lla import ELLARegressor, LLARegressor
    from sklearn_lla.nets import MLP

    net = MLP(N_FEATURES, 1, HIDDEN)
    net.load_state_dict(torch.load(cfg["net"]))
    net.eval()
    X = np.load(cfg["X"], mmap_mode="r")
    y = np.load(cfg["y"], mmap_mode="r")
    out = {"kind": kind, "n": int(len(X)), "P": sum(p.numel() for p in net.parameters())}
    out["base_rss_mb"], out["base_anon_mb"] = _status_mb()
    out["base_maxrss_mb"] = peak_rss_mb()
    sampler = PhaseSampler(limit_mb=cfg["mem_limit_mb"] or None)
    with sampler:
        if kind == "forward":
            out["batch_size"] = ELLARegressor().batch_size
            out["forward_s"], out["forward_cpu_s"] = _bare_forward(net, X, out["batch_size"])
            out["peak_mb"], out["peak_anon_mb"] = sampler.peak, sampler.peak_anon
        elif kind == "ella":
            est = ELLARegressor(net, random_state=0)
            out["batch_size"] = est.batch_size
            out["n_components"] = est.n_components
            t, c = time.perf_counter(), time.process_time()
            est.fit(X, y)
            out["fit_s"] = time.perf_counter() - t
            out["fit_cpu_s"] = time.process_time() - c
            out["maxrss_after_fit_mb"] = peak_rss_mb()
            out["fit_peak_mb"], out["fit_peak_anon_mb"] = sampler.peak, sampler.peak_anon
            out["rss_before_predict_mb"], out["anon_before_predict_mb"] = _status_mb()
            # bare forward passes adjacent in time to predict (the machine may be shared):
            # one just before, one just after; the faster is the reference
            fw1 = _bare_forward(net, X, est.batch_size, repeats=1)
            sampler.reset()
            t, c = time.perf_counter(), time.process_time()
            mean, std = est.predict(X, return_std=True)
            out["predict_s"] = time.perf_counter() - t
            out["predict_cpu_s"] = time.process_time() - c
            out["maxrss_after_predict_mb"] = peak_rss_mb()
            out["predict_peak_mb"], out["predict_peak_anon_mb"] = sampler.peak, sampler.peak_anon
            fw2 = _bare_forward(net, X, est.batch_size, repeats=1)
            out["forward_s"] = min(fw1[0], fw2[0])
            out["forward_cpu_s"] = min(fw1[1], fw2[1])
            out["output_mb"] = (mean.nbytes + std.nbytes) / 2**20
            out["noise_variance_"] = est.noise_variance_
            out["prior_variance_"] = est.prior_variance_
            out["n_components_"] = int(est.n_components_)
        elif kind == "exact":
            n = cfg["exact_n"]
            Xs, ys = np.asarray(X[:n]), np.asarray(y[:n])
            Xq = np.asarray(X[n:n + 1000]) if len(X) >= n + 1000 else np.asarray(X[:1000])
            sampler.reset()
            est = LLARegressor(net, random_state=0)
            t = time.perf_counter()
            est.fit(Xs, ys)
            out["fit_s"] = time.perf_counter() - t
            out["maxrss_after_fit_mb"] = peak_rss_mb()
            out["fit_peak_mb"], out["fit_peak_anon_mb"] = sampler.peak, sampler.peak_anon
            sampler.reset()
            t = time.perf_counter()
            est.predict(Xq, return_std=True)
            out["predict_s"] = time.perf_counter() - t
            out["maxrss_after_predict_mb"] = peak_rss_mb()
            out["space"] = est.space_
            out["exact_n"] = n
            out["bound_mb"] = 2 * n * n * 8 / 2**20
        else:
            raise ValueError(kind)
    return out


def _measure(kind, cfg, timeout):
    res, rc, err = run_child(__file__, ["--child", kind, "--config", json.dumps(cfg)],
                             env={"OMP_NUM_THREADS": str(cfg["threads"]),
                                  "MKL_NUM_THREADS": str(cfg["threads"])},
                             timeout=timeout)
    if res is None:
        why = ("stopped: RSS over --mem-limit-mb" if rc == 3 else f"failed (rc={rc})")
        print(f"  {kind} at N={cfg.get('n')}: {why}\n{err[-1500:]}", flush=True)
        return {"kind": kind, "error": why}
    return res


# ---------------------------------------------------------------------- main
def _mb(v):
    return "-" if v is None else f"{v:,.0f}"


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", default="1000000",
                    help="training rows; comma-separated for several (default 1,000,000)")
    ap.add_argument("--quick", action="store_true", help="smoke run at N = 20,000")
    ap.add_argument("--exact", action="store_true", help="also measure exact LLARegressor")
    ap.add_argument("--exact-n", type=int, default=5000,
                    help="rows for the exact LLA measurement (issue: 20000)")
    ap.add_argument("--workdir", help="where data and net are kept (default: a temp dir, "
                                      "removed at the end)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--mem-limit-mb", type=float, default=6000,
                    help="stop a measurement whose RSS exceeds this (0: no limit)")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds per measurement")
    ap.add_argument("--out", help="also write the tables (markdown) to this file")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--config", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print("RESULT " + json.dumps(child(args.child, json.loads(args.config))), flush=True)
        return

    ns = [20_000] if args.quick else [int(float(s)) for s in args.n.split(",") if s.strip()]
    set_threads(args.threads)
    import torch

    tmp = None
    workdir = args.workdir
    if workdir is None:
        tmp = workdir = tempfile.mkdtemp(prefix="lla_memory_")
    os.makedirs(workdir, exist_ok=True)
    try:
        results = []
        net_path = None
        for n in ns:
            t = time.perf_counter()
            xp, yp = make_data(workdir, n)
            if net_path is None:
                net_path = make_net(workdir)
            print(f"N={n}: data ready in {time.perf_counter() - t:.1f} s ({xp})", flush=True)
            cfg = dict(n=n, X=xp, y=yp, net=net_path, threads=args.threads,
                       mem_limit_mb=args.mem_limit_mb, exact_n=args.exact_n)
            fwd = _measure("forward", cfg, args.timeout)
            ella = _measure("ella", cfg, args.timeout)
            results.append((n, fwd, ella))
            print(f"N={n}: forward {fwd.get('forward_s', float('nan')):.2f} s; ELLA fit "
                  f"{ella.get('fit_s', float('nan')):.1f} s, predict "
                  f"{ella.get('predict_s', float('nan')):.1f} s, peak "
                  f"{ella.get('maxrss_after_predict_mb', float('nan')):.0f} MB", flush=True)
        exact = None
        if args.exact:
            n_ex = max(ns)
            xp, yp = make_data(workdir, n_ex)
            cfg = dict(n=n_ex, X=xp, y=yp, net=net_path, threads=args.threads,
                       mem_limit_mb=args.mem_limit_mb, exact_n=min(args.exact_n, n_ex))
            exact = _measure("exact", cfg, args.timeout)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)

    K = None
    rows = []
    for n, fwd, ella in results:
        g = ella.get
        K = g("n_components_", 20)  # the fitted K ("auto" chooses it)
        target = 1.5 * (K + 1)
        ratio = g("predict_s") / g("forward_s") if "predict_s" in ella else None
        ratio_cpu = g("predict_cpu_s") / g("forward_cpu_s") if "predict_s" in ella else None
        grow = (g("predict_peak_mb") - g("rss_before_predict_mb")
                if "predict_peak_mb" in ella else None)
        rows.append([f"{n:,}", g("fit_s"), g("predict_s"), g("forward_s"),
                     ratio, ratio_cpu, f"{target:.1f}", _mb(g("base_rss_mb")),
                     _mb(g("maxrss_after_fit_mb")), _mb(g("maxrss_after_predict_mb")),
                     _mb(grow), _mb(g("predict_peak_anon_mb")), _mb(fwd.get("peak_mb")),
                     ella.get("error", "")])
    header = ["N", "fit s", "predict s", "forward s", "predict / forward",
              "same, CPU time", "target 1.5(K+1)", "base RSS MB", "peak RSS after fit MB",
              "peak RSS after predict MB", "predict growth MB", "predict peak anon MB",
              "bare forward peak RSS MB", "notes"]
    table = markdown_table(header, rows)
    env = (f"ELLARegressor(net, random_state=0) defaults (M=2000, K={K}, batch 256); "
           f"MLP 90-{'-'.join(map(str, HIDDEN))}-1 tanh float32 (P=98,801); X float32 "
           f".npy memmap; torch {torch.__version__}, {args.threads} threads. Target: peak "
           "RSS <= 3072 MB at N = 1,000,000; predict / forward <= 1.5 (K+1).")
    text = f"### ELLA on a memmap\n\n{env}\n\n{table}\n"
    if len(results) > 1 and all("maxrss_after_predict_mb" in r[2] for r in results):
        (n0, _, e0), (n1, _, e1) = results[0], results[-1]
        slope = ((e1["maxrss_after_predict_mb"] - e0["maxrss_after_predict_mb"])
                 / (n1 - n0) * 1e6)
        text += (f"\nGrowth of the peak RSS with N: {slope:,.0f} MB per million rows "
                 f"(extrapolated peak at N = 1,000,000: "
                 f"{e0['maxrss_after_predict_mb'] + slope * (1e6 - n0) / 1e6:,.0f} MB).\n")
    if exact is not None:
        text += "\n### Exact LLA (LLARegressor defaults)\n\n"
        if "error" in exact:
            text += f"N = {args.exact_n}: {exact['error']}\n"
        else:
            text += markdown_table(
                ["N", "space", "fit s", "predict 1000 s", "base RSS MB", "peak RSS MB",
                 "peak above base MB", "bound 2 N^2 doubles MB"],
                [[f"{exact['exact_n']:,}", exact["space"], exact["fit_s"], exact["predict_s"],
                  _mb(exact["base_rss_mb"]), _mb(exact["maxrss_after_predict_mb"]),
                  _mb(exact["maxrss_after_predict_mb"] - exact["base_rss_mb"]),
                  _mb(exact["bound_mb"])]]) + "\n"
    print("\n" + text)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write("# Memory benchmark (benchmarks/memory.py)\n\n" + text)


if __name__ == "__main__":
    main()
