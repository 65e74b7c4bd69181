"""hypergrad.AlternatingImplicit: inner steps then an implicit hypergradient, against the closed form
of ridge regression; warm starts, per-step batches and bad input."""

from __future__ import annotations

import warnings

import pytest
import torch

import hypergrad as hg

D = torch.float64


def ridge(seed: int = 0):
    """Ridge regression with one log-penalty per feature: g, f, lam, the Hessian and the closed form."""
    gen = torch.Generator().manual_seed(seed)
    X, y = torch.randn(30, 4, generator=gen, dtype=D), torch.randn(30, generator=gen, dtype=D)
    Xv, yv = torch.randn(20, 4, generator=gen, dtype=D), torch.randn(20, generator=gen, dtype=D)

    def g(w, lam, b):
        return 0.5 * ((X @ w["w"] - y) ** 2).sum() + 0.5 * (lam["l2"].exp() * w["w"] ** 2).sum()

    def f(w, lam, b):
        return 0.5 * ((Xv @ w["w"] - yv) ** 2).sum()

    lam = {"l2": torch.tensor([0.1, -0.2, 0.3, 0.0], dtype=D)}
    H = X.T @ X + torch.diag(lam["l2"].exp())
    w_star = torch.linalg.solve(H, X.T @ y)
    # dF/dl2_j = -(d^2 g / dl2_j dw) u with H u = grad_w f; d^2 g / dl2_j dw_j = exp(l2_j) w_j
    expected = -w_star * lam["l2"].exp() * torch.linalg.solve(H, Xv.T @ (Xv @ w_star - yv))
    return hg.BilevelProblem(g, f), lam, H, w_star, expected


def test_enough_inner_steps_give_the_closed_form_hypergradient_of_ridge() -> None:
    problem, lam, H, w_star, expected = ridge()
    method = hg.AlternatingImplicit(hg.inner.SGD(lr=1.0 / float(torch.linalg.eigvalsh(H)[-1])), 400,
                                    hg.Implicit(hg.linear.CG(tol=1e-12), warm_start=True))
    r = method.hypergrad(problem, {"w": torch.zeros(4, dtype=D)}, lam)
    torch.testing.assert_close(r.w["w"], w_star, rtol=1e-6, atol=1e-8)
    torch.testing.assert_close(r.grad["l2"], expected, rtol=1e-5, atol=1e-8)
    assert set(r.state) == {"opt_state", "u"} and r.info.extra["cg_converged"] == 1.0
    assert r.info.extra["cg_iterations"] == r.info.iterations >= 1
    assert r.info.grad_evals >= 400 + 3  # the inner steps are counted with the implicit step's cost
    # a second call starts CG from the carried solution: fewer iterations to the same tolerance
    again = method.hypergrad(problem, r.w, lam, state=r.state)
    assert again.info.iterations < r.info.iterations
    torch.testing.assert_close(again.grad["l2"], expected, rtol=1e-5, atol=1e-8)


def test_few_inner_steps_give_the_implicit_hypergradient_at_the_new_iterate() -> None:
    """Not at the start: the implicit step sees the iterate after the inner steps."""
    problem, lam, H, _, _ = ridge()
    sgd = hg.inner.SGD(lr=0.5 / float(torch.linalg.eigvalsh(H)[-1]))
    w0 = {"w": torch.zeros(4, dtype=D)}
    r = hg.AlternatingImplicit(sgd, 3, hg.Implicit(hg.linear.CG(tol=1e-12))).hypergrad(problem, w0, lam)
    w = w0
    for _ in range(3):
        _, grad, _ = hg.autodiff.loss_and_grads(lambda w_, l_: problem.inner_loss(w_, l_, None), w, lam, wrt_lam=False)
        w, _ = sgd.update(w, grad, sgd.init(w))
    torch.testing.assert_close(r.w["w"], w["w"])
    at_w = hg.Implicit(hg.linear.CG(tol=1e-12)).hypergrad(problem, w, lam)
    torch.testing.assert_close(r.grad["l2"], at_w.grad["l2"])


def test_step_batches_give_each_inner_step_its_own_batch() -> None:
    """Batch b scales the inner loss; step i must see the i-th batch, and the system the last."""
    seen: list[float] = []

    def g(w, lam, b):
        seen.append(b)
        return 0.5 * b * ((w["x"] - lam["c"]) ** 2).sum()

    def f(w, lam, b):
        return 0.5 * ((w["x"] - 1.0) ** 2).sum()

    method = hg.AlternatingImplicit(hg.inner.SGD(lr=0.5), 2, hg.Implicit(hg.linear.CG(tol=1e-12)))
    assert method.takes_step_batches
    lam = {"c": torch.tensor([2.0], dtype=D)}
    r = method.hypergrad(hg.BilevelProblem(g, f), {"x": torch.zeros(1, dtype=D)}, lam,
                         inner_batch=hg.StepBatches(iter([1.0, 2.0, 99.0])))
    assert seen[:2] == [1.0, 2.0] and set(seen[2:]) == {2.0}
    # x: 0 -> 0 - 0.5 * 1 * (0 - 2) = 1 -> 1 - 0.5 * 2 * (1 - 2) = 2 (= c, the inner solution)
    assert r.w["x"].tolist() == [2.0] and r.grad["c"].tolist() == pytest.approx([1.0])
    with pytest.raises(ValueError, match="yielded 1 batch"):
        method.hypergrad(hg.BilevelProblem(g, f), {"x": torch.zeros(1, dtype=D)}, lam,
                         inner_batch=hg.StepBatches([1.0]))


def test_the_solve_context_wraps_the_implicit_step_only() -> None:
    import contextlib

    entered: list[int] = []
    calls = {"g": 0}

    def g(w, lam, b):
        calls["g"] += 1
        return 0.5 * (torch.tensor([1.0, 10.0], dtype=D) * (w["x"] - lam["c"]) ** 2).sum()

    @contextlib.contextmanager
    def context():
        entered.append(calls["g"])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", hg.ConvergenceWarning)
            yield

    capped = hg.Implicit(hg.linear.CG(tol=1e-30, maxiter=1))
    problem = hg.BilevelProblem(g, lambda w, lam, b: (w["x"] ** 4).sum())
    lam = {"c": torch.tensor([1.0, 3.0], dtype=D)}
    with warnings.catch_warnings():
        warnings.simplefilter("error", hg.ConvergenceWarning)
        r = hg.AlternatingImplicit(hg.inner.SGD(lr=0.05), 2, capped, solve_context=context).hypergrad(
            problem, {"x": torch.zeros(2, dtype=D)}, lam)
    assert entered == [2]  # entered once, after the two inner steps
    assert r.info.converged is False and r.info.extra["cg_converged"] == 0.0


def test_bad_input_is_named() -> None:
    with pytest.raises(ValueError, match="inner_steps must be an int >= 1, got 0"):
        hg.AlternatingImplicit(hg.inner.SGD(lr=0.1), 0, hg.Implicit())
    with pytest.raises(ValueError, match="inner_steps must be an int >= 1"):
        hg.AlternatingImplicit(hg.inner.SGD(lr=0.1), 2.0, hg.Implicit())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"implicit must be a hypergrad\.Implicit"):
        hg.AlternatingImplicit(hg.inner.SGD(lr=0.1), 1, hg.linear.CG())  # type: ignore[arg-type]


def test_a_diverging_inner_optimizer_raises_non_finite_error() -> None:
    problem, lam, _, _, _ = ridge()
    method = hg.AlternatingImplicit(hg.inner.SGD(lr=1e6), 200, hg.Implicit())
    with pytest.raises(hg.NonFiniteError, match="inner"):
        method.hypergrad(problem, {"w": torch.ones(4, dtype=D)}, lam)


def test_solve_with_a_stream_of_outer_batches_hands_implicit_one_batch() -> None:
    """hg.solve gives a method that takes step batches a StepBatches per stream; the implicit step
    reads one outer batch of it (it used to get the StepBatches itself)."""
    g = lambda w, lam, b: 0.5 * ((w["x"] - lam["c"]) ** 2).sum()  # noqa: E731
    f = lambda w, lam, b: 0.5 * ((w["x"] - b) ** 2).sum()  # noqa: E731
    method = hg.AlternatingImplicit(inner_optimizer=hg.inner.SGD(lr=1.0), inner_steps=1,
                                    implicit=hg.Implicit(solver=hg.linear.CG(tol=1e-12)))
    targets = [torch.tensor([2.0], dtype=D), torch.tensor([4.0], dtype=D)]
    res = hg.solve(hg.BilevelProblem(g, f), {"x": torch.zeros(1, dtype=D)}, {"c": torch.zeros(1, dtype=D)},
                   method, lambda p: torch.optim.SGD(p, lr=0.5), steps=2, outer_batches=targets, progress=False,
                   outer_loss_every=0)  # no extra outer draw: step i reads targets[i]
    # step 1: w = c = 0, dF/dc = 0 - 2, c = 1; step 2: w = c = 1, dF/dc = 1 - 4, c = 2.5
    assert res.lam["c"].tolist() == [2.5]
