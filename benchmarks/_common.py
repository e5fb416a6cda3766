"""Helpers shared by the benchmark scripts (not part of the library).

* :func:`set_threads` pins torch / BLAS to a number of threads;
* :func:`peak_rss_mb` and :class:`RSSSampler` measure memory (high-water mark of the
  process, and a psutil sampler that also sees what ``ru_maxrss`` cannot separate);
* :func:`run_child` runs a function of a benchmark script in a fresh subprocess and
  returns the JSON it printed (clean peak RSS per measurement);
* :func:`estimator_classes` lists the estimators exported by ``sklearn_lla``;
* :func:`markdown_table` formats rows.
"""

from __future__ import annotations

import inspect
import json
import os
import resource
import subprocess
import sys
import threading
import time

__all__ = [
    "set_threads",
    "peak_rss_mb",
    "current_rss_mb",
    "RSSSampler",
    "run_child",
    "estimator_classes",
    "accepts_validation_data",
    "markdown_table",
    "fmt",
]


def set_threads(n: int) -> None:
    """Limit torch (and, for children, OpenMP / MKL / OpenBLAS) to ``n`` threads."""
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ.setdefault(var, str(n))
    import torch

    torch.set_num_threads(n)


def peak_rss_mb() -> float:
    """High-water mark of this process's resident set, in MB (Linux: ru_maxrss is KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def current_rss_mb() -> float:
    """Current resident set of this process, in MB."""
    try:
        import psutil

        return psutil.Process().memory_info().rss / 2**20
    except ImportError:  # pragma: no cover
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


class RSSSampler:
    """Sample this process's RSS every ``interval`` seconds in a thread.

    ``peak`` is the largest sample since the last :meth:`reset` (so phases of one
    process can be told apart, which ``ru_maxrss`` cannot do). If ``limit_mb`` is
    given and a sample exceeds it, the process exits with status 3 (a guard so a
    benchmark never takes the machine's memory).
    """

    def __init__(self, interval: float = 0.02, limit_mb: float | None = None):
        self.interval = interval
        self.limit_mb = limit_mb
        self.peak = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            rss = current_rss_mb()
            self.peak = max(self.peak, rss)
            if self.limit_mb is not None and rss > self.limit_mb:
                sys.stderr.write(f"RSS {rss:.0f} MB exceeded the limit {self.limit_mb:.0f} MB; "
                                 "aborting this measurement\n")
                sys.stderr.flush()
                os._exit(3)
            time.sleep(self.interval)

    def reset(self) -> None:
        self.peak = current_rss_mb()

    def __enter__(self):
        self.reset()
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def run_child(script: str, args: list[str], env: dict | None = None, timeout: float | None = None):
    """Run ``python script *args`` and parse the line ``RESULT {json}`` it prints.

    Returns ``(result_dict_or_None, returncode, stderr_tail)``.
    """
    full_env = dict(os.environ)
    if env:
        full_env.update(env)
    try:
        proc = subprocess.run([sys.executable, script, *args], capture_output=True, text=True,
                              env=full_env, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        return None, "timeout", str(exc)[-2000:]
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    res = json.loads(lines[-1][7:]) if lines else None
    return res, proc.returncode, (proc.stderr or "")[-3000:]


def estimator_classes(task: str):
    """``(name, class)`` of every estimator in ``sklearn_lla.__all__`` for ``task``.

    ``task`` is ``"regression"`` or ``"classification"``. A class is kept when a
    default instance is a regressor / classifier by sklearn's tags; a class with a
    ``likelihood`` parameter (one estimator for both tasks) is kept when setting
    ``likelihood=task`` makes it one. Returns ``(name, class, extra_params)``.
    """
    from sklearn.base import BaseEstimator, is_classifier, is_regressor

    import sklearn_lla

    check = is_regressor if task == "regression" else is_classifier
    out = []
    for name in sklearn_lla.__all__:
        obj = getattr(sklearn_lla, name, None)
        if not (inspect.isclass(obj) and issubclass(obj, BaseEstimator)):
            continue
        try:
            inst = obj()
        except Exception:  # noqa: BLE001 - a class that cannot be built with defaults
            continue
        if check(inst):
            out.append((name, obj, {}))
            continue
        if "likelihood" in inst.get_params(deep=False):
            try:
                if check(obj(likelihood=task)):
                    out.append((f"{name}(likelihood={task!r})", obj, {"likelihood": task}))
            except Exception:  # noqa: BLE001
                pass
    return out


def accepts_validation_data(cls) -> bool:
    """Whether ``cls.fit`` has a ``validation_data`` parameter."""
    try:
        return "validation_data" in inspect.signature(cls.fit).parameters
    except (TypeError, ValueError):
        return False


def fmt(v, digits: int = 3) -> str:
    """Format a number for a table (``-`` for None, scientific for tiny / huge)."""
    if v is None:
        return "-"
    if isinstance(v, str):
        return v
    try:
        v = float(v)
    except (TypeError, ValueError):
        return str(v)
    if v != v:  # NaN
        return "nan"
    if v != 0 and (abs(v) < 10 ** -digits or abs(v) >= 10 ** 6):
        return f"{v:.{digits - 1}e}"
    return f"{v:.{digits}f}"


def markdown_table(header: list[str], rows: list[list]) -> str:
    """A GitHub-flavoured markdown table; cells go through :func:`fmt`."""
    cells = [[fmt(c) for c in r] for r in rows]
    lines = ["| " + " | ".join(header) + " |",
             "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(c.replace("|", "\\|").replace("\n", " ") for c in r) + " |"
              for r in cells]
    return "\n".join(lines)
