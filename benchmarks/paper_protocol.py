"""The CALM paper's table for one model: uncalibrated, temperature scaling and CALM (``--preset
paper``), per evaluation set, with conf-ECE, accuracy, Brier and AUROC.

For users with a GPU; it drives ``llm-calib calibrate`` through :func:`llm_calib.cli.main` only (the
public command line), then reads its ``metrics.json`` and writes ``paper_table.md`` and
``paper_table.json`` into ``--out``. **Not run here**: the machine this script was written on
has no GPU; the test suite runs it on CPU with a tiny random model, one batch per epoch, local
files only (tests/test_paper_protocol.py).

The paper's setting (arXiv 2608.07419; see docs/methods/calm.md): an aligned 7-8B model, the lower
level on general instruction data (Alpaca), tested on MMLU, MedMCQA, OpenBookQA and ARC-Challenge.
A GPU run, with the data fetched once by ``datasets`` / lm-eval (``pip install 'llm-calib[hub,lm_eval]'``)::

    python -c "import datasets; datasets.load_dataset('tatsu-lab/alpaca', split='train').to_json('alpaca.jsonl')"
    python benchmarks/paper_protocol.py --model allenai/Llama-3.1-Tulu-3-8B \\
        --train jsonl:alpaca.jsonl --train-limit 5000 \\
        --heldout hf:allenai/ai2_arc:config=ARC-Challenge,split=validation \\
        --eval hf:cais/mmlu --eval lm_eval:medmcqa --eval hf:allenai/openbookqa \\
        --eval hf:allenai/ai2_arc:ARC-Challenge --limit 5000 \\
        --device cuda --dtype bfloat16 --load-in-4bit --out runs/paper_tulu8b

Hub ids a GPU user passes: ``allenai/Llama-3.1-Tulu-3-8B`` (or ``mistralai/Mistral-7B-Instruct-v0.3``
...); MMLU ``hf:cais/mmlu`` (test); MedMCQA ``lm_eval:medmcqa`` (lm-eval's task, validation split:
the hub test split has no answers; MedMCQA is not among the local data of this project);
OpenBookQA ``hf:allenai/openbookqa`` (test); ARC-Challenge ``hf:allenai/ai2_arc:ARC-Challenge``
(test). ``--train`` takes any JSONL of (prompt, response) pairs or Alpaca rows (instruction,
input, output). Arguments after ``--`` go to ``llm-calib calibrate`` unchanged (they override the
preset, e.g. ``-- --epochs 1 --lr 2e-4``).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

COLUMNS = {"uncalibrated": "uncalibrated", "temperature_scaled": "temperature scaling", "calm": "CALM (paper preset)",
           "calm+temperature": "CALM + temperature"}
"""The report's columns this table shows, and their headings."""

METRICS = {"ece": "conf-ECE", "accuracy": "accuracy", "brier": "Brier", "auroc": "AUROC"}
"""The metrics of the paper's table (conf-ECE: 10 equal-width bins), by their ``metrics.json`` names."""


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """This script's arguments, and those after ``--`` (passed to ``llm-calib calibrate``)."""
    extra: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1:]
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="hub name or local directory of the model to calibrate")
    p.add_argument("--train", required=True, metavar="SPEC",
                   help="lower-level data: jsonl:PATH of (prompt, response) pairs or Alpaca rows")
    p.add_argument("--train-limit", type=int, default=None, metavar="N",
                   help="use N training pairs (a seeded subsample; default: all)")
    p.add_argument("--heldout", required=True, metavar="SPEC",
                   help="labelled multiple-choice split for model selection and the temperature fit")
    p.add_argument("--unlabeled", action="append", default=None, metavar="SPEC",
                   help="unlabelled multiple-choice inputs of the upper level (default: the --heldout inputs)")
    p.add_argument("--eval", action="append", required=True, metavar="SPEC", help="evaluation set (repeat)")
    p.add_argument("--limit", type=int, default=None, metavar="N",
                   help="at most N records per data set, the training pairs included (calibrate's --limit)")
    p.add_argument("--device", default="cuda", help="torch device (default: %(default)s)")
    p.add_argument("--dtype", default="bfloat16", help="base model dtype (default: %(default)s)")
    p.add_argument("--load-in-4bit", action="store_true", help="QLoRA, as the paper (needs bitsandbytes)")
    p.add_argument("--bootstrap", type=int, default=1000, help="bootstrap resamples of the report (default: %(default)s)")
    p.add_argument("--out", required=True, help="output directory")
    return p.parse_args(argv), extra


def calibrate_argv(args: argparse.Namespace, extra: list[str]) -> list[str]:
    """The ``llm-calib calibrate`` command line of a run (without the program name)."""
    from llm_calib.data import load as load_data

    train = args.train
    argv = ["calibrate", "--preset", "paper", "--model", args.model, "--heldout", args.heldout, "--out", args.out,
            "--device", args.device, "--dtype", args.dtype, "--bootstrap", str(args.bootstrap), "--no-progress"]
    if args.train_limit is not None:  # a subsample of the training pairs alone (--limit cuts every set)
        records = load_data(train, limit=args.train_limit, seed=0).records
        subset = Path(args.out) / "train_subset.jsonl"
        subset.parent.mkdir(parents=True, exist_ok=True)
        subset.write_text("".join(json.dumps({"prompt": r.question, "response": r.answers[0]}) + "\n" for r in records))
        train = f"jsonl:{subset}"
    argv += ["--train", train]
    for spec in args.eval:
        argv += ["--eval", spec]
    for spec in args.unlabeled or ():
        argv += ["--unlabeled", spec]
    if args.limit is not None:
        argv += ["--limit", str(args.limit)]
    if args.load_in_4bit:
        argv.append("--load-in-4bit")
    return [*argv, *extra]


def paper_table(metrics: dict[str, Any]) -> dict[str, dict[str, dict[str, float]]]:
    """Per evaluation domain (and ``mean``), per column of :data:`COLUMNS`, the :data:`METRICS`."""
    table: dict[str, dict[str, dict[str, float]]] = {}
    for domain, d in metrics["domains"].items():
        table[domain] = {col: {m: float(d["columns"][col][m]) for m in METRICS}
                         for col in COLUMNS if d["columns"].get(col)}
    if len(table) > 1:
        cols = [c for c in COLUMNS if all(c in row for row in table.values())]
        table["mean"] = {c: {m: sum(row[c][m] for row in table.values()) / len(table) for m in METRICS} for c in cols}
    return table


def table_markdown(table: dict[str, dict[str, dict[str, float]]], metrics: dict[str, Any], argv: list[str]) -> str:
    """``paper_table.md``: the command, the temperature, and one row per domain and method."""
    fit = metrics.get("temperature") or {}
    lines = ["# The CALM paper's protocol (`--preset paper`)", "",
             "- command: `llm-calib " + " ".join(argv) + "`"]
    if fit:
        lines.append(f"- temperature scaling: T = {fit.get('temperature', math.nan):.3f}, fitted on the held-out split")
    lines += ["", "| domain | method | " + " | ".join(METRICS.values()) + " |", "|---|---|" + "---|" * len(METRICS)]
    for domain, row in table.items():
        for col, values in row.items():
            lines.append(f"| {domain} | {COLUMNS[col]} | " + " | ".join(f"{values[m]:.3f}" for m in METRICS) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Run the preset, then write ``paper_table.md`` / ``.json``; the exit status of ``calibrate``."""
    from llm_calib import cli

    args, extra = parse_args(list(sys.argv[1:] if argv is None else argv))
    command = calibrate_argv(args, extra)
    status = cli.main(command)
    if status != 0:
        return status
    out = Path(args.out)
    metrics = json.loads((out / "metrics.json").read_text())
    table = paper_table(metrics)
    (out / "paper_table.json").write_text(json.dumps(table, indent=2) + "\n")
    (out / "paper_table.md").write_text(table_markdown(table, metrics, command))
    print((out / "paper_table.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
