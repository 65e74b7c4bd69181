"""``llm-calib metrics``: the calibration report of lm-eval ``--log_samples`` files (no model)."""

from __future__ import annotations

import argparse
from pathlib import Path

from llm_calib.cli._common import (
    BINS_FLAG,
    UserError,
    non_negative_int,
    print_summary,
    unescape,
    user_call,
)

__all__ = ["add_parser", "run"]

def add_parser(sub: argparse._SubParsersAction) -> None:
    """Add the ``metrics`` command to the subcommands ``sub`` of the ``llm-calib`` parser.

    Example:
        >>> parser = argparse.ArgumentParser(prog="llm-calib")
        >>> add_parser(parser.add_subparsers(dest="command"))
        >>> args = parser.parse_args(["metrics", "samples_arc.jsonl", "--out", "report"])
        >>> args.samples, args.normalize, args.func is run
        (['samples_arc.jsonl'], 'sum', True)
    """
    p = sub.add_parser(
        "metrics",
        help="calibration metrics of lm-eval --log_samples files (no model needed)",
        description="Read lm-evaluation-harness samples_<task>_<date>.jsonl files (--log_samples) "
        "of multiple-choice tasks, from any model lm-eval ran, and write the calibration report "
        "of `evaluate` (metrics.json, report.md, reliability diagrams): one domain per task.",
    )
    p.add_argument("samples", nargs="+", metavar="SAMPLES", help="lm-eval samples_*.jsonl files")
    p.add_argument(
        "--normalize", choices=("sum", "char", "byte"), default="sum",
        help="option scores of the headline metrics: summed log-likelihoods (lm-eval's acc), per "
        "character (acc_norm) or per byte (acc_bytes); the report shows all three side by side "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--temperature-fit", default=None, metavar="TASK",
        help="fit a temperature on this task (one of the SAMPLES tasks, or another samples file) "
        "and report temperature-scaled metrics for every task",
    )
    p.add_argument(
        "--target-delimiter", type=unescape, default=" ", metavar="TEXT",
        help="the tasks' target delimiter, removed from each continuation to get the choice text "
        "acc_norm and acc_bytes divide by (default: a space)",
    )
    p.add_argument("--seed", type=int, default=0, metavar="S", help="bootstrap seed (default: %(default)s)")
    p.add_argument("--bins", **BINS_FLAG)
    p.add_argument(
        "--bootstrap", type=non_negative_int, default=1000, metavar="R",
        help="bootstrap resamples for the 95%% confidence intervals; 0 disables them (default: %(default)s)",
    )
    p.add_argument("--out", required=True, metavar="DIR", help="output directory (created if missing)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run ``llm-calib metrics`` with its parsed ``args``: read the lm-eval samples files and write
    the calibration report to ``--out``.

    Returns:
        0; a user error raises the CLI's user error, which :func:`~llm_calib.cli.main` reports
        in one line with status 2.

    Example:
        >>> from llm_calib.cli import main
        >>> main(["metrics", "/nonexistent/samples.jsonl", "--out", "/tmp/x"])
        2
    """
    from llm_calib.lm_eval_samples import samples_result
    from llm_calib.report import write_report

    for path in args.samples:
        if not Path(path).is_file():
            raise UserError(f"{path}: no such samples file")
    result = user_call(
        lambda: samples_result(
            args.samples,
            normalize=args.normalize,
            temperature_fit=args.temperature_fit,
            target_delimiter=args.target_delimiter,
            n_bins=args.bins,
            ci=args.bootstrap > 0,
            n_resamples=max(args.bootstrap, 1),
            seed=args.seed,
        ),
        "metrics",
    )
    paths = write_report(result, args.out, title="Calibration report (lm-eval samples)")
    print_summary(result, paths, args.out)
    return 0
