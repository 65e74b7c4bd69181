"""The calibration benchmark (benchmarks/calibration_bench.py): its fast paths and its --quick run."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from _benchmarks import load_benchmark


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("calibration_bench")


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _results(root: Path) -> dict[str, tuple[int, str]]:
    return {str(p.relative_to(root)): (p.stat().st_mtime_ns, p.read_text()) for p in sorted(root.rglob("*.json"))}


def test_quick_run_reports_every_method_and_resumes(bench, tmp_path, capsys) -> None:
    argv = ["--quick", "--out", str(tmp_path), "--no-progress"]
    assert bench.main(argv) == 0
    first = capsys.readouterr().out
    report = (tmp_path / "calibration.md").read_text()
    for label in bench.LABELS.values():
        assert f"| {label} |" in report, label
    targets = [line for line in report.splitlines() if line.startswith("| MC ") or line.startswith("| Open-ended ")]
    assert len(targets) == 9, targets
    _check_targets_against_the_result_files(targets, tmp_path / "calibration_runs")
    pngs = sorted((tmp_path / "calibration").glob("*.png"))
    assert len(pngs) == 2 * len(bench.METHODS)
    runs = tmp_path / "calibration_runs"
    results = _results(runs)
    assert len(results) == 2 * (2 + 5 * 2)  # two tasks; two baselines + five trained methods x two seeds
    rec = json.loads((runs / "mc" / "calm_bome-seed1.json").read_text())
    assert rec["memory"]["train"]["peak_rss_mb"] > 0 and rec["timing"]["train_s"] > 0
    assert set(rec["sets"]) == {"arithmetic", "unit_conversion", "calendar", "capitals", "chemical_symbols"}
    assert "training 3 steps" in first

    # re-run: everything is finished, nothing is recomputed or rewritten
    assert bench.main([*argv, "--no-plots"]) == 0
    second = capsys.readouterr().out
    assert second.count("skipped") == len(results)
    assert "training" not in second and "base pass" not in second
    assert _results(runs) == results

    # delete two results: only those run again, here in two forked workers
    (runs / "mc" / "calm_bome-seed1.json").unlink()
    (runs / "mc" / "lora_ce-seed0.json").unlink()
    log_before = (runs / "bench.log").read_text()
    assert bench.main([*argv, "--no-plots", "--workers", "2"]) == 0
    third = capsys.readouterr().out
    log = (runs / "bench.log").read_text()[len(log_before):]  # the workers' lines too
    trained = sorted(re.findall(r"\] \[(\w+)\] (\w+) seed (\d): training .*\(worker \d\)", log))
    assert trained == [("mc", "calm_bome", "1"), ("mc", "lora_ce", "0")], log
    assert "2 runs on 2 forked workers" in third
    assert third.count("skipped") == len(results) - 2
    after = _results(runs)
    changed = sorted(k for k in after if after[k][0] != results[k][0])
    assert changed == ["mc/calm_bome-seed1.json", "mc/lora_ce-seed0.json"]
    assert not list(runs.rglob("*.lock"))
    # the re-run gives the same numbers as the first run (deterministic training and scoring)
    redo = json.loads((runs / "mc" / "calm_bome-seed1.json").read_text())
    assert redo["questions"] == rec["questions"]
    assert redo["sets"]["calendar"]["ece"] == pytest.approx(rec["sets"]["calendar"]["ece"], abs=1e-12)


def test_search_selects_on_in_domain_data_and_the_run_uses_it(bench, tmp_path, capsys) -> None:
    hp = tmp_path / "hp.json"
    common = ["--quick", "--out", str(tmp_path), "--no-progress", "--no-plots", "--tasks", "mc"]
    assert bench.main([*common, "--search", "--methods", "lora_ce,calm_bome", "--hparams", str(hp)]) == 0
    chosen = json.loads(hp.read_text())
    rows = [c for c in chosen["candidates"] if c["task"] == "mc"]
    assert {c["method"] for c in rows} == {"lora_ce", "calm_bome"}
    for method in ("lora_ce", "calm_bome"):
        mine = [c for c in rows if c["method"] == method]
        assert sum(c["chosen"] for c in mine) == 1
        assert chosen["mc"][method] in [c["candidate"] for c in mine]
        eligible = [c for c in mine if c["accuracy"] >= 0.95 * chosen["mc_uncalibrated"]["accuracy"] - 1e-12]
        best = min(eligible, key=lambda c: c["ece"]) if eligible else max(mine, key=lambda c: c["accuracy"])
        assert best["chosen"]
    assert not (tmp_path / "calibration_runs" / "mc" / "uncalibrated-seed0.json").exists()  # no test set scored
    capsys.readouterr()
    # the main run trains with the chosen settings
    chosen["mc"]["lora_ce"] = {"lr": 0.0123}
    hp.write_text(json.dumps(chosen))
    assert bench.main([*common, "--methods", "uncalibrated,lora_ce", "--seeds", "1", "--hparams", str(hp)]) == 0
    rec = json.loads((tmp_path / "calibration_runs" / "mc" / "lora_ce-seed0.json").read_text())
    assert rec["config"]["lr"] == pytest.approx(0.0123)
    assert "from the in-domain search" in (tmp_path / "calibration.md").read_text()


def _check_targets_against_the_result_files(lines: list[str], runs: Path) -> None:
    """Recompute every target row from the per-run JSON files (not with the benchmark's own
    aggregation) and check the reported value (3 decimals) and the PASS / MISS / info verdict."""

    def sets(task, method):
        files = sorted((runs / task).glob(f"{method}-seed*.json"))
        assert files, (task, method)
        return [json.loads(f.read_text())["sets"] for f in files]

    def mean(task, method, names, metric="ece"):  # mean over seeds of the mean over the sets
        return float(np.mean([np.mean([r[n][metric] for n in names]) for r in sets(task, method)]))

    mc_ood = ("calendar", "capitals", "chemical_symbols")
    mc_in = ("arithmetic", "unit_conversion")
    open_ood = ("capitals", "elements")
    for line in lines:
        cells = [c.strip() for c in line.strip("|").split(" | ")]
        name = cells[0]
        for col, method in ((2, "calm_bome"), (4, "calm_f2sa")):
            value, status = float(cells[col].split(" ")[0]), cells[col + 1]
            if name.startswith("MC OOD: mean conf-ECE / uncalibrated"):
                want = mean("mc", method, mc_ood) / mean("mc", "uncalibrated", mc_ood)
                ok = want <= 0.5
            elif name.startswith("MC OOD: mean conf-ECE / temperature"):
                want = mean("mc", method, mc_ood) / mean("mc", "temperature_scaling", mc_ood)
                ok = want <= 0.8
            elif name.startswith("MC OOD: sets with conf-ECE below"):
                wins = sum(mean("mc", method, [n]) < mean("mc", "temperature_scaling", [n]) for n in mc_ood)
                want, ok = wins / 3, wins >= 3
            elif name.startswith("MC OOD: mean accuracy"):
                want = mean("mc", method, mc_ood, "accuracy") / mean("mc", "uncalibrated", mc_ood, "accuracy")
                ok = want >= 0.95
            elif name.startswith("MC OOD: no set"):
                unc = sets("mc", "uncalibrated")[0]
                margins = [mean("mc", method, [n], "accuracy") - unc[n]["accuracy_ci_low"] for n in mc_ood]
                want, ok = min(margins), min(margins) >= 0
            elif name.startswith("MC in-domain"):
                want = mean("mc", method, mc_in) - mean("mc", "temperature_scaling", mc_in)
                ok = want <= 0.01
            elif name.startswith("Open-ended OOD: conf-ECE reduction"):
                want = 1 - mean("open", method, open_ood) / mean("open", "uncalibrated", open_ood)
                ok = want >= 0.2
            elif "ablation" in name:
                task, ood = ("mc", mc_ood) if name.startswith("MC") else ("open", open_ood)
                want, ok = mean(task, method, ood) - mean(task, "confidence_penalty", ood), None
            else:
                raise AssertionError(f"unknown target row {name!r}")
            assert value == pytest.approx(want, abs=6e-4), (name, method, value, want)
            assert status == {True: "PASS", False: "**MISS**", None: "info"}[ok], (name, method, status)
