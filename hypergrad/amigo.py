r"""AmIGO: amortized implicit gradient optimization (Arbel and Mairal, 2022)."""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from hypergrad.batches import StepBatches, per_step
from hypergrad.compiled import all_finite, run_stage, traced_stage
from hypergrad.problem import BilevelProblem, HypergradInfo, HypergradResult
from hypergrad.stochastic import (
    NON_FINITE,
    OracleCounts,
    StepSize,
    check_step_size,
    compiled_info,
    compiled_stochastic,
    hessian_products,
    inner_products,
    linear_iterate,
    one_batch,
    outer_grads,
    step_counter,
    step_size_at,
    tensor_like,
    traced_cross_product,
    traced_hessian_products,
    traced_inner_sgd,
    traced_outer_grads,
)
from hypergrad.tree import Tree, check_finite, tree_axpy, tree_detach, tree_norm, tree_sub

__all__ = ["AmIGO"]


def _check_steps(value: object, name: str) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")


@dataclass(frozen=True)
class AmIGO:
    r"""AmIGO: warm-started inner SGD, warm-started SGD on the linear system, one implicit-gradient estimate.

    M. Arbel and J. Mairal, "Amortized implicit differentiation for stochastic bilevel
    optimization", ICLR 2022.

    Each call, with fresh inner batches :math:`i_1, i_2, \ldots` and one outer batch :math:`j`:

    1. ``inner_steps`` (:math:`T`) SGD steps :math:`w \leftarrow w - \rho\, \nabla_w g_{i_k}(w,
       \lambda)` from the given ``w`` (warm start);
    2. :math:`\nabla_w f_j, \nabla_\lambda f_j` at the new ``w``;
    3. ``linear_steps`` (:math:`L`) SGD steps on :math:`\tfrac12 v^\top H v - v^\top
       \nabla_w f_j`: :math:`v \leftarrow v - \eta\,(\nabla^2_{ww} g_{i_k}\, v - \nabla_w f_j)`,
       from the previous call's :math:`v` (warm start);
    4. ``result.grad`` :math:`= \nabla_\lambda f_j - \nabla^2_{\lambda w} g_{i}\, v` with one more
       inner batch; the outer optimizer takes the outer step (``torch.optim.SGD(lr=gamma)``).

    ``result.w`` is the ``w`` of step 1. Inner batches are read through
    :func:`hypergrad.batches.per_step`: a :class:`~hypergrad.batches.StepBatches` gives the
    :math:`T + L + 1` fresh batches of a call (in the order above), a plain batch is reused for
    all (and its graph of :math:`\nabla_w g` is built once for the :math:`L` products).
    ``takes_step_batches`` is True, so :func:`hypergrad.solve` hands AmIGO a ``StepBatches`` over
    its batch stream: every step draws a fresh batch, as in the paper. With exact solves (``w`` at :math:`w^*(\lambda)`, :math:`v` at
    :math:`H^{-1} \nabla_w f`, full batches) the direction is :class:`~hypergrad.implicit.Implicit`'s
    hypergradient.

    Mapping from benchmark_bilevel's ``amigo.py`` (``step_size``, ``outer_ratio``,
    ``n_inner_steps``, constant steps): ``AmIGO(step_size, inner_steps=n_inner_steps,
    linear_steps=n_inner_steps)`` with the outer optimizer
    ``lambda p: torch.optim.SGD(p, lr=step_size / outer_ratio)``, ``inner_steps=0`` in
    :func:`hypergrad.solve`.

    State (``result.state``, pass it back): ``"v"`` (zeros at the start) and ``"step"`` (the
    ``t`` of the schedules).

    Cost per call: :math:`T + L + 2` oracle calls (``info.grad_evals``; per oracle in
    ``info.extra["oracle_calls"]``): :math:`T` inner gradients, :math:`L` Hessian-vector products,
    one mixed product, one outer gradient. ``info.residual`` is the last inner batch gradient norm
    (before its step; None when ``inner_steps=0``), ``info.extra["linear_residual"]`` the last
    :math:`\lVert H_{i} v - \nabla_w f_j \rVert` (before its step; None when ``linear_steps=0``). ``info.converged`` is None (no
    stopping test).

    Step sizes: :math:`\rho, \eta < 2 / L_g` for stable recursions (:math:`L_g`: the largest
    batch-Hessian eigenvalue); the paper uses constant steps, with numbers of inner steps
    :math:`T, L` that grow with the condition number :math:`\kappa` of the inner Hessian.

    Args:
        step_size: :math:`\rho` of the inner SGD: a number > 0 or a schedule ``t -> rho_t``.
        inner_steps: :math:`T \ge 0`.
        linear_steps: :math:`L \ge 0`.
        linear_step_size: :math:`\eta` of the linear-system SGD (None: ``step_size``).
        compile: run each call as one graph traced by :func:`torch.compile` and compiled by
            inductor (:func:`hypergrad.stochastic.compiled_stochastic`): the same arithmetic, state
            and counts; step sizes and batch tensors are graph inputs (no recompile per step or
            batch); eager with a log line where compilation fails; ``info.extra["compiled"]``
            and ``["compile_s"]`` say what happened.

    Raises:
        TypeError: a step count that is not an int, a step size that is neither a number nor
            a callable, or a non-bool ``compile``.
        ValueError: a negative step count, a step size that is not finite and > 0, a malformed
            state, or a ``StepBatches`` with fewer than :math:`T + L + 1` batches.
        hypergrad.NonFiniteError: a loss, gradient, product or update is NaN or inf.

    Example:
        >>> import torch, hypergrad as hg
        >>> g = lambda w, lam, b: 0.5 * ((w["x"] - lam["c"]) ** 2).sum()
        >>> f = lambda w, lam, b: 0.5 * ((w["x"] - 3.0) ** 2).sum()
        >>> amigo = hg.AmIGO(step_size=0.5, inner_steps=5, linear_steps=5)
        >>> res = hg.solve(hg.BilevelProblem(g, f), {"x": torch.zeros(1)}, {"c": torch.zeros(1)},
        ...                amigo, lambda p: torch.optim.SGD(p, lr=0.5), steps=40, progress=False)
        >>> round(res.lam["c"].item(), 4)
        3.0
        >>> r = amigo.hypergrad(hg.BilevelProblem(g, f), res.w, res.lam, state=res.state.method)
        >>> r.info.grad_evals, r.info.extra["oracle_calls"]["hvp"]
        (12, 5)
    """

    takes_step_batches: ClassVar[bool] = True

    step_size: StepSize
    _: KW_ONLY  # the options below are keyword-only
    inner_steps: int = 10
    linear_steps: int = 10
    linear_step_size: StepSize | None = None
    compile: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.compile, bool):
            raise TypeError(f"compile must be a bool, got {type(self.compile).__name__}")
        check_step_size(self.step_size, "step_size")
        if self.linear_step_size is not None:
            check_step_size(self.linear_step_size, "linear_step_size")
        _check_steps(self.inner_steps, "inner_steps")
        _check_steps(self.linear_steps, "linear_steps")

    def hypergrad(
        self,
        problem: BilevelProblem,
        w: Tree,
        lam: Tree,
        inner_batch: Any = None,
        outer_batch: Any = None,
        state: dict[str, Any] | None = None,
    ) -> HypergradResult:
        """One AmIGO outer iteration: ``grad`` is the implicit-gradient estimate at the advanced ``w``."""
        if self.compile:
            return compiled_stochastic(self, problem, w, lam, inner_batch, outer_batch, state, call=_amigo_call)
        w, lam = problem.validate(w, lam)
        w, lam = tree_detach(w), tree_detach(lam)
        t = step_counter(state, "AmIGO")
        v = linear_iterate(state, w, "AmIGO")
        T, L = self.inner_steps, self.linear_steps
        rho = step_size_at(self.step_size, t, "step_size")
        eta = rho if self.linear_step_size is None else step_size_at(self.linear_step_size, t, "linear_step_size")
        batches = per_step(inner_batch, T + L + 1)

        inner_residual: float | None = None
        for batch in batches[:T]:
            grad = inner_products(problem, w, lam, batch).grad
            inner_residual = float(tree_norm(grad))
            w = tree_detach(tree_axpy(-rho, grad, w))
        check_finite(w, "AmIGO inner iterate w")
        grad_w_f, grad_lam_f = outer_grads(problem, w, lam, one_batch(outer_batch))
        linear_residual: float | None = None
        hvp = hessian_products(problem, w, lam, inner_batch)
        for batch in batches[T : T + L]:
            d_v = tree_sub(hvp(batch, v), grad_w_f)
            linear_residual = float(tree_norm(d_v))
            v = tree_detach(tree_axpy(-eta, d_v, v))
        check_finite(v, "AmIGO linear-system iterate v")
        cross = inner_products(problem, w, lam, batches[T + L], v, cross=True).cross
        assert cross is not None
        d_lam = tree_sub(grad_lam_f, cross)
        check_finite(d_lam, "AmIGO hypergradient estimate")
        calls = OracleCounts(inner_grad=T, hvp=L, cross=1, outer_grad=1)
        info = HypergradInfo(
            iterations=T + L,
            residual=inner_residual,
            converged=None,
            grad_evals=calls.total,
            extra={
                "oracle_calls": calls.as_dict(),
                "step": t,
                "step_size": rho,
                "linear_step_size": eta,
                "linear_residual": linear_residual,
            },
        )
        return HypergradResult(tree_detach(d_lam), w, info, {"v": v, "step": t + 1})


# ------------------------------------------------------------ the compiled stage (compile=True)


@traced_stage("the AmIGO step")
def _amigo_stage(problem: BilevelProblem, w: Tree, lam: Tree, v: Tree, rho: Tensor, eta: Tensor,
                 batches: list[Any], outer_batch: Any, shared: bool, inner_steps: int) -> tuple[Any, ...]:
    """One call of :meth:`hypergrad.amigo.AmIGO.hypergrad` as a traceable function (same arithmetic)."""
    w, inner_residual = traced_inner_sgd(problem, w, lam, rho, batches[:inner_steps])
    grad_w_f, grad_lam_f, f_value = traced_outer_grads(problem, w, lam, outer_batch)
    linear_residual = torch.zeros_like(rho)
    for product in traced_hessian_products(problem, w, lam, batches[inner_steps:-1], shared):
        d_v = tree_sub(product(v), grad_w_f)
        linear_residual = tree_norm(d_v)
        v = tree_axpy(-eta, d_v, v)
    cross, g_value = traced_cross_product(problem, w, lam, batches[-1], v)
    d_lam = tree_sub(grad_lam_f, cross)
    finite = all_finite([g_value, f_value], [w, grad_w_f, grad_lam_f, v, d_lam])
    return d_lam, w, v, torch.stack([inner_residual, linear_residual, finite.to(rho.dtype)])


def _amigo_call(method: Any, problem: BilevelProblem, w: Tree, lam: Tree, inner_batch: Any, outer_batch: Any,
                state: dict[str, Any] | None, t: int) -> HypergradResult | None:
    """``T`` inner steps, ``L`` linear-system steps, one mixed product, by the compiled stage."""
    n_products = method.linear_steps
    second = method.linear_step_size
    T = method.inner_steps
    rho = step_size_at(method.step_size, t, "step_size")
    eta = rho if second is None else step_size_at(second, t, "linear_step_size")
    batches = per_step(inner_batch, T + n_products + 1)
    shared = not isinstance(inner_batch, StepBatches)
    rho_t, eta_t = tensor_like(rho, w), tensor_like(eta, w)
    v = linear_iterate(state, w, "AmIGO")
    ran = run_stage(problem, _amigo_stage, w, lam, v, rho_t, eta_t, batches, one_batch(outer_batch), shared, T,
                    checks=(w, lam, batches[0]))
    if ran is None:
        return None
    (d_lam, new_w, v, scalars), compile_s = ran
    inner_residual, last, finite = scalars.tolist()
    if not finite:
        return NON_FINITE
    residual = inner_residual if T else None
    calls = OracleCounts(inner_grad=T, hvp=n_products, cross=1, outer_grad=1)
    extra = {"step": t, "step_size": rho, "linear_step_size": eta,
             "linear_residual": last if n_products else None}
    info = compiled_info(calls, T + n_products, residual, extra, compile_s)
    return HypergradResult(d_lam, new_w, info, {"v": v, "step": t + 1})
