"""The ``llm-calib`` command: its parser (one subparser per command, each from its module) and
its entry point."""

from __future__ import annotations

import argparse
import contextlib
import errno
import sys
from collections.abc import Iterator, Sequence

from llm_calib.cli import calibrate, demo, evaluate, export, metrics
from llm_calib.cli._common import UserError, did_you_mean
from llm_calib.cli._interrupts import exit_status, stopped_message, terminate_as_interrupt

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    """The ``llm-calib`` argument parser (one subparser per subcommand).

    Example:
        >>> args = build_parser().parse_args(["evaluate", "--data", "builtin", "--out", "x"])
        >>> args.command, args.data, args.fewshot
        ('evaluate', ['builtin'], None)
    """
    parser = argparse.ArgumentParser(
        prog="llm-calib",
        description="Calibration of causal language models: evaluation and training (CALM).",
    )
    from llm_calib.version import __version__

    parser.add_argument("--version", action="version", version=f"llm-calib {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in (evaluate, calibrate, export, demo, metrics):  # the order of --help
        command.add_parser(sub)
    return parser


def _reject_unknown(sub: argparse.ArgumentParser, unknown: list[str]) -> None:
    """Exit (status 2) with the subcommand's usage, naming the unknown arguments and, for each
    unknown flag, the closest flag the subcommand has."""
    flags = [s for a in sub._actions for s in a.option_strings if s.startswith("--")]
    hints = [f"{flag}{hint}" for flag in (w.split("=", 1)[0] for w in unknown if w.startswith("-"))
             for hint in [did_you_mean(flag, flags)] if hint]
    sub.error(f"unrecognized arguments: {' '.join(unknown)}" + "".join(f"\n  {h}" for h in hints))


_ENVIRONMENT_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES})
"""Errors of the machine rather than the program, reported in one line with status 2."""


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``llm-calib`` command.

    Args:
        argv: arguments (default: ``sys.argv[1:]``).

    Returns:
        The exit status: 0 on success, 2 on a user error or a full disk / read-only output
        (message on stderr, naming the file), 130 when interrupted (Ctrl-C) and 143 when terminated
        (SIGTERM), with one line (``calibrate``: how to continue with ``--resume``) and the run's
        lock released.

    Example:
        >>> main(["evaluate", "--data", "nosuchloader:x", "--out", "/tmp/x", "--quiet"])
        2
    """
    with terminate_as_interrupt(), _one_line_warnings():
        args = None
        try:
            args = _parse(argv)
            return int(args.func(args) or 0)
        except UserError as exc:
            print(f"llm-calib: error: {exc}", file=sys.stderr)
            return 2
        except KeyboardInterrupt as stop:  # Ctrl-C or SIGTERM: one line (and how to continue), not a traceback
            hint = ""
            if getattr(args, "command", None) == "calibrate":
                hint = (f"; continue with the same command and --resume (from the newest checkpoint in "
                        f"{args.out}/checkpoints, with --checkpoint-every)")
            print(stopped_message(stop, hint), file=sys.stderr)
            return exit_status(stop)
        except OSError as exc:
            # a full disk, a quota or a folder that became read-only while writing the outputs: the
            # user's to fix, so one line (the atomic writers leave no truncated file behind), not a traceback
            if exc.errno not in _ENVIRONMENT_ERRNOS:
                raise
            print(f"llm-calib: error: {_located(exc, args)}", file=sys.stderr)
            return 2


@contextlib.contextmanager
def _one_line_warnings() -> Iterator[None]:
    """Warnings as the command's one-line messages (``llm-calib: warning: ...``), not Python's two
    lines of file, line number and source."""
    import warnings

    previous = warnings.formatwarning
    warnings.formatwarning = lambda message, *args, **kwargs: f"llm-calib: warning: {message}\n"
    try:
        yield
    finally:
        warnings.formatwarning = previous


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    """The parsed arguments (unknown ones exit with the subcommand's usage and the closest flags)."""
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = parser._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    if argv and not argv[0].startswith("-") and argv[0] not in commands:
        parser.error(f"unknown command {argv[0]!r}{did_you_mean(argv[0], commands)}; the commands: {', '.join(commands)}")
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # the subcommand's usage and the closest flags, not the top-level usage
        _reject_unknown(commands[args.command], unknown)
    if not (getattr(args, "load_in_4bit", False) or getattr(args, "load_in_8bit", False)):
        # bitsandbytes, imported by peft when installed, warns about its optional CPU kernels on
        # every run; without quantisation it is not used
        import logging

        logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
    return args


def _located(exc: OSError, args: argparse.Namespace | None) -> str:
    """An environment error's message naming the file: its own (``[Errno 28] ...: 'path'``), else
    the output folder the command was writing to (the writers name their file; this is the
    fallback for one that did not)."""
    if exc.filename is not None or not getattr(args, "out", None):
        return str(exc)
    return f"{exc} (while writing to --out {args.out})"
