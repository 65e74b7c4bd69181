#!/usr/bin/env python
"""Per-iteration cost of hypergrad's bilevel solvers on benchopt's ``benchmark_bilevel`` quadratics: hypergrad
eager vs ``compile=True`` vs the benchmark's own jitted JAX solvers (issue #26), one question, two sets of
solvers:

* ``bome``: BOME (and F2SA) on the averaged (deterministic) quadratic (d = 100). One eager hypergrad BOME
  iteration is mostly Python/PyTorch overhead, about 10x a jitted JAX step; does ``BOME(compile=True)`` bring
  it within 2x of the benchmark's JAX step? The JAX side is the benchmark's ``solvers/bome.py`` ``Solver``
  (defaults: T = 10 inner steps of size 0.1, eta = 0.5, ``choice_phi="grad_norm"``, joint step 0.1), run
  through its ``run(callback)`` loop; hypergrad runs ``BOME(SGD(lr=0.1), w_lr=0.1, inner_steps=10, eta=0.5,
  barrier="gradient")`` with a plain loop ``lam <- lam - 0.1 * grad``, on the same matrices as torch tensors
  (read back from the benchmark's jitted functions). A trajectory check compares the final outer variable of
  the two implementations after the same number of iterations.
* ``stochastic``: SOBA, SABA, AmIGO and StocBiO on the benchmark's minibatch quadratic (d = 100, batch 64),
  where an eager iteration took 1.7-3x the benchmark's jitted JAX iteration
  (``benchmarks/results/hypergrad_benchopt.md``); does ``compile=True`` bring each to <= 0.5x? The instance
  is the benchmark's ``datasets/simulated.py`` (1024 inner and outer samples); the per-sample matrices for
  torch come from the benchmark's ``gen_matrices`` with the keys its ``get_data`` uses, and the two losses
  are compared on one batch (the gap is printed). The JAX side is each solver's own jitted epoch
  (``Solver.one_epoch``: ``eval_freq`` iterations in one ``lax.scan``), waited for with
  ``block_until_ready``; the hypergrad side a plain loop over ``method.hypergrad`` with contiguous batches of
  64 samples (SABA's batches ``(index, batch)`` pairs, AmIGO's and StocBiO's inner batches a
  :class:`hypergrad.batches.StepBatches`). Parameters: the benchmark's
  (``config/quadratics_021424_best_params.yml``): SOBA step 0.1 (decreasing, exponent 0.5), SABA step 0.1,
  AmIGO step 0.01 / outer 0.1, T = L = 10, StocBiO step 0.1, T = Q = 10.

Usage (``/work/venv-bench``: torch, jax[cpu], jaxopt, benchopt; a checkout of benchmark_bilevel)::

    git clone https://github.com/benchopt/benchmark_bilevel /tmp/bb
    PYTHONPATH=. python benchmarks/bilevel_overhead.py bome --benchmark /tmp/bb          # results/bome_overhead.md
    PYTHONPATH=. python benchmarks/bilevel_overhead.py stochastic --benchmark /tmp/bb    # results/stochastic_overhead.md
    PYTHONPATH=. python benchmarks/bilevel_overhead.py bome --benchmark /tmp/bb --quick  # prints only

One process, single-threaded (``torch.set_num_threads(1)``, XLA's CPU backend without its Eigen thread pool),
float32 on both sides. Timing (:func:`per_iteration`): per iteration = (time of N2 - time of N1 iterations) /
(N2 - N1) (JAX: whole epochs), so one-off costs and compilation cancel; runners are interleaved over rounds
(:func:`interleaved_rounds`); the tables report medians of wall and of process CPU time and the median of
per-round ratios. The machine line comes from the benchmarks' harness (:mod:`harness.report`).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import importlib.util
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

os.environ.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np
import torch
from harness.report import load_average, machine_info, machine_line
from hypergrad_benchopt import generator_samples

import hypergrad as hg

RESULTS = Path(__file__).resolve().parent / "results"
STEP, T, ETA = 0.1, 10, 0.5
BATCH = 64

# benchmark_bilevel parameters per solver: (file, its parameters, outer step of hypergrad's loop)
JAX_SOLVERS = {
    "SOBA": ("soba.py", {"batch_size": BATCH, "eval_freq": 16, "step_size": 0.1, "outer_ratio": 1.0}),
    "SABA": ("saba.py", {"batch_size": BATCH, "eval_freq": 64, "step_size": 0.1, "outer_ratio": 1.0,
                         "mode_init_memory": "zero"}),
    "AmIGO": ("amigo.py", {"batch_size": BATCH, "eval_freq": 16, "step_size": 0.01, "outer_ratio": 0.1,
                           "n_inner_steps": 10}),
    "StocBiO": ("stocbio.py", {"batch_size": BATCH, "eval_freq": 16, "step_size": 0.1, "outer_ratio": 1.0,
                               "n_inner_steps": 10, "n_shia_steps": 10}),
}


def _module(path: Path, name: str) -> Any:
    """A file of the benchmark_bilevel checkout imported as the module ``name``."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def per_iteration(run: Callable[[int], Any], n1: int, n2: int, per_unit: int = 1) -> tuple[float, float]:
    """(wall, process CPU) seconds per iteration from the difference of an n2 and an n1 run (``per_unit``
    iterations per unit of ``run``: a JAX epoch)."""
    w0, c0 = time.perf_counter(), time.process_time()
    run(n1)
    w1, c1 = time.perf_counter(), time.process_time()
    run(n2)
    w2, c2 = time.perf_counter(), time.process_time()
    return ((w2 - w1) - (w1 - w0)) / ((n2 - n1) * per_unit), ((c2 - c1) - (c1 - c0)) / ((n2 - n1) * per_unit)


def interleaved_rounds(runners: dict[str, tuple[Callable[[int], Any], int]], rounds: int,
                       counts: Callable[[int], tuple[int, int]]) -> tuple[dict[str, list[tuple[float, float]]], list[str]]:
    """Every runner timed once per round, in turn (a shared machine's load falls on all alike); ``counts(per_unit)``
    gives each runner's (N1, N2). Returns the per-round samples and the 1-minute load at each round's start."""
    loads: list[str] = []
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in runners}
    for _ in range(rounds):
        loads.append(load_average().split()[0])
        for name, (run, per_unit) in runners.items():
            n1, n2 = counts(per_unit)
            samples[name].append(per_iteration(run, n1, n2, per_unit))
    return samples, loads


def report_header(title: str, loads: list[str], versions: str) -> str:
    """The report's first lines: title, command, date, the machine (:func:`harness.report.machine_line`), versions."""
    command = "PYTHONPATH=. " + " ".join([Path(sys.executable).as_posix(), *sys.argv])
    return "\n".join([
        f"# {title}", "",
        f"Command: `{command}`",
        f"Date: {_dt.datetime.now(_dt.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}",
        machine_line(machine_info(1, libraries=("torch", "jax")),
                     f"single-threaded runs; load average (1 min) at the start of each round: {', '.join(loads)}"),
        f"Versions: {versions}.",
    ])


def median_ratio(a: list[tuple[float, float]], b: list[tuple[float, float]], column: int) -> float:
    """The median over rounds of ``a``'s time over ``b``'s (column 0: wall, 1: CPU)."""
    return statistics.median(x[column] / y[column] for x, y in zip(a, b, strict=True))


# --------------------------------------------------------------------------------------------- bome


def load_bome(path: Path) -> tuple[Any, Any]:
    """The benchmark's simulated dataset (default parameters) and its BOME solver class."""
    sys.path.insert(0, str(path))
    cwd = os.getcwd()
    os.chdir(tempfile.mkdtemp(prefix="bome_overhead_"))  # gen_matrices caches with joblib in the cwd
    try:
        dataset = _module(path / "datasets/simulated.py", "bb_simulated").Dataset.get_instance()
        data = dataset.get_data()
    finally:
        os.chdir(cwd)
    return data, _module(path / "solvers/bome.py", "bb_bome").Solver


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


def bome_jax_runner(solver: Any) -> Callable[[int], Any]:
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


def bome_runner(method: hg.BOME, problem: hg.BilevelProblem, w0: dict, lam0: dict) -> Callable[[int], Any]:
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


def profile_compiled(run: Callable[[int], Any], n: int) -> str:
    """Where one compiled iteration spends its time: torch.profiler's top entries, per iteration."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run(n)
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12)
    return f"torch.profiler over {n} iterations (totals; divide by {n}):\n\n```\n{table}\n```\n"


def run_bome(args: argparse.Namespace) -> None:
    rounds = args.rounds or (3 if args.quick else 7)
    n1, n2 = (50, 250) if args.quick else (200, 1200)
    torch.set_num_threads(1)
    import jax

    data, Solver = load_bome(args.benchmark)
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

    runners = {"JAX (benchmark_bilevel BOME)": bome_jax_runner(solver),
               "hypergrad BOME eager": bome_runner(eager, problem, w0, lam0),
               "hypergrad BOME compile=True": bome_runner(compiled, problem, w0, lam0)}
    f2sa_runners = {"hypergrad F2SA (Penalty) eager": penalty_runner(hg.Penalty(**f2sa), problem, w0, lam0),
                    "hypergrad F2SA (Penalty) compile=True":
                        penalty_runner(hg.Penalty(**f2sa, compile=True), problem, w0, lam0)}
    # trajectory: the same iterations from the same start
    k = 300
    finals = {name: run(k) for name, run in runners.items()}
    ref = finals["JAX (benchmark_bilevel BOME)"]
    drift = {name: float(np.linalg.norm(x - ref) / np.linalg.norm(ref)) for name, x in finals.items()}

    timed = {name: (run, 1) for name, run in [*runners.items(), *f2sa_runners.items()]}
    samples, loads = interleaved_rounds(timed, rounds, lambda per_unit: (n1, n2))
    jax_name = "JAX (benchmark_bilevel BOME)"
    lines = ["| runner | wall us/iter (median) | CPU us/iter (median) | wall ratio to JAX (median of rounds) "
             "| CPU ratio to JAX | final outer var rel. diff. to JAX after 300 it. |", "|---|---|---|---|---|---|"]
    for name in runners:
        wall = statistics.median(s[0] for s in samples[name]) * 1e6
        cpu = statistics.median(s[1] for s in samples[name]) * 1e6
        wall_ratio = median_ratio(samples[name], samples[jax_name], 0)
        cpu_ratio = median_ratio(samples[name], samples[jax_name], 1)
        lines.append(f"| {name} | {wall:.0f} | {cpu:.0f} | {wall_ratio:.2f} | {cpu_ratio:.2f} | {drift[name]:.1e} |")
    eager_name, compiled_name = f2sa_runners
    lines += ["", "F2SA (`Penalty(sigma=0.01, SGD(lr=0.1), inner_steps=10)`, lam <- lam - 0.1 grad) on the same problem "
              "(benchmark_bilevel's F2SA is a stochastic scan-jitted solver, not timed here):", "",
              "| runner | wall us/iter (median) | CPU us/iter (median) | CPU ratio compile=True / eager |", "|---|---|---|---|"]
    for name in f2sa_runners:
        ratio = median_ratio(samples[compiled_name], samples[eager_name], 1)
        lines.append(f"| {name} | {statistics.median(s[0] for s in samples[name]) * 1e6:.0f} | "
                     f"{statistics.median(s[1] for s in samples[name]) * 1e6:.0f} | "
                     f"{ratio if name == compiled_name else 1.0:.2f} |")
    table = "\n".join(lines)
    profile = profile_compiled(runners["hypergrad BOME compile=True"], 200)
    header = report_header("BOME per-iteration overhead: eager vs compile=True vs benchmark_bilevel's JAX BOME", loads,
                           f"torch {torch.__version__}, jax {jax.__version__}")
    report = f"""{header}

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


# ----------------------------------------------------------------------------------------- stochastic


def load_instance(path: Path) -> tuple[dict[str, Any], tuple[np.ndarray, ...], tuple[np.ndarray, ...]]:
    """The simulated dataset's ``get_data()`` and the per-sample arrays (inner, outer) of its generator."""
    sys.path.insert(0, str(path))
    cwd = os.getcwd()
    os.chdir(path)  # gen_matrices caches with joblib under the checkout
    try:
        dataset = _module(path / "datasets/simulated.py", "bb_simulated").Dataset.get_instance()
        data = dataset.get_data()
        _, inner, outer = generator_samples(dataset)
    finally:
        os.chdir(cwd)
    return data, inner, outer


def quadratic(w: dict[str, torch.Tensor], lam: dict[str, torch.Tensor], batch: Any) -> torch.Tensor:
    """The benchmark's ``batched_quadratic``: the batch mean of per-sample quadratics; a batch is the
    five per-sample arrays, or ``(index, arrays)`` for SABA."""
    if isinstance(batch[0], int):
        batch = batch[1]
    hess_inner, hess_outer, cross, linear_inner, linear_outer = batch
    y, x = w["y"], lam["x"]
    per_sample = 0.5 * ((hess_inner @ y) @ y) + 0.5 * ((hess_outer @ x) @ x) + (cross @ y) @ x
    return (per_sample + linear_inner @ y + linear_outer @ x).mean()


def loss_gap(data: dict[str, Any], inner: tuple[np.ndarray, ...], outer: tuple[np.ndarray, ...]) -> float:
    """Largest relative gap between the benchmark's jax losses and :func:`quadratic` on one batch."""
    rng = np.random.default_rng(0)
    y, x = rng.standard_normal(100).astype(np.float32), rng.standard_normal(100).astype(np.float32)
    gap = 0.0
    for jax_f, arrays in ((data["pb_inner"][0], inner), (data["pb_outer"][0], outer)):
        theirs = float(jax_f(y, x, start=0, batch_size=BATCH))
        mine = float(quadratic({"y": torch.from_numpy(y)}, {"x": torch.from_numpy(x)},
                               tuple(torch.from_numpy(a[:BATCH]) for a in arrays)))
        gap = max(gap, abs(mine - theirs) / abs(theirs))
    return gap


def stochastic_jax_runner(path: Path, name: str, data: dict[str, Any]) -> tuple[Callable[[int], Any], int]:
    """``n`` epochs of the benchmark's jitted solver, waited for; and its iterations per epoch."""
    import jax.numpy as jnp

    filename, params = JAX_SOLVERS[name]
    solver = _module(path / "solvers" / filename, f"bb_{name.lower()}").Solver.get_instance(**params)
    f_inner, n_inner = data["pb_inner"][0], data["pb_inner"][1]
    f_outer, n_outer = data["pb_outer"][0], data["pb_outer"][1]
    solver.set_objective(f_inner, f_outer, n_inner, n_outer, jnp.zeros(100), jnp.zeros(100))  # compiles
    state = [solver.init()]  # the carry; SABA's init returns (memory, carry), its epoch takes both

    def run(n: int) -> Any:
        for _ in range(n):
            if name == "SABA":
                memory, carry = state[0]
                state[0] = solver.one_epoch(carry, memory, solver.eval_freq)
            else:
                state[0] = solver.one_epoch(state[0], solver.eval_freq)
        carry = state[0][1] if name == "SABA" else state[0]
        carry["outer_var"].block_until_ready()
        return carry["outer_var"]

    return run, int(solver.eval_freq)


def batches(arrays: tuple[torch.Tensor, ...], indexed: bool) -> Iterator[Any]:
    """Contiguous batches of ``BATCH`` samples, cycling (``(index, batch)`` when ``indexed``)."""
    n = arrays[0].shape[0] // BATCH
    while True:
        for i in range(n):
            batch = tuple(a[i * BATCH:(i + 1) * BATCH] for a in arrays)
            yield (i, batch) if indexed else batch


def torch_method(name: str, compile_: bool, n_batches: int) -> tuple[Any, float]:
    """The hypergrad method with the benchmark's parameters, and its outer step."""
    if name == "SOBA":
        return hg.SOBA(hg.stochastic.Decreasing(0.1, 0.5), compile=compile_), 0.1
    if name == "SABA":
        return hg.SABA(0.1, n_inner=n_batches, n_outer=n_batches, compile=compile_), 0.1
    if name == "AmIGO":
        return hg.AmIGO(0.01, inner_steps=10, linear_steps=10, compile=compile_), 0.1
    return hg.StocBiO(0.1, inner_steps=10, linear_steps=10, compile=compile_), 0.1


def stochastic_runner(name: str, method: Any, outer_step: float, problem: hg.BilevelProblem,
                 inner: tuple[torch.Tensor, ...], outer: tuple[torch.Tensor, ...]) -> Callable[[int], Any]:
    indexed = name == "SABA"
    inner_stream, outer_stream = batches(inner, indexed), batches(outer, indexed)
    per_call = 21 if name in ("AmIGO", "StocBiO") else 1
    loop = {"w": {"y": torch.zeros(100)}, "lam": {"x": torch.zeros(100)}, "state": None, "t": 0}

    def run(n: int) -> Any:
        w, lam, state, t = loop["w"], loop["lam"], loop["state"], loop["t"]
        for _ in range(n):
            inner_batch = (hg.batches.StepBatches([next(inner_stream) for _ in range(per_call)])
                           if per_call > 1 else next(inner_stream))
            r = method.hypergrad(problem, w, lam, inner_batch, next(outer_stream), state)
            gamma = outer_step / (t + 1) ** 0.5 if name == "SOBA" else outer_step
            w, state, lam, t = r.w, r.state, {"x": lam["x"] - gamma * r.grad["x"]}, t + 1
        loop.update(w=w, lam=lam, state=state, t=t)
        return lam["x"]

    return run


def run_stochastic(args: argparse.Namespace) -> None:
    rounds = args.rounds or (3 if args.quick else 7)
    iterations = args.iterations or ((64, 192) if args.quick else (128, 640))  # JAX: as many, in epochs
    torch.set_num_threads(1)
    import jax

    path = args.benchmark.resolve()
    data, inner_np, outer_np = load_instance(path)
    gap = loss_gap(data, inner_np, outer_np)
    inner, outer = tuple(map(torch.from_numpy, inner_np)), tuple(map(torch.from_numpy, outer_np))
    n_batches = inner[0].shape[0] // BATCH

    runners: dict[str, tuple[Callable[[int], Any], int]] = {}
    compile_s: dict[str, float] = {}
    for name in args.solvers:
        runners[f"{name} JAX (benchmark_bilevel)"] = stochastic_jax_runner(path, name, data)
        for compile_ in (False, True):
            method, outer_step = torch_method(name, compile_, n_batches)
            run = stochastic_runner(name, method, outer_step, hg.BilevelProblem(quadratic, quadratic), inner, outer)
            start = time.perf_counter()
            run(3)  # compiles (SABA: a second compile once its batch index changes)
            if compile_:
                compile_s[name] = time.perf_counter() - start
            runners[f"{name} hypergrad {'compile=True' if compile_ else 'eager'}"] = (run, 1)

    def counts(per_unit: int) -> tuple[int, int]:
        n1, n2 = iterations if per_unit == 1 else (iterations[0] // per_unit, iterations[1] // per_unit)
        return n1, max(n2, n1 + 1)

    samples, loads = interleaved_rounds(runners, rounds, counts)

    lines = ["| solver | runner | wall us/iter (median) | CPU us/iter (median) | wall ratio to JAX | CPU ratio to JAX |",
             "|---|---|---|---|---|---|"]
    summary: dict[str, float] = {}
    for name in args.solvers:
        jax_name = f"{name} JAX (benchmark_bilevel)"
        for kind in ("JAX (benchmark_bilevel)", "hypergrad eager", "hypergrad compile=True"):
            key = f"{name} {kind}"
            wall = statistics.median(s[0] for s in samples[key]) * 1e6
            cpu = statistics.median(s[1] for s in samples[key]) * 1e6
            wall_ratio = median_ratio(samples[key], samples[jax_name], 0)
            cpu_ratio = median_ratio(samples[key], samples[jax_name], 1)
            summary[key] = wall_ratio
            lines.append(f"| {name} | {kind} | {wall:.0f} | {cpu:.0f} | {wall_ratio:.2f} | {cpu_ratio:.2f} |")
    table = "\n".join(lines)
    compiled = ", ".join(f"{k} {v:.1f} s" for k, v in compile_s.items())
    header = report_header("Stochastic solvers per iteration: eager vs compile=True vs benchmark_bilevel's JAX solvers",
                           loads, f"torch {torch.__version__}, jax {jax.__version__}")
    report = f"""{header}

Instance: benchmark_bilevel `datasets/simulated.py` (defaults: d = 100, 1024 samples each side), minibatches
of {BATCH}, float32; torch loss vs the benchmark's jax loss on one batch: relative gap {gap:.1e}.
Per iteration = (time of {iterations[1]} - time of {iterations[0]} iterations) / {iterations[1] - iterations[0]}
(JAX: the same counts in whole `eval_freq` epochs), {rounds} interleaved rounds; ratios are medians of per-round ratios.
hypergrad compile time (first calls, excluded): {compiled}.

{table}
"""
    print(report)
    if not args.quick:
        (RESULTS / "stochastic_overhead.md").write_text(report)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="solvers", required=True, metavar="{bome,stochastic}")
    bome = sub.add_parser("bome", help="BOME and F2SA on the averaged quadratic (results/bome_overhead.md)")
    stochastic = sub.add_parser("stochastic", help="SOBA, SABA, AmIGO, StocBiO on minibatches "
                                "(results/stochastic_overhead.md)")
    for p in (bome, stochastic):
        p.add_argument("--benchmark", type=Path, required=True, help="checkout of benchmark_bilevel")
        p.add_argument("--quick", action="store_true", help="fewer rounds and iterations; print, write nothing")
        p.add_argument("--rounds", type=int, default=None)
    stochastic.add_argument("--iterations", type=int, nargs=2, default=None, metavar=("N1", "N2"),
                            help="iterations of the two timed runs (default 128 640; --quick 64 192)")
    stochastic.add_argument("--solvers", dest="names", nargs="+", default=list(JAX_SOLVERS), choices=list(JAX_SOLVERS))
    args = parser.parse_args(argv)
    if args.solvers == "bome":
        run_bome(args)
    else:
        args.solvers = args.names
        run_stochastic(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
