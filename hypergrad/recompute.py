r"""Recompute cheap saved tensors of a backward pass instead of keeping them.

A first backward built with ``create_graph=True`` (the gradient of a step of reverse-mode
unrolling, whose own derivative is taken later) saves tensors for the second backward; some of
them are cheap functions of tensors that are saved anyway (the output of a pointwise op of the
first backward, a short matrix product). :class:`RecomputeSaved` replaces those by recipes that
recompute them, bitwise equal, when the second backward unpacks them, so the graph of each step
keeps fewer tensors. Used by :class:`hypergrad.unrolled.Unrolled` (``recompute=True``, the
default); see :doc:`/methods/unrolled`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from hypergrad.autodiff import grad_or_zeros, grad_with_graph
from hypergrad.tree import Tree, grads_to_tree

__all__ = ["RecomputeSaved"]


def _tanh_backward(node: Any) -> Tensor:
    return torch.ops.aten.tanh_backward(node._saved_grad_output, node._saved_output)


def _sigmoid_backward(node: Any) -> Tensor:
    return torch.ops.aten.sigmoid_backward(node._saved_grad_output, node._saved_output)


# Matrix products are recomputed only when they cost at most this many multiply-adds per output
# entry (a few pointwise ops' worth): e.g. the backward into the last hidden layer, whose
# contraction runs over the classes.
_MAX_INNER = 16


def _small_mm(node: Any) -> Tensor:
    return torch.mm(node._saved_self, node._saved_mat2)


def _is_small_mm(node: Any) -> bool:
    return int(node._saved_self_sym_sizes[-1]) <= _MAX_INNER  # sizes only: nothing is unpacked


# Nodes whose output is a cheap function of tensors the node saves for the backward anyway:
# pointwise ops of the first backward (built with create_graph=True), and short matrix products.
_RECOMPUTABLE: dict[str, Callable[[Any], Tensor]] = {
    "TanhBackwardBackward0": _tanh_backward,
    "SigmoidBackwardBackward0": _sigmoid_backward,
    "MmBackward0": _small_mm,
}
# Views of such an output that matrix products save (the transposed gradient of a weight).
_VIEWS: dict[str, Callable[[Any], Callable[[Tensor], Tensor]]] = {
    "TBackward0": lambda node: torch.t,
    "PermuteBackward0": lambda node: (lambda x, dims=tuple(node._saved_dims): x.permute(dims)),
    "TransposeBackward0": lambda node: (lambda x, a=node._saved_dim0, b=node._saved_dim1: x.transpose(a, b)),
}


_RELEVANT: dict[type, bool] = {}  # autograd node class -> named in _VIEWS or _RECOMPUTABLE


class _Recipe:
    """A saved tensor replaced by the node that produced it (and a view to re-apply).

    ``memo`` (shared by the recipes of one loop) keeps the last two recomputed node outputs: a
    tensor and its transpose, or a tensor saved by two ops, are unpacked close together in the
    backward sweep, and the second use then costs nothing; two slots because recomputing one
    tensor may unpack (and recompute) another in between. It holds at most two tensors.
    ``kind`` and ``view_cls`` describe the replaced tensor for the plan of :class:`RecomputeSaved`.
    """

    __slots__ = ("fn", "kind", "memo", "node", "storage", "view", "view_cls")

    def __init__(self, node: Any, fn: Callable[[Any], Tensor], view: Callable[[Tensor], Tensor] | None,
                 memo: list[Any], kind: tuple[Any, ...] = (), view_cls: type | None = None) -> None:
        self.node, self.fn, self.view, self.memo = node, fn, view, memo
        self.kind, self.view_cls = kind, view_cls
        self.storage: tuple[int, int] | None = None  # (data_ptr, nbytes) in the discovery step

    def pack(self, _: Tensor) -> _Recipe:
        """The pack hook for ``SavedTensor.register_hooks``: the tensor is dropped, the recipe kept."""
        return self

    def __call__(self) -> Tensor:
        memo, node = self.memo, self.node
        if memo[0] is node:
            out = memo[1]
        elif memo[2] is node:
            out = memo[3]
        else:
            if torch.is_grad_enabled():  # the backward sweep runs without grad mode: no switch there
                torch._C._set_grad_enabled(False)  # the context manager costs more than a pointwise op
                try:
                    out = self.fn(node)
                finally:
                    torch._C._set_grad_enabled(True)
            else:
                out = self.fn(node)
            memo[2], memo[3], memo[0], memo[1] = memo[0], memo[1], node, out
        return self.view(out) if self.view is not None else out


def _unpack(packed: Tensor | _Recipe) -> Tensor:
    return packed() if isinstance(packed, _Recipe) else packed


_SavedTensor = getattr(torch._C._autograd, "SavedTensor", None)
_SAVED_ATTRS: dict[type, tuple[str, ...]] = {}  # autograd node class -> its "_raw_saved_*" names
# The first backward of one step creates a few dozen nodes; a search that visits more than this
# has wandered into a graph the loss closed over, and the plan is not used.
_MAX_SEARCH = 4096


# One replaced saved tensor of a step's first backward, as :meth:`RecomputeSaved._search` found
# it: follow ``hops`` from the ``grad_fn`` of the ``root``-th gradient (at each hop the node must
# be of the recorded class; then take that ``next_functions`` index) to a node of class
# ``holder``, whose saved tensor ``attr`` must be produced by a node of class ``producer`` (through
# a view node of class ``view_cls`` if not None, re-applied by ``view_of(view_node)``), with the
# recorded shape, strides, dtype and device; ``fn(producer)`` recomputes it. A plain tuple: the
# later steps unpack it once per entry.
_Entry = tuple[int, tuple[tuple[type, int], ...], type, str, "type | None",
               "Callable[[Any], Callable[[Tensor], Tensor]] | None", type, Callable[[Any], Tensor],
               torch.Size, tuple[int, ...], torch.dtype, torch.device]


class RecomputeSaved:
    """Replace recomputable saved tensors of each step's first backward by recipes.

    Used for the first backward of each step of the stored-graph reverse unrolling (see
    ``Unrolled(recompute=...)``); :meth:`grad` replaces ``torch.autograd.grad``. A kind of tensor
    (producing op, view, shape, strides, dtype, device) is replaced only after the first tensor of
    that kind recomputed bitwise equal to itself; a kind that did not is kept from then on, as is
    anything unexpected.

    The first step runs under ``saved_tensors_hooks`` (a Python call for every tensor the backward
    saves: about 29 per step of a 3-layer MLP, measured 7 % of the whole unrolled call even for a
    hook that does nothing). It then searches that step's graph for the nodes holding the
    replaced tensors and records, per replaced tensor, the path from a gradient's ``grad_fn`` to
    its node (a plan). The later steps repeat the same ops: they run without hooks, follow the
    plan (checking every node's class and the tensor's kind on the way) and replace just those
    tensors with ``SavedTensor.register_hooks``, so only the replaced tensors ever reach Python.
    The plan keeps only the tensors that free at least ``min_bytes`` per save (:meth:`_select`);
    an empty plan turns the replacement off for the later steps. A plan that does not match a
    later step (other shapes, other ops) is dropped and the hooks are used for the remaining
    steps (replacing the candidates whose storage has at least ``min_bytes``). Where hooks cannot
    be installed (inside transforms that disable them) or the caller has installed its own
    (``torch.autograd.graph.save_on_cpu``, ...), it does nothing.

    Args:
        min_bytes: replace a tensor in the planned steps only if it frees at least this many
            bytes per save (``Unrolled(recompute_min_bytes=...)``).

    Attributes:
        replaced: the saved tensors replaced so far, over all steps.
        planned_steps: the steps replaced by following the plan (no saved-tensor hooks).

    Example:
        >>> import torch
        >>> weights = [torch.randn(8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(i))
        ...            for i in range(2)]
        >>> x = torch.randn(16, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
        >>> def loss(w):
        ...     return torch.tanh(torch.tanh(x @ w["a"]) @ w["b"]).square().sum()
        >>> saver = RecomputeSaved()
        >>> w = {"a": weights[0].requires_grad_(), "b": weights[1].requires_grad_()}
        >>> for _ in range(3):  # one step: a first backward with a graph, then its derivative
        ...     grads = saver.grad(loss(w), w)
        ...     again = torch.autograd.grad(sum(g.square().sum() for g in grads.values()), list(w.values()))
        >>> expected = torch.func.grad(lambda w_: sum(g.square().sum() for g in torch.func.grad(loss)(w_).values()))(w)
        >>> saver.replaced > 0, all(torch.allclose(a, e) for a, e in zip(again, expected.values()))
        (True, True)
    """

    def __init__(self, min_bytes: int = 0) -> None:
        self.replaced = 0
        self.planned_steps = 0  # steps replaced by following the plan (no saved-tensor hooks)
        self.min_bytes = min_bytes
        self._verified: dict[tuple[Any, ...], bool] = {}
        self._memo: list[Any] = [None, None, None, None]
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)
        self._state = "discover"  # -> "plan" | "hooks" | "off"
        self._plan: tuple[_Entry, ...] = ()
        # discovery step only: saves per storage (data_ptr), and the replaced tensors kept alive
        # until the plan is made, so that no later tensor of that step reuses their addresses
        self._saves: dict[int, int] | None = {}
        self._held: list[Tensor] = []

    def grad(self, value: Tensor, inputs: Tree) -> Tree:
        """``grad_or_zeros(value, inputs, create_graph=True)``, with recipes for cheap saves."""
        if self._state == "off" or not value.requires_grad:
            return grad_or_zeros(value, inputs, create_graph=True)
        if self._state == "plan":
            grads = grad_with_graph(value, list(inputs.values()))
            done = self._follow_plan(grads)
            self.replaced += done
            if done == len(self._plan):
                self.planned_steps += 1
            else:
                self._state = "hooks"  # this step keeps what the plan did not reach
            return grads_to_tree(grads, inputs)
        if not self._enter():
            self._state = "off"
            return grad_or_zeros(value, inputs, create_graph=True)
        before = self.replaced
        try:
            grads = grad_with_graph(value, list(inputs.values()))
        finally:
            self._hooks.__exit__(None, None, None)
        if self._state == "discover":
            new = self.replaced - before
            found = self._search(grads) if new else None
            if not new:
                self._state = "off"  # nothing recomputable in this step: the later steps repeat its ops
            elif found is not None and len(found) == new:
                self._plan = self._select(found)
                self._state = "plan" if self._plan else "off"
            else:
                self._state = "hooks"
            self._saves, self._held = None, []
        return grads_to_tree(grads, inputs)

    def _select(self, found: list[tuple[_Entry, tuple[int, int]]]) -> tuple[_Entry, ...]:
        """The entries worth replacing in the later steps.

        A tensor frees memory only if every save of its storage is replaced, and each replaced
        save costs the same Python work per step whatever its size: keep the entries of the
        storages all of whose saves were replaced and that free at least ``min_bytes`` per save.
        """
        saves = self._saves or {}
        replaced: dict[int, int] = {}
        for _, (ptr, _) in found:
            replaced[ptr] = replaced.get(ptr, 0) + 1
        return tuple(entry for entry, (ptr, nbytes) in found
                     if replaced[ptr] == saves.get(ptr, 0) and nbytes >= self.min_bytes * replaced[ptr])

    def _enter(self) -> bool:
        top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
        if top is None or _SavedTensor is None or top(False) is not None:
            return False  # the caller's own hooks (save_on_cpu, a memory probe) take precedence
        try:
            self._hooks.__enter__()
        except RuntimeError:  # saved tensor hooks disabled here
            return False
        return True

    def _pack(self, t: Tensor) -> Tensor | _Recipe:
        saves = self._saves
        if saves is not None:  # the discovery step: count the saves of each storage
            try:
                ptr = t.untyped_storage().data_ptr()
            except Exception:  # no storage (sparse, nested, ...): never grouped with a candidate
                ptr = -1
            saves[ptr] = saves.get(ptr, 0) + 1
        node = t.grad_fn
        if node is None:
            return t
        # fast exit for the many saved tensors that are neither a candidate nor a view (the node
        # classes are fixed per op, so this is one dict lookup per save)
        cls = type(node)
        relevant = _RELEVANT.get(cls)
        if relevant is None:
            relevant = _RELEVANT[cls] = node.name() in _VIEWS or node.name() in _RECOMPUTABLE
        if not relevant:
            return t
        view = None
        view_cls = None
        name = node.name()
        view_name = ""
        try:
            if name in _VIEWS:
                view_name, view_cls = name, cls
                view = _VIEWS[name](node)
                node = node.next_functions[0][0]
                if node is None:
                    return t
                name = node.name()
            fn = _RECOMPUTABLE.get(name)
            if fn is None or (fn is _small_mm and not _is_small_mm(node)):
                return t
            kind = (view_name, name, tuple(t.shape), t.stride(), t.dtype, t.device)
            recipe = _Recipe(node, fn, view, self._memo, kind, view_cls)
            ok = self._verified.get(kind)
            if ok is None:
                ok = _recomputes(recipe, t)
                self._verified[kind] = ok
        except Exception:  # an attribute missing in this torch version, a freed buffer, ...
            return t
        if not ok:
            return t
        try:
            storage = t.untyped_storage()
        except Exception:  # no storage (sparse, nested, ...)
            return t
        if saves is not None:  # the discovery step replaces every candidate (see _select)
            recipe.storage = (storage.data_ptr(), storage.nbytes())
            self._held.append(t)
        elif storage.nbytes() < self.min_bytes:  # the hooks fallback: saves per storage unknown
            return t
        self.replaced += 1
        return recipe

    def _search(self, grads: tuple[Tensor | None, ...]) -> list[tuple[_Entry, tuple[int, int]]] | None:
        """Breadth-first from the gradients' ``grad_fn``: the path to every node holding a recipe."""
        queue: deque[tuple[Any, int, tuple[tuple[type, int], ...]]] = deque()
        for r, g_ in enumerate(grads):
            if g_ is not None and g_.grad_fn is not None:
                queue.append((g_.grad_fn, r, ()))
        seen: dict[int, Any] = {}  # id -> node (kept alive so that ids stay unique)
        plan: list[tuple[_Entry, tuple[int, int]]] = []
        try:
            while queue:
                node, root, hops = queue.popleft()
                if id(node) in seen:
                    continue
                seen[id(node)] = node
                if len(seen) > _MAX_SEARCH:
                    return None
                cls = type(node)
                attrs = _SAVED_ATTRS.get(cls)
                if attrs is None:
                    attrs = _SAVED_ATTRS[cls] = tuple(a for a in dir(node) if a.startswith("_raw_saved_"))
                for attr in attrs:
                    try:
                        raw = getattr(node, attr)
                        packed = raw.data if isinstance(raw, _SavedTensor) else None
                    except Exception:  # e.g. a buffer freed by an earlier backward: not ours
                        continue
                    if isinstance(packed, _Recipe):
                        rec = packed
                        view_name, _, shape, stride, dtype, device = rec.kind
                        view_of = _VIEWS[view_name] if rec.view_cls is not None else None
                        entry = (root, hops, cls, attr, rec.view_cls, view_of, type(rec.node), rec.fn,
                                 torch.Size(shape), stride, dtype, device)
                        plan.append((entry, rec.storage or (-1, 0)))
                for idx, (nxt, _) in enumerate(node.next_functions):
                    if nxt is not None:
                        queue.append((nxt, root, (*hops, (cls, idx))))
        except Exception:  # an attribute this torch version lacks, ...
            return None
        return plan

    def _follow_plan(self, grads: tuple[Tensor | None, ...]) -> int:
        """Replace the planned saved tensors of this step, in order, up to the first that differs.

        Returns how many were replaced (``len(plan)`` when the whole plan matched).
        """
        memo = self._memo
        done = 0
        try:
            for (root, hops, holder, attr, view_cls, view_of, producer_cls, fn, shape, stride, dtype,
                 device) in self._plan:
                g_ = grads[root]
                node = g_.grad_fn if g_ is not None else None
                for cls, idx in hops:
                    if type(node) is not cls:
                        return done
                    node = node.next_functions[idx][0]
                if type(node) is not holder:
                    return done
                raw = getattr(node, attr)
                t = raw.unpack()
                if t.shape != shape or t.stride() != stride or t.dtype is not dtype or t.device != device:
                    return done
                producer = t.grad_fn
                view = None
                if view_cls is not None:
                    if type(producer) is not view_cls:
                        return done
                    view = view_of(producer)  # type: ignore[misc]
                    producer = producer.next_functions[0][0]
                if type(producer) is not producer_cls or (fn is _small_mm and not _is_small_mm(producer)):
                    return done
                # t still alive: the pack hook gets its Python object instead of a new one
                recipe = _Recipe(producer, fn, view, memo)
                raw.register_hooks(recipe.pack, _Recipe.__call__)
                del t
                done += 1
        except Exception:  # a freed buffer, hooks disabled here, ...
            return done
        return done


def _recomputes(recipe: _Recipe, t: Tensor) -> bool:
    """Whether ``recipe`` recomputes ``t`` bitwise (values, shape, strides, dtype, device)."""
    again = recipe()
    return bool(again.shape == t.shape and again.stride() == t.stride() and again.dtype == t.dtype
                and again.device == t.device and torch.equal(again, t))
