"""CALM (BOME) under ``torchrun`` with 2 CPU ranks (gloo) equals one process on the combined batches.

The model runs in float64. In float32 the two runs differ by float rounding only (the order in which
per-question gradients are summed), but Adam's per-coordinate normalisation turns that into visible
differences in λ: BOME's λ direction is the difference of two nearly equal gradients,
∇λ g(θ) − ∇λ g(θ̂). Measured on this set-up: reordering the same batch in *one* process moves λ by
up to 3e-4 in float32 (θ by 1e-8) and by exactly 0 in float64. float64 therefore tests the data-parallel
arithmetic itself, to far below the 1e-5 tolerance.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

from llm_calib.files.checkpoint import latest_checkpoint, load_checkpoint

REPO = Path(__file__).resolve().parents[1]

# Run by every rank, and in-process (single process) for the reference. ``calibrate`` joins the
# process group itself (llm_calib.distributed.init_from_env) and shards each global batch.
SCRIPT = '''
import sys
import torch
torch.set_num_threads(1)
from llm_calib import CalibrationConfig, calibrate
from llm_calib.data import load
from llm_calib.models import tiny_random_model

STEPS = 3


def run(checkpoint_dir):
    model, tok = tiny_random_model(seed=0, init_std=0.1)
    model = model.double()
    train = load("builtin:arithmetic,capitals:n=4").records
    heldout = load("builtin:arithmetic,capitals:n=4,seed=1").records
    # global batch 4 (2 per rank with 2 ranks); eval every step exercises model selection
    cfg = CalibrationConfig(objective={"name": "calm", "solver": {"name": "bome"}, "lam_lr": 1e-1, "adjustment": "vector"},
                            training=dict(steps=STEPS, batch_size=4, heldout_batch_size=4, lr=1e-2),
                            selection=dict(eval_every=1, guard_accuracy=0.0), checkpoint_every=STEPS,
                            lora=dict(rank=2, layers=[1]))
    return calibrate(model, tok, train, heldout, cfg, checkpoint_dir=checkpoint_dir, progress=False)


def final_tensors(result):
    theta = {n: p.detach().clone() for n, p in result.model.named_parameters() if "lora_" in n}
    return {**{f"theta/{k}": v for k, v in theta.items()}, **{f"lam/{k}": v for k, v in result.lam.items()}}


if __name__ == "__main__":
    import torch.distributed as dist
    from safetensors.torch import save_file
    from llm_calib import distributed
    out = sys.argv[1]
    result = run(out + "/ckpt")
    assert distributed.world_size() == 2, "calibrate did not join the process group"
    save_file(final_tensors(result), f"{out}/rank{distributed.rank()}.safetensors")
    dist.destroy_process_group()
'''


def test_two_ranks_equal_one_process(tmp_path):
    script = tmp_path / "ddp_calibration.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    env.pop("WORLD_SIZE", None)
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         str(script), str(tmp_path)],
        env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]

    namespace: dict = {"__name__": "ddp_calibration"}
    exec(compile(SCRIPT, str(script), "exec"), namespace)
    reference = namespace["run"](tmp_path / "single")
    ref = namespace["final_tensors"](reference)

    ranks = [load_file(str(tmp_path / f"rank{r}.safetensors")) for r in (0, 1)]
    for k in ref:
        assert torch.equal(ranks[0][k], ranks[1][k]), k  # every rank holds the same model
        assert torch.allclose(ranks[0][k], ref[k], atol=1e-5, rtol=0), (k, float((ranks[0][k] - ref[k]).abs().max()))
    # the last step's θ and λ (written by rank 0), not only the selected ones, match as well
    t_ddp, s_ddp = load_checkpoint(latest_checkpoint(tmp_path / "ckpt"))
    t_one, s_one = load_checkpoint(latest_checkpoint(tmp_path / "single"))
    assert s_ddp["step"] == s_one["step"] == namespace["STEPS"]
    assert set(t_ddp) == set(t_one)
    for k in t_one:
        assert torch.allclose(t_ddp[k], t_one[k], atol=1e-5, rtol=0), (k, float((t_ddp[k] - t_one[k]).abs().max()))
    moved = [k for k in t_one if k.startswith("theta/") and "lora_B" in k]
    assert moved and all(float(t_one[k].abs().max()) > 1e-4 for k in moved)
    assert float(t_one["lam/b"].abs().max()) > 1e-4
    # the held-out history (full held-out set on every rank) agrees too
    for h_ddp, h_one in zip(s_ddp["history"], s_one["history"], strict=True):
        assert h_ddp.keys() == h_one.keys()
        for key in h_one:
            assert abs(h_ddp[key] - h_one[key]) <= 1e-4 * max(1.0, abs(h_one[key])), (key, h_ddp, h_one)
