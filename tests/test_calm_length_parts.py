"""Training batches in parts of similar length: the split is optimal, and the losses and gradients equal the whole batch's."""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import hypergrad as hg
from llm_calib.adjustment import LogitAdjustment
from llm_calib.calm.encoding import encode_records
from llm_calib.calm.lora import FunctionalLM, attach_lora
from llm_calib.calm.losses import CalmLosses
from llm_calib.calm.run import task_format
from llm_calib.config.calibration import CalibrationConfig, LoraSettings
from llm_calib.data import builtin_multiple_choice
from llm_calib.engine.packing import length_parts
from llm_calib.models import tiny_random_model
from llm_calib.prompts.resolution import resolve_prompt_settings
from llm_calib.training_interface import Batch


def _cost(lengths: list[int], parts: list[list[int]], overhead: int) -> int:
    return sum(len(p) * max(lengths[i] for i in p) + overhead for p in parts)


def _brute_force(lengths: list[int], overhead: int, n_parts: int | None = None) -> int:
    """Cheapest split of the length-sorted questions into contiguous parts (``n_parts`` of them; None: any
    number), by trying every set of cuts."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    best = None
    for k in range(len(order)) if n_parts is None else [n_parts - 1]:
        for cuts in itertools.combinations(range(1, len(order)), k):
            bounds = (0, *cuts, len(order))
            cost = _cost(lengths, [order[a:b] for a, b in itertools.pairwise(bounds)], overhead)
            best = cost if best is None else min(best, cost)
    return best


def test_length_parts_is_the_cheapest_split_and_covers_every_question():
    rng = random.Random(0)
    for _ in range(60):
        lengths = [rng.randint(1, 120) for _ in range(rng.randint(1, 7))]
        overhead = rng.choice([0, 5, 64, 500])
        parts = length_parts(lengths, overhead)
        assert sorted(p for part in parts for p in part) == list(range(len(lengths)))
        assert _cost(lengths, parts, overhead) == _brute_force(lengths, overhead)
        assert [lengths[part[-1]] for part in parts] == sorted(lengths[part[-1]] for part in parts)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 120), min_size=1, max_size=7), st.data())
def test_length_parts_of_a_given_count_is_the_cheapest_split_into_that_many(lengths, data):
    n_parts = data.draw(st.integers(1, len(lengths)))
    parts = length_parts(lengths, overhead=data.draw(st.sampled_from([0, 64])), n_parts=n_parts)
    assert len(parts) == n_parts and all(parts)
    assert sorted(p for part in parts for p in part) == list(range(len(lengths)))
    assert [lengths[p] for part in parts for p in part] == sorted(lengths)  # contiguous in length order
    assert _cost(lengths, parts, 0) == _brute_force(lengths, 0, n_parts)


def test_length_parts_rejects_bad_input():
    with pytest.raises(ValueError, match="at least one length"):
        length_parts([])
    with pytest.raises(ValueError, match="overhead must be >= 0"):
        length_parts([3, 4], overhead=-1)
    for n_parts in (0, 3):
        with pytest.raises(ValueError, match="n_parts must be between 1 and the 2 lengths"):
            length_parts([3, 4], n_parts=n_parts)


@pytest.fixture(scope="module")
def run():
    torch.manual_seed(0)
    model, tok = tiny_random_model(num_layers=3)
    lm = FunctionalLM(attach_lora(model.double(), LoraSettings(rank=2, layers=(1, 2))))
    theta = {k: 0.05 * torch.randn_like(v) for k, v in lm.theta().items()}
    qs = builtin_multiple_choice(n_per_domain=3)
    enc = encode_records(tok, qs, task_format(qs, resolve_prompt_settings(CalibrationConfig().prompt)))
    # the longest and shortest questions side by side: the whole batch is mostly padding for the short ones
    by_length = sorted(range(len(qs)), key=enc.length)
    idx = [by_length[-1], by_length[0], by_length[1], by_length[-2], by_length[len(qs) // 2]]
    return lm, theta, enc, idx, tok.pad_token_id


@pytest.mark.parametrize("kind", ["option_temperature", "vector"])
def test_losses_and_gradients_in_parts_equal_the_whole_batch(run, kind):
    lm, theta, enc, idx, pad_id = run
    split, whole = enc.batch(idx, pad_id, lm), enc.batch(idx, pad_id, lm, split=False)
    assert len(split.parts) >= 2 and not whole.parts
    assert sum(p.packed.input_ids.numel() for p in split.parts) < whole.packed.input_ids.numel()
    adjustment = LogitAdjustment(kind, lm.head.out_features)
    losses = CalmLosses(lm, adjustment)
    lam = {k: v + 0.1 * torch.randn(v.shape, dtype=v.dtype) for k, v in adjustment.init().items()}
    lam = {k: v.double() for k, v in lam.items()}
    torch.testing.assert_close(losses.scores(theta, lam, split), losses.scores(theta, lam, whole), atol=1e-10, rtol=0)
    for loss in (losses.inner, losses.outer):
        value_s, gw_s, gl_s = hg.autodiff.loss_and_grads(lambda w, l_, loss=loss: loss(w, l_, split), theta, lam)
        value_w, gw_w, gl_w = hg.autodiff.loss_and_grads(lambda w, l_, loss=loss: loss(w, l_, whole), theta, lam)
        torch.testing.assert_close(value_s, value_w, atol=1e-10, rtol=0)
        for k in gw_w:
            torch.testing.assert_close(gw_s[k], gw_w[k], atol=1e-10, rtol=1e-8)
        for k in gl_w:
            torch.testing.assert_close(gl_s[k], gl_w[k], atol=1e-10, rtol=1e-8)


def test_a_batch_in_parts_needs_one_position_per_question(run):
    lm, _, enc, idx, pad_id = run
    whole = enc.batch(idx, pad_id, lm, split=False)
    with pytest.raises(ValueError, match="part_order with one position per question"):
        Batch(whole.packed, whole.labels, whole.ids, whole.format, parts=(whole,), part_order=torch.arange(2))
