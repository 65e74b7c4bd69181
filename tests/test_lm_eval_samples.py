"""``llm-calib metrics SAMPLES...``: lm-eval ``--log_samples`` files in, our calibration report out.

Checked against our own ``evaluate`` on the same questions, twice: with a samples file written in
lm-eval 0.4.x's format from our own per-option log-likelihoods (no lm-eval needed), and with a
real lm-eval run (``simple_evaluate`` + ``EvaluationTracker``) on the tiny model over a local task.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from llm_calib.cli import main
from llm_calib.data import builtin_multiple_choice
from llm_calib.data.lm_eval_logs import samples_task_name
from llm_calib.evaluation.evaluate import HEADLINE_METRICS, evaluate_records
from llm_calib.evaluation.lm_eval_samples import read_samples, samples_result
from llm_calib.models import tiny_random_model

DATE = "2026-12-02T12-00-00.000001"


def lm_eval_sample_lines(details: list[dict], labels: list[int], task: str) -> list[str]:
    """Lines as lm-eval 0.4.13's EvaluationTracker.save_results_samples writes them."""
    lines = []
    for doc_id, (d, gold) in enumerate(zip(details, labels, strict=True)):
        lls = d["loglik"]
        resps = [(ll, ll == max(lls)) for ll in lls]
        chars = np.asarray([len(c) for c in d["choices"]], dtype=float)
        sample = {
            "doc_id": doc_id,
            "doc": {"question": d["prompt"], "choices": d["choices"], "gold": gold},
            "target": str(gold),  # lm-eval writes str(target)
            "arguments": {f"gen_args_{i}": {"arg_0": d["prompt"], "arg_1": c}
                          for i, c in enumerate(d["continuations"])},
            "resps": [[[str(ll), str(g)]] for ll, g in resps],
            "filtered_resps": [[str(ll), str(g)] for ll, g in resps],
            "filter": "none",
            "metrics": ["acc", "acc_norm"],
            "doc_hash": "0" * 64, "prompt_hash": "1" * 64, "target_hash": "2" * 64,
            "acc": float(int(np.argmax(lls)) == gold),
            "acc_norm": float(int(np.argmax(np.asarray(lls) / chars)) == gold),
        }
        lines.append(json.dumps(sample, ensure_ascii=False) + "\n")
    return lines


def _close(ours: dict, theirs: dict, keys, rtol: float = 1e-7, atol: float = 1e-9) -> None:
    for k in keys:
        np.testing.assert_allclose(theirs[k], ours[k], rtol=rtol, atol=atol, err_msg=k)


def test_task_name_from_file_name() -> None:
    assert samples_task_name(f"samples_mmlu_high_school_physics_{DATE}.jsonl") == "mmlu_high_school_physics"
    assert samples_task_name("x/samples_arc_easy.jsonl") == "samples_arc_easy"


def test_metrics_cli_matches_evaluate_on_the_same_questions(tmp_path: Path) -> None:
    model, tok = tiny_random_model(init_std=0.5)
    qs = builtin_multiple_choice(30, seed=3, domains=["capitals"])
    ours = evaluate_records(model, tok, [("builtin", qs)], n_resamples=200, seed=7,
                            temperature_fit=("capitals", qs))
    dom = ours.domains["capitals"]
    path = tmp_path / f"samples_capitals_{DATE}.jsonl"
    path.write_text("".join(lm_eval_sample_lines(dom.scored.details, dom.scored.labels, "capitals")))

    out = tmp_path / "report"
    assert main(["metrics", str(path), "--out", str(out), "--bootstrap", "200", "--seed", "7",
                 "--temperature-fit", "capitals"]) == 0
    got = json.loads((out / "metrics.json").read_text())
    assert (out / "report.md").is_file() and (out / "reliability_capitals.png").is_file()
    theirs = got["domains"]["capitals"]
    assert theirs["n"] == 30 and theirs["kind"] == "multiple_choice"
    every = [k for k in dom.uncalibrated if k != "n"]
    assert {f"{m}_ci_low" for m in HEADLINE_METRICS} <= set(every)
    _close(dom.uncalibrated, theirs["uncalibrated"], every)
    _close(dom.temperature_scaled, theirs["temperature_scaled"], every)
    np.testing.assert_allclose(got["temperature"]["temperature"], ours.temperature.temperature, rtol=1e-6)
    for name in ("acc", "acc_norm", "acc_bytes"):
        _close(dom.normalizations[name], theirs["normalizations"][name], ("accuracy", "ece", "nll", "brier"))
    # what lm-eval itself logged per document agrees with the reading
    for name in ("acc", "acc_norm"):
        assert theirs["normalizations"][name]["lm_eval_accuracy"] == theirs["normalizations"][name]["accuracy"]
    for key in ("bin_confidence", "bin_accuracy", "bin_count"):
        if key in dom.reliability:
            np.testing.assert_allclose(theirs["reliability"][key], dom.reliability[key], rtol=1e-7)

    # per character: the headline is evaluate's --normalize char
    ours_char = evaluate_records(model, tok, [("builtin", qs)], normalize="char", ci=False)
    res = samples_result([path], normalize="acc_norm", ci=False)
    _close(ours_char.domains["capitals"].uncalibrated, res.domains["capitals"].uncalibrated,
           [k for k in ours_char.domains["capitals"].uncalibrated if k != "n"])


def test_metrics_cli_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["metrics", str(tmp_path / "missing.jsonl"), "--out", str(tmp_path / "o")]) == 2
    assert "no such samples file" in capsys.readouterr().err
    gen = {"doc_id": 0, "doc": {}, "target": "Paris", "arguments": {"gen_args_0": {
        "arg_0": "Q: Capital of France?\nA:", "arg_1": {"until": ["\n"]}}},
        "resps": [["Paris"]], "filtered_resps": ["Paris"], "filter": "none", "exact_match": 1.0}
    p = tmp_path / f"samples_capitals_gen_{DATE}.jsonl"
    p.write_text(json.dumps(gen) + "\n")
    # a generate_until file goes to semantic confidence, which needs repeats (one response here)
    assert main(["metrics", str(p), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert f"{p}:1" in err and "repeats" in err
    with pytest.raises(ValueError, match=rf"{p}:1: .*only multiple_choice tasks"):
        read_samples(p)
    with pytest.raises(ValueError, match="no token counts"):
        samples_result([p], normalize="mean")
    with pytest.raises(ValueError, match="neither an option index"):
        read_samples(p, rows=[{"doc_id": 0, "target": "Lyon", "filtered_resps": [["-1", "False"], ["-2", "False"]],
                               "arguments": [("Q", " Paris"), ("Q", " Rome")]}])


def test_metrics_of_a_real_lm_eval_run_match_evaluate(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("lm_eval")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    import lm_eval
    from lm_eval.loggers import EvaluationTracker
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    from llm_calib.data import load
    from tests.test_lm_eval_task import ARC_YAML, ROWS

    rows = [*ROWS, *({**r, "id": r["id"] + "b"} for r in ROWS)]
    (tmp_path / "arc.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "toy_arc_easy.yaml").write_text(
        ARC_YAML.format(data=tmp_path / "arc.jsonl", cache=tmp_path / "hf_cache"))
    model, tok = tiny_random_model(init_std=0.5)
    res = lm_eval.simple_evaluate(
        model=HFLM(pretrained=model, tokenizer=tok, batch_size=4, device="cpu"),
        tasks=["toy_arc_easy"], task_manager=TaskManager(include_path=str(tmp_path), include_defaults=False),
        num_fewshot=1, log_samples=True,
    )
    # as lm-eval's CLI saves them (lm_eval --output_path ... --log_samples)
    samples = res.pop("samples")
    tracker = EvaluationTracker(output_path=str(tmp_path / "out" / "results.json"))
    tracker.save_results_aggregated(results=res, samples=samples)
    tracker.save_results_samples(task_name="toy_arc_easy", samples=samples["toy_arc_easy"])
    (path,) = (tmp_path / "out").glob("samples_toy_arc_easy_*.jsonl")

    out = tmp_path / "report"
    assert main(["metrics", str(path), "--out", str(out), "--bootstrap", "0"]) == 0
    got = json.loads((out / "metrics.json").read_text())["domains"]["toy_arc_easy"]
    # lm-eval's own accuracies
    assert got["normalizations"]["acc"]["accuracy"] == res["results"]["toy_arc_easy"]["acc,none"]
    assert got["normalizations"]["acc_norm"]["accuracy"] == res["results"]["toy_arc_easy"]["acc_norm,none"]
    # and our evaluate on the same task through the lm_eval: loader
    recs = load(f"lm_eval:toy_arc_easy:include={tmp_path},num_fewshot=1").records
    ours = evaluate_records(model, tok, [("toy", recs)], ci=False).domains["toy_arc_easy"]
    assert got["n"] == ours.n == len(rows)
    # float32 forward passes with different batch layouts
    _close(ours.uncalibrated, got["uncalibrated"], ("accuracy", "brier", "nll", "mean_confidence", "auroc"),
           rtol=0, atol=1e-5)
