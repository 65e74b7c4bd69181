"""The calibration loop: CALM (BOME or F2SA from :mod:`hypergrad`) and the one-level baselines.

One code path trains every method on the same data order, budget and seed. Each step draws an
inner batch from the training set and, for CALM, an outer batch of held-out inputs (labels unused
by the objective). Every ``eval_every`` steps the deployed model is scored on the whole held-out
set; the run keeps the parameters with the lowest held-out ECE among those whose accuracy stays
above ``guard_accuracy`` times the initial accuracy, and stops early (rolling back) when accuracy
falls below it, so the recipe cannot degenerate into uniform predictions.

A run trains on one kind of record: multiple-choice questions (option scores) or open questions
(the reference answer as a continuation of the open-ended scorer's prompt); see
:mod:`llm_calib.calm.objectives` for the losses of each kind. For open questions the held-out
metrics are a cheap teacher-forced proxy of greedy answering (:meth:`CalmLosses.monitor
<llm_calib.calm.objectives.CalmLosses.monitor>`), not generated answers.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from tqdm.auto import tqdm

import hypergrad as hg
from llm_calib import distributed
from llm_calib.adjustment import LogitAdjustment
from llm_calib.calm.config import CalibrationConfig
from llm_calib.calm.lora import OUTPUT_LOG_SCALE, FunctionalLM, attach_lora
from llm_calib.calm.objectives import Batch, CalmLosses
from llm_calib.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from llm_calib.data.records import MultipleChoice, OpenQA, record_kind
from llm_calib.metrics import ece as ece_metric
from llm_calib.prompts import PromptFormat, build_prompt, continuation_text, uses_chat_template
from llm_calib.scoring.base import encode_continuation, encode_prompt
from llm_calib.scoring.letter import letter_token_ids
from llm_calib.scoring.open_ended import encode_open_prompts
from llm_calib.scoring.option_likelihood import encode_questions
from llm_calib.scoring.packing import (
    PackedQuestions,
    pack_continuations,
    pack_letters,
    pack_questions,
)

__all__ = ["CalibrationResult", "TrainingDiverged", "calibrate", "encode_batch_source"]


class TrainingDiverged(FloatingPointError):  # noqa: N818 (public name)
    """A loss or update became NaN/inf; the last good checkpoint is left untouched."""


_TRUNK_CHUNK = 16


@dataclass
class _Encoded:
    """Tokenised questions of one split, ready to be packed into batches.

    ``layout`` is ``"options"`` (option likelihood: prompt + every option, packed), ``"letter"``
    (listed prompt; ``options`` hold one letter id each) or ``"open"`` (open questions:
    ``options`` holds the reference answer alone, packed as a plain causal sequence).

    With a trunk-caching model the hidden states entering the first trainable layer are computed
    once per question and kept in ``trunk_cache``.
    """

    records: list[MultipleChoice] | list[OpenQA]
    prompts: list[tuple[int, ...]]
    options: list[tuple[tuple[int, ...], ...]]  # option continuations, letter ids, or (reference,)
    layout: str
    trunk_cache: dict[int, Tensor] = field(default_factory=dict)

    def _pack(self, idx: list[int], pad_id: int) -> PackedQuestions:
        if self.layout == "letter":
            return pack_letters([self.prompts[i] for i in idx], [[o[0] for o in self.options[i]] for i in idx], pad_id)
        if self.layout == "open":
            return pack_continuations([(self.prompts[i], self.options[i][0]) for i in idx], pad_id)
        return pack_questions([(self.prompts[i], self.options[i]) for i in idx], pad_id)

    def _length(self, i: int) -> int:
        return len(self.prompts[i]) + (0 if self.layout == "letter" else sum(len(o) for o in self.options[i]))

    def batch(self, indices: Sequence[int], pad_id: int, lm: FunctionalLM | None = None) -> Batch:
        idx = list(indices)
        packed = self._pack(idx, pad_id)
        open_ended = self.layout == "open"
        # an open question's one "option" is its reference answer, hence label 0
        labels = torch.tensor([0 if open_ended else self.records[i].gold for i in idx], dtype=torch.long)
        trunk = None
        if lm is not None and lm.caches_trunk:
            # Fixed chunks (questions 16c .. 16c+15) make each cached value independent of which
            # batch first needed it, so a resumed or data-parallel run computes the same numbers.
            chunks = sorted({i // _TRUNK_CHUNK for i in idx if i not in self.trunk_cache})
            for c in chunks:
                chunk = list(range(c * _TRUNK_CHUNK, min((c + 1) * _TRUNK_CHUNK, len(self.records))))
                hidden = lm.trunk_hidden(self._pack(chunk, pad_id))
                for row, i in enumerate(chunk):
                    self.trunk_cache[i] = hidden[row, : self._length(i)].clone()
            L = packed.input_ids.shape[1]
            trunk = torch.stack(
                [torch.nn.functional.pad(self.trunk_cache[i], (0, 0, 0, L - self.trunk_cache[i].shape[0])) for i in idx]
            )
        return Batch(packed, labels, [self.records[i].id for i in idx], trunk, open_ended)


def encode_batch_source(
    tokenizer: Any, records: Sequence[MultipleChoice] | Sequence[OpenQA], config: CalibrationConfig
) -> _Encoded:
    """Tokenise records once for the configured scorer and prompt format.

    Multiple-choice records follow ``config.scorer`` and ``config.prompt_style``. Open questions
    use the open-ended scorer's prompt (:func:`~llm_calib.scoring.open_ended.encode_open_prompts`,
    cloze, ``config.chat_template``) followed by the first reference alias as the continuation
    ``" " + alias``, tokenised on its own like an option.

    Raises:
        ValueError: no records, records of both kinds or of another type, or an open question
            without a reference answer (each naming the record).

    Example:
        >>> from llm_calib.data import OpenQA
        >>> from llm_calib.models import tiny_random_model
        >>> _, tok = tiny_random_model()
        >>> enc = encode_batch_source(tok, [OpenQA("Capital of France?", ("Paris",), "geo", "q0")],
        ...                           CalibrationConfig())
        >>> enc.layout, tok.decode(enc.options[0][0])
        ('open', ' Paris')
    """
    records = list(records)
    if not records:
        raise ValueError("no records to encode")
    if record_kind(records) == "open":
        unanswered = [r.id for r in records if not r.answers]
        if unanswered:
            raise ValueError(f"open question {unanswered[0]!r} has no reference answer to train or monitor on")
        prompts = encode_open_prompts(tokenizer, records, PromptFormat(chat_template=config.chat_template))
        answers = [(tuple(encode_continuation(tokenizer, continuation_text(r.answers[0]))),) for r in records]
        return _Encoded(records, [tuple(p) for p in prompts], answers, layout="open")
    if config.scorer == "letter":
        fmt = PromptFormat(style="listed", chat_template=config.chat_template)
        chat = uses_chat_template(tokenizer, fmt)
        prompts = [tuple(encode_prompt(tokenizer, build_prompt(tokenizer, r.question, r.options, fmt), chat=chat)) for r in records]
        options = [tuple((t,) for t in letter_token_ids(tokenizer, len(r.options))) for r in records]
        return _Encoded(records, prompts, options, layout="letter")
    fmt = PromptFormat(style=config.prompt_style, chat_template=config.chat_template)
    enc = encode_questions(tokenizer, records, fmt)
    return _Encoded(records, [e.prompt for e in enc], [e.options for e in enc], layout="options")


def _permutation(n: int, seed: int, epoch: int, stream: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed * 1_000_003 + epoch * 7919 + stream)
    return torch.randperm(n, generator=gen).tolist()


def _batch_indices(n: int, batch_size: int, step: int, seed: int, stream: int) -> list[int]:
    """The global batch of ``step``: consecutive slices of a per-epoch seeded permutation."""
    per_epoch = max(1, n // batch_size)
    epoch, k = divmod(step, per_epoch)
    perm = _permutation(n, seed, epoch, stream)
    if batch_size >= n:
        return perm
    return perm[k * batch_size : (k + 1) * batch_size]


def _shard(indices: list[int]) -> list[int]:
    world, rank = distributed.world_size(), distributed.rank()
    if world == 1:
        return indices
    if len(indices) % world:
        raise ValueError(f"the batch size {len(indices)} must be divisible by the number of ranks {world}")
    return indices[rank::world]


@dataclass
class CalibrationResult:
    """The outcome of :func:`calibrate`.

    Attributes:
        model: the calibrated model (peft model with the selected adapter weights loaded). It is
            deployed as is: λ is not needed at inference.
        lam: the final logit adjustment λ (for inspection and research; CALM only).
        history: per evaluation: step, held-out accuracy/ECE/NLL/entropy, losses, BOME's φ and q.
        metrics: held-out metrics before and after training (``"before"``, ``"after"``).
        config: the run's configuration.
        timings: wall-clock seconds per phase.
    """

    model: Any
    lam: dict[str, Tensor]
    history: list[dict[str, float]]
    metrics: dict[str, dict[str, float]]
    config: CalibrationConfig
    timings: dict[str, float] = field(default_factory=dict)

    def save(self, directory: str | os.PathLike[str]) -> Path:
        """Write ``adapter/`` (peft ``save_pretrained``), ``lambda.safetensors``, ``config.json``,
        ``history.json`` and ``metrics.json`` into ``directory``."""
        from safetensors.torch import save_file

        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        self.model.save_pretrained(str(out / "adapter"))
        save_file({k: v.detach().contiguous().cpu() for k, v in self.lam.items()}, str(out / "lambda.safetensors"))
        (out / "config.json").write_text(json.dumps(self.config.to_dict(), indent=2))
        (out / "history.json").write_text(json.dumps(self.history, indent=2))
        (out / "metrics.json").write_text(json.dumps({"metrics": self.metrics, "timings": self.timings}, indent=2))
        return out

    @classmethod
    def load(cls, directory: str | os.PathLike[str], base_model: Any) -> CalibrationResult:
        """Load a saved result onto ``base_model`` (the same base the adapter was trained on)."""
        from peft import PeftModel
        from safetensors.torch import load_file

        src = Path(directory)
        if not (src / "adapter").is_dir():
            raise FileNotFoundError(f"{src}: no adapter/ directory (not a saved CalibrationResult)")
        model = PeftModel.from_pretrained(base_model, str(src / "adapter"))
        model.eval()
        lam = load_file(str(src / "lambda.safetensors")) if (src / "lambda.safetensors").exists() else {}
        config = CalibrationConfig.from_dict(json.loads((src / "config.json").read_text()))
        history = json.loads((src / "history.json").read_text())
        saved = json.loads((src / "metrics.json").read_text())
        return cls(model, lam, history, saved["metrics"], config, saved.get("timings", {}))


def _evaluate(losses: CalmLosses, data: _Encoded, pad_id: int, batch_size: int = 16) -> dict[str, float]:
    """Held-out metrics of the deployed model (no adjustment), computed in inference mode.

    The per-question statistics come from :meth:`CalmLosses.monitor
    <llm_calib.calm.objectives.CalmLosses.monitor>`: exact option metrics for multiple choice, a
    teacher-forced proxy of greedy answering for open questions. The keys are the same for both,
    so model selection and the accuracy guard do not depend on the kind of record.
    """
    parts = []
    with torch.inference_mode():
        for start in range(0, len(data.records), batch_size):
            batch = data.batch(range(start, min(start + batch_size, len(data.records))), pad_id, losses.lm)
            parts.append(losses.monitor(batch))
    stats = {k: torch.cat([part[k] for part in parts]) for k in parts[0]}
    conf, correct = stats["confidence"], stats["correct"]
    return {
        "accuracy": float(correct.mean()),
        "ece": float(ece_metric(conf.numpy(), correct.numpy(), n_bins=10)),
        "nll": float(stats["nll"].mean()),
        "entropy": float(stats["entropy"].mean()),
        "confidence": float(conf.mean()),
    }


def _tree_to_flat(prefix: str, tree: dict[str, Any], out: dict[str, Tensor]) -> None:
    for k, v in tree.items():
        if isinstance(v, dict):
            _tree_to_flat(f"{prefix}{k}/", v, out)
        elif isinstance(v, Tensor):
            out[f"{prefix}{k}"] = v


def _flat_to_tree(prefix: str, flat: dict[str, Tensor]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in flat.items():
        if not key.startswith(prefix):
            continue
        parts = key[len(prefix) :].split("/")
        node = out
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = value
    return out


def _theta_optimizer(config: CalibrationConfig) -> hg.inner.Adam:
    # Adam moves every coordinate by about lr per step: the output log-scale needs its own rate
    # to travel a useful distance (log 2 for T = 2) within a run's few dozen steps.
    return hg.inner.Adam(lr=config.lr, leaf_lr={OUTPUT_LOG_SCALE: config.output_scale_lr} if config.output_scale else {})


def _make_method(config: CalibrationConfig) -> Any:
    w_opt = _theta_optimizer(config)
    if config.solver == "bome":
        return hg.BOME(
            hg.inner.SGD(lr=config.inner_lr), w_lr=config.lr, inner_steps=config.inner_steps,
            eta=config.bome_eta, barrier=config.bome_barrier, w_optimizer=w_opt,
        )
    return hg.Penalty(sigma=config.f2sa_sigma, inner_optimizer=w_opt, inner_steps=config.inner_steps)


def calibrate(
    model: Any,
    tokenizer: Any,
    train: Sequence[MultipleChoice] | Sequence[OpenQA],
    heldout: Sequence[MultipleChoice] | Sequence[OpenQA],
    config: CalibrationConfig | None = None,
    *,
    checkpoint_dir: str | os.PathLike[str] | None = None,
    resume: bool = False,
    progress: bool = True,
) -> CalibrationResult:
    """Fine-tune ``model`` (LoRA) so that its confidence is calibrated; return the result.

    Args:
        model: a Hugging Face causal LM; LoRA adapters are attached to it (its own weights stay
            frozen). Pass a fresh copy per run.
        tokenizer: its tokenizer.
        train: labelled questions for the lower level (task cross-entropy): all
            multiple-choice, or all open questions (trained on their first reference alias).
        heldout: held-out questions of the same kind. Their inputs feed the upper-level entropy
            objective; their labels are used only for monitoring, model selection and the
            accuracy guard (for open questions through a teacher-forced proxy, see
            :meth:`CalmLosses.monitor <llm_calib.calm.objectives.CalmLosses.monitor>`).
        config: the run's configuration (default :class:`CalibrationConfig()`).
        checkpoint_dir: where to write checkpoints every ``config.checkpoint_every`` steps.
        resume: continue from the newest checkpoint in ``checkpoint_dir`` when there is one. The
            checkpoint must come from the same configuration (``steps`` and
            ``checkpoint_every`` may differ) and the same records.
        progress: show a tqdm progress bar (loss, entropy, held-out ECE).

    Returns:
        A :class:`CalibrationResult`.

    Raises:
        TrainingDiverged: when a loss or update is NaN/inf (names the step and the batch).
        ValueError: records of both kinds, or of another type (names the record); ``resume``
            from a checkpoint of another configuration or other data (names the fields).

    Example:
        >>> from llm_calib.models import tiny_random_model
        >>> from llm_calib.data import builtin_multiple_choice
        >>> model, tok = tiny_random_model()
        >>> qs = builtin_multiple_choice(n_per_domain=4, domains=["capitals"])
        >>> cfg = CalibrationConfig(steps=2, batch_size=2, heldout_batch_size=2, eval_every=1)
        >>> res = calibrate(model, tok, qs[:2], qs[2:], cfg, progress=False)
        >>> sorted(res.metrics)
        ['after', 'before']
        >>> from llm_calib.data import OpenQA
        >>> open_qs = [OpenQA(f"What is {i} + 1?", (str(i + 1),), "sums", f"s{i}") for i in range(4)]
        >>> res = calibrate(tiny_random_model()[0], tok, open_qs[:2], open_qs[2:], cfg, progress=False)
        >>> sorted(res.metrics["after"])[:3]
        ['accuracy', 'confidence', 'ece']
    """
    config = config or CalibrationConfig()
    # Check the kinds before touching the model, so a bad mix fails fast and names the record.
    kind = record_kind(train, what="train")
    record_kind(heldout, what="heldout", expected=kind)
    distributed.init_from_env()  # under torchrun: join the process group (gloo on CPU, nccl on GPU)
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    torch.manual_seed(config.seed)
    peft_model = attach_lora(model, config.lora, output_scale=config.output_scale)
    peft_model.eval()  # no dropout randomness unless configured; LoRA dropout is applied in eval too when > 0
    lm = FunctionalLM(peft_model)
    vocab = lm.head.out_features if hasattr(lm.head, "out_features") else lm.base.config.vocab_size
    train_enc = encode_batch_source(tokenizer, train, config)
    heldout_enc = encode_batch_source(tokenizer, heldout, config)
    if config.adjustment == "answer_tokens":
        tokens = {t for src in (train_enc, heldout_enc) for opts in src.options for o in opts for t in o}
        adjustment = LogitAdjustment.for_tokens(sorted(tokens), vocab, max_log_scale=config.max_log_scale, max_bias=config.max_bias)
    else:
        adjustment = LogitAdjustment(config.adjustment, vocab, max_log_scale=config.max_log_scale, max_bias=config.max_bias)
    losses = CalmLosses(lm, adjustment, config.normalize, config.label_smoothing, config.penalty_beta)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    timings["setup"] = time.perf_counter() - t0

    theta = lm.theta()
    # λ in the float precision of the model (float32 for half-precision models)
    lam = adjustment.init(dtype=torch.float64 if lm.dtype == torch.float64 else torch.float32, device=lm.device)
    lam_params = {k: v.clone().requires_grad_(True) for k, v in lam.items()}
    lam_optimizer = torch.optim.Adam(list(lam_params.values()), lr=config.lam_lr)
    theta_opt = _theta_optimizer(config)
    theta_opt_state = theta_opt.init(theta)
    method_state: dict[str, Any] | None = None
    stopped_early = False
    history: list[dict[str, float]] = []
    start_step = 0
    t_eval = time.perf_counter()
    before = _evaluate(losses, heldout_enc, pad_id)
    timings["evaluate_before"] = time.perf_counter() - t_eval
    best = {"ece": before["ece"], "step": 0}
    best_theta = {k: v.clone() for k, v in theta.items()}
    best_lam = {k: v.detach().clone() for k, v in lam_params.items()}

    run_data = _data_fingerprint(train, heldout) if checkpoint_dir is not None else None
    if resume and checkpoint_dir is not None and (ckpt := latest_checkpoint(checkpoint_dir)) is not None:
        tensors, state = load_checkpoint(ckpt)
        _check_resumable(ckpt, state, config, run_data)
        tensors = {k: v.to(lm.device) for k, v in tensors.items()}
        theta = _flat_to_tree("theta/", tensors)
        best_theta = _flat_to_tree("best_theta/", tensors)
        for k, v in _flat_to_tree("lam/", tensors).items():
            with torch.no_grad():
                lam_params[k].copy_(v)
        best_lam = _flat_to_tree("best_lam/", tensors)
        theta_opt_state = _flat_to_tree("theta_opt/", tensors)
        method_state = _flat_to_tree("method/", tensors) or None
        lam_optimizer.load_state_dict(state["lam_optimizer"])
        history, best, start_step, before = state["history"], state["best"], state["step"], state["before"]
        torch.set_rng_state(state["rng"])
        stopped_early = bool(state.get("stopped_early", False))

    method = _make_method(config) if config.method == "calm" else None
    problem = hg.BilevelProblem(inner=losses.inner, outer=losses.outer) if method else None
    bar = tqdm(range(start_step, config.steps if not stopped_early else start_step), desc=f"calibrate[{config.method}]", disable=not progress or distributed.rank() != 0,
               initial=start_step, total=config.steps, dynamic_ncols=True)
    t_train = time.perf_counter()
    step = start_step
    for step in bar:
        inner_idx = _shard(_batch_indices(len(train_enc.records), config.batch_size, step, config.seed, 0))
        inner_batch = train_enc.batch(inner_idx, pad_id, lm)
        record: dict[str, float] = {"step": step + 1}
        try:
            if method is not None:
                outer_idx = _shard(_batch_indices(len(heldout_enc.records), config.heldout_batch_size, step, config.seed, 1))
                outer_batch = heldout_enc.batch(outer_idx, pad_id, lm)
                lam_now = {k: v.detach() for k, v in lam_params.items()}
                r = method.hypergrad(problem, theta, lam_now, inner_batch, outer_batch, method_state)
                lam_optimizer.zero_grad(set_to_none=False)
                for k, p in lam_params.items():
                    p.grad = r.grad[k].detach().clone()
                lam_optimizer.step()
                adjustment.clamp_(lam_params)
                theta, method_state = r.w, r.state
                record.update({k: float(v) for k, v in r.info.extra.items() if isinstance(v, (int, float))})
            else:
                loss, grad, _ = hg.autodiff.loss_and_grads(
                    lambda w, _lam, b=inner_batch: losses.baseline(config.method, w, b), theta, {"_": torch.zeros(1)},
                    wrt_lam=False, what=f"{config.method} loss",
                )
                with torch.no_grad():
                    theta, theta_opt_state = theta_opt.update(theta, grad, theta_opt_state)
                theta = {k: v.detach() for k, v in theta.items()}
                record["loss"] = float(loss)
            hg.tree.check_finite(theta, "updated LoRA parameters")
        except (hg.NonFiniteError, FloatingPointError) as err:
            raise TrainingDiverged(
                f"step {step + 1}: {err}; batch ids {inner_batch.ids[:8]}{'...' if len(inner_batch.ids) > 8 else ''}. "
                "No checkpoint was written for this step; lower the learning rates or check the data."
            ) from err
        done = step + 1
        if done % config.eval_every == 0 or done == config.steps:
            lm.load_theta(theta)
            metrics = _evaluate(losses, heldout_enc, pad_id)
            record.update({f"heldout_{k}": v for k, v in metrics.items()})
            record.update(_parameter_summary(theta, lam_params if config.method == "calm" else {}))
            if metrics["accuracy"] + 1e-12 >= config.guard_accuracy * before["accuracy"] and metrics["ece"] < best["ece"]:
                best = {"ece": metrics["ece"], "step": done, "violations": 0}
                best_theta = {k: v.clone() for k, v in theta.items()}
                best_lam = {k: v.detach().clone() for k, v in lam_params.items()}
            shown = {"loss": record["loss"]} if "loss" in record else {"q": record["q"]} if "q" in record else {}
            bar.set_postfix(**{k: f"{v:.3g}" for k, v in shown.items()}, ece=f"{metrics['ece']:.3f}",
                            acc=f"{metrics['accuracy']:.3f}", H=f"{metrics['entropy']:.3f}")
            history.append(record)
            below = metrics["accuracy"] < config.guard_accuracy * before["accuracy"]
            best["violations"] = best.get("violations", 0) + 1 if below else 0
            if best["violations"] >= config.guard_patience:
                stopped_early = True
        else:
            history.append(record)
        due = config.checkpoint_every and (done % config.checkpoint_every == 0 or stopped_early)
        if checkpoint_dir is not None and due and distributed.rank() == 0:
            _save(checkpoint_dir, done, theta, best_theta, lam_params, best_lam, theta_opt_state, method_state,
                  lam_optimizer, history, best, before, stopped_early, run={"config": config.to_dict(), "data": run_data})
        if stopped_early:
            break
    timings["train"] = time.perf_counter() - t_train
    lm.load_theta(best_theta)
    t_eval = time.perf_counter()
    after = _evaluate(losses, heldout_enc, pad_id)
    timings["evaluate_after"] = time.perf_counter() - t_eval
    after["selected_step"] = float(best["step"])
    after["stopped_early"] = float(stopped_early)
    return CalibrationResult(peft_model, best_lam, history, {"before": before, "after": after}, config, timings)


def _parameter_summary(theta: dict[str, Tensor], lam: dict[str, Tensor]) -> dict[str, float]:
    """The trajectory diagnostics logged at each evaluation: the output log-scale and λ's size."""
    out = {}
    if OUTPUT_LOG_SCALE in theta:
        out[OUTPUT_LOG_SCALE] = float(theta[OUTPUT_LOG_SCALE])
    for name, value in lam.items():
        v = value.detach().double()
        out[f"lambda_{name}_mean"] = float(v.mean())
        out[f"lambda_{name}_absmax"] = float(v.abs().max())
    return out


# Fields a resumed run may change: how long it runs and how often it saves. Any other difference
# would silently splice two different runs into one trajectory.
_RESUMABLE_CHANGES = ("steps", "checkpoint_every")


def _data_fingerprint(train: Sequence[Any], heldout: Sequence[Any]) -> dict[str, Any]:
    """Counts and a hash of the record ids and contents, to recognise the data a checkpoint saw."""
    digest = hashlib.sha256()
    for part in (train, heldout):
        for r in part:
            digest.update(repr(r).encode())
        digest.update(b"|")
    return {"train": len(train), "heldout": len(heldout), "sha256": digest.hexdigest()[:16]}


def _check_resumable(path: Path, state: dict[str, Any], config: CalibrationConfig, data: dict[str, Any]) -> None:
    saved = state.get("run")
    if saved is None:  # checkpoints written before configs were recorded
        return
    now = config.to_dict()
    changed = sorted(k for k in set(now) | set(saved["config"])
                     if k not in _RESUMABLE_CHANGES and now.get(k) != saved["config"].get(k))
    if changed:
        diffs = "; ".join(f"{k}: checkpoint {saved['config'].get(k)!r}, now {now.get(k)!r}" for k in changed)
        raise ValueError(f"cannot resume from {path}: the configuration differs ({diffs}). Use the checkpoint's "
                         f"configuration, or another checkpoint_dir to start a new run.")
    if saved["data"] != data:
        raise ValueError(f"cannot resume from {path}: it was trained on other data (checkpoint: "
                         f"{saved['data']['train']} train / {saved['data']['heldout']} held-out records, hash "
                         f"{saved['data']['sha256']}; now {data['train']} / {data['heldout']}, hash {data['sha256']}).")


def _save(directory, step, theta, best_theta, lam_params, best_lam, theta_opt_state, method_state, lam_optimizer,
          history, best, before, stopped_early=False, run=None) -> None:
    tensors: dict[str, Tensor] = {}
    _tree_to_flat("theta/", theta, tensors)
    _tree_to_flat("best_theta/", best_theta, tensors)
    _tree_to_flat("lam/", {k: v.detach() for k, v in lam_params.items()}, tensors)
    _tree_to_flat("best_lam/", best_lam, tensors)
    _tree_to_flat("theta_opt/", theta_opt_state, tensors)
    if method_state:
        _tree_to_flat("method/", method_state, tensors)
    state = {
        "step": step, "history": history, "best": best, "before": before, "stopped_early": stopped_early,
        "lam_optimizer": lam_optimizer.state_dict(), "rng": torch.get_rng_state(), "run": run,
    }
    save_checkpoint(directory, step, tensors, state)

