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

__all__ = ["format_number", "machine_info", "markdown_table", "mean_sd", "provenance_lines", "verdict"]


def machine_info(threads: int | None = None) -> dict[str, Any]:
    """What a benchmark report states about where it ran: date, CPU model, cores, torch threads,
    torch / transformers / Python versions and the load average (a shared machine shows in it).

    Example:
        >>> sorted(machine_info(1))[:4]
        ['cores', 'cpu', 'date', 'load']
    """
    import datetime
    import platform

    import torch
    import transformers

    cpu = "unknown"
    try:
        match = re.search(r"model name\s*:\s*(.+)", Path("/proc/cpuinfo").read_text())
        cpu = match.group(1).strip() if match else cpu
    except OSError:
        pass
    return {"date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"), "cpu": cpu, "cores": os.cpu_count(),
            "threads": torch.get_num_threads() if threads is None else threads, "torch": torch.__version__,
            "transformers": transformers.__version__, "python": platform.python_version(),
            "load": list(os.getloadavg()) if hasattr(os, "getloadavg") else None}


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
