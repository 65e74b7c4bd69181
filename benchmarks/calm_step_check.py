#!/usr/bin/env python
"""Before/after check of a speed change: the same CALM and LoRA-CE steps and scoring, same seeds.

Usage (from the repository root)::

    python benchmarks/calm_step_check.py --save /tmp/before.pt      # on the code before the change
    python benchmarks/calm_step_check.py --compare /tmp/before.pt   # after it: max differences

Runs ``--steps`` default CALM (BOME) steps and as many LoRA-CE steps (``CalibrationConfig()``,
ARC-Easy train / dev samples, seed 0) from a perturbed LoRA start (so that every gradient is
non-zero), then scores ARC-Easy test questions with the uncalibrated and the CALM-trained model.
Saves the per-step losses and diagnostics, the final θ and λ and the option probabilities;
``--compare`` prints the largest absolute and relative differences against a saved run (equal to
float32 rounding when a change keeps the arithmetic).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from calm_step_profile import arc  # the profile's seeded ARC-Easy samples (run from benchmarks/)

from llm_calib.calm import batch_order, training
from llm_calib.calm.run import resolve_run
from llm_calib.config.calibration import CalibrationConfig
from llm_calib.models import load, random_init_model
from llm_calib.objectives.lora_ce import LoraCE
from llm_calib.scoring.option_likelihood import score_option_likelihood

ROOT = Path(__file__).resolve().parent.parent
ALIAS = "smollm2-135m-instruct"


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    model, tok = load(ALIAS) if args.model == "real" else random_init_model(ALIAS, 0)
    train, heldout, test = arc(args.data_dir, "train", 64), arc(args.data_dir, "dev", 64), arc(args.data_dir, "test", 16)
    out: dict[str, Any] = {"uncalibrated": torch.stack([torch.as_tensor(p) for p in
                                                        score_option_likelihood(model, tok, test, batch_size=16).probs_numpy])}
    for kind, objective in (("bome", CalibrationConfig().objective), ("ce", LoraCE())):
        trainer = training.build_trainer(copy.deepcopy(model), tok, train, heldout,
                                         resolve_run(replace(CalibrationConfig(), objective=objective), train, heldout))
        state = training.init_state(trainer, evaluate_before=False)
        gen = torch.Generator().manual_seed(1)
        state.theta = {k: v + (0.02 * torch.randn(v.shape, generator=gen) if "lora_" in k else 0)
                       for k, v in state.theta.items()}
        records, cpu = [], 0.0
        for _ in range(args.steps):
            c0 = time.thread_time()
            records.append(training.train_step(trainer, state))
            cpu += time.thread_time() - c0
        trainer.lm.load_theta(state.theta)
        scored = score_option_likelihood(trainer.lm.model, tok, test, batch_size=16)
        out[kind] = {"records": records, "theta": state.theta, "lam": {k: v.detach().clone() for k, v in state.objective_state.lam.items()},
                     "probs": torch.stack([torch.as_tensor(p) for p in scored.probs_numpy]), "cpu_s": cpu}
        print(f"{kind}: {args.steps} steps, {cpu:.2f} CPU s; last record {records[-1]}", flush=True)
    return out


def parts_vs_whole(args: argparse.Namespace) -> list[str]:
    """The losses and gradients of one default training batch run in length parts against the whole padded batch."""
    import hypergrad as hg

    torch.set_num_threads(args.threads)
    model, tok = load(ALIAS) if args.model == "real" else random_init_model(ALIAS, 0)
    trainer = training.build_trainer(model, tok, arc(args.data_dir, "train", 64), arc(args.data_dir, "dev", 64),
                                     resolve_run(CalibrationConfig(), arc(args.data_dir, "train", 64), arc(args.data_dir, "dev", 64)))
    state = training.init_state(trainer, evaluate_before=False)
    gen = torch.Generator().manual_seed(1)
    theta = {k: v + (0.02 * torch.randn(v.shape, generator=gen) if "lora_" in k else 0) for k, v in state.theta.items()}
    lam = {k: v.detach() + 0.1 for k, v in state.objective_state.lam.items()}
    lines = []
    for step in range(args.steps):
        idx = batch_order.batch_indices(len(trainer.train), trainer.config.training.batch_size, step,
                                              trainer.config.seed, batch_order.TRAIN_STREAM)
        split = trainer.train.batch(idx, trainer.pad_id, trainer.lm)
        whole = trainer.train.batch(idx, trainer.pad_id, trainer.lm, split=False)
        for name, loss in (("g", trainer.losses.inner), ("f", trainer.losses.outer)):
            a = hg.autodiff.loss_and_grads(lambda w, l_, loss=loss, batch=split: loss(w, l_, batch), theta, lam)
            b = hg.autodiff.loss_and_grads(lambda w, l_, loss=loss, batch=whole: loss(w, l_, batch), theta, lam)
            gw = max(_max_diff(a[1][k], b[1][k])[1] for k in b[1])
            gl = max(_max_diff(a[2][k], b[2][k])[1] for k in b[2])
            lines.append(f"batch {step} ({len(split.parts)} parts, {sum(p.packed.input_ids.numel() for p in split.parts)} "
                         f"of {whole.packed.input_ids.numel()} tokens): {name} abs diff {abs(float(a[0] - b[0])):.2e}, "
                         f"grad theta max rel diff {gw:.2e}, grad lambda max rel diff {gl:.2e}")
    return lines


def parts_vs_whole_cpu(args: argparse.Namespace) -> list[str]:
    """Thread CPU seconds of the BOME direction and of the CE gradient on the same default batches, in length parts and
    whole, interleaved (A, B, A, B...) so that the load of a shared machine falls on both alike."""
    import hypergrad as hg

    torch.set_num_threads(args.threads)
    model, tok = load(ALIAS) if args.model == "real" else random_init_model(ALIAS, 0)
    trainer = training.build_trainer(model, tok, arc(args.data_dir, "train", 64), arc(args.data_dir, "dev", 64),
                                     resolve_run(CalibrationConfig(), arc(args.data_dir, "train", 64), arc(args.data_dir, "dev", 64)))
    state = training.init_state(trainer, evaluate_before=False)
    trainer.fill_trunk_caches()
    theta, lam = state.theta, {k: v.detach() for k, v in state.objective_state.lam.items()}
    cpu: dict[str, list[float]] = {f"{what} {how}": [] for what in ("bome", "ce") for how in ("parts", "whole")}
    tokens = {"parts": 0, "whole": 0}
    for step in range(args.steps):
        batches = {}
        for how in ("parts", "whole"):
            inner, outer = (enc.batch(batch_order.batch_indices(len(enc), size, step, 0, stream), trainer.pad_id, trainer.lm,
                                      split=how == "parts")
                            for enc, size, stream in ((trainer.train, 8, batch_order.TRAIN_STREAM),
                                                      (trainer.unlabeled, 8, batch_order.UPPER_STREAM)))
            batches[how] = (inner, outer)
            tokens[how] += sum(int(p.packed.input_ids.numel()) for b in (inner, outer) for p in (b.parts or (b,)))
        for rep in range(3):
            for how in (("parts", "whole") if rep % 2 == 0 else ("whole", "parts")):
                inner, outer = batches[how]
                calls = {"bome": lambda inner=inner, outer=outer: state.objective_state.method.hypergrad(
                             state.objective_state.problem, theta, lam, inner, outer, state.objective_state.solver_state),
                         "ce": lambda inner=inner: hg.autodiff.loss_and_grads(
                             lambda w, _l: trainer.losses.one_level(w, inner), theta, {"_": torch.zeros(1)}, wrt_lam=False)}
                for what, fn in calls.items():
                    c0 = time.thread_time()
                    fn()
                    if rep > 0:  # the first round is a warm-up
                        cpu[f"{what} {how}"].append(time.thread_time() - c0)
    med = {k: statistics.median(v) for k, v in cpu.items()}
    return [f"{args.steps} default batches (inner + held-out), {tokens['whole']} padded tokens whole, {tokens['parts']} "
            f"in length parts; thread CPU s, medians of {len(cpu['bome parts'])} interleaved calls:",
            *(f"  {what}: whole {med[what + ' whole']:.3f}, parts {med[what + ' parts']:.3f} "
              f"({med[what + ' whole'] / med[what + ' parts']:.2f}x)" for what in ("bome", "ce")),
            f"  BOME direction / CE gradient: whole {med['bome whole'] / med['ce whole']:.2f}, "
            f"parts {med['bome parts'] / med['ce parts']:.2f}"]


def _max_diff(a: Any, b: Any) -> tuple[float, float]:
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    d = float((a - b).abs().max()) if a.numel() else 0.0
    return d, d / max(float(b.abs().max()), 1e-30)


def compare(new: dict[str, Any], old: dict[str, Any]) -> list[str]:
    lines = [f"uncalibrated probabilities: max abs diff {_max_diff(new['uncalibrated'], old['uncalibrated'])[0]:.2e}"]
    for kind in ("bome", "ce"):
        n, o = new[kind], old[kind]
        keys = [k for k in o["records"][0] if isinstance(o["records"][0][k], float)]
        rec = max((abs(a[k] - b[k]), k) for a, b in zip(n["records"], o["records"], strict=True) for k in keys)
        th, th_key = max((_max_diff(n["theta"][k], o["theta"][k])[1], k) for k in o["theta"])
        la = max((_max_diff(n["lam"][k], o["lam"][k])[1] for k in o["lam"]), default=0.0)
        pr = _max_diff(n["probs"], o["probs"])[0]
        lines.append(f"{kind}: records max abs diff {rec[0]:.2e} ({rec[1]}); theta max rel diff {th:.2e} ({th_key}); "
                     f"lambda max rel diff {la:.2e}; test probabilities max abs diff {pr:.2e}; "
                     f"CPU s {o['cpu_s']:.2f} -> {n['cpu_s']:.2f}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=("real", "random"), default="real")
    parser.add_argument("--data-dir", type=Path, default=ROOT.parent / "shared" / "data")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--save", type=Path)
    parser.add_argument("--compare", type=Path)
    parser.add_argument("--parts-vs-whole", action="store_true",
                        help="only compare one batch's losses and gradients in length parts against the whole batch")
    parser.add_argument("--cpu", action="store_true",
                        help="only time the BOME direction and the CE gradient in length parts and whole, interleaved")
    args = parser.parse_args(argv)
    if args.cpu:
        print("\n".join(parts_vs_whole_cpu(args)))
        return 0
    if args.parts_vs_whole:
        print("\n".join(parts_vs_whole(args)))
        return 0
    result = run(args)
    if args.save:
        torch.save(result, args.save)
    if args.compare:
        print("\n".join(compare(result, torch.load(args.compare, weights_only=False))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
