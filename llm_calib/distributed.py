"""Scale-out under ``torchrun``: FSDP2 shards the frozen base, the trained gradients are summed over ranks.

Each rank evaluates its shard of every global batch. The frozen base is sharded: loaded shard by
shard (:func:`load_sharded`, what :func:`llm_calib.models.load` does under ``torchrun``), or
loaded whole and sharded (:func:`shard_frozen_base`). The small trained parameters (θ, λ) are
replicated and every rank takes the identical step. The losses call no collective;
:func:`hypergrad.distributed.replicated` (gradients summed over ranks) and
:func:`hypergrad.distributed.global_mean` (the loss averaged) make them losses of the global batch,
twice differentiable, so the implicit solver's Hessian-vector products are those of the global
batch too (its differentiated units stay gathered, :func:`keep_gathered`). DDP's or FSDP2's own
reduction cannot serve: they hook ``backward()``'s accumulation into ``param.grad``, while
:mod:`hypergrad` calls ``torch.autograd.grad`` (measured with DDP on 2 gloo ranks: each rank got
its own gradient). :func:`is_distributed`, :func:`world_size` and :func:`rank` are
:mod:`hypergrad.distributed`'s, re-exported here. See :doc:`/tutorials/multi_gpu`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from hypergrad.distributed import is_distributed, rank, world_size

__all__ = ["ShardedLoadError", "first_problem", "init_from_env", "is_distributed", "keep_gathered", "load_sharded",
           "max_over_ranks", "process_group_backend", "rank", "reshard_all", "shard_frozen_base", "world_size"]

logger = logging.getLogger(__name__)


def init_from_env(device: torch.device | str | None = None) -> bool:
    """Initialise the default process group under ``torchrun`` (``WORLD_SIZE > 1``); return whether it did.

    The backend follows the run's ``device``: nccl for a CUDA device (and ``cuda:LOCAL_RANK`` made the
    current device), gloo for any other, so a CPU run under ``torchrun`` on a machine with GPUs keeps its
    collectives on the CPU (nccl reduces GPU tensors only, and a node may have fewer GPUs than ranks).
    ``device=None``: nccl when CUDA is available, gloo otherwise. False when a group exists.

    Args:
        device: the device the run computes on (the model's, or the command line's ``--device``).

    Example:
        >>> init_from_env("cpu")   # not launched by torchrun: nothing to do
        False
    """
    if "WORLD_SIZE" not in os.environ or int(os.environ["WORLD_SIZE"]) <= 1 or dist.is_initialized():
        return False
    backend = process_group_backend(device)
    dist.init_process_group(backend=backend)
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    return True


def process_group_backend(device: torch.device | str | None) -> str:
    """The process group backend for a run on ``device``: ``"nccl"`` for CUDA, ``"gloo"`` otherwise
    (``None``: CUDA when it is available).

    Example:
        >>> process_group_backend("cpu"), process_group_backend("cuda:1")
        ('gloo', 'nccl')
    """
    on_cuda = torch.cuda.is_available() if device is None else torch.device(device).type == "cuda"
    return "nccl" if on_cuda else "gloo"


_MESHES: dict[tuple[str, int], Any] = {}


def _mesh(device: torch.device) -> Any:
    """The one-dimensional device mesh of the default process group on ``device``'s type."""
    from torch.distributed.device_mesh import init_device_mesh

    key = (device.type, id(dist.group.WORLD))
    if key not in _MESHES:
        _MESHES[key] = init_device_mesh(device.type, (dist.get_world_size(),))
    return _MESHES[key]


def keep_gathered(modules: list[torch.nn.Module]) -> list[str]:
    """Gather the FSDP2 units inside ``modules`` and keep them whole until :func:`reshard_all`.

    Second derivatives (the implicit solver's Hessian-vector products) run backward passes
    through the graph of a gradient, which reads the gathered weights after FSDP2 would have
    freed them (measured: ``RuntimeError: setStorage: ... storage of size 0``). Kept gathered, the
    units of the trained layers and those above them cost the memory of replicated layers while
    the bottom layers stay sharded.

    Args:
        modules: modules of a model sharded by :func:`shard_frozen_base` or :func:`load_sharded`.

    Returns:
        The names of the units gathered, as ``type@id`` (empty without a process group).

    Example:
        >>> import torch
        >>> keep_gathered([torch.nn.Linear(2, 2)])   # no FSDP2 unit inside
        []
    """
    kept = []
    for module in modules:
        for unit in _fsdp_units(module):
            unit.unshard()
            unit.set_reshard_after_forward(False)
            unit.set_reshard_after_backward(False)
            kept.append(f"{type(unit).__name__}@{id(unit):x}")
    return kept


def reshard_all(model: torch.nn.Module) -> None:
    """Free the gathered weights of every FSDP2 unit in ``model`` again (after :func:`keep_gathered`).

    Example:
        >>> import torch
        >>> reshard_all(torch.nn.Linear(2, 2))   # no FSDP2 unit: nothing to do
    """
    for unit in _fsdp_units(model):
        unit.set_reshard_after_forward(True)
        unit.set_reshard_after_backward(True)
        unit.reshard()


def _fsdp_units(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The FSDP2 units (``fully_shard``-ed modules) inside ``model``, in ``modules()`` order."""
    from torch.distributed.fsdp import FSDPModule

    return [unit for unit in model.modules() if isinstance(unit, FSDPModule)]


def _shared_parameters(model: torch.nn.Module) -> set[int]:
    """Ids of the parameters two modules use (tied embeddings): FSDP2 needs both users in one unit."""
    seen: set[int] = set()
    shared: set[int] = set()
    for _, param in model.named_parameters(remove_duplicate=False):
        (shared if id(param) in seen else seen).add(id(param))
    return shared


def _shard_units(module: torch.nn.Module, shared: set[int], whole_layers: bool = True) -> list[torch.nn.Module]:
    """The modules to shard inside ``module``: frozen decoder layers (members of a ``ModuleList``,
    with ``whole_layers``) and frozen ``nn.Linear`` / ``nn.Embedding`` modules elsewhere. A module
    holding an FSDP2 unit already is searched, never taken whole (no unit contains another)."""
    out: list[torch.nn.Module] = []
    for child in module.children():
        params = list(child.parameters())
        if not params:
            continue
        # quantised weights (bitsandbytes' packed integers in Parameter subclasses) cannot be
        # sharded: FSDP2 would split the packed bytes away from their quantisation state
        plain = all(type(p) is torch.nn.Parameter and p.is_floating_point() for p in params)
        frozen = plain and not any(p.requires_grad or id(p) in shared for p in params)
        unit = (whole_layers and isinstance(module, torch.nn.ModuleList)) or isinstance(
            child, torch.nn.Linear | torch.nn.Embedding)
        if frozen and unit and not _fsdp_units(child):
            out.append(child)
        else:
            out.extend(_shard_units(child, shared, whole_layers))
    return out


def shard_frozen_base(model: torch.nn.Module) -> list[str]:
    """Shard the frozen weights of ``model`` over the ranks with FSDP2 (``fully_shard``); return what it sharded.

    Each unit is its own FSDP2 root: every frozen member of a ``ModuleList`` (a decoder layer), and
    inside the others every frozen ``nn.Linear`` and ``nn.Embedding``. Left replicated: trained
    parameters, norms, weights shared by two modules (tied embeddings) and quantised weights.
    Modules sharded before (by :func:`load_sharded`, or a second method on the same base) are kept
    as they are.

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
    return _shard(model, next(model.parameters()).device, whole_layers=True)


def _shard(model: torch.nn.Module, device: torch.device, whole_layers: bool) -> list[str]:
    """``fully_shard`` every unit of :func:`_shard_units` on ``device``'s mesh; their qualified names."""
    from torch.distributed.fsdp import fully_shard

    names = {id(m): n for n, m in model.named_modules()}
    sharded = []
    for unit in _shard_units(model, _shared_parameters(model), whole_layers):
        # Each unit is an FSDP2 root of its own (no unit contains another), and a root keeps its
        # gathered weights after forward unless told otherwise: free them, or nothing is saved.
        fully_shard(unit, mesh=_mesh(device), reshard_after_forward=True)
        sharded.append(names[id(unit)])
    return sharded


class ShardedLoadError(ValueError):
    """:func:`load_sharded` cannot read this checkpoint shard by shard (raised before any weight is read).

    Example:
        >>> issubclass(ShardedLoadError, ValueError)
        True
    """


@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Create every parameter registered inside on the meta device (no storage), buffers as usual.

    Buffers computed in ``__init__`` and absent from checkpoints (rotary ``inv_freq``) get their
    true values this way; building under ``torch.device("meta")`` would leave them empty too.
    """
    register = torch.nn.Module.register_parameter

    def on_meta(module: torch.nn.Module, name: str, param: torch.nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            param = torch.nn.Parameter(torch.empty_like(param, device="meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    torch.nn.Module.register_parameter = on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register  # type: ignore[method-assign]


_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "I64": torch.int64,
    "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
}


class _StoredTensor:
    """Where one tensor lies in a safetensors file (its header entry), read row range by row range.

    Rows are read with ``readinto`` straight into the destination (or one temporary of the
    rows when the dtype or device differs), not through a memory map: pages a map touches count
    as this process's resident memory until it is closed (measured: 2 ranks reading their half of
    SmolLM2-135M through ``safe_open(...).get_slice`` grew by 650 MB each, 310 MB of which the shards).
    """

    def __init__(self, path: Path, key: str, entry: dict[str, Any], data_start: int) -> None:
        if entry["dtype"] not in _SAFETENSORS_DTYPES:
            raise ShardedLoadError(f"{path}: tensor {key!r} has dtype {entry['dtype']}, which loading sharded "
                                         f"does not read (only {sorted(_SAFETENSORS_DTYPES)})")
        self.path, self.key = path, key
        self.dtype = _SAFETENSORS_DTYPES[entry["dtype"]]
        self.shape = tuple(entry["data_offsets"] and entry["shape"])
        self.offset = data_start + entry["data_offsets"][0]
        self.row_bytes = self.dtype.itemsize * (int(torch.Size(self.shape[1:]).numel()) if self.shape else 1)

    def read_rows(self, start: int, end: int, out: Tensor) -> int:
        """Copy rows ``[start, end)`` (the whole tensor for a scalar) into ``out``; the bytes read."""
        rows = (end - start, *self.shape[1:]) if self.shape else ()
        direct = out.dtype == self.dtype and out.device.type == "cpu" and out.is_contiguous()
        target = out if direct else torch.empty(rows, dtype=self.dtype)
        nbytes = target.numel() * target.element_size()
        with open(self.path, "rb") as f:
            f.seek(self.offset + start * self.row_bytes)
            got = f.readinto(target.view(-1).view(torch.uint8).numpy()) if nbytes else 0
        if got != nbytes:
            raise ValueError(f"{self.path}: tensor {self.key!r} ends early ({got} of {nbytes} bytes; a truncated file?)")
        if not direct:
            out.copy_(target.view(rows))
        return nbytes


def _checkpoint_tensors(directory: Path) -> dict[str, _StoredTensor]:
    """Tensor name -> its place in the safetensors files (the index's files when there is one); headers only."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in directory.glob("*.safetensors"))
    if not files:
        raise ShardedLoadError(f"{directory} holds no *.safetensors weights")
    where: dict[str, _StoredTensor] = {}
    for name in files:
        path = directory / name
        with open(path, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            try:
                header = json.loads(f.read(size))
            except ValueError as exc:
                raise ValueError(f"{path}: not a safetensors file (its header is no JSON: {exc})") from exc
        for key, entry in header.items():
            if key != "__metadata__":
                where[key] = _StoredTensor(path, key, entry, 8 + size)
    return where


def _rows(param: Tensor, rows: int) -> tuple[int, int]:
    """This rank's rows ``[start, end)`` of a weight FSDP2 shards on dim 0 (``torch.chunk``'s split)."""
    from torch.distributed.tensor import Shard

    if tuple(param.placements) != (Shard(0),):
        raise ValueError(f"expected a weight sharded on dim 0, got placements {param.placements}")
    mesh = param.device_mesh
    chunk = -(-rows // mesh.size())
    start = min(mesh.get_local_rank() * chunk, rows)
    return start, min(start + chunk, rows)


def load_sharded(directory: str | os.PathLike[str], *, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu", attn_implementation: str | None = None,
                 trust_remote_code: bool = False, name: str | None = None) -> Any:
    """Load a causal LM with its frozen weights sharded over the ranks, each rank reading only its shards.

    The model is built from ``directory``'s ``config.json`` with its parameters on the meta
    device; every ``nn.Linear`` and ``nn.Embedding`` becomes an FSDP2 unit (``fully_shard``; a weight
    two modules share, such as tied embeddings, stays whole on every rank, as do norms); ``to_empty``
    allocates this rank's shards; then each rank reads its rows of every sharded weight from the
    safetensors files (row ranges read into the shards, no memory map) and the replicated tensors whole. Buffers come
    from the model's ``__init__`` (rotary ``inv_freq``) unless the checkpoint stores them. Every
    projection is its own unit because LoRA attaches to any of them later; :func:`shard_frozen_base`
    keeps these units as they are.

    Args:
        directory: a model directory with ``config.json`` and ``*.safetensors`` (a
            ``model.safetensors.index.json`` for several files).
        dtype: the parameters' dtype (the checkpoint's is converted on the fly).
        device: this rank's device (``cuda:LOCAL_RANK`` under ``torchrun`` with GPUs).
        attn_implementation: as for ``from_pretrained``; None: transformers' choice.
        trust_remote_code: allow the model's own code from ``directory``.
        name: recorded as ``model.config.name_or_path`` (default: ``directory``).

    Returns:
        The model in eval mode on ``device``, every rank holding its shards.

    Raises:
        ShardedLoadError: no process group, no safetensors files, or a parameter without a
            tensor of its name in them (before any weight is read: load whole instead).
        ValueError: a tensor whose shape differs from the model's (naming file, tensor, shapes).

    Example:
        >>> load_sharded("any/model")   # a plain process: nothing to shard across
        Traceback (most recent call last):
        ...
        llm_calib.distributed.ShardedLoadError: loading sharded needs a process group of several ranks (torchrun)
    """
    if not is_distributed():
        raise ShardedLoadError("loading sharded needs a process group of several ranks (torchrun)")
    from transformers import GenerationConfig

    directory = Path(directory)
    device = torch.device(device)
    problem = None
    try:
        model, stored, keys, ties = _model_on_meta(directory, dtype, attn_implementation, trust_remote_code)
    except ShardedLoadError as exc:
        problem = str(exc)
    problem = first_problem(problem)  # every rank loads sharded, or none does (sharding is collective)
    if problem is not None:
        raise ShardedLoadError(problem)
    buffers = dict(model.named_buffers())
    keys.update({n: n for n in buffers if n in stored})  # persistent buffers the checkpoint keeps
    _allocate_shards(model, device, buffers, ties)
    read = _read_shards(model, stored, keys, buffers)
    if (directory / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(directory)
    model.config.name_or_path = name or str(directory)
    model.eval()
    # FSDP2 allocates a unit's gathered weights when it first gathers them; inside
    # torch.inference_mode (evaluation) they would be inference tensors that training passes
    # cannot save for backward. So every unit gathers once here, one after the other (a forward
    # pass instead peaked 180-330 MB higher per rank on SmolLM2-135M, 2 gloo ranks).
    with torch.no_grad():
        for unit in _fsdp_units(model):
            unit.unshard()
            unit.reshard()
    logger.info("rank %d read %.1f MB of %s for its shards", rank(), read / 1e6, directory)
    return model


def _model_on_meta(directory: Path, dtype: torch.dtype, attn_implementation: str | None, trust_remote_code: bool
                   ) -> tuple[Any, dict[str, _StoredTensor], dict[str, str | None], list[list[str]]]:
    """:func:`load_sharded`'s first part, which reads no weight: the frozen model with its
    parameters on the meta device, the checkpoint's tensors, each parameter's tensor name in them
    and the names of every tied parameter's users.

    Raises:
        ShardedLoadError: no config.json, no safetensors files, or a parameter without a tensor.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    if not (directory / "config.json").is_file():
        raise ShardedLoadError(f"{directory} holds no config.json")
    stored = _checkpoint_tensors(directory)
    config = AutoConfig.from_pretrained(directory, trust_remote_code=trust_remote_code)
    kwargs: dict[str, Any] = {"dtype": dtype, "trust_remote_code": trust_remote_code}
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    with _parameters_on_meta():
        model = AutoModelForCausalLM.from_config(config, **kwargs)
    model.requires_grad_(False)
    users: dict[int, list[str]] = {}  # the names of each parameter (two for a tied head)
    for qualified, param in model.named_parameters(remove_duplicate=False):
        users.setdefault(id(param), []).append(qualified)
    ties = [names for names in users.values() if len(names) > 1]
    keys = {names[0]: next((n for n in names if n in stored), None) for names in users.values()}
    missing = sorted(n for n, key in keys.items() if key is None)
    if missing:
        raise ShardedLoadError(
            f"{directory}: no tensor named {missing[0]!r} in its safetensors files ({len(missing)} parameters "
            "missing: its names differ from the model's)")
    return model, stored, keys, ties


def _allocate_shards(model: torch.nn.Module, device: torch.device, buffers: dict[str, Tensor],
                     ties: list[list[str]]) -> None:
    """Shard ``model`` (one unit per ``nn.Linear`` and ``nn.Embedding``) and allocate this rank's
    shards on ``device``; buffers get their ``__init__`` values back, tied parameters one tensor."""
    _shard(model, device, whole_layers=False)
    model.to_empty(device=device)
    for qualified, buffer in buffers.items():  # to_empty left them uninitialised: the values of __init__
        owner, _, attr = qualified.rpartition(".")
        model.get_submodule(owner)._buffers[attr] = buffer.to(device)
    for names in ties:  # to_empty gave each user its own tensor: one again
        for qualified in names[1:]:
            owner, _, attr = qualified.rpartition(".")
            setattr(model.get_submodule(owner), attr, model.get_parameter(names[0]))


def _read_shards(model: torch.nn.Module, stored: dict[str, _StoredTensor], keys: dict[str, str | None],
                 buffers: dict[str, Tensor]) -> int:
    """Read this rank's rows of every sharded tensor and the replicated tensors whole; the bytes read.

    Raises:
        ValueError: a stored tensor's shape differs from the model's (naming file, tensor, shapes).
    """
    from torch.distributed.tensor import DTensor

    read = 0
    with torch.no_grad():
        for qualified, key in keys.items():
            assert key is not None
            tensor = model.get_parameter(qualified) if qualified not in buffers else model.get_buffer(qualified)
            source = stored[key]
            if source.shape != tuple(tensor.shape):
                raise ValueError(f"{source.path}: tensor {key!r} has shape {list(source.shape)}, the model's "
                                 f"{qualified} {list(tensor.shape)} (config.json and weights disagree)")
            if isinstance(tensor, DTensor):
                start, end = _rows(tensor, source.shape[0])
                read += source.read_rows(start, end, tensor.to_local())
            else:
                read += source.read_rows(0, source.shape[0] if source.shape else 1, tensor)
    return read


def first_problem(problem: str | None) -> str | None:
    """The first rank's problem (``"rank R: ..."``), or None when no rank has one; on every rank.

    For decisions every rank must take alike because what follows is collective: a rank that
    cannot load sharded (a file missing on its node) makes every rank load whole, instead of the
    others waiting for it in a collective. One ``all_gather_object``; ``problem`` as it is
    without a process group.

    Example:
        >>> first_problem(None), first_problem("no safetensors files")   # one process
        (None, 'no safetensors files')
    """
    if not is_distributed():
        return problem
    problems: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(problems, problem)
    return next((f"rank {r}: {p}" for r, p in enumerate(problems) if p is not None), None)


def max_over_ranks(values: Sequence[int]) -> list[int]:
    """The element-wise maximum over ranks of a few integers, on every rank (a minimum: negate them).

    For counts every rank must agree on because each unit counted runs collectives (a batch's
    length parts under FSDP2). One ``all_reduce``, on the current GPU under nccl; ``values`` as they
    are without a process group.

    Example:
        >>> max_over_ranks([3, -2])   # one process
        [3, -2]
    """
    if not is_distributed():
        return list(values)
    on_gpu = dist.get_backend() == "nccl"  # nccl reduces GPU tensors only
    counts = torch.tensor(list(values), dtype=torch.long,
                          device=torch.device("cuda", torch.cuda.current_device()) if on_gpu else "cpu")
    dist.all_reduce(counts, op=dist.ReduceOp.MAX)
    return counts.tolist()
