"""File permissions: every file llm_calib writes gets the mode an ordinary ``open()`` gives it."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["ordinary_modes"]


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
