"""No module of ``llm_calib``, ``benchmarks`` or ``tests`` reaches into another module's private names.

A private name is one with a leading underscore (dunders aside): a module-level ``_helper``, or
a private module such as ``llm_calib.data._io``. Allowed: a package's own private modules used by
the modules of that package (``llm_calib/data/ai2.py`` importing ``llm_calib.data._io``), and the
helper modules of ``tests/`` and ``benchmarks/`` (``tests/_problems.py``, ``benchmarks/_memory.py``)
used from their own folder. Checked statically (``ast``): ``from M import _x``, ``import M._x``,
``alias._x`` where ``alias`` names an imported project module, and dotted strings such as
``"llm_calib.calm.trainer._x"`` (monkeypatch targets, docs references).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PROJECT = ("llm_calib", "hypergrad")
CHECKED = ("llm_calib", "benchmarks", "tests")
PRIVATE_PATH = re.compile(r"\b(?:llm_calib|hypergrad)(?:\.\w+)*\._[A-Za-z0-9]\w*")


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _local_helpers(folder: str) -> set[str]:
    return {p.stem for p in (ROOT / folder).glob("_*.py")}


def _package_of(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])


def _is_project(module: str, folder: str) -> bool:
    top = module.split(".")[0]
    return top in PROJECT or top == folder or top in _local_helpers("tests") | _local_helpers("benchmarks")


def _module_allowed(module: str, path: Path, folder: str) -> bool:
    """A dotted module with private parts is importable only from inside the package that owns it."""
    parts = module.split(".")
    if parts[0] in _local_helpers(folder) or (parts[0] == folder and len(parts) == 2):
        return True  # tests/_problems.py from tests/, benchmarks/_memory.py from benchmarks/
    for i, part in enumerate(parts):
        if _private(part):
            owner = ".".join(parts[:i])
            here = _package_of(path)
            if not (here == owner or here.startswith(owner + ".")):
                return False
    return True


def violations(path: Path) -> list[str]:
    """The private cross-module references in one file, as ``file:line: what``."""
    folder = path.relative_to(ROOT).parts[0]
    tree = ast.parse(path.read_text(), filename=str(path))
    rel = path.relative_to(ROOT)
    out: list[str] = []
    aliases: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if _is_project(a.name, folder):
                    if not _module_allowed(a.name, path, folder):
                        out.append(f"{rel}:{node.lineno}: import {a.name}")
                    aliases.add(a.asname or a.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and _is_project(node.module, folder):
            if not _module_allowed(node.module, path, folder):
                out.append(f"{rel}:{node.lineno}: from {node.module} import ...")
            for a in node.names:
                if _private(a.name):
                    out.append(f"{rel}:{node.lineno}: from {node.module} import {a.name}")
                else:
                    aliases.add(a.asname or a.name)  # may be a module (from llm_calib import models)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            base = node.value
            while isinstance(base, ast.Attribute):
                base = base.value
            if isinstance(base, ast.Name) and base.id in aliases:
                out.append(f"{rel}:{node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and path != Path(__file__).resolve():
            for match in PRIVATE_PATH.findall(node.value):
                module = match.rsplit(".", 1)[0]
                if not _module_allowed(match, path, folder) or module != _package_of(path) + "." + path.stem:
                    out.append(f"{rel}:{node.lineno}: string {match!r}")
    return out


@pytest.mark.parametrize("folder", CHECKED)
def test_no_private_cross_module_references(folder: str) -> None:
    found = [v for path in sorted((ROOT / folder).rglob("*.py")) for v in violations(path)]
    assert not found, "private names used across modules:\n" + "\n".join(found)


@pytest.mark.parametrize(
    ("source", "bad"),
    [
        ("from llm_calib.calm.trainer import _evaluate\n", True),
        ("from llm_calib.data._io import decode_line\n", True),  # checked from tests/, outside llm_calib.data
        ("import llm_calib.calm.trainer as t\nt._batch_indices = None\n", True),
        ("import hypergrad as hg\nhg._autodiff.loss_and_grads\n", True),
        ("from llm_calib import models\nmodels._cache_is_valid(1, 2)\n", True),
        ("x = 'llm_calib.calm.trainer._shard'\n", True),
        ("from _problems import DT\nfrom tests._problems import Ridge\n", False),
        ("from llm_calib.calm.training import train_step\nimport argparse\nargparse._SubParsersAction\n", False),
        ("class A:\n    def _f(self):\n        return self._g\n", False),
    ],
)
def test_the_checker_catches_each_form(tmp_path, source, bad) -> None:
    probe = ROOT / "tests" / "_probe_private_imports.py"
    probe.write_text(source)
    try:
        assert bool(violations(probe)) is bad, violations(probe)
    finally:
        probe.unlink()
