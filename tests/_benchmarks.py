"""Import a script from ``benchmarks/`` (not a package) as a module, for the benchmark tests."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def load_benchmark(name: str) -> ModuleType:
    """Import ``benchmarks/<name>.py`` as the module ``name``, as the scripts import each other
    (``hypergrad_bench`` imports ``hg_harness``, ``implicit_dense`` imports ``hypergrad_bench``):
    the folder goes on ``sys.path`` (last, so it shadows nothing), and every name is loaded once
    (its dataclasses and forked workers look their module up in ``sys.modules``)."""
    if str(BENCHMARKS) not in sys.path:
        sys.path.append(str(BENCHMARKS))
    module = importlib.import_module(name)
    if Path(module.__file__ or "").resolve().parent != BENCHMARKS:
        raise ImportError(f"{name!r} resolves to {module.__file__}, not to a script in {BENCHMARKS}")
    return module
