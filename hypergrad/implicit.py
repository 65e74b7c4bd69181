r"""Exact hypergradients by the implicit function theorem."""

from __future__ import annotations

import warnings as _warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from hypergrad.autodiff import RootSystem, loss_and_grads, outer_fn
from hypergrad.errors import ConvergenceWarning
from hypergrad.linear import CG
from hypergrad.linear.base import LinearSolveResult, LinearSystem
from hypergrad.problem import BilevelProblem, HypergradInfo, HypergradResult
from hypergrad.tree import Tree, check_finite, tree_detach, tree_norm, tree_sub

__all__ = ["Implicit"]

LinearSolver = Callable[[LinearSystem, Tree | None], LinearSolveResult]


@dataclass(frozen=True)
class Implicit:
    r"""Implicit differentiation at an (approximate) inner solution.

    With the optimality condition :math:`F(w, \lambda) = 0` (by default
    :math:`F = \nabla_w g`; with ``fixed_point=T``, :math:`F = w - T(w, \lambda)`), the
    hypergradient is

    .. math::
        \nabla F(\lambda) = \nabla_\lambda f - (\partial_\lambda F)^\top u, \qquad
        (\partial_w F)^\top u = \nabla_w f.

    In gradient form :math:`\partial_w F` is the Hessian :math:`\nabla^2_{ww} g` and
    :math:`(\partial_\lambda F)^\top u = \nabla^2_{\lambda w} g\, u`. Products use a graph of
    ``F`` built once and retained (one backward pass each); no Hessian is formed except by
    :class:`~hypergrad.linear.Dense`.

    Cost: one gradient with graph, one outer gradient, one product per solver iteration, one mixed
    product. Exact when ``w`` solves the inner problem; the error is first order in the inner
    residual otherwise (reported in ``info.extra["inner_residual"]``).

    Args:
        solver: a linear solver from :mod:`hypergrad.linear` (default ``CG(tol=1e-6)``).
        fixed_point: optional map ``T(w, lam, batch) -> w`` whose fixed point is the inner
            solution; the system is then non-symmetric (use ``NormalCG``, ``Dense`` or ``Neumann``).
        products: ``"reverse"`` (retained graph, fastest measured) or ``"forward"``
            (``torch.func`` jvp over grad, recomputed each product).
        warm_start: reuse the previous solve's ``u`` (passed through ``state``) as ``x0``.
        compile: solve with the CG iterations and their Hessian-vector products compiled by
            :func:`torch.compile` (:mod:`hypergrad.compiled`); needs ``solver`` to be a
            :class:`~hypergrad.linear.CG` and the gradient form (``fixed_point=None``). Compiled
            once per problem shape (seconds to a minute), then reused; falls back to the eager
            solver, with a log line, where compilation fails. ``info.extra["compiled"]`` says
            which path ran. Off by default: it wins only where per-product overhead dominates
            (small problems, long outer loops), see :doc:`/methods/implicit`.

    Example:
        >>> import torch, hypergrad as hg
        >>> g = lambda w, lam, b: 0.5 * ((w["x"] - lam["c"]) ** 2).sum()
        >>> f = lambda w, lam, b: 0.5 * (w["x"] ** 2).sum()
        >>> lam = {"c": torch.tensor([1.0, 2.0], dtype=torch.float64)}
        >>> r = hg.Implicit(hg.linear.Dense()).hypergrad(hg.BilevelProblem(g, f), {"x": lam["c"].clone()}, lam)
        >>> r.grad["c"].tolist()   # w* = c, so dF/dc = c
        [1.0, 2.0]
    """

    solver: LinearSolver = field(default_factory=lambda: CG(tol=1e-6))
    fixed_point: Callable[[Tree, Tree, Any], Tree] | None = None
    products: str = "reverse"
    warm_start: bool = False
    compile: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.compile, bool):
            raise TypeError(f"compile must be a bool, got {type(self.compile).__name__}")
        if self.compile and (
            not isinstance(self.solver, CG) or self.fixed_point is not None
            or self.solver.preconditioner is not None
        ):
            raise ValueError(
                "compile=True needs solver=hypergrad.linear.CG(...) without a preconditioner and the gradient form "
                f"(fixed_point=None), got solver={self.solver!r}, fixed_point={self.fixed_point!r}"
            )
        if not callable(self.solver):
            raise TypeError(f"solver must be a linear solver from hypergrad.linear, got {self.solver!r}")
        if self.products not in ("reverse", "forward"):
            raise ValueError(f"products must be 'reverse' or 'forward', got {self.products!r}")

    def hypergrad(
        self,
        problem: BilevelProblem,
        w: Tree,
        lam: Tree,
        inner_batch: Any = None,
        outer_batch: Any = None,
        state: dict[str, Any] | None = None,
    ) -> HypergradResult:
        """Return the implicit hypergradient at ``(w, lam)``; ``w`` is returned unchanged."""
        w, lam = problem.validate(w, lam)
        _, grad_w_f, grad_lam_f = loss_and_grads(outer_fn(problem, outer_batch), w, lam, what="outer loss")
        assert grad_w_f is not None and grad_lam_f is not None
        root = RootSystem(problem, w, lam, inner_batch, self.fixed_point, self.products)
        system = LinearSystem(
            matvec=root.rmatvec,
            rhs=grad_w_f,
            rmatvec=root.matvec,
            symmetric=root.symmetric,
            dense=root.dense_rmatrix,
            flat_matvec=root.rmatvec_flat,
        )
        x0 = state.get("u") if (self.warm_start and state) else None
        compiled = False
        if self.compile:
            from hypergrad.compiled import compiled_cg

            assert isinstance(self.solver, CG)
            solve, compiled = compiled_cg(problem, w, lam, inner_batch, system, self.solver, x0)
        else:
            solve = self.solver(system, x0)
        for message in solve.warnings:
            _warnings.warn(message, ConvergenceWarning, stacklevel=2)
        check_finite(solve.solution, "implicit linear solve")
        mixed = root.rmatvec_lam(solve.solution)
        grad = tree_sub(grad_lam_f, mixed)
        check_finite(grad, "Implicit hypergradient")
        info = HypergradInfo(
            iterations=solve.iterations,
            residual=solve.residual,
            converged=solve.converged,
            warnings=list(solve.warnings),
            grad_evals=3 + solve.matvecs,
            extra={"inner_residual": float(tree_norm(root.residual)), "matvecs": solve.matvecs,
                   "compiled": compiled},
        )
        new_state = {"u": tree_detach(solve.solution)} if self.warm_start else None
        return HypergradResult(tree_detach(grad), tree_detach(w), info, new_state)
