"""sklearn-lla: calibrated predictive uncertainty for pretrained PyTorch networks.

Linearized Laplace approximations (exact LLA and its scalable successors) behind the
scikit-learn estimator API.
"""

from . import diagnostics, metrics
from .ella import ELLAClassifier, ELLARegressor
from .exact import LLAClassifier, LLARegressor
from .sampled import SampledLLAClassifier, SampledLLARegressor
from .subspace import SubspaceLaplace, SubspaceLaplaceClassifier, SubspaceLaplaceRegressor

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
    "metrics",
    "diagnostics",
]
