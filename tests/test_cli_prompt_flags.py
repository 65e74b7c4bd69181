"""Issue 31, one consistent CLI: ``calibrate`` and ``export`` take ``evaluate``'s prompt flags
(one builder), few-shot examples are the same in training, selection and evaluation, the saved
result records the prompt, and ``evaluate --adapter`` / ``export`` default to it (another prompt
warns)."""

from __future__ import annotations

import json
import warnings

import pytest
from _rows import ROWS

import llm_calib.scoring.base as scoring_base
import llm_calib.scoring.option_likelihood as option_likelihood
from llm_calib import cli
from llm_calib.calm.trainer import BASE_MODEL_FILE
from llm_calib.prompts.resolution import resolve_prompt_settings

warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)

SPEC = "builtin:capitals:n=4"
HELDOUT = "builtin:capitals:n=4,seed=1"
OTHER = "builtin:arithmetic:n=3"


def _sub(command: str):
    return cli.build_parser()._subparsers._group_actions[0].choices[command]


def _prompt_flags(command: str) -> set[str]:
    """The prompt flags of a subcommand: those of the shared builder's fields."""
    dests = {f"cfg:prompt.{f}" for f in cli.PROMPT_FIELDS} | set(cli.PROMPT_FIELDS) | {"prompt_preset", "prompt_style"}
    return {s for a in _sub(command)._actions if a.dest in dests for s in a.option_strings}


def test_the_three_commands_take_the_same_prompt_flags():
    want = {"--prompt-preset", "--template", "--target-delimiter", "--choices", "--fewshot", "--fewshot-split",
            "--fewshot-seed", "--fewshot-sampler", "--prompt-style", "--no-chat-template", "--system-message",
            "--answer-prefix"}
    for command in ("evaluate", "calibrate", "export"):
        assert _prompt_flags(command) - {"--chat-template"} == want, command


@pytest.mark.parametrize("flags", [
    [],
    ["--prompt-preset", "lm_eval_arc"],
    ["--prompt-preset", "lm_eval_arc", "--fewshot", "2", "--fewshot-split", "builtin:capitals:n=6",
     "--fewshot-sampler", "first_n", "--target-delimiter", "\\n"],
    ["--template", "Q: {question}\\nA:", "--no-chat-template", "--choices", "text", "--fewshot-seed", "7"],
    ["--system-message", "Be brief.", "--answer-prefix", "Answer:", "--prompt-style", "listed"],
])
def test_calibrate_builds_the_prompt_evaluate_builds(flags):
    """The same flags give the same PromptFormat in both commands (the pool aside)."""
    ev = cli.build_parser().parse_args(["evaluate", "--data", SPEC, "--out", "x", *flags])
    cal = cli.build_parser().parse_args(["calibrate", "--train", SPEC, "--heldout", SPEC, "--eval", SPEC,
                                         "--out", "x", *flags])
    config, _ = cli.calibration_config(cal)
    assert resolve_prompt_settings(config.prompt).prompt == cli.prompt_format(ev)


def test_no_chat_template_and_texts_reach_the_config():
    cal = cli.build_parser().parse_args(["calibrate", "--train", SPEC, "--heldout", SPEC, "--eval", SPEC, "--out",
                                         "x", "--no-chat-template", "--target-delimiter", "\\n", "--fewshot", "1",
                                         "--fewshot-split", SPEC])
    prompt = cli.calibration_config(cal)[0].prompt
    assert (prompt.chat_template, prompt.target_delimiter, prompt.fewshot, prompt.fewshot_split) == (False, "\n", 1, SPEC)


def test_fewshot_without_split_is_a_user_error(capsys, tmp_path):
    argv = ["calibrate", "--train", SPEC, "--heldout", SPEC, "--eval", SPEC, "--out", str(tmp_path), "--fewshot", "2"]
    assert cli.main(argv) == 2
    assert "fewshot_split" in capsys.readouterr().err


@pytest.fixture(scope="module")
def fewshot_split(tmp_path_factory):
    path = tmp_path_factory.mktemp("fewshot") / "shots.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return f"jsonl:{path}"


@pytest.fixture(scope="module")
def spied(tiny_model_dir, tmp_path_factory, fewshot_split):
    """A two-shot ``calibrate`` run (trained and evaluated on the same questions), then
    ``evaluate --adapter`` on them without prompt flags; every prompt text the option-likelihood
    encoder made, by question, in calls of training/selection/evaluation and of the evaluate run."""
    out = tmp_path_factory.mktemp("fewshot_run") / "run"
    seen: dict[str, list[str]] = {}
    real = option_likelihood.record_prompt

    def spy(tokenizer, record, fmt=None):
        text = real(tokenizer, record, fmt)
        seen.setdefault(record.question, []).append(text)
        return text

    mp = pytest.MonkeyPatch()
    mp.setattr(option_likelihood, "record_prompt", spy)
    mp.setattr(scoring_base, "record_prompt", spy)  # the prompt encoder (encode_prompts) the scorer calls
    try:
        argv = ["calibrate", "--model", str(tiny_model_dir), "--train", SPEC, "--heldout", HELDOUT, "--eval", SPEC,
                "--eval", OTHER, "--out", str(out), "--methods", "lora_ce", "--steps", "1", "--batch-size", "2", "--lora-rank", "2",
                "--bootstrap", "0", "--no-progress", "--threads", "1", "--prompt-preset", "lm_eval_arc",
                "--fewshot", "2", "--fewshot-split", fewshot_split]
        assert cli.main(argv) == 0
        calibrate_calls = {k: len(v) for k, v in seen.items()}
        ev = out.parent / "ev"
        assert cli.main(["evaluate", "--adapter", str(out / "lora_ce"), "--data", SPEC, "--out", str(ev),
                         "--bootstrap", "0", "--quiet", "--log-samples"]) == 0
    finally:
        mp.undo()
    return out, ev, seen, calibrate_calls


def test_training_prompts_are_the_evaluation_prompts_under_fewshot(spied):
    _, ev, seen, calibrate_calls = spied
    samples = [json.loads(line) for line in (ev / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 4
    for s in samples:
        question = next(q for q in seen if q in s["prompt"].rsplit("Question: ", 1)[1])
        texts = seen[question]
        # encoded for training (train set), scored for the report twice (base, method) in calibrate,
        # then once more by evaluate --adapter: one text throughout
        assert calibrate_calls[question] >= 3 and len(texts) > calibrate_calls[question]
        assert set(texts) == {s["prompt"]}, question
        assert s["prompt"].count("Question: ") == 3  # two examples and the question (lm_eval_arc)
        assert any(r["question"] in s["prompt"] for r in ROWS)  # the examples come from the split


def test_saved_result_records_the_fewshot_prompt_and_evaluate_defaults_to_it(spied, fewshot_split):
    out, ev, _, _ = spied
    rec = json.loads((out / "lora_ce" / BASE_MODEL_FILE).read_text())["prompt"]
    assert (rec["fewshot"], rec["fewshot_split"], rec["fewshot_pool_size"]) == (2, fewshot_split, len(ROWS))
    assert rec["template"] == "Question: {question}\nAnswer:"
    used_config = json.loads((ev / "metrics.json").read_text())["config"]
    assert used_config["limit_mode"] == "first"  # the recorded lm_eval_* preset's default, as in training
    used = used_config["prompt"]
    assert (used["fewshot"], used["fewshot_split"], used["template"]) == (2, fewshot_split, rec["template"])
    assert json.loads((out / "metrics.json").read_text())["config"]["prompt"]["fewshot"] == 2


def test_evaluate_with_other_fewshot_warns(spied, tmp_path, capsys):
    out, _, _, _ = spied
    assert cli.main(["evaluate", "--adapter", str(out / "lora_ce"), "--data", SPEC, "--out", str(tmp_path / "ev"),
                     "--bootstrap", "0", "--quiet", "--fewshot", "1"]) == 0
    err = capsys.readouterr().err
    assert "another prompt" in err and "fewshot: trained 2, now 1" in err
    assert cli.main(["evaluate", "--adapter", str(out / "lora_ce"), "--data", SPEC, "--out", str(tmp_path / "ev2"),
                     "--bootstrap", "0", "--quiet", "--normalize", "char"]) == 0
    assert "normalize: trained 'sum', now 'char'" in capsys.readouterr().err


def test_export_records_the_prompt_and_warns_on_another(spied, tmp_path, capsys):
    out, _, _, _ = spied
    assert cli.main(["export", str(out / "lora_ce"), "--out", str(tmp_path / "m"), "--quiet"]) == 0
    assert "warning" not in capsys.readouterr().err
    rec = json.loads((tmp_path / "m" / "llm_calib_export.json").read_text())
    assert rec["prompt"]["fewshot"] == 2 and rec["prompt"]["template"] == "Question: {question}\nAnswer:"
    assert (rec["scorer"], rec["normalize"]) == ("option_likelihood", "sum")
    assert cli.main(["export", str(out / "lora_ce"), "--out", str(tmp_path / "m2"), "--quiet",
                     "--prompt-preset", "default"]) == 0
    assert "exporting --adapter" in capsys.readouterr().err


def test_evaluate_merged_model_uses_the_prompt_it_was_trained_with(spied, tmp_path, capsys):
    """``evaluate --model MERGED`` (an ``export``) scores under the recorded prompt, as ``evaluate
    --adapter`` does, says so, and lets explicit prompt flags win (with the warning)."""
    out, ev, _, _ = spied
    merged = tmp_path / "m"
    assert cli.main(["export", str(out / "lora_ce"), "--out", str(merged), "--quiet"]) == 0
    assert json.loads((merged / "llm_calib_export.json").read_text())["prompt_preset"] == "lm_eval_arc"
    capsys.readouterr()
    argv = ["evaluate", "--model", str(merged), "--data", SPEC, "--bootstrap", "0", "--threads", "1"]
    assert cli.main([*argv, "--out", str(tmp_path / "e")]) == 0
    err = capsys.readouterr().err
    assert f"prompt: the one --model {merged} was trained with\n" in err and "warning" not in err
    used = json.loads((tmp_path / "e" / "metrics.json").read_text())["config"]
    with_adapter = json.loads((ev / "metrics.json").read_text())["config"]
    assert used["prompt"] == with_adapter["prompt"] and used["prompt"]["fewshot"] == 2
    assert used["limit_mode"] == "first"  # the recorded lm_eval_* preset's default, as with --adapter
    assert cli.main([*argv, "--out", str(tmp_path / "e1"), "--fewshot", "1"]) == 0
    err = capsys.readouterr().err
    assert f"prompt: the one --model {merged} was trained with, changed by the prompt flags (fewshot)" in err
    assert f"evaluating --model {merged} with another prompt" in err and "fewshot: trained 2, now 1" in err
    used = json.loads((tmp_path / "e1" / "metrics.json").read_text())["config"]["prompt"]
    assert (used["fewshot"], used["template"]) == (1, with_adapter["prompt"]["template"])
    assert cli.main([*argv, "--out", str(tmp_path / "e2"), "--prompt-preset", "default"]) == 0
    assert f"prompt: --prompt-preset default instead of the one --model {merged} was trained with" in (
        capsys.readouterr().err)


def test_calibrate_report_shows_every_metric_the_prompt_and_an_overall_table(spied):
    """calibrate's report.md: the metrics of evaluate's domain tables (report.REPORT_METRICS) for
    every column, the resolved prompt, and an overall table (mean of the domains)."""
    from llm_calib.evaluation.report import METRIC_LABELS, REPORT_METRICS, format_metric

    out = spied[0]
    report = (out / "report.md").read_text()
    metrics = json.loads((out / "metrics.json").read_text())
    assert set(metrics["domains"]) == {"capitals", "arithmetic"}
    sections = {s.split("\n", 1)[0]: s for s in report.split("\n## ")}
    for title in ("capitals", "arithmetic", "overall (mean of domains)"):
        rows = [line for line in sections[title].splitlines() if line.startswith("| ")]
        assert [r.split(" | ")[0][2:] for r in rows[1:]] == [METRIC_LABELS[m] for m in REPORT_METRICS], title
        assert rows[0] == "| metric | uncalibrated | temperature-scaled | lora_ce | lora_ce + temperature |"
    # the overall row of a metric is the mean of the domains' values
    cols = [metrics["domains"][d]["columns"]["uncalibrated"] for d in ("capitals", "arithmetic")]
    mean_mce = {"mce": (cols[0]["mce"] + cols[1]["mce"]) / 2}
    mce_row = next(r for r in sections["overall (mean of domains)"].splitlines() if r.startswith("| MCE |"))
    assert mce_row.split(" | ")[1] == format_metric(mean_mce, "mce")
    prompt = next(line for line in report.splitlines() if line.startswith("- prompt: "))
    assert "fewshot=2" in prompt and "chat_template=False" in prompt and "Question: {question}" in prompt


def test_calibrate_report_names_the_preset_prompt_it_used(spied):
    """The scorer line of a run under --prompt-preset lm_eval_arc names that prompt, not 'cloze prompt'."""
    report = (spied[0] / "report.md").read_text()
    assert "- scorer: `option_likelihood` (sum, lm_eval_arc prompt)" in report


@pytest.mark.parametrize(("prompt", "scorer", "style", "named"), [
    ({}, "option_likelihood", "cloze", "cloze prompt"),
    ({"scorer": "letter"}, "letter", "listed", "listed prompt"),
    ({"preset": "default"}, "option_likelihood", "cloze", "cloze prompt"),
    ({"preset": "lm_eval_mmlu"}, "option_likelihood", "cloze", "lm_eval_mmlu prompt"),
    ({"template": "Q: {question}\\nA:"}, "option_likelihood", "cloze", "own-template prompt"),
    ({"preset": "lm_eval_arc", "template": "Q: {question}\\nA:"}, "option_likelihood", "cloze", "own-template prompt"),
])
def test_comparison_report_names_the_prompt_kind(prompt, scorer, style, named):
    """The scorer line follows the prompt of the run's settings (``prompt_style`` as run_comparison
    records it: listed for the letter scorer)."""
    from llm_calib.config.calibration import CalibrationConfig
    from llm_calib.evaluation.compare import Comparison, comparison_markdown

    cfg = {"train": {"spec": "t", "n": 2}, "heldout": {"spec": "h", "n": 2}, "eval": ["e"], "timings": {},
           "calibration": CalibrationConfig.from_dict({"prompt": prompt}).to_dict(),
           "evaluation": {"scorer": scorer, "normalize": "sum", "prompt_style": style, "n_bins": 10, "bootstrap": 0}}
    report = comparison_markdown(Comparison([], {}, None, {}, cfg, {}))
    assert f"- scorer: `{scorer}` (sum, {named})" in report


def test_a_relative_fewshot_split_is_recorded_absolute(tiny_model_dir, tmp_path, monkeypatch, capsys):
    """calibrate run in one directory with a relative --fewshot-split, evaluate --adapter from
    another: the same split; once it is gone, the error names the record and its field."""
    project = tmp_path / "project"
    (project / "data").mkdir(parents=True)
    shots = project / "data" / "shots.jsonl"
    shots.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    monkeypatch.chdir(project)
    argv = ["calibrate", "--model", str(tiny_model_dir), "--train", SPEC, "--heldout", HELDOUT, "--eval", SPEC,
            "--out", "run", "--methods", "lora_ce", "--steps", "1", "--batch-size", "2", "--lora-rank", "2",
            "--bootstrap", "0", "--no-progress", "--threads", "1", "--fewshot", "2", "--fewshot-split",
            "jsonl:data/shots.jsonl"]
    assert cli.main(argv) == 0
    result = project / "run" / "lora_ce"
    for recorded in (json.loads((result / BASE_MODEL_FILE).read_text())["prompt"],
                     json.loads((result / "config.json").read_text())["prompt"]):
        assert recorded["fewshot_split"] == f"jsonl:{shots}"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    evaluate = ["evaluate", "--adapter", str(result), "--data", SPEC, "--bootstrap", "0", "--quiet", "--threads", "1"]
    assert cli.main([*evaluate, "--out", "ev"]) == 0
    used = json.loads((elsewhere / "ev" / "metrics.json").read_text())["config"]["prompt"]
    assert (used["fewshot_split"], used["fewshot_pool_size"]) == (f"jsonl:{shots}", len(ROWS))
    # evaluate records a relative --fewshot-split absolute too
    assert cli.main([*evaluate, "--out", "ev1", "--fewshot-split", "jsonl:../project/data/shots.jsonl"]) == 0
    assert json.loads((elsewhere / "ev1" / "metrics.json").read_text())["config"]["prompt"]["fewshot_split"] == (
        f"jsonl:{shots}")
    shots.unlink()
    capsys.readouterr()
    assert cli.main([*evaluate, "--out", "ev2"]) == 2
    err = capsys.readouterr().err
    assert f"{result / BASE_MODEL_FILE}: prompt.fewshot_split: spec 'jsonl:{shots}'" in err and "does not exist" in err
