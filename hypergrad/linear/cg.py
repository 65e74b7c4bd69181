"""Conjugate gradient for symmetric positive-definite systems."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from hypergrad.linear._checks import check_nonnegative, check_positive_int
from hypergrad.linear.base import LinearSolveResult, LinearSystem
from hypergrad.tree import (
    Tree,
    tree_flatten,
    tree_flatten_view,
    tree_numel,
    tree_unflatten,
    tree_zeros_like,
)

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
        return conjugate_gradient(
            system.matvec, system.rhs, x0, self.tol, self.maxiter, self.damping, "CG",
            flat_matvec=system.flat_matvec,
        )


def flat_operator(
    matvec: Callable[[Tree], Tree], like: Tree, flat_matvec: Callable[[Tensor], Tensor] | None
) -> Callable[[Tensor], Tensor]:
    """``v -> A v`` on flattened vectors, from ``flat_matvec`` or by wrapping the tree ``matvec``."""
    if flat_matvec is not None:
        return flat_matvec
    return lambda v: tree_flatten_view(matvec(tree_unflatten(v, like)))


def conjugate_gradient(
    matvec: Callable[[Tree], Tree],
    b: Tree,
    x0: Tree | None,
    tol: float,
    maxiter: int | None,
    damping: float,
    name: str,
    flat_matvec: Callable[[Tensor], Tensor] | None = None,
) -> LinearSolveResult:
    """Plain CG; shared by :class:`CG` and :class:`~hypergrad.linear.NormalCG`.

    The iteration runs on one flat vector (the leaves of ``b`` concatenated) with in-place
    updates, so its per-iteration overhead is a handful of vector operations besides the product
    (measured: the pytree form spent about as long in bookkeeping as in the product on small
    problems). Scalars are read back once per iteration, as the stopping test needs them anyway.
    """
    mv = flat_operator(matvec, b, flat_matvec)

    def op(v: Tensor) -> Tensor:
        out = mv(v)
        return out.add(v, alpha=damping) if damping else out

    n = tree_numel(b)
    maxiter = maxiter if maxiter is not None else min(n, 1000) + 10
    b_flat = tree_flatten_view(b)
    b_norm = float(torch.linalg.vector_norm(b_flat))
    warnings: list[str] = []
    if b_norm == 0.0:
        return LinearSolveResult(tree_zeros_like(b), 0, 0.0, True, 0, warnings)
    matvecs = 0
    if x0 is None:
        x = torch.zeros_like(b_flat)
        r = b_flat.clone()
    else:
        x = tree_flatten(x0).to(b_flat.dtype)  # a fresh copy, safe to update in place
        r = b_flat - op(x)
        matvecs += 1
    p = r.clone()
    rs = float(torch.dot(r, r))
    threshold2 = (tol * b_norm) ** 2
    iterations = 0
    converged = rs <= threshold2
    while not converged and iterations < maxiter:
        Ap = op(p)
        matvecs += 1
        curvature = float(torch.dot(p, Ap))
        if not curvature > 0.0:
            warnings.append(
                f"{name}: non-positive curvature p^T A p = {curvature:.3e} at iteration "
                f"{iterations}; the matrix is not positive definite (add damping or use Dense)"
            )
            break
        alpha = rs / curvature
        x.add_(p, alpha=alpha)
        r.add_(Ap, alpha=-alpha)
        rs_new = float(torch.dot(r, r))
        iterations += 1
        if rs_new <= threshold2:
            converged = True
            rs = rs_new
            break
        p = torch.add(r, p, alpha=rs_new / rs)  # out of place: matvec may have kept a view of p
        rs = rs_new
    residual = math.sqrt(rs) if rs >= 0.0 else float("nan")
    if not converged and not warnings:
        warnings.append(
            f"{name}: not converged after {iterations} iterations (relative residual "
            f"{residual / b_norm:.3e} > tol {tol:.1e}); raise maxiter or add damping"
        )
    return LinearSolveResult(tree_unflatten(x, b), iterations, residual, converged, matvecs, warnings)
