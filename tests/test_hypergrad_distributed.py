"""Every hypergrad method on 2 gloo ranks under ``torchrun`` equals one process on the combined batches.

One launch runs every method of :data:`METHODS` in sequence (5 outer steps of ``hg.solve`` each, in
float64) on a per-feature L2-regularised logistic regression: each rank draws its half of every
global batch and solves :func:`hypergrad.distributed.data_parallel` of the per-rank problem. The
reference solves the plain problem in this process on the whole batches. The λ trajectories agree
to 1e-10 (measured: the printed maximum differences, 3e-17 to 9e-15).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import hypergrad as hg

REPO = Path(__file__).resolve().parents[1]
TOLERANCE = 1e-10

# Run by every rank under torchrun, and in this process (one rank, whole batches) for the reference.
SCRIPT = '''
import sys

import torch
import torch.nn.functional as F

import hypergrad as hg

torch.set_num_threads(1)
OUTER_STEPS = 5
N_INNER, N_OUTER, BATCH, FEATURES = 4, 2, 8, 5  # global batches: 4 inner, 2 outer, 8 samples each
SGD = hg.inner.SGD


def cg():
    return hg.linear.CG(tol=1e-12, maxiter=50)


# name -> (method, keyword arguments of hg.solve besides the batches). Every method, keyword arguments
# only; a new method (SRBA, ...) gets its line here (test_every_method_is_covered says so).
METHODS = {
    "Implicit": (lambda: hg.Implicit(solver=cg()), {"inner_steps": 10, "inner_optimizer": SGD(lr=1.0)}),
    "AlternatingImplicit": (lambda: hg.AlternatingImplicit(
        inner_optimizer=SGD(lr=1.0), inner_steps=4, implicit=hg.Implicit(solver=cg())), {}),
    "Unrolled": (lambda: hg.Unrolled(optimizer=SGD(lr=1.0), steps=6), {}),
    "FiniteDifference": (lambda: hg.FiniteDifference(eps=1e-3, solver=cg()),
                         {"inner_steps": 10, "inner_optimizer": SGD(lr=1.0)}),
    "Penalty": (lambda: hg.Penalty(sigma=1e-1, inner_optimizer=SGD(lr=1.0), inner_steps=3), {}),
    "BOME": (lambda: hg.BOME(inner_optimizer=SGD(lr=1.0), w_lr=0.5, inner_steps=3), {}),
    "SOBA": (lambda: hg.SOBA(step_size=0.5), {}),
    "SABA": (lambda: hg.SABA(step_size=0.5, n_inner=N_INNER, n_outer=N_OUTER), {}),
    # restarts on this rank's shards of every batch (FULL, set in trajectories): the global mean over ranks
    "SRBA": (lambda: hg.SRBA(step_size=0.5, period=3, full_inner_batches=FULL["inner"], full_outer_batches=FULL["outer"]), {}),
    "AmIGO": (lambda: hg.AmIGO(step_size=0.5, inner_steps=3, linear_steps=3), {}),
    "StocBiO": (lambda: hg.StocBiO(step_size=0.5, inner_steps=3, neumann_steps=3), {}),
}


def data():
    """Global batches (index, X, y): the index is the batch's position, as SABA reads it."""
    gen = torch.Generator().manual_seed(0)
    truth = torch.randn(FEATURES, generator=gen, dtype=torch.float64)

    def batches(count):
        X = torch.randn(count, BATCH, FEATURES, generator=gen, dtype=torch.float64)
        y = torch.sign(X @ truth + 0.5 * torch.randn(count, BATCH, generator=gen, dtype=torch.float64))
        return [(i, X[i], y[i]) for i in range(count)]

    return batches(N_INNER), batches(N_OUTER)


FULL = {}  # this rank's shards of all the batches, SRBA's full batches


def shard(batches, rank, world):
    """This rank's samples of every global batch, under the same index on every rank."""
    return [(i, X[rank::world], y[rank::world]) for i, X, y in batches]


def inner(w, lam, batch):
    _, X, y = batch
    fit = F.softplus(-y * (X @ w["coef"] + w["bias"])).mean()
    return fit + 0.5 * (lam["log_l2"].exp() * w["coef"] ** 2).sum()


def outer(w, lam, batch):
    _, X, y = batch
    return F.softplus(-y * (X @ w["coef"] + w["bias"])).mean()


def trajectories(rank=0, world=1):
    """name -> the λ after each outer step, stacked (steps, features)."""
    problem = hg.distributed.data_parallel(hg.BilevelProblem(inner=inner, outer=outer))
    train, val = data()
    FULL.update(inner=shard(train, rank, world), outer=shard(val, rank, world))
    out = {}
    for name, (make, options) in METHODS.items():
        lams = []
        hg.solve(problem, {"coef": torch.zeros(FEATURES, dtype=torch.float64),
                           "bias": torch.zeros((), dtype=torch.float64)},
                 {"log_l2": torch.zeros(FEATURES, dtype=torch.float64)}, make(),
                 lambda params: torch.optim.SGD(params, lr=1.0), steps=OUTER_STEPS,
                 inner_batches=shard(train, rank, world), outer_batches=shard(val, rank, world),
                 progress=False, callback=lambda step, w, lam, result: lams.append(lam["log_l2"].clone()),
                 **options)
        out[name] = torch.stack(lams)
    return out


if __name__ == "__main__":
    import torch.distributed as dist

    dist.init_process_group("gloo")
    assert hg.distributed.world_size() == 2
    result = trajectories(hg.distributed.rank(), hg.distributed.world_size())
    torch.save(result, f"{sys.argv[1]}/rank{hg.distributed.rank()}.pt")
    dist.destroy_process_group()
'''


def _namespace() -> dict:
    namespace: dict = {"__name__": "hypergrad_distributed"}
    exec(compile(SCRIPT, "hypergrad_distributed.py", "exec"), namespace)
    return namespace


def test_every_method_is_covered() -> None:
    """Each method class hypergrad exports runs in the two-rank test (add a new one to METHODS)."""
    methods = {name for name in hg.__all__ if isinstance(getattr(hg, name), type) and name != "HypergradMethod"
               and callable(getattr(getattr(hg, name), "hypergrad", None))}
    missing = methods - set(_namespace()["METHODS"])
    assert not missing, f"add {sorted(missing)} to METHODS in {Path(__file__).name}'s SCRIPT"


@pytest.mark.slow
def test_two_ranks_equal_one_process(tmp_path: Path) -> None:
    script = tmp_path / "hypergrad_distributed.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    env.pop("WORLD_SIZE", None)
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         str(script), str(tmp_path)],
        env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    reference = _namespace()["trajectories"]()
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1)]
    differences = {}
    for name, lams in reference.items():
        assert torch.equal(ranks[0][name], ranks[1][name]), name  # every rank takes the same steps
        assert lams.shape == ranks[0][name].shape, name
        assert float(lams[-1].abs().max()) > 1e-3, f"{name}: λ hardly moves, the test would see nothing"
        differences[name] = float((ranks[0][name] - lams).abs().max())
    print("max |λ(2 ranks) - λ(1 process)| over 5 steps:",
          ", ".join(f"{name} {diff:.1e}" for name, diff in differences.items()))
    assert all(diff <= TOLERANCE for diff in differences.values()), differences


def test_data_parallel_names_a_wrong_problem() -> None:
    with pytest.raises(TypeError, match=r"problem must be a hypergrad\.BilevelProblem, got function"):
        hg.distributed.data_parallel(lambda w, lam, batch: w["x"].sum())  # type: ignore[arg-type]
