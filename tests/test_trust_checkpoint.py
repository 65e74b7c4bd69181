"""Checkpoints a resume can trust (issue #43, 4-5): a damaged newest checkpoint falls back to the
newest intact one with a warning naming it; temporary folders a kill left are removed; a full
disk while writing is one ``OSError`` naming the folder, not torch's ``inline_container.cc`` error.
"""

from __future__ import annotations

import errno
import warnings
from pathlib import Path

import pytest
import torch

from llm_calib.files.checkpoint import (
    checkpoint_problem,
    latest_checkpoint,
    load_checkpoint,
    remove_stale_temporaries,
    save_checkpoint,
)


def _three(root: Path) -> list[Path]:
    return [save_checkpoint(root, s, {"w": torch.full((64,), float(s))}, {"step": s}, keep=3) for s in (10, 20, 30)]


def _truncate(path: Path, size: int) -> None:
    with open(path, "r+b") as f:
        f.truncate(size)


@pytest.mark.parametrize(("name", "size"), [("tensors.safetensors", 100), ("tensors.safetensors", 4),
                                            ("state.pt", 50), ("state.pt", 0)])
def test_a_damaged_newest_checkpoint_falls_back_with_a_warning(tmp_path: Path, name: str, size: int) -> None:
    _, middle, newest = _three(tmp_path)
    _truncate(newest / name, size)
    assert checkpoint_problem(newest) is not None and checkpoint_problem(middle) is None
    with pytest.warns(UserWarning, match=rf"skipping damaged checkpoint {newest}.*{name}.*resuming from {middle}"):
        found = latest_checkpoint(tmp_path)
    assert found == middle
    assert load_checkpoint(found)[1]["step"] == 20


def test_a_corrupt_header_and_a_missing_file_are_problems(tmp_path: Path) -> None:
    oldest, middle, newest = _three(tmp_path)
    data = bytearray((newest / "tensors.safetensors").read_bytes())
    data[8:12] = b"\xff\xfe{["
    (newest / "tensors.safetensors").write_bytes(bytes(data))
    assert "header" in checkpoint_problem(newest)
    (middle / "state.pt").unlink()
    assert checkpoint_problem(middle) == "state.pt: missing"
    with pytest.warns(UserWarning, match="skipping damaged checkpoint"):
        assert latest_checkpoint(tmp_path) == oldest


def test_no_intact_checkpoint_is_none_with_a_warning(tmp_path: Path) -> None:
    for ckpt in _three(tmp_path):
        _truncate(ckpt / "tensors.safetensors", 10)
    with pytest.warns(UserWarning, match="no intact checkpoint"):
        assert latest_checkpoint(tmp_path) is None


def test_an_intact_newest_checkpoint_gives_no_warning(tmp_path: Path) -> None:
    newest = _three(tmp_path)[-1]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert latest_checkpoint(tmp_path) == newest


def test_stale_temporary_folders_are_removed_by_the_next_write(tmp_path: Path) -> None:
    _three(tmp_path)
    stale = tmp_path / ".ckpt-00000040.k1ll3d.tmp"
    stale.mkdir()
    (stale / "tensors.safetensors").write_bytes(b"half")
    save_checkpoint(tmp_path, 50, {"w": torch.ones(2)}, {"step": 50})
    assert not stale.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["LATEST", "ckpt-00000030", "ckpt-00000050"]
    assert remove_stale_temporaries(tmp_path / "missing") == []


def test_a_full_disk_while_writing_is_one_clear_oserror(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _three(tmp_path)

    def full(*args: object, **kwargs: object) -> None:
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 3968 vs 3860")

    monkeypatch.setattr(torch, "save", full)
    with pytest.raises(OSError, match=rf"could not write checkpoint ckpt-00000040 in {tmp_path} \(.* MiB free") as err:
        save_checkpoint(tmp_path, 40, {"w": torch.ones(2)}, {"step": 40})
    assert err.value.errno == errno.ENOSPC and "--resume" in str(err.value)
    assert (tmp_path / "LATEST").read_text() == "ckpt-00000030"
    assert not list(tmp_path.glob(".ckpt-*"))  # the half-written checkpoint is gone
    monkeypatch.setattr(torch, "save", lambda *a, **k: (_ for _ in ()).throw(OSError(errno.ENOSPC, "No space left")))
    with pytest.raises(OSError, match=r"ckpt-00000040 in .*No space left") as err:
        save_checkpoint(tmp_path, 40, {"w": torch.ones(2)}, {"step": 40})
    assert err.value.errno == errno.ENOSPC


def test_other_runtime_errors_are_not_disguised(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch, "save", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("a bug")))
    with pytest.raises(RuntimeError, match=r"^a bug$"):
        save_checkpoint(tmp_path, 1, {"w": torch.ones(2)}, {"step": 1})


def test_a_byte_changed_in_place_is_caught_by_the_checksum(tmp_path: Path) -> None:
    """Same size, a header that parses, CRCs that hold: only the recorded SHA-256 tells (issue 51, 9)."""
    _, middle, newest = _three(tmp_path)
    weights = newest / "tensors.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0x40  # the last value's top byte
    weights.write_bytes(bytes(data))
    assert checkpoint_problem(newest) == ("tensors.safetensors: its SHA-256 is not the one recorded in checksums.json "
                                          "(changed after it was written)")
    with pytest.warns(UserWarning, match=rf"skipping damaged checkpoint {newest} .*resuming from {middle}"):
        assert latest_checkpoint(tmp_path) == middle
    (middle / "checksums.json").write_text('{"tensors.safetensors": ')
    assert "checksums.json: unreadable" in checkpoint_problem(middle)
    (middle / "checksums.json").unlink()  # a checkpoint written before checksums: the structural checks alone
    assert checkpoint_problem(middle) is None
