"""A KFAC posterior for the parameter directions a low-rank method leaves out.

ELLA and subspace Laplace keep ``K`` directions ``Q`` (orthonormal rows, K x P) and
compute the posterior exactly inside ``span(Q)``. Outside it the exact posterior
covariance ``S = (GGN / s2 + I / s0^2)^-1`` is not the prior: at large ``N`` the
kept directions are the ones the data pin down hardest, and most of exact LLA's
epistemic variance lies in the directions left out, shrunk by the data but far
from to zero (issue 34: the top-``K`` part alone kept 0.3 - 3 % of it, the prior on
the rest 3.6 - 15 x). With ``P_perp = I - Q^T Q`` the complement's share is taken from
a Kronecker-factored (KFAC, type-2) approximation ``Sigma`` of the *full* posterior
covariance,

``S(x) ~ phi(x) S_K phi(x)^T + j_perp(x)^T Sigma j_perp(x)``,  ``j_perp = P_perp j``,

exact when ``span(Q)`` is an invariant subspace of the GGN and ``Sigma`` exact, equal
to the KFAC Laplace predictive for ``K = 0``. Expanded,

``j_perp^T Sigma j_perp = j^T Sigma j - 2 phi (Q Sigma j) + phi (Q Sigma Q^T) phi^T``.

The parameters are Kronecker blocks and diagonal parameters, described per Jacobian
backend by a *layer factors* object (:mod:`~sklearn_lla._posteriors.kfac_layers`): a
block ``W`` (``out x in'``, the bias as a last column) has the row block
``sum_t d_t abar_t^T`` over its positions ``t`` (one for a ``nn.Linear`` of a chain;
a convolution's output positions against its unfolded input patches). The factors
are accumulated in one pass over the training rows, in the KFC sense (Grosse &
Martens 2016; "KFAC-expand"):

``A = mean_n mean_t abar_nt abar_nt^T``,
``G = sum_n sum_k sum_t d_nkt d_nkt^T``  (``d_nk = sum_c M_kc d_nc``, ``M M^T`` the
likelihood's curvature ``Lam_n``; unit noise for a Gaussian likelihood),

the GGN block ``~ G (x) A``, exact for one position and a single layer; a diagonal
parameter (BatchNorm's weight and bias) gets its exact diagonal GGN entry, from its
dense rows in the same pass. Both factors are eigendecomposed once, so ``Sigma =
mult * (H_unit + tau I)^-1`` for any hyperparameters (``mult = s2``, ``tau = s2 /
s0^2`` in regression; ``mult = 1``, ``tau = 1 / s0^2`` in classification) costs only
new eigenvalue weights. Per row, ``j^T Sigma j`` and ``Q Sigma j`` are read from the
row block rotated into the eigenbases, ``Ug^T (sum_t d_t abar_t^T) Ua = sum_t (Ug^T
d_t)(Ua^T abar_t)^T`` (for one position never formed: ``O(in^2 + out^2 + in out)``
per layer and row). All curvature algebra is float64.

Networks on the generic ``torch.func`` backend have no layer factors; there the
estimators fall back to the prior residual (see :func:`supports_kfac_complement`).

:class:`DiagonalComplement` is the complement VaLLA uses (``covariance=
"subspace+diagonal"``): a diagonal posterior computed from Jacobian rows and the
Nystrom residual the sparse GP has anyway, for any network (in
:mod:`~sklearn_lla._posteriors.diagonal_complement`, re-exported here).
"""

from __future__ import annotations

import torch

# the diagonal complement (VaLLA) lives in its own module; its names are re-exported
from .diagonal_complement import (
    DiagonalComplement,
    mixed_sq_colsum,
    row_subset,
    weighted_sq_norms,
)
from .kfac_layers import (  # the factors' row sums (_block_trace: tests)
    _block_trace,  # noqa: F401
    _FactorSums,
    _rows_ggn_trace,
    layer_factors,
    rotate_signals,
    supports_layer_factors,
)

__all__ = ["KFACComplement", "supports_kfac_complement", "training_rows_cache", "OUTSIDE_RTOL",
           "DiagonalComplement", "row_subset", "weighted_sq_norms", "mixed_sq_colsum"]

_F64 = torch.float64

#: Below this fraction of the GGN's trace outside the kept span the data determine
#: nothing there (round-off of float32 features, of the dropped Nystrom eigenvalues):
#: the complement is the prior (:meth:`KFACComplement.match_trace`).
OUTSIDE_RTOL = 1e-6


def supports_kfac_complement(lin) -> bool:
    """Whether ``lin``'s Jacobian backend has layer factors (structured or graph)."""
    return supports_layer_factors(lin)


def _chunks(src, x, C):
    """Slices of ``x`` that fit one product of the layer factors ``src``."""
    step = max(1, int(src.step(C)))
    return [slice(s, s + step) for s in range(0, x.shape[0], step)]


def _mixer(lik):
    """The likelihood's curvature factor as the rows' mixing (``None``: unit)."""
    return None if lik.unit_curvature else (lambda g: lik.lam_factor(g).transpose(1, 2))


def _kfac_pass(payload, batches):
    """Row sums of the KFAC factors: ``(sum_n mean_t abar abar^T per block..., G per
    block..., diagonal GGN, n_points, tr GGN)`` over ``batches`` (module docstring)."""
    lin, lik = payload
    src = layer_factors(lin)
    mix = _mixer(lik)
    sums, C = _FactorSums(lin, src), None
    for x, _ in batches:
        x = lin._input(x)
        if C is None:
            C = lin.n_outputs(x)
        for sl in _chunks(src, x, C):
            _, facs, D = src.factors(x[sl], mix)
            sums.add(facs, D, 0, x)
        sums.n += x.shape[0]
    return sums.result()


def kfac_and_rows_pass(payload, batches):
    """:func:`_kfac_pass` and a per-chunk function of the same rows, in one pass.

    For layer factors that share the rows' pass (the graph backend): each chunk's
    forward and backward pass gives the Jacobian rows (all outputs), passed to
    ``fn(rows, x, y, state)``, and the KFAC factors (the rows' signals mixed by the
    likelihood's curvature factor afterwards: the mixing is linear).

    Parameters
    ----------
    payload : tuple
        ``(lin, likelihood, fn, state)``: ``state`` the initial row sums (float64
        tensors, floats, ints), copied, that ``fn`` adds to in place.
    batches : iterable of (x, y)

    Returns
    -------
    tuple
        :func:`_kfac_pass`'s sums, then the entries of ``state``.
    """
    lin, lik, fn, state = payload
    # a fresh copy: partitions run in one process must not add into one another's sums
    state = [v.clone() if isinstance(v, torch.Tensor) else v for v in state]
    src = layer_factors(lin)
    mix = _mixer(lik)
    sums, C = _FactorSums(lin, src), None
    for x, y in batches:
        x = lin._input(x)
        if C is None:
            C = lin.n_outputs(x[:1])
        for sl in _chunks(src, x, C):
            # the factors in the network's dtype (the mixed signals are products of
            # Jacobian rows), their products and sums in float64 (_FactorSums.add)
            rows, (_, facs, D) = src.rows_and_factors(x[sl], mix, lin.dtype)
            tr = _rows_ggn_trace(rows, mix)
            fn(rows, x[sl], y[sl], state)
            del rows
            sums.add(facs, D, min(sl.stop, x.shape[0]) - sl.start, x, trace=tr)
    return (*sums.result(), *state)


def training_rows_cache(data):
    """A cache for the training rows of :func:`kfac_and_rows_pass` (every output), when
    they can be held: for features that read rows from them instead of computing them
    (ELLA's Nystrom rows are training rows) and for the GGN of the features afterwards,
    so that no row is computed twice.

    Only for layer factors that share the rows' pass (graph backend), in-memory data
    and training rows within :data:`~sklearn_lla._posteriors.subspace_kfac.
    ROW_CACHE_ELEMENTS` (the rows of one point measured).

    Parameters
    ----------
    data : FitData
        The training stream.

    Returns
    -------
    RowCache or None
        Its ``add`` is the pass's ``fn``; ``None`` when the rows cannot be held.
    """
    lin = data.lin
    if data.is_dask or not getattr(layer_factors(lin), "shares_rows", False):
        return None
    from .subspace_kfac import ROW_CACHE_ELEMENTS, RowCache, _fit_rows

    return RowCache(ROW_CACHE_ELEMENTS) if _fit_rows(lin, data) else None


class KFACComplement:
    """``P_perp Sigma_KFAC P_perp``: the posterior outside a kept span ``Q``.

    Parameters
    ----------
    lin : LinearizedNet
        The network (structured or graph Jacobian backend).
    data : FitData
        The training stream (one pass of layer factors).
    Q : Tensor of shape (K, P) or None
        Orthonormal rows spanning the kept directions (float64); ``None``: nothing
        kept (the KFAC Laplace predictive).
    sums : tuple, optional
        The factors' row sums over ``data`` already accumulated
        (:func:`kfac_and_rows_pass`); default: one pass of their own.

    Attributes
    ----------
    blocks : list of KronBlock
        The Kronecker-factored parameter blocks.
    diag_names : list of str
        The parameters with a diagonal curvature.
    eig : list of tuple
        Per block ``(lam_G, U_G, lam_A, U_A)``: the factors' eigenpairs, float64.
    diag : Tensor of shape (p_diag,)
        The exact diagonal GGN of ``diag_names`` (unit noise), float64.
    ggn_trace : float
        ``tr GGN`` (exact, unit noise) of all training rows.
    """

    @property
    def source(self):
        """The layer factors of the network's Jacobian backend (rebuilt after
        unpickling: a backend is never pickled, its network rebuilds it)."""
        if self.__dict__.get("_source") is None:
            self._source = layer_factors(self.lin)
        return self._source

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_source"] = None
        state.pop("_kept_check", None)
        state.pop("_fdir_cache", None)
        state.pop("_dirs_dtype", None)
        return state

    def __init__(self, lin, data, Q, sums=None):
        if not supports_kfac_complement(lin):
            raise ValueError("the KFAC complement needs the structured or graph Jacobian "
                             "backend")
        self.lin = lin
        self._source = layer_factors(lin)
        self.regression = data.likelihood.task == "regression"
        bs = min(data.batch_size, 1024)
        out = data.reduce(_kfac_pass, (lin, data.likelihood), bs) if sums is None else sums
        self.blocks = self.source.blocks(lin._input(data.rows(slice(0, 1))[0]))
        self.diag_names = list(self.source.diag_names)
        L = len(self.blocks)
        if len(out) != 2 * L + 3:
            raise RuntimeError("internal error: KFAC factors do not match the layers")
        n, self.ggn_trace = out[-2], float(out[-1])
        self.eig = []
        for A, G in zip(out[:L], out[L:2 * L]):
            la, Ua = torch.linalg.eigh(0.5 * (A + A.T) / max(n, 1))
            lg, Ug = torch.linalg.eigh(0.5 * (G + G.T))
            self.eig.append((lg.clamp_min(0.0), Ug, la.clamp_min(0.0), Ua))
        self.diag = out[2 * L].clamp_min(0.0)
        self.Q = None if Q is None or len(Q) == 0 else Q.to(_F64)
        self._cache, self._rot = {}, None
        self.scale, self.fraction, self.outside_fraction = 1.0, 1.0, None

    # ---------------------------------------------------------------- algebra
    def _key(self, s0, s2):
        """``(mult, tau)``: ``Sigma = mult * (H_unit + tau I)^-1``."""
        mult = float(s2) if self.regression and s2 is not None else 1.0
        # after early stopping: the KFAC of the rows seen is ``fraction`` times the
        # full data's (a random subset) and the prior precision ``fraction / s0^2``.
        # ``tau`` keys the cache of :meth:`_pieces`: rounded to 12 significant digits,
        # so that a rescaled pair ``(c s0^2, c s2)`` (held-out calibration) finds the
        # pieces of ``(s0^2, s2)`` instead of recomputing them for a last-bit change
        tau = float(f"{mult / float(s0):.12g}")
        return mult / self.fraction, tau

    def _weights(self, tau):
        """``(rho H_KFAC + tau I)^-1``'s eigenvalues: per block ``1 / (rho lam_G lam_A^T
        + tau)`` (out, in') in its Kronecker eigenbasis, and ``1 / (rho diag + tau)``
        for the diagonal parameters (``rho`` in {0, 1}, :meth:`match_trace`)."""
        W = [1.0 / (self.scale * torch.outer(lg, la) + tau) for lg, _, la, _ in self.eig]
        return W, 1.0 / (self.scale * self.diag + tau)

    def match_trace(self, inside_trace, fraction=1.0, total_trace=None):
        """Switch the complement's curvature off when the data leave none outside ``Q``.

        ``tr(P_perp GGN P_perp) = tr GGN - inside_trace`` (``inside_trace = tr(Q GGN
        Q^T)``, the trace of the feature-space GGN) is the curvature the data put
        outside ``span(Q)``. When it vanishes (to :data:`OUTSIDE_RTOL` of ``tr GGN``:
        full-rank ELLA, a subspace at the Jacobian's rank) the exact posterior there
        is the prior, and KFAC, whose factors do not know ``span(Q)``, would shrink
        it: ``rho = 0`` and the complement is the prior, so full rank is exact LLA.
        Otherwise ``rho = 1``: KFAC's own curvature. (Matching KFAC's trace outside
        ``span(Q)`` to the GGN's instead was measured and rejected: KFAC's top
        directions do not align with the GGN's, its trace outside ``span(Q)`` is
        dominated by them, and the matched scale over-shrank the curvature of the
        directions that hold the variance: 3,000 rows, ``n_nystrom=200``, ratio to
        exact LLA's epistemic variance 4.1 against 1.1 with ``rho = 1``.)

        After early stopping (the posterior of a random ``fraction`` of the rows,
        prior precision ``fraction / s0^2``) the complement is that of those rows:
        ``fraction`` times the full data's KFAC and the same prior precision, i.e.
        ``Sigma / fraction``.

        Parameters
        ----------
        inside_trace : float
            ``tr(Q GGN Q^T)`` (unit noise) of the rows the posterior holds.
        fraction : float, default=1.0
            The share of the training rows the posterior holds.
        total_trace : float, optional
            ``tr GGN`` of those rows (default: all of them, or ``fraction`` of it).

        Returns
        -------
        float
            ``rho``.
        """
        self.fraction = float(fraction)
        total = self.fraction * self.ggn_trace if total_trace is None else float(total_trace)
        outside = total - float(inside_trace)
        self.outside_fraction = max(outside, 0.0) / total if total > 0 else 0.0
        self.scale = 1.0 if self.outside_fraction > OUTSIDE_RTOL else 0.0
        self._cache, self._fdir_cache = {}, None
        return self.scale

    # ---------------------------------------------------------------- evidence
    def _rotated(self):
        """``(lam, Qt)``: the unit-noise curvature's eigenvalues (all ``P``: every
        Kronecker block's ``lam_G lam_A^T``, then the diagonal parameters') and ``Q``'s
        rows in the same eigenbasis (K x P), float64; computed once."""
        if self._rot is None:
            lam = torch.cat([torch.outer(lg, la).reshape(-1) for lg, _, la, _ in self.eig]
                            + [self.diag.reshape(-1)])
            Qt = None
            if self.Q is not None:
                Qd = self.lin.unflatten(self.Q)
                parts = [(Ug.T @ blk.to_matrix(Qd) @ Ua).reshape(len(self.Q), -1)
                         for blk, (_, Ug, _, Ua) in zip(self.blocks, self.eig)]
                if self.diag_names:
                    parts.append(self._diag_matrix(Qd))
                Qt = torch.cat(parts, dim=1)
            self._rot = (lam, Qt)
        return self._rot

    def outside_log_det(self, prior_variance, noise_variance=None):
        """The complement's Occam term of the Laplace evidence, and its derivatives.

        With the posterior's curvature ``Q^T G_K Q`` inside ``span(Q)`` and this
        complement's ``P_perp H P_perp`` outside (``H = rho * fraction * H_KFAC``, the
        curvature :meth:`covariance` uses), the evidence's
        ``log det(I + c H_post)`` splits into the ``K`` kept eigenvalues and
        ``log det((I + c H)_perp)``, ``c = s0^2 / s2`` (``s0^2`` for classification).
        For a positive definite ``A`` the determinant of a principal block is
        ``det(A) det((A^-1)_QQ)``, so

        ``log det((I + c H)_perp) = sum_j log(1 + c lam_j) + log det(Q (I + c H)^-1 Q^T)``

        over the KFAC eigenvalues ``lam_j`` (all ``P``) and a ``K x K`` matrix: no
        ``P x P`` matrix, ``O(K^2 P)`` per evaluation. Without it the evidence counts
        the complement's directions as uninformed by the data and picks a prior
        variance many times too large (issue 34).

        Parameters
        ----------
        prior_variance : float
            ``s0^2`` (of the rows the posterior holds, as the evidence's).
        noise_variance : float or None
            ``s2`` (regression) or ``None``.

        Returns
        -------
        value : float
            ``log det((I + c H)_perp)``.
        d_log_prior : float
            Its derivative in ``log s0^2``.
        d_log_noise : float
            Its derivative in ``log s2`` (0 for classification).
        """
        lam, Qt = self._rotated()
        rho = self.scale * self.fraction
        c = float(prior_variance) * rho / (float(noise_variance) if noise_variance is not None
                                           else 1.0)
        if c <= 0.0:
            return 0.0, 0.0, 0.0
        cl = c * lam
        value = float(torch.log1p(cl).sum())
        grad = float((cl / (1.0 + cl)).sum())
        if Qt is not None:
            B = (Qt / (1.0 + cl)) @ Qt.T
            L = torch.linalg.cholesky(0.5 * (B + B.T))
            value += 2.0 * float(torch.log(torch.diagonal(L)).sum())
            dB = (Qt * (cl / (1.0 + cl) ** 2)) @ Qt.T
            grad -= float(torch.cholesky_solve(dB, L).diagonal().sum())
        return value, grad, (-grad if noise_variance is not None else 0.0)

    def _diag_matrix(self, T):
        """The diagonal parameters of ``{name: (K, *shape)}`` as ``(K, p_diag)``."""
        return torch.cat([T[n].to(_F64).reshape(T[n].shape[0], -1) for n in self.diag_names],
                         dim=1)

    def _pieces(self, tau):
        """``(weights, diagonal weights, Sigma_unit Q^T in the eigenbases per block, on
        the diagonal parameters, Q Sigma_unit Q^T)`` at ``tau``."""
        if tau in self._cache:
            return self._cache[tau]
        W, wd = self._weights(tau)
        U = Ud = QSQ = None
        if self.Q is not None:
            _, Qt = self._rotated()  # Q in the eigenbases, once for every tau
            K, start, U = len(self.Q), 0, []
            for w in W:
                U.append(Qt[:, start:start + w.numel()].reshape(K, *w.shape) * w)
                start += w.numel()
            if self.diag_names:
                Ud = Qt[:, start:] * wd
            w_all = torch.cat([w.reshape(-1) for w in W] + [wd.reshape(-1)])
            QSQ = (Qt * w_all) @ Qt.T
            QSQ = 0.5 * (QSQ + QSQ.T)
        if len(self._cache) > 64:
            self._cache.clear()
        self._cache[tau] = (W, wd, U, Ud, QSQ)
        return self._cache[tau]

    # ---------------------------------------------------------------- prediction
    def _dirs_as(self, tau, dtype):
        """:meth:`_pieces`' ``Sigma_unit Q^T`` (per block and on the diagonal
        parameters) in ``dtype``, cached per ``tau``."""
        W, wd, U, Ud, _ = self._pieces(tau)
        seen = self.__dict__.get("_dirs_dtype")
        if seen is None or seen[0] is not U:  # (new pieces: the cache follows them)
            seen = self._dirs_dtype = (U, {})
        if dtype not in seen[1]:
            seen[1][dtype] = ([None if u is None else u.to(dtype) for u in U],
                              None if Ud is None else Ud.to(dtype))
        return seen[1][dtype]

    def _eig_as(self, dtype):
        """The factors' eigenbases ``[(U_G, U_A)]`` in ``dtype`` (cached)."""
        cache = self.__dict__.setdefault("_eig_dtype", {})
        if dtype not in cache:
            cache[dtype] = [(Ug.to(dtype), Ua.to(dtype)) for _, Ug, _, Ua in self.eig]
        return cache[dtype]

    def _feature_dirs(self, features, tau, dtype, kept):
        """``([V ; Sigma_unit Q^T] per block (K + K', out, in'), on the diagonal
        parameters (K + K', p_diag)), K)``: the features' directions ``V`` (their
        tangents) and, when a span is kept, ``Sigma_unit Q^T``, in the Kronecker
        eigenbases and ``dtype`` (cached per features object, ``tau`` and ``dtype``):
        their products with a prediction's rotated row blocks are ``phi = J(x) V^T``
        and ``j^T Sigma_unit Q^T`` (:meth:`features_and_covariance`). When ``V`` is the
        kept basis ``Q`` itself (``kept``: ELLA), its rotation is the evidence's
        (:meth:`_rotated`)."""
        T = features.tangents
        seen = self.__dict__.get("_fdir_cache")
        if seen is None or seen[0] is not T:
            seen = self._fdir_cache = (T, {})
        key = (tau, dtype, kept)
        if key not in seen[1]:
            _, _, U, Ud, _ = self._pieces(tau)
            if kept:
                _, Qt = self._rotated()
                K, start, vs = len(self.Q), 0, []
                for blk in self.blocks:
                    size = blk.out * blk.n_in
                    vs.append(Qt[:, start:start + size].reshape(K, blk.out, blk.n_in))
                    start += size
                vd = Qt[:, start:] if self.diag_names else None
            else:
                V = self.lin._tangents(T)
                K = next(iter(V.values())).shape[0]
                vs = [Ug.T @ blk.to_matrix(V) @ Ua  # (K, out, in'), float64
                      for blk, (_, Ug, _, Ua) in zip(self.blocks, self.eig)]
                vd = self._diag_matrix(V) if self.diag_names else None
            blocks = [(v if U is None else torch.cat([v, U[j]])).to(dtype)
                      for j, v in enumerate(vs)]
            diag = None if vd is None else (vd if Ud is None else torch.cat([vd, Ud])).to(dtype)
            if len(seen[1]) > 8:
                seen[1].clear()
            seen[1][key] = ((blocks, diag), K)
        return seen[1][key]

    def _is_kept_basis(self, features):
        """Whether ``features``' directions are the rows of ``Q`` (to their dtype's
        round-off), so that ``phi = J(x) Q^T`` (checked once per features object)."""
        seen = self.__dict__.get("_kept_check")
        T = features.tangents
        if seen is not None and seen[0] is T:
            return seen[1]
        same = False
        if self.Q is not None and T is not None:
            from .._network.linearized import stack_flat

            T = self.lin._tangents(T)
            V = stack_flat(T, self.lin.names)
            if V.shape == self.Q.shape:
                eps = torch.finfo(V.dtype).eps
                scale = float(self.Q.abs().max())
                same = float((V.to(_F64) - self.Q).abs().max()) <= 8 * eps * scale
        self._kept_check = (features.tangents, same)
        return same

    def _terms(self, factors, tau, joint, cross=True, dirs=None):
        """``(j^T Sigma_unit j, j^T Sigma_unit Q^T)`` from the layer factors of a batch
        (:meth:`~sklearn_lla._posteriors.kfac_layers.GraphFactors.factors`): per point
        ``(B, C, C)`` (``joint``: between all rows, ``(B C, B C)``) and ``(B, C, K)``
        (or ``None``; also without ``cross``). The rotations into the eigenbases are
        done in the factors' dtype (float64, or the network's for a prediction), the
        sums over the blocks in float64. ``dirs``: other directions ``(per block
        (L, out, in'), diagonal (L, p_diag))`` given in the eigenbases and the factors'
        dtype, whose products ``(B, C, L)`` replace ``j^T Sigma_unit Q^T``
        (:meth:`_feature_dirs`)."""
        W, wd, U, Ud, _ = self._pieces(tau)
        _, facs, D = factors
        B, C = (facs[0][1].shape[:2] if facs and facs[0] is not None else D.shape[:2])
        dt_ = next((f[0].dtype for f in facs if f is not None), _F64 if D is None else D.dtype)
        if dirs is not None:
            U, Ud = dirs
        elif not cross:
            U = Ud = None
        elif dt_ != _F64 and U is not None:  # Sigma_unit Q^T in the factors' dtype, once
            U, Ud = self._dirs_as(tau, dt_)
        eig = self._eig_as(dt_)
        W = [w.to(dt_) for w in W]
        quad = torch.zeros((B * C, B * C) if joint else (B, C, C), dtype=_F64,
                           device=self.lin.device)
        L = None if U is None else next(
            (u.shape[0] for u in U if u is not None), None if Ud is None else Ud.shape[0])
        JU = None if U is None else torch.zeros((B, C, L), dtype=_F64, device=self.lin.device)
        for j, (f, (Ug, Ua), w) in enumerate(zip(facs, eig, W)):
            if f is None:
                continue
            a, d = f
            at = a @ Ua  # (B, T, in')
            if a.shape[1] == 1:  # one position: the block is never formed
                # (d^T Ug: one product; Ug^T @ d broadcast over (B, C) is a batched
                # product of (out, out) x (out, 1), 40 x slower on the digits CNN)
                at, dt = at[:, 0], d[..., 0] @ Ug  # (B, in'), (B, C, out)
                if joint:
                    Tm = torch.einsum("pj,qj,ij->pqi", at, at, w)  # (B, B, out)
                    quad += torch.einsum("pci,pqi,qdi->pcqd", dt, Tm, dt).reshape(B * C, -1)
                else:
                    t = (at * at) @ w.T  # (B, out)
                    quad += (dt * t[:, None, :]) @ dt.transpose(1, 2)
                if JU is not None:
                    K, o = U[j].shape[:2]
                    # (B, K, out): U_k at per point, read transposed by the batched
                    # product (no copy of a permuted (K, out, B) layout)
                    tmp = (at @ U[j].reshape(K * o, -1).T).view(B, K, o)
                    JU += dt @ tmp.transpose(1, 2)
                continue
            dt = rotate_signals(Ug, d)  # (B, C, out, T)
            # the rotated row blocks, one batched product per point: (B, C, out in')
            Z = torch.bmm(dt.reshape(B, -1, dt.shape[-1]), at).reshape(B, C, -1)
            if JU is not None:
                JU += Z @ U[j].reshape(len(U[j]), -1).T
            Z.mul_(w.reshape(-1).sqrt())  # in place: no second block-sized temporary
            if joint:
                Zs = Z.reshape(B * C, -1)
                quad += Zs @ Zs.T
            else:
                quad += Z @ Z.transpose(1, 2)
        if D is not None:
            if JU is not None:
                JU += D.to(Ud.dtype) @ Ud.T
            D = D.to(_F64)
            if joint:
                Ds = D.reshape(B * C, -1) * wd.sqrt()
                quad += Ds @ Ds.T
            else:
                quad += (D * wd) @ D.transpose(1, 2)
        return quad, JU

    def covariance(self, x, phi_o, s0, s2):
        """``j_perp^T Sigma j_perp`` per point (B, C, C), float64, PSD.

        Parameters
        ----------
        x : Tensor
            Input batch.
        phi_o : Tensor of shape (B, C, K) or None
            ``J(x) Q^T`` (the coordinates in the kept orthonormal basis).
        s0, s2 : float
            Prior variance and noise variance (``None`` for classification).

        Returns
        -------
        Tensor of shape (B, C, C)
        """
        mult, tau = self._key(s0, s2)
        # the factors and their rotations in the network's dtype (Jacobian products,
        # as features_and_covariance's), the sums over the blocks in float64
        # (_terms): a float32 MLP's ELLA predicts 2 x faster than through float64
        # factors (3 x 200 tanh, 10 classes), the same covariance to float32 round-off
        return mult * self.unit_covariance(x, phi_o, tau, dtype=self.lin.dtype)

    def unit_covariance(self, x, phi_o, tau, factors=None, dtype=_F64):
        """:meth:`covariance` of ``Sigma_unit = (H_unit + tau I)^-1`` (``mult = 1``);
        ``factors``: :meth:`chunk_factors` of ``x`` (for several ``tau``); else computed
        in ``dtype``."""
        x = self.lin._input(x)
        C = None if phi_o is None else phi_o.shape[1]
        chunks = _chunks(self.source, x, C or self.lin.n_outputs(x))
        if factors is None:
            factors = (self.source.factors(x[sl], dtype=dtype) for sl in chunks)
        return self._psd([self._unit_chunk(f, None if phi_o is None else phi_o[sl], tau)
                          for sl, f in zip(chunks, factors)])

    def chunk_factors(self, x, n_outputs):
        """The layer factors of ``x``, chunk by chunk (float64), for
        :meth:`unit_covariance` at several ``tau`` without recomputing them.

        Parameters
        ----------
        x : Tensor
            Input batch.
        n_outputs : int
            ``C``.

        Returns
        -------
        list of tuple
        """
        x = self.lin._input(x)
        return [self.source.factors(x[sl]) for sl in _chunks(self.source, x, n_outputs)]

    @property
    def shares_rows(self) -> bool:
        """Whether :meth:`features_and_covariance` shares the Jacobian's pass between
        the features and the complement (the graph backend's layer factors)."""
        return bool(getattr(self.source, "shares_rows", False))

    def features_and_covariance(self, x, features, W, s0, s2):
        """The features of a batch and :meth:`covariance` there, from one forward and
        one backward pass per chunk of points (:attr:`shares_rows`).

        The rows that give ``phi(x) = J(x) V`` are contracted from the same layer
        signals (inputs and back-propagated signals) as the complement's KFAC terms,
        so the pass is done once. The features and ``j^T Sigma Q^T`` are read from
        the row blocks rotated into the Kronecker eigenbases (which the complement's
        terms need anyway), one product per block with ``[V; Sigma Q^T]`` rotated
        there: a convolution's row blocks are never formed in the parameters' own
        basis (before, subspace Laplace's ``V`` took the rows' own pass: the
        convolutions' row blocks were formed twice, and ``V`` and ``Sigma Q^T``
        concatenated per chunk). When ``V`` is the kept orthonormal basis ``Q``
        itself (``W`` is ``None``: ELLA), ``Q``'s rotation is the evidence's
        (:meth:`_rotated`).

        Parameters
        ----------
        x : Tensor
            Input batch.
        features : Features
            The posterior's features (:meth:`~sklearn_lla._posteriors.glm.Features.
            of_rows`).
        W : Tensor of shape (K, K) or None
            The map of ``phi`` to the kept orthonormal coordinates (``None``: they are).
        s0, s2 : float
            Prior variance and noise variance (``None`` for classification).

        Returns
        -------
        g : Tensor of shape (B, C)
            The outputs, float64.
        phi : Tensor of shape (B, C, K)
            The features, float64.
        cov : Tensor of shape (B, C, C)
            ``j_perp^T Sigma j_perp`` per point, float64.
        """
        if not self.shares_rows:
            raise ValueError("these layer factors do not share the rows' pass")
        mult, tau = self._key(s0, s2)
        x = self.lin._input(x)
        gs, phis, covs = [], [], []
        C = getattr(self, "_n_out", None) or self.lin.n_outputs(x[:1])
        self._n_out = C
        # phi = J(x) V^T and j^T Sigma_unit Q^T from the row blocks rotated into the
        # Kronecker eigenbases (which the complement's terms need anyway), one product
        # per block with [V; Sigma_unit Q^T] rotated there (subspace Laplace: Q = W^T V^T)
        kept = W is None and self._is_kept_basis(features)
        dirs, K = self._feature_dirs(features, tau, self.lin.dtype, kept)
        for sl in _chunks(self.source, x, C):
            facs = self.source.factors(x[sl], dtype=self.lin.dtype)
            quad, P = self._terms(facs, tau, joint=False, dirs=dirs)
            phi = P[..., :K]
            gs.append(facs[0].to(_F64))
            phis.append(phi)
            covs.append(self._with_cross(quad, None if self.Q is None else P[..., K:],
                                         phi if W is None else phi @ W, tau))
        return torch.cat(gs), torch.cat(phis), mult * self._psd(covs)

    def _unit_chunk(self, factors, phi_o, tau):
        """``j_perp^T Sigma_unit j_perp`` of one chunk of points (before :meth:`_psd`)."""
        return self._with_cross(*self._terms(factors, tau, joint=False), phi_o, tau)

    def _with_cross(self, cov, JU, phi_o, tau):
        """``j^T Sigma j - 2 phi (Q Sigma j) + phi (Q Sigma Q^T) phi^T`` per point."""
        if JU is not None:
            QSQ = self._pieces(tau)[4]
            P = phi_o.to(_F64)
            cross = P @ JU.transpose(1, 2)
            cov = cov - cross - cross.transpose(1, 2) + P @ QSQ @ P.transpose(1, 2)
        return cov

    @staticmethod
    def _psd(parts):
        """The chunks' blocks, symmetrised and projected on the PSD cone."""
        cov = torch.cat(parts)
        cov = 0.5 * (cov + cov.transpose(1, 2))
        if cov.shape[-1] == 1:
            return cov.clamp_min(0.0)
        e, V = torch.linalg.eigh(cov)
        return (V * e.clamp_min(0.0)[:, None, :]) @ V.transpose(1, 2)

    def joint_covariance(self, x, phi_o, s0, s2):
        """The joint ``(B C, B C)`` covariance of ``j_perp^T Sigma j_perp`` across points."""
        mult, tau = self._key(s0, s2)
        QSQ = self._pieces(tau)[4]
        cov, JU = self._terms(self.source.factors(self.lin._input(x)), tau, joint=True)
        if JU is not None:
            B, C = JU.shape[:2]
            JU = JU.reshape(B * C, -1)
            P = phi_o.to(_F64).reshape(B * C, -1)
            cross = P @ JU.T
            cov = cov - cross - cross.T + P @ QSQ @ P.T
        return 0.5 * (cov + cov.T) * mult


# ------------------------------------------------------------------------------------
# (subspace Laplace) the factors' row sums as one pass of their own, to be shared
# ------------------------------------------------------------------------------------
def kfac_factor_sums(lin, data):
    """The KFAC factors' row sums over the training rows (:func:`_kfac_pass`, the pass
    :class:`KFACComplement` runs without ``sums``), computed once so that subspace
    Laplace's projector and its complement read the same KFAC.

    Parameters
    ----------
    lin : LinearizedNet
        The network (structured or graph Jacobian backend).
    data : FitData
        The training stream.

    Returns
    -------
    tuple
        ``sums`` for :class:`KFACComplement`.
    """
    return data.reduce(_kfac_pass, (lin, data.likelihood), min(data.batch_size, 1024))
