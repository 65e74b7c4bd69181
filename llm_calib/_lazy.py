"""Lazy re-exports (PEP 562): a package's public names, imported from their modules on first access."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_exports(namespace: dict[str, Any], homes: dict[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The ``__getattr__`` and ``__dir__`` of the package whose ``globals()`` is ``namespace``; ``homes``
    maps each lazy name to the module that defines it (cached in ``namespace`` once imported)."""

    def module_getattr(name: str) -> Any:
        if name not in homes:
            raise AttributeError(f"module {namespace['__name__']!r} has no attribute {name!r}")
        value = namespace[name] = getattr(importlib.import_module(homes[name]), name)
        return value

    def module_dir() -> list[str]:
        return sorted(set(namespace) | set(namespace["__all__"]))

    return module_getattr, module_dir
