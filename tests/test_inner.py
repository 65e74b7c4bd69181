"""Pure inner optimizers (hypergrad.inner) against torch.optim, purity and argument checks."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import hypergrad as hg
from hypergrad.inner import InnerOptimizer

DT = torch.float64
STEPS = 20


def _problem(seed: int) -> tuple[dict[str, torch.Tensor], callable]:
    """A strongly convex quadratic over two leaves (a vector and a matrix) plus a quartic term."""
    gen = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(5, 5, generator=gen, dtype=DT))
    A = (q * torch.logspace(0, 1.3, 5, dtype=DT)) @ q.T
    b = torch.randn(5, generator=gen, dtype=DT)
    M = torch.randn(3, 2, generator=gen, dtype=DT)

    def loss(w: dict[str, torch.Tensor]) -> torch.Tensor:
        x, m = w["x"], w["m"]
        return 0.5 * x @ A @ x - b @ x + 0.5 * ((m - M) ** 2).sum() + 0.05 * (m**4).sum()

    w0 = {
        "x": torch.randn(5, generator=gen, dtype=DT),
        "m": torch.randn(3, 2, generator=gen, dtype=DT),
    }
    return w0, loss


def _ours(opt: InnerOptimizer, w0: dict[str, torch.Tensor], loss) -> list[dict[str, torch.Tensor]]:
    w = {k: v.clone() for k, v in w0.items()}
    state = opt.init(w)
    out = []
    for _ in range(STEPS):
        wg = {k: v.detach().requires_grad_(True) for k, v in w.items()}
        grads = torch.autograd.grad(loss(wg), list(wg.values()))
        with torch.no_grad():
            w, state = opt.update(w, dict(zip(w, grads, strict=True)), state)
        out.append({k: v.clone() for k, v in w.items()})
    return out


def _torch(make_opt, w0: dict[str, torch.Tensor], loss) -> list[dict[str, torch.Tensor]]:
    params = {k: torch.nn.Parameter(v.clone()) for k, v in w0.items()}
    opt = make_opt(list(params.values()))
    out = []
    for _ in range(STEPS):
        opt.zero_grad()
        loss(params).backward()
        opt.step()
        out.append({k: v.detach().clone() for k, v in params.items()})
    return out


def _max_diff(a: list[dict[str, torch.Tensor]], b: list[dict[str, torch.Tensor]]) -> float:
    return max(float((x[k] - y[k]).abs().max()) for x, y in zip(a, b, strict=True) for k in x)


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 10_000), lr=st.floats(0.01, 0.12))
def test_sgd_matches_torch_optim(seed: int, lr: float) -> None:
    w0, loss = _problem(seed)
    ours = _ours(hg.inner.SGD(lr=lr), w0, loss)
    ref = _torch(lambda p: torch.optim.SGD(p, lr=lr), w0, loss)
    assert _max_diff(ours, ref) < 1e-10
    assert _max_diff(ours, [w0] * STEPS) > 1e-3  # it moved


@settings(max_examples=15, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    lr=st.floats(0.01, 0.08),
    beta=st.floats(0.0, 0.95),
    nesterov=st.booleans(),
)
def test_momentum_matches_torch_optim(seed: int, lr: float, beta: float, nesterov: bool) -> None:
    if nesterov and beta == 0.0:
        beta = 0.5  # torch.optim.SGD refuses nesterov without momentum
    w0, loss = _problem(seed)
    ours = _ours(hg.inner.Momentum(lr=lr, beta=beta, nesterov=nesterov), w0, loss)
    ref = _torch(lambda p: torch.optim.SGD(p, lr=lr, momentum=beta, nesterov=nesterov), w0, loss)
    assert _max_diff(ours, ref) < 1e-10


def test_momentum_and_nesterov_differ_from_sgd() -> None:
    """Guards the comparison above against an optimizer that ignores beta / nesterov."""
    w0, loss = _problem(0)
    sgd = _ours(hg.inner.SGD(lr=0.05), w0, loss)
    heavy = _ours(hg.inner.Momentum(lr=0.05, beta=0.9), w0, loss)
    nest = _ours(hg.inner.Momentum(lr=0.05, beta=0.9, nesterov=True), w0, loss)
    assert _max_diff(sgd, heavy) > 1e-3
    assert _max_diff(heavy, nest) > 1e-3


@settings(max_examples=15, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    lr=st.floats(0.001, 0.1),
    beta1=st.floats(0.0, 0.95),
    beta2=st.floats(0.9, 0.9999),
    eps=st.sampled_from([1e-8, 1e-6, 1e-3]),
)
def test_adam_matches_torch_optim(
    seed: int, lr: float, beta1: float, beta2: float, eps: float
) -> None:
    w0, loss = _problem(seed)
    ours = _ours(hg.inner.Adam(lr=lr, betas=(beta1, beta2), eps=eps), w0, loss)
    ref = _torch(lambda p: torch.optim.Adam(p, lr=lr, betas=(beta1, beta2), eps=eps), w0, loss)
    assert _max_diff(ours, ref) < 1e-10


def test_adam_zero_gradient_coordinate_is_finite_and_differentiable() -> None:
    opt = hg.inner.Adam(lr=0.1)
    w = {"x": torch.tensor([1.0, 2.0], dtype=DT)}
    g = torch.tensor([0.0, 3.0], dtype=DT, requires_grad=True)
    new_w, _ = opt.update(w, {"x": g}, opt.init(w))
    assert new_w["x"][0] == 1.0  # a zero gradient does not move the coordinate
    (dg,) = torch.autograd.grad(new_w["x"].sum(), g)
    assert torch.isfinite(dg).all()


@pytest.mark.parametrize(
    "opt",
    [
        hg.inner.SGD(lr=0.1),
        hg.inner.Momentum(lr=0.1, beta=0.9, nesterov=True),
        hg.inner.Adam(lr=0.1),
        hg.inner.LBFGS(lr=0.1, history_size=3),
    ],
    ids=["sgd", "momentum", "adam", "lbfgs"],
)
def test_update_is_pure(opt: InnerOptimizer) -> None:
    """update() must not modify its inputs in place: unrolling relies on every iterate surviving."""
    assert isinstance(opt, InnerOptimizer)
    w = {"x": torch.randn(4, dtype=DT)}
    state = opt.init(w)
    state = opt.update(w, {"x": torch.randn(4, dtype=DT)}, state)[1]  # non-zero buffers
    grad = {"x": torch.randn(4, dtype=DT)}
    before = [t.clone() for t in (*w.values(), *grad.values(), *state.values())]
    new_w, new_state = opt.update(w, grad, state)
    after = [*w.values(), *grad.values(), *state.values()]
    assert all(torch.equal(x, y) for x, y in zip(before, after, strict=True))
    assert set(new_state) == set(state)
    assert not torch.equal(new_w["x"], w["x"])


@pytest.mark.parametrize(
    ("make", "name"),
    [
        (lambda: hg.inner.SGD(lr=0.0), "lr"),
        (lambda: hg.inner.SGD(lr=-0.1), "lr"),
        (lambda: hg.inner.SGD(lr=math.nan), "lr"),
        (lambda: hg.inner.SGD(lr=math.inf), "lr"),
        (lambda: hg.inner.SGD(lr=True), "lr"),
        (lambda: hg.inner.SGD(lr="0.1"), "lr"),
        (lambda: hg.inner.Momentum(lr=0.0), "lr"),
        (lambda: hg.inner.Momentum(lr=0.1, beta=1.0), "beta"),
        (lambda: hg.inner.Momentum(lr=0.1, beta=-0.1), "beta"),
        (lambda: hg.inner.Adam(lr=-1.0), "lr"),
        (lambda: hg.inner.Adam(lr=0.1, betas=(1.0, 0.999)), "betas[0]"),
        (lambda: hg.inner.Adam(lr=0.1, betas=(0.9, 1.5)), "betas[1]"),
        (lambda: hg.inner.Adam(lr=0.1, betas=0.9), "betas"),
        (lambda: hg.inner.Adam(lr=0.1, eps=-1e-8), "eps"),
        (lambda: hg.inner.Adam(lr=0.1, eps_root=-1.0), "eps_root"),
        (lambda: hg.inner.Adam(lr=0.1, leaf_lr={"x": 0.0}), r"leaf_lr['x']"),
        (lambda: hg.inner.SGD(lr=0.1, leaf_lr={"x": math.inf}), r"leaf_lr['x']"),
        (lambda: hg.inner.Momentum(lr=0.1, leaf_lr={"x": -1.0}), r"leaf_lr['x']"),
        (lambda: hg.inner.LBFGS(lr=0.0), "lr"),
        (lambda: hg.inner.LBFGS(history_size=0), "history_size"),
        (lambda: hg.inner.LBFGS(max_backtracks=2.5), "max_backtracks"),
        (lambda: hg.inner.LBFGS(c1=1.0), "c1"),
        (lambda: hg.inner.LBFGS(line_search="yes"), "line_search"),
    ],
)
def test_invalid_arguments_raise_value_error(make, name: str) -> None:
    with pytest.raises(ValueError, match=name.replace("[", r"\[").replace("]", r"\]")):
        make()


@pytest.mark.parametrize(
    ("ours", "theirs"),
    [
        (lambda lr, leaf: hg.inner.SGD(lr=lr, leaf_lr=leaf), lambda groups: torch.optim.SGD(groups)),
        (
            lambda lr, leaf: hg.inner.Momentum(lr=lr, beta=0.8, nesterov=True, leaf_lr=leaf),
            lambda groups: torch.optim.SGD(groups, momentum=0.8, nesterov=True),
        ),
        (lambda lr, leaf: hg.inner.Adam(lr=lr, leaf_lr=leaf), lambda groups: torch.optim.Adam(groups)),
    ],
    ids=["sgd", "momentum", "adam"],
)
def test_leaf_lr_matches_torch_parameter_groups(ours, theirs) -> None:
    """``leaf_lr`` is torch.optim's per-parameter-group learning rate, leaf by leaf."""
    w0, loss = _problem(3)
    got = _ours(ours(0.02, {"m": 0.07}), w0, loss)
    ref = _torch(lambda p: theirs([{"params": [p[0]], "lr": 0.02}, {"params": [p[1]], "lr": 0.07}]), w0, loss)
    assert _max_diff(got, ref) < 1e-10
    assert _max_diff(got, _ours(ours(0.02, {}), w0, loss)) > 1e-3  # the override takes effect


def test_leaf_lr_must_be_a_mapping_of_names() -> None:
    with pytest.raises(TypeError, match="leaf_lr"):
        hg.inner.Adam(lr=0.1, leaf_lr=[("x", 0.1)])


def test_nesterov_must_be_bool() -> None:
    with pytest.raises(TypeError, match="nesterov"):
        hg.inner.Momentum(lr=0.1, nesterov="yes")


def _torch_lbfgs(lr: float, history: int, w0: dict[str, torch.Tensor], loss) -> list[dict[str, torch.Tensor]]:
    """torch.optim.LBFGS, one iteration per step() and its tolerance tests off."""
    params = {k: torch.nn.Parameter(v.clone()) for k, v in w0.items()}
    opt = torch.optim.LBFGS(list(params.values()), lr=lr, max_iter=1, history_size=history,
                            tolerance_grad=-1.0, tolerance_change=0.0, line_search_fn=None)

    def closure():
        opt.zero_grad()
        value = loss(params)
        value.backward()
        return value

    out = []
    for _ in range(STEPS):
        opt.step(closure)
        out.append({k: v.detach().clone() for k, v in params.items()})
    return out


@pytest.mark.parametrize(("lr", "history"), [(0.5, 3), (0.3, 10)])
def test_lbfgs_update_matches_torch_optim(lr: float, history: int) -> None:
    """hg.inner.LBFGS().update is torch.optim.LBFGS(max_iter=1, line_search_fn=None), step by step."""
    for seed in (0, 1):
        w0, loss = _problem(seed)
        ours = _ours(hg.inner.LBFGS(lr=lr, history_size=history), w0, loss)
        assert _max_diff(ours, _torch_lbfgs(lr, history, w0, loss)) < 1e-10
        assert _max_diff(ours, _ours(hg.inner.SGD(lr=lr), w0, loss)) > 1e-2  # not gradient descent


def _ridge(dtype=DT):
    gen = torch.Generator().manual_seed(0)
    X = torch.randn(40, 8, generator=gen, dtype=dtype)
    y = X @ torch.randn(8, generator=gen, dtype=dtype) + 0.1 * torch.randn(40, generator=gen, dtype=dtype)

    def g(w, lam, batch):
        return 0.5 * ((X @ w["beta"] + w["b"] - y) ** 2).mean() + 0.5 * (torch.exp(lam["log_l2"]) * w["beta"] ** 2).sum()

    def closed_form(lam):
        # [beta; b] solves the normal equations of the centred-intercept ridge problem
        A = torch.cat([X, torch.ones(40, 1, dtype=dtype)], 1)
        reg = torch.diag(torch.cat([torch.exp(lam["log_l2"]), torch.zeros(1, dtype=dtype)])) * 40
        sol = torch.linalg.solve(A.T @ A + reg, A.T @ y)
        return sol[:8], sol[8]

    lam = {"log_l2": torch.linspace(-3, 1, 8, dtype=dtype)}
    w0 = {"beta": torch.zeros(8, dtype=dtype), "b": torch.zeros((), dtype=dtype)}
    return hg.BilevelProblem(g, g), w0, lam, closed_form(lam)


def test_lbfgs_inner_solve_reaches_ridge_closed_form() -> None:
    problem, w0, lam, (beta, b) = _ridge()
    out = hg.inner_solve(problem, w0, lam, 200, hg.inner.LBFGS(), tol=1e-13)
    assert out.converged is True and out.grad_norm <= 1e-13
    assert out.steps < 40  # quasi-Newton: a few dozen steps where SGD needs thousands
    assert float((out.w["beta"] - beta).abs().max()) < 1e-10
    assert abs(float(out.w["b"] - b)) < 1e-10
    sgd = hg.inner_solve(problem, w0, lam, out.steps, hg.inner.SGD(lr=0.5), tol=1e-13)
    assert sgd.converged is False and sgd.steps == out.steps and sgd.grad_norm > 1e-6
    # the fixed-step variant (no line search) converges too on this problem
    plain = hg.inner_solve(problem, w0, lam, 200, hg.inner.LBFGS(line_search=False), tol=1e-12)
    assert plain.converged and float((plain.w["beta"] - beta).abs().max()) < 1e-10


def test_lbfgs_line_search_keeps_a_too_long_step_from_diverging() -> None:
    problem, w0, lam, (beta, _) = _ridge()
    searched = hg.inner_solve(problem, w0, lam, 100, hg.inner.LBFGS(lr=50.0), tol=1e-6)
    assert searched.converged and float((searched.w["beta"] - beta).abs().max()) < 1e-5
    with pytest.raises(hg.NonFiniteError):  # the same steps without the search blow up
        hg.inner_solve(problem, w0, lam, 300, hg.inner.LBFGS(lr=50.0, line_search=False), tol=1e-12)


def test_inner_solve_tol_stops_and_reports() -> None:
    g = lambda w, lam, b: 0.5 * ((w["x"] - lam["c"]) ** 2).sum()  # noqa: E731
    p, w0, lam = hg.BilevelProblem(g, g), {"x": torch.zeros(3, dtype=DT)}, {"c": torch.ones(3, dtype=DT)}
    out = hg.inner_solve(p, w0, lam, 1000, hg.inner.SGD(lr=0.5), tol=1e-6)
    # ‖∇g‖ = sqrt(3) 0.5^k after k steps: the first k with sqrt(3) 0.5^k <= 1e-6 is 21
    assert (out.steps, out.converged) == (21, True)
    assert out.grad_norm <= 1e-6 < math.sqrt(3) * 0.5**20
    w, state, norm = out  # still unpacks as before
    assert norm == out.grad_norm and w is out.w and state is out.state
    short = hg.inner_solve(p, w0, lam, 5, hg.inner.SGD(lr=0.5), tol=1e-6)
    assert (short.steps, short.converged) == (5, False)
    assert short.grad_norm == pytest.approx(math.sqrt(3) * 0.5**5)  # measured at the final w
    untested = hg.inner_solve(p, w0, lam, 5, hg.inner.SGD(lr=0.5))
    assert (untested.steps, untested.converged) == (5, None)
    assert torch.equal(untested.w["x"], short.w["x"])
    assert hg.inner_solve(p, w0, lam, 0, hg.inner.SGD(lr=0.5), tol=10.0).converged is True
    for bad in (-1.0, math.nan, math.inf, "1e-6", True):
        with pytest.raises(ValueError, match="tol must be None or a finite number >= 0"):
            hg.inner_solve(p, w0, lam, 5, hg.inner.SGD(lr=0.5), tol=bad)


def test_lbfgs_plain_inner_steps_of_solve_and_unrolled() -> None:
    """As solve's inner_optimizer (line search, warm state across outer steps) and inside Unrolled
    (differentiated through the fixed-step update): both give the ridge problem's hypergradient."""
    problem, w0, lam, _ = _ridge()
    gen = torch.Generator().manual_seed(1)
    X_val = torch.randn(20, 8, generator=gen, dtype=DT)
    y_val = torch.randn(20, generator=gen, dtype=DT)
    f = lambda w, lam, b: 0.5 * ((X_val @ w["beta"] + w["b"] - y_val) ** 2).mean()  # noqa: E731
    bilevel = hg.BilevelProblem(problem.inner, f)
    w_star = hg.inner_solve(bilevel, w0, lam, 200, hg.inner.LBFGS(), tol=1e-13).w
    exact = hg.Implicit(hg.linear.Dense()).hypergrad(bilevel, w_star, lam).grad["log_l2"]
    unrolled = hg.Unrolled(hg.inner.LBFGS(history_size=20, lr=0.5), steps=60).hypergrad(bilevel, w0, lam)
    assert float((unrolled.grad["log_l2"] - exact).abs().max()) < 1e-8 * float(exact.abs().max()) + 1e-12
    res = hg.solve(bilevel, w0, lam, hg.Implicit(hg.linear.Dense()), lambda p: torch.optim.SGD(p, lr=1e-9),
                   steps=2, inner_steps=30, inner_optimizer=hg.inner.LBFGS(), progress=False)
    assert res.history["inner_residual"][-1] < 1e-10
    assert set(res.state.inner_optimizer) >= {"t", "rho", "s.beta", "y.beta"}


def _adam_per_leaf(opt: hg.inner.Adam, w: dict, grad: dict, state: dict) -> tuple[dict, dict]:
    """Adam's per-leaf arithmetic (the update's form for mixed dtypes), the reference of its flat form."""
    b1, b2 = opt.betas
    t = state["t"] + 1
    new_w, new_state = {}, {"t": t}
    for k in w:
        m = state[f"m.{k}"] * b1 + grad[k] * (1 - b1)
        v = state[f"v.{k}"] * b2 + (grad[k] * (1 - b2)) * grad[k]
        new_state[f"m.{k}"], new_state[f"v.{k}"] = m, v
        m_hat, v_hat = m / (1 - b1**t), v / (1 - b2**t)
        new_w[k] = w[k] - (m_hat * opt.leaf_lr.get(k, opt.lr)) / (torch.sqrt(v_hat + opt.eps_root) + opt.eps)
    return new_w, new_state


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_adam_steps_the_leaves_as_flat_buffers_with_the_per_leaf_arithmetic(dtype) -> None:
    """Same dtype on one device: the update runs on one flat vector per tree (about fifteen operators, not that many
    per leaf), bit for bit the per-leaf numbers (a leaf's own rate included), and hands back θ and the moments as
    views of one buffer each, which the next update reads without a copy."""
    gen = torch.Generator().manual_seed(0)
    shapes = {"a": (3, 4), "b": (5,), "scale": (), "c": (2, 1, 3)}
    w = {k: torch.randn(s, generator=gen, dtype=dtype) for k, s in shapes.items()}
    opt = hg.inner.Adam(lr=1e-2, leaf_lr={"scale": 0.3})
    state, ref_w, ref_state = opt.init(w), dict(w), opt.init(w)
    for _ in range(5):
        grad = {k: torch.randn(s, generator=gen, dtype=dtype) for k, s in shapes.items()}
        w, state = opt.update(w, grad, state)
        ref_w, ref_state = _adam_per_leaf(opt, ref_w, grad, ref_state)
        for k in shapes:
            assert w[k].shape == shapes[k] and torch.equal(w[k], ref_w[k]), k
            assert torch.equal(state[f"m.{k}"], ref_state[f"m.{k}"]) and torch.equal(state[f"v.{k}"], ref_state[f"v.{k}"])
        for tree in (w, {k: state[f"m.{k}"] for k in shapes}, {k: state[f"v.{k}"] for k in shapes}):
            assert len({x.untyped_storage().data_ptr() for x in tree.values()}) == 1  # one buffer
    with torch.profiler.profile() as prof:
        opt.update(w, grad, state)
    assert sum(e.name.startswith("aten::") for e in prof.events()) < 60  # per leaf (_foreach on a CPU): ~200
