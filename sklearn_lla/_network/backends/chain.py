"""The structured backend: chains of ``nn.Linear`` layers and elementwise maps.

Products come from :class:`~sklearn_lla._network.structured.chain.StructuredChain`
(per-layer factors ``delta_l (x) a_l``, never a per-example Jacobian); the Jacobian
rows are :class:`~sklearn_lla._network.structured.jacobian.StructuredJacobian`
objects. Everything is closed-form or reverse-mode autograd, so thread-safe.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..structured.chain import StructuredChain
from ..structured.jacobian import StructuredJacobian
from .base import JacobianBackend

__all__ = ["ChainBackend"]


class ChainBackend(JacobianBackend):
    """Products of a network recognised as a :class:`StructuredChain`.

    Parameters
    ----------
    lin : LinearizedNet
        The network.
    chain : StructuredChain
        Its chain (traced and checked by the caller).
    reason : str
        Why this backend was chosen.
    """

    name = "structured"
    thread_safe = True
    factored = True

    def __init__(self, lin, chain: StructuredChain, reason: str) -> None:
        super().__init__(lin, reason)
        self.chain = chain

    def _args(self):
        return self.lin._all_params, self.lin.buffers

    def jvp(self, x: Tensor, T: dict) -> tuple[Tensor, Tensor]:
        with torch.no_grad():
            return self.chain.jvp(*self._args(), x, T)

    def vjp(self, x: Tensor, cotangents: Tensor) -> dict:
        with torch.no_grad():
            return self.chain.vjp(*self._args(), x, cotangents, self.lin.names)

    def rows(self, x: Tensor, out_idx: Tensor | None = None,
             differentiable: bool = False) -> StructuredJacobian:
        with torch.set_grad_enabled(differentiable and torch.is_grad_enabled()):
            return self.chain.features(*self._args(), x, out_idx, self.lin.names,
                                       differentiable=differentiable)

    def jacobian(self, x: Tensor) -> Tensor:
        with torch.no_grad():
            return self.rows(x).dense().reshape(x.shape[0], -1, self.lin.n_params)

    def jacobian_rows(self, x: Tensor, out_idx: Tensor, differentiable: bool = False) -> Tensor:
        return self.rows(x, out_idx, differentiable).dense()

    def gradient_rows_vjp(self, x: Tensor, out_idx: Tensor, U: Tensor) -> dict:
        with torch.no_grad():
            return self.rows(x, out_idx).vjp(U)

    def ntk(self, x1: Tensor, x2: Tensor | None, out1=None, out2=None) -> Tensor:
        with torch.no_grad():
            F1 = self.rows(x1, out1)
            F2 = F1 if x2 is None else self.rows(x2, out2)
            return F1.gram(F2)

    def ntk_diag_blocks(self, x: Tensor) -> Tensor:
        with torch.no_grad():
            return self.rows(x).diag_blocks()

    def cross_and_diag(self, x: Tensor, rows, n_outputs: int) -> tuple[Tensor, Tensor]:
        Fx = self.rows(x)
        return Fx.cross_gram(rows).view(x.shape[0], n_outputs, -1), Fx.diag_blocks()

    def kernel_step(self, n_outputs: int) -> int:
        return 4096
