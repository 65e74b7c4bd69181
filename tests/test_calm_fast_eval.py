"""Fast evaluation of top-layer LoRA models from the base model's cached trunk
(llm_calib.calm.fast_eval) gives the plain scorers' numbers on the merged model; resampled ECE."""

from __future__ import annotations

import copy
import math

import numpy as np
import torch

from llm_calib.calm.config import CalibrationConfig, LoraSettings
from llm_calib.calm.encoding import encode_records
from llm_calib.calm.fast_eval import TrunkGenerator, base_scores, trunk_scores
from llm_calib.calm.lora import FunctionalLM, attach_lora
from llm_calib.data import MultipleChoice, OpenQA, builtin_multiple_choice
from llm_calib.metrics import ece, ece_resamples
from llm_calib.models import tiny_random_model
from llm_calib.scoring.open_ended import encode_open_prompts, score_open_ended
from llm_calib.scoring.option_likelihood import score_option_likelihood

GRID = np.exp(np.linspace(np.log(0.25), np.log(64.0), 41))  # T = 1 included


def _adapted(model, layers=(2,)):
    """A copy of ``model`` with LoRA on ``layers`` whose adapters are far from zero."""
    peft_model = attach_lora(copy.deepcopy(model), LoraSettings(rank=2, alpha=4.0, layers=layers))
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    peft_model.eval()
    return peft_model


def _merged(peft_model):
    return copy.deepcopy(peft_model).merge_and_unload().eval()


def _probs(scores):
    return [torch.softmax(s.double(), 0) for s in scores]


def test_trunk_cached_scores_equal_the_plain_scorer_on_the_merged_model() -> None:
    model, tok = tiny_random_model(seed=0, num_layers=3)
    records = builtin_multiple_choice(n_per_domain=6, seed=0, domains=["capitals", "arithmetic", "calendar"])
    records += [  # ragged option counts and lengths
        MultipleChoice("Which is a colour?", ("red", "the quick brown fox"), 0, "x", "x0"),
        MultipleChoice("Pick the city.", ("Paris", "Lyon", "dog", "2 + 3", "Rome"), 4, "x", "x1"),
    ]
    cfg = CalibrationConfig(lora=LoraSettings(rank=2, layers=(2,)))
    enc = encode_records(tok, records, cfg)
    pad = tok.pad_token_id
    base = base_scores(model, enc, 2, 4, pad, "sum")
    assert len(enc.trunk_cache) == len(records)
    plain = score_option_likelihood(model, tok, records, batch_size=3)
    for a, b in zip(_probs(base), plain.probs, strict=True):
        assert torch.allclose(a, b.double(), atol=1e-5), (a, b)

    adapted = _adapted(model)
    lm = FunctionalLM(adapted)
    assert lm.trunk_layers == 2
    cached = trunk_scores(lm, enc, 5, pad, "sum")
    merged = score_option_likelihood(_merged(adapted), tok, records, batch_size=3)
    diffs = []
    for a, b, c in zip(_probs(cached), merged.probs, _probs(base), strict=True):
        assert torch.allclose(a, b.double(), atol=1e-5), (a, b)
        diffs.append(float((a - c).abs().max()))
    assert max(diffs) > 1e-2  # the adapters change the predictions: the check is not vacuous


def test_trunk_started_generation_equals_score_open_ended() -> None:
    model, tok = tiny_random_model(seed=0, num_layers=3)
    records = [OpenQA(f"What is {a} plus {b}?", (str(a + b),), "sums", f"s{a}{b}") for a in range(3) for b in range(4)]
    records.append(OpenQA("Name the capital of France, please.", ("Paris",), "geo", "g0"))
    prompts = encode_open_prompts(tok, records)
    gen = TrunkGenerator(tok, prompts, batch_size=5, max_new_tokens=6, trunk_layers=2, temperatures=GRID)
    base = gen.base(model, keep_trunk=True, temperatures=True)
    plain = score_open_ended(model, tok, records, max_new_tokens=6, batch_size=5)
    g1 = int(np.argmin(np.abs(GRID - 1.0)))
    assert math.isclose(GRID[g1], 1.0, rel_tol=1e-9)
    for out, text, probs in zip(base, plain.answers, plain.token_probs, strict=True):
        assert out.text == text
        np.testing.assert_allclose(out.token_probs, probs, atol=1e-5)
        np.testing.assert_allclose(out.temp_probs[:, g1], probs, atol=1e-5)  # T = 1 column of the grid

    adapted = _adapted(model)
    trained = gen.trained(adapted)
    reference = score_open_ended(_merged(adapted), tok, records, max_new_tokens=6, batch_size=5)
    assert [o.text for o in trained] == reference.answers
    for out, probs in zip(trained, reference.token_probs, strict=True):
        np.testing.assert_allclose(out.token_probs, probs, atol=1e-5)
    assert [o.text for o in trained] != plain.answers or any(
        abs(a.token_probs[0] - b.token_probs[0]) > 1e-3 for a, b in zip(trained, base, strict=True))


def test_resampled_ece_equals_ece_on_each_resample() -> None:
    rng = np.random.default_rng(0)
    conf = np.concatenate([rng.uniform(0, 1, 200), [0.0, 0.1, 0.5, 1.0]])
    correct = (rng.uniform(0, 1, conf.size) < conf).astype(float)
    idx = np.concatenate([np.arange(conf.size)[None], rng.integers(0, conf.size, size=(20, conf.size))])
    got = ece_resamples(conf, correct, idx)
    for row, value in zip(idx, got, strict=True):  # each resample's ECE by the one-set function
        assert math.isclose(value, ece(conf[row], correct[row], 10), abs_tol=1e-12)
    assert len(set(np.round(got, 12))) > 10  # the resamples differ: the check is not vacuous
