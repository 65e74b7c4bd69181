"""benchmarks/hypergrad_benchopt.py: its pure pieces, without jax, benchopt or a benchmark checkout.

The exact ‖∇F‖² against autograd through the closed-form inner solution, the torch loss against
the averaged quadratic, the time-to-target extraction, the targets and the report. The run against
a real benchmark_bilevel checkout needs jax and benchopt (the bench extra) and is skipped without
them and without ``BENCHMARK_BILEVEL_DIR``.
"""

from __future__ import annotations

import os
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import torch
from _benchmarks import load_benchmark
from hypothesis import given, settings
from hypothesis import strategies as st

import hypergrad as hg


@pytest.fixture(scope="module")
def hb():
    return load_benchmark("hypergrad_benchopt")


def random_quadratics(hb, seed: int, d_in: int = 6, d_out: int = 3):
    """Two quadratics with non-symmetric matrices (only their symmetric parts should act) and an
    inner Hessian that is positive definite."""
    rng = np.random.default_rng(seed)

    def quad(spd: bool):
        m = rng.standard_normal((d_in, d_in))
        hess_inner = m @ m.T + d_in * np.eye(d_in) if spd else m
        hess_inner = hess_inner + np.triu(rng.standard_normal((d_in, d_in)), 1) * 0.3  # not symmetric
        return hb.Quadratic(hess_inner, rng.standard_normal((d_out, d_out)), rng.standard_normal((d_out, d_in)),
                            rng.standard_normal(d_in), rng.standard_normal(d_out))

    return quad(True), quad(False), rng.standard_normal(d_out)


def autograd_grad_sq_norm(inner, outer, x: np.ndarray) -> float:
    """‖∇F‖² by autograd of F(x) = f(y*(x), x) with y*(x) solved in closed form (float64)."""
    def as_t(a: np.ndarray) -> torch.Tensor:
        return torch.tensor(a, dtype=torch.float64)

    def value(q, y, x_):
        return (0.5 * y @ as_t(q.hess_inner) @ y + 0.5 * x_ @ as_t(q.hess_outer) @ x_ + x_ @ as_t(q.cross) @ y
                + as_t(q.linear_inner) @ y + as_t(q.linear_outer) @ x_)

    x_t = as_t(x).requires_grad_(True)
    h = as_t(inner.hess_inner)
    y_star = torch.linalg.solve(0.5 * (h + h.T), -(as_t(inner.linear_inner) + as_t(inner.cross).T @ x_t))
    (grad,) = torch.autograd.grad(value(outer, y_star, x_t), x_t)
    return float(grad @ grad)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_exact_grad_sq_norm_matches_autograd(hb, seed: int) -> None:
    inner, outer, x = random_quadratics(hb, seed)
    assert hb.exact_grad_sq_norm(inner, outer, x) == pytest.approx(autograd_grad_sq_norm(inner, outer, x),
                                                                   rel=1e-10)


@settings(max_examples=15, deadline=2000)
@given(seed=st.integers(0, 10_000), d_in=st.integers(1, 8), d_out=st.integers(1, 5))
def test_exact_grad_sq_norm_property(hb, seed: int, d_in: int, d_out: int) -> None:
    inner, outer, x = random_quadratics(hb, seed, d_in, d_out)
    expected = autograd_grad_sq_norm(inner, outer, x)
    assert hb.exact_grad_sq_norm(inner, outer, x) == pytest.approx(expected, rel=1e-9, abs=1e-12)


def test_exact_grad_vanishes_at_the_bilevel_solution(hb) -> None:
    """Solve the stationarity condition (linear in x) and check ‖∇F‖² is round-off there."""
    inner, outer, x0 = random_quadratics(hb, 5)
    d_out = x0.shape[0]
    # ∇F is affine in x: recover it from d_out + 1 evaluations of the hand formula's gradient
    h = 0.5 * (inner.hess_inner + inner.hess_inner.T)

    def grad(x):
        y = np.linalg.solve(h, -(inner.linear_inner + inner.cross.T @ x))
        return outer.grad_outer_var(y, x) + inner.cross @ np.linalg.solve(h, -outer.grad_inner_var(y, x))

    g0 = grad(np.zeros(d_out))
    jac = np.stack([grad(e) - g0 for e in np.eye(d_out)], axis=1)
    x_star = np.linalg.solve(jac, -g0)
    assert hb.exact_grad_sq_norm(inner, outer, x_star) < 1e-18 * max(1.0, float(g0 @ g0))
    assert hb.exact_grad_sq_norm(inner, outer, x_star + 0.1) > 1e-6


def test_torch_loss_is_the_averaged_quadratic(hb) -> None:
    """The mean of per-sample quadratics (the benchmark's batched_quadratic, in torch) has the
    gradients of the quadratic with the averaged matrices, which the exact ‖∇F‖² uses."""
    rng = np.random.default_rng(3)
    n, d_in, d_out = 7, 5, 3
    samples = (rng.standard_normal((n, d_in, d_in)), rng.standard_normal((n, d_out, d_out)),
               rng.standard_normal((n, d_out, d_in)), rng.standard_normal((n, d_in)), rng.standard_normal((n, d_out)))
    avg = hb.Quadratic(*(a.mean(axis=0) for a in samples))
    y, x = rng.standard_normal(d_in), rng.standard_normal(d_out)
    w = {"y": torch.tensor(y, requires_grad=True)}
    lam = {"x": torch.tensor(x, requires_grad=True)}
    loss = hb.quadratic_loss(w, lam, tuple(torch.tensor(a) for a in samples))
    gy, gx = torch.autograd.grad(loss, (w["y"], lam["x"]))
    np.testing.assert_allclose(gy.numpy(), avg.grad_inner_var(y, x), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(gx.numpy(), avg.grad_outer_var(y, x), rtol=1e-12, atol=1e-12)


def make_traj(hb, times, values, per_it: int = 3, every: int = 2, name: str = "s"):
    traj = hb.Trajectory(name, "lib", "")
    for k, (t, v) in enumerate(zip(times, values, strict=True)):
        traj.record(t, k * every, per_it, v)
    return traj


def test_time_to_target_is_the_first_crossing(hb) -> None:
    traj = make_traj(hb, [0.0, 1.0, 2.0, 3.0, 4.0], [10.0, 1.0, 0.01, 0.005, 0.02])
    # threshold 1e-3 * 10 = 0.01: reached (<=) at the third evaluation, iteration 4, 4 * 3 oracle calls
    assert hb.time_to_target(traj) == (2.0, 12, 4)
    assert hb.time_to_target(traj, fraction=1e-4) is None
    assert hb.time_to_target(traj, fraction=1.0) == (0.0, 0, 0)


def test_time_to_target_never_counts_a_diverged_run(hb) -> None:
    traj = make_traj(hb, [0.0, 1.0, 2.0], [10.0, float("nan"), 0.0])
    assert hb.time_to_target(traj) is None


@pytest.mark.parametrize("fraction", [0.0, -1.0, 1.5, float("nan")])
def test_time_to_target_rejects_bad_fraction(hb, fraction: float) -> None:
    with pytest.raises(ValueError, match="fraction must be in"):
        hb.time_to_target(make_traj(hb, [0.0], [1.0]), fraction=fraction)


def test_time_to_target_rejects_empty_trajectory(hb) -> None:
    with pytest.raises(ValueError, match="no evaluations"):
        hb.time_to_target(hb.Trajectory("s", "lib", ""))


def test_seconds_per_iteration(hb) -> None:
    traj = make_traj(hb, [0.0, 1.0, 3.0], [1.0, 1.0, 1.0], every=10)
    assert traj.seconds_per_iteration() == pytest.approx(3.0 / 20)
    assert hb.Trajectory("s", "lib", "").seconds_per_iteration() is None


def comparisons(hb):
    fast = make_traj(hb, [0, 1, 2], [10, 1, 0.001], name="mine")  # reaches at t=2
    slow = make_traj(hb, [0, 3, 5], [10, 1, 0.001], name="theirs")  # reaches at t=5
    never = make_traj(hb, [0, 4, 8], [10, 5, 2], name="never")
    return fast, slow, never


def test_targets_ratio_bound_and_miss(hb) -> None:
    fast, slow, never = comparisons(hb)
    checks = hb.target_checks([
        hb.Comparison("A", fast, slow),  # ratio 2/5 = 0.4: met
        hb.Comparison("B", fast, never),  # only hypergrad reached: bound 2/8 = 0.25, met
        hb.Comparison("C", never, slow),  # hypergrad never reached: missed
        hb.Comparison("D", slow, slow),  # ratio 1: missed; not the fastest of either library
    ])
    by_name = {c.name.split(":")[0]: c for c in checks}
    assert by_name["A"].measured == pytest.approx(0.4) and by_name["A"].met
    assert by_name["B"].measured == pytest.approx(0.25) and by_name["B"].met and "upper bound" in by_name["B"].detail
    assert by_name["C"].measured is None and not by_name["C"].met
    assert by_name["D"].measured == pytest.approx(1.0) and not by_name["D"].met
    fastest = by_name["fastest hypergrad <= 0.5x fastest benchmark"]
    assert fastest.measured == pytest.approx(2 / 5) and fastest.met


def test_targets_slower_hypergrad_is_missed(hb) -> None:
    fast, slow, _ = comparisons(hb)
    (pair, fastest) = hb.target_checks([hb.Comparison("A", slow, fast)])
    assert pair.measured == pytest.approx(2.5) and not pair.met
    assert fastest.measured == pytest.approx(2.5) and not fastest.met


def test_targets_cheap_bome_per_iteration(hb) -> None:
    fast, slow, _ = comparisons(hb)
    rounds = {"iterations": 50, "hypergrad_ms": [3.0, 5.0, 4.0], "benchmark_ms": [1.0, 2.0, 1.0],
              "ratios": [3.0, 2.5, 4.0]}
    checks = hb.target_checks([hb.Comparison("BOME (averaged)", fast, slow)], bome_rounds=rounds)
    bome = checks[-1]
    assert bome.name.startswith("BOME (averaged): time per iteration")
    assert bome.measured == pytest.approx(3.0) and not bome.met  # the median ratio, limit 2
    # without rounds: the two trajectories' mean time per iteration (2/4 vs 5/4 s)
    bome = hb.target_checks([hb.Comparison("BOME (averaged)", fast, slow)])[-1]
    assert bome.measured == pytest.approx(0.4) and bome.met


def test_report_renders_tables_and_targets(hb) -> None:
    fast, slow, never = comparisons(hb)
    comps = [hb.Comparison("F2SA", fast, slow, note="a note"), hb.Comparison("BOME (full)", never, slow)]
    meta = {"command": "python benchmarks/hypergrad_benchopt.py --quick", "date": "2026-01-01 00:00",
            "cpu": "cpu-model", "cores": "2", "load_before": "1.0 1.0 1.0", "load_after": "2.0 2.0 2.0",
            "versions": "torch x", "initial_value": 10.0, "notes": ["single thread"]}
    text = hb.render_report(meta, comps, hb.target_checks(comps))
    for needle in ("## F2SA", "## BOME (full)", "a note", "cpu-model", "1.0 1.0 1.0", "single thread",
                   "--quick", "| lib | mine |", "hypergrad / benchmark time to target: 0.4", "MISSED", "| met |"):
        assert needle in text, needle
    # the row of the run that reached the target: time 2, 2 * 2 iterations * 3 oracle calls
    assert "| lib | mine |  | 2 | 12 | 4 | 0.001 | 4 |" in text


def test_with_compile_only_where_the_method_has_it(hb) -> None:
    assert hb.with_compile(hg.Implicit, True).compile is True
    assert hb.with_compile(hg.Implicit, False).compile is False
    assert hb.with_compile(hg.SOBA, True, step_size=0.1).compile is True
    fd = hb.with_compile(hg.FiniteDifference, True, eps=0.1)  # no compile field: left out
    assert not hasattr(fd, "compile") and fd.eps == 0.1


def test_batch_stream_covers_each_epoch_once(hb) -> None:
    samples = (torch.arange(10.0), torch.arange(10.0) * 2)
    stream = hb._batch_stream(samples, batch_size=4, seed=0)
    for _ in range(2):  # two epochs of three batches (4, 4, 2 samples), each a contiguous block
        epoch = [next(stream) for _ in range(3)]
        seen = torch.cat([b[0] for b in epoch]).sort().values
        assert torch.equal(seen, torch.arange(10.0))
        for b in epoch:
            assert torch.equal(b[1], b[0] * 2) and torch.equal(b[0], torch.arange(b[0][0], b[0][0] + len(b[0])))


def test_benchmark_dir_must_be_a_checkout(hb, tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match=r"git clone https://github\.com/benchopt/benchmark_bilevel"):
        hb.Benchmark(tmp_path)


def test_same_instance_as_the_benchmark(hb) -> None:
    """The torch loss equals the benchmark's jax f_inner / f_outer on its own generated instance."""
    pytest.importorskip("jax", reason="needs the bench extra (make setup-bench)")
    pytest.importorskip("benchopt", reason="needs the bench extra (make setup-bench)")
    directory = os.environ.get("BENCHMARK_BILEVEL_DIR")
    if not directory:
        pytest.skip("set BENCHMARK_BILEVEL_DIR to a checkout of https://github.com/benchopt/benchmark_bilevel")
    instance = hb.build_instance(hb.Benchmark(Path(directory)), {"n_samples_inner": 128, "n_samples_outer": 64,
                                                                 "dim_inner": 10, "dim_outer": 3})
    assert hb.check_same_instance(instance, batch_size=64) < 1e-5
    assert instance.grad_sq_norm(instance.objective["outer_var0"]) > 0


@pytest.mark.parametrize("method", ["penalty", "bome"])
def test_benchopt_solver_runs_hypergrad_in_the_benchmark(hb, method: str) -> None:
    """benchmarks/benchopt_hypergrad_solver.py on the benchmark's own objective lowers ‖∇F‖²."""
    pytest.importorskip("jax", reason="needs the bench extra (make setup-bench)")
    pytest.importorskip("benchopt", reason="needs the bench extra (make setup-bench)")
    directory = os.environ.get("BENCHMARK_BILEVEL_DIR")
    if not directory:
        pytest.skip("set BENCHMARK_BILEVEL_DIR to a checkout of https://github.com/benchopt/benchmark_bilevel")
    instance = hb.build_instance(hb.Benchmark(Path(directory)), {"n_samples_inner": 256, "n_samples_outer": 128,
                                                                 "dim_inner": 10, "dim_outer": 3})
    module = load_benchmark("benchopt_hypergrad_solver")
    solver = module.Solver.get_instance(method=method, eval_freq=8, n_inner_steps=10 if method == "bome" else 1)
    solver.set_objective(**instance.objective)
    calls = []

    def callback() -> bool:
        calls.append(instance.grad_sq_norm(solver.get_result()["outer_var"]))
        return len(calls) <= 25

    solver.run(callback)
    assert calls[-1] < 0.2 * calls[0], calls


def test_thinned_keeps_ends_and_the_target_point(hb) -> None:
    values = [10.0] * 500 + [0.005] + [0.001] * 499  # the target (0.01) is first reached at index 500
    traj = make_traj(hb, [float(i) for i in range(1000)], values)
    thin = hb.thinned(traj, max_points=50)
    assert len(thin.values) <= 52 and thin.times[0] == 0.0 and thin.times[-1] == 999.0
    assert hb.time_to_target(thin) == hb.time_to_target(traj) == (500.0, 3000, 1000)
    assert hb.thinned(traj, max_points=2000) is traj


# ------------------------------------------------------------------ SRBA against the benchmark's step


SRBA_SETUP = {"n_inner": 64, "n_outer": 32, "batch_size": 8, "dim_inner": 5, "dim_outer": 3, "step_size": 0.2,
              "outer_ratio": 2.0, "period_frac": 0.5, "steps": 60}


def srba_samples(seed: int = 0) -> tuple[tuple[np.ndarray, ...], tuple[np.ndarray, ...], np.ndarray, np.ndarray]:
    """Per-sample quadratics (inner, outer; float64, the benchmark's field order) and a start point.

    Inner Hessians are positive definite per sample (eigenvalues in [0.3, 1.3]) and not symmetric
    (only their symmetric part acts); cross terms are large enough that the outer variable moves.
    """
    rng = np.random.default_rng(seed)
    d_in, d_out = SRBA_SETUP["dim_inner"], SRBA_SETUP["dim_outer"]

    def side(n: int) -> tuple[np.ndarray, ...]:
        basis = np.linalg.qr(rng.standard_normal((n, d_in, d_in)))[0]
        spectrum = rng.uniform(0.3, 1.3, (n, d_in))
        hess_inner = np.einsum("nij,nj,nkj->nik", basis, spectrum, basis)
        hess_inner = hess_inner + 0.2 * np.triu(rng.standard_normal((n, d_in, d_in)), 1)
        hess_outer = 0.5 * rng.standard_normal((n, d_out, d_out)) + np.eye(d_out)
        cross = 0.5 * rng.standard_normal((n, d_out, d_in))
        return hess_inner, hess_outer, cross, rng.standard_normal((n, d_in)), rng.standard_normal((n, d_out))

    return side(SRBA_SETUP["n_inner"]), side(SRBA_SETUP["n_outer"]), rng.standard_normal(d_in), rng.standard_normal(d_out)


def srba_period() -> int:
    """The benchmark's ``period``: ``int((n_inner + n_outer) * period_frac / batch_size)``."""
    s = SRBA_SETUP
    return int((s["n_inner"] + s["n_outer"]) * s["period_frac"] / s["batch_size"])


def benchmark_srba_numpy(hb, inner: tuple[np.ndarray, ...], outer: tuple[np.ndarray, ...], y0: np.ndarray,
                         x0: np.ndarray, inner_starts: list[int], outer_starts: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """benchmark_bilevel's ``solvers/srba.py`` (commit 3ad65dc), step for step in numpy float64.

    Its ``srba_one_iter``: at ``i % period == 0`` the full-batch directions (``fb_directions``, no
    batch drawn), otherwise ``d += phi(batch, now) - phi(batch, old)`` (``srba_directions``, one
    inner and one outer start drawn); then ``old = now`` and the three steps with the constant
    steps ``step_size`` and ``step_size / outer_ratio``. It carries ``v`` with the sign opposite to
    hypergrad's (``d_v = H v + grad_y f``, ``d_outer = C v + grad_x f``). Returns the inner and
    outer iterates after every step, stacked.
    """
    s = SRBA_SETUP
    b = s["batch_size"]
    period = srba_period()

    def averaged(samples, start, size):
        return hb.Quadratic(*(a[start:start + size].mean(axis=0) for a in samples))

    def directions(q_in, q_out, y, x, v):
        h = 0.5 * (q_in.hess_inner + q_in.hess_inner.T)  # the vjp of grad_y g against v: H^T v = sym(H) v
        return (q_in.grad_inner_var(y, x), h @ v + q_out.grad_inner_var(y, x), q_in.cross @ v + q_out.grad_outer_var(y, x))

    inner_lr, outer_lr = s["step_size"], s["step_size"] / s["outer_ratio"]
    y, x, v = y0.copy(), x0.copy(), np.zeros_like(y0)
    y_old, x_old, v_old = y.copy(), x.copy(), v.copy()
    d_inner, d_v, d_outer = np.zeros_like(y), np.zeros_like(y), np.zeros_like(x)
    starts_in, starts_out = iter(inner_starts), iter(outer_starts)
    ys, xs = [], []
    for i in range(s["steps"]):
        if i % period == 0:
            d_inner, d_v, d_outer = directions(averaged(inner, 0, s["n_inner"]), averaged(outer, 0, s["n_outer"]), y, x, v)
        else:
            q_in, q_out = averaged(inner, next(starts_in), b), averaged(outer, next(starts_out), b)
            now, old = directions(q_in, q_out, y, x, v), directions(q_in, q_out, y_old, x_old, v_old)
            d_inner = d_inner + (now[0] - old[0])
            d_v = d_v + (now[1] - old[1])
            d_outer = d_outer + (now[2] - old[2])
        y_old, v_old, x_old = y.copy(), v.copy(), x.copy()
        y, v, x = y - inner_lr * d_inner, v - inner_lr * d_v, x - outer_lr * d_outer
        ys.append(y)
        xs.append(x)
    return np.stack(ys), np.stack(xs)


def hypergrad_srba(hb, inner: tuple[np.ndarray, ...], outer: tuple[np.ndarray, ...], y0: np.ndarray, x0: np.ndarray,
                   inner_starts: list[int], outer_starts: list[int], full_batches: str = "whole") -> tuple[np.ndarray, np.ndarray]:
    """``hg.SRBA`` through ``hg.solve`` on the same batch sequence, mapped as its docstring says.

    ``full_batches="whole"``: the restart reads one batch holding every sample (the benchmark's
    full-batch call); ``"partition"``: the list of the contiguous batches (their mean loss is the
    same full loss). At a restart step ``hg.solve`` hands SRBA a batch it does not read.
    """
    s = SRBA_SETUP
    b, period = s["batch_size"], srba_period()
    inner_t = tuple(torch.from_numpy(a) for a in inner)
    outer_t = tuple(torch.from_numpy(a) for a in outer)

    def batch(samples, start):
        return tuple(a[start:start + b] for a in samples)

    if full_batches == "whole":
        full_inner, full_outer = [inner_t], [outer_t]
    else:
        full_inner = [batch(inner_t, k) for k in range(0, s["n_inner"], b)]
        full_outer = [batch(outer_t, k) for k in range(0, s["n_outer"], b)]
    starts_in, starts_out = iter(inner_starts), iter(outer_starts)
    inner_batches, outer_batches = [], []
    for i in range(s["steps"]):
        restart = i % period == 0
        inner_batches.append(inner_t if restart else batch(inner_t, next(starts_in)))
        outer_batches.append(outer_t if restart else batch(outer_t, next(starts_out)))
    method = hg.SRBA(s["step_size"], period, full_inner_batches=full_inner, full_outer_batches=full_outer)
    ys, xs = [], []

    def record(step, w, lam, result):
        ys.append(w["y"].numpy().copy())
        xs.append(lam["x"].numpy().copy())

    problem = hg.BilevelProblem(inner=hb.quadratic_loss, outer=hb.quadratic_loss)
    hg.solve(problem, {"y": torch.from_numpy(y0.copy())}, {"x": torch.from_numpy(x0.copy())}, method,
             lambda p: torch.optim.SGD(p, lr=s["step_size"] / s["outer_ratio"]), steps=s["steps"], inner_steps=0,
             inner_batches=inner_batches, outer_batches=outer_batches, progress=False, outer_loss_every=0,
             callback=record)
    return np.stack(ys), np.stack(xs)


def shuffled_starts(n: int, count: int, seed: int) -> list[int]:
    """Contiguous batch starts, every epoch in a new random order (the benchmark's sampler)."""
    b = SRBA_SETUP["batch_size"]
    rng = np.random.default_rng(seed)
    out: list[int] = []
    while len(out) < count:
        out.extend(int(k) * b for k in rng.permutation(n // b))
    return out[:count]


@pytest.mark.parametrize("full_batches", ["whole", "partition"])
def test_srba_matches_the_benchmark_step_in_numpy(hb, full_batches: str) -> None:
    """60 steps of hg.SRBA equal the benchmark's SRBA step (transcribed to numpy) on one batch sequence."""
    inner, outer, y0, x0 = srba_samples(0)
    steps = SRBA_SETUP["steps"]
    inner_starts = shuffled_starts(SRBA_SETUP["n_inner"], steps, 1)
    outer_starts = shuffled_starts(SRBA_SETUP["n_outer"], steps, 2)
    ys_ref, xs_ref = benchmark_srba_numpy(hb, inner, outer, y0, x0, inner_starts, outer_starts)
    ys, xs = hypergrad_srba(hb, inner, outer, y0, x0, inner_starts, outer_starts, full_batches)
    assert np.abs(xs_ref[-1] - x0).max() > 0.1, "the outer variable hardly moves: the test would see nothing"
    assert max(np.abs(ys - ys_ref).max(), np.abs(xs - xs_ref).max()) <= 1e-12


def benchmark_srba_jax(directory: Path, inner: tuple[np.ndarray, ...], outer: tuple[np.ndarray, ...], y0: np.ndarray,
                       x0: np.ndarray) -> tuple[np.ndarray, np.ndarray, list[int], list[int]]:
    """The benchmark's own SRBA (``solvers/srba.py``: ``init`` and the step of ``get_step``) on its
    own losses (``datasets/simulated.py``'s ``get_function``) and samplers, in float64.

    Returns the inner and outer iterates after every step and the batch starts its samplers drew
    (replayed with the same sampler functions: the step draws only between restarts).
    """
    import jax

    s = SRBA_SETUP
    bench = load_benchmark("hypergrad_benchopt").Benchmark(directory)  # puts the checkout on sys.path
    from benchmark_utils.minibatch_sampler import init_sampler

    f_inner = bench.simulated.get_function(*(jax.numpy.asarray(a) for a in inner))
    f_outer = bench.simulated.get_function(*(jax.numpy.asarray(a) for a in outer))
    solver = bench.solver_class("srba.py").get_instance(step_size=s["step_size"], outer_ratio=s["outer_ratio"],
                                                        batch_size=s["batch_size"], period_frac=s["period_frac"])
    # what StochasticJaxSolver.set_objective sets, without its warm-up run
    solver.f_inner = partial(f_inner, batch_size=s["batch_size"])
    solver.f_outer = partial(f_outer, batch_size=s["batch_size"])
    solver.n_inner_samples, solver.n_outer_samples = s["n_inner"], s["n_outer"]
    keys = jax.random.split(jax.random.PRNGKey(0), 2)
    inner_sampler, solver.state_inner_sampler = init_sampler(n_samples=s["n_inner"], batch_size=s["batch_size"],
                                                             key=keys[0])
    outer_sampler, solver.state_outer_sampler = init_sampler(n_samples=s["n_outer"], batch_size=s["batch_size"],
                                                             key=keys[1])
    solver.inner_var0, solver.outer_var0 = jax.numpy.asarray(y0), jax.numpy.asarray(x0)
    carry = solver.init()
    assert solver.period == srba_period()
    step = jax.jit(solver.get_step(inner_sampler, outer_sampler))
    ys, xs = [], []
    for i in range(s["steps"]):
        carry, _ = step(carry, i)
        ys.append(np.asarray(carry["inner_var"]))
        xs.append(np.asarray(carry["outer_var"]))
    # the starts the step drew: the same sampler functions from the same states, one draw per non-restart step
    starts_in, starts_out = [], []
    state_in = init_sampler(n_samples=s["n_inner"], batch_size=s["batch_size"], key=keys[0])[1]
    state_out = init_sampler(n_samples=s["n_outer"], batch_size=s["batch_size"], key=keys[1])[1]
    for i in range(s["steps"]):
        if i % solver.period:
            start, *_, state_in = inner_sampler(state_in)
            starts_in.append(int(start))
            start, *_, state_out = outer_sampler(state_out)
            starts_out.append(int(start))
    return np.stack(ys), np.stack(xs), starts_in, starts_out


def test_srba_matches_the_benchmark_solver(hb) -> None:
    """hg.SRBA equals benchmark_bilevel's own jax SRBA step (its solvers/srba.py) over 60 steps in float64.

    Needs the bench extra (jax, benchopt) and ``BENCHMARK_BILEVEL_DIR``; measured 3e-16 (commit 3ad65dc).
    """
    pytest.importorskip("jax", reason="needs the bench extra (make setup-bench)")
    pytest.importorskip("benchopt", reason="needs the bench extra (make setup-bench)")
    directory = os.environ.get("BENCHMARK_BILEVEL_DIR")
    if not directory:
        pytest.skip("set BENCHMARK_BILEVEL_DIR to a checkout of https://github.com/benchopt/benchmark_bilevel")
    import jax

    inner, outer, y0, x0 = srba_samples(0)
    previous = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)
    try:
        ys_ref, xs_ref, starts_in, starts_out = benchmark_srba_jax(Path(directory), inner, outer, y0, x0)
    finally:
        jax.config.update("jax_enable_x64", previous)
    assert ys_ref.dtype == np.float64 and len(set(starts_in)) > 1
    ys, xs = hypergrad_srba(hb, inner, outer, y0, x0, starts_in, starts_out)
    difference = max(np.abs(ys - ys_ref).max(), np.abs(xs - xs_ref).max())
    print(f"hg.SRBA vs benchmark_bilevel's SRBA, {SRBA_SETUP['steps']} steps, float64: max |difference| {difference:.1e}")
    assert np.abs(xs_ref[-1] - x0).max() > 0.1
    assert difference <= 1e-12
