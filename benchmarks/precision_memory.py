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
    python benchmarks/precision_memory.py --sharded-table  # per GPU, base sharded by FSDP2 (formula only)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from harness.report import machine_info

from llm_calib.calm.run import resolve_run

GB = 1e9
# the SmolLM2 run's batches (ARC-Easy, limit 100): padded batch length of 8 questions, mean packed
# length of a cached question, gathered rows per batch of 8 (measured on the encoded records)
TOKENS, CACHE_TOKENS, ROWS = 115, 76, 115


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
               cached: int = 600, rows: int = 160, checkpointing: bool = False,
               cache_tokens: float | None = None) -> dict[str, float]:
    """The terms of the memory formula (bytes).

    * weights: float32 4 B, bf16 2 B, NF4 0.53 B per linear-layer parameter (4 bits + double-quantised
      scales) with embeddings and head in bf16;
    * trunk cache: ``cached`` questions x ``tokens`` x hidden, in the compute dtype, kept for the run;
    * activations of one batch through the ``top_k`` trained layers: per token and layer about
      ``6 d + 2 d_kv + 3 I`` values (norm inputs, q/k/v, attention output, SwiGLU's gate/up/product;
      SDPA keeps no T x T scores) of 4 B (float32) or 2.8 B (bf16, float32 copies included); with
      checkpointing only each layer's input plus one layer's set, recomputed in the backward;
    * output head at the ``rows`` gathered positions: float32 logits, log-softmax and their gradient;
    * LoRA on q_proj and v_proj of the trained layers: float32 parameter, gradient, Adam's two
      moments and BOME's copy (5 x 4 B).
    """
    s = 4 if weights == "float32" else 2
    # bytes per activation value: in bf16 the norms, softmax and rotary embedding keep float32 copies
    # for the backward (measured on SmolLM2: 1.39 x the bf16 count; float32: 1.04 x the float32 count)
    s_act = 4 if weights == "float32" else 2.8
    lin = shape.params - shape.embedding_params
    w = {"float32": 4 * shape.params, "bfloat16": 2 * shape.params,
         "4bit": 0.53 * lin + 2 * shape.embedding_params}[weights]
    n_tok = batch * tokens
    per_layer = 6 * shape.hidden + 2 * shape.kv_hidden + 3 * shape.intermediate
    if checkpointing:
        act = (top_k * shape.hidden * s + per_layer * s_act) * n_tok
    else:
        act = top_k * per_layer * n_tok * s_act
    head = 3 * rows * shape.vocab * 4
    lora = top_k * rank * (2 * shape.hidden + shape.hidden + shape.kv_hidden) * 5 * 4
    cache = cached * (tokens if cache_tokens is None else cache_tokens) * shape.hidden * s
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


def sharded_table(ranks: tuple[int, ...] = (2, 4, 8)) -> str:
    """Per-rank peak memory with the bf16 base sharded by FSDP2 over ``ranks`` GPUs, the same batch per rank.

    Each rank stores ``1/ranks`` of the weights (the norms and LoRA, replicated, are negligible)
    plus, while a sharded unit runs, its gathered weights: at most the largest unit (a frozen
    decoder layer, or the embeddings or the head), freed after its pass (every unit is resharded
    after its forward). The trunk cache is not sharded: every rank computes it for every question
    before the first step and scores the whole held-out set. Activations and the head are those of the
    per-rank batch (8 questions, a global batch of ``8 x ranks``).
    """
    lines = ["| model | GPUs | top k | checkpointing | weight shard GB | largest gathered unit GB | trunk cache GB "
             "| activations GB | head GB | total per GPU GB |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for key in ("8b", "70b"):
        shape = SHAPES[key]
        k = max(1, shape.layers // 8)
        layer = 2 * (shape.params - shape.embedding_params) / shape.layers
        unit = max(layer, 2 * shape.vocab * shape.hidden)
        for n in ranks:
            for ckpt in (False, True):
                t = peak_bytes(shape, weights="bfloat16", top_k=k, checkpointing=ckpt)
                shard = t["weights"] / n
                total = shard + unit + t["trunk_cache"] + t["activations"] + t["head"] + t["lora"]
                lines.append(f"| {shape.name} | {n} | {k} | {'yes' if ckpt else 'no'} | {shard / GB:.1f} | "
                             f"{unit / GB:.2f} | {t['trunk_cache'] / GB:.2f} | {t['activations'] / GB:.2f} | "
                             f"{t['head'] / GB:.2f} | {total / GB:.1f} |")
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


def child(dtype: str, data: str) -> None:
    """The measured process of :func:`in_process`: imports, loads the model and data, then ``llm_calib.calibrate``
    inside a :class:`harness.profiling.Phase` (``VmHWM`` reset at its start); prints one JSON line."""
    from harness.profiling import Phase, proc_status

    import llm_calib
    from llm_calib.data import load as load_data
    from llm_calib.models import free_memory, load

    free_memory()
    imported = proc_status()["VmRSS"]
    model, tok = load("smollm2-135m-instruct", dtype=dtype)
    train = load_data(f"arc_easy:{data}:train", limit=100, seed=0).records
    heldout = load_data(f"arc_easy:{data}:dev", limit=100, seed=0).records
    free_memory()
    loaded = proc_status()["VmRSS"]
    cfg = llm_calib.CalibrationConfig(training={"steps": 10}, selection={"eval_every": 10},
                                      lora=dict(rank=8, layers=list(range(24, 30))))
    with Phase() as p:
        result = llm_calib.calibrate(model, tok, train, heldout, cfg, progress=False)
    print(json.dumps({"dtype": dtype, "import_rss_mb": imported / 2**20, "loaded_rss_mb": loaded / 2**20,
                      "calibrate_peak_rss_mb": p.peak / 2**20, "calibrate_s": p.seconds,
                      "train_s": result.timings["train"], "after": result.metrics["after"],
                      "before": result.metrics["before"]}))


def in_process(dtype: str, data_dir: str) -> dict:
    """``llm_calib.calibrate`` in a child process: resident size after the imports and after
    loading, and the peak during calibrate alone (``VmHWM`` reset at its start)."""
    out = subprocess.run([sys.executable, __file__, "--child", dtype, data_dir], capture_output=True, text=True,
                         check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def measured_terms(dtype: str, data_dir: str, checkpointing: bool = False) -> dict[str, float]:
    """The formula's terms measured on the tensors themselves (bytes): parameter storage, the trunk
    cache after a run's encodings are filled, and the tensors autograd saves for the backward of
    one training loss g on a batch of 8 (``saved_tensors_hooks``, each storage counted once),
    split into the output head's (vocabulary-sized) and the layers' activations."""
    from llm_calib.calm import training
    from llm_calib.config.calibration import CalibrationConfig
    from llm_calib.data import load as load_data
    from llm_calib.models import load

    model, tok = load("smollm2-135m-instruct", dtype=dtype, gradient_checkpointing=checkpointing)
    train = load_data(f"arc_easy:{data_dir}:train", limit=100, seed=0).records
    heldout = load_data(f"arc_easy:{data_dir}:dev", limit=100, seed=0).records
    cfg = CalibrationConfig(lora=dict(rank=8, layers=list(range(24, 30))))
    trainer = training.build_trainer(model, tok, train, heldout, resolve_run(cfg, train, heldout))
    for enc in (trainer.train, trainer.heldout):
        enc.fill_trunk_cache(trainer.lm, trainer.pad_id)
    theta = {k: v.requires_grad_(True) for k, v in trainer.lm.theta().items()}
    lam = trainer.adjustment.init(dtype=torch.float32)
    batch = trainer.train_batch(0)
    seen: dict[int, tuple[int, bool]] = {}
    vocab = model.config.vocab_size

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.device.type != "meta" and t.untyped_storage().data_ptr() not in seen:
            seen[t.untyped_storage().data_ptr()] = (t.untyped_storage().nbytes(), t.dim() > 0 and t.shape[-1] == vocab)
        return t

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    with trainer.lm.train_mode(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = trainer.losses.inner(theta, lam, batch)
    loss.backward()
    saved = {k: v for k, v in seen.items() if k not in params}
    return {
        "weights": sum(p.numel() * p.element_size() for p in model.parameters()),
        "trunk_cache": trainer.train.trunk_cache_bytes + trainer.heldout.trunk_cache_bytes,
        "activations": sum(n for n, is_head in saved.values() if not is_head),
        "head": sum(n for n, is_head in saved.values() if is_head),
        "batch_tokens": int(batch.packed.input_ids.numel()), "rows": int(batch.packed.rows.numel()),
    }


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
    p.add_argument("--sharded-table", action="store_true",
                   help="print the docs table of per-GPU memory with the base sharded by FSDP2, and exit")
    p.add_argument("--out", default="benchmarks/results/precision_memory.json")
    p.add_argument("--terms", action="store_true", help="measure the formula's terms on the tensors")
    p.add_argument("--in-process", action="store_true",
                   help="measure llm_calib.calibrate alone in a child process (peak during calibrate)")
    p.add_argument("--child", nargs=2, metavar=("DTYPE", "DATA_DIR"), help=argparse.SUPPRESS)  # in_process's child
    args = p.parse_args()
    if args.child:
        child(*args.child)
        return 0
    if args.terms:
        shape = SHAPES["smollm2-135m"]
        rows = []
        for dtype, ckpt in (("float32", False), ("bfloat16", False), ("bfloat16", True)):
            m = measured_terms(dtype, args.data_dir, ckpt)
            tokens = m["batch_tokens"] / 8
            f = peak_bytes(shape, weights=dtype, top_k=6, batch=8, tokens=tokens, cached=200, rows=m["rows"],
                           cache_tokens=m["trunk_cache"] / (200 * shape.hidden * (4 if dtype == "float32" else 2)),
                           checkpointing=ckpt)
            r = {"dtype": dtype, "checkpointing": ckpt, "measured_mb": {k: v / 2**20 for k, v in m.items()
                                                                         if k not in ("batch_tokens", "rows")},
                 "formula_mb": {k: f[k] / 2**20 for k in ("weights", "trunk_cache", "activations", "head")},
                 "batch_tokens": m["batch_tokens"], "rows": m["rows"]}
            print(json.dumps(r), flush=True)
            rows.append(r)
        Path(args.out).with_name("precision_memory_terms.json").write_text(json.dumps(rows, indent=2))
        return 0
    if args.in_process:
        shape = SHAPES["smollm2-135m"]
        rows = []
        for dtype in ("float32", "bfloat16"):
            r = in_process(dtype, args.data_dir)
            r["formula_mb"] = {k: v / 2**20 for k, v in peak_bytes(
                shape, weights=dtype, top_k=6, batch=8, tokens=TOKENS, cached=200, rows=ROWS,
                cache_tokens=CACHE_TOKENS).items()}
            print(json.dumps(r), flush=True)
            rows.append(r)
        Path(args.out).with_name("precision_memory_in_process.json").write_text(json.dumps(rows, indent=2))
        return 0
    if args.table:
        print(table())
        return 0
    if args.sharded_table:
        print(sharded_table())
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
            shape, weights=r["dtype"], top_k=6, batch=8, tokens=TOKENS, cached=200, rows=ROWS,
            cache_tokens=CACHE_TOKENS).items()}
    machine = machine_info()
    Path(args.out).write_text(json.dumps({"machine": machine, "results": results}, indent=2))
    print(json.dumps(machine))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
