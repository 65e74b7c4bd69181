"""The public training loop (llm_calib.calm.training): it is what calibrate runs, the unlabelled
upper-level inputs reach f (and only f), the confidence penalty takes its entropy on them, and
the per-step records hold independently checkable values."""

from __future__ import annotations

import copy
import dataclasses
import warnings

import numpy as np
import pytest
import torch
from _benchmarks import BENCHMARKS  # noqa: F401  (puts benchmarks/ on sys.path for harness)
from _configs import configured
from _faults import nan_inner_loss_from_batch
from harness.selection import best_candidate

from llm_calib.calm import training
from llm_calib.calm.encoding import encode_records
from llm_calib.calm.run import resolve_run, task_format, theta_optimizer
from llm_calib.calm.trainer import calibrate
from llm_calib.config.calibration import CalibrationConfig, LoraSettings
from llm_calib.data import load as load_data
from llm_calib.models import tiny_random_model
from llm_calib.prompts.resolution import resolve_prompt_settings
from llm_calib.prompts.templates import PromptFormat
from llm_calib.scoring import score_option_likelihood


@pytest.fixture(scope="module")
def data():
    train = load_data("builtin:arithmetic,capitals:n=8").records
    heldout = load_data("builtin:arithmetic,capitals:n=4,seed=1").records
    unlabeled = load_data("builtin:chemical_symbols,calendar:n=6,seed=5").records
    return train, heldout, unlabeled


BASE = {"objective": {"name": "calm", "lam_lr": 1e-1, "adjustment": "vector",
                      "solver": {"name": "bome", "inner_steps": 1, "barrier": "value"}},
        "training": {"steps": 4, "batch_size": 4, "heldout_batch_size": 4, "lr": 1e-2},
        "selection": {"eval_every": 2, "guard_accuracy": 0.0}, "lora": LoraSettings(rank=2, layers=(1,))}


def _cfg(**kw) -> CalibrationConfig:
    return configured(BASE, **kw)


def _inner_lr(cfg: CalibrationConfig, lr: float) -> CalibrationConfig:
    solver = dataclasses.replace(cfg.objective.solver, inner_lr=lr)
    return dataclasses.replace(cfg, objective=dataclasses.replace(cfg.objective, solver=solver))


def _model():
    return tiny_random_model(seed=0, init_std=0.1)[0]


@pytest.fixture(scope="module")
def tok():
    return tiny_random_model(seed=0, init_std=0.1)[1]


def _final(result) -> dict[str, torch.Tensor]:
    theta = {n: p.detach().clone() for n, p in result.model.named_parameters() if "lora_" in n or "modules_to_save" in n}
    return {**theta, **{f"lam/{k}": v.detach().clone() for k, v in result.lam.items()}}


def _assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert set(a) == set(b)
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("method", ["calm", "confidence_penalty"])
def test_the_public_loop_is_what_calibrate_runs(data, tok, method):
    train, heldout, _ = data
    cfg = _cfg(objective=dict(name=method))
    result = calibrate(_model(), tok, train, heldout, cfg, progress=False)

    trainer = training.build_trainer(_model(), tok, train, heldout, resolve_run(cfg, train, heldout))
    state = training.init_state(trainer)
    while not training.done(trainer, state):
        record = training.train_step(trainer, state)
        if training.evaluation_due(trainer, state.step):
            record.update(training.select(trainer, state, training.evaluate(trainer, state.theta)))
        state.history.append(record)
    after = training.evaluate(trainer, state.best_theta)
    assert state.history == result.history
    assert after["ece"] == result.metrics["after"]["ece"] and state.best["step"] == result.metrics["after"]["selected_step"]
    mine = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_" in n or "modules_to_save" in n}
    _assert_same({**mine, **{f"lam/{k}": v for k, v in state.best_lam.items()}}, _final(result))


def _mc_stats(model, tok, records):
    """Mean NLL of gold and mean entropy of the option distribution, by the evaluation scorer
    (length-normalised scores: the tiny model's summed scores are so far apart that the entropy
    is ~1e-4, where float32 rounding of the scores dominates its relative error)."""
    scored = score_option_likelihood(model, tok, records, normalize="mean", prompt=PromptFormat(style="cloze"))
    probs = [p.astype(np.float64) for p in scored.probs_numpy]
    nll = np.mean([-np.log(p[r.gold]) for p, r in zip(probs, records, strict=True)])
    ent = np.mean([-(p * np.log(p)).sum() for p in probs])
    return nll, ent


def test_step_records_hold_g_and_the_unlabelled_entropy(data, tok):
    """Step 1 starts from the base model (LoRA B = 0) and λ = identity: g is the plain CE of the
    training batch and the recorded entropy the base model's on the unlabelled batch, both
    computed here by the evaluation scorer on the same records."""
    train, heldout, unlabeled = data
    trainer = training.build_trainer(_model(), tok, train, heldout, resolve_run(_cfg(prompt=dict(normalize="mean")), train, heldout, unlabeled), unlabeled=unlabeled)
    inner_ids, outer_ids = trainer.train_batch(0).ids, trainer.unlabeled_batch(0).ids
    state = training.init_state(trainer)
    record = training.train_step(trainer, state)
    base = _model()
    by_id = {r.id: r for r in [*train, *unlabeled]}
    nll, _ = _mc_stats(base, tok, [by_id[i] for i in inner_ids])
    _, ent = _mc_stats(base, tok, [by_id[i] for i in outer_ids])
    assert set(outer_ids) <= {r.id for r in unlabeled}
    assert record["g"] == pytest.approx(nll, rel=1e-5)
    assert ent > 0.1 and record["unlabeled_entropy"] == pytest.approx(ent, rel=1e-5)
    assert {"phi", "q", "grad_q_norm"} <= set(record)
    for name, value in state.objective_state.lam.items():  # λ summaries of the λ after the step, every step
        assert float(value.detach().abs().max()) > 0
        assert record[f"lambda_{name}_absmax"] == pytest.approx(float(value.detach().abs().max()), rel=1e-6)
    record2 = training.train_step(trainer, state)
    assert record2["step"] == 2 and "lambda_b_mean" in record2


def test_unlabeled_inputs_drive_f_and_their_labels_are_ignored(data, tok):
    train, heldout, unlabeled = data
    cfg = _cfg()
    default = calibrate(_model(), tok, train, heldout, cfg, progress=False)
    # the held-out inputs given explicitly (a separate encoding): the same run
    explicit = calibrate(_model(), tok, train, heldout, cfg, unlabeled=list(heldout), progress=False)
    _assert_same(_final(default), _final(explicit))
    # other inputs: f sees them, the run changes; selection still uses the held-out set
    other = calibrate(_model(), tok, train, heldout, cfg, unlabeled=unlabeled, progress=False)
    assert other.metrics["before"] == default.metrics["before"]
    assert not torch.equal(other.lam["b"], default.lam["b"])
    # the unlabelled records' labels play no part
    relabelled = [dataclasses.replace(r, gold=(r.gold + 1) % len(r.options)) for r in unlabeled]
    again = calibrate(_model(), tok, train, heldout, cfg, unlabeled=relabelled, progress=False)
    _assert_same(_final(other), _final(again))
    assert [h.get("unlabeled_entropy") for h in other.history] == [h.get("unlabeled_entropy") for h in again.history]


def test_confidence_penalty_takes_its_entropy_on_the_unlabelled_batch(data, tok):
    """loss = CE(training batch) - β·H(unlabelled batch) at step 1, from an independent computation."""
    train, heldout, unlabeled = data
    beta = 0.7
    trainer = training.build_trainer(_model(), tok, train, heldout, resolve_run(_cfg(objective=dict(name="confidence_penalty", beta=beta), prompt=dict(normalize="mean")), train, heldout, unlabeled),
                                     unlabeled=unlabeled)
    inner_ids, outer_ids = trainer.train_batch(0).ids, trainer.unlabeled_batch(0).ids
    assert not set(inner_ids) & set(outer_ids)
    state = training.init_state(trainer)
    record = training.train_step(trainer, state)
    base = _model()
    by_id = {r.id: r for r in [*train, *unlabeled]}
    nll, _ = _mc_stats(base, tok, [by_id[i] for i in inner_ids])
    _, ent = _mc_stats(base, tok, [by_id[i] for i in outer_ids])
    assert record["ce"] == pytest.approx(nll, rel=1e-5)
    assert ent > 0.1 and record["unlabeled_entropy"] == pytest.approx(ent, rel=1e-5)
    assert record["loss"] == pytest.approx(nll - beta * ent, rel=1e-5)


def test_f2sa_steps_with_inner_lr_and_defaults_to_lr(data, tok):
    train, heldout, _ = data
    cfg = _cfg(objective=dict(solver=dict(name="f2sa")), training=dict(steps=2), selection=dict(eval_every=1))
    assert cfg.objective.solver.build(theta_optimizer(cfg.lora, cfg.training.lr)).inner_optimizer.lr == cfg.training.lr  # default: θ's rate, as before inner_lr was read
    fast = _inner_lr(cfg, 0.05)
    assert fast.objective.solver.build(theta_optimizer(fast.lora, fast.training.lr)).inner_optimizer.lr == 0.05
    default = calibrate(_model(), tok, train, heldout, cfg, progress=False)
    same = calibrate(_model(), tok, train, heldout, _inner_lr(cfg, cfg.training.lr), progress=False)
    _assert_same(_final(default), _final(same))
    faster = calibrate(_model(), tok, train, heldout, _inner_lr(cfg, 10 * cfg.training.lr), progress=False)
    assert not torch.equal(faster.lam["b"], default.lam["b"])


def test_an_encoding_is_reused_with_its_trunk_cache(data, tok):
    train, heldout, _ = data
    cfg = _cfg(objective=dict(name="lora_ce"))
    enc_train, enc_held = encode_records(tok, train, task_format(train, resolve_prompt_settings(cfg.prompt))), encode_records(tok, heldout, task_format(heldout, resolve_prompt_settings(cfg.prompt)))
    first = calibrate(_model(), tok, enc_train, enc_held, cfg, progress=False)
    assert len(enc_train.trunk_cache) == len(train) and len(enc_held.trunk_cache) == len(heldout)
    cached = {i: v.clone() for i, v in enc_train.trunk_cache.items()}
    second = calibrate(_model(), tok, enc_train, enc_held, dataclasses.replace(cfg, seed=1), progress=False)
    assert all(torch.equal(enc_train.trunk_cache[i], v) for i, v in cached.items())
    fresh = calibrate(_model(), tok, train, heldout, dataclasses.replace(cfg, seed=1), progress=False)
    _assert_same(_final(second), _final(fresh))
    _assert_same(_final(first), _final(calibrate(_model(), tok, train, heldout, cfg, progress=False)))


def test_unlabeled_of_another_kind_is_rejected(data, tok):
    from llm_calib.data import OpenQA

    train, heldout, _ = data
    with pytest.raises(ValueError, match="unlabeled"):
        training.build_trainer(_model(), tok, train, heldout, resolve_run(_cfg(), train, heldout, [OpenQA("q?", ("a",), "d", "o1")]), unlabeled=[OpenQA("q?", ("a",), "d", "o1")])


def test_is_selectable_is_the_guard_of_select(data, tok):
    cfg = _cfg(selection=dict(guard_accuracy=0.9))
    assert training.is_selectable(0.9, 1.0, cfg.selection) and not training.is_selectable(0.899, 1.0, cfg.selection)
    train, heldout, _ = data
    trainer = training.build_trainer(_model(), tok, train, heldout, resolve_run(cfg, train, heldout))
    state = training.init_state(trainer)
    state.before = {**state.before, "accuracy": 1.0}
    training.select(trainer, state, {"accuracy": 0.95, "ece": state.before["ece"] - 0.1})
    assert state.best["step"] == 0 and state.best["ece"] == pytest.approx(state.before["ece"] - 0.1)
    assert copy.deepcopy(state.best)["violations"] == 0
    training.select(trainer, state, {"accuracy": 0.5, "ece": 0.0})  # below the floor: not selected
    assert state.best["ece"] == pytest.approx(state.before["ece"] - 0.1) and state.best["violations"] == 1


def test_best_candidate_is_the_selection_rule_over_a_grid() -> None:
    cfg = CalibrationConfig(selection=dict(guard_accuracy=0.9))
    rows = [{"accuracy": 0.60, "ece": 0.20}, {"accuracy": 0.40, "ece": 0.01}, {"accuracy": 0.54, "ece": 0.05},
            {"accuracy": 0.55, "ece": 0.05}]
    assert best_candidate(rows, 0.6, cfg) == 2  # lowest ECE above 0.54, first on ties
    assert best_candidate(rows, 0.6, dataclasses.replace(cfg, selection=dataclasses.replace(cfg.selection, guard_accuracy=0.95))) == 0
    assert best_candidate(rows[1:2], 0.6, cfg) == 0 and best_candidate(rows, 0.9, cfg) == 0
    with pytest.raises(ValueError, match="at least one candidate"):
        best_candidate([], 0.5, cfg)


def test_fill_trunk_caches_and_the_encoding_cache() -> None:
    from llm_calib.calm.encoding import EncodingCache

    model, tok = tiny_random_model(seed=0, num_layers=2)
    qs = load_data("builtin:capitals:n=6").records
    cache, cfg = EncodingCache(), CalibrationConfig(lora=LoraSettings(rank=2, layers=(1,)))

    def run(config):
        return resolve_run(config, qs, qs)

    train = cache(tok, qs, run(cfg))
    assert cache(tok, list(qs), run(dataclasses.replace(cfg, training=dataclasses.replace(cfg.training, lr=0.5), seed=3))) is train  # settings that do not encode
    assert cache(tok, qs, run(dataclasses.replace(cfg, prompt=dataclasses.replace(cfg.prompt, style="listed")))) is not train
    assert cache(tok, qs, run(dataclasses.replace(cfg, lora=LoraSettings(rank=2, layers=(0, 1))))) is not train
    assert cache(tok, qs[:4], run(cfg)) is not train and len(cache.encodings) == 4
    tr = training.build_trainer(copy.deepcopy(model), tok, train, cache(tok, qs[:4], run(cfg)), resolve_run(cfg, train, cache(tok, qs[:4], run(cfg))))
    assert tr.fill_trunk_caches() == 10 and len(train.trunk_cache) == 6
    ref = tr.lm.trunk_hidden(train.pack([2], tok.pad_token_id))[0, : train.length(2)]
    torch.testing.assert_close(train.trunk_cache[2], ref)
    everywhere = training.build_trainer(copy.deepcopy(model), tok, qs, qs, resolve_run(CalibrationConfig(lora=LoraSettings(rank=2)), qs, qs))
    assert everywhere.fill_trunk_caches() == 0  # no trunk below LoRA on every layer


def test_a_small_heldout_split_warns_that_the_guard_is_noise(data, tok):
    train, heldout, _ = data
    with pytest.warns(UserWarning, match=r"8 held-out questions.*at least 500"):
        training.build_trainer(_model(), tok, train, heldout, resolve_run(_cfg(selection=dict(guard_accuracy=0.95)), train, heldout))
    # no guard, no warning; 500 questions, no warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        training.build_trainer(_model(), tok, train, heldout, resolve_run(_cfg(selection=dict(guard_accuracy=0.0)), train, heldout))
        assert not training.warn_small_heldout(training.MIN_GUARD_QUESTIONS, CalibrationConfig().selection)
    with pytest.warns(UserWarning, match="standard error of up to 0.022"):
        assert training.warn_small_heldout(499, CalibrationConfig().selection)


# ---------------------------------------------------------------------------------------------
# The step without host reads: same run, one read per log, divergence still named by its step


class _HostReads(torch.overrides.TorchFunctionMode):
    """Reads of tensor values by the host, by the file that asked."""

    def __init__(self) -> None:
        super().__init__()
        self.files: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in ("__bool__", "__float__", "__int__", "item", "tolist", "numpy"):
            import traceback

            self.files.append(traceback.extract_stack(limit=2)[0].filename)
        return func(*args, **(kwargs or {}))


def _per_leaf_reference(monkeypatch) -> None:
    """The step as it was before the hot path: per-leaf tree operations and optimizer updates, the
    solvers' numbers read back (and checked) inside each step, every step read back at once."""
    import hypergrad.inner
    import hypergrad.tree
    from llm_calib.objectives.calm import F2SA, Bome

    monkeypatch.setattr(hypergrad.tree, "supports_foreach", lambda tensors: False)
    monkeypatch.setattr(hypergrad.inner, "supports_foreach", lambda tensors: False)
    for cls in (Bome, F2SA):
        build = cls.build
        monkeypatch.setattr(cls, "build", lambda self, opt, build=build: dataclasses.replace(build(self, opt),
                                                                                             device_scalars=False))


@pytest.mark.parametrize("solver", ["bome", "f2sa"])
def test_the_fast_step_computes_the_run_of_the_per_leaf_step(data, tok, tmp_path, monkeypatch, solver):
    """foreach operations, device scalars and deferred reads change no number of a run beyond float32
    round-off (the per-leaf dot products sum in another order): θ, λ and the history agree to 1e-6."""
    from llm_calib.files.checkpoint import latest_checkpoint, load_checkpoint

    train, heldout, _ = data
    cfg = _cfg(objective={"solver": {"name": solver, "inner_steps": 3}}, training={"steps": 6, "log_every": 4},
               checkpoint_every=6)

    def run(out):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            result = calibrate(_model(), tok, train, heldout, cfg, checkpoint_dir=out, progress=False)
        return result.history, load_checkpoint(latest_checkpoint(out))[0]

    fast_history, fast = run(tmp_path / "fast")
    with monkeypatch.context() as m:
        _per_leaf_reference(m)
        slow_history, slow = run(tmp_path / "slow")
    assert fast.keys() == slow.keys() and any(k.startswith("lam/") for k in fast)
    for k in fast:
        torch.testing.assert_close(fast[k], slow[k], rtol=0, atol=1e-6, msg=k)
    assert [r.keys() for r in fast_history] == [r.keys() for r in slow_history]
    assert all(isinstance(v, (int, float)) for r in fast_history for v in r.values())
    for a, b in zip(fast_history, slow_history, strict=True):
        for k in a:
            assert a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-6), (a["step"], k)
    assert any(r.get("heldout_ece") is not None for r in fast_history)


@pytest.mark.parametrize("objective", [{"name": "lora_ce"}, {}])
def test_a_step_reads_nothing_back_and_read_back_reads_once(data, tok, objective):
    train, heldout, _ = data
    trainer = training.build_trainer(_model(), tok, train, heldout, resolve_run(_cfg(objective=objective), train, heldout))
    state = training.init_state(trainer, evaluate_before=False)
    training.train_step(trainer, state)  # the first step builds what later steps reuse
    reads = _HostReads()
    with reads:
        records = [training.train_step(trainer, state, read=False) for _ in range(3)]
    # the batch order (a seeded permutation of indices, on the CPU) and torch.optim.Adam's CPU step
    # counter for λ are host values: no device is waited on. Nothing else is read.
    assert {f.rsplit("/", 2)[-1] for f in reads.files} <= {"batch_order.py", "optimizer.py"}, reads.files
    assert all(isinstance(r["g" if "g" in r else "loss"], torch.Tensor) for r in records)
    assert len(state.unread) == 3
    reads = _HostReads()
    with reads:
        training.read_back(state)
    assert len(reads.files) == 1 and not state.unread
    assert all(isinstance(v, (int, float)) for r in records for v in r.values())
    assert "solver_step_finite" not in records[0]


def test_a_non_finite_step_is_named_by_its_own_step_when_read_later(data, tok, tmp_path, monkeypatch):
    """NaN from step 3 on, read at step 5 (log_every) with a checkpoint due at step 4: the checkpoint
    is not written (it reads first) and the error names step 3 and its batch."""
    from llm_calib.files.checkpoint import latest_checkpoint

    train, heldout, _ = data
    seen = nan_inner_loss_from_batch(monkeypatch, 3)
    cfg = _cfg(training={"steps": 6, "log_every": 5}, selection={"eval_every": 100}, checkpoint_every=4)
    with pytest.raises(training.TrainingDiverged) as info:
        calibrate(_model(), tok, train, heldout, cfg, checkpoint_dir=tmp_path / "ckpt", progress=False)
    assert str(info.value).startswith("step 3: g is nan") and f"batch ids {seen[2].ids[:8]}" in str(info.value)
    assert latest_checkpoint(tmp_path / "ckpt") is None
    assert isinstance(info.value.__cause__, FloatingPointError)
