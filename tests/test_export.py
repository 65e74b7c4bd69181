"""Saved adapters: ``evaluate --adapter`` and ``llm-calib export`` (merged standalone model)."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest
import torch

from llm_calib import cli
from llm_calib.calm.export import adapter_directory, export_merged, load_adapter, merge_adapter
from llm_calib.calm.lora import OUTPUT_LOG_SCALE, FunctionalLM, attach_lora
from llm_calib.config.calibration import LoraSettings
from llm_calib.data import load as load_data
from llm_calib.models import load as load_model
from llm_calib.scoring import score_option_likelihood

warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)

SPEC = "builtin:capitals,arithmetic:n=6"


def _trained_adapter(tiny_model_dir, path, log_scale=0.4):
    """A peft adapter with non-zero LoRA weights and output scale, as training would leave it."""
    model, _ = load_model(str(tiny_model_dir))
    peft_model = attach_lora(model, LoraSettings(rank=2, alpha=4), output_scale=True)
    gen = torch.Generator().manual_seed(0)
    lm = FunctionalLM(peft_model)
    theta = lm.theta()
    theta = {k: (torch.randn(v.shape, generator=gen) * 0.3 if k != OUTPUT_LOG_SCALE else torch.tensor(log_scale))
             for k, v in theta.items()}
    lm.load_theta(theta)
    peft_model.save_pretrained(str(path))
    return peft_model


def _probs(model, tok):
    s = score_option_likelihood(model, tok, load_data(SPEC).records)
    return [p.numpy() for p in s.probs], s


@pytest.fixture(scope="module")
def adapter(tmp_path_factory, tiny_model_dir):
    path = tmp_path_factory.mktemp("adapter")
    peft_model = _trained_adapter(tiny_model_dir, path)
    return path, peft_model


def test_export_loads_with_plain_transformers_and_matches_the_peft_model(adapter, tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path, _ = adapter
    base, tok = load_model(str(tiny_model_dir))
    peft_model = load_adapter(base, path)
    want, _ = _probs(peft_model, tok)
    base_probs, _ = _probs(load_model(str(tiny_model_dir))[0], tok)
    # the adapter really changes the model (so equality below is not trivial)
    assert max(np.abs(a - b).max() for a, b in zip(want, base_probs, strict=True)) > 1e-3
    out = tmp_path / "merged"
    assert cli.main(["export", str(path), "--model", str(tiny_model_dir), "--out", str(out)]) == 0
    assert (out / "model.safetensors").is_file() and not (out / "adapter_config.json").exists()
    plain = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    assert type(plain).__name__ == "LlamaForCausalLM"
    assert not any("lora" in n or "modules_to_save" in n for n, _ in plain.named_parameters())
    got, _ = _probs(plain, AutoTokenizer.from_pretrained(str(out)))
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    # the output scale was merged: the final norm's weight is the base weight times exp(0.4)
    fresh = load_model(str(tiny_model_dir))[0]
    torch.testing.assert_close(plain.model.norm.weight, fresh.model.norm.weight * float(np.exp(0.4)),
                               rtol=1e-6, atol=1e-6)


def test_merge_is_exact_on_the_logits(adapter, tiny_model_dir):
    path, _ = adapter
    base, tok = load_model(str(tiny_model_dir))
    peft_model = load_adapter(base, path)
    ids = torch.tensor([tok("The capital of France is")["input_ids"]])
    with torch.no_grad():
        want = peft_model(input_ids=ids).logits
    merged = merge_adapter(peft_model)
    with torch.no_grad():
        got = merged(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_evaluate_with_adapter_scores_the_adapted_model(adapter, tiny_model_dir, tmp_path):
    path, _ = adapter
    # a saved CalibrationResult layout: DIR/adapter/
    result_dir = tmp_path / "result"
    (result_dir / "adapter").mkdir(parents=True)
    for f in path.iterdir():
        (result_dir / "adapter" / f.name).write_bytes(f.read_bytes())
    assert adapter_directory(result_dir) == result_dir / "adapter"
    out = tmp_path / "eval"
    argv = ["evaluate", "--model", str(tiny_model_dir), "--adapter", str(result_dir), "--data", SPEC,
            "--bootstrap", "0", "--quiet", "--log-samples", "--out", str(out)]
    assert cli.main(argv) == 0
    rows = [json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines()]
    base, tok = load_model(str(tiny_model_dir))
    want, _ = _probs(load_adapter(base, path), tok)
    for row, p in zip(rows, want, strict=True):
        np.testing.assert_allclose(row["probs"], p, rtol=1e-6, atol=1e-7)
    assert json.loads((out / "metrics.json").read_text())["config"]["adapter"] == str(result_dir)


def test_missing_adapter_is_a_user_error(tiny_model_dir, tmp_path, capsys):
    assert cli.main(["export", str(tmp_path), "--model", str(tiny_model_dir), "--out", str(tmp_path / "o")]) == 2
    assert "adapter_config.json" in capsys.readouterr().err
    with pytest.raises(FileNotFoundError, match="not a saved calibration result"):
        export_merged(None, None, tmp_path, tmp_path / "o")
