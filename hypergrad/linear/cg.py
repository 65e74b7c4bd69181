"""Conjugate gradient for symmetric positive-definite systems."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from hypergrad.errors import SolverMessage
from hypergrad.linear._checks import check_nonnegative, check_positive_int
from hypergrad.linear.base import LinearSolveResult, LinearSystem
from hypergrad.tree import (
    Tree,
    tree_flatten,
    tree_flatten_view,
    tree_unflatten,
    tree_zeros_like,
)

__all__ = ["CG", "fused_conjugate_gradient", "hutchinson_diagonal", "preconditioned_cg"]


@dataclass(frozen=True, kw_only=True)
class CG:
    r"""Conjugate gradient on ``(A + damping I) x = b`` for symmetric positive-definite ``A``.

    Converges in at most ``n`` iterations in exact arithmetic, and to relative residual
    :math:`\epsilon` in :math:`O(\sqrt{\kappa}\log(1/\epsilon))` iterations. Cost: one
    Hessian-vector product per iteration.

    Args:
        tol: stop when ``||r|| <= tol * ||b||`` (the unpreconditioned residual, whatever the
            preconditioner, so iteration counts compare at the same accuracy).
        maxiter: iteration cap (default ``min(n, 1000)`` with ``n`` the system size, plus a margin
            of 10 for round-off).
        damping: Tikhonov damping, useful when ``A`` is only positive semi-definite.
        preconditioner: None (plain CG); ``"jacobi"``: divide by an estimate of the diagonal of
            ``A + damping I`` from ``probes`` Hutchinson products :math:`z \odot A z` with
            Rademacher :math:`z` (entries at most ``1e-8`` times the largest replaced by the mean
            magnitude); or a
            callable ``r -> M^{-1} r`` on the flat vector (symmetric positive definite ``M``, e.g.
            a known diagonal). The estimate's products are counted in ``matvecs``.
        probes: Hutchinson probes of the Jacobi estimate (>= 1).
        seed: seed of the probes (drawn on the CPU).

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
    preconditioner: str | Callable[[Tensor], Tensor] | None = None
    probes: int = 20
    seed: int = 0

    def __post_init__(self) -> None:
        check_nonnegative(self.tol, "tol")
        check_positive_int(self.maxiter, "maxiter")
        check_nonnegative(self.damping, "damping")
        pre = self.preconditioner
        if not (pre is None or pre == "jacobi" or callable(pre)):
            raise ValueError(f"preconditioner must be None, 'jacobi' or a callable r -> M^-1 r, got {pre!r}")
        check_positive_int(self.probes, "probes", allow_none=False)

    def __call__(self, system: LinearSystem, x0: Tree | None = None) -> LinearSolveResult:
        if not system.symmetric:
            raise ValueError(
                "CG needs a symmetric system; use hypergrad.linear.NormalCG or Dense for the "
                "fixed-point form"
            )
        if self.preconditioner is None:
            if system.flat_cg_step is not None:
                return fused_conjugate_gradient(system, x0, self.tol, self.maxiter, self.damping)
            return conjugate_gradient(
                system.matvec, system.rhs, x0, self.tol, self.maxiter, self.damping, "CG",
                flat_matvec=system.flat_matvec,
            )
        return self._preconditioned(system, x0)

    def _preconditioned(self, system: LinearSystem, x0: Tree | None) -> LinearSolveResult:
        op = damped_operator(system.matvec, system.rhs, system.flat_matvec, self.damping)
        b = tree_flatten_view(system.rhs)
        matvecs = 0
        pre = self.preconditioner
        if pre == "jacobi":
            diag = hutchinson_diagonal(op, b, self.probes, self.seed)
            matvecs += self.probes
            # entries the noise made (nearly) non-positive: the mean magnitude instead
            mean = float(diag.abs().mean()) or 1.0
            diag = torch.where(diag > 1e-8 * float(diag.abs().max()), diag, torch.full_like(diag, mean))
            inv = 1.0 / diag

            def precondition(r: Tensor) -> Tensor:
                return r * inv
        else:
            assert callable(pre)
            precondition = pre
        result = preconditioned_cg(op, b, x0, self.tol, self.maxiter, precondition, system.rhs)
        result.matvecs += matvecs
        return result


def hutchinson_diagonal(op: Callable[[Tensor], Tensor], like: Tensor, probes: int, seed: int = 0) -> Tensor:
    r"""Estimate the diagonal of ``A`` as the mean of :math:`z \odot A z` over Rademacher ``z``.

    Unbiased; the variance of entry ``i`` is :math:`\sum_{j \ne i} A_{ij}^2 / \text{probes}`.

    Example:
        >>> import torch
        >>> A = torch.diag(torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64))
        >>> hutchinson_diagonal(lambda v: A @ v, torch.zeros(3, dtype=torch.float64), probes=4).tolist()
        [1.0, 2.0, 3.0]
    """
    gen = torch.Generator(device="cpu").manual_seed(seed)
    acc = torch.zeros_like(like)
    for _ in range(probes):
        z = (torch.randint(0, 2, like.shape, generator=gen).to(like.dtype) * 2 - 1).to(like.device)
        acc.add_(z * op(z))
    return acc / probes


def preconditioned_cg(
    op: Callable[[Tensor], Tensor],
    b: Tensor,
    x0: Tree | None,
    tol: float,
    maxiter: int | None,
    precondition: Callable[[Tensor], Tensor],
    like: Tree,
) -> LinearSolveResult:
    """Preconditioned CG on flat vectors; stops on the unpreconditioned residual ``||b - A x||``.

    Args:
        op: ``v -> A v`` (symmetric positive definite ``A``).
        b: the right-hand side (flat).
        x0: optional warm start, shaped like ``like``.
        tol: stop when ``||b - A x|| <= tol * ||b||``.
        maxiter: iteration cap (default ``min(n, 1000) + 10``).
        precondition: ``r -> M^{-1} r`` for a symmetric positive definite ``M``.
        like: the pytree the solution is returned as.

    Example:
        >>> import torch
        >>> A = torch.diag(torch.tensor([1.0, 100.0], dtype=torch.float64))
        >>> r = preconditioned_cg(lambda v: A @ v, torch.ones(2, dtype=torch.float64), None, 1e-12,
        ...                       None, lambda v: v / torch.diagonal(A), {"x": torch.zeros(2)})
        >>> r.iterations, [round(v, 6) for v in r.solution["x"].tolist()]
        (1, [1.0, 0.01])
    """
    return _cg_loop("CG", op, b, x0, tol, maxiter, precondition, like)


def _cg_loop(name: str, op: Callable[[Tensor], Tensor], b: Tensor, x0: Tree | None, tol: float,
             maxiter: int | None, precondition: Callable[[Tensor], Tensor] | None, like: Tree) -> LinearSolveResult:
    """The CG iteration on flat vectors, preconditioned or (``precondition=None``) plain; the
    plain form reuses ``r^T r`` as ``r^T z`` instead of computing it again."""
    maxiter = _iteration_cap(maxiter, b)
    b_norm = float(torch.linalg.vector_norm(b))
    warnings: list[str] = []
    if b_norm == 0.0:
        return LinearSolveResult(tree_zeros_like(like), 0, 0.0, True, 0, warnings)
    x, r, matvecs = _start(op, b, x0)
    threshold2 = (tol * b_norm) ** 2
    rs = float(torch.dot(r, r))
    z = r if precondition is None else precondition(r)
    p = z.clone()
    rz = rs if precondition is None else float(torch.dot(r, z))
    iterations = 0
    converged = rs <= threshold2
    while not converged and iterations < maxiter:
        Ap = op(p)
        matvecs += 1
        curvature = float(torch.dot(p, Ap))
        if not curvature > 0.0:
            converged = _solved_at_round_off(curvature, rs, b)
            if not converged:
                warnings.append(_non_positive_curvature(name, curvature, iterations))
            break
        alpha = rz / curvature
        x.add_(p, alpha=alpha)
        r.add_(Ap, alpha=-alpha)
        rs = float(torch.dot(r, r))
        iterations += 1
        if rs <= threshold2:
            converged = True
            break
        if precondition is None:
            z, rz_new = r, rs
        else:
            z = precondition(r)
            rz_new = float(torch.dot(r, z))
            if not rz_new > 0.0:
                warnings.append(SolverMessage(
                    f"{name}: the preconditioner is not positive definite (r^T M^-1 r = {rz_new:.3e})",
                    kind=f"{name}: the preconditioner is not positive definite", value=rz_new,
                    larger_is_worse=False))
                break
        p = torch.add(z, p, alpha=rz_new / rz)  # out of place: matvec may have kept a view of p
        rz = rz_new
    return _finish(name, x, like, iterations, rs, b_norm, tol, converged, matvecs, warnings)


def fused_conjugate_gradient(system: LinearSystem, x0: Tree | None, tol: float, maxiter: int | None,
                             damping: float) -> LinearSolveResult:
    """Plain CG driven by ``system.flat_cg_step`` (one fused call per iteration).

    The same iteration, stopping test and warnings as :func:`conjugate_gradient`; the scalars are
    read back once per iteration for the stopping test.

    Example:
        >>> import torch
        >>> from hypergrad.linear import LinearSystem
        >>> A = torch.tensor([[3.0, 1.0], [1.0, 2.0]], dtype=torch.float64)
        >>> def step(x, r, p, rs, damping):
        ...     ap = A @ p + damping * p
        ...     curvature = p @ ap
        ...     x, r = x + rs / curvature * p, r - rs / curvature * ap
        ...     return x, r, r + (r @ r) / rs * p, r @ r, curvature
        >>> system = LinearSystem(matvec=lambda v: {"x": A @ v["x"]}, rhs={"x": torch.ones(2, dtype=torch.float64)},
        ...                       flat_cg_step=step)
        >>> [round(v, 6) for v in fused_conjugate_gradient(system, None, 1e-12, None, 0.0).solution["x"].tolist()]
        [0.2, 0.4]
    """
    assert system.flat_cg_step is not None
    step = system.flat_cg_step
    b = tree_flatten_view(system.rhs)
    maxiter = _iteration_cap(maxiter, b)
    b_norm = float(torch.linalg.vector_norm(b))
    warnings: list[str] = []
    if b_norm == 0.0:
        return LinearSolveResult(tree_zeros_like(system.rhs), 0, 0.0, True, 0, warnings)
    x, r, matvecs = _start(damped_operator(system.matvec, system.rhs, system.flat_matvec, damping), b, x0)
    threshold2 = (tol * b_norm) ** 2
    rs_t = torch.dot(r, r)
    rs = float(rs_t)
    p = r.clone()
    damping_t = torch.tensor(float(damping), dtype=b.dtype, device=b.device)
    iterations = 0
    converged = rs <= threshold2
    while not converged and iterations < maxiter:
        x_new, r_new, p_new, rs_new, curvature_t = step(x, r, p, rs_t, damping_t)
        matvecs += 1
        curvature = float(curvature_t)
        if not curvature > 0.0:
            converged = _solved_at_round_off(curvature, rs, b)
            if not converged:
                warnings.append(_non_positive_curvature("CG", curvature, iterations))
            break
        x, r, p, rs_t = x_new, r_new, p_new, rs_new
        rs = float(rs_t)
        iterations += 1
        if rs <= threshold2:
            converged = True
    return _finish("CG", x, system.rhs, iterations, rs, b_norm, tol, converged, matvecs, warnings)


def _iteration_cap(maxiter: int | None, b: Tensor) -> int:
    """``maxiter``, or by default ``min(n, 1000)`` plus a margin of 10 for round-off."""
    return maxiter if maxiter is not None else min(b.numel(), 1000) + 10


def _non_positive_curvature(name: str, curvature: float, iteration: int) -> str:
    return SolverMessage(
        f"{name}: non-positive curvature p^T A p = {curvature:.3e} at iteration {iteration}; "
        "the matrix is not positive definite (add damping or use Dense)",
        kind=f"{name}: non-positive curvature", value=curvature, larger_is_worse=False)


def _solved_at_round_off(curvature: float, rs: float, b: Tensor) -> bool:
    """Whether a zero curvature ``p^T A p`` means a solved system, not an indefinite one.

    Once the residual is at round-off level (``||r|| <= eps ||b||``; exactly zero included), the
    next direction is as small and its curvature underflows to 0: the system is solved as far
    as the arithmetic can tell (a ``tol`` of 0 asks for exactly that), not a matrix that fails
    to be positive definite.
    """
    b_norm = float(torch.linalg.vector_norm(b))
    return curvature == 0.0 and rs <= (torch.finfo(b.dtype).eps * b_norm) ** 2


def _start(op: Callable[[Tensor], Tensor], b: Tensor, x0: Tree | None) -> tuple[Tensor, Tensor, int]:
    """The first iterate, its residual and the products spent on it (one for a warm start)."""
    if x0 is None:
        return torch.zeros_like(b), b.clone(), 0
    x = tree_flatten(x0).to(b.dtype)  # a fresh copy, safe to update in place
    return x, b - op(x), 1


def _finish(name: str, x: Tensor, like: Tree, iterations: int, rs: float, b_norm: float, tol: float,
            converged: bool, matvecs: int, warnings: list[str]) -> LinearSolveResult:
    """The result, with a non-convergence warning unless another one explains the stop."""
    residual = math.sqrt(rs) if rs >= 0.0 else float("nan")
    if not converged and not warnings:
        warnings.append(SolverMessage(
            f"{name}: not converged after {iterations} iterations (relative residual "
            f"{residual / b_norm:.3e} > tol {tol:.1e}); raise maxiter or add damping",
            kind=f"{name}: not converged", value=residual / b_norm))
    return LinearSolveResult(tree_unflatten(x, like), iterations, residual, converged, matvecs, warnings)


def damped_operator(
    matvec: Callable[[Tree], Tree], like: Tree, flat_matvec: Callable[[Tensor], Tensor] | None, damping: float
) -> Callable[[Tensor], Tensor]:
    """``v -> (A + damping I) v`` on flattened vectors (see :func:`flat_operator`).

    Example:
        >>> import torch
        >>> op = damped_operator(lambda x: {"x": 2 * x["x"]}, {"x": torch.zeros(2)}, None, 0.5)
        >>> op(torch.ones(2)).tolist()
        [2.5, 2.5]
    """
    mv = flat_operator(matvec, like, flat_matvec)
    if not damping:
        return mv
    return lambda v: mv(v).add(v, alpha=damping)


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
    op = damped_operator(matvec, b, flat_matvec, damping)
    return _cg_loop(name, op, tree_flatten_view(b), x0, tol, maxiter, None, b)
