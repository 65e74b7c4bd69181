"""``llm_calib.integrations.trainer.CalmTrainer``: CALM inside ``transformers.Trainer``.

On the tiny model, 20 steps with calibrate's data, seed and settings give calibrate's θ and λ
(float32) and its held-out history; resuming from the step-10 checkpoint gives the uninterrupted
run; gradient accumulation, gradient checkpointing and bf16 are honoured; the CALM statistics are in
the Trainer's logs; the final save writes a model card; unsupported features get one clear line.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import PrinterCallback, TrainingArguments

from llm_calib import CalibrationConfig, calibrate
from llm_calib.data import builtin_multiple_choice, builtin_open_questions
from llm_calib.files.checkpoint import latest_checkpoint, load_checkpoint
from llm_calib.integrations import MultipleChoiceCollator, OpenAnswerCollator, attach_adapters
from llm_calib.integrations.trainer import CalmTrainer
from llm_calib.models import tiny_random_model

STEPS = 20
EVAL_EVERY = 10


def _sets(kind: str) -> tuple[list, list]:
    qs = (builtin_multiple_choice(n_per_domain=8, domains=["capitals", "arithmetic"]) if kind == "mc"
          else builtin_open_questions(n_per_domain=8))
    return qs[0::2], qs[1::2]  # both domains in each set


CONFIG = CalibrationConfig(training=dict(steps=STEPS, batch_size=4, heldout_batch_size=4, lr=1e-2),
                           objective={"name": "calm", "lam_lr": 5e-2},
                           # the Trainer scores open held-out answers teacher-forced (no generation inside
                           # Trainer.evaluate), so calibrate is compared under the same held-out metric
                           selection=dict(eval_every=EVAL_EVERY, guard_accuracy=0.0, open_metric="teacher_forced"),
                           checkpoint_every=STEPS)


def _args(out: Path, **overrides) -> TrainingArguments:
    """calibrate's settings as TrainingArguments: constant θ rate, no clipping, the same seed."""
    settings = dict(max_steps=STEPS, per_device_train_batch_size=4, per_device_eval_batch_size=16,
                    learning_rate=1e-2, lr_scheduler_type="constant", max_grad_norm=0.0, seed=CONFIG.seed,
                    report_to="none", save_strategy="no", disable_tqdm=True, logging_steps=5,
                    eval_strategy="steps", eval_steps=EVAL_EVERY, dataloader_pin_memory=False)
    settings.update(overrides)
    return TrainingArguments(str(out), **settings)


def make_trainer(kind: str, out: Path, **overrides) -> CalmTrainer:
    train, heldout = _sets(kind)
    model, tok = tiny_random_model(num_layers=3)
    collate = MultipleChoiceCollator(tok, CONFIG) if kind == "mc" else OpenAnswerCollator(tok, CONFIG)
    trainer = CalmTrainer(model=attach_adapters(model, CONFIG), args=_args(out, **overrides), train_dataset=train,
                          eval_dataset=heldout, data_collator=collate, processing_class=tok, calm_config=CONFIG)
    trainer.remove_callback(PrinterCallback)
    return trainer


def _calibrate(kind: str, tmp: Path) -> tuple[dict[str, torch.Tensor], list[dict[str, float]]]:
    train, heldout = _sets(kind)
    model, tok = tiny_random_model(num_layers=3)
    result = calibrate(model, tok, train, heldout, CONFIG, checkpoint_dir=tmp, progress=False)
    return load_checkpoint(latest_checkpoint(tmp))[0], result.history


def _differences(trainer: CalmTrainer, ref: dict[str, torch.Tensor]) -> tuple[float, float]:
    calm = trainer.calm
    dt = max(float((calm.theta[k] - ref[f"theta/{k}"]).abs().max()) for k in calm.theta)
    dl = max(float((calm.lam[k].detach() - ref[f"lam/{k}"]).abs().max()) for k in calm.lam)
    return dt, dl


@pytest.mark.parametrize("kind", ["mc", "open"])
def test_trainer_reproduces_calibrate(kind: str, tmp_path: Path) -> None:
    ref, history = _calibrate(kind, tmp_path / "calibrate")
    trainer = make_trainer(kind, tmp_path / "trainer")
    trainer.train()
    dt, dl = _differences(trainer, ref)
    assert dt <= 1e-6 and dl <= 1e-6, (dt, dl)
    # the held-out history: the Trainer's evaluations at steps 10 and 20 are calibrate's
    evals = [h for h in trainer.state.log_history if "eval_ece" in h]
    expected = [h for h in history if "heldout_ece" in h]
    assert [h["step"] for h in evals] == [h["step"] for h in expected] == [10, 20]
    for got, want in zip(evals, expected, strict=True):
        for metric in ("accuracy", "ece", "nll", "entropy", "confidence"):
            assert abs(got[f"eval_{metric}"] - want[f"heldout_{metric}"]) <= 1e-9, (metric, got, want)


def test_logs_carry_lambda_and_entropy(tmp_path: Path) -> None:
    trainer = make_trainer("mc", tmp_path, max_steps=10, eval_strategy="no", max_grad_norm=1.0)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert [h["step"] for h in logs] == [5, 10]
    for h in logs:
        assert {"calm/g", "calm/unlabeled_entropy", "calm/q", "calm/phi", "calm/lambda_log_a_mean",
                "calm/lambda_log_a_absmax", "calm/output_log_scale"} <= set(h)
        assert h["loss"] == pytest.approx(h["calm/g"], rel=1e-6)
        assert h["grad_norm"] > 0  # θ's update direction, not the empty .grad of the Trainer's own backward
    assert logs[-1]["calm/lambda_log_a_absmax"] > 0


def test_resume_from_step_10_equals_uninterrupted(tmp_path: Path) -> None:
    whole = make_trainer("mc", tmp_path / "run", save_strategy="steps", save_steps=10, eval_strategy="no")
    whole.train()
    checkpoint = tmp_path / "run" / "checkpoint-10"
    assert (checkpoint / "optimizer.pt").is_file()
    resumed = make_trainer("mc", tmp_path / "resumed", eval_strategy="no")
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert resumed.state.global_step == STEPS
    for k, v in whole.calm.theta.items():
        assert torch.equal(v, resumed.calm.theta[k]), k
    for k, v in whole.calm.lam.items():
        assert torch.equal(v, resumed.calm.lam[k]), k
    # the checkpoint's CALM state loads with weights_only=True (no pickled objects)
    state = torch.load(checkpoint / "optimizer.pt", weights_only=True)
    assert state["calm"]["steps"] == 10 and set(state["calm"]["lam"]) == set(whole.calm.lam)


def test_gradient_accumulation_and_checkpointing(tmp_path: Path) -> None:
    plain = make_trainer("mc", tmp_path / "plain", max_steps=6, eval_strategy="no")
    plain.train()
    for name, overrides in {"accumulation": dict(per_device_train_batch_size=2, gradient_accumulation_steps=2),
                            "checkpointing": dict(gradient_checkpointing=True),
                            "late_checkpointing": {}}.items():
        other = make_trainer("mc", tmp_path / name, max_steps=6, eval_strategy="no", **overrides)
        if name == "late_checkpointing":  # switched on after the CALM step exists: transformers' own recomputation
            other.calm_step()             # would use the module's weights, not θ; the step installs its own again
            other.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        other.train()
        if name != "accumulation":
            assert other.calm.lm.checkpointing
        for k, v in plain.calm.theta.items():
            assert torch.allclose(v, other.calm.theta[k], atol=1e-6, rtol=0), (name, k)
        for k, v in plain.calm.lam.items():
            assert torch.allclose(v, other.calm.lam[k], atol=1e-6, rtol=0), (name, k)


def test_bf16_autocast(tmp_path: Path) -> None:
    """bf16=True runs the forward passes under bf16 autocast; θ and its Adam state stay float32."""
    plain = make_trainer("open", tmp_path / "fp32", max_steps=4, eval_strategy="no")
    plain.train()
    half = make_trainer("open", tmp_path / "bf16", max_steps=4, eval_strategy="no", bf16=True, use_cpu=True)
    half.train()
    assert all(v.dtype == torch.float32 and bool(torch.isfinite(v).all()) for v in half.calm.theta.values())
    assert any(not torch.equal(half.calm.theta[k], v) for k, v in plain.calm.theta.items())  # autocast was on
    loss = [next(h["train_loss"] for h in t.state.log_history if "train_loss" in h) for t in (plain, half)]
    assert loss[1] == pytest.approx(loss[0], rel=0.05)  # the same run, rounded to bf16


def test_model_card_written_and_read_back(tmp_path: Path) -> None:
    from huggingface_hub import ModelCard

    trainer = make_trainer("mc", tmp_path, max_steps=2, eval_strategy="no")
    trainer.train()
    trainer.save_model(str(tmp_path / "final"))
    assert (tmp_path / "final" / "adapter_model.safetensors").is_file()
    card = ModelCard.load(tmp_path / "final" / "README.md")
    assert "calm" in card.data.tags and card.data.library_name == "peft"
    results = {r.dataset_name: r for r in card.data.eval_results if r.metric_type == "ece"}
    assert set(results) == {"capitals", "arithmetic", "all"}
    assert all(0 <= r.metric_value <= 1 for r in results.values())
    assert "| capitals | 4 |" in card.text and "| objective.solver.name | `bome` |" in card.text


@pytest.mark.parametrize(("overrides", "message"), [
    (dict(fp16=True), r"TrainingArguments\(fp16=True\): the CALM step takes no loss scaling; use bf16=True"),
    (dict(optim="adafactor"), r"TrainingArguments\(optim='adafactor'\)"),
    (dict(weight_decay=0.1), r"TrainingArguments\(weight_decay=0.1\)"),
    (dict(label_smoothing_factor=0.1), r"TrainingArguments\(label_smoothing_factor=0.1\)"),
])
def test_unsupported_trainer_features(overrides: dict, message: str, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=f"^CalmTrainer does not support {message}"):
        make_trainer("mc", tmp_path, **overrides)


def test_bad_trainer_input(tmp_path: Path) -> None:
    train, heldout = _sets("mc")
    model, tok = tiny_random_model()
    collate = MultipleChoiceCollator(tok)
    with pytest.raises(ValueError, match=r"^upper_batch_size=3 must be a positive multiple of gradient_accumulation_steps"):
        CalmTrainer(model=attach_adapters(model), args=_args(tmp_path, gradient_accumulation_steps=2,
                                                             per_device_train_batch_size=2),
                    train_dataset=train, eval_dataset=heldout, data_collator=collate, upper_batch_size=3)
    with pytest.raises(ValueError, match=r"^CalmTrainer needs unlabelled upper-level inputs"):
        CalmTrainer(model=attach_adapters(tiny_random_model()[0]), args=_args(tmp_path, eval_strategy="no"),
                    train_dataset=train, data_collator=collate)
    with pytest.raises(ValueError, match=r"^CalmTrainer: do not pass optimizers"):
        peft_model = attach_adapters(tiny_random_model()[0])
        CalmTrainer(model=peft_model, args=_args(tmp_path), train_dataset=train, eval_dataset=heldout,
                    data_collator=collate, optimizers=(torch.optim.SGD(peft_model.parameters(), lr=0.1), None))
    upper = [{"question": r.question, "options": list(r.options), "answer": r.gold} for r in heldout]
    trainer = CalmTrainer(model=attach_adapters(tiny_random_model()[0]), args=_args(tmp_path, max_steps=1),
                          train_dataset=train, eval_dataset=heldout, data_collator=collate, upper_dataset=upper)
    trainer.remove_callback(PrinterCallback)
    with pytest.raises(ValueError, match=r"^upper-level batch: example 0 of the batch has labels .'answer'. where none"):
        trainer.train()


def test_load_best_model_at_end_by_ece(tmp_path: Path) -> None:
    """metric_for_best_model="ece" (lower is better) keeps the best-calibrated checkpoint's adapter."""
    from peft import get_peft_model_state_dict
    from safetensors.torch import load_file

    trainer = make_trainer("mc", tmp_path, max_steps=6, eval_steps=2, save_strategy="steps", save_steps=2,
                           load_best_model_at_end=True, metric_for_best_model="ece", greater_is_better=False)
    trainer.train()
    evals = {h["step"]: h["eval_ece"] for h in trainer.state.log_history if "eval_ece" in h}
    best = min(evals, key=evals.get)
    assert trainer.state.best_model_checkpoint.endswith(f"checkpoint-{best}")
    saved = load_file(str(tmp_path / f"checkpoint-{best}" / "adapter_model.safetensors"))
    now = get_peft_model_state_dict(trainer.model)
    assert set(now) == set(saved) and all(torch.equal(now[k], v) for k, v in saved.items())
    final = load_file(str(tmp_path / "checkpoint-6" / "adapter_model.safetensors"))
    assert best == 6 or any(not torch.equal(final[k], v) for k, v in saved.items())  # the best, not the last
