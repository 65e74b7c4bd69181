"""Fast evaluation of many top-layer LoRA models that share one frozen base (trunk caching).

When every model adapts only the top layers, the hidden states entering the first adapted layer
(the trunk) are the base model's: they are computed once, in the base model's own full pass, and
each adapted model runs only its top layers. Multiple choice: :func:`base_scores` then
:func:`trunk_scores`; open questions: the engine's :class:`~llm_calib.engine.decode.TrunkGenerator`;
both over named sets: :class:`SharedTrunkEval`. The numbers are the plain scorers' (to rounding).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from llm_calib.calm.encoding import EncodedRecords, encode_records
from llm_calib.calm.lora import FunctionalLM, attach_lora
from llm_calib.calm.run import task_format
from llm_calib.confidence.token import OpenEndedSet, encode_open_prompts
from llm_calib.config.calibration import LoraSettings
from llm_calib.data.records import OpenQA
from llm_calib.engine.decode import GenOut, TrunkGenerator
from llm_calib.engine.options import forward_rows
from llm_calib.engine.packing import (
    LENGTH_NORMALIZATIONS,
    PackedQuestions,
    length_batches,
    option_scores_from_logits,
)
from llm_calib.formats.base import TaskFormat
from llm_calib.models import lm_head_logits, split_decoder_head
from llm_calib.prompts.resolution import ResolvedPromptSettings
from llm_calib.scoring.base import ScoredSet

__all__ = [
    "SharedTrunkEval", "base_scores", "fill_trunk_caches", "open_ended_set", "trunk_scores",
]


def base_scores(model: Any, enc: EncodedRecords, trunk_layers: int, batch_size: int, pad_id: int,
                normalize: str = "sum", bar: Any = None) -> list[Tensor]:
    """Full-model float64 option scores per question; the trunk entering layer ``trunk_layers`` is kept in
    ``enc.trunk_cache``.

    Args:
        model: the base causal LM.
        enc: multiple-choice records from :func:`~llm_calib.calm.encoding.encode_records`.
        trunk_layers: the first adapted layer of the models evaluated later (0: keep no trunk).
        batch_size: questions per forward pass (batched by length).
        pad_id: padding id.
        normalize: ``"sum"``, ``"mean"``, ``"char"`` or ``"byte"`` option scores.
        bar: optional progress bar (``update(n)``).

    Example:
        >>> from llm_calib.data import builtin_multiple_choice
        >>> from llm_calib.models import tiny_random_model
        >>> model, tok = tiny_random_model()
        >>> from llm_calib.calm.run import resolve_run
        >>> qs = builtin_multiple_choice(n_per_domain=2, domains=["capitals"])
        >>> enc = encode_records(tok, qs, resolve_run(None, qs, qs).formats.lower)
        >>> scores = base_scores(model, enc, trunk_layers=1, batch_size=2, pad_id=tok.pad_token_id)
        >>> len(scores), len(enc.trunk_cache)
        (2, 2)
    """
    _, head = split_decoder_head(model)

    def forward(idx: list[int]) -> tuple[PackedQuestions, Tensor]:
        packed = enc.pack(idx, pad_id)
        hidden, trunk = forward_rows(model, packed, trunk_layer=trunk_layers)
        for row, i in enumerate(idx if trunk is not None else ()):
            enc.trunk_cache[i] = trunk[row, : enc.length(i)].clone()
        return packed, lm_head_logits(model, head, hidden)

    return _option_scores(enc, batch_size, normalize, bar, forward)


def trunk_scores(lm: FunctionalLM, enc: EncodedRecords, batch_size: int, pad_id: int, normalize: str = "sum",
                 bar: Any = None) -> list[Tensor]:
    """Option scores of a top-layer LoRA model from the cached trunk (missing entries computed on the fly).

    Raises:
        ValueError: ``lm`` does not cache a trunk (LoRA must sit on the top layers only).
    """
    if not lm.caches_trunk:
        raise ValueError("the model does not cache a trunk (LoRA must sit on the top layers only)")

    def forward(idx: list[int]) -> tuple[PackedQuestions, Tensor]:
        batch = enc.batch(idx, pad_id, lm, split=False)  # one pass over the whole batch: no parts
        return batch.packed, lm.head_logits(None, batch.packed, batch.trunk)

    return _option_scores(enc, batch_size, normalize, bar, forward)


def _option_scores(enc: EncodedRecords, batch_size: int, normalize: str, bar: Any,
                   forward: Callable[[list[int]], tuple[PackedQuestions, Tensor]]) -> list[Tensor]:
    """Float64 option scores per question, batched by length; ``forward(idx)`` gives packed questions and head
    logits."""
    scores: list[Tensor] = [torch.empty(0)] * len(enc.records)
    with torch.inference_mode():
        for idx in length_batches([enc.length(i) for i in range(len(enc))], batch_size):
            packed, logits = forward(idx)
            lengths = enc.option_text_lengths(idx, normalize) if normalize in LENGTH_NORMALIZATIONS else None
            s = option_scores_from_logits(logits, packed, normalize, lengths)
            for row, i in enumerate(idx):
                scores[i] = s[row, : len(enc.options[i])].double().cpu()
            if bar is not None:
                bar.update(len(idx))
    return scores


def open_ended_set(records: Sequence[OpenQA], outs: Sequence[GenOut], temperature_index: int | None = None) -> OpenEndedSet:
    """The :class:`~llm_calib.confidence.token.OpenEndedSet` of greedy answers (token probabilities at grid
    temperature ``temperature_index``).

    Raises:
        ValueError: ``records`` and ``outs`` differ in length, or an answer has no grid probabilities.

    Example:
        >>> import numpy as np
        >>> outs = [GenOut("Paris", (1,), (0.9,), np.array([[0.9, 0.6]]))]
        >>> s = open_ended_set([OpenQA("Capital of France?", ("Paris",), "geo", "q0")], outs, temperature_index=1)
        >>> s.correct.tolist(), s.token_probs
        ([True], [(0.6,)])
    """
    if len(records) != len(outs):
        raise ValueError(f"records and outs must have the same length, got {len(records)} and {len(outs)}")
    if temperature_index is None:
        token_probs = [o.token_probs for o in outs]
    else:
        if any(o.temp_probs is None for o in outs):
            raise ValueError("temperature_index needs answers from a base pass with a temperature grid")
        token_probs = [tuple(float(p) for p in o.temp_probs[:, temperature_index]) for o in outs]
    return OpenEndedSet([o.text for o in outs], [tuple(r.answers) for r in records], [r.domain for r in records],
                        [r.id for r in records], token_probs)


def fill_trunk_caches(model: Any, encodings: Sequence[EncodedRecords], lora: LoraSettings, pad_id: int,
                      bar: Any = None) -> int:
    """Fill the trunk caches of ``encodings`` for runs with LoRA on ``lora.layers``; return how many were computed.

    ``model`` is not modified; nothing is computed when LoRA is not on the top layers only.

    Example:
        >>> from llm_calib.data import builtin_multiple_choice
        >>> from llm_calib.models import tiny_random_model
        >>> model, tok = tiny_random_model()
        >>> from llm_calib.calm.run import resolve_run
        >>> qs = builtin_multiple_choice(n_per_domain=3, domains=["capitals"])
        >>> enc = encode_records(tok, qs, resolve_run(None, qs, qs).formats.lower)
        >>> fill_trunk_caches(model, [enc], LoraSettings(layers=(1,)), tok.pad_token_id), len(enc.trunk_cache)
        (3, 3)
    """
    import copy

    lm = FunctionalLM(attach_lora(copy.deepcopy(model), lora))
    if not lm.caches_trunk:
        return 0
    return sum(enc.fill_trunk_cache(lm, pad_id, bar=bar) for enc in encodings)


class SharedTrunkEval:
    """Score named record sets with a base model once (:meth:`base`), then with many models adapted from layer
    ``trunk_layers`` up (:meth:`adapted`).

    Args:
        model: the base causal LM (not modified).
        tokenizer: its tokenizer.
        sets: set name -> records (all of one kind), or an :class:`~llm_calib.calm.encoding.EncodedRecords`
            whose trunk cache the base pass fills.
        trunk_layers: the first adapted layer (at least 1, below the number of layers).
        settings: the run's resolved prompt settings (:attr:`~llm_calib.calm.run.ResolvedRun.settings`: the
            sets' format and normalisation); default: the default prompt settings resolved.
        batch_size: questions (prompts) per forward pass.
        max_new_tokens: open questions: the generation budget.
        temperatures: open questions: a temperature grid recorded by :meth:`base`.

    Raises:
        ValueError: no sets, an empty set, sets of both kinds, or ``trunk_layers`` out of range.

    Example:
        >>> from llm_calib.data import builtin_multiple_choice
        >>> from llm_calib.models import tiny_random_model
        >>> model, tok = tiny_random_model()
        >>> ev = SharedTrunkEval(model, tok, {"caps": builtin_multiple_choice(n_per_domain=2, domains=["capitals"])}, 1)
        >>> base = ev.base()
        >>> adapted = ev.adapted(attach_lora(model, LoraSettings(layers=(1,))))
        >>> [float((a - b).abs().max()) < 1e-5 for a, b in zip(base["caps"].logits, adapted["caps"].logits)]
        [True, True]
    """

    def __init__(self, model: Any, tokenizer: Any, sets: Mapping[str, Sequence[Any] | EncodedRecords], trunk_layers: int,
                 *, settings: ResolvedPromptSettings | None = None, batch_size: int = 16, max_new_tokens: int = 10,
                 temperatures: Sequence[float] | None = None) -> None:
        if not sets or any(len(v) == 0 for v in sets.values()):
            raise ValueError("sets must name at least one non-empty record set")
        n_layers = int(model.config.num_hidden_layers)
        if not 0 < trunk_layers < n_layers:
            raise ValueError(f"trunk_layers must be in [1, {n_layers - 1}], got {trunk_layers}")
        self.model, self.tokenizer, self.trunk_layers = model, tokenizer, trunk_layers
        self.batch_size = batch_size
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        records = {k: v.records if isinstance(v, EncodedRecords) else list(v) for k, v in sets.items()}
        # the kind of the sets is read here, once: the first set's format, the others checked against it
        (first, first_set), *_ = sets.items()
        if settings is None:
            settings = ResolvedPromptSettings.default()
        fmt = (first_set.format if isinstance(first_set, EncodedRecords)
               else task_format(records[first], settings, what=first))
        for name, recs in records.items():
            fmt.check(recs, what=name)
        self.format: TaskFormat = fmt
        self.normalize = settings.normalize
        self.records = records
        sets_class = next(c for c in (_ChoiceSets, _AnswerSets) if c.family == fmt.family)
        self._sets = sets_class(self, sets, max_new_tokens, temperatures)

    @property
    def base_outputs(self) -> dict[str, list[GenOut]]:
        """Open questions: the base model's generations per set (after :meth:`base`); else empty."""
        return getattr(self._sets, "base_outputs", {})

    def __len__(self) -> int:
        return sum(len(v) for v in self.records.values())

    def base(self, *, keep_trunk: bool = True, bar: Any = None) -> dict[str, ScoredSet | OpenEndedSet]:
        """The base model's scored sets; with ``keep_trunk`` the trunk is kept for :meth:`adapted`."""
        return self._sets.base(keep_trunk, bar)

    def scaled(self, temperature_index: int) -> dict[str, OpenEndedSet]:
        """Open questions: the base answers at grid temperature ``temperature_index`` (after :meth:`base`)."""
        if not self.base_outputs:
            raise RuntimeError("scaled() needs the answers of base() on open questions")
        return {n: open_ended_set(self.records[n], o, temperature_index) for n, o in self.base_outputs.items()}

    def adapted(self, model: Any, *, normalize: str | None = None, bar: Any = None) -> dict[str, ScoredSet | OpenEndedSet]:
        """The scored sets of ``model`` (LoRA on the top layers only), after :meth:`base`; ``normalize`` defaults
        to the config's.

        Raises:
            ValueError: ``model``'s adapted layers do not start at ``trunk_layers``.
        """
        return self._sets.adapted(model, normalize, bar)


class _ChoiceSets:
    """Multiple-choice sets of a :class:`SharedTrunkEval`: option scores from the base pass, then each model's top
    layers."""

    family = "multiple_choice"  # the format family (record kind) these sets score

    def __init__(self, ev: SharedTrunkEval, sets: Mapping[str, Sequence[Any] | EncodedRecords], max_new_tokens: int,
                 temperatures: Sequence[float] | None) -> None:
        self.ev = ev
        self.encodings = {k: v if isinstance(v, EncodedRecords) else encode_records(ev.tokenizer, v, ev.format)
                          for k, v in sets.items()}

    def _scored(self, name: str, scores: list[Tensor]) -> ScoredSet:
        return ScoredSet.from_records(self.ev.records[name], scores, "option_likelihood", {})

    def base(self, keep_trunk: bool, bar: Any) -> dict[str, ScoredSet]:
        ev = self.ev
        k = ev.trunk_layers if keep_trunk else 0
        return {n: self._scored(n, base_scores(ev.model, enc, k, ev.batch_size, ev.pad_id, ev.normalize, bar))
                for n, enc in self.encodings.items()}

    def adapted(self, model: Any, normalize: str | None, bar: Any) -> dict[str, ScoredSet]:
        ev = self.ev
        lm = FunctionalLM(model)
        if lm.trunk_layers != ev.trunk_layers:
            raise ValueError(f"the model's adapted layers start at {lm.trunk_layers}, expected {ev.trunk_layers}")
        norm = normalize or ev.normalize
        return {n: self._scored(n, trunk_scores(lm, enc, ev.batch_size, ev.pad_id, norm, bar))
                for n, enc in self.encodings.items()}


class _AnswerSets:
    """Open-question sets of a :class:`SharedTrunkEval`: greedy answers (one :class:`TrunkGenerator` over all
    sets)."""

    family = "open"  # the format family (record kind) these sets score

    def __init__(self, ev: SharedTrunkEval, sets: Mapping[str, Sequence[Any] | EncodedRecords], max_new_tokens: int,
                 temperatures: Sequence[float] | None) -> None:
        self.ev = ev
        flat = [r for recs in ev.records.values() for r in recs]
        prompts = encode_open_prompts(ev.tokenizer, flat, ev.format.prompt_settings(), reserve=max_new_tokens)
        self.generator = TrunkGenerator(ev.tokenizer, prompts, ev.batch_size, max_new_tokens, ev.trunk_layers,
                                        temperatures, until=[getattr(r, "until", None) for r in flat])
        self.base_outputs: dict[str, list[GenOut]] = {}

    def _split(self, outs: Sequence[GenOut]) -> dict[str, list[GenOut]]:
        out, start = {}, 0
        for name, recs in self.ev.records.items():
            out[name] = list(outs[start : start + len(recs)])
            start += len(recs)
        return out

    def base(self, keep_trunk: bool, bar: Any) -> dict[str, OpenEndedSet]:
        outs = self.generator.base(self.ev.model, keep_trunk=keep_trunk, temperatures=True, bar=bar)
        self.base_outputs = self._split(outs)
        return {n: open_ended_set(self.ev.records[n], o) for n, o in self.base_outputs.items()}

    def adapted(self, model: Any, normalize: str | None, bar: Any) -> dict[str, OpenEndedSet]:
        return {n: open_ended_set(self.ev.records[n], o) for n, o in self._split(self.generator.trained(model, bar)).items()}

