"""Dask inputs: every registered estimator fitted on a dask array equals the numpy fit.

One ``distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True)``
serves the module (started by the ``client`` fixture on first use, closed at the end);
the first tests run before it, on dask's default (threaded) scheduler. Row-sum passes
run per partition on the workers and are added in float64 (equal to the in-memory
fit up to rounding: 1e-10); the minibatch methods draw the same batches from a dask
array as from numpy (same ``random_state``), so they are equal too. Prediction
returns lazy dask arrays. The last test kills a worker in the middle of a fit.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from sklearn.base import is_classifier
from sklearn.datasets import make_blobs
from torch import nn

da = pytest.importorskip("dask.array")
distributed = pytest.importorskip("distributed")

from sklearn_lla import (  # noqa: E402
    ELLAClassifier,
    ELLARegressor,
    LLARegressor,
    SampledLLARegressor,
)
from sklearn_lla._core import protocol as _protocol  # noqa: E402
from sklearn_lla._core.dask import PartitionError, block_seed, is_dask  # noqa: E402
from sklearn_lla._registry import ESTIMATORS  # noqa: E402

N, CHUNK = 90, 30  # three partitions
TOL = dict(rtol=1e-10, atol=1e-12)


def _mlp(n_in, n_out, seed, first=None):
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        layers = [nn.Linear(n_in, 12), nn.Tanh(), nn.Linear(12, n_out)]
        net = nn.Sequential(*([first] if first is not None else []), *layers).double()
    return net.eval()


def _reg():
    rng = np.random.RandomState(0)
    X = rng.uniform(-2, 2, (N + 20, 3))
    y = np.sin(X[:, 0]) + 0.5 * X[:, 1] + 0.1 * rng.randn(N + 20)
    return SimpleNamespace(X=X[:N], y=y[:N], X_test=X[N:], net=_mlp(3, 1, 0))


def _clf():
    X, y = make_blobs(n_samples=N + 20, centers=3, n_features=3, cluster_std=1.5,
                      random_state=0)
    return SimpleNamespace(X=X[:N], y=y[:N], X_test=X[N:], net=_mlp(3, 3, 1))


REG, CLF = _reg(), _clf()


def _case(entry):
    return CLF if entry.is_classifier else REG


def _outputs(est, X):
    if is_classifier(est):
        return (est.predict_proba(X),)
    return est.predict(X, return_std=True)


def _assert_close(ref, out, **tol):
    for r, o in zip(ref, out):
        assert isinstance(o, da.Array), "predict must return a lazy dask array"
        np.testing.assert_allclose(o.compute(), r, **(tol or TOL))


@pytest.fixture(scope="module")
def client():
    cluster = distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                                       dashboard_address=None)
    cl = distributed.Client(cluster)
    yield cl
    cl.close()
    cluster.close()


# ------------------------------------------------------------------ no cluster
def test_dask_is_imported_only_for_dask_input():
    code = ("import sys, numpy as np, torch\n"
            "from sklearn_lla import ELLARegressor\n"
            "from sklearn_lla._core.dask import is_dask\n"
            "X = np.random.RandomState(0).randn(40, 2); y = X[:, 0]\n"
            "net = torch.nn.Sequential(torch.nn.Linear(2, 4), torch.nn.Tanh(),"
            " torch.nn.Linear(4, 1)).double()\n"
            "ELLARegressor(net, n_nystrom=20).fit(X, y).predict(X, return_std=True)\n"
            "assert not is_dask(X) and 'dask' not in sys.modules, 'dask was imported'\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-2000:]


def test_threaded_scheduler_and_lazy_predict():
    """Without a client: dask's default scheduler; predict builds a graph only."""
    est = ELLARegressor(REG.net, n_nystrom=60, random_state=0).fit(
        da.from_array(REG.X, chunks=CHUNK), REG.y)
    ref = ELLARegressor(REG.net, n_nystrom=60, random_state=0).fit(REG.X, REG.y)
    Xt = da.from_array(REG.X_test, chunks=7)
    mean, std = est.predict(Xt, return_std=True)
    assert isinstance(mean, da.Array) and mean.chunks[0] == Xt.chunks[0]
    _assert_close(ref.predict(REG.X_test, return_std=True), (mean, std))
    _assert_close((ref.predict(REG.X_test),), (est.predict(Xt),))


def test_minibatches_same_on_numpy_and_dask(monkeypatch):
    """The grouped block shuffle (N above the cache) draws the same batches."""
    monkeypatch.setattr(_protocol, "MINIBATCH_CACHE_ROWS", 24)
    monkeypatch.setattr(_protocol, "MINIBATCH_BLOCK_ROWS", 8)
    lin = SimpleNamespace(dtype=torch.float64, device=torch.device("cpu"))
    X = np.arange(N * 2, dtype=float).reshape(N, 2)
    y = torch.arange(N, dtype=torch.float64)
    index = np.arange(3, N)  # a stream over a subset of the rows
    streams = [_protocol.FitData(lin, None, Xa, y, index=index).minibatches(
        5, torch.Generator().manual_seed(0)) for Xa in (X, da.from_array(X, chunks=CHUNK))]
    seen = []
    for _ in range(60):
        (xa, ya), (xb, yb) = next(streams[0]), next(streams[1])
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
        assert torch.equal(xa[:, 0] / 2, ya)  # x and y of the same rows
        seen.append(ya)
    assert len(torch.unique(torch.cat(seen))) > 0.8 * len(index)


# ----------------------------------------------------------------- on the cluster
@pytest.mark.parametrize("entry", ESTIMATORS, ids=[e.id for e in ESTIMATORS])
def test_registered_estimator_dask_fit_equals_numpy(entry, client):
    case = _case(entry)
    kw = dict(random_state=0, device="cpu")
    params = entry.make().get_params()
    if "max_iter" in params:  # minibatch methods: a short run suffices
        kw["max_iter"] = 20
    if "solver" in params:
        # sampled LLA: the minibatch solver; 20 conjugate-gradient iterations would stop
        # unconverged, where a sum in another order moves the result by about the
        # residual (test_sampled_conjugate_gradients_on_dask_equal_numpy below)
        kw["solver"] = "adam"
    ref = entry.make(case.net, **kw).fit(case.X, case.y)
    est = entry.make(case.net, **kw).fit(da.from_array(case.X, chunks=CHUNK), case.y)
    assert est.prior_variance_ == pytest.approx(ref.prior_variance_, rel=1e-10)
    Xt = da.from_array(case.X_test, chunks=8)
    _assert_close(_outputs(ref, case.X_test), _outputs(est, Xt))
    if is_classifier(est):
        labels = est.predict(Xt)
        assert isinstance(labels, da.Array)
        np.testing.assert_array_equal(labels.compute(), ref.predict(case.X_test))


def test_dataframe_from_parquet(client, tmp_path):
    pd = pytest.importorskip("pandas")
    dd = pytest.importorskip("dask.dataframe")
    pytest.importorskip("pyarrow")
    cols = ["pickup_lon", "pickup_lat", "hour"]
    df = pd.DataFrame(REG.X, columns=cols).assign(y=REG.y)
    dd.from_pandas(df, npartitions=3).to_parquet(tmp_path / "taxi")
    ddf = dd.read_parquet(tmp_path / "taxi")
    est = ELLARegressor(REG.net, n_nystrom=60, random_state=0).fit(ddf[cols], ddf["y"])
    ref = ELLARegressor(REG.net, n_nystrom=60, random_state=0).fit(df[cols], df["y"])
    assert list(est.feature_names_in_) == cols
    test = dd.from_pandas(pd.DataFrame(REG.X_test, columns=cols), npartitions=2)
    _assert_close(ref.predict(pd.DataFrame(REG.X_test, columns=cols), return_std=True),
                  est.predict(test, return_std=True))
    with pytest.raises(ValueError, match="feature"):
        est.predict(da.from_array(np.ones((4, 2)), chunks=2))


def test_sample_y_blockwise(client):
    est = LLARegressor(REG.net, random_state=0).fit(da.from_array(REG.X, chunks=CHUNK), REG.y)
    Xt = da.from_array(REG.X_test, chunks=12)
    draws = est.sample_y(Xt, n_samples=3, random_state=5)
    assert isinstance(draws, da.Array) and draws.shape == (len(REG.X_test), 3)
    ref = np.concatenate([est.sample_y(REG.X_test[a:a + 12], 3, random_state=block_seed(5, i))
                          for i, a in enumerate(range(0, len(REG.X_test), 12))])
    np.testing.assert_array_equal(draws.compute(), ref)
    with pytest.raises(ValueError, match="compute"):
        est.predict(Xt, return_cov=True)


def test_minibatch_method_grouped_stream_equal(client, monkeypatch):
    """Sampled LLA with N above the (shrunk) cache: same batches, same fit."""
    monkeypatch.setattr(_protocol, "MINIBATCH_CACHE_ROWS", 32)
    monkeypatch.setattr(_protocol, "MINIBATCH_BLOCK_ROWS", 8)
    entry = next(e for e in ESTIMATORS if e.cls.__name__ == "SampledLLARegressor")
    # minibatch Adam (9 batches is conjugate gradients' territory since CG_MAX_BATCHES = 32)
    kw = dict(random_state=0, device="cpu", batch_size=10, max_iter=30, solver="adam")
    ref = entry.make(REG.net, **kw).fit(REG.X, REG.y)
    est = entry.make(REG.net, **kw).fit(da.from_array(REG.X, chunks=CHUNK), REG.y)
    _assert_close(_outputs(ref, REG.X_test), _outputs(est, da.from_array(REG.X_test, 10)))


def test_error_in_a_partition_is_named(client):
    X = REG.X.copy()
    X[70, 1] = np.nan  # partition 2: rows 60..89
    with pytest.raises(PartitionError, match=r"partition 2 \(rows 60\.\.89\).*non-finite"):
        ELLARegressor(REG.net, n_nystrom=60, random_state=0).fit(
            da.from_array(X, chunks=CHUNK), REG.y)
    est = ELLARegressor(REG.net, n_nystrom=60, random_state=0).fit(REG.X, REG.y)
    lazy = est.predict(da.from_array(X, chunks=CHUNK), return_std=True)[1]
    with pytest.raises(PartitionError, match=r"partition 2 \(rows 60\.\.89\)"):
        lazy.compute()
    with pytest.raises(ValueError, match="pretrained"):
        ELLARegressor(None).fit(da.from_array(REG.X, chunks=CHUNK), REG.y)


def test_parallel_post_fit_and_dask_ml_pipeline(client):
    pytest.importorskip("dask_ml")
    from dask_ml.preprocessing import StandardScaler as DaskScaler
    from dask_ml.wrappers import ParallelPostFit
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    Xt = da.from_array(CLF.X_test, chunks=8)
    ref = ELLAClassifier(CLF.net, n_nystrom=60, random_state=0).fit(CLF.X, CLF.y)
    ppf = ParallelPostFit(ELLAClassifier(CLF.net, n_nystrom=60, random_state=0))
    ppf.fit(CLF.X, CLF.y)  # in memory; prediction block by block on the cluster
    _assert_close((ref.predict_proba(CLF.X_test),), (ppf.predict_proba(Xt),))
    pipe = make_pipeline(DaskScaler(), ELLAClassifier(CLF.net, n_nystrom=60, random_state=0))
    pipe.fit(da.from_array(CLF.X, chunks=CHUNK), CLF.y)
    ref = make_pipeline(StandardScaler(), ELLAClassifier(CLF.net, n_nystrom=60, random_state=0))
    ref.fit(CLF.X, CLF.y)
    _assert_close((ref.predict_proba(CLF.X_test),), (pipe.predict_proba(Xt),), rtol=1e-8)


class KillFirstWorker(nn.Module):
    """Identity, except that the first dask worker process to run it dies (SIGKILL).

    ``torch.where`` keeps the network off the structured backend (whose recorded
    chain would not call this forward again), so every Jacobian runs this code.
    """

    def __init__(self, marker):
        super().__init__()
        self.marker = marker

    def forward(self, x):
        x = torch.where(torch.isfinite(x), x, x)
        try:
            distributed.get_worker()
        except ValueError:  # not in a worker: the client process
            return x
        try:
            fd = os.open(self.marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return x
        os.close(fd)
        os.kill(os.getpid(), signal.SIGKILL)
        return x  # pragma: no cover


def test_worker_killed_mid_fit_gives_the_same_result(client, tmp_path):
    marker = str(tmp_path / "killed")
    net = _mlp(3, 1, 0, first=KillFirstWorker(marker))
    ref = ELLARegressor(net, n_nystrom=60, random_state=0).fit(REG.X, REG.y)
    est = ELLARegressor(net, n_nystrom=60, random_state=0).fit(
        da.from_array(REG.X, chunks=CHUNK), REG.y)
    assert os.path.exists(marker), "no worker was killed"
    _assert_close(ref.predict(REG.X_test, return_std=True),
                  est.predict(da.from_array(REG.X_test, chunks=8), return_std=True))
    assert is_dask(da.ones(2)) and not is_dask(REG.X)


_VALIDATED = [
    lambda **k: ELLARegressor(REG.net, n_nystrom=60, random_state=0, device="cpu", **k),
    lambda **k: LLARegressor(REG.net, space="parameter", random_state=0, device="cpu", **k),
    lambda **k: ELLAClassifier(CLF.net, n_nystrom=60, random_state=0, device="cpu", **k),
    lambda **k: SampledLLARegressor(REG.net, n_posterior_samples=8, max_iter=20,
                                    solver="adam", random_state=0, device="cpu", **k),
]
_VALIDATED_IDS = ["ella_reg", "lla_reg", "ella_clf", "sampled_reg"]


def _split_fit(make, client, **kw):
    case = CLF if is_classifier(make()) else REG
    rng = np.random.RandomState(1)
    idx = rng.permutation(N)
    tr, va = idx[:60], idx[60:]
    ref = make(**kw).fit(case.X[tr], case.y[tr], validation_data=(case.X[va], case.y[va]))
    with distributed.get_task_stream(client) as ts:
        est = make(**kw).fit(da.from_array(case.X[tr], chunks=CHUNK), case.y[tr],
                             validation_data=(da.from_array(case.X[va], chunks=10), case.y[va]))
    return case, ref, est, [str(t["key"]) for t in ts.data]


@pytest.mark.parametrize("make", _VALIDATED, ids=_VALIDATED_IDS)
def test_validation_nll_is_a_partition_reduce(make, client):
    """Dask validation_data with hyper_strategy="validation": the validation NLL grid
    (and, for regression, the noise scale) are summed per partition on the workers and
    equal the numpy selection."""
    case, ref, est, keys = _split_fit(make, client, hyper_strategy="validation")
    assert ref.hyper_strategy_ == "validation"
    assert est.prior_variance_ == pytest.approx(ref.prior_variance_, rel=1e-10)
    for key in ("score", "final_score"):
        if key in ref.hyper_trace_:
            np.testing.assert_allclose(est.hyper_trace_[key], ref.hyper_trace_[key], **TOL)
    n_part = sum("_partition_task" in k for k in keys)
    # two training partitions; three validation partitions per validation pass (noise
    # scale for regression, then the NLL grid)
    n_val_passes = 1 if is_classifier(est) else 2
    assert n_part >= 2 + 3 * n_val_passes, keys
    _assert_close(_outputs(ref, case.X_test), _outputs(est, da.from_array(case.X_test, 8)))


@pytest.mark.parametrize("make", _VALIDATED, ids=_VALIDATED_IDS)
def test_default_calibration_on_dask_validation_equals_numpy(make, client):
    """The default policy with dask validation_data: the prior from the method's
    objective, then the noise (regression) or temperature (classification) calibrated
    on the held-out rows, read per batch: the same as on numpy input."""
    case, ref, est, _ = _split_fit(make, client)
    assert ref.hyper_strategy_ != "validation" and ref.validation_source_ == "validation_data"
    assert est.prior_variance_ == pytest.approx(ref.prior_variance_, rel=1e-10)
    if is_classifier(ref):
        assert est.temperature_ == pytest.approx(ref.temperature_, rel=1e-8)
    else:
        assert est.noise_variance_ == pytest.approx(ref.noise_variance_, rel=1e-8)
    _assert_close(_outputs(ref, case.X_test), _outputs(est, da.from_array(case.X_test, 8)))


def test_sampled_conjugate_gradients_on_dask_equal_numpy(client):
    """Sampled LLA's default solver for small data (conjugate gradients, one partition
    reduce per iteration) run to convergence: dask and numpy inputs agree to the
    solver's tolerance (the sums run in another order, so not to rounding)."""
    kw = dict(n_posterior_samples=8, solver="cg", tol=1e-10, max_iter=2000, random_state=0,
              device="cpu")
    ref = SampledLLARegressor(REG.net, **kw).fit(REG.X, REG.y)
    est = SampledLLARegressor(REG.net, **kw).fit(da.from_array(REG.X, chunks=CHUNK), REG.y)
    assert est.prior_variance_ == pytest.approx(ref.prior_variance_, rel=1e-7)
    _assert_close(_outputs(ref, REG.X_test), _outputs(est, da.from_array(REG.X_test, 8)),
                  rtol=1e-7, atol=1e-10)
