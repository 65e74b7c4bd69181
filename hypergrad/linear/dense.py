"""Direct solve by materialising the matrix (small problems only)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hypergrad.linear._checks import check_nonnegative
from hypergrad.linear.base import LinearSolveResult, LinearSystem
from hypergrad.tree import Tree, tree_flatten, tree_numel, tree_unflatten

__all__ = ["Dense"]


@dataclass(frozen=True, kw_only=True)
class Dense:
    r"""Materialise ``A`` (``n`` products, or one batched product) and solve directly.

    Symmetric systems use a Cholesky factorisation (falling back to LU when ``A`` is not positive
    definite); others use LU. Cost: ``n`` Hessian-vector products plus :math:`O(n^3)`; use for
    ``n`` up to a few thousand.

    Args:
        damping: solve ``(A + damping I) x = b``.

    Example:
        >>> import torch
        >>> from hypergrad.linear import Dense, LinearSystem
        >>> A = torch.tensor([[2.0, 0.0], [0.0, 4.0]], dtype=torch.float64)
        >>> sys = LinearSystem(matvec=lambda x: {"x": A @ x["x"]}, rhs={"x": torch.ones(2, dtype=torch.float64)})
        >>> [round(v, 12) for v in Dense()(sys).solution["x"].tolist()]
        [0.5, 0.25]
    """

    damping: float = 0.0

    def __post_init__(self) -> None:
        check_nonnegative(self.damping, "damping")

    def __call__(self, system: LinearSystem, x0: Tree | None = None) -> LinearSolveResult:
        b = tree_flatten(system.rhs)
        n = tree_numel(system.rhs)
        if system.dense is not None:
            A = system.dense()
            matvecs = n
        else:
            eye = torch.eye(n, dtype=b.dtype, device=b.device)
            cols = [tree_flatten(system.matvec(tree_unflatten(eye[i], system.rhs))) for i in range(n)]
            A = torch.stack(cols, dim=1)
            matvecs = n
        if self.damping:
            A = A + self.damping * torch.eye(n, dtype=A.dtype, device=A.device)
        warnings: list[str] = []
        x = None
        if system.symmetric:
            A = 0.5 * (A + A.T)
            L, info = torch.linalg.cholesky_ex(A)
            if int(info) == 0:
                x = torch.cholesky_solve(b.unsqueeze(1), L).squeeze(1)
            else:
                warnings.append("Dense: matrix is not positive definite; fell back to LU")
        if x is None:
            x = torch.linalg.solve(A, b)
        residual = float(torch.linalg.vector_norm(A @ x - b))
        converged = bool(torch.isfinite(x).all())
        if not converged:
            warnings.append("Dense: singular matrix, solution is not finite")
        return LinearSolveResult(tree_unflatten(x, system.rhs), 1, residual, converged, matvecs, warnings)
