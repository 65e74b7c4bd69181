r"""Conjugate gradient with the Hessian-vector products compiled by :func:`torch.compile`.

The eager solvers take each Hessian-vector product as one backward pass through a graph of
:math:`\nabla_w g` that is built once and retained (:class:`~hypergrad.autodiff.RootSystem`); a
backward pass cannot be compiled. The compiled path instead traces a functional product,
forward-over-reverse ``torch.func.jvp`` over ``torch.func.grad`` of the inner loss on the flat
parameter vector, together with the CG update, into one graph of ``chunk`` iterations. The
stopping test runs between chunks, so the arithmetic is the eager CG's: iterations past the
tolerance (or past ``maxiter``, or after a non-positive curvature) are masked and change nothing,
and the iteration count, solution and residual are those of :class:`~hypergrad.linear.CG` up to
round-off (checked to 1e-10 in float64 by the tests). It is selected by
``Implicit(solver=CG(...), compile=True)``.

**When it pays.** Compilation takes tens of seconds (inductor generates and compiles C++ on the
CPU; a C++ compiler must be installed) and is done once per problem shape and dtype: later calls
with new values of ``w``, ``lam`` and the batch tensors reuse it without recompiling. It removes
the autograd engine's per-product overhead, but on the CPU benchmarks it was slower than the
eager path (1.5x on logistic regression with 100 features, 3-4x on ridge and at 1000 features;
``benchmarks/results/hypergrad.md``): inductor lowers the small matrix-vector products of the
traced product into its own loops, slower than the BLAS calls of eager PyTorch, and the
functional product recomputes forward quantities that the retained graph stores. The default is
therefore eager; the option is for inner losses and devices where those trade-offs differ.

**Fallback.** If compilation fails (no C++ compiler, an inner loss dynamo cannot trace without a
graph break, an unsupported operator), one warning is logged on the ``hypergrad`` logger and the
eager :class:`~hypergrad.linear.CG` solves the system instead; ``info.extra["compiled"]`` says
which path ran. Failures are remembered per inner loss, so the compiler is not retried each call.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from hypergrad.linear.base import LinearSolveResult, LinearSystem
from hypergrad.linear.cg import CG
from hypergrad.problem import BilevelProblem
from hypergrad.tree import Tree, tree_flatten, tree_flatten_view, tree_unflatten, tree_zeros_like

__all__ = ["DEFAULT_CHUNK", "compiled_cg", "compiler_available"]

logger = logging.getLogger("hypergrad")

DEFAULT_CHUNK = 8
"""CG iterations traced into one compiled graph (the stopping test runs between chunks)."""

# inner losses whose compilation failed, by id (the value keeps the object alive, so the id is not
# reused): not retried
_FAILED: dict[int, object] = {}
_COMPILED: dict[int, Callable[..., Any]] = {}  # chunk -> compiled chunk function


def compiler_available() -> tuple[bool, str]:
    """Whether inductor can compile on the CPU here: a C++ compiler must be on ``PATH``.

    Returns:
        ``(True, path of the compiler)`` or ``(False, reason)``.

    Example:
        >>> ok, detail = compiler_available()
        >>> isinstance(ok, bool) and isinstance(detail, str)
        True
    """
    for name in ("g++", "c++", "clang++"):
        path = shutil.which(name)
        if path:
            return True, path
    return False, "no C++ compiler (g++, c++ or clang++) on PATH; inductor needs one on the CPU"


def _cg_chunk(
    problem: BilevelProblem,
    batch: Any,
    lam: Tree,
    w: Tensor,
    x: Tensor,
    r: Tensor,
    p: Tensor,
    rs: Tensor,
    threshold2: Tensor,
    iterations: Tensor,
    ok: Tensor,
    maxiter: Tensor,
    damping: Tensor,
    shapes: tuple[tuple[int, ...], ...],
    keys: tuple[str, ...],
    chunk: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``chunk`` masked CG iterations on ``(H + damping I) x = b``, H the Hessian of g at ``w``."""
    numels = [int(torch.Size(s).numel()) for s in shapes]

    def grad_flat(w_flat: Tensor) -> Tensor:
        parts = w_flat.split(numels) if len(numels) > 1 else (w_flat,)
        tree = {k: v.reshape(s) for k, v, s in zip(keys, parts, shapes, strict=True)}
        grads = torch.func.grad(lambda t: problem.inner_loss(t, lam, batch))(tree)
        return torch.cat([grads[k].reshape(-1) for k in keys])

    zero = torch.zeros_like(rs)
    for _ in range(chunk):
        _, Ap = torch.func.jvp(grad_flat, (w,), (p,))
        Ap = Ap + damping * p
        curvature = torch.dot(p, Ap)
        active = (rs > threshold2) & ok & (iterations < maxiter)
        good = curvature > 0
        ok = ok & (good | ~active)
        step = active & good
        alpha = torch.where(step, rs / curvature, zero)
        x = x + alpha * p
        r = r - alpha * Ap
        rs_new = torch.dot(r, r)
        p = torch.where(step, r + (rs_new / rs) * p, p)
        rs = torch.where(step, rs_new, rs)
        iterations = iterations + step.to(iterations.dtype)
    return x, r, p, rs, iterations, ok


def _compiled_chunk(chunk: int) -> Callable[..., Any]:
    fn = _COMPILED.get(chunk)
    if fn is None:
        fn = torch.compile(_cg_chunk, fullgraph=True, dynamic=False)
        _COMPILED[chunk] = fn
    return fn


def compiled_cg(
    problem: BilevelProblem,
    w: Tree,
    lam: Tree,
    batch: Any,
    system: LinearSystem,
    solver: CG,
    x0: Tree | None = None,
    chunk: int = DEFAULT_CHUNK,
) -> tuple[LinearSolveResult, bool]:
    r"""Solve ``system`` (the Hessian system of ``problem`` at ``(w, lam)``) with compiled CG.

    Args:
        problem: the bilevel problem; its inner loss is traced by :func:`torch.compile`.
        w, lam: the linearisation point (dicts of tensors).
        batch: the inner batch (tensors in it are graph inputs; other values are guarded on).
        system: the same system for the eager fallback (its ``rhs`` is ``b``).
        solver: the :class:`~hypergrad.linear.CG` whose ``tol``, ``maxiter`` and ``damping``
            are used.
        x0: optional warm start.
        chunk: CG iterations per compiled graph.

    Returns:
        The solve and whether the compiled path ran (False: the eager fallback did).

    Example:
        >>> import torch, hypergrad as hg
        >>> from hypergrad.compiled import compiled_cg
        >>> g = lambda w, lam, b: 0.5 * (lam["c"] * w["x"] ** 2).sum()
        >>> w, lam = {"x": torch.ones(3, dtype=torch.float64)}, {"c": torch.tensor([1.0, 2.0, 4.0], dtype=torch.float64)}
        >>> system = hg.linear.LinearSystem(matvec=lambda v: {"x": lam["c"] * v["x"]}, rhs={"x": torch.ones(3, dtype=torch.float64)})
        >>> result, _ = compiled_cg(hg.BilevelProblem(g, g), w, lam, None, system, hg.linear.CG(tol=1e-12))
        >>> [round(v, 6) for v in result.solution["x"].tolist()]
        [1.0, 0.5, 0.25]
    """
    key = id(problem.inner)
    if key in _FAILED:
        return solver(system, x0), False
    b = tree_flatten_view(system.rhs)
    b_norm = float(torch.linalg.vector_norm(b))
    if b_norm == 0.0:
        return LinearSolveResult(tree_zeros_like(system.rhs), 0, 0.0, True, 0, []), True
    keys = tuple(w)
    shapes = tuple(tuple(w[k].shape) for k in keys)
    w_flat = torch.cat([w[k].detach().reshape(-1) for k in keys])
    lam_d = {k: v.detach() for k, v in lam.items()}
    n = b.numel()
    maxiter = solver.maxiter if solver.maxiter is not None else min(n, 1000) + 10
    matvecs = 0
    if x0 is None:
        x = torch.zeros_like(b)
        r = b.clone()
    else:
        x = tree_flatten(x0).to(b.dtype)
        mv = system.flat_matvec
        Ax = mv(x) if mv is not None else tree_flatten(system.matvec(tree_unflatten(x, system.rhs)))
        if solver.damping:
            Ax = Ax + solver.damping * x
        r = b - Ax
        matvecs += 1
    p = r.clone()
    rs = torch.dot(r, r)
    thr = torch.tensor((solver.tol * b_norm) ** 2, dtype=b.dtype, device=b.device)
    it = torch.zeros((), dtype=torch.int64, device=b.device)
    ok = torch.ones((), dtype=torch.bool, device=b.device)
    max_t = torch.tensor(maxiter, dtype=torch.int64, device=b.device)
    damping = torch.tensor(float(solver.damping), dtype=b.dtype, device=b.device)
    fn = _compiled_chunk(chunk)
    while float(rs) > float(thr) and bool(ok) and int(it) < maxiter:
        try:
            x, r, p, rs, it, ok = fn(problem, batch, lam_d, w_flat, x, r, p, rs, thr, it, ok,
                                     max_t, damping, shapes, keys, chunk)
        except Exception as exc:  # compilation or tracing failed: eager from here on
            _FAILED[key] = problem.inner
            logger.warning(
                "hypergrad: torch.compile of the CG solve failed (%s: %s); falling back to the "
                "eager solver for this inner loss", type(exc).__name__, str(exc).split("\n")[0][:200],
            )
            return solver(system, x0), False
        matvecs += chunk
    iterations = int(it)
    rs_f = float(rs)
    residual = rs_f**0.5 if rs_f >= 0 else float("nan")
    converged = rs_f <= float(thr)
    warnings: list[str] = []
    if not bool(ok):
        warnings.append(
            f"CG: non-positive curvature at iteration {iterations}; the matrix is not positive "
            "definite (add damping or use Dense)"
        )
    elif not converged:
        warnings.append(
            f"CG: not converged after {iterations} iterations (relative residual "
            f"{residual / b_norm:.3e} > tol {solver.tol:.1e}); raise maxiter or add damping"
        )
    result = LinearSolveResult(tree_unflatten(x, system.rhs), iterations, residual, converged,
                               matvecs, warnings)
    return result, True
