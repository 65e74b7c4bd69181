"""Prompt formats for multiple-choice and open-ended scoring.

A :class:`PromptFormat` turns a question (and, for the *listed* style, its options) into the text
that precedes the scored continuation. The reference format of the evaluation protocol (:doc:`/methods/calm`)
is the default: the model's chat template with its default system message, a user turn holding the
question alone, the generation prompt, then ``The answer is:``; each option is scored as the
continuation ``" " + option``.

Without a chat template the prompt is ``[system message + "\\n\\n"] + user text + "\\n" +
answer prefix``.

Templates and few-shot (:func:`record_prompt`, :func:`option_continuations`): a
:class:`PromptFormat` may carry a ``template`` with named fields (``{question}``, ``{options}``,
``{subject}``, ``{context}``, any ``meta`` key of the record), a ``target_delimiter`` between the
prompt and each scored choice, ``choices="letters"`` to score the option letters instead of the
option texts, a ``description`` written once before everything, and ``fewshot`` solved examples
drawn reproducibly per question from a pool (:func:`~llm_calib.fewshot.resolve_fewshot` loads it
from a named split and removes the evaluated questions). :data:`PRESETS` reproduce the zero-shot prompts of
EleutherAI's lm-evaluation-harness for the tasks the loaders read (:func:`preset`).

Open questions have a few-shot short-answer prompt (:func:`short_answer_format`: fixed solved
``Q: ...`` / ``A: ...`` examples, e.g. :func:`draw_short_answer_examples` of a training split, then
the question), under which greedy answers are short and end at the newline; CALM trains and
evaluates with it when :attr:`CalibrationConfig.open_examples
<llm_calib.calm.config.CalibrationConfig>` is set.
"""

from __future__ import annotations

import random
import string
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

__all__ = [
    "LETTERS",
    "PRESETS",
    "SHORT_ANSWER_TEMPLATE",
    "PromptFormat",
    "build_prompt",
    "continuation_text",
    "draw_fewshot",
    "draw_short_answer_examples",
    "option_continuations",
    "option_letters",
    "preset",
    "prompt_dict",
    "record_prompt",
    "record_uses_chat_template",
    "short_answer_format",
    "template_fields",
    "user_message",
    "uses_chat_template",
    "with_fewshot",
]

LETTERS: str = string.ascii_uppercase
"""Letters used to label listed options (``A`` ... ``Z``)."""

_STYLES = ("cloze", "listed")
_CHOICES = ("text", "letters")
_SAMPLERS = ("random", "first_n")


@dataclass(frozen=True)
class PromptFormat:
    """How a question is turned into a prompt.

    Attributes:
        style: ``"cloze"`` (the prompt holds the question only) or ``"listed"`` (the options are
            listed below the question, labelled ``A.``, ``B.``, ...). The letter scorer needs
            ``"listed"``.
        chat_template: ``True`` to wrap the user text in the tokenizer's chat template, ``False``
            for plain text, ``None`` to use the chat template when the tokenizer has one.
        system_message: a system message to put in the chat (or in front of the plain prompt);
            ``None`` keeps the template's default (the SmolLM2 template inserts its own).
        answer_prefix: text appended after the generation prompt; the scored continuation
            follows it. With a ``template`` it is only used where the template has the field
            ``{answer_prefix}``.
        template: the text of a question with named fields (see :func:`template_fields`), e.g.
            ``"Question: {question}\\nAnswer:"``; it replaces ``user text + "\\n" + answer
            prefix``. With a chat template the rendered text is the user turn and the scored
            continuation follows the generation prompt. None: the format above.
        target_delimiter: text between the prompt and each scored choice (``" "``, as in
            lm-eval); the choice itself is stripped.
        choices: ``"text"`` scores each option's text; ``"letters"`` scores the option letters
            (``A``, ``B``, ...; use a template that lists the options, as lm-eval's MMLU does).
        description: text written once at the very start (before the few-shot examples), with
            the same fields as the template (lm-eval's ``description``).
        fewshot: number of solved examples before each question (0: zero-shot).
        fewshot_split: data spec of the split the examples are drawn from (e.g.
            ``"arc_easy:../shared/data:train"``); :func:`~llm_calib.fewshot.resolve_fewshot` loads it.
        fewshot_seed: seed of the per-question draw of examples.
        fewshot_delimiter: text between examples, and between the last example and the question.
        fewshot_sampler: ``"random"`` (a seeded draw per question) or ``"first_n"`` (the first
            ``fewshot`` candidates in split order, lm-eval's MMLU sampler).
        fewshot_match: a ``meta`` key (e.g. ``"subject"``) whose value an example must share
            with the question (MMLU: examples from the same subject's dev split); None: any.
        fewshot_pool: the candidate examples (records); filled by
            :func:`~llm_calib.fewshot.resolve_fewshot` or :func:`with_fewshot`, not compared or
            shown.

    Example:
        >>> fmt = PromptFormat(style="listed", chat_template=False)
        >>> print(build_prompt(None, "2 + 2 = ?", ("3", "4"), fmt))
        2 + 2 = ?
        A. 3
        B. 4
        The answer is:
    """

    style: Literal["cloze", "listed"] = "cloze"
    chat_template: bool | None = None
    system_message: str | None = None
    answer_prefix: str = "The answer is:"
    template: str | None = None
    target_delimiter: str = " "
    choices: Literal["text", "letters"] = "text"
    description: str = ""
    fewshot: int = 0
    fewshot_split: str | None = None
    fewshot_seed: int = 1234
    fewshot_delimiter: str = "\n\n"
    fewshot_sampler: Literal["random", "first_n"] = "random"
    fewshot_match: str | None = None
    fewshot_pool: tuple[Any, ...] = field(default=(), compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.style not in _STYLES:
            raise ValueError(f"PromptFormat.style must be one of {_STYLES}, got {self.style!r}")
        if self.chat_template not in (True, False, None):
            raise ValueError(
                f"PromptFormat.chat_template must be True, False or None, got {self.chat_template!r}"
            )
        if self.choices not in _CHOICES:
            raise ValueError(f"PromptFormat.choices must be one of {_CHOICES}, got {self.choices!r}")
        if not isinstance(self.fewshot, int) or isinstance(self.fewshot, bool) or self.fewshot < 0:
            raise ValueError(f"PromptFormat.fewshot must be an integer >= 0, got {self.fewshot!r}")
        if self.fewshot_sampler not in _SAMPLERS:
            raise ValueError(
                f"PromptFormat.fewshot_sampler must be one of {_SAMPLERS}, got {self.fewshot_sampler!r}"
            )
        if self.template is not None and not self.template.strip():
            raise ValueError("PromptFormat.template must not be empty (None for the default format)")
        object.__setattr__(self, "fewshot_pool", tuple(self.fewshot_pool))


def option_letters(n: int) -> str:
    """Return the labels of ``n`` listed options.

    Args:
        n: number of options, 1 to 26.

    Returns:
        The first ``n`` capital letters.

    Raises:
        ValueError: if ``n`` is outside 1..26.

    Example:
        >>> option_letters(4)
        'ABCD'
    """
    if not 1 <= n <= len(LETTERS):
        raise ValueError(f"n (number of options) must be in 1..{len(LETTERS)}, got {n}")
    return LETTERS[:n]


def user_message(
    question: str, options: tuple[str, ...] | list[str] | None, fmt: PromptFormat
) -> str:
    """The text of the user turn: the question, plus the lettered options if ``fmt.style`` is listed.

    Args:
        question: the question text.
        options: the answer options (ignored for the cloze style; required for listed).
        fmt: the prompt format.

    Returns:
        The user text.

    Raises:
        ValueError: ``style="listed"`` without options, or more options than letters.

    Example:
        >>> user_message("Pick one.", ("x", "y"), PromptFormat(style="listed"))
        'Pick one.\\nA. x\\nB. y'
        >>> user_message("Pick one.", ("x", "y"), PromptFormat())
        'Pick one.'
    """
    question = question.strip()
    if fmt.style == "cloze":
        return question
    if not options:
        raise ValueError("options are required for PromptFormat(style='listed')")
    lines = [question]
    lines += [
        f"{letter}. {opt}"
        for letter, opt in zip(option_letters(len(options)), options, strict=True)
    ]
    return "\n".join(lines)


def uses_chat_template(tokenizer: Any, fmt: PromptFormat) -> bool:
    """Whether ``fmt`` applied to ``tokenizer`` goes through the chat template.

    Args:
        tokenizer: a Hugging Face tokenizer, or ``None``.
        fmt: the prompt format.

    Returns:
        ``True`` if the chat template is used.

    Raises:
        ValueError: if ``fmt.chat_template`` is ``True`` but the tokenizer has no chat template.

    Example:
        >>> uses_chat_template(None, PromptFormat())
        False
    """
    has = tokenizer is not None and bool(getattr(tokenizer, "chat_template", None))
    if fmt.chat_template is None:
        return has
    if fmt.chat_template and not has:
        raise ValueError(
            "PromptFormat(chat_template=True) but the tokenizer has no chat template; "
            "use chat_template=None or False"
        )
    return bool(fmt.chat_template)


def record_uses_chat_template(tokenizer: Any, record: Any, fmt: PromptFormat) -> bool:
    """Whether the prompt of ``record`` under ``fmt`` went through the chat template: never for
    a record with an already rendered ``prompt`` (lm-eval's contexts are plain text, tokenised as
    lm-eval tokenises them, with the tokenizer's BOS token where it adds one), else
    :func:`uses_chat_template`.

    Example:
        >>> from llm_calib.data.records import MultipleChoice
        >>> from llm_calib.models import tiny_random_model
        >>> _, tok = tiny_random_model()
        >>> q = MultipleChoice("2 + 2?", ("4", "5"), 0, "math", "q0")
        >>> rendered = MultipleChoice("2 + 2?", ("4", "5"), 0, "math", "q1", prompt="Q: 2 + 2?\\nA:")
        >>> record_uses_chat_template(tok, q, PromptFormat()), record_uses_chat_template(tok, rendered, PromptFormat())
        (True, False)
    """
    if getattr(record, "prompt", None) is not None:
        return False
    return uses_chat_template(tokenizer, fmt)


def build_prompt(
    tokenizer: Any,
    question: str,
    options: tuple[str, ...] | list[str] | None = None,
    fmt: PromptFormat | None = None,
) -> str:
    """Build the prompt text that precedes the scored continuation.

    With a chat template: ``apply_chat_template([system?, user], add_generation_prompt=True)``
    followed directly by ``fmt.answer_prefix``. Without: ``[system + "\\n\\n"] + user + "\\n" +
    answer_prefix``. The prompt ends without a trailing space; continuations start with one.

    Args:
        tokenizer: a Hugging Face tokenizer (only needed when a chat template is used).
        question: the question text.
        options: the options (used by the listed style).
        fmt: the prompt format; default :class:`PromptFormat()` (the reference format).

    Returns:
        The prompt string. When a chat template was applied the string already holds the
        template's special tokens, so tokenise it with ``add_special_tokens=False``.

    Example:
        >>> build_prompt(None, "Capital of France?", fmt=PromptFormat(chat_template=False))
        'Capital of France?\\nThe answer is:'
    """
    fmt = fmt or PromptFormat()
    user = user_message(question, options, fmt)
    if uses_chat_template(tokenizer, fmt):
        messages = []
        if fmt.system_message is not None:
            messages.append({"role": "system", "content": fmt.system_message})
        messages.append({"role": "user", "content": user})
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return text + fmt.answer_prefix
    head = f"{fmt.system_message}\n\n" if fmt.system_message else ""
    return f"{head}{user}\n{fmt.answer_prefix}"


def continuation_text(option: str) -> str:
    """The scored continuation for an option: a space then the option text.

    Args:
        option: the option text.

    Returns:
        ``" " + option.strip()``.

    Example:
        >>> continuation_text("Paris ")
        ' Paris'
    """
    return " " + option.strip()


def _letters_for(record: Any) -> str:
    options = getattr(record, "options", None)
    return option_letters(len(options)) if options else ""


class _Fields(dict):
    """Template fields; a missing one raises a KeyError that names it and the record."""

    def __init__(self, data: Mapping[str, str], record_id: str) -> None:
        super().__init__(data)
        self.record_id = record_id

    def __missing__(self, key: str) -> str:
        raise KeyError(
            f"prompt template field {{{key}}} is not available for record {self.record_id!r}; "
            f"available: {', '.join('{' + k + '}' for k in sorted(self))}"
        )


def template_fields(record: Any, fmt: PromptFormat | None = None) -> dict[str, str]:
    """The named fields a template can use for one record.

    ``question`` (stripped), ``options`` (the options listed as ``A. text`` lines, multiple
    choice only), ``letters`` (``"A, B, C"``), ``option_a`` ... (each option's text),
    ``subject`` (the record's ``meta["subject"]`` with ``_`` as spaces, as lm-eval writes the
    MMLU subject; else the domain), ``context`` (``meta["context"]``, ``meta["passage"]`` or
    ``meta["fact"]`` where present, else empty), ``domain``, ``answer_prefix``, and every other
    ``meta`` key.

    Args:
        record: a :class:`~llm_calib.data.records.MultipleChoice` or
            :class:`~llm_calib.data.records.OpenQA` record.
        fmt: the prompt format (for ``answer_prefix``); default ``PromptFormat()``.

    Returns:
        Field name to text.

    Example:
        >>> from llm_calib.data.records import MultipleChoice
        >>> q = MultipleChoice("2 + 2 = ?", ("3", "4"), 1, "math", "q0", {"subject": "high_school_math"})
        >>> f = template_fields(q)
        >>> f["options"], f["subject"], f["letters"]
        ('A. 3\\nB. 4', 'high school math', 'A, B')
    """
    fmt = fmt or PromptFormat()
    meta = {str(k): str(v) for k, v in (getattr(record, "meta", None) or {}).items()}
    out: dict[str, str] = dict(meta)
    options = getattr(record, "options", None)
    if options:
        letters = option_letters(len(options))
        out["options"] = "\n".join(f"{c}. {o.strip()}" for c, o in zip(letters, options, strict=True))
        out["letters"] = ", ".join(letters)
        for c, o in zip(letters, options, strict=True):
            out[f"option_{c.lower()}"] = o.strip()
    subject = meta.get("subject")
    out["subject"] = subject.replace("_", " ") if subject else str(record.domain)
    out["context"] = next((meta[k] for k in ("context", "passage", "fact") if meta.get(k)), "")
    out["domain"] = str(record.domain)
    out["question"] = record.question.strip()
    out["answer_prefix"] = fmt.answer_prefix
    return out


def _format(text: str, fields: dict[str, str], record: Any, what: str) -> str:
    try:
        return text.format_map(_Fields(fields, str(record.id)))
    except (ValueError, IndexError) as exc:
        raise ValueError(f"PromptFormat.{what} {text!r} is not a valid format string: {exc}") from None


def _question_block(record: Any, fmt: PromptFormat) -> tuple[str, str]:
    """The question's own text and the answer prefix that follows it (empty with a template)."""
    if fmt.template is not None:
        return _format(fmt.template, template_fields(record, fmt), record, "template"), ""
    return user_message(record.question, getattr(record, "options", None), fmt), fmt.answer_prefix


def _target(record: Any, fmt: PromptFormat) -> str:
    options = getattr(record, "options", None)
    if options is None:
        return record.answers[0].strip()
    if fmt.choices == "letters":
        return _letters_for(record)[record.gold]
    return options[record.gold].strip()


def _example_text(record: Any, fmt: PromptFormat) -> str:
    body, prefix = _question_block(record, fmt)
    text = f"{body}\n{prefix}" if fmt.template is None else body
    return text + fmt.target_delimiter + _target(record, fmt)


def draw_fewshot(fmt: PromptFormat, record: Any) -> list[Any]:
    """The ``fmt.fewshot`` examples shown before ``record``.

    Drawn without replacement from ``fmt.fewshot_pool`` minus the record itself (same id or same
    question text), restricted to examples sharing ``meta[fmt.fewshot_match]`` when that is set,
    by a generator seeded with ``fmt.fewshot_seed`` and the record's id (the draw for a question
    depends on neither the other evaluated questions nor their order), or the first candidates
    with ``fewshot_sampler="first_n"``.

    Args:
        fmt: the prompt format (``fewshot`` and ``fewshot_pool``).
        record: the question being asked.

    Returns:
        The example records, in the order they are shown.

    Raises:
        ValueError: ``fewshot > 0`` without a pool, too few candidates, or a pool of the other
            record kind.

    Example:
        >>> from llm_calib.data.records import OpenQA
        >>> pool = [OpenQA(f"Q{i}?", (f"A{i}",), "toy", f"p{i}") for i in range(5)]
        >>> fmt = with_fewshot(PromptFormat(fewshot=2), pool)
        >>> q = OpenQA("Q?", ("A",), "toy", "q0")
        >>> draw_fewshot(fmt, q) == draw_fewshot(fmt, q), len(draw_fewshot(fmt, q))
        (True, 2)
    """
    k = fmt.fewshot
    if k == 0:
        return []
    if not fmt.fewshot_pool:
        raise ValueError(
            f"PromptFormat.fewshot={k} needs examples: set fewshot_split to a data spec and call "
            "llm_calib.fewshot.resolve_fewshot(), or pass them with with_fewshot()"
        )
    kind = type(record)
    question = record.question.strip()
    candidates = [
        ex for ex in fmt.fewshot_pool if ex.id != record.id and ex.question.strip() != question
    ]
    if fmt.fewshot_match is not None:
        want = (getattr(record, "meta", None) or {}).get(fmt.fewshot_match)
        candidates = [ex for ex in candidates if (ex.meta or {}).get(fmt.fewshot_match) == want]
    if any(type(ex) is not kind for ex in candidates):
        raise ValueError(
            f"the few-shot pool ({fmt.fewshot_split or 'given'}) holds records of another kind "
            f"than {kind.__name__} record {record.id!r}"
        )
    if len(candidates) < k:
        raise ValueError(
            f"PromptFormat.fewshot={k} but the pool has only {len(candidates)} other examples"
            + (f" with the same {fmt.fewshot_match}" if fmt.fewshot_match else "")
            + f" for record {record.id!r}"
        )
    if fmt.fewshot_sampler == "first_n":
        return candidates[:k]
    return random.Random(f"{fmt.fewshot_seed}:{record.id}:{question}").sample(candidates, k)


def record_prompt(tokenizer: Any, record: Any, fmt: PromptFormat | None = None) -> str:
    """The prompt of one record under ``fmt``: description, few-shot examples, then the question.

    Without a template, description or few-shot examples this is exactly :func:`build_prompt`.
    Otherwise the text is ``description + example_1 + fewshot_delimiter + ... + example_k +
    fewshot_delimiter + question``, where each example is the question text followed by
    ``target_delimiter`` and its answer (gold option text, its letter with
    ``choices="letters"``, or the first accepted answer of an open question) and the question
    text is the rendered ``template`` (or ``user text + "\\n" + answer prefix``). With a chat
    template all of it is the single user turn; the answer prefix (no template) follows the
    generation prompt.

    A record with an already rendered ``prompt`` (e.g. from :mod:`llm_calib.data.lm_eval_task`)
    returns it verbatim: the format (template, chat template, few-shot) does not apply.

    Args:
        tokenizer: a Hugging Face tokenizer (only needed with a chat template).
        record: a multiple-choice or open record.
        fmt: the prompt format; default ``PromptFormat()``.

    Returns:
        The prompt string (tokenise with :func:`llm_calib.scoring.base.encode_prompt`).

    Raises:
        KeyError: a template field the record does not have (the message names it).
        ValueError: few-shot without a pool (see :func:`draw_fewshot`).

    Example:
        >>> from llm_calib.data.records import MultipleChoice
        >>> q = MultipleChoice("Capital of France?", ("Paris", "Rome"), 0, "geo", "q0")
        >>> print(record_prompt(None, q, preset("lm_eval_arc")))
        Question: Capital of France?
        Answer:
    """
    if getattr(record, "prompt", None) is not None:  # already rendered (e.g. by lm-eval)
        return record.prompt
    fmt = fmt or PromptFormat()
    options = getattr(record, "options", None)
    if fmt.template is None and not fmt.description and fmt.fewshot == 0:
        return build_prompt(tokenizer, record.question, options, fmt)
    fields = template_fields(record, fmt)
    head = _format(fmt.description, fields, record, "description") if fmt.description else ""
    shots = "".join(_example_text(ex, fmt) + fmt.fewshot_delimiter for ex in draw_fewshot(fmt, record))
    body, prefix = _question_block(record, fmt)
    if uses_chat_template(tokenizer, fmt):
        messages = []
        if fmt.system_message is not None:
            messages.append({"role": "system", "content": fmt.system_message})
        messages.append({"role": "user", "content": head + shots + body})
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return text + prefix
    system = f"{fmt.system_message}\n\n" if fmt.system_message else ""
    tail = f"\n{prefix}" if fmt.template is None else ""
    return f"{system}{head}{shots}{body}{tail}"


def option_continuations(record: Any, fmt: PromptFormat | None = None) -> tuple[str, ...]:
    """The scored continuation of each option: ``target_delimiter`` + option text (or letter).

    With the default format this is :func:`continuation_text` of each option.
    A record with already rendered ``continuations`` returns them verbatim.

    Args:
        record: a multiple-choice record.
        fmt: the prompt format.

    Returns:
        One continuation per option.

    Example:
        >>> from llm_calib.data.records import MultipleChoice
        >>> q = MultipleChoice("Pick.", ("x ", "y"), 0, "toy", "q0")
        >>> option_continuations(q), option_continuations(q, PromptFormat(choices="letters"))
        ((' x', ' y'), (' A', ' B'))
    """
    if getattr(record, "continuations", None) is not None:  # already rendered (e.g. by lm-eval)
        return tuple(record.continuations)
    fmt = fmt or PromptFormat()
    if fmt.choices == "letters":
        return tuple(fmt.target_delimiter + c for c in _letters_for(record))
    return tuple(fmt.target_delimiter + o.strip() for o in record.options)


def _question_key(text: str) -> str:
    return " ".join(text.split()).lower()


def with_fewshot(
    fmt: PromptFormat, pool: Sequence[Any], exclude: Sequence[Any] = ()
) -> PromptFormat:
    """A copy of ``fmt`` whose few-shot examples are drawn from ``pool`` minus ``exclude``.

    A pool record is removed when its id or its question text (whitespace and case folded)
    equals that of any excluded record, so the evaluated questions never appear as examples.

    Args:
        fmt: the prompt format (``fewshot`` examples per question).
        pool: candidate example records.
        exclude: the evaluated records.

    Returns:
        The format with ``fewshot_pool`` set.

    Raises:
        ValueError: fewer than ``fmt.fewshot`` candidates remain.

    Example:
        >>> from llm_calib.data.records import OpenQA
        >>> pool = [OpenQA(f"Q{i}?", (f"A{i}",), "toy", f"p{i}") for i in range(3)]
        >>> len(with_fewshot(PromptFormat(fewshot=1), pool, exclude=pool[:1]).fewshot_pool)
        2
    """
    ids = {r.id for r in exclude}
    questions = {_question_key(r.question) for r in exclude}
    kept = tuple(r for r in pool if r.id not in ids and _question_key(r.question) not in questions)
    if len(kept) < fmt.fewshot:
        raise ValueError(
            f"few-shot split {fmt.fewshot_split or '(given pool)'}: {len(kept)} examples left after "
            f"removing the evaluated questions, need fewshot={fmt.fewshot}"
        )
    return replace(fmt, fewshot_pool=kept)


def prompt_dict(fmt: PromptFormat, tokenizer: Any = None) -> dict[str, Any]:
    """The settings of a format as a JSON-ready dict (the pool as its size).

    Args:
        fmt: the prompt format.
        tokenizer: the tokenizer the format is applied with, or None. When given, the dict shows
            the prompt as resolved: ``chat_template`` is whether the chat template is used
            (:func:`uses_chat_template`), never None ("automatic").

    Returns:
        The settings, by field name.

    Example:
        >>> prompt_dict(preset("lm_eval_arc"))["template"]
        'Question: {question}\\nAnswer:'
        >>> prompt_dict(PromptFormat())["chat_template"] is None
        True
    """
    out = {k: getattr(fmt, k) for k in fmt.__dataclass_fields__ if k != "fewshot_pool"}
    out["fewshot_pool_size"] = len(fmt.fewshot_pool)
    if tokenizer is not None:
        out["chat_template"] = uses_chat_template(tokenizer, fmt)
    return out


_LM_EVAL_QA = "Question: {question}\nAnswer:"

PRESETS: dict[str, dict[str, Any]] = {
    "default": {},
    "lm_eval_arc": {"template": _LM_EVAL_QA, "chat_template": False},
    "lm_eval_mmlu": {
        "template": "{question}\n{options}\nAnswer:",
        "description": "The following are multiple choice questions (with answers) about {subject}.\n\n",
        "choices": "letters",
        "chat_template": False,
        "fewshot_sampler": "first_n",
        "fewshot_match": "subject",
    },
    "lm_eval_openbookqa": {"template": "{question}", "chat_template": False},
    "lm_eval_commonsenseqa": {
        "template": "Question: {question}\n{options}\nAnswer:",
        "choices": "letters",
        "chat_template": False,
    },
    "lm_eval_qasc": {"template": _LM_EVAL_QA, "chat_template": False},
    "lm_eval_piqa": {"template": _LM_EVAL_QA, "chat_template": False},
    "qa": {"template": "Q: {question}\nA:", "fewshot_delimiter": "\n", "chat_template": False},
}
"""Named prompt formats (keyword arguments of :class:`PromptFormat`).

* ``default``: the reference format (chat template, question, ``The answer is:``).
* ``lm_eval_arc`` (ARC-Easy/Challenge), ``lm_eval_qasc``, ``lm_eval_piqa`` (two-choice
  goal/solution sets): lm-eval's ``Question: {question}\\nAnswer:`` with each option's text
  scored after a space. lm-eval has no QASC task; its ARC/PIQA/SciQ style is used.
* ``lm_eval_openbookqa``: the question stem alone, option texts scored.
* ``lm_eval_mmlu``: lm-eval's MMLU prompt: the description ``The following are multiple choice
  questions (with answers) about {subject}.``, the question, the options as ``A. ...`` lines,
  ``Answer:``; the letters are scored. Few-shot examples are the first ones of the same subject
  (lm-eval's ``first_n`` sampler on the ``dev`` split: use ``fewshot_split="mmlu:ROOT:dev"``).
* ``lm_eval_commonsenseqa``: lm-eval's ``commonsense_qa``: ``Question: ...``, the listed options,
  ``Answer:``; the letters are scored.
* ``qa``: short-answer open-ended ``Q: {question}\\nA:``, examples one per line (greedy answers
  stop at the newline).

All but ``default`` are plain text (no chat template), as lm-eval without
``--apply_chat_template``.
"""

SHORT_ANSWER_TEMPLATE = "Q: {question}\nA:"
"""The question block of :func:`short_answer_format` (each example is this, a space, its answer)."""


def _short_answer_pairs(examples: Any, what: str) -> tuple[tuple[str, str], ...]:
    """``examples`` as stripped (question, answer) pairs; ValueError naming ``what[i]`` otherwise."""
    if isinstance(examples, (str, bytes)) or not isinstance(examples, Sequence):
        raise ValueError(f"{what} must be a list of [question, answer] pairs, got {examples!r}")
    out = []
    for i, pair in enumerate(examples):
        if (isinstance(pair, (str, bytes)) or not isinstance(pair, Sequence) or len(pair) != 2
                or not all(isinstance(t, str) and t.strip() for t in pair)):
            raise ValueError(f"{what}[{i}] must be a [question, answer] pair of two non-empty strings, got {pair!r}")
        out.append((" ".join(pair[0].split()), " ".join(pair[1].split())))
    return tuple(out)


def short_answer_format(examples: Sequence[tuple[str, str]]) -> PromptFormat:
    """The few-shot short-answer prompt of open questions: solved examples, then the question.

    Plain text (no chat template)::

        Q: <example question 1>
        A: <example answer 1>

        Q: <the question>
        A:

    The examples are fixed (the same before every question) and written into ``description``
    (braces escaped, whitespace runs squeezed to one space); the question is the template
    :data:`SHORT_ANSWER_TEMPLATE`. A greedy answer (:func:`~llm_calib.engine.decode.generate_greedy`)
    then stops at the newline the examples end their answers with; trained answers end with it too
    (:func:`~llm_calib.calm.encoding.encode_records`).

    Args:
        examples: ``(question, answer)`` pairs (e.g. :func:`draw_short_answer_examples`);
            empty gives the zero-shot ``Q: ...\\nA:`` prompt.

    Returns:
        The prompt format (cloze, ``chat_template=False``).

    Raises:
        ValueError: an example that is not a pair of two non-empty strings (names its index).

    Example:
        >>> from llm_calib.data.records import OpenQA
        >>> fmt = short_answer_format([("Capital of Italy?", "Rome"), ("2 + 2?", "4")])
        >>> print(record_prompt(None, OpenQA("Capital of France?", ("Paris",), "geo", "q0"), fmt))
        Q: Capital of Italy?
        A: Rome
        <BLANKLINE>
        Q: 2 + 2?
        A: 4
        <BLANKLINE>
        Q: Capital of France?
        A:
    """
    pairs = _short_answer_pairs(examples, "examples")

    def escape(text: str) -> str:
        return text.replace("{", "{{").replace("}", "}}")

    description = "".join(f"Q: {escape(q)}\nA: {escape(a)}\n\n" for q, a in pairs)
    return PromptFormat(chat_template=False, template=SHORT_ANSWER_TEMPLATE, description=description)


def draw_short_answer_examples(records: Sequence[Any], k: int, seed: int = 0) -> tuple[tuple[str, str], ...]:
    """Draw ``k`` solved examples for :func:`short_answer_format` from open questions.

    Records without an accepted answer (e.g. SelfAware's unanswerable questions) are skipped;
    each example is the question and its first alias. The draw depends only on ``seed`` and the
    order of ``records``.

    Args:
        records: :class:`~llm_calib.data.records.OpenQA` records (a training split).
        k: number of examples (>= 0).
        seed: seed of the draw.

    Returns:
        ``k`` ``(question, answer)`` pairs.

    Raises:
        ValueError: ``k`` negative or more than the records with answers; a record that is not
            open-ended.

    Example:
        >>> from llm_calib.data.records import OpenQA
        >>> pool = [OpenQA(f"Q{i}?", (f"A{i}",), "toy", f"p{i}") for i in range(5)]
        >>> ex = draw_short_answer_examples(pool, 2, seed=1)
        >>> len(ex), ex == draw_short_answer_examples(pool, 2, seed=1), ex[0] in [(r.question, r.answers[0]) for r in pool]
        (2, True, True)
    """
    if not isinstance(k, int) or isinstance(k, bool) or k < 0:
        raise ValueError(f"k (number of examples) must be an integer >= 0, got {k!r}")
    from llm_calib.data.records import OpenQA

    bad = next((r for r in records if not isinstance(r, OpenQA)), None)
    if bad is not None:
        raise ValueError(f"short-answer examples come from open questions (OpenQA), got {type(bad).__name__}")
    answered = [r for r in records if r.answers and r.answers[0].strip()]
    if len(answered) < k:
        raise ValueError(f"k={k} short-answer examples requested but only {len(answered)} records have an answer")
    drawn = random.Random(seed).sample(answered, k)
    return _short_answer_pairs([(r.question, r.answers[0]) for r in drawn], "records")


def preset(name: str, **overrides: Any) -> PromptFormat:
    """The :class:`PromptFormat` of a named preset, with fields overridden.

    Args:
        name: a key of :data:`PRESETS`.
        **overrides: :class:`PromptFormat` fields to change (e.g. ``fewshot=5``).

    Returns:
        The format.

    Raises:
        ValueError: an unknown preset name (the message lists the valid ones).

    Example:
        >>> preset("lm_eval_mmlu", fewshot=5).choices
        'letters'
    """
    if name not in PRESETS:
        raise ValueError(f"unknown prompt preset {name!r}; valid presets: {', '.join(PRESETS)}")
    return PromptFormat(**{**PRESETS[name], **overrides})
