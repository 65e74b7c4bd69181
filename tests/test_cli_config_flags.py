"""``llm-calib calibrate``'s flags are generated from CalibrationConfig; the config file is read once;
defaults < --config < flags for every field; --unlabeled reaches the trainer."""

from __future__ import annotations

import argparse
import dataclasses
import json

import pytest

from llm_calib import cli
from llm_calib.calm import config as config_module
from llm_calib.calm.config import CalibrationConfig, LoraSettings

TRAIN = "builtin:arithmetic,capitals:n=4"
HELDOUT = "builtin:arithmetic,capitals:n=4,seed=1"
UNLABELED = "builtin:calendar:n=6,seed=3"


def _calibrate_parser():
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if a.dest == "command" or getattr(a, "choices", None))
    return sub.choices["calibrate"]


def test_every_config_field_is_a_flag_with_help_and_type():
    options = {s: a for a in _calibrate_parser()._actions for s in a.option_strings}
    fields = [f.name for f in dataclasses.fields(CalibrationConfig) if f.name not in ("method", "lora")]
    fields += [f"lora-{f.name}" for f in dataclasses.fields(LoraSettings)]
    for name in fields:
        flag = "--" + name.replace("_", "-")
        assert flag in options, flag
        action = options[flag]
        assert action.help and "default" in action.help, flag
        assert action.type is not None or action.choices, flag
    assert options["--bome-barrier"].choices == ("value", "gradient")
    assert options["--steps"].type("3") == 3 and options["--lr"].type("1e-3") == 1e-3
    assert options["--inner-lr"].type("null") is None and options["--lora-layers"].type("4,5") == (4, 5)
    assert options["--output-scale"].type("false") is False
    assert options["--open-examples"].type('[["2 + 2?", "4"], ["Capital of Italy?", "Rome"]]') == (
        ("2 + 2?", "4"), ("Capital of Italy?", "Rome"))
    with pytest.raises(argparse.ArgumentTypeError, match="JSON list of lists"):
        options["--open-examples"].type("2 + 2?=4")


def _argv(model_dir, out, *extra):
    return ["calibrate", "--model", str(model_dir), "--train", TRAIN, "--heldout", HELDOUT,
            "--eval", "builtin:capitals:n=4,seed=2", "--out", str(out), "--bootstrap", "0", "--no-progress", *extra]


def test_precedence_file_read_once_and_unlabeled(tiny_model_dir, tmp_path, monkeypatch):
    cfg_file = tmp_path / "run.yaml"
    cfg_file.write_text("method: confidence_penalty\nsteps: 5\nlam_lr: 0.3\npenalty_beta: 0.2\n"
                        "eval_every: 1\nguard_accuracy: 0.0\nlora: {rank: 2, layers: [1]}\n")
    reads = []
    original = config_module.read_config_file
    monkeypatch.setattr(config_module, "read_config_file", lambda p: reads.append(p) or original(p))
    monkeypatch.setattr(CalibrationConfig, "from_file", None)  # the CLI must not read the file a second way
    out = tmp_path / "out"
    argv = _argv(tiny_model_dir, out, "--config", str(cfg_file), "--steps", "2", "--penalty-beta", "0.9",
                 "--lora-rank", "3", "--heldout-batch-size", "2", "--unlabeled", UNLABELED,
                 "--unlabeled", "builtin:chemical_symbols:n=2,seed=4", "--unlabeled-limit", "5")
    assert cli.main(argv) == 0
    assert len(reads) == 1
    saved = json.loads((out / "confidence_penalty" / "config.json").read_text())
    assert saved["method"] == "confidence_penalty"                      # the file's method (no --methods)
    assert (saved["steps"], saved["penalty_beta"], saved["heldout_batch_size"]) == (2, 0.9, 2)   # flags
    assert (saved["lora"]["rank"], saved["lora"]["layers"]) == (3, [1])  # flag inside a file's mapping
    assert (saved["lam_lr"], saved["eval_every"]) == (0.3, 1)            # file
    assert saved["inner_lr"] is None and saved["bome_eta"] == 2.0         # defaults
    report = json.loads((out / "metrics.json").read_text())
    assert report["config"]["unlabeled"] == {"spec": f"{UNLABELED}+builtin:chemical_symbols:n=2,seed=4", "n": 7}
    history = json.loads((out / "confidence_penalty" / "history.json").read_text())
    assert all(h["unlabeled_entropy"] >= 0 for h in history) and len(history) == 2


@pytest.mark.parametrize(("flag", "value", "needle"), [
    ("--steps", "0", "steps must be an int >= 1"),
    ("--guard-accuracy", "2", "guard_accuracy must be in [0, 1]"),
    ("--inner-lr", "-1", "inner_lr must be > 0"),
    ("--open-examples", '[["2 + 2?", "4"], ["3 + 3?"]]', "open_examples[1] must be a [question, answer] pair"),
])
def test_a_bad_flag_value_is_a_one_line_error_naming_the_field(flag, value, needle, tiny_model_dir, tmp_path, capsys):
    assert cli.main(_argv(tiny_model_dir, tmp_path / "out", flag, value)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("llm-calib: error:") and needle in err[-1]


def test_unlabeled_of_another_kind_is_a_one_line_error(tiny_model_dir, tmp_path, capsys):
    path = tmp_path / "open.jsonl"
    path.write_text(json.dumps({"question": "What is 1 + 1?", "answer": ["2"]}) + "\n")
    assert cli.main(_argv(tiny_model_dir, tmp_path / "out", "--unlabeled", f"nq_open:{path}")) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("llm-calib: error:") and "--unlabeled" in last
