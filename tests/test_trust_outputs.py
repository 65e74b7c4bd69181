"""Output folders are checked before any work, and one run at a time writes to one (issue #43, 3
and the lock of 9): ``calibrate --out EXISTING_FILE`` used to train every method and then die.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from llm_calib.files.outputs import (
    LOCK_FILE,
    RunLockedError,
    check_output_file,
    check_output_folder,
    lora_run_bytes,
    run_lock,
)


def test_an_existing_file_is_refused_at_once(tmp_path: Path) -> None:
    existing = tmp_path / "results.txt"
    existing.write_text("keep")
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match=rf"--out {existing}: exists and is a file, not a folder"):
        check_output_folder(existing)
    with pytest.raises(ValueError, match=rf"--out {existing}/run: .*\({existing} is a file\)"):
        check_output_folder(existing / "run")
    assert time.perf_counter() - t0 < 1 and existing.read_text() == "keep"


def test_a_folder_that_can_be_made_is_fine_and_nothing_is_created(tmp_path: Path) -> None:
    assert check_output_folder(tmp_path / "a" / "b", need_bytes=1) == tmp_path / "a" / "b"
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes to read-only folders")
def test_a_read_only_folder_is_refused(tmp_path: Path) -> None:
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o555)
    with pytest.raises(PermissionError, match=rf"--out {ro}: the folder is not writable"):
        check_output_folder(ro)
    with pytest.raises(PermissionError, match=rf"--out {ro}/new: {ro}, where it would be created, is not writable"):
        check_output_folder(ro / "new")


def test_not_writable_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "access", lambda path, mode: False)  # as for a user without write permission
    with pytest.raises(PermissionError, match=rf"--eval-out {tmp_path}: the folder is not writable"):
        check_output_folder(tmp_path, flag="--eval-out")


def test_too_little_free_space_is_refused(tmp_path: Path) -> None:
    with pytest.raises(OSError, match=rf"--out {tmp_path}/run: .* MiB free on its disk, the run writes about"):
        check_output_folder(tmp_path / "run", need_bytes=2**62)
    with pytest.raises(ValueError, match="need_bytes must be >= 0"):
        check_output_folder(tmp_path, need_bytes=-1)


def test_output_file(tmp_path: Path) -> None:
    with pytest.raises(IsADirectoryError, match=rf"--out {tmp_path}: is a folder; give a file name"):
        check_output_file(tmp_path)
    (tmp_path / "f").write_text("x")
    with pytest.raises(ValueError, match=r"its folder"):
        check_output_file(tmp_path / "f" / "metrics.json")
    assert check_output_file(tmp_path / "new" / "m.json").name == "m.json"


def test_lora_run_bytes_grows_with_the_run() -> None:
    one = lora_run_bytes(576, 30, rank=8)
    assert lora_run_bytes(576, 30, rank=8, methods=3) == 3 * one
    assert lora_run_bytes(576, 30, rank=16) > one > lora_run_bytes(576, 30, rank=8, checkpoints_kept=0)
    with pytest.raises(ValueError, match="rank must be >= 1, got 0"):
        lora_run_bytes(576, 30, rank=0)


def test_a_second_run_into_the_same_folder_is_refused_naming_the_holder(tmp_path: Path) -> None:
    with run_lock(tmp_path) as lock:
        assert json.loads(lock.read_text())["pid"] == os.getpid()
        held = rf"--out {tmp_path}: another llm-calib run \(pid {os.getpid()} "
        with pytest.raises(RunLockedError, match=held), run_lock(tmp_path):
            pass
        assert lock.exists()  # the refused run did not take the holder's lock away
    assert not lock.exists()


def test_a_live_process_in_another_interpreter_holds_the_lock(tmp_path: Path) -> None:
    code = ("import sys, time; from llm_calib.files.outputs import run_lock\n"
            "with run_lock(sys.argv[1]):\n    print('locked', flush=True); time.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "locked"
        with pytest.raises(RunLockedError, match=rf"pid {proc.pid} "), run_lock(tmp_path):
            pass
    finally:
        proc.kill()
        proc.wait()
    with run_lock(tmp_path) as lock:  # SIGKILL left the lock of a dead pid: replaced
        assert json.loads(lock.read_text())["pid"] == os.getpid()


def test_a_truncated_lock_is_replaced_only_when_old(tmp_path: Path) -> None:
    lock = tmp_path / LOCK_FILE
    lock.write_text('{"pid": 12')
    with pytest.raises(RunLockedError, match=r"pid \?"), run_lock(tmp_path):
        pass
    os.utime(lock, (time.time() - 3600, time.time() - 3600))
    with run_lock(tmp_path):
        assert json.loads(lock.read_text())["pid"] == os.getpid()
