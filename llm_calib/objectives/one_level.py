"""The base of one-level objectives: a loss of θ, minimised by one Adam step of θ per step."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

import hypergrad as hg
from llm_calib.objectives.base import Objective

if TYPE_CHECKING:
    from llm_calib.training_interface import Batch, StepContext

__all__ = ["OneLevelObjective", "OneLevelState"]


class OneLevelObjective(Objective):
    """One loss of θ on the unadjusted model, minimised by one step of the run's θ optimiser per step.

    A subclass defines :meth:`loss_fn` (and :meth:`record` for extra diagnostics).

    Example:
        >>> from llm_calib.objectives.lora_ce import LoraCE
        >>> isinstance(LoraCE(), OneLevelObjective), LoraCE.trains_adjustment
        (True, False)
    """

    def loss_fn(self, context: StepContext, inner: Batch,
                parts: dict[str, Tensor]) -> Callable[[dict[str, Tensor]], Tensor]:
        """The step's loss of θ on ``inner``; it may store named terms in ``parts``. Draw other batches here
        (``context.unlabeled_batch()``)."""
        raise NotImplementedError(f"{type(self).__name__} must define loss_fn(context, inner, parts)")

    def record(self, parts: dict[str, Tensor]) -> dict[str, float | Tensor]:
        """Extra entries of the step's record from the stored terms (default: none): numbers, or 0-dim
        tensors (detached) that the loop reads back when it logs."""
        return {}

    def start(self, context: StepContext) -> OneLevelState:
        """A fresh state of θ's optimiser."""
        return OneLevelState(self, context.theta_optimizer.init(context.theta))


class OneLevelState:
    """A run of a :class:`OneLevelObjective`: the state of θ's optimiser (checkpointed as ``theta_opt/``).

    Args:
        objective: the objective whose :meth:`~OneLevelObjective.loss_fn` each step minimises.
        theta_opt_state: the state of the run's θ optimiser.

    Example:
        >>> from llm_calib.objectives.lora_ce import LoraCE
        >>> state = OneLevelState(LoraCE(), {"m": {}})
        >>> state.lam, state.checkpoint()
        ({}, ({'theta_opt/': {'m': {}}}, {}))
    """

    def __init__(self, objective: OneLevelObjective, theta_opt_state: Any) -> None:
        self.objective = objective
        self.theta_opt_state = theta_opt_state
        self.lam: dict[str, Tensor] = {}  # trains no λ

    def step(self, context: StepContext, inner: Batch) -> dict[str, float | Tensor]:
        """One step of θ's optimiser on the loss; the record holds ``loss`` and the objective's ``record``
        (0-dim tensors: the loop reads them back, and checks them, when it logs)."""
        parts: dict[str, Tensor] = {}
        loss_of_theta = self.objective.loss_fn(context, inner, parts)
        loss, grad, _ = hg.autodiff.loss_and_grads(lambda w, _lam: loss_of_theta(w), context.theta,
                                                   {"_": torch.zeros(1)}, wrt_lam=False,
                                                   what=f"{self.objective.name} loss", check=False)
        with torch.no_grad():  # no graph: the new θ needs no detaching
            context.theta, self.theta_opt_state = context.theta_optimizer.update(context.theta, grad,
                                                                                 self.theta_opt_state)
        return {"loss": loss, **self.objective.record(parts)}

    def checkpoint(self) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
        """θ's optimiser state under ``theta_opt/``."""
        return {"theta_opt/": self.theta_opt_state or {}}, {}

    def restore(self, trees: dict[str, dict[str, Any]], meta: dict[str, Any]) -> None:
        """θ's optimiser state from ``theta_opt/``."""
        self.theta_opt_state = trees.get("theta_opt/", {})
