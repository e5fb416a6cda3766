"""The FMGP kernels, public through :mod:`sklearn_lla.kernels`.

Covariances over (input, output index) pairs, ``K((x, c), (x', c'))``, evaluated in
float64 with trainable hyperparameters (torch tensors), on the engine's interface
:class:`sklearn_lla._posteriors.gp.Kernel` (one class, re-exported as
:class:`sklearn_lla.kernels.Kernel`):

* :class:`RBF`: ``a exp(-r^2 / 2) [c = c']`` with ARD length scales (regression);
* :class:`ClassificationKernel`: ``a B_cc' RBF(x, x') (psi(x)^T psi(x') / s + [c = c'])``,
  the authors' code form (classification; ``docs/fmgp.md`` derives it);
* :func:`median_heuristic`, the initial length scales.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from .._network.penultimate import PenultimateFeatures
from .gp import Kernel

__all__ = ["ClassificationKernel", "Kernel", "PenultimateFeatures", "RBF", "median_heuristic"]

_F64 = torch.float64

#: Rows read (at most) for the median heuristic and the feature scale.
HEURISTIC_ROWS = 1000


def median_heuristic(X):
    """Length scales by the median heuristic on standardised inputs.

    With ``s_d`` the standard deviation of feature ``d`` (1 for a constant feature)
    and ``u = x / s`` the standardised inputs, ``l0 = sqrt(median ||u_i - u_j||^2 / 2)``
    over the pairs of *distinct* rows (1 when all rows coincide), and the ARD length
    scales are ``l_d = l0 s_d``: the heuristic in standardised units, mapped back to
    the raw inputs. Never zero, never NaN.

    Parameters
    ----------
    X : array-like of shape (n, n_features)
        A sample of the inputs (at most :data:`HEURISTIC_ROWS` rows are used).

    Returns
    -------
    ndarray of shape (n_features,)
        Positive length scales.

    Examples
    --------
    >>> import numpy as np
    >>> from sklearn_lla.kernels import median_heuristic
    >>> X = np.array([[0.0, 5.0], [1.0, 5.0], [3.0, 5.0]])
    >>> median_heuristic(X).round(4)
    array([1.4142, 1.1339])
    """
    X = np.asarray(X, dtype=np.float64)
    if X.ndim != 2:
        X = X.reshape(len(X), -1)
    X = X[:HEURISTIC_ROWS]
    if len(X) < 2:
        return np.ones(X.shape[1])
    sd = X.std(axis=0)
    sd = np.where(sd > 0, sd, 1.0)
    U = (X - X.mean(axis=0)) / sd
    sq = (U * U).sum(1)
    d2 = sq[:, None] + sq[None, :] - 2.0 * U @ U.T
    iu = np.triu_indices(len(U), k=1)
    d2 = d2[iu]
    # distinct pairs only; the Gram formula leaves ~1e-15 on duplicates
    d2 = d2[d2 > 1e-12 * max(1.0, float(sq.max(initial=0.0)))]
    l0 = math.sqrt(float(np.median(d2)) / 2.0) if len(d2) else 1.0
    return l0 * sd


def _positive(value, name, shape=None):
    arr = np.asarray(value, dtype=np.float64)
    if not np.all(np.isfinite(arr)) or np.any(arr <= 0):
        raise ValueError(f"{name} must be positive and finite, got {value!r}")
    if shape is not None and arr.ndim == 1 and arr.shape != shape:
        raise ValueError(f"{name} has {arr.shape[0]} entries but the inputs have "
                         f"{shape[0]} features")
    return arr


class _ScaledDistance:
    """Squared ARD distances ``sum_d (x_d - z_d)^2 / l_d^2`` (float64).

    Inputs are centred at the training mean first (distances are unchanged; the
    Gram-matrix formula loses less to cancellation), then divided by the length
    scales.
    """

    def __init__(self, log_ls, center):
        self.log_ls = log_ls
        self.center = center

    def scale(self, x):
        return (x.to(_F64).reshape(len(x), -1) - self.center) * torch.exp(-self.log_ls)

    @staticmethod
    def sq(a, b):
        d2 = (a * a).sum(-1)[:, None] + (b * b).sum(-1)[None, :] - 2.0 * a @ b.T
        return d2.clamp_min(0.0)


class RBF(Kernel):
    """Squared-exponential kernel with ARD length scales: ``a exp(-r^2 / 2) [c = c']``.

    ``r^2 = sum_d (x_d - x'_d)^2 / l_d^2``. Each output is an independent GP with the
    same kernel (``[c = c']``); the inducing pairs carry their output index.

    Parameters
    ----------
    length_scale : float, array-like of shape (n_features,) or None, default=None
        ``l_d``. ``None``: the median heuristic of :func:`median_heuristic` on a sample
        of the training inputs (per feature, in the inputs' own units, so raw and
        standardised inputs give the same kernel).
    amplitude : float or None, default=None
        ``a``, the prior variance of each output. ``None``: the variance of the
        training targets (regression, averaged over targets), 1 for classification.
    learn_length_scale : bool, default=True
        Learn ``log l_d`` (else keep the initial values).
    learn_amplitude : bool, default=True
        Learn ``log a``.

    Attributes
    ----------
    length_scale_ : ndarray of shape (n_features,)
        Current length scales (after ``initialize``).
    amplitude_ : float
        Current amplitude.

    Examples
    --------
    >>> import torch
    >>> from sklearn_lla.kernels import RBF
    >>> k = RBF(length_scale=1.0, amplitude=2.0).initialize(
    ...     torch.zeros(5, 2, dtype=torch.float64), None, n_outputs=1,
    ...     task="regression", net=None)
    >>> z = torch.tensor([[0.0, 0.0], [1.0, 0.0]], dtype=torch.float64)
    >>> k.gram(z, torch.zeros(2, dtype=torch.long)).detach().numpy().round(4)
    array([[2.    , 1.2131],
           [1.2131, 2.    ]])
    """

    def __init__(self, length_scale=None, amplitude=None, *, learn_length_scale=True,
                 learn_amplitude=True):
        self.length_scale = length_scale
        self.amplitude = amplitude
        self.learn_length_scale = learn_length_scale
        self.learn_amplitude = learn_amplitude

    def _init_rbf(self, X, default_amplitude):
        X = X.detach().to(_F64).reshape(len(X), -1)
        D = X.shape[1]
        if self.length_scale is None:
            ls = median_heuristic(X.cpu().numpy())
        else:
            ls = np.broadcast_to(_positive(self.length_scale, "length_scale", (D,)), (D,))
        amp = default_amplitude if self.amplitude is None else float(
            _positive(self.amplitude, "amplitude"))
        dev = X.device
        self.log_length_scale = torch.tensor(np.log(ls), dtype=_F64, device=dev,
                                             requires_grad=bool(self.learn_length_scale))
        self.log_amplitude = torch.tensor(math.log(amp), dtype=_F64, device=dev,
                                          requires_grad=bool(self.learn_amplitude))
        center = X.mean(0) if len(X) else torch.zeros(D, dtype=_F64, device=dev)
        self._dist = _ScaledDistance(self.log_length_scale, center)

    def initialize(self, X, y, *, n_outputs, task, net):
        """Set the length scales and amplitude from a sample of the training data.

        Parameters
        ----------
        X : Tensor of shape (n, n_features)
            A sample of the training inputs.
        y : Tensor or None
            Their targets (the regression amplitude's initial value is their
            variance).
        n_outputs : int
            ``C``.
        task : {"regression", "classification"}
            The task.
        net : LinearizedNet or None
            Unused.

        Returns
        -------
        self : RBF
            The initialised kernel.
        """
        amp = 1.0
        if task == "regression" and y is not None and len(y) > 1:
            v = float(y.double().reshape(len(y), -1).var(0).mean())
            amp = v if math.isfinite(v) and v > 0 else 1.0
        self._init_rbf(X, amp)
        self.n_outputs = int(n_outputs)
        return self

    def parameters(self):
        """Return the trainable tensors: ``log l`` and ``log a`` (those learned).

        Returns
        -------
        list of Tensor
            The learned leaves (``requires_grad=True`` until fitting ends).
        """
        return ([self.log_length_scale] if self.learn_length_scale else []) + (
            [self.log_amplitude] if self.learn_amplitude else [])

    @property
    def prior_variance(self):
        """The amplitude ``a``."""
        return float(torch.exp(self.log_amplitude.detach()))

    @property
    def length_scale_(self):
        """The current length scales ``l_d`` (ndarray)."""
        return torch.exp(self.log_length_scale.detach()).cpu().numpy()

    @property
    def amplitude_(self):
        """The current amplitude ``a`` (float)."""
        return self.prior_variance

    def _k(self, a, b):
        """``a exp(-r^2 / 2)`` between scaled rows."""
        return torch.exp(self.log_amplitude - 0.5 * _ScaledDistance.sq(a, b))

    def _onehot(self, cz):
        return (torch.arange(self.n_outputs, device=cz.device)[:, None] == cz[None, :]).to(_F64)

    def gram(self, z, cz):
        """Compute the kernel matrix of the inducing pairs.

        Parameters
        ----------
        z : Tensor of shape (M, n_features)
            Inducing inputs.
        cz : Tensor of shape (M,)
            Output index of each inducing input.

        Returns
        -------
        Tensor of shape (M, M)
            ``a exp(-r^2 / 2) [cz_i = cz_j]``.
        """
        zs = self._dist.scale(z)
        return self._k(zs, zs) * (cz[:, None] == cz[None, :]).to(_F64)

    def cross(self, x, z, cz):
        """Compute the covariances of every output of every point with the inducing pairs.

        Parameters
        ----------
        x : Tensor of shape (B, n_features)
            Query points.
        z : Tensor of shape (M, n_features)
            Inducing inputs.
        cz : Tensor of shape (M,)
            Their output indices.

        Returns
        -------
        Tensor of shape (B, C, M)
            ``a exp(-r^2 / 2) [c = cz_m]``.
        """
        k = self._k(self._dist.scale(x), self._dist.scale(z))
        return k[:, None, :] * self._onehot(cz)[None]

    def diag_blocks(self, x):
        """Compute the prior covariance between the outputs of each point: ``a I``.

        Parameters
        ----------
        x : Tensor of shape (B, n_features)
            Query points.

        Returns
        -------
        Tensor of shape (B, C, C)
            ``a I_C`` per point.
        """
        eye = torch.eye(self.n_outputs, dtype=_F64, device=self.log_amplitude.device)
        return (torch.exp(self.log_amplitude) * eye).expand(len(x), -1, -1).clone()

    def predictor(self, z, cz, W):
        """Build the prediction function, with the scaled ``Z`` and ``W`` per output folded.

        Parameters
        ----------
        z : Tensor of shape (M, n_features)
            Fitted inducing inputs.
        cz : Tensor of shape (M,)
            Their output indices.
        W : Tensor of shape (M, M)
            The fitted factor with ``A = W^T W``.

        Returns
        -------
        callable
            ``predict(x) -> (Kxx blocks (B, C, C), Kxz W^T (B, C, M))``; thread-safe.
        """
        with torch.no_grad():
            center = self._dist.center.detach()
            inv_ls = torch.exp(-self.log_length_scale.detach())
            zs = self._dist.scale(z.detach())
            zsT, zsq = zs.T.contiguous(), (zs * zs).sum(-1)[None, :]
            log_amp = float(self.log_amplitude.detach())
            # Kxz W^T = sum_m k(x, z_m) [c = cz_m] W^T[m, :]: one (B, M) x (M, C M) product
            Wc = self._onehot(cz)[:, :, None] * W.detach().T[None]  # (C, M, M)
            Wc = Wc.permute(1, 0, 2).reshape(len(cz), -1)  # (M, C M)
            C = self.n_outputs
            block = math.exp(log_amp) * torch.eye(C, dtype=_F64, device=zs.device)

        def predict(x):
            with torch.no_grad():
                xs = (x.to(_F64).reshape(len(x), -1) - center).mul_(inv_ls)
                d2 = torch.addmm(zsq, xs, zsT, alpha=-2.0).add_((xs * xs).sum(-1, keepdim=True))
                k = d2.clamp_min_(0.0).mul_(-0.5).add_(log_amp).exp_()
                return block.expand(len(x), C, C), (k @ Wc).reshape(len(x), C, -1)

        return predict

    def __repr__(self):
        return (f"RBF(length_scale={self.length_scale!r}, amplitude={self.amplitude!r}, "
                f"learn_length_scale={self.learn_length_scale}, "
                f"learn_amplitude={self.learn_amplitude})")


class ClassificationKernel(RBF):
    """The FMGP classification kernel ``a B_cc' RBF(x, x') (psi(x)^T psi(x') / s + [c = c'])``.

    The authors' code form (BayesiPy's ``RBFxNTK``): the last-layer neural tangent
    kernel of the network, ``psi(x)^T psi(x') + [c = c']`` (weights and bias of its
    linear head), with output covariance ``B = L_B L_B^T`` (C x C, ``L_B`` lower
    triangular, initialised to ``I``) and localised by the unit-amplitude ARD squared
    exponential ``RBF`` on the inputs (median heuristic). ``psi`` are the network's
    penultimate features (see :class:`PenultimateFeatures`) and ``s`` their mean
    squared norm on the training data, so that the linear part is of order one (the
    authors have ``s = 1``). Learned: ``a``, the length scales and ``L_B``.
    ``docs/fmgp.md`` derives the kernel and why the bias term is ``[c = c']``, not the
    thesis text's ``[x = x']``.

    Inducing points. The kernel is one on pairs ``u = (x, psi)`` evaluated at
    ``(x, psi(x))``. With ``inducing_features="free"`` (the authors' code for image
    nets) each inducing point is such a pair with its own learned ``psi_m``, started
    at ``psi(z_m)`` (:meth:`lift_inducing`): the fit then needs no network pass at
    the inducing points, only at the training rows (whose ``psi`` FMGP computes
    once). ``"network"`` ties ``psi_m = psi(z_m)`` and differentiates the network at
    ``Z`` on every step (a forward and a backward pass of ``M`` inputs). The methods'
    ``z`` arguments take either form: rows ``[z_m, psi_m]`` (``n_features + F``
    columns) or plain inputs (``n_features`` columns, ``psi`` from the network).

    Parameters
    ----------
    length_scale : float, array-like of shape (n_features,) or None, default=None
        ``l_d``; ``None``: the median heuristic.
    amplitude : float or None, default=None
        ``a``; ``None``: 1.
    penultimate_layer : str or None, default=None
        Name of the module whose output is ``psi(x)``; ``None``: the input of the
        network's last ``nn.Linear`` (see :class:`PenultimateFeatures`).
    delta : {"class", "input"}, default="class"
        The second term: ``"class"``, ``[c = c']`` (the head's bias, the authors'
        code); ``"input"``, ``[x = x']`` (the thesis text: white noise on identical
        inputs, which no inducing point can explain; measured better only on breast
        cancer, see ``docs/fmgp.md``).
    inducing_features : {"free", "network"}, default="free"
        ``psi`` of the inducing points: ``"free"``, a learned ``(M, F)`` parameter
        started at ``psi(Z)`` (the inducing parameters are then ``(M, D + F)`` rows
        ``[z_m, psi_m]``); ``"network"``, ``psi(z_m)`` recomputed by the network at
        every step (see above; ``docs/fmgp.md`` compares them).
    learn_length_scale : bool, default=True
        Learn ``log l_d``.
    learn_amplitude : bool, default=True
        Learn ``log a``.

    Attributes
    ----------
    length_scale_ : ndarray of shape (n_features,)
        Current length scales.
    amplitude_ : float
        Current amplitude.
    B_ : ndarray of shape (C, C)
        Current output covariance ``L_B L_B^T``.
    features_ : PenultimateFeatures
        The feature map.

    Examples
    --------
    >>> import torch
    >>> from torch import nn
    >>> from sklearn_lla._network.linearized import LinearizedNet
    >>> from sklearn_lla.kernels import ClassificationKernel
    >>> module = nn.Sequential(nn.Linear(2, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    >>> X = torch.randn(20, 2, dtype=torch.float64)
    >>> k = ClassificationKernel().initialize(
    ...     X, None, n_outputs=3, task="classification",
    ...     net=LinearizedNet(module, example_input=X))
    >>> k.cross(X[:4], X[:5], torch.tensor([0, 1, 2, 0, 1])).shape
    torch.Size([4, 3, 5])
    """

    def __init__(self, length_scale=None, amplitude=None, *, penultimate_layer=None,
                 delta="class", inducing_features="free", learn_length_scale=True,
                 learn_amplitude=True):
        super().__init__(length_scale, amplitude, learn_length_scale=learn_length_scale,
                         learn_amplitude=learn_amplitude)
        self.penultimate_layer = penultimate_layer
        self.delta = delta
        self.inducing_features = inducing_features

    def initialize(self, X, y, *, n_outputs, task, net):
        """Set the hyperparameters and the feature map from a sample of the training data.

        Parameters
        ----------
        X : Tensor of shape (n, n_features)
            A sample of the training inputs.
        y : Tensor or None
            Their labels (unused).
        n_outputs : int
            ``C``.
        task : {"regression", "classification"}
            The task.
        net : LinearizedNet
            The frozen network whose penultimate features are used.

        Returns
        -------
        self : ClassificationKernel
            The initialised kernel.
        """
        if net is None:
            raise ValueError("ClassificationKernel needs the network (net=...)")
        if self.delta not in ("class", "input"):
            raise ValueError(f"delta must be 'class' or 'input', got {self.delta!r}")
        if self.inducing_features not in ("free", "network"):
            raise ValueError("inducing_features must be 'free' or 'network', got "
                             f"{self.inducing_features!r}")
        self._init_rbf(X, 1.0)
        self.n_inputs = int(X.reshape(len(X), -1).shape[1])
        self.n_outputs = int(n_outputs)
        self.features_ = PenultimateFeatures(net, self.penultimate_layer, X[:8])
        with torch.no_grad():
            _, psi = self.features_(X.to(net.dtype))
            ms = float((psi.double() ** 2).sum(-1).mean()) if len(psi) else 1.0
        self.feature_scale = 1.0 / ms if math.isfinite(ms) and ms > 0 else 1.0
        C = self.n_outputs
        self.L_B = torch.eye(C, dtype=_F64, device=X.device, requires_grad=True)
        return self

    def parameters(self):
        """Return the trainable tensors: ``log l``, ``log a`` (those learned) and ``L_B``.

        Returns
        -------
        list of Tensor
            The learned leaves (``requires_grad=True`` until fitting ends).
        """
        return super().parameters() + [self.L_B]

    @property
    def B_(self):
        """The output covariance ``L_B L_B^T`` (ndarray)."""
        L = torch.tril(self.L_B.detach())
        return (L @ L.T).cpu().numpy()

    def _B(self):
        L = torch.tril(self.L_B)
        return L @ L.T

    def _psi(self, x):
        _, psi = self.features_(x)
        return psi.to(_F64)

    @property
    def _free(self):
        return getattr(self, "inducing_features", "network") == "free"

    def _inducing(self, z):
        """``(inputs, psi)`` of ``z``: rows ``[z_m, psi_m]`` (see :meth:`lift_inducing`)
        are split; plain inputs (``n_features`` columns) get ``psi`` from the network."""
        D = getattr(self, "n_inputs", None)
        if D is not None and z.ndim == 2 and z.shape[1] > D:
            return z[:, :D], z[:, D:].to(_F64)
        return z, self._psi(z)

    def lift_inducing(self, z):
        """The inducing parameters of inducing inputs ``z``: ``[z, psi(z)]`` when free.

        Parameters
        ----------
        z : Tensor of shape (M, n_features)
            Inducing inputs (the k-means centres at the start of a fit).

        Returns
        -------
        Tensor of shape (M, n_features + F) or (M, n_features)
            ``[z_m, psi(z_m)]`` in float64 with ``inducing_features="free"`` (one
            forward pass), else ``z``.
        """
        if not self._free:
            return z
        with torch.no_grad():
            zx = z.detach().to(_F64).reshape(len(z), -1)
            return torch.cat([zx, self._psi(z.detach().to(self.features_.net.dtype))], 1)

    @staticmethod
    def _same(x, z, d2):
        """``[x_b = z_m]`` (exact equality of the rows), found among near-zero distances."""
        eq = torch.zeros(d2.shape, dtype=_F64, device=d2.device)
        cand = torch.nonzero(d2.detach() <= 1e-10, as_tuple=False)
        if len(cand):
            xa = x.detach().to(_F64).reshape(len(x), -1)[cand[:, 0]]
            za = z.detach().to(_F64).reshape(len(z), -1)[cand[:, 1]]
            hit = (xa == za).all(-1)
            eq[cand[hit, 0], cand[hit, 1]] = 1.0
        return eq

    def _pairs(self, x, xs, psi_x, z, zs, psi_z, cx, cz, *, gram=False):
        """``a B[cx, cz] RBF(x, z) (psi_x^T psi_z / s + delta)``.

        ``gram``: ``cx`` (B,) is the index of each row of ``x`` and the result is (B, M);
        else ``cx`` (C,) lists every logit and the result is the cross block (B, C, M).
        """
        d2 = _ScaledDistance.sq(xs, zs)
        rbf = torch.exp(self.log_amplitude - 0.5 * d2)  # a RBF, (B, M)
        lin = self.feature_scale * (psi_x @ psi_z.T)  # (B, M)
        B = self._B()
        if gram:
            Bp = B[cx][:, cz]
            delta = (self._same(x, z, d2) if self.delta == "input"
                     else (cx[:, None] == cz[None, :]).to(_F64))
            return rbf * Bp * (lin + delta)
        Bp = B[:, cz]  # (C, M)
        if self.delta == "input":
            return (rbf * (lin + self._same(x, z, d2)))[:, None, :] * Bp[None]
        onehot = (cx[:, None] == cz[None, :]).to(_F64)  # (C, M)
        return rbf[:, None, :] * Bp[None] * (lin[:, None, :] + onehot[None])

    def gram(self, z, cz):
        """Compute the kernel matrix of the inducing pairs.

        Parameters
        ----------
        z : Tensor of shape (M, n_features)
            Inducing inputs.
        cz : Tensor of shape (M,)
            Their class indices.

        Returns
        -------
        Tensor of shape (M, M)
            ``a B[cz_i, cz_j] RBF(z_i, z_j) (psi_i^T psi_j / s + [cz_i = cz_j])``.
        """
        z, psi_z = self._inducing(z)
        zs = self._dist.scale(z)
        return self._pairs(z, zs, psi_z, z, zs, psi_z, cz, cz, gram=True)

    def cross(self, x, z, cz):
        """Compute the covariances of every logit of every point with the inducing pairs.

        Parameters
        ----------
        x : Tensor of shape (B, n_features)
            Query points.
        z : Tensor of shape (M, n_features)
            Inducing inputs.
        cz : Tensor of shape (M,)
            Their class indices.

        Returns
        -------
        Tensor of shape (B, C, M)
            ``a B[c, cz_m] RBF(x_b, z_m) (psi_b^T psi_m / s + [c = cz_m])``.
        """
        z, psi_z = self._inducing(z)
        return self._cross(x, self._psi(x), self._dist.scale(z), z, psi_z, cz)

    def _cross(self, x, psi_x, zs, z, psi_z, cz):
        classes = torch.arange(self.n_outputs, device=cz.device)
        return self._pairs(x, self._dist.scale(x), psi_x.to(_F64), z, zs, psi_z, classes, cz)

    def diag_blocks(self, x):
        """Compute the prior covariance between the logits of each point.

        Parameters
        ----------
        x : Tensor of shape (B, n_features)
            Query points.

        Returns
        -------
        Tensor of shape (B, C, C)
            ``a B (|psi(x)|^2 / s + I)`` (elementwise product with ``B``) per point.
        """
        return self._diag(self._psi(x))

    def _diag(self, psi):
        lin = self.feature_scale * (psi * psi).sum(-1)  # (B,)
        B = self._B()
        C = B.shape[0]
        delta = (torch.ones((C, C), dtype=_F64, device=B.device) if self.delta == "input"
                 else torch.eye(C, dtype=_F64, device=B.device))
        return torch.exp(self.log_amplitude) * B[None] * (lin[:, None, None] + delta[None])

    def cross_and_diag(self, x, z, cz):
        """Return :meth:`cross` and :meth:`diag_blocks` from one evaluation of ``psi(x)``.

        Parameters
        ----------
        x : Tensor of shape (B, n_features)
            Query points.
        z : Tensor of shape (M, n_features)
            Inducing inputs.
        cz : Tensor of shape (M,)
            Their class indices.

        Returns
        -------
        Kxz : Tensor of shape (B, C, M)
            ``cross(x, z, cz)``.
        Kxx : Tensor of shape (B, C, C)
            ``diag_blocks(x)``.
        """
        z, psi_z = self._inducing(z)
        psi_x = self._psi(x)
        return self._cross(x, psi_x, self._dist.scale(z), z, psi_z, cz), self._diag(psi_x)

    def batch(self, x, z, cz):
        """Return :meth:`gram`, :meth:`cross` and :meth:`diag_blocks` with one ``psi`` pass each.

        Parameters
        ----------
        x : Tensor of shape (B, n_features)
            The minibatch's inputs.
        z : Tensor of shape (M, n_features)
            Inducing inputs.
        cz : Tensor of shape (M,)
            Their class indices.

        Returns
        -------
        Kzz : Tensor of shape (M, M)
            ``gram(z, cz)``.
        Kxz : Tensor of shape (B, C, M)
            ``cross(x, z, cz)``.
        Kxx : Tensor of shape (B, C, C)
            ``diag_blocks(x)``.
        """
        z, psi_z = self._inducing(z)
        zs = self._dist.scale(z)
        Kzz = self._pairs(z, zs, psi_z, z, zs, psi_z, cz, cz, gram=True)
        psi_x = self._psi(x)  # last: the predictive mean of x then reuses this pass
        return Kzz, self._cross(x, psi_x, zs, z, psi_z, cz), self._diag(psi_x)

    def step_factors(self, x, z, cz):
        """The factors of one training step's covariances, for factored products.

        The cross covariances are ``K((x_b, c), (z_m, c_m)) = B[c, c_m] (R[b, m] +
        [c = c_m] Q[b, m])`` with ``Q = a RBF(x, z)`` and ``R = Q psi(x)^T psi(z) / s``
        (``delta="class"``); with ``delta="input"``, ``R = Q (psi^T psi / s + [x = z])``
        and no ``Q`` term. :mod:`sklearn_lla._posteriors.fmgp_cross` multiplies them
        without forming the (B, C, M) tensor. The same formulas as :meth:`batch`, in
        the same order (``psi(x)`` last).

        Parameters
        ----------
        x : Tensor of shape (B, n_features)
            The minibatch's inputs.
        z : Tensor of shape (M, n_features) or (M, n_features + F)
            Inducing inputs (or rows ``[z_m, psi_m]``, see :meth:`lift_inducing`).
        cz : Tensor of shape (M,)
            Their class indices.

        Returns
        -------
        Kzz : Tensor of shape (M, M)
            ``gram(z, cz)``.
        R : Tensor of shape (B, M)
            The factor every class shares.
        Q : Tensor of shape (B, M) or None
            The own-class factor (``None`` with ``delta="input"``).
        Bmat : Tensor of shape (C, C)
            The output covariance ``B``.
        psi_x : Tensor of shape (B, F)
            ``psi(x)`` in float64 (for :meth:`prior_blocks` / :meth:`prior_variances`).
        """
        z, psi_z = self._inducing(z)
        zs = self._dist.scale(z)
        Kzz = self._pairs(z, zs, psi_z, z, zs, psi_z, cz, cz, gram=True)
        psi_x = self._psi(x)
        xs = self._dist.scale(x)
        d2 = _ScaledDistance.sq(xs, zs)
        Q = torch.exp(self.log_amplitude - 0.5 * d2)  # a RBF, (B, M)
        lin = self.feature_scale * (psi_x @ psi_z.T)
        if self.delta == "input":
            R, Q = Q * (lin + self._same(x, z, d2)), None
        else:
            R = Q * lin
        return Kzz, R, Q, self._B(), psi_x

    def prior_blocks(self, psi):
        """Compute :meth:`diag_blocks` from the points' features.

        Parameters
        ----------
        psi : Tensor of shape (B, F)
            ``psi(x)`` of the points (as :meth:`step_factors` returns it).

        Returns
        -------
        Tensor of shape (B, C, C)
            The prior covariance blocks ``K((x_b, c), (x_b, c'))``.
        """
        return self._diag(psi)

    def prior_variances(self, psi):
        """Compute the diagonal of :meth:`prior_blocks`, ``a B_cc (|psi|^2 / s + 1)``.

        The same numbers as the blocks' diagonal, without forming the blocks.

        Parameters
        ----------
        psi : Tensor of shape (B, F)
            ``psi(x)`` of the points.

        Returns
        -------
        Tensor of shape (B, C)
            The prior variance of each point's latent outputs.
        """
        lin = self.feature_scale * (psi * psi).sum(-1)  # (B,)
        scaled = torch.exp(self.log_amplitude) * torch.diagonal(self._B())
        return scaled[None] * (lin[:, None] + 1.0)

    def predictor(self, z, cz, W):
        """Build the prediction function, with ``psi(Z)`` computed once.

        Parameters
        ----------
        z : Tensor of shape (M, n_features)
            Fitted inducing inputs.
        cz : Tensor of shape (M,)
            Their class indices.
        W : Tensor of shape (M, M)
            The fitted factor with ``A = W^T W``.

        Returns
        -------
        callable
            ``predict(x) -> (Kxx blocks (B, C, C), Kxz W^T (B, C, M))``; thread-safe.
        """
        with torch.no_grad():
            z, psi_z = self._inducing(z.detach())
            zs = self._dist.scale(z)
            psi_z = psi_z.detach()
            W = W.detach()

        def predict(x):
            with torch.no_grad():
                _, psi_x = self.features_(x)
                Kxz = self._cross(x, psi_x, zs, z, psi_z, cz)
                return self._diag(psi_x.to(_F64)), Kxz @ W.T

        return predict

    def __repr__(self):
        return (f"ClassificationKernel(length_scale={self.length_scale!r}, "
                f"amplitude={self.amplitude!r}, penultimate_layer={self.penultimate_layer!r}, "
                f"delta={self.delta!r}, inducing_features={self.inducing_features!r})")
