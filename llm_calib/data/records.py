"""The two record types every loader produces."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["RECORD_KINDS", "MultipleChoice", "OpenQA"]

RECORD_KINDS = ("multiple_choice", "open")
"""The two kinds of record: :class:`MultipleChoice` and :class:`OpenQA` (the ``family`` of a task
format, :func:`llm_calib.formats.base.records_family`)."""


@dataclass(frozen=True)
class MultipleChoice:
    """One multiple-choice question.

    Attributes:
        question: the question text (non-empty).
        options: answer options (at least 2), in display order.
        gold: index of the correct option in ``options``.
        domain: a domain label used to group results (e.g. ``"arc_easy"``, ``"mmlu_stem"``).
        id: a stable identifier, unique within its source.
        meta: free-form extra fields (subject, source file, ...).
        prompt: an already rendered prompt (e.g. lm-eval's context with its few-shot examples),
            used verbatim by the scorers instead of one built from ``question`` under a
            :class:`~llm_calib.prompts.PromptFormat`; None (default) builds it.
        continuations: the already rendered scored continuation of each option (target
            delimiter included, e.g. ``" Paris"``), used verbatim; None (default) builds them.

    Example:
        >>> q = MultipleChoice("2 + 2 = ?", ("3", "4"), 1, "arithmetic", "add-0")
        >>> q.options[q.gold]
        '4'
    """

    question: str
    options: tuple[str, ...]
    gold: int
    domain: str
    id: str
    meta: dict[str, str] = field(default_factory=dict, compare=False, hash=False)
    prompt: str | None = None
    continuations: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if not self.question.strip():
            raise ValueError(f"MultipleChoice {self.id!r}: question is empty")
        if len(self.options) < 2:
            raise ValueError(
                f"MultipleChoice {self.id!r}: needs at least 2 options, got {len(self.options)}"
            )
        if not 0 <= self.gold < len(self.options):
            raise ValueError(
                f"MultipleChoice {self.id!r}: gold index {self.gold} "
                f"is not in [0, {len(self.options) - 1}]"
            )
        if self.continuations is not None and len(self.continuations) != len(self.options):
            raise ValueError(
                f"MultipleChoice {self.id!r}: {len(self.continuations)} continuations "
                f"for {len(self.options)} options"
            )


@dataclass(frozen=True)
class OpenQA:
    """One open-ended question.

    Attributes:
        question: the question text (non-empty).
        answers: accepted answers (aliases); at least one unless ``answerable`` is False.
        domain: a domain label.
        id: a stable identifier.
        meta: free-form extra fields.
        answerable: False for questions that have no correct answer (e.g. the unanswerable
            half of SelfAware); such records may have an empty ``answers`` tuple.
        prompt: an already rendered prompt (e.g. lm-eval's context), used verbatim; None
            (default) builds it from ``question``.
        until: the stop sequences the source asks generation to end at (lm-eval's ``until``):
            greedy answers stop at them (:mod:`llm_calib.engine.decode`); None when the source
            gives none.

    Example:
        >>> OpenQA("Capital of France?", ("Paris",), "geo", "q0").answers
        ('Paris',)
        >>> OpenQA("What happens after death?", (), "selfaware", "q1", answerable=False).answers
        ()
    """

    question: str
    answers: tuple[str, ...]
    domain: str
    id: str
    meta: dict[str, str] = field(default_factory=dict, compare=False, hash=False)
    answerable: bool = True
    prompt: str | None = None
    until: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if not self.question.strip():
            raise ValueError(f"OpenQA {self.id!r}: question is empty")
        if self.answerable and not self.answers:
            raise ValueError(f"OpenQA {self.id!r}: needs at least one accepted answer")

