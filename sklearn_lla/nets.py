"""Ready-made network modules, importable so that skorch nets built on them pickle.

A skorch net whose module class lives in an importable file can be copied to the
worker processes of ``GridSearchCV(n_jobs=2)`` / ``cross_validate(n_jobs=...)``; one
defined in ``__main__`` (a script or a notebook) cannot (see ``docs/networks.md``).

:class:`MLP` is the 3 x 200 tanh network of the papers' regression experiments when
built with ``hidden_layer_sizes=(200, 200, 200)``. :class:`DefaultMLP` is the network
the estimators build and train themselves when ``net=None``.
"""

from __future__ import annotations

import torch
from torch import nn

from ._network.resolve import DefaultMLP

__all__ = ["MLP", "DefaultMLP"]


class MLP(nn.Module):
    """Fully connected network: ``Linear -> activation`` repeated, then a linear head.

    A chain of ``nn.Linear`` layers and elementwise activations, so the estimators
    use their structured fast path on it (NTK Gram matrices, JVPs and VJPs without
    per-example Jacobians). Use it as the ``module`` of a skorch net.

    Parameters
    ----------
    n_features : int, default=1
        Input size.
    n_outputs : int, default=1
        Output size: the number of targets of a regressor, or of classes (logits)
        of a classifier.
    hidden_layer_sizes : tuple of int, default=(50,)
        Widths of the hidden layers; ``()`` gives a linear model.
    activation : type of nn.Module, default=nn.Tanh
        Elementwise activation class, instantiated once after every hidden layer.
    dtype : torch.dtype, default=torch.float32
        Dtype of the weights; inputs must have the same dtype.

    See Also
    --------
    DefaultMLP : The network of ``net=None``, with built-in standardisation.

    Examples
    --------
    >>> import torch
    >>> from sklearn_lla.nets import MLP
    >>> net = MLP(90, 1, hidden_layer_sizes=(200, 200, 200))
    >>> sum(p.numel() for p in net.parameters())
    98801
    >>> net(torch.zeros(5, 90)).shape
    torch.Size([5, 1])

    As the module of a skorch net (``module__`` sets its parameters):

    >>> from skorch import NeuralNetRegressor
    >>> reg = NeuralNetRegressor(MLP, module__n_features=90, max_epochs=5, verbose=0)
    """

    def __init__(
        self,
        n_features=1,
        n_outputs=1,
        hidden_layer_sizes=(50,),
        activation=nn.Tanh,
        dtype=torch.float32,
    ):
        super().__init__()
        sizes = [int(n_features), *[int(h) for h in hidden_layer_sizes]]
        layers = []
        for fan_in, fan_out in zip(sizes[:-1], sizes[1:]):
            layers += [nn.Linear(fan_in, fan_out, dtype=dtype), activation()]
        layers.append(nn.Linear(sizes[-1], int(n_outputs), dtype=dtype))
        self.layers = nn.Sequential(*layers)

    def forward(self, x):
        """Apply the network to a batch of inputs.

        Parameters
        ----------
        x : torch.Tensor of shape (batch_size, n_features)
            Inputs, of the network's dtype.

        Returns
        -------
        torch.Tensor of shape (batch_size, n_outputs)
            The outputs of the linear head (regression targets or logits).
        """
        return self.layers(x)
