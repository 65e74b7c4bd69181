"""Faults injected into whole ``llm-calib`` runs on the tiny model, each ending in the result an
undisturbed run gives or in a clear refusal: the newest checkpoint corrupted in place (same size,
other bytes), SIGTERM during training and then ``--resume``, two ``evaluate`` runs into one folder.

The runs that are stopped run in a subprocess through :data:`HARNESS`, which slows the command
down where the fault is injected (after each checkpoint, before scoring) so that the signal lands
there every time.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from llm_calib import cli
from llm_calib.files.outputs import LOCK_FILE

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
STEPS = "6"

HARNESS = """
import os, sys, time
if os.environ.get("PAUSE_AFTER_CHECKPOINT"):  # each checkpoint written, then a pause: a signal lands in training
    import llm_calib.calm.training as training
    real_save = training.save_state
    def slow_save(*args, **kwargs):
        path = real_save(*args, **kwargs)
        time.sleep(float(os.environ["PAUSE_AFTER_CHECKPOINT"]))
        return path
    training.save_state = slow_save
if os.environ.get("PAUSE_BEFORE_SCORING"):  # evaluate holds its folder's lock, then waits before scoring
    import llm_calib.cli.evaluate as evaluate
    real_score = evaluate._score
    def slow_score(*args, **kwargs):
        time.sleep(float(os.environ["PAUSE_BEFORE_SCORING"]))
        return real_score(*args, **kwargs)
    evaluate._score = slow_score
from llm_calib.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _calibrate_argv(model_dir: Path, out: Path, *extra: str) -> list[str]:
    return ["calibrate", "--model", str(model_dir), "--train", "builtin:arithmetic,capitals:n=4",
            "--heldout", "builtin:arithmetic,capitals:n=4,seed=1", "--eval", "builtin:capitals:n=6,seed=2",
            "--batch-size", "4", "--lora-rank", "2", "--lora-layers", "1", "--bootstrap", "0", "--quiet",
            "--checkpoint-every", "2", "--eval-every", "2", "--steps", STEPS, "--out", str(out), *extra]


def _result(out: Path) -> dict:
    """What a run's calm result is: its adapter and λ bytes, its held-out metrics, its report's numbers."""
    saved = json.loads((out / "calm" / "metrics.json").read_text())["metrics"]
    report = json.loads((out / "metrics.json").read_text())
    return {"adapter": (out / "calm" / "adapter" / "adapter_model.safetensors").read_bytes(),
            "lambda": {k: v.tolist() for k, v in load_file(str(out / "calm" / "lambda.safetensors")).items()},
            "heldout": saved, "domains": report["domains"]}


@pytest.fixture(scope="module")
def undisturbed(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("undisturbed") / "run"
    assert cli.main(_calibrate_argv(tiny_model_dir, out)) == 0
    return _result(out)


def _spawn(argv: list[str], **env: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", HARNESS, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**ENV, **env}, cwd=ROOT)


def _wait_for(path: Path, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if proc.poll() is not None:
            pytest.fail(f"the run ended before {path.name} appeared: {proc.stderr.read()[-2000:]}")
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"no {path} after {timeout} s")
        time.sleep(0.05)


def _corrupt_in_place(weights: Path) -> None:
    """Change one byte of every tensor's data (its sign and exponent byte): same size, a header that parses."""
    data = bytearray(weights.read_bytes())
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    for name, meta in header.items():
        if name != "__metadata__" and meta["data_offsets"][1] > meta["data_offsets"][0]:
            data[8 + n + meta["data_offsets"][0] + 3] ^= 0x40
    weights.write_bytes(bytes(data))


def test_same_size_corruption_of_the_newest_checkpoint_is_skipped(tiny_model_dir, tmp_path, undisturbed):
    out = tmp_path / "run"
    assert cli.main(_calibrate_argv(tiny_model_dir, out)) == 0
    (out / "calm" / "metrics.json").unlink()  # killed after its last checkpoint, before the result was saved
    newest = out / "checkpoints" / "calm" / f"ckpt-{int(STEPS):08d}"
    weights = newest / "tensors.safetensors"
    size = weights.stat().st_size
    _corrupt_in_place(weights)
    assert weights.stat().st_size == size
    with pytest.warns(UserWarning, match=rf"skipping damaged checkpoint {newest} \(tensors.safetensors: its SHA-256 "
                                         r"is not the one recorded.*resuming from .*ckpt-00000004"):
        assert cli.main(_calibrate_argv(tiny_model_dir, out, "--resume")) == 0
    assert _result(out) == undisturbed  # steps 5 and 6 trained again, to the same result


def test_sigterm_during_training_then_resume_gives_the_same_result(tiny_model_dir, tmp_path, undisturbed):
    out = tmp_path / "run"
    proc = _spawn(_calibrate_argv(tiny_model_dir, out), PAUSE_AFTER_CHECKPOINT="3")
    _wait_for(out / "checkpoints" / "calm" / "ckpt-00000002", proc)
    proc.send_signal(signal.SIGTERM)
    err = proc.communicate(timeout=120)[1].strip()
    assert proc.returncode == 143, err
    assert err.splitlines()[-1].startswith("llm-calib: terminated (SIGTERM); continue with the same command and "
                                           "--resume"), err
    assert "Traceback" not in err
    assert not (out / LOCK_FILE).exists() and not (out / "calm" / "metrics.json").exists()
    with pytest.warns(UserWarning):  # the small held-out set's note, as in the undisturbed run
        assert cli.main(_calibrate_argv(tiny_model_dir, out, "--resume")) == 0
    assert _result(out) == undisturbed


def test_a_second_evaluate_into_the_same_folder_is_refused(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "eval"
    argv = ["evaluate", "--model", str(tiny_model_dir), "--data", "builtin:capitals:n=3", "--quiet", "--bootstrap", "0",
            "--out", str(out)]
    first = _spawn(argv, PAUSE_BEFORE_SCORING="60")
    try:
        _wait_for(out / LOCK_FILE, first)
        before = sorted(p.name for p in out.iterdir())
        assert cli.main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and f"another llm-calib run (pid {first.pid} " in err
        assert sorted(p.name for p in out.iterdir()) == before  # the second wrote nothing
    finally:
        first.send_signal(signal.SIGTERM)
        first_err = first.communicate(timeout=120)[1].strip()
    assert first.returncode == 143 and first_err == "llm-calib: terminated (SIGTERM)"
    assert not out.exists()  # the first run's lock went with it, and the folder it made (still empty)
    assert cli.main(argv) == 0 and (out / "metrics.json").is_file()  # the folder is free again
    shutil.rmtree(out)
