"""Tests of the structured (layer-factored) Jacobian algebra against torch.func."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, jacrev, jvp, vmap

import sklearn_lla._network.structured.chain as S
import sklearn_lla._network.structured.jacobian as SJ
from sklearn_lla._network.structured.chain import StructuredChain, StructuredJacobian

DT = torch.float64
RTOL = 1e-10


# ---------------------------------------------------------------------------------
# Networks
# ---------------------------------------------------------------------------------


def _mlp(d=4, h=6, c=1, act=nn.Tanh, bias=True):
    return nn.Sequential(
        nn.Linear(d, h), act(), nn.Linear(h, h, bias=bias), act(), nn.Linear(h, c)
    )


class _Custom(nn.Module):
    def __init__(self, d=4, h=5, c=2):
        super().__init__()
        self.l1 = nn.Linear(d, h)
        self.l2 = nn.Linear(h, h)
        self.out = nn.Linear(h, c)

    def forward(self, x):
        h = torch.tanh(self.l1(x))
        h = F.relu(self.l2(h))
        return self.out(h)


class _Standardized(nn.Module):
    """Input standardisation and output de-standardisation with buffers."""

    def __init__(self, d=4, h=6, c=2):
        super().__init__()
        g = torch.Generator().manual_seed(1)
        self.register_buffer("x_mean", torch.randn(d, generator=g))
        self.register_buffer("x_scale", torch.rand(d, generator=g) + 0.5)
        self.register_buffer("y_mean", torch.randn(c, generator=g))
        self.register_buffer("y_scale", torch.rand(c, generator=g) + 0.5)
        self.layers = nn.Sequential(nn.Linear(d, h), nn.Tanh(), nn.Linear(h, c))

    def forward(self, x):
        h = (x - self.x_mean) / self.x_scale
        h = self.layers(h)
        return h * self.y_scale + self.y_mean


class _Various(nn.Module):
    """Functional / method activations, numbers, trailing activation, inplace ReLU."""

    def __init__(self, d=4, h=5, c=3):
        super().__init__()
        self.a = nn.Linear(d, h)
        self.r = nn.ReLU(inplace=True)
        self.b = nn.Linear(h, h)
        self.c = nn.Linear(h, c)

    def forward(self, x):
        h = self.r(self.a(2.0 * x - 1))
        h = F.leaky_relu(self.b(h), 0.1).tanh()
        h = F.softplus(h, beta=2.0)
        return torch.sigmoid(self.c(h) / 3.0)


def _nets():
    return {
        "mlp_c1": (_mlp(c=1), (4,)),
        "mlp_c3": (_mlp(c=3), (4,)),
        "no_bias": (_mlp(c=2, bias=False), (4,)),
        "custom": (_Custom(), (4,)),
        "standardized": (_Standardized(), (4,)),
        "relu": (_mlp(c=2, act=nn.ReLU), (4,)),
        "gelu": (_mlp(c=2, act=nn.GELU), (4,)),
        "dropout": (
            nn.Sequential(nn.Linear(4, 5), nn.Dropout(0.3), nn.SiLU(), nn.Linear(5, 2)),
            (4,),
        ),
        "various": (_Various(), (4,)),
        "flatten": (
            nn.Sequential(nn.Flatten(), nn.Linear(6, 4), nn.ELU(), nn.Linear(4, 2)),
            (2, 3),
        ),
        "single_linear": (nn.Linear(4, 3), (4,)),
    }


NETS = _nets()


def _setup(name, n=5, seed=0):
    torch.manual_seed(seed)
    net, in_shape = NETS[name]
    net = net.to(DT).eval()
    params = {k: v.detach() for k, v in net.named_parameters()}
    buffers = {k: v.detach() for k, v in net.named_buffers()}
    x = torch.randn(n, *in_shape, dtype=DT)
    chain = StructuredChain.from_module(net)
    assert chain is not None, name
    return net, chain, params, buffers, x


def _ref_jac(net, params, buffers, x):
    """Dense per-example Jacobian, rows (point, output), columns named_parameters."""

    def f(p, xi):
        return functional_call(net, (p, buffers), (xi[None],))[0]

    jac = vmap(jacrev(f), in_dims=(None, 0))(params, x)
    B = x.shape[0]
    C = next(iter(jac.values())).shape[1]
    cols = [jac[k].reshape(B, C, -1) for k in params]
    return torch.cat(cols, dim=-1).reshape(B * C, -1)


def _flat(V, params):
    return torch.cat([V[k].reshape(V[k].shape[0], -1) for k in params], dim=1)


def _close(a, b, rtol=RTOL):
    assert a.shape == b.shape, (a.shape, b.shape)
    scale = max(b.abs().max().item(), 1e-300)
    err = (a - b).abs().max().item()
    assert err <= rtol * scale, f"max err {err:.3e} relative to {scale:.3e}"


# ---------------------------------------------------------------------------------
# Exactness
# ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(NETS))
def test_forward_and_dense(name):
    net, chain, params, buffers, x = _setup(name)
    out = chain.forward(params, buffers, x)
    ref_out = functional_call(net, (params, buffers), (x,))
    _close(out, ref_out, 1e-14)
    assert chain.param_names == list(params)
    assert chain.n_outputs == ref_out.shape[1]
    J = _ref_jac(net, params, buffers, x)
    feats = chain.features(params, buffers, x)
    assert isinstance(feats, StructuredJacobian)
    assert feats.n_rows == J.shape[0] and feats.n_params == J.shape[1]
    _close(feats.output, ref_out, 1e-14)
    _close(feats.dense(), J)


@pytest.mark.parametrize("name", list(NETS))
def test_gram_diag_vjp_matmul(name):
    net, chain, params, buffers, x = _setup(name)
    B = x.shape[0]
    J = _ref_jac(net, params, buffers, x)
    C = J.shape[0] // B
    P = J.shape[1]
    feats = chain.features(params, buffers, x)
    _close(feats.gram(feats), J @ J.T)
    _close(feats.diag(), (J * J).sum(1))

    # one selected output per point
    idx = torch.arange(B) % C
    fi = chain.features(params, buffers, x, out_idx=idx)
    Ji = J.view(B, C, P)[torch.arange(B), idx]
    _close(fi.dense(), Ji)
    _close(fi.gram(fi), Ji @ Ji.T)
    _close(fi.diag(), (Ji * Ji).sum(1))
    _close(fi.gram(feats), Ji @ J.T)
    _close(feats.gram(fi), J @ Ji.T)

    # cross Gram between two point sets
    x2 = torch.randn(3, *x.shape[1:], dtype=DT)
    J2 = _ref_jac(net, params, buffers, x2)
    f2 = chain.features(params, buffers, x2)
    _close(feats.gram(f2), J @ J2.T)
    _close(f2.gram(feats), J2 @ J.T)

    # J^T U and J V
    K = 4
    U = torch.randn(J.shape[0], K, dtype=DT)
    vj = feats.vjp(U)
    assert list(vj) == list(params)
    for k, v in vj.items():
        assert v.shape == (K, *params[k].shape)
    _close(_flat(vj, params), (J.T @ U).T)
    V = {k: torch.randn(K, *p.shape, dtype=DT) for k, p in params.items()}
    _close(feats.matmul(V), J @ _flat(V, params).T)
    _close(fi.matmul(V), Ji @ _flat(V, params).T)
    Ui = torch.randn(B, K, dtype=DT)
    _close(_flat(fi.vjp(Ui), params), (Ji.T @ Ui).T)


@pytest.mark.parametrize("K", [1, 8])
@pytest.mark.parametrize("name", list(NETS))
def test_jvp(name, K):
    """Forward mode (K <= C) and reverse mode (K > C) both equal torch.func's JVPs."""
    net, chain, params, buffers, x = _setup(name)
    tangents = {k: torch.randn(K, *p.shape, dtype=DT) for k, p in params.items()}

    def f(p):
        return functional_call(net, (p, buffers), (x,))

    refs = [jvp(f, (params,), ({k: t[j] for k, t in tangents.items()},)) for j in range(K)]
    out, Jt = chain.jvp(params, buffers, x, tangents)
    _close(out, refs[0][0], 1e-14)
    assert Jt.shape == (*refs[0][0].shape, K)
    _close(Jt, torch.stack([r[1] for r in refs], dim=-1))


def test_chunked_vjp_matmul(monkeypatch):
    """The K-chunked paths give the same results as the unchunked ones."""
    net, chain, params, buffers, x = _setup("mlp_c3")
    feats = chain.features(params, buffers, x)
    J = feats.dense()
    K = 7
    U = torch.randn(feats.n_rows, K, dtype=DT)
    V = {k: torch.randn(K, *p.shape, dtype=DT) for k, p in params.items()}
    Uc = torch.randn(K, x.shape[0], 3, dtype=DT)
    monkeypatch.setattr(SJ, "_CHUNK_ELEMENTS", 1)
    monkeypatch.setattr(S, "_VJP_CHUNK_ELEMENTS", 1)
    _close(_flat(feats.vjp(U), params), (J.T @ U).T)
    _close(feats.matmul(V), J @ _flat(V, params).T)
    _close(_flat(chain.vjp(params, buffers, x, Uc), params), Uc.reshape(K, -1) @ J)


def test_no_grad_float32_and_partial_dicts():
    torch.manual_seed(0)
    net = _Standardized().float().eval()
    chain = StructuredChain.from_module(net)
    params = dict(net.named_parameters())
    x = torch.randn(6, 4)
    with torch.no_grad():
        feats = chain.features(params, None, x)  # buffers default to the module's
        G = feats.gram(feats)
        out = chain.forward(params, {}, x)
        _, Jt = chain.jvp(params, None, x, {"layers.0.weight": torch.ones(2, 6, 4)})
        Jv = feats.matmul({"layers.0.weight": torch.ones(2, 6, 4)})
    assert G.dtype == torch.float64 and not G.requires_grad  # Gram algebra in float64
    assert out.dtype == torch.float32 and not out.requires_grad
    torch.testing.assert_close(out, net(x).detach())
    torch.testing.assert_close(Jt.reshape(-1, 2), Jv)
    # float64 input to a float32 network is cast to the parameters' dtype
    assert chain.forward(params, None, x.double()).dtype == torch.float32


def test_bad_out_idx_and_inputs():
    net, chain, params, buffers, x = _setup("mlp_c3")
    with pytest.raises(ValueError):
        chain.features(params, buffers, x, out_idx=torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError):
        chain.forward(params, buffers, x[:, :3])
    feats = chain.features(params, buffers, x)
    net2 = _mlp(c=3, h=7).to(DT)
    other = StructuredChain.from_module(net2)
    p2 = {k: v.detach() for k, v in net2.named_parameters()}
    f2 = other.features(p2, {}, x)
    with pytest.raises(ValueError):
        feats.gram(f2)


# ---------------------------------------------------------------------------------
# Rejection
# ---------------------------------------------------------------------------------


class _Residual(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(4, 4)
        self.o = nn.Linear(4, 1)

    def forward(self, x):
        return self.o(x + self.l(x))


class _ParamScale(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(4, 3)
        self.scale = nn.Parameter(torch.ones(3))

    def forward(self, x):
        return self.l(x) * self.scale


class _Twice(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(4, 4)

    def forward(self, x):
        return self.l(torch.tanh(self.l(x)))


class _Unused(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(4, 2)
        self.spare = nn.Linear(4, 2)

    def forward(self, x):
        return self.l(x)


class _ControlFlow(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(4, 2)

    def forward(self, x):
        if x.sum() > 0:
            return self.l(x)
        return -self.l(x)


class _BufferReshapes(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(4, 3)
        self.register_buffer("s", torch.ones(5, 3))

    def forward(self, x):
        return self.l(x) * self.s


class _FlattenAfter(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(4, 3)
        self.o = nn.Linear(3, 1)

    def forward(self, x):
        return self.o(torch.flatten(self.l(x), 1))


class _TwoInputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(4, 1)

    def forward(self, x, y):
        return self.l(x) + y


class _Square(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(4, 1)

    def forward(self, x):
        h = self.l(x)
        return h * h


@pytest.mark.parametrize(
    "net",
    [
        nn.Sequential(nn.Linear(4, 5), nn.LayerNorm(5), nn.Tanh(), nn.Linear(5, 1)),
        nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3), nn.Softmax(dim=-1)),
        nn.Sequential(nn.Conv2d(1, 2, 3), nn.Flatten(), nn.Linear(8, 1)),
        _Residual(),
        _ParamScale(),
        _Twice(),
        _Unused(),
        _ControlFlow(),
        _BufferReshapes(),
        _FlattenAfter(),
        _TwoInputs(),
        _Square(),
        nn.Sequential(nn.Tanh()),
    ],
    ids=lambda m: type(m).__name__
    + ("_" + "_".join(type(c).__name__ for c in m) if isinstance(m, nn.Sequential) else ""),
)
def test_rejects(net):
    assert StructuredChain.from_module(net) is None


def test_hooks_are_followed():
    """Hooks run inside the recorded forward pass: their maps become part of the chain."""
    net = _mlp(c=2).to(DT).eval()
    net[0].register_forward_hook(lambda m, i, o: o * 2)
    net[2].register_forward_pre_hook(lambda m, i: (i[0] - 0.5,))
    params = {k: v.detach() for k, v in net.named_parameters()}
    x = torch.randn(5, 4, dtype=DT)
    chain = StructuredChain.from_module(net, x)
    assert chain is not None
    _close(chain.forward(params, {}, x), net(x).detach(), 1e-14)
    _close(chain.features(params, {}, x).dense(), _ref_jac(net, params, {}, x))


def test_hook_with_unsupported_op_is_rejected():
    net = _mlp(c=2)
    net[0].register_forward_hook(lambda m, i, o: o.softmax(-1))
    chain, reason = StructuredChain.trace(net)
    assert chain is None and "softmax" in reason


@pytest.mark.parametrize(
    "net, words",
    [
        (nn.Sequential(nn.Linear(4, 5), nn.LayerNorm(5), nn.Linear(5, 1)),
         ["LayerNorm", "'1'", "layer_norm"]),
        (nn.Sequential(nn.Linear(4, 3), nn.Softmax(dim=-1)), ["Softmax", "softmax"]),
        (_Residual(), ["residual"]),
        (_ParamScale(), ["'scale'"]),
        (_Twice(), ["more than one linear layer"]),
        (_Unused(), ["'spare.weight'", "not used"]),
        (_TwoInputs(), ["failed", "TypeError"]),
        (nn.Sequential(nn.Tanh()), ["no nn.Linear"]),
    ],
    ids=lambda v: type(v).__name__ if isinstance(v, nn.Module) else "",
)
def test_reasons(net, words):
    chain, reason = StructuredChain.trace(net)
    assert chain is None
    for w in words:
        assert w in reason, reason


def test_trace_reason_and_repr_of_supported_chain():
    net, chain, params, buffers, x = _setup("standardized")
    c2, reason = StructuredChain.trace(net, x)
    assert reason == "chain of 2 nn.Linear layers and elementwise maps" == c2.description
    assert c2.n_linear == 2
    assert "x_mean" in repr(c2) and "layers.2.weight" in repr(c2)


def test_trace_leaves_the_module_alone():
    net = nn.Sequential(nn.Linear(4, 5), nn.Dropout(0.5), nn.Tanh(), nn.Linear(5, 1))
    net.train()
    assert StructuredChain.from_module(net) is not None  # traced in eval mode, on a copy
    assert net.training and all(m.training for m in net.modules())


# every activation module the structured path knows, through closed forms or autograd
_ACTIVATIONS = [
    nn.Tanh, nn.ReLU, nn.Sigmoid, nn.GELU, nn.SiLU, nn.ELU, nn.LeakyReLU, nn.Softplus,
    nn.Mish, nn.Hardtanh, nn.Tanhshrink, nn.Softsign, nn.ReLU6, nn.SELU, nn.CELU,
    nn.Hardswish, nn.Hardsigmoid, nn.LogSigmoid, nn.Identity, nn.Dropout, nn.AlphaDropout,
    lambda: nn.ReLU(inplace=True), lambda: nn.GELU(approximate="tanh"),
]


@pytest.mark.parametrize("act", _ACTIVATIONS, ids=range(len(_ACTIVATIONS)))
def test_activation_modules(act):
    torch.manual_seed(3)
    net = nn.Sequential(nn.Linear(4, 6), act(), nn.Linear(6, 2), act()).to(DT).eval()
    params = {k: v.detach() for k, v in net.named_parameters()}
    x = torch.randn(7, 4, dtype=DT)
    chain, reason = StructuredChain.trace(net, x)
    assert chain is not None, reason
    _close(chain.forward(params, {}, x), net(x).detach(), 1e-14)
    J = _ref_jac(net, params, {}, x)
    _close(chain.features(params, {}, x).dense(), J)
    V = {k: torch.randn(3, *p.shape, dtype=DT) for k, p in params.items()}
    _close(chain.jvp(params, {}, x, V)[1].reshape(-1, 3), J @ _flat(V, params).T)


class _Functional(nn.Module):
    """Elementwise functions, methods, pow, reversed operators, dtype cast, F.linear."""

    def __init__(self):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(5, 4, dtype=DT) / 2)
        self.b1 = nn.Parameter(torch.randn(5, dtype=DT))
        self.l2 = nn.Linear(5, 3, dtype=DT)
        self.register_buffer("s", torch.rand(1, 5, dtype=DT) + 0.5)

    def forward(self, x):
        h = F.linear(x.double(), self.w1, self.b1)
        h = torch.exp(-torch.sin(h).abs() ** 2)
        h = self.s * (1.0 / (1.5 + h)) - 0.5
        h = 2.0 ** torch.cos(h / self.s)
        return self.l2(h).neg()


def test_functional_ops():
    torch.manual_seed(0)
    net = _Functional().eval()
    params = {k: v.detach() for k, v in net.named_parameters()}
    x = torch.randn(6, 4, dtype=DT)
    chain, reason = StructuredChain.trace(net, x)
    assert chain is not None, reason
    _close(chain.forward(params, None, x), net(x).detach(), 1e-14)
    J = _ref_jac(net, params, dict(net.named_buffers()), x)
    _close(chain.features(params, None, x).dense(), J)


@pytest.mark.parametrize("name", ["mlp_c3", "standardized", "various"])
def test_vjp(name):
    net, chain, params, buffers, x = _setup(name)
    J = _ref_jac(net, params, buffers, x)
    B, K = x.shape[0], 4
    C = J.shape[0] // B
    U = torch.randn(K, B, C, dtype=DT)
    vj = chain.vjp(params, buffers, x, U)
    assert list(vj) == list(params)
    _close(_flat(vj, params), U.reshape(K, -1) @ J)
    with pytest.raises(ValueError, match="cotangents"):
        chain.vjp(params, buffers, x, U[:, :2])


@pytest.mark.parametrize("which", ["last", "first", "middle_bias", "no_bias_weight"])
def test_parameter_subsets(which):
    name = "no_bias" if which == "no_bias_weight" else "mlp_c3"
    net, chain, params, buffers, x = _setup(name)
    names = {
        "last": ["4.weight", "4.bias"],
        "first": ["0.weight"],
        "middle_bias": ["2.bias", "4.weight"],
        "no_bias_weight": ["2.weight"],
    }[which]
    J = _ref_jac(net, params, buffers, x)
    cols, start = [], 0
    for k, p in params.items():
        if k in names:
            cols.append(J[:, start:start + p.numel()])
        start += p.numel()
    Js = torch.cat(cols, dim=1)
    sub = {k: params[k] for k in params if k in names}
    feats = chain.features(params, buffers, x, param_names=names)
    assert feats.param_names == list(sub) and feats.n_params == Js.shape[1]
    _close(feats.dense(), Js)
    _close(feats.gram(), Js @ Js.T)
    _close(feats.diag(), (Js * Js).sum(1))
    B, C = x.shape[0], J.shape[0] // x.shape[0]
    _close(feats.diag_blocks(), (Js.view(B, C, -1) @ Js.view(B, C, -1).transpose(1, 2)))
    U = torch.randn(Js.shape[0], 3, dtype=DT)
    _close(_flat(feats.vjp(U), sub), (Js.T @ U).T)
    Uc = torch.randn(3, B, C, dtype=DT)
    _close(_flat(chain.vjp(params, buffers, x, Uc, names), sub), Uc.reshape(3, -1) @ Js)
    V = {k: torch.randn(3, *p.shape, dtype=DT) for k, p in sub.items()}
    _close(chain.jvp(params, buffers, x, V)[1].reshape(-1, 3), Js @ _flat(V, sub).T)
    _close(feats.matmul(V), Js @ _flat(V, sub).T)
    with pytest.raises(ValueError, match="unknown"):
        chain.features(params, buffers, x, param_names=["nope"])


def test_float32_gram_is_float64():
    """Factors in the network's dtype, Gram / diag / diag_blocks accumulated in float64."""
    net, chain, params, buffers, x = _setup("mlp_c3")
    p32 = {k: v.float() for k, v in params.items()}
    f64 = chain.features(params, buffers, x)
    f32 = chain.features(p32, buffers, x.float())
    assert f32.dtype == torch.float32
    for a, b in [(f32.gram(), f64.gram()), (f32.diag(), f64.diag()),
                 (f32.diag_blocks(), f64.diag_blocks())]:
        assert a.dtype == torch.float64
        _close(a, b, 1e-5)


def test_inference_mode_and_autograd_derivatives():
    """Derivatives by reverse mode also work inside torch.inference_mode()."""
    net, chain, params, buffers, x = _setup("gelu")
    ref = chain.features(params, buffers, x).dense()
    with torch.inference_mode():
        xi = x.clone()
        got = chain.features(params, buffers, xi).dense()
        _, jv = chain.jvp(params, buffers, xi, {k: v[None] for k, v in params.items()})
    _close(got, ref)
    _close(jv[..., 0].reshape(-1), ref @ _flat({k: v[None] for k, v in params.items()},
                                             params)[0])


def test_tracing_does_not_disturb_other_threads():
    """Tracing is thread-local: modules running in other threads meanwhile are unaffected
    (torch.fx.symbolic_trace patches nn.Module.__call__ process-wide while it traces)."""
    other = _mlp(c=2).to(DT).eval()
    x = torch.randn(16, 4, dtype=DT)
    with torch.no_grad():
        ref = other(x)
    errors, stop = [], threading.Event()

    def run():
        try:
            while not stop.is_set():
                with torch.no_grad():
                    out = other(x)
                if not torch.equal(out, ref):
                    errors.append("wrong output")
        except Exception as exc:  # noqa: BLE001 - collected for the assertion
            errors.append(repr(exc))

    threads = [threading.Thread(target=run) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        for _ in range(30):
            assert StructuredChain.from_module(_Various().to(DT)) is not None
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert not errors, errors[:3]


class _SqueezedLogit(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1 = nn.Linear(4, 5, dtype=DT)
        self.l2 = nn.Linear(5, 1, dtype=DT)

    def forward(self, x):
        return torch.sigmoid(self.l2(torch.tanh(self.l1(x))).squeeze(-1) * 2.0)


class _Viewed(nn.Module):
    def __init__(self, how):
        super().__init__()
        self.how = how
        self.l1 = nn.Linear(6, 4, dtype=DT)
        self.l2 = nn.Linear(4, 2, dtype=DT)

    def forward(self, x):
        if self.how == "view":
            x = x.view(-1, 6)
        elif self.how == "reshape":
            x = torch.reshape(x, (-1, 6))
        else:  # batch-size dependent: not accepted
            x = x.view(x.size(0), -1)
        return self.l2(torch.tanh(self.l1(x)))


@pytest.mark.parametrize("how", ["view", "reshape", "size"])
def test_view_before_first_layer(how):
    torch.manual_seed(0)
    net = _Viewed(how).eval()
    params = {k: v.detach() for k, v in net.named_parameters()}
    x = torch.randn(5, 2, 3, dtype=DT)
    chain, reason = StructuredChain.trace(net, x)
    if how == "size":
        assert chain is None and "Tensor.size" in reason
        return
    assert chain is not None, reason
    _close(chain.forward(params, None, x), net(x).detach(), 1e-14)
    _close(chain.features(params, None, x).dense(), _ref_jac(net, params, {}, x))


def test_squeezed_single_output():
    """A trailing (B, 1) -> (B,) squeeze is accepted; the chain keeps (B, 1)."""
    torch.manual_seed(0)
    net = _SqueezedLogit().eval()
    params = {k: v.detach() for k, v in net.named_parameters()}
    x = torch.randn(5, 4, dtype=DT)
    chain, reason = StructuredChain.trace(net, x)
    assert chain is not None, reason
    _close(chain.forward(params, None, x), net(x).detach()[:, None], 1e-14)

    def f(p, xi):
        return functional_call(net, p, (xi[None],))

    jac = vmap(jacrev(f), in_dims=(None, 0))(params, x)
    J = torch.cat([jac[k].reshape(5, -1) for k in params], dim=1)
    _close(chain.features(params, None, x).dense(), J)
    # squeezing a wider output, or a linear layer after the squeeze, is not supported
    wide = nn.Sequential(nn.Linear(4, 2), nn.Flatten(0))
    assert StructuredChain.from_module(wide) is None


# ---------------------------------------------------------------------------------
# cross_gram: the differentiable twin of gram
# ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(NETS))
def test_cross_gram_equals_gram_and_differentiates_wrt_inputs(name):
    net, chain, params, buffers, x = _setup(name)
    z = torch.randn(4, *x.shape[1:], dtype=DT, generator=torch.Generator().manual_seed(3))
    out = torch.arange(4) % chain.n_outputs
    Fx = chain.features(params, buffers, x)
    Fz = chain.features(params, buffers, z, out)
    _close(Fx.cross_gram(Fz), Fx.gram(Fz), 1e-13)
    _close(Fz.cross_gram(), Fz.gram(), 1e-13)
    # d/dz of sum(K(x, z)^2) + sum(K(z, z)) against the dense Jacobian rows' Gram

    def dense(zz):
        return _ref_jac_rows(net, params, buffers, zz, out)

    def via_factors(zz):
        Fzz = chain.features(params, buffers, zz, out, differentiable=True)
        return (Fx.cross_gram(Fzz) ** 2).sum() + Fzz.cross_gram().sum()

    zz = z.clone().requires_grad_(True)
    (g,) = torch.autograd.grad(via_factors(zz), zz)
    Jx = _ref_jac(net, params, buffers, x)
    zr = z.clone().requires_grad_(True)
    R = dense(zr)
    (g_ref,) = torch.autograd.grad(((Jx @ R.T) ** 2).sum() + (R @ R.T).sum(), zr)
    _close(g, g_ref, 1e-10)


def _ref_jac_rows(net, params, buffers, z, out):
    """Dense rows ``grad_theta g_out[m](z_m)``, differentiable w.r.t. ``z``."""

    def f(p, zi, oi):
        return (functional_call(net, (p, buffers), (zi[None],))[0] * oi).sum()

    onehot = F.one_hot(out, int(net(z[:1]).reshape(1, -1).shape[1])).to(z.dtype)
    jac = vmap(jacrev(f), in_dims=(None, 0, 0))(params, z, onehot)
    return torch.cat([jac[k].reshape(z.shape[0], -1) for k in params], dim=1)


def test_cross_gram_backward_flushes_float32_subnormals():
    """Gradients reaching float32 factors carry no subnormal entries (a CPU matrix
    product with subnormal operands runs two orders of magnitude slower)."""
    a = torch.randn(6, 5, dtype=torch.float32, requires_grad=True)
    b = torch.randn(4, 5, dtype=torch.float32)
    layer_a = SJ.LayerFactor(a, torch.ones(6, 1, dtype=torch.float32), None, "bias")
    layer_b = SJ.LayerFactor(b, torch.ones(4, 1, dtype=torch.float32), None, "bias")
    Fa = StructuredJacobian([layer_a], 1, ["bias"], torch.zeros(6, 1))
    Fb = StructuredJacobian([layer_b], 1, ["bias"], torch.zeros(4, 1))
    G = Fa.cross_gram(Fb)
    assert G.dtype == torch.float64
    # a float64 cotangent with entries far below float32's smallest normal number
    w = torch.full_like(G, 1e-42)
    w[0, 0] = 1.0
    (g,) = torch.autograd.grad((G * w).sum(), a)
    tiny = torch.finfo(torch.float32).tiny
    assert not bool(((g != 0) & (g.abs() < tiny)).any())
    torch.testing.assert_close(g[0], b[0], rtol=0, atol=0)  # the normal part is exact
    assert bool((g[1:] == 0).all())
