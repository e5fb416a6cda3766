"""Small shared helpers: devices, dtypes, seeding, batching and parameter checks."""

from __future__ import annotations

import contextlib
import numbers
from collections.abc import Iterator

import numpy as np
import torch
from sklearn.utils import check_random_state

__all__ = [
    "resolve_device",
    "torch_seed",
    "seeded",
    "iter_batches",
    "check_positive_or_auto",
    "check_positive_int",
    "as_tensor",
]


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


def iter_batches(n: int, batch_size: int) -> Iterator[slice]:
    """Yield consecutive slices of ``range(n)`` of length at most ``batch_size``."""
    batch_size = max(int(batch_size), 1)
    for start in range(0, n, batch_size):
        yield slice(start, min(start + batch_size, n))


def check_positive_or_auto(value, name: str, allow_auto: bool = True):
    """Validate a variance-like parameter: a finite float > 0, or ``"auto"``."""
    if allow_auto and isinstance(value, str) and value == "auto":
        return value
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        expected = "a float > 0 or 'auto'" if allow_auto else "a float > 0"
        raise TypeError(f"{name} must be {expected}, got {value!r}")
    if not np.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite positive number, got {value!r}")
    return float(value)


def check_positive_int(value, name: str, minimum: int = 1) -> int:
    """Validate an integer parameter ``>= minimum``."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value!r}")
    return int(value)


def as_tensor(X, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Convert validated array data to a tensor.

    Always copies from numpy (read-only memmaps cannot back a writable tensor).
    """
    arr = np.array(X, copy=True)
    return torch.as_tensor(arr, dtype=dtype, device=device)


