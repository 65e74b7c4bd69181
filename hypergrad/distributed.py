r"""Data-parallel losses: twice-differentiable reductions over the ranks of a process group.

Under ``torchrun`` every rank holds the same ``w`` and ``lam`` and evaluates the losses on its own
shard of each batch. :func:`replicated` (gradients summed over ranks) and :func:`global_mean`
(a per-rank loss averaged over ranks) turn those per-rank losses into losses of the global batch
whose first *and second* derivatives are the global batch's on every rank, under
``torch.autograd.grad`` as hypergrad takes them. :func:`data_parallel` wraps a
:class:`~hypergrad.problem.BilevelProblem` with both, so every method, ``solve`` included, runs
unchanged on every rank and takes the step one process would take on the combined batch.

DDP's and FSDP2's own gradient reductions cannot serve: they hook the accumulation into
``param.grad`` that ``loss.backward()`` does, while hypergrad calls ``torch.autograd.grad`` (and
differentiates gradients again). See :doc:`/tutorials/hypergrad_distributed`.

Without a process group of several ranks everything here is the identity.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from hypergrad.problem import BilevelProblem
from hypergrad.tree import Tree

__all__ = ["data_parallel", "global_mean", "is_data_parallel", "is_distributed", "rank", "replicated", "world_size"]


def is_distributed() -> bool:
    """True when a process group with more than one rank is initialised.

    Example:
        >>> is_distributed()   # a plain process, not launched by torchrun
        False
    """
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def world_size() -> int:
    """Number of ranks (1 without a process group).

    Example:
        >>> world_size()
        1
    """
    return dist.get_world_size() if is_distributed() else 1


def rank() -> int:
    """This process's rank (0 without a process group); rank 0 writes outputs.

    Example:
        >>> rank()
        0
    """
    return dist.get_rank() if is_distributed() else 0


class _SumOverRanks(torch.autograd.Function):
    """Sum a tensor over ranks; the backward hands the (replicated) cotangent back unchanged.

    Every rank holds the same sum and receives the same cotangent ``u`` for it, so each rank's
    summand gets ``u`` (``torch.distributed.nn.functional.all_reduce`` would sum the ``u`` of the
    copies, ``world_size * u``). Forward mode sums the ranks' tangents (each rank's summand moves
    with its own tangent). Under ``vmap`` the all-reduce runs once on the whole batched tensor
    (it is elementwise), so batched products (``Dense``'s Hessian, ``vmap`` over tangents) take
    one collective, not one per batch entry."""

    @staticmethod
    def forward(value: Tensor) -> Tensor:
        if torch.compiler.is_compiling():
            # losses built on replicated / global_mean by hand (data_parallel problems are refused up
            # front): a compiled stage fails here and falls back to the eager products, with this reason
            raise RuntimeError("hypergrad.distributed's all-reduce cannot be traced by torch.compile; use compile=False")
        total = value.clone()
        dist.all_reduce(total)
        return total

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        pass

    @staticmethod
    def backward(ctx: Any, cotangent: Tensor) -> Tensor:
        return cotangent

    @staticmethod
    def jvp(ctx: Any, tangent: Tensor) -> Tensor:
        return _SumOverRanks.apply(tangent)

    @staticmethod
    def vmap(info: Any, in_dims: tuple[int | None], value: Tensor) -> tuple[Tensor, int | None]:
        return _SumOverRanks.apply(value), in_dims[0]


class _Replicated(torch.autograd.Function):
    """The identity on a replicated tensor whose gradient is the sum of the ranks' gradients."""

    @staticmethod
    def forward(value: Tensor) -> Tensor:
        return value.view_as(value)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        pass

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        return _SumOverRanks.apply(grad)  # differentiable: Hessian-vector products run through it

    @staticmethod
    def jvp(ctx: Any, tangent: Tensor) -> Tensor:
        return tangent  # every rank moves the replicated value by the same tangent

    @staticmethod
    def vmap(info: Any, in_dims: tuple[int | None], value: Tensor) -> tuple[Tensor, int | None]:
        return _Replicated.apply(value), in_dims[0]


class _GlobalMean(torch.autograd.Function):
    """The mean over ranks of a per-rank value; every rank's value gets ``1 / world_size`` of the gradient."""

    @staticmethod
    def forward(value: Tensor) -> Tensor:
        return _SumOverRanks.forward(value) / dist.get_world_size()

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        pass

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        return grad / dist.get_world_size()

    @staticmethod
    def jvp(ctx: Any, tangent: Tensor) -> Tensor:
        return _SumOverRanks.apply(tangent) / dist.get_world_size()

    @staticmethod
    def vmap(info: Any, in_dims: tuple[int | None], value: Tensor) -> tuple[Tensor, int | None]:
        return _GlobalMean.apply(value), in_dims[0]


def replicated(params: dict[str, Tensor] | None) -> dict[str, Tensor] | None:
    """Mark replicated parameters for a loss of this rank's shard: their gradients are summed over ranks.

    One flat tensor per dtype and device goes through an identity whose backward all-reduces the
    gradient, also under ``torch.autograd.grad``, and is split back into views. Flat because each
    reduction is a collective (measured, 2 gloo ranks, the gradients of 120 matrices of 2048 x 8:
    539 ms one collective per matrix, 52 ms flat). The backward is itself differentiable (with
    :func:`global_mean`, a Hessian-vector product of the global loss is the sum of the ranks'
    products, summed once), which torch's engines do not provide: DTensor's ``to_local(grad_placements=[Partial()])`` reduces the
    gradient outside the graph (measured: a second ``torch.autograd.grad`` through it raises "The
    differentiated Tensor ... appears to not have been used in the graph"), and FSDP2 and DDP
    reduce only what ``backward()`` accumulates into ``param.grad``.

    Args:
        params: a flat dict of parameters, identical on every rank; or None.

    Returns:
        The same values whose gradients are summed over ranks; ``params`` without a process group.

    Example:
        >>> import torch
        >>> p = {"w": torch.ones(2)}
        >>> replicated(p) is p, replicated(None)
        (True, None)
    """
    if not params or not is_distributed():
        return params
    groups: dict[tuple[torch.dtype, torch.device], list[str]] = {}
    for name, value in params.items():
        groups.setdefault((value.dtype, value.device), []).append(name)
    out: dict[str, Tensor] = {}
    for names in groups.values():
        values = [params[n] for n in names]
        flat = _Replicated.apply(torch.cat([v.reshape(-1) for v in values]))
        for name, value, part in zip(names, values, flat.split([v.numel() for v in values]), strict=True):
            out[name] = part.view_as(value)
    return {name: out[name] for name in params}


def global_mean(value: Tensor) -> Tensor:
    """Average a scalar loss over ranks (identity without a process group).

    One all-reduce; its backward hands every rank ``1 / world_size`` of the gradient without a
    collective (``torch.distributed.nn.functional.all_reduce`` would also sum the gradients,
    counting each rank ``world_size`` times with :func:`replicated`), and stays differentiable.

    Example:
        >>> import torch
        >>> global_mean(torch.tensor(2.0)).item()
        2.0
    """
    if not is_distributed():
        return value
    return _GlobalMean.apply(value)


def data_parallel(problem: BilevelProblem) -> BilevelProblem:
    r"""The problem whose ``g`` and ``f`` are the means over ranks of ``problem``'s per-rank losses.

    Each rank passes its own shard of every batch; the wrapped losses call ``problem``'s on it,
    with ``w`` and ``lam`` marked :func:`replicated` (one flat all-reduce per dtype and device in
    each backward pass) and the value averaged by :func:`global_mean`. Every rank then sees the
    value, gradients and Hessian-vector products of

    .. math:: g(w, \lambda) = \frac1R \sum_{r<R} g_r(w, \lambda), \qquad
              f(w, \lambda) = \frac1R \sum_{r<R} f_r(w, \lambda)

    over the ``R`` ranks, so any method takes the same step on every rank: the step of one process
    on the combined batch when every ``g_r``, ``f_r`` is a mean over equally many samples (e.g.
    shards from a :class:`torch.utils.data.DistributedSampler`, which pads to equal sizes).

    Requirements: every rank starts from the same ``w`` and ``lam`` and makes the same calls (as
    :func:`~hypergrad.driver.solve` does when every rank draws its shard of the same batches).
    Every method works, with reverse and forward products (``Implicit(products="forward")``,
    ``Unrolled(mode="forward")``), batched ones (``Implicit(hg.linear.Dense())``, ``vmap``: one
    all-reduce per batched product) and :func:`hypergrad.custom_root`; ``compile=True`` is
    refused before the first step (:func:`torch.compile` cannot trace the all-reduce; the eager
    steps are the same on every rank). Without a process group of several ranks the problem is
    returned as it is.

    Args:
        problem: the per-rank problem (its losses call no collective).

    Returns:
        A :class:`~hypergrad.problem.BilevelProblem` of the global means; ``problem`` itself
        without a process group.

    Raises:
        TypeError: ``problem`` is not a :class:`~hypergrad.problem.BilevelProblem`.

    Example:
        >>> import torch, hypergrad as hg
        >>> g = lambda w, lam, batch: 0.5 * ((w["x"] - lam["c"]) ** 2).sum()
        >>> problem = hg.BilevelProblem(inner=g, outer=g)
        >>> hg.distributed.data_parallel(problem) is problem   # one process: nothing to reduce
        True
    """
    if not isinstance(problem, BilevelProblem):
        raise TypeError(f"problem must be a hypergrad.BilevelProblem, got {type(problem).__name__}")
    if not is_distributed():
        return problem
    inner, outer = problem.inner, problem.outer

    def global_inner(w: Tree, lam: Tree, batch: Any) -> Tensor:
        return global_mean(inner(*_replicated_pair(w, lam), batch))

    def global_outer(w: Tree, lam: Tree, batch: Any) -> Tensor:
        return global_mean(outer(*_replicated_pair(w, lam), batch))

    return _DataParallelProblem(inner=global_inner, outer=global_outer, per_rank=problem)


@dataclass(frozen=True)
class _DataParallelProblem(BilevelProblem):
    """The problem :func:`data_parallel` returns: its losses all-reduce over the ranks."""

    per_rank: BilevelProblem


def is_data_parallel(problem: BilevelProblem) -> bool:
    """Whether ``problem`` is a :func:`data_parallel` problem over several ranks (its losses all-reduce).

    Example:
        >>> import hypergrad as hg
        >>> g = lambda w, lam, batch: (w["x"] ** 2).sum()
        >>> is_data_parallel(hg.distributed.data_parallel(hg.BilevelProblem(g, g)))   # one process
        False
    """
    return isinstance(problem, _DataParallelProblem) and is_distributed()


def _replicated_pair(w: Tree, lam: Tree) -> tuple[Tree, Tree]:
    """``w`` and ``lam`` through one :func:`replicated` call (one collective per backward, not two)."""
    both = replicated({**{f"w.{k}": v for k, v in w.items()}, **{f"lam.{k}": v for k, v in lam.items()}})
    assert both is not None
    return {k: both[f"w.{k}"] for k in w}, {k: both[f"lam.{k}"] for k in lam}
