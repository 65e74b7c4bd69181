"""``llm-calib demo``: the main job on the embedded default."""

from __future__ import annotations

import argparse

__all__ = ["add_parser", "run"]


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Add the ``demo`` command to the subcommands ``sub`` of the ``llm-calib`` parser.

    Example:
        >>> parser = argparse.ArgumentParser(prog="llm-calib")
        >>> add_parser(parser.add_subparsers(dest="command"))
        >>> parser.parse_args(["demo"]).func is run
        True
    """
    sub.add_parser("demo", help="run the main job on the embedded default").set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run the demo (:func:`llm_calib.evaluation.demo.run_demo`); ``args`` has no settings.

    Returns:
        0.

    Example:
        >>> from llm_calib.cli import build_parser
        >>> build_parser().parse_args(["demo"]).func is run
        True
    """
    from llm_calib.evaluation.demo import run_demo

    run_demo()
    return 0
