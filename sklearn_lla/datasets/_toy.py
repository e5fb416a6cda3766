"""The papers' 1-D toy regression problems."""

from __future__ import annotations

import numbers

import numpy as np
from sklearn.utils import check_random_state

__all__ = ["make_toy_regression"]

#: Cluster intervals of ``kind="clusters"``: three groups with gaps of 2 between them.
CLUSTERS = ((-3.5, -2.5), (-0.5, 0.5), (2.5, 3.5))

_DEFAULT_N = {"sin": 16, "clusters": 60}


def make_toy_regression(kind="sin", *, n_samples=None, noise=0.2, random_state=None):
    """Generate the papers' 1-D toy regression problems.

    Both problems have the target ``y = sin(2 x) + noise * eps`` with
    ``eps ~ N(0, 1)``:

    * ``"sin"``: the ELLA paper's Figure 1 problem, ``N = 16`` points of
      ``y = sin 2x + eps``, ``eps ~ N(0, 0.2)`` (read here as a standard deviation
      of 0.2). The paper does not state the input range; ``x`` is drawn uniformly
      on ``[-2, 2]``, 1.27 periods, the same as laplace-torch's sinusoid example
      (``sin x`` on ``[0, 8]``).
    * ``"clusters"``: a clustered problem in the style of Izmailov et al. (2020),
      used by the VaLLA / FMGP papers to show the uncertainty growing in the gaps
      between clusters: ``x`` drawn uniformly from three intervals
      ``[-3.5, -2.5]``, ``[-0.5, 0.5]`` and ``[2.5, 3.5]`` (as equal a share
      each as ``n_samples`` allows), with gaps of width 2 between them.

    Parameters
    ----------
    kind : {"sin", "clusters"}, default="sin"
        Which problem.
    n_samples : int or None, default=None
        Number of points; None gives 16 for ``"sin"`` (the paper's value) and 60
        for ``"clusters"``.
    noise : float, default=0.2
        Standard deviation of the Gaussian noise added to ``sin(2 x)``.
    random_state : int, RandomState instance or None, default=None
        Seed of the draw, as everywhere in scikit-learn.

    Returns
    -------
    X : ndarray of shape (n_samples, 1)
        Inputs, in the order drawn (not sorted).
    y : ndarray of shape (n_samples,)
        Noisy targets.

    Examples
    --------
    >>> from sklearn_lla.datasets import make_toy_regression
    >>> X, y = make_toy_regression("sin", random_state=0)
    >>> X.shape, y.shape
    ((16, 1), (16,))
    >>> X, y = make_toy_regression("clusters", n_samples=30, random_state=0)
    >>> bool(((X > -2.5) & (X < -0.5)).any())  # nothing in the gaps
    False
    """
    if kind not in _DEFAULT_N:
        raise ValueError(f"kind must be 'sin' or 'clusters'; got {kind!r}")
    if n_samples is None:
        n_samples = _DEFAULT_N[kind]
    if (isinstance(n_samples, bool) or not isinstance(n_samples, numbers.Integral)
            or n_samples < 1):
        raise ValueError(f"n_samples must be a positive integer; got {n_samples!r}")
    if (isinstance(noise, bool) or not isinstance(noise, numbers.Real) or not noise >= 0
            or not np.isfinite(noise)):
        raise ValueError(f"noise must be a finite number >= 0; got {noise!r}")
    rng = check_random_state(random_state)
    if kind == "sin":
        x = rng.uniform(-2.0, 2.0, size=n_samples)
    else:
        counts = np.full(len(CLUSTERS), n_samples // len(CLUSTERS))
        counts[: n_samples % len(CLUSTERS)] += 1
        x = np.concatenate([rng.uniform(lo, hi, size=c) for (lo, hi), c in zip(CLUSTERS, counts)])
    y = np.sin(2.0 * x) + noise * rng.standard_normal(n_samples)
    return x.reshape(-1, 1), y
