"""``llm-calib calibrate`` end to end on the tiny model saved to disk."""

from __future__ import annotations

import json
import math
import re

import _reference as ref
import numpy as np
import pytest

from llm_calib import cli
from llm_calib.calm.trainer import CalibrationResult
from llm_calib.data import load as load_data
from llm_calib.models import load as load_model
from llm_calib.prompts.templates import PromptFormat

TRAIN = "builtin:arithmetic,capitals:n=4"
HELDOUT = "builtin:arithmetic,capitals:n=4,seed=1"
EVALS = ["builtin:capitals:n=6,seed=2", "builtin:arithmetic:n=6,seed=2"]
CONFIG_YAML = """\
objective:
  name: calm
  lam_lr: 0.1
training:
  steps: 5             # overridden by --steps
  lr: 5e-3             # YAML 1.1 reads this as a string; still a number
  heldout_batch_size: 4
selection:
  eval_every: 1
  guard_accuracy: 0.0
lora:
  rank: 2
  layers: [1]
"""


def _argv(model_dir, out, *extra):
    argv = ["calibrate", "--model", str(model_dir), "--train", TRAIN, "--heldout", HELDOUT]
    for spec in EVALS:
        argv += ["--eval", spec]
    return [*argv, "--out", str(out), *extra]


@pytest.fixture(scope="module")
def run(tiny_model_dir, tmp_path_factory):
    """One CLI run with two methods, shared by the checks below."""
    tmp = tmp_path_factory.mktemp("cli_calibrate")
    config = tmp / "calm.yaml"
    config.write_text(CONFIG_YAML)
    out = tmp / "out"
    argv = _argv(tiny_model_dir, out, "--config", str(config), "--methods", "calm,lora_ce", "--steps", "2",
                 "--batch-size", "4", "--checkpoint-every", "1", "--bootstrap", "0", "--no-progress")
    assert cli.main(argv) == 0
    return out, config


def test_help_documents_every_flag(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["calibrate", "--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    sub = cli.build_parser()._subparsers._group_actions[0].choices["calibrate"]
    flags = [s for a in sub._actions for s in a.option_strings]
    for flag in ("--model", "--train", "--heldout", "--eval", "--out", "--config", "--methods", "--solver",
                 "--steps", "--batch-size", "--limit", "--seed", "--checkpoint-every", "--resume",
                 "--no-progress"):
        assert flag in flags and flag in text, flag
    for action in sub._actions:
        assert action.help, action.option_strings
    assert "torchrun" in text and "precedence" in text
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    commands = capsys.readouterr().out
    assert all(c in commands for c in ("evaluate", "calibrate", "demo"))


def test_outputs_exist_and_config_precedence(run):
    out, _ = run
    for method in ("calm", "lora_ce"):
        d = out / method
        for name in ("adapter/adapter_config.json", "lambda.safetensors", "config.json", "history.json", "metrics.json"):
            assert (d / name).stat().st_size > 0, (method, name)
        cfg = json.loads((d / "config.json").read_text())
        # defaults < config file < flags
        assert (cfg["objective"]["name"], cfg["training"]["steps"], cfg["training"]["batch_size"]) == (method, 2, 4)  # flags
        assert (cfg["training"]["lr"], cfg["lora"]["rank"], cfg["lora"]["layers"]) == (5e-3, 2, [1])  # file
        if method == "calm":
            assert cfg["objective"]["lam_lr"] == 0.1  # file
            assert cfg["objective"]["solver"]["name"] == "bome" and cfg["objective"]["max_bias"] == 10.0  # defaults
        else:
            assert cfg["objective"] == {"name": "lora_ce"}  # a baseline has no CALM settings
        assert [h["step"] for h in json.loads((d / "history.json").read_text())] == [1, 2]
        assert (out / "checkpoints" / method / "LATEST").read_text().strip() == "ckpt-00000002"
    for name in ("report.md", "metrics.json", "reliability_capitals.png", "reliability_arithmetic.png"):
        assert (out / name).stat().st_size > 0, name


def test_metrics_match_direct_scoring_and_the_report(run, tiny_model_dir):
    out, _ = run
    data = json.loads((out / "metrics.json").read_text())
    assert data["columns"] == ["uncalibrated", "temperature_scaled", "calm", "calm+temperature", "lora_ce",
                               "lora_ce+temperature"]
    assert list(data["domains"]) == ["capitals", "arithmetic"]
    # independently: one forward pass per option of the base model and of each saved result
    # reloaded from disk onto a fresh base; metrics by loops (tests/_reference.py)
    prompt = PromptFormat(style="cloze")
    model, tok = load_model(str(tiny_model_dir))
    fit = load_data(HELDOUT).records
    T = data["temperature"]["temperature"]
    ref.assert_minimises_nll(ref.option_log_likelihoods(model, tok, fit, prompt), [r.gold for r in fit], T)
    records = [r for spec in EVALS for r in load_data(spec).records]
    scorers = {"base": model}
    for method in ("calm", "lora_ce"):
        fresh, _ = load_model(str(tiny_model_dir))
        scorers[method] = CalibrationResult.load(out / method, fresh).model
    # each trained method's own temperature minimises the NLL of its held-out scores
    T_of = {m: data["method_temperatures"][m]["temperature"] for m in ("calm", "lora_ce")}
    for m, t in T_of.items():
        ref.assert_minimises_nll(ref.option_log_likelihoods(scorers[m], tok, fit, prompt), [r.gold for r in fit], t)
    for dom, d in data["domains"].items():
        cols = d["columns"]
        assert d["n"] == 6
        recs = [r for r in records if r.domain == dom]
        labels = [r.gold for r in recs]
        scores = {name: ref.option_log_likelihoods(m, tok, recs, prompt) for name, m in scorers.items()}
        for m in ("calm", "lora_ce"):  # a result is the base model exactly when step 0 was selected
            moved = float(np.abs(np.concatenate(scores[m]) - np.concatenate(scores["base"])).max())
            assert (moved > 1e-3) == (data["training"][m]["heldout_after"]["selected_step"] > 0), (m, moved)
        expected = {
            "uncalibrated": ref.summary(scores["base"], labels),
            "temperature_scaled": ref.summary(scores["base"], labels, T),
            "calm": ref.summary(scores["calm"], labels),
            "lora_ce": ref.summary(scores["lora_ce"], labels),
            "calm+temperature": ref.summary(scores["calm"], labels, T_of["calm"]),
            "lora_ce+temperature": ref.summary(scores["lora_ce"], labels, T_of["lora_ce"]),
        }
        assert not math.isnan(expected["uncalibrated"]["ece"])
        for col, exp in expected.items():
            ref.assert_matches(cols[col], exp, ("accuracy", "ece", "nll", "brier"), (dom, col))
            assert len(d["reliability"][col]["counts"]) == 10
    # the selected step is the evaluated step of lowest held-out ECE (step 0, the start, unless
    # one beats it; guard_accuracy is 0), and the reported held-out ECE is that step's
    history = json.loads((out / "calm" / "history.json").read_text())
    after = data["training"]["calm"]["heldout_after"]
    before = data["training"]["calm"]["heldout_before"]
    candidates = [(before["ece"], 0)] + [(h["heldout_ece"], h["step"]) for h in history]
    best_ece, best_step = min(candidates, key=lambda c: c[0])  # first on ties: strict improvement
    assert after["selected_step"] == best_step
    assert after["ece"] == pytest.approx(best_ece, abs=1e-12)

    report = (out / "report.md").read_text()
    for section in ("## Training", "## ECE per domain", "## Accuracy per domain", "## capitals", "## arithmetic"):
        assert section in report
    # the summary tables show exactly the numbers of metrics.json
    for metric, heading in (("ece", "## ECE per domain"), ("accuracy", "## Accuracy per domain")):
        table = report.split(heading)[1].split("\n## ")[0]
        for dom, d in data["domains"].items():
            row = next(line for line in table.splitlines() if line.startswith(f"| {dom} |"))
            cells = [c.strip() for c in row.strip("|").split("|")][2:]
            assert cells == [f"{d['columns'][c][metric]:.3f}" for c in data["columns"]], (metric, dom)
    # per-domain table: one column per method
    header = re.search(r"## capitals\n\n.*\n\n(\|.*\|)\n", report).group(1)
    assert header == ("| metric | uncalibrated | temperature-scaled | calm | calm + temperature | lora_ce | "
                      "lora_ce + temperature |")
    assert f"- calm + temperature: the trained model, then T = {T_of['calm']:.3f}" in report


def test_resume_reuses_finished_methods_and_rejects_a_changed_config(run, tiny_model_dir, capsys):
    out, config = run
    before = (out / "calm" / "adapter" / "adapter_model.safetensors").read_bytes()
    common = ["--config", str(config), "--methods", "calm", "--batch-size", "4", "--bootstrap", "0",
              "--no-progress", "--resume"]
    assert cli.main(_argv(tiny_model_dir, out, *common, "--steps", "2")) == 0
    data = json.loads((out / "metrics.json").read_text())
    assert data["methods"] == ["calm"] and data["training"]["calm"]["reused"] is True
    assert (out / "calm" / "adapter" / "adapter_model.safetensors").read_bytes() == before
    capsys.readouterr()
    assert cli.main(_argv(tiny_model_dir, out, *common, "--steps", "3")) == 2
    err = capsys.readouterr().err
    assert "different configuration" in err and "steps" in err and "Traceback" not in err


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--train", "nosuchloader:x"], "--train nosuchloader:x"),
        (["--eval", "builtin:capitals:n=oops"], "n and seed must be integers"),
        (["--heldout", "arc_easy:/does/not/exist.jsonl"], "does not exist"),
        (["--config", "{missing}"], "--config"),
        (["--config", "{bad_key}"], "learning_rate"),
        (["--config", "{bad_value}"], "objective.lam_lr"),
        (["--config", "{flat}"], "`lam_lr` is now `objective.lam_lr` (objective.name: calm)"),
    ],
)
def test_bad_input_is_a_one_line_error(args, needle, tiny_model_dir, tmp_path, capsys):
    (tmp_path / "bad_key.yaml").write_text("training: {steps: 2}\nlearning_rate: 0.1\n")
    (tmp_path / "bad_value.yaml").write_text("objective: {name: calm, lam_lr: -1}\n")
    (tmp_path / "flat.yaml").write_text("lam_lr: 0.1\n")
    args = [a.format(missing=tmp_path / "nope.yaml", bad_key=tmp_path / "bad_key.yaml",
                     bad_value=tmp_path / "bad_value.yaml", flat=tmp_path / "flat.yaml") for a in args]
    argv = _argv(tiny_model_dir, tmp_path / "out", "--no-progress", "--steps", "1")
    # later occurrences of --train/--heldout override the defaults; --eval appends
    assert cli.main([*argv, *args]) == 2
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    assert last.startswith("llm-calib: error:") and needle in last and "Traceback" not in err
    if "bad_key" in " ".join(args):
        assert "bad_key.yaml" in last
    assert not (tmp_path / "out" / "calm").exists()


def test_unknown_method_is_rejected_by_the_parser(tiny_model_dir, tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(_argv(tiny_model_dir, tmp_path / "out", "--methods", "calm,sft"))
    assert exc.value.code == 2
    assert "sft" in capsys.readouterr().err


def _write_open(path, start, n):
    rows = [{"question": f"What is {i} + 3?", "answer": [str(i + 3), f"{i + 3}.0"]} for i in range(start, start + n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return f"nq_open:{path}"


@pytest.mark.parametrize("examples", [None, (("What is 1 + 1?", "2"), ("Capital of Italy?", "Rome"))])
def test_open_ended_training_and_report(tiny_model_dir, tmp_path, examples):
    """Also with --open-examples: the evaluation sets are answered with the same short-answer prompt."""
    from llm_calib.confidence.token import open_ended_summary, score_open_ended
    from llm_calib.prompts.templates import PromptFormat, short_answer_format

    train, heldout, test = (_write_open(tmp_path / f"{name}.jsonl", start, 4)
                            for name, start in (("train", 0), ("dev", 10), ("test", 20)))
    out = tmp_path / "out"
    argv = ["calibrate", "--model", str(tiny_model_dir), "--train", train, "--heldout", heldout, "--eval", test,
            "--out", str(out), "--methods", "calm", "--steps", "1", "--batch-size", "4", "--bootstrap", "0",
            "--no-progress"]
    if examples:
        argv += ["--open-examples", json.dumps(examples)]
    fmt = short_answer_format(examples) if examples else PromptFormat()
    assert cli.main(argv) == 0
    data = json.loads((out / "metrics.json").read_text())
    assert data["config"]["train"]["kind"] == "open"
    dom = data["domains"]["nq_open"]
    assert dom["kind"] == "open" and dom["n"] == 4
    # the open domains have the temperature columns: T fitted to token confidence on the held-out answers
    assert data["columns"] == ["uncalibrated", "temperature_scaled", "calm", "calm+temperature"]
    assert data["temperature"]["criterion"] == "correctness_nll" and data["temperature"]["source"] == heldout
    assert data["method_temperatures"]["calm"]["criterion"] == "correctness_nll"
    assert dom["columns"]["temperature_scaled"] is not None and dom["columns"]["calm+temperature"] is not None
    report = (out / "report.md").read_text()
    domain_table = report[report.index("## nq_open"):]
    assert "| temperature-scaled |" in domain_table and "| calm + temperature |" in domain_table
    assert "fitted to token confidence (NLL of correctness)" in report
    # the calm column is the greedy open-ended scorer on the saved result
    model, tok = load_model(str(tiny_model_dir))
    loaded = CalibrationResult.load(out / "calm", model)
    ref = open_ended_summary(score_open_ended(loaded.model, tok, load_data(test).records, prompt=fmt), ci=False)
    for key in ("accuracy", "ece", "mean_confidence"):
        assert dom["columns"]["calm"][key] == pytest.approx(ref[key], abs=1e-6), key
    T = data["method_temperatures"]["calm"]["temperature"]
    ref = open_ended_summary(score_open_ended(loaded.model, tok, load_data(test).records, prompt=fmt, temperature=T),
                             ci=False)
    for key in ("accuracy", "ece", "mean_confidence"):  # the same answers, their token probabilities at T
        assert dom["columns"]["calm+temperature"][key] == pytest.approx(ref[key], abs=1e-6), key
    base_model = load_model(str(tiny_model_dir))[0]
    base = open_ended_summary(score_open_ended(base_model, tok, load_data(test).records, prompt=fmt), ci=False)
    assert dom["columns"]["uncalibrated"]["mean_confidence"] == pytest.approx(base["mean_confidence"], abs=1e-6)
    scaled = open_ended_summary(score_open_ended(base_model, tok, load_data(test).records, prompt=fmt,
                                                 temperature=data["temperature"]["temperature"]), ci=False)
    assert dom["columns"]["temperature_scaled"]["ece"] == pytest.approx(scaled["ece"], abs=1e-6)
    assert "trained on open questions" in (out / "report.md").read_text()


def test_mixed_kinds_are_a_one_line_error_naming_the_record(tiny_model_dir, tmp_path, capsys):
    heldout = _write_open(tmp_path / "dev.jsonl", 0, 2)
    argv = _argv(tiny_model_dir, tmp_path / "out", "--no-progress", "--steps", "1")
    assert cli.main([*argv, "--heldout", heldout]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("llm-calib: error: --heldout") and "record 'nq_open-1' is OpenQA" in last


def test_without_methods_only_calm_is_trained_and_the_baselines_are_reported(tiny_model_dir, tmp_path):
    out = tmp_path / "out"
    argv = _argv(tiny_model_dir, out, "--steps", "1", "--batch-size", "4", "--lora-rank", "2", "--lora-layers", "1",
                 "--bootstrap", "0", "--no-progress")
    assert cli.main(argv) == 0
    data = json.loads((out / "metrics.json").read_text())
    assert data["methods"] == ["calm"]
    assert data["columns"] == ["uncalibrated", "temperature_scaled", "calm", "calm+temperature"]
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == ["calm"]
    assert "| metric | uncalibrated | temperature-scaled | calm | calm + temperature |" in (out / "report.md").read_text()
