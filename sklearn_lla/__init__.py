"""sklearn-lla: calibrated predictive uncertainty for pretrained PyTorch networks.

Linearized Laplace approximations (exact LLA and its scalable successors) behind the
scikit-learn estimator API.
"""

from . import diagnostics, kernels, metrics
from .ella import ELLAClassifier, ELLARegressor
from .exact import LLAClassifier, LLARegressor
from .fmgp import FMGPClassifier, FMGPRegressor
from .sampled import SampledLLAClassifier, SampledLLARegressor
from .subspace import SubspaceLaplace, SubspaceLaplaceClassifier, SubspaceLaplaceRegressor
from .valla import VaLLAClassifier, VaLLARegressor

__version__ = "0.1.0.dev0"

__all__ = [
    "LLARegressor",
    "LLAClassifier",
    "ELLARegressor",
    "ELLAClassifier",
    "SubspaceLaplaceRegressor",
    "SubspaceLaplaceClassifier",
    "SubspaceLaplace",
    "SampledLLARegressor",
    "SampledLLAClassifier",
    "FMGPRegressor",
    "FMGPClassifier",
    "VaLLARegressor",
    "VaLLAClassifier",
    "metrics",
    "diagnostics",
    "kernels",
]
