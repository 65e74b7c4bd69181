"""No import cycles among the modules of ``hypergrad`` and ``llm_calib``, at run time and in the design.

The graph is built statically (``ast``), one node per file: an edge ``a -> b`` for every import
in ``a`` of project module ``b``, wherever it stands (imports inside functions run too, later).
Two graphs are checked: the run-time one leaves out imports under ``if TYPE_CHECKING:`` (never
run); the design one keeps them (a type-only import still makes one file's concepts depend on
another's, so a loop through it is a loop in the design). ``from p import x`` points at the
module ``p.x`` when there is one, else at ``p``; a package ``__init__`` re-exporting its
submodules counts like any other import. A cycle is a strongly connected component of more than
one module; the test lists one closed path through each.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("hypergrad", "llm_calib")


def module_files(root: Path, packages: tuple[str, ...]) -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` file of ``packages`` under ``root``."""
    out = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


def _type_checking_only(tree: ast.Module) -> set[int]:
    """ids of the import nodes under ``if TYPE_CHECKING:`` / ``if typing.TYPE_CHECKING:``."""
    skipped = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
            for child in node.body:
                skipped.update(id(n) for n in ast.walk(child))
    return skipped


def _targets(node: ast.Import | ast.ImportFrom, module: str, is_package: bool, modules: set[str]) -> set[str]:
    """The project modules one import statement of ``module`` loads by name."""
    if isinstance(node, ast.Import):
        return {alias.name for alias in node.names if alias.name in modules}
    if node.level:  # relative: from the module's package, one level up per extra dot
        base = module.split(".") if is_package else module.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        source = ".".join(base + ([node.module] if node.module else []))
    else:
        source = node.module or ""
    out = set()
    for alias in node.names:
        submodule = f"{source}.{alias.name}"
        if submodule in modules:
            out.add(submodule)
        elif source in modules:
            out.add(source)
    return out


def import_graph(root: Path, packages: tuple[str, ...], *, type_only: bool = False) -> dict[str, set[str]]:
    """Module -> the project modules it imports (itself excluded): run-time imports only, or with
    ``type_only`` also those under ``if TYPE_CHECKING:``."""
    files = module_files(root, packages)
    names = set(files)
    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        skipped = set() if type_only else _type_checking_only(tree)
        edges: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import | ast.ImportFrom) and id(node) not in skipped:
                edges |= _targets(node, module, path.name == "__init__.py", names)
        graph[module] = edges - {module}
    return graph


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(sorted(component))
    return components


def a_cycle(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """One closed import path through the first module of ``component`` (shortest, by BFS)."""
    members, start = set(component), component[0]
    previous: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for child in sorted(graph[node] & members):
                if child == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(previous[path[-1]])
                    return [start, *reversed(path[:-1]), start]
                if child not in previous:
                    previous[child] = node
                    following.append(child)
        frontier = following
    raise AssertionError(f"no cycle through {start} in {component}")


def describe(graph: dict[str, set[str]]) -> list[str]:
    """One line per cycle: its modules and a closed path through them."""
    return [f"cycle of {len(c)} ({', '.join(c)}): {' -> '.join(a_cycle(graph, c))}" for c in strongly_connected(graph)]


def test_hypergrad_and_llm_calib_have_no_import_cycles() -> None:
    cycles = describe(import_graph(ROOT, PACKAGES))
    assert not cycles, "import cycles (break them; see this test's docstring for what counts):\n" + "\n".join(cycles)


def test_no_design_cycles_counting_type_only_imports() -> None:
    """The loop, the objectives and the formats share :mod:`llm_calib.training_interface` instead of
    importing each other (type-only imports included)."""
    cycles = describe(import_graph(ROOT, PACKAGES, type_only=True))
    assert not cycles, ("design-level import cycles, type-only imports included (move the shared names to a "
                        "module below both, e.g. llm_calib.training_interface):\n" + "\n".join(cycles))


def test_the_graph_sees_function_level_imports_and_skips_type_checking(tmp_path: Path) -> None:
    """The checker itself: a cycle closed inside a function is found, one through a type-only
    import is not, relative imports and package re-exports resolve."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from pkg import a\n")
    (pkg / "a.py").write_text("from pkg.sub import b\n")
    (pkg / "sub" / "__init__.py").write_text("from .b import thing\n")
    (pkg / "sub" / "b.py").write_text("def thing():\n    from ..c import other\n")
    (pkg / "c.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.a import x\n"
        "def other():\n    import pkg.sub.b\n"
    )
    graph = import_graph(tmp_path, ("pkg",))
    assert graph == {"pkg": {"pkg.a"}, "pkg.a": {"pkg.sub.b"}, "pkg.sub": {"pkg.sub.b"}, "pkg.sub.b": {"pkg.c"},
                     "pkg.c": {"pkg.sub.b"}}
    assert describe(graph) == ["cycle of 2 (pkg.c, pkg.sub.b): pkg.c -> pkg.sub.b -> pkg.c"]
    design = import_graph(tmp_path, ("pkg",), type_only=True)  # the type-only import closes a longer loop
    assert design["pkg.c"] == {"pkg.a", "pkg.sub.b"}
    assert describe(design) == [
        "cycle of 3 (pkg.a, pkg.c, pkg.sub.b): pkg.a -> pkg.sub.b -> pkg.c -> pkg.a"]
    (pkg / "c.py").write_text("from pkg.a import x\n")  # a run-time import closes a longer cycle
    assert describe(import_graph(tmp_path, ("pkg",))) == [
        "cycle of 3 (pkg.a, pkg.c, pkg.sub.b): pkg.a -> pkg.sub.b -> pkg.c -> pkg.a"]
