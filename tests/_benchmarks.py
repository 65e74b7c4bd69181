"""Import a script from ``benchmarks/`` (not a package), or a module of its ``harness`` package, for the
benchmark tests.

Importing this module also puts ``benchmarks/`` on ``sys.path``, as running a script from it
does, so that the scripts' own imports (``harness.*``, ``harness.naive_scoring``) and the tests of the
benchmark tooling (``from harness.sweep import ...``) resolve.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
if str(BENCHMARKS) not in sys.path:
    sys.path.insert(0, str(BENCHMARKS))


def load_benchmark(name: str) -> ModuleType:
    """Import ``benchmarks/<name>.py`` as the module ``name``, as the scripts import each other
    (``hypergrad_bench`` imports ``harness.hypergrad_suite``, ``implicit_dense`` imports ``hypergrad_bench``):
    the folder goes on ``sys.path`` (last, so it shadows nothing), and every name is loaded once
    (its dataclasses and forked workers look their module up in ``sys.modules``)."""
    if str(BENCHMARKS) not in sys.path:
        sys.path.append(str(BENCHMARKS))
    module = importlib.import_module(name)
    if Path(module.__file__ or "").resolve().parent != BENCHMARKS:
        raise ImportError(f"{name!r} resolves to {module.__file__}, not to a script in {BENCHMARKS}")
    return module


def load_harness(name: str) -> ModuleType:
    """Import ``benchmarks/harness/<name>.py`` as ``harness.<name>``, as the scripts import it."""
    if str(BENCHMARKS) not in sys.path:
        sys.path.append(str(BENCHMARKS))
    module = importlib.import_module(f"harness.{name}")
    if Path(module.__file__ or "").resolve().parent != BENCHMARKS / "harness":
        raise ImportError(f"harness.{name} resolves to {module.__file__}, not to {BENCHMARKS / 'harness'}")
    return module
