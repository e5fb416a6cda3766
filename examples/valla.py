"""
VaLLA on a 1-D regression with a gap: inducing points against exact LLA
=======================================================================

Trains a small tanh MLP, then fits VaLLA (20 inducing points) with held-out rows, so
that it learns the prior and noise variances with early stopping on the validation
NLL, and exact LLA at the values VaLLA learned. Plots both predictive bands, the
initial (k-means) and learned inducing inputs. Saves ``examples/output/valla_bands.png``.
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

OUT = Path(__file__).resolve().parent / "output"
OUT.mkdir(exist_ok=True)

rng = np.random.RandomState(0)
X = np.concatenate([rng.uniform(-2, -0.7, 60), rng.uniform(0.7, 2, 60)])[:, None]
y = np.sin(2 * X[:, 0]) + 0.1 * rng.randn(len(X))
Xv = np.concatenate([rng.uniform(-2, -0.7, 20), rng.uniform(0.7, 2, 20)])[:, None]
yv = np.sin(2 * Xv[:, 0]) + 0.1 * rng.randn(len(Xv))  # held-out rows
torch.manual_seed(0)
net = skorch.NeuralNetRegressor(
    MLP, module__n_features=1, module__n_outputs=1, module__hidden_layer_sizes=(32, 32),
    module__dtype=torch.float64, optimizer=torch.optim.Adam, lr=1e-2,
    optimizer__weight_decay=1e-4, max_epochs=400, train_split=None, verbose=0,
).fit(X, y[:, None])

valla = VaLLARegressor(net, n_inducing=20, batch_size=60, random_state=0).fit(
    X, y, validation_data=(Xv, yv))
print(f"{valla.hyper_strategy_}: prior_variance_ = {valla.prior_variance_:.4g}, "
      f"noise_variance_ = {valla.noise_variance_:.4g}, Adam steps = {valla.n_iter_} "
      f"(best at {valla.hyper_trace_['best_iter']})")
# where the inducing inputs started: the same k-means, no optimisation
start = VaLLARegressor(net, n_inducing=20, batch_size=60, max_iter=1, learn_inducing=False,
                       early_stopping=False, random_state=0).fit(X, y)
exact = LLARegressor(net, prior_variance=valla.prior_variance_,
                     noise_variance=valla.noise_variance_).fit(X, y)

grid = np.linspace(-3, 3, 300)[:, None]
fig, ax = plt.subplots(figsize=(7, 4))
ax.scatter(X[:, 0], y, s=8, c="k", label="training data")
ax.scatter(Xv[:, 0], yv, s=8, c="C3", label="validation data")
for est, name, color in [(exact, "exact LLA", "C0"), (valla, "VaLLA (M=20)", "C1")]:
    mean, std = est.predict(grid, return_std=True)
    ax.fill_between(grid[:, 0], mean - 2 * std, mean + 2 * std, alpha=0.25, color=color,
                    label=f"{name}: mean +- 2 std")
ax.plot(grid[:, 0], mean, c="k", lw=1, label="network output")
lo = ax.get_ylim()[0]
ax.plot(start.inducing_inputs_[:, 0], np.full(20, lo + 0.15), "|", c="C2", ms=10,
        label="inducing inputs: k-means start")
ax.plot(valla.inducing_inputs_[:, 0], np.full(20, lo + 0.35), "|", c="C1", ms=10,
        label="inducing inputs: learned")
ax.legend(loc="upper left", fontsize=7)
ax.set_title("VaLLA vs exact LLA at VaLLA's learned hyperparameters")
fig.tight_layout()
fig.savefig(OUT / "valla_bands.png", dpi=120)
print(f"saved {OUT / 'valla_bands.png'}")
