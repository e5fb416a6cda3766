"""
VaLLA on a 1-D regression with a gap: the band widens where there are no data
=============================================================================

Trains a small tanh MLP on two clusters of points with skorch's ``train_split=None``
(the network sees every row), then fits :class:`~sklearn_lla.VaLLARegressor` with its
defaults twice on the same network:

* without held-out rows: up to 300 inducing inputs (k-means; here every training row)
  and the variational factor start at their optimum, the prior and noise variances
  come from VaLLA's own objective (an ELBO whose KL includes the network's weights,
  so the prior variance has a finite optimum), and the run stops when the objective
  stops improving;
* with ``validation_data`` (rows the network did not fit): the same fit, then the noise
  variance is calibrated on those rows with the latent covariance kept.

Exact LLA (its own defaults: Laplace evidence) is drawn as the reference VaLLA
approximates. The mean is the network's output in every case; the variance grows in
the gap between the clusters and away from the data. Saves
``examples/output/valla_bands.png``.
"""

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import skorch  # noqa: E402
import torch  # noqa: E402

from sklearn_lla import LLARegressor, VaLLARegressor  # noqa: E402
from sklearn_lla.nets import MLP  # noqa: E402

try:
    HERE = Path(__file__).resolve().parent
except NameError:  # run by sphinx-gallery (``make docs``), from the examples directory
    HERE = Path.cwd()
OUT = HERE / "output"
OUT.mkdir(exist_ok=True)

rng = np.random.RandomState(0)


def clusters(n):
    X = np.concatenate([rng.uniform(-2, -0.7, n), rng.uniform(0.7, 2, n)])[:, None]
    return X.astype(np.float32), np.sin(2 * X[:, 0]) + 0.1 * rng.randn(len(X))


X, y = clusters(60)
Xv, yv = clusters(20)  # held-out rows: the network never sees them
torch.manual_seed(0)
net = skorch.NeuralNetRegressor(
    MLP, module__n_features=1, module__n_outputs=1, module__hidden_layer_sizes=(50, 50),
    optimizer=torch.optim.Adam, lr=1e-2, optimizer__weight_decay=1e-4, max_epochs=400,
    train_split=None, verbose=0,
).fit(X, y[:, None].astype(np.float32))

fits = {
    "no held-out rows": VaLLARegressor(net, random_state=0).fit(X, y),
    "validation_data": VaLLARegressor(net, random_state=0).fit(
        X, y, validation_data=(Xv, yv)),
}
exact = LLARegressor(net).fit(X, y)

grid = np.linspace(-3, 3, 300, dtype=np.float32)[:, None]
gap = np.zeros((1, 1), dtype=np.float32)
fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
for ax, (name, valla) in zip(axes, fits.items()):
    ratio = valla.predict(gap, return_std=True)[1][0] / valla.predict(X, return_std=True)[1].mean()
    print(f"{name}: prior_variance_ = {valla.prior_variance_:.4g}, noise_variance_ = "
          f"{valla.noise_variance_:.4g}, {valla.n_iter_} Adam steps; std mid-gap / on the "
          f"data = {ratio:.1f}")
    ax.scatter(X[:, 0], y, s=8, c="k", label="training data", zorder=3)
    if name == "validation_data":
        ax.scatter(Xv[:, 0], yv, s=8, c="C3", label="held-out data", zorder=3)
    m_valla = f"VaLLA (M = {len(valla.inducing_outputs_)})"
    for est, label, color in [(exact, "exact LLA", "C0"), (valla, m_valla, "C1")]:
        mean, std = est.predict(grid, return_std=True)
        ax.fill_between(grid[:, 0], mean - 2 * std, mean + 2 * std, alpha=0.25,
                        color=color, label=f"{label}: mean +- 2 std")
    ax.plot(grid[:, 0], mean, c="k", lw=1, label="network output")
    ax.plot(valla.inducing_inputs_[:, 0], np.full(len(valla.inducing_inputs_), -2.6), "|",
            c="C1", ms=8, label="VaLLA inducing inputs")
    ax.set_title(f"{name}: std mid-gap = {ratio:.1f} x std on the data")
    ax.set_xlabel("x")
    ax.set_ylim(-3, 3)
axes[0].set_ylabel("y")
axes[0].legend(loc="upper left", fontsize=7)
axes[1].legend(loc="upper left", fontsize=7)
fig.suptitle("VaLLARegressor defaults on a network that fitted every training row")
fig.tight_layout()
fig.savefig(OUT / "valla_bands.png", dpi=120)
print(f"saved {OUT / 'valla_bands.png'}")
