"""Shared machinery of the loaders: optional imports, validated reading of numeric
tables, file-order split sizes, training statistics and the returned ``Bunch``.

Every error about a file names the file and the problem (wrong column count,
non-numeric field, missing column, missing values, empty file, ...).
"""

from __future__ import annotations

import os

import numpy as np
from sklearn.utils import Bunch

#: Epsilon added to the training standard deviations (never to the means), so
#: that constant columns (Taxi's ``month`` is always 1 in a one-month file)
#: standardise to 0 instead of dividing by zero.
STD_EPS = 1e-6


def import_pandas(what, extra="data"):
    """Import pandas or raise an ImportError naming the extra that installs it."""
    try:
        import pandas as pd
    except ImportError as exc:
        raise ImportError(
            f"{what} needs pandas: pip install 'sklearn-lla[{extra}]' (or pip install pandas)"
        ) from exc
    return pd


def import_pyarrow(what):
    """Import pyarrow (and its parquet module) or raise a helpful ImportError."""
    try:
        import pyarrow
        import pyarrow.parquet  # noqa: F401
    except ImportError as exc:
        raise ImportError(
            f"{what} reads parquet files with pyarrow, which is not installed: "
            "pip install 'sklearn-lla[data]' (or pip install pyarrow)"
        ) from exc
    return pyarrow


def check_path(path):
    """``os.fspath(path)``, with a clear error when the file does not exist or is empty."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: no such file")
    if os.path.isdir(path):
        raise IsADirectoryError(f"{path}: is a directory, expected a data file")
    if os.path.getsize(path) == 0:
        raise ValueError(f"{path}: the file is empty")
    return path


def check_max_rows(max_rows):
    if max_rows is None:
        return None
    if isinstance(max_rows, bool) or not isinstance(max_rows, (int, np.integer)) or max_rows < 1:
        raise ValueError(f"max_rows must be a positive integer or None; got {max_rows!r}")
    return int(max_rows)


def numeric_frame(df, columns, name, *, first_line, allow_missing=False):
    """Columns of ``df`` as a float64 array, checked for non-numeric and missing values.

    ``first_line`` is the 1-based line of the file holding the first data row (2 for a
    CSV with a header, None for files without lines, e.g. pickles), used in messages.
    ``allow_missing=True`` returns missing values as NaN (infinite ones still raise).
    """
    pd = import_pandas("reading data files")
    missing = [c for c in columns if c not in df.columns]
    if missing:
        raise ValueError(
            f"{name}: missing column(s) {missing}; the file has columns {list(df.columns)}"
        )
    out = np.empty((len(df), len(columns)), dtype=np.float64)
    for j, col in enumerate(columns):
        s = df[col]
        if not (pd.api.types.is_numeric_dtype(s) and not pd.api.types.is_bool_dtype(s)):
            num = pd.to_numeric(s, errors="coerce")
            bad = np.flatnonzero(num.isna().to_numpy() & s.notna().to_numpy())
            if len(bad):
                raise ValueError(
                    f"{name}: non-numeric value {s.iloc[bad[0]]!r} in column {col!r} "
                    f"at {_where(bad[0], first_line)}"
                )
            s = num
        out[:, j] = s.to_numpy(dtype=np.float64, na_value=np.nan)
    check_finite(np.nan_to_num(out, nan=0.0, posinf=np.inf, neginf=-np.inf) if allow_missing
                 else out, columns, name, first_line=first_line)
    return out


def check_finite(arr, columns, name, *, first_line):
    """Raise a ValueError naming the first missing (NaN) or infinite cell of ``arr``."""
    bad = ~np.isfinite(arr)
    if bad.any():
        i, j = np.argwhere(bad)[0]
        what = "missing or empty value" if np.isnan(arr[i, j]) else "infinite value"
        n_bad_rows = int(bad.any(axis=1).sum())
        raise ValueError(
            f"{name}: {what} in column {columns[j]!r} at {_where(i, first_line)} "
            f"({n_bad_rows} row(s) affected; a truncated or malformed file?)"
        )


def _where(row, first_line):
    row = int(row)
    if first_line is None:
        return f"data row {row}"
    return f"data row {row} (line {row + first_line})"


def split_sizes(n_rows, n_train, n_val, n_test, *, proportional, test_reference, name):
    """File-order split sizes ``(n_train, n_val, n_test)`` for a table of ``n_rows`` rows.

    ``n_test=None`` means "every remaining row". When the table is too small for the
    requested sizes, raise, or (``proportional=True``) scale the sizes down by the
    same factor; with ``n_test=None`` the test share is then ``test_reference`` rows
    (the size of the paper's test split) relative to the requested train / val sizes.
    """
    for label, v in (("n_train", n_train), ("n_val", n_val), ("n_test", n_test)):
        if v is None and label == "n_test":
            continue
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise ValueError(f"{label} must be a positive integer; got {v!r}")
    need = n_train + n_val + (n_test if n_test is not None else 1)
    if n_rows >= need:
        rest = n_rows - n_train - n_val
        return int(n_train), int(n_val), int(rest if n_test is None else n_test)
    if not proportional:
        test = "at least 1 (the rest)" if n_test is None else n_test
        raise ValueError(
            f"{name}: {n_rows} rows, fewer than the {need} the split needs "
            f"(n_train={n_train}, n_val={n_val}, n_test={test}); pass smaller sizes, or "
            "proportional=True to scale the split down to the file"
        )
    total = n_train + n_val + (n_test if n_test is not None else test_reference)
    tr = int(n_rows * n_train // total)
    va = int(n_rows * n_val // total)
    te = n_rows - tr - va
    if min(tr, va, te) < 1:
        raise ValueError(
            f"{name}: {n_rows} rows are too few for a proportional train/val/test split "
            f"(got {tr}/{va}/{te} rows)"
        )
    return tr, va, te


def fraction_sizes(n_rows, train_fraction, val_fraction, name):
    """``(n_train, n_val, n_test)`` from fractions: ``int(n * f)`` rows, test the rest."""
    for label, f in (("train_fraction", train_fraction), ("val_fraction", val_fraction)):
        if not (isinstance(f, (float, int, np.floating)) and 0 < f < 1):
            raise ValueError(f"{label} must be in (0, 1); got {f!r}")
    if train_fraction + val_fraction >= 1:
        raise ValueError("train_fraction + val_fraction must be < 1 (the rest is the test set)")
    tr = int(n_rows * train_fraction)
    va = int(n_rows * val_fraction)
    te = n_rows - tr - va
    if min(tr, va, te) < 1:
        raise ValueError(
            f"{name}: {n_rows} rows are too few for the {train_fraction}/{val_fraction}/rest "
            f"split (got {tr}/{va}/{te} rows)"
        )
    return tr, va, te


def training_stats(X_train, y_train, eps=STD_EPS):
    """Means and standard deviations of the training split, ``eps`` added to the stds."""
    return (X_train.mean(axis=0), X_train.std(axis=0) + eps,
            float(y_train.mean()), float(y_train.std()) + eps)


def make_bunch(X, y, sizes, *, feature_names, target_name, descr, filename, standardize,
               as_frame, eps=STD_EPS, row_index=None, **extra):
    """Split ``X`` / ``y`` in file order and build the returned :class:`~sklearn.utils.Bunch`."""
    n_tr, n_va, n_te = sizes
    bounds = {"train": (0, n_tr), "val": (n_tr, n_tr + n_va),
              "test": (n_tr + n_va, n_tr + n_va + n_te)}
    X_mean, X_std, y_mean, y_std = training_stats(X[:n_tr], y[:n_tr], eps)
    out = Bunch(feature_names=list(feature_names), target_name=target_name,
                X_mean=X_mean, X_std=X_std, y_mean=y_mean, y_std=y_std,
                standardized=bool(standardize), DESCR=descr, filename=filename, **extra)
    if as_frame:
        pd = import_pandas("as_frame=True")
    for split, (lo, hi) in bounds.items():
        Xs, ys = X[lo:hi], y[lo:hi]
        if standardize:
            Xs = (Xs - X_mean) / X_std
            ys = (ys - y_mean) / y_std
        if as_frame:
            idx = pd.RangeIndex(lo, hi) if row_index is None else pd.Index(row_index[lo:hi])
            Xs = pd.DataFrame(Xs, columns=list(feature_names), index=idx)
            ys = pd.Series(ys, name=target_name, index=idx)
        out[f"X_{split}"], out[f"y_{split}"] = Xs, ys
    return out
