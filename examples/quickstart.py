"""
Quick start: error bars that grow away from the data
====================================================

A small tanh MLP is trained with skorch on a 1-D problem with a gap in the data. The
fitted net is handed to :class:`~sklearn_lla.LLARegressor` (exact linearized Laplace)
and :class:`~sklearn_lla.ELLARegressor` (its Nystrom approximation); neither changes
the net: the predictive mean is the net's output, and the predictive standard
deviation is small where there is training data and grows in the gap and beyond the
data. The plots use the displays of :mod:`sklearn_lla.plotting`, and the script saves
them to ``examples/output/``:

* ``quickstart_bands.png``: the net's prediction with +-1 and +-2 std predictive
  bands (:class:`~sklearn_lla.plotting.PredictiveBandDisplay`);
* ``quickstart_calibration.png``: the centred-quantile calibration curve (fraction of
  test targets inside each central interval) against the ideal diagonal
  (:class:`~sklearn_lla.plotting.CalibrationCurveDisplay`).

It runs in a few seconds.
"""

from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import torch
from skorch import NeuralNetRegressor

from sklearn_lla import ELLARegressor, LLARegressor
from sklearn_lla.metrics import centered_quantile_metric, gaussian_nll
from sklearn_lla.nets import MLP
from sklearn_lla.plotting import CalibrationCurveDisplay, PredictiveBandDisplay

try:
    HERE = Path(__file__).resolve().parent
except NameError:  # run by sphinx-gallery (``make docs``), from the examples directory
    HERE = Path.cwd()
OUT = HERE / "output"
OUT.mkdir(exist_ok=True)

# %%
# Data: :math:`y = \sin 2x + \varepsilon`, :math:`\varepsilon \sim \mathcal{N}(0, 0.2^2)`,
# with no training inputs in (-0.5, 1); the test inputs cover the gap too.
rng = np.random.RandomState(0)
X = rng.uniform(-3, 3, (300, 1))
X = X[(X[:, 0] < -0.5) | (X[:, 0] > 1.0)]
y = np.sin(2 * X) + 0.2 * rng.randn(len(X), 1)
X_test = rng.uniform(-3, 3, (500, 1))
y_test = np.sin(2 * X_test) + 0.2 * rng.randn(len(X_test), 1)

# %%
# A pretrained network: any fitted skorch net or ``torch.nn.Module`` works.
torch.manual_seed(0)
net = NeuralNetRegressor(
    MLP, module__n_features=1, module__n_outputs=1, module__hidden_layer_sizes=(50, 50),
    optimizer=torch.optim.Adam, lr=1e-2, optimizer__weight_decay=1e-4,
    max_epochs=300, batch_size=64, train_split=None, verbose=0,
)
net.fit(X.astype(np.float32), y.astype(np.float32))

# %%
# Post-hoc uncertainty: the net's weights are never touched. Exact LLA picks the
# prior and noise variances by maximising the marginal likelihood (no held-out rows
# here). ELLA reuses them, so that the plot shows the approximation itself: M = 200
# Nystrom points and K = 20 features instead of the defaults.
lla = LLARegressor(net, random_state=0).fit(X, y)
ella = ELLARegressor(net, n_nystrom=200, n_components=20, prior_variance=lla.prior_variance_,
                     noise_variance=lla.noise_variance_, random_state=0).fit(X, y)
models = {"exact LLA": lla, "ELLA (M=200, K=20)": ella}

# %%
# The predictive standard deviation on the data, in the gap and beyond the data. It
# includes the noise, about 0.2 here; the network's own uncertainty adds to it away
# from the data. ELLA with M = 200 and K = 20 stays close to exact LLA: its KFAC
# posterior on the directions the K features leave out (``residual_correction``'s
# default) restores most of what they miss (measured: 1.64 against 1.60 at x = 0.25,
# 1.10 against 1.08 at x = 3.5; the paper's ELLA, ``residual_correction=False``, gives
# 0.79 and 0.75).
probe = np.array([[-2.0], [0.25], [3.5]])
for name, model in models.items():
    std = model.predict(probe, return_std=True)[1].ravel()
    print(f"{name:>20}: std at x = -2 (data) {std[0]:.2f}, x = 0.25 (gap) {std[1]:.2f}, "
          f"x = 3.5 (outside) {std[2]:.2f}")

# %%
# Predictive bands: +-1 and +-2 standard deviations of the predictive distribution of y
# (network uncertainty plus noise). They widen in the gap and outside the data.
grid = np.linspace(-4, 4, 400)
fig, axes = plt.subplots(1, len(models), figsize=(11, 4), sharey=True)
for ax, (name, model) in zip(axes, models.items()):
    PredictiveBandDisplay.from_estimator(model, X, y, grid=grid, n_std=(1, 2), ax=ax,
                                         name=name)
    m_t, s_t = model.predict(X_test, return_std=True)
    ax.set_title(f"{name}\ntest NLL {gaussian_nll(y_test, m_t, s_t):.3f}, "
                 f"CQM {centered_quantile_metric(y_test, m_t, s_t):.3f}")
    ax.legend(loc="lower left", fontsize=8)
fig.tight_layout()
fig.savefig(OUT / "quickstart_bands.png", dpi=120)

# %%
# Calibration: the fraction of test targets inside each central interval of level
# alpha. On the diagonal the intervals are calibrated; the CQM is the area between.
fig, ax = plt.subplots(figsize=(4.5, 4.5))
for name, model in models.items():
    CalibrationCurveDisplay.from_estimator(model, X_test, y_test, name=name, ax=ax)
ax.set_title("CQM calibration curve (test data)")
ax.legend(loc="lower right", fontsize=8)
fig.tight_layout()
fig.savefig(OUT / "quickstart_calibration.png", dpi=120)

# %%
# The chosen hyperparameters and the test metrics.
for name, model in models.items():
    m_t, s_t = model.predict(X_test, return_std=True)
    print(f"{name:>20}: prior_variance_={model.prior_variance_:.3g} "
          f"noise_variance_={model.noise_variance_:.3g} "
          f"NLL={gaussian_nll(y_test, m_t, s_t):.3f} "
          f"CQM={centered_quantile_metric(y_test, m_t, s_t):.3f}")
print(f"plots saved to {OUT}")
