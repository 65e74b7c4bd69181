"""The two record types every loader produces."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

__all__ = ["RECORD_KINDS", "MultipleChoice", "OpenQA", "record_kind"]

RECORD_KINDS = ("multiple_choice", "open")
"""The kinds :func:`record_kind` returns: :class:`MultipleChoice` and :class:`OpenQA` records."""


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
        until: the stop sequences the source asks generation to end at (lm-eval's ``until``),
            kept for reference; None when the source gives none.

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


def record_kind(
    records: Iterable[Any], *, what: str = "records", expected: str | None = None
) -> Literal["multiple_choice", "open"]:
    """The one kind of a collection of records; an error names the first record that breaks it.

    Args:
        records: :class:`MultipleChoice` or :class:`OpenQA` records, all of one kind.
        what: how to name the collection in error messages (e.g. ``"train"``).
        expected: the kind the records must have (one of :data:`RECORD_KINDS`), or None to take
            the first record's.

    Returns:
        ``"multiple_choice"`` or ``"open"``.

    Raises:
        ValueError: no records, a record of another type, or a record of the other kind; the
            message names the offending record's id.

    Example:
        >>> record_kind([OpenQA("Capital of France?", ("Paris",), "geo", "q0")])
        'open'
        >>> mc = MultipleChoice("2 + 2 = ?", ("3", "4"), 1, "arithmetic", "add-0")
        >>> record_kind([mc], what="heldout", expected="open")
        Traceback (most recent call last):
        ...
        ValueError: heldout: record 'add-0' is MultipleChoice, expected open records (OpenQA); a run takes one kind of record, all multiple choice or all open-ended
    """
    names = {"multiple_choice": "MultipleChoice", "open": "OpenQA"}
    if expected is not None and expected not in names:
        raise ValueError(f"expected must be one of {RECORD_KINDS}, got {expected!r}")
    kind, first = expected, None
    for position, r in enumerate(records):
        this = "multiple_choice" if isinstance(r, MultipleChoice) else "open" if isinstance(r, OpenQA) else None
        name = f"record {r.id!r}" if isinstance(getattr(r, "id", None), str) else f"record at position {position}"
        if this is None:
            raise ValueError(f"{what}: {name} is a {type(r).__name__}, not a MultipleChoice or OpenQA record")
        if kind is None:
            kind, first = this, name
        elif this != kind:
            since = f" like {first}" if first is not None else ""
            raise ValueError(
                f"{what}: {name} is {type(r).__name__}, expected {kind} records{since} "
                f"({names[kind]}); a run takes one kind of record, all multiple choice or all open-ended"
            )
    if kind is None:
        raise ValueError(f"{what}: no records")
    return kind  # type: ignore[return-value]
