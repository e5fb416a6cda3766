"""scikit-learn style ``fetch_*`` loaders: find the file under ``data_home``, download
it when missing (to a temporary name, then an atomic rename), then ``load_*`` it."""

from __future__ import annotations

import hashlib
import os
import tempfile
import urllib.parse
import urllib.request

from ._loaders import load_airline, load_taxi, load_year

__all__ = ["get_data_home", "fetch_year", "fetch_airline", "fetch_taxi", "YEAR_URL",
           "TAXI_URL"]

#: UCI's YearPredictionMSD archive.
YEAR_URL = ("https://archive.ics.uci.edu/ml/machine-learning-databases/00203/"
            "YearPredictionMSD.txt.zip")
#: NYC TLC yellow-taxi trip records of January 2023 (the papers' file).
TAXI_URL = "https://d37ci6vzurychx.cloudfront.net/trip-data/yellow_tripdata_2023-01.parquet"

#: Opens a URL; module-level so that tests can replace it (no internet in CI).
_urlopen = urllib.request.urlopen
_CHUNK = 1 << 20


def get_data_home(data_home=None):
    """Return the folder where the ``fetch_*`` loaders keep their files, creating it.

    Parameters
    ----------
    data_home : str or os.PathLike, default=None
        The folder to use. None uses scikit-learn's data folder
        (:func:`sklearn.datasets.get_data_home`: ``$SCIKIT_LEARN_DATA`` or
        ``~/scikit_learn_data``) with a ``sklearn_lla`` subfolder.

    Returns
    -------
    path : str
        The folder, which exists on return.

    Examples
    --------
    >>> import tempfile
    >>> from sklearn_lla.datasets import get_data_home
    >>> home = tempfile.mkdtemp()
    >>> get_data_home(home) == home
    True
    """
    if data_home is None:
        from sklearn.datasets import get_data_home as sk_data_home

        path = os.path.join(sk_data_home(), "sklearn_lla")
    else:
        path = os.path.expanduser(os.fspath(data_home))
    os.makedirs(path, exist_ok=True)
    return path


def _url_filename(url):
    name = os.path.basename(urllib.parse.urlparse(url).path)
    if not name:
        raise ValueError(f"cannot take a file name from the URL {url!r}; pass filename=")
    return name


def _download(url, dest, sha256=None, timeout=60):
    """Download ``url`` to ``dest`` through a temporary file in the same folder."""
    folder = os.path.dirname(os.path.abspath(dest))
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=os.path.basename(dest) + ".", suffix=".part")
    digest = hashlib.sha256()
    try:
        with os.fdopen(fd, "wb") as out:
            try:
                resp = _urlopen(url, timeout=timeout)
            except (OSError, ValueError) as exc:
                raise OSError(f"cannot download {url}: {exc}") from exc
            with resp:
                while chunk := resp.read(_CHUNK):
                    digest.update(chunk)
                    out.write(chunk)
        if os.path.getsize(tmp) == 0:
            raise OSError(f"downloading {url} gave an empty file")
        if sha256 is not None and digest.hexdigest() != sha256.lower():
            raise OSError(f"the file downloaded from {url} has sha256 {digest.hexdigest()}, "
                          f"expected {sha256}; it was not kept")
        os.replace(tmp, dest)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    return dest


def _fetch_file(data_home, filename, url, download_if_missing, sha256):
    path = os.path.join(get_data_home(data_home), filename)
    if os.path.exists(path):
        return path
    if not download_if_missing:
        raise OSError(f"Data not found at {path} and download_if_missing is False")
    if url is None:
        raise OSError(f"Data not found at {path} and no url= to download it from")
    return _download(url, path, sha256)


def fetch_year(data_home=None, *, download_if_missing=True, url=YEAR_URL, sha256=None,
               **kwargs):
    """Load YearPredictionMSD from ``data_home``, downloading UCI's zip if missing.

    The archive ``YearPredictionMSD.txt.zip`` (about 200 MB) is kept as downloaded
    and read from the zip by :func:`load_year`.

    Parameters
    ----------
    data_home : str or os.PathLike, default=None
        Folder of the data files; None is :func:`get_data_home`'s default.
    download_if_missing : bool, default=True
        Download the file when it is not in ``data_home``; False raises an OSError
        instead.
    url : str, default=YEAR_URL
        Where to download from (UCI's archive). The local file name is the last part
        of the URL's path.
    sha256 : str or None, default=None
        Expected SHA-256 hex digest of the download; a mismatch raises an OSError
        and keeps nothing.
    **kwargs : dict
        Passed to :func:`load_year` (split sizes, ``standardize``, ``as_frame``, ...).

    Returns
    -------
    data : :class:`~sklearn.utils.Bunch`
        As returned by :func:`load_year`.

    See Also
    --------
    load_year : Load a local file.

    Examples
    --------
    Any URL that urllib opens works, a local ``file://`` one included:

    >>> import os, pathlib, tempfile
    >>> import numpy as np
    >>> from sklearn_lla.datasets import fetch_year
    >>> src = os.path.join(tempfile.mkdtemp(), "YearPredictionMSD.txt")
    >>> np.savetxt(src, np.column_stack([np.arange(1990, 2000), np.ones((10, 90))]),
    ...            delimiter=",", fmt="%g")
    >>> data = fetch_year(tempfile.mkdtemp(), url=pathlib.Path(src).as_uri(),
    ...                   n_train=6, n_val=2)
    >>> data.X_train.shape
    (6, 90)
    """
    path = _fetch_file(data_home, _url_filename(url), url, download_if_missing, sha256)
    return load_year(path, **kwargs)


def fetch_airline(data_home=None, *, url=None, filename=None, download_if_missing=True,
                  sha256=None, **kwargs):
    """Load the Airline delay table from ``data_home``, downloading it from ``url``.

    The papers' 800,000-row table (Hensman et al. 2013; Dutordoir et al. 2020) has no
    single canonical public URL, so none is built in: give the ``url`` of a copy you
    trust (a CSV with a header row, or a pickled DataFrame), or put the file in
    ``data_home`` yourself as ``airline.pickle`` (or pass its ``filename``).

    Parameters
    ----------
    data_home : str or os.PathLike, default=None
        Folder of the data files; None is :func:`get_data_home`'s default.
    url : str or None, default=None
        Where to download the table from when it is missing.
    filename : str or None, default=None
        Name of the file in ``data_home``; None takes the last part of ``url``'s
        path, or ``"airline.pickle"`` without a ``url``.
    download_if_missing : bool, default=True
        Download the file when it is not in ``data_home``; False raises an OSError
        instead.
    sha256 : str or None, default=None
        Expected SHA-256 hex digest of the download; a mismatch raises an OSError.
    **kwargs : dict
        Passed to :func:`load_airline`.

    Returns
    -------
    data : :class:`~sklearn.utils.Bunch`
        As returned by :func:`load_airline`.

    See Also
    --------
    load_airline : Load a local file.

    Examples
    --------
    >>> import os, tempfile
    >>> import pandas as pd
    >>> from sklearn_lla.datasets import fetch_airline
    >>> home = tempfile.mkdtemp()
    >>> cols = ["Month", "DayofMonth", "DayOfWeek", "plane_age", "AirTime",
    ...         "Distance", "ArrTime", "DepTime", "ArrDelay"]
    >>> pd.DataFrame([[1] * 9] * 5, columns=cols).to_pickle(
    ...     os.path.join(home, "airline.pickle"))
    >>> data = fetch_airline(home, n_train=3, n_val=1, n_test=1)
    >>> data.X_train.shape
    (3, 8)
    """
    if filename is None:
        filename = "airline.pickle" if url is None else _url_filename(url)
    path = os.path.join(get_data_home(data_home), filename)
    if url is None and not os.path.exists(path):
        raise OSError(
            f"no airline table at {path} and no url= given: the papers' 800k-row table has "
            "no canonical public URL; pass fetch_airline(url=...) with a copy you trust, or "
            "put the file (CSV with a header, or a pickled DataFrame) at that path")
    path = _fetch_file(data_home, filename, url, download_if_missing, sha256)
    return load_airline(path, **kwargs)


def fetch_taxi(data_home=None, *, download_if_missing=True, url=TAXI_URL, sha256=None,
               **kwargs):
    """Load the NYC taxi trips of January 2023 from ``data_home``, downloading if missing.

    The TLC file ``yellow_tripdata_2023-01.parquet`` is about 50 MB; reading it needs
    pyarrow (``pip install 'sklearn-lla[data]'``).

    Parameters
    ----------
    data_home : str or os.PathLike, default=None
        Folder of the data files; None is :func:`get_data_home`'s default.
    download_if_missing : bool, default=True
        Download the file when it is not in ``data_home``; False raises an OSError
        instead.
    url : str, default=TAXI_URL
        Where to download from (the TLC's public trip-record file). The local file
        name is the last part of the URL's path.
    sha256 : str or None, default=None
        Expected SHA-256 hex digest of the download; a mismatch raises an OSError.
    **kwargs : dict
        Passed to :func:`load_taxi`.

    Returns
    -------
    data : :class:`~sklearn.utils.Bunch`
        As returned by :func:`load_taxi`.

    See Also
    --------
    load_taxi : Load a local file.

    Examples
    --------
    >>> import tempfile
    >>> from sklearn_lla.datasets import fetch_taxi
    >>> try:
    ...     fetch_taxi(tempfile.mkdtemp(), download_if_missing=False)
    ... except OSError as exc:
    ...     print("not downloaded")
    not downloaded
    """
    path = _fetch_file(data_home, _url_filename(url), url, download_if_missing, sha256)
    return load_taxi(path, **kwargs)
