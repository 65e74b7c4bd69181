"""Open questions scored by sampling: modal answers, correctness, Sem-ECE and the summary by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest

from llm_calib.confidence.sampled import SampledSet, score_sampled
from llm_calib.confidence.semantic import answer_equivalence
from llm_calib.confidence.token import encode_open_prompts
from llm_calib.data.records import OpenQA
from llm_calib.engine.sampling import SamplingSettings, sample_answers
from llm_calib.metrics import calibration as metrics
from llm_calib.models import tiny_random_model


def _toy() -> SampledSet:
    return SampledSet(
        samples=[("Paris", "paris", "Lyon", "Paris."), ("4", "5", "5", "four"), ("Oslo", "Bergen", "Oslo", "Oslo")],
        references=[("Paris",), ("4", "four"), ("Stockholm",)], domains=["geo", "math", "geo"],
        ids=["q0", "q1", "q2"], info={"estimator": "plug_in"},
    )


def test_modal_answers_correctness_and_plug_in_by_hand():
    s = _toy()
    assert s.answers == ["Paris", "5", "Oslo"]
    assert s.correct.tolist() == [True, False, False]  # "5" is not an alias; "four" was a minority
    assert s.confidences.tolist() == [0.75, 0.5, 0.75]


def test_sem_ece_is_the_ece_of_the_modal_answers():
    s = _toy()
    r = s.summary(n_bins=10, ci=False)
    # bins: 0.5 -> {q1: wrong}, 0.75 -> {q0: right, q2: wrong}: |0.5-0| * 1/3 + |0.75-0.5| * 2/3
    assert r["ece"] == pytest.approx(0.5 / 3 + 0.25 * 2 / 3)
    assert r["accuracy"] == pytest.approx(1 / 3)
    assert r["brier"] == pytest.approx(((0.75 - 1) ** 2 + 0.5**2 + 0.75**2) / 3)
    assert r["mean_clusters"] == pytest.approx((2 + 3 + 2) / 3)
    assert r["samples"] == 4.0
    assert "ece_sample_split" in r


def test_sample_split_is_the_default_estimator():
    s = SampledSet([("a", "a", "b", "b", "a", "c")], [("a",)], ["d"], ["q"], info={"splits": 7, "seed": 3})
    assert s.confidences[0] == pytest.approx(s.semantic[0].sample_split)
    assert s.confidence("plug_in")[0] == pytest.approx(0.5)


def test_f1_equivalence_for_correctness():
    s = SampledSet([("the Eiffel Tower", "Eiffel Tower")], [("Eiffel Tower in Paris",)], ["d"], ["q"],
                   equivalence=answer_equivalence("f1", threshold=0.5))
    assert s.correct.tolist() == [True]
    assert SampledSet([("the Eiffel Tower",)], [("Eiffel Tower in Paris",)], ["d"], ["q"]).correct.tolist() == [False]


def test_select_and_by_domain_keep_the_clusters():
    s = _toy()
    geo = s.by_domain()["geo"]
    assert geo.answers == ["Paris", "Oslo"] and geo.correct.tolist() == [True, False]


def test_score_sampled_uses_the_samplers_samples():
    model, tok = tiny_random_model(seed=1, init_std=0.05)
    records = [OpenQA("Capital of France?", ("Paris",), "geo", "q0"),
               OpenQA("What is 2 + 2? Answer with a number.", ("4",), "math", "q1"),
               OpenQA("Largest planet?", ("Jupiter",), "geo", "q2")]
    settings = SamplingSettings(n=5, seed=2, max_new_tokens=4)
    s = score_sampled(model, tok, records, settings, batch_size=2)
    direct = sample_answers(model, tok, encode_open_prompts(tok, records), settings,
                            until=[r.until for r in records])
    assert s.samples == [tuple(a.text for a in q) for q in direct]
    assert s.info["n"] == 5 and s.info["estimator"] == "sample_split"
    r = s.summary(ci=True, n_resamples=50)
    assert r["n"] == 3 and 0.0 <= r["ece"] <= 1.0 and r["ece_ci_low"] <= r["ece"] <= r["ece_ci_high"]


def test_binary_summary_counts_unscored_answers():
    r = metrics.binary_summary([0.8, math.nan, 0.3, math.nan], [True, True, False, False], ci=False)
    assert r["n"] == 2 and r["unscored"] == 2 and r["accuracy"] == 0.5 and r["accuracy_all"] == 0.5
    r_all = metrics.binary_summary([0.8, 0.3], [True, False], ci=False)
    assert "unscored" not in r_all and r_all["ece"] == pytest.approx(r["ece"])


def test_bad_arguments():
    model, tok = tiny_random_model()
    q = [OpenQA("Q?", ("a",), "d", "q")]
    with pytest.raises(ValueError, match="estimator must be one of"):
        score_sampled(model, tok, q, SamplingSettings(n=2), estimator="mode")
    with pytest.raises(ValueError, match="equivalence must be one of"):
        score_sampled(model, tok, q, SamplingSettings(n=2), equivalence="nli")
    with pytest.raises(ValueError, match="3 references for 1 questions"):
        SampledSet([("a",)], [("a",)] * 3, ["d"], ["q"])
    assert np.isnan(SampledSet([("a",)], [("a",)], ["d"], ["q"]).confidences[0])  # one sample: no split estimate
