r"""Newton's method for small smooth inner problems, safeguarded by damping and a line search.

Each step solves :math:`(\nabla^2_{ww} g + \mu I)\, d = -\nabla_w g` with a linear solver of
:mod:`hypergrad.linear` (the Hessian materialised and factored by
:class:`~hypergrad.linear.Dense`, or its products only, by :class:`~hypergrad.linear.CG`: a
truncated Newton-CG step), then moves along :math:`d` by a line search from the full step. Near a
strongly convex minimum the full step is taken and the damping is zero, so the iteration
converges quadratically (on the logistic problem of ``tests/test_newton.py`` the gradient norm
falls 2e-1, 5e-2, 3e-3, 1e-5, 2e-10, 6e-17 in six steps). Away from it, the two safeguards: a
Hessian that is not positive definite along the computed direction (it does not descend) raises
the damping :math:`\mu` (Levenberg-Marquardt) until it does, and the line search backs off a
step that does not decrease :math:`g` enough. The damping falls again by a factor of 10 after
every step that took the full step.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass
from typing import ClassVar

import torch

from hypergrad.line_search import strong_wolfe
from hypergrad.linear import Dense
from hypergrad.linear.base import LinearSolveResult, LinearSystem
from hypergrad.objective import InnerObjective
from hypergrad.tree import Tree, tree_dot

__all__ = ["Newton"]

LinearSolver = Callable[[LinearSystem, Tree | None], LinearSolveResult]
_LINE_SEARCHES = ("armijo", "strong_wolfe")


def _check_number(value: object, name: str, low: float, low_inclusive: bool) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or not (value >= low if low_inclusive else value > low):
        raise ValueError(f"{name} must be a finite number {'>=' if low_inclusive else '>'} {low}, got {value!r}")


@dataclass(frozen=True)
class Newton:
    r"""Damped Newton steps with a line search, for :func:`hypergrad.inner_solve` and ``solve``'s inner steps.

    Per step: the Hessian at ``w`` (one gradient with a graph), the direction
    :math:`d = -(\nabla^2 g + \mu I)^{-1} \nabla g` from ``solver``, and a line search along it
    from step ``lr`` (see the module docstring for the safeguards). A Newton step needs the loss
    itself, not only its gradient: use it where :func:`hypergrad.inner_solve` or
    :func:`hypergrad.solve` run the inner steps (they call :meth:`update_with_objective`);
    ``Unrolled``, ``Penalty``, ``BOME`` and ``AlternatingImplicit`` refuse it.

    Cost per step: with ``Dense``, :math:`n` Hessian-vector products in one batched backward pass
    and an :math:`O(n^3)` Cholesky factorisation (``n`` up to a few thousand); with ``CG``, one
    product per CG iteration. Plus the line search's evaluations (one when the full step is
    taken, as it is near the minimum).

    Args:
        lr: the first step of the line search (1: the Newton step).
        solver: the linear solver of the Newton system: ``hypergrad.linear.Dense()`` (default) or
            ``hypergrad.linear.CG(tol=..., maxiter=...)`` for inexact (truncated) Newton-CG
            steps; its ``damping`` is replaced by the current :math:`\mu`.
        damping: the smallest damping :math:`\mu` (>= 0); it rises from there only where the
            Hessian needs it.
        line_search: ``"armijo"`` (default: backtracking from ``lr`` for sufficient decrease),
            ``"strong_wolfe"`` (:func:`hypergrad.line_search.strong_wolfe`) or None (the step
            ``lr`` as it is).
        c1: the sufficient-decrease constant, in (0, 1).
        max_backtracks: halvings before the Armijo search takes the smallest step tried.

    Raises:
        ValueError: an argument out of range.
        TypeError: a ``solver`` without a ``damping`` option.

    Example:
        >>> import torch, hypergrad as hg
        >>> X = torch.tensor([[1.0, 2.0], [3.0, -1.0], [0.5, 0.5]], dtype=torch.float64)
        >>> y = torch.tensor([1.0, 0.0, 1.0], dtype=torch.float64)
        >>> bce = torch.nn.functional.binary_cross_entropy_with_logits
        >>> g = lambda w, lam, b: bce(X @ w["x"], y) + 0.5 * lam["l2"] * (w["x"] ** 2).sum()
        >>> problem, lam = hg.BilevelProblem(g, g), {"l2": torch.tensor(0.1, dtype=torch.float64)}
        >>> out = hg.inner_solve(problem, {"x": torch.zeros(2, dtype=torch.float64)}, lam, 20, hg.inner.Newton(),
        ...                      tol=1e-12)
        >>> out.converged, out.steps
        (True, 5)
    """

    needs_objective: ClassVar[bool] = True
    """Steps with :meth:`update_with_objective` only (the Hessian of the loss, not just its gradient)."""

    lr: float = 1.0
    _: KW_ONLY  # the options below are keyword-only
    solver: LinearSolver | None = None
    damping: float = 0.0
    line_search: str | None = "armijo"
    c1: float = 1e-4
    max_backtracks: int = 30

    def __post_init__(self) -> None:
        _check_number(self.lr, "lr", 0.0, low_inclusive=False)
        _check_number(self.damping, "damping", 0.0, low_inclusive=True)
        if not isinstance(self.c1, (int, float)) or not 0.0 < self.c1 < 1.0:
            raise ValueError(f"c1 must be in (0, 1), got {self.c1!r}")
        if not isinstance(self.max_backtracks, int) or isinstance(self.max_backtracks, bool) or self.max_backtracks < 1:
            raise ValueError(f"max_backtracks must be an int >= 1, got {self.max_backtracks!r}")
        if self.line_search is not None and self.line_search not in _LINE_SEARCHES:
            raise ValueError(f"line_search must be 'armijo', 'strong_wolfe' or None, got {self.line_search!r}")
        if isinstance(self.solver, type):
            raise TypeError(f"solver must be an instance, e.g. {self.solver.__name__}() with its options, not the "
                            f"class {self.solver.__name__} itself")
        if self.solver is not None and not (dataclasses.is_dataclass(self.solver) and any(
                f.name == "damping" for f in dataclasses.fields(self.solver))):
            raise TypeError("solver must be a linear solver with a damping option (hypergrad.linear.Dense() or CG()), "
                            f"got {self.solver!r}")

    def init(self, w: Tree) -> Tree:
        """The state: ``"t"`` (steps taken) and ``"damping"`` (the current :math:`\\mu`)."""
        ref = next(iter(w.values()))
        return {"t": torch.zeros((), dtype=ref.dtype, device=ref.device),
                "damping": torch.tensor(float(self.damping), dtype=ref.dtype, device=ref.device)}

    def update(self, w: Tree, grad: Tree, state: Tree) -> tuple[Tree, Tree]:
        """Not available: a Newton step needs the Hessian of the loss (see :meth:`update_with_objective`)."""
        raise TypeError("hypergrad.inner.Newton steps with the loss's Hessian: use it in hypergrad.inner_solve or as "
                        "solve's inner_optimizer (which call update_with_objective); a gradient alone is not enough")

    def update_with_objective(self, w: Tree, grad: Tree, state: Tree, objective: InnerObjective) -> tuple[Tree, Tree]:
        r"""One damped Newton step with a line search on ``objective`` (the step's inner loss).

        Args:
            w: the current parameters.
            grad: the gradient at ``w``.
            state: the optimizer state (:meth:`init`).
            objective: the step's inner loss (:class:`~hypergrad.objective.InnerObjective`).

        Returns:
            The new parameters and state.
        """
        slope0_scale = float(tree_dot(grad, grad))
        t = state["t"] + 1
        if slope0_scale == 0.0:
            return w, {"t": t, "damping": state["damping"]}
        root = objective.linearization(w)
        system = LinearSystem(matvec=root.rmatvec, rhs={k: -v for k, v in grad.items()}, symmetric=True,
                              dense=root.dense_rmatrix, flat_matvec=root.rmatvec_flat)
        solver = self.solver if self.solver is not None else Dense()
        floor = float(self.damping)
        mu = max(float(state["damping"]), floor)
        d, slope = None, 0.0
        for _ in range(20):  # raise the damping until the direction descends
            try:
                candidate = dataclasses.replace(solver, damping=mu)(system).solution
                slope = float(tree_dot(grad, candidate))
            except torch.linalg.LinAlgError:  # an exactly singular Hessian
                slope = math.nan
            objective.hessian_products += root.matvec_count
            root.matvec_count = 0
            if slope < 0.0 and math.isfinite(slope):
                d = candidate
                break
            mu = max(10.0 * mu, 1e-8 * math.sqrt(slope0_scale), 1e-12)
        if d is None:  # the damping did not help (it should): steepest descent
            d, slope = {k: -v for k, v in grad.items()}, -slope0_scale
        step, full = self._search(w, d, slope, objective)
        if full and mu > floor:
            mu = max(mu / 10.0, floor)
        new_w = {k: w[k] + step * d[k] for k in w}
        ref = state["damping"]
        return new_w, {"t": t, "damping": torch.tensor(mu, dtype=ref.dtype, device=ref.device)}

    def _search(self, w: Tree, d: Tree, slope: float, objective: InnerObjective) -> tuple[float, bool]:
        """The step along ``d`` and whether it was the full step ``lr``."""
        if self.line_search is None:
            return self.lr, True
        ref = next(iter(w.values()))
        rounding = 16 * torch.finfo(ref.dtype).eps * abs(objective.value)
        if self.line_search == "strong_wolfe":
            def phi(t: float) -> tuple[float, float, None]:
                value, g = objective.value_and_grad({k: w[k] + t * d[k] for k in w})
                return value, float(tree_dot(g, d)), None

            result = strong_wolfe(phi, objective.value, slope, self.lr, c1=self.c1, rounding=rounding)
            return result.step, result.step == self.lr
        step = self.lr
        for _ in range(self.max_backtracks):
            value = objective.value_at({k: w[k] + step * d[k] for k in w})
            if value <= objective.value + self.c1 * step * slope + rounding:
                break
            step *= 0.5
        return step, step == self.lr
