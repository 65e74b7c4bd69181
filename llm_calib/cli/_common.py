"""What every ``llm-calib`` command shares: the user error and its one-line report, argparse
types, the ``--bins`` flag, status lines and the summary printed after a report."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any, TypeVar

_T = TypeVar("_T")


DATA_SPECS_HELP = """\
data specs (LOADER[:TARGET[:OPTION]]), for example:
  builtin                                    the built-in generated set (5 domains)
  arc_easy:../shared/data/arc_easy/test.jsonl
  arc_easy:../shared/data:dev                split of a data root
  mmlu_stem:../shared/data/mmlu/test         one MMLU group
  openbookqa:../shared/data/openbookqa/openbookqa.jsonl
  commonsenseqa:../shared/data/commonsenseqa/genmc_dev.jsonl
  jsonl:my_questions.jsonl                   generic {"question", "options", "answer"} rows
  lm_eval:arc_easy:num_fewshot=5             an lm-eval task, its prompts (lm-eval extra)
  lm_eval:my_task:include=tasks/             a local lm-eval task YAML
see llm_calib.data.spec for the full grammar."""
"""The data spec grammar in the ``--help`` epilog of ``evaluate`` and ``calibrate``."""


class UserError(Exception):
    """An error in the user's input, reported without a traceback."""


def int_at_least(minimum: int):
    """An argparse type accepting integers >= ``minimum``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {value}")
        return value

    return parse


def nonempty(what: str) -> Callable[[str], str]:
    """An argparse type accepting any text but an empty or blank one (``--out ""``, ``--out "$UNSET"``:
    a path flag given an unset shell variable must not mean the current folder).

    Example:
        >>> nonempty("a folder")("runs/x")
        'runs/x'
        >>> nonempty("a folder")(" ")
        Traceback (most recent call last):
        argparse.ArgumentTypeError: expected a folder, got ' ' (empty: an unset shell variable?)
    """

    def parse(text: str) -> str:
        if not text.strip():
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r} (empty: an unset shell variable?)")
        return text

    parse.__name__ = "nonempty"
    return parse


PATH = nonempty("a path")
"""The argparse type of every flag naming a file or folder (:func:`nonempty`)."""

MODEL = nonempty("a model (a folder, a .gguf file, a built-in alias or a hub name)")
"""The argparse type of ``--model``."""

SPEC = nonempty("a data spec")
"""The argparse type of every data spec flag."""

def _device(text: str) -> str:
    import torch

    nonempty("a torch device")(text)
    try:
        torch.device(text)
    except (RuntimeError, ValueError):
        raise argparse.ArgumentTypeError(f"expected a torch device (cpu, cuda, cuda:N, mps), got {text!r}") from None
    return text


DEVICE = _device
"""The argparse type of ``--device``: a device name torch can parse (whether this machine has it:
checked by each command before any loading)."""

positive_int = int_at_least(1)


non_negative_int = int_at_least(0)


DEFAULT_MODEL = "smollm2-135m-instruct"


BINS_FLAG: dict[str, Any] = {
    "type": positive_int, "default": 10,
    "help": "equal-width confidence bins for ECE and the reliability diagrams (default: %(default)s)",
}
"""``--bins`` of every command that writes a calibration report (evaluate, calibrate, metrics)."""


def print_summary(result: Any, paths: dict[str, Any], out: str) -> None:
    """The stdout summary of ``evaluate`` and ``metrics``: a line per domain (accuracy, ECE, the
    temperature-scaled ECE, the accuracy of each normalisation) and the files written."""
    for dom, r in result.domains.items():
        unc = r.uncalibrated
        line = f"{dom}: n={r.n} accuracy={unc['accuracy']:.3f} ECE={unc['ece']:.3f}"
        if r.temperature_scaled and result.temperature is not None:
            line += f" ECE(T={result.temperature.temperature:.2f})={r.temperature_scaled['ece']:.3f}"
        if r.normalizations:
            line += " | " + " ".join(f"{n}={m['accuracy']:.3f}" for n, m in r.normalizations.items())
        print(line)
    print(f"wrote {len(paths)} files to {out}")


def log_status(args: argparse.Namespace, message: str) -> None:
    """A status line on stderr, unless the command runs with ``--quiet``."""
    if not getattr(args, "quiet", False):
        print(message, file=sys.stderr, flush=True)


def unescape(text: str) -> str:
    """Command-line text with ``\\n`` and ``\\t`` written as escapes."""
    return text.replace("\\n", "\n").replace("\\t", "\t")


def user_call(
    fn: Callable[[], _T],
    what: str | None,
    errors: tuple[type[BaseException], ...] = (ValueError, OSError, KeyError, TypeError),
) -> _T:
    """``fn()``, its ``errors`` reported as user errors: ``what: message`` (the message alone when
    ``what`` is None)."""
    try:
        return fn()
    except errors as exc:
        message = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
        raise UserError(f"{message}" if what is None else f"{what}: {message}") from exc


def did_you_mean(word: str, candidates: Any) -> str:
    """``" (did you mean 'x'?)"`` for the closest of ``candidates`` to ``word``; empty when none is close."""
    import difflib

    close = difflib.get_close_matches(word, list(candidates), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""
