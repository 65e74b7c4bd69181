"""The base of one-level objectives: a loss of θ, minimised by one Adam step of θ per step."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import Tensor

import hypergrad as hg
from llm_calib.objectives.base import Objective

if TYPE_CHECKING:
    from llm_calib.calm.objectives import Batch
    from llm_calib.calm.training import Trainer, TrainState

__all__ = ["OneLevelObjective"]


class OneLevelObjective(Objective):
    """One loss of θ on the unadjusted model, minimised by one step of the run's θ optimiser per step.

    A subclass defines :meth:`loss_fn` (and :meth:`record` for extra diagnostics).

    Example:
        >>> from llm_calib.objectives.lora_ce import LoraCE
        >>> isinstance(LoraCE(), OneLevelObjective), LoraCE.trains_adjustment
        (True, False)
    """

    def loss_fn(self, trainer: Trainer, state: TrainState, inner: Batch,
                parts: dict[str, Tensor]) -> Callable[[dict[str, Tensor]], Tensor]:
        """The step's loss of θ on ``inner``; it may store named terms in ``parts``. Draw other batches here."""
        raise NotImplementedError(f"{type(self).__name__} must define loss_fn(trainer, state, inner, parts)")

    def record(self, parts: dict[str, Tensor]) -> dict[str, float]:
        """Extra entries of the step's record from the stored terms (default: none)."""
        return {}

    def step(self, trainer: Trainer, state: TrainState, inner: Batch) -> dict[str, float]:
        """One step of θ's optimiser on :meth:`loss_fn`; the record holds ``loss`` and :meth:`record`."""
        parts: dict[str, Tensor] = {}
        loss_of_theta = self.loss_fn(trainer, state, inner, parts)
        loss, grad, _ = hg.autodiff.loss_and_grads(lambda w, _lam: loss_of_theta(w), state.theta, {"_": torch.zeros(1)},
                                                   wrt_lam=False, what=f"{self.name} loss")
        with torch.no_grad():
            theta, state.theta_opt_state = trainer.theta_optimizer.update(state.theta, grad, state.theta_opt_state)
        state.theta = {k: v.detach() for k, v in theta.items()}
        return {"loss": float(loss), **self.record(parts)}
