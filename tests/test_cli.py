"""The ``llm-calib`` command line, end to end on the tiny model saved to disk."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import _reference as ref
import pytest
import torch

from llm_calib import cli
from llm_calib.data import load as load_data
from llm_calib.models import load as load_model
from llm_calib.prompts.templates import PromptFormat, build_prompt
from llm_calib.scoring.base import encode_prompt


@pytest.fixture()
def jsonl_file(tmp_path):
    rows = [
        {"question": "Capital of France?", "options": ["Paris", "Rome", "Oslo"], "answer": "Paris"},
        {"question": "2 + 3 = ?", "options": ["4", "5"], "answer": 1},
        {
            "question": "Largest planet?",
            "options": ["Mars", "Venus", "Jupiter", "Earth"],
            "answer": "C",
        },
        {"question": "Colour of the sky?", "options": ["blue", "green"], "answer": 0},
        {
            "question": "Plants absorb?",
            "options": ["oxygen", "carbon dioxide", "helium"],
            "answer": 1,
        },
    ]
    path = tmp_path / "toy.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_help_documents_every_flag(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["evaluate", "--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    parser = cli.build_parser()
    evaluate = parser._subparsers._group_actions[0].choices["evaluate"]
    flags = [s for a in evaluate._actions for s in a.option_strings]
    assert len(flags) > 15
    for action in evaluate._actions:
        assert action.help, action.option_strings
    for flag in flags:
        assert flag in text
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    assert "evaluate" in capsys.readouterr().out


def test_evaluate_end_to_end(tiny_model_dir, jsonl_file, tmp_path, capsys):
    out = tmp_path / "out"
    spec_b, spec_j = "builtin:capitals,arithmetic:n=8", f"jsonl:{jsonl_file}"
    fit_spec = "builtin:calendar:n=8"
    argv = [
        "evaluate",
        "--model",
        str(tiny_model_dir),
        "--data",
        spec_b,
        "--data",
        spec_j,
        "--temperature-fit",
        fit_spec,
        "--batch-size",
        "3",
        "--bootstrap",
        "50",
        "--out",
        str(out),
        "--quiet",
    ]
    assert cli.main(argv) == 0
    printed = capsys.readouterr().out
    assert "capitals: n=8" in printed
    domains = ["capitals", "arithmetic", "toy"]
    for name in ["metrics.json", "report.md"] + [f"reliability_{d}.png" for d in domains]:
        assert (out / name).stat().st_size > 0, name
    data = json.loads((out / "metrics.json").read_text())
    assert list(data["domains"]) == domains
    # the same numbers, computed independently: one forward pass per option, metrics by loops
    model, tok = load_model(str(tiny_model_dir))
    prompt = PromptFormat()
    fit = load_data(fit_spec).records
    T = data["temperature"]["temperature"]
    assert abs(T - 1.0) > 0.05  # the temperature does something
    ref.assert_minimises_nll(ref.option_log_likelihoods(model, tok, fit, prompt), [r.gold for r in fit], T)
    records = load_data(spec_b).records + load_data(spec_j).records
    for dom in domains:
        recs = [r for r in records if r.domain == dom]
        scores = ref.option_log_likelihoods(model, tok, recs, prompt)
        labels = [r.gold for r in recs]
        got = data["domains"][dom]["uncalibrated"]
        expected = ref.summary(scores, labels)
        assert not math.isnan(expected["ece"]), "uncalibrated ECE must be comparable"
        ref.assert_matches(got, expected, ("n", "accuracy", "ece", "brier", "nll"), dom)
        assert got["accuracy_ci_low"] <= got["accuracy"] <= got["accuracy_ci_high"]
        scaled = ref.summary(scores, labels, T)
        ref.assert_matches(data["domains"][dom]["temperature_scaled"], scaled, ("accuracy", "ece", "nll"), dom)
    report = (out / "report.md").read_text()
    assert "## toy" in report and "temperature-scaled" in report


def test_letter_scorer_plain_prompt(tiny_model_dir, jsonl_file, tmp_path):
    out = tmp_path / "out"
    argv = [
        "evaluate",
        "--model",
        str(tiny_model_dir),
        "--data",
        f"jsonl:{jsonl_file}",
        "--scorer",
        "letter",
        "--no-chat-template",
        "--bootstrap",
        "0",
        "--limit",
        "4",
        "--bins",
        "5",
        "--out",
        str(out),
        "--quiet",
    ]
    assert cli.main(argv) == 0
    data = json.loads((out / "metrics.json").read_text())
    assert data["config"]["scorer"] == "letter" and data["config"]["n_bins"] == 5
    assert data["config"]["prompt"]["chat_template"] is False
    toy = data["domains"]["toy"]
    assert toy["n"] == 4 and "accuracy_ci_low" not in toy["uncalibrated"]
    assert len(toy["reliability"]["counts"]) == 5
    model, tok = load_model(str(tiny_model_dir))
    recs = load_data(f"jsonl:{jsonl_file}", limit=4).records
    # independently: the letter tokens' logits at the last prompt position, renormalised
    fmt = PromptFormat(style="listed", chat_template=False)
    letters = [tok(f" {c}", add_special_tokens=False)["input_ids"][0] for c in "ABCDE"]
    nll = 0.0
    for r in recs:
        ids = encode_prompt(tok, build_prompt(tok, r.question, r.options, fmt), chat=False)
        with torch.no_grad():
            last = model(torch.tensor([ids])).logits[0, -1].double()
        nll -= float(torch.log_softmax(last[letters[: len(r.options)]], 0)[r.gold])
    assert toy["uncalibrated"]["nll"] == pytest.approx(nll / len(recs), abs=ref.TOL)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--data", "nosuchloader:x"], "--data nosuchloader:x"),
        (["--data", "arc_easy:/nonexistent/test.jsonl"], "/nonexistent"),
        (["--data", "builtin:capitals:n=2", "--temperature-fit", "bogus:y"], "--temperature-fit"),
        (
            ["--data", "builtin:capitals:n=2", "--scorer", "letter", "--prompt-style", "cloze"],
            "listed",
        ),
        (["--data", "builtin:capitals:n=2", "--model", "/nonexistent/model_dir"], "--model"),
    ],
)
def test_user_errors_exit_2_without_traceback(argv, message, tmp_path, capsys):
    code = cli.main(["evaluate", *argv, "--out", str(tmp_path / "o"), "--quiet"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("llm-calib: error:") and message in err
    assert "Traceback" not in err


def test_bad_flag_values_are_rejected(capsys):
    for argv in (["--limit", "0"], ["--scorer", "best"], ["--normalize", "max"]):
        with pytest.raises(SystemExit) as exc:
            cli.main(["evaluate", "--data", "builtin", "--out", "x", *argv])
        assert exc.value.code == 2
    assert "invalid choice" in capsys.readouterr().err


def test_entry_point_process_reports_bad_spec():
    proc = subprocess.run(
        [sys.executable, "-m", "llm_calib.cli", "evaluate", "--data", "bogus:spec", "--out", "x"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "llm-calib: error: --data bogus:spec" in proc.stderr and "Traceback" not in proc.stderr


def test_demo_subcommand_calls_run_demo(monkeypatch):
    import llm_calib.evaluation.demo

    calls = []
    monkeypatch.setattr(llm_calib.evaluation.demo, "run_demo", lambda: calls.append(1))
    assert cli.main(["demo"]) == 0
    assert calls == [1]
