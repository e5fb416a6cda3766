"""Exact linearized Laplace approximation: the reference every approximation is tested against.

The GGN posterior precision ``H = sum_n J_n^T Lam_n J_n + I / s0^2`` is formed
explicitly in float64, either

* in **parameter space** (``P x P``; cost ``N C P^2 + P^3``), predictive
  ``S(x) = J(x) H^-1 J(x)^T``, or
* in **function space** (``NC x NC``; cost ``(NC)^2 P + (NC)^3``), with
  ``Lam = A A^T`` (see :mod:`sklearn_lla._likelihoods`) and Woodbury,
  ``S(x) = s0^2 k(x,x) - s0^4 k(x,X) A (I + s0^2 A^T K A)^-1 A^T k(X,x)``,
  which needs no inverse of ``Lam`` (singular for softmax).

``space="auto"`` takes whichever of ``P`` and ``NC`` is smaller. Hyperparameters
(``"auto"``) maximise the Laplace log marginal likelihood, which for the linearised
model is

``log Z = log p(y | theta_hat) - ||theta_hat||^2 / (2 s0^2) - 1/2 sum_i log(1 + s0^2 e_i)``

where ``e_i`` are the eigenvalues of the GGN ``sum_n J_n^T Lam_n J_n`` (those of the
function-space matrix ``A^T K A`` are the same non-zero ones). For regression ``Lam =
I / s2`` so ``e_i = e_i^(1) / s2`` with ``e_i^(1)`` the eigenvalues of ``J^T J``, and
``log p(y | theta_hat)`` is the Gaussian log likelihood of the residuals; this is the
closed-form marginal likelihood of the linearised model around the MAP. One
eigendecomposition serves every candidate ``(s0^2, s2)``.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from scipy.optimize import minimize

from ._base import NET_PARAM_DOC, LaplaceClassifierMixin, LaplaceRegressorMixin
from ._likelihoods import CategoricalLikelihood, GaussianLikelihood
from ._utils import iter_batches, safe_cholesky

try:
    from tqdm.auto import tqdm
except ImportError:  # pragma: no cover
    tqdm = None

__all__ = ["LLAPosterior", "LLARegressor", "LLAClassifier", "log_marginal_likelihood"]

#: Largest ``min(P, N*C)`` the exact estimators accept (a dense float64 matrix that
#: size takes 3.2 GB; its decomposition dominates the run time).
MAX_EXACT_DIM = 20_000

_LOG_BOUNDS = (math.log(1e-12), math.log(1e12))


def log_marginal_likelihood(prior_variance, noise_variance, *, eigvals, theta_sq_norm,
                            rss=None, n_obs=None, log_lik=None):
    """Laplace log marginal likelihood of the linearised model (see module docstring).

    Parameters
    ----------
    prior_variance : float
        ``s0^2``.
    noise_variance : float or None
        ``s2`` for regression (``eigvals`` are then those of ``J^T J``); ``None`` for
        classification (``eigvals`` are those of the GGN and ``log_lik`` is given).
    eigvals : ndarray
        Eigenvalues of the unit-noise GGN (regression) or the GGN (classification).
    theta_sq_norm : float
        ``||theta_hat||^2``.
    rss, n_obs : float, int
        Residual sum of squares and number of scalar observations (regression).
    log_lik : float
        ``log p(y | theta_hat)`` (classification).
    """
    e = np.clip(np.asarray(eigvals, dtype=np.float64), 0.0, None)
    if noise_variance is None:
        data = log_lik
        scaled = prior_variance * e
    else:
        data = -0.5 * n_obs * math.log(2 * math.pi * noise_variance) - 0.5 * rss / noise_variance
        scaled = prior_variance * e / noise_variance
    return data - 0.5 * theta_sq_norm / prior_variance - 0.5 * np.log1p(scaled).sum()


def _optimise_evidence(eigvals, theta_sq_norm, n_params, prior_variance, noise_variance,
                       rss=None, n_obs=None, log_lik=None):
    """Maximise the log marginal likelihood over the ``"auto"`` hyperparameters.

    Works on log variances with analytic gradients (L-BFGS-B). Returns
    ``(prior_variance, noise_variance)``.
    """
    e = np.clip(np.asarray(eigvals, dtype=np.float64), 0.0, None)
    regression = noise_variance is not None
    fit_prior = prior_variance == "auto"
    fit_noise = regression and noise_variance == "auto"
    s0 = theta_sq_norm / max(n_params, 1) if fit_prior else prior_variance
    s0 = max(s0, 1e-8)
    s2 = (max(rss / n_obs, 1e-10) if fit_noise else noise_variance) if regression else None
    if not (fit_prior or fit_noise):
        return s0, s2

    def unpack(u):
        i = 0
        a, b = s0, s2
        if fit_prior:
            a = math.exp(u[i])
            i += 1
        if fit_noise:
            b = math.exp(u[i])
        return a, b

    def negobj(u):
        a, b = unpack(u)
        r = a * e / b if regression else a * e
        frac = r / (1.0 + r)
        val = log_marginal_likelihood(a, b, eigvals=e, theta_sq_norm=theta_sq_norm, rss=rss,
                                      n_obs=n_obs, log_lik=log_lik)
        grad = []
        if fit_prior:
            grad.append(0.5 * theta_sq_norm / a - 0.5 * frac.sum())
        if fit_noise:
            grad.append(-0.5 * n_obs + 0.5 * rss / b + 0.5 * frac.sum())
        return -val, -np.asarray(grad)

    u0 = ([math.log(s0)] if fit_prior else []) + ([math.log(s2)] if fit_noise else [])
    res = minimize(negobj, np.asarray(u0), jac=True, method="L-BFGS-B",
                   bounds=[_LOG_BOUNDS] * len(u0))
    return unpack(res.x)


def _choose_space(space, n_params, n_rows):
    if space not in ("auto", "parameter", "function"):
        raise ValueError(f"space must be 'auto', 'parameter' or 'function', got {space!r}")
    if space == "auto":
        space = "parameter" if n_params <= n_rows else "function"
    dim = n_params if space == "parameter" else n_rows
    if dim > MAX_EXACT_DIM:
        raise ValueError(
            f"exact LLA in {space} space needs a dense {dim} x {dim} matrix (P={n_params}, "
            f"N*C={n_rows}); the limit is {MAX_EXACT_DIM}. Use ELLARegressor/ELLAClassifier "
            "(or another scalable method) for problems this large."
        )
    return space


class LLAPosterior:
    """Exact GGN linearized Laplace posterior (pure torch).

    Parameters
    ----------
    likelihood : GaussianLikelihood or CategoricalLikelihood
        For regression the noise variance may still be ``"auto"`` when passed as
        ``noise_variance``; the likelihood object is then created after the evidence
        optimisation.
    prior_variance : float or "auto"
    noise_variance : float, "auto" or None
        ``None`` for classification.
    space : {"auto", "parameter", "function"}

    Attributes
    ----------
    prior_variance, noise_variance : float
        The values in use (after ``"auto"`` selection).
    space : str
        The space actually used.
    log_marginal_likelihood : float
        The evidence at the selected hyperparameters.
    """

    def __init__(self, prior_variance="auto", noise_variance=None, space="auto", verbose=0):
        self.prior_variance = prior_variance
        self.noise_variance = noise_variance
        self.space = space
        self.verbose = verbose

    # ----------------------------------------------------------------- fitting
    def fit(self, lin, X, y, n_outputs):
        regression = self.noise_variance is not None
        N, C, P = X.shape[0], n_outputs, lin.n_params
        self.space = _choose_space(self.space, P, N * C)
        theta = lin.flat_params().double()
        theta_sq = float(theta @ theta)
        f = torch.cat([lin.forward(X[sl]) for sl in iter_batches(N, 4096)]).double()
        if regression:
            # Unit-noise factor: Lam = I / s2 is applied after the evidence step.
            A = torch.eye(C, dtype=torch.float64, device=f.device).expand(N, C, C)
            rss = float(((y - f) ** 2).sum())
            log_lik = None
        else:
            A = CategoricalLikelihood().lam_factor(f)
            rss = None
            log_lik = float(CategoricalLikelihood().log_likelihood(f, y))
        self._A = A
        if self.space == "parameter":
            G = torch.zeros((P, P), dtype=torch.float64, device=f.device)
            chunks = lin.jacobian_chunks(X, C)
            if self.verbose and tqdm is not None:
                chunks = tqdm(chunks, total=-(-N // lin.chunk_size(C)), leave=False,
                              desc="LLA: accumulating the GGN")
            for sl, J in chunks:
                Phi = torch.einsum("bck,bcp->bkp", A[sl], J.double()).reshape(-1, P)
                G.addmm_(Phi.T, Phi)
            eig = torch.linalg.eigvalsh(G)
            self._G = G
        else:
            K = lin.kernel(X, n_outputs=C)
            W = _sandwich(A, K)
            eig = torch.linalg.eigvalsh(W)
            self._W = W
            self._X = X
        s0, s2 = _optimise_evidence(
            eig.cpu().numpy(), theta_sq, P, self.prior_variance,
            self.noise_variance if regression else None, rss=rss, n_obs=N * C,
            log_lik=log_lik,
        )
        self.prior_variance = float(s0)
        self.noise_variance = float(s2) if regression else None
        self.likelihood = GaussianLikelihood(s2) if regression else CategoricalLikelihood()
        self.log_marginal_likelihood = float(log_marginal_likelihood(
            s0, s2 if regression else None, eigvals=eig.cpu().numpy(), theta_sq_norm=theta_sq,
            rss=rss, n_obs=N * C, log_lik=log_lik))
        noise = s2 if regression else 1.0
        if self.space == "parameter":
            H = self._G / noise + torch.eye(P, dtype=torch.float64, device=f.device) / s0
            self._L = safe_cholesky(H, "posterior precision")
            del self._G
        else:
            B = torch.eye(N * C, dtype=torch.float64, device=f.device) + (s0 / noise) * self._W
            self._L = safe_cholesky(B, "function-space system matrix")
            self._A = A / math.sqrt(noise)
            del self._W
        self.n_outputs = C
        return self

    # -------------------------------------------------------------- prediction
    def predict(self, lin, x, full_cov: bool = False):
        """Network outputs (B, C) and latent covariance (B, C, C) or (B*C, B*C)."""
        mean = lin.forward(x).double()
        B, C = mean.shape
        if self.space == "parameter":
            J = lin.jacobian(x).double().reshape(B * C, -1)
            Z = torch.linalg.solve_triangular(self._L, J.T, upper=False)  # (P, BC)
            cov = Z.T @ Z
        else:
            s0 = self.prior_variance
            kxx = lin.kernel(x, n_outputs=C)
            kXx = lin.kernel(self._X, x, n_outputs=C)  # (NC, BC)
            N = self._X.shape[0]
            AtK = torch.einsum("nck,ncm->nkm", self._A, kXx.reshape(N, C, -1)).reshape(N * C, -1)
            Z = torch.linalg.solve_triangular(self._L, AtK, upper=False)
            cov = s0 * kxx - (s0 * s0) * (Z.T @ Z)
        cov = 0.5 * (cov + cov.T)
        if full_cov:
            return mean, cov
        idx = torch.arange(B, device=cov.device)
        blocks = cov.reshape(B, C, B, C)[idx, :, idx, :]
        return mean, blocks


def _sandwich(A, K):
    """``blockdiag(A)^T K blockdiag(A)`` for per-point factors ``A`` (N, C, C)."""
    N, C, _ = A.shape
    K4 = K.reshape(N, C, N, C)
    left = torch.einsum("nck,ncmd->nkmd", A, K4)
    out = torch.einsum("nkmd,mdl->nkml", left, A)
    return out.reshape(N * C, N * C)


_COMMON_DOC = NET_PARAM_DOC + """
    prior_variance : float or "auto", default="auto"
        ``s0^2`` of the isotropic Gaussian prior. ``"auto"`` maximises the Laplace log
        marginal likelihood.
    space : {"auto", "parameter", "function"}, default="auto"
        Where to form the dense posterior: ``P x P`` (parameter) or ``NC x NC``
        (function). ``"auto"`` takes the smaller.
    device : "auto", "cpu", "cuda" or torch.device, default="auto"
    batch_size : int, default=256
        Points per batch at prediction time.
    random_state : int, RandomState instance or None, default=None
        Seeds training of a default / unfitted net (and ``mc`` sampling).
    verbose : int, default=0
        ``>= 1`` shows a progress bar while the parameter-space GGN is accumulated.
"""


class LLARegressor(LaplaceRegressorMixin):
    __doc__ = (
        """Exact linearized Laplace regression (GGN, float64 dense algebra).

    The reference implementation for small problems (``min(P, N*n_targets)`` up to
    20,000): every approximate method is tested against it.

    Parameters
    ----------""" + _COMMON_DOC + """    noise_variance : float or "auto", default="auto"
        ``s2`` of the Gaussian likelihood. ``"auto"`` maximises the same closed-form
        marginal likelihood jointly with ``prior_variance`` (starting from the mean
        squared training residual); a single variance is shared by all targets.

    Attributes
    ----------
    prior_variance_, noise_variance_ : float
        Values in use.
    log_marginal_likelihood_ : float
    space_ : str
    net_ : object
        The pretrained or trained network.
    posterior_ : LLAPosterior
    n_features_in_ : int

    Examples
    --------
    >>> import numpy as np
    >>> from sklearn_lla import LLARegressor
    >>> rng = np.random.RandomState(0)
    >>> X = rng.uniform(-2, 2, (60, 1)); y = np.sin(2 * X[:, 0]) + 0.1 * rng.randn(60)
    >>> reg = LLARegressor(random_state=0).fit(X, y)
    >>> mean, std = reg.predict(X[:3], return_std=True)
    >>> mean.shape, std.shape
    ((3,), (3,))
    """
    )

    def __init__(self, net=None, *, prior_variance="auto", noise_variance="auto", space="auto",
                 device="auto", batch_size=256, random_state=None, verbose=0):
        self.net = net
        self.prior_variance = prior_variance
        self.noise_variance = noise_variance
        self.space = space
        self.device = device
        self.batch_size = batch_size
        self.random_state = random_state
        self.verbose = verbose

    def _fit_posterior(self, data):
        post = LLAPosterior(self.prior_variance, self.noise_variance, self.space, self.verbose)
        post.fit(data.lin, data.X, data.y, data.n_outputs)
        self.log_marginal_likelihood_ = post.log_marginal_likelihood
        self.space_ = post.space
        return post


class LLAClassifier(LaplaceClassifierMixin):
    __doc__ = (
        """Exact linearized Laplace classification (GGN, float64 dense algebra).

    Parameters
    ----------""" + _COMMON_DOC + """    link_approx : {"probit", "mc", "bridge"}, default="probit"
        Approximation of ``E softmax(f)`` under the Gaussian latent.
    n_samples_predict : int, default=512
        Samples for ``link_approx="mc"``.

    Attributes
    ----------
    classes_ : ndarray
    prior_variance_ : float
    log_marginal_likelihood_ : float
    space_ : str
    net_ : object
    posterior_ : LLAPosterior
    n_features_in_ : int
    """
    )

    def __init__(self, net=None, *, prior_variance="auto", space="auto", link_approx="probit",
                 n_samples_predict=512, device="auto", batch_size=256, random_state=None,
                 verbose=0):
        self.net = net
        self.prior_variance = prior_variance
        self.space = space
        self.link_approx = link_approx
        self.n_samples_predict = n_samples_predict
        self.device = device
        self.batch_size = batch_size
        self.random_state = random_state
        self.verbose = verbose

    def _fit_posterior(self, data):
        post = LLAPosterior(self.prior_variance, None, self.space, self.verbose)
        post.fit(data.lin, data.X, data.y, data.n_outputs)
        self.log_marginal_likelihood_ = post.log_marginal_likelihood
        self.space_ = post.space
        return post
