"""Resolving the ``net`` parameter into one frozen, pretrained network.

Every estimator accepts ``net`` as

* ``None``: a small tanh MLP sized to the data is built and trained (MAP with
  weight decay) by skorch inside ``fit``;
* an *unfitted* skorch net: cloned and trained inside ``fit``;
* a *fitted* skorch net, ``FrozenEstimator(fitted_net)`` or a ``torch.nn.Module``:
  pretrained, never modified.

A skorch net that was only initialised (``net.initialize()``, no training in its
history) is an error, and a module (or a frozen skorch net without training history)
whose weights still look as PyTorch initialised them gets a warning: the Laplace
approximation is taken around the weights it is given, which must be trained (see
:func:`check_trained`).

:func:`resolve_net` returns the pretrained module and how its outputs map to the
latent function ``g(x)`` the Laplace approximation linearises (logits for
classifiers). The user's module object is never touched: the linearisation works on
a private deep copy (see :class:`sklearn_lla._network.linearized.LinearizedNet`).
"""

from __future__ import annotations

import copy
import sys
import warnings
from dataclasses import dataclass

import numpy as np
import torch
from sklearn.base import clone
from torch import nn

from .._core.utils import seeded
from .structured.trace import share_copy

__all__ = [
    "DefaultMLP",
    "ResolvedNet",
    "resolve_net",
    "is_pretrained",
    "check_trained",
    "make_default_net",
    "skorch_validation_rows",
    "last_layer_param_names",
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


def _qualname(cls) -> str:
    module = getattr(cls, "__module__", "") or ""
    name = getattr(cls, "__qualname__", getattr(cls, "__name__", repr(cls)))
    return name if module in ("", "builtins", "__main__") else f"{module}.{name}"


def _type_error(net) -> TypeError:
    """The error for a ``net`` of an unsupported type, naming what was passed."""
    accepted = ("net must be None, a skorch NeuralNet, sklearn.frozen.FrozenEstimator(net) "
                "or a torch.nn.Module instance")
    if isinstance(net, type):
        if issubclass(net, nn.Module):
            hint = (f"pass a trained instance (e.g. {net.__name__}(...) trained first), or "
                    f"NeuralNetRegressor/NeuralNetClassifier(module={net.__name__}, ...) to "
                    "have it trained in fit")
        elif NeuralNet is not None and issubclass(net, NeuralNet):
            hint = f"pass an instance: {net.__name__}(module=..., ...), fitted or not"
        else:
            hint = "pass an instance"
        return TypeError(f"{accepted}; got the class {_qualname(net)} itself: {hint}")
    text = repr(net)
    text = text if len(text) <= 60 else text[:57] + "..."
    return TypeError(f"{accepted}; got {text} of type {_qualname(type(net))}")


#: Layers whose PyTorch default initialisation is ``U(-1/sqrt(fan_in), 1/sqrt(fan_in))``
#: for the weight and the bias (``kaiming_uniform_(a=sqrt(5))``).
_DEFAULT_INIT_LAYERS = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)
#: Normalisation layers, initialised to weight 1 and bias 0.
_NORM_LAYERS = (nn.modules.batchnorm._NormBase, nn.LayerNorm, nn.GroupNorm)
#: A layer this large drawn uniformly reaches 90 % of its bound with probability
#: ``1 - 0.9**50 > 0.99``.
_MIN_INIT_EVIDENCE = 50


def looks_freshly_initialised(module: nn.Module) -> bool:
    """Whether every weight of ``module`` still looks as PyTorch initialised it.

    Cheap evidence only (a few max-reductions over the parameters), never proof:
    true when the module has an ``nn.Linear`` / ``nn.ConvNd`` layer of at least 50
    weights and

    * every weight and bias of every such layer lies inside PyTorch's default
      initialisation range ``[-1/sqrt(fan_in), 1/sqrt(fan_in)]``, while every layer of
      at least 50 weights comes within 10 % of that bound (a uniform draw does, with
      probability above 0.99; weights shrunk by weight decay do not), and
    * every normalisation layer has its initial weight 1 and bias 0.

    Training moves some weight past the bound within a few optimiser steps (measured:
    one epoch of Adam, lr 1e-2, on a 3 -> 16 -> 1 MLP; ten epochs of SGD at lr 1e-2
    do not). A module initialised otherwise (Xavier, normal, a custom scheme) is never
    flagged: the check can miss an untrained net, but it rarely calls a trained one
    untrained.
    """
    evidence = False
    for m in module.modules():
        if isinstance(m, _NORM_LAYERS):
            w, b = getattr(m, "weight", None), getattr(m, "bias", None)
            if (w is not None and not bool(torch.all(w.detach() == 1))) or (
                    b is not None and not bool(torch.all(b.detach() == 0))):
                return False
        if not isinstance(m, _DEFAULT_INIT_LAYERS) or m.weight is None:
            continue
        w = m.weight.detach()
        if w.numel() == 0 or not w.is_floating_point():
            continue
        fan_in = nn.init._calculate_fan_in_and_fan_out(w)[0]
        if fan_in == 0:
            continue
        bound = (1.0 + 1e-5) / float(np.sqrt(fan_in))  # float rounding of the bound
        w_max = float(w.abs().max())
        if w_max > bound:
            return False
        if m.bias is not None and m.bias.numel() and float(m.bias.detach().abs().max()) > bound:
            return False
        if w.numel() >= _MIN_INIT_EVIDENCE:
            if w_max < 0.9 * bound:
                return False
            evidence = True
    return evidence


def _user_stacklevel() -> int:
    """The ``stacklevel`` that points a warning at the first caller outside sklearn_lla."""
    frame, level = sys._getframe(1), 1
    while frame is not None and (frame.f_globals.get("__name__") or "").startswith("sklearn_lla"):
        frame, level = frame.f_back, level + 1
    return level


def _untrained_skorch(inner) -> bool:
    """Whether a skorch net has a module but no training step in its history."""
    history = getattr(inner, "history_", None) or getattr(inner, "history", None) or []
    try:
        return not any("train_loss" in row for row in history)
    except TypeError:  # a history we cannot read: do not guess
        return False


def check_trained(net) -> None:
    """Refuse a skorch net that was never trained, warn on a module that looks untrained.

    The Laplace approximation linearises the network around the weights it is
    given and treats them as a trained (MAP) estimate; around random weights the
    predictive is meaningless, and nothing else would say so.

    * A skorch net with a module (``initialize()`` was called) whose history has no
      ``train_loss``: a ``ValueError`` naming the class. skorch records every
      training epoch, so this is known for sure.
    * A ``torch.nn.Module``, or ``FrozenEstimator`` around a skorch net with no
      training history (weights loaded with ``load_params(f_params=...)`` or trained
      outside skorch): the training state cannot be told, so only a
      ``UserWarning``, and only when :func:`looks_freshly_initialised` says the
      weights are still PyTorch's default initialisation.

    Parameters
    ----------
    net : skorch net, FrozenEstimator or torch.nn.Module
        The pretrained network, as passed to the estimator.

    Raises
    ------
    ValueError
        For an initialised but untrained skorch net.
    """
    inner, frozen = _unwrap(net)
    if NeuralNet is not None and isinstance(inner, NeuralNet):
        if not hasattr(inner, "module_") or not _untrained_skorch(inner):
            return
        name = type(inner).__name__
        if not frozen:
            raise ValueError(
                f"net is a {name} that was initialised but never trained (its history "
                "has no train_loss): the Laplace approximation needs trained weights. Call "
                "net.fit(X, y) first, or pass the net without calling initialize() so "
                "that the estimator's fit trains it. If its weights were trained outside "
                "skorch's fit or loaded with load_params(f_params=...), load f_history as "
                "well or pass "
                "sklearn.frozen.FrozenEstimator(net) to use it as it is")
        module, what = inner.module_, f"FrozenEstimator({name}) with no training history"
    elif isinstance(inner, nn.Module):
        module, what = inner, type(inner).__name__
    else:
        return
    if looks_freshly_initialised(module):
        warnings.warn(
            f"net ({what}) looks untrained: every weight of its Linear/Conv layers is "
            "still inside PyTorch's default initialisation range [-1/sqrt(fan_in), "
            "1/sqrt(fan_in)]. The Laplace approximation is taken around the weights it "
            "is given and assumes they are trained; train the network first, or pass "
            "net=None or an unfitted skorch net to have one trained in fit. If it is "
            "trained, ignore this warning", UserWarning, stacklevel=_user_stacklevel())


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
        check_trained(net)
        return ResolvedNet(module=inner, net=inner)
    if NeuralNet is None or not (inner is None or isinstance(inner, NeuralNet)):
        raise _type_error(inner)
    if inner is not None and (frozen or hasattr(inner, "module_")):
        if not hasattr(inner, "module_"):
            raise ValueError(
                f"FrozenEstimator wraps a {type(inner).__name__} that is not fitted; fit it "
                "first or pass the unfitted net directly so that it is trained in fit"
            )
        check_trained(net)
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


def last_layer_param_names(module: nn.Module, example_input) -> list[str]:
    """Find the parameters of the last leaf module with trainable parameters.

    One forward pass on ``example_input`` (moved to the module's device and dtype; in
    eval mode, under ``torch.no_grad``, on a copy of the module's objects that shares
    its tensors: ``module`` itself is not touched) records the order in which leaf
    modules (modules without children) execute; the last one that holds parameters
    with ``requires_grad=True`` is the network's last layer.

    Parameters
    ----------
    module : torch.nn.Module
        The network.
    example_input : array-like or Tensor of shape (B, ...)
        A small input batch.

    Returns
    -------
    list of str
        Its trainable parameters' names, as in ``module.named_parameters()``, e.g.
        ``["layers.4.weight", "layers.4.bias"]``; pass them as ``param_names`` to
        :class:`~sklearn_lla._network.linearized.LinearizedNet` for last-layer LLA.

    Raises
    ------
    ValueError
        When no leaf module with trainable parameters runs in the forward pass.

    Examples
    --------
    >>> from torch import nn
    >>> import torch
    >>> net = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 2))
    >>> last_layer_param_names(net, torch.zeros(4, 3))
    ['2.weight', '2.bias']
    """
    mod = share_copy(module).eval()
    canonical = {id(p): n for n, p in mod.named_parameters()}
    first = next((p for p in mod.parameters() if p.is_floating_point()), None)
    x = torch.as_tensor(example_input)
    if first is not None:
        # the user's module stays where it is (the estimator's device copy comes later):
        # the example goes to the module's device, e.g. a CPU net fitted with device="cuda"
        x = x.to(first.device, first.dtype if x.is_floating_point() else None)
    order: list[nn.Module] = []
    handles = [
        m.register_forward_hook(lambda m_, i, o: order.append(m_))
        for m in mod.modules()
        if next(m.children(), None) is None
    ]
    try:
        with torch.no_grad():
            mod(x)
    finally:
        for h in handles:
            h.remove()
    for m in reversed(order):
        names = [
            canonical[id(p)]
            for p in m.parameters(recurse=False)
            if p.requires_grad and id(p) in canonical
        ]
        if names:
            return names
    raise ValueError(
        "no leaf module with trainable parameters ran in the forward pass on example_input: "
        "cannot find the network's last layer (pass param_names explicitly)"
    )
