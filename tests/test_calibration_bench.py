"""The calibration benchmark (benchmarks/calibration_bench.py): its fast paths and its --quick run."""

from __future__ import annotations

import copy
import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from _benchmarks import load_benchmark

from llm_calib.calm.config import CalibrationConfig, LoraSettings
from llm_calib.calm.encoding import encode_records as encode_batch_source
from llm_calib.calm.lora import FunctionalLM, attach_lora
from llm_calib.data import MultipleChoice, OpenQA, builtin_multiple_choice
from llm_calib.metrics import ece
from llm_calib.models import tiny_random_model
from llm_calib.scoring.open_ended import encode_open_prompts, score_open_ended
from llm_calib.scoring.option_likelihood import score_option_likelihood


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("calibration_bench")


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _adapted(model, layers=(2,)):
    """A copy of ``model`` with LoRA on ``layers`` whose adapters are far from zero."""
    peft_model = attach_lora(copy.deepcopy(model), LoraSettings(rank=2, alpha=4.0, layers=layers))
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    peft_model.eval()
    return peft_model


def _merged(peft_model):
    return copy.deepcopy(peft_model).merge_and_unload().eval()


def _probs(scores):
    return [torch.softmax(s.double(), 0) for s in scores]


def test_trunk_cached_scores_equal_the_plain_scorer_on_the_merged_model(bench) -> None:
    model, tok = tiny_random_model(seed=0, num_layers=3)
    records = builtin_multiple_choice(n_per_domain=6, seed=0, domains=["capitals", "arithmetic", "calendar"])
    records += [  # ragged option counts and lengths
        MultipleChoice("Which is a colour?", ("red", "the quick brown fox"), 0, "x", "x0"),
        MultipleChoice("Pick the city.", ("Paris", "Lyon", "dog", "2 + 3", "Rome"), 4, "x", "x1"),
    ]
    cfg = CalibrationConfig(lora=LoraSettings(rank=2, layers=(2,)))
    enc = encode_batch_source(tok, records, cfg)
    pad = tok.pad_token_id
    base = bench.base_pass_mc(model, enc, 2, 4, pad, "sum")
    assert len(enc.trunk_cache) == len(records)
    plain = score_option_likelihood(model, tok, records, batch_size=3)
    for a, b in zip(_probs(base), plain.probs, strict=True):
        assert torch.allclose(a, b.double(), atol=1e-5), (a, b)

    adapted = _adapted(model)
    lm = FunctionalLM(adapted)
    assert lm.trunk_layers == 2
    cached = bench.trunk_scores_mc(lm, enc, 5, pad, "sum")
    merged = score_option_likelihood(_merged(adapted), tok, records, batch_size=3)
    diffs = []
    for a, b, c in zip(_probs(cached), merged.probs, _probs(base), strict=True):
        assert torch.allclose(a, b.double(), atol=1e-5), (a, b)
        diffs.append(float((a - c).abs().max()))
    assert max(diffs) > 1e-2  # the adapters change the predictions: the check is not vacuous


def test_trunk_started_generation_equals_score_open_ended(bench) -> None:
    model, tok = tiny_random_model(seed=0, num_layers=3)
    records = [OpenQA(f"What is {a} plus {b}?", (str(a + b),), "sums", f"s{a}{b}") for a in range(3) for b in range(4)]
    records.append(OpenQA("Name the capital of France, please.", ("Paris",), "geo", "g0"))
    prompts = encode_open_prompts(tok, records)
    gen = bench.OpenGenerator(tok, prompts, batch_size=5, max_new_tokens=6, trunk_layers=2)
    base = gen.base(model, keep_trunk=True, temperatures=True)
    plain = score_open_ended(model, tok, records, max_new_tokens=6, batch_size=5)
    g1 = int(np.argmin(np.abs(bench.TEMPERATURE_GRID - 1.0)))
    assert math.isclose(bench.TEMPERATURE_GRID[g1], 1.0, rel_tol=1e-9)
    for out, text, probs in zip(base, plain.answers, plain.token_probs, strict=True):
        assert out.text == text
        np.testing.assert_allclose(out.token_probs, probs, atol=1e-5)
        np.testing.assert_allclose(out.temp_probs[:, g1], probs, atol=1e-5)  # T = 1 column of the grid

    adapted = _adapted(model)
    trained = gen.trained(adapted)
    reference = score_open_ended(_merged(adapted), tok, records, max_new_tokens=6, batch_size=5)
    assert [o.text for o in trained] == reference.answers
    for out, probs in zip(trained, reference.token_probs, strict=True):
        np.testing.assert_allclose(out.token_probs, probs, atol=1e-5)
    assert [o.text for o in trained] != plain.answers or any(
        abs(a.token_probs[0] - b.token_probs[0]) > 1e-3 for a, b in zip(trained, base, strict=True))


def test_bootstrap_ece_matches_the_library(bench) -> None:
    rng = np.random.default_rng(0)
    conf = np.concatenate([rng.uniform(0, 1, 200), [0.0, 0.1, 0.5, 1.0]])
    correct = (rng.uniform(0, 1, conf.size) < conf).astype(float)
    ident = np.arange(conf.size)[None]
    assert math.isclose(bench.boot_ece(conf, correct, ident)[0], ece(conf, correct, 10), abs_tol=1e-12)


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
    for line in targets:
        cells = line.split(" | ")
        for value in (cells[2], cells[4]):  # BOME and F2SA columns: "<number> (<detail>)"
            number = float(value.split(" ")[0])
            assert math.isfinite(number), line
        assert re.search(r"\| (PASS|\*\*MISS\*\*|info) \|", line), line
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
