"""``llm-calib evaluate --confidence KIND`` and ``llm-calib metrics`` on lm-eval generation runs:
the four kinds end to end, metrics reproducing evaluate's Sem-ECE, and one-line errors."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from llm_calib.cli import main

QUESTIONS = [("Capital of France?", ["Paris"]), ("2 + 2 =", ["4", "four"]), ("Largest planet?", ["Jupiter"]),
             ("Colour of a clear sky?", ["blue"]), ("Author of Hamlet?", ["Shakespeare"])]


@pytest.fixture
def open_file(tmp_path: Path) -> Path:
    path = tmp_path / "open.jsonl"
    path.write_text("".join(json.dumps({"id": f"q{i}", "question": q, "answers": a, "domain": "toy"}) + "\n"
                            for i, (q, a) in enumerate(QUESTIONS)))
    return path


def _evaluate(tiny_model_dir, open_file, out, *extra):
    return main(["evaluate", "--model", str(tiny_model_dir), "--data", f"jsonl:{open_file}", "--bootstrap", "50",
                 "--quiet", "--max-new-tokens", "3", "--out", str(out), *extra])


@pytest.mark.parametrize("kind", ["token", "semantic", "p_true", "verbalized"])
def test_each_kind_end_to_end(tiny_model_dir, open_file, tmp_path, kind):
    out = tmp_path / kind
    assert _evaluate(tiny_model_dir, open_file, out, "--confidence", kind, "--samples", "3", "--log-samples") == 0
    report = json.loads((out / "metrics.json").read_text())
    domain = report["domains"]["toy"]
    assert report["config"]["confidence"]["kind"] == kind
    assert domain["n"] + domain["uncalibrated"].get("unscored", 0) == len(QUESTIONS)
    rows = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert len(rows) == len(QUESTIONS)
    if kind == "semantic":
        assert all(len(r["samples"]) == 3 for r in rows) and "Sem-ECE" in (out / "report.md").read_text()
    if kind == "verbalized":
        assert all("reply" in r for r in rows)


def test_metrics_reproduces_evaluate_on_an_lm_eval_file_of_the_same_samples(tiny_model_dir, open_file, tmp_path):
    out = tmp_path / "eval"
    assert _evaluate(tiny_model_dir, open_file, out, "--confidence", "semantic", "--samples", "4", "--splits", "6",
                     "--log-samples") == 0
    rows = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    lines = [json.dumps({
        "doc_id": i, "doc": {}, "target": r["references"],
        "arguments": {"gen_args_0": {"arg_0": r["prompt"], "arg_1": {"until": ["\n"], "do_sample": True}}},
        "resps": [[" " + s for s in r["samples"]]], "filtered_resps": [" " + r["samples"][0]], "filter": "none",
    }) + "\n" for i, r in enumerate(rows)]
    samples = tmp_path / "samples_toy_2026-12-06T12-00-00.000001.jsonl"
    samples.write_text("".join(lines))
    assert main(["metrics", str(samples), "--splits", "6", "--bootstrap", "50", "--out", str(tmp_path / "m")]) == 0
    ours = json.loads((out / "metrics.json").read_text())["domains"]["toy"]["uncalibrated"]
    theirs = json.loads((tmp_path / "m" / "metrics.json").read_text())["domains"]["toy"]["uncalibrated"]
    assert ours.keys() == theirs.keys()
    for key, value in ours.items():  # NaN (e.g. AUROC with no right answer) is written as null
        np.testing.assert_allclose(np.nan if theirs[key] is None else theirs[key], np.nan if value is None else value,
                                   rtol=0, atol=1e-9, err_msg=key)


@pytest.mark.parametrize(("flags", "message"), [
    (["--samples", "0"], "argument --samples: expected an integer >= 2, got 0"),
    (["--confidence", "semantic", "--samples", "1"], "argument --samples: expected an integer >= 2, got 1"),
    (["--sampling-temperature", "0"], "argument --sampling-temperature: expected a finite number > 0, got 0"),
    (["--top-p", "1.5"], r"argument --top-p: expected a number in \(0, 1\], got 1.5"),
    (["--confidence", "mean"], "argument --confidence: invalid choice: 'mean'"),
    (["--confidence", "p_true", "--p-true-template", "no fields"], "--p-true-template: the template must contain"),
])
def test_bad_flags_are_one_line_errors(tiny_model_dir, open_file, tmp_path, capsys, flags, message):
    if "argument" in message:  # argparse's usage error: exit status 2
        with pytest.raises(SystemExit) as exc:
            _evaluate(tiny_model_dir, open_file, tmp_path / "x", *flags)
        assert exc.value.code == 2
    else:
        assert _evaluate(tiny_model_dir, open_file, tmp_path / "x", *flags) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert any(__import__("re").search(message, line) for line in err), err
    if "invalid choice" in message:
        assert "token" in err[-1] and "verbalized" in err[-1]  # the allowed values


def test_metrics_on_a_generation_file_without_repeats(tmp_path, capsys):
    row = {"doc_id": 0, "target": "Paris", "arguments": {"gen_args_0": {"arg_0": "Q", "arg_1": {"until": ["\n"]}}},
           "resps": [[" Paris"]], "filtered_resps": [" Paris"], "filter": "none"}
    path = tmp_path / "samples_gen_2026-12-06T12-00-00.000001.jsonl"
    path.write_text(json.dumps(row) + "\n")
    assert main(["metrics", str(path), "--out", str(tmp_path / "m")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "repeats" in err[0] and str(path) in err[0]
    assert main(["metrics", str(tmp_path), "--out", str(tmp_path / "m")]) == 2
    assert "a folder" in capsys.readouterr().err


def test_calibrate_report_scores_every_column_with_the_chosen_confidence(tiny_model_dir, open_file, tmp_path):
    """``calibrate --confidence semantic``: every column of the report is Sem-ECE over sampled answers,
    and the uncalibrated column equals ``evaluate --confidence semantic`` on the same model, set and seed."""
    out = tmp_path / "cal"
    assert main(["calibrate", "--model", str(tiny_model_dir), "--train", f"jsonl:{open_file}",
                 "--heldout", f"jsonl:{open_file}", "--eval", f"jsonl:{open_file}", "--methods", "lora_ce",
                 "--steps", "1", "--batch-size", "2", "--bootstrap", "50", "--quiet",
                 "--no-progress", "--confidence", "semantic", "--samples", "3", "--splits", "4",
                 "--out", str(out)]) == 0
    report = json.loads((out / "metrics.json").read_text())
    assert report["config"]["evaluation"]["confidence"]["kind"] == "semantic"
    cols = {k: v for k, v in report["domains"]["toy"]["columns"].items() if v}
    assert {"uncalibrated", "lora_ce"} <= set(cols)
    assert all(c["samples"] == 3 and "mean_clusters" in c for c in cols.values())
    text = (out / "report.md").read_text()
    assert "Sem-ECE" in text
    # the post-hoc knob of semantic confidence: the sampling temperature chosen by held-out Sem-ECE, in the
    # temperature columns, and model selection on the held-out Sem-ECE
    assert set(cols) == {"uncalibrated", "temperature_scaled", "lora_ce", "lora_ce+temperature"}
    fit = report["temperature"]
    assert fit["criterion"] == "sem_ece" and set(fit["tried"]) == {"0.5", "0.7", "1", "1.4", "2"}
    kept = {t: v["sem_ece"] for t, v in fit["tried"].items() if v["accuracy"] >= 0.95 * fit["tried"]["1"]["accuracy"]}
    assert fit["nll_after"] == min(kept.values()) == kept[f"{fit['temperature']:g}"]
    assert "the sampling temperature chosen by Sem-ECE" in text and "| lora_ce + temperature |" in text
    assert report["training"]["lora_ce"]["selection"]["metric"] == "Sem-ECE of 3 sampled answers (semantic confidence)"
    assert "read the held-out Sem-ECE of 3 sampled answers" in text
    ev = tmp_path / "ev"
    assert main(["evaluate", "--model", str(tiny_model_dir), "--data", f"jsonl:{open_file}", "--bootstrap", "50",
                 "--quiet", "--confidence", "semantic", "--samples", "3", "--splits", "4", "--out", str(ev)]) == 0
    direct = json.loads((ev / "metrics.json").read_text())["domains"]["toy"]["uncalibrated"]
    for key in ("ece", "accuracy", "mean_confidence", "brier", "mean_clusters"):
        assert cols["uncalibrated"][key] == pytest.approx(direct[key], abs=1e-12), key
