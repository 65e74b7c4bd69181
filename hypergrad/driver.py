"""The outer loop: inner steps, hypergradient, outer optimizer step, for any method."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

try:  # the progress bar is optional: hypergrad itself needs only torch and numpy
    from tqdm.auto import tqdm
except ImportError:

    class tqdm:  # noqa: N801  (stands in for tqdm.auto.tqdm without a bar: iterates, drops the postfix)
        def __init__(self, iterable: Iterable[Any], **_options: Any) -> None:
            self.iterable = iterable

        def __iter__(self) -> Iterator[Any]:
            return iter(self.iterable)

        def set_postfix(self, **_values: Any) -> None:
            pass


from hypergrad.autodiff import inner_fn, loss_and_grads
from hypergrad.inner import SGD, InnerOptimizer
from hypergrad.problem import BilevelProblem, HypergradMethod
from hypergrad.tree import Tree, check_finite, check_like, tree_detach, tree_norm

__all__ = ["SolveResult", "inner_solve", "solve"]

OptimizerFactory = Callable[[list[torch.Tensor]], torch.optim.Optimizer]


@dataclass
class SolveResult:
    """Outcome of :func:`solve`.

    Attributes:
        w: final inner parameters.
        lam: final outer parameters.
        history: per outer step: ``outer_loss`` (f at the current ``w``), ``grad_norm`` (of the
            hypergradient estimate), ``inner_residual`` (‖∇_w g‖ before the estimate) and
            ``converged`` (the method's own flag).
        state: the method's state after the last step (pass it to a later call to resume).

    Example:
        >>> import torch, hypergrad as hg
        >>> g = lambda w, lam, b: 0.5 * ((w["x"] - lam["c"]) ** 2).sum()
        >>> res = hg.solve(hg.BilevelProblem(g, g), {"x": torch.zeros(1)}, {"c": torch.ones(1)},
        ...                hg.Implicit(), steps=3, inner_steps=5, progress=False)
        >>> sorted(res.history), len(res.history["outer_loss"])
        (['converged', 'grad_norm', 'inner_residual', 'outer_loss'], 3)
    """

    w: Tree
    lam: Tree
    history: dict[str, list[float]] = field(default_factory=dict)
    state: dict[str, Any] | None = None


def _cycle(batches: Iterable[Any] | None) -> Iterator[Any]:
    if batches is None:
        return itertools.repeat(None)
    if isinstance(batches, torch.Tensor | dict | tuple):
        # A single batch object (not an iterable of batches): reuse it every step.
        return itertools.repeat(batches)
    return itertools.cycle(batches)


def inner_solve(
    problem: BilevelProblem,
    w: Tree,
    lam: Tree,
    steps: int,
    optimizer: InnerOptimizer,
    batches: Iterable[Any] | None = None,
    opt_state: Tree | None = None,
) -> tuple[Tree, Tree, float]:
    """Run ``steps`` plain (non-differentiable) optimizer steps on ``g(·, lam)``.

    Args:
        problem: the bilevel problem (only its inner loss is used).
        w: starting inner parameters.
        lam: outer parameters, held fixed.
        steps: number of steps (>= 0).
        optimizer: an inner optimizer from :mod:`hypergrad.inner`.
        batches: an iterable of inner batches (cycled, one per step), a single batch (a tensor,
            dict or tuple, reused), or None.
        opt_state: optimizer state to continue from (default ``optimizer.init(w)``).

    Returns:
        ``(w, optimizer_state, final_gradient_norm)``; the norm is that of the last gradient
        taken (NaN when ``steps == 0``).

    Raises:
        ValueError: ``steps`` is not an int >= 0.
        hypergrad.errors.NonFiniteError: the inner loss or its gradient became NaN or inf (a
            step size too large for the problem).

    Example:
        >>> import torch, hypergrad as hg
        >>> g = lambda w, lam, b: 0.5 * ((w["x"] - lam["c"]) ** 2).sum()
        >>> p = hg.BilevelProblem(g, g)
        >>> w, _, res = hg.inner_solve(p, {"x": torch.zeros(2)}, {"c": torch.ones(2)}, 50, hg.inner.SGD(0.5))
        >>> w["x"].tolist(), res < 1e-6
        ([1.0, 1.0], True)
    """
    if not isinstance(steps, int) or steps < 0:
        raise ValueError(f"inner_steps must be an int >= 0, got {steps!r}")
    state = optimizer.init(w) if opt_state is None else opt_state
    batch_iter = _cycle(batches)
    residual = float("nan")
    for _ in range(steps):
        _, gw, _ = loss_and_grads(inner_fn(problem, next(batch_iter)), w, lam, wrt_lam=False, what="inner loss")
        assert gw is not None
        residual = float(tree_norm(gw))
        with torch.no_grad():
            w, state = optimizer.update(w, gw, state)
        w = tree_detach(w)
    return w, state, residual


def solve(
    problem: BilevelProblem,
    w: Tree,
    lam: Tree,
    method: HypergradMethod,
    outer_optimizer: OptimizerFactory | None = None,
    steps: int = 100,
    inner_steps: int = 0,
    inner_optimizer: InnerOptimizer | None = None,
    inner_batches: Iterable[Any] | None = None,
    outer_batches: Iterable[Any] | None = None,
    progress: bool = True,
    callback: Callable[[int, Tree, Tree, Any], None] | None = None,
    state: dict[str, Any] | None = None,
) -> SolveResult:
    r"""Minimise :math:`F(\lambda) = f(w^*(\lambda), \lambda)` with any hypergradient method.

    Each outer step runs ``inner_steps`` plain steps of ``inner_optimizer`` on ``w`` (warm
    started from the previous step), asks ``method`` for the hypergradient, and steps ``lam``
    with a :mod:`torch.optim` optimizer. Methods that advance ``w`` themselves (``Unrolled``,
    ``Penalty``, ``BOME``) usually need ``inner_steps=0``; ``Implicit`` and
    ``FiniteDifference`` assume ``w`` solves the inner problem, so give them enough
    ``inner_steps`` (the residual is recorded in ``history["inner_residual"]``).

    Args:
        problem: the bilevel problem.
        w: initial inner parameters.
        lam: initial outer parameters.
        method: any object with the ``hypergrad`` method (``Implicit``, ``Unrolled``, ...).
        outer_optimizer: factory ``params -> torch.optim.Optimizer``; default
            ``torch.optim.Adam(params, lr=1e-2)``.
        steps: number of outer steps.
        inner_steps: plain inner steps before each hypergradient.
        inner_optimizer: optimizer for those steps (default ``hg.inner.SGD(lr=0.1)``).
        inner_batches: an iterable of inner batches (cycled; one per inner step and one per
            hypergradient), a single batch, or None.
        outer_batches: likewise for the outer loss (one per outer step).
        progress: show a tqdm progress bar with F and ‖grad‖ (when tqdm is installed; else no bar).
        callback: called as ``callback(step, w, lam, result)`` after each outer step.
        state: method state to resume from (``SolveResult.state`` of a previous run).

    Returns:
        A :class:`SolveResult`.

    Raises:
        TypeError: ``method`` has no ``hypergrad`` method, or ``outer_optimizer`` does not
            return a :class:`torch.optim.Optimizer`.
        ValueError: ``steps < 1``, ``inner_steps < 0``, malformed ``w``/``lam``, or a
            hypergradient not shaped like ``lam``.
        hypergrad.errors.NonFiniteError: a loss, gradient or hypergradient became NaN or inf.

    Example:
        >>> import torch, hypergrad as hg
        >>> g = lambda w, lam, b: 0.5 * ((w["x"] - lam["c"]) ** 2).sum()
        >>> f = lambda w, lam, b: 0.5 * ((w["x"] - 3.0) ** 2).sum()
        >>> res = hg.solve(hg.BilevelProblem(g, f), {"x": torch.zeros(1)}, {"c": torch.zeros(1)},
        ...                hg.Implicit(hg.linear.CG()), lambda p: torch.optim.SGD(p, lr=0.5),
        ...                steps=30, inner_steps=20, inner_optimizer=hg.inner.SGD(0.5), progress=False)
        >>> round(res.lam["c"].item(), 4)
        3.0
    """
    w, lam = problem.validate(w, lam)
    if not hasattr(method, "hypergrad"):
        raise TypeError(f"method must have a hypergrad(...) method, got {type(method).__name__}")
    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be an int >= 1, got {steps!r}")
    if not isinstance(inner_steps, int) or inner_steps < 0:
        raise ValueError(f"inner_steps must be an int >= 0, got {inner_steps!r}")
    inner_optimizer = inner_optimizer if inner_optimizer is not None else SGD(lr=0.1)
    lam_params = {k: v.detach().clone().requires_grad_(True) for k, v in lam.items()}
    factory = outer_optimizer if outer_optimizer is not None else (lambda p: torch.optim.Adam(p, lr=1e-2))
    optimizer = factory(list(lam_params.values()))
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError("outer_optimizer must be a factory returning a torch.optim.Optimizer")
    inner_iter = _cycle(inner_batches)
    outer_iter = _cycle(outer_batches)
    w = tree_detach(w)
    opt_state: Tree | None = None
    history: dict[str, list[float]] = {"outer_loss": [], "grad_norm": [], "inner_residual": [], "converged": []}
    bar = tqdm(range(steps), desc="hypergrad.solve", disable=not progress, leave=False)
    for step in bar:
        lam_now = {k: v.detach() for k, v in lam_params.items()}
        residual = float("nan")
        if inner_steps:
            w, opt_state, residual = inner_solve(
                problem, w, lam_now, inner_steps, inner_optimizer, _batches_from(inner_iter, inner_steps), opt_state
            )
        inner_batch, outer_batch = next(inner_iter), next(outer_iter)
        result = method.hypergrad(problem, w, lam_now, inner_batch=inner_batch, outer_batch=outer_batch, state=state)
        check_like(result.grad, lam_now, "hypergradient", "lam")
        check_finite(result.grad, f"hypergradient at outer step {step}")
        with torch.no_grad():
            outer_loss = float(problem.outer_loss(w, lam_now, outer_batch))
        optimizer.zero_grad(set_to_none=False)
        for k, p in lam_params.items():
            p.grad = result.grad[k].detach().to(p.dtype).clone()
        optimizer.step()
        w, state = tree_detach(result.w), result.state
        grad_norm = float(tree_norm(result.grad))
        history["outer_loss"].append(outer_loss)
        history["grad_norm"].append(grad_norm)
        history["inner_residual"].append(residual)
        history["converged"].append(float(result.info.converged))
        bar.set_postfix(F=f"{outer_loss:.4g}", grad=f"{grad_norm:.3g}")
        if callback is not None:
            callback(step, w, {k: v.detach() for k, v in lam_params.items()}, result)
    return SolveResult(w, {k: v.detach().clone() for k, v in lam_params.items()}, history, state)


def _batches_from(iterator: Iterator[Any], n: int) -> list[Any]:
    return [next(iterator) for _ in range(n)]
