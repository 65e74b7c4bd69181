"""harness.sweep (benchmarks/harness): fingerprints, fingerprinted result files, forked workers
running each job once, the seed aggregation and its bootstrap interval, the shared sweep log."""

from __future__ import annotations

import doctest
import math
import os

import numpy as np
import pytest
from _benchmarks import BENCHMARKS  # noqa: F401  (puts benchmarks/ on sys.path for harness)
from harness import sweep
from harness.sweep import (
    SeedResults,
    SweepLog,
    fingerprint,
    read_result,
    run_forked,
    write_json_atomic,
)

from llm_calib.metrics.calibration import ece


def test_fingerprint_ignores_key_order_and_sees_values() -> None:
    assert fingerprint({"a": 1, "b": [1, 2]}) == fingerprint({"b": [1, 2], "a": 1})
    assert fingerprint({"a": 1}) != fingerprint({"a": 2}) != fingerprint({"a": "1"})
    assert len(fingerprint(object)) == 16  # non-JSON objects enter as their str


def test_read_result_rejects_missing_broken_and_stale_files(tmp_path) -> None:
    good = write_json_atomic(tmp_path / "r.json", {"fingerprint": "f1", "v": 1})
    assert read_result(good) == {"fingerprint": "f1", "v": 1} and read_result(good, "f1")["v"] == 1
    assert read_result(good, "f2") is None and read_result(tmp_path / "missing.json") is None
    (tmp_path / "bad.json").write_text('{"fingerprint": ')
    (tmp_path / "list.json").write_text("[1, 2]")
    assert read_result(tmp_path / "bad.json") is None and read_result(tmp_path / "list.json") is None


def _jobs(tmp_path):
    done = lambda j: (tmp_path / f"{j}.json").is_file()  # noqa: E731
    lock = lambda j: tmp_path / f"{j}.lock"  # noqa: E731
    return done, lock


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no os.fork")
def test_run_forked_runs_every_job_once_and_reports_failures(tmp_path) -> None:
    done, lock = _jobs(tmp_path)
    lock("j0").write_text("")  # a stale lock from an interrupted sweep does not block its job

    def run(job, worker):
        assert worker in (0, 1)
        with (tmp_path / "ran.txt").open("a") as fh:
            fh.write(f"{job} {os.getpid()}\n")
        if job == "bad":
            raise RuntimeError("boom")
        (tmp_path / f"{job}.json").write_text("{}")

    jobs = ["bad", *(f"j{i}" for i in range(6))]
    seen: list[int] = []
    failed, missing = run_forked(jobs, run, 2, finished=done, lock=lock, progress=seen.append, poll_s=0.01)
    ran = [line.split() for line in (tmp_path / "ran.txt").read_text().splitlines()]
    assert sorted(j for j, _ in ran) == sorted(jobs)  # each job exactly once
    assert {pid for _, pid in ran} != {str(os.getpid())}  # in the children, not here
    assert failed == 1 and missing == ["bad"] and seen[-1] == 6
    assert not list(tmp_path.glob("*.lock"))


def test_run_forked_serially_for_one_worker(tmp_path) -> None:
    done, lock = _jobs(tmp_path)
    workers = []
    failed, missing = run_forked(["a", "b"], lambda j, w: workers.append(w) or (tmp_path / f"{j}.json").write_text("{}"),
                                 1, finished=done, lock=lock)
    assert (failed, missing, workers) == (0, [], [None, None])
    with pytest.raises(ValueError, match="workers must be at least 1, got 0"):
        run_forked(["a"], lambda j, w: None, 0, finished=done, lock=lock)


def _record(ece_value, acc, conf, correct):
    return {"sets": {"s": {"ece": ece_value, "accuracy": acc}, "t": {"ece": 2 * ece_value, "accuracy": None}},
            "questions": {"s": {"conf": conf, "correct": correct}, "t": {"conf": conf, "correct": correct}}}


def _conf_correct(q):
    return np.asarray(q["conf"], dtype=float), np.asarray(q["correct"], dtype=float)


def test_seed_results_means_pooling_and_interval() -> None:
    rng = np.random.default_rng(0)
    runs = []
    for k in range(3):
        conf = rng.uniform(0.3, 1.0, 40)
        runs.append(_record(0.1 * (k + 1), 0.5 + 0.1 * k, conf.tolist(), (rng.uniform(size=40) < conf).astype(int).tolist()))
    res = SeedResults({"m": runs, "empty": []}, _conf_correct, {"s": 40, "t": 40}, n_resamples=200, seed=7)
    assert list(res.runs) == ["m"]
    assert res.values("m", "s", "ece") == pytest.approx([0.1, 0.2, 0.3]) and res.mean("m", "s", "ece") == pytest.approx(0.2)
    assert math.isnan(res.mean("m", "t", "accuracy")) and math.isnan(res.mean("other", "s", "ece"))
    assert res.group_values("m", ["s", "t"], "ece") == pytest.approx([0.15, 0.3, 0.45])
    assert res.group_mean("m", ["s", "t"], "ece") == pytest.approx(0.3)
    assert res.cell("m", ["s"], "ece") == "0.200 ± 0.100"
    c, k = res.pooled("m", ["s", "t"])
    assert c.shape == k.shape == (240,) and c[:40].tolist() == runs[0]["questions"]["s"]["conf"]
    # the interval by hand: per resample, the seed-mean ECE over the same resampled questions
    idx = np.random.default_rng(7).integers(0, 40, size=(200, 40))
    by_hand = [np.mean([ece(*(a[row] for a in _conf_correct(r["questions"]["s"])), 10) for r in runs]) for row in idx]
    lo, hi = res.ece_interval("m", ["s"])
    assert (lo, hi) == pytest.approx(tuple(np.percentile(by_hand, [2.5, 97.5])), abs=1e-12)
    assert lo < hi and res.cell("m", ["s"], "ece", 2).endswith(f"[{lo:.2f}, {hi:.2f}]")
    assert all(math.isnan(x) for x in res.ece_interval("other", ["s"]))
    with pytest.raises(ValueError, match="n_resamples must be at least 1"):
        SeedResults({}, _conf_correct, {}, 0)


def test_sweep_log_tags_workers_and_survives_an_unwritable_file(tmp_path, capsys) -> None:
    log = SweepLog(tmp_path / "sub" / "sweep.log")
    log("first")
    log.worker = 2
    log("second")
    lines = (tmp_path / "sub" / "sweep.log").read_text().splitlines()
    assert [line.split("] ", 1)[1] for line in lines] == ["first", "second (worker 2)"]
    assert capsys.readouterr().out.splitlines() == lines
    (tmp_path / "file").write_text("")
    SweepLog(tmp_path / "file" / "x.log")("still printed")  # its folder is a file: not written, no error
    assert "still printed" in capsys.readouterr().out


def test_the_docstring_examples_run() -> None:
    """benchmarks/ is outside the doctest paths: its examples run here."""
    results = doctest.testmod(sweep, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert results.attempted >= 3 and results.failed == 0
