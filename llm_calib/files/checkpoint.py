"""Atomic, resumable checkpoints.

A checkpoint is a directory ``ckpt-<step>/`` with ``tensors.safetensors``, ``state.pt`` (read
with ``torch.load(weights_only=True)``) and ``checksums.json`` (the SHA-256 of both), written under
a temporary name and renamed into place before the ``LATEST`` pointer is replaced: a killed run
leaves ``LATEST`` naming a complete one. Reading falls back from a damaged newest checkpoint (a
disk error, a copy cut short, bytes changed in place) to the newest intact one, with a warning
naming the one skipped; temporary folders a kill left are removed.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import tempfile
import warnings
import zipfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from llm_calib.files.atomic import ordinary_modes, write_text_atomic

__all__ = ["CHECKSUMS_FILE", "checkpoint_problem", "latest_checkpoint", "load_checkpoint", "remove_stale_temporaries",
           "safetensors_problem", "save_checkpoint"]

CHECKSUMS_FILE = "checksums.json"
"""The file of a checkpoint holding the SHA-256 of its other files, verified before it is resumed from."""

_DATA_FILES = ("tensors.safetensors", "state.pt")

_TEMPORARY = ".ckpt-*.tmp"
"""The names :func:`save_checkpoint` writes a checkpoint under before renaming it into place."""


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
    remove_stale_temporaries(root)  # one run writes a folder at a time: any temporary is a killed write's
    final = root / f"ckpt-{step:08d}"
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=f".ckpt-{step:08d}.", suffix=".tmp"))
    try:
        try:
            save_file({k: _owned(v) for k, v in tensors.items()}, str(tmp / "tensors.safetensors"))
            torch.save(state, tmp / "state.pt")
            write_text_atomic(tmp / CHECKSUMS_FILE, json.dumps({name: _sha256(tmp / name) for name in _DATA_FILES}))
            ordinary_modes(tmp)
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            write_text_atomic(root / "LATEST", final.name)
        except Exception as err:
            if not isinstance(err, OSError) and not _is_write_failure(err):
                raise
            raise _write_error(root, final.name, err) from err
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    for old in sorted(root.glob("ckpt-*"))[:-keep]:
        if old.name != final.name:
            shutil.rmtree(old, ignore_errors=True)
    return final


def _is_write_failure(err: Exception) -> bool:
    """Whether torch's ``RuntimeError`` is its zip writer failing to write (a full disk reads
    ``[enforce fail at inline_container.cc:672] . unexpected pos 3968 vs 3860``), or safetensors'
    error is an OS error (``No space left on device (os error 28)``)."""
    text = str(err)
    if type(err).__name__ == "SafetensorError":
        return "os error" in text or "Os {" in text
    return isinstance(err, RuntimeError) and any(
        s in text for s in ("inline_container", "PytorchStreamWriter", "unexpected pos", "file write failed"))


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _write_error(root: Path, name: str, err: BaseException) -> OSError:
    """One clear ``OSError`` for a checkpoint that could not be written, naming the folder and the
    free space (a full disk's error from torch names neither)."""
    try:
        free = f"{shutil.disk_usage(root).free / 2**20:.1f} MiB free"
    except OSError:  # pragma: no cover - the folder vanished meanwhile
        free = "free space unknown"
    code = err.errno if isinstance(err, OSError) and err.errno else errno.ENOSPC if "pos" in str(err) or "os error 28" in str(err) else errno.EIO
    reason = err.strerror if isinstance(err, OSError) and err.strerror else str(err).strip()
    return OSError(code, f"could not write checkpoint {name} in {root} ({free}; {reason}); the previous "
                         "checkpoint is intact: free space, then continue with --resume")


def remove_stale_temporaries(directory: str | os.PathLike[str]) -> list[Path]:
    """Remove the temporary checkpoint folders (``.ckpt-*.tmp``) a killed write left in
    ``directory``; return them. Only one run may write to a checkpoint folder at a time (a run lock).

    Example:
        >>> import pathlib, tempfile
        >>> d = pathlib.Path(tempfile.mkdtemp())
        >>> (d / ".ckpt-00000004.x1.tmp").mkdir()
        >>> [p.name for p in remove_stale_temporaries(d)], list(d.iterdir())
        (['.ckpt-00000004.x1.tmp'], [])
    """
    root = Path(directory)
    stale = sorted(p for p in root.glob(_TEMPORARY) if p.is_dir()) if root.is_dir() else []
    for path in stale:
        shutil.rmtree(path, ignore_errors=True)
    return stale


def checkpoint_problem(path: str | os.PathLike[str]) -> str | None:
    """What is wrong with the checkpoint folder ``path`` (a file missing or cut short, a header
    that does not parse, a byte changed: its SHA-256 is not the one :data:`CHECKSUMS_FILE` records),
    or None when it is intact. Reads every file once (the checksums; a checkpoint written before
    they were recorded gets the structural checks alone: the safetensors header and the zip
    directory and CRCs of ``state.pt``).

    Example:
        >>> import pathlib, tempfile, torch
        >>> ckpt = save_checkpoint(tempfile.mkdtemp(), 1, {"w": torch.ones(2)}, {"step": 1})
        >>> checkpoint_problem(ckpt) is None
        True
        >>> with open(ckpt / "tensors.safetensors", "r+b") as f:
        ...     _ = f.truncate(20)
        >>> checkpoint_problem(ckpt)
        'tensors.safetensors: cut short (20 bytes, less than its header needs)'
    """
    path = Path(path)
    weights, state = path / "tensors.safetensors", path / "state.pt"
    for f in (weights, state):
        if not f.is_file():
            return f"{f.name}: missing"
    problem = safetensors_problem(weights)
    if problem is not None:
        return f"{weights.name}: {problem}"
    try:
        with zipfile.ZipFile(state) as archive:
            bad = archive.testzip()
    except (zipfile.BadZipFile, OSError, EOFError) as err:
        return f"{state.name}: not a complete torch archive ({err})"
    if bad is not None:
        return f"{state.name}: {bad} fails its CRC"
    return _checksum_problem(path)


def _checksum_problem(path: Path) -> str | None:
    """A file of the checkpoint whose SHA-256 differs from the recorded one (same size, other bytes: a
    disk error, an edit), or an unreadable record; None when all match or nothing is recorded."""
    record = path / CHECKSUMS_FILE
    if not record.is_file():
        return None  # written before checksums were recorded
    try:
        recorded = json.loads(record.read_text(encoding="utf-8"))
        expected = {name: str(recorded[name]) for name in _DATA_FILES}
    except (OSError, ValueError, KeyError, TypeError) as err:
        return f"{CHECKSUMS_FILE}: unreadable ({type(err).__name__}: {err})"
    for name, digest in expected.items():
        if _sha256(path / name) != digest:
            return f"{name}: its SHA-256 is not the one recorded in {CHECKSUMS_FILE} (changed after it was written)"
    return None


def safetensors_problem(path: str | os.PathLike[str]) -> str | None:
    """What is wrong with the safetensors file ``path`` (missing, cut short, a header that does not
    parse), or None when its structure is whole; reads the header, not the tensors.

    Example:
        >>> import pathlib, tempfile, torch
        >>> from safetensors.torch import save_file
        >>> f = pathlib.Path(tempfile.mkdtemp()) / "w.safetensors"
        >>> save_file({"w": torch.ones(8)}, str(f))
        >>> safetensors_problem(f) is None
        True
        >>> _ = f.write_bytes(f.read_bytes()[:-4])
        >>> safetensors_problem(f)
        'cut short (92 of 96 bytes)'
    """
    path = Path(path)
    if not path.is_file():
        return "missing"
    size = path.stat().st_size
    with open(path, "rb") as fh:
        head = fh.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        if n < 2 or 8 + n > size:
            return f"cut short ({size} bytes, less than its header needs)"
        try:
            header = json.loads(fh.read(n))
        except (ValueError, UnicodeDecodeError):
            return "the header is not valid JSON"
    if not isinstance(header, dict):
        return "the header is not valid JSON"
    ends = [int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__" and isinstance(v, dict)
            and "data_offsets" in v]
    if 8 + n + max(ends, default=0) > size:
        return f"cut short ({size} of {8 + n + max(ends)} bytes)"
    return None


def _step_folders(root: Path) -> list[Path]:
    """The checkpoint folders in ``root``, newest first (by step; then the one ``LATEST`` names)."""
    found = [p for p in root.glob("ckpt-*") if p.is_dir() and p.name[5:].isdigit()]
    pointer = root / "LATEST"
    named = pointer.read_text(errors="replace").strip() if pointer.is_file() else ""
    return sorted(found, key=lambda p: (int(p.name[5:]), p.name == named), reverse=True)


def latest_checkpoint(directory: str | os.PathLike[str]) -> Path | None:
    """The newest intact checkpoint in ``directory`` (:func:`checkpoint_problem`), else None (also if
    no directory). A damaged newer one is skipped with a ``UserWarning`` naming it and what is wrong.

    Example:
        >>> import tempfile
        >>> latest_checkpoint(tempfile.mkdtemp()) is None
        True
    """
    root = Path(directory)
    if not root.is_dir():
        return None
    skipped: list[str] = []
    for path in _step_folders(root):
        problem = checkpoint_problem(path)
        if problem is None:
            if skipped:
                warnings.warn(f"skipping damaged checkpoint {'; '.join(skipped)}; resuming from {path}",
                              UserWarning, stacklevel=2)
            return path
        skipped.append(f"{path} ({problem})")
    if skipped:
        warnings.warn(f"no intact checkpoint in {root}: {'; '.join(skipped)}", UserWarning, stacklevel=2)
    return None


def load_checkpoint(path: str | os.PathLike[str]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Read ``(tensors, state)`` of a checkpoint written by :func:`save_checkpoint` (its example round-trips).

    Raises:
        FileNotFoundError: a file of the checkpoint is missing.
    """
    path = Path(path)
    tensors = load_file(str(path / "tensors.safetensors"))
    state = torch.load(path / "state.pt", weights_only=True)
    return tensors, state
