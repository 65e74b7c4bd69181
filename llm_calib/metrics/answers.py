"""Comparing an answer with a question's accepted aliases: SQuAD normalisation, exact match and
token F1 (re-exported by :mod:`llm_calib.scoring`).
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
    """SQuAD answer normalisation: lowercase, drop punctuation and articles, squeeze whitespace.

    Example:
        >>> normalize_answer("  The  Eiffel-Tower! ")
        'eiffeltower'
    """
    text = text.lower()
    text = "".join(ch for ch in text if ch not in _PUNCT)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def exact_match(prediction: str, answers: Sequence[str]) -> bool:
    """Whether the prediction equals some alias after :func:`normalize_answer`.

    Example:
        >>> exact_match("the Paris.", ["Paris", "City of Light"])
        True
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
    """SQuAD token F1 between the prediction and the best-matching alias (0 if no aliases).

    Example:
        >>> token_f1("the big red dog", ["red dog"])
        0.8
    """
    return max((_f1(prediction, a) for a in answers), default=0.0)
