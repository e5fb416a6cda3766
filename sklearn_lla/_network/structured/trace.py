"""Recognising a network as a chain of ``nn.Linear`` layers and elementwise maps.

The network is run once on a small probe batch under a recording
:class:`torch.overrides.TorchFunctionMode`. Every torch call that touches the value
flowing from the input to the output (the *chain value*) must be one of

* ``F.linear`` with a parameter weight (and optional parameter bias): a linear layer;
* a whitelisted elementwise map of the chain value (activations, ``exp``, ``sin``,
  ``pow`` with a number exponent, ...), with constant extra arguments;
* ``+ - * /`` of the chain value with a python number or a module *buffer* that
  broadcasts along the last dimension;
* dropout in eval mode (the identity);
* after the last linear layer, when it has one output: dropping that dimension
  (``squeeze(-1)``, ``view(-1)``, ...), as in one-logit binary classifiers;
* before the first linear layer only: ``flatten(x, 1)``, ``x.view(-1, d)`` /
  ``x.reshape(-1, d)`` and dtype casts.

Each parameter must be used by exactly one linear layer, no earlier chain value may be
used again (no residual branches) and the module must return the last chain value.
Anything else raises :class:`NotAChain` with a human-readable reason.

Unlike :func:`torch.fx.symbolic_trace`, which monkeypatches ``torch.nn.Module.__call__``
for every thread of the process while it traces, a torch-function mode is
thread-local: tracing one network never disturbs networks running in other threads.
"""

from __future__ import annotations

import copy
import inspect
import numbers
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

__all__ = [
    "NotAChain",
    "ChainSpec",
    "Linear",
    "Op",
    "trace_chain",
    "probe_input",
    "share_copy",
    "value_and_derivative",
]

_TB = torch._C.TensorBase


class NotAChain(Exception):
    """The network is not a chain the structured path supports; ``str(exc)`` says why."""


# ---------------------------------------------------------------------------------
# Whitelists (matched by identity: builtins are not reliably hashable by value)
# ---------------------------------------------------------------------------------

#: Elementwise maps ``f(x, *constants, **constants)`` and their derivative rule
#: (``None``: the derivative is taken by reverse-mode autograd).
_UNARY: dict[int, tuple[Callable, str | None]] = {}


def _register_unary(fns, rule=None):
    for fn in fns:
        _UNARY[id(fn)] = (fn, rule)


_register_unary([torch.tanh, F.tanh, _TB.tanh], "tanh")
_register_unary([torch.sigmoid, F.sigmoid, _TB.sigmoid, torch.special.expit], "sigmoid")
_register_unary([torch.relu, F.relu, _TB.relu], "relu")
_register_unary([torch.neg, torch.negative, _TB.neg, _TB.negative], "neg")
_register_unary([
    torch.exp, torch.sin, torch.cos, torch.abs, torch.square, torch.erf,
    _TB.exp, _TB.sin, _TB.cos, _TB.abs, _TB.square, _TB.erf,
    F.gelu, F.silu, F.softplus, F.elu, F.selu, F.celu, F.leaky_relu, F.relu6, F.mish,
    F.hardtanh, F.hardswish, F.hardsigmoid, F.logsigmoid, F.softsign, F.tanhshrink,
])

#: Binary maps of the chain value and a number or buffer, with their rule.
_BINARY: dict[int, tuple[Callable, str | None]] = {}
for _fn, _rule in [
    (torch.add, "add"), (_TB.add, "add"),
    (torch.sub, "sub"), (torch.subtract, "sub"), (_TB.sub, "sub"), (_TB.subtract, "sub"),
    (torch.mul, "mul"), (torch.multiply, "mul"), (_TB.mul, "mul"), (_TB.multiply, "mul"),
    (torch.div, "div"), (torch.divide, "div"), (torch.true_divide, "div"),
    (_TB.div, "div"), (_TB.divide, "div"), (_TB.true_divide, "div"),
    (torch.Tensor.__rsub__, "rsub"), (torch.Tensor.__rdiv__, None),
    (torch.Tensor.__rtruediv__, None), (torch.pow, "pow"), (torch.Tensor.pow, "pow"),
    (_TB.pow, "pow"), (torch.Tensor.__pow__, "pow"), (torch.Tensor.__rpow__, None),
]:
    _BINARY[id(_fn)] = (_fn, _rule)

#: Dropout functions: the identity when ``training=False``.
_DROPOUT = {id(f): f for f in (F.dropout, F.alpha_dropout, F.feature_alpha_dropout)}
_FLATTEN = {id(f): f for f in (torch.flatten, _TB.flatten)}
#: ``x.view(-1, d)`` / ``x.reshape(-1, d)``: accepted before the first linear layer.
_RESHAPE = {id(f): f for f in (_TB.view, _TB.reshape, torch.reshape)}
#: Ways to drop the trailing size-1 output dimension: ``(B, 1) -> (B,)``.
_SQUEEZE = {
    id(f): f
    for f in (torch.squeeze, _TB.squeeze, torch.flatten, _TB.flatten, torch.reshape,
              _TB.reshape, _TB.view)
}
_CASTS = {id(f): f for f in (_TB.float, _TB.double, _TB.to)}
_LINEAR = F.linear

#: Data-independent tensor metadata that a module may read from the chain value.
_METADATA_PROPERTIES = {
    "dtype", "device", "requires_grad", "is_cuda", "is_cpu", "ndim", "layout",
    "is_sparse", "is_quantized", "is_meta", "is_nested", "is_mps", "is_xpu",
}
_METADATA_METHODS = {
    id(f): f for f in (_TB.dim, _TB.is_floating_point, _TB.is_complex, _TB.get_device)
}


def _name(fn: Any) -> str:
    mod = getattr(fn, "__module__", None) or ""
    qual = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)
    if mod.startswith("torch._C._nn") or mod == "torch.nn.functional":
        return f"torch.nn.functional.{getattr(fn, '__name__', qual)}"
    if qual.startswith(("TensorBase.", "Tensor.")):
        return "Tensor." + qual.split(".", 1)[1]
    if mod.startswith("torch") or qual.startswith("_VariableFunctionsClass"):
        return f"torch.{getattr(fn, '__name__', qual)}"
    return f"{mod}.{qual}" if mod else qual


# ---------------------------------------------------------------------------------
# Ops
# ---------------------------------------------------------------------------------


class _ChainArg:
    """Marks the position of the chain value in a recorded call."""

    def __repr__(self) -> str:
        return "x"


_X = _ChainArg()


@dataclass(frozen=True)
class _BufferRef:
    """Marks a module buffer operand, looked up by name at evaluation time."""

    name: str

    def __repr__(self) -> str:
        return self.name


@dataclass
class Linear:
    """One linear layer ``h = W a + b`` of the chain."""

    weight_name: str
    bias_name: str | None
    in_features: int
    out_features: int

    @property
    def has_bias(self) -> bool:
        return self.bias_name is not None


@dataclass
class Op:
    """A recorded elementwise call ``func(*args, **kwargs)`` with the chain value in it.

    ``args`` holds :data:`_X` where the chain value goes and :class:`_BufferRef` where a
    buffer goes. ``rule`` names a closed-form derivative (``None``: autograd).
    """

    func: Callable
    args: tuple
    kwargs: dict = field(default_factory=dict)
    rule: str | None = None
    identity: bool = False
    label: str | None = None

    @property
    def description(self) -> str:
        if self.label is not None:
            return self.label
        parts = [repr(a) for a in self.args] + [f"{k}={v!r}" for k, v in self.kwargs.items()]
        return f"{_name(self.func)}({', '.join(parts)})"

    @property
    def chain_first(self) -> bool:
        return self.args[0] is _X

    def operand(self, h: Tensor, bufs: dict[str, Tensor]) -> Any:
        """The non-chain operand of a binary op (a number, or the buffer in ``h``'s dtype)."""
        other = self.args[1] if self.chain_first else self.args[0]
        return _resolve(other, h, bufs)

    def __call__(self, h: Tensor, bufs: dict[str, Tensor]) -> Tensor:
        args = tuple(_resolve(a, h, bufs) for a in self.args)
        return self.func(*args, **self.kwargs)


def _identity(h: Tensor) -> Tensor:
    return h


def _resolve(a: Any, h: Tensor, bufs: dict[str, Tensor]) -> Any:
    if a is _X:
        return h
    if isinstance(a, _BufferRef):
        b = bufs[a.name]
        if b.is_floating_point() and b.dtype != h.dtype:
            b = b.to(h.dtype)
        return b
    return a


# ---------------------------------------------------------------------------------
# Derivatives of elementwise ops (thread-safe: no forward-mode AD)
# ---------------------------------------------------------------------------------


def _autograd_value_and_derivative(op: Op, h: Tensor, bufs: dict[str, Tensor],
                                   create_graph: bool = False):
    if create_graph and h.requires_grad and torch.is_grad_enabled():
        # differentiable derivative (double backward): f'(h) stays a function of h
        y = op(h, bufs)
        if not y.requires_grad:  # a constant map
            return y, torch.zeros_like(y)
        (d,) = torch.autograd.grad(y, h, torch.ones_like(y), create_graph=True)
        return y, d
    # grad mode is thread-local; ``inference_mode(False)`` lets this run inside a
    # caller's inference mode (an inference tensor is cloned into a normal one)
    with torch.inference_mode(False), torch.enable_grad():
        t = h.detach()
        if t.is_inference():
            t = t.clone()
        t.requires_grad_(True)
        y = op(t, bufs)
        if not y.requires_grad:  # a constant map
            return y.detach(), torch.zeros_like(y)
        (d,) = torch.autograd.grad(y, t, torch.ones_like(y))
    return y.detach(), d


def value_and_derivative(op: Op, h: Tensor, bufs: dict[str, Tensor],
                         create_graph: bool = False):
    """``(f(h), f'(h))`` of an elementwise op; ``f'(h)`` is ``None`` when it is 1.

    The derivative is a tensor that broadcasts against ``h`` (a 0-d tensor for a
    multiplication by a number). Closed forms are used for common maps; any other
    map is differentiated by one reverse-mode pass (``f`` is elementwise, so the
    gradient of ``sum f(h)`` is ``f'(h)``). The closed forms are differentiable
    functions of ``h``; with ``create_graph=True`` (and ``h`` requiring grad) the
    reverse-mode pass keeps its graph too, so ``f'(h)`` can be differentiated
    again (second derivatives, e.g. VaLLA's gradients w.r.t. inducing inputs).
    """
    rule = op.rule
    if rule is None:
        return _autograd_value_and_derivative(op, h, bufs, create_graph)
    y = op(h, bufs)
    if rule == "tanh":
        return y, 1.0 - y * y
    if rule == "sigmoid":
        return y, y * (1.0 - y)
    if rule == "relu":
        return y, (h > 0).to(h.dtype)
    if rule == "neg":
        return y, torch.tensor(-1.0, dtype=h.dtype, device=h.device)
    if rule == "add" or (rule == "sub" and op.chain_first):
        return y, None
    if rule in ("sub", "rsub"):
        return y, torch.tensor(-1.0, dtype=h.dtype, device=h.device)
    other = op.operand(h, bufs)
    if not isinstance(other, Tensor):
        other = torch.tensor(other, dtype=h.dtype, device=h.device)
    if rule == "mul":
        return y, other
    if rule == "div" and op.chain_first:
        return y, 1.0 / other
    if rule == "pow":  # chain value as base, number exponent
        return y, other * h.pow(other - 1.0)
    return _autograd_value_and_derivative(op, h, bufs, create_graph)


# ---------------------------------------------------------------------------------
# Recording
# ---------------------------------------------------------------------------------


@dataclass
class ChainSpec:
    """What :func:`trace_chain` found: pre-ops, linear layers and the ops after each."""

    pre: list[Op]
    linears: list[Linear]
    post: list[list[Op]]
    param_names: list[str]
    buffers: dict[str, Tensor]
    squeezed: bool = False


def share_copy(module: nn.Module) -> nn.Module:
    """A copy of ``module``'s module objects that shares its parameter and buffer tensors."""
    memo = {id(t): t for t in module.parameters()}
    memo.update({id(t): t for t in module.buffers()})
    return copy.deepcopy(module, memo)


def _current_module(names: dict[int, str]) -> str | None:
    """Describe the innermost module of ``names`` whose ``forward`` is on the stack."""
    frame = inspect.currentframe()
    while frame is not None:
        obj = frame.f_locals.get("self")
        if isinstance(obj, nn.Module) and id(obj) in names:
            path = names[id(obj)]
            where = f"at {path!r}" if path else "(the network itself)"
            return f"module {type(obj).__name__} {where}"
        frame = frame.f_back
    return None


class _Recorder(TorchFunctionMode):
    """Follows the chain value through one forward pass; raises NotAChain on a detour."""

    def __init__(self, module: nn.Module, x: Tensor) -> None:
        super().__init__()
        self.params = {id(p): n for n, p in module.named_parameters()}
        self.buffer_names = {id(b): n for n, b in module.named_buffers()}
        self.buffers = dict(module.named_buffers())
        self.module_names = {id(m): n for n, m in module.named_modules()}
        self.cur = x
        self.chain: list[Tensor] = [x]  # keeps the tensors alive: their ids stay unique
        self.chain_ids = {id(x)}
        self.pre: list[Op] = []
        self.linears: list[Linear] = []
        self.post: list[list[Op]] = []
        self.used: list[str] = []
        self.error: NotAChain | None = None
        self.squeezed = False

    # -- helpers ------------------------------------------------------------------

    def fail(self, message: str, with_module: bool = True) -> None:
        where = _current_module(self.module_names) if with_module else None
        self.error = NotAChain(f"{where} is not supported: {message}" if where else message)
        raise self.error

    def width(self) -> int | None:
        return self.linears[-1].out_features if self.linears else None

    def operand(self, a: Any, fname: str) -> Any:
        if isinstance(a, Tensor):
            name = self.buffer_names.get(id(a))
            if name is None:
                self.fail(f"{fname} combines the chain value with a tensor that is neither "
                          "a number nor a buffer of the module")
            shape, w = tuple(a.shape), self.width()
            if w is not None and not (
                len(shape) <= 2 and all(s == 1 for s in shape[:-1])
                and (len(shape) == 0 or shape[-1] in (1, w))
            ):
                self.fail(f"buffer {name!r} of shape {shape} does not broadcast along the "
                          f"last dimension of the width-{w} chain value")
            return _BufferRef(name)
        if isinstance(a, bool) or (isinstance(a, numbers.Number) and not isinstance(a, complex)):
            return a
        self.fail(f"{fname} has an operand of type {type(a).__name__}")

    def add(self, op: Op) -> None:
        (self.post[-1] if self.linears else self.pre).append(op)

    def advance(self, out: Any, fname: str, same_shape: bool) -> None:
        if not isinstance(out, Tensor):
            self.fail(f"{fname} did not return a tensor")
        if same_shape and out.shape != self.cur.shape:
            self.fail(f"{fname} changes the shape {tuple(self.cur.shape)} of the chain "
                      f"value to {tuple(out.shape)}")
        self.cur = out
        self.chain.append(out)
        self.chain_ids.add(id(out))

    # -- the mode -----------------------------------------------------------------

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.error is None:
            self.record(func, args, kwargs, out)
        return out

    def record(self, func, args, kwargs, out) -> None:
        leaves, _ = tree_flatten((args, kwargs))
        tensors = [t for t in leaves if isinstance(t, Tensor)]
        fid = id(func)
        if getattr(func, "__name__", None) == "__get__":
            prop = getattr(getattr(func, "__self__", None), "__name__", "?")
            if prop in _METADATA_PROPERTIES:
                return  # data-independent reads are harmless on any tensor
            if any(id(t) in self.chain_ids for t in tensors):
                self.fail(f"it reads Tensor.{prop} of the chain value")
        if fid in _METADATA_METHODS:
            return
        on_chain = [t for t in tensors if id(t) in self.chain_ids]
        params = [self.params[id(t)] for t in tensors if id(t) in self.params]
        fname = _name(func)
        if not on_chain:
            if params:
                self.fail(f"parameter {params[0]!r} is used by {fname}, not by a linear layer")
            return  # computations on constants / buffers only: not part of the chain
        if any(t is not self.cur for t in on_chain):
            self.fail(f"{fname} uses an earlier value of the chain again (a residual "
                      "connection or a branch): not a single chain")
        if func is _LINEAR:
            self.linear(args, kwargs, params, out)
            return
        if params:
            self.fail(f"parameter {params[0]!r} is used by {fname}, not by a linear layer")
        first = bool(args) and args[0] is self.cur
        second = fid in _BINARY and len(args) == 2 and args[1] is self.cur
        if len(on_chain) != 1 or not (first or second):
            self.fail(f"{fname} does not take the chain value once, as an operand "
                      "of an elementwise map")
        if fid in _SQUEEZE and self.is_output_squeeze(args, kwargs, out):
            # (B, 1) -> (B,): the chain keeps computing on (B, 1), which the maps after
            # it (elementwise) do not mind; the output is read as (B, C=1) anyway
            self.squeezed = True
            self.advance(out, fname, same_shape=False)
        elif fid in _UNARY:
            self.unary(func, args, kwargs, out, fname)
        elif fid in _BINARY:
            self.binary(func, args, kwargs, out, fname)
        elif fid in _DROPOUT:
            training = kwargs.get("training", args[2] if len(args) > 2 else True)
            if training:
                self.fail(f"{fname} in training mode is random")
            self.add(Op(_identity, (_X,), {}, identity=True, label=f"{fname}(eval)"))
            self.advance(out, fname, same_shape=True)
        elif fid in _FLATTEN:
            start = args[1] if len(args) > 1 else kwargs.get("start_dim", 0)
            end = args[2] if len(args) > 2 else kwargs.get("end_dim", -1)
            if self.linears or start != 1 or end != -1 or len(args) > 3:
                self.fail("only flatten(x, 1) before the first linear layer is supported")
            self.pre.append(Op(func, (_X, 1)))
            self.advance(out, fname, same_shape=False)
        elif fid in _RESHAPE and not self.linears:
            shape = args[1] if len(args) == 2 and isinstance(args[1], (tuple, list)) else args[1:]
            if (kwargs or len(shape) != 2 or shape[0] != -1
                    or not isinstance(shape[1], int) or isinstance(shape[1], bool)):
                self.fail(f"{fname} before the first linear layer is only supported as "
                          "x.view(-1, d) / x.reshape(-1, d)")
            self.pre.append(Op(_TB.reshape, (_X, -1, int(shape[1]))))
            self.advance(out, fname, same_shape=False)
        elif fid in _CASTS:
            to_dtype = func is _TB.to and (
                (len(args) == 2 and isinstance(args[1], torch.dtype) and not kwargs)
                or (len(args) == 1 and set(kwargs) == {"dtype"})
            )
            if self.linears or not (to_dtype or (len(args) == 1 and not kwargs)):
                self.fail(f"{fname} is only supported as a dtype cast before the first "
                          "linear layer")
            self.pre.append(Op(func, (_X, *args[1:]), dict(kwargs)))
            self.advance(out, fname, same_shape=False)
        else:
            self.fail(f"{fname} applied to the chain value is not an elementwise map "
                      "the structured path knows")

    def is_output_squeeze(self, args, kwargs, out) -> bool:
        cur = self.cur
        leaves, _ = tree_flatten((args[1:], kwargs))
        return (
            bool(self.linears) and not self.squeezed and cur.ndim == 2 and cur.shape[1] == 1
            and isinstance(out, Tensor) and tuple(out.shape) == (cur.shape[0],)
            and not any(isinstance(t, Tensor) for t in leaves)
        )

    def linear(self, args, kwargs, params, out) -> None:
        if len(args) < 2 or args[0] is not self.cur or set(kwargs) - {"bias"} or len(args) > 3:
            self.fail("F.linear is called in an unexpected way")
        weight = args[1]
        bias = args[2] if len(args) == 3 else kwargs.get("bias")
        wname = self.params.get(id(weight))
        if wname is None:
            self.fail("a linear layer's weight is not a parameter of the module "
                      "(a parametrization or a computed weight)")
        bname = None
        if bias is not None:
            bname = self.params.get(id(bias))
            if bname is None:
                self.fail("a linear layer's bias is not a parameter of the module")
        if weight.ndim != 2:
            self.fail(f"weight {wname!r} is not a matrix")
        out_f, in_f = weight.shape
        if bias is not None and tuple(bias.shape) != (out_f,):
            self.fail(f"bias {bname!r} has shape {tuple(bias.shape)}, expected ({out_f},)")
        for n in (wname, bname):
            if n is not None and n in self.used:
                self.fail(f"parameter {n!r} is used by more than one linear layer "
                          "(shared or tied weights)")
        if self.cur.ndim != 2 or self.squeezed:
            self.fail(f"a linear layer's input has shape {tuple(self.cur.shape)}, "
                      "expected (batch, features)")
        self.linears.append(Linear(wname, bname, int(in_f), int(out_f)))
        self.post.append([])
        self.used += [n for n in (wname, bname) if n is not None]
        self.advance(out, "F.linear", same_shape=False)

    def unary(self, func, args, kwargs, out, fname) -> None:
        leaves, _ = tree_flatten((args[1:], kwargs))
        if any(isinstance(t, Tensor) for t in leaves):
            self.fail(f"{fname} has tensor arguments besides the chain value")
        kwargs = dict(kwargs)
        if "inplace" in kwargs:  # the pre-activation is needed for the derivative
            kwargs["inplace"] = False
        _, rule = _UNARY[id(func)]
        self.add(Op(func, (_X, *args[1:]), kwargs, rule))
        self.advance(out, fname, same_shape=True)

    def binary(self, func, args, kwargs, out, fname) -> None:
        if len(args) != 2 or kwargs:
            self.fail(f"{fname} with extra arguments is not supported")
        _, rule = _BINARY[id(func)]
        first = args[0] is self.cur
        other = self.operand(args[1] if first else args[0], fname)
        if rule == "pow" and (not first or isinstance(other, _BufferRef)):
            self.fail("pow is only supported with the chain value as base and a number "
                      "exponent")
        if func is torch.Tensor.__rpow__ and isinstance(other, _BufferRef):
            self.fail("a buffer raised to the power of the chain value is not supported")
        self.add(Op(func, (_X, other) if first else (other, _X), {}, rule))
        self.advance(out, fname, same_shape=True)


def probe_input(module: nn.Module, n: int = 2, seed: int = 0) -> Tensor:
    """A random ``(n, d)`` input for a network whose first ``nn.Linear`` has ``d`` inputs.

    Used when no example input is available; raises :class:`NotAChain` when the module
    has no ``nn.Linear`` (or no floating parameter) to infer ``d`` from.
    """
    lin = next((m for m in module.modules() if isinstance(m, nn.Linear)), None)
    if lin is None:
        raise NotAChain("the module contains no nn.Linear layer")
    dtype = lin.weight.dtype
    if not dtype.is_floating_point:
        raise NotAChain(f"nn.Linear weights of dtype {dtype} are not supported")
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, lin.in_features, generator=g, dtype=torch.float64)
    return x.to(dtype=dtype, device=lin.weight.device)


def trace_chain(module: nn.Module, x: Tensor) -> tuple[ChainSpec, Tensor]:
    """Record the chain of ``module`` on the input batch ``x``.

    The module is run once, in eval mode, on a copy that shares its tensors (the
    original keeps its ``training`` flag; no buffer changes in eval mode).

    Returns
    -------
    spec : ChainSpec
    output : Tensor
        The module's output on ``x``.

    Raises
    ------
    NotAChain
        With the reason, when ``module`` is not a supported chain.
    """
    try:
        mod = share_copy(module).eval()
    except Exception as exc:  # noqa: BLE001 - reported as the reason
        raise NotAChain(f"the module could not be copied ({type(exc).__name__}: {exc})") from exc
    if isinstance(x, Tensor) and x.is_floating_point():
        dtypes = {p.dtype for p in mod.parameters()}
        if len(dtypes) == 1:
            x = x.to(next(iter(dtypes)))
    x = x.detach().clone()
    rec = _Recorder(mod, x)
    try:
        with torch.no_grad(), rec:
            out = mod(x)
    except NotAChain:
        raise
    except Exception as exc:  # noqa: BLE001 - reported as the reason
        if rec.error is not None:
            raise rec.error from exc
        raise NotAChain(
            f"calling the module on an input of shape {tuple(x.shape)} failed "
            f"({type(exc).__name__}: {exc})"
        ) from exc
    if rec.error is not None:  # the module caught our exception itself
        raise rec.error
    if not rec.linears:
        raise NotAChain("no nn.Linear layer (or F.linear on parameters) acts on the input")
    if not isinstance(out, Tensor) or out is not rec.cur:
        raise NotAChain("the module does not return the value computed by its last "
                        "supported operation")
    named = dict(mod.named_parameters())
    unused = [n for n in named if n not in rec.used]
    if unused:
        raise NotAChain(f"parameter {unused[0]!r} is not used by a linear layer")
    dtypes = {named[n].dtype for n in rec.used}
    if len(dtypes) != 1:
        raise NotAChain(f"the linear layers mix parameter dtypes {sorted(map(str, dtypes))}")
    spec = ChainSpec(rec.pre, rec.linears, rec.post, list(named), dict(module.named_buffers()),
                     rec.squeezed)
    return spec, out
