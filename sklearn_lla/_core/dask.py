"""Dask inputs: lazy validation, sums over partitions, streaming and lazy prediction.

Every estimator accepts dask arrays and dask DataFrames (for instance from
``dask.dataframe.read_parquet``) besides in-memory arrays. This module holds all
that is Dask-specific, so that the core (:mod:`sklearn_lla._core.protocol`,
:mod:`sklearn_lla._base`) stays small:

* :func:`is_dask` recognises a dask collection without importing dask (the library
  works without dask installed); dask is imported only once such an input arrives;
* :func:`validate_X` checks a dask input lazily (feature count and names, dtype, at
  least two rows) without computing it; non-finite values are found when a
  partition is read, and reported with the partition (:class:`PartitionError`);
* :func:`partition_reduce` runs a row-sum pass (``fn(payload, batches)`` whose
  results add) as one task per partition on the active ``distributed.Client``
  (else dask's default scheduler): the payload (the frozen network, the feature
  basis, the likelihood) is one node of the graph, so it travels to each worker
  once, and the partial sums come back and are added on the client in float64, in
  partition order (the result does not depend on which worker ran what, and a task
  lost with its worker is simply re-run);
* :func:`stream_batches` reads the partitions one after the other on the client
  (the next one is fetched while the current one is used) and yields batches whose
  boundaries are those of the in-memory path, for passes that are not sums
  (curvlinops' KFAC, the sampled-LLA statistics);
* :func:`lazy_apply` builds ``predict`` / ``predict_proba`` / ``sample_y`` as
  ``map_blocks`` over the row blocks: nothing is computed until the user asks.
"""

from __future__ import annotations

import uuid
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from .utils import cast_rows

__all__ = ["PartitionError", "is_dask", "validate_X", "materialize", "partition_reduce",
           "stream_batches", "lazy_apply", "block_seed", "row_bounds", "read_rows"]

_FLOAT_DTYPES = (np.dtype(np.float64), np.dtype(np.float32))

#: Bytes of partitions a fit keeps in memory after reading them on the client (per
#: FitData, least recently used first out): repeated passes over a small stream (a
#: validation set evaluated every few optimiser steps) read it once.
BLOCK_CACHE_BYTES = 1 << 28


class PartitionError(ValueError):
    """An error raised while processing one partition of a dask input.

    Parameters
    ----------
    partition : int
        Index of the partition (row block) of ``X``.
    start, stop : int
        The rows ``start .. stop - 1`` of ``X`` in that partition (``-1`` if unknown).
    message : str
        What went wrong.
    """

    def __init__(self, partition, start, stop, message):
        self.partition, self.start, self.stop = int(partition), int(start), int(stop)
        self.message = str(message)
        rows = f" (rows {start}..{stop - 1})" if start >= 0 else ""
        super().__init__(f"partition {partition}{rows} of X: {message}")

    def __reduce__(self):  # picklable across processes (worker -> client)
        return type(self), (self.partition, self.start, self.stop, self.message)


def is_dask(x) -> bool:
    """Whether ``x`` is a dask collection (tested without importing dask)."""
    return x is not None and callable(getattr(type(x), "__dask_graph__", None))


def materialize(x):
    """A dask collection computed into memory (numpy); anything else unchanged."""
    if not is_dask(x):
        return x
    return np.asarray(x.compute())


def row_bounds(X):
    """``[(start, stop), ...]`` of the row blocks of a dask array with known chunks."""
    ends = np.cumsum((0,) + tuple(int(c) for c in X.chunks[0]))
    return [(int(a), int(b)) for a, b in zip(ends[:-1], ends[1:])]


def _to_array(X, lengths):
    if hasattr(X, "to_dask_array"):  # dask DataFrame or Series
        # counted on the array itself: dask-expr may fuse partitions of a projected
        # parquet read differently when it counts the DataFrame's partitions
        X = X.to_dask_array()
    if lengths and any(np.isnan(c) for c in X.chunks[0]):
        X = X.compute_chunk_sizes()
    return X


def validate_X(est, X, *, reset):
    """Check a dask ``X`` lazily; returns a 2-D float dask array (float32 stays).

    At fit (``reset=True``) the row counts of the partitions are made known (a
    DataFrame's are counted, one cheap pass), which row access needs; at predict
    they may stay unknown, and nothing is computed.
    """
    from sklearn.utils.validation import _check_feature_names, _check_n_features

    # a dask DataFrame's empty pandas ``_meta`` carries its columns and dtypes
    _check_feature_names(est, getattr(X, "_meta", X), reset=reset)
    dtypes = getattr(X, "dtypes", None)
    if dtypes is not None and not np.isscalar(dtypes) and hasattr(dtypes, "items"):
        bad = [str(c) for c, dt in dtypes.items()
               if not (np.issubdtype(np.dtype(dt), np.number) or np.dtype(dt) == bool)]
        if bad:
            raise ValueError(f"X has non-numeric column(s) {bad[:10]}; encode them (for "
                             "example with dask_ml.preprocessing) before fitting")
    A = _to_array(X, lengths=reset)
    if A.ndim != 2:
        raise ValueError(f"Expected a 2D array, got a {A.ndim}D dask array; reshape the "
                         "data (a single feature: X.reshape(-1, 1))")
    if A.shape[1] == 0:
        raise ValueError("X has 0 features; at least one is required")
    _check_n_features(est, A, reset=reset)
    if A.dtype not in _FLOAT_DTYPES:
        if A.dtype.kind not in "biuf":
            raise ValueError(f"X has dtype {A.dtype}; expected numbers")
        A = A.astype(np.float64)
    if A.numblocks[1] > 1:
        A = A.rechunk({1: -1})
    if reset and A.shape[0] < 2:
        raise ValueError(f"Found array with {A.shape[0]} sample(s) while a minimum of 2 "
                         "is required")
    return A


def _as_numpy(block, dtype, partition, start, stop):
    """A block in the network's dtype, checked finite (the error names the partition)."""
    arr = cast_rows(block, dtype)
    np_dtype = arr.dtype
    if not np.isfinite(arr).all():
        bad = int(np.flatnonzero(~np.isfinite(arr).all(axis=tuple(range(1, arr.ndim))))[0])
        raise PartitionError(
            partition, start, stop,
            f"non-finite values (NaN or inf) in the network's dtype {np_dtype} (first at "
            f"local row {bad}); clean or rescale the inputs")
    return arr


def read_rows(X, rows, dtype, device):
    """Rows ``rows`` (sorted int array) of a dask ``X`` as a tensor; one compute.

    Only the partitions holding those rows are read; a non-finite value is reported
    with its partition.
    """
    arr = cast_rows(np.asarray(X[rows].compute()), dtype)
    np_dtype = arr.dtype
    finite = np.isfinite(arr).all(axis=1)
    if not finite.all():
        row = int(rows[np.flatnonzero(~finite)[0]])
        for i, (a, b) in enumerate(row_bounds(X)):
            if a <= row < b:
                raise PartitionError(i, a, b, f"non-finite values (NaN or inf) in the network's "
                                     f"dtype {np_dtype} at row {row}; clean or rescale the "
                                     "inputs")
    return torch.from_numpy(arr).to(device)


# --------------------------------------------------------------------- map-reduce
def _partition_task(fn, payload, block, y, local, partition, start, stop, batch_size,
                    dtype, device):
    """One partition of a row-sum pass: ``fn(payload, batches)`` with CPU results."""
    try:
        block = np.asarray(block)
        if local is not None:
            block = block[local]
        x_all = torch.from_numpy(_as_numpy(block, dtype, partition, start, stop))
        y_all = torch.from_numpy(y).to(device)

        def batches():
            for s in range(0, len(x_all), batch_size):
                yield x_all[s:s + batch_size].to(device), y_all[s:s + batch_size]

        out = fn(payload, batches())
        return tuple(o.detach().cpu() if isinstance(o, torch.Tensor) else o for o in out)
    except PartitionError:
        raise
    except Exception as exc:  # noqa: BLE001 - re-raised with the partition named
        raise PartitionError(partition, start, stop,
                             f"{type(exc).__name__}: {exc}") from exc


def _add(parts, device):
    """Entry-wise sum of the partial results, in partition order, in float64."""
    total = None
    for part in parts:
        if total is None:
            total = [p.double() if isinstance(p, torch.Tensor) and p.is_floating_point()
                     else p for p in part]
            continue
        total = [t + (p.double() if isinstance(p, torch.Tensor) and p.is_floating_point()
                      else p) for t, p in zip(total, part)]
    return tuple(t.to(device) if isinstance(t, torch.Tensor) else t for t in total)


def partition_reduce(data, fn, payload, batch_size):
    """``fn(payload, batches)`` summed over the partitions of a dask-backed FitData.

    Parameters
    ----------
    data : FitData
        Its ``X`` is a dask array with known row chunks.
    fn : callable
        A module-level function ``fn(payload, batches) -> tuple`` whose entries
        (float64 tensors, floats, ints) add over disjoint sets of rows.
    payload : object
        What ``fn`` needs (the feature map with its network, the likelihood); one
        node of the graph, shipped to each worker once.
    batch_size : int
        Rows per batch inside a partition.

    Returns
    -------
    tuple
        The entry-wise sums, float64 tensors on ``data.device``.
    """
    import dask

    X, index = data.X, data.index
    blocks = X.to_delayed().ravel()
    y = data.y.detach().cpu().numpy()
    pay = dask.delayed(payload, name=f"sklearn-lla-payload-{uuid.uuid4().hex}",
                       traverse=False)
    task = dask.delayed(_partition_task, pure=False)
    tasks = []
    for i, (a, b) in enumerate(row_bounds(X)):
        if index is None:
            local, yb = None, y[a:b]
        else:
            sel = index[(index >= a) & (index < b)]
            if not len(sel):
                continue
            local, yb = sel - a, y[sel]
        tasks.append(task(fn, pay, blocks[i], np.ascontiguousarray(yb), local, i, a, b,
                          int(batch_size), data.dtype, data.device))
    if not tasks:
        raise ValueError("no rows to process")
    parts = dask.compute(*tasks)
    return _add(parts, data.device)


# ---------------------------------------------------------------------- streaming
def stream_batches(data, batch_size):
    """Yield ``(x, y)`` batches of a dask-backed FitData, read partition by partition.

    The batch boundaries are those of the in-memory path (``batch_size``
    consecutive rows of the stream, across partition boundaries), so a pass that
    depends on them (random draws per batch) gives the same result. Only the
    partitions holding rows of the stream are read, one at a time, the next one
    fetched in the background.
    """
    X, index = data.X, data.index
    dtype = data.dtype
    jobs = []
    for i, (a, b) in enumerate(row_bounds(X)):
        if index is None:
            jobs.append((i, a, b, None, np.arange(a, b)))
        else:
            pos = np.flatnonzero((index >= a) & (index < b))
            if len(pos):
                jobs.append((i, a, b, index[pos] - a, pos))
    bs = int(batch_size)
    pool = ThreadPoolExecutor(max_workers=1)
    cache = data.__dict__.setdefault("_dask_block_cache", {})

    def fetch(j):
        i, a, b, _, _ = jobs[j]
        if i in cache:
            return cache[i]
        return _as_numpy(np.asarray(X.blocks[i].compute()), dtype, i, a, b)

    try:
        pending = pool.submit(fetch, 0) if jobs else None
        xs, ys, have = [], [], 0
        for j, (i, _, _, local, pos) in enumerate(jobs):
            arr = pending.result()
            pending = pool.submit(fetch, j + 1) if j + 1 < len(jobs) else None
            _remember(cache, i, arr)
            arr = arr if local is None else arr[local]
            xs.append(arr)
            ys.append(pos)
            have += len(arr)
            while have >= bs:
                x, rows, xs, ys = _take(xs, ys, bs)
                have -= bs
                yield _pair(data, x, rows)
        if have:
            x, rows, _, _ = _take(xs, ys, have)
            yield _pair(data, x, rows)
    finally:
        if pending is not None:
            pending.cancel()
        pool.shutdown(wait=False)


def _remember(cache, i, arr):
    """Keep block ``i`` in the per-fit LRU cache within :data:`BLOCK_CACHE_BYTES`."""
    cache.pop(i, None)
    if arr.nbytes > BLOCK_CACHE_BYTES:
        return
    while cache and sum(a.nbytes for a in cache.values()) + arr.nbytes > BLOCK_CACHE_BYTES:
        cache.pop(next(iter(cache)))
    cache[i] = arr


def _take(xs, ys, n):
    """The first ``n`` rows of the pending pieces, and what is left."""
    out_x, out_y, got = [], [], 0
    while got < n:
        k = min(n - got, len(xs[0]))
        out_x.append(xs[0][:k])
        out_y.append(ys[0][:k])
        got += k
        if k == len(xs[0]):
            xs, ys = xs[1:], ys[1:]
        else:
            xs = [xs[0][k:]] + xs[1:]
            ys = [ys[0][k:]] + ys[1:]
    x = out_x[0] if len(out_x) == 1 else np.concatenate(out_x)
    return x, np.concatenate(out_y), xs, ys


def _pair(data, x, rows):
    """Tensors of a batch: ``rows`` are positions in the stream (global rows w/o index)."""
    x = torch.from_numpy(np.array(x, copy=True)).to(data.device)
    if data.index is None:
        y = data.y[int(rows[0]):int(rows[-1]) + 1]
    else:
        y = data.y[torch.from_numpy(data.index[rows]).to(data.y.device)]
    return x, y


# -------------------------------------------------------------------------- predict
def block_seed(random_state, block):
    """The seed of block ``block`` of a lazy ``sample_y`` with integer ``random_state``."""
    ss = np.random.SeedSequence([int(random_state) % 2**32, int(block)])
    return int(ss.generate_state(1)[0])


def _apply_block(block, est, method, kwargs, block_info=None):
    """``est.method(block)`` on one row block; errors name the partition."""
    loc = block_info[0] if block_info else {}
    i = loc.get("chunk-location", (-1,))[0]
    a, b = loc.get("array-location", [(-1, 0)])[0]
    try:
        if len(block) == 0:
            raise ValueError("empty block")
        Xb = block
        names = getattr(est, "feature_names_in_", None)
        if names is not None:
            import pandas as pd

            Xb = pd.DataFrame(block, columns=names, copy=False)
        kw = dict(kwargs)
        if method == "sample_y":
            kw["random_state"] = block_seed(kw.pop("seed"), i)
            return est.sample_y(Xb, **kw)
        if method == "predict_std":
            m, s = est.predict(Xb, return_std=True)
            return np.concatenate([m.reshape(len(m), -1), s.reshape(len(s), -1)], axis=1)
        return getattr(est, method)(Xb, **kw)
    except PartitionError:
        raise
    except Exception as exc:  # noqa: BLE001 - re-raised with the partition named
        msg = f"{type(exc).__name__}: {exc}"
        raise PartitionError(i, a, b if a >= 0 else 0, msg) from exc


def lazy_apply(est, X, method, *, shape_tail, dtype=np.float64, **kwargs):
    """A lazy dask array of ``est.method(X)`` computed block by block with ``map_blocks``.

    Parameters
    ----------
    est : fitted estimator
        Shipped once per worker (one node of the graph).
    X : dask array of shape (n, n_features)
        Validated (one chunk along the features).
    method : str
        ``"predict"``, ``"predict_proba"``, ``"predict_std"`` (mean and std side by
        side) or ``"sample_y"`` (``seed`` in ``kwargs``; block ``i`` draws with
        :func:`block_seed` ``(seed, i)``).
    shape_tail : tuple of int
        Trailing shape of the output per row: ``()`` for one value per row.
    dtype : numpy dtype, default=float64
    **kwargs
        Passed to the method.

    Returns
    -------
    dask.array.Array of shape (n, *shape_tail)
    """
    import dask

    est_d = dask.delayed(est, name=f"sklearn-lla-estimator-{uuid.uuid4().hex}",
                         traverse=False)
    chunks = (X.chunks[0],) + tuple((int(t),) for t in shape_tail)
    opts = {}
    if len(shape_tail) == 0:
        opts["drop_axis"] = 1
    elif len(shape_tail) == 2:
        opts["new_axis"] = 2
    meta = np.empty((0,) * (1 + len(shape_tail)), dtype=dtype)
    return X.map_blocks(_apply_block, est_d, method, kwargs, dtype=dtype, chunks=chunks,
                        meta=meta, **opts)
