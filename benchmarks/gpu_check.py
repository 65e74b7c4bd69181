"""GPU check of real-model calibration: bf16, gradient checkpointing and 4-bit on a ~1B Llama.

Needs nothing from outside the machine: the model is a randomly initialised Llama-style
configuration built in code (TinyLlama-1.1B's shape: 22 layers, hidden 2048, 32 heads, 4 KV heads,
vocabulary 32,000), the tokenizer is the tiny byte-level BPE built in code
(:func:`llm_calib.models.tiny_random_model`), the questions are the built-in multiple-choice set.
For each mode it runs 20 CALM (BOME) steps with LoRA rank 8 on the top 4 layers and the output
scale, and prints the peak accelerator memory of the steps (on CPU: the peak resident set size), tokens per second (real tokens of the
step's training and upper-level batches, per second of step time) and whether every loss was
finite. Modes: ``bf16``, ``bf16+ckpt`` (gradient checkpointing) and, when bitsandbytes is
installed, ``4bit`` (NF4 base, bf16 compute, via ``llm_calib.models.load(load_in_4bit=True)``
from a checkpoint of the same random model written to a temporary directory).
Exit status 1 when a loss is not finite. Expected time on one recent GPU: well under 5 minutes.

FSDP2 modes, under ``torchrun`` with two or more ranks (one process per GPU): ``fsdp2`` and
``fsdp2+ckpt`` are ``bf16`` and ``bf16+ckpt`` with the frozen base sharded over the ranks
(:func:`llm_calib.distributed.shard_frozen_base`) and each global batch split between them;
``fsdp2+load`` loads a bf16 checkpoint of the random model shard by shard onto each GPU
(:func:`llm_calib.distributed.load_sharded`: ``weights MB`` is then this rank's shards);
``fsdp2+implicit`` trains with the implicit solver (2 inner steps, 5 CG iterations) instead of
BOME, its top layers and head kept gathered (``base MB/rank`` counts them whole). Rank 0
prints, besides the columns above, the base's parameter storage per rank against the whole base
(``base MB/rank``, ``base MB``), the ranks and the tokens per second of all ranks together; the
peak memory is rank 0's. ``--batch-size`` is the global batch (a multiple of the ranks).

Run::

    python benchmarks/gpu_check.py                       # on cuda
    python benchmarks/gpu_check.py --device cpu --tiny   # a seconds-long CPU smoke check
    torchrun --nproc_per_node=2 benchmarks/gpu_check.py --modes fsdp2,fsdp2+ckpt,fsdp2+load,fsdp2+implicit  # 2 GPUs
    torchrun --nproc_per_node=2 benchmarks/gpu_check.py --device cpu --tiny --modes fsdp2   # gloo
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import torch
from harness.report import machine_info

from llm_calib.calm.run import resolve_run

sys.path.insert(0, str(Path(__file__).resolve().parent))


def llama_config(tiny: bool, vocab: int, tok):
    from transformers import LlamaConfig

    shape = (dict(hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=max(vocab, 512))
             if tiny else
             dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
                  num_key_value_heads=4, vocab_size=32000))
    return LlamaConfig(**shape, max_position_embeddings=2048, initializer_range=0.02, tie_word_embeddings=False,
                       bos_token_id=tok.convert_tokens_to_ids("<|im_start|>"), eos_token_id=tok.eos_token_id,
                       pad_token_id=tok.pad_token_id)


FSDP2_MODES = {"fsdp2": "bf16", "fsdp2+ckpt": "bf16+ckpt", "fsdp2+load": "bf16", "fsdp2+implicit": "bf16"}
"""The sharded modes and the single-process mode each one shards."""


def build_model(config, device: str, mode: str, workdir: Path):
    """The random model for ``mode``: built on the device in bf16, or 4-bit via a checkpoint."""
    from transformers import LlamaForCausalLM

    from llm_calib.models import enable_checkpointing
    from llm_calib.models import load as load_model

    torch.manual_seed(0)
    if mode == "fsdp2+load":  # a bf16 checkpoint of the random model, loaded shard by shard onto the device
        shared = [str(workdir / "random_llama_bf16")]  # rank 0's (save_pretrained writes on rank 0 only)
        torch.distributed.broadcast_object_list(shared, src=0)
        ckpt = Path(shared[0])
        if torch.distributed.get_rank() == 0:
            LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(ckpt)
            TOKENIZER.save_pretrained(ckpt)
        torch.distributed.barrier()
        model, _ = load_model(str(ckpt), dtype="bfloat16", device=device)
        return model
    mode = FSDP2_MODES.get(mode, mode)
    if mode == "4bit":
        ckpt = workdir / "random_llama"
        if not ckpt.exists():
            model = LlamaForCausalLM(config).to(torch.bfloat16)
            model.save_pretrained(ckpt)
            TOKENIZER.save_pretrained(ckpt)
            del model
        model, _ = load_model(str(ckpt), load_in_4bit=True, device=device, gradient_checkpointing=True)
        return model
    with torch.device(device):
        model = LlamaForCausalLM(config)
    model = model.to(torch.bfloat16).eval()
    if mode == "bf16+ckpt":
        enable_checkpointing(model)
    return model


def run_mode(mode: str, args: argparse.Namespace, workdir: Path) -> dict:
    from harness.profiling import parameter_bytes

    from llm_calib import distributed
    from llm_calib.calm import training
    from llm_calib.config.calibration import CalibrationConfig, SelectionSettings, TrainingSettings
    from llm_calib.data import builtin_multiple_choice
    from llm_calib.objectives.calm import Bome, Calm, ImplicitSolver

    cuda = args.device.startswith("cuda")
    config = llama_config(args.tiny, len(TOKENIZER), TOKENIZER)
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    model = build_model(config, args.device, mode, workdir)
    load_s = time.perf_counter() - t0
    weights_mb = (torch.cuda.memory_allocated() if cuda else 0) / 2**20
    base_mb = parameter_bytes(model) / 2**20  # before sharding: the whole base
    n_layers = config.num_hidden_layers
    records = builtin_multiple_choice(n_per_domain=24, seed=0)
    train, heldout = records[::2], records[1::2]
    solver = ImplicitSolver(inner_steps=2, maxiter=5) if mode == "fsdp2+implicit" else Bome()
    cfg = CalibrationConfig(objective=Calm(solver=solver),
                            training=TrainingSettings(steps=args.steps, batch_size=args.batch_size,
                                                      heldout_batch_size=args.batch_size),
                            selection=SelectionSettings(eval_every=args.steps, guard_accuracy=0.0),
                            lora=dict(rank=8, layers=list(range(n_layers - args.top_k, n_layers))))
    trainer = training.build_trainer(model, TOKENIZER, train, heldout, resolve_run(cfg, train, heldout))  # shards the base under torchrun
    base_mb_rank = parameter_bytes(trainer.lm.base) / 2**20  # this rank's shards (and LoRA)
    sharded_weights_mb = (torch.cuda.memory_allocated() if cuda else 0) / 2**20
    state = training.init_state(trainer, evaluate_before=False)
    trainer.train.fill_trunk_cache(trainer.lm, trainer.pad_id)  # the one-off trunk pass, not timed
    trainer.unlabeled.fill_trunk_cache(trainer.lm, trainer.pad_id)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    from harness.profiling import Phase

    tokens, losses, t_steps = 0, [], 0.0
    phase = Phase().__enter__()  # CPU: peak RSS of the steps (absolute)
    for step in range(args.steps):
        inner, outer = trainer.train_batch(step), trainer.unlabeled_batch(step)
        tokens += int(sum((b.packed.input_ids != trainer.pad_id).sum() for b in (inner, outer)))
        t1 = time.perf_counter()
        try:
            record = training.train_step(trainer, state)
        except training.TrainingDiverged as err:
            print(f"[{mode}] diverged: {err}", flush=True)
            losses.append(math.nan)
            break
        if cuda:
            torch.cuda.synchronize()
        t_steps += time.perf_counter() - t1
        losses.append(record["g"])
    phase.__exit__(None, None, None)
    if distributed.is_distributed():  # every rank's tokens: the global batches' throughput
        counted = torch.tensor([float(tokens)], device=trainer.lm.device)
        torch.distributed.all_reduce(counted)
        tokens = int(counted.item())
    peak_mb = torch.cuda.max_memory_allocated() / 2**20 if cuda else phase.peak / 2**20
    result = {
        "mode": mode, "layers": n_layers, "hidden": config.hidden_size,
        "parameters_m": sum(p.numel() for p in model.parameters()) / 1e6,
        "trained_layers": args.top_k, "load_s": load_s, "weights_mb": weights_mb,
        "ranks": distributed.world_size(), "base_mb": base_mb, "base_mb_rank": base_mb_rank,
        "weights_mb_after_sharding": sharded_weights_mb,
        "steps": len(losses), "step_s": t_steps / max(len(losses), 1), "tokens_per_s": tokens / max(t_steps, 1e-9),
        "peak_step_mb": peak_mb, "finite": all(math.isfinite(x) for x in losses), "g_first_last": [losses[0], losses[-1]],
        "theta_dtypes": sorted({str(v.dtype) for v in state.theta.values()}),
        "lam_dtypes": sorted({str(v.dtype) for v in state.objective_state.lam.values()}),
    }
    del trainer, state, model
    if cuda:
        torch.cuda.empty_cache()
    return result


def main() -> int:
    global TOKENIZER
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="a 6-layer width-64 model (CPU smoke check)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--top-k", type=int, default=4, help="LoRA on the top K layers")
    p.add_argument("--modes", default=None,
                   help="comma-separated; default bf16,bf16+ckpt,4bit (one process), "
                        "fsdp2,fsdp2+ckpt,fsdp2+load,fsdp2+implicit (torchrun)")
    p.add_argument("--out", default=None, help="also write the results as JSON here (rank 0)")
    args = p.parse_args()
    from llm_calib import distributed

    distributed.init_from_env()  # under torchrun: nccl on GPUs (cuda:LOCAL_RANK), gloo on CPUs
    ranks, main_rank = distributed.world_size(), distributed.rank() == 0
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("no CUDA device; use --device cpu --tiny for a smoke check", file=sys.stderr)
        return 2
    if args.device == "cuda" and ranks > 1:
        args.device = f"cuda:{torch.cuda.current_device()}"
    from llm_calib.models import tiny_random_model

    TOKENIZER = tiny_random_model()[1]
    default = ",".join(FSDP2_MODES) if ranks > 1 else "bf16,bf16+ckpt,4bit"
    modes = [m for m in (args.modes or default).split(",") if m]
    unknown = sorted(set(modes) - {"bf16", "bf16+ckpt", "4bit", *FSDP2_MODES})
    if unknown:
        p.error(f"--modes: unknown {unknown}; choose from bf16, bf16+ckpt, 4bit, {', '.join(FSDP2_MODES)}")
    if ranks == 1 and any(m in FSDP2_MODES for m in modes):
        print("fsdp2 modes shard over ranks: launch with torchrun --nproc_per_node=N (N >= 2); skipping them",
              flush=True)
        modes = [m for m in modes if m not in FSDP2_MODES]
    if ranks > 1 and args.batch_size % ranks:
        p.error(f"--batch-size {args.batch_size} is the global batch: it must be a multiple of the {ranks} ranks")
    if "4bit" in modes and importlib.util.find_spec("bitsandbytes") is None:
        print("bitsandbytes not installed: skipping 4bit", flush=True)
        modes.remove("4bit")
    machine = machine_info() | {"device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
                                "ranks": ranks}
    if main_rank:
        print(json.dumps(machine), flush=True)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for mode in modes:
            t0 = time.perf_counter()
            r = run_mode(mode, args, Path(tmp))
            r["wall_s"] = time.perf_counter() - t0
            results.append(r)
            if main_rank:
                print(json.dumps(r), flush=True)
    if main_rank:
        print(f"{'mode':<14} {'params M':>9} {'weights MB':>11} {'peak step MB':>13} {'step s':>7} {'tok/s':>8} "
              f"{'ranks':>5} {'base MB':>8} {'base MB/rank':>12} finite")
        for r in results:
            print(f"{r['mode']:<14} {r['parameters_m']:>9.0f} {r['weights_mb']:>11.0f} {r['peak_step_mb']:>13.0f} "
                  f"{r['step_s']:>7.3f} {r['tokens_per_s']:>8.0f} {r['ranks']:>5} {r['base_mb']:>8.1f} "
                  f"{r['base_mb_rank']:>12.1f} {r['finite']}")
        if args.out:
            Path(args.out).write_text(json.dumps({"machine": machine, "results": results}, indent=2))
    if distributed.is_distributed():
        torch.distributed.destroy_process_group()
    return 0 if all(r["finite"] for r in results) else 1


TOKENIZER = None

if __name__ == "__main__":
    raise SystemExit(main())
