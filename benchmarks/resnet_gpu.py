"""Every classifier's defaults on a CIFAR ResNet-20 with BatchNorm (issue 31, GPU rows).

The net: the CIFAR ResNet-20 of the papers (3 stages x 3 BasicBlocks, 16/32/64
channels, BatchNorm, 1 x 1 convolution + BatchNorm shortcuts where the shape changes;
P = 272,474) behind an ``nn.Unflatten`` (the estimators take 2-D ``X``: images are
passed as flat rows of 3,072 pixels), trained here with SGD (momentum 0.9, lr 0.1 cosine, weight
decay 5e-4, batch 128, ``--epochs``) on a synthetic CIFAR-shaped task (3 x 32 x 32, 10
classes): each class is a smooth random colour template; an image is its class
template, randomly shifted by up to 4 pixels and flipped, plus ``--mix`` times another
class's template and Gaussian pixel noise of std ``--noise``. Situation (b): the net trained on all
``--n-train`` rows, ``fit(X, y)``; (c, ``--situation c``): trained on 90 % of them and
``fit(X, y, validation_data=the other 10 %)``.

Per method (laplace-torch 0.3's last-layer KFAC + marglik + probit when it is
installed, the raw softmax, every registered classifier with its defaults and
``device``): fit and predict seconds (predict: the ``--n-test`` test images and both
OOD sets), the process CPU seconds of both (all threads: on a loaded machine, with
``--threads 1``, the number to compare), peak GPU memory
(``torch.cuda.max_memory_allocated``), peak RSS, test
accuracy, NLL, ECE, the entropy OOD AUC on uniform-noise images and on images of 5
classes the net never saw, and the NLL under the strongest of three Gaussian blurs.
Each method runs under ``--timeout`` seconds (a method that runs out is reported as
such; the clock is checked between its torch operations).

Usage::

    python benchmarks/resnet_gpu.py [--device cuda] [--n-train 10000] [--n-test 5000]
        [--epochs 8] [--timeout 120] [--situation b|c] [--only NAME,...] [--json F]
        [--threads N] [--phases]
    python benchmarks/resnet_gpu.py --device cpu --quick   # a smoke run on the CPU
"""

from __future__ import annotations

import argparse
import copy
import json
import signal
import sys
import time
import warnings
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import RSSSampler, markdown_table  # noqa: E402


def resnet20(n_classes=10):
    """The CIFAR ResNet-20 (He et al. 2016, projection shortcuts) on flat inputs."""
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self, cin, cout, stride):
            super().__init__()
            self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
            self.bn1 = nn.BatchNorm2d(cout)
            self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
            self.bn2 = nn.BatchNorm2d(cout)
            self.shortcut = nn.Identity()
            if stride != 1 or cin != cout:
                self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                              nn.BatchNorm2d(cout))

        def forward(self, x):
            out = torch.relu(self.bn1(self.conv1(x)))
            out = self.bn2(self.conv2(out))
            return torch.relu(out + self.shortcut(x))

    class ResNet20(nn.Module):
        def __init__(self):
            super().__init__()
            self.unflatten = nn.Unflatten(1, (3, 32, 32))
            self.conv = nn.Conv2d(3, 16, 3, 1, 1, bias=False)
            self.bn = nn.BatchNorm2d(16)
            layers, cin = [], 16
            for cout, stride in ((16, 1), (32, 2), (64, 2)):
                for i in range(3):
                    layers.append(Block(cin, cout, stride if i == 0 else 1))
                    cin = cout
            self.layers = nn.Sequential(*layers)
            self.pool = nn.AdaptiveAvgPool2d(1)
            self.fc = nn.Linear(64, n_classes)

        def forward(self, x):
            x = torch.relu(self.bn(self.conv(self.unflatten(x))))
            x = self.pool(self.layers(x)).flatten(1)
            return self.fc(x)

    return ResNet20()


def make_data(n_train, n_test, seed=0, n_classes=10, n_unseen=5, mix=0.6, noise=0.9):
    """The synthetic CIFAR-shaped task (module docstring), float32 NCHW arrays."""
    import torch

    g = torch.Generator().manual_seed(seed)
    k = n_classes + n_unseen
    low = torch.randn(k, 3, 6, 6, generator=g)
    templates = torch.nn.functional.interpolate(low, size=(32, 32), mode="bicubic",
                                                align_corners=False)
    templates = templates / templates.flatten(1).std(1)[:, None, None, None]

    def draw(n, classes):
        y = classes[torch.randint(len(classes), (n,), generator=g)]
        other = classes[torch.randint(len(classes), (n,), generator=g)]
        x = templates[y] + mix * templates[other]
        sx, sy = (torch.randint(-4, 5, (2, n), generator=g))
        x = torch.stack([torch.roll(xi, (int(a), int(b)), (1, 2)) for xi, a, b in zip(x, sx, sy)])
        flip = torch.rand(n, generator=g) < 0.5
        x[flip] = x[flip].flip(-1)
        x = x + noise * torch.randn(x.shape, generator=g)
        return x.float().reshape(n, -1).numpy(), y.numpy()

    seen, unseen = torch.arange(n_classes), torch.arange(n_classes, k)
    Xtr, ytr = draw(n_train, seen)
    Xte, yte = draw(n_test, seen)
    Xunseen, _ = draw(n_test, unseen)
    rng = np.random.default_rng(seed)
    lo, hi = float(Xtr.min()), float(Xtr.max())
    Xnoise = rng.uniform(lo, hi, Xte.shape).astype(np.float32)
    return dict(Xtr=Xtr, ytr=ytr, Xte=Xte, yte=yte, Xnoise=Xnoise, Xunseen=Xunseen)


def blur(X, times):
    """``times`` passes of a 3 x 3 Gaussian filter (per channel)."""
    import torch

    k = torch.tensor([1.0, 2.0, 1.0])
    k = (k[:, None] * k[None, :]) / 16.0
    w = k.expand(3, 1, 3, 3).contiguous()
    x = torch.as_tensor(X).reshape(len(X), 3, 32, 32)
    for _ in range(times):
        x = torch.nn.functional.conv2d(x, w, padding=1, groups=3)
    return x.reshape(len(X), -1).numpy()


def train(net, X, y, epochs, device, seed=0):
    import torch
    from torch import nn

    torch.manual_seed(seed)
    net = net.to(device)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4,
                          nesterov=True)
    steps = epochs * ((len(X) + 127) // 128)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, 0.1, total_steps=steps)
    Xt, yt = torch.as_tensor(X, device=device), torch.as_tensor(y, device=device)
    for _ in range(epochs):
        net.train()
        perm = torch.randperm(len(Xt), device=device)
        for i in range(0, len(Xt), 128):
            b = perm[i:i + 128]
            opt.zero_grad()
            nn.functional.cross_entropy(net(Xt[b]), yt[b]).backward()
            opt.step()
            sched.step()
    return net.eval()


def metrics(yte, p_te, p_noise, p_unseen, p_blur):
    from sklearn_lla.metrics import expected_calibration_error, ood_auc

    def nll(p):
        return float(-np.log(np.clip(p[np.arange(len(yte)), yte], 1e-12, None)).mean())

    return dict(acc=float((p_te.argmax(1) == yte).mean()), nll=nll(p_te),
                ece=float(expected_calibration_error(yte, p_te)),
                auc_noise=float(ood_auc(p_te, p_noise)),
                auc_unseen=float(ood_auc(p_te, p_unseen)), blur_nll=nll(p_blur))


def _instrument(cuda):
    """Count calls and seconds of :class:`LinearizedNet`'s products (outermost calls)."""
    import functools

    import torch

    from sklearn_lla._network.linearized import LinearizedNet

    stats, depth = {}, [0]

    def wrap(name):
        f = getattr(LinearizedNet, name)

        @functools.wraps(f)
        def w(*a, **k):
            depth[0] += 1
            t = time.perf_counter()
            try:
                return f(*a, **k)
            finally:
                depth[0] -= 1
                if depth[0] == 0:
                    if cuda:
                        torch.cuda.synchronize()
                    st = stats.setdefault(name, [0, 0.0])
                    st[0] += 1
                    st[1] += time.perf_counter() - t

        setattr(LinearizedNet, name, w)

    for name in ("forward", "jvp", "jvp_and_ntk_diag", "vjp", "jacobian", "rows", "kernel",
                 "ntk", "ntk_diag_blocks", "cross_and_diag", "gradient_rows_vjp"):
        wrap(name)
    return stats


class _Timeout(Exception):
    pass


def _alarm(signum, frame):
    raise _Timeout()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--n-train", type=int, default=10000)
    ap.add_argument("--n-test", type=int, default=5000)
    ap.add_argument("--epochs", type=int, default=8)
    ap.add_argument("--timeout", type=int, default=120)
    ap.add_argument("--situation", choices=("b", "c"), default="b")
    ap.add_argument("--only", default="", help="comma-separated method names to run")
    ap.add_argument("--quick", action="store_true", help="tiny sizes, for a CPU smoke run")
    ap.add_argument("--mix", type=float, default=0.6,
                    help="weight of the other class's template in an image")
    ap.add_argument("--noise", type=float, default=0.9, help="pixel noise std")
    ap.add_argument("--json", default=None)
    ap.add_argument("--threads", type=int, default=0,
                    help="torch CPU threads (0: torch's default)")
    ap.add_argument("--phases", action="store_true",
                    help="record calls and seconds of each LinearizedNet product per method")
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore")
    import torch

    from sklearn_lla._registry import ESTIMATORS

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.quick:
        args.n_train, args.n_test, args.epochs = 256, 64, 1
    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    p = make_data(args.n_train, args.n_test, mix=args.mix, noise=args.noise)
    Xtr, ytr, Xva, yva = p["Xtr"], p["ytr"], None, None
    if args.situation == "c":
        n = int(0.9 * len(Xtr))
        Xtr, ytr, Xva, yva = Xtr[:n], ytr[:n], p["Xtr"][n:], p["ytr"][n:]
    t0 = time.perf_counter()
    net = train(resnet20(), Xtr, ytr, args.epochs, dev)
    train_s = time.perf_counter() - t0
    P = sum(q.numel() for q in net.parameters())
    Xblur = blur(p["Xte"], 3)
    sets = (p["Xte"], p["Xnoise"], p["Xunseen"], Xblur)

    def softmax_predict(X):
        out = []
        with torch.no_grad():
            for i in range(0, len(X), 1000):
                out.append(torch.softmax(net(torch.as_tensor(X[i:i + 1000], device=dev)), -1)
                           .double().cpu().numpy())
        return np.concatenate(out)

    def raw(_):
        return 0.0, softmax_predict, ""

    def laplace_torch(_):
        from laplace import Laplace

        t = time.perf_counter()
        model = copy.deepcopy(net).eval()
        loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(
            torch.as_tensor(Xtr, device=dev), torch.as_tensor(ytr, device=dev)),
            batch_size=256)
        la = Laplace(model, "classification", subset_of_weights="last_layer",
                     hessian_structure="kron")
        la.fit(loader)
        la.optimize_prior_precision(pred_type="glm", method="marglik")

        def predict(X):
            out = []
            for i in range(0, len(X), 1000):
                xb = torch.as_tensor(X[i:i + 1000], device=dev)
                with torch.no_grad():
                    out.append(la(xb, pred_type="glm", link_approx="probit")
                               .double().cpu().numpy())
            return np.concatenate(out)

        return time.perf_counter() - t, predict, ""

    def estimator(entry):
        def run(_):
            est = entry.cls(net, **entry.params, device=args.device, random_state=0)
            t = time.perf_counter()
            if Xva is not None:
                est.fit(Xtr, ytr, validation_data=(Xva, yva))
            else:
                est.fit(Xtr, ytr)
            return time.perf_counter() - t, est.predict_proba, getattr(
                est, "jacobian_backend_", "")
        return run

    methods = [("raw softmax", raw), ("laplace-torch LL-KFAC+marglik", laplace_torch)]
    methods += [(e.id, estimator(e)) for e in ESTIMATORS
                if e.is_classifier and "likelihood" not in e.params]
    only = [s for s in args.only.split(",") if s]
    if only:
        methods = [m for m in methods if m[0] in only or m[0] == "raw softmax"]
    phases = _instrument(cuda) if args.phases else None
    signal.signal(signal.SIGALRM, _alarm)
    rss = RSSSampler().__enter__()
    rows = []
    for name, fn in methods:
        rec = dict(method=name)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        if phases is not None:
            phases.clear()
        signal.alarm(args.timeout)
        try:
            c0 = time.process_time()
            fit_s, predict, backend = fn(None)
            c1 = time.process_time()
            t = time.perf_counter()
            probs = [predict(X) for X in sets]
            pred_s = time.perf_counter() - t
            rec.update(fit_s=fit_s, predict_s=pred_s, backend=backend,
                       fit_cpu_s=c1 - c0, predict_cpu_s=time.process_time() - c1,
                       **metrics(p["yte"], *probs))
        except _Timeout:
            rec["error"] = f"not finished in {args.timeout} s"
        except Exception as exc:  # noqa: BLE001 - reported in the table
            rec["error"] = f"{type(exc).__name__}: {str(exc)[:160]}"
        finally:
            signal.alarm(0)
        if cuda:
            rec["gpu_gb"] = torch.cuda.max_memory_allocated() / 2**30
        rec["rss_mb"] = rss.peak
        if phases:
            rec["phases"] = {k: [v[0], round(v[1], 2)] for k, v in
                             sorted(phases.items(), key=lambda kv: -kv[1][1])}
        rows.append(rec)
        print(rec, flush=True)
    rss.__exit__(None, None, None)
    ref = next((r.get("fit_s", 0) + r.get("predict_s", 0) for r in rows
                if r["method"].startswith("laplace-torch") and "error" not in r), None)
    table = []
    for r in rows:
        gpu = f"{r['gpu_gb']:.2f}" if "gpu_gb" in r else ""
        if "error" in r:
            table.append([r["method"], r["error"], "", "", "", "", gpu,
                          f"{r['rss_mb']:.0f}"] + [""] * 6)
            continue
        total = r["fit_s"] + r["predict_s"]
        ratio = f"{total / ref:.1f}" if ref and total else ""
        table.append([r["method"], r["backend"], f"{r['fit_s']:.1f}", f"{r['predict_s']:.1f}",
                      f"{r['fit_cpu_s']:.1f} / {r['predict_cpu_s']:.1f}", ratio, gpu,
                      f"{r['rss_mb']:.0f}", f"{r['acc']:.3f}", f"{r['nll']:.3f}",
                      f"{r['ece']:.3f}", f"{r['auc_noise']:.3f}", f"{r['auc_unseen']:.3f}",
                      f"{r['blur_nll']:.3f}"])
    name = (torch.cuda.get_device_name(dev) if cuda else
            f"CPU, {torch.get_num_threads()} thread(s)")
    print(f"\nResNet-20, P = {P}, {len(Xtr)} training rows (net trained in {train_s:.0f} s, "
          f"{args.epochs} epochs), {args.n_test} test rows, situation ({args.situation}), "
          f"{name}\n")
    print(markdown_table(["method", "backend", "fit s", "predict s", "CPU s fit / predict",
                          "x laplace-torch",
                          "peak GPU GB", "peak RSS MB", "acc", "NLL", "ECE", "AUC noise",
                          "AUC unseen", "blur NLL"], table))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(dict(P=P, train_s=train_s, device=name, args=vars(args), rows=rows),
                      fh, indent=1)


if __name__ == "__main__":
    main()
