"""The hypergrad benchmark's parts (benchmarks/hg_implicit.py, hg_unrolled.py, hg_first_order.py
over harness/hypergrad_problems.py and harness/hypergrad_suite.py): each alone times only its own families, on the problems
it serves; together, through hypergrad_bench.py, every family in the order of the report."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from _benchmarks import load_benchmark, load_harness

pytest.importorskip("torchopt")
pytest.importorskip("higher")
pytest.importorskip("sklearn")

HARNESS, PROBLEMS = load_harness("hypergrad_suite"), load_harness("hypergrad_problems")
UNITS = {"unit", "unit-hvp"}
# hypergrad_bench.py's runners on the per-feature ridge problem, in the order the single-file
# benchmark built them (its make_runners): implicit, unrolled, then first-order families
RIDGE_FEATURE_FAMILIES = [
    "unit", "unit-hvp", "implicit-cg", "implicit-cg", "implicit-cg-floor", "implicit-dense", "implicit-neumann", "implicit-neumann",
    "unrolled-reverse", "unrolled-reverse", "unrolled-reverse-metasgd", "unrolled-checkpoint", "unrolled-stored",
    "unrolled-all", "unrolled-truncated", "unrolled-forward", "fd-cg", "fd-identity", "penalty", "penalty-advanced",
]


def _families(result, problem):
    return [r.family for r in result["rows"] if r.problem == problem]


def _suite(concerns, numbers):
    sizes = replace(PROBLEMS.TINY, problems=numbers, memory=False)
    threads = torch.get_num_threads()
    try:
        return HARNESS.suite(sizes, concerns, threads=1, log=lambda _: None)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize(("part", "prefixes"), [("hg_implicit", ("implicit-",)),
                                                 ("hg_unrolled", ("unrolled-",)),
                                                 ("hg_first_order", ("fd-", "penalty"))])
def test_a_part_alone_times_only_its_families(part, prefixes) -> None:
    concern = load_benchmark(part)
    result = _suite((concern,), (1,))
    assert {r.problem for r in result["rows"]} == {"ridge_scalar", "ridge_feature"}
    for problem in ("ridge_scalar", "ridge_feature"):
        families = _families(result, problem)
        own = [f for f in families if f not in UNITS]
        assert own and all(f.startswith(prefixes) for f in own), (part, problem, families)
        assert families[0] == "unit"  # the grad-eq denominator, in every part
    # the preconditioning experiment belongs to the implicit part, after the per-feature problem
    precond = result.get("precond", [])
    assert ({p["problem"] for p in precond} == {"ridge_feature"}) == (part == "hg_implicit"), precond


@pytest.mark.filterwarnings("ignore")
def test_a_problem_no_part_serves_is_left_out() -> None:
    """The unroll-length sweep (problem 5) has no finite-difference or penalty runners: the
    first-order part alone builds nothing there (not even the unit gradient's rows)."""
    result = _suite((load_benchmark("hg_first_order"),), (5,))
    assert result["rows"] == []


@pytest.mark.filterwarnings("ignore")
def test_the_entry_runs_every_family_in_the_single_file_order() -> None:
    bench = load_benchmark("hypergrad_bench")
    b = bench.build_bench({"key": "ridge_feature", "kind": "ridge", "n": 60, "d": 5, "scalar": False, "K": 3})
    # jaxopt's peer rows join when the bench extra is installed; hypergrad's own rows are the ones in order
    runners = [r for r in bench.make_runners(b, PROBLEMS.TINY) if r.library != "jaxopt"]
    assert [r.family for r in runners] == RIDGE_FEATURE_FAMILIES
    # each runner knows the group that builds it again in the memory worker
    for r in runners:
        again = bench.make_runners(b, PROBLEMS.TINY, [r.group])
        assert r.name in {x.name for x in again}, (r.group, r.name)


@pytest.mark.filterwarnings("ignore")
def test_a_part_runs_alone_from_its_command_line(capsys) -> None:
    """``python benchmarks/hg_first_order.py --quick --problems 1 --no-memory`` prints its report."""
    part = load_benchmark("hg_first_order")
    threads = torch.get_num_threads()
    try:
        assert part.main(["--quick", "--problems", "1", "--no-memory"]) == 0
    finally:
        torch.set_num_threads(threads)
    text = capsys.readouterr().out
    assert "- Command: `python benchmarks/hg_first_order.py --quick --problems 1`" in text
    assert "| FiniteDifference (CG) | hypergrad |" in text and "| Penalty / F2SA (T=1" in text
    assert "| Implicit CG |" not in text and "Unrolled reverse (K=" not in text
