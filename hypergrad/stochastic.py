r"""Shared pieces of the stochastic bilevel solvers (SOBA, SABA, AmIGO, StocBiO).

* Step sizes: a float, or a schedule (a callable of the step counter ``t = 0, 1, ...``) such as
  :class:`Decreasing` (:math:`c / (t + 1)^{a}`, the convention of benchmark_bilevel), and
  :class:`ScheduledSGD`, a :mod:`torch.optim` SGD whose learning rate follows such a schedule, to
  use as the outer optimizer of :func:`hypergrad.solve`.
* The per-batch oracle: :func:`inner_products` returns :math:`\nabla_w g`, the Hessian-vector
  product :math:`\nabla^2_{ww} g\, v` and the mixed product :math:`\nabla^2_{\lambda w} g\, v` of
  one batch from one graph of :math:`\nabla_w g` (the two products in one backward pass);
  :func:`outer_grads` returns :math:`(\nabla_w f, \nabla_\lambda f)` of one batch.
* :class:`OracleCounts`, the per-oracle call count every solver reports in
  ``info.extra["oracle_calls"]``.
* :func:`step_counter` and :func:`linear_iterate` read a solver's carried state.

Sign convention shared by the solvers: the linear-system iterate ``v`` approximates
:math:`v^* = [\nabla^2_{ww} g]^{-1} \nabla_w f` and the hypergradient is
:math:`\nabla_\lambda f - \nabla^2_{\lambda w} g\, v` (benchmark_bilevel's SOBA and SABA carry
:math:`-v`; the numbers are the same).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import Tensor

from hypergrad.autodiff import (
    RootSystem,
    check_w_used,
    grad_with_graph,
    loss_and_grads,
    outer_fn,
    report_lam_unused,
)
from hypergrad.batches import StepBatches, per_step
from hypergrad.compiled import eager_fallback, grad_and_value, non_finite_fallback, replayable
from hypergrad.problem import BilevelProblem, HypergradInfo, HypergradResult
from hypergrad.tree import (
    Tree,
    check_finite,
    check_like,
    check_tree,
    grads_to_tree,
    tree_axpy,
    tree_detach,
    tree_norm,
    tree_requires_grad,
    tree_zeros_like,
)

__all__ = [
    "NON_FINITE",
    "CompiledCall",
    "Decreasing",
    "InnerProducts",
    "OracleCounts",
    "ScheduledSGD",
    "StepSize",
    "check_step_size",
    "compiled_info",
    "compiled_stochastic",
    "hessian_products",
    "inner_products",
    "linear_iterate",
    "one_batch",
    "outer_grads",
    "step_counter",
    "step_size_at",
    "tensor_like",
    "traced_cross_product",
    "traced_hessian_products",
    "traced_inner_products",
    "traced_inner_sgd",
    "traced_outer_grads",
]

StepSize = float | Callable[[int], float]
"""A step size: a number, or a schedule ``t -> step`` of the step counter ``t = 0, 1, ...``."""


@dataclass(frozen=True)
class Decreasing:
    r"""The decreasing schedule :math:`t \mapsto c / (t + 1)^{a}`.

    ``t`` counts calls from 0, so the first step is ``initial``; this is benchmark_bilevel's
    ``update_lr`` (``exponent=0.5`` for SOBA, 0 for constant steps).

    Args:
        initial: :math:`c > 0`, the first step.
        exponent: :math:`a \ge 0`.

    Example:
        >>> from hypergrad.stochastic import Decreasing
        >>> schedule = Decreasing(0.1, exponent=0.5)
        >>> [round(schedule(t), 4) for t in range(4)]
        [0.1, 0.0707, 0.0577, 0.05]
    """

    initial: float
    exponent: float = 0.5

    def __post_init__(self) -> None:
        _check_positive_real(self.initial, "initial")
        if not isinstance(self.exponent, (int, float)) or isinstance(self.exponent, bool):
            raise TypeError(f"exponent must be a real number, got {type(self.exponent).__name__}")
        if not 0.0 <= self.exponent < float("inf"):
            raise ValueError(f"exponent must be a finite number >= 0, got {self.exponent!r}")

    def __call__(self, t: int) -> float:
        """The step at counter ``t >= 0``."""
        return float(self.initial) / (t + 1) ** float(self.exponent)


def _check_positive_real(value: object, name: str) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
    if not 0.0 < value < float("inf"):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")


def check_step_size(value: object, name: str) -> None:
    """Check that ``value`` is a finite number > 0 or a callable schedule.

    Raises:
        TypeError: neither a real number nor a callable.
        ValueError: a number that is not finite and > 0.

    Example:
        >>> from hypergrad.stochastic import check_step_size
        >>> check_step_size(0.1, "step_size")
        >>> check_step_size(-1.0, "step_size")
        Traceback (most recent call last):
        ...
        ValueError: step_size must be a finite number > 0 (or a schedule t -> step), got -1.0
    """
    if callable(value):
        return
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise TypeError(f"{name} must be a real number > 0 or a schedule t -> step, got {type(value).__name__}")
    if not 0.0 < value < float("inf"):
        raise ValueError(f"{name} must be a finite number > 0 (or a schedule t -> step), got {value!r}")


def step_size_at(step_size: StepSize, t: int, name: str) -> float:
    """The step of ``step_size`` at counter ``t``: the number itself, or ``step_size(t)``.

    Raises:
        ValueError: a schedule returned a value that is not a finite number > 0.

    Example:
        >>> from hypergrad.stochastic import Decreasing, step_size_at
        >>> step_size_at(0.5, 7, "step_size"), step_size_at(Decreasing(1.0, 1.0), 3, "step_size")
        (0.5, 0.25)
    """
    if not callable(step_size):
        return float(step_size)
    value = step_size(t)
    if isinstance(value, Tensor) and value.numel() == 1:
        value = float(value)
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0.0 < value < float("inf"):
        raise ValueError(f"{name} schedule must return a finite number > 0, got {value!r} at step {t}")
    return float(value)


class ScheduledSGD(torch.optim.Optimizer):
    r"""Plain SGD, :math:`p \leftarrow p - \eta_t\, \mathrm{grad}`, with :math:`\eta_t` a schedule.

    The outer optimizer for the decreasing outer steps of the stochastic solvers: pass
    ``lambda p: ScheduledSGD(p, Decreasing(step_size / outer_ratio, 0.5))`` as the optimizer factory
    of :func:`hypergrad.solve` for benchmark_bilevel's SOBA schedule. ``t`` counts :meth:`step`
    calls from 0, in step with the solvers' own counters.

    Args:
        params: the parameters (as for any :mod:`torch.optim` optimizer).
        step_size: a number > 0 or a schedule ``t -> step``.

    Example:
        >>> import torch
        >>> from hypergrad.stochastic import Decreasing, ScheduledSGD
        >>> p = torch.zeros(1, requires_grad=True)
        >>> opt = ScheduledSGD([p], Decreasing(1.0, exponent=1.0))
        >>> for _ in range(3):
        ...     p.grad = torch.ones(1)
        ...     opt.step()
        >>> round(p.item(), 4)   # -(1 + 1/2 + 1/3)
        -1.8333
    """

    def __init__(self, params: Iterable[Any], step_size: StepSize) -> None:
        check_step_size(step_size, "step_size")
        super().__init__(params, {})
        self.step_size = step_size
        self.t = 0

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Take one step with the step size at the current counter, then advance the counter."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        lr = step_size_at(self.step_size, self.t, "step_size")
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-lr)
        self.t += 1
        return loss


@dataclass
class OracleCounts:
    """Oracle calls of one solver call, as benchmark_bilevel counts them.

    Attributes:
        inner_grad: inner gradients :math:`\\nabla_w g` of one batch.
        hvp: Hessian-vector products :math:`\\nabla^2_{ww} g\\, v`.
        cross: mixed products :math:`\\nabla^2_{\\lambda w} g\\, v`.
        outer_grad: outer gradients :math:`(\\nabla_w f, \\nabla_\\lambda f)` of one batch.

    Example:
        >>> from hypergrad.stochastic import OracleCounts
        >>> c = OracleCounts(inner_grad=1, hvp=1, cross=1, outer_grad=1)
        >>> c.total, c.as_dict()["hvp"]
        (4, 1)
    """

    inner_grad: int = 0
    hvp: int = 0
    cross: int = 0
    outer_grad: int = 0

    @property
    def total(self) -> int:
        """All calls together (what ``info.grad_evals`` reports)."""
        return self.inner_grad + self.hvp + self.cross + self.outer_grad

    def as_dict(self) -> dict[str, int]:
        """The four counts by name."""
        return {"inner_grad": self.inner_grad, "hvp": self.hvp, "cross": self.cross, "outer_grad": self.outer_grad}


class InnerProducts(NamedTuple):
    """What :func:`inner_products` returns; a product not asked for is None."""

    grad: Tree
    hvp: Tree | None
    cross: Tree | None


def inner_products(
    problem: BilevelProblem,
    w: Tree,
    lam: Tree,
    batch: Any,
    v: Tree | None = None,
    *,
    hvp: bool = False,
    cross: bool = False,
) -> InnerProducts:
    r""":math:`\nabla_w g`, and optionally :math:`\nabla^2_{ww} g\, v` and :math:`\nabla^2_{\lambda w} g\, v`, of one batch.

    The gradient is taken once with its graph; the requested products are then one backward
    pass through it (both at once when both are asked for).

    Args:
        problem: the bilevel problem (its inner loss ``g``).
        w, lam: the point.
        batch: the inner batch, passed to ``g`` unchanged.
        v: the vector of the products (shaped like ``w``); required when a product is asked for.
        hvp: return the Hessian-vector product.
        cross: return the mixed product (shaped like ``lam``).

    Raises:
        hypergrad.NonFiniteError: the loss or a returned tree holds NaN or inf.

    Example:
        >>> import torch, hypergrad as hg
        >>> from hypergrad.stochastic import inner_products
        >>> g = lambda w, lam, b: 0.5 * (lam["a"] * w["x"] ** 2).sum()
        >>> w, lam = {"x": torch.tensor([1.0, 2.0])}, {"a": torch.tensor(3.0)}
        >>> out = inner_products(hg.BilevelProblem(g, g), w, lam, None, {"x": torch.ones(2)}, hvp=True, cross=True)
        >>> out.grad["x"].tolist(), out.hvp["x"].tolist(), float(out.cross["a"])
        ([3.0, 6.0], [3.0, 3.0], 3.0)
    """
    from hypergrad.errors import NonFiniteError

    if (hvp or cross) and v is None:
        raise ValueError("v (shaped like w) is required for the Hessian-vector or mixed product")
    w_ = tree_requires_grad(w)
    lam_ = tree_requires_grad(lam) if cross else tree_detach(lam)
    w_leaves = list(w_.values())
    with torch.enable_grad():
        value = problem.inner_loss(w_, lam_, batch)
        if not bool(torch.isfinite(value)):
            raise NonFiniteError(f"inner loss is {float(value.detach())} (non-finite)")
        if not (hvp or cross):
            grads = torch.autograd.grad(value, w_leaves, allow_unused=True) if value.requires_grad else (None,) * len(w_leaves)
            check_w_used(w_, grads)
            grad = grads_to_tree(grads, w_)
            check_finite(grad, "inner gradient")
            return InnerProducts(grad, None, None)
        first = grad_with_graph(value, w_leaves) if value.requires_grad else (None,) * len(w_leaves)
        check_w_used(w_, first)
        grad = grads_to_tree([None if f is None else f.detach() for f in first], w_)
        check_finite(grad, "inner gradient")
        assert v is not None
        # Entries of the gradient that do not depend on (w, lam) (g linear in them) contribute
        # no second derivative; torch.autograd.grad rejects them, so they are left out.
        pairs = [(f, v[k]) for k, f in zip(w_, first, strict=True) if f is not None and f.requires_grad]
        leaves = (w_leaves if hvp else []) + (list(lam_.values()) if cross else [])
        if pairs:
            second = torch.autograd.grad(
                [f for f, _ in pairs], leaves, [u.to(f.dtype) for f, u in pairs], allow_unused=True
            )
        else:
            second = (None,) * len(leaves)
    n_w = len(w_leaves) if hvp else 0
    hvp_tree = grads_to_tree(second[:n_w], w_) if hvp else None
    if cross and all(part is None for part in second[n_w:]):
        report_lam_unused()
    cross_tree = grads_to_tree(second[n_w:], lam_) if cross else None
    if hvp_tree is not None:
        check_finite(hvp_tree, "Hessian-vector product")
    if cross_tree is not None:
        check_finite(cross_tree, "mixed product")
    return InnerProducts(grad, hvp_tree, cross_tree)


def hessian_products(problem: BilevelProblem, w: Tree, lam: Tree, inner_batch: Any) -> Callable[[Any, Tree], Tree]:
    r"""A function ``(batch, v) -> H_batch v`` for the repeated products of one call at ``(w, lam)``.

    When ``inner_batch`` is a plain batch (reused for every step, see
    :func:`hypergrad.batches.per_step`), the graph of :math:`\nabla_w g` is built once and every
    product is one backward pass through it (about half the cost of building it per product).
    With a :class:`~hypergrad.batches.StepBatches` every product builds the graph of its own
    batch (no reuse on object identity: a loader may refill one buffer in place).

    Raises:
        hypergrad.NonFiniteError: the loss or a product holds NaN or inf.

    Example:
        >>> import torch, hypergrad as hg
        >>> from hypergrad.stochastic import hessian_products
        >>> g = lambda w, lam, b: 0.5 * (lam["a"] * w["x"] ** 2).sum()
        >>> w, lam = {"x": torch.tensor([1.0, 2.0])}, {"a": torch.tensor(3.0)}
        >>> hvp = hessian_products(hg.BilevelProblem(g, g), w, lam, None)
        >>> hvp(None, {"x": torch.ones(2)})["x"].tolist()
        [3.0, 3.0]
    """
    if isinstance(inner_batch, StepBatches):

        def fresh(batch: Any, v: Tree) -> Tree:
            out = inner_products(problem, w, lam, batch, v, hvp=True).hvp
            assert out is not None
            return out

        return fresh
    system: RootSystem | None = None

    def reused(batch: Any, v: Tree) -> Tree:
        nonlocal system
        if system is None:
            system = RootSystem(problem, w, tree_detach(lam), batch)
        out = system.rmatvec(v)
        check_finite(out, "Hessian-vector product")
        return out

    return reused


def outer_grads(problem: BilevelProblem, w: Tree, lam: Tree, batch: Any) -> tuple[Tree, Tree]:
    r""":math:`(\nabla_w f, \nabla_\lambda f)` of one outer batch (zeros where ``f`` ignores ``lam``).

    Raises:
        hypergrad.NonFiniteError: the loss or a gradient holds NaN or inf.

    Example:
        >>> import torch, hypergrad as hg
        >>> from hypergrad.stochastic import outer_grads
        >>> f = lambda w, lam, b: (w["x"] ** 2).sum()
        >>> gw, glam = outer_grads(hg.BilevelProblem(f, f), {"x": torch.ones(2)}, {"c": torch.ones(1)}, None)
        >>> gw["x"].tolist(), glam["c"].tolist()
        ([2.0, 2.0], [0.0])
    """
    _, grad_w, grad_lam = loss_and_grads(outer_fn(problem, batch), w, lam, what="outer loss")
    assert grad_w is not None and grad_lam is not None
    check_finite(grad_w, "outer gradient (w)")
    check_finite(grad_lam, "outer gradient (lam)")
    return grad_w, grad_lam


def one_batch(batch: Any) -> Any:
    """The batch of a one-batch-per-call solver: the next batch of a ``StepBatches``, else ``batch``.

    Example:
        >>> import hypergrad as hg
        >>> from hypergrad.stochastic import one_batch
        >>> one_batch("b"), one_batch(hg.StepBatches(iter("xyz")))
        ('b', 'x')
    """
    return per_step(batch, 1)[0]


def step_counter(state: dict[str, Any] | None, method: str) -> int:
    """The step counter ``state["step"]`` (0 without a state).

    Raises:
        ValueError: ``state["step"]`` is not an int >= 0.

    Example:
        >>> from hypergrad.stochastic import step_counter
        >>> step_counter(None, "SOBA"), step_counter({"step": 4}, "SOBA")
        (0, 4)
    """
    if state is None or state.get("step") is None:
        return 0
    t = state["step"]
    if not isinstance(t, int) or isinstance(t, bool) or t < 0:
        raise ValueError(f"{method}: state['step'] must be an int >= 0 (the calls so far), got {t!r}")
    return t


def linear_iterate(state: dict[str, Any] | None, w: Tree, method: str) -> Tree:
    """The carried linear-system iterate ``state["v"]`` (zeros shaped like ``w`` without one).

    Raises:
        ValueError: ``state["v"]`` is not shaped like ``w``.

    Example:
        >>> import torch
        >>> from hypergrad.stochastic import linear_iterate
        >>> linear_iterate(None, {"x": torch.ones(2)}, "SOBA")["x"].tolist()
        [0.0, 0.0]
    """
    if state is None or state.get("v") is None:
        return tree_zeros_like(w)
    v = check_tree(state["v"], f"{method} state['v']")
    check_like(v, w, f"{method} state['v']", "w")
    return tree_detach(v)


# ------------------------------------------------------- compiled stages (compile=True)
#
# SOBA, SABA, AmIGO and StocBiO: one call is a fixed sequence of batch gradients and products
# (no solver loop with a tolerance), so, as for BOME, the whole call is the stage (each
# method's stage is in its module; :mod:`hypergrad.compiled` is the backend). What changes
# from call to call is data, never code: the iterates, the step sizes of the schedules (0-dim
# tensors, not Python floats, which dynamo would bake into the graph), SABA's stored oracle
# values of the batch's memory slot (the slot index stays in Python) and every drawn batch's
# tensors (graph inputs).


def traced_inner_products(problem: BilevelProblem, w: Tree, lam: Tree, batch: Any,
                          v: Tree) -> tuple[Tree, Tree, Tree, Tensor]:
    r""":math:`\nabla_w g`, :math:`\nabla^2_{ww} g\, v`, :math:`\nabla^2_{\lambda w} g\, v` and :math:`g` of one batch.

    Traceable (``torch.func``; both products in one reverse pass, as :func:`inner_products`).

    Example:
        >>> import torch, hypergrad as hg
        >>> problem = hg.BilevelProblem(lambda w, lam, b: 0.5 * (lam["c"] * w["x"] ** 2).sum(),
        ...                             lambda w, lam, b: (lam["c"] * w["x"]).sum())
        >>> w, lam = {"x": torch.ones(2)}, {"c": torch.full((2,), 2.0)}
        >>> grad, hv, cross, value = traced_inner_products(problem, w, lam, None, {"x": torch.ones(2)})
        >>> grad["x"].tolist(), hv["x"].tolist(), cross["c"].tolist(), value.item()
        ([2.0, 2.0], [2.0, 2.0], [1.0, 1.0], 2.0)
    """
    def grad_w_g(w_: Tree, l_: Tree) -> tuple[Tree, Tensor]:
        return torch.func.grad_and_value(lambda t: problem.inner_loss(t, l_, batch))(w_)

    grad, products, value = torch.func.vjp(grad_w_g, w, lam, has_aux=True)
    hv, cross = products(v)  # both products in one reverse pass, as the eager oracle
    return grad, hv, cross, value


def _hessian_product(problem: BilevelProblem, w: Tree, lam: Tree, batch: Any) -> Callable[[Tree], Tree]:
    """``v -> H v`` of one batch at ``w`` (the gradient's graph traced once, reused per product).

    Neither the gradient nor the loss is an output, so the compiled graph computes only what the
    product needs (a loss value would cost a full forward pass per product); non-finite losses
    still surface in the products and in the checked loss values of the mixed product."""
    _, hvp = torch.func.vjp(torch.func.grad(lambda t: problem.inner_loss(t, lam, batch)), w)
    return lambda v: hvp(v)[0]


def traced_cross_product(problem: BilevelProblem, w: Tree, lam: Tree, batch: Any, v: Tree) -> tuple[Tree, Tensor]:
    r""":math:`\nabla^2_{\lambda w} g\, v` and :math:`g` of one batch at ``(w, lam)`` (traceable).

    Example:
        >>> import torch, hypergrad as hg
        >>> problem = hg.BilevelProblem(lambda w, lam, b: 0.5 * (lam["c"] * w["x"] ** 2).sum(),
        ...                             lambda w, lam, b: (lam["c"] * w["x"]).sum())
        >>> w, lam = {"x": torch.ones(2)}, {"c": torch.full((2,), 2.0)}
        >>> cross, value = traced_cross_product(problem, w, lam, None, {"x": torch.ones(2)})
        >>> cross["c"].tolist(), value.item()
        ([1.0, 1.0], 2.0)
    """
    _, cross, value = torch.func.vjp(
        lambda l_: torch.func.grad_and_value(lambda t: problem.inner_loss(t, l_, batch))(w), lam, has_aux=True)
    return cross(v)[0], value


def traced_outer_grads(problem: BilevelProblem, w: Tree, lam: Tree, batch: Any) -> tuple[Tree, Tree, Tensor]:
    r""":math:`\nabla_w f`, :math:`\nabla_\lambda f` and :math:`f` of one batch (traceable).

    Example:
        >>> import torch, hypergrad as hg
        >>> problem = hg.BilevelProblem(lambda w, lam, b: 0.5 * (lam["c"] * w["x"] ** 2).sum(),
        ...                             lambda w, lam, b: (lam["c"] * w["x"]).sum())
        >>> w, lam = {"x": torch.ones(2)}, {"c": torch.full((2,), 2.0)}
        >>> grad_w, grad_lam, value = traced_outer_grads(problem, w, lam, None)
        >>> grad_w["x"].tolist(), grad_lam["c"].tolist(), value.item()
        ([2.0, 2.0], [1.0, 1.0], 4.0)
    """
    (grad_w, grad_lam), value = grad_and_value(lambda w_, l_: problem.outer_loss(w_, l_, batch), w, lam, (0, 1))
    return grad_w, grad_lam, value


def traced_inner_sgd(problem: BilevelProblem, w: Tree, lam: Tree, rho: Tensor, batches: list[Any]) -> tuple[Tree, Tensor]:
    """SGD steps on :math:`g` with step ``rho``, one per batch (traceable): AmIGO's and StocBiO's inner steps.

    Returns the last iterate and the last gradient norm (0 without steps). No loss values: only
    the gradients (the steps' outputs are checked for non-finite values).

    Example:
        >>> import torch, hypergrad as hg
        >>> problem = hg.BilevelProblem(lambda w, lam, b: 0.5 * (lam["c"] * w["x"] ** 2).sum(),
        ...                             lambda w, lam, b: (lam["c"] * w["x"]).sum())
        >>> w, lam = {"x": torch.ones(2)}, {"c": torch.full((2,), 2.0)}
        >>> w_new, residual = traced_inner_sgd(problem, w, lam, torch.tensor(0.25), [None, None])
        >>> w_new["x"].tolist(), round(residual.item(), 4)  # x <- x - 0.25 * 2 x, twice
        ([0.25, 0.25], 1.4142)
    """
    residual = torch.zeros_like(rho)
    for batch in batches:
        grad = torch.func.grad(lambda t, b=batch: problem.inner_loss(t, lam, b))(w)
        residual = tree_norm(grad)
        w = tree_axpy(-rho, grad, w)
    return w, residual


def traced_hessian_products(problem: BilevelProblem, w: Tree, lam: Tree, batches: list[Any],
                            shared: bool) -> list[Callable[[Tree], Tree]]:
    """``v -> H_i v`` for each batch, one shared product where the call reuses one batch (traceable).

    The traceable form of :func:`hessian_products`; neither the gradient nor the loss value is an
    output, so a compiled graph computes only what the products need.

    Example:
        >>> import torch, hypergrad as hg
        >>> problem = hg.BilevelProblem(lambda w, lam, b: 0.5 * (lam["c"] * w["x"] ** 2).sum(),
        ...                             lambda w, lam, b: (lam["c"] * w["x"]).sum())
        >>> w, lam = {"x": torch.ones(2)}, {"c": torch.full((2,), 2.0)}
        >>> products = traced_hessian_products(problem, w, lam, [None, None], shared=True)
        >>> len(products), products[1]({"x": torch.ones(2)})["x"].tolist()
        (2, [2.0, 2.0])
    """
    products: list[Callable[[Tree], Tree]] = []
    for batch in batches[:1] if shared else batches:
        products.append(_hessian_product(problem, w, lam, batch))
    return products * len(batches) if shared else products


def compiled_info(calls: OracleCounts, iterations: int, residual: float | None,
                  extra: dict[str, Any], compile_s: float) -> HypergradInfo:
    """The ``info`` of a compiled stochastic call: the counts, ``extra`` and the compilation fields.

    Example:
        >>> info = compiled_info(OracleCounts(inner_grad=1, hvp=1), 1, 0.5, {"step": 0}, 0.0)
        >>> info.grad_evals, info.extra["compiled"], info.extra["step"]
        (2, True, 0)
    """
    return HypergradInfo(iterations=iterations, residual=residual, converged=None, grad_evals=calls.total,
                         extra={"oracle_calls": calls.as_dict(), **extra, "compiled": True, "compile_s": compile_s})


NON_FINITE: Any = object()
"""What a compiled call of :func:`compiled_stochastic` returns when its step gave a non-finite value."""


def tensor_like(value: float, like: Tree) -> Tensor:
    """``value`` as a 0-dim tensor of the dtype and device of ``like``'s leaves: a step size a
    compiled graph reads as an input (a Python float would be baked into the graph).

    Example:
        >>> import torch
        >>> tensor_like(0.5, {"x": torch.zeros(2, dtype=torch.float64)})
        tensor(0.5000, dtype=torch.float64)
    """
    ref = next(iter(like.values()))
    return torch.tensor(value, dtype=ref.dtype, device=ref.device)


CompiledCall = Callable[..., Any]
"""A method's compiled call for :func:`compiled_stochastic`: ``(method, problem, w, lam, inner_batch,
outer_batch, state, t) -> HypergradResult | None | NON_FINITE``."""


def compiled_stochastic(method: Any, problem: BilevelProblem, w: Tree, lam: Tree, inner_batch: Any = None,
                        outer_batch: Any = None, state: dict[str, Any] | None = None, *,
                        call: CompiledCall) -> HypergradResult:
    r"""``method.hypergrad(...)`` of a SOBA, SABA, AmIGO or StocBiO from its compiled step.

    Called by ``compile=True`` on :class:`~hypergrad.soba.SOBA`, :class:`~hypergrad.saba.SABA`,
    :class:`~hypergrad.amigo.AmIGO` and :class:`~hypergrad.stocbio.StocBiO`: the whole call (the
    batch gradients and products, the SAGA estimates, the inner and linear-system steps) runs as
    one compiled graph. Compiles once per problem, shape, dtype and method configuration; the
    iterates, the carried state, the step sizes of the schedules (0-dim tensor inputs) and the
    tensors of every drawn batch are read afresh, so the graph is not recompiled per step or per
    batch. SABA's memory slot index stays outside the graph (the slot's stored values are inputs);
    its stage is traced with dynamo's automatic dynamic shapes, so a batch ``(index, data)`` with a
    Python ``int`` index costs one recompile (the index becomes symbolic), not one per index. With
    a :class:`~hypergrad.batches.StepBatches`, AmIGO and StocBiO read their ``T + L + 1`` (or
    ``T + Q + 1``) batches as in the eager call. Falls back to the eager call (logged once per
    problem) where compilation fails; a non-finite value reruns the eager call, which raises its
    :class:`~hypergrad.errors.NonFiniteError`. Checked for non-finite values: every output and
    state tree, the loss values of the products of SOBA and SABA and of the mixed product and
    outer gradient of AmIGO and StocBiO; their inner steps and Hessian products compute no loss
    value (that would cost one more forward pass per step), so a non-finite loss whose gradient is
    finite there goes unnoticed where the eager call raises.

    Each method's stage and compiled call live in its module (``hypergrad.soba`` and so on); this
    function holds what the four share: the batches made replayable, the checks of ``w``,
    ``lam`` and the step counter, and the fallbacks.

    Args:
        method: the SOBA, SABA, AmIGO or StocBiO (``compile`` may be either value: the fallbacks
            run it with ``compile=False``).
        problem, w, lam, inner_batch, outer_batch, state: as for ``method.hypergrad``.
        call: the method's compiled call, ``(method, problem, w, lam, inner_batch, outer_batch,
            state, t) -> result`` at the checked, detached ``w`` and ``lam`` and step ``t``: the
            result, None where compilation is unavailable (the eager call runs), or
            :data:`NON_FINITE` (the eager call runs and raises its diagnostic).

    Returns:
        The eager call's result (same fields, state and counts) with ``info.extra["compiled"]``
        (which path ran) and ``info.extra["compile_s"]`` (seconds this call spent compiling).

    Example:
        >>> import torch, hypergrad as hg
        >>> g = lambda w, lam, b: 0.5 * ((w["x"] - lam["c"]) ** 2).sum()
        >>> f = lambda w, lam, b: 0.5 * ((w["x"] - 3.0) ** 2).sum()
        >>> w, lam = {"x": torch.zeros(2, dtype=torch.float64)}, {"c": torch.ones(2, dtype=torch.float64)}
        >>> def unavailable(method, problem, w, lam, inner_batch, outer_batch, state, t):
        ...     return None  # what a call returns without a compiler: the eager call runs
        >>> r = compiled_stochastic(hg.SOBA(step_size=0.5, compile=True), hg.BilevelProblem(g, f), w, lam,
        ...                         call=unavailable)
        >>> r.info.extra["compiled"], sorted(r.state), r.info.extra["oracle_calls"]["hvp"]
        (False, ['step', 'v'], 1)
        >>> soba = hg.SOBA(step_size=0.5, compile=True)  # its hypergrad runs SOBA's compiled call
        >>> r = soba.hypergrad(hg.BilevelProblem(g, f), w, lam)
        >>> r.grad["c"].tolist() == hg.SOBA(step_size=0.5).hypergrad(hg.BilevelProblem(g, f), w, lam).grad["c"].tolist()
        True
    """
    name = type(method).__name__
    inner_batch, outer_batch = replayable(inner_batch), replayable(outer_batch)
    args = (w, lam, inner_batch, outer_batch, state)
    w, lam = problem.validate(w, lam)
    w, lam = tree_detach(w), tree_detach(lam)
    t = step_counter(state, name)
    result = call(method, problem, w, lam, inner_batch, outer_batch, state, t)
    if result is None:
        return eager_fallback(method, problem, args)
    if result is NON_FINITE:
        return non_finite_fallback(method, problem, args)
    return result
