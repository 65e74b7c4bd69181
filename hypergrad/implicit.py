r"""Exact hypergradients by the implicit function theorem."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass, field
from typing import Any, NamedTuple

import torch
from torch import Tensor

from hypergrad.autodiff import RootSystem, loss_and_grads, outer_fn
from hypergrad.compiled import CompiledStage, compiled_products, traced_stage, unflatten_view
from hypergrad.errors import ConvergenceWarning, check_not_class, report
from hypergrad.linear import CG
from hypergrad.linear.base import LinearSolveResult, LinearSystem
from hypergrad.problem import BilevelProblem, HypergradInfo, HypergradResult
from hypergrad.tree import (
    Tree,
    check_finite,
    tree_detach,
    tree_flatten_view,
    tree_norm,
    tree_sub,
    tree_unflatten,
)

__all__ = ["Implicit", "compiled_stage", "products_stage"]


def _check_value(value: Tensor, message: str) -> None:
    if not bool(torch.isfinite(value)):
        from hypergrad.errors import NonFiniteError

        raise NonFiniteError(message.format(float(value)))


LinearSolver = Callable[[LinearSystem, Tree | None], LinearSolveResult]


@dataclass(frozen=True)
class Implicit:
    r"""Implicit differentiation at an (approximate) inner solution.

    With the optimality condition :math:`F(w, \lambda) = 0` (by default
    :math:`F = \nabla_w g`; with ``fixed_point=T``, :math:`F = w - T(w, \lambda)`), the
    hypergradient is

    .. math::
        \nabla F(\lambda) = \nabla_\lambda f - (\partial_\lambda F)^\top u, \qquad
        (\partial_w F)^\top u = \nabla_w f.

    In gradient form :math:`\partial_w F` is the Hessian :math:`\nabla^2_{ww} g` and
    :math:`(\partial_\lambda F)^\top u = \nabla^2_{\lambda w} g\, u`. Products use a graph of
    ``F`` built once and retained (one backward pass each); no Hessian is formed except by
    :class:`~hypergrad.linear.Dense`.

    Cost: one gradient with graph, one outer gradient, one product per solver iteration, one mixed
    product. Exact when ``w`` solves the inner problem; the error is first order in the inner
    residual otherwise (reported in ``info.extra["inner_residual"]``).

    Args:
        solver: a linear solver from :mod:`hypergrad.linear` (default ``CG(tol=1e-6)``).
        fixed_point: optional map ``T(w, lam, batch) -> w`` whose fixed point is the inner
            solution; the system is then non-symmetric (use ``NormalCG``, ``Dense`` or ``Neumann``).
        products: ``"reverse"`` (retained graph, fastest measured) or ``"forward"``
            (``torch.func`` jvp over grad, recomputed each product).
        warm_start: reuse the previous solve's ``u`` (passed through ``state``) as ``x0``.
        compile: take the gradients and products from a stage traced once by
            :func:`torch.compile` and compiled by inductor (:mod:`hypergrad.compiled`): per
            hypergradient one guarded call runs the forward and first backward passes, and every
            solver iteration calls the compiled Hessian-vector product directly, without the
            autograd engine. Any solver of :mod:`hypergrad.linear` works; the gradient form only
            (``fixed_point=None``, ``products="reverse"``). Compiles once per problem, shape and
            dtype (5-45 s for the first problem of a process on a CPU, 1-6 s for later ones),
            then reuses it; falls back to the eager products, with a log line, where
            compilation fails. ``info.extra["compiled"]`` says which path ran
            and ``info.extra["compile_s"]`` how long this call spent compiling.

    Example:
        >>> import torch, hypergrad as hg
        >>> g = lambda w, lam, b: 0.5 * ((w["x"] - lam["c"]) ** 2).sum()
        >>> f = lambda w, lam, b: 0.5 * (w["x"] ** 2).sum()
        >>> lam = {"c": torch.tensor([1.0, 2.0], dtype=torch.float64)}
        >>> r = hg.Implicit(hg.linear.Dense()).hypergrad(hg.BilevelProblem(g, f), {"x": lam["c"].clone()}, lam)
        >>> r.grad["c"].tolist()   # w* = c, so dF/dc = c
        [1.0, 2.0]
    """

    solver: LinearSolver = field(default_factory=lambda: CG(tol=1e-6))
    _: KW_ONLY  # the options below are keyword-only
    fixed_point: Callable[[Tree, Tree, Any], Tree] | None = None
    products: str = "reverse"
    warm_start: bool = False
    compile: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.compile, bool):
            raise TypeError(f"compile must be a bool, got {type(self.compile).__name__}")
        if self.compile and (self.fixed_point is not None or self.products != "reverse"):
            raise ValueError(
                "compile=True needs the gradient form (fixed_point=None) and products='reverse', got "
                f"fixed_point={self.fixed_point!r}, products={self.products!r}"
            )
        check_not_class(self.solver, "solver")
        if not callable(self.solver):
            raise TypeError(f"solver must be a linear solver from hypergrad.linear, got {self.solver!r}")
        if self.products not in ("reverse", "forward"):
            raise ValueError(f"products must be 'reverse' or 'forward', got {self.products!r}")

    def hypergrad(
        self,
        problem: BilevelProblem,
        w: Tree,
        lam: Tree,
        inner_batch: Any = None,
        outer_batch: Any = None,
        state: dict[str, Any] | None = None,
    ) -> HypergradResult:
        """Return the implicit hypergradient at ``(w, lam)``; ``w`` is returned unchanged."""
        w, lam = problem.validate(w, lam)
        x0 = state.get("u") if (self.warm_start and state) else None
        stage = compiled_stage(problem, w, lam, inner_batch, outer_batch) if self.compile else None
        if stage is not None:
            system, grad_lam_f, residual_tree, mixed_product = _compiled_parts(stage, w)
        else:
            system, grad_lam_f, residual_tree, mixed_product = self._eager_parts(
                problem, w, lam, inner_batch, outer_batch)
        solve = self.solver(system, x0)
        report(solve.warnings, ConvergenceWarning, repeated=solve.repeated_warnings, stacklevel=2)
        check_finite(solve.solution, "implicit linear solve")
        mixed = mixed_product(solve.solution)
        grad = tree_sub(grad_lam_f, mixed)
        check_finite(grad, "Implicit hypergradient")
        info = HypergradInfo(
            iterations=solve.iterations,
            residual=solve.residual,
            converged=solve.converged,
            stopping_test="linear solve",
            warnings=list(solve.warnings),
            grad_evals=3 + solve.matvecs,
            extra={"inner_residual": float(tree_norm(residual_tree)), "matvecs": solve.matvecs,
                   "compiled": stage is not None, "compile_s": stage.compile_s if stage is not None else 0.0},
        )
        new_state = {"u": tree_detach(solve.solution)} if self.warm_start else None
        return HypergradResult(tree_detach(grad), tree_detach(w), info, new_state)

    def _eager_parts(self, problem: BilevelProblem, w: Tree, lam: Tree, inner_batch: Any,
                     outer_batch: Any) -> _Parts:
        """The system and products from autograd: a retained graph of the optimality condition."""
        _, grad_w_f, grad_lam_f = loss_and_grads(outer_fn(problem, outer_batch), w, lam, what="outer loss")
        assert grad_w_f is not None and grad_lam_f is not None
        root = RootSystem(problem, w, lam, inner_batch, self.fixed_point, self.products)
        system = LinearSystem(
            matvec=root.rmatvec,
            rhs=grad_w_f,
            rmatvec=root.matvec,
            symmetric=root.symmetric,
            dense=root.dense_rmatrix,
            flat_matvec=root.rmatvec_flat,
        )
        return _Parts(system, grad_lam_f, root.residual, root.rmatvec_lam)


class _Parts(NamedTuple):
    system: LinearSystem
    grad_lam_f: Tree
    residual: Tree
    mixed_product: Callable[[Tree], Tree]


def _compiled_parts(stage: CompiledStage, w: Tree) -> _Parts:
    """The system and products from a compiled stage (checked like the eager ones)."""
    _check_value(stage.outer_value, "outer loss is {} (non-finite)")
    _check_value(stage.inner_value, "inner loss is {} (non-finite) at the linearisation point")
    check_finite(stage.residual, "optimality residual F(w, lam)")
    system = LinearSystem(
        matvec=lambda v: tree_unflatten(stage.hvp_flat(tree_flatten_view(v)), w),
        rhs=stage.grad_w_f, flat_matvec=stage.hvp_flat, flat_cg_step=stage.cg_step,
    )
    return _Parts(system, stage.grad_lam_f, stage.residual, lambda u: stage.mixed(tree_flatten_view(u)))


# ------------------------------------------------------------ the compiled stage (compile=True)


def _flat(t: Tree, like: Tree) -> Tensor:
    return torch.cat([t[k].reshape(-1) for k in like])


@traced_stage("the implicit products", eager='products')
def products_stage(problem: BilevelProblem, w: Tree, lam: Tree, inner_batch: Any, outer_batch: Any,
                   v: Tensor, u: Tensor) -> tuple[Any, ...]:
    r"""The traced function of ``Implicit(compile=True)``: gradients and both products at ``(w, lam)``.

    Returns ``(f, g, grad_w_f, grad_lam_f, residual, Hv, mixed)``: the two loss values, the outer
    gradients, :math:`\nabla_w g`, the flat :math:`\nabla^2_{ww} g\, v` and the flat
    :math:`(\partial_\lambda \nabla_w g)^\top u`, for flat ``v`` and ``u`` shaped like ``w``'s
    leaves concatenated (the contract of :func:`hypergrad.compiled.compiled_products`, which
    traces it once and splits the graph into the part run once and the two products).

    Example:
        >>> import torch, hypergrad as hg
        >>> g = lambda w, lam, b: 0.5 * (torch.exp(lam["c"]) * w["x"] ** 2).sum()
        >>> f = lambda w, lam, b: w["x"].sum()
        >>> w, lam = {"x": torch.ones(2, dtype=torch.float64)}, {"c": torch.zeros(2, dtype=torch.float64)}
        >>> ones = torch.ones(2, dtype=torch.float64)
        >>> out = products_stage(hg.BilevelProblem(g, f), w, lam, None, None, ones, ones)
        >>> out[5].tolist(), out[6].tolist()  # H v = e^c v; mixed: d(e^c w)/dc u = e^c w u
        ([1.0, 1.0], [1.0, 1.0])
    """
    (grad_w_f, grad_lam_f), f_value = torch.func.grad_and_value(
        lambda w_, l_: problem.outer_loss(w_, l_, outer_batch), argnums=(0, 1))(w, lam)

    def grad_w_g(w_: Tree, l_: Tree) -> tuple[Tree, Tensor]:
        return torch.func.grad_and_value(lambda t: problem.inner_loss(t, l_, inner_batch))(w_)

    residual, hvp, g_value = torch.func.vjp(lambda w_: grad_w_g(w_, lam), w, has_aux=True)
    _, mixed, _ = torch.func.vjp(lambda l_: grad_w_g(w, l_), lam, has_aux=True)
    (hv,) = hvp(unflatten_view(v, w))
    (mu,) = mixed(unflatten_view(u, w))
    # "+ 0 * vector": each product depends on its vector in the traced graph even where it is
    # constant (an inner loss without lam, or linear in w), so the split always finds both
    return (f_value, g_value, grad_w_f, grad_lam_f, residual, _flat(hv, w) + 0.0 * v,
            _flat(mu, lam) + 0.0 * u.sum())


def compiled_stage(problem: BilevelProblem, w: Tree, lam: Tree, inner_batch: Any = None,
                   outer_batch: Any = None) -> CompiledStage | None:
    r"""Run the compiled stage of ``problem`` at ``(w, lam)``; None where compilation is unavailable.

    :func:`hypergrad.compiled.compiled_products` with :func:`products_stage`.

    Args:
        problem: the bilevel problem; its losses are traced once by :func:`torch.compile`.
        w, lam: the point (dicts of floating tensors; gradients are not tracked through them).
        inner_batch, outer_batch: the batches passed to the losses (their tensors are graph inputs;
            other values are guarded on).

    Returns:
        A :class:`CompiledStage`, or None when tracing or compiling failed now or before for this
        problem (logged once on the ``hypergrad`` logger): use the eager products then.

    Example:
        >>> import torch, hypergrad as hg
        >>> from hypergrad.implicit import compiled_stage
        >>> g = lambda w, lam, b: 0.5 * (torch.exp(lam["c"]) * w["x"] ** 2).sum()
        >>> f = lambda w, lam, b: w["x"].sum()
        >>> w = {"x": torch.ones(3, dtype=torch.float64)}
        >>> lam = {"c": torch.zeros(3, dtype=torch.float64)}
        >>> stage = compiled_stage(hg.BilevelProblem(g, f), w, lam)
        >>> stage is None or stage.hvp_flat(torch.ones(3, dtype=torch.float64)).tolist() == [1.0, 1.0, 1.0]
        True
    """
    return compiled_products(problem, products_stage, w, lam, inner_batch, outer_batch)
