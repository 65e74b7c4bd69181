"""``pip install llm-calib`` without extras gives a working ``hypergrad`` that needs only torch and
numpy, and an ``llm_calib`` that refuses to import with one line naming the ``llm`` extra.

A fresh venv, no network: torch, numpy and their own dependencies (nothing else: no transformers,
peft, gguf, tqdm, matplotlib) are made visible through a ``.pth`` file pointing at a folder of
symlinks into this interpreter's site-packages; the project is installed from a copy of its
sources with ``pip install --no-deps --no-build-isolation --no-index``. In that venv the README's
"hypergrad in ten lines" example runs as written (and ``hg.solve`` with its progress bar on,
tqdm absent).
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parent.parent
LLM_ONLY = ("transformers", "peft", "gguf", "tqdm", "matplotlib", "safetensors", "pyyaml")
"""Distributions of the ``llm`` extra (safetensors and pyyaml may come with torch; the rest must not)."""

pytestmark = pytest.mark.slow  # a venv, a pip install and one torch import: ~15 s of CPU


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def dependency_closure(roots: tuple[str, ...]) -> list[importlib.metadata.Distribution]:
    """The installed distributions ``roots`` need at run time (their requirements without
    extras, recursively, markers evaluated for this interpreter)."""
    seen: dict[str, importlib.metadata.Distribution] = {}
    todo = list(roots)
    while todo:
        name = _canonical(todo.pop())
        if name in seen:
            continue
        dist = importlib.metadata.distribution(name)
        seen[name] = dist
        for text in dist.requires or []:
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return list(seen.values())


def link_distributions(dists: list[importlib.metadata.Distribution], folder: Path) -> set[str]:
    """Symlink the top-level files and folders of ``dists`` (packages, modules, ``.libs``,
    ``.dist-info``) into ``folder``; return the names linked."""
    folder.mkdir()
    linked: set[str] = set()
    for dist in dists:
        site = Path(dist.locate_file(""))
        for file in dist.files or []:
            top = file.parts[0]
            if top in ("..", "__pycache__") or top in linked or not (site / top).exists():
                continue
            (folder / top).symlink_to(site / top)
            linked.add(top)
    return linked


def readme_example() -> str:
    """The code block under the README's "hypergrad in ten lines" heading."""
    text = (ROOT / "README.md").read_text()
    match = re.search(r"^## hypergrad in ten lines\n.*?```python\n(.*?)```", text, flags=re.S | re.M)
    assert match, "README.md has no ```python block under '## hypergrad in ten lines'"
    return match.group(1)


@pytest.fixture(scope="module")
def bare_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A venv holding the project (no extras) and, through a ``.pth`` file, torch and numpy."""
    base = tmp_path_factory.mktemp("alone")
    closure = dependency_closure(("torch", "numpy"))
    names = {_canonical(d.metadata["Name"]) for d in closure}
    assert {"torch", "numpy"} <= names and not names & {"transformers", "peft", "gguf", "tqdm", "matplotlib"}, names
    deps = base / "deps"
    link_distributions(closure, deps)

    venv = base / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True).stdout.strip()
    (Path(purelib) / "torch_numpy_only.pth").write_text(f"{deps}\n")

    src = base / "src"  # build from a copy: pip writes build/ and *.egg-info next to the sources
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    for package in ("hypergrad", "llm_calib"):
        shutil.copytree(ROOT / package, src / package, ignore=shutil.ignore_patterns("__pycache__"))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "PIP_"))}
    install = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet", "--no-deps",
         "--no-build-isolation", "--no-index", "--no-cache-dir", "--disable-pip-version-check", str(src)],
        capture_output=True, text=True, env=env, cwd=base,
    )
    assert install.returncode == 0, install.stdout + install.stderr
    return venv


def run_in(venv: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """Run in the venv from a folder without the repository's packages (so they are not imported)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    return subprocess.run([*args], capture_output=True, text=True, env=env, cwd=venv.parent, timeout=300)


def test_the_readme_hypergrad_example_runs_with_torch_and_numpy_only(bare_venv: Path) -> None:
    # one process (torch imports once): the README example as written, its output captured, then
    # hg.solve with the progress bar on and no tqdm, then where everything came from
    script = (
        "import contextlib, importlib.util, io, json\n"
        "example = io.StringIO()\n"
        "with contextlib.redirect_stdout(example):\n"
        f"    exec(compile({readme_example()!r}, 'README.md', 'exec'), {{}})\n"
        "import torch, hypergrad as hg\n"
        "g = lambda w, lam, b: 0.5 * ((w['x'] - lam['c']) ** 2).sum()\n"
        "f = lambda w, lam, b: 0.5 * ((w['x'] - 1.0) ** 2).sum()\n"
        "r = hg.solve(hg.BilevelProblem(g, f), {'x': torch.zeros(2)}, {'c': torch.full((2,), 3.0)}, hg.Implicit(),\n"
        "             steps=3, inner_steps=20, progress=True)\n"
        "print(json.dumps({'example': example.getvalue(), 'solve_steps': len(r.history['outer_loss']),\n"
        "                  'hypergrad': hg.__file__,\n"
        f"                  'present': [m for m in {LLM_ONLY[:5]!r} if importlib.util.find_spec(m) is not None]}}))\n"
    )
    run = run_in(bare_venv, str(bare_venv / "bin" / "python"), "-c", script)
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert str(bare_venv) in out["hypergrad"] and out["present"] == []  # the installed copy, no LLM package
    assert out["solve_steps"] == 3
    printed = out["example"].strip()
    # print(r.grad["l2"], r.info.converged): five float64 derivatives, CG converged
    assert printed.startswith("tensor([") and printed.endswith("dtype=torch.float64) True"), printed
    assert len(re.findall(r"-?\d+\.\d+(?:e[-+]\d+)?", printed.split("dtype")[0])) == 5, printed


def test_the_core_requirements_are_torch_and_numpy(bare_venv: Path) -> None:
    out = run_in(bare_venv, str(bare_venv / "bin" / "python"), "-c", (
        "import importlib.metadata as m\n"
        "for r in m.requires('llm-calib'): print(r)\n"
    ))
    assert out.returncode == 0, out.stderr
    core = [r for r in out.stdout.splitlines() if "extra ==" not in r]
    llm = sorted(Requirement(r).name for r in out.stdout.splitlines() if re.search(r"extra == .llm.", r))
    assert sorted(core) == ["numpy", "torch>=2.4"]
    assert llm == sorted(LLM_ONLY)


def test_llm_calib_without_the_extra_fails_with_one_line_naming_it(bare_venv: Path) -> None:
    imported = run_in(bare_venv, str(bare_venv / "bin" / "python"), "-c", "import llm_calib")
    assert imported.returncode == 1
    last = imported.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: llm_calib needs the 'llm' extra: pip install 'llm-calib[llm]' (missing: "), last
    assert "transformers" in last and "peft" in last

    command = run_in(bare_venv, str(bare_venv / "bin" / "llm-calib"), "--help")
    assert command.returncode == 1 and command.stdout == ""
    assert command.stderr.strip().splitlines() == [
        "llm-calib: error: " + last.removeprefix("ImportError: ")], command.stderr
