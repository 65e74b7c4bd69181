"""Task formats, one object per way of asking questions (:mod:`llm_calib.formats.base`):
:class:`OptionLikelihood` and :class:`Letter` (multiple choice), :class:`OpenEnded` (open
questions), registered by name (:mod:`llm_calib.formats.registry`; a multiple-choice format's
name is its ``scorer``). :func:`format_for` reads the kind of the records, once, where they enter.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import replace
from typing import Any, Literal

from llm_calib.confidence.kinds import OpenConfidence
from llm_calib.data.records import MultipleChoice
from llm_calib.formats.base import RecordKindError, TaskFormat, records_family
from llm_calib.formats.categorical import cross_entropy, entropy, identity
from llm_calib.formats.multiple_choice import (
    Letter,
    MultipleChoiceFormat,
    OptionLikelihood,
    normalization_summary,
)
from llm_calib.formats.open_ended import OpenEnded
from llm_calib.formats.registry import (
    BUILTIN_FORMATS,
    MULTIPLE_CHOICE_FORMATS,
    SCORER_NAMES,
    family_format,
    format_class,
    format_names,
    register_format,
    scorer_class,
    unregister_format,
)
from llm_calib.prompts.templates import PromptFormat
from llm_calib.scoring.base import ScoredResult, ScoredSet

__all__ = [
    "BUILTIN_FORMATS", "MULTIPLE_CHOICE_FORMATS", "SCORER_NAMES", "Letter", "MultipleChoiceFormat", "OpenEnded",
    "OptionLikelihood", "RecordKindError", "ScoredResult", "TaskFormat", "cross_entropy", "entropy",
    "family_format", "format_class", "format_for", "format_names", "identity", "multiple_choice_format",
    "normalization_summary", "records_family", "register_format", "score_multiple_choice", "scorer_class",
    "unregister_format",
]

def multiple_choice_format(scorer: str = "option_likelihood", *, normalize: str = "sum",
                           prompt: PromptFormat | None = None) -> MultipleChoiceFormat:
    """The multiple-choice format of a scorer name (one of :data:`SCORER_NAMES`).

    Raises:
        ValueError: an unknown scorer, or a prompt the scorer cannot use.

    Example:
        >>> multiple_choice_format("letter").prompt_settings().style
        'listed'
    """
    return scorer_class(scorer)(normalize=normalize, prompt=prompt)


def score_multiple_choice(
    model: Any, tokenizer: Any, records: Sequence[MultipleChoice], *, scorer: str = "option_likelihood",
    normalize: Literal["sum", "mean", "char", "byte"] = "sum", prompt: PromptFormat | None = None,
    batch_size: int = 8, progress: bool = False,
) -> ScoredSet:
    """Score multiple-choice records with the format registered as ``scorer``
    (:func:`multiple_choice_format`; ``normalize``: option likelihood only).

    Raises:
        ValueError: an unknown ``scorer``, or the scorer's own argument errors.

    Example:
        >>> from llm_calib.models import tiny_random_model
        >>> model, tok = tiny_random_model()
        >>> qs = [MultipleChoice("Capital of France?", ("Paris", "Rome"), 0, "geo", "q0")]
        >>> score_multiple_choice(model, tok, qs, scorer="letter").scorer
        'letter'
    """
    fmt = multiple_choice_format(scorer, normalize=normalize, prompt=prompt)
    return fmt.score(model, tokenizer, records, batch_size=batch_size, progress=progress)


def format_for(
    records: Iterable[Any], *, scorer: str = "option_likelihood", normalize: str = "sum",
    prompt: PromptFormat | None = None, open_prompt: PromptFormat | None = None, max_new_tokens: int = 32,
    answer_stop: bool = False, what: str = "records", confidence: OpenConfidence | None = None,
) -> TaskFormat:
    """The format of a record set: the one place the kind of records is decided.

    Args:
        records: all multiple choice or all open questions.
        scorer: multiple-choice scorer name (one of :data:`SCORER_NAMES`).
        normalize: option-likelihood normalisation.
        prompt: multiple-choice prompt format (None: the scorer's default).
        open_prompt: open-question prompt format (None: ``prompt`` as a cloze prompt).
        max_new_tokens: open questions: generation budget.
        answer_stop: open questions: train on the stop token after the answer.
        what: how error messages name the records.
        confidence: open questions: how answers get their confidence (None: ``token``).

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
        return OpenEnded(open_prompt if open_prompt is not None else prompt, max_new_tokens, answer_stop, confidence)
    return multiple_choice_format(scorer, normalize=normalize, prompt=prompt)

