"""The prompt flags of ``evaluate``, ``calibrate`` and ``export`` (one builder) and the prompt
format ``evaluate`` and ``export`` resolve from them and from a saved result's record."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

from llm_calib.cli._common import SPEC, UserError, non_negative_int, unescape, user_call
from llm_calib.config.choices import PROMPT_PRESETS

__all__ = ["PROMPT_FIELDS", "prompt_format"]

PROMPT_GROUP_HELP = (
    "how each question is put to the model; evaluate, calibrate and export take the same flags. "
    "Other prompt flags override --prompt-preset; with a saved --adapter (evaluate, export) or a "
    "merged model of export (evaluate --model) the prompt it was trained with is the default"
)


PROMPT_FIELDS = (
    "preset", "template", "target_delimiter", "choices", "fewshot", "fewshot_split", "fewshot_seed",
    "fewshot_sampler", "style", "chat_template", "system_message", "answer_prefix",
)
"""The prompt settings ``evaluate``, ``calibrate`` and ``export`` take flags for (one builder),
by their :class:`~llm_calib.config.calibration.PromptSettings` name."""


EVALUATE_PROMPT_DEST = {field: {"preset": "prompt_preset", "style": "prompt_style"}.get(field, field)
                        for field in PROMPT_FIELDS}
"""Where evaluate and export store each prompt flag (calibrate: ``cfg:prompt.<field>``)."""


def add_prompt_args(group: Any, dest: Callable[[str], str | None]) -> None:
    """The prompt flags of ``evaluate``, ``calibrate`` and ``export`` (one builder, so the three
    spell and parse them alike): each setting of :data:`PROMPT_FIELDS`, stored as ``dest(field)``,
    default None (not given). Texts are unescaped (``\\n`` is a newline)."""

    def add(field: str, *flags: str, **kwargs: Any) -> None:
        group.add_argument(*flags, dest=dest(field), default=None, **kwargs)

    add("preset", "--prompt-preset", choices=tuple(PROMPT_PRESETS),
        help="a named prompt format; the lm_eval_* presets reproduce lm-eval's prompts "
        "(lm_eval_arc, lm_eval_mmlu, lm_eval_openbookqa, lm_eval_commonsenseqa, lm_eval_qasc, "
        "lm_eval_piqa), qa is the open-ended 'Q: ...\\nA:' format; other prompt flags override it "
        "(default: none, the prompt of --prompt-style)")
    add("template", "--template", type=unescape, metavar="TEXT",
        help="question template with named fields {question}, {options} (listed A. ... lines), "
        "{subject}, {context}, {answer_prefix} or any record meta key, e.g. "
        "'Question: {question}\\nAnswer:' ('\\n' is a newline) (default: none)")
    add("target_delimiter", "--target-delimiter", type=unescape, metavar="TEXT",
        help="text between the prompt and each scored choice (default: ' ')")
    add("choices", "--choices", choices=("text", "letters"),
        help="score each option's text, or its letter (for templates that list the options) "
        "(default: text, or the preset's)")
    add("fewshot", "--fewshot", type=non_negative_int, metavar="K",
        help="solved examples before each question, drawn from --fewshot-split (never an "
        "evaluated question; a question gets the same examples in training, selection and "
        "evaluation) (default: 0, zero-shot)")
    add("fewshot_split", "--fewshot-split", type=SPEC, metavar="SPEC",
        help="data spec the few-shot examples come from, e.g. arc_easy:../shared/data:train (default: "
        "none; needed with --fewshot)")
    add("fewshot_seed", "--fewshot-seed", type=int, metavar="S",
        help="seed of the per-question draw of examples (default: 1234, as lm-eval)")
    add("fewshot_sampler", "--fewshot-sampler", choices=("random", "first_n"),
        help="random: a seeded draw per question; first_n: the first K examples of the split "
        "(lm-eval's first_n sampler; its MMLU default) (default: random, or the preset's)")
    add("style", "--prompt-style", choices=("cloze", "listed"),
        help="cloze: the prompt holds the question only; listed: options listed as A., B., ... "
        "(default: cloze for option_likelihood, listed for letter)")
    add("chat_template", "--no-chat-template", action="store_const", const=False,
        help="plain-text prompt instead of the tokenizer's chat template")
    add("system_message", "--system-message", type=str, metavar="TEXT",
        help="system message for the chat (default: the template's own default)")
    add("answer_prefix", "--answer-prefix", type=unescape, metavar="TEXT",
        help="text after the generation prompt, before the scored answer (default: "
        "'The answer is:'; with a template only where it has {answer_prefix})")


def prompt_flags(args: argparse.Namespace) -> dict[str, Any]:
    """The prompt flags given (:func:`add_prompt_args`, as evaluate and export store them), as
    :class:`~llm_calib.prompts.templates.PromptFormat` fields."""
    return {field: getattr(args, dest) for field, dest in EVALUATE_PROMPT_DEST.items()
            if field != "preset" and getattr(args, dest) is not None}


def saved_prompt(base: dict[str, Any]) -> dict[str, Any]:
    """The :class:`~llm_calib.prompts.templates.PromptFormat` fields a saved result records (none for a
    plain adapter)."""
    from llm_calib.prompts.templates import PromptFormat

    saved = base.get("prompt") or {}
    return {k: v for k, v in saved.items() if k in PromptFormat.__dataclass_fields__ and k != "fewshot_pool"}


def prompt_format(args: argparse.Namespace, base: dict[str, Any] | None = None) -> Any:
    """The :class:`~llm_calib.prompts.templates.PromptFormat` of ``llm-calib evaluate`` (and ``export``):
    the preset, else the prompt a saved ``--adapter`` records (``base``), else the scorer's
    default; then the explicit prompt flags. ``calibrate`` builds the same format from the same
    flags (:func:`llm_calib.prompts.resolution.resolve_prompt_settings`; both resolve with :func:`llm_calib.prompts.resolution.resolve_prompt`).

    ``args.scorer`` and ``args.normalize`` (when the command has them) not given default to the
    saved result's, else ``option_likelihood`` and ``sum``.

    Args:
        args: ``evaluate`` or ``export`` arguments parsed by :func:`~llm_calib.cli.build_parser`.
        base: the saved result's record (:func:`llm_calib.calm.export.saved_base`), or None.

    Returns:
        The prompt format (without the few-shot pool).

    Raises:
        SystemExit: through :func:`~llm_calib.cli.main`: flags the scorer does not accept, or ``--fewshot``
            without ``--fewshot-split``.

    Example:
        >>> from llm_calib.cli import build_parser
        >>> args = build_parser().parse_args(["evaluate", "--data", "builtin", "--out", "x",
        ...                                   "--prompt-preset", "lm_eval_arc", "--fewshot", "2",
        ...                                   "--fewshot-split", "builtin:capitals:n=10"])
        >>> fmt = prompt_format(args)
        >>> fmt.template, fmt.fewshot, args.normalize
        ('Question: {question}\\nAnswer:', 2, 'sum')
    """
    from llm_calib.data import absolute_spec
    from llm_calib.formats import multiple_choice_format
    from llm_calib.prompts.resolution import resolve_prompt

    base = base or {}
    scorer = getattr(args, "scorer", None) or base.get("scorer") or "option_likelihood"
    if hasattr(args, "scorer"):
        args.scorer = scorer
        args.normalize = args.normalize or base.get("normalize") or "sum"
    given = prompt_flags(args)
    if "fewshot_split" in given:  # recorded absolute (export, metrics.json), as the model path is
        given["fewshot_split"] = user_call(lambda: absolute_spec(given["fewshot_split"]), "--fewshot-split")
    saved = saved_prompt(base)
    fmt = user_call(lambda: resolve_prompt(scorer, given, preset_name=args.prompt_preset, saved=saved), "prompt")
    try:  # the scorer's own rules on the prompt (the letter scorer needs the options listed)
        multiple_choice_format(scorer, prompt=fmt)
    except ValueError as exc:
        raise UserError(f"--scorer {scorer}: {exc} (see --prompt-style)") from exc
    if fmt.fewshot and not fmt.fewshot_split:
        raise UserError(f"--fewshot {fmt.fewshot} needs --fewshot-split SPEC (the split the examples come from)")
    return fmt


def preset_in_use(args: argparse.Namespace, base: dict[str, Any]) -> str | None:
    """The preset of the prompt in use: ``--prompt-preset``, else the one the saved record
    ``base`` was trained with when no prompt flag changes its prompt."""
    if args.prompt_preset is not None or prompt_flags(args):
        return args.prompt_preset
    return base.get("prompt_preset")


def prompt_origin(args: argparse.Namespace, base: dict[str, Any], source: str) -> str | None:
    """The status line naming where the prompt comes from when ``source`` (``--adapter DIR`` or an
    exported merged ``--model DIR``) records the one it was trained with; None when it does not."""
    if not base.get("prompt"):
        return None
    if args.prompt_preset is not None:
        return f"prompt: --prompt-preset {args.prompt_preset} instead of the one {source} was trained with"
    changed = sorted(prompt_flags(args))
    return f"prompt: the one {source} was trained with" + (
        f", changed by the prompt flags ({', '.join(changed)})" if changed else "")


def warn_prompt_mismatch(trained: dict[str, Any], prompt: Any, tokenizer: Any, source: str, *,
                         scoring: dict[str, Any] | None = None, doing: str = "evaluating") -> None:
    """Warn (stderr, even with ``--quiet``) when ``prompt`` (or the ``scoring`` settings, scorer
    and normalize) differs from what ``source`` (``--adapter DIR``, or an exported merged ``--model
    DIR``) was trained with (``trained``: its saved record; nothing when it does not record the
    prompt). Both prompts are compared as resolved for ``tokenizer`` (an automatic chat template is
    the one it has or not)."""
    from llm_calib.prompts.templates import PromptFormat, prompt_dict

    if not trained.get("prompt"):
        return
    scoring = scoring or {}
    before = {**prompt_dict(PromptFormat(**saved_prompt(trained)), tokenizer),
              **{k: trained.get(k) for k in scoring if trained.get(k) is not None}}
    used = {**prompt_dict(prompt, tokenizer), **{k: v for k, v in scoring.items() if k in before}}
    keys = sorted(k for k in set(before) | set(used) if k != "fewshot_pool_size" and before.get(k) != used.get(k))
    if keys:
        diff = "; ".join(f"{k}: trained {before.get(k)!r}, now {used.get(k)!r}" for k in keys)
        print(f"llm-calib: warning: {doing} {source} with another prompt than it was trained "
              f"with ({diff}); its calibration may not carry over", file=sys.stderr, flush=True)
