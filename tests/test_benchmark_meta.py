"""The batched iMAML comparison (benchmarks/hg_meta.py, ``hypergrad_bench.py --imaml``) on tiny
sizes: the methods agree, the report's statistics and verdicts follow its numbers."""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
from _benchmarks import load_benchmark

pytest.importorskip("torchopt")
pytest.importorskip("higher")


@pytest.fixture(scope="module")
def meta():
    return load_benchmark("hg_meta")


@pytest.fixture(scope="module")
def imaml_tiny(meta):
    sizes = meta.IMAMLSizes("tiny", meta_steps=3, meta_batch=3, shots=5, width=8, test_tasks=4,
                             timing_steps=1, seeds=3)
    threads = torch.get_num_threads()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return meta.imaml_suite(sizes, log=lambda _: None)
    finally:
        torch.set_num_threads(threads)


def test_imaml_methods_agree_and_float64_trajectories_coincide(meta, imaml_tiny) -> None:
    """The batched iMAML section: the three methods compute the same meta-gradient (float32
    round-off, float64 to 1e-10), and meta-trained side by side in float64 on one task stream
    their thetas and final meta-test losses coincide (they would not if each method drew its own
    meta-batches)."""
    result = imaml_tiny
    sizes = result["sizes"]
    t32 = {r["name"]: r for r in result["timing"]["float32"]}
    t64 = {r["name"]: r for r in result["timing"]["float64"]}
    assert t32[meta.IMAML_BATCHED]["agree"] == 0.0 and t64[meta.IMAML_BATCHED]["agree"] == 0.0
    for name in (meta.IMAML_LOOP, meta.IMAML_TORCHOPT):
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
def test_imaml_report_recomputes_the_seed_statistics(meta, imaml_tiny, tmp_path, synthetic) -> None:
    """The report's means, sds and 95% intervals are those of the per-seed values it lists
    (recomputed here with scipy's t quantile), and its verdict follows the interval; on the tiny
    run itself and on made-up per-seed losses of the size full runs give (spread ~0.3, the
    torchopt interval excluding 0)."""
    stats_t = pytest.importorskip("scipy.stats")
    result = imaml_tiny
    if synthetic:
        result = _with_losses(result, [(1.65, 2.41, 2.62, 1.88), (1.90, 1.70, 2.95, 1.61),
                                       (2.20, 2.35, 3.18, 2.31)])
    text = meta.render_imaml(result, tmp_path, "python benchmarks/hypergrad_bench.py --imaml")
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
    names_ = (meta.IMAML_BATCHED, meta.IMAML_LOOP, meta.IMAML_CONTROL)
    d = [sum(values[k][j] for k in names_) / 3 - values[meta.IMAML_TORCHOPT][j] for j in range(n)]
    mean = sum(d) / n
    sd = math.sqrt(sum((x - mean) ** 2 for x in d) / (n - 1))
    lo, hi = mean - t * sd / math.sqrt(n), mean + t * sd / math.sqrt(n)
    cells = next(v for k, v in diff_rows.items() if k.startswith("(exploratory)"))
    assert all(close(c, x) for c, x in zip(cells[:n], d, strict=True)), (cells, d)
    assert close(cells[n], mean) and close(cells[n + 1], sd), (cells, mean, sd)
    lo_c, hi_c = cells[n + 2].strip("[]").split(",")
    assert close(lo_c, lo) and close(hi_c, hi), (cells, lo, hi)
    peer = verdicts[meta.IMAML_TORCHOPT]
    assert f"which {'contains' if peer else 'does not contain'} 0" in text
    if synthetic:
        assert not peer and verdicts[meta.IMAML_CONTROL]
        assert "equal meta-test loss is **not established**" in text
    t32 = {r["name"]: r for r in result["timing"]["float32"]}
    ratio = t32[meta.IMAML_BATCHED]["tasks_per_s"] / t32[meta.IMAML_TORCHOPT]["tasks_per_s"]
    assert f"= {ratio:.1f}x the tasks per second in float32" in text


def test_t_interval_quantiles_and_bad_input(meta) -> None:
    stats_t = pytest.importorskip("scipy.stats")
    for df, q in enumerate(meta.T975, start=1):
        assert q == pytest.approx(float(stats_t.t.ppf(0.975, df)), abs=1e-4), df
    ci = meta.t_interval([1.0, 2.0, 3.0, 4.0])
    assert ci["mean"] == 2.5 and ci["sd"] == pytest.approx(math.sqrt(5 / 3))
    assert ci["half"] == pytest.approx(float(stats_t.t.ppf(0.975, 3)) * math.sqrt(5 / 3) / 2, rel=1e-4)
    with pytest.raises(ValueError, match="values: 2 to 31"):
        meta.t_interval([1.0])
    with pytest.raises(ValueError, match=r"IMAMLSizes\.seeds"):
        meta.imaml_suite(meta.IMAMLSizes("bad", seeds=1), log=lambda _: None)


def test_imaml_verdict_follows_both_criteria(meta, imaml_tiny) -> None:
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
    text = meta.render_imaml(together, None, "x")
    assert "the trajectories stay together" in text
    assert "equal meta-test loss is **equal** by both criteria" in text
    apart = copy.deepcopy(together)
    apart["trajectory"]["drift"][2] = [1e-12, 3e-3, 5e-2][:steps]
    text = meta.render_imaml(apart, None, "x")
    assert "the trajectories separate" in text and "above 1e-6 from meta-step 2 (torchopt)" in text
    assert "equal meta-test loss is **not exact**" in text
    row = next(line for line in text.splitlines() if line.startswith(f"| {meta.IMAML_TORCHOPT} | 1.0e-12"))
    assert "| 5.0e-02 | 2 |" in row, row
    off = copy.deepcopy(together)
    off["trajectory"]["meta_test_loss"] = [2.0, 2.0, 2.001]  # 5e-4 apart: not 4 digits
    assert "equal meta-test loss is **not exact**" in meta.render_imaml(off, None, "x")
    worse = _with_losses(together, excludes)
    assert "equal meta-test loss is **not established**" in meta.render_imaml(worse, None, "x")


@pytest.mark.parametrize(("script", "flags"), [("hypergrad_bench", ["--imaml"]), ("hg_meta", [])])
def test_imaml_render_from_json_reproduces_the_report(imaml_tiny, tmp_path, script, flags) -> None:
    """`--imaml --render hypergrad_imaml.json` (the raw numbers the full run writes), and
    `hg_meta.py --render` alike, give the same report as rendering the in-memory result."""
    import json
    from dataclasses import asdict

    meta, entry = load_benchmark("hg_meta"), load_benchmark(script)
    command = "python benchmarks/hypergrad_bench.py --imaml"
    raw = {**imaml_tiny, "sizes": asdict(imaml_tiny["sizes"]), "command": command}
    (tmp_path / "hypergrad_imaml.json").write_text(json.dumps(raw))
    out = tmp_path / "again"
    threads = torch.get_num_threads()
    try:
        assert entry.main([*flags, "--render", str(tmp_path / "hypergrad_imaml.json"), "--out", str(out)]) == 0
    finally:
        torch.set_num_threads(threads)
    assert (out / "hypergrad_imaml.md").read_text() == meta.render_imaml(imaml_tiny, None, command)
