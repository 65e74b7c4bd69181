"""Loading a saved adapter onto its base model, and exporting a merged standalone model that
``AutoModelForCausalLM.from_pretrained`` loads alone, at the base model's inference cost.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from llm_calib.calm.lora import peft_deprecations_silenced
from llm_calib.calm.trainer import BASE_MODEL_FILE
from llm_calib.file_modes import ordinary_modes

__all__ = ["EXPORT_FILE", "adapter_directory", "export_merged", "load_adapter", "merge_adapter", "merged_record",
           "saved_base", "saved_base_file"]

EXPORT_FILE = "llm_calib_export.json"
"""The record :func:`export_merged` writes next to the merged weights (the adapter merged; ``llm-calib
export`` adds the prompt, preset, scorer and normalisation it was calibrated with)."""


def adapter_directory(path: str | os.PathLike[str]) -> Path:
    """The peft adapter directory of a saved calibration result (``adapter/``) or of an adapter;
    ``FileNotFoundError`` for anything else.

    Example:
        >>> import tempfile
        >>> adapter_directory(tempfile.mkdtemp())  # doctest: +IGNORE_EXCEPTION_DETAIL
        Traceback (most recent call last):
        FileNotFoundError: ...
    """
    src = Path(path)
    for candidate in (src, src / "adapter"):
        if (candidate / "adapter_config.json").is_file():
            return candidate
    raise FileNotFoundError(
        f"{src}: not a saved calibration result (no adapter/adapter_config.json) nor a peft adapter "
        "(no adapter_config.json)"
    )


def saved_base_file(path: str | os.PathLike[str]) -> Path | None:
    """The file where the saved result at ``path`` (or the one whose ``adapter/`` it is) records
    its base model (:data:`~llm_calib.calm.trainer.BASE_MODEL_FILE`); None for a plain peft adapter.

    Example:
        >>> import tempfile
        >>> saved_base_file(tempfile.mkdtemp()) is None
        True
    """
    src = Path(path)
    for candidate in (src, src.parent):
        if (candidate / BASE_MODEL_FILE).is_file():
            return candidate / BASE_MODEL_FILE
    return None


def saved_base(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The base model a saved result records (:func:`saved_base_file`: ``model``, ``dtype``,
    ``prompt``); empty for a plain peft adapter.

    Example:
        >>> import tempfile
        >>> saved_base(tempfile.mkdtemp())
        {}
    """
    record = saved_base_file(path)
    return dict(json.loads(record.read_text())) if record is not None else {}


def merged_record(path: str | os.PathLike[str]) -> dict[str, Any]:
    """What an exported merged model at ``path`` records (:data:`EXPORT_FILE`); empty for any other
    model (a hub name, an alias, a plain checkpoint).

    Example:
        >>> import tempfile
        >>> merged_record(tempfile.mkdtemp()), merged_record("smollm2-135m")
        ({}, {})
    """
    record = Path(path) / EXPORT_FILE
    return dict(json.loads(record.read_text())) if record.is_file() else {}


def load_adapter(base_model: Any, path: str | os.PathLike[str]) -> Any:
    """Put the adapter saved at ``path`` (:func:`adapter_directory`) on ``base_model`` (eval mode).

    Example:
        >>> import tempfile
        >>> from llm_calib.models import tiny_random_model
        >>> from llm_calib.calm.lora import attach_lora
        >>> from llm_calib.calm.config import LoraSettings
        >>> d = tempfile.mkdtemp()
        >>> attach_lora(tiny_random_model()[0], LoraSettings(rank=2)).save_pretrained(d)
        >>> type(load_adapter(tiny_random_model()[0], d)).__name__
        'PeftModelForCausalLM'
    """
    from peft import PeftModel

    with peft_deprecations_silenced():
        model = PeftModel.from_pretrained(base_model, str(adapter_directory(path)))
    model.eval()
    return model


def merge_adapter(model: Any) -> Any:
    """Fold a peft model's adapters into plain weights (a plain model is returned as it is).

    Example:
        >>> from llm_calib.models import tiny_random_model
        >>> from llm_calib.calm.lora import attach_lora
        >>> from llm_calib.calm.config import LoraSettings
        >>> merged = merge_adapter(attach_lora(tiny_random_model()[0], LoraSettings(rank=2)))
        >>> type(merged).__name__, any("lora_" in n for n, _ in merged.named_parameters())
        ('LlamaForCausalLM', False)
    """
    if not hasattr(model, "merge_and_unload"):
        return model
    merged = model.merge_and_unload()
    leftover = [n for n, _ in merged.named_modules() if "lora_" in n or "modules_to_save" in n]
    if leftover:  # pragma: no cover - peft guarantees this; a clear error if it ever does not
        raise RuntimeError(f"merging left adapter modules behind: {leftover[:3]}")
    merged.eval()
    return merged


def export_merged(
    base_model: Any, tokenizer: Any, adapter: str | os.PathLike[str], out: str | os.PathLike[str]
) -> Path:
    """Merge the adapter into ``base_model`` (in place) and save a standalone model to ``out``
    (safetensors, tokenizer, and :data:`EXPORT_FILE` naming the adapter).

    Example:
        >>> import tempfile
        >>> from llm_calib.models import tiny_random_model
        >>> from llm_calib.calm.lora import attach_lora
        >>> from llm_calib.calm.config import LoraSettings
        >>> d, out = tempfile.mkdtemp(), tempfile.mkdtemp()
        >>> lora = attach_lora(tiny_random_model()[0], LoraSettings(rank=2), output_scale=True)
        >>> lora.save_pretrained(d)
        >>> model, tok = tiny_random_model()
        >>> [p.name for p in export_merged(model, tok, d, out).glob("*.safetensors")]
        ['model.safetensors']
    """
    src = adapter_directory(adapter)
    merged = merge_adapter(load_adapter(base_model, src))
    target = Path(out)
    target.mkdir(parents=True, exist_ok=True)
    merged.save_pretrained(str(target), safe_serialization=True)
    tokenizer.save_pretrained(str(target))
    (target / EXPORT_FILE).write_text(
        json.dumps({"adapter": str(src.resolve()), "merged": ["lora", "modules_to_save"]}, indent=2)
    )
    for weights in target.glob("*.safetensors"):
        ordinary_modes(weights)  # safetensors writes model.safetensors 0600
    return target
