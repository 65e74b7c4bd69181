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

__all__ = [
    "BUCKET_BYTES",
    "buckets",
    "global_mean",
    "init_from_env",
    "is_distributed",
    "rank",
    "sync_gradients",
    "world_size",
]

BUCKET_BYTES = 25 * 2**20
"""Largest all-reduce bucket of :func:`sync_gradients` (25 MiB, as in DDP): LoRA gradients are
flattened into as few collectives as fit, instead of one per parameter."""


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


def buckets(tensors: list[Tensor], bucket_bytes: int = BUCKET_BYTES) -> list[list[int]]:
    """Group tensor indices into all-reduce buckets: same dtype and device, at most
    ``bucket_bytes`` each (a larger tensor gets a bucket of its own), in order.

    Example:
        >>> import torch
        >>> buckets([torch.zeros(4), torch.zeros(4), torch.zeros(4, dtype=torch.float64)], bucket_bytes=32)
        [[0, 1], [2]]
        >>> buckets([torch.zeros(4)] * 3, bucket_bytes=16)
        [[0], [1], [2]]
    """
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    out: list[list[int]] = []
    open_bucket: dict[tuple[torch.dtype, torch.device], tuple[list[int], int]] = {}
    for i, t in enumerate(tensors):
        key, size = (t.dtype, t.device), t.numel() * t.element_size()
        current = open_bucket.get(key)
        if current is not None and current[1] + size <= bucket_bytes:
            current[0].append(i)
            open_bucket[key] = (current[0], current[1] + size)
            continue
        bucket = [i]
        out.append(bucket)
        open_bucket[key] = (bucket, size)
    return out


class _SyncGradients(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, bucket_bytes: int, *tensors: Tensor) -> tuple[Tensor, ...]:
        ctx.bucket_bytes = bucket_bytes
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple[Any, ...]:
        # called once, with every parameter's gradient (zeros where unused): one flat
        # all-reduce per bucket
        grads_list = [g.contiguous() for g in grads]
        out: list[Tensor] = list(grads_list)
        for bucket in buckets(grads_list, ctx.bucket_bytes):
            flat = torch.cat([grads_list[i].reshape(-1) for i in bucket])
            dist.all_reduce(flat)
            for i, part in zip(bucket, flat.split([grads_list[i].numel() for i in bucket]), strict=True):
                out[i] = part.view_as(grads_list[i])
        return (None, *out)


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


def sync_gradients(params: dict[str, Tensor], bucket_bytes: int = BUCKET_BYTES) -> dict[str, Tensor]:
    """Route the parameters through one identity whose backward sums their gradients over ranks.

    The backward runs once all of them have their gradient and all-reduces them flattened into
    :func:`buckets` of at most ``bucket_bytes``: a handful of collectives per loss instead of one per
    LoRA matrix.

    Args:
        params: the parameters (a flat dict) about to be used in a loss.
        bucket_bytes: largest bucket.

    Returns:
        The same values, wrapped so that gradients reaching them are all-reduced; ``params``
        itself without a process group.

    Example:
        >>> import torch
        >>> p = {"w": torch.ones(2)}
        >>> sync_gradients(p)["w"] is p["w"]
        True
    """
    if not is_distributed() or not params:
        return params
    keys = list(params)
    synced = _SyncGradients.apply(bucket_bytes, *(params[k] for k in keys))
    return dict(zip(keys, synced, strict=True))
