"""Every hypergrad method on 2 gloo ranks under ``torchrun`` equals one process on the combined batches.

One launch runs every method of :data:`METHODS` in sequence (5 outer steps of ``hg.solve`` each, in
float64) on a per-feature L2-regularised logistic regression: each rank draws its half of every
global batch and solves :func:`hypergrad.distributed.data_parallel` of the per-rank problem. The
reference solves the plain problem in this process on the whole batches. The λ trajectories agree
to 1e-10 (measured: the printed maximum differences, 3e-17 to 9e-15). The same launch runs 20 outer
steps of the combinations that differentiate the all-reduce by batched or forward-mode products
(``Implicit(Dense())``, ``Implicit(products="forward")``, ``Unrolled(mode="forward")``) and of
:func:`hypergrad.custom_root`, against one process to 1e-10, and checks that ``compile=True`` is refused
before the first step.
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


# Twenty outer steps of the combinations that differentiate the all-reduce in other ways than reverse-mode
# products on a retained graph: batched backward passes (Dense's Hessian by vmap), forward mode, and
# custom_root's implicit backward pass. Outer SGD with lr 0.2 (lam stays of order 1).
LONG_STEPS = 20
COMBINATIONS = {
    "Implicit(Dense())": (lambda: hg.Implicit(hg.linear.Dense()), {"inner_steps": 10, "inner_optimizer": SGD(lr=1.0)}),
    "Implicit(products='forward')": (lambda: hg.Implicit(cg(), products="forward"),
                                     {"inner_steps": 10, "inner_optimizer": SGD(lr=1.0)}),
    "Unrolled(mode='forward')": (lambda: hg.Unrolled(SGD(lr=1.0), steps=6, mode="forward"), {}),
}
# compile=True is refused before the first step: no batch drawn, no callback
REFUSED = {
    "Implicit(compile=True)": lambda: hg.Implicit(cg(), compile=True),
    "SOBA(compile=True)": lambda: hg.SOBA(0.5, compile=True),
    "BOME(compile=True)": lambda: hg.BOME(SGD(lr=1.0), w_lr=0.5, inner_steps=3, compile=True),
    "Penalty(compile=True)": lambda: hg.Penalty(0.1, SGD(lr=1.0), inner_steps=3, compile=True),
    "AlternatingImplicit(implicit=Implicit(compile=True))": lambda: hg.AlternatingImplicit(
        SGD(lr=1.0), 2, hg.Implicit(cg(), compile=True)),
}


def start():
    return ({"coef": torch.zeros(FEATURES, dtype=torch.float64), "bias": torch.zeros((), dtype=torch.float64)},
            {"log_l2": torch.zeros(FEATURES, dtype=torch.float64)})


def combinations(rank=0, world=1):
    """name -> the lam after each of LONG_STEPS outer steps; "custom_root": the same with the gradient of
    f(w*(lam)) from hg.custom_root (the inner solve by L-BFGS, warm started)."""
    problem = hg.distributed.data_parallel(hg.BilevelProblem(inner=inner, outer=outer))
    train, val = data()
    train, val = shard(train, rank, world), shard(val, rank, world)
    out = {}
    for name, (make, options) in COMBINATIONS.items():
        lams = []
        w, lam = start()
        hg.solve(problem, w, lam, make(), lambda params: torch.optim.SGD(params, lr=0.2), steps=LONG_STEPS,
                 inner_batches=train, outer_batches=val, progress=False,
                 callback=lambda step, w, lam, result: lams.append(lam["log_l2"].clone()), **options)
        out[name] = torch.stack(lams)

    @hg.custom_root(problem.inner, solver=hg.linear.CG(tol=1e-12, maxiter=50))
    def solution(w0, lam, batch):
        return hg.inner_solve(problem, w0, lam, 100, hg.inner.LBFGS(), batch, tol=1e-12)

    w, lam = start()
    lam = {"log_l2": lam["log_l2"].requires_grad_(True)}
    lams = []
    for step in range(LONG_STEPS):
        w_star = solution(w, lam, train[step % len(train)])
        value = problem.outer(w_star, lam, val[step % len(val)])
        (grad,) = torch.autograd.grad(value, [lam["log_l2"]])
        with torch.no_grad():
            lam["log_l2"] -= 0.5 * grad
        w = {k: v.detach() for k, v in w_star.items()}
        lams.append(lam["log_l2"].detach().clone())
    out["custom_root"] = torch.stack(lams)
    return out


def refusals(rank, world):
    """name -> (the error message, batches drawn, callbacks run) of a solve with compile=True, and of one
    direct hypergrad call."""
    problem = hg.distributed.data_parallel(hg.BilevelProblem(inner=inner, outer=outer))
    train, val = data()
    out = {}
    for name, make in REFUSED.items():
        drawn, called = [], []

        def batches(shards=shard(train, rank, world)):
            for batch in shards:
                drawn.append(1)
                yield batch

        w, lam = start()
        try:
            hg.solve(problem, w, lam, make(), steps=3, inner_batches=batches(), outer_batches=shard(val, rank, world),
                     progress=False, callback=lambda *args: called.append(1))
            message = None
        except ValueError as error:
            message = str(error)
        try:
            make().hypergrad(problem, w, lam, shard(train, rank, world)[0], shard(val, rank, world)[0])
            direct = None
        except ValueError as error:
            direct = str(error)
        out[name] = (message, len(drawn), len(called), direct)
    return out


if __name__ == "__main__":
    import torch.distributed as dist

    dist.init_process_group("gloo")
    assert hg.distributed.world_size() == 2
    rank, world = hg.distributed.rank(), hg.distributed.world_size()
    result = {"trajectories": trajectories(rank, world), "combinations": combinations(rank, world),
              "refusals": refusals(rank, world)}
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


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """One torchrun launch of SCRIPT on 2 gloo ranks: each rank's results."""
    folder = tmp_path_factory.mktemp("two_ranks")
    script = folder / "hypergrad_distributed.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    env.pop("WORLD_SIZE", None)
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         str(script), str(folder)],
        env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [torch.load(folder / f"rank{r}.pt") for r in (0, 1)]


def _compare(reference: dict, ranks: list[dict], what: str) -> dict[str, float]:
    differences = {}
    for name, lams in reference.items():
        assert torch.equal(ranks[0][name], ranks[1][name]), name  # every rank takes the same steps
        assert lams.shape == ranks[0][name].shape, name
        assert float(lams[-1].abs().max()) > 1e-3, f"{name}: λ hardly moves, the test would see nothing"
        differences[name] = float((ranks[0][name] - lams).abs().max())
    print(f"max |λ(2 ranks) - λ(1 process)| over {what}:",
          ", ".join(f"{name} {diff:.1e}" for name, diff in differences.items()))
    return differences


@pytest.mark.slow
def test_two_ranks_equal_one_process(two_ranks: list[dict]) -> None:
    reference = _namespace()["trajectories"]()
    differences = _compare(reference, [r["trajectories"] for r in two_ranks], "5 steps")
    assert all(diff <= TOLERANCE for diff in differences.values()), differences


@pytest.mark.slow
def test_dense_forward_products_and_custom_root_equal_one_process_over_twenty_steps(two_ranks: list[dict]) -> None:
    # Dense's Hessian is one vmap over backward passes through the all-reduce, forward products a jvp
    # through it: both used to fail under data_parallel (no batching rule, no setup_context)
    reference = _namespace()["combinations"]()
    differences = _compare(reference, [r["combinations"] for r in two_ranks], "20 steps")
    assert set(differences) == {"Implicit(Dense())", "Implicit(products='forward')", "Unrolled(mode='forward')",
                                "custom_root"}
    assert all(diff <= TOLERANCE for diff in differences.values()), differences


@pytest.mark.slow
def test_compile_under_data_parallel_is_refused_before_the_first_step(two_ranks: list[dict]) -> None:
    # it used to return a zero lam-gradient with info.extra["compiled"] = True
    refused = two_ranks[0]["refusals"]
    assert set(refused) == set(_namespace()["REFUSED"])
    for name, (message, drawn, called, direct) in refused.items():
        assert message is not None and "\n" not in message, name
        assert message.startswith(f"{name} under hypergrad.distributed.data_parallel (2 ranks) is not supported"), message
        assert message.endswith("use compile=False, which takes the same steps on every rank"), message
        assert drawn == 0 and called == 0, (name, drawn, called)  # refused before anything ran
        assert direct is not None and "is not supported" in direct and "compile=False" in direct, (name, direct)


def test_data_parallel_names_a_wrong_problem() -> None:
    with pytest.raises(TypeError, match=r"problem must be a hypergrad\.BilevelProblem, got function"):
        hg.distributed.data_parallel(lambda w, lam, batch: w["x"].sum())  # type: ignore[arg-type]
