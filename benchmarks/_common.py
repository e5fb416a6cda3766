"""Helpers shared by the benchmark scripts (not part of the library).

* :func:`set_threads` pins torch / BLAS to a number of threads;
* :func:`peak_rss_mb` and :class:`RSSSampler` measure memory (high-water mark of the
  process, and a psutil sampler that also sees what ``ru_maxrss`` cannot separate);
* :func:`run_child` runs a function of a benchmark script in a fresh subprocess and
  returns the JSON it printed (clean peak RSS per measurement);
* :func:`estimator_classes` lists the estimators exported by ``sklearn_lla``;
* :func:`markdown_table` formats rows;
* :func:`train_skorch_mlp` trains the skorch MLP of the calibration and budget
  benchmarks, :func:`skorch_split_rows` replays its internal validation split;
* :func:`time_limit` bounds a call's wall time, :func:`warning_summary` and
  :func:`fitted_hypers` describe a fit.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import os
import resource
import signal
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
    "train_skorch_mlp",
    "skorch_split_rows",
    "BenchTimeout",
    "time_limit",
    "warning_summary",
    "fitted_hypers",
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


# ------------------------------------------------------------------- skorch nets
def train_skorch_mlp(X, y, classification, n_outputs, *, hidden=(50, 50), lr=3e-3,
                     weight_decay=1e-4, max_epochs=200, batch_size=128, seed=0,
                     holdout=True):
    """A skorch ``NeuralNetRegressor`` / ``NeuralNetClassifier`` on ``sklearn_lla.nets.MLP``.

    tanh hidden layers, float32, Adam, ``MSELoss`` (``y`` one column) or
    ``CrossEntropyLoss`` on logits, ``torch.manual_seed(seed)`` (the global torch
    generator is restored afterwards). ``holdout=True`` keeps skorch's default
    ``train_split`` (5-fold ``ValidSplit``: 20 % of the rows never trained on);
    ``holdout=False`` passes ``train_split=None`` (the net fits every row).
    """
    import numpy as np
    import torch
    from skorch import NeuralNetClassifier, NeuralNetRegressor

    from sklearn_lla.nets import MLP

    kw = dict(module=MLP, module__n_features=X.shape[1], module__n_outputs=n_outputs,
              module__hidden_layer_sizes=tuple(hidden), optimizer=torch.optim.Adam, lr=lr,
              optimizer__weight_decay=weight_decay, max_epochs=max_epochs,
              batch_size=batch_size, verbose=0)
    if not holdout:
        kw["train_split"] = None
    X = np.asarray(X, dtype=np.float32)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        if classification:
            net = NeuralNetClassifier(criterion=torch.nn.CrossEntropyLoss, **kw)
            net.fit(X, np.asarray(y, dtype=np.int64))
        else:
            net = NeuralNetRegressor(**kw)
            net.fit(X, np.asarray(y, dtype=np.float32).reshape(len(X), -1))
    return net


def skorch_split_rows(net, X, y):
    """``(train_rows, valid_rows)`` of a fitted skorch net's own ``train_split`` on ``(X, y)``.

    The split is replayed with the net's ``train_split`` (deterministic for skorch's
    default ``ValidSplit(5)``); ``None`` when the net has no ``train_split``.
    """
    import numpy as np
    from skorch.dataset import Dataset

    if net.train_split is None:
        return None
    y = np.asarray(y)
    ds_train, ds_valid = net.train_split(Dataset(np.zeros((len(X), 1)), y), y)
    return (np.sort(np.asarray(ds_train.indices, dtype=np.int64)),
            np.sort(np.asarray(ds_valid.indices, dtype=np.int64)))


# ------------------------------------------------------------------ fit helpers
class BenchTimeout(BaseException):
    """Raised by :func:`time_limit` (a ``BaseException``: ``except Exception`` misses it)."""


@contextlib.contextmanager
def time_limit(seconds):
    """Raise :class:`BenchTimeout` in the main thread after ``seconds`` (``None`` / 0: off).

    Uses ``SIGALRM`` (POSIX, main thread only): Python code is interrupted at the
    next bytecode, a long torch kernel when it returns.
    """
    if not seconds or not hasattr(signal, "SIGALRM"):
        yield
        return

    def _raise(signum, frame):
        raise BenchTimeout(f"wall time limit of {seconds:g} s reached")

    old = signal.signal(signal.SIGALRM, _raise)
    signal.setitimer(signal.ITIMER_REAL, float(seconds))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def warning_summary(caught, width: int = 100):
    """Distinct ``"Class: first width chars"`` of caught warnings (deprecations dropped),
    with a ``" (xN)"`` suffix for repeats, in first-seen order."""
    counts = {}
    for w in caught:
        if issubclass(w.category, (DeprecationWarning, FutureWarning)):
            continue
        key = f"{w.category.__name__}: {str(w.message)[:width]}".replace("\n", " ")
        counts[key] = counts.get(key, 0) + 1
    return [k + (f" (x{n})" if n > 1 else "") for k, n in counts.items()]


_HYPERS = ("prior_variance_", "noise_variance_", "temperature_", "covariance_scale_",
           "hyper_strategy_",
           "validation_source_", "n_iter_", "n_components_")


def fitted_hypers(est) -> dict:
    """The fitted hyperparameters an estimator has (JSON-friendly), by ``getattr``."""
    import numpy as np

    out = {}
    for name in _HYPERS:
        v = getattr(est, name, None)
        if v is None:
            continue
        if isinstance(v, np.ndarray):
            v = v.tolist() if v.size <= 10 else f"array{v.shape}"
        elif isinstance(v, np.generic):
            v = v.item()
        elif not isinstance(v, (int, float, str, bool, list)):
            v = str(v)
        out[name.rstrip("_")] = v
    return out
