"""No module of ``llm_calib``, ``benchmarks`` or ``tests`` reaches into another module's private names.

A private name is one with a leading underscore (dunders aside): a module-level ``_helper``, or
a private module such as ``llm_calib.data._io``. Allowed: a package's own private modules used by
the modules of that package (``llm_calib/data/ai2.py`` importing ``llm_calib.data._io``), and the
helper modules of ``tests/`` and ``benchmarks/`` (``tests/_problems.py``, ``tests/_benchmarks.py``)
used from their own folder. Checked statically (``ast``): ``from M import _x``, ``import M._x``,
``alias._x`` where ``alias`` names an imported project module, and dotted strings such as
``"llm_calib.calm.trainer._x"`` (monkeypatch targets, docs references).

Also attribute access to another module's private names on any object: ``obj._x`` (and
``getattr/setattr/hasattr/delattr(obj, "_x")``, ``monkeypatch.setattr(obj, "_x", ...)``) where
``_x`` is defined privately (a ``def``, class, module-level or ``self._x`` assignment) only in
*other* files of ``hypergrad`` / ``llm_calib`` — ``enc._pack(...)``, ``trainer._recorder`` — but
not ``self._x`` / ``cls._x`` / ``super()._x``. A file may touch a private name it defines itself.
The rare legitimate exception goes into :data:`ALLOWED` with its reason.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PROJECT = ("llm_calib", "hypergrad")
CHECKED = ("hypergrad", "llm_calib", "benchmarks", "tests")
ALLOWED: dict[tuple[str, str], str] = {
    ("tests/test_models.py", "_convert_gguf"): "replaces the GGUF conversion (slow, needs the model wheel) to see "
    "that load() converts only an invalid cache",
}
"""``(file relative to the root, private name) -> why`` this file may touch another module's private
name. Keep it short: a test of a module's own private helper, where no public seam exists."""
ACCESSORS = ("getattr", "setattr", "hasattr", "delattr")
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
        return True  # tests/_problems.py from tests/, a benchmarks/_helper.py from benchmarks/
    for i, part in enumerate(parts):
        if _private(part):
            owner = ".".join(parts[:i])
            here = _package_of(path)
            if not (here == owner or here.startswith(owner + ".")):
                return False
    return True


def _private_definitions() -> dict[str, set[Path]]:
    """Private name -> the project files (``hypergrad``, ``llm_calib``) that define it."""
    out: dict[str, set[Path]] = {}
    for package in PROJECT:
        for path in (ROOT / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
                names: list[str] = []
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                    names = [node.name]
                elif isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign):
                    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                    names = [n.id if isinstance(n, ast.Name) else n.attr for t in targets for n in ast.walk(t)
                             if isinstance(n, ast.Name | ast.Attribute)]
                for name in names:
                    if _private(name):
                        out.setdefault(name, set()).add(path.resolve())
    return out


DEFINED = _private_definitions()


def _is_own(base: ast.expr) -> bool:
    """``self``, ``cls`` or ``super()``: an object's own private names."""
    if isinstance(base, ast.Name):
        return base.id in ("self", "cls")
    return isinstance(base, ast.Call) and isinstance(base.func, ast.Name) and base.func.id == "super"


def _foreign(name: str, path: Path) -> bool:
    """A private name defined only in other project files than ``path``."""
    owners = DEFINED.get(name)
    rel = str(path.relative_to(ROOT))
    return bool(owners) and path.resolve() not in owners and (rel, name) not in ALLOWED


def _accessed_name(node: ast.Call) -> tuple[ast.expr, str] | None:
    """``(object, "_x")`` of ``getattr(obj, "_x")`` & co. and ``*.setattr(obj, "_x", ...)``."""
    func = node.func
    named = (isinstance(func, ast.Name) and func.id in ACCESSORS) or (
        isinstance(func, ast.Attribute) and func.attr in ("setattr", "delattr"))
    if named and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str):
        return node.args[0], node.args[1].value
    return None


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
            elif not _is_own(node.value) and _foreign(node.attr, path):
                owners = ", ".join(sorted(str(p.relative_to(ROOT)) for p in DEFINED[node.attr]))
                out.append(f"{rel}:{node.lineno}: {ast.unparse(node)} (private to {owners})")
        elif isinstance(node, ast.Call) and (hit := _accessed_name(node)) is not None:
            obj, name = hit
            if _private(name) and not _is_own(obj) and _foreign(name, path):
                owners = ", ".join(sorted(str(p.relative_to(ROOT)) for p in DEFINED[name]))
                out.append(f"{rel}:{node.lineno}: {ast.unparse(node.func)}(..., {name!r}) (private to {owners})")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and path != Path(__file__).resolve():
            for match in PRIVATE_PATH.findall(node.value):
                module = match.rsplit(".", 1)[0]
                if not _module_allowed(match, path, folder) or module != _package_of(path) + "." + path.stem:
                    out.append(f"{rel}:{node.lineno}: string {match!r}")
    return out


@pytest.mark.parametrize("folder", CHECKED)
def test_no_private_cross_module_references(folder: str) -> None:
    found = sorted({v for path in sorted((ROOT / folder).rglob("*.py")) for v in violations(path)})
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
        # another module's private names on an instance, or by name
        ("def f(enc):\n    return enc.pack([0], 0), enc.trunk_cache\n", False),
        ("def f(lm, p, t):\n    return lm._top_layers(None, p, t)\n", True),
        ("def f(tr):\n    return tr._FirstValues\n", True),
        ("def f(lm):\n    return getattr(lm, '_split_scale')\n", True),
        ("def f(mp, t):\n    mp.setattr(t, '_split_scale', None)\n", True),
        ("class B:\n    def g(self):\n        return super()._logits\n", False),
        ("def f(x):\n    return x._not_defined_anywhere_in_the_project, getattr(x, 'name')\n", False),
    ],
)
def test_the_checker_catches_each_form(tmp_path, source, bad) -> None:
    probe = ROOT / "tests" / "_probe_private_imports.py"
    probe.write_text(source)
    try:
        assert bool(violations(probe)) is bad, violations(probe)
    finally:
        probe.unlink()
