"""The vocabulary that the training loop, the objectives and the task formats share.

:class:`Batch` is what the loop hands an objective's step and what a format's loss view reads;
:class:`Losses` is what an objective and a format may call of the run's losses (the CALM losses,
:class:`~llm_calib.calm.losses.CalmLosses`, implement it); :class:`StepContext` is what an
objective's step may use of the run (the loop, :mod:`llm_calib.calm.training`, implements it);
:class:`ObjectiveState` is what the loop keeps of an objective between steps (made by
:meth:`Objective.start <llm_calib.objectives.base.Objective.start>`). This module imports none of
:mod:`llm_calib.calm`, :mod:`llm_calib.objectives` or :mod:`llm_calib.formats`: they import it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from torch import Tensor

from llm_calib.engine.packing import PackedQuestions

__all__ = ["Batch", "BatchFormat", "Losses", "ObjectiveState", "StepContext"]


class BatchFormat(Protocol):
    """What the losses read of a batch's task format (:class:`~llm_calib.formats.base.TaskFormat` implements it).

    Attributes:
        description: how messages name the format's questions.
        answer_stop: open questions: each reference answer ends with greedy answering's stop token.
    """

    description: str
    answer_stop: bool

    def categorical(self, losses: Losses, theta: dict[str, Tensor] | None, lam: dict[str, Tensor] | None,
                    batch: Batch) -> tuple[Tensor, Tensor, Callable[[Tensor], Tensor]]:
        """The batch as categorical predictions: scores, targets and the per-question reduction."""

    def deployed_entropy(self, losses: Losses, theta: dict[str, Tensor] | None, batch: Batch) -> Tensor:
        """The entropy of the deployed (unadjusted) model, per question."""

    def monitor(self, losses: Losses, batch: Batch) -> dict[str, Tensor]:
        """Per-question held-out statistics (``confidence``, ``correct``, ``nll``, ``entropy``)."""

    def check_adjustment(self, adjustment: Any) -> None:
        """Raise a ValueError for a logit adjustment the format cannot take."""


@dataclass
class Batch:
    """A packed batch of questions with gold labels (labels may be unused, e.g. for f).

    Attributes:
        packed: model inputs and gather indices.
        labels: gold option per question, ``(B,)`` (0 for open questions: the reference answer).
        ids: record ids (for diagnostics).
        format: the task format that gives the losses their view (:class:`BatchFormat`).
        trunk: cached hidden states entering the first trainable layer, or None.
        option_text_lengths: ``"char"``/``"byte"``: option lengths ``(B, K_max)`` (1 at padding)
            for those normalisations; empty for open questions.
        parts: multiple-choice batches only: the same questions as sub-batches of similar length
            (:func:`~llm_calib.engine.packing.length_parts`), through which
            :meth:`CalmLosses.scores <llm_calib.calm.losses.CalmLosses.scores>` runs the model instead
            of the whole padded batch; empty: the whole batch in one pass.
        part_order: with ``parts``: the position in the concatenated parts of each question of the batch.

    Example:
        >>> import torch
        >>> from llm_calib.engine.packing import pack_continuations
        >>> from llm_calib.formats import OpenEnded
        >>> batch = Batch(pack_continuations([((5, 6, 7), (8, 9))], 0), torch.zeros(1), ["q0"], OpenEnded())
        >>> batch.packed.batch_size, batch.answer_stop
        (1, False)
    """

    packed: PackedQuestions
    labels: Tensor
    ids: list[str]
    format: BatchFormat
    trunk: Tensor | None = None
    option_text_lengths: dict[str, Tensor] = field(default_factory=dict)
    parts: tuple[Batch, ...] = ()
    part_order: Tensor | None = None

    def __post_init__(self) -> None:
        if self.parts and (self.part_order is None or len(self.part_order) != self.packed.batch_size):
            raise ValueError(f"a batch of {self.packed.batch_size} questions in parts needs part_order with one "
                             f"position per question, got {None if self.part_order is None else len(self.part_order)}")

    @property
    def answer_stop(self) -> bool:
        """Whether each reference answer ends with greedy answering's stop token."""
        return self.format.answer_stop


class Losses(Protocol):
    """The losses of a run as an objective or a format calls them; each is the mean over a :class:`Batch`.

    Attributes:
        adjustment: the logit adjustment λ acts through (:class:`~llm_calib.adjustment.LogitAdjustment`),
            or None when the run trains none.
    """

    adjustment: Any

    def logits(self, theta: dict[str, Tensor] | None, lam: dict[str, Tensor] | None, batch: Batch,
               select: Tensor | None = None) -> Tensor:
        """Head logits at the batch's gathered rows, adjusted by a token-level λ."""

    def scores(self, theta: dict[str, Tensor] | None, lam: dict[str, Tensor] | None, batch: Batch) -> Tensor:
        """Option scores ``(B, K_max)``; adjusted when ``lam`` is given."""

    def inner(self, theta: dict[str, Tensor], lam: dict[str, Tensor], batch: Batch) -> Tensor:
        """g(θ, λ): cross-entropy under the adjusted predictions."""

    def outer(self, theta: dict[str, Tensor], lam: dict[str, Tensor] | None, batch: Batch) -> Tensor:
        """f(θ): minus the mean entropy of the deployed model."""

    def one_level(self, theta: dict[str, Tensor], batch: Batch, smoothing: float = 0.0,
                  entropy_weight: float = 0.0) -> Tensor:
        """Cross-entropy (label smoothing ``smoothing``) minus ``entropy_weight`` times the entropy."""

    def initial_lam(self) -> dict[str, Tensor]:
        """λ at the identity, in the model's float precision and on its device."""


class StepContext(Protocol):
    """What an objective's step may use of the run (five members).

    Attributes:
        step: the steps taken so far (the step being taken is ``step + 1``).
        theta: the current LoRA parameters θ (detached); the step assigns the updated ones.
        losses: the run's losses (:class:`Losses`).
        theta_optimizer: the run's optimiser of θ (:class:`hypergrad.inner.Adam`, its learning rates
            from the configuration); a solver derives its own from it.
    """

    step: int
    theta: dict[str, Tensor]
    losses: Losses
    theta_optimizer: Any

    def unlabeled_batch(self) -> Batch:
        """This step's batch of upper-level inputs (labels unused)."""


class ObjectiveState(Protocol):
    """What the loop keeps of an objective between steps, made by ``Objective.start``.

    Attributes:
        lam: the logit adjustment λ the objective trains (the result keeps the selected step's);
            empty when it trains none.
    """

    lam: dict[str, Tensor]

    def step(self, context: StepContext, inner: Batch) -> dict[str, float | Tensor]:
        """One step on the training batch ``inner``: assign ``context.theta``, return the step's record.

        Values are numbers or 0-dim tensors where they were computed (read back to the host only when the
        loop logs, :func:`~llm_calib.calm.training.read_back`, which also checks that they are finite); a 0-dim
        bool tensor is a check (False: the step diverged), not kept in the history."""

    def checkpoint(self) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
        """Its tensors, as trees by checkpoint key prefix (e.g. ``"lam/"``), and its other state (picklable)."""

    def restore(self, trees: dict[str, dict[str, Any]], meta: dict[str, Any]) -> None:
        """Load what :meth:`checkpoint` wrote (missing trees: the state a fresh run starts from)."""
