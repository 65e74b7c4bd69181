"""Semantic confidence of lm-eval generation runs: a file in lm-eval's format from our own samples
reproduces our numbers, and a real lm-eval ``generate_until`` run with ``repeats`` is read right."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from llm_calib.confidence.lm_eval_generations import is_generation_row, read_generation_samples
from llm_calib.confidence.sampled import SampledSet, score_sampled
from llm_calib.data.records import OpenQA
from llm_calib.engine.sampling import SamplingSettings
from llm_calib.models import tiny_random_model

DATE = "2026-12-06T12-00-00.000001"

GEN_YAML = """task: toy_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
  cache_dir: {cache}
test_split: test
output_type: generate_until
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_target: "{{{{answers}}}}"
repeats: 4
generation_kwargs:
  until: ["\\n"]
  do_sample: true
  temperature: 1.0
  max_gen_toks: 4
filter_list:
  - name: none
    filter:
      - function: take_first
metric_list:
  - metric: exact_match
"""


def lm_eval_generation_lines(scored: SampledSet) -> list[str]:
    """Lines as lm-eval 0.4.13 writes a generate_until task run with repeats."""
    lines = []
    for doc_id in range(len(scored)):
        d = scored.details[doc_id] if scored.details else {"prompt": "Q"}
        row = {
            "doc_id": doc_id, "doc": {"id": scored.ids[doc_id]}, "target": list(scored.references[doc_id]),
            "arguments": {"gen_args_0": {"arg_0": d["prompt"], "arg_1": {"until": ["\n"], "do_sample": True}}},
            "resps": [[" " + s for s in scored.samples[doc_id]]], "filtered_resps": [" " + scored.samples[doc_id][0]],
            "filter": "none", "metrics": ["exact_match"], "doc_hash": "0", "prompt_hash": "1", "target_hash": "2",
            "exact_match": 0.0,
        }
        lines.append(json.dumps(row, ensure_ascii=False) + "\n")
    return lines


def test_an_lm_eval_file_of_our_samples_reproduces_our_numbers(tmp_path: Path):
    model, tok = tiny_random_model(seed=1, init_std=0.05)
    records = [OpenQA(q, (a,), "toy", f"q{i}") for i, (q, a) in enumerate(
        [("Capital of France?", "Paris"), ("2 + 2 =", "4"), ("Largest planet?", "Jupiter"), ("Colour of sky?", "blue")])]
    ours = score_sampled(model, tok, records, SamplingSettings(n=6, seed=4, max_new_tokens=3), splits=5)
    path = tmp_path / f"samples_toy_{DATE}.jsonl"
    path.write_text("".join(lm_eval_generation_lines(ours)))
    theirs = read_generation_samples(path, splits=5, seed=0)
    assert theirs.samples == ours.samples and theirs.answers == ours.answers
    a, b = ours.summary(n_resamples=200), theirs.summary(n_resamples=200)
    for key in ("accuracy", "ece", "adaptive_ece", "brier", "auroc", "ece_ci_low", "ece_ci_high", "ece_plug_in"):
        np.testing.assert_allclose(b[key], a[key], rtol=0, atol=1e-9, err_msg=key)


def test_aliases_regex_filter_and_errors(tmp_path: Path):
    rows = [{"doc_id": 0, "target": ["Paris", "City of Light"], "arguments": [["Q", {"until": ["\n"]}]],
             "resps": [["The answer is Paris.", "answer is city of light", "Lyon"]], "filtered_resps": ["x"]}]
    s = read_generation_samples("t.jsonl", rows=rows, response_regex=r"answer is (.+)", estimator="plug_in")
    assert s.samples == [("Paris.", "city of light", "[invalid]")]
    assert s.correct.tolist() == [True] and s.confidences.tolist() == [pytest.approx(1 / 3)]
    one = [{**rows[0], "resps": [["Paris"]]}]
    with pytest.raises(ValueError, match=r"t.jsonl:1: 1 response\(s\).*repeats"):
        read_generation_samples("t.jsonl", rows=one)
    mc = [{"doc_id": 0, "target": "0", "arguments": {"gen_args_0": {"arg_0": "Q", "arg_1": " A"}},
           "resps": [[["-1.0", "True"]]], "filtered_resps": [["-1.0", "True"]]}]
    assert not is_generation_row(mc[0])
    with pytest.raises(ValueError, match="not a generate_until row"):
        read_generation_samples("t.jsonl", rows=mc)
    bad = tmp_path / "samples_bad.jsonl"
    bad.write_bytes(b"\xff\xfe not utf-8\n")
    with pytest.raises(ValueError, match=r"samples_bad.jsonl:1: not UTF-8"):
        read_generation_samples(bad)
    with pytest.raises(ValueError, match="neither a string nor a list"):
        read_generation_samples("t.jsonl", rows=[{**rows[0], "target": 3}])


def test_a_real_lm_eval_generation_run_with_repeats(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    pytest.importorskip("lm_eval")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    import lm_eval
    from lm_eval.loggers import EvaluationTracker
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    data = [{"question": q, "answers": a} for q, a in
            [("Capital of France?", "Paris"), ("2 + 2 =", "4"), ("Largest planet?", "Jupiter")]]
    (tmp_path / "gen.jsonl").write_text("".join(json.dumps(r) + "\n" for r in data))
    (tmp_path / "toy_gen.yaml").write_text(GEN_YAML.format(data=tmp_path / "gen.jsonl", cache=tmp_path / "cache"))
    model, tok = tiny_random_model(seed=1, init_std=0.05)
    res = lm_eval.simple_evaluate(
        model=HFLM(pretrained=model, tokenizer=tok, batch_size=4, device="cpu"), tasks=["toy_gen"],
        task_manager=TaskManager(include_path=str(tmp_path), include_defaults=False), log_samples=True,
        random_seed=0, numpy_random_seed=0, torch_random_seed=0,
    )
    samples = res.pop("samples")
    tracker = EvaluationTracker(output_path=str(tmp_path / "out" / "results.json"))
    tracker.save_results_aggregated(results=res, samples=samples)
    tracker.save_results_samples(task_name="toy_gen", samples=samples["toy_gen"])
    (path,) = (tmp_path / "out").glob("samples_toy_gen_*.jsonl")
    got = read_generation_samples(path, estimator="plug_in")
    logged = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(got) == 3 and all(len(s) == 4 for s in got.samples)
    # a direct computation from the logged responses: the modal normalised answer and its share
    for row, answer, conf, correct in zip(sorted(logged, key=lambda r: r["doc_id"]), got.answers, got.confidences,
                                          got.correct, strict=True):
        from llm_calib.metrics.answers import normalize_answer

        keys = [normalize_answer(r) for r in row["resps"][0]]
        mode = max(keys, key=lambda k: (keys.count(k), -keys.index(k)))
        assert normalize_answer(answer) == mode
        assert conf == pytest.approx(keys.count(mode) / 4)
        assert correct == (mode == normalize_answer(row["target"]))
