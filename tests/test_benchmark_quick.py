"""The benchmark's core (benchmarks/hypergrad_bench.py) on tiny sizes: sane numbers, a report."""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
from _benchmarks import load_benchmark

pytest.importorskip("torchopt")
pytest.importorskip("higher")
pytest.importorskip("sklearn")

@pytest.fixture(scope="module")
def bench():
    return load_benchmark("hypergrad_bench")


@pytest.fixture(scope="module")
def result(bench):
    return bench.suite(bench.TINY, threads=1, log=lambda _: None)


def _rows(result, problem=None, family=None, library=None):
    return [
        r for r in result["rows"]
        if (problem is None or r.problem == problem)
        and (family is None or r.family == family)
        and (library is None or r.library == library)
    ]


@pytest.mark.filterwarnings("ignore")
def test_exact_methods_are_accurate_and_peers_agree(result, bench) -> None:
    for problem in ("ridge_scalar", "ridge_feature", "logistic_d50", "clean"):
        for library in ("hypergrad", "torchopt"):
            (cg,) = _rows(result, problem, "implicit-cg", library)
            assert cg.error is not None and cg.error < 1e-4, (problem, library, cg.error)
        (fd,) = _rows(result, problem, "fd-cg", "hypergrad")
        assert fd.error < 1e-3, (problem, fd.error)
        # same estimator, same number: torchopt's CG, higher and MetaSGD against ours
        for family, library in (("implicit-cg", "torchopt"), ("unrolled-reverse", "higher"),
                                ("unrolled-reverse-metasgd", "torchopt")):
            (peer,) = _rows(result, problem, family, library)
            assert peer.agree is not None and peer.agree < 1e-5, (problem, family, peer.agree)
    # Implicit Dense on ridge/logistic: exact (closed form / explicit IFT solve), agrees with CG to
    # CG's tolerance, and appears in the ours/peer ratio rows next to CG
    for problem in ("ridge_scalar", "ridge_feature", "logistic_d50"):
        (dense,) = _rows(result, problem, "implicit-dense", "hypergrad")
        assert dense.error is not None and dense.error < 1e-10, (problem, dense.error)
        assert dense.agree is not None and dense.agree < 1e-4, (problem, dense.agree)
        pairs = {r["pair"] for r in bench.pair_ratios(result["rows"]) if r["problem"] == problem}
        assert {"Implicit Dense / Implicit CG", "Implicit Dense (not the default) / torchopt CG"} <= pairs
    assert not _rows(result, "clean", "implicit-dense")  # ridge/logistic only
    # jaxopt (when the bench extra is installed): the same CG solve, the same number
    if bench._jax() is not None:
        for problem in ("ridge_scalar", "ridge_feature", "logistic_d50"):
            (jx,) = _rows(result, problem, "implicit-cg", "jaxopt")
            assert jx.agree is not None and jx.agree < 1e-8, (problem, jx.agree)
            assert jx.extra["compile_s"] > 0
    # forward and reverse unrolling agree (scalar hyperparameter)
    for problem in ("ridge_scalar", "ksweep_K10"):
        (fwd,) = _rows(result, problem, "unrolled-forward")
        (rev,) = _rows(result, problem, "unrolled-reverse", "hypergrad")
        (ck,) = _rows(result, problem, "unrolled-checkpoint")
        if rev.error is not None:
            assert math.isclose(fwd.error, rev.error, rel_tol=1e-4, abs_tol=1e-9)
            assert math.isclose(ck.error, rev.error, rel_tol=1e-6, abs_tol=1e-12)


@pytest.mark.filterwarnings("ignore")
def test_times_ratios_and_targets_are_finite(result, bench, tmp_path) -> None:
    rows = result["rows"]
    assert len(rows) > 40
    for r in rows:
        assert math.isfinite(r.time_s) and r.time_s > 0, r
        assert math.isfinite(r.geq) and r.geq > 0, r
    # a solve-based hypergradient (two gradients, the products, the mixed product) costs more than
    # one gradient; the unit row is exactly 1. (PyTorch libraries; jaxopt's compiled solve can beat
    # one eager PyTorch gradient. The floor is 1, not the ~3+ of an idle machine: 1-2 timed rounds
    # of sub-millisecond calls on a loaded 2-core machine measured 1.4.)
    for r in _rows(result, family="implicit-cg"):
        assert r.library == "jaxopt" or r.geq > 1.0, r
    assert all(r.geq == 1.0 for r in _rows(result, family="unit"))
    ratios = bench.pair_ratios(rows)
    assert {p["pair"] for p in ratios} >= {
        "Implicit CG / torchopt custom_root+solve_cg", "Unrolled reverse / higher"}
    for p in ratios:
        # each ratio is ours / peer of the two rows it names, in both time and memory
        label_fams = {
            "Implicit CG / torchopt custom_root+solve_cg": ("implicit-cg", "implicit-cg", "torchopt"),
            "Unrolled reverse / higher": ("unrolled-reverse", "unrolled-reverse", "higher"),
            "Unrolled reverse / torchopt MetaSGD": ("unrolled-reverse", "unrolled-reverse-metasgd", "torchopt"),
        }
        if p["pair"] not in label_fams:
            continue
        ours_fam, peer_fam, peer_lib = label_fams[p["pair"]]
        (ours,) = _rows(result, p["problem"], ours_fam, "hypergrad")
        (peer,) = _rows(result, p["problem"], peer_fam, peer_lib)
        assert p["time_ratio"] == pytest.approx(ours.time_s / peer.time_s, rel=1e-12), p
        assert p["ours_ms"] == pytest.approx(ours.time_s * 1e3) and p["peer_ms"] == pytest.approx(peer.time_s * 1e3)
    # the unrolled reverse runners of the three libraries build the same graph of K steps: their
    # times agree within a factor of 10 on every problem even on a loaded machine (a stub, or a
    # runner that skips the K steps, is about 100x off)
    for p in ratios:
        if p["pair"].startswith("Unrolled reverse"):
            assert 0.1 < p["time_ratio"] < 10.0, p
    names = [t["target"] for t in bench.targets(rows, result["sizes"])]
    assert any(n.startswith("Implicit CG time") for n in names)
    assert any(n.startswith("Penalty") for n in names)
    acc = {c["name"]: c["test_acc"] for c in result["cleaning"]}
    assert all(0.0 <= a <= 1.0 for a in acc.values())
    assert acc["oracle (clean examples only)"] > acc["no cleaning (all weights 0.5)"]
    text = bench.render(result, tmp_path)
    assert (tmp_path / "hypergrad.md").read_text() == text
    assert (tmp_path / "hypergrad.json").exists()
    assert "## Targets" in text and "| Implicit CG |" in text


@pytest.mark.filterwarnings("ignore")
def test_memory_measurement_of_one_configuration(bench, tmp_path) -> None:
    """The worker's per-configuration measurement sees the stored graph, and checkpointing drops it.

    On a tanh MLP (64-64-64-10, batch 256, float32, K = 100) reverse unrolling keeps every step's
    activations and double-backward buffers (tens of MB); checkpoint=True keeps only the iterates
    and one step's graph. Measured as the benchmark does, one fresh process per configuration:
    an earlier in-process version on a ridge problem passed or failed with the allocator's state
    (its stored graph was smaller than the test assumed)."""
    K = 100
    spec = {"key": "mlp_w64", "label": "checkpoint_mem", "kind": "mlp", "width": 64, "batch": 256, "K": K,
            "maxiter": 10, "sigma": 1e-2, "inner_iters": 20}
    bench.build_bench(spec, tmp_path)  # fills the cache the worker reads
    configs = [{"id": group, "spec": spec, "cache": str(tmp_path), "mode": "tiny", "threads": 1,
                "group": group, "name": name, "K": K}
               for group, name in (("unrolled-reverse", f"Unrolled reverse (K={K})"),
                                   ("unrolled-checkpoint", f"Unrolled reverse, checkpoint=True (K={K})"))]
    out = bench.measure_memory(configs, 1, lambda _: None)
    rev, ck = out["unrolled-reverse"], out["unrolled-checkpoint"]
    assert math.isfinite(rev["peak_mb"]) and rev["seconds"] > 0.0
    assert rev["peak_mb"] > 20.0, out
    assert ck["peak_mb"] < 0.5 * rev["peak_mb"], out


@pytest.mark.filterwarnings("ignore")
def test_a_subset_of_problems_runs_and_renders(bench, tmp_path) -> None:
    """--problems 5: only the unroll-length sweep, with the recompute=False rows and targets."""
    from dataclasses import replace

    threads = torch.get_num_threads()
    try:
        result = bench.suite(replace(bench.TINY, problems=(5,)), threads=1, log=lambda _: None)
    finally:
        torch.set_num_threads(threads)
    assert {r.problem for r in result["rows"]} == {"ksweep_K10"}
    (stored,) = _rows(result, "ksweep_K10", "unrolled-stored", "hypergrad")
    assert stored.agree is not None and stored.agree == 0.0  # recompute changes no bit
    text = bench.render(result, tmp_path)
    assert "Unrolled reverse, recompute=False (K=10)" in text
    assert "same, Unrolled(recompute=False): time <= 1.0x higher (K=10)" in text


@pytest.mark.filterwarnings("ignore")
def test_recompute_lowers_the_stored_graph_memory(bench, tmp_path) -> None:
    """Unrolled(recompute=True), the default, and with recompute_min_bytes=0, against
    recompute=False on a tanh MLP (the ksweep problem's shape: 64-64-64-10, batch 256, float32,
    K = 100), peak RSS over the baseline as the benchmark measures it: in its worker, one fresh
    process per configuration, freed tensors returned to the system. Per step the default drops
    the 256 x 64 matrix product into the last hidden layer (64 KiB, saved once), and
    recompute_min_bytes=0 also the tanh backward output of that layer (64 KiB, saved twice), of
    about 460 KiB that the graph keeps per step; the stored graph (about 45 MB) dwarfs the
    allocator's noise."""
    K = 100
    spec = {"key": "mlp_w64", "label": "recompute_mem", "kind": "mlp", "width": 64, "batch": 256, "K": K,
            "maxiter": 10, "sigma": 1e-2, "inner_iters": 20}
    bench.build_bench(spec, tmp_path)
    configs = [{"id": group, "spec": spec, "cache": str(tmp_path), "mode": "tiny", "threads": 1,
                "group": group, "name": name, "K": K}
               for group, name in (("unrolled-stored", f"Unrolled reverse, recompute=False (K={K})"),
                                   ("unrolled-reverse", f"Unrolled reverse (K={K})"),
                                   ("unrolled-all", f"Unrolled reverse, recompute_min_bytes=0 (K={K})"))]
    out = bench.measure_memory(configs, 1, lambda _: None)
    off = out["unrolled-stored"]["peak_mb"]
    on, every = out["unrolled-reverse"]["peak_mb"], out["unrolled-all"]["peak_mb"]
    tensor_mb = K * 256 * 64 * 4 / 2**20  # one 256 x 64 float32 tensor per step: 6.25 MiB
    assert off > 30.0, out
    assert 0.8 * tensor_mb < off - on < 1.2 * tensor_mb, out
    assert 1.6 * tensor_mb < off - every < 2.4 * tensor_mb, out


@pytest.fixture(scope="module")
def imaml_tiny(bench):
    sizes = bench.IMAMLSizes("tiny", meta_steps=3, meta_batch=3, shots=5, width=8, test_tasks=4,
                             timing_steps=1, seeds=3)
    threads = torch.get_num_threads()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return bench.imaml_suite(sizes, log=lambda _: None)
    finally:
        torch.set_num_threads(threads)


def test_imaml_methods_agree_and_float64_trajectories_coincide(bench, imaml_tiny) -> None:
    """The batched iMAML section: the three methods compute the same meta-gradient (float32
    round-off, float64 to 1e-10), and meta-trained side by side in float64 on one task stream
    their thetas and final meta-test losses coincide (they would not if each method drew its own
    meta-batches)."""
    result = imaml_tiny
    sizes = result["sizes"]
    t32 = {r["name"]: r for r in result["timing"]["float32"]}
    t64 = {r["name"]: r for r in result["timing"]["float64"]}
    assert t32[bench.IMAML_BATCHED]["agree"] == 0.0 and t64[bench.IMAML_BATCHED]["agree"] == 0.0
    for name in (bench.IMAML_LOOP, bench.IMAML_TORCHOPT):
        assert t32[name]["agree"] < 1e-3, (name, t32[name]["agree"])
        assert t64[name]["agree"] < 1e-10, (name, t64[name]["agree"])
    for r in [*t32.values(), *t64.values()]:
        assert r["tasks_per_s"] == pytest.approx(sizes.meta_batch / r["step_s"])
    traj = result["trajectory"]
    assert traj["names"] == result["names"][:3]
    assert all(len(d) == sizes.meta_steps for d in traj["drift"])
    assert traj["drift"][0] == [0.0] * sizes.meta_steps
    assert max(max(d) for d in traj["drift"]) < 1e-10, traj["drift"]
    ref = traj["meta_test_loss"][0]
    assert math.isfinite(ref) and ref > 0
    assert traj["meta_test_loss"] == pytest.approx([ref] * 3, rel=1e-9)
    # float32 seeds: the null control starts perturbed, the other methods from theta0 itself
    for s in result["seeds"]:
        assert len(s["meta_test_loss"]) == 4 and all(x > 0 for x in s["meta_test_loss"])
        assert s["drift_max"][0] == 0.0 and s["drift_max"][3] > 0.1 * sizes.perturb
        assert s["drift_max"][1] < 1e-3 and s["drift_max"][2] < 1e-3


def _with_losses(result, losses):
    out = copy.deepcopy(result)
    for s, v in zip(out["seeds"], losses, strict=True):
        s["meta_test_loss"] = list(v)
    return out


def _table(section: str) -> dict[str, list[str]]:
    rows = {}
    for line in section.splitlines():
        if line.startswith("| ") and not line.startswith("|---"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            rows[cells[0]] = cells[1:]
    return rows


@pytest.mark.parametrize("synthetic", [False, True])
def test_imaml_report_recomputes_the_seed_statistics(bench, imaml_tiny, tmp_path, synthetic) -> None:
    """The report's means, sds and 95% intervals are those of the per-seed values it lists
    (recomputed here with scipy's t quantile), and its verdict follows the interval; on the tiny
    run itself and on made-up per-seed losses of the size full runs give (spread ~0.3, the
    torchopt interval excluding 0)."""
    stats_t = pytest.importorskip("scipy.stats")
    result = imaml_tiny
    if synthetic:
        result = _with_losses(result, [(1.65, 2.41, 2.62, 1.88), (1.90, 1.70, 2.95, 1.61),
                                       (2.20, 2.35, 3.18, 2.31)])
    text = bench.render_imaml(result, tmp_path, "python benchmarks/hypergrad_bench.py --imaml")
    assert (tmp_path / "hypergrad_imaml.md").read_text() == text
    seeds_part, diffs_part = text.split("## float32 final meta-test MSE")[1].split("Paired differences")
    seed_rows, diff_rows = _table(seeds_part), _table(diffs_part)
    names = result["names"]
    values = {name: [s["meta_test_loss"][i] for s in result["seeds"]] for i, name in enumerate(names)}
    n = len(result["seeds"])
    t = float(stats_t.t.ppf(0.975, n - 1))

    def close(cell: str, x: float) -> bool:  # 4 decimals; the report's t quantile has 4 decimals too
        return abs(float(cell) - x) <= 2e-4 + 1e-4 * abs(x)

    for name, v in values.items():
        mean = sum(v) / n
        sd = math.sqrt(sum((x - mean) ** 2 for x in v) / (n - 1))
        cells = seed_rows[name]
        assert all(close(c, x) for c, x in zip(cells[:n], v, strict=True)), (name, cells, v)
        assert close(cells[n], mean) and close(cells[n + 1], sd), (name, cells, mean, sd)
    verdicts = {}
    for name in names[1:]:
        d = [a - b for a, b in zip(values[names[0]], values[name], strict=True)]
        mean = sum(d) / n
        sd = math.sqrt(sum((x - mean) ** 2 for x in d) / (n - 1))
        lo, hi = mean - t * sd / math.sqrt(n), mean + t * sd / math.sqrt(n)
        cells = diff_rows[name]
        assert all(close(c, x) for c, x in zip(cells[:n], d, strict=True)), (name, cells, d)
        assert close(cells[n], mean) and close(cells[n + 1], sd), (name, cells, mean, sd)
        lo_c, hi_c = cells[n + 2].strip("[]").split(",")
        assert close(lo_c, lo) and close(hi_c, hi), (name, cells, lo, hi)
        verdicts[name] = lo <= 0 <= hi
        assert cells[n + 3] == ("yes" if verdicts[name] else "no"), (name, cells)
    # exploratory row: the per-seed mean of the three hypergrad-estimator runs minus torchopt
    names_ = (bench.IMAML_BATCHED, bench.IMAML_LOOP, bench.IMAML_CONTROL)
    d = [sum(values[k][j] for k in names_) / 3 - values[bench.IMAML_TORCHOPT][j] for j in range(n)]
    mean = sum(d) / n
    sd = math.sqrt(sum((x - mean) ** 2 for x in d) / (n - 1))
    lo, hi = mean - t * sd / math.sqrt(n), mean + t * sd / math.sqrt(n)
    cells = next(v for k, v in diff_rows.items() if k.startswith("(exploratory)"))
    assert all(close(c, x) for c, x in zip(cells[:n], d, strict=True)), (cells, d)
    assert close(cells[n], mean) and close(cells[n + 1], sd), (cells, mean, sd)
    lo_c, hi_c = cells[n + 2].strip("[]").split(",")
    assert close(lo_c, lo) and close(hi_c, hi), (cells, lo, hi)
    peer = verdicts[bench.IMAML_TORCHOPT]
    assert f"which {'contains' if peer else 'does not contain'} 0" in text
    if synthetic:
        assert not peer and verdicts[bench.IMAML_CONTROL]
        assert "equal meta-test loss is **not established**" in text
    t32 = {r["name"]: r for r in result["timing"]["float32"]}
    ratio = t32[bench.IMAML_BATCHED]["tasks_per_s"] / t32[bench.IMAML_TORCHOPT]["tasks_per_s"]
    assert f"= {ratio:.1f}x the tasks per second in float32" in text


def test_t_interval_quantiles_and_bad_input(bench) -> None:
    stats_t = pytest.importorskip("scipy.stats")
    for df, q in enumerate(bench.T975, start=1):
        assert q == pytest.approx(float(stats_t.t.ppf(0.975, df)), abs=1e-4), df
    ci = bench.t_interval([1.0, 2.0, 3.0, 4.0])
    assert ci["mean"] == 2.5 and ci["sd"] == pytest.approx(math.sqrt(5 / 3))
    assert ci["half"] == pytest.approx(float(stats_t.t.ppf(0.975, 3)) * math.sqrt(5 / 3) / 2, rel=1e-4)
    with pytest.raises(ValueError, match="values: 2 to 31"):
        bench.t_interval([1.0])
    with pytest.raises(ValueError, match=r"IMAMLSizes\.seeds"):
        bench.imaml_suite(bench.IMAMLSizes("bad", seeds=1), log=lambda _: None)


def test_imaml_verdict_follows_both_criteria(bench, imaml_tiny) -> None:
    """The conclusion line applies the stated criteria: float64 trajectories together (theta
    difference < 1e-6, final MSEs to 4 digits) and a float32 interval containing 0 give "equal";
    a float64 separation (and the meta-step where it starts) gives "not exact"; an interval
    excluding 0 gives "not established"."""
    contains = [(1.65, 2.41, 2.62, 1.88), (1.90, 1.70, 2.05, 1.61), (2.20, 2.35, 1.98, 2.31)]
    excludes = [(1.65, 2.41, 2.62, 1.88), (1.90, 1.70, 2.95, 1.61), (2.20, 2.35, 3.18, 2.31)]
    steps = imaml_tiny["sizes"].meta_steps
    together = _with_losses(imaml_tiny, contains)
    together["trajectory"]["drift"] = [[0.0] * steps, [1e-15] * steps, [1e-12] * steps]
    together["trajectory"]["meta_test_loss"] = [2.0, 2.0, 2.00001]
    text = bench.render_imaml(together, None, "x")
    assert "the trajectories stay together" in text
    assert "equal meta-test loss is **equal** by both criteria" in text
    apart = copy.deepcopy(together)
    apart["trajectory"]["drift"][2] = [1e-12, 3e-3, 5e-2][:steps]
    text = bench.render_imaml(apart, None, "x")
    assert "the trajectories separate" in text and "above 1e-6 from meta-step 2 (torchopt)" in text
    assert "equal meta-test loss is **not exact**" in text
    row = next(line for line in text.splitlines() if line.startswith(f"| {bench.IMAML_TORCHOPT} | 1.0e-12"))
    assert "| 5.0e-02 | 2 |" in row, row
    off = copy.deepcopy(together)
    off["trajectory"]["meta_test_loss"] = [2.0, 2.0, 2.001]  # 5e-4 apart: not 4 digits
    assert "equal meta-test loss is **not exact**" in bench.render_imaml(off, None, "x")
    worse = _with_losses(together, excludes)
    assert "equal meta-test loss is **not established**" in bench.render_imaml(worse, None, "x")


def test_imaml_render_from_json_reproduces_the_report(bench, imaml_tiny, tmp_path) -> None:
    """`--imaml --render hypergrad_imaml.json` (the raw numbers the full run writes) gives the
    same report as rendering the in-memory result."""
    import json
    from dataclasses import asdict

    command = "python benchmarks/hypergrad_bench.py --imaml"
    raw = {**imaml_tiny, "sizes": asdict(imaml_tiny["sizes"]), "command": command}
    (tmp_path / "hypergrad_imaml.json").write_text(json.dumps(raw))
    out = tmp_path / "again"
    threads = torch.get_num_threads()
    try:
        assert bench.main(["--imaml", "--render", str(tmp_path / "hypergrad_imaml.json"), "--out", str(out)]) == 0
    finally:
        torch.set_num_threads(threads)
    assert (out / "hypergrad_imaml.md").read_text() == bench.render_imaml(imaml_tiny, None, command)
