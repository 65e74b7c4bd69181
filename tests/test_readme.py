"""The README's hypergrad example runs as written and prints the right numbers."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import torch

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_example_runs_and_matches_closed_form():
    code = re.search(r"```python\n(.*?)```", README.read_text(), re.S).group(1)
    namespace: dict = {}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, str(README), "exec"), namespace)
    assert "True" in out.getvalue()
    X, y, Xv, yv, lam = (namespace[k] for k in ("X", "y", "Xv", "yv", "lam"))
    H = X.T @ X + torch.diag(lam["l2"].exp())
    w_star = torch.linalg.solve(H, X.T @ y)
    expected = -w_star * torch.linalg.solve(H, Xv.T @ (Xv @ w_star - yv))
    # 500 SGD steps leave a small inner residual; the estimate is first-order accurate in it.
    assert torch.allclose(namespace["r"].grad["l2"], expected, rtol=1e-3, atol=1e-5)
