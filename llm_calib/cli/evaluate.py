"""``llm-calib evaluate``: score data sets with a model (optionally a saved adapter on it) and
write the calibration report."""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from llm_calib.cli._common import (
    BINS_FLAG,
    DATA_SPECS_HELP,
    DEVICE,
    MODEL,
    PATH,
    SPEC,
    log_status,
    non_negative_int,
    positive_int,
    print_summary,
    user_call,
)
from llm_calib.cli._loading import (
    add_allow_other_base_arg,
    add_data_loading_args,
    add_model_loading_args,
    check_confidence_applies,
    check_device,
    fewshot_pool,
    limit_mode,
    load_base_model,
    load_distinct,
    load_records,
    recorded_model,
    resolve_base,
    start,
)
from llm_calib.cli.confidence import add_confidence_args, open_confidence
from llm_calib.cli.prompt import (
    EVALUATE_PROMPT_DEST,
    PROMPT_GROUP_HELP,
    add_prompt_args,
    preset_in_use,
    prompt_format,
    prompt_origin,
    warn_prompt_mismatch,
)

__all__ = ["add_parser", "run"]

EVALUATE_EPILOG = DATA_SPECS_HELP + """

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


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Add the ``evaluate`` command to the subcommands ``sub`` of the ``llm-calib`` parser.

    Example:
        >>> parser = argparse.ArgumentParser(prog="llm-calib")
        >>> add_parser(parser.add_subparsers(dest="command"))
        >>> args = parser.parse_args(["evaluate", "--data", "builtin", "--out", "x"])
        >>> args.batch_size, args.func is run
        (8, True)
    """
    from llm_calib.config.calibration import PromptSettings
    from llm_calib.config.choices import NORMALIZE_MODES

    p = sub.add_parser(
        "evaluate",
        help="score data sets with a model and write a calibration report",
        description=(
            "Score multiple-choice (or open) data sets with a causal LM and write metrics.json, "
            "report.md (a table per domain with 95% bootstrap CIs) and reliability_<domain>.png "
            "to --out."
        ),
        epilog=EVALUATE_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--model",
        type=MODEL,
        default=None,
        help="built-in alias (smollm2-135m-instruct), local model directory, .gguf file or hub "
        "name (default: the base model a saved --adapter records, else smollm2-135m-instruct)",
    )
    p.add_argument(
        "--adapter",
        type=PATH,
        default=None,
        metavar="DIR",
        help="put this adapter on --model first: a saved calibration result (llm-calib "
        "calibrate's --out/<method>) or any peft adapter directory",
    )
    add_allow_other_base_arg(p)
    add_model_loading_args(p, training=False)
    p.add_argument(
        "--data",
        type=SPEC,
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
        choices=NORMALIZE_MODES,
        default=None,
        help="option likelihood: summed token log-probabilities (lm-eval's acc), their mean per "
        "token, or the sum divided by the choice's characters (acc_norm) or bytes (acc_bytes); "
        "the report shows all four side by side either way (default: the one a saved --adapter "
        "or merged --model was trained with, else sum)",
    )
    add_prompt_args(p.add_argument_group("prompt", PROMPT_GROUP_HELP), EVALUATE_PROMPT_DEST.get)
    add_data_loading_args(
        p,
        limit_help="at most N questions per evaluated data set (see --limit-mode; the --temperature-fit "
        "set is read whole)",
    )
    _add_run_flags(p)
    add_confidence_args(p)
    p.set_defaults(func=run)


def _add_run_flags(p: argparse.ArgumentParser) -> None:
    """``evaluate``'s flags after the data: batching, temperature fit, seed, report, device, outputs."""
    p.add_argument(
        "--batch-size",
        type=positive_int,
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
        type=positive_int,
        default=1024,
        metavar="MB",
        help="bound on the prefix keys/values held for one batch, in MiB (default: %(default)s)",
    )
    p.add_argument(
        "--temperature-fit",
        type=SPEC,
        default=None,
        metavar="SPEC",
        help="fit a temperature on this split (e.g. arc_easy:../shared/data:dev) and report "
        "temperature-scaled metrics for every domain next to the uncalibrated ones",
    )
    p.add_argument(
        "--seed",
        type=non_negative_int,
        default=0,
        metavar="S",
        help="seed of the --limit subsample, the bootstrap and the sampled answers of --confidence "
        "semantic (default: %(default)s)",
    )
    p.add_argument("--bins", **BINS_FLAG)
    p.add_argument(
        "--bootstrap",
        type=non_negative_int,
        default=1000,
        metavar="R",
        help="bootstrap resamples for the 95%% confidence intervals; 0 disables them (default: %(default)s)",
    )
    p.add_argument(
        "--max-new-tokens",
        type=positive_int,
        default=32,
        help="generation budget for open-ended questions (default: %(default)s)",
    )
    p.add_argument(
        "--device", type=DEVICE, default="cpu", help="torch device to run the model on (default: %(default)s)"
    )
    p.add_argument(
        "--cache-dir",
        type=PATH,
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
        "--out", type=PATH, required=True, metavar="DIR", help="output directory (created if missing)"
    )


def _load_data(args: argparse.Namespace, prompt: Any) -> tuple[list, Any, Any]:
    """The ``--data`` sets, the ``--temperature-fit`` set (None without it) and ``prompt`` with its
    few-shot pool (drawn without the evaluated and fitted questions)."""
    log = lambda message: log_status(args, message)  # noqa: E731
    datasets = load_distinct(args, "--data", args.data, log)  # a set given twice is scored once
    fit = None
    if args.temperature_fit:
        fit = load_records(args, "--temperature-fit", args.temperature_fit, log, limited=False,
                           note=" (temperature fit)")
    if prompt.fewshot:
        evaluated = [r for _, recs in datasets for r in recs] + (list(fit[1]) if fit else [])
        recorded = args.fewshot_split is None and args.prompt_preset is None and args.base_record is not None
        # a split the saved result or merged model records: the error names that file and field
        prompt = fewshot_pool(args, prompt, evaluated, log, f"{args.base_record}: prompt.fewshot_split" if recorded else None)
    return datasets, fit, prompt


def _load_model_and_adapter(args: argparse.Namespace) -> tuple[Any, Any, Any]:
    """``--model`` on ``--device``, with ``--adapter`` on it when given: ``(model, tokenizer, the
    ModelLoadConfig)``."""
    model, tokenizer, loading = load_base_model(args, args.device)
    if args.adapter:
        import warnings

        from llm_calib.calm.export import load_adapter

        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        model = user_call(lambda: load_adapter(model, args.adapter), f"--adapter {args.adapter}")
    return model, tokenizer, loading


def _score(args: argparse.Namespace, model: Any, tokenizer: Any, datasets: list, prompt: Any, fit: Any,
           confidence: Any) -> Any:
    """:func:`~llm_calib.evaluation.evaluate.evaluate_records` under the parsed flags (argument errors of the
    records themselves are user errors)."""
    from llm_calib.evaluation.evaluate import evaluate_records

    return user_call(
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
            confidence=confidence,
            context_overflow=args.context_overflow,
        ),
        "evaluate",
        # only argument problems of the records themselves are user errors here
        errors=(ValueError, TypeError, KeyError),
    )


def run(args: argparse.Namespace) -> int:
    """Run ``llm-calib evaluate`` with its parsed ``args``: load the data, then the model (and
    adapter), score every set and write the report to ``--out``.

    Returns:
        0; a user error raises the CLI's user error, which :func:`~llm_calib.cli.main` reports
        in one line with status 2.

    Example:
        >>> from llm_calib.cli import main
        >>> main(["evaluate", "--data", "nosuchloader:x", "--out", "/tmp/x", "--quiet"])
        2
    """
    import contextlib

    from llm_calib.files.outputs import check_output_folder, earlier_report, run_lock

    user_call(lambda: check_output_folder(args.out), None)  # before any loading, not after the scoring
    user_call(lambda: earlier_report(args.out), None)  # files of another kind there: refused before any work
    check_device(args.device)
    with contextlib.ExitStack() as stack:  # the lock calibrate takes: one run at a time writes to --out
        user_call(lambda: stack.enter_context(run_lock(args.out)), None)
        return _run_locked(args)


def _run_locked(args: argparse.Namespace) -> int:
    """:func:`run` after the checks of ``--out``, while holding its lock."""
    from llm_calib.engine.options import loaded_precision
    from llm_calib.evaluation.evaluate import write_samples
    from llm_calib.evaluation.report import write_report
    from llm_calib.files.outputs import earlier_report, remove_stale
    from llm_calib.prompts.templates import prompt_dict

    start(args, args.quiet)
    confidence = user_call(lambda: open_confidence(args, seed=args.seed), None)  # before any loading
    base = resolve_base(args, args.adapter, "--adapter")
    source = f"--adapter {args.adapter}" if args.adapter else f"--model {args.model}"
    prompt = prompt_format(args, base)
    args.saved_preset = preset_in_use(args, base)  # the saved prompt: its preset's --limit-mode
    origin = prompt_origin(args, base, source)
    if origin:
        log_status(args, origin)
    t0 = time.perf_counter()
    # Load every data set before the model, so a bad spec fails fast.
    datasets, fit, prompt = _load_data(args, prompt)
    check_confidence_applies(confidence.kind, datasets, "--data")  # before the model is loaded
    load_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    model, tokenizer, loading = _load_model_and_adapter(args)
    model_s = time.perf_counter() - t0
    log_status(args, f"loaded model {args.model}{' + ' + args.adapter if args.adapter else ''} in {model_s:.1f} s")
    warn_prompt_mismatch(base, prompt, tokenizer, source, scoring={"scorer": args.scorer, "normalize": args.normalize})
    from llm_calib.engine.prefix import prefix_cache

    with prefix_cache(args.prefix_cache, args.prefix_cache_mb):  # --prefix-cache, --prefix-cache-mb
        result = _score(args, model, tokenizer, datasets, prompt, fit, confidence)
    result.config.update(
        {
            "model": args.model,
            "adapter": None if args.adapter is None else recorded_model(args.adapter),
            # what the model computes with, not what was asked: --load-in-4bit computes in bfloat16
            **loaded_precision(model),
            "model_loading": loading.to_dict(),
            "merged_specs": getattr(args, "merged_specs", []),
            "limit": args.limit,
            "limit_mode": limit_mode(args),
            "on_error": args.on_error,
            "skipped": getattr(args, "skipped_rows", {}),
            "prompt": prompt_dict(prompt, tokenizer),  # as resolved: chat_template True/False
        }
    )
    result.timing.update({"data_loading_s": load_s, "model_loading_s": model_s})
    earlier = user_call(lambda: earlier_report(args.out), None)
    paths = write_report(result, args.out)
    if args.log_samples:
        write_samples(result, Path(args.out) / "samples.jsonl")
        paths["samples"] = Path(args.out) / "samples.jsonl"
    remove_stale(earlier, list(paths.values()))  # an earlier run's samples and diagrams do not stay beside this report
    print_summary(result, paths, args.out)
    return 0
