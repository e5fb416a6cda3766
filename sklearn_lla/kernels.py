"""Kernels of the fixed-mean Gaussian process (FMGP).

A kernel here is a covariance over (input, output index) pairs, ``K((x, c), (x', c'))``,
evaluated in float64 with trainable hyperparameters (torch tensors). FMGP
(:class:`~sklearn_lla.FMGPRegressor`, :class:`~sklearn_lla.FMGPClassifier`) learns them
together with its variational parameters. Provided:

* :class:`Kernel`: the interface (subclass it to write your own);
* :class:`RBF`: ``a exp(-1/2 sum_d (x_d - x'_d)^2 / l_d^2) [c = c']``, ARD length scales
  ``l_d`` and amplitude ``a`` (the default for regression);
* :class:`ClassificationKernel`: ``a B_cc' RBF(x, x') (psi(x)^T psi(x') / s + [c = c'])``
  with ``B = L_B L_B^T`` and ``psi`` the network's penultimate features (the default
  for classification; the form of the authors' code);
* :class:`PenultimateFeatures`: ``g(x)`` and ``psi(x)`` from one forward pass.

Length scales left at ``None`` are set by the median heuristic at fit (see
:func:`median_heuristic`).
"""

from ._posteriors.kernels import (
    RBF,
    ClassificationKernel,
    Kernel,
    PenultimateFeatures,
    median_heuristic,
)

__all__ = ["Kernel", "RBF", "ClassificationKernel", "PenultimateFeatures", "median_heuristic"]
