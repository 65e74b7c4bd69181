"""Arithmetic and validation for flat pytrees: ``dict[str, Tensor]``.

Every variable in :mod:`hypergrad` (inner parameters ``w``, outer parameters ``lam``, linear-solver
vectors) is a flat dict of tensors, the convention of :func:`torch.func.functional_call`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence

import torch
from torch import Tensor

Tree = dict[str, Tensor]

__all__ = [
    "Tree",
    "check_finite",
    "check_like",
    "check_scalar_loss",
    "check_tree",
    "supports_foreach",
    "tree_add",
    "tree_all_finite",
    "tree_axpy",
    "tree_detach",
    "tree_dot",
    "tree_flatten",
    "tree_flatten_view",
    "tree_map",
    "tree_norm",
    "tree_numel",
    "tree_requires_grad",
    "tree_scale",
    "tree_split_views",
    "tree_sub",
    "tree_unflatten",
    "tree_zeros_like",
]


def check_tree(tree: object, name: str) -> Tree:
    """Validate that ``tree`` is a non-empty ``dict[str, Tensor]`` of floating tensors.

    Raises:
        TypeError: if ``tree`` is not a dict of floating-point tensors with string keys.
        ValueError: if it is empty.
    """
    if not isinstance(tree, Mapping):
        raise TypeError(f"{name} must be a dict[str, Tensor], got {type(tree).__name__}")
    if len(tree) == 0:
        raise ValueError(f"{name} must contain at least one tensor, got an empty dict")
    for key, value in tree.items():
        if not isinstance(key, str):
            raise TypeError(f"{name} keys must be str, got key {key!r} of type {type(key).__name__}")
        if not isinstance(value, Tensor):
            raise TypeError(f"{name}[{key!r}] must be a torch.Tensor, got {type(value).__name__}")
        if not value.is_floating_point():
            raise TypeError(
                f"{name}[{key!r}] must have a floating dtype (float32/float64/...), got {value.dtype}"
            )
    return dict(tree)


def check_like(tree: Mapping[str, Tensor], reference: Mapping[str, Tensor], name: str, ref_name: str) -> None:
    """Check that ``tree`` has exactly the keys and shapes of ``reference``.

    Raises:
        ValueError: naming the first missing/extra key or mismatched shape.
    """
    missing = sorted(set(reference) - set(tree))
    extra = sorted(set(tree) - set(reference))
    if missing or extra:
        raise ValueError(
            f"{name} must have the same keys as {ref_name}: missing {missing}, unexpected {extra}"
        )
    for key, ref in reference.items():
        if tree[key].shape != ref.shape:
            raise ValueError(
                f"{name}[{key!r}] has shape {tuple(tree[key].shape)} but {ref_name}[{key!r}] has "
                f"shape {tuple(ref.shape)}"
            )


def check_scalar_loss(value: object, name: str) -> Tensor:
    """Check that a loss callable returned a real floating scalar tensor."""
    if not isinstance(value, Tensor):
        raise TypeError(f"{name} must return a scalar torch.Tensor, got {type(value).__name__}")
    if value.numel() != 1 or value.dim() > 1:
        raise ValueError(f"{name} must return a scalar tensor, got shape {tuple(value.shape)}")
    if not value.is_floating_point():
        raise TypeError(f"{name} must return a floating tensor, got {value.dtype}")
    return value.reshape(())


def supports_foreach(tensors: Sequence[Tensor]) -> bool:
    """Whether the ``torch._foreach_*`` operators apply to ``tensors``: plain tensors on one device,
    outside the :mod:`torch.func` transforms (``vmap`` has no batching rules for them).

    On a GPU one ``_foreach`` call launches one kernel for all the leaves instead of one per leaf;
    on the CPU it runs the same per-leaf kernels as a loop (the same numbers) from one Python call.

    Example:
        >>> import torch
        >>> supports_foreach([torch.ones(2), torch.zeros(3)]), supports_foreach([])
        (True, False)
    """
    if not tensors or torch._C._are_functorch_transforms_active():
        return False
    device = tensors[0].device
    return all(type(t) is Tensor or type(t) is torch.nn.Parameter for t in tensors) and all(
        t.device == device for t in tensors)


def tree_all_finite(tree: Mapping[str, Tensor]) -> Tensor:
    """Whether every entry of every leaf is finite, as a 0-dim bool tensor on the leaves' device.

    Nothing is read back to the host (no synchronisation on a GPU): a training loop can keep the
    flag and check it when it logs.

    Example:
        >>> import torch
        >>> tree_all_finite({"a": torch.ones(2), "b": torch.tensor([1.0, float("inf")])})
        tensor(False)
    """
    leaves = list(tree.values())
    if not leaves:
        return torch.ones((), dtype=torch.bool)
    buffer = _shared_buffer(leaves) if supports_foreach(leaves) else None
    if buffer is not None:  # leaves held in one buffer (an optimiser's output): one test over it
        return torch.isfinite(buffer).all()
    if supports_foreach(leaves):
        # the largest magnitude per leaf: NaN where a leaf holds a NaN, inf where it holds an inf
        return torch.isfinite(torch.stack(torch._foreach_norm(leaves, ord=math.inf))).all()
    return torch.stack([torch.isfinite(v).all() for v in leaves]).all()


def check_finite(tree: Mapping[str, Tensor], what: str) -> None:
    """Raise :class:`hypergrad.NonFiniteError` if any entry of ``tree`` holds NaN or inf.

    One value is read back to the host (:func:`tree_all_finite`); the leaves are scanned one by one
    only to name the first bad entry.

    Example:
        >>> import torch
        >>> check_finite({"w": torch.tensor([1.0, float("nan")])}, "update")
        Traceback (most recent call last):
        ...
        hypergrad.errors.NonFiniteError: update: 1 non-finite value(s) in entry 'w'
    """
    from hypergrad.errors import NonFiniteError

    if not tree or bool(tree_all_finite(tree)):
        return
    for key, value in tree.items():
        if not bool(torch.isfinite(value).all()):
            n_bad = int((~torch.isfinite(value)).sum())
            raise NonFiniteError(f"{what}: {n_bad} non-finite value(s) in entry {key!r}")


def tree_map(fn: Callable[..., Tensor], tree: Mapping[str, Tensor], *rest: Mapping[str, Tensor]) -> Tree:
    """Apply ``fn`` leaf-wise over trees with the same keys."""
    return {k: fn(v, *(r[k] for r in rest)) for k, v in tree.items()}


def _leaves(tree: Mapping[str, Tensor], keys: Iterable[str]) -> list[Tensor]:
    return [tree[k] for k in keys]


def tree_add(a: Mapping[str, Tensor], b: Mapping[str, Tensor]) -> Tree:
    """Return ``a + b``."""
    xs = list(a.values())
    if supports_foreach(xs):
        return dict(zip(a, torch._foreach_add(xs, _leaves(b, a)), strict=True))
    return {k: a[k] + b[k] for k in a}


def tree_sub(a: Mapping[str, Tensor], b: Mapping[str, Tensor]) -> Tree:
    """Return ``a - b``."""
    xs = list(a.values())
    if supports_foreach(xs):
        return dict(zip(a, torch._foreach_sub(xs, _leaves(b, a)), strict=True))
    return {k: a[k] - b[k] for k in a}


def _as_scalar(s: float | Tensor, leaves: list[Tensor]) -> float | Tensor | None:
    """``s`` as the scalar of one ``_foreach`` call on ``leaves``: a number as it is; a 0-dim tensor on
    their device in their (common) dtype, as a number would be taken (a float64 step size does not
    promote a float32 0-dim leaf). None where one call cannot take it."""
    if not isinstance(s, Tensor):
        return s
    dtypes = {t.dtype for t in leaves}
    if s.dim() != 0 or s.device != leaves[0].device or len(dtypes) != 1:
        return None
    return s.to(dtypes.pop())


def _leaf_scalar(s: float | Tensor, leaf: Tensor) -> float | Tensor:
    return s.to(leaf.dtype) if isinstance(s, Tensor) and s.dim() == 0 else s


def tree_scale(a: Mapping[str, Tensor], s: float | Tensor) -> Tree:
    """Return ``s * a`` (a 0-dim tensor ``s`` is taken in the leaves' dtype, as a number is)."""
    xs = list(a.values())
    if supports_foreach(xs) and (scalar := _as_scalar(s, xs)) is not None:
        return dict(zip(a, torch._foreach_mul(xs, scalar), strict=True))
    return {k: v * _leaf_scalar(s, v) for k, v in a.items()}


def tree_axpy(alpha: float | Tensor, x: Mapping[str, Tensor], y: Mapping[str, Tensor]) -> Tree:
    """Return ``alpha * x + y``.

    ``alpha`` may be a 0-dim tensor on the leaves' device (e.g. a step size computed there): nothing
    is read back to the host, and it is taken in the leaves' dtype, as a number is.
    """
    ys = list(y.values())
    if supports_foreach(ys) and (scalar := _as_scalar(alpha, ys)) is not None:
        # multiply, then add (two roundings, as the per-leaf form)
        return dict(zip(y, torch._foreach_add(ys, torch._foreach_mul(_leaves(x, y), scalar)), strict=True))
    return {k: y[k] + _leaf_scalar(alpha, y[k]) * x[k] for k in y}


def _flat_pair(a: Mapping[str, Tensor], b: Mapping[str, Tensor]) -> tuple[Tensor, Tensor] | None:
    """Both trees as flat vectors (leaves in ``a``'s key order) when their leaves share one device."""
    xs, ys = list(a.values()), _leaves(b, a)
    if not supports_foreach(xs + ys):
        return None
    if len(xs) == 1:
        return xs[0].reshape(-1), ys[0].reshape(-1)
    return torch.cat([v.reshape(-1) for v in xs]), torch.cat([v.reshape(-1) for v in ys])


def tree_dot(a: Mapping[str, Tensor], b: Mapping[str, Tensor]) -> Tensor:
    """Return the Euclidean inner product ``<a, b>`` as a scalar tensor (on the leaves' device)."""
    flat = _flat_pair(a, b)
    if flat is not None:
        x, y = flat
        if x.dtype == y.dtype:
            return torch.dot(x, y)
        return torch.sum(x * y)  # mixed dtypes: the product promotes (torch.dot would refuse)
    ref = next(iter(a.values()))
    return sum((torch.sum(a[k] * b[k]) for k in a), start=torch.zeros((), dtype=ref.dtype, device=ref.device))


def tree_norm(a: Mapping[str, Tensor]) -> Tensor:
    """Return the Euclidean norm of the concatenated leaves."""
    xs = list(a.values())
    if supports_foreach(xs):
        if len(xs) == 1:
            return torch.linalg.vector_norm(xs[0])
        return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(xs)))
    return torch.sqrt(tree_dot(a, a))


def tree_zeros_like(a: Mapping[str, Tensor]) -> Tree:
    """Return a tree of zeros shaped like ``a``."""
    return {k: torch.zeros_like(v) for k, v in a.items()}


def tree_detach(a: Mapping[str, Tensor]) -> Tree:
    """Return ``a`` with every leaf detached from the autograd graph."""
    return {k: v.detach() for k, v in a.items()}


def tree_requires_grad(a: Mapping[str, Tensor]) -> Tree:
    """Return detached copies of the leaves that require grad (fresh autograd leaves)."""
    return {k: v.detach().requires_grad_(True) for k, v in a.items()}


def tree_numel(a: Mapping[str, Tensor]) -> int:
    """Return the total number of scalar entries."""
    return sum(v.numel() for v in a.values())


def tree_flatten(a: Mapping[str, Tensor]) -> Tensor:
    """Concatenate the leaves (in key order) into one vector."""
    return torch.cat([v.reshape(-1) for v in a.values()])


def tree_flatten_view(a: Mapping[str, Tensor]) -> Tensor:
    """Like :func:`tree_flatten`, but without a copy where none is needed: a single contiguous leaf, or
    leaves that are consecutive pieces of one buffer (as :func:`tree_split_views` makes them), are
    returned as a view of it.

    The result may alias ``a``: do not modify it in place.

    Example:
        >>> import torch
        >>> flat = torch.arange(5.0)
        >>> tree_flatten_view(tree_split_views(flat, {"a": torch.zeros(2), "b": torch.zeros(3)})).data_ptr() == flat.data_ptr()
        True
    """
    leaves = list(a.values())
    if len(leaves) == 1:
        return leaves[0].reshape(-1)
    buffer = _shared_buffer(leaves)
    if buffer is not None:
        return buffer
    # contiguous leaves flatten by a view each (one operator), not a reshape (two)
    return torch.cat([v.view(-1) if v.is_contiguous() else v.reshape(-1) for v in leaves])


def _shared_buffer(leaves: Sequence[Tensor]) -> Tensor | None:
    """The flat buffer ``leaves`` are consecutive contiguous pieces of (one view of it), or None.

    Read from the leaves' storage and offsets only (no operator runs); a single contiguous leaf is its
    own buffer.
    """
    if not leaves or torch.compiler.is_compiling():  # traced code: no storage to read
        return None
    first = leaves[0]
    if len(leaves) == 1:
        return first.reshape(-1) if first.is_contiguous() else None
    storage = first.untyped_storage().data_ptr()
    offset, dtype = first.storage_offset(), first.dtype
    for leaf in leaves:
        if (leaf.dtype != dtype or not leaf.is_contiguous() or leaf.storage_offset() != offset
                or leaf.untyped_storage().data_ptr() != storage or type(leaf) is not Tensor):
            return None
        offset += leaf.numel()
    return first.as_strided((offset - first.storage_offset(),), (1,), first.storage_offset())


def tree_split_views(vector: Tensor, like: Mapping[str, Tensor]) -> Tree:
    """``vector`` (1-D, contiguous) as a tree shaped like ``like``: consecutive views, one operator per leaf.

    The inverse of :func:`tree_flatten` for leaves of ``vector``'s dtype; :func:`tree_flatten_view` of the
    result is ``vector`` again without a copy (what lets an optimiser keep its trees as flat buffers).

    Example:
        >>> import torch
        >>> t = tree_split_views(torch.arange(5.0), {"a": torch.zeros(2), "b": torch.zeros(1, 3)})
        >>> t["a"].tolist(), t["b"].tolist()
        ([0.0, 1.0], [[2.0, 3.0, 4.0]])
    """
    if vector.dim() != 1 or not vector.is_contiguous():
        raise ValueError(f"tree_split_views needs a contiguous 1-D vector, got shape {tuple(vector.shape)}")
    if vector.numel() != tree_numel(like):
        raise ValueError(f"tree_split_views: the vector has {vector.numel()} entries, the tree {tree_numel(like)}")
    out: Tree = {}
    offset = vector.storage_offset()
    for k, v in like.items():
        out[k] = vector.as_strided(v.shape, _contiguous_strides(v.shape), offset)
        offset += v.numel()
    return out


def _contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def tree_unflatten(vector: Tensor, like: Mapping[str, Tensor]) -> Tree:
    """Split ``vector`` into a tree shaped like ``like`` (inverse of :func:`tree_flatten`).

    Leaves take the dtype of ``like``'s (``torch.cat`` promotes mixed dtypes when flattening).
    """
    out: Tree = {}
    offset = 0
    for k, v in like.items():
        n = v.numel()
        out[k] = vector[offset : offset + n].reshape(v.shape).to(v.dtype)
        offset += n
    return out


def grads_to_tree(grads: Iterable[Tensor | None], like: Mapping[str, Tensor]) -> Tree:
    """Turn the tuple returned by :func:`torch.autograd.grad` into a tree, zero-filling ``None``."""
    return {
        k: (g if g is not None else torch.zeros_like(v))
        for (k, v), g in zip(like.items(), grads, strict=True)
    }
