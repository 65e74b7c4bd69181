"""Compiled products (Implicit(compile=True), hypergrad.compiled): the eager hypergradients to
1e-10 in float64, no recompiles on new values, closure and batch tensors read afresh, an eager
fallback with a log line."""

from __future__ import annotations

import logging

import pytest
import torch

import hypergrad as hg
from hypergrad.compiled import compiled_stage, compiler_available
from hypergrad.linear.cg import conjugate_gradient, fused_conjugate_gradient

DT = torch.float64
HAVE_COMPILER, COMPILER = compiler_available()
needs_compiler = pytest.mark.skipif(not HAVE_COMPILER, reason=COMPILER)
bce = torch.nn.functional.binary_cross_entropy_with_logits


def _logistic(seed: int = 0, n: int = 60, d: int = 7):
    """Logistic regression with a bias (two leaves in w) and per-feature L2 hyperparameters."""
    gen = torch.Generator().manual_seed(seed)
    X, Xv = torch.randn(n, d, generator=gen, dtype=DT), torch.randn(n, d, generator=gen, dtype=DT)
    y = (torch.rand(n, generator=gen, dtype=DT) < 0.5).to(DT)
    yv = (torch.rand(n, generator=gen, dtype=DT) < 0.5).to(DT)

    def g(w, lam, batch):
        z = X @ w["weight"] + w["bias"]
        return bce(z, y) + 0.5 * (torch.exp(lam["log_l2"]) * w["weight"] ** 2).sum()

    def f(w, lam, batch):
        return bce(Xv @ w["weight"] + w["bias"], yv) + 0.01 * lam["log_l2"].square().sum()

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
    assert rc.info.extra["compile_s"] > 0.0
    assert rc.info.iterations == re_.info.iterations > 3
    assert rc.info.converged and not rc.info.warnings
    assert _rel(rc.grad["log_l2"], re_.grad["log_l2"]) < 1e-10
    assert rc.info.extra["inner_residual"] == pytest.approx(re_.info.extra["inner_residual"], rel=1e-10)
    graphs = counters["stats"]["unique_graphs"]
    assert graphs >= 1
    # new values of w and lam (same shapes): the compiled stage is reused, with the new values
    w2 = {k: 1.5 * v + 0.1 for k, v in w.items()}
    lam2 = {"log_l2": lam["log_l2"] + 0.7}
    rc2 = compiled.hypergrad(problem, w2, lam2)
    assert counters["stats"]["unique_graphs"] == graphs
    assert rc2.info.extra["compiled"] is True and rc2.info.extra["compile_s"] == 0.0
    re2 = eager.hypergrad(problem, w2, lam2)
    assert _rel(rc2.grad["log_l2"], re2.grad["log_l2"]) < 1e-10
    assert _rel(rc2.grad["log_l2"], rc.grad["log_l2"]) > 1e-3  # it did use the new values

    # a cap, damping, a warm start, other solvers: still the eager iteration, step for step
    solvers = (hg.linear.CG(tol=1e-12, maxiter=3), hg.linear.CG(tol=1e-9, damping=0.3),
               hg.linear.CG(tol=1e-11, preconditioner="jacobi"), hg.linear.Dense(),
               hg.linear.Neumann(alpha=0.5, steps=30, tol=0.0))
    for lin in solvers:
        a = hg.Implicit(lin, compile=True).hypergrad(problem, w, lam)
        b = hg.Implicit(lin).hypergrad(problem, w, lam)
        assert a.info.extra["compiled"] is True
        assert (a.info.iterations, a.info.converged, a.info.extra["matvecs"]) == (
            b.info.iterations, b.info.converged, b.info.extra["matvecs"]), lin
        assert _rel(a.grad["log_l2"], b.grad["log_l2"]) < 1e-10, lin
    a = hg.Implicit(hg.linear.CG(tol=1e-12, maxiter=3), compile=True).hypergrad(problem, w, lam)
    assert a.info.iterations == 3 and not a.info.converged and a.info.warnings
    ws = hg.Implicit(solver, warm_start=True)
    first = ws.hypergrad(problem, w, lam)
    a = hg.Implicit(solver, warm_start=True, compile=True).hypergrad(problem, w2, lam2, state=first.state)
    b = ws.hypergrad(problem, w2, lam2, state=first.state)
    assert a.info.iterations == b.info.iterations and _rel(a.grad["log_l2"], b.grad["log_l2"]) < 1e-10
    assert counters["stats"]["unique_graphs"] == graphs  # solvers and warm starts are not guards


@needs_compiler
def test_closure_and_batch_tensors_are_read_on_every_call():
    """Tensors the losses read from a closure, and the batch tensors, are graph inputs: rebinding
    them to new data changes the compiled result exactly as it changes the eager one."""
    gen = torch.Generator().manual_seed(3)
    data = {"X": torch.randn(40, 5, generator=gen, dtype=DT), "y": torch.randn(40, generator=gen, dtype=DT)}

    def g(w, lam, batch):
        r = data["X"] @ w["x"] - data["y"]
        return 0.5 * (r @ r) / 40 + 0.5 * (torch.exp(lam["c"]) * w["x"] ** 2).sum()

    def f(w, lam, batch):
        r = batch["Xv"] @ w["x"] - batch["yv"]
        return 0.5 * (r @ r)

    problem = hg.BilevelProblem(g, f)
    w = {"x": torch.randn(5, generator=gen, dtype=DT)}
    lam = {"c": torch.zeros(5, dtype=DT)}
    batch = {"Xv": torch.randn(30, 5, generator=gen, dtype=DT), "yv": torch.randn(30, generator=gen, dtype=DT)}
    solver = hg.linear.CG(tol=1e-12)
    compiled, eager = hg.Implicit(solver, compile=True), hg.Implicit(solver)
    first = compiled.hypergrad(problem, w, lam, outer_batch=batch)
    assert first.info.extra["compiled"]
    assert _rel(first.grad["c"], eager.hypergrad(problem, w, lam, outer_batch=batch).grad["c"]) < 1e-10
    data["X"] = torch.randn(40, 5, generator=gen, dtype=DT)  # rebind the closure's data
    batch2 = {"Xv": torch.randn(30, 5, generator=gen, dtype=DT), "yv": torch.randn(30, generator=gen, dtype=DT)}
    second = compiled.hypergrad(problem, w, lam, outer_batch=batch2)
    expected = eager.hypergrad(problem, w, lam, outer_batch=batch2)
    assert second.info.extra["compiled"] and second.info.extra["compile_s"] == 0.0
    assert _rel(second.grad["c"], expected.grad["c"]) < 1e-10
    assert _rel(second.grad["c"], first.grad["c"]) > 1e-2
    # a new BilevelProblem over the same two losses finds the compiled stage
    again = compiled.hypergrad(hg.BilevelProblem(g, f), w, lam, outer_batch=batch2)
    assert again.info.extra["compile_s"] == 0.0 and _rel(again.grad["c"], expected.grad["c"]) < 1e-10


@needs_compiler
def test_compiled_stage_products_against_closed_forms():
    """Ridge regression: H = X^T X / n + diag(exp(c)), mixed product = diag(exp(c) * w) u."""
    gen = torch.Generator().manual_seed(5)
    X = torch.randn(50, 6, generator=gen, dtype=DT)
    y = torch.randn(50, generator=gen, dtype=DT)

    def g(w, lam, batch):
        r = X @ w["x"] - y
        return 0.5 * (r @ r) / 50 + 0.5 * (torch.exp(lam["c"]) * w["x"] ** 2).sum()

    def f(w, lam, batch):
        return (w["x"] ** 2).sum()

    w = {"x": torch.randn(6, generator=gen, dtype=DT)}
    lam = {"c": torch.randn(6, generator=gen, dtype=DT)}
    stage = compiled_stage(hg.BilevelProblem(g, f), w, lam)
    assert stage is not None
    H = X.T @ X / 50 + torch.diag(torch.exp(lam["c"]))
    v = torch.randn(6, generator=gen, dtype=DT)
    torch.testing.assert_close(stage.hvp_flat(v), H @ v, rtol=1e-12, atol=0)
    torch.testing.assert_close(stage.mixed(v)["c"], torch.exp(lam["c"]) * w["x"] * v, rtol=1e-12, atol=0)
    torch.testing.assert_close(stage.grad_w_f["x"], 2 * w["x"], rtol=1e-12, atol=0)
    torch.testing.assert_close(stage.residual["x"], H @ w["x"] - X.T @ y / 50, rtol=1e-12, atol=1e-15)
    with pytest.raises(ValueError, match=r"flat torch\.float64 vector of shape"):
        stage.hvp_flat(torch.ones(5, dtype=DT))
    # the fused CG step is the iteration of conjugate_gradient
    x, r, p = torch.zeros(6, dtype=DT), v.clone(), v.clone()
    rs = r @ r
    x1, r1, p1, rs1, curvature = stage.cg_step(x, r, p, rs, torch.tensor(0.25, dtype=DT))
    Ap = H @ p + 0.25 * p
    alpha = rs / (p @ Ap)
    torch.testing.assert_close(curvature, p @ Ap, rtol=1e-12, atol=0)
    torch.testing.assert_close(x1, alpha * p, rtol=1e-12, atol=0)
    torch.testing.assert_close(r1, r - alpha * Ap, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(p1, r1 + (rs1 / rs) * p, rtol=1e-12, atol=1e-15)


def test_fused_conjugate_gradient_is_the_plain_iteration():
    gen = torch.Generator().manual_seed(2)
    M = torch.randn(8, 8, generator=gen, dtype=DT)
    A = M @ M.T + 0.5 * torch.eye(8, dtype=DT)
    b = {"x": torch.randn(8, generator=gen, dtype=DT)}

    def step(x, r, p, rs, damping):
        ap = A @ p + damping * p
        curvature = p @ ap
        alpha = rs / curvature
        x, r = x + alpha * p, r - alpha * ap
        rs_new = r @ r
        return x, r, r + (rs_new / rs) * p, rs_new, curvature

    system = hg.linear.LinearSystem(matvec=lambda v: {"x": A @ v["x"]}, rhs=b, flat_cg_step=step)
    plain = hg.linear.LinearSystem(matvec=lambda v: {"x": A @ v["x"]}, rhs=b)
    for kwargs in ({"tol": 1e-12}, {"tol": 1e-12, "maxiter": 4}, {"tol": 1e-10, "damping": 0.7}):
        fused = hg.linear.CG(**kwargs)(system)
        ref = hg.linear.CG(**kwargs)(plain)
        assert (fused.iterations, fused.converged, fused.matvecs, len(fused.warnings)) == (
            ref.iterations, ref.converged, ref.matvecs, len(ref.warnings))
        assert _rel(fused.solution["x"], ref.solution["x"]) < 1e-12
        assert fused.residual == pytest.approx(ref.residual, rel=1e-8, abs=1e-10)  # abs: round-off at 1e-12
    x0 = {"x": torch.ones(8, dtype=DT)}
    fused = fused_conjugate_gradient(system, x0, 1e-12, None, 0.0)
    ref = conjugate_gradient(plain.matvec, b, x0, 1e-12, None, 0.0, "CG")
    assert fused.iterations == ref.iterations and _rel(fused.solution["x"], ref.solution["x"]) < 1e-12
    indefinite = hg.linear.LinearSystem(matvec=lambda v: {"x": -v["x"]}, rhs=b,
                                        flat_cg_step=lambda x, r, p, rs, d: (x, r, p, rs, -(p @ p)))
    result = hg.linear.CG(tol=1e-12)(indefinite)
    assert result.iterations == 0 and "non-positive curvature" in result.warnings[0]


@needs_compiler
def test_products_that_do_not_depend_on_their_vector():
    """An inner loss without lam (the mixed product is zero) and one linear in w (H = 0)."""
    gen = torch.Generator().manual_seed(7)
    X, y = torch.randn(20, 3, generator=gen, dtype=DT), torch.randn(20, generator=gen, dtype=DT)

    def g(w, lam, b):
        return 0.5 * ((X @ w["x"] - y) ** 2).mean() + 0.5 * (w["x"] ** 2).sum()

    def f(w, lam, b):
        return ((w["x"] - lam["t"]) ** 2).sum()

    w, lam = {"x": torch.randn(3, generator=gen, dtype=DT)}, {"t": torch.ones(3, dtype=DT)}
    solver = hg.linear.CG(tol=1e-12)
    a = hg.Implicit(solver, compile=True).hypergrad(hg.BilevelProblem(g, f), w, lam)
    b = hg.Implicit(solver).hypergrad(hg.BilevelProblem(g, f), w, lam)
    assert a.info.extra["compiled"] and _rel(a.grad["t"], b.grad["t"]) < 1e-12
    stage = compiled_stage(hg.BilevelProblem(lambda w_, l_, b_: (l_["t"] * w_["x"]).sum(), f), w, lam)
    assert stage is not None
    assert stage.hvp_flat(torch.ones(3, dtype=DT)).tolist() == [0.0, 0.0, 0.0]
    torch.testing.assert_close(stage.mixed(torch.arange(3.0, dtype=DT))["t"], torch.arange(3.0, dtype=DT))


@needs_compiler
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
    assert any("using the eager products" in m for m in caplog.messages)
    re_ = hg.Implicit(solver).hypergrad(broken, w, lam)
    assert _rel(rc.grad["log_l2"], re_.grad["log_l2"]) < 1e-12
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="hypergrad"):  # remembered: not retried
        assert hg.Implicit(solver, compile=True).hypergrad(broken, w, lam).info.extra["compiled"] is False
    assert not caplog.messages


@needs_compiler
def test_non_finite_losses_stop_with_a_diagnostic():
    problem, w, lam = _logistic(seed=2)
    nan_outer = hg.BilevelProblem(problem.inner, lambda w_, l_, b: problem.outer(w_, l_, b) * float("nan"))
    with pytest.raises(hg.NonFiniteError, match="outer loss is nan"):
        hg.Implicit(compile=True).hypergrad(nan_outer, w, lam)
    inf_inner = hg.BilevelProblem(lambda w_, l_, b: problem.inner(w_, l_, b) + float("inf"), problem.outer)
    with pytest.raises(hg.NonFiniteError, match="inner loss is inf"):
        hg.Implicit(compile=True).hypergrad(inf_inner, w, lam)


def test_compile_needs_the_gradient_form():
    with pytest.raises(ValueError, match="compile=True needs the gradient form"):
        hg.Implicit(hg.linear.NormalCG(), fixed_point=lambda w, lam, b: w, compile=True)
    with pytest.raises(ValueError, match="compile=True needs the gradient form"):
        hg.Implicit(products="forward", compile=True)
    with pytest.raises(TypeError, match="compile must be a bool"):
        hg.Implicit(compile="yes")
