"""Bucketed gradient all-reduce (``llm_calib.distributed.sync_gradients``) under 2 gloo ranks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from llm_calib.distributed import buckets

REPO = Path(__file__).resolve().parents[1]

SCRIPT = '''
import json, sys
import torch
import torch.distributed as dist
from llm_calib import distributed

dist.init_process_group("gloo")
r = dist.get_rank()
calls = []
real = dist.all_reduce
def counting(t, *a, **k):
    calls.append(t.numel())
    return real(t, *a, **k)
distributed.dist.all_reduce = counting
shapes = [(3, 4), (5,), (2, 2), (7,), (1,)]
out = {}
for bucket_bytes in (distributed.BUCKET_BYTES, 48):
    params = {f"p{i}": torch.full(s, float(i + 1), requires_grad=True) for i, s in enumerate(shapes)}
    synced = distributed.sync_gradients(params, bucket_bytes=bucket_bytes)
    # rank-dependent data; p4 unused by the loss (its gradient is zero)
    loss = sum((r + 1) * (k + 1) * synced[f"p{k}"].sum() for k in range(4))
    calls.clear()
    loss.backward()
    out[str(bucket_bytes)] = {"calls": list(calls), "grads": {k: p.grad.flatten().tolist() for k, p in params.items()}}
json.dump(out, open(sys.argv[1] + f"/rank{r}.json", "w"))
dist.destroy_process_group()
'''


def test_bucketed_all_reduce_sums_gradients_in_few_collectives(tmp_path):
    script = tmp_path / "buckets.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    env.pop("WORLD_SIZE", None)
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script), str(tmp_path)],
        env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    shapes = [(3, 4), (5,), (2, 2), (7,), (1,)]
    sizes = [int(torch.Size(s).numel()) for s in shapes]
    for bucket_bytes, n_calls in (("26214400", 1), ("48", None)):
        for rank in ranks:
            got = rank[bucket_bytes]
            # the sum over ranks of (r + 1)(k + 1): 3 (k + 1); the unused p4 gets zeros
            for k, size in enumerate(sizes):
                expected = [3.0 * (k + 1)] * size if k < 4 else [0.0] * size
                assert got["grads"][f"p{k}"] == expected, (bucket_bytes, k)
            plan = buckets([torch.zeros(s) for s in shapes], int(bucket_bytes))
            assert got["calls"] == [sum(sizes[i] for i in b) for b in plan]
            if n_calls is not None:
                assert len(got["calls"]) == n_calls  # one flat all-reduce instead of one per leaf
    assert len(ranks[0]["48"]["calls"]) == 3  # 12 floats (48 B) | 5 + 2 x 2 | 7 + 1


def test_buckets_respect_size_and_dtype():
    ts = [torch.zeros(3), torch.zeros(2, dtype=torch.float64), torch.zeros(1), torch.zeros(10)]
    assert buckets(ts, bucket_bytes=16) == [[0, 2], [1], [3]]
    assert buckets(ts, bucket_bytes=10**9) == [[0, 2, 3], [1]]
