"""The one registry type: objectives, solvers, task formats and data loaders register, load their
built-ins and fail the same way."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from llm_calib.data.spec import register_loader, unregister_loader
from llm_calib.formats.registry import register_format, unregister_format
from llm_calib.objectives.registry import register_objective, register_solver, unregister_objective
from llm_calib.registry import (
    LOADERS,
    OBJECTIVES,
    SOLVERS,
    TASK_FORMATS,
    BuiltinEntryError,
    InvalidNameError,
    NameTakenError,
    Registry,
    RegistryError,
    UnknownNameError,
)

ROOT = Path(__file__).resolve().parent.parent
REGISTRIES = {"objective": OBJECTIVES, "solver": SOLVERS, "format": TASK_FORMATS, "loader": LOADERS}


def test_one_registry_class_in_the_library() -> None:
    """No class of llm_calib but :class:`~llm_calib.registry.Registry` keeps a table with register and unregister."""
    owners = []
    for path in sorted((ROOT / "llm_calib").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef):
                methods = {n.name for n in node.body if isinstance(n, ast.FunctionDef)}
                if {"register", "unregister"} <= methods:
                    owners.append(f"{path.relative_to(ROOT)}:{node.name}")
    assert owners == ["llm_calib/registry.py:Registry"], owners
    assert all(isinstance(r, Registry) for r in REGISTRIES.values())


@pytest.mark.parametrize("kind", sorted(REGISTRIES))
def test_every_builtin_is_registered_by_the_module_the_table_names(kind: str) -> None:
    registry = REGISTRIES[kind]
    entries = registry.entries()
    assert list(entries)[: len(registry.builtins)] == list(registry.builtins)
    for name, module in registry.builtins.items():
        assert module in sys.modules, (name, module)


def test_names_are_known_before_any_builtin_loads() -> None:
    """In a fresh interpreter the names are listed and checked without importing an objective, a format or a
    loader; the first lookup of a name imports the module that registers it."""
    code = """
import sys
from llm_calib.registry import LOADERS, OBJECTIVES, SOLVERS, TASK_FORMATS
assert "calm" in OBJECTIVES and "bome" in SOLVERS and "letter" in TASK_FORMATS.names("multiple_choice")
assert "jsonl" in LOADERS and "open_ended" in TASK_FORMATS.names("open")
loaded = [m for m in sys.modules if m.startswith(("llm_calib.objectives.", "llm_calib.formats", "llm_calib.data"))]
assert loaded == ["llm_calib.objectives.registry"] or loaded == [], loaded
assert OBJECTIVES.get("lora_ce").__name__ == "LoraCE" and "llm_calib.objectives.lora_ce" in sys.modules
assert "llm_calib.objectives.calm" not in sys.modules
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                         env={"PYTHONPATH": str(ROOT), "PATH": ""})
    assert out.stdout.strip() == "ok", out.stderr


def test_one_error_type_per_misuse_in_every_registry() -> None:
    def loader(spec, on_error):
        raise AssertionError

    class Probe:
        family = "multiple_choice"

    decorators = {"objective": register_objective, "solver": register_solver}
    for kind, registry in REGISTRIES.items():
        with pytest.raises(InvalidNameError, match=f"{kind} name must be a Python identifier"):
            registry.register("not-a-name", Probe)
        with pytest.raises(BuiltinEntryError, match=f"the built-in {kind} '{next(iter(registry.builtins))}' cannot"):
            registry.unregister(next(iter(registry.builtins)))
        with pytest.raises(UnknownNameError, match=f"no {kind} 'absent_probe' is registered"):
            registry.unregister("absent_probe")
        with pytest.raises(UnknownNameError, match=r"must be one of \("):
            registry.get("absent_probe")
    # the packages' decorators raise the same types
    for decorate in decorators.values():
        with pytest.raises(InvalidNameError):
            decorate("a-b")
    with pytest.raises(InvalidNameError):
        register_loader("a:b", "a colon ends the loader name")
    register_objective("probe_objective")(Probe)
    try:
        with pytest.raises(NameTakenError, match="objective 'probe_objective' is already registered"):
            register_objective("probe_objective")(type("Other", (), {}))
    finally:
        unregister_objective("probe_objective")
    register_loader("probe_loader", "a probe", path=False)(loader)
    try:
        with pytest.raises(NameTakenError, match="loader 'probe_loader' is already registered"):
            register_loader("probe_loader", "another")(lambda spec, on_error: None)
        register_loader("probe_loader", "the same function again")(loader)  # a re-imported module is harmless
    finally:
        unregister_loader("probe_loader")
    with pytest.raises(BuiltinEntryError):
        unregister_format("letter")
    with pytest.raises(TypeError, match="takes a TaskFormat subclass"):
        register_format("probe_format")(Probe)
    assert all(issubclass(e, RegistryError) and issubclass(e, ValueError)
               for e in (InvalidNameError, NameTakenError, BuiltinEntryError, UnknownNameError))
