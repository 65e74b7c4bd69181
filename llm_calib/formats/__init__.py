"""Task formats, one object per way of asking questions (:mod:`llm_calib.formats.base`):
:class:`OptionLikelihood` and :class:`Letter` (multiple choice), :class:`OpenEnded` (open
questions). :func:`format_for` reads the kind of the records, once, where they enter.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace
from typing import Any

from llm_calib.data.records import RECORD_KINDS
from llm_calib.formats.base import RecordKindError, TaskFormat, records_family
from llm_calib.formats.categorical import cross_entropy, entropy, identity
from llm_calib.formats.multiple_choice import (
    Letter,
    MultipleChoiceFormat,
    OptionLikelihood,
    normalization_summary,
)
from llm_calib.formats.open_ended import OpenEnded
from llm_calib.prompts import PromptFormat
from llm_calib.scoring.base import ScoredResult

__all__ = [
    "MULTIPLE_CHOICE_FORMATS", "Letter", "MultipleChoiceFormat", "OpenEnded", "OptionLikelihood",
    "RecordKindError", "ScoredResult", "TaskFormat", "cross_entropy", "entropy", "family_format",
    "format_for", "identity", "multiple_choice_format", "normalization_summary", "records_family",
]

MULTIPLE_CHOICE_FORMATS: dict[str, type[MultipleChoiceFormat]] = {
    "option_likelihood": OptionLikelihood,
    "letter": Letter,
}
"""The multiple-choice formats by scorer name (the ``scorer`` setting)."""

_FAMILIES: dict[str, type[TaskFormat]] = {"multiple_choice": MultipleChoiceFormat, "open": OpenEnded}


def family_format(family: str) -> type[TaskFormat]:
    """The format class of a record kind (as result files store it).

    Raises:
        ValueError: an unknown kind.

    Example:
        >>> family_format("open").description
        'open-ended (exact match)'
    """
    if family not in _FAMILIES:
        raise ValueError(f"kind must be one of {RECORD_KINDS}, got {family!r}")
    return _FAMILIES[family]


def multiple_choice_format(scorer: str = "option_likelihood", *, normalize: str = "sum",
                           prompt: PromptFormat | None = None) -> MultipleChoiceFormat:
    """The multiple-choice format of a scorer name (a key of :data:`MULTIPLE_CHOICE_FORMATS`).

    Raises:
        ValueError: an unknown scorer, or a prompt the scorer cannot use.

    Example:
        >>> multiple_choice_format("letter").prompt_settings().style
        'listed'
    """
    if scorer not in MULTIPLE_CHOICE_FORMATS:
        raise ValueError(f"scorer must be one of {tuple(MULTIPLE_CHOICE_FORMATS)}, got {scorer!r}")
    return MULTIPLE_CHOICE_FORMATS[scorer](normalize=normalize, prompt=prompt)


def format_for(
    records: Iterable[Any], *, scorer: str = "option_likelihood", normalize: str = "sum",
    prompt: PromptFormat | None = None, open_prompt: PromptFormat | None = None, max_new_tokens: int = 32,
    answer_stop: bool = False, what: str = "records",
) -> TaskFormat:
    """The format of a record set: the one place the kind of records is decided.

    Args:
        records: all multiple choice or all open questions.
        scorer: multiple-choice scorer name (see :data:`MULTIPLE_CHOICE_FORMATS`).
        normalize: option-likelihood normalisation.
        prompt: multiple-choice prompt format (None: the scorer's default).
        open_prompt: open-question prompt format (None: ``prompt`` as a cloze prompt).
        max_new_tokens: open questions: generation budget.
        answer_stop: open questions: train on the stop token after the answer.
        what: how error messages name the records.

    Raises:
        ValueError: no records, records of both kinds or another type (naming the record), an
            unknown scorer, or a prompt the scorer cannot use.

    Example:
        >>> from llm_calib.data import OpenQA, builtin_multiple_choice
        >>> format_for(builtin_multiple_choice(1, domains=["capitals"]), scorer="letter").layout
        'letter'
        >>> format_for([OpenQA("Capital of France?", ("Paris",), "geo", "q0")]).layout
        'open'
    """
    if records_family(records, what=what) == "open":
        if open_prompt is None and prompt is not None and prompt.style != "cloze":
            open_prompt = replace(prompt, style="cloze")
        return OpenEnded(open_prompt if open_prompt is not None else prompt, max_new_tokens, answer_stop)
    return multiple_choice_format(scorer, normalize=normalize, prompt=prompt)

