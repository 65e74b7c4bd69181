"""harness.profiling (benchmarks/harness): the memory phase sees what a block allocates, the timers
interleave and count as documented, a worker process answers in JSON, the BOME breakdown covers its
parts."""

from __future__ import annotations

import doctest
import json
import sys

import pytest
import torch
from _benchmarks import BENCHMARKS  # noqa: F401  (puts benchmarks/ on sys.path for harness)
from harness import profiling
from harness.profiling import (
    MB,
    Phase,
    bome_step_breakdown,
    interleave,
    measurement_env,
    median,
    run_json_worker,
    timed,
)

from llm_calib.calm.run import resolve_run
from llm_calib.calm.training import build_trainer, init_state
from llm_calib.config.calibration import CalibrationConfig, LoraSettings
from llm_calib.data import builtin_multiple_choice


def test_the_memory_phase_sees_an_allocation_of_known_size() -> None:
    """A stub reporting 0 fails: 64 MB allocated and touched inside the phase show in its peak."""
    with Phase() as phase:
        block = torch.ones(16 * 1024 * 1024)  # 64 MB of float32, written
        assert float(block[-1]) == 1.0
        del block
    if not phase.how.startswith("VmHWM"):
        pytest.skip("no /proc high-water-mark reset on this system")
    assert phase.over / MB >= 60
    with Phase() as idle:
        pass
    assert idle.over / MB < phase.over / MB / 2
    record = phase.to_dict()
    assert record["peak_over_start_mb"] == pytest.approx(phase.over / MB)
    assert record["peak_rss_mb"] == pytest.approx(phase.peak / MB) and record["seconds"] == phase.seconds


def test_timed_returns_medians_and_the_last_result() -> None:
    calls = []
    wall, cpu, out = timed(lambda: calls.append(len(calls)) or len(calls), repeats=3)
    assert out == 3 and len(calls) == 3 and wall >= 0 and cpu >= 0
    assert median([5.0, 1.0, 3.0, 100.0]) == 4.0
    with pytest.raises(ValueError, match="repeats must be at least 1, got 0"):
        timed(lambda: None, repeats=0)


def test_interleave_warms_up_rotates_and_respects_rounds_and_budget() -> None:
    order: list[str] = []
    runners = {"a": lambda: order.append("a"), "b": lambda: order.append("b")}
    wall, cpu = interleave(runners, {"a": 2, "b": 3}, budget_s=1e9)
    assert order == ["a", "b", "a", "b", "b", "a", "b"]  # warm-ups, round 0, round 1 rotated, b's third
    assert [len(wall["a"]), len(wall["b"]), len(cpu["b"])] == [2, 3, 3]
    order.clear()
    wall, _ = interleave(runners, {"a": 5, "b": 1}, budget_s=0.0)  # over budget: stop at the smallest count
    assert [len(wall["a"]), len(wall["b"])] == [1, 1]
    with pytest.raises(ValueError, match=r"missing or < 1: \['b'\]"):
        interleave(runners, {"a": 1}, budget_s=1.0)


def test_run_json_worker_passes_the_config_and_reads_json_lines(tmp_path) -> None:
    script = tmp_path / "worker.py"
    script.write_text("import json, sys\ncfg = json.load(open(sys.argv[2]))\nprint('{\"first\": 1}')\n"
                      "print(json.dumps({'x': cfg['x'] * 2, 'arg': sys.argv[3:]}))\nprint('noise')\n"
                      "sys.exit(cfg.get('code', 0))\n")
    answers, proc = run_json_worker(script, {"x": 21}, args=["--flag"], env=measurement_env(1))
    assert answers == [{"first": 1}, {"x": 42, "arg": ["--flag"]}] and proc.returncode == 0
    answers, proc = run_json_worker(script, {"x": 1, "code": 3})
    assert proc.returncode == 3 and answers[1]["x"] == 2
    env = measurement_env(3)
    assert env["OMP_NUM_THREADS"] == "3" and env["MALLOC_TRIM_THRESHOLD_"] == "0"
    assert json.dumps(env) and sys.executable  # a plain str -> str mapping


def test_bome_step_breakdown_times_each_part(tiny_model, tiny_tokenizer) -> None:
    import copy

    qs = builtin_multiple_choice(n_per_domain=4, domains=["capitals"])
    cfg = CalibrationConfig(training=dict(batch_size=2, heldout_batch_size=2), lora=LoraSettings(rank=2, layers=(1,)))
    tr = build_trainer(copy.deepcopy(tiny_model), tiny_tokenizer, qs, qs, resolve_run(cfg, qs, qs))
    out = bome_step_breakdown(tr, init_state(tr, evaluate_before=False), repeats=1)
    parts = [k for k, v in out.items() if isinstance(v, dict)]
    assert len(parts) == 5 and all(out[k]["cpu_s"] > 0 and out[k]["wall_s"] > 0 for k in parts)
    ce = out["plain LoRA: grad CE(w)"]["cpu_s"]
    three = sum(out[k]["cpu_s"] for k in parts if not k.startswith(("plain", "whole")))
    assert out["floor_ratio"] == pytest.approx(three / ce)
    assert out["call_ratio"] == pytest.approx(out["whole BOME direction (hypergrad call)"]["cpu_s"] / ce)


def test_the_docstring_examples_run() -> None:
    """benchmarks/ is outside the doctest paths: its examples run here."""
    results = doctest.testmod(profiling, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert results.attempted >= 6 and results.failed == 0
