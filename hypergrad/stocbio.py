r"""StocBiO: inner SGD and a stochastic Neumann series (Ji, Yang, Liang, 2021)."""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass
from typing import Any, ClassVar, TypeVar

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
from hypergrad.tree import (
    Tree,
    check_finite,
    tree_add,
    tree_axpy,
    tree_detach,
    tree_norm,
    tree_scale,
    tree_sub,
)

__all__ = ["StocBiO"]


_Class = TypeVar("_Class", bound=type)


def _renamed_arguments(**renames: str) -> Callable[[_Class], _Class]:
    """Accept each old keyword of the constructor (``old=new``) with a ``DeprecationWarning``."""

    def decorate(cls: _Class) -> _Class:
        init = cls.__init__

        @functools.wraps(init)
        def init_with_old_names(self: Any, *args: Any, **kwargs: Any) -> None:
            for old, new in renames.items():
                if old in kwargs:
                    if new in kwargs:
                        raise TypeError(f"{cls.__name__}: pass {new} only ({old} is its deprecated name)")
                    warnings.warn(f"{cls.__name__}({old}=...) is deprecated; use {new}=... (same meaning)",
                                  DeprecationWarning, stacklevel=2)
                    kwargs[new] = kwargs.pop(old)
            init(self, *args, **kwargs)

        cls.__init__ = init_with_old_names  # type: ignore[misc]
        return cls

    return decorate


def _check_steps(value: object, name: str) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")


@_renamed_arguments(neumann_steps="linear_steps", neumann_step_size="linear_step_size")
@dataclass(frozen=True)
class StocBiO:
    r"""StocBiO: ``T`` inner SGD steps, then a stochastic Neumann series with a fresh batch per term.

    K. Ji, J. Yang and Y. Liang, "Bilevel optimization: convergence analysis and enhanced
    design", ICML 2021.

    Each call, with fresh inner batches :math:`i_1, i_2, \ldots` and one outer batch :math:`j`:

    1. ``inner_steps`` (:math:`T`) SGD steps :math:`w \leftarrow w - \rho\, \nabla_w g_{i_k}`
       from the given ``w`` (warm start across calls through ``result.w``);
    2. :math:`b = \nabla_w f_j` and :math:`\nabla_\lambda f_j` at the new ``w``;
    3. the truncated Neumann series of :math:`H^{-1} b` with ``linear_steps`` (:math:`Q`)
       Hessian-vector products, each on its own batch:

       .. math::
           v = \eta \sum_{q=0}^{Q} \prod_{k=1}^{q} (I - \eta H_{i_{T+k}})\, b ,

       (:math:`Q + 1` terms; with one Hessian :math:`H` it is
       :math:`\eta \sum_{q \le Q} (I - \eta H)^q b \to H^{-1} b` as :math:`Q \to \infty` for
       :math:`0 < \eta < 2 / L_g`, with bias :math:`(I - \eta H)^{Q+1} H^{-1} b`);
    4. ``result.grad`` :math:`= \nabla_\lambda f_j - \nabla^2_{\lambda w} g_{i}\, v` with one more
       inner batch; the outer optimizer takes the outer step (``torch.optim.SGD(lr=gamma)``).

    Inner batches are read through :func:`hypergrad.batches.per_step`: a
    :class:`~hypergrad.batches.StepBatches` gives the :math:`T + Q + 1` fresh batches of a call
    (in the order above), a plain batch is reused for all (and its graph of :math:`\nabla_w g`
    is built once for the :math:`Q` products). ``takes_step_batches`` is True, so
    :func:`hypergrad.solve` hands StocBiO a ``StepBatches`` over its batch stream: every term
    draws a fresh batch, as in the paper.

    Mapping from benchmark_bilevel's ``stocbio.py`` (``step_size``, ``outer_ratio``,
    ``n_inner_steps``, ``n_shia_steps``, constant steps): ``StocBiO(step_size,
    inner_steps=n_inner_steps, linear_steps=n_shia_steps)`` with the outer optimizer
    ``lambda p: torch.optim.SGD(p, lr=step_size / outer_ratio)``, ``inner_steps=0`` in
    :func:`hypergrad.solve`.

    State (``result.state``): ``"step"`` only (the ``t`` of the schedules); the series starts from
    :math:`b` on every call (no warm start of :math:`v`, unlike :class:`~hypergrad.amigo.AmIGO`).

    Cost per call: :math:`T + Q + 2` oracle calls (``info.grad_evals``; per oracle in
    ``info.extra["oracle_calls"]``). ``info.residual`` is the last inner batch gradient norm
    (before its step; None when ``inner_steps=0``); ``info.extra["last_term_norm"]`` is the norm
    of the last series term :math:`\eta \lVert\prod (I - \eta H) b\rVert` (small when :math:`Q` is
    large enough). ``info.converged`` is None (no stopping test).

    Args:
        step_size: :math:`\rho` of the inner SGD: a number > 0 or a schedule ``t -> rho_t``.
        inner_steps: :math:`T \ge 0`.
        linear_steps: :math:`Q \ge 0`, the Hessian-vector products of the series (the same name
            as AmIGO's count of linear-system steps; ``neumann_steps``, its former name, still
            works with a ``DeprecationWarning``).
        linear_step_size: :math:`\eta` of the series (None: ``step_size``; formerly
            ``neumann_step_size``, which still works with a ``DeprecationWarning``).
        compile: run each call as one graph traced by :func:`torch.compile` and compiled by
            inductor (:func:`hypergrad.stochastic.compiled_stochastic`): the same arithmetic, state
            and counts; step sizes and batch tensors are graph inputs (no recompile per step or
            batch); eager with a log line where compilation fails; ``info.extra["compiled"]``
            and ``["compile_s"]`` say what happened.

    Raises:
        TypeError: a step count that is not an int, a step size that is neither a number nor
            a callable, or a non-bool ``compile``.
        ValueError: a negative step count, a step size that is not finite and > 0, or a
            ``StepBatches`` with fewer than :math:`T + Q + 1` batches.
        hypergrad.NonFiniteError: a loss, gradient, product or update is NaN or inf.

    Example:
        >>> import torch, hypergrad as hg
        >>> g = lambda w, lam, b: 0.5 * ((w["x"] - lam["c"]) ** 2).sum()
        >>> f = lambda w, lam, b: 0.5 * ((w["x"] - 3.0) ** 2).sum()
        >>> stocbio = hg.StocBiO(step_size=0.5, inner_steps=5, linear_steps=20)
        >>> res = hg.solve(hg.BilevelProblem(g, f), {"x": torch.zeros(1)}, {"c": torch.zeros(1)},
        ...                stocbio, lambda p: torch.optim.SGD(p, lr=0.5), steps=40, progress=False)
        >>> round(res.lam["c"].item(), 4)
        3.0
        >>> stocbio.hypergrad(hg.BilevelProblem(g, f), res.w, res.lam).info.extra["oracle_calls"]
        {'inner_grad': 5, 'hvp': 20, 'cross': 1, 'outer_grad': 1}
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

    @property
    def neumann_steps(self) -> int:
        """Deprecated name of :attr:`linear_steps` (reading it warns)."""
        warnings.warn("StocBiO.neumann_steps is deprecated; use linear_steps", DeprecationWarning, stacklevel=2)
        return self.linear_steps

    @property
    def neumann_step_size(self) -> StepSize | None:
        """Deprecated name of :attr:`linear_step_size` (reading it warns)."""
        warnings.warn("StocBiO.neumann_step_size is deprecated; use linear_step_size", DeprecationWarning, stacklevel=2)
        return self.linear_step_size

    def hypergrad(
        self,
        problem: BilevelProblem,
        w: Tree,
        lam: Tree,
        inner_batch: Any = None,
        outer_batch: Any = None,
        state: dict[str, Any] | None = None,
    ) -> HypergradResult:
        """One StocBiO outer iteration: ``grad`` is the Neumann hypergradient estimate at the advanced ``w``."""
        if self.compile:
            return compiled_stochastic(self, problem, w, lam, inner_batch, outer_batch, state, call=_stocbio_call)
        w, lam = problem.validate(w, lam)
        w, lam = tree_detach(w), tree_detach(lam)
        t = step_counter(state, "StocBiO")
        T, Q = self.inner_steps, self.linear_steps
        rho = step_size_at(self.step_size, t, "step_size")
        eta = rho if self.linear_step_size is None else step_size_at(self.linear_step_size, t, "linear_step_size")
        batches = per_step(inner_batch, T + Q + 1)

        inner_residual: float | None = None
        for batch in batches[:T]:
            grad = inner_products(problem, w, lam, batch).grad
            inner_residual = float(tree_norm(grad))
            w = tree_detach(tree_axpy(-rho, grad, w))
        check_finite(w, "StocBiO inner iterate w")
        grad_w_f, grad_lam_f = outer_grads(problem, w, lam, one_batch(outer_batch))
        term, total = grad_w_f, grad_w_f
        hvp = hessian_products(problem, w, lam, inner_batch)
        for batch in batches[T : T + Q]:
            term = tree_detach(tree_axpy(-eta, hvp(batch, term), term))
            total = tree_add(total, term)
        v = tree_scale(total, eta)
        check_finite(v, "StocBiO Neumann estimate v")
        cross = inner_products(problem, w, lam, batches[T + Q], v, cross=True).cross
        assert cross is not None
        d_lam = tree_sub(grad_lam_f, cross)
        check_finite(d_lam, "StocBiO hypergradient estimate")
        calls = OracleCounts(inner_grad=T, hvp=Q, cross=1, outer_grad=1)
        info = HypergradInfo(
            iterations=T + Q,
            residual=inner_residual,
            converged=None,
            grad_evals=calls.total,
            extra={
                "oracle_calls": calls.as_dict(),
                "step": t,
                "step_size": rho,
                "neumann_step_size": eta,
                "last_term_norm": eta * float(tree_norm(term)),
                "v": tree_detach(v),
            },
        )
        return HypergradResult(tree_detach(d_lam), w, info, {"step": t + 1})


# ------------------------------------------------------------ the compiled stage (compile=True)


@traced_stage("the StocBiO step")
def _stocbio_stage(problem: BilevelProblem, w: Tree, lam: Tree, rho: Tensor, eta: Tensor, batches: list[Any],
                   outer_batch: Any, shared: bool, inner_steps: int) -> tuple[Any, ...]:
    """One call of :meth:`hypergrad.stocbio.StocBiO.hypergrad` as a traceable function (same arithmetic)."""
    w, inner_residual = traced_inner_sgd(problem, w, lam, rho, batches[:inner_steps])
    grad_w_f, grad_lam_f, f_value = traced_outer_grads(problem, w, lam, outer_batch)
    term = total = grad_w_f
    for product in traced_hessian_products(problem, w, lam, batches[inner_steps:-1], shared):
        term = tree_axpy(-eta, product(term), term)
        total = tree_add(total, term)
    v = tree_scale(total, eta)
    cross, g_value = traced_cross_product(problem, w, lam, batches[-1], v)
    d_lam = tree_sub(grad_lam_f, cross)
    finite = all_finite([g_value, f_value], [w, grad_w_f, grad_lam_f, v, d_lam])
    return d_lam, w, v, torch.stack([inner_residual, tree_norm(term), finite.to(rho.dtype)])


def _stocbio_call(method: Any, problem: BilevelProblem, w: Tree, lam: Tree, inner_batch: Any, outer_batch: Any,
                  state: dict[str, Any] | None, t: int) -> HypergradResult | None:
    """``T`` inner steps, ``Q`` Neumann terms, one mixed product, by the compiled stage."""
    n_products = method.linear_steps
    second = method.linear_step_size
    T = method.inner_steps
    rho = step_size_at(method.step_size, t, "step_size")
    eta = rho if second is None else step_size_at(second, t, "linear_step_size")
    batches = per_step(inner_batch, T + n_products + 1)
    shared = not isinstance(inner_batch, StepBatches)
    rho_t, eta_t = tensor_like(rho, w), tensor_like(eta, w)
    ran = run_stage(problem, _stocbio_stage, w, lam, rho_t, eta_t, batches, one_batch(outer_batch), shared, T,
                    checks=(w, lam, batches[0]))
    if ran is None:
        return None
    (d_lam, new_w, v, scalars), compile_s = ran
    inner_residual, last, finite = scalars.tolist()
    if not finite:
        return NON_FINITE
    residual = inner_residual if T else None
    calls = OracleCounts(inner_grad=T, hvp=n_products, cross=1, outer_grad=1)
    extra = {"step": t, "step_size": rho, "neumann_step_size": eta, "last_term_norm": eta * last, "v": v}
    info = compiled_info(calls, T + n_products, residual, extra, compile_s)
    return HypergradResult(d_lam, new_w, info, {"step": t + 1})
