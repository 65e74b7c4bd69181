"""``calm``: the bilevel objective (λ on g, θ on f subject to g's optimality) and its solver configs.

:class:`Calm` holds one solver config, :class:`Bome`, :class:`F2SA` or :class:`ImplicitSolver`
(registered with :func:`~llm_calib.objectives.registry.register_solver`); each validates its
settings and builds its :mod:`hypergrad` method. A run's λ, its optimiser, the solver's method and
state and the bilevel problem live in its :class:`CalmState`, not in the training loop.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import torch
from torch import Tensor

import hypergrad as hg
from llm_calib.adjustment import ADJUSTMENT_KINDS, LogitAdjustment
from llm_calib.config.checks import check_int, check_number
from llm_calib.engine.attention import second_order_attention
from llm_calib.objectives.base import Objective, settings_from_dict
from llm_calib.objectives.registry import (
    register_objective,
    register_solver,
    solver_class,
    solver_names,
)

if TYPE_CHECKING:
    from llm_calib.training_interface import Batch, StepContext

__all__ = [
    "ADJUSTMENT_CHOICES", "F2SA", "Bome", "Calm", "CalmSolver", "CalmState", "ImplicitSolver",
]

ADJUSTMENT_CHOICES = ("auto", *ADJUSTMENT_KINDS)
"""The values of :attr:`Calm.adjustment`."""


def _check_inner(owner: str, solver: Any) -> None:
    check_int(f"{owner}.inner_steps", solver.inner_steps, minimum=1)
    if solver.inner_lr is not None:
        solver.inner_lr = check_number(f"{owner}.inner_lr", solver.inner_lr, positive=True)


class CalmSolver(Protocol):
    """What :class:`Calm` needs from a solver config.

    Attributes:
        name: the registered name (``objective.solver.name`` in a config file).
        scores_f_at_step: whether the solver evaluates f at the step's θ (BOME); else the step scores it again.
        second_order: whether the solver takes second derivatives (under ``torchrun`` the sharded units
            it differentiates through twice stay gathered:
            :func:`~llm_calib.calm.training.keep_differentiated_units_gathered`).
        inner_steps: lower-level steps per outer step.
        inner_lr: their step size; None: the solver's default.
    """

    name: ClassVar[str]
    scores_f_at_step: ClassVar[bool]
    second_order: ClassVar[bool]
    inner_steps: int
    inner_lr: float | None

    def step_size(self, lr: float) -> float:
        """The step size of the solver's inner steps in a run whose θ learns at rate ``lr``."""

    def build(self, theta_optimizer: hg.inner.Adam) -> Any:
        """The :mod:`hypergrad` method of a run whose θ optimiser is ``theta_optimizer``."""


@register_solver("bome")
@dataclass
class Bome:
    """BOME (:class:`hypergrad.BOME`): ``inner_steps`` plain-SGD steps define the value function; θ steps by
    the run's θ optimiser (:func:`~llm_calib.calm.run.theta_optimizer`).

    Attributes:
        eta: the barrier coefficient η > 0 (2: θ's step weighs the task loss about as much as the
            flat confidence penalty does; at 0.5 held-out accuracy fell below the guard).
        barrier: ``"value"`` (φ = η q) or ``"gradient"`` (default, φ = η‖∇q‖²).
        inner_steps: T, the plain-SGD steps of the value function.
        inner_lr: their step size; None (default): 5e-2.

    Example:
        >>> Bome(barrier="none")
        Traceback (most recent call last):
        ...
        ValueError: objective.solver.barrier must be 'value' or 'gradient', got 'none'
    """

    eta: float = 2.0
    barrier: str = "gradient"
    inner_steps: int = 5
    inner_lr: float | None = None
    scores_f_at_step: ClassVar[bool] = True
    second_order: ClassVar[bool] = False
    field_choices: ClassVar[dict[str, tuple[str, ...]]] = {"barrier": ("value", "gradient")}
    default_inner_lr: ClassVar[float] = 5e-2

    def __post_init__(self) -> None:
        self.eta = check_number("objective.solver.eta", self.eta, positive=True)
        if self.barrier not in self.field_choices["barrier"]:
            raise ValueError(f"objective.solver.barrier must be 'value' or 'gradient', got {self.barrier!r}")
        _check_inner("objective.solver", self)

    def step_size(self, lr: float) -> float:
        """:attr:`inner_lr` when set, else 5e-2 (large enough for the lower level to bind); ``lr`` is not used."""
        return self.default_inner_lr if self.inner_lr is None else self.inner_lr

    def build(self, theta_optimizer: hg.inner.Adam) -> hg.BOME:
        """The :class:`hypergrad.BOME` of the run: θ steps by ``theta_optimizer``."""
        return hg.BOME(
            hg.inner.SGD(lr=self.step_size(theta_optimizer.lr)), w_lr=theta_optimizer.lr,
            inner_steps=self.inner_steps, eta=self.eta, barrier=self.barrier, w_optimizer=theta_optimizer,
            device_scalars=True,  # the loop reads the step's numbers when it logs
        )


@register_solver("f2sa")
@dataclass
class F2SA:
    """F2SA (:class:`hypergrad.Penalty`): θ on g and θ_σ on g + σ f each take ``inner_steps`` Adam steps, evaluated
    at the last iterate.

    Attributes:
        sigma: the penalty weight σ > 0.
        inner_steps: the Adam steps of each iterate per outer step.
        inner_lr: their step size; None (default): θ's rate ``training.lr``.

    Example:
        >>> F2SA(sigma=0.2).sigma
        0.2
    """

    sigma: float = 0.1
    inner_steps: int = 5
    inner_lr: float | None = None
    scores_f_at_step: ClassVar[bool] = False
    second_order: ClassVar[bool] = False
    evaluate: ClassVar[str] = "advanced"

    def __post_init__(self) -> None:
        self.sigma = check_number("objective.solver.sigma", self.sigma, positive=True)
        _check_inner("objective.solver", self)

    def step_size(self, lr: float) -> float:
        """:attr:`inner_lr` when set, else θ's rate ``lr`` (``training.lr``)."""
        return lr if self.inner_lr is None else self.inner_lr

    def build(self, theta_optimizer: hg.inner.Adam) -> hg.Penalty:
        """The :class:`hypergrad.Penalty` of the run: its iterates step by ``theta_optimizer`` at :meth:`step_size`."""
        inner = dataclasses.replace(theta_optimizer, lr=self.step_size(theta_optimizer.lr))
        return hg.Penalty(sigma=self.sigma, inner_optimizer=inner, inner_steps=self.inner_steps, evaluate=self.evaluate,
                          device_scalars=True)  # the loop reads the step's numbers when it logs


@contextlib.contextmanager
def _capped_second_order_solve() -> Iterator[None]:
    """Attention with second derivatives; a capped CG solve is reported (``info.converged``), not warned about."""
    with second_order_attention(), warnings.catch_warnings():
        warnings.simplefilter("ignore", hg.ConvergenceWarning)
        yield


@register_solver("implicit")
@dataclass
class ImplicitSolver:
    """Exact hypergradients after lower-level steps (:class:`hypergrad.AlternatingImplicit`): ``inner_steps``
    Adam steps of θ on g, then damped conjugate gradients warm-started across steps.

    Attributes:
        maxiter: CG iterations per hypergradient, >= 1.
        damping: μ >= 0 in (H + μI) v = ∇_θ f (keeps the system positive definite).
        tol: relative residual > 0 at which CG stops early.
        inner_steps: the lower-level Adam steps per outer step.
        inner_lr: their step size; None (default): θ's rate ``training.lr``.

    Example:
        >>> ImplicitSolver(maxiter=0)
        Traceback (most recent call last):
        ...
        ValueError: objective.solver.maxiter must be an int >= 1, got 0
    """

    maxiter: int = 10
    damping: float = 1e-2
    tol: float = 1e-3
    inner_steps: int = 5
    inner_lr: float | None = None
    scores_f_at_step: ClassVar[bool] = False
    second_order: ClassVar[bool] = True

    def __post_init__(self) -> None:
        check_int("objective.solver.maxiter", self.maxiter, minimum=1)
        self.damping = check_number("objective.solver.damping", self.damping, minimum=0)
        self.tol = check_number("objective.solver.tol", self.tol, positive=True)
        _check_inner("objective.solver", self)

    def step_size(self, lr: float) -> float:
        """:attr:`inner_lr` when set, else θ's rate ``lr`` (``training.lr``)."""
        return lr if self.inner_lr is None else self.inner_lr

    def build(self, theta_optimizer: hg.inner.Adam) -> hg.AlternatingImplicit:
        """The :class:`hypergrad.AlternatingImplicit` of the run: lower-level steps by ``theta_optimizer`` at
        :meth:`step_size`."""
        cg = hg.linear.CG(tol=self.tol, maxiter=self.maxiter, damping=self.damping)
        inner = dataclasses.replace(theta_optimizer, lr=self.step_size(theta_optimizer.lr))
        return hg.AlternatingImplicit(inner, self.inner_steps, hg.Implicit(solver=cg, warm_start=True),
                                      solve_context=_capped_second_order_solve)


@register_objective("calm")
@dataclass
class Calm(Objective):
    """CALM: λ and θ trained on ``BilevelProblem(inner=g, outer=f)`` by a solver, then an Adam step of λ within its
    bounds.

    The step's record holds ``g``, ``unlabeled_entropy`` (−f at the step's θ) and the solver's diagnostics.

    Attributes:
        solver: a registered solver config: :class:`Bome` (default), :class:`F2SA` or :class:`ImplicitSolver`.
        adjustment: λ variant (:data:`ADJUSTMENT_CHOICES`; ``"auto"``: where the prediction is made, the
            :attr:`~llm_calib.formats.base.TaskFormat.auto_adjustment` of the run's format).
        lam_lr: learning rate of λ (Adam).
        max_log_scale, max_bias: bounds on λ.

    Example:
        >>> Calm.trains_adjustment, Calm.from_dict({"solver": {"name": "f2sa"}}).solver
        (True, F2SA(sigma=0.1, inner_steps=5, inner_lr=None))
    """

    solver: Any = field(default_factory=Bome)
    adjustment: str = "auto"
    lam_lr: float = 5e-2
    max_log_scale: float = 3.0
    max_bias: float = 10.0
    trains_adjustment: ClassVar[bool] = True
    field_choices: ClassVar[dict[str, tuple[str, ...]]] = {"adjustment": ADJUSTMENT_CHOICES}

    def __post_init__(self) -> None:
        if isinstance(self.solver, str):
            self.solver = {"name": self.solver}
        if isinstance(self.solver, dict):  # a registered solver's settings, tagged with its name (default bome)
            self.solver = settings_from_dict(solver_class(self.solver.get("name", "bome")), self.solver,
                                             "objective.solver")
        if not isinstance(self.solver, tuple(solver_class(n) for n in solver_names())):
            raise ValueError(f"objective.solver must be a registered solver config ({', '.join(solver_names())}), "
                             f"got {self.solver!r}")
        if self.adjustment not in ADJUSTMENT_CHOICES:
            raise ValueError(f"objective.adjustment must be one of {ADJUSTMENT_CHOICES}, got {self.adjustment!r}")
        self.lam_lr = check_number("objective.lam_lr", self.lam_lr, positive=True)
        self.max_log_scale = check_number("objective.max_log_scale", self.max_log_scale, positive=True)
        self.max_bias = check_number("objective.max_bias", self.max_bias, minimum=0)

    @property
    def second_order(self) -> bool:
        """Whether the solver takes second derivatives (:attr:`CalmSolver.second_order`)."""
        return self.solver.second_order

    def logit_adjustment(self, vocab_size: int, token_ids: Iterable[int], auto_kind: str) -> LogitAdjustment:
        """λ of kind :attr:`adjustment` (``"auto"``: ``auto_kind``) within :attr:`max_log_scale` and :attr:`max_bias`.

        Example:
            >>> Calm(adjustment="answer_tokens").logit_adjustment(10, [3, 1, 3], "vector").token_ids
            (1, 3)
        """
        bounds = {"max_log_scale": self.max_log_scale, "max_bias": self.max_bias}
        kind = auto_kind if self.adjustment == "auto" else self.adjustment
        if kind == "answer_tokens":
            return LogitAdjustment.for_tokens(token_ids, vocab_size, **bounds)
        return LogitAdjustment(kind, vocab_size, **bounds)

    def start(self, context: StepContext) -> CalmState:
        """λ at the identity, its Adam optimiser, the solver's method and the bilevel problem of the run."""
        return CalmState(self, context)


class _FirstValues:
    """Keeps the first value of each wrapped loss since the last :meth:`reset` (a step's start), as a
    detached tensor where it was computed (read back when the loop logs)."""

    def __init__(self) -> None:
        self.values: dict[str, Tensor] = {}

    def reset(self) -> None:
        self.values = {}

    def wrap(self, name: str, fn: Callable[..., Tensor]) -> Callable[..., Tensor]:
        def recorded(*args: Any) -> Tensor:
            value = fn(*args)
            if name not in self.values:
                self.values[name] = value.detach()
            return value

        return recorded


class CalmState:
    """A CALM run: λ and its optimiser, the solver's :mod:`hypergrad` method and state, and the problem.

    Made by :meth:`Calm.start` from the run's :class:`~llm_calib.training_interface.StepContext`
    (its losses carry λ's :class:`~llm_calib.adjustment.LogitAdjustment`).

    Attributes:
        lam: the current λ (leaf tensors stepped by ``lam_optimizer``).
        lam_optimizer: λ's :class:`torch.optim.Adam` (rate :attr:`Calm.lam_lr`).
        method: the solver's :mod:`hypergrad` method (:meth:`CalmSolver.build`).
        problem: ``BilevelProblem(inner=g, outer=f)`` of the run's losses.
        solver_state: the method's state between steps (BOME's θ optimiser, F2SA's iterates), or None.
        step_losses: the first g and f the method computed in the current step.
    """

    def __init__(self, objective: Calm, context: StepContext) -> None:
        losses = context.losses
        self.scores_f_at_step = objective.solver.scores_f_at_step
        self.method = objective.solver.build(context.theta_optimizer)
        self.step_losses = _FirstValues()
        self.problem = hg.BilevelProblem(inner=self.step_losses.wrap("g", losses.inner),
                                         outer=self.step_losses.wrap("f", losses.outer))
        self.lam = {k: v.clone().requires_grad_(True) for k, v in losses.initial_lam().items()}
        self.lam_optimizer = torch.optim.Adam(list(self.lam.values()), lr=objective.lam_lr)
        self.solver_state: Any = None

    def step(self, context: StepContext, inner: Batch) -> dict[str, float | Tensor]:
        """One CALM step: the method's joint step of θ and λ's direction, then one projected Adam step of λ.

        The record holds ``g``, ``unlabeled_entropy`` (−f at the step's θ) and the method's diagnostics, as
        0-dim tensors where they were computed (numbers where the method gives numbers), and the check
        ``solver_step_finite`` when the method flags its own finiteness (``info.extra["finite"]``): nothing
        is read back to the host here.
        """
        outer = context.unlabeled_batch()
        lam_now = {k: v.detach() for k, v in self.lam.items()}
        self.step_losses.reset()
        r = self.method.hypergrad(self.problem, context.theta, lam_now, inner, outer, self.solver_state)
        self.lam_optimizer.zero_grad(set_to_none=False)
        for k, p in self.lam.items():
            p.grad = r.grad[k].detach().clone()
        self.lam_optimizer.step()
        context.losses.adjustment.clamp_(self.lam)
        seen = self.step_losses.values
        record: dict[str, float | Tensor] = {"g": seen["g"]}
        if self.scores_f_at_step:
            record["unlabeled_entropy"] = -seen["f"]
        else:  # f was evaluated elsewhere (F2SA: at its penalised iterate); score the step's θ (no grad)
            with torch.no_grad():
                record["unlabeled_entropy"] = -context.losses.outer(context.theta, lam_now, outer)
        context.theta, self.solver_state = r.w, r.state
        for k, v in r.info.extra.items():
            if k == "finite" and isinstance(v, Tensor):
                record["solver_step_finite"] = v  # a check of the loop (see ObjectiveState.step)
            elif isinstance(v, (int, float)):  # bools too, as 1.0 / 0.0
                record[k] = float(v)
            elif isinstance(v, Tensor) and v.dim() == 0 and v.is_floating_point():
                record[k] = v.detach()
        return record

    def checkpoint(self) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
        """λ (``lam/``), the method's state (``method/``) and λ's optimiser state (``lam_optimizer``)."""
        return {"lam/": self.lam, "method/": self.solver_state or {}}, {"lam_optimizer": self.lam_optimizer.state_dict()}

    def restore(self, trees: dict[str, dict[str, Any]], meta: dict[str, Any]) -> None:
        """Load :meth:`checkpoint`'s trees and λ's optimiser state; λ's leaves stay the ones its optimiser steps."""
        with torch.no_grad():
            for k, v in trees.get("lam/", {}).items():
                self.lam[k].copy_(v)
        self.solver_state = trees.get("method/") or None
        if "lam_optimizer" in meta:
            self.lam_optimizer.load_state_dict(meta["lam_optimizer"])
