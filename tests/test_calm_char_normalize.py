"""Issue 31 (1): training and selection under per-character / per-byte option scores, as
``evaluate --normalize char|byte`` (lm-eval's acc_norm / acc_bytes) scores them."""

from __future__ import annotations

import json

import pytest
import torch

from llm_calib import cli
from llm_calib.adjustment import LogitAdjustment
from llm_calib.calm.encoding import encode_records
from llm_calib.calm.fast_eval import base_scores
from llm_calib.calm.lora import FunctionalLM, attach_lora
from llm_calib.calm.losses import CalmLosses
from llm_calib.calm.run import task_format
from llm_calib.config.calibration import CalibrationConfig, LoraSettings
from llm_calib.data import MultipleChoice, OpenQA, builtin_multiple_choice
from llm_calib.models import tiny_random_model
from llm_calib.prompts.resolution import resolve_prompt_settings
from llm_calib.scoring import score_option_likelihood

# options of different lengths in characters, bytes and tokens (so the normalisations disagree)
QUESTIONS = [
    MultipleChoice("Capital of Switzerland?", ("Bern", "Zürich", "Genève la grande"), 0, "geo", "q0"),
    MultipleChoice("Largest planet?", ("Jupiter", "Mars"), 0, "space", "q1"),
    *builtin_multiple_choice(2, domains=["capitals"]),
]


@pytest.mark.parametrize("normalize", ["char", "byte", "sum", "mean"])
def test_training_scores_equal_evaluation_scores(normalize):
    model, tok = tiny_random_model(seed=0, init_std=0.1)
    want = score_option_likelihood(model, tok, QUESTIONS, normalize=normalize)
    config = CalibrationConfig(prompt={"normalize": normalize})
    enc = encode_records(tok, QUESTIONS, task_format(QUESTIONS, resolve_prompt_settings(config.prompt)))
    lm = FunctionalLM(attach_lora(model, LoraSettings(rank=2)))  # LoRA B = 0: the base model
    losses = CalmLosses(lm, LogitAdjustment("vector", lm.head.out_features), normalize)
    got = losses.scores(None, None, enc.batch(range(len(QUESTIONS)), tok.pad_token_id))
    for i, w in enumerate(want.logits):
        torch.testing.assert_close(got[i, : len(w)].double(), w.double(), atol=2e-5, rtol=0)
    if normalize in ("char", "byte"):  # by hand: the summed log-likelihood over the option's length
        total = score_option_likelihood(model, tok, QUESTIONS, normalize="sum").logits
        for i, q in enumerate(QUESTIONS):
            n = [len(o) if normalize == "char" else len(o.encode("utf-8")) for o in q.options]
            torch.testing.assert_close(got[i, : len(n)].double(), total[i].double() / torch.tensor(n, dtype=torch.float64),
                                       atol=2e-5, rtol=0)
    # selection's fast scorer agrees too
    fast = base_scores(model, enc, trunk_layers=0, batch_size=2, pad_id=tok.pad_token_id, normalize=normalize)
    for f, w in zip(fast, want.logits, strict=True):
        torch.testing.assert_close(f, w.double(), atol=2e-5, rtol=0)


def test_char_differs_from_sum_and_mean():
    model, tok = tiny_random_model(seed=0, init_std=0.1)
    s = {n: score_option_likelihood(model, tok, QUESTIONS[:1], normalize=n).logits[0] for n in ("sum", "mean", "char")}
    assert not torch.allclose(s["char"], s["sum"]) and not torch.allclose(s["char"], s["mean"])


def test_char_on_open_questions_is_a_clear_error():
    model, tok = tiny_random_model()
    qs = [OpenQA("What is 1 + 1?", ("2",), "sums", "s0")]
    enc = encode_records(tok, qs, task_format(qs, resolve_prompt_settings(CalibrationConfig().prompt)))
    lm = FunctionalLM(attach_lora(model, LoraSettings(rank=2)))
    losses = CalmLosses(lm, LogitAdjustment("vector", lm.head.out_features), "char")
    with pytest.raises(ValueError, match="needs multiple-choice options"):
        losses.scores(None, None, enc.batch([0], tok.pad_token_id))


def test_calibrate_cli_trains_and_selects_under_char(tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    spec = "builtin:capitals:n=4"
    argv = ["calibrate", "--model", str(tiny_model_dir), "--train", spec, "--heldout", "builtin:capitals:n=4,seed=1",
            "--eval", spec, "--out", str(out), "--methods", "lora_ce", "--steps", "1", "--batch-size", "2",
            "--lora-rank", "2", "--bootstrap", "0", "--no-progress", "--normalize", "char"]
    assert cli.main(argv) == 0
    assert json.loads((out / "lora_ce" / "config.json").read_text())["prompt"]["normalize"] == "char"
    assert json.loads((out / "lora_ce" / "base_model.json").read_text())["normalize"] == "char"
    assert json.loads((out / "metrics.json").read_text())["config"]["calibration"]["prompt"]["normalize"] == "char"


def test_training_under_an_lm_eval_preset_scores_like_evaluate():
    from llm_calib.prompts.templates import preset

    model, tok = tiny_random_model(seed=0, init_std=0.1)
    want = score_option_likelihood(model, tok, QUESTIONS, normalize="char", prompt=preset("lm_eval_arc"))
    config = CalibrationConfig(prompt={"normalize": "char", "preset": "lm_eval_arc"})
    enc = encode_records(tok, QUESTIONS, task_format(QUESTIONS, resolve_prompt_settings(config.prompt)))
    assert tok.decode(enc.prompts[0]).startswith("Question: Capital of Switzerland?\nAnswer:")
    lm = FunctionalLM(attach_lora(model, LoraSettings(rank=2)))
    got = CalmLosses(lm, LogitAdjustment("vector", lm.head.out_features), "char").scores(
        None, None, enc.batch(range(len(QUESTIONS)), tok.pad_token_id))
    for i, w in enumerate(want.logits):
        torch.testing.assert_close(got[i, : len(w)].double(), w.double(), atol=2e-5, rtol=0)
    # a template given as on the command line ("\n" escaped) is the same prompt
    escaped = CalibrationConfig(prompt={"template": "Question: {question}\\nAnswer:", "chat_template": False})
    assert encode_records(tok, QUESTIONS, task_format(QUESTIONS, resolve_prompt_settings(escaped.prompt))).prompts == enc.prompts


def test_calibrate_cli_prompt_preset_is_recorded_and_checked_at_evaluation(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "run"
    spec = "builtin:capitals:n=4"
    argv = ["calibrate", "--model", str(tiny_model_dir), "--train", spec, "--heldout", "builtin:capitals:n=4,seed=1",
            "--eval", spec, "--out", str(out), "--methods", "lora_ce", "--steps", "1", "--batch-size", "2",
            "--lora-rank", "2", "--bootstrap", "0", "--no-progress", "--prompt-preset", "lm_eval_arc",
            "--normalize", "char", "--threads", "1"]
    assert cli.main(argv) == 0
    rec = json.loads((out / "lora_ce" / "base_model.json").read_text())
    assert rec["prompt"]["template"] == "Question: {question}\nAnswer:" and rec["prompt"]["chat_template"] is False
    capsys.readouterr()
    ev = ["evaluate", "--adapter", str(out / "lora_ce"), "--data", spec, "--bootstrap", "0", "--quiet"]
    assert cli.main([*ev, "--out", str(tmp_path / "e1"), "--prompt-preset", "lm_eval_arc", "--normalize", "char"]) == 0
    assert "warning" not in capsys.readouterr().err
    # without prompt flags evaluate --adapter uses the recorded prompt, scorer and normalisation
    assert cli.main([*ev, "--out", str(tmp_path / "e2")]) == 0
    assert "warning" not in capsys.readouterr().err
    used = json.loads((tmp_path / "e2" / "metrics.json").read_text())["config"]
    assert used["prompt"]["template"] == "Question: {question}\nAnswer:" and used["prompt"]["chat_template"] is False
    assert cli.main([*ev, "--out", str(tmp_path / "e3"), "--prompt-preset", "default"]) == 0  # not the training one
    assert "another prompt" in capsys.readouterr().err
