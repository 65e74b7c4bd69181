"""``label_smoothing``: cross-entropy against labels smoothed towards uniform over the options."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from torch import Tensor

from llm_calib.config.checks import check_number
from llm_calib.objectives.one_level import OneLevelObjective
from llm_calib.objectives.registry import register_objective

if TYPE_CHECKING:
    from llm_calib.training_interface import Batch, StepContext

__all__ = ["LabelSmoothing"]


@register_objective("label_smoothing")
@dataclass
class LabelSmoothing(OneLevelObjective):
    """CE with label smoothing ε (over the options; for open questions over the vocabulary).

    Attributes:
        eps: the smoothing mass ε, in [0, 1).

    Example:
        >>> LabelSmoothing(eps=1.0)
        Traceback (most recent call last):
        ...
        ValueError: objective.eps must be in [0, 1), got 1.0
    """

    eps: float = 0.1

    def __post_init__(self) -> None:
        self.eps = check_number("objective.eps", self.eps, minimum=0, below=1)

    def loss_fn(self, context: StepContext, inner: Batch,
                parts: dict[str, Tensor]) -> Callable[[dict[str, Tensor]], Tensor]:
        """Smoothed CE of ``inner`` under θ."""
        return lambda theta: context.losses.one_level(theta, inner, smoothing=self.eps)
