"""The code in the documentation runs as written.

Every page under ``docs/`` is read in order; its fenced blocks are:

* ```` ```python ````: executed, all blocks of a page in one namespace, in a fresh directory;
* ```` ```bash ````: executed with ``bash -e`` in that same directory, with the virtual
  environment's ``bin/`` (``llm-calib``, ``torchrun``) first on ``PATH``; every ``llm-calib`` and
  ``torchrun`` command in it is also parsed with the real argument parsers;
* ```` ```{code-block} python ```` / ```` ```{code-block} bash ```` with ``:class: no-run``
  (examples that need the real model, a GPU or undefined placeholders): Python is compiled,
  shell commands are parsed with the real argument parsers, nothing is executed.

Other blocks (``text``, ``console``, ``yaml``, ...) are ignored.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from llm_calib.objectives.registry import (
    objective_names,
    solver_names,
    unregister_objective,
    unregister_solver,
)

DOCS = Path(__file__).resolve().parent.parent / "docs"
PAGES = sorted(p for p in DOCS.rglob("*.md") if "_build" not in p.parts)

NEEDS = {"tutorials/lm_eval.md": "lm_eval", "tutorials/fine_tuning_scripts.md": "trl"}
"""Pages whose runnable code needs an optional extra's module (``pip install 'llm-calib[lm-eval]'``,
``'llm-calib[trl]'``, which the README's test command installs): skipped, with the reason, where it is not installed."""

_FENCE = re.compile(r"^(`{3,})\s*(\{code-block\}\s*)?([\w-]*)\s*$")


@dataclass
class Block:
    language: str
    code: str
    run: bool
    line: int


def blocks(path: Path) -> list[Block]:
    """The fenced code blocks of a MyST page (nested fences are not used in these pages)."""
    lines = path.read_text().splitlines()
    out: list[Block] = []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, directive, language = m.group(1), m.group(2), m.group(3)
        start = i + 1
        j = start
        while j < len(lines) and lines[j].strip() != fence:
            j += 1
        body = lines[start:j]
        run = True
        if directive:
            options = []
            while body and body[0].startswith(":"):
                options.append(body.pop(0))
            run = not any(o.split(":", 2)[1] == "class" and "no-run" in o for o in options)
        out.append(Block(language, "\n".join(body).strip("\n") + "\n", run, start))
        i = j + 1
    return out


def _commands(script: str) -> list[list[str]]:
    """Shell commands of a block (continuation lines joined, comments dropped) as argv lists."""
    joined = re.sub(r"\\\n", " ", script)
    cmds = []
    for line in joined.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            cmds.append(shlex.split(line, comments=True))
    return cmds


def check_command(argv: list[str]) -> None:
    """Parse ``llm-calib ...`` and ``torchrun ... -m llm_calib.cli ...`` with the real parsers."""
    from llm_calib.cli import build_parser

    if not argv:
        return
    if argv[0] == "llm-calib":
        build_parser().parse_args(argv[1:])
    elif argv[0] == "torchrun":
        from torch.distributed.run import get_args_parser

        args = get_args_parser().parse_args(argv[1:])
        assert args.module, "the tutorial runs llm_calib.cli as a module (-m)"
        assert args.training_script == "llm_calib.cli", args.training_script
        build_parser().parse_args(args.training_script_args)


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(DOCS)) for p in PAGES])
def test_page_code_runs(page: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    found = [b for b in blocks(page) if b.language in ("python", "bash")]
    if not found:
        pytest.skip("no python or bash blocks")
    module = NEEDS.get(str(page.relative_to(DOCS)))
    if module is not None and importlib.util.find_spec(module) is None:
        pytest.skip(f"the page runs {module}, which is not installed")
    monkeypatch.chdir(tmp_path)
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.setdefault("OMP_NUM_THREADS", "1")
    env["HF_HUB_OFFLINE"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(DOCS.parent), env.get("PYTHONPATH", "")])
    namespace: dict[str, object] = {"__name__": "__docs__"}
    # a page's Python runs in this worker: objectives and solvers it registers are removed after it,
    # so that later tests in the worker see only the built-in ones (calm.md registers "focal")
    objectives, solvers = set(objective_names()), set(solver_names())
    try:
        _run_blocks(page, found, tmp_path, env, namespace)
    finally:
        for name in set(objective_names()) - objectives:
            unregister_objective(name)
        for name in set(solver_names()) - solvers:
            unregister_solver(name)


def _run_blocks(page: Path, found: list[Block], tmp_path: Path, env: dict[str, str],
                namespace: dict[str, object]) -> None:
    for block in found:
        where = f"{page.relative_to(DOCS)}:{block.line}"
        if block.language == "python":
            code = compile(block.code, where, "exec", dont_inherit=True)  # not this file's __future__ flags
            if block.run:
                exec(code, namespace)
            continue
        for argv in _commands(block.code):
            check_command(argv)
        if block.run:
            proc = subprocess.run(
                ["bash", "-e", "-c", block.code], cwd=tmp_path, env=env, capture_output=True,
                text=True, timeout=600,
            )
            assert proc.returncode == 0, (
                f"{where}: exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
            )


def test_fence_parser_reads_options(tmp_path: Path) -> None:
    text = "```python\nx = 1\n```\n\n```{code-block} bash\n:class: no-run\n\nllm-calib demo\n```\n"
    path = tmp_path / "page.md"
    path.write_text(text)
    got = blocks(path)
    assert [(b.language, b.run, b.code) for b in got] == [
        ("python", True, "x = 1\n"),
        ("bash", False, "llm-calib demo\n"),
    ]
