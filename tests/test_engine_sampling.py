"""Sampled answers: the shared prompt cache draws exactly what separate `generate` calls draw."""

from __future__ import annotations

import pytest
import torch

from llm_calib.engine.sampling import SamplingSettings, sample_answers, sample_seed
from llm_calib.models import tiny_random_model

PROMPTS = ["Capital of France?", "2 + 2 =", "The largest planet in the solar system is", "Q"]


def _reference(model, tok, prompt, settings, q, i):
    """One Hugging Face `generate` call for sample i of question q, seeded as sample_answers seeds it."""
    torch.manual_seed(sample_seed(settings.seed, q, i))
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=settings.temperature,
                         top_p=settings.top_p, top_k=0, max_new_tokens=settings.max_new_tokens,
                         pad_token_id=tok.pad_token_id)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 1.0), (0.7, 0.9), (1.5, 0.5)])
def test_same_token_ids_as_separate_generate_calls(temperature, top_p):
    model, tok = tiny_random_model(seed=1, init_std=0.05)
    prompts = [tok(t)["input_ids"] for t in PROMPTS]
    settings = SamplingSettings(n=3, temperature=temperature, top_p=top_p, seed=5, max_new_tokens=5)
    got = sample_answers(model, tok, prompts, settings, batch_size=3, stop_at_newline=False)
    for q, prompt in enumerate(prompts):
        for i, sample in enumerate(got[q]):
            ref = _reference(model, tok, prompt, settings, q, i)
            assert list(sample.token_ids) == ref[: len(sample.token_ids)], (q, i)
            assert sample.seed == sample_seed(settings.seed, q, i)


def test_samples_do_not_depend_on_the_batch_and_differ_between_samples():
    model, tok = tiny_random_model(seed=2, init_std=0.05)
    prompts = [tok(t)["input_ids"] for t in PROMPTS]
    settings = SamplingSettings(n=4, seed=3, max_new_tokens=4)
    whole = sample_answers(model, tok, prompts, settings, batch_size=4)
    one_by_one = [sample_answers(model, tok, [p], settings, question_indices=[q])[0] for q, p in enumerate(prompts)]
    assert [[s.token_ids for s in q] for q in whole] == [[s.token_ids for s in q] for q in one_by_one]
    assert len({s.token_ids for q in whole for s in q}) > len(prompts)  # not the same answer every time
    again = sample_answers(model, tok, prompts, settings, batch_size=2)
    assert [[s.token_ids for s in q] for q in whole] == [[s.token_ids for s in q] for q in again]


def test_token_probs_are_the_models_temperature_one_probabilities():
    model, tok = tiny_random_model(seed=4, init_std=0.05)
    prompt = tok("Capital of France?")["input_ids"]
    sample = sample_answers(model, tok, [prompt], SamplingSettings(n=1, temperature=2.0, seed=0, max_new_tokens=3),
                            stop_at_newline=False)[0][0]
    ids = list(prompt)
    for token, prob in zip(sample.token_ids, sample.token_probs, strict=True):
        with torch.no_grad():
            p = torch.softmax(model(torch.tensor([ids])).logits[0, -1].float(), -1)[token]
        assert prob == pytest.approx(float(p), rel=1e-4)
        ids.append(token)


def test_stop_sequences_cut_the_answer():
    model, tok = tiny_random_model(seed=1, init_std=0.05)
    prompt = tok("Capital of France?")["input_ids"]
    settings = SamplingSettings(n=2, seed=0, max_new_tokens=6)
    free = sample_answers(model, tok, [prompt], settings, stop_at_newline=False)[0]
    text = tok.decode(free[0].token_ids)
    stop = text.strip()[:1]
    if not stop:
        pytest.skip("the first sample is empty")
    cut = sample_answers(model, tok, [prompt], settings, until=[[stop]])[0]
    assert stop not in cut[0].text


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"n": 0}, r"samples \(n\) must be an integer >= 1, got 0"),
    ({"temperature": 0.0}, "temperature must be a finite number > 0"),
    ({"temperature": float("inf")}, "temperature must be a finite number > 0"),
    ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
    ({"max_new_tokens": 0}, "max_new_tokens must be an integer >= 1"),
])
def test_bad_settings(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingSettings(**kwargs)
