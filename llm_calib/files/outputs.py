"""Output folders checked before the work: a command that will write to ``--out`` checks it
(exists as a file, not writable, too little free space) before it loads a model, and holds a lock
file in it while it runs, so two runs into one folder do not interleave their checkpoints.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import time
from collections.abc import Iterator
from pathlib import Path

__all__ = ["LOCK_FILE", "REPORT_OUTPUTS", "RunLockedError", "check_output_file", "check_output_folder",
           "earlier_report", "lora_run_bytes", "remove_stale", "run_lock"]

LOCK_FILE = ".llm-calib.lock"
"""The lock file :func:`run_lock` holds in an output folder (JSON: ``pid``, ``host``, ``started``)."""


class RunLockedError(FileExistsError):
    """Another live run holds the output folder's :data:`LOCK_FILE`."""


def _nearest_existing(path: Path) -> Path:
    """``path`` or its nearest existing ancestor (what ``mkdir(parents=True)`` would create under)."""
    probe = path.absolute()
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    return probe


def _mib(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB"


def check_output_folder(path: str | os.PathLike[str], *, flag: str = "--out", need_bytes: int = 0,
                        writes: str = "the run writes about {size} (adapters and checkpoints)") -> Path:
    """Check, before any work, that ``path`` can become an output folder: it is a folder or can be
    made one (no file there or on the way), writable, on a disk with roughly ``need_bytes`` free.
    Creates nothing.

    Args:
        path: the output folder.
        flag: what to call it in the message (the command-line flag).
        need_bytes: a rough estimate of what the run writes at least (:func:`lora_run_bytes`): a
            disk with less free is refused; 0 skips the free-space check.
        writes: what the message says is written (``{size}``: ``need_bytes``).

    Returns:
        ``path`` as a path.

    Raises:
        ValueError: ``path`` is empty or blank (it would mean the current folder), ``path`` (or a
            parent) exists and is not a folder, or ``need_bytes < 0``.
        PermissionError: ``path`` (or the parent it would be created in) is not writable.
        OSError: less than ``need_bytes`` free. Each message names ``flag`` and the path.

    Example:
        >>> import pathlib, tempfile
        >>> d = pathlib.Path(tempfile.mkdtemp())
        >>> check_output_folder(d / "run" / "out").name
        'out'
        >>> _ = (d / "file").write_text("x")
        >>> check_output_folder(d / "file")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ValueError: --out .../file: exists and is a file, not a folder; ...
    """
    if need_bytes < 0:
        raise ValueError(f"need_bytes must be >= 0, got {need_bytes}")
    if not str(path).strip():
        raise ValueError(f"{flag} {str(path)!r}: an empty path (an unset shell variable?); give the output folder")
    out = Path(path)
    base = _nearest_existing(out)
    if not base.is_dir():
        where = "" if base == out.absolute() else f" ({base} is a file)"
        raise ValueError(f"{flag} {out}: exists and is a file, not a folder{where}; choose a folder")
    if not os.access(base, os.W_OK | os.X_OK):
        what = "the folder" if base == out.absolute() else f"{base}, where it would be created,"
        raise PermissionError(f"{flag} {out}: {what} is not writable; choose another folder")
    if need_bytes:
        free = shutil.disk_usage(base).free
        if free < need_bytes:
            raise OSError(f"{flag} {out}: {_mib(free)} free on its disk, {writes.format(size=_mib(need_bytes))}; "
                          "free space or choose another folder")
    return out


def check_output_file(path: str | os.PathLike[str], *, flag: str = "--out") -> Path:
    """Check, before any work, that a file can be written at ``path``: not a folder, its folder
    exists or can be made, writable (a command writing one file, e.g. ``metrics --out``).

    Raises:
        IsADirectoryError: ``path`` is a folder.
        ValueError, PermissionError: as :func:`check_output_folder` for its folder.

    Example:
        >>> import tempfile
        >>> check_output_file(tempfile.mkdtemp())  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        IsADirectoryError: --out ...: is a folder; give a file name
    """
    out = Path(path)
    if out.is_dir():
        raise IsADirectoryError(f"{flag} {out}: is a folder; give a file name")
    check_output_folder(out.parent, flag=f"{flag} {out}: its folder")
    if out.exists() and not os.access(out, os.W_OK):
        raise PermissionError(f"{flag} {out}: the file is not writable")
    return out


def lora_run_bytes(hidden_size: int, layers: int, *, rank: int, modules_per_layer: int = 2, methods: int = 1,
                   checkpoints_kept: int = 2, bytes_per_value: int = 4) -> int:
    """A rough lower estimate of what a calibration run writes (a free-space check refuses only a
    disk the run cannot fit on): per method the adapter and ``checkpoints_kept`` checkpoints
    (adapter, two optimiser moments and a solver copy each) and 128 KiB of records, reports and plots. A
    LoRA pair on a ``hidden_size`` square projection holds ``2 * rank * hidden_size`` values (q/k/v/o
    of most models; MLP projections are wider); ``layers``: the adapted layers.

    Example:
        >>> round(lora_run_bytes(576, 30, rank=8) / 2**20, 1)  # SmolLM2-135M, q/v, all layers
        19.1
    """
    for name, value in (("hidden_size", hidden_size), ("layers", layers), ("rank", rank),
                        ("modules_per_layer", modules_per_layer), ("methods", methods),
                        ("bytes_per_value", bytes_per_value)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if checkpoints_kept < 0:
        raise ValueError(f"checkpoints_kept must be >= 0, got {checkpoints_kept}")
    adapter = 2 * rank * hidden_size * modules_per_layer * layers * bytes_per_value
    return methods * (adapter * (1 + 4 * checkpoints_kept) + 2**17)


REPORT_OUTPUTS = ("metrics.json", "report.md", "samples.jsonl", "reliability_*.png")
"""The files a calibration report of ``evaluate`` or ``metrics`` writes into its folder (glob patterns)."""


def earlier_report(out_dir: str | os.PathLike[str], *, flag: str = "--out") -> list[Path]:
    """The files (:data:`REPORT_OUTPUTS`) an earlier ``evaluate`` or ``metrics`` report left in
    ``out_dir``: a new report into the folder replaces them, and removes those it does not write
    again (another run's ``samples.jsonl``, the diagrams of domains it does not have), so the folder
    never mixes two runs. Such files that no report wrote are refused: a calibrate run's report (its
    ``metrics.json`` lists methods), or anything else of those names (a ``report.md`` of the user's).

    Returns:
        The earlier report's files (empty for a new or unrelated folder).

    Raises:
        ValueError: ``out_dir`` holds files of those names that no ``evaluate``/``metrics`` report
            wrote; the message names them.

    Example:
        >>> import pathlib, tempfile
        >>> d = pathlib.Path(tempfile.mkdtemp())
        >>> earlier_report(d)
        []
        >>> _ = (d / "report.md").write_text("my notes")
        >>> earlier_report(d)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ValueError: --out ...: holds report.md, which no llm-calib report wrote; ...
    """
    root = Path(out_dir)
    if not root.is_dir():
        return []
    found = sorted({p for pattern in REPORT_OUTPUTS for p in root.glob(pattern) if p.is_file()})
    if not found:
        return []
    try:
        record = json.loads((root / "metrics.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        record = None
    if isinstance(record, dict) and "methods" in record:
        raise ValueError(f"{flag} {root}: holds the report of a calibrate run (metrics.json lists its methods "
                         f"{record.get('methods')}); writing here would replace it; choose another folder")
    if not (isinstance(record, dict) and "domains" in record and "llm_calib_version" in record):
        names = ", ".join(p.name for p in found)
        raise ValueError(f"{flag} {root}: holds {names}, which no llm-calib report wrote; writing here would "
                         "replace it; choose a new or empty folder (or remove them)")
    return found


def remove_stale(earlier: list[Path], written: list[Path]) -> list[Path]:
    """Remove the files of ``earlier`` (:func:`earlier_report`) that are not among ``written`` (the
    new report's); return them.

    Example:
        >>> import pathlib, tempfile
        >>> d = pathlib.Path(tempfile.mkdtemp())
        >>> old = [d / "report.md", d / "samples.jsonl"]
        >>> for p in old:
        ...     _ = p.write_text("x")
        >>> [p.name for p in remove_stale(old, [d / "report.md"])], sorted(p.name for p in d.iterdir())
        (['samples.jsonl'], ['report.md'])
    """
    keep = {Path(p).absolute() for p in written}
    removed = [p for p in earlier if p.absolute() not in keep]
    for p in removed:
        with contextlib.suppress(FileNotFoundError):
            p.unlink()
    return removed


def _holder(lock: Path) -> dict[str, object]:
    try:
        return dict(json.loads(lock.read_text()))
    except (OSError, ValueError, TypeError):  # a lock cut short by a kill while being written
        return {}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


@contextlib.contextmanager
def run_lock(out_dir: str | os.PathLike[str], *, flag: str = "--out") -> Iterator[Path]:
    """Hold :data:`LOCK_FILE` in ``out_dir`` (created if missing) for the block: a second run into
    the same folder is refused, naming the holder's pid; a lock left by a dead process on this
    host (a kill) is replaced. The lock is removed when the block ends, and the folders it created
    with it when they are still empty (a run that failed before writing leaves nothing behind).

    Raises:
        RunLockedError: a live process holds the lock (the message names its pid, host and start).

    Example:
        >>> import tempfile
        >>> d = tempfile.mkdtemp()
        >>> with run_lock(d) as lock:
        ...     with run_lock(d):  # doctest: +ELLIPSIS
        ...         pass
        Traceback (most recent call last):
        llm_calib.files.outputs.RunLockedError: --out ...: another llm-calib run (pid ...) is writing to this folder since ...
        >>> lock.exists()
        False
    """
    root = Path(out_dir)
    created = [p for p in (root.absolute(), *root.absolute().parents) if not p.exists()]
    root.mkdir(parents=True, exist_ok=True)
    lock = root / LOCK_FILE
    host = socket.gethostname()
    record = json.dumps({"pid": os.getpid(), "host": host, "started": time.strftime("%Y-%m-%d %H:%M:%S")})
    for _ in range(2):
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666)
        except FileExistsError:
            held = _holder(lock)
            pid = held.get("pid")
            stale = isinstance(pid, int) and held.get("host") == host and not _alive(pid)
            if not stale and not (not held and time.time() - lock.stat().st_mtime > 60):
                raise RunLockedError(
                    f"{flag} {root}: another llm-calib run (pid {pid if pid is not None else '?'} on "
                    f"{held.get('host', '?')}) is writing to this folder since {held.get('started', '?')}; "
                    f"wait for it or choose another folder (if no such run exists, remove {lock})",
                ) from None
            with contextlib.suppress(FileNotFoundError):
                lock.unlink()  # left by a killed run
            continue
        with os.fdopen(fd, "w") as fh:
            fh.write(record)
        break
    else:  # pragma: no cover - a third process took the lock between our unlink and open
        raise RunLockedError(f"{flag} {root}: another llm-calib run took the lock; try again")
    try:
        yield lock
    finally:
        if _holder(lock).get("pid") == os.getpid():
            with contextlib.suppress(FileNotFoundError):
                lock.unlink()
        for folder in created:  # deepest first; one that holds anything stays
            with contextlib.suppress(OSError):
                folder.rmdir()
