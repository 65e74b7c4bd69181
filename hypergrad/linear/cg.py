"""Conjugate gradient for symmetric positive-definite systems."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hypergrad._pytree import Tree, tree_axpy, tree_dot, tree_numel, tree_sub, tree_zeros_like
from hypergrad.linear._checks import check_nonnegative, check_positive_int
from hypergrad.linear.base import LinearSolveResult, LinearSystem

__all__ = ["CG"]


@dataclass(frozen=True)
class CG:
    r"""Conjugate gradient on ``(A + damping I) x = b`` for symmetric positive-definite ``A``.

    Converges in at most ``n`` iterations in exact arithmetic, and to relative residual
    :math:`\epsilon` in :math:`O(\sqrt{\kappa}\log(1/\epsilon))` iterations. Cost: one
    Hessian-vector product per iteration.

    Args:
        tol: stop when ``||r|| <= tol * ||b||``.
        maxiter: iteration cap (default ``min(n, 1000)`` with ``n`` the system size, plus a margin
            of 10 for round-off).
        damping: Tikhonov damping, useful when ``A`` is only positive semi-definite.

    Example:
        >>> import torch
        >>> from hypergrad.linear import CG, LinearSystem
        >>> A = torch.tensor([[3.0, 1.0], [1.0, 2.0]], dtype=torch.float64)
        >>> sys = LinearSystem(matvec=lambda x: {"x": A @ x["x"]}, rhs={"x": torch.ones(2, dtype=torch.float64)})
        >>> [round(v, 6) for v in CG(tol=1e-12)(sys).solution["x"].tolist()]
        [0.2, 0.4]
    """

    tol: float = 1e-6
    maxiter: int | None = None
    damping: float = 0.0

    def __post_init__(self) -> None:
        check_nonnegative(self.tol, "tol")
        check_positive_int(self.maxiter, "maxiter")
        check_nonnegative(self.damping, "damping")

    def __call__(self, system: LinearSystem, x0: Tree | None = None) -> LinearSolveResult:
        if not system.symmetric:
            raise ValueError(
                "CG needs a symmetric system; use hypergrad.linear.NormalCG or Dense for the "
                "fixed-point form"
            )
        return conjugate_gradient(system.matvec, system.rhs, x0, self.tol, self.maxiter, self.damping, "CG")


def conjugate_gradient(
    matvec, b: Tree, x0: Tree | None, tol: float, maxiter: int | None, damping: float, name: str
) -> LinearSolveResult:
    """Plain CG over pytrees; shared by :class:`CG` and :class:`~hypergrad.linear.NormalCG`."""

    def op(v: Tree) -> Tree:
        out = matvec(v)
        return tree_axpy(damping, v, out) if damping else out

    n = tree_numel(b)
    maxiter = maxiter if maxiter is not None else min(n, 1000) + 10
    b_norm = float(torch.sqrt(tree_dot(b, b)))
    warnings: list[str] = []
    if b_norm == 0.0:
        return LinearSolveResult(tree_zeros_like(b), 0, 0.0, True, 0, warnings)
    matvecs = 0
    if x0 is None:
        x = tree_zeros_like(b)
        r = dict(b)
    else:
        x = dict(x0)
        r = tree_sub(b, op(x))
        matvecs += 1
    p = dict(r)
    rs = tree_dot(r, r)
    threshold = tol * b_norm
    iterations = 0
    converged = float(torch.sqrt(rs)) <= threshold
    while not converged and iterations < maxiter:
        Ap = op(p)
        matvecs += 1
        curvature = tree_dot(p, Ap)
        if not float(curvature) > 0.0:
            warnings.append(
                f"{name}: non-positive curvature p^T A p = {float(curvature):.3e} at iteration "
                f"{iterations}; the matrix is not positive definite (add damping or use Dense)"
            )
            break
        alpha = rs / curvature
        x = tree_axpy(alpha, p, x)
        r = tree_axpy(-alpha, Ap, r)
        rs_new = tree_dot(r, r)
        iterations += 1
        if float(torch.sqrt(rs_new)) <= threshold:
            converged = True
            rs = rs_new
            break
        p = tree_axpy(rs_new / rs, p, r)
        rs = rs_new
    residual = float(torch.sqrt(rs))
    if not converged and not warnings:
        warnings.append(
            f"{name}: not converged after {iterations} iterations (relative residual "
            f"{residual / b_norm:.3e} > tol {tol:.1e}); raise maxiter or add damping"
        )
    return LinearSolveResult(x, iterations, residual, converged, matvecs, warnings)
