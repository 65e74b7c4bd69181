"""The task-format interface (see :doc:`/architecture`): a :class:`TaskFormat` owns the check,
encoding, training-loss view, scoring and result rows of one way of asking questions; the kind
of the records is decided once, where they enter (:func:`records_family`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from torch import Tensor

from llm_calib.data.records import RECORD_KINDS, MultipleChoice, OpenQA
from llm_calib.engine.packing import PackedQuestions
from llm_calib.scoring.base import ScoredResult

if TYPE_CHECKING:
    from llm_calib.adjustment import LogitAdjustment
    from llm_calib.training_interface import Batch, Losses

__all__ = ["RecordKindError", "TaskFormat", "records_family"]


class RecordKindError(ValueError):
    """Records that are not all of one kind (or not records).

    Example:
        >>> issubclass(RecordKindError, ValueError)
        True
    """


def records_family(
    records: Iterable[Any], *, what: str = "records", expected: str | None = None
) -> Literal["multiple_choice", "open"]:
    """The one kind (``"multiple_choice"`` or ``"open"``) of a collection of records.

    Args:
        records: records, all of one kind.
        what: how error messages name the collection (e.g. ``"train"``).
        expected: the kind the records must have, or None to take the first record's.

    Raises:
        RecordKindError: no records, or a record of another type or kind (named by its id).
        ValueError: an unknown ``expected``.

    Example:
        >>> records_family([OpenQA("Capital of France?", ("Paris",), "geo", "q0")])
        'open'
        >>> mc = MultipleChoice("2 + 2 = ?", ("3", "4"), 1, "arithmetic", "add-0")
        >>> records_family([mc], what="heldout", expected="open")
        Traceback (most recent call last):
        ...
        llm_calib.formats.base.RecordKindError: heldout: record 'add-0' is MultipleChoice, expected open records (OpenQA); a run takes one kind of record, all multiple choice or all open-ended
    """
    names = {"multiple_choice": "MultipleChoice", "open": "OpenQA"}
    if expected is not None and expected not in names:
        raise ValueError(f"expected must be one of {RECORD_KINDS}, got {expected!r}")
    family, first = expected, None
    for position, r in enumerate(records):
        this = "multiple_choice" if isinstance(r, MultipleChoice) else "open" if isinstance(r, OpenQA) else None
        name = f"record {r.id!r}" if isinstance(getattr(r, "id", None), str) else f"record at position {position}"
        if this is None:
            raise RecordKindError(f"{what}: {name} is a {type(r).__name__}, not a MultipleChoice or OpenQA record")
        if family is None:
            family, first = this, name
        elif this != family:
            since = f" like {first}" if first is not None else ""
            raise RecordKindError(
                f"{what}: {name} is {type(r).__name__}, expected {family} records{since} "
                f"({names[family]}); a run takes one kind of record, all multiple choice or all open-ended"
            )
    if family is None:
        raise RecordKindError(f"{what}: no records")
    return family  # type: ignore[return-value]


class TaskFormat(ABC):
    """One way of asking questions and reading answers; subclasses are frozen dataclasses.

    Attributes:
        family: the record kind taken (``"multiple_choice"`` or ``"open"``), results' ``kind``.
        layout: the training-batch layout (``"options"``, ``"letter"`` or ``"open"``).
        auto_adjustment: the logit adjustment λ of CALM's ``adjustment="auto"`` for this format: λ acts
            where the prediction is made (an option temperature on option scores, the letters'
            logits for the letter scorer, the vocabulary for open answers).
        description: how reports name the kind of question.
        temperature_scalable: whether the scores are option logits a temperature applies to.
        answer_stop: open questions: each reference ends with greedy answering's stop token.
        default_prompt: the prompt format used when a format is given none (None: no prompt).
        training_notes: lines a comparison report adds about training on this kind.
        upper_families: the record kinds of the held-out and unlabelled sets (upper level, model
            selection) a lower level of this format can serve. Multiple choice serves only
            multiple choice; open-ended answers (token cross-entropy of a reference response, e.g.
            instruction data) are a generic language-modelling loss and also serve a
            multiple-choice upper level.

    Example:
        >>> from llm_calib.formats import OptionLikelihood
        >>> fmt = OptionLikelihood()
        >>> fmt.family, fmt.layout, fmt.temperature_scalable
        ('multiple_choice', 'options', True)
    """

    family: ClassVar[str]
    layout: ClassVar[str]
    auto_adjustment: ClassVar[str]
    description: ClassVar[str]
    temperature_scalable: ClassVar[bool] = False
    training_notes: ClassVar[tuple[str, ...]] = ()
    upper_families: ClassVar[tuple[str, ...]] = ("multiple_choice",)
    default_prompt: ClassVar[Any] = None
    answer_stop: bool = False

    # --- data ---------------------------------------------------------------------------------
    def check(self, records: Iterable[Any], *, what: str = "records") -> None:
        """Raise ValueError (naming the record) unless ``records`` are all of this format's kind."""
        records_family(records, what=what, expected=self.family)

    @classmethod
    def domain_notes(cls, metrics: dict[str, float]) -> list[str]:
        """Lines a report writes under a domain's heading (after the question count)."""
        return []

    # --- training encoding --------------------------------------------------------------------
    @abstractmethod
    def encode(self, tokenizer: Any, records: Sequence[Any]) -> tuple[list[tuple[int, ...]], list[tuple[tuple[int, ...], ...]]]:
        """Training token ids: one prompt per record, and its continuations (options, letters or answer)."""

    @abstractmethod
    def pack(self, prompts: Sequence[Sequence[int]], options: Sequence[Sequence[Sequence[int]]], pad_id: int) -> PackedQuestions:
        """One model input holding the given questions (see :mod:`llm_calib.engine.packing`)."""

    def length(self, prompt: Sequence[int], options: Sequence[Sequence[int]]) -> int:
        """Packed length (tokens) of one question: the prompt and every continuation (default)."""
        return len(prompt) + sum(len(o) for o in options)

    @abstractmethod
    def label(self, record: Any) -> int:
        """The target index of a record in its batch (the gold option; 0 for a reference answer)."""

    # --- training-loss view -------------------------------------------------------------------
    def option_text_lengths(self, record: Any, normalize: str) -> list[int] | None:
        """Per option, the length in characters or UTF-8 bytes a score is divided by (None: no option texts)."""
        return None

    def check_adjustment(self, adjustment: LogitAdjustment) -> None:  # noqa: B027 (optional hook)
        """Raise ValueError when ``adjustment`` cannot act on this format's predictions."""

    @abstractmethod
    def categorical(
        self, losses: Losses, theta: dict[str, Tensor] | None, lam: dict[str, Tensor] | None, batch: Batch
    ) -> tuple[Tensor, Tensor, Callable[[Tensor], Tensor]]:
        """The predictions the task loss fits (adjusted by ``lam``), their targets, and the per-question reduction."""

    @abstractmethod
    def deployed_entropy(self, losses: Losses, theta: dict[str, Tensor] | None, batch: Batch) -> Tensor:
        """Per-question entropy of the unadjusted model's prediction (the upper-level target)."""

    @abstractmethod
    def monitor(self, losses: Losses, batch: Batch) -> dict[str, Tensor]:
        """Per-question held-out ``confidence``, ``correct``, ``nll`` and ``entropy`` (float64, CPU)."""

    # --- scoring and results ------------------------------------------------------------------
    @abstractmethod
    def score(self, model: Any, tokenizer: Any, records: Sequence[Any], *, batch_size: int = 8,
              progress: bool = False) -> ScoredResult:
        """Score ``records`` with this format's scorer."""

    def temperature_scaled(self, scored: Any, temperature: float | None) -> ScoredResult | None:
        """``scored`` with a fitted temperature applied, or None."""
        return None

    def extra_metrics(self, scored: Any, n_bins: int = 10) -> dict[str, dict[str, float]] | None:
        """Format-specific metrics reported next to the headline ones (None: none)."""
        return None

    @abstractmethod
    def sample_rows(self, domain: str, scored: Any) -> Iterator[dict[str, Any]]:
        """One JSON-ready dict per question of ``scored``."""

    def prompt_settings(self) -> Any:
        """The prompt format the scorer uses (its :attr:`default_prompt` filled in)."""
        return getattr(self, "prompt", None) or self.default_prompt

