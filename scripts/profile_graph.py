"""Where the graph backend's time goes on a ResNet-20 (a developer's profile).

Times ``LinearizedNet.jvp`` (ELLA's features: all outputs' rows, then ``R V``) on a
batch of images with ``K`` tangents, its parts (rows with all outputs batched over
the cotangents, rows one output at a time, the product), and prints torch.profiler's
top operators. Usage: ``python scripts/profile_graph.py [--device cuda] [--batch 256]``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from resnet_gpu import resnet20  # noqa: E402

from sklearn_lla._network.linearized import LinearizedNet  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--K", type=int, default=20)
    args = ap.parse_args()
    dev = torch.device(args.device)
    torch.manual_seed(0)
    net = resnet20().to(dev).eval()
    x = torch.randn(args.batch, 3072, device=dev)
    lin = LinearizedNet(net, dev, example_input=x[:4])
    be = lin.jacobian_backend
    print("backend", lin.backend, "step", be.kernel_step(10), "cost", be._cost)
    T = {n: torch.randn(args.K, *p.shape, device=dev) for n, p in lin.params.items()}

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    def timed(label, f, reps=3):
        f()
        sync()
        t = time.perf_counter()
        for _ in range(reps):
            f()
        sync()
        print(f"{label}: {(time.perf_counter() - t) / reps * 1e3:.1f} ms", flush=True)

    step = be.kernel_step(10)
    xs = x[:step]
    with torch.no_grad():
        timed(f"jvp, {args.batch} points", lambda: lin.jvp(x, T))
        timed(f"forward, {args.batch} points", lambda: lin.forward(x))
        timed(f"rows all outputs (batched backward), {step} points",
              lambda: be._rows(xs, None, False))
        idx = torch.zeros(step, dtype=torch.long, device=dev)
        timed(f"rows one output, {step} points (x10 = the loop)", lambda: be._rows(xs, idx, False))
        R = be._rows(xs, None, False)
        timed("R V product", lambda: R.matmul(T))
        timed("diag blocks", lambda: R.diag_blocks())
    if dev.type == "cuda":
        print("peak GB", torch.cuda.max_memory_allocated() / 2**30)
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
        with torch.no_grad(), profile(activities=acts) as prof:
            lin.jvp(x, T)
            sync()
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25))


if __name__ == "__main__":
    main()
