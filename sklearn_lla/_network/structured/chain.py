"""Exact Jacobian products for chains of ``nn.Linear`` layers and elementwise maps.

:meth:`StructuredChain.trace` recognises networks that are a single chain
``input -> pre-ops -> (Linear -> elementwise maps)*`` (see
:mod:`sklearn_lla._network.structured.trace` for what is accepted) and says why when a network
is not one. A chain evaluates the network, its factored Jacobian rows
(:class:`~sklearn_lla._network.structured.jacobian.StructuredJacobian`: Gram matrices, row
norms, ``J^T U`` and ``J V`` without per-example Jacobians), Jacobian-vector products
for many tangents in one pass and vector-Jacobian products for many cotangents.

Everything here is thread-safe: derivatives of the elementwise maps come from closed
forms or from reverse-mode autograd (grad mode is thread-local), never from
forward-mode AD, whose dual levels are process-global.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .jacobian import LayerFactor, StructuredJacobian
from .trace import Linear, NotAChain, Op, probe_input, trace_chain, value_and_derivative

__all__ = ["StructuredChain", "StructuredJacobian"]

#: Largest number of elements of the per-direction temporaries of
#: :meth:`StructuredChain.vjp` before it splits the ``K`` cotangents.
_VJP_CHUNK_ELEMENTS = 1 << 24


class StructuredChain:
    """A network recognised as ``pre-ops -> (Linear -> elementwise ops)*``.

    Build it with :meth:`trace` (which says why a network is not supported) or
    :meth:`from_module`, not with the constructor. All methods are functional: they
    take the parameters and buffers as dictionaries keyed like
    ``module.named_parameters()`` / ``module.named_buffers()`` (``None`` or missing
    buffers fall back to the module's own; ``params`` must hold every parameter of the
    chain, linearised or not), compute in the dtype of the parameters on ``x.device``,
    build no autograd graph that outlives a call, and evaluate the network in eval mode
    (dropout is the identity). They are safe to call from several threads at once.

    Parameters
    ----------
    pre : list of Op
        Elementwise maps before the first linear layer.
    linears : list of Linear
        The linear layers.
    post : list of list of Op
        The elementwise maps after each linear layer.
    param_names : list of str
        All parameter names, in ``module.named_parameters()`` order.
    default_buffers : dict of str to Tensor
        The module's buffers, used when a call passes none.

    Attributes
    ----------
    param_names : list of str
        All parameter names, in ``module.named_parameters()`` order.
    n_outputs : int
        Number ``C`` of network outputs.
    n_features : int
        Input width of the first linear layer (after any ``flatten``).
    n_linear : int
        Number of linear layers.
    """

    def __init__(
        self,
        pre: list[Op],
        linears: list[Linear],
        post: list[list[Op]],
        param_names: list[str],
        default_buffers: dict[str, Tensor],
    ) -> None:
        self._pre = pre
        self._linears = linears
        self._post = post
        self.param_names = list(param_names)
        self._default_buffers = default_buffers
        self.n_outputs = linears[-1].out_features
        self.n_features = linears[0].in_features
        self.n_linear = len(linears)

    def __repr__(self) -> str:
        parts = [op.description for op in self._pre]
        for lin, ops in zip(self._linears, self._post):
            parts.append(f"Linear({lin.in_features}->{lin.out_features}, {lin.weight_name})")
            parts += [op.description for op in ops if not op.identity]
        return "StructuredChain(" + " -> ".join(parts) + ")"

    @property
    def description(self) -> str:
        """Summarise the chain, e.g. ``"chain of 4 nn.Linear layers and elementwise maps"``."""
        n = self.n_linear
        return f"chain of {n} nn.Linear layer{'s' if n > 1 else ''} and elementwise maps"

    # -- recognition ----------------------------------------------------------------

    @classmethod
    def trace(
        cls, module: nn.Module, example_input: Tensor | None = None
    ) -> tuple[StructuredChain | None, str]:
        """Recognise ``module`` as a chain, or say why it is not one.

        The module is run once (in eval mode, on a copy sharing its tensors) on
        ``example_input``, or on a random ``(2, d)`` probe when it is ``None`` (``d``
        the input width of its first ``nn.Linear``), while a thread-local torch
        function mode records every operation on the value flowing from the input to
        the output. The recorded chain is then replayed and must reproduce the
        module's output on that input.

        Parameters
        ----------
        module : nn.Module
            The network.
        example_input : Tensor of shape (B, ...), optional
            A small input batch; its first rows are used.

        Returns
        -------
        chain : StructuredChain or None
            The chain, or ``None`` when ``module`` is not a supported chain.
        reason : str
            The chain's :attr:`description`, or why the module is not supported.
        """
        try:
            x = probe_input(module) if example_input is None else example_input[:2]
            spec, out = trace_chain(module, x)
        except NotAChain as exc:
            return None, str(exc)
        chain = cls(spec.pre, spec.linears, spec.post, spec.param_names, spec.buffers)
        params = dict(module.named_parameters())
        try:
            with torch.no_grad():
                got = chain.forward(params, spec.buffers, x)
        except Exception as exc:  # noqa: BLE001 - reported as the reason
            return None, f"replaying the recorded chain failed ({type(exc).__name__}: {exc})"
        out = out.detach()
        if spec.squeezed and out.ndim == 1:
            out = out.unsqueeze(-1)  # the chain keeps the (B, 1) shape
        if got.shape != out.shape or not torch.allclose(
            got, out.to(got.dtype), rtol=1e-4, atol=1e-6 * (1 + out.abs().max().item())
        ):
            return None, ("replaying the recorded chain did not reproduce the module's "
                          "output (an operation escaped the recording)")
        return chain, chain.description

    @classmethod
    def from_module(
        cls, module: nn.Module, example_input: Tensor | None = None
    ) -> StructuredChain | None:
        """Recognise ``module`` as a chain, like :meth:`trace` without the reason.

        Parameters
        ----------
        module : nn.Module
            The network.
        example_input : Tensor of shape (B, ...), optional
            A small input batch; its first rows are used.

        Returns
        -------
        StructuredChain or None
            ``None`` when ``module`` is not a supported chain.
        """
        return cls.trace(module, example_input)[0]

    # -- evaluation -----------------------------------------------------------------

    def _prepare(
        self,
        params: dict[str, Tensor],
        buffers: dict[str, Tensor] | None,
        x: Tensor,
    ) -> tuple[Tensor, dict[str, Tensor], list[tuple[Tensor, Tensor | None]]]:
        """Input after the pre-ops, buffers, and the (weight, bias) of each layer."""
        if buffers is None:
            buffers = self._default_buffers
        elif any(k not in buffers for k in self._default_buffers):
            buffers = {**self._default_buffers, **buffers}
        weights = [
            (params[lin.weight_name], params[lin.bias_name] if lin.has_bias else None)
            for lin in self._linears
        ]
        dtype = weights[0][0].dtype
        if x.ndim < 2:
            raise ValueError(f"x must have a leading batch dimension, got shape {tuple(x.shape)}")
        B = x.shape[0]
        h = x.to(dtype)
        for op in self._pre:
            h = op(h, buffers)
        if h.ndim != 2 or h.shape != (B, self.n_features):
            raise ValueError(
                f"the input of the first linear layer has shape {tuple(h.shape)}, "
                f"expected ({B}, {self.n_features})"
            )
        return h, buffers, weights

    def forward(
        self,
        params: dict[str, Tensor],
        buffers: dict[str, Tensor] | None,
        x: Tensor,
    ) -> Tensor:
        """Evaluate the network like ``functional_call(module, (params, buffers), (x,))``.

        Parameters
        ----------
        params : dict
            Parameters keyed like ``module.named_parameters()``.
        buffers : dict or None
            Buffers keyed like ``module.named_buffers()``.
        x : Tensor of shape (B, ...)
            Input batch.

        Returns
        -------
        Tensor of shape (B, C)
            The network output (``(B, 1)`` also for a network that squeezes its one
            output to ``(B,)``).
        """
        h, buffers, weights = self._prepare(params, buffers, x)
        for (W, b), ops in zip(weights, self._post):
            h = F.linear(h, W, b)
            for op in ops:
                if not op.identity:
                    h = op(h, buffers)
        return h

    __call__ = forward

    def _forward_collect(self, params, buffers, x, differentiable=False):
        """Forward pass keeping each layer's input and ``prod f'(h)`` of its trailing ops.

        Returns ``(output, acts, derivs, weights)``; ``derivs[l]`` is ``None`` (all
        ones) or a tensor of the layer's output shape. ``differentiable``: the
        derivatives keep their autograd graph (see :func:`value_and_derivative`).
        """
        h, buffers, weights = self._prepare(params, buffers, x)
        acts: list[Tensor] = []
        derivs: list[Tensor | None] = []
        for (W, b), ops in zip(weights, self._post):
            acts.append(h)
            h = F.linear(h, W, b)
            d = None
            for op in ops:
                if op.identity:
                    continue
                h, dh = value_and_derivative(op, h, buffers, create_graph=differentiable)
                if dh is not None:
                    d = dh if d is None else d * dh
            derivs.append(None if d is None else torch.broadcast_to(d, h.shape))
        return h, acts, derivs, weights

    def _selection(self, param_names) -> tuple[set[str], int]:
        """The selected names and the index of the first layer holding one of them."""
        if param_names is None:
            return set(self.param_names), 0
        sel = set(param_names)
        unknown = sel - set(self.param_names)
        if unknown:
            raise ValueError(f"unknown parameter names {sorted(unknown)}")
        for li, lin in enumerate(self._linears):
            if lin.weight_name in sel or (lin.has_bias and lin.bias_name in sel):
                return sel, li
        raise ValueError("param_names selects no parameter")

    def features(
        self,
        params: dict[str, Tensor],
        buffers: dict[str, Tensor] | None,
        x: Tensor,
        out_idx: Tensor | None = None,
        param_names: list[str] | None = None,
        differentiable: bool = False,
    ) -> StructuredJacobian:
        """Factor the Jacobian rows of the outputs at ``x``.

        Parameters
        ----------
        params, buffers : dict
            As in :meth:`forward`.
        x : Tensor of shape (B, ...)
            Input batch.
        out_idx : LongTensor of shape (B,), optional
            ``None``: all ``C`` outputs, rows ``b * C + c``. Otherwise one row per
            point, the gradient of output ``out_idx[b]`` at ``x[b]``.
        param_names : list of str, optional
            The parameters to differentiate with respect to (the Jacobian's columns);
            ``None`` means all. Deltas are not propagated below the lowest layer
            holding one of them.
        differentiable : bool, default=False
            Build the factors with operations that autograd can differentiate with
            respect to ``x`` (and the parameters) when they require grad, including
            the derivatives of the elementwise maps (second derivatives of the
            network): the NTK's gradient w.r.t. its inputs (VaLLA's inducing points).

        Returns
        -------
        StructuredJacobian
            With ``.output`` the network output ``(B, C)``.
        """
        sel, lowest = self._selection(param_names)
        output, acts, derivs, weights = self._forward_collect(params, buffers, x,
                                                              differentiable)
        B, C = output.shape[0], self.n_outputs
        dtype, device = output.dtype, output.device
        if out_idx is None:
            k = C
            eye = torch.eye(C, dtype=dtype, device=device)
            if derivs[-1] is None:
                delta = eye.expand(B, C, C).reshape(B * C, C)
            else:
                delta = (eye * derivs[-1][:, None, :]).reshape(B * C, C)
        else:
            out_idx = torch.as_tensor(out_idx, device=device).long().reshape(-1)
            if out_idx.shape[0] != B:
                raise ValueError(f"out_idx must have shape ({B},), got {tuple(out_idx.shape)}")
            k = 1
            delta = F.one_hot(out_idx, C).to(dtype)
            if derivs[-1] is not None:
                delta = delta * derivs[-1]
        layers: list[LayerFactor] = []
        for li in range(len(self._linears) - 1, lowest - 1, -1):
            lin = self._linears[li]
            wname = lin.weight_name if lin.weight_name in sel else None
            bname = lin.bias_name if lin.has_bias and lin.bias_name in sel else None
            if wname is not None or bname is not None:
                layers.append(LayerFactor(delta, acts[li], wname, bname))
            if li > lowest:
                delta = delta @ weights[li][0]  # (n_rows, out_{l-1})
                d = derivs[li - 1]
                if d is not None:
                    o = delta.shape[1]
                    delta = (delta.view(B, k, o) * d[:, None, :]).view(B * k, o)
        layers.reverse()
        names = [n for n in self.param_names if n in sel]
        return StructuredJacobian(layers, k, names, output)

    def jvp(
        self,
        params: dict[str, Tensor],
        buffers: dict[str, Tensor] | None,
        x: Tensor,
        tangents: dict[str, Tensor],
    ) -> tuple[Tensor, Tensor]:
        """Compute Jacobian-vector products for ``K`` parameter directions in one pass.

        Parameters
        ----------
        params, buffers : dict
            As in :meth:`forward`.
        x : Tensor of shape (B, ...)
            Input batch.
        tangents : dict
            ``{name: Tensor of shape (K, *param.shape)}``; missing names count as 0.

        Returns
        -------
        output : Tensor of shape (B, C)
            The network output.
        jvp : Tensor of shape (B, C, K)
            ``J(x) t_k`` for every direction ``k``.
        """
        Kdim = next((t.shape[0] for t in tangents.values()), None)
        if Kdim is None:
            raise ValueError("tangents is empty")
        names = [n for n in self.param_names if n in tangents]
        if Kdim > self.n_outputs and names:
            # Reverse mode: back-propagate one delta per output (2 C P multiply-adds a
            # point), then one GEMM a_l @ V_l per layer (K P): about half the work of
            # pushing K tangents forward (W dA and dW a per layer, 2 K P), and 2-3x
            # faster measured on a 3 x 200 MLP at K = 20 (benchmarks/bench_scale.py).
            jac = self.features(params, buffers, x, param_names=names)
            B = jac.output.shape[0]
            return jac.output, jac.matmul(tangents).view(B, self.n_outputs, Kdim)
        h, acts, derivs, weights = self._forward_collect(params, buffers, x)
        B, dtype, device = h.shape[0], h.dtype, h.device
        dA: Tensor | None = None  # (B, width, K); None while no tangent has entered
        for (W, _), a, d, lin in zip(weights, acts, derivs, self._linears):
            dW = tangents.get(lin.weight_name)
            db = tangents.get(lin.bias_name) if lin.has_bias else None
            o, i = lin.out_features, lin.in_features
            dh = None if dA is None else W @ dA  # (B, o, K)
            if dW is not None:
                dWf = dW.to(dtype).reshape(Kdim * o, i)
                z = (a @ dWf.T).view(B, Kdim, o).transpose(1, 2)
                dh = z if dh is None else dh.add_(z)
            if db is not None:
                dbT = db.to(dtype).reshape(Kdim, o).T  # (o, K)
                dh = dbT.expand(B, o, Kdim) if dh is None else dh + dbT
            if dh is not None and d is not None:
                dh = dh * d[:, :, None]
            dA = dh
        if dA is None:
            dA = torch.zeros(B, self.n_outputs, Kdim, dtype=dtype, device=device)
        return h, dA

    def vjp(
        self,
        params: dict[str, Tensor],
        buffers: dict[str, Tensor] | None,
        x: Tensor,
        cotangents: Tensor,
        param_names: list[str] | None = None,
    ) -> dict[str, Tensor]:
        """Compute vector-Jacobian products ``sum_b J(x_b)^T u_k[b]`` for ``K`` cotangents.

        Parameters
        ----------
        params, buffers : dict
            As in :meth:`forward`.
        x : Tensor of shape (B, ...)
            Input batch.
        cotangents : Tensor of shape (K, B, C)
            The cotangents ``u_k`` over the outputs.
        param_names : list of str, optional
            The parameters to return (``None``: all).

        Returns
        -------
        dict
            ``{name: Tensor of shape (K, *param.shape)}`` in :attr:`param_names` order.
        """
        sel, lowest = self._selection(param_names)
        output, acts, derivs, weights = self._forward_collect(params, buffers, x)
        B, C = output.shape
        if cotangents.ndim != 3 or cotangents.shape[1:] != (B, C):
            raise ValueError(f"cotangents must have shape (K, {B}, {C}), "
                             f"got {tuple(cotangents.shape)}")
        Kdim = cotangents.shape[0]
        dtype, device = output.dtype, output.device
        res: dict[str, Tensor] = {}
        for li in range(lowest, len(self._linears)):
            lin = self._linears[li]
            if lin.weight_name in sel:
                res[lin.weight_name] = torch.empty(
                    Kdim, lin.out_features, lin.in_features, dtype=dtype, device=device)
            if lin.has_bias and lin.bias_name in sel:
                res[lin.bias_name] = torch.empty(Kdim, lin.out_features, dtype=dtype,
                                                 device=device)
        width = max(lin.out_features for lin in self._linears)
        step = max(1, _VJP_CHUNK_ELEMENTS // max(1, B * width))
        U = cotangents.to(dtype)
        for s in range(0, Kdim, step):
            delta = U[s : s + step].transpose(0, 1)  # (B, Kc, C)
            Kc = delta.shape[1]
            if derivs[-1] is not None:
                delta = delta * derivs[-1][:, None, :]
            for li in range(len(self._linears) - 1, lowest - 1, -1):
                lin = self._linears[li]
                o = lin.out_features
                if lin.weight_name in sel:  # sum_b delta[b, k, o] a[b, i]
                    gw = delta.permute(1, 2, 0).reshape(Kc * o, B) @ acts[li]
                    res[lin.weight_name][s : s + Kc] = gw.view(Kc, o, lin.in_features)
                if lin.has_bias and lin.bias_name in sel:
                    res[lin.bias_name][s : s + Kc] = delta.sum(0)
                if li > lowest:
                    delta = delta @ weights[li][0]  # (B, Kc, out_{l-1})
                    d = derivs[li - 1]
                    if d is not None:
                        delta = delta * d[:, None, :]
        return {n: res[n] for n in self.param_names if n in sel}
