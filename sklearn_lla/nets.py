"""Ready-made network modules (importable, so skorch nets built on them pickle and
work with ``n_jobs > 1``).

:class:`MLP` is the 3 x 200 tanh network of the papers' regression experiments when
built with ``hidden_layer_sizes=(200, 200, 200)``.
"""

from __future__ import annotations

import torch
from torch import nn

from ._net import DefaultMLP

__all__ = ["MLP", "DefaultMLP"]


class MLP(nn.Module):
    """Fully connected network: ``Linear -> activation`` repeated, then a linear head.

    Parameters
    ----------
    n_features : int
        Input size.
    n_outputs : int
        Output size (targets or classes).
    hidden_layer_sizes : tuple of int, default=(50,)
        Hidden widths.
    activation : type of nn.Module, default=nn.Tanh
        Elementwise activation class.
    dtype : torch.dtype, default=torch.float32

    Examples
    --------
    >>> from sklearn_lla.nets import MLP
    >>> net = MLP(90, 1, hidden_layer_sizes=(200, 200, 200))
    >>> sum(p.numel() for p in net.parameters())
    98801
    """

    def __init__(self, n_features=1, n_outputs=1, hidden_layer_sizes=(50,), activation=nn.Tanh,
                 dtype=torch.float32):
        super().__init__()
        sizes = [int(n_features), *[int(h) for h in hidden_layer_sizes]]
        layers = []
        for fan_in, fan_out in zip(sizes[:-1], sizes[1:]):
            layers += [nn.Linear(fan_in, fan_out, dtype=dtype), activation()]
        layers.append(nn.Linear(sizes[-1], int(n_outputs), dtype=dtype))
        self.layers = nn.Sequential(*layers)

    def forward(self, x):
        return self.layers(x)
