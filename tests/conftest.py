"""Shared fixtures: a tiny randomly initialised Llama model with a tokenizer built in code."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch

from llm_calib.data.records import MultipleChoice
from llm_calib.models import tiny_random_model

# The suite runs under pytest-xdist with one worker per core; tiny models gain nothing from
# intra-op threads, and oversubscribed OpenMP threads make them 10-20x slower.
torch.set_num_threads(1)

# torch.compile's on-disk cache (default /tmp/torchinductor_<user>) does not key on the CPU-capability
# environment (ATEN_CPU_CAPABILITY): after a run under the AVX2 code paths, a native run on the same
# machine loaded the cached kernels and tests/test_compiled.py got wrong numbers (7 failures; all
# passed with an empty cache). The suite keeps one cache per capability, unless the caller chose a
# directory; a warm cache saves about 200 CPU s of compiling on a rerun (test_compiled.py and the
# compiled doctests: 256 s cold, 51 s warm), and a fresh machine starts empty either way.
if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(
        Path(tempfile.gettempdir()) / f"llm-calib-inductor-{os.getuid()}-{torch.backends.cpu.get_cpu_capability()}"
    )


@pytest.fixture(scope="session")
def tiny() -> tuple[Any, Any]:
    """(model, tokenizer): 2 layers, hidden 32, ~350-token byte-level BPE, chat template."""
    return tiny_random_model(seed=0, init_std=0.1)


@pytest.fixture(scope="session")
def tiny_model(tiny: tuple[Any, Any]) -> Any:
    return tiny[0]


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny: tuple[Any, Any]) -> Any:
    return tiny[1]


@pytest.fixture(scope="session")
def tiny_plain_tokenizer() -> Any:
    """The same tokenizer without a chat template."""
    return tiny_random_model(seed=0, init_std=0.1, chat_template=False)[1]


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory, tiny: tuple[Any, Any]) -> Path:
    """The tiny model and tokenizer saved with ``save_pretrained``."""
    path = tmp_path_factory.mktemp("tiny_model")
    model, tokenizer = tiny
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def mc_records() -> list[MultipleChoice]:
    """Nine questions with 2 to 5 options of different token lengths, in two domains."""
    out = []
    for i in range(9):
        k = 2 + i % 4
        options = tuple(f"option {j}" + " and more" * ((i + j) % 3) for j in range(k))
        out.append(
            MultipleChoice(
                f"Question {i}: which of these is right? " + "Think. " * (i % 3),
                options,
                i % k,
                "even" if i % 2 == 0 else "odd",
                f"q{i}",
            )
        )
    return out


# Modules whose tests take tens of seconds each (real model, torch.compile, torchrun launches, CLI
# subprocesses, docs pages), longest first. They run before the rest, and `make test` passes
# --maxschedchunk 2 so that each xdist worker takes two tests at a time: the longest tests start
# first on whichever worker is free and the short ones fill the end (longest-first greedy). Without
# it xdist hands each worker a contiguous quarter of the list up front, which gave one worker every
# slow test (pytest 700 s against 549 s in file order).
SLOW_FIRST = (
    "test_docs_tutorials.py", "test_real_model.py", "test_compiled.py", "test_fsdp.py",
    "test_benchmark_quick.py", "test_calibration_bench.py", "test_calm_distributed.py", "test_hypergrad_distributed.py",
    "test_calm_verify.py", "test_calm_trainer.py", "test_bome.py", "test_lm_eval_task.py", "test_lm_eval_parity.py",
    "test_calm_calibrates.py", "test_install_hypergrad_alone.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(SLOW_FIRST)}
    # a stable sort keeps each module's tests together and in their own order
    items.sort(key=lambda item: rank.get(item.path.name, len(SLOW_FIRST)))
