"""``llm-calib demo`` (llm_calib.evaluation.demo): the trunk-cached pipeline gives the plain scorer's numbers,
the report says what the table means, and its reading follows the numbers."""

from __future__ import annotations

import json

import numpy as np
import pytest

from llm_calib.calm.trainer import CalibrationResult
from llm_calib.evaluation.demo import (
    DemoSettings,
    calibration_config,
    explain_table,
    run_demo,
    split_data,
)
from llm_calib.models import load
from llm_calib.prompts.resolution import resolve_prompt_settings
from llm_calib.scoring.option_likelihood import score_option_likelihood


def test_split_keeps_test_questions_apart_and_checks_sizes():
    s = DemoSettings(n_per_domain=10, n_train=3, n_heldout=2)
    train, heldout, test = split_data(s)
    assert len(train) == 3 * 3 and len(heldout) == 3 * 2
    assert [len(test[d]) for d in s.in_domain] == [5, 5, 5] and [len(test[d]) for d in s.out_of_domain] == [5, 5]
    seen = {q.id for q in train} | {q.id for q in heldout}
    assert not seen & {q.id for qs in test.values() for q in qs}
    _, _, test = split_data(DemoSettings(n_per_domain=10, n_train=3, n_heldout=2, n_out_of_domain=7))
    assert [len(test[d]) for d in s.in_domain] == [5, 5, 5] and [len(test[d]) for d in s.out_of_domain] == [7, 7]
    with pytest.raises(ValueError, match=r"n_train \+ n_heldout \(6 \+ 4\) must be below n_per_domain \(10\)"):
        DemoSettings(n_per_domain=10, n_train=6, n_heldout=4)
    with pytest.raises(ValueError, match="top_layers"):
        DemoSettings(top_layers=0)


def test_demo_on_the_tiny_model_matches_the_plain_scorer(tiny_model_dir, tmp_path, capsys):
    # seed 2 and lr 1e-2: model selection keeps step 3 (a trained adapter, not the base model)
    settings = DemoSettings(model=str(tiny_model_dir), n_per_domain=6, n_train=2, n_heldout=2, steps=3, batch_size=2,
                            top_layers=1, eval_every=1, lr=1e-2, seed=2, out=str(tmp_path / "demo"))
    results = run_demo(settings)
    assert results["calm_metrics"]["after"]["selected_step"] == 3
    printed = capsys.readouterr().out
    report = (tmp_path / "demo" / "report.md").read_text()
    assert report in printed
    assert "| **mean** | in-domain |" in report and "| **mean** | out-of-domain |" in report
    assert "How to read the table:" in report and "ECE (expected calibration error)" in report
    assert "\n".join(results["reading"]) in report
    assert set(results["timings"]) == {"load model", "score uncalibrated", "train CALM", "score CALM"}
    assert json.loads((tmp_path / "demo" / "results.json").read_text())["temperature"] == results["temperature"]

    # the table's numbers are the plain scorer's: base model, and the saved CALM adapter on a fresh base
    _, _, test = split_data(settings)
    fmt = resolve_prompt_settings(calibration_config(settings).prompt).prompt
    model, tok = load(str(tiny_model_dir))
    calm = CalibrationResult.load(tmp_path / "demo" / "calm", load(str(tiny_model_dir))[0]).model
    for domain, records in test.items():
        row = results["rows"][domain]
        for column, scored_by in (("uncalibrated", model), ("CALM", calm)):
            plain = score_option_likelihood(scored_by, tok, records, prompt=fmt).summary(ci=False)
            for metric in ("accuracy", "ece", "nll"):
                np.testing.assert_allclose(row[column][metric], plain[metric], rtol=1e-4, atol=1e-5,
                                           err_msg=f"{domain} {column} {metric}")
        # CALM + temperature: the CALM model's scores divided by the temperature fitted on its held-out scores
        both = f"CALM + temperature (T={results['calm_temperature']:.2f})"
        plain = score_option_likelihood(calm, tok, records, prompt=fmt).scaled(results["calm_temperature"])
        for metric, want in plain.summary(ci=False).items():
            if metric in ("accuracy", "ece", "nll"):
                np.testing.assert_allclose(row[both][metric], want, rtol=1e-4, atol=1e-5, err_msg=f"{domain} {metric}")
        assert row[both]["accuracy"] == row["CALM"]["accuracy"]  # a temperature never changes accuracy
    assert list(results["rows"][domain]) == ["uncalibrated", f"temperature (T={results['temperature']:.2f})", "CALM",
                                             both]
    assert f"| {both} acc / ECE |" in report and f"- {both}: the CALM model's probabilities" in report


def _rows(in_ece, out_ece):
    m = lambda ece: {"accuracy": 0.5, "ece": ece}  # noqa: E731
    return {"x": {"u": m(in_ece[0]), "t": m(in_ece[1]), "c": m(in_ece[2])},
            "y": {"u": m(out_ece[0]), "t": m(out_ece[1]), "c": m(out_ece[2])}}


def test_the_reading_explains_the_calm_plus_temperature_column():
    s = DemoSettings(in_domain=("x",), out_of_domain=("y",))
    rows = _rows((0.3, 0.2, 0.1), (0.2, 0.1, 0.25))
    for dom, ece in (("x", 0.05), ("y", 0.08)):
        rows[dom]["c+t"] = {"accuracy": 0.5, "ece": ece}
    three = explain_table(rows, ["u", "t", "c"], s, 20)
    four = explain_table(rows, ["u", "t", "c", "c+t"], s, 20)
    assert len(four) == len(three) + 1 and four[-2:] == three[-2:]
    assert four[4].startswith("- c+t: the CALM model's probabilities divided by a temperature fitted on its own")


def test_the_reading_follows_the_numbers():
    s = DemoSettings(in_domain=("x",), out_of_domain=("y",))
    lowered = explain_table(_rows((0.3, 0.2, 0.1), (0.2, 0.1, 0.25)), ["u", "t", "c"], s, 20)[-2]
    assert "in domain, CALM (step 20 of 30) lowered the mean ECE from 0.300 to 0.100" in lowered
    assert "out of domain it raised it from 0.200 to 0.250" in lowered
    raised = explain_table(_rows((0.1, 0.2, 0.3), (0.2, 0.1, 0.2)), ["u", "t", "c"], s, 0)[-2]
    assert "CALM (model selection kept the initial model) raised the mean ECE from 0.100 to 0.300" in raised
    assert "out of domain it left it at 0.200" in raised
