"""``--preset paper`` and the instruction-data lower level (issue #29, point 4)."""

from __future__ import annotations

import json

import pytest

from llm_calib import cli
from llm_calib.calm.run import run_formats
from llm_calib.config.calibration import (
    CONFIG_PRESETS,
    PAPER_LORA_MODULES,
    CalibrationConfig,
    apply_preset,
)
from llm_calib.data import OpenQA, builtin_multiple_choice
from llm_calib.data import load as load_data
from llm_calib.data.errors import DataError
from llm_calib.data.jsonl import load_jsonl
from llm_calib.prompts.resolution import resolve_prompt_settings

HELDOUT = "builtin:capitals:n=8,seed=1"
UNLABELED = "builtin:arithmetic:n=8,seed=3"
EVAL = "builtin:capitals:n=6,seed=2"


def _config(*flags: str) -> CalibrationConfig:
    args = cli.build_parser().parse_args(["calibrate", "--train", "builtin", "--heldout", "builtin", "--eval",
                                          "builtin", "--out", "x", *flags])
    return cli.calibration_config(args)[0]


def _write_instructions(path, n: int, alpaca: bool = False) -> str:
    rows = ({"instruction": f"Say the number {i}.", "input": "" if i % 2 else "please", "output": str(i)} if alpaca
            else {"prompt": f"Say the number {i}.", "response": str(i)} for i in range(n))
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return f"jsonl:{path}"


def test_the_paper_preset_resolves_to_the_documented_values():
    cfg = _config("--preset", "paper")
    assert cfg.preset == "paper"
    assert (cfg.objective.name, cfg.objective.solver.name, cfg.objective.adjustment) == ("calm", "bome", "vector")
    lora = cfg.lora
    assert (lora.rank, lora.alpha, lora.target_modules, lora.layers, lora.top_layers, lora.output_scale) == (
        64, 32.0, PAPER_LORA_MODULES, None, None, False)
    assert lora.layer_indices(30) is None  # every decoder layer
    assert set(PAPER_LORA_MODULES) == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    assert (cfg.training.epochs, cfg.training.batch_size, cfg.training.heldout_batch_size) == (5, 16, 16)
    assert (cfg.prompt.scorer, cfg.prompt.style) == ("letter", "listed")
    # the Python API and a config file's `preset:` give the same configuration
    assert CalibrationConfig.from_dict({"preset": "paper"}) == cfg
    assert CalibrationConfig.from_dict(cfg.to_dict()) == cfg
    # five epochs of 16: 40 questions are 3 batches an epoch
    assert cfg.resolved(40).training.steps == 15 and cfg.resolved(16).training.steps == 5
    assert _config().preset is None and _config().training.epochs is None


def test_explicit_flags_override_the_preset(tmp_path):
    cfg = _config("--preset", "paper", "--lora-rank", "8", "--epochs", "1", "--adjustment", "auto", "--solver", "f2sa",
                  "--scorer", "option_likelihood", "--prompt-style", "cloze")
    assert (cfg.lora.rank, cfg.lora.alpha, cfg.training.epochs, cfg.training.batch_size) == (8, 32.0, 1, 16)
    assert (cfg.objective.adjustment, cfg.objective.solver.name, cfg.prompt.scorer, cfg.prompt.style) == (
        "auto", "f2sa", "option_likelihood", "cloze")
    steps = _config("--preset", "paper", "--steps", "3")  # an explicit budget replaces the preset's epochs
    assert (steps.training.steps, steps.training.epochs, steps.resolved(100).training.steps) == (3, None, 3)
    config = tmp_path / "run.yaml"
    config.write_text("preset: paper\nlora: {rank: 4}\ntraining: {batch_size: 8}\n")
    from_file = _config("--config", str(config), "--lora-alpha", "8")
    assert (from_file.preset, from_file.lora.rank, from_file.lora.alpha, from_file.training.batch_size,
            from_file.training.epochs) == ("paper", 4, 8.0, 8, 5)
    with pytest.raises(ValueError, match=r"preset must be one of \('paper',\)"):
        apply_preset({"preset": "papper"})
    with pytest.raises(SystemExit):
        _config("--preset", "papper")
    assert set(CONFIG_PRESETS) == {"paper"}


def test_instruction_jsonl_loads_prompt_response_and_alpaca_rows(tmp_path):
    records = load_data(_write_instructions(tmp_path / "chat.jsonl", 3)).records
    assert [(r.question, r.answers) for r in records] == [(f"Say the number {i}.", (str(i),)) for i in range(3)]
    alpaca = load_data(_write_instructions(tmp_path / "alpaca.jsonl", 2, alpaca=True)).records
    assert [r.question for r in alpaca] == ["Say the number 0.\n\nplease", "Say the number 1."]
    assert all(isinstance(r, OpenQA) and r.domain == "alpaca" for r in alpaca)


@pytest.mark.parametrize("row, field, reason", [
    ({"prompt": "Hi."}, "response", "missing response"),
    ({"response": "Hi."}, "prompt", "missing prompt"),
    ({"prompt": ["Hi."], "response": "Hello."}, "prompt", "expected a string, got list"),
    ({"prompt": "Hi.", "response": 3}, "response", "expected a string, got int"),
    ({"prompt": "Hi.", "response": "  "}, "response", "empty response"),
    ({"instruction": "Add.", "input": 2, "output": "4"}, "input", "expected a string, got int"),
    ({"instruction": "Add.", "input": "2+2"}, "output", "missing output"),
    ({"prompt": "Hi.", "output": "Hello."}, "prompt", "not both schemas"),
])
def test_bad_instruction_rows_name_file_line_and_field(tmp_path, row, field, reason):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"prompt": "Fine.", "response": "Yes."}) + "\n" + json.dumps(row) + "\n")
    with pytest.raises(DataError, match=reason) as exc:
        load_jsonl(path)
    assert (exc.value.source, exc.value.line, exc.value.field) == (str(path), 2, field)


def test_run_formats_lets_open_training_serve_a_multiple_choice_upper_level():
    mc = builtin_multiple_choice(2, domains=["capitals"])
    chat = [OpenQA("Say hi.", ("Hi!",), "chat", "c0")]
    lower, upper = run_formats(chat, mc, resolve_prompt_settings(CalibrationConfig.from_dict({"preset": "paper"}).prompt), mc)
    assert (lower.layout, upper.layout) == ("open", "letter")
    with pytest.raises(ValueError, match=r"unlabeled: record 'c0' is OpenQA, expected multiple_choice"):
        run_formats(chat, mc, resolve_prompt_settings(CalibrationConfig().prompt), chat)  # the upper level reads what selection scores
    with pytest.raises(ValueError, match=r"heldout: record 'c0' is OpenQA, expected multiple_choice"):
        run_formats(mc, chat, resolve_prompt_settings(CalibrationConfig().prompt))  # option-score training says nothing about greedy answers
    assert run_formats(chat, chat, resolve_prompt_settings(CalibrationConfig().prompt)).upper.layout == "open"


def test_calibrate_preset_paper_trains_on_instruction_data(tiny_model_dir, tmp_path, capsys):
    """The paper's protocol end to end: an instruction-data lower level (16 pairs, one batch of 16 an
    epoch: 5 steps), multiple-choice held-out, unlabelled and evaluation sets."""
    out = tmp_path / "out"
    train = _write_instructions(tmp_path / "chat.jsonl", 16)
    argv = ["calibrate", "--model", str(tiny_model_dir), "--preset", "paper", "--train", train, "--heldout", HELDOUT,
            "--unlabeled", UNLABELED, "--eval", EVAL, "--out", str(out), "--eval-every", "1", "--bootstrap", "0",
            "--no-progress"]
    assert cli.main(argv) == 0
    data = json.loads((out / "metrics.json").read_text())
    cal = data["config"]["calibration"]
    assert cal["preset"] == "paper" and cal["training"] == {"steps": 5, "batch_size": 16, "heldout_batch_size": 16,
                                                             "lr": 1e-3, "epochs": 5, "log_every": 10,
                                                             "compile": False, "part_overhead": None}
    assert cal["lora"]["rank"] == 64 and cal["objectives"]["calm"]["adjustment"] == "vector"
    assert (data["config"]["train"]["kind"], data["config"]["heldout"]["kind"]) == ("open", "multiple_choice")
    assert data["columns"] == ["uncalibrated", "temperature_scaled", "calm", "calm+temperature"]
    assert data["domains"]["capitals"]["kind"] == "multiple_choice"
    saved = json.loads((out / "calm" / "config.json").read_text())
    assert saved["preset"] == "paper" and saved["training"]["steps"] == 5 and saved["lora"]["target_modules"] == list(
        PAPER_LORA_MODULES)
    history = json.loads((out / "calm" / "history.json").read_text())
    steps = history if isinstance(history, list) else history["history"]
    assert [h["step"] for h in steps] == [1, 2, 3, 4, 5]
    assert "lower level trained on open-ended (prompt, response) records" in (out / "report.md").read_text()


def test_calibrate_names_the_bad_instruction_row_and_keeps_the_kind_refusals(tiny_model_dir, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "Hi.", "response": "Hello."}) + "\n" + json.dumps({"prompt": "Bye."}) + "\n")
    base = ["calibrate", "--model", str(tiny_model_dir), "--preset", "paper", "--heldout", HELDOUT, "--eval", EVAL,
            "--out", str(tmp_path / "out"), "--no-progress"]
    assert cli.main([*base, "--train", f"jsonl:{bad}"]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last == f"llm-calib: error: --train jsonl:{bad}: {bad}:2: response: missing response"
    train = _write_instructions(tmp_path / "chat.jsonl", 4)
    assert cli.main([*base, "--train", train, "--unlabeled", train]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("llm-calib: error: --unlabeled") and "is OpenQA, expected multiple_choice" in last


def test_epochs_set_the_step_count_of_the_python_api():
    from llm_calib import calibrate
    from llm_calib.models import tiny_random_model

    model, tok = tiny_random_model(seed=0, init_std=0.1)
    qs = builtin_multiple_choice(n_per_domain=5, domains=["capitals"])
    cfg = CalibrationConfig(training=dict(epochs=2, batch_size=2, heldout_batch_size=2), lora=dict(rank=2),
                            selection=dict(eval_every=1))
    result = calibrate(model, tok, qs[:3], qs[3:], cfg, progress=False)  # 3 questions: 2 batches an epoch
    assert [h["step"] for h in result.history] == [1, 2, 3, 4]
    assert (result.config.training.steps, result.config.training.epochs) == (4, 2)
