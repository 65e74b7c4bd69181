"""Records tokenised once for training and evaluation, with an optional trunk cache.

An encoding depends only on the tokenizer and the prompt settings, so one serves every method and
seed on the same records; with a trunk-caching model (LoRA on the top layers only) it also keeps
each question's frozen bottom-layer hidden states, computed once.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from llm_calib import distributed
from llm_calib.calm.lora import FunctionalLM
from llm_calib.calm.run import ResolvedRun, check_resolved, task_format
from llm_calib.data.records import MultipleChoice, OpenQA
from llm_calib.engine.packing import (
    LENGTH_NORMALIZATIONS,
    PackedQuestions,
    length_parts,
    pack_prompts,
)
from llm_calib.formats import TaskFormat
from llm_calib.training_interface import Batch

__all__ = ["TRUNK_CHUNK", "EncodedRecords", "EncodingCache", "encode_records"]

TRUNK_CHUNK = 16
"""Questions per trunk-cache forward pass: question ``i`` is always computed with its chunk
``[16 (i // 16), 16 (i // 16) + 16)``, so a cached value does not depend on which batch needed it
first (resumed and data-parallel runs compute the same numbers).
"""


@dataclass
class EncodedRecords:
    """Tokenised questions of one record set, ready to be packed into batches.

    Attributes:
        records: the records, in order (batch indices refer to positions in this list).
        prompts: prompt token ids per record.
        options: per record, the option continuations, one letter id per option, or the reference answer.
        format: the task format that encoded the records and packs them; one encoding serves every
            ``normalize`` (training takes it from its losses).
        trunk_cache: hidden states entering the first trainable layer, per record index; they depend
            on the frozen base model only (a different base needs a fresh encoding).

    Example:
        >>> from llm_calib.data import builtin_multiple_choice
        >>> from llm_calib.models import tiny_random_model
        >>> _, tok = tiny_random_model()
        >>> from llm_calib.calm.run import resolve_run
        >>> qs = builtin_multiple_choice(n_per_domain=2, domains=["capitals"])
        >>> enc = encode_records(tok, qs, resolve_run(None, qs, qs).formats.lower)
        >>> len(enc), enc.layout, enc.pack([0, 1], 0).input_ids.shape[0]
        (2, 'options', 2)
    """

    records: list[MultipleChoice] | list[OpenQA]
    prompts: list[tuple[int, ...]]
    options: list[tuple[tuple[int, ...], ...]]
    format: TaskFormat
    trunk_cache: dict[int, Tensor] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.records)

    @property
    def layout(self) -> str:
        """The format's batch layout: ``"options"``, ``"letter"`` or ``"open"``."""
        return self.format.layout

    @property
    def answer_stop(self) -> bool:
        """Open questions: each reference ends with greedy answering's stop token."""
        return self.format.answer_stop

    def pack(self, indices: Sequence[int], pad_id: int) -> PackedQuestions:
        """Pack the questions at ``indices`` into one model input (no trunk)."""
        idx = list(indices)
        return self.format.pack([self.prompts[i] for i in idx], [self.options[i] for i in idx], pad_id)

    def length(self, i: int) -> int:
        """Packed length (tokens) of question ``i``."""
        return self.format.length(self.prompts[i], self.options[i])

    @property
    def trunk_cache_bytes(self) -> int:
        """Memory held by the trunk cache, in bytes."""
        return sum(v.numel() * v.element_size() for v in self.trunk_cache.values())

    def fill_trunk_cache(self, lm: FunctionalLM, pad_id: int, indices: Iterable[int] | None = None,
                         bar: Any = None) -> int:
        """Compute the missing trunks of the questions at ``indices`` (default: all), chunk by chunk
        (:data:`TRUNK_CHUNK`); no-op without trunk caching. Returns how many were missing, counted on
        ``bar`` (``update(n)``, optional) chunk by chunk."""
        if not lm.caches_trunk:
            return 0
        wanted = range(len(self.records)) if indices is None else indices
        chunks = sorted({i // TRUNK_CHUNK for i in wanted if i not in self.trunk_cache})
        n = 0
        for c in chunks:
            chunk = list(range(c * TRUNK_CHUNK, min((c + 1) * TRUNK_CHUNK, len(self.records))))
            todo = sum(i not in self.trunk_cache for i in chunk)
            hidden = lm.trunk_hidden(self.pack(chunk, pad_id))
            for row, i in enumerate(chunk):
                self.trunk_cache[i] = hidden[row, : self.length(i)].clone()
            n += todo
            if bar is not None:
                bar.update(todo)
        return n

    def batch(self, indices: Sequence[int], pad_id: int, lm: FunctionalLM | None = None, *,
              split: bool = True) -> Batch:
        """The :class:`~llm_calib.training_interface.Batch` of the questions at ``indices``, with the cached trunk for
        a trunk-caching ``lm``.

        ``split``: multiple-choice questions of different lengths also come as parts of similar length
        (:attr:`Batch.parts <llm_calib.training_interface.Batch.parts>`, chosen by
        :func:`~llm_calib.engine.packing.length_parts`), which the losses run instead of the padded batch.
        Under ``torchrun`` every rank's shard comes in the same number of parts (one small collective:
        every rank calls this alike).
        """
        idx = list(indices)
        batch = self._whole_batch(idx, pad_id, lm)
        if not split or self.layout == "open":
            return batch
        lengths = [self.length(i) for i in idx]
        parts = length_parts(lengths) if len(idx) > 1 else [list(range(len(idx)))]
        if distributed.is_distributed():
            # Every rank must run the same number of passes (FSDP2 gathers weights in each one), and each
            # rank's shard splits differently: all take the most parts any shard wants, but no more than
            # the smallest shard has questions (no rank is left with an empty part).
            most_parts, minus_fewest_questions = distributed.max_over_ranks([len(parts), -len(idx)])
            n_parts = min(most_parts, -minus_fewest_questions)
            if n_parts != len(parts):
                parts = length_parts(lengths, n_parts=n_parts)
        if len(parts) < 2:
            return batch
        order = [p for part in parts for p in part]
        batch.parts = tuple(self._whole_batch([idx[p] for p in part], pad_id, lm) for part in parts)
        batch.part_order = torch.empty(len(order), dtype=torch.long).scatter_(0, torch.tensor(order),
                                                                              torch.arange(len(order)))
        return batch

    def upper_batch(self, indices: Sequence[int], pad_id: int, lm: FunctionalLM | None = None) -> Batch:
        """The upper-level batch of the questions at ``indices``: open questions as their prompts alone
        (:func:`~llm_calib.engine.packing.pack_prompts`: the upper level reads the entropy where the answer
        starts, which the answer's tokens do not change, and an unlabelled input has none), with the cached
        trunks cut to the prompt; multiple-choice questions as :meth:`batch` packs them (every option).

        Example:
            >>> from llm_calib.data import OpenQA
            >>> from llm_calib.models import tiny_random_model
            >>> _, tok = tiny_random_model()
            >>> from llm_calib.calm.run import resolve_run
            >>> qs = [OpenQA("Capital of France?", ("Paris",), "geo", "q0")]
            >>> enc = encode_records(tok, qs, resolve_run(None, qs, qs).formats.lower)
            >>> enc.upper_batch([0], 0).packed.input_ids.shape[1] == len(enc.prompts[0])
            True
        """
        if self.layout != "open":
            return self.batch(indices, pad_id, lm)
        idx = list(indices)
        packed = pack_prompts([self.prompts[i] for i in idx], pad_id)
        trunk = None
        if lm is not None and lm.caches_trunk:
            self.fill_trunk_cache(lm, pad_id, idx)
            L = packed.input_ids.shape[1]
            trunk = torch.stack([torch.nn.functional.pad(self.trunk_cache[i][: len(self.prompts[i])],
                                                         (0, 0, 0, L - len(self.prompts[i]))) for i in idx])
        return Batch(packed, torch.zeros(len(idx), dtype=torch.long), [self.records[i].id for i in idx], self.format,
                     trunk)

    def _whole_batch(self, idx: list[int], pad_id: int, lm: FunctionalLM | None) -> Batch:
        packed = self.pack(idx, pad_id)
        labels = torch.tensor([self.format.label(self.records[i]) for i in idx], dtype=torch.long)
        trunk = None
        if lm is not None and lm.caches_trunk:
            self.fill_trunk_cache(lm, pad_id, idx)
            L = packed.input_ids.shape[1]
            trunk = torch.stack(
                [torch.nn.functional.pad(self.trunk_cache[i], (0, 0, 0, L - self.trunk_cache[i].shape[0])) for i in idx]
            )
        return Batch(packed, labels, [self.records[i].id for i in idx], self.format, trunk,
                     {n: t for n in LENGTH_NORMALIZATIONS if (t := self.option_text_lengths(idx, n)) is not None})

    def option_text_lengths(self, indices: Sequence[int], normalize: str) -> Tensor | None:
        """``(len(indices), K_max)`` option lengths in characters or bytes (1 at padding); None without option
        texts."""
        rows = [self.format.option_text_lengths(self.records[i], normalize) for i in indices]
        if any(r is None for r in rows):
            return None
        out = torch.ones((len(rows), max(len(r) for r in rows)), dtype=torch.float64)
        for b, r in enumerate(rows):
            out[b, : len(r)] = torch.tensor(r, dtype=torch.float64)
        return out


def encode_records(tokenizer: Any, records: Sequence[MultipleChoice] | Sequence[OpenQA], fmt: TaskFormat) -> EncodedRecords:
    """Tokenise records once with their format ``fmt`` (checked against them; a run's formats come
    from :func:`~llm_calib.calm.run.resolve_run`, another set's from :func:`~llm_calib.calm.run.task_format`).

    Open questions train on their first alias (``" " + alias``, plus the stop newline under a run's
    ``prompt.open_examples``); for every alias, give one record per alias
    (:func:`~llm_calib.data.one_record_per_alias`).

    Raises:
        ValueError: no records, records of both kinds or of another type, or an open question
            without a reference answer (each naming the record).

    Example:
        >>> from llm_calib.data import OpenQA
        >>> from llm_calib.models import tiny_random_model
        >>> _, tok = tiny_random_model()
        >>> from llm_calib.calm.run import resolve_run
        >>> qs = [OpenQA("Capital of France?", ("Paris",), "geo", "q0")]
        >>> enc = encode_records(tok, qs, resolve_run(None, qs, qs).formats.lower)
        >>> enc.layout, tok.decode(enc.options[0][0])
        ('open', ' Paris')
    """
    records = list(records)
    if not records:
        raise ValueError("no records to encode")
    fmt.check(records)
    prompts, options = fmt.encode(tokenizer, records)
    return EncodedRecords(records, prompts, options, fmt)


class EncodingCache:
    """One :class:`EncodedRecords` (and trunk cache) per record set, prompt settings and adapted layers, shared by
    every run.

    Example:
        >>> from llm_calib.calm.run import resolve_run
        >>> from llm_calib.config.calibration import CalibrationConfig, TrainingSettings
        >>> from llm_calib.data import builtin_multiple_choice
        >>> from llm_calib.models import tiny_random_model
        >>> _, tok = tiny_random_model()
        >>> qs, cache = builtin_multiple_choice(n_per_domain=2, domains=["capitals"]), EncodingCache()
        >>> fast = CalibrationConfig(training=TrainingSettings(lr=0.1))
        >>> cache(tok, qs, resolve_run(None, qs, qs)) is cache(tok, list(qs), resolve_run(fast, qs, qs))
        True
    """

    def __init__(self) -> None:
        self.encodings: dict[Any, EncodedRecords] = {}

    def __call__(self, tokenizer: Any, records: Sequence[Any], run: ResolvedRun) -> EncodedRecords:
        """The encoding of ``records`` (recognised by domain and id) under the resolved ``run``; made on first use."""
        settings = check_resolved(run, "EncodingCache").settings  # what the encoding depends on (normalize does not matter)
        prompts = settings.scorer, settings.prompt, settings.open_prompt, settings.answer_stop
        lora = run.config.lora
        key = (tuple(f"{r.domain}/{r.id}" for r in records), *prompts, lora.layers, lora.top_layers)
        if key not in self.encodings:
            self.encodings[key] = encode_records(tokenizer, records, task_format(records, settings))
        return self.encodings[key]
