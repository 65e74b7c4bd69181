"""The process group's backend follows the run's device, also on a machine with GPUs.

A CPU run under ``torchrun`` on a GPU machine (the suite's own 2-rank CPU launches, or ``--device cpu``)
once got nccl, which reduces GPU tensors only, and ``cuda:LOCAL_RANK`` made current even where the node has
fewer GPUs than ranks. These tests pretend CUDA is present and record what would be initialised.
"""

from __future__ import annotations

import pytest
import torch

from llm_calib import CalibrationConfig, calibrate, cli, distributed
from llm_calib.data import builtin_multiple_choice
from llm_calib.models import tiny_random_model


@pytest.fixture
def gpu_machine_under_torchrun(monkeypatch):
    """CUDA 'available', ``WORLD_SIZE=2``/``LOCAL_RANK=1``, and the group's initialisation recorded."""
    calls: dict[str, list] = {"init": [], "set_device": []}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.distributed, "init_process_group", lambda backend: calls["init"].append(backend))
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: calls["set_device"].append(index))
    return calls


@pytest.mark.parametrize(("device", "backend", "set_device"), [
    ("cpu", "gloo", []),
    (torch.device("cpu"), "gloo", []),
    ("cuda", "nccl", [1]),
    ("cuda:1", "nccl", [1]),
    (None, "nccl", [1]),  # no device named: CUDA when it is available
])
def test_backend_follows_the_device(gpu_machine_under_torchrun, device, backend, set_device):
    assert distributed.init_from_env(device) is True
    assert gpu_machine_under_torchrun == {"init": [backend], "set_device": set_device}


def test_no_group_outside_torchrun(monkeypatch, gpu_machine_under_torchrun):
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert distributed.init_from_env("cuda") is False
    assert gpu_machine_under_torchrun == {"init": [], "set_device": []}


def test_calibrate_joins_with_its_models_device(monkeypatch):
    seen = []
    monkeypatch.setattr(distributed, "init_from_env", lambda device=None: seen.append(device) or False)
    model, tok = tiny_random_model()
    qs = builtin_multiple_choice(n_per_domain=4, domains=["capitals"])
    config = CalibrationConfig(training={"steps": 1, "batch_size": 2}, lora={"rank": 2})
    calibrate(model, tok, qs[:2], qs[2:], config, progress=False)
    assert seen == [torch.device("cpu")]


def test_cli_joins_with_its_device_flag(monkeypatch, tiny_model_dir, tmp_path):
    seen = []
    monkeypatch.setattr(distributed, "init_from_env", lambda device=None: seen.append(device) or False)
    spec = "builtin:capitals:n=4"
    argv = ["calibrate", "--model", str(tiny_model_dir), "--train", spec, "--heldout", "builtin:capitals:n=4,seed=1",
            "--eval", spec, "--out", str(tmp_path / "run"), "--methods", "lora_ce", "--steps", "1", "--batch-size", "2",
            "--lora-rank", "2", "--bootstrap", "0", "--no-progress", "--device", "cpu"]
    assert cli.main(argv) == 0
    assert seen[0] == "cpu"  # before the model is loaded (sharded loading needs the group)
    assert all(torch.device(d).type == "cpu" for d in seen)  # calibrate's own call: the model's device
