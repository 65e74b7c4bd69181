"""``llm-calib metrics``: the calibration report of lm-eval ``--log_samples`` files (no model)."""

from __future__ import annotations

import argparse

from llm_calib.cli._common import (
    BINS_FLAG,
    PATH,
    UserError,
    non_negative_int,
    nonempty,
    print_summary,
    unescape,
    user_call,
)
from llm_calib.cli.confidence import add_semantic_args

__all__ = ["add_parser", "run"]

def _regex(text: str) -> str:
    """An argparse type: a Python regular expression (refused with re's reason and position)."""
    import re

    try:
        re.compile(text)
    except re.error as err:
        raise argparse.ArgumentTypeError(f"not a regular expression: {err} in {text!r}") from None
    return text


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
        "of `evaluate` (metrics.json, report.md, reliability diagrams): one domain per task. "
        "Files of generate_until tasks run with `repeats: N` and sampling (do_sample: true) get "
        "semantic confidence (Sem-ECE) from each question's N responses, against lm-eval's target.",
    )
    p.add_argument("samples", type=PATH, nargs="+", metavar="SAMPLES", help="lm-eval samples_*.jsonl files")
    p.add_argument(
        "--normalize", choices=("sum", "char", "byte"), default="sum",
        help="option scores of the headline metrics: summed log-likelihoods (lm-eval's acc), per "
        "character (acc_norm) or per byte (acc_bytes); the report shows all three side by side "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--temperature-fit", type=nonempty("a task or samples file"), default=None, metavar="TASK",
        help="fit a temperature on this task (one of the SAMPLES tasks, or another samples file) "
        "and report temperature-scaled metrics for every task",
    )
    p.add_argument(
        "--target-delimiter", type=unescape, default=" ", metavar="TEXT",
        help="the tasks' target delimiter, removed from each continuation to get the choice text "
        "acc_norm and acc_bytes divide by (default: a space)",
    )
    g = p.add_argument_group("generate_until tasks (semantic confidence of the N responses)")
    add_semantic_args(g)
    g.add_argument("--response-regex", type=_regex, default=None, metavar="REGEX",
                   help="extract each response's answer as lm-eval's regex filter does (group 1 of the "
                   "first match, '[invalid]' without one) before comparing answers")
    p.add_argument("--seed", type=non_negative_int, default=0, metavar="S",
                   help="bootstrap seed, and the sample splits' (default: %(default)s)")
    p.add_argument("--bins", **BINS_FLAG)
    p.add_argument(
        "--bootstrap", type=non_negative_int, default=1000, metavar="R",
        help="bootstrap resamples for the 95%% confidence intervals; 0 disables them (default: %(default)s)",
    )
    p.add_argument("--out", type=PATH, required=True, metavar="DIR", help="output directory (created if missing)")
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
    import contextlib

    from llm_calib.data.lm_eval_logs import check_samples_file
    from llm_calib.files.outputs import check_output_folder, earlier_report, run_lock

    for path in args.samples:  # a folder's error lists the samples files in it
        user_call(lambda path=path: check_samples_file(path), None)
    user_call(lambda: check_output_folder(args.out), None)  # before reading and scoring, not after
    user_call(lambda: earlier_report(args.out), None)  # report files of another kind there: refused now
    with contextlib.ExitStack() as stack:  # evaluate's and calibrate's lock: one run at a time writes to --out
        user_call(lambda: stack.enter_context(run_lock(args.out)), None)
        return _run_locked(args)


def _run_locked(args: argparse.Namespace) -> int:
    """:func:`run` after the checks of ``--out``, while holding its lock."""
    from llm_calib.confidence.lm_eval_generations import is_generation_row
    from llm_calib.data.lm_eval_logs import first_row
    from llm_calib.evaluation.lm_eval_samples import generation_result, samples_result
    from llm_calib.evaluation.report import write_report
    from llm_calib.files.outputs import earlier_report, remove_stale

    generation = [p for p in args.samples if is_generation_row(user_call(lambda p=p: first_row(p) or {}, None))]
    choice = [p for p in args.samples if p not in generation]
    stats = {"n_bins": args.bins, "ci": args.bootstrap > 0, "n_resamples": max(args.bootstrap, 1), "seed": args.seed}
    if generation and args.temperature_fit:
        raise UserError("--temperature-fit: generate_until samples log no scores a temperature could scale")
    results = []
    if choice:
        results.append(user_call(lambda: samples_result(
            choice, normalize=args.normalize, temperature_fit=args.temperature_fit,
            target_delimiter=args.target_delimiter, **stats), "metrics"))
    if generation:
        results.append(user_call(lambda: generation_result(
            generation, equivalence=args.equivalence, threshold=args.f1_threshold, estimator=args.estimator,
            splits=args.splits, response_regex=args.response_regex, **stats), "metrics"))
    result = results[0]
    if len(results) == 2:  # one report: the multiple-choice tasks, then the generation tasks
        result.domains.update(results[1].domains)
        result.config["generate_until"] = results[1].config
    earlier = user_call(lambda: earlier_report(args.out), None)
    paths = write_report(result, args.out, title="Calibration report (lm-eval samples)")
    remove_stale(earlier, list(paths.values()))  # an earlier report's diagrams do not stay beside this one
    print_summary(result, paths, args.out)
    return 0
