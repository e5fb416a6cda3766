"""FMGP's classification step with its gradient in closed form (one autograd node).

:class:`~sklearn_lla._posteriors.fmgp_cross.FactoredObjective`'s lean loss (the
classification kernel with ``delta="class"`` and free inducing features, the full
covariance, the probit energy at alpha = 1, a categorical likelihood) is a few large
products and one Cholesky, but differentiated by autograd it is some 350 graph nodes
per step, whose bookkeeping cost several times the products on the digits CNN. Here
the loss and the gradient of every parameter are computed together, in float64 and in
closed form, and handed to the loop as one :class:`torch.autograd.Function` whose
backward returns them: the same numbers as autograd's to round-off
(``tests/test_fmgp_fused.py`` checks both against autograd and finite differences).

The gradient, with ``X`` the (B C, M) cross covariances (kept factored, see
:class:`~sklearn_lla._posteriors.fmgp_cross.ClassCross`), ``L = tril(L_raw)``,
``H = I + L^T K L = Lc Lc^T``, ``W = Lc^-1 L^T`` (``A = W^T W``) and the loss
``f(W, K) + c KL``, ``c = 2 / N`` with ``Q*`` (``1 / N`` without):

* the energies give ``G_var`` and ``G_m*`` (B, C), through the probit link
  ``softmax(f / sqrt(1 + pi v / 8))``; ``V = X W^T`` gets ``-2 G_var V``, and one
  batched product back through the factors gives ``dW`` and ``X^T G_m*``;
* with ``G = dW - c W K`` and ``S = sym(G W^T)``: ``dL = tril((G^T - K W^T S + c K W^T)
  Lc^-1)`` and ``dK = -1/2 W^T S W`` (the KL's ``1/2 c A`` terms cancel), since the
  data terms read ``W`` through ``A`` only;
* ``Q*``'s weights ``a = (K + eps I)^-1 q_mu``: ``b = (K + eps I)^-1 (X^T G_m* + K a / N)``,
  ``dq_mu = b``, ``dK += K a a^T / (2N)`` terms and ``-sym(b a^T)`` (with ``eps``'s
  share on the diagonal);
* ``dK`` then flows through ``K = a RBF B[cz, cz] (psi psi^T / s + [cz = cz])`` to the
  length scales, the amplitude, ``L_B`` and the inducing rows ``[z, psi]``, as does
  the data side's ``R`` and ``Q``.
"""

from __future__ import annotations

import math

import torch

from .._core.linalg import cholesky
from .kernels import ClassificationKernel

__all__ = ["FUSED_STEPS", "fused_applies", "fused_loss"]

_F64 = torch.float64

#: The classification step's gradient in closed form (:func:`fused_loss`) where it
#: applies (:func:`fused_applies`); ``False``: autograd through the factored loss
#: (the same numbers to round-off; for tests).
FUSED_STEPS = True


def fused_applies(post, objective, likelihood):
    """Whether :func:`fused_loss` computes ``objective``'s lean loss.

    The classification kernel itself with ``delta="class"`` and free inducing features
    (the default), a categorical likelihood at temperature 1 (the probit link), and the
    lean factored step (see :class:`~sklearn_lla._posteriors.fmgp_cross.FactoredObjective`).
    """
    from .._core.likelihoods import Categorical

    k = objective.kernel
    return (FUSED_STEPS and objective.lean and type(k) is ClassificationKernel
            and k.delta == "class" and k._free and k.n_inputs < objective.Z.shape[1]
            and type(likelihood) is Categorical and likelihood.link_approx == "probit"
            and getattr(likelihood, "temperature", 1.0) == 1.0
            and getattr(likelihood, "covariance_scale", 1.0) == 1.0)


class _Fused(torch.autograd.Function):
    """The loss, with the gradients computed alongside it returned by ``backward``."""

    @staticmethod
    def forward(ctx, step, *params):
        loss, grads = step()
        ctx.grads = grads
        return loss

    @staticmethod
    def backward(ctx, grad_out):
        grads = ctx.grads
        del ctx.grads
        return (None, *[None if g is None else grad_out * g for g in grads])


def _grouped(F, groups, C):
    """(B, M) -> (C, B, G): each class's columns (``groups``: see ``class_groups``)."""
    B = F.shape[0]
    if groups is None:
        return F.reshape(B, C, -1).transpose(0, 1)
    return torch.cat([F, F.new_zeros(B, 1)], 1)[:, groups].transpose(0, 1)


def _ungrouped(Fg, groups, M):
    """The adjoint of :func:`_grouped`: (C, B, G) -> (B, M), padding dropped."""
    C, B, G = Fg.shape
    flat = Fg.transpose(0, 1).reshape(B, C * G)
    if groups is None:
        return flat.contiguous()
    out = flat.new_zeros(B, M + 1)
    out.index_add_(1, groups.reshape(-1), flat)
    return out[:, :M]


def _sq_backward(Gd, a, b):
    """Gradients of ``sum(Gd * sq(a, b))`` in ``a`` and ``b`` (``sq``: squared distances)."""
    da = 2.0 * Gd.sum(1, keepdim=True) * a - 2.0 * (Gd @ b)
    db = 2.0 * Gd.sum(0)[:, None] * b - 2.0 * (Gd.T @ a)
    return da, db


def _probit_energy(f, var, y):
    """Per-point ``log softmax(f / sqrt(1 + pi v / 8))[y]`` and its gradients in ``f``, ``v``."""
    den = torch.sqrt(1.0 + math.pi / 8.0 * var)
    p = torch.softmax(f / den, dim=-1)
    yi = y.long().reshape(-1, 1)
    picked = p.gather(-1, yi).squeeze(-1)
    tiny = torch.finfo(p.dtype).tiny
    e = torch.log(picked.clamp_min(tiny))
    du = -p
    du.scatter_add_(1, yi, torch.ones_like(picked)[:, None])
    du = du * (picked >= tiny).to(p.dtype)[:, None]  # the clamp's mask
    df = du / den
    dvar = du * f * (-math.pi / 16.0) / (den * den * den)
    return e, df, dvar


def fused_loss(post, objective, batch):
    """The lean factored loss of one minibatch, differentiable in closed form.

    The same value as :meth:`FactoredObjective.loss
    <sklearn_lla._posteriors.fmgp_cross.FactoredObjective.loss>` and the same gradients
    (to float64 round-off) for ``L_raw``, the kernel's learned tensors, ``q_mu`` (with
    ``Q*``) and the inducing rows ``Z``.

    Parameters
    ----------
    post : FMGPPosterior
        The posterior being fitted (``_groups``, ``q_mu``, ``mean_regularizer``).
    objective : FactoredObjective
        The live tensors of the fit.
    batch : tuple of Tensor
        The minibatch ``(x, y)``.

    Returns
    -------
    Tensor
        A scalar whose ``backward`` accumulates the gradients.
    """
    kernel, data = objective.kernel, objective.data
    x, y = batch
    Z, L_raw = objective.Z, objective.L_raw
    log_ls, log_amp, L_B = kernel.log_length_scale, kernel.log_amplitude, kernel.L_B
    qstar = post.mean_regularizer
    q_mu = post.q_mu if qstar else None
    inputs = (L_raw, log_ls, log_amp, L_B, q_mu, Z)
    need = [t is not None and t.requires_grad for t in inputs]

    consts = getattr(objective, "_fused_constants", None)
    if consts is None:
        M = Z.shape[0]
        consts = objective._fused_constants = _Constants(objective.cz, post._groups,
                                                         kernel.n_outputs, M)

    def step():
        with torch.no_grad():
            return _loss_and_grads(post, kernel, data, x, y, Z, objective.cz, L_raw, q_mu,
                                   need, consts)

    return _Fused.apply(step, *[t if t is not None else torch.empty(0) for t in inputs])


class _Constants:
    """What a fit's steps share: the inducing pairs' class structure, ``I``."""

    def __init__(self, cz, groups, C, M):
        dev = cz.device
        self.M, self.C = M, C
        self.groups = None if groups is None else groups.to(dev)
        self.G = None if groups is None else int(groups.shape[1])
        self.eye = torch.eye(M, dtype=_F64, device=dev)
        self.same = (cz[:, None] == cz[None, :]).to(_F64)
        self.onehot = (torch.arange(C, device=dev)[:, None] == cz[None, :]).to(_F64)
        self.cz = cz
        self._gram = None

    def features_gram(self, psi_z, s, fixed):
        """``s psi_z psi_z^T + [cz = cz']``, computed once when ``psi_z`` is not trained."""
        if fixed and self._gram is not None:
            return self._gram
        gram = s * (psi_z @ psi_z.T) + self.same
        self._gram = gram if fixed else None
        return gram

    def expand(self, Bm):
        """``B[cz][:, cz]`` (M, M)."""
        if self.groups is None:
            C, G = self.C, self.M // self.C
            return Bm[:, None, :, None].expand(C, G, C, G).reshape(self.M, self.M)
        return Bm[self.cz][:, self.cz]

    def reduce(self, F):
        """The adjoint of :meth:`expand`: ``sum_{cz_m = c, cz_n = d} F[m, n]`` (C, C)."""
        if self.groups is None:
            C = self.C
            return F.reshape(C, self.M // C, C, -1).sum((1, 3))
        return self.onehot @ F @ self.onehot.T


def _loss_and_grads(post, kernel, data, x, y, Zp, cz, L_raw, q_mu, need, consts):
    # -- forward (the operations of ``step_factors`` and ``FactoredObjective.loss``) --
    D = kernel.n_inputs
    z, psi_z = Zp[:, :D], Zp[:, D:]
    M = Zp.shape[0]
    dist = kernel._dist
    s = kernel.feature_scale
    amp_log = kernel.log_amplitude
    inv_ls = torch.exp(-kernel.log_length_scale)
    zs = (z - dist.center) * inv_ls  # ``dist.scale(z)``
    zz = (zs * zs).sum(-1)
    Kq = torch.exp(amp_log - 0.5 * (zz[:, None] + zz[None, :] - 2.0 * zs @ zs.T).clamp_min(0.0))
    LD = consts.features_gram(psi_z, s, fixed=not need[5])  # psi psi^T s + [cz = cz]
    Bm = kernel._B()
    C = Bm.shape[0]
    Bp = consts.expand(Bm)
    KB = Kq * Bp
    K = KB * LD
    _, psi_x = kernel.features_(x)
    psi_x = psi_x.to(_F64)
    xs = (x.to(_F64).reshape(len(x), -1) - dist.center) * inv_ls  # ``dist.scale(x)``
    Q = torch.exp(amp_log - 0.5 * ((xs * xs).sum(-1)[:, None] + zz[None, :]
                                   - 2.0 * xs @ zs.T).clamp_min(0.0))
    linx = s * (psi_x @ psi_z.T)
    R = Q * linx
    groups = consts.groups
    L = torch.tril(L_raw)
    eye = consts.eye
    H = eye + L.T @ K @ L
    Lc = cholesky(H, "variational matrix I + L^T Kzz L", warn=False)
    W = torch.linalg.solve_triangular(Lc, L.T, upper=False)
    WK = W @ K
    kl = torch.log(torch.diagonal(Lc)).sum() - 0.5 * (WK * W).sum()
    T = W.T
    if q_mu is not None:
        jit = 1e-3 * torch.diagonal(K).mean()
        chol_j = cholesky(K + jit * eye, "regularised inducing Gram matrix", warn=False)
        a = torch.cholesky_solve(q_mu.reshape(M, 1), chol_j).reshape(M)
        T = torch.cat([T, a[:, None]], 1)
    Kc = T.shape[1]
    B = R.shape[0]
    Rg = _grouped(R, groups, C).contiguous()  # (C, B, G)
    diagB = torch.diagonal(Bm)
    Qg0 = _grouped(Q, groups, C).contiguous()
    Qg = Qg0 * diagB[:, None, None]
    Tg = (T.reshape(C, -1, Kc) if groups is None  # (C, G, Kc)
          else torch.cat([T, T.new_zeros(1, Kc)])[groups])
    TR = torch.bmm(Rg, Tg).reshape(C, B * Kc)
    VA = torch.bmm(Qg, Tg)
    VA.view(C, B * Kc).addmm_(Bm, TR)  # + the classes' mixing, in place
    V = VA[..., :M]  # (C, B, M): class-major, as the products give it
    h = s * (psi_x * psi_x).sum(-1) + 1.0  # (B,)
    pv = torch.exp(amp_log) * diagB[None] * h[:, None]
    var_raw = pv - (V * V).sum(-1).T
    var = var_raw.clamp_min(0.0)
    g = post._mean(data.lin, x)
    N = data.n_samples
    e, _, dvar = _probit_energy(g, var, y)
    loss = -e.mean() + kl / N
    Gv = dvar
    Gm = None
    if q_mu is not None:
        e_s, dm, dvar_s = _probit_energy(VA[..., M].T, var, y)
        loss = loss + (-e_s.mean() + (kl + 0.5 * (a @ (K @ a))) / N)
        Gv = Gv + dvar_s
        Gm = dm * (-1.0 / B)
    Gv = torch.where(var_raw >= 0, Gv, 0.0) * (-1.0 / B)
    # -- backward: the cross products, class-major (C, B, Kc) -----------------------
    # (C, B, Kc) buffers are reused: VA becomes d VA, TR becomes d TR
    dTQ = VA
    dTQ[..., :M].mul_((-2.0 * Gv).T[..., None])
    if Gm is not None:
        dTQ[..., M] = Gm.T
    dVc = dTQ.view(C, B * Kc)
    dBm = dVc @ TR.T  # sum_{b,k} dV[c, b, k] TR[d, b, k]
    dTR = torch.mm(Bm.T.contiguous(), dVc, out=TR).view(C, B, Kc)
    TgT = Tg.transpose(1, 2)
    dQg_s = torch.bmm(dTQ, TgT)  # d(Qg * diagB), (C, B, G)
    ddiagB = (dQg_s * Qg0).sum((1, 2))
    dQ = _ungrouped(dQg_s * diagB[:, None, None], groups, M)
    dR = _ungrouped(torch.bmm(dTR, TgT), groups, M)
    dTg = torch.bmm(Rg.transpose(1, 2), dTR) + torch.bmm(Qg.transpose(1, 2), dTQ)
    if groups is None:
        dT = dTg.reshape(M, Kc)
    else:
        dT = dTg.new_zeros(M + 1, Kc).index_add_(0, groups.reshape(-1),
                                                 dTg.reshape(-1, Kc))[:M]
    # prior variances
    ddiagB = ddiagB + Gv.T @ (torch.exp(amp_log) * h)
    dlog_amp = (Gv * pv).sum()
    # -- the factor: W = Lc^-1 L^T, the KL ------------------------------------------
    c_kl = (2.0 if q_mu is not None else 1.0) / N
    G = dT[:, :M].T - c_kl * WK
    S = G @ W.T
    S = 0.5 * (S + S.T)
    KWt = WK.T
    dL = torch.linalg.solve_triangular(Lc, G.T - KWt @ S + c_kl * KWt, upper=False,
                                       left=False)
    dK = (W.T @ S @ W) * -0.5
    dq = None
    if q_mu is not None:
        abar = dT[:, M] + (K @ a) / N
        bq = torch.cholesky_solve(abar.reshape(M, 1), chol_j).reshape(M)
        dq = bq
        gKj = torch.outer(bq, a)
        dK = dK + ((0.5 / N) * torch.outer(a, a) - 0.5 * (gKj + gKj.T)
                   + (-1e-3 / M) * torch.dot(bq, a) * eye)
    # -- K = a RBF(z) * B[cz, cz] * (psi psi^T s + same) ------------------------------
    GKq = dK * Bp * LD
    dlog_amp = dlog_amp + (GKq * Kq).sum()
    GD = GKq * Kq * -0.5
    GD = GD + GD.T
    dBm = dBm + consts.reduce(dK * Kq * LD) + torch.diag(ddiagB)
    GDz = GD @ zs
    # -- the data side: R = Q * lin_x, Q = a RBF(x, z) ------------------------------
    Qbar = dQ + dR * linx
    QbQ = Qbar * Q
    dlog_amp = dlog_amp + QbQ.sum()
    GDx = QbQ * -0.5
    GDxz = GDx @ zs
    rows, cols = GDx.sum(1, keepdim=True), GDx.sum(0)[:, None]
    dZ = dlog_ls = None
    if need[5]:  # the inducing rows [z, psi]: d zs, then d z = d zs / l
        Glin = dK * KB
        dpsi_z = s * ((Glin + Glin.T) @ psi_z) + s * ((dR * Q).T @ psi_x)
        dzs = (2.0 * GD.sum(1, keepdim=True) * zs - 2.0 * GDz
               + 2.0 * cols * zs - 2.0 * (GDx.T @ xs))
        dZ = torch.cat([dzs * inv_ls, dpsi_z], 1)
        if need[1]:
            dxs = 2.0 * rows * xs - 2.0 * GDxz
            dlog_ls = -(dzs * zs).sum(0) - (dxs * xs).sum(0)
    elif need[1]:  # d log l = -sum (d zs) zs - sum (d xs) xs, without d zs itself
        cross = (GDxz * xs).sum(0)
        dlog_ls = (-2.0 * ((GD.sum(1, keepdim=True) + cols) * zs * zs).sum(0)
                   + 2.0 * (GDz * zs).sum(0) + 4.0 * cross
                   - 2.0 * (rows * xs * xs).sum(0))
    Lb = torch.tril(kernel.L_B)
    dL_B = torch.tril((dBm + dBm.T) @ Lb)
    grads = (torch.tril(dL), dlog_ls, dlog_amp, dL_B, dq, dZ)
    return loss, [gr if n else None for gr, n in zip(grads, need)]
