"""Subspace Laplace benchmark: fidelity to exact LLA against s (the paper's Figure 1).

Two problems small enough for exact LLA (bundled with scikit-learn, no download):

* regression: ``load_diabetes`` (442 x 10, standardised), MLP 10-50-1 (tanh),
  P = 601;
* classification: ``load_digits`` (1797 x 64, 10 classes), MLP 64-32-10 (tanh),
  P = 2,410.

Every net is trained here in float64 (Adam, weight decay, fixed seed). The
hyperparameters are fixed for all projectors, as in the paper: the prior variance
from the KFAC evidence (``SubspaceLaplace``'s default) and, for regression, the
noise variance = the mean squared training residual. For every projector and
subspace dimension ``s`` it reports

* ``KL``: ``KL(exact LLA || subspace)`` on the test inputs (regression: the joint
  Gaussian of ``y`` over all test points; classification: the sum over test points
  of the probit class distributions, the paper's block-diagonal form);
* ``log10 Tr``: the trace criterion ``log10 Tr S_P(X_test)`` (exact LLA's on the
  last line);
* fit and predict times (one thread count, CPU unless ``--device cuda``).

``optimal`` is Theorem 1's projector built on the test inputs themselves (the
paper's ``lowrankopt-GGN``), a bound no feasible projector can beat.

Usage::

    python benchmarks/bench_subspace.py            # both problems (a few minutes)
    python benchmarks/bench_subspace.py --quick    # small smoke run
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import markdown_table, set_threads  # noqa: E402

PROJECTORS = ("lowrank-kfac", "lowrank-diag", "subset-magnitude", "subset-diagonal",
              "subset-swag", "optimal")


def train_mlp(X, y, hidden, task, epochs, seed=0):
    from sklearn_lla.nets import MLP

    n_out = 1 if task == "regression" else int(y.max()) + 1
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        net = MLP(X.shape[1], n_out, hidden, dtype=torch.float64)
        opt = torch.optim.Adam(net.parameters(), lr=3e-3, weight_decay=1e-4)
        Xt = torch.as_tensor(X)
        yt = torch.as_tensor(y.reshape(-1, 1) if task == "regression" else y)
        for _ in range(epochs):
            perm = torch.randperm(len(Xt))
            for i in range(0, len(Xt), 64):
                idx = perm[i:i + 64]
                opt.zero_grad()
                out = net(Xt[idx])
                if task == "regression":
                    loss = torch.nn.functional.mse_loss(out, yt[idx])
                else:
                    loss = torch.nn.functional.cross_entropy(out, yt[idx])
                loss.backward()
                opt.step()
    return net.eval()


def problems(quick):
    from sklearn.datasets import load_diabetes, load_digits
    from sklearn.model_selection import train_test_split
    from sklearn.preprocessing import StandardScaler

    X, y = load_diabetes(return_X_y=True)
    Xtr, Xte, ytr, yte = train_test_split(X, y, test_size=92, random_state=0)
    sx, sy = StandardScaler().fit(Xtr), StandardScaler().fit(ytr[:, None])
    reg = dict(name="diabetes (regression)", task="regression", hidden=(50,),
               Xtr=sx.transform(Xtr), ytr=sy.transform(ytr[:, None])[:, 0],
               Xte=sx.transform(Xte), s=[2, 5, 10, 20, 50, 100], epochs=200)
    X, y = load_digits(return_X_y=True)
    Xtr, Xte, ytr, yte = train_test_split(X, y, test_size=100, random_state=0, stratify=y)
    sx = StandardScaler().fit(Xtr)
    clf = dict(name="digits (classification)", task="classification", hidden=(32,),
               Xtr=sx.transform(Xtr), ytr=ytr, Xte=sx.transform(Xte),
               s=[10, 20, 50, 100, 200], epochs=60)
    if quick:
        reg.update(s=[5, 20], epochs=50)
        clf.update(s=[10, 50], epochs=10, Xtr=clf["Xtr"][:300], ytr=clf["ytr"][:300],
                   Xte=clf["Xte"][:40])
    return [reg, clf]


def run_problem(pb, device, seed):
    from sklearn_lla import LLAClassifier, LLARegressor
    from sklearn_lla.diagnostics import latent_predictive, predictive_kl, trace_criterion
    from sklearn_lla.subspace import SubspaceLaplace

    task, Xtr, ytr, Xte = pb["task"], pb["Xtr"], pb["ytr"], pb["Xte"]
    net = train_mlp(Xtr, ytr, pb["hidden"], task, pb["epochs"], seed)
    P = sum(p.numel() for p in net.parameters())
    # hyperparameters: KFAC evidence prior (the library's default), residual noise
    probe = SubspaceLaplace(net, task, subspace_dim=2, n_subset=10, device=device,
                            random_state=seed).fit(Xtr, ytr)
    s0 = probe.prior_variance_
    fixed = {"prior_variance": s0}
    s2 = None
    if task == "regression":
        with torch.no_grad():
            f = net(torch.as_tensor(Xtr)).numpy()[:, 0]
        s2 = float(np.mean((ytr - f) ** 2))
        fixed["noise_variance"] = s2
    t = time.perf_counter()
    exact_cls = LLARegressor if task == "regression" else LLAClassifier
    exact = exact_cls(net, space="parameter", device=device, **fixed).fit(Xtr, ytr)
    t_fit = time.perf_counter() - t
    t = time.perf_counter()
    joint = task == "regression"
    mp, cp = latent_predictive(exact, Xte, joint=joint)
    t_pred = time.perf_counter() - t
    rows = {"exact LLA": {"trace": trace_criterion(exact, Xte), "fit": t_fit, "pred": t_pred}}
    for name in PROJECTORS:
        for s in pb["s"]:
            kw = {"subspace_X": Xte} if name == "optimal" else {}
            est = SubspaceLaplace(net, task, projector=name, subspace_dim=s, device=device,
                                  random_state=seed, **fixed, **kw)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)
                t = time.perf_counter()
                est.fit(Xtr, ytr)
                t_fit = time.perf_counter() - t
            t = time.perf_counter()
            mq, cq = latent_predictive(est, Xte, joint=joint)
            t_pred = time.perf_counter() - t
            kl = predictive_kl(mp, cp, mq, cq, likelihood=task,
                               noise_variance=s2 if s2 is not None else 0.0)
            rows.setdefault(name, {})[s] = dict(kl=kl, trace=trace_criterion(est, Xte),
                                                fit=t_fit, pred=t_pred, s_used=est.subspace_dim_)
    return dict(P=P, N=len(Xtr), n_test=len(Xte), s0=s0, s2=s2, rows=rows)


def report(pb, res):
    s_list = pb["s"]
    print(f"\n### {pb['name']}: P = {res['P']}, N = {res['N']}, {res['n_test']} test points, "
          f"prior variance {res['s0']:.4g} (KFAC evidence)"
          + (f", noise variance {res['s2']:.4g}" if res["s2"] is not None else "") + "\n")
    rows = res["rows"]

    def cell(r, key):
        v = r[key]
        if key == "trace":
            return "-inf" if v <= 0 else f"{np.log10(v):.2f}"
        txt = f"{v:.3g}"
        return txt + ("*" if r["s_used"] < r.get("s", 0) else "")

    for key, title in (("kl", "KL(exact || subspace)"), ("trace", "log10 Tr S_P(X_test)")):
        header = ["projector"] + [f"s={s}" for s in s_list]
        table = []
        for name in PROJECTORS:
            line = [name]
            for s in s_list:
                r = dict(rows[name][s], s=s)
                line.append(cell(r, key))
            table.append(line)
        if key == "trace":
            table.append(["exact LLA"] + [f"{np.log10(rows['exact LLA']['trace']):.2f}"]
                         * len(s_list))
        print(f"{title}:\n")
        print(markdown_table(header, table))
        print()
    s_mid = s_list[-1]
    header = ["method", f"fit (s) at s={s_mid}", f"predict (s) at s={s_mid}"]
    table = [[name, f"{rows[name][s_mid]['fit']:.2f}", f"{rows[name][s_mid]['pred']:.3f}"]
             for name in PROJECTORS]
    table.append(["exact LLA", f"{rows['exact LLA']['fit']:.2f}",
                  f"{rows['exact LLA']['pred']:.3f}"])
    print(markdown_table(header, table))
    capped = [(n, s, rows[n][s]["s_used"]) for n in PROJECTORS for s in s_list
              if rows[n][s]["s_used"] < s]
    if capped:
        print("\n(*) capped at the numerical rank: "
              + ", ".join(f"{n} s={s} -> {u}" for n, s, u in capped))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    set_threads(args.threads)
    print(f"torch {torch.__version__}, device {args.device}, {args.threads} threads, "
          f"seed {args.seed}")
    for pb in problems(args.quick):
        res = run_problem(pb, args.device, args.seed)
        report(pb, res)


if __name__ == "__main__":
    main()
