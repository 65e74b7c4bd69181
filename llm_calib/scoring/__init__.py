"""Scorers that turn a model's outputs into per-question option probabilities, and the result sets.

Multiple choice (a :class:`ScoredSet`): :func:`score_option_likelihood` (each option's text after
the prompt) and :func:`score_letter` (the option letters, options listed). Open-ended answers and
their confidences are one floor up, in :mod:`llm_calib.confidence`.

The scorers by name are the multiple-choice formats of :mod:`llm_calib.formats.registry`
(:func:`llm_calib.formats.score_multiple_choice`): a format owns its scorer, its training
encoding and its loss view, and this package sits below the formats.
"""

from __future__ import annotations

from llm_calib.scoring.base import ScoredSet
from llm_calib.scoring.letter import letter_token_ids, score_letter
from llm_calib.scoring.option_likelihood import (
    LM_EVAL_NORMALIZATIONS,
    NORMALIZE_MODES,
    STRATEGIES,
    normalized,
    score_option_likelihood,
)

__all__ = [
    "LM_EVAL_NORMALIZATIONS", "NORMALIZE_MODES", "STRATEGIES", "ScoredSet", "letter_token_ids",
    "normalized", "score_letter", "score_option_likelihood",
]
