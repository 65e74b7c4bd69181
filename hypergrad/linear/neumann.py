"""Truncated Neumann series, with the step chosen from a power-iteration eigenvalue estimate."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from hypergrad.errors import SolverMessage
from hypergrad.linear._checks import check_nonnegative, check_positive_int
from hypergrad.linear.base import LinearSolveResult, LinearSystem
from hypergrad.linear.cg import flat_operator
from hypergrad.tree import Tree, tree_flatten, tree_flatten_view, tree_unflatten

__all__ = ["Neumann", "largest_eigenvalue"]


def largest_eigenvalue(system: LinearSystem, iterations: int = 20, seed: int = 0) -> float:
    r"""Estimate the largest-magnitude eigenvalue of ``A`` by power iteration (Rayleigh quotient).

    Args:
        system: the linear system; only ``matvec`` (or ``flat_matvec``) and the shapes of ``rhs``
            are used.
        iterations: power-iteration steps (one product each).
        seed: seed of the random starting vector (drawn on the CPU, so results do not depend on
            the device).

    Returns:
        The absolute value of the final Rayleigh quotient, an estimate of
        :math:`|\lambda|_{\max}` from below for symmetric ``A``.

    Example:
        >>> import torch
        >>> from hypergrad.linear import LinearSystem, largest_eigenvalue
        >>> A = torch.diag(torch.tensor([1.0, 5.0], dtype=torch.float64))
        >>> sys = LinearSystem(matvec=lambda x: {"x": A @ x["x"]}, rhs={"x": torch.ones(2, dtype=torch.float64)})
        >>> round(largest_eigenvalue(sys, iterations=50), 6)
        5.0
    """
    gen = torch.Generator(device="cpu").manual_seed(seed)
    like = system.rhs
    mv = flat_operator(system.matvec, like, system.flat_matvec)
    v = tree_flatten(
        {k: torch.randn(t.shape, generator=gen, dtype=t.dtype).to(t.device) for k, t in like.items()}
    )
    v = v / torch.linalg.vector_norm(v)
    estimate = 0.0
    for _ in range(iterations):
        Av = mv(v)
        estimate = float(torch.dot(v, Av))
        norm = float(torch.linalg.vector_norm(Av))
        if norm == 0.0 or not math.isfinite(norm):
            break
        v = Av / norm
    return abs(estimate)


@dataclass(frozen=True, kw_only=True)
class Neumann:
    r"""Approximate :math:`A^{-1} b \approx \alpha \sum_{k=0}^{K} (I - \alpha A)^k b`.

    Converges when the spectral radius of :math:`I - \alpha A` is below one; for symmetric positive
    definite ``A`` that means :math:`0 < \alpha < 2/\lambda_{\max}`, with rate
    :math:`1 - \alpha\lambda_{\min}`. A fixed default step diverges on badly scaled problems, so by
    default :math:`\alpha = 1/\hat\lambda_{\max}` from ``power_iterations`` steps of power
    iteration. Cost: one product per term (plus the power iterations).

    Args:
        alpha: step; None picks ``1 / largest_eigenvalue``.
        steps: maximum number of terms ``K``.
        tol: stop early when ``||A x - b|| <= tol * ||b||``.
        power_iterations: iterations of the eigenvalue estimate when ``alpha`` is None.

    Warnings: a truncated series (``steps`` terms short of ``tol``) is often intended (e.g.
    ``Neumann(steps=10)`` as a cheap approximate inverse), so outside :func:`hypergrad.solve`
    each solver instance reports each kind of warning (not converged, diverging) as a Python
    warning once: later calls still list it in ``result.warnings`` (and ``Implicit``'s
    ``info.warnings``), with ``result.repeated_warnings`` set so that callers do not warn again.
    Inside a solve every occurrence is counted and each kind warned once at the end, as for any
    solver (:func:`hypergrad.errors.report`).

    Example:
        >>> import torch
        >>> from hypergrad.linear import Neumann, LinearSystem
        >>> A = torch.tensor([[2.0, 0.5], [0.5, 1.0]], dtype=torch.float64)
        >>> sys = LinearSystem(matvec=lambda x: {"x": A @ x["x"]}, rhs={"x": torch.ones(2, dtype=torch.float64)})
        >>> x = Neumann(steps=500, tol=1e-12)(sys).solution["x"]
        >>> torch.allclose(A @ x, torch.ones(2, dtype=torch.float64))
        True
    """

    alpha: float | None = None
    steps: int = 100
    tol: float = 1e-6
    power_iterations: int = 20
    # The kinds of warning this instance has already reported (mutable, so shared by the frozen
    # instance across calls; not part of equality).
    _reported: set[str] = field(default_factory=set, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.alpha is not None and not (isinstance(self.alpha, (int, float)) and self.alpha > 0):
            raise ValueError(f"alpha must be > 0 or None, got {self.alpha!r}")
        check_positive_int(self.steps, "steps", allow_none=False)
        check_nonnegative(self.tol, "tol")
        check_positive_int(self.power_iterations, "power_iterations", allow_none=False)

    def __call__(self, system: LinearSystem, x0: Tree | None = None) -> LinearSolveResult:
        b = tree_flatten_view(system.rhs)
        mv = flat_operator(system.matvec, system.rhs, system.flat_matvec)
        b_norm = float(torch.linalg.vector_norm(b))
        warnings: list[str] = []
        matvecs = 0
        alpha = self.alpha
        if alpha is None:
            lam_max = largest_eigenvalue(system, self.power_iterations)
            matvecs += self.power_iterations
            if lam_max == 0.0:
                raise ValueError("Neumann: the matrix appears to be zero; cannot choose alpha")
            alpha = 1.0 / lam_max
        if b_norm == 0.0:
            return LinearSolveResult(dict(system.rhs), 0, 0.0, True, matvecs, warnings)
        # x_K = alpha * sum_k (I - alpha A)^k b; the residual b - A x_K equals (I - alpha A)^{K+1} b.
        # Flat vectors, in-place updates of the vectors owned here (x, residual).
        if x0 is None:
            residual = b.clone()
            x = b * alpha
        else:
            x = tree_flatten(x0).to(b.dtype)
            residual = b - mv(x)
            matvecs += 1
            x.add_(residual, alpha=alpha)
        iterations = 0
        converged = False
        res_norm = b_norm
        for iterations in range(1, self.steps + 1):  # noqa: B007
            residual.add_(mv(residual), alpha=-alpha)
            matvecs += 1
            res_norm = float(torch.linalg.vector_norm(residual))
            if not res_norm < 1e6 * b_norm:  # also catches NaN
                warnings.append(SolverMessage(
                    f"Neumann: diverging (residual {res_norm:.3e}) with alpha={alpha:.3e}; the "
                    "series needs 0 < alpha < 2 / lambda_max (use alpha=None to estimate it)",
                    kind="Neumann: diverging", value=res_norm))
                break
            if res_norm <= self.tol * b_norm:
                converged = True
                break
            x.add_(residual, alpha=alpha)
        kind = "diverging" if warnings else "not converged"
        if converged:
            x.add_(residual, alpha=alpha)
        elif not warnings:
            warnings.append(SolverMessage(
                f"Neumann: not converged after {self.steps} terms (relative residual "
                f"{res_norm / b_norm:.3e} > tol {self.tol:.1e}); raise steps or use CG",
                kind="Neumann: not converged", value=res_norm / b_norm))
        repeated = bool(warnings) and kind in self._reported
        if warnings:
            self._reported.add(kind)
        return LinearSolveResult(
            tree_unflatten(x, system.rhs), iterations, res_norm, converged, matvecs, warnings, repeated
        )
