"""Measuring wall time, CPU time and peak memory of blocks of code (Linux ``/proc``; a coarser
fallback elsewhere).

* :class:`Phase`: wall time and peak resident memory of one ``with`` block, the kernel's RSS
  high-water mark reset at its start so the peak belongs to the block alone;
* :func:`timed` and :func:`interleave`: medians of wall and CPU seconds, several candidates timed
  in interleaved rounds after a warm-up (fair on a machine shared with other jobs);
* :func:`run_json_worker` and :func:`measurement_env`: one configuration per fresh process (a
  peak of one configuration is not inflated by what an earlier one left on the heap);
* :func:`bome_step_breakdown`: where a CALM (BOME) step's time goes, against a plain LoRA step;
* :func:`parameter_bytes`: the parameter storage a rank holds (its shards under FSDP2).

Benchmark-only tooling (not installed with ``llm_calib``): the benchmark scripts beside this
package import it as ``harness.profiling``.
"""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llm_calib.models import free_memory

if TYPE_CHECKING:
    import torch

__all__ = [
    "MB",
    "Phase",
    "bome_step_breakdown",
    "interleave",
    "measurement_env",
    "median",
    "parameter_bytes",
    "proc_status",
    "run_json_worker",
    "timed",
]

MB = 1024.0 * 1024.0
"""Bytes in a mebibyte."""


def parameter_bytes(model: torch.nn.Module) -> int:
    """Bytes of parameter storage this rank holds for ``model`` (a sharded weight: its local shard).

    Example:
        >>> import torch
        >>> parameter_bytes(torch.nn.Linear(3, 2))   # 6 weights and 2 biases in float32
        32
    """
    total = 0
    for param in model.parameters():
        local = param.to_local() if hasattr(param, "to_local") else param
        total += local.numel() * local.element_size()
    return total


def proc_status() -> dict[str, int]:
    """Resident set size now (``VmRSS``) and its high-water mark (``VmHWM``), in bytes.

    Raises:
        OSError: no ``/proc/self/status`` (not Linux).

    Example:
        >>> s = proc_status()  # doctest: +SKIP
        >>> s["VmHWM"] >= s["VmRSS"] > 0  # doctest: +SKIP
        True
    """
    text = Path("/proc/self/status").read_text()
    out = {}
    for key in ("VmRSS", "VmHWM"):
        match = re.search(rf"{key}:\s+(\d+)", text)
        if match is None:
            raise OSError(f"/proc/self/status has no {key}")
        out[key] = int(match.group(1)) * 1024
    return out


def _lifetime_peak() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class Phase:
    """Wall time and peak RSS of one block: ``with Phase() as p: ...``.

    At the start, memory the caller dropped is given back (:func:`llm_calib.models.free_memory`:
    garbage collection and a C-heap trim) and the kernel's high-water mark (``VmHWM``) is reset
    through ``/proc/self/clear_refs``, so the peak belongs to this block alone. Without ``/proc``
    it falls back to the process's lifetime peak (``ru_maxrss``), which is less precise.

    Attributes (after the block):
        seconds: wall time of the block.
        start: RSS at the start, bytes.
        peak: peak RSS during the block, bytes.
        over: ``peak - start`` (at least 0), bytes.
        how: which reading was used (``"VmHWM after reset"`` or the fallback).

    Example:
        >>> with Phase() as p:
        ...     block = bytearray(8 * 2**20)
        >>> p.seconds >= 0 and p.peak >= 0 and sorted(p.to_dict())
        ['how', 'peak_over_start_mb', 'peak_rss_mb', 'seconds']
    """

    def __enter__(self) -> Phase:
        free_memory()
        self.how = "VmHWM after reset"
        try:
            self.start = proc_status()["VmRSS"]
            Path("/proc/self/clear_refs").write_text("5")
        except (OSError, AttributeError):
            self.how = "ru_maxrss (lifetime peak; no /proc reset available)"
            self.start = _lifetime_peak()
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds = time.perf_counter() - self.t0
        try:
            self.peak = proc_status()["VmHWM"] if self.how.startswith("VmHWM") else _lifetime_peak()
        except OSError:
            self.peak = _lifetime_peak()
        self.over = max(0, self.peak - self.start)

    def to_dict(self) -> dict[str, Any]:
        """``seconds``, ``peak_rss_mb``, ``peak_over_start_mb`` and ``how``: a JSON record."""
        return {"seconds": self.seconds, "peak_rss_mb": self.peak / MB, "peak_over_start_mb": self.over / MB,
                "how": self.how}


def median(xs: Sequence[float]) -> float:
    """The median, NaN for no values.

    Example:
        >>> median([3.0, 1.0, 2.0]), median([])
        (2.0, nan)
    """
    return statistics.median(xs) if xs else float("nan")


def timed(fn: Callable[[], Any], repeats: int = 1) -> tuple[float, float, Any]:
    """Median wall and process-CPU seconds of ``repeats`` calls of ``fn``, and the last result.

    Raises:
        ValueError: ``repeats`` < 1.

    Example:
        >>> wall, cpu, out = timed(lambda: sum(range(1000)), repeats=3)
        >>> out, wall >= 0, cpu >= 0
        (499500, True, True)
    """
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    walls, cpus, out = [], [], None
    for _ in range(repeats):
        c0, t0 = time.process_time(), time.perf_counter()
        out = fn()
        walls.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
    return median(walls), median(cpus), out


def interleave(
    runners: dict[str, Callable[[], Any]],
    rounds: dict[str, int],
    budget_s: float,
    log: Callable[[str], None] = lambda message: None,
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Warm each runner up once, then time them in interleaved rounds with a rotating start.

    Runner ``name`` is timed up to ``rounds[name]`` times; once every runner has the smallest
    round count and ``budget_s`` seconds have passed, the remaining rounds are dropped.

    Args:
        runners: name -> a call to time.
        rounds: name -> the most timed calls (every name of ``runners``).
        budget_s: soft time limit of the timed rounds, seconds.
        log: receives one line per warm-up.

    Returns:
        ``(wall, cpu)``: name -> the wall and process-CPU seconds of each timed call.

    Raises:
        ValueError: a runner has no round count, or a count below 1.

    Example:
        >>> wall, cpu = interleave({"a": lambda: None, "b": lambda: None}, {"a": 2, "b": 3}, budget_s=60)
        >>> len(wall["a"]), len(wall["b"])
        (2, 3)
    """
    bad = [n for n in runners if rounds.get(n, 0) < 1]
    if bad:
        raise ValueError(f"rounds must give every runner at least 1 round; missing or < 1: {bad}")
    for name, fn in runners.items():
        t0 = time.perf_counter()
        fn()
        log(f"    warm-up {name}: {time.perf_counter() - t0:.2f}s")
    wall: dict[str, list[float]] = {k: [] for k in runners}
    cpu: dict[str, list[float]] = {k: [] for k in runners}
    names, t_start, r, least = list(runners), time.perf_counter(), 0, min(rounds[n] for n in runners)
    while pending := [n for n in names if len(wall[n]) < rounds[n]]:
        if r >= least and time.perf_counter() - t_start > budget_s:
            pending = [n for n in pending if len(wall[n]) < least]
            if not pending:
                break
        shift = r % len(pending)
        for name in pending[shift:] + pending[:shift]:
            c0, t0 = time.process_time(), time.perf_counter()
            runners[name]()
            wall[name].append(time.perf_counter() - t0)
            cpu[name].append(time.process_time() - c0)
        r += 1
    return wall, cpu


def measurement_env(threads: int) -> dict[str, str]:
    """The environment for a memory-measuring child process: ``threads`` OpenMP threads, and glibc
    serving large blocks through ``mmap`` and trimming at once, so freed tensors leave the RSS.

    Example:
        >>> measurement_env(2)["OMP_NUM_THREADS"]
        '2'
    """
    return dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0", OMP_NUM_THREADS=str(threads))


def run_json_worker(
    script: str | os.PathLike[str],
    config: Any,
    *,
    args: Sequence[str] = (),
    env: dict[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
) -> tuple[list[dict[str, Any]], subprocess.CompletedProcess[str]]:
    """Run ``python script --worker CONFIG.json [args]`` in a fresh process and read its answers.

    ``config`` is written to a temporary JSON file whose path follows ``--worker``; the worker
    prints one JSON object per line (other lines are ignored).

    Args:
        script: the Python script; it must accept ``--worker PATH``.
        config: any JSON-serialisable object.
        args: further command-line arguments.
        env: the child's environment (default: this process's).
        cwd: the child's working directory.

    Returns:
        ``(objects, process)``: the JSON objects the child printed, and the finished process
        (``returncode``, ``stderr``).

    Example:
        >>> import pathlib, tempfile
        >>> script = pathlib.Path(tempfile.mkdtemp()) / "w.py"
        >>> _ = script.write_text("import json, sys; print(json.dumps(json.load(open(sys.argv[2]))))")
        >>> run_json_worker(script, {"x": 1})[0]
        [{'x': 1}]
    """
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as fh:
        json.dump(config, fh)
    try:
        proc = subprocess.run([sys.executable, str(script), "--worker", fh.name, *args], capture_output=True, text=True,
                              env=env, check=False, cwd=None if cwd is None else str(cwd))
    finally:
        os.unlink(fh.name)
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")], proc


def bome_step_breakdown(trainer: Any, state: Any, repeats: int = 2) -> dict[str, Any]:
    """Where a BOME step's time goes, on the current step's batches: BOME's three gradient
    evaluations (one inner step, T = 1) and the whole hypergradient call, against the one gradient
    evaluation of a plain LoRA (cross-entropy) step on the same batch; each timed alone after a
    warm-up (wall and CPU medians of ``repeats`` calls).

    Args:
        trainer: a :class:`~llm_calib.calm.training.Trainer` of a CALM run with the BOME solver.
        state: its :class:`~llm_calib.calm.training.TrainState`.
        repeats: timed calls per part.

    Returns:
        Per part ``{"wall_s", "cpu_s"}``; ``floor_ratio``: CPU time of the three evaluations over
        the plain step's; ``call_ratio``: the whole call's over the plain step's.

    Example:
        >>> from llm_calib.config.calibration import CalibrationConfig, LoraSettings, TrainingSettings
        >>> from llm_calib.calm.run import resolve_run
        >>> from llm_calib.calm.training import build_trainer, init_state
        >>> from llm_calib.data import builtin_multiple_choice
        >>> from llm_calib.models import tiny_random_model
        >>> model, tok = tiny_random_model()
        >>> qs = builtin_multiple_choice(n_per_domain=2, domains=["capitals"])
        >>> cfg = CalibrationConfig(training=TrainingSettings(batch_size=2), lora=LoraSettings(layers=(1,)))
        >>> tr = build_trainer(model, tok, qs, qs, resolve_run(cfg, qs, qs))
        >>> out = bome_step_breakdown(tr, init_state(tr, evaluate_before=False), repeats=1)
        >>> out["call_ratio"] > 0, len(out)
        (True, 7)
    """
    import torch

    import hypergrad as hg

    inner, outer = trainer.train_batch(state.step), trainer.unlabeled_batch(state.step)
    lam, theta = {k: v.detach() for k, v in state.objective_state.lam.items()}, state.theta

    def g(w: Any, l_: Any) -> Any:
        return trainer.losses.inner(w, l_, inner)

    _, grad_w, _ = hg.autodiff.loss_and_grads(g, theta, lam)
    inner_lr = trainer.config.objective.solver.step_size(trainer.config.training.lr)
    w_hat = {k: (v - inner_lr * grad_w[k]).detach() for k, v in theta.items()}
    parts = {
        "grad g(w) (theta and lambda)": lambda: hg.autodiff.loss_and_grads(g, theta, lam),
        "g(w_hat) and its lambda-gradient": lambda: hg.autodiff.loss_and_grads(g, w_hat, lam, wrt_w=False),
        "grad f(w) (held-out batch)": lambda: hg.autodiff.loss_and_grads(
            lambda w, l_: trainer.losses.outer(w, l_, outer), theta, lam),
        "plain LoRA: grad CE(w)": lambda: hg.autodiff.loss_and_grads(
            lambda w, _l: trainer.losses.one_level(w, inner), theta, {"_": torch.zeros(1)}, wrt_lam=False),
        "whole BOME direction (hypergrad call)": lambda: state.objective_state.method.hypergrad(
            state.objective_state.problem, theta, lam, inner, outer, state.objective_state.solver_state),
    }
    out: dict[str, Any] = {}
    for name, fn in parts.items():
        fn()  # warm-up
        wall, cpu_s, _ = timed(fn, repeats)
        out[name] = {"wall_s": wall, "cpu_s": cpu_s}
    ce_cpu = out["plain LoRA: grad CE(w)"]["cpu_s"]
    out["floor_ratio"] = sum(v["cpu_s"] for k, v in out.items() if not k.startswith(("plain", "whole"))) / ce_cpu
    out["call_ratio"] = out["whole BOME direction (hypergrad call)"]["cpu_s"] / ce_cpu
    return out
