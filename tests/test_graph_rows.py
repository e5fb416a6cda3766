"""The graph backend's row passes: the unfolded conv patches against ``F.unfold`` and
the chunked, in-place row blocks against the dense autograd Jacobian."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from sklearn_lla._network.backends import graph
from sklearn_lla._network.backends.graph_layers import _padding, conv_patches
from sklearn_lla._network.linearized import LinearizedNet


def _unfold(m, a):
    if isinstance(m, nn.Conv1d):
        return F.unfold(a.unsqueeze(2), (1, m.kernel_size[0]), dilation=(1, m.dilation[0]),
                        padding=(0, _padding(m)[0]), stride=(1, m.stride[0])).transpose(1, 2)
    return F.unfold(a, m.kernel_size, dilation=m.dilation, padding=_padding(m),
                    stride=m.stride).transpose(1, 2)


@pytest.mark.parametrize("cls", [nn.Conv1d, nn.Conv2d])
def test_conv_patches_equal_unfold(cls):
    torch.manual_seed(0)
    shape = (3, 4, 11) if cls is nn.Conv1d else (3, 4, 9, 10)
    for k, s, d, p in itertools.product((1, 2, 3), (1, 2, 3), (1, 2), (0, 1, 2, "valid", "same")):
        if p == "same" and (s != 1 or d * (k - 1) % 2):
            continue
        m = cls(4, 5, k, stride=s, dilation=d, padding=p)
        a = torch.randn(shape, dtype=torch.float64)
        ref = _unfold(m, a)
        got = conv_patches(m, a)
        assert got.shape == ref.shape
        assert torch.equal(got, ref), (k, s, d, p)
        if cls is nn.Conv2d:  # a channels-last input (other strides), the same patches
            assert torch.equal(conv_patches(m, a.contiguous(memory_format=torch.channels_last)),
                               ref)
        # with the bias's column of ones (the KFAC factor abar): the same patches first
        ext = conv_patches(m, a, ones=True)
        assert ext.shape == ref.shape[:2] + (ref.shape[2] + 1,)
        assert torch.equal(ext[..., :-1], ref), (k, s, d, p)
        assert torch.equal(ext[..., -1], torch.ones_like(ext[..., -1]))


def _cnn():
    torch.manual_seed(1)
    net = nn.Sequential(nn.Unflatten(1, (1, 6, 6)), nn.Conv2d(1, 4, 3, padding=1),
                        nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 5, 3, stride=2),
                        nn.BatchNorm2d(5), nn.ReLU(), nn.Flatten(), nn.Linear(20, 3))
    for m in net.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.normal_(0, 0.3)
            m.running_var.uniform_(0.5, 2.0)
            m.weight.data.normal_(1.0, 0.2)
    return net.eval().double()


@pytest.mark.parametrize("one_output", [False, True])
def test_chunked_rows_written_in_place_match_autograd(one_output, monkeypatch):
    net = _cnn()
    X = torch.randn(9, 36, dtype=torch.float64)
    lin = LinearizedNet(net, example_input=X[:4])
    be = lin.jacobian_backend
    assert isinstance(be, graph.GraphBackend)
    x = lin._input(X)
    idx = torch.arange(9) % 3 if one_output else None
    # a budget of a few points per recorded pass: rows() writes chunks 2.. in place
    k = 1 if one_output else 3
    monkeypatch.setattr(graph, "ROWS_CHUNK_ELEMENTS", 4 * k * be.row_elements())
    assert be.rows_step(k) == 4
    with torch.no_grad():
        R = be.rows(x, idx)
    ref = graph._reference_rows(lin, x, idx)
    torch.testing.assert_close(R.dense(), ref, rtol=1e-10, atol=1e-12)
