"""Every benchmark script imports and answers ``--help``; every import in ``benchmarks/`` resolves.

A script's measuring mode can run for hours and needs models or peers this suite does not have, so it is
not run here; but each script is imported (its module-level imports resolve), its ``main`` parses
``--help`` (its command line is well formed), and every ``import`` / ``from ... import`` statement of the
scripts and of their ``harness`` package, the ones inside functions included, names a module and names
that exist (a script importing a module that was deleted, as ``precision_memory.py`` did with
``_memory``, fails here). Peers that are optional (jax, benchopt, lm-eval, ...) are not checked.
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import importlib.util
import io
import sys
from pathlib import Path

import pytest
from _benchmarks import BENCHMARKS, load_benchmark

CHECKED_ROOTS = ("llm_calib", "hypergrad", "harness")
"""Import roots whose names are checked: the two packages and the benchmarks' harness."""

PLUGINS = {"benchopt_hypergrad_solver": "benchopt"}
"""Files of benchmarks/ that are not scripts but plugins loaded by a peer, and the peer they need."""


def scripts() -> list[str]:
    return sorted(p.stem for p in BENCHMARKS.glob("*.py") if p.stem not in PLUGINS)


def test_every_script_has_a_main_and_a_command_line() -> None:
    missing = [s for s in scripts() if 'if __name__ == "__main__"' not in (BENCHMARKS / f"{s}.py").read_text()]
    assert not missing, f"benchmarks/ holds only scripts (libraries go to benchmarks/harness/): {missing}"


@pytest.mark.parametrize("name", scripts())
def test_the_script_imports_and_answers_help(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    module = load_benchmark(name)
    out = io.StringIO()
    monkeypatch.setattr(sys, "argv", [f"benchmarks/{name}.py", "--help"])
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exit_:
        module.main()
    assert exit_.value.code in (0, None), f"{name} --help exited with {exit_.value.code}"
    assert "usage:" in out.getvalue(), f"{name} --help printed no usage"


@pytest.mark.parametrize("name", sorted(PLUGINS))
def test_a_plugin_imports_where_its_peer_is_installed(name: str) -> None:
    pytest.importorskip(PLUGINS[name])
    load_benchmark(name)


def unresolved_imports(path: Path) -> list[str]:
    """``file:line`` of each import statement in ``path`` (at any depth) of a project or benchmark module that
    does not exist, or of a name that module does not have."""
    siblings = {p.stem for p in BENCHMARKS.glob("*.py")}
    problems = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            wanted = [(alias.name, None) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            wanted = [(node.module, alias.name) for alias in node.names]
        else:
            continue
        for module, name in wanted:
            root = module.split(".")[0]
            if root not in CHECKED_ROOTS and root not in siblings and not root.startswith("_"):
                continue
            where = f"{path.relative_to(BENCHMARKS.parent)}:{node.lineno}"
            if importlib.util.find_spec(module) is None:
                problems.append(f"{where}: no module {module!r}")
                continue
            if name is not None and name != "*":
                mod = importlib.import_module(module)
                if not hasattr(mod, name) and not (hasattr(mod, "__path__") and importlib.util.find_spec(f"{module}.{name}")):
                    problems.append(f"{where}: {module!r} has no {name!r}")
    return list(dict.fromkeys(problems))


def test_every_import_of_the_benchmarks_resolves() -> None:
    files = sorted(BENCHMARKS.glob("*.py")) + sorted((BENCHMARKS / "harness").glob("*.py"))
    problems = [p for path in files for p in unresolved_imports(path)]
    assert not problems, "\n".join(problems)


def test_the_import_check_sees_a_deleted_module_inside_a_function(tmp_path: Path) -> None:
    script = BENCHMARKS / "probe_for_the_import_check.py"  # the checker reads benchmarks/-relative paths
    try:
        script.write_text("def child():\n    from _memory import Phase\n    from harness.report import no_such_name\n")
        problems = unresolved_imports(script)
    finally:
        script.unlink()
    assert problems == ["benchmarks/probe_for_the_import_check.py:2: no module '_memory'",
                        "benchmarks/probe_for_the_import_check.py:3: 'harness.report' has no 'no_such_name'"]


MACHINE_READERS = ("/proc/cpuinfo", "lscpu", "platform.processor(", "/proc/loadavg", "os.getloadavg(")
"""What a script that wrote its own machine line read; only ``harness/report.py`` reads them."""


def machine_readers(path: Path) -> list[str]:
    """``file:line`` of each line of ``path`` (code, not its docstrings or comments) that reads the machine itself."""
    lines = path.read_text(encoding="utf-8").splitlines()
    docs = {n for node in ast.walk(ast.parse("\n".join(lines)))
            if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
            for n in range(node.lineno, node.end_lineno + 1)}
    return [f"{path.relative_to(BENCHMARKS.parent)}:{i}" for i, line in enumerate(lines, 1)
            if i not in docs and any(r in line.split("#", 1)[0] for r in MACHINE_READERS)]


def test_the_machine_line_comes_from_the_harness() -> None:
    """One machine line: every script takes it from ``harness.report`` (machine_info, machine_line, load_average)."""
    files = [p for p in sorted(BENCHMARKS.glob("*.py")) + sorted((BENCHMARKS / "harness").glob("*.py"))
             if p.name != "report.py" and p.stem not in PLUGINS]
    found = [f for path in files for f in machine_readers(path)]
    assert not found, "read the machine through harness.report (machine_info / machine_line / load_average):\n" + "\n".join(found)


def test_the_machine_check_sees_a_script_of_its_own(tmp_path: Path) -> None:
    script = BENCHMARKS / "probe_for_the_machine_check.py"  # the checker reads benchmarks/-relative paths
    try:
        script.write_text('"""Reads /proc/cpuinfo? Not here."""\nimport platform\n# lscpu in a comment\n'
                          'cpu = platform.processor()\n')
        found = machine_readers(script)
    finally:
        script.unlink()
    assert found == ["benchmarks/probe_for_the_machine_check.py:4"]


def test_gpu_rows_script_calls_existing_scripts_with_their_flags():
    """benchmarks/gpu_rows.sh, run when a GPU is lent (no second try): valid bash, and every script it
    names exists and defines every flag it is given."""
    import re
    import subprocess

    script = BENCHMARKS / "gpu_rows.sh"
    subprocess.run(["bash", "-n", str(script)], check=True)
    commands = re.sub(r"\\\n\s*", " ", script.read_text())
    calls = re.findall(r"benchmarks/(\w+)\.py([^\n>]*)", commands)
    assert {name for name, _ in calls} == {"gpu_check", "step_overhead"}
    for name, args in calls:
        source = (BENCHMARKS / f"{name}.py").read_text()
        for flag in re.findall(r"(--[\w-]+)", args):
            assert f'"{flag}"' in source, f"{name}.py has no {flag}"
