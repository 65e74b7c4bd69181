"""Sphinx configuration of the llm-calib documentation (``make docs``).

Build: ``.venv/bin/sphinx-build -W --keep-going -b html docs docs/_build/html`` (what ``make docs``
and ``make test`` run). Warnings are errors, so a broken cross-reference, a bad docstring or a
missing include fails the build.

Offline by default. The build machines and CI have no internet, and intersphinx's "failed to
reach" message is a warning that ``-W`` turns into an error, so ``intersphinx_mapping`` (PyTorch,
transformers, peft, Python, NumPy) is only set when ``LLM_CALIB_DOCS_ONLINE=1``; offline,
references to those projects render as plain (unlinked) names and nothing is fetched.

MathJax is loaded by the browser from its CDN when a page with math is opened (nothing is fetched
at build time). To view the pages on a machine without internet, point
``LLM_CALIB_DOCS_MATHJAX`` at a local MathJax 2 ``MathJax.js`` (Debian: ``apt-get install
libjs-mathjax``, then ``/usr/share/javascript/mathjax/MathJax.js``) before building.
"""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

project = "llm-calib"
author = "llm-calib developers"
copyright = "2025, llm-calib developers"
release = version = importlib.import_module("hypergrad").__version__

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
    "sphinx.ext.mathjax",
    "sphinx.ext.intersphinx",
    "myst_parser",
]

source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "Thumbs.db", ".DS_Store"]
templates_path: list[str] = []

# -- MyST --------------------------------------------------------------------------------------
myst_enable_extensions = ["dollarmath", "amsmath", "colon_fence", "deflist"]
myst_heading_anchors = 3
myst_dmath_double_inline = True

# -- autodoc / napoleon ------------------------------------------------------------------------
# Every public symbol is documented once, at the module that defines it (``automodule`` with
# ``:members:`` follows each module's ``__all__``); the package pages list their re-exports in
# autosummary tables pointing there, and ``_resolve_reexport`` below makes references to the
# re-exported names (``hypergrad.Implicit``) link to the canonical entry.
autodoc_default_options = {"members": True, "member-order": "bysource"}
autodoc_typehints = "description"
autodoc_typehints_description_target = "all"
autodoc_typehints_format = "short"
autodoc_preserve_defaults = True
autodoc_class_signature = "mixed"
autodoc_inherit_docstrings = False
autosummary_generate = False
autosummary_imported_members = False
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_ivar = True  # "Attributes:" as fields, not objects: no duplicates with dataclass fields
napoleon_use_rtype = False
napoleon_attr_annotations = True
add_module_names = False
python_use_unqualified_type_names = True

# -- intersphinx (online only, see the module docstring) ---------------------------------------
intersphinx_mapping: dict[str, tuple[str, Any]] = {}
if os.environ.get("LLM_CALIB_DOCS_ONLINE") == "1":
    intersphinx_mapping = {
        "python": ("https://docs.python.org/3", None),
        "torch": ("https://pytorch.org/docs/stable", None),
        "transformers": ("https://huggingface.co/docs/transformers/main/en", None),
        "peft": ("https://huggingface.co/docs/peft/main/en", None),
        "numpy": ("https://numpy.org/doc/stable", None),
    }
intersphinx_timeout = 10

# -- math ----------------------------------------------------------------------------------------
_local_mathjax = os.environ.get("LLM_CALIB_DOCS_MATHJAX")
if _local_mathjax:
    mathjax_path = Path(_local_mathjax).resolve().as_uri() + "?config=TeX-AMS-MML_HTMLorMML"
    mathjax2_config = {
        "tex2jax": {
            "inlineMath": [["\\(", "\\)"]],
            "displayMath": [["\\[", "\\]"]],
            "processRefs": False,
            "processEnvironments": False,
        }
    }
    myst_update_mathjax = False  # MyST's MathJax 3+ settings would replace MathJax 2's config

# -- HTML ----------------------------------------------------------------------------------------
html_theme = "furo"
html_title = "llm-calib"
html_static_path: list[str] = []
html_show_sourcelink = False


def _resolve_reexport(app: Any, env: Any, node: Any, contnode: Any) -> Any:
    """Resolve ``hypergrad.Implicit`` (a re-export) to ``hypergrad.implicit.Implicit``.

    Also resolves a short name used inside a module's docstring (``:class:`LoadResult``` in
    ``llm_calib.data``) to where the object is defined.
    """
    if node.get("refdomain") != "py":
        return None
    target = node.get("reftarget", "")
    module = node.get("py:module") or ""
    candidates = [target] + ([f"{module}.{target}"] if module else [])
    for candidate in candidates:
        canonical = _canonical_name(candidate)
        if canonical and canonical != target:
            domain = env.domains["py"]
            new = node.deepcopy()
            new["reftarget"] = canonical
            found = domain.resolve_xref(
                env, node["refdoc"], app.builder, node["reftype"], canonical, new, contnode
            )
            if found is not None:
                return found
    return None


def _canonical_name(dotted: str) -> str | None:
    """``module.qualname`` of the object at ``dotted`` (a package attribute), or None."""
    parts = dotted.split(".")
    if len(parts) < 2 or parts[0] not in ("hypergrad", "llm_calib"):
        return None
    for split in range(len(parts) - 1, 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        try:
            for attr in parts[split:]:
                obj = getattr(obj, attr)
        except AttributeError:
            return None
        module = getattr(obj, "__module__", None)
        qualname = getattr(obj, "__qualname__", None)
        if module and qualname and isinstance(module, str):
            return f"{module}.{qualname}"
        return None
    return None


def setup(app: Any) -> None:
    app.connect("missing-reference", _resolve_reexport)
