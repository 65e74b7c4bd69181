"""Per-rank memory of loading a model under ``torchrun``: whole then sharded, or shard by shard.

Run it once per mode, e.g. on 2 CPU ranks (gloo) with the built-in SmolLM2-135M alias::

    torchrun --standalone --nproc_per_node=2 benchmarks/fsdp_load_memory.py --mode whole
    torchrun --standalone --nproc_per_node=2 benchmarks/fsdp_load_memory.py --mode sharded

``whole``: ``from_pretrained`` on every rank, then :func:`llm_calib.distributed.shard_frozen_base`
and the first (no-grad) forward pass that training runs through a freshly sharded base (the path
before sharded loading). ``sharded``: :func:`llm_calib.models.load`, whose default under
``torchrun`` is :func:`llm_calib.distributed.load_sharded`. Each rank prints one JSON line: its
peak resident memory (``ru_maxrss``) grown during the load, its resident memory after it, and the
parameter bytes it holds. Imports and the process group come first, outside the measurement.
"""

from __future__ import annotations

import argparse
import json
import resource
import time
from pathlib import Path

import torch


def _rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct", help="alias or safetensors model directory")
    parser.add_argument("--mode", choices=("whole", "sharded"), required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    import transformers.models.llama.modeling_llama  # noqa: F401 (imported before measuring)
    from harness.profiling import parameter_bytes
    from transformers import AutoModelForCausalLM

    from llm_calib import distributed, models

    distributed.init_from_env("cpu")  # the measurement loads onto the CPU
    source = models.default_cache_dir(args.model) if args.model in models.ALIASES else Path(args.model)
    if not (source / "config.json").is_file():
        raise SystemExit(f"{source} holds no model: convert the alias once with llm_calib.models.load({args.model!r})")
    models.free_memory()
    rss0, peak0, t0 = _rss_mb(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, time.perf_counter()
    if args.mode == "whole":
        model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
        if distributed.shard_frozen_base(model.requires_grad_(False)):
            with torch.no_grad():  # build_trainer's first pass through a freshly sharded base
                model(input_ids=torch.zeros((1, 1), dtype=torch.long))
    else:
        model, _ = models.load(str(source))
    models.free_memory()
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    full = sum(p.numel() * p.element_size() for p in model.parameters()) if not distributed.is_distributed() else None
    print(json.dumps({
        "mode": args.mode, "rank": distributed.rank(), "ranks": distributed.world_size(),
        "peak_rss_growth_mb": round(peak - peak0, 1), "rss_growth_mb": round(_rss_mb() - rss0, 1),
        "parameter_mb": round(parameter_bytes(model) / 2**20, 1), "load_s": round(seconds, 2),
        **({"full_parameter_mb": round(full / 2**20, 1)} if full else {}),
    }), flush=True)
    if distributed.is_distributed():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
