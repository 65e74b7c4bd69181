"""Forward-mode Unrolled uses no forward-mode AD, so it never reaches torch's deprecated
``torch.jit.script`` (PyTorch's first dual tensor or ``torch.func.jvp`` in a process scripts its
jvp decompositions with it: 18 DeprecationWarnings). Checked in a fresh interpreter, where that
first use would happen."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

SCRIPT = """
import sys, warnings
import torch
import hypergrad as hg

warnings.simplefilter("error")  # any warning, the torch.jit.script deprecation included, fails
X = torch.randn(16, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
y = torch.arange(16) % 3
def g(w, lam, b):
    logits = torch.tanh(X @ w["a"]) @ w["b"]
    return torch.nn.functional.cross_entropy(logits, y) + (lam["c"].exp() * w["a"] ** 2).sum() / 100
f = lambda w, lam, b: torch.nn.functional.cross_entropy(torch.tanh(X @ w["a"]) @ w["b"], (y + 1) % 3)
w = {"a": torch.full((4, 5), 0.1, dtype=torch.float64), "b": torch.full((5, 3), -0.1, dtype=torch.float64)}
problem = hg.BilevelProblem(g, f)
for shape in ((), (4, 5)):
    lam = {"c": torch.zeros(shape, dtype=torch.float64)}
    for vectorize in (True, False):
        for opt in (hg.inner.SGD(lr=0.2), hg.inner.Adam(lr=0.01)):
            method = hg.Unrolled(opt, steps=3, mode="forward", vectorize=vectorize)
            forward = method.hypergrad(problem, w, lam)
            reverse = hg.Unrolled(opt, steps=3).hypergrad(problem, w, lam)
            torch.testing.assert_close(forward.grad["c"], reverse.grad["c"], rtol=1e-10, atol=1e-14)
assert "torch._decomp.decompositions_for_jvp" not in sys.modules, "forward-mode AD was used"
print("ok")
"""


def test_forward_mode_runs_without_forward_ad_and_without_warnings() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]
