"""The shape of ``llm_calib`` that issue 50 set: a small package root, the configuration a leaf,
the configuration resolved once at the entry points and only resolved values below them."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "llm_calib"

MAX_ROOT_MODULES = 10
MAX_CONFIG_IMPORTS = 12

ENTRY_POINTS = {
    ("calm/run.py", "resolve_run"),  # resolves a configuration into a ResolvedRun
    ("calm/trainer.py", "calibrate"),  # llm_calib.calibrate: resolves, then calibrate_run
}
"""The functions below the command line that take a :class:`~llm_calib.config.calibration.CalibrationConfig`:
they resolve it once. The configuration's own package (``config/``), the command line (``cli/``, which
builds configurations from flags and files) and the Hugging Face integrations (``integrations/``: a
``Trainer``, a step and collators built from a configuration, with no record sets to resolve a whole
run from) are entry points too."""

ENTRY_PACKAGES = ("config/", "cli/", "integrations/")

RESOLVING_MODULES = {"prompts/resolution.py", "calm/run.py", "integrations/collators.py"}
"""Where prompt settings are resolved: the module that owns prompt resolution, the one that resolves a run,
and the integrations' collators (entry points that take a configuration, see :data:`ENTRY_POINTS`)."""


def test_the_package_root_holds_at_most_ten_modules() -> None:
    root = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(root) <= MAX_ROOT_MODULES, f"{len(root)} modules at llm_calib/'s root (at most {MAX_ROOT_MODULES}): {root}"


def loaded_by_import(module: str) -> list[str]:
    """The ``llm_calib`` modules a fresh interpreter has loaded after ``import module``."""
    code = f"import sys, {module}; print('\\n'.join(sorted(m for m in sys.modules if m.split('.')[0] == 'llm_calib')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT,
                         env={"PYTHONPATH": str(ROOT), "PATH": ""}).stdout
    return out.split()


def test_the_configuration_is_a_leaf() -> None:
    """Importing the configuration loads no format, objective, scorer, engine or model code: names are
    checked against the registries' name tables, and the code behind a name loads when it is used."""
    loaded = loaded_by_import("llm_calib.config.calibration")
    assert len(loaded) <= MAX_CONFIG_IMPORTS, f"{len(loaded)} llm_calib modules (at most {MAX_CONFIG_IMPORTS}): {loaded}"
    heavy = [m for m in loaded if [*m.split("."), ""][1] in ("formats", "scoring", "engine", "confidence", "calm", "models",
                                                       "prompts", "data", "evaluation")
             or (m.startswith("llm_calib.objectives.") and m != "llm_calib.objectives.registry")]
    assert not heavy, heavy


def _functions(path: Path) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]


def config_parameters(path: Path, base: Path = PACKAGE) -> list[str]:
    """``file:line function(parameter)`` for each parameter of a function in ``path`` annotated with a
    type that mentions ``CalibrationConfig``."""
    out = []
    for fn in _functions(path):
        args = fn.args
        for a in (*args.posonlyargs, *args.args, *args.kwonlyargs):
            if a.annotation is not None and "CalibrationConfig" in ast.unparse(a.annotation):
                out.append(f"{path.relative_to(base)}:{fn.lineno} {fn.name}({a.arg})")
    return out


def test_no_function_below_the_entry_points_takes_a_configuration() -> None:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel.startswith(ENTRY_PACKAGES):
            continue
        found += [f for f in config_parameters(path) if (rel, f.split(" ")[1].split("(")[0]) not in ENTRY_POINTS]
    assert not found, ("below the entry points only resolved values travel (a ResolvedRun, its ResolvedPromptSettings, "
                       "or the part of the configuration a function reads):\n" + "\n".join(found))


def test_the_checker_sees_a_configuration_parameter(tmp_path: Path) -> None:
    """The checker itself: a parameter annotated with the configuration (also in a union) is found."""
    path = tmp_path / "probe.py"
    path.write_text("def f(run, config: CalibrationConfig | None = None): ...\ndef g(run: ResolvedRun): ...\n")
    assert config_parameters(path, tmp_path) == ["probe.py:1 f(config)"]


def test_prompt_settings_are_resolved_only_in_the_resolving_modules() -> None:
    """``resolve_prompt_settings`` (what ``format_settings`` was) is called in the module that owns prompt
    resolution and in :func:`~llm_calib.calm.run.resolve_run`, nowhere else in the library."""
    calls = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name | ast.Attribute)
                    and (node.func.id if isinstance(node.func, ast.Name) else node.func.attr)
                    in ("resolve_prompt_settings", "format_settings")):
                calls.append(path.relative_to(PACKAGE).as_posix())
    assert set(calls) <= RESOLVING_MODULES and "calm/run.py" in calls, sorted(set(calls))
