"""A frozen, functional view of a pretrained network and its Jacobian products.

:class:`LinearizedNet` is the one place where the library touches the user's network.
It deep-copies the module once (so the user's object is never mutated, not even its
``training`` flag or ``requires_grad``), evaluates it in eval mode with
:func:`torch.func.functional_call`, and offers the products every method needs:

* ``forward``: ``g(x)``;
* ``jvp``: ``g(x)`` and ``J(x) t_k`` for many tangents in one batched forward pass;
* ``vjp``: ``J(x)^T u_k`` for many cotangents;
* ``jacobian``: per-example Jacobian rows, in chunks whose memory is bounded;
* ``ntk``: blocks of the neural tangent kernel ``J(x) J(x')^T``.

For networks that are chains of ``nn.Linear`` layers and elementwise maps the NTK,
VJP and JVP go through :mod:`sklearn_lla._structured`, which never forms Jacobian
rows; every other architecture uses ``torch.func``.
"""

from __future__ import annotations

import copy
import warnings

import torch
from torch import nn
from torch.func import functional_call, jacrev, jvp, vjp, vmap

__all__ = ["LinearizedNet"]

#: Default memory budget (in tensor elements) of one chunk of Jacobian rows.
JACOBIAN_CHUNK_ELEMENTS = 2**25


class LinearizedNet:
    """Functional, frozen view of a pretrained network ``g(x; theta_hat)``.

    Parameters
    ----------
    module : torch.nn.Module
        The pretrained network. It is deep-copied; the original is never modified.
    device : torch.device
        Where to compute.
    output_transform : {"identity", "log", "binary"}, default="identity"
        How module outputs map to ``g``: unchanged, ``log`` (a module that outputs
        probabilities, as skorch's default classifier), or ``binary`` (a single logit
        ``z`` becomes the two logits ``[0, z]``).
    structured : bool, default=True
        Use the structured fast path when the module is a supported chain.

    Attributes
    ----------
    params : dict of str to Tensor
        The pretrained parameters ``theta_hat`` (detached copies).
    n_params : int
        ``P``, the number of parameters.
    dtype : torch.dtype
        The parameters' floating dtype; inputs are cast to it.
    chain : StructuredChain or None
        The structured representation, when available.
    """

    def __init__(self, module: nn.Module, device, output_transform: str = "identity",
                 structured: bool = True):
        if output_transform not in ("identity", "log", "binary"):
            raise ValueError(f"unknown output_transform {output_transform!r}")
        mod = copy.deepcopy(module).to(device)
        mod.eval()
        for p in mod.parameters():
            p.requires_grad_(False)
        self.module = mod
        self.device = torch.device(device)
        self.output_transform = output_transform
        self.params = {n: p.detach() for n, p in mod.named_parameters()}
        if not self.params:
            raise ValueError("the network has no parameters to linearise")
        self.buffers = {n: b.detach() for n, b in mod.named_buffers()}
        self.names = list(self.params)
        self.shapes = [self.params[n].shape for n in self.names]
        self.numels = [self.params[n].numel() for n in self.names]
        self.n_params = int(sum(self.numels))
        dtypes = {p.dtype for p in self.params.values()}
        if len(dtypes) != 1 or not next(iter(dtypes)).is_floating_point:
            raise TypeError(f"network parameters must share one floating dtype, got {dtypes}")
        self.dtype = next(iter(dtypes))
        self.structured = structured
        self._build_chain()

    def _build_chain(self):
        self.chain = None
        self._chain_checked = False
        if self.structured and self.output_transform == "identity":
            try:
                from ._structured import StructuredChain
            except ImportError:  # pragma: no cover
                StructuredChain = None
            if StructuredChain is not None:
                try:
                    self.chain = StructuredChain.from_module(self.module)
                except Exception:  # tracing is best effort; fall back to torch.func
                    self.chain = None

    def __getstate__(self):
        # The traced chain holds closures that do not pickle; it is rebuilt on load.
        state = self.__dict__.copy()
        state.pop("chain", None)
        state.pop("_chain_checked", None)
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._build_chain()

    # ------------------------------------------------------------------ basics
    def _g(self, params, x):
        out = functional_call(self.module, (params, self.buffers), (x,))
        if out.ndim == 1:
            out = out.unsqueeze(-1)
        elif out.ndim > 2:
            out = out.reshape(out.shape[0], -1)
        if self.output_transform == "log":
            out = torch.log(out.clamp_min(torch.finfo(out.dtype).tiny))
        elif self.output_transform == "binary":
            if out.shape[-1] != 1:
                raise ValueError("a binary classifier net must have exactly one output")
            out = torch.cat([torch.zeros_like(out), out], dim=-1)
        return out

    def _use_chain(self, x) -> bool:
        """Use the structured path, after checking once that it reproduces ``g``."""
        if self.chain is None:
            return False
        if not self._chain_checked:
            xs = x[: min(len(x), 8)]
            with torch.no_grad():
                ref = self._g(self.params, xs)
                try:
                    got = self.chain.forward(self.params, self.buffers, xs)
                    ok = got.shape == ref.shape and torch.allclose(
                        got, ref, rtol=1e-4, atol=1e-5 * (1 + ref.abs().max().item())
                    )
                except Exception:
                    ok = False
            if not ok:
                warnings.warn(
                    "the structured NTK path did not reproduce the network's outputs; "
                    "falling back to generic Jacobians",
                    RuntimeWarning,
                    stacklevel=3,
                )
                self.chain = None
            self._chain_checked = True
        return self.chain is not None

    def to_input(self, x) -> torch.Tensor:
        """Cast an input batch to the network's dtype and device."""
        return torch.as_tensor(x).to(device=self.device, dtype=self.dtype)

    @torch.no_grad()
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Network outputs ``g(x)`` of shape (B, C)."""
        return self._g(self.params, x)

    __call__ = forward

    def n_outputs(self, x: torch.Tensor) -> int:
        """Number of outputs ``C`` (evaluated on a sample input)."""
        return int(self.forward(x[:1]).shape[-1])

    # ------------------------------------------------------------ flat vectors
    def flatten(self, tree: dict) -> torch.Tensor:
        """Stack a dict of per-parameter tensors with a leading batch dim into (K, P)."""
        return torch.cat([tree[n].reshape(tree[n].shape[0], -1) for n in self.names], dim=1)

    def unflatten(self, flat: torch.Tensor) -> dict:
        """Inverse of :meth:`flatten`: (K, P) to a dict of (K, *shape) tensors."""
        out, start = {}, 0
        for n, shape, k in zip(self.names, self.shapes, self.numels):
            out[n] = flat[:, start:start + k].reshape(flat.shape[0], *shape)
            start += k
        return out

    def flat_params(self) -> torch.Tensor:
        """``theta_hat`` as a flat vector of length P."""
        return torch.cat([self.params[n].reshape(-1) for n in self.names])

    # ---------------------------------------------------------------- products
    def jvp(self, x: torch.Tensor, tangents) -> tuple[torch.Tensor, torch.Tensor]:
        """Outputs and Jacobian-vector products for many tangents in one pass.

        Parameters
        ----------
        x : Tensor of shape (B, ...)
        tangents : Tensor of shape (K, P) or dict of (K, *param_shape)

        Returns
        -------
        g : Tensor of shape (B, C)
        jv : Tensor of shape (B, C, K)
            ``jv[b, :, k] = J(x_b) t_k``.
        """
        if isinstance(tangents, torch.Tensor):
            tangents = self.unflatten(tangents.to(self.dtype))
        if self._use_chain(x):
            return self.chain.jvp(self.params, self.buffers, x, tangents)

        def f(p):
            return self._g(p, x)

        def one(t):
            return jvp(f, (self.params,), (t,))

        with torch.no_grad():
            g, jv = vmap(one, out_dims=(None, 0))(tangents)
        return g, jv.permute(1, 2, 0)

    def vjp(self, x: torch.Tensor, cotangents: torch.Tensor) -> dict:
        """Vector-Jacobian products ``sum_b J(x_b)^T u_k[b]``.

        Parameters
        ----------
        x : Tensor of shape (B, ...)
        cotangents : Tensor of shape (K, B, C)

        Returns
        -------
        dict of str to Tensor of shape (K, *param_shape)
        """
        _, fn = vjp(lambda p: self._g(p, x), self.params)
        with torch.no_grad():
            (grads,) = vmap(fn)(cotangents.to(self.dtype))
        return grads

    def _jacobian_dense(self, x: torch.Tensor) -> torch.Tensor:
        def single(p, xi):
            return self._g(p, xi.unsqueeze(0)).squeeze(0)

        jac = vmap(jacrev(single), in_dims=(None, 0))(self.params, x)
        B = x.shape[0]
        C = next(iter(jac.values())).shape[1]
        return torch.cat([jac[n].reshape(B, C, -1) for n in self.names], dim=2)

    def jacobian(self, x: torch.Tensor) -> torch.Tensor:
        """Per-example Jacobians of shape (B, C, P) (use :meth:`jacobian_chunks` for many points)."""
        if self._use_chain(x):
            with torch.no_grad():
                F = self.chain.features(self.params, self.buffers, x)
                return F.dense().reshape(x.shape[0], -1, self.n_params)
        with torch.no_grad():
            return self._jacobian_dense(x)

    def chunk_size(self, n_outputs: int, budget: int = JACOBIAN_CHUNK_ELEMENTS) -> int:
        """Number of points whose Jacobian rows fit in ``budget`` elements."""
        return max(1, budget // max(1, n_outputs * self.n_params))

    def jacobian_chunks(self, X: torch.Tensor, n_outputs: int, budget: int = JACOBIAN_CHUNK_ELEMENTS):
        """Yield ``(slice, J)`` with ``J`` of shape (b, C, P) over chunks of ``X``."""
        step = self.chunk_size(n_outputs, budget)
        for start in range(0, X.shape[0], step):
            sl = slice(start, min(start + step, X.shape[0]))
            yield sl, self.jacobian(X[sl])

    def ntk(self, x1: torch.Tensor, x2: torch.Tensor | None = None,
            out1: torch.Tensor | None = None, out2: torch.Tensor | None = None) -> torch.Tensor:
        """Neural tangent kernel block ``J_1 J_2^T``.

        Parameters
        ----------
        x1, x2 : Tensor
            Inputs; ``x2=None`` means ``x2 = x1`` (and ``out2 = out1``).
        out1, out2 : LongTensor of shape (B,), optional
            One output index per point; when given, the rows are the gradients of that
            output only. Otherwise all outputs, rows ordered ``b * C + c``.

        Returns
        -------
        Tensor of shape (rows1, rows2)
        """
        same = x2 is None
        if same:
            x2, out2 = x1, out1
        if self._use_chain(x1):
            with torch.no_grad():
                F1 = self.chain.features(self.params, self.buffers, x1, out1)
                F2 = F1 if same else self.chain.features(self.params, self.buffers, x2, out2)
                return F1.gram(F2)
        R1 = self._rows(x1, out1)
        R2 = R1 if same else self._rows(x2, out2)
        return R1 @ R2.T

    def _rows(self, x, out_idx):
        J = self.jacobian(x)
        if out_idx is None:
            return J.reshape(-1, J.shape[-1])
        return J[torch.arange(J.shape[0], device=J.device), out_idx]

    def gradient_rows_vjp(self, x: torch.Tensor, out_idx: torch.Tensor, U: torch.Tensor) -> dict:
        """``R^T U`` where ``R`` holds the rows ``grad g_{out_idx[m]}(x_m)``.

        Parameters
        ----------
        x : Tensor of shape (M, ...)
        out_idx : LongTensor of shape (M,)
        U : Tensor of shape (M, K)

        Returns
        -------
        dict of str to Tensor of shape (K, *param_shape)
        """
        U = U.to(self.dtype)
        if self._use_chain(x):
            with torch.no_grad():
                F = self.chain.features(self.params, self.buffers, x, out_idx)
                return F.vjp(U)
        C = self.n_outputs(x)
        onehot = torch.nn.functional.one_hot(out_idx, C).to(self.dtype)  # (M, C)
        cot = U.T[:, :, None] * onehot[None]  # (K, M, C)
        return self.vjp(x, cot)

    def kernel(self, X1: torch.Tensor, X2: torch.Tensor | None = None,
               n_outputs: int | None = None, dtype=torch.float64,
               out1: torch.Tensor | None = None, out2: torch.Tensor | None = None) -> torch.Tensor:
        """Full NTK Gram matrix, assembled block by block.

        Without ``out1``/``out2`` the rows are all outputs of every point (ordered
        ``b * C + c``), giving a ``(n1 * C, n2 * C)`` matrix; with them, one row per
        point (the gradient of output ``out[b]``). Each block's Jacobian rows fit in
        the chunk budget, so memory beyond the result stays bounded.
        """
        C = n_outputs or self.n_outputs(X1)
        same = X2 is None
        if same:
            X2, out2 = X1, out1
        r1 = 1 if out1 is not None else C
        r2 = 1 if out2 is not None else C
        step = self.chunk_size(C) if self.chain is None else 4096
        n1, n2 = X1.shape[0], X2.shape[0]
        out = torch.empty((n1 * r1, n2 * r2), dtype=dtype, device=self.device)

        def sel(o, s):
            return None if o is None else o[s]

        for i in range(0, n1, step):
            si = slice(i, min(i + step, n1))
            for j in range(0, n2, step):
                if same and j < i:
                    continue
                sj = slice(j, min(j + step, n2))
                if same and i == j:
                    blk = self.ntk(X1[si], None, sel(out1, si))
                else:
                    blk = self.ntk(X1[si], X2[sj], sel(out1, si), sel(out2, sj))
                out[si.start * r1:si.stop * r1, sj.start * r2:sj.stop * r2] = blk.to(dtype)
                if same and j > i:
                    out[sj.start * r2:sj.stop * r2, si.start * r1:si.stop * r1] = blk.T.to(dtype)
        return out

    def ntk_diag_blocks(self, x: torch.Tensor) -> torch.Tensor:
        """Per-point NTK blocks ``J(x_b) J(x_b)^T`` of shape (B, C, C)."""
        if self._use_chain(x):
            with torch.no_grad():
                return self.chain.features(self.params, self.buffers, x).diag_blocks()
        out = []
        for _, J in self.jacobian_chunks(x, self.n_outputs(x)):
            out.append(J @ J.transpose(1, 2))
        return torch.cat(out)
