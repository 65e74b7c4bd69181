"""``llm_calib.integrations.CalmStep``: a plain PyTorch loop reproduces ``llm_calib.calibrate``.

The loop draws calibrate's batches (``llm_calib.calm.batch_order``) and feeds them through the public
collators; after 20 steps θ and λ equal calibrate's last checkpoint (float32). The state saves and
loads exactly, micro-batches equal the whole batch, and bad input gets one clear line.
"""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch

from llm_calib import CalibrationConfig, calibrate
from llm_calib.calm import batch_order
from llm_calib.data import builtin_multiple_choice, builtin_open_questions
from llm_calib.files.checkpoint import latest_checkpoint, load_checkpoint
from llm_calib.integrations import (
    CalmStep,
    MultipleChoiceCollator,
    OpenAnswerCollator,
    attach_adapters,
    labelled_sequences,
)
from llm_calib.models import tiny_random_model

STEPS = 20


def _sets(kind: str) -> tuple[list, list]:
    qs = (builtin_multiple_choice(n_per_domain=8, domains=["capitals", "arithmetic"]) if kind == "mc"
          else builtin_open_questions(n_per_domain=8))
    return qs[: len(qs) // 2], qs[len(qs) // 2:]


def _config(**lora) -> CalibrationConfig:
    return CalibrationConfig(training=dict(steps=STEPS, batch_size=4, heldout_batch_size=4, lr=1e-2),
                             objective={"name": "calm", "lam_lr": 5e-2}, selection=dict(eval_every=STEPS, guard_accuracy=0.0),
                             checkpoint_every=STEPS, **({"lora": lora} if lora else {}))


def calibrate_last_state(kind: str, cfg: CalibrationConfig, tmp: Path) -> dict[str, torch.Tensor]:
    """θ and λ after calibrate's last step (its checkpoint), keyed ``theta/...``, ``lam/...``."""
    train, heldout = _sets(kind)
    model, tok = tiny_random_model(num_layers=3)
    calibrate(model, tok, train, heldout, cfg, checkpoint_dir=tmp, progress=False)
    return load_checkpoint(latest_checkpoint(tmp))[0]


def _collators(kind: str, tok, cfg):
    if kind == "mc":
        return MultipleChoiceCollator(tok, cfg), MultipleChoiceCollator(tok, cfg, labels=None)
    return OpenAnswerCollator(tok, cfg), OpenAnswerCollator(tok, cfg, labels=None)


def plain_loop(kind: str, cfg: CalibrationConfig, steps: range = range(STEPS), calm: CalmStep | None = None,
               **step_options) -> CalmStep:
    """The loop a user writes: their batches (here calibrate's order) into ``calm.step``."""
    train, heldout = _sets(kind)
    model, tok = tiny_random_model(num_layers=3)
    collate, collate_upper = _collators(kind, tok, cfg)
    if calm is None:
        calm = CalmStep(attach_adapters(model, cfg), cfg, task_format=collate.format, **step_options)
    for step in steps:
        i = batch_order.batch_indices(len(train), 4, step, cfg.seed, batch_order.TRAIN_STREAM)
        j = batch_order.batch_indices(len(heldout), 4, step, cfg.seed, batch_order.UPPER_STREAM)
        calm.step(collate([train[k] for k in i]), collate_upper([heldout[k] for k in j]))
    return calm


def max_differences(calm: CalmStep, ref: dict[str, torch.Tensor]) -> tuple[float, float]:
    dt = max(float((calm.theta[k] - ref[f"theta/{k}"]).abs().max()) for k in calm.theta)
    dl = max(float((calm.lam[k].detach() - ref[f"lam/{k}"]).abs().max()) for k in calm.lam)
    return dt, dl


@pytest.mark.parametrize("kind", ["mc", "open"])
def test_plain_loop_reproduces_calibrate(kind: str, tmp_path: Path) -> None:
    cfg = _config()
    ref = calibrate_last_state(kind, cfg, tmp_path)
    calm = plain_loop(kind, cfg)
    dt, dl = max_differences(calm, ref)
    assert dt <= 1e-6 and dl <= 1e-6, (dt, dl)
    assert calm.steps_taken == STEPS
    moved = [float(v.abs().max()) for k, v in ref.items() if k.startswith("theta/") and "lora_B" in k]
    assert moved and min(moved) > 1e-3  # θ really trained
    # the model's own adapters hold the step's θ (what save_pretrained writes)
    params = dict(calm.lm.decoder.named_parameters())
    assert all(torch.equal(params[k], v) for k, v in calm.theta.items() if k in params)


def test_trunk_cache_filled_like_calibrate_reproduces_it(tmp_path: Path) -> None:
    """LoRA on the top layer only: the frozen bottom is cached; filled set by set in chunks of 16 (what
    calibrate does), the numbers are calibrate's."""
    cfg = _config(layers=[2])
    ref = calibrate_last_state("mc", cfg, tmp_path)
    train, heldout = _sets("mc")
    model, tok = tiny_random_model(num_layers=3)
    collate = MultipleChoiceCollator(tok, cfg)
    calm = CalmStep(attach_adapters(model, cfg), cfg, task_format=collate.format)
    assert calm.lm.caches_trunk
    for records in (train, heldout):
        for start in range(0, len(records), 16):
            calm.cache_trunks(collate(records[start:start + 16]))
    cached = calm.cached_trunks
    plain_loop("mc", cfg, calm=calm)
    assert calm.cached_trunks == cached == len(train) + len(heldout)  # every question computed once
    dt, dl = max_differences(calm, ref)
    assert dt <= 1e-6 and dl <= 1e-6, (dt, dl)


def test_state_saves_and_loads_exactly(tmp_path: Path) -> None:
    """torch.save(state_dict) at step 10, torch.load(weights_only=True) into a fresh step, 10 more
    steps: bit for bit the uninterrupted run."""
    cfg = _config()
    whole = plain_loop("mc", cfg)
    first = plain_loop("mc", cfg, steps=range(10))
    buffer = io.BytesIO()
    torch.save(first.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    model, tok = tiny_random_model(num_layers=3)
    fresh = CalmStep(attach_adapters(model, cfg), cfg, task_format=MultipleChoiceCollator(tok, cfg).format)
    fresh.load_state_dict(state)
    assert fresh.steps_taken == 10
    resumed = plain_loop("mc", cfg, steps=range(10, STEPS), calm=fresh)
    for k in whole.theta:
        assert torch.equal(whole.theta[k], resumed.theta[k]), k
    for k in whole.lam:
        assert torch.equal(whole.lam[k], resumed.lam[k]), k
    # the solver's state (BOME's θ Adam moments) came back too: without it the run differs
    model, tok = tiny_random_model(num_layers=3)
    partial = CalmStep(attach_adapters(model, cfg), cfg, task_format=MultipleChoiceCollator(tok, cfg).format)
    partial.load_state_dict({**state, "solver_state": {}})
    plain_loop("mc", cfg, steps=range(10, STEPS), calm=partial)
    assert any(not torch.equal(whole.theta[k], partial.theta[k]) for k in whole.theta)


def test_micro_batches_equal_the_whole_batch() -> None:
    """accumulation_steps=2 (gradient accumulation) takes the step of the whole batch (float64)."""
    cfg = _config()
    train, heldout = _sets("mc")
    runs = []
    for accumulation in (1, 2):
        model, tok = tiny_random_model(num_layers=3)
        collate = MultipleChoiceCollator(tok, cfg)
        calm = CalmStep(attach_adapters(model.double(), cfg), cfg, task_format=collate.format,
                        accumulation_steps=accumulation)
        records = [calm.step(collate(train[4 * (s % 2):4 * (s % 2) + 4]), MultipleChoiceCollator(tok, cfg, labels=None)(heldout[:4]))
                   for s in range(3)]
        runs.append((calm, records))
    (one, rec1), (two, rec2) = runs
    for k in one.theta:
        assert torch.allclose(one.theta[k], two.theta[k], atol=1e-10, rtol=0), k
    for k in one.lam:
        assert torch.allclose(one.lam[k], two.lam[k], atol=1e-10, rtol=0), k
    assert abs(rec1[-1]["g"] - rec2[-1]["g"]) < 1e-10


@pytest.mark.filterwarnings("ignore:.is_gradient_checkpointing. is deprecated:FutureWarning")
def test_users_own_peft_model_trains(tmp_path: Path) -> None:
    """A peft model built with the user's own LoraConfig (all layers, their target modules) takes CALM steps
    on Hugging Face causal-LM batches; save_pretrained writes the trained adapter."""
    from peft import LoraConfig, PeftModel, get_peft_model

    model, tok = tiny_random_model()
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "o_proj"],
                                                  task_type="CAUSAL_LM"))
    calm = CalmStep(peft_model, _config())
    train, heldout = _sets("open")
    collate, prompts = OpenAnswerCollator(tok), OpenAnswerCollator(tok, labels=False)
    for step in range(3):
        record = calm.step(collate(train[4 * step:4 * step + 4]),
                           prompts([{"question": r.question} for r in heldout[:4]]))
    assert set(record) >= {"g", "unlabeled_entropy", "q", "lambda_b_mean", "lambda_b_absmax"}
    peft_model.save_pretrained(tmp_path)
    reloaded = PeftModel.from_pretrained(tiny_random_model()[0], tmp_path)
    saved = {n: p for n, p in reloaded.named_parameters() if "lora_B" in n}
    assert saved and all(float(p.abs().max()) > 0 for p in saved.values())  # B starts at 0: trained


def test_left_right_padding_and_packing_read_alike() -> None:
    ids, labels = [5, 6, 7, 8], [-100, -100, 7, 8]
    right = {"input_ids": torch.tensor([ids, [9, 10, 0, 0]]), "attention_mask": torch.tensor([[1] * 4, [1, 1, 0, 0]]),
             "labels": torch.tensor([labels, [-100, 10, -100, -100]])}
    left = {"input_ids": torch.tensor([ids, [0, 0, 9, 10]]), "attention_mask": torch.tensor([[1] * 4, [0, 0, 1, 1]]),
            "labels": torch.tensor([labels, [-100, -100, -100, 10]])}
    packed = {"input_ids": torch.tensor([[*ids, 9, 10]]), "position_ids": torch.tensor([[0, 1, 2, 3, 0, 1]]),
              "labels": torch.tensor([[*labels, -100, 10]])}
    assert labelled_sequences(right) == labelled_sequences(left) == labelled_sequences(packed)


def test_bad_input_one_clear_line() -> None:
    model, tok = tiny_random_model()
    with pytest.raises(ValueError, match=r"has no trainable adapters .it is not a peft model"):
        CalmStep(model)
    calm = CalmStep(attach_adapters(model))
    collate, prompts = OpenAnswerCollator(tok), OpenAnswerCollator(tok, labels=False)
    good = collate([{"question": "Capital of France?", "answers": ["Paris"]}] * 2)
    upper = prompts([{"question": "Capital of Peru?"}] * 2)
    unlabelled = {**good, "labels": torch.full_like(good["labels"], -100)}
    with pytest.raises(ValueError, match=r"^labelled batch: row 0 has no labelled token \(its labels are all -100\)"):
        calm.step(unlabelled, upper)
    with pytest.raises(ValueError, match=r"^upper-level batch: has labels .* where none are expected"):
        calm.step(good, good)
    with pytest.raises(ValueError, match=r"^upper-level batch: example 0 of the batch has labels .'answers'. where none"):
        prompts([{"question": "Capital of Peru?", "answers": ["Lima"]}])
    mc = MultipleChoiceCollator(tok)([{"question": "2 + 2?", "options": ["3", "4"], "answer": 1}])
    with pytest.raises(ValueError, match=r"but this CalmStep was made for OpenEnded: pass task_format=collator.format"):
        calm.step(mc, upper)
    split = CalmStep(attach_adapters(tiny_random_model()[0]), accumulation_steps=4)
    with pytest.raises(ValueError, match=r"^labelled batch: accumulation_steps=4 does not divide its 2 questions"):
        split.step(good, upper)
    frozen = attach_adapters(tiny_random_model()[0])
    for p in frozen.parameters():
        p.requires_grad_(False)
    with pytest.raises(ValueError, match=r"no parameter requires grad"):
        CalmStep(frozen)
    with pytest.raises(ValueError, match=r"accumulation_steps=2 needs a first-order solver"):
        CalmStep(attach_adapters(tiny_random_model()[0]), CalibrationConfig(objective={"name": "calm", "solver": "implicit"}),
                 accumulation_steps=2)


def test_readme_plain_loop_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The README's plain-loop block, given a model and the two DataLoaders it names."""
    import re

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    code = next(b for b in re.findall(r"```python\n(.*?)```", readme, re.S) if "CalmStep" in b)
    model, tok = tiny_random_model()
    train, heldout = _sets("open")
    loader = torch.utils.data.DataLoader(train, batch_size=4, collate_fn=OpenAnswerCollator(tok))
    prompts = torch.utils.data.DataLoader(heldout, batch_size=4, collate_fn=OpenAnswerCollator(tok, labels=None))
    monkeypatch.chdir(tmp_path)
    namespace = {"model": model, "train_loader": loader, "prompt_loader": prompts}
    exec(compile(code, "README.md", "exec"), namespace)
    assert namespace["calm"].steps_taken == 3 and (tmp_path / "adapter" / "adapter_config.json").is_file()
    assert torch.load(tmp_path / "calm_state.pt", weights_only=True)["steps"] == 3
