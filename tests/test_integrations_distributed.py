"""CalmStep and CalmTrainer under ``torchrun`` with 2 CPU ranks (gloo) equal one process on the combined batch.

Each rank passes its half of every global batch (the plain loop: every other question, as
``calibrate`` shards; the Trainer: accelerate's sharded data loader); the losses are means over
ranks, so every rank takes the step of the whole batch. The model runs in float64: in float32 the
two runs differ by the order in which per-question gradients are summed, which BOME's λ direction
(a difference of two nearly equal gradients) and Adam's per-coordinate normalisation turn into
visible differences in λ (measured in ``tests/test_calm_distributed.py``: up to 3e-4 for a reordered
batch in one process); float64 tests the data-parallel arithmetic itself.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

REPO = Path(__file__).resolve().parents[1]

SCRIPT = '''
import sys
import tempfile
import torch
torch.set_num_threads(1)
from transformers import PrinterCallback, TrainingArguments
from llm_calib import CalibrationConfig, distributed
from llm_calib.calm import batch_order
from llm_calib.data import builtin_multiple_choice
from llm_calib.integrations import CalmStep, MultipleChoiceCollator, attach_adapters
from llm_calib.integrations.trainer import CalmTrainer
from llm_calib.models import tiny_random_model

STEPS, BATCH = 3, 4
CONFIG = CalibrationConfig(objective={"name": "calm", "lam_lr": 1e-1}, training=dict(lr=1e-2), lora=dict(rank=2))
QUESTIONS = builtin_multiple_choice(n_per_domain=6, domains=["arithmetic", "capitals"])
TRAIN, HELDOUT = QUESTIONS[0::2], QUESTIONS[1::2]


def model_and_collators():
    model, tok = tiny_random_model(seed=0, init_std=0.1)
    return attach_adapters(model.double(), CONFIG), MultipleChoiceCollator(tok, CONFIG), \\
        MultipleChoiceCollator(tok, CONFIG, labels=None)


def plain_loop():
    model, collate, upper = model_and_collators()
    calm = CalmStep(model, CONFIG, task_format=collate.format)
    for step in range(STEPS):
        i = batch_order.shard(batch_order.batch_indices(len(TRAIN), BATCH, step, 0, batch_order.TRAIN_STREAM))
        j = batch_order.shard(batch_order.batch_indices(len(HELDOUT), BATCH, step, 0, batch_order.UPPER_STREAM))
        calm.step(collate([TRAIN[k] for k in i]), upper([HELDOUT[k] for k in j]))
    return calm


def trainer_run():
    model, collate, _ = model_and_collators()
    args = TrainingArguments(tempfile.mkdtemp(), max_steps=STEPS, per_device_train_batch_size=BATCH // distributed.world_size(),
                             learning_rate=1e-2, lr_scheduler_type="constant", max_grad_norm=0.0, seed=0,
                             report_to="none", save_strategy="no", disable_tqdm=True, use_cpu=True,
                             dataloader_pin_memory=False, ddp_backend="gloo" if distributed.world_size() > 1 else None)
    trainer = CalmTrainer(model=model, args=args, train_dataset=TRAIN, eval_dataset=HELDOUT, data_collator=collate,
                          calm_config=CONFIG, upper_batch_size=BATCH)
    trainer.remove_callback(PrinterCallback)
    trainer.train()
    return trainer.calm


def tensors(calm):
    return {**{f"theta/{k}": v for k, v in calm.theta.items()}, **{f"lam/{k}": v.detach() for k, v in calm.lam.items()}}


if __name__ == "__main__":
    from safetensors.torch import save_file
    out = sys.argv[1]
    distributed.init_from_env("cpu")
    assert distributed.world_size() == 2
    save_file(tensors(plain_loop()), f"{out}/plain{distributed.rank()}.safetensors")
    save_file(tensors(trainer_run()), f"{out}/trainer{distributed.rank()}.safetensors")
    torch.distributed.destroy_process_group()
'''


def test_two_ranks_equal_one_process(tmp_path: Path) -> None:
    script = tmp_path / "ddp_calm.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           str(script), str(tmp_path)], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]

    namespace: dict = {"__name__": "ddp_calm"}
    exec(compile(SCRIPT, str(script), "exec"), namespace)
    for name, run in (("plain", namespace["plain_loop"]), ("trainer", namespace["trainer_run"])):
        reference = namespace["tensors"](run())
        ranks = [load_file(str(tmp_path / f"{name}{r}.safetensors")) for r in (0, 1)]
        assert set(ranks[0]) == set(reference)
        for k, want in reference.items():
            assert torch.equal(ranks[0][k], ranks[1][k]), (name, k)  # every rank holds the same θ and λ
            assert torch.allclose(ranks[0][k], want, atol=1e-6, rtol=0), (name, k, float((ranks[0][k] - want).abs().max()))
        assert max(float(v.abs().max()) for k, v in reference.items() if "lora_B" in k) > 1e-3  # θ trained
        assert float(reference["lam/log_a"].abs().max()) > 1e-3  # λ trained
