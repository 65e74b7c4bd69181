"""Process memory readings shared by the benchmark scripts (Linux ``/proc``; no-ops elsewhere)."""

from __future__ import annotations

import re
from pathlib import Path

__all__ = ["malloc_trim", "proc_status"]


def proc_status() -> dict[str, int]:
    """Resident set size now (``VmRSS``) and its high-water mark (``VmHWM``), in bytes."""
    text = Path("/proc/self/status").read_text()
    return {k: int(re.search(rf"{k}:\s+(\d+)", text).group(1)) * 1024 for k in ("VmRSS", "VmHWM")}


def malloc_trim() -> None:
    """Return the C heap's free pages to the OS, so that a baseline RSS counts live memory only."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
