"""
Classification: is the Laplace predictive better calibrated than the network?
=============================================================================

A skorch MLP classifier is trained on a 3-class problem with overlapping classes;
:class:`~sklearn_lla.LLAClassifier` and :class:`~sklearn_lla.ELLAClassifier` turn it
into a Bayesian predictive without retraining. Saves to ``examples/output/``:

* ``classification_reliability.png``: reliability diagrams (accuracy vs confidence,
  15 bins, with the histogram of confidences;
  :class:`~sklearn_lla.plotting.ReliabilityDisplay`) of the MAP network and of the
  Laplace predictives, with their ECE. The prior variance is chosen by the default
  rule (without held-out rows the full-network classifier uses the weight-norm
  estimate ``||theta||^2 / P``; see the hyperparameters page), or by
  ``GridSearchCV`` on log loss (the pretrained net is shared by the clones, never
  retrained);
* ``classification_confidence.png``: predictive confidence over the input plane:
  LLA grows uncertain away from the data, the MAP network does not.
"""

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from sklearn.datasets import make_blobs  # noqa: E402
from sklearn.model_selection import GridSearchCV, train_test_split  # noqa: E402
from skorch import NeuralNetClassifier  # noqa: E402

from sklearn_lla import ELLAClassifier, LLAClassifier  # noqa: E402
from sklearn_lla.metrics import (  # noqa: E402
    brier_score,
    expected_calibration_error,
    neg_log_loss_scorer,
)
from sklearn_lla.nets import MLP  # noqa: E402
from sklearn_lla.plotting import ReliabilityDisplay  # noqa: E402

try:
    HERE = Path(__file__).resolve().parent
except NameError:  # run by sphinx-gallery (``make docs``), from the examples directory
    HERE = Path.cwd()
OUT = HERE / "output"
OUT.mkdir(exist_ok=True)

X, y = make_blobs(n_samples=1500, centers=[[-2, 0], [2, 0], [0, 2.5]], cluster_std=1.4,
                  random_state=0)
X_train, X_test, y_train, y_test = train_test_split(X, y, test_size=0.5, random_state=0)

torch.manual_seed(0)
net = NeuralNetClassifier(
    MLP, module__n_features=2, module__n_outputs=3, module__hidden_layer_sizes=(64, 64),
    criterion=torch.nn.CrossEntropyLoss, optimizer=torch.optim.Adam, lr=1e-2,
    optimizer__weight_decay=1e-3,
    max_epochs=100, batch_size=128, train_split=None, verbose=0,
)
net.fit(X_train.astype(np.float32), y_train)

# Prior variance by the default rule (no held-out rows here: "weight_norm") ...
lla = LLAClassifier(net, random_state=0).fit(X_train, y_train)
# ... or by cross-validated log loss: the pretrained net is shared, never retrained.
search = GridSearchCV(LLAClassifier(net), {"prior_variance": np.logspace(-3, 1, 5)},
                      scoring=neg_log_loss_scorer, cv=3).fit(X_train, y_train)
lla_cv = search.best_estimator_
ella = ELLAClassifier(net, n_nystrom=500, n_components=20,
                      prior_variance=lla_cv.prior_variance_, random_state=0).fit(X_train, y_train)
probas = {
    "MAP network": net.predict_proba(X_test.astype(np.float32)),
    f"LLA, {lla.hyper_strategy_} (s0^2={lla.prior_variance_:.2g})": lla.predict_proba(X_test),
    f"LLA, CV (s0^2={lla_cv.prior_variance_:.2g})": lla_cv.predict_proba(X_test),
    "ELLA (M=500, K=20), CV prior": ella.predict_proba(X_test),
}

fig, axes = plt.subplots(1, 4, figsize=(16, 4.2))
for ax, (name, p) in zip(axes, probas.items()):
    disp = ReliabilityDisplay.from_predictions(y_test, p, n_bins=15, ax=ax)
    disp.hist_ax_.set_ylabel("")
    ax.set_title(f"{name}\nBrier {brier_score(y_test, p):.3f}")
fig.tight_layout()
fig.savefig(OUT / "classification_reliability.png", dpi=120)

xx, yy = np.meshgrid(np.linspace(-9, 9, 150), np.linspace(-7, 10, 150))
grid = np.c_[xx.ravel(), yy.ravel()]
fig, axes = plt.subplots(1, 2, figsize=(10, 4.2), sharey=True)
for ax, (name, p) in zip(axes, [("MAP network", net.predict_proba(grid.astype(np.float32))),
                                ("LLA, default prior", lla.predict_proba(grid))]):
    cs = ax.contourf(xx, yy, p.max(1).reshape(xx.shape), levels=np.linspace(1 / 3, 1, 12),
                     cmap="viridis")
    ax.scatter(X_train[:, 0], X_train[:, 1], c=y_train, s=4, cmap="Set1", alpha=0.6)
    ax.set_title(f"{name}: confidence max_c p(c|x)")
fig.colorbar(cs, ax=axes, shrink=0.9)
fig.savefig(OUT / "classification_confidence.png", dpi=120)

for name, p in probas.items():
    print(f"{name:>34}: accuracy={np.mean(p.argmax(1) == y_test):.3f} "
          f"ECE={expected_calibration_error(y_test, p):.4f} Brier={brier_score(y_test, p):.4f}")
print(f"plots saved to {OUT}")
