"""
FMGP on a 1-D regression with three clusters: the band widens in the gaps
=========================================================================

Trains a small tanh MLP on three clusters of points (as in the thesis' figure), with
skorch's ``train_split=None`` (the network sees every row), then fits
:class:`~sklearn_lla.FMGPRegressor` twice on the same network:

* without held-out rows: the kernel, the inducing points and the noise variance come
  from FMGP's own objective (the noise from the auxiliary ``Q*``, not from the
  network's optimistic training residuals), and the run stops when the objective
  stops improving;
* with ``validation_data`` (rows the network did not fit): the same fit, then the noise
  variance is calibrated on those rows with the latent covariance kept.

FMGP's mean is the network's output; its variance, from a Gaussian process with a
learned RBF kernel, grows in the gaps between the clusters and away from the data.
Saves ``examples/output/fmgp_bands.png``.
"""

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import skorch  # noqa: E402
import torch  # noqa: E402

from sklearn_lla import FMGPRegressor  # noqa: E402
from sklearn_lla.nets import MLP  # noqa: E402

try:
    HERE = Path(__file__).resolve().parent
except NameError:  # run by sphinx-gallery (``make docs``), from the examples directory
    HERE = Path.cwd()
OUT = HERE / "output"
OUT.mkdir(exist_ok=True)
CENTRES = np.array([-3.0, 0.0, 3.0])


def clusters(n, seed):
    rng = np.random.RandomState(seed)
    X = (CENTRES[rng.randint(0, 3, n)] + rng.uniform(-0.5, 0.5, n))[:, None]
    return X, np.sin(2 * X[:, 0]) + 0.1 * rng.randn(n)


X, y = clusters(240, 0)
Xv, yv = clusters(60, 1)
torch.manual_seed(0)
net = skorch.NeuralNetRegressor(
    MLP, module__n_features=1, module__n_outputs=1, module__hidden_layer_sizes=(32, 32),
    module__dtype=torch.float64, optimizer=torch.optim.Adam, lr=1e-2,
    optimizer__weight_decay=1e-4, max_epochs=300, train_split=None, verbose=0,
).fit(X, y[:, None])

fits = {
    "no held-out rows": FMGPRegressor(net, n_inducing=20, random_state=0).fit(X, y),
    "validation_data": FMGPRegressor(net, n_inducing=20, random_state=0).fit(
        X, y, validation_data=(Xv, yv)),
}

grid = np.linspace(-4.5, 4.5, 451)[:, None]
gaps = np.array([[-1.5], [1.5]])  # the centres of the two gaps
fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
for ax, (name, est) in zip(axes, fits.items()):
    mean, std = est.predict(grid, return_std=True)
    _, std_data = est.predict(X, return_std=True)
    _, std_gap = est.predict(gaps, return_std=True)
    ratio = float(std_gap.min() / std_data.mean())
    print(f"FMGP ({name}): {est.n_iter_} steps, noise_variance_ = {est.noise_variance_:.4g}, "
          f"amplitude = {est.prior_variance_:.4g}, length scale = "
          f"{est.kernel_.length_scale_[0]:.3g}; std in the gaps / on the data = {ratio:.2f}")
    ax.fill_between(grid[:, 0], mean - 2 * std, mean + 2 * std, alpha=0.3, color="C1",
                    label="FMGP: mean +- 2 std")
    ax.plot(grid[:, 0], mean, c="k", lw=1, label="network output (FMGP's mean)")
    ax.scatter(X[:, 0], y, s=6, c="C0", label="training data")
    ax.plot(est.inducing_inputs_[:, 0], np.full(len(est.inducing_inputs_), -2.4), "|",
            c="C3", ms=10, label="inducing inputs")
    ax.set_title(f"{name}: std in the gaps {ratio:.1f} x the std on the data", fontsize=10)
    ax.set_xlabel("x")
    ax.set_ylim(-2.6, 2.6)
axes[0].set_ylabel("y")
axes[0].legend(loc="upper left", fontsize=7)
fig.suptitle("FMGPRegressor on three clusters (2 x 32 tanh MLP, train_split=None)")
fig.tight_layout()
fig.savefig(OUT / "fmgp_bands.png", dpi=120)
print(f"saved {OUT / 'fmgp_bands.png'}")
