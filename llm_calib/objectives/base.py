"""What the training loop needs from an objective: :class:`Objective`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from llm_calib.calm.config import CalibrationConfig
    from llm_calib.calm.objectives import Batch
    from llm_calib.calm.training import Trainer, TrainState

__all__ = ["Objective"]


class Objective:
    """A training objective: its settings (as dataclass fields of a subclass) and its step.

    :func:`~llm_calib.calm.training.build_trainer` builds the run's objective with
    :func:`~llm_calib.objectives.registry.build_objective` and
    :func:`~llm_calib.calm.training.train_step` calls :meth:`step`; nothing else in the training
    code depends on which objective runs. Subclasses register with
    :func:`~llm_calib.objectives.registry.register_objective`; one-level losses derive from
    :class:`~llm_calib.objectives.one_level.OneLevelObjective` and define only their loss.

    Attributes:
        name: the registered name (set by ``register_objective``).
        trains_adjustment: True when the objective trains the logit adjustment λ (CALM): then its
            step updates ``state.lam`` and the step's record summarises λ.

    Example:
        >>> Objective.from_config(None)
        Objective()
    """

    name: ClassVar[str] = ""
    trains_adjustment: ClassVar[bool] = False

    @classmethod
    def from_config(cls, config: CalibrationConfig) -> Objective:
        """The objective with its settings read from ``config`` (default: no settings)."""
        return cls()

    def make_solver(self, config: CalibrationConfig) -> Any:
        """The bilevel solver the trainer calls on ``BilevelProblem(g, f)``; None (default): a
        one-level objective, no bilevel problem is built."""
        return None

    def step(self, trainer: Trainer, state: TrainState, inner: Batch) -> dict[str, float]:
        """Take one step on the training batch ``inner``: update ``state.theta`` (and the
        optimiser states, and λ when :attr:`trains_adjustment`) in place; return the step's
        record (losses and diagnostics, floats)."""
        raise NotImplementedError(f"{type(self).__name__} must define step(trainer, state, inner)")

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"
