"""docs/architecture.md's package trees name every module of ``hypergrad`` and ``llm_calib``, in the
package that holds it, and no module that does not exist.

The tree is the first ``text`` block of the page. A line whose first word is ``name/`` opens the
package ``name`` for the lines indented deeper (the words after it on its own line belong to it
too); every ``*.py`` word of a line belongs to the innermost package opened at a smaller indent.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "architecture.md"


def named_modules(tree: str) -> set[str]:
    """``package/.../module.py`` (and ``package/`` for a package) of every name in ``tree``."""
    out: set[str] = set()
    open_packages: list[tuple[int, str]] = []  # (indent, path)
    for line in tree.splitlines():
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip(" "))
        while open_packages and open_packages[-1][0] >= indent:
            open_packages.pop()
        parent = open_packages[-1][1] if open_packages else ""
        words = line.split()
        if re.fullmatch(r"\w+/", words[0]):
            path = parent + words[0]
            out.add(path)
            open_packages.append((indent, path))
            parent = path
        out |= {parent if name == "__init__.py" else parent + name
                for name in re.findall(r"(?<![\w/.])(\w+\.py)\b", line)}
    return out


def actual_modules(package: str) -> set[str]:
    """The same spelling of every module and subpackage of ``package``."""
    base = ROOT / package
    out = {package + "/"}
    for path in base.rglob("*.py"):
        if "__pycache__" in path.parts:
            continue
        rel = path.relative_to(ROOT).as_posix()
        if path.name != "__init__.py":
            out.add(rel)
        else:
            out.add(rel.removesuffix("__init__.py"))
    return out


def the_tree() -> str:
    return DOC.read_text(encoding="utf-8").split("```text\n", 1)[1].split("```", 1)[0]


def test_the_trees_name_every_module_of_both_packages() -> None:
    named = named_modules(the_tree())
    for package in ("hypergrad", "llm_calib"):
        actual = actual_modules(package)
        mine = {n for n in named if n.startswith(package + "/")}
        assert actual - mine == set(), f"docs/architecture.md does not name: {sorted(actual - mine)}"
        assert mine - actual == set(), f"docs/architecture.md names what {package}/ does not hold: {sorted(mine - actual)}"


def test_the_parser_reads_nesting_and_continuation_lines() -> None:
    tree = ("pkg/        the package\n  a.py, b.py  two\n  sub/        a subpackage (c.py, d.py;\n"
            "              e.py)\n    f.py\n  g.py        back at the top\n")
    assert named_modules(tree) == {"pkg/", "pkg/a.py", "pkg/b.py", "pkg/sub/", "pkg/sub/c.py", "pkg/sub/d.py",
                                   "pkg/sub/e.py", "pkg/sub/f.py", "pkg/g.py"}


def test_the_pages_examples_run() -> None:
    """The "How to add" examples (a registered objective, loader and scorer) run as written."""
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(encoding="utf-8"), flags=re.DOTALL)
    assert len(blocks) >= 3
    for i, block in enumerate(blocks):
        exec(compile(block, f"docs/architecture.md python block {i}", "exec"), {})
