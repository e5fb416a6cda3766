"""The estimator registry: one list of every public estimator configuration.

The contract tests (``tests/test_contract.py``) iterate :data:`ESTIMATORS`, so a
new method gets every contract test (``check_estimator`` default and pretrained,
bad input, non-mutation of the net, pickling, determinism, thread-safe predict,
float32 vs float64 nets) by adding one line here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .ella import ELLAClassifier, ELLARegressor
from .exact import LLAClassifier, LLARegressor
from .fmgp import FMGPClassifier, FMGPRegressor
from .sampled import SampledLLAClassifier, SampledLLARegressor
from .subspace import SubspaceLaplace, SubspaceLaplaceClassifier, SubspaceLaplaceRegressor
from .valla import VaLLAClassifier, VaLLARegressor

__all__ = ["Entry", "ESTIMATORS"]


@dataclass(frozen=True)
class Entry:
    """One registered estimator configuration.

    Attributes
    ----------
    cls : type
        The estimator class.
    params : dict
        Constructor parameters of this configuration (besides ``net``).
    test_params : dict
        Settings that keep the contract tests fast (small sizes); merged over
        ``params`` in tests.
    joint : bool
        Whether ``predict(return_cov=True)`` / ``sample_y`` are supported.
    """

    cls: type
    params: dict = field(default_factory=dict)
    test_params: dict = field(default_factory=dict)
    joint: bool = True

    @property
    def is_classifier(self) -> bool:
        """Whether this configuration is a classifier (by its tags, not its class)."""
        from sklearn.base import is_classifier

        return is_classifier(self.cls(None, **self.params))

    @property
    def id(self) -> str:
        extra = "-".join(f"{v}" for v in self.params.values())
        return self.cls.__name__ + (f"[{extra}]" if extra else "")

    def make(self, net=None, **kw):
        """An instance with ``net`` and the test settings (plus overrides ``kw``)."""
        return self.cls(net, **{**self.params, **self.test_params, **kw})


#: Every public estimator configuration.
ESTIMATORS = [
    Entry(LLARegressor),
    Entry(LLARegressor, {"subset_of_weights": "last_layer"}),
    Entry(LLAClassifier),
    Entry(LLAClassifier, {"subset_of_weights": "last_layer"}),
    Entry(ELLARegressor, test_params={"n_nystrom": 60}),
    Entry(ELLAClassifier, test_params={"n_nystrom": 60}),
    Entry(SubspaceLaplaceRegressor, test_params={"subspace_dim": 10, "n_subset": 50}),
    Entry(SubspaceLaplaceClassifier, test_params={"subspace_dim": 10, "n_subset": 50}),
    Entry(SubspaceLaplace, {"likelihood": "regression"},
          test_params={"subspace_dim": 10, "n_subset": 50}),
    Entry(SubspaceLaplace, {"likelihood": "classification"},
          test_params={"subspace_dim": 10, "n_subset": 50}),
    Entry(SampledLLARegressor,
          test_params={"n_posterior_samples": 8, "max_iter": 100, "n_em_steps": 1}),
    Entry(SampledLLAClassifier,
          test_params={"n_posterior_samples": 8, "max_iter": 100, "n_em_steps": 1}),
    Entry(FMGPRegressor, test_params={"n_inducing": 10, "max_iter": 60, "validation_freq": 20}),
    Entry(FMGPClassifier, test_params={"n_inducing": 9, "max_iter": 60, "validation_freq": 20}),
    Entry(VaLLARegressor, test_params={"n_inducing": 10, "max_iter": 40, "validation_freq": 20}),
    Entry(VaLLAClassifier, test_params={"n_inducing": 9, "max_iter": 40, "validation_freq": 20}),
]
