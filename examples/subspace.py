"""
Subspace Laplace: how close each projector gets to exact LLA as s grows
=======================================================================

A small tanh MLP is trained on a 1-D regression problem with a gap in the data. Exact
LLA is the reference; :class:`~sklearn_lla.subspace.SubspaceLaplaceRegressor` is fitted
with every projector for a few subspace dimensions ``s``. The script saves
``examples/output/subspace.png``:

* left: predictive std of exact LLA (the wide grey band) and of lowrank-kfac (with and
  without its KFAC complement) / subset-magnitude at s = 20;
* right: KL(exact || subspace) on the test inputs against ``s``, per projector.

Two kinds of model are on the right. The default ``lowrank-kfac`` and ``lowrank-diag``
add a posterior on the directions outside ``span(P)`` (``residual_correction="auto"``
gives them the KFAC complement or the prior residual): they are not restricted to the
subspace. Every other projector, ``optimal`` included, keeps to the subspace (the
paper's :math:`S_P`). ``optimal`` is Theorem 1's projector built on the test inputs
themselves: among subspace-only models of dimension ``s`` it maximises the trace
criterion ``Tr S_P(X')`` (the part of exact LLA's variance kept on
those inputs). Against ``lowrank-kfac`` restricted to its subspace too (dotted,
``residual_correction=False``) it is far better (KL 0.02 against 5.7 at s = 20); the
default lowrank-kfac beats it there (1.5e-5) because it is not a subspace-only model,
so the theorem does not cover it.
"""

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from sklearn_lla import LLARegressor  # noqa: E402
from sklearn_lla.diagnostics import latent_predictive, predictive_kl  # noqa: E402
from sklearn_lla.nets import MLP  # noqa: E402
from sklearn_lla.subspace import SubspaceLaplaceRegressor  # noqa: E402

try:
    HERE = Path(__file__).resolve().parent
except NameError:  # run by sphinx-gallery (``make docs``), from the examples directory
    HERE = Path.cwd()
OUT = HERE / "output"
OUT.mkdir(exist_ok=True)

rng = np.random.RandomState(0)
X = rng.uniform(-3, 3, (200, 1))
X = X[(X[:, 0] < -0.5) | (X[:, 0] > 1.0)]
y = np.sin(2 * X[:, 0]) + 0.2 * rng.randn(len(X))
X_test = np.linspace(-4, 4, 100)[:, None]

torch.manual_seed(0)
net = MLP(1, 1, (30, 30), dtype=torch.float64)
opt = torch.optim.Adam(net.parameters(), lr=1e-2, weight_decay=1e-4)
Xt, yt = torch.as_tensor(X), torch.as_tensor(y[:, None])
for _ in range(1500):
    opt.zero_grad()
    torch.nn.functional.mse_loss(net(Xt), yt).backward()
    opt.step()
net.eval()

# fixed hyperparameters for every model: the KFAC-evidence prior, the residual noise
probe = SubspaceLaplaceRegressor(net, subspace_dim=2, device="cpu", random_state=0).fit(X, y)
with torch.no_grad():
    s2 = float(np.mean((net(Xt).numpy()[:, 0] - y) ** 2))
hyper = dict(prior_variance=probe.prior_variance_, noise_variance=s2, device="cpu")
exact = LLARegressor(net, space="parameter", **hyper).fit(X, y)
mp, cp = latent_predictive(exact, X_test, joint=True)

projectors = ["lowrank-kfac", "lowrank-diag", "subset-magnitude", "subset-diagonal",
              "subset-swag", "optimal"]
dims = [1, 2, 5, 10, 20, 50]
kl = {}
for name in projectors:
    kl[name] = []
    for s in dims:
        kw = {"subspace_X": X_test} if name == "optimal" else {}
        est = SubspaceLaplaceRegressor(net, projector=name, subspace_dim=s, random_state=0,
                                       **hyper, **kw).fit(X, y)
        mq, cq = latent_predictive(est, X_test, joint=True)
        kl[name].append(predictive_kl(mp, cp, mq, cq, noise_variance=s2))
# lowrank-kfac restricted to its subspace, like the others: the comparison Theorem 1 covers
ONLY_SP = "lowrank-kfac, S_P only"
kl[ONLY_SP] = []
for s in dims:
    est = SubspaceLaplaceRegressor(net, subspace_dim=s, residual_correction=False,
                                   random_state=0, **hyper).fit(X, y)
    kl[ONLY_SP].append(predictive_kl(mp, cp, *latent_predictive(est, X_test, joint=True),
                                     noise_variance=s2))

fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
# exact LLA first, wide and grey, so that a curve drawn on top of it leaves it visible
a.plot(X_test[:, 0], exact.predict(X_test, return_std=True)[1], color="0.55", lw=6,
       alpha=0.6, label="exact LLA", zorder=2)
for name, rc, style in (("lowrank-kfac", "auto", "-"), ("lowrank-kfac", False, ":"),
                        ("subset-magnitude", "auto", "--")):
    est = SubspaceLaplaceRegressor(net, projector=name, subspace_dim=20, random_state=0,
                                   residual_correction=rc, **hyper).fit(X, y)
    label = f"{name}, s=20" + (", S_P only" if rc is False else
                               " (+ complement)" if name == "lowrank-kfac" else "")
    a.plot(X_test[:, 0], est.predict(X_test, return_std=True)[1], style, lw=1.5,
           label=label, zorder=3)
a.axvspan(-0.5, 1.0, color="0.92", label="no training data", zorder=1)
a.set(xlabel="x", ylabel="predictive std of y", title="predictive std")
a.legend(fontsize=8)
for name in kl:
    b.plot(dims, np.maximum(kl[name], 1e-6), ls=":" if name == ONLY_SP else
           "-" if "lowrank" in name else "--", marker="o" if "lowrank" in name else "s",
           label=name + {"optimal": " (Theorem 1 on X_test, S_P only)", "lowrank-kfac":
                         " (+ complement)", "lowrank-diag": " (+ complement)"}.get(name, ""))
b.set(xscale="log", yscale="log", xlabel="subspace dimension s",
      ylabel="KL(exact || subspace)", title="fidelity to exact LLA")
b.legend(fontsize=8)
fig.tight_layout()
fig.savefig(OUT / "subspace.png", dpi=120)
print(f"saved {OUT / 'subspace.png'}")
for name in kl:
    print(f"{name:22s}", " ".join(f"{v:9.3g}" for v in kl[name]))
