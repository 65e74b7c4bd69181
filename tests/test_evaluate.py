"""The evaluation pipeline: per-domain metrics, temperature carried across domains."""

from __future__ import annotations

import math

import numpy as np
import pytest

from llm_calib import metrics
from llm_calib.data import builtin_multiple_choice
from llm_calib.data.records import OpenQA
from llm_calib.evaluate import evaluate, evaluate_records, score_records
from llm_calib.prompts import PromptFormat
from llm_calib.scoring import ScoredSet, score_option_likelihood
from llm_calib.temperature import fit_temperature


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
    fit_scores = score_option_likelihood(model, tok, fit_records)
    T = fit_temperature(fit_scores.logits, fit_scores.labels)
    assert res.temperature is not None
    assert res.temperature.temperature == pytest.approx(T, rel=1e-6)
    assert res.temperature.nll_after <= res.temperature.nll_before + 1e-9
    assert res.temperature.domains == ["calendar"]
    direct = score_option_likelihood(model, tok, builtin_small).by_domain()
    for dom, r in res.domains.items():
        s = direct[dom]
        assert r.n == 6 and r.kind == "multiple_choice"
        ref = metrics.summarize(s.probs_numpy, s.labels, n_resamples=50)
        for key in ("accuracy", "ece", "brier", "nll", "auroc", "ece_ci_low"):
            np.testing.assert_allclose(r.uncalibrated[key], ref[key], atol=1e-9, equal_nan=True)
        scaled = metrics.summarize(s.scaled(T).probs_numpy, s.labels, n_resamples=50)
        assert r.temperature_scaled is not None
        np.testing.assert_allclose(r.temperature_scaled["ece"], scaled["ece"], atol=1e-6)
        assert r.temperature_scaled["accuracy"] == r.uncalibrated["accuracy"]
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
    assert 0.0 <= r.uncalibrated["mean_confidence"] <= 1.0
    with pytest.raises(ValueError, match="temperature_fit"):
        evaluate_records(model, tok, [("open", recs)], temperature_fit=("open", recs))


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
