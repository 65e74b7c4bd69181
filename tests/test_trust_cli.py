"""The CLI's trust checks (issue "outputs you can trust"): ``--out`` checked before any model is
loaded, the run lock, refusals of stale checkpoints and of a smaller resumed budget, export and
adapter-base refusals, one-line errors for damaged models, Ctrl-C, numeric flags, warnings once."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _cli_runs import EVAL, HELDOUT, ROOT, RUN_FLAGS, TRAIN

from llm_calib import cli
from llm_calib.cli import calibrate as cli_calibrate
from llm_calib.cli import evaluate as cli_evaluate
from llm_calib.cli import export as cli_export
from llm_calib.files.outputs import LOCK_FILE


def _calibrate_argv(model_dir: Path, out: Path, *extra: str) -> list[str]:
    return ["calibrate", "--model", str(model_dir), "--train", TRAIN, "--heldout", HELDOUT, "--eval", EVAL,
            *RUN_FLAGS, "--out", str(out), *extra]


def _no_loading(*args, **kwargs):
    raise AssertionError("the model was loaded")


@pytest.fixture(scope="module")
def run(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """One two-method run with checkpoints, in a subprocess (its stderr as a user sees it)."""
    out = tmp_path_factory.mktemp("trust_cli") / "run"
    argv = _calibrate_argv(tiny_model_dir, out, "--methods", "calm,lora_ce", "--steps", "4")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "llm_calib.cli", *argv], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=600)
    assert done.returncode == 0, done.stderr
    return out, done.stderr


def _copy(run_dir: Path, tmp_path: Path) -> Path:
    target = tmp_path / "run"
    shutil.copytree(run_dir, target)
    return target


# --------------------------------------------------------------------------- --out before the work

@pytest.mark.parametrize("command", ["calibrate", "evaluate", "metrics"])
def test_out_an_existing_file_fails_before_loading(command, tiny_model_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(cli_calibrate, "load_base_model", _no_loading)
    monkeypatch.setattr(cli_evaluate, "load_base_model", _no_loading)
    out = tmp_path / "taken"
    out.write_text("not a folder")
    samples = tmp_path / "samples_arc_easy_2024.jsonl"
    samples.write_text("")
    argv = {"calibrate": _calibrate_argv(tiny_model_dir, out),
            "evaluate": ["evaluate", "--model", str(tiny_model_dir), "--data", EVAL, "--quiet", "--out", str(out)],
            "metrics": ["metrics", str(samples), "--out", str(out)]}[command]
    t0 = time.perf_counter()
    assert cli.main(argv) == 2
    assert time.perf_counter() - t0 < 10
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"--out {out}: exists and is a file" in err


def test_run_lock_refuses_a_second_run(tiny_model_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(cli_calibrate, "load_base_model", _no_loading)
    out = tmp_path / "out"
    out.mkdir()
    (out / LOCK_FILE).write_text(f'{{"pid": {os.getppid()}, "host": "{os.uname().nodename}", "started": "now"}}')
    assert cli.main(_calibrate_argv(tiny_model_dir, out)) == 2
    assert "another llm-calib run (pid" in capsys.readouterr().err


def test_interrupt_gives_130_and_the_resume_hint(tiny_model_dir, tmp_path, monkeypatch, capsys):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli_calibrate, "load_records", interrupted)  # while the run holds the lock
    out = tmp_path / "out"
    assert cli.main(_calibrate_argv(tiny_model_dir, out)) == 130
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "interrupted" in err and "--resume" in err
    assert not (out / LOCK_FILE).exists()  # the lock goes with the run


def test_a_full_disk_while_writing_the_report_is_one_line(tiny_model_dir, tmp_path, monkeypatch, capsys):
    import errno

    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "out" / "metrics.json"))

    monkeypatch.setattr(cli_evaluate, "write_report", full_disk, raising=False)
    monkeypatch.setattr("llm_calib.evaluation.report.write_report", full_disk)
    argv = ["evaluate", "--model", str(tiny_model_dir), "--data", "builtin:capitals:n=2", "--quiet", "--bootstrap", "0",
            "--out", str(tmp_path / "out")]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "No space left on device" in err and "metrics.json" in err


# --------------------------------------------------------------------------- checkpoints and resume

def test_warnings_are_shown_once(run):
    _, err = run
    assert err.count("held-out questions: model selection") == 1, err  # once, though two methods train
    for line in err.splitlines():  # a selection note is a status line, not also a warning
        assert not ("UserWarning" in line and "selection:" in line), err


def test_rerun_without_resume_refuses_to_delete_checkpoints(run, tiny_model_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(cli_calibrate, "load_base_model", _no_loading)
    out = _copy(run[0], tmp_path)
    before = sorted(p.name for p in (out / "checkpoints" / "calm").iterdir())
    assert cli.main(_calibrate_argv(tiny_model_dir, out, "--steps", "4")) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "checkpoints of an earlier run" in err and "--restart" in err
    assert sorted(p.name for p in (out / "checkpoints" / "calm").iterdir()) == before
    assert cli.main(_calibrate_argv(tiny_model_dir, out, "--resume", "--restart")) == 2
    assert "choose one" in capsys.readouterr().err


def test_resume_with_fewer_steps_is_refused_and_resume_says_where(run, tiny_model_dir, tmp_path, capsys):
    out = _copy(run[0], tmp_path)
    (out / "calm" / "metrics.json").unlink()  # killed after the last checkpoint, before the result was saved
    assert cli.main(_calibrate_argv(tiny_model_dir, out, "--steps", "2", "--resume")) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "trained 4 steps, more than training.steps (--steps) 2" in err and "--steps 4" in err
    assert not (out / "calm" / "metrics.json").exists()
    assert cli.main(_calibrate_argv(tiny_model_dir, out, "--steps", "4", "--resume")) == 0
    err = capsys.readouterr().err
    assert "[calm] resuming from step 4 (checkpoint " in err and "ckpt-00000004" in err


@pytest.fixture
def fresh_model():
    """A tiny model of its own: loading a saved result puts LoRA on the model in place."""
    from llm_calib.models import tiny_random_model

    return tiny_random_model(seed=0, init_std=0.1)[0]


def test_truncated_saved_result_is_named(run, fresh_model):
    from llm_calib.calm.trainer import CalibrationResult

    src = run[0] / "calm"
    damaged = Path(str(src) + "_damaged")
    shutil.copytree(src, damaged)
    (damaged / "metrics.json").write_text('{"metrics": {"bef')
    with pytest.raises(ValueError, match=r"metrics.json: not valid JSON"):
        CalibrationResult.load(damaged, fresh_model)


def test_result_save_is_atomic(run, fresh_model, tmp_path, monkeypatch):
    """A save cut short (a full disk while writing λ) leaves no metrics.json, the mark of a finished
    result that --resume trusts, and no temporary file; a failed adapter write leaves no adapter/."""
    import errno

    import safetensors.torch

    from llm_calib.calm.trainer import CalibrationResult

    result = CalibrationResult.load(run[0] / "calm", fresh_model)
    target = tmp_path / "calm"
    result.save(target)
    assert (target / "metrics.json").is_file()

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", full)
    with pytest.raises(OSError, match="No space"):
        result.save(target)
    assert not (target / "metrics.json").exists()
    assert not [p for p in target.iterdir() if p.name.startswith(".")]
    monkeypatch.undo()
    monkeypatch.setattr(type(result.model), "save_pretrained", full)
    fresh = tmp_path / "fresh"
    with pytest.raises(OSError, match="No space"):
        result.save(fresh)
    assert sorted(p.name for p in fresh.iterdir()) == []  # no adapter/, no temporary folder


# --------------------------------------------------------------------------- export and adapters

def test_export_refuses_the_base_folder_before_loading(run, tiny_model_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(cli_export, "load_base_model", _no_loading)
    base = tmp_path / "victim"
    shutil.copytree(tiny_model_dir, base)
    weights = (base / "model.safetensors").read_bytes()
    rc = cli.main(["export", str(run[0] / "calm"), "--model", str(base), "--out", str(base), "--quiet",
                   "--allow-other-base"])
    assert rc == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "base model's folder" in err
    assert (base / "model.safetensors").read_bytes() == weights
    other = tmp_path / "notes"
    other.mkdir()
    (other / "keep.txt").write_text("mine")
    assert cli.main(["export", str(run[0] / "calm"), "--out", str(other), "--quiet"]) == 2
    assert "--overwrite" in capsys.readouterr().err and (other / "keep.txt").exists()


def test_export_overwrite_replaces_a_non_empty_folder(run, tmp_path):
    other = tmp_path / "notes"
    other.mkdir()
    (other / "keep.txt").write_text("mine")
    assert cli.main(["export", str(run[0] / "calm"), "--out", str(other), "--quiet", "--overwrite"]) == 0
    assert not (other / "keep.txt").exists() and (other / "llm_calib_export.json").is_file()
    from llm_calib.files.atomic import read_json

    assert "prompt" in read_json(other / "llm_calib_export.json")


def test_adapter_on_another_base_is_refused(run, tiny_model_dir, tmp_path, monkeypatch, capsys):
    from llm_calib.models import tiny_random_model

    other = tmp_path / "other_base"  # the tiny model's shape, other weights (an exact copy is the same base)
    model, tok = tiny_random_model(seed=1, init_std=0.1)
    model.save_pretrained(other)
    tok.save_pretrained(other)
    adapter = str(run[0] / "calm")

    def reached_loading(*args, **kwargs):
        raise ValueError("reached loading")

    monkeypatch.setattr(cli_evaluate, "load_base_model", reached_loading)
    monkeypatch.setattr(cli_export, "load_base_model", reached_loading)
    for argv in (["evaluate", "--adapter", adapter, "--model", str(other), "--data", EVAL, "--quiet",
                  "--out", str(tmp_path / "e")],
                 ["export", adapter, "--model", str(other), "--out", str(tmp_path / "m"), "--quiet"]):
        assert cli.main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "was trained on" in err and "--allow-other-base" in err, err
        with pytest.raises(ValueError, match="reached loading"):
            cli.main([*argv, "--allow-other-base"])


def test_truncated_base_record_is_one_line(run, tmp_path, capsys):
    result = _copy(run[0] / "calm", tmp_path)
    (result / "base_model.json").write_text('{"model": "/tm')
    assert cli.main(["evaluate", "--adapter", str(result), "--data", EVAL, "--quiet", "--out",
                     str(tmp_path / "e")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "base_model.json: not valid JSON" in err


# --------------------------------------------------------------------------- damaged models

def _damaged_models(tiny_model_dir: Path, tmp_path: Path) -> dict[str, Path]:
    no_config = tmp_path / "no_config"
    shutil.copytree(tiny_model_dir, no_config)
    (no_config / "config.json").unlink()
    fake_gguf = tmp_path / "model.gguf"
    fake_gguf.write_bytes(b"this is no gguf")
    not_a_model = tmp_path / "notes.txt"
    not_a_model.write_text("hello")
    truncated = tmp_path / "truncated"
    shutil.copytree(tiny_model_dir, truncated)
    weights = truncated / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    return {"a folder without config.json": no_config, "not a GGUF file": fake_gguf, "a file, not a model": not_a_model,
            "cannot be loaded": truncated}


def test_damaged_model_is_one_line_naming_it(tiny_model_dir, tmp_path, capsys):
    for message, path in _damaged_models(tiny_model_dir, tmp_path).items():
        assert cli.main(["evaluate", "--model", str(path), "--data", EVAL, "--quiet",
                         "--out", str(tmp_path / "e")]) == 2, message
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and f"--model {path}: " in err and message in err, err


# --------------------------------------------------------------------------- flags

@pytest.mark.parametrize("flag", ["--lam-lr", "--lr", "--bome-eta", "--output-scale-lr"])
@pytest.mark.parametrize("value", ["inf", "nan"])
def test_numeric_flags_must_be_finite(flag, value, tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["calibrate", "--train", "builtin", "--heldout", "builtin", "--eval", "builtin",
                  "--out", str(tmp_path), flag, value])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert flag in err and f"expected a finite number, got {value!r}" in err


def test_config_file_numbers_must_be_finite(tmp_path, capsys):
    config = tmp_path / "c.yaml"
    config.write_text("objective: {name: calm, lam_lr: .inf}\n")
    assert cli.main(["calibrate", "--train", "builtin", "--heldout", "builtin", "--eval", "builtin",
                     "--out", str(tmp_path / "o"), "--config", str(config)]) == 2
    assert "objective.lam_lr must be a finite number" in capsys.readouterr().err


def test_config_file_duplicate_key_is_an_error(tmp_path, capsys):
    config = tmp_path / "c.yaml"
    config.write_text("training:\n  steps: 60\n  lr: 0.1\n  steps: 6\n")
    assert cli.main(["calibrate", "--train", "builtin", "--heldout", "builtin", "--eval", "builtin",
                     "--out", str(tmp_path / "o"), "--config", str(config)]) == 2
    assert "c.yaml:4: duplicate key 'steps' (first at line 2)" in capsys.readouterr().err


def test_unknown_lora_target_module_fails_before_training(tiny_model_dir, tmp_path, monkeypatch, capsys):
    def no_training(*args, **kwargs):
        raise AssertionError("training started")

    monkeypatch.setattr("llm_calib.evaluation.compare.run_comparison", no_training)
    assert cli.main(_calibrate_argv(tiny_model_dir, tmp_path / "o", "--lora-target-modules", "q_proj,foo_proj")) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--lora-target-modules foo_proj: LlamaForCausalLM has no such linear module" in err
    assert "q_proj" in err and "down_proj" in err


def test_metrics_on_a_folder_lists_its_samples_files(tmp_path, capsys):
    (tmp_path / "samples_arc_easy_2024.jsonl").write_text("")
    assert cli.main(["metrics", str(tmp_path), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "is a folder, not a samples file" in err and "samples_arc_easy_2024.jsonl" in err


def test_too_little_free_space_fails_before_loading(tiny_model_dir, tmp_path, monkeypatch, capsys):
    import collections

    import llm_calib.files.outputs

    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(llm_calib.files.outputs.shutil, "disk_usage", lambda path: usage(10**9, 10**9 - 1000, 1000))
    monkeypatch.setattr(cli_calibrate, "load_base_model", _no_loading)
    assert cli.main(_calibrate_argv(tiny_model_dir, tmp_path / "o")) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "free on its disk, the run writes about" in err
