"""Import a script from ``benchmarks/`` (not a package) as a module, for the benchmark tests.

Importing this module also puts ``benchmarks/`` on ``sys.path``, as running a script from it
does, so that the scripts' own imports (``harness.*``, ``naive_scoring``) and the tests of the
benchmark tooling (``from harness.sweep import ...``) resolve.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
if str(BENCHMARKS) not in sys.path:
    sys.path.insert(0, str(BENCHMARKS))


def load_benchmark(name: str) -> ModuleType:
    """Execute ``benchmarks/<name>.py`` once and register it in ``sys.modules`` under ``name``
    (its dataclasses and forked workers look their module up there)."""
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
