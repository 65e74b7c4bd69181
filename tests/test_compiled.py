"""The compiled CG path (Implicit(compile=True)): same hypergradients as eager, no recompiles,
eager fallback with a log line."""

from __future__ import annotations

import logging

import pytest
import torch

import hypergrad as hg
from hypergrad.compiled import compiler_available

DT = torch.float64
HAVE_COMPILER, COMPILER = compiler_available()
needs_compiler = pytest.mark.skipif(not HAVE_COMPILER, reason=COMPILER)


def _logistic(seed: int = 0, n: int = 60, d: int = 7):
    """Logistic regression with a bias (two leaves in w) and per-feature L2 hyperparameters."""
    gen = torch.Generator().manual_seed(seed)
    X, Xv = torch.randn(n, d, generator=gen, dtype=DT), torch.randn(n, d, generator=gen, dtype=DT)
    y = (torch.rand(n, generator=gen, dtype=DT) < 0.5).to(DT)
    yv = (torch.rand(n, generator=gen, dtype=DT) < 0.5).to(DT)
    bce = torch.nn.functional.binary_cross_entropy_with_logits

    def g(w, lam, batch):
        z = X @ w["weight"] + w["bias"]
        return bce(z, y) + 0.5 * (torch.exp(lam["log_l2"]) * w["weight"] ** 2).sum()

    def f(w, lam, batch):
        return bce(Xv @ w["weight"] + w["bias"], yv)

    w = {"weight": 0.3 * torch.randn(d, generator=gen, dtype=DT), "bias": torch.zeros(1, dtype=DT)}
    lam = {"log_l2": torch.randn(d, generator=gen, dtype=DT) - 2.0}
    return hg.BilevelProblem(g, f), w, lam


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(b))


@needs_compiler
def test_compiled_equals_eager_and_second_call_does_not_recompile():
    from torch._dynamo.utils import counters

    problem, w, lam = _logistic()
    solver = hg.linear.CG(tol=1e-12, maxiter=200)
    eager, compiled = hg.Implicit(solver), hg.Implicit(solver, compile=True)
    rc = compiled.hypergrad(problem, w, lam)
    re_ = eager.hypergrad(problem, w, lam)
    assert rc.info.extra["compiled"] is True and re_.info.extra["compiled"] is False
    assert rc.info.iterations == re_.info.iterations > 3
    assert rc.info.converged and not rc.info.warnings
    assert _rel(rc.grad["log_l2"], re_.grad["log_l2"]) < 1e-10
    graphs = counters["stats"]["unique_graphs"]
    assert graphs >= 1
    # new values of w and lam (same shapes): the compiled graph is reused
    w2 = {k: 1.5 * v + 0.1 for k, v in w.items()}
    lam2 = {"log_l2": lam["log_l2"] + 0.7}
    rc2 = compiled.hypergrad(problem, w2, lam2)
    assert counters["stats"]["unique_graphs"] == graphs
    assert rc2.info.extra["compiled"] is True
    re2 = eager.hypergrad(problem, w2, lam2)
    assert _rel(rc2.grad["log_l2"], re2.grad["log_l2"]) < 1e-10
    assert _rel(rc2.grad["log_l2"], rc.grad["log_l2"]) > 1e-3  # it did use the new values

    # a cap inside a chunk, damping, a warm start: still the eager iteration, step for step
    for cg in (hg.linear.CG(tol=1e-12, maxiter=3), hg.linear.CG(tol=1e-9, damping=0.3)):
        a = hg.Implicit(cg, compile=True).hypergrad(problem, w, lam)
        b = hg.Implicit(cg).hypergrad(problem, w, lam)
        assert (a.info.iterations, a.info.converged) == (b.info.iterations, b.info.converged)
        assert _rel(a.grad["log_l2"], b.grad["log_l2"]) < 1e-10
    a = hg.Implicit(hg.linear.CG(tol=1e-12, maxiter=3), compile=True).hypergrad(problem, w, lam)
    assert a.info.iterations == 3 and not a.info.converged and a.info.warnings
    ws = hg.Implicit(solver, warm_start=True)
    first = ws.hypergrad(problem, w, lam)
    a = hg.Implicit(solver, warm_start=True, compile=True).hypergrad(problem, w2, lam2, state=first.state)
    b = ws.hypergrad(problem, w2, lam2, state=first.state)
    assert a.info.iterations == b.info.iterations and _rel(a.grad["log_l2"], b.grad["log_l2"]) < 1e-10
    assert counters["stats"]["unique_graphs"] == graphs  # maxiter, damping, x0 are values, not guards


def test_fallback_to_eager_with_a_log_line(caplog):
    """An inner loss with data-dependent Python control flow cannot be traced into one graph."""
    problem, w, lam = _logistic(seed=1)

    def g(w_, lam_, batch):
        value = problem.inner(w_, lam_, batch)
        if float(w_["bias"].detach().sum()) > 1e6:  # a graph break under fullgraph=True
            value = value * 2
        return value

    broken = hg.BilevelProblem(g, problem.outer)
    solver = hg.linear.CG(tol=1e-12)
    with caplog.at_level(logging.WARNING, logger="hypergrad"):
        rc = hg.Implicit(solver, compile=True).hypergrad(broken, w, lam)
    assert rc.info.extra["compiled"] is False
    assert any("falling back to the eager solver" in m for m in caplog.messages)
    re_ = hg.Implicit(solver).hypergrad(broken, w, lam)
    assert _rel(rc.grad["log_l2"], re_.grad["log_l2"]) < 1e-12
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="hypergrad"):  # remembered: not retried
        assert hg.Implicit(solver, compile=True).hypergrad(broken, w, lam).info.extra["compiled"] is False
    assert not caplog.messages


def test_compile_needs_cg_and_the_gradient_form():
    with pytest.raises(ValueError, match="compile=True needs solver"):
        hg.Implicit(hg.linear.Dense(), compile=True)
    with pytest.raises(ValueError, match="compile=True needs solver"):
        hg.Implicit(hg.linear.NormalCG(), fixed_point=lambda w, lam, b: w, compile=True)
    with pytest.raises(TypeError, match="compile must be a bool"):
        hg.Implicit(compile="yes")
