"""Gradients, Hessian-vector and mixed products of the losses, built on :mod:`torch.autograd`.

The default product form is reverse-over-reverse on a graph built once and retained: measured on
CPU it costs about 0.7 inner-gradient evaluations per product, against about 15 for
forward-over-reverse ``torch.func.jvp`` over ``torch.func.grad`` (see :doc:`/methods/implicit`
and ``benchmarks/results``). The forward form is kept as an option.

Public so that code built on :mod:`hypergrad` (training loops, benchmarks) can take the same
checked gradients and linearisations as the methods do.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from hypergrad.problem import BilevelProblem
from hypergrad.tree import Tree, check_finite, grads_to_tree, tree_requires_grad

__all__ = [
    "RootSystem", "check_inner_graph", "check_w_used", "grad_or_zeros", "grad_with_graph", "inner_fn", "inner_grads", "loss_and_grads",
    "outer_fn", "report_lam_unused",
]

LossFn = Callable[[Tree, Tree, Any], Tensor]

# The C++ autograd engine entry that torch.autograd.grad ends in. Calling it directly skips
# torch.autograd.grad's per-call argument normalisation and checks (measured about 25 us of the
# 115 us of a Hessian-vector product on a 100-feature ridge problem); used only for the repeated
# products on a retained graph, whose arguments are validated once (see RootSystem). Falls back to
# torch.autograd.grad if a PyTorch version lacks it.
_engine_run_backward = getattr(torch.autograd.graph, "_engine_run_backward", None)
# The engine itself, one level further down (skips the wrapper's context stash, which only matters
# for backward passes that run on device threads, i.e. not on the CPU): measured 20 of 280 us.
_engine = getattr(getattr(torch.autograd, "Variable", None), "_execution_engine", None)


def grad_with_graph(value: Tensor, leaves: list[Tensor]) -> tuple[Tensor | None, ...]:
    """``torch.autograd.grad(value, leaves, create_graph=True, allow_unused=True)``.

    For a plain real scalar on the CPU with plain tensor leaves and no ``__torch_function__``
    override, the engine is called directly (it runs the backward on the calling thread there),
    skipping the wrapper's argument normalisation: measured about 30 us of a 1.4 ms unrolled step
    on a 64-64-64-10 MLP. Anything else goes through :func:`torch.autograd.grad`.

    Example:
        >>> import torch
        >>> x = torch.tensor([1.0, 2.0], requires_grad=True)
        >>> (g,) = grad_with_graph((x ** 3).sum(), [x])
        >>> g.tolist(), g.requires_grad
        ([3.0, 12.0], True)
    """
    if (_engine is not None and type(value) is Tensor and value.dim() == 0 and value.is_floating_point()
            and value.device.type == "cpu" and all(type(x) is Tensor for x in leaves)
            and not torch.overrides.has_torch_function((value, *leaves))):
        return _engine.run_backward((value,), (torch.ones_like(value),), True, True, tuple(leaves), True, False)
    return torch.autograd.grad(value, leaves, create_graph=True, allow_unused=True)


def loss_and_grads(
    loss: Callable[[Tree, Tree], Tensor],
    w: Tree,
    lam: Tree,
    *,
    wrt_w: bool = True,
    wrt_lam: bool = True,
    what: str = "loss",
    check: bool = True,
) -> tuple[Tensor, Tree | None, Tree | None]:
    """Return ``loss(w, lam)`` (detached) and its gradients w.r.t. ``w`` and/or ``lam``.

    First-order only: no graph is kept, so the result is safe for functions that are not twice
    differentiable. A gradient the loss does not depend on is zero (also when the loss depends
    on none of the inputs asked for). ``check=False`` skips the finiteness test of the loss, the
    one value this function reads back to the host (a synchronisation on a GPU): the caller
    checks the value later.

    Raises:
        hypergrad.NonFiniteError: the loss is NaN or inf (``what`` names it), with ``check``.

    Example:
        >>> import torch
        >>> w, lam = {"x": torch.tensor([1.0, 2.0])}, {"c": torch.tensor(3.0)}
        >>> value, gw, glam = loss_and_grads(lambda w, l: l["c"] * (w["x"] ** 2).sum(), w, lam)
        >>> float(value), gw["x"].tolist(), float(glam["c"])
        (15.0, [6.0, 12.0], 5.0)
        >>> loss_and_grads(lambda w, l: (w["x"] ** 2).sum(), w, lam, wrt_w=False)[2]["c"].item()  # ignores lam
        0.0
    """
    value, w_, lam_, grads = _value_and_grads(loss, w, lam, wrt_w, wrt_lam, what, check=check)
    n_w = len(w_) if wrt_w else 0
    gw = grads_to_tree(grads[:n_w], w_) if wrt_w else None
    glam = grads_to_tree(grads[n_w:], lam_) if wrt_lam else None
    return value, gw, glam


def _value_and_grads(loss: Callable[[Tree, Tree], Tensor], w: Tree, lam: Tree, wrt_w: bool, wrt_lam: bool,
                     what: str, track_w: bool = False,
                     check: bool = True) -> tuple[Tensor, Tree, Tree, tuple[Tensor | None, ...]]:
    """The detached value, the inputs and the raw gradients (None where the loss does not use an
    input). ``track_w`` (without ``wrt_w``): check that the loss uses every entry of ``w`` from its
    graph, without taking their gradients."""
    w_ = tree_requires_grad(w) if wrt_w or track_w else {k: v.detach() for k, v in w.items()}
    lam_ = tree_requires_grad(lam) if wrt_lam else {k: v.detach() for k, v in lam.items()}
    with torch.enable_grad():
        value = loss(w_, lam_)
        inputs = (list(w_.values()) if wrt_w else []) + (list(lam_.values()) if wrt_lam else [])
        if track_w and not wrt_w:
            reached = _reached_leaves(value, list(w_.values()))
            check_w_used(w_, [x if hit else None for x, hit in zip(w_.values(), reached, strict=True)])
        if inputs and value.requires_grad:
            grads: tuple[Tensor | None, ...] = torch.autograd.grad(value, inputs, allow_unused=True)
        else:  # the loss depends on none of the inputs (torch.autograd.grad would raise)
            grads = (None,) * len(inputs)
    if check and not bool(torch.isfinite(value)):
        from hypergrad.errors import NonFiniteError

        raise NonFiniteError(f"{what} is {float(value.detach())} (non-finite)")
    return value.detach(), w_, lam_, grads


def check_inner_graph(value: Tensor, w: Tree, lam: Tree) -> None:
    """The checks of :func:`inner_grads`, read from the graph of one evaluation of ``g``.

    For methods that differentiate ``g`` with a graph of their own (``Unrolled``): ``value`` is
    ``g(w, lam, batch)`` computed from leaves ``w`` and ``lam`` that require grad. A walk over its
    autograd graph (no backward pass) finds the leaves it uses: an entry of ``w`` it does not use
    is refused (:func:`check_w_used`), and a ``g`` that uses no entry of ``lam`` warns
    (:func:`report_lam_unused`).

    Raises:
        ValueError: an entry of ``w`` that ``g`` does not use.

    Example:
        >>> import torch
        >>> w = {"x": torch.ones(2, requires_grad=True), "y": torch.ones(1, requires_grad=True)}
        >>> lam = {"c": torch.ones(2, requires_grad=True)}
        >>> check_inner_graph(((w["x"] - lam["c"]) ** 2).sum() + w["y"].sum(), w, lam)   # all used
        >>> check_inner_graph(((w["x"] - lam["c"]) ** 2).sum(), w, lam)
        Traceback (most recent call last):
        ...
        ValueError: w['y'] is not used by the inner loss g: the inner problem does not determine it, so it has no implicit derivative; remove it from w (or make g use it)
    """
    reached = _reached_leaves(value, [*w.values(), *lam.values()])
    check_w_used(w, [x if hit else None for x, hit in zip(w.values(), reached, strict=False)])
    if lam and not any(reached[len(w):]):
        report_lam_unused(stacklevel=5)


def _reached_leaves(value: Tensor, leaves: list[Tensor]) -> list[bool]:
    """Which of ``leaves`` the autograd graph of ``value`` reaches (a walk over its nodes, no backward pass)."""
    index = {id(x): i for i, x in enumerate(leaves)}
    reached = [False] * len(leaves)
    seen: set[Any] = set()  # the nodes themselves (torch keeps one Python object per node of a live graph)
    stack = [value.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)  # an AccumulateGrad node: a leaf
        if variable is not None and id(variable) in index:
            reached[index[id(variable)]] = True
        stack.extend(child for child, _ in node.next_functions)
    return reached


def inner_grads(
    problem: BilevelProblem,
    batch: Any,
    w: Tree,
    lam: Tree,
    *,
    wrt_w: bool = True,
    wrt_lam: bool = False,
    check_w: bool = False,
    what: str = "inner loss",
    check: bool = True,
) -> tuple[Tensor, Tree | None, Tree | None]:
    """The inner loss ``g(w, lam, batch)`` and its gradients, with the checks every method makes.

    As :func:`loss_and_grads` on the inner loss, and: with ``wrt_w`` (or ``check_w``, which checks
    without taking the gradients), an entry of ``w`` that ``g`` does not use is refused
    (:func:`check_w_used`); with ``wrt_lam``, a ``g`` that does not use ``lam`` at all warns
    (:func:`report_lam_unused`). Every method takes its first-order inner gradients here, so the
    same problem gets the same error or warning from any method. ``check=False`` skips the
    finiteness test of the loss, as in :func:`loss_and_grads`.

    Raises:
        ValueError: an entry of ``w`` that ``g`` does not use.
        hypergrad.NonFiniteError: the loss is NaN or inf (``what`` names it).

    Example:
        >>> import torch, hypergrad as hg
        >>> g = lambda w, lam, b: (lam["c"] * w["x"] ** 2).sum()
        >>> value, gw, glam = inner_grads(hg.BilevelProblem(g, g), None, {"x": torch.ones(2)},
        ...                               {"c": torch.tensor(3.0)}, wrt_lam=True)
        >>> float(value), gw["x"].tolist(), float(glam["c"])
        (6.0, [6.0, 6.0], 2.0)
        >>> inner_grads(hg.BilevelProblem(g, g), None, {"x": torch.ones(2), "y": torch.ones(1)}, {"c": torch.tensor(3.0)})
        Traceback (most recent call last):
        ...
        ValueError: w['y'] is not used by the inner loss g: the inner problem does not determine it, so it has no implicit derivative; remove it from w (or make g use it)
    """
    value, w_, lam_, grads = _value_and_grads(
        lambda w_, lam_: problem.inner_loss(w_, lam_, batch), w, lam, wrt_w, wrt_lam, what, track_w=check_w,
        check=check)
    n_w = len(w_) if wrt_w else 0
    if wrt_w:
        check_w_used(w_, grads[:n_w])
    if wrt_lam and lam_ and all(grad is None for grad in grads[n_w:]):
        report_lam_unused(stacklevel=5)
    gw = grads_to_tree(grads[:n_w], w_) if wrt_w else None
    glam = grads_to_tree(grads[n_w:], lam_) if wrt_lam else None
    return value, gw, glam


def inner_fn(problem: BilevelProblem, batch: Any) -> Callable[[Tree, Tree], Tensor]:
    """Bind ``batch`` into the checked inner loss."""
    return lambda w, lam: problem.inner_loss(w, lam, batch)


def outer_fn(problem: BilevelProblem, batch: Any) -> Callable[[Tree, Tree], Tensor]:
    """Bind ``batch`` into the checked outer loss."""
    return lambda w, lam: problem.outer_loss(w, lam, batch)


class RootSystem:
    r"""Linearisation of an optimality condition :math:`F(w, \lambda) = 0` at a point.

    ``F`` is the gradient :math:`\nabla_w g` (gradient-root form; its Jacobian is the
    symmetric Hessian), :math:`w - T(w, \lambda)` (fixed-point form) or any residual
    ``optimality(w, lam, batch)`` (root form). The graph of ``F`` is built once; every product
    afterwards is one backward pass through it.

    Args:
        problem: the bilevel problem (its inner loss defines the gradient-root form).
        w, lam: the linearisation point.
        batch: the inner batch.
        fixed_point: optional map ``T(w, lam, batch) -> w``; when given, ``F = w - T``.
        products: ``"reverse"`` (retained graph) or ``"forward"`` (``torch.func`` jvp over grad;
            gradient-root form only).
        optimality: optional residual ``F(w, lam, batch) -> dict shaped like w`` whose root is the
            inner solution (instead of ``problem``'s gradient or ``fixed_point``).
        symmetric: with ``optimality``, whether its Jacobian in ``w`` is symmetric (e.g. a
            gradient written by hand), which CG and Cholesky need; default False.
    """

    def __init__(
        self,
        problem: BilevelProblem,
        w: Tree,
        lam: Tree,
        batch: Any,
        fixed_point: Callable[[Tree, Tree, Any], Tree] | None = None,
        products: str = "reverse",
        optimality: Callable[[Tree, Tree, Any], Tree] | None = None,
        symmetric: bool | None = None,
    ) -> None:
        if products not in ("reverse", "forward"):
            raise ValueError(f"products must be 'reverse' or 'forward', got {products!r}")
        if fixed_point is not None and optimality is not None:
            raise ValueError("give fixed_point or optimality, not both")
        if products == "forward" and (fixed_point is not None or optimality is not None):
            raise ValueError("products='forward' supports the gradient-root form only (fixed_point=None)")
        self.symmetric = (fixed_point is None and optimality is None) or (optimality is not None and bool(symmetric))
        self.products = products
        self.matvec_count = 0
        self._problem, self._batch = problem, batch
        self._w = tree_requires_grad(w)
        self._lam = tree_requires_grad(lam)
        self._w_leaves = list(self._w.values())
        self._lam_leaves = list(self._lam.values())
        if products == "forward":
            self._F = None
            with torch.enable_grad():  # the checks of the reverse form, from the graph of one evaluation of g
                check_inner_graph(problem.inner_loss(self._w, self._lam, batch), self._w, self._lam)
            return
        with torch.enable_grad():
            if optimality is not None:
                F_tree = optimality(self._w, self._lam, batch)
                if not isinstance(F_tree, dict) or set(F_tree) != set(self._w) or any(
                        F_tree[k].shape != x.shape for k, x in self._w.items()):
                    raise ValueError("optimality(w, lam, batch) must return a dict shaped like w (same keys and shapes)")
                self._F = [F_tree[k] if F_tree[k].requires_grad else F_tree[k] + 0.0 * x.sum()
                           for k, x in self._w.items()]
                self._residual_tree = {k: f.detach() for k, f in zip(self._w, self._F, strict=True)}
            elif fixed_point is None:
                g = problem.inner_loss(self._w, self._lam, batch)
                if not bool(torch.isfinite(g)):
                    from hypergrad.errors import NonFiniteError

                    raise NonFiniteError(f"inner loss is {float(g.detach())} (non-finite) at the linearisation point")
                F = torch.autograd.grad(g, self._w_leaves, create_graph=True, allow_unused=True)
                _check_w_determined(self._w, F)
                self._F = [
                    f if f is not None else torch.zeros_like(x) for f, x in zip(F, self._w_leaves, strict=True)
                ]
                self._residual_tree = {k: f.detach() for k, f in zip(self._w, self._F, strict=True)}
            else:
                T = fixed_point(self._w, self._lam, batch)
                if not isinstance(T, dict) or set(T) != set(self._w):
                    raise ValueError("fixed_point(w, lam, batch) must return a dict with the keys of w")
                self._F = [self._w[k] - T[k] for k in self._w]
                self._residual_tree = {k: f.detach() for k, f in zip(self._w, self._F, strict=True)}
        check_finite(self._residual_tree, "optimality residual F(w, lam)")
        self._F_depends_on_lam = True
        self._F_tuple = tuple(self._F)
        self._shapes = [x.shape for x in self._w_leaves]
        self._numels = [x.numel() for x in self._w_leaves]
        # Fast path for the repeated products: plain tensors only (subclasses and
        # __torch_function__ overrides go through torch.autograd.grad), and every output part of
        # the graph (otherwise torch.autograd.grad raises, as it always did).
        leaves = self._F + self._w_leaves + self._lam_leaves
        self._fast = (
            _engine_run_backward is not None
            and all(type(t) is torch.Tensor for t in leaves)
            and all(f.requires_grad for f in self._F)
        )
        self._run = _engine_run_backward
        if self._fast and _engine is not None and all(t.device.type == "cpu" for t in leaves):
            self._run = _engine.run_backward
        self._w_tuple = tuple(self._w_leaves)
        # single-leaf w (one flat parameter vector, the common case of the linear solvers): the
        # flat product is one reshape on each side of the engine call
        self._single = self._fast and len(self._F) == 1
        self._dtype0 = self._F[0].dtype

    @property
    def residual(self) -> Tree:
        """``F(w, lam)`` itself: zero at an exact inner solution."""
        if self._F is None:
            _, gw, _ = loss_and_grads(inner_fn(self._problem, self._batch), self._w, self._lam, wrt_lam=False)
            assert gw is not None
            return gw
        return self._residual_tree

    def _vjp_list(self, cotangents: list[Tensor], leaves: list[Tensor]) -> tuple[Tensor | None, ...]:
        assert self._F is not None
        if self._fast and all(
            c.shape == f.shape and c.dtype == f.dtype for c, f in zip(cotangents, self._F, strict=True)
        ):
            return self._run(self._F_tuple, tuple(cotangents), True, False, tuple(leaves), True, False)
        return torch.autograd.grad(self._F, leaves, cotangents, retain_graph=True, allow_unused=True)

    def _vjp(self, u: Tree, leaves: list[Tensor], like: Tree) -> Tree:
        return grads_to_tree(self._vjp_list([u[k] for k in self._w], leaves), like)

    def _split(self, v: Tensor) -> list[Tensor]:
        if len(self._shapes) == 1:
            return [v.reshape(self._shapes[0])]
        return [part.reshape(shape) for part, shape in zip(v.split(self._numels), self._shapes, strict=True)]

    def rmatvec_flat(self, u: Tensor) -> Tensor:
        r""":meth:`rmatvec` on a flat vector (the leaves of ``w`` concatenated in key order).

        Used by the iterative solvers (``LinearSystem.flat_matvec``): no dict is built per product.
        """
        if self._F is None:
            return self._flat(self.rmatvec(self._unflat(u)))
        self.matvec_count += 1
        if self._single and u.dtype == self._dtype0 and u.numel() == self._numels[0]:
            (g,) = self._run(
                self._F_tuple, (u.reshape(self._shapes[0]),), True, False, self._w_tuple, True, False
            )
            return g.reshape(-1) if g is not None else torch.zeros_like(u)
        grads = self._vjp_list(self._split(u), self._w_leaves)
        if len(grads) == 1 and grads[0] is not None:
            return grads[0].reshape(-1)
        return torch.cat(
            [(g if g is not None else torch.zeros_like(x)).reshape(-1) for g, x in zip(grads, self._w_leaves, strict=True)]
        )

    def rmatvec(self, u: Tree) -> Tree:
        r"""Return :math:`(\partial F / \partial w)^\top u` (the Hessian product in gradient form)."""
        self.matvec_count += 1
        if self._F is None:
            return self._forward_hvp(u)
        return self._vjp(u, self._w_leaves, self._w)

    def matvec(self, v: Tree) -> Tree:
        r"""Return :math:`(\partial F / \partial w) v`; equals :meth:`rmatvec` in gradient form."""
        if self.symmetric:
            return self.rmatvec(v)
        self.matvec_count += 1
        assert self._F is not None
        # Double-vjp trick: J v = d/du <J^T u, v>, since J^T u is linear in u.
        dummy = [torch.zeros_like(f, requires_grad=True) for f in self._F]
        with torch.enable_grad():
            jt_u = torch.autograd.grad(self._F, self._w_leaves, dummy, retain_graph=True, create_graph=True)
            out = torch.autograd.grad(jt_u, dummy, [v[k] for k in self._w], allow_unused=True)
        return grads_to_tree(out, self._w)

    def rmatvec_lam(self, u: Tree) -> Tree:
        r"""Return :math:`(\partial F / \partial \lambda)^\top u` (the mixed product).

        Warns (:func:`~hypergrad.errors.report`) when ``F`` does not depend on ``lam`` at all: the
        product is then identically zero.
        """
        if self._F is None:
            return self._forward_mixed(u)
        grads = self._vjp_list([u[k] for k in self._w], self._lam_leaves)
        if all(grad is None for grad in grads):
            report_lam_unused()
        return grads_to_tree(grads, self._lam)

    def dense_rmatrix(self) -> Tensor:
        r"""Materialise :math:`(\partial F/\partial w)^\top` as an ``(n, n)`` matrix (batched vjps)."""
        n = sum(x.numel() for x in self._w_leaves)
        ref = self._w_leaves[0]
        eye = torch.eye(n, dtype=ref.dtype, device=ref.device)
        if self._F is None:
            cols = [self._flat(self.rmatvec(self._unflat(eye[i]))) for i in range(n)]
            return torch.stack(cols, dim=1)
        basis: list[Tensor] = []
        offset = 0
        for x in self._w_leaves:
            basis.append(eye[:, offset : offset + x.numel()].reshape(n, *x.shape))
            offset += x.numel()
        self.matvec_count += n
        F, leaves = self._F, self._w_leaves

        def row(*cotangents: Tensor) -> tuple[Tensor, ...]:
            grads = torch.autograd.grad(F, leaves, list(cotangents), retain_graph=True, allow_unused=True)
            return tuple(g if g is not None else torch.zeros_like(x) for g, x in zip(grads, leaves, strict=True))

        # torch.func.vmap over the backward pass, not torch.autograd.grad(is_grads_batched=True):
        # as fast (measured on the benchmark's logistic problems), and it applies the vmap rules of
        # autograd Functions in the graph (hypergrad.distributed's all-reduce), which the legacy
        # batching of is_grads_batched cannot
        rows = torch.func.vmap(row)(*basis)
        # rows[j][i] = (J^T e_i) restricted to leaf j, i.e. column i of J^T.
        return torch.cat([r.reshape(n, -1) for r in rows], dim=1).T

    def _flat(self, t: Tree) -> Tensor:
        return torch.cat([t[k].reshape(-1) for k in self._w])

    def _unflat(self, v: Tensor) -> Tree:
        out, offset = {}, 0
        for k, x in self._w.items():
            out[k] = v[offset : offset + x.numel()].reshape(x.shape)
            offset += x.numel()
        return out

    def _forward_hvp(self, v: Tree) -> Tree:
        g = inner_fn(self._problem, self._batch)
        lam = {k: x.detach() for k, x in self._lam.items()}
        grad_w = torch.func.grad(lambda w: g(w, lam))
        w = {k: x.detach() for k, x in self._w.items()}
        _, out = torch.func.jvp(grad_w, (w,), ({k: v[k] for k in w},))
        return out

    def _forward_mixed(self, u: Tree) -> Tree:
        g = inner_fn(self._problem, self._batch)
        w = {k: x.detach() for k, x in self._w.items()}
        lam = {k: x.detach() for k, x in self._lam.items()}
        # d/dlam <grad_w g(w, lam), u>
        def inner_product(lam_: Tree) -> Tensor:
            gw = torch.func.grad(lambda w_: g(w_, lam_))(w)
            return sum(torch.sum(gw[k] * u[k]) for k in gw)

        return torch.func.grad(inner_product)(lam)


def check_w_used(w: Tree, grads: Sequence[Tensor | None]) -> None:
    """A one-line :class:`ValueError` for an entry of ``w`` that the inner loss ``g`` does not use.

    ``grads`` are ``torch.autograd.grad(g, list(w.values()), allow_unused=True)``: None marks an
    entry ``g`` does not depend on. The inner problem does not determine such an entry (any value
    minimises ``g``), so no method can say how it moves with ``lam``: every method refuses it,
    rather than carry it along unchanged.

    Example:
        >>> import torch
        >>> check_w_used({"x": torch.ones(1)}, (torch.ones(1),))   # used: nothing happens
        >>> check_w_used({"x": torch.ones(1), "extra": torch.ones(1)}, (torch.ones(1), None))
        Traceback (most recent call last):
        ...
        ValueError: w['extra'] is not used by the inner loss g: the inner problem does not determine it, so it has no implicit derivative; remove it from w (or make g use it)
    """
    for key, grad in zip(w, grads, strict=True):
        if grad is None:
            raise ValueError(
                f"w[{key!r}] is not used by the inner loss g: the inner problem does not determine it, so it has no "
                "implicit derivative; remove it from w (or make g use it)"
            )


def _check_w_determined(w: Tree, grads: tuple[Tensor | None, ...]) -> None:
    """:func:`check_w_used`, and a one-line error for an entry ``g`` is linear in (gradients with a graph)."""
    check_w_used(w, grads)
    for key, grad in zip(w, grads, strict=True):
        if grad is not None and not grad.requires_grad:
            raise ValueError(
                f"the inner loss g is linear in w[{key!r}] (its gradient does not depend on w or lam): the inner "
                "problem has no minimiser in it; remove it from w or make g strictly convex in it"
            )


def report_lam_unused(stacklevel: int = 4) -> None:
    r"""Warn that the inner optimality condition does not depend on ``lam``.

    Then :math:`\partial^2 g / \partial\lambda\partial w = 0`, ``w*`` does not move with ``lam``,
    and the hypergradient is :math:`\nabla_\lambda f` alone (zero when ``f`` ignores ``lam`` too):
    usually a ``g`` that forgot to use ``lam``. Folded like every hypergrad warning: once per call,
    once per :func:`hypergrad.solve`.

    Args:
        stacklevel: as for :func:`warnings.warn`, counted from the caller of this function.

    Example:
        >>> import warnings, torch, hypergrad as hg
        >>> g = lambda w, lam, b: 0.5 * (w["x"] ** 2).sum()    # ignores lam
        >>> lam = {"c": torch.ones(2, dtype=torch.float64)}
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     r = hg.Implicit().hypergrad(hg.BilevelProblem(g, g), {"x": torch.ones(2, dtype=torch.float64)}, lam)
        >>> r.grad["c"].tolist(), "does not depend on lam" in str(caught[0].message)
        ([0.0, 0.0], True)
    """
    from hypergrad.errors import report

    report(["the inner loss g's gradient in w does not depend on lam (g ignores lam, or uses it only in terms "
            "without w): w* does not move with lam and the hypergradient is grad_lam f alone (zero if f "
            "ignores lam too); check that g uses lam"], UserWarning, stacklevel=stacklevel)


def grad_or_zeros(value: Tensor, inputs: Tree, create_graph: bool) -> Tree:
    """``d value / d inputs`` as a tree, zeros where ``value`` does not depend on an input.

    With ``create_graph`` the gradients keep their graph (for a derivative of the gradient, as
    the reverse-mode unrolling takes).

    Example:
        >>> import torch
        >>> x, y = torch.ones(2, requires_grad=True), torch.ones(1, requires_grad=True)
        >>> grads = grad_or_zeros((3 * x).sum(), {"x": x, "y": y}, create_graph=False)
        >>> grads["x"].tolist(), grads["y"].tolist()
        ([3.0, 3.0], [0.0])
    """
    if not value.requires_grad:
        return {k: torch.zeros_like(v) for k, v in inputs.items()}
    if create_graph:
        return grads_to_tree(grad_with_graph(value, list(inputs.values())), inputs)
    grads = torch.autograd.grad(value, list(inputs.values()), allow_unused=True)
    return grads_to_tree(grads, inputs)
