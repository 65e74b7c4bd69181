"""``confidence_penalty``: CE on the training batch minus β times the entropy on the unlabelled batch."""

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

__all__ = ["ConfidencePenalty"]


@register_objective("confidence_penalty")
@dataclass
class ConfidencePenalty(OneLevelObjective):
    """The flat confidence penalty ``CE − β·H`` (H: mean entropy on CALM's unlabelled batch), a one-level ablation
    of CALM.

    Attributes:
        beta: the entropy weight β >= 0.

    Example:
        >>> ConfidencePenalty(beta=-1.0)
        Traceback (most recent call last):
        ...
        ValueError: objective.beta must be >= 0, got -1.0
    """

    beta: float = 0.5

    def __post_init__(self) -> None:
        self.beta = check_number("objective.beta", self.beta, minimum=0)

    def loss_fn(self, context: StepContext, inner: Batch,
                parts: dict[str, Tensor]) -> Callable[[dict[str, Tensor]], Tensor]:
        """CE of ``inner`` plus β times f (minus the entropy) of this step's unlabelled batch."""
        outer = context.unlabeled_batch()

        def loss(theta: dict[str, Tensor]) -> Tensor:
            parts["ce"] = context.losses.one_level(theta, inner)
            parts["f"] = context.losses.outer(theta, None, outer)
            return parts["ce"] + self.beta * parts["f"]

        return loss

    def record(self, parts: dict[str, Tensor]) -> dict[str, float | Tensor]:
        """``ce`` and ``unlabeled_entropy`` (−f) at the step's θ."""
        return {"ce": parts["ce"].detach(), "unlabeled_entropy": -parts["f"].detach()}
