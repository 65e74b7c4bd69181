#!/usr/bin/env python
"""CALM through ``transformers.Trainer`` (``CalmTrainer``) against ``llm-calib calibrate`` on the real model.

Question (issue 48): with SmolLM2-135M-Instruct on ARC-Easy and the same settings (data, seed, LoRA,
BOME, θ's rate, batch sizes, steps, evaluation every ``--eval-every`` steps), does a Trainer-based run
record the same held-out history as the CLI, and is its wall time within 1.2x of the CLI's?

Usage::

    PYTHONPATH=. /work/bin/bench python benchmarks/trainer_parity.py            # writes the results
    PYTHONPATH=. python benchmarks/trainer_parity.py --model DIR --limit 16 --steps 4 --eval-every 2 --no-write

Each round runs both sides as fresh processes, the side that goes first alternating: the CLI
(``llm-calib calibrate ... --guard-accuracy 0``: nothing stops early, as the Trainer has no guard) and a
Trainer script, the one a user writes (load the model, attach llm-calib's adapters, ``CalmTrainer``
with ``MultipleChoiceCollator``, ``train()``, ``save_model()``: the adapter and its model card, the
calibration table measured on the held-out set). Wall time is the whole process (model load
included); the training phase is calibrate's recorded ``train`` time against the Trainer's
``train_runtime`` (both evaluate the held-out set every ``--eval-every`` steps). The CLI also
evaluates ``--eval`` before and after and fits a temperature, so its end-to-end time holds more work.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the shared helpers beside this script

from harness.report import load_averages, machine_info, markdown_table, provenance_lines

RESULTS = Path(__file__).resolve().parent / "results"
DATA = "/work/shared/data"
TARGET = 1.2
METRICS = ("accuracy", "ece", "nll", "entropy", "confidence")


def trainer_run(args: argparse.Namespace) -> None:
    """The Trainer side (run in its own process): a user's CALM fine-tuning script."""
    import torch
    from transformers import TrainingArguments

    from llm_calib import CalibrationConfig
    from llm_calib.data import load
    from llm_calib.integrations import MultipleChoiceCollator, attach_adapters
    from llm_calib.integrations.trainer import CalmTrainer
    from llm_calib.models import load as load_model

    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model)
    train = load(f"arc_easy:{args.data}:train", limit=args.limit, seed=0).records
    heldout = load(f"arc_easy:{args.data}:dev", limit=args.limit, seed=0).records
    config = CalibrationConfig()  # llm-calib's defaults: top-6 LoRA with the output scale, BOME, θ's rate 1e-3
    training = TrainingArguments(
        args.out, max_steps=args.steps, per_device_train_batch_size=8, per_device_eval_batch_size=16,
        learning_rate=config.training.lr, lr_scheduler_type="constant", max_grad_norm=0.0, seed=config.seed,
        eval_strategy="steps", eval_steps=args.eval_every, logging_steps=args.eval_every, save_strategy="no",
        report_to="none", disable_tqdm=True, dataloader_pin_memory=False)
    trainer = CalmTrainer(model=attach_adapters(model, config), args=training, train_dataset=train,
                          eval_dataset=heldout, data_collator=MultipleChoiceCollator(tokenizer, config),
                          calm_config=config)
    output = trainer.train()
    trainer.save_model(args.out)
    history = [{"step": h["step"], **{f"heldout_{m}": h[f"eval_{m}"] for m in METRICS}}
               for h in trainer.state.log_history if "eval_ece" in h]
    Path(args.out, "parity.json").write_text(json.dumps({"history": history,
                                                         "train_s": output.metrics["train_runtime"]}))


def cli_history(out: Path) -> tuple[list[dict], float]:
    history = json.loads((out / "calm" / "history.json").read_text())
    metrics = json.loads((out / "metrics.json").read_text())
    evals = [{"step": h["step"], **{f"heldout_{m}": h[f"heldout_{m}"] for m in METRICS}}
             for h in history if "heldout_ece" in h]
    return evals, metrics["training"]["calm"]["timings"]["train"]


def run_round(args: argparse.Namespace, work: Path, round_no: int, env: dict[str, str]) -> dict:
    cli_out, trainer_out = work / f"cli{round_no}", work / f"trainer{round_no}"
    cli = [sys.executable, "-m", "llm_calib.cli", "calibrate", "--model", args.model,
           "--train", f"arc_easy:{args.data}:train", "--heldout", f"arc_easy:{args.data}:dev",
           "--eval", f"arc_easy:{args.data}/arc_easy/test.jsonl", "--limit", str(args.limit),
           "--steps", str(args.steps), "--eval-every", str(args.eval_every), "--guard-accuracy", "0",
           "--bootstrap", "0", "--no-progress", "--quiet", "--out", str(cli_out)]
    script = [sys.executable, __file__, "--trainer-run", "--model", args.model, "--data", args.data,
              "--limit", str(args.limit), "--steps", str(args.steps), "--eval-every", str(args.eval_every),
              "--threads", str(args.threads), "--out", str(trainer_out)]
    wall = {}
    sides = [("cli", cli), ("trainer", script)]
    for name, command in sides if round_no % 2 == 0 else sides[::-1]:
        t0 = time.perf_counter()
        proc = subprocess.run(command, env=env, capture_output=True, text=True)
        wall[name] = time.perf_counter() - t0
        if proc.returncode != 0:
            raise SystemExit(f"{name} failed:\n{proc.stderr[-3000:]}")
        print(f"round {round_no}: {name} {wall[name]:.1f} s", flush=True)
    cli_hist, cli_train = cli_history(cli_out)
    ours = json.loads((trainer_out / "parity.json").read_text())
    return {"wall": wall, "train": {"cli": cli_train, "trainer": ours["train_s"]},
            "history": {"cli": cli_hist, "trainer": ours["history"]},
            "card": (trainer_out / "README.md").read_text()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--data", default=DATA)
    parser.add_argument("--limit", type=int, default=200, help="questions per split (the CLI's --limit)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--no-write", action="store_true")
    parser.add_argument("--trainer-run", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.trainer_run:
        trainer_run(args)
        return
    load_start = load_averages()
    t_start = time.perf_counter()
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads),
           "TOKENIZERS_PARALLELISM": "false"}
    with tempfile.TemporaryDirectory() as tmp:
        rounds = [run_round(args, Path(tmp), r, env) for r in range(args.rounds)]
    lines = report(args, rounds, load_start, time.perf_counter() - t_start)
    print("\n".join(lines))
    if not args.no_write:
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / "trainer_parity.md").write_text("\n".join(lines) + "\n")


def report(args: argparse.Namespace, rounds: list[dict], load_start: list[float], elapsed: float) -> list[str]:
    command = "PYTHONPATH=. /work/bin/bench python benchmarks/trainer_parity.py " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in (("limit", args.limit), ("steps", args.steps),
                                                      ("eval_every", args.eval_every), ("rounds", args.rounds)))
    lines = ["# CALM through transformers.Trainer vs llm-calib calibrate (SmolLM2-135M-Instruct, ARC-Easy)", ""]
    lines += provenance_lines(command, machine_info(args.threads), elapsed_s=elapsed, load_start=load_start)
    lines += ["", f"Settings: `--limit {args.limit}` questions per split (train, dev as held-out and upper level, "
              f"test as --eval), {args.steps} steps of 8 questions, held-out evaluation every {args.eval_every} "
              "steps, llm-calib's default configuration (LoRA rank 8 on q/v of the top 6 layers with the output "
              "scale, BOME, θ rate 1e-3, constant), seed 0; Trainer: `lr_scheduler_type='constant'`, "
              "`max_grad_norm=0` (calibrate clips nothing).", "", "## Held-out history", ""]
    first = rounds[0]["history"]
    rows, worst = [], 0.0
    for cli, ours in zip(first["cli"], first["trainer"], strict=True):
        for m in METRICS:
            a, b = cli[f"heldout_{m}"], ours[f"heldout_{m}"]
            worst = max(worst, abs(a - b))
            rows.append([cli["step"], m, f"{a:.6f}", f"{b:.6f}", f"{abs(a - b):.1e}"])
    same_steps = [h["step"] for h in first["cli"]] == [h["step"] for h in first["trainer"]]
    lines += markdown_table(["step", "metric", "llm-calib calibrate", "CalmTrainer", "|difference|"], rows)
    repeat = all(r["history"] == first for r in rounds[1:])
    lines += ["", f"Largest difference: {worst:.1e} (evaluated at the same steps: {'yes' if same_steps else 'NO'}); "
              f"later rounds repeat round 1's histories exactly: {'yes' if repeat else 'no'}.", "",
              "## Wall time", ""]
    rows = []
    for i, r in enumerate(rounds):
        rows.append([i + 1, f"{r['wall']['cli']:.1f}", f"{r['wall']['trainer']:.1f}",
                     f"{r['wall']['trainer'] / r['wall']['cli']:.2f}", f"{r['train']['cli']:.1f}",
                     f"{r['train']['trainer']:.1f}", f"{r['train']['trainer'] / r['train']['cli']:.2f}"])
    wall = [sum(r["wall"][s] for r in rounds) for s in ("cli", "trainer")]
    train = [sum(r["train"][s] for r in rounds) for s in ("cli", "trainer")]
    rows.append(["all", f"{wall[0]:.1f}", f"{wall[1]:.1f}", f"**{wall[1] / wall[0]:.2f}**", f"{train[0]:.1f}",
                 f"{train[1]:.1f}", f"**{train[1] / train[0]:.2f}**"])
    lines += markdown_table(["round", "CLI wall (s)", "Trainer wall (s)", "ratio", "CLI train (s)",
                             "Trainer train (s)", "ratio"], rows)
    lines += ["", f"Target: Trainer wall time ≤ {TARGET}x the CLI's: end to end {wall[1] / wall[0]:.2f}x, training "
              f"phase {train[1] / train[0]:.2f}x. The CLI's wall time also holds its --eval evaluations (before and "
              "after) and the temperature fit; the Trainer's holds the final evaluation for the model card.", "",
              "## The model card of the Trainer run (its final save)", "", "```markdown", rounds[0]["card"].rstrip(),
              "```"]
    return lines


if __name__ == "__main__":
    main()
