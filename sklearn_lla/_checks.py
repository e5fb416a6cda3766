"""The checks ``fit`` makes that the network fits the data: input width, target scale.

Both name what is wrong in the user's terms (the columns of ``X``, the scale of ``y``)
where torch would fail with a shape error or, worse, not fail at all.
"""

from __future__ import annotations

import warnings

import numpy as np
from torch import nn

from ._core.protocol import to_batch

__all__ = ["check_input_width", "check_target_scale"]

#: Training rows (at most, evenly spaced) on which ``fit`` checks that a regression
#: network's outputs can be predictions of ``y`` (:func:`check_target_scale`).
_TARGET_CHECK_ROWS = 1000

#: ``fit`` warns when the network's R^2 on the training rows is below this: its
#: squared residuals are more than ``1 - _TARGET_CHECK_R2 = 3`` times ``var(y)``, so
#: predicting the constant ``mean(y)`` would beat it by that factor ...
_TARGET_CHECK_R2 = -2.0
#: ... or when it explains almost nothing (R^2 below ``_TARGET_CHECK_WEAK_R2``) while
#: its outputs vary on a scale ``_TARGET_CHECK_SPREAD`` times (or more) smaller than
#: ``y`` does (a net trained on standardised targets, fitted against centred raw ones).
_TARGET_CHECK_WEAK_R2 = 0.1
_TARGET_CHECK_SPREAD = 10.0


#: Layers that pass a 2-D input's width through to the next one.
_WIDTH_PRESERVING = (nn.Identity, nn.Dropout, nn.Flatten)


def _input_layer(module):
    """The ``nn.Linear`` that first sees the input, where the architecture says so.

    Followed only through ``nn.Sequential`` chains (and ``sklearn_lla.nets.MLP``,
    whose forward is its ``layers``): a custom ``forward`` may reshape or extend its
    input before its first layer, so there the width is not known without running it.
    """
    from .nets import MLP

    m = module
    while True:
        if isinstance(m, nn.Linear):
            return m
        if isinstance(m, MLP) and type(m).forward is MLP.forward:
            m = m.layers
        elif isinstance(m, nn.Sequential) and type(m).forward is nn.Sequential.forward:
            first = next((c for c in m if not isinstance(c, _WIDTH_PRESERVING)), None)
            if first is None:
                return None
            m = first
        else:
            return None


def check_input_width(module, X):
    """Raise a ValueError naming ``X`` when its columns cannot be the network's inputs."""
    layer = _input_layer(module)
    if layer is None or len(getattr(X, "shape", ())) != 2 or X.shape[1] == layer.in_features:
        return
    w = layer.in_features
    raise ValueError(
        f"X has {X.shape[1]} feature(s) but the network's first layer ({layer}) takes {w}: "
        f"pass X of shape (n_samples, {w}) with the columns the network was trained on "
        "(the same features, in the same order, after the same preprocessing; in a "
        "Pipeline, the output of the steps before this estimator)")


def check_target_scale(lin, X, y, estimator):
    """Warn when a regression network's outputs cannot be predictions of ``y``.

    The linearized Laplace predictive is centred on the network's output, on the
    scale of the ``y`` given to ``fit``: a net trained on transformed targets (say,
    standardised) and fitted against raw ``y`` gives a noise variance of the order of
    ``y``'s squared offset and a meaningless predictive, without any error. Checked on
    up to ``_TARGET_CHECK_ROWS`` evenly spaced training rows (one forward pass).
    """
    n = len(X)
    rows = np.unique(np.linspace(0, n - 1, min(n, _TARGET_CHECK_ROWS)).astype(np.int64))
    g = lin.forward(to_batch(X, rows, lin.dtype, lin.device)).double().cpu().numpy()
    t = y[rows].reshape(len(rows), -1)
    g = g.reshape(t.shape)
    var, spread = t.var(axis=0), g.std(axis=0)
    mse = ((t - g) ** 2).mean(axis=0)
    for col in np.flatnonzero(var > 0):
        r2 = 1.0 - mse[col] / var[col]
        if r2 < _TARGET_CHECK_R2 or (r2 < _TARGET_CHECK_WEAK_R2 and
                                     _TARGET_CHECK_SPREAD * spread[col] < np.sqrt(var[col])):
            break
    else:
        return
    which = "" if t.shape[1] == 1 else f" (target {col})"
    warnings.warn(
        f"{type(estimator).__name__}.fit: the network's outputs cannot be predictions of y"
        f"{which}: on {len(rows)} training rows its R^2 is {r2:.3g}, with mean squared "
        f"residual {mse[col]:.4g} against var(y) = {var[col]:.4g} (outputs: mean "
        f"{g[:, col].mean():.4g}, std {spread[col]:.4g}; y: mean {t[:, col].mean():.4g}, "
        f"std {t[:, col].std():.4g}). The Laplace predictive is centred on the network's "
        "output on y's scale, so noise_variance_ and the predictive std will be meaningless. "
        "Check that y is on the scale the network was trained on (a net trained on "
        "standardised targets: wrap the estimator in "
        "sklearn_lla.compose.TransformedTargetRegressor(..., transformer=StandardScaler())), "
        "that the network's output is the regression output (not logits or a feature "
        "layer), and that X is preprocessed as for training", UserWarning, stacklevel=5)
