"""Scorers that turn a model's outputs into per-question probabilities and confidences.

Multiple choice (a :class:`ScoredSet`): :func:`score_option_likelihood` (each option's text after
the prompt) and :func:`score_letter` (the option letters, options listed). Open-ended (an
:class:`OpenEndedSet`): :func:`score_open_ended` (greedy answers, exact match and F1).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from llm_calib.data.records import MultipleChoice
from llm_calib.engine.packing import Normalize
from llm_calib.prompts import PromptFormat
from llm_calib.scoring.base import ScoredSet
from llm_calib.scoring.letter import letter_token_ids, score_letter
from llm_calib.scoring.open_ended import OpenEndedSet, score_open_ended
from llm_calib.scoring.option_likelihood import (
    LM_EVAL_NORMALIZATIONS,
    NORMALIZE_MODES,
    STRATEGIES,
    normalized,
    score_option_likelihood,
)

__all__ = [
    "LM_EVAL_NORMALIZATIONS", "NORMALIZE_MODES", "SCORERS", "STRATEGIES", "OpenEndedSet",
    "ScoredSet", "letter_token_ids", "normalized", "score_letter", "score_multiple_choice",
    "score_open_ended", "score_option_likelihood",
]

SCORERS: dict[str, Callable[..., ScoredSet]] = {"option_likelihood": score_option_likelihood, "letter": score_letter}
"""Multiple-choice scorers by name."""


def score_multiple_choice(
    model: Any, tokenizer: Any, records: Sequence[MultipleChoice], *, scorer: str = "option_likelihood",
    normalize: Normalize = "sum", prompt: PromptFormat | None = None,
    batch_size: int = 8, progress: bool = False,
) -> ScoredSet:
    """Score multiple-choice records with the scorer named ``scorer`` (``normalize``: option likelihood
    only); ValueError for an unknown ``scorer`` or the scorer's own argument errors.

    Example:
        >>> from llm_calib.models import tiny_random_model
        >>> model, tok = tiny_random_model()
        >>> qs = [MultipleChoice("Capital of France?", ("Paris", "Rome"), 0, "geo", "q0")]
        >>> score_multiple_choice(model, tok, qs, scorer="letter").scorer
        'letter'
    """
    if scorer not in SCORERS:
        raise ValueError(f"scorer must be one of {tuple(SCORERS)}, got {scorer!r}")
    extra = {"normalize": normalize} if scorer == "option_likelihood" else {}
    return SCORERS[scorer](model, tokenizer, records, prompt=prompt, batch_size=batch_size, progress=progress, **extra)
