"""Fast evaluation of top-layer LoRA models from the base model's cached trunk
(llm_calib.calm.fast_eval) gives the plain scorers' numbers on the merged model; resampled ECE."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
from _benchmarks import BENCHMARKS, load_benchmark  # noqa: F401  (puts benchmarks/ on sys.path for harness)
from harness.sweep import ece_resamples

from llm_calib.calm.encoding import encode_records
from llm_calib.calm.fast_eval import (
    SharedTrunkEval,
    base_scores,
    fill_trunk_caches,
    open_ended_set,
    trunk_scores,
)
from llm_calib.calm.lora import FunctionalLM, attach_lora
from llm_calib.calm.run import task_format
from llm_calib.confidence.token import encode_open_prompts, score_open_ended
from llm_calib.config.calibration import CalibrationConfig, LoraSettings, PromptSettings
from llm_calib.data import MultipleChoice, OpenQA, builtin_multiple_choice
from llm_calib.engine.decode import GenOut, TrunkGenerator
from llm_calib.metrics.calibration import ece
from llm_calib.models import tiny_random_model
from llm_calib.prompts.resolution import resolve_prompt_settings
from llm_calib.prompts.templates import short_answer_format
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
    enc = encode_records(tok, records, task_format(records, resolve_prompt_settings(cfg.prompt)))
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


def test_shared_trunk_eval_scores_each_set_as_the_plain_scorers() -> None:
    """Multiple choice: base = the plain scorer on the base model, adapted = on the merged model,
    set by set; open: the same for greedy answers, with one generator over the sets in order."""
    model, tok = tiny_random_model(seed=0, num_layers=3)
    sets = {d: builtin_multiple_choice(n_per_domain=4, seed=0, domains=[d]) for d in ("capitals", "arithmetic")}
    ev = SharedTrunkEval(model, tok, sets, 2, batch_size=3)
    base, adapted_model = ev.base(), _adapted(model)
    adapted = ev.adapted(adapted_model)
    assert list(base) == list(adapted) == ["capitals", "arithmetic"] and len(ev) == 8
    for name, recs in sets.items():
        for got, ref in ((base[name], score_option_likelihood(model, tok, recs)),
                         (adapted[name], score_option_likelihood(_merged(adapted_model), tok, recs))):
            assert got.ids == [r.id for r in recs] and got.labels == [r.gold for r in recs]
            for a, b in zip(got.probs_numpy, ref.probs_numpy, strict=True):
                np.testing.assert_allclose(a, b, atol=1e-5)
    assert max(float(np.abs(a - b).max()) for a, b in zip(base["capitals"].probs_numpy, adapted["capitals"].probs_numpy,
                                                          strict=True)) > 1e-3
    with pytest.raises(ValueError, match="adapted layers start at 1, expected 2"):
        ev.adapted(_adapted(model, layers=(1, 2)))

    open_sets = {"sums": [OpenQA(f"What is {a} plus {b}?", (str(a + b),), "sums", f"s{a}{b}") for a in range(3) for b in range(2)],
                 "geo": [OpenQA("Name the capital of France, please.", ("Paris",), "geo", "g0")]}
    oev = SharedTrunkEval(model, tok, open_sets, 2, batch_size=4, max_new_tokens=5, temperatures=GRID)
    obase, oadapted = oev.base(), oev.adapted(adapted_model)
    g1 = int(np.argmin(np.abs(GRID - 1.0)))
    for name, recs in open_sets.items():
        for got, ref in ((obase[name], score_open_ended(model, tok, recs, max_new_tokens=5)),
                         (oadapted[name], score_open_ended(_merged(adapted_model), tok, recs, max_new_tokens=5))):
            assert got.answers == ref.answers and got.ids == [r.id for r in recs]
            for a, b in zip(got.token_probs, ref.token_probs, strict=True):
                np.testing.assert_allclose(a, b, atol=1e-5)
        for a, b in zip(oev.scaled(g1)[name].token_probs, obase[name].token_probs, strict=True):  # T = 1 column
            np.testing.assert_allclose(a, b, atol=1e-5)


def test_shared_trunk_eval_answers_open_questions_with_the_configs_short_answer_prompt() -> None:
    """With ``open_examples`` the trunk-cached answers are those of ``score_open_ended`` under
    ``short_answer_format`` (base and adapted model), and not those of the chat prompt."""
    model, tok = tiny_random_model(seed=0, num_layers=3)
    examples = (("What is 1 plus 1?", "2"), ("Name the capital of Italy.", "Rome"))
    recs = [OpenQA(f"What is {a} plus {b}?", (str(a + b),), "sums", f"s{a}{b}") for a in range(3) for b in range(3)]
    ev = SharedTrunkEval(model, tok, {"sums": recs}, 2, settings=resolve_prompt_settings(PromptSettings(open_examples=examples)),
                         batch_size=4, max_new_tokens=5)
    fmt = short_answer_format(examples)
    adapted_model = _adapted(model)
    base, adapted = ev.base()["sums"], ev.adapted(adapted_model)["sums"]
    for got, ref in ((base, score_open_ended(model, tok, recs, prompt=fmt, max_new_tokens=5)),
                     (adapted, score_open_ended(_merged(adapted_model), tok, recs, prompt=fmt, max_new_tokens=5))):
        assert got.answers == ref.answers
        for a, b in zip(got.token_probs, ref.token_probs, strict=True):
            np.testing.assert_allclose(a, b, atol=1e-5)
    chat = score_open_ended(model, tok, recs, max_new_tokens=5)
    assert chat.token_probs != base.token_probs


def test_shared_trunk_eval_rejects_bad_sets() -> None:
    model, tok = tiny_random_model(seed=0, num_layers=3)
    mc = builtin_multiple_choice(n_per_domain=2, domains=["capitals"])
    with pytest.raises(ValueError, match="trunk_layers must be in \\[1, 2\\], got 3"):
        SharedTrunkEval(model, tok, {"a": mc}, 3)
    with pytest.raises(ValueError, match="non-empty"):
        SharedTrunkEval(model, tok, {"a": []}, 1)
    with pytest.raises(ValueError, match="all multiple choice or all open"):
        SharedTrunkEval(model, tok, {"a": mc, "b": [OpenQA("q?", ("a",), "d", "0")]}, 1)
    with pytest.raises(RuntimeError, match="base\\(\\) on open questions"):
        SharedTrunkEval(model, tok, {"a": mc}, 1).scaled(0)


def test_fit_open_temperature_minimises_the_log_loss_on_the_grid() -> None:
    fit_open_temperature = load_benchmark("calibration_bench").fit_open_temperature
    rng = np.random.default_rng(0)
    recs = [OpenQA(f"q{i}?", ("yes",), "d", str(i)) for i in range(40)]
    grid = np.array([0.5, 1.0, 2.0, 4.0])
    outs = []
    for i in range(40):
        p = np.clip(rng.uniform(0.2, 0.99, size=(2, 1)) ** (1 / grid), 1e-6, 1 - 1e-6)  # confidences drop with T
        outs.append(GenOut("yes" if i % 2 else "no", (1, 2), tuple(p[:, 1]), p))
    t, g = fit_open_temperature(recs, outs, grid)
    correct = np.array([i % 2 for i in range(40)], dtype=float)
    losses = []
    for j in range(len(grid)):  # by hand: log-loss of correctness of the mean token probability
        c = np.array([o.temp_probs[:, j].mean() for o in outs])
        losses.append(-np.mean(correct * np.log(c) + (1 - correct) * np.log(1 - c)))
    assert g == int(np.argmin(losses)) and t == grid[g]
    assert len(set(np.round(losses, 6))) == len(grid)  # the grid points differ: the check is not vacuous
    s = open_ended_set(recs, outs, temperature_index=2)
    assert s.token_probs[3] == tuple(outs[3].temp_probs[:, 2]) and s.correct.tolist() == [bool(k) for k in correct]
    with pytest.raises(ValueError, match="same length"):
        open_ended_set(recs[:3], outs)
    with pytest.raises(ValueError, match="for the 3 grid temperatures"):
        fit_open_temperature(recs, outs, grid[:3])


def test_fill_trunk_caches_computes_each_missing_trunk_once() -> None:
    model, tok = tiny_random_model(seed=0, num_layers=3)
    cfg = CalibrationConfig(lora=LoraSettings(rank=2, layers=(2,)))
    a = encode_records(tok, builtin_multiple_choice(n_per_domain=20, domains=["capitals"]), task_format(builtin_multiple_choice(n_per_domain=20, domains=['capitals']), resolve_prompt_settings(cfg.prompt)))
    b = encode_records(tok, builtin_multiple_choice(n_per_domain=3, domains=["arithmetic"]), task_format(builtin_multiple_choice(n_per_domain=3, domains=['arithmetic']), resolve_prompt_settings(cfg.prompt)))
    b.trunk_cache[0] = torch.zeros(1)  # already cached: not counted (its chunk is computed whole)
    updates: list[int] = []

    class Bar:
        def update(self, n: int) -> None:
            updates.append(n)

    assert fill_trunk_caches(model, [a, b], cfg.lora, tok.pad_token_id, Bar()) == 22
    assert updates == [16, 4, 2] and len(a.trunk_cache) == 20 and len(b.trunk_cache) == 3
    lm = FunctionalLM(attach_lora(copy.deepcopy(model), cfg.lora))
    ref = lm.trunk_hidden(a.pack([5], tok.pad_token_id))[0, : a.length(5)]
    torch.testing.assert_close(a.trunk_cache[5], ref, rtol=1e-5, atol=1e-6)
    assert fill_trunk_caches(model, [a, b], cfg.lora, tok.pad_token_id) == 0  # all cached now
    assert fill_trunk_caches(model, [a], LoraSettings(rank=2), tok.pad_token_id) == 0  # LoRA everywhere: no trunk


def test_fit_open_temperature_is_not_fooled_by_float32_probabilities_of_one() -> None:
    """A right answer whose float32 grid probability is 1.0 at the sharpest temperature: its loss term
    there is 0, not 0 * log(0) = NaN, so the fit does not pick the grid's edge (it did before the float64 cast)."""
    fit_open_temperature = load_benchmark("calibration_bench").fit_open_temperature
    recs = [OpenQA(f"q{i}?", ("yes",), "d", str(i)) for i in range(4)]
    grid = np.array([0.25, 1.0, 4.0])
    sure_right = np.array([[1.0, 0.95, 0.8]], dtype=np.float32)  # rounded to 1 at T = 0.25
    wrong = np.array([[0.9, 0.6, 0.4]], dtype=np.float32)
    outs = [GenOut("yes", (1,), (0.95,), sure_right), *(GenOut("no", (1,), (0.6,), wrong) for _ in range(3))]
    t, g = fit_open_temperature(recs, outs, grid)
    assert (t, g) == (4.0, 2)
