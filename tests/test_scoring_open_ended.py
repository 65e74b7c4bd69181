"""Open-ended scoring: SQuAD normalisation, EM/F1, greedy decoding and its stopping rules."""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from llm_calib.confidence.token import OpenEndedSet, score_open_ended
from llm_calib.data.records import MultipleChoice, OpenQA
from llm_calib.engine.decode import generate_greedy
from llm_calib.engine.prefix import cache_keyword
from llm_calib.metrics.answers import exact_match, normalize_answer, token_f1
from llm_calib.models import tiny_random_model

# Token probabilities come from a float32 softmax: a few units of float32 rounding (~1.2e-7
# relative each), which differ between CPUs, so exact values are compared at this tolerance.
F32_RTOL = 1e-5


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("The Eiffel Tower.", "eiffel tower"),
        ("  an   APPLE, a pear & the plum!  ", "apple pear plum"),
        ("Theatre", "theatre"),  # articles only as whole words
        ("U.S.A.", "usa"),
        ("", ""),
    ],
)
def test_normalize_answer(text, expected):
    assert normalize_answer(text) == expected


def test_exact_match_any_alias():
    assert exact_match("the United States", ["USA", "United States"])
    assert not exact_match("United States of America", ["United States"])
    assert not exact_match("Paris", [])


def test_token_f1_hand_cases():
    assert token_f1("Barack Obama", ["Obama"]) == pytest.approx(2 * 0.5 * 1 / 1.5)
    assert token_f1("the cat sat", ["a cat sat down"]) == pytest.approx(
        2 * 1 * (2 / 3) / (1 + 2 / 3)
    )
    assert token_f1("dog dog", ["dog"]) == pytest.approx(2 * 0.5 * 1 / 1.5)  # counts, not sets
    assert token_f1("x", ["y", "x"]) == 1.0
    assert token_f1("", ["the"]) == 1.0  # both normalise to empty
    assert token_f1("cat", []) == 0.0


def test_greedy_is_deterministic_and_batch_independent(tiny):
    model, tok = tiny
    prompts = [tok(t)["input_ids"] for t in ("What is 2 + 3?", "Hi", "the quick brown fox jumps")]
    a = generate_greedy(model, tok, prompts, max_new_tokens=6, stop_at_newline=False)
    b = generate_greedy(model, tok, prompts, max_new_tokens=6, stop_at_newline=False)
    assert a == b
    for p, batched in zip(prompts, a, strict=True):
        single = generate_greedy(model, tok, [p], max_new_tokens=6, stop_at_newline=False)[0]
        assert single.token_ids == batched.token_ids  # left padding changes nothing
        np.testing.assert_allclose(single.token_probs, batched.token_probs, atol=1e-5)
        hf = model.generate(
            torch.tensor([p]),
            attention_mask=torch.ones(1, len(p), dtype=torch.long),
            do_sample=False,
            max_new_tokens=6,
            pad_token_id=tok.pad_token_id,
        )[0, len(p) :].tolist()
        eos = tok.eos_token_id
        hf = hf[: hf.index(eos) + 1] if eos in hf else hf
        assert list(single.token_ids) == [t for t in hf if t != eos]
        assert all(0.0 < q <= 1.0 for q in single.token_probs)


def test_greedy_projects_only_the_last_position(tiny):
    model, tok = tiny
    seen = []
    hook = model.register_forward_hook(
        lambda m, args, kwargs, out: seen.append((kwargs.get("logits_to_keep"), out.logits.shape[1])),
        with_kwargs=True,
    )
    try:
        prompt = tok("What is 2 + 3?")["input_ids"]
        generate_greedy(model, tok, [prompt], max_new_tokens=3, stop_at_newline=False)
    finally:
        hook.remove()
    assert len(seen) == 3 and len(prompt) > 1
    assert all(keep == 1 and positions == 1 for keep, positions in seen)


def test_greedy_on_a_peft_model_uses_the_current_cache_name_and_one_head_row():
    """A peft wrapper's forward takes **kwargs: the wrapped model's signature decides the names."""
    from llm_calib.calm.lora import attach_lora
    from llm_calib.config.calibration import LoraSettings

    model, tok = tiny_random_model(seed=0, init_std=0.1)
    peft_model = attach_lora(model, LoraSettings(rank=2, layers=(1,)))
    seen = []
    hook = peft_model.get_base_model().register_forward_hook(
        lambda m, args, kwargs, out: seen.append(sorted(kwargs)), with_kwargs=True
    )
    prompt = tok("What is 2 + 3?")["input_ids"]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", FutureWarning)  # transformers' past_key_values deprecation
            out = generate_greedy(peft_model, tok, [prompt], max_new_tokens=3, stop_at_newline=False)
    finally:
        hook.remove()
    assert out[0].token_ids == generate_greedy(model, tok, [prompt], max_new_tokens=3, stop_at_newline=False)[0].token_ids
    current = cache_keyword(model)  # "cache" from transformers 5.2x, "past_key_values" before
    stale = {"cache", "past_key_values"} - {current}
    assert seen and all(current in k and "logits_to_keep" in k and not stale & set(k) for k in seen)


class _ScriptedLM(torch.nn.Module):
    """Emits a fixed token script with fixed probabilities, whatever the input."""

    def __init__(self, script: list[int], vocab: int, eos: int, p: float = 0.8):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.script, self.vocab, self.p = script, vocab, p
        self.config = SimpleNamespace(eos_token_id=eos)

    def forward(
        self, input_ids, attention_mask=None, position_ids=None, use_cache=True, cache=None
    ):
        step = 0 if cache is None else cache
        tok = self.script[min(step, len(self.script) - 1)]
        probs = torch.full((input_ids.shape[0], self.vocab), (1 - self.p) / (self.vocab - 1))
        probs[:, tok] = self.p
        logits = torch.log(probs)[:, None, :].expand(-1, input_ids.shape[1], -1)
        return SimpleNamespace(logits=logits, cache=step + 1)


def _ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def test_stops_at_newline_and_eos(tiny_tokenizer):
    tok = tiny_tokenizer
    paris, newline, eos = _ids(tok, " Paris"), _ids(tok, "\n"), tok.eos_token_id
    lm = _ScriptedLM(paris + newline + paris, len(tok), eos, p=0.8)
    out = generate_greedy(lm, tok, [[1, 2]], max_new_tokens=10)[0]
    assert (out.text, out.stop, out.token_ids) == ("Paris", "newline", tuple(paris))
    assert out.token_probs == pytest.approx((0.8,) * len(paris), rel=F32_RTOL)
    lm = _ScriptedLM([*paris, eos, *paris], len(tok), eos)
    out = generate_greedy(lm, tok, [[1, 2]], max_new_tokens=10)[0]
    assert (out.text, out.stop) == ("Paris", "eos")
    out = generate_greedy(lm, tok, [[1, 2]], max_new_tokens=1)[0]
    assert out.stop == "length" and len(out.token_ids) == 1
    lm = _ScriptedLM([eos], len(tok), eos, p=0.3)  # empty answer: confidence of stopping
    out = generate_greedy(lm, tok, [[1, 2]], max_new_tokens=5)[0]
    assert out.text == "" and out.token_probs == pytest.approx((0.3,), rel=F32_RTOL)


def test_score_open_ended_correctness_and_confidence(tiny_tokenizer):
    tok = tiny_tokenizer
    lm = _ScriptedLM([*_ids(tok, " Paris"), tok.eos_token_id], len(tok), tok.eos_token_id, p=0.6)
    recs = [
        OpenQA("Capital of France?", ("Paris", "City of Light"), "geo", "q0"),
        OpenQA("Capital of Italy?", ("Rome",), "geo", "q1"),
        OpenQA("Where is the Louvre?", ("Paris, France",), "art", "q2"),
    ]
    s = score_open_ended(lm, tok, recs, batch_size=2)
    assert s.answers == ["Paris"] * 3
    assert s.correct.tolist() == [True, False, False]
    np.testing.assert_allclose(s.f1, [1.0, 0.0, 2 * 1 * 0.5 / 1.5])
    n = len(_ids(tok, " Paris"))
    np.testing.assert_allclose(s.confidence("mean"), 0.6, rtol=F32_RTOL)
    np.testing.assert_allclose(s.confidence("product"), 0.6**n, rtol=n * F32_RTOL)
    assert list(s.by_domain()) == ["geo", "art"]
    with pytest.raises(ValueError, match="kind"):
        s.confidence("median")


def test_open_ended_argument_errors(tiny):
    model, tok = tiny
    with pytest.raises(TypeError, match="OpenQA"):
        score_open_ended(model, tok, [MultipleChoice("q?", ("a", "b"), 0, "d", "0")])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate_greedy(model, tok, [[1]], max_new_tokens=0)


def test_open_ended_set_confidence_kinds():
    s = OpenEndedSet(["a"], [("a",)], ["d"], ["0"], [(0.5, 0.2)])
    assert s.confidence("min").tolist() == [0.2]
    assert s.confidence("product").tolist() == pytest.approx([0.1])
