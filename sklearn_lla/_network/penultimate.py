"""Penultimate features of a network: ``g(x)`` and ``psi(x)`` from one forward pass.

Used by :class:`sklearn_lla.kernels.ClassificationKernel` (and re-exported there as
:class:`sklearn_lla.kernels.PenultimateFeatures`).
"""

from __future__ import annotations

import threading
import weakref

import torch
from torch import nn

__all__ = ["PenultimateFeatures"]


def _last_parametrised_leaf(module, example_input):
    """Name of the last leaf module holding parameters that runs in the forward pass.

    One forward pass on ``example_input`` under ``torch.no_grad`` on a copy of the
    module objects (sharing the tensors; ``module`` itself is not touched).
    """
    from .structured.trace import share_copy

    mod = share_copy(module)
    names = {id(m): n for n, m in mod.named_modules()}
    order = []
    handles = [m.register_forward_hook(lambda m_, i, o: order.append(m_))
               for m in mod.modules() if next(m.children(), None) is None]
    try:
        with torch.no_grad():
            mod(example_input)
    finally:
        for h in handles:
            h.remove()
    for m in reversed(order):
        if next(m.parameters(recurse=False), None) is not None:
            return names[id(m)]
    raise ValueError("no module with parameters ran in the forward pass: cannot find the "
                     "network's last layer; pass penultimate_layer='name'")


class PenultimateFeatures:
    """The network's outputs ``g(x)`` and penultimate features ``psi(x)`` in one pass.

    ``psi(x)`` is the output of the module named ``layer``, flattened to (B, F). With
    ``layer=None`` it is the *input* of the last module with trainable parameters
    that runs in the forward pass, which must be an ``nn.Linear`` (the head of an
    MLP or of most classifiers); otherwise name the module whose output is
    ``psi`` (a name from ``net.named_modules()``). The module must run exactly once
    per forward pass.

    The forward pass runs on a per-thread copy of the network's module objects (they
    share its tensors) carrying a forward hook: the user's module and the
    :class:`~sklearn_lla._network.linearized.LinearizedNet`'s own copy are never touched, and
    calls from several threads do not interfere. The last result is cached per
    thread (keyed on the input tensor's identity and version), so the kernel and the
    predictive mean share one forward pass per batch.

    Parameters
    ----------
    net : LinearizedNet
        The frozen network.
    layer : str or None, default=None
        Name of the module whose output is ``psi``.
    example_input : Tensor, optional
        A small batch, used to find and check the layer.

    Examples
    --------
    >>> import torch
    >>> from torch import nn
    >>> from sklearn_lla._network.linearized import LinearizedNet
    >>> from sklearn_lla.kernels import PenultimateFeatures
    >>> module = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 2))
    >>> x = torch.randn(4, 3)
    >>> feats = PenultimateFeatures(LinearizedNet(module, example_input=x), example_input=x)
    >>> feats.layer, feats.mode
    ('2', 'input')
    >>> g, psi = feats(x)
    >>> psi.shape
    torch.Size([4, 8])
    """

    def __init__(self, net, layer=None, example_input=None):
        self.net = net
        self.requested = layer
        if example_input is not None:
            example_input = net._input(torch.as_tensor(example_input, device=net.device))
        self.layer, self.mode = self._resolve(net.module, layer, example_input)
        self._local = threading.local()
        if example_input is not None:
            self(example_input)

    @staticmethod
    def _resolve(module, layer, example_input):
        named = dict(module.named_modules())
        if layer is not None:
            if not isinstance(layer, str) or layer not in named or layer == "":
                some = [n for n in named if n][:12]
                raise ValueError(
                    f"penultimate_layer={layer!r} is not a module of the network; expected "
                    f"a name from net.named_modules(), e.g. {some}")
            return layer, "output"
        if example_input is None:
            raise ValueError("example_input is needed to find the penultimate layer")
        head = _last_parametrised_leaf(module, example_input)
        mod = named[head]
        if not isinstance(mod, nn.Linear):
            raise ValueError(
                f"cannot tell the network's penultimate features: its last module with "
                f"parameters is a {type(mod).__name__} at {head!r}, not an nn.Linear "
                "(whose input would be the features). Pass penultimate_layer='name', the "
                "name (as in net.named_modules()) of the module whose output are the "
                "features psi(x)")
        return head, "input"

    def __getstate__(self):
        state = dict(self.__dict__)
        state.pop("_local", None)
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._local = threading.local()

    def _module(self):
        local = self._local
        mod = getattr(local, "module", None)
        if mod is None:
            from .structured.trace import share_copy

            mod = share_copy(self.net.module)
            box = []
            sub = dict(mod.named_modules())[self.layer]
            if self.mode == "input":
                sub.register_forward_pre_hook(lambda m, args: box.append(args[0]))
            else:
                sub.register_forward_hook(lambda m, args, out: box.append(out))
            local.module, local.box = mod, box
        return mod, local.box

    def _compute(self, x):
        mod, box = self._module()
        x = self.net._input(x)
        B = x.shape[0]
        box.clear()
        try:
            out = mod(x)
            g = self.net._finish(out, B)
            if len(box) != 1:
                where = f"{self.layer!r} ({self.mode} of the module)"
                raise ValueError(
                    f"the penultimate layer {where} ran {len(box)} times in one forward "
                    "pass; it must run exactly once: pass penultimate_layer='name' of a "
                    "module that does")
            psi = box[0]
        finally:
            box.clear()
        if not isinstance(psi, torch.Tensor) or psi.ndim == 0 or psi.shape[0] != B:
            raise ValueError(
                f"the penultimate layer {self.layer!r} gave "
                f"{type(psi).__name__ if not isinstance(psi, torch.Tensor) else tuple(psi.shape)}"
                f" for a batch of {B}; expected a tensor (B, ...)")
        return g, psi.reshape(B, -1)

    def __call__(self, x):
        """Return ``(g(x), psi(x))`` for a batch ``x`` (network dtype).

        Parameters
        ----------
        x : Tensor of shape (B, ...)
            Inputs.

        Returns
        -------
        g : Tensor of shape (B, C)
            The network's outputs (exactly ``net.forward(x)``).
        psi : Tensor of shape (B, F)
            The penultimate features.
        """
        pinned = getattr(self._local, "pinned", None)
        if pinned is not None and pinned[0]() is x and pinned[1] == x._version:
            return pinned[2], pinned[3]
        grad = torch.is_grad_enabled() and x.requires_grad
        entry = getattr(self._local, "entry", None)
        if entry is not None:
            ref, version, was_grad, g, psi = entry
            if ref() is x and version == x._version and was_grad == grad:
                return g, psi
        if grad:
            g, psi = self._compute(x)
        else:
            with torch.no_grad():
                g, psi = self._compute(x)
        self._local.entry = (weakref.ref(x), x._version, grad, g, psi)
        return g, psi

    def pin(self, x, g, psi):
        """Give the outputs of batch ``x`` in this thread without a forward pass.

        Until the next :meth:`pin` (or :meth:`unpin`) in this thread, calls with this
        very tensor (unmodified) return ``(g, psi)``: FMGP's fit attaches the cached
        outputs of its training rows to each minibatch this way. ``x`` must not
        require gradients (the pinned values carry none).

        Parameters
        ----------
        x : Tensor of shape (B, ...)
            The batch.
        g : Tensor of shape (B, C)
            Its network outputs.
        psi : Tensor of shape (B, F)
            Its penultimate features.
        """
        self._local.pinned = (weakref.ref(x), x._version, g, psi)

    def unpin(self):
        """Forget the outputs given by :meth:`pin` in this thread."""
        self._local.pinned = None
