r"""SABA: SOBA with SAGA-style variance reduction (Dagréou, Ablin, Vaiter, Moreau, 2022)."""

from __future__ import annotations

from collections.abc import Callable
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
from hypergrad.tree import (
    Tree,
    check_finite,
    tree_axpy,
    tree_detach,
    tree_norm,
    tree_sub,
    tree_zeros_like,
)

__all__ = ["SABA", "batch_position"]

# The five fields SABA averages: three of the inner batch, two of the outer batch.
_INNER_FIELDS = ("grad", "hvp", "cross")
_OUTER_FIELDS = ("grad_w", "grad_lam")


_INDEX_HINT = (": SABA needs batches of the form (index, data), e.g. a loader over list(enumerate(batches)), "
               "or batch_index=<a function batch -> index>")


def batch_position(batch: Any) -> Any:
    """SABA's default ``batch_index``: the first element of a batch ``(index, data)``.

    Example:
        >>> from hypergrad.saba import batch_position
        >>> batch_position((3, "data"))
        3
    """
    try:
        return batch[0]
    except (TypeError, IndexError, KeyError) as err:
        raise TypeError(
            f"SABA needs batches of the form (index, data) (or batch_index=<a function batch -> index>), got "
            f"{type(batch).__name__}"
        ) from err


@dataclass(frozen=True)
class SABA:
    r"""SABA: SOBA's three directions, each replaced by a SAGA estimate over a finite sum.

    M. Dagréou, P. Ablin, S. Vaiter and T. Moreau, "A framework for bilevel optimization that
    enables stochastic and global variance reduction algorithms", NeurIPS 2022.

    For a finite sum :math:`g = \frac1{n}\sum_{i<n} g_i`, :math:`f = \frac1{m}\sum_{j<m} f_j`
    (``n = n_inner`` batches, ``m = n_outer`` batches), SABA keeps, per batch, the last value of
    each of the five oracle outputs :math:`\phi \in \{\nabla_w g_i, \nabla^2_{ww} g_i\, v,
    \nabla^2_{\lambda w} g_i\, v, \nabla_w f_j, \nabla_\lambda f_j\}` it computed for that batch
    (memory :math:`M_i`, zeros at the start) and their mean :math:`\bar M`. A call on batches
    :math:`(i, j)` computes the fresh values :math:`\phi_i` at the current :math:`(w, v, \lambda)`
    and uses the SAGA estimate

    .. math::
        \hat\phi = \phi_i - M_i + \bar M,
        \qquad \text{then} \quad \bar M \leftarrow \bar M + (\phi_i - M_i)/n,\ M_i \leftarrow \phi_i,

    in SOBA's updates (see :class:`~hypergrad.soba.SOBA`):
    :math:`w \leftarrow w - \rho\, \widehat{\nabla_w g}`,
    :math:`v \leftarrow v - \rho\,(\widehat{\nabla^2_{ww} g\, v} - \widehat{\nabla_w f})`,
    ``result.grad`` :math:`= \widehat{\nabla_\lambda f} - \widehat{\nabla^2_{\lambda w} g\, v}`,
    on which the outer optimizer takes the outer step (``torch.optim.SGD(lr=gamma)``). When every
    :math:`M_i` holds the values at the current iterates, :math:`\hat\phi` is the full-batch
    value: SABA's direction is then the full-batch SOBA direction. The variance of
    :math:`\hat\phi` vanishes as the iterates converge, so constant steps converge to the exact
    solution (SOBA needs decreasing steps).

    **Batch convention.** SABA must know which of the fixed batches it is given: by default a
    batch is a pair ``(index, data)`` with ``index`` an int (or integer tensor of one element)
    in ``range(n_inner)`` (inner) or ``range(n_outer)`` (outer); the whole pair is passed to the
    losses, which may ignore the index. Another layout: pass ``batch_index``, a function
    ``batch -> index`` used for both. The batches must be a fixed partition of the data into
    ``n_inner`` (``n_outer``) parts of equal weight, each loss a mean over its part, so that
    the mean of the batch losses is the full loss (benchmark_bilevel's fixed contiguous
    batches, weight ``batch_size / n_samples``). ``hypergrad.solve`` hands SABA one inner and one
    outer batch per step: give it loaders that yield ``(index, data)`` in shuffled order.

    Mapping from benchmark_bilevel's ``saba.py`` (``step_size``, ``outer_ratio``, constant steps,
    ``mode_init_memory="zero"``): ``SABA(step_size, n_inner, n_outer)`` with the outer optimizer
    ``lambda p: torch.optim.SGD(p, lr=step_size / outer_ratio)``, ``inner_steps=0``.

    State (``result.state``, pass it back): ``"v"``, ``"step"``, and ``"memory"``: the per-batch
    tables ``memory["inner"][i]`` / ``memory["outer"][j]`` (dicts of the fields above, present
    once the batch was seen) and the means ``memory["inner_mean"]`` / ``memory["outer_mean"]``.
    The memory holds :math:`3n` trees shaped like :math:`w` or :math:`\lambda` plus :math:`2m`
    more. A call returns new tables (the state passed in is not modified).

    Cost per call: 4 oracle calls, as SOBA (``info.grad_evals``, per oracle in
    ``info.extra["oracle_calls"]``). ``info.extra["seen_inner"]`` / ``["seen_outer"]`` count the
    batches in memory; the estimates are biased towards zero until all have been seen (as
    benchmark_bilevel's zero initialisation). ``info.converged`` is None (no tolerance).

    Args:
        step_size: :math:`\rho` of the :math:`w` and :math:`v` steps: a number > 0 or a schedule
            ``t -> rho_t`` (the paper uses constant steps).
        n_inner: the number of inner batches :math:`n \ge 1`.
        n_outer: the number of outer batches :math:`m \ge 1`.
        batch_index: optional function ``batch -> index``; default: ``batch[0]``.
        compile: run each call as one graph traced by :func:`torch.compile` and compiled by
            inductor (:func:`hypergrad.stochastic.compiled_stochastic`): the same arithmetic, state
            and counts; step sizes and batch tensors are graph inputs (no recompile per step or
            batch); eager with a log line where compilation fails; ``info.extra["compiled"]``
            and ``["compile_s"]`` say what happened.

    Raises:
        TypeError: a bad argument type (``compile`` not a bool), or a batch without an index.
        ValueError: ``step_size`` not a finite number > 0, ``n_inner`` or ``n_outer`` < 1, a
            batch index outside ``range(n_inner)`` / ``range(n_outer)``, or a malformed state.
        hypergrad.NonFiniteError: a loss, gradient, product or update is NaN or inf.

    Example:
        >>> import torch, hypergrad as hg
        >>> a = torch.tensor([1.0, 2.0, 3.0, 6.0])        # four samples, one batch each
        >>> g = lambda w, lam, b: 0.5 * ((w["x"] - lam["c"] * a[b[0]]) ** 2).sum()
        >>> f = lambda w, lam, b: 0.5 * ((w["x"] - 9.0) ** 2).sum()
        >>> batches = [(i, None) for i in torch.randperm(4, generator=torch.Generator().manual_seed(0)).tolist()] * 100
        >>> res = hg.solve(hg.BilevelProblem(g, f), {"x": torch.zeros(1)}, {"c": torch.zeros(1)},
        ...                hg.SABA(step_size=0.5, n_inner=4, n_outer=1), lambda p: torch.optim.SGD(p, lr=0.02),
        ...                steps=400, inner_batches=batches, outer_batches=[(0, None)], progress=False)
        >>> round(res.lam["c"].item(), 4)   # w* = c * mean(a) = 3c, F minimal at c* = 3
        3.0
    """

    step_size: StepSize
    n_inner: int
    _: KW_ONLY  # the options below are keyword-only
    n_outer: int = 1
    batch_index: Callable[[Any], Any] | None = None
    compile: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.compile, bool):
            raise TypeError(f"compile must be a bool, got {type(self.compile).__name__}")
        check_step_size(self.step_size, "step_size")
        for name in ("n_inner", "n_outer"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"{name} must be an int (the number of batches), got {type(value).__name__}")
            if value < 1:
                raise ValueError(f"{name} must be >= 1 (the number of batches), got {value}")
        if self.batch_index is not None and not callable(self.batch_index):
            raise TypeError(f"batch_index must be None or a function batch -> index, got {self.batch_index!r}")

    def index_of(self, batch: Any, which: str) -> int:
        """The memory slot of ``batch``: ``batch_index(batch)`` (or :func:`batch_position`), checked.

        Args:
            batch: one inner or outer batch.
            which: ``"inner"`` (slots ``range(n_inner)``) or ``"outer"`` (``range(n_outer)``).

        Raises:
            TypeError: the index is not an int or a one-element integer tensor.
            ValueError: the index is out of range.

        Example:
            >>> from hypergrad.saba import SABA
            >>> SABA(0.1, n_inner=4).index_of((3, "data"), "inner")
            3
        """
        if which not in ("inner", "outer"):
            raise ValueError(f"which must be 'inner' or 'outer', got {which!r}")
        return self._index(batch, self.n_inner if which == "inner" else self.n_outer, which)

    @staticmethod
    def read_memory(state: dict[str, Any] | None, w: Tree, lam: Tree) -> dict[str, Any]:
        """The SAGA memory carried in ``state["memory"]`` (empty tables and zero means without one).

        Raises:
            ValueError: ``state["memory"]`` is not the dict a previous SABA call returned.

        Example:
            >>> import torch
            >>> from hypergrad.saba import SABA
            >>> memory = SABA.read_memory(None, {"x": torch.ones(2)}, {"c": torch.ones(1)})
            >>> memory["inner"], memory["inner_mean"]["grad"]["x"].tolist()
            ({}, [0.0, 0.0])
        """
        return _read_memory(state, w, lam)

    def _index(self, batch: Any, n: int, which: str) -> int:
        raw = (self.batch_index or batch_position)(batch)
        if isinstance(raw, torch.Tensor):
            if raw.numel() != 1 or raw.is_floating_point() or raw.is_complex():
                raise TypeError(f"SABA: the {which} batch index must be an int or a one-element integer tensor, got "
                                f"a {raw.dtype} tensor of shape {tuple(raw.shape)}{_INDEX_HINT}")
            raw = int(raw.item())
        if not isinstance(raw, int) or isinstance(raw, bool):
            raise TypeError(f"SABA: the {which} batch index must be an int, got {type(raw).__name__}{_INDEX_HINT}")
        if not 0 <= raw < n:
            name = "n_inner" if which == "inner" else "n_outer"
            raise ValueError(f"SABA: the {which} batch index must be in range({name}) = range({n}), got {raw}")
        return raw

    def hypergrad(
        self,
        problem: BilevelProblem,
        w: Tree,
        lam: Tree,
        inner_batch: Any = None,
        outer_batch: Any = None,
        state: dict[str, Any] | None = None,
    ) -> HypergradResult:
        """One SABA step: ``grad`` is the variance-reduced :math:`D_\\lambda`; ``w``, ``v`` and the memory advance.

        A :class:`~hypergrad.batches.StepBatches` as a batch gives one batch.
        """
        if self.compile:
            return compiled_stochastic(self, problem, w, lam, inner_batch, outer_batch, state, call=_saba_call)
        w, lam = problem.validate(w, lam)
        w, lam = tree_detach(w), tree_detach(lam)
        t = step_counter(state, "SABA")
        v = linear_iterate(state, w, "SABA")
        memory = _read_memory(state, w, lam)
        rho = step_size_at(self.step_size, t, "step_size")
        inner_batch, outer_batch = one_batch(inner_batch), one_batch(outer_batch)
        i = self._index(inner_batch, self.n_inner, "inner")
        j = self._index(outer_batch, self.n_outer, "outer")

        inner = inner_products(problem, w, lam, inner_batch, v, hvp=True, cross=True)
        grad_w_f, grad_lam_f = outer_grads(problem, w, lam, outer_batch)
        assert inner.hvp is not None and inner.cross is not None
        fresh_inner = {"grad": inner.grad, "hvp": inner.hvp, "cross": inner.cross}
        fresh_outer = {"grad_w": grad_w_f, "grad_lam": grad_lam_f}
        est_inner, inner_table, inner_mean = _saga(fresh_inner, memory["inner"], memory["inner_mean"], i, self.n_inner)
        est_outer, outer_table, outer_mean = _saga(fresh_outer, memory["outer"], memory["outer_mean"], j, self.n_outer)

        d_v = tree_sub(est_inner["hvp"], est_outer["grad_w"])
        d_lam = tree_sub(est_outer["grad_lam"], est_inner["cross"])
        new_w = tree_detach(tree_axpy(-rho, est_inner["grad"], w))
        new_v = tree_detach(tree_axpy(-rho, d_v, v))
        check_finite(d_lam, "SABA direction D_lam")
        check_finite(new_w, "SABA inner iterate w")
        check_finite(new_v, "SABA linear-system iterate v")
        calls = OracleCounts(inner_grad=1, hvp=1, cross=1, outer_grad=1)
        info = HypergradInfo(
            iterations=1,
            residual=float(tree_norm(est_inner["grad"])),
            converged=None,
            grad_evals=calls.total,
            extra={
                "oracle_calls": calls.as_dict(),
                "step": t,
                "step_size": rho,
                "linear_residual": float(tree_norm(d_v)),
                "seen_inner": len(inner_table),
                "seen_outer": len(outer_table),
            },
        )
        new_memory = {"inner": inner_table, "outer": outer_table, "inner_mean": inner_mean, "outer_mean": outer_mean}
        return HypergradResult(tree_detach(d_lam), new_w, info, {"v": new_v, "step": t + 1, "memory": new_memory})


def _saga(
    fresh: dict[str, Tree], table: dict[int, dict[str, Tree]], mean: dict[str, Tree], index: int, n: int
) -> tuple[dict[str, Tree], dict[int, dict[str, Tree]], dict[str, Tree]]:
    """SAGA estimates of every field, with the updated table and mean (new objects)."""
    stored = table.get(index)
    estimate: dict[str, Tree] = {}
    new_mean: dict[str, Tree] = {}
    for name, value in fresh.items():
        change = value if stored is None else tree_sub(value, stored[name])
        estimate[name] = tree_axpy(1.0, change, mean[name])
        new_mean[name] = tree_detach(tree_axpy(1.0 / n, change, mean[name]))
    new_table = dict(table)
    new_table[index] = {name: tree_detach(value) for name, value in fresh.items()}
    return estimate, new_table, new_mean


def _read_memory(state: dict[str, Any] | None, w: Tree, lam: Tree) -> dict[str, Any]:
    memory = None if state is None else state.get("memory")
    if memory is None:
        like_inner = {"grad": w, "hvp": w, "cross": lam}
        like_outer = {"grad_w": w, "grad_lam": lam}
        return {
            "inner": {},
            "outer": {},
            "inner_mean": {k: tree_zeros_like(x) for k, x in like_inner.items()},
            "outer_mean": {k: tree_zeros_like(x) for k, x in like_outer.items()},
        }
    expected = {"inner", "outer", "inner_mean", "outer_mean"}
    if not isinstance(memory, dict) or set(memory) != expected:
        raise ValueError(f"SABA: state['memory'] must be the dict a previous SABA call returned (keys {sorted(expected)})")
    if set(memory["inner_mean"]) != set(_INNER_FIELDS) or set(memory["outer_mean"]) != set(_OUTER_FIELDS):
        raise ValueError("SABA: state['memory'] means are malformed (not from a SABA call)")
    return memory


# ------------------------------------------------------------ the compiled stage (compile=True)


def _saga_estimate(fresh: dict[str, Tree], stored: dict[str, Tree], mean: dict[str, Tree],
                   inv_n: float) -> tuple[dict[str, Tree], dict[str, Tree]]:
    """SAGA estimates and updated means; ``stored`` is zeros for a slot never visited (exact)."""
    estimate, new_mean = {}, {}
    for name, value in fresh.items():
        change = tree_sub(value, stored[name])
        estimate[name] = tree_axpy(1.0, change, mean[name])
        new_mean[name] = tree_axpy(inv_n, change, mean[name])
    return estimate, new_mean


@traced_stage("the SABA step", automatic_dynamic=True)
def _saba_stage(problem: BilevelProblem, w: Tree, lam: Tree, v: Tree, rho: Tensor, inner_batch: Any,
                outer_batch: Any, stored_inner: dict[str, Tree], inner_mean: dict[str, Tree],
                stored_outer: dict[str, Tree], outer_mean: dict[str, Tree], inv_n_inner: float,
                inv_n_outer: float) -> tuple[Any, ...]:
    """One call of :meth:`hypergrad.saba.SABA.hypergrad` as a traceable function (same arithmetic)."""
    grad, hv, cross, g_value = traced_inner_products(problem, w, lam, inner_batch, v)
    grad_w_f, grad_lam_f, f_value = traced_outer_grads(problem, w, lam, outer_batch)
    fresh_inner = {"grad": grad, "hvp": hv, "cross": cross}
    fresh_outer = {"grad_w": grad_w_f, "grad_lam": grad_lam_f}
    est_inner, new_inner_mean = _saga_estimate(fresh_inner, stored_inner, inner_mean, inv_n_inner)
    est_outer, new_outer_mean = _saga_estimate(fresh_outer, stored_outer, outer_mean, inv_n_outer)
    d_v = tree_sub(est_inner["hvp"], est_outer["grad_w"])
    d_lam = tree_sub(est_outer["grad_lam"], est_inner["cross"])
    new_w, new_v = tree_axpy(-rho, est_inner["grad"], w), tree_axpy(-rho, d_v, v)
    finite = all_finite([g_value, f_value], [grad, hv, cross, grad_w_f, grad_lam_f, d_lam, new_w, new_v])
    scalars = torch.stack([tree_norm(est_inner["grad"]), tree_norm(d_v), finite.to(rho.dtype)])
    return d_lam, new_w, new_v, fresh_inner, fresh_outer, new_inner_mean, new_outer_mean, scalars


def _zeros_like_fields(like: dict[str, Tree]) -> dict[str, Tree]:
    return {name: {k: torch.zeros_like(x) for k, x in tree.items()} for name, tree in like.items()}


def _saba_call(method: Any, problem: BilevelProblem, w: Tree, lam: Tree, inner_batch: Any, outer_batch: Any,
               state: dict[str, Any] | None, t: int) -> HypergradResult | None:
    v = linear_iterate(state, w, "SABA")
    memory = method.read_memory(state, w, lam)
    rho = step_size_at(method.step_size, t, "step_size")
    inner_batch, outer_batch = one_batch(inner_batch), one_batch(outer_batch)
    i, j = method.index_of(inner_batch, "inner"), method.index_of(outer_batch, "outer")
    stored_inner = memory["inner"].get(i) or _zeros_like_fields(memory["inner_mean"])
    stored_outer = memory["outer"].get(j) or _zeros_like_fields(memory["outer_mean"])
    ran = run_stage(problem, _saba_stage, w, lam, v, tensor_like(rho, w), inner_batch, outer_batch,
                    stored_inner, memory["inner_mean"], stored_outer, memory["outer_mean"],
                    1.0 / method.n_inner, 1.0 / method.n_outer, checks=(w, lam, inner_batch))
    if ran is None:
        return None
    (d_lam, new_w, new_v, fresh_inner, fresh_outer, inner_mean, outer_mean, scalars), compile_s = ran
    residual, linear_residual, finite = scalars.tolist()
    if not finite:
        return NON_FINITE
    inner_table, outer_table = dict(memory["inner"]), dict(memory["outer"])
    inner_table[i], outer_table[j] = fresh_inner, fresh_outer
    calls = OracleCounts(inner_grad=1, hvp=1, cross=1, outer_grad=1)
    extra = {"step": t, "step_size": rho, "linear_residual": linear_residual,
             "seen_inner": len(inner_table), "seen_outer": len(outer_table)}
    info = compiled_info(calls, 1, residual, extra, compile_s)
    new_memory = {"inner": inner_table, "outer": outer_table, "inner_mean": inner_mean, "outer_mean": outer_mean}
    return HypergradResult(d_lam, new_w, info, {"v": new_v, "step": t + 1, "memory": new_memory})
