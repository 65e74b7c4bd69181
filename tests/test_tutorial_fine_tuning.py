"""The tutorial "Add CALM to your fine-tuning script": each CALM script differs from its ordinary SFT
script by the diff the page shows, of at most 10 changed lines (the scripts themselves run in
``tests/test_docs_tutorials.py``, on the tiny model)."""

from __future__ import annotations

import difflib
from pathlib import Path

import pytest
from test_docs_tutorials import blocks

PAGE = Path(__file__).resolve().parents[1] / "docs" / "tutorials" / "fine_tuning_scripts.md"
PAIRS = [("sft.py", "sft_calm.py"), ("trl_sft.py", "trl_sft_calm.py")]
MAX_CHANGED_LINES = 10


def _scripts() -> dict[str, list[str]]:
    out = {}
    for block in blocks(PAGE):
        first = block.code.splitlines()[0] if block.code.strip() else ""
        if block.language == "python" and first.startswith("# ") and first.endswith(".py"):
            out[first[2:]] = block.code.splitlines()[1:]
    return out


def _shown_diffs() -> dict[tuple[str, str], list[str]]:
    out = {}
    for block in blocks(PAGE):
        lines = block.code.splitlines()
        if block.language == "diff":
            out[(lines[0].removeprefix("--- "), lines[1].removeprefix("+++ "))] = lines
    return out


@pytest.mark.parametrize(("plain", "calm"), PAIRS)
def test_the_shown_diff_is_the_scripts_diff_and_small(plain: str, calm: str) -> None:
    scripts = _scripts()
    actual = list(difflib.unified_diff(scripts[plain], scripts[calm], plain, calm, lineterm=""))
    assert _shown_diffs()[(plain, calm)] == actual, "\n".join(actual)
    changed = [line for line in actual[2:] if line[:1] in "+-"]
    assert 0 < len(changed) <= MAX_CHANGED_LINES, changed
