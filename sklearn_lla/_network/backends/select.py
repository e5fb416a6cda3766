"""Which Jacobian backend computes a :class:`~sklearn_lla._network.linearized.LinearizedNet`'s
products: chosen once, at construction, and chosen again the same way after unpickling.

The order of preference is the structured chain (chains of ``nn.Linear`` layers and
elementwise maps, checked against the module's own forward pass), then the graph
backend (linear, convolutional and BatchNorm layers in any graph), then generic
``torch.func`` products. Every fallback records why in the backend's ``reason``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..structured.chain import StructuredChain
from .base import JacobianBackend
from .chain import ChainBackend
from .graph import GraphBackend

__all__ = ["rebuild_backend", "select_backend"]


def _graph_or_generic(lin, x: Tensor | None, why_not_chain: str) -> JacobianBackend:
    graph, reason = GraphBackend.build(lin, x)
    if graph is not None:
        return graph
    return JacobianBackend(lin, f"{why_not_chain}; not a supported graph: {reason}")


def _chain_reproduces(lin, chain: StructuredChain, x: Tensor | None) -> str | None:
    """``None`` when the chain's forward pass equals the module's, else why not.

    Checked on one row more than the traced input (another batch size), or on a
    fresh random batch when there is no example input.
    """
    if x is not None:
        probe = torch.cat([x, x[:1]])
    else:
        g = torch.Generator().manual_seed(1)
        probe = torch.randn(8, chain.n_features, generator=g, dtype=torch.float64)
        probe = probe.to(dtype=lin.dtype, device=lin.device)
    with torch.no_grad():
        ref = lin.forward(probe)
        got = chain.forward(lin._all_params, lin.buffers, probe)
    tol = 1e-5 * (1.0 + ref.abs().max().item())
    if got.shape == ref.shape and torch.allclose(got, ref, rtol=1e-4, atol=tol):
        return None
    err = (got - ref).abs().max().item() if got.shape == ref.shape else float("nan")
    return ("the structured chain did not reproduce the network's outputs on "
            f"{'example_input' if x is not None else 'a random probe'} "
            f"(shapes {tuple(got.shape)} / {tuple(ref.shape)}, max difference {err:.3g})")


def select_backend(lin, x: Tensor | None) -> tuple[JacobianBackend, Tensor | None]:
    """Choose the backend for ``lin``.

    Parameters
    ----------
    lin : LinearizedNet
        The network (its module, parameters and flags are set).
    x : Tensor of shape (B, ...) or None
        Example inputs, in the network's dtype and device.

    Returns
    -------
    backend : JacobianBackend
        The chosen backend; ``backend.reason`` says why.
    trace_input : Tensor of shape (2, ...) or None
        The rows the backend was traced on, kept to rebuild it after unpickling.
    """
    trace = None if x is None else x[:2]
    if not lin.structured:
        return JacobianBackend(lin, "structured=False was requested"), None
    if lin.output_transform != "identity":
        return _graph_or_generic(lin, x, f"output_transform={lin.output_transform!r} is "
                                 "not supported by the structured chain"), trace
    chain, reason = StructuredChain.trace(lin.module, x)
    if chain is None:
        return _graph_or_generic(lin, x, f"not a chain: {reason}"), trace
    mismatch = _chain_reproduces(lin, chain, x)
    if mismatch is not None:
        return JacobianBackend(lin, mismatch), trace
    note = "" if x is not None else (" (checked on a random probe input; pass "
                                     "example_input to check on real inputs)")
    return ChainBackend(lin, chain, chain.description + note), trace


def rebuild_backend(lin, name: str, reason: str, trace: Tensor | None) -> JacobianBackend:
    """The backend of an unpickled ``lin``: the one it had, rebuilt from its trace input.

    Parameters
    ----------
    lin : LinearizedNet
        The unpickled network.
    name : str
        The backend's ``name`` before pickling.
    reason : str
        Its ``reason``.
    trace : Tensor or None
        The rows it was traced on.

    Returns
    -------
    JacobianBackend
        The same kind of backend, or the generic one with the reason it could not be
        rebuilt.
    """
    if name == "structured":
        chain, why = StructuredChain.trace(lin.module, trace)
        if chain is not None:
            return ChainBackend(lin, chain, reason)
        return JacobianBackend(lin, "the structured chain could not be rebuilt after "
                               f"unpickling: {why}")
    if name == "graph":
        graph, why = GraphBackend.build(lin, trace)
        if graph is not None:
            return graph
        return JacobianBackend(lin, "the graph backend could not be rebuilt after "
                               f"unpickling: {why}")
    return JacobianBackend(lin, reason)
