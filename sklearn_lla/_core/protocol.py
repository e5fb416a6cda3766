"""The posterior contract every method implements.

A method is one :class:`Posterior` subclass plus two thin estimators. The estimator
(see :mod:`sklearn_lla._base`) validates input, resolves the network into a
:class:`~sklearn_lla._network.linearized.LinearizedNet`, picks the likelihood, and hands the
posterior a :class:`FitData`; everything the user sees (``predict``,
``return_std``, ``return_cov``, ``predict_proba``, ``sample_y``, scorers) is built
from the :class:`LatentPredictive` that :meth:`Posterior.predict` returns.

::

    FitData          the batched training stream (+ optional validation stream)
    Posterior.fit(data) -> self
    Posterior.predict(x) -> LatentPredictive(mean (B, C), cov (B, C, C))
    Posterior.predict_joint(x) -> (mean (B, C), cov (B*C, B*C))   [optional]
    Posterior.fitted_attributes   names of the state ``fit`` sets
"""

from __future__ import annotations

import abc
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from .utils import cast_rows

__all__ = ["FitData", "LatentPredictive", "Posterior", "holdout_rows",
           "to_batch", "check_finite_outputs", "validation_residuals"]

#: Rows a minibatch stream (:meth:`FitData.minibatches`) keeps in memory. Up to this
#: many training rows, every epoch is one global permutation; beyond, the rows are
#: cut into blocks of :data:`MINIBATCH_BLOCK_ROWS` consecutive rows and each epoch
#: visits groups of blocks (in a random order) read into memory together, shuffled
#: within the group: per-step cost and memory stay independent of N, and a memmap or
#: a dask input is read in large sequential pieces.
MINIBATCH_CACHE_ROWS = 1 << 18
#: Consecutive rows per block of the grouped minibatch stream.
MINIBATCH_BLOCK_ROWS = 1 << 15


def holdout_rows(n: int, fraction: float, generator: torch.Generator):
    """Split ``range(n)`` into sorted (train, validation) rows, ``fraction`` held out.

    At least one row lands on each side; the permutation comes from ``generator``.
    """
    n_val = min(max(1, int(round(fraction * n))), n - 1)
    perm = torch.randperm(n, generator=generator).numpy()
    return np.sort(perm[n_val:]), np.sort(perm[:n_val])


def check_finite_outputs(g: torch.Tensor, where: str) -> None:
    """Raise a clear error when the network's outputs ``g`` on ``where`` are not finite."""
    if not bool(torch.isfinite(g).all()):
        raise ValueError(
            f"the network produced non-finite outputs (NaN or inf) on {where}; check the "
            "inputs' scale and the network's weights"
        )


def validation_residuals(lin, batches):
    """Row sums ``(sum (y - g)^2, number of scalars)`` of the network on ``batches``.

    A row-sum pass for :meth:`FitData.reduce` (per partition on dask input).
    """
    sq, n = 0.0, 0
    for x, y in batches:
        g = lin.forward(x).to(torch.float64)
        check_finite_outputs(g, "validation rows")
        sq += float(((y - g) ** 2).sum())
        n += y.numel()
    return sq, n


def to_batch(X, sl, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Rows ``sl`` (a slice or an index array) of array-like ``X`` as a fresh tensor.

    Reads only those rows (memmaps and other array-likes are never loaded whole) and
    always copies, so read-only input never backs a tensor.
    """
    arr = cast_rows(X[sl], dtype)
    np_dtype = arr.dtype
    if not np.isfinite(arr).all():
        what = (f"rows {sl.start}..{sl.stop - 1}" if isinstance(sl, slice) else "some rows")
        raise ValueError(
            f"{what} of X are not finite in the network's dtype {np_dtype} (values beyond "
            f"{np.finfo(np_dtype).max:.3g} overflow it); rescale the inputs"
        )
    return torch.from_numpy(arr).to(device)


class FitData:
    """The training stream a posterior fits on.

    Parameters
    ----------
    lin : LinearizedNet
        The frozen network.
    likelihood : Likelihood
        The likelihood (its hyperparameters may still be chosen by the posterior).
    X : array-like of shape (n_samples, n_features)
        Validated inputs (numpy array, memmap or dask array with known row chunks;
        float32 stays float32). Read per batch (a dask array: per partition).
    y : Tensor
        Regression targets (n_samples, C) float64, or class indices (n_samples,) int64.
    batch_size : int
        Rows per batch.
    generator : torch.Generator
        Random source seeded from ``random_state`` (CPU).
    validation : FitData or None
        Held-out data the network did not fit, if any.
    verbose : int
        ``>= 1`` for progress bars.
    index : array of int or None
        Rows of ``X`` (and ``y``) that make up this stream; ``None`` means all. Lets
        a hold-out split share ``X`` without copying it.

    Attributes
    ----------
    n_samples : int
    n_outputs : int
    device : torch.device
    dtype : torch.dtype
        The network's dtype (inputs are cast to it per batch).
    """

    def __init__(self, lin, likelihood, X, y, *, batch_size=256, generator=None,
                 validation=None, verbose=0, index=None):
        self.lin = lin
        self.likelihood = likelihood
        self.X = X
        self.y = y
        self.batch_size = int(batch_size)
        self.generator = generator if generator is not None else torch.Generator()
        self.validation = validation
        self.verbose = int(verbose)
        self.index = None if index is None else np.asarray(index, dtype=np.int64)

    @property
    def n_samples(self) -> int:
        return int(self.X.shape[0] if self.index is None else len(self.index))

    @property
    def n_outputs(self) -> int:
        return int(self.likelihood.n_outputs)

    @property
    def is_dask(self) -> bool:
        """Whether ``X`` is a dask array (read per partition, sums run on workers)."""
        from .dask import is_dask

        return is_dask(self.X)

    @property
    def device(self) -> torch.device:
        return self.lin.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lin.dtype

    def rows(self, idx) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and targets of rows ``idx`` (slice or index array) of this stream."""
        if self.index is not None:
            idx = self.index[idx]
        if self.is_dask:  # one compute reading only the partitions holding the rows
            from .dask import read_rows

            if isinstance(idx, slice):
                return read_rows(self.X, np.arange(self.X.shape[0])[idx], self.dtype,
                                 self.device), self.y[idx]
            idx = np.asarray(idx)
            order = np.argsort(idx, kind="stable")
            x = read_rows(self.X, idx[order], self.dtype, self.device)
            inv = torch.from_numpy(np.argsort(order, kind="stable")).to(self.device)
            return x[inv], self.y[torch.from_numpy(idx).to(self.y.device)]
        if not isinstance(idx, slice):
            idx = np.asarray(idx)
            order = np.argsort(idx, kind="stable")
            x = to_batch(self.X, idx[order], self.dtype, self.device)
            inv = torch.from_numpy(np.argsort(order, kind="stable")).to(self.device)
            x = x[inv]
            return x, self.y[torch.from_numpy(idx).to(self.y.device)]
        return to_batch(self.X, idx, self.dtype, self.device), self.y[idx]

    def batches(self, batch_size: int | None = None, order=None) -> Iterator:
        """Yield ``(x, y)`` batches, in row order or in the order of index array ``order``."""
        bs = int(batch_size or self.batch_size)
        if order is None and self.is_dask:
            from .dask import stream_batches

            yield from stream_batches(self, bs)
            return
        n = self.n_samples
        for start in range(0, n, bs):
            stop = min(start + bs, n)
            yield self.rows(slice(start, stop) if order is None else order[start:stop])

    def reduce(self, fn, payload, batch_size: int | None = None, desc: str | None = None):
        """Run a row-sum pass ``fn(payload, batches)`` over the stream.

        ``fn`` is a module-level function returning a tuple whose entries (float64
        tensors, floats, ints) add over disjoint sets of rows. In memory it runs
        once on :meth:`batches`; on a dask ``X`` once per partition on the workers
        (:func:`sklearn_lla._core.dask.partition_reduce`), the partial results added in
        float64 on the client.

        Parameters
        ----------
        fn : callable
            ``fn(payload, batches) -> tuple``.
        payload : object
            Everything ``fn`` needs besides the batches (sent to each worker once).
        batch_size : int, optional
            Rows per batch (default ``self.batch_size``).
        desc : str, optional
            Label of the progress bar (in memory, when ``verbose``).

        Returns
        -------
        tuple
        """
        bs = int(batch_size or self.batch_size)
        if self.is_dask:
            from .dask import partition_reduce

            return partition_reduce(self, fn, payload, bs)
        bar = self.progress(self.n_samples, desc) if desc else None
        batches = self.batches(bs)
        if bar is not None:
            batches = _counting(batches, bar)
        try:
            return fn(payload, batches)
        finally:
            if bar is not None:
                bar.close()

    def minibatches(self, batch_size: int, generator: torch.Generator, *,
                    with_index: bool = False) -> Iterator:
        """Endless shuffled minibatches ``(x, y)`` of ``batch_size`` rows.

        Up to :data:`MINIBATCH_CACHE_ROWS` rows each epoch is a fresh permutation of
        all rows drawn from ``generator`` (a dask ``X`` is read into memory once).
        Beyond, each epoch draws a random order of the blocks of
        :data:`MINIBATCH_BLOCK_ROWS` consecutive rows, reads them a group of
        ``MINIBATCH_CACHE_ROWS // MINIBATCH_BLOCK_ROWS`` blocks at a time and
        yields batches of a permutation of the group's rows (a last partial batch of
        a group is dropped). The draws depend only on ``generator``, ``N`` and
        ``batch_size``: numpy and dask inputs give the same batches.
        ``with_index=True`` yields ``(x, y, idx)``: the same batches with the
        positions of their rows in this stream (an int64 ndarray), for callers that
        cache per-row quantities.
        """
        n = self.n_samples
        bs = min(int(batch_size), n)
        cache = max(MINIBATCH_CACHE_ROWS, bs)
        if n <= cache:
            src = self
            if self.is_dask:  # all rows fit in the cache: read them once
                x_all, y_all = self.rows(np.arange(n))
            while True:
                perm = torch.randperm(n, generator=generator).numpy()
                for start in range(0, n - bs + 1, bs):
                    sel = perm[start:start + bs]
                    if src.is_dask:
                        t = torch.from_numpy(sel).to(x_all.device)
                        batch = x_all[t], y_all[t.to(y_all.device)]
                    else:
                        batch = src.rows(sel)
                    yield (*batch, sel) if with_index else batch
        block = max(1, min(MINIBATCH_BLOCK_ROWS, cache))
        n_blocks = -(-n // block)
        per_group = max(1, cache // block)
        while True:
            order = torch.randperm(n_blocks, generator=generator).numpy()
            for g in range(0, n_blocks, per_group):
                rows = np.concatenate([np.arange(b * block, min((b + 1) * block, n))
                                       for b in order[g:g + per_group]])
                xg, yg = self.rows(rows)
                perm = torch.randperm(len(rows), generator=generator)
                for start in range(0, len(rows) - bs + 1, bs):
                    sel = perm[start:start + bs]
                    batch = xg[sel.to(xg.device)], yg[sel.to(yg.device)]
                    yield (*batch, rows[sel.numpy()]) if with_index else batch

    def progress(self, total: int, desc: str):
        """A tqdm bar when ``verbose`` (else ``None``)."""
        if not self.verbose:
            return None
        from tqdm.auto import tqdm

        return tqdm(total=total, desc=desc, leave=False)


def _counting(batches, bar):
    for x, y in batches:
        yield x, y
        bar.update(x.shape[0])


@dataclass
class LatentPredictive:
    """Gaussian latent predictive ``f(x) ~ N(mean, cov)`` at a batch of points.

    Attributes
    ----------
    mean : Tensor of shape (B, C)
        The network's outputs (float64).
    cov : Tensor of shape (B, C, C)
        Per-point latent covariance blocks (float64, symmetric PSD).
    """

    mean: torch.Tensor
    cov: torch.Tensor

    @property
    def var(self) -> torch.Tensor:
        """Latent variances ``diag(cov)`` of shape (B, C), clipped at zero."""
        return torch.diagonal(self.cov, dim1=-2, dim2=-1).clamp_min(0.0)

    def sample(self, n: int, generator: torch.Generator | None = None) -> torch.Tensor:
        """``n`` draws per point (independent across points), shape (n, B, C)."""
        from .likelihoods import latent_draws

        eps = torch.randn((n, *self.mean.shape), dtype=self.mean.dtype, generator=generator)
        return latent_draws(self.mean, self.cov, eps.to(self.mean.device))


class Posterior(abc.ABC):
    """Base class of a method's posterior (pure torch, float64 algebra).

    Subclasses implement :meth:`fit` and :meth:`predict`, list the state ``fit`` sets
    in ``fitted_attributes``, and may implement :meth:`predict_joint` (joint
    covariance over query points, for ``return_cov`` and ``sample_y``). After ``fit``
    every posterior exposes ``prior_variance`` (float), ``likelihood`` (with fitted
    hyperparameters), ``hyper_strategy`` (name) and ``hyper_trace`` (dict).
    """

    #: Names of the fitted state set by :meth:`fit`.
    fitted_attributes: tuple[str, ...] = ()

    @abc.abstractmethod
    def fit(self, data: FitData) -> Posterior:  # pragma: no cover - interface
        """Fit on the training stream ``data``; returns ``self``."""

    @abc.abstractmethod
    def predict(self, x: torch.Tensor) -> LatentPredictive:  # pragma: no cover
        """Latent predictive at a batch of inputs ``x`` (network dtype, device)."""

    def predict_joint(self, x: torch.Tensor):
        """Mean (B, C) and joint latent covariance (B*C, B*C) at ``x``."""
        raise ValueError(
            f"{type(self).__name__} does not provide joint covariances over query points "
            "(return_cov, sample_y)")

    #: Regression: whether the posterior at ``(c s0^2, c s2)`` is exactly ``c`` times
    #: the one at ``(s0^2, s2)`` (a linear-Gaussian posterior). Held-out rows then fit
    #: that scale in closed form (:func:`~sklearn_lla._core.calibration.calibrate_scale`,
    #: applied by :meth:`rescale`); otherwise the noise variance alone, the latent
    #: covariance kept.
    rescalable: bool = False

    #: Regression: whether the posterior can be refitted for a candidate noise variance
    #: (:meth:`held_out_pairs`, :meth:`refit_noise`). Under a fixed prior variance
    #: held-out rows then choose the noise variance alone, the posterior refitted.
    refits_noise: bool = False

    #: Regression: whether the latent predictive stays the same when the noise variance
    #: alone is calibrated (:meth:`predict` does not read it), so that the held-out
    #: rows' latent predictive read by that calibration is reused for the conformal
    #: scores; otherwise they are predicted again after it.
    latent_keeps_noise: bool = True

    #: At most this many torch intra-op threads while :meth:`calibrate` runs (its
    #: many held-out NLL evaluations are small tensor operations); 0: unchanged.
    calibration_threads: int = 0

    #: Whether the prior variance was ``"auto"`` (set by :meth:`fit` of a posterior that
    #: :attr:`refits_noise`).
    auto_prior: bool = True

    def rescale(self, c: float) -> None:
        """Move to ``(c s0^2, c s2)`` (a :attr:`rescalable` posterior)."""
        raise NotImplementedError(f"{type(self).__name__} is not rescalable")

    def held_out_pairs(self, validation: FitData):
        """``(score, base_noise)``: held-out NLL per ``(s0^2, s2)`` pair and the network's
        mean squared held-out residual (a posterior that :attr:`refits_noise`)."""
        raise NotImplementedError(f"{type(self).__name__} does not refit its noise")

    def refit_noise(self, noise_variance: float) -> None:
        """Refit at the noise variance ``noise_variance`` (the prior kept)."""
        raise NotImplementedError(f"{type(self).__name__} does not refit its noise")

    def calibrate(self, validation: FitData, *, noise: bool, temperature: bool,
                  generator: torch.Generator | None = None):
        """Calibrate one scalar on held-out rows, keeping the latent covariance's shape.

        Regression (when ``noise``): a :attr:`rescalable` posterior's scale ``c`` of
        ``(s0^2, s2)`` (closed form), or, under a fixed prior variance, for a posterior
        that :attr:`refits_noise`, the noise variance with the posterior refitted;
        otherwise the noise variance alone. Classification (when ``temperature``): a
        temperature of the latent predictive, and a scale of its covariance where the
        temperature cannot bring the held-out NLL near the network's own. See
        :mod:`sklearn_lla._core.calibration`. ``self.likelihood`` is replaced and
        ``self.hyper_trace["calibration"]`` records the search.

        Parameters
        ----------
        validation : FitData
            Rows the network did not fit.
        noise, temperature : bool
            Which scalar may be calibrated (only ``"auto"`` ones are).
        generator : torch.Generator, optional
            Random source of a row subset and of Monte Carlo draws.

        Returns
        -------
        HeldOutLatent or None
            The latent predictive of the calibrated posterior on the held-out rows
            the calibration read (all of them, or a random subset of
            :data:`~sklearn_lla._core.calibration.CALIBRATION_ROWS`), for the
            split-conformal scores to reuse; ``None`` when no latent predictive was
            formed (nothing calibrated, or the noise refitted from held-out scores).
        """
        from .utils import torch_threads

        with torch_threads(self.calibration_threads):
            return self._calibrate(validation, noise, temperature, generator)

    def _calibrate(self, validation, noise, temperature, generator):
        """:meth:`calibrate` itself (under its thread limit)."""
        from . import calibration as cal
        from .likelihoods import uses_mc_link

        lik = self.likelihood
        regression = lik.task == "regression"
        if not (noise if regression else temperature):
            return None
        latent = None
        if regression and self.refits_noise and not self.auto_prior:
            score, base_noise = self.held_out_pairs(validation)
            s2, trace = cal.calibrate_noise_refit(score, self.prior_variance, base_noise)
            self.refit_noise(s2)
        elif regression and self.rescalable:
            mean, cov, y, rows = cal.held_out_predictive(self, validation, max_rows=None,
                                                         return_rows=True)
            c, trace = cal.calibrate_scale(mean, cov, y, self.prior_variance,
                                           lik.noise_variance)
            self.rescale(c)
            # the posterior at (c s0^2, c s2) is c times the one the rows were read at
            latent = cal.HeldOutLatent(rows, mean, cov.mul_(c))
        elif regression:
            mean, cov, y, rows = cal.held_out_predictive(self, validation, generator=generator,
                                                         max_rows=cal.CALIBRATION_ROWS,
                                                         return_rows=True)
            s2, trace = cal.calibrate_noise(mean, cov, y)
            self.likelihood = lik.with_noise(s2)
            if hasattr(self, "noise_variance"):
                self.noise_variance = s2
            if self.latent_keeps_noise:
                latent = cal.HeldOutLatent(rows, mean, cov)
        else:
            mean, cov, y, rows = cal.held_out_predictive(self, validation, generator=generator,
                                                         max_rows=cal.CALIBRATION_ROWS,
                                                         return_rows=True)
            eps = None
            if uses_mc_link(lik):
                gen = generator if generator is not None else torch.Generator().manual_seed(0)
                eps = torch.randn((lik.n_samples, *mean.shape), dtype=mean.dtype, generator=gen)
            T, c, trace = cal.calibrate_classification(lik, mean, cov, y, eps=eps)
            self.likelihood = lik.with_temperature(T).with_covariance_scale(c)
            # the likelihood applies both: the latent the rows were read at is unchanged
            latent = cal.HeldOutLatent(rows, mean, cov)
        self.hyper_trace = {**(self.hyper_trace or {}), "calibration": trace}
        return latent
