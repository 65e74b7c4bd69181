"""The shared data-loading flags (--limit, --limit-mode, --on-error) of ``llm-calib calibrate``."""

from __future__ import annotations

import json

import pytest

from llm_calib import cli

GOOD = [
    {"question": f"Question {i}?", "options": [f"a{i}", f"b{i}"], "answer": i % 2} for i in range(6)
]


@pytest.fixture()
def bad_file(tmp_path):
    rows = [json.dumps(r) for r in GOOD]
    rows.insert(1, json.dumps({"question": "Broken?", "options": ["x", "y"], "answer": "q"}))
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(rows) + "\n")
    return path


def test_calibrate_help_has_the_data_flags(capsys):
    with pytest.raises(SystemExit):
        cli.main(["calibrate", "--help"])
    text = capsys.readouterr().out
    for flag in ("--limit", "--limit-mode", "--on-error"):
        assert flag in text


def test_calibrate_on_error(tiny_model_dir, bad_file, tmp_path, capsys):
    spec = f"jsonl:{bad_file}"
    base = ["calibrate", "--model", str(tiny_model_dir), "--train", spec, "--heldout", spec,
            "--eval", spec, "--methods", "lora_ce", "--steps", "1", "--no-progress", "--bootstrap", "0"]
    assert cli.main([*base, "--out", str(tmp_path / "raise")]) == 2
    assert f"{bad_file}:2" in capsys.readouterr().err
    out = tmp_path / "skip"
    assert cli.main([*base, "--on-error", "skip", "--limit", "4", "--limit-mode", "first", "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert err.count("skipped 1 malformed rows") == 3 and f"{bad_file}:2" in err
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["config"]["limit_mode"] == "first"
    assert metrics["config"]["skipped"][spec]["count"] == 1
