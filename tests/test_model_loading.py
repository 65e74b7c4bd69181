"""ModelLoadConfig, ``load(...)`` options, the CLI's model-loading flags, one load per comparison."""

from __future__ import annotations

import json

import pytest
import torch

from llm_calib import cli
from llm_calib.calm.run import resolve_run
from llm_calib.config.calibration import CalibrationConfig
from llm_calib.data import load as load_data
from llm_calib.evaluation.compare import run_comparison
from llm_calib.models import ModelLoadConfig, load, load_count
from llm_calib.objectives.calm import Calm
from llm_calib.objectives.lora_ce import LoraCE

TRAIN = "builtin:arithmetic,capitals:n=4"
HELDOUT = "builtin:arithmetic,capitals:n=4,seed=1"
EVAL = "builtin:capitals:n=4,seed=2"


def test_config_round_trip_and_errors(tmp_path):
    cfg = ModelLoadConfig(dtype="bfloat16", load_in_4bit=True, attn_implementation="sdpa",
                          gradient_checkpointing=True, device_map="cuda:0")
    assert ModelLoadConfig.load(cfg.save(tmp_path / "m.json")) == cfg
    assert json.loads((tmp_path / "m.json").read_text())["dtype"] == "bfloat16"
    assert cfg.quantized and cfg.torch_dtype == torch.bfloat16 and ModelLoadConfig(dtype="auto").torch_dtype == "auto"
    for kwargs, message in [
        ({"dtype": "fp16"}, "dtype must be one of"),
        ({"attn_implementation": "flash"}, "attn_implementation must be None or one of"),
        ({"load_in_4bit": True, "load_in_8bit": True}, "exclusive"),
        ({"gradient_checkpointing": "yes"}, "gradient_checkpointing must be true or false"),
    ]:
        with pytest.raises(ValueError, match=message):
            ModelLoadConfig(**kwargs)
    with pytest.raises(ValueError, match=r"unknown ModelLoadConfig fields \['dtypes'\]"):
        ModelLoadConfig.from_dict({"dtypes": "float32"})


def test_load_options(tiny_model_dir):
    n = load_count()
    model, _ = load(str(tiny_model_dir), dtype="bfloat16", attn_implementation="eager", gradient_checkpointing=True)
    assert load_count() == n + 1
    assert model.dtype == torch.bfloat16 and model.config._attn_implementation == "eager"
    assert all(layer.gradient_checkpointing for layer in model.model.layers)
    assert not model.training
    auto, _ = load(str(tiny_model_dir), config=ModelLoadConfig(dtype="auto"))
    assert auto.dtype == torch.float32  # the checkpoint's own dtype
    same, _ = load(str(tiny_model_dir), dtype=torch.float16)  # a torch.dtype works too
    assert same.dtype == torch.float16
    with pytest.raises(TypeError, match="unknown options"):
        load(str(tiny_model_dir), load_in_3bit=True)


def test_one_base_model_load_per_comparison(tiny_model_dir, tmp_path):
    """The loader is called once for the baselines and every method (it used to be called
    1 + number of methods times, plus once more by the CLI for the tokenizer), and the
    second method trains on a clean base: the same θ as on a freshly loaded model."""
    from llm_calib.calm.trainer import calibrate

    calls = []

    def loader():
        calls.append(1)
        return load(str(tiny_model_dir))[0]

    tok = load(str(tiny_model_dir))[1]
    train, heldout = load_data(TRAIN).records, load_data(HELDOUT).records
    cfg = CalibrationConfig(training=dict(steps=2, batch_size=4, heldout_batch_size=4),
                            selection=dict(eval_every=1, guard_accuracy=0.0), lora=dict(rank=2, layers=[1]))
    cmp = run_comparison(loader, tok, ("t", train), ("h", heldout), [("e", load_data(EVAL).records)],
                         resolve_run(cfg, train, heldout),
                         [Calm(), LoraCE()], tmp_path / "out", checkpoints=False, progress=False, bootstrap=0)
    assert len(calls) == 1
    assert cmp.methods == ["calm", "lora_ce"]
    # lora_ce trained after calm on the same base object equals lora_ce on a fresh model
    import dataclasses

    from llm_calib.calm.trainer import CalibrationResult

    fresh = calibrate(load(str(tiny_model_dir))[0], tok, train, heldout, dataclasses.replace(cfg, objective=LoraCE()),
                      progress=False)
    saved = CalibrationResult.load(tmp_path / "out" / "lora_ce", load(str(tiny_model_dir))[0])
    ref = {n: p for n, p in fresh.model.named_parameters() if "lora_" in n or "modules_to_save" in n}
    got = dict(saved.model.named_parameters())
    assert ref and all(torch.equal(got[n], p) for n, p in ref.items())
    assert cmp.training["lora_ce"]["heldout_after"] == pytest.approx(fresh.metrics["after"])


def test_cli_loads_the_model_once_with_the_flags(tiny_model_dir, tmp_path):
    out = tmp_path / "out"
    n = load_count()
    argv = ["calibrate", "--model", str(tiny_model_dir), "--train", TRAIN, "--heldout", HELDOUT, "--eval", EVAL,
            "--out", str(out), "--methods", "calm,lora_ce,label_smoothing", "--steps", "1", "--batch-size", "4",
            "--heldout-batch-size", "4", "--lora-rank", "2", "--lora-layers", "1", "--bootstrap", "0",
            "--no-progress", "--dtype", "bfloat16", "--gradient-checkpointing", "--attn-implementation", "eager"]
    assert cli.main(argv) == 0
    assert load_count() == n + 1  # was 5 for three methods (tokenizer, baselines, one per method)
    saved = ModelLoadConfig.load(out / "model_loading.json")
    assert saved == ModelLoadConfig(dtype="bfloat16", gradient_checkpointing=True, attn_implementation="eager")
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["config"]["model_loading"]["dtype"] == "bfloat16"
    for method in ("calm", "lora_ce", "label_smoothing"):
        history = json.loads((out / method / "history.json").read_text())
        assert history and all(v == v for row in history for v in row.values())  # finite, no NaN


def test_cli_rejects_bad_flags(tiny_model_dir, tmp_path, capsys):
    base = ["calibrate", "--model", str(tiny_model_dir), "--train", TRAIN, "--heldout", HELDOUT, "--eval", EVAL,
            "--out", str(tmp_path)]
    with pytest.raises(SystemExit):
        cli.main([*base, "--dtype", "half"])
    assert "--dtype: invalid choice: 'half'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main([*base, "--load-in-4bit", "--load-in-8bit"])
    assert "not allowed with argument" in capsys.readouterr().err


def test_evaluate_takes_the_loading_flags(tiny_model_dir, tmp_path):
    out = {}
    for dtype in ("float32", "bfloat16"):
        d = tmp_path / dtype
        argv = ["evaluate", "--model", str(tiny_model_dir), "--data", EVAL, "--out", str(d), "--bootstrap", "0",
                "--quiet", "--dtype", dtype, "--attn-implementation", "eager"]
        assert cli.main(argv) == 0
        out[dtype] = json.loads((d / "metrics.json").read_text())
    assert out["bfloat16"]["config"]["dtype"] == "bfloat16"
    a = out["float32"]["domains"]["capitals"]["uncalibrated"]
    b = out["bfloat16"]["domains"]["capitals"]["uncalibrated"]
    assert a["nll"] != b["nll"] and b["nll"] == pytest.approx(a["nll"], rel=2e-2)  # bf16 rounding, no more


def test_model_loading_errors_say_what_is_wrong(tmp_path, monkeypatch, capsys):
    """Issue #31 (4): a missing local path says so; a near-miss of a built-in alias suggests it;
    offline, a hub name fails at once with one line (it used to wait ~50 s on retries)."""
    import time

    missing = tmp_path / "my-model"
    with pytest.raises(FileNotFoundError, match=f"model path {missing} does not exist"):
        load(str(missing))
    with pytest.raises(ValueError, match="did you mean 'smollm2-135m-instruct'"):
        load("smollm2-135m-instrct")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    t0 = time.perf_counter()
    with pytest.raises(OSError, match="hub is unreachable"):
        load("no-such-org/no-such-model-xyz")
    assert time.perf_counter() - t0 < 10
    # the CLI: one line, exit status 2
    for model, words in [(str(missing), "does not exist"), ("smollm2-135m-instrct", "did you mean"),
                         ("no-such-org/no-such-model-xyz", "unreachable")]:
        assert cli.main(["evaluate", "--model", model, "--data", EVAL, "--out", str(tmp_path / "o"),
                         "--quiet"]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("llm-calib: error: --model") and words in err and "\n" not in err
