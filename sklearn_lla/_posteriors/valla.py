"""VaLLA: variational linearized Laplace (Ortega, Santana & Hernandez-Lobato, 2024).

LLA's predictive is the posterior of a GP with the network as its mean and the scaled
neural tangent kernel ``k((x, c), (z, c')) = s0^2 J_c(x) J_c'(z)^T`` as its kernel
(``J_c`` the gradient of output ``c`` w.r.t. the linearised parameters). VaLLA
approximates that GP by the fixed-mean sparse variational GP of
:mod:`sklearn_lla._posteriors.gp` (``M`` inducing pairs ``(z_m, c_m)`` and a triangular factor
``L``) and learns ``Z``, ``L``, ``log s0^2`` and ``log s2`` by minibatch Adam on the
alpha-energy (alpha = 1), stopping early on the validation NLL. Nothing here touches
more than one minibatch of the data per step, so a step costs the same for any N.

The kernel (:class:`NTKKernel`) is evaluated

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
for the structured kernel, or the parameter-space basis ``U = J(Z)^T W^T`` (P x M,
``A = W^T W``) for the generic one, so ``Kxz W^T = s0^2 J(x) U`` is one forward pass
with ``M`` tangents (as ELLA's predict).
"""


from __future__ import annotations

import math

import numpy as np
import torch
from torch.func import jacrev, vmap

from .gp import FixedMeanGPPosterior, Kernel, joint_cov

__all__ = ["NTKKernel", "VaLLAPosterior", "structured_cross_gram"]

_F64 = torch.float64

def structured_cross_gram(Fa, Fb) -> torch.Tensor:
    """``Ja Jb^T`` from two factored Jacobians, in differentiable out-of-place ops.

    ``Fa``, ``Fb`` are :class:`~sklearn_lla._network.structured.jacobian.StructuredJacobian`
    of the same chain; the result has shape ``(Fa.n_rows, Fb.n_rows)``, float64 (each
    layer's two products are formed in the factors' dtype and combined in float64).
    Unlike ``StructuredJacobian.gram`` (in place, no autograd), gradients flow to
    whichever factors require them.
    """
    B1, k1 = Fa.n_points, Fa.rows_per_point
    B2, k2 = Fb.n_points, Fb.rows_per_point
    G = None
    for la, lb in zip(Fa.layers, Fb.layers):
        DD = (la.delta @ lb.delta.T).to(_F64)  # (B1 k1, B2 k2)
        if la.has_weight:
            K = (la.act @ lb.act.T).to(_F64)  # (B1, B2)
            if la.has_bias:
                K = K + 1.0
            if k1 == 1 and k2 == 1:
                DD = DD * K
            else:
                DD = (DD.view(B1, k1, B2, k2) * K[:, None, :, None]).reshape(B1 * k1, B2 * k2)
        G = DD if G is None else G + DD
    return G


class NTKKernel(Kernel):
    """The scaled NTK ``s0^2 J_c(x) J_c'(z)^T`` over (input, output index) pairs.

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
    structured : bool or None, default=None
        Use the layer-wise closed form (``None``: whenever the network is a
        structured chain, ``lin.backend == "structured"``).
    """

    def __init__(self, lin, n_outputs, input_shape, prior_variance=1.0, learn_prior=False,
                 structured=None):
        self.lin = lin
        self.n_outputs = int(n_outputs)
        self.input_shape = tuple(int(s) for s in input_shape)
        self.learn_prior = bool(learn_prior)
        self.log_prior_variance = torch.tensor(math.log(float(prior_variance)), dtype=_F64,
                                               device=lin.device, requires_grad=self.learn_prior)
        can = lin.chain is not None
        self.structured = can if structured is None else bool(structured) and can

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

    def gram(self, z, cz):
        """``s0^2 J_cz(Z) J_cz(Z)^T`` (M, M), float64, differentiable w.r.t. ``Z``."""
        if self.structured:
            Fz = self._factors(self._z_input(z), cz, differentiable=z.requires_grad)
            K = structured_cross_gram(Fz, Fz)
        else:
            R = self._rows(z, cz)
            K = R @ R.T
        return self._s0() * K

    def cross(self, x, z, cz):
        """``s0^2 J(x) J_cz(Z)^T`` of shape (B, C, M), float64."""
        return self.cross_and_diag(x, z, cz)[0]

    def diag_blocks(self, x):
        """``s0^2 J(x_b) J(x_b)^T`` of shape (B, C, C), float64."""
        lin = self.lin
        blocks = self._factors(x).diag_blocks() if self.structured else lin.ntk_diag_blocks(x)
        return self._s0() * blocks

    def cross_and_diag(self, x, z, cz):
        """``(cross(x, z, cz), diag_blocks(x))`` sharing the work on ``x``."""
        B, C = x.shape[0], self.n_outputs
        if self.structured:
            Fx = self._factors(x)
            Fz = self._factors(self._z_input(z), cz, differentiable=z.requires_grad)
            G = structured_cross_gram(Fx, Fz)
            blocks = Fx.diag_blocks()
        else:
            G, blocks = self._generic_cross_and_diag(x, self._rows(z, cz))
        s0 = self._s0()
        return s0 * G.view(B, C, -1), s0 * blocks

    def batch(self, x, z, cz):
        """``(Kzz, Kxz, Kxx)`` for a training step, evaluating the network at ``Z`` once."""
        B, C = x.shape[0], self.n_outputs
        s0 = self._s0()
        if self.structured:
            Fz = self._factors(self._z_input(z), cz, differentiable=z.requires_grad)
            Fx = self._factors(x)
            Kzz = structured_cross_gram(Fz, Fz)
            Kxz = structured_cross_gram(Fx, Fz).view(B, C, -1)
            return s0 * Kzz, s0 * Kxz, s0 * Fx.diag_blocks()
        R = self._rows(z, cz)
        Kxz, Kxx = self._generic_cross_and_diag(x, R)
        return s0 * (R @ R.T), s0 * Kxz, s0 * Kxx

    def _generic_cross_and_diag(self, x, R):
        parts, blocks = [], []
        for _, J in self.lin.jacobian_chunks(x, self.n_outputs):
            J = J.to(_F64)
            parts.append(J @ R.T)
            blocks.append(J @ J.transpose(1, 2))
        return torch.cat(parts), torch.cat(blocks)

    def joint(self, x):
        """``s0^2 J(x) J(x)^T`` over all outputs of all points, (B C, B C), float64."""
        if self.structured:
            Fx = self._factors(x)
            K = structured_cross_gram(Fx, Fx)
        else:
            K = self.lin.kernel(x, n_outputs=self.n_outputs)
        return self._s0() * K

    # -- evaluation ------------------------------------------------------------------
    def _factors(self, x, out_idx=None, differentiable=False):
        """Factored Jacobian rows (all outputs, or ``out_idx``) at ``x``, network dtype."""
        lin = self.lin
        return lin.chain.features(lin._all_params, lin.buffers, x.to(lin.dtype), out_idx,
                                  lin.names, differentiable=differentiable)

    def _rows(self, z, cz):
        """Jacobian rows ``grad g_cz[m](z_m)`` (M, P), float64, differentiable w.r.t. ``z``."""
        lin = self.lin
        zin = self._z_input(z).to(lin.dtype)
        onehot = torch.nn.functional.one_hot(torch.as_tensor(cz, device=zin.device),
                                             self.n_outputs).to(lin.dtype)

        def out(p, zi, oi):
            return (lin._g(p, zi.unsqueeze(0))[0] * oi).sum()

        jac = vmap(jacrev(out), in_dims=(None, 0, 0))(lin.params, zin, onehot)
        M = zin.shape[0]
        return torch.cat([jac[n].reshape(M, -1) for n in lin.names], dim=1).to(_F64)

    def predictor(self, z, cz, W, method="auto"):
        """``x -> (Kxx blocks, Kxz W^T)`` with everything about ``Z`` precomputed.

        Parameters
        ----------
        z, cz : Tensor
            The fitted inducing inputs and output indices.
        W : Tensor of shape (M, M)
            ``A = W^T W``.
        method : {"auto", "structured", "basis"}, default="auto"
            ``"structured"``: the layer-wise kernel against the stored inducing
            factors (the default for structured networks: ``O(B C M width)`` per
            layer). ``"basis"``: ``U = J(Z)^T W^T`` (P x M) and ``Kxz W^T = s0^2 J(x)
            U`` by one forward pass with ``M`` tangents (``O(B P M)``; the default for
            other networks).

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
        if self.structured and method != "basis":
            with torch.no_grad():
                Fz = self._factors(zin, cz)

            def predict(x):
                Fx = self._factors(x)
                V = structured_cross_gram(Fx, Fz) @ W.T
                return s0 * Fx.diag_blocks(), s0 * V.view(x.shape[0], C, -1)

            return predict
        if method == "structured":
            raise ValueError("the structured predictor needs a structured network")
        cz = torch.as_tensor(cz, device=zin.device)
        U = lin.gradient_rows_vjp(zin.to(lin.dtype), cz, W.T)  # K = M directions

        def predict(x):
            _, jv = lin.jvp(x, U)
            return s0 * lin.ntk_diag_blocks(x), s0 * jv.to(_F64)

        return predict


class VaLLAPosterior(FixedMeanGPPosterior):
    """VaLLA: the fixed-mean sparse GP of :mod:`sklearn_lla._posteriors.gp` with the scaled NTK.

    Parameters
    ----------
    prior_variance : float or "auto", default="auto"
        ``s0^2``: fixed, or learned (``"auto"``) from ``||theta_hat||^2 / P``.
    **kwargs
        The :class:`~sklearn_lla._posteriors.gp.FixedMeanGPPosterior` settings.
    """

    def __init__(self, prior_variance="auto", **kwargs):
        super().__init__(**kwargs)
        self.prior_setting = prior_variance

    def make_kernel(self, data, Z, cz):
        """The NTK kernel of ``data.lin``, with its initial prior variance."""
        lin = data.lin
        x0, _ = data.rows(np.arange(1))
        if isinstance(self.prior_setting, str):
            theta = lin.flat_params().to(_F64)
            s0 = max(float(theta @ theta) / lin.n_params, 1e-8)
            learn = True
        else:
            s0, learn = float(self.prior_setting), False
        self.initial_prior_variance = s0
        return NTKKernel(lin, data.n_outputs, x0.shape[1:], s0, learn)

    def _initial_noise(self, data, gen):
        """The larger of the training and the held-out mean squared residuals.

        A network usually fits its training rows more closely than new ones; starting
        ``s2`` at the training residual makes the first validation check already find
        a noise too small. Starting from the held-out residual (a value the objective
        then lowers) lets early stopping halt where the validation NLL is best, the
        paper's "relatively large" initialisation.
        """
        s2 = super()._initial_noise(data, gen)
        val = data.validation
        if val is not None and val.n_samples > 0:
            s2 = max(s2, super()._initial_noise(val, gen))
        return s2

    def predict_joint(self, x):
        """Mean (B, C) and joint latent covariance ``Kxx - Kxz A Kzx`` (B C, B C)."""
        mean = self._mean(self._lin, x)
        with torch.no_grad():
            K = self.kernel.joint(x)
            _, V = self._predict_fn(x)
            V = V.reshape(-1, V.shape[-1]).to(_F64)
        return mean, joint_cov(K, V)
