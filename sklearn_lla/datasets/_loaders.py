"""The Year, Airline and Taxi loaders: read the original files, prepare them as the
papers do (features, target, filters, units) and split them in file order."""

from __future__ import annotations

import contextlib
import os
import pickle
import shutil
import tempfile
import warnings
import zipfile
import zlib

import numpy as np

from ._common import (
    check_finite,
    check_max_rows,
    check_path,
    fraction_sizes,
    import_pandas,
    import_pyarrow,
    make_bunch,
    numeric_frame,
    split_sizes,
)

__all__ = ["load_year", "load_airline", "load_taxi", "YEAR_FEATURES", "AIRLINE_FEATURES",
           "TAXI_FEATURES", "TAXI_COLUMNS"]

#: Year: 12 timbre averages then 78 timbre covariances (UCI's description).
YEAR_FEATURES = [f"timbre_avg_{i}" for i in range(1, 13)] + [
    f"timbre_cov_{i}" for i in range(1, 79)]
#: Rows of the paper's Year test split: the 51,630 rows after train and validation.
YEAR_N_TEST = 51_630

#: Airline features, in the papers' order (Hensman et al. 2013's recipe).
AIRLINE_FEATURES = ["Month", "DayofMonth", "DayOfWeek", "plane_age", "AirTime", "Distance",
                    "ArrTime", "DepTime"]

#: Taxi features built from the TLC columns.
TAXI_FEATURES = ["time_of_day", "day_of_week", "day_of_month", "month", "PULocationID",
                 "DOLocationID", "trip_distance", "duration"]
#: TLC columns the Taxi preparation reads.
TAXI_COLUMNS = ["tpep_pickup_datetime", "tpep_dropoff_datetime", "PULocationID",
                "DOLocationID", "trip_distance", "total_amount"]

_YEAR_DESCR = """\
YearPredictionMSD (UCI, Bertin-Mahieux et al. 2011), as prepared by the VaLLA / FMGP
papers: 90 audio features (12 timbre averages, 78 timbre covariances) -> release year
(first column). File-order splits: the first {n_train} rows train, the next {n_val}
validation, then {n_test} test (paper: 400,000 / 63,715 / 51,630, UCI's original
train/test split with validation carved from the end of train). Read from {file}."""

_AIRLINE_DESCR = """\
US flight delays (the airline table of Hensman et al. 2013 / Dutordoir et al. 2020), as
prepared by the VaLLA / FMGP papers: Month, DayofMonth, DayOfWeek, plane_age, AirTime,
Distance, ArrTime, DepTime -> ArrDelay (minutes); ArrTime and DepTime converted from
HHMM to minutes after midnight (60 * floor(t / 100) + t mod 100). File-order splits:
{n_train} train, {n_val} validation, {n_test} test (paper: 600k / 100k / 100k; later
rows unused). Read from {file}."""

_TAXI_DESCR = """\
NYC yellow taxi trips (TLC trip records), as prepared by the VaLLA / FMGP papers:
time of day (pickup, seconds after midnight), day of week (Monday = 0), day of month,
month, PULocationID, DOLocationID, trip_distance, duration (dropoff - pickup, seconds)
-> total_amount. Trips kept when 10 s <= duration <= 5 h ({n_dropped} of {n_read} rows
dropped). File-order splits of the kept trips: {n_train} train, {n_val} validation,
{n_test} test (paper: 80 % / 10 % / 10 %). Read from {file}."""


# ------------------------------------------------------------------- CSV reading
def _read_csv(open_src, name, *, header, usecols, nrows, float_columns=None, na_values=None):
    """``(frame, is_float)``: read a CSV, float64 when every field parses, else as text.

    ``open_src`` is a context-manager factory yielding a path or binary handle;
    ``float_columns`` are the columns parsed as float64 (None: all), the others are
    left to pandas. ``na_values``: the only fields read as missing (e.g. ``["", "NA"]``),
    in both reads; None keeps pandas' default list in the float read and only ``""`` in
    the text read.
    """
    pd = import_pandas("reading CSV files")
    na = {} if na_values is None else {"keep_default_na": False, "na_values": list(na_values)}
    text_na = list(na_values) if na_values is not None else [""]

    def read(**kw):
        # index_col=False: a first row longer than the header is an error here (a
        # ParserWarning made an error), never a silent implicit index column.
        with open_src() as src, warnings.catch_warnings():
            warnings.simplefilter("error", pd.errors.ParserWarning)
            return pd.read_csv(src, header=header, usecols=usecols, nrows=nrows,
                               index_col=False, **kw)

    try:
        try:
            dtype = (np.float64 if float_columns is None
                     else dict.fromkeys(float_columns, np.float64))
            return read(dtype=dtype, **na), True
        except pd.errors.EmptyDataError as exc:
            raise ValueError(f"{name}: the file is empty") from exc
        except (pd.errors.ParserError, pd.errors.ParserWarning) as exc:
            raise ValueError(f"{name}: wrong number of columns ({exc})") from exc
        except UnicodeDecodeError as exc:
            raise ValueError(f"{name}: not a text file ({exc})") from exc
        except ValueError:  # a non-numeric field: read as text, the caller says where
            return read(dtype=str, keep_default_na=False, na_values=text_na), False
    except (zipfile.BadZipFile, EOFError, OSError, zlib.error) as exc:
        raise ValueError(f"{name}: cannot read the file ({type(exc).__name__}: {exc}); "
                         "a truncated or corrupt file?") from exc


def _as_float(df, is_float, columns, name, first_line):
    if not is_float:
        return numeric_frame(df, columns, name, first_line=first_line)
    arr = df[columns].to_numpy(dtype=np.float64)
    check_finite(arr, columns, name, first_line=first_line)
    return arr


# --------------------------------------------------------------------------- Year
def _year_source(path):
    """``(open_src, name)``: a context-manager factory for the text, and a label."""
    is_zip = zipfile.is_zipfile(path)
    if path.lower().endswith(".zip") and not is_zip:
        raise ValueError(f"{path}: not a valid zip archive (bad or truncated zip file)")
    if not is_zip:
        return (lambda: contextlib.nullcontext(path)), path
    try:
        with zipfile.ZipFile(path) as zf:
            members = [m for m in zf.infolist()
                       if not m.is_dir() and not m.filename.startswith("__MACOSX/")]
    except (zipfile.BadZipFile, OSError) as exc:
        raise ValueError(f"{path}: bad zip archive ({exc})") from exc
    txt = [m for m in members if m.filename.lower().endswith(".txt")] or members
    if len(txt) != 1:
        raise ValueError(f"{path}: expected one YearPredictionMSD text file in the zip, found "
                         f"{[m.filename for m in members]}")
    member = txt[0].filename

    @contextlib.contextmanager
    def open_src():
        # pandas parses a file on disk about twice as fast as a zip member's stream,
        # so the member is extracted to a temporary file, removed afterwards
        with tempfile.TemporaryDirectory(prefix="sklearn_lla_") as tmp:
            out = os.path.join(tmp, "YearPredictionMSD.txt")
            with zipfile.ZipFile(path) as zf, zf.open(member) as src, open(out, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
            yield out

    return open_src, f"{path}!{member}"


def _read_year_table(path, nrows):
    opener, name = _year_source(path)
    n_cols = 1 + len(YEAR_FEATURES)
    columns = ["year", *YEAR_FEATURES]
    df, is_float = _read_csv(opener, name, header=None, usecols=None, nrows=nrows)
    if df.shape[1] != n_cols:
        raise ValueError(f"{name}: {df.shape[1]} columns, expected {n_cols} (the year, then "
                         "90 features)")
    if len(df) == 0:
        raise ValueError(f"{name}: no data rows")
    df.columns = columns
    return _as_float(df, is_float, columns, name, first_line=1), name


def _rows_to_read(max_rows, proportional, n_train, n_val, n_test):
    """Rows worth reading: the split's total when it is fixed, capped by ``max_rows``."""
    if proportional or n_test is None:
        return max_rows
    try:
        need = int(n_train) + int(n_val) + int(n_test)
    except (TypeError, ValueError):
        return max_rows  # split_sizes reports the bad size
    return need if max_rows is None else min(need, max_rows)


def load_year(path, *, n_train=400_000, n_val=63_715, n_test=None, proportional=False,
              max_rows=None, standardize=False, as_frame=False):
    """Load YearPredictionMSD prepared as in the VaLLA / FMGP papers.

    Reads UCI's ``YearPredictionMSD.txt`` (comma-separated, no header: the release
    year, then 90 features) or the ``YearPredictionMSD.txt.zip`` it ships in. The
    target is the year, the features the 90 timbre statistics. Splits follow the file
    order: the first ``n_train`` rows train, the next ``n_val`` validation, then the
    test rows.

    Parameters
    ----------
    path : str or os.PathLike
        The ``.txt`` file, or a zip archive holding it.
    n_train : int, default=400_000
        Rows of the training split (the paper's value).
    n_val : int, default=63_715
        Rows of the validation split (the paper's value).
    n_test : int or None, default=None
        Rows of the test split; None takes every remaining row (51,630 in the full
        file).
    proportional : bool, default=False
        What to do when the file has fewer rows than the split needs: False raises a
        ValueError; True scales the three sizes down in the paper's proportions.
    max_rows : int or None, default=None
        Read only the first ``max_rows`` rows of the file.
    standardize : bool, default=False
        Return inputs and targets standardised with the training statistics
        (``(X - X_mean) / X_std``, ``(y - y_mean) / y_std``).
    as_frame : bool, default=False
        Return the splits as pandas DataFrames (inputs) and Series (targets), indexed by
        row number in the file.

    Returns
    -------
    data : :class:`~sklearn.utils.Bunch`
        ``X_train, y_train, X_val, y_val, X_test, y_test`` (float64 arrays, or pandas
        objects with ``as_frame=True``); ``feature_names`` (90 names),
        ``target_name`` (``"year"``); the training statistics ``X_mean``, ``X_std``
        (arrays), ``y_mean``, ``y_std`` (floats), the stds including the epsilon
        ``1e-6``; ``standardized``; ``DESCR``; ``filename``.

    See Also
    --------
    fetch_year : Download the file first (scikit-learn style).

    Examples
    --------
    A 10-row file in the original format, split 6 / 2 / rest:

    >>> import os, tempfile
    >>> import numpy as np
    >>> from sklearn_lla.datasets import load_year
    >>> path = os.path.join(tempfile.mkdtemp(), "YearPredictionMSD.txt")
    >>> rows = np.column_stack([np.arange(2000, 2010), np.ones((10, 90))])
    >>> np.savetxt(path, rows, delimiter=",", fmt="%g")
    >>> data = load_year(path, n_train=6, n_val=2)
    >>> data.X_train.shape, data.X_val.shape, data.X_test.shape
    ((6, 90), (2, 90), (2, 90))
    >>> data.y_test.tolist()
    [2008.0, 2009.0]
    """
    path = check_path(path)
    max_rows = check_max_rows(max_rows)
    arr, name = _read_year_table(
        path, _rows_to_read(max_rows, proportional, n_train, n_val, n_test))
    sizes = split_sizes(len(arr), n_train, n_val, n_test, proportional=proportional,
                        test_reference=YEAR_N_TEST, name=name)
    arr = arr[: sum(sizes)]
    n_tr, n_va, n_te = sizes
    return make_bunch(
        arr[:, 1:], arr[:, 0], sizes, feature_names=YEAR_FEATURES, target_name="year",
        descr=_YEAR_DESCR.format(n_train=n_tr, n_val=n_va, n_test=n_te, file=name),
        filename=path, standardize=standardize, as_frame=as_frame)


# ------------------------------------------------------------------------ Airline
def hhmm_to_minutes(t):
    """Convert HHMM clock times to minutes after midnight, as the Airline preparation does.

    ``60 * floor(t / 100) + t mod 100``, the recipe of Hensman et al. (2013) that the
    papers follow (``2400`` stays ``1440``; no wrapping).

    Parameters
    ----------
    t : array-like
        Clock times written as HHMM numbers (``1435`` is 14:35).

    Returns
    -------
    minutes : ndarray of float64
        Minutes after midnight, same shape as ``t``.

    Examples
    --------
    >>> from sklearn_lla.datasets import hhmm_to_minutes
    >>> hhmm_to_minutes([0, 59, 100, 1435, 2400]).tolist()
    [0.0, 59.0, 60.0, 875.0, 1440.0]
    """
    t = np.asarray(t, dtype=np.float64)
    return 60.0 * np.floor(t / 100.0) + np.mod(t, 100.0)


def _airline_format(path, format):
    if format is not None:
        if format not in ("csv", "pickle"):
            raise ValueError(f"format must be 'csv', 'pickle' or None; got {format!r}")
        return format
    low = path.lower()
    for ext in (".gz", ".bz2", ".xz", ".zip", ".zst"):
        if low.endswith(ext):
            low = low[: -len(ext)]
    if low.endswith((".pkl", ".pickle")):
        return "pickle"
    if low.endswith((".csv", ".txt")):
        return "csv"
    raise ValueError(f"{path}: cannot tell the format from the name; pass format='csv' or "
                     "format='pickle'")


def _read_airline(path, fmt, nrows):
    """``(frame, is_float, first_line)`` of the airline table (first ``nrows`` rows)."""
    pd = import_pandas("load_airline")
    cols = [*AIRLINE_FEATURES, "ArrDelay"]
    if fmt == "pickle":
        try:
            df = pd.read_pickle(path)
        except (pickle.UnpicklingError, EOFError, AttributeError, ImportError, IndexError,
                ValueError, TypeError, OSError, zlib.error) as exc:
            raise ValueError(f"{path}: cannot unpickle the file ({type(exc).__name__}: {exc}); "
                             "a truncated file or not a pickle?") from exc
        if not isinstance(df, pd.DataFrame):
            raise ValueError(f"{path}: the pickle holds a {type(df).__name__}, expected a "
                             "pandas DataFrame with the airline columns")
        first_line = None
        is_float = False
    else:
        opener = lambda: contextlib.nullcontext(path)  # noqa: E731
        header, _ = _read_csv(opener, path, header=0, usecols=None, nrows=0)
        df = header
        first_line = 2
    missing = [c for c in cols if c not in df.columns]
    if missing:
        raise ValueError(f"{path}: missing column(s) {missing}; the file has columns "
                         f"{list(df.columns)}")
    if fmt == "pickle":
        return (df if nrows is None else df.iloc[:nrows]), is_float, first_line
    # every column is read (usecols would skip the field-count check of each line)
    df, is_float = _read_csv(opener, path, header=0, usecols=None, nrows=nrows,
                             float_columns=cols)
    return df, is_float, first_line


def load_airline(path, *, format=None, n_train=600_000, n_val=100_000, n_test=100_000,
                 proportional=False, max_rows=None, standardize=False, as_frame=False):
    """Load the US flight-delay (Airline) table prepared as in the VaLLA / FMGP papers.

    Reads the airline delay table (Hensman et al. 2013; Dutordoir et al. 2020) as a
    CSV with a header row or a pickled pandas DataFrame. It must have the columns
    ``Month, DayofMonth, DayOfWeek, plane_age, AirTime, Distance, ArrTime, DepTime,
    ArrDelay`` (others are ignored). Preparation: those eight features in that order,
    ``ArrTime`` and ``DepTime`` converted from HHMM clock times to minutes after
    midnight (``60 * floor(t / 100) + t mod 100``), target ``ArrDelay``; the first
    ``n_train`` rows train, the next ``n_val`` validation, the next ``n_test`` test,
    later rows unused.

    Parameters
    ----------
    path : str or os.PathLike
        The CSV (optionally compressed: ``.csv.gz`` ...) or pickle (``.pkl``,
        ``.pickle``) file. Only unpickle files you trust.
    format : {"csv", "pickle"} or None, default=None
        The file format; None infers it from the file name.
    n_train : int, default=600_000
        Rows of the training split (the paper's value).
    n_val : int, default=100_000
        Rows of the validation split (the paper's value).
    n_test : int, default=100_000
        Rows of the test split (the paper's value).
    proportional : bool, default=False
        What to do when the file has fewer rows than the split needs: False raises a
        ValueError; True scales the three sizes down in the same proportions.
    max_rows : int or None, default=None
        Use only the first ``max_rows`` rows of the file.
    standardize : bool, default=False
        Return inputs and targets standardised with the training statistics.
    as_frame : bool, default=False
        Return the splits as pandas DataFrames and Series, indexed by row number.

    Returns
    -------
    data : :class:`~sklearn.utils.Bunch`
        ``X_train, y_train, X_val, y_val, X_test, y_test``, ``feature_names``,
        ``target_name`` (``"ArrDelay"``), the training statistics ``X_mean``,
        ``X_std``, ``y_mean``, ``y_std`` (stds including the epsilon ``1e-6``),
        ``standardized``, ``DESCR`` and ``filename``.

    See Also
    --------
    fetch_airline : Download the table first, from a URL you give.

    Examples
    --------
    >>> import os, tempfile
    >>> import pandas as pd
    >>> from sklearn_lla.datasets import load_airline
    >>> df = pd.DataFrame({"Month": [1] * 8, "DayofMonth": range(1, 9),
    ...                    "DayOfWeek": [3] * 8, "plane_age": [10.0] * 8,
    ...                    "AirTime": [60] * 8, "Distance": [400] * 8,
    ...                    "ArrTime": [1435] * 8, "DepTime": [905] * 8,
    ...                    "ArrDelay": [-3, 5, 0, 12, 7, -1, 4, 30]})
    >>> path = os.path.join(tempfile.mkdtemp(), "airline.csv")
    >>> df.to_csv(path, index=False)
    >>> data = load_airline(path, n_train=4, n_val=2, n_test=2)
    >>> data.X_train[0, 6:].tolist()  # ArrTime, DepTime in minutes after midnight
    [875.0, 545.0]
    >>> data.y_test.tolist()
    [4.0, 30.0]
    """
    path = check_path(path)
    fmt = _airline_format(path, format)
    max_rows = check_max_rows(max_rows)
    df, is_float, first_line = _read_airline(
        path, fmt, _rows_to_read(max_rows, proportional, n_train, n_val, n_test))
    if len(df) == 0:
        raise ValueError(f"{path}: no data rows")
    sizes = split_sizes(len(df), n_train, n_val, n_test, proportional=proportional,
                        test_reference=None, name=path)
    cols = [*AIRLINE_FEATURES, "ArrDelay"]
    arr = _as_float(df.iloc[: sum(sizes)], is_float, cols, path, first_line)
    X, y = arr[:, :-1], arr[:, -1]
    for col in ("ArrTime", "DepTime"):
        j = AIRLINE_FEATURES.index(col)
        X[:, j] = hhmm_to_minutes(X[:, j])
    n_tr, n_va, n_te = sizes
    return make_bunch(
        X, y, sizes, feature_names=AIRLINE_FEATURES, target_name="ArrDelay",
        descr=_AIRLINE_DESCR.format(n_train=n_tr, n_val=n_va, n_test=n_te, file=path),
        filename=path, standardize=standardize, as_frame=as_frame)


# --------------------------------------------------------------------------- Taxi
def _read_taxi_table(path, max_rows):
    pa = import_pyarrow("load_taxi")
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
        schema = pf.schema_arrow
    except (pa.ArrowException, OSError) as exc:
        raise ValueError(f"{path}: not a readable parquet file ({exc}); truncated or another "
                         "format?") from exc
    missing = [c for c in TAXI_COLUMNS if c not in schema.names]
    if missing:
        raise ValueError(f"{path}: missing column(s) {missing}; the file has columns "
                         f"{schema.names}")
    for c in TAXI_COLUMNS:
        t = schema.field(c).type
        if c.endswith("_datetime"):
            ok = pa.types.is_timestamp(t)
            expected = "a timestamp"
        else:
            ok = pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_decimal(t)
            expected = "numeric"
        if not ok:
            raise ValueError(f"{path}: column {c!r} has type {t}, expected {expected}")
    try:
        if max_rows is None:
            table = pf.read(columns=TAXI_COLUMNS)
        else:
            batches, n = [], 0
            for batch in pf.iter_batches(batch_size=min(max_rows, 65_536),
                                         columns=TAXI_COLUMNS):
                batches.append(batch)
                n += batch.num_rows
                if n >= max_rows:
                    break
            table = (pa.Table.from_batches(batches).slice(0, max_rows) if batches
                     else schema.empty_table().select(TAXI_COLUMNS))
    except (pa.ArrowException, OSError) as exc:
        raise ValueError(f"{path}: cannot read the parquet data ({exc}); a truncated "
                         "file?") from exc
    for c in TAXI_COLUMNS:
        nulls = table.column(c).null_count
        if nulls:
            first = int(np.flatnonzero(table.column(c).is_null().to_numpy(
                zero_copy_only=False))[0])
            raise ValueError(f"{path}: {nulls} missing value(s) in column {c!r} (first at "
                             f"data row {first})")
    if table.num_rows == 0:
        raise ValueError(f"{path}: no data rows")
    return table.to_pandas()


def _taxi_features(df):
    """``(X, y, keep)``: the papers' Taxi features and target from TLC columns.

    ``keep`` marks the trips with ``10 s <= duration <= 5 h``; ``X`` and ``y`` hold
    every row (filter them with ``keep``).
    """
    pick = df["tpep_pickup_datetime"]
    drop = df["tpep_dropoff_datetime"]
    duration = (drop - pick).dt.total_seconds().to_numpy(dtype=np.float64)
    X = np.column_stack([
        (pick.dt.hour * 3600 + pick.dt.minute * 60 + pick.dt.second).to_numpy(np.float64),
        pick.dt.day_of_week.to_numpy(np.float64),
        pick.dt.day.to_numpy(np.float64),
        pick.dt.month.to_numpy(np.float64),
        df["PULocationID"].to_numpy(np.float64),
        df["DOLocationID"].to_numpy(np.float64),
        df["trip_distance"].to_numpy(np.float64),
        duration,
    ])
    y = df["total_amount"].to_numpy(np.float64)
    keep = (duration >= 10.0) & (duration <= 5 * 3600.0)
    return X, y, keep


def load_taxi(path, *, train_fraction=0.8, val_fraction=0.1, max_rows=None,
              standardize=False, as_frame=False):
    """Load NYC yellow-taxi trips prepared as in the VaLLA / FMGP papers.

    Reads a TLC trip-record parquet file (the papers use
    ``yellow_tripdata_2023-01.parquet``) with its original columns
    ``tpep_pickup_datetime``, ``tpep_dropoff_datetime`` (timestamps),
    ``PULocationID``, ``DOLocationID``, ``trip_distance`` and ``total_amount``
    (others are ignored). Preparation: features time of day of the pickup (seconds
    after midnight), day of week (Monday = 0), day of month, month, PULocationID,
    DOLocationID, trip_distance and the trip duration in seconds; target
    ``total_amount``; trips kept when ``10 s <= duration <= 5 h``; the first
    ``int(train_fraction * n)`` kept trips train, the next ``int(val_fraction * n)``
    validation, the rest test, in file order. Needs pyarrow
    (``pip install 'sklearn-lla[data]'``).

    Parameters
    ----------
    path : str or os.PathLike
        The parquet file.
    train_fraction : float, default=0.8
        Fraction of the kept trips in the training split (the paper's value).
    val_fraction : float, default=0.1
        Fraction of the kept trips in the validation split (the paper's value).
    max_rows : int or None, default=None
        Read only the first ``max_rows`` rows of the file (before the filter).
    standardize : bool, default=False
        Return inputs and targets standardised with the training statistics.
    as_frame : bool, default=False
        Return the splits as pandas DataFrames and Series, indexed by row number in
        the file (so the filtered-out rows are gaps in the index).

    Returns
    -------
    data : :class:`~sklearn.utils.Bunch`
        ``X_train, y_train, X_val, y_val, X_test, y_test``, ``feature_names``,
        ``target_name`` (``"total_amount"``), the training statistics ``X_mean``,
        ``X_std``, ``y_mean``, ``y_std`` (stds including the epsilon ``1e-6``),
        ``standardized``, ``DESCR``, ``filename``, and ``n_rows_read`` /
        ``n_rows_dropped`` (rows read, rows removed by the duration filter).

    See Also
    --------
    fetch_taxi : Download the TLC file first (scikit-learn style).

    Examples
    --------
    >>> import os, tempfile
    >>> import pandas as pd
    >>> from sklearn_lla.datasets import load_taxi
    >>> pick = pd.to_datetime(["2023-01-02 08:00:00"] * 12)
    >>> secs = [600, 5, 900, 1200, 300, 60, 1800, 20000, 420, 480, 540, 660]
    >>> df = pd.DataFrame({"tpep_pickup_datetime": pick,
    ...                    "tpep_dropoff_datetime": pick + pd.to_timedelta(secs, unit="s"),
    ...                    "PULocationID": 161, "DOLocationID": 237,
    ...                    "trip_distance": 1.5, "total_amount": range(12)})
    >>> path = os.path.join(tempfile.mkdtemp(), "yellow_tripdata_2023-01.parquet")
    >>> df.to_parquet(path)
    >>> data = load_taxi(path)
    >>> data.n_rows_dropped  # 5 s and 20,000 s trips
    2
    >>> len(data.y_train), len(data.y_val), len(data.y_test)
    (8, 1, 1)
    """
    path = check_path(path)
    df = _read_taxi_table(path, check_max_rows(max_rows))
    X, y, keep = _taxi_features(df)
    rows = np.flatnonzero(keep)
    X, y = X[rows], y[rows]
    sizes = fraction_sizes(len(y), train_fraction, val_fraction, path)
    n_tr, n_va, n_te = sizes
    descr = _TAXI_DESCR.format(n_dropped=len(keep) - len(rows), n_read=len(keep),
                               n_train=n_tr, n_val=n_va, n_test=n_te, file=path)
    return make_bunch(X, y, sizes, feature_names=TAXI_FEATURES, target_name="total_amount",
                      descr=descr, filename=path, standardize=standardize,
                      as_frame=as_frame, row_index=rows, n_rows_read=len(keep),
                      n_rows_dropped=len(keep) - len(rows))

