r"""Implicit hypergradients of many small inner problems at once, vectorised with ``torch.func.vmap``.

The meta-learning shape: one set of hyperparameters :math:`\lambda` (e.g. iMAML's meta-parameters
:math:`\theta`) shared by many tasks, each with its own inner problem
:math:`w_i^*(\lambda) = \arg\min_w g(w, \lambda, b_i)` and outer loss :math:`f(w, \lambda, b'_i)`.
:class:`BatchedImplicit` runs, for all tasks in one vectorised program, ``inner_steps`` steps of
gradient descent from a shared start, then the implicit-function-theorem hypergradient with a
fixed number of conjugate-gradient iterations (a data-dependent stopping test cannot differ
between the lanes of ``vmap``) on functional Hessian-vector products
(``torch.func.jvp`` over ``torch.func.grad``). Every task's batch is a slice of one stacked
batch, so the per-task Python and autograd-engine overhead of a loop over tasks is paid once.

For iMAML (Rajeswaran et al., 2019) the inner loss is the task's training loss plus
:math:`\tfrac{\rho}{2}\lVert w - \theta\rVert^2` and the inner start is :math:`\theta` itself; the
system :math:`\rho I + \nabla^2 L_i` is well conditioned while the curvature of the task loss is
small against :math:`\rho`, so a few CG iterations suffice; see :doc:`/tutorials/meta_learning`.
"""

from __future__ import annotations

import warnings as _warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from hypergrad.errors import ConvergenceWarning
from hypergrad.problem import BilevelProblem
from hypergrad.tree import Tree, check_tree

__all__ = ["BatchedImplicit", "BatchedResult"]


@dataclass
class BatchedResult:
    """What :meth:`BatchedImplicit.hypergrad` returns.

    Attributes:
        grad: the mean hypergradient over tasks, shaped like ``lam``.
        task_grads: every task's hypergradient, each leaf with a leading task dimension.
        w: every task's final inner iterate, each leaf with a leading task dimension.
        outer_loss: every task's outer loss at its final iterate (shape ``(tasks,)``).
        inner_residual: every task's :math:`\\lVert\\nabla_w g\\rVert` at its final iterate.
        cg_residual: every task's relative CG residual after ``cg_iters`` iterations (a lane
            that met a non-positive curvature stops there, as :class:`~hypergrad.linear.CG` does).
        indefinite: per task, whether its CG met a non-positive curvature (p^T H p <= 0)
            and stopped there (its system is not positive definite, e.g. the inner steps have
            not reached a minimum); :meth:`BatchedImplicit.hypergrad` warns when any task did.

    Example:
        >>> BatchedResult.__dataclass_fields__.keys() >= {"grad", "task_grads", "outer_loss"}
        True
    """

    grad: Tree
    task_grads: Tree
    w: Tree
    outer_loss: Tensor
    inner_residual: Tensor
    cg_residual: Tensor
    indefinite: Tensor


def _tensors(tree: Any) -> list[Tensor]:
    if isinstance(tree, Tensor):
        return [tree]
    if isinstance(tree, dict):
        tree = list(tree.values())
    if isinstance(tree, (list, tuple)):
        return [t for item in tree for t in _tensors(item)]
    return []


def _check_count(value: int, name: str, minimum: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


@dataclass(frozen=True, kw_only=True)
class BatchedImplicit:
    r"""Implicit hypergradients of a batch of tasks, vectorised over the tasks with ``vmap``.

    Per task ``i``: ``inner_steps`` steps :math:`w \leftarrow w - \alpha \nabla_w g(w, \lambda, b_i)`
    from ``w0``, then :math:`H_i u_i = \nabla_w f` by ``cg_iters`` CG iterations (with
    :math:`H_i = \nabla^2_{ww} g + \text{damping}\, I`) and
    :math:`\nabla_\lambda f - \nabla^2_{\lambda w} g\, u_i`. ``result.grad`` is the mean over tasks.

    The losses take one task's batch; the batches passed to :meth:`hypergrad` are pytrees of
    tensors (tensors, tuples, lists, dicts) whose leaves all have the task dimension first.

    Args:
        inner_steps: gradient-descent steps per task (>= 0).
        inner_lr: their step size :math:`\alpha > 0`.
        cg_iters: CG iterations per task (>= 1); ``info`` reports the residual reached.
        damping: added to the Hessian (>= 0).

    Example:
        >>> import torch, hypergrad as hg
        >>> g = lambda w, lam, b: 0.5 * ((w["x"] - b) ** 2).sum() + 0.5 * ((w["x"] - lam["t"]) ** 2).sum()
        >>> f = lambda w, lam, b: 0.5 * ((w["x"] - b) ** 2).sum()
        >>> lam = {"t": torch.zeros(2, dtype=torch.float64)}
        >>> targets = torch.tensor([[1.0, 2.0], [3.0, 4.0]], dtype=torch.float64)  # two tasks
        >>> method = hg.batched.BatchedImplicit(inner_steps=50, inner_lr=0.5, cg_iters=2)
        >>> r = method.hypergrad(hg.BilevelProblem(g, f), {"x": lam["t"]}, lam, targets, targets)
        >>> r.task_grads["t"].shape, [round(v, 4) for v in r.grad["t"].tolist()]  # w* = (b + t) / 2
        (torch.Size([2, 2]), [-0.5, -0.75])
    """

    inner_steps: int = 10
    inner_lr: float = 0.1
    cg_iters: int = 10
    damping: float = 0.0

    def __post_init__(self) -> None:
        _check_count(self.inner_steps, "inner_steps", 0)
        _check_count(self.cg_iters, "cg_iters", 1)
        for name, strict in (("inner_lr", True), ("damping", False)):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
            if not (value > 0 if strict else value >= 0) or value == float("inf"):
                raise ValueError(f"{name} must be {'> 0' if strict else '>= 0'} and finite, got {value!r}")

    def task_fn(self, problem: BilevelProblem, w0: Tree, lam: Tree) -> Callable[[Any, Any], tuple]:
        """The per-task computation ``(inner_batch, outer_batch) -> (grad, w, f, inner residual, CG
        residual, indefinite)``, unbatched (``vmap`` it, or call it on one task)."""
        keys = list(w0)
        shapes = [w0[k].shape for k in keys]
        numels = [w0[k].numel() for k in keys]
        w0_flat = torch.cat([w0[k].detach().reshape(-1) for k in keys])
        lam = {k: v.detach() for k, v in lam.items()}
        steps, lr, iters, damping = self.inner_steps, float(self.inner_lr), self.cg_iters, float(self.damping)

        def unflat(v: Tensor) -> Tree:
            parts = v.split(numels) if len(numels) > 1 else (v,)
            return {k: p.reshape(s) for k, p, s in zip(keys, parts, shapes, strict=True)}

        def flat(t: Tree) -> Tensor:
            return torch.cat([t[k].reshape(-1) for k in keys])

        def run(inner_batch: Any, outer_batch: Any) -> tuple[Tree, Tensor, Tensor, Tensor, Tensor]:
            def grad_w(w_flat: Tensor, lam_: Tree) -> Tensor:
                return flat(torch.func.grad(lambda t: problem.inner(t, lam_, inner_batch))(unflat(w_flat)))

            w = w0_flat
            for _ in range(steps):
                w = w - lr * grad_w(w, lam)
            f_value, (gf_w, gf_lam) = torch.func.grad_and_value(
                lambda w_, lam_: problem.outer(unflat(w_), lam_, outer_batch), argnums=(0, 1)
            )(w, lam)[::-1]

            def hvp(v: Tensor) -> Tensor:
                out = torch.func.jvp(lambda w_: grad_w(w_, lam), (w,), (v,))[1]
                return out + damping * v if damping else out

            tiny = torch.finfo(w.dtype).tiny
            x = torch.zeros_like(gf_w)
            r = gf_w
            p = r
            rs = torch.dot(r, r)
            ok = torch.ones((), dtype=torch.bool, device=w.device)
            indefinite = torch.zeros((), dtype=torch.bool, device=w.device)
            zero = torch.zeros((), dtype=w.dtype, device=w.device)
            for _ in range(iters):
                Ap = hvp(p)
                curvature = torch.dot(p, Ap)
                # a lane stops (as the eager CG does) at a non-positive curvature or a zero residual
                indefinite = indefinite | (ok & (rs > 0) & ~(curvature > 0))
                ok = ok & (curvature > 0) & (rs > 0)
                alpha = torch.where(ok, rs / torch.clamp(curvature, min=tiny), zero)
                x = x + alpha * p
                r = r - alpha * Ap
                rs_new = torch.dot(r, r)
                p = torch.where(ok, r + (rs_new / torch.clamp(rs, min=tiny)) * p, p)
                rs = torch.where(ok, rs_new, rs)
            _, vjp_lam = torch.func.vjp(lambda lam_: grad_w(w, lam_), lam)
            (mixed,) = vjp_lam(x)
            grad = {k: gf_lam[k] - mixed[k] for k in gf_lam}
            cg_res = torch.sqrt(rs) / torch.clamp(torch.linalg.vector_norm(gf_w), min=tiny)
            inner_res = torch.linalg.vector_norm(grad_w(w, lam))
            return grad, unflat(w), f_value, inner_res, cg_res, indefinite

        return run

    def hypergrad(
        self,
        problem: BilevelProblem,
        w0: Tree,
        lam: Tree,
        inner_batches: Any,
        outer_batches: Any,
    ) -> BatchedResult:
        """Run every task (``vmap`` over the leading dimension of the batches) and return the
        mean and per-task hypergradients."""
        w0, lam = check_tree(w0, "w0"), check_tree(lam, "lam")
        tasks = {int(t.shape[0]) if t.dim() else 0 for t in _tensors((inner_batches, outer_batches))}
        if len(tasks) != 1:
            raise ValueError(
                "inner_batches and outer_batches must be tensors (or pytrees of tensors) sharing one "
                f"leading task dimension, got leading sizes {sorted(tasks)}"
            )
        with torch.no_grad():
            grads, w, f, inner_res, cg_res, indefinite = torch.func.vmap(self.task_fn(problem, w0, lam))(
                inner_batches, outer_batches
            )
        n_bad = int(indefinite.sum())
        if n_bad:
            _warnings.warn(
                f"BatchedImplicit: CG met a non-positive curvature in {n_bad} of {indefinite.numel()} tasks "
                "and stopped their solves there (result.indefinite): their Hessians are not positive "
                "definite at the final inner iterate (more or smaller inner steps, or damping)",
                ConvergenceWarning, stacklevel=2,
            )
        mean = {k: v.mean(0) for k, v in grads.items()}
        return BatchedResult(mean, grads, w, f, inner_res, cg_res, indefinite)
