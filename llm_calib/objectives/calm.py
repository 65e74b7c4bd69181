"""``calm``: the bilevel objective (λ on g, θ on f subject to g's optimality) and its solver configs.

:class:`Calm` holds one solver config, :class:`Bome`, :class:`F2SA` or :class:`ImplicitSolver`
(registered with :func:`~llm_calib.objectives.registry.register_solver`); each validates its
settings and builds its :mod:`hypergrad` method.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import torch

import hypergrad as hg
from llm_calib.adjustment import ADJUSTMENT_KINDS
from llm_calib.calm.attention import second_order_attention
from llm_calib.calm.methods import theta_optimizer
from llm_calib.checks import check_int, check_number
from llm_calib.objectives.base import Objective, settings_from_dict
from llm_calib.objectives.registry import (
    register_objective,
    register_solver,
    solver_class,
    solver_names,
)

if TYPE_CHECKING:
    from llm_calib.calm.config import CalibrationConfig
    from llm_calib.calm.objectives import Batch
    from llm_calib.calm.training import Trainer, TrainState

__all__ = [
    "ADJUSTMENT_CHOICES", "F2SA", "Bome", "Calm", "CalmSolver", "ImplicitSolver",
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
        inner_steps: lower-level steps per outer step.
        inner_lr: their step size; None: the solver's default.
    """

    name: ClassVar[str]
    scores_f_at_step: ClassVar[bool]
    inner_steps: int
    inner_lr: float | None

    def step_size(self, config: CalibrationConfig) -> float:
        """The step size of the solver's inner steps in a run with ``config``."""

    def build(self, config: CalibrationConfig) -> Any:
        """The :mod:`hypergrad` method of a run with ``config``."""


@register_solver("bome")
@dataclass
class Bome:
    """BOME (:class:`hypergrad.BOME`): ``inner_steps`` plain-SGD steps define the value function; θ steps by
    :func:`~llm_calib.calm.methods.theta_optimizer`.

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
    field_choices: ClassVar[dict[str, tuple[str, ...]]] = {"barrier": ("value", "gradient")}
    default_inner_lr: ClassVar[float] = 5e-2

    def __post_init__(self) -> None:
        self.eta = check_number("objective.solver.eta", self.eta, positive=True)
        if self.barrier not in self.field_choices["barrier"]:
            raise ValueError(f"objective.solver.barrier must be 'value' or 'gradient', got {self.barrier!r}")
        _check_inner("objective.solver", self)

    def step_size(self, config: CalibrationConfig) -> float:
        """:attr:`inner_lr` when set, else 5e-2 (large enough for the lower level to bind)."""
        return self.default_inner_lr if self.inner_lr is None else self.inner_lr

    def build(self, config: CalibrationConfig) -> hg.BOME:
        """The :class:`hypergrad.BOME` of the run."""
        return hg.BOME(
            hg.inner.SGD(lr=self.step_size(config)), w_lr=config.training.lr, inner_steps=self.inner_steps,
            eta=self.eta, barrier=self.barrier, w_optimizer=theta_optimizer(config),
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
    evaluate: ClassVar[str] = "advanced"

    def __post_init__(self) -> None:
        self.sigma = check_number("objective.solver.sigma", self.sigma, positive=True)
        _check_inner("objective.solver", self)

    def step_size(self, config: CalibrationConfig) -> float:
        """:attr:`inner_lr` when set, else θ's rate ``config.training.lr``."""
        return config.training.lr if self.inner_lr is None else self.inner_lr

    def build(self, config: CalibrationConfig) -> hg.Penalty:
        """The :class:`hypergrad.Penalty` of the run."""
        return hg.Penalty(sigma=self.sigma, inner_optimizer=theta_optimizer(config, self.step_size(config)),
                          inner_steps=self.inner_steps, evaluate=self.evaluate)


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

    def __post_init__(self) -> None:
        check_int("objective.solver.maxiter", self.maxiter, minimum=1)
        self.damping = check_number("objective.solver.damping", self.damping, minimum=0)
        self.tol = check_number("objective.solver.tol", self.tol, positive=True)
        _check_inner("objective.solver", self)

    def step_size(self, config: CalibrationConfig) -> float:
        """:attr:`inner_lr` when set, else θ's rate ``config.training.lr``."""
        return config.training.lr if self.inner_lr is None else self.inner_lr

    def build(self, config: CalibrationConfig) -> hg.AlternatingImplicit:
        """The :class:`hypergrad.AlternatingImplicit` of the run."""
        cg = hg.linear.CG(tol=self.tol, maxiter=self.maxiter, damping=self.damping)
        return hg.AlternatingImplicit(theta_optimizer(config, self.step_size(config)), self.inner_steps,
                                      hg.Implicit(solver=cg, warm_start=True), solve_context=_capped_second_order_solve)


@register_objective("calm")
@dataclass
class Calm(Objective):
    """CALM: λ and θ trained on ``BilevelProblem(inner=g, outer=f)`` by a solver, then an Adam step of λ within its
    bounds.

    The step's record holds ``g``, ``unlabeled_entropy`` (−f at the step's θ) and the solver's diagnostics.

    Attributes:
        solver: a registered solver config: :class:`Bome` (default), :class:`F2SA` or :class:`ImplicitSolver`.
        adjustment: λ variant (:data:`ADJUSTMENT_CHOICES`; ``"auto"``: where the prediction is made,
            :func:`~llm_calib.calm.methods.resolve_adjustment`).
        lam_lr: learning rate of λ (Adam).
        max_log_scale, max_bias: bounds on λ.

    Example:
        >>> Calm.trains_adjustment, Calm.from_dict({"solver": {"name": "f2sa"}}).solver
        (True, F2SA(sigma=0.1, inner_steps=5, inner_lr=None))
    """

    solver: Any = field(default_factory=Bome)
    adjustment: str = Objective.adjustment
    lam_lr: float = Objective.lam_lr
    max_log_scale: float = Objective.max_log_scale
    max_bias: float = Objective.max_bias
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

    def make_solver(self, config: CalibrationConfig) -> Any:
        """The solver's :mod:`hypergrad` method."""
        return self.solver.build(config)

    def step(self, trainer: Trainer, state: TrainState, inner: Batch) -> dict[str, float]:
        """One CALM step (see the class docstring)."""
        outer = trainer.unlabeled_batch(state.step)
        lam_now = {k: v.detach() for k, v in state.lam.items()}
        trainer.step_losses.reset()
        r = trainer.solver.hypergrad(trainer.problem, state.theta, lam_now, inner, outer, state.solver_state)
        state.lam_optimizer.zero_grad(set_to_none=False)
        for k, p in state.lam.items():
            p.grad = r.grad[k].detach().clone()
        state.lam_optimizer.step()
        trainer.adjustment.clamp_(state.lam)
        seen = trainer.step_losses.values
        record = {"g": seen["g"]}
        if self.solver.scores_f_at_step:
            record["unlabeled_entropy"] = -seen["f"]
        else:  # f was evaluated elsewhere (F2SA: at its penalised iterate); score the step's θ (no grad)
            with torch.no_grad():
                record["unlabeled_entropy"] = -float(trainer.losses.outer(state.theta, lam_now, outer))
        state.theta, state.solver_state = r.w, r.state
        record.update({k: float(v) for k, v in r.info.extra.items() if isinstance(v, (int, float))})
        return record
