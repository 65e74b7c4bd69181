"""How llm_calib writes files: every file gets the mode an ordinary ``open()`` gives it, and the files
a later step reads back (checkpoint pointers, records, samples) are replaced atomically."""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

__all__ = ["ordinary_modes", "write_text_atomic"]


def _umask() -> int:
    mask = os.umask(0o022)  # reading the umask means setting it; put it back at once
    os.umask(mask)
    return mask


def ordinary_modes(path: str | os.PathLike[str]) -> Path:
    """Give ``path`` (a file, or a directory and everything below it but links) the modes
    ``open``/``mkdir`` would, ``0o666``/``0o777`` minus the umask; ``mkstemp`` and safetensors
    write ``0600``. Every file llm_calib writes goes through this.

    Example:
        >>> import pathlib, stat, tempfile
        >>> f = ordinary_modes(tempfile.mkstemp()[1])
        >>> stat.S_IMODE(f.stat().st_mode) == 0o666 & ~_umask()
        True
    """
    path = Path(path)
    mask = _umask()
    paths = [path, *path.rglob("*")] if path.is_dir() else [path]
    for p in paths:
        if p.is_symlink():
            continue
        os.chmod(p, (0o777 if p.is_dir() else 0o666) & ~mask)
    return path


def write_text_atomic(path: str | os.PathLike[str], text: str) -> Path:
    """Write ``text`` to ``path`` as UTF-8, atomically (a temporary file beside it, fsynced, renamed;
    parents made).

    Example:
        >>> import pathlib, tempfile
        >>> path = write_text_atomic(pathlib.Path(tempfile.mkdtemp()) / "a" / "note.txt", "done")
        >>> path.read_text()
        'done'
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        ordinary_modes(tmp)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return path
