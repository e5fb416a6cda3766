"""Curvature of the linearised network: KFAC, the full GGN, its diagonal, SWAG variances.

These are the curvature estimates the subspace projectors of
:mod:`sklearn_lla._posteriors.subspace` are built from (``Psi_approx``). On networks
whose Jacobian backend has layer factors the projector reads the same KFAC from the
KFAC complement's factors instead (:mod:`sklearn_lla._posteriors.subspace_kfac`, one
pass shared with the complement); :class:`KFAC` here is the path for the others.

KFAC comes from ``curvlinops`` (``KFACLinearOperator`` with the exact type-2 GGN
factors, ``KFACInverseLinearOperator`` with exact damping for ``Psi_approx``). Every
pass runs on the network in its own dtype (a float32 net keeps its fast float32
kernels); what is accumulated (the Kronecker factors, the diagonal's sums, the dense
GGN) is accumulated in float64, and the algebra on it is float64. The
diagonal of the GGN is exact: ``sum_n sum_c (A_n^T J_n)_c^2`` streamed over
memory-bounded chunks of per-example Jacobians (curvlinops only estimates
diagonals stochastically). Only :func:`full_ggn` forms a ``p x p`` matrix.
"""

from __future__ import annotations

import copy
import pickle

import torch
from torch import nn

from .linearized import LinearizedNet

__all__ = ["KFAC", "ggn_diagonal", "full_ggn", "swag_variances", "float64_view"]


class UnsupportedKFAC(ValueError):
    """The network has linearised parameters outside KFAC's supported layers."""


class _Outputs(nn.Module):
    """``g(x)`` of shape (B, C) from a module (shape fix and output transform)."""

    def __init__(self, module, transform):
        super().__init__()
        self.m = module
        self.transform = transform

    def forward(self, x):
        out = self.m(x)
        out = out.reshape(x.shape[0], -1)
        if self.transform == "log":
            out = torch.log(out.clamp_min(torch.finfo(out.dtype).tiny))
        return out


def float64_view(lin):
    """``lin`` itself, or a float64 copy of it (only where a dense float64 operator is
    inherent: the ``"optimal"`` projector's full GGN on a small network)."""
    if lin.dtype == torch.float64:
        return lin
    x = getattr(lin, "_trace_input", None)
    if x is not None and x.is_floating_point():
        x = x.double()
    return LinearizedNet(copy.deepcopy(lin.module).double(), lin.device, lin.output_transform,
                         structured=lin.structured, param_names=list(lin.names),
                         example_input=x)


def _rows(lin, x, lik):
    """``A^T J(x)`` (B, C, p) float64, unit noise for a Gaussian likelihood (the
    Jacobian in the network's dtype, cast to float64 before anything is summed)."""
    x = _as_net_dtype(lin, x)
    J = lin.jacobian(x).double()
    if lik.unit_curvature:
        return J
    A = lik.lam_factor(lin.forward(x).double())
    return torch.einsum("bck,bcp->bkp", A, J)


def _as_net_dtype(lin, x):
    """Floating inputs in the network's dtype (integer inputs, e.g. token ids, as they are)."""
    return x.to(lin.dtype) if x.is_floating_point() and x.dtype != lin.dtype else x


def _chunk(lin, C, batch_size):
    return max(1, min(batch_size, lin.chunk_size(C)))


def _ggn_diagonal(payload, batches):
    lin, lik = payload
    d = torch.zeros(lin.n_params, dtype=torch.float64, device=lin.device)
    for x, _ in batches:
        d += _rows(lin, x, lik).pow(2).sum((0, 1))
    return (d,)


def ggn_diagonal(lin, data):
    """Exact diagonal of the GGN (unit noise for a Gaussian likelihood), float64 (p,)."""
    payload = (lin, data.likelihood)
    return data.reduce(_ggn_diagonal, payload, _chunk(lin, data.n_outputs, data.batch_size))[0]


def _full_ggn(payload, batches):
    lin, lik = payload
    p = lin.n_params
    G = torch.zeros((p, p), dtype=torch.float64, device=lin.device)
    for x, _ in batches:
        R = _rows(lin, x, lik).reshape(-1, p)
        G.addmm_(R.T, R)
    return (G,)


def full_ggn(lin, data):
    """Dense GGN ``sum_n J_n^T Lam_n J_n`` (unit noise for a Gaussian), float64 (p, p)."""
    payload = (lin, data.likelihood)
    return data.reduce(_full_ggn, payload, _chunk(lin, data.n_outputs, data.batch_size))[0]


def _curvlinops_batches(batches, bernoulli, dtype):
    """``(x, y)`` batches as curvlinops' losses take them: floating inputs in the
    network's ``dtype``, and a ``(B, 1)`` target of that dtype for a Bernoulli
    (``BCEWithLogitsLoss``) likelihood; a regression target in that dtype too."""
    for x, y in batches:
        x = x.to(dtype) if x.is_floating_point() else x
        if bernoulli:
            y = y.reshape(-1, 1).to(dtype)
        elif y.is_floating_point():
            y = y.to(dtype)
        yield x, y


class _Batches:
    """A re-iterable view of the training stream for curvlinops (the net's dtype)."""

    def __init__(self, data, bernoulli, dtype):
        self.data, self.bernoulli, self.dtype = data, bernoulli, dtype

    def __iter__(self):
        return _curvlinops_batches(self.data.batches(), self.bernoulli, self.dtype)


_KFAC64 = None


def _kfac64_class():
    """curvlinops' ``KFACLinearOperator`` with its Kronecker factors accumulated in
    float64: each batch's factor (``a^T a`` / ``g^T g`` over the batch's rows, in the
    network's dtype) is cast to float64 before it is added to the running sum, so a
    float32 network's passes stay float32 and nothing is summed over batches in float32.
    """
    global _KFAC64
    if _KFAC64 is None:
        from curvlinops import KFACLinearOperator

        class KFACLinearOperator64(KFACLinearOperator):
            @staticmethod
            def _set_or_add_(dictionary, key, value):
                return KFACLinearOperator._set_or_add_(dictionary, key,
                                                       value.to(torch.float64))

        _KFAC64 = KFACLinearOperator64
    return _KFAC64


def _kfac_operator(mod, loss, names, batches, num_data):
    from curvlinops.kfac import FisherType

    named = dict(mod.m.named_parameters())
    return _kfac64_class()(mod, loss, [named[n] for n in names], batches,
                           fisher_type=FisherType.TYPE2, num_data=num_data,
                           num_per_example_loss_terms=1, check_deterministic=False,
                           separate_weight_and_bias=False)


def _factor_keys(state):
    """The Kronecker factors of a KFAC state dict, in a fixed order."""
    return [(kind, name) for kind in ("input_covariances", "gradient_covariances")
            for name in sorted(state[kind], key=str)]


def _kfac_factors(payload, batches):
    """KFAC's Kronecker factors over ``batches`` (they add over disjoint row sets)."""
    mod_bytes, loss, names, num_data, bernoulli, dtype = payload
    # A private copy per task (curvlinops hooks into it), unpickled here: dask's own
    # serialisation of modules leaves plain-dict hook tables, which torch cannot hook.
    mod = pickle.loads(mod_bytes)
    op = _kfac_operator(mod, loss, names,
                        _OnePass(_curvlinops_batches(batches, bernoulli, dtype)), num_data)
    op.compute_kronecker_factors()
    state = op.state_dict()
    return tuple(state[kind][name].to(torch.float64) for kind, name in _factor_keys(state))


class _OnePass:
    """A partition's batches for curvlinops, read once.

    curvlinops peeks at the first batch (``next(iter(data))``) and then loops over
    the data: the first batch is kept for the loop that follows, and a second full
    loop, which would silently see no rows, raises instead.
    """

    def __init__(self, it):
        self.it, self.first, self.drained = iter(it), None, False

    def __iter__(self):
        if self.drained:
            raise RuntimeError("internal error: KFAC iterated a partition's batches twice")
        return self._gen()

    def _gen(self):
        if self.first is None:
            self.first = next(self.it, None)
            if self.first is None:
                return
        yield self.first
        self.drained = True
        yield from self.it


#: The layers curvlinops' KFAC supports.
KFAC_LAYERS = (nn.Linear, nn.Conv2d)


def _owners(module):
    """``{parameter name: its module}``."""
    out = {}
    for path, m in module.named_modules():
        for attr, _ in m.named_parameters(recurse=False):
            out[(path + "." if path else "") + attr] = m
    return out


class KFAC:
    """KFAC of the GGN (curvlinops, exact type-2 factors) from passes through the net in
    its own dtype, the factors accumulated and stored in float64, with the exact GGN
    diagonal for the parameters of layers KFAC does not support.

    ``GGN ~ scale * K`` with ``K`` curvlinops' operator: ``scale = 1 / (2 s2)`` for a
    Gaussian likelihood (``MSELoss(reduction="sum")`` has Hessian ``2 I``), 1 otherwise.
    The parameters of ``nn.Linear`` / ``nn.Conv2d`` layers get KFAC's Kronecker
    blocks; any other linearised parameter (BatchNorm's weight and bias, a Conv1d,
    ...) its exact diagonal GGN entry (:func:`ggn_diagonal` of a view of the network
    linearised in those parameters only: per-example rows of their size, never of
    ``p``). The approximation is block diagonal, so its eigenvalues are KFAC's and
    those diagonal entries, and its damped inverse acts block by block.

    Parameters
    ----------
    lin : LinearizedNet
    data : FitData

    Attributes
    ----------
    description : str
        Which curvature covers which parameters, in words.
    """

    def __init__(self, lin, data):
        from curvlinops import KFACLinearOperator

        lik = data.likelihood
        owners = _owners(lin.module)
        kfac_names = [n for n in lin.names if type(owners[n]) in KFAC_LAYERS]
        rest = [n for n in lin.names if n not in set(kfac_names)]
        if not kfac_names:
            raise UnsupportedKFAC(
                "KFAC (curvlinops) supports only nn.Linear and nn.Conv2d layers, and this "
                "network has no linearised parameter in one; use projector='lowrank-diag' "
                "or a subset projector")
        # a private copy in the net's own dtype (curvlinops hooks into it and sets
        # requires_grad); only the factors are float64
        mod = _Outputs(copy.deepcopy(lin.module), lin.output_transform)
        dtype = lin.dtype
        named = dict(mod.m.named_parameters())
        params = [named[n] for n in kfac_names]
        for p in params:
            p.requires_grad_(True)
        if lik.task == "regression":
            loss = nn.MSELoss(reduction="sum")
            self.unit_scale = 0.5
        elif data.n_outputs == 1:
            loss = nn.BCEWithLogitsLoss(reduction="sum")
            self.unit_scale = 1.0
        else:
            loss = nn.CrossEntropyLoss(reduction="sum")
            self.unit_scale = 1.0
        try:
            self.mapping = KFACLinearOperator.compute_parameter_mapping(params, mod)
        except NotImplementedError as exc:
            raise UnsupportedKFAC(
                f"KFAC (curvlinops) could not handle this network's nn.Linear / nn.Conv2d "
                f"layers ({exc}); use projector='lowrank-diag' or a subset projector") from exc
        bernoulli = data.n_outputs == 1 and lik.task != "regression"
        if not data.is_dask:
            self.op = _kfac_operator(mod, loss, kfac_names, _Batches(data, bernoulli, dtype),
                                     data.n_samples)
            self.op.compute_kronecker_factors()
        else:
            # The type-2 factors with num_data = N fixed are sums over rows (checked to
            # 1e-15 against one pass): one operator per partition on the workers, the
            # factors added on the client and loaded into an operator built on one row.
            sums = data.reduce(_kfac_factors, (pickle.dumps(mod), loss, list(kfac_names),
                                               data.n_samples, bernoulli, dtype))
            first = list(_curvlinops_batches([data.rows(slice(0, 1))], bernoulli, dtype))
            self.op = _kfac_operator(mod, loss, kfac_names, first, data.n_samples)
            self.op.compute_kronecker_factors()
            state = self.op.state_dict()
            keys = _factor_keys(state)
            for (kind, name), value in zip(keys, sums):
                state[kind][name] = value.to(torch.float64)
            self.op.load_state_dict(state)
        self.names = list(lin.names)
        self.shapes = [named[n].shape for n in lin.names]
        self.kfac_names, self.diag_names = kfac_names, rest
        offsets, start = {}, 0
        for n in lin.names:
            offsets[n] = (start, start + named[n].numel())
            start += named[n].numel()

        def index(names):
            return torch.cat([torch.arange(*offsets[n]) for n in names]).to(lin.device)

        self._kfac_idx = index(kfac_names)
        self._diag_idx = index(rest) if rest else None
        self.diag = None
        kinds = sorted({type(owners[n]).__name__ for n in kfac_names})
        n_k = int(self._kfac_idx.numel())
        self.description = f"KFAC ({', '.join(kinds)}: {n_k} parameters)"
        if rest:
            x = getattr(lin, "_trace_input", None)
            sub = LinearizedNet(lin.module, lin.device, lin.output_transform,
                                structured=lin.structured, param_names=rest,
                                example_input=x)
            self.diag = ggn_diagonal(sub, data)
            kinds = sorted({type(owners[n]).__name__ for n in rest})
            self.description += (f" + exact diagonal GGN ({', '.join(kinds)}: "
                                 f"{self.diag.numel()} parameters)")

    def eigvals(self):
        """Eigenvalues of the unit-noise KFAC GGN (``p`` of them), float64 numpy."""
        state = self.op.state_dict()
        aat, ggt = state["input_covariances"], state["gradient_covariances"]
        out = []
        for mod_name, pos in self.mapping.items():
            eg = torch.linalg.eigvalsh(ggt[mod_name].double()).clamp_min(0)
            if "weight" in pos:  # weight (and bias, jointly: aaT is augmented by a 1)
                ea = torch.linalg.eigvalsh(aat[mod_name].double()).clamp_min(0)
                out.append(torch.outer(eg, ea).reshape(-1))
            else:
                out.append(eg)
        ev = torch.cat(out) * self.unit_scale
        if self.diag is not None:  # already the unit-noise GGN's
            ev = torch.cat([ev, self.diag.to(ev.device)])
        return ev.cpu().numpy()

    def inverse(self, prior_variance, noise_variance=None):
        """``Psi_approx = (c K + I / s0^2)^-1`` as a map on (p, k) float64 matrices."""
        from curvlinops import KFACInverseLinearOperator

        c = self.unit_scale / (noise_variance if noise_variance is not None else 1.0)
        inv = KFACInverseLinearOperator(self.op, damping=1.0 / (prior_variance * c),
                                        use_exact_damping=True)
        if self.diag is None:
            def apply(T):
                return inv @ T.to(torch.float64) / c

            return apply
        s2 = noise_variance if noise_variance is not None else 1.0
        var = 1.0 / (self.diag / s2 + 1.0 / prior_variance)
        ki, di = self._kfac_idx, self._diag_idx

        def apply_mixed(T):
            T = T.to(torch.float64)
            out = torch.empty_like(T)
            out[ki] = inv @ T[ki].contiguous() / c
            out[di] = T[di] * var.to(T.device, T.dtype)[:, None]
            return out

        return apply_mixed


def swag_variances(lin, data, likelihood, prior_variance, learning_rate, n_steps, generator):
    """SWAG's diagonal variances from SGD started at the pretrained weights.

    The run works on a private copy of the network's parameters (the pretrained net
    and ``lin`` are untouched): SGD with a constant learning rate on the mean
    negative log likelihood of a minibatch plus the prior term
    ``||theta||^2 / (2 s0^2 N)`` (a Gaussian likelihood's loss is multiplied by its
    noise variance, i.e. half the mean squared error), collecting the first and
    second moments of the parameters after every step.

    Returns
    -------
    Tensor of shape (p,)
        ``E[theta^2] - E[theta]^2`` over the iterates, float64.
    """
    mod = _Outputs(copy.deepcopy(lin.module), lin.output_transform)
    named = dict(mod.m.named_parameters())
    params = [named[n] for n in lin.names]
    for p in params:
        p.requires_grad_(True)
    N = data.n_samples
    bs = min(data.batch_size, N)
    scale = likelihood.noise_variance if likelihood.task == "regression" else 1.0
    opt = torch.optim.SGD(params, lr=learning_rate)
    m1 = torch.zeros(lin.n_params, dtype=torch.float64, device=lin.device)
    m2 = torch.zeros_like(m1)
    batches = data.minibatches(bs, generator)  # the same draws as a permutation per epoch
    with torch.enable_grad():
        for _ in range(int(n_steps)):
            x, y = next(batches)
            f = mod(x)
            nll = -likelihood.log_prob(f, y).mean() * scale
            prior = sum(p.pow(2).sum() for p in params) / (2.0 * prior_variance * N) * scale
            loss = nll + prior
            opt.zero_grad()
            loss.backward()
            opt.step()
            flat = torch.cat([p.detach().reshape(-1) for p in params]).double()
            if not bool(torch.isfinite(flat).all()):
                raise ValueError("the SWAG run diverged (non-finite weights); lower "
                                 "swag_learning_rate")
            m1 += flat
            m2 += flat * flat
    m1 /= n_steps
    return (m2 / n_steps - m1 * m1).clamp_min(0.0)


