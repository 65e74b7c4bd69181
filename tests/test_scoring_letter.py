"""Letter scorer: renormalised letter-token probabilities with the options listed."""

from __future__ import annotations

import math

import pytest
import torch

from llm_calib.prompts.templates import PromptFormat, build_prompt
from llm_calib.scoring import letter_token_ids, score_letter
from llm_calib.scoring.base import encode_prompt


def test_probabilities_sum_to_one_and_match_manual_computation(tiny, mc_records):
    model, tok = tiny
    s = score_letter(model, tok, mc_records, batch_size=4)
    assert s.scorer == "letter" and len(s) == len(mc_records)
    for rec, z, p in zip(mc_records, s.logits, s.probs, strict=True):
        assert len(z) == len(rec.options)
        assert math.isclose(float(p.sum()), 1.0, abs_tol=1e-6)
        text = build_prompt(tok, rec.question, rec.options, PromptFormat(style="listed"))
        ids = encode_prompt(tok, text, chat=True)
        with torch.no_grad():
            last = model(torch.tensor([ids])).logits[0, -1].double()
        letters = [tok(f" {c}", add_special_tokens=False)["input_ids"][0] for c in "ABCDE"]
        manual = torch.softmax(last[letters[: len(rec.options)]], dim=0)
        assert torch.allclose(p.double(), manual, atol=1e-5)
        assert torch.allclose(
            z, torch.log_softmax(last, -1)[letters[: len(rec.options)]], atol=1e-5
        )
    assert 0.0 < s.info["letter_mass"] < 1.0


def test_batch_size_does_not_change_scores(tiny, mc_records):
    model, tok = tiny
    a = score_letter(model, tok, mc_records, batch_size=1)
    b = score_letter(model, tok, mc_records, batch_size=16)
    for x, y in zip(a.logits, b.logits, strict=True):
        assert torch.allclose(x, y, atol=1e-5)


def test_letter_scorer_requires_listed_options(tiny, mc_records):
    model, tok = tiny
    with pytest.raises(ValueError, match="listed"):
        score_letter(model, tok, mc_records, prompt=PromptFormat(style="cloze"))
    with pytest.raises(ValueError, match="batch_size"):
        score_letter(model, tok, mc_records, batch_size=0)


class _SplitLetters:
    """A fake tokenizer whose letters are never single tokens."""

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) for c in text] + [0]}


def test_letter_token_ids(tiny_tokenizer):
    ids = letter_token_ids(tiny_tokenizer, 4)
    assert tiny_tokenizer.convert_ids_to_tokens(ids) == ["ĠA", "ĠB", "ĠC", "ĠD"]
    with pytest.raises(ValueError, match="single-token"):
        letter_token_ids(_SplitLetters(), 2)
