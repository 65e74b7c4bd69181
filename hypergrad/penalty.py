r"""Fully first-order hypergradients by the penalty method F2SA (Kwon et al., 2023)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from hypergrad.autodiff import loss_and_grads
from hypergrad.inner import InnerOptimizer
from hypergrad.problem import BilevelProblem, HypergradInfo, HypergradResult
from hypergrad.tree import (
    Tree,
    check_finite,
    check_like,
    check_tree,
    tree_detach,
    tree_norm,
    tree_scale,
    tree_sub,
)

__all__ = ["Penalty"]


def _check_optimizer(opt: object, name: str) -> None:
    if not (callable(getattr(opt, "init", None)) and callable(getattr(opt, "update", None))):
        raise TypeError(
            f"{name} must be an inner optimizer with init(w) and update(w, grad, state) "
            f"(e.g. hypergrad.inner.SGD(lr=0.1)), got {opt!r}"
        )


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

    Each call runs ``inner_steps`` (``T``) optimizer steps on both iterates, then evaluates the
    estimate at the advanced iterates (Algorithm 1 of Kwon et al.). Every evaluation is one
    backward pass giving the ``w``- and :math:`\lambda`-gradients together: of :math:`g` at ``w``,
    and of :math:`g + \sigma f` at :math:`w_\sigma`. Cost: ``2 * T + 2`` gradient evaluations
    (4 at ``T = 1``; ``info.grad_evals``).

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

    Raises:
        ValueError: ``sigma <= 0`` or ``inner_steps < 1``; a ``state`` whose ``w_sigma`` does not
            match ``w``.
        TypeError: non-numeric ``sigma``, non-integer ``inner_steps``, or an optimizer without
            ``init``/``update``.

    Example:
        >>> import torch, hypergrad as hg
        >>> g = lambda w, lam, b: 0.5 * ((w["x"] - lam["c"]) ** 2).sum()
        >>> f = lambda w, lam, b: 0.5 * (w["x"] ** 2).sum()
        >>> lam = {"c": torch.tensor([1.0, 2.0], dtype=torch.float64)}
        >>> method = hg.Penalty(sigma=1e-3, inner_optimizer=hg.inner.SGD(lr=0.5), inner_steps=50)
        >>> w0 = {"x": torch.zeros(2, dtype=torch.float64)}
        >>> r = method.hypergrad(hg.BilevelProblem(g, f), w0, lam)
        >>> [round(x, 2) for x in r.grad["c"].tolist()]   # exact: dF/dc = c
        [1.0, 2.0]
        >>> sorted(r.state), r.info.grad_evals
        (['opt_state', 'sigma_opt_state', 'w', 'w_sigma'], 102)
    """

    sigma: float
    inner_optimizer: InnerOptimizer
    inner_steps: int = 1
    sigma_optimizer: InnerOptimizer | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.sigma, (int, float)) or isinstance(self.sigma, bool):
            raise TypeError(f"sigma must be a real number, got {type(self.sigma).__name__}")
        if not 0.0 < self.sigma < float("inf"):
            raise ValueError(f"sigma must be a finite number > 0, got {self.sigma!r}")
        if not isinstance(self.inner_steps, int) or isinstance(self.inner_steps, bool):
            raise TypeError(f"inner_steps must be an int, got {type(self.inner_steps).__name__}")
        if self.inner_steps < 1:
            raise ValueError(f"inner_steps must be >= 1, got {self.inner_steps}")
        _check_optimizer(self.inner_optimizer, "inner_optimizer")
        if self.sigma_optimizer is not None:
            _check_optimizer(self.sigma_optimizer, "sigma_optimizer")

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

        def g(w_: Tree, lam_: Tree) -> torch.Tensor:
            return problem.inner_loss(w_, lam_, inner_batch)

        def penalised(w_: Tree, lam_: Tree) -> torch.Tensor:
            return problem.inner_loss(w_, lam_, inner_batch) + sigma * problem.outer_loss(
                w_, lam_, outer_batch
            )

        T = self.inner_steps
        grad_lam_g: Tree | None = None
        grad_lam_pen: Tree | None = None
        # T steps, then one more evaluation at the advanced iterates. Each evaluation is a single
        # backward giving the w-gradient (for a step) and the lam-gradient (used after the last).
        for t in range(T + 1):
            last = t == T
            _, gw, grad_lam_g = loss_and_grads(g, w, lam, wrt_lam=last, what="inner loss")
            _, gws, grad_lam_pen = loss_and_grads(
                penalised, w_sigma, lam, wrt_lam=last, what="penalised loss g + sigma f"
            )
            if last:
                break
            assert gw is not None and gws is not None
            with torch.no_grad():
                w, opt_state = opt.update(w, gw, opt_state)
                w_sigma, sigma_opt_state = sigma_opt.update(w_sigma, gws, sigma_opt_state)
            w, w_sigma = tree_detach(w), tree_detach(w_sigma)
        assert grad_lam_g is not None and grad_lam_pen is not None
        assert gw is not None and gws is not None
        check_finite(w_sigma, "Penalty iterate w_sigma")
        grad = tree_scale(tree_sub(grad_lam_pen, grad_lam_g), 1.0 / sigma)
        check_finite(grad, "Penalty (F2SA) hypergradient")
        info = HypergradInfo(
            iterations=T,
            residual=float(tree_norm(gw)),
            converged=True,
            grad_evals=2 * T + 2,
            extra={
                "sigma": sigma,
                "inner_residual": float(tree_norm(gw)),
                "sigma_residual": float(tree_norm(gws)),
                "gap": float(tree_norm(tree_sub(w_sigma, w))),
            },
        )
        new_state: dict[str, Any] = {
            "w": w,
            "w_sigma": w_sigma,
            "opt_state": opt_state,
            "sigma_opt_state": sigma_opt_state,
        }
        return HypergradResult(tree_detach(grad), w, info, new_state)
