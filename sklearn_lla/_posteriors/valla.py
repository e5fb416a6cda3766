"""VaLLA: variational linearized Laplace (Ortega, Santana & Hernandez-Lobato, 2024).

LLA's predictive is the posterior of a GP with the network as its mean and the scaled
neural tangent kernel ``k((x, c), (z, c')) = s0^2 J_c(x) J_c'(z)^T`` as its kernel
(``J_c`` the gradient of output ``c`` w.r.t. the linearised parameters). VaLLA
approximates that GP by the fixed-mean sparse variational GP of
:mod:`sklearn_lla._posteriors.gp` (``M`` inducing pairs ``(z_m, c_m)`` and a triangular factor
``L``) and learns ``Z``, ``L``, ``log s0^2`` and ``log s2`` by minibatch Adam on the
alpha-energy (alpha = 1), stopping early on the validation NLL. Nothing here touches
more than one minibatch of the data per step, so a step costs the same for any N; with
``Z`` fixed (the default), each training row's kernel matrices are computed once per
fit and kept (:class:`~sklearn_lla._posteriors.valla_cache.RowCache`), so an epoch
after the first costs only the ``M x M`` algebra (on the digits CNN, 60 steps of 100
rows had recomputed 4.8 epochs of rows).

The kernel (:class:`NTKKernel`) is evaluated by the network's Jacobian backend:

* for chains of ``nn.Linear`` layers and elementwise maps by the layer-wise closed
  form ``sum_l (delta_l(x) . delta_l(z)) (a_l(x) . a_l(z) + 1)`` of the thesis'
  appendix "Efficient Kernel Computation for MLP" (``a_l`` a layer's input,
  ``delta_l`` the back-propagated output gradient at its pre-activation), written in
  differentiable torch operations so that autograd gives ``d/dZ`` (second
  derivatives of the activations) -- no Jacobian row is ever formed; the factors are
  in the network's dtype and each layer's products are combined in float64;
* for any other network from ``torch.func`` Jacobians: ``J(Z)`` (M x P, differentiable
  w.r.t. ``Z``) and the minibatch's ``J(x)`` in memory-bounded chunks.

Prediction precomputes what depends only on the fitted state: the inducing factors
for a backend with compact factored rows, or the parameter-space basis ``U = J(Z)^T
W^T`` (P x M, ``A = W^T W``) for the generic one and for rows with dense blocks (a
convolutional network's; :meth:`NTKKernel.predictor_method`), so ``Kxz W^T = s0^2
J(x) U`` is one evaluation of ``J(x)`` with ``M`` tangents (as ELLA's predict).
"""


from __future__ import annotations

import math

import numpy as np
import torch

from .._core.hyper import OBJECTIVE, Fixed, VariationalEnergy
from .._core.linalg import cholesky
from .._core.utils import torch_threads_released
from .complement import KFACComplement, supports_kfac_complement
from .gp import FixedMeanGPPosterior, Kernel
from .gp_algebra import (
    FIT_THREADS,
    alpha_energy,
    joint_cov,
    latent_cov,
    nystrom_blocks,
    subspace_gram,
    torch_threads,
    variational_terms,
)
from .valla_cache import RowCache
from .valla_complement import ComplementMixin

__all__ = ["NTKKernel", "VaLLAPosterior"]

_F64 = torch.float64

#: Training rows (at most) read by :meth:`VaLLAPosterior.start`.
START_ROWS = 2000
#: Largest ``rows x C x M`` cross-covariance :meth:`VaLLAPosterior.start` holds.
START_ELEMENTS = 1 << 22
#: ``complement="auto"``: the KFAC complement while ``P M C`` is at most this. Its
#: prediction pushes ``M`` tangents through the network per point (the KFAC cross
#: covariance of each point with the span, three times for the line of
#: :meth:`~sklearn_lla._posteriors.valla_complement.ComplementMixin._kfac_outside`):
#: 2,000 rows of a 3 x 200 MLP (P = 98,801, M = 300, P M = 3e7) took 133 s against the
#: diagonal's 1.1 s (one loaded core).
KFAC_MAX_WORK = 10_000_000
#: Relative jitter of ``Kzz`` in the optimal factor of :meth:`VaLLAPosterior.start`.
START_JITTER = 1e-6
class NTKKernel(Kernel):
    """The scaled NTK ``s0^2 J_c(x) J_c'(z)^T`` over (input, output index) pairs.

    Every product comes from the network's Jacobian backend (``lin.rows``,
    ``lin.cross_and_diag``, ...): per-layer factors for a structured network, dense
    rows otherwise.

    Parameters
    ----------
    lin : LinearizedNet
        The network.
    n_outputs : int
        ``C``.
    input_shape : tuple of int
        The shape of one input (inducing inputs are stored flat).
    prior_variance : float, default=1.0
        ``s0^2`` (the initial value when learned).
    learn_prior : bool, default=False
        Whether ``log s0^2`` is a trainable parameter.
    """

    def __init__(self, lin, n_outputs, input_shape, prior_variance=1.0, learn_prior=False):
        self.lin = lin
        self.n_outputs = int(n_outputs)
        self.input_shape = tuple(int(s) for s in input_shape)
        self.learn_prior = bool(learn_prior)
        self.log_prior_variance = torch.tensor(math.log(float(prior_variance)), dtype=_F64,
                                               device=lin.device, requires_grad=self.learn_prior)

    # -- interface -------------------------------------------------------------------
    def parameters(self):
        """``[log s0^2]`` when the prior variance is learned, else ``[]``."""
        return [self.log_prior_variance] if self.learn_prior else []

    @property
    def prior_variance(self):
        """``s0^2``."""
        return float(torch.exp(self.log_prior_variance.detach()))

    def _s0(self):
        return torch.exp(self.log_prior_variance)

    def _z_input(self, z):
        return z.reshape(z.shape[0], *self.input_shape)

    def _z_rows(self, z, cz, differentiable=None):
        """The rows ``grad g_cz[m](z_m)`` (differentiable w.r.t. ``z`` when it requires grad)."""
        diff = z.requires_grad if differentiable is None else differentiable
        return self.lin.rows(self._z_input(z), cz, differentiable=diff)

    def gram(self, z, cz):
        """``s0^2 J_cz(Z) J_cz(Z)^T`` (M, M), float64, differentiable w.r.t. ``Z``."""
        return self._s0() * self._z_rows(z, cz).cross_gram()

    def cross(self, x, z, cz):
        """``s0^2 J(x) J_cz(Z)^T`` of shape (B, C, M), float64."""
        return self.cross_and_diag(x, z, cz)[0]

    def diag_blocks(self, x):
        """``s0^2 J(x_b) J(x_b)^T`` of shape (B, C, C), float64."""
        return self._s0() * self.lin.ntk_diag_blocks(x)

    def cross_and_diag(self, x, z, cz):
        """``(cross(x, z, cz), diag_blocks(x))`` sharing the work on ``x``."""
        G, blocks = self.unit_cross_and_diag(x, z, cz)
        s0 = self._s0()
        return s0 * G, s0 * blocks

    def unit_cross_and_diag(self, x, z, cz):
        """``(J(x) J_cz(Z)^T, J(x_b) J(x_b)^T)``: :meth:`cross_and_diag` over ``s0^2``.

        With ``Z`` fixed the rows at ``Z`` are those of :meth:`_z_side` (computed
        once while ``z`` is the same, unmodified tensor).
        """
        with torch_threads_released():  # a pass of large products: every thread
            Fz = self._z_rows(z, cz) if z.requires_grad else self._z_side(z, cz)[0]
            return self.lin.cross_and_diag(x, Fz, self.n_outputs)

    def batch(self, x, z, cz):
        """``(Kzz, Kxz, Kxx)`` for a training step, evaluating the network at ``Z`` once.

        When ``Z`` is not being learned (no gradient), its rows (factors or dense)
        and ``Kzz / s0^2`` are computed on the first step and reused while ``z`` and
        ``cz`` are the same, unmodified tensors; and when the minibatch ``x`` is
        pinned to its training rows in a :class:`RowCache` (:attr:`row_cache`), the
        rows' matrices come from there (each computed once per fit).
        """
        s0 = self._s0()
        Fz, Kzz = self._z_side(z, cz)
        cache = self.__dict__.get("row_cache")
        t = None if cache is None or z.requires_grad else cache.rows_of(x)
        if t is None:
            Kxz, Kxx = self.lin.cross_and_diag(x, Fz, self.n_outputs)
        else:
            def compute(xs):
                kxz, kxx = self.lin.cross_and_diag(xs, Fz, self.n_outputs)
                with torch.no_grad():
                    return kxz, kxx, self.lin.forward(xs).double()

            Kxz, Kxx, _ = cache.fill(x, t, compute)
        return s0 * Kzz, s0 * Kxz, s0 * Kxx

    def _z_side(self, z, cz):
        """``(rows at Z, Kzz / s0^2)``, cached for a fixed ``Z``."""
        key = None
        if not z.requires_grad:
            key = (z.data_ptr(), z._version, tuple(z.shape), cz.data_ptr(), cz._version)
            cached = self.__dict__.get("_z_cache")
            if cached is not None and cached[0] == key:
                return cached[1], cached[2]
        Fz = self._z_rows(z, cz)
        Kzz = Fz.cross_gram()
        if key is not None:
            self._z_cache = (key, Fz, Kzz)
        return Fz, Kzz

    def __getstate__(self):
        state = dict(self.__dict__)
        state.pop("_z_cache", None)
        state.pop("row_cache", None)
        return state

    def joint(self, x):
        """``s0^2 J(x) J(x)^T`` over all outputs of all points, (B C, B C), float64."""
        return self._s0() * self.lin.kernel(x, n_outputs=self.n_outputs)

    # -- evaluation ------------------------------------------------------------------
    def mean_offset(self, z, cz):
        """``J_cz[m](z_m) theta_hat`` of shape (M,), float64, differentiable w.r.t. ``z``.

        The linearised network's offset from its prior mean at the inducing pairs
        (``g(x) = m0(x) + J(x) theta_hat``): the subspace model's mean term is its
        norm in the inducing pairs' RKHS.
        """
        lin = self.lin
        diff = bool(z.requires_grad and torch.is_grad_enabled())
        theta = {n: p.unsqueeze(0) for n, p in lin.params.items()}
        return self._z_rows(z, cz, diff).matmul(theta)[:, 0].to(_F64)

    def predictor_method(self, n_inducing, n_factor_rows):
        """The method of :meth:`predictor` with ``method="auto"``.

        ``"structured"`` pairs each point's ``C`` rows (``R = lin.row_elements()``
        elements each) with the ``M`` stored rows in float64, about ``C R M`` per
        point; ``"basis"`` pushes the factor's rows through ``J(x)`` as tangents in
        the network's dtype, about ``P`` per tangent and point. ``"basis"`` when the
        rows are not factored, or when ``C R > P`` (rows with dense blocks, as a
        convolutional network's in the graph backend) and the factor is ``W`` alone
        (``covariance="full"``: the prior block is ``Kxx``, which ``V V^T`` stays
        well below away from the inducing inputs, so products in the network's
        dtype cost no relative precision of the variance; the ``"subspace"`` model's
        ``Qxx - V V^T`` can cancel to zero and stays float64). On the digits CNN
        (P = 38,378, C = 10, M = 100; 1,080 points, one thread): 1.49 s CPU
        structured, 1.15 s basis, variances within 1.3e-6 relative.

        Parameters
        ----------
        n_inducing : int
            ``M``.
        n_factor_rows : int
            Rows of the factor the predictor folds in (``M``, or ``2M`` with the
            subspace model's ``chol(Kzz)^-1``).

        Returns
        -------
        {"structured", "basis"}
        """
        lin = self.lin
        if not lin.factored:
            return "basis"
        dense = self.n_outputs * lin.row_elements() > lin.n_params
        return "basis" if dense and n_factor_rows == n_inducing else "structured"

    def predictor(self, z, cz, W, method="auto"):
        """``x -> (Kxx blocks, Kxz W^T)`` with everything about ``Z`` precomputed.

        Parameters
        ----------
        z, cz : Tensor
            The fitted inducing inputs and output indices.
        W : Tensor of shape (M, M)
            ``A = W^T W``.
        method : {"auto", "structured", "basis"}, default="auto"
            ``"structured"``: the kernel against the stored inducing rows, kept as
            the backend's compact factors (``O(B C M width)`` per layer, float64).
            ``"basis"``: ``U = J(Z)^T W^T`` (P x M) and ``Kxz W^T = s0^2 J(x) U`` by
            one evaluation of ``J(x)`` with ``M`` tangents (``O(B P M)``, the
            network's dtype). ``"auto"``: :meth:`predictor_method`.

        Returns
        -------
        callable
            Thread-safe: it reads the precomputed tensors and never writes state.
        """
        if method not in ("auto", "structured", "basis"):
            raise ValueError(f"unknown predictor method {method!r}")
        lin, C = self.lin, self.n_outputs
        s0 = float(torch.exp(self.log_prior_variance.detach()))
        W = W.detach().to(_F64)
        zin = self._z_input(z.detach())
        if method == "auto":
            method = self.predictor_method(z.shape[0], W.shape[0])
        if lin.factored and method != "basis":
            with torch.no_grad():
                Fz = lin.rows(zin, cz)

            def predict(x):
                V, blocks = lin.cross_and_diag(x, Fz, C)
                return s0 * blocks, s0 * (V.reshape(-1, V.shape[-1]) @ W.T).view(
                    x.shape[0], C, -1)

            return predict
        if method == "structured":
            raise ValueError("the structured predictor needs a structured network")
        cz = torch.as_tensor(cz, device=zin.device)
        U = lin.gradient_rows_vjp(zin.to(lin.dtype), cz, W.T)  # K = M directions

        def predict(x):
            _, jv, blocks = lin.jvp_and_ntk_diag(x, U)  # one evaluation of J(x)
            return s0 * blocks, s0 * jv.to(_F64)

        return predict


class VaLLAPosterior(ComplementMixin, FixedMeanGPPosterior):
    """VaLLA: the fixed-mean sparse GP of :mod:`sklearn_lla._posteriors.gp` with the scaled NTK.

    The KL term is the complete ``KL(q(theta) || p(theta))`` of the weight-space
    Gaussian the sparse GP stands for, ``q(theta) = N(theta_hat, s0^2 I - s0^4 J_Z^T A
    J_Z)`` against the prior ``N(0, s0^2 I)``: the covariance part
    ``1/2 logdet Hm - 1/2 tr(Kzz A)`` of the shared engine **plus the mean part**
    ``||theta_hat||^2 / (2 s0^2)``. The papers drop the mean part (the mean is fixed),
    which leaves the objective decreasing as ``s0^2 -> 0`` (their Appendix D) and
    forces early stopping on held-out rows; with it ``s0^2`` has a finite optimum,
    at ``alpha = 0`` the one of a lower bound on LLA's Laplace evidence.

    Parameters
    ----------
    prior_variance : float or "auto", default="auto"
        ``s0^2``: fixed, or learned (``"auto"``), initialised at ``||theta_hat||^2 / P``.
    init : {"optimal", "identity"}, default="optimal"
        Where Adam starts: ``"optimal"`` (:meth:`start`), or the papers' ``L = I``
        with ``s0^2 = ||theta_hat||^2 / P`` and ``s2`` the network's mean squared
        training residual.
    complement : {None, "diagonal", "kfac", "auto"}, default=None
        With ``covariance="subspace"``, a posterior for the parameter directions
        outside the inducing pairs' span, added to the predictive (estimated once
        after the fit, at the fitted ``s0^2`` and likelihood). ``"kfac"``: the
        KFAC posterior projected onto the complement
        (:class:`~sklearn_lla._posteriors.complement.KFACComplement`, as ELLA's; needs
        factored Jacobians). ``"diagonal"``: the diagonal posterior of
        :class:`~sklearn_lla._posteriors.complement.DiagonalComplement` (any
        network; too wide once the data pin down directions the span misses, see
        ``docs/valla.md``). ``"auto"``: ``"kfac"`` where the network supports it
        and ``P M C`` is at most :data:`KFAC_MAX_WORK`, else ``"diagonal"``. The
        choice is in :attr:`complement_kind`.
    **kwargs
        The :class:`~sklearn_lla._posteriors.gp.FixedMeanGPPosterior` settings.
    """

    def __init__(self, prior_variance="auto", init="optimal", complement=None, **kwargs):
        super().__init__(**kwargs)
        self.prior_setting = prior_variance
        if init not in ("optimal", "identity"):
            raise ValueError(f"init must be 'optimal' or 'identity', got {init!r}")
        self.init = init
        if complement not in (None, "diagonal", "kfac", "auto"):
            raise ValueError("complement must be None, 'diagonal', 'kfac' or 'auto', got "
                             f"{complement!r}")
        if complement is not None and self.covariance != "subspace":
            raise ValueError(f"complement={complement!r} needs covariance='subspace' (the "
                             "'full' covariance keeps the prior in the complement)")
        self.complement = complement
        self.complement_kind = None

    def make_kernel(self, data, Z, cz):
        """The NTK kernel of ``data.lin``, with its initial prior variance."""
        lin = data.lin
        x0, _ = data.rows(np.arange(1))
        theta = lin.flat_params().to(_F64)
        self.theta_sq = float(theta @ theta)
        self.fixed_strategy = Fixed.name
        if isinstance(self.prior_setting, str):
            s0 = max(self.theta_sq / lin.n_params, 1e-8)
            # the family's objective: learned (regression) or the weight norm, kept
            objective = OBJECTIVE[("variational", data.likelihood.task)]
            learn = objective == VariationalEnergy.name
            if not learn:
                self.fixed_strategy = objective
        else:
            s0, learn = float(self.prior_setting), False
        self.initial_prior_variance = s0
        return NTKKernel(lin, data.n_outputs, x0.shape[1:], s0, learn)

    def _mean_kl(self, kernel, Z, cz, Kzz):
        """The mean part of the KL at ``Z`` (a tensor, differentiable).

        ``"full"``: ``||theta_hat||^2 / (2 s0^2)``. ``"subspace"``: the same for the
        part of ``theta_hat`` in the subspace, ``||P_Z theta_hat||^2 / (2 s0^2) =
        1/2 v^T Kzz^-1 v`` with ``v = J_Z theta_hat`` (``Kzz`` jittered as the model's).
        """
        if self.covariance == "full":
            return 0.5 * self.theta_sq * torch.exp(-kernel.log_prior_variance)
        v = self.__dict__.get("_v1")
        if v is None or Z.requires_grad:
            v = kernel.mean_offset(Z, cz)  # (M,)
            if not Z.requires_grad:  # fixed Z: a constant of the fit
                self._v1 = v
        chol = self.subspace_cholesky(kernel, Z, Kzz)
        w = torch.linalg.solve_triangular(chol, v[:, None], upper=False)
        return 0.5 * (w * w).sum()

    def subspace_cholesky(self, kernel, Z, Kzz):
        """``chol(Kzz)``; with ``Z`` fixed, one factorisation per fit.

        The NTK kernel is its prior variance times a fixed matrix, and so is the
        jittered ``Kzz`` (the jitter is relative to its mean diagonal): ``Kzz = s0^2
        K1``, ``chol(Kzz) = s0 chol(K1)``. ``K1``'s factor is taken at the first step
        and scaled at every later one (a step then differentiates one scalar product
        instead of a Cholesky factorisation; with the mean term's offset ``v = J_Z
        theta_hat`` kept too, 7 of 30 ms per step at ``M = 300``).
        """
        if Z.requires_grad:
            return super().subspace_cholesky(kernel, Z, Kzz)
        s0 = kernel._s0()
        chol1 = self.__dict__.get("_chol1")
        if chol1 is None:
            chol1 = self._chol1 = cholesky((Kzz / s0).detach(), "inducing kernel matrix",
                                           warn=False)
        return torch.sqrt(s0) * chol1

    def extra_loss(self, *, x, y, n_total, kernel, Kzz, terms, Kxx, Kxz, cov, noise):
        """The mean part of the KL (:meth:`_mean_kl`), per training row.

        A constant when nothing it depends on is learned (``"full"`` with a fixed
        ``s0^2``): then omitted from the loss (the reported ``kl`` includes it).
        """
        if self.covariance == "full" and not kernel.learn_prior:
            return None
        return self._mean_kl(kernel, self._Z_fit, self._cz_fit, Kzz) / n_total

    def fit(self, data):
        """Learn ``Z``, ``L``, ``s0^2`` and ``s2`` (see the class docstring)."""
        super().fit(data)
        with torch.no_grad():
            Kzz = self.kernel.gram(self._Z, self._cz)
            if self.covariance == "subspace":
                Kzz = subspace_gram(Kzz)
            mean_kl = float(self._mean_kl(self.kernel, self._Z, self._cz, Kzz))
        self.hyper_trace = {**self.hyper_trace, "kl": float(self._kl) + mean_kl,
                            "kl_covariance": float(self._kl), "kl_mean": mean_kl,
                            "start": self.start_trace}
        for name in ("_Z_fit", "_cz_fit", "_chol1", "_v1"):
            self.__dict__.pop(name, None)
        self.kernel.__dict__.pop("_z_cache", None)
        self.kernel.__dict__.pop("row_cache", None)  # (the complement reads it below)
        self._complement = None
        kind = self.complement
        if kind == "auto":
            work = self._lin.n_params * self._Z.shape[0] * data.n_outputs
            kind = ("kfac" if supports_kfac_complement(self._lin) and work <= KFAC_MAX_WORK
                    else "diagonal")
        if kind == "kfac" and not supports_kfac_complement(self._lin):
            raise ValueError("complement='kfac' needs factored Jacobians (a chain of "
                             "nn.Linear layers and elementwise maps); use 'diagonal'")
        self.complement_kind = kind
        if kind == "diagonal":
            with torch_threads(FIT_THREADS):
                self._complement = self._fit_complement(data)
            self.hyper_trace["complement"] = self._complement.trace()
        elif kind == "kfac":
            with torch_threads(FIT_THREADS):
                self._complement = self._fit_kfac_complement(data)
            self.hyper_trace["complement"] = {
                "kind": "kfac", "outside_fraction": self._complement.outside_fraction,
                "scale": self._complement.scale}
        self.kernel.__dict__.pop("_z_cache", None)  # (the complement's rows at Z)
        self.__dict__.pop("_row_cache", None)
        return self

    def _prior_and_v(self, x):
        """The engine's ``(prior blocks, Kxz W^T)``; with the complement, the prior is
        ``Qxx`` plus the complement's ``S_perp``."""
        with torch_threads_released():  # J(x)'s rows: large products, every thread
            return self._prior_and_v_rows(x)

    def _prior_and_v_rows(self, x):
        comp = self.__dict__.get("_complement")
        if comp is None:
            return super()._prior_and_v(x)
        Kxx, V = self._predict_fn(x)
        V, m = V.double(), self._n_w
        U = V[..., m:]
        Q = U @ U.transpose(-1, -2)
        if isinstance(comp, KFACComplement):
            s0 = self.kernel.prior_variance
            S, _ = self._kfac_outside(comp, x, U / math.sqrt(s0))
            R = torch.diagonal(Kxx.double() - Q, dim1=1, dim2=2) / s0
            top = (self._complement_floor(x, U, R) - torch.diagonal(S, dim1=1, dim2=2))
            return Q + S + torch.diag_embed(top.clamp_min(0.0)), V[..., :m]
        residual = (Kxx.double() - Q) / self.kernel.prior_variance
        residual = 0.5 * (residual + residual.transpose(-1, -2))
        return Q + comp.blocks(comp.inverse_precision(self._lin, x), residual), V[..., :m]

    def start(self, data, kernel, Z, cz, L_raw, log_noise):
        """Start at the optimum for the k-means inducing points (Proposition 3).

        On a seeded subset of at most :data:`START_ROWS` training rows (scaled to the
        full ``N``), with ``Phi = (N / n) sum_n Kzn Lam_n Knz``, ``Lam_n`` the
        likelihood's curvature at ``g(x_n)`` (``I / s2`` for regression, the softmax
        Hessian for classification):

        * ``L = chol(B)``, ``B = Kzz^-1 Phi Kzz^-1``: the papers' optimal factor
          (Proposition 3; exact for the alpha = 0 Gaussian objective, the
          Laplace / GGN sites otherwise). ``B`` does not depend on ``s0^2`` and scales
          as ``1 / s2``; it is formed as ``R^T R`` from a QR factorisation (no
          squared condition number), ``Kzz`` jittered (:data:`START_JITTER`, or the
          subspace model's own jitter);
        * then the learned ``log s0^2`` (and ``log s2``) minimise the objective on the
          subset with ``L`` following ``s2`` (L-BFGS-B on one or two scalars: every
          kernel matrix is linear in ``s0^2``).

        Adam then refines everything from there instead of starting thousands of steps
        away (``L = I`` against entries of order ``sqrt(N / (M s2))``; ``s0^2`` at
        ``||theta||^2 / P``, a factor 5 to 200 from the optimum on the calibration
        sets and the gap toy).
        """
        self._Z_fit, self._cz_fit = Z, cz  # what extra_loss evaluates the mean term at
        self._chol1 = self._v1 = None  # the fixed-Z constants of this fit
        self._row_cache = None
        if not Z.requires_grad and RowCache.fits(data.n_samples, data.n_outputs, Z.shape[0]):
            self._row_cache = RowCache(data.n_samples, data.n_outputs, Z.shape[0], Z.device)
        kernel.row_cache = self._row_cache
        if self.init == "identity":
            self.start_trace = {"init": "identity"}
            return
        C, M, N = data.n_outputs, Z.shape[0], data.n_samples
        n = int(min(N, START_ROWS, max(1, START_ELEMENTS // max(1, C * M))))
        perm = np.random.default_rng(self.random_state + 1).permutation(N)
        idx = np.sort(perm[:n])
        # the monitor scores rows the start did not fit, when there are any
        idx_mon = np.sort(perm[n:2 * n]) if N > n else idx
        sub = self._start_factor(data, kernel, Z, cz, idx)
        gen = torch.Generator().manual_seed(self.random_state + 2)
        sub["elik"] = self._energy_likelihood(data.likelihood)
        sub["eps"] = None
        if self._needs_eps(sub["elik"]):
            sub["eps"] = torch.randn((self.n_energy_samples, n, C), generator=gen,
                                     dtype=_F64).to(sub["mean"].device)
        trace = self._start_search(data, kernel, L_raw, log_noise, sub)
        trace["rows"] = n
        self.start_trace = trace
        if not Z.requires_grad:  # Z stays: precompute the monitor's kernel matrices
            self._monitor_cache(data, kernel, Z, cz, idx, idx_mon, sub, gen)
            trace["monitor_rows"] = len(idx_mon)

    def _start_factor(self, data, kernel, Z, cz, idx):
        """The optimal factor ``L1`` (at unit ``kappa``) on the start rows ``idx``, with
        the kernel matrices there in units of ``s0^2`` (see :meth:`start`)."""
        lik = data.likelihood
        regression = lik.task == "regression"
        subspace = self.covariance == "subspace"
        C, M, N, n = data.n_outputs, Z.shape[0], data.n_samples, len(idx)
        s0 = kernel.prior_variance
        with torch.no_grad():
            # every kernel matrix in units of s0^2
            Kzz = kernel.gram(Z, cz) / s0 if Z.requires_grad else kernel._z_side(Z, cz)[1]
            Kxz, Kxx, mean, y = self._rows_matrices(data, kernel, Z, cz, idx)
            eye = torch.eye(M, dtype=_F64, device=Kzz.device)
            Kj = subspace_gram(Kzz) if subspace else Kzz
            Lk = cholesky(
                Kj if subspace else Kzz + START_JITTER * float(Kzz.diagonal().mean()) * eye,
                "inducing kernel matrix", warn=False)
            # G = stacked Lam_n^(1/2)^T Kxz[n] (n C, M), Phi = (N / n) G^T G;
            # B = Kzz^-1 Phi Kzz^-1 = F F^T with F = Kzz^-1 G^T, and L = R^T from F^T = Q R
            G = Kxz if regression else lik.lam_factor(mean).transpose(1, 2) @ Kxz
            G = G.reshape(n * C, M) * math.sqrt(N / n)
            F = torch.cholesky_solve(G.T.contiguous(), Lk)
            R = torch.linalg.qr(F.T, mode="r").R
            if R.shape[0] < M:  # fewer rows than inducing pairs: B has low rank
                R = torch.cat([R, R.new_zeros(M - R.shape[0], M)])
            L1 = R.T * torch.where(torch.diagonal(R) < 0, -1.0, 1.0)[None, :]
            prior1 = nystrom_blocks(Kxz, Lk) if subspace else Kxx
            if subspace:
                # v = J_Z theta_hat does not scale with s0^2: 1/2 v^T (s0^2 Kzz)^-1 v
                w = torch.linalg.solve_triangular(Lk, kernel.mean_offset(Z, cz)[:, None],
                                                  upper=False)
                mean_kl1 = 0.5 * float((w * w).sum())  # the mean term times s0^2
            else:
                mean_kl1 = 0.5 * self.theta_sq
        return dict(s0=s0, Kj=Kj, Lk=Lk, L1=L1, prior1=prior1, Kxz=Kxz, mean=mean, y=y,
                    mean_kl1=mean_kl1)

    def _start_search(self, data, kernel, L_raw, log_noise, sub):
        """L-BFGS-B on ``log kappa`` (and the learned ``log s0^2``, ``log s2``) on the
        start rows, written back into the kernel, ``log_noise`` and ``L_raw``."""
        from scipy.optimize import minimize as scipy_minimize

        regression = data.likelihood.task == "regression"
        learn_s0, learn_s2 = kernel.learn_prior, log_noise is not None
        N = data.n_samples
        s0, Kj, L1, prior1, Kxz = sub["s0"], sub["Kj"], sub["L1"], sub["prior1"], sub["Kxz"]
        mean, y, mean_kl1, elik, eps = (sub["mean"], sub["y"], sub["mean_kl1"], sub["elik"],
                                        sub["eps"])
        fixed_s2 = float(self.noise_variance) if regression and not learn_s2 else None
        ls2_0 = (float(log_noise.detach()) if learn_s2 else
                 math.log(fixed_s2) if regression else 0.0)
        # u = [log kappa, (log s0^2), (log s2)]: L = kappa^(1/2) L1, kappa = 1 / s2 the
        # exact optimum of the alpha = 0 Gaussian case, 1 the Laplace sites otherwise
        u0 = [-ls2_0] + ([math.log(s0)] if learn_s0 else []) + ([ls2_0] if learn_s2 else [])

        def unpack(u):
            ls0 = u[1] if learn_s0 else torch.tensor(math.log(s0), dtype=_F64)
            if not regression:
                return u[0], ls0, None
            return u[0], ls0, u[-1] if learn_s2 else torch.tensor(ls2_0, dtype=_F64)

        def factor(lk):
            return L1 * torch.exp(0.5 * lk)

        @torch.enable_grad()
        def objective(uv):
            u = torch.tensor(uv, dtype=_F64, requires_grad=True)
            lk, ls0, ls2 = unpack(u)
            s0_ = torch.exp(ls0)
            terms = variational_terms(s0_ * Kj, factor(lk))
            cov = latent_cov(s0_ * prior1, (s0_ * Kxz) @ terms.W.T)
            e = alpha_energy(elik, mean, cov, y, alpha=self.alpha,
                             noise=None if ls2 is None else torch.exp(ls2), eps=eps)
            loss = -e.mean() + (terms.kl + mean_kl1 / s0_) / N
            loss.backward()
            v = float(loss.detach())
            if not math.isfinite(v):
                return 1e300, np.zeros(len(uv))
            return v, u.grad.numpy().copy()

        trace = {}
        u = np.asarray(u0, dtype=np.float64)
        res = scipy_minimize(objective, u, jac=True, method="L-BFGS-B",
                             bounds=[(v - 25.0, v + 25.0) for v in u],
                             options={"maxiter": 200})
        u = res.x
        trace.update(objective=float(res.fun), converged=bool(res.success),
                     n_evaluations=int(res.nfev))
        with torch.no_grad():
            lk, ls0, ls2 = unpack(torch.as_tensor(u, dtype=_F64))
            if learn_s0:
                kernel.log_prior_variance.copy_(ls0)
            if learn_s2:
                log_noise.copy_(ls2)
            L_raw.copy_(factor(lk))
        trace["prior_variance"] = kernel.prior_variance
        trace["factor_scale"] = float(torch.exp(lk))
        if ls2 is not None:
            trace["noise_variance"] = float(torch.exp(ls2))
        return trace

    def _monitor_cache(self, data, kernel, Z, cz, idx, idx_mon, sub, gen):
        """The monitor's kernel matrices on ``idx_mon`` (fixed ``Z``: computed once)."""
        Kxz, prior1, mean, y, eps = sub["Kxz"], sub["prior1"], sub["mean"], sub["y"], sub["eps"]
        if idx_mon is not idx:
            with torch.no_grad():
                # in units of the kernel's prior variance now (the start has set it):
                # K(s0_new) / s0_new, as Kzz / s0 above was K(s0) / s0
                Kxz, Kxx, mean, y = self._rows_matrices(data, kernel, Z, cz, idx_mon)
                prior1 = (nystrom_blocks(Kxz, sub["Lk"]) if self.covariance == "subspace"
                          else Kxx)
            if eps is not None:
                eps = torch.randn((self.n_energy_samples, len(idx_mon), data.n_outputs),
                                  generator=gen, dtype=_F64).to(mean.device)
        self._subset = dict(Kj=sub["Kj"], prior=prior1, Kxz=Kxz, mean=mean, y=y, eps=eps,
                            elik=sub["elik"], mean_kl=sub["mean_kl1"], n_total=data.n_samples)

    def _rows_matrices(self, data, kernel, Z, cz, idx):
        """``(Kxz, Kxx) / s0^2``, ``g`` and ``y`` at training rows ``idx`` (no graph),
        kept in the fit's :class:`RowCache` when there is one."""
        ys, Kxz, Kxx, means = [], [], [], []
        for i in range(0, len(idx), 256):
            x, y = data.rows(idx[i:i + 256])
            kxz, kxx = kernel.unit_cross_and_diag(x, Z, cz)
            Kxz.append(kxz)
            Kxx.append(kxx)
            means.append(self._mean(data.lin, x))
            ys.append(y)
        out = tuple(torch.cat(t) for t in (Kxz, Kxx, means, ys))
        cache = kernel.__dict__.get("row_cache")
        if cache is not None:
            cache.put(idx, *out[:3])
        return out

    def training_batches(self, data, generator):
        """The minibatches of :func:`~sklearn_lla._core.optim.minibatches` (the same
        draws), each pinned to its training rows in the fit's :class:`RowCache` when
        there is one (``Z`` fixed and the rows' matrices within
        :data:`~sklearn_lla._posteriors.valla_cache.ROW_CACHE_ELEMENTS`)."""
        cache = self.__dict__.get("_row_cache")
        if cache is None or not hasattr(data, "minibatches"):
            yield from super().training_batches(data, generator)
            return
        for x, y, idx in data.minibatches(self.batch_size, generator, with_index=True):
            cache.pin(x, idx)
            yield x, y

    def _mean(self, lin, x):
        cache = self.__dict__.get("_row_cache")
        t = None if cache is None else cache.rows_of(x)
        if t is not None and bool(cache.done[t].all()):
            return cache.mean[t]
        return super()._mean(lin, x)

    def monitor(self, kernel, Z, cz, L_raw, noise):
        """The objective on a fixed subset of the training rows, exactly (``Z`` fixed).

        The subset holds up to :data:`START_ROWS` rows that :meth:`start` did not use
        (all rows when ``N`` is at most that): an unbiased estimate of the objective
        that does not favour the start. Every kernel matrix of the subset is linear in
        ``s0^2`` and ``Z`` does not move, so a check only redoes the ``M x M`` algebra
        and the energy with the current ``s0^2``, ``L`` and ``s2`` (Monte Carlo draws
        fixed): a score without minibatch noise, compared with ``tol``. With learned
        inducing inputs (or ``init="identity"``), the minibatch loss averaged between
        checks.
        """
        sub = self.__dict__.pop("_subset", None)
        if sub is None:
            return "loss"

        def score():
            s0 = torch.exp(kernel.log_prior_variance)
            terms = variational_terms(s0 * sub["Kj"], L_raw)
            cov = latent_cov(s0 * sub["prior"], (s0 * sub["Kxz"]) @ terms.W.T)
            e = alpha_energy(sub["elik"], sub["mean"], cov, sub["y"], alpha=self.alpha,
                             noise=noise(), eps=sub["eps"])
            return float((-e.mean() + (terms.kl + sub["mean_kl"] / s0) / sub["n_total"])
                         .detach())

        return score

    def predict_joint(self, x):
        """Mean (B, C) and joint latent covariance ``Kxx - Kxz A Kzx`` (B C, B C).

        With ``covariance="subspace"`` the prior block is the Nystrom ``Qxx``.
        """
        with torch_threads(FIT_THREADS), torch.no_grad():
            mean = self._mean(self._lin, x)
            _, V = self._predict_fn(x)
            V = V.reshape(-1, V.shape[-1]).to(_F64)
            m = self._n_w
            if V.shape[-1] == m:
                K = self.kernel.joint(x)
            else:
                U, V = V[:, m:], V[:, :m]
                K = U @ U.T
            comp = self.__dict__.get("_complement")
            if isinstance(comp, KFACComplement):
                s0 = self.kernel.prior_variance
                phi = U.reshape(x.shape[0], -1, U.shape[-1]) / math.sqrt(s0)
                _, t = self._kfac_outside(comp, x, phi)
                S = comp.joint_covariance(x, t[:, None, None] * phi, s0,
                                          self._noise_or_none())
                R = torch.diagonal(self.kernel.joint(x) - K) / s0
                floor = self._complement_floor(x, phi * math.sqrt(s0),
                                               R.reshape(x.shape[0], -1)).reshape(-1)
                K = K + S + torch.diag((floor - torch.diagonal(S)).clamp_min(0.0))
            elif comp is not None:
                R = (self.kernel.joint(x) - K) / self.kernel.prior_variance
                K = K + comp.joint(comp.inverse_precision(self._lin, x), 0.5 * (R + R.T))
        return mean, joint_cov(K, V)
