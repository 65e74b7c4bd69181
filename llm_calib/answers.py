"""Comparing an answer with the accepted aliases of a question: SQuAD normalisation
(:func:`normalize_answer`), exact match and token F1.

Used when open questions are loaded (aliases that normalise alike are one,
:func:`llm_calib.data.one_record_per_alias`) and when greedy answers are scored
(:mod:`llm_calib.scoring.open_ended`); ``llm_calib.scoring`` re-exports the three functions.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Sequence

__all__ = ["exact_match", "normalize_answer", "token_f1"]

_PUNCT = set(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")


def normalize_answer(text: str) -> str:
    """SQuAD answer normalisation: lowercase, drop punctuation, drop articles, squeeze whitespace.

    Args:
        text: an answer.

    Returns:
        The normalised answer.

    Example:
        >>> normalize_answer("  The  Eiffel-Tower! ")
        'eiffeltower'
        >>> normalize_answer("An apple a day")
        'apple day'
    """
    text = text.lower()
    text = "".join(ch for ch in text if ch not in _PUNCT)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def exact_match(prediction: str, answers: Sequence[str]) -> bool:
    """Whether the normalised prediction equals the normalised form of any answer.

    Args:
        prediction: the model's answer.
        answers: the accepted aliases.

    Returns:
        True when some alias matches after :func:`normalize_answer`.

    Example:
        >>> exact_match("the Paris.", ["Paris", "City of Light"])
        True
        >>> exact_match("Lyon", ["Paris"])
        False
    """
    pred = normalize_answer(prediction)
    return any(pred == normalize_answer(a) for a in answers)


def _f1(prediction: str, answer: str) -> float:
    pred, gold = normalize_answer(prediction).split(), normalize_answer(answer).split()
    if not pred or not gold:
        return float(pred == gold)
    common = sum((Counter(pred) & Counter(gold)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred), common / len(gold)
    return 2 * precision * recall / (precision + recall)


def token_f1(prediction: str, answers: Sequence[str]) -> float:
    """SQuAD token F1 between the prediction and the best-matching answer (0 if no answers).

    Args:
        prediction: the model's answer.
        answers: the accepted aliases.

    Returns:
        The best F1 over the aliases, in ``[0, 1]``.

    Example:
        >>> token_f1("the big red dog", ["red dog"])
        0.8
        >>> token_f1("cat", ["dog", "cat"])
        1.0
    """
    return max((_f1(prediction, a) for a in answers), default=0.0)
