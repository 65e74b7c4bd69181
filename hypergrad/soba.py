r"""SOBA: single-loop stochastic bilevel optimization (Dagréou, Ablin, Vaiter, Moreau, 2022)."""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass
from typing import Any

import torch
from torch import Tensor

from hypergrad.compiled import all_finite, run_stage, traced_stage
from hypergrad.problem import BilevelProblem, HypergradInfo, HypergradResult
from hypergrad.stochastic import (
    NON_FINITE,
    OracleCounts,
    StepSize,
    check_step_size,
    compiled_info,
    compiled_stochastic,
    inner_products,
    linear_iterate,
    one_batch,
    outer_grads,
    step_counter,
    step_size_at,
    tensor_like,
    traced_inner_products,
    traced_outer_grads,
)
from hypergrad.tree import Tree, check_finite, tree_axpy, tree_detach, tree_norm, tree_sub

__all__ = ["SOBA"]


@dataclass(frozen=True)
class SOBA:
    r"""SOBA: one stochastic step on :math:`w`, on the linear-system iterate :math:`v` and on :math:`\lambda`.

    M. Dagréou, P. Ablin, S. Vaiter and T. Moreau, "A framework for bilevel optimization that
    enables stochastic and global variance reduction algorithms", NeurIPS 2022.

    Each call draws one inner batch :math:`i` and one outer batch :math:`j` and, at the current
    :math:`(w, v, \lambda)`, evaluates

    .. math::
        D_w = \nabla_w g_i, \qquad
        D_v = \nabla^2_{ww} g_i\, v - \nabla_w f_j, \qquad
        D_\lambda = \nabla_\lambda f_j - \nabla^2_{\lambda w} g_i\, v ,

    then returns ``w - rho_t * D_w`` as ``result.w``, carries ``v - rho_t * D_v`` in
    ``result.state["v"]`` and returns :math:`D_\lambda` as ``result.grad``; the outer optimizer
    takes the paper's outer step :math:`\lambda \leftarrow \lambda - \gamma_t D_\lambda` (with
    ``torch.optim.SGD(lr=gamma)``, or :class:`~hypergrad.stochastic.ScheduledSGD` for a
    decreasing :math:`\gamma_t`). :math:`v` approximates
    :math:`[\nabla^2_{ww} g]^{-1} \nabla_w f`, so at the fixed point :math:`D_\lambda` is the
    exact hypergradient (the paper and benchmark_bilevel carry :math:`-v`; same numbers).

    Mapping from benchmark_bilevel's ``soba.py`` (``step_size``, ``outer_ratio``, steps
    :math:`c / \sqrt{t + 1}`): ``SOBA(step_size=Decreasing(step_size, 0.5))`` with the outer
    optimizer ``lambda p: ScheduledSGD(p, Decreasing(step_size / outer_ratio, 0.5))``
    (:class:`~hypergrad.stochastic.Decreasing`); run it through :func:`hypergrad.solve` with
    ``inner_steps=0`` and one inner and one outer batch per step. All three updates use the
    same iterates, as in the paper: ``hypergrad.solve`` evaluates ``grad`` at the ``w`` it
    passes and only then moves to ``result.w``.

    State (``result.state``, pass it back): ``"v"`` (shaped like ``w``, zeros at the start) and
    ``"step"`` (the calls so far, the ``t`` of the schedules).

    Cost per call: 4 oracle calls (``info.grad_evals``; per oracle in
    ``info.extra["oracle_calls"]``): one inner gradient, one Hessian-vector product, one mixed
    product (the two products share one backward pass) and one outer gradient.

    ``info.residual`` is the batch gradient norm :math:`\lVert\nabla_w g_i\rVert`;
    ``info.extra["linear_residual"]`` is :math:`\lVert D_v \rVert`. There is no tolerance:
    ``info.converged`` is None (a single step solves nothing; judge convergence by the
    iterates).

    Step sizes: the paper's analysis takes :math:`\rho_t \propto t^{-2/5}`,
    :math:`\gamma_t \propto t^{-3/5}` (``Decreasing(rho, 0.4)`` and ``Decreasing(gamma, 0.6)``);
    benchmark_bilevel uses :math:`t^{-1/2}` for both; with constant steps the iterates reach a
    noise ball of radius :math:`O(\rho)` (see :doc:`/methods/stochastic`).
    :math:`\rho` must be below :math:`2 / L` (:math:`L`: the largest eigenvalue of the batch
    Hessians) for the :math:`w` and :math:`v` recursions to be stable.

    Args:
        step_size: :math:`\rho` of the :math:`w` and :math:`v` steps: a number > 0 or a schedule
            ``t -> rho_t`` (e.g. ``Decreasing(0.1, 0.5)``).
        compile: run each call as one graph traced by :func:`torch.compile` and compiled by
            inductor (:func:`hypergrad.stochastic.compiled_stochastic`): the same arithmetic, state
            and counts; step sizes and batch tensors are graph inputs (no recompile per step or
            batch); eager with a log line where compilation fails; ``info.extra["compiled"]``
            and ``["compile_s"]`` say what happened.

    Raises:
        TypeError: ``step_size`` is neither a number nor a callable, or ``compile`` is not a bool.
        ValueError: ``step_size`` is not a finite number > 0 (or a schedule returns one),
            ``state["v"]`` is not shaped like ``w``, or ``state["step"]`` is not an int >= 0.
        hypergrad.NonFiniteError: a loss, gradient, product or update is NaN or inf.

    Example:
        >>> import torch, hypergrad as hg
        >>> g = lambda w, lam, b: 0.5 * ((w["x"] - lam["c"]) ** 2).sum()
        >>> f = lambda w, lam, b: 0.5 * ((w["x"] - 3.0) ** 2).sum()
        >>> res = hg.solve(hg.BilevelProblem(g, f), {"x": torch.zeros(1)}, {"c": torch.zeros(1)},
        ...                hg.SOBA(step_size=0.5), lambda p: torch.optim.SGD(p, lr=0.2),
        ...                steps=200, progress=False)
        >>> round(res.lam["c"].item(), 4), round(res.state.method["v"]["x"].item(), 4)  # c* = 3, v* = 0
        (3.0, 0.0)
        >>> res.state.method["step"]
        200
    """

    step_size: StepSize
    _: KW_ONLY  # the options below are keyword-only
    compile: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.compile, bool):
            raise TypeError(f"compile must be a bool, got {type(self.compile).__name__}")
        check_step_size(self.step_size, "step_size")

    def hypergrad(
        self,
        problem: BilevelProblem,
        w: Tree,
        lam: Tree,
        inner_batch: Any = None,
        outer_batch: Any = None,
        state: dict[str, Any] | None = None,
    ) -> HypergradResult:
        """One SOBA step: ``grad`` is :math:`D_\\lambda`, ``w`` and ``state["v"]`` are advanced.

        A :class:`~hypergrad.batches.StepBatches` as a batch gives one batch (SOBA uses one
        inner and one outer batch per call).
        """
        if self.compile:
            return compiled_stochastic(self, problem, w, lam, inner_batch, outer_batch, state, call=_soba_call)
        w, lam = problem.validate(w, lam)
        w, lam = tree_detach(w), tree_detach(lam)
        t = step_counter(state, "SOBA")
        v = linear_iterate(state, w, "SOBA")
        rho = step_size_at(self.step_size, t, "step_size")
        inner = inner_products(problem, w, lam, one_batch(inner_batch), v, hvp=True, cross=True)
        grad_w_f, grad_lam_f = outer_grads(problem, w, lam, one_batch(outer_batch))
        assert inner.hvp is not None and inner.cross is not None
        d_v = tree_sub(inner.hvp, grad_w_f)
        d_lam = tree_sub(grad_lam_f, inner.cross)
        new_w = tree_detach(tree_axpy(-rho, inner.grad, w))
        new_v = tree_detach(tree_axpy(-rho, d_v, v))
        check_finite(d_lam, "SOBA direction D_lam")
        check_finite(new_w, "SOBA inner iterate w")
        check_finite(new_v, "SOBA linear-system iterate v")
        calls = OracleCounts(inner_grad=1, hvp=1, cross=1, outer_grad=1)
        info = HypergradInfo(
            iterations=1,
            residual=float(tree_norm(inner.grad)),
            converged=None,
            grad_evals=calls.total,
            extra={
                "oracle_calls": calls.as_dict(),
                "step": t,
                "step_size": rho,
                "linear_residual": float(tree_norm(d_v)),
            },
        )
        return HypergradResult(tree_detach(d_lam), new_w, info, {"v": new_v, "step": t + 1})


# ------------------------------------------------------------ the compiled stage (compile=True)


@traced_stage("the SOBA step")
def _soba_stage(problem: BilevelProblem, w: Tree, lam: Tree, v: Tree, rho: Tensor, inner_batch: Any,
                outer_batch: Any) -> tuple[Any, ...]:
    """One call of :meth:`hypergrad.soba.SOBA.hypergrad` as a traceable function (same arithmetic)."""
    grad, hv, cross, g_value = traced_inner_products(problem, w, lam, inner_batch, v)
    grad_w_f, grad_lam_f, f_value = traced_outer_grads(problem, w, lam, outer_batch)
    d_v = tree_sub(hv, grad_w_f)
    d_lam = tree_sub(grad_lam_f, cross)
    new_w, new_v = tree_axpy(-rho, grad, w), tree_axpy(-rho, d_v, v)
    finite = all_finite([g_value, f_value], [grad, hv, cross, grad_w_f, grad_lam_f, d_lam, new_w, new_v])
    return d_lam, new_w, new_v, torch.stack([tree_norm(grad), tree_norm(d_v), finite.to(rho.dtype)])


def _soba_call(method: Any, problem: BilevelProblem, w: Tree, lam: Tree, inner_batch: Any, outer_batch: Any,
               state: dict[str, Any] | None, t: int) -> HypergradResult | None:
    v = linear_iterate(state, w, "SOBA")
    rho = step_size_at(method.step_size, t, "step_size")
    batch = one_batch(inner_batch)
    ran = run_stage(problem, _soba_stage, w, lam, v, tensor_like(rho, w), batch, one_batch(outer_batch),
                    checks=(w, lam, batch))
    if ran is None:
        return None
    (d_lam, new_w, new_v, scalars), compile_s = ran
    residual, linear_residual, finite = scalars.tolist()
    if not finite:
        return NON_FINITE
    calls = OracleCounts(inner_grad=1, hvp=1, cross=1, outer_grad=1)
    info = compiled_info(calls, 1, residual,
                         {"step": t, "step_size": rho, "linear_residual": linear_residual}, compile_s)
    return HypergradResult(d_lam, new_w, info, {"v": new_v, "step": t + 1})
