"""Loading the model and the data sets: the model and data loading flags of the commands that
load them, the base model a saved result records, ``--limit``/``--limit-mode``, few-shot pools."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from llm_calib.cli._common import DEFAULT_MODEL, UserError, positive_int, user_call


def add_model_loading_args(p: argparse.ArgumentParser, *, training: bool, quantization: bool = True) -> None:
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
        "--threads", type=positive_int, default=None,
        help="torch CPU threads (default: torch's choice)",
    )


def start(args: argparse.Namespace, quiet: bool) -> None:
    """What every command that loads a model does first: ``--threads`` (of
    :func:`add_model_loading_args`) sets torch's CPU thread count; ``quiet``: no transformers /
    huggingface_hub progress bars ("Loading weights", "Writing model shards", downloads) for the
    rest of the process."""
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    if quiet:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()


def resolve_base(args: argparse.Namespace, adapter: str | None, flag: str) -> dict[str, Any]:
    """``--model`` and ``--dtype`` default to what the saved result at ``adapter`` records
    (:func:`~llm_calib.calm.export.saved_base`); without an adapter, to the built-in model and float32.

    Returns:
        The saved record (empty when there is none); without an adapter, the record of an exported
        merged ``--model`` (:func:`~llm_calib.calm.export.merged_record`): the prompt it was trained with.
        The file it was read from is ``args.base_record`` (None when there is none).

    Raises:
        UserError: ``adapter`` is not an adapter directory, its record is unreadable, it was trained
            on another base than ``--model`` (without ``--allow-other-base``), or it names no base
            model and no ``--model`` is given; a local ``--model`` that is no model
            (:func:`check_model_path`).
    """
    from llm_calib.calm.export import (
        EXPORT_FILE,
        adapter_directory,
        check_adapter_base,
        merged_record,
        saved_base,
        saved_base_file,
    )

    base: dict[str, Any] = {}
    args.base_record = None
    if adapter is not None:
        user_call(lambda: adapter_directory(adapter), flag)  # fail before loading the model
        base = user_call(lambda: saved_base(adapter), flag)  # a truncated base_model.json: one line naming it
        args.base_record = saved_base_file(adapter)
        if args.model is not None:  # an adapter on another base of the same shape would score nonsense silently
            user_call(lambda: check_adapter_base(adapter, args.model, cache_dir=getattr(args, "cache_dir", None),
                                                 allow_other_base=getattr(args, "allow_other_base", False)), None)
        elif base.get("model") and os.path.isabs(str(base["model"])) and not Path(base["model"]).exists():
            raise UserError(f"{flag} {adapter}: the base model it was trained on, {base['model']} ({args.base_record}), "
                            "is not there any more (moved or deleted?); give its new place with --model (a copy or "
                            "a moved folder of it is recognised by its content)")
    elif args.model is not None:
        base = user_call(lambda: merged_record(args.model), f"--model {args.model}")
        args.base_record = Path(args.model) / EXPORT_FILE if base else None
    if args.model is None:
        if adapter is not None and not base.get("model"):
            raise UserError(
                f"--model is required: {flag} {adapter} does not record the base model it was trained on "
                "(a plain peft adapter, or a result saved by an older llm-calib); give the model it was "
                "trained on with --model"
            )
        args.model = base.get("model") or DEFAULT_MODEL
    check_model_path(args.model)
    if args.dtype is None:
        args.dtype = base.get("dtype") or "float32"
    return base


def add_allow_other_base_arg(p: argparse.ArgumentParser) -> None:
    """``--allow-other-base``: put an adapter on a ``--model`` other than the base it records."""
    p.add_argument(
        "--allow-other-base", action="store_true",
        help="put --adapter on --model even though the saved result records another base model "
        "(refused otherwise: an adapter on another base of the same shape loads without error and "
        "scores nonsense)",
    )


def check_model_path(name: str) -> None:
    """A local ``--model`` path that cannot be a model is a one-line error naming it, before any
    loading (transformers' own messages do not say what is wrong with the path): a folder without
    ``config.json`` (or a ``.gguf`` file), a file that is not a ``.gguf``, or a ``.gguf`` without the
    GGUF magic bytes. Names that are no local path (aliases, hub names) pass.

    Raises:
        UserError: as above.
    """
    path = Path(name).expanduser()
    if not path.exists():
        return
    if path.is_dir():
        if not (path / "config.json").is_file() and not any(path.glob("*.gguf")):
            raise UserError(f"--model {name}: a folder without config.json, not a saved model (save one with "
                            "save_pretrained, or give a .gguf file, a built-in alias or a hub name)")
        return
    if path.suffix.lower() != ".gguf":
        raise UserError(f"--model {name}: a file, not a model; give a model folder (with config.json), a .gguf "
                        "file, a built-in alias or a hub name")
    with path.open("rb") as fh:
        magic = fh.read(4)
    if magic != b"GGUF":
        raise UserError(f"--model {name}: not a GGUF file (it does not start with the GGUF magic bytes)")


def recorded_model(name: str) -> str:
    """The model name a saved result records: an existing local path made absolute (so it still
    loads from another working directory), anything else (alias, hub name) as given."""
    return str(Path(name).resolve()) if Path(name).exists() else name


def load_base_model(args: argparse.Namespace, device: str = "cpu") -> tuple[Any, Any, Any]:
    """``--model`` loaded onto ``device`` with the model loading flags (their ``ModelLoadConfig``; on
    a GPU the weights load straight onto it): ``(model, tokenizer, the ModelLoadConfig)``."""
    from llm_calib.models import ModelLoadConfig
    from llm_calib.models import load as load_model

    loading = user_call(
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
    check_model_path(args.model)
    local = Path(args.model).expanduser().exists()
    try:
        model, tokenizer = user_call(
            lambda: load_model(args.model, cache_dir=args.cache_dir, device=device, config=loading),
            f"--model {args.model}",
        )
    except UserError:
        raise
    except Exception as exc:
        if not local:
            raise
        first = (str(exc).strip().splitlines() or [""])[0][:300]
        raise UserError(f"--model {args.model}: cannot be loaded ({type(exc).__name__}: {first}); truncated or "
                        "damaged weights? check the files or download the model again") from exc
    return model, tokenizer, loading


def add_data_loading_args(p: argparse.ArgumentParser, *, limit_help: str) -> None:
    """``--limit``, ``--limit-mode``, ``--context-overflow`` and ``--on-error``: how every command that
    loads data reads it (and fits it to the model)."""
    p.add_argument("--limit", type=positive_int, default=None, metavar="N", help=limit_help)
    p.add_argument(
        "--limit-mode",
        choices=("sample", "first"),
        default=None,
        help="which N questions --limit keeps: a seeded subsample in file order (sample), or the "
        "first N rows of the file (first, as lm-eval's --limit) (default: first with an lm_eval_* "
        "--prompt-preset, else sample)",
    )
    p.add_argument(
        "--context-overflow",
        choices=("refuse", "truncate"),
        default="refuse",
        help="a question whose prompt and answer are longer than the model's context (its "
        "max_position_embeddings): refuse it, naming it (refuse), or cut its prompt from the left to fit, "
        "as lm-eval does, counted in the report and warned about (truncate) (default: %(default)s)",
    )
    p.add_argument(
        "--on-error",
        choices=("raise", "skip"),
        default="raise",
        help="a malformed data row stops the run (raise) or is skipped and reported with its "
        "file:line:field (skip) (default: %(default)s)",
    )


SET_OF_FLAG = {"--train": "training", "--heldout": "held-out", "--unlabeled": "unlabelled", "--eval": "evaluation",
               "--data": "evaluation", "--temperature-fit": "temperature-fit"}


def limit_mode(args: argparse.Namespace) -> str:
    """``--limit-mode`` as given, else ``first`` under an ``lm_eval_*`` prompt preset (lm-eval's
    ``--limit`` takes the first N; the preset of the flag, else the one a saved ``--adapter`` or
    an exported merged ``--model`` was trained with when no prompt flag is given), else ``sample``."""
    mode = getattr(args, "limit_mode", None)
    if mode is not None:
        return mode
    preset = getattr(args, "prompt_preset", None) or getattr(args, "saved_preset", None)
    return "first" if (preset or "").startswith("lm_eval_") else "sample"


def load_records(args: argparse.Namespace, flag: str, spec: str, log: Callable[[str], None], *,
                 seed: int | None = None, limited: bool = True, note: str = "") -> tuple[str, list]:
    """Load one spec with the shared data-loading flags (``--limit`` only when ``limited``) as
    ``(spec, records)``, logging ``loaded N questions from SPEC`` (and ``note``) with ``log``; no
    records is an error naming the empty set.

    Skipped rows (``--on-error skip``) are reported on stderr even with ``--quiet``, one line
    per row naming its file, line and field, and kept in ``args.skipped_rows``.
    """
    from llm_calib.data import load as load_data

    res = user_call(
        lambda: load_data(
            spec,
            limit=args.limit if limited else None,
            seed=seed if seed is not None else (args.seed if args.seed is not None else 0),
            on_error=getattr(args, "on_error", "raise"),
            limit_mode=limit_mode(args),
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
        raise UserError(f"{flag} {spec}: no records (the {SET_OF_FLAG.get(flag, flag)} set is empty)")
    log(f"loaded {len(res.records)} questions from {spec}{note}")
    return spec, res.records


def check_device(name: str) -> None:
    """A ``--device`` this machine does not have is a one-line error naming it and what it has,
    before any loading (torch's own error surfaces only when the model is moved there).

    Raises:
        UserError: no CUDA (or MPS, XPU, ...) on this machine or in this torch build, or a device
            index beyond the devices there are.
    """
    import torch

    device = torch.device(name)
    if device.type in ("cpu", "meta"):
        return
    backend = {"mps": getattr(torch.backends, "mps", None)}.get(device.type, getattr(torch, device.type, None))
    available = getattr(backend, "is_available", None)
    if available is None or not available():
        build = f"; this torch {torch.__version__} is built without CUDA" if device.type == "cuda" and not torch.version.cuda else ""
        raise UserError(f"--device {name}: no {device.type} device on this machine{build}; use --device cpu")
    count = getattr(backend, "device_count", None)
    if device.index is not None and count is not None and device.index >= count():
        raise UserError(f"--device {name}: this machine has {count()} {device.type} device(s), "
                        f"{device.type}:0 to {device.type}:{count() - 1}")


def _spec_key(spec: str) -> str:
    """A spec as a key that two spellings of one data set share (a relative path made absolute)."""
    from llm_calib.data import absolute_spec

    try:
        return absolute_spec(spec.strip())
    except ValueError:
        return spec.strip()


def load_distinct(args: argparse.Namespace, flag: str, specs: list[str], log: Callable[[str], None], *,
                  seed: int | None = None, load: Callable[[str], list] | None = None) -> list[tuple[str, list]]:
    """The sets of a repeatable data flag (``--data``, ``--eval``, ``--unlabeled``), each loaded with
    :func:`load_records` (or ``load(spec)``), a set given twice counted once: a spec repeated (the same text, or the same
    path spelled another way) is not loaded again, and a spec whose records are those of an earlier
    one (``builtin:capitals:n=6`` and ``builtin:capitals:n=6,seed=0``) is dropped. Each merge is a
    one-line warning on stderr (even with ``--quiet``) and an entry ``{"flag", "spec", "same_as"}``
    of ``args.merged_specs``, which the report shows: counted twice, every interval would be too narrow.
    """
    import hashlib

    if not hasattr(args, "merged_specs"):
        args.merged_specs = []
    out: list[tuple[str, list]] = []
    by_key: dict[str, str] = {}
    by_records: dict[str, str] = {}

    def merge(spec: str, first: str, why: str) -> None:
        args.merged_specs.append({"flag": flag, "spec": spec, "same_as": first})
        print(f"llm-calib: warning: {flag} {spec}: {why} {flag} {first}; counted once", file=sys.stderr, flush=True)

    for spec in specs:
        key = _spec_key(spec)
        if key in by_key:
            merge(spec, by_key[key], "the same data set as")
            continue
        name, records = (spec, load(spec)) if load is not None else load_records(args, flag, spec, log, seed=seed)
        digest = hashlib.sha256("\n".join(repr(r) for r in records).encode()).hexdigest()
        if digest in by_records:
            merge(spec, by_records[digest], "the same questions as")
            continue
        by_key[key], by_records[digest] = spec, spec
        out.append((name, records))
    return out


def check_confidence_applies(kind: str, sets: list[tuple[str, list]], flag: str) -> None:
    """``--confidence`` other than ``token`` with no open-ended question among the evaluated ``sets``
    is an error: it would change nothing (multiple choice is scored by its option probabilities),
    and a user asking for Sem-ECE would get option ECE without a word.

    Raises:
        UserError: as above, naming the sets.
    """
    from llm_calib.data.records import OpenQA

    if kind != "token" and not any(isinstance(r, OpenQA) for _, records in sets for r in records):
        raise UserError(f"--confidence {kind}: applies to open-ended questions, and every {flag} set here is multiple "
                        f"choice ({', '.join(name for name, _ in sets)}; its confidence is the probability of the "
                        "chosen option): leave out --confidence, or add an open-ended set")


def run_device(name: str) -> str:
    import os

    if name == "cuda" and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
    return name


def fewshot_pool(args: argparse.Namespace, prompt: Any, evaluated: list, log: Callable[[str], None],
                 what: str | None = None) -> Any:
    """``prompt`` with its few-shot pool: ``prompt.fewshot_split`` loaded once, without the
    ``evaluated`` questions (``evaluate``: the questions it scores; ``calibrate``: the held-out and
    evaluation sets, so training, selection and evaluation draw each question's examples from the
    same pool, and a question shows the same examples in all three and in an ``evaluate`` of the
    same split with the same flags). A load error names ``what`` (default: ``--fewshot-split SPEC``)."""
    from llm_calib.prompts.resolution import resolve_fewshot

    fmt = user_call(lambda: resolve_fewshot(prompt, exclude=evaluated, on_error=args.on_error),
                    what or f"--fewshot-split {prompt.fewshot_split}")
    log(f"few-shot pool: {len(fmt.fewshot_pool)} examples from {fmt.fewshot_split}")
    return fmt
