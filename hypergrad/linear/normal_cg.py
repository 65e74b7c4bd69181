"""CG on the normal equations, for non-symmetric systems."""

from __future__ import annotations

from dataclasses import dataclass

from hypergrad.linear._checks import check_nonnegative, check_positive_int
from hypergrad.linear.base import LinearSolveResult, LinearSystem
from hypergrad.linear.cg import conjugate_gradient
from hypergrad.tree import Tree

__all__ = ["NormalCG"]


@dataclass(frozen=True, kw_only=True)
class NormalCG:
    r"""Conjugate gradient on :math:`A^\top A x = A^\top b`.

    Works for any non-singular ``A`` (e.g. the fixed-point form :math:`I - \partial_w T`), at the
    price of squaring the condition number. Cost: two products (``A`` and ``A^T``) per iteration.

    Args:
        tol: stop when the normal-equation residual ``||A^T (b - A x)|| <= tol * ||A^T b||``.
        maxiter: iteration cap (default ``min(n, 1000) + 10``).
        damping: solve :math:`(A^\top A + \text{damping}\, I) x = A^\top b`.

    Example:
        >>> import torch
        >>> from hypergrad.linear import NormalCG, LinearSystem
        >>> A = torch.tensor([[2.0, 1.0], [0.0, 1.0]], dtype=torch.float64)
        >>> sys = LinearSystem(matvec=lambda x: {"x": A @ x["x"]}, rmatvec=lambda x: {"x": A.T @ x["x"]},
        ...                    rhs={"x": torch.tensor([3.0, 1.0], dtype=torch.float64)}, symmetric=False)
        >>> [round(v, 6) for v in NormalCG(tol=1e-12)(sys).solution["x"].tolist()]
        [1.0, 1.0]
    """

    tol: float = 1e-6
    maxiter: int | None = None
    damping: float = 0.0

    def __post_init__(self) -> None:
        check_nonnegative(self.tol, "tol")
        check_positive_int(self.maxiter, "maxiter")
        check_nonnegative(self.damping, "damping")

    def __call__(self, system: LinearSystem, x0: Tree | None = None) -> LinearSolveResult:
        rmatvec = system.rmatvec
        if rmatvec is None:
            if not system.symmetric:
                raise ValueError("NormalCG needs system.rmatvec (A^T products) for a non-symmetric system")
            rmatvec = system.matvec
        result = conjugate_gradient(
            lambda v: rmatvec(system.matvec(v)), rmatvec(system.rhs), x0, self.tol, self.maxiter,
            self.damping, "NormalCG",
        )
        result.matvecs = 2 * result.matvecs + 1
        return result
