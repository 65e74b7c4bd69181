r"""The inner loss of one step as a function of ``w``: what a line search or a Newton step evaluates.

The plain inner optimizers (:class:`~hypergrad.inner.SGD`, ``Momentum``, ``Adam``) need only the
gradient at ``w``. An optimizer that searches along its direction
(:class:`~hypergrad.inner.LBFGS`) or solves with the Hessian (:class:`~hypergrad.inner.Newton`)
needs the loss itself: :func:`hypergrad.inner_solve` and the plain inner steps of
:func:`hypergrad.solve` hand such an optimizer an :class:`InnerObjective`, the inner loss
:math:`g(\cdot, \lambda, \text{batch})` of that step's batch at fixed :math:`\lambda`, through its
method ``update_with_objective(w, grad, state, objective)``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from hypergrad.autodiff import RootSystem, inner_grads
from hypergrad.problem import BilevelProblem
from hypergrad.tree import Tree

__all__ = ["InnerObjective"]


class InnerObjective:
    r"""The inner loss of one step's batch, :math:`w \mapsto g(w, \lambda, \text{batch})`.

    Holds the point the step starts from (``w``, its ``value`` and ``grad``, computed by the
    caller) and evaluates the loss, its gradient and its Hessian elsewhere, counting every
    evaluation in ``evaluations`` (values and gradients at new points; Hessian products are
    counted in ``hessian_products``). ``last`` is ``(point, value, gradient)`` of the latest
    :meth:`value_and_grad`: when a step ends at that point (the point object itself), the caller
    reuses them for the next step on the same batch instead of evaluating again.

    Args:
        problem: the bilevel problem (its inner loss).
        lam: the outer parameters, held fixed.
        batch: the step's batch.
        w: the current point.
        value: :math:`g` at ``w``.
        grad: :math:`\nabla_w g` at ``w``.

    Example:
        >>> import torch, hypergrad as hg
        >>> g = lambda w, lam, b: 0.5 * lam["a"] * (w["x"] ** 2).sum()
        >>> w, lam = {"x": torch.tensor([1.0, 2.0])}, {"a": torch.tensor(3.0)}
        >>> objective = hg.inner.InnerObjective(hg.BilevelProblem(g, g), lam, None, w, 7.5, {"x": 3 * w["x"]})
        >>> value, grad = objective.value_and_grad({"x": torch.tensor([1.0, 0.0])})
        >>> value, grad["x"].tolist(), objective.evaluations
        (1.5, [3.0, 0.0], 1)
        >>> objective.hessian(w).tolist()
        [[3.0, 0.0], [0.0, 3.0]]
    """

    def __init__(self, problem: BilevelProblem, lam: Tree, batch: Any, w: Tree, value: float, grad: Tree) -> None:
        self.problem, self.lam, self.batch = problem, lam, batch
        self.w, self.value, self.grad = w, float(value), grad
        self.evaluations = 0
        self.hessian_products = 0
        self.last: tuple[Tree, float, Tree] | None = None

    def value_at(self, w: Tree) -> float:
        """:math:`g` at ``w`` (no gradient; NaN or inf are returned, not raised: a search backs off)."""
        self.evaluations += 1
        with torch.no_grad():
            return float(self.problem.inner_loss(w, self.lam, self.batch))

    def value_and_grad(self, w: Tree) -> tuple[float, Tree]:
        r""":math:`g` and :math:`\nabla_w g` at ``w``; a non-finite value is returned as it is (the
        gradient is then NaN), so that a line search can back off instead of failing."""
        self.evaluations += 1
        try:
            value, grad, _ = inner_grads(self.problem, self.batch, w, self.lam)
        except FloatingPointError:  # NonFiniteError: the step went too far
            nan = {k: torch.full_like(v, float("nan")) for k, v in w.items()}
            return float("nan"), nan
        assert grad is not None
        self.last = (w, float(value), grad)
        return float(value), grad

    def linearization(self, w: Tree) -> RootSystem:
        r"""The Hessian at ``w`` as products: a :class:`~hypergrad.autodiff.RootSystem` of
        :math:`\nabla_w g` (one gradient with a graph; each product one backward pass through it)."""
        self.evaluations += 1
        return RootSystem(self.problem, w, self.lam, self.batch)

    def hessian(self, w: Tree) -> Tensor:
        r""":math:`\nabla^2_{ww} g` at ``w`` as an ``(n, n)`` matrix in the key order of ``w``."""
        root = self.linearization(w)
        matrix = root.dense_rmatrix()
        self.hessian_products += root.matvec_count
        return matrix
