"""P(True): the prompt, the two-choice softmax, and the model call against a direct computation."""

from __future__ import annotations

import math

import pytest
import torch

from llm_calib.confidence.p_true import P_TRUE_CHOICES, p_true, p_true_from_loglik, p_true_prompt
from llm_calib.models import tiny_random_model


def _loglik(model, ids, cont):
    """Summed log-probability of ``cont`` after ``ids``, from one plain forward pass."""
    full = torch.tensor([ids + cont])
    with torch.no_grad():
        logp = torch.log_softmax(model(full).logits[0].double(), -1)
    return sum(float(logp[len(ids) - 1 + j, t]) for j, t in enumerate(cont))


def test_p_true_matches_a_direct_computation():
    model, tok = tiny_random_model(seed=3)
    questions, answers = ["Capital of France?", "2 + 2 = ?", "Largest planet?"], ["Paris", "5", "Jupiter"]
    got = p_true(model, tok, questions, answers, batch_size=2)
    for q, a, p in zip(questions, answers, got, strict=True):
        ids = tok(p_true_prompt(q, a))["input_ids"]
        lt, lf = (_loglik(model, ids, tok(c, add_special_tokens=False)["input_ids"]) for c in P_TRUE_CHOICES)
        assert p == pytest.approx(math.exp(lt) / (math.exp(lt) + math.exp(lf)), rel=1e-5)


def test_two_choice_softmax_by_hand():
    assert p_true_from_loglik(math.log(0.3), math.log(0.1)) == pytest.approx(0.75)
    assert p_true_from_loglik(-1000.0, 0.0) == 0.0 and p_true_from_loglik(0.0, -1000.0) == 1.0


def test_overridden_template_and_choices():
    model, tok = tiny_random_model()
    a = p_true(model, tok, ["Q?"], ["A"], template="{question} {answer} True or false?", choices=(" True", " False"))
    b = p_true(model, tok, ["Q?"], ["A"])
    assert a.shape == b.shape == (1,) and a[0] != b[0]


def test_bad_input():
    model, tok = tiny_random_model()
    with pytest.raises(ValueError, match="2 questions but 1 answers"):
        p_true(model, tok, ["a", "b"], ["x"])
    with pytest.raises(ValueError, match="two different continuations"):
        p_true(model, tok, ["a"], ["x"], choices=(" A", " A"))
    with pytest.raises(ValueError, match=r"\{answer\}"):
        p_true_prompt("q", "a", "{question} only")
