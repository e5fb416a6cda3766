"""Sampled LLA's E-step: the linear systems' right-hand sides (the perturbation pass)
and their solvers, conjugate gradients with a Nystrom preconditioner or minibatch
Adam (:class:`ESteps`, a mixin of
:class:`~sklearn_lla._posteriors.sampled.SampledLLAPosterior`; see that module)."""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
from sklearn.exceptions import ConvergenceWarning

from .._core.krylov import NystromPreconditioner, block_cg, nystrom_preconditioner
from .._core.optim import minibatches, minimize
from .._network.linearized import stack_flat
from ._sampled_passes import BatchRows, _ggn_product_sums, products, scaled_tangents

__all__ = ["ESteps", "AUTO_ITERATIONS", "AUTO_PRECONDITIONER_RANK", "CG_MAX_BATCHES"]

_F64 = torch.float64

#: Steps between the checks of the windowed objective when ``early_stopping``.
_CHECK_FREQ = 50

#: ``max_iter="auto"``: conjugate-gradient iterations (full data passes) / Adam steps
#: per E-step. CG stops at its tolerance, well before its cap on the bundled data sets
#: (``docs/sampled.md``): the cap only bounds a pathological run. Adam runs all of
#: its steps.
AUTO_ITERATIONS = {"cg": 1000, "adam": 300}

#: ``preconditioner_rank="auto"``: the Nystrom sketch's rank in units of the number
#: of columns ``K + 1`` solved (the sketch costs this many conjugate-gradient
#: iterations; measured in ``docs/sampled.md``): room for the columns' starts and
#: right-hand sides in its test matrix (the Galerkin start,
#: :meth:`~sklearn_lla._core.krylov.NystromPreconditioner.galerkin`).
AUTO_PRECONDITIONER_RANK = 2

#: Largest number of batches in a full data pass for which ``solver="auto"`` uses
#: conjugate gradients (one pass per iteration) rather than minibatch Adam. With the
#: Nystrom preconditioner CG needs a few passes (5 on 8,192 Airline rows) where a
#: default Adam E-step costs 300 minibatches: about the break-even at 32 batches of
#: 256 rows (``docs/sampled.md``).
CG_MAX_BATCHES = 32


@dataclass
class _EStepState:
    """What the E-steps of one ``fit`` share (warm starts between them).

    Attributes
    ----------
    theta_hat : Tensor (P,)
        The network's parameters.
    with_mode : bool
        Whether the linear model's mode is solved for too (regression, EM).
    eps0 : Tensor (K, P)
        The prior draws ``eps_0`` (whitened).
    S : Tensor (K, P)
        ``sum_n J_n^T A_n eps_n``, the data part of the samples' targets.
    q : Tensor (P,) or None
        The mode's data vector (:meth:`SampledLLAPosterior._perturbation_pass`).
    Z : Tensor (K, P)
        The current samples ``zeta_k``.
    delta : Tensor (P,)
        The mode's offset ``theta_bar - theta_hat``.
    sigma : Tensor (P,)
        The prior std ``s0 s`` of the current samples.
    precond : NystromPreconditioner or None
        Conjugate gradients' sketch of ``sigma G sigma``, made once per fit.
    precond_ref : tuple or None
        ``(sigma, 1 / s2)`` (``1`` for classification) the sketch was made at.
    q_solved : Tensor (k,) or None
        ``z_k^T G z_k`` of the samples the last conjugate-gradient E-step solved, from
        its residual (``None`` after an Adam E-step).
    rows : BatchRows or None
        The training batches' Jacobian rows, kept for this fit's full data passes
        (:meth:`BatchRows.for_fit`; ``None``: the backend's products).
    """

    theta_hat: torch.Tensor
    with_mode: bool
    eps0: torch.Tensor | None = None
    S: torch.Tensor | None = None
    q: torch.Tensor | None = None
    Z: torch.Tensor | None = None
    delta: torch.Tensor | None = None
    sigma: torch.Tensor | None = None
    precond: NystromPreconditioner | None = None
    precond_ref: tuple | None = None
    q_solved: torch.Tensor | None = None
    rows: BatchRows | None = None


class _HandGradient(torch.autograd.Function):
    """``value``, with the gradient ``grad`` w.r.t. ``V`` (assembled by hand).

    The E-step objective is a quadratic (or, for the mode, a GLM) in ``V`` whose
    gradient is one VJP of hand-made output cotangents: building it by hand spares
    autograd's graph through the Jacobian products.
    """

    @staticmethod
    def forward(ctx, V, value, grad):
        ctx.save_for_backward(grad)
        return value.clone()

    @staticmethod
    def backward(ctx, grad_out):
        (grad,) = ctx.saved_tensors
        return grad_out * grad, None, None


class ESteps:
    """The E-step of :class:`~sklearn_lla._posteriors.sampled.SampledLLAPosterior`
    (a mixin: it reads the posterior's parameters, ``self.tol``, ``self.solver``,
    ``self.preconditioner``, ...): the perturbation pass, the solver's choice and
    conjugate gradients / Adam on the whitened systems."""

    def _perturbation_pass(self, st, data, lik):
        """``S = sum_n J_n^T A_n eps_n`` for K fresh ``eps_n ~ N(0, I)`` (K, P).

        With ``st.with_mode`` the same pass also returns the linear model's data
        vector ``q = sum_n J_n^T (Lam_n J_n theta_hat + d log p(y_n | g_n) / dg)``
        (the mode solves ``(sum_n J_n^T Lam_n J_n + A) theta_bar = q``); else ``None``.
        """
        lin, K, C = data.lin, self.n_posterior_samples, data.n_outputs
        M = K + 1 if st.with_mode else K
        S = torch.zeros((M, lin.n_params), dtype=_F64, device=data.device)
        gen = data.generator
        th = st.theta_hat[None]
        ops = products(lin, st.rows)
        for i, (x, y) in enumerate(data.batches()):
            eps = torch.randn((x.shape[0], K, C), dtype=_F64, generator=gen).to(data.device)
            if st.with_mode:
                g, jt = ops.jvp(i, x, th)
                g, jt = g.to(_F64), jt.to(_F64)[..., 0]
            else:
                g = ops.output(i, x).to(_F64)
            A = lik.lam_factor(g)
            cot = torch.einsum("bcd,bkd->kbc", A, eps)
            if st.with_mode:
                m = torch.einsum("bcd,bd->bc", A, torch.einsum("bcd,bc->bd", A, jt))
                cot = torch.cat([cot, (m + lik.grad(g, y))[None]])
            S += ops.vjp(i, x, cot)
        return (S[:K], S[K]) if st.with_mode else (S, None)

    def _schedule(self):
        """``"auto"`` is ``"cosine"`` (see ``lr_schedule`` of
        :class:`~sklearn_lla._posteriors.sampled.SampledLLAPosterior`)."""
        return "cosine" if self.lr_schedule == "auto" else self.lr_schedule

    # ------------------------------------------------------------------ E-step
    def _solver(self, data):
        """``"auto"``: conjugate gradients when a full data pass is at most
        :data:`CG_MAX_BATCHES` batches, Adam on minibatches otherwise.

        The choice depends on the data's size only (never on its container): a dask
        array is summed per partition by :meth:`FitData.reduce`, so both solvers give
        it the numpy answer.
        """
        if self.solver != "auto":
            return self.solver
        small = -(-data.n_samples // data.batch_size) <= CG_MAX_BATCHES
        return "cg" if small else "adam"

    def _iterations(self, data):
        """``max_iter``, or for ``"auto"`` the solver's :data:`AUTO_ITERATIONS`."""
        if self.max_iter == "auto":
            return AUTO_ITERATIONS[self._solver(data)]
        return self.max_iter

    def _e_step(self, st, data, lik, sigma, desc, max_iter=None, k=None, final=False):
        """Solve for the first ``k`` samples (all by default) and the mode at prior std
        ``sigma``; updates ``st``.

        Warm start: the samples keep their prior-whitened coordinates ``u = z / sigma``
        (exact in the directions the data does not constrain, where ``u = eps_0`` for
        every ``sigma``); the mode keeps ``delta = theta_bar - theta_hat``. Samples past
        ``k`` keep their whitened coordinates too (a sample never solved stays at its
        start ``u = eps_0``).

        ``final``: the fit's last E-step. Nothing after it reads the perturbations
        (``eps_0``, ``S``) or the preconditioner's sketch: the right-hand sides are made
        in ``S``'s storage and the sketch's test matrix is let go once used (the
        memory of two (K, P) and two (P, r) float64 blocks during its solve).
        """
        max_iter = max_iter or self._iterations(data)
        k = self.n_posterior_samples if k is None else int(k)
        U = st.Z / st.sigma  # the start, in whitened coordinates
        st.Z = None  # (made again from U below: not held during the solve)
        if final:  # the samples' targets u_n = eps_0 + sigma S, in place in S
            B = st.S[:k].mul_(sigma).add_(st.eps0[:k])
            st.S = st.eps0 = None
        else:
            B = st.eps0[:k] + sigma * st.S[:k]  # the samples' targets u_n
        if self._solver(data) == "cg":
            out, U[:k] = self._cg_e_step(st, data, lik, sigma, desc, max_iter, U[:k], B,
                                         final=final)
        else:
            out, U[:k] = self._adam_e_step(st, data, lik, sigma, desc, max_iter, U[:k], B)
        st.Z = U.mul_(sigma)
        st.sigma = sigma
        return out

    def _partial_e_step(self, *args, **kwargs):
        """:meth:`_e_step` without its ConvergenceWarning; returns whether it was cut.

        EM's and the validation scan's E-steps are warm-started partial solves by
        design (the next one goes on from where this one stopped); only the final
        E-step, whose samples are kept, warns. Every other warning is passed on.
        """
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", ConvergenceWarning)
            self._e_step(*args, **kwargs)
        cut = False
        for w in caught:
            if issubclass(w.category, ConvergenceWarning):
                cut = True
            else:
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
        return cut

    @staticmethod
    def _ggn_times(st, data, lik, sigma, V):
        """``G (sigma V)`` (float64, (M, P)), one data pass.

        With kept rows (:class:`BatchRows`) the tangents ``sigma V`` go to the pass in
        the network's dtype (what its products round them to anyway, made a few rows at
        a time by :func:`scaled_tangents`): no float64 (M, P) copy of them is held.
        """
        dtype = data.lin.dtype if st.rows is not None else _F64
        (D,) = data.reduce(_ggn_product_sums,
                           (data.lin, lik, scaled_tangents(V, sigma, dtype), st.rows))
        return D

    def _preconditioner(self, st, data, lik, sigma, start, rhs):
        """``(preconditioner, products)``: the Nystrom preconditioner of ``I + sigma G
        sigma`` (``None`` when off) and, when made now, ``sigma G sigma start``.

        One sketch per fit (a data pass with ``r`` tangents, its own random stream),
        made at the first conjugate-gradient E-step and rescaled afterwards (a new
        prior or noise variance multiplies ``sigma G sigma`` by a scalar). That
        E-step's ``start`` (``eps_0``, and the mode's start) is in the test matrix
        (``include``): the sketch's pass gives CG's initial residual, one pass fewer;
        so are its right-hand sides ``rhs`` where the rank leaves room (``span``, the
        ``"auto"`` rank does), for the Galerkin start
        (:meth:`~sklearn_lla._core.krylov.NystromPreconditioner.galerkin`).
        """
        if self.preconditioner is None:
            return None, None
        curv = 1.0 / float(lik.noise_variance) if self._regression else 1.0
        products = None
        if st.precond is None:
            rank = self.preconditioner_rank
            if rank == "auto":
                rank = AUTO_PRECONDITIONER_RANK * (self.n_posterior_samples + 1)
            rank = min(int(rank), data.n_samples * data.n_outputs, st.theta_hat.numel())

            def matvec(V):
                return self._ggn_times(st, data, lik, sigma, V).mul_(sigma)

            gen = torch.Generator().manual_seed(int(data.generator.initial_seed()) ^ 0x5EED)
            n = st.theta_hat.numel()
            if start.shape[0] <= min(rank, n):
                span = rhs if start.shape[0] + rhs.shape[0] <= min(rank, n) else None
                st.precond, products = nystrom_preconditioner(
                    matvec, n, rank, gen, data.device, include=start, span=span)
            else:
                st.precond = nystrom_preconditioner(matvec, n, rank, gen, data.device)
            st.precond_ref = (sigma.clone(), curv)
        sigma_ref, curv_ref = st.precond_ref
        scale = float((sigma / sigma_ref).pow(2).mean()) * curv / curv_ref
        return st.precond.rescaled(scale), products

    def _cg_e_step(self, st, data, lik, sigma, desc, max_iter, X, B, final=False):
        """Conjugate gradients on ``(I + sigma G sigma) u = b``, all columns.

        ``G = sum_n J_n^T Lam_n J_n`` (one full data pass per iteration, all columns
        batched as tangents), in prior-whitened coordinates; ``b = eps_0 + sigma S`` for
        the samples and ``sigma q`` for the mode (see :meth:`_perturbation_pass`). A
        column is converged when its residual is below ``tol`` times its right-hand
        side (relative); the run ends when all are, or after ``max_iter`` iterations
        (a :class:`~sklearn.exceptions.ConvergenceWarning`). ``X`` (k, P) is the
        samples' whitened start and ``B`` their right-hand sides; returns the trace and
        the whitened samples ``u_1..u_k``, and sets the mode. ``final``: see
        :meth:`_e_step` (the sketch is let go after the Galerkin start).
        """
        if st.with_mode:
            B = torch.cat([(sigma * st.q)[None], B])
            X = torch.cat([((st.theta_hat + st.delta) / sigma)[None], X])

        def op(V):  # V + sigma G sigma V, in place in the product (same rounding)
            return self._ggn_times(st, data, lik, sigma, V).mul_(sigma).add_(V)

        precond, products = self._preconditioner(st, data, lik, sigma, X, B)
        R0 = None
        if products is not None:  # B - (X + A X); the products are not held by the solve
            R0 = B - (X + products)
            del products
        correction = None
        if precond is not None:
            def correction(X, R):
                X, R = precond.galerkin(X, R)
                if final:  # no later E-step starts from the sketch
                    precond.Q = precond.AQ = precond.core = None
                    st.precond = None
                return X, R
        bar = data.progress(max_iter, f"{self.name}: {desc}")

        def progress(it, rel):
            if bar is not None:
                bar.update(1)
                bar.set_postfix(residual=f"{rel:.2g}")

        try:
            X, it, rel, R = block_cg(op, B, X, self.tol, max_iter,
                                     None if precond is None else precond.apply, progress,
                                     start_residual=R0, start_correction=correction)
        except FloatingPointError as exc:
            raise FloatingPointError(f"{self.name}: {desc}: {exc}") from None
        finally:
            if bar is not None:
                bar.close()
        if rel > self.tol:
            warnings.warn(f"{self.name}: {desc}: conjugate gradients reached max_iter="
                          f"{max_iter} with a relative residual of {rel:.2g} > tol={self.tol:g}; "
                          "increase max_iter", ConvergenceWarning, stacklevel=4)
        if st.with_mode:
            st.delta = sigma * X[0] - st.theta_hat
            X, B, R = X[1:], B[1:], R[1:]
        # (I + sigma G sigma) u = b - r: z^T G z = u^T (b - r) - u^T u, no data pass
        st.q_solved = (X * (B - R)).sum(1) - (X * X).sum(1)
        self.n_iter.append(it)
        out = {"solver": "cg", "n_iter": it, "relative_residual": rel,
               "converged": rel <= self.tol}
        if precond is not None:
            out["preconditioner_rank"] = precond.rank
        return out, X

    def _adam_e_step(self, st, data, lik, sigma, desc, max_iter, U, U_n):
        """Minibatch Adam on the same objective (:func:`sklearn_lla._core.optim.minimize`)
        from the whitened start ``U`` towards the targets ``U_n``; returns the trace and
        the whitened samples ``u_1..u_k``, and sets the mode."""
        lin, N = data.lin, data.n_samples
        m = 1 if st.with_mode else 0
        w_hat = st.theta_hat / sigma
        cols = [U]
        if m:
            cols.insert(0, (st.delta / sigma)[None])
        V = torch.cat(cols).requires_grad_(True)
        M = V.shape[0]

        def loss_fn(batch):
            x, y = batch
            scale = N / x.shape[0]
            with torch.no_grad():
                g, jt = lin.jvp(x, V * sigma)
                g, jt = g.to(_F64), jt.to(_F64)
                A = lik.lam_factor(g)
                ajz = torch.einsum("bcd,bck->bdk", A, jt)  # A^T J z_k (and A^T J delta)
                r = V[m:] - U_n
                value = 0.5 * ajz[..., m:].pow(2).sum() * scale + 0.5 * r.pow(2).sum()
                cot = torch.einsum("bcd,bdk->kbc", A, ajz)  # Lam J z_k
                if m:
                    # the mode: the Gaussian linear model of the pseudo-targets (one Newton
                    # step of the likelihood at g; for a Gaussian likelihood its exact mode)
                    gl = lik.grad(g, y)
                    r0 = w_hat + V[0]
                    value = value + scale * (0.5 * ajz[..., 0].pow(2).sum()
                                             - (jt[..., 0] * gl).sum()) + 0.5 * r0.pow(2).sum()
                    cot[0] -= gl
                grad = stack_flat(lin.vjp(x, cot), lin.names).to(_F64).mul_(scale * sigma)
                grad[m:] += r
                if m:
                    grad[0] += r0
                value, grad = value / M, grad / M
            return _HandGradient.apply(V, value, grad)

        es = self.early_stopping
        res = minimize(loss_fn, [V], minibatches(data, data.batch_size, data.generator),
                       max_iter=max_iter, lr=self.learning_rate,
                       validation="loss" if es else None, validation_freq=_CHECK_FREQ,
                       early_stopping=es, n_iter_no_change=self.n_iter_no_change,
                       tol=self.tol, verbose=data.verbose, desc=f"{self.name}: {desc}",
                       lr_schedule=self._schedule())
        V = V.detach()
        st.q_solved = None
        if m:
            st.delta = (V[0] * sigma).clone()
        self.n_iter.append(res.n_iter)
        return {"solver": "adam", **res.as_dict()}, V[m:]

