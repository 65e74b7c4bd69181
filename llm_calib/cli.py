"""Command line: ``llm-calib``."""

from __future__ import annotations

import argparse
import sys

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``llm-calib`` command."""
    parser = argparse.ArgumentParser(prog="llm-calib", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("demo", help="run the main job on the embedded default")
    args = parser.parse_args(argv)
    if args.command == "demo":
        from llm_calib.demo import run_demo

        run_demo()
    return 0


if __name__ == "__main__":
    sys.exit(main())
