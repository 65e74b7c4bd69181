"""Command line: ``llm-calib``, one module per command.

Subcommands:

* ``llm-calib evaluate``: score data sets with a model and write ``metrics.json``, ``report.md``
  and one reliability diagram per domain.
* ``llm-calib calibrate``: train CALM (or the configured objective; ``--methods`` trains several on
  the same data, one model load, each method training and removing its own adapters), save each
  result, and compare them with the uncalibrated and temperature-scaled model per domain in
  ``report.md``, ``metrics.json`` and reliability diagrams.
* ``llm-calib export``: merge a saved adapter (LoRA and the output scale) into its base model and
  save a standalone Hugging Face model.
* ``llm-calib demo``: the main job on the embedded default.
* ``llm-calib metrics SAMPLES...``: the calibration report of lm-eval ``--log_samples`` files
  (:mod:`llm_calib.evaluation.lm_eval_samples`; no model needed).

Errors in the user's input (a bad data spec, a missing file, an unknown model) print one line
``llm-calib: error: ...`` and exit with status 2, without a traceback; Ctrl-C and SIGTERM print one
line and exit with 130 and 143, from the first second on (this package imports the commands, and
torch with them, only when :func:`main` runs).

Each command is one module with its flags (``add_parser``) and its run (``run``):
:mod:`~llm_calib.cli.evaluate`, :mod:`~llm_calib.cli.calibrate`, :mod:`~llm_calib.cli.export`,
:mod:`~llm_calib.cli.metrics`, :mod:`~llm_calib.cli.demo`; :mod:`~llm_calib.cli.app` builds the
parser and is the entry point (``llm-calib``, ``python -m llm_calib.cli``). Shared:
:mod:`~llm_calib.cli.prompt` (the prompt flags), :mod:`~llm_calib.cli.config_flags` (``calibrate``'s
configuration flags, generated with :mod:`~llm_calib.cli.flags` from the config's dataclasses).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from llm_calib._lazy import lazy_exports
from llm_calib.cli._interrupts import exit_status, stopped_message, terminate_as_interrupt

__all__ = ["PROMPT_FIELDS", "build_parser", "calibration_config", "main", "prompt_format"]

_LAZY = {"build_parser": "llm_calib.cli.app", "calibration_config": "llm_calib.cli.config_flags",
         "PROMPT_FIELDS": "llm_calib.cli.prompt", "prompt_format": "llm_calib.cli.prompt"}

if TYPE_CHECKING:
    from llm_calib.cli.app import build_parser
    from llm_calib.cli.config_flags import calibration_config
    from llm_calib.cli.prompt import PROMPT_FIELDS, prompt_format


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``llm-calib`` command (:func:`llm_calib.cli.app.main`), which it imports
    under the command's interrupt handling: Ctrl-C or SIGTERM while the commands and torch import
    (seconds) ends with one line and status 130 or 143, as later in the run.

    Example:
        >>> main(["evaluate", "--data", "nosuchloader:x", "--out", "/tmp/x", "--quiet"])
        2
    """
    with terminate_as_interrupt():
        try:
            from llm_calib.cli import app
        except KeyboardInterrupt as stop:
            print(stopped_message(stop), file=sys.stderr)
            return exit_status(stop)
        return app.main(argv)


__getattr__, __dir__ = lazy_exports(globals(), _LAZY)
