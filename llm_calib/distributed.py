"""Scale-out under ``torchrun``: FSDP2 shards the frozen base, DTensor reduces the trained gradients.

Each rank evaluates its shard of every global batch. The frozen base is sharded
(:func:`shard_frozen_base`); the small trained parameters (θ, λ) are replicated and every rank takes
the identical step. The losses call no collective; :func:`replicated` (gradients summed over
ranks) and :func:`global_mean` (the loss averaged) make them losses of the global batch. DDP's or
FSDP2's own reduction cannot serve: they hook ``backward()``'s accumulation into ``param.grad``,
while :mod:`hypergrad` calls ``torch.autograd.grad`` (measured with DDP on 2 gloo ranks: each rank
got its own gradient). Second derivatives do not run here: FSDP2 frees the gathered weights a
second backward pass needs (measured: ``RuntimeError: setStorage: ... storage of size 0``).
See :doc:`/tutorials/multi_gpu`.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["global_mean", "init_from_env", "is_distributed", "parameter_bytes", "rank", "replicated",
           "shard_frozen_base", "world_size"]


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


def init_from_env() -> bool:
    """Initialise the default process group under ``torchrun`` (``WORLD_SIZE > 1``); return whether it did.

    nccl on GPU ``LOCAL_RANK`` when CUDA is available, gloo otherwise; False when a group exists.

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


_MESHES: dict[tuple[str, int], Any] = {}


def _mesh(device: torch.device) -> Any:
    """The one-dimensional device mesh of the default process group on ``device``'s type."""
    from torch.distributed.device_mesh import init_device_mesh

    key = (device.type, id(dist.group.WORLD))
    if key not in _MESHES:
        _MESHES[key] = init_device_mesh(device.type, (dist.get_world_size(),))
    return _MESHES[key]


def replicated(params: dict[str, Tensor] | None) -> dict[str, Tensor] | None:
    """Mark replicated parameters for a loss of this rank's shard: their gradients are summed over ranks.

    One flat tensor per dtype and device goes through ``DTensor.from_local(flat, [Replicate()])
    .to_local(grad_placements=[Partial()])`` and is split back into views, so DTensor's autograd
    all-reduces their gradient, also under ``torch.autograd.grad``. Flat because each reduction is
    a collective (measured, 2 gloo ranks, 120 LoRA matrices: 539 ms one per matrix, 52 ms flat).

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
    from torch.distributed.tensor import DTensor, Partial, Replicate

    groups: dict[tuple[torch.dtype, torch.device], list[str]] = {}
    for name, value in params.items():
        groups.setdefault((value.dtype, value.device), []).append(name)
    out: dict[str, Tensor] = {}
    for (_, device), names in groups.items():
        values = [params[n] for n in names]
        flat = torch.cat([v.reshape(-1) for v in values])
        flat = DTensor.from_local(flat, _mesh(device), [Replicate()], run_check=False).to_local(
            grad_placements=[Partial()])
        for name, value, part in zip(names, values, flat.split([v.numel() for v in values]), strict=True):
            out[name] = part.view_as(value)
    return {name: out[name] for name in params}


def global_mean(value: Tensor) -> Tensor:
    """Average a scalar loss over ranks (identity without a process group).

    ``value / world_size`` as a DTensor ``Partial`` sum made whole (one all-reduce); its backward
    hands every rank ``1 / world_size`` of the gradient. (``torch.distributed.nn.functional.all_reduce``
    would also sum the gradients, counting each rank ``world_size`` times with :func:`replicated`.)

    Example:
        >>> import torch
        >>> global_mean(torch.tensor(2.0)).item()
        2.0
    """
    if not is_distributed():
        return value
    from torch.distributed.tensor import DTensor, Partial

    return DTensor.from_local(value / dist.get_world_size(), _mesh(value.device), [Partial()]).full_tensor()


def _shard_units(module: torch.nn.Module, shared: set[int]) -> list[torch.nn.Module]:
    """The modules :func:`shard_frozen_base` shards inside ``module``, children before parents."""
    out: list[torch.nn.Module] = []
    for child in module.children():
        params = list(child.parameters())
        if not params:
            continue
        # quantised weights (bitsandbytes' packed integers in Parameter subclasses) cannot be
        # sharded: FSDP2 would split the packed bytes away from their quantisation state
        plain = all(type(p) is torch.nn.Parameter and p.is_floating_point() for p in params)
        frozen = plain and not any(p.requires_grad or id(p) in shared for p in params)
        if frozen and (isinstance(module, torch.nn.ModuleList) or isinstance(child, torch.nn.Linear | torch.nn.Embedding)):
            out.append(child)
        else:
            out.extend(_shard_units(child, shared))
    return out


def shard_frozen_base(model: torch.nn.Module) -> list[str]:
    """Shard the frozen weights of ``model`` over the ranks with FSDP2 (``fully_shard``); return what it sharded.

    Each unit is its own FSDP2 root: every frozen member of a ``ModuleList`` (a decoder layer), and
    inside the others every frozen ``nn.Linear`` and ``nn.Embedding``. Left replicated: trained
    parameters, norms, weights shared by two modules (tied embeddings) and quantised weights.
    Modules sharded before (a second method on the same base) are kept as they are.

    Args:
        model: the model with its trainable parameters marked, on this rank's device.

    Returns:
        The qualified names of the modules sharded by this call; empty without a process group.

    Example:
        >>> from llm_calib.models import tiny_random_model
        >>> shard_frozen_base(tiny_random_model()[0])   # one process: nothing to shard
        []
    """
    if not is_distributed():
        return []
    from torch.distributed.fsdp import FSDPModule, fully_shard

    seen: set[int] = set()
    shared: set[int] = set()
    for _, param in model.named_parameters(remove_duplicate=False):
        (shared if id(param) in seen else seen).add(id(param))
    names = {id(m): n for n, m in model.named_modules()}
    device = next(model.parameters()).device
    sharded = []
    for unit in _shard_units(model, shared):
        if isinstance(unit, FSDPModule):
            continue
        # Each unit is an FSDP2 root of its own (no unit contains another), and a root keeps its
        # gathered weights after forward unless told otherwise: free them, or nothing is saved.
        fully_shard(unit, mesh=_mesh(device), reshard_after_forward=True)
        sharded.append(names[id(unit)])
    return sharded


def parameter_bytes(model: torch.nn.Module) -> int:
    """Bytes of parameter storage this rank holds for ``model`` (a sharded weight: its local shard).

    Example:
        >>> import torch
        >>> parameter_bytes(torch.nn.Linear(3, 2))   # 6 weights and 2 biases in float32
        32
    """
    total = 0
    for param in model.parameters():
        local = param.to_local() if hasattr(param, "to_local") else param
        total += local.numel() * local.element_size()
    return total
