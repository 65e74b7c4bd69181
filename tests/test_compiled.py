"""Compiled products (Implicit(compile=True), hypergrad.compiled): the eager hypergradients to
1e-10 in float64, no recompiles on new values, closure and batch tensors read afresh, an eager
fallback with a log line."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

import hypergrad as hg
from hypergrad.compiled import compiler_available
from hypergrad.implicit import compiled_stage
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


# ------------------------------------------------------------ BOME / Penalty (F2SA) compile=True


def _same_result(a, b, tol: float = 1e-10) -> None:
    """Compiled ``a`` against eager ``b``: trees to ``tol``, the same counts and info floats."""
    for key in b.grad:
        torch.testing.assert_close(a.grad[key], b.grad[key], rtol=tol, atol=1e-13)
    for key in b.w:
        torch.testing.assert_close(a.w[key], b.w[key], rtol=tol, atol=1e-13)
    assert (a.info.iterations, a.info.grad_evals, a.info.converged) == (
        b.info.iterations, b.info.grad_evals, b.info.converged)
    assert a.info.residual == pytest.approx(b.info.residual, rel=tol, abs=1e-14)
    for key, value in b.info.extra.items():
        if isinstance(value, float):
            assert a.info.extra[key] == pytest.approx(value, rel=1e-8, abs=1e-12), key
        else:
            assert a.info.extra[key] == value, key
    assert a.info.extra["compiled"] is True
    assert (a.state is None) == (b.state is None)
    for key, tree in (b.state or {}).items():
        for leaf, value in tree.items():
            torch.testing.assert_close(a.state[key][leaf], value, rtol=tol, atol=1e-14)


@needs_compiler
def test_bome_compiled_equals_eager_across_calls_and_optimizers():
    problem, w, lam = _logistic(seed=4)
    eager = hg.BOME(hg.inner.SGD(lr=0.5), w_lr=0.1, inner_steps=5, eta=0.5)
    compiled = hg.BOME(hg.inner.SGD(lr=0.5), w_lr=0.1, inner_steps=5, eta=0.5, compile=True)
    first = compiled.hypergrad(problem, w, lam)
    assert first.info.extra["compile_s"] > 0.0
    _same_result(first, eager.hypergrad(problem, w, lam))
    assert first.info.extra["phi"] > 0.0  # the correction is active: phi and grad q are tested
    # the outer loop: new values of w and lam every call, no recompilation, still the eager numbers
    for _ in range(3):
        lam = {"log_l2": lam["log_l2"] - 0.1 * first.grad["log_l2"]}
        again, expected = compiled.hypergrad(problem, first.w, lam), eager.hypergrad(problem, first.w, lam)
        assert again.info.extra["compile_s"] == 0.0
        _same_result(again, expected)
        first = again
    # inner Adam, w stepped by Momentum with its state carried across calls, the gradient barrier
    kwargs = {"w_optimizer": hg.inner.Momentum(lr=0.05, beta=0.8), "inner_steps": 4, "barrier": "gradient"}
    eager = hg.BOME(hg.inner.Adam(lr=0.05), **kwargs)
    compiled = hg.BOME(hg.inner.Adam(lr=0.05), **kwargs, compile=True)
    ra, rb = None, None
    for _ in range(3):
        ra = compiled.hypergrad(problem, (ra or rb or first).w, lam, state=ra and ra.state)
        rb = eager.hypergrad(problem, rb.w if rb else first.w, lam, state=rb and rb.state)
        _same_result(ra, rb)
    assert float(ra.state["w_opt_state"]["m.weight"].abs().sum()) > 0.0


@needs_compiler
def test_penalty_compiled_equals_eager_with_state_carried():
    problem, w, lam = _logistic(seed=5)
    kwargs = {"sigma": 1e-2, "inner_optimizer": hg.inner.Momentum(lr=0.3, beta=0.5), "inner_steps": 3,
              "sigma_optimizer": hg.inner.Adam(lr=0.05)}
    eager, compiled = hg.Penalty(**kwargs), hg.Penalty(**kwargs, compile=True)
    ra = rb = None
    for call in range(3):
        ra = compiled.hypergrad(problem, ra.w if ra else w, lam, state=ra and ra.state)
        rb = eager.hypergrad(problem, rb.w if rb else w, lam, state=rb and rb.state)
        _same_result(ra, rb)
        assert (ra.info.extra["compile_s"] > 0.0) == (call == 0)
    assert _rel(ra.state["w_sigma"]["weight"], w["weight"]) > 1e-3  # the iterates did move
    advanced = {"sigma": 1e-2, "inner_optimizer": hg.inner.SGD(lr=0.3), "inner_steps": 2, "evaluate": "advanced"}
    _same_result(hg.Penalty(**advanced, compile=True).hypergrad(problem, w, lam, state=rb.state),
                 hg.Penalty(**advanced).hypergrad(problem, w, lam, state=rb.state))


@needs_compiler
def test_first_order_steps_read_closure_batch_and_step_batch_tensors_afresh():
    gen = torch.Generator().manual_seed(6)
    data = {"X": torch.randn(30, 4, generator=gen, dtype=DT), "y": torch.randn(30, generator=gen, dtype=DT)}

    def g(w, lam, batch):
        X, y = (data["X"], data["y"]) if batch is None else batch
        r = X @ w["x"] - y
        # lam scales the data term too, so that its gradient (the gap's) depends on the batch
        return 0.5 * (r @ r) / len(y) * torch.exp(lam["c"]).mean() + 0.5 * (torch.exp(lam["c"]) * w["x"] ** 2).sum()

    def f(w, lam, batch):
        return 0.5 * ((batch["Xv"] @ w["x"] - batch["yv"]) ** 2).sum()

    def outer_batch():
        return {"Xv": torch.randn(20, 4, generator=gen, dtype=DT), "yv": torch.randn(20, generator=gen, dtype=DT)}

    problem = hg.BilevelProblem(g, f)
    w, lam = {"x": torch.randn(4, generator=gen, dtype=DT)}, {"c": torch.zeros(4, dtype=DT)}
    kwargs = {"w_lr": 0.1, "inner_steps": 3, "eta": 50.0, "barrier": "gradient"}
    eager = hg.BOME(hg.inner.SGD(lr=0.3), **kwargs)
    compiled = hg.BOME(hg.inner.SGD(lr=0.3), **kwargs, compile=True)
    batch = outer_batch()
    first = compiled.hypergrad(problem, w, lam, outer_batch=batch)
    _same_result(first, eager.hypergrad(problem, w, lam, outer_batch=batch))
    assert first.info.extra["phi"] > 0.0
    data["X"] = torch.randn(30, 4, generator=gen, dtype=DT)  # rebind the closure's data
    batch = outer_batch()
    second = compiled.hypergrad(problem, w, lam, outer_batch=batch)
    assert second.info.extra["compile_s"] == 0.0
    _same_result(second, eager.hypergrad(problem, w, lam, outer_batch=batch))
    assert _rel(second.grad["c"], first.grad["c"]) > 1e-2

    # per-step batches: inner step t reads batch t, the gap g(w) - g(w_hat) is taken on batch 0
    drawn = []

    def stream():
        while True:
            drawn.append((torch.randn(30, 4, generator=gen, dtype=DT), torch.randn(30, generator=gen, dtype=DT)))
            yield drawn[-1]

    batches = hg.batches.StepBatches(stream())
    for _ in range(2):  # a fresh set of batches on every call, read as inputs of the same graph
        result = compiled.hypergrad(problem, w, lam, inner_batch=batches, outer_batch=batch)
        steps = drawn[-3:]
        assert len(drawn) % 3 == 0 and result.info.extra["compiled"]
        expected = _bome_reference(problem, w, lam, steps, batch, lr=0.3, **kwargs)
        for got, want in zip((result.grad["c"], result.w["x"]), expected, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-13)
        if getattr(hg.BOME, "takes_step_batches", False):  # the eager BOME reads per-step batches too
            _same_result(result, eager.hypergrad(problem, w, lam, inner_batch=hg.batches.StepBatches(steps),
                                                 outer_batch=batch))
    assert len(drawn) == 6  # three per call: each batch drawn once


def _bome_reference(problem, w, lam, steps, outer_batch, lr, w_lr, inner_steps, eta, barrier):
    """BOME with SGD inner steps on per-step batches, written out with torch.autograd."""
    def grads(loss, x, c):
        x, c = x.detach().requires_grad_(), c.detach().requires_grad_()
        value = loss({"x": x}, {"c": c})
        return (value.detach(), *torch.autograd.grad(value, (x, c), allow_unused=True, materialize_grads=True))

    x = w["x"]
    g_w, gx, gc = grads(lambda w_, l_: problem.inner(w_, l_, steps[0]), w["x"], lam["c"])
    for batch in steps:
        _, step_grad, _ = grads(lambda w_, l_, b=batch: problem.inner(w_, l_, b), x, lam["c"])
        x = x - lr * step_grad
    g_hat, _, gc_hat = grads(lambda w_, l_: problem.inner(w_, l_, steps[0]), x, lam["c"])
    _, fx, fc = grads(lambda w_, l_: problem.outer(w_, l_, outer_batch), w["x"], lam["c"])
    qc = gc - gc_hat
    sq_norm = gx @ gx + qc @ qc
    target = eta * (g_w - g_hat) if barrier == "value" else eta * sq_norm
    phi = torch.clamp_min((target - (fx @ gx + fc @ qc)) / sq_norm, 0.0)
    return fc + phi * qc, w["x"] - w_lr * (fx + phi * gx)


@needs_compiler
def test_first_order_fallback_to_eager_with_a_log_line(caplog):
    problem, w, lam = _logistic(seed=7)

    def g(w_, lam_, batch):
        value = problem.inner(w_, lam_, batch)
        if float(w_["bias"].detach().sum()) > 1e6:  # a graph break under fullgraph=True
            value = value * 2
        return value

    broken = hg.BilevelProblem(g, problem.outer)
    for method in (hg.BOME(hg.inner.SGD(lr=0.5), w_lr=0.1, inner_steps=2),
                   hg.Penalty(1e-2, hg.inner.SGD(lr=0.5), inner_steps=2)):
        compiled = dataclasses.replace(method, compile=True)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="hypergrad"):
            a = compiled.hypergrad(broken, w, lam)
        assert a.info.extra["compiled"] is False and a.info.extra["compile_s"] == 0.0
        assert any("using the eager step" in m for m in caplog.messages)
        b = method.hypergrad(broken, w, lam)
        assert torch.equal(a.grad["log_l2"], b.grad["log_l2"]) and a.info.grad_evals == b.info.grad_evals
        if getattr(type(method), "takes_step_batches", False):  # the eager call reads per-step batches
            drawn = []
            stream = hg.batches.StepBatches(drawn.append(i) or i for i in range(100))
            compiled.hypergrad(broken, w, lam, inner_batch=stream)
            assert len(drawn) == 2  # the eager fallback re-reads the batches the compiled path drew
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="hypergrad"):  # remembered: not retried
            assert compiled.hypergrad(broken, w, lam).info.extra["compiled"] is False
        assert not caplog.messages


@needs_compiler
def test_first_order_non_finite_values_raise_the_eager_diagnostic():
    problem, w, lam = _logistic(seed=4)  # the losses of the first BOME test: compiled, no recompile
    nan_lam = {"log_l2": lam["log_l2"].clone()}
    nan_lam["log_l2"][0] = float("nan")
    bome = hg.BOME(hg.inner.SGD(lr=0.5), w_lr=0.1, inner_steps=5, eta=0.5, compile=True)
    assert bome.hypergrad(problem, w, lam).info.extra["compiled"]
    with pytest.raises(hg.NonFiniteError, match=r"^inner loss is nan \(non-finite\)"):
        bome.hypergrad(problem, w, nan_lam)
    huge = {"inner_optimizer": hg.inner.SGD(lr=1e200), "w_lr": 0.1, "inner_steps": 2}  # w_hat overflows
    with pytest.raises(hg.NonFiniteError) as eager_error:
        hg.BOME(**huge).hypergrad(problem, w, lam)
    with pytest.raises(hg.NonFiniteError) as compiled_error:
        hg.BOME(**huge, compile=True).hypergrad(problem, w, lam)
    assert str(compiled_error.value) == str(eager_error.value)
    f2sa = hg.Penalty(1e-2, hg.inner.SGD(lr=0.5), inner_steps=2, compile=True)
    with pytest.raises(hg.NonFiniteError, match=r"^inner loss is nan \(non-finite\)"):
        f2sa.hypergrad(problem, w, nan_lam)


def test_first_order_compile_flag_is_checked():
    for make in (lambda c: hg.BOME(hg.inner.SGD(lr=0.1), w_lr=0.1, compile=c),
                 lambda c: hg.Penalty(1e-2, hg.inner.SGD(lr=0.1), compile=c)):
        with pytest.raises(TypeError, match="compile must be a bool, got str"):
            make("yes")
        assert make(True).compile is True and make(False).compile is False


@needs_compiler
def test_first_order_past_the_recompile_limit_runs_eagerly(caplog):
    """Past dynamo's recompile limit (torch 2.13 raises under fullgraph=True; the stage's "ran" flag
    covers versions that run the frame eagerly instead): the eager step, with a log line."""
    import torch._dynamo.config

    problem, w, lam = _logistic(seed=8, n=20, d=3)
    with torch._dynamo.config.patch(recompile_limit=1), caplog.at_level(logging.WARNING, logger="hypergrad"):
        first = hg.BOME(hg.inner.SGD(lr=0.5), w_lr=0.1, inner_steps=1, compile=True).hypergrad(problem, w, lam)
        assert first.info.extra["compiled"] is True
        other = hg.BOME(hg.inner.SGD(lr=0.5), w_lr=0.1, inner_steps=2)  # a guard fails: a second graph
        result = dataclasses.replace(other, compile=True).hypergrad(problem, w, lam)
    assert result.info.extra["compiled"] is False
    assert any("RecompileLimit" in m or "recompile limit" in m for m in caplog.messages)
    assert torch.equal(result.grad["log_l2"], other.hypergrad(problem, w, lam).grad["log_l2"])


@needs_compiler
def test_penalty_compiled_reads_one_batch_per_evaluation():
    """With StepBatches, F2SA's T evaluations read T batch pairs: the same as T eager one-step calls
    with the state carried, one batch pair each (evaluate="current": the estimate is the last's)."""
    gen = torch.Generator().manual_seed(9)

    def g(w, lam, batch):
        r = batch[0] @ w["x"] - batch[1]
        return 0.5 * (r @ r) / len(r) * torch.exp(lam["c"]).mean() + 0.5 * (torch.exp(lam["c"]) * w["x"] ** 2).sum()

    def f(w, lam, batch):
        return 0.5 * ((batch[0] @ w["x"] - batch[1]) ** 2).mean()

    def batch():
        return torch.randn(25, 4, generator=gen, dtype=DT), torch.randn(25, generator=gen, dtype=DT)

    problem = hg.BilevelProblem(g, f)
    w, lam = {"x": torch.randn(4, generator=gen, dtype=DT)}, {"c": 0.1 * torch.randn(4, generator=gen, dtype=DT)}
    kwargs = {"sigma": 0.05, "inner_optimizer": hg.inner.SGD(lr=0.2)}
    for _ in range(2):
        inner, outer = [batch() for _ in range(3)], [batch() for _ in range(3)]
        stream = iter(inner)
        result = hg.Penalty(**kwargs, inner_steps=3, compile=True).hypergrad(
            problem, w, lam, hg.batches.StepBatches(stream), hg.batches.StepBatches(outer))
        assert result.info.extra["compiled"] and next(stream, None) is None  # three drawn
        state, one_step = None, hg.Penalty(**kwargs, inner_steps=1)
        for inner_batch, outer_batch in zip(inner, outer, strict=True):
            expected = one_step.hypergrad(problem, state["w"] if state else w, lam, inner_batch, outer_batch, state)
            state = expected.state
        torch.testing.assert_close(result.grad["c"], expected.grad["c"], rtol=1e-10, atol=1e-13)
        for key in ("w", "w_sigma"):
            torch.testing.assert_close(result.state[key]["x"], expected.state[key]["x"], rtol=1e-10, atol=1e-13)


# ------------------------------------------------- SOBA / SABA / AmIGO / StocBiO compile=True


@pytest.fixture(scope="module")
def stochastic():
    """A tiny least-squares bilevel problem with fresh batches (shared by the tests below, so each
    solver's stage compiles once for the module)."""
    gen = torch.Generator().manual_seed(11)

    def data(batch):
        return batch[1] if isinstance(batch[0], int) else batch  # SABA's batches are (index, data)

    def g(w, lam, batch):
        X, y = data(batch)
        r = X @ w["x"] - y
        return 0.5 * (r @ r) / len(r) + 0.5 * (torch.exp(lam["c"]) * w["x"] ** 2).sum()

    def f(w, lam, batch):
        X, y = data(batch)
        return 0.5 * ((X @ w["x"] - y) ** 2).mean() + 0.01 * (lam["c"] ** 2).sum()

    def batch():
        return torch.randn(8, 3, generator=gen, dtype=DT), torch.randn(8, generator=gen, dtype=DT)

    w, lam = {"x": torch.randn(3, generator=gen, dtype=DT)}, {"c": 0.1 * torch.randn(3, generator=gen, dtype=DT)}
    return hg.BilevelProblem(g, f), w, lam, batch


SCHEDULE = hg.stochastic.Decreasing(0.3, 0.5)
STOCHASTIC_METHODS = {  # name -> (compile flag -> method, indexed batches, StepBatches inner batches)
    "SOBA": (lambda c: hg.SOBA(SCHEDULE, compile=c), False, False),
    "SABA": (lambda c: hg.SABA(SCHEDULE, n_inner=3, n_outer=3, compile=c), True, False),
    "AmIGO": (lambda c: hg.AmIGO(SCHEDULE, inner_steps=2, linear_steps=2,
                                 linear_step_size=hg.stochastic.Decreasing(0.2, 0.3), compile=c), False, True),
    "StocBiO": (lambda c: hg.StocBiO(SCHEDULE, inner_steps=2, linear_steps=2, compile=c), False, False),
}


def _same_nested(a, b, where: str) -> None:
    """Trees, memory tables and counters of a compiled result against the eager one (1e-10)."""
    if isinstance(b, torch.Tensor):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-14, msg=where)
    elif isinstance(b, dict):
        assert set(a) == set(b), where
        for key in b:
            _same_nested(a[key], b[key], f"{where}[{key!r}]")
    elif isinstance(b, float):
        assert a == pytest.approx(b, rel=1e-10, abs=1e-13), where
    else:
        assert a == b, where


def _same_stochastic(a, b) -> None:
    _same_nested(a.grad, b.grad, "grad")
    _same_nested(a.w, b.w, "w")
    assert (a.info.iterations, a.info.grad_evals, a.info.converged) == (
        b.info.iterations, b.info.grad_evals, b.info.converged)
    _same_nested(a.info.residual, b.info.residual, "residual")
    assert a.info.extra["compiled"] is True
    _same_nested({k: a.info.extra[k] for k in b.info.extra}, b.info.extra, "extra")
    _same_nested(a.state, b.state, "state")


@needs_compiler
@pytest.mark.parametrize("name", list(STOCHASTIC_METHODS))
def test_stochastic_compiled_equals_eager_across_calls(stochastic, name):
    """Four calls with the state carried on each path, fresh batches and a decreasing step size:
    the eager results to 1e-10, and no recompilation per step, per batch or (SABA) per index."""
    problem, w, lam, batch = stochastic
    make, indexed, step_batches = STOCHASTIC_METHODS[name]
    eager, compiled = make(False), make(True)
    eager_w, eager_state, compiled_w, compiled_state = w, None, w, None
    compiles = []
    for call, slot in enumerate((0, 1, 0, 2)):  # SABA revisits slot 0 (its stored values are used)
        if step_batches:
            drawn = [batch() for _ in range(compiled.inner_steps + compiled.linear_steps + 1)]
            stream = iter([*drawn, "not drawn"])
            inner_eager, inner_compiled = hg.batches.StepBatches(drawn), hg.batches.StepBatches(stream)
        else:
            inner_eager = inner_compiled = (slot, batch()) if indexed else batch()
        outer_batch = (2 - slot, batch()) if indexed else batch()
        b = eager.hypergrad(problem, eager_w, lam, inner_eager, outer_batch, eager_state)
        a = compiled.hypergrad(problem, compiled_w, lam, inner_compiled, outer_batch, compiled_state)
        if step_batches:
            assert next(stream) == "not drawn"  # T + L + 1 batches read, each a graph input
        _same_stochastic(a, b)
        compiles.append(a.info.extra["compile_s"] > 0.0)
        assert a.info.extra["step"] == call
        eager_w, eager_state, compiled_w, compiled_state = b.w, b.state, a.w, a.state
    # one compilation (SABA: at most one more, when the Python int index first changes)
    assert compiles[2:] == [False, False] and sum(compiles) <= (2 if indexed else 1), compiles


@needs_compiler
def test_stochastic_fallback_to_eager_with_a_log_line(stochastic, caplog):
    problem, w, lam, batch = stochastic

    def g(w_, lam_, b):
        value = problem.inner(w_, lam_, b)
        if float(w_["x"].detach().sum()) > 1e6:  # a graph break under fullgraph=True
            value = value * 2
        return value

    broken = hg.BilevelProblem(g, problem.outer)
    inner_batch, outer_batch = (0, batch()), (1, batch())
    for name, (make, _, step_batches) in STOCHASTIC_METHODS.items():
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="hypergrad"):
            if step_batches:  # the eager fallback re-reads the batches the compiled path drew
                drawn = []
                stream = hg.batches.StepBatches(drawn.append(i) or inner_batch for i in range(100))
                a = make(True).hypergrad(broken, w, lam, stream, outer_batch)
                assert len(drawn) == 5
            else:
                a = make(True).hypergrad(broken, w, lam, inner_batch, outer_batch)
        assert a.info.extra["compiled"] is False and a.info.extra["compile_s"] == 0.0, name
        assert any(f"compiling the {name} step failed" in m and "using the eager step" in m
                   for m in caplog.messages), caplog.messages
        b = make(False).hypergrad(broken, w, lam, inner_batch, outer_batch)
        torch.testing.assert_close(a.grad["c"], b.grad["c"], rtol=1e-12, atol=1e-15)
        assert a.info.grad_evals == b.info.grad_evals
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="hypergrad"):  # remembered: not retried
            assert make(True).hypergrad(broken, w, lam, inner_batch, outer_batch).info.extra["compiled"] is False
        assert not caplog.messages


@needs_compiler
def test_stochastic_non_finite_values_raise_the_eager_diagnostic(stochastic):
    problem, w, lam, batch = stochastic
    nan_lam = {"c": lam["c"].clone()}
    nan_lam["c"][0] = float("nan")
    for name in ("SOBA", "StocBiO"):  # the stages the equality test compiled: no recompilation
        make, _, _ = STOCHASTIC_METHODS[name]
        inner_batch, outer_batch = batch(), batch()
        with pytest.raises(hg.NonFiniteError) as eager_error:
            make(False).hypergrad(problem, w, nan_lam, inner_batch, outer_batch)
        with pytest.raises(hg.NonFiniteError) as compiled_error:
            make(True).hypergrad(problem, w, nan_lam, inner_batch, outer_batch)
        assert str(compiled_error.value) == str(eager_error.value)


def test_stochastic_compile_flag_is_checked():
    for name, (make, _, _) in STOCHASTIC_METHODS.items():
        with pytest.raises(TypeError, match="compile must be a bool, got str"):
            dataclasses.replace(make(False), compile="yes")
        assert make(True).compile is True and make(False).compile is False, name
