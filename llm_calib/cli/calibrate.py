"""``llm-calib calibrate``: train the configured objective (or each of ``--methods``) and compare
the results with the uncalibrated and temperature-scaled model."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from llm_calib.cli._common import (
    BINS_FLAG,
    DATA_SPECS_HELP,
    DEFAULT_MODEL,
    DEVICE,
    MODEL,
    PATH,
    SPEC,
    UserError,
    non_negative_int,
    positive_int,
    user_call,
)
from llm_calib.cli._loading import (
    add_data_loading_args,
    add_model_loading_args,
    check_confidence_applies,
    check_device,
    check_model_path,
    fewshot_pool,
    limit_mode,
    load_base_model,
    load_distinct,
    load_records,
    recorded_model,
    run_device,
    start,
)
from llm_calib.cli.confidence import add_confidence_args, open_confidence
from llm_calib.cli.config_flags import add_config_flags, calibration_config

__all__ = ["add_parser", "run"]

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
llm_calib.config.calibration.CalibrationConfig for every field.

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
(--confidence semantic --samples 10 reports every column's Sem-ECE over sampled answers instead
of the greedy answer's token probability; also p_true, verbalized.)
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


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Add the ``calibrate`` command to the subcommands ``sub`` of the ``llm-calib`` parser: its
    data and run flags, the model loading flags and the configuration's flags
    (:func:`~llm_calib.cli.config_flags.add_config_flags`).

    Example:
        >>> parser = argparse.ArgumentParser(prog="llm-calib")
        >>> add_parser(parser.add_subparsers(dest="command"))
        >>> args = parser.parse_args(["calibrate", "--train", "builtin", "--heldout", "builtin",
        ...                           "--eval", "builtin", "--out", "x", "--methods", "calm,lora_ce"])
        >>> args.methods, args.model, args.func is run
        (['calm', 'lora_ce'], 'smollm2-135m-instruct', True)
    """
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
        epilog=_CALIBRATE_EPILOG + "\n" + DATA_SPECS_HELP + "\n",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--model", type=MODEL,
        default=DEFAULT_MODEL,
        help="built-in alias (smollm2-135m-instruct), local model directory, .gguf file or hub "
        "name; loaded once, every method trains its own adapters on it (default: %(default)s)",
    )
    p.add_argument(
        "--train", type=SPEC, required=True, metavar="SPEC",
        help="data spec of the labelled training split (lower level: task cross-entropy); all "
        "multiple choice, or all open questions (e.g. nq_open), trained on their first answer; or "
        "instruction data, jsonl:PATH of {prompt, response} (or Alpaca's {instruction, input, output}) "
        "lines, trained on the response under a multiple-choice --heldout",
    )
    p.add_argument(
        "--heldout", type=SPEC, required=True, metavar="SPEC",
        help="data spec of the held-out split, of the kind of --train (multiple choice also under "
        "open-ended --train records): its labels serve "
        "model selection, the accuracy guard and the temperature fit (open questions: of token confidence, "
        "or the sampling temperature under --confidence semantic; none under p_true or verbalized); its "
        "inputs drive CALM's entropy objective unless --unlabeled is given",
    )
    p.add_argument(
        "--eval", type=SPEC, action="append", required=True, metavar="SPEC",
        help="data spec to evaluate on; repeat for several sets (reported per domain)",
    )
    p.add_argument("--out", type=PATH, required=True, metavar="DIR", help="output directory (created if missing)")
    p.add_argument(
        "--config", type=PATH, default=None, metavar="FILE",
        help="YAML or JSON file of the nested CalibrationConfig (overridden by explicit flags)",
    )
    p.add_argument(
        "--methods", type=_methods, default=None, metavar="M[,M...]",
        help="compare several objectives: comma-separated names from calm, lora_ce, label_smoothing, "
        "confidence_penalty or a registered objective, each trained with its settings (the config's for "
        "its objective, else the defaults, then the flags of that objective) (default: only the "
        "objective of --objective / the config file, CALM unless set)",
    )
    add_data_loading_args(
        p, limit_help="at most N questions per data spec (--train, --heldout, --eval; see --limit-mode)"
    )
    _add_run_flags(p)
    add_model_loading_args(p.add_argument_group("model loading", "how the base model is loaded (once per run)"),
                           training=True)
    add_config_flags(p)
    p.set_defaults(func=run)


def _add_run_flags(p: argparse.ArgumentParser) -> None:
    """``calibrate``'s flags after the data: unlabelled inputs, resuming, progress, report, device."""
    p.add_argument(
        "--unlabeled", type=SPEC, action="append", default=None, metavar="SPEC",
        help="data spec of unlabelled upper-level inputs (CALM's entropy objective and the "
        "confidence penalty's entropy term), of the same kind as --heldout; labels in it are "
        "ignored; repeat for several sets (default: the --heldout inputs; then --heldout "
        "serves only model selection, the accuracy guard and the temperature fit)",
    )
    p.add_argument(
        "--unlabeled-limit", type=positive_int, default=None, metavar="N",
        help="at most N records per --unlabeled spec (a seeded subsample; default: all, "
        "--limit does not apply to --unlabeled)",
    )
    p.add_argument(
        "--resume", action="store_true",
        help="reuse finished methods in --out (same config) and continue unfinished ones from "
        "their newest checkpoint",
    )
    p.add_argument(
        "--restart", action="store_true",
        help="start over: delete the checkpoints an earlier run left in --out/checkpoints/<method> "
        "(without --resume or --restart, such checkpoints stop the run before the model is loaded)",
    )
    p.add_argument(
        "--no-progress", "--quiet", dest="no_progress", action="store_true",
        help="no progress bars, transformers' loading bars included (training shows "
        "loss/accuracy/entropy/held-out ECE otherwise)",
    )
    p.add_argument(
        "--bootstrap", type=non_negative_int, default=1000, metavar="R",
        help="bootstrap resamples for 95%% confidence intervals in the report; 0 disables them "
        "(default: %(default)s)",
    )
    p.add_argument("--bins", **BINS_FLAG)
    p.add_argument(
        "--device", type=DEVICE, default="cpu",
        help="torch device (default: %(default)s); 'cuda' under torchrun means cuda:LOCAL_RANK",
    )
    p.add_argument(
        "--cache-dir", type=PATH, default=None,
        help="cache of the converted built-in model, or hub cache for hub names",
    )
    add_confidence_args(p)


def _load_data(args: argparse.Namespace, config: Any,
               log: Callable[[str], None]) -> tuple[Any, Any, list, Any, Any]:
    """The ``--train``, ``--heldout``, ``--eval`` and ``--unlabeled`` sets (the last None without
    the flag), each checked against the formats of the run, and the run resolved once
    (:func:`~llm_calib.calm.run.resolve_run`) with ``config.prompt``'s few-shot pool, drawn once without
    the held-out and evaluated questions."""
    from llm_calib.calm.run import resolve_run
    from llm_calib.data import load as load_data
    from llm_calib.prompts.templates import PromptFormat

    seed = config.seed
    train = load_records(args, "--train", args.train, log, seed=seed)
    heldout = load_records(args, "--heldout", args.heldout, log, seed=seed)
    evals = load_distinct(args, "--eval", args.eval, log, seed=seed)  # a set given twice is scored once
    pool: tuple[Any, ...] = ()
    if config.prompt.fewshot:  # one pool for training, selection and evaluation, as evaluate draws it
        settings = config.prompt
        pool = fewshot_pool(
            args, PromptFormat(fewshot=settings.fewshot, fewshot_split=settings.fewshot_split),
            [r for _, recs in [heldout, *evals] for r in recs], log,
        ).fewshot_pool
    # one kind of record per set, read here; the held-out kind is the training kind, or multiple
    # choice under open-ended (prompt, response) training; the message names the offending record
    names = (f"--train {args.train}", f"--heldout {args.heldout}", "--unlabeled")
    resolved = user_call(lambda: resolve_run(config, train[1], heldout[1], names=names, fewshot_pool=pool), None,
                         (ValueError,))
    fmt = resolved.formats.upper
    unlabeled = None
    if args.unlabeled:
        parts = load_distinct(args, "--unlabeled", args.unlabeled, lambda message: None, seed=seed,
                              load=lambda spec: user_call(
                                  lambda: load_data(spec, limit=args.unlabeled_limit, seed=seed).records,
                                  f"--unlabeled {spec}"))
        unlabeled = ("+".join(spec for spec, _ in parts), [r for _, part in parts for r in part])
        if not unlabeled[1]:
            raise UserError(f"--unlabeled {unlabeled[0]}: no records (the unlabelled set is empty)")
        user_call(lambda: fmt.check(unlabeled[1], what=f"--unlabeled {unlabeled[0]}"), None, (ValueError,))
        log(f"loaded {len(unlabeled[1])} unlabelled inputs from {unlabeled[0]}")
    return train, heldout, evals, unlabeled, resolved


def _print_ece(cmp: Any) -> None:
    """One stdout line per evaluated domain: its size and the ECE of every column of the report."""
    for dom, d in cmp.domains.items():
        cells = ", ".join(
            f"{col}={(d.columns.get(col) or {}).get('ece', float('nan')):.3f}" for col in cmp.columns
        )
        print(f"{dom}: n={d.n} ECE {cells}")


def _run_bytes(model: str, config: Any, methods: list[Any]) -> int:
    """A rough estimate of what the run writes (:func:`~llm_calib.files.outputs.lora_run_bytes`), from a
    local model's ``config.json`` (no model is loaded); 0 (no free-space check) for a hub name or
    alias, or a config without the sizes."""
    from llm_calib.files.atomic import read_json
    from llm_calib.files.outputs import lora_run_bytes

    path = Path(model).expanduser() / "config.json"
    try:
        sizes = read_json(path) if path.is_file() else {}
        hidden, layers = int(sizes["hidden_size"]), int(sizes["num_hidden_layers"])
    except (KeyError, TypeError, ValueError, OSError):
        return 0
    try:
        adapted = config.lora.layer_indices(layers)  # --lora-layers / top_layers: only those get adapters
    except ValueError:  # an index out of range: the run reports it
        return 0
    return lora_run_bytes(hidden, layers if adapted is None else max(len(adapted), 1), rank=config.lora.rank,
                          modules_per_layer=max(len(config.lora.target_modules), 1),
                          methods=len(methods), checkpoints_kept=2 if config.checkpoint_every else 0)


def run(args: argparse.Namespace) -> int:
    """Run ``llm-calib calibrate`` with its parsed ``args``: resolve the configuration, load the
    data, then the model (once), train and compare the objectives and write the report to ``--out``.

    Returns:
        0, or 1 when training diverged; a user error raises the CLI's user error, which
        :func:`~llm_calib.cli.main` reports in one line with status 2.

    Example:
        >>> from llm_calib.cli import main
        >>> main(["calibrate", "--train", "nosuchloader:x", "--heldout", "builtin", "--eval", "builtin",
        ...       "--out", "/tmp/x", "--quiet"])
        2
    """
    from llm_calib.evaluation.compare import (
        resume_budget_problem,
        stale_checkpoints,
        stale_checkpoints_message,
    )
    from llm_calib.files.outputs import check_output_folder, run_lock

    if args.resume and args.restart:
        raise UserError("--resume and --restart: choose one (continue the earlier run, or delete its checkpoints)")
    config, methods = calibration_config(args)
    confidence = user_call(lambda: open_confidence(args, seed=config.seed), None)  # a bad template: before any work
    # before the data and the model, not after the work: a file, not writable, too little free space
    user_call(lambda: check_output_folder(args.out, need_bytes=_run_bytes(args.model, config, methods)), None)
    check_model_path(args.model)
    check_device(args.device)
    stale = stale_checkpoints(args.out, [m.name for m in methods])
    if stale and not args.resume and not args.restart:
        raise UserError(stale_checkpoints_message(args.out, [p.name for p in stale]))
    if args.resume:  # a checkpoint past the budget: refused now, not after loading the model
        problem = resume_budget_problem(args.out, [m.name for m in methods],
                                        None if config.training.epochs is not None else config.training.steps)
        if problem is not None:
            raise UserError(problem)
    with contextlib.ExitStack() as stack:  # the lock: a second run into --out is refused
        if int(os.environ.get("RANK", "0")) == 0:  # torchrun's ranks are one run: the first holds the lock
            user_call(lambda: stack.enter_context(run_lock(args.out)), None)
        return _run_locked(args, config, methods, None if confidence.kind == "token" else confidence)


def _run_locked(args: argparse.Namespace, config: Any, methods: list[Any], confidence: Any) -> int:
    """:func:`run` after the checks of ``--out``, while holding its lock."""
    from llm_calib import distributed
    from llm_calib.calm.lora import check_target_modules
    from llm_calib.calm.trainer import TrainingDiverged
    from llm_calib.engine.options import loaded_precision
    from llm_calib.evaluation.compare import run_comparison, write_comparison_report
    from llm_calib.prompts.templates import prompt_dict

    args.prompt_preset = config.prompt.preset  # --limit-mode's default follows the preset (flag or file)
    start(args, args.no_progress)
    distributed.init_from_env(args.device)  # gloo for --device cpu even where GPUs are present
    main_rank = distributed.rank() == 0

    def log(message: str) -> None:
        if main_rank:
            print(message, file=sys.stderr, flush=True)

    t0 = time.perf_counter()
    # Load every data set before the model, so a bad spec fails fast.
    train, heldout, evals, unlabeled, resolved = _load_data(args, config, log)
    if confidence is not None:
        check_confidence_applies(confidence.kind, evals, "--eval")  # before the model is loaded
    load_s = time.perf_counter() - t0
    t1 = time.perf_counter()
    model, tokenizer, loading = load_base_model(args, run_device(args.device))  # once: every method trains its own adapters
    precision = loaded_precision(model)
    log(f"loaded {args.model} ({precision['dtype']}{', ' + precision['quantization'] if precision['quantization'] else ''}"
        f", {precision['device']}) in {time.perf_counter() - t1:.1f} s")
    # before any training: a module name the model lacks, named with the ones it has
    user_call(lambda: check_target_modules(model, config.lora.target_modules), None)
    # the prompt as resolved (chat_template: whether this tokenizer's template is used), as evaluate records it
    prompt = prompt_dict(resolved.settings.prompt, tokenizer)
    try:
        cmp = run_comparison(
            model, tokenizer, train, heldout, evals, resolved, methods, args.out,
            unlabeled=unlabeled, resume=args.resume, restart=args.restart, progress=not args.no_progress,
            n_bins=args.bins,
            bootstrap=args.bootstrap, log=log,
            # the dtype and quantisation are the model's own (base_model_record), not the flags asked for
            base_model={"model": recorded_model(args.model), "prompt": prompt, "prompt_preset": config.prompt.preset},
            confidence=confidence, context_overflow=args.context_overflow,
        )
    except TrainingDiverged as exc:
        print(f"llm-calib: error: training diverged: {exc}", file=sys.stderr)
        return 1
    except ValueError as exc:
        raise UserError(str(exc)) from exc
    cmp.config["model"] = args.model
    cmp.config["model_loading"] = loading.to_dict()
    cmp.config.update(precision)  # what the model computed with, not what was asked
    cmp.config["merged_specs"] = getattr(args, "merged_specs", [])
    cmp.config["prompt"] = prompt
    cmp.config["limit"] = args.limit
    cmp.config["limit_mode"] = limit_mode(args)
    cmp.config["skipped"] = getattr(args, "skipped_rows", {})
    cmp.config["timings"]["data_loading_s"] = load_s
    if not main_rank:
        return 0
    paths = write_comparison_report(cmp, args.out)
    paths["model_loading"] = loading.save(Path(args.out) / "model_loading.json")
    _print_ece(cmp)
    print(f"wrote {len(paths)} report files and {len(methods)} result directories to {args.out}")
    return 0
