"""Verbalized confidence: the model is asked how sure it is, 0-100, and the number is parsed.

After its answer the model gets a follow-up prompt (:data:`VERBALIZED_PROMPT`, overridable) and
its greedy reply is parsed by :func:`parse_verbalized_confidence`. Replies with no number in
``[0, 100]`` are *unparsed*: they are counted and reported (``unparsed`` in every summary), and
left out of the calibration metrics, never given a made-up confidence. Lin, Hilton and Evans
("Teaching Models to Express Their Uncertainty in Words", 2022) and Tian et al. ("Just Ask for
Calibration", EMNLP 2023) describe the method; small models often ignore the request, which is
why the unparsed share matters as much as the ECE.

Example:
    >>> [parse_verbalized_confidence(t) for t in ["85", " 90%.", "I am 70 percent sure", "high", "250"]]
    [0.85, 0.9, 0.7, None, None]
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["VERBALIZED_PROMPT", "VerbalizedParse", "parse_verbalized_confidence", "parse_verbalized_replies",
           "verbalized_prompt"]

VERBALIZED_PROMPT = (
    "{prompt}{answer}\n"
    "How confident are you that this answer is correct? "
    "Reply with a number from 0 to 100.\nConfidence:"
)
"""The follow-up after the model's answer: ``{prompt}`` is the question as the model saw it and
``{answer}`` its answer; the reply is generated greedily and parsed."""

# A number, optionally with a decimal part, not part of a longer word or number.
_NUMBER = re.compile(r"(?<![\w.])(-?\d+(?:\.\d+)?)\s*(%|percent|/\s*100)?", re.IGNORECASE)


def verbalized_prompt(prompt: str, answer: str, template: str = VERBALIZED_PROMPT) -> str:
    """The follow-up prompt asking for a confidence.

    Args:
        prompt: the question as the model saw it (its answer continued this text).
        answer: the model's answer.
        template: a ``str.format`` template with ``{prompt}`` and ``{answer}``.

    Returns:
        The prompt whose continuation is parsed.

    Raises:
        ValueError: the template lacks a field.

    Example:
        >>> print(verbalized_prompt("Q: Capital of France?\\nA:", " Paris"))
        Q: Capital of France?
        A: Paris
        How confident are you that this answer is correct? Reply with a number from 0 to 100.
        Confidence:
    """
    for name in ("{prompt}", "{answer}"):
        if name not in template:
            raise ValueError(f"the verbalized-confidence template must contain {name}, got {template!r}")
    return template.format(prompt=prompt, answer=answer)


def parse_verbalized_confidence(text: str) -> float | None:
    """The confidence in a reply, as a probability in ``[0, 1]``, or None if there is none.

    The first number in the reply is read as a percentage (``"85"``, ``"85%"``, ``"85 percent"``,
    ``"85/100"``); a number with a decimal point below 1 and no percent sign (``"0.85"``) is read
    as a probability. Anything else, a negative number or one over 100 gives None.

    Args:
        text: the model's reply to :data:`VERBALIZED_PROMPT`.

    Returns:
        The confidence, or None when the reply is unparsed.

    Example:
        >>> parse_verbalized_confidence("Confidence: 0.35"), parse_verbalized_confidence("100/100")
        (0.35, 1.0)
        >>> parse_verbalized_confidence("-5") is None, parse_verbalized_confidence("") is None
        (True, True)
    """
    m = _NUMBER.search(text)
    if m is None:
        return None
    value = float(m.group(1))
    if m.group(2) is None and "." in m.group(1) and 0.0 <= value <= 1.0:
        return value
    if not 0.0 <= value <= 100.0:
        return None
    return value / 100.0


@dataclass(frozen=True)
class VerbalizedParse:
    """Parsed replies: ``confidences[i]`` is None where reply ``i`` was unparsed.

    Attributes:
        confidences: one parsed confidence (or None) per reply.
        unparsed: the indices of the unparsed replies.
    """

    confidences: tuple[float | None, ...]
    unparsed: tuple[int, ...]

    @property
    def unparsed_rate(self) -> float:
        """The share of unparsed replies (NaN with no replies).

        Example:
            >>> parse_verbalized_replies(["80", "?"]).unparsed_rate
            0.5
        """
        return len(self.unparsed) / len(self.confidences) if self.confidences else float("nan")


def parse_verbalized_replies(replies: Sequence[str]) -> VerbalizedParse:
    """Parse every reply and record which failed.

    Args:
        replies: the model's replies, one per question.

    Returns:
        A :class:`VerbalizedParse`.

    Example:
        >>> p = parse_verbalized_replies(["80", "no idea", "55%"])
        >>> p.confidences, p.unparsed
        ((0.8, None, 0.55), (1,))
    """
    parsed = tuple(parse_verbalized_confidence(r) for r in replies)
    return VerbalizedParse(parsed, tuple(i for i, c in enumerate(parsed) if c is None))
