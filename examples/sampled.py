"""
Sampled LLA on a 1-D regression with a gap: samples against exact LLA
=====================================================================

Trains a small tanh MLP, then fits sampled LLA (64 posterior samples) on it with its
defaults: the paper's EM chooses the prior and noise variances on the training rows,
and the held-out rows passed as ``validation_data`` then fit one overall scale ``c``
of the exact rescaling ``(c s0^2, c s2)`` (the predictive's shape, and so its growth
in the gap, is EM's). Exact LLA at the same values is fitted for comparison, and both
predictive bands are plotted: they widen between the two clusters. Saves
``examples/output/sampled_bands.png``.
"""

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import skorch  # noqa: E402
import torch  # noqa: E402

from sklearn_lla import LLARegressor  # noqa: E402
from sklearn_lla.nets import MLP  # noqa: E402
from sklearn_lla.sampled import SampledLLARegressor  # noqa: E402

try:
    HERE = Path(__file__).resolve().parent
except NameError:  # run by sphinx-gallery (``make docs``), from the examples directory
    HERE = Path.cwd()
OUT = HERE / "output"
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

sampled = SampledLLARegressor(net, n_posterior_samples=64, random_state=0).fit(
    X, y, validation_data=(Xv, yv))
print(f"{sampled.hyper_strategy_}: prior_variance_ = {sampled.prior_variance_:.4g}, "
      f"noise_variance_ = {sampled.noise_variance_:.4g}, effective_dim_ = "
      f"{sampled.effective_dim_:.1f}, held-out rescaling c = "
      f"{sampled.hyper_trace_['calibration']['scale']:.3g}, "
      f"{sampled.hyper_trace_['solver']} iterations per E-step = {sampled.n_iter_}")
_, std_data = sampled.predict(X, return_std=True)
_, std_gap = sampled.predict(np.zeros((1, 1)), return_std=True)
print(f"std in the middle of the gap / mean std on the data = "
      f"{std_gap[0] / std_data.mean():.2f}")
exact = LLARegressor(net, prior_variance=sampled.prior_variance_,
                     noise_variance=sampled.noise_variance_, space="parameter").fit(X, y)

grid = np.linspace(-3, 3, 300)[:, None]
fig, ax = plt.subplots(figsize=(7, 4))
ax.scatter(X[:, 0], y, s=8, c="k", label="training data")
for est, name, color in [(exact, "exact LLA", "C0"), (sampled, "sampled LLA (K=64)", "C1")]:
    mean, std = est.predict(grid, return_std=True)
    ax.fill_between(grid[:, 0], mean - 2 * std, mean + 2 * std, alpha=0.25, color=color,
                    label=f"{name}: mean +- 2 std")
ax.plot(grid[:, 0], mean, c="k", lw=1, label="network output")
ax.legend(loc="lower left", fontsize=8)
ax.set_title("Sampled LLA vs exact LLA at the EM-chosen hyperparameters")
fig.tight_layout()
fig.savefig(OUT / "sampled_bands.png", dpi=120)
print(f"saved {OUT / 'sampled_bands.png'}")
