#!/usr/bin/env python
"""Where one default CALM step, one LoRA-CE step and one scoring pass spend their CPU time.

Usage (from the repository root)::

    python benchmarks/calm_step_profile.py                      # SmolLM2-135M-Instruct, 1 thread, prints a table
    ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 python benchmarks/calm_step_profile.py  # AVX2 proxy
    python benchmarks/calm_step_profile.py --json out.json      # also the raw numbers

One thread (``torch.set_num_threads(1)``) and CPU time (the thread's CPU clock, the profiler's
self-CPU per operator), so that other jobs on a shared machine change the numbers little; the load
average is printed beside them. The step is ``llm_calib.calm.training.train_step`` at the defaults
of ``calibrate`` (``CalibrationConfig()``: BOME with 5 inner steps, LoRA rank 8 on q/v of the top 6
layers with the frozen trunk cached, batch 8 + 8 held-out questions); the CE step is the same run
with ``objective=LoraCE()`` on the same batch; the scoring pass is ``score_option_likelihood`` of
ARC-Easy test questions with the uncalibrated model. Operators are grouped by what they compute
(matrix shapes tell the output head, the LoRA factors and the layers' own projections apart);
"Python and framework overhead" is the step's CPU time minus the operators' self-CPU time.
The GEMM rate of the machine is that of a plain ``torch.mm`` at the model's shapes, 1 thread.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the shared helpers beside this script
from harness.report import load_averages, machine_info

import hypergrad as hg
from llm_calib.calm import training
from llm_calib.calm.encoding import EncodedRecords
from llm_calib.calm.run import resolve_run
from llm_calib.config.calibration import CalibrationConfig
from llm_calib.data import load as load_data
from llm_calib.models import load, random_init_model, tiny_random_model
from llm_calib.objectives.lora_ce import LoraCE
from llm_calib.scoring.option_likelihood import score_option_likelihood

ROOT = Path(__file__).resolve().parent.parent
ALIAS = "smollm2-135m-instruct"
GEMM_OPS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm"}
SCOPE_OPTIMIZER = "## optimizer updates (inner SGD, theta Adam, lambda Adam)"
SCOPE_BATCH = "## batch assembly (sampling, padding, masks, trunk lookup)"
GROUPS = (
    "GEMMs in the adapted layers (q/k/v/o, MLP)",
    "LoRA factor GEMMs (rank r)",
    "attention (scaled dot product, fwd + bwd)",
    "output head GEMM (hidden -> vocab)",
    "vocabulary-wide ops (log-softmax, logsumexp, their grads)",
    "other operators (norms, rotary, elementwise, copies)",
    SCOPE_OPTIMIZER,
    SCOPE_BATCH,
    "Python, framework and profiler overhead (call CPU time - operators)",
)


def thread_cpu() -> float:
    return time.thread_time()


def loadavg() -> list[float]:
    return [round(x, 2) for x in load_averages() or []]


def gemm_rate(shapes: list[tuple[int, int, int]], repeats: int = 5) -> dict[str, float]:
    """GFLOP/s of ``torch.mm`` (float32, the current thread count) at ``(m, k, n)`` shapes, best of ``repeats``."""
    out = {}
    for m, k, n in shapes:
        a, b = torch.randn(m, k), torch.randn(k, n)
        torch.mm(a, b)
        best = float("inf")
        for _ in range(repeats):
            c0 = thread_cpu()
            torch.mm(a, b)
            best = min(best, thread_cpu() - c0)
        out[f"{m}x{k}x{n}"] = 2 * m * k * n / best / 1e9
    return out


def _ancestors(event: Any) -> list[str]:
    names, parent = [], event.cpu_parent
    while parent is not None:
        names.append(parent.name)
        parent = parent.cpu_parent
    return names


def classify(event: Any, vocab: int, rank: int) -> str:
    """The group of one profiled operator (see :data:`GROUPS`)."""
    above = _ancestors(event)
    for scope in (SCOPE_OPTIMIZER, SCOPE_BATCH):
        if scope in above:
            return scope
    name, shapes = event.name, [s for s in (event.input_shapes or []) if s]
    dims = {d for s in shapes for d in s}
    if "attention" in name or any("attention" in a for a in above[:3]):
        return GROUPS[2]
    if name in GEMM_OPS:
        if vocab in dims:
            return GROUPS[3]
        if rank in {d for s in shapes if len(s) == 2 for d in s}:
            return GROUPS[1]
        if name in ("aten::bmm", "aten::baddbmm") and any(len(s) >= 3 for s in shapes):
            return GROUPS[2]
        return GROUPS[0]
    if any(s[-1] == vocab for s in shapes):
        return GROUPS[4]
    return GROUPS[5]


def profile_call(fn: Callable[[], Any], vocab: int, rank: int, cpu_s: float) -> dict[str, Any]:
    """CPU seconds and FLOPs per group of one profiled call of ``fn``; ``cpu_s``: its unprofiled CPU time.

    The profiler times operators by the wall clock, which other jobs on the machine stretch; each
    operator's self time is converted to CPU time with the call's own CPU / wall ratio (the load
    stretches every operator alike), and what the operators leave of the call's CPU time is Python,
    framework and profiler overhead.
    """
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True, with_flops=True) as prof:
        c0, t0 = thread_cpu(), time.perf_counter()
        fn()
        profiled_cpu_s, profiled_wall_s = thread_cpu() - c0, time.perf_counter() - t0
    to_cpu = profiled_cpu_s / profiled_wall_s
    groups: dict[str, float] = defaultdict(float)
    flops: dict[str, float] = defaultdict(float)
    ops: dict[str, float] = defaultdict(float)
    for ev in prof.events():
        if ev.name.startswith("## "):
            continue
        g = classify(ev, vocab, rank)
        groups[g] += ev.self_cpu_time_total / 1e6 * to_cpu
        ops[ev.name] += ev.self_cpu_time_total / 1e6 * to_cpu
        if ev.name in GEMM_OPS:
            flops[g] += float(ev.flops or 0)
    op_total = sum(groups.values())
    groups[GROUPS[-1]] = max(profiled_cpu_s - op_total, 0.0)
    top_ops = sorted(ops.items(), key=lambda kv: -kv[1])[:15]
    return {"groups": dict(groups), "flops": dict(flops), "op_cpu_s": op_total, "cpu_s": cpu_s,
            "profiled_cpu_s": profiled_cpu_s, "profiled_wall_s": profiled_wall_s, "top_ops": top_ops}


def instrument(trainer: Any, state: Any) -> None:
    """Put the optimiser updates and batch assembly of a run in profiler scopes (this process only)."""
    def scoped(fn: Callable[..., Any], label: str) -> Callable[..., Any]:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            with record_function(label):
                return fn(*args, **kwargs)
        return wrapped

    for cls in (hg.inner.SGD, hg.inner.Adam):
        if not getattr(cls.update, "_scoped", False):
            cls.update = scoped(cls.update, SCOPE_OPTIMIZER)
            cls.update._scoped = True  # type: ignore[attr-defined]
    lam_optimizer = getattr(state.objective_state, "lam_optimizer", None)
    if lam_optimizer is not None:
        lam_optimizer.step = scoped(lam_optimizer.step, SCOPE_OPTIMIZER)
    trainer.train_batch = scoped(trainer.train_batch, SCOPE_BATCH)
    trainer.unlabeled_batch = scoped(trainer.unlabeled_batch, SCOPE_BATCH)


def median_cpu(fn: Callable[[], Any], repeats: int) -> tuple[float, list[float]]:
    samples = []
    for _ in range(repeats):
        c0 = thread_cpu()
        fn()
        samples.append(thread_cpu() - c0)
    return statistics.median(samples), samples


def build(kind: str) -> tuple[Any, Any]:
    if kind == "real":
        return load(ALIAS)
    if kind == "random":
        return random_init_model(ALIAS, 0)
    return tiny_random_model(0, hidden_size=32, num_layers=8)


def arc(data_dir: Path, split: str, n: int, seed: int = 0) -> list[Any]:
    records = list(load_data(f"arc_easy:{data_dir}:{split}", on_error="skip").records)
    idx = torch.randperm(len(records), generator=torch.Generator().manual_seed(seed))[:n].tolist()
    return [records[i] for i in idx]


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    if args.whole_batches:
        whole = EncodedRecords.batch
        EncodedRecords.batch = lambda self, indices, pad_id, lm=None, split=True: whole(self, indices, pad_id, lm, split=False)
    model, tok = build(args.model)
    vocab = int(model.get_output_embeddings().weight.shape[0])
    train, heldout = arc(args.data_dir, "train", 64), arc(args.data_dir, "dev", 64)
    test = arc(args.data_dir, "test", args.n_score)
    config = CalibrationConfig()
    if args.inner_steps is not None:
        config = replace(config, objective=replace(config.objective, solver=replace(config.objective.solver,
                                                                                      inner_steps=args.inner_steps)))
    out: dict[str, Any] = {"config": config.to_dict(), "vocab": vocab, "load_start": loadavg(),
                           "capability": torch.backends.cpu.get_cpu_capability(),
                           "env": {k: os.environ.get(k) for k in ("ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS")}}
    out["score"] = {}
    fn = lambda: score_option_likelihood(model, tok, test, batch_size=args.score_batch)  # noqa: E731
    fn()
    cpu, samples = median_cpu(fn, args.repeats)
    out["score"] = {"n": len(test), "batch": args.score_batch, "cpu_s": cpu, "samples": samples, "load": loadavg(),
                    **profile_call(fn, vocab, config.lora.rank, cpu)}
    runs = {}
    for kind, objective in (("bome", config.objective), ("ce", LoraCE())):
        trainer = training.build_trainer(copy.deepcopy(model), tok, train, heldout, resolve_run(replace(config, objective=objective), train, heldout))
        state = training.init_state(trainer, evaluate_before=False)
        trainer.fill_trunk_caches()
        instrument(trainer, state)
        runs[kind] = (trainer, state)
    first = runs["bome"][0].train_batch(0)
    rows, tokens = int(first.packed.rows.numel()), int(first.packed.input_ids.numel())
    out["batch_questions"], out["batch_tokens"], out["batch_rows"] = first.packed.batch_size, tokens, rows
    out["batch_part_tokens"] = sum(int(p.packed.input_ids.numel()) for p in first.parts) if first.parts else tokens
    for kind, (trainer, state) in runs.items():
        step = lambda trainer=trainer, state=state: training.train_step(trainer, state)  # noqa: E731
        step()  # warm-up
        cpu, samples = median_cpu(step, args.repeats)
        out[kind] = {"cpu_s": cpu, "samples": samples, "load": loadavg(),
                     **profile_call(step, vocab, config.lora.rank, cpu)}
    out["ratio_cpu"] = out["bome"]["cpu_s"] / out["ce"]["cpu_s"]
    h = model.config.hidden_size
    inter = model.config.intermediate_size
    kv = model.config.num_key_value_heads * (h // model.config.num_attention_heads)
    out["gemm_rate"] = gemm_rate([(tokens, h, h), (tokens, h, kv), (tokens, h, inter), (tokens, inter, h),
                                  (rows, h, vocab)])
    out["load_end"] = loadavg()
    out["meta"] = machine_info(args.threads)
    return out


def render(r: dict[str, Any], command: str) -> str:
    """The markdown tables of a :func:`run` result."""
    peak = max(r["gemm_rate"].values())
    kinds = ("bome", "ce", "score")
    lines = [f"- Command: `{command}`; {r['meta']['date']}",
             f"- Machine: {r['meta']['cpu']}, {r['meta']['cores']} cores, 1 torch thread; ATen CPU capability "
             f"{r['capability']} (env {r['env']}); torch {r['meta']['torch']}",
             f"- Load average (1, 5, 15 min): start {r['load_start']}, BOME {r['bome']['load']}, CE {r['ce']['load']}, "
             f"scoring {r['score']['load']}, end {r['load_end']}",
             f"- Step batch: {r['batch_questions']} questions, {r['batch_tokens']} padded tokens "
             f"({r['batch_part_tokens']} in its length parts), {r['batch_rows']} head rows; vocabulary {r['vocab']}; "
             f"scoring: {r['score']['n']} ARC-Easy test questions, batch {r['score']['batch']}", "",
             "| group | BOME step CPU s | % | CE step CPU s | % | scoring pass CPU s | % |", "|---|---|---|---|---|---|---|"]
    for g in GROUPS:
        cells = []
        for k in kinds:
            v = r[k]["groups"].get(g, 0.0)
            cells += [f"{v:.3f}", f"{100 * v / r[k]['profiled_cpu_s']:.1f}"]
        lines.append(f"| {g} | " + " | ".join(cells) + " |")
    lines.append("| profiled call (thread CPU s) | " + " | ".join(f"{r[k]['profiled_cpu_s']:.3f} | 100" for k in kinds) + " |")
    lines.append("| **unprofiled call, median thread CPU s** | " + " | ".join(
        f"**{r[k]['cpu_s']:.3f}** | " for k in kinds) + " |")
    lines += ["", f"BOME / CE step (thread CPU time, unprofiled medians): **{r['ratio_cpu']:.2f}**; scoring "
              f"{r['score']['n'] / r['score']['cpu_s']:.2f} questions per CPU second.", "",
              "Achieved GEMM rate, GFLOP/s (profiler FLOPs of `aten::mm`/`addmm`/`bmm` over the group's CPU time):", "",
              "| group | BOME | CE | scoring |", "|---|---|---|---|"]
    for g in (GROUPS[0], GROUPS[1], GROUPS[3]):
        cells = []
        for k in kinds:
            f, t = r[k]["flops"].get(g, 0.0), r[k]["groups"].get(g, 0.0)
            cells.append(f"{f / t / 1e9:.1f}" if f and t else "-")
        lines.append(f"| {g} | " + " | ".join(cells) + " |")
    lines += ["| all GEMM FLOPs / the whole call's CPU time | " + " | ".join(
        f"{sum(r[k]['flops'].values()) / r[k]['profiled_cpu_s'] / 1e9:.1f}" for k in kinds) + " |",
        "| GEMM FLOPs per call (GFLOP) | " + " | ".join(f"{sum(r[k]['flops'].values()) / 1e9:.1f}" for k in kinds) + " |",
        "", "Plain `torch.mm`, float32, 1 thread, at the model's shapes (m x k x n: GFLOP/s): "
        + ", ".join(f"{s}: {v:.1f}" for s, v in r["gemm_rate"].items()) + f"; best {peak:.1f}.", ""]
    for k in kinds:
        lines.append(f"Top operators ({k}, CPU s): " + ", ".join(f"`{n}` {v:.3f}" for n, v in r[k]["top_ops"][:8]))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=("real", "random", "tiny"), default="real")
    parser.add_argument("--data-dir", type=Path, default=ROOT.parent / "shared" / "data")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3, help="timed calls per configuration (median)")
    parser.add_argument("--n-score", type=int, default=16, help="ARC-Easy test questions in the scoring pass")
    parser.add_argument("--score-batch", type=int, default=16)
    parser.add_argument("--inner-steps", type=int, default=None, help="BOME's T (default: the config's)")
    parser.add_argument("--whole-batches", action="store_true",
                        help="run each training batch whole, padded to its longest question (the code before length parts)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    command = " ".join(["python benchmarks/calm_step_profile.py", *(argv if argv is not None else sys.argv[1:])])
    result = run(args)
    text = render(result, command)
    print(text)
    if args.json:
        args.json.write_text(json.dumps(result | {"command": command}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
