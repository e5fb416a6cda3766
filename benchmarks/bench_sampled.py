"""Sampled LLA benchmark: fidelity against exact LLA and fit time against ELLA.

1. A small MLP (3 -> 32 -> 32 -> 1 tanh, P = 1,185; 300 points of a 3-D sine): fit
   time and mean KL(exact || sampled) of the latent predictive at 200 test points
   (exact LLA in parameter space, fixed s0^2 and s2) against the number of posterior
   samples K, for both E-step solvers (conjugate gradients, the default on these 300
   rows, and minibatch Adam).
2. A Year-shaped problem (20,000 x 90 random inputs, a 3 x 200 tanh MLP from
   ``sklearn_lla.nets.MLP``, P = 98,801, float32, trained briefly): fit time of
   ``SampledLLARegressor`` (K = 16, EM with ``--em-steps`` steps and ``--max-iter`` Adam
   steps per E-step) next to ``ELLARegressor`` (M = 500, K = 20) on the same net, and
   their ratio, from one run.
3. ``--cost``: what one posterior sample costs, on an Airline-shaped net (8 inputs,
   3 x 200 tanh, P = 82,401, float32; random inputs: the cost does not depend on the
   values): one conjugate-gradient iteration (a data pass with one JVP and one VJP of
   ``K + 1`` tangents) over 10,000 rows, the Nystrom sketch (rank ``2 (K + 1)``) over
   the same rows, and one default Adam E-step (300 minibatch JVP / VJP pairs of 256
   rows, whatever ``N``), each divided by ``K + 1``.

Usage::

    python benchmarks/bench_sampled.py            # both parts (about 5 minutes, 1 thread)
    python benchmarks/bench_sampled.py --quick    # smoke run
    python benchmarks/bench_sampled.py --ks 8,32,128   # a shorter part 1
    python benchmarks/bench_sampled.py --cost          # part 3 only (about a minute)
"""

from __future__ import annotations

import argparse
import time
import warnings

import numpy as np
import torch


def _kl(var_p, var_q):
    r = var_p / var_q
    return float(np.mean(0.5 * (r - 1.0 - np.log(r))))


def fidelity(Ks, max_iter, device):
    from sklearn_lla import LLARegressor
    from sklearn_lla.nets import MLP
    from sklearn_lla.sampled import SampledLLARegressor

    rng = np.random.RandomState(0)
    X = rng.uniform(-2, 2, (500, 3))
    y = np.sin(X @ np.array([1.0, 0.5, -0.3])) + 0.1 * rng.randn(500)
    X, Xq, y = X[:300], np.vstack([X[300:], 3 * X[300:310]]), y[:300]
    torch.manual_seed(0)
    net = MLP(3, 1, (32, 32), dtype=torch.float64)
    opt = torch.optim.Adam(net.parameters(), lr=1e-2, weight_decay=1e-4)
    Xt, yt = torch.as_tensor(X), torch.as_tensor(y[:, None])
    for _ in range(500):
        opt.zero_grad()
        torch.nn.functional.mse_loss(net(Xt), yt).backward()
        opt.step()
    s0, s2 = 0.1, 0.01
    t = time.perf_counter()
    exact = LLARegressor(net, prior_variance=s0, noise_variance=s2, space="parameter",
                         device=device).fit(X, y)
    t_exact = time.perf_counter() - t
    var_e = exact.posterior_.predict(torch.as_tensor(Xq)).var[:, 0].numpy()
    rows = [("exact LLA (parameter space)", "-", f"{t_exact:.2f}", "0")]
    for K in Ks:
        for solver in ("cg", "adam"):  # conjugate gradients (the default here) and Adam
            t = time.perf_counter()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                est = SampledLLARegressor(net, prior_variance=s0, noise_variance=s2,
                                          n_posterior_samples=K, max_iter=max_iter,
                                          solver=solver, random_state=0,
                                          device=device).fit(X, y)
            dt = time.perf_counter() - t
            var_s = est.posterior_.predict(torch.as_tensor(Xq)).var[:, 0].numpy()
            rows.append((f"sampled LLA ({solver}), K = {K}", str(int(est.n_iter_[-1])),
                         f"{dt:.2f}", f"{_kl(var_e, var_s):.4f}"))
    return exact.linearized_net_.n_params, rows


def year(n_train, max_iter, em_steps, device):
    from sklearn_lla import ELLARegressor
    from sklearn_lla.nets import MLP
    from sklearn_lla.sampled import SampledLLARegressor

    rng = np.random.RandomState(0)
    W = rng.randn(90, 1) / np.sqrt(90)
    X = rng.randn(n_train, 90).astype(np.float32)
    y = (np.tanh(X @ W) * 2 + 0.3 * rng.randn(n_train, 1)).astype(np.float32)[:, 0]
    torch.manual_seed(0)
    net = MLP(90, 1, (200, 200, 200))
    opt = torch.optim.Adam(net.parameters(), lr=1e-3, weight_decay=1e-4)
    Xt, yt = torch.as_tensor(X), torch.as_tensor(y[:, None])
    for i in range(0, n_train, 256):  # one epoch: the net only has to be a trained net
        opt.zero_grad()
        torch.nn.functional.mse_loss(net(Xt[i:i + 256]), yt[i:i + 256]).backward()
        opt.step()
    out = {}
    t = time.perf_counter()
    ELLARegressor(net, n_nystrom=500, n_components=20, random_state=0, device=device).fit(X, y)
    out["ELLA (M = 500, K = 20)"] = time.perf_counter() - t
    t = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        est = SampledLLARegressor(net, n_posterior_samples=16, n_em_steps=em_steps,
                                  max_iter=max_iter, random_state=0, device=device).fit(X, y)
    out[f"sampled LLA (K = 16, {em_steps} EM steps, {max_iter} steps/E-step)"] = (
        time.perf_counter() - t)
    return sum(p.numel() for p in net.parameters()), out, est


def cost(K=64, n=10000, batch=256, repeats=2):
    """Seconds per posterior sample of the E-step's units (part 3)."""
    from sklearn_lla import SampledLLARegressor
    from sklearn_lla._core.protocol import FitData
    from sklearn_lla._posteriors._sampled_passes import _ggn_product_sums
    from sklearn_lla.nets import MLP

    torch.manual_seed(0)
    net = MLP(8, 1, (200, 200, 200))
    X = np.random.RandomState(0).randn(n, 8).astype(np.float32)
    y = np.zeros(n, dtype=np.float32)
    tiny = SampledLLARegressor(net, prior_variance=0.1, noise_variance=1.0, max_iter=1,
                               n_posterior_samples=2, device="cpu", random_state=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tiny.fit(X[:512], y[:512])
    lin, lik = tiny.posterior_.lin, tiny.likelihood_
    data = FitData(lin, lik, torch.as_tensor(X), torch.as_tensor(y)[:, None], batch_size=batch)

    def timed(fn):
        fn()  # warm up
        t = time.perf_counter()
        for _ in range(repeats):
            fn()
        return (time.perf_counter() - t) / repeats

    M = K + 1
    g = torch.Generator().manual_seed(0)
    T = torch.randn(M, lin.n_params, dtype=torch.float64, generator=g)
    T2 = torch.randn(2 * M, lin.n_params, dtype=torch.float64, generator=g)
    xb = torch.as_tensor(X[:batch])
    sub = FitData(lin, lik, xb, torch.as_tensor(y[:batch])[:, None], batch_size=batch)
    step = timed(lambda: sub.reduce(_ggn_product_sums, (lin, lik, T)))
    rows = [
        (f"CG iteration: JVP + VJP with K + 1 = {M} tangents over {n:,} rows",
         timed(lambda: data.reduce(_ggn_product_sums, (lin, lik, T)))),
        (f"Nystrom sketch (rank {2 * M}) over {n:,} rows",
         timed(lambda: data.reduce(_ggn_product_sums, (lin, lik, T2)))),
        (f"Adam E-step: 300 minibatches of {batch} rows, {M} tangents (any N)", 300 * step),
    ]
    return lin.n_params, M, rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cost", action="store_true", help="part 3 only")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--max-iter", type=int, default=200)
    ap.add_argument("--em-steps", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--ks", default="8,32,128,512", help="comma-separated K of part 1")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.cost:
        P, M, rows = cost()
        print(f"\n## Cost per posterior sample (Airline-shaped net, P = {P:,}, "
              f"{args.threads} thread(s))\n")
        print("| unit | seconds | seconds per sample |")
        print("|---|---|---|")
        for name, sec in rows:
            print(f"| {name} | {sec:.2f} | {sec / M:.3f} |")
        return
    Ks = (8, 32) if args.quick else tuple(int(k) for k in args.ks.split(","))
    P, rows = fidelity(Ks, 200 if args.quick else 1000, args.device)
    print(f"\n## Fidelity (small MLP, P = {P}, N = 300, s0^2 = 0.1, s2 = 0.01)\n")
    print("| method | iterations (final E-step) | fit time (s) | mean KL(exact || method) |")
    print("|---|---|---|---|")
    for r in rows:
        print("| " + " | ".join(r) + " |")
    n = 2000 if args.quick else 20000
    P, times, est = year(n, 20 if args.quick else args.max_iter, args.em_steps, args.device)
    ella = next(v for k, v in times.items() if k.startswith("ELLA"))
    print(f"\n## Year-shaped fit time (N = {n}, 90 features, 3 x 200 tanh, P = {P})\n")
    print("| method | fit time (s) | ratio to ELLA |")
    print("|---|---|---|")
    for k, v in times.items():
        print(f"| {k} | {v:.1f} | {v / ella:.2f} |")
    print(f"\nsampled LLA: prior_variance_ = {est.prior_variance_:.4g}, "
          f"noise_variance_ = {est.noise_variance_:.4g}, effective_dim_ = "
          f"{est.effective_dim_:.1f}, Adam steps per E-step = {est.n_iter_}")


if __name__ == "__main__":
    main()
