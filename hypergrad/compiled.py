r"""Compiled products for implicit differentiation: trace the losses once, then run kernels.

The eager products of :class:`~hypergrad.autodiff.RootSystem` are backward passes through a
retained graph: each one walks the autograd engine's node list (tens of microseconds per node on
small problems), although the arithmetic of a Hessian-vector product is often a few microseconds.
This module removes that overhead the way a tracing compiler does:

1. :func:`torch.compile` (dynamo) traces one *stage* function of ``(w, lam, batches, v, u)`` that
   returns the outer gradients, the inner gradient (the optimality residual), a Hessian-vector
   product ``H v`` and a mixed product ``(\partial_\lambda \nabla_w g)^\top u`` (both by
   ``torch.func.vjp`` of ``torch.func.grad``). Dynamo's guards re-trace when the problem's code,
   the shapes or the dtypes change, and tensors the losses read from closures or globals are
   graph inputs, read afresh on every call (never frozen at trace time).
2. The traced ATen graph is split by dependence: the nodes that depend on neither ``v`` nor ``u``
   (the *primal* part: forward passes, first backward, everything the products reuse) run once
   per hypergradient; the nodes that depend on ``v`` form the Hessian-vector product, and those
   that depend on ``u`` the mixed product. Each part is compiled by inductor.
3. Per hypergradient, one guarded call runs the primal part and hands over the residual tensors
   the products need; every solver iteration then calls the compiled product directly (no guard
   evaluation, no autograd engine, no Python per operator).

It is selected by ``Implicit(compile=True)`` and works with any solver of
:mod:`hypergrad.linear` for the gradient form (the system is symmetric). The arithmetic is the
eager products' up to floating-point reassociation (the tests check 1e-10 in float64).

**Cost.** Compilation happens once per problem, shape and dtype; later calls with new values of
``w``, ``lam`` and the batches reuse it. Measured on a 2-core CPU (inductor generates C++; a C++
compiler must be on ``PATH``): the first compilation in a process takes 15-45 s with an empty
inductor cache (it builds its C++ runtime as well as the kernels), 5-8 s with inductor's on-disk
cache warm, and 1-6 s for further problems in the same process. Once compiled a hypergradient
takes 0.5-1.0x the eager time (``benchmarks/results/hypergrad.md``), so compiling pays back after
hundreds to thousands of calls: in long outer loops, not in a few calls.

**Fallback.** If tracing or compilation fails (no C++ compiler, Python control flow that depends
on tensor values, an operator dynamo cannot trace, the recompile limit), one warning is logged on
the ``hypergrad`` logger and the eager products are used; ``info.extra["compiled"]`` says which
path ran. Failures are remembered per problem, so the compiler is not retried on every call.
"""

from __future__ import annotations

import logging
import shutil
import threading
import time
import types
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from hypergrad.problem import BilevelProblem
from hypergrad.tree import Tree

__all__ = ["CompiledStage", "compiled_stage", "compiler_available"]

logger = logging.getLogger("hypergrad")

PRIMAL, TANGENT_V, TANGENT_U = 0, 1, 2


def compiler_available() -> tuple[bool, str]:
    """Whether inductor can compile on the CPU here: a C++ compiler must be on ``PATH``.

    Returns:
        ``(True, path of the compiler)`` or ``(False, reason)``.

    Example:
        >>> ok, detail = compiler_available()
        >>> isinstance(ok, bool) and isinstance(detail, str)
        True
    """
    for name in ("g++", "c++", "clang++"):
        path = shutil.which(name)
        if path:
            return True, path
    return False, "no C++ compiler (g++, c++ or clang++) on PATH; inductor needs one on the CPU"


@dataclass
class CompiledStage:
    r"""What one compiled call hands to a hypergradient method.

    Attributes:
        outer_value: :math:`f(w, \lambda)` (detached scalar).
        inner_value: :math:`g(w, \lambda)` (detached scalar).
        grad_w_f: :math:`\nabla_w f`, shaped like ``w``.
        grad_lam_f: :math:`\nabla_\lambda f`, shaped like ``lam``.
        residual: :math:`\nabla_w g` (zero at an exact inner solution), shaped like ``w``.
        hvp_flat: ``v -> H v`` on the flat vector (the leaves of ``w`` concatenated in key order),
            :math:`H = \nabla^2_{ww} g` at the stage's point.
        mixed: ``u -> (\partial_\lambda \nabla_w g)^\top u`` for a flat ``u``, shaped like ``lam``.
        cg_step: one conjugate-gradient iteration on ``(H + damping I) x = b`` fused with its
            product, ``(x, r, p, rs, damping) -> (x', r', p', rs', curvature)`` (``rs = r^T r``
            and ``damping`` 0-dim tensors); see :class:`~hypergrad.linear.LinearSystem`.
        compile_s: seconds spent compiling during this call (0 when the cache was used).
    """

    outer_value: Tensor
    inner_value: Tensor
    grad_w_f: Tree
    grad_lam_f: Tree
    residual: Tree
    hvp_flat: Callable[[Tensor], Tensor]
    mixed: Callable[[Tensor], Tree]
    cg_step: Callable[..., tuple[Tensor, ...]]
    compile_s: float


# --------------------------------------------------------------------------- the traced stage


def _unflat(v: Tensor, like: Tree) -> Tree:
    out, offset = {}, 0
    for k, x in like.items():
        out[k] = v[offset : offset + x.numel()].view(x.shape)
        offset += x.numel()
    return out


def _flat(t: Tree, like: Tree) -> Tensor:
    return torch.cat([t[k].reshape(-1) for k in like])


def _stage(problem: BilevelProblem, w: Tree, lam: Tree, inner_batch: Any, outer_batch: Any,
           v: Tensor, u: Tensor) -> tuple[Any, ...]:
    (grad_w_f, grad_lam_f), f_value = torch.func.grad_and_value(
        lambda w_, l_: problem.outer_loss(w_, l_, outer_batch), argnums=(0, 1))(w, lam)

    def grad_w_g(w_: Tree, l_: Tree) -> tuple[Tree, Tensor]:
        return torch.func.grad_and_value(lambda t: problem.inner_loss(t, l_, inner_batch))(w_)

    residual, hvp, g_value = torch.func.vjp(lambda w_: grad_w_g(w_, lam), w, has_aux=True)
    _, mixed, _ = torch.func.vjp(lambda l_: grad_w_g(w, l_), lam, has_aux=True)
    (hv,) = hvp(_unflat(v, w))
    (mu,) = mixed(_unflat(u, w))
    # "+ 0 * vector": each product depends on its vector in the traced graph even where it is
    # constant (an inner loss without lam, or linear in w), so the split always finds both
    return (f_value, g_value, grad_w_f, grad_lam_f, residual, _flat(hv, w) + 0.0 * v,
            _flat(mu, lam) + 0.0 * u.sum())


# ------------------------------------------------------------------------ splitting the graph


def _dependence(graph: torch.fx.Graph, v_node: torch.fx.Node, u_node: torch.fx.Node) -> dict[torch.fx.Node, int]:
    kind: dict[torch.fx.Node, int] = {}
    for node in graph.nodes:
        if node.op == "output":
            continue
        if node is v_node:
            kind[node] = TANGENT_V
        elif node is u_node:
            kind[node] = TANGENT_U
        else:
            kinds = {kind[a] for a in node.all_input_nodes} - {PRIMAL}
            if len(kinds) > 1:
                raise RuntimeError(f"node {node.name} depends on both product vectors")
            kind[node] = kinds.pop() if kinds else PRIMAL
    return kind


def _tangent_module(gm: torch.fx.GraphModule, kind: dict[torch.fx.Node, int], which: int,
                    vector: torch.fx.Node, outputs: list[torch.fx.Node]) -> tuple[torch.fx.GraphModule, list[torch.fx.Node]]:
    """The nodes of one product as their own graph: inputs the vector, then the primal residuals."""
    nodes = [n for n in gm.graph.nodes if n.op != "output" and kind[n] == which and n is not vector]
    residuals: list[torch.fx.Node] = []
    for node in nodes:
        for a in node.all_input_nodes:
            if kind[a] == PRIMAL and a not in residuals:
                residuals.append(a)
    graph = torch.fx.Graph()
    env = {vector: graph.placeholder("vector")}
    for i, a in enumerate(residuals):
        env[a] = graph.placeholder(f"residual_{i}")
    for node in nodes:
        env[node] = graph.node_copy(node, lambda a: env[a])
    graph.output(tuple(env[o] for o in outputs if kind[o] == which))
    module = torch.fx.GraphModule(gm, graph)
    module.graph.eliminate_dead_code()
    module.recompile()
    return module, residuals


def _cg_step_module(hvp_module: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """One CG iteration around the product: ``(x, r, p, rs, damping, *residuals)``, the arithmetic
    of :func:`hypergrad.linear.cg.conjugate_gradient` (its caller checks the curvature)."""
    aten = torch.ops.aten
    graph = torch.fx.Graph()
    x, r, p, rs, damping = (graph.placeholder(n) for n in ("x", "r", "p", "rs", "damping"))
    env: dict[torch.fx.Node, Any] = {}
    for node in hvp_module.graph.nodes:
        if node.op == "placeholder":
            env[node] = p if node.target == "vector" else graph.placeholder(node.target)
        elif node.op == "output":
            (product,) = node.args[0]
            hp = env[product]
        else:
            env[node] = graph.node_copy(node, lambda a: env[a])

    def op(fn: Any, *args: Any) -> torch.fx.Node:
        return graph.call_function(fn, args)

    ap = op(aten.add.Tensor, hp, op(aten.mul.Tensor, p, damping))
    curvature = op(aten.dot.default, p, ap)
    alpha = op(aten.div.Tensor, rs, curvature)
    x_new = op(aten.add.Tensor, x, op(aten.mul.Tensor, p, alpha))
    r_new = op(aten.sub.Tensor, r, op(aten.mul.Tensor, ap, alpha))
    rs_new = op(aten.dot.default, r_new, r_new)
    p_new = op(aten.add.Tensor, r_new, op(aten.mul.Tensor, p, op(aten.div.Tensor, rs_new, rs)))
    graph.output((x_new, r_new, p_new, rs_new, curvature))
    module = torch.fx.GraphModule(hvp_module, graph)
    module.recompile()
    return module


def _primal_module(gm: torch.fx.GraphModule, kind: dict[torch.fx.Node, int], outputs: list[torch.fx.Node],
                   residuals: list[torch.fx.Node]) -> torch.fx.GraphModule:
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for node in gm.graph.nodes:
        if node.op != "output" and kind[node] == PRIMAL:
            env[node] = graph.node_copy(node, lambda a: env[a])
    graph.output(tuple(env[o] for o in outputs if kind[o] == PRIMAL) + tuple(env[r] for r in residuals))
    module = torch.fx.GraphModule(gm, graph)
    module.graph.eliminate_dead_code()
    module.recompile()
    return module


class _Handoff(threading.local):
    """What the compiled stage leaves for its caller (set by the runner on every call)."""

    parts: tuple[Any, ...] | None = None
    vectors: tuple[Tensor, Tensor] | None = None  # v, u of the call being traced
    compiled: bool = False  # the backend ran during this call


_HANDOFF = _Handoff()


def _backend(gm: torch.fx.GraphModule, example_inputs: list[Tensor]) -> Callable[..., Any]:
    """Dynamo backend: lower to ATen (aot_autograd), split by dependence, compile each part."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._inductor import compile as inductor_compile

    _HANDOFF.compiled = True
    assert _HANDOFF.vectors is not None
    v, u = _HANDOFF.vectors
    v_index = next(i for i, t in enumerate(example_inputs) if t is v)
    u_index = next(i for i, t in enumerate(example_inputs) if t is u)
    n_inputs = len(example_inputs)

    def forward_compiler(aten: torch.fx.GraphModule, inputs: list[Tensor]) -> Callable[..., Any]:
        placeholders = [n for n in aten.graph.nodes if n.op == "placeholder"]
        offset = len(placeholders) - n_inputs  # aot_autograd puts lifted parameters first
        vi, ui = offset + v_index, offset + u_index
        v_node, u_node = placeholders[vi], placeholders[ui]
        if tuple(inputs[vi].shape) != tuple(v.shape) or tuple(inputs[ui].shape) != tuple(u.shape):
            raise RuntimeError("could not identify the product vectors among the traced inputs")
        outputs = list(next(n for n in aten.graph.nodes if n.op == "output").args[0])
        kind = _dependence(aten.graph, v_node, u_node)
        hvp_module, hvp_residuals = _tangent_module(aten, kind, TANGENT_V, v_node, outputs)
        mixed_module, mixed_residuals = _tangent_module(aten, kind, TANGENT_U, u_node, outputs)
        primal_module = _primal_module(aten, kind, outputs, hvp_residuals + mixed_residuals)
        primal_inputs = [x for i, x in enumerate(inputs) if i not in (vi, ui)]
        n_primal_out = sum(1 for o in outputs if kind[o] == PRIMAL)
        n_hvp_res = len(hvp_residuals)
        primal = inductor_compile(primal_module, primal_inputs)
        fake = primal_module(*primal_inputs)  # fake tensors: the residuals' shapes and strides
        hvp_fake = fake[n_primal_out:n_primal_out + n_hvp_res]
        # The products run once per solver iteration, so their per-call checks of every input's
        # size and stride are dropped: the residuals come from the primal part above (fixed
        # layout) and the wrappers in compiled_stage check and make contiguous the vectors.
        fast = {"size_asserts": False, "alignment_asserts": False, "scalar_asserts": False}
        hvp = inductor_compile(hvp_module, [inputs[vi], *hvp_fake], options=fast)
        mixed = inductor_compile(mixed_module, [inputs[ui], *fake[n_primal_out + n_hvp_res:]], options=fast)
        vec, scalar = inputs[vi], inputs[vi].new_zeros(())
        step = inductor_compile(_cg_step_module(hvp_module), [vec, vec, vec, scalar, scalar, *hvp_fake],
                                options=fast)
        empties = [(tuple(o.meta["val"].shape), o.meta["val"].dtype) if kind[o] != PRIMAL else None for o in outputs]

        def run(args: list[Tensor]) -> list[Tensor]:
            device = args[vi].device
            values = primal(*[x for i, x in enumerate(args) if i not in (vi, ui)])
            args.clear()
            residuals = values[n_primal_out:]
            _HANDOFF.parts = (hvp, step, residuals[:n_hvp_res], mixed, residuals[n_hvp_res:])
            it = iter(values[:n_primal_out])
            # the products' own outputs are not computed here: the caller runs them directly
            return [next(it) if e is None else torch.empty(e[0], dtype=e[1], device=device) for e in empties]

        run._boxed_call = True  # type: ignore[attr-defined]
        return run

    return aot_autograd(fw_compiler=forward_compiler)(gm, example_inputs)


# ------------------------------------------------------------------------------- the cache

# per problem (BilevelProblem compares by its two losses, so a new instance over the same losses
# finds the entry): its own copy of the stage's code object (dynamo's cache and recompile limit
# are per code object, so problems do not evict each other), or the reason compilation failed.
# Least recently used first; the oldest entries are dropped beyond MAX_PROBLEMS.
_STAGES: OrderedDict[BilevelProblem, Callable[..., Any] | str] = OrderedDict()
MAX_PROBLEMS = 16


def _stage_for(problem: BilevelProblem) -> Callable[..., Any] | str:
    entry = _STAGES.get(problem)
    if entry is not None:
        _STAGES.move_to_end(problem)
    else:
        ok, detail = compiler_available()
        if not ok:
            entry = detail
        else:
            fn = types.FunctionType(_stage.__code__.replace(), _stage.__globals__, "_stage")
            entry = torch.compile(fn, backend=_backend, fullgraph=True, dynamic=False)
        _STAGES[problem] = entry
        while len(_STAGES) > MAX_PROBLEMS:
            _STAGES.popitem(last=False)
    return entry


def _fail(problem: BilevelProblem, reason: str) -> None:
    _STAGES[problem] = reason
    logger.warning("hypergrad: compiling the implicit products failed (%s); using the eager products "
                   "for this problem", reason)


def compiled_stage(problem: BilevelProblem, w: Tree, lam: Tree, inner_batch: Any = None,
                   outer_batch: Any = None) -> CompiledStage | None:
    r"""Run the compiled stage of ``problem`` at ``(w, lam)``; None where compilation is unavailable.

    Args:
        problem: the bilevel problem; its losses are traced once by :func:`torch.compile`.
        w, lam: the point (dicts of floating tensors; gradients are not tracked through them).
        inner_batch, outer_batch: the batches passed to the losses (their tensors are graph inputs;
            other values are guarded on).

    Returns:
        A :class:`CompiledStage`, or None when tracing or compiling failed now or before for this
        problem (logged once on the ``hypergrad`` logger): use the eager products then.

    Example:
        >>> import torch, hypergrad as hg
        >>> from hypergrad.compiled import compiled_stage
        >>> g = lambda w, lam, b: 0.5 * (torch.exp(lam["c"]) * w["x"] ** 2).sum()
        >>> f = lambda w, lam, b: w["x"].sum()
        >>> w = {"x": torch.ones(3, dtype=torch.float64)}
        >>> lam = {"c": torch.zeros(3, dtype=torch.float64)}
        >>> stage = compiled_stage(hg.BilevelProblem(g, f), w, lam)
        >>> stage is None or stage.hvp_flat(torch.ones(3, dtype=torch.float64)).tolist() == [1.0, 1.0, 1.0]
        True
    """
    fn = _stage_for(problem)
    if isinstance(fn, str):
        return None
    w_ = {k: x.detach() for k, x in w.items()}
    lam_ = {k: x.detach() for k, x in lam.items()}
    ref = next(iter(w_.values()))
    n_w = sum(x.numel() for x in w_.values())
    v = torch.zeros(n_w, dtype=ref.dtype, device=ref.device)
    u = torch.zeros(n_w, dtype=ref.dtype, device=ref.device)
    _HANDOFF.parts, _HANDOFF.vectors, _HANDOFF.compiled = None, (v, u), False
    start = time.perf_counter()
    try:
        f_value, g_value, grad_w_f, grad_lam_f, residual, _, _ = fn(problem, w_, lam_, inner_batch, outer_batch, v, u)
    except Exception as exc:
        _fail(problem, f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}")
        return None
    finally:
        _HANDOFF.vectors = None
    compile_s = time.perf_counter() - start if _HANDOFF.compiled else 0.0
    parts, _HANDOFF.parts = _HANDOFF.parts, None
    if parts is None:  # dynamo ran the stage eagerly (e.g. past its recompile limit)
        _fail(problem, "torch.compile ran the stage without the compiled graph (recompile limit?)")
        return None
    hvp, step, hvp_residuals, mixed, mixed_residuals = parts
    shape, dtype = v.shape, v.dtype

    def check(t: Tensor, what: str) -> Tensor:
        if t.shape != shape or t.dtype != dtype:
            raise ValueError(f"the compiled {what} takes a flat {dtype} vector of shape {tuple(shape)}, "
                             f"got {t.dtype} {tuple(t.shape)}")
        return t.contiguous()

    def hvp_flat(p: Tensor) -> Tensor:
        return hvp(check(p, "Hessian-vector product"), *hvp_residuals)[0]

    def cg_step(x: Tensor, r: Tensor, p: Tensor, rs: Tensor, damping: Tensor) -> tuple[Tensor, ...]:
        if rs.shape or damping.shape or rs.dtype != dtype or damping.dtype != dtype:
            raise ValueError(f"the compiled CG step takes rs and damping as 0-dim {dtype} tensors")
        vectors = (check(t, "CG step") for t in (x, r, p))
        return tuple(step(*vectors, rs, damping, *hvp_residuals))

    def mixed_product(q: Tensor) -> Tree:
        return _unflat(mixed(check(q, "mixed product"), *mixed_residuals)[0], lam_)

    return CompiledStage(f_value.detach(), g_value.detach(), grad_w_f, grad_lam_f, residual,
                         hvp_flat, mixed_product, cg_step, compile_s)
