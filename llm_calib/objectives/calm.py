"""``calm``: the bilevel objective (λ trained on g, θ on f subject to g's optimality) and its solvers.

:class:`Calm` holds its solver's config, one of :class:`Bome`, :class:`F2SA` or
:class:`ImplicitSolver` (registered by name with
:func:`~llm_calib.objectives.registry.register_solver`). Each solver config owns its settings,
their validation, its solver-specific defaults (:meth:`Bome.inner_lr`) and the factory of the
:mod:`hypergrad` method it builds (any object with ``hypergrad(problem, w, lam, inner_batch,
outer_batch, state)`` returning a :class:`hypergrad.HypergradResult`).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import torch

import hypergrad as hg
from llm_calib.calm.attention import second_order_attention
from llm_calib.calm.methods import theta_optimizer
from llm_calib.objectives.base import Objective
from llm_calib.objectives.registry import register_objective, register_solver, solver_class

if TYPE_CHECKING:
    from llm_calib.calm.config import CalibrationConfig
    from llm_calib.calm.objectives import Batch
    from llm_calib.calm.training import Trainer, TrainState

__all__ = ["F2SA", "Bome", "Calm", "CalmSolver", "ImplicitSolver", "inner_lr", "make_solver"]


def _check(owner: str, name: str, value: Any, allowed: str, ok: Any) -> None:
    if isinstance(value, bool) or not ok(value):
        raise ValueError(f"{owner}.{name} must be {allowed}, got {value!r}")


def _positive(value: Any) -> bool:
    return isinstance(value, (int, float)) and value > 0


class CalmSolver(Protocol):
    """What :class:`Calm` needs from a solver config.

    Attributes:
        name: the registered name (``CalibrationConfig.solver``).
        scores_f_at_step: True when the solver evaluates f once at the step's θ (BOME), so the
            step records that value as ``unlabeled_entropy``; otherwise (F2SA's f is at its
            penalised iterate) the step scores the step's θ again, without gradients.
    """

    name: ClassVar[str]
    scores_f_at_step: ClassVar[bool]

    @classmethod
    def from_config(cls, config: CalibrationConfig) -> CalmSolver:
        """The solver with its settings read from ``config``."""

    def inner_lr(self, config: CalibrationConfig) -> float:
        """The step size of the solver's inner steps under ``config``."""

    def build(self, config: CalibrationConfig) -> Any:
        """The :mod:`hypergrad` method of a run with ``config``."""


@register_solver("bome")
@dataclass
class Bome:
    """BOME: :class:`hypergrad.BOME` with ``inner_steps`` plain-SGD steps of :meth:`inner_lr`
    defining the value function, θ stepped along BOME's direction by
    :func:`~llm_calib.calm.methods.theta_optimizer`.

    Attributes:
        eta: the barrier coefficient η > 0 (``CalibrationConfig.bome_eta``).
        barrier: ``"value"`` (φ = η q) or ``"gradient"`` (φ = η‖∇q‖²) (``bome_barrier``).

    Example:
        >>> Bome(eta=0.5).barrier
        'gradient'
        >>> Bome(barrier="none")
        Traceback (most recent call last):
        ...
        ValueError: bome.barrier must be 'value' or 'gradient', got 'none'
    """

    eta: float = 2.0
    barrier: str = "gradient"
    scores_f_at_step: ClassVar[bool] = True
    default_inner_lr: ClassVar[float] = 5e-2
    """Plain SGD: large enough that the value function's ``inner_steps`` steps make the lower level bind."""

    def __post_init__(self) -> None:
        _check("bome", "eta", self.eta, "a number > 0", _positive)
        _check("bome", "barrier", self.barrier, "'value' or 'gradient'", lambda b: b in ("value", "gradient"))

    @classmethod
    def from_config(cls, config: CalibrationConfig) -> Bome:
        """η and the barrier from ``config.bome_eta`` / ``config.bome_barrier``."""
        return cls(eta=config.bome_eta, barrier=config.bome_barrier)

    def inner_lr(self, config: CalibrationConfig) -> float:
        """``config.inner_lr`` when set, else :attr:`default_inner_lr`."""
        return self.default_inner_lr if config.inner_lr is None else config.inner_lr

    def build(self, config: CalibrationConfig) -> hg.BOME:
        """The :class:`hypergrad.BOME` of the run."""
        return hg.BOME(
            hg.inner.SGD(lr=self.inner_lr(config)), w_lr=config.lr, inner_steps=config.inner_steps,
            eta=self.eta, barrier=self.barrier, w_optimizer=theta_optimizer(config),
        )


@register_solver("f2sa")
@dataclass
class F2SA:
    """F2SA: :class:`hypergrad.Penalty` whose two iterates (θ on g, θ_σ on g + σ f) take
    ``inner_steps`` Adam steps of :meth:`inner_lr` (by default θ's rate ``config.lr``), evaluated
    at the estimate after the last inner step (``evaluate="advanced"``, as the CALM results in
    ``benchmarks/results`` were measured).

    Attributes:
        sigma: the penalty weight σ > 0 (``CalibrationConfig.f2sa_sigma``).

    Example:
        >>> F2SA(sigma=0.2).sigma
        0.2
    """

    sigma: float = 0.1
    scores_f_at_step: ClassVar[bool] = False
    evaluate: ClassVar[str] = "advanced"

    def __post_init__(self) -> None:
        _check("f2sa", "sigma", self.sigma, "a number > 0", _positive)

    @classmethod
    def from_config(cls, config: CalibrationConfig) -> F2SA:
        """σ from ``config.f2sa_sigma``."""
        return cls(sigma=config.f2sa_sigma)

    def inner_lr(self, config: CalibrationConfig) -> float:
        """``config.inner_lr`` when set, else θ's rate ``config.lr``."""
        return config.lr if config.inner_lr is None else config.inner_lr

    def build(self, config: CalibrationConfig) -> hg.Penalty:
        """The :class:`hypergrad.Penalty` of the run."""
        return hg.Penalty(sigma=self.sigma, inner_optimizer=theta_optimizer(config, self.inner_lr(config)),
                          inner_steps=config.inner_steps, evaluate=self.evaluate)


@contextlib.contextmanager
def _capped_second_order_solve() -> Iterator[None]:
    """Attention with second derivatives, and a CG solve capped at ``maxiter`` without a warning
    per step (``info.converged`` reports it)."""
    with second_order_attention(), warnings.catch_warnings():
        warnings.simplefilter("ignore", hg.ConvergenceWarning)
        yield


@register_solver("implicit")
@dataclass
class ImplicitSolver:
    """Exact implicit differentiation after lower-level steps: :class:`hypergrad.AlternatingImplicit`
    takes ``inner_steps`` Adam steps of θ on g (of :meth:`inner_lr`, by default θ's rate), then the
    exact hypergradient by damped conjugate gradients, warm started across steps, in attention's
    math kernel (second derivatives); a capped CG solve is reported per step (``cg_converged``),
    not warned about. The first-order solvers approximate this direction; on CALM's problem they
    can point away from it (``benchmarks/results/calm_hypergradient.md``).

    Attributes:
        cg_maxiter: CG iterations per hypergradient, >= 1 (``CalibrationConfig.cg_maxiter``).
        cg_damping: damping μ >= 0 of the Hessian, (H + μI) v = ∇_θ f (``cg_damping``).
        cg_tol: relative residual > 0 at which CG stops early (``cg_tol``).

    Example:
        >>> ImplicitSolver(cg_maxiter=0)
        Traceback (most recent call last):
        ...
        ValueError: implicit.cg_maxiter must be an int >= 1, got 0
    """

    cg_maxiter: int = 10
    cg_damping: float = 1e-2
    cg_tol: float = 1e-3
    scores_f_at_step: ClassVar[bool] = False

    def __post_init__(self) -> None:
        _check("implicit", "cg_maxiter", self.cg_maxiter, "an int >= 1", lambda v: isinstance(v, int) and v >= 1)
        _check("implicit", "cg_damping", self.cg_damping, "a number >= 0",
               lambda v: isinstance(v, (int, float)) and v >= 0)
        _check("implicit", "cg_tol", self.cg_tol, "a number > 0", _positive)

    @classmethod
    def from_config(cls, config: CalibrationConfig) -> ImplicitSolver:
        """The CG settings from ``config.cg_maxiter`` / ``cg_damping`` / ``cg_tol``."""
        return cls(cg_maxiter=config.cg_maxiter, cg_damping=config.cg_damping, cg_tol=config.cg_tol)

    def inner_lr(self, config: CalibrationConfig) -> float:
        """``config.inner_lr`` when set, else θ's rate ``config.lr``."""
        return config.lr if config.inner_lr is None else config.inner_lr

    def build(self, config: CalibrationConfig) -> hg.AlternatingImplicit:
        """The :class:`hypergrad.AlternatingImplicit` of the run."""
        cg = hg.linear.CG(tol=self.cg_tol, maxiter=self.cg_maxiter, damping=self.cg_damping)
        return hg.AlternatingImplicit(theta_optimizer(config, self.inner_lr(config)), config.inner_steps,
                                      hg.Implicit(solver=cg, warm_start=True), solve_context=_capped_second_order_solve)


@register_objective("calm")
@dataclass
class Calm(Objective):
    """CALM: λ and θ trained on the bilevel problem ``BilevelProblem(inner=g, outer=f)`` by a solver.

    Each step: the solver's joint step of θ and its λ-direction, then one Adam step of λ
    projected onto its bounds. The record holds ``g`` (adjusted cross-entropy of the training
    batch at the step's θ), ``unlabeled_entropy`` (−f at the step's θ) and the solver's
    diagnostics (BOME: ``phi``, ``q``, ``grad_q_norm``).

    Attributes:
        solver: the solver's config (:class:`Bome` by default).

    Example:
        >>> Calm(solver=F2SA(sigma=0.2))
        Calm(solver=F2SA(sigma=0.2))
        >>> Calm.trains_adjustment
        True
    """

    solver: Any = field(default_factory=Bome)
    trains_adjustment: ClassVar[bool] = True

    @classmethod
    def from_config(cls, config: CalibrationConfig) -> Calm:
        """The solver registered as ``config.solver``, with its settings from ``config``."""
        return cls(solver=solver_class(config.solver).from_config(config))

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


def inner_lr(config: CalibrationConfig) -> float:
    """The inner step size of ``config.solver``: ``config.inner_lr`` when set, else the solver's
    default (BOME: ``5e-2``, plain SGD; F2SA and implicit: θ's Adam rate ``config.lr``).

    Example:
        >>> from llm_calib.calm.config import CalibrationConfig
        >>> inner_lr(CalibrationConfig(solver="f2sa", lr=3e-3)), inner_lr(CalibrationConfig())
        (0.003, 0.05)
    """
    return solver_class(config.solver).from_config(config).inner_lr(config)


def make_solver(config: CalibrationConfig) -> Any:
    """The :mod:`hypergrad` method of CALM's solver ``config.solver`` (see :class:`Bome`,
    :class:`F2SA`, :class:`ImplicitSolver`).

    Raises:
        ValueError: an unknown solver.

    Example:
        >>> from llm_calib.calm.config import CalibrationConfig
        >>> type(make_solver(CalibrationConfig(solver="f2sa"))).__name__
        'Penalty'
    """
    return Calm.from_config(config).make_solver(config)
