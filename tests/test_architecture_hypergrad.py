"""docs/architecture.md's ``hypergrad/`` block names every module and package of hypergrad (and
of ``hypergrad/linear/``), and no file that is not there."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "hypergrad"


def _hypergrad_block() -> str:
    """The lines of the package tree from ``hypergrad/`` to the blank line that ends its block."""
    tree = (ROOT / "docs" / "architecture.md").read_text().split("```text\n", 1)[1].split("```", 1)[0]
    start = tree.index("hypergrad/")
    end = tree.find("\n\n", start)
    return tree[start:] if end < 0 else tree[start:end]


def test_the_hypergrad_block_matches_the_tree() -> None:
    named = set(re.findall(r"\b\w+\.py\b|\b\w+/", _hypergrad_block())) - {"hypergrad/"}
    top = {p.name for p in PACKAGE.glob("*.py") if p.name != "__init__.py"}
    top |= {p.name + "/" for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    linear = {p.name for p in (PACKAGE / "linear").glob("*.py") if p.name != "__init__.py"}
    assert top - named == set(), f"add to docs/architecture.md: {sorted(top - named)}"
    assert linear - named == set(), f"add to docs/architecture.md (linear/): {sorted(linear - named)}"
    assert named - top - linear == set(), f"not in hypergrad/: {sorted(named - top - linear)}"
