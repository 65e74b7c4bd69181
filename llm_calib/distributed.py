"""Data parallelism for the functional losses used by CALM (``torchrun``, gloo or nccl).

Every rank evaluates its local shard. :func:`global_mean` makes the loss value the average over
ranks, and :func:`sync_gradients` makes the gradient reaching each parameter the gradient of that
global average. Any first-order method from :mod:`hypergrad` then takes identical steps on every
rank, equal (up to reduction order) to one process on the combined batch.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["global_mean", "init_from_env", "is_distributed", "rank", "sync_gradients", "world_size"]


def is_distributed() -> bool:
    """True when a process group with more than one rank is initialised.

    Returns:
        Whether losses and gradients are averaged across processes.

    Example:
        >>> is_distributed()   # a plain process, not launched by torchrun
        False
    """
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def world_size() -> int:
    """Number of ranks (1 without a process group).

    Returns:
        The world size of the default process group, or 1.

    Example:
        >>> world_size()
        1
    """
    return dist.get_world_size() if is_distributed() else 1


def rank() -> int:
    """This process's rank (0 without a process group).

    Returns:
        The rank in the default process group, or 0; rank 0 writes outputs.

    Example:
        >>> rank()
        0
    """
    return dist.get_rank() if is_distributed() else 0


def init_from_env() -> bool:
    """Initialise the default process group when launched by ``torchrun``; return whether it did.

    Uses nccl when CUDA is available, gloo otherwise (and then selects the GPU ``LOCAL_RANK``).

    Returns:
        True if this call initialised the process group; False when not launched with
        ``WORLD_SIZE > 1`` or when a group already exists.

    Example:
        >>> init_from_env()   # not launched by torchrun: nothing to do
        False
    """
    if "WORLD_SIZE" not in os.environ or int(os.environ["WORLD_SIZE"]) <= 1 or dist.is_initialized():
        return False
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend=backend)
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    return True


class _GlobalMean(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, value: Tensor) -> Tensor:
        out = value.detach().clone()
        dist.all_reduce(out)
        return out / dist.get_world_size()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        # Each rank's shard contributes 1/R of the global mean; the sum over ranks happens in
        # _SyncGradients at the parameters.
        return grad / dist.get_world_size()


class _SyncGradients(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: Tensor) -> Tensor:
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad)
        return grad


def global_mean(value: Tensor) -> Tensor:
    """Average a scalar loss over ranks (identity without a process group).

    The backward pass divides the incoming gradient by the number of ranks; together with
    :func:`sync_gradients` on the parameters this gives every rank the gradient of the global
    mean.

    Args:
        value: a scalar tensor, this rank's loss on its shard.

    Returns:
        The mean of ``value`` over ranks (differentiable), or ``value`` itself.

    Example:
        >>> import torch
        >>> global_mean(torch.tensor(2.0)).item()
        2.0
    """
    return _GlobalMean.apply(value) if is_distributed() else value


def sync_gradients(params: dict[str, Tensor]) -> dict[str, Tensor]:
    """Route each parameter through an identity whose backward sums gradients over ranks.

    Args:
        params: the parameters (a pytree) about to be used in a loss.

    Returns:
        The same values, wrapped so that gradients reaching them are all-reduced; ``params``
        itself without a process group.

    Example:
        >>> import torch
        >>> p = {"w": torch.ones(2)}
        >>> sync_gradients(p)["w"] is p["w"]
        True
    """
    if not is_distributed():
        return params
    return {k: _SyncGradients.apply(v) for k, v in params.items()}
