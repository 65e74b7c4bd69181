"""Verbalized confidence: parsing replies, counting the unparsed ones, the follow-up prompt."""

from __future__ import annotations

import pytest

from llm_calib.confidence.verbalized import (
    parse_verbalized_confidence,
    parse_verbalized_replies,
    verbalized_prompt,
)


@pytest.mark.parametrize(("reply", "expected"), [
    ("85", 0.85), (" 85%", 0.85), ("I'd say 40 percent.", 0.40), ("70/100", 0.70), ("0.3", 0.3),
    ("1.0", 1.0), ("100", 1.0), ("0", 0.0), ("Confidence: 55 (fairly sure)", 0.55), ("12.5%", 0.125),
])
def test_parsed(reply, expected):
    assert parse_verbalized_confidence(reply) == pytest.approx(expected)


@pytest.mark.parametrize("reply", ["", "high", "very confident", "-20", "150", "250%", "x1"])
def test_unparsed(reply):
    assert parse_verbalized_confidence(reply) is None


def test_unparsed_replies_are_counted_not_dropped():
    p = parse_verbalized_replies(["90", "sure!", "10%", "?"])
    assert p.confidences == (0.9, None, 0.1, None)
    assert p.unparsed == (1, 3)
    assert p.unparsed_rate == 0.5


def test_prompt_template_fields():
    assert verbalized_prompt("Q?", " A", "{prompt}|{answer}") == "Q?| A"
    with pytest.raises(ValueError, match=r"\{answer\}"):
        verbalized_prompt("Q?", "A", "{prompt} only")
