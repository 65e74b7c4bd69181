"""The open-ended format: greedy answers to open questions; training packs prompt + reference answer."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import Tensor

from llm_calib.confidence.kinds import JudgedSet, OpenConfidence, score_open
from llm_calib.confidence.sampled import SampledSet
from llm_calib.confidence.token import OpenEndedSet, encode_open_prompts
from llm_calib.data.records import OpenQA
from llm_calib.engine.packing import PackedQuestions, pack_continuations, reduce_per_option
from llm_calib.formats.base import TaskFormat
from llm_calib.formats.categorical import entropy
from llm_calib.formats.registry import register_format
from llm_calib.prompts.templates import PromptFormat, continuation_text
from llm_calib.scoring.base import ScoredResult, encode_continuation

if TYPE_CHECKING:
    from llm_calib.adjustment import LogitAdjustment
    from llm_calib.training_interface import Batch, Losses

__all__ = ["OpenEnded"]


@register_format("open_ended")
@dataclass(frozen=True)
class OpenEnded(TaskFormat):
    """Open questions answered greedily; exact match against the accepted answers.

    Args:
        prompt: the prompt format (cloze); None: ``PromptFormat()``.
        max_new_tokens: generation budget per answer.
        answer_stop: train each reference with the newline greedy answering stops at (the
            short-answer prompt); :meth:`monitor` leaves it out of the confidence, as scoring does.
        confidence: how scored answers get their confidence
            (:class:`~llm_calib.confidence.kinds.OpenConfidence`: ``token``, ``semantic``,
            ``p_true`` or ``verbalized``); None: ``token``. Training is the same for every kind.

    Example:
        >>> from llm_calib.models import tiny_random_model
        >>> model, tok = tiny_random_model()
        >>> qs = [OpenQA("Capital of France?", ("Paris",), "geo", "q0")]
        >>> fmt = OpenEnded(max_new_tokens=3)
        >>> prompts, answers = fmt.encode(tok, qs)
        >>> tok.decode(answers[0][0]), fmt.label(qs[0]), len(fmt.score(model, tok, qs))
        (' Paris', 0, 1)
    """

    prompt: PromptFormat | None = None
    max_new_tokens: int = 32
    answer_stop: bool = False
    confidence: OpenConfidence | None = None

    name: ClassVar[str]
    family: ClassVar[str] = "open"
    layout: ClassVar[str] = "open"
    auto_adjustment: ClassVar[str] = "vector"
    description: ClassVar[str] = "open-ended (exact match)"
    default_prompt: ClassVar[PromptFormat] = PromptFormat()
    upper_families: ClassVar[tuple[str, ...]] = ("open", "multiple_choice")
    training_notes: ClassVar[tuple[str, ...]] = (
        "- trained on open questions (token cross-entropy of the first reference answer); the "
        "held-out accuracy and ECE of the training table are what model selection read (the line "
        "under the table: the generated answers' by default, or the teacher-forced proxy)",
    )

    @classmethod
    def domain_notes(cls, metrics: dict[str, float]) -> list[str]:
        """The confidence used (read off the metrics each kind reports) and the token F1 or cluster count."""
        if "mean_clusters" in metrics:
            return [f"Confidence = semantic: the share of {metrics.get('samples', float('nan')):.0f} sampled answers in "
                    f"the modal answer's meaning cluster (ECE here is Sem-ECE); {metrics['mean_clusters']:.2f} "
                    "clusters per question on average."]
        f1 = f"token F1 {metrics.get('f1', float('nan')):.3f}"
        if "ece_token" in metrics:
            unscored = int(metrics.get("unscored", 0))
            left_out = f"; {unscored} answer(s) without a readable confidence left out" if unscored else ""
            return [f"Confidence = the model's own judgement of its greedy answer (P(True) or stated); "
                    f"{f1}; token-confidence ECE {metrics['ece_token']:.3f}{left_out}."]
        return [f"Confidence = mean answer-token probability; {f1}."]

    # --- training encoding --------------------------------------------------------------------
    def encode(self, tokenizer: Any, records: Sequence[OpenQA]) -> tuple[list[tuple[int, ...]], list[tuple[tuple[int, ...], ...]]]:
        """The scorer's prompt ids, and ``" " + first alias`` (plus ``"\\n"`` with ``answer_stop``) as the one
        continuation.

        Raises:
            ValueError: an open question without a reference answer (naming it).
        """
        unanswered = [r.id for r in records if not r.answers]
        if unanswered:
            raise ValueError(f"open question {unanswered[0]!r} has no reference answer to train or monitor on")
        stop = "\n" if self.answer_stop else ""
        answers = [(tuple(encode_continuation(tokenizer, continuation_text(r.answers[0]) + stop)),) for r in records]
        prompts = encode_open_prompts(tokenizer, records, self.prompt, reserve=[len(a[0]) for a in answers])
        return [tuple(p) for p in prompts], answers

    def pack(self, prompts: Sequence[Sequence[int]], options: Sequence[Sequence[Sequence[int]]], pad_id: int) -> PackedQuestions:
        """Prompt + reference answer, a plain causal sequence
        (:func:`~llm_calib.engine.packing.pack_continuations`)."""
        return pack_continuations([(p, o[0]) for p, o in zip(prompts, options, strict=True)], pad_id)

    def label(self, record: OpenQA) -> int:
        """0: the one "option" of an open question is its reference answer."""
        return 0

    # --- training-loss view -------------------------------------------------------------------
    def check_adjustment(self, adjustment: LogitAdjustment) -> None:
        """Raise ValueError for an option-level adjustment: open questions have no options."""
        if adjustment.acts_on_options:
            raise ValueError(
                f"adjustment {adjustment.kind!r} acts on option scores; open questions need a token-level "
                "adjustment ('vector', 'temperature' or 'answer_tokens')"
            )

    def categorical(
        self, losses: Losses, theta: dict[str, Tensor] | None, lam: dict[str, Tensor] | None, batch: Batch
    ) -> tuple[Tensor, Tensor, Callable[[Tensor], Tensor]]:
        """One vocabulary distribution per answer token, its reference token, and the per-answer mean."""
        packed = batch.packed
        if lam is not None:
            self.check_adjustment(losses.adjustment)
        logits = losses.logits(theta, lam, batch)
        on = packed.on(logits.device)  # copied once per batch
        return (
            logits[on.target_rows],
            on.target_ids,
            lambda per_token: reduce_per_option(per_token, packed, "mean"),
        )

    def deployed_entropy(self, losses: Losses, theta: dict[str, Tensor] | None, batch: Batch) -> Tensor:
        """Entropy of the unadjusted next-token distribution at the first answer position."""
        return entropy(losses.logits(theta, None, batch, batch.packed.answer_start_rows()))

    def monitor(self, losses: Losses, batch: Batch) -> dict[str, Tensor]:
        """A teacher-forced proxy of greedy answering."""
        packed = batch.packed
        logp = torch.log_softmax(losses.logits(None, None, batch).double(), -1).cpu()
        token_logp = logp[packed.target_rows]
        top_logp, top = token_logp.max(-1)
        wrong = (top != packed.target_ids).double()
        token_nll = -token_logp[torch.arange(len(packed.target_ids)), packed.target_ids]
        top_p = top_logp.exp()
        if self.answer_stop:  # leave each answer's final (stop) token out of the confidence
            option = packed.target_option
            pos = torch.arange(len(option))
            last = torch.full((len(packed.option_lengths),), -1, dtype=torch.long).scatter_reduce(
                0, option, pos, "amax")
            keep = (pos != last[option]) | (packed.option_lengths[option] == 1)
            confidence = (reduce_per_option(top_p * keep, packed, "sum")
                          / reduce_per_option(keep.double(), packed, "sum"))
        else:
            confidence = reduce_per_option(top_p, packed, "mean")
        return {"confidence": confidence, "correct": (reduce_per_option(wrong, packed, "sum") == 0).double(),
                "nll": reduce_per_option(token_nll, packed, "mean"),
                "entropy": entropy(logp[packed.answer_start_rows()])}

    # --- scoring and results ------------------------------------------------------------------
    def score(self, model: Any, tokenizer: Any, records: Sequence[OpenQA], *, batch_size: int = 8,
              progress: bool = False) -> ScoredResult:
        """:func:`~llm_calib.confidence.kinds.score_open` under the format's confidence kind."""
        return score_open(model, tokenizer, records, self.confidence, prompt=self.prompt,
                          max_new_tokens=self.max_new_tokens, batch_size=batch_size, progress=progress)

    def sample_rows(self, domain: str, scored: ScoredResult) -> Iterator[dict[str, Any]]:
        """Per question: ``prompt``, ``answer``, ``references``, ``confidence``, ``correct``, and what
        the confidence came from: token ids and probabilities, ``f1`` and ``stop`` (greedy answers),
        ``samples`` and their ``clusters`` (semantic), the model's ``reply`` (verbalized)."""
        if isinstance(scored, SampledSet):
            yield from _sampled_rows(domain, scored)
            return
        s: OpenEndedSet = scored  # type: ignore[assignment]
        conf, correct, f1 = s.confidences, s.correct, s.f1
        for i in range(len(s)):
            d = s.details[i] if s.details is not None else {}
            row = {
                "id": s.ids[i], "domain": domain, "prompt": d.get("prompt"), "answer": s.answers[i],
                "references": list(s.references[i]), "token_ids": d.get("token_ids"),
                "token_probs": list(s.token_probs[i]), "confidence": _json_float(conf[i]), "correct": bool(correct[i]),
                "f1": float(f1[i]), "stop": d.get("stop"),
            }
            if isinstance(s, JudgedSet):
                row["token_confidence"] = float(s.confidence("mean")[i])
                if "reply" in d:
                    row["reply"] = d["reply"]
            yield row


def _json_float(value: float) -> float | None:
    """A confidence for a JSON line: None where there is none (an unparsed verbalized reply)."""
    return None if value != value else float(value)


def _sampled_rows(domain: str, s: SampledSet) -> Iterator[dict[str, Any]]:
    conf, correct = s.confidences, s.correct
    for i in range(len(s)):
        d = s.details[i] if s.details is not None else {}
        sem = s.semantic[i]
        yield {
            "id": s.ids[i], "domain": domain, "prompt": d.get("prompt"), "answer": sem.answer,
            "references": list(s.references[i]), "samples": list(s.samples[i]), "clusters": list(sem.labels),
            "confidence": _json_float(conf[i]), "plug_in": sem.plug_in, "sample_split": _json_float(sem.sample_split),
            "correct": bool(correct[i]), "stop": d.get("stop"),
        }
