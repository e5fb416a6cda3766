"""The graph backend: convolutional / residual networks by per-layer factors.

Any network whose linearised parameters all sit in ``nn.Linear``, ``nn.Conv1d``,
``nn.Conv2d`` or ``nn.BatchNorm1d`` / ``nn.BatchNorm2d`` (eval mode, running
statistics) modules, each called once per forward pass; everything else -- residual
additions, pooling, ``Flatten`` / ``Unflatten``, activations, any parameter-free
operation -- is differentiated by autograd, so the graph needs no tracing.

One forward pass records, at each of those modules, its input ``a_l`` and adds a zero
tensor ``eps_l`` to its output; one backward pass per output (or a single one when
each point has one selected output) gives every layer's back-propagated signal
``delta_l = d g / d eps_l`` for all rows at once (all ``C`` outputs by one backward
pass batched over the cotangents). The Jacobian row blocks follow in
closed form:

* ``nn.Linear`` on ``(B, i)`` inputs: the factor ``delta_l (x) a_l``, never formed
  (paired like the structured chain's, :class:`StructuredJacobian`);
* ``nn.Conv1d`` / ``nn.Conv2d``: the weight block of a row is ``delta_l`` against the
  unfolded input patches (one batched matrix product), the bias block ``delta_l``
  summed over positions;
* ``nn.BatchNorm`` (eval): ``gamma``: ``delta_l * (a_l - mean) / sqrt(var + eps)``
  summed over positions; ``beta``: ``delta_l`` summed;
* ``nn.Linear`` on inputs with extra dimensions: the sum over positions.

Dense blocks are small for the convolutional layers of a typical CNN (their
parameters are few); the large fully connected layers stay factored. Rows are
computed once per call -- Gram blocks pair rows, they never recompute them.

Reverse mode only (autograd's grad mode is per thread; forward-mode dual levels are
process-global), and the recording hooks live on a per-thread copy of the module,
so every product is thread-safe. The backend is chosen only after its rows reproduce
the generic ``torch.func`` Jacobian on the example input.
"""

from __future__ import annotations

import copy
import threading

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..structured.jacobian import LayerFactor, StructuredJacobian
from ..structured.trace import share_copy
from .base import (
    DenseRows,
    FactoredBackend,
    Rows,
    device_budget,
)
from .graph_layers import SUPPORTED, _Layer, _module_issue, conv_patches, layer_blocks
from .graph_rows import GraphRows, _cat_rows

__all__ = ["GraphBackend", "GraphRows", "SUPPORTED", "conv_patches", "layer_blocks"]

_F64 = torch.float64


#: Elements (per chunk of points) of the rows, signals and patches a product holds.
CHUNK_ELEMENTS = 2**25

#: Elements (per recorded pass) of the signals, patches and row blocks of
#: :meth:`GraphBackend.rows` and of the KFAC complement's passes: smaller than
#: :data:`CHUNK_ELEMENTS`, so that the pass's temporaries (each below 32 MB) are reused
#: by the allocator instead of mapped and faulted in afresh for every chunk. On the
#: digits CNN (one thread) the 2,000 Nystrom rows took 0.17 s instead of 0.25 s, the
#: KFAC training pass and the predictions about 15 % less.
#:
#: At ResNet-20 scale (P = 272,474) both rules give few points per pass (rows of all
#: 10 outputs: 1 point per recorded pass, 4 per product chunk; one output per point:
#: 12 and 49), and that is not where its time goes: making a point's 10 rows costs
#: about 20 forward passes of arithmetic (the batched backward pass and the weight
#: blocks), measured at one thread 49.5 / 47.5 / 52.9 / 60.6 ms per point with 1 / 2 /
#: 4 / 8 points per pass (from 3 points a pass's dense block passes 32 MB), the
#: signals alone 36 / 30 / 25 / 24 ms, and a subspace Laplace fit on 64 rows the same
#: within its noise (10 %) with 1, 2 or 4 points per pass. The per-pass overhead
#: matters only for one row per point (17 ms a point alone, 9 ms with 16 a pass: the
#: rules give 12). What made the large net slow was the Gram's rows being remade for
#: every panel of a 256 MB budget counted with the signals (about 7 times each for
#: ELLA's 2,000 Nystrom rows): :meth:`GraphBackend.kernel` now holds panels of
#: :data:`KERNEL_PANEL_ELEMENTS` counted in the elements a kept row holds.
ROWS_CHUNK_ELEMENTS = 2**23

#: Elements (network dtype) of the Jacobian rows :meth:`GraphBackend.kernel` keeps at
#: once (1 GiB in float32): a panel of rows and the block paired with it.
KERNEL_PANEL_ELEMENTS = 2**28

#: Most elements of the float64 copy of the rows that :meth:`GraphBackend.cross_and_diag`
#: pairs every chunk with (256 MiB).
F64_COPY_ELEMENTS = 2**25

#: Largest number of Jacobian entries the check at construction compares (all outputs
#: of two example rows; beyond it, one selected output per row).
CHECK_ELEMENTS = 2**22


class _Recording:
    def __init__(self, n_layers, differentiable):
        self.acts = [None] * n_layers
        self.eps = [None] * n_layers
        self.calls = [0] * n_layers
        self.differentiable = differentiable


class GraphBackend(FactoredBackend):
    """Products of a network whose linearised layers are Linear / Conv / BatchNorm.

    Build it with :meth:`build` (which checks it against ``torch.func`` and says why
    a network is not supported).

    Parameters
    ----------
    lin : LinearizedNet
        The network.
    layers : list of _Layer
        The modules holding linearised parameters.
    reason : str
        Why this backend was chosen.
    """

    name = "graph"

    def __init__(self, lin, layers: list[_Layer], reason: str) -> None:
        super().__init__(lin, reason)
        self.layers = layers
        self._local = threading.local()
        self._cost = None  # elements per (point, row) of a product, set by build
        self._signal = 0  # elements of the back-propagated signals per row
        self._held = None  # elements a kept row holds (dense blocks and factors)
        self._C = None  # the number of outputs, read once

    def __getstate__(self):  # pragma: no cover - LinearizedNet rebuilds backends
        raise TypeError("a GraphBackend is rebuilt by its LinearizedNet, not pickled")

    # -- construction -----------------------------------------------------------
    @classmethod
    def build(cls, lin, x: Tensor | None) -> tuple[GraphBackend | None, str]:
        """The backend for ``lin``, or ``None`` and why not.

        Parameters
        ----------
        lin : LinearizedNet
            The network.
        x : Tensor of shape (B, ...) or None
            Example inputs; the backend is checked against ``torch.func`` on two rows.

        Returns
        -------
        backend : GraphBackend or None
        reason : str
        """
        owner = {}
        modules = dict(lin.module.named_modules())
        for path, m in modules.items():
            for attr, _ in m.named_parameters(recurse=False):
                owner[(path + "." if path else "") + attr] = (path, m, attr)
        by_module: dict[str, dict] = {}
        for n in lin.names:
            path, m, attr = owner[n]
            issue = _module_issue(m)
            if issue is None and attr not in ("weight", "bias"):
                issue = f"its parameter {attr!r} is not a weight or bias"
            if issue is not None:
                where = f"at {path!r}" if path else "(the network itself)"
                return None, f"parameter {n!r} of module {type(m).__name__} {where}: {issue}"
            by_module.setdefault(path, {})[attr] = n
        if x is None:
            return None, "no example_input to check the graph backend on"
        layers = [_Layer(path, modules[path], names.get("weight"), names.get("bias"))
                  for path, names in by_module.items()]
        backend = cls(lin, layers, "")
        x2 = x[:2]
        try:
            with torch.no_grad():
                C = lin.n_outputs(x2)
                # all rows of two points when they are small, else one row per point
                # (outputs 0 and C - 1), so that the check stays O(P) for large nets
                sel = (None if 2 * C * lin.n_params <= CHECK_ELEMENTS else
                       torch.tensor([0, C - 1], device=x2.device)[:x2.shape[0]])
                R = backend.rows(x2, sel)
                got = R.dense()
                ref = _reference_rows(lin, x2, sel)
        except _NotPerSample as exc:
            return None, str(exc)
        except Exception as exc:  # noqa: BLE001 - reported as the reason
            return None, f"the graph backend failed on example_input ({type(exc).__name__}: {exc})"
        tol = 1e-4 * (1.0 + ref.abs().max().item())
        if got.shape != ref.shape or not torch.allclose(got, ref, rtol=1e-3, atol=tol):
            err = (got - ref).abs().max().item() if got.shape == ref.shape else float("nan")
            return None, ("the graph backend's Jacobian did not match autograd's on "
                          f"example_input (max difference {err:.3g})")
        R = backend.rows(x2[:1])
        # per row: its dense blocks, its factors and the signals of its backward pass
        # per row: its dense blocks and its factors (what a kept row holds) ...
        backend._held = (int(R.D.shape[1]) if R.D is not None else 0) + sum(
            int(f.delta.shape[1]) + int(f.act.shape[1]) for f in
            (R.factors.layers if R.factors is not None else []))
        # ... and the signals of its backward pass (what making it holds besides)
        backend._cost = backend._held + backend._signal
        kinds: dict[str, int] = {}
        for layer in layers:
            kinds[layer.kind] = kinds.get(layer.kind, 0) + 1
        desc = ", ".join(f"{v} {k}" for k, v in kinds.items())
        backend.reason = (f"graph of {desc} layers (Jacobian blocks from per-layer factors; "
                          "autograd through every other operation)")
        return backend, backend.reason

    # -- recording --------------------------------------------------------------
    def _module(self) -> nn.Module:
        mod = getattr(self._local, "module", None)
        if mod is None:
            mod = share_copy(self.lin.module)
            named = dict(mod.named_modules())
            for i, layer in enumerate(self.layers):
                named[layer.path].register_forward_hook(self._hook(i))
            self._local.module = mod
            self._local.rec = None
        return mod

    def _hook(self, i):
        local = self._local

        def hook(module, inputs, output):
            rec = getattr(local, "rec", None)
            if rec is None:
                return None
            rec.calls[i] += 1
            a = inputs[0]
            rec.acts[i] = a if rec.differentiable else a.detach().clone()
            eps = torch.zeros_like(output, requires_grad=True)
            rec.eps[i] = eps
            return output + eps

        return hook

    def rows(self, x: Tensor, out_idx: Tensor | None = None,
             differentiable: bool = False) -> Rows:
        diff = bool(differentiable and torch.is_grad_enabled())
        if diff or self._cost is None:  # (the check at construction: two points)
            return self._rows(x, out_idx, diff)
        step = self.rows_step(1 if out_idx is not None else self._n_outputs(x))
        if x.shape[0] <= step:
            return self._rows(x, out_idx, diff)
        # more points than one product's budget: their signals and patches chunk by
        # chunk, the rows written into one preallocated block (no second copy)
        # (after the first chunk, each chunk's dense blocks are written straight into
        # its rows of D: no per-chunk block to allocate, fault in and copy)
        k = 1 if out_idx is not None else self._n_outputs(x)
        D, parts = None, []
        for s in range(0, x.shape[0], step):
            e = min(s + step, x.shape[0])
            part = self._rows(x[s:e], None if out_idx is None else out_idx[s:e], False,
                              dest=None if D is None else D[s * k:e * k])
            if part.D is not None:
                if D is None:
                    D = part.D.new_empty((x.shape[0] * k, part.D.shape[1]))
                    D[:part.D.shape[0]] = part.D
                part.D = None
            parts.append(part)
        return _cat_rows(parts, D, self.lin)

    def _record(self, x: Tensor, diff: bool) -> tuple[Tensor, _Recording, nn.Module]:
        """One recorded forward pass: ``(g, recording, the per-thread module)``."""
        mod = self._module()
        rec = _Recording(len(self.layers), diff)
        self._local.rec = rec
        try:
            with torch.enable_grad():
                g = self.lin._finish(mod(x), x.shape[0])
        finally:
            self._local.rec = None
        for i, layer in enumerate(self.layers):
            if rec.calls[i] != 1:
                raise _NotPerSample(f"module {layer.kind} at {layer.path!r} was called "
                                    f"{rec.calls[i]} times in one forward pass")
        return g, rec, mod

    def layer_signals(self, x: Tensor, mix=None) -> tuple[Tensor, list]:
        """Every layer's input and back-propagated signals, before they are contracted
        into Jacobian blocks (the per-position factors a KFAC is accumulated from).

        Parameters
        ----------
        x : Tensor of shape (B, ...)
            Inputs (already cast by the network).
        mix : callable, optional
            ``mix(g) -> M`` of shape ``(B, K, C)``: point ``b``'s ``K`` cotangents (row
            ``k`` of ``M[b]``) from the outputs ``g``; default the identity (``K = C``:
            the signals of every output's row).

        Returns
        -------
        g : Tensor of shape (B, C)
            The outputs.
        signals : list of (_Layer, nn.Module, Tensor, Tensor) or None
            Per layer of :attr:`layers`: the module, its input ``a`` ``(B, ...)`` and
            the signal at its output ``d`` ``(B * K, ...)`` (rows ``b * K + k``);
            ``None`` for a layer the forward pass did not use (its rows are zero).
        """
        g, rec, mod = self._record(x, False)
        B, C = g.shape
        with torch.no_grad():
            M = (torch.eye(C, dtype=g.dtype, device=g.device).expand(B, C, C) if mix is None
                 else mix(g.detach()).to(g.dtype))
        K = M.shape[1]
        used = [i for i in range(len(self.layers)) if rec.eps[i] is not None]
        with torch.enable_grad():
            grads = torch.autograd.grad(g, [rec.eps[i] for i in used],
                                        M.permute(1, 0, 2).contiguous(),
                                        is_grads_batched=True, allow_unused=True)
        named = dict(mod.named_modules())
        out = [None] * len(self.layers)
        for i, d in zip(used, grads):
            e = rec.eps[i]
            d = (e.new_zeros((B * K,) + e.shape[1:]) if d is None else
                 d.detach().transpose(0, 1).reshape(B * K, *e.shape[1:]))
            layer = self.layers[i]
            out[i] = (layer, named[layer.path], rec.acts[i], d)
        return g.detach(), out

    def rows_and_signals(self, x: Tensor) -> GraphRows:
        """All ``C`` outputs' rows at ``x`` (one product's chunk of points), keeping
        the layer signals they were contracted from in ``rows.signals`` (the format of
        :meth:`layer_signals`) and the unfolded conv patches in ``rows.patches`` (per
        layer index, the network's dtype; with the bias's column of ones when the layer
        has a bias: the KFAC factor ``abar``): the KFAC complement's terms and the
        features ``J(x) V`` from one forward and one backward pass.

        Parameters
        ----------
        x : Tensor of shape (B, ...)
            Inputs (already cast by the network), at most one chunk of points.

        Returns
        -------
        GraphRows
        """
        return self._rows(x, None, False, keep=True)

    def _rows(self, x: Tensor, out_idx: Tensor | None, diff: bool,
              keep: bool = False, dest: Tensor | None = None) -> GraphRows:
        """The rows at ``x`` (one chunk of points); ``dest``: preallocated
        ``(n_rows, p_dense)`` for the dense blocks (not differentiable), else new."""
        lin = self.lin
        g, rec, mod = self._record(x, diff)
        B, C = g.shape
        used = [i for i in range(len(self.layers)) if rec.eps[i] is not None]
        eps = [rec.eps[i] for i in used]
        self._signal = sum(e[0].numel() for e in eps)  # per row, for the chunk budget
        named = dict(mod.named_modules())
        caches: dict[int, dict] = {i: {} for i in used}
        factors: dict[int, LayerFactor] = {}
        fdeltas: dict[int, list] = {}
        dlists: dict[str, list] = {}
        D, offsets, views = None, {}, {}
        if not diff:
            # the dense blocks' columns (every used layer but nn.Linear on (B, i)
            # inputs, which stays factored), so that they are written in place
            start = 0
            for n in lin.names:
                for i in used:
                    layer = self.layers[i]
                    if n in layer.names() and not (
                            isinstance(named[layer.path], nn.Linear) and rec.acts[i].ndim == 2):
                        offsets[n] = (start, start + lin.params[n].numel())
                        start += lin.params[n].numel()
            if offsets:
                n_rows = B * (1 if out_idx is not None else C)
                D = torch.empty(n_rows, start, dtype=g.dtype, device=g.device) if dest is None \
                    else dest
                if D.shape != (n_rows, start):
                    raise ValueError(f"dest has shape {tuple(D.shape)}, expected "
                                     f"{(n_rows, start)}")
                views = {n: D[:, a:b] for n, (a, b) in offsets.items()}

        def blocks_of(grads, k):
            """Every layer's blocks for signals ``(B * k, ...)``, rows ``b * k + c``
            (the dense ones of the non-differentiable passes written into ``D``)."""
            out = {}
            for j, i in enumerate(used):
                d = grads[j] if grads[j] is not None else eps[j].new_zeros(
                    (B * k,) + eps[j].shape[1:])
                layer = self.layers[i]
                f, b = layer_blocks(layer, named[layer.path], rec.acts[i],
                                     d if diff else d.detach(), k, caches[i], views)
                if f is not None:
                    factors[i] = f
                    fdeltas.setdefault(i, []).append(f.delta)
                out.update(b)
            return out

        if out_idx is not None:  # one backward pass: each point's selected output
            k = 1
            cot = F.one_hot(out_idx, C).to(g.dtype)
            with torch.enable_grad():
                grads = torch.autograd.grad(g, eps, cot, retain_graph=diff,
                                            create_graph=diff, allow_unused=True)
            with torch.set_grad_enabled(diff):
                parts = [blocks_of(grads, 1)]
        elif diff:  # one backward pass per output (differentiable), rows b * C + c
            k = C
            parts = []
            for c in range(C):
                cot = torch.zeros_like(g)
                cot[:, c] = 1.0
                with torch.enable_grad():
                    grads = torch.autograd.grad(g, eps, cot, retain_graph=True,
                                                create_graph=True, allow_unused=True)
                parts.append(blocks_of(grads, 1))
        else:
            # all C outputs by one backward pass batched over the cotangents (vmap):
            # C passes' work in one, the launches of one pass (what a GPU waits on).
            # Measured on the CPU (one thread, process CPU time, alternated in one
            # process) and kept: autograd's vmap fallback runs the conv / BatchNorm
            # backward once per cotangent and stacks, then the (C, B) -> (B, C)
            # transposes copy, yet neither alternative was faster. C ordinary backward
            # passes writing into a (B, C, ...) buffer: digits CNN, 71 points, C = 10,
            # the signals 24.1 vs 21.5 ms, the rows 40.8 vs 37.8 ms; ResNet-20, one
            # point 60.4 vs 42.8 ms, four 133.6 vs 111.4 ms. One backward pass on the
            # C-fold repeated batch (C - 1 more forward passes, no transposes):
            # digits CNN 36-44 vs 17-19 ms; ResNet-20 one point 44.7 vs 42.8 ms, four
            # 175.4 vs 111.4 ms.
            k = C
            cots = torch.eye(C, dtype=g.dtype, device=g.device)[:, None, :].expand(C, B, C)
            with torch.enable_grad():
                grads = torch.autograd.grad(g, eps, cots, is_grads_batched=True,
                                            allow_unused=True)
            grads = [None if d is None else d.transpose(0, 1).reshape(B * C, *d.shape[2:])
                     for d in grads]
            with torch.no_grad():
                parts = [blocks_of(grads, C)]
        if diff:
            for blocks in parts:
                for n, blk in blocks.items():
                    dlists.setdefault(n, []).append(blk)
        else:
            (blocks,) = parts
            for n, blk in blocks.items():
                if blk is not views[n]:  # (every block is written in place today)
                    views[n].copy_(blk)
        dnames = [n for n in lin.names if n in (dlists if diff else offsets)]
        if diff and dnames:
            D = torch.cat([torch.stack(dlists[n], 1).reshape(B * k, -1) for n in dnames], dim=1)
        layers = []
        for i in sorted(factors):
            f = factors[i]
            ds = fdeltas[i]
            delta = ds[0] if len(ds) == 1 else torch.stack(ds, 1).reshape(B * k, -1)
            layers.append(LayerFactor(delta, f.act, f.weight_name, f.bias_name))
        fnames = [n for n in lin.names
                  if any(n in (f.weight_name, f.bias_name) for f in layers)]
        output = g if diff else g.detach()
        sj = StructuredJacobian(layers, k, fnames, output) if layers else None
        rows = GraphRows(sj, None if D is None else D.reshape(B * k, -1), dnames, k, lin,
                         output)
        if keep:  # (all outputs, not differentiable: the batched branch above)
            rows.signals = [None] * len(self.layers)
            rows.patches = {}
            for j, i in enumerate(used):
                layer = self.layers[i]
                rows.signals[i] = (layer, named[layer.path], rec.acts[i], grads[j] if
                                   grads[j] is not None else eps[j].new_zeros(
                                       (B * k,) + eps[j].shape[1:]))
                if "abar" in caches[i]:
                    rows.patches[i] = caches[i]["abar"]
        return rows

    # -- products -----------------------------------------------------------------
    def _n_outputs(self, x: Tensor) -> int:
        if self._C is None:
            self._C = self.lin.n_outputs(x)
        return self._C

    def row_elements(self) -> int:
        return self._cost

    def kernel_step(self, rows_per_point: int) -> int:
        budget = device_budget(CHUNK_ELEMENTS, self.lin.device)
        return max(1, budget // max(1, rows_per_point * self._cost))

    def rows_step(self, rows_per_point: int) -> int:
        """Points per recorded pass of :meth:`rows` and of the KFAC complement's
        shared passes: at most :data:`ROWS_CHUNK_ELEMENTS` elements of signals,
        patches and row blocks (and never more than :meth:`kernel_step`).

        Parameters
        ----------
        rows_per_point : int

        Returns
        -------
        int
        """
        budget = device_budget(ROWS_CHUNK_ELEMENTS, self.lin.device)
        return max(1, min(self.kernel_step(rows_per_point),
                          budget // max(1, rows_per_point * self._cost)))

    def kernel(self, X1: Tensor, X2: Tensor | None, C: int, dtype, out1=None,
               out2=None) -> Tensor:
        """The full Gram ``J(X1) J(X2)^T`` (see ``LinearizedNet.kernel``), from panels
        of rows as large as :data:`KERNEL_PANEL_ELEMENTS` allows.

        A panel of ``X1``'s rows (at most 7/8 of the budget, counted in the elements a
        kept row holds: its dense blocks and factors, not the signals it was made
        from) is made once, paired with itself by one ``syrk`` and with blocks of the
        other rows (the rest of the budget) made one at a time; with ``X2`` given, the
        side with fewer rows is the panel (a test batch against the training rows:
        both made once when it fits). Each row of the panel side is made once;
        with ``X2=None`` the rows after a panel are made once per panel before them,
        so when all rows fit (the digits CNN's) each row is made once, and at
        P = 272k (ResNet-20, 2,000 rows of about 1.1 MB each, three panels) the
        rows are made about 1.5 times instead of about 7 times by the generic
        chunk-pair rule, whose small Gram blocks also converted each chunk to
        float64 once per pairing.

        Parameters
        ----------
        X1 : Tensor of shape (n1, ...)
        X2 : Tensor of shape (n2, ...) or None
            ``None``: ``X1`` (and ``out1``).
        C : int
            Outputs per point when ``out1`` / ``out2`` is not given.
        dtype : torch.dtype
            The result's dtype.
        out1, out2 : LongTensor, optional
            One selected output per point.

        Returns
        -------
        Tensor of shape (rows1, rows2)
        """
        if self._held is None:  # (not built yet: the generic rule)
            return super().kernel(X1, X2, C, dtype, out1, out2)
        same = X2 is None
        if same:
            X2, out2 = X1, out1
        r1 = 1 if out1 is not None else C
        r2 = 1 if out2 is not None else C
        n1, n2 = X1.shape[0], X2.shape[0]
        if not same and n2 * r2 < n1 * r1:  # the smaller side is the panel
            return self.kernel(X2, X1, C, dtype, out2, out1).T.contiguous()
        budget = device_budget(KERNEL_PANEL_ELEMENTS, self.lin.device)
        held = max(1, self._held)
        p1 = max(1, (budget - budget // 8) // (r1 * held))
        # the other side's blocks: the rest of the budget (each block is paired with
        # every panel, each pairing converting the panel's columns to float64)
        p2 = max(1, (budget - min(n1, p1) * r1 * held) // (r2 * held))
        out = torch.empty((n1 * r1, n2 * r2), dtype=dtype, device=self.lin.device)

        def rows(X, o, a, b):
            return self.rows(X[a:b], None if o is None else o[a:b])

        with torch.no_grad():
            for a in range(0, n1, p1):
                b = min(a + p1, n1)
                Ra = rows(X1, out1, a, b)
                if same:
                    out[a * r1:b * r1, a * r1:b * r1] = Ra.gram()
                for c in range(b if same else 0, n2, p2):
                    d = min(c + p2, n2)
                    blk = Ra.gram(rows(X2, out2, c, d))
                    out[a * r1:b * r1, c * r2:d * r2] = blk
                    if same:
                        out[c * r2:d * r2, a * r1:b * r1] = blk.T
                del Ra
        return out

    def ntk_diag_blocks(self, x: Tensor) -> Tensor:
        step = self.kernel_step(self._n_outputs(x))
        with torch.no_grad():
            return torch.cat([self.rows(x[s:s + step]).diag_blocks()
                              for s in range(0, x.shape[0], step)])

    def cross_and_diag(self, x: Tensor, rows, n_outputs: int) -> tuple[Tensor, Tensor]:
        """``(J(x) R^T, ntk_diag_blocks(x))`` chunk by chunk of ``x``.

        When ``rows`` carry no autograd graph (or grad mode is off), the pairing is
        :meth:`GraphRows.gram` (no graph) against a float64 copy of ``rows``' dense
        blocks made once (up to :data:`F64_COPY_ELEMENTS`) instead of once per chunk
        of ``x`` (VaLLA's fit at P = 272k: its inducing rows converted 67 times).

        Parameters
        ----------
        x : Tensor of shape (B, ...)
        rows : Rows
        n_outputs : int

        Returns
        -------
        cross : Tensor of shape (B, n_outputs, n_rows), dtype float64
        blocks : Tensor of shape (B, n_outputs, n_outputs), dtype float64
        """
        step = self.kernel_step(n_outputs)
        diff = torch.is_grad_enabled() and _carries_graph(rows)
        other = rows if diff else _with_f64_dense(rows)
        parts, blocks = [], []
        for s in range(0, x.shape[0], step):
            Fx = self.rows(x[s:s + step])
            G = Fx.cross_gram(other) if diff else Fx.gram(other)
            parts.append(G.view(-1, n_outputs, rows.n_rows))
            blocks.append(Fx.diag_blocks())
        return torch.cat(parts), torch.cat(blocks)

    def _jvp_chunks(self, x: Tensor, T: dict, with_blocks: bool) -> tuple:
        """``(g, J T)`` and, with ``with_blocks``, the diagonal NTK blocks, chunk by
        chunk from the rows of each chunk."""
        K = next((t.shape[0] for t in T.values()), None)
        if K is None:
            raise ValueError("tangents is empty")
        step = self.kernel_step(self._n_outputs(x))
        gs, jvs, blocks = [], [], []
        flat, names = None, None  # the dense blocks' directions, made once
        with torch.no_grad():
            for s in range(0, x.shape[0], step):
                R = self.rows(x[s:s + step])
                b, C = R.output.shape
                gs.append(R.output)
                if R.D is not None and R.dense_names != names:
                    flat, names = R.dense_directions(T), R.dense_names
                jvs.append(R.matmul(T, flat if R.D is not None else None).view(b, C, K))
                if with_blocks:
                    blocks.append(R.diag_blocks())
        out = (torch.cat(gs), torch.cat(jvs))
        return out + (torch.cat(blocks),) if with_blocks else out

    def jvp(self, x: Tensor, T: dict) -> tuple[Tensor, Tensor]:
        return self._jvp_chunks(x, T, False)

    def jvp_and_ntk_diag(self, x: Tensor, T: dict) -> tuple[Tensor, Tensor, Tensor]:
        return self._jvp_chunks(x, T, True)

    def vjp(self, x: Tensor, cotangents: Tensor) -> dict:
        K, B, C = cotangents.shape
        if K <= C:
            return super().vjp(x, cotangents)
        step = self.kernel_step(C)
        res = None
        with torch.no_grad():
            for s in range(0, B, step):
                U = cotangents[:, s:s + step].permute(1, 2, 0).reshape(-1, K)
                part = self.rows(x[s:s + step]).vjp(U)
                res = part if res is None else {n: res[n] + part[n] for n in res}
        return res


def _carries_graph(rows) -> bool:
    """Whether any tensor of ``rows`` requires grad (an autograd graph to keep)."""
    if isinstance(rows, DenseRows):
        return rows.R.requires_grad
    ts = [rows.D, rows.output]
    if rows.factors is not None:
        ts += [t for f in rows.factors.layers for t in (f.delta, f.act)]
    return any(t is not None and t.requires_grad for t in ts)


def _with_f64_dense(rows):
    """``rows`` with a float64 copy of its dense blocks when they fit
    :data:`F64_COPY_ELEMENTS` (a shallow copy; the factors are shared), else ``rows``."""
    if (not isinstance(rows, GraphRows) or rows.D is None or rows.D.dtype == _F64
            or rows.D.numel() > device_budget(F64_COPY_ELEMENTS, rows.D.device)):
        return rows
    out = copy.copy(rows)
    out.D = rows.D.to(_F64)
    return out


def _reference_rows(lin, x: Tensor, out_idx: Tensor | None = None) -> Tensor:
    """Jacobian rows at ``x`` (all, rows ``b * C + c``, or output ``out_idx[b]`` of
    point ``b``) by plain autograd, one backward pass per row (a few rows: the check of
    :meth:`GraphBackend.build`)."""
    params = {n: p.detach().clone().requires_grad_() for n, p in lin.params.items()}
    leaves = [params[n] for n in lin.names]
    with torch.enable_grad():
        g = lin._g(params, x)
        rows = []
        for b in range(g.shape[0]):
            for c in (range(g.shape[1]) if out_idx is None else [int(out_idx[b])]):
                grads = torch.autograd.grad(g[b, c], leaves, retain_graph=True,
                                            allow_unused=True)
                rows.append(torch.cat([(gr if gr is not None else torch.zeros_like(p))
                                       .reshape(-1) for gr, p in zip(grads, leaves)]))
    return torch.stack(rows)


class _NotPerSample(RuntimeError):
    """A recorded module was not called exactly once."""
