r"""SRBA: the stochastic recursive bilevel algorithm (Dagréou, Moreau, Vaiter, Ablin, 2023)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import KW_ONLY, dataclass, field
from typing import Any, NamedTuple

import torch

from hypergrad.problem import BilevelProblem, HypergradInfo, HypergradResult
from hypergrad.stochastic import (
    OracleCounts,
    StepSize,
    check_step_size,
    inner_products,
    linear_iterate,
    one_batch,
    outer_grads,
    step_counter,
    step_size_at,
)
from hypergrad.tree import (
    Tree,
    check_finite,
    check_like,
    check_tree,
    tree_add,
    tree_axpy,
    tree_detach,
    tree_norm,
    tree_scale,
    tree_sub,
)

__all__ = ["SRBA", "Directions"]

# What a recursive step reads from the carried state besides v and the step counter.
_RECURSIVE_KEYS = ("w_prev", "v_prev", "lam_prev", "d_w", "d_v", "d_lam")


class Directions(NamedTuple):
    r"""SOBA's three directions at one point: :math:`D_w = \nabla_w g`,
    :math:`D_v = \nabla^2_{ww} g\, v - \nabla_w f`, :math:`D_\lambda = \nabla_\lambda f - \nabla^2_{\lambda w} g\, v`.

    Example:
        >>> import torch
        >>> from hypergrad.srba import Directions
        >>> d = Directions(w={"x": torch.ones(1)}, v={"x": torch.zeros(1)}, lam={"c": torch.ones(2)})
        >>> d.lam["c"].tolist()
        [1.0, 1.0]
    """

    w: Tree
    v: Tree
    lam: Tree


@dataclass(frozen=True)
class SRBA:
    r"""SRBA: SOBA's three directions estimated by a recursive (SARAH) estimator, restarted from full batches.

    M. Dagréou, T. Moreau, S. Vaiter and P. Ablin, "A lower bound and a near-optimal algorithm
    for bilevel empirical risk minimization", arXiv:2302.08766, 2023.

    For a finite sum :math:`g = \frac1{n}\sum_{i<n} g_i`, :math:`f = \frac1{m}\sum_{j<m} f_j`,
    write :math:`\phi_{ij}(z) = (\nabla_w g_i,\ \nabla^2_{ww} g_i\, v - \nabla_w f_j,\
    \nabla_\lambda f_j - \nabla^2_{\lambda w} g_i\, v)` at :math:`z = (w, v, \lambda)` (SOBA's
    directions on batches :math:`i, j`, see :class:`~hypergrad.soba.SOBA`) and :math:`\phi` the
    same on all the data. SRBA carries an estimate :math:`D_t` of :math:`\phi(z_t)` and the
    previous point :math:`z_{t-1}`:

    .. math::
        D_t = \begin{cases}
            \phi(z_t) & t \bmod q = 0 \quad\text{(restart: full batches)}\\
            D_{t-1} + \phi_{ij}(z_t) - \phi_{ij}(z_{t-1}) & \text{otherwise (one batch pair, both points)}
        \end{cases}

    then :math:`w \leftarrow w - \rho\, D_w`, :math:`v \leftarrow v - \rho\, D_v`, and
    ``result.grad`` :math:`= D_\lambda`, on which the outer optimizer takes the step
    :math:`\lambda \leftarrow \lambda - \gamma D_\lambda` (``torch.optim.SGD(lr=gamma)``). The
    correction :math:`\phi_{ij}(z_t) - \phi_{ij}(z_{t-1})` is small when the iterates move
    little, so the estimate's error stays small between restarts and **constant steps converge
    to the exact solution**, like SABA's, with no memory per batch; the paper shows SRBA reaches
    an :math:`\epsilon`-stationary point in :math:`O((n + m)^{1/2} \epsilon^{-1})` oracle calls
    (:math:`n + m` samples), the order of its lower bound for bilevel empirical risk minimization.

    **Full batches.** A restart averages the directions over ``full_inner_batches`` (for
    :math:`g`) and ``full_outer_batches`` (for :math:`f`): re-iterable collections of batches (a
    list, a ``DataLoader``) read once per restart, each batch weighing the same, so the mean of
    their losses must be the full loss (equal-size batches, each loss a mean over its batch; or
    ``[whole_data]``, one batch holding everything). The batches of the call itself are not used
    at a restart (``hypergrad.solve`` still draws them). Between restarts a call uses one inner
    and one outer batch, as SOBA, in any form the losses accept (no index needed).

    Mapping from benchmark_bilevel's ``srba.py`` (``step_size``, ``outer_ratio``,
    ``batch_size``, ``period_frac``): ``SRBA(step_size, period, full_inner_batches=...,
    full_outer_batches=...)`` with ``period = int((n_inner_samples + n_outer_samples) *
    period_frac / batch_size)`` and the outer optimizer
    ``lambda p: torch.optim.SGD(p, lr=step_size / outer_ratio)``, ``inner_steps=0``. The
    benchmark draws no batch at a restart step; ``hypergrad.solve`` draws one and leaves it unused.

    State (``result.state``, pass it back): ``"v"`` and ``"step"`` as SOBA's; ``"w_prev"``,
    ``"v_prev"``, ``"lam_prev"`` (the point of the previous call) and ``"d_w"``, ``"d_v"``,
    ``"d_lam"`` (the estimate :math:`D`): three copies of :math:`w` and two of :math:`\lambda`,
    whatever the number of batches.

    Cost per call: 8 oracle calls between restarts (SOBA's four at the current point and at the
    previous one, on the same batches); at a restart 3 per full inner batch and 1 per full outer
    batch (``info.grad_evals``, per oracle in ``info.extra["oracle_calls"]``;
    ``info.extra["restart"]`` says which). Averaged over a period :math:`q` with :math:`K` inner
    and :math:`K'` outer full batches: :math:`(8 (q - 1) + 3K + K') / q` per call.
    ``info.residual`` is :math:`\lVert D_w\rVert`, ``info.extra["linear_residual"]``
    :math:`\lVert D_v\rVert`. There is no stopping test: ``info.converged`` says nothing about
    this call (judge convergence by the iterates).

    Args:
        step_size: :math:`\rho` of the :math:`w` and :math:`v` steps: a number > 0 or a schedule
            ``t -> rho_t`` (the paper and the benchmark use constant steps).
        period: :math:`q \ge 1`, calls between two restarts (the first call, ``step`` 0, is one).
        full_inner_batches: the batches whose mean inner loss is :math:`g`, read at each restart
            (a list, a ``DataLoader``, any re-iterable; not a one-shot iterator).
        full_outer_batches: the same for :math:`f`.

    Raises:
        TypeError: ``step_size`` neither a number nor a schedule, ``period`` not an int, or full
            batches that are not a re-iterable collection of batches.
        ValueError: ``step_size`` not a finite number > 0, ``period`` < 1, empty full batches, or a
            malformed state.
        hypergrad.NonFiniteError: a loss, gradient, product or update is NaN or inf.

    Example:
        >>> import torch, hypergrad as hg
        >>> a = torch.tensor([1.0, 2.0, 3.0, 6.0])        # four samples, one batch each
        >>> g = lambda w, lam, i: 0.5 * ((w["x"] - lam["c"] * a[i]) ** 2).sum()
        >>> f = lambda w, lam, j: 0.5 * ((w["x"] - 9.0) ** 2).sum()
        >>> srba = hg.SRBA(step_size=0.5, period=4, full_inner_batches=[0, 1, 2, 3], full_outer_batches=[0])
        >>> res = hg.solve(hg.BilevelProblem(g, f), {"x": torch.zeros(1)}, {"c": torch.zeros(1)},
        ...                srba, lambda p: torch.optim.SGD(p, lr=0.02), steps=400,
        ...                inner_batches=[3, 0, 2, 1], outer_batches=[0], progress=False)
        >>> round(res.lam["c"].item(), 4)   # w* = c * mean(a) = 3c, F minimal at c* = 3
        3.0
    """

    step_size: StepSize
    period: int
    _: KW_ONLY  # the options below are keyword-only
    # not hashed: a list of batches is not hashable, and a method is compared, not hashed, by its data
    full_inner_batches: Iterable[Any] = field(hash=False)
    full_outer_batches: Iterable[Any] = field(hash=False)

    def __post_init__(self) -> None:
        check_step_size(self.step_size, "step_size")
        if not isinstance(self.period, int) or isinstance(self.period, bool):
            raise TypeError(f"period must be an int (calls between full-batch restarts), got {type(self.period).__name__}")
        if self.period < 1:
            raise ValueError(f"period must be >= 1 (calls between full-batch restarts), got {self.period}")
        for name in ("full_inner_batches", "full_outer_batches"):
            _check_full_batches(getattr(self, name), name)

    def full_directions(self, problem: BilevelProblem, w: Tree, v: Tree, lam: Tree) -> tuple[Directions, OracleCounts]:
        r"""SOBA's directions averaged over the full batches at :math:`(w, v, \lambda)`, and their oracle calls.

        Raises:
            ValueError: a collection of full batches yielded no batch.

        Example:
            >>> import torch, hypergrad as hg
            >>> g = lambda w, lam, b: 0.5 * ((w["x"] - b * lam["c"]) ** 2).sum()
            >>> f = lambda w, lam, b: 0.5 * ((w["x"] - b) ** 2).sum()
            >>> srba = hg.SRBA(step_size=0.1, period=2, full_inner_batches=[1.0, 3.0], full_outer_batches=[4.0])
            >>> x, c = {"x": torch.tensor([1.0])}, {"c": torch.tensor([1.0])}
            >>> d, calls = srba.full_directions(hg.BilevelProblem(g, f), x, {"x": torch.tensor([0.0])}, c)
            >>> d.w["x"].tolist(), d.v["x"].tolist(), calls.total   # mean of (1 - b c), -(1 - 4)
            ([-1.0], [3.0], 7)
        """
        grad = hvp = cross = None
        count = 0
        for batch in self.full_inner_batches:
            out = inner_products(problem, w, lam, batch, v, hvp=True, cross=True)
            assert out.hvp is not None and out.cross is not None
            grad = out.grad if grad is None else tree_add(grad, out.grad)
            hvp = out.hvp if hvp is None else tree_add(hvp, out.hvp)
            cross = out.cross if cross is None else tree_add(cross, out.cross)
            count += 1
        if grad is None or hvp is None or cross is None:
            raise ValueError("SRBA: full_inner_batches yielded no batch (a restart needs at least one)")
        grad_w_f = grad_lam_f = None
        count_outer = 0
        for batch in self.full_outer_batches:
            gw, gl = outer_grads(problem, w, lam, batch)
            grad_w_f = gw if grad_w_f is None else tree_add(grad_w_f, gw)
            grad_lam_f = gl if grad_lam_f is None else tree_add(grad_lam_f, gl)
            count_outer += 1
        if grad_w_f is None or grad_lam_f is None:
            raise ValueError("SRBA: full_outer_batches yielded no batch (a restart needs at least one)")
        grad, hvp, cross = (tree_scale(t, 1.0 / count) for t in (grad, hvp, cross))
        grad_w_f, grad_lam_f = (tree_scale(t, 1.0 / count_outer) for t in (grad_w_f, grad_lam_f))
        directions = Directions(grad, tree_sub(hvp, grad_w_f), tree_sub(grad_lam_f, cross))
        return directions, OracleCounts(inner_grad=count, hvp=count, cross=count, outer_grad=count_outer)

    def hypergrad(
        self,
        problem: BilevelProblem,
        w: Tree,
        lam: Tree,
        inner_batch: Any = None,
        outer_batch: Any = None,
        state: dict[str, Any] | None = None,
    ) -> HypergradResult:
        """One SRBA step: ``grad`` is the estimate :math:`D_\\lambda`; ``w``, ``v`` and the estimate advance.

        A :class:`~hypergrad.batches.StepBatches` as a batch gives one batch (read only between
        restarts).
        """
        w, lam = problem.validate(w, lam)
        w, lam = tree_detach(w), tree_detach(lam)
        t = step_counter(state, "SRBA")
        v = linear_iterate(state, w, "SRBA")
        rho = step_size_at(self.step_size, t, "step_size")
        restart = t % self.period == 0
        if restart:
            d, calls = self.full_directions(problem, w, v, lam)
        else:
            assert state is not None  # step_counter gives 0 without a state
            prev = _read_recursive(state, w, lam)
            inner_batch, outer_batch = one_batch(inner_batch), one_batch(outer_batch)
            now = _batch_directions(problem, w, v, lam, inner_batch, outer_batch)
            before = _batch_directions(problem, prev["w_prev"], prev["v_prev"], prev["lam_prev"], inner_batch, outer_batch)
            d = Directions(*(tree_add(old, tree_sub(new, past)) for old, new, past in
                             zip((prev["d_w"], prev["d_v"], prev["d_lam"]), now, before, strict=True)))
            calls = OracleCounts(inner_grad=2, hvp=2, cross=2, outer_grad=2)
        d = Directions(*(tree_detach(x) for x in d))
        new_w = tree_detach(tree_axpy(-rho, d.w, w))
        new_v = tree_detach(tree_axpy(-rho, d.v, v))
        check_finite(d.lam, "SRBA direction D_lam")
        check_finite(new_w, "SRBA inner iterate w")
        check_finite(new_v, "SRBA linear-system iterate v")
        info = HypergradInfo(
            iterations=1,
            residual=float(tree_norm(d.w)),
            grad_evals=calls.total,
            extra={
                "oracle_calls": calls.as_dict(),
                "step": t,
                "step_size": rho,
                "restart": restart,
                "linear_residual": float(tree_norm(d.v)),
            },
        )
        # copies: hypergrad.solve hands over views of the outer parameters, which its optimizer
        # then updates in place; the recursive step needs the point as it was at this call
        new_state = {"v": new_v, "step": t + 1, "w_prev": _copy(w), "v_prev": v, "lam_prev": _copy(lam),
                     "d_w": d.w, "d_v": d.v, "d_lam": d.lam}
        return HypergradResult(d.lam, new_w, info, new_state)


def _copy(tree: Tree) -> Tree:
    return {k: x.detach().clone() for k, x in tree.items()}


def _batch_directions(problem: BilevelProblem, w: Tree, v: Tree, lam: Tree, inner_batch: Any, outer_batch: Any) -> Directions:
    inner = inner_products(problem, w, lam, inner_batch, v, hvp=True, cross=True)
    grad_w_f, grad_lam_f = outer_grads(problem, w, lam, outer_batch)
    assert inner.hvp is not None and inner.cross is not None
    return Directions(inner.grad, tree_sub(inner.hvp, grad_w_f), tree_sub(grad_lam_f, inner.cross))


def _read_recursive(state: dict[str, Any], w: Tree, lam: Tree) -> dict[str, Tree]:
    """The previous point and estimate a recursive step continues from, checked against ``w`` and ``lam``."""
    missing = [key for key in _RECURSIVE_KEYS if state.get(key) is None]
    if missing:
        raise ValueError(
            f"SRBA: state at step {state.get('step')} (not a restart) lacks {missing}: pass the state of the "
            "previous SRBA call (or start from step 0)"
        )
    out: dict[str, Tree] = {}
    for key in _RECURSIVE_KEYS:
        like, like_name = (lam, "lam") if key in ("lam_prev", "d_lam") else (w, "w")
        tree = check_tree(state[key], f"SRBA state[{key!r}]")
        check_like(tree, like, f"SRBA state[{key!r}]", like_name)
        out[key] = tree_detach(tree)
    return out


def _check_full_batches(batches: object, name: str) -> None:
    if batches is None or isinstance(batches, (torch.Tensor, dict, tuple, str, bytes)):
        raise TypeError(
            f"{name} must be a list of batches or a DataLoader (for one batch holding all the data, pass "
            f"[batch]), got {type(batches).__name__}"
        )
    try:
        iterator = iter(batches)  # type: ignore[call-overload]
    except TypeError:
        raise TypeError(f"{name} must be a list of batches or a DataLoader, got {type(batches).__name__}") from None
    if iterator is batches:
        raise TypeError(
            f"{name} must be re-iterable (a list, a DataLoader): every restart reads it again, got a one-shot "
            f"{type(batches).__name__}"
        )
    if isinstance(batches, list) and not batches:
        raise ValueError(f"{name} must hold at least one batch, got an empty list")

