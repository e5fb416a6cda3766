"""Held-out pairs ``(X_val, y_val)`` transformed when the estimator reads them.

A ``validation_data=(X_val, y_val)`` passed to a meta-estimator's ``fit`` must reach
the inner estimator transformed as its training data is (by a Pipeline's fitted
steps, by a target transformer fitted on ``y``); those transformations are only fitted
inside the meta-estimator's own ``fit``, after it has received the pair. The
meta-estimators of :mod:`sklearn_lla.pipeline` and :mod:`sklearn_lla.compose` hand
down a :class:`DeferredPair` instead, which applies the transformations when the
inner ``fit`` unpacks it (``X_val, y_val = validation_data``), by then fitted.
"""

from __future__ import annotations

__all__ = ["DeferredPair", "split_pair"]


def split_pair(validation_data):
    """``(X_val, y_val)`` of a pair, with a TypeError naming ``validation_data``."""
    try:
        X, y = validation_data
    except (TypeError, ValueError) as exc:
        raise TypeError("validation_data must be a pair (X_val, y_val)") from exc
    return X, y


class DeferredPair:
    """A pair ``(transform_X(X), transform_y(y))`` computed when it is unpacked.

    Parameters
    ----------
    X, y : array-like
        The held-out inputs and targets, as the user passed them.
    transform_X, transform_y : callable or None
        Applied at unpacking (``None``: the value as is).

    Examples
    --------
    >>> from sklearn_lla._deferred import DeferredPair
    >>> pair = DeferredPair([1, 2], [3, 4], transform_X=lambda X: [2 * v for v in X])
    >>> X_val, y_val = pair
    >>> X_val, y_val
    ([2, 4], [3, 4])
    """

    def __init__(self, X, y, *, transform_X=None, transform_y=None):
        self.X, self.y = X, y
        self.transform_X, self.transform_y = transform_X, transform_y

    def __len__(self):
        return 2

    def __iter__(self):
        yield self.X if self.transform_X is None else self.transform_X(self.X)
        yield self.y if self.transform_y is None else self.transform_y(self.y)

    def __repr__(self):
        return f"DeferredPair(X={type(self.X).__name__}, y={type(self.y).__name__})"
