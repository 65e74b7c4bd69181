#!/usr/bin/env python
"""Minibatch implicit hypergradients: what a batch Hessian smaller than dim w does to the linear solve.

Question: with a least-squares inner loss on a batch of b samples, the Hessian has rank <= b. For
b < dim w the system H_b v = grad_w f has no solution; how wrong is ``hg.Implicit`` then, and
what do the remedies (a larger batch for the hypergradient, damping, a capped CG, a truncated
Neumann series) buy? Backs the "Minibatch implicit hypergradients" section of
``docs/methods/implicit.md``.

Usage (from the repository root)::

    PYTHONPATH=. .venv/bin/python benchmarks/minibatch_implicit.py           # writes benchmarks/results/minibatch_implicit.md
    PYTHONPATH=. .venv/bin/python benchmarks/minibatch_implicit.py --quick   # prints only, 5 batches per row

Problem: dim w = 100, 4,096 training samples with features of mean 0.5, one hyperparameter (a
shift of the training targets), validation targets offset by 1; float64, one torch thread. Each
row: the implicit hypergradient at the full-batch inner solution w* from independent random
batches, against the exact full-batch hypergradient (autograd through a least-squares solve).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import platform
import statistics
import time
import warnings
from pathlib import Path

import torch
from harness.report import machine_info, machine_line

import hypergrad as hg

RESULTS = Path(__file__).resolve().parent / "results"


def make_problem(seed: int = 0) -> tuple[hg.BilevelProblem, torch.Tensor, torch.Tensor, dict, dict, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    dt = torch.float64
    n, d = 4096, 100
    X = torch.randn(n, d, generator=gen, dtype=dt) + 0.5
    X_val = torch.randn(1000, d, generator=gen, dtype=dt) + 0.5
    w_true = torch.randn(d, generator=gen, dtype=dt)
    y = X @ w_true + torch.randn(n, generator=gen, dtype=dt)
    y_val = X_val @ w_true + 1.0

    def g(w, lam, batch):
        Xb, yb = batch
        return 0.5 * ((Xb @ w["w"] - yb - lam["shift"]) ** 2).mean()

    def f(w, lam, batch):
        return 0.5 * ((X_val @ w["w"] - y_val) ** 2).mean()

    lam = {"shift": torch.zeros(1, dtype=dt)}
    shift = lam["shift"].clone().requires_grad_()
    w_full = torch.linalg.lstsq(X, (y + shift)[:, None]).solution[:, 0]
    exact = torch.autograd.grad(f({"w": w_full}, None, None), shift)[0]
    return hg.BilevelProblem(g, f), X, y, {"w": w_full.detach()}, lam, exact


def rows():
    return [
        ("CG, batch 64", hg.linear.CG(), 64),
        ("CG, batch 100", hg.linear.CG(), 100),
        ("CG, batch 256", hg.linear.CG(), 256),
        ("CG, batch 1024", hg.linear.CG(), 1024),
        ("CG, all 4096 samples", hg.linear.CG(), 4096),
        ("CG(damping=0.1), batch 64", hg.linear.CG(damping=0.1), 64),
        ("CG(damping=1.0), batch 64", hg.linear.CG(damping=1.0), 64),
        ("CG(maxiter=10), batch 64", hg.linear.CG(maxiter=10), 64),
        ("Neumann(steps=10), batch 64", hg.linear.Neumann(steps=10), 64),
        ("Neumann(steps=10), batch 1024", hg.linear.Neumann(steps=10), 1024),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="5 batches per row, print only")
    args = parser.parse_args()
    torch.set_num_threads(1)
    count = 5 if args.quick else 20
    problem, X, y, w_star, lam, exact = make_problem()
    table = ["| solver, hypergradient batch | median relative error of one estimate | relative error of the mean of "
             f"{count} | converged | products per call | Python warnings |", "|---|---|---|---|---|---|"]
    wall = time.perf_counter()
    for name, solver, size in rows():
        gen = torch.Generator().manual_seed(1)
        method, errors, estimates, converged, matvecs = hg.Implicit(solver), [], [], 0, 0
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(count):
                idx = torch.randperm(X.shape[0], generator=gen)[:size]
                r = method.hypergrad(problem, w_star, lam, inner_batch=(X[idx], y[idx]))
                estimates.append(float(r.grad["shift"]))
                errors.append(float((r.grad["shift"] - exact).abs() / exact.abs()))
                converged += r.info.converged
                matvecs += r.info.extra["matvecs"]
        mean_error = abs(statistics.fmean(estimates) - float(exact)) / abs(float(exact))
        table.append(f"| {name} | {statistics.median(errors):.3g} | {mean_error:.3g} | {converged}/{count} | "
                     f"{matvecs / count:.1f} | {len(caught)} |")
    wall = time.perf_counter() - wall
    text = "\n".join([
        "# Minibatch implicit hypergradients: batch Hessians of rank <= batch size",
        "",
        f"- Command: `PYTHONPATH=. python benchmarks/minibatch_implicit.py{' --quick' if args.quick else ''}` "
        f"(wall time {wall / 60:.1f} min)",
        f"- Date: {_dt.datetime.now(_dt.UTC).strftime('%Y-%m-%d %H:%M')} UTC",
        machine_line(machine_info(1), "shared with other jobs; load average at the end"),
        f"- Versions: torch {torch.__version__}, Python {platform.python_version()}",
        f"- Problem: least squares, dim w = 100, 4096 samples, one hyperparameter (a target shift); exact "
        f"full-batch hypergradient {float(exact):.6f}; {count} random batches per row (the same batches for "
        "every row of one size), hypergradients at the full-batch w*.",
        "",
        *table,
        "",
        "Batches smaller than dim w = 100 give a singular Hessian: CG never converges and the estimate is "
        "meaningless; a batch of a few times dim w for the linear solve (`hg.solve(..., hypergrad_batches=...)`) "
        "restores it; damping and truncated Neumann are biased but bounded. Neumann warns once per solver "
        "instance (its later calls list the warning in `info.warnings`).",
        "",
    ])
    print(text)
    if not args.quick:
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / "minibatch_implicit.md").write_text(text)


if __name__ == "__main__":
    main()
