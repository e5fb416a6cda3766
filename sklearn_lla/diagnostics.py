"""Diagnostics that compare Laplace approximations by their predictive distributions.

* :func:`latent_predictive`: the latent Gaussian ``N(g(X), S(X))`` of a fitted
  estimator, per point or jointly;
* :func:`predictive_kl`: KL divergence between two predictive distributions
  (regression: Gaussians of ``y``; classification: the product over points of the
  link-approximated categorical distributions, the paper's "block-diagonal"
  approximation);
* :func:`trace_criterion`: ``Tr S(X)``, the epistemic trace criterion of Faller &
  Martin (the larger, the more of the dominant eigenspace a subspace captures;
  ``Tr S_P(X) <= Tr S(X)`` for every subspace).
"""

from __future__ import annotations

import numpy as np
import torch

from ._core.likelihoods import Bernoulli, Categorical
from ._core.protocol import to_batch

__all__ = ["latent_predictive", "predictive_kl", "trace_criterion"]


def latent_predictive(estimator, X, joint=False):
    """Return the latent predictive mean and covariance of a fitted estimator at ``X``.

    Parameters
    ----------
    estimator : fitted sklearn_lla estimator
        Any estimator of the package.
    X : array-like of shape (n_samples, n_features)
        Query points.
    joint : bool, default=False
        Return the joint covariance over all points and outputs (``n * C`` square,
        rows ordered ``point * C + output``) instead of the per-point blocks.

    Returns
    -------
    mean : ndarray of shape (n_samples, n_outputs)
        The network's outputs.
    cov : ndarray of shape (n_samples, n_outputs, n_outputs) or (n * C, n * C)
        The latent covariance (epistemic part only), float64.

    Examples
    --------
    >>> import numpy as np
    >>> from sklearn_lla import LLARegressor
    >>> from sklearn_lla.diagnostics import latent_predictive
    >>> rng = np.random.RandomState(0)
    >>> X = rng.uniform(-2, 2, (40, 1))
    >>> y = np.sin(2 * X[:, 0]) + 0.1 * rng.randn(40)
    >>> reg = LLARegressor(random_state=0).fit(X, y)
    >>> mean, cov = latent_predictive(reg, X[:4])
    >>> mean.shape, cov.shape
    ((4, 1), (4, 1, 1))
    """
    X = estimator._check_X(X)
    if joint:
        mean, cov = estimator._predict_joint(X)
        return mean.numpy(), cov.numpy()
    n, C = len(X), estimator.n_outputs_
    mean, cov = np.empty((n, C)), np.empty((n, C, C))
    for sl, lp in estimator._predictive_batches(X):
        mean[sl], cov[sl] = lp.mean.numpy(), lp.cov.numpy()
    return mean, cov


def _as_blocks(mean, cov):
    """Per-point (n, C, C) blocks from variances, blocks or a joint covariance."""
    n, C = mean.shape
    if cov.shape == mean.shape:
        return np.einsum("nc,cd->ncd", cov, np.eye(C))
    if cov.ndim == 3 and cov.shape == (n, C, C):
        return cov
    if cov.ndim == 2 and cov.shape == (n * C, n * C):
        idx = np.arange(n)
        return cov.reshape(n, C, n, C)[idx, :, idx, :]
    raise ValueError(f"cov of shape {cov.shape} does not match mean of shape {(n, C)}: expected "
                     f"variances {(n, C)}, blocks {(n, C, C)} or a joint {(n * C, n * C)}")


def _gauss_kl(m0, S0, m1, S1):
    """``KL(N(m0, S0) || N(m1, S1))`` for (batches of) full covariances."""
    L0 = np.linalg.cholesky(S0)
    L1 = np.linalg.cholesky(S1)
    k = S0.shape[-1]
    A = np.linalg.solve(L1, L0)
    d = np.linalg.solve(L1, (m1 - m0)[..., None])[..., 0]
    logdet0 = 2 * np.log(np.diagonal(L0, axis1=-2, axis2=-1)).sum(-1)
    logdet1 = 2 * np.log(np.diagonal(L1, axis1=-2, axis2=-1)).sum(-1)
    return 0.5 * ((A ** 2).sum((-2, -1)) + (d ** 2).sum(-1) - k + logdet1 - logdet0)


def predictive_kl(mean_p, cov_p, mean_q, cov_q, *, likelihood="regression",
                  noise_variance=0.0, link_approx="probit", reduction="sum"):
    """Compute the KL divergence ``KL(p || q)`` between two predictive distributions.

    Regression: ``p = N(mean_p, cov_p + s2 I)`` and ``q = N(mean_q, cov_q + s2 I)``
    over ``y``, joint over all points when joint covariances are given, otherwise a
    sum of per-point terms. Classification: the paper's block-diagonal approximation,
    ``sum_i KL(Cat(pi_p(x_i)) || Cat(pi_q(x_i)))`` with the class probabilities of
    each point's latent block by ``link_approx`` (a one-output latent is a
    Bernoulli logit).

    Parameters
    ----------
    mean_p : array-like of shape (n,) or (n, C)
        Latent means of ``p`` (e.g. exact LLA).
    cov_p : array-like
        Latent covariance of ``p``: variances (the shape of ``mean_p``), per-point
        blocks (n, C, C) or a joint covariance (n * C, n * C).
    mean_q : array-like of shape (n,) or (n, C)
        Latent means of ``q`` (e.g. a subspace model).
    cov_q : array-like
        Latent covariance of ``q``, as ``cov_p``.
    likelihood : {"regression", "classification"}, default="regression"
        The task.
    noise_variance : float, default=0.0
        ``s2`` added to both covariances (regression). With ``0`` a singular
        ``cov_q`` (a subspace model of rank below ``n * C``) gives an error: pass
        the fitted noise variance, as the paper does.
    link_approx : {"probit", "bridge"}, default="probit"
        Link approximation of the class probabilities (classification).
    reduction : {"sum", "mean"}, default="sum"
        The divergence of the whole distribution, or per point.

    Returns
    -------
    kl : float
        ``KL(p || q) >= 0``.

    Examples
    --------
    >>> import numpy as np
    >>> from sklearn_lla.diagnostics import predictive_kl
    >>> mean = np.zeros(3)
    >>> float(predictive_kl(mean, np.ones(3), mean, np.ones(3)))
    0.0
    >>> round(float(predictive_kl(mean, 2 * np.eye(3), mean, np.eye(3))), 4)
    0.4603
    >>> logits = np.array([[2.0, 0.0, -1.0]])
    >>> kl = predictive_kl(logits, np.eye(3)[None], logits, np.zeros((1, 3, 3)),
    ...                    likelihood="classification")
    >>> bool(kl > 0)
    True
    """
    if likelihood not in ("regression", "classification"):
        raise ValueError(f"likelihood must be 'regression' or 'classification', "
                         f"got {likelihood!r}")
    if reduction not in ("sum", "mean"):
        raise ValueError(f"reduction must be 'sum' or 'mean', got {reduction!r}")
    mp, mq = np.asarray(mean_p, dtype=np.float64), np.asarray(mean_q, dtype=np.float64)
    if mp.shape != mq.shape:
        raise ValueError(f"mean_p {mp.shape} and mean_q {mq.shape} differ in shape")
    cp, cq = np.asarray(cov_p, dtype=np.float64), np.asarray(cov_q, dtype=np.float64)
    one_d = mp.ndim == 1
    mp2, mq2 = mp.reshape(len(mp), -1), mq.reshape(len(mq), -1)
    if one_d:  # (n,) variances stay variances of (n, 1)
        cp = cp.reshape(-1, 1) if cp.shape == mp.shape else cp
        cq = cq.reshape(-1, 1) if cq.shape == mq.shape else cq
    n, C = mp2.shape
    if likelihood == "classification":
        bp, bq = _as_blocks(mp2, cp), _as_blocks(mq2, cq)
        lik = Bernoulli(link_approx) if C == 1 else Categorical(C, link_approx)
        pp = lik.predict(torch.as_tensor(mp2), torch.as_tensor(bp)).numpy()
        pq = lik.predict(torch.as_tensor(mq2), torch.as_tensor(bq)).numpy()
        tiny = np.finfo(np.float64).tiny
        kl = float((pp * (np.log(np.maximum(pp, tiny)) - np.log(np.maximum(pq, tiny)))).sum())
    else:
        joint = (cp.ndim == 2 and cp.shape == (n * C, n * C) and cq.shape == cp.shape
                 and cp.shape != mp2.shape)
        s2 = float(noise_variance)
        try:
            if joint:
                eye = np.eye(n * C)
                kl = float(_gauss_kl(mp2.reshape(-1), cp + s2 * eye, mq2.reshape(-1),
                                     cq + s2 * eye))
            else:
                eye = np.eye(C)
                kl = float(_gauss_kl(mp2, _as_blocks(mp2, cp) + s2 * eye, mq2,
                                     _as_blocks(mq2, cq) + s2 * eye).sum())
        except np.linalg.LinAlgError as exc:
            raise ValueError("a predictive covariance is singular: pass noise_variance > 0 "
                             "(the fitted noise variance of the regression)") from exc
    kl = max(kl, 0.0)
    return kl / n if reduction == "mean" else kl


def trace_criterion(estimator_or_posterior, X, batch_size=256):
    """Compute the trace criterion ``Tr S(X)`` of a fitted model's latent covariance.

    The sum over the points of ``X`` of the trace of their latent (epistemic)
    covariance blocks, which equals the trace of the joint covariance. For subspace
    Laplace ``Tr S_P(X) <= Tr S(X)`` (exact LLA) and a larger trace means that more
    of the dominant eigenspace is captured (Faller & Martin, eq. 20).

    Parameters
    ----------
    estimator_or_posterior : fitted estimator or Posterior
        A fitted estimator of the package, or a fitted posterior (``.predict(x)``
        returning a :class:`~sklearn_lla._core.protocol.LatentPredictive`).
    X : array-like of shape (n_samples, n_features)
        Query points.
    batch_size : int, default=256
        Rows per batch when ``estimator_or_posterior`` is a posterior.

    Returns
    -------
    trace : float
        ``Tr S(X)``.

    Examples
    --------
    >>> import numpy as np
    >>> from sklearn_lla import LLARegressor
    >>> from sklearn_lla.diagnostics import trace_criterion
    >>> rng = np.random.RandomState(0)
    >>> X = rng.uniform(-2, 2, (40, 1))
    >>> y = np.sin(2 * X[:, 0]) + 0.1 * rng.randn(40)
    >>> reg = LLARegressor(random_state=0).fit(X, y)
    >>> bool(trace_criterion(reg, X[:5]) > 0)
    True
    """
    obj = estimator_or_posterior
    if hasattr(obj, "_predictive_batches"):
        total = 0.0
        for _, lp in obj._predictive_batches(obj._check_X(X)):
            total += float(torch.diagonal(lp.cov, dim1=-2, dim2=-1).sum())
        return total
    if not hasattr(obj, "predict"):
        raise TypeError("expected a fitted sklearn_lla estimator or posterior, got "
                        f"{type(obj).__name__}")
    lin = getattr(getattr(obj, "features", None), "lin", None) or getattr(obj, "lin", None)
    dtype = lin.dtype if lin is not None else torch.float64
    device = lin.device if lin is not None else torch.device("cpu")
    X = np.asarray(X)
    total = 0.0
    for start in range(0, len(X), batch_size):
        x = to_batch(X, slice(start, min(start + batch_size, len(X))), dtype, device)
        total += float(torch.diagonal(obj.predict(x).cov, dim1=-2, dim2=-1).sum())
    return total
