"""The held-out calibrations of ``sklearn_lla._core.calibration`` on data with a known answer.

* temperature: labels drawn from ``softmax(z)`` while the "network" reports ``a z``
  (over-confident for ``a > 1``): the held-out NLL's minimiser is ``T = a`` up to
  sampling error, and the out-of-fold check keeps it; for a well-calibrated network
  (``a = 1``) ``T = 1`` is kept or the fitted ``T`` is within sampling error of 1;
* the sharpening bound: a temperature never makes the predictive more confident than
  the network on the held-out rows;
* noise: residuals drawn from ``N(0, v_i + s2)`` with known latent variances ``v_i``: the
  calibrated ``s2`` is the maximum-likelihood value (checked against a fine brute-force
  grid) and close to the truth;
* scale of the latent covariance (classification): applied only where the temperature
  cannot bring the held-out NLL within tolerance of the network's own, and then the
  largest scale that does;
* scale of a rescalable posterior: the closed-form ``c`` equals the answer of the
  85-point grid (plus 11 refinements) it replaced, to that grid's resolution, and the
  two-evaluation form :func:`rescaled_nll` gives its NLL.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from sklearn_lla._core.calibration import (
    calibrate_classification,
    calibrate_noise,
    calibrate_scale,
    calibrate_temperature,
    rescaled_nll,
)
from sklearn_lla._core.likelihoods import Categorical


def _labels(z, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.multinomial(torch.softmax(z, -1), 1, generator=g).reshape(-1)


@pytest.mark.parametrize("a", [3.0, 0.5])
def test_temperature_recovers_the_logit_scale(a):
    # n = 4000 points, C = 4: the MLE of T has a relative sampling sd of ~2-3 %
    z = torch.randn(4000, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0)) * 2
    y = _labels(z, 1)
    mean, cov = a * z, torch.zeros(4000, 4, 4, dtype=torch.float64)
    T, trace = calibrate_temperature(Categorical(4), mean, cov, y)
    if a > 1:  # over-confident: T = a is found and kept
        assert trace["kept"] and T == pytest.approx(a, rel=0.08)
    else:  # under-confident: sharpening is capped at the network's own confidence, and
        # with cov = 0 the network is the predictive at T = 1: no sharpening at all
        assert trace["min_temperature"] == pytest.approx(1.0, rel=1e-6)
        assert T == pytest.approx(1.0, rel=1e-6)


def test_temperature_is_not_kept_when_it_does_not_help():
    # a calibrated network and few rows: fitted T is noise, kept only if it helps out
    # of fold; either way the result is within sampling error of 1
    z = torch.randn(150, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(3)) * 2
    y = _labels(z, 4)
    cov = 0.3 * torch.eye(3, dtype=torch.float64).expand(150, 3, 3).clone()
    T, trace = calibrate_temperature(Categorical(3), 1.0 * z, cov, y)
    assert T == 1.0 or trace["out_of_fold_nll"] < trace["out_of_fold_nll_at_1"]
    assert 0.5 < trace["fitted_temperature"] < 2.0


def test_temperature_never_sharper_than_the_network():
    # latent variance makes the probit predictive softer than the network: tempering
    # may take that back, but the mean confidence stays <= the network's
    z = torch.randn(3000, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(5)) * 3
    y = z.argmax(-1)  # labels with no noise: the held-out NLL keeps falling as T -> 0
    cov = 4.0 * torch.eye(5, dtype=torch.float64).expand(3000, 5, 5).clone()
    lik = Categorical(5)
    T, trace = calibrate_temperature(lik, z, cov, y)
    raw = float(torch.softmax(z, -1).max(-1).values.mean())
    tempered = lik.with_temperature(T).predict(z, cov).max(-1).values.mean()
    assert T < 1 and float(tempered) <= raw + 1e-9
    assert T == pytest.approx(trace["min_temperature"], rel=1e-3)  # the bound binds


def test_noise_is_the_maximum_likelihood_value():
    rng = np.random.RandomState(0)
    n, s2_true = 5000, 0.3
    v = rng.uniform(0.0, 1.0, n)
    r = rng.randn(n) * np.sqrt(v + s2_true)
    mean = torch.zeros(n, 1, dtype=torch.float64)
    cov = torch.as_tensor(v, dtype=torch.float64).reshape(n, 1, 1)
    y = torch.as_tensor(r, dtype=torch.float64).reshape(n, 1)
    s2, trace = calibrate_noise(mean, cov, y)
    grid = np.exp(np.linspace(math.log(0.05), math.log(2.0), 20001))
    nll = [0.5 * np.mean(np.log(v + g) + r**2 / (v + g)) for g in grid]
    assert s2 == pytest.approx(grid[int(np.argmin(nll))], rel=1e-3)
    assert s2 == pytest.approx(s2_true, rel=0.1)  # sampling error of the MLE ~ 4 %
    assert trace["best_score"] == pytest.approx(min(nll) + 0.5 * math.log(2 * math.pi),
                                                rel=1e-6)


def test_temperature_lower_end_is_a_cap_warned_only_when_it_binds():
    """Held-out rows without errors want T -> 0. The search stops where the predictive
    is as sharp as the network allows (every logit's probit scale back to 1 at each
    row, or the range's end where a large variance leaves nothing to take back): a
    cap by design, recorded in the trace. It warns (naming temperature_ and
    prior_variance_) only when the held-out NLL there is still clearly above the
    network's own: the posterior is wider than the rows support."""
    import warnings

    from sklearn_lla._core.hyper import HyperparameterWarning

    g = torch.Generator().manual_seed(0)
    z = torch.randn(600, 3, dtype=torch.float64, generator=g) * 4
    y = z.argmax(-1)  # the network's argmax is always right: sharper is always better
    eye = torch.eye(3, dtype=torch.float64)
    broad = 100.0 * eye.expand(600, 3, 3).clone()  # latent std 10 everywhere
    mixed = broad.clone()
    mixed[:300] = 1e-6 * eye  # half the rows: no variance, never sharpened past the net
    moderate = 2.0 * eye.expand(600, 3, 3).clone()  # v = 2: floor sqrt(1 - pi v / 8)
    floor = math.sqrt(1 - math.pi * 2.0 / 8)
    net_nll = float(-torch.log_softmax(z, -1).gather(1, y[:, None]).mean())
    for cov, want in ((broad, 0.01), (mixed, 0.01)):  # std 10 left at the cap: binds
        with pytest.warns(HyperparameterWarning,
                          match=r"temperature_ ended at its sharpening limit.*prior_variance_"):
            T, trace = calibrate_temperature(Categorical(3), z, cov, y)
        assert trace["kept"] and T == pytest.approx(want, rel=1e-3)
        assert trace["at_sharpening_limit"]
        assert trace["min_temperature"] == pytest.approx(want, rel=1e-9)
        assert trace["network_nll"] == pytest.approx(net_nll, rel=1e-9)
        assert trace["best_score"] > net_nll + 0.005
    with warnings.catch_warnings():
        warnings.simplefilter("error", HyperparameterWarning)
        T, trace = calibrate_temperature(Categorical(3), z, moderate, y)
    assert trace["kept"] and T == pytest.approx(floor, rel=1e-3)
    assert trace["at_sharpening_limit"]
    # at the common floor every logit is back at the network's scale: the network's NLL
    p = Categorical(3).with_temperature(T).predict(z, moderate)
    np.testing.assert_allclose(p, torch.softmax(z, -1), rtol=1e-6)
    assert trace["best_score"] == pytest.approx(net_nll, rel=1e-5)


def test_covariance_scale_only_where_the_temperature_is_not_enough():
    """The spread too wide for the held-out rows (latent std 10, no errors): the
    temperature stops at its cap with the NLL above the network's, so the latent
    covariance is scaled by the largest ``c`` that brings it within tolerance (2 % more
    spread does not), without a warning. A spread the temperature can take back
    (v = 2): ``c = 1`` and the temperature's own result."""
    import warnings

    from sklearn_lla._core.hyper import HyperparameterWarning

    g = torch.Generator().manual_seed(0)
    z = torch.randn(600, 3, dtype=torch.float64, generator=g) * 4
    y = z.argmax(-1)
    eye = torch.eye(3, dtype=torch.float64)
    broad = 100.0 * eye.expand(600, 3, 3).clone()
    net_nll = float(-torch.log_softmax(z, -1).gather(1, y[:, None]).mean())
    tol = max(0.005, 0.1 * net_nll)
    with warnings.catch_warnings():
        warnings.simplefilter("error", HyperparameterWarning)
        T, c, trace = calibrate_classification(Categorical(3), z, broad, y)
    assert 1e-3 < c < 1 and trace["covariance_scale"] == c
    lik = Categorical(3).with_temperature(T).with_covariance_scale(c)
    nll = float(-lik.log_predictive(z, broad, y).mean())
    assert nll == pytest.approx(trace["best_score"], rel=1e-9)
    assert nll - net_nll <= tol + 1e-9
    wider_trace = calibrate_temperature(Categorical(3), z, broad * (1.02 * c), y,
                                        warn=False)[1]
    assert wider_trace["best_score"] - net_nll > tol
    # the scale is the latent's: N(z, c S) tempered
    np.testing.assert_allclose(lik.predict(z, broad),
                               Categorical(3).with_temperature(T).predict(z, c * broad),
                               rtol=1e-12)
    moderate = 2.0 * eye.expand(600, 3, 3).clone()
    T1, c1, trace1 = calibrate_classification(Categorical(3), z, moderate, y)
    T0, trace0 = calibrate_temperature(Categorical(3), z, moderate, y)
    assert c1 == 1.0 and T1 == T0 and "scale_search" not in trace1
    with pytest.raises(ValueError, match="covariance_scale"):
        Categorical(3).with_covariance_scale(0.0)


def _rescaled_case(C, seed, shrink):
    """Held-out residuals, a latent covariance and ``s2`` (``shrink`` scales the residuals)."""
    g = torch.Generator().manual_seed(seed)
    n = 300
    A = torch.randn(n, C, C, dtype=torch.float64, generator=g) * 0.5
    cov = A @ A.transpose(1, 2)
    s2 = 0.05
    sig = cov + s2 * torch.eye(C, dtype=torch.float64)
    r = torch.linalg.cholesky(sig) @ torch.randn(n, C, 1, dtype=torch.float64, generator=g)
    mean = torch.randn(n, C, dtype=torch.float64, generator=g)
    return mean, cov, mean + shrink * r.squeeze(-1), s2


def _nll_at_scale(mean, cov, y, s2, c):
    C = mean.shape[1]
    sig = c * (cov + s2 * torch.eye(C, dtype=torch.float64))
    d = torch.distributions.MultivariateNormal(mean, covariance_matrix=sig)
    return float(-d.log_prob(y).mean())


def _old_grid_scale(mean, cov, y, s2):
    """The grid search the closed form replaced: 85 scales 0.05 decades apart in units of
    ``c0`` (mean squared residual / s2), then 11 points between the best one's
    neighbours."""
    c0 = float(((y - mean) ** 2).mean()) / s2
    c = np.logspace(-4, 0.2, 85) * c0
    sc = np.array([_nll_at_scale(mean, cov, y, s2, v) for v in c])
    i = int(np.argmin(sc))
    step = np.log(c[1] / c[0])
    fine = c[i] * np.exp(np.linspace(-step, step, 11))
    fs = np.array([_nll_at_scale(mean, cov, y, s2, v) for v in fine])
    return (fine[int(np.argmin(fs))] if fs.min() < sc[i] else c[i]), step / 5


@pytest.mark.parametrize("C, shrink", [(1, 1.0), (1, 0.3), (3, 1.0), (3, 2.0)])
def test_closed_form_scale_equals_the_grid_to_its_resolution(C, shrink):
    mean, cov, y, s2 = _rescaled_case(C, seed=C, shrink=shrink)
    c, trace = calibrate_scale(mean, cov, y, 0.7, s2)
    grid_c, fine_step = _old_grid_scale(mean, cov, y, s2)
    # the refined grid is 0.01 decades apart: its answer is within half a step
    assert abs(math.log(c / grid_c)) <= 0.5 * fine_step + 1e-12
    # and the closed form is the minimiser: no grid point scores better
    best = _nll_at_scale(mean, cov, y, s2, c)
    assert trace["best_score"] == pytest.approx(best, rel=1e-10)
    assert best <= _nll_at_scale(mean, cov, y, s2, grid_c) + 1e-12
    assert trace["prior_variance"] == pytest.approx(0.7 * c, rel=1e-14)
    assert trace["noise_variance"] == pytest.approx(s2 * c, rel=1e-14)
    # the two-evaluation form gives the same minimum from the NLL alone
    assert rescaled_nll(lambda v: _nll_at_scale(mean, cov, y, s2, v), C) == pytest.approx(
        best, rel=1e-9)


def test_crossing_brackets_the_level_to_bisection_width():
    """The batched search of the sharpening limit: the bracket it returns holds the
    crossing of a decreasing function, is as narrow as 40 bisection steps, and every
    call evaluates one batch of points."""
    from sklearn_lla._core.calibration import _crossing

    calls = []

    def above(us):  # exp(-u) decreases, crossing its level at u = -1.2345
        calls.append(len(us))
        return np.exp(-np.asarray(us)) > math.exp(1.2345)

    a, b = _crossing(above, -4.6, 0.0)
    assert a < -1.2345 <= b
    assert b - a <= 4.6 / 2**40 and b + 1.2345 < 1e-11
    assert calls == [63] * 7
    # the crossing at an end of the bracket
    a, b = _crossing(lambda us: np.asarray(us) < -4.6 + 1e-14, -4.6, 0.0)
    assert b - (-4.6) < 1e-11
