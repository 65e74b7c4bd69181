"""The command line shared by the hypergrad benchmark scripts: run the suite, write its report.

``hypergrad_bench.py`` runs every concern and writes ``results/hypergrad.md`` in full mode; a
concern module run alone (``hg_implicit.py``, ``hg_unrolled.py``, ``hg_first_order.py``) runs the
problems its runners serve and prints its partial report unless ``--out`` names a folder, so that a
partial run never replaces the committed full report.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

import torch

from harness.hypergrad_problems import FULL, QUICK, Sizes
from harness.hypergrad_report import CORE_CHANGES, render
from harness.hypergrad_suite import Concern, Row, suite


def add_suite_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of a suite run: mode, output folder, threads, memory, problems."""
    parser.add_argument("--quick", action="store_true", help="about one minute; no files unless --out")
    parser.add_argument("--out", type=Path, default=None, help="write the report here")
    parser.add_argument("--threads", type=int, default=1, help="torch threads, same for every library")
    parser.add_argument("--no-memory", action="store_true", help="skip the per-configuration processes")
    parser.add_argument("--problems", default=None,
                        help="comma-separated problems to run: 1 ridge, 2 logistic, 3 hyper-cleaning, "
                             "4 MLP widths, 5 unroll-length sweep, 6 forward-mode memory in K; default all. "
                             "The report then covers only these (give --out to keep results/ intact)")


def run_suite(args: argparse.Namespace, parser: argparse.ArgumentParser, concerns: tuple[Concern, ...],
              script: str, default_out: Path | None) -> int:
    """Run the suite with ``concerns`` as ``args`` ask; write the report to ``args.out``, else to
    ``default_out`` in full mode, else print it. ``script``: the file name the report's command names."""
    sizes = QUICK if args.quick else FULL
    if args.no_memory:
        sizes = replace(sizes, memory=False)
    if args.problems:
        chosen = tuple(int(x) for x in args.problems.split(","))
        if not set(chosen) <= set(range(1, 7)):
            parser.error(f"--problems: numbers in 1-6, got {args.problems!r}")
        sizes = replace(sizes, problems=chosen)
    out = args.out if args.out is not None else (None if args.quick else default_out)
    command = f"python benchmarks/{script}" + (" --quick" if args.quick else "") + (
        f" --threads {args.threads}" if args.threads != 1 else "") + (
        f" --problems {args.problems}" if args.problems else "")
    print(f"hypergrad benchmark ({sizes.name}), torch {torch.__version__}, {args.threads} thread(s)")
    result = suite(sizes, concerns, threads=args.threads, log=lambda m: print(m, flush=True))
    result["command"] = command
    result["notes"] = CORE_CHANGES
    text = render(result, out)
    if out is None:
        print(text)
    else:
        print(f"wrote {out / 'hypergrad.md'}")
    print(f"total {result['elapsed_s']:.0f}s")
    return 0


def rerender(path: Path, out: Path | None) -> None:
    """Render a ``hypergrad.json`` again (into ``out``, default: its folder)."""
    raw = json.loads(path.read_text())
    raw["sizes"] = Sizes(**{k: tuple(v) if isinstance(v, list) else v for k, v in raw["sizes"].items()})
    raw["rows"] = [Row(**r) for r in raw["rows"]]
    raw["notes"] = CORE_CHANGES
    render(raw, out if out is not None else path.parent)


def concern_main(argv: list[str] | None, concern: Concern, script: str) -> int:
    """``python benchmarks/<script> [--quick] ...``: the suite with one concern's runners."""
    doc = (concern.__doc__ or script).strip()
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    add_suite_arguments(parser)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    return run_suite(args, parser, (concern,), script, default_out=None)
