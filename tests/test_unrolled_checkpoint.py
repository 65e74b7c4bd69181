"""Unrolled(checkpoint=True): the stored-graph reverse estimate from a rebuilt graph per step."""

from __future__ import annotations

import pytest
import torch
from _problems import mlp_classification

import hypergrad as hg

DT = torch.float64


def _mlp_problem(dropout: float = 0.0):
    return mlp_classification(lambda: torch.nn.Sequential(
        torch.nn.Linear(5, 16), torch.nn.Tanh(), torch.nn.Dropout(dropout), torch.nn.Linear(16, 3)
    ))


def _close(a, b, tol):
    return all(torch.allclose(a[k], b[k], rtol=tol, atol=tol) for k in a)


@pytest.mark.parametrize(
    "opt",
    [hg.inner.SGD(lr=0.3), hg.inner.Momentum(lr=0.1, beta=0.8, nesterov=True), hg.inner.Adam(lr=0.02)],
)
@pytest.mark.parametrize("truncate", [None, 3])
def test_checkpoint_equals_stored_graph(opt, truncate) -> None:
    problem, w0, lam, _ = _mlp_problem()
    ref = hg.Unrolled(opt, steps=8, truncate=truncate).hypergrad(problem, w0, lam)
    ck = hg.Unrolled(opt, steps=8, truncate=truncate, checkpoint=True).hypergrad(problem, w0, lam)
    assert _close(ck.grad, ref.grad, 1e-11) and _close(ck.w, ref.w, 1e-13)
    assert ck.info.extra["checkpoint"] is True
    k = truncate or 8
    assert ck.info.grad_evals == 8 + 2 * k + 1
    assert float(ref.grad["log_t"].abs()) > 1e-6


def test_checkpoint_replays_the_randomness_of_each_step() -> None:
    problem, w0, lam, model = _mlp_problem(dropout=0.3)
    model.train()
    torch.manual_seed(5)
    ref = hg.Unrolled(hg.inner.SGD(lr=0.3), steps=6).hypergrad(problem, w0, lam)
    torch.manual_seed(5)
    ck = hg.Unrolled(hg.inner.SGD(lr=0.3), steps=6, checkpoint=True).hypergrad(problem, w0, lam)
    assert _close(ck.grad, ref.grad, 1e-11)


def test_checkpoint_keeps_memory_flat_in_the_graph() -> None:
    """Only the iterates are stored: the live graph buffers peak at one step's, not K steps'."""
    problem, w0, lam, _ = _mlp_problem()
    live = {"now": 0, "peak": 0}

    class Box:
        def __init__(self, t):
            self.t = t
            live["now"] += t.numel()
            live["peak"] = max(live["peak"], live["now"])

        def __del__(self):
            live["now"] -= self.t.numel()

    def peak(**kw):
        live["now"] = live["peak"] = 0
        with torch.autograd.graph.saved_tensors_hooks(Box, lambda b: b.t):
            hg.Unrolled(hg.inner.SGD(lr=0.3), steps=20, **kw).hypergrad(problem, w0, lam)
        return live["peak"]

    assert peak(checkpoint=True) * 8 < peak()


def test_checkpoint_argument_checks() -> None:
    with pytest.raises(TypeError, match="checkpoint"):
        hg.Unrolled(hg.inner.SGD(lr=0.1), steps=3, checkpoint=1)
    with pytest.raises(ValueError, match="checkpoint"):
        hg.Unrolled(hg.inner.SGD(lr=0.1), steps=3, mode="forward", checkpoint=True)
