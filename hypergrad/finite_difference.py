r"""First-order implicit hypergradients: second-order products by central differences."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from hypergrad.autodiff import inner_grads, loss_and_grads, outer_fn
from hypergrad.errors import ConvergenceWarning, check_not_class, report
from hypergrad.linear import CG
from hypergrad.linear.base import LinearSolveResult, LinearSystem
from hypergrad.problem import BilevelProblem, HypergradInfo, HypergradResult
from hypergrad.tree import (
    Tree,
    check_finite,
    tree_axpy,
    tree_detach,
    tree_norm,
    tree_scale,
    tree_sub,
    tree_zeros_like,
)

__all__ = ["FiniteDifference"]

LinearSolver = Callable[[LinearSystem, Tree | None], LinearSolveResult]


def _check_positive(value: object, name: str) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
    if not value > 0.0 or value == float("inf"):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return float(value)


@dataclass(frozen=True, kw_only=True)
class FiniteDifference:
    r"""Implicit hypergradient with every second-order product replaced by a central difference.

    The implicit function theorem gives

    .. math::
        \nabla F(\lambda) = \nabla_\lambda f - \nabla^2_{\lambda w} g\, v, \qquad
        \nabla^2_{ww} g\, v = \nabla_w f .

    Here both products are central differences of *first-order* gradients along a direction
    :math:`u`, with the step :math:`h = \varepsilon / \lVert u \rVert`:

    .. math::
        \nabla^2_{ww} g\, u \approx
            \frac{\nabla_w g(w + h u, \lambda) - \nabla_w g(w - h u, \lambda)}{2h}, \qquad
        \nabla^2_{\lambda w} g\, u \approx
            \frac{\nabla_\lambda g(w + h u, \lambda) - \nabla_\lambda g(w - h u, \lambda)}{2h}.

    **Step-size convention.** ``eps`` is the Euclidean length of the perturbation
    :math:`h u` in parameter space (DARTS uses ``0.01 / ||v||`` the same way), so it does not
    depend on the scale of ``u``. Each difference has truncation error
    :math:`\tfrac{\varepsilon^2}{6}\lVert u \rVert\, |D^3 g|` (relative error
    :math:`O(\varepsilon^2)`; exact for quadratic ``g``) and round-off error about
    :math:`\mathrm{u}_\text{mach} \lVert\nabla g\rVert \lVert u\rVert / \varepsilon`. In float64
    ``eps`` in ``[1e-4, 1e-2]`` is a good range; in float32 use ``eps ~ 1e-2``.

    Solvers:

    * a linear solver from :mod:`hypergrad.linear` (default ``CG(tol=1e-6)``) solves the system
      with finite-difference Hessian-vector products (``Dense`` materialises the matrix by ``n``
      of them). The finite-difference operator is exactly linear only for quadratic ``g``; do
      not ask CG for a tolerance below the :math:`O(\varepsilon^2)` error.
    * ``"identity"``: the DARTS approximation :math:`(\nabla^2_{ww} g)^{-1} \approx \xi I`, i.e.
      :math:`v = \xi \nabla_w f` with ``xi`` the inner learning rate (Liu et al., 2019). With
      ``virtual_step=True`` the outer gradients are taken at the DARTS look-ahead point
      :math:`w' = w - \xi \nabla_w g(w, \lambda)`, which makes the estimate the exact derivative
      (up to :math:`O(\varepsilon^2)`) of one unrolled SGD step.

    No double backward is ever taken: only first-order :func:`torch.autograd.grad` calls without
    ``create_graph``, so the losses may use operations that are differentiable only once.

    Cost in gradient evaluations (``info.grad_evals``): one outer gradient (``w`` and
    :math:`\lambda` in one backward) + two per solver product + two for the mixed product:
    ``3 + 2 * matvecs`` with a solver; 3 with ``"identity"`` (4 with ``virtual_step``).
    Like :class:`~hypergrad.Implicit`, the estimate assumes ``w`` solves the inner problem; its
    error is first order in the inner residual plus :math:`O(\varepsilon^2)`. ``info.converged``
    is the linear solver's outcome, None with ``"identity"`` (no solve, no stopping test).

    Args:
        eps: length of the finite-difference perturbation (> 0), see above.
        solver: a linear solver from :mod:`hypergrad.linear`, or ``"identity"``.
        xi: inner learning rate for ``solver="identity"`` (required there, rejected otherwise).
        virtual_step: with ``"identity"``, evaluate the outer gradients at the DARTS look-ahead
            point ``w - xi * grad_w g`` (one extra gradient).
        warm_start: reuse the previous solution ``v`` (passed through ``state``) as the initial
            guess of an iterative solver.

    Raises:
        ValueError: ``eps <= 0``, ``xi <= 0``, ``xi`` missing for ``"identity"`` or given with a
            solver, an unknown solver string.
        TypeError: non-numeric ``eps``/``xi`` or a non-callable ``solver``.

    Example:
        >>> import torch, hypergrad as hg
        >>> g = lambda w, lam, b: 0.5 * ((w["x"] - lam["c"]) ** 2).sum()
        >>> f = lambda w, lam, b: 0.5 * (w["x"] ** 2).sum()
        >>> lam = {"c": torch.tensor([1.0, 2.0], dtype=torch.float64)}
        >>> fd = hg.FiniteDifference(eps=1e-3, solver=hg.linear.CG(tol=1e-10))
        >>> r = fd.hypergrad(hg.BilevelProblem(g, f), {"x": lam["c"].clone()}, lam)
        >>> [round(x, 6) for x in r.grad["c"].tolist()]   # w* = c, so dF/dc = c
        [1.0, 2.0]
        >>> darts = hg.FiniteDifference(solver="identity", xi=1.0)   # H = I, so xi = 1 is exact
        >>> r = darts.hypergrad(hg.BilevelProblem(g, f), {"x": lam["c"].clone()}, lam)
        >>> [round(x, 6) for x in r.grad["c"].tolist()], r.info.grad_evals, r.info.converged
        ([1.0, 2.0], 3, None)
    """

    eps: float = 1e-3
    solver: LinearSolver | str = field(default_factory=lambda: CG(tol=1e-6))
    xi: float | None = None
    virtual_step: bool = False
    warm_start: bool = False

    def __post_init__(self) -> None:
        _check_positive(self.eps, "eps")
        if isinstance(self.solver, str):
            if self.solver != "identity":
                raise ValueError(
                    f"solver must be a linear solver from hypergrad.linear or 'identity', "
                    f"got {self.solver!r}"
                )
            if self.xi is None:
                raise ValueError("xi (the inner learning rate) is required with solver='identity'")
            _check_positive(self.xi, "xi")
        else:
            check_not_class(self.solver, "solver")
            if not callable(self.solver):
                raise TypeError(
                    f"solver must be a linear solver from hypergrad.linear or 'identity', "
                    f"got {self.solver!r}"
                )
            if self.xi is not None:
                raise ValueError("xi is only used with solver='identity'; leave it None")
            if self.virtual_step:
                raise ValueError("virtual_step is only used with solver='identity'")
        if not isinstance(self.virtual_step, bool):
            raise TypeError(f"virtual_step must be a bool, got {type(self.virtual_step).__name__}")

    def _central(self, problem: BilevelProblem, batch: Any, w: Tree, lam: Tree, u: Tree, wrt: str,
                 check_w: bool = False) -> Tree:
        """Central difference of ``grad_wrt g`` at ``w`` along ``u`` (two gradients); ``check_w``:
        refuse entries of ``w`` that ``g`` does not use although no ``w``-gradient is taken."""
        norm = float(tree_norm(u))
        if norm == 0.0:
            return tree_zeros_like(w if wrt == "w" else lam)
        h = self.eps / norm
        wrt_w, wrt_lam = wrt == "w", wrt == "lam"
        _, gw_p, gl_p = inner_grads(problem, batch, tree_axpy(h, u, w), lam, wrt_w=wrt_w, wrt_lam=wrt_lam,
                                    check_w=check_w)
        # checked (and warned) once, at the first point
        _, gw_m, gl_m = loss_and_grads(lambda w_, l_: problem.inner_loss(w_, l_, batch), tree_axpy(-h, u, w), lam,
                                       wrt_w=wrt_w, wrt_lam=wrt_lam, what="inner loss")
        plus, minus = (gw_p, gw_m) if wrt_w else (gl_p, gl_m)
        assert plus is not None and minus is not None
        return tree_scale(tree_sub(plus, minus), 1.0 / (2.0 * h))

    def hypergrad(
        self,
        problem: BilevelProblem,
        w: Tree,
        lam: Tree,
        inner_batch: Any = None,
        outer_batch: Any = None,
        state: dict[str, Any] | None = None,
    ) -> HypergradResult:
        """Return the finite-difference implicit hypergradient at ``(w, lam)``.

        ``w`` is returned unchanged (detached). ``state`` carries ``v`` when ``warm_start``.
        """
        w, lam = problem.validate(w, lam)
        w, lam = tree_detach(w), tree_detach(lam)
        grad_evals = 0
        checked_w = False  # whether a w-gradient of g was taken (it refuses entries of w that g does not use)
        w_outer = w
        if isinstance(self.solver, str) and self.virtual_step:
            assert self.xi is not None
            _, gw_g, _ = inner_grads(problem, inner_batch, w, lam)
            assert gw_g is not None
            checked_w = True
            w_outer = tree_axpy(-self.xi, gw_g, w)
            grad_evals += 1
        _, grad_w_f, grad_lam_f = loss_and_grads(
            outer_fn(problem, outer_batch), w_outer, lam, what="outer loss"
        )
        assert grad_w_f is not None and grad_lam_f is not None
        check_finite(grad_w_f, "outer gradient grad_w f")
        check_finite(grad_lam_f, "outer gradient grad_lam f")
        grad_evals += 1

        iterations, residual, matvecs = 0, None, 0
        converged: bool | None = None  # no linear solve, no stopping test
        messages: list[str] = []
        if isinstance(self.solver, str):
            assert self.xi is not None
            v = tree_scale(grad_w_f, self.xi)
        else:
            counter = [0]

            def hvp(u: Tree) -> Tree:
                counter[0] += 1
                return self._central(problem, inner_batch, w, lam, u, "w")

            system = LinearSystem(matvec=hvp, rhs=grad_w_f, symmetric=True)
            x0 = state.get("v") if (self.warm_start and state) else None
            solve = self.solver(system, x0)
            report(solve.warnings, ConvergenceWarning, repeated=solve.repeated_warnings, stacklevel=2)
            messages = list(solve.warnings)
            iterations, residual, converged = solve.iterations, solve.residual, solve.converged
            matvecs = counter[0]
            grad_evals += 2 * matvecs
            v = solve.solution
            check_finite(v, "FiniteDifference linear solve")
            checked_w = checked_w or counter[0] > 0
        mixed = self._central(problem, inner_batch, w, lam, v, "lam", check_w=not checked_w)
        if float(tree_norm(v)) > 0.0:
            grad_evals += 2
        grad = tree_sub(grad_lam_f, mixed)
        check_finite(grad, "FiniteDifference hypergradient")
        info = HypergradInfo(
            iterations=iterations,
            residual=residual,
            converged=converged,
            stopping_test=None if converged is None else "linear solve",
            warnings=messages,
            grad_evals=grad_evals,
            extra={"matvecs": matvecs, "eps": self.eps},
        )
        new_state = {"v": tree_detach(v)} if self.warm_start else None
        return HypergradResult(tree_detach(grad), w, info, new_state)
