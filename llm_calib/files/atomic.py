"""How llm_calib writes files: every file gets the mode an ordinary ``open()`` gives it, and the files
a later step reads back (checkpoint pointers, records, samples) are replaced atomically."""

from __future__ import annotations

import contextlib
import json
import os
import re
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = ["as_os_error", "atomic_path", "named_os_error", "ordinary_modes", "read_json", "write_bytes_atomic", "write_json_atomic",
           "write_text_atomic"]


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


def named_os_error(err: OSError, path: str | os.PathLike[str]) -> OSError:
    """``err`` naming ``path`` (``[Errno 28] No space left on device: 'runs/x/metrics.json'``): a
    write's OS error names the temporary file or nothing, which tells the user nothing. Keeps the
    errno (and so the subclass: ``PermissionError`` for EACCES); ``err`` itself when it already names ``path``.

    Example:
        >>> import errno
        >>> str(named_os_error(OSError(errno.ENOSPC, "No space left on device"), "out/report.md"))
        "[Errno 28] No space left on device: 'out/report.md'"
    """
    if err.filename is not None and str(err.filename) == str(path):
        return err
    if err.errno is None:
        return OSError(f"{path}: {err}")
    return OSError(err.errno, err.strerror or str(err), str(path))


_OS_ERROR_CODE = re.compile(r"\(os error (\d+)\)|Os \{ code: (\d+)")


def as_os_error(err: BaseException, path: str | os.PathLike[str]) -> OSError | None:
    """``err`` as an ``OSError`` naming ``path`` (:func:`named_os_error`) when it is one, or one in
    disguise: safetensors' ``SafetensorError`` on a full disk (``Error while serializing: I/O error:
    No space left on device (os error 28)``) carries the OS error only in its text. None for any other error.

    Example:
        >>> from safetensors import SafetensorError
        >>> str(as_os_error(SafetensorError("I/O error: No space left on device (os error 28)"), "m.safetensors"))
        "[Errno 28] No space left on device: 'm.safetensors'"
        >>> as_os_error(ValueError("bad"), "m.json") is None
        True
    """
    if isinstance(err, OSError):
        return named_os_error(err, path)
    found = _OS_ERROR_CODE.search(str(err)) if type(err).__name__ == "SafetensorError" else None
    if found is None:
        return None
    code = int(found.group(1) or found.group(2))
    return OSError(code, os.strerror(code), str(path))


def write_bytes_atomic(path: str | os.PathLike[str], data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically: a temporary file beside it, fsynced, renamed over
    ``path`` (parents made). A failed write (a full disk) leaves ``path`` as it was and no
    temporary file behind.

    Example:
        >>> import pathlib, tempfile
        >>> write_bytes_atomic(pathlib.Path(tempfile.mkdtemp()) / "b.bin", b"ok").read_bytes()
        b'ok'
    """
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as err:
        raise named_os_error(err, path) from err
    try:
        with os.fdopen(fd, "wb") as fh:
            view = memoryview(data)
            while view:  # os.write may write less than asked; a full disk raises OSError(ENOSPC)
                view = view[os.write(fh.fileno(), view):]
            os.fsync(fh.fileno())
        ordinary_modes(tmp)
        os.replace(tmp, path)
    except BaseException as err:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(err, OSError):
            raise named_os_error(err, path) from err
        raise
    return path


def write_text_atomic(path: str | os.PathLike[str], text: str) -> Path:
    """Write ``text`` to ``path`` as UTF-8, atomically (:func:`write_bytes_atomic`: a temporary file
    beside it, fsynced, renamed; parents made).

    Example:
        >>> import pathlib, tempfile
        >>> path = write_text_atomic(pathlib.Path(tempfile.mkdtemp()) / "a" / "note.txt", "done")
        >>> path.read_text()
        'done'
    """
    return write_bytes_atomic(path, text.encode("utf-8"))


def write_json_atomic(path: str | os.PathLike[str], data: Any, **dumps: Any) -> Path:
    """Write ``data`` as JSON (``indent=2`` and a final newline unless ``dumps`` says otherwise;
    ``dumps`` goes to :func:`json.dumps`) to ``path`` atomically (:func:`write_text_atomic`).

    Example:
        >>> import pathlib, tempfile
        >>> read_json(write_json_atomic(pathlib.Path(tempfile.mkdtemp()) / "m.json", {"ece": 0.1}))
        {'ece': 0.1}
    """
    return write_text_atomic(path, json.dumps(data, **{"indent": 2, **dumps}) + "\n")


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike[str]) -> Iterator[Path]:
    """A temporary path beside ``path`` for a writer that takes a file name (matplotlib's
    ``savefig``, ``save_pretrained``); when the block ends without error the file is fsynced and
    renamed over ``path``, otherwise removed (``path`` untouched). The temporary name keeps
    ``path``'s suffix, so writers that pick a format by suffix still do.

    Example:
        >>> import pathlib, tempfile
        >>> out = pathlib.Path(tempfile.mkdtemp()) / "plot.png"
        >>> with atomic_path(out) as tmp:
        ...     _ = tmp.write_bytes(b"png")
        >>> out.read_bytes(), sorted(p.name for p in out.parent.iterdir())
        (b'png', ['plot.png'])
    """
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=f".tmp{path.suffix}")
        os.close(fd)
    except OSError as err:
        raise named_os_error(err, path) from err
    tmp = Path(name)
    try:
        yield tmp
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        ordinary_modes(tmp)
        os.replace(tmp, path)
    except BaseException as err:
        with contextlib.suppress(OSError):
            tmp.unlink()
        converted = as_os_error(err, path)  # the writer's error names the temporary file, or nothing
        if converted is not None:
            raise converted from err
        raise


def read_json(path: str | os.PathLike[str]) -> Any:
    """The JSON in ``path``; a truncated or otherwise invalid file (a write cut short by a full disk
    or a kill) raises ``ValueError`` naming the file, the position and what to do.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: ``path`` is not valid UTF-8 JSON (the message names it).

    Example:
        >>> import pathlib, tempfile
        >>> p = pathlib.Path(tempfile.mkdtemp()) / "metrics.json"
        >>> _ = p.write_text('{"ece": 0.')
        >>> read_json(p)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ValueError: .../metrics.json: not valid JSON (truncated or corrupt? line 1 column ...); ...
    """
    path = Path(path)
    data = path.read_bytes()
    try:
        return json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as err:
        raise ValueError(f"{path}: not UTF-8 text (byte {err.start}); remove it or write it again") from None
    except json.JSONDecodeError as err:
        where = "empty file" if not data.strip() else f"line {err.lineno} column {err.colno}: {err.msg}"
        raise ValueError(f"{path}: not valid JSON (truncated or corrupt? {where}); remove it or write it "
                         "again (for a run's output: rerun the command)") from None
