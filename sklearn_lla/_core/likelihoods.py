"""Likelihood objects: everything a method needs to know about ``p(y | f)``.

Three likelihoods cover every estimator:

* :class:`Gaussian` (regression, ``y ~ N(f, s2 I)``, ``s2 = noise_variance``);
* :class:`Categorical` (``C >= 2`` logits, softmax);
* :class:`Bernoulli` (a one-logit binary net, sigmoid; skorch's
  ``NeuralNetBinaryClassifier``).

Each owns, written once:

* ``lam_factor(f)``: ``A`` with ``A A^T = Lam(f)``, ``Lam`` the Hessian of
  ``-log p(y | f)`` w.r.t. ``f``. Categorical: ``A = diag(sqrt p) - p sqrt(p)^T``,
  exact without any eigendecomposition (``Lam`` is singular for softmax);
* ``log_prob(f, y)``: per-point log likelihood;
* ``log_predictive(mean, cov, y)``: per-point log predictive density of ``y`` under
  the latent ``N(mean, cov)`` (the validation NLL is its negative mean; the alpha = 1
  energy of VaLLA/FMGP uses it too);
* ``expected_log_prob(mean, cov, y)``: ``E_{N(mean, cov)} log p(y | f)`` (closed
  form for Gaussian; Monte Carlo or Gauss-Hermite for the others), for ELBO-type
  objectives;
* ``predict(mean, cov)``: the predictive distribution of ``y``: Gaussian mean and
  variance, or class probabilities by a link approximation (``probit``, ``mc``,
  ``bridge``) that works for one-logit and C-logit nets alike.

Everything is differentiable torch code, so the variational methods can optimise
through it.
"""

from __future__ import annotations

import math

import numpy as np
import torch

__all__ = [
    "Likelihood",
    "Gaussian",
    "Categorical",
    "Bernoulli",
    "latent_draws",
    "LINK_APPROXIMATIONS",
    "point_normals",
    "row_keys",
    "uses_mc_link",
    "mc_seed",
]

LINK_APPROXIMATIONS = ("probit", "mc", "bridge")

_LOG_2PI = math.log(2.0 * math.pi)


# ---------------------------------------------------------------------------------
# Per-point random numbers (MC link): independent of batch composition and size
# ---------------------------------------------------------------------------------

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _splitmix(z: np.ndarray) -> np.ndarray:
    """SplitMix64 finaliser, vectorised (uint64 arithmetic wraps modulo 2**64)."""
    z = z ^ (z >> np.uint64(30))
    z = z * _M1
    z = z ^ (z >> np.uint64(27))
    z = z * _M2
    return z ^ (z >> np.uint64(31))


def row_keys(x: np.ndarray, seed: int) -> np.ndarray:
    """One 64-bit key per row of ``x``, a hash of the row's float64 bytes and ``seed``.

    A point's Monte Carlo draws are derived from its key, so its predictive
    probabilities do not depend on which other points are in the batch, on the batch
    size, or on its position in ``X``.
    """
    bits = np.ascontiguousarray(np.asarray(x, dtype=np.float64).reshape(len(x), -1))
    bits = bits.view(np.uint64)
    with np.errstate(over="ignore"):
        h = np.full(len(bits), _splitmix(np.uint64(seed) + _GOLDEN), dtype=np.uint64)
        for j in range(bits.shape[1]):
            h = _splitmix(h ^ bits[:, j] + _GOLDEN)
    return h


def point_normals(keys: np.ndarray, n_samples: int, n_outputs: int) -> torch.Tensor:
    """Standard normal draws of shape ``(n_samples, B, n_outputs)`` from per-point keys.

    Counter-based (SplitMix64 of key and counter, Box-Muller), so point ``b`` always
    gets the same draws whatever else is drawn with it.
    """
    B = len(keys)
    n = n_samples * n_outputs
    half = (n + 1) // 2
    ctr = np.arange(2 * half, dtype=np.uint64)
    with np.errstate(over="ignore"):
        z = _splitmix(keys[:, None] + (ctr[None, :] + np.uint64(1)) * _GOLDEN)
    u = ((z >> np.uint64(11)).astype(np.float64) + 0.5) / float(2**53)  # (0, 1)
    u1, u2 = u[:, :half], u[:, half:]
    r = np.sqrt(-2.0 * np.log(u1))
    eps = np.concatenate([r * np.cos(2 * np.pi * u2), r * np.sin(2 * np.pi * u2)], axis=1)
    eps = eps[:, :n].reshape(B, n_samples, n_outputs).transpose(1, 0, 2)
    return torch.from_numpy(np.ascontiguousarray(eps))


# ---------------------------------------------------------------------------------
# Link approximations of E softmax(f), f ~ N(mean, cov): written once
# ---------------------------------------------------------------------------------


def _diag(cov: torch.Tensor) -> torch.Tensor:
    return torch.diagonal(cov, dim1=-2, dim2=-1).clamp_min(0.0)


def _probit_softmax(mean, var):
    """Probit approximation of ``E softmax(f)`` from the latent variances ``var``."""
    return torch.softmax(mean / torch.sqrt(1.0 + math.pi / 8.0 * var), dim=-1)


def sharpening_floor(cov):
    """Per point, the smallest temperature that scales no logit up: shape (B,).

    Tempering ``f / T`` gives the probit scale ``1 / sqrt(T^2 + pi v_c / 8)`` to logit
    ``c`` (``v_c`` its latent variance); it stays at most 1 for every class when
    ``T^2 >= 1 - pi min_c v_c / 8``. A temperature below 1 can then take back the
    spread the posterior adds at a point, but not make a logit larger than the
    network's own.
    """
    v = _diag(cov).min(dim=-1).values
    return torch.sqrt((1.0 - math.pi / 8.0 * v).clamp_min(0.0))


def _bridge_softmax(mean, var):
    # Laplace bridge (Hobbhahn et al., 2022): N(mean, diag var) -> Dirichlet, return
    # its mean. Logits are centred first (softmax is shift invariant, the bridge is
    # not: its derivation assumes sum-to-zero logits).
    C = mean.shape[-1]
    mu = mean - mean.mean(dim=-1, keepdim=True)
    var = var.clamp_min(torch.finfo(mean.dtype).eps)
    log_term = mu + torch.logsumexp(-mu, dim=-1, keepdim=True)
    alpha = (1.0 - 2.0 / C + torch.exp(log_term) / C**2) / var
    return alpha / alpha.sum(dim=-1, keepdim=True)


def _sqrt_psd(cov: torch.Tensor) -> torch.Tensor:
    """A factor ``L`` with ``L L^T = cov`` for a batch of small PSD matrices."""
    C = cov.shape[-1]
    eye = torch.eye(C, dtype=cov.dtype, device=cov.device)
    scale = _diag(cov).mean(-1).clamp_min(1e-300)[..., None, None]
    L, info = torch.linalg.cholesky_ex(cov + 1e-12 * scale * eye)
    if bool((info != 0).any()):
        evals, evecs = torch.linalg.eigh(0.5 * (cov + cov.transpose(-1, -2)))
        L = evecs * evals.clamp_min(0).sqrt().unsqueeze(-2)
    return L


def latent_draws(mean, cov, eps):
    """``mean + L eps`` for ``eps`` of shape (S, B, C)."""
    L = _sqrt_psd(cov)
    return mean.unsqueeze(0) + torch.einsum("bij,sbj->sbi", L, eps.to(mean))


def uses_mc_link(lik):
    """Whether the likelihood's predictive draws Monte Carlo samples (``link_approx="mc"``)."""
    return getattr(lik, "link_approx", None) == "mc"


def mc_seed(lik, generator):
    """A seed for a validation pass's Monte Carlo draws, from ``generator``.

    One seed per selection gives every candidate the same draws (common random
    numbers), on every partition alike; for other links it is 0 and ``generator``
    is left untouched.
    """
    if not uses_mc_link(lik):
        return 0
    return int(torch.randint(2**62, (1,), generator=generator))



def _check_link(link_approx):
    if link_approx not in LINK_APPROXIMATIONS:
        raise ValueError(
            f"link_approx must be one of {LINK_APPROXIMATIONS}, got {link_approx!r}"
        )


# ---------------------------------------------------------------------------------
# Likelihoods
# ---------------------------------------------------------------------------------


class Likelihood:
    """Base class: ``p(y | f)`` for latent outputs ``f`` of shape (B, C).

    Subclasses set ``task`` (``"regression"`` or ``"classification"``) and
    ``n_outputs`` and implement the methods below.
    """

    task = None
    n_outputs = None

    def lam(self, f: torch.Tensor) -> torch.Tensor:
        """Output Hessian ``Lam(f) = A A^T`` of shape (B, C, C)."""
        A = self.lam_factor(f)
        return A @ A.transpose(-1, -2)

    def __repr__(self):
        args = ", ".join(f"{k}={v!r}" for k, v in self._params().items())
        return f"{type(self).__name__}({args})"

    def _params(self):
        return {}


class Gaussian(Likelihood):
    """Isotropic Gaussian likelihood ``y ~ N(f, s2 I)``.

    Parameters
    ----------
    noise_variance : float
        ``s2`` (> 0).
    n_outputs : int, default=1
        Number of targets ``C``.
    """

    task = "regression"

    def __init__(self, noise_variance: float, n_outputs: int = 1):
        if not (np.isfinite(noise_variance) and noise_variance > 0):
            raise ValueError(f"noise_variance must be finite and > 0, got {noise_variance!r}")
        self.noise_variance = float(noise_variance)
        self.n_outputs = int(n_outputs)

    def _params(self):
        return {"noise_variance": self.noise_variance, "n_outputs": self.n_outputs}

    def with_noise(self, noise_variance: float) -> Gaussian:
        """A copy with another noise variance."""
        return Gaussian(noise_variance, self.n_outputs)

    #: ``Lam = I / s2`` does not depend on ``f``: GLM curvature can be accumulated
    #: once with unit noise and rescaled for every candidate ``s2``.
    unit_curvature = True

    def lam_factor(self, f):
        """``A = I / sqrt(s2)`` of shape (B, C, C)."""
        B, C = f.shape
        eye = torch.eye(C, dtype=f.dtype, device=f.device)
        return (eye / math.sqrt(self.noise_variance)).expand(B, C, C)

    def log_prob(self, f, y):
        """Per-point ``log N(y | f, s2 I)``, shape (B,)."""
        r = (y - f).reshape(f.shape[0], -1)
        return -0.5 * (r.pow(2).sum(-1) / self.noise_variance
                       + r.shape[1] * (_LOG_2PI + math.log(self.noise_variance)))

    def grad(self, f, y):
        """``d log p / d f = (y - f) / s2``, shape (B, C)."""
        return (y - f) / self.noise_variance

    def log_predictive(self, mean, cov, y, **kw):
        """Per-point ``log N(y | mean, cov + s2 I)`` (joint over the C outputs)."""
        C = mean.shape[-1]
        if C == 1:
            v = cov.reshape(-1).clamp_min(0) + self.noise_variance
            r = (y.reshape(-1) - mean.reshape(-1))
            return -0.5 * (_LOG_2PI + torch.log(v) + r * r / v)
        eye = torch.eye(C, dtype=mean.dtype, device=mean.device)
        S = 0.5 * (cov + cov.transpose(-1, -2)) + self.noise_variance * eye
        L = torch.linalg.cholesky(S)
        r = (y - mean).unsqueeze(-1)
        z = torch.linalg.solve_triangular(L, r, upper=False).squeeze(-1)
        logdet = 2.0 * torch.log(torch.diagonal(L, dim1=-2, dim2=-1)).sum(-1)
        return -0.5 * (C * _LOG_2PI + logdet + z.pow(2).sum(-1))

    def expected_log_prob(self, mean, cov, y, **kw):
        """``E_{N(mean, cov)} log N(y | f, s2 I)`` in closed form, shape (B,)."""
        var = _diag(cov) if cov.ndim == 3 else cov
        r2 = (y - mean).pow(2) + var
        C = mean.shape[-1]
        return -0.5 * (r2.sum(-1) / self.noise_variance
                       + C * (_LOG_2PI + math.log(self.noise_variance)))

    def predict(self, mean, cov, **kw):
        """Predictive mean and variance of ``y``: ``(mean, diag(cov) + s2)``."""
        return mean, _diag(cov) + self.noise_variance


class _ClassLikelihood(Likelihood):
    """Shared parts of the classification likelihoods.

    ``temperature`` ``T`` (default 1) tempers the predictive only: :meth:`predict` and
    :meth:`log_predictive` return the class probabilities of the latent ``f / T``,
    ``f ~ N(mean, cov)``, i.e. of ``N(mean / T, cov / T^2)`` (temperature scaling, Guo
    et al. 2017, applied to the whole Laplace predictive, so the ratio of posterior
    spread to logit scale is kept). Below 1, ``T`` is raised per point to
    :func:`sharpening_floor`: it takes back the posterior's spread but scales no logit
    up (without latent variance a point keeps the network's probabilities). The
    curvature (:meth:`lam_factor`), the log likelihood and the training-time
    expectations are those of the untempered model: the posterior is the network's,
    ``T`` is calibrated afterwards on held-out rows
    (:meth:`sklearn_lla._core.protocol.Posterior.calibrate`).

    ``covariance_scale`` ``c`` (default 1) multiplies the latent covariance before the
    temperature: the predictive is that of ``f / T`` with ``f ~ N(mean, c cov)``. It is
    calibrated on held-out rows only where no temperature brings their NLL near the
    network's own (:func:`sklearn_lla._core.calibration.calibrate_classification`).
    """

    task = "classification"
    unit_curvature = False

    def __init__(self, link_approx: str = "probit", n_samples: int = 512):
        _check_link(link_approx)
        self.link_approx = link_approx
        self.n_samples = int(n_samples)
        self.temperature = 1.0
        self.covariance_scale = 1.0

    def _params(self):
        params = {"link_approx": self.link_approx, "n_samples": self.n_samples}
        if self.temperature != 1.0:
            params["temperature"] = self.temperature
        if getattr(self, "covariance_scale", 1.0) != 1.0:
            params["covariance_scale"] = self.covariance_scale
        return params

    def _copy_with(self, name: str, value: float):
        """A copy with the positive scalar ``name`` set to ``value``."""
        if not (np.isfinite(value) and value > 0):
            raise ValueError(f"{name} must be finite and > 0, got {value!r}")
        import copy

        lik = copy.copy(self)
        setattr(lik, name, float(value))
        return lik

    def with_temperature(self, temperature: float):
        """A copy whose predictive is tempered by ``temperature`` (> 0)."""
        return self._copy_with("temperature", temperature)

    def with_covariance_scale(self, scale: float):
        """A copy whose latent covariance is multiplied by ``scale`` (> 0)."""
        return self._copy_with("covariance_scale", scale)

    def _tempered(self, mean, cov):
        c = getattr(self, "covariance_scale", 1.0)  # pickles from before it existed
        if c != 1.0:
            cov = cov * c
        T = getattr(self, "temperature", 1.0)  # pickles from before temperatures existed
        if T == 1.0:
            return mean, cov
        if T < 1.0:
            T = torch.maximum(torch.as_tensor(T, dtype=mean.dtype, device=mean.device),
                              sharpening_floor(cov)).unsqueeze(-1)
            return mean / T, cov / (T * T).unsqueeze(-1)
        return mean / T, cov / (T * T)

    def predict(self, mean, cov, *, eps=None, generator=None):
        """Class probabilities of shape (B, K) of the (tempered) latent ``N(mean, cov)``."""
        mean, cov = self._tempered(mean, cov)
        return self._link(mean, cov, eps=eps, generator=generator)

    def predict_at_temperatures(self, mean, cov, temperatures, *, eps=None):
        """:meth:`predict` at several temperatures, in batched calls: shape (T, B, K).

        Row ``t`` equals ``self.with_temperature(temperatures[t]).predict(mean, cov,
        eps=eps)`` (the same operations, on ``T`` copies of the batch at once); the
        held-out calibration evaluates its grids of temperatures this way.

        Parameters
        ----------
        mean : Tensor of shape (B, C)
        cov : Tensor of shape (B, C, C)
        temperatures : sequence of float
            Each > 0.
        eps : Tensor of shape (S, B, C), optional
            Fixed draws for ``link_approx="mc"``, shared by every temperature.

        Returns
        -------
        Tensor of shape (T, B, K)
        """
        temps = [float(t) for t in temperatures]
        if not all(np.isfinite(t) and t > 0 for t in temps):
            raise ValueError(f"temperatures must be finite and > 0, got {temps!r}")
        c = getattr(self, "covariance_scale", 1.0)
        if c != 1.0:
            cov = cov * c
        B = mean.shape[0]
        floor = sharpening_floor(cov)
        mc = self.link_approx == "mc"
        if not mc:  # the other links read the latent variances only
            cov = _diag(cov)
        # copies of the batch per call: bounded for Monte Carlo draws
        per = max(1, 2**22 // max(1, self.n_samples * mean.numel())) if mc else len(temps)
        out = []
        for i in range(0, len(temps), per):
            T = torch.as_tensor(temps[i:i + per], dtype=mean.dtype, device=mean.device)
            T = torch.where(T.unsqueeze(-1) < 1.0,  # the per-point floor, as _tempered
                            torch.maximum(T.unsqueeze(-1), floor), T.unsqueeze(-1))
            m = (mean / T.unsqueeze(-1)).reshape(-1, *mean.shape[1:])
            T2 = (T * T).reshape(*T.shape, *[1] * (cov.ndim - 1))
            v = (cov / T2).reshape(-1, *cov.shape[1:])
            if mc:
                e = None if eps is None else eps.repeat(1, len(T), 1)
                p = self._link(m, v, eps=e)
            else:
                p = self._link_var(m, v)
            out.append(p.reshape(len(T), B, -1))
        return torch.cat(out)

    def log_predictive_at_temperatures(self, mean, cov, y, temperatures, *, eps=None):
        """:meth:`log_predictive` at several temperatures: shape (T, B).

        Parameters
        ----------
        mean : Tensor of shape (B, C)
        cov : Tensor of shape (B, C, C)
        y : Tensor of shape (B,)
            Labels (ints).
        temperatures : sequence of float
        eps : Tensor of shape (S, B, C), optional

        Returns
        -------
        Tensor of shape (T, B)
        """
        p = self.predict_at_temperatures(mean, cov, temperatures, eps=eps)
        idx = y.long().reshape(1, -1, 1).expand(p.shape[0], -1, 1)
        return torch.log(p.gather(-1, idx).squeeze(-1).clamp_min(torch.finfo(p.dtype).tiny))

    def log_predictive(self, mean, cov, y, *, eps=None, generator=None):
        """Per-point log predictive probability of the labels ``y`` (ints)."""
        p = self.predict(mean, cov, eps=eps, generator=generator)
        picked = p.gather(-1, y.long().reshape(-1, 1)).squeeze(-1)
        return torch.log(picked.clamp_min(torch.finfo(p.dtype).tiny))

    def _eps(self, shape, eps, generator, like):
        if eps is not None:
            return eps.to(like)
        return torch.randn(shape, dtype=like.dtype, device=like.device, generator=generator)


class Categorical(_ClassLikelihood):
    """Categorical likelihood with softmax link on ``C >= 2`` logits.

    Parameters
    ----------
    n_outputs : int
        Number of classes (logits) ``C``.
    link_approx : {"probit", "mc", "bridge"}, default="probit"
        Approximation of ``E softmax(f)`` at prediction.
    n_samples : int, default=512
        Monte Carlo samples for ``link_approx="mc"`` (and MC expectations).
    """

    def __init__(self, n_outputs: int, link_approx: str = "probit", n_samples: int = 512):
        super().__init__(link_approx, n_samples)
        self.n_outputs = int(n_outputs)

    def _params(self):
        return {"n_outputs": self.n_outputs, **super()._params()}

    def lam_factor(self, f):
        """``A = diag(sqrt p) - p sqrt(p)^T``, ``A A^T = diag(p) - p p^T``."""
        p = torch.softmax(f, dim=-1)
        sp = p.sqrt()
        return torch.diag_embed(sp) - p.unsqueeze(-1) * sp.unsqueeze(-2)

    def log_prob(self, f, y):
        """Per-point ``log softmax(f)[y]``, shape (B,)."""
        return torch.log_softmax(f, dim=-1).gather(-1, y.long().reshape(-1, 1)).squeeze(-1)

    def grad(self, f, y):
        """``d log p / d f = onehot(y) - softmax(f)``."""
        onehot = torch.nn.functional.one_hot(y.long().reshape(-1), f.shape[-1]).to(f)
        return onehot - torch.softmax(f, dim=-1)

    def expected_log_prob(self, mean, cov, y, *, eps=None, generator=None):
        """Monte Carlo ``E log softmax(f)[y]`` (reparameterised, differentiable)."""
        e = self._eps((self.n_samples, *mean.shape), eps, generator, mean)
        f = latent_draws(mean, cov, e)
        lp = torch.log_softmax(f, dim=-1)
        idx = y.long().reshape(1, -1, 1).expand(f.shape[0], -1, 1)
        return lp.gather(-1, idx).squeeze(-1).mean(0)

    def _link(self, mean, cov, *, eps=None, generator=None):
        """``E softmax(f)`` of shape (B, C) by ``link_approx``."""
        if self.link_approx != "mc":
            return self._link_var(mean, _diag(cov))
        e = self._eps((self.n_samples, *mean.shape), eps, generator, mean)
        return torch.softmax(latent_draws(mean, cov, e), dim=-1).mean(0)

    def _link_var(self, mean, var):
        """The probit or bridge link from the latent variances ``var`` (B, C)."""
        if self.link_approx == "probit":
            return _probit_softmax(mean, var)
        return _bridge_softmax(mean, var)


#: Gauss-Hermite nodes and weights (probabilists' form) for 1-D expectations.
_GH_X, _GH_W = np.polynomial.hermite_e.hermegauss(32)
_GH_W = _GH_W / _GH_W.sum()


class Bernoulli(_ClassLikelihood):
    """Bernoulli likelihood for a one-logit binary net: ``p(y=1 | z) = sigmoid(z)``.

    ``predict`` returns two columns ``[p(y=0), p(y=1)]``. Links: ``probit``
    (``sigmoid(m / sqrt(1 + pi v / 8))``), ``mc`` (average sigmoid over draws) and
    ``bridge`` (the Laplace bridge of the equivalent sum-to-zero two-logit model
    ``[-z/2, z/2]``).

    Parameters
    ----------
    link_approx : {"probit", "mc", "bridge"}, default="probit"
    n_samples : int, default=512
    """

    n_outputs = 1

    def lam_factor(self, f):
        """``A = sqrt(p (1 - p))`` of shape (B, 1, 1)."""
        p = torch.sigmoid(f)
        return (p * (1 - p)).sqrt().unsqueeze(-1)

    def log_prob(self, f, y):
        """Per-point ``log sigmoid(+-z)``, shape (B,)."""
        z = f.reshape(-1)
        sign = 2.0 * y.reshape(-1).to(z) - 1.0
        return torch.nn.functional.logsigmoid(sign * z)

    def grad(self, f, y):
        """``d log p / d z = y - sigmoid(z)``, shape (B, 1)."""
        return y.reshape(-1, 1).to(f) - torch.sigmoid(f)

    def expected_log_prob(self, mean, cov, y, **kw):
        """``E log sigmoid(+-z)`` by 32-point Gauss-Hermite quadrature, shape (B,)."""
        m = mean.reshape(-1, 1)
        s = cov.reshape(-1, 1).clamp_min(0).sqrt()
        x = torch.as_tensor(_GH_X, dtype=m.dtype, device=m.device)
        w = torch.as_tensor(_GH_W, dtype=m.dtype, device=m.device)
        sign = 2.0 * y.reshape(-1, 1).to(m) - 1.0
        return (torch.nn.functional.logsigmoid(sign * (m + s * x)) * w).sum(-1)

    def _link(self, mean, cov, *, eps=None, generator=None):
        """Probabilities ``[p(y=0), p(y=1)]`` of shape (B, 2) by ``link_approx``."""
        if self.link_approx != "mc":
            return self._link_var(mean, cov)
        m = mean.reshape(-1)
        v = cov.reshape(-1).clamp_min(0)
        e = self._eps((self.n_samples, m.shape[0], 1), eps, generator, m)
        p1 = torch.sigmoid(m + v.sqrt() * e[..., 0]).mean(0)
        return torch.stack([1.0 - p1, p1], dim=-1)

    def _link_var(self, mean, var):
        """The probit or bridge link from the latent variance (any shape of B values)."""
        m = mean.reshape(-1)
        v = var.reshape(-1).clamp_min(0)
        if self.link_approx == "probit":
            p1 = torch.sigmoid(m / torch.sqrt(1.0 + math.pi / 8.0 * v))
            return torch.stack([1.0 - p1, p1], dim=-1)
        mu2 = torch.stack([-0.5 * m, 0.5 * m], dim=-1)
        return _bridge_softmax(mu2, torch.stack([0.25 * v, 0.25 * v], dim=-1))
