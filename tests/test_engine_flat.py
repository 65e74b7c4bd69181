"""Flat continuation batches (llm_calib.engine.flat): a batch's real tokens run as one unpadded
sequence, attention split into the shared-prefix part and each question's own part, merged by
log-sum-exp. Checked against the naive computation, one full forward pass per (question, option)
as lm-eval runs it, in float64 (exactness) and float32 (the scorers' tolerances): ragged lengths,
multi-token options, batches mixing several prefixes and questions without one, the CPU's fused
kernel and the matrix-product path, the fallback for models that cannot run flat, the planner
that fills flat batches across prefix groups, and the memory it reports."""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from llm_calib.data import MultipleChoice
from llm_calib.engine.flat import (
    FlatUnsupportedError,
    attention_with_logsumexp,
    flat_batch,
    flat_batches,
    flat_supported,
    forward_rows_flat,
    merge_attention,
)
from llm_calib.engine.options import forward_rows
from llm_calib.engine.packing import pack_continuations, pack_letters, pack_questions
from llm_calib.engine.prefix import (
    PrefixCacheStats,
    compute_prefix,
    forward_rows_after,
    plan_prefix_batches,
    run_prefix_plan,
)
from llm_calib.models import tiny_random_model
from llm_calib.prompts.templates import PromptFormat, preset, with_fewshot
from llm_calib.scoring import score_letter, score_option_likelihood
from llm_calib.scoring.option_likelihood import EncodedQuestion, option_log_likelihoods


@pytest.fixture(scope="module")
def tiny64():
    model, tok = tiny_random_model(seed=3, num_layers=3)
    return model.double(), tok


@pytest.fixture(scope="module")
def tiny32():
    return tiny_random_model(seed=4, num_layers=3)


def naive_option_logprobs(model, prompt, options) -> list[torch.Tensor]:
    """One full forward pass of ``prompt + option`` per option (what lm-eval computes)."""
    out = []
    with torch.inference_mode():
        for opt in options:
            ids = torch.tensor([list(prompt) + list(opt)])
            logp = torch.log_softmax(model(input_ids=ids).logits[0].double(), dim=-1)
            at = torch.arange(len(prompt) - 1, len(prompt) + len(opt) - 1)
            out.append(logp[at, torch.tensor(opt)])
    return out


def _mixed_batch(model):
    """Questions on two prefixes and on none, ragged prompts, options of 1 to 4 tokens, 2 to 5 options."""
    shot_a, shot_b = list(range(40, 70)), list(range(100, 125))
    kv_a, kv_b = compute_prefix(model, shot_a), compute_prefix(model, shot_b)
    rows = [
        (shot_a, [5], [(8,), (9, 10, 11)]),
        (shot_b, [12, 13, 14, 15, 16, 17, 18], [(13, 14), (15,), (16,), (17, 18, 19, 20)]),
        (shot_a, list(range(130, 145)), [(21,), (22,)]),
        (None, [30, 31, 32], [(33, 34), (35,), (36, 37, 38), (39,), (33,)]),
        (shot_b, [50], [(51, 52, 53), (54, 55)]),
        (None, list(range(150, 170)), [(60,), (61, 62)]),
    ]
    kv = {id(shot_a): kv_a, id(shot_b): kv_b}
    prefixes = [kv[id(s)] if s is not None else None for s, _, _ in rows]
    items = [EncodedQuestion(tuple((s or []) + p), tuple(o)) for s, p, o in rows]
    return rows, prefixes, items


@pytest.mark.parametrize("fused", [None, False])
def test_a_mixed_batch_equals_one_forward_pass_per_option(tiny64, fused) -> None:
    model, _ = tiny64
    rows, prefixes, items = _mixed_batch(model)
    with flat_batches(fused_attention=fused):
        flat = option_log_likelihoods(model, items, prefix=prefixes)
    for (shot, prompt, options), got in zip(rows, flat, strict=True):
        want = naive_option_logprobs(model, (shot or []) + prompt, options)
        for g, w in zip(got, want, strict=True):
            assert torch.allclose(g, w, atol=1e-10, rtol=0)
    # the same questions without prefixes, flat and padded
    whole = option_log_likelihoods(model, items)
    with flat_batches(False):
        padded = option_log_likelihoods(model, items)
    for a, b, c in zip(flat, whole, padded, strict=True):
        for x, y, z in zip(a, b, c, strict=True):
            assert torch.allclose(x, y, atol=1e-10, rtol=0) and torch.allclose(x, z, atol=1e-10, rtol=0)


@settings(max_examples=20, deadline=None)
@given(st.data())
def test_random_batches_equal_the_naive_computation(tiny64, data) -> None:
    model, _ = tiny64
    shots = {"a": list(range(40, 60)), "b": list(range(200, 217))}
    kvs = {k: compute_prefix(model, v) for k, v in shots.items()}
    n = data.draw(st.integers(1, 5), label="questions")
    token = st.integers(3, 300)
    rows = []
    for _ in range(n):
        which = data.draw(st.sampled_from([None, "a", "b"]))
        prompt = data.draw(st.lists(token, min_size=1, max_size=14))
        options = data.draw(st.lists(st.lists(token, min_size=1, max_size=4).map(tuple), min_size=1, max_size=4))
        rows.append((which, prompt, options))
    items = [EncodedQuestion(tuple((shots[w] if w else []) + p), tuple(o)) for w, p, o in rows]
    flat = option_log_likelihoods(model, items, prefix=[kvs[w] if w else None for w, _, _ in rows])
    for (w, prompt, options), got in zip(rows, flat, strict=True):
        for g, want in zip(got, naive_option_logprobs(model, (shots[w] if w else []) + prompt, options), strict=True):
            assert torch.allclose(g, want, atol=1e-10, rtol=0)


def test_letters_and_continuations_run_flat_as_whole_sequences(tiny64) -> None:
    model, _ = tiny64
    prompts = [(5, 6, 7, 8, 9, 10, 11), (12,), (13, 14, 15)]
    letters = pack_letters(prompts, [(3, 4), (3, 4, 5), (3, 4, 5, 6)], pad_id=0)
    answers = pack_continuations([(p, (20 + i, 21, 22)[: 1 + i]) for i, p in enumerate(prompts)], pad_id=0)
    for packed in (letters, answers):
        with torch.inference_mode():
            whole = forward_rows(model, packed)[0]
        assert torch.allclose(forward_rows_flat(model, packed), whole, atol=1e-10, rtol=0)
        kv = compute_prefix(model, (1, 2, 3, 4))
        after = forward_rows_flat(model, packed, kv)
        with flat_batches(False):
            padded = forward_rows_after(model, kv, packed)
        assert torch.allclose(after, padded, atol=1e-10, rtol=0)


def test_the_layout_runs_only_needed_tokens_and_splits_ragged_own_parts() -> None:
    items = [((1, 2, 3), ((4, 5), (6,), (7, 8, 9))), ((10,), ((11,), (12,)))]
    fb = flat_batch(pack_questions(items, pad_id=0), None)
    # the last token of each option is not run: 5, 6, 9, 11 and 12
    assert fb.input_ids.tolist() == [[1, 2, 3, 4, 7, 8, 10]]
    assert fb.position_ids.tolist() == [[0, 1, 2, 3, 3, 4, 0]]
    assert fb.input_ids[0, fb.rows].tolist() == [3, 4, 7, 8, 10]  # rows predict the option tokens
    assert len(fb.own_parts) == 1 and fb.own_parts[0].bias is not None  # options do not see each other
    # plainly causal rows (letters) run without a mask; very different lengths in separate calls
    letters = pack_letters([tuple(range(1, 200)), (7, 8), (9, 10, 11)], [(3, 4)] * 3, pad_id=0)
    parts = flat_batch(letters, None).own_parts
    assert [p.shape for p in parts] == [(2, 3), (1, 199)] and all(p.bias is None for p in parts)
    assert [p.shape for p in flat_batch(letters, None, own_overhead=10**9).own_parts] == [(3, 199)]


def test_own_part_splits_do_not_change_the_numbers(tiny64) -> None:
    model, _ = tiny64
    items = [((5,) * 200, ((8, 7), (9, 10))), ((11, 12), ((13, 14), (15,))), ((16,) * 9, ((17, 18, 19),))]
    packed = pack_questions(items, pad_id=0)
    decoder_rows = forward_rows(model, packed)[0]
    assert len(flat_batch(packed, None).own_parts) > 1
    assert torch.allclose(forward_rows_flat(model, packed), decoder_rows, atol=1e-10, rtol=0)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("max_scores", [2**24, 60])  # 60: blocks of one query per product
def test_attention_with_logsumexp_fused_and_matrix_products_agree(causal, max_scores, monkeypatch) -> None:
    import llm_calib.engine.flat as flat

    monkeypatch.setattr(flat, "MAX_SCORES", max_scores)
    torch.manual_seed(0)
    q, k, v = torch.randn(3, 6, 7, 16), torch.randn(3, 2, 7, 16), torch.randn(3, 2, 7, 16)
    allowed = torch.rand(3, 1, 7, 7) > 0.4
    allowed |= torch.eye(7, dtype=torch.bool)
    bias = None if causal else torch.zeros(allowed.shape).masked_fill_(~allowed, torch.finfo(torch.float32).min)
    mask = torch.ones(7, 7, dtype=torch.bool).tril() if causal else allowed
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True, scale=0.3)
    scores = (q @ k.repeat_interleave(3, dim=1).transpose(-1, -2)) * 0.3
    ref_lse = scores.masked_fill(~mask, float("-inf")).logsumexp(-1)
    for fused in (True, False):
        out, lse = attention_with_logsumexp(q, k, v, bias, 0.3, causal=causal, fused=fused)
        assert torch.allclose(out, ref, atol=1e-5) and torch.allclose(lse, ref_lse, atol=1e-5)
    with pytest.raises(ValueError, match="causal call takes no bias"):
        attention_with_logsumexp(q, k, v, torch.zeros(3, 1, 7, 7), 0.3, causal=True)


def test_merging_two_key_sets_is_attention_over_their_union() -> None:
    torch.manual_seed(1)
    q, k, v = (torch.randn(2, 4, 5, 8, dtype=torch.float64) for _ in range(3))
    k, v = torch.cat([k, torch.randn(2, 4, 3, 8, dtype=torch.float64)], 2), torch.cat([v, v[:, :, :3]], 2)
    a = attention_with_logsumexp(q, k[:, :, :5], v[:, :, :5], None, 0.5, fused=False)
    b = attention_with_logsumexp(q, k[:, :, 5:], v[:, :, 5:], None, 0.5, fused=False)
    whole, whole_lse = attention_with_logsumexp(q, k, v, None, 0.5, fused=False)
    out, lse = merge_attention(*a, *b)
    assert torch.allclose(out, whole, atol=1e-12) and torch.allclose(lse, whole_lse, atol=1e-12)


def test_a_model_that_cannot_run_flat_falls_back_to_the_padded_layout(tiny32) -> None:
    model = copy.deepcopy(tiny32[0])
    decoder = model.get_decoder()
    decoder.layers[1].self_attn.config = copy.deepcopy(decoder.config)  # a layer that ignores the switch
    items = [((5, 6, 7), ((8,), (9, 10))), ((11, 12, 13, 14), ((15, 16),))]
    packed = pack_questions(items, pad_id=0)
    assert flat_supported(model)
    with pytest.raises(FlatUnsupportedError, match=r"2 of 3 attention layers"):
        forward_rows_flat(model, packed)
    assert not flat_supported(model)  # remembered
    with torch.inference_mode():
        whole = forward_rows(model, packed)[0]
    assert torch.allclose(forward_rows_after(model, None, packed), whole, atol=1e-6)
    kv = compute_prefix(model, [1, 2, 3])
    with pytest.raises(ValueError, match="different prefixes need a model that runs flat batches"):
        forward_rows_after(model, [kv, None], packed)


def test_a_sliding_window_within_reach_is_not_run_flat() -> None:
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    config = MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, sliding_window=6, max_position_embeddings=128)
    model = MistralForCausalLM(config).eval()
    items = [((5, 6, 7, 8, 9, 10, 11, 12), ((13,), (14, 15))), ((16, 17), ((18,),))]
    packed = pack_questions(items, pad_id=0)
    with torch.inference_mode():
        whole = forward_rows(model, packed)[0]
    with pytest.raises(FlatUnsupportedError, match="sliding window of 6"):
        forward_rows_flat(model, packed)
    assert torch.allclose(forward_rows_after(model, None, packed), whole, atol=1e-6)


def test_flat_plans_fill_batches_across_groups_and_bound_the_prefixes_held() -> None:
    a, b = [7] * 20, [8] * 30
    prompts = [[*a, 1], [*b, 2], [*a, 3, 3], [*b, 4], [*a, 5], [9, 9], [6, 6, 6]]
    lengths = [len(p) + 1 for p in prompts]
    plan = plan_prefix_batches(prompts, lengths, 4, bytes_per_token=10, max_bytes=1e9, flat=True)
    assert [(s.prefix_len, s.indices, s.joins_previous) for s in plan] == [
        (20, (0, 4, 2), False), (30, (1,), True), (30, (3,), False), (0, (5, 6), True)]
    # the prefixes of one batch fit max_bytes together: 20 + 30 tokens do not fit 400 bytes
    plan = plan_prefix_batches(prompts, lengths, 4, bytes_per_token=10, max_bytes=400, flat=True)
    assert [(s.prefix_len, s.indices, s.joins_previous) for s in plan] == [
        (20, (0, 4, 2), False), (30, (1, 3), False), (0, (5, 6), True)]
    # a prefix larger than max_bytes alone is not shared
    plan = plan_prefix_batches(prompts, lengths, 8, bytes_per_token=10, max_bytes=250, flat=True)
    assert [(s.prefix_len, s.indices) for s in plan] == [(20, (0, 4, 2)), (0, (5, 6, 1, 3))]


def test_running_a_flat_plan_computes_each_prefix_once_and_counts_what_it_holds(tiny32) -> None:
    model, _ = tiny32
    a, b = list(range(20, 40)), list(range(50, 80))
    prompts = [[*a, 1], [*b, 2], [*a, 3, 3], [*b, 4], [*a, 5], [9, 9]]
    plan = plan_prefix_batches(prompts, [len(p) for p in prompts], 2, bytes_per_token=1, max_bytes=1e9, flat=True)
    seen: list[list[int | None]] = []

    def score(idx, kvs):
        seen.append([kv.length if kv is not None else None for kv in kvs])
        return [kv.length if kv is not None else 0 for kv in kvs]

    stats = PrefixCacheStats()
    assert run_prefix_plan(model, prompts, plan, score, stats=stats, flat=True) == [20, 30, 20, 30, 20, 0]
    assert seen == [[20, 20], [20, 30], [30, None]]
    assert (stats.groups, stats.requests, stats.tokens_saved) == (2, 5, 2 * 20 + 30)
    per_token = compute_prefix(model, [1]).nbytes
    assert stats.peak_bytes == (20 + 30) * per_token  # both prefixes held by the second batch, once each


def _fewshot_records():
    pools = {d: [MultipleChoice(f"Which {d} number follows {k}?", (str(k + 1), str(k + 2)), 0, d, f"{d}{k}")
                 for k in range(4)] for d in ("math", "logic")}
    recs = [MultipleChoice(f"What is the capital of {c}{'?' * (1 + i % 3)}", ("Paris", "Rome", "Madrid and more",
                                                                            "Oslo")[: 2 + i % 3], i % 2, "geo", f"q{i}")
            for i, c in enumerate(["France", "Italy", "Spain", "Norway", "Peru", "Japan", "Chile", "Egypt"])]
    return pools, recs


def test_scorers_give_the_same_scores_flat_and_padded(tiny32) -> None:
    model, tok = tiny32
    pools, recs = _fewshot_records()
    for style in ("plain", "listed"):
        base = preset("lm_eval_mmlu", fewshot=3, fewshot_sampler="first_n") if style == "listed" else \
            PromptFormat(fewshot=3, fewshot_sampler="first_n")
        scorer = score_letter if style == "listed" else score_option_likelihood
        # two few-shot pools (two prefixes) and zero-shot questions, scored in one call
        fmts = [with_fewshot(base, pools["math"]), with_fewshot(base, pools["logic"])]
        got = [scorer(model, tok, recs[:4], prompt=f, batch_size=3) for f in fmts]
        with flat_batches(False):
            want = [scorer(model, tok, recs[:4], prompt=f, batch_size=3) for f in fmts]
        for g, w in zip(got, want, strict=True):
            assert g.info["prefix_cache"]["groups"] == 1
            for x, y in zip(g.logits, w.logits, strict=True):
                assert torch.allclose(x, y, atol=1e-5, rtol=0)
            assert (g.predictions == w.predictions).all()
    zero = PromptFormat(chat_template=False)
    flat = score_option_likelihood(model, tok, recs, prompt=zero, batch_size=3)
    with flat_batches(False):
        padded = score_option_likelihood(model, tok, recs, prompt=zero, batch_size=3)
    for x, y in zip(flat.logits, padded.logits, strict=True):
        assert torch.allclose(x, y, atol=1e-5, rtol=0)


def test_a_flat_batch_holds_each_prefix_once(tiny32) -> None:
    model, tok = tiny32
    pools, recs = _fewshot_records()
    fmt = with_fewshot(PromptFormat(fewshot=3, fewshot_sampler="first_n"), pools["math"])
    scored = score_option_likelihood(model, tok, recs, prompt=fmt, batch_size=8)
    stats = scored.info["prefix_cache"]
    prefix_tokens = stats["tokens_saved"] // (stats["requests"] - 1)
    assert stats["groups"] == 1 and stats["peak_bytes"] == prefix_tokens * compute_prefix(model, [1]).nbytes
    # a bound below the prefix: not shared, same scores
    alone = score_option_likelihood(model, tok, recs, prompt=fmt, batch_size=8,
                                    prefix_cache_mb=0.5 * stats["peak_bytes"] / 2**20)
    assert alone.info["prefix_cache"]["groups"] == 0
    for x, y in zip(scored.logits, alone.logits, strict=True):
        assert torch.allclose(x, y, atol=1e-5, rtol=0)
