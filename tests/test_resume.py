"""Exact resume of ``hg.solve`` and its checkpoint files.

``solve(state=result.state)`` continues a run bit for bit (outer optimizer, scheduler, inner
optimizer, batch streams, random state); ``save_checkpoint`` / ``load_checkpoint`` write and read
that state, and ``checkpoint_every`` resumes a killed solve to the same result.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import hypergrad as hg

ROOT = Path(__file__).resolve().parent.parent


def _data(seed: int = 0) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(48, 5, generator=gen, dtype=torch.float64)
    y = x @ torch.randn(5, generator=gen, dtype=torch.float64) + 0.3 * torch.randn(48, generator=gen, dtype=torch.float64)
    return x[:32], y[:32], x[32:], y[32:]


X, Y, X_VAL, Y_VAL = _data()


def g(w, lam, batch):
    x, y = (X, Y) if batch is None else batch
    return 0.5 * ((x @ w["w"] - y) ** 2).mean() + 0.5 * (torch.exp(lam["log_l2"]) * w["w"] ** 2).sum()


def f(w, lam, batch):
    x, y = (X_VAL, Y_VAL) if batch is None else batch
    return 0.5 * ((x @ w["w"] - y) ** 2).mean()


PROBLEM = hg.BilevelProblem(g, f)
W0 = {"w": torch.zeros(5, dtype=torch.float64)}
LAM0 = {"log_l2": torch.full((5,), -1.0, dtype=torch.float64)}


def _adam(params):
    return torch.optim.Adam(params, lr=0.05)


def _cosine(opt):
    return torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=25)


def _loader(x, y, batch_size, seed=None):
    generator = None if seed is None else torch.Generator().manual_seed(seed)
    return DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=True, generator=generator)


def _config(name: str) -> dict:
    """solve's arguments (all but w, lam, steps, state) of one method; loaders made afresh each call."""
    if name == "implicit_cg":
        return dict(method=hg.Implicit(hg.linear.CG(tol=1e-12)), inner_steps=15,
                    inner_optimizer=hg.inner.Adam(lr=0.05))
    if name == "soba_loader":  # shuffling loaders on the global torch RNG; epochs end mid-solve
        return dict(method=hg.SOBA(step_size=0.2), inner_batches=_loader(X, Y, 6),
                    outer_batches=_loader(X_VAL, Y_VAL, 5))
    if name == "bome_loader":  # step batches (several draws per call), a loader with its own generator
        return dict(method=hg.BOME(hg.inner.SGD(lr=0.2), inner_steps=3, w_optimizer=hg.inner.Adam(lr=0.05)), inner_batches=_loader(X, Y, 7, seed=3),
                    outer_batches=_loader(X_VAL, Y_VAL, 4), outer_loss_every=3)
    raise AssertionError(name)


def _solve(name, w, lam, steps, state=None, **extra):
    return hg.solve(PROBLEM, w, lam, outer_optimizer=_adam, scheduler=_cosine, steps=steps, progress=False,
                    state=state, **_config(name), **extra)


def _assert_same(a: hg.SolveResult, b: hg.SolveResult) -> None:
    for key in a.lam:
        assert torch.equal(a.lam[key], b.lam[key]), (key, (a.lam[key] - b.lam[key]).abs().max())
    for key in a.w:
        assert torch.equal(a.w[key], b.w[key]), key


@pytest.mark.parametrize("name", ["implicit_cg", "soba_loader", "bome_loader"])
def test_ten_plus_ten_steps_equal_twenty_bit_for_bit(name: str) -> None:
    torch.manual_seed(1)
    whole = _solve(name, W0, LAM0, 20)
    torch.manual_seed(1)
    first = _solve(name, W0, LAM0, 10)
    torch.manual_seed(12345)  # the resumed solve sets torch's random state back itself
    second = _solve(name, first.w, first.lam, 10, state=first.state)
    _assert_same(second, whole)
    assert second.state.step == whole.state.step == 20
    assert second.steps_run == 10
    assert (LAM0["log_l2"] - whole.lam["log_l2"]).abs().max() > 1e-2  # the run did move λ
    # the state is not consumed by resuming: the same state resumed again gives the same numbers
    again = _solve(name, first.w, first.lam, 10, state=first.state)
    _assert_same(again, whole)


def test_random_losses_continue_from_the_saved_random_state() -> None:
    """No batch stream, but a loss that draws random numbers: the global torch RNG is restored."""

    def noisy_g(w, lam, batch):
        return g(w, lam, batch) + 0.05 * (torch.randn(5, dtype=torch.float64) * w["w"]).sum()

    def run(w, lam, steps, state=None):
        return hg.solve(hg.BilevelProblem(noisy_g, f), w, lam, hg.Implicit(hg.linear.CG(tol=1e-12)), _adam,
                        steps=steps, inner_steps=5, inner_optimizer=hg.inner.SGD(lr=0.1), progress=False,
                        state=state)

    torch.manual_seed(3)
    whole = run(W0, LAM0, 12)
    torch.manual_seed(3)
    first = run(W0, LAM0, 6)
    torch.manual_seed(99)
    _assert_same(run(first.w, first.lam, 6, first.state), whole)


def test_method_state_alone_restarts_the_outer_optimizer() -> None:
    """What resuming used to be (the method's state only): not exact with Adam; the SolveState is."""
    whole = _solve("implicit_cg", W0, LAM0, 20)
    first = _solve("implicit_cg", W0, LAM0, 10)
    old_style = _solve("implicit_cg", first.w, first.lam, 10, state=first.state.method)
    assert (old_style.lam["log_l2"] - whole.lam["log_l2"]).abs().max() > 1e-3


def test_callback_steps_and_outer_loss_every_count_on_across_a_resume() -> None:
    seen: list[int] = []
    first = _solve("bome_loader", W0, LAM0, 4)
    resumed = _solve("bome_loader", first.w, first.lam, 3, state=first.state,
                     callback=lambda step, w, lam, r: seen.append(step))
    assert seen == [4, 5, 6]
    nan = [x != x for x in resumed.history["outer_loss"]]
    assert nan == [True, True, False]  # outer_loss_every=3: evaluated at step 6, not 4 or 5


class _StopError(Exception):
    pass


def test_solve_stopped_by_an_exception_resumes_from_its_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "run.pt"
    torch.manual_seed(7)
    whole = _solve("soba_loader", W0, LAM0, 20)

    def fail_at_13(step, w, lam, r):
        if step == 13:
            raise _StopError

    torch.manual_seed(7)
    with pytest.raises(_StopError):
        _solve("soba_loader", W0, LAM0, 20, checkpoint_every=5, checkpoint_path=path, callback=fail_at_13)
    state = hg.load_checkpoint(path)
    assert state.step == 10
    assert sorted(os.listdir(tmp_path)) == ["run.pt"]  # no temporary file left behind
    resumed = _solve("soba_loader", state.w, state.lam, 20 - state.step, state=state,
                     checkpoint_every=5, checkpoint_path=path)
    _assert_same(resumed, whole)
    assert hg.load_checkpoint(path).step == 20


def test_killed_solve_resumes_to_the_same_result(tmp_path: Path) -> None:
    """A solve in another process is killed (SIGKILL) after its checkpoint at step 12."""
    path = tmp_path / "run.pt"
    script = textwrap.dedent(f"""
        import os, signal, sys, torch
        sys.path.insert(0, {str(ROOT)!r})
        torch.set_num_threads({torch.get_num_threads()})
        from tests.test_resume import W0, LAM0, _solve

        def kill_after_12(step, w, lam, r):
            if step == 13:
                os.kill(os.getpid(), signal.SIGKILL)

        torch.manual_seed(5)
        _solve("bome_loader", W0, LAM0, 20, checkpoint_every=4, checkpoint_path={str(path)!r}, callback=kill_after_12)
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    state = hg.load_checkpoint(path)
    assert state.step == 12
    torch.manual_seed(5)
    whole = _solve("bome_loader", W0, LAM0, 20)
    resumed = _solve("bome_loader", state.w, state.lam, 8, state=state)
    _assert_same(resumed, whole)


def test_truncated_or_corrupt_checkpoint_gives_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "run.pt"
    res = _solve("implicit_cg", W0, LAM0, 2, checkpoint_path=path)
    assert hg.load_checkpoint(path).step == 2
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=r"run\.pt is not a readable hypergrad checkpoint \(truncated or corrupt"):
        hg.load_checkpoint(path)
    path.write_bytes(b"\0" * 100)
    with pytest.raises(ValueError, match=r"run\.pt is not a readable hypergrad checkpoint"):
        hg.load_checkpoint(path)
    torch.save({"w": res.w}, path)  # a torch file, but not a checkpoint
    with pytest.raises(ValueError, match=r"run\.pt is not a hypergrad checkpoint"):
        hg.load_checkpoint(path)
    with pytest.raises(FileNotFoundError, match=r"missing\.pt"):
        hg.load_checkpoint(tmp_path / "missing.pt")


def test_failed_write_keeps_the_previous_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "run.pt"
    state = hg.SolveState(step=1, w=W0, lam=LAM0)
    hg.save_checkpoint(path, state)

    def broken_save(obj, handle):
        handle.write(b"half a file")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", broken_save)
    with pytest.raises(OSError, match="disk full"):
        hg.save_checkpoint(path, dataclasses.replace(state, step=2))
    monkeypatch.undo()
    assert hg.load_checkpoint(path).step == 1
    assert sorted(os.listdir(tmp_path)) == ["run.pt"]


def test_resume_errors_name_what_is_wrong(tmp_path: Path) -> None:
    first = _solve("implicit_cg", W0, LAM0, 2)
    with pytest.raises(ValueError, match=r"lam is not state\.lam .*after step 2.*lam=state\.lam"):
        _solve("implicit_cg", first.w, LAM0, 2, state=first.state)
    with pytest.raises(ValueError, match=r"w is not state\.w"):
        _solve("implicit_cg", W0, first.lam, 2, state=first.state)
    with pytest.raises(ValueError, match="scheduler=None"):
        hg.solve(PROBLEM, first.w, first.lam, hg.Implicit(), _adam, steps=1, progress=False, state=first.state)
    with pytest.raises(ValueError, match="checkpoint_every=3 needs checkpoint_path"):
        _solve("implicit_cg", W0, LAM0, 2, checkpoint_every=3)
    with pytest.raises(ValueError, match="checkpoint_every must be an int >= 0"):
        _solve("implicit_cg", W0, LAM0, 2, checkpoint_every=-1, checkpoint_path=tmp_path / "x.pt")
    with pytest.raises(TypeError, match=r"state must be a hypergrad\.SolveState"):
        hg.save_checkpoint(tmp_path / "x.pt", first.state.method)
    shorter = dataclasses.replace(first.state, streams={"inner_batches": {
        "kind": "re-iterable", "drawn": 99, "epoch_drawn": 99, "epoch_rng": first.state.rng | {"generators": []},
        "first_rng": first.state.rng | {"generators": []}, "rng": first.state.rng | {"generators": []}}})
    with pytest.raises(ValueError, match="cannot resume inner_batches: the state stood at batch 99"):
        _solve("implicit_cg", first.w, first.lam, 1, state=shorter, inner_batches=[(X, Y)] * 4)
