"""Benchmark reports: where a run happened (command, machine, load, versions) and the markdown
cells and tables the benchmark scripts print.

Benchmark-only tooling (not installed with ``llm_calib``): the benchmark scripts beside this
package import it as ``harness.report``.
"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path
from typing import Any

__all__ = ["format_number", "load_average", "load_averages", "machine_info", "machine_line", "markdown_table", "mean_sd", "provenance_lines", "verdict"]


def machine_info(threads: int | None = None, libraries: tuple[str, ...] = ("torch", "transformers")) -> dict[str, Any]:
    """Where a benchmark ran, the one place every script reads it from: date, CPU model and its widest
    vector extension, cores, torch threads, the load average (a shared machine shows in it), Python and
    the version of each of ``libraries`` (read from the installed distributions, so a library that is
    not installed is reported, not imported).

    Example:
        >>> sorted(machine_info(1))[:5]
        ['cores', 'cpu', 'date', 'load', 'python']
        >>> machine_info(1, libraries=("no_such_library",))["no_such_library"]
        'not installed'
    """
    import datetime
    import platform
    from importlib.metadata import PackageNotFoundError, version

    cpu, simd = platform.processor() or platform.machine() or "unknown", "?"
    try:
        info = Path("/proc/cpuinfo").read_text()
        match = re.search(r"model name\s*:\s*(.+)", info)
        cpu = match.group(1).strip() if match else cpu
        simd = "AVX-512" if "avx512f" in info else "AVX2" if "avx2" in info else "no AVX2"
    except OSError:
        pass
    if threads is None:
        import torch

        threads = torch.get_num_threads()

    def installed(name: str) -> str:
        try:
            return version(name)
        except PackageNotFoundError:
            return "not installed"

    return {"date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"), "cpu": cpu, "simd": simd,
            "cores": os.cpu_count(), "threads": threads,
            "load": load_averages(),
            "python": platform.python_version(), **{name: installed(name) for name in libraries}}


def load_averages() -> list[float] | None:
    """The 1, 5 and 15 minute load averages now (None where the system has none): the load a shared
    machine shows at the start of a run, beside each timed round, in :func:`machine_info`.

    Example:
        >>> loads = load_averages()
        >>> loads is None or (len(loads) == 3 and min(loads) >= 0)
        True
    """
    return list(os.getloadavg()) if hasattr(os, "getloadavg") else None


def load_average() -> str:
    """The 1, 5 and 15 minute load averages now, as text (``"?"`` where the system has none).

    Example:
        >>> len(load_average().split()) in (1, 3)
        True
    """
    loads = load_averages()
    return " ".join(f"{x:.2f}" for x in loads) if loads is not None else "?"


def machine_line(meta: dict[str, Any], note: str = "") -> str:
    """The ``- Machine:`` line of a report from :func:`machine_info`; ``note`` is appended.

    Example:
        >>> machine_line({"cpu": "X", "simd": "AVX2", "cores": 2, "threads": 1, "load": [1.0, 2.0, 3.0]}, "shared")
        '- Machine: X (AVX2), 2 cores, 1 torch thread(s); load average 1.0, 2.0, 3.0; shared'
    """
    load = ", ".join(f"{x:.1f}" for x in meta["load"]) if meta.get("load") else "?"
    return (f"- Machine: {meta['cpu']} ({meta.get('simd', '?')}), {meta['cores']} cores, {meta['threads']} torch "
            f"thread(s); load average {load}" + (f"; {note}" if note else ""))


def provenance_lines(
    command: str,
    meta: dict[str, Any],
    *,
    mode: str | None = None,
    elapsed_s: float | None = None,
    load_start: list[float] | None = None,
) -> list[str]:
    """The first lines of a benchmark report: the command, mode, wall time and date; the machine
    (CPU, cores, torch threads, load averages, flagged busy when a load average exceeds the cores);
    the versions.

    Args:
        command: the command line that produced the report.
        meta: :func:`machine_info` (taken at the end of the run).
        mode: the benchmark's mode, if any.
        elapsed_s: wall time of the run.
        load_start: the load averages at the start of the run.

    Example:
        >>> meta = {"date": "2026-01-01 00:00", "cpu": "X", "cores": 2, "threads": 1, "torch": "2", "transformers": "4",
        ...         "python": "3.12", "load": [3.5, 1.0, 1.0]}
        >>> for line in provenance_lines("python b.py --quick", meta, mode="quick", elapsed_s=90):
        ...     print(line)
        - Command: `python b.py --quick` (quick mode, wall time 1.5 min); date 2026-01-01 00:00
        - Machine: X, 2 cores, 1 torch threads; load average at the end 3.5, 1.0, 1.0 (**busy machine**: wall times inflated, trust the CPU-time ratios more)
        - Versions: torch 2, transformers 4, Python 3.12
    """
    run = ", ".join(x for x in (f"{mode} mode" if mode else "",
                                f"wall time {elapsed_s / 60:.1f} min" if elapsed_s is not None else "") if x)

    def loads(xs: list[float] | None) -> str:
        return ", ".join(f"{x:.1f}" for x in xs) if xs else "?"

    busy = max([*(load_start or [])[:1], *(meta.get("load") or [])[:1], 0.0]) > (meta.get("cores") or 1)
    return [
        f"- Command: `{command}`" + (f" ({run})" if run else "") + f"; date {meta['date']}",
        f"- Machine: {meta['cpu']}, {meta['cores']} cores, {meta['threads']} torch threads; load average "
        + (f"at the start {loads(load_start)}, " if load_start is not None else "") + f"at the end {loads(meta.get('load'))}"
        + (" (**busy machine**: wall times inflated, trust the CPU-time ratios more)" if busy else ""),
        f"- Versions: torch {meta['torch']}, transformers {meta['transformers']}, Python {meta['python']}",
    ]


def format_number(x: Any, spec: str = ".3f", missing: str = "n/a") -> str:
    """``format(x, spec)``, or ``missing`` for None, NaN and infinities.

    Example:
        >>> format_number(0.12345), format_number(None), format_number(float("nan"), ".2g", "-")
        ('0.123', 'n/a', '-')
    """
    if x is None or (isinstance(x, float | int) and not math.isfinite(x)):
        return missing
    return format(x, spec)


def verdict(ok: bool | None, measured: bool = True) -> str:
    """A target's status cell: ``PASS``, ``**MISS**``, or for no verdict ``info`` (measured) / ``n/a``.

    Example:
        >>> verdict(True), verdict(False), verdict(None), verdict(None, measured=False)
        ('PASS', '**MISS**', 'info', 'n/a')
    """
    return {True: "PASS", False: "**MISS**"}.get(ok, "info" if measured else "n/a")  # type: ignore[arg-type]


def mean_sd(values: Any, digits: int = 3) -> str:
    """``mean ± sd`` (sample standard deviation) of the finite values; the value alone for one,
    ``n/a`` for none (None and NaN are dropped).

    Example:
        >>> mean_sd([0.1, 0.2, None]), mean_sd([0.5]), mean_sd([float("nan")])
        ('0.150 ± 0.071', '0.500', 'n/a')
    """
    import numpy as np

    v = np.asarray([x for x in values if x is not None and math.isfinite(x)], dtype=np.float64)
    if v.size == 0:
        return "n/a"
    if v.size == 1:
        return f"{v[0]:.{digits}f}"
    return f"{v.mean():.{digits}f} ± {v.std(ddof=1):.{digits}f}"


def markdown_table(header: Any, rows: Any) -> list[str]:
    """The lines of a markdown table: the header, the rule, one line per row (cells as ``str``).

    Example:
        >>> for line in markdown_table(("k", "ECE"), [(2, "0.10"), (6, "0.08")]):
        ...     print(line)
        | k | ECE |
        |---|---|
        | 2 | 0.10 |
        | 6 | 0.08 |
    """
    header = list(header)
    return ["| " + " | ".join(map(str, header)) + " |", "|" + "---|" * len(header)] + [
        "| " + " | ".join(map(str, r)) + " |" for r in rows
    ]
