"""ELLA benchmark: sklearn-lla vs laplace-torch 0.3 on a Year-shaped problem.

Setting (issue #3): N = 20,000 training points x 90 features, a 3 x 200 tanh MLP
(P = 98,801), M = 2000 Nystrom pairs, K = 20 components, 5,000 test points, 2 threads.
Each method runs in its own subprocess so that its peak memory (RSS high-water mark
above the process's baseline after data and net are loaded) is its own. Printed, from
one run: fit + predict times and their ratios against laplace-torch's ELLA and its
KFAC GLM (fed test points in chunks of 256: in one call its KFAC GLM predictive needs
over 24 GiB), our predict time divided by (K + 1) bare forward passes, and peak memory.

Usage::

    python benchmarks/bench_ella.py            # full setting (a few minutes)
    python benchmarks/bench_ella.py --quick    # small smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

import numpy as np
import torch


def make_problem(n_train, n_test, n_features, seed=0):
    rng = np.random.RandomState(seed)
    W = rng.randn(n_features, 1) / np.sqrt(n_features)
    X = rng.randn(n_train + n_test, n_features).astype(np.float32)
    y = (np.tanh(X @ W) * 2 + 0.5 * np.sin(3 * X[:, :1]) + 0.3 * rng.randn(len(X), 1))
    y = y.astype(np.float32)
    return X[:n_train], y[:n_train], X[n_train:], y[n_train:]


def make_net(X, y, hidden, epochs, seed=0):
    from sklearn_lla.nets import MLP

    torch.manual_seed(seed)
    net = MLP(X.shape[1], 1, hidden)
    opt = torch.optim.Adam(net.parameters(), lr=1e-3, weight_decay=1e-4)
    Xt, yt = torch.as_tensor(X), torch.as_tensor(y)
    for _ in range(epochs):
        perm = torch.randperm(len(Xt))
        for i in range(0, len(Xt), 256):
            idx = perm[i:i + 256]
            opt.zero_grad()
            torch.nn.functional.mse_loss(net(Xt[idx]), yt[idx]).backward()
            opt.step()
    net.eval()
    return net


def peak_rss_mb():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def run_method(method, cfg):
    torch.set_num_threads(cfg["threads"])
    X, y, Xte, _ = make_problem(cfg["n_train"], cfg["n_test"], cfg["n_features"])
    net = make_net(X, y, tuple(cfg["hidden"]), cfg["epochs"])
    s2, s0 = cfg["noise_variance"], cfg["prior_variance"]
    M, K, chunk = cfg["n_nystrom"], cfg["n_components"], cfg["chunk"]
    base = peak_rss_mb()
    out = {"method": method}
    if method == "forward":
        Xt = torch.as_tensor(Xte)
        with torch.no_grad():
            net(Xt[:256])
            t = time.perf_counter()
            for _ in range(3):
                for i in range(0, len(Xt), cfg["batch_size"]):
                    net(Xt[i:i + cfg["batch_size"]])
            out["forward"] = (time.perf_counter() - t) / 3
    elif method == "ours":
        from sklearn_lla import ELLARegressor

        est = ELLARegressor(net, n_nystrom=M, n_components=K, prior_variance=s0,
                            noise_variance=s2, device="cpu", batch_size=cfg["batch_size"],
                            random_state=0)
        t = time.perf_counter()
        est.fit(X, y)
        out["fit"] = time.perf_counter() - t
        t = time.perf_counter()
        _, std = est.predict(Xte, return_std=True)
        out["predict"] = time.perf_counter() - t
        out["var"] = (std.ravel() ** 2 - est.noise_variance_).tolist()[:200]
    else:
        from laplace import Laplace

        loader = torch.utils.data.DataLoader(
            torch.utils.data.TensorDataset(torch.as_tensor(X), torch.as_tensor(y)),
            batch_size=cfg["batch_size"])
        if method == "laplace_ella":
            la = Laplace(net, "regression", subset_of_weights="all", hessian_structure="gp",
                         functional_approximation="nystrom", subsample_size=M,
                         n_eigenvalues=K, sigma_noise=s2 ** 0.5, prior_precision=1 / s0)
            pred = dict(pred_type="gp")
        else:
            la = Laplace(net, "regression", subset_of_weights="all", hessian_structure="kron",
                         sigma_noise=s2 ** 0.5, prior_precision=1 / s0)
            pred = dict(pred_type="glm")
        t = time.perf_counter()
        la.fit(loader)
        out["fit"] = time.perf_counter() - t
        Xt = torch.as_tensor(Xte)
        t = time.perf_counter()
        var = []
        for i in range(0, len(Xt), chunk):
            _, fv = la(Xt[i:i + chunk], **pred)
            var.append(fv.reshape(-1).detach())
        out["predict"] = time.perf_counter() - t
        out["var"] = torch.cat(var).tolist()[:200]
    out["peak_mb"] = peak_rss_mb() - base
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small smoke configuration")
    ap.add_argument("--method", help=argparse.SUPPRESS)
    ap.add_argument("--config", help=argparse.SUPPRESS)
    ap.add_argument("--skip-kfac", action="store_true")
    args = ap.parse_args()
    if args.method:
        print("RESULT " + json.dumps(run_method(args.method, json.loads(args.config))))
        return
    cfg = dict(n_train=20_000, n_test=5_000, n_features=90, hidden=[200, 200, 200],
               n_nystrom=2000, n_components=20, threads=2, batch_size=256, chunk=256,
               epochs=2, noise_variance=0.1, prior_variance=0.01)
    if args.quick:
        cfg.update(n_train=2000, n_test=500, hidden=[50, 50], n_nystrom=200, epochs=1)
    methods = ["forward", "ours", "laplace_ella"] + ([] if args.skip_kfac else ["laplace_kfac"])
    env = dict(os.environ, OMP_NUM_THREADS=str(cfg["threads"]), MKL_NUM_THREADS=str(cfg["threads"]))
    res = {}
    for m in methods:
        proc = subprocess.run(
            [sys.executable, __file__, "--method", m, "--config", json.dumps(cfg)],
            capture_output=True, text=True, env=env,
        )
        line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        if proc.returncode != 0 or not line:
            print(f"{m}: FAILED\n{proc.stderr[-3000:]}")
            continue
        res[m] = json.loads(line[0][7:])
    print(f"\nELLA benchmark: N={cfg['n_train']}, D={cfg['n_features']}, MLP {cfg['hidden']}, "
          f"M={cfg['n_nystrom']}, K={cfg['n_components']}, test={cfg['n_test']}, "
          f"threads={cfg['threads']}, torch {torch.__version__}")
    print(f"{'method':<14}{'fit s':>10}{'predict s':>12}{'total s':>10}{'peak MB':>10}")
    for m, r in res.items():
        if m == "forward":
            continue
        print(f"{m:<14}{r['fit']:>10.2f}{r['predict']:>12.2f}{r['fit'] + r['predict']:>10.2f}"
              f"{r['peak_mb']:>10.0f}")
    if "ours" in res:
        ours = res["ours"]["fit"] + res["ours"]["predict"]
        for peer in ("laplace_ella", "laplace_kfac"):
            if peer in res:
                tot = res[peer]["fit"] + res[peer]["predict"]
                print(f"ratio ours / {peer} (fit+predict): {ours / tot:.3f}")
        if "forward" in res:
            fwd = res["forward"]["forward"]
            ratio = res["ours"]["predict"] / ((cfg["n_components"] + 1) * fwd)
            print(f"bare forward over the test set: {fwd * 1e3:.1f} ms; ours predict / "
                  f"((K+1) forwards) = {ratio:.2f}")
        if "laplace_ella" in res:
            a = np.asarray(res["ours"]["var"])
            b = np.asarray(res["laplace_ella"]["var"])
            print("latent variance, ours vs laplace-torch ELLA (different random pairs): "
                  f"median ratio {np.median(a / b):.3f}")


if __name__ == "__main__":
    main()
