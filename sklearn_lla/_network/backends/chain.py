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
from .base import FactoredBackend

__all__ = ["ChainBackend"]


class ChainBackend(FactoredBackend):
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

    def kernel_step(self, rows_per_point: int) -> int:
        return 4096

    def row_elements(self) -> int:
        return 1  # factors: the chain's rows are cheap to hold
