"""Every public module of ``hypergrad`` and ``llm_calib`` has its page in the API reference."""

from __future__ import annotations

import importlib
import re
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
API = ROOT / "docs" / "api"


def public_modules() -> set[str]:
    """Dotted names of the modules that have no ``_``-prefixed component (``__init__`` aside)."""
    out = set()
    for package in ("hypergrad", "llm_calib"):
        for path in (ROOT / package).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            if any(p.startswith("_") for p in parts):
                continue
            out.add(".".join(parts))
    return out


OPTIONAL_EXTRAS = {"trl", "lm_eval", "torchopt", "higher", "bitsandbytes"}
"""Imports of optional extras: a module that cannot load without one is skipped where it is not installed."""


def import_unless_extra_missing(name: str) -> Any:
    """The module ``name``, or None where it needs an optional extra that is not installed."""
    try:
        return importlib.import_module(name)
    except ImportError as err:
        missing = err.__cause__ if isinstance(err.__cause__, ModuleNotFoundError) else err
        if isinstance(missing, ModuleNotFoundError) and (missing.name or "").split(".")[0] in OPTIONAL_EXTRAS:
            return None
        raise


def documented_modules() -> set[str]:
    text = "\n".join(p.read_text() for p in API.glob("*.rst"))
    return set(re.findall(r"^\.\. automodule:: ([\w.]+)", text, flags=re.MULTILINE))


def test_every_public_module_is_documented() -> None:
    missing = public_modules() - documented_modules()
    assert not missing, f"add these modules to a page under docs/api/: {sorted(missing)}"


def test_documented_modules_exist() -> None:
    for name in documented_modules():
        import_unless_extra_missing(name)


def test_public_functions_and_classes_have_docstrings() -> None:
    undocumented = []
    for name in public_modules():
        module = import_unless_extra_missing(name)
        if module is None:
            continue
        for symbol in getattr(module, "__all__", []):
            obj = getattr(module, symbol)
            if getattr(obj, "__module__", None) == name and callable(obj) and not obj.__doc__:
                undocumented.append(f"{name}.{symbol}")
    assert not undocumented, undocumented


def test_architecture_names_the_scorer_registry_the_code_reads() -> None:
    """docs/architecture.md registers a new scorer where the commands, evaluation and the trainer
    look it up: the ``--scorer`` choices of ``evaluate`` and ``calibrate`` and the config's are
    the names of that registry."""
    from llm_calib import cli
    from llm_calib.config.calibration import PromptSettings
    from llm_calib.formats import MULTIPLE_CHOICE_FORMATS

    paragraph = (ROOT / "docs" / "architecture.md").read_text().split("**A scorer**", 1)[1].split("\n\n", 1)[0]
    assert "registered by name with {func}`~llm_calib.formats.registry.register_format`" in paragraph
    commands = cli.build_parser()._subparsers._group_actions[0].choices
    for command, dest in (("evaluate", "scorer"), ("calibrate", "cfg:prompt.scorer")):
        flag = next(a for a in commands[command]._actions if a.dest == dest)
        assert tuple(flag.choices) == tuple(MULTIPLE_CHOICE_FORMATS), command
    assert PromptSettings.field_choices["scorer"] == tuple(MULTIPLE_CHOICE_FORMATS)
