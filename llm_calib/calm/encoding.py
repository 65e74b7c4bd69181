"""Records tokenised once for training and evaluation, with an optional trunk cache.

:func:`encode_records` turns a record set into an :class:`EncodedRecords`: token ids of every
prompt and option (or reference answer), ready to be packed into :class:`~llm_calib.calm.objectives.Batch`
es. The encoding depends only on the tokenizer and the prompt fields of the configuration, so one
encoding serves every method and seed run on the same records; with a trunk-caching model
(LoRA on the top layers only, :attr:`FunctionalLM.caches_trunk
<llm_calib.calm.lora.FunctionalLM.caches_trunk>`) it also keeps the frozen bottom layers' hidden
states of each question, computed once, for as long as the object lives.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from llm_calib.calm.config import CalibrationConfig, open_prompt_format
from llm_calib.calm.lora import FunctionalLM
from llm_calib.calm.objectives import Batch
from llm_calib.data.records import MultipleChoice, OpenQA
from llm_calib.engine.packing import PackedQuestions
from llm_calib.formats import MULTIPLE_CHOICE_FORMATS, TaskFormat, format_for
from llm_calib.prompts import preset

__all__ = [
    "LAYOUTS",
    "TRUNK_CHUNK",
    "EncodedRecords",
    "EncodingCache",
    "encode_records",
    "format_settings",
    "task_format",
]

LAYOUTS = ("options", "letter", "open")
"""How an :class:`EncodedRecords` packs its questions (see its ``layout``)."""

TRUNK_CHUNK = 16
"""Questions per trunk-cache forward pass: question ``i`` is always computed with the questions of
its chunk ``[16 (i // 16), 16 (i // 16) + 16)``, so each cached value is independent of which batch
first needed it and a resumed or data-parallel run computes the same numbers."""


@dataclass
class EncodedRecords:
    """Tokenised questions of one record set, ready to be packed into batches.

    Attributes:
        records: the records, in order (batch indices refer to positions in this list).
        prompts: prompt token ids per record.
        options: per record, the option continuations (``"options"``), one letter id per option
            (``"letter"``) or the reference answer alone (``"open"``).
        format: the task format that encoded the records; it packs them
            (:meth:`~llm_calib.formats.base.TaskFormat.pack`) and gives their batches' losses
            their view (:attr:`Batch.format <llm_calib.calm.objectives.Batch>`). The token ids do
            not depend on the option-score normalisation: training takes it from its losses
            (:class:`~llm_calib.calm.objectives.CalmLosses`), so one encoding serves every
            ``normalize`` (:class:`EncodingCache` shares it).
        trunk_cache: hidden states entering the first trainable layer, per record index, filled
            by :meth:`batch` and :meth:`fill_trunk_cache` with a trunk-caching model. They depend
            on the frozen base model only, so an encoding may be reused by every run on the same
            base model and adapted layers; a different base needs a fresh encoding.

    Example:
        >>> from llm_calib.data import builtin_multiple_choice
        >>> from llm_calib.models import tiny_random_model
        >>> _, tok = tiny_random_model()
        >>> enc = encode_records(tok, builtin_multiple_choice(n_per_domain=2, domains=["capitals"]),
        ...                      CalibrationConfig())
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
        """The format's batch layout: ``"options"`` (option likelihood: prompt + every option,
        packed), ``"letter"`` (listed prompt, one answer-letter token per option) or ``"open"``
        (open questions, prompt + reference answer as a plain causal sequence)."""
        return self.format.layout

    @property
    def answer_stop(self) -> bool:
        """Open questions: each reference ends with the stop token of greedy answering (the
        short-answer prompt, :func:`encode_records`)."""
        return self.format.answer_stop

    def pack(self, indices: Sequence[int], pad_id: int) -> PackedQuestions:
        """Pack the questions at ``indices`` into one model input (no trunk)."""
        idx = list(indices)
        return self.format.pack([self.prompts[i] for i in idx], [self.options[i] for i in idx], pad_id)

    def length(self, i: int) -> int:
        """Packed length (tokens) of question ``i``: its prompt plus its options (not letters)."""
        return self.format.length(self.prompts[i], self.options[i])

    @property
    def trunk_cache_bytes(self) -> int:
        """Memory held by the trunk cache, in bytes."""
        return sum(v.numel() * v.element_size() for v in self.trunk_cache.values())

    def fill_trunk_cache(self, lm: FunctionalLM, pad_id: int, indices: Iterable[int] | None = None) -> None:
        """Compute the cached trunk of the questions at ``indices`` (default: all) that lack one.

        Does nothing when ``lm`` does not cache its trunk. Questions are computed chunk by chunk
        (:data:`TRUNK_CHUNK`), whichever indices are asked for.
        """
        if not lm.caches_trunk:
            return
        wanted = range(len(self.records)) if indices is None else indices
        chunks = sorted({i // TRUNK_CHUNK for i in wanted if i not in self.trunk_cache})
        for c in chunks:
            chunk = list(range(c * TRUNK_CHUNK, min((c + 1) * TRUNK_CHUNK, len(self.records))))
            hidden = lm.trunk_hidden(self.pack(chunk, pad_id))
            for row, i in enumerate(chunk):
                self.trunk_cache[i] = hidden[row, : self.length(i)].clone()

    def batch(self, indices: Sequence[int], pad_id: int, lm: FunctionalLM | None = None) -> Batch:
        """The :class:`~llm_calib.calm.objectives.Batch` of the questions at ``indices``.

        With a trunk-caching ``lm`` the batch carries the cached trunk (computed on first use).
        """
        idx = list(indices)
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
                     {n: t for n in ("char", "byte") if (t := self.option_text_lengths(idx, n)) is not None})

    def option_text_lengths(self, indices: Sequence[int], normalize: str) -> Tensor | None:
        """``(len(indices), K_max)`` lengths in characters (``"char"``) or UTF-8 bytes (``"byte"``)
        of the options of the questions at ``indices`` (1 at padding), what those option-score
        normalisations divide by; None when the format has no option texts (open questions)."""
        rows = [self.format.option_text_lengths(self.records[i], normalize) for i in indices]
        if any(r is None for r in rows):
            return None
        out = torch.ones((len(rows), max(len(r) for r in rows)), dtype=torch.float64)
        for b, r in enumerate(rows):
            out[b, : len(r)] = torch.tensor(r, dtype=torch.float64)
        return out


def format_settings(config: CalibrationConfig) -> dict[str, Any]:
    """The scorer settings of a configuration, as :func:`~llm_calib.formats.format_for` and
    :func:`~llm_calib.evaluate.evaluate_records` take them: the one function that reads the
    configuration's prompt part (``scorer``, ``normalize``, ``style``,
    ``chat_template``, ``open_examples``).

    The multiple-choice prompt is ``style`` (listed for the letter scorer, whose options
    must be listed) with ``chat_template``, or, with ``preset`` or any of the prompt settings
    ``evaluate`` has flags for (``template``, ``target_delimiter``, ``choices``,
    ``system_message``, ``answer_prefix``, ``fewshot``...), the prompt ``evaluate`` builds from
    the same flags: the preset (or the style's prompt), then the settings given. With few-shot
    examples the format carries the pool of ``config.prompt.fewshot_pool`` (loaded from
    ``fewshot_split`` on first use when empty), so training, selection and evaluation show a
    question the same examples. Open questions use
    :func:`~llm_calib.calm.config.open_prompt_format`, and with ``open_examples`` each reference
    answer is trained with the newline that ends a greedy answer (``answer_stop``).

    Example:
        >>> s = format_settings(CalibrationConfig(prompt=dict(scorer="letter")))
        >>> s["scorer"], s["prompt"].style, s["answer_stop"]
        ('letter', 'listed', False)
        >>> format_settings(CalibrationConfig(prompt=dict(preset="lm_eval_arc")))["prompt"].template
        'Question: {question}\\nAnswer:'
    """
    import dataclasses

    settings = config.prompt
    given = settings.prompt_overrides()
    prompt = MULTIPLE_CHOICE_FORMATS[settings.scorer].configured_prompt(settings.style, settings.chat_template)
    if settings.preset is not None:  # as evaluate --prompt-preset: the preset, then the settings given
        chat = {} if settings.chat_template is None else {"chat_template": settings.chat_template}
        prompt = preset(settings.preset, **given, **chat)
    elif given:  # as evaluate's prompt flags without a preset
        prompt = dataclasses.replace(prompt, **given)
    if prompt.fewshot:
        if not settings.fewshot_pool:
            from llm_calib.fewshot import resolve_fewshot

            settings.fewshot_pool = resolve_fewshot(prompt).fewshot_pool  # type: ignore[union-attr]
        prompt = dataclasses.replace(prompt, fewshot_pool=settings.fewshot_pool)
    return {
        "scorer": config.prompt.scorer,
        "normalize": config.prompt.normalize,
        "prompt": prompt,
        "open_prompt": open_prompt_format(config),
        "answer_stop": bool(config.prompt.open_examples),
    }


def task_format(records: Iterable[Any], config: CalibrationConfig | None = None, *, what: str = "records") -> TaskFormat:
    """The task format of a run's records under its configuration
    (:func:`~llm_calib.formats.format_for` of :func:`format_settings`): what training, its
    evaluation and a comparison use. This is where a run reads the kind of its records.

    Args:
        records: all multiple choice or all open questions.
        config: the configuration (default ``CalibrationConfig()``).
        what: how error messages name the records (e.g. ``"train"``).

    Returns:
        The format.

    Raises:
        ValueError: no records, records of both kinds or of another type (naming the record).

    Example:
        >>> from llm_calib.data import builtin_multiple_choice
        >>> fmt = task_format(builtin_multiple_choice(1, domains=["capitals"]), CalibrationConfig(prompt=dict(normalize="mean")))
        >>> type(fmt).__name__, fmt.normalize
        ('OptionLikelihood', 'mean')
    """
    return format_for(records, **format_settings(config or CalibrationConfig()), what=what)


def encode_records(
    tokenizer: Any, records: Sequence[MultipleChoice] | Sequence[OpenQA], config: CalibrationConfig,
    *, fmt: TaskFormat | None = None,
) -> EncodedRecords:
    """Tokenise records once for the configured scorer and prompt format.

    The format (:func:`task_format` of the records under ``config``, or ``fmt``) does the
    encoding (:meth:`~llm_calib.formats.base.TaskFormat.encode`). Multiple-choice records follow
    ``config.prompt.scorer`` and ``config.prompt.style``. Open questions use the open-ended scorer's
    prompt (:func:`~llm_calib.scoring.open_ended.encode_open_prompts`) of
    :func:`~llm_calib.calm.config.open_prompt_format`, followed by the first reference alias as
    the continuation, tokenised on its own like an option: ``" " + alias`` under the chat prompt,
    ``" " + alias + "\\n"`` under the few-shot short-answer prompt (``config.prompt.open_examples``), so
    the trained answer ends with the newline token at which greedy answering stops (to train on
    every alias, give one record per alias: :func:`~llm_calib.data.one_record_per_alias`).

    Args:
        tokenizer: the model's tokenizer.
        records: all multiple choice or all open questions.
        config: the run's configuration (only ``scorer``, ``normalize``, ``prompt_style``,
            ``chat_template`` and ``open_examples`` matter).
        fmt: the records' format, when the caller has it already (it is checked against the
            records); None: :func:`task_format`.

    Returns:
        An :class:`EncodedRecords` with an empty trunk cache.

    Raises:
        ValueError: no records, records of both kinds or of another type, or an open question
            without a reference answer (each naming the record).

    Example:
        >>> from llm_calib.data import OpenQA
        >>> from llm_calib.models import tiny_random_model
        >>> _, tok = tiny_random_model()
        >>> enc = encode_records(tok, [OpenQA("Capital of France?", ("Paris",), "geo", "q0")],
        ...                      CalibrationConfig())
        >>> enc.layout, tok.decode(enc.options[0][0])
        ('open', ' Paris')
    """
    records = list(records)
    if not records:
        raise ValueError("no records to encode")
    if fmt is None:
        fmt = task_format(records, config)
    else:
        fmt.check(records)
    prompts, options = fmt.encode(tokenizer, records)
    return EncodedRecords(records, prompts, options, fmt)


class EncodingCache:
    """One :class:`EncodedRecords` (and so one trunk cache) per record set, prompt format and
    adapted layers, reused by every run that asks for it: several methods and seeds on the same
    base model pay for tokenisation and the frozen trunk once.

    Example:
        >>> from llm_calib.data import builtin_multiple_choice
        >>> from llm_calib.models import tiny_random_model
        >>> _, tok = tiny_random_model()
        >>> qs, cache = builtin_multiple_choice(n_per_domain=2, domains=["capitals"]), EncodingCache()
        >>> from llm_calib.calm.config import TrainingSettings
        >>> cache(tok, qs, CalibrationConfig()) is cache(tok, list(qs), CalibrationConfig(training=TrainingSettings(lr=0.1)))
        True
    """

    def __init__(self) -> None:
        self.encodings: dict[Any, EncodedRecords] = {}

    def __call__(self, tokenizer: Any, records: Sequence[Any], config: CalibrationConfig) -> EncodedRecords:
        """The encoding of ``records`` under ``config``'s scorer, prompt style, chat template, open
        examples and LoRA layers (records are recognised by domain and id); made on first use."""
        settings = format_settings(config)  # what the encoding depends on (normalize does not matter)
        prompts = settings["scorer"], settings["prompt"], settings["open_prompt"], settings["answer_stop"]
        key = (tuple(f"{r.domain}/{r.id}" for r in records), *prompts, config.lora.layers, config.lora.top_layers)
        if key not in self.encodings:
            self.encodings[key] = encode_records(tokenizer, records, config)
        return self.encodings[key]
