#!/usr/bin/env python
"""What the per-step outer-loss evaluation of ``hg.solve`` costs, and what ``outer_loss_every`` saves.

Question: ``hg.solve`` evaluates the outer loss f at every outer step for ``history`` (one extra
forward pass of f on the outer batch). On a full-batch BOME loop, how much of a step is that, and
how much does ``outer_loss_every=0`` (never) or ``=10`` save?

Usage (from the repository root)::

    .venv/bin/python benchmarks/solve_loop_controls.py            # writes benchmarks/results/solve_loop_controls.md
    .venv/bin/python benchmarks/solve_loop_controls.py --quick    # prints only, fewer rounds

Problem: L2-regularised logistic regression with one log-strength per feature (n = 4000 training
and 4000 validation samples, d = 300, float64), ``hg.BOME(SGD, inner_steps=10)``, 20 outer steps
per run. The three settings run in interleaved rounds in one process (rotating start), one torch
thread; the table gives medians of CPU time per outer step and ratios to ``outer_loss_every=1``.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import platform
import statistics
import time
from pathlib import Path

import torch
from harness.report import machine_info, machine_line

import hypergrad as hg

RESULTS = Path(__file__).resolve().parent / "results"
SETTINGS = (1, 10, 0)   # outer_loss_every


def make_problem(n: int = 4000, d: int = 300, seed: int = 0) -> tuple[hg.BilevelProblem, dict, dict]:
    gen = torch.Generator().manual_seed(seed)
    dt = torch.float64
    w_true = torch.randn(d, generator=gen, dtype=dt)
    X, X_val = torch.randn(n, d, generator=gen, dtype=dt), torch.randn(n, d, generator=gen, dtype=dt)
    y = (torch.rand(n, generator=gen, dtype=dt) < torch.sigmoid(X @ w_true)).to(dt)
    y_val = (torch.rand(n, generator=gen, dtype=dt) < torch.sigmoid(X_val @ w_true)).to(dt)

    def g(w, lam, batch):
        loss = torch.nn.functional.binary_cross_entropy_with_logits(X @ w["w"], y)
        return loss + 0.5 * (lam["log_l2"].exp() * w["w"] ** 2).sum()

    def f(w, lam, batch):
        return torch.nn.functional.binary_cross_entropy_with_logits(X_val @ w["w"], y_val)

    return hg.BilevelProblem(g, f), {"w": torch.zeros(d, dtype=dt)}, {"log_l2": torch.full((d,), -3.0, dtype=dt)}


def run(problem: hg.BilevelProblem, w: dict, lam: dict, every: int, steps: int) -> float:
    """CPU seconds per outer step of one solve."""
    method = hg.BOME(hg.inner.SGD(lr=1.0), w_lr=0.5, inner_steps=10)
    start = time.process_time()
    hg.solve(problem, w, lam, method, lambda p: torch.optim.SGD(p, lr=0.5), steps=steps,
             progress=False, outer_loss_every=every)
    return (time.process_time() - start) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 rounds, print only")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rounds, steps = (3, 10) if args.quick else (9, 20)
    problem, w, lam = make_problem()
    run(problem, w, lam, 1, 2)  # warm-up
    times: dict[int, list[float]] = {every: [] for every in SETTINGS}
    wall = time.perf_counter()
    for r in range(rounds):
        order = SETTINGS[r % len(SETTINGS):] + SETTINGS[: r % len(SETTINGS)]
        for every in order:
            times[every].append(run(problem, w, lam, every, steps))
    wall = time.perf_counter() - wall
    base = statistics.median(times[1])
    rows = [f"| {every} | {statistics.median(times[every]) * 1e3:.1f} | {statistics.median(times[every]) / base:.3f} |"
            for every in SETTINGS]
    lines = [
        "# `hg.solve`: cost of the per-step outer-loss evaluation (`outer_loss_every`)",
        "",
        f"- Command: `python benchmarks/solve_loop_controls.py{' --quick' if args.quick else ''}` (wall time {wall / 60:.1f} min)",
        f"- Date: {_dt.datetime.now(_dt.UTC).strftime('%Y-%m-%d %H:%M')} UTC",
        machine_line(machine_info(1), "shared with other jobs; load average at the end"),
        f"- Versions: torch {torch.__version__}, Python {platform.python_version()}",
        "- Problem: logistic regression with per-feature L2 (n = 4000 + 4000, d = 300, float64), full batch, "
        f"`hg.BOME(hg.inner.SGD(lr=1.0), w_lr=0.5, inner_steps=10)`, {steps} outer steps per run, "
        f"{rounds} interleaved rounds (rotating start); medians of CPU time per outer step.",
        "",
        "| outer_loss_every | ms per outer step | ratio to 1 |",
        "|---|---|---|",
        *rows,
        "",
    ]
    text = "\n".join(lines)
    print(text)
    if not args.quick:
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / "solve_loop_controls.md").write_text(text)


if __name__ == "__main__":
    main()
