"""The scoring engine (llm_calib.engine): its one forward pass and its one greedy decoder agree
with themselves across layouts and model runners, and the scorers are built on them."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from llm_calib.confidence.token import encode_open_prompts
from llm_calib.data import MultipleChoice, OpenQA
from llm_calib.engine.decode import TrunkGenerator, generate_greedy, greedy_loop
from llm_calib.engine.options import forward_rows, target_logprobs
from llm_calib.engine.packing import pack_letters, pack_questions, reduce_per_option
from llm_calib.models import tiny_random_model
from llm_calib.prompts.templates import PromptFormat
from llm_calib.scoring import score_letter, score_option_likelihood
from llm_calib.scoring.option_likelihood import encode_questions


@pytest.fixture(scope="module")
def tiny():
    return tiny_random_model(seed=0, num_layers=3)


def test_packed_and_per_option_layouts_give_the_same_rows_and_trunk(tiny) -> None:
    model, _ = tiny
    packed = pack_questions([((5, 6, 7), ((8,), (9, 10, 11))), ((12,), ((13, 14), (15,), (16,)))], pad_id=0)
    with torch.inference_mode():
        h4, t4 = forward_rows(model, packed, trunk_layer=2)
        h2, t2 = forward_rows(model, packed, trunk_layer=2, packed_masks=False)
    assert torch.allclose(h4, h2, atol=1e-5)
    real = packed.input_ids != 0  # no token above is the padding id
    assert torch.allclose(t4[real], t2[real], atol=1e-5)


def test_option_likelihood_is_the_engine_forward_reduced_per_option(tiny) -> None:
    model, tok = tiny
    recs = [MultipleChoice("Capital of France?", ("Paris", "Rome", "Oslo"), 0, "geo", "q0"),
            MultipleChoice("2 + 3 = ?", ("5", "four"), 0, "math", "q1")]
    items = encode_questions(tok, recs, PromptFormat())
    packed = pack_questions([(it.prompt, it.options) for it in items], tok.pad_token_id)
    with torch.inference_mode():
        sums = reduce_per_option(target_logprobs(model, packed).double(), packed)
    scored = score_option_likelihood(model, tok, recs, batch_size=2)
    assert torch.allclose(torch.cat(scored.logits), sums, atol=1e-9)


def test_letter_scores_are_the_engine_forward_over_pack_letters(tiny) -> None:
    model, tok = tiny
    recs = [MultipleChoice("Capital of France?", ("Paris", "Rome", "Oslo"), 0, "geo", "q0")]
    scored = score_letter(model, tok, recs)
    d = scored.details[0]
    prompt = tok(d["prompt"], add_special_tokens=False)["input_ids"]
    with torch.inference_mode():
        lp = target_logprobs(model, pack_letters([prompt], [[t[0] for t in d["token_ids"]]], tok.pad_token_id))
    assert torch.allclose(scored.logits[0], lp.double(), atol=1e-5)


def test_one_decoder_full_model_and_trunk_generator_agree(tiny) -> None:
    model, tok = tiny
    recs = [OpenQA(f"What is {i} plus {i}?", (str(2 * i),), "math", f"o{i}") for i in range(5)]
    prompts = encode_open_prompts(tok, recs)
    full = generate_greedy(model, tok, prompts, max_new_tokens=6)
    gen = TrunkGenerator(tok, prompts, batch_size=5, max_new_tokens=6, trunk_layers=0)
    trunked = gen.base(model, keep_trunk=False, temperatures=False)
    assert [a.text for a in full] == [o.text for o in trunked]
    for a, o in zip(full, trunked, strict=True):
        assert a.token_ids == o.token_ids
        assert max(abs(x - y) for x, y in zip(a.token_probs, o.token_probs, strict=True)) < 1e-5


def test_greedy_loop_feeds_or_drops_stopped_rows_with_the_same_answers(tiny) -> None:
    _, tok = tiny
    eos = tok.eos_token_id
    table = torch.zeros(3, tok.vocab_size)
    table[0, eos], table[1, 40], table[2, 41] = 5.0, 5.0, 5.0
    seen: list[int] = []

    def step(tokens: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
        seen.append(len(tokens))
        rows = torch.arange(3) if keep is None and len(tokens) == 3 else torch.tensor([1, 2])
        return table[rows]

    kept = greedy_loop(step, table.clone(), tok, {eos}, max_new_tokens=3)
    assert seen == [3, 3]
    seen.clear()
    dropped = greedy_loop(step, table.clone(), tok, {eos}, max_new_tokens=3, drop_finished=True)
    assert seen == [2, 2]
    assert [a for a, _ in kept] == [a for a, _ in dropped]
    assert kept[0][0].stop == "eos" and kept[1][0].token_ids == (40, 40, 40)


def test_generate_greedy_records_each_answer_token_at_every_grid_temperature():
    """``temperatures``: the answers are those without a grid; the T = 1 column is the token probabilities;
    the greedy token's probability falls as T rises; a temperature <= 0 is refused."""
    model, tok = tiny_random_model(seed=3)
    prompts = [tok("What is 2 + 3?")["input_ids"], tok("Capital of France")["input_ids"]]
    plain = generate_greedy(model, tok, prompts, max_new_tokens=5)
    gridded = generate_greedy(model, tok, prompts, max_new_tokens=5, temperatures=[0.5, 1.0, 4.0])
    for a, b in zip(plain, gridded, strict=True):
        assert (a.text, a.token_ids, a.stop) == (b.text, b.token_ids, b.stop) and a.temp_probs is None
        assert b.temp_probs.shape == (len(b.token_probs), 3)
        np.testing.assert_allclose(b.temp_probs[:, 1], b.token_probs, rtol=1e-5, atol=1e-7)
        assert (b.temp_probs[:, 0] >= b.temp_probs[:, 1] - 1e-7).all()
        assert (b.temp_probs[:, 1] >= b.temp_probs[:, 2] - 1e-7).all()
    with pytest.raises(ValueError, match="temperatures"):
        generate_greedy(model, tok, prompts, temperatures=[1.0, 0.0])
