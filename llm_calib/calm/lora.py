"""LoRA adapters (peft) and a functional view of the adapted model for :mod:`hypergrad`."""

from __future__ import annotations

import contextlib
import logging
import re
import warnings
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from llm_calib.engine.options import compute_dtype, forward_rows
from llm_calib.engine.packing import (
    PackedQuestions,
    accepts_packed_masks,
    causal_additive_mask,
    option_sequences,
)
from llm_calib.models import lm_head_logits, split_decoder_head

if TYPE_CHECKING:
    from llm_calib.config.calibration import LoraSettings

__all__ = ["OUTPUT_LOG_SCALE", "TRUNK_CACHE_ARCHITECTURES", "FunctionalLM", "attach_lora", "check_target_modules",
           "detach_lora",
           "peft_deprecations_silenced"]

logger = logging.getLogger(__name__)

OUTPUT_LOG_SCALE = "output_log_scale"
"""Name of the θ leaf holding the log of the final norm's scale (see :func:`attach_lora`)."""

TRUNK_CACHE_ARCHITECTURES = frozenset({"LlamaModel", "MistralModel", "Qwen2Model", "Qwen3Model"})
"""Decoders whose forward is exactly embedding, layers (``layer(hidden, attention_mask=, position_ids=,
position_embeddings=)``), final norm, so :class:`FunctionalLM` can cache the frozen bottom layers;
any other decoder runs the full forward every step (slower for top-k LoRA, never wrong)."""


def _final_norm_name(model: Any) -> str:
    decoder, _ = split_decoder_head(model)
    norm = getattr(decoder, "norm", None)
    if norm is not None and not _scales_with_weight(norm):
        raise ValueError(f"output_scale needs a final norm whose output scales with its weight; {type(norm).__name__} "
                         "does not (e.g. Gemma's RMSNorm multiplies by 1 + weight): set output_scale=False")
    for name, module in model.named_modules():
        if norm is not None and module is norm:
            return name
    raise ValueError(f"output_scale needs a decoder with a final norm module `norm`; {type(model).__name__} has none "
                     "(set output_scale=False)")


def _scales_with_weight(norm: Any) -> bool:
    """True when doubling the norm's weight doubles its output (what the output scale relies on)."""
    weight = getattr(norm, "weight", None)
    if not isinstance(weight, Tensor) or weight.dim() != 1 or not bool(weight.detach().abs().sum() > 0):
        return False
    x = torch.linspace(-1.0, 1.0, 2 * weight.shape[0], device=weight.device).reshape(2, -1).to(weight.dtype)
    with torch.no_grad():
        once = norm(x).float()
        twice = torch.func.functional_call(norm, {"weight": 2 * weight.detach()}, (x,)).float()
    return torch.allclose(twice, 2 * once, rtol=2e-2, atol=1e-3)


@contextlib.contextmanager
def peft_deprecations_silenced() -> Iterator[None]:
    """Silence the transformers 5 deprecation (``is_gradient_checkpointing``) that peft's own calls trigger.

    Example:
        >>> import warnings
        >>> with peft_deprecations_silenced():
        ...     warnings.warn("`is_gradient_checkpointing` is deprecated", FutureWarning)
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        yield


def attach_lora(model: Any, settings: LoraSettings, output_scale: bool = False) -> Any:
    """Wrap ``model`` in a :class:`peft.PeftModel` with fresh LoRA adapters (``B = 0``); the base is frozen.

    With ``output_scale`` the final norm gets an adapter-owned copy (peft ``modules_to_save``) that
    :class:`FunctionalLM` trains as one scalar, ``base weight * exp(θ[OUTPUT_LOG_SCALE])``: an
    in-model temperature (see :doc:`/methods/calm`).

    Args:
        model: a Hugging Face causal LM.
        settings: rank, alpha, dropout, target modules and layers.
        output_scale: also make the final norm's scale trainable.

    Example:
        >>> from llm_calib.models import tiny_random_model
        >>> from llm_calib.config.calibration import LoraSettings
        >>> peft_model = attach_lora(tiny_random_model()[0], LoraSettings(rank=2, layers=(1,)))
        >>> sorted({n.split(".")[4] for n, p in peft_model.named_parameters() if p.requires_grad})
        ['1']
    """
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=settings.rank, lora_alpha=settings.alpha, lora_dropout=settings.dropout,
        target_modules=list(settings.target_modules), bias="none", task_type="CAUSAL_LM",
        layers_to_transform=settings.layer_indices(int(model.config.num_hidden_layers)),
        modules_to_save=[_final_norm_name(model)] if output_scale else None)
    with peft_deprecations_silenced():
        peft_model = get_peft_model(model, config)
    # Half-precision (or k-bit) base: the trained adapters (θ, its optimiser states) stay float32.
    for name, param in peft_model.named_parameters():
        if "lora_" in name and param.requires_grad and param.dtype in (torch.float16, torch.bfloat16):
            param.data = param.data.float()
    if not any(p.requires_grad for n, p in peft_model.named_parameters() if "lora_" in n):
        raise ValueError(f"LoRA target_modules={settings.target_modules} matched no module of "
                         f"{type(model).__name__}; check the module names")
    if output_scale:
        # The copy is trained through one scalar (FunctionalLM), never coordinate by coordinate.
        for name, param in peft_model.named_parameters():
            if ".modules_to_save." in name:
                param.requires_grad_(False)
    return peft_model


def linear_module_names(model: Any) -> list[str]:
    """The distinct last name parts of ``model``'s linear layers but the output head: what LoRA's
    ``target_modules`` can name (``q_proj``, ``down_proj``, ...)."""
    head = getattr(model.get_output_embeddings(), "weight", None) if hasattr(model, "get_output_embeddings") else None
    names = {name.rsplit(".", 1)[-1] for name, module in model.named_modules()
             if isinstance(module, torch.nn.Linear) and module.weight is not head}
    return sorted(names)


def check_target_modules(model: Any, target_modules: Any, *, flag: str = "--lora-target-modules") -> None:
    """Refuse LoRA ``target_modules`` that ``model`` does not have, before any training (peft's own
    error comes late and does not say what the model has).

    Raises:
        ValueError: a name matches no linear layer of ``model``; names ``flag`` and lists the
            model's linear module names.

    Example:
        >>> from llm_calib.models import tiny_random_model
        >>> model = tiny_random_model()[0]
        >>> check_target_modules(model, ("q_proj", "v_proj"))
        >>> check_target_modules(model, ("foo_proj",))  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ValueError: --lora-target-modules foo_proj: LlamaForCausalLM has no such linear module; its linear modules: down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj
    """
    if isinstance(target_modules, str):  # peft's "all-linear" and regular expressions: peft checks them
        return
    names = linear_module_names(model)
    missing = [m for m in target_modules if m not in names]
    if missing:
        raise ValueError(f"{flag} {','.join(missing)}: {type(model).__name__} has no such linear module; "
                         f"its linear modules: {', '.join(names)}")


def detach_lora(model: Any) -> Any:
    """Remove every adapter from a peft model (no merge) and return the unchanged base model.

    The next run can attach fresh adapters to it instead of loading the base again.

    Args:
        model: a :class:`peft.PeftModel` (or a plain model, returned as is in eval mode).

    Raises:
        RuntimeError: an adapter module survived the removal.

    Example:
        >>> from llm_calib.models import tiny_random_model
        >>> from llm_calib.config.calibration import LoraSettings
        >>> base, _ = tiny_random_model()
        >>> names, before = sorted(base.state_dict()), base.model.norm.weight.clone()
        >>> lm = FunctionalLM(attach_lora(base, LoraSettings(rank=2), output_scale=True))
        >>> lm.load_theta({**lm.theta(), OUTPUT_LOG_SCALE: torch.tensor(0.5)})  # a trained scale
        >>> back = detach_lora(lm.model)
        >>> back is base, sorted(back.state_dict()) == names, bool((back.model.norm.weight == before).all())
        (True, True, True)
    """
    if not hasattr(model, "get_base_model"):
        return model.eval()
    # peft's unload keeps a modules_to_save copy (the output scale's norm): restore the original
    for name, module in list(model.named_modules()):
        if hasattr(module, "original_module") and hasattr(module, "modules_to_save"):
            parent_name, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent_name) if parent_name else model, child, module.original_module)
    with peft_deprecations_silenced():
        base = model.unload()
    left = [n for n, m in base.named_modules() if "lora_" in n or hasattr(m, "modules_to_save")]
    if left:
        raise RuntimeError(f"adapter modules left after unloading: {left[:4]}")
    for param in base.parameters():
        param.requires_grad_(False)
    return base.eval()


class FunctionalLM:
    """A causal LM as a pure function of its trainable parameters θ.

    θ maps parameter names relative to the decoder (the LoRA weights, and with an output scale
    :data:`OUTPUT_LOG_SCALE`) to tensors; :meth:`head_logits` runs the decoder with θ substituted
    (:func:`torch.func.functional_call`) and the output head only at the gathered rows.

    Args:
        model: a Hugging Face causal LM or a peft wrapper of one.
        cache_trunk: cache the frozen bottom layers when only top layers are trained.

    Example:
        >>> from llm_calib.models import tiny_random_model
        >>> from llm_calib.config.calibration import LoraSettings
        >>> lm = FunctionalLM(attach_lora(tiny_random_model()[0], LoraSettings(rank=2), output_scale=True))
        >>> sorted({k.split(".")[-2] for k in lm.theta() if "lora_" in k}), float(lm.theta()[OUTPUT_LOG_SCALE])
        (['default'], 0.0)
    """

    def __init__(self, model: Any, cache_trunk: bool = True) -> None:
        self.model = model
        self.base = model.get_base_model() if hasattr(model, "get_base_model") else model
        self.decoder, self.head = split_decoder_head(self.base)
        trained = [n for n, p in self.decoder.named_parameters() if p.requires_grad]
        trainable_layers = sorted({int(m.group(1)) for n in trained if (m := re.match(r"layers\.(\d+)\.", n))})
        has_other_trainable = any(not n.startswith("layers.") for n in trained)
        layered = all(hasattr(self.decoder, a) for a in ("layers", "norm", "rotary_emb"))
        known = type(self.decoder).__name__ in TRUNK_CACHE_ARCHITECTURES
        self._four_d_masks = accepts_packed_masks(self.base)
        self.packed_masks = self._four_d_masks
        """Whether the attention takes the packed 4-D masks; otherwise one sequence per option."""
        self._checkpointed = _install_functional_checkpointing(self.decoder)
        self.checkpointing = bool(self._checkpointed)
        """Whether the decoder layers recompute activations in the backward pass."""
        norm = getattr(self.decoder, "norm", None)
        self._scaled_norm: str | None = None  # name (relative to the norm) of its adapter copy's weight
        if norm is not None and hasattr(norm, "original_module") and hasattr(norm, "modules_to_save"):
            self._scaled_norm = next(n for n, _ in norm.named_parameters() if n.startswith("modules_to_save."))
            self._norm_base_weight = norm.original_module.weight
        self._compiled_stack: Callable[..., Tensor] | None = None
        self.trunk_layers = 0
        if cache_trunk and trainable_layers and trainable_layers[0] > 0 and not has_other_trainable:
            if layered and known:
                self.trunk_layers = trainable_layers[0]
            else:
                logger.info(
                    "trunk cache off for %s (not one of %s): every step runs the full forward through "
                    "all %s layers, slower for top-k LoRA but exact", type(self.decoder).__name__,
                    sorted(TRUNK_CACHE_ARCHITECTURES), len(getattr(self.decoder, "layers", ())) or "its",
                )

    def refresh_checkpointing(self) -> bool:
        """Give llm-calib's functional checkpointing to decoder layers switched to gradient checkpointing
        after this view was made (``gradient_checkpointing_enable`` installs transformers' own, which
        recomputes with the module's weights, not θ: silently wrong gradients). Returns whether any changed.

        Example:
            >>> from llm_calib.models import tiny_random_model
            >>> from llm_calib.config.calibration import LoraSettings
            >>> lm = FunctionalLM(attach_lora(tiny_random_model()[0], LoraSettings(rank=2)))
            >>> lm.model.gradient_checkpointing_enable()
            >>> lm.refresh_checkpointing(), lm.checkpointing, lm.refresh_checkpointing()
            (True, True, False)
        """
        layers = [m for m in self.decoder.modules() if getattr(m, "gradient_checkpointing", False) and m is not self.decoder]
        stale = [m for m in layers if not getattr(getattr(m, "_gradient_checkpointing_func", None), "substitutes_theta", False)]
        if not stale and len(layers) == len(self._checkpointed):
            return False
        self._checkpointed = _install_functional_checkpointing(self.decoder)
        self.checkpointing = bool(self._checkpointed)
        return True

    @contextlib.contextmanager
    def train_mode(self) -> Iterator[None]:
        """Training mode only on the LoRA dropouts and checkpointed layers, for a step.

        The frozen base keeps its eval behaviour (no attention dropout), so with ``dropout=0`` a
        step computes what eval mode does; the previous flags are restored afterwards.
        """
        modules = [m for n, m in self.model.named_modules() if ".lora_dropout." in f".{n}" and isinstance(m, torch.nn.Dropout)]
        modules += self._checkpointed
        previous = [m.training for m in modules]
        for m in modules:
            m.training = True
        try:
            yield
        finally:
            for m, flag in zip(modules, previous, strict=True):
                m.training = flag

    @property
    def caches_trunk(self) -> bool:
        """True when the frozen bottom layers are computed once and cached (top-k LoRA)."""
        return self.trunk_layers > 0

    def trunk_hidden(self, packed: PackedQuestions) -> Tensor:
        """Hidden states entering the first trainable layer, ``(B, L, hidden)`` (no grad)."""
        if packed.attention_mask.dim() == 4 and not self.packed_masks:
            seq = option_sequences(packed)
            hidden = self.trunk_hidden(seq.packed)
            B, L = packed.input_ids.shape
            return hidden.reshape(-1, hidden.shape[-1])[seq.target.to(hidden.device)].reshape(B, L, -1)
        device = self.device
        with torch.inference_mode():
            if type(self.decoder).__name__ in TRUNK_CACHE_ARCHITECTURES:
                # Only the bottom layers (the full forward costs ~25% more for the top 6 of 30).
                hidden = self.decoder.embed_tokens(packed.input_ids.to(device))
                return self._run_layers(hidden, packed, range(self.trunk_layers)).clone()
            mask = packed.additive_mask(self.dtype) if packed.attention_mask.dim() == 4 else packed.attention_mask
            out = self.decoder(input_ids=packed.input_ids.to(device), attention_mask=mask.to(device),
                               position_ids=packed.position_ids.to(device), use_cache=False, output_hidden_states=True)
        return out.hidden_states[self.trunk_layers].clone()

    def _run_layers(self, hidden: Tensor, packed: PackedQuestions, indices: range,
                    per_layer: dict[int, dict[str, Tensor]] | None = None) -> Tensor:
        """Run decoder layers ``indices`` on ``hidden``, with θ substituted in the layers of ``per_layer``."""
        return self._layers(hidden, *self._layer_inputs(packed), indices, per_layer)

    def _layer_inputs(self, packed: PackedQuestions) -> tuple[Tensor, Tensor]:
        """The attention mask the layers take and the position ids, on the model's device."""
        on = packed.on(self.device)  # copied to the device once per batch, not once per pass
        if on.attention_mask.dim() == 4:
            mask = on.additive_mask(self.dtype)
        elif self._four_d_masks:
            mask = causal_additive_mask(packed.attention_mask, self.dtype).to(self.device)
        else:  # flash-style kernels take the 2-D padding mask
            mask = on.attention_mask
        return mask, on.position_ids

    def _layers(self, hidden: Tensor, mask: Tensor, pos: Tensor, indices: range,
                per_layer: dict[int, dict[str, Tensor]] | None) -> Tensor:
        kwargs = {"attention_mask": mask, "position_ids": pos,
                  "position_embeddings": self.decoder.rotary_emb(hidden, position_ids=pos)}
        for index in indices:
            layer = self.decoder.layers[index]
            if per_layer and index in per_layer:
                hidden = torch.func.functional_call(layer, per_layer[index], (hidden,), kwargs, strict=False)
            else:
                hidden = layer(hidden, **kwargs)
            if isinstance(hidden, tuple):
                hidden = hidden[0]
        return hidden

    def _top_layers(self, theta: dict[str, Tensor] | None, packed: PackedQuestions, trunk: Tensor) -> Tensor:
        per_layer: dict[int, dict[str, Tensor]] = {}
        theta, norm_weight = self._split_scale(theta)
        for name, value in theta.items():
            m = re.match(r"layers\.(\d+)\.(.+)", name)
            if m is None:
                raise ValueError(f"theta entry {name!r} is not inside a decoder layer")
            per_layer.setdefault(int(m.group(1)), {})[m.group(2)] = value
        stack = self._layer_stack if self._compiled_stack is None else self._compiled_stack
        return stack(per_layer, norm_weight, trunk.to(self.device), *self._layer_inputs(packed))

    def _layer_stack(self, per_layer: dict[int, dict[str, Tensor]], norm_weight: dict[str, Tensor], hidden: Tensor,
                     mask: Tensor, pos: Tensor) -> Tensor:
        """The layers from the first trained one and the final norm: what :meth:`compile_step` compiles."""
        hidden = self._layers(hidden, mask, pos, range(self.trunk_layers, len(self.decoder.layers)), per_layer)
        if norm_weight:
            return torch.func.functional_call(self.decoder.norm, norm_weight, (hidden,), strict=False)
        return self.decoder.norm(hidden)

    @property
    def compiled(self) -> bool:
        """Whether :meth:`compile_step` compiled the trained layers."""
        return self._compiled_stack is not None

    def compile_step(self) -> None:
        """Run the trained layers and the final norm (forward and backward) as graphs compiled by
        :func:`torch.compile` (inductor, dynamic shapes: one graph for every batch shape).

        Every loss evaluation of a step then launches a few fused kernels instead of one per operator:
        the step's cost on a GPU stops being set by the launches. The frozen layers below (the trunk, or
        the embedding) run as before. Compiling takes seconds to minutes on the first steps (each of
        training, a gradient in λ only, and the no-grad evaluation compiles once); results equal the
        eager step's to float round-off (fused kernels round differently). CUDA graphs are not used:
        each step's batch has its own shape, which a captured graph cannot take.

        Raises:
            ValueError: a decoder this cannot run layer by layer (not one of
                :data:`TRUNK_CACHE_ARCHITECTURES`, or without 4-D attention masks), gradient checkpointing
                (it recomputes through the compiled graph), θ outside the decoder layers, or no compiler.
        """
        from hypergrad.compiled import compiler_available

        if type(self.decoder).__name__ not in TRUNK_CACHE_ARCHITECTURES or not self.packed_masks:
            raise ValueError(f"training.compile runs the layers one by one, which {type(self.decoder).__name__} "
                             f"does not allow (compiled decoders: {sorted(TRUNK_CACHE_ARCHITECTURES)}, with 4-D "
                             "attention masks)")
        if self.checkpointing:
            raise ValueError("training.compile does not combine with gradient checkpointing; turn one off")
        outside = [n for n in self.theta() if n != OUTPUT_LOG_SCALE and not re.match(r"layers\.\d+\.", n)]
        if outside:
            raise ValueError(f"training.compile needs θ inside the decoder layers; {outside[:3]} are not")
        ok, why = compiler_available()
        if not ok:
            raise ValueError(f"training.compile: torch.compile has no compiler here ({why})")
        self._compiled_stack = torch.compile(self._layer_stack, dynamic=True)

    def _split_scale(self, theta: dict[str, Tensor] | None) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        """θ without the output log-scale, and the final norm's substituted weight (or ``{}``)."""
        theta = dict(theta or {})
        log_scale = theta.pop(OUTPUT_LOG_SCALE, None)
        if log_scale is None:
            return theta, {}
        if self._scaled_norm is None:
            raise ValueError(f"theta has {OUTPUT_LOG_SCALE!r} but the model's final norm has no adapter copy")
        base = self._norm_base_weight
        # the log-scale is a float32 master value; the product is cast to the norm's dtype
        return theta, {self._scaled_norm: (base.to(log_scale.dtype) * torch.exp(log_scale)).to(base.dtype)}

    def decoder_parameters(self, theta: dict[str, Tensor]) -> dict[str, Tensor]:
        """θ as decoder parameters for :func:`torch.func.functional_call` (log-scale → norm weight).

        Example:
            >>> from llm_calib.models import tiny_random_model
            >>> from llm_calib.config.calibration import LoraSettings
            >>> lm = FunctionalLM(attach_lora(tiny_random_model()[0], LoraSettings(rank=2), output_scale=True))
            >>> [k for k in lm.decoder_parameters(lm.theta()) if k.startswith("norm.")]
            ['norm.modules_to_save.default.weight']
        """
        theta, norm_weight = self._split_scale(theta)
        theta.update({f"norm.{k}": v for k, v in norm_weight.items()})
        return theta

    def _current_log_scale(self) -> Tensor:
        copy = dict(self.decoder.norm.named_parameters())[self._scaled_norm].detach()
        base = self._norm_base_weight.detach()
        # The copy is base * exp(s), so the norm ratio recovers s; float32 (float64) master copy.
        master = torch.float64 if base.dtype == torch.float64 else torch.float32
        return torch.log(copy.double().norm() / base.double().norm()).to(master)

    def theta(self) -> dict[str, Tensor]:
        """Detached copies of the trainable parameters (``requires_grad``) of the decoder."""
        out = {n: p.detach().clone() for n, p in self.decoder.named_parameters() if p.requires_grad}
        if self._scaled_norm is not None:
            out[OUTPUT_LOG_SCALE] = self._current_log_scale()
        if not out:
            raise ValueError("the model has no trainable decoder parameters (attach LoRA first)")
        head_trainable = [n for n, p in self.head.named_parameters() if p.requires_grad]
        if head_trainable and self.head is not getattr(self.decoder, "embed_tokens", None):
            raise ValueError(f"trainable output-head parameters {head_trainable} are not supported")
        return out

    def load_theta(self, theta: dict[str, Tensor]) -> None:
        """Copy θ into the decoder's parameters in place."""
        params = dict(self.decoder.named_parameters())
        with torch.no_grad():
            for k, v in self.decoder_parameters(theta).items():
                params[k].copy_(v)

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype of the base model (of its input embeddings: quantised weights are integers)."""
        return compute_dtype(self.base)

    @property
    def device(self) -> torch.device:
        return next(self.decoder.parameters()).device

    def hidden_rows(self, theta: dict[str, Tensor] | None, packed: PackedQuestions,
                    trunk: Tensor | None = None) -> Tensor:
        """Final hidden states at ``packed.rows`` (``(R, hidden)``), with θ substituted; with
        ``trunk`` (:meth:`trunk_hidden`) only the layers from the first trainable one run."""
        if trunk is None and self._compiled_stack is not None:  # every layer trained: the embedding is the trunk
            with torch.no_grad():
                trunk = self.decoder.embed_tokens(packed.input_ids.to(self.device))
        if trunk is None:  # the engine's forward pass (one sequence per option where 4-D masks cannot go)
            params = None if theta is None else self.decoder_parameters(theta)
            return forward_rows(self.base, packed, packed_masks=self.packed_masks, parameters=params)[0]
        if packed.attention_mask.dim() == 4 and not self.packed_masks:
            seq = option_sequences(packed)
            trunk = trunk.reshape(-1, trunk.shape[-1])[seq.source.to(trunk.device)]
            return self.hidden_rows(theta, seq.packed, trunk.reshape(*seq.packed.input_ids.shape, -1))
        hidden = self._top_layers(theta, packed, trunk)
        return hidden.reshape(-1, hidden.shape[-1])[packed.on(self.device).rows]

    def head_logits(self, theta: dict[str, Tensor] | None, packed: PackedQuestions, trunk: Tensor | None = None,
                    select: Tensor | None = None) -> Tensor:
        """Vocabulary logits ``(R, V)`` at ``packed.rows`` (float32 for half-precision models);
        ``select`` (indices into the rows) projects only those rows."""
        hidden = self.hidden_rows(theta, packed, trunk)
        if select is not None:
            hidden = hidden[select.to(hidden.device)]
        return lm_head_logits(self.base, self.head, hidden)


@contextlib.contextmanager
def _parameters_set(module: torch.nn.Module, tensors: dict[str, Tensor]) -> Iterator[None]:
    """Temporarily make ``tensors`` (by parameter name) the parameters of ``module``."""
    swapped = []
    for name, tensor in tensors.items():
        owner_name, _, leaf = name.rpartition(".")
        owner = module.get_submodule(owner_name) if owner_name else module
        current = owner._parameters[leaf]
        if current is not tensor:
            owner._parameters[leaf] = tensor  # type: ignore[assignment]
            swapped.append((owner, leaf, current))
    try:
        yield
    finally:
        for owner, leaf, current in reversed(swapped):
            owner._parameters[leaf] = current


def _functional_checkpoint(layer: torch.nn.Module) -> Callable[..., Any]:
    """A checkpointing function for ``layer`` that stays correct under ``functional_call``.

    transformers' default recomputes with the module's own parameters, not the substituted θ
    (silently wrong gradients); this one substitutes the trained parameters the forward saw again.
    Frozen weights are left alone: FSDP2 gathers them for the recomputation itself.
    """
    from torch.utils.checkpoint import checkpoint

    trained = {name for name, p in layer.named_parameters() if p.requires_grad}

    def run(forward: Callable[..., Any], *args: Any) -> Any:
        seen = {name: p for name, p in layer.named_parameters() if name in trained}

        def replay(*inputs: Any) -> Any:
            with _parameters_set(layer, seen):
                return forward(*inputs)

        return checkpoint(replay, *args, use_reentrant=False)

    run.substitutes_theta = True  # type: ignore[attr-defined]  # what FunctionalLM.refresh_checkpointing looks for
    return run


def _install_functional_checkpointing(decoder: torch.nn.Module) -> list[torch.nn.Module]:
    """Give every checkpointed layer of ``decoder`` :func:`_functional_checkpoint`; return them."""
    layers = [m for m in decoder.modules() if getattr(m, "gradient_checkpointing", False) and m is not decoder]
    for layer in layers:
        layer._gradient_checkpointing_func = _functional_checkpoint(layer)
    return layers
