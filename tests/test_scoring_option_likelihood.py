"""Batched option likelihood against the one-sequence-per-option reference."""

from __future__ import annotations

import math

import pytest
import torch
from _benchmarks import load_harness

from llm_calib.data.records import MultipleChoice, OpenQA
from llm_calib.prompts.templates import PromptFormat
from llm_calib.scoring import score_option_likelihood
from llm_calib.scoring.option_likelihood import encode_questions

# the slow one-sequence-per-option reference (benchmarks/harness/naive_scoring.py, not library API)
score_option_likelihood_naive = load_harness("naive_scoring").score_option_likelihood_naive


def _max_excess(a, b) -> float:
    """Largest |a - b| - (1e-5 + 1e-6 |b|) over all option scores (<= 0: close).

    Both are sums of float32 token log-probabilities computed in batches of different shapes: each
    term carries a few units of float32 rounding (~1e-7 relative, CPU-dependent), so long options
    (sums > 100) need the relative part.
    """
    assert len(a.logits) == len(b.logits)
    return max(
        float(((x.double() - y.double()).abs() - 1e-5 - 1e-6 * y.double().abs()).max())
        for x, y in zip(a.logits, b.logits, strict=True)
    )


@pytest.mark.parametrize("normalize", ["sum", "mean"])
@pytest.mark.parametrize("chat", [None, False])
@pytest.mark.parametrize("style", ["cloze", "listed"])
def test_matches_naive_reference(tiny, mc_records, normalize, chat, style):
    model, tok = tiny
    fmt = PromptFormat(style=style, chat_template=chat)
    ref = score_option_likelihood_naive(model, tok, mc_records, normalize=normalize, prompt=fmt)
    for strategy in ("packed", "padded"):
        for batch_size in (1, 4, 16):
            got = score_option_likelihood(
                model,
                tok,
                mc_records,
                normalize=normalize,
                prompt=fmt,
                batch_size=batch_size,
                strategy=strategy,
            )
            assert _max_excess(got, ref) <= 0, (strategy, batch_size)
            assert [len(z) for z in got.logits] == [len(r.options) for r in mc_records]


def test_reference_is_a_real_log_likelihood(tiny, mc_records):
    """The naive scores equal a hand computation for one option, and mean = sum / n_tokens."""
    model, tok = tiny
    fmt = PromptFormat()
    enc = encode_questions(tok, mc_records[:1], fmt)[0]
    ids = list(enc.prompt) + list(enc.options[1])
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), -1)
    p = len(enc.prompt)
    manual = sum(float(logp[p - 1 + j, t]) for j, t in enumerate(enc.options[1]))
    s = score_option_likelihood(model, tok, mc_records[:1], normalize="sum")
    m = score_option_likelihood(model, tok, mc_records[:1], normalize="mean")
    # float32 log-probabilities (the scorer) against float64 ones of the same float32 logits
    assert math.isclose(float(s.logits[0][1]), manual, rel_tol=1e-6, abs_tol=1e-5)
    assert math.isclose(float(m.logits[0][1]), manual / len(enc.options[1]), rel_tol=1e-6, abs_tol=1e-6)


def test_result_fields_and_probabilities(tiny, mc_records):
    model, tok = tiny
    s = score_option_likelihood(model, tok, mc_records, batch_size=3)
    assert s.labels == [r.gold for r in mc_records]
    assert s.domains == [r.domain for r in mc_records]
    assert s.ids == [r.id for r in mc_records]
    assert s.scorer == "option_likelihood" and s.info["normalize"] == "sum"
    for p in s.probs:
        assert math.isclose(float(p.sum()), 1.0, abs_tol=1e-6) and bool((p >= 0).all())
    assert all(torch.isfinite(z).all() and (z < 0).all() for z in s.logits)


def test_one_decoder_pass_per_batch_and_head_only_on_needed_rows(tiny, mc_records):
    model, tok = tiny
    enc = encode_questions(tok, mc_records, PromptFormat())
    # one shared row for each question's first option token + one per later option token
    needed = sum(1 + sum(len(o) - 1 for o in e.options) for e in enc)
    for prefix_cache in (False, True):
        calls, head_rows = [], []
        h1 = model.model.register_forward_hook(lambda m, i, o, calls=calls: calls.append(1))
        h2 = model.lm_head.register_forward_hook(lambda m, i, o, rows=head_rows: rows.append(i[0].shape[0]))
        try:
            scored = score_option_likelihood(model, tok, mc_records, batch_size=4, prefix_cache=prefix_cache)
        finally:
            h1.remove()
            h2.remove()
        # with the prefix cache, one more pass per shared prefix (here the chat template's system message)
        prefixes = scored.info["prefix_cache"]["groups"] if prefix_cache else 0
        assert len(calls) == math.ceil(len(mc_records) / 4) + prefixes
        assert sum(head_rows) == needed


def test_long_option_sums_agree(tiny):
    model, tok = tiny
    long = "the quick brown fox jumps over the lazy dog " * 6
    recs = [MultipleChoice("Say it.", (long, "dog", long + "again"), 0, "d", "x")]
    ref = score_option_likelihood_naive(model, tok, recs)
    got = score_option_likelihood(model, tok, recs)
    assert float(ref.logits[0].abs().max()) > 100  # large sums, still equal
    assert _max_excess(got, ref) <= 0


def test_argument_errors(tiny, mc_records):
    model, tok = tiny
    with pytest.raises(ValueError, match="normalize"):
        score_option_likelihood(model, tok, mc_records, normalize="max")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="batch_size"):
        score_option_likelihood(model, tok, mc_records, batch_size=0)
    with pytest.raises(ValueError, match="strategy"):
        score_option_likelihood(model, tok, mc_records, strategy="fast")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="MultipleChoice"):
        score_option_likelihood(model, tok, [OpenQA("q?", ("a",), "d", "0")])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="normalize"):
        score_option_likelihood_naive(model, tok, mc_records, normalize="max")  # type: ignore[arg-type]


def test_empty_input_gives_empty_set(tiny):
    model, tok = tiny
    assert len(score_option_likelihood(model, tok, [])) == 0
