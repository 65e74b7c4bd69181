"""``export`` never replaces the base model's folder, nor a folder it did not write (issue #43, 1).

``cp -a BASE victim; llm-calib export RUN/calm --model victim --out victim`` used to replace the
base weights; ``evaluate --model victim --adapter RUN/calm`` then applied LoRA twice.
"""

from __future__ import annotations

import hashlib
import shutil
import warnings
from pathlib import Path

import pytest

from llm_calib.calm.export import EXPORT_FILE, check_export_target, export_merged
from llm_calib.calm.lora import attach_lora
from llm_calib.config.calibration import LoraSettings
from llm_calib.models import load as load_model

warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)


def _digest(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


@pytest.fixture
def base(tmp_path: Path, tiny_model_dir: Path) -> Path:
    """A copy of the tiny base model, as ``cp -a BASE victim`` made."""
    return Path(shutil.copytree(tiny_model_dir, tmp_path / "victim"))


@pytest.fixture
def adapter(tmp_path: Path, tiny_model_dir: Path) -> Path:
    path = tmp_path / "adapter"
    attach_lora(load_model(str(tiny_model_dir))[0], LoraSettings(rank=2)).save_pretrained(str(path))
    return path


@pytest.mark.parametrize("how", ["same path", "symlink", "trailing dot"])
def test_export_onto_the_base_folder_is_refused_and_the_base_is_unchanged(base: Path, adapter: Path,
                                                                          tmp_path: Path, how: str) -> None:
    before = _digest(base)
    out = {"same path": base, "trailing dot": base / ".", "symlink": tmp_path / "link"}[how]
    if how == "symlink":
        out.symlink_to(base, target_is_directory=True)
    model, tok = load_model(str(base))
    with pytest.raises(ValueError, match=r"this is the base model's folder"):
        export_merged(model, tok, adapter, out, overwrite=True)  # overwrite never allows the base
    with pytest.raises(ValueError, match=r"base model's folder"):
        check_export_target(out, base, overwrite=True)
    assert _digest(base) == before


def test_export_onto_the_adapter_is_refused(base: Path, adapter: Path) -> None:
    with pytest.raises(ValueError, match=r"this is the adapter's folder"):
        check_export_target(adapter, base, adapter=adapter, overwrite=True)


def test_a_non_empty_folder_needs_overwrite(base: Path, adapter: Path, tmp_path: Path) -> None:
    other = tmp_path / "notes"
    other.mkdir()
    (other / "keep.txt").write_text("mine")
    model, tok = load_model(str(base))
    with pytest.raises(ValueError, match=r"non-empty folder .* --overwrite"):
        export_merged(model, tok, adapter, other)
    assert (other / "keep.txt").read_text() == "mine"
    out = export_merged(model, tok, adapter, other, overwrite=True)
    assert (out / EXPORT_FILE).is_file() and not (out / "keep.txt").exists()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []  # no staging left


def test_an_earlier_export_and_an_empty_folder_are_fine(base: Path, adapter: Path, tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    assert check_export_target(empty, base) == empty
    model, tok = load_model(str(base))
    out = export_merged(model, tok, adapter, tmp_path / "merged")
    model, tok = load_model(str(base))
    assert export_merged(model, tok, adapter, out) == out  # re-export into its own earlier output
    with pytest.raises(ValueError, match=r"is not a folder"):
        check_export_target(out / EXPORT_FILE, base, overwrite=True)
