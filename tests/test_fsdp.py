"""FSDP2 under ``torchrun`` with 2 CPU ranks (gloo): the sharded base trains as one process does.

One launch of 2 ranks runs, on the float32 tiny model with its frozen base sharded by FSDP2
(:func:`llm_calib.distributed.shard_frozen_base`): 3 CALM (BOME) steps, 3 steps of the LoRA CE
baseline, and 1 CALM step resumed from a checkpoint a single process wrote at step 2 (1 rank → 2).
The LoRA CE runs recompute the trained layer in the backward pass (gradient checkpointing).
The test process runs the same on the combined batches in one process and resumes the 2-rank
checkpoint of step 2 there (2 ranks → 1). Losses, θ and λ agree within float32 tolerances; each
rank stores about half of the base's parameters; the 2-rank result loads into one process.

A second launch loads a tied tiny model from a safetensors directory shard by shard (the default of
:func:`llm_calib.models.load` under ``torchrun``) and trains it with the implicit solver, whose
Hessian-vector products run through the sharded base; outputs, θ and λ equal one process.

A third launch gives the ranks shards whose own cheapest length parts differ in number (and a
shard of one question): they must still run the same passes, or the gathers deadlock.

λ is the temperature adjustment here (one scalar with a sizeable gradient): a vector λ over the
vocabulary has coordinates with near-zero gradients, where Adam's normalisation turns float32
reordering noise into steps of the full learning rate (``tests/test_calm_distributed.py`` checks
that case in float64).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from llm_calib.engine.packing import length_parts
from llm_calib.files.checkpoint import latest_checkpoint, load_checkpoint
from llm_calib.models import tiny_random_model

REPO = Path(__file__).resolve().parents[1]

# Run by every rank, and in the test process (one process) for the reference.
SCRIPT = '''
import json, sys
import torch
torch.set_num_threads(1)
from llm_calib import CalibrationConfig, calibrate
from llm_calib.data import load

STEPS = 3


def config(objective):
    return CalibrationConfig(objective=objective, checkpoint_every=1, lora=dict(rank=2, layers=[1]),
                             training=dict(steps=STEPS, batch_size=4, heldout_batch_size=4, lr=1e-2),
                             selection=dict(eval_every=1, guard_accuracy=0.0))


CALM = {"name": "calm", "solver": {"name": "bome"}, "lam_lr": 1e-1, "adjustment": "temperature"}
LORA_CE = {"name": "lora_ce"}


def run(objective, checkpoint_dir, resume=False):
    from llm_calib.models import enable_checkpointing, tiny_random_model
    model, tok = tiny_random_model(seed=0, init_std=0.1)
    if objective is LORA_CE:  # the baseline with gradient checkpointing (recomputed under FSDP2)
        enable_checkpointing(model)
    # 20 training questions: two trunk-cache chunks, which the ranks' shards of the first batch
    # touch differently (1 chunk on rank 0, 2 on rank 1: every rank must still run the same passes)
    train = load("builtin:arithmetic,capitals:n=10").records
    heldout = load("builtin:arithmetic,capitals:n=4,seed=1").records
    return calibrate(model, tok, train, heldout, config(objective), checkpoint_dir=checkpoint_dir, resume=resume,
                     progress=False)


if __name__ == "__main__":
    import time
    import torch.distributed as dist
    from benchmarks.harness.profiling import parameter_bytes  # the checkout is on PYTHONPATH

    from llm_calib import distributed
    out = sys.argv[1]
    t0 = time.perf_counter()
    calm = run(CALM, out + "/calm")
    assert distributed.world_size() == 2, "calibrate did not join the process group"
    base = calm.model.get_base_model()
    report = {
        "base_bytes": parameter_bytes(base),
        "sharded_weights": sum(1 for p in base.parameters() if hasattr(p, "to_local")),
        "lora_sharded": sum(1 for n, p in base.named_parameters() if "lora_" in n and hasattr(p, "to_local")),
    }
    if distributed.rank() == 0:
        calm.save(out + "/calm_result")
    run(LORA_CE, out + "/lora_ce")
    run(CALM, out + "/from_one_rank", resume=True)
    report["seconds"] = time.perf_counter() - t0
    json.dump(report, open(f"{out}/rank{distributed.rank()}.json", "w"))
    dist.destroy_process_group()
'''


def _last(ckpt_dir: Path) -> tuple[dict[str, torch.Tensor], dict]:
    return load_checkpoint(latest_checkpoint(ckpt_dir))


def _at_step(src: Path, dst: Path, step: int) -> Path:
    """A copy of checkpoint directory ``src`` whose newest checkpoint is that of ``step``."""
    shutil.copytree(src, dst)
    for later in dst.glob("ckpt-*"):
        if int(later.name.split("-")[1]) > step:
            shutil.rmtree(later)
    (dst / "LATEST").write_text(f"ckpt-{step:08d}")
    return dst


def _assert_same_run(got: Path, want: Path, what: str) -> None:
    """Step-3 checkpoints: θ and λ (and every optimiser state) within float32 tolerance; the same history."""
    t_got, s_got = _last(got)
    t_want, s_want = _last(want)
    assert s_got["step"] == s_want["step"] == 3, what
    assert set(t_got) == set(t_want), what
    errors = {k: float((t_got[k] - t_want[k]).abs().max()) for k in t_want}
    print(f"{what}: largest |difference| {max(errors.values()):.2e} ({max(errors, key=errors.get)})")
    for k, err in errors.items():
        assert torch.allclose(t_got[k], t_want[k], rtol=1e-4, atol=1e-6), (what, k, err)
    for h_got, h_want in zip(s_got["history"], s_want["history"], strict=True):
        assert h_got.keys() == h_want.keys(), what
        for key in h_want:  # losses, entropies, held-out metrics of every step
            assert abs(h_got[key] - h_want[key]) <= 1e-5 * max(1.0, abs(h_want[key])), (what, key, h_got, h_want)



def _torchrun(script: Path, *args: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    """``script`` on 2 gloo ranks (one thread each) with this checkout importable.

    Ranks that wait for each other in mismatched collectives hang (gloo's own timeout is 30 minutes):
    after ``timeout`` seconds the launcher stops its ranks and the test fails.
    """
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    env.pop("WORLD_SIZE", None)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               str(script), *map(str, args)]
    with subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            # SIGTERM: torchrun stops its ranks, which run in sessions of their own (killing torchrun would
            # leave them hanging, holding its output pipes open)
            proc.terminate()
            try:
                _, stderr = proc.communicate(timeout=90)
            finally:
                proc.kill()
            pytest.fail(f"{script.name} on 2 ranks did not finish in {timeout} s (ranks deadlocked?)\n{stderr[-4000:]}")
    return subprocess.CompletedProcess(command, proc.returncode, stdout, stderr)

def test_fsdp_two_ranks_equal_one_process_and_resume_across_world_sizes(tmp_path):
    namespace: dict = {"__name__": "fsdp_calibration"}
    exec(compile(SCRIPT, "fsdp_calibration.py", "exec"), namespace)
    run, calm, lora_ce = namespace["run"], namespace["CALM"], namespace["LORA_CE"]
    one = tmp_path / "one"
    run(calm, one / "calm")
    run(lora_ce, one / "lora_ce")
    _at_step(one / "calm", tmp_path / "two" / "from_one_rank", 2)  # the 2-rank run resumes it

    script = tmp_path / "fsdp_calibration.py"
    script.write_text(SCRIPT)
    t0 = time.perf_counter()
    proc = _torchrun(script, tmp_path / "two")
    assert proc.returncode == 0, proc.stderr[-4000:]
    print(f"2-rank launch: {time.perf_counter() - t0:.1f} s")
    two = tmp_path / "two"
    reports = [json.loads((two / f"rank{r}.json").read_text()) for r in (0, 1)]

    # 2 ranks equal 1 process on the combined batch: CALM and the baseline
    _assert_same_run(two / "calm", one / "calm", "calm")
    _assert_same_run(two / "lora_ce", one / "lora_ce", "lora_ce")
    t_calm, _ = _last(one / "calm")
    assert all(float(v.abs().max()) > 1e-4 for k, v in t_calm.items() if k.startswith("theta/") and "lora_B" in k)
    assert abs(float(t_calm["lam/log_a"])) > 1e-4  # the run moved θ and λ

    # each rank stores about half of the base, measured from its shards; LoRA θ is not sharded
    single = tiny_random_model(seed=0, init_std=0.1)[0]
    full = sum(p.numel() * p.element_size() for p in single.parameters())
    for report in reports:
        assert report["sharded_weights"] > 0 and report["lora_sharded"] == 0, report
        lora = sum(4 * 2 * (32 + out) for out in (32, 16))  # rank 2 on q_proj, v_proj of layer 1
        share = (report["base_bytes"] - lora) / full
        assert 0.5 <= share <= 0.52, (report, full)  # the unsharded norms: 5 vectors of 32

    # checkpoints cross world sizes: 2 ranks → 1 and 1 → 2 reach the same step 3
    from_two = _at_step(two / "calm", tmp_path / "from_two_ranks", 2)
    run(calm, from_two, resume=True)
    _assert_same_run(from_two, one / "calm", "resumed 2 ranks -> 1")
    _assert_same_run(two / "from_one_rank", one / "calm", "resumed 1 rank -> 2")

    # the result saved at 2 ranks loads into one process (evaluate --adapter, export)
    from llm_calib.calm.trainer import CalibrationResult

    loaded = CalibrationResult.load(two / "calm_result", tiny_random_model(seed=0, init_std=0.1)[0])
    t_two, _ = _last(two / "calm")  # its selected θ and λ: best_theta/, best_lam/
    lora = {"layers." + n.split(".layers.", 1)[1].replace(".default", ""): p for n, p in loaded.model.named_parameters()
            if "lora_" in n}
    best = {k.removeprefix("best_theta/").replace(".default", ""): v for k, v in t_two.items()
            if k.startswith("best_theta/") and "lora_" in k}
    assert lora.keys() == best.keys() and len(lora) == 4
    for k, v in best.items():
        assert torch.equal(lora[k].detach(), v), k
    assert all(float(v.abs().max()) > 0 for k, v in best.items() if "lora_A" in k)  # not a comparison of zeros
    assert torch.equal(loaded.lam["log_a"], t_two["best_lam/log_a"])


def test_gpu_check_runs_on_cpu_and_names_torchrun_for_fsdp2_modes(tmp_path):
    """benchmarks/gpu_check.py's CPU smoke check; its fsdp2 modes need torchrun (2 ranks: see its docstring)."""
    out = tmp_path / "gpu_check.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    env.pop("WORLD_SIZE", None)
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "gpu_check.py"), "--device", "cpu", "--tiny", "--steps", "1",
         "--modes", "bf16+ckpt,fsdp2", "--batch-sizes", "4", "--out", str(out)], env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "launch with torchrun --nproc_per_node=N (N >= 2)" in proc.stdout
    results = json.loads(out.read_text())["results"]
    assert [(r["mode"], r["batch_size"]) for r in results] == [("bf16+ckpt", 4)]
    assert results[0]["finite"] and results[0]["ranks"] == 1


# Run by every rank: the base loaded shard by shard from a safetensors directory (the default of
# llm_calib.models.load under torchrun), then loaded whole and sharded (the path before), then 3
# CALM steps with the implicit solver (Hessian-vector products through the sharded base).
LOAD_SCRIPT = SCRIPT.split("\nif __name__")[0] + '''
IMPLICIT = {"name": "calm", "solver": {"name": "implicit", "inner_steps": 2, "maxiter": 3}, "lam_lr": 1e-1,
            "adjustment": "temperature"}

def tied_logits(model, tok):
    ids = tok(["What is the capital of France? The answer is: Paris", "the quick brown fox"], return_tensors="pt",
              padding=True)
    with torch.no_grad():
        return model(**ids).logits


if __name__ == "__main__":
    import resource
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM
    from llm_calib import distributed
    from llm_calib.models import load
    model_dir, out, renamed = sys.argv[1], sys.argv[2], sys.argv[3]
    distributed.init_from_env("cpu")
    import warnings
    with warnings.catch_warnings(record=True) as seen:  # rank 1 cannot load sharded: no rank does
        warnings.simplefilter("always")
        other, _ = load(renamed if distributed.rank() == 1 else model_dir)
    fallback = {"warnings": [str(w.message) for w in seen if "loads the whole model" in str(w.message)],
                "sharded": any(hasattr(p, "to_local") for p in other.parameters())}
    del other
    peak0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    model, tok = load(model_dir)  # sharded loading
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    shards = [p for p in model.parameters() if hasattr(p, "to_local")]
    report = {
        "peak_rss_growth_kb": peak - peak0,
        "sharded_local_bytes": sum(p.to_local().numel() * p.element_size() for p in shards),
        "sharded_global_bytes": sum(p.numel() * p.element_size() for p in shards),
        "replicated": sorted(n for n, p in model.named_parameters() if not hasattr(p, "to_local")),
        "tied": model.lm_head.weight is model.model.embed_tokens.weight,
        "q_proj_unit": type(model.model.layers[0].self_attn.q_proj).__name__,
        "fallback": fallback,
    }
    torch.save(tied_logits(model, tok), f"{out}/logits_sharded_load_rank{distributed.rank()}.pt")
    whole = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval().requires_grad_(False)
    distributed.shard_frozen_base(whole)
    torch.save(tied_logits(whole, tok), f"{out}/logits_whole_then_sharded_rank{distributed.rank()}.pt")
    del whole
    train = load_data("builtin:arithmetic,capitals:n=10").records
    heldout = load_data("builtin:arithmetic,capitals:n=4,seed=1").records
    calm = calibrate(model, tok, train, heldout, config(IMPLICIT), checkpoint_dir=out + "/implicit", progress=False)
    base = calm.model.get_base_model()
    report["tied_after_training"] = base.lm_head.weight is base.model.embed_tokens.weight
    json.dump(report, open(f"{out}/rank{distributed.rank()}.json", "w"))
    dist.destroy_process_group()
'''


def _tied_tiny_model(directory: Path) -> None:
    """The tiny model with its head tied to the embedding (as SmolLM2's), saved as safetensors."""
    from transformers import LlamaForCausalLM

    model, tok = tiny_random_model(seed=0, init_std=0.1)
    model.config.tie_word_embeddings = True
    tied = LlamaForCausalLM(model.config)
    tied.load_state_dict({k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}, strict=False)
    assert tied.lm_head.weight is tied.model.embed_tokens.weight
    tied.save_pretrained(directory)
    tok.save_pretrained(directory)


def test_sharded_loading_and_the_implicit_solver_on_two_ranks_equal_one_process(tmp_path):
    from safetensors.torch import load_file, save_file

    from llm_calib.models import load

    model_dir, two, renamed = tmp_path / "model", tmp_path / "two", tmp_path / "renamed"
    _tied_tiny_model(model_dir)
    two.mkdir()
    shutil.copytree(model_dir, renamed)  # a checkpoint whose names differ from the model's (on rank 1 only)
    weights = load_file(renamed / "model.safetensors")
    weights["model.final_norm.weight"] = weights.pop("model.norm.weight")
    save_file(weights, renamed / "model.safetensors", metadata={"format": "pt"})
    script = tmp_path / "fsdp_loading.py"
    script.write_text(LOAD_SCRIPT.replace("from llm_calib.data import load\n", "from llm_calib.data import load as load_data\n"))
    t0 = time.perf_counter()
    proc = _torchrun(script, model_dir, two, renamed)
    assert proc.returncode == 0, proc.stderr[-4000:]
    print(f"2-rank sharded-loading launch: {time.perf_counter() - t0:.1f} s")
    reports = [json.loads((two / f"rank{r}.json").read_text()) for r in (0, 1)]

    # one process: the same directory loaded whole, the same 3 CALM steps
    namespace: dict = {"__name__": "fsdp_loading"}
    exec(compile(LOAD_SCRIPT, "fsdp_loading.py", "exec"), namespace)
    model, tok = load(str(model_dir))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    want = namespace["tied_logits"](model, tok)
    full = sum(p.numel() * p.element_size() for p in model.parameters())
    embed_and_norms = {n: p.numel() * p.element_size() for n, p in model.named_parameters() if "norm" in n or "embed" in n}
    for r in (0, 1):  # (a) the outputs: sharded loading = loading whole then sharding = one process
        for path in ("sharded_load", "whole_then_sharded"):
            got = torch.load(two / f"logits_{path}_rank{r}.pt")
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=f"{path} rank {r}")
    one = tmp_path / "one"
    namespace["calibrate"](model, tok, namespace["load"]("builtin:arithmetic,capitals:n=10").records,
                           namespace["load"]("builtin:arithmetic,capitals:n=4,seed=1").records,
                           namespace["config"](namespace["IMPLICIT"]), checkpoint_dir=one, progress=False)
    _assert_same_run(two / "implicit", one, "calm (implicit solver) on a base loaded sharded")
    t_one, s_one = _last(one)
    assert abs(float(t_one["lam/log_a"])) > 1e-4 and s_one["history"][-1]["matvecs"] > 0  # λ moved by HVPs

    # (b) each rank materialised half of every sharded weight; whole only the tied embedding and the norms
    for report in reports:
        print(f"rank report: {report}")
        assert report["q_proj_unit"] == "FSDPLinear"
        assert report["sharded_local_bytes"] * 2 == report["sharded_global_bytes"], report
        assert report["replicated"] == sorted(embed_and_norms), report
        assert report["sharded_global_bytes"] + sum(embed_and_norms.values()) == full
        # (c) the head stays tied to the embedding, loaded and after training
        assert report["tied"] and report["tied_after_training"], report
        # a rank that cannot load sharded makes every rank load whole (rank 0 warns, naming why)
        assert not report["fallback"]["sharded"], report
    assert reports[1]["fallback"]["warnings"] == []
    assert reports[0]["fallback"]["warnings"] == [
        f"{model_dir}: every rank loads the whole model before FSDP2 shards it: rank 1: {renamed}: no tensor named "
        "'model.norm.weight' in its safetensors files (1 parameters missing: its names differ from the model's)"]


def test_loading_under_torchrun_says_why_it_loads_whole(tmp_path, monkeypatch):
    """Where sharded loading cannot serve (here a device map), every rank loads whole, with a warning naming why."""
    import pytest

    from llm_calib import distributed
    from llm_calib.models import load

    _tied_tiny_model(tmp_path)
    monkeypatch.setattr(distributed, "is_distributed", lambda: True)
    monkeypatch.setattr(distributed, "rank", lambda: 0)
    monkeypatch.setattr(distributed, "first_problem", lambda problem: problem)  # one rank: its own
    with pytest.warns(UserWarning, match=r"every rank loads the whole model before FSDP2 shards it: device_map='cpu'"):
        model, _ = load(str(tmp_path), device_map="cpu")
    assert not any(hasattr(p, "to_local") for p in model.parameters())


# Run by every rank, and in the test process (one process) for the reference: the losses on shards
# whose own cheapest length parts differ in number. FSDP2 gathers the sharded weights in every pass,
# so the ranks must agree on the number of parts (llm_calib.calm.encoding.EncodedRecords.batch).
PARTS_SCRIPT = '''
import sys
import torch
torch.set_num_threads(1)
import hypergrad as hg
from llm_calib import CalibrationConfig, distributed
from llm_calib.calm.run import resolve_run
from llm_calib.calm.training import build_trainer
from llm_calib.data import load
from llm_calib.models import tiny_random_model

# Positions in builtin:arithmetic,capitals:n=10, whose packed lengths are 70 to 103 tokens. "equal":
# rank 0's questions (73, 75, 76, 78 tokens) cost least in 1 part, rank 1's (70, 72, 72, 103) in 2.
# "unequal": rank 0 holds 1 question, fewer than the 2 parts rank 1's shard wants.
SHARDS = {"equal": ([0, 4, 9, 1], [7, 3, 5, 15]), "unequal": ([0], [7, 3, 5, 15])}


def trainer():
    model, tok = tiny_random_model(seed=0, init_std=0.1)
    records = load("builtin:arithmetic,capitals:n=10").records
    return build_trainer(model, tok, records, records, resolve_run(CalibrationConfig(lora=dict(rank=2, layers=[1])), records, records))


def losses_and_gradients(trainer, indices):
    """The number of parts of the batch of ``indices``; g(θ, λ) and f(θ) with their gradients, at θ and λ
    away from the start (the trainer's losses: of the global batch under torchrun)."""
    batch = trainer.train.batch(indices, trainer.pad_id, trainer.lm)
    gen = torch.Generator().manual_seed(0)
    theta = {k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in trainer.lm.theta().items()}
    lam = {k: v + 0.1 * torch.randn(v.shape, generator=gen) for k, v in trainer.adjustment.init().items()}
    out = {"parts": len(batch.parts)}
    for name, loss in (("g", trainer.losses.inner), ("f", trainer.losses.outer)):
        value, grad_theta, grad_lam = hg.autodiff.loss_and_grads(lambda t, l_, loss=loss: loss(t, l_, batch),
                                                                 theta, lam)
        out[name] = value
        out.update({f"{name}/theta/{k}": v for k, v in grad_theta.items()})
        out.update({f"{name}/lam/{k}": v for k, v in grad_lam.items()})
    return out


if __name__ == "__main__":
    import torch.distributed as dist
    distributed.init_from_env("cpu")
    run = trainer()
    rank = distributed.rank()
    torch.save({name: losses_and_gradients(run, shards[rank]) for name, shards in SHARDS.items()},
               f"{sys.argv[1]}/rank{rank}.pt")
    dist.destroy_process_group()
'''


def test_ranks_whose_shards_split_differently_run_the_same_length_parts(tmp_path):
    namespace: dict = {"__name__": "length_parts_ranks"}
    exec(compile(PARTS_SCRIPT, "length_parts_ranks.py", "exec"), namespace)
    script = tmp_path / "length_parts_ranks.py"
    script.write_text(PARTS_SCRIPT)
    proc = _torchrun(script, tmp_path, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    one = namespace["trainer"]()
    for name, shards in namespace["SHARDS"].items():
        # the premise: on its own, each shard would split into a different number of parts
        assert [len(length_parts([one.train.length(i) for i in shard])) for shard in shards] == [1, 2], name
        ranks = [torch.load(tmp_path / f"rank{r}.pt")[name] for r in (0, 1)]
        # every rank runs the same parts: the most any shard wants (2), or none when a shard has 1 question
        assert [r["parts"] for r in ranks] == ([2, 2] if name == "equal" else [0, 0]), name
        # each loss is the mean of the shards' losses, as one process computes them (in parts or whole)
        reference = [namespace["losses_and_gradients"](one, shard) for shard in shards]
        for key in reference[0].keys() - {"parts"}:
            want = (reference[0][key] + reference[1][key]) / 2
            for r, got in enumerate(ranks):
                assert torch.allclose(got[key], want, rtol=1e-4, atol=1e-6), (name, key, r)
        assert reference[1]["parts"] == 2 and ranks[0]["g"] != 0  # one process splits rank 1's shard alike
