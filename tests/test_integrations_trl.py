"""``llm_calib.integrations.trl.CalmSFTTrainer``: CALM on TRL's ``SFTTrainer`` data (trl from PyPI, the ``trl`` extra).

Prompt/completion rows and chat ``messages`` go through TRL's own tokenisation and collator; the
CALM step reads its completion-only (or assistant-only) labels; padding-free batches give the same
run as padded ones; the upper level reads prompts (TRL's prompt-only rows, or the evaluation set's).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

trl = pytest.importorskip("trl", reason="the trl extra (pip install 'llm-calib[trl]')")

from datasets import Dataset  # noqa: E402
from peft import LoraConfig  # noqa: E402
from transformers import PrinterCallback  # noqa: E402

from llm_calib.data import builtin_open_questions  # noqa: E402
from llm_calib.integrations import labelled_sequences  # noqa: E402
from llm_calib.integrations.trl import CalmSFTTrainer  # noqa: E402
from llm_calib.models import tiny_random_model  # noqa: E402

# The tiny model's ChatML template with TRL's {% generation %} markers around the assistant's turn,
# which assistant_only_loss needs (the template of a real chat model has them, or TRL patches it).
TRAINING_TEMPLATE = (
    "{% for m in messages %}{% if loop.first and m['role'] != 'system' %}"
    "<|im_start|>system\nYou are a tiny test model.<|im_end|>\n{% endif %}"
    "{% if m['role'] == 'assistant' %}<|im_start|>assistant\n{% generation %}{{ m['content'] }}<|im_end|>\n"
    "{% endgeneration %}{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
QUESTIONS = builtin_open_questions(12)  # 36 questions


def _user(q) -> dict[str, str]:
    return {"role": "user", "content": q.question}


def _answer(q) -> dict[str, str]:
    return {"role": "assistant", "content": q.answers[0]}


def prompt_completion(questions) -> Dataset:
    return Dataset.from_list([{"prompt": [_user(q)], "completion": [_answer(q)]} for q in questions])


def messages(questions) -> Dataset:
    return Dataset.from_list([{"messages": [_user(q), _answer(q)]} for q in questions])


def make_trainer(tmp: Path, train: Dataset, evals: Dataset | None, tokenizer=None, **options) -> CalmSFTTrainer:
    calm = {k: options.pop(k) for k in ("upper_dataset",) if k in options}
    _, tok = tiny_random_model()
    tokenizer = tokenizer or tok
    settings = dict(max_steps=4, per_device_train_batch_size=4, learning_rate=1e-2, report_to="none", save_strategy="no",
                    disable_tqdm=True, use_cpu=True, logging_steps=2, dataloader_pin_memory=False)
    args = trl.SFTConfig(str(tmp), **{**settings, **options})
    trainer = CalmSFTTrainer(model=tiny_random_model()[0], args=args, train_dataset=train, eval_dataset=evals,
                             processing_class=tokenizer, peft_config=LoraConfig(r=4, target_modules=["q_proj", "v_proj"]),
                             **calm)
    trainer.remove_callback(PrinterCallback)
    return trainer


def _trained(trainer: CalmSFTTrainer) -> float:
    return max(float(v.abs().max()) for k, v in trainer.calm.theta.items() if "lora_B" in k)


def test_prompt_completion_run(tmp_path: Path) -> None:
    trainer = make_trainer(tmp_path, prompt_completion(QUESTIONS[:24]), prompt_completion(QUESTIONS[24:]))
    # TRL's completion-only labels: the CALM step's answer is the completion and its end of turn
    _, tok = tiny_random_model()
    seq = labelled_sequences(trainer.data_collator([trainer.train_dataset[0]]))[0]
    assert tok.decode([seq.tokens[j] for j in seq.targets]) == f"{QUESTIONS[0].answers[0]}<|im_end|>\n"
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 2 and all({"calm/g", "calm/unlabeled_entropy", "calm/lambda_b_absmax"} <= set(h) for h in logs)
    assert _trained(trainer) > 1e-3 and float(trainer.calm.lam["b"].abs().max()) > 1e-3
    metrics = trainer.evaluate()
    assert 0 <= metrics["eval_ece"] <= 1 and metrics["eval_entropy"] > 0
    trainer.save_model(str(tmp_path / "final"))
    from huggingface_hub import ModelCard

    card = ModelCard.load(tmp_path / "final" / "README.md")
    assert "calm" in card.data.tags and {r.dataset_name for r in card.data.eval_results} == {"eval"}


def test_padding_free_batches_train_as_padded_ones(tmp_path: Path) -> None:
    """padding_free=True (sequences concatenated, position_ids restarting): the same θ and λ as padding."""
    runs = []
    for name, free in (("padded", False), ("free", True)):
        trainer = make_trainer(tmp_path / name, prompt_completion(QUESTIONS[:16]), prompt_completion(QUESTIONS[16:24]),
                               padding_free=free, max_length=None, max_steps=2)
        trainer.train()
        runs.append(trainer.calm)
    padded, free = runs
    assert "position_ids" in make_trainer(tmp_path / "x", prompt_completion(QUESTIONS[:4]), None,
                                          padding_free=True, max_length=None, upper_dataset=[{"prompt": "hi"}]).data_collator(
        [{"input_ids": [1, 2, 3], "completion_mask": [0, 1, 1]}])
    for k, v in padded.theta.items():
        assert torch.allclose(v, free.theta[k], atol=1e-6, rtol=0), k
    for k, v in padded.lam.items():
        assert torch.allclose(v, free.lam[k], atol=1e-6, rtol=0), k


def test_chat_messages(tmp_path: Path) -> None:
    _, tok = tiny_random_model()
    tok.chat_template = TRAINING_TEMPLATE
    # assistant-only labels: the evaluation set's prompts serve the upper level
    trainer = make_trainer(tmp_path / "assistant", messages(QUESTIONS[:16]), messages(QUESTIONS[16:24]), tokenizer=tok,
                           assistant_only_loss=True)
    seq = labelled_sequences(trainer.data_collator([trainer.train_dataset[0]]))[0]
    assert tok.decode([seq.tokens[j] for j in seq.targets]) == f"{QUESTIONS[0].answers[0]}<|im_end|>\n"
    trainer.train()
    assert _trained(trainer) > 1e-3
    # labels on the whole conversation: the evaluation set has no prompts to read ...
    whole = make_trainer(tmp_path / "whole", messages(QUESTIONS[:16]), messages(QUESTIONS[16:24]))
    with pytest.raises(ValueError, match=r"^upper level from eval_dataset: its labels cover whole sequences"):
        whole.train()
    # ... so the upper level takes prompt-only conversations
    prompts = [{"messages": [_user(q)]} for q in QUESTIONS[24:32]]
    whole = make_trainer(tmp_path / "prompts", messages(QUESTIONS[:16]), messages(QUESTIONS[16:24]), upper_dataset=prompts)
    whole.train()
    assert _trained(whole) > 1e-3


def test_upper_rows_with_completions_refused(tmp_path: Path) -> None:
    rows = [{"prompt": [_user(q)], "completion": [_answer(q)]} for q in QUESTIONS[:8]]
    trainer = make_trainer(tmp_path, prompt_completion(QUESTIONS[:16]), None, upper_dataset=rows, max_steps=1)
    with pytest.raises(ValueError, match=r"^upper-level batch: example .* has labels \('completion'\) where none are expected"):
        trainer.train()
