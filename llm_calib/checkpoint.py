"""Atomic, resumable checkpoints.

A checkpoint is a directory ``ckpt-<step>/`` with ``tensors.safetensors`` and ``state.pt`` (read
with ``torch.load(weights_only=True)``), written under a temporary name and renamed into place
before the ``LATEST`` pointer is replaced: a killed run leaves ``LATEST`` naming a complete one.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from llm_calib.file_modes import ordinary_modes, write_text_atomic

__all__ = ["latest_checkpoint", "load_checkpoint", "save_checkpoint"]


def _owned(tensor: torch.Tensor) -> torch.Tensor:
    """A CPU tensor with its own memory (safetensors refuses shared storage, e.g. F2SA's state)."""
    out = tensor.detach().contiguous().cpu()
    shared = out.untyped_storage().data_ptr() == tensor.untyped_storage().data_ptr()
    return out.clone() if shared else out


def save_checkpoint(directory: str | os.PathLike[str], step: int, tensors: dict[str, torch.Tensor],
                    state: dict[str, Any], keep: int = 2) -> Path:
    """Write checkpoint ``step`` atomically, keep only the newest ``keep``; return its path.

    Args:
        directory: the run's checkpoint directory (created if missing).
        step: the step count the checkpoint represents.
        tensors: named tensors (stored with safetensors).
        state: dicts, lists, numbers, strings, tensors (what ``weights_only`` loading reads).
        keep: how many checkpoints to retain (>= 1).

    Raises:
        ValueError: ``keep < 1``.
        OSError: the checkpoint could not be written (``LATEST`` still names the previous one).

    Example:
        >>> import tempfile, torch
        >>> d = tempfile.mkdtemp()
        >>> _ = save_checkpoint(d, 3, {"w": torch.ones(2)}, {"step": 3})
        >>> t, s = load_checkpoint(latest_checkpoint(d))
        >>> t["w"].tolist(), s["step"]
        ([1.0, 1.0], 3)
    """
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"ckpt-{step:08d}"
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=f".ckpt-{step:08d}.", suffix=".tmp"))
    try:
        save_file({k: _owned(v) for k, v in tensors.items()}, str(tmp / "tensors.safetensors"))
        torch.save(state, tmp / "state.pt")
        ordinary_modes(tmp)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    write_text_atomic(root / "LATEST", final.name)
    for old in sorted(root.glob("ckpt-*"))[:-keep]:
        if old.name != final.name:
            shutil.rmtree(old, ignore_errors=True)
    return final


def latest_checkpoint(directory: str | os.PathLike[str]) -> Path | None:
    """The checkpoint ``LATEST`` names in ``directory`` when complete, else None (also if no directory).

    Example:
        >>> import tempfile
        >>> latest_checkpoint(tempfile.mkdtemp()) is None
        True
    """
    root = Path(directory)
    pointer = root / "LATEST"
    if not pointer.exists():
        return None
    path = root / pointer.read_text().strip()
    return path if (path / "state.pt").exists() and (path / "tensors.safetensors").exists() else None


def load_checkpoint(path: str | os.PathLike[str]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Read ``(tensors, state)`` of a checkpoint written by :func:`save_checkpoint` (its example round-trips).

    Raises:
        FileNotFoundError: a file of the checkpoint is missing.
    """
    path = Path(path)
    tensors = load_file(str(path / "tensors.safetensors"))
    state = torch.load(path / "state.pt", weights_only=True)
    return tensors, state
