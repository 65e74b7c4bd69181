"""benchmarks/gpu_check.py in its CPU smoke mode (--small): every row has the CALM step beside the
LoRA-CE step, their ratio, the MFU estimate, and only the steps after the warm-up timed."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_gpu_check_small_mode_runs_on_the_cpu_in_seconds(tmp_path):
    out = tmp_path / "gpu_check.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    env.pop("WORLD_SIZE", None)
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu_check.py"), "--small", "--warmup", "2",
                           "--steps", "2", "--batch-sizes", "4,6", "--out", str(out)],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(out.read_text())
    assert report["machine"]["warmup_steps"] == 2 and report["machine"]["matmul_tflops"] > 0
    rows = report["results"]
    assert [(r["mode"], r["batch_size"]) for r in rows] == [("bf16", 4), ("bf16", 6), ("bf16+ckpt", 4), ("bf16+ckpt", 6)]
    for r in rows:
        assert r["finite"]
        for objective in ("calm", "lora_ce"):
            assert r[objective]["steps_timed"] == 2 == len(r[objective]["step_s_all"])  # the warm-up is not timed
            assert r[objective]["step_s"] > 0 and r[objective]["tflop_per_step"] > 0
        assert r["calm_over_ce"] == r["calm"]["step_s"] / r["lora_ce"]["step_s"] > 1  # CALM does T + 2 passes
        assert 0 < r["mfu_calm"] < 1 and math.isfinite(r["mfu_ce"])
        assert r["calm"]["tflop_per_step"] > 5 * r["lora_ce"]["tflop_per_step"]
    assert "CALM/CE" in proc.stdout
