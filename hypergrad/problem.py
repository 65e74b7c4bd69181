"""The bilevel problem and the result record shared by every hypergradient method."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from torch import Tensor

from hypergrad.tree import Tree, check_scalar_loss, check_tree

__all__ = ["BilevelProblem", "HypergradInfo", "HypergradMethod", "HypergradResult", "Loss"]

Loss = Callable[[Tree, Tree, Any], Tensor]
"""A loss ``(w, lam, batch) -> scalar tensor``; ``batch`` is whatever the caller passes (may be None)."""


@dataclass(frozen=True)
class BilevelProblem:
    r"""A bilevel problem :math:`\min_\lambda f(w^*(\lambda), \lambda)` s.t.
    :math:`w^*(\lambda) \in \arg\min_w g(w, \lambda)`.

    Args:
        inner: the lower-level loss ``g(w, lam, batch)``, a scalar tensor.
        outer: the upper-level loss ``f(w, lam, batch)``, a scalar tensor. It may ignore ``lam``.

    Example:
        >>> import torch, hypergrad as hg
        >>> g = lambda w, lam, batch: ((w["x"] - lam["c"]) ** 2).sum()
        >>> f = lambda w, lam, batch: (w["x"] ** 2).sum()
        >>> problem = hg.BilevelProblem(inner=g, outer=f)
        >>> float(problem.inner_loss({"x": torch.ones(2)}, {"c": torch.zeros(2)}))
        2.0
    """

    inner: Loss
    outer: Loss

    def __post_init__(self) -> None:
        if not callable(self.inner):
            raise TypeError(f"inner must be callable (w, lam, batch) -> Tensor, got {type(self.inner).__name__}")
        if not callable(self.outer):
            raise TypeError(f"outer must be callable (w, lam, batch) -> Tensor, got {type(self.outer).__name__}")

    def inner_loss(self, w: Tree, lam: Tree, batch: Any = None) -> Tensor:
        """Evaluate ``g(w, lam, batch)`` and check that it is a floating scalar."""
        return check_scalar_loss(self.inner(w, lam, batch), "inner loss g(w, lam, batch)")

    def outer_loss(self, w: Tree, lam: Tree, batch: Any = None) -> Tensor:
        """Evaluate ``f(w, lam, batch)`` and check that it is a floating scalar."""
        return check_scalar_loss(self.outer(w, lam, batch), "outer loss f(w, lam, batch)")

    def validate(self, w: object, lam: object) -> tuple[Tree, Tree]:
        """Check ``w`` and ``lam`` are dicts of floating tensors; return them as dicts."""
        return check_tree(w, "w"), check_tree(lam, "lam")


@dataclass
class HypergradInfo:
    """Diagnostics of one hypergradient evaluation.

    Attributes:
        iterations: iterations of the method's inner solver (linear solver, unrolled steps, ...).
        residual: final residual norm of that solver (None when it has none).
        converged: the outcome of the method's stopping test: True when it passed, False when an
            iterative solver stopped before its tolerance (``Implicit`` and
            ``FiniteDifference`` with a linear solver, ``AlternatingImplicit``: the linear
            solve; ``Penalty``: both inner residuals; ``BOME``: the value-function gap). None
            when the method has no stopping test, so nothing was checked: ``Unrolled`` (a
            fixed number of steps), ``FiniteDifference(solver="identity")``, and the stochastic
            methods ``SOBA``, ``SABA``, ``SRBA``, ``AmIGO`` and ``StocBiO`` (judge them by the
            iterates).
        warnings: human-readable messages (non-convergence, clipping, ...).
        grad_evals: gradient-equivalents spent, counted as one per first-order gradient or
            Hessian-vector product (a rough, implementation-level cost measure).
        extra: method-specific values (e.g. BOME's ``phi`` and ``q``).
        stopping_test: what ``converged`` is the outcome of: ``"linear solve"`` (``Implicit``,
            ``FiniteDifference``, ``AlternatingImplicit``), ``"inner residuals"`` (``Penalty``),
            ``"value-function gap"`` (``BOME``); None where there is no test (or a method of
            your own does not name it). :attr:`hypergrad.SolveResult.unconverged_steps` counts
            the linear solves (and unnamed tests) that stopped short.

    Example:
        >>> import torch, hypergrad as hg
        >>> g = lambda w, lam, b: 0.5 * ((w["x"] - lam["c"]) ** 2).sum()
        >>> lam = {"c": torch.ones(3, dtype=torch.float64)}
        >>> r = hg.Implicit(hg.linear.CG(tol=1e-10)).hypergrad(hg.BilevelProblem(g, g), {"x": lam["c"]}, lam)
        >>> r.info.converged, r.info.iterations, r.info.grad_evals
        (True, 0, 3)
        >>> hg.Unrolled(hg.inner.SGD(0.5), steps=2).hypergrad(hg.BilevelProblem(g, g), {"x": lam["c"]}, lam).info.converged is None
        True
    """

    iterations: int = 0
    residual: float | None = None
    converged: bool | None = None
    warnings: list[str] = field(default_factory=list)
    grad_evals: int = 0
    extra: dict[str, Any] = field(default_factory=dict)
    stopping_test: str | None = None


@dataclass
class HypergradResult:
    """What every method returns.

    Attributes:
        grad: the hypergradient estimate (for BOME: the outer update direction), shaped like ``lam``.
        w: the inner iterate to continue from.
        info: diagnostics, see :class:`HypergradInfo`.
        state: method state to pass back on the next call (e.g. F2SA's ``w_sigma``); None when
            the method is stateless.

    Example:
        >>> import torch, hypergrad as hg
        >>> g = lambda w, lam, b: 0.5 * ((w["x"] - lam["c"]) ** 2).sum()
        >>> f = lambda w, lam, b: 0.5 * (w["x"] ** 2).sum()
        >>> lam = {"c": torch.tensor([2.0])}
        >>> r = hg.Unrolled(hg.inner.SGD(lr=1.0), steps=1).hypergrad(hg.BilevelProblem(g, f), {"x": torch.zeros(1)}, lam)
        >>> r.grad["c"].tolist(), r.w["x"].tolist(), r.state   # one step lands on w* = c
        ([2.0], [2.0], None)
    """

    grad: Tree
    w: Tree
    info: HypergradInfo
    state: dict[str, Any] | None = None


@runtime_checkable
class HypergradMethod(Protocol):
    """The one interface every method implements.

    ``hypergrad(problem, w, lam, inner_batch, outer_batch, state)`` estimates the hypergradient
    at ``(w, lam)`` and returns a :class:`HypergradResult`; ``state`` is the previous result's
    ``state`` (None on the first call). :func:`~hypergrad.driver.solve` accepts any object with
    this method. A method that takes several steps per call and wants a fresh batch for each
    declares the class attribute ``takes_step_batches = True``; ``solve`` then hands it
    :class:`~hypergrad.batches.StepBatches` over its batch streams, which it reads through
    :func:`~hypergrad.batches.per_step` (see :mod:`hypergrad.batches`).

    Example:
        >>> import hypergrad as hg
        >>> all(isinstance(m, hg.HypergradMethod) for m in
        ...     [hg.Implicit(), hg.FiniteDifference(), hg.Unrolled(hg.inner.SGD(0.1), steps=2)])
        True
    """

    def hypergrad(
        self,
        problem: BilevelProblem,
        w: Tree,
        lam: Tree,
        inner_batch: Any = None,
        outer_batch: Any = None,
        state: dict[str, Any] | None = None,
    ) -> HypergradResult:
        """Estimate the hypergradient at ``(w, lam)``."""
        ...
