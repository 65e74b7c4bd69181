r"""The tracing backend of the compiled hypergradient stages: trace the losses once, then run kernels.

A *stage* is the traceable function of one call of a method, with the method's arithmetic; it
lives in the method's own module, next to the eager call it reproduces
(:func:`hypergrad.implicit.products_stage`, and the stages behind
:func:`hypergrad.bome.compiled_bome`, :func:`hypergrad.penalty.compiled_penalty` and
:func:`hypergrad.stochastic.compiled_stochastic`). This module holds what the stages share: the
dynamo backends, the per-problem cache of compiled stages, the fallback to the eager call, and the
traceable helpers of every stage. A stage is declared with :func:`traced_stage` and run with
:func:`compiled_products` (the implicit products) or :func:`run_stage` (a whole call).

The eager products of :class:`~hypergrad.autodiff.RootSystem` are backward passes through a
retained graph: each one walks the autograd engine's node list (tens of microseconds per node on
small problems), although the arithmetic of a Hessian-vector product is often a few microseconds.
:func:`compiled_products` removes that overhead the way a tracing compiler does:

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

**Stochastic solvers.** ``SOBA``, ``SABA``, ``AmIGO`` and ``StocBiO`` with ``compile=True`` compile
their whole call the same way (:func:`hypergrad.stochastic.compiled_stochastic`); see
:doc:`/methods/stochastic`.

**First-order methods.** ``BOME(compile=True)`` and ``Penalty(compile=True)`` take no products
inside a call, so their stage is the whole call (:func:`hypergrad.bome.compiled_bome`,
:func:`hypergrad.penalty.compiled_penalty`, both through :func:`run_stage`):
the inner steps, the final gradients and the direction or estimate are traced and compiled by
inductor as one graph, the same cache, guards, fallback and ``info.extra`` fields as above. Per
call that is one guarded call of compiled code and one read-back of the floats of ``info``. On
benchmark_bilevel's averaged quadratic (d = 100, T = 10) a compiled BOME call took 0.46x the CPU
time of the benchmark's jitted JAX BOME iteration, the eager call 3.7x; a compiled F2SA call 0.11x
the eager one (``benchmarks/results/bome_overhead.md``).
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
import threading
import time
import types
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch import Tensor

from hypergrad.autodiff import inner_grads
from hypergrad.batches import StepBatches
from hypergrad.distributed import is_data_parallel, world_size
from hypergrad.problem import BilevelProblem, HypergradResult
from hypergrad.tree import Tree

__all__ = [
    "CompiledStage",
    "all_finite",
    "check_compilable",
    "compiled_products",
    "compiler_available",
    "eager_fallback",
    "grad_and_value",
    "non_finite_fallback",
    "replayable",
    "run_stage",
    "traced_stage",
    "unflatten_view",
]

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


def unflatten_view(v: Tensor, like: Tree) -> Tree:
    """The slices of the flat vector ``v`` as views shaped like the leaves of ``like`` (key order).

    Unlike :func:`hypergrad.tree.tree_unflatten` no dtype conversion is traced: the stages use it
    on vectors of ``like``'s dtype.

    Example:
        >>> import torch
        >>> tree = unflatten_view(torch.arange(5.0), {"a": torch.zeros(2), "b": torch.zeros(3)})
        >>> tree["a"].tolist(), tree["b"].tolist()
        ([0.0, 1.0], [2.0, 3.0, 4.0])
    """
    out, offset = {}, 0
    for k, x in like.items():
        out[k] = v[offset : offset + x.numel()].view(x.shape)
        offset += x.numel()
    return out


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
    ran: bool = False  # a first-order stage's compiled code ran during this call


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
        # layout) and the wrappers in compiled_products check and make contiguous the vectors.
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
# Keys are (stage key, problem): each method's stage has its own entries.
_STAGES: OrderedDict[tuple[str, BilevelProblem], Callable[..., Any] | str] = OrderedDict()
MAX_PROBLEMS = 16


def check_compilable(problem: BilevelProblem, what: str) -> None:
    """Refuse ``compile=True`` on a :func:`hypergrad.distributed.data_parallel` problem, in one line.

    :func:`torch.compile` cannot trace the all-reduce in the gradients of such a problem's losses
    (measured: the compiled stages returned a zero ``lam``-gradient on 2 ranks), so every method
    with ``compile=True`` refuses it before its first step; the eager call (``compile=False``)
    takes the same step on every rank. :func:`hypergrad.solve` checks it before the first outer
    step, each compiled call before it compiles.

    Args:
        problem: the problem.
        what: the combination refused, for the message (``"Implicit(compile=True)"``).

    Raises:
        ValueError: ``problem`` is data-parallel over several ranks.

    Example:
        >>> import hypergrad as hg
        >>> g = lambda w, lam, b: (w["x"] ** 2).sum()
        >>> check_compilable(hg.BilevelProblem(g, g), "SOBA(compile=True)")   # one process: nothing to refuse
    """
    if is_data_parallel(problem):
        raise ValueError(
            f"{what} under hypergrad.distributed.data_parallel ({world_size()} ranks) is not supported: "
            "torch.compile cannot trace the all-reduce of the ranks' gradients; use compile=False, which takes "
            "the same steps on every rank")


def _stage_for(problem: BilevelProblem, stage: Callable[..., Any], backend: Callable[..., Any],
               checks: tuple[Tree, Tree, Any] | None = None) -> Callable[..., Any] | str:
    name = _stage_key(stage)
    if name not in _STAGE_INFO:
        raise ValueError(f"stage must be a function declared with hypergrad.compiled.traced_stage, got {name}")
    check_compilable(problem, f"compile=True ({_STAGE_INFO[name][0]})")
    key = (name, problem)
    entry = _STAGES.get(key)
    if entry is not None:
        _STAGES.move_to_end(key)
    else:
        if checks is not None:
            # the traced gradients (torch.func) are zero where the eager ones are None: the checks every
            # eager method makes (an entry of w that g does not use, a g without lam) run here once
            w, lam, batch = checks
            inner_grads(problem, batch, w, lam, wrt_lam=True)
        ok, detail = compiler_available()
        if not ok:
            entry = detail
        else:
            fn = types.FunctionType(stage.__code__.replace(), stage.__globals__, stage.__name__)
            # SABA's batches carry their memory slot index, often a Python int: automatic dynamic
            # shapes make it symbolic after its first change instead of one graph per index
            dynamic = None if _STAGE_INFO[name][2] else False
            entry = torch.compile(fn, backend=backend, fullgraph=True, dynamic=dynamic)
        _STAGES[key] = entry
        while len(_STAGES) > MAX_PROBLEMS:
            _STAGES.popitem(last=False)
    return entry


# per stage (see _stage_key): what it compiles and what its eager fallback is called, for the log
# line, and whether it is traced with dynamo's automatic dynamic shapes; filled by traced_stage
_STAGE_INFO: dict[str, tuple[str, str, bool]] = {}
Stage = TypeVar("Stage", bound=Callable[..., Any])


def _stage_key(stage: Callable[..., Any]) -> str:
    return f"{stage.__module__}.{stage.__qualname__}"


def traced_stage(what: str, *, eager: str = "step", automatic_dynamic: bool = False) -> Callable[[Stage], Stage]:
    """Declare a function as a stage that :func:`compiled_products` or :func:`run_stage` may compile.

    Returns the function unchanged; the backend keeps, per stage, what the log line of a failed
    compilation names.

    Args:
        what: what the stage computes, for the log line (``"the SOBA step"``).
        eager: what the eager fallback is called in that line (``"step"``, ``"products"``).
        automatic_dynamic: trace with dynamo's automatic dynamic shapes (a Python ``int`` in the
            arguments, such as SABA's memory slot index, becomes symbolic after its first change
            instead of one graph per value); otherwise every shape and Python number is static.

    Example:
        >>> import torch
        >>> @traced_stage("a doubling")
        ... def double(problem, x):
        ...     return 2 * x
        >>> double(None, torch.ones(2)).tolist()
        [2.0, 2.0]
    """

    def register(stage: Stage) -> Stage:
        _STAGE_INFO[_stage_key(stage)] = (what, eager, automatic_dynamic)
        return stage

    return register


_NOT_COMPILED = "torch.compile ran the stage without the compiled graph (recompile limit?)"


def _reason(exc: Exception) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"


def _fail(problem: BilevelProblem, stage: Callable[..., Any], reason: str) -> None:
    _STAGES[(_stage_key(stage), problem)] = reason
    what, eager, _ = _STAGE_INFO[_stage_key(stage)]
    logger.warning("hypergrad: compiling %s failed (%s); using the eager %s for this problem", what, reason, eager)


def compiled_products(problem: BilevelProblem, stage: Callable[..., tuple[Any, ...]], w: Tree, lam: Tree,
                      inner_batch: Any = None, outer_batch: Any = None) -> CompiledStage | None:
    r"""Run the compiled products ``stage`` of ``problem`` at ``(w, lam)``; None where compilation is unavailable.

    Args:
        problem: the bilevel problem; its losses are traced once by :func:`torch.compile`.
        stage: the traced function, declared with :func:`traced_stage`:
            ``(problem, w, lam, inner_batch, outer_batch, v, u) -> (f, g, grad_w_f, grad_lam_f,
            residual, Hv, mixed)`` with flat vectors ``v`` (shaped like ``w``'s leaves
            concatenated) and ``u``, the product ``Hv`` flat like ``v`` and ``mixed`` flat like
            ``lam``, each product depending on its vector and on nothing of the other's
            (:func:`hypergrad.implicit.products_stage`).
        w, lam: the point (dicts of floating tensors; gradients are not tracked through them).
        inner_batch, outer_batch: the batches passed to the losses (their tensors are graph inputs;
            other values are guarded on).

    Returns:
        A :class:`CompiledStage`, or None when tracing or compiling failed now or before for this
        problem (logged once on the ``hypergrad`` logger): use the eager products then.

    Raises:
        ValueError: ``stage`` was not declared with :func:`traced_stage`.

    Example:
        >>> import torch, hypergrad as hg
        >>> from hypergrad.implicit import products_stage
        >>> g = lambda w, lam, b: 0.5 * (torch.exp(lam["c"]) * w["x"] ** 2).sum()
        >>> f = lambda w, lam, b: w["x"].sum()
        >>> w = {"x": torch.ones(3, dtype=torch.float64)}
        >>> lam = {"c": torch.zeros(3, dtype=torch.float64)}
        >>> stage = compiled_products(hg.BilevelProblem(g, f), products_stage, w, lam)
        >>> stage is None or stage.hvp_flat(torch.ones(3, dtype=torch.float64)).tolist() == [1.0, 1.0, 1.0]
        True
    """
    fn = _stage_for(problem, stage, _backend, (w, lam, inner_batch))
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
        _fail(problem, stage, _reason(exc))
        return None
    finally:
        _HANDOFF.vectors = None
    compile_s = time.perf_counter() - start if _HANDOFF.compiled else 0.0
    parts, _HANDOFF.parts = _HANDOFF.parts, None
    if parts is None:  # dynamo ran the stage eagerly (e.g. past its recompile limit)
        _fail(problem, stage, _NOT_COMPILED)
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
        return unflatten_view(mixed(check(q, "mixed product"), *mixed_residuals)[0], lam_)

    return CompiledStage(f_value.detach(), g_value.detach(), grad_w_f, grad_lam_f, residual,
                         hvp_flat, mixed_product, cg_step, compile_s)


# ------------------------------------------------------------------ whole-call stages
#
# BOME, F2SA (Penalty) and the stochastic solvers take no products inside a call: one call is a
# fixed sequence of gradient evaluations and optimizer steps. Their stage is that whole call,
# traced once and compiled by inductor as one graph; a call is then one guarded call of compiled
# code (no autograd engine, no Python per operator), the floats of ``info`` read back in one
# transfer.


def _first_order_backend(gm: torch.fx.GraphModule, example_inputs: list[Tensor]) -> Callable[..., Any]:
    """Dynamo backend: inductor, marking in ``_HANDOFF`` that it compiled and that its code ran."""
    from torch._inductor.compile_fx import compile_fx

    _HANDOFF.compiled = True
    compiled = compile_fx(gm, example_inputs)

    def run(*args: Any) -> Any:
        _HANDOFF.ran = True
        return compiled(*args)

    return run


def grad_and_value(loss: Callable[[Tree, Tree], Tensor], w: Tree, lam: Tree, argnums: int | tuple[int, ...]) -> Any:
    """``torch.func.grad_and_value`` of ``loss(w, lam)`` with respect to ``argnums`` (traceable).

    Example:
        >>> import torch
        >>> (gw, gl), value = grad_and_value(lambda w, l: (w["x"] * l["c"]).sum(),
        ...                                  {"x": torch.ones(2)}, {"c": torch.full((2,), 3.0)}, (0, 1))
        >>> gw["x"].tolist(), gl["c"].tolist(), value.item()
        ([3.0, 3.0], [1.0, 1.0], 6.0)
    """
    return torch.func.grad_and_value(loss, argnums=argnums)(w, lam)


def all_finite(values: list[Tensor], trees: list[Tree]) -> Tensor:
    """Whether every value and every leaf of every tree is finite, as a 0-dim bool tensor (traceable).

    Example:
        >>> import torch
        >>> all_finite([torch.tensor(1.0)], [{"x": torch.tensor([0.0, float("nan")])}]).item()
        False
    """
    flags = [torch.isfinite(torch.stack(values)).all()]
    flags += [torch.isfinite(x).all() for tree in trees for x in tree.values()]
    return torch.stack(flags).all()


class _Replay:
    """An iterable over ``source`` that replays what it drew: the eager path re-reads the batches
    the compiled path drew (a stream is consumed once per call whichever path runs)."""

    def __init__(self, source: Any) -> None:
        self._source = iter(source)
        self._drawn: list[Any] = []

    def __iter__(self) -> Any:
        index = 0
        while True:
            if index == len(self._drawn):
                try:
                    self._drawn.append(next(self._source))
                except StopIteration:
                    return
            yield self._drawn[index]
            index += 1


def replayable(batch: Any) -> Any:
    """``batch``, or for a :class:`~hypergrad.batches.StepBatches` one that replays what it drew.

    A compiled call that falls back to the eager call re-reads the batches the compiled path
    drew: a stream is consumed once per call whichever path runs.

    Example:
        >>> from hypergrad.batches import StepBatches
        >>> batches = replayable(StepBatches(iter([1, 2, 3])))
        >>> list(zip(range(2), batches.batches)), list(zip(range(3), batches.batches))
        ([(0, 1), (1, 2)], [(0, 1), (1, 2), (2, 3)])
    """
    return StepBatches(_Replay(batch.batches)) if isinstance(batch, StepBatches) else batch


def run_stage(problem: BilevelProblem, stage: Callable[..., Any], *args: Any,
              checks: tuple[Tree, Tree, Any] | None = None) -> tuple[Any, float] | None:
    """The compiled ``stage`` on ``(problem, *args)``, and the seconds it spent compiling; None: use eager.

    ``stage`` is declared with :func:`traced_stage`; it is compiled once per problem (and per
    shape, dtype and guarded value of ``args``) by inductor as one graph. None where compilation
    is unavailable or failed, now or before for this problem (logged once on the ``hypergrad``
    logger). ``checks``: ``(w, lam, inner_batch)`` at which, before the first compilation for this
    problem, one eager inner gradient makes the checks of the eager methods
    (:func:`hypergrad.autodiff.inner_grads`): traced gradients cannot see an unused input.

    Raises:
        ValueError: ``stage`` was not declared with :func:`traced_stage`; a
            :func:`~hypergrad.distributed.data_parallel` problem (:func:`check_compilable`); an
            entry of ``w`` that ``g`` does not use (with ``checks``).

    Example:
        >>> import torch, hypergrad as hg
        >>> @traced_stage("a scaled gradient")
        ... def scaled_gradient(problem, w, lam):
        ...     return grad_and_value(lambda w_, l_: problem.inner_loss(w_, l_, None), w, lam, 0)[0]
        >>> problem = hg.BilevelProblem(lambda w, lam, b: (lam["c"] * w["x"] ** 2).sum(), lambda w, lam, b: w["x"].sum())
        >>> ran = run_stage(problem, scaled_gradient, {"x": torch.ones(2)}, {"c": torch.full((2,), 2.0)})
        >>> ran is None or ran[0]["x"].tolist() == [4.0, 4.0]
        True
    """
    fn = _stage_for(problem, stage, _first_order_backend, checks)
    if isinstance(fn, str):
        return None
    _HANDOFF.compiled = _HANDOFF.ran = False
    start = time.perf_counter()
    try:
        out = fn(problem, *args)
    except Exception as exc:
        _fail(problem, stage, _reason(exc))
        return None
    if not _HANDOFF.ran:  # dynamo ran the stage eagerly (e.g. past its recompile limit)
        _fail(problem, stage, _NOT_COMPILED)
        return None
    return out, time.perf_counter() - start if _HANDOFF.compiled else 0.0


def eager_fallback(method: Any, problem: BilevelProblem, args: tuple[Any, ...]) -> HypergradResult:
    """The method's eager call on ``args``, with ``info.extra`` saying that it ran eagerly.

    ``method`` is a dataclass with a ``compile`` field; ``args`` are the arguments of its
    ``hypergrad`` after ``problem``.

    Example:
        >>> import torch, hypergrad as hg
        >>> g = lambda w, lam, b: 0.5 * ((w["x"] - lam["c"]) ** 2).sum()
        >>> f = lambda w, lam, b: 0.5 * (w["x"] ** 2).sum()
        >>> w, lam = {"x": torch.zeros(1)}, {"c": torch.ones(1)}
        >>> result = eager_fallback(hg.SOBA(step_size=0.5, compile=True), hg.BilevelProblem(g, f), (w, lam))
        >>> result.info.extra["compiled"], result.info.extra["compile_s"]
        (False, 0.0)
    """
    result = dataclasses.replace(method, compile=False).hypergrad(problem, *args)
    result.info.extra.update(compiled=False, compile_s=0.0)
    return result


def non_finite_fallback(method: Any, problem: BilevelProblem, args: tuple[Any, ...]) -> HypergradResult:
    """A non-finite value in the compiled call: the eager call, which raises with its own diagnostic.

    Where the eager call finds its values finite after all, its result is returned with a warning
    on the ``hypergrad`` logger.

    Example:
        >>> import torch, hypergrad as hg
        >>> g = lambda w, lam, b: 0.5 * ((w["x"] - lam["c"]) ** 2).sum()
        >>> f = lambda w, lam, b: 0.5 * (w["x"] ** 2).sum()
        >>> w, lam = {"x": torch.zeros(1)}, {"c": torch.tensor([float("nan")])}
        >>> non_finite_fallback(hg.SOBA(step_size=0.5, compile=True), hg.BilevelProblem(g, f), (w, lam))  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        hypergrad.errors.NonFiniteError: ...
    """
    result = eager_fallback(method, problem, args)
    logger.warning("hypergrad: the compiled %s step gave non-finite values where the eager step did not; "
                   "returning the eager result", type(method).__name__)
    return result
