"""benchmarks/paper_protocol.py end to end on CPU: the tiny model, local files only, one batch of 16
instruction pairs an epoch (the preset's 5 epochs: 5 steps)."""

from __future__ import annotations

import json
from pathlib import Path

from _benchmarks import load_benchmark

DATA = Path(__file__).resolve().parents[1] / ".." / "shared" / "data"


def test_paper_protocol_writes_the_table(tiny_model_dir, tmp_path, capsys):
    script = load_benchmark("paper_protocol")
    train = tmp_path / "alpaca.jsonl"
    train.write_text("".join(json.dumps({"instruction": f"Name the number {i}.", "input": "", "output": str(i)}) + "\n"
                             for i in range(20)))
    out = tmp_path / "out"
    argv = ["--model", str(tiny_model_dir), "--train", f"jsonl:{train}", "--train-limit", "16",
            "--heldout", "builtin:capitals:n=8,seed=1", "--eval", "builtin:capitals:n=6,seed=2",
            "--eval", f"openbookqa:{DATA / 'openbookqa' / 'openbookqa.jsonl'}", "--limit", "16",
            "--device", "cpu", "--dtype", "float32", "--bootstrap", "0", "--out", str(out), "--", "--eval-every", "1"]
    assert script.main(argv) == 0
    table = json.loads((out / "paper_table.json").read_text())
    assert sorted(table) == ["capitals", "mean", "openbookqa"]
    for row in table.values():
        assert set(row) == {"uncalibrated", "temperature_scaled", "calm", "calm+temperature"}
        assert all(set(v) == {"ece", "accuracy", "brier", "auroc"} for v in row.values())
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["config"]["calibration"]["preset"] == "paper"
    assert metrics["config"]["train"] == {"spec": f"jsonl:{out / 'train_subset.jsonl'}", "n": 16, "kind": "open"}
    assert metrics["config"]["calibration"]["training"]["steps"] == 5  # 5 epochs of one batch of 16
    assert metrics["domains"]["capitals"]["columns"]["calm"]["ece"] == table["capitals"]["calm"]["ece"]
    text = (out / "paper_table.md").read_text()
    assert "| openbookqa | CALM (paper preset) |" in text and "--preset paper" in text
