r"""Differentiable inner solutions: :func:`custom_root` turns an inner solver into :math:`w^*(\lambda)`.

The methods of :mod:`hypergrad` return the hypergradient :math:`\nabla F(\lambda)` of one outer
loss. Sometimes the inner solution itself is wanted as a tensor inside a larger autograd graph: a
layer whose output is the minimiser of an inner problem (an OptNet-style or deep-equilibrium
layer), a loss built from :math:`w^*(\lambda)` by code hypergrad never sees, derivatives with
respect to the inner problem's data, or a batch of inner problems under :func:`torch.func.vmap`.
:func:`custom_root` (the ``custom_root`` of jaxopt and torchopt) wraps the solver so that its
output is differentiable: the forward pass runs the solver as it is (without a graph), and the
backward pass applies the implicit function theorem at the solution it returned. For a cotangent
:math:`v` of :math:`w^*`, with the optimality condition :math:`F(w^*, \lambda) = 0`,

.. math::
    (\partial_w F)^\top u = v, \qquad
    \bar\lambda = -(\partial_\lambda F)^\top u,

one linear solve (any solver of :mod:`hypergrad.linear`) per backward pass; the data of the inner
problem (the tensors of ``batch``) gets its cotangent the same way. With
:math:`F = \nabla_w g` and :math:`v = \nabla_w f` this is exactly
:class:`~hypergrad.implicit.Implicit`'s hypergradient.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import Tensor

from hypergrad.autodiff import RootSystem
from hypergrad.errors import ConvergenceWarning, check_not_class, report
from hypergrad.linear import CG
from hypergrad.linear.base import LinearSolveResult, LinearSystem
from hypergrad.problem import BilevelProblem
from hypergrad.tree import Tree, check_finite, check_tree

__all__ = ["custom_root"]

InnerSolver = Callable[..., Any]
LinearSolver = Callable[[LinearSystem, Tree | None], LinearSolveResult]


def custom_root(
    inner: Callable[[Tree, Tree, Any], Tensor] | None = None,
    *,
    optimality: Callable[[Tree, Tree, Any], Tree] | None = None,
    solver: LinearSolver | None = None,
    symmetric: bool = False,
    vectorize: bool = False,
) -> Callable[[InnerSolver], Callable[..., Tree]]:
    r"""Decorate an inner solver so that its solution :math:`w^*(\lambda)` is differentiable.

    The decorated function is called as ``solve(w0, lam, batch=None)`` with dicts of tensors
    ``w0`` (the start) and ``lam``, and returns the solution as a dict shaped like ``w0`` (or an
    object with such a ``.w``, e.g. what :func:`hypergrad.inner_solve` returns). The wrapped
    call runs it without a graph and returns the solution connected to ``lam`` and to the tensors
    of ``batch``: gradients flow back by the implicit function theorem (see the module
    docstring), never through the solver's iterations, so any solver works (L-BFGS with a line
    search, a closed form, a library call), at the cost of one linear solve per backward pass.
    ``w0`` gets no gradient. The linearisation is taken at the returned point, so the gradients
    are exact when it solves :math:`F = 0` and off by a first-order term in its residual
    otherwise. Each linear solve's non-convergence is warned
    (:class:`~hypergrad.errors.ConvergenceWarning`, folded as in every method).

    **vmap.** Under :func:`torch.func.vmap` (over ``lam``, ``w0`` or the batch's tensors: a batch
    of inner problems) the solution and its backward pass are computed one problem at a time,
    with the solver and the linear solver as they are (their data-dependent stopping tests
    cannot run vectorised); with ``vectorize=True`` the forward pass runs the solver itself
    under ``vmap`` (it must then be vmappable: a closed form or a fixed number of steps of plain
    tensor operations), the backward pass still solves one problem at a time.
    :func:`torch.func.grad` and ``vmap`` compose with it in either order.

    Args:
        inner: the inner loss ``g(w, lam, batch)``: the solution is a root of
            :math:`F = \nabla_w g` (symmetric system: CG works).
        optimality: instead of ``inner``, the residual ``F(w, lam, batch) -> dict shaped like w``
            whose root the solver finds (e.g. ``w - T(w, lam, batch)`` for a fixed point
            :math:`w = T(w, \lambda)`); its Jacobian is not assumed symmetric (use
            :class:`~hypergrad.linear.NormalCG`, ``Dense`` or ``Neumann``) unless ``symmetric``.
        solver: the linear solver of the backward pass, from :mod:`hypergrad.linear` (default
            ``CG(tol=1e-10)`` for ``inner``, ``NormalCG(tol=1e-10)`` for ``optimality``).
        symmetric: with ``optimality``: its Jacobian in ``w`` is symmetric.
        vectorize: run the solver under ``vmap`` when the call is vmapped (see above).

    Returns:
        A decorator; the decorated function has the signature ``(w0, lam, batch=None) -> dict``.

    Raises:
        ValueError: neither or both of ``inner`` and ``optimality``; a solution not shaped like
            ``w0``; ``CG`` on a non-symmetric system.
        TypeError: a linear solver class instead of an instance.

    Example:
        Ridge regression, :math:`w^* = (X^\top X + \lambda I)^{-1} X^\top y`, solved by L-BFGS; the
        gradient of a loss of :math:`w^*` (here its squared norm) by the implicit function
        theorem, against the closed form:

        >>> import torch, hypergrad as hg
        >>> X, y = torch.randn(20, 3, dtype=torch.float64), torch.randn(20, dtype=torch.float64)
        >>> g = lambda w, lam, b: 0.5 * ((X @ w["x"] - y) ** 2).sum() + 0.5 * lam["l2"] * (w["x"] ** 2).sum()
        >>> @hg.custom_root(g)
        ... def ridge(w0, lam, batch=None):
        ...     return hg.inner_solve(hg.BilevelProblem(g, g), w0, lam, 100, hg.inner.LBFGS(), tol=1e-12)
        >>> lam = {"l2": torch.tensor(0.5, dtype=torch.float64, requires_grad=True)}
        >>> w = ridge({"x": torch.zeros(3, dtype=torch.float64)}, lam)
        >>> (w["x"] ** 2).sum().backward()
        >>> l2 = torch.tensor(0.5, dtype=torch.float64, requires_grad=True)
        >>> exact = torch.linalg.solve(X.T @ X + l2 * torch.eye(3, dtype=torch.float64), X.T @ y)
        >>> (exact ** 2).sum().backward()
        >>> abs(float(lam["l2"].grad - l2.grad)) < 1e-9
        True
    """
    if (inner is None) == (optimality is None):
        raise ValueError("custom_root needs exactly one of inner (the inner loss g) and optimality (a residual F)")
    for name, fn in (("inner", inner), ("optimality", optimality)):
        if fn is not None and not callable(fn):
            raise TypeError(f"{name} must be callable (w, lam, batch) -> ..., got {type(fn).__name__}")
    if not isinstance(symmetric, bool) or not isinstance(vectorize, bool):
        raise TypeError(f"symmetric and vectorize must be bools, got {symmetric!r} and {vectorize!r}")
    if solver is None:
        from hypergrad.linear import NormalCG

        solver = CG(tol=1e-10) if inner is not None or symmetric else NormalCG(tol=1e-10)
    check_not_class(solver, "solver")
    if not callable(solver):
        raise TypeError(f"solver must be a linear solver from hypergrad.linear, got {solver!r}")

    def decorate(solve: InnerSolver) -> Callable[..., Tree]:
        if not callable(solve):
            raise TypeError(f"custom_root decorates an inner solver (w0, lam, batch) -> w, got {type(solve).__name__}")

        @functools.wraps(solve)
        def solution(w0: Tree, lam: Tree, batch: Any = None) -> Tree:
            w0, lam = check_tree(w0, "w0"), check_tree(lam, "lam")
            leaves, batch_spec = pytree.tree_flatten(batch)
            tensor_at = tuple(i for i, leaf in enumerate(leaves) if isinstance(leaf, Tensor))
            spec = _Spec(solve=solve, inner=inner, optimality=optimality, solver=solver,
                         symmetric=symmetric, vectorize=vectorize, w_keys=tuple(w0), lam_keys=tuple(lam),
                         batch_spec=batch_spec, batch_leaves=tuple(None if i in tensor_at else leaf
                                                                   for i, leaf in enumerate(leaves)),
                         tensor_at=tensor_at)
            out = _Solution.apply(spec, *lam.values(), *w0.values(), *(leaves[i] for i in tensor_at))
            return dict(zip(w0, out, strict=True))

        return solution

    return decorate


@dataclass(frozen=True)
class _Spec:
    """What the autograd functions need besides their tensors (non-tensor arguments of ``apply``)."""

    solve: InnerSolver
    inner: Callable[[Tree, Tree, Any], Tensor] | None
    optimality: Callable[[Tree, Tree, Any], Tree] | None
    solver: LinearSolver
    symmetric: bool
    vectorize: bool
    w_keys: tuple[str, ...]
    lam_keys: tuple[str, ...]
    batch_spec: Any
    batch_leaves: tuple[Any, ...]  # the non-tensor leaves of the batch (None where a tensor goes)
    tensor_at: tuple[int, ...]  # where the batch's tensors go among its leaves
    given: bool = False  # the solution comes as the last inputs (computed vectorised), not from solve
    needs: tuple[bool, ...] = ()  # the adjoint: which of lam's and the batch's tensors need a cotangent

    def split(self, tensors: tuple[Tensor, ...]) -> tuple[Tree, Tree, list[Tensor], tuple[Tensor, ...]]:
        """``(lam, w0 or the solution, the batch's tensors, the rest)`` from ``apply``'s tensors."""
        n_lam, n_w, n_b = len(self.lam_keys), len(self.w_keys), len(self.tensor_at)
        lam = dict(zip(self.lam_keys, tensors[:n_lam], strict=True))
        w = dict(zip(self.w_keys, tensors[n_lam:n_lam + n_w], strict=True))
        return lam, w, list(tensors[n_lam + n_w:n_lam + n_w + n_b]), tensors[n_lam + n_w + n_b:]

    def batch(self, tensors: list[Tensor]) -> Any:
        """The batch, rebuilt from its tensors and the other leaves."""
        leaves = list(self.batch_leaves)
        for i, tensor in zip(self.tensor_at, tensors, strict=True):
            leaves[i] = tensor
        return pytree.tree_unflatten(leaves, self.batch_spec)


def _run_solver(spec: _Spec, w0: Tree, lam: Tree, batch: Any, finite: bool = True) -> Tree:
    """The inner solver's solution, checked to be shaped like ``w0`` (and ``finite``)."""
    with torch.no_grad():
        out = spec.solve({k: v.detach() for k, v in w0.items()}, {k: v.detach() for k, v in lam.items()}, batch)
    w = out if isinstance(out, dict) else getattr(out, "w", out)
    if not isinstance(w, dict) or set(w) != set(spec.w_keys):
        raise ValueError(f"the inner solver must return a dict with the keys of w0 {list(spec.w_keys)} (or an object "
                         f"with such a .w, as hypergrad.inner_solve returns), got {type(out).__name__}")
    for k in spec.w_keys:
        if not isinstance(w[k], Tensor) or w[k].shape != w0[k].shape:
            raise ValueError(f"the inner solver's w[{k!r}] must be a tensor of shape {tuple(w0[k].shape)} like w0's, got "
                             f"{getattr(w[k], 'shape', type(w[k]).__name__)}")
    if finite:  # under vmap (vectorize=True) the caller checks the stacked solutions
        check_finite(w, "custom_root inner solution")
    return {k: w[k] for k in spec.w_keys}


def _slice(tensors: tuple[Any, ...], in_dims: tuple[int | None, ...], i: int) -> list[Any]:
    return [t if d is None or not isinstance(t, Tensor) else t.select(d, i) for t, d in zip(tensors, in_dims, strict=True)]


class _Solution(torch.autograd.Function):
    """``(spec, *lam, *w0, *batch tensors[, *solution]) -> solution``; backward: :class:`_Adjoint`."""

    @staticmethod
    def forward(spec: _Spec, *tensors: Tensor) -> tuple[Tensor, ...]:
        lam, w0, batch_tensors, rest = spec.split(tensors)
        if spec.given:
            solution = dict(zip(spec.w_keys, rest, strict=True))
        else:
            solution = _run_solver(spec, w0, lam, spec.batch(batch_tensors))
        inputs = {id(t) for t in tensors}
        # a fresh tensor for a solution that is one of the inputs (a solver that took no step)
        return tuple(v.detach().clone() if id(v) in inputs else v.detach() for v in solution.values())

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, ...]) -> None:
        spec = inputs[0]
        lam, _, batch_tensors, _ = spec.split(inputs[1:])
        ctx.spec = spec
        ctx.save_for_backward(*lam.values(), *output, *batch_tensors)

    @staticmethod
    def backward(ctx: Any, *cotangents: Tensor | None) -> tuple[Tensor | None, ...]:
        spec: _Spec = ctx.spec
        n_lam, n_w, n_b = len(spec.lam_keys), len(spec.w_keys), len(spec.tensor_at)
        needs = ctx.needs_input_grad[1:]
        need_lam, need_batch = needs[:n_lam], needs[n_lam + n_w:n_lam + n_w + n_b]
        saved = ctx.saved_tensors
        out: list[Tensor | None] = [None] * (1 + len(needs))
        if not (any(need_lam) or any(need_batch)):
            return tuple(out)
        solution = saved[n_lam:n_lam + n_w]
        cot = [c if c is not None else torch.zeros_like(w) for c, w in zip(cotangents, solution, strict=True)]
        adjoint = replace(spec, given=False, needs=tuple(need_lam) + tuple(need_batch))
        grads = iter(_Adjoint.apply(adjoint, *saved, *cot))
        for i, need in enumerate(need_lam):
            out[1 + i] = next(grads) if need else None
        for j, need in enumerate(need_batch):
            out[1 + n_lam + n_w + j] = next(grads) if need else None
        return tuple(out)

    @staticmethod
    def vmap(info: Any, in_dims: tuple[Any, ...], spec: _Spec, *tensors: Any) -> tuple[Any, Any]:
        dims = in_dims[1:]
        if spec.vectorize and not spec.given:
            lam, w0, batch_tensors, _ = spec.split(tensors)
            lam_dims, w_dims, batch_dims, _ = spec.split(dims)

            def one(lam_: Tree, w0_: Tree, batch_tensors_: list[Tensor]) -> tuple[Tensor, ...]:
                return tuple(_run_solver(spec, w0_, lam_, spec.batch(batch_tensors_), finite=False).values())

            solutions = torch.func.vmap(one, in_dims=(lam_dims, w_dims, batch_dims), randomness="same")(
                lam, w0, batch_tensors)
            check_finite(dict(zip(spec.w_keys, solutions, strict=True)), "custom_root inner solution")
            given = replace(spec, given=True)
            rows = [_Solution.apply(given, *_slice(tensors, dims, i), *(s[i] for s in solutions))
                    for i in range(info.batch_size)]
        else:
            rows = [_Solution.apply(spec, *_slice(tensors, dims, i)) for i in range(info.batch_size)]
        return tuple(torch.stack(column) for column in zip(*rows, strict=True)), (0,) * len(spec.w_keys)


class _Adjoint(torch.autograd.Function):
    """``(spec, *lam, *solution, *batch tensors, *cotangents) -> the cotangents of lam's and the
    batch's tensors that need one``, by one linear solve (the implicit function theorem)."""

    @staticmethod
    def forward(spec: _Spec, *tensors: Tensor) -> tuple[Tensor, ...]:
        lam, solution, batch_tensors, cotangent = spec.split(tensors)
        n_lam = len(spec.lam_keys)
        need_lam, need_batch = spec.needs[:n_lam], spec.needs[n_lam:]
        # the differentiable inputs of F: lam's entries and the batch's tensors that need a cotangent
        inputs = {f"lam.{k}": v for (k, v), need in zip(lam.items(), need_lam, strict=True) if need}
        inputs.update({f"batch.{j}": t for j, (t, need) in enumerate(zip(batch_tensors, need_batch, strict=True))
                       if need})

        def split_inputs(merged: Tree) -> tuple[Tree, Any]:
            lam_ = {k: merged.get(f"lam.{k}", v) for k, v in lam.items()}
            tensors_ = [merged.get(f"batch.{j}", t) for j, t in enumerate(batch_tensors)]
            return lam_, spec.batch(tensors_)

        if spec.inner is not None:
            inner = spec.inner

            def g(w: Tree, merged: Tree, _: Any) -> Tensor:
                lam_, batch = split_inputs(merged)
                return inner(w, lam_, batch)

            root = RootSystem(BilevelProblem(g, g), solution, inputs, None)
        else:
            optimality = spec.optimality
            assert optimality is not None

            def residual(w: Tree, merged: Tree, _: Any) -> Tree:
                lam_, batch = split_inputs(merged)
                return optimality(w, lam_, batch)

            root = RootSystem(BilevelProblem(_no_loss, _no_loss), solution, inputs, None, optimality=residual,
                              symmetric=spec.symmetric)
        v = dict(zip(spec.w_keys, cotangent, strict=True))
        system = LinearSystem(matvec=root.rmatvec, rhs=v, rmatvec=root.matvec, symmetric=root.symmetric,
                              dense=root.dense_rmatrix, flat_matvec=root.rmatvec_flat)
        solved = spec.solver(system, None)
        report(solved.warnings, ConvergenceWarning, repeated=solved.repeated_warnings, stacklevel=2)
        check_finite(solved.solution, "custom_root linear solve")
        pulled = root.rmatvec_lam(solved.solution) if inputs else {}
        return tuple(-pulled[key].detach() for key in inputs)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        pass

    @staticmethod
    def backward(ctx: Any, *cotangents: Any) -> Any:
        raise RuntimeError("custom_root's gradients are first-order: differentiating them again (a double backward, "
                           "a Hessian through the solution) is not supported")

    @staticmethod
    def vmap(info: Any, in_dims: tuple[Any, ...], spec: _Spec, *tensors: Any) -> tuple[Any, Any]:
        rows = [_Adjoint.apply(spec, *_slice(tensors, in_dims[1:], i)) for i in range(info.batch_size)]
        return tuple(torch.stack(column) for column in zip(*rows, strict=True)), (0,) * len(rows[0])


def _no_loss(w: Tree, lam: Tree, batch: Any) -> Tensor:
    raise AssertionError("not called: the root form takes F from optimality")  # pragma: no cover
