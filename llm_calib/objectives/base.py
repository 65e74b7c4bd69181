"""What the training loop needs from an objective: :class:`Objective`, and its config-file form.

An objective talks to the loop through :mod:`llm_calib.training_interface` only: :meth:`Objective.start`
gets a :class:`~llm_calib.training_interface.StepContext` and returns the run's
:class:`~llm_calib.training_interface.ObjectiveState`, whose ``step`` the loop calls.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from llm_calib.adjustment import LogitAdjustment
    from llm_calib.training_interface import ObjectiveState, StepContext

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
    """A training objective: its settings (dataclass fields of a subclass) and the state of a run of it.

    It is the ``objective`` part of :class:`~llm_calib.config.calibration.CalibrationConfig`, registered by
    name with :func:`~llm_calib.objectives.registry.register_objective`. The settings stay as
    configured; what a run changes lives in the :class:`~llm_calib.training_interface.ObjectiveState`
    that :meth:`start` returns (an objective that trains a logit adjustment λ, as CALM does, keeps λ
    and its optimiser there and says which λ in :meth:`logit_adjustment`).

    Attributes:
        name: the registered name.
        trains_adjustment: whether its runs train a logit adjustment λ.
        second_order: whether its runs take second derivatives (CALM with the implicit solver).
        field_choices: the allowed values of string fields (command-line choices).

    Example:
        >>> from llm_calib.objectives.lora_ce import LoraCE
        >>> LoraCE().to_dict(), LoraCE().logit_adjustment(10, (), "vector") is None
        ({'name': 'lora_ce'}, True)
    """

    name: ClassVar[str] = ""
    trains_adjustment: ClassVar[bool] = False
    second_order: ClassVar[bool] = False
    field_choices: ClassVar[dict[str, tuple[str, ...]]] = {}

    def logit_adjustment(self, vocab_size: int, token_ids: Iterable[int], auto_kind: str) -> LogitAdjustment | None:
        """The logit adjustment λ a run of this objective trains, or None (default): it trains none.

        Args:
            vocab_size: the model's vocabulary size.
            token_ids: the answer tokens of the run's records (what ``"answer_tokens"`` adjusts).
            auto_kind: the kind the run's task format adjusts by default
                (:attr:`~llm_calib.formats.base.TaskFormat.auto_adjustment`).
        """
        return None

    def start(self, context: StepContext) -> ObjectiveState:
        """The state of a new run at step 0 (``context.losses`` carries :meth:`logit_adjustment`'s λ)."""
        raise NotImplementedError(f"{type(self).__name__} must define start(context)")

    def to_dict(self) -> dict[str, Any]:
        """The settings as a dict tagged with ``name`` (see :func:`settings_to_dict`)."""
        return settings_to_dict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Objective:
        """The objective of ``data`` (a ``name`` key is ignored), unknown keys rejected."""
        return settings_from_dict(cls, data, "objective")

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"
