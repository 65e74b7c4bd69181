#!/usr/bin/env python
"""Per-iteration cost of SOBA, SABA, AmIGO and StocBiO: hypergrad eager vs ``compile=True`` vs the
JAX solvers of benchopt's ``benchmark_bilevel``.

Question (issue #26): on the benchmark's minibatch quadratic (d = 100, batch 64) an eager hypergrad
iteration of each stochastic solver took 1.7-3x the benchmark's jitted JAX iteration
(``benchmarks/results/hypergrad_benchopt.md``). Does ``compile=True`` bring each to <= 0.5x?

Usage (``/work/venv-bench``: torch, jax[cpu], jaxopt, benchopt; a checkout of benchmark_bilevel)::

    git clone https://github.com/benchopt/benchmark_bilevel /tmp/bb
    PYTHONPATH=. python benchmarks/stochastic_overhead.py --benchmark /tmp/bb          # writes the results file
    PYTHONPATH=. python benchmarks/stochastic_overhead.py --benchmark /tmp/bb --quick  # prints only

One process, single-threaded (``torch.set_num_threads(1)``, XLA's CPU backend without its Eigen
thread pool), float32 on both sides. The instance is the benchmark's ``datasets/simulated.py``
(default parameters: 1024 inner and outer samples, d = 100); the per-sample matrices for torch come
from the benchmark's ``gen_matrices`` with the keys its ``get_data`` uses, and the two losses are
compared on one batch (the gap is printed). The JAX side is each solver's own jitted epoch
(``Solver.one_epoch``: ``eval_freq`` iterations in one ``lax.scan``, minibatches drawn by its
sampler inside the scan), waited for with ``block_until_ready``. The hypergrad side is a plain loop
over ``method.hypergrad`` with contiguous batches of 64 samples and ``lam <- lam - gamma * grad``;
SABA's batches are ``(index, batch)`` pairs with a Python ``int`` index, AmIGO's and StocBiO's
inner batches a :class:`hypergrad.batches.StepBatches` (a fresh batch per step, as the benchmark's
samplers). Parameters: the benchmark's (``config/quadratics_021424_best_params.yml`` where it has
them): SOBA step 0.1 (decreasing, exponent 0.5), SABA step 0.1, AmIGO step 0.01 / outer 0.1,
T = L = 10, StocBiO step 0.1, T = Q = 10.

Timing: per iteration = (time of N2 - time of N1 iterations) / (N2 - N1) (JAX: whole epochs), so
one-off costs cancel; compilation happens before timing. Runners are interleaved over rounds; the
table reports medians of wall and of process CPU time and the median of per-round ratios.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import importlib.util
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

os.environ.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np
import torch
from hypergrad_benchopt import generator_samples

import hypergrad as hg

RESULTS = Path(__file__).resolve().parent / "results"
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
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


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


def jax_runner(path: Path, name: str, data: dict[str, Any]) -> tuple[Callable[[int], Any], int]:
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


def torch_runner(name: str, method: Any, outer_step: float, problem: hg.BilevelProblem,
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


def per_iteration(run: Callable[[int], Any], n1: int, n2: int, per_unit: int) -> tuple[float, float]:
    """(wall, process CPU) seconds per iteration from the difference of an n2 and an n1 run."""
    w0, c0 = time.perf_counter(), time.process_time()
    run(n1)
    w1, c1 = time.perf_counter(), time.process_time()
    run(n2)
    w2, c2 = time.perf_counter(), time.process_time()
    return ((w2 - w1) - (w1 - w0)) / ((n2 - n1) * per_unit), ((c2 - c1) - (c1 - c0)) / ((n2 - n1) * per_unit)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--benchmark", type=Path, required=True, help="checkout of benchmark_bilevel")
    parser.add_argument("--quick", action="store_true", help="fewer rounds and iterations; print, write nothing")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--iterations", type=int, nargs=2, default=None, metavar=("N1", "N2"),
                        help="iterations of the two timed runs (default 128 640; --quick 64 192)")
    parser.add_argument("--solvers", nargs="+", default=list(JAX_SOLVERS), choices=list(JAX_SOLVERS))
    args = parser.parse_args()
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
        runners[f"{name} JAX (benchmark_bilevel)"] = jax_runner(path, name, data)
        for compile_ in (False, True):
            method, outer_step = torch_method(name, compile_, n_batches)
            run = torch_runner(name, method, outer_step, hg.BilevelProblem(quadratic, quadratic), inner, outer)
            start = time.perf_counter()
            run(3)  # compiles (SABA: a second compile once its batch index changes)
            if compile_:
                compile_s[name] = time.perf_counter() - start
            runners[f"{name} hypergrad {'compile=True' if compile_ else 'eager'}"] = (run, 1)

    loads: list[str] = []
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in runners}
    for _ in range(rounds):
        loads.append(Path("/proc/loadavg").read_text().split()[0])
        for name, (run, per_unit) in runners.items():
            n1, n2 = iterations if per_unit == 1 else (iterations[0] // per_unit, iterations[1] // per_unit)
            samples[name].append(per_iteration(run, n1, max(n2, n1 + 1), per_unit))

    lines = ["| solver | runner | wall us/iter (median) | CPU us/iter (median) | wall ratio to JAX | CPU ratio to JAX |",
             "|---|---|---|---|---|---|"]
    summary: dict[str, float] = {}
    for name in args.solvers:
        jax_name = f"{name} JAX (benchmark_bilevel)"
        for kind in ("JAX (benchmark_bilevel)", "hypergrad eager", "hypergrad compile=True"):
            key = f"{name} {kind}"
            wall = statistics.median(s[0] for s in samples[key]) * 1e6
            cpu = statistics.median(s[1] for s in samples[key]) * 1e6
            wall_ratio = statistics.median(a[0] / b[0] for a, b in zip(samples[key], samples[jax_name], strict=True))
            cpu_ratio = statistics.median(a[1] / b[1] for a, b in zip(samples[key], samples[jax_name], strict=True))
            summary[key] = wall_ratio
            lines.append(f"| {name} | {kind} | {wall:.0f} | {cpu:.0f} | {wall_ratio:.2f} | {cpu_ratio:.2f} |")
    table = "\n".join(lines)
    command = "PYTHONPATH=. " + " ".join([Path(sys.executable).as_posix(), *sys.argv])
    compiled = ", ".join(f"{k} {v:.1f} s" for k, v in compile_s.items())
    report = f"""# Stochastic solvers per iteration: eager vs compile=True vs benchmark_bilevel's JAX solvers

Command: `{command}`
Date: {_dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}
Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores (shared with other jobs), single-threaded runs;
load average (1 min) at the start of each round: {", ".join(loads)}.
Versions: torch {torch.__version__}, jax {jax.__version__}, python {platform.python_version()}.

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


if __name__ == "__main__":
    main()
