"""The task-format interface: one object per format owns encoding, the training-loss view,
scoring and the result type; evaluation, the report and the trainer go through it without
asking which kind of question they hold."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import pytest
import torch
from _benchmarks import BENCHMARKS  # noqa: F401  (puts benchmarks/ on sys.path for harness)
from harness.evaluation import summarize_scored

from llm_calib.adjustment import LogitAdjustment
from llm_calib.calm import training
from llm_calib.calm.encoding import encode_records
from llm_calib.calm.run import resolve_run, task_format
from llm_calib.confidence.token import OpenEndedSet
from llm_calib.config.calibration import CalibrationConfig
from llm_calib.data import builtin_multiple_choice
from llm_calib.data.records import MultipleChoice, OpenQA
from llm_calib.evaluation.evaluate import evaluate_records, sample_rows
from llm_calib.evaluation.report import markdown_report
from llm_calib.formats import (
    Letter,
    OpenEnded,
    OptionLikelihood,
    RecordKindError,
    ScoredResult,
    TaskFormat,
    family_format,
    format_for,
)
from llm_calib.metrics import calibration as metrics
from llm_calib.models import tiny_random_model
from llm_calib.prompts.resolution import open_prompt_format, resolve_prompt_settings
from llm_calib.prompts.templates import PromptFormat
from llm_calib.scoring import ScoredSet


def _mc(n: int = 3, domains: Sequence[str] = ("capitals",)) -> list[MultipleChoice]:
    return builtin_multiple_choice(n, seed=0, domains=list(domains))


def _open(n: int = 4) -> list[OpenQA]:
    return [OpenQA(f"What is {i} + 1?", (str(i + 1),), "sums", f"s{i}") for i in range(n)]


# --- the kind is decided once, by the factory -----------------------------------------------


def test_format_for_decides_the_kind_once_and_names_a_mixed_record() -> None:
    assert isinstance(format_for(_mc()), OptionLikelihood)
    assert isinstance(format_for(_mc(), scorer="letter"), Letter)
    fmt = format_for(_open(), prompt=PromptFormat(style="listed", chat_template=False), max_new_tokens=5)
    assert isinstance(fmt, OpenEnded) and fmt.max_new_tokens == 5
    assert fmt.prompt == PromptFormat(style="cloze", chat_template=False)  # open questions list no options
    with pytest.raises(RecordKindError, match=r"train: record 's0' is OpenQA, expected multiple_choice"):
        format_for([*_mc(1), *_open(1)], what="train")
    with pytest.raises(ValueError, match="scorer must be one of"):
        format_for(_mc(), scorer="nope")
    # a format checks further record sets against its own kind
    with pytest.raises(ValueError, match="heldout: record 's0' is OpenQA"):
        format_for(_mc()).check(_open(), what="heldout")


def test_the_letter_rule_and_the_option_adjustment_rule_live_in_the_formats() -> None:
    with pytest.raises(ValueError, match="letter scorer needs the options listed"):
        Letter(PromptFormat(style="cloze"))
    assert Letter(PromptFormat(template="{question}\n{options}\nAnswer:")).prompt is not None
    # the configuration's letter scorer always gets the listed prompt, whatever prompt_style says
    assert resolve_prompt_settings(CalibrationConfig(prompt=dict(scorer="letter", style="cloze")).prompt).prompt.style == "listed"
    assert task_format(_mc(), resolve_prompt_settings(CalibrationConfig(prompt=dict(scorer="letter")).prompt)).prompt_settings().style == "listed"
    OpenEnded().check_adjustment(LogitAdjustment("vector", 10))
    with pytest.raises(ValueError, match="acts on option scores; open questions need a token-level"):
        OpenEnded().check_adjustment(LogitAdjustment("option_temperature", 10))


def test_task_format_reads_the_configuration() -> None:
    cfg = CalibrationConfig(prompt=dict(normalize="mean", style="listed", chat_template=False,
                                          open_examples=[["2 + 2?", "4"]]))
    mc = task_format(_mc(), resolve_prompt_settings(cfg.prompt))
    assert mc == OptionLikelihood("mean", PromptFormat(style="listed", chat_template=False))
    op = task_format(_open(), resolve_prompt_settings(cfg.prompt))
    assert op.answer_stop and op.prompt == open_prompt_format(cfg.prompt)
    assert family_format(mc.family) is type(mc).__mro__[1] and family_format(op.family) is OpenEnded


# --- one result interface ---------------------------------------------------------------------


def test_scored_and_open_sets_share_one_interface() -> None:
    mc = ScoredSet([torch.tensor([0.0, 2.0]), torch.tensor([1.0, 0.0]), torch.tensor([0.0, 0.0, 3.0])],
                   [1, 1, 2], ["a", "b", "a"], ["q0", "q1", "q2"])
    op = OpenEndedSet(["Paris", "Rome", "x"], [("Paris",), ("Oslo",), ("x",)], ["a", "b", "a"],
                      ["o0", "o1", "o2"], [(0.9, 0.5), (1.2,), (0.3,)])
    for s in (mc, op):
        assert isinstance(s, ScoredResult)
        assert len(s) == 3 and s.accuracy == pytest.approx(float(np.mean(s.correct)))
        assert np.all((s.confidences >= 0) & (s.confidences <= 1))
        parts = s.by_domain()
        assert list(parts) == ["a", "b"]
        merged = type(s).concat(list(parts.values()))
        assert merged.ids == [s.ids[0], s.ids[2], s.ids[1]] and len(s.select([2])) == 1
        assert summarize_scored(s, ci=False) == s.summary(ci=False)
        rb = metrics.reliability_bins(s.confidences, s.correct, n_bins=10)
        assert sum(rb.counts) == 3
    assert op.confidences[1] == 1.0  # clipped, as the open-ended metrics bin it


def test_one_evaluation_path_for_multiple_choice_and_open_sets(tiny) -> None:
    model, tok = tiny
    res = evaluate_records(model, tok, [("mc", _mc(4)), ("open", _open(4))], temperature_fit=("fit", _mc(4)),
                           ci=False, max_new_tokens=3)
    mc, op = res.domains["capitals"], res.domains["sums"]
    assert isinstance(mc.task, OptionLikelihood) and isinstance(op.task, OpenEnded)
    assert (mc.kind, op.kind) == ("multiple_choice", "open")
    assert mc.temperature_scaled is not None and op.temperature_scaled is None  # open answers have no logits
    assert mc.normalizations is not None and op.normalizations is None
    rows = list(sample_rows(res))
    assert [r["domain"] for r in rows] == ["capitals"] * 4 + ["sums"] * 4
    assert "gold" in rows[0] and "answer" in rows[-1]
    text = markdown_report(res)
    assert "4 questions, multiple choice." in text and "4 questions, open-ended (exact match)." in text


# --- a new format needs no edits to the callers --------------------------------------------


@dataclass
class _Hits:
    """A result type of its own: neither a ScoredSet nor an OpenEndedSet."""

    ids: list[str]
    domains: list[str]
    hit: list[bool]
    conf: list[float]

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def correct(self) -> np.ndarray:
        return np.asarray(self.hit)

    @property
    def confidences(self) -> np.ndarray:
        return np.asarray(self.conf)

    @property
    def accuracy(self) -> float:
        return float(np.mean(self.hit))

    def select(self, indices: Sequence[int]) -> _Hits:
        return _Hits(*([getattr(self, f.name)[i] for i in indices] for f in dataclasses.fields(self)))

    def by_domain(self) -> dict[str, _Hits]:
        return {d: self.select([i for i, x in enumerate(self.domains) if x == d]) for d in dict.fromkeys(self.domains)}

    @staticmethod
    def concat(sets: Sequence[_Hits]) -> _Hits:
        return _Hits(*([x for s in sets for x in getattr(s, f.name)] for f in dataclasses.fields(_Hits)))

    def summary(self, n_bins: int = 10, ci: bool = True, n_resamples: int = 1000, seed: int = 0) -> dict[str, float]:
        return {"n": len(self), "accuracy": self.accuracy, "ece": metrics.ece(self.confidences, self.correct, n_bins)}


@dataclass(frozen=True)
class _FirstOption(OptionLikelihood):
    """A made-up format: always answers the first option, with confidence 0.75."""

    description: ClassVar[str] = "first option"

    def score(self, model: Any, tokenizer: Any, records: Sequence[MultipleChoice], *, batch_size: int = 8,
              progress: bool = False) -> _Hits:
        return _Hits([r.id for r in records], [r.domain for r in records], [r.gold == 0 for r in records],
                     [0.75] * len(records))

    def temperature_scaled(self, scored: Any, temperature: float | None) -> None:
        return None

    def extra_metrics(self, scored: Any, n_bins: int = 10) -> None:
        return None

    def sample_rows(self, domain: str, scored: _Hits) -> Iterator[dict[str, Any]]:
        for i in range(len(scored)):
            yield {"id": scored.ids[i], "domain": domain, "correct": bool(scored.hit[i])}


def test_a_new_format_runs_through_evaluation_unchanged(tiny) -> None:
    model, tok = tiny
    qs = _mc(5, domains=("capitals", "arithmetic"))
    res = evaluate_records(model, tok, [("a", qs[:4]), ("b", qs[4:])], task=_FirstOption(), ci=False)
    for dom, r in res.domains.items():
        first = [q.gold == 0 for q in qs if q.domain == dom]
        assert isinstance(r.scored, _Hits) and r.n == len(first)
        assert r.uncalibrated["accuracy"] == pytest.approx(np.mean(first))
    assert [row["id"] for row in sample_rows(res)] == [q.id for d in res.domains for q in qs if q.domain == d]
    with pytest.raises(TypeError, match="all MultipleChoice or all OpenQA"):
        evaluate_records(model, tok, [("open", _open())], task=_FirstOption())


@dataclass(frozen=True)
class _Counting(OpenEnded):
    """The open-ended format, counting what the trainer asks of it."""

    calls: dict[str, int] = dataclasses.field(default_factory=dict, compare=False, hash=False)

    def _count(self, name: str) -> None:
        self.calls[name] = self.calls.get(name, 0) + 1

    def categorical(self, losses: Any, theta: Any, lam: Any, batch: Any) -> Any:
        self._count("categorical")
        return super().categorical(losses, theta, lam, batch)

    def deployed_entropy(self, losses: Any, theta: Any, batch: Any) -> Any:
        self._count("deployed_entropy")
        return super().deployed_entropy(losses, theta, batch)

    def monitor(self, losses: Any, batch: Any) -> Any:
        self._count("monitor")
        return super().monitor(losses, batch)


def test_training_goes_through_the_batch_format() -> None:
    model, tok = tiny_random_model(seed=0, init_std=0.1)
    cfg = CalibrationConfig(training=dict(steps=2, batch_size=2, heldout_batch_size=2), selection=dict(eval_every=1))
    fmt = _Counting(PromptFormat(chat_template=cfg.prompt.chat_template), 32)
    train = encode_records(tok, _open(4), fmt)
    assert train.format is fmt and train.layout == "open"
    trainer = training.build_trainer(model, tok, train, _open(4)[:2], resolve_run(cfg, train, _open(4)[:2]))
    assert trainer.heldout.format is fmt and trainer.train_batch(0).format is fmt
    state = training.init_state(trainer)
    for _ in range(cfg.training.steps):
        training.train_step(trainer, state)
    assert fmt.calls["categorical"] > 0 and fmt.calls["deployed_entropy"] > 0 and fmt.calls["monitor"] > 0
    # open-ended training records serve a multiple-choice held-out set (the instruction-data
    # lower level); multiple-choice training still refuses open held-out records
    mixed = training.build_trainer(tiny_random_model()[0], tok, train, _mc(2), resolve_run(cfg, train, _mc(2)))
    assert mixed.train.format is fmt and mixed.heldout.layout == "options" and mixed.unlabeled is mixed.heldout
    with pytest.raises(ValueError, match="heldout: record"):
        training.build_trainer(tiny_random_model()[0], tok, _mc(2), _open(2), resolve_run(cfg, _mc(2), _open(2)))


def test_task_format_subclasses_need_the_whole_interface() -> None:
    class Half(TaskFormat):
        family = "open"
        layout = "open"
        description = "half"

    with pytest.raises(TypeError, match="abstract"):
        Half()  # type: ignore[abstract]


def test_letter_training_prompts_are_the_letter_scorer_s(tiny) -> None:
    """Training under the letter format reads the prompt the letter scorer scores (a template or a
    pre-rendered prompt included), so training and evaluation see the same text."""
    from llm_calib.prompts.templates import record_prompt
    from llm_calib.scoring.base import encode_prompt

    _, tok = tiny
    records = list(_mc())
    records[0] = dataclasses.replace(records[0], prompt="Pre-rendered: A, B or C?\nAnswer:")
    fmt = Letter(PromptFormat(template="Q: {question}\n{options}\nAnswer:", chat_template=False))
    prompts, _ = fmt.encode(tok, records)
    assert prompts == [tuple(encode_prompt(tok, record_prompt(tok, r, fmt.prompt), chat=False)) for r in records]
    assert tok.decode(prompts[0]).startswith("Pre-rendered") and "Q: " in tok.decode(prompts[1])
