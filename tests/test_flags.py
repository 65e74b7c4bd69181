"""llm_calib.cli.flags (a parser and metavar per field type, help text from docstrings) and the
benchmarks' harness.flags built on it: a typed, documented flag per dataclass field, parsed back
to the fields given."""

from __future__ import annotations

import argparse
import doctest
from dataclasses import dataclass

import pytest
from _benchmarks import BENCHMARKS  # noqa: F401  (puts benchmarks/ on sys.path for harness)
from harness import flags as harness_flags
from harness.flags import add_dataclass_flags, dataclass_overrides

from llm_calib.cli.flags import (
    flag_type,
    optional,
    parse_bool,
    parse_csv,
    plain_help,
)


@dataclass(frozen=True)
class Settings:
    """Settings of a test.

    Attributes:
        name: the name.
        steps: training steps (``steps`` of :class:`Other`), 100% of them.
        lr, scale: step sizes
            over two lines.
        layers: the layers.
        ks: sizes, ``none`` for all.
        quick: run fast.
        budget: seconds, or none.
    """

    name: str = "x"
    steps: int = 3
    lr: float = 0.1
    scale: float = 1.0
    layers: tuple[int, ...] = (1, 2)
    ks: tuple[int | None, ...] = (2, None)
    quick: bool = False
    budget: float | None = None


def _parser(**kw):
    p = argparse.ArgumentParser(prog="t")
    return p, add_dataclass_flags(p, Settings, **kw)


def test_every_field_gets_a_typed_documented_flag() -> None:
    p, added = _parser(exclude=("name",))
    assert added == ["steps", "lr", "scale", "layers", "ks", "quick", "budget"]
    text = p.format_help()
    assert "--steps INT" in text and "training steps (steps of Other), 100% of them. (default: 3)" in " ".join(text.split())
    assert "step sizes over two lines. (default: 0.1)" in " ".join(text.split())
    assert "--layers A,B,..." in text and "(default: 1,2)" in text and "--quick {true,false}" in text
    assert "--budget FLOAT|null" in text and "--name" not in text
    args = p.parse_args(["--steps", "7", "--layers", "4, 5", "--ks", "3,none", "--quick", "yes", "--budget", "null",
                         "--lr", "0.5"])
    over = dataclass_overrides(args, Settings)
    assert over == {"steps": 7, "lr": 0.5, "layers": (4, 5), "ks": (3, None), "quick": True, "budget": None}
    assert dataclass_overrides(p.parse_args([]), Settings) == {}


def test_bad_values_name_the_flag(capsys) -> None:
    p, _ = _parser()
    for argv, needle in ((["--steps", "x"], "--steps: invalid int value"),
                         (["--quick", "maybe"], "expected true or false, got 'maybe'"),
                         (["--layers", "1,a"], "expected a comma-separated list, got '1,a'")):
        with pytest.raises(SystemExit):
            p.parse_args(argv)
        assert needle in capsys.readouterr().err
    with pytest.raises(TypeError, match="must be a dataclass"):
        add_dataclass_flags(p, int)


def test_defaults_of_an_instance_and_a_prefix() -> None:
    p = argparse.ArgumentParser()
    add_dataclass_flags(p, Settings, defaults=Settings(steps=9), dest_prefix="s.")
    assert "(default: 9)" in p.format_help()
    assert dataclass_overrides(p.parse_args(["--steps", "1"]), Settings, dest_prefix="s.") == {"steps": 1}


def test_the_parsers() -> None:
    assert [parse_bool(t) for t in ("TRUE", "no", "1")] == [True, False, True]
    assert parse_csv(float)("1, 2.5,,") == (1.0, 2.5)
    assert optional(float)("None") is None and optional(float)("2") == 2.0
    assert flag_type(str)[1] == "VALUE" and flag_type(tuple[str, ...])[0]("a,b") == ("a", "b")
    assert flag_type(bool | None)[0]("null") is None and flag_type(int | None)[1] == "INT|null"
    assert plain_help(":func:`llm_calib.calm.trainer.calibrate` and ``x``") == "llm_calib.calm.trainer.calibrate and x"


def test_the_harness_docstring_examples_run() -> None:
    """benchmarks/ is outside the doctest paths: its examples run here."""
    results = doctest.testmod(harness_flags, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert results.attempted >= 4 and results.failed == 0
