"""Resolving the ``net`` parameter into one frozen, pretrained network.

Every estimator accepts ``net`` as

* ``None``: a small tanh MLP sized to the data is built and trained (MAP with
  weight decay) by skorch inside ``fit``;
* an *unfitted* skorch net: cloned and trained inside ``fit``;
* a *fitted* (initialised) skorch net, ``FrozenEstimator(fitted_net)`` or a
  ``torch.nn.Module``: pretrained, never modified.

:func:`resolve_net` returns the pretrained module and how its outputs map to the
latent function ``g(x)`` the Laplace approximation linearises (logits for
classifiers). The user's module object is never touched: the linearisation works on
a private deep copy (see :class:`sklearn_lla._network.linearized.LinearizedNet`).
"""

from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass

import numpy as np
import torch
from sklearn.base import clone
from torch import nn

from .._core.utils import seeded

__all__ = [
    "DefaultMLP",
    "ResolvedNet",
    "resolve_net",
    "is_pretrained",
    "make_default_net",
    "skorch_validation_rows",
]

try:  # sklearn >= 1.6
    from sklearn.frozen import FrozenEstimator
except ImportError:  # pragma: no cover - older sklearn
    FrozenEstimator = None

try:
    from skorch import NeuralNet, NeuralNetBinaryClassifier, NeuralNetClassifier, NeuralNetRegressor
except ImportError:  # pragma: no cover - skorch is a hard dependency
    NeuralNet = NeuralNetClassifier = NeuralNetRegressor = NeuralNetBinaryClassifier = None


#: Settings of the default network (``net=None``).
DEFAULT_HIDDEN = (50,)
DEFAULT_MAX_EPOCHS = 100
DEFAULT_LR = 1e-2
DEFAULT_WEIGHT_DECAY = 1e-4
DEFAULT_BATCH_SIZE = 128


class DefaultMLP(nn.Module):
    """Tanh MLP with built-in input (and, for regression, output) standardisation.

    The standardisation statistics are buffers, not parameters, so the network maps
    the original inputs to the original target scale while the Laplace
    approximation acts on the weights only. Computes in float64 (float32 batch and
    row-wise outputs differ by ~1e-7, more than sklearn's invariance checks allow).

    Parameters
    ----------
    n_features, n_outputs : int
        Input and output sizes.
    hidden_layer_sizes : tuple of int
        Widths of the hidden tanh layers.
    x_mean, x_scale : array-like of shape (n_features,), optional
        Input standardisation; defaults to 0 and 1.
    y_mean, y_scale : array-like of shape (n_outputs,), optional
        Output de-standardisation; defaults to 0 and 1.

    Examples
    --------
    >>> import torch
    >>> from sklearn_lla.nets import DefaultMLP
    >>> net = DefaultMLP(n_features=3, n_outputs=2, hidden_layer_sizes=(8,))
    >>> net(torch.zeros(4, 3, dtype=torch.float64)).shape
    torch.Size([4, 2])
    """

    def __init__(
        self,
        n_features=1,
        n_outputs=1,
        hidden_layer_sizes=DEFAULT_HIDDEN,
        x_mean=None,
        x_scale=None,
        y_mean=None,
        y_scale=None,
    ):
        super().__init__()
        dt = torch.float64

        def buf(v, n, fill):
            if v is None:
                return torch.full((n,), float(fill), dtype=dt)
            return torch.as_tensor(np.asarray(v, dtype=np.float64).reshape(n), dtype=dt)

        self.register_buffer("x_mean", buf(x_mean, n_features, 0.0))
        self.register_buffer("x_scale", buf(x_scale, n_features, 1.0))
        self.register_buffer("y_mean", buf(y_mean, n_outputs, 0.0))
        self.register_buffer("y_scale", buf(y_scale, n_outputs, 1.0))
        sizes = [int(n_features), *[int(h) for h in hidden_layer_sizes]]
        layers = []
        for fan_in, fan_out in zip(sizes[:-1], sizes[1:]):
            layers += [nn.Linear(fan_in, fan_out, dtype=dt), nn.Tanh()]
        layers.append(nn.Linear(sizes[-1], int(n_outputs), dtype=dt))
        self.layers = nn.Sequential(*layers)

    def forward(self, x):
        """Map inputs to outputs on the original target scale.

        Parameters
        ----------
        x : Tensor of shape (B, n_features)
            Inputs on their original scale.

        Returns
        -------
        Tensor of shape (B, n_outputs)
            The network's outputs.
        """
        h = (x - self.x_mean) / self.x_scale
        h = self.layers(h)
        return h * self.y_scale + self.y_mean


def _scale(a: np.ndarray) -> np.ndarray:
    s = a.std(axis=0)
    return np.where(s > 1e-12, s, 1.0)


def make_default_net(task: str, X: np.ndarray, y: np.ndarray, n_outputs: int, device):
    """Build the (unfitted) skorch net used when ``net=None``.

    Inputs are standardised with training statistics inside the module; regression
    targets too. Trained with Adam (lr 1e-2, weight decay 1e-4), 100 epochs,
    mini-batches of 128.
    """
    common = dict(
        module=DefaultMLP,
        module__n_features=X.shape[1],
        module__n_outputs=n_outputs,
        module__hidden_layer_sizes=DEFAULT_HIDDEN,
        module__x_mean=X.mean(axis=0),
        module__x_scale=_scale(X),
        optimizer=torch.optim.Adam,
        optimizer__lr=DEFAULT_LR,
        optimizer__weight_decay=DEFAULT_WEIGHT_DECAY,
        max_epochs=DEFAULT_MAX_EPOCHS,
        batch_size=DEFAULT_BATCH_SIZE,
        iterator_train__shuffle=True,
        train_split=None,
        verbose=0,
        device=str(device),
    )
    if task == "regression":
        return NeuralNetRegressor(
            criterion=nn.MSELoss,
            module__y_mean=y.mean(axis=0),
            module__y_scale=_scale(y),
            **common,
        )
    return NeuralNetClassifier(criterion=nn.CrossEntropyLoss, **common)


def _unwrap(net):
    if FrozenEstimator is not None and isinstance(net, FrozenEstimator):
        return net.estimator, True
    return net, False


def is_pretrained(net) -> bool:
    """Whether ``net`` is used as it is (never trained nor modified by ``fit``)."""
    inner, frozen = _unwrap(net)
    if frozen or isinstance(inner, nn.Module):
        return True
    if NeuralNet is not None and isinstance(inner, NeuralNet):
        return hasattr(inner, "module_")
    return False


@dataclass
class ResolvedNet:
    """The pretrained network behind an estimator.

    Attributes
    ----------
    module : torch.nn.Module
        The pretrained module (the user's object: read, never modified).
    net : object
        What ``net_`` exposes: the fitted skorch net (the user's or one trained in
        ``fit``) or the user's module.
    output_transform : {"identity", "log"}
        How module outputs become the latent ``g(x)``: as they are (logits, or one
        logit for a binary net), or ``log`` of probabilities (skorch's default
        classifier ends in a softmax and uses ``NLLLoss``).
    classes : ndarray or None
        Class labels a pretrained skorch classifier was trained with, if known.
    """

    module: nn.Module
    net: object
    output_transform: str = "identity"
    classes: np.ndarray | None = None


def _classifier_transform(skorch_net) -> str:
    if NeuralNetBinaryClassifier is not None and isinstance(skorch_net, NeuralNetBinaryClassifier):
        return "identity"  # one logit: the Bernoulli likelihood
    crit = getattr(skorch_net, "criterion_", None) or getattr(skorch_net, "criterion", None)
    crit_cls = crit if isinstance(crit, type) else type(crit)
    if isinstance(crit_cls, type) and issubclass(crit_cls, nn.NLLLoss):
        return "log"
    return "identity"


def _skorch_classes(skorch_net):
    try:
        classes = skorch_net.classes_
    except (AttributeError, Exception):
        return None
    return None if classes is None else np.asarray(classes)


def resolve_net(net, task: str, X: np.ndarray, y: np.ndarray, n_outputs: int, seed: int, device):
    """Resolve ``net`` into a :class:`ResolvedNet`, training it first if needed.

    Parameters
    ----------
    net : None, skorch net, FrozenEstimator or torch.nn.Module
        The estimator's ``net`` parameter.
    task : {"regression", "classification"}
    X : ndarray of shape (n_samples, n_features)
        Training inputs (float64).
    y : ndarray
        Regression targets of shape (n_samples, n_outputs), or encoded class
        indices of shape (n_samples,).
    n_outputs : int
        Number of outputs the network must produce (targets or classes).
    seed : int
        Seed for training (module initialisation and shuffling).
    device : torch.device
        Device to train on.
    """
    inner, frozen = _unwrap(net)
    if isinstance(inner, nn.Module):
        return ResolvedNet(module=inner, net=inner)
    if NeuralNet is None or not (inner is None or isinstance(inner, NeuralNet)):
        raise TypeError(
            "net must be None, a skorch NeuralNet, sklearn.frozen.FrozenEstimator(net) or a "
            f"torch.nn.Module; got {type(net).__name__}"
        )
    if inner is not None and (frozen or hasattr(inner, "module_")):
        if not hasattr(inner, "module_"):
            raise ValueError(
                "FrozenEstimator wraps a skorch net that is not fitted; fit it first or pass "
                "the unfitted net directly so that it is trained in fit"
            )
        transform = _classifier_transform(inner) if task == "classification" else "identity"
        classes = _skorch_classes(inner) if task == "classification" else None
        return ResolvedNet(inner.module_, inner, transform, classes)

    # Train a net here: the default MLP, or a clone of the user's unfitted skorch net.
    skorch_net = make_default_net(task, X, y, n_outputs, device) if inner is None else clone(inner)
    with seeded(seed, device):
        skorch_net.initialize()
        params = list(skorch_net.module_.parameters())
        dtype = params[0].dtype if params else torch.float32
        np_dtype = np.float64 if dtype == torch.float64 else np.float32
        # Copies: skorch would otherwise wrap read-only (memmap) input in tensors.
        X_fit = np.array(X, dtype=np_dtype, copy=True)
        if task == "regression":
            y_fit = np.array(y, dtype=np_dtype, copy=True)
        else:
            y_fit = np.array(y, dtype=np.int64, copy=True)
        # partial_fit trains max_epochs without re-initialising the module above.
        skorch_net.partial_fit(X_fit, y_fit)
    transform = _classifier_transform(skorch_net) if task == "classification" else "identity"
    return ResolvedNet(skorch_net.module_, skorch_net, transform, None)


def skorch_validation_rows(net, X, y, task, module_dtype):
    """The rows of ``(X, y)`` a fitted skorch net held out as its own validation split.

    skorch nets trained the usual way keep part of the training data out of training
    (``train_split``, by default a deterministic 5-fold split). When ``fit`` is
    called on the same data, those rows are data the network did not fit: honest
    validation data. The split is recomputed with the net's own ``train_split`` and
    accepted only if the net's criterion on the recovered rows reproduces the last
    ``valid_loss`` of its history (relative tolerance 1e-3); otherwise (another X, a
    random split, no split) ``None`` is returned.

    Parameters
    ----------
    net : skorch.NeuralNet
        A fitted skorch net.
    X : ndarray of shape (n_samples, n_features)
        The inputs given to the estimator's ``fit``.
    y : ndarray
        Regression targets (n_samples, C), or class indices (n_samples,).
    task : {"regression", "classification"}
    module_dtype : torch.dtype
        The module's floating dtype.

    Returns
    -------
    (train_rows, validation_rows) : tuple of ndarray, or None
    """
    if NeuralNet is None or not isinstance(net, NeuralNet) or net.train_split is None:
        return None
    try:
        valid_loss = float(net.history[-1, "valid_loss"])
    except (KeyError, IndexError, TypeError):
        return None
    from skorch.dataset import Dataset

    n = len(X)
    y_split = np.asarray(y)
    try:
        ds_train, ds_valid = net.train_split(Dataset(np.zeros((n, 1)), y_split), y_split)
        tr = np.asarray(ds_train.indices, dtype=np.int64)
        va = np.asarray(ds_valid.indices, dtype=np.int64)
    except Exception:  # a custom split we cannot replay: no recovered rows
        return None
    if len(va) == 0 or len(tr) == 0 or len(np.intersect1d(tr, va)) or len(tr) + len(va) != n:
        return None
    module = net.module_
    np_dtype = np.float64 if module_dtype == torch.float64 else np.float32
    xv = torch.as_tensor(np.array(X[np.sort(va)], dtype=np_dtype))
    yv = y_split[np.sort(va)]
    mod = copy.deepcopy(module).eval()
    with torch.no_grad():
        out = mod(xv)
        candidates = []
        if task == "classification":
            binary = NeuralNetBinaryClassifier is not None and isinstance(
                net, NeuralNetBinaryClassifier)
            candidates.append(torch.as_tensor(yv, dtype=out.dtype if binary else torch.long))
        else:
            candidates.append(torch.as_tensor(yv, dtype=out.dtype))
            if yv.ndim == 2 and yv.shape[1] == 1:
                candidates.append(torch.as_tensor(yv[:, 0], dtype=out.dtype))
        for yt in candidates:
            try:
                with warnings.catch_warnings():  # broadcasting warnings of a wrong layout
                    warnings.simplefilter("ignore")
                    loss = float(net.get_loss(out, yt, X=xv, training=False))
            except Exception:  # shapes the criterion rejects: not the trained layout
                continue
            if np.isfinite(loss) and abs(loss - valid_loss) <= 1e-3 * max(abs(valid_loss), 1e-6):
                return np.sort(tr), np.sort(va)
    return None
