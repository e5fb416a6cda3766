"""Small shared helpers: devices, seeds, dtypes and torch threads (one home each)."""

from __future__ import annotations

import contextlib
import threading
from numbers import Integral

import numpy as np
import torch
from sklearn.utils import check_random_state

__all__ = ["resolve_device", "torch_seed", "int_seed", "generator_seed", "seeded",
           "torch_threads", "torch_threads_released", "module_dtype", "cast_rows"]


def resolve_device(device) -> torch.device:
    """Turn the ``device`` constructor parameter into a :class:`torch.device`.

    ``"auto"`` selects CUDA when it is available and the CPU otherwise.
    """
    if device is None or (isinstance(device, str) and device == "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if isinstance(device, torch.device):
        dev = device
    elif isinstance(device, str):
        try:
            dev = torch.device(device)
        except RuntimeError as exc:
            raise ValueError(f"device={device!r} is not a valid torch device") from exc
    else:
        raise TypeError(
            f"device must be 'auto', 'cpu', 'cuda' or a torch.device, got {device!r}"
        )
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} was requested but CUDA is not available")
    return dev


def torch_seed(random_state) -> int:
    """Draw a torch seed from ``random_state`` (int, RandomState or None)."""
    rng = check_random_state(random_state)
    return int(rng.randint(0, 2**31 - 1))


def int_seed(random_state) -> int:
    """An int ``random_state`` as it is, else one drawn from it (RandomState or None)."""
    if isinstance(random_state, Integral):
        return int(random_state)
    return int(check_random_state(random_state).randint(2**31 - 1))


def module_dtype(module) -> torch.dtype:
    """The dtype of a module's first floating-point parameter (float32 without any)."""
    for p in module.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.float32


def cast_rows(rows, dtype: torch.dtype) -> np.ndarray:
    """A fresh numpy copy of ``rows`` in the numpy dtype of the torch ``dtype``.

    Values beyond the dtype's range overflow to ``inf`` silently: the caller checks
    finiteness and names the rows in its error.
    """
    np_dtype = torch.empty((), dtype=dtype).numpy().dtype
    with np.errstate(over="ignore"):
        return np.array(rows, dtype=np_dtype, copy=True)


def generator_seed(generator: torch.Generator) -> int:
    """Draw a seed in ``[0, 2^31 - 1)`` from a :class:`torch.Generator` (advancing it).

    What an estimator passes to its posterior as ``random_state`` (k-means and other
    numpy-seeded initialisations) from the fit's generator.
    """
    return int(torch.randint(0, 2**31 - 1, (1,), generator=generator))


@contextlib.contextmanager
def seeded(seed: int, device: torch.device | None = None):
    """Run a block with torch's global RNG seeded, restoring the previous state afterwards.

    Code that cannot take a :class:`torch.Generator` (skorch training, module
    initialisation) is made reproducible this way without leaving any global seed set.
    """
    devices = []
    if device is not None and device.type == "cuda":
        devices = [device.index if device.index is not None else torch.cuda.current_device()]
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield


_THREADS_LOCK = threading.Lock()
_THREADS_STATE = {"depth": 0, "before": None}


@contextlib.contextmanager
def torch_threads(n: int):
    """Run the block with at most ``n`` torch intra-op threads, then restore the setting.

    Re-entrant and safe across threads (several fits or predictions at once): the
    first block to enter records the setting and lowers it, the last one to leave
    restores it. Like scikit-learn's ``threadpool_limits`` inside ``fit``, the limit
    is process-wide while any such block runs. ``n <= 0`` does nothing.
    """
    if n <= 0:
        yield
        return
    with _THREADS_LOCK:
        if _THREADS_STATE["depth"] == 0:
            before = torch.get_num_threads()
            _THREADS_STATE["before"] = before
            if n < before:
                torch.set_num_threads(n)
        _THREADS_STATE["depth"] += 1
    try:
        yield
    finally:
        with _THREADS_LOCK:
            _THREADS_STATE["depth"] -= 1
            if _THREADS_STATE["depth"] == 0:
                if torch.get_num_threads() != _THREADS_STATE["before"]:
                    torch.set_num_threads(_THREADS_STATE["before"])
                _THREADS_STATE["before"] = None


@contextlib.contextmanager
def torch_threads_released():
    """Inside a :func:`torch_threads` block, run this block with the setting that block
    lowered, then lower it again; outside one, do nothing.

    The limit is for code made of many small operations (a fixed-mean GP's steps),
    where a thread pool only adds synchronisation; a pass of large products inside
    the same fit (Jacobian rows of a convolutional net) gains from every thread
    (VaLLA on the digits CNN, 2 idle cores: fit + predict 3.3-3.7 s on one thread, 2.3
    s on two). Another thread's limited block that runs meanwhile gets the raised
    setting too (performance only: the limit is process-wide, as documented there).
    """
    with _THREADS_LOCK:
        before, lowered = _THREADS_STATE["before"], torch.get_num_threads()
        raise_ = _THREADS_STATE["depth"] > 0 and before is not None and before > lowered
        if raise_:
            torch.set_num_threads(before)
    try:
        yield
    finally:
        if raise_:
            with _THREADS_LOCK:
                if _THREADS_STATE["depth"] > 0 and torch.get_num_threads() != lowered:
                    torch.set_num_threads(lowered)
