"""Cross-check CALM's first-order solvers against exact implicit hypergradients (:doc:`/methods/calm`).

:func:`check_hypergradients` solves the proximal lower level well, takes the exact hypergradient
(:class:`hypergrad.Implicit`) and compares each method's λ direction with it; run it on your own
model, data and configuration.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import Tensor

import hypergrad as hg
from hypergrad.tree import tree_dot, tree_norm
from llm_calib.engine.attention import second_order_attention

__all__ = [
    "DirectionCheck", "HypergradientCheck", "check_hypergradients", "compare_directions",
    "exact_hypergradient", "proximal_problem", "solve_lower_level",
]


def proximal_problem(problem: hg.BilevelProblem, anchor: Mapping[str, Tensor], mu: float) -> hg.BilevelProblem:
    r"""``problem`` with :math:`\tfrac{\mu}{2}\lVert\theta - \bar\theta\rVert^2` (``anchor`` :math:`\bar\theta`)
    added to its lower level.

    Raises:
        ValueError: ``mu`` negative or not finite.

    Example:
        >>> import torch, hypergrad as hg
        >>> g = lambda w, lam, b: (w["x"] * lam["c"]).sum()
        >>> p = proximal_problem(hg.BilevelProblem(g, g), {"x": torch.zeros(2)}, mu=2.0)
        >>> float(p.inner_loss({"x": torch.ones(2)}, {"c": torch.zeros(2)}))
        2.0
    """
    if not 0.0 <= float(mu) < float("inf"):
        raise ValueError(f"mu must be a finite number >= 0, got {mu!r}")
    anchor = {k: v.detach() for k, v in anchor.items()}
    if mu == 0.0:
        return problem

    def inner(theta: dict[str, Tensor], lam: dict[str, Tensor], batch: Any) -> Tensor:
        prox = sum(((theta[k] - anchor[k]) ** 2).sum() for k in anchor)
        return problem.inner(theta, lam, batch) + 0.5 * mu * prox

    return hg.BilevelProblem(inner=inner, outer=problem.outer)


def solve_lower_level(
    problem: hg.BilevelProblem, theta: dict[str, Tensor], lam: dict[str, Tensor], batch: Any, *,
    max_iter: int = 200, tol: float = 1e-8,
) -> tuple[dict[str, Tensor], float]:
    """``(θ*(λ), gradient norm)`` on one fixed batch, by L-BFGS with a strong-Wolfe line search (to ``tol``).

    Example:
        >>> import torch, hypergrad as hg
        >>> g = lambda w, lam, b: ((w["x"] - lam["c"]) ** 4).sum() + ((w["x"] - lam["c"]) ** 2).sum()
        >>> w, gnorm = solve_lower_level(hg.BilevelProblem(g, g), {"x": torch.zeros(2, dtype=torch.float64)},
        ...                              {"c": torch.tensor([1.0, -2.0], dtype=torch.float64)}, None)
        >>> [round(v, 6) for v in w["x"].tolist()], gnorm < 1e-6
        ([1.0, -2.0], True)
    """
    leaves = {k: v.detach().clone().requires_grad_(True) for k, v in theta.items()}
    lam = {k: v.detach() for k, v in lam.items()}
    opt = torch.optim.LBFGS(list(leaves.values()), lr=1.0, max_iter=max_iter, tolerance_grad=tol,
                            tolerance_change=0.0, history_size=50, line_search_fn="strong_wolfe")

    def closure() -> Tensor:
        opt.zero_grad()
        with torch.enable_grad():
            loss = problem.inner_loss(leaves, lam, batch)
            loss.backward()
        return loss

    opt.step(closure)
    solved = {k: v.detach() for k, v in leaves.items()}
    return solved, _lower_gradient_norm(problem, solved, lam, batch)


def _lower_gradient_norm(problem: hg.BilevelProblem, theta: dict[str, Tensor], lam: dict[str, Tensor], batch: Any) -> float:
    _, grad, _ = hg.autodiff.loss_and_grads(
        lambda w, l_: problem.inner_loss(w, l_, batch), theta, lam, wrt_lam=False, what="lower level"
    )
    return float(tree_norm(grad))


@dataclass(frozen=True)
class DirectionCheck:
    r"""How a method's λ direction relates to the exact hypergradient :math:`\nabla F`.

    Attributes:
        method: the method's name.
        cosine: cosine similarity between the method's λ direction and :math:`\nabla F`.
        relative_norm: ``||method|| / ||exact||``.
        descent: directional derivative of :math:`F` along the unit step ``-direction`` (< 0: descends);
            for BOME, whose joint step is not a hypergradient estimate, the meaningful measure.
        extra: the method's own diagnostics (e.g. BOME's ``phi``).
    """

    method: str
    cosine: float
    relative_norm: float
    descent: float
    extra: dict[str, float] = field(default_factory=dict)


def compare_directions(method: str, exact: Mapping[str, Tensor], direction: Mapping[str, Tensor]) -> DirectionCheck:
    """Compare a λ direction with the exact hypergradient (float64 arithmetic).

    Example:
        >>> import torch
        >>> c = compare_directions("m", {"a": torch.tensor([1.0, 0.0])}, {"a": torch.tensor([2.0, 2.0])})
        >>> round(c.cosine, 4), round(c.relative_norm, 4), round(c.descent, 4)
        (0.7071, 2.8284, -0.7071)
    """
    e = {k: v.detach().double() for k, v in exact.items()}
    d = {k: direction[k].detach().double() for k in e}
    ne, nd = float(tree_norm(e)), float(tree_norm(d))
    dot = float(tree_dot(e, d))
    cosine = dot / (ne * nd) if ne > 0 and nd > 0 else 0.0
    return DirectionCheck(method, cosine, nd / ne if ne > 0 else float("inf"), -dot / nd if nd > 0 else 0.0)


def exact_hypergradient(
    problem: hg.BilevelProblem, theta: dict[str, Tensor], lam: dict[str, Tensor], inner_batch: Any,
    outer_batch: Any, solver: Any = None,
) -> hg.HypergradResult:
    """:class:`hypergrad.Implicit` at ``theta`` (a lower-level solution) in the attention kernel with second
    derivatives.

    ``solver`` defaults to ``hypergrad.linear.CG(tol=1e-6, maxiter=200)``; ``info.converged`` reports the solve.
    """
    solver = solver if solver is not None else hg.linear.CG(tol=1e-6, maxiter=200)
    with second_order_attention():
        return hg.Implicit(solver=solver).hypergrad(problem, theta, lam, inner_batch, outer_batch)


@dataclass
class HypergradientCheck:
    r"""The result of :func:`check_hypergradients`: the exact :math:`\nabla F`, how well the lower level
    was solved (``lower_gradient_norm``), the exact method's linear solve (``solver_*``) and one
    :class:`DirectionCheck` per method.
    """

    exact: dict[str, Tensor]
    lower_gradient_norm: float
    solver_iterations: int
    solver_converged: bool
    solver_residual: float | None
    checks: list[DirectionCheck]

    def by_method(self) -> dict[str, DirectionCheck]:
        """The checks keyed by method name."""
        return {c.method: c for c in self.checks}


def check_hypergradients(
    problem: hg.BilevelProblem, theta: dict[str, Tensor], lam: dict[str, Tensor], inner_batch: Any,
    outer_batch: Any, methods: Mapping[str, Any], *, lower_steps: int = 200, lower_optimizer: Any = None,
    solver: Any = None, calls: int = 1, method_start: str | Mapping[str, str] = "solved",
    method_states: Mapping[str, Any] | None = None,
) -> HypergradientCheck:
    """Exact hypergradient at λ versus each first-order method's λ direction.

    θ*(λ) is found from ``theta`` on ``inner_batch`` (L-BFGS, or ``lower_steps`` steps of
    ``lower_optimizer``). Each method is called ``calls`` times at λ, starting from θ*(λ)
    (``method_start="solved"``) or from ``theta`` with its state from ``method_states`` (``"given"``),
    and its last λ gradient is compared with the exact one.

    Args:
        problem: the bilevel problem (usually :func:`proximal_problem` of CALM's).
        theta: where to start solving the lower level.
        lam: the λ to differentiate at.
        inner_batch, outer_batch: fixed batches for g and f.
        methods: name → a :mod:`hypergrad` method.
        lower_steps: L-BFGS iterations (or optimizer steps) for θ*(λ).
        lower_optimizer: a :mod:`hypergrad.inner` optimizer instead of L-BFGS.
        solver: the exact method's linear solver (see :func:`exact_hypergradient`).
        calls: calls per method at the fixed λ.
        method_start: ``"solved"`` or ``"given"``, or a mapping from method name to either.
        method_states: per method name, the state to start from (``"given"`` only).

    Example:
        >>> import torch, hypergrad as hg
        >>> g = lambda w, lam, b: 0.5 * ((w["x"] - lam["c"]) ** 2).sum()
        >>> f = lambda w, lam, b: 0.5 * ((w["x"] - 1.0) ** 2).sum()
        >>> lam = {"c": torch.tensor([3.0, -1.0], dtype=torch.float64)}
        >>> f2sa = hg.Penalty(sigma=1e-3, inner_optimizer=hg.inner.SGD(lr=0.5), inner_steps=20)
        >>> res = check_hypergradients(hg.BilevelProblem(g, f), {"x": torch.zeros(2, dtype=torch.float64)},
        ...                            lam, None, None, {"f2sa": f2sa}, lower_optimizer=hg.inner.SGD(lr=0.5))
        >>> res.exact["c"].tolist(), round(res.by_method()["f2sa"].cosine, 6)
        ([2.0, -2.0], 1.0)
    """
    if lower_steps < 0 or calls < 1:
        raise ValueError(f"lower_steps must be >= 0 and calls >= 1, got {lower_steps} and {calls}")
    starts = {name: method_start if isinstance(method_start, str) else method_start.get(name, "solved") for name in methods}
    bad = {k: v for k, v in starts.items() if v not in ("solved", "given")}
    if bad:
        raise ValueError(f"method_start must be 'solved' or 'given', got {bad}")
    if lower_optimizer is None:
        theta_star, lower_norm = solve_lower_level(problem, theta, lam, inner_batch, max_iter=max(lower_steps, 1))
    else:
        theta_star, _, _ = hg.inner_solve(problem, theta, lam, lower_steps, lower_optimizer, batches=[inner_batch])
        lower_norm = _lower_gradient_norm(problem, theta_star, lam, inner_batch)
    exact = exact_hypergradient(problem, theta_star, lam, inner_batch, outer_batch, solver)
    checks = []
    for name, method in methods.items():
        if starts[name] == "solved":
            w, state, result = theta_star, None, None
        else:
            w, state, result = theta, (method_states or {}).get(name), None
        for _ in range(calls):
            result = method.hypergrad(problem, w, lam, inner_batch, outer_batch, state)
            state = result.state
            if not isinstance(method, hg.BOME):  # BOME's w moves along f as well: keep it at θ*
                w = result.w
        assert result is not None
        extra = {k: float(v) for k, v in result.info.extra.items() if isinstance(v, (int, float))}
        checks.append(replace(compare_directions(name, exact.grad, result.grad), extra=extra))
    return HypergradientCheck({k: v.detach() for k, v in exact.grad.items()}, lower_norm, exact.info.iterations,
                              exact.info.converged, exact.info.residual, checks)
