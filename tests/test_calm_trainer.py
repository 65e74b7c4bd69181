"""The calibration loop on the tiny model: saving, divergence, kill-and-resume, accuracy guard, config."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from _configs import configured
from _faults import nan_inner_loss_from_batch
from safetensors.torch import load_file

import hypergrad as hg
import llm_calib
from llm_calib.calm.lora import OUTPUT_LOG_SCALE, FunctionalLM
from llm_calib.calm.losses import CalmLosses
from llm_calib.calm.trainer import CalibrationResult, TrainingDiverged, calibrate
from llm_calib.config.calibration import CalibrationConfig, LoraSettings
from llm_calib.data import load as load_data
from llm_calib.files.checkpoint import latest_checkpoint, load_checkpoint
from llm_calib.formats import score_multiple_choice
from llm_calib.models import tiny_random_model
from llm_calib.objectives.calm import F2SA, Bome, Calm
from llm_calib.objectives.confidence_penalty import ConfidencePenalty
from llm_calib.prompts.resolution import open_prompt_format
from llm_calib.prompts.templates import PromptFormat, short_answer_format

REPO = Path(__file__).resolve().parents[1]

# One source for the subprocess runs and the in-process reference run. The script counts the
# training steps it executes (through the batch sampler) so that a resume is seen to resume.
RUN_SCRIPT = '''
import json, sys
import torch
torch.set_num_threads(1)
import llm_calib.calm.batch_order as sampling
from llm_calib import CalibrationConfig, calibrate
from llm_calib.data import load
from llm_calib.models import tiny_random_model

STEPS = 8


def run(method, checkpoint_dir, resume):
    model, tok = tiny_random_model(seed=0, init_std=0.1)
    train = load("builtin:arithmetic,capitals:n=8").records
    heldout = load("builtin:arithmetic,capitals:n=4,seed=1").records
    objective = {"name": method, **({"lam_lr": 1e-1, "adjustment": "vector"} if method == "calm" else {})}
    cfg = CalibrationConfig(objective=objective, training=dict(steps=STEPS, batch_size=4, heldout_batch_size=4, lr=1e-2),
                            selection=dict(eval_every=2, guard_accuracy=0.0), checkpoint_every=2,
                            lora=dict(rank=2, layers=[1]))
    return calibrate(model, tok, train, heldout, cfg, checkpoint_dir=checkpoint_dir, resume=resume,
                     progress=False)


def final_tensors(result):
    theta = {n: p.detach().clone() for n, p in result.model.named_parameters() if "lora_" in n}
    return {**{f"theta/{k}": v for k, v in theta.items()}, **{f"lam/{k}": v for k, v in result.lam.items()}}


if __name__ == "__main__":
    import os, time
    from safetensors.torch import save_file
    method, ckpt, resume, out = sys.argv[1], sys.argv[2], sys.argv[3] == "1", sys.argv[4]
    if os.environ.get("PAUSE_IN_CHECKPOINT_WRITE"):  # stop inside one checkpoint's write, to be killed there
        import llm_calib.files.checkpoint as checkpoint
        real_save, step_tag = checkpoint.torch.save, f".ckpt-{int(os.environ['PAUSE_IN_CHECKPOINT_WRITE']):08d}."
        def paused_save(obj, f, *args, **kwargs):
            if step_tag in str(f):  # its tensors are written, its state is not, nothing is renamed yet
                open(os.environ["PAUSE_MARKER"], "w").close()
                time.sleep(600)
            return real_save(obj, f, *args, **kwargs)
        checkpoint.torch.save = paused_save
    calls = []
    sampler = sampling.batch_indices
    sampling.batch_indices = lambda n, b, step, seed, stream: calls.append(step) or sampler(n, b, step, seed, stream)
    result = run(method, ckpt, resume)
    save_file(final_tensors(result), out)
    with open(out + ".json", "w") as fh:
        json.dump({"steps_run": sorted(set(calls)), "history": result.history}, fh)
'''


@pytest.fixture(scope="module")
def run_module(tmp_path_factory):
    path = tmp_path_factory.mktemp("run") / "run_calibration.py"
    path.write_text(RUN_SCRIPT)
    namespace: dict = {"__name__": "run_calibration"}
    exec(compile(RUN_SCRIPT, str(path), "exec"), namespace)
    return path, namespace


@pytest.fixture(scope="module")
def data():
    train = load_data("builtin:arithmetic,capitals:n=8").records
    heldout = load_data("builtin:arithmetic,capitals:n=4,seed=1").records
    return train, heldout


BASE = {"objective": {"name": "calm", "adjustment": "vector"},
        "training": {"steps": 3, "batch_size": 4, "heldout_batch_size": 4, "lr": 1e-2},
        "selection": {"eval_every": 1, "guard_accuracy": 0.0}, "lora": LoraSettings(rank=2, layers=(1,))}


def _cfg(**kw) -> CalibrationConfig:
    return configured(BASE, **kw)


def _model():
    return tiny_random_model(seed=0, init_std=0.1)


def test_package_exports_the_training_api():
    assert set(llm_calib.__all__) >= {"calibrate", "CalibrationConfig", "CalibrationResult", "LoraSettings"}
    assert llm_calib.calibrate is calibrate
    assert llm_calib.CalibrationResult is CalibrationResult
    assert llm_calib.LoraSettings is LoraSettings


def test_save_and_load_round_trip(tmp_path, data):
    train, heldout = data
    model, tok = _model()
    result = calibrate(model, tok, train, heldout, _cfg(objective=dict(lam_lr=0.1)), progress=False)
    assert result.lam["b"].abs().max() > 0  # λ moved, so its round trip means something
    base_norm = _model()[0].model.norm.weight
    trained_norm = result.model.get_base_model().model.norm.modules_to_save["default"].weight
    assert not torch.allclose(trained_norm, base_norm)  # the output scale moved too
    out = result.save(tmp_path / "calm")
    assert {p.name for p in out.iterdir()} >= {"adapter", "lambda.safetensors", "config.json", "history.json", "metrics.json"}

    fresh, _ = _model()
    loaded = CalibrationResult.load(out, fresh)
    prompt = PromptFormat(style="cloze")
    before = score_multiple_choice(_model()[0], tok, heldout[:6], prompt=prompt)
    original = score_multiple_choice(result.model, tok, heldout[:6], prompt=prompt)
    again = score_multiple_choice(loaded.model, tok, heldout[:6], prompt=prompt)
    for a, b, c in zip(original.logits, again.logits, before.logits, strict=True):
        assert torch.allclose(a, b, atol=1e-6, rtol=0), (a, b)
        assert not torch.allclose(a, c, atol=1e-6, rtol=0)  # the adapter changes the scores
    # the trainer's own held-out metrics agree with the ordinary scorer on the peft model
    scored = score_multiple_choice(loaded.model, tok, heldout, prompt=prompt)
    assert float(scored.correct.mean()) == pytest.approx(result.metrics["after"]["accuracy"], abs=1e-12)
    assert set(loaded.lam) == set(result.lam)
    for k in result.lam:
        assert torch.equal(loaded.lam[k], result.lam[k])
    assert loaded.config == result.config
    assert loaded.history == result.history
    assert loaded.metrics == result.metrics
    assert json.loads((out / "config.json").read_text())["lora"]["layers"] == [1]


def test_nan_loss_raises_with_step_and_batch_and_keeps_last_good_checkpoint(tmp_path, data, monkeypatch):
    train, heldout = data
    calls = {"n": 0}
    real = CalmLosses.one_level

    def poisoned(self, theta, batch, *args, **kwargs):  # one call per step: step 5 yields NaN
        calls["n"] += 1
        loss = real(self, theta, batch, *args, **kwargs)
        return loss * float("nan") if calls["n"] == 5 else loss

    monkeypatch.setattr(CalmLosses, "one_level", poisoned)
    ckpt = tmp_path / "ckpt"
    model, tok = _model()
    with pytest.raises(TrainingDiverged) as info:
        calibrate(model, tok, train, heldout, _cfg(objective=dict(name="lora_ce"), training=dict(steps=8), checkpoint_every=2),
                  checkpoint_dir=ckpt, progress=False)
    message = str(info.value)
    assert "step 5" in message and "batch ids" in message
    assert any(r.id in message for r in train)
    last = latest_checkpoint(ckpt)
    assert last is not None and last.name == "ckpt-00000004"
    assert (ckpt / "LATEST").read_text().strip() == last.name
    tensors, state = load_checkpoint(last)
    assert state["step"] == 4 < 5
    assert all(bool(torch.isfinite(v).all()) for v in tensors.values())
    # the good checkpoint resumes (the poisoned call is past)
    model, tok = _model()
    result = calibrate(model, tok, train, heldout, _cfg(objective=dict(name="lora_ce"), training=dict(steps=6), checkpoint_every=2),
                       checkpoint_dir=ckpt, resume=True, progress=False)
    assert [h["step"] for h in result.history] == list(range(1, 7))


def test_resume_refuses_a_checkpoint_of_another_configuration_or_other_data(tmp_path, data):
    train, heldout = data
    ckpt = tmp_path / "ckpt"
    calibrate(*_model(), train, heldout, _cfg(objective=dict(name="lora_ce"), training=dict(steps=2), checkpoint_every=2),
              checkpoint_dir=ckpt, progress=False)
    with pytest.raises(ValueError, match=r"configuration differs \(training\.lr: checkpoint 0\.01, now 0\.07\)") as info:
        calibrate(*_model(), train, heldout, _cfg(objective=dict(name="lora_ce"), training=dict(steps=4, lr=0.07), checkpoint_every=2),
                  checkpoint_dir=ckpt, resume=True, progress=False)
    assert str(latest_checkpoint(ckpt)) in str(info.value)
    with pytest.raises(ValueError, match="trained on other data"):
        calibrate(*_model(), train[1:], heldout, _cfg(objective=dict(name="lora_ce"), training=dict(steps=4), checkpoint_every=2),
                  checkpoint_dir=ckpt, resume=True, progress=False)
    # more steps (and another save interval) is a legitimate continuation
    result = calibrate(*_model(), train, heldout, _cfg(objective=dict(name="lora_ce"), training=dict(steps=4), checkpoint_every=1),
                       checkpoint_dir=ckpt, resume=True, progress=False)
    assert [h["step"] for h in result.history] == [1, 2, 3, 4]


def test_history_logs_the_output_scale_and_lambda_of_the_selected_step(data):
    train, heldout = data
    result = calibrate(*_model(), train, heldout, _cfg(objective=dict(name="calm", lam_lr=0.2), training=dict(steps=4), lora=dict(output_scale_lr=0.2)),
                       progress=False)
    evaluated = [h for h in result.history if "heldout_ece" in h]
    assert len(evaluated) == 4
    assert len({h[OUTPUT_LOG_SCALE] for h in evaluated}) == 4  # it moves every step
    chosen = int(result.metrics["after"]["selected_step"])
    assert chosen > 0, "the test needs a run that keeps a trained step"
    record = next(h for h in evaluated if h["step"] == chosen)
    deployed = float(FunctionalLM(result.model).theta()[OUTPUT_LOG_SCALE])
    assert record[OUTPUT_LOG_SCALE] == pytest.approx(deployed, abs=1e-6)
    for name, value in result.lam.items():
        assert record[f"lambda_{name}_absmax"] == pytest.approx(float(value.abs().max()), abs=1e-6)
        assert record[f"lambda_{name}_mean"] == pytest.approx(float(value.double().mean()), abs=1e-6)


def test_a_non_finite_loss_raises_training_diverged_and_keeps_the_last_checkpoint(tmp_path, data, monkeypatch):
    """The inner loss turns NaN from the third step's batch on (each step builds a new batch).

    Injected, not provoked with a huge learning rate: whether a float32 overflow of that kind gives
    inf/NaN or saturates to a finite, gradient-free model depends on the CPU's matmul kernels
    (with MKL's AVX2 code path lr = 1e30 trains on, finite, on this set-up).
    """
    train, heldout = data
    seen = nan_inner_loss_from_batch(monkeypatch, 3)
    with pytest.raises(TrainingDiverged) as info:
        calibrate(*_model(), train, heldout, _cfg(objective=dict(name="calm"), training=dict(steps=6), checkpoint_every=1),
                  checkpoint_dir=tmp_path / "ckpt", progress=False)
    assert len(seen) == 3
    assert str(info.value).startswith("step 3: ")
    assert f"batch ids {seen[-1].ids[:8]}" in str(info.value)
    assert _latest_step(tmp_path / "ckpt") == 2  # steps 1 and 2 were saved, step 3 was not


def test_a_learning_rate_beyond_float32_range_raises_at_the_first_step(tmp_path, data):
    """lr = 1e39 overflows float32 in the first update on any CPU (IEEE: 1e39 > 3.4e38)."""
    train, heldout = data
    with pytest.raises(TrainingDiverged, match=r"^step 1: updated LoRA parameters: .*non-finite.*batch ids \['") as info:
        calibrate(*_model(), train, heldout, _cfg(objective=dict(name="lora_ce"), training=dict(lr=1e39, steps=3), checkpoint_every=1),
                  checkpoint_dir=tmp_path / "ckpt", progress=False)
    assert isinstance(info.value.__cause__, FloatingPointError)
    assert _latest_step(tmp_path / "ckpt") == 0


def _spawn(script: Path, method: str, ckpt: Path, resume: bool, out: Path, **env_extra: str) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]), **env_extra}
    return subprocess.Popen(
        [sys.executable, str(script), method, str(ckpt), "1" if resume else "0", str(out)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )


def _latest_step(ckpt: Path) -> int:
    last = latest_checkpoint(ckpt)
    return int(last.name.split("-")[1]) if last is not None else 0


def test_sigkill_then_resume_equals_an_uninterrupted_run(tmp_path, run_module):
    script, ns = run_module
    methods = ("calm", "label_smoothing")
    steps = ns["STEPS"]
    procs = {m: _spawn(script, m, tmp_path / f"ckpt-{m}", False, tmp_path / f"killed-{m}.safetensors") for m in methods}
    killed_at: dict[str, int] = {}
    deadline = time.monotonic() + 180
    try:
        while len(killed_at) < len(methods) and time.monotonic() < deadline:
            for m, p in procs.items():
                if m not in killed_at and _latest_step(tmp_path / f"ckpt-{m}") >= 2:
                    os.kill(p.pid, signal.SIGKILL)
                    p.wait()
                    killed_at[m] = _latest_step(tmp_path / f"ckpt-{m}")
                elif m not in killed_at and p.poll() is not None:
                    pytest.fail(f"{m}: the run ended before it could be killed: {p.stderr.read().decode()[-2000:]}")
            time.sleep(0.002)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
    for m, p in procs.items():
        assert p.returncode == -signal.SIGKILL, (m, p.returncode)
        assert 2 <= killed_at[m] < steps, killed_at
        assert not (tmp_path / f"killed-{m}.safetensors").exists()

    resumed = {m: _spawn(script, m, tmp_path / f"ckpt-{m}", True, tmp_path / f"resumed-{m}.safetensors") for m in methods}
    for m, p in resumed.items():
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, (m, err.decode()[-3000:])

    for m in methods:
        ref_dir = tmp_path / f"ref-{m}"
        reference = ns["run"](m, ref_dir, False)
        ref = ns["final_tensors"](reference)
        got = load_file(str(tmp_path / f"resumed-{m}.safetensors"))
        info = json.loads((tmp_path / f"resumed-{m}.safetensors.json").read_text())
        # it continued from the newest checkpoint instead of starting over
        assert info["steps_run"] == list(range(killed_at[m], steps))
        assert set(got) == set(ref)
        for k, v in ref.items():
            assert torch.allclose(got[k], v, atol=1e-6, rtol=0), (m, k, float((got[k] - v).abs().max()))
        # same records; values equal up to float rounding (trunk caches are filled in other batches)
        assert [sorted(h) for h in info["history"]] == [sorted(h) for h in reference.history]
        for h_got, h_ref in zip(info["history"], reference.history, strict=True):
            assert h_got == pytest.approx(h_ref, rel=1e-4, abs=1e-6)
        # the last-step state (not only the selected one) matches too
        t_resumed, s_resumed = load_checkpoint(latest_checkpoint(tmp_path / f"ckpt-{m}"))
        t_ref, s_ref = load_checkpoint(latest_checkpoint(ref_dir))
        assert s_resumed["step"] == s_ref["step"] == steps
        assert any(float(v.abs().max()) > 1e-4 for k, v in t_ref.items() if k.startswith("theta/") and "lora_B" in k)
        assert set(t_resumed) == set(t_ref)
        for k in t_ref:
            assert torch.allclose(t_resumed[k], t_ref[k], atol=1e-6, rtol=0), (m, k)


def test_sigkill_inside_a_checkpoint_write_then_resume_equals_an_uninterrupted_run(tmp_path, run_module):
    """Killed while writing step 4's checkpoint (tensors written, state not, not renamed): the run
    resumes from step 2's, the half-written folder is cleaned away, and the result is the same."""
    script, ns = run_module
    ckpt, marker = tmp_path / "ckpt", tmp_path / "paused"
    p = _spawn(script, "calm", ckpt, False, tmp_path / "killed.safetensors",
               PAUSE_IN_CHECKPOINT_WRITE="4", PAUSE_MARKER=str(marker))
    deadline = time.monotonic() + 300
    try:
        while not marker.exists():
            if p.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"the run did not reach step 4's checkpoint write: {p.stderr.read().decode()[-2000:]}")
            time.sleep(0.01)
        os.kill(p.pid, signal.SIGKILL)
        p.wait()
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == -signal.SIGKILL
    assert _latest_step(ckpt) == 2 and list(ckpt.glob(".ckpt-00000004.*.tmp"))  # the write was cut short
    resumed = _spawn(script, "calm", ckpt, True, tmp_path / "resumed.safetensors")
    _, err = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, err.decode()[-3000:]
    info = json.loads((tmp_path / "resumed.safetensors.json").read_text())
    assert info["steps_run"] == list(range(2, ns["STEPS"]))
    assert not list(ckpt.glob(".ckpt-*.tmp"))  # the half-written folder is gone
    ref = ns["final_tensors"](ns["run"]("calm", tmp_path / "ref", False))
    got = load_file(str(tmp_path / "resumed.safetensors"))
    assert set(got) == set(ref)
    for k, v in ref.items():
        assert torch.allclose(got[k], v, atol=1e-6, rtol=0), (k, float((got[k] - v).abs().max()))


def test_accuracy_guard_stops_and_returns_the_initial_parameters(data):
    train, heldout = data
    model, tok = _model()
    guard = 0.95
    result = calibrate(model, tok, train, heldout,
                       _cfg(objective=dict(name="lora_ce"), training=dict(lr=1.0, steps=10), selection=dict(eval_every=1, guard_accuracy=guard, guard_patience=2)),
                       progress=False)
    before, after = result.metrics["before"], result.metrics["after"]
    assert after["stopped_early"] == 1.0
    assert len(result.history) < 10
    # it did destroy accuracy, on the last 2 (guard_patience) evaluations
    assert all(h["heldout_accuracy"] < guard * before["accuracy"] for h in result.history[-2:])
    assert after["accuracy"] >= guard * before["accuracy"]
    assert after["selected_step"] == 0.0
    # integers as integers (issue #31 (5)): metrics.json says 0 and 1, not 0.0 and 1.0
    assert type(after["selected_step"]) is int and type(after["stopped_early"]) is int
    assert '"selected_step": 0,' in json.dumps(after) and '"stopped_early": 1' in json.dumps(after)
    assert after["ece"] == pytest.approx(before["ece"], abs=1e-9)
    lora_b = [p for n, p in result.model.named_parameters() if "lora_B" in n]
    assert lora_b and all(float(p.detach().abs().max()) == 0.0 for p in lora_b)  # rolled back to the start


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"training": {"lr": -1.0}}, "training.lr"),
        ({"training": {"lr": "fast"}}, "training.lr"),
        ({"training": {"steps": 0}}, "training.steps"),
        ({"training": {"steps": 2.5}}, "training.steps"),
        ({"objective": "sft"}, "objective.name"),
        ({"objective": {"name": "calm", "solver": "adam"}}, "objective.solver.name"),
        ({"objective": {"solver": {"name": "bome", "barrier": "hinge"}}}, "objective.solver.barrier"),
        ({"lora": {"output_scale": "yes"}}, "lora.output_scale"),
        ({"lora": {"output_scale_lr": 0.0}}, "lora.output_scale_lr"),
        ({"selection": {"guard_accuracy": 1.5}}, "selection.guard_accuracy"),
        ({"objective": {"name": "label_smoothing", "eps": 1.0}}, "objective.eps"),
        ({"checkpoint_every": -1}, "checkpoint_every"),
        ({"selection": {"guard_patience": 0}}, "selection.guard_patience"),
        ({"prompt": {"chat_template": "yes"}}, "prompt.chat_template"),
        ({"lora": {"rank": 0}}, "lora.rank"),
        ({"lora": {"dropout": 2.0}}, "lora.dropout"),
        ({"lora": {"rnak": 4}}, "rnak"),
        ({"prompt": {"open_examples": "Q: 2 + 2? A: 4"}}, "open_examples must be a list"),
        ({"prompt": {"open_examples": [["2 + 2?", "4"], ["3 + 3?"]]}}, "open_examples[1]"),
        ({"prompt": {"open_examples": [["2 + 2?", " "]]}}, "open_examples[0]"),
        ({"prompt": {"open_examples": [["2 + 2?", 4]]}}, "open_examples[0]"),
        ({"objective": {"name": "calm", "beta": 0.5}}, "unknown objective key(s) ['beta']"),
        ({"prompt": {"styel": "cloze"}}, "unknown prompt key(s) ['styel']"),
    ],
)
def test_config_errors_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=re.escape(field)):
        CalibrationConfig(**kwargs)


def test_config_yaml_round_trip_and_unknown_key(tmp_path):
    import yaml

    cfg = CalibrationConfig(objective=ConfidencePenalty(beta=0.3), training=dict(steps=7, lr=3e-4),
                            prompt=dict(open_examples=(("Capital of Italy?", "Rome"), ("2 + 2?", "4"))),
                            lora=LoraSettings(rank=4, target_modules=("q_proj",), layers=(0, 1)))
    assert cfg.to_dict()["prompt"]["open_examples"] == [["Capital of Italy?", "Rome"], ["2 + 2?", "4"]]
    assert cfg.to_dict()["objective"] == {"name": "confidence_penalty", "beta": 0.3}
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg.to_dict()))
    assert CalibrationConfig.from_file(path) == cfg
    assert CalibrationConfig.from_file(path).prompt.open_examples == (("Capital of Italy?", "Rome"), ("2 + 2?", "4"))
    assert CalibrationConfig(prompt=dict(open_examples=[[" 2 + 2? ", "4 "]])).prompt.open_examples == (("2 + 2?", "4"),)
    calm = CalibrationConfig(objective=Calm(solver=F2SA(sigma=0.2, inner_steps=2), adjustment="temperature"))
    path.write_text(yaml.safe_dump(calm.to_dict()))
    assert CalibrationConfig.from_file(path) == calm
    # hand-written YAML: 1e-3 is a string in YAML 1.1 and still reads as a number
    hand = tmp_path / "hand.yml"
    hand.write_text("objective: {name: calm, solver: {name: bome, eta: 2.0}, adjustment: auto}\n"
                    "training:\n  steps: 5\n  lr: 1e-3\nlora:\n  rank: 2\n")
    loaded = CalibrationConfig.from_file(hand)
    assert (loaded.training.steps, loaded.training.lr, loaded.lora.rank) == (5, 1e-3, 2)
    assert loaded.objective == Calm(solver=Bome(eta=2.0), adjustment="auto")
    json_path = tmp_path / "cfg.json"
    json_path.write_text(json.dumps(cfg.to_dict()))
    assert CalibrationConfig.from_file(json_path) == cfg

    bad = tmp_path / "bad.yaml"
    bad.write_text("training: {steps: 5}\nlearning_rate: 0.1\n")
    with pytest.raises(ValueError, match=r"bad\.yaml.*learning_rate"):
        CalibrationConfig.from_file(bad)
    bad.write_text("training: {steps: [1}\n")
    with pytest.raises(ValueError, match=r"bad\.yaml"):
        CalibrationConfig.from_file(bad)
    bad.write_text("training: {lr: -2}\n")
    with pytest.raises(ValueError, match=r"bad\.yaml.*training\.lr"):
        CalibrationConfig.from_file(bad)
    bad.write_text('prompt:\n  open_examples:\n    - ["Capital of Italy?", Rome]\n    - ["2 + 2?"]\n')
    with pytest.raises(ValueError, match=r"bad\.yaml.*open_examples\[1\]"):
        CalibrationConfig.from_file(bad)


def test_open_prompt_format_is_the_chat_prompt_or_the_short_answer_prompt():
    assert open_prompt_format(CalibrationConfig().prompt) == PromptFormat()
    assert open_prompt_format(CalibrationConfig(prompt=dict(chat_template=False)).prompt) == PromptFormat(chat_template=False)
    examples = (("Capital of Italy?", "Rome"), ("2 + 2?", "4"))
    assert open_prompt_format(CalibrationConfig(prompt=dict(open_examples=examples)).prompt) == short_answer_format(examples)
    # the few-shot prompt is plain text whatever chat_template says
    assert open_prompt_format(CalibrationConfig(prompt=dict(open_examples=examples, chat_template=True)).prompt).chat_template is False


@pytest.mark.parametrize(("solver", "method_class"), [("bome", "BOME"), ("f2sa", "Penalty")])
def test_calm_solves_the_bilevel_problem_the_right_way_round_and_steps_lambda(tmp_path, data, monkeypatch, solver,
                                                                             method_class):
    """g (the adjusted CE) is the lower level, on training batches; f (minus the held-out entropy) the
    upper one, on held-out batches; λ takes Adam steps along the solver's hypergradients."""
    train, heldout = data
    train_ids, heldout_ids = {r.id for r in train}, {r.id for r in heldout}
    calls: dict[str, list[set[str]]] = {"inner": [], "outer": []}
    for name in calls:
        loss = getattr(CalmLosses, name)
        monkeypatch.setattr(CalmLosses, name, lambda self, theta, lam, batch, _loss=loss, _name=name:
                            calls[_name].append(set(batch.ids)) or _loss(self, theta, lam, batch))
    results = []
    cls = getattr(hg, method_class)
    hypergrad = cls.hypergrad
    monkeypatch.setattr(cls, "hypergrad", lambda self, *a, **k: results.append(hypergrad(self, *a, **k)) or results[-1])
    lam_lr, steps = 0.05, 3
    calibrate(*_model(), train, heldout, _cfg(objective=dict(name="calm", lam_lr=lam_lr, solver=dict(name=solver)), training=dict(steps=steps), checkpoint_every=1),
              checkpoint_dir=tmp_path / "ckpt", progress=False)
    # the lower level g sees only training questions, the upper level f only held-out ones
    assert calls["inner"] and all(ids <= train_ids for ids in calls["inner"])
    assert calls["outer"] and all(ids <= heldout_ids for ids in calls["outer"])
    # λ after the last step: λ0 = 0 (the identity) moved by torch's Adam along the solver's
    # hypergradient of every step, replayed here (the bounds max_log_scale / max_bias are far)
    assert len(results) == steps
    tensors, _ = load_checkpoint(latest_checkpoint(tmp_path / "ckpt"))
    replay = {k: torch.zeros_like(g, requires_grad=True) for k, g in results[0].grad.items()}
    assert set(replay) == {"log_a", "b"}
    adam = torch.optim.Adam(list(replay.values()), lr=lam_lr)
    for r in results:
        for k, p in replay.items():
            p.grad = r.grad[k].detach().clone()
        adam.step()
    for k, p in replay.items():
        assert float(p.detach().abs().max()) > 0.5 * lam_lr  # λ really moved
        torch.testing.assert_close(tensors[f"lam/{k}"], p.detach(), rtol=1e-6, atol=1e-6 * lam_lr)
