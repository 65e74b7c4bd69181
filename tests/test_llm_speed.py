"""The speed benchmark (benchmarks/llm_speed.py): the fast path computes the slow path's numbers,
and the benchmark's tiny mode produces a complete, consistent report."""

from __future__ import annotations

import copy
import inspect
import json
import math
import re

import pytest
import torch
from _benchmarks import load_benchmark, load_harness

from llm_calib.adjustment import LogitAdjustment
from llm_calib.calm.encoding import encode_records
from llm_calib.calm.lora import FunctionalLM, attach_lora
from llm_calib.calm.losses import CalmLosses
from llm_calib.calm.run import task_format
from llm_calib.config.calibration import CalibrationConfig, LoraSettings
from llm_calib.data.records import MultipleChoice
from llm_calib.engine.packing import pack_questions
from llm_calib.prompts.resolution import resolve_prompt_settings

_naive = load_harness("naive_scoring")
option_scores_naive, score_option_likelihood_naive = _naive.option_scores_naive, _naive.score_option_likelihood_naive


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("llm_speed")


_OUTPUT_SCALE = "output_scale" in inspect.signature(attach_lora).parameters
_SCALES = [False, pytest.param(True, marks=pytest.mark.skipif(not _OUTPUT_SCALE, reason="no output_scale"))]


def _adapted(tiny_model, tiny_tokenizer, records, output_scale=False):
    """LoRA on the top layer of the 2-layer tiny model (trunk cached), with non-zero weights."""
    config = CalibrationConfig(lora=LoraSettings(rank=2, layers=(1,)))
    kwargs = {"output_scale": True} if output_scale else {}
    peft_model = attach_lora(copy.deepcopy(tiny_model), config.lora, **kwargs)
    peft_model.eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in peft_model.parameters():
            if p.requires_grad:
                p.copy_(0.05 * torch.randn(p.shape, generator=gen))
    lm = FunctionalLM(peft_model)
    if output_scale:  # a final-norm scale away from 1 (θ then holds its log)
        theta = lm.theta()
        theta["output_log_scale"] = torch.tensor(0.3)
        lm.load_theta(theta)
    enc = encode_records(tiny_tokenizer, records, task_format(records, resolve_prompt_settings(config.prompt)))
    batch = enc.batch(range(len(records)), tiny_tokenizer.pad_token_id, lm)
    vocab = lm.head.out_features
    adjustment = LogitAdjustment("vector", vocab)
    lam = {"log_a": 0.1 * torch.randn(vocab, generator=gen), "b": 0.5 * torch.randn(vocab, generator=gen)}
    return lm, adjustment, batch, lam, peft_model


@pytest.fixture(params=_SCALES, ids=["lora", "lora+output_scale"])
def adapted(request, tiny_model, tiny_tokenizer, mc_records):
    """Questions with 2 to 5 options (padded option slots); LoRA alone, or with the output scale."""
    return _adapted(tiny_model, tiny_tokenizer, mc_records, output_scale=request.param)


def _uniform_records() -> list[MultipleChoice]:
    """Three options each, similar scores: no padded slots (see test_entropy_gradient_with_padding)
    and an entropy that is not saturated, so that f's gradients are not vanishingly small."""
    return [
        MultipleChoice(f"Question {i}: which one? " + "Think. " * i, ("option 0", "option 1", "option 2 and more"),
                       i % 3, "d", f"u{i}")
        for i in range(3)
    ]


def test_unpack_questions_round_trips(bench) -> None:
    items = [((1, 2), ((3,), (4, 5))), ((6,), ((7,), (8,), (9, 9, 9))), ((1, 2, 3, 4), ((5, 6),))]
    packed = pack_questions(items, pad_id=0)
    assert _naive.unpack_questions(packed) == items


def test_fast_scores_equal_the_naive_scorers(bench, adapted, tiny_tokenizer, mc_records) -> None:
    lm, adjustment, batch, lam, peft_model = adapted
    assert lm.caches_trunk and batch.trunk is not None  # the fast path really is the cached one
    theta = lm.theta()
    fast = CalmLosses(lm, adjustment).scores(theta, None, batch)
    params = _naive.NaiveCalmLosses(lm, adjustment).model_params(theta)
    assert all(k.startswith("model.layers.") or k.startswith("model.norm.") for k in params)
    slow = option_scores_naive(lm.base, _naive.unpack_questions(batch.packed), params)
    assert fast.shape == slow.shape == (len(mc_records), 5)
    assert torch.equal(torch.isinf(fast), torch.isinf(slow))
    finite = torch.isfinite(slow)
    torch.testing.assert_close(fast[finite], slow[finite], atol=1e-4, rtol=0)
    reference = score_option_likelihood_naive(peft_model, tiny_tokenizer, mc_records)
    for row, ref in zip(fast, reference.logits, strict=True):
        torch.testing.assert_close(row[: len(ref)].double(), ref, atol=1e-4, rtol=0)
    # with a non-trivial logit adjustment, and length-normalised
    for normalize in ("sum", "mean"):
        f = CalmLosses(lm, adjustment, normalize).scores(theta, lam, batch)
        s = _naive.NaiveCalmLosses(lm, adjustment, normalize).scores(theta, lam, batch)
        torch.testing.assert_close(f[finite], s[finite], atol=1e-4, rtol=0)
        assert float((f[finite] - fast[finite]).abs().max()) > 1e-2  # λ really changed them
    # θ values other than the model's own (LoRA and output scale) are substituted by both paths
    moved = {k: v + 0.02 if k == "output_log_scale" else v * 1.5 for k, v in theta.items()}
    f = CalmLosses(lm, adjustment).scores(moved, None, batch)
    s = _naive.NaiveCalmLosses(lm, adjustment).scores(moved, None, batch)
    torch.testing.assert_close(f[finite], s[finite], atol=1e-4, rtol=0)
    assert float((f[finite] - fast[finite]).abs().max()) > 1e-3


@pytest.mark.parametrize("output_scale", _SCALES)
@pytest.mark.parametrize("uniform", [False, True])
def test_calm_losses_and_gradients_equal_the_naive_path(
    bench, tiny_model, tiny_tokenizer, mc_records, uniform, output_scale
) -> None:
    records = _uniform_records() if uniform else mc_records
    lm, adjustment, batch, lam, _ = _adapted(tiny_model, tiny_tokenizer, records, output_scale)
    names = ("inner", "outer")
    fast, slow = CalmLosses(lm, adjustment), _naive.NaiveCalmLosses(lm, adjustment)
    theta = {k: v.detach().clone().requires_grad_(True) for k, v in lm.theta().items()}
    lam = {k: v.detach().clone().requires_grad_(True) for k, v in lam.items()}
    for name in names:
        vf = getattr(fast, name)(theta, lam, batch)
        gf = torch.autograd.grad(vf, [*theta.values(), *lam.values()], allow_unused=True)
        vs = getattr(slow, name)(theta, lam, batch)
        gs = torch.autograd.grad(vs, [*theta.values(), *lam.values()], allow_unused=True)
        torch.testing.assert_close(vf, vs, atol=1e-4, rtol=0)
        n_theta = len(theta)
        assert all(g is not None for g in gf[:n_theta])
        assert max(float(g.abs().max()) for g in gf[:n_theta]) > 1e-3  # non-trivial θ-gradients
        for a, b in zip(gf, gs, strict=True):
            if a is None or b is None:
                assert a is None and b is None and name == "outer"  # f does not depend on λ
                continue
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_option_scores_naive_validates(tiny_model) -> None:
    with pytest.raises(ValueError, match="normalize"):
        option_scores_naive(tiny_model, [((1,), ((2,),))], normalize="max")
    with pytest.raises(ValueError, match="at least one"):
        option_scores_naive(tiny_model, [])
    with pytest.raises(ValueError, match="no tokens"):
        option_scores_naive(tiny_model, [((1,), ((2,), ()))])


_NUM = r"([0-9.]+(?:e[-+]?\d+)?)"


def test_tiny_benchmark_writes_a_consistent_report(bench, tmp_path) -> None:
    out = tmp_path / "speed.md"
    threads = torch.get_num_threads()
    try:
        bench.main(["--mode", "tiny", "--threads", "1", "--data-dir", str(tmp_path / "absent"), "--out", str(out)])
    finally:
        torch.set_num_threads(threads)
    text = out.read_text()
    raw = json.loads(out.with_suffix(".json").read_text())
    assert "python benchmarks/llm_speed.py --mode tiny" in text and "1 torch threads" in text
    assert "built-in set (ARC-Easy absent)" in text
    # every target has a finite, positive measured value and a verdict
    target_rows = re.findall(r"^\| (.+?) \| " + _NUM + r" \| [0-9.]+ \| (PASS|\*\*MISS\*\*|n/a) \|", text, re.M)
    assert len(target_rows) == 6, text
    for _, value, _ in target_rows:
        assert math.isfinite(float(value)) and float(value) > 0
    # the CALM / CE ratio at calibrate's defaults is the reported CPU seconds' ratio, not below BOME's T + 2 arithmetic
    dc = raw["default_steps"]
    assert dc["ratio_cpu"] == pytest.approx(dc["bome_cpu_s"] / dc["ce_cpu_s"])
    assert dc["by_construction"][str(dc["inner_steps"])] > dc["by_construction"]["1"] > 1
    assert f"**{dc['ratio_cpu']:.2f}**" in text
    # (a) the ratio is naive time / default time, from the reported seconds
    ev = raw["eval"]
    naive_s = float(re.search(r"\| naive \(`score_option_likelihood_naive`\) \| " + _NUM, text).group(1))
    default_s = float(re.search(r"\| default \(`score_option_likelihood`\) \| " + _NUM, text).group(1))
    assert naive_s > 0 and default_s > 0
    assert ev["speedup"] == pytest.approx(ev["naive_s"] / ev["default_s"]) == pytest.approx(
        ev["default_qps"] / ev["naive_qps"])
    assert f"**{ev['speedup']:.2f}x**" in text
    assert ev["max_abs_score_diff"] < 1e-4
    # (b), (d) steps of both paths, ratios naive / default and BOME / CE
    st = raw["steps"]
    naive, default = st["paths"]["naive"], st["paths"]["default"]
    for p in (naive, default):
        for key in ("bome_s", "ce_s", "epoch_s", "epoch_steps_s"):
            assert math.isfinite(p[key]) and p[key] > 0, (key, p)
        assert p["bome_over_ce"] == pytest.approx(p["bome_s"] / p["ce_s"])
        assert p["epoch_steps"] == 1000 / p["batch_size"]
    assert st["step_speedup"] == pytest.approx(naive["bome_s"] / default["bome_s"])
    assert st["epoch_speedup"] == pytest.approx(naive["epoch_s"] / default["epoch_s"])
    assert default["caches_trunk"] and not naive["caches_trunk"]
    assert default["epoch_trunk_s"] > 0 and default["trunk_bytes_per_question"] > 0
    assert naive["k"] == 4 and default["k"] == 2
    assert f"**{st['step_speedup']:.1f}x**" in text
    bd = st["bome_breakdown"]  # three gradient evaluations against one
    assert bd["floor_ratio"] > 1 and bd["call_ratio"] > 1 and "whole BOME call / plain LoRA" in text
    # (e) one row per k plus the uncalibrated one, finite ECEs
    rows = raw["quality"]["rows"]
    assert [r["k"] for r in rows] == ["uncalibrated", 2, 4]
    for r in rows:
        assert 0.0 <= r["ece_in"] <= 1.0 and 0.0 <= r["ece_out"] <= 1.0
    assert re.search(r"^\| 2 \| [0-9,]+ \| " + _NUM, text, re.M)
    # fast vs slow: the same numbers to float rounding
    fs = raw["fast_vs_slow"]
    assert fs["losses"]["scores_max_abs_diff"] < 1e-4
    assert fs["losses"]["g"]["grad_theta_rel"] < 1e-4 and fs["losses"]["f"]["grad_theta_rel"] < 1e-4
    assert fs["theta_rel"] < 1e-4 and fs["ece_max_abs_diff"] < 1e-4
    for section in ("## (a) Evaluation", "## (b) Calibration steps", "## (c) Peak memory", "## (e) Calibration",
                    "## Fast path vs slow path"):
        assert section in text


def test_memory_of_one_configuration_in_process(bench) -> None:
    threads = torch.get_num_threads()
    try:
        out = bench.measure_one({"name": "bome default", "mode": "tiny", "model": "tiny", "threads": 1,
                                 "data_dir": None})
    finally:
        torch.set_num_threads(threads)
    assert out["seconds"] > 0 and out["peak_abs_mb"] >= out["baseline_mb"] > 0
    # the reported peak is the high-water mark of the measured call over its baseline
    assert out["peak_mb"] == pytest.approx(max(0.0, out["peak_abs_mb"] - out["baseline_mb"]), abs=1e-9)


def test_quick_model_falls_back_without_the_model_cache(bench, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("LLM_CALIB_CACHE", str(tmp_path / "empty"))
    model, tok, kind, desc = bench.build_model("random")
    assert kind == "fallback" and "FALLBACK" in desc and "unavailable" in desc
    assert model.config.num_hidden_layers == 8 and tok.pad_token_id is not None
