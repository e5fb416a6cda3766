"""Every classifier's defaults on a small CNN with BatchNorm (issue 31, items 6-7, CPU).

The net (the issue's digits CNN): ``load_digits`` rows (8 x 8 images, pixels / 16)
through ``nn.Unflatten``; Conv2d 1->16 + BatchNorm + ReLU, Conv2d 16->32 + BatchNorm +
ReLU, max-pool 2, Linear 512->64 + ReLU, Linear 64->10 (P = 38,378). ``--residual``
adds a residual block (Conv2d 16->16 + BatchNorm, added to its input) after the first
ReLU. Trained with Adam (lr 1e-3, weight decay 1e-4, batch 64, 30 epochs, seed 0) on
a 70 % split of the 1,797 rows (1,257) in situation (b), or on 90 % of those in
situation (c) (``fit(X, y, validation_data=the other 10 %)``). Test: the other 540
rows. OOD: uniform-noise images in [0, 1] (540 rows), and natural-image patches (a
distribution the net never saw: 540 random 32 x 32 grayscale crops of scikit-learn's
bundled sample images, average-pooled to 8 x 8 and scaled to [0, 1]). Corruption: the
test images under 1, 2 and 3 passes of a 3 x 3 Gaussian filter (the NLL at each).

Measured per method, in one process, in this order: the raw softmax; laplace-torch
0.3's last-layer KFAC with marginal-likelihood prior precision and the probit GLM
predictive (the budget's reference); every registered classifier configuration with
its default parameters (``sklearn_lla._registry.ESTIMATORS``, ``random_state=0``).
Fit and predict seconds (predict: the test and noise rows; the run with the median
fit + predict of ``--repeat`` runs, default 3), peak RSS of the process so
far (psutil sampler, MB), test accuracy, NLL, ECE (15 bins), the OOD entropy AUC on
both OOD sets and the NLL under each blur; the ratio of fit + predict to
laplace-torch's in the same run. ``--generic`` switches the
graph Jacobian backend off (every product by ``torch.func``), for the comparison of
backends.

Usage::

    OMP_NUM_THREADS=2 python benchmarks/cnn.py [--situation b|c] [--residual]
        [--generic] [--only NAME,NAME] [--threads 2] [--repeat 3] [--set KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import ast
import copy
import sys
import time
import warnings
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import RSSSampler, markdown_table, set_threads  # noqa: E402


def make_net(residual=False):
    """The digits CNN (optionally with one residual block)."""
    import torch
    from torch import nn

    class Residual(nn.Module):
        def __init__(self, c):
            super().__init__()
            self.conv = nn.Conv2d(c, c, 3, padding=1)
            self.bn = nn.BatchNorm2d(c)

        def forward(self, x):
            return torch.relu(x + self.bn(self.conv(x)))

    layers = [nn.Unflatten(1, (1, 8, 8)), nn.Conv2d(1, 16, 3, padding=1), nn.BatchNorm2d(16),
              nn.ReLU()]
    if residual:
        layers.append(Residual(16))
    layers += [nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
               nn.Flatten(), nn.Linear(512, 64), nn.ReLU(), nn.Linear(64, 10)]
    return nn.Sequential(*layers)


def train(net, X, y, epochs=30, seed=0):
    """Adam, lr 1e-3, weight decay 1e-4, batch 64; returns the net in eval mode."""
    import torch
    from torch import nn

    g = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        net = net.float()
        opt = torch.optim.Adam(net.parameters(), 1e-3, weight_decay=1e-4)
        Xt, yt = torch.as_tensor(X), torch.as_tensor(y)
        for _ in range(epochs):
            perm = torch.randperm(len(Xt), generator=g)
            net.train()
            for i in range(0, len(Xt), 64):
                b = perm[i:i + 64]
                opt.zero_grad()
                nn.functional.cross_entropy(net(Xt[b]), yt[b]).backward()
                opt.step()
    return net.eval()


def make_data(situation, seed=0):
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    X, y = load_digits(return_X_y=True)
    X = (X / 16.0).astype(np.float32)
    Xtr, Xte, ytr, yte = train_test_split(X, y, test_size=0.3, random_state=seed)
    p = dict(Xtr=Xtr, ytr=ytr, Xte=Xte, yte=yte, Xva=None, yva=None)
    if situation == "c":
        Xa, Xv, ya, yv = train_test_split(Xtr, ytr, test_size=0.1, random_state=seed)
        p.update(Xtr=Xa, ytr=ya, Xva=Xv, yva=yv)
    rng = np.random.default_rng(seed)
    p["Xood"] = rng.uniform(0, 1, Xte.shape).astype(np.float32)
    p["Xpatch"] = natural_patches(len(Xte), rng)
    p["Xblur"] = [blur(Xte, k) for k in (1, 2, 3)]
    return p


def natural_patches(n, rng):
    """``n`` 8 x 8 grayscale patches of scikit-learn's sample images in [0, 1]: random
    32 x 32 crops, average-pooled 4 x 4."""
    from sklearn.datasets import load_sample_images

    imgs = [im.mean(-1) / 255.0 for im in load_sample_images().images]
    out = np.empty((n, 64), np.float32)
    for i in range(n):
        im = imgs[rng.integers(len(imgs))]
        r, c = rng.integers(im.shape[0] - 32), rng.integers(im.shape[1] - 32)
        crop = im[r:r + 32, c:c + 32].reshape(8, 4, 8, 4).mean((1, 3))
        lo, hi = crop.min(), crop.max()
        out[i] = ((crop - lo) / max(hi - lo, 1e-6)).ravel()
    return out


def blur(X, times):
    """``times`` passes of a 3 x 3 Gaussian filter over the 8 x 8 images."""
    import torch

    k = torch.tensor([1.0, 2.0, 1.0])
    w = ((k[:, None] * k[None, :]) / 16.0).reshape(1, 1, 3, 3)
    x = torch.as_tensor(X).reshape(len(X), 1, 8, 8)
    for _ in range(times):
        x = torch.nn.functional.conv2d(x, w, padding=1)
    return x.reshape(len(X), -1).numpy().astype(np.float32)


def metrics(p, proba_te, proba_ood, proba_patch, proba_blur):
    from sklearn_lla.metrics import expected_calibration_error, ood_auc

    yte = p["yte"]

    def nll(proba):
        return float(-np.log(np.clip(proba[np.arange(len(yte)), yte], 1e-12, None)).mean())

    return dict(acc=float((proba_te.argmax(1) == yte).mean()), nll=nll(proba_te),
                ece=float(expected_calibration_error(yte, proba_te)),
                auc=float(ood_auc(proba_te, proba_ood)),
                auc_patch=float(ood_auc(proba_te, proba_patch)),
                blur_nll=[nll(pb) for pb in proba_blur])


def raw_softmax(net, p):
    import torch

    def predict(X):
        with torch.no_grad():
            return torch.softmax(net(torch.as_tensor(X)), -1).double().numpy()

    return 0.0, predict


def laplace_torch(net, p):
    """laplace-torch 0.3: last-layer KFAC, marglik prior precision, probit GLM."""
    import torch
    from laplace import Laplace

    t = time.perf_counter()
    model = copy.deepcopy(net).eval()
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(torch.as_tensor(p["Xtr"]), torch.as_tensor(p["ytr"])),
        batch_size=128)
    la = Laplace(model, "classification", subset_of_weights="last_layer",
                 hessian_structure="kron")
    la.fit(loader)
    la.optimize_prior_precision(pred_type="glm", method="marglik")

    def predict(X):
        with torch.no_grad():
            return la(torch.as_tensor(X), pred_type="glm", link_approx="probit").double().numpy()

    return time.perf_counter() - t, predict


def estimator(entry, seed=0, overrides=None):
    def run(net, p):
        est = entry.cls(net, **{**entry.params, **(overrides or {})}, random_state=seed)
        t = time.perf_counter()
        if p["Xva"] is not None:
            est.fit(p["Xtr"], p["ytr"], validation_data=(p["Xva"], p["yva"]))
        else:
            est.fit(p["Xtr"], p["ytr"])
        run.backend = getattr(est, "jacobian_backend_", "")
        return time.perf_counter() - t, est.predict_proba

    run.backend = ""
    return run


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--situation", choices=("b", "c"), default="b")
    ap.add_argument("--residual", action="store_true")
    ap.add_argument("--generic", action="store_true",
                    help="switch the graph Jacobian backend off (torch.func products)")
    ap.add_argument("--only", default="", help="comma-separated method names to run")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3,
                    help="fits + predicts per method; the median is reported (default 3)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a parameter for the estimators run (e.g. covariance=subspace, "
                         "prior_variance=0.001); repeatable")
    args = ap.parse_args(argv)
    overrides = {}
    for item in args.set:
        key, _, value = item.partition("=")
        try:
            overrides[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            overrides[key] = value
    set_threads(args.threads)
    warnings.filterwarnings("ignore")
    import torch

    from sklearn_lla._registry import ESTIMATORS

    if args.generic:
        from sklearn_lla._network.backends import graph

        graph.GraphBackend.build = classmethod(lambda cls, lin, x: (None, "switched off"))
    p = make_data(args.situation)
    torch.manual_seed(0)
    net = train(make_net(args.residual), p["Xtr"], p["ytr"])
    P = sum(q.numel() for q in net.parameters())
    methods = [("raw softmax", raw_softmax), ("laplace-torch LL-KFAC+marglik", laplace_torch)]
    methods += [(e.id, estimator(e, overrides=overrides)) for e in ESTIMATORS
                if e.is_classifier and "likelihood" not in e.params]
    only = [s for s in args.only.split(",") if s]
    if only:
        methods = [m for m in methods if m[0] in only or m[0] == "laplace-torch LL-KFAC+marglik"]
    rss = RSSSampler().__enter__()
    rows, ref = [], None
    for name, fn in methods:
        rec = dict(method=name)
        try:
            runs = []
            for _ in range(args.repeat):  # the median of the repeats' fit + predict
                fit_s, predict = fn(net, p)
                t = time.perf_counter()
                pte, pood = predict(p["Xte"]), predict(p["Xood"])
                runs.append((fit_s + time.perf_counter() - t, fit_s))  # test + noise rows
            total, fit_s = sorted(runs)[len(runs) // 2]
            pred_s = total - fit_s
            ppatch, pblur = predict(p["Xpatch"]), [predict(x) for x in p["Xblur"]]
            if name.startswith("laplace-torch"):
                ref = total
            rec.update(fit_s=fit_s, predict_s=pred_s, total=total,
                       **metrics(p, pte, pood, ppatch, pblur), backend=getattr(fn, "backend", ""))
        except Exception as exc:  # noqa: BLE001 - reported in the table
            rec["error"] = f"{type(exc).__name__}: {str(exc)[:120]}"
        rec["rss_mb"] = rss.peak
        rows.append(rec)
        print(rec, flush=True)
    rss.__exit__(None, None, None)
    table = []
    for r in rows:
        if "error" in r:
            table.append([r["method"], r["error"]] + [""] * 10)
            continue
        ratio = f"{r['total'] / ref:.1f}" if ref and r["total"] else ""
        table.append([r["method"], r.get("backend", ""), f"{r['fit_s']:.1f}",
                      f"{r['predict_s']:.1f}", ratio, f"{r['rss_mb']:.0f}", f"{r['acc']:.3f}",
                      f"{r['nll']:.3f}", f"{r['ece']:.3f}", f"{r['auc']:.3f}",
                      f"{r['auc_patch']:.3f}", " / ".join(f"{v:.3f}" for v in r["blur_nll"])])
    print(f"\ndigits CNN{' + residual block' if args.residual else ''}, P = {P}, situation "
          f"({args.situation}), {args.threads} threads"
          f"{', graph backend off' if args.generic else ''}\n")
    print(markdown_table(["method", "backend", "fit s", "predict s", "x laplace-torch",
                          "peak RSS MB", "acc", "NLL", "ECE", "AUC noise", "AUC patches",
                          "blur NLL 1 / 2 / 3"], table))


if __name__ == "__main__":
    main()
