"""sklearn-lla: calibrated predictive uncertainty for pretrained PyTorch networks.

Linearized Laplace approximations (exact LLA and its scalable successors) behind the
scikit-learn estimator API.
"""

from . import metrics
from .ella import ELLAClassifier, ELLARegressor
from .exact import LLAClassifier, LLARegressor

__version__ = "0.1.0.dev0"

__all__ = [
    "LLARegressor",
    "LLAClassifier",
    "ELLARegressor",
    "ELLAClassifier",
    "metrics",
]
