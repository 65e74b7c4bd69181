"""Every final output is written atomically (issue #43, 4): a full disk at any write leaves each
file either as it was or complete, never truncated, and no temporary file behind; a truncated
JSON file is reported by name.
"""

from __future__ import annotations

import builtins
import errno
import io
import json
import os
from collections.abc import Callable
from pathlib import Path

import matplotlib.figure
import pytest

from llm_calib.data import builtin_multiple_choice
from llm_calib.evaluation.evaluate import EvaluationResult, evaluate_records, write_samples
from llm_calib.evaluation.report import write_report
from llm_calib.files.atomic import atomic_path, read_json, write_bytes_atomic, write_json_atomic

PNG_END = b"IEND\xaeB`\x82"


@pytest.fixture(scope="module")
def results(tiny) -> tuple[EvaluationResult, EvaluationResult]:
    model, tok = tiny
    fit = builtin_multiple_choice(5, seed=3, domains=["arithmetic"])
    return tuple(evaluate_records(model, tok, [("builtin", builtin_multiple_choice(n, domains=["capitals"]))],
                                  temperature_fit=("fit", fit), n_resamples=20) for n in (4, 6))


class FullDisk:
    """``os.write`` that writes at most 4096 bytes a call to files under ``root`` and raises
    ``OSError(ENOSPC)`` at the ``k``-th such call."""

    def __init__(self, root: Path, k: int, real: Callable[[int, bytes], int]) -> None:
        self.root, self.k, self.real, self.calls = str(root), k, real, 0

    def __call__(self, fd: int, data: bytes) -> int:
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            target = ""
        if not target.startswith(self.root):
            return self.real(fd, data)
        self.calls += 1
        if self.calls == self.k:
            raise OSError(errno.ENOSPC, "No space left on device")
        return self.real(fd, bytes(data[:4096]))


class _ThroughOsWrite:
    """A file object whose writes go through ``os.write`` (so :class:`FullDisk` sees a plain
    ``open(path, "w").write`` too, not only llm_calib's atomic writer)."""

    def __init__(self, f: io.IOBase) -> None:
        self._f = f

    def write(self, data: str | bytes) -> int:
        raw = data.encode(getattr(self._f, "encoding", None) or "utf-8") if isinstance(data, str) else bytes(data)
        self._f.flush()
        view = memoryview(raw)
        while view:
            view = view[os.write(self._f.fileno(), view):]
        return len(data)

    def __getattr__(self, name: str) -> object:
        return getattr(self._f, name)

    def __enter__(self) -> _ThroughOsWrite:
        return self

    def __exit__(self, *exc: object) -> None:
        self._f.__exit__(*exc)


def _routing_open(root: Path, real_open: Callable[..., object]) -> Callable[..., object]:
    def opener(file: object, mode: str = "r", *args: object, **kwargs: object) -> object:
        f = real_open(file, mode, *args, **kwargs)
        if isinstance(file, str | os.PathLike) and str(file).startswith(str(root)) and set(mode) & set("wax"):
            return _ThroughOsWrite(f)
        return f
    return opener


def _savefig_cached(self: matplotlib.figure.Figure, fname: str | os.PathLike[str], **kw: object) -> None:
    """The figure rendered once per title (rendering dominates the test's time), written with ``open``."""
    title = self._suptitle.get_text() if self._suptitle is not None else ""
    if title not in _RENDERED:
        buf = io.BytesIO()
        Figure_savefig(self, buf, format="png", **kw)
        _RENDERED[title] = buf.getvalue()
    with open(fname, "wb") as fh:
        fh.write(_RENDERED[title])


Figure_savefig = matplotlib.figure.Figure.savefig
_RENDERED: dict[str, bytes] = {}


def _complete(path: Path, before: dict[str, bytes]) -> bool:
    data = path.read_bytes()
    if data == before.get(path.name):
        return True
    if path.suffix == ".json":
        return isinstance(read_json(path), dict)
    if path.suffix == ".png":
        return data.endswith(PNG_END)
    if path.suffix == ".jsonl":
        return data.endswith(b"\n") and all(json.loads(line) for line in data.splitlines())
    return data.endswith(b"\n")  # report.md


def test_a_full_disk_at_every_write_leaves_no_truncated_output(results, tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    old, new = results
    out = tmp_path / "out"
    write_report(old, out)
    write_samples(old, out / "samples.jsonl")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", _savefig_cached)
    opener = _routing_open(out, io.open)
    monkeypatch.setattr(io, "open", opener)
    monkeypatch.setattr(builtins, "open", opener)
    real = os.write
    k, failures = 1, 0
    while True:
        fake = FullDisk(out, k, real)
        monkeypatch.setattr(os, "write", fake)
        try:
            write_report(new, out)
            write_samples(new, out / "samples.jsonl")
        except OSError as err:
            assert err.errno == errno.ENOSPC
            failures += 1
        else:
            break
        finally:
            monkeypatch.setattr(os, "write", real)
        names = sorted(p.name for p in out.iterdir())
        assert names == sorted(before), f"k={k}: temporary files left: {names}"
        bad = [p.name for p in out.iterdir() if not _complete(p, before)]
        assert not bad, f"k={k}: truncated {bad}"
        k += 1
    assert failures > 10  # the writes were really split and failed at every point
    assert (out / "metrics.json").read_bytes() != before["metrics.json"]


def test_atomic_path_keeps_the_old_file_when_the_writer_fails(tmp_path: Path) -> None:
    target = write_bytes_atomic(tmp_path / "plot.png", b"old")
    with pytest.raises(OSError, match="No space"), atomic_path(target) as tmp:
        assert tmp.suffix == ".png" and tmp.parent == tmp_path
        tmp.write_bytes(b"half")
        raise OSError(errno.ENOSPC, "No space left on device")
    assert target.read_bytes() == b"old" and sorted(p.name for p in tmp_path.iterdir()) == ["plot.png"]


@pytest.mark.parametrize(("content", "says"), [(b"", "empty file"), (b'{"ece": 0.1, "acc', "line 1 column"),
                                               (b"\xff\xfe{}", "not UTF-8")])
def test_a_truncated_json_file_is_reported_by_name(tmp_path: Path, content: bytes, says: str) -> None:
    path = tmp_path / "calm" / "metrics.json"
    path.parent.mkdir()
    path.write_bytes(content)
    with pytest.raises(ValueError, match=rf"{path}: .*{says}"):
        read_json(path)
    assert read_json(write_json_atomic(path, {"a": [1]})) == {"a": [1]}
