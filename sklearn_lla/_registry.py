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
]
