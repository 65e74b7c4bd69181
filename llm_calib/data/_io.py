"""Reading text files line by line (split on ``\\n`` only) with strict UTF-8 decoding."""

from __future__ import annotations

import codecs
from collections.abc import Iterator
from pathlib import Path

from llm_calib.data.errors import DataError

__all__ = ["CP1252_FALLBACK", "decode_line", "iter_lines", "repair_utf8"]

CP1252_FALLBACK = "llm_calib.cp1252_fallback"
"""Name of the codec error handler used by :func:`repair_utf8`."""

_UTF8_BOM = b"\xef\xbb\xbf"


def iter_lines(path: str | Path) -> Iterator[tuple[int, bytes]]:
    r"""Yield ``(line_number, raw_bytes)`` per line of ``path`` (1-based; BOM and CR removed).

    Example:
        >>> import pathlib, tempfile
        >>> p = pathlib.Path(tempfile.mkdtemp(), "f.txt")
        >>> _ = p.write_bytes(b"\xef\xbb\xbfa\r\nb\x85c\n")
        >>> list(iter_lines(p))
        [(1, b'a'), (2, b'b\x85c')]
    """
    data = Path(path).read_bytes()
    if data.startswith(_UTF8_BOM):
        data = data[len(_UTF8_BOM) :]
    lines = data.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    for number, raw in enumerate(lines, start=1):
        yield number, raw[:-1] if raw.endswith(b"\r") else raw


def decode_line(raw: bytes, source: str | Path, line: int, *, repair: bool = False) -> str:
    r"""Decode one line as UTF-8 (``repair``: with :func:`repair_utf8`), else a DataError.

    Example:
        >>> decode_line(b"Caf\xe9", "f.txt", 3)
        Traceback (most recent call last):
        ...
        llm_calib.data.errors.DataError: f.txt:3: encoding: invalid UTF-8 (byte b'\xe9' at column 4)
    """
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        if repair:
            return repair_utf8(raw)
        bad = raw[exc.start : exc.end]
        raise DataError(
            str(source), line, "encoding", f"invalid UTF-8 (byte {bad!r} at column {exc.start + 1})"
        ) from None


def _sequence_length(lead: int) -> int:
    if 0xC2 <= lead <= 0xDF:
        return 2
    if 0xE0 <= lead <= 0xEF:
        return 3
    if 0xF0 <= lead <= 0xF4:
        return 4
    return 1


def _cp1252_fallback(exc: UnicodeError) -> tuple[str, int]:
    if not isinstance(exc, UnicodeDecodeError):
        raise exc
    data, start, end = exc.object, exc.start, exc.end
    bad = bytes(data[start:end])
    expected = _sequence_length(bad[0])
    if expected > 1 and len(bad) == expected - 1 and data[end : end + 1] == b"?":
        # A multi-byte character whose last byte was turned into "?" by a round trip through
        # cp1252 (the byte is one of those cp1252 leaves undefined). E2 80 ? is a right double
        # quotation mark (E2 80 9D) in every case seen in practice; others cannot be guessed.
        return ("\u201d" if bad == b"\xe2\x80" else "\ufffd"), end + 1
    return bad.decode("cp1252", errors="replace"), end


codecs.register_error(CP1252_FALLBACK, _cp1252_fallback)


def repair_utf8(raw: bytes) -> str:
    """Decode mostly-UTF-8 bytes in which some characters were saved as Windows-1252 (a byte
    sequence whose last byte became ``?`` gives U+FFFD, ``E2 80 ?`` gives ``”``).

    Example:
        >>> repair_utf8(b"Caf\\xe9 \\x93Treble\\x94 \\xe2\\x80?")
        'Café “Treble” ”'
    """
    return raw.decode("utf-8", errors=CP1252_FALLBACK)
