#!/usr/bin/env python
"""Per-iteration cost of BOME on a cheap oracle: hypergrad eager vs ``compile=True`` vs the JAX BOME
of benchopt's ``benchmark_bilevel``.

Question (issue #26): on the averaged (deterministic) quadratic of benchmark_bilevel (d = 100), one
eager hypergrad BOME iteration is mostly Python/PyTorch overhead, about 10x a jitted JAX step. Does
``BOME(compile=True)`` bring it within 2x of the benchmark's JAX step?

Usage (``/work/venv-bench``: torch, jax[cpu], jaxopt, benchopt; a checkout of benchmark_bilevel)::

    git clone https://github.com/benchopt/benchmark_bilevel /tmp/bb
    PYTHONPATH=. python benchmarks/bome_overhead.py --benchmark /tmp/bb          # writes the results file
    PYTHONPATH=. python benchmarks/bome_overhead.py --benchmark /tmp/bb --quick  # prints only

Everything runs in one process, single-threaded (``torch.set_num_threads(1)``, XLA's CPU backend
without its Eigen thread pool), float32 on both sides (JAX's default). The problem is the
benchmark's own: its ``datasets/simulated.py`` generates the matrices (default parameters, d = 100,
1024 samples averaged into one quadratic, ``f_inner_fb`` / ``f_outer_fb``), and the JAX side is its
``solvers/bome.py`` ``Solver`` (defaults: T = 10 inner steps of size 0.1, eta = 0.5,
``choice_phi="grad_norm"``, joint step 0.1), run through its ``run(callback)`` loop. hypergrad runs
``BOME(SGD(lr=0.1), w_lr=0.1, inner_steps=10, eta=0.5, barrier="gradient")`` with a plain loop
``lam <- lam - 0.1 * grad`` (the benchmark's joint step), on the same matrices as torch tensors.

Timing: per iteration = (time of N2 iterations - time of N1 iterations) / (N2 - N1), so the JAX
solver's compilation in ``run`` and any one-off cost cancel out; JAX's result is waited for with
``block_until_ready`` inside each timed run; hypergrad's compilation happens before timing.
Runners are interleaved over rounds; the table reports medians of wall time and of process CPU
time (all threads) with the load average next to them. A trajectory check compares the final
outer variable of the two implementations after the same number of iterations.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np
import torch

import hypergrad as hg

RESULTS = Path(__file__).resolve().parent / "results"
STEP, T, ETA = 0.1, 10, 0.5


def load_benchmark(path: Path) -> tuple[Any, Any]:
    """The benchmark's simulated dataset (default parameters) and its BOME solver class."""
    sys.path.insert(0, str(path))
    import importlib.util

    def module(rel: str, name: str) -> Any:
        spec = importlib.util.spec_from_file_location(name, path / rel)
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod

    cwd = os.getcwd()
    os.chdir(tempfile.mkdtemp(prefix="bome_overhead_"))  # gen_matrices caches with joblib in the cwd
    try:
        dataset = module("datasets/simulated.py", "bb_simulated").Dataset.get_instance()
        data = dataset.get_data()
    finally:
        os.chdir(cwd)
    return data, module("solvers/bome.py", "bb_bome").Solver


def torch_problem(f_inner_fb: Any, f_outer_fb: Any) -> hg.BilevelProblem:
    """The averaged quadratics as a hypergrad problem: the same matrices, read back from the
    benchmark's jitted functions (``f(y, x) = 0.5 y'Ay + 0.5 x'Bx + x'Cy + a'y + b'x``)."""
    import jax
    import jax.numpy as jnp

    def coefficients(fn: Any, d_in: int, d_out: int) -> dict[str, torch.Tensor]:
        zero_in, zero_out = jnp.zeros(d_in), jnp.zeros(d_out)
        grad = jax.grad(fn, argnums=(0, 1))
        a, b = grad(zero_in, zero_out)
        A = jax.jacfwd(lambda y: grad(y, zero_out)[0])(zero_in)
        B = jax.jacfwd(lambda x: grad(zero_in, x)[1])(zero_out)
        C = jax.jacfwd(lambda y: grad(y, zero_out)[1])(zero_in)  # d/dy of (Bx + Cy + b) = C
        return {k: torch.from_numpy(np.array(v)) for k, v in
                {"A": A, "B": B, "C": C, "a": a, "b": b}.items()}

    gi, go = coefficients(f_inner_fb, 100, 100), coefficients(f_outer_fb, 100, 100)

    def quadratic(c: dict[str, torch.Tensor], y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return 0.5 * y @ (c["A"] @ y) + 0.5 * x @ (c["B"] @ x) + x @ (c["C"] @ y) + c["a"] @ y + c["b"] @ x

    return hg.BilevelProblem(lambda w, lam, b: quadratic(gi, w["y"], lam["x"]),
                             lambda w, lam, b: quadratic(go, w["y"], lam["x"]))


def jax_runner(solver: Any) -> Callable[[int], Any]:
    """``n`` iterations of the benchmark's BOME solver loop, waited for; returns the outer variable."""

    def run(n: int) -> Any:
        left = [n]

        def callback() -> bool:
            left[0] -= 1
            return left[0] >= 0

        solver.run(callback)
        solver.outer_var.block_until_ready()
        return np.asarray(solver.outer_var)

    return run


def torch_runner(method: hg.BOME, problem: hg.BilevelProblem, w0: dict, lam0: dict) -> Callable[[int], Any]:
    def run(n: int) -> Any:
        w, lam = dict(w0), dict(lam0)
        for _ in range(n):
            r = method.hypergrad(problem, w, lam)
            w, lam = r.w, {"x": lam["x"] - STEP * r.grad["x"]}
        return lam["x"].numpy()

    return run


def penalty_runner(method: hg.Penalty, problem: hg.BilevelProblem, w0: dict, lam0: dict) -> Callable[[int], Any]:
    """F2SA on the same problem: its two iterates and optimizer states carried across calls."""
    def run(n: int) -> Any:
        w, lam, state = dict(w0), dict(lam0), None
        for _ in range(n):
            r = method.hypergrad(problem, w, lam, state=state)
            w, state, lam = r.w, r.state, {"x": lam["x"] - STEP * r.grad["x"]}
        return lam["x"].numpy()

    return run


def per_iteration(run: Callable[[int], Any], n1: int, n2: int) -> tuple[float, float]:
    """(wall, process CPU) seconds per iteration from the difference of an n2 and an n1 run."""
    w0, c0 = time.perf_counter(), time.process_time()
    run(n1)
    w1, c1 = time.perf_counter(), time.process_time()
    run(n2)
    w2, c2 = time.perf_counter(), time.process_time()
    return ((w2 - w1) - (w1 - w0)) / (n2 - n1), ((c2 - c1) - (c1 - c0)) / (n2 - n1)


def profile_compiled(run: Callable[[int], Any], n: int) -> str:
    """Where one compiled iteration spends its time: torch.profiler's top entries, per iteration."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run(n)
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12)
    return f"torch.profiler over {n} iterations (totals; divide by {n}):\n\n```\n{table}\n```\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--benchmark", type=Path, required=True, help="checkout of benchmark_bilevel")
    parser.add_argument("--quick", action="store_true", help="fewer rounds; print, write nothing")
    parser.add_argument("--rounds", type=int, default=None)
    args = parser.parse_args()
    rounds = args.rounds or (3 if args.quick else 7)
    n1, n2 = (50, 250) if args.quick else (200, 1200)
    torch.set_num_threads(1)
    import jax

    data, Solver = load_benchmark(args.benchmark)
    f_inner_fb, f_outer_fb = data["pb_inner"][3], data["pb_outer"][3]
    inner0, outer0 = jax.numpy.zeros(100), -2 * jax.numpy.ones(100)
    solver = Solver.get_instance()
    solver.set_objective(f_inner_fb, f_outer_fb, 1, 1, inner0, outer0)

    problem = torch_problem(f_inner_fb, f_outer_fb)
    w0, lam0 = {"y": torch.zeros(100)}, {"x": -2 * torch.ones(100)}
    kwargs = {"w_lr": STEP, "inner_steps": T, "eta": ETA, "barrier": "gradient"}
    eager = hg.BOME(hg.inner.SGD(lr=STEP), **kwargs)
    compiled = hg.BOME(hg.inner.SGD(lr=STEP), **kwargs, compile=True)
    first = compiled.hypergrad(problem, w0, lam0)
    assert first.info.extra["compiled"], "compilation failed (see the hypergrad log line)"
    compile_s = first.info.extra["compile_s"]
    f2sa = {"sigma": 0.01, "inner_optimizer": hg.inner.SGD(lr=STEP), "inner_steps": T}
    assert hg.Penalty(**f2sa, compile=True).hypergrad(problem, w0, lam0).info.extra["compiled"]

    runners = {"JAX (benchmark_bilevel BOME)": jax_runner(solver),
               "hypergrad BOME eager": torch_runner(eager, problem, w0, lam0),
               "hypergrad BOME compile=True": torch_runner(compiled, problem, w0, lam0)}
    f2sa_runners = {"hypergrad F2SA (Penalty) eager": penalty_runner(hg.Penalty(**f2sa), problem, w0, lam0),
                    "hypergrad F2SA (Penalty) compile=True":
                        penalty_runner(hg.Penalty(**f2sa, compile=True), problem, w0, lam0)}
    # trajectory: the same iterations from the same start
    k = 300
    finals = {name: run(k) for name, run in runners.items()}
    ref = finals["JAX (benchmark_bilevel BOME)"]
    drift = {name: float(np.linalg.norm(x - ref) / np.linalg.norm(ref)) for name, x in finals.items()}

    loads, samples = [], {name: [] for name in [*runners, *f2sa_runners]}
    for _ in range(rounds):
        loads.append(Path("/proc/loadavg").read_text().split()[0])
        for name, run in [*runners.items(), *f2sa_runners.items()]:
            samples[name].append(per_iteration(run, n1, n2))
    jax_name = "JAX (benchmark_bilevel BOME)"
    lines = ["| runner | wall us/iter (median) | CPU us/iter (median) | wall ratio to JAX (median of rounds) "
             "| CPU ratio to JAX | final outer var rel. diff. to JAX after 300 it. |", "|---|---|---|---|---|---|"]
    for name in runners:
        wall = statistics.median(s[0] for s in samples[name]) * 1e6
        cpu = statistics.median(s[1] for s in samples[name]) * 1e6
        wall_ratio = statistics.median(a[0] / b[0] for a, b in zip(samples[name], samples[jax_name], strict=True))
        cpu_ratio = statistics.median(a[1] / b[1] for a, b in zip(samples[name], samples[jax_name], strict=True))
        lines.append(f"| {name} | {wall:.0f} | {cpu:.0f} | {wall_ratio:.2f} | {cpu_ratio:.2f} | {drift[name]:.1e} |")
    eager_name, compiled_name = f2sa_runners
    lines += ["", "F2SA (`Penalty(sigma=0.01, SGD(lr=0.1), inner_steps=10)`, lam <- lam - 0.1 grad) on the same problem "
              "(benchmark_bilevel's F2SA is a stochastic scan-jitted solver, not timed here):", "",
              "| runner | wall us/iter (median) | CPU us/iter (median) | CPU ratio compile=True / eager |", "|---|---|---|---|"]
    for name in f2sa_runners:
        ratio = statistics.median(a[1] / b[1] for a, b in zip(samples[compiled_name], samples[eager_name], strict=True))
        lines.append(f"| {name} | {statistics.median(s[0] for s in samples[name]) * 1e6:.0f} | "
                     f"{statistics.median(s[1] for s in samples[name]) * 1e6:.0f} | "
                     f"{ratio if name == compiled_name else 1.0:.2f} |")
    table = "\n".join(lines)
    profile = profile_compiled(runners["hypergrad BOME compile=True"], 200)
    command = "PYTHONPATH=. " + " ".join([Path(sys.executable).as_posix(), *sys.argv])
    report = f"""# BOME per-iteration overhead: eager vs compile=True vs benchmark_bilevel's JAX BOME

Command: `{command}`
Date: {_dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}
Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, single-threaded runs;
load average (1 min) at the start of each round: {", ".join(loads)}.
Versions: torch {torch.__version__}, jax {jax.__version__}, python {platform.python_version()}.

Problem: benchmark_bilevel `datasets/simulated.py` (defaults, d = 100), averaged quadratic
(`f_inner_fb`, `f_outer_fb`), float32. BOME T = 10, inner step 0.1, eta = 0.5, phi = eta |grad q|^2,
joint step 0.1. Per iteration = (time of {n2} - time of {n1} iterations) / {n2 - n1}, {rounds} interleaved rounds.
hypergrad compile time (first call, excluded): {compile_s:.1f} s.

{table}

{profile}
"""
    print(report)
    if not args.quick:
        (RESULTS / "bome_overhead.md").write_text(report)


if __name__ == "__main__":
    main()
