"""Resumable sweeps: one JSON result file per job, fingerprinted settings, forked workers.

A sweep (methods x seeds, a hyperparameter grid) writes each job's result atomically
(:func:`write_json_atomic`) with a :func:`fingerprint` of everything that
determines it. A re-run reads a finished result back with :func:`read_result` when its fingerprint
still matches and runs only the missing or stale jobs, serially or in forked workers
(:func:`run_forked`), which share the parent's memory (a loaded model, cached encodings)
copy-on-write. :class:`SeedResults` then aggregates the finished records over seeds.

Benchmark-only tooling (not installed with ``llm_calib``): the benchmark scripts beside this
package import it as ``harness.sweep``.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import math
import os
import sys
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from llm_calib.evaluation.report import jsonable
from llm_calib.files.atomic import write_text_atomic
from llm_calib.metrics.calibration import ece

__all__ = ["SeedResults", "SweepLog", "ece_resamples", "fingerprint", "read_result", "run_forked", "write_json_atomic"]

J = TypeVar("J", bound=Hashable)


class SweepLog:
    """Progress lines of a sweep: ``[HH:MM:SS] message``, printed and appended to a log file that
    forked workers share (a worker's lines end with ``(worker k)``: set :attr:`worker` in the child).

    Example:
        >>> import pathlib, tempfile
        >>> log = SweepLog(pathlib.Path(tempfile.mkdtemp()) / "sweep.log")
        >>> log.worker = 1
        >>> log("run 3 done")  # doctest: +ELLIPSIS
        [...] run 3 done (worker 1)
        >>> log.path.read_text().splitlines()[-1].endswith("run 3 done (worker 1)")
        True
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.worker: int | None = None

    def __call__(self, message: str) -> None:
        """Print one line and append it to the file (a file that cannot be written is skipped)."""
        tag = f" (worker {self.worker})" if self.worker is not None else ""
        line = f"[{datetime.datetime.now().strftime('%H:%M:%S')}] {message}{tag}"
        sys.stdout.write(line + "\n")
        sys.stdout.flush()
        with contextlib.suppress(OSError):
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self.path.open("a") as fh:
                fh.write(line + "\n")


def fingerprint(obj: Any) -> str:
    """A short stable hash (16 hex digits) of a JSON-serialisable object, key order aside
    (other objects enter as their ``str``).

    Example:
        >>> fingerprint({"a": 1, "b": [2, 3]}) == fingerprint({"b": [2, 3], "a": 1})
        True
        >>> len(fingerprint("x"))
        16
    """
    return hashlib.sha1(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def write_json_atomic(path: str | os.PathLike[str], obj: Any) -> Path:
    """Write ``obj`` as strict JSON (NaN and infinities as null) to ``path`` atomically.

    Example:
        >>> import json, pathlib, tempfile
        >>> path = write_json_atomic(pathlib.Path(tempfile.mkdtemp()) / "r.json", {"ece": float("nan")})
        >>> json.loads(path.read_text())
        {'ece': None}
    """
    return write_text_atomic(path, json.dumps(jsonable(obj), allow_nan=False))


def read_result(path: str | os.PathLike[str], fingerprint: str | None = None) -> dict[str, Any] | None:
    """A finished result file, or None when it is missing, unreadable, or (with ``fingerprint``)
    was written for other settings (its ``"fingerprint"`` entry differs).

    Example:
        >>> import pathlib, tempfile
        >>> p = pathlib.Path(tempfile.mkdtemp()) / "r.json"
        >>> _ = p.write_text('{"fingerprint": "abc", "ece": 0.1}')
        >>> read_result(p, "abc")["ece"], read_result(p, "other"), read_result(p.with_name("none.json"))
        (0.1, None, None)
    """
    path = Path(path)
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    if not isinstance(data, dict) or (fingerprint is not None and data.get("fingerprint") != fingerprint):
        return None
    return data


def run_forked(
    jobs: Sequence[J],
    run: Callable[[J, int | None], None],
    workers: int,
    *,
    finished: Callable[[J], bool],
    lock: Callable[[J], Path],
    progress: Callable[[int], None] | None = None,
    poll_s: float = 1.0,
) -> tuple[int, list[J]]:
    """Run every job once, in ``workers`` forked processes (serially for one worker or without
    ``os.fork``).

    A child claims a job by creating its lock file (``O_CREAT | O_EXCL``), so each job runs once and
    the given order (say, longest first) keeps the workers busy; ``run`` must write the job's
    result itself (``finished`` then sees it). Locks are removed before and after.

    Args:
        jobs: the jobs, in the order to start them.
        run: ``run(job, worker)``: computes and writes one job; ``worker`` is the child's index
            (None when run serially in this process).
        workers: processes (at least 1).
        finished: whether a job's result exists.
        lock: the lock file of a job (its folder must exist).
        progress: called with the number of finished jobs while waiting.
        poll_s: seconds between checks of the children.

    Returns:
        ``(failed, missing)``: how many workers exited with an error, and the jobs without a result.

    Raises:
        ValueError: ``workers`` < 1.

    Example:
        >>> import pathlib, tempfile
        >>> d = pathlib.Path(tempfile.mkdtemp())
        >>> def work(job, worker):
        ...     (d / f"{job}.json").write_text("{}")
        >>> run_forked(["a", "b", "c"], work, 2, finished=lambda j: (d / f"{j}.json").is_file(),
        ...            lock=lambda j: d / f"{j}.lock", poll_s=0.05)
        (0, [])
    """
    if workers < 1:
        raise ValueError(f"workers must be at least 1, got {workers}")
    for job in jobs:
        lock(job).unlink(missing_ok=True)
    failed = 0
    if workers == 1 or not hasattr(os, "fork"):
        for job in jobs:
            run(job, None)
    else:
        failed = _fork(jobs, run, workers, finished, lock, progress, poll_s)
    for job in jobs:
        lock(job).unlink(missing_ok=True)
    return failed, [j for j in jobs if not finished(j)]


def _fork(jobs: Sequence[J], run: Callable[[J, int | None], None], workers: int, finished: Callable[[J], bool],
          lock: Callable[[J], Path], progress: Callable[[int], None] | None, poll_s: float) -> int:
    sys.stdout.flush()
    sys.stderr.flush()
    pids = []
    for w in range(workers):
        pid = os.fork()
        if pid == 0:  # child: claim jobs until none is left
            code = 0
            try:
                for job in jobs:
                    try:
                        os.close(os.open(lock(job), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
                    except FileExistsError:
                        continue
                    run(job, w)
            except BaseException:
                import traceback

                traceback.print_exc()
                code = 1
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        pids.append(pid)
    alive, failed = set(pids), 0
    while alive:
        for pid in list(alive):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                alive.discard(pid)
                failed += status != 0
        if progress is not None:
            progress(sum(finished(j) for j in jobs))
        if alive:
            time.sleep(poll_s)
    return failed


def ece_resamples(confidences: Any, correct: Any, indices: Any, n_bins: int = 10) -> np.ndarray:
    """:func:`llm_calib.metrics.calibration.ece` of each resample, a row of ``indices`` ``(R, n)``, at once (``(R,)``).

    Example:
        >>> conf, correct = [0.9, 1.0, 0.6, 0.0], [1, 0, 1, 0]
        >>> [round(float(e), 6) for e in ece_resamples(conf, correct, [[0, 1, 2, 3], [0, 0, 0, 0]])]
        [0.325, 0.1]
    """
    ece(confidences, correct, n_bins)  # the one-set metric's checks of the inputs and n_bins
    c0 = np.clip(np.asarray(confidences, dtype=np.float64), 0.0, 1.0)
    k0 = np.asarray(correct, dtype=np.float64)
    idx = np.asarray(indices, dtype=np.int64)
    if idx.ndim != 2 or idx.size == 0:
        raise ValueError(f"indices must be a non-empty (resamples, n) array, got shape {idx.shape}")
    R, n = idx.shape
    n_bins = int(n_bins)
    c, k = c0[idx], k0[idx]
    b = np.searchsorted(np.arange(1, n_bins, dtype=np.float64) / n_bins, c, side="right") + np.arange(R)[:, None] * n_bins
    gap = np.bincount(b.ravel(), weights=(k - c).ravel(), minlength=R * n_bins).reshape(R, n_bins)
    return np.abs(gap).sum(1) / n


def _num(x: Any) -> float:
    return math.nan if x is None else float(x)


class SeedResults:
    """Result records of several methods over seeds, on the same named sets: seed means of the
    metrics, means over groups of sets, pooled predictions, and a bootstrap interval of the
    seed-mean ECE.

    A record is a mapping with ``"sets"`` (set name -> metric name -> value) and ``"questions"``
    (set name -> per-question data that ``conf_correct`` turns into confidences and correctness).

    Args:
        runs: method -> its records, one per seed (methods without records are left out).
        conf_correct: per-question data of one set -> ``(confidences, correct)`` arrays.
        set_sizes: set name -> questions, in a fixed order (it fixes the bootstrap resamples).
        n_resamples: bootstrap resamples (at least 1).
        seed: the seed of the resamples, shared by every method and seed.

    Example:
        >>> rec = lambda e, c: {"sets": {"a": {"ece": e}}, "questions": {"a": {"conf": c, "correct": [1, 0]}}}
        >>> res = SeedResults({"m": [rec(0.1, [0.9, 0.6]), rec(0.3, [0.8, 0.7])]},
        ...                   lambda q: (np.asarray(q["conf"]), np.asarray(q["correct"], dtype=float)), {"a": 2}, 20)
        >>> round(res.mean("m", "a", "ece"), 6), res.values("m", "a", "ece"), len(res.pooled("m", ["a"])[0])
        (0.2, [0.1, 0.3], 4)
        >>> res.cell("m", ["a"], "ece")
        '0.200 ± 0.141'
    """

    def __init__(self, runs: Mapping[str, Sequence[Mapping[str, Any]]],
                 conf_correct: Callable[[Any], tuple[np.ndarray, np.ndarray]], set_sizes: Mapping[str, int],
                 n_resamples: int, seed: int = 12345) -> None:
        if n_resamples < 1:
            raise ValueError(f"n_resamples must be at least 1, got {n_resamples}")
        self.runs = {m: list(r) for m, r in runs.items() if r}
        self.conf_correct = conf_correct
        rng = np.random.default_rng(seed)
        self.idx = {name: rng.integers(0, n, size=(n_resamples, n)) for name, n in set_sizes.items() if n}

    def values(self, method: str, name: str, metric: str) -> list[float]:
        """Per seed, ``metric`` on set ``name`` (NaN where missing)."""
        return [_num(r["sets"][name].get(metric)) for r in self.runs.get(method, [])]

    def mean(self, method: str, name: str, metric: str) -> float:
        """The seed mean of :meth:`values` (NaNs ignored; NaN without values)."""
        v = self.values(method, name, metric)
        return float(np.nanmean(v)) if v and not all(np.isnan(v)) else math.nan

    def group_values(self, method: str, names: Sequence[str], metric: str) -> list[float]:
        """Per seed, the mean of ``metric`` over the sets ``names``."""
        return [float(np.mean([_num(r["sets"][n].get(metric)) for n in names])) for r in self.runs.get(method, [])]

    def group_mean(self, method: str, names: Sequence[str], metric: str) -> float:
        """The seed mean of :meth:`group_values` (NaN without records)."""
        v = self.group_values(method, names, metric)
        return float(np.mean(v)) if v else math.nan

    def ece_interval(self, method: str, names: Sequence[str], n_bins: int = 10) -> tuple[float, float]:
        """Bootstrap 95% interval of the seed-mean ECE averaged over the sets ``names`` (questions
        resampled within each set, the same resamples for every seed and method)."""
        runs = self.runs.get(method, [])
        if not runs or not names:
            return math.nan, math.nan
        total = np.zeros(next(iter(self.idx.values())).shape[0])
        for name in names:
            total += np.mean([ece_resamples(*self.conf_correct(r["questions"][name]), self.idx[name], n_bins)
                              for r in runs], axis=0)
        lo, hi = np.percentile(total / len(names), [2.5, 97.5])
        return float(lo), float(hi)

    def cell(self, method: str, names: Sequence[str], metric: str, interval_digits: int | None = None) -> str:
        """A table cell: ``mean ± sd`` over seeds of ``metric`` averaged over the sets ``names``
        (:func:`harness.report.mean_sd`); with ``interval_digits``, then the bootstrap 95% interval
        of the seed-mean ECE (:meth:`ece_interval`) with that many decimals."""
        from harness.report import mean_sd

        text = mean_sd(self.group_values(method, names, metric))
        if interval_digits is not None:
            lo, hi = self.ece_interval(method, names)
            text += f" [{lo:.{interval_digits}f}, {hi:.{interval_digits}f}]"
        return text

    def pooled(self, method: str, names: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        """Confidences and correctness of every question of the sets ``names`` over every seed."""
        pairs = [self.conf_correct(r["questions"][n]) for r in self.runs.get(method, []) for n in names]
        return np.concatenate([c for c, _ in pairs]), np.concatenate([k for _, k in pairs])
