"""The packed layouts built from Python lists equal the token-by-token construction they replaced.

The packing runs in every training step (both batches of a CALM step), so it builds its rows as lists
and makes each tensor at once; the references below are the earlier per-question, per-option tensor
writes, kept here as the specification.
"""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from llm_calib.engine.packing import pack_continuations, pack_letters, pack_prompts, pack_questions

TOKENS = st.integers(min_value=1, max_value=50)
PROMPTS = st.lists(TOKENS, min_size=1, max_size=6)
OPTIONS = st.lists(st.lists(TOKENS, min_size=1, max_size=4), min_size=1, max_size=4)


def reference_pack_questions(items, pad_id):
    """The construction before the list-built one: one tensor write per prompt and per option."""
    B = len(items)
    L = max(len(p) + sum(len(o) for o in opts) for p, opts in items)
    ids = torch.full((B, L), pad_id, dtype=torch.long)
    pos = torch.zeros((B, L), dtype=torch.long)
    seg = torch.full((B, L), -1, dtype=torch.long)
    rows, target_rows, target_ids, target_option, option_question, option_lengths, n_options = [], [], [], [], [], [], []
    for b, (prompt, options) in enumerate(items):
        p = len(prompt)
        ids[b, :p] = torch.tensor(list(prompt))
        pos[b, :p] = torch.arange(p)
        seg[b, :p] = 0
        first_row = len(rows)
        rows.append(b * L + p - 1)
        offset = p
        for k, opt in enumerate(options):
            n = len(opt)
            ids[b, offset : offset + n] = torch.tensor(list(opt))
            pos[b, offset : offset + n] = torch.arange(p, p + n)
            seg[b, offset : offset + n] = k + 1
            option_index = len(option_lengths)
            for j in range(n):
                if j == 0:
                    target_rows.append(first_row)
                else:
                    target_rows.append(len(rows))
                    rows.append(b * L + offset + j - 1)
                target_ids.append(int(opt[j]))
                target_option.append(option_index)
            option_question.append(b)
            option_lengths.append(n)
            offset += n
        n_options.append(len(options))
    causal = torch.ones(L, L, dtype=torch.bool).tril()
    q_seg, k_seg = seg[:, :, None], seg[:, None, :]
    allowed = causal & (k_seg >= 0) & ((k_seg == 0) | (k_seg == q_seg))
    allowed |= torch.eye(L, dtype=torch.bool)[None] & (seg < 0)[:, :, None]
    return (ids, allowed[:, None], pos, torch.tensor(rows), torch.tensor(target_rows), torch.tensor(target_ids),
            torch.tensor(target_option), torch.tensor(option_question), torch.tensor(option_lengths), n_options)


def reference_right_pad(seqs, pad_id):
    B, L = len(seqs), max(len(s) for s in seqs)
    ids = torch.full((B, L), pad_id, dtype=torch.long)
    mask = torch.zeros((B, L), dtype=torch.long)
    for b, seq in enumerate(seqs):
        ids[b, : len(seq)] = torch.tensor(list(seq))
        mask[b, : len(seq)] = 1
    return ids, mask, (mask.cumsum(-1) - 1).clamp(min=0)


def fields(packed):
    return (packed.input_ids, packed.attention_mask, packed.position_ids, packed.rows, packed.target_rows,
            packed.target_ids, packed.target_option, packed.option_question, packed.option_lengths, packed.n_options)


def same(got, want) -> None:
    for g, w in zip(got, want, strict=True):
        if isinstance(w, torch.Tensor):
            assert g.dtype == w.dtype and g.shape == w.shape and torch.equal(g, w)
        else:
            assert g == w


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(PROMPTS, OPTIONS), min_size=1, max_size=5), st.integers(0, 3))
def test_pack_questions_equals_the_per_token_construction(items, pad_id) -> None:
    same(fields(pack_questions(items, pad_id)), reference_pack_questions(items, pad_id))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(PROMPTS, st.lists(TOKENS, min_size=1, max_size=4)), min_size=1, max_size=5), st.integers(0, 3))
def test_right_padded_layouts_equal_the_per_sequence_construction(items, pad_id) -> None:
    prompts = [p for p, _ in items]
    ids, mask, pos = reference_right_pad([p + a for p, a in items], pad_id)
    got = pack_continuations(items, pad_id)
    same((got.input_ids, got.attention_mask, got.position_ids), (ids, mask, pos))
    ids, mask, pos = reference_right_pad(prompts, pad_id)
    for got in (pack_prompts(prompts, pad_id), pack_letters(prompts, [(7, 8)] * len(prompts), pad_id)):
        same((got.input_ids, got.attention_mask, got.position_ids), (ids, mask, pos))
