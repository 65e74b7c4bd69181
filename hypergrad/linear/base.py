"""The linear-system record every solver in :mod:`hypergrad.linear` consumes and produces."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from torch import Tensor

from hypergrad.tree import Tree

__all__ = ["LinearSolveResult", "LinearSystem"]


@dataclass
class LinearSystem:
    """A square linear system ``A x = b`` over pytrees, given through products only.

    Attributes:
        matvec: ``x -> A x``.
        rhs: ``b``.
        rmatvec: ``x -> A^T x`` (needed by :class:`~hypergrad.linear.NormalCG` when ``A`` is not
            symmetric).
        symmetric: True when ``A`` is symmetric (Hessians), enabling CG and Cholesky.
        dense: optional callable returning ``A`` as an ``(n, n)`` matrix in flattened key order,
            faster than ``n`` separate products for :class:`~hypergrad.linear.Dense`.
        flat_matvec: optional ``v -> A v`` on the flattened vector (leaves concatenated in the
            key order of ``rhs``); when given, the iterative solvers use it instead of ``matvec``
            and skip the per-iteration pytree bookkeeping. It must equal ``matvec`` and must not
            modify its argument in place.
        flat_cg_step: optional fused conjugate-gradient iteration on ``(A + damping I) x = b``
            over flat vectors, ``(x, r, p, rs, damping) -> (x', r', p', rs', curvature)`` with
            ``rs = r^T r`` and ``damping`` 0-dim tensors, ``curvature = p^T (A + damping I) p``,
            ``alpha = rs / curvature``, ``x' = x + alpha p``, ``r' = r - alpha (A + damping I) p``,
            ``rs' = r'^T r'``, ``p' = r' + (rs' / rs) p``. Plain :class:`~hypergrad.linear.CG`
            uses it instead of ``flat_matvec`` and its own vector updates (one call per
            iteration; :mod:`hypergrad.compiled` provides one).

    Example:
        >>> import torch
        >>> from hypergrad.linear import CG, LinearSystem
        >>> A = torch.tensor([[4.0, 1.0], [1.0, 3.0]], dtype=torch.float64)
        >>> system = LinearSystem(matvec=lambda x: {"x": A @ x["x"]},
        ...                       rhs={"x": torch.tensor([1.0, 2.0], dtype=torch.float64)})
        >>> x = CG(tol=1e-12)(system).solution["x"]
        >>> torch.allclose(A @ x, system.rhs["x"])
        True
    """

    matvec: Callable[[Tree], Tree]
    rhs: Tree
    rmatvec: Callable[[Tree], Tree] | None = None
    symmetric: bool = True
    dense: Callable[[], Tensor] | None = None
    flat_matvec: Callable[[Tensor], Tensor] | None = None
    flat_cg_step: Callable[..., tuple[Tensor, ...]] | None = None


@dataclass
class LinearSolveResult:
    """Solution and diagnostics of a linear solve.

    Attributes:
        solution: ``x``.
        iterations: iterations run.
        residual: final ``||A x - b||`` (or the solver's recurrence estimate of it).
        converged: whether the tolerance was met.
        matvecs: products with ``A`` or ``A^T`` spent.
        warnings: messages about non-convergence or indefiniteness.
        repeated_warnings: True when the solver already reported these same kinds of warning on
            an earlier call and asks callers not to raise them again as Python warnings (they
            are still listed in ``warnings``); :class:`~hypergrad.linear.Neumann` sets it.

    Example:
        >>> import torch
        >>> from hypergrad.linear import CG, LinearSystem
        >>> system = LinearSystem(matvec=lambda x: {"x": 2 * x["x"]}, rhs={"x": torch.ones(3)})
        >>> result = CG(tol=1e-8)(system)
        >>> result.solution["x"].tolist(), result.iterations, result.converged, result.matvecs
        ([0.5, 0.5, 0.5], 1, True, 1)
    """

    solution: Tree
    iterations: int
    residual: float
    converged: bool
    matvecs: int
    warnings: list[str] = field(default_factory=list)
    repeated_warnings: bool = False
