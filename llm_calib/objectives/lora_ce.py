"""``lora_ce``: plain fine-tuning, the task cross-entropy (the baseline every method is compared with)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from torch import Tensor

from llm_calib.objectives.one_level import OneLevelObjective
from llm_calib.objectives.registry import register_objective

if TYPE_CHECKING:
    from llm_calib.training_interface import Batch, StepContext

__all__ = ["LoraCE"]


@register_objective("lora_ce")
@dataclass
class LoraCE(OneLevelObjective):
    """Cross-entropy of the training batch (options, or answer tokens), no settings.

    Example:
        >>> LoraCE().name
        'lora_ce'
    """

    def loss_fn(self, context: StepContext, inner: Batch,
                parts: dict[str, Tensor]) -> Callable[[dict[str, Tensor]], Tensor]:
        """CE of ``inner`` under θ."""
        return lambda theta: context.losses.one_level(theta, inner)
