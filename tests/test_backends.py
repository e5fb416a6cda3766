"""The Jacobian backends against dense float64 Jacobians (``torch.func.jacrev``).

Every product of the graph backend (conv / BatchNorm / residual nets) on small nets
holding every supported layer, in float32 and float64; when a network is not
supported, the fallback to ``torch.func`` and its reason; thread safety; pickling.
"""

from __future__ import annotations

import copy
import pickle
import threading

import pytest
import torch
from torch import nn
from torch.func import functional_call, jacrev, vmap

from sklearn_lla._network.linearized import LinearizedNet

F64 = torch.float64


class Residual(nn.Module):
    def __init__(self, c, act=nn.ReLU):
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, padding="same", bias=False)
        self.bn = nn.BatchNorm2d(c)
        self.act = act()

    def forward(self, x):
        return self.act(x + self.bn(self.conv(x)))


class Conv1dNet(nn.Module):
    """Conv1d (stride, dilation) + BatchNorm1d + GELU, avg-pool, Linear on (B, T, i)."""

    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv1d(2, 4, 3, stride=2, dilation=1, padding=1)
        self.bn = nn.BatchNorm1d(4)
        self.c2 = nn.Conv1d(4, 3, 2, dilation=2)
        self.lin_t = nn.Linear(3, 5)  # applied to (B, T, 3)
        self.head = nn.Linear(5, 3)

    def forward(self, x):
        h = x.view(x.shape[0], 2, 8)
        h = nn.functional.gelu(self.bn(self.c1(h)))
        h = torch.tanh(self.c2(h))  # (B, 3, 2)
        h = self.lin_t(h.transpose(1, 2))  # (B, 2, 5)
        return self.head(h.mean(1))


def conv2d_net():
    """Unflatten, Conv2d + BN + ReLU, a residual block, max / avg / adaptive pooling."""
    return nn.Sequential(
        nn.Unflatten(1, (1, 6, 6)), nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
        Residual(4, nn.GELU), nn.MaxPool2d(2), nn.Conv2d(4, 5, 2, stride=1, dilation=1),
        nn.Tanh(), nn.AvgPool2d(1), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        nn.Linear(5, 6), nn.ReLU(), nn.Linear(6, 3))


def _randomise_bn(net, seed=0):
    g = torch.Generator().manual_seed(seed)
    for m in net.modules():
        if isinstance(m, (nn.BatchNorm1d, nn.BatchNorm2d)):
            n = m.num_features
            m.running_mean.copy_(torch.rand(n, generator=g) - 0.5)
            m.running_var.copy_(torch.rand(n, generator=g) + 0.5)
            with torch.no_grad():
                m.weight.copy_(torch.rand(n, generator=g) + 0.5)
                m.bias.copy_(torch.rand(n, generator=g) - 0.5)
    return net


NETS = {
    "conv2d": (conv2d_net, 36),
    "conv1d": (Conv1dNet, 16),
}


def _make(name, dtype, seed=0):
    build, d = NETS[name]
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        net = _randomise_bn(build().to(dtype)).eval()
    x = torch.randn(5, d, generator=torch.Generator().manual_seed(1), dtype=dtype)
    return net, x


def dense_jacobian(net, x):
    """(B, C, P) float64 Jacobian of a float64 copy of ``net`` (independent reference)."""
    net = copy.deepcopy(net).double().eval()
    params = {k: v.detach() for k, v in net.named_parameters()}
    buffers = dict(net.named_buffers())

    def f(p, xi):
        return functional_call(net, (p, buffers), (xi[None],))[0]

    jac = vmap(jacrev(f), in_dims=(None, 0))(params, x.double())
    B = x.shape[0]
    return torch.cat([jac[k].reshape(B, jac[k].shape[1], -1) for k in params], dim=2)


def _close(a, b, tol):
    assert a.shape == b.shape, (a.shape, b.shape)
    scale = max(b.abs().max().item(), 1e-30)
    err = (a.double() - b.double()).abs().max().item()
    assert err <= tol * scale, f"max error {err:.3e} relative to {scale:.3e}"


def _flat(tree, names):
    return torch.cat([tree[n].reshape(tree[n].shape[0], -1) for n in names], dim=1)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("name", list(NETS))
def test_graph_backend_products_match_dense(name, dtype):
    net, x = _make(name, dtype)
    lin = LinearizedNet(net, example_input=x)
    assert lin.backend == "graph", lin.backend_reason
    assert lin.factored and lin.thread_safe
    tol = 1e-10 if dtype == F64 else 2e-5
    J = dense_jacobian(net, x)
    B, C, P = J.shape
    assert lin.n_params == P
    Jf = J.reshape(B * C, P)
    _close(lin.jacobian(x), J, tol)
    _close(lin.ntk(x), Jf @ Jf.T, tol)
    assert lin.ntk(x).dtype == F64
    x2 = x[:3] * 0.5 + 0.1
    J2 = dense_jacobian(net, x2).reshape(-1, P)
    _close(lin.ntk(x, x2), Jf @ J2.T, tol)
    _close(lin.kernel(x, x2, n_outputs=C), Jf @ J2.T, tol)
    idx = torch.arange(B) % C
    Ji = J[torch.arange(B), idx]
    _close(lin.kernel(x, out1=idx), Ji @ Ji.T, tol)
    _close(lin.jacobian_rows(x, idx), Ji, tol)
    _close(lin.ntk_diag_blocks(x), J @ J.transpose(1, 2), tol)
    g = torch.Generator().manual_seed(3)
    for K in (2, 7):  # fewer and more directions than outputs
        V = torch.randn(K, P, generator=g, dtype=F64)
        out, jv = lin.jvp(x, V.to(dtype))
        assert jv.dtype == dtype
        _close(out, net(x).detach(), tol)
        _close(jv, torch.einsum("bcp,kp->bck", J, V), tol * 10)
        out2, jv2, blocks2 = lin.jvp_and_ntk_diag(x, V.to(dtype))  # rows shared
        _close(jv2, torch.einsum("bcp,kp->bck", J, V), tol * 10)
        _close(blocks2, J @ J.transpose(1, 2), tol)
        U = torch.randn(K, B, C, generator=g, dtype=F64)
        _close(_flat(lin.vjp(x, U.to(dtype)), lin.names), torch.einsum("bcp,kbc->kp", J, U),
               tol * 10)
    Um = torch.randn(B, 3, generator=g, dtype=F64)
    _close(_flat(lin.gradient_rows_vjp(x, idx, Um.to(dtype)), lin.names), (Ji.T @ Um).T,
           tol * 10)
    Rz = lin.rows(x2, idx[:3])
    cross, blocks = lin.cross_and_diag(x, Rz, C)
    Jz = dense_jacobian(net, x2)[torch.arange(3), idx[:3]]
    _close(cross, (Jf @ Jz.T).view(B, C, 3), tol)
    _close(blocks, J @ J.transpose(1, 2), tol)
    theta = {n: p.unsqueeze(0) for n, p in lin.params.items()}
    _close(lin.rows(x, idx).matmul(theta)[:, 0], Ji @ lin.flat_params().double(), tol * 10)


@pytest.mark.parametrize("name", list(NETS))
def test_graph_cross_gram_differentiates_wrt_inputs(name):
    net, x = _make(name, F64)
    graph = LinearizedNet(net, example_input=x)
    generic = LinearizedNet(net, example_input=x, structured=False)
    assert (graph.backend, generic.backend) == ("graph", "functorch")
    idx = torch.arange(x.shape[0]) % 3
    grads = []
    for lin in (graph, generic):
        z = x.clone().requires_grad_()
        K = lin.rows(z, idx, differentiable=True).cross_gram()
        (K * torch.linspace(0.5, 1.5, K.numel(), dtype=F64).view_as(K)).sum().backward()
        grads.append(z.grad)
    _close(grads[0], grads[1], 1e-9)


def test_graph_backend_threads_equal_serial():
    net, x = _make("conv2d", torch.float32)
    lin = LinearizedNet(net, example_input=x)
    V = torch.randn(4, lin.n_params)
    ref = (lin.ntk(x), lin.jvp(x, V)[1])
    errs = []

    def work():
        try:
            for _ in range(5):
                got = (lin.ntk(x), lin.jvp(x, V)[1])
                assert all(torch.equal(a, b) for a, b in zip(got, ref))
        except Exception as exc:  # noqa: BLE001 - reported below
            errs.append(exc)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errs, errs
    torch.testing.assert_close(lin.forward(x), net(x).detach())  # hooks do not leak


def test_graph_backend_pickles():
    net, x = _make("conv2d", F64)
    lin = LinearizedNet(net, example_input=x)
    lin2 = pickle.loads(pickle.dumps(lin))
    assert (lin2.backend, lin2.backend_reason) == (lin.backend, lin.backend_reason)
    torch.testing.assert_close(lin2.ntk(x), lin.ntk(x), rtol=0, atol=0)


def test_graph_backend_last_layer_and_frozen_layers():
    net, x = _make("conv2d", F64)
    for p in net[1].parameters():  # the first conv frozen
        p.requires_grad_(False)
    lin = LinearizedNet(net, example_input=x)
    assert lin.backend == "graph" and "1.weight" not in lin.names
    full = dense_jacobian(net, x)
    names = [n for n, _ in net.named_parameters()]
    sizes = [p.numel() for _, p in net.named_parameters()]
    keep = torch.cat([torch.full((s,), n in lin.names) for n, s in zip(names, sizes)])
    _close(lin.jacobian(x), full[..., keep], 1e-10)


class _Twice(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.out = nn.Linear(4, 2)

    def forward(self, x):
        return self.out(torch.tanh(self.lin(torch.tanh(self.lin(x)))))


class _Grouped(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(2, 2, 3, groups=2)
        self.out = nn.Linear(4, 2)

    def forward(self, x):
        return self.out(self.conv(x.view(-1, 2, 3)).flatten(1).repeat(1, 2))


class _FunctionalUse(nn.Module):
    """A parameter used outside its module's forward: the check catches it."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 2)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)) + x @ self.a.weight.T)


@pytest.mark.parametrize("net, d, reason", [
    (nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.Linear(4, 2)), 4,
     "of module LayerNorm at '1': it is a LayerNorm"),
    (_Grouped(), 6, "grouped convolution"),
    (nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4, track_running_stats=False),
                   nn.Linear(4, 2)), 4, "without running statistics"),
    (_Twice(), 4, "called 2 times"),
    (_FunctionalUse(), 4, "did not match autograd's"),
])
def test_unsupported_networks_fall_back_with_reason(net, d, reason):
    net = net.double().eval()
    x = torch.randn(3, d, dtype=F64)
    lin = LinearizedNet(net, example_input=x)
    assert lin.backend == "functorch"
    assert reason in lin.backend_reason, lin.backend_reason
    if "running" not in reason:  # (batch statistics: no per-example Jacobian at all)
        _close(lin.jacobian(x), dense_jacobian(net, x), 1e-10)  # the fallback is exact


def test_log_output_transform():
    net, x = _make("conv2d", F64)
    soft = nn.Sequential(net, nn.Softmax(-1))
    lin = LinearizedNet(soft, output_transform="log", example_input=x)
    assert lin.backend == "graph"
    logsoft = nn.Sequential(net, nn.LogSoftmax(-1))
    _close(lin.jacobian(x), dense_jacobian(logsoft, x), 1e-9)


def test_kernel_computes_each_row_once_per_panel(monkeypatch):
    """The Gram's rows are computed once (per panel of held rows), never once per block
    pair (ELLA's Nystrom Gram on the digits CNN computed them 529 times for 276 blocks)."""
    from sklearn_lla._network.backends import base

    net, x = _make("conv2d", F64)
    x = torch.cat([x, 0.5 * x, -x, x + 0.1])  # 20 points
    lin = LinearizedNet(net, example_input=x, structured=False)  # the generic backend
    backend = lin.jacobian_backend
    calls = []
    rows = backend.rows
    monkeypatch.setattr(backend, "kernel_step", lambda r: 3)  # 7 chunks, 28 blocks
    monkeypatch.setattr(backend, "rows", lambda *a, **k: calls.append(1) or rows(*a, **k))
    idx = torch.arange(20) % 3
    ref = lin.jacobian_rows(x, idx).double()
    _close(lin.kernel(x, out1=idx), ref @ ref.T, 1e-12)
    assert len(calls) == 7  # the panel holds every chunk: each computed once
    calls.clear()
    monkeypatch.setattr(base, "PANEL_ELEMENTS", 2 * 3 * lin.n_params)  # 2 chunks a panel
    _close(lin.kernel(x, out1=idx), ref @ ref.T, 1e-12)
    assert len(calls) == 7 + 5 + 3 + 1  # held once, streamed once per earlier panel
    x2 = x[:5] - 0.2
    calls.clear()
    R2 = lin.jacobian_rows(x2, idx[:5]).double()
    _close(lin.kernel(x, x2, out1=idx, out2=idx[:5]), ref @ R2.T, 1e-12)
    assert len(calls) == 7 + 4 * 2  # X1 chunks once; X2's 2 chunks once per panel (4)


@pytest.mark.parametrize("panel", ["one row", "a few rows", "all rows"])
def test_graph_kernel_panels_do_not_change_the_gram(monkeypatch, panel):
    """The graph backend's panelled Gram: any panel budget (one row a panel, a few,
    all) gives the dense Gram to 1e-12 in float64; the panel side's rows are made once,
    with ``X2=None`` the rows after a panel once per panel before them, and with
    ``X2`` the side with fewer rows is the panel."""
    from sklearn_lla._network.backends import graph

    net, x = _make("conv2d", F64)
    x = torch.cat([x, 0.5 * x, -x, x + 0.1])  # 20 points
    lin = LinearizedNet(net, example_input=x)
    backend = lin.jacobian_backend
    held = backend._held
    budget = {"one row": 8 * held, "a few rows": 16 * held, "all rows": 2**28}[panel]
    monkeypatch.setattr(graph, "KERNEL_PANEL_ELEMENTS", budget)
    made = []
    rows = backend.rows
    monkeypatch.setattr(backend, "rows", lambda x, o=None, *a, **k: made.append(x.shape[0])
                        or rows(x, o, *a, **k))
    J = dense_jacobian(net, x)
    B, C, P = J.shape
    idx = torch.arange(B) % C
    Ji = J[torch.arange(B), idx]
    _close(lin.kernel(x, out1=idx), Ji @ Ji.T, 1e-12)
    p1 = {"one row": 7, "a few rows": 14, "all rows": B}[panel]
    panels = range(0, B, min(p1, B))
    assert sum(made) == B + sum(max(0, B - a - p1) for a in panels)
    Jf = J.reshape(B * C, P)
    _close(lin.kernel(x, n_outputs=C), Jf @ Jf.T, 1e-12)
    x2 = x[:7] - 0.2
    J2 = dense_jacobian(net, x2)
    made.clear()
    _close(lin.kernel(x, x2, out1=idx, out2=idx[:7]),
           Ji @ J2[torch.arange(7), idx[:7]].T, 1e-12)
    assert sum(made) == 7 + B  # the smaller side (7 points) is the panel: all made once
    made.clear()
    _close(lin.kernel(x2, x, out1=idx[:7], out2=idx),
           J2[torch.arange(7), idx[:7]] @ Ji.T, 1e-12)
    assert sum(made) == 7 + B


@pytest.mark.parametrize("budget", ["tiny", "large"])
def test_graph_chunk_rules_do_not_change_products(monkeypatch, budget):
    """Every chunk rule of the graph backend (points per product, per recorded pass,
    rows per Gram panel, the float64 copy of ``cross_and_diag``) forced to its smallest
    (one point / one row at a time, no copy) or to one chunk for everything: the
    products equal the dense float64 reference to 1e-10."""
    from sklearn_lla._network.backends import graph

    net, x = _make("conv2d", F64)
    x = torch.cat([x, 0.5 * x - 0.1])  # 10 points
    lin = LinearizedNet(net, example_input=x)
    big = budget == "large"
    for name in ("CHUNK_ELEMENTS", "ROWS_CHUNK_ELEMENTS", "KERNEL_PANEL_ELEMENTS",
                 "F64_COPY_ELEMENTS"):
        monkeypatch.setattr(graph, name, 2**30 if big else 1)
    be = lin.jacobian_backend
    steps = (be.kernel_step(3), be.rows_step(3))
    assert min(steps) >= x.shape[0] if big else steps == (1, 1)
    J = dense_jacobian(net, x)
    B, C, P = J.shape
    Jf = J.reshape(B * C, P)
    idx = torch.arange(B) % C
    Ji = J[torch.arange(B), idx]
    tol = 1e-10
    _close(lin.rows(x).dense(), Jf, tol)
    _close(lin.rows(x, idx).dense(), Ji, tol)
    _close(lin.kernel(x, n_outputs=C), Jf @ Jf.T, tol)
    _close(lin.kernel(x, out1=idx), Ji @ Ji.T, tol)
    g = torch.Generator().manual_seed(5)
    V = torch.randn(4, P, generator=g, dtype=F64)
    _, jv, blocks = lin.jvp_and_ntk_diag(x, V)
    _close(jv, torch.einsum("bcp,kp->bck", J, V), tol)
    _close(blocks, J @ J.transpose(1, 2), tol)
    U = torch.randn(12, B, C, generator=g, dtype=F64)  # more cotangents than outputs
    _close(_flat(lin.vjp(x, U), lin.names), torch.einsum("bcp,kbc->kp", J, U), tol)
    x2 = x[:4] * 0.3
    J2 = dense_jacobian(net, x2)[torch.arange(4), idx[:4]]
    for grad in (False, True):  # the float64 copy (no graph) and the differentiable path
        with torch.set_grad_enabled(grad):
            cross, blocks = lin.cross_and_diag(x, lin.rows(x2, idx[:4]), C)
        _close(cross, (Jf @ J2.T).view(B, C, 4), tol)
        _close(blocks, J @ J.transpose(1, 2), tol)
    z = x2.clone().requires_grad_()
    cross, _ = lin.cross_and_diag(x, lin.rows(z, idx[:4], differentiable=True), C)
    assert cross.requires_grad
    _close(cross.detach(), (Jf @ J2.T).view(B, C, 4), tol)


def test_check_on_one_output_per_row_for_large_nets(monkeypatch):
    """Beyond CHECK_ELEMENTS the construction check compares one selected output per
    example row (O(P) memory); it still tells a supported graph from a wrong one."""
    from sklearn_lla._network.backends import graph

    monkeypatch.setattr(graph, "CHECK_ELEMENTS", 0)
    net, x = _make("conv2d", F64)
    assert LinearizedNet(net, example_input=x).backend == "graph"
    bad = _FunctionalUse().double().eval()
    lin = LinearizedNet(bad, example_input=torch.randn(3, 4, dtype=F64))
    assert lin.backend == "functorch" and "did not match autograd's" in lin.backend_reason


def test_small_budgets_give_the_same_products(monkeypatch):
    """Chunked products (one point per chunk) and the Gram accumulated over float64
    column blocks (a few columns at a time) equal the dense reference: the budgets
    bound memory, they never change a number."""
    from sklearn_lla._network.backends import base, graph

    net, x = _make("conv2d", F64)
    lin = LinearizedNet(net, example_input=x)
    J = dense_jacobian(net, x)
    B, C, P = J.shape
    idx = torch.arange(B) % C
    Ji = J[torch.arange(B), idx]
    monkeypatch.setattr(graph, "CHUNK_ELEMENTS", 1)  # one point per chunk
    monkeypatch.setattr(base, "GRAM_BLOCK_ELEMENTS", 3 * B * C)  # 3-column blocks
    assert lin.jacobian_backend.kernel_step(1) == 1
    _close(lin.kernel(x, out1=idx), Ji @ Ji.T, 1e-12)
    Jf = J.reshape(B * C, P)
    _close(lin.kernel(x, n_outputs=C), Jf @ Jf.T, 1e-12)
    U = torch.randn(B, 4, generator=torch.Generator().manual_seed(0), dtype=F64)
    _close(_flat(lin.gradient_rows_vjp(x, idx, U), lin.names), (Ji.T @ U).T, 1e-12)
    R = lin.rows(x)  # all points at once: computed chunk by chunk, then concatenated
    _close(R.dense(), Jf, 1e-12)
    _close(R.gram(), Jf @ Jf.T, 1e-12)
    _close(lin.rows(x, idx).dense(), Ji, 1e-12)
    a = torch.randn(70, 50, dtype=F64)  # the CPU syrk path, accumulated over blocks
    _close(base.gram64(a), a @ a.T, 1e-13)
    _close(base.gram64(a, a[:9]), a @ a[:9].T, 1e-13)
    assert base.device_budget(123, "cpu") == 123


@pytest.mark.parametrize("structured", [True, False])
def test_rows_weighted_and_mixed_squares_match_dense(structured):
    """The complement's two row products (VaLLA's diagonal complement) from each
    backend's own rows -- graph factors and dense blocks, or the generic dense rows --
    equal the dense Jacobian's."""
    from sklearn_lla._posteriors.complement import mixed_sq_colsum, weighted_sq_norms

    net, x = _make("conv2d", F64)
    lin = LinearizedNet(net, example_input=x, structured=structured)
    assert lin.backend == ("graph" if structured else "functorch")
    J = dense_jacobian(net, x)
    B, C, P = J.shape
    g = torch.Generator().manual_seed(0)
    W = torch.rand(3, P, generator=g, dtype=F64)
    _close(weighted_sq_norms(lin, x, W), (J * J) @ W.T, 1e-12)
    M = torch.randn(B, 2, C, generator=g, dtype=F64)
    G = M @ J
    _close(mixed_sq_colsum(lin, x, M), (G * G).sum((0, 1)), 1e-12)


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_factored_self_gram_equals_dense_rows_gram(k, dtype):
    """The graph rows' self-Gram of factored layers (``syrk`` for the wide factors,
    one product for the narrow ones) is the float64 Gram of the explicit rows, to
    round-off, for one and several rows per point."""
    from sklearn_lla._network.backends.base import SYRK_WIDTH, _factored_self_gram
    from sklearn_lla._network.structured.jacobian import LayerFactor, StructuredJacobian

    g = torch.Generator().manual_seed(0)
    B = 70  # the CPU syrk path (at least 64 rows)
    widths = [(SYRK_WIDTH + 9, 12, True), (12, 5, True), (5, 4, False)]  # (in, out, bias)
    layers, names = [], []
    for i, (d_in, d_out, bias) in enumerate(widths):
        act = torch.randn(B, d_in, generator=g, dtype=F64).to(dtype)
        delta = torch.randn(B * k, d_out, generator=g, dtype=F64).to(dtype)
        layers.append(LayerFactor(delta, act, f"w{i}", f"b{i}" if bias else None))
        names += [f"w{i}"] + ([f"b{i}"] if bias else [])
    sj = StructuredJacobian(layers, k, names, torch.zeros(B, k, dtype=dtype))
    G = _factored_self_gram(sj)
    assert G.dtype == F64
    # the reference rows from the factors cast to float64 (exact): no float32 rounding
    sj64 = StructuredJacobian([LayerFactor(f.delta.double(), f.act.double(), f.weight_name,
                                           f.bias_name) for f in layers], k, names,
                              torch.zeros(B, k, dtype=F64))
    R = sj64.dense()
    _close(G, R @ R.T, 1e-13)
    _close(G, sj.gram(), 1e-14)
