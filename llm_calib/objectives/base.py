"""What the training loop needs from an objective: :class:`Objective`, and its config-file form."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from llm_calib.calm.config import CalibrationConfig
    from llm_calib.calm.objectives import Batch
    from llm_calib.calm.training import Trainer, TrainState

__all__ = ["Objective", "settings_from_dict", "settings_to_dict"]


def settings_to_dict(settings: Any) -> dict[str, Any]:
    """A registered settings dataclass as a dict tagged with its ``name`` (nested ones too; tuples become lists).

    Example:
        >>> from llm_calib.objectives.calm import Calm, F2SA
        >>> settings_to_dict(Calm(solver=F2SA(sigma=0.2)))["solver"]
        {'name': 'f2sa', 'sigma': 0.2, 'inner_steps': 5, 'inner_lr': None}
    """
    out: dict[str, Any] = {"name": settings.name}
    for f in dataclasses.fields(settings):
        value = getattr(settings, f.name)
        if dataclasses.is_dataclass(value) and getattr(value, "name", ""):
            value = settings_to_dict(value)
        elif isinstance(value, tuple):
            value = list(value)
        out[f.name] = value
    return out


def settings_from_dict(cls: type, data: dict[str, Any], path: str) -> Any:
    """``cls(**data)`` without the ``name`` tag, rejecting unknown keys by their ``path``.

    Raises:
        ValueError: a key that is not a field of ``cls`` (names it and the valid ones).

    Example:
        >>> from llm_calib.objectives.label_smoothing import LabelSmoothing
        >>> settings_from_dict(LabelSmoothing, {"beta": 0.2}, "objective")
        Traceback (most recent call last):
        ...
        ValueError: unknown objective key(s) ['beta'] for objective.name: label_smoothing; valid keys: ['eps', 'name']
    """
    known = {f.name for f in dataclasses.fields(cls)}
    kwargs = {k: v for k, v in data.items() if k != "name"}
    unknown = sorted(set(kwargs) - known)
    if unknown:
        raise ValueError(f"unknown {path} key(s) {unknown} for {path}.name: {cls.name}; "
                         f"valid keys: {sorted(known | {'name'})}")
    return cls(**kwargs)


class Objective:
    """A training objective: its settings (dataclass fields of a subclass) and its :meth:`step`.

    It is the ``objective`` part of :class:`~llm_calib.calm.config.CalibrationConfig`, registered by
    name with :func:`~llm_calib.objectives.registry.register_objective`. An objective that trains the
    logit adjustment λ (CALM) makes ``adjustment``, ``lam_lr``, ``max_log_scale`` and ``max_bias``
    fields; the others keep the class defaults (λ stays the identity).

    Attributes:
        name: the registered name.
        trains_adjustment: whether the step updates ``state.lam``.
        field_choices: the allowed values of string fields (command-line choices).

    Example:
        >>> from llm_calib.objectives.lora_ce import LoraCE
        >>> LoraCE().to_dict(), LoraCE().adjustment
        ({'name': 'lora_ce'}, 'auto')
    """

    name: ClassVar[str] = ""
    trains_adjustment: ClassVar[bool] = False
    field_choices: ClassVar[dict[str, tuple[str, ...]]] = {}
    adjustment = "auto"
    lam_lr = 5e-2
    max_log_scale = 3.0
    max_bias = 10.0

    def make_solver(self, config: CalibrationConfig) -> Any:
        """The bilevel solver of ``BilevelProblem(g, f)``; None (default): a one-level objective."""
        return None

    def step(self, trainer: Trainer, state: TrainState, inner: Batch) -> dict[str, float]:
        """One step on the training batch ``inner``: update ``state`` in place, return the step's record (floats)."""
        raise NotImplementedError(f"{type(self).__name__} must define step(trainer, state, inner)")

    def to_dict(self) -> dict[str, Any]:
        """The settings as a dict tagged with ``name`` (see :func:`settings_to_dict`)."""
        return settings_to_dict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Objective:
        """The objective of ``data`` (a ``name`` key is ignored), unknown keys rejected."""
        return settings_from_dict(cls, data, "objective")

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"
