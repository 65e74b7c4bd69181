"""The evaluation pipeline: per-domain metrics, temperature carried across domains."""

from __future__ import annotations

import math
from types import SimpleNamespace

import _reference as ref
import numpy as np
import pytest
import torch
from _benchmarks import BENCHMARKS  # noqa: F401  (puts benchmarks/ on sys.path for harness)
from harness.evaluation import group_means, score_records, summarize_scored

from llm_calib.confidence.kinds import OpenConfidence
from llm_calib.data import builtin_multiple_choice
from llm_calib.data.records import OpenQA
from llm_calib.evaluation.evaluate import evaluate, evaluate_records
from llm_calib.prompts.templates import PromptFormat
from llm_calib.scoring import ScoredSet


@pytest.fixture(scope="module")
def builtin_small():
    return builtin_multiple_choice(6, seed=0, domains=["capitals", "arithmetic"])


def test_domains_metrics_and_temperature_transfer(tiny, builtin_small):
    model, tok = tiny
    fit_records = builtin_multiple_choice(8, seed=1, domains=["calendar"])
    res = evaluate_records(
        model,
        tok,
        [("builtin", builtin_small)],
        temperature_fit=("calendar", fit_records),
        n_resamples=50,
    )
    assert list(res.domains) == ["capitals", "arithmetic"]
    # independently: one forward pass per option, metrics by loops (tests/_reference.py)
    prompt = PromptFormat()
    assert res.temperature is not None
    T = res.temperature.temperature
    fit_scores = ref.option_log_likelihoods(model, tok, fit_records, prompt)
    ref.assert_minimises_nll(fit_scores, [r.gold for r in fit_records], T)
    assert res.temperature.nll_before == pytest.approx(ref.nll_at(fit_scores, [r.gold for r in fit_records], 1.0),
                                                       abs=ref.TOL)
    assert res.temperature.nll_after == pytest.approx(ref.nll_at(fit_scores, [r.gold for r in fit_records], T),
                                                      abs=ref.TOL)
    assert res.temperature.nll_after < res.temperature.nll_before
    assert res.temperature.domains == ["calendar"]
    for dom, r in res.domains.items():
        recs = [q for q in builtin_small if q.domain == dom]
        scores, labels = ref.option_log_likelihoods(model, tok, recs, prompt), [q.gold for q in recs]
        assert r.n == 6 and r.kind == "multiple_choice"
        expected = ref.summary(scores, labels)
        assert not math.isnan(expected["ece"])
        ref.assert_matches(r.uncalibrated, expected, ("n", "accuracy", "ece", "brier", "nll"), dom)
        assert r.uncalibrated["ece_ci_low"] <= r.uncalibrated["ece"] <= r.uncalibrated["ece_ci_high"]
        assert r.temperature_scaled is not None
        ref.assert_matches(r.temperature_scaled, ref.summary(scores, labels, T), ("accuracy", "ece", "brier", "nll"), dom)
        assert sum(r.reliability["counts"]) == 6
    d = res.to_dict()
    assert set(d) == {"config", "temperature", "timing", "domains", "macro_average"}
    mean_acc = np.mean([r.uncalibrated["accuracy"] for r in res.domains.values()])
    assert d["macro_average"]["uncalibrated"]["accuracy"] == pytest.approx(mean_acc)
    assert res.timing["questions_per_s"] > 0


def test_no_temperature_and_letter_scorer(tiny, builtin_small):
    model, tok = tiny
    res = evaluate_records(model, tok, [("b", builtin_small)], scorer="letter", ci=False)
    assert res.temperature is None
    r = res.domains["capitals"]
    assert r.temperature_scaled is None and r.reliability_scaled is None
    assert "ece_ci_low" not in r.uncalibrated
    assert res.config["scorer"] == "letter" and res.config["prompt"]["style"] == "listed"


def test_evaluate_by_spec_with_limit(tiny):
    model, tok = tiny
    res = evaluate(model, tok, ["builtin:capitals:n=12"], limit=5, ci=False)
    assert res.domains["capitals"].n == 5 and res.config["limit"] == 5
    with pytest.raises(ValueError):
        evaluate(model, tok, ["nosuchloader:x"])
    with pytest.raises(ValueError, match="scorer"):
        evaluate(model, tok, ["builtin:capitals:n=4"], scorer="bogus")


def test_same_domain_from_two_datasets_is_merged(tiny, builtin_small):
    model, tok = tiny
    res = evaluate_records(
        model, tok, [("a", builtin_small[:3]), ("b", builtin_small[3:6])], ci=False
    )
    assert res.domains["capitals"].n == 6


def test_open_questions_get_binary_calibration_metrics(tiny):
    model, tok = tiny
    recs = [OpenQA(f"What is {i} + 1?", (str(i + 1),), "sums", f"s{i}") for i in range(4)]
    res = evaluate_records(model, tok, [("open", recs)], n_resamples=20, max_new_tokens=3)
    r = res.domains["sums"]
    assert r.kind == "open" and r.n == 4
    for key in ("accuracy", "f1", "ece", "brier", "nll", "mean_confidence", "ece_product"):
        assert key in r.uncalibrated
    # open questions take a temperature too (token confidence: fitted on their greedy answers)...
    scaled = evaluate_records(model, tok, [("open", recs)], temperature_fit=("open", recs), ci=False, max_new_tokens=3)
    assert scaled.temperature.criterion == "correctness_nll" and scaled.domains["sums"].temperature_scaled is not None
    # ... but not a judged confidence, which no temperature of the answers sets
    with pytest.raises(ValueError, match="temperature_fit 'open': no temperature applies to p_true"):
        evaluate_records(model, tok, [("open", recs)], temperature_fit=("open", recs),
                         confidence=OpenConfidence("p_true"))


class _ScriptedLM(torch.nn.Module):
    """Answers every question with the same tokens, each with probability ``p``, then stops."""

    def __init__(self, script: list[int], vocab: int, eos: int, p: float):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.script, self.vocab, self.p = script, vocab, p
        self.config = SimpleNamespace(eos_token_id=eos)

    def forward(self, input_ids, attention_mask=None, position_ids=None, use_cache=True, cache=None):
        step = 0 if cache is None else cache
        probs = torch.full((input_ids.shape[0], self.vocab), (1 - self.p) / (self.vocab - 1), dtype=torch.float64)
        probs[:, self.script[min(step, len(self.script) - 1)]] = self.p
        logits = torch.log(probs)[:, None, :].expand(-1, input_ids.shape[1], -1)
        return SimpleNamespace(logits=logits, cache=step + 1)


def test_open_ended_metrics_by_hand(tiny_tokenizer):
    """Every answer is "Paris" at confidence 0.7: 3 of 4 right (one via an alias), one wrong."""
    tok = tiny_tokenizer
    paris = tok(" Paris", add_special_tokens=False)["input_ids"]
    lm = _ScriptedLM([*paris, tok.eos_token_id], len(tok), tok.eos_token_id, p=0.7)
    recs = [OpenQA("Capital of France?", ("Paris",), "geo", "a"),
            OpenQA("City of Light?", ("the City of Light", "Paris"), "geo", "b"),
            OpenQA("Where is the Louvre?", ("Paris.",), "geo", "c"),
            OpenQA("Capital of Italy?", ("Rome",), "geo", "d")]
    res = evaluate_records(lm, tok, [("open", recs)], ci=False, max_new_tokens=5)
    got = res.domains["geo"].uncalibrated
    c, k = 0.7, np.array([1.0, 1.0, 1.0, 0.0])
    expected = {
        "n": 4, "accuracy": 0.75, "f1": 0.75, "mean_confidence": c,
        "ece": abs(0.75 - c),  # one bin, [0.7, 0.8)
        "ece_product": abs(0.75 - c ** len(paris)),  # the product of the token probabilities
        "brier": float(np.mean((c - k) ** 2)),
        "nll": float(-np.mean(k * math.log(c) + (1 - k) * math.log(1 - c))),
        "auroc": 0.5,  # one confidence for all: ties
    }
    # the token probabilities come from a float32 softmax (a few 1e-8 off 0.7, CPU-dependent)
    for key, value in expected.items():
        assert got[key] == pytest.approx(value, abs=1e-6), key


def test_score_records_rejects_mixed_kinds(tiny, builtin_small):
    model, tok = tiny
    assert isinstance(score_records(model, tok, builtin_small[:2]), ScoredSet)
    with pytest.raises(TypeError, match="all MultipleChoice or all OpenQA"):
        score_records(model, tok, [builtin_small[0], OpenQA("q?", ("a",), "d", "0")])


def test_prompt_is_recorded(tiny, builtin_small):
    model, tok = tiny
    fmt = PromptFormat(chat_template=False, answer_prefix="Answer:")
    res = evaluate_records(model, tok, [("b", builtin_small[:2])], prompt=fmt, ci=False)
    assert res.config["prompt"]["answer_prefix"] == "Answer:"
    assert res.config["prompt"]["chat_template"] is False
    assert math.isfinite(res.domains["capitals"].uncalibrated["nll"])


def test_summarize_scored_and_group_means() -> None:
    from llm_calib.confidence.token import OpenEndedSet, open_ended_summary
    from llm_calib.metrics.calibration import summarize

    rng = np.random.default_rng(0)
    logits = [torch.tensor(rng.normal(size=3)) for _ in range(30)]
    s = ScoredSet(logits, [int(x) for x in rng.integers(0, 3, 30)], ["a"] * 10 + ["b"] * 12 + ["c"] * 8,
                  [str(i) for i in range(30)])
    got = summarize_scored(s, n_bins=5, ci=False)
    assert got == summarize(s.probs_numpy, s.labels_numpy, n_bins=5, ci=False)
    o = OpenEndedSet(["x", "y"], [("x",), ("z",)], ["d", "d"], ["0", "1"], [(0.9,), (0.4, 0.2)])
    assert summarize_scored(o, ci=False) == open_ended_summary(o, ci=False)
    with pytest.raises(TypeError, match="ScoredSet or an OpenEndedSet, got list"):
        summarize_scored([])
    per = {d: summarize_scored(x, ci=False) for d, x in s.by_domain().items()}
    means = group_means(s, {"in": ["a", "b"], "out": ["c", "missing"], "none": ["zz"]})
    assert means["ece_in"] == pytest.approx((per["a"]["ece"] + per["b"]["ece"]) / 2, rel=1e-12)
    assert means["accuracy_out"] == per["c"]["accuracy"] and math.isnan(means["ece_none"])
    assert means["ece_in"] != pytest.approx(summarize_scored(s, ci=False)["ece"])  # a macro, not a pooled mean
