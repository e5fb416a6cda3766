"""Exact Jacobian / NTK algebra for chains of ``nn.Linear`` layers and elementwise maps.

For a linear layer ``h = W a + b`` the gradient of any scalar output with respect to
``W`` is the outer product ``delta a^T`` with ``delta = d output / d h``, and the
gradient with respect to ``b`` is ``delta``. Two Jacobian rows ``r = (x, o)`` and
``r' = (x', o')`` therefore have the inner product

.. math::

    \\langle J_r, J_{r'} \\rangle = \\sum_l (\\delta_l(r) \\cdot \\delta_l(r'))
        (a_l(x) \\cdot a_l(x') + [\\text{layer } l \\text{ has a bias}]),

so Gram matrices, row norms, ``J^T U`` and ``J V`` can be computed from the per-layer
activations ``a_l`` (one per point) and the back-propagated ``delta_l`` (one per row)
without ever forming a per-example Jacobian (VaLLA thesis, appendix "Efficient
Kernel Computation for MLP").

:meth:`StructuredChain.from_module` recognises networks whose traced graph is a
single chain ``input -> ops -> output`` of ``nn.Linear`` layers and elementwise
maps (activations, dropout in eval mode, affine standardisation with buffers or
numbers, ``flatten`` before the first layer); for anything else it returns ``None``
so that callers can fall back to generic autograd code.
"""

from __future__ import annotations

import copy
import numbers
import operator
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["StructuredChain", "StructuredJacobian"]

#: Largest number of elements of a temporary created by :meth:`StructuredJacobian.vjp`
#: and :meth:`StructuredJacobian.matmul` before they split the ``K`` directions.
_CHUNK_ELEMENTS = 1 << 24

# ---------------------------------------------------------------------------------
# Whitelists
# ---------------------------------------------------------------------------------

#: Parameter-free elementwise modules that are called as they are.
_ELEMENTWISE_MODULES: tuple[type[nn.Module], ...] = (
    nn.Tanh,
    nn.ReLU,
    nn.Sigmoid,
    nn.GELU,
    nn.SiLU,
    nn.ELU,
    nn.LeakyReLU,
    nn.Softplus,
    nn.Mish,
    nn.Hardtanh,
    nn.Tanhshrink,
    nn.Softsign,
    nn.ReLU6,
    nn.SELU,
    nn.CELU,
    nn.Hardswish,
    nn.Hardsigmoid,
    nn.LogSigmoid,
)

#: Modules treated as the identity (the network is evaluated in eval mode).
_IDENTITY_MODULES: tuple[type[nn.Module], ...] = (nn.Identity, nn.Dropout, nn.AlphaDropout)

#: Elementwise functions ``f(x, *constants, **constants)``.
_ELEMENTWISE_FUNCTIONS: tuple[Callable, ...] = (
    torch.tanh,
    torch.relu,
    torch.sigmoid,
    torch.exp,
    torch.sin,
    torch.cos,
    torch.special.expit,
    F.relu,
    F.gelu,
    F.silu,
    F.softplus,
    F.elu,
    F.selu,
    F.celu,
    F.leaky_relu,
    F.relu6,
    F.mish,
    F.hardtanh,
    F.hardswish,
    F.hardsigmoid,
    F.logsigmoid,
    F.softsign,
    F.tanhshrink,
    F.tanh,
    F.sigmoid,
    operator.neg,
    torch.neg,
)

#: Elementwise tensor methods ``x.name()``.
_ELEMENTWISE_METHODS = {"tanh", "relu", "sigmoid", "exp", "neg"}

#: Binary functions combining the chain value with a number or a buffer.
_BINARY_FUNCTIONS: tuple[Callable, ...] = (
    operator.add,
    operator.sub,
    operator.mul,
    operator.truediv,
    torch.add,
    torch.sub,
    torch.mul,
    torch.div,
    torch.true_divide,
)
_BINARY_METHODS = {"add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": torch.div}


def _in(fn: Any, candidates) -> bool:
    """Membership by identity (functions are not reliably hashable / comparable)."""
    return any(fn is c for c in candidates)


def _forward_is(mod: nn.Module, bases: tuple[type[nn.Module], ...]) -> bool:
    """Whether ``mod`` is one of ``bases`` without an overridden ``forward``."""
    for base in bases:
        if isinstance(mod, base) and type(mod).forward is base.forward:
            return True
    return False


def _has_node(obj: Any) -> bool:
    found = []
    torch.fx.node.map_arg(obj, lambda n: found.append(n))
    return bool(found)


# ---------------------------------------------------------------------------------
# Ops
# ---------------------------------------------------------------------------------


@dataclass
class _Linear:
    """One ``nn.Linear`` (or ``F.linear`` on parameters) of the chain."""

    weight_name: str
    bias_name: str | None
    in_features: int
    out_features: int

    @property
    def has_bias(self) -> bool:
        return self.bias_name is not None


@dataclass
class _Elementwise:
    """An elementwise map ``h -> fn(h, buffers)``; ``identity`` ops are skipped."""

    fn: Callable[[Tensor, dict[str, Tensor]], Tensor]
    description: str
    identity: bool = False


def _identity_op(description: str) -> _Elementwise:
    return _Elementwise(lambda h, bufs: h, description, identity=True)


def _module_op(mod: nn.Module, target: str) -> _Elementwise:
    if getattr(mod, "inplace", False):
        # the pre-activation is needed afterwards for the derivative
        mod = copy.deepcopy(mod)
        mod.inplace = False
    return _Elementwise(lambda h, bufs: mod(h), f"{type(mod).__name__}({target})")


def _function_op(fn: Callable, args: tuple, kwargs: dict) -> _Elementwise:
    kwargs = dict(kwargs)
    if "inplace" in kwargs:
        kwargs["inplace"] = False
    name = getattr(fn, "__name__", repr(fn))
    return _Elementwise(lambda h, bufs: fn(h, *args, **kwargs), name)


def _binary_op(fn: Callable, chain_first: bool, other: Any, is_buffer: bool) -> _Elementwise:
    name = getattr(fn, "__name__", repr(fn))
    if is_buffer:
        buf_name = other

        def get(h: Tensor, bufs: dict[str, Tensor]) -> Tensor:
            b = bufs[buf_name]
            if b.is_floating_point() and b.dtype != h.dtype:
                b = b.to(h.dtype)
            return b

        if chain_first:
            return _Elementwise(lambda h, bufs: fn(h, get(h, bufs)), f"{name}(x, {buf_name})")
        return _Elementwise(lambda h, bufs: fn(get(h, bufs), h), f"{name}({buf_name}, x)")
    if chain_first:
        return _Elementwise(lambda h, bufs: fn(h, other), f"{name}(x, {other!r})")
    return _Elementwise(lambda h, bufs: fn(other, h), f"{name}({other!r}, x)")


def _flatten_op() -> _Elementwise:
    return _Elementwise(lambda h, bufs: torch.flatten(h, 1), "flatten(x, 1)")


_JVP_WARMED_UP = False


def _value_and_derivative(op: _Elementwise, h: Tensor, bufs: dict[str, Tensor]):
    """``(f(h), f'(h))`` of an elementwise ``f`` by one forward-mode pass."""
    global _JVP_WARMED_UP
    if not _JVP_WARMED_UP:
        # torch's first forward-mode call loads decompositions via the deprecated
        # torch.jit.script; keep its DeprecationWarnings away from users
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", category=DeprecationWarning)
            res = torch.func.jvp(lambda t: op.fn(t, bufs), (h,), (torch.ones_like(h),))
        _JVP_WARMED_UP = True
        return res
    return torch.func.jvp(lambda t: op.fn(t, bufs), (h,), (torch.ones_like(h),))


class _Unsupported(Exception):
    """Raised internally while parsing a graph that is not a supported chain."""


# ---------------------------------------------------------------------------------
# Jacobian representation
# ---------------------------------------------------------------------------------


@dataclass
class _LayerFactor:
    """Factors of one linear layer's Jacobian block: rows ``delta[r] (x) a[point(r)]``."""

    delta: Tensor  # (n_rows, out_features)
    act: Tensor  # (n_points, in_features)
    weight_name: str
    bias_name: str | None

    @property
    def has_bias(self) -> bool:
        return self.bias_name is not None

    def act_sq_norm(self) -> Tensor:
        """``|a(x)|^2 (+1 for the bias)`` per point: the input side of a row's norm."""
        an = self.act.pow(2).sum(-1)
        return an + 1.0 if self.has_bias else an


class StructuredJacobian:
    """Compact, exact representation of Jacobian rows of a :class:`StructuredChain`.

    Row ``r`` belongs to point ``r // rows_per_point``; the block of the row for the
    weight of linear layer ``l`` is ``delta_l[r] (outer) a_l[point]`` and the block for
    its bias is ``delta_l[r]``.

    Parameters
    ----------
    layers : list of _LayerFactor
        Per linear layer: ``delta`` of shape ``(n_rows, out_l)``, ``act`` of shape
        ``(n_points, in_l)``, and the names of its weight and (optional) bias.
    rows_per_point : int
        Number of consecutive rows per point (``C`` for all outputs, 1 for one
        selected output per point).
    param_names : list of str
        All parameter names in ``module.named_parameters()`` order.
    output : Tensor of shape (n_points, C)
        Network output at the points.

    Attributes
    ----------
    n_rows, n_points : int
        Number of rows and of points.
    """

    def __init__(
        self,
        layers: list[_LayerFactor],
        rows_per_point: int,
        param_names: list[str],
        output: Tensor,
    ) -> None:
        self.layers = layers
        self.rows_per_point = int(rows_per_point)
        self.param_names = list(param_names)
        self.output = output
        self.n_points = int(layers[0].act.shape[0])
        self.n_rows = int(layers[0].delta.shape[0])
        if self.n_rows != self.n_points * self.rows_per_point:
            raise ValueError("inconsistent numbers of rows and points")
        self._where: dict[str, tuple[int, str]] = {}
        for i, layer in enumerate(layers):
            self._where[layer.weight_name] = (i, "weight")
            if layer.bias_name is not None:
                self._where[layer.bias_name] = (i, "bias")

    def __len__(self) -> int:
        return self.n_rows

    @property
    def n_params(self) -> int:
        """Total number of parameters (columns of the Jacobian)."""
        return sum(
            l.delta.shape[1] * (l.act.shape[1] + (1 if l.has_bias else 0)) for l in self.layers
        )

    @property
    def dtype(self) -> torch.dtype:
        return self.layers[0].delta.dtype

    @property
    def device(self) -> torch.device:
        return self.layers[0].delta.device

    def _check_compatible(self, other: "StructuredJacobian") -> None:
        if len(self.layers) != len(other.layers) or any(
            (a.weight_name, a.bias_name, a.delta.shape[1], a.act.shape[1])
            != (b.weight_name, b.bias_name, b.delta.shape[1], b.act.shape[1])
            for a, b in zip(self.layers, other.layers)
        ):
            raise ValueError("the two StructuredJacobians come from different networks")

    # -- kernel algebra -------------------------------------------------------------

    def gram(self, other: "StructuredJacobian | None" = None) -> Tensor:
        """Exact cross-Gram matrix ``J_self @ J_other^T``.

        Parameters
        ----------
        other : StructuredJacobian, optional
            Rows of the same network; defaults to ``self``.

        Returns
        -------
        Tensor of shape (n_rows_self, n_rows_other)
        """
        if other is None:
            other = self
        self._check_compatible(other)
        B1, k1 = self.n_points, self.rows_per_point
        B2, k2 = other.n_points, other.rows_per_point
        G = None
        for a, b in zip(self.layers, other.layers):
            K = a.act @ b.act.T  # (B1, B2)
            if a.has_bias:
                K += 1.0
            DD = a.delta @ b.delta.T  # (n1, n2)
            if k1 == 1 and k2 == 1:
                term = DD.mul_(K)
            else:
                term = DD.view(B1, k1, B2, k2).mul_(K[:, None, :, None]).view(B1 * k1, B2 * k2)
            G = term if G is None else G.add_(term)
        return G

    def diag(self) -> Tensor:
        """Squared norms of the rows (diagonal of :meth:`gram`) without the Gram matrix.

        Returns
        -------
        Tensor of shape (n_rows,)
        """
        B, k = self.n_points, self.rows_per_point
        out = None
        for layer in self.layers:
            dn = layer.delta.pow(2).sum(-1).view(B, k) * layer.act_sq_norm()[:, None]
            out = dn if out is None else out.add_(dn)
        return out.reshape(-1)

    def diag_blocks(self) -> Tensor:
        """Per-point blocks of :meth:`gram` (the rows of one point against each other).

        Returns
        -------
        Tensor of shape (n_points, rows_per_point, rows_per_point)
        """
        B, k = self.n_points, self.rows_per_point
        out = None
        for layer in self.layers:
            d = layer.delta.view(B, k, -1)
            blk = (d @ d.transpose(1, 2)).mul_(layer.act_sq_norm()[:, None, None])
            out = blk if out is None else out.add_(blk)
        return out

    def vjp(self, U: Tensor) -> dict[str, Tensor]:
        """``J^T U`` per parameter, never forming Jacobian rows.

        Parameters
        ----------
        U : Tensor of shape (n_rows, K)

        Returns
        -------
        dict
            ``{name: Tensor of shape (K, *param.shape)}`` in ``named_parameters``
            order.
        """
        if U.ndim != 2 or U.shape[0] != self.n_rows:
            raise ValueError(f"U must have shape ({self.n_rows}, K), got {tuple(U.shape)}")
        B, k = self.n_points, self.rows_per_point
        Kdim = U.shape[1]
        U = U.to(self.dtype)
        Ub = U.view(B, k, Kdim)
        res: dict[str, Tensor] = {}
        for layer in self.layers:
            o, i = layer.delta.shape[1], layer.act.shape[1]
            D = layer.delta.view(B, k, o)
            gw = torch.empty(Kdim, o, i, dtype=self.dtype, device=self.device)
            gb = (
                torch.empty(Kdim, o, dtype=self.dtype, device=self.device)
                if layer.has_bias
                else None
            )
            step = max(1, _CHUNK_ELEMENTS // max(1, B * o))
            for s in range(0, Kdim, step):
                Uc = Ub[:, :, s : s + step]  # (B, k, Kc)
                T = Uc.transpose(1, 2) @ D  # (B, Kc, o)
                Kc = T.shape[1]
                # sum_b T[b, kc, o] a[b, i]
                gw[s : s + Kc] = (T.reshape(B, Kc * o).T @ layer.act).view(Kc, o, i)
                if gb is not None:
                    gb[s : s + Kc] = T.sum(0)
            res[layer.weight_name] = gw
            if gb is not None:
                res[layer.bias_name] = gb
        return {name: res[name] for name in self.param_names}

    def matmul(self, V: dict[str, Tensor]) -> Tensor:
        """``J @ V`` for directions ``V`` in parameter space, computed layer-wise.

        Parameters
        ----------
        V : dict
            ``{name: Tensor of shape (K, *param.shape)}``; missing names count as 0.

        Returns
        -------
        Tensor of shape (n_rows, K)
        """
        Kdim = None
        for v in V.values():
            Kdim = v.shape[0]
            break
        if Kdim is None:
            raise ValueError("V is empty")
        B, k = self.n_points, self.rows_per_point
        out = torch.zeros(B, k, Kdim, dtype=self.dtype, device=self.device)
        for layer in self.layers:
            o, i = layer.delta.shape[1], layer.act.shape[1]
            VW = V.get(layer.weight_name)
            Vb = V.get(layer.bias_name) if layer.has_bias else None
            if VW is None and Vb is None:
                continue
            D = layer.delta.view(B, k, o)
            step = max(1, _CHUNK_ELEMENTS // max(1, B * o))
            for s in range(0, Kdim, step):
                Kc = min(step, Kdim - s)
                Z = None  # (B, o, Kc): V_W[k] @ a[b] + V_b[k]
                if VW is not None:
                    VWc = VW[s : s + Kc].to(self.dtype).reshape(Kc * o, i)
                    Z = (layer.act @ VWc.T).view(B, Kc, o).transpose(1, 2)
                if Vb is not None:
                    Vbc = Vb[s : s + Kc].to(self.dtype).reshape(Kc, o).T  # (o, Kc)
                    Z = Vbc.expand(B, o, Kc) if Z is None else Z + Vbc
                out[:, :, s : s + Kc] += D @ Z
        return out.view(B * k, Kdim)

    def dense(self) -> Tensor:
        """Explicit Jacobian rows (small problems and tests only).

        Returns
        -------
        Tensor of shape (n_rows, n_params)
            Columns in ``named_parameters`` order, each parameter flattened.
        """
        B, k = self.n_points, self.rows_per_point
        blocks = []
        for name in self.param_names:
            li, kind = self._where[name]
            layer = self.layers[li]
            o, i = layer.delta.shape[1], layer.act.shape[1]
            if kind == "bias":
                blocks.append(layer.delta)
            else:
                D = layer.delta.view(B, k, o, 1)
                A = layer.act.view(B, 1, 1, i)
                blocks.append((D * A).reshape(B * k, o * i))
        return torch.cat(blocks, dim=1)


# ---------------------------------------------------------------------------------
# Chain
# ---------------------------------------------------------------------------------


class StructuredChain:
    """A network recognised as ``pre-ops -> (Linear -> elementwise ops)*``.

    Build it with :meth:`from_module`. All methods are functional: they take the
    parameters and buffers as dictionaries keyed like ``module.named_parameters()`` /
    ``module.named_buffers()`` (``None`` or missing buffers fall back to the module's
    own), compute in the dtype of the parameters on ``x.device``, use no autograd
    graph (they work under :func:`torch.no_grad`), and evaluate the network in eval
    mode (dropout is the identity).

    Attributes
    ----------
    param_names : list of str
        Parameter names in ``module.named_parameters()`` order.
    n_outputs : int
        Number ``C`` of network outputs.
    n_features : int
        Input width of the first linear layer (after any ``flatten``).
    """

    def __init__(
        self,
        pre: list[_Elementwise],
        linears: list[_Linear],
        post: list[list[_Elementwise]],
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

    def __repr__(self) -> str:
        parts = [op.description for op in self._pre]
        for lin, ops in zip(self._linears, self._post):
            parts.append(f"Linear({lin.in_features}->{lin.out_features}, {lin.weight_name})")
            parts += [op.description for op in ops if not op.identity]
        return "StructuredChain(" + " -> ".join(parts) + ")"

    # -- recognition ----------------------------------------------------------------

    @classmethod
    def from_module(cls, module: nn.Module) -> "StructuredChain | None":
        """Recognise ``module`` as a chain of linear layers and elementwise maps.

        The module is traced with :func:`torch.fx.symbolic_trace`. The traced graph
        must be a single chain ``placeholder -> ops -> output`` whose ops are

        * ``nn.Linear`` modules (or ``F.linear`` on parameters), each used once;
        * parameter-free elementwise activation modules (``Tanh``, ``ReLU``,
          ``Sigmoid``, ``GELU``, ``SiLU``, ``ELU``, ``LeakyReLU``, ``Softplus``,
          ``Mish``, ``Hardtanh``, ``Tanhshrink``, ``Softsign``, ...), ``Identity`` and
          ``Dropout`` / ``AlphaDropout`` (identity: eval mode);
        * elementwise functions and methods (``torch.tanh``, ``F.relu``, ``F.gelu``,
          ``x.sigmoid()``, ...);
        * ``+ - * /`` with a python number or a *buffer* that broadcasts along the
          last dimension without changing the shape of the chain value;
        * ``torch.flatten(x, 1)`` / ``nn.Flatten()`` before the first linear layer.

        Every parameter of the module must belong to one of the linear layers.

        Parameters
        ----------
        module : nn.Module

        Returns
        -------
        StructuredChain or None
            ``None`` (never an exception) when the module is not such a chain.
        """
        try:
            return cls._parse(module)
        except Exception:  # noqa: BLE001 - any failure means "not supported"
            return None

    @classmethod
    def _parse(cls, module: nn.Module) -> "StructuredChain | None":
        from torch.nn.modules import module as _module_mod

        if getattr(_module_mod, "_global_forward_hooks", None) or getattr(
            _module_mod, "_global_forward_pre_hooks", None
        ):
            return None
        for m in module.modules():
            if m._forward_hooks or m._forward_pre_hooks:
                return None
        named_params = dict(module.named_parameters())
        named_buffers = dict(module.named_buffers())
        graph = torch.fx.symbolic_trace(module).graph
        nodes = list(graph.nodes)
        placeholders = [n for n in nodes if n.op == "placeholder"]
        if len(placeholders) != 1:
            return None

        pre: list[_Elementwise] = []
        linears: list[_Linear] = []
        post: list[list[_Elementwise]] = []
        used_modules: set[str] = set()
        used_params: list[str] = []
        visited = {placeholders[0]}
        get_attrs = set()

        def width() -> int | None:
            return linears[-1].out_features if linears else None

        def add_elementwise(op: _Elementwise) -> None:
            (post[-1] if linears else pre).append(op)

        def buffer_operand(node: torch.fx.Node) -> str:
            if node.op != "get_attr" or node.target not in named_buffers:
                raise _Unsupported("operand is not a buffer")
            shape = tuple(named_buffers[node.target].shape)
            w = width()
            if w is not None:
                ok = (
                    len(shape) <= 2
                    and all(s == 1 for s in shape[:-1])
                    and (len(shape) == 0 or shape[-1] in (1, w))
                )
                if not ok:
                    raise _Unsupported("buffer does not broadcast along the last dimension")
            get_attrs.add(node)
            return node.target

        def param_operand(node: Any) -> str:
            if not isinstance(node, torch.fx.Node) or node.op != "get_attr":
                raise _Unsupported("F.linear operand is not a parameter")
            if node.target not in named_params:
                raise _Unsupported("F.linear operand is not a parameter")
            get_attrs.add(node)
            return node.target

        def add_linear(weight_name: str, bias_name: str | None) -> None:
            W = named_params[weight_name]
            if W.ndim != 2:
                raise _Unsupported("weight is not a matrix")
            out_f, in_f = W.shape
            if bias_name is not None and tuple(named_params[bias_name].shape) != (out_f,):
                raise _Unsupported("bias shape")
            if linears and linears[-1].out_features != in_f:
                raise _Unsupported("widths of consecutive layers do not match")
            linears.append(_Linear(weight_name, bias_name, int(in_f), int(out_f)))
            post.append([])
            used_params.append(weight_name)
            if bias_name is not None:
                used_params.append(bias_name)

        cur = placeholders[0]
        while True:
            users = list(cur.users)
            if len(users) != 1:
                return None
            node = users[0]
            if node.op == "output":
                if node.args != (cur,) or node.kwargs:
                    return None
                visited.add(node)
                break
            visited.add(node)
            if node.op == "call_module":
                if node.args != (cur,) or node.kwargs:
                    return None
                target = str(node.target)
                mod = module.get_submodule(target)
                if _forward_is(mod, (nn.Linear,)):
                    if target in used_modules:
                        return None
                    used_modules.add(target)
                    wname = f"{target}.weight" if target else "weight"
                    bname = f"{target}.bias" if target else "bias"
                    if named_params.get(wname) is not mod.weight:
                        return None
                    if mod.bias is not None:
                        if named_params.get(bname) is not mod.bias:
                            return None
                    else:
                        bname = None
                    add_linear(wname, bname)
                elif _forward_is(mod, _IDENTITY_MODULES):
                    add_elementwise(_identity_op(f"{type(mod).__name__}({target})"))
                elif _forward_is(mod, _ELEMENTWISE_MODULES):
                    if any(True for _ in mod.parameters()) or any(True for _ in mod.buffers()):
                        return None
                    add_elementwise(_module_op(mod, target))
                elif _forward_is(mod, (nn.Flatten,)):
                    if linears or mod.start_dim != 1 or mod.end_dim != -1:
                        return None
                    pre.append(_flatten_op())
                else:
                    return None
            elif node.op in ("call_function", "call_method"):
                fn = node.target
                args, kwargs = tuple(node.args), dict(node.kwargs)
                is_method = node.op == "call_method"
                if not args:
                    return None
                if not is_method and fn is F.linear:
                    if args[0] is not cur or len(args) > 3 or set(kwargs) - {"bias"}:
                        return None
                    if len(args) < 2:
                        return None
                    wname = param_operand(args[1])
                    b = args[2] if len(args) == 3 else kwargs.get("bias")
                    bname = None if b is None else param_operand(b)
                    add_linear(wname, bname)
                elif (not is_method and fn is torch.flatten) or (is_method and fn == "flatten"):
                    if linears or args[0] is not cur:
                        return None
                    start = args[1] if len(args) > 1 else kwargs.get("start_dim", 0)
                    end = args[2] if len(args) > 2 else kwargs.get("end_dim", -1)
                    if start != 1 or end != -1 or len(args) > 3:
                        return None
                    if set(kwargs) - {"start_dim", "end_dim"}:
                        return None
                    pre.append(_flatten_op())
                elif (not is_method and _in(fn, _ELEMENTWISE_FUNCTIONS)) or (
                    is_method and fn in _ELEMENTWISE_METHODS
                ):
                    if args[0] is not cur or _has_node(args[1:]) or _has_node(kwargs):
                        return None
                    if is_method:
                        if len(args) != 1 or kwargs:
                            return None
                        method = fn
                        op = _Elementwise(
                            lambda h, bufs, _m=method: getattr(h, _m)(), f"x.{method}()"
                        )
                    else:
                        op = _function_op(fn, args[1:], kwargs)
                    add_elementwise(op)
                elif (not is_method and _in(fn, _BINARY_FUNCTIONS)) or (
                    is_method and fn in _BINARY_METHODS
                ):
                    if len(args) != 2 or kwargs:
                        return None
                    bfn = _BINARY_METHODS[fn] if is_method else fn
                    x0, x1 = args
                    if (x0 is cur) == (x1 is cur):
                        return None
                    other = x1 if x0 is cur else x0
                    if isinstance(other, torch.fx.Node):
                        op = _binary_op(bfn, x0 is cur, buffer_operand(other), is_buffer=True)
                    elif isinstance(other, numbers.Number) and not isinstance(other, complex):
                        op = _binary_op(bfn, x0 is cur, other, is_buffer=False)
                    else:
                        return None
                    add_elementwise(op)
                else:
                    return None
            else:
                return None
            cur = node

        if not linears:
            return None
        for n in get_attrs:
            if not all(u in visited for u in n.users):
                return None
        if visited | get_attrs != set(nodes):
            return None
        if len(used_params) != len(set(used_params)) or set(used_params) != set(named_params):
            return None
        dtypes = {named_params[n].dtype for n in used_params}
        if len(dtypes) != 1 or not next(iter(dtypes)).is_floating_point:
            return None
        return cls(pre, linears, post, list(named_params), named_buffers)

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
            (params[l.weight_name], params[l.bias_name] if l.has_bias else None)
            for l in self._linears
        ]
        dtype = weights[0][0].dtype
        if x.ndim < 2:
            raise ValueError(f"x must have a leading batch dimension, got shape {tuple(x.shape)}")
        B = x.shape[0]
        h = x.to(dtype)
        for op in self._pre:
            h = op.fn(h, buffers)
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
        """Network output, equal to ``functional_call(module, (params, buffers), (x,))``.

        Parameters
        ----------
        params : dict
            Parameters keyed like ``module.named_parameters()``.
        buffers : dict or None
            Buffers keyed like ``module.named_buffers()``.
        x : Tensor of shape (B, ...)

        Returns
        -------
        Tensor of shape (B, C)
        """
        h, buffers, weights = self._prepare(params, buffers, x)
        for (W, b), ops in zip(weights, self._post):
            h = F.linear(h, W, b)
            for op in ops:
                if not op.identity:
                    h = op.fn(h, buffers)
        return h

    __call__ = forward

    def features(
        self,
        params: dict[str, Tensor],
        buffers: dict[str, Tensor] | None,
        x: Tensor,
        out_idx: Tensor | None = None,
    ) -> StructuredJacobian:
        """Factored Jacobian rows of the outputs at ``x``.

        Parameters
        ----------
        params, buffers : dict
            As in :meth:`forward`.
        x : Tensor of shape (B, ...)
        out_idx : LongTensor of shape (B,), optional
            ``None``: all ``C`` outputs, rows ``b * C + c``. Otherwise one row per
            point, the gradient of output ``out_idx[b]`` at ``x[b]``.

        Returns
        -------
        StructuredJacobian
            With ``.output`` the network output ``(B, C)``.
        """
        h, buffers, weights = self._prepare(params, buffers, x)
        B, C = h.shape[0], self.n_outputs
        acts: list[Tensor] = []
        derivs: list[Tensor | None] = []  # product of f'(h) over each layer's trailing ops
        for (W, b), ops in zip(weights, self._post):
            acts.append(h)
            h = F.linear(h, W, b)
            d = None
            for op in ops:
                if op.identity:
                    continue
                h, dh = _value_and_derivative(op, h, buffers)
                d = dh if d is None else d * dh
            derivs.append(d)
        output = h

        dtype, device = h.dtype, h.device
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
        deltas: list[Tensor] = [delta]
        for li in range(len(self._linears) - 1, 0, -1):
            W = weights[li][0]
            delta = delta @ W  # (n_rows, in_l) = (n_rows, out_{l-1})
            d = derivs[li - 1]
            if d is not None:
                o = delta.shape[1]
                delta = (delta.view(B, k, o) * d[:, None, :]).view(B * k, o)
            deltas.append(delta)
        deltas.reverse()
        layers = [
            _LayerFactor(dl, al, lin.weight_name, lin.bias_name)
            for dl, al, lin in zip(deltas, acts, self._linears)
        ]
        return StructuredJacobian(layers, k, self.param_names, output)

    def jvp(
        self,
        params: dict[str, Tensor],
        buffers: dict[str, Tensor] | None,
        x: Tensor,
        tangents: dict[str, Tensor],
    ) -> tuple[Tensor, Tensor]:
        """Forward-mode Jacobian-vector products for ``K`` parameter directions.

        Parameters
        ----------
        params, buffers : dict
            As in :meth:`forward`.
        x : Tensor of shape (B, ...)
        tangents : dict
            ``{name: Tensor of shape (K, *param.shape)}``; missing names count as 0.

        Returns
        -------
        output : Tensor of shape (B, C)
        jvp : Tensor of shape (B, C, K)
            ``J(x) t_k`` for every direction ``k``.
        """
        h, buffers, weights = self._prepare(params, buffers, x)
        Kdim = None
        for t in tangents.values():
            Kdim = t.shape[0]
            break
        if Kdim is None:
            raise ValueError("tangents is empty")
        B = h.shape[0]
        dtype = h.dtype
        dA: Tensor | None = None  # (B, width, K)
        for (W, b), lin, ops in zip(weights, self._linears, self._post):
            a = h
            h = F.linear(a, W, b)
            dW = tangents.get(lin.weight_name)
            db = tangents.get(lin.bias_name) if lin.has_bias else None
            o, i = lin.out_features, lin.in_features
            dh = None
            if dW is not None:
                dWf = dW.to(dtype).reshape(Kdim * o, i)
                dh = (a @ dWf.T).view(B, Kdim, o).transpose(1, 2)
            if db is not None:
                dbT = db.to(dtype).reshape(Kdim, o).T  # (o, K)
                dh = dbT.expand(B, o, Kdim) if dh is None else dh + dbT
            if dA is not None:
                prop = W @ dA  # (B, o, K)
                dh = prop if dh is None else dh + prop
            if dh is None:
                dh = torch.zeros(B, o, Kdim, dtype=dtype, device=h.device)
            for op in ops:
                if op.identity:
                    continue
                h, d = _value_and_derivative(op, h, buffers)
                dh = dh * d[:, :, None]
            dA = dh
        return h, dA
