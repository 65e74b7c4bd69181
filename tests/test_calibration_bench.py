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
    for label in (bench.LABELS[m] for m in bench.DEFAULT_METHODS):
        assert f"| {label} |" in report, label
    targets = [line for line in report.splitlines() if line.startswith(("| MC A ", "| MC B ", "| Open-ended "))]
    assert len(targets) == 15, targets
    _check_targets_against_the_result_files(targets, tmp_path / "calibration_runs")
    v3 = [line for line in report.splitlines() if line.startswith(("| MC summed", "| MC per-character"))]
    assert len(v3) == 15, v3
    _check_v3_targets_against_the_result_files(v3, tmp_path / "calibration_runs")
    assert report.count("**out-of-domain sets above chance**: none") == 3  # regimes A and B, per-character
    pngs = sorted(p.name for p in (tmp_path / "calibration").glob("*.png"))
    assert pngs == sorted(["summary_ood_ece.png", *(f"reliability_mc_{n}.png" for n in (
        "arithmetic", "unit_conversion", "calendar", "capitals", "chemical_symbols")),
        *(f"reliability_open_{n}.png" for n in ("sums", "capitals", "elements"))])
    runs = tmp_path / "calibration_runs"
    results = _results(runs)
    # mc: 3 baselines, 12 methods x 2 seeds (LoRA CE, penalty and CALM-BOME in both regimes, the temperature
    # rows of LoRA CE and of CALM-BOME in both regimes, LoRA CE and CALM-BOME trained per-character and their
    # temperature rows), 2 x 1 seed (label smoothing, F2SA in regime A); open: regime A only, no temperature rows
    # of trained models, nothing trained per-character
    assert len(results) == (3 + 12 * 2 + 2) + (3 + 3 * 2 + 2)
    rec = json.loads((runs / "mc" / "calm_bome-seed1.json").read_text())
    assert rec["memory"]["train"]["peak_rss_mb"] > 0 and rec["timing"]["train_s"] > 0
    assert set(rec["sets"]) == set(rec["sets_char"]) == {"arithmetic", "unit_conversion", "calendar", "capitals",
                                                          "chemical_symbols"}
    assert "training 3 steps (unlabelled inputs: regime A)" in first
    assert "calm_bome_B seed 1: training 3 steps (unlabelled inputs: regime B)" in first
    assert "lora_ce seed 0: training 3 steps\n" in first  # no unlabelled inputs for one-level CE
    char = json.loads((runs / "mc" / "calm_bome_char-seed0.json").read_text())
    assert char["config"]["normalize"] == "char" and rec["config"]["normalize"] == "sum"
    assert char["questions"] != json.loads((runs / "mc" / "calm_bome-seed0.json").read_text())["questions"]
    _check_the_temperature_rows(runs)

    # re-run: everything is finished, nothing is recomputed or rewritten
    assert bench.main([*argv, "--no-plots"]) == 0
    second = capsys.readouterr().out
    assert second.count("skipped") == len(results)
    assert "training" not in second and "base pass" not in second
    assert _results(runs) == results

    # delete two results: only those run again, here in two forked workers (each rewrites its temperature row)
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
    assert changed == ["mc/calm_bome-seed1.json", "mc/calm_bome_ts-seed1.json", "mc/lora_ce-seed0.json",
                       "mc/lora_ce_ts-seed0.json"]
    assert not list(runs.rglob("*.lock"))
    # the re-run gives the same numbers as the first run (deterministic training and scoring)
    redo = json.loads((runs / "mc" / "calm_bome-seed1.json").read_text())
    assert redo["questions"] == rec["questions"]
    assert redo["sets"]["calendar"]["ece"] == pytest.approx(rec["sets"]["calendar"]["ece"], abs=1e-12)

    # --report-only runs nothing: a missing result stays missing and the report names it
    (runs / "mc" / "label_smoothing-seed0.json").unlink()
    assert bench.main([*argv, "--no-plots", "--report-only"]) == 0
    assert "training" not in capsys.readouterr().out and not (runs / "mc" / "label_smoothing-seed0.json").exists()
    report = (tmp_path / "calibration.md").read_text()
    assert "- Methods without results (not run: time): mc: label smoothing, CALM (F2SA, B).\n" in report


def _ece_of_scores(scores, labels, temperature: float = 1.0) -> float:
    from llm_calib.metrics.calibration import confidence_correct, ece
    from llm_calib.scoring.base import ScoredSet

    s = ScoredSet([torch.tensor(x) for x in scores], labels, ["d"] * len(labels), [str(i) for i in range(len(labels))])
    return ece(*confidence_correct(s.scaled(float(temperature)).probs_numpy, s.labels_numpy), 10)


def _check_the_temperature_rows(runs: Path) -> None:
    """From the stored scores: the oracle row is no worse than any temperature of a coarser grid on
    each set; LoRA CE + temperature scaling is its LoRA CE run's scores divided by the stored T."""
    from _benchmarks import load_benchmark

    grid = load_benchmark("calibration_bench").ORACLE_GRID
    unc = json.loads((runs / "mc" / "uncalibrated-seed0.json").read_text())
    oracle = json.loads((runs / "mc" / "oracle_temperature-seed0.json").read_text())
    for name, q in unc["questions"].items():
        best = min(_ece_of_scores(q["scores"], q["labels"], t) for t in grid[::8])
        assert oracle["sets"][name]["ece"] <= best + 1e-6, name
        t = oracle["temperature"][name]
        assert oracle["sets"][name]["ece"] == pytest.approx(_ece_of_scores(q["scores"], q["labels"], t), abs=1e-6)
    for source, derived in (("lora_ce", "lora_ce_ts"), ("calm_bome", "calm_bome_ts"), ("calm_bome_B", "calm_bome_B_ts")):
        ce = json.loads((runs / "mc" / f"{source}-seed0.json").read_text())
        ts = json.loads((runs / "mc" / f"{derived}-seed0.json").read_text())
        for name, q in ce["questions"].items():
            want = np.concatenate(q["scores"]) / ts["temperature"]
            assert np.allclose(want, np.concatenate(ts["questions"][name]["scores"]), rtol=1e-5, atol=1e-6), (derived, name)


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
    assert f"the in-domain search `{hp}`" in (tmp_path / "calibration.md").read_text()


def _check_targets_against_the_result_files(lines: list[str], runs: Path) -> None:
    """Recompute every target row from the per-run JSON files (not with the benchmark's own
    aggregation) and check the reported value (3 decimals) and the PASS / MISS / info verdict."""

    def sets(task, method):
        files = sorted((runs / task).glob(f"{method}-seed*.json"))
        assert files, (task, method)
        return [json.loads(f.read_text())["sets"] for f in files]

    def per_seed(task, method, names, metric="ece"):  # per seed, the mean over the sets
        return [float(np.mean([r[n][metric] for n in names])) for r in sets(task, method)]

    def mean(task, method, names, metric="ece"):
        return float(np.mean(per_seed(task, method, names, metric)))

    mc_ood = ("calendar", "capitals", "chemical_symbols")
    mc_in = ("arithmetic", "unit_conversion")
    open_ood = ("capitals", "elements")
    for line in lines:
        cells = [c.strip() for c in line.strip("|").split(" | ")]
        name = cells[0]
        regime = "B" if name.startswith("MC B") else "A"
        suffix = "_B" if regime == "B" else ""
        penalty = "confidence_penalty" + suffix
        for col, method in ((2, "calm_bome" + suffix), (4, "calm_f2sa" + suffix)):
            status = cells[col + 1]
            if cells[col].startswith("n/a"):  # F2SA in regime B is not run by default
                assert method == "calm_f2sa_B" and "missing results" in cells[col] and status == "n/a", (name, cells)
                continue
            value = float(cells[col].split(" ")[0])
            if "mean conf-ECE / temperature" in name:
                want = mean("mc", method, mc_ood) / mean("mc", "temperature_scaling", mc_ood)
                ok = want <= (0.5 if regime == "B" else 0.8)
            elif "sets with conf-ECE below" in name:
                wins = sum(mean("mc", method, [n]) < mean("mc", "temperature_scaling", [n]) for n in mc_ood)
                want, ok = wins / 3, wins >= 3
            elif "above the seed spread" in name:
                spread = max(float(np.std(per_seed("mc", m, mc_ood), ddof=1)) for m in (method, penalty)
                             if len(per_seed("mc", m, mc_ood)) > 1)
                want = mean("mc", penalty, mc_ood) - mean("mc", method, mc_ood)
                ok = want > spread
            elif "mean accuracy" in name:
                want = mean("mc", method, mc_ood, "accuracy") / mean("mc", "uncalibrated", mc_ood, "accuracy")
                ok = want >= 0.95
            elif "no set" in name:
                unc = sets("mc", "uncalibrated")[0]
                margins = [mean("mc", method, [n], "accuracy") - unc[n]["accuracy_ci_low"] for n in mc_ood]
                want, ok = min(margins), min(margins) >= 0
            elif "in-domain" in name:
                want = mean("mc", method, mc_in) - mean("mc", "temperature_scaling", mc_in)
                ok = want <= 0.01
            elif name.startswith("Open-ended OOD: exact match"):
                want = mean("open", method, open_ood, "accuracy")
                ok = want >= 0.05
            elif name.startswith("Open-ended OOD: conf-ECE reduction"):
                want = 1 - mean("open", method, open_ood) / mean("open", "uncalibrated", open_ood)
                ok = want >= 0.2 and mean("open", method, open_ood, "accuracy") >= 0.05
            elif name.startswith("Open-ended OOD: conf-ECE / temperature"):
                want = mean("open", method, open_ood) / mean("open", "temperature_scaling", open_ood)
                ok = want < 1
            else:
                raise AssertionError(f"unknown target row {name!r}")
            assert value == pytest.approx(want, abs=6e-4), (name, method, value, want)
            assert status == {True: "PASS", False: "**MISS**", None: "info"}[ok], (name, method, status)


def _check_v3_targets_against_the_result_files(lines: list[str], runs: Path) -> None:
    """Recompute the v3 target rows (CALM + temperature) from the per-run JSON files, under summed
    (``sets``) and per-character (``sets_char``) scores, and check value and verdict."""

    def records(method, key):
        return [json.loads(f.read_text())[key] for f in sorted((runs / "mc").glob(f"{method}-seed*.json"))]

    def per_seed(method, names, key, metric="ece"):
        return [float(np.mean([r[n][metric] for n in names])) for r in records(method, key)]

    def mean(method, names, key, metric="ece"):
        return float(np.mean(per_seed(method, names, key, metric)))

    ood, ind = ("calendar", "capitals", "chemical_symbols"), ("arithmetic", "unit_conversion")
    unc = json.loads((runs / "mc" / "uncalibrated-seed0.json").read_text())
    for line in lines:
        cells = [c.strip() for c in line.strip("|").split(" | ")]
        name = cells[0]
        key = "sets_char" if name.startswith("MC per-character") else "sets"
        probs = "probs_char" if key == "sets_char" else "probs"
        chance = {n: float(np.mean([1 / len(p) for p in unc["questions"][n][probs]])) for n in ood}
        above = [n for n in ood if unc[key][n]["accuracy_ci_low"] > chance[n]]
        names = above if "above chance" in name else list(ood)
        for col, method in ((2, "calm_bome_ts"), (4, "calm_bome_B_ts"), (6, "calm_bome_char_ts")):
            status = cells[col + 1]
            lora = "lora_ce_char_ts" if method == "calm_bome_char_ts" else "lora_ce_ts"
            if method == "calm_bome_char_ts" and key == "sets":
                assert cells[col].startswith("n/a") and status == "n/a", (name, cells)
                continue
            if not names:
                assert cells[col] == "n/a (no above chance set)" and status == "n/a", (name, cells)
                continue
            value = float(cells[col].split(" ")[0])
            if "mean conf-ECE / temperature alone" in name:
                want = mean(method, names, key) / mean("temperature_scaling", names, key)
                ok = want <= 0.85
            elif "below temperature alone" in name:
                wins = sum(mean(method, [n], key) < mean("temperature_scaling", [n], key) for n in names)
                want, ok = wins / len(names), wins >= np.ceil(10 / 13 * len(names))
            elif "LoRA CE + T − CALM + T" in name:
                spread = max(float(np.std(per_seed(m, names, key), ddof=1)) for m in (method, lora))
                want = mean(lora, names, key) - mean(method, names, key)
                ok = want > spread
            elif "in domain" in name:
                want = mean(method, ind, key) - mean("temperature_scaling", ind, key)
                ok = want <= 0.01 and mean(method, ind, key, "accuracy") >= 0.95 * mean("uncalibrated", ind, key, "accuracy")
            else:
                raise AssertionError(f"unknown v3 target row {name!r}")
            assert value == pytest.approx(want, abs=6e-4), (name, method, value, want)
            assert status == ("PASS" if ok else "**MISS**"), (name, method, status)


def test_per_character_scores_divide_by_the_continuation_length(bench) -> None:
    from llm_calib.data.records import MultipleChoice
    from llm_calib.scoring.base import ScoredSet

    recs = [MultipleChoice("q?", ("ab", "abcd "), 1, "d", "0"), MultipleChoice("r?", ("x", "yy", "zzz"), 0, "d", "1")]
    s = ScoredSet([torch.tensor([-3.0, -5.0]), torch.tensor([-2.0, -3.0, -4.0])], [1, 0], ["d", "d"], ["0", "1"])
    c = bench.per_char(s, recs)
    assert torch.allclose(c.logits[0], torch.tensor([-1.0, -1.0])) and torch.allclose(c.logits[1], torch.tensor([-1.0, -1.0, -1.0]))
    assert c.labels == s.labels and c.ids == s.ids
