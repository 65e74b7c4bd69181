#!/usr/bin/env python
"""Sampling N answers per open question: the shared prompt cache (``sample_answers``) against N
separate Hugging Face ``generate`` calls per question with the same seeds.

Question (issue 41): with SmolLM2-135M-Instruct on NQ-open, N = 10, does ``sample_answers``
(each prompt's keys/values computed once and repeated for its N samples, questions batched) draw
the same token ids as ``torch.manual_seed(sample_seed(seed, q, i)); model.generate(do_sample=True,
temperature=T, top_p=P, top_k=0)``, and is it at least 3x faster?

Usage::

    PYTHONPATH=. python benchmarks/open_sampling_speed.py                 # 100 questions, writes the results
    PYTHONPATH=. python benchmarks/open_sampling_speed.py --questions 8 --no-write   # a quick look

Both sides stop a sample at its first token holding a newline or at EOS (the reference through a
``StoppingCriteria``), at most ``--max-new-tokens`` tokens, so they decode the same tokens. The
questions are split into ``--rounds`` chunks; each chunk is timed on both sides, the side that goes
first alternating, so contention on a shared machine hits both alike. Wall time and process CPU
time (all threads) are summed over the rounds. A sample "matches" when its token ids equal the
reference's (the reference may hold one more token: the newline ``sample_answers`` cuts off).
Float rounding differs between a batched and an unbatched forward, so a rare near-tie in the
sampling may flip and the two samples diverge from there; the count is reported as measured.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the shared helpers beside this script

from harness.report import load_averages, machine_info, markdown_table, provenance_lines

from llm_calib.confidence.token import encode_open_prompts
from llm_calib.data import load_nq_open
from llm_calib.engine.sampling import SamplingSettings, sample_answers, sample_seed
from llm_calib.models import load

ALIAS = "smollm2-135m-instruct"
NQ = "/work/shared/data/nq_open/NQ-open.dev.jsonl"
RESULTS = Path(__file__).resolve().parent / "results"
TARGET = 3.0


class NewlineOrEos:
    """Stop a one-row ``generate`` at a token holding a newline (as ``sample_answers`` does)."""

    def __init__(self, tokenizer: Any):
        self.tokenizer, self.cache = tokenizer, {}

    def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
        token = int(input_ids[0, -1])
        if token not in self.cache:
            self.cache[token] = "\n" in self.tokenizer.decode([token])
        return torch.tensor([self.cache[token]], device=input_ids.device)


def reference(model: Any, tok: Any, prompts: list[list[int]], indices: list[int], settings: SamplingSettings) -> list:
    """N separate ``generate`` calls per question, seeded as ``sample_answers`` seeds its samples."""
    from transformers import StoppingCriteriaList

    stop = StoppingCriteriaList([NewlineOrEos(tok)])
    out = []
    with torch.inference_mode():
        for q, prompt in zip(indices, prompts, strict=True):
            ids = torch.tensor([prompt])
            rows = []
            for i in range(settings.n):
                torch.manual_seed(sample_seed(settings.seed, q, i))
                gen = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True,
                                     temperature=settings.temperature, top_p=settings.top_p, top_k=0,
                                     max_new_tokens=settings.max_new_tokens, pad_token_id=tok.pad_token_id,
                                     stopping_criteria=stop)
                rows.append(gen[0, len(prompt):].tolist())
            out.append(rows)
    return out


def timed(fn: Any) -> tuple[Any, float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    result = fn()
    return result, time.perf_counter() - wall, time.process_time() - cpu


def same(sample: tuple[int, ...], ref: list[int]) -> bool:
    # sample_answers drops the stopping newline token from token_ids; the reference keeps it
    return list(sample) == ref or (list(sample) == ref[:-1] and len(ref) == len(sample) + 1)


def run(args: argparse.Namespace) -> dict[str, Any]:
    load_start = load_averages()
    torch.set_num_threads(args.threads)
    model, tok = load(ALIAS)
    records = list(load_nq_open(args.data).records[: args.questions])
    prompts = encode_open_prompts(tok, records)
    settings = SamplingSettings(n=args.samples, temperature=args.temperature, top_p=args.top_p, seed=args.seed,
                                max_new_tokens=args.max_new_tokens)
    chunk = -(-len(prompts) // args.rounds)
    totals = {"shared": [0.0, 0.0], "generate": [0.0, 0.0]}
    rounds, matched, total, lengths = [], 0, 0, []
    for r in range(args.rounds):
        idx = list(range(r * chunk, min((r + 1) * chunk, len(prompts))))
        if not idx:
            break
        sides = {
            "shared": lambda idx=idx: sample_answers(model, tok, [prompts[i] for i in idx], settings,
                                                     batch_size=args.batch_size, question_indices=idx),
            "generate": lambda idx=idx: reference(model, tok, [prompts[i] for i in idx], idx, settings),
        }
        order = ["shared", "generate"] if r % 2 == 0 else ["generate", "shared"]
        got, row = {}, {"round": r, "questions": len(idx), "first": order[0], "load": load_averages()}
        for side in order:
            got[side], wall, cpu = timed(sides[side])
            totals[side][0] += wall
            totals[side][1] += cpu
            row[f"{side}_wall_s"], row[f"{side}_cpu_s"] = wall, cpu
            print(f"round {r} {side}: wall {wall:.1f} s, cpu {cpu:.1f} s", flush=True)
        for samples, refs in zip(got["shared"], got["generate"], strict=True):
            for s, ref in zip(samples, refs, strict=True):
                matched += same(s.token_ids, ref)
                total += 1
                lengths.append(len(ref))
        rounds.append(row)
    meta = machine_info()
    return {
        "questions": len(prompts), "samples": settings.n, "temperature": settings.temperature, "top_p": settings.top_p,
        "seed": settings.seed, "max_new_tokens": settings.max_new_tokens, "batch_size": args.batch_size,
        "rounds": rounds, "matched": matched, "total": total,
        "mean_reference_tokens": sum(lengths) / max(len(lengths), 1),
        "shared_wall_s": totals["shared"][0], "shared_cpu_s": totals["shared"][1],
        "generate_wall_s": totals["generate"][0], "generate_cpu_s": totals["generate"][1],
        "wall_ratio": totals["generate"][0] / totals["shared"][0],
        "cpu_ratio": totals["generate"][1] / totals["shared"][1],
        "meta": meta, "simd": meta["simd"], "load_start": load_start,
    }


def report(res: dict[str, Any], command: str) -> str:
    meta = res["meta"]
    lines = ["# Sampled open answers: shared prompt cache vs separate `generate` calls", ""]
    lines += provenance_lines(command, meta, elapsed_s=res["shared_wall_s"] + res["generate_wall_s"],
                              load_start=res["load_start"])
    lines += [f"- CPU flags: {res['simd']}. The machine was shared with other jobs (2 cores, several "
              "processes); both sides ran interleaved in the same process, the first side alternating by round.",
              f"- Model {ALIAS} (float32), NQ-open dev, first {res['questions']} questions, N = {res['samples']}, "
              f"temperature {res['temperature']}, top-p {res['top_p']}, seed {res['seed']}, at most "
              f"{res['max_new_tokens']} new tokens, stop at a newline or EOS; shared side batch size "
              f"{res['batch_size']} questions ({res['batch_size'] * res['samples']} decoding rows).", ""]
    rows = [[str(r["round"]), str(r["questions"]), r["first"], f"{r['shared_wall_s']:.1f}",
             f"{r['generate_wall_s']:.1f}", f"{r['shared_cpu_s']:.1f}", f"{r['generate_cpu_s']:.1f}",
             f"{r['load'][0]:.1f}"] for r in res["rounds"]]
    rows.append(["all", str(res["questions"]), "", f"{res['shared_wall_s']:.1f}", f"{res['generate_wall_s']:.1f}",
                 f"{res['shared_cpu_s']:.1f}", f"{res['generate_cpu_s']:.1f}", ""])
    lines += markdown_table(["round", "questions", "first", "shared wall s", "generate wall s", "shared CPU s",
                             "generate CPU s", "load (1 min)"], rows)
    met = res["cpu_ratio"] >= TARGET and res["wall_ratio"] >= TARGET
    lines += ["", f"- Speed-up of the shared cache: **{res['wall_ratio']:.2f}x wall**, **{res['cpu_ratio']:.2f}x CPU** "
              f"(target >= {TARGET:.0f}x: {'met' if met else 'missed'}).",
              f"- Same token ids as the separate `generate` calls: **{res['matched']} of {res['total']}** samples "
              f"(mean reference length {res['mean_reference_tokens']:.1f} tokens). A mismatch is a near-tie "
              "flipped by float rounding between the batched and the one-row forward; the samples then diverge."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", default=NQ)
    p.add_argument("--questions", type=int, default=100)
    p.add_argument("--samples", type=int, default=10)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=1, help="torch threads (1: steadier on a busy machine)")
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args(argv)
    res = run(args)
    command = "PYTHONPATH=. python benchmarks/open_sampling_speed.py " + " ".join(argv if argv is not None
                                                                                  else sys.argv[1:])
    text = report(res, command.strip())
    print(text)
    if not args.no_write:
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / "open_sampling_speed.md").write_text(text)
        (RESULTS / "open_sampling_speed.json").write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
