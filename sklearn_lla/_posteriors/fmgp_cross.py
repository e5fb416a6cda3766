"""The classification kernel's cross covariances in factored form, for FMGP's steps.

:class:`~sklearn_lla.kernels.ClassificationKernel` has cross covariances

``K((x_b, c), (z_m, c_m)) = B[c, c_m] (R[b, m] + [c = c_m] Q[b, m])``

with ``Q = a RBF(x, z)`` and ``R = Q psi(x)^T psi(z) / s`` (``delta="class"``; with
``delta="input"`` the bracket is ``R' = Q (psi^T psi / s + [x = z])`` and there is no
``Q`` term). A training step multiplies the (B, C, M) tensor ``Kxz`` by ``W^T``
(M, M) and by ``Q*``'s weights: ``O(B C M^2)``, the largest product of the step, and
``Kxz`` itself is several (B, C, M) elementwise products to form and differentiate.
In the factored form the product is, with the inducing pairs grouped by their class
(``G`` per class, padded),

``(Kxz T)[b, c] = sum_d B[c, d] sum_{m in d} R[b, m] T[m] + B[c, c] sum_{m in c} Q[b, m] T[m]``:

one batched product over the classes (``O(B M^2)``, ``C`` times less) and a
``C x C`` mixing, and ``Kxz`` is never formed. :class:`ClassCross` holds the factors
and multiplies like the tensor (``Kxz @ T``); the numbers are those of the dense
product up to float64 round-off (``tests/test_fmgp_cost.py``).
"""

from __future__ import annotations

import torch

from . import fmgp_fused
from .fmgp_fused import fused_applies, fused_inputs, fused_loss, fused_step
from .gp import _VariationalObjective
from .gp_algebra import variational_terms
from .kernels import ClassificationKernel

__all__ = ["ClassCross", "FactoredObjective", "class_groups", "factored_batch"]

_F64 = torch.float64


def class_groups(cz, n_outputs):
    """The inducing pairs grouped by class: an index (C, G), or ``None`` when contiguous.

    Parameters
    ----------
    cz : Tensor of shape (M,)
        The class of each inducing pair.
    n_outputs : int
        ``C``.

    Returns
    -------
    Tensor of shape (C, G) or None
        Row ``c`` lists the pairs of class ``c``, padded with ``M`` (a zero row);
        ``None`` when ``cz`` is ``G`` pairs of class 0, then ``G`` of class 1, ...
        (k-means' order with equal shares), where reshapes replace the gathers.
    """
    M = int(cz.shape[0])
    C = int(n_outputs)
    cz = cz.detach().long().cpu()
    counts = torch.bincount(cz, minlength=C)
    G = int(counts.max()) if M else 0
    if C * G == M and bool((cz == torch.arange(C).repeat_interleave(G)).all()):
        return None
    idx = torch.full((C, max(G, 1)), M, dtype=torch.long)
    for c in range(C):
        members = torch.nonzero(cz == c, as_tuple=False).reshape(-1)
        idx[c, :len(members)] = members
    return idx


class ClassCross:
    """``Kxz`` of :class:`~sklearn_lla.kernels.ClassificationKernel`, factored.

    Multiplies like the (B, C, M) tensor: ``cross @ T`` for ``T`` (M, K) gives
    (B, C, K), for ``T`` (M,) gives (B, C).

    Parameters
    ----------
    R : Tensor of shape (B, M)
        The factor every class shares, ``a RBF psi^T psi / s`` (plus ``a RBF [x = z]``
        with ``delta="input"``).
    Q : Tensor of shape (B, M) or None
        The factor of the own class, ``a RBF`` (``delta="class"``), else ``None``.
    Bmat : Tensor of shape (C, C)
        The output covariance ``B``.
    groups : Tensor of shape (C, G) or None
        :func:`class_groups` of the inducing pairs.
    """

    def __init__(self, R, Q, Bmat, groups):
        self.R, self.Q, self.Bmat, self.groups = R, Q, Bmat, groups
        self.shape = (R.shape[0], Bmat.shape[0], R.shape[1])
        self.device, self.dtype = R.device, R.dtype

    def _grouped(self, F):
        """(B, M) -> (C, B, G): each class's columns."""
        B, C = F.shape[0], self.Bmat.shape[0]
        if self.groups is None:
            return F.reshape(B, C, -1).transpose(0, 1)
        Fp = torch.cat([F, F.new_zeros(B, 1)], 1)
        return Fp[:, self.groups].transpose(0, 1)

    def _grouped_rows(self, T):
        """(M, K) -> (C, G, K): each class's rows."""
        C = self.Bmat.shape[0]
        if self.groups is None:
            return T.reshape(C, -1, T.shape[1])
        Tp = torch.cat([T, T.new_zeros(1, T.shape[1])])
        return Tp[self.groups]

    def __matmul__(self, T):
        vector = T.ndim == 1
        T2 = T.reshape(-1, 1) if vector else T
        B, C, _ = self.shape
        K = T2.shape[1]
        Tg = self._grouped_rows(T2.to(_F64))  # (C, G, K)
        TR = torch.bmm(self._grouped(self.R), Tg).reshape(C, B * K)  # (C, B K)
        if self.Q is None:
            res = self.Bmat @ TR
        else:  # B[c, c] scales the (C, B, G) factor, not the (C, B, K) product
            Qg = self._grouped(self.Q) * torch.diagonal(self.Bmat)[:, None, None]
            res = torch.addmm(torch.bmm(Qg, Tg).reshape(C, B * K), self.Bmat, TR)
        res = res.reshape(C, B, K).transpose(0, 1)  # (B, C, K)
        return res.reshape(B, C) if vector else res

    def dense(self):
        """The (B, C, M) tensor (for tests)."""
        M = self.shape[2]
        return self @ torch.eye(M, dtype=_F64, device=self.R.device)


def factored_batch(kernel, x, Z, cz, groups):
    """``(Kzz, Kxz as ClassCross, Kxx)`` of a training step, or ``None``.

    ``None`` unless ``kernel`` is a :class:`~sklearn_lla.kernels.ClassificationKernel`
    itself (a subclass may change the pairs' formula): then the caller uses
    ``kernel.batch``. The same formulas as :meth:`ClassificationKernel.batch`,
    evaluated in the same order (``psi(x)`` last).

    Parameters
    ----------
    kernel : Kernel
        The step's kernel.
    x : Tensor of shape (B, n_features)
        The minibatch's inputs.
    Z : Tensor of shape (M, n_params)
        The inducing parameters.
    cz : Tensor of shape (M,)
        Their classes.
    groups : Tensor of shape (C, G) or None
        :func:`class_groups` of ``cz``.

    Returns
    -------
    tuple or None
    """
    if type(kernel) is not ClassificationKernel or kernel.delta not in ("class", "input"):
        return None
    Kzz, R, Q, Bmat, psi_x = kernel.step_factors(x, Z, cz)
    if groups is not None:
        groups = groups.to(R.device)
    return Kzz, ClassCross(R, Q, Bmat, groups), kernel.prior_blocks(psi_x)


class FactoredObjective(_VariationalObjective):
    """FMGP's minibatch objective, with the step of the classification kernel factored.

    Where :meth:`lean` holds (:class:`~sklearn_lla.kernels.ClassificationKernel` itself,
    the full covariance, and an energy that reads only the latent variances: the
    probit link at alpha = 1), :meth:`loss` evaluates the engine's loss (the
    fixed-mean term, and ``Q*``'s when the posterior has it) with fewer operations:

    * the cross covariances stay factored (:class:`ClassCross`);
    * the prior variances are formed without the ``C x C`` prior blocks
      (:meth:`~sklearn_lla.kernels.ClassificationKernel.prior_variances`);
    * ``a = (Kzz + eps I)^-1 q_mu`` is differentiated in closed form
      (:func:`~sklearn_lla._posteriors.gp_algebra.spd_solve`).

    The same loss and gradients as the engine's step to float64 round-off
    (``tests/test_fmgp_cost.py``); elsewhere the engine's ``loss``.
    """

    def __init__(self, *args):
        super().__init__(*args)
        k = self.kernel
        self.lean = (self.diagonal and not self.subspace and not self.regression
                     and type(k) is ClassificationKernel and k.delta in ("class", "input"))
        self.fused = self.lean and fused_applies(self.post, self, self.elik)

    def closed_form_step(self, params):
        """The loop's ``loss_and_grads`` where the fused step applies, else ``None``.

        ``batch -> (loss, gradients of params)`` from
        :func:`~sklearn_lla._posteriors.fmgp_fused.fused_step`: the same numbers as
        :meth:`loss` and its backward pass, without autograd (see
        :func:`~sklearn_lla._core.optim.minimize`).
        """
        if not (self.lean and self.fused and fmgp_fused.FUSED_STEPS
                and getattr(self.post, "_groups", False) is not False):
            return None
        post = self.post
        slot = {id(t): i for i, t in enumerate(fused_inputs(post, self)) if t is not None}
        where = [slot.get(id(p)) for p in params]

        def loss_and_grads(batch):
            loss, grads = fused_step(post, self, batch)
            return loss, [None if i is None else grads[i] for i in where]

        return loss_and_grads

    def loss(self, batch):
        """The minibatch objective (a differentiable scalar)."""
        # the posterior's class groups are set by its ``start`` (False: not factored)
        if not self.lean or getattr(self.post, "_groups", False) is False:
            return super().loss(batch)
        if self.fused and fmgp_fused.FUSED_STEPS:
            return fused_loss(self.post, self, batch)
        from .fmgp import _qstar_weights

        post, data, kernel = self.post, self.data, self.kernel
        x, y = batch
        Kzz, R, Q, Bmat, psi_x = kernel.step_factors(x, self.Z, self.cz)
        groups = post._groups
        cross = ClassCross(R, Q, Bmat, None if groups is None else groups.to(R.device))
        terms = variational_terms(Kzz, self.L_raw)
        qstar = post.mean_regularizer
        V = cross @ terms.W.T
        var = (kernel.prior_variances(psi_x) - (V * V).sum(-1)).clamp_min(0.0)
        cov = torch.diag_embed(var)
        lik = self.elik
        n_total = data.n_samples
        e = lik.log_predictive(post._mean(data.lin, x), cov, y)
        loss = -e.mean() + terms.kl / n_total
        if not qstar:
            return loss
        a = _qstar_weights(post.q_mu, Kzz)
        e_star = lik.log_predictive(cross @ a, cov, y)
        kl = terms.kl + 0.5 * (a @ (Kzz @ a))
        return loss + (-e_star.mean() + kl / n_total)
