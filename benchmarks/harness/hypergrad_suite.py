"""The shared harness of the hypergrad benchmarks (``hypergrad_bench.py`` and its parts).

What every part uses besides the problems (``harness.hypergrad_problems``), in one place:

- :class:`Runner` (one method on one problem), the peers' lazy imports (:func:`peers`,
  :func:`jax_module`) and :func:`make_runners`, which asks each concern module for its runners;
- interleaved CPU timing (:func:`time_interleaved`) and memory measurement in fresh processes
  (:func:`measure_memory`);
- :class:`Row`, :func:`run_problem` and :func:`suite`: the six numbered problems, each timed with
  the runners of the concerns given;
- :func:`metadata` and :func:`fmt_value` for the reports.

A *concern* is a module (``hg_implicit``, ``hg_unrolled``, ``hg_first_order``) with ``GROUPS``,
the ``make_runners`` selectors it serves, ``add_runners(b, sizes, K, want, add)``, which adds the
runners of the wanted groups, and ``after_problem(b, sizes, log)``, which runs its per-problem
experiments (preconditioning, the hyper-cleaning loop) and returns their result lists by key
(:func:`no_experiments` where there are none). The suite times every runner of one problem
interleaved, whichever concern it comes from; the entry ``hypergrad_bench.py`` passes them all.
"""

from __future__ import annotations

import copy
import gc
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import Tensor, nn

import hypergrad as hg
from harness.hypergrad_problems import (
    MODES,
    TINY,
    Bench,
    Sizes,
    Tree,
    build_bench,
    flat,
    fresh_leaves,
    rel_err,
)
from harness.profiling import Phase, measurement_env
from harness.report import machine_info

warnings.filterwarnings("ignore", category=FutureWarning)  # torchopt's functorch deprecations
warnings.filterwarnings("ignore", category=DeprecationWarning)
warnings.filterwarnings("ignore", category=UserWarning, module="higher")
warnings.filterwarnings("ignore", category=hg.ConvergenceWarning)  # reported in the tables

RESULTS = Path(__file__).resolve().parent.parent / "results"
MB = 1024.0 * 1024.0


# ------------------------------------------------------------------------------ runners


@dataclass
class Runner:
    """One hypergradient method on one problem: ``fn()`` returns the flat hypergradient."""

    name: str
    library: str  # "hypergrad" | "torchopt" | "higher" | "(unit)"
    family: str  # "implicit-cg", "implicit-neumann", "unrolled-reverse", ...
    fn: Callable[[], Tensor]
    info: dict[str, Any] = field(default_factory=dict)
    warm: Callable[[], Any] | None = None  # cheaper warm-up for the memory worker
    group: str = ""  # the make_runners selector that builds it
    clock: str = "thread"  # "thread": the calling thread's CPU time; "process": all threads'


def peers() -> tuple[Any, Any]:
    """torchopt and higher, imported on first use (their import warnings silenced)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import higher
        import torchopt
    return torchopt, higher

_JAX: dict[str, Any] = {}


def jax_module() -> Any | None:
    """jax (float64, one XLA thread) and jaxopt, or None when the bench extra is not installed."""
    if "mod" not in _JAX:
        # one intra-op thread, like torch.set_num_threads(1) for the other libraries; must be set
        # before jax creates its CPU backend
        os.environ.setdefault(
            "XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1")
        try:
            import jax
            import jaxopt  # noqa: F401

            jax.config.update("jax_enable_x64", True)
            _JAX["mod"] = jax
        except Exception:  # not installed (the bench extra is optional): rows are left out
            _JAX["mod"] = None
    return _JAX["mod"]


def ours(b: Bench, method: Any, name: str, family: str, state: dict | None = None) -> Runner:
    """hypergrad's ``method`` on ``b`` as a runner (its iterations and gradient evaluations in ``info``)."""
    problem = b.problem
    holder: dict[str, Any] = {"state": state}
    info: dict[str, Any] = {}

    def fn() -> Tensor:
        # Penalty: every call starts from the steady state (w, w_sigma at their optima for this
        # lam, the state a long outer loop carries), so the T=1 step is what a call costs.
        r = method.hypergrad(problem, b.w, b.lam, state=holder["state"])
        info.update(iterations=r.info.iterations, grad_evals=r.info.grad_evals,
                    converged=r.info.converged)
        return flat(r.grad)

    return Runner(name, "hypergrad", family, fn, info)


def loaded_copy(model: nn.Module, w: Tree, requires_grad: bool) -> nn.Module:
    """A deep copy of ``model`` holding the parameters ``w`` (for higher and MetaSGD)."""
    m = copy.deepcopy(model)
    with torch.no_grad():
        for k, p in m.named_parameters():
            p.copy_(w[k])
            p.requires_grad_(requires_grad)
    return m


def _grad_unit(b: Bench) -> Runner:
    w_ = fresh_leaves(b.w)
    leaves = list(w_.values())

    def fn() -> Tensor:
        return flat(torch.autograd.grad(b.g(w_, b.lam), leaves))

    return Runner("one inner gradient (unit)", "(unit)", "unit", fn)


def _hvp_unit(b: Bench) -> Runner:
    """One Hessian-vector product on hypergrad's retained graph (the cost of one CG iteration)."""
    from hypergrad.autodiff import RootSystem

    root = RootSystem(b.problem, b.w, b.lam, None)
    gen = torch.Generator().manual_seed(1)
    u = torch.randn(b.n_params, generator=gen, dtype=b.dtype)
    return Runner("one Hessian-vector product (retained graph)", "(unit)", "unit-hvp",
                  lambda: root.rmatvec_flat(u))


def cg_settings(b: Bench, sizes: Sizes) -> tuple[float, int]:
    """The CG tolerance and iteration cap of the solve-based runners on ``b``: ``sizes.tol`` and 2000
    iterations, or exactly ``b.extra["maxiter"]`` iterations where the spec fixes them."""
    maxiter = b.extra.get("maxiter")  # fixed CG iterations (MLP: non-convex, no tolerance target)
    cg_tol = 0.0 if maxiter else sizes.tol
    cg_maxiter = maxiter or 2000
    return cg_tol, cg_maxiter


Want = Callable[[str], bool]  # want(group): make_runners was asked for this group
Add = Callable[..., None]  # add(group, *runners): append runners built by that group


class Concern(Protocol):
    """A concern module (``hg_implicit``, ``hg_unrolled``, ``hg_first_order``), see the module doc."""

    GROUPS: tuple[str, ...]

    def add_runners(self, b: Bench, sizes: Sizes, K: int, want: Want, add: Add) -> None: ...

    def after_problem(self, b: Bench, sizes: Sizes, log: Callable[[str], None]) -> dict[str, list]: ...


def no_experiments(b: Bench, sizes: Sizes, log: Callable[[str], None]) -> dict[str, list]:
    """``after_problem`` of a concern with no experiment beyond the timings."""
    return {}


def make_runners(b: Bench, sizes: Sizes, concerns: tuple[Concern, ...], which: list[str] | None = None,
                 K: int | None = None) -> list[Runner]:
    """All runners of the ``concerns`` for a problem, in their order, after the unit runners
    (``which`` restricts to the named groups)."""
    peers()
    K = K if K is not None else b.extra.get("K", sizes.unroll_k)
    runners: list[Runner] = []

    def want(group: str) -> bool:
        return which is None or group in which

    def add(group: str, *new: Runner) -> None:
        for r in new:
            r.group = group
            runners.append(r)

    if want("unit"):
        add("unit", _grad_unit(b))
    if want("unit-hvp"):
        add("unit-hvp", _hvp_unit(b))
    for concern in concerns:
        concern.add_runners(b, sizes, K, want, add)
    return runners


# ------------------------------------------------------------------------------- timing


def cpu_timer(threads: int) -> Callable[[], float]:
    """CPU time of the computation: the calling thread's with one torch thread (the autograd engine
    and every kernel then run on it), the process's otherwise.

    Wall time is not used: on a shared machine a computation longer than the scheduler's slice is
    preempted by other processes, which inflates long calls more than short ones and would bias
    both the ratios and the gradient-equivalents. On an idle machine with one thread CPU time
    equals wall time.
    """
    return time.thread_time if threads == 1 else time.process_time


def time_interleaved(runners: list[Runner], sizes: Sizes, log: Callable[[str], None],
                     threads: int = 1) -> dict[str, Any]:
    """Warm up, then time rounds A B C ... (rotating the start), until ``repeats`` rounds or the
    time budget. Returns per-runner medians, all samples and the first call's output."""
    thread_clock = cpu_timer(threads)
    clocks = {r.name: time.process_time if r.clock == "process" else thread_clock for r in runners}
    outputs: dict[str, Tensor] = {}
    samples: dict[str, list[float]] = {r.name: [] for r in runners}
    wall: dict[str, list[float]] = {r.name: [] for r in runners}
    start = time.perf_counter()
    for r in runners:  # warm-up (unrolled runners: a 2-step call exercises the same code)
        (r.warm or r.fn)()
    warm_s = time.perf_counter() - start
    start = time.perf_counter()
    rounds = 0
    gc.collect()
    while rounds < sizes.repeats:
        order = runners[rounds % len(runners):] + runners[: rounds % len(runners)]
        gc.disable()  # as timeit does: no collector pauses inside the timed calls
        try:
            for r in order:
                clock = clocks[r.name]
                w0 = time.perf_counter()
                t0 = clock()
                out = r.fn()
                samples[r.name].append(clock() - t0)
                wall[r.name].append(time.perf_counter() - w0)
                outputs.setdefault(r.name, out)  # the accuracy sample: first timed call
        finally:
            gc.enable()
        rounds += 1
        elapsed = time.perf_counter() - start
        per_round = elapsed / rounds
        # expensive instances (a round longer than a third of the budget) may stop after one round
        min_rounds = sizes.min_repeats if per_round < sizes.budget_s / 3 else 1
        if rounds >= min_rounds and elapsed + per_round > sizes.budget_s:
            break
    log(f"    timed {rounds} interleaved round(s) of {len(runners)} runners in "
        f"{time.perf_counter() - start:.1f}s (warm-up {warm_s:.1f}s)")
    return {
        "median": {k: statistics.median(v) for k, v in samples.items()},
        "wall_median": {k: statistics.median(v) for k, v in wall.items()},
        "samples": samples,
        "outputs": outputs,
        "rounds": rounds,
    }


# ------------------------------------------------------------------------------- memory

# The memory worker: the entry script, whose hidden ``--worker`` flag calls :func:`worker` with
# every concern, so any part's configurations can be measured from any script.
WORKER_SCRIPT = Path(__file__).resolve().parent.parent / "hypergrad_bench.py"


def _dry_run(concerns: tuple[Concern, ...]) -> None:
    """Trigger every lazy import and first-call initialisation (torch.func, torchopt, higher)."""
    spec = {"key": "dry", "kind": "ridge", "n": 20, "d": 4, "scalar": True, "K": 2}
    b = build_bench(spec)
    for r in make_runners(b, replace(TINY, neumann_cap=5), concerns, K=2):
        r.fn()


def _measure_one(config: dict[str, Any], concerns: tuple[Concern, ...]) -> dict[str, Any]:
    """Inside a fresh process: build, warm up, reset the peak-RSS counter, run once."""
    torch.set_num_threads(config["threads"])
    sizes = MODES[config["mode"]]
    t_build = time.perf_counter()
    b = build_bench(config["spec"], Path(config["cache"]))
    b.extra.update(config.get("extra", {}))
    runners = make_runners(b, sizes, concerns, [config["group"]], K=config.get("K"))
    runner = next(r for r in runners if r.name == config["name"])
    t_warm = time.perf_counter()
    # Methods whose memory does not grow with K warm up at full size (their peak is small, so
    # allocator state matters); the others warm up with K = 2 (their peak dwarfs that noise).
    lean = runner.family in ("unrolled-forward", "unrolled-checkpoint", "unrolled-truncated")
    (runner.fn if lean or runner.warm is None else runner.warm)()
    t_warm_end = time.perf_counter()
    with Phase() as phase:
        runner.fn()
    return {"peak_mb": phase.over / MB, "seconds": phase.seconds, "how": phase.how,
            "build_s": t_warm - t_build, "warm_s": t_warm_end - t_warm}


def worker(config_path: str, concerns: tuple[Concern, ...]) -> None:
    """Hidden ``--worker`` entry: one forked child per configuration, JSON lines on stdout
    (``concerns``: those whose runner groups the configurations name)."""
    configs = json.loads(Path(config_path).read_text())
    _JAX["mod"] = None  # no jax in the memory worker: it forks, and jax is multithreaded
    peers()  # import once in the parent; children start from this import-only state
    import sklearn.datasets  # noqa: F401

    _dry_run(concerns)
    gc.collect()
    for config in configs:
        if hasattr(os, "fork"):
            rfd, wfd = os.pipe()
            pid = os.fork()
            if pid == 0:  # child
                os.close(rfd)
                try:
                    out = _measure_one(config, concerns)
                except Exception as exc:  # report, do not kill the sweep
                    out = {"error": f"{type(exc).__name__}: {exc}"[:300]}
                os.write(wfd, json.dumps(out).encode())
                os.close(wfd)
                os._exit(0)
            os.close(wfd)
            chunks = []
            while True:
                chunk = os.read(rfd, 65536)
                if not chunk:
                    break
                chunks.append(chunk)
            os.close(rfd)
            os.waitpid(pid, 0)
            text = b"".join(chunks).decode() or '{"error": "child died"}'
            out = json.loads(text)
        else:
            out = _measure_one(config, concerns)
        print(json.dumps({"id": config["id"], **out}), flush=True)


def measure_memory(configs: list[dict[str, Any]], threads: int, log: Callable[[str], None]) -> dict[str, dict]:
    """Run the configurations in a worker subprocess (``WORKER_SCRIPT --worker``, forking a fresh
    child for each)."""
    if not configs:
        return {}
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as fh:
        json.dump(configs, fh)
        path = fh.name
    env = measurement_env(threads)  # large allocations through mmap, returned on free: RSS tracks live tensors
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, str(WORKER_SCRIPT), "--worker", path, "--threads", str(threads)],
        capture_output=True, text=True, env=env, check=False,
    )
    os.unlink(path)
    results: dict[str, dict] = {}
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            item = json.loads(line)
            results[item.pop("id")] = item
    if proc.returncode != 0:
        log(f"    memory worker exited with {proc.returncode}: {proc.stderr[-500:]}")
    log(f"    memory: {len(results)}/{len(configs)} configurations in {time.perf_counter() - t0:.1f}s")
    return results


# ---------------------------------------------------------------------------- the suite


@dataclass
class Row:
    problem: str
    name: str
    library: str
    family: str
    time_s: float
    geq: float
    error: float | None
    agree: float | None = None  # relative difference to the paired runner (same estimator)
    iterations: int | None = None
    grad_evals: int | None = None
    peak_mb: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def fill_memory(rows: list[Row], threads: int, log: Callable[[str], None]) -> None:
    """Measure every row's peak memory in fresh processes, interleaving ours and the peers."""
    todo = [r for r in rows if "memory_config" in r.extra]
    configs = []
    for i, r in enumerate(todo):
        configs.append({"id": str(i), **r.extra.pop("memory_config")})
    mem = measure_memory(configs, threads, log)
    for i, r in enumerate(todo):
        m = mem.get(str(i), {})
        if "peak_mb" in m:
            r.peak_mb = m["peak_mb"]
        elif "error" in m:
            r.extra["memory_error"] = m["error"]


def run_problem(
    b: Bench, sizes: Sizes, runners: list[Runner], cache: Path | None, threads: int,
    log: Callable[[str], None], memory: bool,
) -> list[Row]:
    """Time the runners (interleaved); attach each row's memory configuration (measured later, in
    fresh processes, by :func:`fill_memory`)."""
    log(f"  {b.title} (set-up {b.extra.get('build_s', 0.0):.1f}s)")
    # Implicit Dense builds an n x n matrix (30 MB at d = 1000): interleaved with the others it
    # evicts their data from the caches, and the runner after it in each round pays for that
    # (ridge d = 1000, Penalty: 4.9 gradient-equivalents with Dense in the rounds, 4.2 without,
    # 3.25 timed with the unit gradient alone). It is timed in its own rounds after the others.
    main_runners = [r for r in runners if r.family != "implicit-dense"]
    timing = time_interleaved(main_runners, sizes, log, threads)
    heavy = [r for r in runners if r.family == "implicit-dense"]
    if heavy:
        extra_timing = time_interleaved(heavy, sizes, log, threads)
        for key in ("median", "wall_median", "samples", "outputs"):
            timing[key].update(extra_timing[key])
    unit = timing["median"]["one inner gradient (unit)"]
    outs = timing["outputs"]
    rows = []
    by_family: dict[str, Tensor] = {}
    for r in runners:
        if r.library == "hypergrad" and r.family not in by_family:
            by_family[r.family] = outs[r.name]
    for r in runners:
        t = timing["median"][r.name]
        err = (rel_err(outs[r.name], b.reference)
               if b.reference is not None and not r.family.startswith("unit") else None)
        fam = "unrolled-reverse" if r.family.startswith("unrolled-reverse") else r.family
        agree = None
        if r.library in ("torchopt", "higher", "jaxopt") and fam in by_family:
            agree = rel_err(outs[r.name], by_family[fam])
        if r.family in ("implicit-cg-compiled", "implicit-dense", "implicit-cg-floor") and "implicit-cg" in by_family:  # vs CG
            agree = rel_err(outs[r.name], by_family["implicit-cg"])
        if r.family in ("unrolled-stored", "unrolled-all") and "unrolled-reverse" in by_family:  # vs default
            agree = rel_err(outs[r.name], by_family["unrolled-reverse"])
        extra = {"n_params": b.n_params, "n_hyper": b.n_hyper, "wall_s": timing["wall_median"][r.name]}
        for key in ("compile_s", "compiled"):
            if key in r.info:
                extra[key] = r.info[key]
        rows.append(Row(b.key, r.name, r.library, r.family, t, t / unit, err, agree,
                        r.info.get("iterations"), r.info.get("grad_evals"), extra=extra))
    if sizes.memory_only is not None and not b.key.startswith(sizes.memory_only):
        memory = False
    if memory and cache is not None:
        for r in runners:
            # jaxopt: XLA's own allocator and threads; not measured (forking after jax starts
            # its threads is unsafe); the floor row is a timing reference only
            if (r.family.startswith("unit") or r.library == "jaxopt"
                    or r.family in ("implicit-cg-compiled", "implicit-cg-floor")):
                continue
            row = next(x for x in rows if x.name == r.name)
            row.extra["memory_config"] = {
                "spec": b.extra_spec, "cache": str(cache), "mode": sizes.name, "threads": threads,
                "group": r.group, "name": r.name, "K": b.extra.get("K"),
                "extra": {k: v for k, v in b.extra.items() if k == "neumann_steps"},
            }
    return rows

_TITLES: dict[str, str] = {}
_REF_NOTES: dict[str, str] = {}


def _spec_bench(spec: dict[str, Any], cache: Path | None) -> Bench:
    b = build_bench(spec, cache)
    b.extra_spec = spec  # type: ignore[attr-defined]
    _TITLES[b.key] = b.title + (f", K={spec['K']}" if spec["kind"] == "mlp" else "")
    _REF_NOTES[b.key] = b.ref_note
    return b


def suite(sizes: Sizes, concerns: tuple[Concern, ...], threads: int = 1, log: Callable[[str], None] = print,
          cache: Path | None = None) -> dict[str, Any]:
    """Run every problem with the runners of ``concerns`` (a problem none of them serves is left
    out); return rows, the concerns' per-problem results (``after_problem``) and metadata."""
    threads_before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return _suite(sizes, concerns, threads, log, cache)
    finally:
        torch.set_num_threads(threads_before)


def _suite(sizes: Sizes, concerns: tuple[Concern, ...], threads: int, log: Callable[[str], None],
           cache: Path | None) -> dict[str, Any]:
    own_cache = cache is None
    if own_cache:
        cache = Path(tempfile.mkdtemp(prefix="hgbench-"))
    memory = sizes.memory
    t_start = time.perf_counter()
    rows: list[Row] = []
    extras: dict[str, list[dict[str, Any]]] = {}  # the concerns' per-problem results, by key
    all_families = None
    served = {group for concern in concerns for group in concern.GROUPS}  # units alone compare nothing

    def run(n: int) -> bool:
        return sizes.problems is None or n in sizes.problems

    def serves(fams: list[str] | None) -> bool:
        """A concern serves one of ``fams`` (``None``: every family)."""
        return bool(served) if fams is None else bool(served & set(fams))

    def after(b: Bench) -> None:
        for concern in concerns:
            for key, items in concern.after_problem(b, sizes, log).items():
                extras.setdefault(key, []).extend(items)

    # 1. ridge
    for scalar in ((True, False) if run(1) and serves(all_families) else ()):
        spec = {"key": f"ridge_{'scalar' if scalar else 'feature'}", "kind": "ridge", "n": sizes.ridge_n,
                "d": sizes.ridge_d, "scalar": scalar, "K": sizes.unroll_k}
        b = _spec_bench(spec, cache)
        rows += run_problem(b, sizes, make_runners(b, sizes, concerns, all_families), cache, threads, log,
                            memory)
        after(b)

    # 1b. per-feature ridge at a larger d: the implicit runners only (jaxopt's comparison)
    fams = ["unit", "unit-hvp", "implicit-cg", "implicit-cg-compiled", "implicit-dense", "penalty"]
    for d in (sizes.ridge_large_d if run(1) and serves(fams) else ()):
        spec = {"key": f"ridge_feature_d{d}", "kind": "ridge", "n": sizes.ridge_n, "d": d,
                "scalar": False, "K": sizes.unroll_k}
        b = _spec_bench(spec, cache)
        rows += run_problem(b, sizes, make_runners(b, sizes, concerns, fams), cache, threads, log, memory)
        after(b)

    # 2. logistic, d sweep
    for d in (sizes.logistic_ds if run(2) else ()):
        fams = ["unit", "unit-hvp", "implicit-cg", "implicit-cg-compiled", "implicit-dense", "implicit-neumann",
                "fd", "penalty"]
        if d <= sizes.logistic_unrolled_max_d:
            fams += ["unrolled-reverse", "unrolled-truncated"]
        if not serves(fams):
            continue
        spec = {"key": f"logistic_d{d}", "kind": "logistic", "n": sizes.logistic_n, "d": d,
                "scalar": False, "K": sizes.unroll_k}
        b = _spec_bench(spec, cache)
        rows += run_problem(b, sizes, make_runners(b, sizes, concerns, fams), cache, threads, log, memory)
        after(b)

    # 3. hyper-cleaning: single hypergradients, then the outer loop (hg_implicit's after_problem)
    if run(3) and serves(all_families):
        spec = {"key": "clean", "kind": "clean", "n_train": sizes.clean_train, "K": sizes.clean_unroll_k,
                "sigma": 1e-2, "inner_iters": sizes.lbfgs_iters}
        b_clean = _spec_bench(spec, cache)
        rows += run_problem(b_clean, sizes, make_runners(b_clean, sizes, concerns, all_families), cache,
                            threads, log, memory)
        after(b_clean)

    # 4. MLP: scaling in the parameter count
    fams = ["unit", "unit-hvp", "implicit-cg", "implicit-cg-compiled", "unrolled-reverse", "unrolled-stored",
            "unrolled-all",
            "unrolled-checkpoint", "unrolled-forward", "fd", "penalty"]
    for width in (sizes.mlp_widths if run(4) and serves(fams) else ()):
        spec = {"key": f"mlp_w{width}", "kind": "mlp", "width": width, "batch": sizes.mlp_batch,
                "K": sizes.mlp_k, "maxiter": 10, "sigma": 1e-2,
                "inner_iters": 100 if width >= 512 else min(200, sizes.lbfgs_iters)}
        b = _spec_bench(spec, cache)
        rows += run_problem(b, sizes, make_runners(b, sizes, concerns, fams), cache, threads, log, memory)
        after(b)

    # 5. unroll length sweep on a small MLP
    fams = ["unit", "unrolled-reverse", "unrolled-stored", "unrolled-all", "unrolled-checkpoint",
            "unrolled-truncated", "unrolled-forward"]
    for K in (sizes.ks if run(5) and serves(fams) else ()):
        spec = {"key": f"mlp_w{sizes.ksweep_width}", "label": f"ksweep_K{K}", "kind": "mlp",
                "width": sizes.ksweep_width, "batch": sizes.mlp_batch, "K": K, "maxiter": 10,
                "sigma": 1e-2, "inner_iters": min(200, sizes.lbfgs_iters)}
        b = _spec_bench(spec, cache)
        rows += run_problem(b, sizes, make_runners(b, sizes, concerns, fams), cache, threads, log, memory)
        after(b)

    # 6. forward-mode memory against K on a larger MLP (a working set well above the ~0.3 MB the
    #    Python interpreter's free lists and heap add to any long loop)
    width = sizes.mlp_widths[min(1, len(sizes.mlp_widths) - 1)]
    fams = ["unit", "unrolled-forward"]
    for K in (sizes.flat_ks if run(6) and serves(fams) else ()):
        spec = {"key": f"mlp_w{width}", "label": f"fwdflat_K{K}", "kind": "mlp", "width": width,
                "batch": sizes.mlp_batch, "K": K, "maxiter": 10, "sigma": 1e-2,
                "inner_iters": 100 if width >= 512 else min(200, sizes.lbfgs_iters)}
        b = _spec_bench(spec, cache)
        rows += run_problem(b, sizes, make_runners(b, sizes, concerns, fams), cache, threads, log, memory)
        after(b)

    if memory:
        fill_memory(rows, threads, log)
    if own_cache:
        shutil.rmtree(cache, ignore_errors=True)
    elapsed = time.perf_counter() - t_start
    return {"rows": rows, **extras, "elapsed_s": elapsed, "threads": threads,
            "sizes": sizes, "meta": metadata(threads), "titles": dict(_TITLES),
            "ref_notes": dict(_REF_NOTES)}


# ----------------------------------------------------------------------- report helpers


def fmt_value(x: float | None, spec: str = ".2f", none: str = "-") -> str:
    """``x`` formatted with ``spec``; ``none`` for None or NaN."""
    return none if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def metadata(threads: int) -> dict[str, Any]:
    """Date, machine, load and library versions for a report header (:func:`harness.report.machine_info`)."""
    return machine_info(threads, libraries=("torch", "torchopt", "higher", "jax", "jaxopt")) | {"hypergrad": hg.__version__}
