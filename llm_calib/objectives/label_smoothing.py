"""``label_smoothing``: cross-entropy against labels smoothed towards uniform over the options."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from torch import Tensor

from llm_calib.objectives.one_level import OneLevelObjective
from llm_calib.objectives.registry import register_objective

if TYPE_CHECKING:
    from llm_calib.calm.config import CalibrationConfig
    from llm_calib.calm.objectives import Batch
    from llm_calib.calm.training import Trainer, TrainState

__all__ = ["LabelSmoothing"]


@register_objective("label_smoothing")
@dataclass
class LabelSmoothing(OneLevelObjective):
    """CE with label smoothing ε (options; for open questions: over the vocabulary).

    Attributes:
        eps: the smoothing mass ε, in [0, 1) (``CalibrationConfig.label_smoothing``).

    Example:
        >>> LabelSmoothing(eps=0.2).eps
        0.2
        >>> LabelSmoothing(eps=1.0)
        Traceback (most recent call last):
        ...
        ValueError: label_smoothing.eps must be in [0, 1), got 1.0
    """

    eps: float = 0.1

    def __post_init__(self) -> None:
        if isinstance(self.eps, bool) or not isinstance(self.eps, (int, float)) or not 0.0 <= self.eps < 1.0:
            raise ValueError(f"label_smoothing.eps must be in [0, 1), got {self.eps!r}")
        self.eps = float(self.eps)

    @classmethod
    def from_config(cls, config: CalibrationConfig) -> LabelSmoothing:
        """ε from ``config.label_smoothing``."""
        return cls(eps=config.label_smoothing)

    def loss_fn(self, trainer: Trainer, state: TrainState, inner: Batch,
                parts: dict[str, Tensor]) -> Callable[[dict[str, Tensor]], Tensor]:
        """Smoothed CE of ``inner`` under θ."""
        return lambda theta: trainer.losses.one_level(theta, inner, smoothing=self.eps)
