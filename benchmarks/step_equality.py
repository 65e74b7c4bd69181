#!/usr/bin/env python
"""Does a faster training step compute the same run? θ, λ and the history after ``--steps`` steps.

Runs :func:`llm_calib.calibrate` on the tiny random Llama (4 layers, hidden 64, float32) for
LoRA-CE and CALM with each registered solver, writes a checkpoint at the last step and compares
its θ (``theta/``), λ (``lam/``), selected θ and λ, and every number of the history (per-step
losses and solver diagnostics, held-out metrics every 5 steps) between two trees: this one and
the one given by ``--compare`` (run with ``PYTHONPATH`` set to it). Only the public API is used,
so an older tree runs the same script.

Usage (repository root)::

    python benchmarks/step_equality.py --compare /path/to/old/tree          # prints the largest differences
    python benchmarks/step_equality.py --compare OLD --out benchmarks/results/step_equality.md
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
METHODS = ("lora_ce", "calm:bome", "calm:f2sa", "calm:implicit")


def objective(method: str) -> Any:
    import llm_calib

    if method == "lora_ce":
        return llm_calib.LoraCE()
    return llm_calib.Calm(solver={"name": method.split(":", 1)[1]})


def dump(method: str, steps: int, out: Path) -> None:
    """Run ``method`` for ``steps`` steps; write its last checkpoint's tensors and the history under ``out``."""
    import llm_calib
    # the tree's own module (an editable install elsewhere may answer for modules this tree lacks)
    if (Path(llm_calib.__file__).parent / "files" / "checkpoint.py").is_file():
        from llm_calib.files.checkpoint import latest_checkpoint, load_checkpoint
    else:  # the layout before llm_calib.files: an older tree measured side by side (--compare)
        import importlib

        before = importlib.import_module("llm_calib.checkpoint")
        latest_checkpoint, load_checkpoint = before.latest_checkpoint, before.load_checkpoint
    from llm_calib.data import builtin_multiple_choice
    from llm_calib.models import tiny_random_model

    torch.set_num_threads(1)
    model, tok = tiny_random_model(seed=0, hidden_size=64, num_layers=4)
    qs = builtin_multiple_choice(n_per_domain=8, seed=0)
    config = llm_calib.CalibrationConfig(
        objective=objective(method),
        training=llm_calib.TrainingSettings(steps=steps, batch_size=8, heldout_batch_size=8),
        selection=llm_calib.SelectionSettings(eval_every=5, guard_accuracy=0.0), checkpoint_every=steps)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = llm_calib.calibrate(model, tok, qs[::2], qs[1::2], config, checkpoint_dir=out / "ckpt", progress=False)
    tensors, _ = load_checkpoint(latest_checkpoint(out / "ckpt"))
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "tensors.safetensors"))
    (out / "history.json").write_text(json.dumps({"history": result.history, "metrics": result.metrics}))


def _numbers(history: list[dict[str, Any]]) -> dict[str, float]:
    return {f"{i}/{k}": float(v) for i, rec in enumerate(history) for k, v in rec.items()
            if isinstance(v, (int, float))}


def compare_dumps(a: Path, b: Path) -> dict[str, Any]:
    """Largest absolute differences between two dumps (tensors by prefix, history numbers), and
    the keys present in only one."""
    from safetensors.torch import load_file

    ta, tb = load_file(str(a / "tensors.safetensors")), load_file(str(b / "tensors.safetensors"))
    out: dict[str, Any] = {"tensor_keys_only_in_one": sorted(set(ta) ^ set(tb))}
    for key in sorted(set(ta) & set(tb)):
        prefix = key.split("/", 1)[0]
        diff = float((ta[key].double() - tb[key].double()).abs().max()) if ta[key].numel() else 0.0
        out[f"max|Δ| {prefix}"] = max(out.get(f"max|Δ| {prefix}", 0.0), diff)
    ha, hb = (json.loads((p / "history.json").read_text()) for p in (a, b))
    na, nb = _numbers(ha["history"]), _numbers(hb["history"])
    out["history_keys_only_in_one"] = sorted(set(na) ^ set(nb))
    common = set(na) & set(nb)
    finite = [abs(na[k] - nb[k]) for k in common if math.isfinite(na[k]) and math.isfinite(nb[k])]
    out["max|Δ| history"] = max(finite, default=0.0)
    worst = max(common, key=lambda k: abs(na[k] - nb[k]) if math.isfinite(na[k] - nb[k]) else -1, default=None)
    out["history worst entry"] = worst
    held = [k for k in common if "/heldout_" in k]
    out["max|Δ| held-out history"] = max((abs(na[k] - nb[k]) for k in held), default=0.0)
    out["history entries"] = len(common)
    out["steps"] = len(ha["history"])
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--compare", help="the other tree (PYTHONPATH for its run)")
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--out", help="write the report (markdown) here")
    p.add_argument("--dump", nargs=2, metavar=("METHOD", "DIR"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.dump:
        dump(args.dump[0], args.steps, Path(args.dump[1]))
        return 0
    if not args.compare:
        p.error("--compare DIR is required")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for method in args.methods.split(","):
            dirs = {}
            for label, tree in (("before", Path(args.compare).resolve()), ("after", ROOT)):
                d = Path(tmp) / f"{label}_{method.replace(':', '_')}"
                d.mkdir()
                env = dict(os.environ, PYTHONPATH=str(tree), OMP_NUM_THREADS="1")
                proc = subprocess.run([sys.executable, __file__, "--steps", str(args.steps), "--dump", method, str(d)],
                                      env=env, capture_output=True, text=True, cwd=str(tree), check=False)
                if proc.returncode:
                    raise SystemExit(f"{label} {method} failed:\n{proc.stderr[-3000:]}")
                dirs[label] = d
            row = {"method": method, **compare_dumps(dirs["before"], dirs["after"])}
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.out:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from harness.report import machine_info, machine_line

        meta = machine_info(threads=1)
        lines = ["# Same run after the faster step? (`benchmarks/step_equality.py`)", "",
                 f"- Command: `python benchmarks/step_equality.py {' '.join(sys.argv[1:])}`; date {meta['date']}",
                 machine_line(meta),
                 f"- Before: `{Path(args.compare).resolve()}`; after: `{ROOT}`; tiny random Llama (4 layers, hidden 64), "
                 f"float32, {args.steps} steps, held-out evaluation every 5 steps", "",
                 "| method | max abs Δ θ | Δ λ | Δ selected θ | Δ selected λ | Δ history (all numbers) | "
                 "Δ held-out history | entries | keys only in one |", "|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            lines.append(f"| {r['method']} | {r.get('max|Δ| theta', 0):.2e} | {r.get('max|Δ| lam', 0):.2e} | "
                         f"{r.get('max|Δ| best_theta', 0):.2e} | {r.get('max|Δ| best_lam', 0):.2e} | "
                         f"{r['max|Δ| history']:.2e} (worst: {r['history worst entry']}) | "
                         f"{r['max|Δ| held-out history']:.2e} | {r['history entries']} | "
                         f"{len(r['tensor_keys_only_in_one']) + len(r['history_keys_only_in_one'])} |")
        Path(args.out).write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
