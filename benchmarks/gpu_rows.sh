#!/usr/bin/env bash
# The GPU rows of a lent device in one call: what a session runs when it is lent a GPU.
#
#   run(command="bash benchmarks/gpu_rows.sh", timeout_s=560)      # the device tool, repository root
#
# Writes everything under $OUT (the device tool's folder; ./gpu_rows_out without one):
#   machine.txt         nvidia-smi, python/torch/transformers versions
#   gpu_check.json/.log benchmarks/gpu_check.py at the TinyLlama-1.1B shape: CALM beside LoRA-CE, warm-up
#                       excluded, batch sweep 8/32/64, MFU, the compiled step (bf16; 4-bit where bitsandbytes is)
#   step_overhead.*     benchmarks/step_overhead.py on CUDA: kernels, device time and syncs per step (tiny model)
#   suite.log           the whole test suite on the GPU machine (-n 14), failures and errors listed at the end
# Each part has its own time limit, so one that runs long leaves the others their time; the budgets add up to
# about 520 s. The image has no network and lacks some extras (see the suite's skips): nothing is installed, the
# checkout runs from PYTHONPATH.
set -u
OUT=${OUT:-gpu_rows_out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} OMP_NUM_THREADS=${OMP_NUM_THREADS:-4} HF_HUB_OFFLINE=1
PY=${PY:-python3}

{
  date -u
  nvidia-smi || true
  $PY -c "import sys, torch, transformers; print(sys.version); print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no cuda'); print('transformers', transformers.__version__)"
} > "$OUT/machine.txt" 2>&1

timeout 220 $PY benchmarks/gpu_check.py --out "$OUT/gpu_check.json" > "$OUT/gpu_check.log" 2>&1
echo "gpu_check rc=$?" >> "$OUT/machine.txt"

timeout 60 $PY benchmarks/step_overhead.py --device cuda --methods lora_ce+one_pass,calm:bome --steps 4 --repeats 2 \
  --out "$OUT/step_overhead.md" > "$OUT/step_overhead.log" 2>&1
echo "step_overhead rc=$?" >> "$OUT/machine.txt"

timeout 240 $PY -m pytest -n 14 -p no:cacheprovider --tb=line -rfE -q > "$OUT/suite.log" 2>&1
echo "suite rc=$?" >> "$OUT/machine.txt"
tail -n 60 "$OUT/suite.log"
cat "$OUT/machine.txt"
