"""Per-layer pieces of the graph backend: which modules it linearises and their
Jacobian row blocks from a layer's input and back-propagated signal.

:mod:`~sklearn_lla._network.backends.graph` records the inputs and signals; the
functions here turn them into row blocks (and, for the KFAC complement,
:mod:`~sklearn_lla._posteriors.kfac_layers`, into the unfolded patches they share).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..structured.jacobian import LayerFactor

__all__ = ["SUPPORTED", "conv_patches", "layer_blocks"]

#: The module types whose parameters the graph backend linearises.
SUPPORTED = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.BatchNorm1d, nn.BatchNorm2d)


def _module_issue(m: nn.Module) -> str | None:
    """Why a module holding linearised parameters is not supported (``None``: it is)."""
    if type(m) not in SUPPORTED:
        return f"it is a {type(m).__name__}"
    if isinstance(m, (nn.Conv1d, nn.Conv2d)):
        if m.groups != 1:
            return "grouped convolution"
        if m.padding_mode != "zeros":
            return f"padding_mode={m.padding_mode!r}"
        if (isinstance(m.padding, str) and m.padding != "valid"
                and any(d * (k - 1) % 2 for d, k in zip(m.dilation, m.kernel_size))):
            return "asymmetric 'same' padding"
    if isinstance(m, (nn.BatchNorm1d, nn.BatchNorm2d)) and (
            m.running_mean is None or m.running_var is None):
        return "BatchNorm without running statistics (batch statistics in eval mode)"
    return None


def _padding(m) -> tuple:
    if isinstance(m.padding, str):
        if m.padding == "valid":
            return (0,) * len(m.kernel_size)
        return tuple(d * (k - 1) // 2 for d, k in zip(m.dilation, m.kernel_size))
    return tuple(m.padding)


class _Layer:
    """A module holding linearised parameters: where it is and which of its names."""

    def __init__(self, path: str, module: nn.Module, weight: str | None, bias: str | None):
        self.path = path
        self.kind = type(module).__name__
        self.weight_name = weight
        self.bias_name = bias

    def names(self) -> list[str]:
        return [n for n in (self.weight_name, self.bias_name) if n is not None]


def conv_patches(mod: nn.Module, a: Tensor, ones: bool = False) -> Tensor:
    """The unfolded input patches of a ``Conv1d`` / ``Conv2d``, ``(B, L, in * kernel)``
    (columns in the order of ``weight.reshape(out, -1)``).

    Parameters
    ----------
    mod : nn.Conv1d or nn.Conv2d
    a : Tensor of shape (B, in, ...)
        The module's input.
    ones : bool, default=False
        Append a column of ones (the bias's input, ``abar = [a, 1]`` of the KFAC
        factors): ``(B, L, in * kernel + 1)``, whose first ``in * kernel`` columns are
        the patches (a view).

    Returns
    -------
    Tensor of shape (B, L, in * prod(kernel_size) (+ 1))
        A transposed view of a contiguous ``(B, in * kernel (+ 1), L)`` block.
    """
    if isinstance(mod, nn.Conv1d):
        a2 = a.unsqueeze(2)
        ks, dil, pad, st = ((1, mod.kernel_size[0]), (1, mod.dilation[0]),
                            (0, _padding(mod)[0]), (1, mod.stride[0]))
    else:
        a2, ks, dil, pad, st = a, mod.kernel_size, mod.dilation, _padding(mod), mod.stride
    # F.unfold's result, gathered by one strided copy of a window view of the
    # zero-padded input (the same values and layout, (B, in * kernel, L) transposed):
    # on the CPU at one thread 2.4 x faster than F.unfold (digits CNN, 713 points,
    # 16 x 8 x 8 inputs, 3 x 3: 5.0 vs 12.1 ms; 1 x 8 x 8: 0.44 vs 1.30 ms;
    # ResNet-20's 16 x 32 x 32 stride-2 conv, 4 points: 0.18 vs 0.35 ms)
    B, C = a2.shape[:2]
    ap = F.pad(a2, (pad[1], pad[1], pad[0], pad[0])) if any(pad) else a2
    Ho = (ap.shape[2] - dil[0] * (ks[0] - 1) - 1) // st[0] + 1
    Wo = (ap.shape[3] - dil[1] * (ks[1] - 1) - 1) // st[1] + 1
    sB, sC, sH, sW = ap.stride()
    win = ap.as_strided((B, C, ks[0], ks[1], Ho, Wo),
                        (sB, sC, dil[0] * sH, dil[1] * sW, st[0] * sH, st[1] * sW))
    n = C * ks[0] * ks[1]
    if not ones:
        return win.reshape(B, n, Ho * Wo).contiguous().transpose(1, 2)
    # the ones written as one more row of the same (B, n + 1, L) block: no second copy
    # of the patches to append them (digits CNN, 71 points, 16 x 8 x 8: 0.55 against
    # 1.20 ms with torch.cat), and the transposed view is the faster operand of the
    # rotation into the KFAC eigenbasis (2.8 against 3.9 ms, one thread)
    buf = ap.new_empty((B, n + 1, Ho * Wo))
    buf[:, :n].view(B, C, ks[0], ks[1], Ho, Wo).copy_(win)
    buf[:, n].fill_(1.0)
    return buf.transpose(1, 2)


def layer_blocks(layer: _Layer, mod: nn.Module, a: Tensor, d: Tensor, k: int,
                  cache: dict | None = None, dest: dict | None = None):
    """``(factor, dense)``: a :class:`LayerFactor` or ``{name: (n_rows, numel)}``.

    ``a``: the module's input ``(B, ...)``; ``d``: the signal at its output,
    ``(B * k, ...)``; ``cache``: keeps what depends on ``a`` only (unfolded patches,
    normalised inputs) between calls for the same input; ``dest``: where to write
    dense blocks, ``{name: (n_rows, numel)}`` (columns of the caller's preallocated
    rows, any row stride, unit column stride); a block written there is returned as
    that same tensor.
    """
    cache = {} if cache is None else cache
    dest = {} if dest is None else dest
    B = a.shape[0]
    n_rows = d.shape[0]

    def put(name, blk):
        if name in dest:
            dest[name].copy_(blk.reshape(dest[name].shape))
            return dest[name]
        return blk

    if isinstance(mod, nn.Linear):
        if a.ndim == 2:
            return LayerFactor(d, a, layer.weight_name, layer.bias_name), {}
        o, i = d.shape[-1], a.shape[-1]
        dv = d.reshape(B, k, -1, o)
        av = a.reshape(B, -1, i)
        out = {}
        if layer.weight_name:
            out[layer.weight_name] = put(layer.weight_name, torch.einsum(
                "bkto,bti->bkoi", dv, av).reshape(n_rows, o * i))
        if layer.bias_name:
            out[layer.bias_name] = put(layer.bias_name, dv.sum(2).reshape(n_rows, o))
        return None, out
    out = {}
    if isinstance(mod, (nn.Conv1d, nn.Conv2d)):
        o = d.shape[1]
        dv = d.reshape(n_rows, o, -1)
        if layer.weight_name:
            patches = cache.get("patches")
            if patches is None:
                # with the bias's column of ones when there is a bias: the KFAC factor
                # ``abar`` that the complement's pass reads from ``cache["abar"]``
                abar = conv_patches(mod, a, ones=layer.bias_name is not None)
                patches = abar[..., :-1] if layer.bias_name is not None else abar
                cache["patches"], cache["abar"] = patches, abar
            w = layer.weight_name
            if w in dest:
                # into the caller's rows (no block to allocate, then copy)
                out[w] = _conv_weight_into(dv.reshape(B, k * o, -1), patches, dest[w], k)
            else:
                gw = torch.bmm(dv.reshape(B, k * o, -1), patches)
                out[w] = gw.reshape(n_rows, -1)
        if layer.bias_name:
            bn = layer.bias_name
            out[bn] = (torch.sum(dv, -1, out=dest[bn]) if bn in dest else dv.sum(-1))
        return None, out
    # BatchNorm in eval mode
    ch = d.shape[1]
    dv = d.reshape(B, k, ch, -1)
    if layer.weight_name:
        xhat = cache.get("xhat")
        if xhat is None:
            shape = (1, ch) + (1,) * (a.ndim - 2)
            xhat = (a - mod.running_mean.view(shape)) * torch.rsqrt(
                mod.running_var.view(shape) + mod.eps)
            cache["xhat"] = xhat
        out[layer.weight_name] = _sum_last(dv * xhat.reshape(B, 1, ch, -1),
                                           dest.get(layer.weight_name))
    if layer.bias_name:
        out[layer.bias_name] = _sum_last(dv, dest.get(layer.bias_name))
    return None, out


def _sum_last(t: Tensor, dest: Tensor | None) -> Tensor:
    """``t (B, k, ch, L)`` summed over ``L`` as ``(B * k, ch)`` rows (into ``dest``)."""
    B, k, ch = t.shape[:3]
    if dest is None:
        return t.sum(-1).reshape(B * k, ch)
    torch.sum(t, -1, out=dest.view(B, k, ch))
    return dest



def _conv_weight_into(dv: Tensor, patches: Tensor, dest: Tensor, k: int) -> Tensor:
    """A conv layer's weight blocks ``(B * k, out * in * kernel)`` written into
    ``dest`` (columns of preallocated rows).

    ``dv``: the signals ``(B, k * out, L)``; ``patches``: ``(B, L, in * kernel)``.
    One row per point (``k = 1``): one batched product straight into ``dest``. Several
    rows per point: a point's ``(k * out, L) @ (L, in * kernel)`` product has no view
    in ``dest`` (its ``k`` rows sit ``p_dense`` apart), so on the CPU each point's
    product goes to a cache-sized buffer and is copied from there (digits CNN, conv
    16 -> 32, 71 points, C = 10, one thread, medians of 11 alternated runs: 33.4 ms
    per chunk of rows against 37.2 ms with one batched product for all points then
    copied, and 34.5 ms before the blocks were written in place); elsewhere (a GPU:
    launches) one batched product, then one copy.
    """
    B, ko, _ = dv.shape
    if k == 1:
        torch.bmm(dv, patches, out=dest.view(B, ko, -1))
        return dest
    Dv = dest.view(B, k, -1)
    if dv.device.type != "cpu":
        Dv.copy_(torch.bmm(dv, patches).view(B, k, -1))
        return dest
    tmp = dv.new_empty((ko, patches.shape[-1]))
    for b in range(B):
        torch.mm(dv[b], patches[b], out=tmp)
        Dv[b].copy_(tmp.view(k, -1))
    return dest
