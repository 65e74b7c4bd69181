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

RESOLVING_MODULE = "prompts/resolution.py"
"""The one module that owns prompt resolution (``resolve_prompt_settings``, what ``format_settings`` was)."""

RESOLVING_CALLERS = {
    ("calm/run.py", "resolve_run"),  # the run resolved once: its prompt settings first
    ("integrations/collators.py", "MultipleChoiceCollator.__init__"),  # collators take a configuration (entry points)
    ("integrations/collators.py", "OpenAnswerCollator.__init__"),
}
"""The entry points outside :data:`RESOLVING_MODULE` that call the resolver: each resolves its configuration
once and passes the resolved settings on."""


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
    type that mentions ``CalibrationConfig``, and each parameter named ``config`` or ``cfg`` left untyped
    (no annotation, ``Any`` or ``object``: it could take one)."""
    out = []
    for fn in _functions(path):
        args = fn.args
        for a in (*args.posonlyargs, *args.args, *args.kwonlyargs):
            annotation = ast.unparse(a.annotation) if a.annotation is not None else None
            if ("CalibrationConfig" in (annotation or "")
                    or (a.arg in ("config", "cfg") and annotation in (None, "Any", "object"))):  # untyped: could be one
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
    path.write_text("def f(run, config: CalibrationConfig | None = None): ...\ndef g(run: ResolvedRun): ...\n"
                    "def h(cfg): ...\ndef k(config: Any): ...\ndef m(config: LoraSettings): ...\n")
    assert config_parameters(path, tmp_path) == ["probe.py:1 f(config)", "probe.py:3 h(cfg)", "probe.py:4 k(config)"]


def resolver_calls(path: Path, base: Path = PACKAGE) -> list[tuple[str, str]]:
    """``(file, Class.function)`` for each call of ``resolve_prompt_settings`` or ``format_settings`` in ``path``
    (``<module>`` at module level), by the innermost enclosing function."""
    calls: list[tuple[str, str]] = []

    def visit(node: ast.AST, scope: list[str]) -> None:
        for child in ast.iter_child_nodes(node):
            inner = [*scope, child.name] if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) else scope
            if isinstance(child, ast.Call) and isinstance(child.func, ast.Name | ast.Attribute) and (
                    child.func.id if isinstance(child.func, ast.Name) else child.func.attr) in ("resolve_prompt_settings",
                                                                                                 "format_settings"):
                calls.append((path.relative_to(base).as_posix(), ".".join(scope) or "<module>"))
            visit(child, inner)

    visit(ast.parse(path.read_text(encoding="utf-8")), [])
    return calls


def test_prompt_settings_are_resolved_only_in_the_resolving_module() -> None:
    """``resolve_prompt_settings`` (what ``format_settings`` was) is called in the module that owns prompt
    resolution and, outside it, only by the entry points of :data:`RESOLVING_CALLERS`: no deep user (the encoding
    cache, fast evaluation, the trainer, the formats) resolves prompt settings itself."""
    calls = [c for path in sorted(PACKAGE.rglob("*.py")) for c in resolver_calls(path)]
    outside = sorted({c for c in calls if c[0] != RESOLVING_MODULE} - RESOLVING_CALLERS)
    assert not outside, f"prompt settings resolved below the entry points: {outside}"
    assert ("calm/run.py", "resolve_run") in calls


def test_the_resolver_checker_names_the_calling_function(tmp_path: Path) -> None:
    """The checker itself: a call inside a method is named by its class and method, a module-level one too."""
    path = tmp_path / "probe.py"
    path.write_text("class EncodingCache:\n    def __call__(self, config):\n        return resolve_prompt_settings(config.prompt)\n"
                    "x = format_settings(config)\n")
    assert resolver_calls(path, tmp_path) == [("probe.py", "EncodingCache.__call__"), ("probe.py", "<module>")]
