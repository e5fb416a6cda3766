"""VaLLA: variational linearized Laplace (Ortega, Santana & Hernandez-Lobato, 2024).

LLA's predictive is the posterior of a GP with the network as its mean and the scaled
neural tangent kernel ``k((x, c), (z, c')) = s0^2 J_c(x) J_c'(z)^T`` as its kernel
(``J_c`` the gradient of output ``c`` w.r.t. the linearised parameters). VaLLA
approximates that GP by the fixed-mean sparse variational GP of
:mod:`sklearn_lla._gp` (``M`` inducing pairs ``(z_m, c_m)`` and a triangular factor
``L``) and learns ``Z``, ``L``, ``log s0^2`` and ``log s2`` by minibatch Adam on the
alpha-energy (alpha = 1), stopping early on the validation NLL. Nothing here touches
more than one minibatch of the data per step, so a step costs the same for any N.

The kernel (:class:`NTKKernel`) is evaluated

* for chains of ``nn.Linear`` layers and elementwise maps by the layer-wise closed
  form ``sum_l (delta_l(x) . delta_l(z)) (a_l(x) . a_l(z) + 1)`` of the thesis'
  appendix "Efficient Kernel Computation for MLP" (``a_l`` a layer's input,
  ``delta_l`` the back-propagated output gradient at its pre-activation), written in
  differentiable torch operations so that autograd gives ``d/dZ`` (second
  derivatives of the activations) -- no Jacobian row is ever formed; the factors are
  in the network's dtype and each layer's products are combined in float64;
* for any other network from ``torch.func`` Jacobians: ``J(Z)`` (M x P, differentiable
  w.r.t. ``Z``) and the minibatch's ``J(x)`` in memory-bounded chunks.

Prediction precomputes what depends only on the fitted state: the inducing factors
for the structured kernel, or the parameter-space basis ``U = J(Z)^T W^T`` (P x M,
``A = W^T W``) for the generic one, so ``Kxz W^T = s0^2 J(x) U`` is one forward pass
with ``M`` tangents (as ELLA's predict).
"""

from __future__ import annotations

import math
from numbers import Integral, Real

import numpy as np
import torch
from sklearn.utils._param_validation import Interval, StrOptions
from torch.func import jacrev, vmap

from ._base import (
    _MIN_ROWS_FOR_HOLDOUT,
    CLASSIFIER_CONSTRAINTS,
    REGRESSOR_CONSTRAINTS,
    LaplaceClassifierMixin,
    LaplaceRegressorMixin,
)
from ._gp import FixedMeanGPPosterior, Kernel, joint_cov
from ._protocol import carve_validation

__all__ = ["NTKKernel", "VaLLAPosterior", "VaLLARegressor", "VaLLAClassifier"]

_F64 = torch.float64

def structured_cross_gram(Fa, Fb) -> torch.Tensor:
    """``Ja Jb^T`` from two factored Jacobians, in differentiable out-of-place ops.

    ``Fa``, ``Fb`` are :class:`~sklearn_lla._structured_jacobian.StructuredJacobian`
    of the same chain; the result has shape ``(Fa.n_rows, Fb.n_rows)``, float64 (each
    layer's two products are formed in the factors' dtype and combined in float64).
    Unlike ``StructuredJacobian.gram`` (in place, no autograd), gradients flow to
    whichever factors require them.
    """
    B1, k1 = Fa.n_points, Fa.rows_per_point
    B2, k2 = Fb.n_points, Fb.rows_per_point
    G = None
    for la, lb in zip(Fa.layers, Fb.layers):
        DD = (la.delta @ lb.delta.T).to(_F64)  # (B1 k1, B2 k2)
        if la.has_weight:
            K = (la.act @ lb.act.T).to(_F64)  # (B1, B2)
            if la.has_bias:
                K = K + 1.0
            if k1 == 1 and k2 == 1:
                DD = DD * K
            else:
                DD = (DD.view(B1, k1, B2, k2) * K[:, None, :, None]).reshape(B1 * k1, B2 * k2)
        G = DD if G is None else G + DD
    return G


class NTKKernel(Kernel):
    """The scaled NTK ``s0^2 J_c(x) J_c'(z)^T`` over (input, output index) pairs.

    Parameters
    ----------
    lin : LinearizedNet
        The network.
    n_outputs : int
        ``C``.
    input_shape : tuple of int
        The shape of one input (inducing inputs are stored flat).
    prior_variance : float, default=1.0
        ``s0^2`` (the initial value when learned).
    learn_prior : bool, default=False
        Whether ``log s0^2`` is a trainable parameter.
    structured : bool or None, default=None
        Use the layer-wise closed form (``None``: whenever the network is a
        structured chain, ``lin.backend == "structured"``).
    """

    def __init__(self, lin, n_outputs, input_shape, prior_variance=1.0, learn_prior=False,
                 structured=None):
        self.lin = lin
        self.n_outputs = int(n_outputs)
        self.input_shape = tuple(int(s) for s in input_shape)
        self.learn_prior = bool(learn_prior)
        self.log_prior_variance = torch.tensor(math.log(float(prior_variance)), dtype=_F64,
                                               device=lin.device, requires_grad=self.learn_prior)
        can = lin.chain is not None
        self.structured = can if structured is None else bool(structured) and can

    # -- interface -------------------------------------------------------------------
    def parameters(self):
        """``[log s0^2]`` when the prior variance is learned, else ``[]``."""
        return [self.log_prior_variance] if self.learn_prior else []

    @property
    def prior_variance(self):
        """``s0^2``."""
        return float(torch.exp(self.log_prior_variance.detach()))

    def _s0(self):
        return torch.exp(self.log_prior_variance)

    def _z_input(self, z):
        return z.reshape(z.shape[0], *self.input_shape)

    def gram(self, z, cz):
        """``s0^2 J_cz(Z) J_cz(Z)^T`` (M, M), float64, differentiable w.r.t. ``Z``."""
        if self.structured:
            Fz = self._factors(self._z_input(z), cz, differentiable=z.requires_grad)
            K = structured_cross_gram(Fz, Fz)
        else:
            R = self._rows(z, cz)
            K = R @ R.T
        return self._s0() * K

    def cross(self, x, z, cz):
        """``s0^2 J(x) J_cz(Z)^T`` of shape (B, C, M), float64."""
        return self.cross_and_diag(x, z, cz)[0]

    def diag_blocks(self, x):
        """``s0^2 J(x_b) J(x_b)^T`` of shape (B, C, C), float64."""
        lin = self.lin
        blocks = self._factors(x).diag_blocks() if self.structured else lin.ntk_diag_blocks(x)
        return self._s0() * blocks

    def cross_and_diag(self, x, z, cz):
        """``(cross(x, z, cz), diag_blocks(x))`` sharing the work on ``x``."""
        B, C = x.shape[0], self.n_outputs
        if self.structured:
            Fx = self._factors(x)
            Fz = self._factors(self._z_input(z), cz, differentiable=z.requires_grad)
            G = structured_cross_gram(Fx, Fz)
            blocks = Fx.diag_blocks()
        else:
            G, blocks = self._generic_cross_and_diag(x, self._rows(z, cz))
        s0 = self._s0()
        return s0 * G.view(B, C, -1), s0 * blocks

    def batch(self, x, z, cz):
        """``(Kzz, Kxz, Kxx)`` for a training step, evaluating the network at ``Z`` once."""
        B, C = x.shape[0], self.n_outputs
        s0 = self._s0()
        if self.structured:
            Fz = self._factors(self._z_input(z), cz, differentiable=z.requires_grad)
            Fx = self._factors(x)
            Kzz = structured_cross_gram(Fz, Fz)
            Kxz = structured_cross_gram(Fx, Fz).view(B, C, -1)
            return s0 * Kzz, s0 * Kxz, s0 * Fx.diag_blocks()
        R = self._rows(z, cz)
        Kxz, Kxx = self._generic_cross_and_diag(x, R)
        return s0 * (R @ R.T), s0 * Kxz, s0 * Kxx

    def _generic_cross_and_diag(self, x, R):
        parts, blocks = [], []
        for _, J in self.lin.jacobian_chunks(x, self.n_outputs):
            J = J.to(_F64)
            parts.append(J @ R.T)
            blocks.append(J @ J.transpose(1, 2))
        return torch.cat(parts), torch.cat(blocks)

    def joint(self, x):
        """``s0^2 J(x) J(x)^T`` over all outputs of all points, (B C, B C), float64."""
        if self.structured:
            Fx = self._factors(x)
            K = structured_cross_gram(Fx, Fx)
        else:
            K = self.lin.kernel(x, n_outputs=self.n_outputs)
        return self._s0() * K

    # -- evaluation ------------------------------------------------------------------
    def _factors(self, x, out_idx=None, differentiable=False):
        """Factored Jacobian rows (all outputs, or ``out_idx``) at ``x``, network dtype."""
        lin = self.lin
        return lin.chain.features(lin._all_params, lin.buffers, x.to(lin.dtype), out_idx,
                                  lin.names, differentiable=differentiable)

    def _rows(self, z, cz):
        """Jacobian rows ``grad g_cz[m](z_m)`` (M, P), float64, differentiable w.r.t. ``z``."""
        lin = self.lin
        zin = self._z_input(z).to(lin.dtype)
        onehot = torch.nn.functional.one_hot(torch.as_tensor(cz, device=zin.device),
                                             self.n_outputs).to(lin.dtype)

        def out(p, zi, oi):
            return (lin._g(p, zi.unsqueeze(0))[0] * oi).sum()

        jac = vmap(jacrev(out), in_dims=(None, 0, 0))(lin.params, zin, onehot)
        M = zin.shape[0]
        return torch.cat([jac[n].reshape(M, -1) for n in lin.names], dim=1).to(_F64)

    def predictor(self, z, cz, W, method="auto"):
        """``x -> (Kxx blocks, Kxz W^T)`` with everything about ``Z`` precomputed.

        Parameters
        ----------
        z, cz : Tensor
            The fitted inducing inputs and output indices.
        W : Tensor of shape (M, M)
            ``A = W^T W``.
        method : {"auto", "structured", "basis"}, default="auto"
            ``"structured"``: the layer-wise kernel against the stored inducing
            factors (the default for structured networks: ``O(B C M width)`` per
            layer). ``"basis"``: ``U = J(Z)^T W^T`` (P x M) and ``Kxz W^T = s0^2 J(x)
            U`` by one forward pass with ``M`` tangents (``O(B P M)``; the default for
            other networks).

        Returns
        -------
        callable
            Thread-safe: it reads the precomputed tensors and never writes state.
        """
        if method not in ("auto", "structured", "basis"):
            raise ValueError(f"unknown predictor method {method!r}")
        lin, C = self.lin, self.n_outputs
        s0 = float(torch.exp(self.log_prior_variance.detach()))
        W = W.detach().to(_F64)
        zin = self._z_input(z.detach())
        if self.structured and method != "basis":
            with torch.no_grad():
                Fz = self._factors(zin, cz)

            def predict(x):
                Fx = self._factors(x)
                V = structured_cross_gram(Fx, Fz) @ W.T
                return s0 * Fx.diag_blocks(), s0 * V.view(x.shape[0], C, -1)

            return predict
        if method == "structured":
            raise ValueError("the structured predictor needs a structured network")
        cz = torch.as_tensor(cz, device=zin.device)
        U = lin.gradient_rows_vjp(zin.to(lin.dtype), cz, W.T)  # K = M directions

        def predict(x):
            _, jv = lin.jvp(x, U)
            return s0 * lin.ntk_diag_blocks(x), s0 * jv.to(_F64)

        return predict


class VaLLAPosterior(FixedMeanGPPosterior):
    """VaLLA: the fixed-mean sparse GP of :mod:`sklearn_lla._gp` with the scaled NTK.

    Parameters
    ----------
    prior_variance : float or "auto", default="auto"
        ``s0^2``: fixed, or learned (``"auto"``) from ``||theta_hat||^2 / P``.
    **kwargs
        The :class:`~sklearn_lla._gp.FixedMeanGPPosterior` settings.
    """

    def __init__(self, prior_variance="auto", **kwargs):
        super().__init__(**kwargs)
        self.prior_setting = prior_variance

    def make_kernel(self, data, Z, cz):
        """The NTK kernel of ``data.lin``, with its initial prior variance."""
        lin = data.lin
        x0, _ = data.rows(np.arange(1))
        if isinstance(self.prior_setting, str):
            theta = lin.flat_params().to(_F64)
            s0 = max(float(theta @ theta) / lin.n_params, 1e-8)
            learn = True
        else:
            s0, learn = float(self.prior_setting), False
        self.initial_prior_variance = s0
        return NTKKernel(lin, data.n_outputs, x0.shape[1:], s0, learn)

    def _initial_noise(self, data, gen):
        """The larger of the training and the held-out mean squared residuals.

        A network usually fits its training rows more closely than new ones; starting
        ``s2`` at the training residual makes the first validation check already find
        a noise too small. Starting from the held-out residual (a value the objective
        then lowers) lets early stopping halt where the validation NLL is best, the
        paper's "relatively large" initialisation.
        """
        s2 = super()._initial_noise(data, gen)
        val = data.validation
        if val is not None and val.n_samples > 0:
            s2 = max(s2, super()._initial_noise(val, gen))
        return s2

    def predict_joint(self, x):
        """Mean (B, C) and joint latent covariance ``Kxx - Kxz A Kzx`` (B C, B C)."""
        mean = self._mean(self._lin, x)
        with torch.no_grad():
            K = self.kernel.joint(x)
            _, V = self._predict_fn(x)
            V = V.reshape(-1, V.shape[-1]).to(_F64)
        return mean, joint_cov(K, V)


# ---------------------------------------------------------------------------------
# Estimators
# ---------------------------------------------------------------------------------


class _VaLLAMixin:
    """VaLLA's parameters and posterior, shared by the regressor and the classifier."""

    _valla_constraints = {
        "n_inducing": [Interval(Integral, 1, None, closed="left")],
        "alpha": [Interval(Real, 0, 1, closed="both")],
        "learning_rate": [Interval(Real, 0, None, closed="neither")],
        "max_iter": [Interval(Integral, 1, None, closed="left")],
        "early_stopping": ["boolean"],
        "validation_freq": [Interval(Integral, 1, None, closed="left")],
        "n_iter_no_change": [Interval(Integral, 1, None, closed="left")],
        "tol": [Interval(Real, 0, None, closed="left")],
        "learn_inducing": ["boolean"],
        "energy_link": [StrOptions({"probit", "mc"})],
        "validation_fraction": [Interval(Real, 0, 1, closed="neither")],
    }

    def _make_posterior(self, data):
        self._carved = False
        if (self.early_stopping and data.validation is None
                and data.n_samples >= _MIN_ROWS_FOR_HOLDOUT):
            data.validation = carve_validation(data, self.validation_fraction)
            self._carved = True
        regression = data.likelihood.task == "regression"
        seed = int(torch.randint(0, 2**31 - 1, (1,), generator=data.generator))
        return VaLLAPosterior(
            prior_variance=self.prior_variance,
            noise_variance=self.noise_variance if regression else None,
            n_inducing=self.n_inducing, alpha=self.alpha, learning_rate=self.learning_rate,
            max_iter=self.max_iter, batch_size=self.batch_size,
            early_stopping=self.early_stopping, validation_freq=self.validation_freq,
            n_iter_no_change=self.n_iter_no_change, learn_inducing=self.learn_inducing,
            energy_link=self.energy_link, random_state=seed, validation_tol=self.tol)

    def _store_fitted(self, posterior):
        self.inducing_inputs_ = posterior.inducing_inputs
        self.inducing_outputs_ = posterior.inducing_outputs
        self.n_iter_ = posterior.n_iter
        self.validation_scores_ = list(posterior.hyper_trace.get("validation", []))
        self.kl_ = float(posterior.hyper_trace.get("kl", np.nan))
        if self._carved:
            self.validation_source_ = "rows held out from the training data (validation_fraction)"
        del self._carved
        super()._store_fitted(posterior)




class VaLLARegressor(_VaLLAMixin, LaplaceRegressorMixin):
    """VaLLA regression: variational LLA with learned prior, noise and inducing points.

    Approximates linearized Laplace (the GP with the network as mean and the scaled
    NTK ``s0^2 J(x) J(x')^T`` as kernel) by a sparse variational GP whose mean stays
    the network: ``n_inducing`` inducing inputs (k-means initialised) and a triangular
    factor, learned with ``log s0^2`` and ``log s2`` by minibatch Adam on the
    alpha-energy, with early stopping on the validation NLL. A step costs the same for
    any number of rows.

    Parameters
    ----------
    net : None, skorch net, FrozenEstimator or torch.nn.Module, default=None
        The network. ``None`` trains a small tanh MLP (MAP, weight decay) in ``fit``;
        a fitted skorch net, ``FrozenEstimator(net)`` or an ``nn.Module`` is used as it
        is and never modified; an unfitted skorch net is trained in ``fit``.
    n_inducing : int, default=100
        ``M``, the number of inducing points (cost ``O(M^3)`` per step).
    prior_variance : float or "auto", default="auto"
        ``s0^2``. ``"auto"``: learned by the objective, initialised at
        ``||theta_hat||^2 / P``; a float is kept fixed.
    noise_variance : float or "auto", default="auto"
        ``s2``. ``"auto"``: learned, initialised at the network's mean squared
        residual on the held-out rows (or the training rows, whichever is larger);
        a float is kept fixed.
    alpha : float, default=1.0
        The alpha of the energy (1: the paper's; 0: the ELBO, which cannot learn
        ``s0^2`` with the mean fixed).
    learning_rate : float, default=1e-3
        Adam's learning rate (the paper's). Larger rates move ``s0^2`` and ``s2``
        past the validation optimum between two checks (measured in
        ``docs/valla.md``).
    max_iter : int, default=10000
        Largest number of Adam steps (the paper: up to 40,000); early stopping
        usually ends the run after a few hundred to a few thousand.
    batch_size : int, default=100
        Rows per Adam step (and per forward pass at prediction).
    early_stopping : bool, default=True
        Check the validation NLL every ``validation_freq`` steps, stop after
        ``n_iter_no_change`` checks without improvement and keep the best state. Needs
        held-out rows: ``validation_data``, the net's own hold-out, or
        ``validation_fraction`` of the training rows.
    validation_freq : int, default=100
        Steps between validation checks.
    n_iter_no_change : int, default=5
        Checks without improvement before stopping.
    tol : float, default=1e-3
        Relative decrease of the validation NLL that counts as an improvement.
    validation_fraction : float, default=0.1
        Fraction of training rows held out for early stopping when no held-out rows
        exist (at least 20 rows needed).
    learn_inducing : bool, default=True
        Learn ``Z`` (gradients through ``J(Z)``: second derivatives of the network).
    energy_link : {"probit", "mc"}, default="probit"
        Unused in regression (closed form); kept for a common signature.
    trainable_only : bool, default=True
        Linearise only parameters with ``requires_grad=True``.
    device : str or torch.device, default="auto"
        ``"auto"`` (CUDA when available), ``"cpu"``, ``"cuda"`` or a torch device.
    random_state : int, RandomState instance or None, default=None
        Seeds k-means, hold-outs, the minibatch order and net training.
    verbose : int or bool, default=0
        ``>= 1`` shows a progress bar.

    Attributes
    ----------
    prior_variance_ : float
        The learned (or fixed) ``s0^2``.
    noise_variance_ : float
        The learned (or fixed) ``s2``.
    inducing_inputs_ : ndarray of shape (n_inducing, n_features_flat)
        The learned inducing inputs ``Z`` (flattened inputs).
    inducing_outputs_ : ndarray of shape (n_inducing,)
        The output index (regression target or class logit) each one carries.
    n_iter_ : int
        Adam steps taken.
    validation_scores_ : list of tuple
        ``(step, validation NLL)`` at each check (empty without held-out rows).
    kl_ : float
        The fitted ``KL`` term of the objective.
    hyper_strategy_ : str
        ``"variational"`` (learned) or ``"fixed"``.
    hyper_trace_ : dict
        The optimisation history (loss per step, validation checks, best step).
    net_ : object
        The pretrained or trained network.
    linearized_net_ : LinearizedNet
        The frozen functional view of the network.
    jacobian_backend_ : str
        ``"structured"`` (layer-wise NTK) or ``"functorch"``.
    jacobian_backend_reason_ : str
        Why that backend was chosen.
    validation_source_ : str or None
        Where the held-out rows came from, or ``None``.
    likelihood_ : Gaussian
        The fitted likelihood.
    posterior_ : VaLLAPosterior
        The fitted posterior.
    n_outputs_ : int
        Number of network outputs.
    n_features_in_ : int
        Number of input features.
    feature_names_in_ : ndarray of shape (n_features_in_,)
        Feature names, when ``X`` has string column names.

    See Also
    --------
    LLARegressor : Exact LLA, which VaLLA approximates.
    ELLARegressor : Nystrom LLA.

    Examples
    --------
    >>> import numpy as np
    >>> from sklearn_lla import VaLLARegressor
    >>> rng = np.random.RandomState(0)
    >>> X = rng.uniform(-2, 2, (200, 1))
    >>> y = np.sin(2 * X[:, 0]) + 0.1 * rng.randn(200)
    >>> reg = VaLLARegressor(n_inducing=20, max_iter=200, random_state=0).fit(X, y)
    >>> mean, std = reg.predict(X[:2], return_std=True)
    >>> std.shape, reg.inducing_inputs_.shape
    ((2,), (20, 1))
    """

    _parameter_constraints = {**REGRESSOR_CONSTRAINTS, **_VaLLAMixin._valla_constraints}

    def __init__(self, net=None, *, n_inducing=100, prior_variance="auto",
                 noise_variance="auto", alpha=1.0, learning_rate=1e-3, max_iter=10000,
                 batch_size=100, early_stopping=True, validation_freq=100, n_iter_no_change=5,
                 tol=1e-3, validation_fraction=0.1, learn_inducing=True, energy_link="probit",
                 trainable_only=True, device="auto", random_state=None, verbose=0):
        self.net = net
        self.n_inducing = n_inducing
        self.prior_variance = prior_variance
        self.noise_variance = noise_variance
        self.alpha = alpha
        self.learning_rate = learning_rate
        self.max_iter = max_iter
        self.batch_size = batch_size
        self.early_stopping = early_stopping
        self.validation_freq = validation_freq
        self.n_iter_no_change = n_iter_no_change
        self.tol = tol
        self.validation_fraction = validation_fraction
        self.learn_inducing = learn_inducing
        self.energy_link = energy_link
        self.trainable_only = trainable_only
        self.device = device
        self.random_state = random_state
        self.verbose = verbose


class VaLLAClassifier(_VaLLAMixin, LaplaceClassifierMixin):
    """VaLLA classification: variational LLA with a learned prior and inducing points.

    Approximates linearized Laplace (the GP with the network's logits as mean and the
    scaled NTK as kernel) by a sparse variational GP whose mean stays the network:
    ``n_inducing`` inducing points (k-means per class, each carrying its class logit)
    and a triangular factor, learned with ``log s0^2`` by minibatch Adam on the
    alpha-energy (the probit-scaled softmax's log predictive at alpha = 1), with early
    stopping on the validation NLL.

    Parameters
    ----------
    net : None, skorch net, FrozenEstimator or torch.nn.Module, default=None
        The network. ``None`` trains a small tanh MLP (MAP, weight decay) in ``fit``;
        a fitted skorch net, ``FrozenEstimator(net)`` or an ``nn.Module`` is used as it
        is and never modified; an unfitted skorch net is trained in ``fit``.
    n_inducing : int, default=100
        ``M``; ``M / n_classes`` per class.
    prior_variance : float or "auto", default="auto"
        ``s0^2``. ``"auto"``: learned, initialised at ``||theta_hat||^2 / P``.
    alpha : float, default=1.0
        The alpha of the energy; ``0 < alpha < 1`` uses Monte Carlo.
    learning_rate : float, default=1e-3
        Adam's learning rate (the paper's).
    max_iter : int, default=10000
        Largest number of Adam steps; early stopping usually ends the run sooner.
    batch_size : int, default=100
        Rows per Adam step (and per forward pass at prediction).
    early_stopping : bool, default=True
        Stop on the validation NLL (checked every ``validation_freq`` steps).
    validation_freq : int, default=100
        Steps between validation checks.
    n_iter_no_change : int, default=5
        Checks without improvement before stopping.
    tol : float, default=1e-3
        Relative decrease of the validation NLL that counts as an improvement.
    validation_fraction : float, default=0.1
        Fraction of training rows held out for early stopping when no held-out rows
        exist.
    learn_inducing : bool, default=True
        Learn ``Z``.
    energy_link : {"probit", "mc"}, default="probit"
        How ``E_Q p(y | f)`` is computed in the objective.
    link_approx : {"probit", "mc", "bridge"}, default="probit"
        Approximation of ``E softmax(f)`` at prediction.
    n_samples_predict : int, default=512
        Samples per point for ``link_approx="mc"``.
    classes : array-like or None, default=None
        The label of each network output, in output order (see
        :class:`~sklearn_lla.LLAClassifier`).
    trainable_only : bool, default=True
        Linearise only parameters with ``requires_grad=True``.
    device : str or torch.device, default="auto"
        ``"auto"`` (CUDA when available), ``"cpu"``, ``"cuda"`` or a torch device.
    random_state : int, RandomState instance or None, default=None
        Seeds k-means, hold-outs, the minibatch order, net training and ``mc`` draws.
    verbose : int or bool, default=0
        ``>= 1`` shows a progress bar.

    Attributes
    ----------
    classes_ : ndarray
        Class labels, in the order of ``predict_proba``'s columns.
    prior_variance_ : float
        The learned (or fixed) ``s0^2``.
    inducing_inputs_ : ndarray of shape (n_inducing, n_features_flat)
        The learned inducing inputs ``Z`` (flattened inputs).
    inducing_outputs_ : ndarray of shape (n_inducing,)
        The output index (regression target or class logit) each one carries.
    n_iter_ : int
        Adam steps taken.
    validation_scores_ : list of tuple
        ``(step, validation NLL)`` at each check (empty without held-out rows).
    kl_ : float
        The fitted ``KL`` term of the objective.
    hyper_strategy_ : str
        ``"variational"`` (learned) or ``"fixed"``.
    hyper_trace_ : dict
        The optimisation history.
    net_ : object
        The pretrained or trained network.
    linearized_net_ : LinearizedNet
        The frozen functional view of the network.
    jacobian_backend_ : str
        ``"structured"`` or ``"functorch"``.
    jacobian_backend_reason_ : str
        Why that backend was chosen.
    validation_source_ : str or None
        Where the held-out rows came from, or ``None``.
    likelihood_ : Categorical or Bernoulli
        The likelihood.
    posterior_ : VaLLAPosterior
        The fitted posterior.
    n_outputs_ : int
        Number of network outputs.
    n_features_in_ : int
        Number of input features.
    feature_names_in_ : ndarray of shape (n_features_in_,)
        Feature names, when ``X`` has string column names.

    See Also
    --------
    LLAClassifier : Exact LLA, which VaLLA approximates.

    Examples
    --------
    >>> from sklearn.datasets import make_blobs
    >>> from sklearn_lla import VaLLAClassifier
    >>> X, y = make_blobs(n_samples=120, centers=3, random_state=0)
    >>> clf = VaLLAClassifier(n_inducing=12, max_iter=100, random_state=0).fit(X, y)
    >>> clf.predict_proba(X[:2]).shape
    (2, 3)
    """

    _parameter_constraints = {**CLASSIFIER_CONSTRAINTS, **_VaLLAMixin._valla_constraints}

    def __init__(self, net=None, *, n_inducing=100, prior_variance="auto", alpha=1.0,
                 learning_rate=1e-3, max_iter=10000, batch_size=100, early_stopping=True,
                 validation_freq=100, n_iter_no_change=5, tol=1e-3, validation_fraction=0.1,
                 learn_inducing=True, energy_link="probit", link_approx="probit",
                 n_samples_predict=512, classes=None, trainable_only=True, device="auto",
                 random_state=None, verbose=0):
        self.net = net
        self.n_inducing = n_inducing
        self.prior_variance = prior_variance
        self.alpha = alpha
        self.learning_rate = learning_rate
        self.max_iter = max_iter
        self.batch_size = batch_size
        self.early_stopping = early_stopping
        self.validation_freq = validation_freq
        self.n_iter_no_change = n_iter_no_change
        self.tol = tol
        self.validation_fraction = validation_fraction
        self.learn_inducing = learn_inducing
        self.energy_link = energy_link
        self.link_approx = link_approx
        self.n_samples_predict = n_samples_predict
        self.classes = classes
        self.trainable_only = trainable_only
        self.device = device
        self.random_state = random_state
        self.verbose = verbose
