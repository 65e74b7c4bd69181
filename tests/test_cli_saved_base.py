"""Issue 31 (3): a saved result records its base model, dtype and prompt; ``evaluate --adapter``
and ``export`` default to them; ``--threads`` and the model-loading flags are shared."""

from __future__ import annotations

import json
import shutil
import warnings

import pytest
import torch

from llm_calib import cli
from llm_calib.calm.export import saved_base
from llm_calib.calm.trainer import BASE_MODEL_FILE, CalibrationResult
from llm_calib.models import load as load_model

warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)

SPEC = "builtin:capitals:n=4"


@pytest.fixture(scope="module")
def result(tiny_model_dir, tmp_path_factory):
    """One short ``calibrate`` run (lora_ce, one step); its saved result directory."""
    out = tmp_path_factory.mktemp("saved_base") / "run"
    argv = ["calibrate", "--model", str(tiny_model_dir), "--train", SPEC, "--heldout", "builtin:capitals:n=4,seed=1",
            "--eval", SPEC, "--out", str(out), "--methods", "lora_ce", "--steps", "1", "--batch-size", "2",
            "--lora-rank", "2", "--bootstrap", "0", "--no-progress", "--threads", "1"]
    assert cli.main(argv) == 0
    return out


def test_calibrate_records_base_model_dtype_and_prompt(result, tiny_model_dir):
    rec = json.loads((result / "lora_ce" / BASE_MODEL_FILE).read_text())
    assert rec["model"] == str(tiny_model_dir.resolve()) and rec["dtype"] == "float32"
    assert rec["prompt"]["style"] == "cloze" and rec["prompt"]["template"] is None
    assert (rec["scorer"], rec["normalize"]) == ("option_likelihood", "sum")
    assert saved_base(result / "lora_ce" / "adapter") == rec
    # the run's metrics.json names the prompt too
    assert json.loads((result / "metrics.json").read_text())["config"]["prompt"] == rec["prompt"]
    loaded = CalibrationResult.load(result / "lora_ce", load_model(str(tiny_model_dir))[0])
    assert loaded.base == rec


def test_evaluate_adapter_defaults_to_the_recorded_model(result, tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "ev"
    assert cli.main(["evaluate", "--adapter", str(result / "lora_ce"), "--data", SPEC, "--out", str(out),
                     "--bootstrap", "0", "--quiet"]) == 0
    cfg = json.loads((out / "metrics.json").read_text())["config"]
    assert cfg["model"] == str(tiny_model_dir.resolve()) and cfg["dtype"] == "float32"
    assert "warning" not in capsys.readouterr().err  # the training prompt: no warning


def test_evaluate_with_another_prompt_warns(result, tmp_path, capsys):
    assert cli.main(["evaluate", "--adapter", str(result / "lora_ce"), "--data", SPEC, "--out", str(tmp_path / "ev"),
                     "--bootstrap", "0", "--quiet", "--prompt-preset", "lm_eval_arc"]) == 0
    err = capsys.readouterr().err
    assert "warning" in err and "another prompt" in err and "template" in err


def test_export_defaults_to_the_recorded_model(result, tmp_path):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "merged"
    assert cli.main(["export", str(result / "lora_ce"), "--out", str(out), "--threads", "1"]) == 0
    merged = AutoModelForCausalLM.from_pretrained(str(out))
    assert next(merged.parameters()).dtype == torch.float32


def test_old_results_still_load_but_need_model(result, tiny_model_dir, tmp_path, capsys):
    old = tmp_path / "old"
    shutil.copytree(result / "lora_ce", old)
    (old / BASE_MODEL_FILE).unlink()
    assert CalibrationResult.load(old, load_model(str(tiny_model_dir))[0]).base == {}
    capsys.readouterr()
    assert cli.main(["evaluate", "--adapter", str(old), "--data", SPEC, "--out", str(tmp_path / "ev"), "--quiet"]) == 2
    assert "--model is required" in capsys.readouterr().err
    assert cli.main(["export", str(old), "--out", str(tmp_path / "m")]) == 2
    assert "--model is required" in capsys.readouterr().err
    # with --model they work as before
    assert cli.main(["export", str(old), "--model", str(tiny_model_dir), "--out", str(tmp_path / "m")]) == 0


@pytest.mark.parametrize("command", ["evaluate", "calibrate", "export"])
def test_model_loading_flags_are_shared(command):
    sub = cli.build_parser()._subparsers._group_actions[0].choices[command]
    flags = {s for a in sub._actions for s in a.option_strings}
    assert {"--model", "--dtype", "--threads", "--attn-implementation", "--trust-remote-code", "--cache-dir"} <= flags


def test_threads_applies(monkeypatch, tiny_model_dir, result, tmp_path):
    calls = []
    monkeypatch.setattr(torch, "set_num_threads", calls.append)
    assert cli.main(["export", str(result / "lora_ce"), "--out", str(tmp_path / "m"), "--threads", "3"]) == 0
    assert calls == [3]
