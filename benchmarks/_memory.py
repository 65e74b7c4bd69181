"""Process memory readings shared by the benchmark scripts (Linux ``/proc``; no-ops elsewhere)."""

from __future__ import annotations

import gc
import re
import time
from pathlib import Path

__all__ = ["Phase", "malloc_trim", "proc_status"]


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


class Phase:
    """Wall time and peak RSS of one block: ``with Phase() as p: ...``.

    The kernel's high-water mark (``VmHWM``) is reset at the start (``/proc/self/clear_refs``),
    after a garbage collection and a heap trim, so the peak belongs to this block alone. Without
    ``/proc`` it falls back to the process's lifetime peak (``ru_maxrss``), which is less precise.

    Attributes (after the block): ``seconds``, ``start`` (RSS at the start, bytes), ``peak``
    (peak RSS, bytes), ``over`` (peak above the start, bytes), ``how`` (which reading).
    """

    def __enter__(self) -> Phase:
        gc.collect()
        malloc_trim()
        self.how = "VmHWM after reset"
        try:
            self.start = proc_status()["VmRSS"]
            Path("/proc/self/clear_refs").write_text("5")
        except (OSError, AttributeError):
            self.how = "ru_maxrss (lifetime peak; no /proc reset available)"
            self.start = _lifetime_peak()
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds = time.perf_counter() - self.t0
        try:
            self.peak = proc_status()["VmHWM"] if self.how.startswith("VmHWM") else _lifetime_peak()
        except OSError:
            self.peak = _lifetime_peak()
        self.over = max(0, self.peak - self.start)


def _lifetime_peak() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
