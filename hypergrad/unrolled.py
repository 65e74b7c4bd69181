r"""Hypergradients by differentiating through K steps of an inner optimizer (unrolling)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import KW_ONLY, dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from hypergrad.autodiff import (
    check_inner_graph,
    grad_or_zeros,
    inner_grads,
    loss_and_grads,
    outer_fn,
)
from hypergrad.batches import StepBatches, per_step  # noqa: F401  (StepBatches: the old import path)
from hypergrad.inner import InnerOptimizer
from hypergrad.problem import BilevelProblem, HypergradInfo, HypergradResult
from hypergrad.recompute import RecomputeSaved
from hypergrad.tree import (
    Tree,
    check_finite,
    tree_detach,
    tree_flatten,
    tree_numel,
    tree_requires_grad,
    tree_unflatten,
)

__all__ = ["Unrolled"]

_MODES = ("reverse", "forward")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class Unrolled:
    r"""Differentiate through ``steps`` iterations of a differentiable inner optimizer.

    Starting from :math:`w_0 = w` (a constant) and the optimizer state :math:`s_0`, run

    .. math::
        (w_{k+1}, s_{k+1}) = \Phi(w_k, s_k, \lambda)
        = \mathrm{update}\bigl(w_k, \nabla_w g(w_k, \lambda, \xi_k), s_k\bigr),
        \qquad k = 0, \dots, K-1,

    and return the exact derivative of :math:`F_K(\lambda) = f(w_K(\lambda), \lambda)`:

    .. math::
        \nabla F_K = \nabla_\lambda f + \Bigl(\frac{d w_K}{d\lambda}\Bigr)^{\!\top} \nabla_w f,

        \frac{d z_{k+1}}{d\lambda} = \partial_z \Phi \, \frac{d z_k}{d\lambda}
        + \partial_\lambda \Phi, \quad z = (w, s), \quad \frac{d z_0}{d\lambda} = 0.

    For SGD on a :math:`\mu`-strongly convex, :math:`L`-smooth ``g`` with :math:`\eta \le 2/L`,
    :math:`\partial_w\Phi = I - \eta \nabla^2_{ww} g` has norm :math:`\le \rho = \max|1-\eta\,
    \mathrm{eig}(\nabla^2 g)| < 1`, so :math:`\nabla F_K` approaches the implicit (IFT)
    hypergradient geometrically: the error is :math:`O(\rho^K)` on quadratics and
    :math:`O((K+1)\rho^K)` in general (Franceschi et al., 2018; Grazzi et al., 2020).

    Modes:

    * ``"reverse"``: backpropagation through the loop (each inner gradient is taken with
      ``create_graph=True``). Cost: ``K`` inner gradients plus one backward pass through the loop
      (about one Hessian-vector product per step); memory :math:`O(K \cdot |w|)` for the graph.
    * ``"reverse"`` with ``truncate=k``: the first ``K-k`` steps run without a graph and
      :math:`(w_{K-k}, s_{K-k})` is treated as a constant, i.e. the term
      :math:`(\partial z_K / \partial z_{K-k})\, dz_{K-k}/d\lambda` of :math:`dz_K/d\lambda` is
      dropped. Memory :math:`O(k\,|w|)`. The estimate is biased: for SGD on a strongly convex
      ``g`` the bias is at most :math:`\|\nabla_w f\|\,\rho^k\,\|dw_{K-k}/d\lambda\|`, so it
      decays geometrically in ``k`` (Shaban et al., 2019), but for fixed ``k`` it does not vanish
      as ``K`` grows: for :math:`g = \frac12 w^\top A w - w^\top B\lambda` the truncated
      :math:`dw_K/d\lambda` tends to :math:`A^{-1}(I - M^k)B` instead of :math:`A^{-1}B`,
      :math:`M = I - \eta A`.
    * ``"reverse"`` with ``checkpoint=True``: the same estimate without storing the K graphs. The
      forward sweep runs without a graph and keeps only the iterates :math:`z_k = (w_k, s_k)`;
      the backward sweep rebuilds one step's graph at a time from :math:`z_k` and pulls the
      cotangent back through it. Memory :math:`O(K\,|z|)` plus one step's graph (the stored-graph
      form keeps every step's activations and double-backward buffers, typically several times
      :math:`|w|` per step); cost one extra inner gradient per step. The RNG state of each step
      is replayed, so a stochastic loss (dropout) sees the same randomness twice.
    * ``"forward"``: forward-mode differentiation: the JVP of the step map :math:`\Phi` with one
      tangent per scalar entry of ``lam``, propagated step by step along with :math:`w_k`.
      Memory is independent of ``K`` (:math:`O(\dim\lambda \cdot |z|)`), cost is about
      :math:`K (1 + \dim\lambda)` gradient-equivalents: meant for few hyperparameters (a
      temperature, a few regularisation strengths). Each step takes one gradient with a graph
      and, per direction, one Hessian-vector product through it (a backward pass: by symmetry
      of the Hessian of ``g`` it gives the tangent of :math:`\nabla_w g`) and the JVP of the
      optimizer update (the VJP of its VJP); no forward-mode AD, so PyTorch's deprecated
      ``torch.jit.script``, which its forward AD uses on first use, is never reached. With
      several directions their backward passes are batched (``is_grads_batched``, vmap over
      the directions); if that fails for the losses, a loop over the directions is used and
      ``info.extra["vectorized"]`` is False.

    Both modes compute the same number up to round-off. Only ``lam``'s influence is
    differentiated: the starting point ``w`` and the starting optimizer state are constants.
    ``info.converged`` is None: ``K`` fixed steps have no stopping test.

    Args:
        optimizer: a pure optimizer from :mod:`hypergrad.inner` (``SGD``, ``Momentum``, ``Adam``).
        steps: number ``K >= 1`` of inner steps.
        mode: ``"reverse"`` or ``"forward"``.
        truncate: ``None`` (differentiate all steps) or ``k`` in ``[1, steps]``: differentiate
            only the last ``k`` steps (``mode="reverse"`` only).
        warm_start: start from the optimizer state passed back through ``state`` (key
            ``"opt_state"``; a fresh ``optimizer.init(w)`` when absent) and return the final one,
            so momentum buffers and Adam's step count carry over between calls.
        vectorize: forward mode only: batch the backward passes of the directions first (vmap;
            falls back to a loop when batching fails); False always loops.
        checkpoint: reverse mode only: rebuild each step's graph in the backward sweep instead of
            storing all of them (see Modes).
        recompute: reverse mode with stored graphs only: do not store the outputs of cheap
            backward ops whose inputs the graph keeps anyway (the first backward's
            ``tanh_backward`` and ``sigmoid_backward``, transposes of them, and matrix products
            summed over at most 16 terms, e.g. the gradient into the last hidden layer, summed
            over the classes). Each is kept as a reference to the op that produced it and
            recomputed when the backward sweep needs it. Exact: the same op runs on the same
            saved inputs, and a kind of tensor is replaced only after its recomputation compared
            bitwise equal. The first step finds the replaceable tensors under saved-tensor hooks
            and records where they sit in its graph (a plan); the later steps, which repeat the
            same ops, run without hooks and replace just the planned tensors
            (``info.extra["recompute_planned_steps"]`` counts them; a step whose graph does not
            match the plan switches the remaining steps back to the hooks). Measured at K = 100
            on a tanh MLP (8,970 parameters, batch 256, float32): peak memory 0.89x -> 0.76x
            higher's, time 0.89x -> 0.92x higher's (0.97x in another run;
            ``benchmarks/results/hypergrad_problems_4_5.md``).
            ``recompute=False`` keeps every saved tensor. When the first step has nothing to
            recompute (e.g. linear models), nothing is done for the other steps; under the
            caller's own saved-tensor hooks (``torch.autograd.graph.save_on_cpu``) nothing is
            done at all. ``info.extra["recomputed"]`` counts the saves replaced (a tensor saved
            by two ops counts twice).
        recompute_min_bytes: with ``recompute``, replace a tensor in the planned steps only if it
            frees at least this many bytes per save it takes to replace (its storage's size over
            the number of saves holding it; a storage some save of which cannot be replaced frees
            nothing and is kept). Each replaced save costs about 15-30 us of Python per step
            whatever its size, so small tensors saved twice are not worth it where a step takes
            about a millisecond: the default 48 KiB keeps, on the 64-wide MLP above, the matrix
            product (64 KiB, one save) and not the tanh backward output (64 KiB held by two
            saves, it and its transpose; with it: 0.64x higher's memory at 0.98x its time).
            0 replaces every replaceable tensor.

    Inner batches: ``inner_batch`` is one batch reused for all ``K`` steps, or a
    :class:`~hypergrad.batches.StepBatches` holding one batch per step (:func:`hypergrad.solve`
    passes one for a stream of batches); ``outer_batch`` is one batch, or a ``StepBatches`` of
    which one is drawn. In forward mode the inner loss is evaluated once per step for all
    directions.

    Example:
        >>> import torch, hypergrad as hg
        >>> g = lambda w, lam, b: 0.5 * ((w["x"] - lam["c"]) ** 2).sum()
        >>> f = lambda w, lam, b: 0.5 * (w["x"] ** 2).sum()
        >>> problem = hg.BilevelProblem(g, f)
        >>> w0 = {"x": torch.zeros(2, dtype=torch.float64)}
        >>> lam = {"c": torch.tensor([1.0, 2.0], dtype=torch.float64)}
        >>> method = hg.Unrolled(hg.inner.SGD(lr=0.5), steps=3)
        >>> r = method.hypergrad(problem, w0, lam)   # w_3 = (1 - 0.5**3) c = 0.875 c
        >>> [round(v, 6) for v in r.grad["c"].tolist()]   # dF/dc = 0.875**2 c
        [0.765625, 1.53125]
        >>> fwd = hg.Unrolled(hg.inner.SGD(lr=0.5), steps=3, mode="forward")
        >>> fwd = fwd.hypergrad(problem, w0, lam)
        >>> torch.allclose(fwd.grad["c"], r.grad["c"]), r.info.iterations
        (True, 3)
    """

    takes_step_batches: ClassVar[bool] = True  # hg.solve hands it a StepBatches per stream

    optimizer: InnerOptimizer
    steps: int
    _: KW_ONLY  # the options below are keyword-only
    mode: str = "reverse"
    truncate: int | None = None
    warm_start: bool = False
    vectorize: bool = True
    checkpoint: bool = False
    recompute: bool = True
    recompute_min_bytes: int = 48 * 1024

    def __post_init__(self) -> None:
        # a local import keeps the module's import block as it was
        from hypergrad.errors import check_inner_optimizer

        check_inner_optimizer(self.optimizer, "optimizer")
        if not isinstance(self.optimizer, InnerOptimizer):
            raise TypeError(
                "optimizer must be an inner optimizer with init(w) and update(w, grad, state) "
                f"(e.g. hypergrad.inner.SGD), got {type(self.optimizer).__name__}"
            )
        if not _is_int(self.steps):
            raise TypeError(f"steps must be an int, got {type(self.steps).__name__}")
        if self.steps < 1:
            raise ValueError(f"steps must be >= 1, got {self.steps}")
        if self.mode not in _MODES:
            raise ValueError(f"mode must be 'reverse' or 'forward', got {self.mode!r}")
        if self.truncate is not None:
            if not _is_int(self.truncate):
                raise TypeError(
                    f"truncate must be None or an int, got {type(self.truncate).__name__}"
                )
            if not 1 <= self.truncate <= self.steps:
                raise ValueError(
                    f"truncate must be None or in [1, steps={self.steps}], got {self.truncate}"
                )
            if self.mode == "forward":
                raise ValueError(
                    "truncate is only supported with mode='reverse', got mode='forward'"
                )
        if not isinstance(self.warm_start, bool):
            raise TypeError(f"warm_start must be a bool, got {type(self.warm_start).__name__}")
        if not isinstance(self.vectorize, bool):
            raise TypeError(f"vectorize must be a bool, got {type(self.vectorize).__name__}")
        if not isinstance(self.checkpoint, bool):
            raise TypeError(f"checkpoint must be a bool, got {type(self.checkpoint).__name__}")
        if not isinstance(self.recompute, bool):
            raise TypeError(f"recompute must be a bool, got {type(self.recompute).__name__}")
        if not _is_int(self.recompute_min_bytes):
            raise TypeError(
                f"recompute_min_bytes must be an int, got {type(self.recompute_min_bytes).__name__}"
            )
        if self.recompute_min_bytes < 0:
            raise ValueError(f"recompute_min_bytes must be >= 0, got {self.recompute_min_bytes}")
        if self.checkpoint and self.mode != "reverse":
            raise ValueError("checkpoint is only supported with mode='reverse', got mode='forward'")

    def hypergrad(
        self,
        problem: BilevelProblem,
        w: Tree,
        lam: Tree,
        inner_batch: Any = None,
        outer_batch: Any = None,
        state: dict[str, Any] | None = None,
    ) -> HypergradResult:
        """Unroll ``steps`` inner steps from ``w``; return ``dF_K/dlam`` and ``w_K`` (detached)."""
        w, lam = problem.validate(w, lam)
        w, lam = tree_detach(w), tree_detach(lam)
        batches = per_step(inner_batch, self.steps)
        (outer_batch,) = per_step(outer_batch, 1)
        opt_state = self._initial_state(w, state)
        with torch.enable_grad():
            if self.mode == "reverse":
                grad, w_K, s_K, extra, evals = self._reverse(
                    problem, w, lam, batches, outer_batch, opt_state
                )
            else:
                grad, w_K, s_K, extra, evals = self._forward(
                    problem, w, lam, batches, outer_batch, opt_state
                )
        check_finite(
            w_K, "Unrolled inner iterate w_K (did the inner optimizer diverge? lower its lr)"
        )
        check_finite(grad, "Unrolled hypergradient")
        info = HypergradInfo(
            iterations=self.steps,
            grad_evals=evals,
            warnings=extra.pop("warnings", []),
            extra={"mode": self.mode, **extra},
        )
        new_state = {"opt_state": tree_detach(s_K)} if self.warm_start else None
        return HypergradResult(tree_detach(grad), tree_detach(w_K), info, new_state)

    # ------------------------------------------------------------------ helpers

    def _initial_state(self, w: Tree, state: dict[str, Any] | None) -> Tree:
        fresh = self.optimizer.init(w)
        if not (self.warm_start and state and "opt_state" in state):
            return fresh
        given = state["opt_state"]
        if not isinstance(given, dict) or set(given) != set(fresh):
            raise ValueError(
                "state['opt_state'] must be the optimizer state returned by a previous call "
                f"(keys {sorted(fresh)}), got "
                f"{sorted(given) if isinstance(given, dict) else repr(given)}"
            )
        return tree_detach(given)

    def _reverse(
        self,
        problem: BilevelProblem,
        w: Tree,
        lam: Tree,
        batches: list[Any],
        outer_batch: Any,
        s: Tree,
    ) -> tuple[Tree, Tree, Tree, dict[str, Any], int]:
        if self.checkpoint:
            return self._reverse_checkpointed(problem, w, lam, batches, outer_batch, s)
        K = self.steps
        k = self.truncate if self.truncate is not None else K
        opt = self.optimizer
        for i in range(K - k):  # detached prefix (truncated backprop)
            w, s = _plain_step(problem, opt, w, lam, batches[i], s, i)
        lam_ = tree_requires_grad(lam)
        w = tree_requires_grad(w)  # a constant start; requires grad only so that grad_w g exists
        saver = RecomputeSaved(self.recompute_min_bytes) if self.recompute else None
        for i in range(K - k, K):
            value = problem.inner_loss(w, lam_, batches[i])
            if i == K - k:  # the same checks as every method, once per call
                check_inner_graph(value, w, lam_)
            # the recomputable tensors are those the first backward saves (the forward's are kept)
            if saver is not None:
                grad_w = saver.grad(value, w)
            else:
                grad_w = grad_or_zeros(value, w, create_graph=True)
            w, s = opt.update(w, grad_w, s)
        f_value = problem.outer_loss(w, lam_, outer_batch)
        grad = grad_or_zeros(f_value, lam_, create_graph=False)
        extra: dict[str, Any] = {"differentiated_steps": k}
        if saver is not None:
            extra["recomputed"] = saver.replaced
            extra["recompute_planned_steps"] = saver.planned_steps
        return grad, w, s, extra, K + k + 1

    def _reverse_checkpointed(
        self,
        problem: BilevelProblem,
        w: Tree,
        lam: Tree,
        batches: list[Any],
        outer_batch: Any,
        s: Tree,
    ) -> tuple[Tree, Tree, Tree, dict[str, Any], int]:
        r"""Reverse mode storing only the iterates: rebuild each step's graph in the backward sweep.

        Forward sweep without a graph, keeping :math:`z_i = (w_i, s_i)` (and the RNG state, so a
        stochastic loss replays the same randomness); backward sweep from :math:`z_K`: for
        :math:`i = K-1, \dots, K-k` rebuild step ``i`` at :math:`z_i` and pull the cotangent of
        :math:`z_{i+1}` back to :math:`z_i` and :math:`\lambda` (one VJP). Same estimate as the
        stored-graph form up to round-off; memory :math:`k\,|z|` plus one step's graph instead of
        ``k`` graphs; cost one extra inner gradient per differentiated step.
        """
        K = self.steps
        k = self.truncate if self.truncate is not None else K
        opt = self.optimizer
        device = next(iter(w.values())).device
        trajectory: list[tuple[Tree, Tree, Any]] = []
        for i in range(K):
            if i >= K - k:
                trajectory.append((w, s, _get_rng(device)))
            w, s = _plain_step(problem, opt, w, lam, batches[i], s, i)
        _, a_w, grad_lam_f = loss_and_grads(outer_fn(problem, outer_batch), w, lam, what="outer loss")
        assert a_w is not None and grad_lam_f is not None
        a_s: Tree = {key: torch.zeros_like(v) for key, v in s.items()}
        lam_ = tree_requires_grad(lam)
        lam_leaves = list(lam_.values())
        acc = [g.clone() for g in grad_lam_f.values()]
        rng_now = _get_rng(device)
        for j in reversed(range(k)):
            w_i, s_i, rng = trajectory[j]
            trajectory[j] = ({}, {}, rng)  # drop z_i once used (a long tail of iterates stays small)
            first = j == 0  # z_{K-k} is a constant: only lam's cotangent is needed there
            w_ = tree_requires_grad(w_i)
            s_ = {key: (v.detach().requires_grad_(True) if v.is_floating_point() else v) for key, v in s_i.items()}
            _set_rng(device, rng)
            value = problem.inner_loss(w_, lam_, batches[K - k + j])
            if j == k - 1:  # the same checks as every method, once per call
                check_inner_graph(value, w_, lam_)
            w_next, s_next = opt.update(w_, grad_or_zeros(value, w_, create_graph=True), s_)
            outputs, cotangents = [], []
            for key, v in w_next.items():
                if v.requires_grad:
                    outputs.append(v)
                    cotangents.append(a_w[key])
            for key, v in s_next.items():
                if v.requires_grad:
                    outputs.append(v)
                    cotangents.append(a_s[key])
            w_leaves = [] if first else list(w_.values())
            s_keys = [] if first else [key for key, v in s_.items() if v.requires_grad]
            inputs = lam_leaves + w_leaves + [s_[key] for key in s_keys]
            if outputs:
                grads = torch.autograd.grad(outputs, inputs, cotangents, allow_unused=True)
            else:
                grads = (None,) * len(inputs)
            n_lam, n_w = len(lam_leaves), len(w_leaves)
            for m, g_ in enumerate(grads[:n_lam]):
                if g_ is not None:
                    acc[m] = acc[m] + g_
            if not first:
                a_w = _zeros_for_none(grads[n_lam : n_lam + n_w], w_i)
                new_a_s = {key: torch.zeros_like(v) for key, v in s_i.items()}
                for key, g_ in zip(s_keys, grads[n_lam + n_w :], strict=True):
                    if g_ is not None:
                        new_a_s[key] = g_
                a_s = new_a_s
        _set_rng(device, rng_now)
        grad = dict(zip(lam, acc, strict=True))
        extra = {"differentiated_steps": k, "checkpoint": True}
        return grad, w, s, extra, K + 2 * k + 1

    def _forward(
        self,
        problem: BilevelProblem,
        w: Tree,
        lam: Tree,
        batches: list[Any],
        outer_batch: Any,
        s: Tree,
    ) -> tuple[Tree, Tree, Tree, dict[str, Any], int]:
        r"""Forward mode by reverse passes: the tangents of every direction pushed through each step.

        Per step: the gradient :math:`\nabla g` at :math:`(w_k, \lambda)` with a graph; one
        backward pass through it per direction gives the directional derivative of
        :math:`\nabla_w g` along the tangent :math:`(\dot w_k, \dot\lambda)` (by symmetry of the
        Hessian of ``g``, the VJP of :math:`(\nabla_w g, \nabla_\lambda g)` with cotangent
        :math:`(\dot w_k, \dot\lambda)` *is* :math:`\nabla^2_{ww} g\,\dot w_k +
        \nabla^2_{w\lambda} g\,\dot\lambda`); then the optimizer update and its JVP, taken as the
        VJP of its VJP (:func:`_update_tangents`). With ``vectorize`` the directions share one
        batched backward pass (``is_grads_batched``), else one pass each. The graph is freed at
        every step, so memory does not grow with K. No forward-mode AD is used: PyTorch's
        (dual tensors, ``torch.func.jvp``) scripts its decompositions with the deprecated
        ``torch.jit.script`` on first use; reverse-over-reverse products were also measured
        about 5x faster than ``torch.func.jvp`` over ``torch.func.grad`` through the whole step
        for one direction (see :doc:`/methods/implicit`).
        """
        p = tree_numel(lam)
        opt = self.optimizer
        lam_ = tree_requires_grad(lam)
        lam_leaves = list(lam_.values())
        ref = lam_leaves[0]
        t_lam = list(_batched_basis(torch.eye(p, dtype=ref.dtype, device=ref.device), lam).values())
        t_w = {k: v.new_zeros((p, *v.shape)) for k, v in w.items()}
        t_s = {k: v.new_zeros((p, *v.shape)) for k, v in s.items()}
        directions = _Directions(p, batched=self.vectorize and p > 1)
        for i in range(self.steps):
            w_ = tree_requires_grad(w)
            w_leaves = list(w_.values())
            n_w = len(w_leaves)
            value = problem.inner_loss(w_, lam_, batches[i])
            if i == 0:  # the same checks as every method, once per call
                check_inner_graph(value, w_, lam_)
            if value.requires_grad:
                grads = torch.autograd.grad(value, w_leaves + lam_leaves, create_graph=True, allow_unused=True)
            else:
                grads = (None,) * (n_w + len(lam_leaves))
            outputs, cotangents = [], []
            for g_, tangent in zip(grads, [*t_w.values(), *t_lam], strict=True):
                if g_ is not None and g_.requires_grad:
                    outputs.append(g_)
                    cotangents.append(tangent.to(g_.dtype))
            grad_dot = dict(zip(w, directions.vjps(outputs, w_leaves, cotangents), strict=True))
            grad_w = _zeros_for_none(grads[:n_w], w)
            w, s, t_w, t_s = _update_tangents(opt, w, grad_w, s, t_w, grad_dot, t_s, directions)
        _, grad_w_f, grad_lam_f = loss_and_grads(
            outer_fn(problem, outer_batch), w, lam, what="outer loss"
        )
        assert grad_w_f is not None and grad_lam_f is not None
        # dF/dlam_i = <grad_w f, dw_K/dlam_i> + d_lam_i f
        flat = tree_flatten(grad_lam_f).clone()
        for key, tangent in t_w.items():
            gwf = grad_w_f[key].reshape(-1).to(tangent.dtype)
            flat = flat + (tangent.reshape(p, -1) @ gwf).to(flat.dtype)
        grad = tree_unflatten(flat, lam)
        extra = {"directions": p, "vectorized": p == 1 or directions.batched, "warnings": directions.warnings}
        return grad, w, s, extra, self.steps * (1 + p) + 1

def _get_rng(device: torch.device) -> tuple[Tensor, Tensor | None]:
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


def _set_rng(device: torch.device, state: tuple[Tensor, Tensor | None]) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)


def _zeros_for_none(grads: Iterable[Tensor | None], like: Tree) -> Tree:
    return {k: (g.detach() if g is not None else torch.zeros_like(v)) for (k, v), g in zip(like.items(), grads, strict=True)}


def _batched_basis(eye: Tensor, like: Tree) -> Tree:
    """The standard basis of ``like``'s space as a tree whose leaves have a leading batch dim."""
    p = eye.shape[0]
    out, offset = {}, 0
    for k, v in like.items():
        out[k] = eye[:, offset : offset + v.numel()].reshape(p, *v.shape)
        offset += v.numel()
    return out


class _Directions:
    """Backward passes along ``p`` directions: one batched pass (``is_grads_batched``) while
    ``batched``, else one pass per direction; a batched pass that fails switches to the loop
    for the rest of the call and says why in ``warnings``."""

    def __init__(self, p: int, batched: bool) -> None:
        self.p, self.batched = p, batched
        self.warnings: list[str] = []

    def vjps(self, outputs: list[Tensor], inputs: list[Tensor], cotangents: list[Tensor]) -> list[Tensor]:
        """Per input, the VJPs of ``outputs`` along each direction's cotangents (``(p, ...)``
        leading), stacked; zeros for an input the outputs do not depend on."""
        p = self.p
        if outputs and self.batched:
            try:
                grads = torch.autograd.grad(outputs, inputs, cotangents, retain_graph=True, allow_unused=True,
                                            is_grads_batched=True)
                return [x.new_zeros((p, *x.shape)) if g_ is None else g_.detach() for g_, x in zip(grads, inputs,
                                                                                                  strict=True)]
            except Exception as exc:  # not batchable (vmap): loop below (re-raises real errors)
                self.batched = False
                self.warnings.append(
                    f"batching the backward passes of the {p} hyperparameter direction(s) with vmap "
                    f"failed ({type(exc).__name__}: {str(exc)[:200]}); used a loop over directions"
                )
        columns: list[list[Tensor | None]] = [[] for _ in inputs]
        for d in range(p):
            if outputs:
                grads = torch.autograd.grad(outputs, inputs, [c[d] for c in cotangents], retain_graph=True,
                                            allow_unused=True)
            else:
                grads = (None,) * len(inputs)
            for column, g_ in zip(columns, grads, strict=True):
                column.append(g_)
        return [torch.stack([torch.zeros_like(x) if g_ is None else g_.detach() for g_ in column])
                for column, x in zip(columns, inputs, strict=True)]


def _update_tangents(opt: InnerOptimizer, w: Tree, grad: Tree, s: Tree, t_w: Tree, t_grad: Tree, t_s: Tree,
                     directions: _Directions) -> tuple[Tree, Tree, Tree, Tree]:
    r"""``opt.update(w, grad, s)`` (detached) and its JVPs along each direction's tangents.

    The JVP is the VJP of the update's VJP: :math:`u \mapsto J^\top u` is linear in the
    cotangent ``u``, so its VJP with cotangent ``t`` is :math:`J t`. Two backward passes through
    the update (elementwise for the optimizers of :mod:`hypergrad.inner`), any update written with
    differentiable ops, and no forward-mode AD.
    """
    def leaf(x: Tensor) -> Tensor:
        return x.detach().requires_grad_(True) if x.is_floating_point() else x.detach()

    w_in, g_in, s_in = ({k: leaf(v) for k, v in tree.items()} for tree in (w, grad, s))
    w_new, s_new = opt.update(w_in, g_in, s_in)
    inputs, tangents = [], []
    for tree, tangent in ((w_in, t_w), (g_in, t_grad), (s_in, t_s)):
        for k, x in tree.items():
            if x.requires_grad:
                inputs.append(x)
                tangents.append(tangent[k].to(x.dtype))
    outputs = [v for v in (*w_new.values(), *s_new.values()) if v.requires_grad]
    units = [torch.zeros_like(v, requires_grad=True) for v in outputs]
    if outputs:
        pulled = torch.autograd.grad(outputs, inputs, units, create_graph=True, allow_unused=True)
    else:
        pulled = (None,) * len(inputs)
    linear = [(z, t) for z, t in zip(pulled, tangents, strict=True) if z is not None and z.requires_grad]
    pushed = iter(directions.vjps([z for z, _ in linear], units, [t for _, t in linear]))
    p = directions.p

    def tangent_of(v: Tensor) -> Tensor:
        # keep tangents in the dtype of their primals
        return next(pushed).to(v.dtype) if v.requires_grad else v.new_zeros((p, *v.shape))

    t_w_new = {k: tangent_of(v) for k, v in w_new.items()}
    t_s_new = {k: tangent_of(v) for k, v in s_new.items()}
    return tree_detach(w_new), tree_detach(s_new), t_w_new, t_s_new


def _plain_step(
    problem: BilevelProblem, opt: InnerOptimizer, w: Tree, lam: Tree, batch: Any, s: Tree, i: int
) -> tuple[Tree, Tree]:
    """One optimizer step on g without a graph (detached result)."""
    _, gw, _ = inner_grads(problem, batch, w, lam, what=f"inner loss at step {i}")
    assert gw is not None
    with torch.no_grad():
        w, s = opt.update(w, gw, s)
    return tree_detach(w), tree_detach(s)
