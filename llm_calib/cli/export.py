"""``llm-calib export``: merge a saved adapter into its base model and save a standalone model."""

from __future__ import annotations

import argparse
from pathlib import Path

from llm_calib.cli._common import MODEL, PATH, user_call
from llm_calib.cli._loading import (
    add_allow_other_base_arg,
    add_model_loading_args,
    load_base_model,
    resolve_base,
    start,
)
from llm_calib.cli.prompt import (
    EVALUATE_PROMPT_DEST,
    add_prompt_args,
    preset_in_use,
    prompt_format,
    warn_prompt_mismatch,
)

__all__ = ["add_parser", "run"]

def add_parser(sub: argparse._SubParsersAction) -> None:
    """Add the ``export`` command to the subcommands ``sub`` of the ``llm-calib`` parser.

    Example:
        >>> parser = argparse.ArgumentParser(prog="llm-calib")
        >>> add_parser(parser.add_subparsers(dest="command"))
        >>> args = parser.parse_args(["export", "runs/calm/calm", "--out", "merged"])
        >>> args.adapter, args.model, args.func is run
        ('runs/calm/calm', None, True)
    """
    p = sub.add_parser(
        "export",
        help="merge a saved adapter into its base model and save a standalone model",
        description=(
            "Load --model, put the adapter of DIR on it (a saved calibration result or any peft "
            "adapter), fold LoRA and the output scale into the base weights and save the merged "
            "model with save_pretrained (safetensors) plus its tokenizer and a Hugging Face model card "
            "(README.md: method, data and the per-domain calibration table of the run) to --out. The result "
            "loads with plain transformers (AutoModelForCausalLM.from_pretrained), without peft "
            "or llm_calib, and runs at the base model's cost."
        ),
        epilog="example:\n  llm-calib export runs/calm/calm --model smollm2-135m-instruct --out smollm2-calm\n",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("adapter", type=PATH, metavar="DIR", help="saved calibration result or peft adapter directory")
    p.add_argument(
        "--model",
        type=MODEL,
        default=None,
        help="the base model the adapter was trained on: built-in alias, local directory, .gguf "
        "file or hub name (default: the one the saved result records; required for a plain peft "
        "adapter or a result saved without it)",
    )
    add_model_loading_args(p.add_argument_group("model loading", "how the base model is loaded (--dtype: "
                                                 "the dtype of the merged weights)"),
                            training=False, quantization=False)
    p.add_argument("--cache-dir", type=PATH, default=None, help="cache of the converted built-in model, or hub cache")
    p.add_argument("--out", type=PATH, required=True, metavar="MERGED",
                   help="output directory (created if missing); never the base model's or the adapter's "
                   "folder, and a non-empty folder only when an earlier export wrote it, or with --overwrite")
    p.add_argument("--overwrite", action="store_true",
                   help="replace a non-empty --out folder that llm-calib export did not write (never the base "
                   "model's or the adapter's folder)")
    add_allow_other_base_arg(p)
    p.add_argument("--quiet", "--no-progress", dest="quiet", action="store_true",
                   help="no progress bars (transformers' 'Loading weights' and 'Writing model shards')")
    add_prompt_args(
        p.add_argument_group("prompt", "the prompt the merged model is meant to be used with, recorded in "
                             "MERGED/llm_calib_export.json (default: the one the saved result was trained "
                             "with; another one warns)"),
        EVALUATE_PROMPT_DEST.get,
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run ``llm-calib export`` with its parsed ``args``: resolve the base model and the prompt the
    adapter was trained with, load the model, merge the adapter and save the merged model, its
    record and its model card (:func:`~llm_calib.integrations.model_card.result_model_card`) to ``--out``.

    Returns:
        0; a user error raises the CLI's user error, which :func:`~llm_calib.cli.main` reports
        in one line with status 2.

    Example:
        >>> from llm_calib.cli import main
        >>> main(["export", "/nonexistent/adapter", "--out", "/tmp/x", "--quiet"])
        2
    """
    import warnings

    from llm_calib.calm.export import EXPORT_FILE, check_export_target, export_merged, merged_bytes
    from llm_calib.files.atomic import read_json, write_json_atomic, write_text_atomic
    from llm_calib.files.outputs import check_output_folder
    from llm_calib.prompts.templates import prompt_dict

    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
    start(args, args.quiet)
    base = resolve_base(args, args.adapter, "export")  # fails before loading the model
    # never the base model's folder, nor a folder of something else without --overwrite: before loading
    user_call(lambda: check_export_target(args.out, args.model, adapter=args.adapter, overwrite=args.overwrite), None)
    # a read-only folder or a disk without room for the merged weights: now, not after loading and merging
    user_call(lambda: check_output_folder(args.out, flag="export --out",
                                          need_bytes=merged_bytes(args.model, args.dtype),
                                          writes="the merged model needs about {size}"), None)
    prompt = prompt_format(args, base)
    model, tokenizer, _ = load_base_model(args)
    warn_prompt_mismatch(base, prompt, tokenizer, f"--adapter {args.adapter}", doing="exporting")
    out = user_call(lambda: export_merged(model, tokenizer, args.adapter, args.out, overwrite=args.overwrite), "export")
    record = Path(out) / EXPORT_FILE  # what the merged model was calibrated for: evaluate --model reads it
    write_json_atomic(record, {**read_json(record), "prompt": prompt_dict(prompt, tokenizer),
                               "prompt_preset": preset_in_use(args, base),
                               **{k: base[k] for k in ("scorer", "normalize") if k in base}})
    from llm_calib.integrations.model_card import MODEL_CARD_FILE, result_model_card

    write_text_atomic(Path(out) / MODEL_CARD_FILE, result_model_card(args.adapter, base.get("model") or args.model))
    print(f"wrote the merged model and its model card to {out}")
    return 0
