"""Unrolled(recompute=True), the default: cheap saved tensors of the stored graph are recomputed.

Same numbers bitwise as recompute=False (the same ops on the same saved inputs), fewer tensors
kept, off where there is nothing to recompute and under the caller's own saved-tensor hooks.
"""

from __future__ import annotations

import pytest
import torch
from _problems import mlp_classification

import hypergrad as hg

DT = torch.float64


def _mlp_problem(act: type[torch.nn.Module] = torch.nn.Tanh, classes: int = 3, hidden: int = 16):
    problem, w0, lam, _ = mlp_classification(lambda: torch.nn.Sequential(
        torch.nn.Linear(5, hidden), act(), torch.nn.Linear(hidden, hidden), act(), torch.nn.Linear(hidden, classes)
    ), classes)
    return problem, w0, lam


@pytest.mark.parametrize("act", [torch.nn.Tanh, torch.nn.Sigmoid, torch.nn.ReLU])
@pytest.mark.parametrize(
    "opt", [hg.inner.SGD(lr=0.3), hg.inner.Momentum(lr=0.1, beta=0.8), hg.inner.Adam(lr=0.02)]
)
@pytest.mark.parametrize("truncate", [None, 3])
def test_recompute_gives_the_stored_graph_numbers_bitwise(act, opt, truncate) -> None:
    problem, w0, lam = _mlp_problem(act)
    K = 7
    on = hg.Unrolled(opt, steps=K, truncate=truncate).hypergrad(problem, w0, lam)
    off = hg.Unrolled(opt, steps=K, truncate=truncate, recompute=False).hypergrad(problem, w0, lam)
    for k in lam:
        assert torch.equal(on.grad[k], off.grad[k]), k
    for k in w0:
        assert torch.equal(on.w[k], off.w[k]), k
    assert float(off.grad["log_t"].abs()) > 1e-6
    assert "recomputed" not in off.info.extra
    n = on.info.extra["recomputed"]
    if act is torch.nn.ReLU:
        # relu's double backward needs neither the incoming gradient nor its own output: nothing
        # recomputable is saved, so the first step turns the hooks off
        assert n == 0, n
    else:
        # per step, saves replaced: the tanh/sigmoid backward of the second hidden layer and its
        # transpose (the first layer's is not saved: X needs no gradient), and twice the 3-class
        # matrix product into the second hidden layer (saved by two ops)
        assert n == 4 * (truncate or K), n


def test_nothing_recomputable_turns_the_hooks_off() -> None:
    """A linear model: the first step replaces nothing; the count stays 0 and numbers agree."""
    gen = torch.Generator().manual_seed(0)
    X, y = torch.randn(50, 6, dtype=DT, generator=gen), torch.randn(50, dtype=DT, generator=gen)

    def g(w, lam, b):
        return 0.5 * ((X @ w["x"] - y) ** 2).mean() + 0.5 * (torch.exp(lam["l"]) * w["x"] ** 2).sum()

    def f(w, lam, b):
        return 0.5 * ((X @ w["x"] - y) ** 2).mean()

    problem, w0, lam = hg.BilevelProblem(g, f), {"x": torch.zeros(6, dtype=DT)}, {"l": torch.zeros(6, dtype=DT)}
    on = hg.Unrolled(hg.inner.SGD(lr=0.5), steps=5).hypergrad(problem, w0, lam)
    off = hg.Unrolled(hg.inner.SGD(lr=0.5), steps=5, recompute=False).hypergrad(problem, w0, lam)
    assert on.info.extra["recomputed"] == 0
    assert torch.equal(on.grad["l"], off.grad["l"])


def _saved_numel(**kw) -> tuple[int, int]:
    """Elements the caller's own saved-tensor hook sees, and Unrolled's recomputed count."""
    problem, w0, lam = _mlp_problem()
    seen = {"n": 0}

    def pack(t):
        seen["n"] += t.numel()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        r = hg.Unrolled(hg.inner.SGD(lr=0.3), steps=6, **kw).hypergrad(problem, w0, lam)
    return seen["n"], r.info.extra.get("recomputed", -1)


def test_the_callers_saved_tensor_hooks_take_precedence() -> None:
    """Under save_on_cpu or a memory probe every saved tensor still reaches the caller's hook."""
    seen_on, n_on = _saved_numel()
    seen_off, _ = _saved_numel(recompute=False)
    assert n_on == 0
    assert seen_on == seen_off > 0


def test_recompute_argument_check() -> None:
    with pytest.raises(TypeError, match="recompute"):
        hg.Unrolled(hg.inner.SGD(lr=0.1), steps=3, recompute=1)
