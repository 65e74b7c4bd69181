"""The prefix cache (llm_calib.engine.prefix): grouping by exact token prefixes, the memory bound,
continuations run on a computed prefix equal whole sequences, and the scorers give the same
scores with it (within float32 rounding) and bit-identical scores without it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from llm_calib.data import MultipleChoice
from llm_calib.engine.flat import flat_batches
from llm_calib.engine.options import forward_rows, target_logprobs
from llm_calib.engine.packing import pack_letters, pack_questions
from llm_calib.engine.prefix import (
    PrefixCacheSettings,
    compute_prefix,
    forward_rows_after,
    kv_bytes_per_token,
    plan_prefix_batches,
    prefix_cache,
    prefix_cache_settings,
    prefix_groups,
)
from llm_calib.models import tiny_random_model
from llm_calib.prompts.templates import PromptFormat, preset, with_fewshot
from llm_calib.scoring import score_letter, score_option_likelihood
from llm_calib.scoring.base import score_in_batches
from llm_calib.scoring.option_likelihood import encode_questions, option_log_likelihoods


@pytest.fixture(scope="module")
def tiny():
    return tiny_random_model(seed=0, num_layers=3)


def _questions(n: int) -> list[MultipleChoice]:
    topics = ["France", "Italy", "Spain", "Norway", "Peru", "Japan", "Chile", "Egypt", "Kenya", "Nepal"]
    return [MultipleChoice(f"What is the capital of {topics[i % len(topics)]}{'?' * (1 + i % 3)}",
                           ("Paris", "Rome", "Madrid and more", "Oslo")[: 2 + i % 3], i % 2, "geo", f"q{i}")
            for i in range(n)]


def _fewshot_format(style: str = "plain") -> PromptFormat:
    pool = [MultipleChoice(f"Which number follows {k}?", (str(k + 1), str(k + 2)), 0, "math", f"s{k}") for k in range(4)]
    fmt = preset("lm_eval_mmlu", fewshot=3, fewshot_sampler="first_n") if style == "listed" else \
        PromptFormat(fewshot=3, fewshot_sampler="first_n")
    return with_fewshot(fmt, pool)


def test_prefix_groups_share_exact_token_prefixes() -> None:
    shot, other = [7] * 30, [8] * 30
    prompts = [[*shot, 1, 2], [*other, 1], [*shot, 3], [9, 9, 9], [*other, 4, 4], [*shot, 1, 5]]
    groups = {g.indices: g.prefix_len for g in prefix_groups(prompts, min_tokens=8)}
    assert groups == {(0, 2, 5): 30, (1, 4): 30, (3,): 0}
    # a prompt that is all prefix keeps its last token for the continuation
    assert prefix_groups([shot, [*shot, 1]], min_tokens=8)[0].prefix_len == 29
    # a long shared context is not cut back to a short description shared with one more prompt
    desc = [5] * 10
    prompts = [desc + shot + [1], desc + shot + [2], desc + shot + [3], desc + [4] * 40]
    assert {g.indices: g.prefix_len for g in prefix_groups(prompts, min_tokens=8)} == {(0, 1, 2): 40, (3,): 0}
    assert all(g.prefix_len == 0 for g in prefix_groups(prompts, min_tokens=41))
    with pytest.raises(ValueError, match="min_tokens must be a positive integer"):
        prefix_groups(prompts, min_tokens=0)


def test_plan_bounds_the_prefix_bytes_and_sorts_rows_by_length() -> None:
    shot = [7] * 20
    prompts = [shot + [1] * k for k in (5, 1, 3, 2, 4)] + [[9, 9]]
    lengths = [len(p) + 2 for p in prompts]
    plan = plan_prefix_batches(prompts, lengths, 8, bytes_per_token=10, max_bytes=1e9)
    assert [(b.prefix_len, b.indices) for b in plan] == [(20, (1, 3, 2, 4, 0)), (0, (5,))]
    # (rows + 1) * 20 tokens * 10 bytes <= 700 bytes: at most 2 rows per batch
    plan = plan_prefix_batches(prompts, lengths, 8, bytes_per_token=10, max_bytes=700)
    assert [b.indices for b in plan] == [(1, 3), (2, 4), (0,), (5,)]
    # the prefix and one row do not fit: scored whole, batched by length
    plan = plan_prefix_batches(prompts, lengths, 4, bytes_per_token=10, max_bytes=300)
    assert [(b.prefix_len, b.indices) for b in plan] == [(0, (5, 1, 3, 2)), (0, (4, 0))]


def test_continuations_of_a_computed_prefix_equal_whole_sequences(tiny) -> None:
    model, _ = tiny
    shot = list(range(40, 70))
    items = [([*shot, 5, 6, 7], ((8,), (9, 10, 11))), ([*shot, 12], ((13, 14), (15,), (16,)))]
    kv = compute_prefix(model, shot)
    assert kv.nbytes == len(shot) * kv_bytes_per_token(model)
    with torch.inference_mode():
        whole = forward_rows(model, pack_questions(items, pad_id=0))[0]
        after = forward_rows_after(model, kv, pack_questions([(p[30:], o) for p, o in items], pad_id=0))
        letters = [(3, 4), (3, 4, 5)]
        whole_l = target_logprobs(model, pack_letters([p for p, _ in items], letters, pad_id=0))
        suffix = pack_letters([p[30:] for p, _ in items], letters, pad_id=0)
        after_l = target_logprobs(model, suffix, forward_rows_after(model, kv, suffix))
    assert torch.allclose(whole, after, atol=1e-5)
    assert torch.allclose(whole_l, after_l, atol=1e-5)


def test_fewshot_option_likelihood_shares_the_prefix_and_keeps_the_scores(tiny) -> None:
    model, tok = tiny
    recs, fmt = _questions(10), _fewshot_format()
    on = score_option_likelihood(model, tok, recs, prompt=fmt, batch_size=4, prefix_cache=True)
    off = score_option_likelihood(model, tok, recs, prompt=fmt, batch_size=4, prefix_cache=False)
    stats = on.info["prefix_cache"]
    assert stats["groups"] == 1 and stats["requests"] == 10 and stats["tokens_saved"] > 9 * 40
    assert stats["peak_bytes"] > 0 and "prefix_cache" not in off.info
    for a, b in zip(on.logits, off.logits, strict=True):
        assert torch.allclose(a, b, atol=1e-5, rtol=0)
    assert (on.predictions == off.predictions).all()
    flat = [(x, y) for a, b in zip(on.details, off.details, strict=True) for x, y in zip(a["loglik"], b["loglik"], strict=True)]
    assert max(abs(x - y) for x, y in flat) < 1e-5


def test_disabled_cache_is_bit_identical_to_scoring_without_it(tiny) -> None:
    model, tok = tiny
    recs, fmt = _questions(10), _fewshot_format()
    off = score_option_likelihood(model, tok, recs, prompt=fmt, batch_size=4, prefix_cache=False)
    items = encode_questions(tok, recs, fmt)
    pad = tok.pad_token_id
    direct = score_in_batches([it.n_tokens for it in items], 4,
                              lambda idx: option_log_likelihoods(model, [items[i] for i in idx], pad_id=pad),
                              desc="x", progress=False)
    assert [d["loglik"] for d in off.details] == [[float(t.sum()) for t in q] for q in direct]
    with prefix_cache(enabled=False):  # the context setting, as the CLI's --no-prefix-cache sets it
        again = score_option_likelihood(model, tok, recs, prompt=fmt, batch_size=4)
    assert all(torch.equal(a, b) for a, b in zip(off.logits, again.logits, strict=True))
    # zero-shot prompts that share no prefix: the cache changes nothing, to the bit
    recs = [MultipleChoice(f"{w} is the capital?", ("Paris", "Rome"), 0, "geo", w) for w in ("Which", "Why", "So")]
    fmt = PromptFormat(chat_template=False)  # (a chat template's system message is a shared prefix)
    plain = score_option_likelihood(model, tok, recs, prompt=fmt, batch_size=4)
    plain_off = score_option_likelihood(model, tok, recs, prompt=fmt, batch_size=4, prefix_cache=False)
    assert plain.info["prefix_cache"]["groups"] == 0
    assert all(torch.equal(a, b) for a, b in zip(plain.logits, plain_off.logits, strict=True))


def test_letter_scorer_shares_the_prefix(tiny) -> None:
    model, tok = tiny
    recs, fmt = _questions(9), _fewshot_format("listed")
    on = score_letter(model, tok, recs, prompt=fmt, batch_size=4)
    off = score_letter(model, tok, recs, prompt=fmt, batch_size=4, prefix_cache=False)
    assert on.info["prefix_cache"]["groups"] == 1
    for a, b in zip(on.logits, off.logits, strict=True):
        assert torch.allclose(a, b, atol=1e-5, rtol=0)


def test_memory_bound_is_kept_and_reported(tiny) -> None:
    model, tok = tiny
    recs, fmt = _questions(10), _fewshot_format()
    with flat_batches(False):  # padded batches: the prefix copied per row
        free = score_option_likelihood(model, tok, recs, prompt=fmt, batch_size=8)
        per_prefix = free.info["prefix_cache"]["peak_bytes"] // (8 + 1)
        bound_mb = 3.5 * per_prefix / 2**20  # the prefix and two copies fit, not three
        tight = score_option_likelihood(model, tok, recs, prompt=fmt, batch_size=8, prefix_cache_mb=bound_mb)
    assert tight.info["prefix_cache"]["peak_bytes"] == 3 * per_prefix <= bound_mb * 2**20
    assert tight.info["prefix_cache"]["requests"] == 10
    for a, b in zip(free.logits, tight.logits, strict=True):
        assert torch.allclose(a, b, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match=r"prefix cache size must be > 0 MiB"):
        score_option_likelihood(model, tok, recs, prefix_cache_mb=0)
    assert prefix_cache_settings(max_mb=2) == PrefixCacheSettings(True, 2.0)


LM_EVAL_YAML = """\
task: toy_fewshot
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
    dev: {data}
output_type: multiple_choice
test_split: test
fewshot_split: dev
fewshot_config:
  sampler: first_n
description: "The following are questions about capitals.\\n\\n"
doc_to_text: "Question: {{{{q}}}}\\nAnswer:"
doc_to_target: a
doc_to_choice: "{{{{c}}}}"
metric_list:
  - metric: acc
"""


def test_lm_eval_requests_share_their_fewshot_prefix(tiny, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("lm_eval")
    from llm_calib.data import load

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    rows = [{"q": f"Capital number {i} of the list?", "c": ["Paris", "Rome and Milan"], "a": i % 2} for i in range(8)]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "toy_fewshot.yaml").write_text(LM_EVAL_YAML.format(data=tmp_path / "rows.jsonl"))
    records = load(f"lm_eval:toy_fewshot:include={tmp_path},num_fewshot=3").records
    assert records[0].prompt.startswith("The following are questions about capitals.")
    model, tok = tiny
    on = score_option_likelihood(model, tok, records, batch_size=3)
    off = score_option_likelihood(model, tok, records, batch_size=3, prefix_cache=False)
    assert on.info["prefix_cache"]["requests"] >= 6
    for a, b in zip(on.logits, off.logits, strict=True):
        assert torch.allclose(a, b, atol=1e-5, rtol=0)
