r"""Alternating implicit differentiation: a few inner steps, then an exact hypergradient."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import KW_ONLY, dataclass
from typing import Any, ClassVar

import torch

from hypergrad.autodiff import inner_grads
from hypergrad.batches import per_step
from hypergrad.errors import check_inner_optimizer, check_not_class
from hypergrad.implicit import Implicit
from hypergrad.inner import InnerOptimizer
from hypergrad.problem import BilevelProblem, HypergradInfo, HypergradResult
from hypergrad.tree import Tree, check_finite

__all__ = ["AlternatingImplicit"]


@dataclass(frozen=True)
class AlternatingImplicit:
    r"""Inner steps on :math:`w`, then the implicit hypergradient at the new :math:`w`.

    Each call takes ``inner_steps`` steps of ``inner_optimizer`` on :math:`g(\cdot, \lambda)`
    from the given :math:`w` (so :math:`w` only ever descends the inner loss, as in alternating
    bilevel training), then returns ``implicit``'s hypergradient at the new iterate:
    :math:`\nabla F(\lambda) = \nabla_\lambda f - \nabla^2_{\lambda w} g\, u` with
    :math:`\nabla^2_{ww} g\, u = \nabla_w f`. The new iterate is ``result.w``: pass it back on
    the next call. Across calls, ``state`` carries the inner optimizer's state and, when
    ``implicit.warm_start`` is set, the previous solution :math:`u` (the linear solve then starts
    from it).

    Batches: step ``i`` uses the ``i``-th batch of ``inner_batch`` when it is a
    :class:`~hypergrad.batches.StepBatches` (one fresh batch per step,
    :func:`~hypergrad.batches.per_step`), and the implicit system is built on the last step's
    batch; any other ``inner_batch`` is reused for every step and for the system.

    Cost: ``inner_steps`` inner gradients, then one :class:`~hypergrad.implicit.Implicit` call.

    Args:
        inner_optimizer: a :mod:`hypergrad.inner` optimizer stepping :math:`w` on :math:`g`.
        inner_steps: inner steps per call (an int >= 1).
        implicit: the :class:`~hypergrad.implicit.Implicit` method of the hypergradient (its
            linear solver, damping, ``warm_start``).
        solve_context: a factory of the context the implicit step runs in, the only part that
            takes second derivatives: e.g. one selecting kernels that support double backward,
            or one filtering the :class:`~hypergrad.errors.ConvergenceWarning` of a solve capped
            on purpose (``result.info.converged`` still reports it). Default: no context.

    Raises:
        ValueError: ``inner_steps`` is not an int >= 1.
        TypeError: ``implicit`` is not an :class:`~hypergrad.implicit.Implicit`.
        hypergrad.NonFiniteError: an inner loss, the new iterate or the hypergradient is NaN
            or inf.

    Example:
        >>> import torch, hypergrad as hg
        >>> g = lambda w, lam, b: 0.5 * ((w["x"] - lam["c"]) ** 2).sum()
        >>> f = lambda w, lam, b: 0.5 * ((w["x"] - 1.0) ** 2).sum()
        >>> method = hg.AlternatingImplicit(hg.inner.SGD(lr=1.0), 1, hg.Implicit(hg.linear.CG(tol=1e-10)))
        >>> lam = {"c": torch.tensor([3.0], dtype=torch.float64)}
        >>> r = method.hypergrad(hg.BilevelProblem(g, f), {"x": torch.zeros(1, dtype=torch.float64)}, lam)
        >>> r.w["x"].tolist(), r.grad["c"].tolist()   # one exact step reaches w* = c; dF/dc = c - 1
        ([3.0], [2.0])
    """

    takes_step_batches: ClassVar[bool] = True
    """Reads one fresh batch per inner step from a :class:`~hypergrad.batches.StepBatches`."""

    inner_optimizer: InnerOptimizer
    inner_steps: int
    implicit: Implicit
    _: KW_ONLY  # the options below are keyword-only
    solve_context: Callable[[], AbstractContextManager[Any]] = contextlib.nullcontext

    def __post_init__(self) -> None:
        if isinstance(self.inner_steps, bool) or not isinstance(self.inner_steps, int) or self.inner_steps < 1:
            raise ValueError(f"inner_steps must be an int >= 1, got {self.inner_steps!r}")
        check_inner_optimizer(self.inner_optimizer, "inner_optimizer")
        check_not_class(self.implicit, "implicit")
        if not isinstance(self.implicit, Implicit):
            raise TypeError(f"implicit must be a hypergrad.Implicit, got {self.implicit!r}")

    def hypergrad(
        self,
        problem: BilevelProblem,
        w: Tree,
        lam: Tree,
        inner_batch: Any = None,
        outer_batch: Any = None,
        state: dict[str, Any] | None = None,
    ) -> HypergradResult:
        """Step ``w`` on the inner loss, then return the implicit hypergradient at the new ``w``
        (``result.w``)."""
        w, lam = problem.validate(w, lam)
        state = state or {}
        opt_state = state.get("opt_state") or self.inner_optimizer.init(w)
        batches = per_step(inner_batch, self.inner_steps)
        for batch in batches:
            # a non-finite loss gives a non-finite iterate, which the check below reports (one read
            # back to the host per call instead of one per step); the update under no_grad keeps no graph
            _, grad, _ = inner_grads(problem, batch, w, lam, check=False)
            with torch.no_grad():
                w, opt_state = self.inner_optimizer.update(w, grad, opt_state)
        check_finite(w, "AlternatingImplicit inner iterate (did the inner optimizer diverge? lower its lr)")
        with self.solve_context():
            # under hg.solve a stream of outer batches arrives as StepBatches: Implicit takes one
            r = self.implicit.hypergrad(problem, w, lam, batches[-1], per_step(outer_batch, 1)[0],
                                        {"u": state["u"]} if "u" in state else None)
        info = HypergradInfo(
            iterations=r.info.iterations,
            residual=r.info.residual,
            converged=r.info.converged,
            stopping_test=r.info.stopping_test,
            warnings=r.info.warnings,
            grad_evals=r.info.grad_evals + self.inner_steps,
            # the linear solve's iterations and convergence as numbers, for per-step logs
            extra={**r.info.extra, "cg_iterations": r.info.iterations, "cg_converged": float(r.info.converged)},
        )
        return HypergradResult(r.grad, w, info, {"opt_state": opt_state, **(r.state or {})})
