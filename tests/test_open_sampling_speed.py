"""benchmarks/open_sampling_speed.py on the tiny model: its reference (N separate ``generate``
calls, stopped at a newline) draws what ``sample_answers`` draws, and its match rule is strict."""

from __future__ import annotations

import torch
from _benchmarks import load_benchmark

from llm_calib.engine.sampling import SamplingSettings, sample_answers
from llm_calib.models import tiny_random_model


def test_reference_matches_sample_answers_on_the_tiny_model():
    bench = load_benchmark("open_sampling_speed")
    model, tok = tiny_random_model(seed=1, init_std=0.05)
    prompts = [tok(t)["input_ids"] for t in ("Capital of France?", "2 + 2 =", "Largest planet?")]
    settings = SamplingSettings(n=3, temperature=1.0, seed=7, max_new_tokens=6)
    ours = sample_answers(model, tok, prompts, settings, batch_size=3)
    refs = bench.reference(model, tok, prompts, [0, 1, 2], settings)
    pairs = [(s.token_ids, r) for q, r_q in zip(ours, refs, strict=True) for s, r in zip(q, r_q, strict=True)]
    assert all(bench.same(s, r) for s, r in pairs)
    assert len({tuple(r) for _, r in pairs}) > 1  # the samples differ: a real comparison


def test_match_rule():
    bench = load_benchmark("open_sampling_speed")
    assert bench.same((1, 2), [1, 2])
    assert bench.same((1, 2), [1, 2, 9])  # the reference keeps the newline token sample_answers drops
    assert not bench.same((1, 2), [1, 2, 9, 9])  # the reference went on: the sample stopped too early
    assert not bench.same((1, 3), [1, 2])
    assert not bench.same((1,), [1, 2, 3])


def test_newline_criterion_stops_at_a_newline_token():
    bench = load_benchmark("open_sampling_speed")
    _, tok = tiny_random_model()
    stop = bench.NewlineOrEos(tok)
    newline = tok("\n")["input_ids"][-1]
    plain = tok("a")["input_ids"][-1]
    assert bool(stop(torch.tensor([[plain, newline]]), None))
    assert not bool(stop(torch.tensor([[newline, plain]]), None))
