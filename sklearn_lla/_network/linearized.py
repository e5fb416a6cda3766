"""A frozen, functional view of a pretrained network and its Jacobian products.

:class:`LinearizedNet` is the one place where the library touches the user's network.
It deep-copies the module once (so the user's object is never mutated, not even its
``training`` flag or ``requires_grad``), evaluates it in eval mode, and offers the
products every method needs:

* ``forward``: ``g(x)``;
* ``jvp``: ``g(x)`` and ``J(x) t_k`` for many tangents in one batched pass;
* ``vjp``: ``J(x)^T u_k`` for many cotangents;
* ``jacobian``: per-example Jacobian rows, in chunks whose memory is bounded;
* ``ntk`` / ``kernel`` / ``ntk_diag_blocks``: blocks of the neural tangent kernel
  ``J(x) J(x')^T``, always in float64.

The Jacobian is taken with respect to the *linearised* parameters: by default the
trainable ones (``requires_grad=True`` in the user's module), or an explicit subset
(``param_names``, e.g. :func:`~sklearn_lla._network.resolve.last_layer_param_names`
for last-layer LLA); the other parameters are held fixed like buffers.

The products are computed by a Jacobian backend
(:class:`~sklearn_lla._network.backends.base.JacobianBackend`), chosen once, at
construction, and reported in ``backend`` / ``backend_reason``: networks that are
chains of ``nn.Linear`` layers and elementwise maps use
:mod:`sklearn_lla._network.backends.chain`, which never forms Jacobian rows; every
other architecture uses the generic ``torch.func`` backend (reverse mode only). The
methods here cast inputs, check arguments and delegate; nothing outside this
package looks at which backend it is.

Thread safety: every method may be called from several threads at once. No
forward-mode AD is used (its dual levels are process-global); ``torch.func`` transforms
keep their state per thread; and ``functional_call``, which temporarily swaps a
module's tensors, runs on a per-thread copy of the module's objects (sharing the
parameter tensors).
"""

from __future__ import annotations

import copy
import threading

import torch
from torch import Tensor, nn
from torch.func import functional_call

from .backends.base import JacobianBackend, Rows, device_budget
from .backends.select import rebuild_backend, select_backend
from .structured.chain import StructuredChain
from .structured.jacobian import StructuredJacobian
from .structured.trace import share_copy

__all__ = ["LinearizedNet", "stack_flat"]

#: Default memory budget (in tensor elements) of one chunk of Jacobian rows.
JACOBIAN_CHUNK_ELEMENTS = 2**25

#: Output transforms: how module outputs map to ``g``.
OUTPUT_TRANSFORMS = ("identity", "log")

#: Rows of ``example_input`` used to check the structured chain against the module.
_CHECK_ROWS = 64


def _as_input(x, device, dtype) -> Tensor:
    x = torch.as_tensor(x, device=device)
    return x.to(dtype) if x.is_floating_point() else x


def stack_flat(tensors: dict, names) -> Tensor:
    """Join per-parameter tensors into flat vectors (the inverse of
    :meth:`LinearizedNet.unflatten`).

    Parameters
    ----------
    tensors : dict of str to Tensor of shape (K, *param_shape)
        One entry per name (e.g. what :meth:`LinearizedNet.vjp` returns).
    names : sequence of str
        The order of the parameters (:attr:`LinearizedNet.names`).

    Returns
    -------
    Tensor of shape (K, P)

    Examples
    --------
    >>> import torch
    >>> from sklearn_lla._network.linearized import stack_flat
    >>> stack_flat({"w": torch.ones(2, 2, 3), "b": torch.zeros(2, 2)}, ["w", "b"]).shape
    torch.Size([2, 8])
    """
    K = tensors[names[0]].shape[0]
    return torch.cat([tensors[n].reshape(K, -1) for n in names], dim=1)


class LinearizedNet:
    """Functional, frozen view of a pretrained network ``g(x; theta_hat)``.

    Parameters
    ----------
    module : torch.nn.Module
        The pretrained network. It is deep-copied; the original is never modified.
    device : str or torch.device, default="cpu"
        Where to compute.
    output_transform : {"identity", "log"}, default="identity"
        How module outputs map to ``g``: unchanged, or ``log`` (a module that outputs
        probabilities, as skorch's default classifier). A one-output network simply
        has ``C = 1``.
    structured : bool, default=True
        Allow the structured fast path; ``False`` forces ``torch.func``.
    example_input : array-like or Tensor of shape (B, ...), optional
        A small input batch (a few rows suffice; at most 64 are used). Used once, at
        construction, to check that the network keeps the batch dimension and that
        the structured chain reproduces the network's outputs. Without it, a random
        probe of the first ``nn.Linear``'s input width is used for the chain check.
    trainable_only : bool, default=True
        Linearise only the parameters with ``requires_grad=True`` in ``module``
        (read, never changed); the others are held fixed like buffers. ``False``
        linearises every parameter. Ignored when ``param_names`` is given.
    param_names : list of str, optional
        Linearise exactly these parameters (names as in ``module.named_parameters()``),
        e.g. :func:`~sklearn_lla._network.resolve.last_layer_param_names`; everything
        else is held fixed.

    Attributes
    ----------
    module : torch.nn.Module
        The private eval-mode copy.
    params : dict of str to Tensor
        The linearised parameters ``theta_hat`` (detached), in module order.
    fixed_params : dict of str to Tensor
        The parameters held fixed.
    buffers : dict of str to Tensor
        The module's buffers.
    names : list of str
        Keys of ``params``: the order of the flat parameter vector.
    n_params : int
        ``P``, the number of linearised parameters.
    dtype : torch.dtype
        The linearised parameters' floating dtype; floating inputs are cast to it.
    device : torch.device
    output_transform : str
    jacobian_backend : JacobianBackend
        The object that computes the Jacobian products.
    backend : {"structured", "functorch"}
        Its name.
    backend_reason : str
        Why, in words (e.g. ``"chain of 4 nn.Linear layers and elementwise maps"``, or
        ``"not a chain: module LayerNorm at 'norm' is not supported: ..."``).
    chain : StructuredChain or None
        The structured representation when ``backend == "structured"``.
    factored : bool
        Whether :meth:`rows` returns compact per-layer factors (cheap to keep for
        many points) rather than dense rows.

    Notes
    -----
    Gram matrices (``ntk``, ``kernel``, ``ntk_diag_blocks``) are accumulated in
    float64 whatever the network's dtype; ``forward``, ``jvp``, ``vjp`` and
    ``jacobian`` return the network's dtype. All methods are thread-safe.

    Examples
    --------
    >>> import torch
    >>> from torch import nn
    >>> net = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 2)).double()
    >>> X = torch.randn(5, 3, dtype=torch.float64)
    >>> lin = LinearizedNet(net, example_input=X)
    >>> lin.backend, lin.n_params
    ('structured', 50)
    >>> lin.ntk(X).shape
    torch.Size([10, 10])
    """

    def __init__(
        self,
        module: nn.Module,
        device="cpu",
        output_transform: str = "identity",
        structured: bool = True,
        *,
        example_input=None,
        trainable_only: bool = True,
        param_names: list[str] | None = None,
    ):
        if output_transform not in OUTPUT_TRANSFORMS:
            raise ValueError(
                f"unknown output_transform {output_transform!r}; expected one of "
                f"{OUTPUT_TRANSFORMS} (a one-logit network simply has one output)"
            )
        mod = copy.deepcopy(module).to(device)
        mod.eval()
        named = dict(mod.named_parameters())
        if not named:
            raise ValueError("the network has no parameters to linearise")
        for n, p in named.items():
            if p.is_floating_point() and not bool(torch.isfinite(p).all()):
                raise ValueError(f"parameter {n!r} of the network has non-finite values "
                                 "(NaN or inf)")
        selected = self._select(named, trainable_only, param_names)
        for p in mod.parameters():
            p.requires_grad_(False)
        self.module = mod
        self.device = torch.device(device)
        self.output_transform = output_transform
        self.structured = bool(structured)
        self.trainable_only = bool(trainable_only)
        self.params = {n: named[n].detach() for n in selected}
        self.fixed_params = {n: p.detach() for n, p in named.items() if n not in self.params}
        self.buffers = {n: b.detach() for n, b in mod.named_buffers()}
        self._all_params = {n: p.detach() for n, p in named.items()}
        self.names = list(self.params)
        self.shapes = [self.params[n].shape for n in self.names]
        self.numels = [self.params[n].numel() for n in self.names]
        self.n_params = int(sum(self.numels))
        dtypes = {p.dtype for p in self.params.values()}
        if len(dtypes) != 1 or not next(iter(dtypes)).is_floating_point:
            raise TypeError(f"the linearised parameters must share one floating dtype, "
                            f"got {dtypes}")
        self.dtype = next(iter(dtypes))
        self._local = threading.local()
        x = None
        if example_input is not None:
            x = _as_input(example_input, self.device, self.dtype)[:_CHECK_ROWS]
            self._check_batch_dimension(x)
        self._select_backend(x)

    @staticmethod
    def _select(named, trainable_only, param_names) -> list[str]:
        if param_names is not None:
            if isinstance(param_names, str):
                raise TypeError("param_names must be a list of parameter names, not a str")
            wanted = list(param_names)
            unknown = [n for n in wanted if n not in named]
            if unknown:
                raise ValueError(f"unknown parameter names {unknown}; the network has "
                                 f"{list(named)}")
            if not wanted:
                raise ValueError("param_names is empty: no parameter to linearise")
            return [n for n in named if n in set(wanted)]
        if trainable_only:
            selected = [n for n, p in named.items() if p.requires_grad]
            if not selected:
                raise ValueError("every parameter of the network has requires_grad=False: "
                                 "nothing to linearise (pass trainable_only=False to "
                                 "linearise all of them)")
            return selected
        return list(named)

    def _check_batch_dimension(self, x: Tensor) -> None:
        """The output must have the batch size as its leading dimension.

        Checked on ``x`` and on ``x`` plus one row: an output of shape ``(C,)`` cannot
        pass both as ``(B,)``.
        """
        if x.ndim == 0 or x.shape[0] == 0:
            raise ValueError("example_input must be a non-empty batch (B, ...)")
        self.forward(x)
        self.forward(torch.cat([x, x[:1]]))

    def _use(self, backend: JacobianBackend) -> None:
        self.jacobian_backend = backend
        self.backend = backend.name
        self.backend_reason = backend.reason

    @property
    def chain(self) -> StructuredChain | None:
        """The structured chain, when the structured backend computes the products."""
        return getattr(self.jacobian_backend, "chain", None)

    @property
    def factored(self) -> bool:
        """Whether :meth:`rows` returns compact factors rather than dense rows."""
        return bool(self.jacobian_backend.factored)

    @property
    def thread_safe(self) -> bool:
        """Whether the backend's products may run from several threads at once."""
        return bool(self.jacobian_backend.thread_safe)

    def _select_backend(self, x: Tensor | None) -> None:
        """Decide, once, between the structured chain, the graph backend and torch.func."""
        backend, self._trace_input = select_backend(self, x)
        self._use(backend)

    def __getstate__(self):
        # The tensors are pickled once, with the module; the per-thread modules and
        # the backend (e.g. a traced chain) are rebuilt on load.
        state = self.__dict__.copy()
        for key in ("jacobian_backend", "_local", "_all_params", "buffers", "fixed_params"):
            state.pop(key, None)
        state["params"] = list(self.params)
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._local = threading.local()
        named = dict(self.module.named_parameters())
        self._all_params = {n: p.detach() for n, p in named.items()}
        self.params = {n: self._all_params[n] for n in state["params"]}
        self.fixed_params = {n: p for n, p in self._all_params.items() if n not in self.params}
        self.buffers = {n: b.detach() for n, b in self.module.named_buffers()}
        self._use(rebuild_backend(self, self.backend, self.backend_reason,
                                  self._trace_input))

    # ------------------------------------------------------------------ basics
    def _module(self) -> nn.Module:
        """This thread's copy of the module's objects, sharing its tensors.

        ``functional_call`` swaps tensors on the module it is given, so each thread
        runs its own copy; :attr:`module` itself is never swapped, so copying it from
        any thread at any time is safe.
        """
        mod = getattr(self._local, "module", None)
        if mod is None:
            mod = share_copy(self.module)
            self._local.module = mod
        return mod

    def _finish(self, out, B: int) -> Tensor:
        if not isinstance(out, Tensor):
            raise TypeError(f"the network returned a {type(out).__name__}, expected a Tensor")
        if out.ndim == 0 and B == 1:  # a (B,)-output network squeezed a batch of one
            out = out.reshape(1)
        if out.ndim == 0 or out.shape[0] != B:
            raise ValueError(
                f"the network returned shape {tuple(out.shape)} for a batch of {B} inputs; "
                f"expected ({B}, C) or ({B},): the output must keep the batch dimension"
            )
        if out.ndim == 1:
            out = out.unsqueeze(-1)
        elif out.ndim > 2:
            out = out.reshape(B, -1)
        if self.output_transform == "log":
            out = torch.log(out.clamp_min(torch.finfo(out.dtype).tiny))
        return out

    def _g(self, params, x):
        out = functional_call(self._module(), (params, self.fixed_params, self.buffers), (x,))
        return self._finish(out, x.shape[0])

    def _input(self, x) -> Tensor:
        if isinstance(x, Tensor) and x.is_floating_point() and x.dtype != self.dtype:
            return x.to(self.dtype)
        return x

    def forward(self, x: Tensor) -> Tensor:
        """Evaluate the network outputs ``g(x)``.

        Parameters
        ----------
        x : Tensor of shape (B, ...)
            Input batch; floating inputs are cast to :attr:`dtype`.

        Returns
        -------
        Tensor of shape (B, C)
            The (transformed) network outputs.
        """
        x = self._input(x)
        with torch.no_grad():
            return self._finish(self._module()(x), x.shape[0])

    __call__ = forward

    def n_outputs(self, x: Tensor) -> int:
        """Count the network outputs ``C``.

        Parameters
        ----------
        x : Tensor of shape (B, ...)
            Sample inputs; only the first row is evaluated.

        Returns
        -------
        int
            The number of outputs ``C``.
        """
        return int(self.forward(x[:1]).shape[-1])

    # ------------------------------------------------------------ flat vectors
    def unflatten(self, flat: Tensor) -> dict:
        """Split flat parameter vectors into per-parameter tensors.

        Parameters
        ----------
        flat : Tensor of shape (K, P)
            ``K`` vectors over the linearised parameters.

        Returns
        -------
        dict of str to Tensor of shape (K, *param_shape)
            In :attr:`names` order.
        """
        if flat.ndim != 2 or flat.shape[1] != self.n_params:
            raise ValueError(f"expected shape (K, {self.n_params}), got {tuple(flat.shape)}")
        out, start = {}, 0
        for n, shape, k in zip(self.names, self.shapes, self.numels):
            out[n] = flat[:, start:start + k].reshape(flat.shape[0], *shape)
            start += k
        return out

    def flat_params(self) -> Tensor:
        """Return ``theta_hat``, the linearised parameters, as one flat vector.

        Returns
        -------
        Tensor of shape (P,)
            The parameters in :attr:`names` order, each flattened.
        """
        return torch.cat([self.params[n].reshape(-1) for n in self.names])

    def _tangents(self, tangents) -> dict:
        if isinstance(tangents, Tensor):
            return self.unflatten(tangents.to(self.dtype))
        unknown = set(tangents) - set(self.names)
        if unknown:
            raise ValueError(f"tangents for parameters that are not linearised: "
                             f"{sorted(unknown)}")
        return {n: t.to(self.dtype) for n, t in tangents.items()}

    # ---------------------------------------------------------------- products
    def jvp(self, x: Tensor, tangents) -> tuple[Tensor, Tensor]:
        """Compute outputs and Jacobian-vector products for many tangents in one pass.

        Parameters
        ----------
        x : Tensor of shape (B, ...)
            Input batch.
        tangents : Tensor of shape (K, P) or dict of (K, *param_shape)
            Directions in the linearised parameters; missing dict entries count as 0.

        Returns
        -------
        g : Tensor of shape (B, C)
            The network outputs.
        jv : Tensor of shape (B, C, K)
            ``jv[b, :, k] = J(x_b) t_k``.
        """
        return self.jacobian_backend.jvp(self._input(x), self._tangents(tangents))

    def jvp_and_ntk_diag(self, x: Tensor, tangents) -> tuple[Tensor, Tensor, Tensor]:
        """:meth:`jvp` and :meth:`ntk_diag_blocks` at the same ``x``, sharing the work
        where the backend can (one evaluation of the Jacobian rows).

        Parameters
        ----------
        x : Tensor of shape (B, ...)
            Input batch.
        tangents : Tensor of shape (K, P) or dict of (K, *param_shape)
            As in :meth:`jvp`.

        Returns
        -------
        g : Tensor of shape (B, C)
        jv : Tensor of shape (B, C, K)
        blocks : Tensor of shape (B, C, C), dtype float64
        """
        return self.jacobian_backend.jvp_and_ntk_diag(self._input(x),
                                                      self._tangents(tangents))

    def vjp(self, x: Tensor, cotangents: Tensor) -> dict:
        """Compute vector-Jacobian products ``sum_b J(x_b)^T u_k[b]``.

        Parameters
        ----------
        x : Tensor of shape (B, ...)
            Input batch.
        cotangents : Tensor of shape (K, B, C)
            ``K`` cotangents ``u_k`` over the outputs.

        Returns
        -------
        dict of str to Tensor of shape (K, *param_shape)
            One entry per linearised parameter, in :attr:`names` order.
        """
        return self.jacobian_backend.vjp(self._input(x), cotangents.to(self.dtype))

    def jacobian(self, x: Tensor) -> Tensor:
        """Compute per-example Jacobians (see :meth:`jacobian_chunks` for many points).

        Parameters
        ----------
        x : Tensor of shape (B, ...)
            Input batch.

        Returns
        -------
        Tensor of shape (B, C, P)
            Columns in :attr:`names` order, in the network's dtype.
        """
        return self.jacobian_backend.jacobian(self._input(x))

    def chunk_size(self, n_outputs: int, budget: int = JACOBIAN_CHUNK_ELEMENTS) -> int:
        """Count the points whose Jacobian rows fit in a memory budget.

        Parameters
        ----------
        n_outputs : int
            ``C``.
        budget : int, default=2**25
            Tensor elements of one chunk on the CPU (scaled by ``device_budget``).

        Returns
        -------
        int
            At least 1.
        """
        budget = device_budget(budget, self.device)
        return max(1, budget // max(1, n_outputs * self.n_params))

    def jacobian_chunks(self, X: Tensor, n_outputs: int,
                        budget: int = JACOBIAN_CHUNK_ELEMENTS):
        """Iterate over per-example Jacobians of ``X`` in memory-bounded chunks.

        Parameters
        ----------
        X : Tensor of shape (N, ...)
            Inputs.
        n_outputs : int
            ``C``.
        budget : int, default=2**25
            Tensor elements allowed for one chunk (see :meth:`chunk_size`).

        Yields
        ------
        slice
            The rows of ``X`` in the chunk.
        Tensor of shape (b, C, P)
            Their Jacobians.
        """
        step = self.chunk_size(n_outputs, budget)
        for start in range(0, X.shape[0], step):
            sl = slice(start, min(start + step, X.shape[0]))
            yield sl, self.jacobian(X[sl])

    def _out_idx(self, x: Tensor, out_idx) -> Tensor:
        out_idx = torch.as_tensor(out_idx, device=x.device).long().reshape(-1)
        if out_idx.shape[0] != x.shape[0]:
            raise ValueError(f"out_idx must have shape ({x.shape[0]},), "
                             f"got {tuple(out_idx.shape)}")
        return out_idx

    def rows(self, x: Tensor, out_idx: Tensor | None = None, *,
             differentiable: bool = False) -> Rows:
        """Jacobian rows at ``x``, in the backend's representation.

        Parameters
        ----------
        x : Tensor of shape (B, ...)
            Input batch; floating inputs are cast to :attr:`dtype`.
        out_idx : LongTensor of shape (B,), optional
            ``None``: all ``C`` outputs, rows ``b * C + c``; else the gradient of
            output ``out_idx[b]`` only, one row per point.
        differentiable : bool, default=False
            Keep the autograd graph from ``x`` to the rows (second derivatives of the
            network), e.g. to learn inducing inputs through a kernel of the rows.

        Returns
        -------
        Rows
            Dense rows, or per-layer factors when :attr:`factored`; either way with
            ``gram``, ``cross_gram`` (differentiable), ``diag_blocks``, ``vjp``,
            ``matmul`` and ``dense``.
        """
        x = self._input(x)
        if out_idx is not None:
            out_idx = self._out_idx(x, out_idx)
        return self.jacobian_backend.rows(x, out_idx, differentiable)

    def row_elements(self) -> int:
        """Elements one Jacobian row holds in :meth:`rows`' representation.

        Returns
        -------
        int
            ``P`` for dense rows, far fewer for factored ones.
        """
        return int(self.jacobian_backend.row_elements())

    def factored_jacobian(self, x: Tensor, out_idx: Tensor | None = None, *,
                          differentiable: bool = False) -> StructuredJacobian:
        """Factor the Jacobian rows at ``x`` without forming them (structured backend).

        Parameters
        ----------
        x : Tensor of shape (B, ...)
            Input batch; floating inputs are cast to :attr:`dtype`.
        out_idx : LongTensor of shape (B,), optional
            ``None``: all ``C`` outputs, rows ``b * C + c``; else the gradient of
            output ``out_idx[b]`` only, one row per point.
        differentiable : bool, default=False
            Keep the autograd graph from ``x`` to the factors (second derivatives of
            the network), so that kernels built from them (e.g.
            :meth:`StructuredJacobian.cross_gram`) differentiate w.r.t. ``x``.

        Returns
        -------
        StructuredJacobian
            Per-layer factors in the network's dtype, columns :attr:`names`.

        Raises
        ------
        RuntimeError
            When the network is not a structured chain (``backend != "structured"``).
        """
        if self.chain is None:
            raise RuntimeError(f"factored Jacobians need the structured backend; this "
                               f"network uses {self.backend!r} ({self.backend_reason})")
        return self.jacobian_backend.rows(self._input(x), out_idx, differentiable)

    def jacobian_rows(self, x: Tensor, out_idx: Tensor, *,
                      differentiable: bool = False) -> Tensor:
        """Compute one Jacobian row per point, ``grad_theta g_{out_idx[b]}(x_b)``.

        Parameters
        ----------
        x : Tensor of shape (B, ...)
            Input batch; floating inputs are cast to :attr:`dtype`.
        out_idx : LongTensor of shape (B,)
            The output differentiated at each point.
        differentiable : bool, default=False
            Keep the autograd graph from ``x`` to the rows (second derivatives of the
            network), e.g. to learn inducing inputs through a kernel of the rows.

        Returns
        -------
        Tensor of shape (B, P)
            Columns in :attr:`names` order, in the network's dtype.
        """
        x = self._input(x)
        return self.jacobian_backend.jacobian_rows(x, self._out_idx(x, out_idx),
                                                   differentiable)

    def ntk(self, x1: Tensor, x2: Tensor | None = None,
            out1: Tensor | None = None, out2: Tensor | None = None) -> Tensor:
        """Compute a neural tangent kernel block ``J_1 J_2^T``, in float64.

        Parameters
        ----------
        x1, x2 : Tensor
            Inputs; ``x2=None`` means ``x2 = x1`` (and ``out2 = out1``).
        out1, out2 : LongTensor of shape (B,), optional
            One output index per point; when given, the rows are the gradients of that
            output only. Otherwise all outputs, rows ordered ``b * C + c``.

        Returns
        -------
        Tensor of shape (rows1, rows2), dtype float64
            The kernel block.
        """
        x1 = self._input(x1)
        x2 = None if x2 is None else self._input(x2)
        return self.jacobian_backend.ntk(x1, x2, out1, out2)

    def gradient_rows_vjp(self, x: Tensor, out_idx: Tensor, U: Tensor) -> dict:
        """Compute ``R^T U`` where ``R`` holds the rows ``grad g_{out_idx[m]}(x_m)``.

        Parameters
        ----------
        x : Tensor of shape (M, ...)
            Input points.
        out_idx : LongTensor of shape (M,)
            One output index per point.
        U : Tensor of shape (M, K)
            ``K`` weight vectors over the rows.

        Returns
        -------
        dict of str to Tensor of shape (K, *param_shape)
            One entry per linearised parameter, in :attr:`names` order.
        """
        return self.jacobian_backend.gradient_rows_vjp(self._input(x), out_idx,
                                                       U.to(self.dtype))

    def kernel(self, X1: Tensor, X2: Tensor | None = None,
               n_outputs: int | None = None, dtype=torch.float64,
               out1: Tensor | None = None, out2: Tensor | None = None) -> Tensor:
        """Assemble a full NTK Gram matrix block by block (computed in float64).

        Without ``out1``/``out2`` the rows are all outputs of every point (ordered
        ``b * C + c``), giving a ``(n1 * C, n2 * C)`` matrix; with them, one row per
        point (the gradient of output ``out[b]``). Each block's Jacobian rows fit in
        the chunk budget, so memory beyond the result stays bounded.

        Parameters
        ----------
        X1, X2 : Tensor
            Inputs; ``X2=None`` means ``X2 = X1`` (and ``out2 = out1``).
        n_outputs : int, optional
            ``C`` (evaluated on ``X1`` when not given).
        dtype : torch.dtype, default=torch.float64
            The dtype of the result.
        out1, out2 : LongTensor, optional
            As in :meth:`ntk`.

        Returns
        -------
        Tensor of shape (rows1, rows2)
            The Gram matrix, of dtype ``dtype``.
        """
        C = n_outputs or self.n_outputs(X1)
        X2 = None if X2 is None else self._input(X2)
        return self.jacobian_backend.kernel(self._input(X1), X2, C, dtype, out1, out2)

    def ntk_diag_blocks(self, x: Tensor) -> Tensor:
        """Compute the per-point NTK blocks ``J(x_b) J(x_b)^T``, in float64.

        Parameters
        ----------
        x : Tensor of shape (B, ...)
            Input batch.

        Returns
        -------
        Tensor of shape (B, C, C), dtype float64
            One block per point.
        """
        return self.jacobian_backend.ntk_diag_blocks(self._input(x))

    def cross_and_diag(self, x: Tensor, rows: Rows, n_outputs: int) -> tuple[Tensor, Tensor]:
        """Pair all outputs at ``x`` with given rows, and their own diagonal blocks.

        Parameters
        ----------
        x : Tensor of shape (B, ...)
            Input batch.
        rows : Rows
            From :meth:`rows` (e.g. inducing points'; may carry an autograd graph).
        n_outputs : int
            ``C``.

        Returns
        -------
        cross : Tensor of shape (B, C, n_rows), dtype float64
            ``J(x) R^T``, differentiable w.r.t. what ``rows`` depends on.
        blocks : Tensor of shape (B, C, C), dtype float64
            ``J(x_b) J(x_b)^T``.
        """
        return self.jacobian_backend.cross_and_diag(self._input(x), rows, n_outputs)
