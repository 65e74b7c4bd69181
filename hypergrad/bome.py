r"""BOME: first-order bilevel optimization by a value-function constraint (Liu et al., 2022)."""

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
    tree_all_finite,
    tree_axpy,
    tree_detach,
    tree_dot,
    tree_sub,
)

__all__ = ["BOME", "compiled_bome"]

_BARRIERS = ("value", "gradient")


def bome_phi(q: float, dot: float, sq_norm: float, eta: float, barrier: str) -> float:
    r"""BOME's multiplier :math:`\varphi` from :math:`q`, :math:`\langle\nabla f,\nabla q\rangle`
    and :math:`\lVert\nabla q\rVert^2`.

    ``"value"``: :math:`\max((\eta q - \langle\nabla f,\nabla q\rangle) / \|\nabla q\|^2, 0)`;
    ``"gradient"``:
    :math:`\max((\eta \|\nabla q\|^2 - \langle\nabla f,\nabla q\rangle) / \|\nabla q\|^2, 0)`.
    Returns 0 when :math:`\nabla q = 0` (nothing to correct: ``w`` is inner-stationary).

    Example:
        >>> bome_phi(q=2.0, dot=1.0, sq_norm=4.0, eta=1.0, barrier="value")
        0.25
        >>> bome_phi(q=2.0, dot=1.0, sq_norm=4.0, eta=1.0, barrier="gradient")
        0.75
    """
    if barrier not in _BARRIERS:
        raise ValueError(f"barrier must be one of {_BARRIERS}, got {barrier!r}")
    if sq_norm <= 0.0:
        return 0.0
    target = eta * q if barrier == "value" else eta * sq_norm
    return max((target - dot) / sq_norm, 0.0)


def _phi_tensor(q: Tensor, dot: Tensor, sq_norm: Tensor, eta: float, barrier: str) -> Tensor:
    """:func:`bome_phi` on 0-dim tensors, computed where they are (nothing read back to the host).

    NaN in, NaN out (as :func:`bome_phi`: a NaN norm is not ``<= 0``).
    """
    target = eta * q if barrier == "value" else eta * sq_norm
    return torch.where(sq_norm <= 0, torch.zeros_like(sq_norm), torch.clamp_min((target - dot) / sq_norm, 0.0))


def _inner_loss(problem: BilevelProblem, batch: Any) -> Callable[[Tree, Tree], torch.Tensor]:
    return lambda w_, lam_: problem.inner_loss(w_, lam_, batch)


@dataclass(frozen=True)
class BOME:
    r"""BOME: a joint first-order step on :math:`(w, \lambda)` under a value-function constraint.

    The bilevel problem is rewritten as :math:`\min_{w,\lambda} f(w, \lambda)` subject to
    :math:`q(w, \lambda) = g(w, \lambda) - g(\hat w_T, \lambda) \le 0`, where :math:`\hat w_T` is
    ``inner_steps`` (``T``) steps of ``inner_optimizer`` from ``w`` on :math:`g(\cdot,\lambda)`,
    treated as a constant. With gradients and inner products over the concatenation of ``w`` and
    :math:`\lambda` (so :math:`\nabla_w q = \nabla_w g(w,\lambda)` and
    :math:`\nabla_\lambda q = \nabla_\lambda g(w,\lambda) - \nabla_\lambda g(\hat w_T,\lambda)`),
    the update direction is

    .. math::
        d = \nabla f + \varphi \nabla q, \qquad
        \varphi = \max\!\Big(\frac{\phi - \langle \nabla f, \nabla q\rangle}
                                   {\lVert\nabla q\rVert^2},\ 0\Big),

    the minimum-norm correction of :math:`\nabla f` with
    :math:`\langle d, \nabla q\rangle \ge \phi`, so that a step along :math:`-d` decreases
    :math:`q` at least at rate :math:`\phi`:
    :math:`\phi = \eta\, q` for ``barrier="value"`` (see :doc:`/methods/first_order`) and
    :math:`\phi = \eta \lVert\nabla q\rVert^2` for ``barrier="gradient"`` (the paper's default).
    :math:`\varphi = 0` when :math:`\nabla q = 0`.

    ``result.grad`` is :math:`d_\lambda` and ``result.w`` is :math:`w - \mathtt{w\_lr}\, d_w`; the
    outer optimizer steps :math:`\lambda` along ``grad`` (use plain SGD with ``lr = w_lr`` for the
    paper's joint step). Note that ``grad`` is an update direction, not an estimate of
    :math:`\nabla F`: it is :math:`\nabla_\lambda f` corrected towards feasibility, and it does
    not vanish at the bilevel solution before ``w`` has converged. BOME is therefore compared
    with the other methods by where it converges, not by the error of each ``grad``. Its
    stationary points satisfy
    :math:`\nabla_\lambda f = \nabla^2_{\lambda w} g\, (I - (I - \alpha H)^T) H^{-1} \nabla_w f`
    (SGD inner steps of size :math:`\alpha`, quadratic :math:`g`), the exact stationarity
    condition up to the factor :math:`(I - \alpha H)^T`, so larger ``T`` brings them closer to
    the bilevel solution.

    **Fixed steps stall at distance O(w_lr).** As ``w`` approaches :math:`w^*(\lambda)`,
    :math:`\nabla q \to 0` and :math:`\varphi` grows like :math:`1/\lVert w - w^*\rVert`, until
    the step :math:`\mathtt{w\_lr}\,\varphi \lVert H \rVert` reaches about 2; the iteration then
    settles on a 2-cycle with :math:`\lVert w - w^*\rVert = O(\mathtt{w\_lr}\, \lVert\nabla_w f
    \rVert)` and a matching :math:`O(\mathtt{w\_lr})` offset in :math:`\lambda`. Where
    :math:`\nabla_w f` is small at the solution (the validation loss nearly minimised by
    :math:`w^*`) the offset is negligible; otherwise decrease ``w_lr`` and the outer learning rate
    for high accuracy (measured on ridge regression with validation noise 0.05: offsets of 1e-3
    to 5e-3 in :math:`\lambda` at ``w_lr = 0.3``, shrinking about linearly with ``w_lr``).

    Cost: ``T + 2`` gradient evaluations per call (``info.grad_evals``): the first inner step's
    backward also yields :math:`\nabla_\lambda g(w, \lambda)`; one backward at
    :math:`\hat w_T` (for :math:`g(\hat w_T)` and :math:`\nabla_\lambda g(\hat w_T)`); one for
    :math:`\nabla f`. No second derivatives.

    Batches: ``inner_batch`` is one batch reused for all ``T`` inner steps, or a
    :class:`~hypergrad.batches.StepBatches` giving a fresh batch per step (:func:`hypergrad.solve`
    passes these for batch streams); :math:`q` and its gradients are taken on the first step's
    batch, so both values of :math:`g` in :math:`q` see the same data. ``outer_batch`` (one
    batch, or a ``StepBatches`` of which one is drawn) is that of :math:`\nabla f`.

    Args:
        inner_optimizer: optimizer for the ``T`` steps producing :math:`\hat w_T`, e.g.
            ``hg.inner.SGD(lr=1 / L_g)``.
        w_lr: step size of ``w`` along :math:`-d_w` (> 0). Optional when ``w_optimizer`` is
            given (which then sets the step and ``w_lr`` is not used); required otherwise.
        inner_steps: ``T >= 1``.
        eta: barrier coefficient :math:`\eta > 0`.
        barrier: ``"value"`` or ``"gradient"``, see above.
        w_optimizer: optional optimizer (e.g. ``hg.inner.Adam(lr)``) that steps ``w`` along
            :math:`d_w` instead of plain ``w - w_lr * d_w``; its state is carried in
            ``result.state["w_opt_state"]`` (pass it back through ``state``).
        tol: tolerance on the value-function gap for ``info.converged`` (>= 0).
        compile: run each call as one graph traced by :func:`torch.compile` and compiled by
            inductor (:func:`compiled_bome`): the same arithmetic and counts
            without the per-operator overhead of eager PyTorch, which dominates on cheap problems.
            Compiles once per problem, shape, dtype and configuration (seconds), falls back to
            eager with a log line where compilation fails; ``info.extra["compiled"]`` and
            ``["compile_s"]`` say what happened.
        device_scalars: read nothing back to the host inside the call (on a GPU every read
            drains the queue): :math:`q`, the inner products and :math:`\varphi` stay 0-dim
            tensors where the gradients are, ``info.residual``, ``info.extra["q"]``,
            ``["phi"]`` and ``["grad_q_norm"]`` are such tensors (float64 for
            :math:`\varphi` and the norm, as the host arithmetic), ``info.converged`` a 0-dim
            bool tensor, and ``info.extra["finite"]`` a 0-dim bool tensor saying whether every
            loss, :math:`\varphi` and both directions were finite. The finiteness checks of the
            default (a :class:`~hypergrad.errors.NonFiniteError` at once) are then the caller's:
            read ``finite`` when logging, before using or saving the result. Same numbers
            otherwise; not with ``compile``.

    ``info.converged`` is True when the constraint holds to ``tol`` at the given ``w``:
    :math:`q = g(w, \lambda) - g(\hat w_T, \lambda) \le` ``tol``, i.e. ``T`` more inner steps
    would lower :math:`g` by at most ``tol`` (``w`` is nearly inner-optimal, so ``d`` is close to
    a step on the bilevel objective). :math:`q` is in ``info.extra["q"]``.

    Raises:
        ValueError: ``inner_steps < 1``, ``eta <= 0``, ``w_lr <= 0``, ``tol < 0``, unknown
            ``barrier``, or neither ``w_lr`` nor ``w_optimizer`` given.
        TypeError: non-numeric arguments, a non-bool ``compile`` or an optimizer without
            ``init``/``update``.

    Example:
        >>> import torch, hypergrad as hg
        >>> g = lambda w, lam, b: 0.5 * ((w["x"] - lam["c"]) ** 2).sum()
        >>> f = lambda w, lam, b: 0.5 * ((w["x"] - 3.0) ** 2).sum()
        >>> bome = hg.BOME(hg.inner.SGD(lr=0.5), w_lr=0.1, inner_steps=5, eta=0.5)
        >>> res = hg.solve(hg.BilevelProblem(g, f), {"x": torch.zeros(1)}, {"c": torch.zeros(1)},
        ...                bome, lambda p: torch.optim.SGD(p, lr=0.1), steps=500, progress=False)
        >>> round(res.lam["c"].item(), 3), round(res.w["x"].item(), 3)   # bilevel solution c = 3
        (3.0, 3.0)
        >>> adam = hg.BOME(hg.inner.SGD(lr=0.5), w_optimizer=hg.inner.Adam(lr=0.1))  # no w_lr needed
        >>> r = adam.hypergrad(hg.BilevelProblem(g, f), res.w, res.lam)
        >>> r.info.converged, r.info.extra["q"] < 1e-6   # w is inner-optimal for lam
        (True, True)
    """

    takes_step_batches: ClassVar[bool] = True

    inner_optimizer: InnerOptimizer
    _: KW_ONLY  # the options below are keyword-only
    w_lr: float | None = None
    inner_steps: int = 10
    eta: float = 0.5
    barrier: str = "value"
    w_optimizer: InnerOptimizer | None = None
    tol: float = 1e-6
    compile: bool = False
    device_scalars: bool = False

    def __post_init__(self) -> None:
        check_compile_options(self.compile, self.device_scalars)
        # check_inner_optimizer also refuses anything without callable init and update
        check_inner_optimizer(self.inner_optimizer, "inner_optimizer")
        if self.w_optimizer is not None:
            check_inner_optimizer(self.w_optimizer, "w_optimizer")
        if self.w_lr is None and self.w_optimizer is None:
            raise ValueError(
                "w_lr must be a number > 0 unless w_optimizer is given (it then sets the step of w)"
            )
        for name in ("w_lr", "eta"):
            value = getattr(self, name)
            if value is None:  # w_lr with a w_optimizer
                continue
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
            if not 0.0 < value < float("inf"):
                raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
        if not isinstance(self.inner_steps, int) or isinstance(self.inner_steps, bool):
            raise TypeError(f"inner_steps must be an int, got {type(self.inner_steps).__name__}")
        if self.inner_steps < 1:
            raise ValueError(f"inner_steps must be >= 1, got {self.inner_steps}")
        if self.barrier not in _BARRIERS:
            raise ValueError(f"barrier must be one of {_BARRIERS}, got {self.barrier!r}")
        if not isinstance(self.tol, (int, float)) or isinstance(self.tol, bool):
            raise TypeError(f"tol must be a real number, got {type(self.tol).__name__}")
        if not self.tol >= 0.0:
            raise ValueError(f"tol must be >= 0, got {self.tol!r}")

    def hypergrad(
        self,
        problem: BilevelProblem,
        w: Tree,
        lam: Tree,
        inner_batch: Any = None,
        outer_batch: Any = None,
        state: dict[str, Any] | None = None,
    ) -> HypergradResult:
        """Return the BOME direction ``d_lam`` as ``grad`` and ``w - w_lr * d_w`` as ``w``.

        ``state`` carries ``w_optimizer``'s state when one is set; otherwise BOME is stateless
        and the result's ``state`` is None.
        """
        if self.compile:
            return compiled_bome(self, problem, w, lam, inner_batch, outer_batch, state)
        w, lam = problem.validate(w, lam)
        w, lam = tree_detach(w), tree_detach(lam)
        check = not self.device_scalars  # else nothing is read back: the caller reads extra["finite"]

        # One inner batch per inner step; q = g(w) - g(w_hat_T) is taken on the first step's
        # batch, so that its two values (and their lam-gradients) are on the same batch.
        batches = per_step(inner_batch, self.inner_steps)
        (outer_batch,) = per_step(outer_batch, 1)
        g = _inner_loss(problem, batches[0])

        # Inner steps from w; the first backward also gives q's gradients at (w, lam). The updates
        # run under no_grad, so the iterates carry no graph.
        g_w, grad_w_g, grad_lam_g = inner_grads(problem, batches[0], w, lam, wrt_lam=True, check=check)
        assert grad_w_g is not None and grad_lam_g is not None
        opt = self.inner_optimizer
        opt_state = opt.init(w)
        with torch.no_grad():
            w_hat, opt_state = opt.update(w, grad_w_g, opt_state)
        for batch in batches[1:]:
            _, gw, _ = inner_grads(problem, batch, w_hat, lam, check=check)
            assert gw is not None
            with torch.no_grad():
                w_hat, opt_state = opt.update(w_hat, gw, opt_state)
        if check:
            check_finite(w_hat, "BOME inner iterate w_hat")
        g_hat, _, grad_lam_g_hat = loss_and_grads(g, w_hat, lam, wrt_w=False, what="inner loss", check=check)
        assert grad_lam_g_hat is not None
        f_value, grad_w_f, grad_lam_f = loss_and_grads(
            lambda w_, lam_: problem.outer_loss(w_, lam_, outer_batch), w, lam, what="outer loss", check=check
        )
        assert grad_w_f is not None and grad_lam_f is not None

        # q, the inner products and phi stay on the device; phi in float64, as bome_phi on floats
        q = g_w - g_hat
        grad_w_q = grad_w_g
        grad_lam_q = tree_sub(grad_lam_g, grad_lam_g_hat)
        sq_norm = tree_dot(grad_w_q, grad_w_q) + tree_dot(grad_lam_q, grad_lam_q)
        dot = tree_dot(grad_w_f, grad_w_q) + tree_dot(grad_lam_f, grad_lam_q)
        phi = _phi_tensor(q.double(), dot.double(), sq_norm.double(), float(self.eta), self.barrier)
        d_w = tree_axpy(phi, grad_w_q, grad_w_f)
        d_lam = tree_axpy(phi, grad_lam_q, grad_lam_f)
        if check:
            check_finite(d_lam, "BOME direction d_lam")
            check_finite(d_w, "BOME direction d_w")
        new_state: dict[str, Any] | None = None
        with torch.no_grad():
            if self.w_optimizer is None:
                assert self.w_lr is not None
                new_w = tree_axpy(-float(self.w_lr), d_w, w)
            else:
                w_opt_state = (state or {}).get("w_opt_state") or self.w_optimizer.init(w)
                new_w, w_opt_state = self.w_optimizer.update(w, d_w, w_opt_state)
                new_state = {"w_opt_state": tree_detach(w_opt_state)}
        grad_q_norm = sq_norm.double().sqrt()
        if self.device_scalars:
            finite = torch.isfinite(torch.stack([g_w, g_hat, f_value, sq_norm, dot]).double()).all()
            finite = finite & torch.isfinite(phi) & tree_all_finite(d_w) & tree_all_finite(d_lam)
            residual: Any = grad_q_norm
            converged: Any = q <= float(self.tol)
            extra: dict[str, Any] = {"phi": phi, "q": q, "grad_q_norm": grad_q_norm, "finite": finite}
        else:  # one read for the three numbers
            q_f, phi_f, norm_f = torch.stack([q.double(), phi, grad_q_norm]).tolist()
            residual, converged = norm_f, q_f <= float(self.tol)
            extra = {"phi": phi_f, "q": q_f, "grad_q_norm": norm_f}
        info = HypergradInfo(
            iterations=self.inner_steps,
            residual=residual,
            converged=converged,
            stopping_test="value-function gap",
            grad_evals=self.inner_steps + 2,
            extra=extra,
        )
        return HypergradResult(tree_detach(d_lam), new_w, info, new_state)


# ------------------------------------------------------------ the compiled stage (compile=True)


@traced_stage("the BOME step")
def _bome_stage(problem: BilevelProblem, method: Any, w: Tree, lam: Tree, step_batches: list[Any],
                gap_batch: Any, outer_batch: Any, w_opt_state: Tree | None) -> tuple[Any, ...]:
    """One call of :meth:`hypergrad.bome.BOME.hypergrad` as a traceable function (same arithmetic)."""
    opt = method.inner_optimizer

    def inner(batch: Any) -> Callable[[Tree, Tree], Tensor]:
        return lambda w_, l_: problem.inner_loss(w_, l_, batch)

    (grad_w_g, grad_lam_g), g_w = grad_and_value(inner(step_batches[0]), w, lam, (0, 1))
    losses = [g_w]
    w_hat, opt_state = opt.update(w, grad_w_g, opt.init(w))
    for batch in step_batches[1:]:
        grad_w, value = grad_and_value(inner(batch), w_hat, lam, 0)
        losses.append(value)
        w_hat, opt_state = opt.update(w_hat, grad_w, opt_state)
    grad_lam_g_hat, g_hat = grad_and_value(inner(gap_batch), w_hat, lam, 1)
    (grad_w_f, grad_lam_f), f_value = grad_and_value(
        lambda w_, l_: problem.outer_loss(w_, l_, outer_batch), w, lam, (0, 1))
    q = g_w - g_hat
    grad_lam_q = tree_sub(grad_lam_g, grad_lam_g_hat)
    sq_norm = tree_dot(grad_w_g, grad_w_g) + tree_dot(grad_lam_q, grad_lam_q)
    dot = tree_dot(grad_w_f, grad_w_g) + tree_dot(grad_lam_f, grad_lam_q)
    phi = _phi_tensor(q, dot, sq_norm, method.eta, method.barrier)
    d_w = tree_axpy(phi, grad_w_g, grad_w_f)
    d_lam = tree_axpy(phi, grad_lam_q, grad_lam_f)
    if method.w_optimizer is None:
        new_w, w_opt_state = tree_axpy(-float(method.w_lr), d_w, w), None
    else:
        new_w, w_opt_state = method.w_optimizer.update(w, d_w, w_opt_state)
    finite = all_finite([*losses, g_hat, f_value], [w_hat, d_lam, d_w])
    return d_lam, new_w, w_opt_state, torch.stack([q, sq_norm, phi, finite.to(q.dtype)])


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
    inner_batch, outer_batch = replayable(inner_batch), replayable(outer_batch)
    args = (w, lam, inner_batch, outer_batch, state)
    w, lam = problem.validate(w, lam)
    w, lam = tree_detach(w), tree_detach(lam)
    w_opt_state = None
    if method.w_optimizer is not None:
        w_opt_state = (state or {}).get("w_opt_state") or method.w_optimizer.init(w)
    batches = per_step(inner_batch, method.inner_steps)
    (outer_batch,) = per_step(outer_batch, 1)  # one outer batch per call, as in the eager call
    ran = run_stage(problem, _bome_stage, method, w, lam, batches, batches[0], outer_batch, w_opt_state,
                    checks=(w, lam, batches[0]))
    if ran is None:
        return eager_fallback(method, problem, args)
    (d_lam, new_w, w_opt_state, scalars), compile_s = ran
    q, sq_norm, phi, finite = scalars.tolist()
    if not finite:
        return non_finite_fallback(method, problem, args)
    info = HypergradInfo(
        iterations=method.inner_steps,
        residual=sq_norm**0.5,
        converged=q <= float(method.tol),
        stopping_test="value-function gap",
        grad_evals=method.inner_steps + 2,
        extra={"phi": phi, "q": q, "grad_q_norm": sq_norm**0.5, "compiled": True, "compile_s": compile_s},
    )
    new_state = None if w_opt_state is None else {"w_opt_state": w_opt_state}
    return HypergradResult(d_lam, new_w, info, new_state)
