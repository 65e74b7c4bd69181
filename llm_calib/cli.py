"""Command line: ``llm-calib``.

Subcommands:

* ``llm-calib evaluate``: score data sets with a model and write ``metrics.json``, ``report.md``
  and one reliability diagram per domain.
* ``llm-calib calibrate``: train CALM and the baselines on the same data (one fresh model per
  method), save each result, and compare them with the uncalibrated and temperature-scaled model
  per domain in ``report.md``, ``metrics.json`` and reliability diagrams.
* ``llm-calib demo``: the main job on the embedded default.

Errors in the user's input (a bad data spec, a missing file, an unknown model) print one line
``llm-calib: error: ...`` and exit with status 2, without a traceback.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

__all__ = ["build_parser", "main"]

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
see llm_calib.data.spec for the full grammar.

example:
  llm-calib evaluate --model smollm2-135m-instruct \\
      --data arc_easy:../shared/data/arc_easy/test.jsonl --limit 200 \\
      --temperature-fit arc_easy:../shared/data/arc_easy/dev.jsonl --out /tmp/eval
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


def _add_evaluate(sub: argparse._SubParsersAction) -> None:
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
        default="smollm2-135m-instruct",
        help="built-in alias (smollm2-135m-instruct), local model directory, .gguf file or hub "
        "name (default: %(default)s)",
    )
    p.add_argument(
        "--data",
        action="append",
        required=True,
        metavar="SPEC",
        help="data spec to evaluate; repeat for several data sets (results per domain)",
    )
    p.add_argument(
        "--scorer",
        choices=("option_likelihood", "letter"),
        default="option_likelihood",
        help="multiple-choice scorer: likelihood of each option's text, or the logits of the "
        "option letters with the options listed (default: %(default)s)",
    )
    p.add_argument(
        "--normalize",
        choices=("sum", "mean"),
        default="sum",
        help="option likelihood: summed token log-probabilities, or their mean per token "
        "(length-normalised) (default: %(default)s)",
    )
    p.add_argument(
        "--prompt-style",
        choices=("cloze", "listed"),
        default=None,
        help="cloze: the prompt holds the question only; listed: options listed as A., B., ... "
        "(default: cloze for option_likelihood, listed for letter)",
    )
    p.add_argument(
        "--no-chat-template",
        action="store_true",
        help="plain-text prompt instead of the tokenizer's chat template",
    )
    p.add_argument(
        "--system-message",
        default=None,
        help="system message for the chat (default: the template's own default)",
    )
    p.add_argument(
        "--answer-prefix",
        default="The answer is:",
        help="text after the generation prompt, before the scored answer (default: %(default)r)",
    )
    p.add_argument(
        "--limit",
        type=_positive_int,
        default=None,
        metavar="N",
        help="at most N questions per data set (a seeded subsample; also for --temperature-fit)",
    )
    p.add_argument(
        "--batch-size",
        type=_positive_int,
        default=8,
        metavar="B",
        help="questions per forward pass (default: %(default)s)",
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
    p.add_argument(
        "--bins",
        type=_positive_int,
        default=10,
        help="equal-width confidence bins for ECE and the reliability diagrams (default: %(default)s)",
    )
    p.add_argument(
        "--bootstrap",
        type=int,
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
        "--threads",
        type=_positive_int,
        default=None,
        help="torch CPU threads (default: torch's choice)",
    )
    p.add_argument(
        "--cache-dir",
        default=None,
        help="cache of the converted built-in model (default: $LLM_CALIB_CACHE/<alias> or "
        "~/.cache/llm_calib/<alias>) or hub cache for hub names",
    )
    p.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="allow custom model code from the hub (only for repositories you trust)",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.add_argument(
        "--out", required=True, metavar="DIR", help="output directory (created if missing)"
    )
    p.set_defaults(func=_cmd_evaluate)


_CALIBRATE_EPILOG = """\
configuration precedence: built-in defaults < --config FILE < explicit flags.
A config file (YAML or JSON) holds CalibrationConfig fields, for example:
  method: calm            # used when --methods is not given
  solver: bome
  steps: 60
  batch_size: 8
  heldout_batch_size: 8
  lr: 1.0e-3
  lam_lr: 5.0e-2
  eval_every: 10
  lora: {rank: 8, alpha: 16, target_modules: [q_proj, v_proj], layers: null}
Unknown keys are errors. See llm_calib.calm.config.CalibrationConfig for every field.

outputs in --out DIR:
  <method>/            adapter/ (peft), lambda.safetensors, config.json, history.json, metrics.json
  checkpoints/<method>/  with --checkpoint-every N (continue with --resume)
  report.md            before/after table per domain: uncalibrated, temperature-scaled, methods
  metrics.json         every number of report.md, plus reliability bins
  reliability_<domain>.png

multi-process (one rank per GPU, or CPU processes with gloo):
  torchrun --nproc_per_node=2 -m llm_calib.cli calibrate ... --device cuda
(the global --batch-size is split over the ranks; rank 0 writes the outputs.)

example:
  llm-calib calibrate --model smollm2-135m-instruct \\
      --train arc_easy:../shared/data:train --heldout arc_easy:../shared/data:dev \\
      --eval arc_easy:../shared/data/arc_easy/test.jsonl --eval mmlu_stem:../shared/data/mmlu/test \\
      --limit 200 --steps 60 --methods calm,lora_ce --out /tmp/calm

open-ended training (greedy answers, exact match in the report; no temperature column):
  llm-calib calibrate --train webquestions:../shared/data:train \\
      --heldout webquestions:../shared/data:dev --eval webquestions:../shared/data:test \\
      --eval nq_open:../shared/data:dev --limit 200 --methods calm,lora_ce --out /tmp/calm_open
"""


def _methods(text: str) -> list[str]:
    from llm_calib.calm.config import METHODS

    methods = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in methods if m not in METHODS]
    if bad or not methods:
        raise argparse.ArgumentTypeError(
            f"expected a comma-separated list from {', '.join(METHODS)}, got {text!r}"
        )
    if len(set(methods)) != len(methods):
        raise argparse.ArgumentTypeError(f"a method is listed twice in {text!r}")
    return methods


def _add_calibrate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "calibrate",
        help="train CALM and baselines, compare them per domain",
        description=(
            "Train each method (CALM and the one-level baselines) on a fresh copy of the model "
            "with the same data, seed and budget; save each result to --out/<method>/; evaluate "
            "the uncalibrated model, temperature scaling (T fitted on the held-out split) and "
            "every trained method on each --eval set, domain by domain; write report.md, "
            "metrics.json and reliability_<domain>.png to --out."
        ),
        epilog=_CALIBRATE_EPILOG + "\n" + _EVALUATE_EPILOG.split("\n\nexample:")[0] + "\n",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--model",
        default="smollm2-135m-instruct",
        help="built-in alias (smollm2-135m-instruct), local model directory, .gguf file or hub "
        "name; reloaded fresh for every method (default: %(default)s)",
    )
    p.add_argument(
        "--train", required=True, metavar="SPEC",
        help="data spec of the labelled training split (lower level: task cross-entropy); all "
        "multiple choice, or all open questions (e.g. nq_open), trained on their first answer",
    )
    p.add_argument(
        "--heldout", required=True, metavar="SPEC",
        help="data spec of the held-out split, of the same kind as --train: its labels serve "
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
        help="YAML or JSON file of CalibrationConfig fields (overridden by explicit flags)",
    )
    p.add_argument(
        "--methods", type=_methods, default=None, metavar="M[,M...]",
        help="comma-separated methods to train: calm, lora_ce, label_smoothing, "
        "confidence_penalty (default: the config file's 'method' if it sets one, else all four)",
    )
    p.add_argument(
        "--limit", type=_positive_int, default=None, metavar="N",
        help="at most N questions per data spec (a seeded subsample; --train, --heldout, --eval)",
    )
    p.add_argument(
        "--unlabeled", action="append", default=None, metavar="SPEC",
        help="data spec of unlabelled upper-level inputs (CALM's entropy objective and the "
        "confidence penalty's entropy term), of the same kind as --train; labels in it are "
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
        "--no-progress", action="store_true",
        help="no progress bars (training shows loss/accuracy/entropy/held-out ECE otherwise)",
    )
    p.add_argument(
        "--bootstrap", type=_non_negative_int, default=1000, metavar="R",
        help="bootstrap resamples for 95%% confidence intervals in the report; 0 disables them "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--bins", type=_positive_int, default=10,
        help="equal-width confidence bins for ECE and the reliability diagrams (default: %(default)s)",
    )
    p.add_argument(
        "--device", default="cpu",
        help="torch device (default: %(default)s); 'cuda' under torchrun means cuda:LOCAL_RANK",
    )
    p.add_argument(
        "--cache-dir", default=None,
        help="cache of the converted built-in model, or hub cache for hub names",
    )
    _add_config_flags(p.add_argument_group(
        "calibration settings",
        "every CalibrationConfig field (llm_calib.calm.config); a flag overrides --config, which "
        "overrides the defaults",
    ))
    p.set_defaults(func=_cmd_calibrate)


def _plain(text: str) -> str:
    """Docstring text for --help: no reST roles or literals, %% escaped for argparse."""
    text = re.sub(r":\w+:`~?([^`<]*?)(?: <[^>]*>)?`", r"\1", text).replace("``", "")
    return text.replace("%", "%%")


def _optional(parse: Callable[[str], _T]) -> Callable[[str], _T | None]:
    def parse_optional(text: str) -> _T | None:
        return None if text.lower() in ("null", "none") else parse(text)

    parse_optional.__name__ = getattr(parse, "__name__", "value")
    return parse_optional


def _bool(text: str) -> bool:
    if text.lower() in ("true", "yes", "1"):
        return True
    if text.lower() in ("false", "no", "0"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def _csv(item: Callable[[str], _T]) -> Callable[[str], tuple[_T, ...]]:
    def parse(text: str) -> tuple[_T, ...]:
        try:
            return tuple(item(t.strip()) for t in text.split(",") if t.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list, got {text!r}") from None

    return parse


def _config_fields() -> list[tuple[str, str, Any, str]]:
    """``(flag, dotted field, type hint, help)`` of every CalibrationConfig field but ``method``."""
    import dataclasses
    import typing

    from llm_calib.calm.config import CalibrationConfig, LoraSettings, field_help

    out = []
    for cls, prefix in ((CalibrationConfig, ""), (LoraSettings, "lora.")):
        hints, helps = typing.get_type_hints(cls), field_help(cls)
        for f in dataclasses.fields(cls):
            if f.name in ("method", "lora") and cls is CalibrationConfig:
                continue
            name = prefix + f.name
            out.append(("--" + name.replace(".", "-").replace("_", "-"), name, hints[f.name], helps.get(f.name, "")))
    return out


def _flag_type(hint: Any) -> tuple[Callable[[str], Any], str]:
    """An argparse type for a config field's type hint, and the metavar."""
    import typing

    args = [a for a in typing.get_args(hint) if a is not type(None)]
    optional = type(None) in typing.get_args(hint)
    base = args[0] if optional and len(args) == 1 else hint
    if typing.get_origin(base) is tuple:
        item = typing.get_args(base)[0]
        parse, metavar = _csv(int if item is int else str), "A,B,..."
    elif base is bool:
        parse, metavar = _bool, "{true,false}"
    elif base in (int, float):
        parse, metavar = base, base.__name__.upper()
    else:
        parse, metavar = str, "VALUE"
    return (_optional(parse), metavar + "|null") if optional else (parse, metavar)


def _add_config_flags(group: Any) -> None:
    from llm_calib.calm.config import CHOICES, CalibrationConfig, LoraSettings

    defaults = {**CalibrationConfig().to_dict(), **{f"lora.{k}": v for k, v in LoraSettings().__dict__.items()}}
    for flag, name, hint, text in _config_fields():
        parse, metavar = _flag_type(hint)
        choices = CHOICES.get(name)
        default = defaults[name]
        shown = ",".join(map(str, default)) if isinstance(default, tuple) else "null" if default is None else default
        group.add_argument(
            flag, dest=f"cfg:{name}", type=None if choices else parse, choices=choices, default=None,
            metavar=None if choices else metavar, help=f"{_plain(text)} (default: config, else {shown})",
        )


def _config_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The config fields set by explicit flags, as a (nested) CalibrationConfig dict."""
    out: dict[str, Any] = {}
    for key, value in vars(args).items():
        if key.startswith("cfg:") and value is not None:
            name = key[4:]
            if name.startswith("lora."):
                out.setdefault("lora", {})[name[5:]] = list(value) if isinstance(value, tuple) else value
            else:
                out[name] = value
    return out


def _calibration_config(args: argparse.Namespace) -> tuple[object, list[str]]:
    """The run's CalibrationConfig (defaults < --config < flags) and the methods to train."""
    from llm_calib.calm.config import METHODS, CalibrationConfig, read_config_file

    data: dict = {}
    methods = list(METHODS)
    if args.config:
        data = _user_call(lambda: read_config_file(args.config), f"--config {args.config}")
        # validate the file alone first, so that an error names the file
        _user_call(lambda: CalibrationConfig.from_dict(data), f"--config {args.config}")
        if "method" in data:
            methods = [data["method"]]
    flags = _config_overrides(args)
    lora = {**(data.get("lora") or {}), **flags.pop("lora", {})}
    data = {**data, **flags, **({"lora": lora} if lora else {})}
    if args.methods is not None:
        methods = args.methods
    data["method"] = methods[0]
    config = _user_call(lambda: CalibrationConfig.from_dict(data), "calibration config")
    return config, methods


def _device(name: str) -> str:
    import os

    if name == "cuda" and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
    return name


def _cmd_calibrate(args: argparse.Namespace) -> int:

    from llm_calib import distributed
    from llm_calib.calm.trainer import TrainingDiverged
    from llm_calib.compare import run_comparison, write_comparison_report
    from llm_calib.data import load as load_data
    from llm_calib.data.records import record_kind
    from llm_calib.models import load as load_model

    config, methods = _calibration_config(args)
    distributed.init_from_env()
    main_rank = distributed.rank() == 0

    def log(message: str) -> None:
        if main_rank:
            print(message, file=sys.stderr, flush=True)

    if args.no_progress:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    seed = config.seed
    t0 = time.perf_counter()

    def records(flag: str, spec: str) -> list:
        recs = _user_call(lambda: load_data(spec, limit=args.limit, seed=seed).records, f"{flag} {spec}")
        if not recs:
            raise _UserError(f"{flag} {spec}: no records")
        log(f"loaded {len(recs)} questions from {spec}")
        return recs

    # Load every data set before the model, so a bad spec fails fast.
    train = (args.train, records("--train", args.train))
    heldout = (args.heldout, records("--heldout", args.heldout))
    try:  # one kind of record per run; the message names the offending record
        kind = record_kind(train[1], what=f"--train {args.train}")
        record_kind(heldout[1], what=f"--heldout {args.heldout}", expected=kind)
    except ValueError as exc:
        raise _UserError(str(exc)) from exc
    unlabeled = None
    if args.unlabeled:
        parts = [_user_call(lambda spec=spec: load_data(spec, limit=args.unlabeled_limit, seed=seed).records,
                            f"--unlabeled {spec}") for spec in args.unlabeled]
        unlabeled = ("+".join(args.unlabeled), [r for part in parts for r in part])
        try:
            record_kind(unlabeled[1], what=f"--unlabeled {unlabeled[0]}", expected=kind)
        except ValueError as exc:
            raise _UserError(str(exc)) from exc
        log(f"loaded {len(unlabeled[1])} unlabelled inputs from {unlabeled[0]}")
    evals = [(spec, records("--eval", spec)) for spec in args.eval]
    load_s = time.perf_counter() - t0
    device = _device(args.device)

    def fresh_model():
        return _user_call(
            lambda: load_model(args.model, cache_dir=args.cache_dir, device=device),
            f"--model {args.model}",
        )

    _, tokenizer = fresh_model()  # fail fast on a bad --model, and keep the tokenizer
    try:
        cmp = run_comparison(
            lambda: fresh_model()[0], tokenizer, train, heldout, evals, config, methods, args.out,
            unlabeled=unlabeled, resume=args.resume, progress=not args.no_progress, n_bins=args.bins,
            bootstrap=args.bootstrap, log=log,
        )
    except TrainingDiverged as exc:
        print(f"llm-calib: error: training diverged: {exc}", file=sys.stderr)
        return 1
    except ValueError as exc:
        raise _UserError(str(exc)) from exc
    cmp.config["model"] = args.model
    cmp.config["limit"] = args.limit
    cmp.config["timings"]["data_loading_s"] = load_s
    if not main_rank:
        return 0
    paths = write_comparison_report(cmp, args.out)
    for dom, d in cmp.domains.items():
        cells = ", ".join(
            f"{col}={(d.columns.get(col) or {}).get('ece', float('nan')):.3f}" for col in cmp.columns
        )
        print(f"{dom}: n={d.n} ECE {cells}")
    print(f"wrote {len(paths)} report files and {len(methods)} result directories to {args.out}")
    return 0


def _add_demo(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="run the main job on the embedded default")
    p.set_defaults(func=_cmd_demo)


def build_parser() -> argparse.ArgumentParser:
    """The ``llm-calib`` argument parser (one subparser per subcommand).

    Example:
        >>> args = build_parser().parse_args(["evaluate", "--data", "builtin", "--out", "x"])
        >>> args.command, args.scorer, args.data
        ('evaluate', 'option_likelihood', ['builtin'])
    """
    parser = argparse.ArgumentParser(
        prog="llm-calib",
        description="Calibration of causal language models: evaluation and training (CALM).",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_evaluate(sub)
    _add_calibrate(sub)
    _add_demo(sub)
    return parser


def _log(args: argparse.Namespace, message: str) -> None:
    if not getattr(args, "quiet", False):
        print(message, file=sys.stderr, flush=True)


def _cmd_evaluate(args: argparse.Namespace) -> int:
    import torch

    from llm_calib.data import load as load_data
    from llm_calib.evaluate import evaluate_records
    from llm_calib.models import load as load_model
    from llm_calib.prompts import PromptFormat
    from llm_calib.report import write_report

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.quiet:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    if args.bootstrap < 0:
        raise _UserError(f"--bootstrap must be >= 0, got {args.bootstrap}")
    style = args.prompt_style or ("listed" if args.scorer == "letter" else "cloze")
    if args.scorer == "letter" and style != "listed":
        raise _UserError("--scorer letter needs --prompt-style listed (the options must be listed)")
    prompt = PromptFormat(
        style=style,
        chat_template=False if args.no_chat_template else None,
        system_message=args.system_message,
        answer_prefix=args.answer_prefix,
    )
    t0 = time.perf_counter()
    # Load every data set before the model, so a bad spec fails fast.
    datasets = []
    for spec in args.data:
        records = _user_call(
            lambda s=spec: load_data(s, limit=args.limit, seed=args.seed).records, f"--data {spec}"
        )
        if not records:
            raise _UserError(f"--data {spec}: no records")
        _log(args, f"loaded {len(records)} questions from {spec}")
        datasets.append((spec, records))
    fit = None
    if args.temperature_fit:
        spec = args.temperature_fit
        records = _user_call(
            lambda: load_data(spec, limit=args.limit, seed=args.seed).records,
            f"--temperature-fit {spec}",
        )
        if not records:
            raise _UserError(f"--temperature-fit {spec}: no records")
        fit = (spec, records)
        _log(args, f"loaded {len(records)} questions from {spec} (temperature fit)")
    load_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    model, tokenizer = _user_call(
        lambda: load_model(
            args.model,
            cache_dir=args.cache_dir,
            device=args.device,
            trust_remote_code=args.trust_remote_code,
        ),
        f"--model {args.model}",
    )
    model_s = time.perf_counter() - t0
    _log(args, f"loaded model {args.model} in {model_s:.1f} s")
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
        errors=(ValueError, TypeError),
    )
    result.config.update({"model": args.model, "limit": args.limit})
    result.timing.update({"data_loading_s": load_s, "model_loading_s": model_s})
    paths = write_report(result, args.out)
    for dom, r in result.domains.items():
        unc = r.uncalibrated
        line = f"{dom}: n={r.n} accuracy={unc['accuracy']:.3f} ECE={unc['ece']:.3f}"
        if r.temperature_scaled:
            line += (
                f" ECE(T={result.temperature.temperature:.2f})={r.temperature_scaled['ece']:.3f}"
            )
        print(line)
    print(f"wrote {len(paths)} files to {args.out}")
    return 0


def _user_call(
    fn: Callable[[], _T],
    what: str,
    errors: tuple[type[BaseException], ...] = (ValueError, OSError, KeyError, TypeError),
) -> _T:
    try:
        return fn()
    except errors as exc:
        message = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
        raise _UserError(f"{what}: {message}") from exc


def _cmd_demo(args: argparse.Namespace) -> int:
    from llm_calib.demo import run_demo

    run_demo()
    return 0


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
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except _UserError as exc:
        print(f"llm-calib: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
