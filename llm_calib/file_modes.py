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
    """Give ``path`` the permissions an ordinary ``open(path, "w")`` or ``mkdir`` would.

    Files get ``0o666`` and directories ``0o777``, minus the process umask: ``0644`` / ``0755``
    under the usual umask ``022``. ``tempfile.mkstemp``/``mkdtemp`` create ``0600``/``0700`` and
    safetensors writes ``0600``; every file llm_calib writes goes through this, so all of them
    (reports, samples, adapters, λ, checkpoints, merged models) have the same modes. A directory
    is handled with everything below it (symbolic links are left alone): pass only what was
    just written.

    Args:
        path: a file or directory.

    Returns:
        ``path`` as a :class:`~pathlib.Path`.

    Example:
        >>> import pathlib, stat, tempfile
        >>> f = pathlib.Path(tempfile.mkstemp()[1])
        >>> oct(stat.S_IMODE(f.stat().st_mode))
        '0o600'
        >>> stat.S_IMODE(ordinary_modes(f).stat().st_mode) == 0o666 & ~_umask()
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
