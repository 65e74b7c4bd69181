"""GPU check of real-model calibration: the CALM step beside the LoRA-CE step, per mode and batch size.

Needs nothing from outside the machine: the model is a randomly initialised Llama-style
configuration built in code (TinyLlama-1.1B's shape: 22 layers, hidden 2048, 32 heads, 4 KV heads,
vocabulary 32,000), the tokenizer is the tiny byte-level BPE built in code
(:func:`llm_calib.models.tiny_random_model`), the questions are the built-in multiple-choice set.

For each mode (``bf16``; ``bf16+ckpt``: gradient checkpointing; ``4bit``: NF4 base through
``llm_calib.models.load(load_in_4bit=True)`` when bitsandbytes is installed; ``compile``: bf16 with
the compiled step, ``training.compile``) and each batch size of the sweep (``--batch-sizes``, default
8, 32 and 64 questions, as many held-out questions), it builds one run of CALM (BOME, 5 inner steps)
and one of LoRA-CE (LoRA rank 8 on the top 4 layers, the output scale, trunk cached) and steps them
**in alternating order** (a rotating start: neither is always first), ``--warmup`` steps each
(default 3, excluded) then ``--steps`` timed ones (default 10). Each timed step is synchronised
(``torch.cuda.synchronize``), its record read back after the clock stops. Reported per row: the
median step time of CALM and of LoRA-CE and their **ratio**, tokens per second (padded tokens of the
step's batches), an **MFU** estimate (model FLOPs of the step from the shapes, over the median time,
against the rate of a bf16 matrix product measured on the device, and against ``--peak-tflops``
when given), peak accelerator memory (CPU: peak RSS) and whether every loss was finite.

FLOPs of a step, from the shapes: a forward pass through the trained top layers costs 2 × (their
weights + LoRA) per token plus ``2 · hidden · vocab`` per gathered row at the head; a pass
differentiated in θ costs about twice that (the frozen weights' own gradients are not formed: the
backward computes the activations' gradients, about one forward, plus the small LoRA terms). CALM
with BOME runs ``T`` differentiated passes on the training batch, one forward on it (g at the inner
iterate, differentiated in λ only) and one differentiated pass on the held-out batch; LoRA-CE one
differentiated pass. With gradient checkpointing each differentiated pass adds one forward.

FSDP2 modes, under ``torchrun`` with two or more ranks (one process per GPU): ``fsdp2`` and
``fsdp2+ckpt`` are ``bf16`` and ``bf16+ckpt`` with the frozen base sharded over the ranks
(:func:`llm_calib.distributed.shard_frozen_base`) and each global batch split between them;
``fsdp2+load`` loads a bf16 checkpoint of the random model shard by shard onto each GPU
(:func:`llm_calib.distributed.load_sharded`); ``fsdp2+implicit`` trains with the implicit solver (2 inner
steps, 5 CG iterations) instead of BOME. Rank 0 prints the rows, plus the base's parameter storage
per rank against the whole base.

Exit status 1 when a loss is not finite.

Run::

    python benchmarks/gpu_check.py --out benchmarks/results/gpu_check.json     # on cuda, all modes
    python benchmarks/gpu_check.py --small                 # a seconds-long CPU smoke check (tiny model)
    torchrun --nproc_per_node=2 benchmarks/gpu_check.py --modes fsdp2,fsdp2+ckpt,fsdp2+load,fsdp2+implicit  # 2 GPUs
    torchrun --nproc_per_node=2 benchmarks/gpu_check.py --small --modes fsdp2   # gloo
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness.report import machine_info

SINGLE_MODES = ("bf16", "bf16+ckpt", "4bit", "compile")
FSDP2_MODES = {"fsdp2": "bf16", "fsdp2+ckpt": "bf16+ckpt", "fsdp2+load": "bf16", "fsdp2+implicit": "bf16"}
"""The sharded modes and the single-process mode each one shards."""
OBJECTIVES = ("calm", "lora_ce")


def llama_config(small: bool, vocab: int, tok: Any) -> Any:
    from transformers import LlamaConfig

    shape = (dict(hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=max(vocab, 512))
             if small else
             dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
                  num_key_value_heads=4, vocab_size=32000))
    return LlamaConfig(**shape, max_position_embeddings=2048, initializer_range=0.02, tie_word_embeddings=False,
                       bos_token_id=tok.convert_tokens_to_ids("<|im_start|>"), eos_token_id=tok.eos_token_id,
                       pad_token_id=tok.pad_token_id)


def build_model(config: Any, device: str, mode: str, workdir: Path, dtype: torch.dtype) -> Any:
    """The random model for ``mode``: built on the device, or 4-bit via a checkpoint."""
    from transformers import LlamaForCausalLM

    from llm_calib.models import enable_checkpointing
    from llm_calib.models import load as load_model

    torch.manual_seed(0)
    if mode == "fsdp2+load":  # a bf16 checkpoint of the random model, loaded shard by shard onto the device
        shared = [str(workdir / "random_llama_bf16")]  # rank 0's (save_pretrained writes on rank 0 only)
        torch.distributed.broadcast_object_list(shared, src=0)
        ckpt = Path(shared[0])
        if torch.distributed.get_rank() == 0:
            LlamaForCausalLM(config).to(dtype).save_pretrained(ckpt)
            TOKENIZER.save_pretrained(ckpt)
        torch.distributed.barrier()
        model, _ = load_model(str(ckpt), dtype=str(dtype).removeprefix("torch."), device=device)
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
    model = model.to(dtype).eval()
    if mode == "bf16+ckpt":
        enable_checkpointing(model)
    return model


def step_flops(trainer: Any, inner: Any, outer: Any, objective: str, inner_steps: int, checkpointing: bool) -> float:
    """Model FLOPs of one step from the shapes (see the module docstring)."""
    lm = trainer.lm
    cfg = lm.base.config
    n_layers = cfg.num_hidden_layers
    top = n_layers - lm.trunk_layers
    h, kv = cfg.hidden_size, cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads)
    # a layer's matrices from the config (a 4-bit weight's numel counts packed bytes): q, o; k, v; the MLP
    layer_weights = 2 * h * h + 2 * h * kv + 3 * h * cfg.intermediate_size
    vocab_head = cfg.hidden_size * cfg.vocab_size

    def forward(batch: Any) -> float:
        parts = batch.parts or (batch,)
        tokens = sum(p.packed.input_ids.numel() for p in parts)
        rows = sum(len(p.packed.rows) for p in parts)
        return 2.0 * top * layer_weights * tokens + 2.0 * vocab_head * rows

    grad_pass = 2.0 + (1.0 if checkpointing else 0.0)  # forward, activations' backward (+ the recomputation)
    if objective == "lora_ce":
        return grad_pass * forward(inner)
    return (inner_steps * grad_pass + 1.0) * forward(inner) + grad_pass * forward(outer)


def matmul_tflops(device: str, dtype: torch.dtype, n: int) -> float:
    """TFLOP/s of an ``n × n`` matrix product in ``dtype`` on ``device`` (the best of 5)."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    best = math.inf
    for _ in range(6):
        sync(device)
        t0 = time.perf_counter()
        a @ b
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return 2.0 * n**3 / best / 1e12


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


class Runner:
    """One run (an objective at a batch size) stepped one timed step at a time."""

    def __init__(self, name: str, trainer: Any, state: Any, objective: str, args: argparse.Namespace,
                 checkpointing: bool) -> None:
        self.name, self.trainer, self.state, self.objective = name, trainer, state, objective
        self.args, self.checkpointing = args, checkpointing
        self.times: list[float] = []
        self.flops: list[float] = []
        self.tokens: list[int] = []
        self.losses: list[float] = []
        self.diverged = ""

    def step(self, timed: bool) -> None:
        from llm_calib.calm import training

        if self.diverged:
            return
        t, s = self.trainer, self.state
        inner, outer = t.train_batch(s.step), t.unlabeled_batch(s.step)
        sync(self.args.device)
        t0 = time.perf_counter()
        try:
            record = training.train_step(t, s, read=False)
            sync(self.args.device)
            elapsed = time.perf_counter() - t0
            training.read_back(s)  # after the clock: the step itself reads nothing back
        except training.TrainingDiverged as err:
            self.diverged = str(err)
            self.losses.append(math.nan)
            return
        self.losses.append(record["g"] if "g" in record else record["loss"])
        if timed:
            self.times.append(elapsed)
            batches = [inner] if self.objective == "lora_ce" else [inner, outer]
            self.tokens.append(sum(p.packed.input_ids.numel() for b in batches for p in (b.parts or (b,))))
            self.flops.append(step_flops(t, inner, outer, self.objective, 5, self.checkpointing))

    def summary(self) -> dict[str, Any]:
        med = statistics.median(self.times) if self.times else math.nan
        flops = statistics.median(self.flops) if self.flops else math.nan
        tokens = statistics.median(self.tokens) if self.tokens else math.nan
        return {"step_s": med, "steps_timed": len(self.times), "step_s_all": self.times,
                "tokens_per_step": tokens, "tokens_per_s": tokens / med if med else math.nan,
                "tflop_per_step": flops / 1e12, "tflops": flops / med / 1e12 if med else math.nan,
                "finite": not self.diverged and all(math.isfinite(x) for x in self.losses),
                "diverged": self.diverged, "loss_first_last": [self.losses[0], self.losses[-1]] if self.losses else []}


def build_runner(model: Any, mode: str, objective: str, batch_size: int, args: argparse.Namespace,
                 records: tuple[list[Any], list[Any]]) -> Runner:
    from llm_calib.calm import training
    from llm_calib.calm.run import resolve_run
    from llm_calib.config.calibration import CalibrationConfig, SelectionSettings, TrainingSettings
    from llm_calib.objectives.calm import Bome, Calm, ImplicitSolver
    from llm_calib.objectives.lora_ce import LoraCE

    n_layers = model.config.num_hidden_layers
    if objective == "lora_ce":
        obj: Any = LoraCE()
    else:
        obj = Calm(solver=ImplicitSolver(inner_steps=2, maxiter=5) if mode == "fsdp2+implicit" else Bome())
    training_settings = TrainingSettings(steps=10**6, batch_size=batch_size, heldout_batch_size=batch_size)
    if mode == "compile":
        training_settings = dataclasses.replace(training_settings, compile=True)
    cfg = CalibrationConfig(objective=obj, training=training_settings,
                            selection=SelectionSettings(eval_every=10**6, guard_accuracy=0.0),
                            lora=dict(rank=8, layers=list(range(n_layers - args.top_k, n_layers))))
    train, heldout = records
    # shards the base under torchrun
    trainer = training.build_trainer(model, TOKENIZER, train, heldout, resolve_run(cfg, train, heldout))
    state = training.init_state(trainer, evaluate_before=False)
    trainer.fill_trunk_caches()  # the one-off trunk pass, not timed
    checkpointing = FSDP2_MODES.get(mode, mode) == "bf16+ckpt" or mode == "4bit"
    return Runner(f"{mode}/{objective}/b{batch_size}", trainer, state, objective, args, checkpointing)


def run_mode(mode: str, args: argparse.Namespace, workdir: Path, peak: dict[str, float]) -> list[dict[str, Any]]:
    """Every batch size of the sweep: CALM and LoRA-CE stepped alternately; one row per batch size."""
    from harness.profiling import Phase, parameter_bytes

    from llm_calib import distributed
    from llm_calib.data import builtin_multiple_choice

    cuda = args.device.startswith("cuda")
    dtype = torch.bfloat16 if cuda or not args.small else torch.float32
    config = llama_config(args.small, len(TOKENIZER), TOKENIZER)
    records = builtin_multiple_choice(n_per_domain=max(8, (2 * max(args.batch_sizes) + 4) // 5), seed=0)
    split = (records[::2], records[1::2])
    rows = []
    for batch_size in args.batch_sizes:
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        runners, load_s = [], 0.0
        for objective in OBJECTIVES:  # each run attaches LoRA to its own model (the same random weights)
            t0 = time.perf_counter()
            model = build_model(config, args.device, mode, workdir, dtype)
            load_s = time.perf_counter() - t0
            base_mb = parameter_bytes(model) / 2**20  # before sharding: the whole base
            parameters_m = sum(p.numel() for p in model.parameters()) / 1e6
            runners.append(build_runner(model, mode, objective, batch_size, args, split))
        base_mb_rank = parameter_bytes(runners[0].trainer.lm.base) / 2**20
        phase = Phase().__enter__()  # CPU: peak RSS of the steps
        for i in range(args.warmup + args.steps):
            order = runners[i % 2:] + runners[:i % 2]  # alternating: neither always first
            for runner in order:
                runner.step(timed=i >= args.warmup)
        phase.__exit__(None, None, None)
        calm, ce = (r.summary() for r in runners)
        peak_mb = torch.cuda.max_memory_allocated() / 2**20 if cuda else phase.peak / 2**20
        row = {"mode": mode, "batch_size": batch_size, "layers": config.num_hidden_layers,
               "hidden": config.hidden_size, "parameters_m": parameters_m,
               "trained_layers": args.top_k, "load_s": load_s, "ranks": distributed.world_size(),
               "base_mb": base_mb, "base_mb_rank": base_mb_rank, "peak_step_mb": peak_mb,
               "calm": calm, "lora_ce": ce, "calm_over_ce": calm["step_s"] / ce["step_s"],
               "mfu_calm": calm["tflops"] / peak["measured"], "mfu_ce": ce["tflops"] / peak["measured"],
               "finite": calm["finite"] and ce["finite"],
               "theta_dtypes": sorted({str(v.dtype) for v in runners[0].state.theta.values()}),
               "lam_dtypes": sorted({str(v.dtype) for v in runners[0].state.objective_state.lam.values()})}
        if peak.get("nominal"):
            row["mfu_calm_nominal"] = calm["tflops"] / peak["nominal"]
            row["mfu_ce_nominal"] = ce["tflops"] / peak["nominal"]
        rows.append(row)
        if distributed.rank() == 0:
            print(json.dumps(row), flush=True)
        del runners, model
    if cuda:
        torch.cuda.empty_cache()
    return rows


def main() -> int:
    global TOKENIZER
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default=None, help="default: cuda, or cpu with --small")
    p.add_argument("--small", "--tiny", action="store_true",
                   help="a 6-layer width-64 float32 model on the CPU, 1 warm-up and 2 timed steps, batches 4 and 8")
    p.add_argument("--steps", type=int, default=None, help="timed steps per run (default 10; --small 2)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps per run first (default 3; --small 1)")
    p.add_argument("--batch-sizes", default=None, help="comma-separated questions per step (default 8,32,64; --small 4,8)")
    p.add_argument("--top-k", type=int, default=4, help="LoRA on the top K layers")
    p.add_argument("--modes", default=None,
                   help=f"comma-separated; default {','.join(SINGLE_MODES)} (one process), "
                        f"{','.join(FSDP2_MODES)} (torchrun)")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="the card's nominal dense bf16 rate, for a second MFU column (H100 SXM: 989)")
    p.add_argument("--out", default=None, help="also write the results as JSON here (rank 0)")
    args = p.parse_args()
    args.device = args.device or ("cpu" if args.small else "cuda")
    args.steps = args.steps if args.steps is not None else (2 if args.small else 10)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.small else 3)
    args.batch_sizes = [int(b) for b in (args.batch_sizes or ("4,8" if args.small else "8,32,64")).split(",")]
    from llm_calib import distributed

    distributed.init_from_env(args.device)  # under torchrun: nccl on GPUs (cuda:LOCAL_RANK), gloo on CPUs
    ranks, main_rank = distributed.world_size(), distributed.rank() == 0
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("no CUDA device; use --small for a CPU smoke check", file=sys.stderr)
        return 2
    if args.device == "cuda" and ranks > 1:
        args.device = f"cuda:{torch.cuda.current_device()}"
    from llm_calib.models import tiny_random_model

    TOKENIZER = tiny_random_model()[1]
    # --small: the two eager modes (compiling takes a minute on a CPU: ask for it with --modes compile)
    default = ",".join(FSDP2_MODES) if ranks > 1 else ",".join(SINGLE_MODES[:2] if args.small else SINGLE_MODES)
    modes = [m for m in (args.modes or default).split(",") if m]
    unknown = sorted(set(modes) - {*SINGLE_MODES, *FSDP2_MODES})
    if unknown:
        p.error(f"--modes: unknown {unknown}; choose from {', '.join(SINGLE_MODES)}, {', '.join(FSDP2_MODES)}")
    if ranks == 1 and any(m in FSDP2_MODES for m in modes):
        print("fsdp2 modes shard over ranks: launch with torchrun --nproc_per_node=N (N >= 2); skipping them",
              flush=True)
        modes = [m for m in modes if m not in FSDP2_MODES]
    if ranks > 1 and any(b % ranks for b in args.batch_sizes):
        p.error(f"--batch-sizes {args.batch_sizes} are global batches: each must be a multiple of the {ranks} ranks")
    if "4bit" in modes and (importlib.util.find_spec("bitsandbytes") is None or not args.device.startswith("cuda")):
        print("4bit needs bitsandbytes and a GPU: skipping it", flush=True)
        modes.remove("4bit")
    if "compile" in modes:
        from hypergrad.compiled import compiler_available

        ok, why = compiler_available()
        if not ok:
            print(f"compile: no compiler ({why}): skipping it", flush=True)
            modes.remove("compile")
    cuda = args.device.startswith("cuda")
    dtype = torch.bfloat16 if cuda else torch.float32
    peak = {"measured": matmul_tflops(args.device, dtype, 8192 if cuda else 512), "nominal": args.peak_tflops}
    machine = machine_info() | {"device": torch.cuda.get_device_name() if cuda else "cpu", "ranks": ranks,
               "matmul_tflops": peak["measured"], "dtype": str(dtype).removeprefix("torch."),
               "command": "python benchmarks/gpu_check.py " + " ".join(sys.argv[1:]),
               "warmup_steps": args.warmup, "timed_steps": args.steps}
    if main_rank:
        print(json.dumps(machine), flush=True)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for mode in modes:
            t0 = time.perf_counter()
            rows = run_mode(mode, args, Path(tmp), peak)
            for r in rows:
                r["mode_wall_s"] = time.perf_counter() - t0
            results.extend(rows)
    if main_rank:
        print(f"{'mode':<14} {'batch':>5} {'CALM s':>8} {'CE s':>8} {'CALM/CE':>8} {'CALM tok/s':>10} "
              f"{'MFU CALM':>8} {'MFU CE':>7} {'peak MB':>8} {'ranks':>5} {'base MB/rank':>12} finite")
        for r in results:
            print(f"{r['mode']:<14} {r['batch_size']:>5} {r['calm']['step_s']:>8.4f} {r['lora_ce']['step_s']:>8.4f} "
                  f"{r['calm_over_ce']:>8.2f} {r['calm']['tokens_per_s']:>10.0f} {r['mfu_calm']:>8.1%} "
                  f"{r['mfu_ce']:>7.1%} {r['peak_step_mb']:>8.0f} {r['ranks']:>5} {r['base_mb_rank']:>12.1f} "
                  f"{r['finite']}")
        print(f"MFU against a {machine['dtype']} {8192 if cuda else 512}-square matrix product measured here: "
              f"{peak['measured']:.1f} TFLOP/s; step times are medians after {args.warmup} warm-up steps", flush=True)
        if args.out:
            Path(args.out).write_text(json.dumps({"machine": machine, "results": results}, indent=2))
    if distributed.is_distributed():
        torch.distributed.destroy_process_group()
    return 0 if all(r["finite"] for r in results) else 1


TOKENIZER = None

if __name__ == "__main__":
    raise SystemExit(main())
