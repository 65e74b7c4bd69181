"""The two record types every loader produces."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["RECORD_KINDS", "MultipleChoice", "OpenQA"]

RECORD_KINDS = ("multiple_choice", "open")
"""The two kinds of record (:func:`llm_calib.formats.base.records_family`)."""


@dataclass(frozen=True)
class MultipleChoice:
    """One multiple-choice question: ``options`` (at least 2) and the ``gold`` index; ``prompt`` and
    ``continuations`` (e.g. lm-eval's context and ``" Paris"``), when given, are used verbatim.

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
            raise ValueError(f"MultipleChoice {self.id!r}: needs at least 2 options, got {len(self.options)}")
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
    """One open-ended question with its accepted ``answers`` (none when ``answerable`` is False);
    ``prompt`` is used verbatim when given; ``until`` keeps the source's stop sequences (lm-eval's
    ``until``), at which greedy answers stop.

    Example:
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

