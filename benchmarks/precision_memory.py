"""Time and peak memory of a short ``llm-calib calibrate`` in float32 and bfloat16, and the memory
formula of docs/tutorials/multi_gpu.md checked against them.

Each setting is one ``llm-calib calibrate`` process (CALM, LoRA rank 8 on the top 6 of SmolLM2's
30 layers, ``--steps 10 --limit 100``), run in turn; peak memory is the process's peak resident
set size (``ru_maxrss`` of the child), time is the training phase (``train_total_s`` in
``metrics.json``) and the whole process. The formula's prediction for the same run is printed
next to the measured peak above the process's resident size just after loading the model.

Run::

    python benchmarks/precision_memory.py --data-dir ../shared/data
    python benchmarks/precision_memory.py --table          # the docs table (formula only)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

GB = 1e9


@dataclass(frozen=True)
class Shape:
    """A decoder's dimensions (Llama-style, SwiGLU)."""

    name: str
    params: float  # total parameters
    layers: int
    hidden: int
    kv_hidden: int  # num_key_value_heads * head_dim
    intermediate: int
    vocab: int
    tied: bool = False

    @property
    def embedding_params(self) -> float:
        return self.vocab * self.hidden * (1 if self.tied else 2)


SHAPES = {
    "smollm2-135m": Shape("SmolLM2-135M", 134.5e6, 30, 576, 192, 1536, 49152, tied=True),
    "1b": Shape("Llama-3.2-1B", 1.24e9, 16, 2048, 512, 8192, 128256, tied=True),
    "8b": Shape("Llama-3.1-8B", 8.03e9, 32, 4096, 1024, 14336, 128256),
    "70b": Shape("Llama-3.1-70B", 70.6e9, 80, 8192, 1024, 28672, 128256),
}


def peak_bytes(shape: Shape, *, weights: str, top_k: int, rank: int = 8, batch: int = 8, tokens: float = 200,
               cached: int = 600, rows: int = 160, checkpointing: bool = False) -> dict[str, float]:
    """The terms of the memory formula (bytes).

    * weights: float32 4 B, bf16 2 B, NF4 0.53 B per linear-layer parameter (4 bits + double-quantised
      scales) with embeddings and head in bf16;
    * trunk cache: ``cached`` questions x ``tokens`` x hidden, in the compute dtype, kept for the run;
    * activations of one batch through the ``top_k`` trained layers: per token and layer about
      ``6 d + 2 d_kv + 3 I`` values (norm inputs, q/k/v, attention output, SwiGLU's gate/up/product;
      SDPA keeps no T x T scores); with checkpointing only each layer's input plus one layer's set;
    * output head at the ``rows`` gathered positions: float32 logits, log-softmax and their gradient;
    * LoRA on q_proj and v_proj of the trained layers: float32 parameter, gradient, Adam's two
      moments and BOME's copy (5 x 4 B).
    """
    s = 4 if weights == "float32" else 2
    lin = shape.params - shape.embedding_params
    w = {"float32": 4 * shape.params, "bfloat16": 2 * shape.params,
         "4bit": 0.53 * lin + 2 * shape.embedding_params}[weights]
    n_tok = batch * tokens
    per_layer = 6 * shape.hidden + 2 * shape.kv_hidden + 3 * shape.intermediate
    if checkpointing:
        act = (top_k * shape.hidden + per_layer) * n_tok * s
    else:
        act = top_k * per_layer * n_tok * s
    head = 3 * rows * shape.vocab * 4
    lora = top_k * rank * (2 * shape.hidden + shape.hidden + shape.kv_hidden) * 5 * 4
    cache = cached * tokens * shape.hidden * s
    return {"weights": w, "trunk_cache": cache, "activations": act, "head": head, "lora": lora,
            "total": w + cache + act + head + lora}


def table() -> str:
    lines = ["| model | weights | top k | checkpointing | weights GB | trunk cache GB | activations GB | head GB | total GB |",
             "|---|---|---|---|---|---|---|---|---|"]
    for key in ("1b", "8b", "70b"):
        shape = SHAPES[key]
        k = max(1, shape.layers // 8)
        for weights in ("bfloat16", "4bit"):
            for ckpt in (False, True):
                t = peak_bytes(shape, weights=weights, top_k=k, checkpointing=ckpt)
                lines.append(f"| {shape.name} | {weights} | {k} | {'yes' if ckpt else 'no'} | {t['weights'] / GB:.1f} | "
                             f"{t['trunk_cache'] / GB:.2f} | {t['activations'] / GB:.2f} | {t['head'] / GB:.2f} | "
                             f"{t['total'] / GB:.1f} |")
    return "\n".join(lines)


def run(dtype: str, data_dir: str, out: Path, extra: list[str]) -> dict:
    argv = [sys.executable, "-m", "llm_calib.cli", "calibrate", "--model", "smollm2-135m-instruct",
            "--train", f"arc_easy:{data_dir}:train", "--heldout", f"arc_easy:{data_dir}:dev",
            "--eval", f"arc_easy:{data_dir}:dev", "--limit", "100", "--methods", "calm", "--steps", "10",
            "--eval-every", "10", "--lora-layers", "24,25,26,27,28,29", "--lora-rank", "8", "--bootstrap", "0",
            "--no-progress", "--dtype", dtype, "--out", str(out), *extra]
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    stderr = proc.stderr.read()
    if status != 0:
        raise RuntimeError(f"{dtype}: exit {status}\n{stderr[-3000:]}")
    metrics = json.loads((out / "metrics.json").read_text())
    tr = metrics["training"]["calm"]
    return {"dtype": dtype, "extra": extra, "wall_s": wall, "peak_rss_mb": usage.ru_maxrss / 1024,
            "train_s": tr["timings"]["train_total_s"], "heldout_before": tr["heldout_before"],
            "heldout_after": tr["heldout_after"], "command": " ".join(argv[1:])}


def _child_peak_mb(code: str) -> float:
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _, status, usage = os.wait4(proc.pid, 0)
    if status != 0:
        raise RuntimeError(f"{code!r} failed")
    return usage.ru_maxrss / 1024


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data-dir", default="../shared/data")
    p.add_argument("--table", action="store_true", help="print the docs table and exit")
    p.add_argument("--out", default="benchmarks/results/precision_memory.json")
    args = p.parse_args()
    if args.table:
        print(table())
        return 0
    results = []
    imports = _child_peak_mb("import llm_calib.cli, llm_calib.calm.trainer, peft, transformers")
    with tempfile.TemporaryDirectory() as tmp:
        for dtype in ("float32", "bfloat16"):
            r = run(dtype, args.data_dir, Path(tmp) / dtype, [])
            r["import_rss_mb"] = imports
            r["load_only_rss_mb"] = _child_peak_mb(
                f"from llm_calib.models import load; load('smollm2-135m-instruct', dtype='{dtype}')")
            print(json.dumps(r), flush=True)
            results.append(r)
    shape = SHAPES["smollm2-135m"]
    for r in results:
        # this run: 6 trained layers; ~100 train + 100 held-out questions cached, ~120 tokens packed
        r["formula"] = {k: v / 2**20 for k, v in peak_bytes(
            shape, weights=r["dtype"], top_k=6, batch=8, tokens=120, cached=200, rows=100).items()}
    machine = {"cpus": os.cpu_count(), "torch": torch.__version__, "python": platform.python_version(),
               "processor": platform.processor(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    Path(args.out).write_text(json.dumps({"machine": machine, "results": results}, indent=2))
    print(json.dumps(machine))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
