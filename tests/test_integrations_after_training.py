"""After a CALM run in someone else's pipeline: the usual outputs work with llm-calib's commands.

``save_pretrained`` of the Trainer's model is read by ``llm-calib evaluate --adapter``; its
``merge_and_unload`` output by ``llm-calib evaluate --model`` with the same numbers; ``llm-calib export``
writes a Hugging Face model card (method, data, per-domain table) that ``huggingface_hub.ModelCard`` reads.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

from huggingface_hub import ModelCard
from transformers import PrinterCallback, TrainingArguments

from llm_calib import cli
from llm_calib.data import load as load_data
from llm_calib.integrations import MultipleChoiceCollator
from llm_calib.integrations.trainer import CalmTrainer
from llm_calib.models import load as load_model

warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)

DATA = "builtin:capitals,arithmetic:n=6"


def _evaluate(tmp: Path, name: str, *flags: str) -> dict:
    out = tmp / name
    assert cli.main(["evaluate", "--data", DATA, "--bootstrap", "0", "--no-progress", "--quiet", "--out", str(out),
                     *flags]) == 0
    return json.loads((out / "metrics.json").read_text())["domains"]


def test_trainer_outputs_read_by_evaluate(tiny_model_dir: Path, tmp_path: Path) -> None:
    from peft import LoraConfig, get_peft_model

    model, tok = load_model(str(tiny_model_dir))
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    records = load_data("builtin:capitals,arithmetic:n=8,seed=3").records
    args = TrainingArguments(str(tmp_path / "run"), max_steps=4, per_device_train_batch_size=4, learning_rate=5e-2,
                             report_to="none", save_strategy="no", disable_tqdm=True, dataloader_pin_memory=False)
    trainer = CalmTrainer(model=peft_model, args=args, train_dataset=records[0::2], eval_dataset=records[1::2],
                          data_collator=MultipleChoiceCollator(tok))
    trainer.remove_callback(PrinterCallback)
    trainer.train()
    trainer.save_model(str(tmp_path / "adapter"))  # the usual save: a peft adapter (and the model card)
    merged = trainer.model.merge_and_unload()
    merged.save_pretrained(tmp_path / "merged")
    tok.save_pretrained(tmp_path / "merged")

    base = _evaluate(tmp_path, "base", "--model", str(tiny_model_dir))
    adapted = _evaluate(tmp_path, "adapted", "--model", str(tiny_model_dir), "--adapter", str(tmp_path / "adapter"))
    folded = _evaluate(tmp_path, "merged", "--model", str(tmp_path / "merged"))
    for domain in ("capitals", "arithmetic"):
        for metric in ("ece", "nll", "accuracy"):
            a, m = adapted[domain]["uncalibrated"][metric], folded[domain]["uncalibrated"][metric]
            assert abs(a - m) <= 1e-5, (domain, metric, a, m)
    # the adapter was trained: the evaluation differs from the base model's
    assert max(abs(adapted[d]["uncalibrated"]["nll"] - base[d]["uncalibrated"]["nll"]) for d in adapted) > 1e-4
    # the final save wrote a model card with the table measured at the end
    card = ModelCard.load(tmp_path / "adapter" / "README.md")
    assert {r.dataset_name for r in card.data.eval_results} == {"capitals", "arithmetic", "all"}


def test_export_writes_a_model_card(tiny_model_dir: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    assert cli.main(["calibrate", "--model", str(tiny_model_dir), "--train", "builtin:capitals:n=8",
                     "--heldout", "builtin:capitals:n=8,seed=1", "--eval", DATA, "--steps", "2", "--bootstrap", "0",
                     "--no-progress", "--quiet", "--out", str(run)]) == 0
    assert cli.main(["export", str(run / "calm"), "--out", str(tmp_path / "merged"), "--quiet"]) == 0
    card = ModelCard.load(tmp_path / "merged" / "README.md")
    assert card.data.base_model == str(tiny_model_dir) and "calm" in card.data.tags
    ece = {r.dataset_name: r.metric_value for r in card.data.eval_results if r.metric_type == "ece"}
    summary = json.loads((run / "metrics.json").read_text())["domains"]
    assert ece == {d: round(summary[d]["columns"]["calm"]["ece"], 6) for d in ("capitals", "arithmetic")}
    assert "| objective.solver.name | `bome` |" in card.text and "`builtin:capitals:n=8`" in card.text
