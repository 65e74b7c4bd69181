r"""Fully first-order hypergradients by the penalty method F2SA (Kwon et al., 2023)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from hypergrad.autodiff import inner_grads, loss_and_grads
from hypergrad.batches import per_step
from hypergrad.compiled import (
    all_finite,
    eager_fallback,
    grad_and_value,
    non_finite_fallback,
    replayable,
    run_stage,
    traced_stage,
)
from hypergrad.errors import check_compile_options, check_inner_optimizer
from hypergrad.inner import InnerOptimizer
from hypergrad.problem import BilevelProblem, HypergradInfo, HypergradResult
from hypergrad.tree import (
    Tree,
    check_finite,
    check_like,
    check_tree,
    tree_all_finite,
    tree_detach,
    tree_norm,
    tree_scale,
    tree_sub,
)

__all__ = ["Penalty", "compiled_penalty"]


_EVALUATE = ("advanced", "current")


def _penalised_loss(problem: BilevelProblem, sigma: float, inner_batch: Any,
                    outer_batch: Any) -> Callable[[Tree, Tree], torch.Tensor]:
    return lambda w_, lam_: (problem.inner_loss(w_, lam_, inner_batch)
                             + sigma * problem.outer_loss(w_, lam_, outer_batch))


@dataclass(frozen=True)
class Penalty:
    r"""F2SA: the hypergradient from two first-order inner iterates, no second derivatives.

    Two inner iterates are tracked across calls: :math:`w \approx w^*(\lambda) = \arg\min_w g`
    and :math:`w_\sigma \approx \arg\min_w\, g + \sigma f`. Then

    .. math::
        \nabla F(\lambda) \approx \nabla_\lambda f(w_\sigma, \lambda)
            + \frac{\nabla_\lambda g(w_\sigma, \lambda) - \nabla_\lambda g(w, \lambda)}{\sigma}
        = \frac{\nabla_\lambda (g + \sigma f)(w_\sigma, \lambda)
            - \nabla_\lambda g(w, \lambda)}{\sigma}.

    Why it works: :math:`w_\sigma = w^* - \sigma H^{-1}\nabla_w f + O(\sigma^2)` with
    :math:`H = \nabla^2_{ww} g`, so the difference quotient equals
    :math:`-\nabla^2_{\lambda w} g\, H^{-1} \nabla_w f + O(\sigma)`, the implicit term.

    **Bias/variance trade-off.** With exact inner solutions the error is :math:`O(\sigma)`
    (linear: halving ``sigma`` halves it). But any error :math:`\delta` in ``w`` or
    :math:`w_\sigma` (inexact inner optimisation, stochastic inner batches) enters divided by
    :math:`\sigma`, as :math:`O(\delta / \sigma)`: small ``sigma`` means small bias but large
    variance, and needs more accurate inner iterates. Kwon et al. increase :math:`1/\sigma`
    slowly over the outer iterations; here ``sigma`` is fixed per instance.

    Each call runs ``inner_steps`` (``T``) optimizer steps on both iterates. Every evaluation
    pair is two backward passes giving the ``w``- and :math:`\lambda`-gradients together: of
    :math:`g` at ``w``, and of :math:`g + \sigma f` at :math:`w_\sigma`, which differentiates
    both :math:`g` and :math:`f`, so a pair costs 3 gradients (``info.grad_evals`` counts
    every one). Where the estimate is taken is set by ``evaluate``:

    * ``"current"`` (default): the backward passes of the last step also give the :math:`\lambda`-gradients,
      so the estimate is taken at the iterates before that step (after ``T - 1`` steps), and
      nothing is evaluated twice. Cost ``3 T`` gradients, the floor of the method: 3 at
      ``T = 1`` (``g`` at ``w``; ``g`` and ``f`` at :math:`w_\sigma`). Across an outer loop it
      is Algorithm 1 with the estimate lagging the iterates by one inner step; at a steady state
      (iterates at their optima) both give the same number.
    * ``"advanced"`` (Algorithm 1 of Kwon et al. as written): after the ``T`` steps, one more
      evaluation of both losses at the advanced iterates. Cost ``3 T + 3`` gradients (6 at
      ``T = 1``), twice the floor at ``T = 1``. Use it for a single call from a cold start with
      small ``T``, where the estimate should see the last step.

    Batches: ``inner_batch`` and ``outer_batch`` are each one batch reused for every
    evaluation, or a :class:`~hypergrad.batches.StepBatches` giving a fresh batch per
    evaluation pair (``T`` of them, ``T + 1`` with ``"advanced"``; :func:`hypergrad.solve`
    passes these for batch streams). Both iterates of a pair see the same batches, so the
    difference of :math:`\lambda`-gradients in the estimate is taken on one batch.

    ``info.converged`` is True when both inner residuals at the evaluation point,
    :math:`\lVert\nabla_w g(w)\rVert` and :math:`\lVert\nabla_w (g + \sigma f)(w_\sigma)\rVert`
    (``info.extra["inner_residual"]`` and ``["sigma_residual"]``), are at most ``tol``: only then
    is the estimate within :math:`O(\sigma)` of the hypergradient (an error :math:`\delta` in the
    iterates enters as :math:`O(\delta / \sigma)`, see above).

    State: ``state["w_sigma"]`` and the two optimizer states ``state["opt_state"]`` (of ``w``)
    and ``state["sigma_opt_state"]`` (of :math:`w_\sigma`) are carried between calls;
    ``state["w"]`` is the advanced ``w`` (the same tensors as ``result.w``; the ``w`` argument
    always takes precedence). On the first call (``state=None``) :math:`w_\sigma` starts at ``w``.

    Args:
        sigma: penalty weight :math:`\sigma > 0` of the outer loss (the bias is :math:`O(\sigma)`).
        inner_optimizer: optimizer stepping ``w`` on ``g``, e.g. ``hg.inner.SGD(lr=1 / L_g)``.
        inner_steps: steps ``T >= 1`` on each iterate per call.
        sigma_optimizer: optimizer stepping :math:`w_\sigma` on :math:`g + \sigma f`; defaults to
            ``inner_optimizer`` (fine while :math:`\sigma L_f \ll L_g`).
        evaluate: ``"advanced"`` or ``"current"``, where the estimate is taken (see above).
        tol: gradient-norm tolerance on both inner residuals for ``info.converged`` (>= 0).
        compile: run each call as one graph traced by :func:`torch.compile` and compiled by
            inductor (:func:`compiled_penalty`): the same arithmetic, state and
            counts without the per-operator overhead of eager PyTorch. Compiles once per problem,
            shape, dtype and configuration, falls back to eager with a log line where compilation
            fails; ``info.extra["compiled"]`` and ``["compile_s"]`` say what happened.
        device_scalars: read nothing back to the host inside the call (on a GPU every read
            drains the queue): ``info.residual``, ``info.extra["inner_residual"]``,
            ``["sigma_residual"]`` and ``["gap"]`` stay 0-dim tensors where the gradients are,
            ``info.converged`` is a 0-dim bool tensor, and ``info.extra["finite"]`` a 0-dim bool
            tensor saying whether the losses, the new :math:`w_\sigma` and the estimate were
            finite; the default's finiteness checks (a :class:`~hypergrad.errors.NonFiniteError`
            at once) are then the caller's. Same numbers otherwise; not with ``compile``.

    Raises:
        ValueError: ``sigma <= 0``, ``inner_steps < 1``, ``tol < 0`` or an unknown ``evaluate``; a
            ``state`` whose ``w_sigma`` does not match ``w``; ``compile`` with ``device_scalars``.
        TypeError: non-numeric ``sigma``, non-integer ``inner_steps``, a non-bool ``compile``, or
            an optimizer without ``init``/``update``.

    Example:
        >>> import torch, hypergrad as hg
        >>> g = lambda w, lam, b: 0.5 * ((w["x"] - lam["c"]) ** 2).sum()
        >>> f = lambda w, lam, b: 0.5 * (w["x"] ** 2).sum()
        >>> lam = {"c": torch.tensor([1.0, 2.0], dtype=torch.float64)}
        >>> method = hg.Penalty(sigma=1e-3, inner_optimizer=hg.inner.SGD(lr=0.5), inner_steps=50,
        ...                     evaluate="advanced")
        >>> w0 = {"x": torch.zeros(2, dtype=torch.float64)}
        >>> r = method.hypergrad(hg.BilevelProblem(g, f), w0, lam)
        >>> [round(x, 2) for x in r.grad["c"].tolist()]   # exact: dF/dc = c
        [1.0, 2.0]
        >>> sorted(r.state), r.info.grad_evals, r.info.converged
        (['opt_state', 'sigma_opt_state', 'w', 'w_sigma'], 153, True)
        >>> cheap = hg.Penalty(sigma=1e-3, inner_optimizer=hg.inner.SGD(lr=0.5))  # evaluate="current"
        >>> r = cheap.hypergrad(hg.BilevelProblem(g, f), r.w, lam, state=r.state)
        >>> [round(x, 2) for x in r.grad["c"].tolist()], r.info.grad_evals
        ([1.0, 2.0], 3)
    """

    takes_step_batches: ClassVar[bool] = True

    sigma: float
    inner_optimizer: InnerOptimizer
    _: KW_ONLY  # the options below are keyword-only
    inner_steps: int = 1
    sigma_optimizer: InnerOptimizer | None = None
    evaluate: str = "current"
    tol: float = 1e-4
    compile: bool = False
    device_scalars: bool = False

    def __post_init__(self) -> None:
        check_compile_options(self.compile, self.device_scalars)
        if not isinstance(self.sigma, (int, float)) or isinstance(self.sigma, bool):
            raise TypeError(f"sigma must be a real number, got {type(self.sigma).__name__}")
        if not 0.0 < self.sigma < float("inf"):
            raise ValueError(f"sigma must be a finite number > 0, got {self.sigma!r}")
        if not isinstance(self.inner_steps, int) or isinstance(self.inner_steps, bool):
            raise TypeError(f"inner_steps must be an int, got {type(self.inner_steps).__name__}")
        if self.inner_steps < 1:
            raise ValueError(f"inner_steps must be >= 1, got {self.inner_steps}")
        if self.evaluate not in _EVALUATE:
            raise ValueError(f"evaluate must be one of {_EVALUATE}, got {self.evaluate!r}")
        if not isinstance(self.tol, (int, float)) or isinstance(self.tol, bool):
            raise TypeError(f"tol must be a real number, got {type(self.tol).__name__}")
        if not self.tol >= 0.0:
            raise ValueError(f"tol must be >= 0, got {self.tol!r}")
        check_inner_optimizer(self.inner_optimizer, "inner_optimizer")
        if self.sigma_optimizer is not None:
            check_inner_optimizer(self.sigma_optimizer, "sigma_optimizer")

    def _optimizers(self) -> tuple[InnerOptimizer, InnerOptimizer]:
        opt = self.inner_optimizer
        return opt, (self.sigma_optimizer if self.sigma_optimizer is not None else opt)

    def hypergrad(
        self,
        problem: BilevelProblem,
        w: Tree,
        lam: Tree,
        inner_batch: Any = None,
        outer_batch: Any = None,
        state: dict[str, Any] | None = None,
    ) -> HypergradResult:
        """Advance ``w`` and ``w_sigma`` by ``inner_steps`` and return the F2SA estimate there."""
        if self.compile:
            return compiled_penalty(self, problem, w, lam, inner_batch, outer_batch, state)
        w, lam = problem.validate(w, lam)
        w, lam = tree_detach(w), tree_detach(lam)
        opt, sigma_opt = self._optimizers()
        sigma = float(self.sigma)
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

        T = self.inner_steps
        check = not self.device_scalars  # else nothing is read back: the caller reads extra["finite"]
        current = self.evaluate == "current"
        grad_lam_g: Tree | None = None
        grad_lam_pen: Tree | None = None
        # "advanced": T steps, then one more evaluation at the advanced iterates; "current": the
        # last step's evaluation is the estimate's. Each evaluation is a single backward giving the
        # w-gradient (for a step) and, where it is the estimate's, the lam-gradient.
        n_evals = T if current else T + 1
        estimate_at = n_evals - 1
        # One inner (and outer) batch per evaluation: both iterates see the same batch, so the
        # difference of lam-gradients at the estimate is taken on one batch.
        inner_batches, outer_batches = per_step(inner_batch, n_evals), per_step(outer_batch, n_evals)
        losses: list[Tensor] = []
        for t in range(n_evals):
            here = t == estimate_at
            penalised = _penalised_loss(problem, sigma, inner_batches[t], outer_batches[t])
            g_value, gw, lam_g = inner_grads(problem, inner_batches[t], w, lam, wrt_lam=here, check=check)
            pen_value, gws, lam_pen = loss_and_grads(
                penalised, w_sigma, lam, wrt_lam=here, what="penalised loss g + sigma f", check=check
            )
            assert gw is not None and gws is not None
            losses.extend((g_value, pen_value))
            if here:
                grad_lam_g, grad_lam_pen = lam_g, lam_pen
                norms = torch.stack([tree_norm(gw), tree_norm(gws), tree_norm(tree_sub(w_sigma, w))])
                if not current:
                    break
            with torch.no_grad():  # no graph: the iterates need no detaching
                w, opt_state = opt.update(w, gw, opt_state)
                w_sigma, sigma_opt_state = sigma_opt.update(w_sigma, gws, sigma_opt_state)
        assert grad_lam_g is not None and grad_lam_pen is not None
        if check:
            check_finite(w_sigma, "Penalty iterate w_sigma")
        grad = tree_scale(tree_sub(grad_lam_pen, grad_lam_g), 1.0 / sigma)
        if check:
            check_finite(grad, "Penalty (F2SA) hypergradient")
        tol = float(self.tol)
        if self.device_scalars:
            inner_residual, sigma_residual, gap = norms.unbind()
            converged: Any = (inner_residual <= tol) & (sigma_residual <= tol)
        else:  # one read for the three norms
            inner_residual, sigma_residual, gap = norms.tolist()
            converged = inner_residual <= tol and sigma_residual <= tol
        extra: dict[str, Any] = {"sigma": sigma, "inner_residual": inner_residual, "sigma_residual": sigma_residual,
                                 "gap": gap, "evaluate": self.evaluate}
        if self.device_scalars:
            extra["finite"] = (torch.isfinite(torch.stack(losses)).all() & tree_all_finite(w_sigma)
                               & tree_all_finite(grad))
        info = HypergradInfo(
            iterations=T,
            residual=inner_residual,
            converged=converged,
            stopping_test="inner residuals",
            grad_evals=3 * n_evals,
            extra=extra,
        )
        new_state: dict[str, Any] = {
            "w": w,
            "w_sigma": w_sigma,
            "opt_state": opt_state,
            "sigma_opt_state": sigma_opt_state,
        }
        return HypergradResult(tree_detach(grad), w, info, new_state)


# ------------------------------------------------------------ the compiled stage (compile=True)


@traced_stage("the F2SA step")
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
            (gw, grad_lam_g), g_value = grad_and_value(g, w, lam, (0, 1))
            (gws, grad_lam_pen), pen_value = grad_and_value(penalised, w_sigma, lam, (0, 1))
            losses += [g_value, pen_value]
            residuals = [tree_norm(gw), tree_norm(gws), tree_norm(tree_sub(w_sigma, w))]
            if not current:
                break
        else:
            gw, g_value = grad_and_value(g, w, lam, 0)
            gws, pen_value = grad_and_value(penalised, w_sigma, lam, 0)
            losses += [g_value, pen_value]
        w, opt_state = opt.update(w, gw, opt_state)
        w_sigma, sigma_opt_state = sigma_opt.update(w_sigma, gws, sigma_opt_state)
    grad = tree_scale(tree_sub(grad_lam_pen, grad_lam_g), 1.0 / sigma)
    finite = all_finite(losses, [w_sigma, grad])
    scalars = torch.stack([*residuals, finite.to(residuals[0].dtype)])
    return grad, w, w_sigma, opt_state, sigma_opt_state, scalars


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
    inner_batch, outer_batch = replayable(inner_batch), replayable(outer_batch)
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
    inner_batches = per_step(inner_batch, n_evals)
    ran = run_stage(problem, _penalty_stage, method, w, w_sigma, lam, inner_batches,
                    per_step(outer_batch, n_evals), opt_state, sigma_opt_state, checks=(w, lam, inner_batches[0]))
    if ran is None:
        return eager_fallback(method, problem, args)
    (grad, w, w_sigma, opt_state, sigma_opt_state, scalars), compile_s = ran
    inner_residual, sigma_residual, gap, finite = scalars.tolist()
    if not finite:
        return non_finite_fallback(method, problem, args)
    tol = float(method.tol)
    info = HypergradInfo(
        iterations=method.inner_steps,
        residual=inner_residual,
        converged=inner_residual <= tol and sigma_residual <= tol,
        stopping_test="inner residuals",
        grad_evals=3 * n_evals,
        extra={"sigma": float(method.sigma), "inner_residual": inner_residual, "sigma_residual": sigma_residual,
               "gap": gap, "evaluate": method.evaluate, "compiled": True, "compile_s": compile_s},
    )
    new_state = {"w": w, "w_sigma": w_sigma, "opt_state": opt_state, "sigma_opt_state": sigma_opt_state}
    return HypergradResult(grad, w, info, new_state)
