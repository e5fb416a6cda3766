"""ELLA: Nystrom-accelerated linearized Laplace (Deng, Zhou & Zhu, NeurIPS 2022).

The NTK is approximated by ``k(x, x') ~ phi(x) phi(x')^T`` with ``K`` Nystrom
features ``phi(x) = J(x) V`` (C x K), and LLA becomes Bayesian linear regression on
them:

1. draw ``M`` pairs ``(x_m, i_m)`` (training point, output index) uniformly without
   replacement from the ``N * C`` pairs (all of them when ``M >= N * C``);
2. ``Kt = Jt Jt^T`` (M x M) in float64, ``Jt`` the rows ``grad g_{i_m}(x_m)``; its
   top-``K`` eigenpairs ``(lam_k, u_k)`` by ``eigh`` with escalating jitter;
3. ``v_k = Jt^T u_k / sqrt(lam_k)`` by vector-Jacobian products (memory O(P K));
4. ``phi(x) = J(x) V`` and ``g(x)`` from one forward pass with ``K`` tangents;
5. ``G = sum_n phi_n^T Lam_n phi_n + I / s0^2`` streamed over the training data;
   ``S(x) = phi(x) G^-1 phi(x)^T``.

For networks that are chains of ``nn.Linear`` layers and elementwise maps, steps 2
and 3 use the structured NTK (:mod:`sklearn_lla._structured`): no Jacobian row is
formed and the Gram costs about as much as a forward pass over the M points.

Options beyond the paper: early stopping of the streaming pass on validation NLL
(the paper's remedy for LLA's over-concentration at large N), validation-NLL grids
for ``prior_variance="auto"`` / ``noise_variance="auto"``, and a residual correction
that adds back the prior variance outside ``span(V)``.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import torch

from ._base import NET_PARAM_DOC, LaplaceClassifierMixin, LaplaceRegressorMixin
from ._likelihoods import CategoricalLikelihood, predictive_proba
from ._utils import check_positive_int, iter_batches

__all__ = ["ELLAPosterior", "ELLARegressor", "ELLAClassifier", "nystrom_basis"]

try:
    from tqdm.auto import tqdm
except ImportError:  # pragma: no cover
    tqdm = None


def _topk_eigh(Kt: torch.Tensor, k: int):
    """Top-``k`` eigenpairs of a PSD Gram matrix in float64, with escalating jitter.

    Jitter starts at 1e-10 x mean diagonal and grows x10 until the factorisation
    succeeds and the kept eigenvalues are positive. Components whose eigenvalue is
    below the numerical noise floor are dropped with a warning.
    """
    Kt = 0.5 * (Kt + Kt.T).double()
    M = Kt.shape[0]
    scale = float(torch.diagonal(Kt).mean().clamp_min(1e-300))
    eye = torch.eye(M, dtype=Kt.dtype, device=Kt.device)
    jitter = 0.0
    for attempt in range(12):
        try:
            lam, U = torch.linalg.eigh(Kt + jitter * scale * eye)
            if torch.isfinite(lam).all():
                break
        except RuntimeError:  # eigh failed to converge
            pass
        jitter = 1e-10 if jitter == 0.0 else jitter * 10
    else:  # pragma: no cover - pathological input
        raise np.linalg.LinAlgError("eigendecomposition of the Nystrom Gram matrix failed")
    lam, U = lam.flip(0), U.flip(1)
    lam = lam - jitter * scale
    tol = float(lam[0]) * M * torch.finfo(torch.float64).eps * 10
    keep = int((lam[:k] > max(tol, 0.0)).sum())
    if keep < k:
        warnings.warn(
            f"the Nystrom Gram matrix has only {keep} numerically positive eigenvalues; "
            f"using n_components={keep} instead of {k}",
            RuntimeWarning,
            stacklevel=3,
        )
    if keep == 0:
        raise ValueError("the Nystrom Gram matrix is zero: the network's Jacobian vanishes")
    return lam[:keep], U[:, :keep]


def nystrom_basis(lin, X: torch.Tensor, n_outputs: int, n_nystrom: int, n_components: int,
                  generator: torch.Generator, chunk: int = 4096, pairs=None):
    """Draw the Nystrom pairs and build the parameter-space basis ``V``.

    ``pairs=(point_idx, output_idx)`` uses the given pairs instead of drawing them
    (to reproduce another implementation's basis in tests).

    Returns
    -------
    V : dict of str to Tensor of shape (K, *param_shape)
        ``v_k = Jt^T u_k / sqrt(lam_k)``, orthonormal in parameter space.
    lam : Tensor of shape (K,)
        The top eigenvalues of ``Kt``.
    pairs : tuple of LongTensor
        Point indices and output indices of the M pairs.
    """
    N, C = X.shape[0], n_outputs
    n_pairs = N * C
    if pairs is not None:
        idx, out = (torch.as_tensor(p, dtype=torch.long, device=X.device) for p in pairs)
    else:
        if n_nystrom >= n_pairs:
            flat = torch.arange(n_pairs, device=X.device)
        else:
            flat = torch.randperm(n_pairs, generator=generator, device=generator.device)
            flat = flat[:n_nystrom].to(X.device)
        idx, out = flat // C, flat % C
    Xm = X[idx]
    Kt = lin.kernel(Xm, n_outputs=C, out1=out)
    lam, U = _topk_eigh(Kt, n_components)
    Us = (U / lam.sqrt()).to(lin.dtype)
    V = None
    for sl in iter_batches(len(idx), chunk):
        part = lin.gradient_rows_vjp(Xm[sl], out[sl], Us[sl])
        V = part if V is None else {k: V[k] + part[k] for k in V}
    return V, lam, (idx, out)


class ELLAPosterior:
    """ELLA posterior: Nystrom features and the K x K precision ``G`` (pure torch).

    Parameters
    ----------
    n_nystrom, n_components : int
        ``M`` and ``K``.
    prior_variance, noise_variance : float or "auto"
        ``noise_variance=None`` for classification.
    early_stopping : bool
        Stop the streaming pass when validation NLL stops improving.
    search_freq : int
        Points between validation evaluations.
    n_iter_no_change : int
        Evaluations without improvement before stopping.
    residual : bool
        Add ``s0^2 (k(x,x) - phi(x) phi(x)^T)`` at prediction.
    batch_size : int
    verbose : int
    prior_grid, noise_grid : ndarray
        Multipliers of the base scales searched for ``"auto"`` hyperparameters.

    Attributes
    ----------
    V : dict of str to Tensor
        Basis directions in parameter space, (K, *param_shape) each.
    G_lik : Tensor (K, K)
        ``sum_n phi_n^T Lam_n phi_n`` over the points used (regression: with
        ``Lam = I``; the noise variance divides it).
    n_seen : int
        Training points in ``G_lik`` (fewer than N after early stopping).
    history : list of (n_seen, best validation NLL at that point)
    """

    def __init__(self, n_nystrom=2000, n_components=20, prior_variance="auto",
                 noise_variance=None, early_stopping=False, search_freq=1000,
                 n_iter_no_change=5, residual=False, batch_size=256, verbose=0,
                 prior_grid=None, noise_grid=None):
        self.n_nystrom = n_nystrom
        self.n_components = n_components
        self.prior_variance = prior_variance
        self.noise_variance = noise_variance
        self.early_stopping = early_stopping
        self.search_freq = search_freq
        self.n_iter_no_change = n_iter_no_change
        self.residual = residual
        self.batch_size = batch_size
        self.verbose = verbose
        self.prior_grid = np.logspace(-4, 4, 33) if prior_grid is None else prior_grid
        self.noise_grid = np.logspace(-2, 1, 13) if noise_grid is None else noise_grid

    @property
    def regression(self):
        return self.noise_variance is not None

    # ------------------------------------------------------------------ pieces
    def features(self, lin, x):
        """``g(x)`` (B, C) and ``phi(x)`` (B, C, K), from one batched forward pass."""
        g, phi = lin.jvp(x, self.V)
        return g.double(), phi.double()

    def _lik_gram(self, g, phi):
        if self.regression:
            return torch.einsum("bck,bcl->kl", phi, phi)
        A = CategoricalLikelihood().lam_factor(g)  # Lam = A A^T
        Phi = torch.einsum("bck,bcl->bkl", A, phi)  # A^T phi
        return torch.einsum("bck,bcl->kl", Phi, Phi)

    def _latent_var(self, phi, G_lik, n_ratio, s0, s2):
        """Per-point latent covariance (B, C, C) for given hyperparameters."""
        K = G_lik.shape[0]
        scale = 1.0 / s2 if self.regression else 1.0
        G = G_lik * scale + (n_ratio / s0) * torch.eye(K, dtype=G_lik.dtype, device=G_lik.device)
        L = torch.linalg.cholesky(G)
        B, C, _ = phi.shape
        Z = torch.linalg.solve_triangular(L, phi.reshape(B * C, K).T, upper=False)
        Z = Z.T.reshape(B, C, K)
        return Z @ Z.transpose(1, 2)

    def _val_scores(self, G_lik, n_ratio, s0_grid, s2_grid):
        """Validation NLL for every (s0, s2) on the grids, via one eigendecomposition."""
        e, Q = torch.linalg.eigh(0.5 * (G_lik + G_lik.T))
        e = e.clamp_min(0)
        PQ = torch.einsum("bck,kl->bcl", self._phi_val, Q)  # (B, C, K)
        g, y = self._g_val, self._y_val
        scores = np.full((len(s0_grid), len(s2_grid)), np.inf)
        for i, s0 in enumerate(s0_grid):
            for j, s2 in enumerate(s2_grid):
                scale = 1.0 / s2 if self.regression else 1.0
                d = 1.0 / (e * scale + n_ratio / s0)
                if self.regression:
                    var = (PQ.pow(2) * d).sum(-1) + s2  # (B, C)
                    if self._res_val is not None:
                        var = var + s0 * torch.diagonal(self._res_val, dim1=1, dim2=2)
                    nll = 0.5 * (torch.log(2 * math.pi * var) + (y - g) ** 2 / var)
                    scores[i, j] = float(nll.sum(-1).mean())
                else:
                    cov = torch.einsum("bck,k,bdk->bcd", PQ, d, PQ)
                    if self._res_val is not None:
                        cov = cov + s0 * self._res_val
                    p = predictive_proba(g, cov, "probit")
                    lp = torch.log(p.gather(1, y.view(-1, 1)).clamp_min(1e-300))
                    scores[i, j] = float(-lp.mean())
        scores[~np.isfinite(scores)] = np.inf
        return scores

    # ----------------------------------------------------------------- fitting
    def fit(self, lin, X, y, n_outputs, generator, X_val=None, y_val=None, pairs=None):
        """Build the basis, then stream the training data to accumulate ``G``.

        Parameters
        ----------
        lin : LinearizedNet
        X, y : Tensor
            Training data (regression targets (N, C) float64; class indices (N,)).
        n_outputs : int
        generator : torch.Generator
        X_val, y_val : Tensor, optional
            Validation data (required for early stopping / ``"auto"``).
        pairs : tuple of index tensors, optional
            Fixed Nystrom pairs (see :func:`nystrom_basis`).
        """
        C = n_outputs
        N = X.shape[0]
        self.V, self.lam, self.pairs = nystrom_basis(
            lin, X, C, self.n_nystrom, self.n_components, generator, pairs=pairs)
        K = self.lam.shape[0]
        self.n_components_used = K
        theta = lin.flat_params().double()
        base_s0 = float(theta @ theta) / lin.n_params
        need_val = (self.early_stopping or self.prior_variance == "auto"
                    or (self.regression and self.noise_variance == "auto"))
        if need_val and X_val is None:
            raise ValueError("validation data is required for early stopping or 'auto' "
                             "hyperparameters")
        if need_val:
            self._g_val, self._phi_val = self.features(lin, X_val)
            self._y_val = y_val
            self._res_val = None
            if self.residual:
                r = lin.ntk_diag_blocks(X_val).double() - self._phi_val @ self._phi_val.transpose(1, 2)
                self._res_val = 0.5 * (r + r.transpose(1, 2))
            if self.regression:
                base_s2 = float(((y_val - self._g_val) ** 2).mean().clamp_min(1e-12))
        s0_grid = (base_s0 * np.asarray(self.prior_grid) if self.prior_variance == "auto"
                   else np.array([self.prior_variance]))
        if self.regression:
            s2_grid = (base_s2 * np.asarray(self.noise_grid) if self.noise_variance == "auto"
                       else np.array([self.noise_variance]))
        else:
            s2_grid = np.array([1.0])

        order = (torch.randperm(N, generator=generator, device=generator.device).to(X.device)
                 if self.early_stopping else None)
        G_lik = torch.zeros((K, K), dtype=torch.float64, device=X.device)
        best = (np.inf, None, 0, s0_grid[0], s2_grid[0])  # nll, G, n_seen, s0, s2
        self.history = []
        next_check, bad, n_seen = self.search_freq, 0, 0
        bar = None
        if self.verbose and tqdm is not None:
            bar = tqdm(total=N, desc="ELLA: accumulating G", unit="pt", leave=False)
        step = min(self.batch_size, self.search_freq) if self.early_stopping else self.batch_size
        for sl in iter_batches(N, step):
            idx = order[sl] if order is not None else sl
            g, phi = self.features(lin, X[idx])
            G_lik += self._lik_gram(g, phi)
            n_seen += g.shape[0]
            if bar is not None:
                bar.update(g.shape[0])
            if self.early_stopping and (n_seen >= next_check or n_seen == N):
                next_check += self.search_freq
                scores = self._val_scores(G_lik, n_seen / N, s0_grid, s2_grid)
                i, j = np.unravel_index(np.argmin(scores), scores.shape)
                self.history.append((n_seen, float(scores[i, j])))
                if scores[i, j] < best[0]:
                    best = (float(scores[i, j]), G_lik.clone(), n_seen, s0_grid[i], s2_grid[j])
                    bad = 0
                else:
                    bad += 1
                    if bad >= self.n_iter_no_change:
                        break
        if bar is not None:
            bar.close()
        if self.early_stopping:
            _, G_lik, n_seen, s0, s2 = best
            n_ratio = n_seen / N
        else:
            n_ratio = 1.0
            if need_val:
                scores = self._val_scores(G_lik, 1.0, s0_grid, s2_grid)
                i, j = np.unravel_index(np.argmin(scores), scores.shape)
                s0, s2 = s0_grid[i], s2_grid[j]
                self.history.append((n_seen, float(scores[i, j])))
            else:
                s0, s2 = s0_grid[0], s2_grid[0]
        for name in ("_g_val", "_phi_val", "_y_val", "_res_val"):
            self.__dict__.pop(name, None)
        self.G_lik = G_lik
        self.n_seen = n_seen
        self.n_ratio = n_ratio
        self.prior_variance = float(s0)
        self.noise_variance = float(s2) if self.regression else None
        scale = 1.0 / s2 if self.regression else 1.0
        # The prior term is scaled by the fraction of data seen (METHODS.md, ELLA step 6).
        G = G_lik * scale + (n_ratio / s0) * torch.eye(K, dtype=torch.float64, device=X.device)
        self._L = torch.linalg.cholesky(0.5 * (G + G.T))
        return self

    # -------------------------------------------------------------- prediction
    def predict(self, lin, x, full_cov: bool = False):
        """Network outputs (B, C) and latent covariance (B, C, C) or (B*C, B*C)."""
        g, phi = self.features(lin, x)
        B, C, K = phi.shape
        Z = torch.linalg.solve_triangular(self._L, phi.reshape(B * C, K).T, upper=False)
        if full_cov:
            cov = Z.T @ Z
            if self.residual:
                # Only the per-point blocks of the residual are available cheaply;
                # the cross-point residual needs the full NTK between query points.
                res = lin.kernel(x, n_outputs=C) - phi.reshape(B * C, K) @ phi.reshape(B * C, K).T
                cov = cov + self.prior_variance * res
            return g, 0.5 * (cov + cov.T)
        Zb = Z.T.reshape(B, C, K)
        cov = Zb @ Zb.transpose(1, 2)
        if self.residual:
            kxx = lin.ntk_diag_blocks(x).double()
            res = kxx - phi @ phi.transpose(1, 2)
            # k - phi phi^T is PSD in exact arithmetic; symmetrise the round-off.
            res = 0.5 * (res + res.transpose(1, 2))
            cov = cov + self.prior_variance * res
        return g, cov


def _check_ella_params(est):
    check_positive_int(est.n_nystrom, "n_nystrom")
    check_positive_int(est.n_components, "n_components")
    check_positive_int(est.search_freq, "search_freq")
    check_positive_int(est.n_iter_no_change, "n_iter_no_change")
    if not isinstance(est.early_stopping, (bool, np.bool_)):
        raise TypeError(f"early_stopping must be a bool, got {est.early_stopping!r}")
    if not isinstance(est.residual_correction, (bool, np.bool_)):
        raise TypeError(f"residual_correction must be a bool, got {est.residual_correction!r}")
    vf = est.validation_fraction
    if isinstance(vf, bool) or not isinstance(vf, (float, int, np.floating)) or not 0 < vf < 1:
        raise ValueError(f"validation_fraction must be in (0, 1), got {vf!r}")


class _ELLAMixin:
    """Shared fit logic: validation hold-out and the posterior."""

    def _check_params(self):
        device = super()._check_params()
        _check_ella_params(self)
        return device

    def fit(self, X, y, validation_data=None):
        """Fit ELLA.

        Parameters
        ----------
        X : array-like of shape (n_samples, n_features)
        y : array-like
            Targets (regression) or labels (classification).
        validation_data : tuple (X_val, y_val), optional
            Held-out data for early stopping and ``"auto"`` hyperparameters. When
            omitted and either is requested, a random ``validation_fraction`` of the
            training data is held out (and not used in ``G``).

        Returns
        -------
        self : object
        """
        return self._fit(X, y, validation_data)

    def _needs_validation(self):
        auto = self.prior_variance == "auto" or getattr(self, "noise_variance", None) == "auto"
        return bool(self.early_stopping or auto)

    def _fit_posterior(self, data):
        X, y, X_val, y_val = data.X, data.y, data.X_val, data.y_val
        if self._needs_validation() and X_val is None:
            N = X.shape[0]
            n_val = min(max(1, int(round(self.validation_fraction * N))), N - 1)
            perm = torch.randperm(N, generator=data.generator, device=data.generator.device)
            perm = perm.to(X.device)
            val, tr = perm[:n_val], perm[n_val:]
            X_val, y_val, X, y = X[val], y[val], X[tr], y[tr]
        post = ELLAPosterior(
            n_nystrom=self.n_nystrom, n_components=self.n_components,
            prior_variance=self.prior_variance,
            noise_variance=self.noise_variance if self._task == "regression" else None,
            early_stopping=self.early_stopping, search_freq=self.search_freq,
            n_iter_no_change=self.n_iter_no_change, residual=self.residual_correction,
            batch_size=self.batch_size, verbose=self.verbose,
        )
        post.fit(data.lin, X, y, data.n_outputs, data.generator, X_val, y_val)
        self.n_components_ = post.n_components_used
        self.n_seen_ = post.n_seen
        self.validation_scores_ = post.history
        return post


_ELLA_DOC = NET_PARAM_DOC + """
    n_nystrom : int, default=2000
        ``M``, the number of (point, output) pairs of the Nystrom approximation
        (all ``N * C`` pairs when larger).
    n_components : int, default=20
        ``K``, the number of eigenpairs kept.
    prior_variance : float or "auto", default="auto"
        ``s0^2``. ``"auto"`` picks the value with the lowest validation NLL on the grid
        ``||theta||^2 / P * logspace(-4, 4, 33)``; only ``G``'s diagonal changes, so
        the search costs no extra network evaluations.
    early_stopping : bool, default=False
        Evaluate validation NLL every ``search_freq`` training points while streaming,
        with prior term ``(n_seen / N) I / s0^2``, keep the best state and stop after
        ``n_iter_no_change`` evaluations without improvement (the paper's remedy for
        LLA's over-concentration on large data). The data is streamed in random order.
    validation_fraction : float, default=0.1
        Fraction of the training data held out when validation is needed and no
        ``validation_data`` is passed to ``fit``.
    search_freq : int, default=1000
        Training points between validation evaluations.
    n_iter_no_change : int, default=5
    residual_correction : bool, default=False
        Add back the prior variance ELLA drops outside ``span(V)``,
        ``s0^2 (k(x,x) - phi(x) phi(x)^T)``, which makes full-rank ELLA equal exact LLA
        at every input (it costs one NTK diagonal per query point). Off by default,
        as in the paper.
    device : "auto", "cpu", "cuda" or torch.device, default="auto"
    batch_size : int, default=256
        Points per forward pass (training stream and prediction).
    random_state : int, RandomState instance or None, default=None
        Seeds the Nystrom pairs, the hold-out split, the stream order and the
        training of a default / unfitted net.
    verbose : int, default=0
        ``>= 1`` shows a progress bar over the training pass.
"""


class ELLARegressor(_ELLAMixin, LaplaceRegressorMixin):
    __doc__ = (
        """ELLA regression: Nystrom-accelerated linearized Laplace.

    Parameters
    ----------""" + _ELLA_DOC + """    noise_variance : float or "auto", default="auto"
        ``s2``. ``"auto"`` searches ``mse_val * logspace(-2, 1, 13)`` (``mse_val`` the
        network's mean squared validation residual) jointly with the prior grid, by
        validation NLL.

    Attributes
    ----------
    prior_variance_, noise_variance_ : float
    n_components_ : int
        Eigenpairs kept (fewer than ``n_components`` if the Gram is rank deficient).
    n_seen_ : int
        Training points accumulated in ``G``.
    validation_scores_ : list of (n_seen, nll)
    posterior_ : ELLAPosterior
    net_ : object
    n_features_in_ : int

    Examples
    --------
    >>> import numpy as np
    >>> from sklearn_lla import ELLARegressor
    >>> rng = np.random.RandomState(0)
    >>> X = rng.uniform(-2, 2, (200, 1)); y = np.sin(2 * X[:, 0]) + 0.1 * rng.randn(200)
    >>> reg = ELLARegressor(n_nystrom=100, n_components=10, random_state=0).fit(X, y)
    >>> mean, std = reg.predict(X[:2], return_std=True)
    """
    )

    def __init__(self, net=None, *, n_nystrom=2000, n_components=20, prior_variance="auto",
                 noise_variance="auto", early_stopping=False, validation_fraction=0.1,
                 search_freq=1000, n_iter_no_change=5, residual_correction=False,
                 device="auto", batch_size=256, random_state=None, verbose=0):
        self.net = net
        self.n_nystrom = n_nystrom
        self.n_components = n_components
        self.prior_variance = prior_variance
        self.noise_variance = noise_variance
        self.early_stopping = early_stopping
        self.validation_fraction = validation_fraction
        self.search_freq = search_freq
        self.n_iter_no_change = n_iter_no_change
        self.residual_correction = residual_correction
        self.device = device
        self.batch_size = batch_size
        self.random_state = random_state
        self.verbose = verbose


class ELLAClassifier(_ELLAMixin, LaplaceClassifierMixin):
    __doc__ = (
        """ELLA classification: Nystrom-accelerated linearized Laplace.

    Parameters
    ----------""" + _ELLA_DOC + """    link_approx : {"probit", "mc", "bridge"}, default="probit"
        Approximation of ``E softmax(f)``; the paper uses ``"mc"`` with 512 samples.
    n_samples_predict : int, default=512

    Attributes
    ----------
    classes_ : ndarray
    prior_variance_ : float
    n_components_ : int
    n_seen_ : int
    validation_scores_ : list of (n_seen, nll)
    posterior_ : ELLAPosterior
    net_ : object
    n_features_in_ : int
    """
    )

    def __init__(self, net=None, *, n_nystrom=2000, n_components=20, prior_variance="auto",
                 early_stopping=False, validation_fraction=0.1, search_freq=1000,
                 n_iter_no_change=5, residual_correction=False, link_approx="probit",
                 n_samples_predict=512, device="auto", batch_size=256, random_state=None,
                 verbose=0):
        self.net = net
        self.n_nystrom = n_nystrom
        self.n_components = n_components
        self.prior_variance = prior_variance
        self.early_stopping = early_stopping
        self.validation_fraction = validation_fraction
        self.search_freq = search_freq
        self.n_iter_no_change = n_iter_no_change
        self.residual_correction = residual_correction
        self.link_approx = link_approx
        self.n_samples_predict = n_samples_predict
        self.device = device
        self.batch_size = batch_size
        self.random_state = random_state
        self.verbose = verbose
