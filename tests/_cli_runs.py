"""The small CLI runs the trust tests share: the tiny built-in data specs, the flags that keep a run
short, and the environment of a child process that imports this checkout."""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TRAIN = "builtin:arithmetic,capitals:n=4"
HELDOUT = "builtin:arithmetic,capitals:n=4,seed=1"
EVAL = "builtin:capitals:n=6,seed=2"
RUN_FLAGS = ["--batch-size", "4", "--lora-rank", "2", "--lora-layers", "1", "--bootstrap", "0", "--quiet",
             "--checkpoint-every", "2", "--eval-every", "2"]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
