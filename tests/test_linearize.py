"""Tests of LinearizedNet: backend choice, thread safety, float64 Gram algebra, trainable
and selected parameter subsets, input / output checks, pickling."""

from __future__ import annotations

import copy
import pickle
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from torch import nn
from torch.func import functional_call, jacrev, vjp, vmap

from sklearn_lla._network.linearized import LinearizedNet
from sklearn_lla._network.resolve import last_layer_param_names
from sklearn_lla._network.structured.chain import StructuredChain

DT = torch.float64


# ---------------------------------------------------------------------------------
# Networks and a dense reference
# ---------------------------------------------------------------------------------


def _mlp(d=3, h=12, c=2, dtype=DT, seed=0):
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return nn.Sequential(
            nn.Linear(d, h), nn.Tanh(), nn.Linear(h, h), nn.GELU(), nn.Linear(h, c)
        ).to(dtype)


class _LayerNormNet(nn.Module):
    """Linear -> LayerNorm -> tanh -> Linear: not a chain the structured path supports."""

    def __init__(self, d=3, h=12, c=2, seed=0):
        super().__init__()
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            self.l1 = nn.Linear(d, h, dtype=DT)
            self.norm = nn.LayerNorm(h, dtype=DT)
            self.l2 = nn.Linear(h, c, dtype=DT)
            with torch.no_grad():  # non-trivial affine parameters
                self.norm.weight.add_(0.3 * torch.randn(h, dtype=DT))
                self.norm.bias.add_(0.3 * torch.randn(h, dtype=DT))

    def forward(self, x):
        return self.l2(torch.tanh(self.norm(self.l1(x))))


NETS = {"structured": _mlp, "functorch": _LayerNormNet}


def _x(n=6, d=3, seed=1, dtype=DT):
    return torch.randn(n, d, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def _dense_jacobian(module, x, names=None):
    """(B, C, P) Jacobian of ``module`` w.r.t. the parameters ``names`` (default: all)."""
    full = {k: v.detach() for k, v in module.named_parameters()}
    names = list(full) if names is None else names
    sub = {k: full[k] for k in names}

    def f(p, xi):
        return functional_call(module, ({**full, **p}, dict(module.named_buffers())),
                               (xi[None],))[0]

    jac = vmap(jacrev(f), in_dims=(None, 0))(sub, x)
    B = x.shape[0]
    return torch.cat([jac[k].reshape(B, jac[k].shape[1], -1) for k in names], dim=2)


def _flat(tree, names):
    return torch.cat([tree[n].reshape(tree[n].shape[0], -1) for n in names], dim=1)


def _close(a, b, rtol=1e-10):
    assert a.shape == b.shape, (a.shape, b.shape)
    scale = max(b.abs().max().item(), 1e-300)
    err = (a - b).abs().max().item()
    assert err <= rtol * scale, f"max err {err:.3e} relative to {scale:.3e}"


# ---------------------------------------------------------------------------------
# Backend choice
# ---------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", list(NETS))
def test_backend_and_products_match_dense(backend):
    net, x = NETS[backend](), _x()
    lin = LinearizedNet(net, example_input=x)
    assert lin.backend == backend
    assert (lin.chain is not None) == (backend == "structured")
    if backend == "structured":
        assert lin.backend_reason == "chain of 3 nn.Linear layers and elementwise maps"
    else:
        assert lin.backend_reason.startswith("not a chain: module LayerNorm at 'norm'")
    J = _dense_jacobian(net, x)
    B, C, P = J.shape
    assert lin.n_params == P and lin.names == [n for n, _ in net.named_parameters()]
    Jf = J.reshape(B * C, P)
    _close(lin.jacobian(x), J)
    _close(lin.ntk(x), Jf @ Jf.T)
    x2 = _x(4, seed=2)
    J2 = _dense_jacobian(net, x2).reshape(-1, P)
    _close(lin.ntk(x, x2), Jf @ J2.T)
    _close(lin.kernel(x, x2, n_outputs=C), Jf @ J2.T)
    idx = torch.arange(B) % C
    Ji = J[torch.arange(B), idx]
    _close(lin.kernel(x, out1=idx), Ji @ Ji.T)
    _close(lin.ntk_diag_blocks(x), J @ J.transpose(1, 2))
    V = torch.randn(5, P, dtype=DT)
    g, jv = lin.jvp(x, V)
    torch.testing.assert_close(g, net(x).detach())
    _close(jv, torch.einsum("bcp,kp->bck", J, V))
    U = torch.randn(5, B, C, dtype=DT)
    _close(_flat(lin.vjp(x, U), lin.names), torch.einsum("bcp,kbc->kp", J, U))
    Um = torch.randn(B, 3, dtype=DT)
    _close(_flat(lin.gradient_rows_vjp(x, idx, Um), lin.names), (Ji.T @ Um).T)
    # a dict of tangents may leave parameters out (they count as 0)
    first = lin.names[0]
    T = {first: V[:, : lin.numels[0]].reshape(5, *lin.shapes[0])}
    n0 = lin.numels[0]
    _close(lin.jvp(x, T)[1], torch.einsum("bcp,kp->bck", J[..., :n0], V[:, :n0]))
    with pytest.raises(ValueError, match="not linearised"):
        lin.jvp(x, {"nope": T[first]})


def test_backend_reasons():
    x = _x()
    lin = LinearizedNet(_mlp(), structured=False)
    assert (lin.backend, lin.chain) == ("functorch", None)
    assert "structured=False" in lin.backend_reason
    soft = nn.Sequential(_mlp(), nn.Softmax(dim=-1))
    lin = LinearizedNet(soft, output_transform="log", example_input=x)
    assert lin.backend == "graph"  # the chain does not take the log; the graph backend does
    assert lin.backend_reason.startswith("graph of 3 Linear layers")
    lin_f = LinearizedNet(soft, output_transform="log")  # nothing to check the graph on
    assert lin_f.backend == "functorch"
    assert lin_f.backend_reason == (
        "output_transform='log' is not supported by the structured chain; not a supported "
        "graph: no example_input to check the graph backend on")
    _close(lin.ntk(x), lin_f.ntk(x))
    torch.testing.assert_close(lin(x), torch.log_softmax(_mlp()(x), -1).detach())
    lin = LinearizedNet(_mlp())  # no example input: checked on a random probe
    assert lin.backend == "structured" and "random probe" in lin.backend_reason


def test_failed_check_falls_back_with_reason(monkeypatch):
    def wrong_forward(self, params, buffers, x):
        return torch.zeros(x.shape[0], self.n_outputs, dtype=DT)

    chain, _ = StructuredChain.trace(_mlp(), _x())
    monkeypatch.setattr(StructuredChain, "trace", classmethod(lambda cls, m, x=None: (chain, "ok")))
    monkeypatch.setattr(StructuredChain, "forward", wrong_forward)
    lin = LinearizedNet(_mlp(), example_input=_x())
    assert lin.backend == "functorch" and lin.chain is None
    assert "did not reproduce the network's outputs on example_input" in lin.backend_reason


def test_unknown_output_transform():
    with pytest.raises(ValueError, match="one-logit"):
        LinearizedNet(_mlp(c=1), output_transform="binary")


class _Squeezed(nn.Module):
    """One logit squeezed to (B,), as skorch's NeuralNetBinaryClassifier expects."""

    def __init__(self, how):
        super().__init__()
        self.mlp, self.how = _mlp(c=1), how

    def forward(self, x):
        z = self.mlp(x)
        if self.how == "squeeze":
            return z.squeeze(-1)
        if self.how == "view":
            return z.view(-1)
        return torch.flatten(z)


@pytest.mark.parametrize("how", ["squeeze", "view", "flatten"])
def test_one_logit_net_has_one_output(how):
    net, x = _Squeezed(how), _x()
    lin = LinearizedNet(net, example_input=x)
    assert lin.backend == "structured", lin.backend_reason
    assert lin(x).shape == (6, 1) and lin.n_outputs(x) == 1
    assert lin(x[:1]).shape == (1, 1)  # squeezed to a 0-d tensor by the net itself
    J = _dense_jacobian(net.mlp, x)
    _close(lin.jacobian(x), J)
    ref = LinearizedNet(net, example_input=x, structured=False)
    _close(lin.ntk(x), ref.ntk(x))


def test_dead_helpers_removed():
    lin = LinearizedNet(_mlp())
    assert not hasattr(lin, "to_input") and not hasattr(lin, "flatten")


# ---------------------------------------------------------------------------------
# Thread safety
# ---------------------------------------------------------------------------------


def _all_products(lin, seed):
    x = _x(5, seed=seed)
    g = torch.Generator().manual_seed(seed)
    C = lin.n_outputs(x)
    V = torch.randn(3, lin.n_params, generator=g, dtype=DT)
    U = torch.randn(2, 5, C, generator=g, dtype=DT)
    idx = torch.arange(5) % C
    return {
        "forward": lin.forward(x),
        "jvp": lin.jvp(x, V)[1],
        "vjp": _flat(lin.vjp(x, U), lin.names),
        "ntk": lin.ntk(x, _x(3, seed=seed + 100)),
        "kernel": lin.kernel(x, out1=idx),
        "diag_blocks": lin.ntk_diag_blocks(x),
        "jacobian": lin.jacobian(x),
    }


@pytest.mark.parametrize("backend", list(NETS))
def test_concurrent_products_equal_serial(backend):
    """8 threads computing every product at once give the serial results.

    Forward-mode AD (torch.func.jvp, dual levels) keeps process-global state and failed
    here with "no forward AD level exists" or wrong numbers; functional_call swaps the
    tensors of a shared module."""
    lin = LinearizedNet(NETS[backend](), example_input=_x())
    assert lin.backend == backend
    seeds = list(range(24))
    serial = {s: _all_products(lin, s) for s in seeds}
    for _ in range(3):
        with ThreadPoolExecutor(max_workers=8) as pool:
            futures = [pool.submit(lambda s=s: (s, _all_products(lin, s))) for s in seeds * 2]
            # the constructing thread keeps working meanwhile
            results = [(s, _all_products(lin, s)) for s in seeds[:4]]
            results += [f.result() for f in futures]
        for s, res in results:
            for key, value in res.items():
                _close(value, serial[s][key], 1e-12)


def test_torch_func_vjp_vmap_are_thread_safe():
    """torch.func.vjp / vmap keep their transform state per thread."""
    W = torch.randn(6, 4, dtype=DT)

    def job(seed):
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(5, 4, generator=g, dtype=DT)
        U = torch.randn(7, 5, 6, generator=g, dtype=DT)
        _, fn = vjp(lambda w: torch.tanh(x @ w.T), W)
        (got,) = vmap(fn)(U)
        d = 1 - torch.tanh(x @ W.T) ** 2
        return got, torch.einsum("kbo,bo,bi->koi", U, d, x)

    with ThreadPoolExecutor(max_workers=8) as pool:
        for got, ref in pool.map(job, range(64)):
            _close(got, ref, 1e-12)


# ---------------------------------------------------------------------------------
# float64 Gram algebra
# ---------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", list(NETS))
def test_float32_net_gram_in_float64(backend):
    net64 = NETS[backend]()
    net32 = copy.deepcopy(net64).float()
    x = _x()
    lin64 = LinearizedNet(net64, example_input=x)
    lin32 = LinearizedNet(net32, example_input=x.float())
    assert lin32.backend == backend and lin32.dtype == torch.float32
    idx = torch.arange(6) % 2
    for f in (lambda lin: lin.ntk(x), lambda lin: lin.kernel(x, out1=idx),
              lambda lin: lin.ntk_diag_blocks(x)):
        a, b = f(lin32), f(lin64)
        assert a.dtype == torch.float64
        _close(a, b, 1e-5)
    V = torch.randn(2, lin32.n_params)
    assert lin32.jvp(x, V)[1].dtype == torch.float32  # products stay in the net's dtype


# ---------------------------------------------------------------------------------
# Parameter subsets
# ---------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", list(NETS))
def test_trainable_only(backend):
    net, x = NETS[backend](), _x()
    first = next(iter(net.parameters()))
    first.requires_grad_(False)
    flags = {n: p.requires_grad for n, p in net.named_parameters()}
    lin = LinearizedNet(net, example_input=x)
    assert lin.backend == backend  # a frozen layer just drops out of the structured path
    names = [n for n, p in net.named_parameters() if p.requires_grad]
    assert lin.names == names and list(lin.fixed_params) == [n for n in flags if not flags[n]]
    assert lin.n_params == sum(p.numel() for p in net.parameters() if p.requires_grad)
    assert {n: p.requires_grad for n, p in net.named_parameters()} == flags  # user's flags
    J = _dense_jacobian(net, x, names)
    Jf = J.reshape(-1, J.shape[-1])
    _close(lin.ntk(x), Jf @ Jf.T)
    _close(lin.jacobian(x), J)
    V = torch.randn(3, lin.n_params, dtype=DT)
    _close(lin.jvp(x, V)[1], torch.einsum("bcp,kp->bck", J, V))
    U = torch.randn(3, 6, 2, dtype=DT)
    _close(_flat(lin.vjp(x, U), lin.names), torch.einsum("bcp,kbc->kp", J, U))
    torch.testing.assert_close(lin.flat_params(),
                               torch.cat([p.detach().reshape(-1) for p in net.parameters()
                                          if p.requires_grad]))
    everything = LinearizedNet(net, example_input=x, trainable_only=False)
    assert everything.n_params == sum(p.numel() for p in net.parameters())
    for p in net.parameters():
        p.requires_grad_(False)
    with pytest.raises(ValueError, match="requires_grad=False"):
        LinearizedNet(net)


@pytest.mark.parametrize("backend", list(NETS))
def test_last_layer(backend):
    net, x = NETS[backend](), _x()
    last = last_layer_param_names(net, x)
    assert last == (["4.weight", "4.bias"] if backend == "structured" else
                    ["l2.weight", "l2.bias"])
    lin = LinearizedNet(net, example_input=x, param_names=last)
    # the LayerNorm held fixed: the graph backend linearises the last nn.Linear
    assert lin.backend == {"functorch": "graph"}.get(backend, backend) and lin.names == last
    J = _dense_jacobian(net, x, last)
    B, C, P = J.shape
    assert lin.n_params == P
    Jf = J.reshape(B * C, P)
    _close(lin.ntk(x), Jf @ Jf.T)
    _close(lin.kernel(x, n_outputs=C), Jf @ Jf.T)
    _close(lin.jacobian(x), J)
    _close(lin.ntk_diag_blocks(x), J @ J.transpose(1, 2))
    V = torch.randn(3, P, dtype=DT)
    _close(lin.jvp(x, V)[1], torch.einsum("bcp,kp->bck", J, V))
    assert lin.unflatten(V)[last[0]].shape == (3, *dict(net.named_parameters())[last[0]].shape)
    U = torch.randn(3, B, C, dtype=DT)
    vj = lin.vjp(x, U)
    assert list(vj) == last
    _close(_flat(vj, last), torch.einsum("bcp,kbc->kp", J, U))
    torch.testing.assert_close(lin.flat_params(), torch.cat(
        [dict(net.named_parameters())[n].detach().reshape(-1) for n in last]))


def test_last_layer_param_names_cases():
    net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2), nn.Tanh())
    assert last_layer_param_names(net, torch.zeros(2, 3)) == ["2.weight", "2.bias"]
    net[2].weight.requires_grad_(False)  # only trainable parameters count
    assert last_layer_param_names(net, torch.zeros(2, 3)) == ["2.bias"]
    net[2].bias.requires_grad_(False)
    assert last_layer_param_names(net, torch.zeros(2, 3)) == ["0.weight", "0.bias"]
    with pytest.raises(ValueError, match="no leaf module"):
        last_layer_param_names(nn.Tanh(), torch.zeros(2, 3))
    assert not net[0]._forward_hooks  # hooks went on a copy
    net.train()
    last_layer_param_names(net, torch.zeros(2, 3))
    assert net.training


def test_param_names_errors():
    with pytest.raises(ValueError, match="unknown parameter names"):
        LinearizedNet(_mlp(), param_names=["nope"])
    with pytest.raises(ValueError, match="empty"):
        LinearizedNet(_mlp(), param_names=[])
    with pytest.raises(TypeError):
        LinearizedNet(_mlp(), param_names="4.weight")


# ---------------------------------------------------------------------------------
# Input / output checks
# ---------------------------------------------------------------------------------


def test_non_finite_parameter():
    net = _mlp()
    with torch.no_grad():
        net[2].weight[0, 0] = float("nan")
    with pytest.raises(ValueError, match=r"'2\.weight'.*non-finite"):
        LinearizedNet(net)
    with torch.no_grad():
        net[2].weight[0, 0] = float("inf")
    with pytest.raises(ValueError, match=r"'2\.weight'"):
        LinearizedNet(net)


class _DropsBatch(nn.Module):
    def __init__(self, how):
        super().__init__()
        self.l = nn.Linear(3, 2, dtype=DT)
        self.how = how

    def forward(self, x):
        out = self.l(x)
        return out.mean(0) if self.how == "mean" else out[:2]


@pytest.mark.parametrize("how", ["mean", "slice"])
def test_output_must_keep_batch_dimension(how):
    x = _x()
    with pytest.raises(ValueError, match=r"returned shape .* expected \(6, C\) or \(6,\)"):
        LinearizedNet(_DropsBatch(how), example_input=x)
    lin = LinearizedNet(_DropsBatch(how))  # unchecked at construction: checked per call
    with pytest.raises(ValueError, match="batch dimension"):
        lin.forward(x)
    if how == "mean":  # a single example is checked on a batch of two
        with pytest.raises(ValueError, match="batch dimension"):
            LinearizedNet(_DropsBatch(how), example_input=x[:1])


def test_inputs_cast_and_module_untouched():
    net = _mlp()
    net.train()
    before = {k: v.clone() for k, v in net.state_dict().items()}
    lin = LinearizedNet(net, example_input=_x())
    out = lin(_x().float())
    assert out.dtype == DT
    torch.testing.assert_close(out, net.eval()(_x()).detach())
    net.train()
    assert net.training
    for k, v in net.state_dict().items():
        assert torch.equal(v, before[k])


def test_inference_mode():
    for backend, make in NETS.items():
        lin = LinearizedNet(make(), example_input=_x())
        ref = lin.ntk(_x())
        with torch.inference_mode():
            got = lin.ntk(_x())
            if backend == "structured":
                lin.jvp(_x(), torch.ones(1, lin.n_params, dtype=DT))
        _close(got, ref, 1e-12)


# ---------------------------------------------------------------------------------
# Pickling
# ---------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", list(NETS))
def test_pickle_roundtrip(backend):
    net, x = NETS[backend](), _x()
    lin = LinearizedNet(net, example_input=x, param_names=last_layer_param_names(net, x))
    lin2 = pickle.loads(pickle.dumps(lin))
    assert (lin2.backend, lin2.backend_reason) == (lin.backend, lin.backend_reason)
    assert (lin2.chain is None) == (lin.chain is None)
    assert lin2.names == lin.names
    torch.testing.assert_close(lin2.ntk(x), lin.ntk(x), rtol=0, atol=0)
    V = torch.randn(2, lin.n_params, dtype=DT)
    torch.testing.assert_close(lin2.jvp(x, V), lin.jvp(x, V), rtol=0, atol=0)


def test_pickle_rebuild_failure_is_reported(monkeypatch):
    lin = LinearizedNet(_mlp(), example_input=_x())
    data = pickle.dumps(lin)
    monkeypatch.setattr(StructuredChain, "trace",
                        classmethod(lambda cls, m, x=None: (None, "simulated")))
    lin2 = pickle.loads(data)
    assert lin2.backend == "functorch" and lin2.chain is None
    assert "after unpickling: simulated" in lin2.backend_reason
    _close(lin2.ntk(_x()), lin.ntk(_x()))


# ---------------------------------------------------------------------------------
# Public Jacobian factors and rows (what the kernels use)
# ---------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", list(NETS))
def test_jacobian_rows_match_dense_and_differentiate_wrt_inputs(backend):
    module = NETS[backend]()
    lin = LinearizedNet(module, example_input=_x(), structured=True)
    assert lin.backend == backend
    x = _x(5, seed=4)
    out = torch.tensor([0, 1, 1, 0, 1])
    J = _dense_jacobian(module, x)
    _close(lin.jacobian_rows(x, out), J[torch.arange(5), out])
    # differentiable: d/dx sum(rows^2) against the dense Jacobian's double backward
    xr = x.clone().requires_grad_(True)
    (g,) = torch.autograd.grad((lin.jacobian_rows(xr, out, differentiable=True) ** 2).sum(), xr)
    xd = x.clone().requires_grad_(True)

    def row(p, xi, oi):
        return (functional_call(module, (p, {}), (xi[None],))[0] * oi).sum()

    params = {k: v.detach() for k, v in module.named_parameters()}
    onehot = torch.nn.functional.one_hot(out, 2).to(DT)
    jac = vmap(jacrev(row), in_dims=(None, 0, 0))(params, xd, onehot)
    R = torch.cat([jac[k].reshape(5, -1) for k in params], dim=1)
    (g_ref,) = torch.autograd.grad((R ** 2).sum(), xd)
    _close(g, g_ref)
    assert not lin.jacobian_rows(x, out).requires_grad
    with pytest.raises(ValueError, match="out_idx"):
        lin.jacobian_rows(x, out[:3])


def test_factored_jacobian_is_public_and_structured_only():
    module = _mlp()
    lin = LinearizedNet(module, example_input=_x())
    x = _x(4, seed=2)
    F = lin.factored_jacobian(x)
    _close(F.dense().reshape(4, 2, -1), _dense_jacobian(module, x))
    assert not F.layers[0].delta.requires_grad
    xr = x.clone().requires_grad_(True)
    Fd = lin.factored_jacobian(xr, torch.tensor([1, 0, 1, 1]), differentiable=True)
    assert Fd.n_rows == 4 and Fd.layers[0].act.requires_grad
    generic = LinearizedNet(_LayerNormNet(), example_input=_x())
    with pytest.raises(RuntimeError, match="structured backend"):
        generic.factored_jacobian(x)
