#!/usr/bin/env python
"""hypergrad against jaxopt, torchopt and higher, side by side: time, memory, accuracy, scaling.

Usage (from the repository root, after ``make setup``)::

    make setup-bench   # optional: jax and jaxopt for the jaxopt rows (skipped without them)
    .venv/bin/python benchmarks/hypergrad_bench.py            # full run (< 15 min on 2 cores),
                                                              # writes benchmarks/results/
    .venv/bin/python benchmarks/hypergrad_bench.py --quick    # about a minute; prints only
    .venv/bin/python benchmarks/hypergrad_bench.py --quick --out /tmp/bench   # quick, to a folder

Problems (same data, dtype and thread count for every library):

1. ridge regression, scalar and per-feature regularisation (closed-form hypergradient);
2. logistic regression with per-feature L2 hyperparameters, d = 100 ... 10,000 features
   (reference: the implicit-function-theorem formula with an explicit/Woodbury solve);
3. data hyper-cleaning on scikit-learn's digits (50 % of the training labels corrupted, one
   weight per training example; single-hypergradient timings plus a short outer loop and the final
   test accuracy);
4. an MLP inner problem on digits, up to about 1M parameters (scaling in the parameter count),
   and a sweep of the unroll length K = 10 ... 1000 on a small MLP.

Timing: all runners of one problem are interleaved (A B C A B C ...) after a warm-up; medians.
Memory: every (problem, method, size) configuration runs in a fresh process: the script re-runs
itself with a hidden ``--worker`` flag, which imports once and forks one child per configuration
(children are fresh processes forked from an import-only parent, so no state leaks between
configurations); the child builds the problem, warms up, resets the kernel's peak-RSS counter and
reports the peak RSS over that baseline for one hypergradient.

The parts, each runnable alone with ``--quick`` (see its docstring): ``hg_implicit.py`` (implicit
differentiation vs torchopt and jaxopt, preconditioning, the hyper-cleaning loop),
``hg_unrolled.py`` (unrolling vs higher and MetaSGD), ``hg_first_order.py`` (finite differences,
Penalty/F2SA), ``hg_meta.py`` (batched iMAML, ``--imaml`` here), over ``harness/hypergrad_problems.py``
(sizes and problems), the shared harness ``harness/hypergrad_suite.py`` (runners, timing, memory, the suite),
``harness/hypergrad_report.py`` (the report) and ``harness/hypergrad_cli.py`` (the command line).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import hg_first_order
import hg_implicit
import hg_meta
import hg_unrolled
import torch
from harness import hypergrad_cli
from harness.hypergrad_problems import FULL, QUICK, TINY, Bench, Sizes, build_bench, flat, rel_err
from harness.hypergrad_suite import RESULTS, Concern, Runner, metadata, time_interleaved, worker
from harness.hypergrad_suite import make_runners as make_concern_runners
from harness.hypergrad_suite import suite as concern_suite

__all__ = [
    "CONCERNS", "FULL", "QUICK", "TINY", "Bench", "Runner", "Sizes", "build_bench", "flat", "main",
    "make_runners", "metadata", "rel_err", "suite", "time_interleaved",
]

CONCERNS: tuple[Concern, ...] = (hg_implicit, hg_unrolled, hg_first_order)  # runner and report order


def make_runners(b: Bench, sizes: Sizes, which: list[str] | None = None, K: int | None = None) -> list[Runner]:
    """All runners for a problem, of every concern (``which`` restricts to the named groups)."""
    return make_concern_runners(b, sizes, CONCERNS, which, K)


def suite(sizes: Sizes, threads: int = 1, log: Callable[[str], None] = print,
          cache: Path | None = None) -> dict[str, Any]:
    """Run every problem with every concern's runners (``harness.hypergrad_suite.suite``)."""
    return concern_suite(sizes, CONCERNS, threads, log, cache)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    hypergrad_cli.add_suite_arguments(parser)
    parser.add_argument("--imaml", action="store_true",
                        help="only the batched iMAML comparison (writes hypergrad_imaml.md)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--render", type=Path, help=argparse.SUPPRESS)  # re-render a hypergrad.json
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.worker:
        worker(args.worker, CONCERNS)
        return 0
    if args.render and args.imaml:  # re-render a hypergrad_imaml.json
        hg_meta.rerender(args.render, args.out)
        return 0
    if args.render:
        hypergrad_cli.rerender(args.render, args.out)
        return 0
    if args.imaml:
        out = args.out if args.out is not None else (None if args.quick else RESULTS)
        command = "python benchmarks/hypergrad_bench.py --imaml" + (" --quick" if args.quick else "")
        return hg_meta.run(args.quick, out, command)
    return hypergrad_cli.run_suite(args, parser, CONCERNS, "hypergrad_bench.py", default_out=RESULTS)


if __name__ == "__main__":
    sys.exit(main())
