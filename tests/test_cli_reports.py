"""Issue 31, points 2, 5, 7, 8 and 9: what a run says when it keeps the initial model, what the
reports show, lm-eval-friendly --limit defaults, quiet mode and named progress bars, and empty
splits at every entry point (Python and the command line, on the tiny model)."""

from __future__ import annotations

import json
import re
import warnings

import pytest
from _rows import ROWS
from transformers.utils import logging as hf_logging

import llm_calib
from llm_calib import cli
from llm_calib.calm.training import selection_note, warn_small_heldout
from llm_calib.config.calibration import (
    CalibrationConfig,
    LoraSettings,
    SelectionSettings,
    TrainingSettings,
)
from llm_calib.data import builtin_multiple_choice
from llm_calib.evaluation.evaluate import evaluate_records
from llm_calib.models import tiny_random_model

TRAIN = "builtin:arithmetic,capitals:n=4"
HELDOUT = "builtin:arithmetic,capitals:n=4,seed=1"
EVAL = "builtin:capitals:n=4,seed=2"


@pytest.fixture()
def jsonl_file(tmp_path):
    path = tmp_path / "toy.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return f"jsonl:{path}"


@pytest.fixture()
def bars_on():
    """transformers' progress bars on for the test (quiet runs turn them off process-wide)."""
    hf_logging.enable_progress_bar()
    yield
    hf_logging.enable_progress_bar()


def _cfg(frozen: bool = False):
    """Two steps, evaluated after each; ``frozen``: learning rates below float32 resolution, so
    the deployed model never changes and no evaluation beats the initial ECE."""
    lr = {"lr": 1e-30} if frozen else {}
    return CalibrationConfig(training=TrainingSettings(steps=2, batch_size=2, heldout_batch_size=2, **lr),
                             lora=LoraSettings(output_scale_lr=1e-30 if frozen else 3e-2),
                             selection=SelectionSettings(eval_every=1))


# --------------------------------------------------------------------------- 9: empty splits

@pytest.mark.parametrize(("split", "needle"), [
    ("train", "the training set (train) is empty"),
    ("heldout", "the held-out set (heldout) is empty"),
    ("unlabeled", "the unlabelled set (unlabeled) is empty"),
])
def test_calibrate_names_the_empty_split(split, needle):
    model, tok = tiny_random_model()
    qs = builtin_multiple_choice(n_per_domain=6, domains=["capitals"])
    sets = {"train": qs[:3], "heldout": qs[3:], "unlabeled": None}
    sets[split] = qs[6:]  # the empty slice of the issue
    with pytest.raises(ValueError, match=re.escape(needle)):
        llm_calib.calibrate(model, tok, sets["train"], sets["heldout"], _cfg(), unlabeled=sets["unlabeled"],
                            progress=False)


def test_warn_small_heldout_names_an_empty_heldout_set():
    with pytest.raises(ValueError, match=re.escape("the held-out set (heldout) is empty")):
        warn_small_heldout(0, CalibrationConfig().selection)


def test_evaluate_names_the_empty_set_before_scoring_anything(tiny):
    model, tok = tiny
    qs = builtin_multiple_choice(n_per_domain=2, domains=["capitals"])
    with pytest.raises(ValueError, match="evaluation set 'empty' \\(eval\\) is empty"):
        evaluate_records(model, tok, [("full", qs), ("empty", [])], ci=False, temperature_fit=("fit", qs),
                         progress=False)


@pytest.mark.parametrize(("flag", "needle"), [
    ("--train", "--train {}: no records (the training set is empty)"),
    ("--heldout", "--heldout {}: no records (the held-out set is empty)"),
    ("--eval", "--eval {}: no records (the evaluation set is empty)"),
    ("--unlabeled", "--unlabeled {}: no records (the unlabelled set is empty)"),
])
def test_cli_calibrate_names_the_empty_split(flag, needle, tiny_model_dir, tmp_path, capsys):
    (tmp_path / "empty.jsonl").write_text("")
    empty = f"jsonl:{tmp_path / 'empty.jsonl'}"
    sets = {"--train": TRAIN, "--heldout": HELDOUT, "--eval": EVAL}
    argv = ["calibrate", "--model", str(tiny_model_dir), "--steps", "1", "--no-progress", "--out", str(tmp_path / "o")]
    for name, spec in sets.items():
        argv += [name, empty if name == flag else spec]
    if flag == "--unlabeled":
        argv += ["--unlabeled", empty]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert needle.format(empty) in err
    assert "Traceback" not in err


def test_cli_evaluate_names_the_empty_set(tiny_model_dir, tmp_path, capsys):
    (tmp_path / "empty.jsonl").write_text("")
    argv = ["evaluate", "--model", str(tiny_model_dir), "--quiet", "--out", str(tmp_path / "o"), "--data",
            f"jsonl:{tmp_path / 'empty.jsonl'}"]
    assert cli.main(argv) == 2
    assert "(the evaluation set is empty)" in capsys.readouterr().err


# --------------------------------------------------------------------------- 2: step 0 kept, said

def test_selection_note_says_why_and_what_to_try():
    cfg = CalibrationConfig()
    hist = [{"step": 0, "loss": 1.0}, {"step": 3, "heldout_accuracy": 0.542, "heldout_ece": 0.1},
            {"step": 6, "heldout_accuracy": 0.5, "heldout_ece": 0.05}]
    note = selection_note(hist, {"accuracy": 0.583, "ece": 0.2}, 0, cfg.selection)
    assert note.startswith("guard: held-out accuracy 0.542 < 0.554")
    assert "initial model was kept" in note and "--steps" in note and "--guard-accuracy" in note
    ok = [{"step": 3, "heldout_accuracy": 0.6, "heldout_ece": 0.25}]
    note = selection_note(ok, {"accuracy": 0.583, "ece": 0.2}, 0, cfg.selection)
    assert note.startswith("selection: no evaluation lowered the held-out ECE below the initial 0.200 (best 0.250 at step 3)")
    assert selection_note(ok, {"accuracy": 0.583, "ece": 0.3}, 3, cfg.selection) is None
    assert selection_note([{"step": 1, "loss": 1.0}], {"accuracy": 0.5, "ece": 0.2}, 0, cfg.selection) is None


def test_calibrate_warns_and_records_when_the_initial_model_is_kept(tmp_path):
    model, tok = tiny_random_model()
    qs = builtin_multiple_choice(n_per_domain=4, domains=["capitals"])
    cfg = _cfg(frozen=True)  # θ moves below float32 resolution: no evaluation beats the initial ECE
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        res = llm_calib.calibrate(model, tok, qs[:2], qs[2:], cfg, progress=False)
    assert res.metrics["after"]["selected_step"] == 0
    assert len(res.notes) == 1 and "the initial model was kept" in res.notes[0]
    assert any(str(w.message) == res.notes[0] for w in seen)
    res.save(tmp_path / "r")
    saved = json.loads((tmp_path / "r" / "metrics.json").read_text())
    assert saved["notes"] == res.notes
    assert saved["llm_calib_version"] == llm_calib.__version__


def test_cli_calibrate_says_and_marks_a_kept_initial_model(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "o"
    argv = ["calibrate", "--model", str(tiny_model_dir), "--train", TRAIN, "--heldout", HELDOUT, "--eval", EVAL,
            "--eval", "builtin:arithmetic:n=4,seed=2", "--steps", "2", "--lr", "1e-30", "--output-scale-lr", "1e-30", "--eval-every", "1",
            "--batch-size", "4", "--bootstrap", "0", "--no-progress", "--out", str(out)]
    assert cli.main(argv) == 0  # still a success
    err = capsys.readouterr().err
    assert "[calm] selection: no evaluation lowered the held-out ECE" in err
    report = (out / "report.md").read_text()
    assert "| 0 (initial model kept) |" in report
    assert "**calm: the initial model was kept.** selection: no evaluation lowered" in report
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["llm_calib_version"] == llm_calib.__version__
    assert metrics["training"]["calm"]["notes"]
    assert "| macro average |" in report  # two evaluated domains: an overall row
    assert json.loads((out / "calm" / "metrics.json").read_text())["llm_calib_version"] == llm_calib.__version__


# --------------------------------------------------------------------------- 5: reports, --version

def test_version_flag(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == f"llm-calib {llm_calib.__version__}"


def test_evaluate_report_shows_every_metric_an_overall_row_and_the_resolved_prompt(tiny_model_dir, tmp_path):
    out = tmp_path / "o"
    argv = ["evaluate", "--model", str(tiny_model_dir), "--quiet", "--bootstrap", "0", "--out", str(out),
            "--data", "builtin:capitals,arithmetic:n=4"]
    assert cli.main(argv) == 0
    report = (out / "report.md").read_text()
    metrics = json.loads((out / "metrics.json").read_text())
    for label in ("| ECE-15 |", "| class-wise ECE |", "| MCE |", "| mean entropy |", "| mean confidence |"):
        assert label in report, label
    unc = metrics["domains"]["capitals"]["uncalibrated"]
    assert f"| mean confidence | {unc['mean_confidence']:.3f} |" in report
    assert f"| ECE-15 | {unc['ece15']:.3f} |" in report
    avg = metrics["macro_average"]["uncalibrated"]
    assert f"| overall (mean of domains) | 8 | {avg['accuracy']:.3f} | {avg['ece']:.3f} |" in report
    assert metrics["llm_calib_version"] == llm_calib.__version__
    # the tiny tokenizer has a chat template, used by default: the report says so, not None
    assert metrics["config"]["prompt"]["chat_template"] is True
    assert "chat_template=True" in report and "chat_template=None" not in report
    assert cli.main([*argv, "--no-chat-template", "--out", str(tmp_path / "p")]) == 0
    assert "chat_template=False" in (tmp_path / "p" / "report.md").read_text()


def test_metrics_command_records_the_version(tmp_path, tiny_model_dir, jsonl_file):
    out = tmp_path / "e"
    assert cli.main(["evaluate", "--model", str(tiny_model_dir), "--quiet", "--bootstrap", "0", "--out", str(out),
                     "--data", str(jsonl_file), "--log-samples"]) == 0
    assert json.loads((out / "metrics.json").read_text())["llm_calib_version"] == llm_calib.__version__


# --------------------------------------------------------------------------- 7: lm-eval defaults

def _ids(out):
    return [json.loads(line)["id"] for line in (out / "samples.jsonl").read_text().splitlines()]


def test_lm_eval_preset_defaults_to_the_first_n_and_limit_spares_the_temperature_fit(tiny_model_dir, tmp_path,
                                                                                     jsonl_file):
    def run(out, *extra):
        argv = ["evaluate", "--model", str(tiny_model_dir), "--quiet", "--bootstrap", "0", "--out", str(out),
                "--data", str(jsonl_file), "--limit", "3", "--log-samples", "--temperature-fit", str(jsonl_file),
                *extra]
        assert cli.main(argv) == 0
        return json.loads((out / "metrics.json").read_text())

    first = run(tmp_path / "lm", "--prompt-preset", "lm_eval_arc")
    assert first["config"]["limit_mode"] == "first"
    explicit = run(tmp_path / "first", "--limit-mode", "first")
    assert _ids(tmp_path / "lm") == _ids(tmp_path / "first")
    plain = run(tmp_path / "plain")
    assert plain["config"]["limit_mode"] == "sample"
    assert explicit["config"]["limit_mode"] == "first"
    sampled = run(tmp_path / "sampled", "--prompt-preset", "lm_eval_arc", "--limit-mode", "sample")
    assert sampled["config"]["limit_mode"] == "sample"
    assert len(_ids(tmp_path / "lm")) == 3
    assert first["temperature"]["n"] == len(ROWS)  # --limit 3 does not shrink the temperature fit


# --------------------------------------------------------------------------- 8: quiet, named bars

def test_evaluate_bars_name_their_split_and_quiet_silences_transformers(bars_on, tiny_model_dir, tmp_path,
                                                                       jsonl_file, capsys):
    argv = ["evaluate", "--model", str(tiny_model_dir), "--bootstrap", "0", "--data", str(jsonl_file),
            "--temperature-fit", "builtin:capitals:n=2"]
    assert cli.main([*argv, "--out", str(tmp_path / "loud")]) == 0
    err = capsys.readouterr().err
    assert f"{jsonl_file}: option likelihood" in err
    assert "builtin:capitals:n=2 (temperature fit): option likelihood" in err
    assert "Loading weights" in err
    assert cli.main([*argv, "--no-progress", "--out", str(tmp_path / "quiet")]) == 0
    err = capsys.readouterr().err
    assert "Loading weights" not in err and "option likelihood" not in err


def test_export_quiet_silences_loading_and_writing_bars(bars_on, tiny_model_dir, tmp_path, capsys):
    model, tok = tiny_random_model()
    qs = builtin_multiple_choice(n_per_domain=4, domains=["capitals"])
    res = llm_calib.calibrate(model, tok, qs[:2], qs[2:], _cfg(), progress=False)
    res.save(tmp_path / "r")
    argv = ["export", str(tmp_path / "r"), "--model", str(tiny_model_dir)]
    assert cli.main([*argv, "--out", str(tmp_path / "loud")]) == 0
    err = capsys.readouterr().err
    assert "Loading weights" in err and "Writing model shards" in err
    assert cli.main([*argv, "--quiet", "--out", str(tmp_path / "quiet")]) == 0
    err = capsys.readouterr().err
    assert "Loading weights" not in err and "Writing model shards" not in err
