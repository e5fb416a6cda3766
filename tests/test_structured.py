"""Tests of the structured (layer-factored) Jacobian algebra against torch.func."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, jacrev, jvp, vmap

from sklearn_lla._structured import StructuredChain, StructuredJacobian

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


@pytest.mark.parametrize("name", list(NETS))
def test_jvp(name):
    net, chain, params, buffers, x = _setup(name)
    K = 3
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
    import sklearn_lla._structured as S

    net, chain, params, buffers, x = _setup("mlp_c3")
    feats = chain.features(params, buffers, x)
    J = feats.dense()
    K = 7
    U = torch.randn(feats.n_rows, K, dtype=DT)
    V = {k: torch.randn(K, *p.shape, dtype=DT) for k, p in params.items()}
    monkeypatch.setattr(S, "_CHUNK_ELEMENTS", 1)
    _close(_flat(feats.vjp(U), params), (J.T @ U).T)
    _close(feats.matmul(V), J @ _flat(V, params).T)


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
    assert G.dtype == torch.float32 and not G.requires_grad
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


def test_rejects_hooks():
    net = _mlp()
    net[0].register_forward_hook(lambda m, i, o: o * 2)
    assert StructuredChain.from_module(net) is None
