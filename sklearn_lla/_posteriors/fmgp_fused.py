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

__all__ = ["FUSED_STEPS", "fused_applies", "fused_inputs", "fused_loss", "fused_step"]

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


def _ungrouped_t(Fg, groups, M):
    """The adjoint of :func:`_grouped` from the (C, G, B) layout: (B, M), padding dropped."""
    C, G, B = Fg.shape
    flat = Fg.reshape(C * G, B)
    if groups is None:
        return flat.T
    out = flat.new_zeros(M + 1, B)
    out.index_add_(0, groups.reshape(-1), flat)
    return out[:M].T


def _cholesky(A, what):
    """The Cholesky factor of ``A`` (its lower triangle; symmetric to round-off), and
    :func:`~sklearn_lla._core.linalg.cholesky`'s escalating jitter where it fails."""
    Lc, info = torch.linalg.cholesky_ex(A)
    if int(info) == 0:
        return Lc
    return cholesky(A, what, warn=False)


def _probit_energies(f, var, y):
    """Per-point ``log softmax(f_j / sqrt(1 + pi v / 8))[y]`` of the means ``f`` (J, B, C)
    with one variance ``var`` (B, C); the gradients in each ``f_j`` and their sum in ``v``.

    Returns ``(e (J, B), df (J, B, C), dvar (B, C))``.
    """
    den = torch.sqrt(var * (math.pi / 8.0) + 1.0)
    u = f / den  # the softmax spelled out (torch's is several times slower on 10 classes)
    p = u.sub_(u.amax(-1, keepdim=True)).exp_()
    p = p.div_(p.sum(-1, keepdim=True))
    J, B, _ = f.shape
    yi = y.long().reshape(1, B, 1).expand(J, B, 1)
    picked = p.gather(-1, yi)  # (J, B, 1)
    tiny = torch.finfo(p.dtype).tiny
    e = torch.log(picked.clamp_min(tiny)).squeeze(-1)
    du = p.neg_()
    du.scatter_add_(-1, yi, (picked >= tiny).to(p.dtype))  # the clamp's mask (rows below
    du.mul_((picked >= tiny).to(p.dtype))                     # it get no gradient)
    df = du / den
    dvar = (df * f).sum(0) * (-math.pi / 16.0) / (den * den)
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
    inputs = fused_inputs(post, objective)

    def step():
        return fused_step(post, objective, batch)

    return _Fused.apply(step, *[t if t is not None else torch.empty(0) for t in inputs])


def fused_inputs(post, objective):
    """The tensors :func:`fused_step` differentiates: ``(L_raw, log l, log a, L_B, q_mu,
    Z)`` (``q_mu`` ``None`` without ``Q*``)."""
    kernel = objective.kernel
    q_mu = post.q_mu if post.mean_regularizer else None
    return (objective.L_raw, kernel.log_length_scale, kernel.log_amplitude, kernel.L_B,
            q_mu, objective.Z)


def fused_step(post, objective, batch):
    """:func:`fused_loss`'s loss and gradients, without autograd.

    Returns
    -------
    loss : Tensor
        The scalar loss (no graph).
    grads : list
        The gradient of each tensor of :func:`fused_inputs` (``None`` for those that do
        not require one).
    """
    kernel = objective.kernel
    inputs = fused_inputs(post, objective)
    need = [t is not None and t.requires_grad for t in inputs]
    consts = getattr(objective, "_fused_constants", None)
    if consts is None:
        consts = objective._fused_constants = _Constants(objective.cz, post._groups,
                                                         kernel.n_outputs,
                                                         objective.Z.shape[0])
    x, y = batch
    with torch.no_grad():
        return _loss_and_grads(post, kernel, objective.data, x, y, objective.Z,
                               objective.cz, objective.L_raw, inputs[4], need, consts)


class _Constants:
    """What a fit's steps share: the inducing pairs' class structure, ``I``, and the
    inducing features' terms while they are not trained."""

    def __init__(self, cz, groups, C, M):
        dev = cz.device
        self.M, self.C = M, C
        self.groups = None if groups is None else groups.to(dev)
        self.G = None if groups is None else int(groups.shape[1])
        self.eye = torch.eye(M, dtype=_F64, device=dev)
        self.same = (cz[:, None] == cz[None, :]).to(_F64)
        self.onehot = (torch.arange(C, device=dev)[:, None] == cz[None, :]).to(_F64)
        self.cz = cz
        self._gram = self._psi_s = self._w = None

    def features_gram(self, psi_z, s, fixed):
        """``s psi_z psi_z^T + [cz = cz']``, computed once when ``psi_z`` is not trained."""
        if fixed and self._gram is not None:
            return self._gram
        gram = s * (psi_z @ psi_z.T) + self.same
        self._gram = gram if fixed else None
        return gram

    def scaled_features(self, psi_z, s, fixed):
        """``s psi_z`` (M, F), computed once when ``psi_z`` is not trained."""
        if fixed and self._psi_s is not None:
            return self._psi_s
        psi_s = s * psi_z
        self._psi_s = psi_s if fixed else None
        return psi_s

    def ls_weights(self, B):
        """(M + B,): 2 on the inducing rows, 4 on a batch's rows (the length scales'
        gradient, see :func:`_loss_and_grads`)."""
        w = self._w
        if w is None or w.shape[0] != self.M + B:
            w = torch.full((self.M + B,), 4.0, dtype=_F64, device=self.eye.device)
            w[:self.M] = 2.0
            self._w = w
        return w

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
    B = x.shape[0]
    center = kernel._dist.center
    s = kernel.feature_scale
    amp_log = kernel.log_amplitude
    amp = torch.exp(amp_log)
    inv_ls = torch.exp(-kernel.log_length_scale)
    # the inducing rows and the batch, scaled (``dist.scale``), stacked: one RBF product
    us = torch.cat([z, x.to(_F64).reshape(B, -1)]).sub_(center).mul_(inv_ls)  # (M + B, D)
    zs, xs = us[:M], us[M:]
    us2 = us * us
    uu = us2.sum(-1)
    E = torch.addmm(uu[:, None] + uu[None, :M], us, zs.T, alpha=-2.0)
    E = E.clamp_min_(0.0).mul_(-0.5).add_(amp_log).exp_()  # a RBF: [Kq; Q] (M + B, M)
    Kq, Q = E[:M], E[M:]
    fixed = not need[5]
    LD = consts.features_gram(psi_z, s, fixed)  # psi psi^T s + [cz = cz]
    Bm = kernel._B()
    C = Bm.shape[0]
    Bp = consts.expand(Bm)
    KqLD = Kq * LD
    K = KqLD * Bp
    _, psi_x = kernel.features_(x)
    psi_x = psi_x.to(_F64)
    linx = psi_x @ consts.scaled_features(psi_z, s, fixed).T
    R = Q * linx
    groups = consts.groups
    L = torch.tril(L_raw)
    eye = consts.eye
    H = torch.addmm(eye, L.T @ K, L)
    Lc = _cholesky(H, "variational matrix I + L^T Kzz L")
    W = torch.linalg.solve_triangular(Lc, L.T, upper=False)
    WK = W @ K
    kl = torch.log(torch.diagonal(Lc)).sum() - 0.5 * torch.vdot(WK.reshape(-1), W.reshape(-1))
    if q_mu is not None:
        jit = 1e-3 * torch.diagonal(K).mean()
        chol_j = _cholesky(K + jit * eye, "regularised inducing Gram matrix")
        a = torch.cholesky_solve(q_mu.reshape(M, 1), chol_j)
        T = torch.cat([W.T, a], 1)
        a = a.reshape(M)
        Ka = K @ a
    else:
        T = W.T.contiguous()
    Kc = T.shape[1]
    Rg = _grouped(R, groups, C).contiguous()  # (C, B, G)
    diagB = torch.diagonal(Bm)
    Qg0 = _grouped(Q, groups, C).contiguous()
    Qg = Qg0 * diagB[:, None, None]
    Tg = (T.reshape(C, -1, Kc) if groups is None  # (C, G, Kc)
          else torch.cat([T, T.new_zeros(1, Kc)])[groups])
    TR = torch.bmm(Rg, Tg)
    VA = torch.bmm(Qg, Tg)
    VA.view(C, B * Kc).addmm_(Bm, TR.view(C, B * Kc))  # + the classes' mixing, in place
    V = VA[..., :M]  # (C, B, M): class-major, as the products give it
    h = (psi_x * psi_x).sum(-1).mul_(s).add_(1.0)  # (B,)
    pv = torch.outer(h, amp * diagB)
    var_raw = pv - torch.linalg.vecdot(V, V).T
    var = var_raw.clamp_min(0.0)
    g = post._mean(data.lin, x)
    N = data.n_samples
    if q_mu is None:
        e, _, Gv = _probit_energies(g[None], var, y)
        loss = -e.mean() + kl / N
    else:  # the fixed-mean and ``Q*`` energies share the latent variances
        e, df, Gv = _probit_energies(torch.stack([g, VA[..., M].T]), var, y)
        loss = -e.mean(1).sum() + (2.0 * kl + 0.5 * torch.dot(a, Ka)) / N
        Gm = df[1] * (-1.0 / B)
    Gv = torch.where(var_raw >= 0, Gv, 0.0).mul_(-1.0 / B)
    # -- backward: the cross products, class-major (C, B, Kc) -----------------------
    # (C, B, Kc) buffers are reused: VA becomes d VA, TR becomes d TR
    dTQ = VA
    dTQ[..., :M].mul_((-2.0 * Gv).T[..., None])
    if q_mu is not None:
        dTQ[..., M] = Gm.T
    dVc = dTQ.view(C, B * Kc)
    dBm = dVc @ TR.view(C, B * Kc).T  # sum_{b,k} dV[c, b, k] TR[d, b, k]
    dTR = torch.mm(Bm.T, dVc, out=TR.view(C, B * Kc)).view(C, B, Kc)
    # (Tg dTQ^T) is (C, G, B): the products back to the factors in that layout (MKL's
    # batched product is faster so than with the (B, G) outputs)
    dQg_t = torch.bmm(Tg, dTQ.transpose(1, 2))  # d(Qg * diagB), transposed
    ddiagB = torch.linalg.vecdot(dQg_t.reshape(C, -1),
                                 Qg0.transpose(1, 2).reshape(C, -1))
    dQ = _ungrouped_t(dQg_t.mul_(diagB[:, None, None]), groups, M)
    dR = _ungrouped_t(torch.bmm(Tg, dTR.transpose(1, 2)), groups, M)
    dTg = torch.baddbmm(torch.bmm(Rg.transpose(1, 2), dTR), Qg.transpose(1, 2), dTQ)
    if groups is None:
        dT = dTg.reshape(M, Kc)
    else:
        dT = dTg.new_zeros(M + 1, Kc).index_add_(0, groups.reshape(-1),
                                                 dTg.reshape(-1, Kc))[:M]
    # prior variances
    ddiagB = ddiagB + (Gv.T @ h) * amp
    dlog_amp = torch.vdot(Gv.reshape(-1), pv.reshape(-1))
    # -- the factor: W = Lc^-1 L^T, the KL ------------------------------------------
    c_kl = (2.0 if q_mu is not None else 1.0) / N
    G = dT[:, :M].T - c_kl * WK
    S = G @ W.T
    S = (S + S.T).mul_(0.5)
    KWt = WK.T
    dL = torch.linalg.solve_triangular(Lc, torch.addmm(G.T, KWt, c_kl * eye - S), upper=False,
                                       left=False)
    dK = (W.T @ S @ W).mul_(-0.5)
    dq = None
    if q_mu is not None:
        abar = dT[:, M] + Ka / N
        bq = torch.cholesky_solve(abar.reshape(M, 1), chol_j).reshape(M)
        dq = bq
        v = a * (0.5 / N) - bq  # the terms (a a^T / N - b a^T - a b^T) / 2, symmetric
        dK.addr_(a, v, alpha=0.5).addr_(v, a, alpha=0.5)
        dK.diagonal().sub_(torch.dot(bq, a) * (1e-3 / M))
    # -- K = a RBF(z) * B[cz, cz] * (psi psi^T s + same) ------------------------------
    dKK = dK * K
    dlog_amp = dlog_amp + dKK.sum()
    dBm = dBm.add_(consts.reduce(dK * KqLD)).add_(torch.diag(ddiagB))
    # -- the data side: R = Q * lin_x, Q = a RBF(x, z) ------------------------------
    dRQ = dR * Q if need[5] else None
    QbQ = dR.mul_(linx).add_(dQ).mul_(Q)  # (dQ + dR lin_x) Q
    dlog_amp = dlog_amp + QbQ.sum()
    GDall = torch.cat([dKK + dKK.T, QbQ]).mul_(-0.5)  # d / d sq-distances, (M + B, M)
    GD, GDx = GDall[:M], GDall[M:]
    GU = GDall @ zs  # [GD zs; GDx zs]
    rows, cols = GDx.sum(1), GDx.sum(0)
    dZ = dlog_ls = None
    if need[5]:  # the inducing rows [z, psi]: d zs, then d z = d zs / l
        Glin = dK * (Kq * Bp)
        dpsi_z = s * ((Glin + Glin.T) @ psi_z) + s * (dRQ.T @ psi_x)
        dzs = (2.0 * (GD.sum(1) + cols)[:, None] * zs - 2.0 * GU[:M] - 2.0 * (GDx.T @ xs))
        dZ = torch.cat([dzs * inv_ls, dpsi_z], 1)
        if need[1]:
            dxs = 2.0 * rows[:, None] * xs - 2.0 * GU[M:]
            dlog_ls = -(dzs * zs).sum(0) - (dxs * xs).sum(0)
    elif need[1]:  # d log l = -sum (d zs) zs - sum (d xs) xs, without d zs itself
        w2 = torch.cat([GD.sum(1) + cols, rows]).mul_(-2.0)  # on us^2
        w1 = consts.ls_weights(B)  # on (GU us): 2 for the z rows, 4 for the x rows
        dlog_ls = torch.mv(us2.T, w2).add_(torch.mv((GU * us).T, w1))
    Lb = torch.tril(kernel.L_B)
    dL_B = torch.tril((dBm + dBm.T) @ Lb)
    grads = (torch.tril(dL), dlog_ls, dlog_amp, dL_B, dq, dZ)
    return loss, [gr if n else None for gr, n in zip(grads, need)]
