r"""Compiled hypergradient stages (implicit products, BOME, F2SA, stochastic solvers): trace the losses once, then run kernels.

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

**Stochastic solvers.** ``SOBA``, ``SABA``, ``AmIGO`` and ``StocBiO`` with ``compile=True`` compile
their whole call the same way (:func:`compiled_stochastic`); see :doc:`/methods/stochastic`.

**First-order methods.** ``BOME(compile=True)`` and ``Penalty(compile=True)`` take no products
inside a call, so their stage is the whole call (:func:`compiled_bome`, :func:`compiled_penalty`):
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
from typing import Any

import torch
from torch import Tensor

from hypergrad.batches import StepBatches, per_step
from hypergrad.problem import BilevelProblem, HypergradInfo, HypergradResult
from hypergrad.stochastic import OracleCounts, linear_iterate, one_batch, step_counter, step_size_at
from hypergrad.tree import (
    Tree,
    check_like,
    check_tree,
    tree_add,
    tree_axpy,
    tree_detach,
    tree_dot,
    tree_norm,
    tree_scale,
    tree_sub,
)

__all__ = [
    "CompiledStage",
    "compiled_bome",
    "compiled_penalty",
    "compiled_stage",
    "compiled_stochastic",
    "compiler_available",
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
# Keys are (stage name, problem): each method's stage has its own entries.
_STAGES: OrderedDict[tuple[str, BilevelProblem], Callable[..., Any] | str] = OrderedDict()
MAX_PROBLEMS = 16


def _stage_for(problem: BilevelProblem, stage: Callable[..., Any], backend: Callable[..., Any]) -> Callable[..., Any] | str:
    key = (stage.__name__, problem)
    entry = _STAGES.get(key)
    if entry is not None:
        _STAGES.move_to_end(key)
    else:
        ok, detail = compiler_available()
        if not ok:
            entry = detail
        else:
            fn = types.FunctionType(stage.__code__.replace(), stage.__globals__, stage.__name__)
            # SABA's batches carry their memory slot index, often a Python int: automatic dynamic
            # shapes make it symbolic after its first change instead of one graph per index
            dynamic = None if stage.__name__ in _AUTOMATIC_DYNAMIC else False
            entry = torch.compile(fn, backend=backend, fullgraph=True, dynamic=dynamic)
        _STAGES[key] = entry
        while len(_STAGES) > MAX_PROBLEMS:
            _STAGES.popitem(last=False)
    return entry


# what each stage compiles, and what its eager fallback is called, for the log line
_FALLBACK = {"_stage": ("the implicit products", "products"), "_bome_stage": ("the BOME step", "step"),
             "_penalty_stage": ("the F2SA step", "step"), "_soba_stage": ("the SOBA step", "step"),
             "_saba_stage": ("the SABA step", "step"), "_amigo_stage": ("the AmIGO step", "step"),
             "_stocbio_stage": ("the StocBiO step", "step")}
_AUTOMATIC_DYNAMIC = {"_saba_stage"}
_NOT_COMPILED = "torch.compile ran the stage without the compiled graph (recompile limit?)"


def _reason(exc: Exception) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"


def _fail(problem: BilevelProblem, stage: Callable[..., Any], reason: str) -> None:
    _STAGES[(stage.__name__, problem)] = reason
    what, eager = _FALLBACK[stage.__name__]
    logger.warning("hypergrad: compiling %s failed (%s); using the eager %s for this problem", what, reason, eager)


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
    fn = _stage_for(problem, _stage, _backend)
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
        _fail(problem, _stage, _reason(exc))
        return None
    finally:
        _HANDOFF.vectors = None
    compile_s = time.perf_counter() - start if _HANDOFF.compiled else 0.0
    parts, _HANDOFF.parts = _HANDOFF.parts, None
    if parts is None:  # dynamo ran the stage eagerly (e.g. past its recompile limit)
        _fail(problem, _stage, _NOT_COMPILED)
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


# ------------------------------------------------------------------ first-order methods
#
# BOME and F2SA (Penalty) take no products inside a call: one call is a fixed sequence of
# gradient evaluations and optimizer steps. Their stage is that whole call, traced once and
# compiled by inductor as one graph; a call is then one guarded call of compiled code (no autograd
# engine, no Python per operator), the floats of ``info`` read back in one transfer.


def _first_order_backend(gm: torch.fx.GraphModule, example_inputs: list[Tensor]) -> Callable[..., Any]:
    """Dynamo backend: inductor, marking in ``_HANDOFF`` that it compiled and that its code ran."""
    from torch._inductor.compile_fx import compile_fx

    _HANDOFF.compiled = True
    compiled = compile_fx(gm, example_inputs)

    def run(*args: Any) -> Any:
        _HANDOFF.ran = True
        return compiled(*args)

    return run


def _grad_and_value(loss: Callable[[Tree, Tree], Tensor], w: Tree, lam: Tree, argnums: int | tuple[int, ...]) -> Any:
    return torch.func.grad_and_value(loss, argnums=argnums)(w, lam)


def _all_finite(values: list[Tensor], trees: list[Tree]) -> Tensor:
    flags = [torch.isfinite(torch.stack(values)).all()]
    flags += [torch.isfinite(x).all() for tree in trees for x in tree.values()]
    return torch.stack(flags).all()


def _bome_stage(problem: BilevelProblem, method: Any, w: Tree, lam: Tree, step_batches: list[Any],
                gap_batch: Any, outer_batch: Any, w_opt_state: Tree | None) -> tuple[Any, ...]:
    """One call of :meth:`hypergrad.bome.BOME.hypergrad` as a traceable function (same arithmetic)."""
    opt = method.inner_optimizer

    def inner(batch: Any) -> Callable[[Tree, Tree], Tensor]:
        return lambda w_, l_: problem.inner_loss(w_, l_, batch)

    (grad_w_g, grad_lam_g), g_w = _grad_and_value(inner(step_batches[0]), w, lam, (0, 1))
    losses = [g_w]
    w_hat, opt_state = opt.update(w, grad_w_g, opt.init(w))
    for batch in step_batches[1:]:
        grad_w, value = _grad_and_value(inner(batch), w_hat, lam, 0)
        losses.append(value)
        w_hat, opt_state = opt.update(w_hat, grad_w, opt_state)
    grad_lam_g_hat, g_hat = _grad_and_value(inner(gap_batch), w_hat, lam, 1)
    (grad_w_f, grad_lam_f), f_value = _grad_and_value(
        lambda w_, l_: problem.outer_loss(w_, l_, outer_batch), w, lam, (0, 1))
    q = g_w - g_hat
    grad_lam_q = tree_sub(grad_lam_g, grad_lam_g_hat)
    sq_norm = tree_dot(grad_w_g, grad_w_g) + tree_dot(grad_lam_q, grad_lam_q)
    dot = tree_dot(grad_w_f, grad_w_g) + tree_dot(grad_lam_f, grad_lam_q)
    target = method.eta * q if method.barrier == "value" else method.eta * sq_norm
    # bome_phi: max((target - dot) / |grad q|^2, 0), and 0 where grad q = 0
    phi = torch.where(sq_norm > 0, torch.clamp_min((target - dot) / sq_norm, 0.0), torch.zeros_like(sq_norm))
    d_w = tree_axpy(phi, grad_w_g, grad_w_f)
    d_lam = tree_axpy(phi, grad_lam_q, grad_lam_f)
    if method.w_optimizer is None:
        new_w, w_opt_state = tree_axpy(-float(method.w_lr), d_w, w), None
    else:
        new_w, w_opt_state = method.w_optimizer.update(w, d_w, w_opt_state)
    finite = _all_finite([*losses, g_hat, f_value], [w_hat, d_lam, d_w])
    return d_lam, new_w, w_opt_state, torch.stack([q, sq_norm, phi, finite.to(q.dtype)])


def _penalty_stage(problem: BilevelProblem, method: Any, w: Tree, w_sigma: Tree, lam: Tree,
                   inner_batches: list[Any], outer_batches: list[Any], opt_state: Tree,
                   sigma_opt_state: Tree) -> tuple[Any, ...]:
    """One call of :meth:`hypergrad.penalty.Penalty.hypergrad` as a traceable function."""
    opt = method.inner_optimizer
    sigma_opt = method.sigma_optimizer if method.sigma_optimizer is not None else opt
    sigma = float(method.sigma)
    current = method.evaluate == "current"
    losses: list[Tensor] = []
    n_evals = len(inner_batches)
    for t, (inner_batch, outer_batch) in enumerate(zip(inner_batches, outer_batches, strict=True)):
        def g(w_: Tree, l_: Tree, b: Any = inner_batch) -> Tensor:
            return problem.inner_loss(w_, l_, b)

        def penalised(w_: Tree, l_: Tree, b: Any = inner_batch, ob: Any = outer_batch) -> Tensor:
            return problem.inner_loss(w_, l_, b) + sigma * problem.outer_loss(w_, l_, ob)

        if t == n_evals - 1:  # the estimate's evaluation: lam-gradients too
            (gw, grad_lam_g), g_value = _grad_and_value(g, w, lam, (0, 1))
            (gws, grad_lam_pen), pen_value = _grad_and_value(penalised, w_sigma, lam, (0, 1))
            losses += [g_value, pen_value]
            residuals = [tree_norm(gw), tree_norm(gws), tree_norm(tree_sub(w_sigma, w))]
            if not current:
                break
        else:
            gw, g_value = _grad_and_value(g, w, lam, 0)
            gws, pen_value = _grad_and_value(penalised, w_sigma, lam, 0)
            losses += [g_value, pen_value]
        w, opt_state = opt.update(w, gw, opt_state)
        w_sigma, sigma_opt_state = sigma_opt.update(w_sigma, gws, sigma_opt_state)
    grad = tree_scale(tree_sub(grad_lam_pen, grad_lam_g), 1.0 / sigma)
    finite = _all_finite(losses, [w_sigma, grad])
    scalars = torch.stack([*residuals, finite.to(residuals[0].dtype)])
    return grad, w, w_sigma, opt_state, sigma_opt_state, scalars


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


def _replayable(batch: Any) -> Any:
    return StepBatches(_Replay(batch.batches)) if isinstance(batch, StepBatches) else batch


def _run_stage(problem: BilevelProblem, stage: Callable[..., Any], *args: Any) -> tuple[Any, float] | None:
    """The compiled ``stage`` on ``args``, and the seconds it spent compiling; None: use eager."""
    fn = _stage_for(problem, stage, _first_order_backend)
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


def _eager(method: Any, problem: BilevelProblem, args: tuple[Any, ...]) -> HypergradResult:
    """The method's eager call, with ``info.extra`` saying that it ran eagerly."""
    result = dataclasses.replace(method, compile=False).hypergrad(problem, *args)
    result.info.extra.update(compiled=False, compile_s=0.0)
    return result


def _non_finite(method: Any, problem: BilevelProblem, args: tuple[Any, ...]) -> HypergradResult:
    """A non-finite value in the compiled call: the eager call raises with its own diagnostic."""
    result = _eager(method, problem, args)
    logger.warning("hypergrad: the compiled %s step gave non-finite values where the eager step did not; "
                   "returning the eager result", type(method).__name__)
    return result


def compiled_bome(method: Any, problem: BilevelProblem, w: Tree, lam: Tree, inner_batch: Any = None,
                  outer_batch: Any = None, state: dict[str, Any] | None = None) -> HypergradResult:
    r"""``method.hypergrad(...)`` of a :class:`~hypergrad.bome.BOME` from its compiled step.

    Called by ``BOME(compile=True).hypergrad``: the ``T`` inner steps on :math:`g`, the
    value-function gap and the joint direction run as one compiled graph (any inner optimizer and
    ``w_optimizer`` of :mod:`hypergrad.inner`). Compiles once per problem, shape, dtype and
    method configuration; new values of ``w``, ``lam``, the state and the batch tensors are read
    afresh. With a :class:`~hypergrad.batches.StepBatches` inner batch, inner step ``t`` uses the
    ``t``-th batch, and the gap :math:`g(w) - g(\hat w_T)` is taken on the first; one outer batch
    is drawn from a ``StepBatches`` outer batch. Falls back to
    the eager call (logged once per problem) where compilation fails; a non-finite value reruns
    the eager call, which raises its :class:`~hypergrad.errors.NonFiniteError`.

    Returns:
        The eager call's result (same fields and counts) with ``info.extra["compiled"]`` (which
        path ran) and ``info.extra["compile_s"]`` (seconds this call spent compiling).

    Example:
        >>> import torch, hypergrad as hg
        >>> g = lambda w, lam, b: 0.5 * ((w["x"] - lam["c"]) ** 2).sum()
        >>> f = lambda w, lam, b: 0.5 * ((w["x"] - 3.0) ** 2).sum()
        >>> bome = hg.BOME(hg.inner.SGD(lr=0.5), w_lr=0.1, inner_steps=3, compile=True)
        >>> w, lam = {"x": torch.zeros(2, dtype=torch.float64)}, {"c": torch.ones(2, dtype=torch.float64)}
        >>> r = compiled_bome(bome, hg.BilevelProblem(g, f), w, lam)
        >>> r.grad["c"].tolist() == bome.hypergrad(hg.BilevelProblem(g, f), w, lam).grad["c"].tolist()
        True
    """
    inner_batch, outer_batch = _replayable(inner_batch), _replayable(outer_batch)
    args = (w, lam, inner_batch, outer_batch, state)
    w, lam = problem.validate(w, lam)
    w, lam = tree_detach(w), tree_detach(lam)
    w_opt_state = None
    if method.w_optimizer is not None:
        w_opt_state = (state or {}).get("w_opt_state") or method.w_optimizer.init(w)
    batches = per_step(inner_batch, method.inner_steps)
    (outer_batch,) = per_step(outer_batch, 1)  # one outer batch per call, as in the eager call
    ran = _run_stage(problem, _bome_stage, method, w, lam, batches, batches[0], outer_batch, w_opt_state)
    if ran is None:
        return _eager(method, problem, args)
    (d_lam, new_w, w_opt_state, scalars), compile_s = ran
    q, sq_norm, phi, finite = scalars.tolist()
    if not finite:
        return _non_finite(method, problem, args)
    info = HypergradInfo(
        iterations=method.inner_steps,
        residual=sq_norm**0.5,
        converged=q <= float(method.tol),
        grad_evals=method.inner_steps + 2,
        extra={"phi": phi, "q": q, "grad_q_norm": sq_norm**0.5, "compiled": True, "compile_s": compile_s},
    )
    new_state = None if w_opt_state is None else {"w_opt_state": w_opt_state}
    return HypergradResult(d_lam, new_w, info, new_state)


def compiled_penalty(method: Any, problem: BilevelProblem, w: Tree, lam: Tree, inner_batch: Any = None,
                     outer_batch: Any = None, state: dict[str, Any] | None = None) -> HypergradResult:
    r"""``method.hypergrad(...)`` of a :class:`~hypergrad.penalty.Penalty` (F2SA) from its compiled step.

    Called by ``Penalty(compile=True).hypergrad``: the steps on :math:`g` and
    :math:`g + \sigma f` and the estimate run as one compiled graph (any optimizers of
    :mod:`hypergrad.inner`; their states are carried in ``state`` as in the eager call). With
    :class:`~hypergrad.batches.StepBatches`, evaluation ``t`` uses the ``t``-th inner (and outer)
    batch. Compilation, fallback and non-finite values as in :func:`compiled_bome`.

    Returns:
        The eager call's result (same fields, state and counts) with ``info.extra["compiled"]``
        and ``info.extra["compile_s"]``.

    Example:
        >>> import torch, hypergrad as hg
        >>> g = lambda w, lam, b: 0.5 * ((w["x"] - lam["c"]) ** 2).sum()
        >>> f = lambda w, lam, b: 0.5 * (w["x"] ** 2).sum()
        >>> f2sa = hg.Penalty(sigma=1e-3, inner_optimizer=hg.inner.SGD(lr=0.5), inner_steps=3, compile=True)
        >>> w, lam = {"x": torch.zeros(2, dtype=torch.float64)}, {"c": torch.ones(2, dtype=torch.float64)}
        >>> r = compiled_penalty(f2sa, hg.BilevelProblem(g, f), w, lam)
        >>> sorted(r.state), r.info.extra["compiled"] in (True, False)
        (['opt_state', 'sigma_opt_state', 'w', 'w_sigma'], True)
    """
    inner_batch, outer_batch = _replayable(inner_batch), _replayable(outer_batch)
    args = (w, lam, inner_batch, outer_batch, state)
    w, lam = problem.validate(w, lam)
    w, lam = tree_detach(w), tree_detach(lam)
    opt = method.inner_optimizer
    sigma_opt = method.sigma_optimizer if method.sigma_optimizer is not None else opt
    if state is not None and state.get("w_sigma") is not None:
        w_sigma = check_tree(state["w_sigma"], "state['w_sigma']")
        check_like(w_sigma, w, "state['w_sigma']", "w")
        w_sigma = tree_detach(w_sigma)
    else:
        w_sigma = {k: v.clone() for k, v in w.items()}
    opt_state = state.get("opt_state") if state else None
    sigma_opt_state = state.get("sigma_opt_state") if state else None
    opt_state = opt.init(w) if opt_state is None else opt_state
    sigma_opt_state = sigma_opt.init(w_sigma) if sigma_opt_state is None else sigma_opt_state
    n_evals = method.inner_steps if method.evaluate == "current" else method.inner_steps + 1
    ran = _run_stage(problem, _penalty_stage, method, w, w_sigma, lam, per_step(inner_batch, n_evals),
                     per_step(outer_batch, n_evals), opt_state, sigma_opt_state)
    if ran is None:
        return _eager(method, problem, args)
    (grad, w, w_sigma, opt_state, sigma_opt_state, scalars), compile_s = ran
    inner_residual, sigma_residual, gap, finite = scalars.tolist()
    if not finite:
        return _non_finite(method, problem, args)
    tol = float(method.tol)
    info = HypergradInfo(
        iterations=method.inner_steps,
        residual=inner_residual,
        converged=inner_residual <= tol and sigma_residual <= tol,
        grad_evals=3 * n_evals,
        extra={"sigma": float(method.sigma), "inner_residual": inner_residual, "sigma_residual": sigma_residual,
               "gap": gap, "evaluate": method.evaluate, "compiled": True, "compile_s": compile_s},
    )
    new_state = {"w": w, "w_sigma": w_sigma, "opt_state": opt_state, "sigma_opt_state": sigma_opt_state}
    return HypergradResult(grad, w, info, new_state)


# ------------------------------------------------------------------ stochastic solvers
#
# SOBA, SABA, AmIGO and StocBiO: one call is a fixed sequence of batch gradients and products
# (no solver loop with a tolerance), so, as for BOME, the whole call is the stage. What changes
# from call to call is data, never code: the iterates, the step sizes of the schedules (0-dim
# tensors, not Python floats, which dynamo would bake into the graph), SABA's stored oracle
# values of the batch's memory slot (the slot index stays in Python) and every drawn batch's
# tensors (graph inputs).


def _inner_products(problem: BilevelProblem, w: Tree, lam: Tree, batch: Any,
                    v: Tree) -> tuple[Tree, Tree, Tree, Tensor]:
    r""":math:`\nabla_w g`, :math:`\nabla^2_{ww} g\, v`, :math:`\nabla^2_{\lambda w} g\, v` and :math:`g` of one batch."""
    def grad_w_g(w_: Tree, l_: Tree) -> tuple[Tree, Tensor]:
        return torch.func.grad_and_value(lambda t: problem.inner_loss(t, l_, batch))(w_)

    grad, products, value = torch.func.vjp(grad_w_g, w, lam, has_aux=True)
    hv, cross = products(v)  # both products in one reverse pass, as the eager oracle
    return grad, hv, cross, value


def _hessian_product(problem: BilevelProblem, w: Tree, lam: Tree, batch: Any) -> Callable[[Tree], Tree]:
    """``v -> H v`` of one batch at ``w`` (the gradient's graph traced once, reused per product).

    Neither the gradient nor the loss is an output, so the compiled graph computes only what the
    product needs (a loss value would cost a full forward pass per product); non-finite losses
    still surface in the products and in the checked loss values of the mixed product."""
    _, hvp = torch.func.vjp(torch.func.grad(lambda t: problem.inner_loss(t, lam, batch)), w)
    return lambda v: hvp(v)[0]


def _cross_product(problem: BilevelProblem, w: Tree, lam: Tree, batch: Any, v: Tree) -> tuple[Tree, Tensor]:
    _, cross, value = torch.func.vjp(
        lambda l_: torch.func.grad_and_value(lambda t: problem.inner_loss(t, l_, batch))(w), lam, has_aux=True)
    return cross(v)[0], value


def _outer_grads(problem: BilevelProblem, w: Tree, lam: Tree, batch: Any) -> tuple[Tree, Tree, Tensor]:
    (grad_w, grad_lam), value = _grad_and_value(lambda w_, l_: problem.outer_loss(w_, l_, batch), w, lam, (0, 1))
    return grad_w, grad_lam, value


def _soba_stage(problem: BilevelProblem, w: Tree, lam: Tree, v: Tree, rho: Tensor, inner_batch: Any,
                outer_batch: Any) -> tuple[Any, ...]:
    """One call of :meth:`hypergrad.soba.SOBA.hypergrad` as a traceable function (same arithmetic)."""
    grad, hv, cross, g_value = _inner_products(problem, w, lam, inner_batch, v)
    grad_w_f, grad_lam_f, f_value = _outer_grads(problem, w, lam, outer_batch)
    d_v = tree_sub(hv, grad_w_f)
    d_lam = tree_sub(grad_lam_f, cross)
    new_w, new_v = tree_axpy(-rho, grad, w), tree_axpy(-rho, d_v, v)
    finite = _all_finite([g_value, f_value], [grad, hv, cross, grad_w_f, grad_lam_f, d_lam, new_w, new_v])
    return d_lam, new_w, new_v, torch.stack([tree_norm(grad), tree_norm(d_v), finite.to(rho.dtype)])


def _saga_estimate(fresh: dict[str, Tree], stored: dict[str, Tree], mean: dict[str, Tree],
                   inv_n: float) -> tuple[dict[str, Tree], dict[str, Tree]]:
    """SAGA estimates and updated means; ``stored`` is zeros for a slot never visited (exact)."""
    estimate, new_mean = {}, {}
    for name, value in fresh.items():
        change = tree_sub(value, stored[name])
        estimate[name] = tree_axpy(1.0, change, mean[name])
        new_mean[name] = tree_axpy(inv_n, change, mean[name])
    return estimate, new_mean


def _saba_stage(problem: BilevelProblem, w: Tree, lam: Tree, v: Tree, rho: Tensor, inner_batch: Any,
                outer_batch: Any, stored_inner: dict[str, Tree], inner_mean: dict[str, Tree],
                stored_outer: dict[str, Tree], outer_mean: dict[str, Tree], inv_n_inner: float,
                inv_n_outer: float) -> tuple[Any, ...]:
    """One call of :meth:`hypergrad.saba.SABA.hypergrad` as a traceable function (same arithmetic)."""
    grad, hv, cross, g_value = _inner_products(problem, w, lam, inner_batch, v)
    grad_w_f, grad_lam_f, f_value = _outer_grads(problem, w, lam, outer_batch)
    fresh_inner = {"grad": grad, "hvp": hv, "cross": cross}
    fresh_outer = {"grad_w": grad_w_f, "grad_lam": grad_lam_f}
    est_inner, new_inner_mean = _saga_estimate(fresh_inner, stored_inner, inner_mean, inv_n_inner)
    est_outer, new_outer_mean = _saga_estimate(fresh_outer, stored_outer, outer_mean, inv_n_outer)
    d_v = tree_sub(est_inner["hvp"], est_outer["grad_w"])
    d_lam = tree_sub(est_outer["grad_lam"], est_inner["cross"])
    new_w, new_v = tree_axpy(-rho, est_inner["grad"], w), tree_axpy(-rho, d_v, v)
    finite = _all_finite([g_value, f_value], [grad, hv, cross, grad_w_f, grad_lam_f, d_lam, new_w, new_v])
    scalars = torch.stack([tree_norm(est_inner["grad"]), tree_norm(d_v), finite.to(rho.dtype)])
    return d_lam, new_w, new_v, fresh_inner, fresh_outer, new_inner_mean, new_outer_mean, scalars


def _inner_sgd(problem: BilevelProblem, w: Tree, lam: Tree, rho: Tensor, batches: list[Any]) -> tuple[Tree, Tensor]:
    """The inner SGD steps of AmIGO and StocBiO; the last gradient norm (0 without steps). No loss
    values: only the gradients (the steps' outputs are checked for non-finite values)."""
    residual = torch.zeros_like(rho)
    for batch in batches:
        grad = torch.func.grad(lambda t, b=batch: problem.inner_loss(t, lam, b))(w)
        residual = tree_norm(grad)
        w = tree_axpy(-rho, grad, w)
    return w, residual


def _hessian_products(problem: BilevelProblem, w: Tree, lam: Tree, batches: list[Any],
                      shared: bool) -> list[Callable[[Tree], Tree]]:
    """One product per batch; one shared product where the call reuses one batch (as the eager
    :func:`hypergrad.stochastic.hessian_products`)."""
    products: list[Callable[[Tree], Tree]] = []
    for batch in batches[:1] if shared else batches:
        products.append(_hessian_product(problem, w, lam, batch))
    return products * len(batches) if shared else products


def _amigo_stage(problem: BilevelProblem, w: Tree, lam: Tree, v: Tree, rho: Tensor, eta: Tensor,
                 batches: list[Any], outer_batch: Any, shared: bool, inner_steps: int) -> tuple[Any, ...]:
    """One call of :meth:`hypergrad.amigo.AmIGO.hypergrad` as a traceable function (same arithmetic)."""
    w, inner_residual = _inner_sgd(problem, w, lam, rho, batches[:inner_steps])
    grad_w_f, grad_lam_f, f_value = _outer_grads(problem, w, lam, outer_batch)
    linear_residual = torch.zeros_like(rho)
    for product in _hessian_products(problem, w, lam, batches[inner_steps:-1], shared):
        d_v = tree_sub(product(v), grad_w_f)
        linear_residual = tree_norm(d_v)
        v = tree_axpy(-eta, d_v, v)
    cross, g_value = _cross_product(problem, w, lam, batches[-1], v)
    d_lam = tree_sub(grad_lam_f, cross)
    finite = _all_finite([g_value, f_value], [w, grad_w_f, grad_lam_f, v, d_lam])
    return d_lam, w, v, torch.stack([inner_residual, linear_residual, finite.to(rho.dtype)])


def _stocbio_stage(problem: BilevelProblem, w: Tree, lam: Tree, rho: Tensor, eta: Tensor, batches: list[Any],
                   outer_batch: Any, shared: bool, inner_steps: int) -> tuple[Any, ...]:
    """One call of :meth:`hypergrad.stocbio.StocBiO.hypergrad` as a traceable function (same arithmetic)."""
    w, inner_residual = _inner_sgd(problem, w, lam, rho, batches[:inner_steps])
    grad_w_f, grad_lam_f, f_value = _outer_grads(problem, w, lam, outer_batch)
    term = total = grad_w_f
    for product in _hessian_products(problem, w, lam, batches[inner_steps:-1], shared):
        term = tree_axpy(-eta, product(term), term)
        total = tree_add(total, term)
    v = tree_scale(total, eta)
    cross, g_value = _cross_product(problem, w, lam, batches[-1], v)
    d_lam = tree_sub(grad_lam_f, cross)
    finite = _all_finite([g_value, f_value], [w, grad_w_f, grad_lam_f, v, d_lam])
    return d_lam, w, v, torch.stack([inner_residual, tree_norm(term), finite.to(rho.dtype)])


def _zeros_like_fields(like: dict[str, Tree]) -> dict[str, Tree]:
    return {name: {k: torch.zeros_like(x) for k, x in tree.items()} for name, tree in like.items()}


def _stochastic_info(calls: OracleCounts, iterations: int, residual: float | None,
                     extra: dict[str, Any], compile_s: float) -> HypergradInfo:
    return HypergradInfo(iterations=iterations, residual=residual, converged=None, grad_evals=calls.total,
                         extra={"oracle_calls": calls.as_dict(), **extra, "compiled": True, "compile_s": compile_s})


def compiled_stochastic(method: Any, problem: BilevelProblem, w: Tree, lam: Tree, inner_batch: Any = None,
                        outer_batch: Any = None, state: dict[str, Any] | None = None) -> HypergradResult:
    r"""``method.hypergrad(...)`` of a SOBA, SABA, AmIGO or StocBiO from its compiled step.

    Called by ``compile=True`` on :class:`~hypergrad.soba.SOBA`, :class:`~hypergrad.saba.SABA`,
    :class:`~hypergrad.amigo.AmIGO` and :class:`~hypergrad.stocbio.StocBiO`: the whole call (the
    batch gradients and products, the SAGA estimates, the inner and linear-system steps) runs as
    one compiled graph. Compiles once per problem, shape, dtype and method configuration; the
    iterates, the carried state, the step sizes of the schedules (0-dim tensor inputs) and the
    tensors of every drawn batch are read afresh, so the graph is not recompiled per step or per
    batch. SABA's memory slot index stays outside the graph (the slot's stored values are inputs);
    its stage is traced with dynamo's automatic dynamic shapes, so a batch ``(index, data)`` with a
    Python ``int`` index costs one recompile (the index becomes symbolic), not one per index. With
    a :class:`~hypergrad.batches.StepBatches`, AmIGO and StocBiO read their ``T + L + 1`` (or
    ``T + Q + 1``) batches as in the eager call. Falls back to the eager call (logged once per
    problem) where compilation fails; a non-finite value reruns the eager call, which raises its
    :class:`~hypergrad.errors.NonFiniteError`. Checked for non-finite values: every output and
    state tree, the loss values of the products of SOBA and SABA and of the mixed product and
    outer gradient of AmIGO and StocBiO; their inner steps and Hessian products compute no loss
    value (that would cost one more forward pass per step), so a non-finite loss whose gradient is
    finite there goes unnoticed where the eager call raises.

    Returns:
        The eager call's result (same fields, state and counts) with ``info.extra["compiled"]``
        (which path ran) and ``info.extra["compile_s"]`` (seconds this call spent compiling).

    Example:
        >>> import torch, hypergrad as hg
        >>> g = lambda w, lam, b: 0.5 * ((w["x"] - lam["c"]) ** 2).sum()
        >>> f = lambda w, lam, b: 0.5 * ((w["x"] - 3.0) ** 2).sum()
        >>> soba = hg.SOBA(step_size=0.5, compile=True)
        >>> w, lam = {"x": torch.zeros(2, dtype=torch.float64)}, {"c": torch.ones(2, dtype=torch.float64)}
        >>> r = compiled_stochastic(soba, hg.BilevelProblem(g, f), w, lam)
        >>> r.grad["c"].tolist() == hg.SOBA(step_size=0.5).hypergrad(hg.BilevelProblem(g, f), w, lam).grad["c"].tolist()
        True
        >>> sorted(r.state), r.info.extra["oracle_calls"]["hvp"]
        (['step', 'v'], 1)
    """
    name = type(method).__name__
    if name not in _STOCHASTIC_CALLS:
        raise TypeError(f"compiled_stochastic takes a SOBA, SABA, AmIGO or StocBiO, got {name}")
    inner_batch, outer_batch = _replayable(inner_batch), _replayable(outer_batch)
    args = (w, lam, inner_batch, outer_batch, state)
    w, lam = problem.validate(w, lam)
    w, lam = tree_detach(w), tree_detach(lam)
    t = step_counter(state, name)
    result = _STOCHASTIC_CALLS[name](method, problem, w, lam, inner_batch, outer_batch, state, t)
    if result is None:
        return _eager(method, problem, args)
    if result is _NON_FINITE:
        return _non_finite(method, problem, args)
    return result


_NON_FINITE: Any = object()


def _tensor_like(value: float, like: Tree) -> Tensor:
    ref = next(iter(like.values()))
    return torch.tensor(value, dtype=ref.dtype, device=ref.device)


def _soba_call(method: Any, problem: BilevelProblem, w: Tree, lam: Tree, inner_batch: Any, outer_batch: Any,
               state: dict[str, Any] | None, t: int) -> HypergradResult | None:
    v = linear_iterate(state, w, "SOBA")
    rho = step_size_at(method.step_size, t, "step_size")
    ran = _run_stage(problem, _soba_stage, w, lam, v, _tensor_like(rho, w), one_batch(inner_batch),
                     one_batch(outer_batch))
    if ran is None:
        return None
    (d_lam, new_w, new_v, scalars), compile_s = ran
    residual, linear_residual, finite = scalars.tolist()
    if not finite:
        return _NON_FINITE
    calls = OracleCounts(inner_grad=1, hvp=1, cross=1, outer_grad=1)
    info = _stochastic_info(calls, 1, residual,
                            {"step": t, "step_size": rho, "linear_residual": linear_residual}, compile_s)
    return HypergradResult(d_lam, new_w, info, {"v": new_v, "step": t + 1})


def _saba_call(method: Any, problem: BilevelProblem, w: Tree, lam: Tree, inner_batch: Any, outer_batch: Any,
               state: dict[str, Any] | None, t: int) -> HypergradResult | None:
    v = linear_iterate(state, w, "SABA")
    memory = method.read_memory(state, w, lam)
    rho = step_size_at(method.step_size, t, "step_size")
    inner_batch, outer_batch = one_batch(inner_batch), one_batch(outer_batch)
    i, j = method.index_of(inner_batch, "inner"), method.index_of(outer_batch, "outer")
    stored_inner = memory["inner"].get(i) or _zeros_like_fields(memory["inner_mean"])
    stored_outer = memory["outer"].get(j) or _zeros_like_fields(memory["outer_mean"])
    ran = _run_stage(problem, _saba_stage, w, lam, v, _tensor_like(rho, w), inner_batch, outer_batch,
                     stored_inner, memory["inner_mean"], stored_outer, memory["outer_mean"],
                     1.0 / method.n_inner, 1.0 / method.n_outer)
    if ran is None:
        return None
    (d_lam, new_w, new_v, fresh_inner, fresh_outer, inner_mean, outer_mean, scalars), compile_s = ran
    residual, linear_residual, finite = scalars.tolist()
    if not finite:
        return _NON_FINITE
    inner_table, outer_table = dict(memory["inner"]), dict(memory["outer"])
    inner_table[i], outer_table[j] = fresh_inner, fresh_outer
    calls = OracleCounts(inner_grad=1, hvp=1, cross=1, outer_grad=1)
    extra = {"step": t, "step_size": rho, "linear_residual": linear_residual,
             "seen_inner": len(inner_table), "seen_outer": len(outer_table)}
    info = _stochastic_info(calls, 1, residual, extra, compile_s)
    new_memory = {"inner": inner_table, "outer": outer_table, "inner_mean": inner_mean, "outer_mean": outer_mean}
    return HypergradResult(d_lam, new_w, info, {"v": new_v, "step": t + 1, "memory": new_memory})


def _series_call(method: Any, problem: BilevelProblem, w: Tree, lam: Tree, inner_batch: Any, outer_batch: Any,
                 state: dict[str, Any] | None, t: int) -> HypergradResult | None:
    """AmIGO and StocBiO: ``T`` inner steps, ``L`` (or ``Q``) products, one mixed product."""
    amigo = type(method).__name__ == "AmIGO"
    n_products = method.linear_steps if amigo else method.neumann_steps
    second = method.linear_step_size if amigo else method.neumann_step_size
    second_name = "linear_step_size" if amigo else "neumann_step_size"
    T = method.inner_steps
    rho = step_size_at(method.step_size, t, "step_size")
    eta = rho if second is None else step_size_at(second, t, second_name)
    batches = per_step(inner_batch, T + n_products + 1)
    shared = not isinstance(inner_batch, StepBatches)
    rho_t, eta_t = _tensor_like(rho, w), _tensor_like(eta, w)
    if amigo:
        v = linear_iterate(state, w, "AmIGO")
        ran = _run_stage(problem, _amigo_stage, w, lam, v, rho_t, eta_t, batches, one_batch(outer_batch), shared, T)
    else:
        ran = _run_stage(problem, _stocbio_stage, w, lam, rho_t, eta_t, batches, one_batch(outer_batch), shared, T)
    if ran is None:
        return None
    (d_lam, new_w, v, scalars), compile_s = ran
    inner_residual, last, finite = scalars.tolist()
    if not finite:
        return _NON_FINITE
    residual = inner_residual if T else None
    if amigo:
        calls = OracleCounts(inner_grad=T, hvp=n_products, cross=1, outer_grad=1)
        extra = {"step": t, "step_size": rho, "linear_step_size": eta,
                 "linear_residual": last if n_products else None}
        info = _stochastic_info(calls, T + n_products, residual, extra, compile_s)
        return HypergradResult(d_lam, new_w, info, {"v": v, "step": t + 1})
    calls = OracleCounts(inner_grad=T, hvp=n_products, cross=1, outer_grad=1)
    extra = {"step": t, "step_size": rho, "neumann_step_size": eta, "last_term_norm": eta * last, "v": v}
    info = _stochastic_info(calls, T + n_products, residual, extra, compile_s)
    return HypergradResult(d_lam, new_w, info, {"step": t + 1})


_STOCHASTIC_CALLS: dict[str, Callable[..., HypergradResult | None]] = {
    "SOBA": _soba_call, "SABA": _saba_call, "AmIGO": _series_call, "StocBiO": _series_call}
