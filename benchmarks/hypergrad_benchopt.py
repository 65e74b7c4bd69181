"""hypergrad's solvers against benchmark_bilevel's own implementations, on its quadratic problem.

The benchopt benchmark `benchmark_bilevel <https://github.com/benchopt/benchmark_bilevel>`_ ships
JAX implementations of stochastic and deterministic bilevel solvers and a simulated quadratic
problem. This script builds that problem with the benchmark's own generator
(``datasets/simulated.py``, ``benchmark_utils/gen_matrices.py``) and initial point
(``objective.py``), runs the benchmark's solvers (``solvers/*.py``) through their own
``set_objective`` / ``run(callback)`` and hypergrad's methods through :func:`hypergrad.solve` on
the same instance, batch sizes and step sizes, and reports per algorithm:

* compute time and oracle calls until ‖∇F(x)‖² ≤ 1e-3 × its value at the initial point,
* the final ‖∇F‖² and the ratio hypergrad / benchmark.

‖∇F‖² is computed exactly, as the benchmark's objective does (solve for y*(x) and the adjoint with
the averaged matrices), in float64 outside the timed region, for both libraries' iterates.

Clocks: the time between two evaluations only, like benchopt's callback clock, but the JAX iterates
are waited for (``jax.block_until_ready``) before the clock is read (benchopt's clock reads before
JAX finishes its asynchronous dispatch). Compilation is excluded: the benchmark's solvers warm up
in ``set_objective`` (``run_once``) and any compilation left inside the timed region (measured by
``jax.monitoring``'s compile events) is subtracted and reported; hypergrad runs two warm-up steps.
Every library runs on one thread (``torch.set_num_threads(1)``, XLA single-threaded Eigen and one
intra-op thread).

Setup::

    make setup-bench                                                   # jax, jaxopt, benchopt
    git clone https://github.com/benchopt/benchmark_bilevel /path/to/benchmark_bilevel
    python benchmarks/hypergrad_benchopt.py --benchmark-dir /path/to/benchmark_bilevel [--quick]

``--quick`` (a smoke run, about 2 min of CPU) uses a smaller instance, 1.5 s budgets and leaves out
the full-batch BOME (the benchmark's jax BOME compiles every sample into its program); the default
run uses the
benchmark's instance of ``config/quadratics_021424*.yml`` (32768 inner and 1024 outer samples,
dimensions 100 and 10). ``--compile`` passes ``compile=True`` to the hypergrad methods that accept
it. Results go to ``benchmarks/results/hypergrad_benchopt.md`` and ``.json``.
"""

from __future__ import annotations

import os

THREAD_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "NUMBA_NUM_THREADS")
if __name__ == "__main__":
    # One thread for numpy's BLAS too, set before numpy starts its pool: on a loaded machine the
    # idle BLAS threads of the (untimed) float64 evaluation spin and steal the timed solvers' core
    # (measured: 150 ms per 100x100 solve at load 8 on 2 cores).
    for _name in THREAD_ENV:
        os.environ[_name] = "1"

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import datetime  # noqa: E402
import importlib.util  # noqa: E402
import inspect  # noqa: E402
import itertools  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable, Iterator  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402
from harness.report import load_average, machine_info  # noqa: E402

TARGET_FRACTION = 1e-3
BATCH_SIZE = 64  # every stochastic solver of config/quadratics_021424*.yml
RESULTS_DIR = Path(__file__).resolve().parent / "results"
REPORT_NAME = "hypergrad_benchopt"


# --------------------------------------------------------------------------------------------
# Pure pieces (numpy only): the exact ‖∇F‖², trajectories, targets, the report.
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Quadratic:
    """The averaged quadratic ``0.5 y'Hy + 0.5 x'Ax + x'Cy + b'y + c'x`` of the benchmark.

    ``y`` is the inner variable (``dim_inner``), ``x`` the outer one (``dim_outer``); the names
    follow ``datasets/simulated.py``: ``hess_inner`` H, ``hess_outer`` A, ``cross`` C
    (``dim_outer x dim_inner``), ``linear_inner`` b, ``linear_outer`` c.
    """

    hess_inner: np.ndarray
    hess_outer: np.ndarray
    cross: np.ndarray
    linear_inner: np.ndarray
    linear_outer: np.ndarray

    def grad_inner_var(self, y: np.ndarray, x: np.ndarray) -> np.ndarray:
        """∂/∂y of the quadratic (H need not be symmetric: its symmetric part acts)."""
        h = 0.5 * (self.hess_inner + self.hess_inner.T)
        return h @ y + self.cross.T @ x + self.linear_inner

    def grad_outer_var(self, y: np.ndarray, x: np.ndarray) -> np.ndarray:
        """∂/∂x of the quadratic."""
        a = 0.5 * (self.hess_outer + self.hess_outer.T)
        return a @ x + self.cross @ y + self.linear_outer


def exact_grad_sq_norm(inner: Quadratic, outer: Quadratic, x: np.ndarray) -> float:
    """‖∇F(x)‖² of ``F(x) = f(y*(x), x)``, ``y*(x) = argmin_y g(y, x)``, in float64.

    The benchmark's ``metrics``: ``y* = -H_g⁻¹ (b_g + C_gᵀ x)``, adjoint ``v = -H_g⁻¹ ∇_y f(y*, x)``,
    ``∇F = ∇_x f(y*, x) + C_g v``.
    """
    x = np.asarray(x, dtype=np.float64).reshape(-1)
    h = 0.5 * (inner.hess_inner + inner.hess_inner.T)
    y_star = np.linalg.solve(h, -(inner.linear_inner + inner.cross.T @ x))
    v = np.linalg.solve(h, -outer.grad_inner_var(y_star, x))
    grad = outer.grad_outer_var(y_star, x) + inner.cross @ v
    return float(grad @ grad)


@dataclass
class Trajectory:
    """One solver's evaluations: compute time (s), oracle calls, iterations and ‖∇F‖²."""

    solver: str
    library: str
    settings: str
    times: list[float] = field(default_factory=list)
    oracle_calls: list[int] = field(default_factory=list)
    iterations: list[int] = field(default_factory=list)
    values: list[float] = field(default_factory=list)
    compile_s: float = 0.0
    stopped: str = ""

    def record(self, time_s: float, iteration: int, oracles_per_iteration: int, value: float) -> None:
        """Append one evaluation."""
        self.times.append(float(time_s))
        self.iterations.append(int(iteration))
        self.oracle_calls.append(int(iteration) * int(oracles_per_iteration))
        self.values.append(float(value))

    def seconds_per_iteration(self) -> float | None:
        """Mean compute time per iteration over the whole run (None before any iteration)."""
        if not self.iterations or self.iterations[-1] == 0:
            return None
        return self.times[-1] / self.iterations[-1]


def time_to_target(traj: Trajectory, fraction: float = TARGET_FRACTION) -> tuple[float, int, int] | None:
    """The first evaluation with ‖∇F‖² ≤ ``fraction`` × the initial value.

    Returns ``(time_s, oracle_calls, iterations)`` there, or None when no evaluation reached it
    (or a value is not finite before it: a diverged run never counts as reaching the target).

    Raises:
        ValueError: ``fraction`` is not in (0, 1], or the trajectory is empty.
    """
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"fraction must be in (0, 1], got {fraction!r}")
    if not traj.values:
        raise ValueError(f"trajectory of {traj.solver!r} has no evaluations")
    threshold = fraction * traj.values[0]
    for t, calls, it, value in zip(traj.times, traj.oracle_calls, traj.iterations, traj.values, strict=True):
        if not np.isfinite(value):
            return None
        if value <= threshold:
            return t, calls, it
    return None


def thinned(traj: Trajectory, max_points: int = 200) -> Trajectory:
    """At most about ``max_points`` evaluations, evenly spaced, always keeping the first, the last
    and the one that reached the target (for the raw-numbers file)."""
    n = len(traj.values)
    if n <= max_points:
        return traj
    keep = set(np.linspace(0, n - 1, max_points).round().astype(int).tolist()) | {0, n - 1}
    hit = time_to_target(traj)
    if hit is not None:
        keep.add(traj.times.index(hit[0]))
    idx = sorted(keep)
    return dataclasses.replace(traj, times=[traj.times[i] for i in idx],
                               oracle_calls=[traj.oracle_calls[i] for i in idx],
                               iterations=[traj.iterations[i] for i in idx], values=[traj.values[i] for i in idx])


@dataclass
class Comparison:
    """One algorithm run by both libraries."""

    algorithm: str
    hypergrad: Trajectory
    benchmark: Trajectory | None
    note: str = ""

    def time_ratio(self) -> float | None:
        """hypergrad / benchmark time to target (None unless both reached it)."""
        if self.benchmark is None:
            return None
        mine, theirs = time_to_target(self.hypergrad), time_to_target(self.benchmark)
        if mine is None or theirs is None or theirs[0] <= 0:
            return None
        return mine[0] / theirs[0]


@dataclass
class TargetCheck:
    """One of the issue's targets: what was measured against which limit."""

    name: str
    measured: float | None
    limit: float
    met: bool
    detail: str


def _bound_ratio(mine: Trajectory, theirs: Trajectory) -> tuple[float | None, bool, str]:
    """Time ratio at the target; when only hypergrad reached it, an upper bound from the budget."""
    hit_mine, hit_theirs = time_to_target(mine), time_to_target(theirs)
    if hit_mine is None:
        return None, False, f"{mine.solver} did not reach the target ({mine.stopped})"
    if hit_theirs is None:
        bound = hit_mine[0] / theirs.times[-1] if theirs.times and theirs.times[-1] > 0 else None
        return bound, True, (
            f"{theirs.solver} did not reach the target in {theirs.times[-1]:.3g} s ({theirs.stopped}); "
            "ratio is an upper bound")
    ratio = hit_mine[0] / hit_theirs[0]
    return ratio, ratio <= 0.5, f"{hit_mine[0]:.3g} s vs {hit_theirs[0]:.3g} s"


def target_checks(comparisons: list[Comparison], cheap_bome: str = "BOME (averaged)",
                  bome_rounds: dict[str, Any] | None = None) -> list[TargetCheck]:
    """The issue's three targets, each met or missed with the measured numbers.

    ``bome_rounds`` (from :func:`interleaved_rounds`) gives the per-iteration ratio of the cheap-oracle
    BOME from interleaved rounds; without it the ratio comes from the two trajectories.
    """
    checks: list[TargetCheck] = []
    paired = [c for c in comparisons if c.benchmark is not None]
    for c in paired:
        assert c.benchmark is not None
        ratio, met, detail = _bound_ratio(c.hypergrad, c.benchmark)
        checks.append(TargetCheck(f"{c.algorithm}: hypergrad time to target <= 0.5x benchmark", ratio, 0.5,
                                  met and ratio is not None and ratio <= 0.5, detail))

    def fastest(trajs: list[Trajectory]) -> Trajectory | None:
        hits = [(time_to_target(t), t) for t in trajs]
        reached = [(h[0], t) for h, t in hits if h is not None]
        return min(reached, key=lambda p: p[0])[1] if reached else None

    mine = fastest([c.hypergrad for c in comparisons])
    theirs = fastest([c.benchmark for c in paired if c.benchmark is not None])
    if mine is None:
        checks.append(TargetCheck("fastest hypergrad <= 0.5x fastest benchmark", None, 0.5, False,
                                  "no hypergrad solver reached the target"))
    elif theirs is None:
        longest = max((c.benchmark.times[-1] for c in paired if c.benchmark and c.benchmark.times), default=0.0)
        bound = time_to_target(mine)[0] / longest if longest > 0 else None  # type: ignore[index]
        checks.append(TargetCheck("fastest hypergrad <= 0.5x fastest benchmark", bound, 0.5,
                                  bound is not None and bound <= 0.5,
                                  f"{mine.solver}; no benchmark solver reached the target (upper bound)"))
    else:
        ratio = time_to_target(mine)[0] / time_to_target(theirs)[0]  # type: ignore[index]
        checks.append(TargetCheck("fastest hypergrad <= 0.5x fastest benchmark", ratio, 0.5, ratio <= 0.5,
                                  f"{mine.solver} vs {theirs.solver}"))

    name = f"{cheap_bome}: time per iteration <= 2x the JAX step"
    if bome_rounds is not None and bome_rounds.get("ratios"):
        ratio = float(np.median(bome_rounds["ratios"]))
        checks.append(TargetCheck(name, ratio, 2.0, ratio <= 2.0, (
            f"median of {len(bome_rounds['ratios'])} interleaved rounds of {bome_rounds['iterations']} iterations: "
            f"{np.median(bome_rounds['hypergrad_ms']):.3g} ms vs {np.median(bome_rounds['benchmark_ms']):.3g} ms")))
        return checks
    bome = next((c for c in paired if c.algorithm == cheap_bome), None)
    if bome is not None and bome.benchmark is not None:
        mine_it, theirs_it = bome.hypergrad.seconds_per_iteration(), bome.benchmark.seconds_per_iteration()
        if mine_it is not None and theirs_it is not None and theirs_it > 0:
            ratio = mine_it / theirs_it
            checks.append(TargetCheck(name, ratio, 2.0,
                                      ratio <= 2.0,
                                      f"{mine_it * 1e3:.3g} ms vs {theirs_it * 1e3:.3g} ms per iteration"))
    return checks


def _fmt(x: float | None, spec: str = ".3g") -> str:
    return "-" if x is None else format(x, spec)


def render_report(meta: dict[str, Any], comparisons: list[Comparison], checks: list[TargetCheck]) -> str:
    """The markdown results file: provenance, one table per algorithm, the targets."""
    lines = [
        "# hypergrad vs benchmark_bilevel (benchopt) on the simulated quadratic",
        "",
        f"- command: `{meta.get('command', '-')}`",
        f"- date (UTC): {meta.get('date', '-')}",
        f"- machine: {meta.get('cpu', '-')}, {meta.get('cores', '-')} cores; load average before / after: "
        f"{meta.get('load_before', '-')} / {meta.get('load_after', '-')}",
        f"- versions: {meta.get('versions', '-')}",
        f"- benchmark_bilevel commit: {meta.get('benchmark_commit', '-')}; hypergrad: {meta.get('hypergrad', '-')}",
        f"- instance: {meta.get('instance', '-')}",
        f"- target: ‖∇F‖² ≤ {TARGET_FRACTION:g} × the initial value "
        f"({_fmt(meta.get('initial_value'))}); exact ‖∇F‖² in float64 outside the timed region",
        "- oracle call: one gradient or Hessian-vector product of g or f on one batch "
        "(counted from each algorithm's code)",
        "",
    ]
    for c in comparisons:
        lines += [f"## {c.algorithm}", ""]
        if c.note:
            lines += [c.note, ""]
        lines += ["| library | solver | settings | time to target s | oracle calls to target | "
                  "iterations to target | final ‖∇F‖² | iterations run | ms / iteration | compile s excluded | stopped |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for traj in (c.hypergrad, c.benchmark):
            if traj is None:
                continue
            hit = time_to_target(traj)
            per_it = traj.seconds_per_iteration()
            lines.append(
                f"| {traj.library} | {traj.solver} | {traj.settings} | {_fmt(hit[0] if hit else None)} | "
                f"{hit[1] if hit else '-'} | {hit[2] if hit else '-'} | {_fmt(traj.values[-1] if traj.values else None)} | "
                f"{traj.iterations[-1] if traj.iterations else 0} | {_fmt(per_it * 1e3 if per_it else None)} | "
                f"{traj.compile_s:.3g} | {traj.stopped} |")
        lines += ["", f"hypergrad / benchmark time to target: {_fmt(c.time_ratio())}", ""]
    lines += ["## Targets", "", "| target | measured | limit | met | detail |", "|---|---|---|---|---|"]
    for t in checks:
        lines.append(f"| {t.name} | {_fmt(t.measured)} | {t.limit:g} | {'met' if t.met else 'MISSED'} | {t.detail} |")
    notes = meta.get("notes") or []
    if notes:
        lines += ["", "## Notes", ""] + [f"- {n}" for n in notes]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------------
# Run-time pieces: jax, torch, the benchmark checkout.
# --------------------------------------------------------------------------------------------


def single_thread() -> None:
    """One thread for every library; must run before jax or torch start their thread pools."""
    os.environ["XLA_FLAGS"] = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
    for name in THREAD_ENV:  # for libraries that start their pools later (numpy's is set on import)
        os.environ[name] = "1"
    import torch

    torch.set_num_threads(1)


def _load_module(path: Path, name: str) -> Any:
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


class Benchmark:
    """The user's benchmark_bilevel checkout: its dataset, objective and solver classes."""

    def __init__(self, directory: Path) -> None:
        self.dir = directory.resolve()
        if not (self.dir / "datasets" / "simulated.py").is_file():
            raise SystemExit(
                f"--benchmark-dir {directory} is not a benchmark_bilevel checkout (no datasets/simulated.py); "
                "get one with: git clone https://github.com/benchopt/benchmark_bilevel")
        sys.path.insert(0, str(self.dir))  # the solvers import benchmark_utils
        self.simulated = _load_module(self.dir / "datasets" / "simulated.py", "benchmark_bilevel_simulated")
        self.objective = _load_module(self.dir / "objective.py", "benchmark_bilevel_objective")

    def solver_class(self, filename: str) -> Any:
        """``Solver`` of ``solvers/<filename>``."""
        module = _load_module(self.dir / "solvers" / filename, f"benchmark_bilevel_solver_{Path(filename).stem}")
        return module.Solver

    def commit(self) -> str:
        try:
            return subprocess.run(["git", "-C", str(self.dir), "rev-parse", "HEAD"], capture_output=True,
                                  text=True, check=True).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            return "unknown (not a git checkout)"


SAMPLE_FIELDS = ("hess_inner", "hess_outer", "cross", "linear_inner", "linear_outer")


@dataclass
class Instance:
    """The benchmark's quadratic: its jax functions and objective, and the raw per-sample arrays."""

    params: dict[str, Any]
    data: dict[str, Any]  # Dataset.get_data(): pb_inner, pb_outer, metrics
    objective: dict[str, Any]  # Objective.get_objective(): f_inner, f_outer, ..., inner_var0, outer_var0
    inner_samples: tuple[np.ndarray, ...]  # float32, leading axis = samples, order SAMPLE_FIELDS
    outer_samples: tuple[np.ndarray, ...]
    inner_avg: Quadratic = field(init=False)
    outer_avg: Quadratic = field(init=False)

    def __post_init__(self) -> None:
        def average(samples: tuple[np.ndarray, ...]) -> Quadratic:
            return Quadratic(*(a.astype(np.float64).mean(axis=0) for a in samples))

        self.inner_avg, self.outer_avg = average(self.inner_samples), average(self.outer_samples)

    def grad_sq_norm(self, outer_var: Any) -> float:
        """Exact ‖∇F‖² at ``outer_var`` (float64)."""
        return exact_grad_sq_norm(self.inner_avg, self.outer_avg, np.asarray(outer_var, dtype=np.float64))


def build_instance(bench: Benchmark, params: dict[str, Any]) -> Instance:
    """The benchmark's dataset and objective, and the same arrays from its generator.

    ``Dataset.get_data`` only returns closures over its arrays; the arrays come from calling the
    benchmark's ``gen_matrices`` with the arguments and keys ``get_data`` uses (joblib caches the
    call, in ``__cache__`` of the checkout, as benchopt does). ``check_same_instance`` then
    compares the two.
    """
    cwd = os.getcwd()
    os.chdir(bench.dir)  # gen_matrices caches under ./__cache__ (ignored by the benchmark's .gitignore)
    try:
        dataset = bench.simulated.Dataset.get_instance(**params)
        data = dataset.get_data()
        p, inner, outer = generator_samples(dataset)
    finally:
        os.chdir(cwd)
    objective = bench.objective.Objective.get_instance()
    objective.set_data(**data)
    return Instance(p, data, objective.get_objective(), inner, outer)


def generator_samples(dataset: Any) -> tuple[dict[str, Any], tuple[np.ndarray, ...], tuple[np.ndarray, ...]]:
    """The simulated ``dataset``'s parameters and its per-sample arrays (inner, outer; float32, order
    ``SAMPLE_FIELDS``), from the benchmark's ``gen_matrices`` with the arguments and keys its
    ``get_data`` uses. Call it with the checkout as the working directory and on ``sys.path``.
    """
    import jax
    from benchmark_utils.gen_matrices import gen_matrices

    names = ("random_state", "n_samples_inner", "n_samples_outer", "dim_inner", "dim_outer", "L_inner_inner",
             "L_outer_inner", "L_cross_inner", "L_inner_outer", "L_outer_outer", "L_cross_outer", "mu_inner")
    p = {name: getattr(dataset, name) for name in names}  # benchopt sets the parameters as attributes
    keys = jax.random.split(jax.random.PRNGKey(p["random_state"]), 2)
    inner = gen_matrices(p["n_samples_inner"], p["dim_inner"], p["dim_outer"], p["L_inner_inner"],
                         p["L_outer_inner"], p["L_cross_inner"], p["mu_inner"], keys[0])
    outer = gen_matrices(p["n_samples_outer"], p["dim_inner"], p["dim_outer"], p["L_inner_outer"],
                         p["L_outer_outer"], p["L_cross_outer"], p["mu_inner"], keys[1])
    as32 = lambda arrays: tuple(np.array(a, dtype=np.float32) for a in arrays)  # noqa: E731
    return p, as32(inner), as32(outer)


def quadratic_loss(w: dict[str, Any], lam: dict[str, Any], batch: tuple[Any, ...]) -> Any:
    """The benchmark's ``batched_quadratic`` in torch: the mean over the batch of per-sample quadratics."""
    hess_inner, hess_outer, cross, linear_inner, linear_outer = batch
    y, x = w["y"], lam["x"]
    per_sample = 0.5 * ((hess_inner @ y) @ y) + 0.5 * ((hess_outer @ x) @ x)
    per_sample = per_sample + (cross @ y) @ x + linear_inner @ y + linear_outer @ x
    return per_sample.mean()


def check_same_instance(instance: Instance, batch_size: int = 64) -> float:
    """Largest relative gap between the benchmark's jax ``f_inner``/``f_outer`` and :func:`quadratic_loss`
    on the first batch at a random point (float32: expect ~1e-6)."""
    import torch

    rng = np.random.default_rng(0)
    y = rng.standard_normal(instance.inner_avg.linear_inner.shape[0]).astype(np.float32)
    x = rng.standard_normal(instance.inner_avg.linear_outer.shape[0]).astype(np.float32)
    gap = 0.0
    for jax_f, samples in ((instance.data["pb_inner"][0], instance.inner_samples),
                           (instance.data["pb_outer"][0], instance.outer_samples)):
        theirs = float(jax_f(y, x, start=0, batch_size=batch_size))
        batch = tuple(torch.from_numpy(a[:batch_size]) for a in samples)
        mine = float(quadratic_loss({"y": torch.from_numpy(y)}, {"x": torch.from_numpy(x)}, batch))
        gap = max(gap, abs(mine - theirs) / max(abs(theirs), 1e-30))
    return gap


# ---- the JAX side: the benchmark's own solvers, timed with block_until_ready -----------------


class CompileTimer:
    """Seconds jax spent tracing, lowering and compiling since start (``jax.monitoring`` events)."""

    def __init__(self) -> None:
        import jax

        self.total = 0.0
        jax.monitoring.register_event_duration_secs_listener(self._on_event)

    def _on_event(self, event: str, duration: float, **_: Any) -> None:
        if event.startswith("/jax/core/compile/"):
            self.total += duration


@dataclass(frozen=True)
class BenchmarkSolver:
    """One of the benchmark's solvers with its parameters (``config/*best_params.yml`` or defaults)."""

    name: str
    file: str
    params: dict[str, Any]
    oracle: str  # "minibatch" (its own sampler), "full" (all samples per oracle) or "averaged"
    oracles_per_iteration: int
    iterations_per_callback: int
    settings: str


class _JaxClock:
    """The ``callback`` handed to the benchmark's ``Solver.run``: times, evaluates, stops."""

    def __init__(self, solver: Any, spec: BenchmarkSolver, instance: Instance, traj: Trajectory,
                 budget_s: float, compile_timer: CompileTimer, stop_value: float,
                 max_iterations: int | None = None) -> None:
        self.solver, self.spec, self.instance, self.traj = solver, spec, instance, traj
        self.budget_s, self.compile_timer, self.stop_value = budget_s, compile_timer, stop_value
        self.max_iterations = max_iterations
        self.calls, self.elapsed, self.resume, self.compile_mark = 0, 0.0, 0.0, 0.0

    def __call__(self) -> bool:
        import jax

        if self.calls > 0:
            jax.block_until_ready((self.solver.inner_var, self.solver.outer_var))
            now = time.perf_counter()
            compiled = self.compile_timer.total - self.compile_mark
            self.traj.compile_s += compiled
            self.elapsed += now - self.resume - compiled
        value = self.instance.grad_sq_norm(self.solver.outer_var)
        iteration = self.calls * self.spec.iterations_per_callback
        self.traj.record(self.elapsed, iteration, self.spec.oracles_per_iteration, value)
        self.calls += 1
        stop = _stop_reason(value, self.stop_value, self.elapsed, self.budget_s, iteration, self.max_iterations)
        if stop:
            self.traj.stopped = stop
            return False
        self.compile_mark = self.compile_timer.total
        self.resume = time.perf_counter()
        return True


def _stop_reason(value: float, stop_value: float, elapsed: float, budget_s: float, iteration: int = 0,
                 max_iterations: int | None = None) -> str:
    if not np.isfinite(value):
        return "diverged"
    if value <= stop_value:
        return "reached 0.1x target"
    if elapsed >= budget_s:
        return f"budget {budget_s:g} s"
    if max_iterations is not None and iteration >= max_iterations:
        return f"{max_iterations} iterations"
    return ""


def run_benchmark_solver(bench: Benchmark, spec: BenchmarkSolver, instance: Instance, budget_s: float,
                         compile_timer: CompileTimer, max_iterations: int | None = None) -> Trajectory:
    """Run one of the benchmark's solvers through its own ``set_objective`` (warm-up) and ``run``."""
    solver = bench.solver_class(spec.file).get_instance(**spec.params)
    kwargs = dict(instance.objective)
    if spec.oracle == "averaged":  # the same quadratic with the sample-averaged matrices: one cheap oracle
        kwargs.update(f_inner=instance.data["pb_inner"][3], f_outer=instance.data["pb_outer"][3],
                      n_inner_samples=1, n_outer_samples=1)
    solver.set_objective(**kwargs)  # compiles and runs twice (run_once(2)): the warm-up
    traj = Trajectory(spec.name, "benchmark_bilevel (jax)", spec.settings)
    initial = instance.grad_sq_norm(instance.objective["outer_var0"])
    clock = _JaxClock(solver, spec, instance, traj, budget_s, compile_timer, 0.1 * TARGET_FRACTION * initial,
                      max_iterations)
    solver.run(clock)
    return traj


# ---- the hypergrad side: one small adapter per method ---------------------------------------


@dataclass(frozen=True)
class HypergradSolver:
    """A hypergrad method run by :func:`hypergrad.solve` (``inner_steps=0``, SGD on ``x``)."""

    name: str
    make_method: Callable[..., Any]  # compile flag -> method (with full_batches: also the full inner and outer batches)
    outer_lr: float
    oracle: str  # "minibatch", "full" or "averaged"
    oracles_per_iteration: int
    settings: str
    eval_every: int = 1
    outer_optimizer: Callable[[list[Any]], Any] | None = None  # default torch.optim.SGD(lr=outer_lr)
    step_batches: bool = False  # a fresh inner batch per step inside a call (hg.StepBatches)
    indexed: bool = False  # batches are (batch index, data) pairs (SABA's memory is per batch)
    full_batches: bool = False  # make_method(compile, [all inner samples], [all outer samples]) (SRBA's restarts)


def with_compile(cls: type, compile_: bool, **kwargs: Any) -> Any:
    """``cls(**kwargs)``, with ``compile=True`` added when asked for and ``cls`` has that field."""
    if compile_ and "compile" in {f.name for f in dataclasses.fields(cls)}:
        kwargs["compile"] = True
    return cls(**kwargs)


class _StopRunError(Exception):
    """Raised by the hypergrad clock to end :func:`hypergrad.solve` (target reached or budget spent)."""


def _batch_stream(samples: tuple[Any, ...], batch_size: int, seed: int, indexed: bool = False) -> Iterator[Any]:
    """Contiguous batches in a fresh random order each epoch, as the benchmark's sampler draws them
    (``(index, batch)`` pairs when ``indexed``)."""
    n = samples[0].shape[0]
    n_batches = (n + batch_size - 1) // batch_size
    rng = np.random.default_rng(seed)
    while True:
        for i in rng.permutation(n_batches):
            start = int(i) * batch_size
            batch = tuple(a[start:start + batch_size] for a in samples)
            yield (int(i), batch) if indexed else batch


def indexed_quadratic_loss(w: dict[str, Any], lam: dict[str, Any], batch: tuple[int, tuple[Any, ...]]) -> Any:
    """:func:`quadratic_loss` of an ``(index, batch)`` pair (the index is for SABA's memory)."""
    return quadratic_loss(w, lam, batch[1])


def _averaged(samples: tuple[Any, ...]) -> tuple[Any, ...]:
    """One 'sample' holding the mean matrices (mean in float64, stored in float32 like the data)."""
    import torch

    return tuple(a.to(torch.float64).mean(0, keepdim=True).to(torch.float32) for a in samples)


def run_hypergrad_solver(adapter: HypergradSolver, instance: Instance, budget_s: float, compile_: bool,
                         batch_size: int, seed: int = 1, max_iterations: int | None = None) -> Trajectory:
    """Two warm-up steps, then :func:`hypergrad.solve` timed between evaluations."""
    import torch

    import hypergrad as hg

    inner = tuple(torch.from_numpy(a) for a in instance.inner_samples)
    outer = tuple(torch.from_numpy(a) for a in instance.outer_samples)

    def streams() -> tuple[Any, Any]:
        if adapter.oracle == "minibatch":
            inner_stream = _batch_stream(inner, batch_size, seed, adapter.indexed)
            outer_stream = _batch_stream(outer, batch_size, seed + 1, adapter.indexed)
            if adapter.step_batches:  # every call draws the batches of its steps from one stream
                inner_stream = itertools.repeat(hg.StepBatches(inner_stream))
            return inner_stream, outer_stream
        if adapter.oracle == "full":
            return inner, outer
        return _averaged(inner), _averaged(outer)

    loss = indexed_quadratic_loss if adapter.indexed else quadratic_loss
    problem = hg.BilevelProblem(inner=loss, outer=loss)
    w0 = {"y": torch.from_numpy(np.array(instance.objective["inner_var0"], dtype=np.float32))}
    lam0 = {"x": torch.from_numpy(np.array(instance.objective["outer_var0"], dtype=np.float32))}
    method = adapter.make_method(compile_, [inner], [outer]) if adapter.full_batches else adapter.make_method(compile_)

    def sgd(params: list[torch.Tensor]) -> torch.optim.Optimizer:
        if adapter.outer_optimizer is not None:
            return adapter.outer_optimizer(params)
        return torch.optim.SGD(params, lr=adapter.outer_lr)

    warm_inner, warm_outer = streams()
    hg.solve(problem, w0, lam0, method, sgd, steps=2, inner_steps=0, inner_batches=warm_inner,
             outer_batches=warm_outer, progress=False)

    traj = Trajectory(adapter.name, "hypergrad (torch)", adapter.settings)
    initial = instance.grad_sq_norm(lam0["x"].numpy())
    traj.record(0.0, 0, adapter.oracles_per_iteration, initial)
    stop_value = 0.1 * TARGET_FRACTION * initial
    clock = {"elapsed": 0.0, "resume": 0.0}

    def callback(step: int, w: Any, lam: Any, result: Any) -> None:
        now = time.perf_counter()
        clock["elapsed"] += now - clock["resume"]
        if (step + 1) % adapter.eval_every == 0:
            value = instance.grad_sq_norm(lam["x"].numpy())
            traj.record(clock["elapsed"], step + 1, adapter.oracles_per_iteration, value)
            stop = _stop_reason(value, stop_value, clock["elapsed"], budget_s, step + 1, max_iterations)
            if stop:
                traj.stopped = stop
                raise _StopRunError
        clock["resume"] = time.perf_counter()

    inner_stream, outer_stream = streams()
    # the benchmark's solvers never evaluate the outer loss; hypergrad.solve does it for its history
    # unless told not to (outer_loss_every=0, where this hypergrad has it)
    quiet = {"outer_loss_every": 0} if "outer_loss_every" in inspect.signature(hg.solve).parameters else {}
    clock["resume"] = time.perf_counter()
    try:
        hg.solve(problem, w0, lam0, method, sgd, steps=10**9, inner_steps=0, inner_batches=inner_stream,
                 outer_batches=outer_stream, progress=False, callback=callback, **quiet)
    except _StopRunError:
        pass
    except hg.NonFiniteError as err:  # a diverging run is a result, not a crash
        traj.stopped = f"diverged: {str(err).splitlines()[0]}"
    return traj


def interleaved_rounds(bench: Benchmark, spec: BenchmarkSolver, adapter: HypergradSolver, instance: Instance,
                       compile_timer: CompileTimer, compile_: bool, rounds: int, iterations: int) -> dict[str, Any]:
    """Time per iteration of both libraries in alternating short runs (the load of a shared machine
    drifts: alternating keeps it the same for both)."""
    mine_ms: list[float] = []
    theirs_ms: list[float] = []
    for _ in range(rounds):
        theirs = run_benchmark_solver(bench, spec, instance, float("inf"), compile_timer, max_iterations=iterations)
        mine = run_hypergrad_solver(adapter, instance, float("inf"), compile_, batch_size=1,
                                    max_iterations=iterations)
        theirs_it, mine_it = theirs.seconds_per_iteration(), mine.seconds_per_iteration()
        if theirs_it and mine_it:
            theirs_ms.append(theirs_it * 1e3)
            mine_ms.append(mine_it * 1e3)
    return {"rounds": rounds, "iterations": iterations, "hypergrad_ms": mine_ms, "benchmark_ms": theirs_ms,
            "ratios": [m / t for m, t in zip(mine_ms, theirs_ms, strict=True)]}


# ---- the algorithms both libraries implement -----------------------------------------------

# config/quadratics_021424_best_params.yml (F2SA) and the solvers' defaults (BOME: its grid in
# config/quadratics_021424.yml has no best value; the defaults are step_size=.1, outer_ratio=1, eta=.5)
F2SA_PARAMS = {"batch_size": 64, "delta_lmbda": 0.01, "eval_freq": 16, "lmbda0": 1.0, "n_inner_steps": 10,
               "outer_ratio": 1.0, "step_size": 0.1, "random_state": 1}
BOME_PARAMS = {"step_size": 0.1, "outer_ratio": 1.0, "eta": 0.5, "n_inner_steps": 10, "choice_phi": "grad_norm",
               "random_state": 1}


# config/quadratics_021424_best_params.yml (AmIGO, SABA, StocBiO); SOBA has none there: its defaults
# (step .1, outer_ratio 1) with the eval_freq of config/quadratics_021424.yml
SOBA_PARAMS = {"batch_size": 64, "eval_freq": 16, "outer_ratio": 1.0, "step_size": 0.1, "random_state": 1}
SABA_PARAMS = {"batch_size": 64, "eval_freq": 64, "mode_init_memory": "zero", "outer_ratio": 1.0, "step_size": 0.1,
               "random_state": 1}
SRBA_PARAMS = {"batch_size": 64, "eval_freq": 64, "outer_ratio": 1.0, "period_frac": 0.5, "step_size": 0.1,
               "random_state": 1}
AMIGO_PARAMS = {"batch_size": 64, "eval_freq": 16, "n_inner_steps": 10, "outer_ratio": 0.1, "step_size": 0.01,
                "random_state": 1}
STOCBIO_PARAMS = {"batch_size": 64, "eval_freq": 16, "n_inner_steps": 10, "n_shia_steps": 10, "outer_ratio": 1.0,
                  "step_size": 0.1, "random_state": 1}


def stochastic_comparisons(n_inner_batches: int, n_outer_batches: int
                           ) -> list[tuple[str, list[HypergradSolver], BenchmarkSolver, str]]:
    """SOBA, SABA, SRBA, AmIGO and StocBiO, for those this hypergrad has (``hg.SOBA``, ...); SABA keeps a
    memory per batch of 64 (``n_inner_batches``, ``n_outer_batches``); SRBA restarts from all samples every
    ``period`` steps."""
    import hypergrad as hg

    out: list[tuple[str, list[HypergradSolver], BenchmarkSolver, str]] = []
    note = "Stochastic, batch 64; hypergrad set up by the mapping in its class docstring."
    if hasattr(hg, "SOBA"):
        step, outer = SOBA_PARAMS["step_size"], SOBA_PARAMS["step_size"] / SOBA_PARAMS["outer_ratio"]
        out.append(("SOBA", [HypergradSolver(
            "SOBA", lambda c: with_compile(hg.SOBA, c, step_size=hg.stochastic.Decreasing(step, 0.5)),
            outer_lr=outer, oracle="minibatch", oracles_per_iteration=4,
            settings="steps .1/sqrt(t+1) (w, v) and outer .1/sqrt(t+1) (ScheduledSGD)",
            eval_every=SOBA_PARAMS["eval_freq"],
            outer_optimizer=lambda p: hg.stochastic.ScheduledSGD(p, hg.stochastic.Decreasing(outer, 0.5)))],
            BenchmarkSolver("SOBA", "soba.py", SOBA_PARAMS, "minibatch", 4, SOBA_PARAMS["eval_freq"],
                            "defaults: step .1, outer .1, both decaying (t+1)^-1/2"), note))
    if hasattr(hg, "SABA"):
        step, outer = SABA_PARAMS["step_size"], SABA_PARAMS["step_size"] / SABA_PARAMS["outer_ratio"]
        out.append(("SABA", [HypergradSolver(
            "SABA", lambda c: with_compile(hg.SABA, c, step_size=step, n_inner=n_inner_batches,
                                                n_outer=n_outer_batches),
            outer_lr=outer, oracle="minibatch", oracles_per_iteration=4, settings="constant steps .1, outer .1",
            eval_every=SABA_PARAMS["eval_freq"], indexed=True)],
            BenchmarkSolver("SABA", "saba.py", SABA_PARAMS, "minibatch", 4, SABA_PARAMS["eval_freq"],
                            "best params: step .1, outer .1, constant, memory starts at zero"), note))
    if hasattr(hg, "SRBA"):
        step, outer = SRBA_PARAMS["step_size"], SRBA_PARAMS["step_size"] / SRBA_PARAMS["outer_ratio"]
        # the benchmark's int((n_inner_samples + n_outer_samples) * period_frac / batch_size), with
        # samples = batches * 64 (every instance here has a multiple of 64 samples)
        period = int((n_inner_batches + n_outer_batches) * SRBA_PARAMS["period_frac"])
        # per period: 8 oracle calls per recursive step, 3 per inner and 1 per outer batch at the restart
        per_iteration = round((8 * (period - 1) + 3 * n_inner_batches + n_outer_batches) / period)
        out.append(("SRBA", [HypergradSolver(
            # step and period bound now: the names are reassigned for the solvers below
            "SRBA", lambda c, full_inner, full_outer, step=step, period=period: hg.SRBA(
                step, period, full_inner_batches=full_inner, full_outer_batches=full_outer),
            outer_lr=outer, oracle="minibatch", oracles_per_iteration=per_iteration,
            settings=f"constant steps .1, outer .1, period {period} (restart on all samples)",
            eval_every=SRBA_PARAMS["eval_freq"], full_batches=True)],
            BenchmarkSolver("SRBA", "srba.py", SRBA_PARAMS, "minibatch", per_iteration, SRBA_PARAMS["eval_freq"],
                            f"best params: step .1, outer .1, period_frac .5 (period {period}), constant"),
            note + " Oracle calls per iteration: the mean over a period (8 per recursive step, a restart "
                   "counts every batch of the data)."))
    if hasattr(hg, "AmIGO"):
        step, outer, T = AMIGO_PARAMS["step_size"], AMIGO_PARAMS["step_size"] / AMIGO_PARAMS["outer_ratio"], 10
        out.append(("AmIGO", [HypergradSolver(
            "AmIGO", lambda c: with_compile(hg.AmIGO, c, step_size=step, inner_steps=T, linear_steps=T),
            outer_lr=outer, oracle="minibatch", oracles_per_iteration=2 * T + 2,
            settings="T=L=10, steps .01, outer .1, constant", eval_every=AMIGO_PARAMS["eval_freq"],
            step_batches=True)],
            BenchmarkSolver("AmIGO", "amigo.py", AMIGO_PARAMS, "minibatch", 2 * T + 2, AMIGO_PARAMS["eval_freq"],
                            "best params: T=10, step .01, outer .1, constant"), note))
    if hasattr(hg, "StocBiO"):
        step, outer, T = STOCBIO_PARAMS["step_size"], STOCBIO_PARAMS["step_size"] / STOCBIO_PARAMS["outer_ratio"], 10
        out.append(("StocBiO", [HypergradSolver(
            "StocBiO", lambda c: with_compile(hg.StocBiO, c, step_size=step, inner_steps=T, linear_steps=T),
            outer_lr=outer, oracle="minibatch", oracles_per_iteration=2 * T + 2,
            settings="T=10, 10 Neumann steps, steps .1, outer .1, constant",
            eval_every=STOCBIO_PARAMS["eval_freq"], step_batches=True)],
            BenchmarkSolver("StocBiO", "stocbio.py", STOCBIO_PARAMS, "minibatch", 2 * T + 2,
                            STOCBIO_PARAMS["eval_freq"], "best params: T=10, 10 SHIA steps, step .1, outer .1"),
            note))
    return out


def comparisons_to_run(sigma: float, n_inner_batches: int, n_outer_batches: int) -> list[tuple[str, list[HypergradSolver], BenchmarkSolver, str]]:
    """(algorithm, hypergrad adapters, benchmark solver, note) for every algorithm of both libraries."""
    import hypergrad as hg

    step, ratio, T = F2SA_PARAMS["step_size"], F2SA_PARAMS["outer_ratio"], F2SA_PARAMS["n_inner_steps"]
    f2sa_bench = BenchmarkSolver(
        "F2SA", "f2sa.py", F2SA_PARAMS, "minibatch", 3 * T + 3, F2SA_PARAMS["eval_freq"],
        "best params: batch 64, T=10, step .1 (decay (i+1)^-5/7, -4/7), outer .1 (^-4/7), "
        "lmbda 1 + .01 (i+1)^-1/7 per step")

    def penalty(steps: int) -> HypergradSolver:
        return HypergradSolver(
            f"Penalty T={steps}",
            lambda c: with_compile(hg.Penalty, c, sigma=sigma, inner_optimizer=hg.inner.SGD(lr=step),
                                   inner_steps=steps),
            outer_lr=step / ratio, oracle="minibatch", oracles_per_iteration=3 * steps,
            settings=f"batch 64, T={steps}, SGD .1 on both iterates, outer SGD .1, sigma={sigma:g} fixed",
            eval_every=F2SA_PARAMS["eval_freq"])

    bstep, bratio, bT, eta = (BOME_PARAMS["step_size"], BOME_PARAMS["outer_ratio"], BOME_PARAMS["n_inner_steps"],
                              BOME_PARAMS["eta"])

    def bome(oracle: str) -> tuple[HypergradSolver, BenchmarkSolver]:
        mine = HypergradSolver(
            f"BOME ({oracle})",
            lambda c: with_compile(hg.BOME, c, inner_optimizer=hg.inner.SGD(lr=bstep), w_lr=bstep, inner_steps=bT,
                                   eta=eta, barrier="gradient"),
            outer_lr=bstep / bratio, oracle=oracle, oracles_per_iteration=bT + 2,
            settings=f"T={bT}, SGD .1, w_lr .1, outer SGD .1, eta .5, barrier=gradient")
        theirs = BenchmarkSolver(f"BOME ({oracle})", "bome.py", BOME_PARAMS, oracle, bT + 3, 1,
                                 "defaults: T=10, step .1, outer .1, eta .5, phi=grad_norm")
        return mine, theirs

    averaged, averaged_bench = bome("averaged")
    full, full_bench = bome("full")
    return [*stochastic_comparisons(n_inner_batches, n_outer_batches),
        ("F2SA", [penalty(T), penalty(1)], f2sa_bench,
         "Stochastic, batch 64, same instance and base step sizes. The benchmark's F2SA decays its step sizes "
         "and grows lmbda = 1/sigma each step; hypergrad's Penalty keeps them fixed (no schedule)."),
        ("BOME (averaged)", [averaged], averaged_bench,
         "Deterministic, cheap oracle: the sample-averaged matrices (the benchmark's f_inner_fb / f_outer_fb), "
         "one 100x100 quadratic per oracle."),
        ("BOME (full)", [full], full_bench,
         "Deterministic, expensive oracle: every sample per oracle (the benchmark's BOME as it ships)."),
    ]


def profile_hypergrad(name: str, instance: Instance, sigma: float, compile_: bool, steps: int) -> str:
    """cProfile of ``steps`` steps of one hypergrad solver (after its warm-up): the top functions
    by own time, and the mean time per step under the profiler."""
    import cProfile
    import io
    import pstats

    params = instance.params
    adapters = [a for _, mine, _, _ in comparisons_to_run(sigma, -(-params["n_samples_inner"] // BATCH_SIZE),
                                                          -(-params["n_samples_outer"] // BATCH_SIZE))
                for a in mine]
    adapter = next((a for a in adapters if a.name == name), None)
    if adapter is None:
        raise SystemExit(f"--profile {name!r}: no such hypergrad solver; one of {[a.name for a in adapters]}")
    profiler = cProfile.Profile()
    profiler.enable()
    traj = run_hypergrad_solver(adapter, instance, float("inf"), compile_, BATCH_SIZE, max_iterations=steps)
    profiler.disable()
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(15)
    per_step = traj.seconds_per_iteration()
    return (f"{name}: {traj.iterations[-1]} steps, {per_step * 1e3 if per_step else float('nan'):.3g} ms per step "
            f"under cProfile (load {load_average()})\n{out.getvalue()}")


def _versions() -> str:
    from importlib.metadata import PackageNotFoundError, version

    out = []
    for name in ("torch", "jax", "jaxlib", "jaxopt", "benchopt", "numpy"):
        try:
            out.append(f"{name} {version(name)}")
        except PackageNotFoundError:
            out.append(f"{name} -")
    return ", ".join(out)


def _hypergrad_source() -> str:
    """Where the hypergrad that ran comes from (path and git commit of its checkout)."""
    import hypergrad

    root = Path(hypergrad.__file__).resolve().parent.parent
    try:
        commit = subprocess.run(["git", "-C", str(root), "log", "-1", "--format=%h %D"], capture_output=True,
                                text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = "not a git checkout"
    return f"{root} ({commit})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="hypergrad against benchmark_bilevel's own solvers on its quadratic problem. Needs a "
                    "checkout of the benchmark (git clone https://github.com/benchopt/benchmark_bilevel) and "
                    "the bench extra (make setup-bench: jax, jaxopt, benchopt).")
    parser.add_argument("--benchmark-dir", type=Path, required=True,
                        help="a checkout of https://github.com/benchopt/benchmark_bilevel")
    parser.add_argument("--quick", action="store_true",
                        help="smaller instance, 1.5 s budgets, no full-batch BOME (a smoke run)")
    parser.add_argument("--compile", action="store_true",
                        help="compile=True for the hypergrad methods that accept it")
    parser.add_argument("--budget", type=float, default=None,
                        help="compute seconds per solver run (default 60, --quick 1.5)")
    parser.add_argument("--sigma", type=float, default=0.01, help="Penalty's fixed sigma (default 0.01)")
    parser.add_argument("--only", default=None, help="run only the algorithms whose name contains this")
    parser.add_argument("--skip", default="", help="comma-separated algorithms to leave out (e.g. 'BOME (full)')")
    parser.add_argument("--profile", default=None, metavar="SOLVER",
                        help="only profile this hypergrad solver (e.g. 'BOME (averaged)') with cProfile for "
                             "--profile-steps steps and print the top functions")
    parser.add_argument("--profile-steps", type=int, default=200)
    parser.add_argument("--n-samples-inner", type=int, default=None,
                        help="inner samples (default 32768, the benchmark's instance; --quick 2048). The "
                             "benchmark's jax solvers compile with the samples as constants: at 32768, jax "
                             "took more than 13 GB of memory compiling F2SA")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / REPORT_NAME,
                        help="output path without suffix (writes .md and .json)")
    args = parser.parse_args(argv)

    single_thread()
    hypergrad_source = _hypergrad_source()  # before the run: a checkout may move while it runs
    load_before = load_average()
    bench = Benchmark(args.benchmark_dir)
    compile_timer = CompileTimer()
    params = {"n_samples_inner": 32768, "n_samples_outer": 1024, "dim_inner": 100, "dim_outer": 10,
              "mu_inner": 0.1, "L_cross_inner": 0.1, "L_cross_outer": 0.1}
    if args.n_samples_inner is not None:
        params["n_samples_inner"] = args.n_samples_inner
    elif args.quick:
        params["n_samples_inner"] = 2048
    budget = args.budget if args.budget is not None else (1.5 if args.quick else 60.0)
    skip = set(args.skip.split(",")) | ({"BOME (full)"} if args.quick else set())
    instance = build_instance(bench, params)
    gap = check_same_instance(instance)
    initial = instance.grad_sq_norm(instance.objective["outer_var0"])
    print(f"instance {instance.params}; torch vs benchmark loss relative gap {gap:.2e}; ‖∇F(x0)‖² = {initial:.6g}")

    if args.profile:
        print(profile_hypergrad(args.profile, instance, args.sigma, args.compile, args.profile_steps))
        return 0
    comparisons: list[Comparison] = []
    bome_rounds: dict[str, Any] | None = None
    for algorithm, adapters, spec, note in comparisons_to_run(
            args.sigma, -(-params["n_samples_inner"] // BATCH_SIZE), -(-params["n_samples_outer"] // BATCH_SIZE)):
        if (args.only and args.only not in algorithm) or algorithm in skip:
            continue
        if algorithm == "BOME (averaged)":
            bome_rounds = interleaved_rounds(bench, spec, adapters[0], instance, compile_timer, args.compile,
                                             rounds=2 if args.quick else 5, iterations=30 if args.quick else 200)
            print(f"BOME (averaged) interleaved ms/iteration: {bome_rounds}")
        theirs = run_benchmark_solver(bench, spec, instance, budget, compile_timer)
        print(f"{spec.name:24s} benchmark   final {theirs.values[-1]:.3e} after {theirs.iterations[-1]} it, "
              f"{theirs.times[-1]:.2f} s ({theirs.stopped}); target at {time_to_target(theirs)}")
        for adapter in adapters:
            mine = run_hypergrad_solver(adapter, instance, budget, args.compile, BATCH_SIZE)
            print(f"{adapter.name:24s} hypergrad   final {mine.values[-1]:.3e} after {mine.iterations[-1]} it, "
                  f"{mine.times[-1]:.2f} s ({mine.stopped}); target at {time_to_target(mine)}")
            comparisons.append(Comparison(algorithm if len(adapters) == 1 else f"{algorithm} ({adapter.name})",
                                          mine, theirs, note))
    checks = target_checks(comparisons, bome_rounds=bome_rounds)
    meta = machine_info(libraries=("torch", "jax", "jaxopt", "benchopt"))
    cpu, cores = meta["cpu"], meta["cores"]
    meta = {
        "command": "python " + " ".join([Path(sys.argv[0]).as_posix(), *(argv if argv is not None else sys.argv[1:])]),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M"),
        "cpu": cpu, "cores": cores, "load_before": load_before, "load_after": load_average(),
        "versions": _versions(), "benchmark_commit": bench.commit(), "hypergrad": hypergrad_source,
        "instance": f"simulated {instance.params}, init y=0, x=-2 (objective.py); torch/jax loss gap {gap:.1e}",
        "initial_value": initial, "quick": args.quick, "compile": args.compile, "budget_s": budget,
        "bome_interleaved_rounds": bome_rounds,
        "notes": [
            "Single thread everywhere: torch.set_num_threads(1); XLA_FLAGS=--xla_cpu_multi_thread_eigen=false "
            "intra_op_parallelism_threads=1; OMP/MKL/OPENBLAS threads 1.",
            "Times are compute time between evaluations; the JAX iterates are block_until_ready'd before the "
            "clock is read, and jax compile time inside the timed region is subtracted (column 'compile s').",
            "Runs stop at 0.1x the target, on divergence, or when the compute budget is spent.",
            f"Penalty's sigma is fixed at {args.sigma:g} (hypergrad has no default sigma); its minibatches are "
            "drawn by a numpy sampler of the same kind (contiguous blocks, reshuffled each epoch), not the "
            "benchmark's jax keys.",
            "hypergrad.solve runs with outer_loss_every=0 where it has it (no outer-loss history, as the "
            "benchmark's solvers keep none); methods with takes_step_batches (Penalty, BOME, AmIGO, StocBiO) "
            "draw a fresh batch per inner step, as the benchmark's solvers do.",
        ],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".md").write_text(render_report(meta, comparisons, checks))
    args.out.with_suffix(".json").write_text(json.dumps(
        {"meta": meta, "comparisons": [
            dataclasses.asdict(dataclasses.replace(c, hypergrad=thinned(c.hypergrad),
                                                   benchmark=thinned(c.benchmark) if c.benchmark else None))
            for c in comparisons],
         "targets": [dataclasses.asdict(t) for t in checks]}, indent=1))
    print(render_report(meta, comparisons, checks))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
