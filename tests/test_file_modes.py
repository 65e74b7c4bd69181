"""Every file llm_calib writes has the same ordinary mode (0644 under umask 022), issue #31 (6).

safetensors writes 0600 and ``tempfile.mkstemp`` creates 0600: samples.jsonl, adapter weights,
``lambda.safetensors`` and the merged ``model.safetensors`` used to be 0600, everything else 0644.
"""

from __future__ import annotations

import os
import stat
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from llm_calib.calm import CalibrationConfig, CalibrationResult
from llm_calib.calm.export import export_merged
from llm_calib.calm.lora import attach_lora
from llm_calib.config.calibration import LoraSettings
from llm_calib.evaluation.evaluate import evaluate, write_samples
from llm_calib.files.atomic import ordinary_modes, write_text_atomic
from llm_calib.files.checkpoint import save_checkpoint
from llm_calib.models import tiny_random_model

warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)


@pytest.fixture(autouse=True)
def _umask_022() -> Iterator[None]:
    old = os.umask(0o022)
    yield
    os.umask(old)


def _modes(root: Path) -> dict[str, str]:
    paths = [root, *root.rglob("*")] if root.is_dir() else [root]
    return {str(p.relative_to(root.parent)): oct(stat.S_IMODE(p.stat().st_mode)) for p in paths}


def _ordinary(root: Path) -> None:
    modes = _modes(root)
    bad = {p: m for p, m in modes.items()
           if m != ("0o755" if (root.parent / p).is_dir() else "0o644")}
    assert not bad, f"not 0644 files / 0755 directories: {bad}"


def test_samples_jsonl(tmp_path: Path) -> None:
    model, tok = tiny_random_model()
    res = evaluate(model, tok, ["builtin:capitals:n=3"], ci=False)
    _ordinary(write_samples(res, tmp_path / "samples.jsonl"))
    _ordinary(write_text_atomic(tmp_path / "note.txt", "x"))


def test_checkpoint(tmp_path: Path) -> None:
    _ordinary(save_checkpoint(tmp_path / "ckpt", 3, {"w": torch.ones(2)}, {"step": 3}))
    _ordinary(tmp_path / "ckpt" / "LATEST")


def test_saved_result_and_merged_model(tmp_path: Path) -> None:
    model, tok = tiny_random_model()
    peft_model = attach_lora(model, LoraSettings(rank=2), output_scale=True)
    result = CalibrationResult(peft_model, {"lam": torch.zeros(3)}, [], {}, CalibrationConfig())
    saved = result.save(tmp_path / "calm")
    assert (saved / "lambda.safetensors").is_file()
    assert any(p.suffix == ".safetensors" for p in (saved / "adapter").iterdir())
    _ordinary(saved)
    base, tok = tiny_random_model()
    merged = export_merged(base, tok, saved, tmp_path / "merged")
    assert (merged / "model.safetensors").is_file()
    _ordinary(merged)


def test_ordinary_modes_follows_the_umask(tmp_path: Path) -> None:
    f = tmp_path / "f"
    f.write_text("x")
    f.chmod(0o600)
    os.umask(0o027)
    assert oct(stat.S_IMODE(ordinary_modes(f).stat().st_mode)) == "0o640"


def test_files_of_the_user_keep_their_modes(tmp_path: Path) -> None:
    """Only what llm_calib wrote is touched: a script already in the output directory stays 0755."""
    out = tmp_path / "calm"
    out.mkdir()
    script = out / "run.sh"
    script.write_text("#!/bin/sh\n")
    script.chmod(0o755)
    model, _ = tiny_random_model()
    CalibrationResult(attach_lora(model, LoraSettings(rank=2)), {}, [], {}, CalibrationConfig()).save(out)
    assert oct(stat.S_IMODE(script.stat().st_mode)) == "0o755"
