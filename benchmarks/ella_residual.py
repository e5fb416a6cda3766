"""Does ELLA's optional residual correction help? Measured against exact LLA.

ELLA keeps only the part of the posterior covariance inside span(V) and drops the
prior variance outside it, ``s0^2 J(x)(I - V V^T) J(x)^T``. ``residual_correction=True``
adds it back. This script fits exact LLA on a 1-D regression problem with a gap and on
a 5-D problem, fixes its evidence-optimal prior and noise variance, and compares ELLA
with and without the correction for several (M, K):

* the mean KL divergence KL(ELLA || LLA) between the Gaussian predictives of y at test
  points inside the data range and outside it (extrapolation);
* test NLL of each method.

Usage: ``python benchmarks/ella_residual.py``
"""

import numpy as np
import torch
from skorch import NeuralNetRegressor

from sklearn_lla import ELLARegressor, LLARegressor
from sklearn_lla.metrics import gaussian_nll
from sklearn_lla.nets import MLP


def kl_gauss(m1, s1, m2, s2):
    return np.mean(np.log(s2 / s1) + (s1**2 + (m1 - m2) ** 2) / (2 * s2**2) - 0.5)


def problem(d, seed=0):
    rng = np.random.RandomState(seed)
    X = rng.uniform(-2, 2, (400, d))
    if d == 1:
        X = X[(X[:, 0] < -0.5) | (X[:, 0] > 0.7)]
    w = rng.randn(d)
    f = lambda Z: np.sin(2 * Z @ w / np.sqrt(d))  # noqa: E731
    y = f(X) + 0.1 * rng.randn(len(X))
    X_in = rng.uniform(-2, 2, (500, d))
    X_out = rng.uniform(2, 4, (500, d)) * rng.choice([-1, 1], (500, d))
    y_in = f(X_in) + 0.1 * rng.randn(500)
    return X, y, X_in, y_in, X_out


def main():
    torch.set_num_threads(2)
    rows = []
    for d in (1, 5):
        X, y, X_in, y_in, X_out = problem(d)
        torch.manual_seed(0)
        net = NeuralNetRegressor(MLP, module__n_features=d, module__hidden_layer_sizes=(32, 32),
                                 module__dtype=torch.float64, optimizer=torch.optim.Adam,
                                 lr=1e-2, optimizer__weight_decay=1e-4, max_epochs=300,
                                 train_split=None, verbose=0).fit(X, y[:, None])
        lla = LLARegressor(net).fit(X, y)
        s0, s2 = lla.prior_variance_, lla.noise_variance_
        ref = {k: lla.predict(Z, return_std=True) for k, Z in (("in", X_in), ("out", X_out))}
        nll_lla = gaussian_nll(y_in, *ref["in"])
        for M, K in ((50, 5), (100, 10), (200, 20), (len(X), 50)):
            for res in (False, True):
                e = ELLARegressor(net, n_nystrom=M, n_components=K, prior_variance=s0,
                                  noise_variance=s2, residual_correction=res,
                                  random_state=0).fit(X, y)
                kl = {k: kl_gauss(*e.predict(Z, return_std=True), *ref[k])
                      for k, Z in (("in", X_in), ("out", X_out))}
                nll = gaussian_nll(y_in, *e.predict(X_in, return_std=True))
                rows.append((d, M, e.n_components_, res, kl["in"], kl["out"], nll, nll_lla))
    print(f"{'D':>2} {'M':>5} {'K':>4} {'residual':>9} {'KL in':>10} {'KL out':>10} "
          f"{'NLL in':>8} {'NLL LLA':>8}")
    for d, M, K, res, kin, kout, nll, nl in rows:
        print(
            f"{d:>2} {M:>5} {K:>4} {str(res):>9} {kin:>10.4f} {kout:>10.4f} "
            f"{nll:>8.4f} {nl:>8.4f}"
        )


if __name__ == "__main__":
    main()
