"""Command line: ``llm-calib``.

Subcommands:

* ``llm-calib evaluate``: score data sets with a model and write ``metrics.json``, ``report.md``
  and one reliability diagram per domain.
* ``llm-calib calibrate``: train CALM (or the configured objective; ``--methods`` trains several on
  the same data, one model load, each method training and removing its own adapters), save each
  result, and compare them with the uncalibrated and temperature-scaled model per domain in
  ``report.md``, ``metrics.json`` and reliability diagrams.
* ``llm-calib export``: merge a saved adapter (LoRA and the output scale) into its base model and
  save a standalone Hugging Face model.
* ``llm-calib demo``: the main job on the embedded default.
* ``llm-calib metrics SAMPLES...``: the calibration report of lm-eval ``--log_samples`` files
  (:mod:`llm_calib.lm_eval_samples`; no model needed).

Errors in the user's input (a bad data spec, a missing file, an unknown model) print one line
``llm-calib: error: ...`` and exit with status 2, without a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from llm_calib.prompts import PRESETS

__all__ = ["PROMPT_FIELDS", "build_parser", "calibration_config", "main", "prompt_format"]

_T = TypeVar("_T")

_EVALUATE_EPILOG = """\
data specs (LOADER[:TARGET[:OPTION]]), for example:
  builtin                                    the built-in generated set (5 domains)
  arc_easy:../shared/data/arc_easy/test.jsonl
  arc_easy:../shared/data:dev                split of a data root
  mmlu_stem:../shared/data/mmlu/test         one MMLU group
  openbookqa:../shared/data/openbookqa/openbookqa.jsonl
  commonsenseqa:../shared/data/commonsenseqa/genmc_dev.jsonl
  jsonl:my_questions.jsonl                   generic {"question", "options", "answer"} rows
  lm_eval:arc_easy:num_fewshot=5             an lm-eval task, its prompts (lm-eval extra)
  lm_eval:my_task:include=tasks/             a local lm-eval task YAML
see llm_calib.data.spec for the full grammar.

example:
  llm-calib evaluate --model smollm2-135m-instruct \\
      --data arc_easy:../shared/data/arc_easy/test.jsonl --limit 200 \\
      --temperature-fit arc_easy:../shared/data/arc_easy/dev.jsonl --out /tmp/eval

lm-eval's prompt, its first 300 questions, 5 examples from train, per-sample log:
  llm-calib evaluate --data arc_easy:../shared/data:test --prompt-preset lm_eval_arc \\
      --limit 300 --limit-mode first --fewshot 5 --fewshot-split arc_easy:../shared/data:train \\
      --log-samples --out /tmp/eval_lm_eval

a saved calibration result (or any peft adapter) on its base model:
  llm-calib evaluate --model smollm2-135m-instruct --adapter runs/calm/calm --data ... --out ...
a merged model of `llm-calib export` (under the prompt it was trained with, as --adapter):
  llm-calib evaluate --model runs/calm-merged --data ... --out ...
"""


class _UserError(Exception):
    """An error in the user's input, reported without a traceback."""


def _int_at_least(minimum: int):
    """An argparse type accepting integers >= ``minimum``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {value}")
        return value

    return parse


_positive_int = _int_at_least(1)
_non_negative_int = _int_at_least(0)


_DEFAULT_MODEL = "smollm2-135m-instruct"

_BINS_FLAG: dict[str, Any] = {
    "type": _positive_int, "default": 10,
    "help": "equal-width confidence bins for ECE and the reliability diagrams (default: %(default)s)",
}
"""``--bins`` of every command that writes a calibration report (evaluate, calibrate, metrics)."""


def _add_model_loading_args(p: argparse.ArgumentParser, *, training: bool, quantization: bool = True) -> None:
    """``--dtype``, ``--load-in-4bit/8bit``, ``--attn-implementation``, ``--trust-remote-code``
    (and for training ``--gradient-checkpointing``): the fields of ``ModelLoadConfig``; every
    command that loads a model (``evaluate``, ``calibrate``, ``export``) takes them from here.
    ``quantization=False`` leaves out the 4/8-bit flags (``export`` merges into full weights)."""
    from llm_calib.models import ATTN_IMPLEMENTATIONS, DTYPES

    p.add_argument(
        "--dtype", choices=DTYPES, default=None,
        help="parameter dtype of the base model; auto: the checkpoint's own. With bfloat16/float16 "
        "the LoRA weights, the output scale, λ and the optimiser states stay float32 "
        "(default: float32; with a saved calibration result, the dtype it was trained in)",
    )
    if quantization:
        quant = p.add_mutually_exclusive_group()
        quant.add_argument(
            "--load-in-4bit", action="store_true",
            help="quantise the frozen base weights to 4-bit NF4 (QLoRA; needs bitsandbytes: pip install "
            "'llm-calib[quant]'); computes in --dtype, bfloat16 when that is float32 or auto",
        )
        quant.add_argument("--load-in-8bit", action="store_true", help="8-bit (LLM.int8) base weights instead")
    p.add_argument(
        "--attn-implementation", choices=ATTN_IMPLEMENTATIONS, default=None,
        help="attention kernel (default: transformers' choice, sdpa where available); with a kernel "
        "other than eager/sdpa each option is scored as its own sequence instead of packed",
    )
    if training:
        p.add_argument(
            "--gradient-checkpointing", action="store_true",
            help="recompute the trained layers' activations in the backward pass instead of storing "
            "them (less memory, about a third more compute; same gradients)",
        )
    p.add_argument(
        "--trust-remote-code", action="store_true",
        help="allow custom model code from the hub (only for repositories you trust)",
    )
    p.add_argument(
        "--threads", type=_positive_int, default=None,
        help="torch CPU threads (default: torch's choice)",
    )


def _start(args: argparse.Namespace, quiet: bool) -> None:
    """What every command that loads a model does first: ``--threads`` (of
    :func:`_add_model_loading_args`) sets torch's CPU thread count; ``quiet``: no transformers /
    huggingface_hub progress bars ("Loading weights", "Writing model shards", downloads) for the
    rest of the process."""
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    if quiet:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()


def _resolve_base(args: argparse.Namespace, adapter: str | None, flag: str) -> dict[str, Any]:
    """``--model`` and ``--dtype`` default to what the saved result at ``adapter`` records
    (:func:`~llm_calib.export.saved_base`); without an adapter, to the built-in model and float32.

    Returns:
        The saved record (empty when there is none); without an adapter, the record of an exported
        merged ``--model`` (:func:`~llm_calib.export.merged_record`): the prompt it was trained with.
        The file it was read from is ``args.base_record`` (None when there is none).

    Raises:
        _UserError: ``adapter`` is not an adapter directory, or names no base model and no
            ``--model`` is given.
    """
    from llm_calib.export import (
        EXPORT_FILE,
        adapter_directory,
        merged_record,
        saved_base,
        saved_base_file,
    )

    base: dict[str, Any] = {}
    args.base_record = None
    if adapter is not None:
        _user_call(lambda: adapter_directory(adapter), flag)  # fail before loading the model
        base = saved_base(adapter)
        args.base_record = saved_base_file(adapter)
    elif args.model is not None:
        base = merged_record(args.model)
        args.base_record = Path(args.model) / EXPORT_FILE if base else None
    if args.model is None:
        if adapter is not None and not base.get("model"):
            raise _UserError(
                f"--model is required: {flag} {adapter} does not record the base model it was trained on "
                "(a plain peft adapter, or a result saved by an older llm-calib); give the model it was "
                "trained on with --model"
            )
        args.model = base.get("model") or _DEFAULT_MODEL
    if args.dtype is None:
        args.dtype = base.get("dtype") or "float32"
    return base


def _recorded_model(name: str) -> str:
    """The model name a saved result records: an existing local path made absolute (so it still
    loads from another working directory), anything else (alias, hub name) as given."""
    return str(Path(name).resolve()) if Path(name).exists() else name


def _load_model(args: argparse.Namespace, device: str = "cpu") -> tuple[Any, Any, Any]:
    """``--model`` loaded onto ``device`` with the model loading flags (their ``ModelLoadConfig``; on
    a GPU the weights load straight onto it): ``(model, tokenizer, the ModelLoadConfig)``."""
    from llm_calib.models import ModelLoadConfig
    from llm_calib.models import load as load_model

    loading = _user_call(
        lambda: ModelLoadConfig(
            dtype=args.dtype or "float32", load_in_4bit=getattr(args, "load_in_4bit", False),
            load_in_8bit=getattr(args, "load_in_8bit", False),
            attn_implementation=args.attn_implementation,
            gradient_checkpointing=getattr(args, "gradient_checkpointing", False),
            trust_remote_code=args.trust_remote_code,
            device_map=device if str(device).startswith("cuda") else None,
        ),
        "model loading flags",
    )
    model, tokenizer = _user_call(
        lambda: load_model(args.model, cache_dir=args.cache_dir, device=device, config=loading), f"--model {args.model}"
    )
    return model, tokenizer, loading


def _add_data_loading_args(p: argparse.ArgumentParser, *, limit_help: str) -> None:
    """``--limit``, ``--limit-mode`` and ``--on-error``: how every command that loads data reads it."""
    p.add_argument("--limit", type=_positive_int, default=None, metavar="N", help=limit_help)
    p.add_argument(
        "--limit-mode",
        choices=("sample", "first"),
        default=None,
        help="which N questions --limit keeps: a seeded subsample in file order (sample), or the "
        "first N rows of the file (first, as lm-eval's --limit) (default: first with an lm_eval_* "
        "--prompt-preset, else sample)",
    )
    p.add_argument(
        "--on-error",
        choices=("raise", "skip"),
        default="raise",
        help="a malformed data row stops the run (raise) or is skipped and reported with its "
        "file:line:field (skip) (default: %(default)s)",
    )


_SET_OF_FLAG = {"--train": "training", "--heldout": "held-out", "--unlabeled": "unlabelled", "--eval": "evaluation",
                "--data": "evaluation", "--temperature-fit": "temperature-fit"}


def _limit_mode(args: argparse.Namespace) -> str:
    """``--limit-mode`` as given, else ``first`` under an ``lm_eval_*`` prompt preset (lm-eval's
    ``--limit`` takes the first N; the preset of the flag, else the one a saved ``--adapter`` or
    an exported merged ``--model`` was trained with when no prompt flag is given), else ``sample``."""
    mode = getattr(args, "limit_mode", None)
    if mode is not None:
        return mode
    preset = getattr(args, "prompt_preset", None) or getattr(args, "saved_preset", None)
    return "first" if (preset or "").startswith("lm_eval_") else "sample"


def _load_records(args: argparse.Namespace, flag: str, spec: str, log: Callable[[str], None], *,
                  seed: int | None = None, limited: bool = True, note: str = "") -> tuple[str, list]:
    """Load one spec with the shared data-loading flags (``--limit`` only when ``limited``) as
    ``(spec, records)``, logging ``loaded N questions from SPEC`` (and ``note``) with ``log``; no
    records is an error naming the empty set.

    Skipped rows (``--on-error skip``) are reported on stderr even with ``--quiet``, one line
    per row naming its file, line and field, and kept in ``args.skipped_rows``.
    """
    from llm_calib.data import load as load_data

    res = _user_call(
        lambda: load_data(
            spec,
            limit=args.limit if limited else None,
            seed=seed if seed is not None else (args.seed if args.seed is not None else 0),
            on_error=getattr(args, "on_error", "raise"),
            limit_mode=_limit_mode(args),
        ),
        f"{flag} {spec}",
        # ImportError: a loader's optional extra is missing (lm_eval:, hf:); the message names it
        errors=(ValueError, OSError, KeyError, TypeError, ImportError),
    )
    if res.skipped:
        if not hasattr(args, "skipped_rows"):
            args.skipped_rows = {}
        args.skipped_rows[spec] = {"count": res.skipped, "errors": list(res.errors)}
        lines = [f"{flag} {spec}: skipped {res.skipped} malformed rows:"]
        lines += [f"  {message}" for message in res.errors]
        if res.skipped > len(res.errors):
            lines.append(f"  ... and {res.skipped - len(res.errors)} more")
        print("\n".join(lines), file=sys.stderr, flush=True)
    if not res.records:
        raise _UserError(f"{flag} {spec}: no records (the {_SET_OF_FLAG.get(flag, flag)} set is empty)")
    log(f"loaded {len(res.records)} questions from {spec}{note}")
    return spec, res.records


_PROMPT_GROUP_HELP = (
    "how each question is put to the model; evaluate, calibrate and export take the same flags. "
    "Other prompt flags override --prompt-preset; with a saved --adapter (evaluate, export) or a "
    "merged model of export (evaluate --model) the prompt it was trained with is the default"
)

PROMPT_FIELDS = (
    "preset", "template", "target_delimiter", "choices", "fewshot", "fewshot_split", "fewshot_seed",
    "fewshot_sampler", "style", "chat_template", "system_message", "answer_prefix",
)
"""The prompt settings ``evaluate``, ``calibrate`` and ``export`` take flags for (one builder),
by their :class:`~llm_calib.calm.config.PromptSettings` name."""

_EVALUATE_PROMPT_DEST = {field: {"preset": "prompt_preset", "style": "prompt_style"}.get(field, field)
                         for field in PROMPT_FIELDS}
"""Where evaluate and export store each prompt flag (calibrate: ``cfg:prompt.<field>``)."""


def _add_prompt_args(group: Any, dest: Callable[[str], str | None]) -> None:
    """The prompt flags of ``evaluate``, ``calibrate`` and ``export`` (one builder, so the three
    spell and parse them alike): each setting of :data:`PROMPT_FIELDS`, stored as ``dest(field)``,
    default None (not given). Texts are unescaped (``\\n`` is a newline)."""

    def add(field: str, *flags: str, **kwargs: Any) -> None:
        group.add_argument(*flags, dest=dest(field), default=None, **kwargs)

    add("preset", "--prompt-preset", choices=tuple(PRESETS),
        help="a named prompt format; the lm_eval_* presets reproduce lm-eval's prompts "
        "(lm_eval_arc, lm_eval_mmlu, lm_eval_openbookqa, lm_eval_commonsenseqa, lm_eval_qasc, "
        "lm_eval_piqa), qa is the open-ended 'Q: ...\\nA:' format; other prompt flags override it "
        "(default: none, the prompt of --prompt-style)")
    add("template", "--template", type=_unescape, metavar="TEXT",
        help="question template with named fields {question}, {options} (listed A. ... lines), "
        "{subject}, {context}, {answer_prefix} or any record meta key, e.g. "
        "'Question: {question}\\nAnswer:' ('\\n' is a newline) (default: none)")
    add("target_delimiter", "--target-delimiter", type=_unescape, metavar="TEXT",
        help="text between the prompt and each scored choice (default: ' ')")
    add("choices", "--choices", choices=("text", "letters"),
        help="score each option's text, or its letter (for templates that list the options) "
        "(default: text, or the preset's)")
    add("fewshot", "--fewshot", type=_non_negative_int, metavar="K",
        help="solved examples before each question, drawn from --fewshot-split (never an "
        "evaluated question; a question gets the same examples in training, selection and "
        "evaluation) (default: 0, zero-shot)")
    add("fewshot_split", "--fewshot-split", type=str, metavar="SPEC",
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
    add("answer_prefix", "--answer-prefix", type=_unescape, metavar="TEXT",
        help="text after the generation prompt, before the scored answer (default: "
        "'The answer is:'; with a template only where it has {answer_prefix})")


def _add_evaluate(sub: argparse._SubParsersAction) -> None:
    from llm_calib.calm.config import PromptSettings

    p = sub.add_parser(
        "evaluate",
        help="score data sets with a model and write a calibration report",
        description=(
            "Score multiple-choice (or open) data sets with a causal LM and write metrics.json, "
            "report.md (a table per domain with 95%% bootstrap CIs) and reliability_<domain>.png "
            "to --out."
        ),
        epilog=_EVALUATE_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--model",
        default=None,
        help="built-in alias (smollm2-135m-instruct), local model directory, .gguf file or hub "
        "name (default: the base model a saved --adapter records, else smollm2-135m-instruct)",
    )
    p.add_argument(
        "--adapter",
        default=None,
        metavar="DIR",
        help="put this adapter on --model first: a saved calibration result (llm-calib "
        "calibrate's --out/<method>) or any peft adapter directory",
    )
    _add_model_loading_args(p, training=False)
    p.add_argument(
        "--data",
        action="append",
        required=True,
        metavar="SPEC",
        help="data spec to evaluate; repeat for several data sets (results per domain)",
    )
    p.add_argument(
        "--scorer",
        choices=PromptSettings.field_choices["scorer"],  # calibrate's choices: the registered formats
        default=None,
        help="multiple-choice scorer: likelihood of each option's text, or the logits of the "
        "option letters with the options listed (default: the one a saved --adapter or merged "
        "--model was trained with, else option_likelihood)",
    )
    p.add_argument(
        "--normalize",
        choices=("sum", "mean", "char", "byte"),
        default=None,
        help="option likelihood: summed token log-probabilities (lm-eval's acc), their mean per "
        "token, or the sum divided by the choice's characters (acc_norm) or bytes (acc_bytes); "
        "the report shows all four side by side either way (default: the one a saved --adapter "
        "or merged --model was trained with, else sum)",
    )
    _add_prompt_args(p.add_argument_group("prompt", _PROMPT_GROUP_HELP), _EVALUATE_PROMPT_DEST.get)
    _add_data_loading_args(
        p,
        limit_help="at most N questions per evaluated data set (see --limit-mode; the --temperature-fit "
        "set is read whole)",
    )
    p.add_argument(
        "--batch-size",
        type=_positive_int,
        default=8,
        metavar="B",
        help="questions per forward pass (default: %(default)s)",
    )
    p.add_argument(
        "--prefix-cache",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="compute a prompt prefix shared by several questions (few-shot examples, a task "
        "description, a system message) once and reuse its keys/values; scores are the same up to "
        "float rounding, bit-identical with --no-prefix-cache (default: on)",
    )
    p.add_argument(
        "--prefix-cache-mb",
        type=_positive_int,
        default=1024,
        metavar="MB",
        help="bound on the prefix keys/values held for one batch, in MiB (default: %(default)s)",
    )
    p.add_argument(
        "--temperature-fit",
        default=None,
        metavar="SPEC",
        help="fit a temperature on this split (e.g. arc_easy:../shared/data:dev) and report "
        "temperature-scaled metrics for every domain next to the uncalibrated ones",
    )
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        metavar="S",
        help="seed of the --limit subsample and of the bootstrap (default: %(default)s)",
    )
    p.add_argument("--bins", **_BINS_FLAG)
    p.add_argument(
        "--bootstrap",
        type=_non_negative_int,
        default=1000,
        metavar="R",
        help="bootstrap resamples for the 95%% confidence intervals; 0 disables them (default: %(default)s)",
    )
    p.add_argument(
        "--max-new-tokens",
        type=_positive_int,
        default=32,
        help="generation budget for open-ended questions (default: %(default)s)",
    )
    p.add_argument(
        "--device", default="cpu", help="torch device to run the model on (default: %(default)s)"
    )
    p.add_argument(
        "--cache-dir",
        default=None,
        help="cache of the converted built-in model (default: $LLM_CALIB_CACHE/<alias> or "
        "~/.cache/llm_calib/<alias>) or hub cache for hub names",
    )
    p.add_argument("--quiet", "--no-progress", dest="quiet", action="store_true",
                   help="no progress bars (transformers' loading bars included) and no status lines")
    p.add_argument(
        "--log-samples",
        action="store_true",
        help="also write --out/samples.jsonl: one JSON line per question (id, domain, prompt, "
        "options, per-option log-likelihood and token count, probabilities, prediction, gold, "
        "confidence, correct), written atomically",
    )
    p.add_argument(
        "--out", required=True, metavar="DIR", help="output directory (created if missing)"
    )
    p.set_defaults(func=_cmd_evaluate)


def _add_export(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "export",
        help="merge a saved adapter into its base model and save a standalone model",
        description=(
            "Load --model, put the adapter of DIR on it (a saved calibration result or any peft "
            "adapter), fold LoRA and the output scale into the base weights and save the merged "
            "model with save_pretrained (safetensors) plus its tokenizer to --out. The result "
            "loads with plain transformers (AutoModelForCausalLM.from_pretrained), without peft "
            "or llm_calib, and runs at the base model's cost."
        ),
        epilog="example:\n  llm-calib export runs/calm/calm --model smollm2-135m-instruct --out smollm2-calm\n",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("adapter", metavar="DIR", help="saved calibration result or peft adapter directory")
    p.add_argument(
        "--model",
        default=None,
        help="the base model the adapter was trained on: built-in alias, local directory, .gguf "
        "file or hub name (default: the one the saved result records; required for a plain peft "
        "adapter or a result saved without it)",
    )
    _add_model_loading_args(p.add_argument_group("model loading", "how the base model is loaded (--dtype: "
                                                 "the dtype of the merged weights)"),
                            training=False, quantization=False)
    p.add_argument("--cache-dir", default=None, help="cache of the converted built-in model, or hub cache")
    p.add_argument("--out", required=True, metavar="MERGED", help="output directory (created if missing)")
    p.add_argument("--quiet", "--no-progress", dest="quiet", action="store_true",
                   help="no progress bars (transformers' 'Loading weights' and 'Writing model shards')")
    _add_prompt_args(
        p.add_argument_group("prompt", "the prompt the merged model is meant to be used with, recorded in "
                             "MERGED/llm_calib_export.json (default: the one the saved result was trained "
                             "with; another one warns)"),
        _EVALUATE_PROMPT_DEST.get,
    )
    p.set_defaults(func=_cmd_export)


def _cmd_export(args: argparse.Namespace) -> int:
    import warnings

    from llm_calib.export import EXPORT_FILE, export_merged
    from llm_calib.file_modes import write_text_atomic
    from llm_calib.prompts import prompt_dict

    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
    _start(args, args.quiet)
    base = _resolve_base(args, args.adapter, "export")  # fails before loading the model
    prompt = prompt_format(args, base)
    model, tokenizer, _ = _load_model(args)
    _warn_prompt_mismatch(base, prompt, tokenizer, f"--adapter {args.adapter}", doing="exporting")
    out = _user_call(lambda: export_merged(model, tokenizer, args.adapter, args.out), "export")
    record = Path(out) / EXPORT_FILE  # what the merged model was calibrated for: evaluate --model reads it
    write_text_atomic(record, json.dumps({**json.loads(record.read_text()), "prompt": prompt_dict(prompt, tokenizer),
                                          "prompt_preset": _preset_in_use(args, base),
                                          **{k: base[k] for k in ("scorer", "normalize") if k in base}}, indent=2))
    print(f"wrote the merged model to {out}")
    return 0


_CALIBRATE_EPILOG = """\
By default one objective is trained: the config's (CALM with BOME unless --config or --objective
says otherwise); --methods calm,lora_ce,... trains and compares several. The report always has
the uncalibrated model and temperature scaling next to the trained ones.

configuration precedence: built-in defaults < --config FILE < explicit flags.
A config file (YAML or JSON) holds the nested CalibrationConfig, for example:
  objective:              # the objective trained without --methods, tagged by name
    name: calm
    solver: {name: bome, eta: 2.0, inner_steps: 5}
    adjustment: auto
    lam_lr: 5.0e-2
  lora: {rank: 8, alpha: 16, target_modules: [q_proj, v_proj], top_layers: 6}
  prompt: {scorer: option_likelihood, style: cloze}
  training: {steps: 60, batch_size: 8, heldout_batch_size: 8, lr: 1.0e-3}
  selection: {eval_every: 10, guard_accuracy: 0.95}
Unknown keys are errors; a key of the old flat format (steps:, bome_eta:, ...) is an error naming
its new place. Flags of an objective's or solver's settings (--confidence-penalty-beta,
--f2sa-sigma, ...) apply wherever that objective or solver is trained. See
llm_calib.calm.config.CalibrationConfig for every field.

outputs in --out DIR:
  <method>/            adapter/ (peft), lambda.safetensors, config.json, history.json, metrics.json
  checkpoints/<method>/  with --checkpoint-every N (continue with --resume)
  report.md            before/after table per domain: uncalibrated, temperature-scaled, methods
  metrics.json         every number of report.md, plus reliability bins
  reliability_<domain>.png

multi-process (one rank per GPU, or CPU processes with gloo):
  torchrun --nproc_per_node=2 -m llm_calib.cli calibrate ... --device cuda
(the global --batch-size is split over the ranks; rank 0 writes the outputs.)

example (CALM, against the uncalibrated and temperature-scaled model):
  llm-calib calibrate --model smollm2-135m-instruct \\
      --train arc_easy:../shared/data:train --heldout arc_easy:../shared/data:dev \\
      --eval arc_easy:../shared/data/arc_easy/test.jsonl --eval mmlu_stem:../shared/data/mmlu/test \\
      --limit 200 --steps 60 --out /tmp/calm

comparing methods (each trained with the same data, seed and budget):
  llm-calib calibrate ... --methods calm,lora_ce,label_smoothing,confidence_penalty --out /tmp/compare

the CALM paper's protocol (vector λ, LoRA r=64 on every linear layer, batch 16, 5 epochs, letters),
with an instruction-data lower level (JSONL of {"prompt", "response"} lines) and multiple-choice
held-out and evaluation sets; flags override the preset:
  llm-calib calibrate --preset paper --train jsonl:alpaca.jsonl \\
      --heldout arc_challenge:../shared/data:dev --eval arc_challenge:../shared/data:test --out /tmp/paper

open-ended training (greedy answers, exact match in the report; no temperature column):
  llm-calib calibrate --train webquestions:../shared/data:train \\
      --heldout webquestions:../shared/data:dev --eval webquestions:../shared/data:test \\
      --eval nq_open:../shared/data:dev --limit 200 --out /tmp/calm_open
"""


def _methods(text: str) -> list[str]:
    from llm_calib.objectives.registry import objective_names

    methods = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in methods if m not in objective_names()]
    if bad or not methods:
        raise argparse.ArgumentTypeError(
            f"expected a comma-separated list from {', '.join(objective_names())}, got {text!r}"
        )
    if len(set(methods)) != len(methods):
        raise argparse.ArgumentTypeError(f"a method is listed twice in {text!r}")
    return methods


def _add_calibrate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "calibrate",
        help="calibrate a model (CALM by default; --methods compares several objectives)",
        description=(
            "Train the configured objective (CALM by default), or each of --methods with the same data, "
            "seed and budget, with fresh LoRA adapters on the model (loaded once); save each result to "
            "--out/<method>/; evaluate the uncalibrated model, temperature scaling (T fitted on the held-out "
            "split) and every trained method on each --eval set, domain by domain; write report.md, "
            "metrics.json and reliability_<domain>.png to --out."
        ),
        epilog=_CALIBRATE_EPILOG + "\n" + _EVALUATE_EPILOG.split("\n\nexample:")[0] + "\n",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--model",
        default=_DEFAULT_MODEL,
        help="built-in alias (smollm2-135m-instruct), local model directory, .gguf file or hub "
        "name; loaded once, every method trains its own adapters on it (default: %(default)s)",
    )
    p.add_argument(
        "--train", required=True, metavar="SPEC",
        help="data spec of the labelled training split (lower level: task cross-entropy); all "
        "multiple choice, or all open questions (e.g. nq_open), trained on their first answer; or "
        "instruction data, jsonl:PATH of {prompt, response} (or Alpaca's {instruction, input, output}) "
        "lines, trained on the response under a multiple-choice --heldout",
    )
    p.add_argument(
        "--heldout", required=True, metavar="SPEC",
        help="data spec of the held-out split, of the kind of --train (multiple choice also under "
        "open-ended --train records): its labels serve "
        "model selection, the accuracy guard and (multiple choice only) the temperature fit; its "
        "inputs drive CALM's entropy objective unless --unlabeled is given",
    )
    p.add_argument(
        "--eval", action="append", required=True, metavar="SPEC",
        help="data spec to evaluate on; repeat for several sets (reported per domain)",
    )
    p.add_argument("--out", required=True, metavar="DIR", help="output directory (created if missing)")
    p.add_argument(
        "--config", default=None, metavar="FILE",
        help="YAML or JSON file of the nested CalibrationConfig (overridden by explicit flags)",
    )
    p.add_argument(
        "--methods", type=_methods, default=None, metavar="M[,M...]",
        help="compare several objectives: comma-separated names from calm, lora_ce, label_smoothing, "
        "confidence_penalty or a registered objective, each trained with its settings (the config's for "
        "its objective, else the defaults, then the flags of that objective) (default: only the "
        "objective of --objective / the config file, CALM unless set)",
    )
    _add_data_loading_args(
        p, limit_help="at most N questions per data spec (--train, --heldout, --eval; see --limit-mode)"
    )
    p.add_argument(
        "--unlabeled", action="append", default=None, metavar="SPEC",
        help="data spec of unlabelled upper-level inputs (CALM's entropy objective and the "
        "confidence penalty's entropy term), of the same kind as --heldout; labels in it are "
        "ignored; repeat for several sets (default: the --heldout inputs; then --heldout "
        "serves only model selection, the accuracy guard and the temperature fit)",
    )
    p.add_argument(
        "--unlabeled-limit", type=_positive_int, default=None, metavar="N",
        help="at most N records per --unlabeled spec (a seeded subsample; default: all, "
        "--limit does not apply to --unlabeled)",
    )
    p.add_argument(
        "--resume", action="store_true",
        help="reuse finished methods in --out (same config) and continue unfinished ones from "
        "their newest checkpoint",
    )
    p.add_argument(
        "--no-progress", "--quiet", dest="no_progress", action="store_true",
        help="no progress bars, transformers' loading bars included (training shows "
        "loss/accuracy/entropy/held-out ECE otherwise)",
    )
    p.add_argument(
        "--bootstrap", type=_non_negative_int, default=1000, metavar="R",
        help="bootstrap resamples for 95%% confidence intervals in the report; 0 disables them "
        "(default: %(default)s)",
    )
    p.add_argument("--bins", **_BINS_FLAG)
    p.add_argument(
        "--device", default="cpu",
        help="torch device (default: %(default)s); 'cuda' under torchrun means cuda:LOCAL_RANK",
    )
    p.add_argument(
        "--cache-dir", default=None,
        help="cache of the converted built-in model, or hub cache for hub names",
    )
    _add_model_loading_args(p.add_argument_group("model loading", "how the base model is loaded (once per run)"),
                            training=True)
    _add_config_flags(p)
    p.set_defaults(func=_cmd_calibrate)


_PART_GROUPS = {
    "lora": ("LoRA settings (CalibrationConfig.lora)", "--lora-"),
    "prompt": ("prompt settings (CalibrationConfig.prompt)", "--"),
    "training": ("training budget (CalibrationConfig.training)", "--"),
    "selection": ("model selection (CalibrationConfig.selection)", "--"),
}
"""Flag group and flag prefix of each settings part of the config."""

_FLAG_ALIASES = {
    "objective:calm.adjustment": "--adjustment", "objective:calm.lam_lr": "--lam-lr",
    "objective:calm.max_log_scale": "--max-log-scale", "objective:calm.max_bias": "--max-bias",
    "objective:confidence_penalty.beta": "--penalty-beta", "objective:label_smoothing.eps": "--label-smoothing",
    "solver:implicit.maxiter": "--cg-maxiter", "solver:implicit.damping": "--cg-damping",
    "solver:implicit.tol": "--cg-tol", "lora.output_scale": "--output-scale",
    "lora.output_scale_lr": "--output-scale-lr",
}
"""Spellings of the flags before the config was nested, still accepted."""


def _dashed(name: str) -> str:
    return name.replace("_", "-")


def _shown(value: Any) -> str:
    if isinstance(value, tuple):
        return ",".join(map(str, value)) if value else "[]"
    return "null" if value is None else str(value)


def _settings_flags(cls: type, dest: str, flag: str, group: Any, key: str, *, skip: Any = None,
                    help_from: type | None = None) -> None:
    """One flag per field of the settings dataclass ``cls``: ``flag + field`` (dashed) plus the old
    spelling of ``_FLAG_ALIASES[key + field]``; stored as ``dest + field``; help from its docstring."""
    import dataclasses
    import typing

    from llm_calib.calm.config import field_help
    from llm_calib.flags import flag_type, plain_help

    hints, helps, choices = typing.get_type_hints(cls), field_help(help_from or cls), getattr(cls, "field_choices", {})
    try:
        defaults = cls()
    except (TypeError, ValueError):
        defaults = None
    for f in dataclasses.fields(cls):
        default = getattr(defaults, f.name, None)
        if dataclasses.is_dataclass(default) or (skip and skip(f.name)):
            continue  # a nested part (CALM's solver) has its own flags
        names = [flag + _dashed(f.name)] + [a for a in [_FLAG_ALIASES.get(key + f.name)] if a]
        parse, metavar = flag_type(hints[f.name])
        allowed = choices.get(f.name)
        shown = "" if defaults is None else f" (default: {_shown(default)})"
        group.add_argument(*names, dest=dest + f.name, type=None if allowed else parse, choices=allowed,
                           default=None, metavar=None if allowed else metavar,
                           help=plain_help(helps.get(f.name, f.name)) + shown)


def _add_config_flags(p: argparse.ArgumentParser) -> None:
    """The config's flags, generated from its dataclasses, one group per part."""
    import dataclasses

    from llm_calib.calm.config import CONFIG_PRESETS, PARTS, CalibrationConfig
    from llm_calib.objectives.registry import (
        objective_class,
        objective_names,
        solver_class,
        solver_names,
    )

    group = p.add_argument_group(
        "objective (CalibrationConfig.objective)",
        "the objective trained without --methods, and the settings of each objective; a setting's flag "
        "applies wherever its objective is trained",
    )
    group.add_argument("--objective", dest="objective_name", choices=objective_names(), default=None,
                       help="the objective to train (default: the config file's, else calm)")
    for name in objective_names():
        _settings_flags(objective_class(name), f"obj:{name}:", f"--{_dashed(name)}-", group, f"objective:{name}.")
    classes = {n: solver_class(n) for n in solver_names()}
    # the fields every solver has (inner_steps, ...): one flag sets the chosen solver's
    common = set.intersection(*({f.name for f in dataclasses.fields(c)} for c in classes.values()))
    group = p.add_argument_group(
        "solver (CalibrationConfig.objective.solver, CALM's bilevel solver)",
        "the solver and the settings of each solver; --inner-steps and --inner-lr set those of the chosen one",
    )
    group.add_argument("--solver", dest="solver_name", choices=solver_names(), default=None,
                       help="CALM's bilevel solver: bome (first-order, default), f2sa (first-order penalty) or "
                       "implicit (exact hypergradients after lower-level steps), or a registered solver")
    for name, cls in classes.items():
        _settings_flags(cls, f"solver:{name}:", f"--{_dashed(name)}-", group, f"solver:{name}.",
                        skip=common.__contains__)
    from llm_calib.objectives.calm import CalmSolver

    _settings_flags(next(iter(classes.values())), "solver:*:", "--", group, "solver:*.",
                    skip=lambda f: f not in common, help_from=CalmSolver)
    for part, cls in PARTS.items():
        title, prefix = _PART_GROUPS[part]
        group = p.add_argument_group(title)
        if part == "prompt":  # evaluate's prompt flags, from the builder they share
            shared = set(PROMPT_FIELDS) - {"chat_template"}  # --chat-template true|false|null stays too
            _add_prompt_args(group, lambda field: f"cfg:prompt.{field}")
            _settings_flags(cls, "cfg:prompt.", prefix, group, "prompt.", skip=shared.__contains__)
        else:
            _settings_flags(cls, f"cfg:{part}.", prefix, group, f"{part}.")
    group = p.add_argument_group("run (CalibrationConfig.checkpoint_every, seed, preset)")
    _settings_flags(CalibrationConfig, "cfg:", "--", group, "", skip=lambda f: f in PARTS or f in ("objective", "preset"))
    group.add_argument(
        "--preset", dest="cfg:preset", choices=tuple(CONFIG_PRESETS), default=None,
        help="start from a named configuration; --config and explicit flags override its values, an "
        "explicit --steps its --epochs. paper: the CALM paper's protocol (CALM + BOME, per-vocabulary λ "
        "(--adjustment vector), LoRA r=64, alpha=32 on every linear layer, batch 16, 5 epochs, options "
        "listed and scored by letter; see docs/methods/calm.md) (default: none)",
    )


def _config_overrides(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, dict[str, Any]], dict[str, dict[str, Any]]]:
    """The settings explicit flags set: ``(config dict of the parts, objective name -> settings,
    solver name (or "*": the chosen one) -> settings)``."""
    parts: dict[str, Any] = {}
    objectives: dict[str, dict[str, Any]] = {}
    solvers: dict[str, dict[str, Any]] = {}
    for key, value in vars(args).items():
        if value is None or ":" not in key:
            continue
        value = [list(v) if isinstance(v, tuple) else v for v in value] if isinstance(value, tuple) else value
        kind, rest = key.split(":", 1)
        if kind == "cfg":
            part, _, name = rest.rpartition(".")
            (parts.setdefault(part, {}) if part else parts)[name] = value
        elif kind in ("obj", "solver"):
            owner, name = rest.split(":", 1)
            (objectives if kind == "obj" else solvers).setdefault(owner, {})[name] = value
    return parts, objectives, solvers


def _flag_of(dest: str) -> str:
    """The flag of an objective's or solver's setting stored as ``dest`` (``obj:calm:lam_lr``)."""
    if dest == "solver_name":
        return "--solver"
    _, owner, name = dest.split(":")
    return "--" + (_dashed(name) if owner == "*" else f"{_dashed(owner)}-{_dashed(name)}")


def calibration_config(args: argparse.Namespace) -> tuple[Any, list[Any]]:
    """The ``calibrate`` run's configuration (defaults < ``--config`` < flags) and the objectives to
    train (the configuration's own, or each of ``--methods``, with the flags of each).

    Args:
        args: ``llm-calib calibrate`` arguments parsed by :func:`build_parser`.

    Returns:
        The :class:`~llm_calib.calm.config.CalibrationConfig` (its objective: the first one to
        train) and the list of objectives.

    Raises:
        SystemExit: through :func:`main`: a bad file, flag value, or a setting flag of an
            objective that is not trained.

    Example:
        >>> args = build_parser().parse_args(["calibrate", "--model", "m", "--train", "builtin",
        ...     "--heldout", "builtin", "--eval", "builtin", "--out", "out", "--steps", "5",
        ...     "--methods", "calm,lora_ce"])
        >>> config, objectives = calibration_config(args)
        >>> config.training.steps, [o.name for o in objectives]
        (5, ['calm', 'lora_ce'])
    """
    import dataclasses

    from llm_calib.calm.config import (
        CalibrationConfig,
        apply_preset,
        flat_key_location,
        read_config_file,
    )
    from llm_calib.data import absolute_spec
    from llm_calib.objectives.registry import objective_class, objective_from_dict

    data: dict = {}
    if args.config:
        data = _user_call(lambda: read_config_file(args.config), f"--config {args.config}")
        # validate the file alone first, so that an error names the file (and an old key its line)
        _user_call(lambda: CalibrationConfig.from_dict(data), f"--config {flat_key_location(args.config, data)}")
    parts, objective_flags, solver_flags = _config_overrides(args)
    # precedence: defaults < --preset (else the file's preset:) < --config < flags
    preset = parts.pop("preset", None) or data.get("preset")
    if preset is not None:
        data = _user_call(lambda: apply_preset({**data, "preset": preset}), "--preset")
    merged = {k: v for k, v in data.items() if k != "objective"}
    for part, values in parts.items():
        if isinstance(values, dict):
            merged[part] = {**(merged.get(part) or {}), **values}
        else:
            merged[part] = values
    if "steps" in parts.get("training", {}) and "epochs" not in parts["training"] and "training" in merged:
        merged["training"]["epochs"] = None  # an explicit --steps replaces the preset's or the file's epochs
    base = data.get("objective", CalibrationConfig().objective.name)
    base = {"name": base} if isinstance(base, str) else {"name": CalibrationConfig().objective.name, **base}
    if args.objective_name is not None:  # another objective than the file's: its settings were for that one
        base = {base["name"]: base}.get(args.objective_name, {"name": args.objective_name})
    names = args.methods or [base["name"]]
    given = {base["name"]: base}
    objectives, used_solvers = [], set()
    for name in names:
        settings = {**given.get(name, {"name": name}), **objective_flags.get(name, {})}
        cls = objective_class(name)
        default = _user_call(cls, f"objective {name}")
        if "solver" in {f.name for f in dataclasses.fields(cls)} and dataclasses.is_dataclass(default.solver):
            solver = settings.get("solver", {})
            solver = {"name": solver} if isinstance(solver, str) else {"name": default.solver.name, **solver}
            if args.solver_name is not None:
                solver = {solver["name"]: solver}.get(args.solver_name, {"name": args.solver_name})
            solver.update(solver_flags.get("*", {}))
            solver.update(solver_flags.get(solver["name"], {}))
            used_solvers |= {"*", solver["name"]}
            settings["solver"] = solver
        objectives.append(_user_call(lambda s=settings: objective_from_dict(s), "calibration config"))
    unused = [f"obj:{o}:{k}" for o, v in objective_flags.items() if o not in names for k in v]
    unused += [f"solver:{o}:{k}" for o, v in solver_flags.items() if o not in used_solvers for k in v]
    if args.solver_name is not None and not used_solvers:
        unused.append("solver_name")
    if unused:
        flags = ", ".join(sorted({_flag_of(d) for d in unused}))
        raise _UserError(f"{flags}: no trained objective has this setting (objectives: {', '.join(names)}; "
                         "an objective's or solver's flags apply to the objectives trained with it)")
    config = _user_call(lambda: CalibrationConfig.from_dict({**merged, "objective": objectives[0]}),
                        "calibration config")
    if config.prompt.fewshot_split:  # recorded absolute (config.json, base_model.json), as the model path is
        config.prompt.fewshot_split = _user_call(lambda: absolute_spec(config.prompt.fewshot_split), "--fewshot-split")
    return config, objectives


def _device(name: str) -> str:
    import os

    if name == "cuda" and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
    return name


def _fewshot_pool(args: argparse.Namespace, prompt: Any, evaluated: list, log: Callable[[str], None],
                  what: str | None = None) -> Any:
    """``prompt`` with its few-shot pool: ``prompt.fewshot_split`` loaded once, without the
    ``evaluated`` questions (``evaluate``: the questions it scores; ``calibrate``: the held-out and
    evaluation sets, so training, selection and evaluation draw each question's examples from the
    same pool, and a question shows the same examples in all three and in an ``evaluate`` of the
    same split with the same flags). A load error names ``what`` (default: ``--fewshot-split SPEC``)."""
    from llm_calib.fewshot import resolve_fewshot

    fmt = _user_call(lambda: resolve_fewshot(prompt, exclude=evaluated, on_error=args.on_error),
                     what or f"--fewshot-split {prompt.fewshot_split}")
    log(f"few-shot pool: {len(fmt.fewshot_pool)} examples from {fmt.fewshot_split}")
    return fmt


def _cmd_calibrate(args: argparse.Namespace) -> int:

    from llm_calib import distributed
    from llm_calib.calm.encoding import format_settings, run_formats
    from llm_calib.calm.trainer import TrainingDiverged
    from llm_calib.compare import run_comparison, write_comparison_report
    from llm_calib.data import load as load_data
    from llm_calib.prompts import PromptFormat, prompt_dict

    config, methods = calibration_config(args)
    args.prompt_preset = config.prompt.preset  # --limit-mode's default follows the preset (flag or file)
    _start(args, args.no_progress)
    distributed.init_from_env()
    main_rank = distributed.rank() == 0

    def log(message: str) -> None:
        if main_rank:
            print(message, file=sys.stderr, flush=True)

    seed = config.seed
    t0 = time.perf_counter()
    # Load every data set before the model, so a bad spec fails fast.
    train = _load_records(args, "--train", args.train, log, seed=seed)
    heldout = _load_records(args, "--heldout", args.heldout, log, seed=seed)
    evals = [_load_records(args, "--eval", spec, log, seed=seed) for spec in args.eval]
    if config.prompt.fewshot:  # one pool for training, selection and evaluation, as evaluate draws it
        settings = config.prompt
        settings.fewshot_pool = _fewshot_pool(
            args, PromptFormat(fewshot=settings.fewshot, fewshot_split=settings.fewshot_split),
            [r for _, recs in [heldout, *evals] for r in recs], log,
        ).fewshot_pool
    # one kind of record per set, read here; the held-out kind is the training kind, or multiple
    # choice under open-ended (prompt, response) training; the message names the offending record
    names = (f"--train {args.train}", f"--heldout {args.heldout}", "--unlabeled")
    fmt = _user_call(lambda: run_formats(train[1], heldout[1], config, names=names).upper, None, (ValueError,))
    unlabeled = None
    if args.unlabeled:
        parts = [_user_call(lambda spec=spec: load_data(spec, limit=args.unlabeled_limit, seed=seed).records,
                            f"--unlabeled {spec}") for spec in args.unlabeled]
        unlabeled = ("+".join(args.unlabeled), [r for part in parts for r in part])
        if not unlabeled[1]:
            raise _UserError(f"--unlabeled {unlabeled[0]}: no records (the unlabelled set is empty)")
        _user_call(lambda: fmt.check(unlabeled[1], what=f"--unlabeled {unlabeled[0]}"), None, (ValueError,))
        log(f"loaded {len(unlabeled[1])} unlabelled inputs from {unlabeled[0]}")
    load_s = time.perf_counter() - t0
    t1 = time.perf_counter()
    model, tokenizer, loading = _load_model(args, _device(args.device))  # once: every method trains its own adapters
    log(f"loaded {args.model} ({loading.dtype}{', 4-bit' if loading.load_in_4bit else ''}"
        f"{', 8-bit' if loading.load_in_8bit else ''}) in {time.perf_counter() - t1:.1f} s")
    # the prompt as resolved (chat_template: whether this tokenizer's template is used), as evaluate records it
    prompt = prompt_dict(format_settings(config)["prompt"], tokenizer)
    try:
        cmp = run_comparison(
            model, tokenizer, train, heldout, evals, config, methods, args.out,
            unlabeled=unlabeled, resume=args.resume, progress=not args.no_progress, n_bins=args.bins,
            bootstrap=args.bootstrap, log=log,
            base_model={"model": _recorded_model(args.model), "dtype": loading.dtype, "prompt": prompt,
                        "prompt_preset": config.prompt.preset},
        )
    except TrainingDiverged as exc:
        print(f"llm-calib: error: training diverged: {exc}", file=sys.stderr)
        return 1
    except ValueError as exc:
        raise _UserError(str(exc)) from exc
    cmp.config["model"] = args.model
    cmp.config["model_loading"] = loading.to_dict()
    cmp.config["prompt"] = prompt
    cmp.config["limit"] = args.limit
    cmp.config["limit_mode"] = _limit_mode(args)
    cmp.config["skipped"] = getattr(args, "skipped_rows", {})
    cmp.config["timings"]["data_loading_s"] = load_s
    if not main_rank:
        return 0
    paths = write_comparison_report(cmp, args.out)
    paths["model_loading"] = loading.save(Path(args.out) / "model_loading.json")
    for dom, d in cmp.domains.items():
        cells = ", ".join(
            f"{col}={(d.columns.get(col) or {}).get('ece', float('nan')):.3f}" for col in cmp.columns
        )
        print(f"{dom}: n={d.n} ECE {cells}")
    print(f"wrote {len(paths)} report files and {len(methods)} result directories to {args.out}")
    return 0


def _add_metrics(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "metrics",
        help="calibration metrics of lm-eval --log_samples files (no model needed)",
        description="Read lm-evaluation-harness samples_<task>_<date>.jsonl files (--log_samples) "
        "of multiple-choice tasks, from any model lm-eval ran, and write the calibration report "
        "of `evaluate` (metrics.json, report.md, reliability diagrams): one domain per task.",
    )
    p.add_argument("samples", nargs="+", metavar="SAMPLES", help="lm-eval samples_*.jsonl files")
    p.add_argument(
        "--normalize", choices=("sum", "char", "byte"), default="sum",
        help="option scores of the headline metrics: summed log-likelihoods (lm-eval's acc), per "
        "character (acc_norm) or per byte (acc_bytes); the report shows all three side by side "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--temperature-fit", default=None, metavar="TASK",
        help="fit a temperature on this task (one of the SAMPLES tasks, or another samples file) "
        "and report temperature-scaled metrics for every task",
    )
    p.add_argument(
        "--target-delimiter", type=_unescape, default=" ", metavar="TEXT",
        help="the tasks' target delimiter, removed from each continuation to get the choice text "
        "acc_norm and acc_bytes divide by (default: a space)",
    )
    p.add_argument("--seed", type=int, default=0, metavar="S", help="bootstrap seed (default: %(default)s)")
    p.add_argument("--bins", **_BINS_FLAG)
    p.add_argument(
        "--bootstrap", type=_non_negative_int, default=1000, metavar="R",
        help="bootstrap resamples for the 95%% confidence intervals; 0 disables them (default: %(default)s)",
    )
    p.add_argument("--out", required=True, metavar="DIR", help="output directory (created if missing)")
    p.set_defaults(func=_cmd_metrics)


def _cmd_metrics(args: argparse.Namespace) -> int:
    from llm_calib.lm_eval_samples import samples_result
    from llm_calib.report import write_report

    for path in args.samples:
        if not Path(path).is_file():
            raise _UserError(f"{path}: no such samples file")
    result = _user_call(
        lambda: samples_result(
            args.samples,
            normalize=args.normalize,
            temperature_fit=args.temperature_fit,
            target_delimiter=args.target_delimiter,
            n_bins=args.bins,
            ci=args.bootstrap > 0,
            n_resamples=max(args.bootstrap, 1),
            seed=args.seed,
        ),
        "metrics",
    )
    paths = write_report(result, args.out, title="Calibration report (lm-eval samples)")
    _print_summary(result, paths, args.out)
    return 0


def _print_summary(result: Any, paths: dict[str, Any], out: str) -> None:
    """The stdout summary of ``evaluate`` and ``metrics``: a line per domain (accuracy, ECE, the
    temperature-scaled ECE, the accuracy of each normalisation) and the files written."""
    for dom, r in result.domains.items():
        unc = r.uncalibrated
        line = f"{dom}: n={r.n} accuracy={unc['accuracy']:.3f} ECE={unc['ece']:.3f}"
        if r.temperature_scaled and result.temperature is not None:
            line += f" ECE(T={result.temperature.temperature:.2f})={r.temperature_scaled['ece']:.3f}"
        if r.normalizations:
            line += " | " + " ".join(f"{n}={m['accuracy']:.3f}" for n, m in r.normalizations.items())
        print(line)
    print(f"wrote {len(paths)} files to {out}")


def build_parser() -> argparse.ArgumentParser:
    """The ``llm-calib`` argument parser (one subparser per subcommand).

    Example:
        >>> args = build_parser().parse_args(["evaluate", "--data", "builtin", "--out", "x"])
        >>> args.command, args.data, args.fewshot
        ('evaluate', ['builtin'], None)
    """
    parser = argparse.ArgumentParser(
        prog="llm-calib",
        description="Calibration of causal language models: evaluation and training (CALM).",
    )
    from llm_calib import __version__

    parser.add_argument("--version", action="version", version=f"llm-calib {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_evaluate(sub)
    _add_calibrate(sub)
    _add_export(sub)
    sub.add_parser("demo", help="run the main job on the embedded default").set_defaults(func=_cmd_demo)
    _add_metrics(sub)
    return parser


def _log(args: argparse.Namespace, message: str) -> None:
    if not getattr(args, "quiet", False):
        print(message, file=sys.stderr, flush=True)


def _unescape(text: str) -> str:
    """Command-line text with ``\\n`` and ``\\t`` written as escapes."""
    return text.replace("\\n", "\n").replace("\\t", "\t")


def _prompt_flags(args: argparse.Namespace) -> dict[str, Any]:
    """The prompt flags given (:func:`_add_prompt_args`, as evaluate and export store them), as
    :class:`~llm_calib.prompts.PromptFormat` fields."""
    return {field: getattr(args, dest) for field, dest in _EVALUATE_PROMPT_DEST.items()
            if field != "preset" and getattr(args, dest) is not None}


def _saved_prompt(base: dict[str, Any]) -> dict[str, Any]:
    """The :class:`~llm_calib.prompts.PromptFormat` fields a saved result records (none for a
    plain adapter)."""
    from llm_calib.prompts import PromptFormat

    saved = base.get("prompt") or {}
    return {k: v for k, v in saved.items() if k in PromptFormat.__dataclass_fields__ and k != "fewshot_pool"}


def prompt_format(args: argparse.Namespace, base: dict[str, Any] | None = None) -> Any:
    """The :class:`~llm_calib.prompts.PromptFormat` of ``llm-calib evaluate`` (and ``export``):
    the preset, else the prompt a saved ``--adapter`` records (``base``), else the scorer's
    default; then the explicit prompt flags. ``calibrate`` builds the same format from the same
    flags (:func:`llm_calib.calm.encoding.format_settings`).

    ``args.scorer`` and ``args.normalize`` (when the command has them) not given default to the
    saved result's, else ``option_likelihood`` and ``sum``.

    Args:
        args: ``evaluate`` or ``export`` arguments parsed by :func:`build_parser`.
        base: the saved result's record (:func:`llm_calib.export.saved_base`), or None.

    Returns:
        The prompt format (without the few-shot pool).

    Raises:
        SystemExit: through :func:`main`: flags the scorer does not accept, or ``--fewshot``
            without ``--fewshot-split``.

    Example:
        >>> args = build_parser().parse_args(["evaluate", "--data", "builtin", "--out", "x",
        ...                                   "--prompt-preset", "lm_eval_arc", "--fewshot", "2",
        ...                                   "--fewshot-split", "builtin:capitals:n=10"])
        >>> fmt = prompt_format(args)
        >>> fmt.template, fmt.fewshot, args.normalize
        ('Question: {question}\\nAnswer:', 2, 'sum')
    """
    from llm_calib.data import absolute_spec
    from llm_calib.formats import multiple_choice_format
    from llm_calib.prompts import PromptFormat, preset

    base = base or {}
    scorer = getattr(args, "scorer", None) or base.get("scorer") or "option_likelihood"
    if hasattr(args, "scorer"):
        args.scorer = scorer
        args.normalize = args.normalize or base.get("normalize") or "sum"
    given = _prompt_flags(args)
    if "fewshot_split" in given:  # recorded absolute (export, metrics.json), as the model path is
        given["fewshot_split"] = _user_call(lambda: absolute_spec(given["fewshot_split"]), "--fewshot-split")
    saved = _saved_prompt(base)
    if args.prompt_preset is not None:
        make = lambda: preset(args.prompt_preset, **given)  # noqa: E731
    elif saved:
        make = lambda: PromptFormat(**{**saved, **given})  # noqa: E731
    else:
        given.setdefault("style", multiple_choice_format(scorer).prompt_settings().style)
        make = lambda: PromptFormat(**given)  # noqa: E731
    fmt = _user_call(make, "prompt")
    try:  # the scorer's own rules on the prompt (the letter scorer needs the options listed)
        multiple_choice_format(scorer, prompt=fmt)
    except ValueError as exc:
        raise _UserError(f"--scorer {scorer}: {exc} (see --prompt-style)") from exc
    if fmt.fewshot and not fmt.fewshot_split:
        raise _UserError(f"--fewshot {fmt.fewshot} needs --fewshot-split SPEC (the split the examples come from)")
    return fmt


def _preset_in_use(args: argparse.Namespace, base: dict[str, Any]) -> str | None:
    """The preset of the prompt in use: ``--prompt-preset``, else the one the saved record
    ``base`` was trained with when no prompt flag changes its prompt."""
    if args.prompt_preset is not None or _prompt_flags(args):
        return args.prompt_preset
    return base.get("prompt_preset")


def _prompt_origin(args: argparse.Namespace, base: dict[str, Any], source: str) -> str | None:
    """The status line naming where the prompt comes from when ``source`` (``--adapter DIR`` or an
    exported merged ``--model DIR``) records the one it was trained with; None when it does not."""
    if not base.get("prompt"):
        return None
    if args.prompt_preset is not None:
        return f"prompt: --prompt-preset {args.prompt_preset} instead of the one {source} was trained with"
    changed = sorted(_prompt_flags(args))
    return f"prompt: the one {source} was trained with" + (
        f", changed by the prompt flags ({', '.join(changed)})" if changed else "")


def _warn_prompt_mismatch(trained: dict[str, Any], prompt: Any, tokenizer: Any, source: str, *,
                          scoring: dict[str, Any] | None = None, doing: str = "evaluating") -> None:
    """Warn (stderr, even with ``--quiet``) when ``prompt`` (or the ``scoring`` settings, scorer
    and normalize) differs from what ``source`` (``--adapter DIR``, or an exported merged ``--model
    DIR``) was trained with (``trained``: its saved record; nothing when it does not record the
    prompt). Both prompts are compared as resolved for ``tokenizer`` (an automatic chat template is
    the one it has or not)."""
    from llm_calib.prompts import PromptFormat, prompt_dict

    if not trained.get("prompt"):
        return
    scoring = scoring or {}
    before = {**prompt_dict(PromptFormat(**_saved_prompt(trained)), tokenizer),
              **{k: trained.get(k) for k in scoring if trained.get(k) is not None}}
    used = {**prompt_dict(prompt, tokenizer), **{k: v for k, v in scoring.items() if k in before}}
    keys = sorted(k for k in set(before) | set(used) if k != "fewshot_pool_size" and before.get(k) != used.get(k))
    if keys:
        diff = "; ".join(f"{k}: trained {before.get(k)!r}, now {used.get(k)!r}" for k in keys)
        print(f"llm-calib: warning: {doing} {source} with another prompt than it was trained "
              f"with ({diff}); its calibration may not carry over", file=sys.stderr, flush=True)


def _cmd_evaluate(args: argparse.Namespace) -> int:
    from llm_calib.evaluate import evaluate_records, write_samples
    from llm_calib.prompts import prompt_dict
    from llm_calib.report import write_report

    _start(args, args.quiet)
    base = _resolve_base(args, args.adapter, "--adapter")
    source = f"--adapter {args.adapter}" if args.adapter else f"--model {args.model}"
    prompt = prompt_format(args, base)
    args.saved_preset = _preset_in_use(args, base)  # the saved prompt: its preset's --limit-mode
    origin = _prompt_origin(args, base, source)
    if origin:
        _log(args, origin)
    t0 = time.perf_counter()
    # Load every data set before the model, so a bad spec fails fast.
    log = lambda message: _log(args, message)  # noqa: E731
    datasets = [_load_records(args, "--data", spec, log) for spec in args.data]
    fit = None
    if args.temperature_fit:
        fit = _load_records(args, "--temperature-fit", args.temperature_fit, log, limited=False,
                            note=" (temperature fit)")
    if prompt.fewshot:
        evaluated = [r for _, recs in datasets for r in recs] + (list(fit[1]) if fit else [])
        recorded = args.fewshot_split is None and args.prompt_preset is None and args.base_record is not None
        # a split the saved result or merged model records: the error names that file and field
        prompt = _fewshot_pool(args, prompt, evaluated, log, f"{args.base_record}: prompt.fewshot_split" if recorded else None)
    load_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    model, tokenizer, _ = _load_model(args, args.device)
    if args.adapter:
        import warnings

        from llm_calib.export import load_adapter

        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        model = _user_call(lambda: load_adapter(model, args.adapter), f"--adapter {args.adapter}")
    model_s = time.perf_counter() - t0
    _log(args, f"loaded model {args.model}{' + ' + args.adapter if args.adapter else ''} in {model_s:.1f} s")
    _warn_prompt_mismatch(base, prompt, tokenizer, source, scoring={"scorer": args.scorer, "normalize": args.normalize})
    from llm_calib.engine.prefix import prefix_cache

    with prefix_cache(args.prefix_cache, args.prefix_cache_mb):  # --prefix-cache, --prefix-cache-mb
        result = _user_call(
            lambda: evaluate_records(
                model,
                tokenizer,
                datasets,
                scorer=args.scorer,
                normalize=args.normalize,
                prompt=prompt,
                batch_size=args.batch_size,
                temperature_fit=fit,
                n_bins=args.bins,
                ci=args.bootstrap > 0,
                n_resamples=max(args.bootstrap, 1),
                seed=args.seed,
                max_new_tokens=args.max_new_tokens,
                progress=not args.quiet,
            ),
            "evaluate",
            # only argument problems of the records themselves are user errors here
            errors=(ValueError, TypeError, KeyError),
        )
    result.config.update(
        {
            "model": args.model,
            "adapter": args.adapter,
            "dtype": args.dtype,
            "limit": args.limit,
            "limit_mode": _limit_mode(args),
            "on_error": args.on_error,
            "skipped": getattr(args, "skipped_rows", {}),
            "prompt": prompt_dict(prompt, tokenizer),  # as resolved: chat_template True/False
        }
    )
    result.timing.update({"data_loading_s": load_s, "model_loading_s": model_s})
    paths = write_report(result, args.out)
    if args.log_samples:
        write_samples(result, Path(args.out) / "samples.jsonl")
        paths["samples"] = Path(args.out) / "samples.jsonl"
    _print_summary(result, paths, args.out)
    return 0


def _user_call(
    fn: Callable[[], _T],
    what: str | None,
    errors: tuple[type[BaseException], ...] = (ValueError, OSError, KeyError, TypeError),
) -> _T:
    """``fn()``, its ``errors`` reported as user errors: ``what: message`` (the message alone when
    ``what`` is None)."""
    try:
        return fn()
    except errors as exc:
        message = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
        raise _UserError(f"{message}" if what is None else f"{what}: {message}") from exc


def _cmd_demo(args: argparse.Namespace) -> int:
    from llm_calib.demo import run_demo

    run_demo()
    return 0


def _did_you_mean(word: str, candidates: Any) -> str:
    """``" (did you mean 'x'?)"`` for the closest of ``candidates`` to ``word``; empty when none is close."""
    import difflib

    close = difflib.get_close_matches(word, list(candidates), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _reject_unknown(sub: argparse.ArgumentParser, unknown: list[str]) -> None:
    """Exit (status 2) with the subcommand's usage, naming the unknown arguments and, for each
    unknown flag, the closest flag the subcommand has."""
    flags = [s for a in sub._actions for s in a.option_strings if s.startswith("--")]
    hints = [f"{flag}{hint}" for flag in (w.split("=", 1)[0] for w in unknown if w.startswith("-"))
             for hint in [_did_you_mean(flag, flags)] if hint]
    sub.error(f"unrecognized arguments: {' '.join(unknown)}" + "".join(f"\n  {h}" for h in hints))


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``llm-calib`` command.

    Args:
        argv: arguments (default: ``sys.argv[1:]``).

    Returns:
        The exit status: 0 on success, 2 on a user error (message on stderr).

    Example:
        >>> main(["evaluate", "--data", "nosuchloader:x", "--out", "/tmp/x", "--quiet"])
        2
    """
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = parser._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    if argv and not argv[0].startswith("-") and argv[0] not in commands:
        parser.error(f"unknown command {argv[0]!r}{_did_you_mean(argv[0], commands)}; the commands: {', '.join(commands)}")
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # the subcommand's usage and the closest flags, not the top-level usage
        _reject_unknown(commands[args.command], unknown)
    if not (getattr(args, "load_in_4bit", False) or getattr(args, "load_in_8bit", False)):
        # bitsandbytes, imported by peft when installed, warns about its optional CPU kernels on
        # every run; without quantisation it is not used
        import logging

        logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
    try:
        return int(args.func(args) or 0)
    except _UserError as exc:
        print(f"llm-calib: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
