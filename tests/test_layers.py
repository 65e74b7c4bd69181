"""``llm_calib``'s modules stand in named layers, and no module imports one from a higher layer.

Bottom to top (a module may import its own layer and the layers below it):

==========================  ==========================================================================
layer                       modules
==========================  ==========================================================================
foundation                  ``version``, the root's private helpers, ``registry`` (with the objectives' name tables,
                            ``objectives.registry``), ``files``, ``metrics``, ``distributed``
data                        ``data``: records and their loaders
configuration               ``config``: the settings of a run and their allowed values
prompts                     ``prompts``: prompt templates and prompt resolution
model                       ``models`` (loading) and ``engine`` (running the model over questions)
scoring                     ``scoring``: multiple-choice scorers and the result sets
confidence                  ``confidence``: open answers and their confidence
training vocabulary         ``training_interface``, ``adjustment``: what the loop, the objectives
                            and the formats share
formats and objectives      ``formats``, ``objectives`` (they do not import each other)
training loop               ``calm``: run resolution, encoding, LoRA, losses, the loop, the trainer
applications                ``evaluation`` (evaluate, compare, report, lm-eval logs, the demo) and
                            ``integrations`` (CALM inside Hugging Face's Trainer and TRL)
command line                ``cli``
public surface              ``llm_calib`` (the package's lazy re-exports)
==========================  ==========================================================================

Every import counts: module level, inside functions and under ``if TYPE_CHECKING:`` (a type-only
import still makes a lower concept depend on a higher one). The graph is the one of
``tests/test_import_cycles.py``.
"""

from __future__ import annotations

from pathlib import Path

from test_import_cycles import import_graph, module_files

ROOT = Path(__file__).resolve().parent.parent

LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("foundation", ("llm_calib.version", "llm_calib.registry", "llm_calib.objectives.registry",
                    "llm_calib.files", "llm_calib.metrics", "llm_calib.distributed")),
    ("data", ("llm_calib.data",)),
    ("configuration", ("llm_calib.config",)),
    ("prompts", ("llm_calib.prompts",)),
    ("model", ("llm_calib.models", "llm_calib.engine")),
    ("scoring", ("llm_calib.scoring",)),
    ("confidence", ("llm_calib.confidence",)),
    ("training vocabulary", ("llm_calib.training_interface", "llm_calib.adjustment")),
    ("formats and objectives", ("llm_calib.formats", "llm_calib.objectives")),
    ("training loop", ("llm_calib.calm",)),
    ("applications", ("llm_calib.evaluation", "llm_calib.integrations")),
    ("command line", ("llm_calib.cli",)),
    ("public surface", ("llm_calib",)),
)

SIBLINGS = (("llm_calib.formats", "llm_calib.objectives"),)
"""Packages of one layer that must not import each other either."""


def _in(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def layer_of(module: str) -> int:
    """The index in :data:`LAYERS` of the most specific prefix that holds ``module``; a private module of
    the package root (a helper of the package files, such as the lazy re-exports) is foundation."""
    package, _, name = module.rpartition(".")
    if package == "llm_calib" and name.startswith("_"):
        return 0
    matches = [(len(p), i) for i, (_, prefixes) in enumerate(LAYERS) for p in prefixes if _in(module, p)]
    assert matches, f"{module} is in no layer: add it to LAYERS (and docs/architecture.md)"
    return max(matches)[1]


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """``a -> b (layer A < layer B)`` for each import of a module ``b`` from a higher layer than ``a``'s."""
    out = []
    for a, targets in sorted(graph.items()):
        for b in sorted(targets):
            if layer_of(b) > layer_of(a):
                out.append(f"{a} ({LAYERS[layer_of(a)][0]}) -> {b} ({LAYERS[layer_of(b)][0]})")
    return out


def test_every_module_has_a_layer() -> None:
    for module in module_files(ROOT, ("llm_calib",)):
        layer_of(module)


def test_no_import_runs_from_a_lower_layer_to_a_higher_one() -> None:
    graph = import_graph(ROOT, ("llm_calib",), type_only=True)
    bad = upward_imports(graph)
    assert not bad, "imports from a lower layer to a higher one:\n" + "\n".join(bad)


def test_formats_and_objectives_do_not_import_each_other() -> None:
    graph = import_graph(ROOT, ("llm_calib",), type_only=True)
    for left, right in SIBLINGS:
        for a, b in ((left, right), (right, left)):
            crossing = sorted(f"{m} -> {t}" for m, ts in graph.items() if _in(m, a)
                              for t in ts if _in(t, b) and layer_of(t) == layer_of(m))
            assert not crossing, f"{a} and {b} share a layer and must not import each other:\n" + "\n".join(crossing)


def test_the_checker_finds_an_upward_import(tmp_path: Path) -> None:
    """The checker itself: a data module importing the training loop is reported, the reverse is not."""
    graph = {"llm_calib.data.jsonl": {"llm_calib.calm.training"}, "llm_calib.calm.training": {"llm_calib.data.jsonl"}}
    assert upward_imports(graph) == ["llm_calib.data.jsonl (data) -> llm_calib.calm.training (training loop)"]
    assert layer_of("llm_calib.objectives.registry") == 0 and layer_of("llm_calib.objectives.calm") == 8
